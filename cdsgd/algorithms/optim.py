"""``torch.optim`` classes for a user's own training loop: :class:`CDSGD`, :class:`CDMSGD`, and
:class:`DecentralizedOptimizer` for any neighbour rule (``dsgt``, ``d2``, ``qg_dsgdm``, ...).

One instance per agent (e.g. per torchrun rank), taking a Mixer that
exchanges that agent's flat P-vector with its neighbours (the runtime's
:class:`cdsgd.runtime.NeighbourMixer`). The arithmetic is the functional core
of :mod:`cdsgd.algorithms.rules`, so these classes and the executors update
parameters identically. See docs/distributed.md for a complete loop.

Example (an agent alone: Π = [1], so a step is plain SGD)::

    >>> import torch
    >>> from cdsgd.mixers import Handle, Mixer, result_tensor
    >>> class Alone(Mixer):   # one agent, no neighbours: Σ_l π_jl x_l = x_j
    ...     n_agents, agents = 1, [0]
    ...     def __init__(self): self.bytes_sent = torch.zeros(1, dtype=torch.float64)
    ...     def start(self, x, *, out=None): return Handle(result_tensor(x, out).copy_(x))
    ...     def average(self, x, mask=None, *, out=None): return result_tensor(x, out).copy_(x)
    >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    >>> opt = CDSGD([w], Alone(), lr=0.5)
    >>> w.grad = torch.tensor([1.0, 1.0]); _ = opt.step(); w.tolist()
    [0.5, 1.5]
"""

from __future__ import annotations

from typing import Callable

import torch

from ..base.checks import check_lr, check_momentum, check_weight_decay
from ..base.flat import flatten, unflatten
from ..mixers import Handle, Mixer, check_mixer
from .factory import make_algorithm
from .rules import Algorithm, cdsgd_update, momentum_update, with_weight_decay

__all__ = ["CDMSGD", "CDSGD", "DecentralizedOptimizer"]



def _closure_loss(closure: Callable[[], torch.Tensor] | None):
    """torch.optim's convention: ``step(closure)`` re-evaluates the loss (with gradients on) and returns it."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _ConsensusOptimizer(torch.optim.Optimizer):
    """Shared machinery of :class:`CDSGD` and :class:`CDMSGD`.

    All parameters (of all groups) are flattened into one preallocated
    buffer and exchanged together. :meth:`post` starts the exchange of the
    current parameters (call it before the backward pass to overlap
    communication with computation); :meth:`step` waits for it (posting it
    first if needed) and applies the update with each group's hyperparameters.
    """

    def __init__(self, params, defaults: dict, mixer: Mixer) -> None:
        check_mixer(mixer)
        super().__init__(params, defaults)
        self.mixer = mixer
        self._handle: Handle | None = None
        params = self._params()
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        first = params[0]
        self._flat = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self._mixed = torch.empty_like(self._flat)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def post(self) -> None:
        """Start exchanging the current parameters with the neighbours."""
        flatten(self._params(), out=self._flat)
        self._handle = self.mixer.start(self._flat, out=self._mixed)

    def _update(self, p: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """Write the new value of parameter ``p`` into it."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = _closure_loss(closure)
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


class DecentralizedOptimizer(torch.optim.Optimizer):
    r"""Any neighbour update rule of :func:`make_algorithm` as a ``torch.optim`` optimizer for one agent.

    The rule is the executors' own (:mod:`cdsgd.algorithms.rules`,
    :mod:`cdsgd.algorithms.heterogeneous`): the agent's parameters are
    flattened into one 1×P row, the rule updates it with its state
    (tracker, previous iterate, momentum) and the Mixer, and the result is
    written back into the parameters. Hyperparameters belong to the rule
    (``lr``, ``momentum``, ``lr_schedule``, ...), not to parameter groups; the
    step counter k drives the step-size schedule.

    Args:
        params: the agent's parameters.
        mixer: a Mixer for this agent (e.g. ``cdsgd.runtime.NeighbourMixer``);
            rules that exchange two vectors (``dsgt``) need one that supports
            ``slot`` (the runtime's and the simulator's mixers do).
        algorithm: a name (``dsgt``, ``d2``, ``qg_dsgdm``, ``cdsgd``,
            ``cdmsgd``) with ``**hyper``, or a ready :class:`Algorithm`.

    Call ``opt.post()`` before the backward pass to overlap the exchanges of
    rules that allow it (``cdsgd``, ``cdmsgd``, ``dsgt``), then ``opt.step()``.
    ``state_dict()`` holds the rule's state and k, so a checkpointed loop
    resumes bit for bit. D² checks its condition on W when you build the mixer
    yourself: call ``opt.algorithm.check_mixing(W)``.

    Example (in a torchrun script)::

        opt = DecentralizedOptimizer(model.parameters(), NeighbourMixer(W, rank), "dsgt", lr=0.05, momentum=0.9)
        for x, y in batches:
            opt.post(); opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    """

    def __init__(self, params, mixer: Mixer, algorithm: str | Algorithm = "dsgt", **hyper) -> None:
        check_mixer(mixer)
        if isinstance(algorithm, str):
            algorithm = make_algorithm(algorithm, **hyper)
        elif hyper:
            raise ValueError(f"hyperparameters {sorted(hyper)} given with a ready Algorithm; set them on it")
        if algorithm.traffic != "neighbours":
            raise ValueError(f"algorithm {algorithm.name!r} is not a neighbour rule; DecentralizedOptimizer "
                             "takes cdsgd, cdmsgd, dsgt, d2 or qg_dsgdm")
        super().__init__(params, {})
        self.mixer, self.algorithm = mixer, algorithm
        params = self._params()
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        self._X = flatten(params).unsqueeze(0)
        self._G = torch.zeros_like(self._X)
        algorithm.bind(n_agents=mixer.n_agents, steps_per_epoch=1, seed=0)
        self.rule_state = algorithm.init_state(self._X)
        self.k = 0
        self._handle = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def post(self) -> None:
        """Start the exchanges that need only the current state (rules with ``mixes_params``)."""
        flatten(self._params(), out=self._X[0])
        if self.algorithm.mixes_params:
            self._handle = self.algorithm.start(self._X, self.rule_state, self.mixer.at(self.k))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = _closure_loss(closure)
        params = self._params()
        if self._handle is None:
            self.post()
        flatten([torch.zeros_like(p) if p.grad is None else p.grad for p in params], out=self._G[0])
        handle, self._handle = self._handle, None
        self.algorithm.update(self._X, self._G, self.rule_state, k=self.k, mixer=self.mixer.at(self.k), mixed=handle)
        for p, new in zip(params, unflatten(self._X[0], [p.shape for p in params])):
            p.copy_(new)
        self.k += 1
        return loss

    def state_dict(self) -> dict:
        return {"k": self.k, "algorithm": self.algorithm.name,
                "rule_state": {name: t.detach().clone() for name, t in self.rule_state.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm.name:
            raise ValueError(f"optimizer state is of algorithm {state.get('algorithm')!r}, this optimizer runs "
                             f"{self.algorithm.name!r}")
        if sorted(state["rule_state"]) != sorted(self.rule_state):
            raise ValueError(f"optimizer state holds {sorted(state['rule_state'])}, this rule {sorted(self.rule_state)}")
        with torch.no_grad():
            for name, t in state["rule_state"].items():
                self.rule_state[name].copy_(t)
        self.k = int(state["k"])

