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
bookkeeping are the same code.

The executor is built from parts, each owning its state and ``state_dict()``
(the executor's checkpoint is the dict of theirs): the agents
(:class:`~cdsgd.executor.agents.AgentStack`: models, the parameter stack,
random streams, gradients by ``loop`` or ``vmap``), their data
(:class:`~cdsgd.executor.streams.DataFeed`), the mixer, the rule (an
:class:`~cdsgd.algorithms.Algorithm` and its per-agent state), the
:class:`~cdsgd.executor.reducer.Reducer`, the
:class:`~cdsgd.executor.evaluation.Evaluator` and the meters
(:mod:`cdsgd.executor.meters`: step timer, losses, non-finite watch, the
models' statistics, the simulated clock). :meth:`Executor.build` (also
named ``Simulator``) and :func:`simulate` build them from keyword arguments;
``cdsgd run`` builds them from its config (:func:`cdsgd.run.plan.build_executor`).

Example (3 agents on a path, step by step; every agent starts from the
same parameters, so after one step they differ only through their batches)::

    >>> import torch, topologies
    >>> from torch import nn
    >>> shards = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(3)]
    >>> W = topologies.mixing_matrix(topologies.build("path", 3))
    >>> ex = Executor.build(lambda: nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=4)
    >>> ex.X.shape, ex.strategy, ex.steps_per_epoch
    (torch.Size([3, 8]), 'vmap', 2)
    >>> _ = ex.step(); ex.k, ex.evaluate()["step"]
    (1, 1)
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ..algorithms import Algorithm, make_algorithm
from ..algorithms.factory import UnknownHyperparameter
from ..base.checks import check_int
from . import evaluation
from .agents import AgentStack, held_mixer
from .evaluation import Evaluator
from .gradients import cross_entropy
from .membership import Membership, build_membership, check_membership, freeze
from .meters import Meters
from .reducer import Reducer
from .streams import DataFeed, check_shards
from .timing import ClockFeed

__all__ = ["Diverged", "Executor", "STATE_FORMAT", "Simulator", "state_format_problem"]

#: the version of :meth:`Executor.state_dict`'s layout (a checkpoint of another is refused in one line)
STATE_FORMAT = 2


def state_format_problem(saved: dict) -> str:
    """Why ``saved`` (an :meth:`Executor.state_dict`) cannot be loaded by this version, or ``""``.

    >>> state_format_problem({"format": STATE_FORMAT}), state_format_problem({})[:11]
    ('', 'of format 1')
    """
    found = saved.get("format", 1)  # cdsgd 0.1.0 wrote no "format": its layout is format 1
    if found == STATE_FORMAT:
        return ""
    return (f"of format {found}, written by an earlier cdsgd; this version reads format {STATE_FORMAT}: "
            "start the run afresh (resume=false)")


class Diverged(ArithmeticError):
    """The run met a non-finite training loss or parameter: ``step`` (1-based), ``agent``, ``what``."""

    def __init__(self, step: int, agent: int, what: str) -> None:
        self.step, self.agent, self.what = int(step), int(agent), what
        super().__init__(f"the run diverged: agent {agent}'s {what} became non-finite at step {step}")


class Executor:
    """The agents held in this process, stepped by one rule. See the module docstring for the semantics.

    Args:
        stack: the held agents (:class:`~cdsgd.executor.agents.AgentStack`).
        data: their training data (:class:`~cdsgd.executor.streams.DataFeed` over all N shards).
        mixer: the N×N mixing matrix (numpy, nested lists or scipy.sparse), a
            :class:`topologies.Schedule`, a ready Mixer (the runtime's BlockMixer for a block of
            agents), or None for Π = 11ᵀ/N (the rules that mix with no graph). Checked against the
            rule once, here.
        algorithm: a ready :class:`~cdsgd.algorithms.Algorithm` (:func:`cdsgd.algorithms.make_algorithm`).
        reducer: sums across processes for evaluation (default: none needed).
        evaluator: the test set and evaluated agents (default: no test set; test metrics are NaN).
        network: a simulated network (:func:`cdsgd.network.network_spec`, or a ready
            :class:`~cdsgd.network.NetworkClock`): each row's ``sim_seconds``
            (:mod:`cdsgd.executor.timing`); its losses change the mixing (simulator only).
        overlap: start the mixing of X before the gradients are computed and
            wait for it after (the default); False starts it after, for measurement.

    Public state (read it; each step updates it in place):
        X: the L×P stack of the held agents' flat parameters (N×P in the simulator): row i is agent
            ``agents[i]``'s, in ``layout`` order (``layout.views(X[i])`` names them); for ``sgp`` the
            de-biased z_j. The executor's own buffer: ``X.clone()`` keeps a snapshot.
        state: the rule's per-agent state (momentum, trackers, ...).
        k: the steps taken. meters: :class:`~cdsgd.executor.meters.Meters`.
        membership: who is online at each step under churn (:class:`~cdsgd.executor.membership.Membership`),
            else None.
        push_sum_weights: push-sum's weights w_j (``sgp``: numerators ``X[i] * w_j``), else None.
    """

    def __init__(self, stack: AgentStack, data: DataFeed, mixer, algorithm: Algorithm,
                 reducer: Reducer | None = None, evaluator: Evaluator | None = None, network=None, *,
                 overlap: bool = True) -> None:
        if not isinstance(algorithm, Algorithm):
            raise ValueError(f"algorithm must be an Algorithm (cdsgd.algorithms.make_algorithm), got "
                             f"{type(algorithm).__name__}; Executor.build takes a name")
        if data.n_agents != stack.n_agents:
            raise ValueError(f"the data holds {data.n_agents} shards but the agents are {stack.n_agents}")
        self.stack, self.data, self.algorithm, self.overlap = stack, data, algorithm, bool(overlap)
        self.reducer = reducer if reducer is not None else Reducer()
        self.evaluator = evaluator if evaluator is not None else Evaluator(None, stack.n_agents)
        self.mixer = held_mixer(mixer, algorithm, stack.n_agents, stack.ids, exact=stack.exact)
        algorithm.bind(n_agents=stack.n_agents, steps_per_epoch=data.steps_per_epoch, seed=stack.seed,
                       tensor_sizes=[math.prod(s) for s in stack.layout.shapes])
        self.state = algorithm.init_state(self.X, mixer=self.mixer)
        self.k = 0
        self.meters = Meters(len(stack.ids), self.X, stack.models)
        #: set by the evaluation that first sees a non-finite loss or parameter: (step, agent, what)
        self.diverged: tuple[int, int, str] | None = None
        #: training bytes all processes have sent to other processes (set by each evaluation)
        self.bytes_across_processes = 0.0
        #: who is online at each step (:class:`~cdsgd.executor.membership.Membership`): the churn of ``network``
        #: (``churn``, ``churn_trace``) over the graph of the mixer's matrix with Metropolis weights (``cdsgd
        #: run`` sets the run's graph and weight rule before the first step), else None: all, always
        self.membership: Membership | None = None
        #: what takes a step in :meth:`run` instead of :meth:`step` (None: step): the runtime's elastic
        #: agreement around it (:class:`cdsgd.runtime.elastic.ElasticStep`)
        self.stepper: Callable[[], float] | None = None
        if getattr(network, "churning", False):
            check_membership("elastic", network, algorithm, n_agents=stack.n_agents, mixing="metropolis",
                             executor="sim" if len(stack.ids) == stack.n_agents else "torch",
                             schedule=hasattr(self.mixer.matrix, "period"))
            self.membership = build_membership(network, self.mixer, seed=stack.seed)
        if network is not None:
            self.meters.clock = ClockFeed(network, self)

    @classmethod
    def build(cls, model_fn: Callable[[], nn.Module], shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
              W=None, algorithm: str | Algorithm = "cdmsgd", *, batch_size: int = 32, seed: int = 0,
              init: str = "same", strategy: str = "auto",
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
              test_set: tuple[torch.Tensor, torch.Tensor] | None = None, eval_batch_size: int = 1024,
              eval_agents: int | None = None, eval_samples: int | None = None, exact: bool = False,
              augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
              overlap: bool = True, agents: Sequence[int] | None = None, reducer: Reducer | None = None,
              device: str | torch.device | None = None,
              batch_stream: Callable[[int, torch.Generator], object] | None = None,
              steps_per_epoch: int | None = None, grad_clip: float = 0.0, network=None, **hyper) -> "Executor":
        """The friendly door: an executor built from a model factory, per-agent data and keyword options.

        Args:
            model_fn: builds one agent's ``nn.Module`` (called under a seeded RNG).
            shards: per-agent training data, a sequence of (inputs, targets) tensor pairs.
            W: the mixer (see the class); None for the rules that mix with no graph.
            algorithm: a name (with ``**hyper`` for :func:`make_algorithm`) or an Algorithm.
            batch_size, seed, init (``"same"`` | ``"independent"``), strategy (``"auto"`` | ``"loop"`` |
                ``"vmap"``), loss_fn (mean over the batch), exact (ordered multiply-adds as the
                runtime's exact mode; with ``strategy="auto"``, the loop strategy), device, grad_clip:
                the agents (:class:`~cdsgd.executor.agents.AgentStack`).
            augment, batch_stream, steps_per_epoch: the data (:class:`~cdsgd.executor.streams.DataFeed`).
            test_set, eval_batch_size, eval_agents, eval_samples: the evaluation
                (:class:`~cdsgd.executor.evaluation.Evaluator`).
            agents: the agents this process holds (default: all); a block needs a Mixer that reaches
                the others (:class:`cdsgd.runtime.BlockMixer`) and a ``reducer`` over its group.
            overlap, network: as the class's.
        """
        n = check_shards(shards)
        alg = _make_algorithm(algorithm, hyper)
        stack = AgentStack(model_fn, n, seed=seed, ids=agents, init=init, same_init=alg.same_init,
                           strategy=strategy, exact=exact, device=device, loss_fn=loss_fn, grad_clip=grad_clip)
        data = DataFeed(shards, stack.ids, batch_size=batch_size, seed=stack.seed, device=stack.device,
                        augment=augment, batch_stream=batch_stream, steps_per_epoch=steps_per_epoch)
        evaluator = Evaluator(test_set, n, eval_agents=eval_agents, eval_samples=eval_samples,
                              eval_batch_size=eval_batch_size, seed=stack.seed, device=stack.device)
        return cls(stack, data, W, alg, reducer, evaluator, network, overlap=overlap)

    # ------------------------------------------------------- the parts' public state, by its usual names

    @property
    def X(self) -> torch.Tensor:
        return self.stack.X

    @property
    def agents(self) -> list[int]:
        """The indices of the agents held here."""
        return self.stack.ids

    n_agents = property(lambda self: self.stack.n_agents, doc="N, all agents of the run")
    layout = property(lambda self: self.stack.layout, doc="names the columns of X")
    models = property(lambda self: self.stack.models)
    strategy = property(lambda self: self.stack.strategy)
    gradients = property(lambda self: self.stack.gradients)
    device = property(lambda self: self.stack.device)
    dtype = property(lambda self: self.stack.dtype)
    exact = property(lambda self: self.stack.exact)
    seed = property(lambda self: self.stack.seed)
    rng = property(lambda self: self.stack.rng)
    loss_fn = property(lambda self: self.stack.loss_fn)
    steps_per_epoch = property(lambda self: self.data.steps_per_epoch)
    batch_size = property(lambda self: self.data.batch_size)
    streams = property(lambda self: self.data.streams)
    shards = property(lambda self: self.data.shards)
    test_set = property(lambda self: self.evaluator.test_set)
    eval_agents = property(lambda self: self.evaluator.eval_agents)
    eval_batch_size = property(lambda self: self.evaluator.eval_batch_size)
    clock = property(lambda self: self.meters.clock, doc="the simulated network's clock feed, or None")
    train_seconds = property(lambda self: self.meters.timer.train_seconds, doc="seconds of the timed steps")
    warmup_seconds = property(lambda self: self.meters.timer.warmup_seconds)
    timed_steps = property(lambda self: self.meters.timer.timed_steps)
    eval_seconds = property(lambda self: self.meters.timer.eval_seconds)
    last_loss = property(lambda self: self.meters.loss.last,
                         doc="the mean batch loss of the agents held here at the last step (NaN if none stepped)")

    # ------------------------------------------------------------------- step

    def step(self) -> float:
        """One synchronous step of every agent held here. Returns their mean batch loss (NaN if none stepped)."""
        t0 = time.perf_counter()
        alg, X, k, clock, members = self.algorithm, self.X, self.k, self.meters.clock, self.membership
        online, joins = (None, []) if members is None else members.begin(k, self)  # returning agents copied in
        base = self.mixer if online is None else members.mixer(k)  # the online agents' mixing
        mixer = alg.step_mixer(base, k)  # W_k of a schedule, Π = I between periodic gossip's messages
        sent = self.mixer.bytes_sent.clone()
        mixer = mixer if clock is None else clock.mixer(mixer, k)  # the step's lost messages taken out
        mask = alg.participants(k)
        active = [i for i, j in enumerate(self.agents) if (mask is None or bool(mask[j]))
                  and (online is None or bool(online[j]))]
        restore = None if online is None else freeze(self, online)  # the offline agents' rows stay as they are
        anyone = online is None or bool(online.any())  # (every process decides alike: exchanges pair up)
        handle = alg.start(X, self.state, mixer) if alg.mixes_params and self.overlap and anyone else None
        t1 = time.perf_counter()
        losses = self.gradients.gradients(active, self.data.batches(active)) if active else torch.zeros(0)
        t1 = time.perf_counter() - t1
        if alg.mixes_params and not self.overlap and anyone:
            handle = alg.start(X, self.state, mixer)
        if anyone:
            alg.update(X, self.gradients.G, self.state, k=k, mixer=mixer, mixed=handle)
        if restore is not None:
            restore()
        self.k += 1
        losses = losses.detach().double().cpu()
        self.meters.loss.add(active, losses)
        self.meters.nonfinite.check(active, losses, self.X, self.k)
        if clock is not None:
            clock.record(active, t1, self.mixer.bytes_sent - sent, alg.message_delay(k), getattr(mixer, "phase", None),
                         online=online, joins=joins)
        self.meters.timer.charge(time.perf_counter() - t0)
        return self.last_loss

    @property
    def push_sum_weights(self) -> torch.Tensor | None:
        """Push-sum's w_j of the held agents (a new L-vector; Σ_j w_j = N; :meth:`SGPAlgorithm.weights`), else None."""
        weights = getattr(self.algorithm, "weights", None)
        return None if weights is None else weights(self.state)

    @property
    def nonfinite_here(self) -> bool:
        """Whether an agent held here has met a non-finite loss or parameter (not yet agreed across processes)."""
        return self.meters.nonfinite.any

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
        t0 = time.perf_counter()
        row, diverged, self.bytes_across_processes = evaluation.evaluate(self)
        if self.diverged is None:
            self.diverged = diverged
        self.meters.timer.eval_seconds += time.perf_counter() - t0
        return row

    # -------------------------------------------------------------------- run

    def run(self, *, epochs: float | None = None, steps: int | None = None, eval_every_steps: int | None = None,
            callback: Callable[[dict], None] | None = None, progress: Callable[[int], None] | None = None,
            after_step: Callable[[int], None] | None = None) -> list[dict]:
        """Run ``epochs`` epochs (or ``steps`` steps), evaluating every ``eval_every_steps`` steps.

        ``eval_every_steps`` (steps, unlike the config's ``eval_every`` in epochs) defaults to one epoch;
        the last step is always evaluated.
        Evaluations fall on the steps k (counted from the very start, also
        after :meth:`load_state_dict`) with k % eval_every_steps == 0.
        The rule learns the step the run ends at (k + the steps to run: a
        ``cosine`` step size decays over it unless ``lr_decay_steps`` is given).
        ``callback(row)`` receives each metrics row as it is made, ``progress(k)``
        each step, ``after_step(k)`` each step after its evaluation (the place
        for checkpoints: the state then includes the row).
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs and steps")
        total = round(epochs * self.steps_per_epoch) if steps is None else check_int("steps", steps)
        if epochs is not None and (not epochs > 0 or total < 1):
            raise ValueError(f"epochs must be > 0 (at least one step), got {epochs!r}")
        every = self.steps_per_epoch if eval_every_steps is None else check_int("eval_every_steps", eval_every_steps)
        rows = []
        end = self.k + total
        self.algorithm.bind(n_agents=self.n_agents, steps_per_epoch=self.steps_per_epoch, seed=self.seed,
                            total_steps=end)  # the step the run ends at: a cosine step size's horizon
        alone = len(self.agents) == self.n_agents  # no other process: stop at the very step
        while self.k < end:
            self.step() if self.stepper is None else self.stepper()
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
        """Everything that decides the rest of the run, for the agents held here: the dict of the parts'.

        Only tensors, numbers, strings, lists and dicts: it loads with
        ``torch.load(weights_only=True)``. Restoring it into an executor built
        the same way (:meth:`load_state_dict`) continues bit for bit as if it
        had never stopped.
        """
        return {
            "format": STATE_FORMAT,
            "k": self.k,
            "agents": list(self.agents),
            "n_agents": self.n_agents,
            "numel": self.layout.numel,
            "algorithm": self.algorithm.name,
            "stack": self.stack.state_dict(),
            "data": self.data.state_dict(),
            "rule": {name: t.detach().cpu().clone() for name, t in self.state.items()},
            "mixer": {"bytes_sent": self.mixer.bytes_sent.clone(), "bytes_across": float(self.mixer.bytes_across)},
            "reducer": {"bytes": float(self.reducer.bytes)},
            "meters": self.meters.state_dict(),
            **({} if self.membership is None else {"membership": self.membership.state_dict()}),
        }

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` of an executor built the same way; mismatches are ValueErrors."""
        problem = state_format_problem(saved)
        if problem:
            raise ValueError(f"checkpoint state is {problem}")
        expect = {"agents": list(self.agents), "n_agents": self.n_agents, "numel": self.layout.numel,
                  "algorithm": self.algorithm.name}
        for key, want in expect.items():
            if saved.get(key) != want:
                raise ValueError(f"checkpoint state has {key} = {saved.get(key)!r}, this run has {want!r}")
        if sorted(saved["rule"]) != sorted(self.state):
            raise ValueError(f"checkpoint algorithm state holds {sorted(saved['rule'])}, this run {sorted(self.state)}")
        self.stack.load_state_dict(saved["stack"])
        with torch.no_grad():
            for name, t in saved["rule"].items():
                self.state[name].copy_(t)
        self.data.load_state_dict(saved["data"])
        self.mixer.bytes_sent.copy_(saved["mixer"]["bytes_sent"])
        self.mixer.bytes_across = float(saved["mixer"]["bytes_across"])
        self.reducer.bytes = float(saved["reducer"]["bytes"])
        self.meters.load_state_dict(saved["meters"])
        if self.membership is not None:
            if "membership" not in saved:
                raise ValueError("checkpoint state was written without churn, this run has churn (network_params)")
            self.membership.load_state_dict(saved["membership"])
        self.k = int(saved["k"])

    def agent_model(self, j: int) -> nn.Module:
        """Agent j's module holding its current parameters (j must be held here; :meth:`AgentStack.model`)."""
        return self.stack.model(j)


def _make_algorithm(algorithm: str | Algorithm, hyper: dict) -> Algorithm:
    """The executor's ``algorithm``: a ready Algorithm (with no ``hyper``) or ``make_algorithm(algorithm, **hyper)``.

    ``hyper`` holds every keyword :meth:`Executor.build` did not take itself, so a name
    the rule does not take either is refused naming both lists.
    """
    if not isinstance(algorithm, str):
        if hyper:
            raise ValueError(f"hyperparameters {sorted(hyper)} given with a ready Algorithm; set them on it")
        return algorithm
    try:
        return make_algorithm(algorithm, **hyper)
    except UnknownHyperparameter as e:
        own = [p for p in inspect.signature(Executor.build).parameters if p not in ("cls", "hyper")]
        raise ValueError(f"unknown option {e.name!r}: not a Simulator option ({', '.join(own)}) "
                         f"nor a hyperparameter of algorithm {e.algorithm!r} ({', '.join(e.allowed)})") from None


#: the friendly door's other name: ``Simulator(model_fn, shards, W, algorithm, **options)`` builds an executor
#: holding every agent (:meth:`Executor.build`)
Simulator = Executor.build
