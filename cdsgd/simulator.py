r"""The single-process simulator: N agents stacked in one process.

All agents' flat parameters live in one N×P buffer ``X``, so the mixing of a
CDSGD step is one matrix product Π X. Each step is synchronous: every agent
computes its gradient at the same iterate, then the update rule of
:mod:`cdsgd.algorithms` is applied to the whole stack.

Independence of agents. Agent j has its own model instance (for buffers),
its own momentum rows, its own data order and its own random streams, all
seeded from (seed, j) by :func:`cdsgd.seeding.derive_seed`:

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

Two execution strategies with identical numerics (to float rounding):

``loop``   for each agent, ``torch.func.grad`` of its loss through
           ``functional_call`` on its own module;
``vmap``   the same function vectorised over agents with ``torch.vmap``.

``strategy="auto"`` picks ``vmap`` for models without convolutions, dropout
or buffers (dense networks: measured 1.5–1.8× faster than the loop on 2 CPU
cores) and ``loop`` otherwise (for CNNs vmap measured 0.4–0.7× the loop;
dropout and buffers need per-agent state that vmap cannot keep exactly).
Forcing ``vmap`` on a model with dropout or buffers is refused.

Metrics of an evaluation (see :meth:`Simulator.evaluate`): mean train loss,
per-agent test loss/accuracy averaged over agents, test accuracy of the
average model x̄, consensus distance sqrt(mean_j ‖x_j − x̄‖²), and the mean
bytes each agent has sent. Evaluation cost is bounded by ``eval_batch_size``
(chunks), ``eval_agents`` (evaluate k evenly spaced agents) and
``eval_samples`` (a fixed random subset of the test set).

Example (4 agents on a ring learn a linear classifier)::

    >>> import torch, topologies
    >>> from torch import nn
    >>> g = torch.Generator().manual_seed(0)
    >>> Xs = torch.randn(400, 5, generator=g); ys = (Xs[:, 0] > 0).long()
    >>> shards = [(Xs[i::4], ys[i::4]) for i in range(4)]
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> result = simulate(lambda: nn.Linear(5, 2), shards, W, "cdsgd", lr=0.5,
    ...                   epochs=5, batch_size=20, test_set=(Xs, ys))
    >>> result.metrics[-1]["test_accuracy"] > 0.9, result.params.shape
    (True, torch.Size([4, 12]))
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .algorithms import Algorithm, algorithm_params, check_int, make_algorithm
from .mixing import MatrixMixer, Mixer
from .models import has_convolutions, vmap_blockers
from .seeding import derive_seed, generator

__all__ = [
    "BatchStream",
    "Reducer",
    "METRIC_COLUMNS",
    "ParamLayout",
    "SimulationResult",
    "Simulator",
    "simulate",
]

#: the columns of a metrics row, in the order of the run-output contract
METRIC_COLUMNS = (
    "epoch",
    "step",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "test_accuracy_avg_model",
    "consensus_distance",
    "bytes_sent_per_agent",
    "wall_seconds",
)

STRATEGIES = ("auto", "loop", "vmap")
INITS = ("same", "independent")


class ParamLayout:
    """Where each named parameter of a model lives in the flat P-vector."""

    def __init__(self, module: nn.Module) -> None:
        self.names, self.shapes, self.offsets = [], [], []
        offset = 0
        for name, p in module.named_parameters():
            self.names.append(name)
            self.shapes.append(p.shape)
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """The module's parameters as one flat detached P-vector (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in module.parameters()])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name → view of ``flat`` in that parameter's shape.

        ``flat`` is a P-vector, or a stack (…, P) of them: then each view has
        the leading dimensions too (an N×P stack gives N×shape views).
        """
        lead = flat.shape[:-1]
        return {
            name: flat[..., o:o + math.prod(s)].view(*lead, *s)
            for name, s, o in zip(self.names, self.shapes, self.offsets)
        }

    def load_into(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy a flat P-vector into the module's parameters."""
        with torch.no_grad():
            for p, v in zip(module.parameters(), self.views(flat).values()):
                p.copy_(v)


class BatchStream:
    """Endless full batches of indices 0..n-1: concatenated random permutations.

    Batch k is positions [k·b, (k+1)·b) of perm₀ ‖ perm₁ ‖ …, so each pass
    covers every index once and every batch has exactly ``batch_size``
    indices (also when n < batch_size).

    >>> s = BatchStream(5, 2, torch.Generator().manual_seed(0))
    >>> sorted(torch.cat([s.next() for _ in range(5)]).tolist())
    [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    """

    def __init__(self, n: int, batch_size: int, gen: torch.Generator) -> None:
        if n < 1:
            raise ValueError(f"an agent's shard is empty (n={n}); every agent needs data")
        self.n, self.batch_size, self.gen = n, batch_size, gen
        self._perm = torch.randperm(n, generator=gen)
        self._pos = 0

    def state_dict(self) -> dict:
        """The position in the stream: the current permutation, the place in it, the generator state."""
        return {"perm": self._perm.clone(), "pos": self._pos, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        perm = state["perm"]
        if perm.shape != (self.n,) or not 0 <= int(state["pos"]) <= self.n:
            raise ValueError(f"data stream state is for a shard of {perm.numel()} samples, not {self.n}")
        self._perm, self._pos = perm.clone(), int(state["pos"])
        self.gen.set_state(state["gen"])

    def next(self) -> torch.Tensor:
        parts, need = [], self.batch_size
        while need:
            if self._pos == self.n:
                self._perm = torch.randperm(self.n, generator=self.gen)
                self._pos = 0
            take = min(need, self.n - self._pos)
            parts.append(self._perm[self._pos:self._pos + take])
            self._pos += take
            need -= take
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class SimulationResult:
    """What :func:`simulate` returns."""

    #: one dict per evaluation with the keys of METRIC_COLUMNS
    metrics: list[dict]
    #: final N×P parameters
    params: torch.Tensor
    simulator: "Simulator" = field(repr=False)


class _AgentRNG:
    """Per-agent global-RNG states: run agent j's forward on its own stream."""

    def __init__(self, seed: int, agents: Sequence[int], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        saved = self._get()
        self.states = []
        for j in agents:
            torch.manual_seed(derive_seed(seed, j, "dropout"))
            self.states.append(self._get())
        self._set(saved)

    def state_dict(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def load_state_dict(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.states):
            raise ValueError(f"random streams of {len(states)} agents, but this executor holds {len(self.states)}")
        self.states = [s.clone() for s in states]

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def _set(self, state) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def run(self, i: int, fn: Callable, *args):
        """fn(*args) on the i-th held agent's stream."""
        saved = self._get()
        self._set(self.states[i])
        try:
            return fn(*args)
        finally:
            self.states[i] = self._get()
            self._set(saved)


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


class Simulator:
    """N agents, one process. See the module docstring for the semantics.

    Args:
        model_fn: builds one agent's ``nn.Module`` (called under a seeded RNG).
        shards: per-agent training data, a sequence of (inputs, targets) tensor pairs.
        W: the N×N mixing matrix (numpy or nested lists), or a ready Mixer.
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
            runtime holds one, ``[rank]``, with a neighbour Mixer and a Reducer
            over its process group; the update rule and the bookkeeping are the same.
        reducer: sums across processes for evaluation (default: none needed).
        device: where parameters and data live (default: the model's device).
        batch_stream: ``batch_stream(j, generator)`` makes agent j's endless
            stream of index batches (``next()``, ``state_dict()``,
            ``load_state_dict()``), e.g. a :class:`cdsgd.data.bucketing.BucketStream`;
            default :class:`BatchStream` over agent j's shard.
        steps_per_epoch: steps that count as one epoch (default
            ceil(mean shard size / batch_size)).
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
        **hyper,
    ) -> None:
        self.n_agents = n = len(shards)
        if n < 1:
            raise ValueError("shards is empty; the simulator needs at least one agent")
        for j, shard in enumerate(shards):
            if not (isinstance(shard, (tuple, list)) and len(shard) == 2):
                raise ValueError(f"shard {j} must be an (inputs, targets) pair, got {type(shard).__name__}")
            if len(shard[0]) != len(shard[1]):
                raise ValueError(f"shard {j} has {len(shard[0])} inputs but {len(shard[1])} targets")
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
        self.overlap = bool(overlap)

        if isinstance(algorithm, str):
            allowed = algorithm_params(algorithm)
            unknown = sorted(set(hyper) - set(allowed))
            if unknown:
                import inspect

                own = [p for p in inspect.signature(Simulator).parameters if p not in ("hyper",)]
                raise ValueError(
                    f"unknown option {unknown[0]!r}: not a Simulator option ({', '.join(own)}) "
                    f"nor a hyperparameter of algorithm {algorithm!r} ({', '.join(allowed)})"
                )
            algorithm = make_algorithm(algorithm, **hyper)
        elif hyper:
            raise ValueError(f"hyperparameters {sorted(hyper)} given with a ready Algorithm; set them on it")
        self.algorithm = algorithm

        # --- the mixer
        if not isinstance(W, Mixer) and len(self.agents) < n:
            raise ValueError(f"an executor holding agents {self.agents} of {n} needs a Mixer that reaches the "
                             "others (e.g. cdsgd.runtime.NeighbourMixer), not a matrix")
        if isinstance(W, Mixer):
            self.mixer = W
        elif W is None:
            if algorithm.traffic == "neighbours":
                raise ValueError(f"algorithm {algorithm.name!r} mixes with neighbours: give the mixing matrix W")
            self.mixer = MatrixMixer(np.full((n, n), 1.0 / n), exact=exact)
        else:
            W = np.asarray(W, dtype=np.float64)
            if W.shape != (n, n):
                raise ValueError(f"mixing matrix W is {'x'.join(map(str, W.shape))} but there are {n} agents (shards)")
            self.mixer = MatrixMixer(W, exact=exact)
        if self.mixer.n_agents != n:
            raise ValueError(f"mixer is for {self.mixer.n_agents} agents but there are {n} shards")
        if list(getattr(self.mixer, "rows", range(n))) != self.agents:
            raise ValueError(f"mixer holds agents {list(self.mixer.rows)} but this executor holds {self.agents}")

        # --- models and the L×P parameter stack of the L agents held here
        # init="same": every agent's module is built under one seed (identical copies);
        # one-model algorithms (sgd, msgd, fedavg) start every agent from agent 0's parameters.
        def init_key(j: int) -> int:
            if init == "same":
                return derive_seed(self.seed, "init")
            return derive_seed(self.seed, 0 if algorithm.same_init else j, "init")

        self.models = [self._seeded(init_key(j), model_fn) for j in self.agents]
        template = self.models[0]
        self.layout = ParamLayout(template)
        if self.layout.numel == 0:
            raise ValueError("the model has no parameters")
        first = next(template.parameters())
        self.device = torch.device(device) if device is not None else first.device
        for m in self.models:
            m.to(self.device)
        self.X = torch.stack([self.layout.flatten(m) for m in self.models]).to(self.device)
        self.dtype = self.X.dtype

        blockers = vmap_blockers(template)
        if strategy == "auto":
            strategy = "loop" if blockers or exact or has_convolutions(template) else "vmap"
        elif strategy == "vmap" and blockers:
            raise ValueError(f"strategy 'vmap' cannot simulate this model exactly: {'; '.join(blockers)}; use 'loop'")
        self.strategy = strategy
        self.loss_fn = loss_fn
        self._dropout = bool(blockers)  # per-agent RNG streams matter only for models that draw
        self._vmap_grad = vmap(grad_and_value(self._vmap_loss))
        for m in self.models:
            m.train()

        # --- data, per-agent streams (seeded by the global agent index)
        self.shards = [(shards[j][0].to(self.device), shards[j][1].to(self.device)) for j in self.agents]
        if batch_stream is None:
            def batch_stream(j, gen):
                return BatchStream(len(shards[j][1]), self.batch_size, gen)
        self.streams = [batch_stream(j, generator(self.seed, j, "data")) for j in self.agents]
        self.augment = augment
        self._augment_gens = [generator(self.seed, j, "augment") for j in self.agents] if augment else None
        mean_shard = sum(len(y) for _, y in shards) / n
        self.steps_per_epoch = (max(1, math.ceil(mean_shard / self.batch_size)) if steps_per_epoch is None
                                else check_int("steps_per_epoch", steps_per_epoch))
        self.rng = _AgentRNG(self.seed, self.agents, self.device)
        algorithm.bind(n_agents=n, steps_per_epoch=self.steps_per_epoch, seed=self.seed)
        self.state = algorithm.init_state(self.X)
        self._G = torch.zeros_like(self.X)
        if self.strategy == "loop":
            self._bind_modules()

        self.test_set = None
        if test_set is not None:
            tx, ty = test_set
            if eval_samples is not None and eval_samples < len(ty):
                keep = torch.randperm(len(ty), generator=generator(self.seed, "eval"))[:eval_samples]
                tx, ty = tx[keep], ty[keep]
            self.test_set = (tx.to(self.device), ty.to(self.device))
        self.eval_agents = (
            list(range(n)) if eval_agents is None or eval_agents >= n
            else sorted({int(round(v)) for v in np.linspace(0, n - 1, eval_agents)})
        )

        self.k = 0
        self._loss_sum, self._loss_count = 0.0, 0
        self._wall = 0.0

    # ------------------------------------------------------------------ parts

    @staticmethod
    def _seeded(seed: int, model_fn: Callable[[], nn.Module]) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_fn()
        if not isinstance(model, nn.Module):
            raise ValueError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        return model

    def _bind_modules(self) -> None:
        """Make the i-th local agent's module parameters views of X[i] and their ``.grad`` views of G[i].

        The loop strategy then runs each agent's own module with plain
        autograd: no copies in or out, and backward accumulates straight into
        the gradient stack (measured: functional_call + torch.func.grad cost
        ~15 % more than this on the paper's CNN).
        """
        for i, model in enumerate(self.models):
            for p, xv, gv in zip(model.parameters(), self.layout.views(self.X[i]).values(),
                                 self.layout.views(self._G[i]).values()):
                p.data = xv
                p.grad = gv
        self._grad_views = [[p.grad for p in m.parameters()] for m in self.models]

    def _agent_backward(self, i: int, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.models[i](xb), yb)
        loss.backward()
        return loss.detach()

    def _vmap_loss(self, params, xb, yb):
        return self.loss_fn(functional_call(self.models[0], params, (xb,)), yb)

    def _gradients(self, X: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the local rows listed (L×P; other rows zero) and their batch losses."""
        G = self._G
        if self.strategy == "loop" or len(rows) < len(self.agents):
            G.zero_()  # the loop's backward accumulates into G; vmap overwrites every listed row
        batches = []
        for i in rows:
            idx = self.streams[i].next()
            x, y = self.shards[i]
            xb = x[idx] if self.augment is None else self.augment(x[idx], self._augment_gens[i])
            batches.append((xb, y[idx]))
        views = self.layout.views
        if self.strategy == "vmap" and not rows:  # no agent held here takes part in this step (FedAvg)
            return G, torch.zeros(0)
        if self.strategy == "vmap":
            xb, yb = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
            if len(rows) == len(self.agents):
                g, losses = self._vmap_grad(views(X), xb, yb)
                for name, v in views(G).items():
                    v.copy_(g[name])
            else:
                idx = torch.tensor(rows, device=X.device)
                g, losses = self._vmap_grad(views(X[idx]), xb, yb)
                G[idx] = torch.cat([g[name].reshape(len(rows), -1) for name in self.layout.names], dim=1)
            return G, losses.detach()
        losses = []
        for i, (xb, yb) in zip(rows, batches):
            if self._dropout:
                losses.append(self.rng.run(i, self._agent_backward, i, xb, yb))
            else:
                losses.append(self._agent_backward(i, xb, yb))
            for p, gv in zip(self.models[i].parameters(), self._grad_views[i]):
                if p.grad is not gv:  # autograd replaced the buffer instead of accumulating: copy back
                    gv.copy_(p.grad)
                    p.grad = gv
        return G, torch.stack(losses) if losses else torch.zeros(0)

    # ------------------------------------------------------------------- step

    def step(self) -> float:
        """One synchronous step of every agent held here. Returns their mean batch loss (NaN if none stepped)."""
        t0 = time.perf_counter()
        alg, X, k = self.algorithm, self.X, self.k
        mask = alg.participants(k)
        rows = [i for i, j in enumerate(self.agents) if mask is None or bool(mask[j])]
        handle = self.mixer.start(X) if alg.mixes_params and self.overlap else None
        G, losses = self._gradients(X, rows)
        if alg.mixes_params and not self.overlap:
            handle = self.mixer.start(X)
        alg.update(X, G, self.state, k=k, mixer=self.mixer, mixed=handle)
        self.k += 1
        total = float(losses.sum())
        self._loss_sum += total
        self._loss_count += len(rows)
        self._wall += time.perf_counter() - t0
        return total / len(rows) if rows else float("nan")

    # --------------------------------------------------------------- evaluate

    def _sum(self, values: Sequence[float]) -> list[float]:
        """Sum over all agents of per-process partial sums (float64)."""
        return self.reducer.sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def average_params(self) -> torch.Tensor:
        """x̄ = (1/N) Σ_j x_j over all agents (a P-vector)."""
        total = self.reducer.sum(self.X.double().sum(dim=0))
        return (total / self.n_agents).to(self.dtype)

    def consensus_distance(self, xbar: torch.Tensor | None = None) -> float:
        """sqrt(mean_j ‖x_j − x̄‖²) over all agents."""
        xbar = self.average_params() if xbar is None else xbar
        local = float(((self.X.double() - xbar.double()) ** 2).sum())
        return math.sqrt(self._sum([local])[0] / self.n_agents)

    @torch.no_grad()
    def _eval_params(self, flats: torch.Tensor, model_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Mean test loss and accuracy of each row of ``flats`` (evaluated with local module model_ids[i])."""
        tx, ty = self.test_set
        n = len(ty)
        loss_sum = np.zeros(len(model_ids))
        correct = np.zeros(len(model_ids))
        if not model_ids:
            return loss_sum, correct
        for start in range(0, n, self.eval_batch_size):
            xb, yb = tx[start:start + self.eval_batch_size], ty[start:start + self.eval_batch_size]
            if self.strategy == "vmap":
                model, views = self.models[0], self.layout.views
                outs = list(vmap(lambda f: functional_call(model, views(f), (xb,)))(flats))
            else:
                outs = [functional_call(self.models[m], self.layout.views(f), (xb,))
                        for m, f in zip(model_ids, flats)]
            for i, o in enumerate(outs):
                loss_sum[i] += float(self.loss_fn(o, yb)) * len(yb)
                if o.dim() == 2 and yb.dim() == 1:
                    correct[i] += float((o.argmax(dim=1) == yb).sum())
        return loss_sum / n, correct / n

    def evaluate(self) -> dict:
        """A metrics row (the METRIC_COLUMNS) for the current state; resets the train-loss window.

        Sums over agents go through the Reducer, so every process holding
        agents must call this together; the row is the same on all of them
        (test_accuracy_avg_model is evaluated by the process holding agent 0
        and is NaN on the others).
        """
        loss_sum, loss_count = self._sum([self._loss_sum, float(self._loss_count)])
        self._loss_sum, self._loss_count = 0.0, 0
        xbar = self.average_params()
        row = {
            "epoch": self.k / self.steps_per_epoch,
            "step": self.k,
            "train_loss": loss_sum / loss_count if loss_count else float("nan"),
            "test_loss": float("nan"),
            "test_accuracy": float("nan"),
            "test_accuracy_avg_model": float("nan"),
            "consensus_distance": self.consensus_distance(xbar),
            "bytes_sent_per_agent": self._sum([float(self.mixer.bytes_sent.sum())])[0] / self.n_agents,
            "wall_seconds": self._wall,
        }
        if self.test_set is not None:
            for m in self.models:
                m.eval()
            try:
                rows = [i for i, j in enumerate(self.agents) if j in self.eval_agents]
                loss, acc = self._eval_params(self.X[rows], rows)
                t_loss, t_acc = self._sum([float(loss.sum()), float(acc.sum())])
                if 0 in self.agents:
                    _, acc_avg = self._eval_params(xbar.unsqueeze(0), [self.agents.index(0)])
                    row["test_accuracy_avg_model"] = float(acc_avg[0])
            finally:
                for m in self.models:
                    m.train()
            count = len(self.eval_agents)
            row.update(test_loss=t_loss / count, test_accuracy=t_acc / count)
        return row

    # -------------------------------------------------------------------- run

    def run(self, *, epochs: float | None = None, steps: int | None = None, eval_every: int | None = None,
            callback: Callable[[dict], None] | None = None, progress: Callable[[int], None] | None = None,
            after_step: Callable[[int], None] | None = None) -> list[dict]:
        """Run ``epochs`` epochs (or ``steps`` steps), evaluating every ``eval_every`` steps.

        ``eval_every`` defaults to one epoch; the last step is always evaluated.
        Evaluations fall on the steps k (counted from the very start, also
        after :meth:`load_state_dict`) with k % eval_every == 0.
        ``callback(row)`` receives each metrics row as it is made, ``progress(k)``
        each step, ``after_step(k)`` each step after its evaluation (the place
        for checkpoints: the state then includes the row).
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs and steps")
        total = round(epochs * self.steps_per_epoch) if steps is None else check_int("steps", steps)
        if epochs is not None and (not epochs > 0 or total < 1):
            raise ValueError(f"epochs must be > 0 (at least one step), got {epochs!r}")
        every = self.steps_per_epoch if eval_every is None else check_int("eval_every", eval_every)
        rows = []
        end = self.k + total
        while self.k < end:
            self.step()
            if progress is not None:
                progress(self.k)
            if self.k % every == 0 or self.k == end:
                row = self.evaluate()
                rows.append(row)
                if callback is not None:
                    callback(row)
            if after_step is not None:
                after_step(self.k)
        return rows

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """Everything that decides the rest of the run, for the agents held here.

        Parameters, the algorithm's state (momentum), the step counter, the
        train-loss window, the wall clock, each agent's data order (permutation,
        position, generator), augmentation and dropout streams, and the bytes
        counted so far. Only tensors, numbers, strings, lists and dicts: it
        loads with ``torch.load(weights_only=True)``. Restoring it into a
        Simulator built with the same arguments (:meth:`load_state_dict`)
        continues bit for bit as if it had never stopped.
        """
        return {
            "k": self.k,
            "agents": list(self.agents),
            "n_agents": self.n_agents,
            "numel": self.layout.numel,
            "X": self.X.detach().cpu().clone(),
            "algorithm": self.algorithm.name,
            "algorithm_state": {name: t.detach().cpu().clone() for name, t in self.state.items()},
            "loss_sum": self._loss_sum,
            "loss_count": self._loss_count,
            "wall": self._wall,
            "streams": [s.state_dict() for s in self.streams],
            "augment": [g.get_state() for g in self._augment_gens] if self._augment_gens else [],
            "rng": [s.cpu() for s in self.rng.state_dict()],
            "bytes_sent": self.mixer.bytes_sent.clone(),
            "eval_bytes": float(self.reducer.bytes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` of an executor built the same way; mismatches are ValueErrors."""
        expect = {"agents": list(self.agents), "n_agents": self.n_agents, "numel": self.layout.numel,
                  "algorithm": self.algorithm.name}
        for key, want in expect.items():
            if state.get(key) != want:
                raise ValueError(f"checkpoint state has {key} = {state.get(key)!r}, this run has {want!r}")
        if tuple(state["X"].shape) != tuple(self.X.shape):
            raise ValueError(f"checkpoint parameters have shape {tuple(state['X'].shape)}, "
                             f"this run {tuple(self.X.shape)}")
        if sorted(state["algorithm_state"]) != sorted(self.state):
            raise ValueError(f"checkpoint algorithm state holds {sorted(state['algorithm_state'])}, "
                             f"this run {sorted(self.state)}")
        with torch.no_grad():
            self.X.copy_(state["X"])  # in place: the loop strategy's modules are views of X
            for name, t in state["algorithm_state"].items():
                self.state[name].copy_(t)
        for stream, s in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(s)
        for g, s in zip(self._augment_gens or [], state["augment"], strict=True):
            g.set_state(s)
        self.rng.load_state_dict([s.to(self.rng.states[0].device) for s in state["rng"]])
        self.mixer.bytes_sent.copy_(state["bytes_sent"])
        self.reducer.bytes = float(state["eval_bytes"])
        self.k = int(state["k"])
        self._loss_sum, self._loss_count = float(state["loss_sum"]), int(state["loss_count"])
        self._wall = float(state["wall"])

    def agent_model(self, j: int) -> nn.Module:
        """Agent j's module holding its current parameters (j must be held here)."""
        i = self.agents.index(j)
        self.layout.load_into(self.models[i], self.X[i])
        return self.models[i]


def simulate(
    model_fn: Callable[[], nn.Module],
    shards: Sequence[tuple[torch.Tensor, torch.Tensor]],
    W=None,
    algorithm: str | Algorithm = "cdmsgd",
    *,
    epochs: float | None = None,
    steps: int | None = None,
    eval_every: int | None = None,
    **options,
) -> SimulationResult:
    """Run the simulator on your own model, loss and per-agent data.

    ``options`` are :class:`Simulator`'s keyword arguments (``batch_size``,
    ``seed``, ``test_set``, ``loss_fn``, ...) and the algorithm's
    hyperparameters (``lr``, ``momentum``, ...). Returns the metrics rows and
    the final N×P parameters (row j is agent j; ``result.simulator.layout``
    maps them back to named tensors).
    """
    sim = Simulator(model_fn, shards, W, algorithm, **options)
    metrics = sim.run(epochs=epochs, steps=steps, eval_every=eval_every)
    return SimulationResult(metrics=metrics, params=sim.X.clone(), simulator=sim)
