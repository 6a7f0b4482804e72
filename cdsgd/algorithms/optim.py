"""``torch.optim`` classes for a user's own training loop: :class:`CDSGD`, :class:`CDMSGD`, and
:class:`DecentralizedOptimizer` for any neighbour rule (``dsgt``, ``d2``, ``qg_dsgdm``, ...).

One instance per agent (e.g. per torchrun rank), taking a Mixer that
exchanges that agent's flat P-vector with its neighbours (the runtime's
:class:`cdsgd.runtime.NeighbourMixer`). The arithmetic is the functional core
of :mod:`cdsgd.algorithms.rules`, so these classes and the executors update
parameters identically. See docs/distributed.md for a complete loop.

As with any ``torch.optim`` optimizer, ``lr`` (and ``momentum`` where the
rule has one) live in ``param_groups``, so ``torch.optim.lr_scheduler``
works, and :meth:`~torch.optim.Optimizer.add_param_group` adds parameters
mid-run. All parameters of all groups are exchanged as one flat vector (one
dtype and device), so **every agent must add the same groups** (parameters
of the same shapes, in the same order, before the same step): otherwise the
agents' vectors no longer pair up (a size mismatch, or a wrong sum).

A mixer's matrix (``mixer.matrix``, when it has one) is checked against the
rule when the optimizer is built (:meth:`Algorithm.check_mixing
<cdsgd.algorithms.Algorithm.check_mixing>`: a doubly stochastic W for
``cdsgd``, D²'s eigenvalue condition, a push-sum P for ``sgp``, ...).

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
    >>> opt = DecentralizedOptimizer([w], Alone(), "dsgt", lr=0.5, momentum=0.0)  # gradient tracking alone: SGD
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> for _ in range(2):
    ...     _ = opt.step(); sched.step()
    >>> w.tolist()   # steps of 0.5, then 0.25
    [-0.25, 0.75]
"""

from __future__ import annotations

from typing import Callable

import torch

from ..base.checks import (BETAS, EPS, HYPER_DEFAULTS, OPTIMIZERS, SCHEDULED_LR, check_lr, check_momentum,
                           check_nesterov, check_weight_decay)
from ..base.flat import flatten, unflatten
from ..mixers import Mixer, check_mixer
from .factory import algorithm_params, make_algorithm
from .local_optim import adamw_direction
from .rules import Algorithm, cdsgd_update, momentum_update, with_weight_decay

__all__ = ["CDMSGD", "CDSGD", "DecentralizedOptimizer"]


def _closure_loss(closure: Callable[[], torch.Tensor] | None):
    """torch.optim's convention: ``step(closure)`` re-evaluates the loss (with gradients on) and returns it."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local_defaults(optimizer: str, betas, eps: float) -> dict:
    """The local optimizer's entries of a group: ``optimizer``, ``betas`` (a tuple), ``eps``, checked."""
    return {"optimizer": OPTIMIZERS.check("optimizer", optimizer), "betas": BETAS.check("betas", betas),
            "eps": float(EPS.check("eps", eps))}


class _FlatOptimizer(torch.optim.Optimizer):
    """What every optimizer here shares: the parameters of all groups, exchanged as one flat vector.

    Subclasses size their buffers in :meth:`_resize` (called once built, and
    after every :meth:`add_param_group`) and check a group's hyperparameters
    in :meth:`_check_group`.
    """

    def __init__(self, params, defaults: dict, mixer: Mixer) -> None:
        check_mixer(mixer)
        self.mixer = mixer
        self._handle = None
        self._built = False
        super().__init__(params, defaults)  # calls add_param_group for each group
        if not self._params():
            raise ValueError("optimizer got an empty parameter list")

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _check_group(self, group: dict) -> None:
        """Refuse a group's hyperparameters (ValueError); the group is already in ``param_groups``."""

    def _resize(self) -> None:
        """(Re)size the flat buffers to the parameters of all groups."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, as ``torch.optim.Optimizer.add_param_group``; the exchanged vector grows.

        Every agent must add the same group (same shapes, same order) before
        the same step, and not between :meth:`post` and ``step``. The new
        parameters start the rule afresh (zero momentum; a tracker or a
        previous iterate as at step 0), from their current values.
        """
        if getattr(self, "_handle", None) is not None:
            raise RuntimeError("add_param_group between post() and step(): an exchange of the old parameters is "
                               "in flight; add the group after step()")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            first = self.param_groups[0]["params"][:1] or group["params"][:1]
            for p in group["params"]:
                if first and (p.dtype != first[0].dtype or p.device != first[0].device):
                    raise ValueError(f"all parameters are exchanged as one flat vector and must share one dtype and "
                                     f"device: {first[0].dtype} on {first[0].device}, got {p.dtype} on {p.device}")
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        if self._built:
            self._resize()


class _ConsensusOptimizer(_FlatOptimizer):
    """Shared machinery of :class:`CDSGD` and :class:`CDMSGD`.

    All parameters (of all groups) are flattened into one preallocated
    buffer and exchanged together. :meth:`post` starts the exchange of the
    current parameters (call it before the backward pass to overlap
    communication with computation); :meth:`step` waits for it (posting it
    first if needed) and applies the update with each group's hyperparameters.
    """

    #: the rule of :func:`make_algorithm` whose ``check_mixing`` the mixer's matrix must pass
    rule: str

    def __init__(self, params, defaults: dict, mixer: Mixer) -> None:
        super().__init__(params, defaults, mixer)
        make_algorithm(self.rule, lr=defaults["lr"]).check_mixer(mixer)  # its check_mixing on mixer.matrix
        self._built = True
        self._resize()

    def _check_group(self, group: dict) -> None:
        check_lr(group["lr"])
        check_weight_decay(group["weight_decay"])
        OPTIMIZERS.check("optimizer", group["optimizer"])
        BETAS.check("betas", group["betas"])
        EPS.check("eps", group["eps"])

    def _resize(self) -> None:
        params = self._params()
        self._flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self._mixed = torch.empty_like(self._flat)

    @torch.no_grad()
    def post(self) -> None:
        """Start exchanging the current parameters with the neighbours."""
        flatten(self._params(), out=self._flat)
        self._handle = self.mixer.start(self._flat, out=self._mixed)

    def _update(self, p: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """Write the new value of parameter ``p`` into it (g: its gradient, with the L2 term under ``sgd``)."""
        raise NotImplementedError

    def _adamw(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> torch.Tensor:
        """AdamW's direction m̂/(√v̂ + ε) + λp for parameter ``p`` (a new tensor), its moments and step count
        in ``self.state[p]`` (``exp_avg``, ``exp_avg_sq``, ``step``, as ``torch.optim.AdamW`` names them)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                         step=torch.zeros((), dtype=torch.float64, device=p.device))
        return adamw_direction(g, p, state["exp_avg"], state["exp_avg_sq"], state["step"],
                               betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"],
                               out=torch.empty_like(p))

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
                if group["optimizer"] != "adamw":  # sgd (auto: sgd here); adamw: decoupled, in its direction
                    g = with_weight_decay(g, p, group["weight_decay"])
                self._update(p, mixed, g, group)
        return loss


class CDSGD(_ConsensusOptimizer):
    r"""Consensus-based distributed SGD for one agent: x ← Σ_l π_jl x_l − α g(x).

    Args:
        params: the agent's parameters (or parameter groups, each with its own
            ``lr`` and ``weight_decay``).
        mixer: a Mixer whose ``start(x)`` exchanges this agent's flat
            P-vector with its neighbours (e.g. the runtime's neighbour mixer);
            its matrix, if it has one, must be doubly stochastic.
        lr: step size α (> 0), keyword-only like every tunable.
        weight_decay: λ >= 0: the L2 term (g ← g + λx) under ``optimizer="sgd"``, decoupled under ``"adamw"``.
        optimizer: ``"sgd"`` (the default) or ``"adamw"``: x ← Σ_l π_jl x_l − α (m̂/(√v̂ + ε) + λx), the
            moments in ``self.state[p]`` (``exp_avg``, ``exp_avg_sq``, ``step``); alone (Π = [1]) it is
            ``torch.optim.AdamW`` (:mod:`cdsgd.algorithms.local_optim`).
        betas, eps: AdamW's (β1, β2), each in [0, 1), and ε > 0 (used under ``"adamw"``).

    Use ``opt.post()`` before the backward pass to overlap the exchange,
    then ``opt.step()``; or just ``opt.step()``. ``lr`` in ``param_groups``
    follows ``torch.optim.lr_scheduler``; ``add_param_group`` grows the
    exchanged vector (every agent must add the same groups: module docstring).
    """

    rule = "cdsgd"

    def __init__(self, params, mixer: Mixer, *, lr: float, weight_decay: float = HYPER_DEFAULTS["weight_decay"],
                 optimizer: str = HYPER_DEFAULTS["optimizer"], betas=HYPER_DEFAULTS["betas"],
                 eps: float = HYPER_DEFAULTS["eps"]) -> None:
        defaults = {"lr": check_lr(lr), "weight_decay": check_weight_decay(weight_decay),
                    **_local_defaults(optimizer, betas, eps)}
        super().__init__(params, defaults, mixer)

    def _update(self, p, mixed, g, group):
        d = self._adamw(p, g, group) if group["optimizer"] == "adamw" else g
        cdsgd_update(mixed, d, group["lr"], out=p)


class CDMSGD(_ConsensusOptimizer):
    r"""CDSGD with a local momentum buffer (never mixed), for one agent.

    m ← μ m − α g;  x ← Σ_l π_jl x_l + μ m − α g (``nesterov=True``, the
    paper's form) or x ← Σ_l π_jl x_l + m (heavy ball). The buffer is kept in
    ``self.state[p]["momentum_buffer"]``.

    Args:
        params, mixer: as for :class:`CDSGD`.
        lr: α > 0. momentum: μ in [0, 1) (default 0.95, the paper's: ``HYPER_DEFAULTS``).
        nesterov: Nesterov form (default) or heavy ball. weight_decay: λ >= 0.
        optimizer, betas, eps: as :class:`CDSGD`'s; under ``"adamw"`` CDMSGD is CDSGD with AdamW (Adam's
        β1 moment is the momentum: ``momentum`` and ``nesterov`` are not used, no momentum buffer is kept).
        Each may differ per parameter group; ``lr`` and ``momentum`` follow
        ``torch.optim.lr_scheduler`` (``OneCycleLR`` cycles the momentum too).
    """

    rule = "cdmsgd"

    def __init__(self, params, mixer: Mixer, *, lr: float, momentum: float = HYPER_DEFAULTS["momentum"],
                 nesterov: bool = HYPER_DEFAULTS["nesterov"], weight_decay: float = HYPER_DEFAULTS["weight_decay"],
                 optimizer: str = HYPER_DEFAULTS["optimizer"], betas=HYPER_DEFAULTS["betas"],
                 eps: float = HYPER_DEFAULTS["eps"]) -> None:
        defaults = {"lr": check_lr(lr), "momentum": check_momentum(momentum), "nesterov": check_nesterov(nesterov),
                    "weight_decay": check_weight_decay(weight_decay), **_local_defaults(optimizer, betas, eps)}
        super().__init__(params, defaults, mixer)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_momentum(group["momentum"])
        check_nesterov(group["nesterov"])

    def _update(self, p, mixed, g, group):
        if group["optimizer"] == "adamw":  # CDSGD's step along AdamW's direction
            cdsgd_update(mixed, self._adamw(p, g, group), group["lr"], out=p)
            return
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum_update(mixed, g, state["momentum_buffer"], group["lr"], group["momentum"], group["nesterov"], out=p)


class DecentralizedOptimizer(_FlatOptimizer):
    r"""Any neighbour update rule of :func:`make_algorithm` as a ``torch.optim`` optimizer for one agent.

    The rule is the executors' own (:mod:`cdsgd.algorithms.rules`,
    :mod:`cdsgd.algorithms.heterogeneous`, :mod:`cdsgd.algorithms.pushsum`):
    the agent's parameters are flattened into one 1×P row, the rule updates
    it with its state (tracker, previous iterate, momentum, push-sum weight)
    and the Mixer, and the result is written back into the parameters.

    **Hyperparameters.** ``lr``, and ``momentum`` for rules that have one,
    live in ``param_groups`` as with any torch optimizer (``torch.optim.
    lr_scheduler`` changes them; ``OneCycleLR``/``CyclicLR`` cycle the
    momentum too): each step uses the groups' current values. The rule
    updates one flat vector with one step size, so all groups must hold the
    same ``lr`` and ``momentum`` (a group that differs is refused). The
    rule's own step-size schedule still applies on top, with the group's
    lr as α₀ (:class:`~cdsgd.algorithms.StepSize`): the step at k is lr for
    ``lr_schedule="constant"`` (the default; keep it when a torch scheduler
    drives lr), lr·(1 + k/τ)^−p for ``"diminishing"``, and so on; a
    ``"cosine"`` needs ``lr_decay_steps`` here (no run's total steps to decay
    over: refused without). A rule built with ``momentum=0`` keeps no momentum
    buffer, so a group ``momentum`` > 0 is then refused at ``step``; under
    ``optimizer="adamw"`` groups hold no ``momentum`` (Adam's β1 moment is
    the momentum). The other hyperparameters (``weight_decay``, ``optimizer``,
    ``lr_schedule``, ...) belong to the rule, set when it is built; AdamW's
    moments are in its state (``opt.rule_state``, so in ``state_dict()``).

    Args:
        params: the agent's parameters (or parameter groups: see above).
        mixer: a Mixer for this agent (e.g. ``cdsgd.runtime.NeighbourMixer``):
            it provides ``n_agents``, ``agents``, ``bytes_sent`` and
            ``start``/``average`` taking ``out=`` (:func:`cdsgd.mixers.check_mixer`
            refuses one that does not, naming what is missing). Its matrix,
            if it has one, is checked against the rule here (D²'s eigenvalue
            condition, a doubly stochastic W, a push-sum P for ``sgp``).
        algorithm: a name (``dsgt``, ``d2``, ``qg_dsgdm``, ``sgp``, ``cdsgd``,
            ``cdmsgd``) with ``**hyper``, or a ready :class:`Algorithm` (the
            optimizer then owns it: each step sets its ``step_size.lr`` and
            ``momentum`` from ``param_groups``).

    Call ``opt.post()`` before the backward pass to overlap the exchanges of
    rules that allow it (``cdsgd``, ``cdmsgd``, ``dsgt``), then ``opt.step()``.
    ``add_param_group`` grows the flat row and the rule's state (the new
    parameters start the rule afresh); every agent must add the same groups
    before the same step (module docstring). ``state_dict()`` holds the
    rule's state, k and the groups' hyperparameters, so a checkpointed loop
    resumes bit for bit. ``opt.rule_state`` is the rule's state; for ``sgp``,
    ``opt.algorithm.weights(opt.rule_state)`` is the agent's push-sum weight.

    Example (in a torchrun script)::

        opt = DecentralizedOptimizer(model.parameters(), NeighbourMixer(W, rank), "dsgt", lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
        for x, y in batches:
            opt.post(); opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step(); sched.step()
    """

    def __init__(self, params, mixer: Mixer, algorithm: str | Algorithm = "dsgt", **hyper) -> None:
        if isinstance(algorithm, str):
            algorithm = make_algorithm(algorithm, **hyper)
        elif hyper:
            raise ValueError(f"hyperparameters {sorted(hyper)} given with a ready Algorithm; set them on it")
        if algorithm.traffic != "neighbours":
            raise ValueError(f"algorithm {algorithm.name!r} is not a neighbour rule; DecentralizedOptimizer "
                             "takes cdsgd, cdmsgd, dsgt, d2, qg_dsgdm or sgp")
        self.algorithm = algorithm
        # the hyperparameters that live in param_groups (lr schedulers change them), and the rule's own
        adamw = getattr(algorithm, "adam", None) is not None  # adamw: no momentum (β1 is), none to tune
        self._tunable = ("lr", "momentum") if hasattr(algorithm, "momentum") and not adamw else ("lr",)
        try:
            self._rule_only = set(algorithm_params(algorithm.name)) - set(self._tunable)
        except ValueError:  # a rule of the user's own, not registered
            self._rule_only = set()
        defaults = {"lr": algorithm.step_size.lr}
        if "momentum" in self._tunable:
            defaults["momentum"] = algorithm.momentum
        super().__init__(params, defaults, mixer)
        self._X = flatten(self._params()).unsqueeze(0)
        self._G = torch.zeros_like(self._X)
        algorithm.bind(n_agents=mixer.n_agents, steps_per_epoch=1, seed=0)
        if algorithm.step_size.schedule == "cosine":  # a loop of the user's own: no run's total steps to decay over
            algorithm.step_size.horizon()
        self.rule_state = algorithm.init_state(self._X, mixer=mixer)  # the rule checks mixer.matrix here
        self.k = 0
        self._built = True

    def _check_group(self, group: dict) -> None:
        own = sorted(set(group) & self._rule_only)
        if own:
            raise ValueError(f"{', '.join(own)} belongs to the rule {self.algorithm.name!r}, not to a parameter "
                             f"group (set it when building the rule); groups hold {', '.join(self._tunable)}")
        check_lr(group["lr"])
        if "momentum" in group:
            check_momentum(group["momentum"])
        self._common_hyper()

    def _common_hyper(self) -> dict:
        """The groups' ``lr`` (and ``momentum``): one value each, shared by every group (ValueError otherwise)."""
        values = {}
        for key in self._tunable:
            seen = [g[key] for g in self.param_groups]
            if any(v != seen[0] for v in seen):
                raise ValueError(f"DecentralizedOptimizer updates the flat vector of all groups with one rule, so "
                                 f"every group must have the same {key}; got {seen}")
            values[key] = seen[0]
        SCHEDULED_LR.check("lr in param_groups", values["lr"])
        if "momentum" in values:
            values["momentum"] = check_momentum(values["momentum"])
        return values

    def _resize(self) -> None:
        """Grow the flat row and the rule's state to the parameters of all groups (new entries: the rule's start)."""
        X = flatten(self._params()).unsqueeze(0)
        fresh = self.algorithm.init_state(X, mixer=self.mixer)
        for name, old in self.rule_state.items():
            if fresh[name].shape != old.shape:  # a per-parameter row (not the push-sum weight)
                fresh[name][..., :old.shape[-1]].copy_(old)
                self.rule_state[name] = fresh[name]
        self._X, self._G = X, torch.zeros_like(X)

    @torch.no_grad()
    def post(self) -> None:
        """Start the exchanges that need only the current state (rules with ``mixes_params``)."""
        flatten(self._params(), out=self._X[0])
        if self.algorithm.mixes_params:
            self._handle = self.algorithm.start(self._X, self.rule_state, self.algorithm.step_mixer(self.mixer, self.k))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = _closure_loss(closure)
        hyper = self._common_hyper()
        if hyper.get("momentum", 0.0) > 0 and "momentum" not in self.rule_state:
            raise ValueError(f"param_groups ask for momentum {hyper['momentum']}, but rule "
                             f"{self.algorithm.name!r} was built with momentum 0 and keeps no momentum buffer; "
                             "build it with momentum > 0 to change momentum during the run")
        self.algorithm.step_size.lr = float(hyper["lr"])
        if "momentum" in hyper:
            self.algorithm.momentum = hyper["momentum"]
        params = self._params()
        if self._handle is None:
            self.post()
        flatten([torch.zeros_like(p) if p.grad is None else p.grad for p in params], out=self._G[0])
        handle, self._handle = self._handle, None
        self.algorithm.update(self._X, self._G, self.rule_state, k=self.k, mixer=self.algorithm.step_mixer(self.mixer, self.k), mixed=handle)
        for p, new in zip(params, unflatten(self._X[0], [p.shape for p in params])):
            p.copy_(new)
        self.k += 1
        return loss

    def state_dict(self) -> dict:
        return {"k": self.k, "algorithm": self.algorithm.name,
                "rule_state": {name: t.detach().clone() for name, t in self.rule_state.items()},
                "param_groups": [{key: v for key, v in g.items() if key != "params"} for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm.name:
            raise ValueError(f"optimizer state is of algorithm {state.get('algorithm')!r}, this optimizer runs "
                             f"{self.algorithm.name!r}")
        if sorted(state["rule_state"]) != sorted(self.rule_state):
            raise ValueError(f"optimizer state holds {sorted(state['rule_state'])}, this rule {sorted(self.rule_state)}")
        groups = state.get("param_groups")  # absent from the state of earlier releases: keep the current values
        if groups is not None and len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        for name, t in state["rule_state"].items():
            if t.shape != self.rule_state[name].shape:
                raise ValueError(f"optimizer state's {name} is {tuple(t.shape)}, this optimizer's "
                                 f"{tuple(self.rule_state[name].shape)} (add the same parameter groups first)")
        with torch.no_grad():
            for name, t in state["rule_state"].items():
                self.rule_state[name].copy_(t)
        for group, saved in zip(self.param_groups, groups or []):
            group.update({key: v for key, v in saved.items() if key != "params"})
        self.k = int(state["k"])
