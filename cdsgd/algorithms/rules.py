r"""The update rules CDSGD and CDMSGD, the functional core and the :class:`Algorithm` every rule is.

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

The baselines (``sgd``, ``msgd``, ``fedavg``, ``local``) are in
:mod:`cdsgd.algorithms.baselines`; the step sizes α_k (``constant``,
``diminishing``, ``cosine``, ``step``, with a warm-up) in
:mod:`cdsgd.algorithms.step_sizes`.

**The local optimizer** (``optimizer``, :mod:`cdsgd.algorithms.local_optim`):
``"sgd"`` is the arithmetic above; ``"adamw"`` replaces g_j (+ λ x_j) by the
AdamW direction d_j = m̂_j/(√v̂_j + ε) + λ x_j of the agent's moments, so that
``cdsgd`` is x_j ← Σ_l π_jl x_l − α_k d_j (the decentralized Adam of Nazari,
Tarzanagh & Michailidis, "DADAM", IEEE TSP 2022, without its max on v̂), and
``cdmsgd`` is the same rule (Adam's β1 moment is its momentum: ``momentum``
and ``nesterov`` are not used). A rule whose ``takes_adamw`` is false refuses
``"adamw"``, naming the rules that take it.

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
    >>> make_algorithm("d2", lr=0.1, optimizer="adamw")
    Traceback (most recent call last):
    ...
    ValueError: algorithm 'd2' takes optimizer='sgd' only (no reference defines its form with Adam); optimizer='adamw' is for cdsgd, cdmsgd, sgd, msgd, fedavg, local, dsgt, diloco, noloco
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from topologies import TOL, Registry, validate

from ..base.checks import HYPER_DEFAULTS, check_int, check_momentum, check_nesterov, check_weight_decay
from ..base.flat import kept
from ..mixers import Handle, LocalStepMixer, Mixer, is_schedule, is_sparse
from .local_optim import local_optimizer
from .step_sizes import StepSize

__all__ = [
    "ALGORITHMS",
    "Algorithm",
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
# the algorithms, as executors see them

ALGORITHMS: Registry[type["Algorithm"]] = Registry("algorithm")
#: the rules whose own rounds of local steps are not periodic gossip (they average at a round's end)
LOCAL_STEP_RULES = ("fedavg", "diloco", "noloco")


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
    #: the rule takes ``optimizer="adamw"`` (docs/algorithms.md gives each one's form and its reference)
    takes_adamw: ClassVar[bool] = False
    #: what ``optimizer="auto"`` (the default) means for the rule
    default_optimizer: ClassVar[str] = "sgd"
    #: ``local_steps`` H > 1 is defined for the rule as periodic gossip: Π = I (no message) on every step but
    #: each H-th (Koloskova et al., ICML 2020); a rule with memory of earlier mixings refuses it
    periodic: ClassVar[bool] = False
    #: why a rule that is not ``periodic`` refuses local steps (its refusal says it)
    why_not_periodic: ClassVar[str] = "it communicates on every step"
    #: the rule goes on when agents leave and come back (churn, ``membership = "elastic"``): its state is per
    #: agent and it mixes with whatever W_k the online agents have (docs/reliability.md)
    elastic: ClassVar[bool] = True
    #: why a rule that is not ``elastic`` cannot (its refusal says it)
    why_not_elastic: ClassVar[str] = ""
    #: the root of the rule's random streams (:meth:`bind` sets the run's; 0 until then)
    seed: int = 0
    #: the model's parameter tensors' sizes in flat order (:meth:`bind`; None until then)
    tensor_sizes: list[int] | None = None

    def __init__(self, *, lr: float, lr_schedule: str = HYPER_DEFAULTS["lr_schedule"],
                 lr_tau: float = HYPER_DEFAULTS["lr_tau"], lr_power: float = HYPER_DEFAULTS["lr_power"],
                 lr_min: float = HYPER_DEFAULTS["lr_min"], lr_decay_steps: int | None = HYPER_DEFAULTS["lr_decay_steps"],
                 lr_step_size: int = HYPER_DEFAULTS["lr_step_size"], lr_gamma: float = HYPER_DEFAULTS["lr_gamma"],
                 lr_warmup: int = HYPER_DEFAULTS["lr_warmup"], weight_decay: float = HYPER_DEFAULTS["weight_decay"],
                 optimizer: str = HYPER_DEFAULTS["optimizer"], betas=HYPER_DEFAULTS["betas"],
                 eps: float = HYPER_DEFAULTS["eps"], local_steps: int | None = HYPER_DEFAULTS["local_steps"]) -> None:
        self.local_steps = 1 if local_steps is None else check_int("local_steps", local_steps, 1)
        if self.local_steps > 1 and not self.periodic:
            takers = ", ".join(n for n in ALGORITHMS if ALGORITHMS.get(n).periodic or n in LOCAL_STEP_RULES)
            raise ValueError(f"local_steps={self.local_steps}: algorithm {self.name!r} takes local_steps=1 only "
                             f"({self.why_not_periodic}); local steps are for {takers}")
        self.step_size = StepSize(lr, lr_schedule, tau=lr_tau, power=lr_power, lr_min=lr_min,
                                  decay_steps=lr_decay_steps, step_size=lr_step_size, gamma=lr_gamma, warmup=lr_warmup)
        self.weight_decay = check_weight_decay(weight_decay)
        if optimizer == "auto":
            optimizer = self.default_optimizer
        #: the local optimizer's transform: None for ``"sgd"``, an :class:`~.local_optim.AdamW` for ``"adamw"``
        self.adam = local_optimizer(optimizer, betas=betas, eps=eps)
        self.optimizer = optimizer
        if self.adam is not None and not self.takes_adamw:
            takers = ", ".join(n for n in ALGORITHMS if ALGORITHMS.get(n).takes_adamw)
            raise ValueError(f"algorithm {self.name!r} takes optimizer='sgd' only (no reference defines its form "
                             f"with Adam); optimizer='adamw' is for {takers}")

    def bind(self, *, n_agents: int, steps_per_epoch: int, seed: int, total_steps: int | None = None,
             tensor_sizes: list[int] | None = None) -> "Algorithm":
        """Tell the rule the system it runs in (FedAvg needs it) and, when known, the step at which the run
        ends (``total_steps``: a cosine step size's horizon unless ``lr_decay_steps`` is given) and the sizes
        of the model's parameter tensors in flat order (``tensor_sizes``: Streaming DiLoCo's fragments).
        Returns self."""
        self.n_agents, self.steps_per_epoch, self.seed = n_agents, steps_per_epoch, seed
        if tensor_sizes is not None:
            self.tensor_sizes = [int(s) for s in tensor_sizes]
        if total_steps is not None:
            self.step_size.total_steps = total_steps
        return self

    def check_elastic(self) -> None:
        """Refuse elastic membership (agents that leave and return) for a rule that cannot go on without an agent."""
        if not self.elastic:
            takers = ", ".join(n for n in ALGORITHMS if ALGORITHMS.get(n).elastic)
            raise ValueError(f"membership='elastic' (churn): algorithm {self.name!r} cannot go on when agents leave "
                             f"and return ({self.why_not_elastic}); elastic membership is for {takers}")

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
        state = self._init_state(X, mixer)
        return state if self.adam is None else {**state, **self.adam.init_state(X)}

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

    def communicates(self, k: int) -> bool:
        """Whether step k sends anything: every step, or with ``local_steps`` H every H-th ((k + 1) % H == 0)."""
        return (k + 1) % self.local_steps == 0

    def step_mixer(self, mixer: Mixer, k: int) -> Mixer:
        """The mixer of step k: W_k (``mixer.at(k)``), or, between the communications of periodic gossip
        (``local_steps`` > 1), Π = I: a :class:`~cdsgd.mixers.LocalStepMixer` that sends nothing."""
        mixer = mixer.at(k)
        if self.local_steps == 1 or not self.periodic or self.communicates(k):
            return mixer
        return mixer if isinstance(mixer, LocalStepMixer) else LocalStepMixer(mixer)

    def message_delay(self, k: int) -> int:
        """How many further steps the messages sent at step k may take to arrive (0: before step k + 1 starts;
        Streaming DiLoCo's overlapped fragments: ``overlap_steps``). The simulated clock waits for them then."""
        return 0

    def update(self, X: torch.Tensor, G: torch.Tensor, state: dict, *, k: int, mixer: Mixer | None,
               mixed: Handle | torch.Tensor | None = None) -> torch.Tensor:
        """Step k: X (overwritten and returned) from the gradients G at X and the rule's ``state``.

        What all rules share, then its :meth:`_step`: step k's mixer (``mixer.at(k)``:
        a whole :class:`~cdsgd.mixers.ScheduleMixer` mixes with W_k) and g + λ·x
        (G itself is left alone). ``mixed``: what :meth:`start` returned, if the
        exchange was posted before the backward pass. The matrix was checked
        where rule and mixer met (:meth:`init_state`), not here.
        """
        mixer = None if mixer is None else self.step_mixer(mixer, k)
        if self.adam is None:  # sgd: the L2 term in g; adamw: decoupled, in the direction (:meth:`_local`)
            decayed = self._scratch(X, "decayed") if self.weight_decay else None
            G = with_weight_decay(G, X, self.weight_decay, out=decayed)
        return self._step(X, G, state, k=k, mixer=mixer, mixed=mixed)

    def _step(self, X: torch.Tensor, G: torch.Tensor, state: dict, *, k: int, mixer: Mixer | None,
              mixed: Handle | torch.Tensor | None) -> torch.Tensor:
        """The rule's arithmetic of step k (:meth:`update`): G has its weight decay (under ``sgd``), ``mixer``
        is step k's."""
        raise NotImplementedError

    def _local(self, U: torch.Tensor, X: torch.Tensor, state: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The local optimizer's direction for the update U the rule would step along (G, ḡ, a tracker), at
        the pre-step X: U itself under ``sgd``; under ``adamw`` m̂/(√v̂ + ε) + λx (:mod:`.local_optim`), in a
        buffer of this rule's. ``rows``: the held agents that step (None: all)."""
        if self.adam is None:
            return U
        return self.adam.direction(U, X, state, weight_decay=self.weight_decay, out=self._scratch(X, "adam_direction"),
                                   rows=rows)

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
    """``momentum`` μ and ``nesterov`` (their defaults: HYPER_DEFAULTS), with a momentum buffer per agent
    (none under ``optimizer="adamw"``, whose β1 moment takes the momentum's place: μ and nesterov unused)."""

    def __init__(self, *, momentum: float = HYPER_DEFAULTS["momentum"], nesterov: bool = HYPER_DEFAULTS["nesterov"],
                 **common) -> None:
        super().__init__(**common)
        self.momentum = check_momentum(momentum)
        self.nesterov = check_nesterov(nesterov)

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"momentum": torch.zeros_like(X)} if self.adam is None else {}  # adamw: β1's moment is the momentum


@ALGORITHMS.register("cdsgd")
class CDSGDAlgorithm(Algorithm):
    name, traffic, mixes_params, takes_adamw, periodic = "cdsgd", "neighbours", True, True, True

    def _step(self, X, G, state, *, k, mixer, mixed):
        return cdsgd_update(self._mixed(X, mixer, mixed), self._local(G, X, state), self.step_size(k), out=X)


@ALGORITHMS.register("cdmsgd")
class CDMSGDAlgorithm(_MomentumMixin, Algorithm):
    name, traffic, mixes_params, takes_adamw, periodic = "cdmsgd", "neighbours", True, True, True

    def _step(self, X, G, state, *, k, mixer, mixed):
        mixed = self._mixed(X, mixer, mixed)
        if self.adam is not None:  # cdsgd's step along AdamW's direction
            return cdsgd_update(mixed, self._local(G, X, state), self.step_size(k), out=X)
        return momentum_update(mixed, G, state["momentum"], self.step_size(k), self.momentum, self.nesterov, out=X)
