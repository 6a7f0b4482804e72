r"""Mixers: how an update rule averages with other agents.

The update rules in :mod:`cdsgd.algorithms` never know who their neighbours
are or whether the agents live in one process. They receive a :class:`Mixer`
and call two operations on it:

``start(X).wait()`` (or ``mix(X)``)
    Π X: each agent's weighted sum Σ_l π_jl x_l of its neighbours' rows
    (used by CDSGD/CDMSGD on parameters).
``average(X, mask=None)``
    the mean over all (or the masked, participating) agents, given back to
    every agent: 11ᵀX/N (centralized SGD on gradients, FedAvg on parameters).

In the simulator X is the N×P stack of all agents' flat parameters and the
mixer is a :class:`MatrixMixer`; in the distributed runtime X is one rank's
P-vector and the mixer exchanges it with the neighbours. ``start`` returns a
:class:`Handle` so an executor can post the exchange before the backward pass
and wait for it afterwards (the mixing of x_j and the gradient at x_j are
independent).

Every mixer counts what each agent would send (``bytes_sent``, one entry per
agent it represents): degree_j·P·(element size) per mixing step, and
2(N−1)/N·P·(element size) per all-average (a ring all-reduce's volume).

Example::

    >>> import torch, topologies
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> m = MatrixMixer(W)
    >>> X = torch.arange(4.0, dtype=torch.float64).unsqueeze(1)   # agent j holds x_j = j
    >>> [round(v, 4) for v in m.mix(X).squeeze(1).tolist()]
    [1.3333, 1.0, 2.0, 1.6667]
    >>> m.bytes_sent.tolist()   # degree 2 × 1 element × 8 bytes
    [16.0, 16.0, 16.0, 16.0]
"""

from __future__ import annotations

import abc
import warnings
from typing import Sequence

import numpy as np
import torch

import topologies

from .base.compat import renamed_attribute

__all__ = [
    "Handle",
    "Mixer",
    "MatrixMixer",
    "ScheduleMixer",
    "allreduce_bytes",
    "is_schedule",
    "is_sparse",
    "neighbourhood",
    "ordered_weighted_sum",
]


class Handle:
    """A mixing in flight; :meth:`wait` returns Σ_l π_jl x_l."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


def allreduce_bytes(n_agents: int, numel: int, element_size: int) -> float:
    """Bytes one agent sends in a ring all-reduce of ``numel`` elements: 2(N−1)/N·P·size."""
    return 2.0 * (n_agents - 1) / n_agents * numel * element_size if n_agents > 1 else 0.0


def ordered_weighted_sum(weights: Sequence[float], tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = Σ_k w_k · t_k`` as explicit multiply-adds in the given order.

    The exact mode of both executors computes the mixing with this one
    function (self first, then neighbours in ascending rank), so that the
    simulator and the runtime round identically.
    """
    torch.mul(tensors[0], weights[0], out=out)
    for w, t in zip(weights[1:], tensors[1:]):
        out.add_(t, alpha=w)
    return out


def is_sparse(W) -> bool:
    """True for a ``scipy.sparse`` matrix (what ``topologies.mixing_matrix(..., sparse=True)`` returns)."""
    return hasattr(W, "tocsr") and hasattr(W, "nnz")


def is_schedule(W) -> bool:
    """True for a time-varying :class:`topologies.Schedule` (what ``topologies.schedule(...)`` returns)."""
    return isinstance(W, topologies.Schedule)


def neighbourhood(W, j: int) -> tuple[list[float], list[int]]:
    """Row j of Π as (weights, sources): agent j itself first, then its neighbours ascending.

    The one definition of "who agent j averages with, and how much" that
    both the in-process mixer and the runtime's neighbour exchange use (and
    the order in which the exact mode adds them up). ``W`` is dense (array
    or nested lists) or a ``scipy.sparse`` matrix (then O(degree)).

    >>> neighbourhood([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]], 1)
    ([0.25, 0.5, 0.25], [1, 0, 2])
    """
    if is_sparse(W):
        S = W if getattr(W, "format", None) == "csr" else W.tocsr()
        lo, hi = S.indptr[j], S.indptr[j + 1]
        cols, vals = S.indices[lo:hi], S.data[lo:hi]
        keep = vals != 0
        found = dict(zip(cols[keep].tolist(), vals[keep].tolist()))
        src = [j] + sorted(c for c in found if c != j)
        return [float(found.get(c, 0.0)) for c in src], src
    row = np.asarray(W, dtype=np.float64)[j]
    src = [j] + [int(l) for l in np.flatnonzero(row) if l != j]
    return [float(row[l]) for l in src], src


class Mixer(abc.ABC):
    """Base class: ``start``/``mix`` apply Π, ``average`` applies 11ᵀ/N.

    Results may live in buffers the mixer reuses: they are valid until the
    mixer's next call of the same kind (executors consume them at once).
    """

    #: number of agents in the whole system
    n_agents: int
    #: bytes each agent represented here has sent so far (float64 tensor, one entry per row)
    bytes_sent: torch.Tensor
    #: bytes this process has sent to other processes (0 for a mixer that keeps every agent in-process)
    bytes_across: float = 0.0
    #: the agents (global indices) whose rows the stacks handed to this mixer hold
    agents: list[int]

    rows = renamed_attribute()  # the old name of agents (cdsgd.base.compat)

    @abc.abstractmethod
    def start(self, X: torch.Tensor, slot: str = "params") -> Handle:
        """Begin computing Π X; the handle's ``wait()`` returns it.

        ``slot`` names the buffers the result lives in: mixings of different
        slots may be in flight (or held) at once, e.g. parameters and a
        gradient tracker in the same step; a result is valid until the next
        ``start`` of the same slot. Every process must start its slots in
        the same order (messages to one peer pair up in order).
        """

    def mix(self, X: torch.Tensor, slot: str = "params") -> torch.Tensor:
        """Π X (blocking): ``start(X, slot).wait()``."""
        return self.start(X, slot).wait()

    @abc.abstractmethod
    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of the (masked) agents' X, returned to every agent."""

    def at(self, k: int) -> "Mixer":
        """The mixer of step k (a time-varying :class:`ScheduleMixer` has one per step of its period)."""
        return self


def _numel_per_agent(X: torch.Tensor) -> int:
    return X[0].numel() if X.dim() > 1 else X.numel()


#: the mixer multiplies the dense N×N matrix when more than this fraction of its entries are
#: non-zero (small or dense graphs: a ring of 5, a complete graph); else it works edge by edge
DENSE_FRACTION = 0.25
#: bytes of one block of rows in the edge-wise product (kept within a core's cache)
BLOCK_BYTES = 1 << 20
#: the edge-wise product pads every row to the largest degree; beyond this multiple of the mean
#: degree (a star, say) it uses torch's sparse CSR product instead
PAD_LIMIT = 4.0


class MatrixMixer(Mixer):
    """Π X for an N×P stack of all agents (the simulator's mixer).

    Args:
        W: the N×N mixing matrix: dense (numpy or nested lists) or
            ``scipy.sparse``; validated with :func:`topologies.validate`.
            None means Π = 11ᵀ/N (every agent averages with all), with
            ``n_agents`` given: nothing N×N is stored.
        exact: compute each row as :func:`ordered_weighted_sum` over the
            agent itself and then its neighbours in ascending order, instead
            of the fast product: slower, but rounds exactly as the runtime.
        validate: check W (turn off only for matrices that are not meant to be
            doubly stochastic, e.g. in tests, or that were validated already).
        method: how the fast product is computed: ``"auto"`` (below), or one of
            ``"dense"``, ``"edges"``, ``"csr"`` (for measurements).

    The fast product is chosen by the shape of the graph. ``dense``: one
    ``torch.mm`` with the N×N matrix, O(N²·P), for dense graphs (more than
    :data:`DENSE_FRACTION` of the entries non-zero, which includes every
    graph of a handful of agents). ``edges`` otherwise: O(N·d·P) for the N·d non-zero
    entries: the rows are taken in blocks of about :data:`BLOCK_BYTES`; a
    block's output is w_self·x_self plus, for each k-th neighbour, a gathered
    block of neighbour rows times its weights. Rows are padded to the largest
    degree (with weight 0 on the agent itself), so irregular graphs whose
    largest degree exceeds :data:`PAD_LIMIT` times the mean (a star) use
    ``csr``: torch's sparse CSR product. No N×N array is built on these paths:
    setup is O(N·d). All reuse preallocated outputs (no allocation per step).
    """

    def __init__(self, W, *, exact: bool = False, validate: bool = True, method: str = "auto",
                 n_agents: int | None = None) -> None:
        if W is None:
            if n_agents is None or n_agents < 1:
                raise ValueError(f"MatrixMixer(None) stands for Π = 11ᵀ/N and needs n_agents >= 1, got {n_agents!r}")
            self.n_agents, self._csr, self._dense64 = int(n_agents), None, None
            self.degrees = torch.full((self.n_agents,), float(self.n_agents - 1), dtype=torch.float64)
        else:
            if is_sparse(W):
                S = topologies.validate(W) if validate else W.tocsr().astype(np.float64)
                self._dense64 = None
            else:
                D = np.asarray(W, dtype=np.float64)
                if validate:
                    topologies.validate(D)
                import scipy.sparse as sp

                S, self._dense64 = sp.csr_array(D), D
            S.sort_indices()
            self._csr = S
            self.n_agents = S.shape[0]
            nnz_rows = np.diff(S.indptr)
            has_self = S.diagonal() != 0
            self.degrees = torch.as_tensor(nnz_rows - has_self, dtype=torch.float64)
        allowed = ("auto", "dense", "edges", "csr")
        if method not in allowed:
            raise ValueError(f"mixing method {method!r} is unknown; allowed: {', '.join(allowed)}")
        self.agents = list(range(self.n_agents))
        self.exact = exact
        self.method = self._choose() if method == "auto" else method
        self.bytes_sent = torch.zeros(self.n_agents, dtype=torch.float64)
        self._rows_cache: list[tuple[list[float], list[int]]] | None = None
        self._tensors: dict[tuple, object] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    # ------------------------------------------------------------ structure

    def _choose(self) -> str:
        if self._csr is None:
            return "mean"
        n, nnz = self.n_agents, self._csr.nnz
        if nnz > DENSE_FRACTION * n * n:
            return "dense"
        per_row = np.diff(self._csr.indptr)
        return "edges" if per_row.max() <= PAD_LIMIT * per_row.mean() else "csr"

    @property
    def W64(self) -> np.ndarray:
        """The dense N×N matrix (built on demand: avoid for large N)."""
        if self._dense64 is None:
            self._dense64 = (np.full((self.n_agents,) * 2, 1.0 / self.n_agents) if self._csr is None
                             else self._csr.toarray())
        return self._dense64

    @property
    def _rows(self) -> list[tuple[list[float], list[int]]]:
        """Row j's (weights, sources): self first, then neighbours ascending (the exact mode's order)."""
        if self._rows_cache is None:
            self._rows_cache = [neighbourhood(self._csr if self._csr is not None else self.W64, j)
                                for j in range(self.n_agents)]
        return self._rows_cache

    def _tables(self, X: torch.Tensor):
        """The edge-wise product's padded (N×d) source indices and weights, self in column 0."""
        key = ("edges", X.dtype, X.device)
        if key not in self._tensors:
            S, n = self._csr, self.n_agents
            per_row = np.diff(S.indptr)
            d = int((per_row + (S.diagonal() == 0)).max())
            idx = np.repeat(np.arange(n)[:, None], d, axis=1)
            wts = np.zeros((n, d))
            wts[:, 0] = S.diagonal()
            row_of = np.repeat(np.arange(n), per_row)
            off = S.indices != row_of
            r, c, v = row_of[off], S.indices[off], S.data[off]
            # position of each off-diagonal entry within its row, after the self column
            first = np.searchsorted(r, np.arange(n))
            pos = 1 + np.arange(len(r)) - first[r]
            idx[r, pos], wts[r, pos] = c, v
            self._tensors[key] = (torch.as_tensor(idx, device=X.device),
                                  torch.as_tensor(wts, dtype=X.dtype, device=X.device))
        return self._tensors[key]

    def _matrix(self, X: torch.Tensor) -> torch.Tensor:
        key = ("dense", X.dtype, X.device)
        if key not in self._tensors:
            self._tensors[key] = torch.as_tensor(self.W64, dtype=X.dtype, device=X.device)
        return self._tensors[key]

    def _sparse(self, X: torch.Tensor) -> torch.Tensor:
        key = ("csr", X.dtype, X.device)
        if key not in self._tensors:
            S = self._csr
            with warnings.catch_warnings():  # "sparse CSR support is in beta": the product used here is stable
                warnings.simplefilter("ignore", UserWarning)
                self._tensors[key] = torch.sparse_csr_tensor(
                    torch.as_tensor(S.indptr, dtype=torch.int64), torch.as_tensor(S.indices, dtype=torch.int64),
                    torch.as_tensor(S.data, dtype=X.dtype), size=S.shape, device=X.device, check_invariants=False)
        return self._tensors[key]

    def _buffer(self, X: torch.Tensor, purpose: str, shape=None) -> torch.Tensor:
        """A preallocated output like X (reused: valid until the next call)."""
        shape = tuple(X.shape) if shape is None else tuple(shape)
        key = (purpose, shape, X.dtype, X.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = X.new_empty(shape)
        return buf

    def _check(self, X: torch.Tensor) -> None:
        if X.dim() < 1 or X.shape[0] != self.n_agents:
            raise ValueError(f"MatrixMixer expects a stack of {self.n_agents} agents (N×P), got shape {tuple(X.shape)}")

    # ------------------------------------------------------------ products

    def _edges(self, X2: torch.Tensor, out2: torch.Tensor) -> None:
        idx, wts = self._tables(X2)
        n, P = X2.shape
        rows = max(1, BLOCK_BYTES // max(1, P * X2.element_size()))
        tmp = self._buffer(X2, "gather", (min(rows, n), P))
        for b0 in range(0, n, rows):
            b1 = min(n, b0 + rows)
            o, t = out2[b0:b1], tmp[:b1 - b0]
            torch.index_select(X2, 0, idx[b0:b1, 0], out=o)
            o.mul_(wts[b0:b1, 0:1])
            for k in range(1, idx.shape[1]):
                torch.index_select(X2, 0, idx[b0:b1, k], out=t)
                o.addcmul_(t, wts[b0:b1, k:k + 1])

    def product(self, X2: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        """``out2 = W X2`` for an N×P matrix X2 by the fast method (not counted as traffic; ignores ``exact``).

        The product itself, for a caller that owns the bookkeeping (the
        runtime's :class:`cdsgd.runtime.BlockMixer` applies it to the block of
        W among the agents one process holds).
        """
        if self.method == "mean":
            mean = torch.mean(X2, dim=0, keepdim=True, out=self._buffer(X2, "mean", (1, X2.shape[1])))
            out2.copy_(mean.expand_as(out2))
        elif self.method == "dense":
            torch.mm(self._matrix(X2), X2, out=out2)
        elif self.method == "edges":
            self._edges(X2, out2)
        else:
            torch.mm(self._sparse(X2), X2, out=out2)
        return out2

    def start(self, X: torch.Tensor, slot: str = "params") -> Handle:
        self._check(X)
        self.bytes_sent += self.degrees * (_numel_per_agent(X) * X.element_size())
        out = self._buffer(X, ("mix", slot))
        if self.exact:
            for j, (weights, src) in enumerate(self._rows):
                ordered_weighted_sum(weights, [X[l] for l in src], out[j])
        else:
            self.product(X.reshape(self.n_agents, -1), out.view(self.n_agents, -1))
        return Handle(out)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check(X)
        self.bytes_sent += allreduce_bytes(self.n_agents, _numel_per_agent(X), X.element_size())
        mean = X.mean(dim=0, keepdim=True) if mask is None else X[mask.to(torch.bool)].mean(dim=0, keepdim=True)
        return self._buffer(X, "average").copy_(mean.expand_as(X))


class ScheduleMixer(Mixer):
    """Π_k X for a time-varying :class:`topologies.Schedule`: one mixer per step of its period.

    ``at(k)`` is the mixer of W_{k mod T}, built on first use by ``make(W_k)``
    (a :class:`MatrixMixer` in the simulator, the runtime's ``BlockMixer``
    across processes, which then exchanges with that step's peers only).
    The phases share one ``bytes_sent`` counter; ``average`` needs no W and
    uses the first. Executors and :class:`~cdsgd.algorithms.DecentralizedOptimizer`
    call ``at(k)``; ``start`` without a step is refused.
    """

    def __init__(self, schedule, make) -> None:
        self.schedule, self._make = schedule, make
        self._phases: dict[int, Mixer] = {}
        first = self.at(0)
        self.n_agents, self.agents = first.n_agents, list(first.agents)
        self.bytes_sent = first.bytes_sent

    def at(self, k: int) -> Mixer:
        k = int(k) % len(self.schedule)
        if k not in self._phases:
            mixer = self._make(self.schedule[k])
            if self._phases:
                mixer.bytes_sent = self.bytes_sent  # one counter for every step of the period
            self._phases[k] = mixer
        return self._phases[k]

    @property
    def bytes_across(self) -> float:
        """What this process sent to other processes, over every step of the period."""
        return float(sum(m.bytes_across for m in self._phases.values()))

    @bytes_across.setter
    def bytes_across(self, value: float) -> None:
        for k, m in self._phases.items():
            m.bytes_across = float(value) if k == 0 else 0.0

    def start(self, X: torch.Tensor, slot: str = "params") -> Handle:
        raise ValueError(f"a time-varying schedule ({self.schedule!r}) mixes with W_k: call mixer.at(k).start(X)")

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.at(0).average(X, mask)

