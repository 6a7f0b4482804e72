"""``torch.optim`` classes for a user's own training loop: :class:`CDSGD` and :class:`CDMSGD`.

One instance per agent (e.g. per torchrun rank), taking a Mixer that
exchanges that agent's flat P-vector with its neighbours (the runtime's
:class:`cdsgd.runtime.NeighbourMixer`). The arithmetic is the functional core
of :mod:`cdsgd.algorithms.rules`, so these classes and the executors update
parameters identically. See docs/distributed.md for a complete loop.

Example (an agent alone: Π = [1], so a step is plain SGD)::

    >>> import torch
    >>> class Alone(Mixer):   # Σ_l π_jl x_l = x_j
    ...     n_agents, rows, bytes_sent = 1, [0], torch.zeros(1)
    ...     def start(self, x): return Handle(x.clone())
    ...     def average(self, x, mask=None): return x
    >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    >>> opt = CDSGD([w], Alone(), lr=0.5)
    >>> w.grad = torch.tensor([1.0, 1.0]); _ = opt.step(); w.tolist()
    [0.5, 1.5]
"""

from __future__ import annotations

from typing import Callable

import torch

from ..checks import check_lr, check_momentum, check_weight_decay
from ..flat import flatten, unflatten
from ..mixing import Handle, Mixer
from .rules import cdsgd_update, momentum_update, with_weight_decay

__all__ = ["CDMSGD", "CDSGD"]



class _ConsensusOptimizer(torch.optim.Optimizer):
    """Shared machinery of :class:`CDSGD` and :class:`CDMSGD`.

    All parameters (of all groups) are flattened into one preallocated
    buffer and exchanged together. :meth:`post` starts the exchange of the
    current parameters (call it before the backward pass to overlap
    communication with computation); :meth:`step` waits for it (posting it
    first if needed) and applies the update with each group's hyperparameters.
    """

    def __init__(self, params, defaults: dict, mixer: Mixer) -> None:
        if not isinstance(mixer, Mixer):
            raise ValueError(f"mixer must be a cdsgd.mixing.Mixer, got {type(mixer).__name__}")
        super().__init__(params, defaults)
        self.mixer = mixer
        self._handle: Handle | None = None
        params = self._params()
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        first = params[0]
        self._flat = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def post(self) -> None:
        """Start exchanging the current parameters with the neighbours."""
        flatten(self._params(), out=self._flat)
        self._handle = self.mixer.start(self._flat)

    def _update(self, p: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """Write the new value of parameter ``p`` into it."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._handle is None:
            self.post()
        mixed_flat, self._handle = self._handle.wait(), None
        views = iter(unflatten(mixed_flat, [p.shape for p in self._params()]))
        for group in self.param_groups:
            for p in group["params"]:
                mixed = next(views)
                g = torch.zeros_like(p) if p.grad is None else p.grad
                g = with_weight_decay(g, p, group["weight_decay"])
                self._update(p, mixed, g, group)
        return loss


class CDSGD(_ConsensusOptimizer):
    r"""Consensus-based distributed SGD for one agent: x ← Σ_l π_jl x_l − α g(x).

    Args:
        params: the agent's parameters (or parameter groups).
        mixer: a Mixer whose ``start(x)`` exchanges this agent's flat
            P-vector with its neighbours (e.g. the runtime's neighbour mixer).
        lr: step size α (> 0), keyword-only like every tunable.
        weight_decay: L2 coefficient λ (g ← g + λx), >= 0.

    Use ``opt.post()`` before the backward pass to overlap the exchange,
    then ``opt.step()``; or just ``opt.step()``.
    """

    def __init__(self, params, mixer: Mixer, *, lr: float, weight_decay: float = 0.0) -> None:
        defaults = {"lr": check_lr(lr), "weight_decay": check_weight_decay(weight_decay)}
        super().__init__(params, defaults, mixer)

    def _update(self, p, mixed, g, group):
        cdsgd_update(mixed, g, group["lr"], out=p)


class CDMSGD(_ConsensusOptimizer):
    r"""CDSGD with a local momentum buffer (never mixed), for one agent.

    m ← μ m − α g;  x ← Σ_l π_jl x_l + μ m − α g (``nesterov=True``, the
    paper's form) or x ← Σ_l π_jl x_l + m (heavy ball). The buffer is kept in
    ``self.state[p]["momentum_buffer"]``.

    Args:
        params, mixer: as for :class:`CDSGD`.
        lr: α > 0. momentum: μ in [0, 1) (default 0.95, the paper's).
        nesterov: Nesterov form (default) or heavy ball. weight_decay: λ >= 0.
    """

    def __init__(self, params, mixer: Mixer, *, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0) -> None:
        if not isinstance(nesterov, bool):
            raise ValueError(f"nesterov must be true or false, got {nesterov!r}")
        defaults = {"lr": check_lr(lr), "momentum": check_momentum(momentum), "nesterov": nesterov,
                    "weight_decay": check_weight_decay(weight_decay)}
        super().__init__(params, defaults, mixer)

    def _update(self, p, mixed, g, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum_update(mixed, g, state["momentum_buffer"], group["lr"], group["momentum"], group["nesterov"], out=p)
