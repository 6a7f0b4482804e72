r"""The asynchronous executor: AD-PSGD (``adpsgd``) event by event, in simulated time (simulator only).

No agent waits. Agent i computes a gradient at the parameters x̂_i it read
when it started (its *snapshot*); when the computation is done it averages
with one random neighbour j and steps (:class:`~cdsgd.algorithms.ADPSGDAlgorithm`),
then starts its next computation. Which event comes first, and so how stale
each gradient is, follows from this time model.

**Time model.** Agent i's computation takes c_i seconds: ``compute_ms``
/ 1000, times ``straggler_slowdown`` for the stragglers of
:func:`cdsgd.network.stragglers` (spec, N, seed). An exchange sends one
full parameter vector each way in parallel, each over its sender's own
uplink: it holds both uplinks for τ = P · b · 8 / bandwidth
(:meth:`NetworkSpec.transfer_seconds` of P parameters of b bytes) and ends
one latency L later. With e_i the time i's computation ends and u_i the time
i's uplink is next free (both 0 at the start, when every agent begins
computing at the same x_0)::

    e_i    = s_i + c_i                      (s_i: when i started computing; s_i = 0 at first)
    σ      = max(e_i, u_i, u_j)             (the exchange starts when i is done and both uplinks are free)
    u_i, u_j ← σ + τ
    s_i'   = (σ + τ) + L                    (the exchange ends; i starts its next computation)

Events are taken in the order of e_i, ties broken by the agent index, and
uplinks are granted first come, first served in that order. Every exchange
that touches x_i holds i's uplink, so the exchanges on any one agent happen
in that same order, and applying each event's arithmetic when it is taken
(the pairwise average with x_j as it is then, i's step) gives the
parameters the time model implies. Agent i's snapshot is its x_i right after
its own exchange: the averages neighbours do into x_i after that, before its
next exchange, are its gradient's staleness.

* ``compute_ms`` must be given: the event order, and so the arithmetic,
  depends on the compute times, and a measured time would make a run
  depend on the machine's load (and not continue bit for bit from a
  checkpoint). A network without it is refused (:func:`check_asynchronous`).
* ``network = "none"``: every computation takes one unit and communication
  is free (τ = L = 0): agents finish together and take their turns by index.
  ``sim_seconds`` is then NaN, as for every rule without a network.
* ``drop``, ``link_failure`` and ``agents_per_host`` > 1 are refused (one
  uplink per agent, no lost exchanges).

**Steps.** One executor step is the next N events (gradient applications) in
time order, so an epoch is as many gradients as for the synchronous rules;
an agent may apply several gradients in a step and a straggler none. A
metrics row's ``sim_seconds`` is the end of the latest exchange processed;
``bytes_sent_per_agent`` counts each exchange's message for both partners
(P · b each). Gradients are computed lazily, all pending agents' at once
(at their snapshots, with the executor's gradient strategy) when the next
event needs one: an agent's gradient depends only on its snapshot and its
batch, so the batching changes nothing but the speed.

Example (4 agents on a ring, 10 ms computations, 8 float32 parameters at
1 Mbit/s: τ = 0.256 ms, L = 0). All finish computing at 10 ms; agents 0 and
1 pick partners 3 and 2 and exchange at once; agent 2 (partner 1) waits for
the uplinks of 1 and 2 until 10.256 ms, agent 3 (partner 2) for 2's until
10.512 ms. Each listed as (exchange end in ms, agent, partner)::

    >>> import torch, topologies
    >>> from torch import nn
    >>> from cdsgd.network import network_spec
    >>> shards = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(4)]
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> net = network_spec("none", {"bandwidth_mbps": 1, "latency_ms": 0, "compute_ms": 10})
    >>> ex = AsyncExecutor.build(lambda: nn.Linear(3, 2), shards, W, "adpsgd", lr=0.1, batch_size=4, network=net)
    >>> _ = ex.step(); [(round(t * 1e3, 3), i, j) for t, i, j in ex.last_events]
    [(10.256, 0, 3), (10.256, 1, 2), (10.512, 2, 1), (10.768, 3, 2)]
"""

from __future__ import annotations

import heapq
import time

import numpy as np
import torch

from ..algorithms import Algorithm, is_asynchronous
from ..mixers import neighbourhood
from ..network import NetworkSpec, stragglers
from .core import Executor

__all__ = ["AsyncExecutor", "EventTimes", "check_asynchronous", "executor_class"]


def check_asynchronous(spec: NetworkSpec | None, algorithm: Algorithm, *, in_one_process: bool) -> None:
    """Refuse what an asynchronous rule cannot run on: many processes, lost messages, shared uplinks, measured compute."""
    if not is_asynchronous(algorithm):
        return
    name = algorithm.name
    if not in_one_process:
        raise ValueError(f"algorithm {name!r} is simulated with every agent in one process (executor=sim); "
                         "executor=torch runs the synchronous rules")
    if spec is None:
        return
    if spec.lossy:
        raise ValueError(f"network_params drop={spec.drop:g}, link_failure={spec.link_failure:g}: algorithm "
                         f"{name!r} does not simulate lost exchanges; allowed: drop=0, link_failure=0")
    if getattr(spec, "agents_per_host", 1) != 1:
        raise ValueError(f"network_params agents_per_host={spec.agents_per_host}: algorithm {name!r} models one "
                         "uplink per agent; allowed: agents_per_host=1")
    if spec.compute_ms is None:
        raise ValueError(f"network {spec.name!r} without network_params.compute_ms: algorithm {name!r} orders its "
                         "events by the compute times, which must be given to be reproducible (e.g. "
                         "network_params={compute_ms=20})")


def executor_class(algorithm: Algorithm) -> type[Executor]:
    """The executor that runs ``algorithm``: :class:`AsyncExecutor` for an asynchronous rule, else :class:`Executor`."""
    return AsyncExecutor if is_asynchronous(algorithm) else Executor


class EventTimes:
    """The time model of an asynchronous run (module docstring): compute times, uplinks, pending events.

    Args:
        spec: the network, or None (unit computations, free communication).
        n_agents: N.
        seed: the root of the straggler draw.
        message_bytes: P · b, one parameter vector.

    Public state: ``compute`` (c_i in seconds), ``done`` (e_i: when agent i's current computation ends),
    ``uplink`` (u_i), ``seconds`` (the end of the latest exchange), ``straggler`` (the boolean mask),
    ``spec``, ``lost_messages`` (always 0). It also reads as the run's clock model (``ex.clock.clock``).
    """

    def __init__(self, spec: NetworkSpec | None, n_agents: int, *, seed: int, message_bytes: float) -> None:
        self.spec, self.n_agents, self.lost_messages = spec, int(n_agents), 0
        if spec is None:
            self.straggler = np.zeros(self.n_agents, dtype=bool)
            self.compute = [1.0] * self.n_agents
            self.transfer, self.latency = 0.0, 0.0
        else:
            self.straggler = stragglers(spec, self.n_agents, seed)
            base = spec.compute_ms / 1e3
            self.compute = [base * (spec.straggler_slowdown if s else 1.0) for s in self.straggler.tolist()]
            self.transfer, self.latency = spec.transfer_seconds(message_bytes), spec.latency
        self.done = list(self.compute)  # every agent starts computing at time 0
        self.uplink = [0.0] * self.n_agents
        self.seconds = 0.0
        self._queue = [(e, i) for i, e in enumerate(self.done)]
        heapq.heapify(self._queue)

    def next(self) -> tuple[float, int]:
        """The next event: (e_i, i), the earliest computation to end (the lowest index among equal times)."""
        return heapq.heappop(self._queue)

    def exchange(self, i: int, j: int, done: float) -> float:
        """Agent i, done at ``done``, exchanges with j: hold both uplinks, schedule i's next event; the exchange's end."""
        start = max(done, self.uplink[i], self.uplink[j])
        self.uplink[i] = self.uplink[j] = start + self.transfer
        end = start + self.transfer + self.latency
        self.seconds = max(self.seconds, end)
        self.done[i] = end + self.compute[i]
        heapq.heappush(self._queue, (self.done[i], i))
        return end

    def state_dict(self) -> dict:
        """Numbers and lists (loads with ``weights_only``)."""
        return {"done": list(self.done), "uplink": list(self.uplink), "seconds": self.seconds,
                "compute": list(self.compute)}

    def load_state_dict(self, state: dict) -> None:
        if [float(c) for c in state["compute"]] != self.compute:
            raise ValueError("checkpoint's compute times differ from this run's (another network, stragglers or "
                             "seed); resume with the checkpoint run's network")
        self.done = [float(e) for e in state["done"]]
        self.uplink = [float(u) for u in state["uplink"]]
        self.seconds = float(state["seconds"])
        self._queue = [(e, i) for i, e in enumerate(self.done)]
        heapq.heapify(self._queue)


class _SimulatedTime:
    """``ex.clock`` of an asynchronous run with a network: what the evaluation and the run's summary read."""

    def __init__(self, times: EventTimes) -> None:
        self.clock = times  # spec, straggler, lost_messages (as a ClockFeed's NetworkClock)

    def flush(self, reducer) -> float:
        """The simulated time of the latest event processed (``sim_seconds``)."""
        return self.clock.seconds

    def state_dict(self) -> dict:
        return {}  # the times are saved with the executor's asynchronous state

    def load_state_dict(self, state: dict) -> None:
        pass


class AsyncExecutor(Executor):
    """The simulator for an asynchronous rule (``adpsgd``): :class:`Executor`'s arguments, all agents held.

    ``network`` is a :class:`~cdsgd.network.NetworkSpec` (with ``compute_ms``) or None; see the module
    docstring for the time model and what one step is. Public state beyond the Executor's:
    ``times`` (:class:`EventTimes`), ``neighbours`` (each agent's, ascending), ``applied`` (gradients each
    agent has applied), ``last_events`` (the last step's events: (exchange end, agent i, partner j)).
    ``X`` always holds the agents' live parameters (what evaluation reads).
    """

    def __init__(self, stack, data, mixer, algorithm: Algorithm, reducer=None, evaluator=None, network=None, *,
                 overlap: bool = True) -> None:
        if network is not None and not isinstance(network, NetworkSpec):
            raise ValueError(f"network must be a NetworkSpec or None for an asynchronous run, got "
                             f"{type(network).__name__}")
        super().__init__(stack, data, mixer, algorithm, reducer, evaluator, overlap=overlap)
        alg, n = self.algorithm, self.n_agents
        if not is_asynchronous(alg):
            raise ValueError(f"AsyncExecutor runs the asynchronous rules (adpsgd), not {alg.name!r}: use Executor")
        check_asynchronous(network, alg, in_one_process=len(self.agents) == n)
        self.neighbours = [neighbourhood(self.mixer.matrix, i)[1][1:] for i in range(n)]
        lonely = [i for i, nb in enumerate(self.neighbours) if not nb]
        if lonely:
            raise ValueError(f"agent {lonely[0]} has no neighbour to average with; give a connected graph")
        self._message_bytes = float(self.layout.numel * self.X.element_size())
        self.times = EventTimes(network, n, seed=self.seed, message_bytes=self._message_bytes)
        self.meters.clock = None if network is None else _SimulatedTime(self.times)
        self.applied = [0] * n
        self.last_events: list[tuple[float, int, int]] = []
        self._snapshots = self.X.clone()  # x̂_i: where agent i's pending gradient is taken
        self._pending = torch.zeros_like(self.X)  # the computed pending gradients (rows with _ready)
        self._pending_loss = torch.zeros(n, dtype=torch.float64)
        self._ready = [False] * n

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def _compute_pending(self) -> None:
        """Every pending gradient not computed yet, at once: the snapshots in X for the gradient strategy."""
        todo = [a for a in range(self.n_agents) if not self._ready[a]]
        idx = torch.tensor(todo, device=self.X.device)
        live = self.X.index_select(0, idx)
        self.X.index_copy_(0, idx, self._snapshots.index_select(0, idx))
        try:
            with torch.enable_grad():
                losses = self.gradients.gradients(todo, self.data.batches(todo))
        finally:
            self.X.index_copy_(0, idx, live)  # in place: the loop strategy's modules are views of X
        self._pending.index_copy_(0, idx, self.gradients.G.index_select(0, idx))
        self._pending_loss[todo] = losses.detach().double().cpu()
        for a in todo:
            self._ready[a] = True

    def step(self) -> float:
        """The next N events in time order. Returns the mean batch loss of the gradients applied."""
        t0 = time.perf_counter()
        alg, X, times, sent = self.algorithm, self.X, self.times, self.mixer.bytes_sent
        events, per_agent = [], {}
        for _ in range(self.n_agents):
            done, i = times.next()
            t = self.applied[i]
            j = alg.partner(i, t, self.neighbours[i])
            end = times.exchange(i, j, done)
            if not self._ready[i]:
                self._compute_pending()
            with torch.no_grad():
                alg.exchange(X, self._pending[i], self.state, i=i, j=j, t=t, at=self._snapshots[i])
                self._snapshots[i].copy_(X[i])  # i's next computation reads its parameters now
            self._ready[i] = False
            self.applied[i] += 1
            sent[i] += self._message_bytes
            sent[j] += self._message_bytes
            loss = float(self._pending_loss[i])
            self.meters.loss.add_one(i, loss)
            per_agent[i] = per_agent.get(i, 0.0) + loss  # a non-finite loss stays non-finite in the sum
            events.append((end, i, j))
        self.k += 1
        self.last_events = events
        active = sorted(per_agent)
        self.meters.nonfinite.check(active, torch.tensor([per_agent[i] for i in active], dtype=torch.float64), X,
                                    self.k)
        self.meters.timer.charge(time.perf_counter() - t0)
        self.meters.loss.last = sum(per_agent.values()) / self.n_agents  # N events
        return self.last_loss

    # ------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """The Executor's state plus the event queue, uplinks, snapshots and pending gradients."""
        state = super().state_dict()
        state["asynchronous"] = {
            "times": self.times.state_dict(), "applied": list(self.applied), "ready": list(self._ready),
            "snapshots": self._snapshots.detach().cpu().clone(), "pending": self._pending.detach().cpu().clone(),
            "pending_loss": self._pending_loss.clone(),
        }
        return state

    def load_state_dict(self, saved: dict) -> None:
        if "asynchronous" not in saved:
            raise ValueError("checkpoint state has no asynchronous state (event queue, snapshots): it is not of an "
                             "asynchronous run")
        super().load_state_dict(saved)
        mine = saved["asynchronous"]
        self.times.load_state_dict(mine["times"])
        self.applied = [int(a) for a in mine["applied"]]
        self._ready = [bool(r) for r in mine["ready"]]
        with torch.no_grad():
            self._snapshots.copy_(mine["snapshots"])
            self._pending.copy_(mine["pending"])
        self._pending_loss.copy_(mine["pending_loss"])
