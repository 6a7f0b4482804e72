"""How an executor sums over agents held elsewhere (evaluation only).

:class:`Reducer` is the in-process answer (every agent is here: sums are
the values themselves); the runtime's :class:`cdsgd.runtime.DistReducer`
all-reduces across ranks. Its traffic is counted apart from the training
traffic the Mixer counts.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["Reducer"]


class Reducer:
    """Sums over agents held elsewhere: identity here; the runtime's reduce across ranks.

    Evaluation (and only evaluation) uses it, so its traffic is counted apart
    from the training traffic the Mixer counts (``bytes``).
    """

    bytes = 0.0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over processes of ``t`` (here: ``t``)."""
        return t

    def agent_values(self, local: torch.Tensor) -> torch.Tensor:
        """Per-agent figures (an L×k block per process) as the N×k stack in agent order (here: ``local``)."""
        return local

    def sum_in_order(self, acc: torch.Tensor, add: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """``add(acc)`` adds this process's agents to the running sum in place; processes add in agent order."""
        add(acc)
        return acc

    def barrier(self, what: str) -> None:
        """Return once every process holding agents has called it (here: at once); not counted as traffic."""

    def gather(self, X: torch.Tensor) -> torch.Tensor | None:
        """All agents' rows as one N×P stack on the first process, None on the others (here: a copy of X)."""
        return X.clone()
