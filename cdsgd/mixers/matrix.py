"""The in-process mixer: Π X for the N×P stack of all agents (:class:`MatrixMixer`)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

import topologies

from ..base.flat import kept
from .edges import edge_list, out_degrees, reverse_positions
from .base import (Handle, Mixer, allreduce_bytes, is_schedule, is_sparse, neighbourhood, ordered_mean,
                   ordered_weighted_sum, result_tensor)

__all__ = ["BLOCK_BYTES", "DENSE_FRACTION", "MatrixMixer", "PAD_LIMIT"]


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
        validate: check W here (off for a matrix validated already, or a
            push-sum P; an update rule still checks the matrix of the mixer it
            is given, see ``Algorithm.check_mixing``).
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
    setup is O(N·d). With ``out=`` given a step allocates nothing (the
    scratch of the edge-wise product is kept).
    """

    def __init__(self, W, *, exact: bool = False, validate: bool = True, method: str = "auto",
                 n_agents: int | None = None) -> None:
        if is_schedule(W):
            raise ValueError(f"MatrixMixer takes one N×N matrix, got the time-varying schedule {W!r}: use "
                             "cdsgd.make_mixer(schedule), which gives a ScheduleMixer (W_k at step k)")
        if W is None:
            if n_agents is None or n_agents < 1:
                raise ValueError(f"MatrixMixer(None) stands for Π = 11ᵀ/N and needs n_agents >= 1, got {n_agents!r}")
            self.n_agents, self._csr, self._dense64 = int(n_agents), None, None
            self.matrix = None
            self.degrees = torch.full((self.n_agents,), float(self.n_agents - 1), dtype=torch.float64)
        else:
            if is_sparse(W):
                S = topologies.validate(W) if validate else W.tocsr().astype(np.float64)
                self._dense64 = None
            else:
                D = np.asarray(W.detach().cpu() if isinstance(W, torch.Tensor) else W, dtype=np.float64)
                if validate:
                    topologies.validate(D)
                import scipy.sparse as sp

                S, self._dense64 = sp.csr_array(D), D
            S.sort_indices()
            self._csr = S
            self.matrix = S if self._dense64 is None else self._dense64
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
        self._edge_list: np.ndarray | None = None

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
        """A preallocated scratch tensor (internal: consumed within the call that asks for it)."""
        return kept(self._buffers, purpose, X.shape if shape is None else shape, X)

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

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        self._check(X)
        out = result_tensor(X, out)
        self.bytes_sent += self.degrees * (_numel_per_agent(X) * X.element_size())
        if self.exact:
            for j, (weights, src) in enumerate(self._rows):
                ordered_weighted_sum(weights, [X[l] for l in src], out[j])
        else:
            self.product(X.reshape(self.n_agents, -1), out.view(self.n_agents, -1))
        return Handle(out)

    @property
    def edges(self) -> np.ndarray:
        """Every directed edge (i, l) of the graph, sorted (:mod:`cdsgd.mixers.edges`; the complete graph for 11ᵀ/N)."""
        if self._edge_list is None:
            S = self._csr if self._csr is not None else np.ones((self.n_agents,) * 2)
            self._edge_list = edge_list(S, self.agents)
        return self._edge_list

    def exchange(self, M: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        """Per-edge messages in one gather: R[(i, l)] = M[(l, i)] (:mod:`cdsgd.mixers.edges`)."""
        E = len(self.edges)
        if M.dim() < 1 or M.shape[0] != E:
            raise ValueError(f"exchange takes one message per edge ({E}×…), got shape {tuple(M.shape)}")
        out = result_tensor(M, out, "exchange")
        key = ("reverse", M.device)
        if key not in self._tensors:
            self._tensors[key] = torch.as_tensor(reverse_positions(self.edges), device=M.device)
        if "out-degree" not in self._tensors:
            self._tensors["out-degree"] = out_degrees(self.edges, self.agents)
        torch.index_select(M, 0, self._tensors[key], out=out)
        self.bytes_sent += self._tensors["out-degree"] * (_numel_per_agent(M) * M.element_size())
        return Handle(out)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(X)
        out = result_tensor(X, out, "average")
        self.bytes_sent += allreduce_bytes(self.n_agents, _numel_per_agent(X), X.element_size())
        if self.exact:  # summed in agent order, as the runtime's exact mode does
            mean = ordered_mean(X.reshape(X.shape[0], -1), mask, self._buffer(X, "ordered_mean", (X[0].numel(),)))
            return out.copy_(mean.view(1, *X.shape[1:]).expand_as(X))
        if mask is None:
            mean = torch.mean(X, dim=0, keepdim=True, out=self._buffer(X, "mean", (1, *X.shape[1:])))
        else:
            mean = X[mask.to(torch.bool)].mean(dim=0, keepdim=True)
        return out.copy_(mean.expand_as(X))
