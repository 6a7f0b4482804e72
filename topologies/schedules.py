r"""Time-varying topologies: periodic schedules of mixing matrices W_0, W_1, …

A :class:`Schedule` is what an executor mixes with at step k: ``s[k]`` is
W_{k mod T}, ``len(s)`` is the period T. Each W_k is doubly stochastic and
non-negative (validated), but need not be symmetric nor connected on its
own: one peer per step is the point. The union of the W_k's supports over a
period must be connected (else agents never reach consensus).

Schedules (``topologies.schedule(name, n, **params)``):

``one_peer_exponential``  (Ying, Yuan, Chen, Hu, Pan & Yin, "Exponential
    graph is provably efficient for decentralized deep training", NeurIPS
    2021) with τ = ⌈log₂ n⌉ and period τ: at step k agent i averages with
    agent (i + 2^(k mod τ)) mod n, weight ½ each: W_k = (I + S^(2^m))/2 with
    S the cyclic shift. Every agent receives from one peer and sends to one.
    When n is a power of two the product over a period is exactly 11ᵀ/n:
    exact average after log₂ n steps (tested). Otherwise it is not:
    :meth:`Schedule.consensus_rate` says how far (0.22 for n = 6, 0.21 for n = 12).
``random_groups``  NoLoCo's peer groups (Kolehmainen et al. 2025): at step
    k a uniformly random partition drawn from (``seed``, k) splits the agents
    into groups of ``group_size`` (which must divide n); each group averages,
    weight 1/group_size. ``period`` (default 100) steps, then it repeats.
``random_matching``  gossip with one random peer per step: at step k a
    uniformly random matching drawn from (``seed``, k) pairs the agents
    (one sits out when n is odd); each pair averages, weight ½. Symmetric.
    ``period`` (default 100) steps, then it repeats.

Rates. A period maps x to M x with M = W_{T−1} ⋯ W_1 W_0 (doubly
stochastic), and contracts the distance to the average by at most
``consensus_rate()`` = ‖M − 11ᵀ/n‖₂ (0: the exact average). ``spectral_gap``
of a schedule is its per-step equivalent, 1 − rate^(1/T).

    >>> s = schedule("one_peer_exponential", 8)
    >>> len(s), s[0][0].tolist(), s[4] is s[1]          # W_4 = W_{4 mod 3}
    (3, [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], True)
    >>> round(s.consensus_rate(), 12)                   # 8 = 2³: exact average after 3 steps
    0.0
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .mixing import DENSE_UP_TO, _check_connected, validate
from .builders import _powers_of_two_below
from .registry import Registry
from .spectral import SPARSE_EIGEN_FROM

__all__ = ["SCHEDULES", "Schedule", "schedule", "schedule_params"]

#: name -> function(n, **params) returning (period, step(k) -> (rows, cols, values))
SCHEDULES: Registry[Callable[..., tuple[int, Callable[[int], tuple]]]] = Registry("schedule")


class Schedule:
    """A periodic sequence of mixing matrices; ``s[k]`` is W_{k mod T}, ``len(s)`` is T.

    Matrices are built on first use and kept (dense up to :data:`DENSE_UP_TO`
    nodes, ``scipy.sparse`` CSR beyond), each validated as doubly stochastic;
    the union of the period's supports is checked connected at construction.
    """

    def __init__(self, name: str, n: int, period: int, step: Callable[[int], tuple], params: dict) -> None:
        self.name, self.n, self.period, self.params = name, int(n), int(period), dict(params)
        self._step = step
        self._mats: dict[int, Any] = {}
        self._rate: float | None = None
        self.sparse = self.n > DENSE_UP_TO
        edges = [self._entries(k) for k in range(self.period)]
        rows = np.concatenate([r[c != r] for r, c, _ in edges] or [np.zeros(0, int)])
        cols = np.concatenate([c[c != r] for r, c, _ in edges] or [np.zeros(0, int)])
        try:
            _check_connected(self.n, rows, cols)
        except ValueError as e:
            raise ValueError(f"schedule {name!r} on {n} nodes, over its period of {period}: {e}") from None

    def _entries(self, k: int):
        r, c, v = self._step(k)
        return np.asarray(r, dtype=np.int64), np.asarray(c, dtype=np.int64), np.asarray(v, dtype=np.float64)

    def __len__(self) -> int:
        return self.period

    def __getitem__(self, k: int):
        k = int(k) % self.period
        if k not in self._mats:
            import scipy.sparse as sp

            r, c, v = self._entries(k)
            S = sp.csr_array((v, (r, c)), shape=(self.n, self.n))
            S.sum_duplicates()
            W = S if self.sparse else S.toarray()
            self._mats[k] = validate(W, symmetric=False, connected=False)
        return self._mats[k]

    def __iter__(self):
        return (self[k] for k in range(self.period))

    def __repr__(self) -> str:
        params = "".join(f", {k}={v!r}" for k, v in sorted(self.params.items()))
        return f"Schedule({self.name!r}, n={self.n}, period={self.period}{params})"

    @property
    def symmetric(self) -> bool:
        """Every W_k is symmetric."""
        return all(abs(W - W.T).max() <= 1e-12 for W in self)

    def union_graph(self):
        """The undirected graph of every pair that exchanges at some step of the period (networkx)."""
        import networkx as nx

        G = nx.Graph()
        G.add_nodes_from(range(self.n))
        for k in range(self.period):
            r, c, _ = self._entries(k)
            G.add_edges_from((int(a), int(b)) for a, b in zip(r, c) if a != b)
        return G

    def apply(self, x: np.ndarray, start: int = 0, steps: int | None = None) -> np.ndarray:
        """W_{start+steps−1} ⋯ W_start x (a period by default); x is n-vector or n×m."""
        for k in range(start, start + (self.period if steps is None else steps)):
            x = self[k] @ x
        return x

    def product(self) -> np.ndarray:
        """M = W_{T−1} ⋯ W_1 W_0 as a dense n×n array (for inspection; n² memory)."""
        return self.apply(np.eye(self.n))

    def consensus_rate(self) -> float:
        """‖M − 11ᵀ/n‖₂: the factor by which one period shrinks the worst distance to the average.

        Computed once (a schedule does not change): dense below
        :data:`~topologies.spectral.SPARSE_EIGEN_FROM` agents, a matrix-free SVD from there on.
        """
        if self._rate is None:
            self._rate = self._consensus_rate()
        return self._rate

    def _consensus_rate(self) -> float:
        n = self.n
        if n == 1:
            return 0.0
        if n < SPARSE_EIGEN_FROM:
            return float(np.linalg.norm(self.product() - 1.0 / n, 2))
        from scipy.sparse.linalg import LinearOperator, svds

        def matvec(x):
            x = np.asarray(x, dtype=np.float64).reshape(n, -1)
            x = x - x.mean(axis=0)
            return self.apply(x)

        def rmatvec(x):
            x = np.asarray(x, dtype=np.float64).reshape(n, -1)
            for k in reversed(range(self.period)):
                x = self[k].T @ x
            return x - x.mean(axis=0)

        op = LinearOperator((n, n), matvec=matvec, rmatvec=rmatvec, dtype=np.float64)
        return float(svds(op, k=1, return_singular_vectors=False, tol=1e-8)[0])


def schedule_params(name: str) -> list[str]:
    """The parameters ``schedule(name, n, ...)`` accepts."""
    import inspect

    return [p for p in inspect.signature(SCHEDULES.get(name)).parameters if p != "n"]


def schedule(name: str, n: int, **params) -> Schedule:
    """The named time-varying topology on ``n`` agents (see the module docstring).

    >>> s = schedule("random_matching", 6, seed=1, period=4)
    >>> len(s), all(abs(W.sum(axis=0) - 1).max() < 1e-12 for W in s)
    (4, True)
    """
    fn = SCHEDULES.get(name)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"schedule {name!r} needs n >= 2 agents, got {n!r}")
    allowed = schedule_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"schedule {name!r} takes no parameter {unknown[0]!r}; "
                         f"allowed: {', '.join(allowed) if allowed else 'none'}")
    period, step = fn(int(n), **params)
    return Schedule(name, int(n), period, step, params)


def _pairs(n: int, i: np.ndarray, j: np.ndarray) -> tuple:
    """Entries of W with weight ½ on each (i, j) and ½ on i's diagonal, 1 on rows that take no part."""
    busy = np.zeros(n, dtype=bool)
    busy[i] = True
    idle = np.flatnonzero(~busy)
    rows = np.concatenate([i, i, idle])
    cols = np.concatenate([i, j, idle])
    vals = np.concatenate([np.full(2 * len(i), 0.5), np.ones(len(idle))])
    return rows, cols, vals


@SCHEDULES.register("one_peer_exponential")
def one_peer_exponential(n: int):
    """Agent i averages with (i + 2^(k mod τ)) mod n, τ = ⌈log₂ n⌉; period τ."""
    offsets = _powers_of_two_below(n)  # the directed exponential graph's, one per step
    agents = np.arange(n)

    def step(k: int):
        return _pairs(n, agents, (agents + offsets[k % len(offsets)]) % n)

    return len(offsets), step


@SCHEDULES.register("random_matching")
def random_matching(n: int, seed: int = 0, period: int = 100):
    """A random matching per step, drawn from (seed, k); matched pairs average. Period ``period``."""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"random_matching: period must be an integer >= 1, got {period!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"random_matching: seed must be an integer >= 0, got {seed!r}")

    def step(k: int):
        perm = np.random.default_rng([seed, k]).permutation(n)
        a, b = perm[0:n - 1:2], perm[1:n:2]
        return _pairs(n, np.concatenate([a, b]), np.concatenate([b, a]))

    return period, step


@SCHEDULES.register("random_groups")
def random_groups(n: int, group_size: int = 2, seed: int = 0, period: int = 100):
    """A random partition into groups of ``group_size`` per step, drawn from (seed, k); each group averages
    (weight 1/group_size). NoLoCo's peer groups (Kolehmainen et al. 2025). Period ``period``."""
    for name, value, low in (("group_size", group_size, 2), ("seed", seed, 0), ("period", period, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"random_groups: {name} must be an integer >= {low}, got {value!r}")
    if n % group_size:
        raise ValueError(f"random_groups: group_size={group_size} must divide the {n} agents "
                         f"(allowed: {', '.join(str(g) for g in range(2, n + 1) if n % g == 0)})")

    def step(k: int):
        groups = np.random.default_rng([seed, k]).permutation(n).reshape(-1, group_size)
        rows = np.repeat(groups, group_size, axis=1).ravel()
        cols = np.tile(groups, (1, group_size)).ravel()
        return rows, cols, np.full(len(rows), 1.0 / group_size)

    return int(period), step
