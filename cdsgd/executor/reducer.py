"""How an executor sums over agents held elsewhere (evaluation only).

:class:`Reducer` is the in-process answer (every agent is here: sums are
the values themselves); the runtime's :class:`cdsgd.runtime.DistReducer`
all-reduces across ranks. Its traffic is counted apart from the training
traffic the Mixer counts.
"""

from __future__ import annotations

import torch

__all__ = ["Reducer"]


class Reducer:
    """Sums over agents held elsewhere: identity here; the runtime's all-reduces across ranks.

    Evaluation (and only evaluation) uses it, so its traffic is counted apart
    from the training traffic the Mixer counts (``bytes``).
    """

    bytes = 0.0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self, what: str) -> None:
        """Return once every process holding agents has called it (here: at once); not counted as traffic."""

    def gather(self, X: torch.Tensor) -> torch.Tensor:
        """All agents' rows as one N×P stack (here: the stack itself)."""
        return X.clone()
