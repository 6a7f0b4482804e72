r"""Elastic membership: who is online at each step, the mixing over them, and what a returning agent takes.

Churn is time-varying membership (docs/reliability.md). At step k a
:class:`~cdsgd.network.MembershipTrace` says which agents are online; then

* an offline agent neither computes nor sends: its parameters and every row
  of the rule's state (momentum, moments, trackers, outer state) stay as they
  were, and its data stream does not advance;
* the online agents mix with the run's weight rule on the subgraph they
  induce (:func:`topologies.surviving_mixing`; each connected part on its
  own when the graph falls apart); an all-average (``sgd``, ``fedavg``,
  ``diloco``) spans the online agents;
* an agent that comes back at step k (offline at k − 1) first takes the
  parameters and the rule's state of its donor: the lowest-numbered graph
  neighbour online at both k − 1 and k (any such agent for the rules without
  a graph); with none, it goes on from its own. That copy is one message of
  the donor's (its bytes count, and the clock charges it);
* every change is a row of ``membership.csv``: :data:`MEMBERSHIP_COLUMNS`.

With every agent online the step is the base mixer's, untouched: a trace in
which nobody leaves is bit-identical to a run without churn.

Example (a ring of 4 in which agent 2 is offline at steps 1 and 2)::

    >>> import torch, topologies
    >>> from cdsgd.network import MembershipTrace
    >>> from cdsgd.mixers import make_mixer
    >>> G = topologies.build("ring", 4)
    >>> m = Membership(MembershipTrace(4, [(2, 1, 3)]), G, "metropolis", make_mixer(topologies.mixing_matrix(G)))
    >>> x = torch.arange(4.0, dtype=torch.float64).unsqueeze(1)
    >>> m.online(1).tolist(), [round(v, 4) for v in m.mixer(1).mix(x).squeeze(1).tolist()]   # the path 3-0-1
    ([True, True, False, True], [1.3333, 0.6667, 2.0, 2.0])
"""

from __future__ import annotations

import math
from collections import OrderedDict

import networkx as nx
import numpy as np
import torch

import topologies

from ..mixers import Handle, Mixer, make_mixer
from ..mixers.base import allreduce_bytes, result_tensor

__all__ = ["MEMBERSHIP_COLUMNS", "Membership", "OnlineMixer", "build_membership", "check_membership", "freeze",
           "per_agent"]

#: the columns of membership.csv, one row per step at which the membership changed
MEMBERSHIP_COLUMNS = ("step", "sim_seconds", "wall_seconds", "left", "joined", "donors", "online", "parts",
                      "spectral_gap")

#: mixers kept for the online sets met most recently
_CACHED = 64


class OnlineMixer(Mixer):
    """The mixer of one step with only the ``online`` agents taking part.

    ``start``/``exchange`` are ``gossip``'s (the surviving subgraph's matrix); ``average`` is ``base``'s over
    the online agents (and ``mask``), each online agent counting a ring all-reduce among them. Bytes go to
    ``base``'s counter.
    """

    def __init__(self, gossip: Mixer, base: Mixer, online: np.ndarray) -> None:
        self.gossip, self.base = gossip, base
        self.n_agents, self.agents, self.matrix, self.exact = base.n_agents, list(base.agents), gossip.matrix, base.exact
        self.online = torch.as_tensor(np.asarray(online, dtype=bool))
        self._held = self.online[torch.as_tensor(self.agents)]

    bytes_sent = property(lambda self: self.base.bytes_sent)
    bytes_across = property(lambda self: self.base.bytes_across)
    edges = property(lambda self: self.gossip.edges)

    def _counted(self, post):
        """Run ``post()`` on the gossip mixer; what it sent to other processes goes to the run's count."""
        if self.gossip is self.base:
            return post()
        before = self.gossip.bytes_across
        handle = post()
        self.base.bytes_across += self.gossip.bytes_across - before
        self.gossip.bytes_across = before
        return handle

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        return self._counted(lambda: self.gossip.start(X, out=out))

    def exchange(self, M: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        return self._counted(lambda: self.gossip.exchange(M, out=out))

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.online.clone() if mask is None else mask.to(torch.bool).cpu() & self.online
        if not bool(mask.any()):  # nobody to average with: every row stays as it is
            return result_tensor(X, out, "average").copy_(X)
        before = self.base.bytes_sent.clone()
        result = self.base.average(X, mask.to(X.device), out=out)
        self.base.bytes_sent.copy_(before)  # only the online agents take part, in an all-reduce among them
        self.base.bytes_sent[self._held] += allreduce_bytes(int(self.online.sum()), X[0].numel(), X.element_size())
        return result


class Membership:
    """The executor's part for churn: the trace, the mixers of the online sets, the changes recorded.

    Args:
        trace: a :class:`~cdsgd.network.MembershipTrace`.
        graph: the run's graph (None for the rules that mix with no graph).
        rule: the run's weight rule (``mixing``), applied to the surviving subgraph.
        mixer: the run's mixer of the agents held here (its bytes counters are the run's).
        make: builds the mixer of a surviving matrix for the agents held here (default:
            ``make_mixer(W, exact=mixer.exact, validated=True)``; the runtime's group gives its BlockMixer's).
    """

    def __init__(self, trace, graph: nx.Graph | None, rule: str, mixer: Mixer, make=None) -> None:
        self.trace, self.graph, self.rule, self.base = trace, graph, rule, mixer
        self.make = make if make is not None else (lambda W: make_mixer(W, exact=mixer.exact, validated=True))
        self.n_agents = mixer.n_agents
        self._mixers: OrderedDict[bytes, tuple[Mixer, topologies.Surviving | None]] = OrderedDict()
        self._online: dict[int, np.ndarray] = {}  # steps k − 1 and k, asked for at every step
        self._full_gap: float | None = None
        #: membership.csv's rows so far (``sim_seconds`` filled when the clock has reached the step)
        self.rows: list[dict] = []
        #: the agents online at the last step taken (all before the first)
        self.current = np.ones(self.n_agents, dtype=bool)
        self.online_steps = 0  # Σ over the steps taken of the agents online (summary.json's mean)
        self.steps = 0
        #: (agent, step) of the losses the runtime observed (:meth:`lose`), beyond the trace it started with
        self.lost: list[tuple[int, int]] = []
        #: (agent, step) of the lost agents that came back in a replacement process (:meth:`rejoin`)
        self.back: list[tuple[int, int]] = []

    def online(self, k: int) -> np.ndarray:
        """The agents online at step k (all for k < 0)."""
        if k < 0:
            return np.ones(self.n_agents, dtype=bool)
        if k not in self._online:
            self._online = {j: v for j, v in self._online.items() if j >= k - 1}
            self._online[k] = self.trace.online(k)
        return self._online[k]

    def lose(self, agents, k: int) -> None:
        """The runtime lost ``agents`` (their ranks died): they leave at step k for good, as the trace rows
        ``agent, k,`` would make them leave (the simulator given those rows is the reference)."""
        for j in agents:
            self.trace.add(int(j), int(k), None)
            self.lost.append((int(j), int(k)))
        self._online = {s: v for s, v in self._online.items() if s < k}

    def rejoin(self, agents, k: int) -> None:
        """Lost ``agents`` are back at step k (a replacement process joined): the trace rows ``agent, leave, k``;
        at step k each takes its donor's model and state (:meth:`begin`)."""
        for j in agents:
            self.trace.readmit(int(j), int(k))
            self.back.append((int(j), int(k)))
        self._online = {s: v for s, v in self._online.items() if s < k}

    def _surviving(self, online: np.ndarray) -> tuple[Mixer, topologies.Surviving | None]:
        key = np.packbits(online).tobytes()
        if key not in self._mixers:
            if self.graph is None:
                self._mixers[key] = (OnlineMixer(self.base, self.base, online), None)
            else:
                s = topologies.surviving_mixing(self.graph, online, self.rule,
                                                sparse=self.n_agents > topologies.DENSE_UP_TO)
                gossip = self.make(s.W)
                gossip.bytes_sent = self.base.bytes_sent  # one counter: the run's
                self._mixers[key] = (OnlineMixer(gossip, self.base, online), s)
            if len(self._mixers) > _CACHED:
                self._mixers.popitem(last=False)
        self._mixers.move_to_end(key)
        return self._mixers[key]

    def mixer(self, k: int) -> Mixer:
        """The mixer of step k: the base mixer when every agent is online, else the surviving one."""
        online = self.online(k)
        return self.base if online.all() else self._surviving(online)[0]

    def donor(self, j: int, k: int) -> int:
        """Whom agent j, back at step k, takes its model from: the lowest-numbered neighbour (any agent without
        a graph) online at k − 1 and k; −1 when there is none."""
        alive = self.online(k - 1) & self.online(k)
        candidates = range(self.n_agents) if self.graph is None else sorted(self.graph.neighbors(j))
        return next((int(i) for i in candidates if alive[i] and i != j), -1)

    def begin(self, k: int, ex) -> tuple[np.ndarray | None, list[tuple[int, int, float]]]:
        """Step k starts: returning agents take their donors' rows; a change is recorded. Returns the online mask
        (None: all online) and the joins (agent, donor, bytes) for the clock."""
        before, online = self.online(k - 1), self.online(k)
        self.current = online
        self.steps += 1
        self.online_steps += int(online.sum())
        if np.array_equal(before, online):
            return (None if online.all() else online), []
        left = np.flatnonzero(before & ~online).tolist()
        joined = np.flatnonzero(~before & online).tolist()
        joins = self._copy(ex, [(j, self.donor(j, k)) for j in joined])
        s = None if online.all() else self._surviving(online)[1]
        if s is None and self.graph is not None and self._full_gap is None:
            self._full_gap = topologies.spectral_gap(self.base.matrix).gap
        gap = float("nan") if self.graph is None else (self._full_gap if s is None else s.gap.gap)
        self.rows.append({"step": k, "sim_seconds": math.nan, "wall_seconds": ex.meters.timer.train_seconds,
                          "left": " ".join(map(str, left)), "joined": " ".join(map(str, joined)),
                          "donors": " ".join(f"{j}<{d}" for j, d, _ in joins), "online": int(online.sum()),
                          "parts": 1 if s is None else len(s.parts), "spectral_gap": gap})
        return (None if online.all() else online), joins

    def _copy(self, ex, moves: list[tuple[int, int]]) -> list[tuple[int, int, float]]:
        """Each returning agent j with a donor d (d >= 0) takes d's parameters and rule state (across processes
        too: :meth:`Mixer.move_rows`); returns the joins (j, d, bytes of that one message of d's)."""
        moves = [(j, d) for j, d in moves if d >= 0]
        if not moves:
            return []
        stacks = per_agent(ex)
        n_bytes = float(sum(t[0].numel() * t.element_size() for t in stacks))
        self.base.move_rows(moves, stacks)
        for _, d in moves:
            if d in ex.agents:
                self.base.bytes_sent[ex.agents.index(d)] += n_bytes
        return [(j, d, n_bytes) for j, d in moves]

    def timed(self, k: int, seconds: float) -> None:
        """The clock reached step k at ``seconds``: the change recorded at k gets its simulated time."""
        for row in reversed(self.rows):  # in step order: only the changes since the last evaluation are passed
            if row["step"] <= k:
                if row["step"] == k:
                    row["sim_seconds"] = float(seconds)
                return

    def summary(self) -> dict:
        """What summary.json says of the membership: changes, departures, returns, online agents."""
        return {"membership_changes": len(self.rows),
                "departures": sum(len(r["left"].split()) for r in self.rows),
                "returns": sum(len(r["joined"].split()) for r in self.rows),
                "min_online": min([self.n_agents, *(r["online"] for r in self.rows)]),
                "final_online": int(self.current.sum()),
                "mean_online": self.online_steps / self.steps if self.steps else float(self.n_agents),
                "most_parts": max([1, *(r["parts"] for r in self.rows)])}

    def state_dict(self) -> dict:
        return {"rows": [dict(r) for r in self.rows], "online_steps": self.online_steps, "steps": self.steps,
                "current": self.current.tolist(), "lost": [list(v) for v in self.lost],
                "back": [list(v) for v in self.back]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [dict(r) for r in state["rows"]]
        self.online_steps, self.steps = int(state["online_steps"]), int(state["steps"])
        self.current = np.asarray(state["current"], dtype=bool)
        for key, apply in (("lost", self.lose), ("back", self.rejoin)):  # the runtime's losses and returns
            for j, k in [(int(j), int(k)) for j, k in state.get(key, [])]:
                if (j, k) not in getattr(self, key):
                    apply([j], k)


def check_membership(membership: str, spec, algorithm, *, n_agents: int, executor: str, mixing: str,
                     schedule: bool) -> None:
    """Refuse, in one line each, what elastic membership and churn cannot run with: churn under
    ``membership = "fixed"``, a rule that cannot go on without an agent, churn beside lost messages or over a
    time-varying schedule, a weight rule that cannot be re-weighted, a bad trace file."""
    churning = spec is not None and spec.churning
    if churning and membership != "elastic":
        raise ValueError(f"network_params churn makes agents leave and come back, but membership = {membership!r} "
                         "stops the run at the first loss: set membership = \"elastic\"")
    if membership != "elastic":
        return
    algorithm.check_elastic()
    if not churning:
        return
    if spec.lossy:
        raise ValueError(f"network_params churn with drop = {spec.drop:g}, link_failure = {spec.link_failure:g}: "
                         "simulate one kind of failure at a time (churn, or lost messages)")
    if schedule:
        raise ValueError("network_params churn re-weights one fixed graph; a time-varying topology (schedule) "
                         "cannot lose agents: give a graph (ring, torus, ...)")
    if algorithm.traffic == "neighbours" and mixing in topologies.REGULAR_ONLY_RULES:
        raise ValueError(f"mixing = {mixing!r} is doubly stochastic on regular graphs only, and a graph that loses "
                         "an agent is not regular: use metropolis (or max_degree, lazy_metropolis) with churn")
    if spec.churn_trace is not None:
        from ..network import load_trace

        load_trace(spec.churn_trace, n_agents)


def build_membership(spec, mixer: Mixer, *, seed: int, graph: nx.Graph | None = None, rule: str = "metropolis",
                     make=None) -> Membership:
    """The :class:`Membership` of a churning network ``spec`` (``churn`` or ``churn_trace``) over ``mixer``
    (a ``spec`` without churn, or None: nobody leaves but whom the runtime loses, :meth:`Membership.lose`):
    the graph is ``graph``, or that of ``mixer.matrix``'s non-zeros (None for a mixer without one); ``make``
    as :class:`Membership`'s."""
    from ..network import MembershipTrace, load_trace, random_churn

    n = mixer.n_agents
    if spec is None or not spec.churning:
        trace = MembershipTrace(n)
    else:
        trace = (load_trace(spec.churn_trace, n) if spec.churn_trace is not None
                 else random_churn(n, spec.churn, spec.churn_down_steps, seed))
    if graph is None and mixer.matrix is not None:
        if topologies.Schedule is type(mixer.matrix) or hasattr(mixer.matrix, "period"):
            raise ValueError("churn re-weights one fixed graph; a time-varying schedule cannot lose agents")
        graph = topologies.graph_of(mixer.matrix)
    return Membership(trace, graph, rule, mixer, make)


def per_agent(ex) -> list[torch.Tensor]:
    """The stacks with one row per held agent: X and the rule's per-agent state (what a returning agent takes)."""
    return [t for t in (ex.X, *ex.state.values()) if t.dim() and t.shape[0] == len(ex.agents)]


def freeze(ex, online: np.ndarray):
    """Keep the offline agents' rows of X and of the rule's state; returns what puts them back after the step."""
    off = torch.as_tensor(np.flatnonzero(~online[ex.agents]), device=ex.X.device)
    tensors = per_agent(ex)
    kept = [t.index_select(0, off) for t in tensors]

    def restore() -> None:
        with torch.no_grad():
            for t, rows in zip(tensors, kept):
                t.index_copy_(0, off, rows)

    return restore
