r"""The executor: the agents a process holds, stacked; one step of the update rule on all of them.

All agents' flat parameters live in one N×P buffer ``X``, so the mixing of a
CDSGD step is one matrix product Π X. Each step is synchronous: every agent
computes its gradient at the same iterate, then the update rule of
:mod:`cdsgd.algorithms` is applied to the whole stack.

Independence of agents. Agent j has its own model instance (for buffers),
its own momentum rows, its own data order and its own random streams, all
seeded from (seed, j) by :func:`cdsgd.base.seeding.derive_seed`:

* ``init="same"`` (default): one model is built under seed (seed, "init")
  and copied to every agent; ``init="independent"``: agent j's model is built
  under (seed, j, "init"). Algorithms that stand for one model (sgd, msgd,
  fedavg) always start every agent from agent 0's parameters.
* data order: agent j draws batches from an endless concatenation of
  permutations of its shard, drawn by the generator (seed, j, "data"); every
  sample is seen once per pass and all batches are full.
* dropout: agent j's forward passes run on its own RNG state, seeded with
  (seed, j, "dropout"); the global RNG is left as it was.

So rank j of the distributed runtime can reproduce agent j step for step.

Epoch: ``steps_per_epoch = ceil(mean shard size / batch_size)`` synchronous
steps (all shards are equal with the ``iid`` partition).

One executor serves every layout: all N agents in this process (the
simulator), or a block of agents per rank (the runtime: ``agents=block``
with a :class:`cdsgd.runtime.BlockMixer` and a distributed Reducer; one
agent per rank is a block of one). Only the
Mixer and the Reducer differ; the update rule, the streams and the
bookkeeping are the same code. ``Simulator`` is this class's other name.

Gradients: :mod:`cdsgd.executor.gradients` (``loop`` or ``vmap``, chosen by
``strategy``). Metrics: :mod:`cdsgd.executor.evaluation`.

Example (3 agents on a path, step by step; every agent starts from the
same parameters, so after one step they differ only through their batches)::

    >>> import torch, topologies
    >>> from torch import nn
    >>> shards = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(3)]
    >>> W = topologies.mixing_matrix(topologies.build("path", 3))
    >>> ex = Executor(lambda: nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=4)
    >>> ex.X.shape, ex.strategy, ex.steps_per_epoch
    (torch.Size([3, 8]), 'vmap', 2)
    >>> _ = ex.step(); ex.k, ex.evaluate()["step"]
    (1, 1)
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..algorithms import Algorithm, make_algorithm
from ..algorithms.factory import UnknownHyperparameter
from ..base.checks import check_int
from ..base.compat import renamed_keyword
from ..base.seeding import derive_seed, generator
from . import evaluation
from . import state as checkpoint_state
from .agents import build_agents, held_mixer
from .gradients import STRATEGIES, make_strategy, nonfinite_rows
from .reducer import Reducer
from .streams import AgentRNG, BatchStream, check_shards, gather
from .timing import ClockFeed, charge_step

__all__ = ["INITS", "Diverged", "Executor", "SimulationResult", "Simulator", "simulate"]

#: how agents' initial parameters relate (``init=``)
INITS = ("same", "independent")


@dataclass
class SimulationResult:
    """What :func:`simulate` returns."""

    #: one dict per evaluation with the keys of METRIC_COLUMNS
    metrics: list[dict]
    #: final N×P parameters
    params: torch.Tensor
    simulator: "Executor" = field(repr=False)


class Diverged(ArithmeticError):
    """The run met a non-finite training loss or parameter: ``step`` (1-based), ``agent``, ``what``."""

    def __init__(self, step: int, agent: int, what: str) -> None:
        self.step, self.agent, self.what = int(step), int(agent), what
        super().__init__(f"the run diverged: agent {agent}'s {what} became non-finite at step {step}")


class Executor:
    """The agents held in this process (all N by default). See the module docstring for the semantics.

    Args:
        model_fn: builds one agent's ``nn.Module`` (called under a seeded RNG).
        shards: per-agent training data, a sequence of (inputs, targets) tensor pairs.
        W: the N×N mixing matrix (numpy, nested lists or scipy.sparse), a
            time-varying :class:`topologies.Schedule` (step k mixes with W_k), or a ready Mixer.
            Not used by ``sgd``, ``msgd``, ``fedavg`` (all-average) nor by
            ``local``; pass ``None`` there to use Π = 11ᵀ/N for bookkeeping.
        algorithm: a name (with ``**hyper`` for :func:`make_algorithm`) or an Algorithm.
        batch_size: per-agent batch size.
        seed: the root of every random stream.
        init: ``"same"`` or ``"independent"``.
        strategy: ``"auto"``, ``"loop"`` or ``"vmap"``.
        loss_fn: ``loss_fn(outputs, targets)``, mean over the batch (default cross-entropy).
        test_set: (inputs, targets) for evaluation, or None (test metrics are NaN).
        eval_batch_size, eval_agents, eval_samples: bound the cost of evaluation.
        exact: mix with the ordered multiply-add of the runtime's exact mode
            (and, with ``strategy="auto"``, use the loop strategy).
        augment: ``augment(batch_inputs, generator)`` applied to each training
            batch of agent j with its own generator seeded from (seed, j, "augment").
        overlap: start the mixing of X before the gradients are computed and
            wait for it after (the default); False starts it after, for measurement.
        agents: the agents this process holds (default: all). The distributed
            runtime holds a contiguous block per rank, with a
            :class:`cdsgd.runtime.BlockMixer` and a Reducer over its process
            group; the update rule and the bookkeeping are the same.
        reducer: sums across processes for evaluation (default: none needed).
        device: where parameters and data live (default: the model's device).
        batch_stream: ``batch_stream(j, generator)`` makes agent j's endless
            stream of index batches (``next()``, ``state_dict()``,
            ``load_state_dict()``), e.g. a :class:`cdsgd.data.bucketing.BucketStream`;
            default :class:`BatchStream` over agent j's shard.
        steps_per_epoch: steps that count as one epoch (default
            ceil(mean shard size / batch_size)).
        network: a simulated network (:func:`cdsgd.network.network_spec`, or a ready
            :class:`~cdsgd.network.NetworkClock`): each row's ``sim_seconds``
            (:mod:`cdsgd.executor.timing`); its losses change the mixing (simulator only).

    Public state (read it; each step updates it in place):
        X: the L×P stack of the held agents' flat parameters (N×P in the simulator): row i is agent
            ``agents[i]``'s, in ``layout`` order (``layout.views(X[i])`` names them); for ``sgp`` the
            de-biased z_j. The executor's own buffer: ``X.clone()`` keeps a snapshot.
        push_sum_weights: push-sum's weights w_j (``sgp``: numerators ``X[i] * w_j``), else None.
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
        W=None,
        algorithm: str | Algorithm = "cdmsgd",
        *,
        batch_size: int = 32,
        seed: int = 0,
        init: str = "same",
        strategy: str = "auto",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
        test_set: tuple[torch.Tensor, torch.Tensor] | None = None,
        eval_batch_size: int = 1024,
        eval_agents: int | None = None,
        eval_samples: int | None = None,
        exact: bool = False,
        augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
        overlap: bool = True,
        agents: Sequence[int] | None = None,
        reducer: Reducer | None = None,
        device: str | torch.device | None = None,
        batch_stream: Callable[[int, torch.Generator], object] | None = None,
        steps_per_epoch: int | None = None,
        grad_clip: float = 0.0,
        network=None,
        **hyper,
    ) -> None:
        self.n_agents = n = check_shards(shards)
        self.batch_size = check_int("batch_size", batch_size)
        self.seed = check_int("seed", seed, 0)
        if init not in INITS:
            raise ValueError(f"init {init!r} is unknown; allowed: {', '.join(INITS)}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
        self.eval_batch_size = check_int("eval_batch_size", eval_batch_size)
        if eval_agents is not None:
            check_int("eval_agents", eval_agents)
        if eval_samples is not None:
            check_int("eval_samples", eval_samples)
        self.agents = list(range(n)) if agents is None else [int(j) for j in agents]
        if not self.agents or any(not 0 <= j < n for j in self.agents) or len(set(self.agents)) != len(self.agents):
            raise ValueError(f"agents must be distinct indices in 0..{n - 1}, got {agents!r}")
        self.reducer = reducer if reducer is not None else Reducer()
        self.overlap, self.exact = bool(overlap), bool(exact)
        if not (isinstance(grad_clip, (int, float)) and 0 <= grad_clip < math.inf):
            raise ValueError(f"grad_clip must be a finite number >= 0 (0: off), got {grad_clip!r}")

        self.algorithm = algorithm = _make_algorithm(algorithm, hyper)

        # --- the mixer
        self.mixer = held_mixer(W, algorithm, n, self.agents, exact=exact)

        # --- models and the L×P parameter stack of the L agents held here
        # init="same": every agent's module is built under one seed (identical copies);
        # one-model algorithms (sgd, msgd, fedavg) start every agent from agent 0's parameters.
        def init_key(j: int) -> int:
            if init == "same":
                return derive_seed(self.seed, "init")
            return derive_seed(self.seed, 0 if algorithm.same_init else j, "init")

        built = build_agents(model_fn, [init_key(j) for j in self.agents], strategy=strategy, exact=exact,
                             device=device)
        self.models, self.layout, self.X, self.device = built.models, built.layout, built.X, built.device
        self.dtype, self.strategy, self.loss_fn = self.X.dtype, built.strategy, loss_fn

        # --- data, per-agent streams (seeded by the global agent index)
        self.shards = [(shards[j][0].to(self.device), shards[j][1].to(self.device)) for j in self.agents]
        if batch_stream is None:
            def batch_stream(j, gen):
                return BatchStream(len(shards[j][1]), self.batch_size, gen)
        self.streams = [batch_stream(j, generator(self.seed, j, "data")) for j in self.agents]
        self.augment, self._kept_batches = augment, {}
        self._augment_gens = [generator(self.seed, j, "augment") for j in self.agents] if augment else None
        mean_shard = sum(len(y) for _, y in shards) / n
        self.steps_per_epoch = (max(1, math.ceil(mean_shard / self.batch_size)) if steps_per_epoch is None
                                else check_int("steps_per_epoch", steps_per_epoch))
        self.rng = AgentRNG(self.seed, self.agents, self.device)
        algorithm.bind(n_agents=n, steps_per_epoch=self.steps_per_epoch, seed=self.seed)
        self.state = algorithm.init_state(self.X, mixer=self.mixer)
        self._G = torch.zeros_like(self.X)
        self.gradients = make_strategy(self.strategy, self.models, self.layout, self.X, self._G, loss_fn, self.rng,
                                       grad_clip=grad_clip)

        self.test_set = None if test_set is None else self._held_test_set(test_set, eval_samples)
        self.eval_agents = evaluation.pick_agents(n, eval_agents)

        self.k = 0
        # each held agent's train-loss sum and count since the last evaluation (summed per agent, so that
        # the row does not depend on how agents are spread over processes)
        self._loss_sums = torch.zeros(len(self.agents), dtype=torch.float64)
        self._loss_counts = torch.zeros(len(self.agents), dtype=torch.float64)
        self._wall = 0.0  # the training seconds of the timed steps (charge_step)
        #: seconds of the first step this process ran (compilation, first calls): not in wall_seconds
        self.warmup_seconds, self.timed_steps, self._warm = 0.0, 0, False
        self.last_loss = float("nan")
        #: seconds spent in evaluation (not part of wall_seconds, which counts training steps only)
        self.eval_seconds = 0.0
        # each held agent's first non-finite step (0: none) and whether its parameters (1) or loss (0) were so
        self._nonfinite = torch.zeros(len(self.agents), 2, dtype=torch.float64)
        self._row_sums = self.X.new_empty(len(self.agents), dtype=torch.promote_types(self.dtype, torch.float32))
        #: set by the evaluation that first sees a non-finite loss or parameter: (step, agent, what)
        self.diverged: tuple[int, int, str] | None = None
        #: training bytes all processes have sent to other processes (set by each evaluation)
        self.bytes_across_processes = 0.0
        #: the simulated network's clock and its records (:mod:`cdsgd.executor.timing`), or None
        self.clock = None if network is None else ClockFeed(network, self)

    def _held_test_set(self, test_set: tuple[torch.Tensor, torch.Tensor],
                       eval_samples: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The test set on this executor's device, cut to a seeded random ``eval_samples`` of it when given."""
        tx, ty = test_set
        if eval_samples is not None and eval_samples < len(ty):
            keep = torch.randperm(len(ty), generator=generator(self.seed, "eval"))[:eval_samples]
            tx, ty = tx[keep], ty[keep]
        return tx.to(self.device), ty.to(self.device)

    # ------------------------------------------------------------------- step

    def _batches(self, active: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next training batch of each active held agent (into buffers kept for it; augmented on its own stream)."""
        batches = []
        for i in active:
            xb, yb = gather(*self.shards[i], self.streams[i].next(), self._kept_batches, i)
            batches.append((xb if self.augment is None else self.augment(xb, self._augment_gens[i]), yb))
        return batches

    def step(self) -> float:
        """One synchronous step of every agent held here. Returns their mean batch loss (NaN if none stepped)."""
        t0 = time.perf_counter()
        alg, X, k = self.algorithm, self.X, self.k
        mixer = self.mixer.at(k)  # W_k of a time-varying schedule; the one mixer otherwise
        clock, sent = self.clock, self.mixer.bytes_sent.clone()
        mixer = mixer if clock is None else clock.mixer(mixer, k)  # the step's lost messages taken out
        mask = alg.participants(k)
        active = [i for i, j in enumerate(self.agents) if mask is None or bool(mask[j])]
        handle = alg.start(X, self.state, mixer) if alg.mixes_params and self.overlap else None
        t1 = time.perf_counter()
        losses = self.gradients.gradients(active, self._batches(active))
        t1 = time.perf_counter() - t1
        if alg.mixes_params and not self.overlap:
            handle = alg.start(X, self.state, mixer)
        alg.update(X, self._G, self.state, k=k, mixer=mixer, mixed=handle)
        self.k += 1
        losses = losses.detach().double().cpu()
        self._loss_sums[active] += losses
        self._loss_counts[active] += 1
        self._check_finite(active, losses)
        if clock is not None:
            clock.record(active, t1, self.mixer.bytes_sent - sent)
        charge_step(self, time.perf_counter() - t0)
        #: the mean batch loss of the agents held here at the last step (NaN if none stepped)
        self.last_loss = float(losses.mean()) if active else float("nan")
        return self.last_loss

    def _check_finite(self, active: list[int], losses: torch.Tensor) -> None:
        """Note each held agent's first step with a non-finite batch loss or parameter (one reduction per step)."""
        if bool(self._nonfinite[:, 0].all()):
            return  # every held agent is noted already
        bad_loss = torch.zeros(len(self.agents), dtype=torch.bool)
        bad_loss[active] = ~torch.isfinite(losses)
        todo = ~bad_loss & (self._nonfinite[:, 0] == 0)  # the rows whose parameters are still to look at
        bad = bad_loss | nonfinite_rows(self.X.reshape(len(self.agents), -1), self._row_sums, todo)
        new = bad & (self._nonfinite[:, 0] == 0)
        self._nonfinite[new, 0] = self.k
        self._nonfinite[new, 1] = (~bad_loss[new]).double()

    @property
    def push_sum_weights(self) -> torch.Tensor | None:
        """Push-sum's w_j of the held agents (a new L-vector; Σ_j w_j = N; :meth:`SGPAlgorithm.weights`), else None."""
        weights = getattr(self.algorithm, "weights", None)
        return None if weights is None else weights(self.state)

    @property
    def nonfinite_here(self) -> bool:
        """Whether an agent held here has met a non-finite loss or parameter (not yet agreed across processes)."""
        return bool(self._nonfinite[:, 0].any())

    # --------------------------------------------------------------- evaluate

    def average_params(self) -> torch.Tensor:
        """x̄ = (1/N) Σ_j x_j over all agents (a P-vector)."""
        return evaluation.average_params(self)

    def consensus_distance(self, xbar: torch.Tensor | None = None) -> float:
        """sqrt(mean_j ‖x_j − x̄‖²) over all agents."""
        return evaluation.consensus_distance(self, xbar)

    def evaluate(self) -> dict:
        """A metrics row (the METRIC_COLUMNS) for the current state; resets the train-loss window.

        Sums over agents go through the Reducer, so every process holding
        agents must call this together; the row is the same on all of them.
        """
        return evaluation.evaluate(self)

    # -------------------------------------------------------------------- run

    def run(self, *, epochs: float | None = None, steps: int | None = None, eval_every_steps: int | None = None,
            callback: Callable[[dict], None] | None = None, progress: Callable[[int], None] | None = None,
            after_step: Callable[[int], None] | None = None, **old) -> list[dict]:
        """Run ``epochs`` epochs (or ``steps`` steps), evaluating every ``eval_every_steps`` steps.

        ``eval_every_steps`` (steps, unlike the config's ``eval_every`` in epochs; the old name
        ``eval_every=`` warns) defaults to one epoch; the last step is always evaluated.
        Evaluations fall on the steps k (counted from the very start, also
        after :meth:`load_state_dict`) with k % eval_every_steps == 0.
        ``callback(row)`` receives each metrics row as it is made, ``progress(k)``
        each step, ``after_step(k)`` each step after its evaluation (the place
        for checkpoints: the state then includes the row).
        """
        eval_every_steps = renamed_keyword("Executor.run", old, "eval_every_steps", eval_every_steps, rest=True)
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs and steps")
        total = round(epochs * self.steps_per_epoch) if steps is None else check_int("steps", steps)
        if epochs is not None and (not epochs > 0 or total < 1):
            raise ValueError(f"epochs must be > 0 (at least one step), got {epochs!r}")
        every = self.steps_per_epoch if eval_every_steps is None else check_int("eval_every_steps", eval_every_steps)
        rows = []
        end = self.k + total
        alone = len(self.agents) == self.n_agents  # no other process: stop at the very step
        while self.k < end:
            self.step()
            if progress is not None:
                progress(self.k)
            if self.k % every == 0 or self.k == end or (alone and self.nonfinite_here):
                row = self.evaluate()
                rows.append(row)
                if callback is not None:
                    callback(row)
                if self.diverged is not None:
                    raise Diverged(*self.diverged)
            if after_step is not None:
                after_step(self.k)
        return rows

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """Everything that decides the rest of the run, for the agents held here (:func:`cdsgd.executor.state.state_dict`).

        Restoring it into an executor built with the same arguments
        (:meth:`load_state_dict`) continues bit for bit as if it had never stopped.
        """
        return checkpoint_state.state_dict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` of an executor built the same way; mismatches are ValueErrors."""
        checkpoint_state.load_state_dict(self, saved)

    def agent_model(self, j: int) -> nn.Module:
        """Agent j's module holding its current parameters (j must be held here).

        With the ``loop`` strategy it is the agent's own module (its parameters
        are views of X); with ``vmap``, a fresh copy of the template each call.
        """
        i = self.agents.index(j)
        model = self.models[i] if len(self.models) == len(self.agents) else copy.deepcopy(self.models[0])
        self.layout.load_into(model, self.X[i])
        return model


def _make_algorithm(algorithm: str | Algorithm, hyper: dict) -> Algorithm:
    """The Executor's ``algorithm``: a ready Algorithm (with no ``hyper``) or ``make_algorithm(algorithm, **hyper)``.

    ``hyper`` holds every keyword the Executor did not take itself, so a name
    the rule does not take either is refused naming both lists.
    """
    if not isinstance(algorithm, str):
        if hyper:
            raise ValueError(f"hyperparameters {sorted(hyper)} given with a ready Algorithm; set them on it")
        return algorithm
    try:
        return make_algorithm(algorithm, **hyper)
    except UnknownHyperparameter as e:
        own = [p for p in inspect.signature(Executor).parameters if p != "hyper"]
        raise ValueError(f"unknown option {e.name!r}: not a Simulator option ({', '.join(own)}) "
                         f"nor a hyperparameter of algorithm {e.algorithm!r} ({', '.join(e.allowed)})") from None


def simulate(model_fn: Callable[[], nn.Module], shards: Sequence[tuple[torch.Tensor, torch.Tensor]], W=None,
             algorithm: str | Algorithm = "cdmsgd", *, epochs: float | None = None, steps: int | None = None,
             eval_every_steps: int | None = None, **options) -> SimulationResult:
    """Run the simulator on your own model, loss and per-agent data, evaluating every ``eval_every_steps`` steps.

    ``options`` are :class:`Simulator`'s keyword arguments (``batch_size``,
    ``seed``, ``test_set``, ``loss_fn``, ...) and the algorithm's
    hyperparameters (``lr``, ``momentum``, ...). Returns the metrics rows and
    the final N×P parameters (row j is agent j; ``result.simulator.layout``
    maps them back to named tensors).
    """
    eval_every_steps = renamed_keyword("simulate", options, "eval_every_steps", eval_every_steps)
    sim = Executor(model_fn, shards, W, algorithm, **options)
    metrics = sim.run(epochs=epochs, steps=steps, eval_every_steps=eval_every_steps)
    return SimulationResult(metrics=metrics, params=sim.X.clone(), simulator=sim)


#: the executor's name when it holds every agent (and its name in earlier releases)
Simulator = Executor
