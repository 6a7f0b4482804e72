r"""The update rules: CDSGD, CDMSGD and the baselines, written once.

Notation: agent j holds flat parameters x_j, its stochastic gradient is
g_j = ∇f_j(x_j) (+ λ·x_j with weight decay λ), Π is the mixing matrix, α_k the
step size at step k, μ the momentum. Stacked over agents, X is N×P; one rank
of the distributed runtime holds just its P-vector. The rules below are
element-wise apart from the mixing, so the same code serves both: only the
:class:`~cdsgd.mixers.Mixer` differs.

``cdsgd``   x_j ← Σ_l π_jl x_l − α g_j(x_j)
            (the gradient at the agent's own pre-mixing parameters;
            parameters are mixed, not gradients)
``cdmsgd``  m_j ← μ m_j − α g_j(x_j)
            x_j ← Σ_l π_jl x_l + μ m_j − α g_j(x_j)      (Nesterov, default)
            x_j ← Σ_l π_jl x_l + m_j                    (``nesterov=False``, heavy ball)
            m_j is local and never mixed.
``sgd``     x_j ← x_j − α ḡ,  ḡ = (1/N) Σ_l g_l        (centralized: one model
            trained on the union of the agents' batches)
``msgd``    the same with momentum on ḡ (Nesterov or heavy ball as above,
            with Σ_l π_jl x_l replaced by x_j)
``fedavg``  each agent runs ``local_steps`` SGD steps on its shard (or
            ``local_epochs`` epochs), then x_j ← mean of the participating
            agents' x (all agents by default; ``fedavg_fraction`` samples
            max(1, round(fraction·N)) agents per round; the others sit the
            round out and receive the average)
``local``   Π = I: x_j ← x_j − α g_j (momentum as in cdmsgd when μ > 0);
            no communication.

Step sizes: ``constant`` α_k = α₀, or ``diminishing``
α_k = α₀ / (1 + k/τ)^p with 0.5 < p ≤ 1, so that Σ_k α_k = ∞ and
Σ_k α_k² < ∞ (the condition under which CDSGD reaches exact consensus).

Two ways in:

* :func:`make_algorithm` (:mod:`.factory`) gives an :class:`Algorithm` whose ``update`` the
  executors (simulator, runtime) call on X;
* :class:`CDSGD` and :class:`CDMSGD` are ``torch.optim.Optimizer`` classes
  for a user's own training loop, one instance per agent, taking a Mixer that
  exchanges that agent's P-vector with its neighbours.

Example (two agents, one parameter each, zero gradients: one step is Π X)::

    >>> import torch
    >>> from cdsgd.mixers import MatrixMixer
    >>> from cdsgd.algorithms import make_algorithm
    >>> alg = make_algorithm("cdsgd", lr=0.1)
    >>> X = torch.tensor([[0.0], [1.0]]); G = torch.zeros(2, 1)
    >>> alg.update(X, G, alg.init_state(X), k=0, mixer=MatrixMixer([[0.75, 0.25], [0.25, 0.75]])).tolist()  # X, updated
    [[0.25], [0.75]]
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from topologies import TOL, Registry, validate

from ..base.checks import (FEDAVG_FRACTION, HYPER_DEFAULTS, LR_POWER, LR_SCHEDULES, LR_TAU, check_int, check_lr,
                           check_momentum, check_nesterov, check_weight_decay)
from ..base.flat import kept
from ..base.seeding import derive_seed
from ..mixers import Handle, Mixer, is_schedule, is_sparse

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "StepSize",
    "cdsgd_update",
    "momentum_update",
    "with_weight_decay",
]

# --------------------------------------------------------------------------
# the functional core: element-wise, in place where it can be


def with_weight_decay(G: torch.Tensor, X: torch.Tensor, weight_decay: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """g + λ·x (a new tensor, or ``out``; G itself is left alone). λ = 0 returns G."""
    if not weight_decay:
        return G
    return torch.add(G, X, alpha=weight_decay) if out is None else torch.add(G, X, alpha=weight_decay, out=out)


#: the element-wise updates below run over blocks of this many bytes when their tensors are larger, so
#: that the several passes of one update stay in a core's cache (the same numbers, far less memory traffic)
UPDATE_BLOCK_BYTES = 1 << 20


def _in_blocks(*tensors: torch.Tensor):
    """Matching element ranges of same-shaped contiguous tensors, about UPDATE_BLOCK_BYTES each.

    Yields the tensors themselves once when they are small or not all
    contiguous (then an update runs whole, as it would without blocks).
    """
    first = tensors[0]
    step = max(1, UPDATE_BLOCK_BYTES // first.element_size())
    if first.numel() <= step or not all(t.is_contiguous() and t.shape == first.shape for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, first.numel(), step):
        yield [f[start:start + step] for f in flat]


def cdsgd_update(mixed: torch.Tensor, G: torch.Tensor, lr: float, out: torch.Tensor) -> torch.Tensor:
    """out ← Σ_l π_jl x_l − α g, with ``mixed`` = Σ_l π_jl x_l. ``out`` may be ``mixed`` or x itself."""
    return torch.add(mixed, G, alpha=-lr, out=out)


def momentum_update(
    mixed: torch.Tensor,
    G: torch.Tensor,
    buf: torch.Tensor,
    lr: float,
    momentum: float,
    nesterov: bool,
    out: torch.Tensor,
) -> torch.Tensor:
    """m ← μ m − α g (``buf`` in place); out ← mixed + μ m − α g (Nesterov) or mixed + m.

    Large tensors are updated block by block (:data:`UPDATE_BLOCK_BYTES`):
    the four passes of a block run while it is in cache.
    """
    for mixed_b, G_b, buf_b, out_b in _in_blocks(mixed, G, buf, out):
        buf_b.mul_(momentum).add_(G_b, alpha=-lr)
        if nesterov:
            torch.add(mixed_b, buf_b, alpha=momentum, out=out_b).add_(G_b, alpha=-lr)
        else:
            torch.add(mixed_b, buf_b, out=out_b)
    return out


# --------------------------------------------------------------------------
# step sizes


class StepSize:
    """α_k: ``constant`` (α₀) or ``diminishing`` (α₀ / (1 + k/τ)^p, 0.5 < p ≤ 1).

    >>> s = StepSize(0.1, "diminishing", tau=10, power=1.0)
    >>> [round(s(k), 4) for k in (0, 10, 30)]
    [0.1, 0.05, 0.025]
    """

    SCHEDULES = LR_SCHEDULES.names

    def __init__(self, lr: float, schedule: str = HYPER_DEFAULTS["lr_schedule"], *,
                 tau: float = HYPER_DEFAULTS["lr_tau"], power: float = HYPER_DEFAULTS["lr_power"]) -> None:
        self.lr = check_lr(lr)
        self.schedule = LR_SCHEDULES.check("lr_schedule", schedule)
        self.tau = float(LR_TAU.check("lr_tau", tau))
        self.power = float(LR_POWER.check("lr_power", power))

    def __call__(self, k: int) -> float:
        if self.schedule == "constant":
            return self.lr
        return self.lr / (1.0 + k / self.tau) ** self.power


# --------------------------------------------------------------------------
# the algorithms, as executors see them

ALGORITHMS: Registry[type["Algorithm"]] = Registry("algorithm")


class Algorithm:
    """One update rule with its hyperparameters.

    Executors call, once per run, ``state = init_state(X, mixer)`` (where
    the rule meets its mixer: :meth:`check_mixer` refuses a matrix the rule
    cannot run with), then per step k: ``mask = participants(k)``; compute G
    at X (rows outside ``mask`` may be skipped); ``update(X, G, state, k=k,
    mixer=mixer, mixed=...)``, which overwrites X with the new parameters
    (and returns it). When ``mixes_params`` is true the rule's exchanges
    depend only on what is known before the gradient (Π X, and for gradient
    tracking Π Y too): the executor calls ``start(X, state, mixer)`` before
    the backward pass and passes what it returns as ``mixed``; otherwise the
    rule calls the mixer itself (on gradients, on a half-step, or on
    parameters at the end of a FedAvg round).

    A rule writes :meth:`_step` (its arithmetic: G with weight decay, step
    k's mixer) and :meth:`_init_state`; :meth:`update` and :meth:`init_state`
    do what all rules share. Defaults: :data:`cdsgd.base.checks.HYPER_DEFAULTS`.

    ``vectors_per_step`` is how many P-vectors each agent sends to each
    neighbour per step (what ``bytes_sent_per_agent`` counts).
    """

    name: ClassVar[str]
    #: "neighbours" (point-to-point only), "allreduce" or "none"
    traffic: ClassVar[str]
    #: the rule mixes the pre-update parameters (Π X): the exchange can overlap the backward pass
    mixes_params: ClassVar[bool] = False
    #: all agents must start from the same parameters (one model: sgd, msgd, fedavg)
    same_init: ClassVar[bool] = False
    #: P-vectors each agent sends each neighbour per step (all-reduce rules: per all-reduce)
    vectors_per_step: ClassVar[int] = 1
    #: the rule takes a column-stochastic (push-sum) mixing matrix instead of a doubly stochastic one (sgp)
    column_stochastic: ClassVar[bool] = False
    #: what a receiver does with a lost message (a simulated network's ``drop``/``link_failure``,
    #: :mod:`cdsgd.network.lossy`): "own" (its weight added to the receiver's own), "lost" (push-sum: the
    #: mass never arrives), or None (the rule cannot lose messages and refuses such a network)
    lost_message: ClassVar[str | None] = "own"
    #: the root of the rule's random streams (:meth:`bind` sets the run's; 0 until then)
    seed: int = 0

    def __init__(self, *, lr: float, lr_schedule: str = HYPER_DEFAULTS["lr_schedule"],
                 lr_tau: float = HYPER_DEFAULTS["lr_tau"], lr_power: float = HYPER_DEFAULTS["lr_power"],
                 weight_decay: float = HYPER_DEFAULTS["weight_decay"]) -> None:
        self.step_size = StepSize(lr, lr_schedule, tau=lr_tau, power=lr_power)
        self.weight_decay = check_weight_decay(weight_decay)

    def bind(self, *, n_agents: int, steps_per_epoch: int, seed: int) -> "Algorithm":
        """Tell the rule the system it runs in (FedAvg needs it). Returns self."""
        self.n_agents, self.steps_per_epoch, self.seed = n_agents, steps_per_epoch, seed
        return self

    def expect_losses(self) -> None:
        """The run's simulated network loses messages (``drop``, ``link_failure``): a rule whose paper handles
        losses differently from lossless running switches to that handling here (RelaySum); most rules have
        nothing to switch (the mixing itself changes: :attr:`lost_message`)."""

    def init_state(self, X: torch.Tensor, mixer: Mixer | None = None) -> dict:
        """The rule's per-agent state for the stack X (tensors only: checkpoints save them).

        ``mixer`` is the one the rule will mix with: rule and mixer meet here,
        once per run (executors and the ``torch.optim`` classes call it when
        built), so :meth:`check_mixer` runs here; it also sizes per-edge state
        (RelaySum's messages). Without a mixer nothing is checked.
        """
        if mixer is not None:
            self.check_mixer(mixer)
        return self._init_state(X, mixer)

    def _init_state(self, X: torch.Tensor, mixer: Mixer | None) -> dict:
        """The rule's own state (:meth:`init_state`, whose mixer has been checked)."""
        return {}

    def prepare(self, mixer, X: torch.Tensor) -> list[str]:
        """Work the rule does once before its first step (CHOCO's γ tuning); returns what to tell the user."""
        return []

    def summary(self) -> dict:
        """What the rule chose or built, for summary.json (e.g. ``consensus_step_used``)."""
        return {}

    def participants(self, k: int) -> torch.Tensor | None:
        """Boolean mask of the agents that compute a gradient at step k (None: all)."""
        return None

    def check_mixing(self, W) -> None:
        """Refuse a mixing matrix the rule cannot converge with (ValueError naming why).

        Default: a neighbour rule needs a doubly stochastic W (non-negative,
        every row and column summing to 1); a push-sum matrix
        (``mixing=push_sum``, columns only) is for ``sgp``. A schedule's steps
        were checked when it was built. Runs where a rule meets a mixer
        (:meth:`check_mixer`), however the mixer was made.
        """
        if self.traffic != "neighbours" or W is None or is_schedule(W):
            return
        sums = np.asarray((W if is_sparse(W) else np.asarray(W, dtype=np.float64)).sum(axis=1)).ravel()
        bad = np.flatnonzero(np.abs(sums - 1.0) > TOL)
        if len(bad):
            raise ValueError(f"algorithm {self.name!r} needs a doubly stochastic mixing matrix, but row {bad[0]} "
                             f"sums to {sums[bad[0]]:.6g}; a push-sum matrix (mixing=push_sum, columns summing "
                             "to 1) is for algorithm=sgp")
        try:
            validate(W, symmetric=False, connected=False)
        except ValueError as e:
            raise ValueError(f"algorithm {self.name!r} needs a doubly stochastic mixing matrix: {e}") from None

    def check_mixer(self, mixer: Mixer) -> Mixer:
        """Refuse a mixer whose matrix this rule cannot run with (:meth:`check_mixing`); returns the mixer.

        The matrix is ``mixer.matrix``, or for one step of a time-varying
        schedule the whole schedule's (``mixer.part_of.matrix``), however the
        mixer was built (``validate=False`` included). A mixer whose matrix is
        unknown (None: all-reduce, a user's own mixer) is taken on trust.
        :meth:`init_state` calls it. (Whether a mixer provides the interface
        at all is :func:`cdsgd.mixers.check_mixer`'s to say.)
        """
        matrix = (mixer.part_of or mixer).matrix
        if matrix is not None:
            self.check_mixing(matrix)
        return mixer

    def _scratch(self, X: torch.Tensor, name: str) -> torch.Tensor:
        """A buffer like X that this rule owns (a mixing's ``out=``): allocated once, reused every step."""
        return kept(self.__dict__.setdefault("_buffers", {}), name, X.shape, X)

    def start(self, X: torch.Tensor, state: dict, mixer: Mixer):
        """Post the exchanges of step k that need nothing but the pre-gradient state (``mixes_params``);
        ``mixer`` is step k's (``mixer.at(k)``)."""
        return mixer.start(X, out=self._scratch(X, "mixed"))

    def update(self, X: torch.Tensor, G: torch.Tensor, state: dict, *, k: int, mixer: Mixer | None,
               mixed: Handle | torch.Tensor | None = None) -> torch.Tensor:
        """Step k: X (overwritten and returned) from the gradients G at X and the rule's ``state``.

        What all rules share, then its :meth:`_step`: step k's mixer (``mixer.at(k)``:
        a whole :class:`~cdsgd.mixers.ScheduleMixer` mixes with W_k) and g + λ·x
        (G itself is left alone). ``mixed``: what :meth:`start` returned, if the
        exchange was posted before the backward pass. The matrix was checked
        where rule and mixer met (:meth:`init_state`), not here.
        """
        mixer = None if mixer is None else mixer.at(k)
        decayed = self._scratch(X, "decayed") if self.weight_decay else None
        G = with_weight_decay(G, X, self.weight_decay, out=decayed)
        return self._step(X, G, state, k=k, mixer=mixer, mixed=mixed)

    def _step(self, X: torch.Tensor, G: torch.Tensor, state: dict, *, k: int, mixer: Mixer | None,
              mixed: Handle | torch.Tensor | None) -> torch.Tensor:
        """The rule's arithmetic of step k (:meth:`update`): G has its weight decay, ``mixer`` is step k's."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.step_size.lr}, schedule={self.step_size.schedule!r})"

    def _mixed(self, X: torch.Tensor, mixer: Mixer, mixed) -> torch.Tensor:
        """Π X: from the handle :meth:`start` gave, else mixed now (into this rule's buffer)."""
        if mixed is None:
            return self.start(X, {}, mixer).wait()
        return mixed.wait() if isinstance(mixed, Handle) else mixed


def _direction(G: torch.Tensor, state: dict, momentum: float, nesterov: bool) -> torch.Tensor:
    """The local momentum direction d (``state["momentum"]`` in place): m ← μ m + g; d = g + μ m
    (Nesterov) or m (heavy ball); μ = 0: d = g. Returns d in ``state["direction"]`` (or G itself)."""
    if not momentum:
        return G
    m, d = state["momentum"], state["direction"]
    for G_b, m_b, d_b in _in_blocks(G, m, d):
        m_b.mul_(momentum).add_(G_b)
        if nesterov:
            torch.add(G_b, m_b, alpha=momentum, out=d_b)
        else:
            d_b.copy_(m_b)
    return d


class _MomentumMixin:
    """``momentum`` μ and ``nesterov`` (their defaults: HYPER_DEFAULTS), with a momentum buffer per agent."""

    def __init__(self, *, momentum: float = HYPER_DEFAULTS["momentum"], nesterov: bool = HYPER_DEFAULTS["nesterov"],
                 **common) -> None:
        super().__init__(**common)
        self.momentum = check_momentum(momentum)
        self.nesterov = check_nesterov(nesterov)

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"momentum": torch.zeros_like(X)}


@ALGORITHMS.register("cdsgd")
class CDSGDAlgorithm(Algorithm):
    name, traffic, mixes_params = "cdsgd", "neighbours", True

    def _step(self, X, G, state, *, k, mixer, mixed):
        return cdsgd_update(self._mixed(X, mixer, mixed), G, self.step_size(k), out=X)


@ALGORITHMS.register("cdmsgd")
class CDMSGDAlgorithm(_MomentumMixin, Algorithm):
    name, traffic, mixes_params = "cdmsgd", "neighbours", True

    def _step(self, X, G, state, *, k, mixer, mixed):
        return momentum_update(self._mixed(X, mixer, mixed), G, state["momentum"], self.step_size(k),
                               self.momentum, self.nesterov, out=X)


@ALGORITHMS.register("sgd")
class SGDAlgorithm(Algorithm):
    name, traffic, same_init = "sgd", "allreduce", True

    def _step(self, X, G, state, *, k, mixer, mixed):
        G = mixer.average(G, out=self._scratch(X, "average"))
        return cdsgd_update(X, G, self.step_size(k), out=X)


@ALGORITHMS.register("msgd")
class MSGDAlgorithm(_MomentumMixin, Algorithm):
    name, traffic, same_init = "msgd", "allreduce", True

    def _step(self, X, G, state, *, k, mixer, mixed):
        G = mixer.average(G, out=self._scratch(X, "average"))
        return momentum_update(X, G, state["momentum"], self.step_size(k), self.momentum, self.nesterov, out=X)


@ALGORITHMS.register("fedavg")
class FedAvgAlgorithm(Algorithm):
    name, traffic, same_init = "fedavg", "allreduce", True

    def __init__(self, *, local_steps: int | None = HYPER_DEFAULTS["local_steps"], local_epochs: int | None = None,
                 fedavg_fraction: float = HYPER_DEFAULTS["fedavg_fraction"], **common) -> None:
        super().__init__(**common)
        if local_steps is not None and local_epochs is not None:
            raise ValueError(f"give local_steps or local_epochs, not both (got {local_steps} and {local_epochs})")
        self.local_steps = None if local_steps is None else check_int("local_steps", local_steps, 1)
        self.local_epochs = None if local_epochs is None else check_int("local_epochs", local_epochs, 1)
        if self.local_steps is None and self.local_epochs is None:  # local_epochs None: "not given", so that
            self.local_epochs = HYPER_DEFAULTS["local_epochs"]  # giving both is refused above
        self.fraction = float(FEDAVG_FRACTION.check("fedavg_fraction", fedavg_fraction))
        self._round_mask: tuple[int | None, torch.Tensor | None] = (None, None)  # (round, participants)

    @property
    def round_length(self) -> int:
        return self.local_steps if self.local_steps is not None else self.local_epochs * self.steps_per_epoch

    def participants(self, k: int) -> torch.Tensor | None:
        if self.fraction == 1.0:
            return None
        r = k // self.round_length
        if self._round_mask[0] != r:  # drawn once per round, asked for by the executor and by update
            g = torch.Generator().manual_seed(derive_seed(self.seed, "fedavg", r))
            m = max(1, round(self.fraction * self.n_agents))
            mask = torch.zeros(self.n_agents, dtype=torch.bool)
            mask[torch.randperm(self.n_agents, generator=g)[:m]] = True
            self._round_mask = (r, mask)
        return self._round_mask[1]

    def _step(self, X, G, state, *, k, mixer, mixed):
        mask = self.participants(k)
        if mask is None:
            cdsgd_update(X, G, self.step_size(k), out=X)
        else:  # agents sitting the round out keep their parameters
            X.copy_(torch.where(_rows(mask[mixer.agents], X), X - self.step_size(k) * G, X))
        if (k + 1) % self.round_length == 0:
            X.copy_(mixer.average(X, mask, out=self._scratch(X, "average")))
        return X


def _rows(mask: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A mask over the stack's rows, broadcastable over the L×P stack."""
    return mask.view(-1, *([1] * (X.dim() - 1)))


@ALGORITHMS.register("local")
class LocalAlgorithm(_MomentumMixin, Algorithm):
    name, traffic = "local", "none"

    def _step(self, X, G, state, *, k, mixer, mixed):
        if self.momentum:
            return momentum_update(X, G, state["momentum"], self.step_size(k), self.momentum, self.nesterov, out=X)
        return cdsgd_update(X, G, self.step_size(k), out=X)
