r"""The simulated network clock: message sizes, the graph and computation times → simulated seconds.

A pure model (numpy only): it never sleeps and never touches parameters.
The executor feeds it, after every step k, each agent's computation time
c_j(k) and the bytes it sent; the clock keeps, for every agent j, the time
s_j(k) at which it starts step k (s_j(0) = 0) and the time u_j from which
its uplink is free.

**Gossip** (algorithms whose ``traffic`` is ``"neighbours"``). Agent j
sends its step-k messages one after another over its own uplink, to its
out-neighbours i of W_k (W_k[i, j] ≠ 0, i ≠ j) in increasing order of i,
each of the size the run really sends (the bytes the mixer counted for j
this step divided by j's out-degree: compressed messages included; an
algorithm's several vectors to one neighbour in one step count as one
message of their total size). With bandwidth B (bit/s), latency L and the
transfer time τ_j = m_j · 8 / B::

    σ_j   = max(u_j, s_j)              (overlap: the exchange runs during the computation)
    σ_j   = max(u_j, s_j + c_j)        (overlap = false: the exchange starts after it)
    a_ij  = σ_j + r_ij · τ_j + L       (r_ij: i's place, 1-based, among the messages j sends)
    u_j  ← σ_j + (messages sent) · τ_j
    s_i(k+1) = max(s_i + c_i, max over the step-k messages i receives of a_ij)

So an agent starts step k + 1 when its own computation is done and every
step-k message it waits for has arrived (neighbour-synchronous, as the
runtime behaves). With no computation every agent of a d-regular graph
starts step k at exactly k · (d · τ + L); with computation c and overlap
false at k · (c + d · τ + L), with overlap at k · max(c, d · τ + L).

**All-reduce** (``sgd``, ``msgd``): a ring all-reduce after the slowest
agent's computation: 2(N − 1) rounds of latency plus the bytes each agent
sends in it (2(N − 1)/N · P · b, what the mixer counts) over its uplink;
every agent finishes together. **FedAvg** rounds go through a server with
the agents' bandwidth: the n participants upload m = P · b bytes each in
parallel (m · 8 / B + L), then the server sends the average to each of them
over its uplink (n · m · 8 / B + L). A step in which an agent sends nothing
(a FedAvg local step, ``local``) costs its computation only.

**Delayed messages** (Streaming DiLoCo's overlapped fragments: the rule's
``message_delay``). Messages sent at step k with delay d are waited for at the
start of step k + 1 + d instead of k + 1: s_i(k+1+d) = max(s_i(k+1+d), their
arrivals), so d steps of computation overlap them (they still occupy the
uplink). With d = 0 this is the rule above.

**Losses.** ``drop``: each message independently lost with that
probability; ``link_failure``: each edge down for one step with that
probability (both directions; nothing is sent over it). The draws of step k
come from the stream (seed, "network", k), so the mixing and the clock see
the same losses (:meth:`NetworkClock.losses`). A lost message is not waited
for (the receiver is assumed to learn of the loss at once; a timeout is not
modelled); a dropped one still occupies its sender's uplink.

**Churn** (:mod:`cdsgd.network.churn`). An agent offline at step k
computes nothing and sends nothing: its start time stays where it was, and
the messages of its edges are neither sent nor waited for (its neighbours'
messages are split over the edges that remain). An agent that returns at
step k first receives its donor's model and state (``bytes``): over the
donor's uplink from max(u_d, s_d), arriving a latency later, and starts step
k no earlier than that. An all-reduce spans the agents online.

**Hosts** (``agents_per_host`` = h: agents 0..h−1 share host 0, and so
on; by default every agent is its own host). The uplink belongs to the
host: a message between two agents of one host costs nothing (it
arrives when its sender is ready), and a host sends its agents' messages to
other hosts one after another, in the order (ready time, sender, receiver)::

    d_e = max(d_(e−1), ready_j) + τ_j      (d before the step's first: the host's u_h)
    a_ij = d_e + L

With one agent per host this is the per-agent model above.

**Stragglers**: ``round(stragglers · N)`` agents drawn by (seed, "stragglers")
compute ``straggler_slowdown`` times slower for the whole run.

Example (a 4-ring, 1 kB messages at 8 Mbit/s, 1 ms latency, no computation:
each step takes 2 · 1 ms + 1 ms)::

    >>> import numpy as np, topologies
    >>> from cdsgd.network import network_spec
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> clock = NetworkClock(network_spec("none", {"bandwidth_mbps": 8, "latency_ms": 1, "compute_ms": 0}), W)
    >>> for k in range(3):
    ...     _ = clock.advance(np.zeros(4), np.full(4, 2000.0))
    >>> round(clock.seconds, 9)
    0.009
"""

from __future__ import annotations

import numpy as np

from ..base.seeding import derive_seed
from .spec import NetworkSpec

__all__ = ["NetworkClock", "stragglers"]

#: what a clock can be told about an algorithm's traffic
TRAFFIC = ("neighbours", "allreduce", "server", "none")


def stragglers(spec: NetworkSpec, n_agents: int, seed: int) -> np.ndarray:
    """The boolean N-vector of stragglers: ``round(spec.stragglers · N)`` agents drawn by (seed, "stragglers").

    >>> from cdsgd.network import network_spec
    >>> int(stragglers(network_spec("edge", {"stragglers": 0.25}), 16, 0).sum())
    4
    """
    mask = np.zeros(n_agents, dtype=bool)
    count = int(round(spec.stragglers * n_agents))
    if count:
        rng = np.random.default_rng(derive_seed(seed, "stragglers"))
        mask[rng.choice(n_agents, size=count, replace=False)] = True
    return mask


class _Graph:
    """The directed edges (receiver i ← sender j) of one W_k, sorted by (i, j), with what the clock needs."""

    def __init__(self, W, n: int) -> None:
        import scipy.sparse as sp

        S = sp.coo_array(W if sp.issparse(W) else np.asarray(W, dtype=np.float64))
        keep = (S.row != S.col) & (S.data != 0)
        recv, send, weight = S.row[keep].astype(np.int64), S.col[keep].astype(np.int64), S.data[keep].astype(float)
        order = np.lexsort((send, recv))
        self.recv, self.send, self.weight = recv[order], send[order], weight[order]
        self.out_degree = np.bincount(self.send, minlength=n).astype(np.float64)
        # the sender's order: by sender, then receiver (i's place among j's messages)
        self.by_sender = np.lexsort((self.recv, self.send))
        lo, hi = np.minimum(self.recv, self.send), np.maximum(self.recv, self.send)
        _, self.link = np.unique(lo * n + hi, return_inverse=True)  # one link per unordered pair
        self.n_links = int(self.link.max()) + 1 if len(self.link) else 0


class NetworkClock:
    """Simulated seconds of a run on ``spec``'s network (see the module docstring for the model).

    Args:
        spec: the network (:func:`cdsgd.network.network_spec`).
        W: the N×N mixing matrix (dense or ``scipy.sparse``), a :class:`topologies.Schedule`,
            or None for algorithms without a graph (``traffic`` "allreduce", "server" or "none").
        n_agents: N (default: W's size).
        traffic: "neighbours" (gossip along W_k), "allreduce" (a ring all-reduce),
            "server" (FedAvg's star) or "none".
        overlap: whether an agent's messages go out during its computation (the runtime's default).
        seed: the root of the straggler and loss draws.
        message_bytes: P · b, one full parameter vector (the "server" traffic's message).
        hosts: each agent's host (an N-vector of host ids; default: consecutive blocks of
            ``spec.agents_per_host`` agents, each agent its own host when that is 1).

    Public state: ``start`` (each agent's start time of its next step), ``seconds`` (the latest of
    them: the time at which the last agent finished its last step), ``k`` (steps advanced),
    ``straggler`` (the boolean mask), ``lost_messages`` (messages lost so far).
    """

    def __init__(self, spec: NetworkSpec, W=None, *, n_agents: int | None = None, traffic: str = "neighbours",
                 overlap: bool = True, seed: int = 0, message_bytes: float = 0.0, hosts=None) -> None:
        if traffic not in TRAFFIC:
            raise ValueError(f"traffic {traffic!r} is unknown; allowed: {', '.join(TRAFFIC)}")
        if traffic == "neighbours" and W is None:
            raise ValueError("a gossip clock (traffic='neighbours') needs the mixing matrix W")
        self.spec, self.traffic, self.overlap, self.seed = spec, traffic, bool(overlap), int(seed)
        self.message_bytes = float(message_bytes)
        period = None
        if W is not None:
            period = list(W) if hasattr(W, "period") else [W]  # a topologies.Schedule, or one matrix
        n = n_agents if n_agents is not None else (period[0].shape[0] if period else None)
        if n is None:
            raise ValueError("give n_agents (or W)")
        self.n_agents = int(n)
        self._graphs = [_Graph(Wk, self.n_agents) for Wk in period] if period and traffic == "neighbours" else []
        self.straggler = stragglers(spec, self.n_agents, self.seed)
        self.slowdown = np.where(self.straggler, spec.straggler_slowdown, 1.0)
        self.start = np.zeros(self.n_agents)
        self.hosts = None
        if hosts is None and spec.agents_per_host > 1:
            hosts = np.arange(self.n_agents) // spec.agents_per_host
        if hosts is not None:
            _, self.hosts = np.unique(np.asarray(hosts).reshape(-1), return_inverse=True)
            if len(self.hosts) != self.n_agents:
                raise ValueError(f"hosts must name one host per agent ({self.n_agents}), got {len(self.hosts)}")
        self.uplink = np.zeros(self.n_agents if self.hosts is None else int(self.hosts.max()) + 1)
        self.k = 0
        self.lost_messages = 0
        #: messages in flight past their step (``delay`` > 0): (the step that waits for them, arrival per agent)
        self.pending: list[tuple[int, np.ndarray]] = []

    # ------------------------------------------------------------------ losses

    def graph(self, k: int) -> _Graph:
        """The edges of W_k (gossip clocks only)."""
        return self._graphs[k % len(self._graphs)]

    def losses(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(dropped, failed)``: boolean masks over the edges of W_k (:meth:`graph`) lost at step k.

        Deterministic in (seed, k): the mixing and the clock draw the same. All
        false without ``drop`` and ``link_failure``.
        """
        g = self.graph(k)
        E = len(g.recv)
        if not self.spec.lossy or E == 0:
            none = np.zeros(E, dtype=bool)
            return none, none.copy()
        rng = np.random.default_rng(derive_seed(self.seed, "network", k))
        dropped = rng.random(E) < self.spec.drop
        failed = (rng.random(g.n_links) < self.spec.link_failure)[g.link]
        return dropped & ~failed, failed

    # ------------------------------------------------------------------ clock

    @property
    def seconds(self) -> float:
        """The simulated time at which the last agent finished its last step."""
        return float(self.start.max()) if self.n_agents else 0.0

    def compute_seconds(self, measured: np.ndarray) -> np.ndarray:
        """Each agent's computation time this step: ``compute_ms`` (or ``measured``), times its slowdown."""
        base = np.asarray(measured, dtype=float) if self.spec.compute_ms is None else np.full(
            self.n_agents, self.spec.compute_ms / 1e3)
        return base * self.slowdown

    def advance(self, measured: np.ndarray, sent: np.ndarray, delay: int = 0, phase: int | None = None,
                online: np.ndarray | None = None, joins=()) -> float:
        """Advance by one step: ``measured`` each agent's computation seconds (used when ``compute_ms`` is
        absent; 0 for an agent that did not compute), ``sent`` the bytes each agent sent this step,
        ``delay`` the further steps its messages may take (0: waited for before step k + 1 starts; d: before
        step k + 1 + d, the computation of the d steps between overlapping them); ``phase`` the step of the
        schedule the messages went over (default k; NoLoCo's groups change once per outer step); ``online``
        the boolean N-vector of the agents online this step (None: all; **Churn** in the module docstring)
        and ``joins`` the (agent, donor, bytes) of those that rejoin at its start. Returns :attr:`seconds`."""
        if not (isinstance(delay, (int, np.integer)) and delay >= 0):
            raise ValueError(f"delay must be a whole number of steps >= 0, got {delay!r}")
        landed = [a for due, a in self.pending if due == self.k]
        self.pending = [(due, a) for due, a in self.pending if due != self.k]
        for arrivals in landed:  # messages sent d steps ago are waited for now
            self.start = np.maximum(self.start, arrivals)
        for agent, donor, n_bytes in joins:  # a returning agent starts once its donor's model has reached it
            sigma = max(self.uplink[self._host(donor)], self.start[donor])
            self.uplink[self._host(donor)] = sigma + self.spec.transfer_seconds(n_bytes)
            self.start[agent] = max(self.start[agent], self.uplink[self._host(donor)] + self.spec.latency)
        c = self.compute_seconds(measured)
        online = None if online is None else np.asarray(online, dtype=bool)
        if online is not None:
            c = np.where(online, c, 0.0)  # an offline agent computes nothing (and sends nothing: its bytes are 0)
        sent = np.asarray(sent, dtype=float)
        done = self.start + c
        if self.traffic == "none" or not sent.any():
            finish = done
        elif self.traffic in ("allreduce", "server"):
            finish = self._collective(done, sent, self.n_agents if online is None else int(online.sum()))
        else:
            finish = self._gossip(c, done, sent, self.k if phase is None else phase, online)
        if delay and finish is not done:
            self.pending.append((self.k + 1 + int(delay), finish))
            finish = done
        self.start = finish
        self.k += 1
        return self.seconds

    def _host(self, j: int) -> int:
        """The index of agent j's uplink (its host's)."""
        return int(j) if self.hosts is None else int(self.hosts[j])

    def _collective(self, done: np.ndarray, sent: np.ndarray, n: int) -> np.ndarray:
        spec, part = self.spec, sent > 0
        t0 = done[part].max()
        if self.traffic == "allreduce":  # over the n agents online
            t = t0 + spec.transfer_seconds(sent[part].max()) + 2 * (n - 1) * spec.latency
        else:  # FedAvg's server star: upload in parallel, then the server sends to each participant in turn
            m = self.message_bytes
            t = t0 + spec.transfer_seconds(m) + spec.latency + spec.transfer_seconds(part.sum() * m) + spec.latency
        self.uplink = np.where(part, t, self.uplink)
        return np.where(part, t, done)

    def _gossip(self, c: np.ndarray, done: np.ndarray, sent: np.ndarray, phase: int,
                online: np.ndarray | None = None) -> np.ndarray:
        spec, g = self.spec, self.graph(phase)
        none = np.zeros(len(g.recv), dtype=bool)  # a rule on its own phases (noloco) never loses messages
        dropped, failed = self.losses(self.k) if spec.lossy else (none, none)
        out_degree = g.out_degree
        if online is not None:  # churn: the edges of an offline agent carry nothing, as if failed
            failed = failed | ~(online[g.recv] & online[g.send])
            out_degree = np.bincount(g.send[~failed], minlength=self.n_agents).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            size = np.where(out_degree > 0, sent / out_degree, 0.0)  # one message's bytes, per sender
        tau = size * 8.0 / (spec.bandwidth_mbps * 1e6)
        if self.hosts is not None:
            return self._gossip_hosts(g, tau, done, sent, dropped, failed, online)
        sigma = np.maximum(self.uplink, self.start if self.overlap else done)
        # each edge's place among its sender's messages actually sent (failed links send nothing)
        live = (~failed) & (sent[g.send] > 0)
        order = g.by_sender
        counts = np.cumsum(live[order])
        first = np.searchsorted(g.send[order], g.send[order], side="left")
        before = np.where(first > 0, counts[first - 1], 0)
        place = np.empty(len(order), dtype=np.float64)
        place[order] = counts - before  # 1-based among the sender's live messages (valid where live)
        arrive = sigma[g.send] + place * tau[g.send] + spec.latency
        waited = live & ~dropped
        finish = done.copy()
        np.maximum.at(finish, g.recv[waited], arrive[waited])
        n_sent = np.bincount(g.send[live], minlength=self.n_agents)
        self.uplink = np.where(n_sent > 0, sigma + n_sent * tau, self.uplink)
        self._count_lost(live, dropped, failed, sent, g, online)
        return finish

    def _count_lost(self, live, dropped, failed, sent, g: _Graph, online) -> None:
        """Add the step's lost messages: dropped ones, and those a failed link stopped (not an offline agent's)."""
        stopped = failed & (sent[g.send] > 0)
        if online is not None:
            stopped &= online[g.recv] & online[g.send]
        self.lost_messages += int((live & dropped).sum() + stopped.sum())

    def _gossip_hosts(self, g: _Graph, tau: np.ndarray, done: np.ndarray, sent: np.ndarray, dropped: np.ndarray,
                      failed: np.ndarray, online: np.ndarray | None = None) -> np.ndarray:
        """The gossip step with uplinks per host (the module docstring's **Hosts**)."""
        ready = self.start if self.overlap else done
        live = (~failed) & (sent[g.send] > 0)
        host_s, host_r = self.hosts[g.send], self.hosts[g.recv]
        arrive = ready[g.send].astype(float)  # within a host: when the sender is ready
        across = np.flatnonzero(live & (host_s != host_r))
        for e in across[np.lexsort((g.recv[across], g.send[across], ready[g.send[across]], host_s[across]))]:
            h, j = host_s[e], g.send[e]
            self.uplink[h] = max(self.uplink[h], ready[j]) + tau[j]
            arrive[e] = self.uplink[h] + self.spec.latency
        waited = live & ~dropped
        finish = done.copy()
        np.maximum.at(finish, g.recv[waited], arrive[waited])
        self._count_lost(live, dropped, failed, sent, g, online)
        return finish

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """The clock's state (numbers and lists: loads with ``weights_only``)."""
        return {"k": self.k, "start": self.start.tolist(), "uplink": self.uplink.tolist(),
                "lost_messages": self.lost_messages, "pending": [[due, a.tolist()] for due, a in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`."""
        self.k, self.lost_messages = int(state["k"]), int(state["lost_messages"])
        self.start = np.asarray(state["start"], dtype=float)
        self.uplink = np.asarray(state["uplink"], dtype=float)
        self.pending = [(int(due), np.asarray(a, dtype=float)) for due, a in state.get("pending", [])]
