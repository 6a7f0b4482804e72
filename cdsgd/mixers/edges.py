r"""Per-edge messages: each agent sends a different tensor to each neighbour (:meth:`Mixer.exchange`).

A mixing (``start``/``mix``) sends the same vector to every neighbour and
hands back one weighted sum. Some rules need more: RelaySum sends each
neighbour the sum of what the *other* neighbours sent (a different vector
per edge), CHOCO-SGD sends compressed bytes that the receiver decodes
before it adds them up. Both are written over one primitive:

``mixer.edges``
    the directed edges (i, l) of the agents a mixer holds, as an E×2 int64
    array of global agent indices: i a held agent, l ≠ i a neighbour of i
    (W[i, l] ≠ 0 or W[l, i] ≠ 0), sorted by i, then l. Row i's edges are
    one contiguous run, in ascending neighbour order.
``mixer.exchange(M, *, out=None)``
    M is an E×… stack, M[e] the message agent i sends along e = (i, l); the
    handle's ``wait()`` returns R of the same shape, R[e] the message agent
    i received from l (what l put in M at its edge (l, i)). In the simulator
    this is one gather (R = M[reverse]); in the runtime, edges inside a
    rank's block are gathered too and each cut edge's row goes in one
    message per neighbouring rank, all posted at once.

Messages may be any dtype (``torch.uint8`` rows of compressed bytes: the
bytes counted and, across processes, sent are exactly those rows).
``bytes_sent`` grows by each held agent's out-degree × one row's bytes.

:class:`EdgeTable` is what a rule needs to use the edges: where each held
agent's run of edges starts (``ptr``), the mixing weights along them, and the
ordered weighted sum of received rows (self first, then neighbours ascending:
the exact mode's order).

Example (a path 0 – 1 – 2; each agent sends each neighbour 10·i + l)::

    >>> import torch, topologies
    >>> from cdsgd.mixers import MatrixMixer
    >>> m = MatrixMixer(topologies.mixing_matrix(topologies.build("path", 3)))
    >>> m.edges.tolist()
    [[0, 1], [1, 0], [1, 2], [2, 1]]
    >>> M = torch.tensor([[10.0 * i + l] for i, l in m.edges.tolist()])
    >>> m.exchange(M).wait().flatten().tolist()   # R[(i, l)] = M[(l, i)] = 10·l + i
    [10.0, 1.0, 21.0, 12.0]
"""

from __future__ import annotations

import weakref

import numpy as np
import scipy.sparse as sp
import torch

from .base import neighbourhood, ordered_weighted_sum

__all__ = ["EdgeTable", "edge_list", "edge_table", "out_degrees", "reverse_positions"]


def edge_list(S, agents) -> np.ndarray:
    """The directed edges (i, l) of ``agents`` in the graph of W (``S``: N×N, dense or sparse), E×2 int64.

    l is a neighbour of i when W[i, l] ≠ 0 or W[l, i] ≠ 0 (l ≠ i); sorted by i, then l.
    """
    A = sp.csr_array(S) if not hasattr(S, "tocsr") else S.tocsr()
    A = (abs(A) + abs(A.T)).tocsr()
    rows = []
    for i in agents:
        lo, hi = A.indptr[i], A.indptr[i + 1]
        nb = np.sort(A.indices[lo:hi][A.data[lo:hi] != 0])
        nb = nb[nb != i]
        rows.append(np.stack([np.full(len(nb), i), nb], axis=1))
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 2), dtype=np.int64)


def reverse_positions(edges: np.ndarray, among=None) -> np.ndarray:
    """For each edge e = (i, l) of ``among`` (positions in ``edges``; default all), the position of (l, i) in ``edges``.

    What an exchange gathers where both ends are held: R[e] = M[reverse[e]].
    """
    where = {(int(i), int(l)): e for e, (i, l) in enumerate(edges)}
    among = range(len(edges)) if among is None else among
    return np.asarray([where[(int(edges[e, 1]), int(edges[e, 0]))] for e in among], dtype=np.int64)


def out_degrees(edges: np.ndarray, agents) -> torch.Tensor:
    """How many edges each of ``agents`` sends along (float64, for ``bytes_sent``); ``edges`` sorted by sender."""
    agents = np.asarray(list(agents))
    counts = np.searchsorted(edges[:, 0], agents, side="right") - np.searchsorted(edges[:, 0], agents, side="left")
    return torch.as_tensor(counts, dtype=torch.float64)


class EdgeTable:
    """The held agents' edges, ready for a rule: runs, weights and the ordered sum over received rows.

    Built once per mixer (:func:`edge_table`). ``edges`` as ``mixer.edges``;
    ``ptr[i]:ptr[i + 1]`` are held row i's edges; ``self_weights[i]`` = W[j, j]
    and ``weights[e]`` = W[i, l] for e = (i, l), from the mixer's matrix.
    """

    def __init__(self, edges: np.ndarray, agents: list[int], W=None) -> None:
        self.edges = edges
        self.agents = list(agents)
        self._row = {j: i for i, j in enumerate(self.agents)}  # agent -> held row
        self.local = np.array([self._row[j] for j in edges[:, 0]], dtype=np.int64)  # held row of each edge's sender
        self.ptr = np.searchsorted(self.local, np.arange(len(self.agents) + 1)).astype(np.int64)
        self.degrees = np.diff(self.ptr)
        if W is not None:
            self.self_weights, self.weights = [], np.zeros(len(edges))
            for i, j in enumerate(self.agents):
                w, src = neighbourhood(W, j)
                self.self_weights.append(w[0])
                found = dict(zip(src[1:], w[1:]))
                for e in range(self.ptr[i], self.ptr[i + 1]):
                    self.weights[e] = found.get(int(edges[e, 1]), 0.0)
            self.self_weights = np.asarray(self.self_weights)
        self._tensors: dict = {}

    def senders(self, device) -> torch.Tensor:
        """Each edge's sending held row (an E-long int64 tensor): ``M = stack[senders]`` sends row i on all its edges."""
        key = ("senders", device)
        if key not in self._tensors:
            self._tensors[key] = torch.as_tensor(self.local, device=device)
        return self._tensors[key]

    def sources(self, device) -> torch.Tensor:
        """Each edge's receiving agent as a held row (all agents held): R = stack[sources] is what the edges bring."""
        key = ("sources", device)
        if key not in self._tensors:
            self._tensors[key] = torch.as_tensor([self._row[int(l)] for l in self.edges[:, 1]], dtype=torch.int64,
                                                 device=device)
        return self._tensors[key]

    def _padded(self, dtype, device):
        """(L×d indices into the edge stack, L×d weights) with d the largest degree; padding has weight 0."""
        key = ("padded", dtype, device)
        if key not in self._tensors:
            L, d = len(self.agents), int(self.degrees.max(initial=0))
            idx, wts = np.zeros((L, d), dtype=np.int64), np.zeros((L, d))
            for i in range(L):
                n = self.degrees[i]
                idx[i, :n] = np.arange(self.ptr[i], self.ptr[i + 1])
                wts[i, :n] = self.weights[self.ptr[i]:self.ptr[i + 1]]
            self._tensors[key] = (torch.as_tensor(idx, device=device), torch.as_tensor(wts, dtype=dtype, device=device),
                                  torch.as_tensor(self.self_weights, dtype=dtype, device=device))
        return self._tensors[key]

    def weighted_sum(self, X: torch.Tensor, R: torch.Tensor, out: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """out[i] = W[j, j]·X[i] + Σ_{e = (j, l)} W[j, l]·R[e], the neighbours in ascending order.

        X: the L×P held rows, R: the E×P received rows. ``exact``: each row by
        :func:`ordered_weighted_sum` (the runtime's exact order, bit for bit
        whatever the block); else a padded gather (one pass per neighbour slot).
        """
        if exact:
            for i in range(len(self.agents)):
                e0, e1 = int(self.ptr[i]), int(self.ptr[i + 1])
                ordered_weighted_sum([float(self.self_weights[i]), *self.weights[e0:e1].tolist()],
                                     [X[i], *R[e0:e1]], out[i])
            return out
        idx, wts, sw = self._padded(X.dtype, X.device)
        shape = (-1,) + (1,) * (X.dim() - 1)
        torch.mul(X, sw.view(shape), out=out)
        for s in range(idx.shape[1]):
            out.addcmul_(R.index_select(0, idx[:, s]), wts[:, s].view(shape))
        return out

    def sum_others(self, X: torch.Tensor, R: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[e] = X[i] + Σ_{e' = (j, k), k ≠ l} R[e'] for each edge e = (j, l): what j relays to l (RelaySum).

        Added in ascending k (the same order on every executor), so the result does not depend on the block.
        """
        for i in range(len(self.agents)):
            e0, e1 = int(self.ptr[i]), int(self.ptr[i + 1])
            for e in range(e0, e1):
                out[e].copy_(X[i])
                for f in range(e0, e1):
                    if f != e:
                        out[e].add_(R[f])
        return out

    def sum_received(self, X: torch.Tensor, R: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[i] = X[i] + Σ_{e = (j, l)} R[e], the neighbours in ascending order (the same on every executor)."""
        for i in range(len(self.agents)):
            out[i].copy_(X[i])
            for e in range(int(self.ptr[i]), int(self.ptr[i + 1])):
                out[i].add_(R[e])
        return out


#: each mixer's EdgeTable, built once, kept here (not on the mixer) for as long as the mixer lives
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def edge_table(mixer) -> EdgeTable:
    """The :class:`EdgeTable` of ``mixer`` (built once per mixer)."""
    table = _TABLES.get(mixer)
    if table is None:
        table = _TABLES[mixer] = EdgeTable(np.asarray(mixer.edges), mixer.agents, getattr(mixer, "matrix", None))
    return table
