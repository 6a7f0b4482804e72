r"""Mixing matrices: weight rules, validation, spectral gap.

A mixing matrix Π for a graph G on nodes 0..n-1 is what CDSGD averages with:
``x_j ← Σ_l π_jl x_l``. cdsgd requires Π to be

* non-negative and finite,
* symmetric (π_jl = π_lj),
* doubly stochastic (every row and column sums to 1, within ``TOL``),
* supported on the graph (π_jl = 0 unless j = l or j ~ l),
* and connected (the graph of its non-zero off-diagonal entries is connected),

so that Π^k → 11ᵀ/n and the agents reach consensus. The rate is set by the
second-largest eigenvalue modulus λ = max(|λ₂|, |λₙ|) < 1; the spectral gap is
1 − λ.

Weight rules (d_i is the degree of node i, d_max the largest degree;
off-graph entries are 0; the diagonal is what makes a row sum to 1):

``metropolis``       π_ij = 1 / (1 + max(d_i, d_j)) on edges,
                     π_ii = 1 − Σ_{j~i} π_ij. Always doubly stochastic and
                     symmetric, needs only the neighbours' degrees.
``max_degree``       π_ij = 1 / (1 + d_max) on edges, π_ii = 1 − d_i / (1 + d_max).
                     Always doubly stochastic; needs the global d_max.
``lazy_metropolis``  (I + Π_metropolis) / 2. Eigenvalues in [0, 1], so
                     λ = λ₂ (no oscillating mode), at the cost of a slower rate.
``uniform``          π_ij = 1 / (d_i + 1) on edges and on the diagonal. Row
                     stochastic always, symmetric (so doubly stochastic) only
                     when all degrees are equal: refused on irregular graphs.
``weight``           the edges' "weight" attribute as given, π_ii = 1 − Σ_j π_ij,
                     then validated (e.g. the paper's 5-ring: 0.33 per edge
                     gives 0.34 on the diagonal).

Example::

    >>> from topologies import build
    >>> W = mixing_matrix(build("ring", 4), "metropolis")
    >>> W[0].tolist()
    [0.33333333333333337, 0.3333333333333333, 0.0, 0.3333333333333333]
    >>> round(spectral_gap(W).gap, 6)
    0.666667
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import networkx as nx
import numpy as np

from .registry import Registry

__all__ = ["mixing_matrix", "validate", "spectral_gap", "SpectralGap", "RULES", "SPARSE_EIGEN_FROM", "TOL", "format_gap"]

#: Absolute tolerance on row/column sums and on symmetry.
TOL = 1e-8

RULES: Registry[Callable[[nx.Graph], np.ndarray]] = Registry("mixing rule")


def _check_graph(G: nx.Graph) -> int:
    if G.is_directed():
        raise ValueError("graph is directed; cdsgd needs an undirected graph (symmetric mixing)")
    n = G.number_of_nodes()
    if n == 0:
        raise ValueError("graph has no nodes")
    if set(G.nodes) != set(range(n)):
        raise ValueError(
            "graph nodes must be 0..n-1; relabel with networkx.convert_node_labels_to_integers "
            f"(found nodes such as {sorted(map(repr, G.nodes))[:3]})"
        )
    loops = list(nx.selfloop_edges(G))
    if loops:
        raise ValueError(f"graph has a self-loop at node {loops[0][0]}; self weights come from the rule")
    return n


def _edges(G: nx.Graph) -> tuple[np.ndarray, np.ndarray]:
    """Both ends of every edge as two int arrays (O(edges))."""
    e = np.array(list(G.edges()), dtype=np.int64).reshape(-1, 2)
    return e[:, 0], e[:, 1]


def _degrees(G: nx.Graph, n: int) -> np.ndarray:
    d = np.zeros(n, dtype=np.float64)
    for i, k in G.degree():
        d[i] = k
    return d


def _symmetric(n: int, i: np.ndarray, j: np.ndarray, w_ij: np.ndarray, w_ji: np.ndarray | None = None):
    """The sparse n×n matrix with w_ij at (i, j) and w_ji at (j, i), the diagonal making each row sum to 1."""
    import scipy.sparse as sp

    w_ji = w_ij if w_ji is None else w_ji
    off = sp.csr_array((np.concatenate([w_ij, w_ji]), (np.concatenate([i, j]), np.concatenate([j, i]))), shape=(n, n))
    diag = 1.0 - np.asarray(off.sum(axis=1)).ravel()
    return (off + sp.dia_array((diag[None, :], [0]), shape=(n, n))).tocsr()


def _rule(fn: Callable[[nx.Graph], "object"]) -> Callable[..., "object"]:
    """A rule computes a sparse matrix; called by a user it returns the dense n×n array (``sparse=True``: CSR)."""

    def rule(G: nx.Graph, sparse: bool = False):
        W = fn(G)
        return W if sparse else W.toarray()

    rule.__name__, rule.__doc__, rule.__wrapped__ = fn.__name__, fn.__doc__, fn
    return rule


@RULES.register("metropolis")
@_rule
def metropolis(G: nx.Graph):
    n = G.number_of_nodes()
    d = _degrees(G, n)
    i, j = _edges(G)
    return _symmetric(n, i, j, 1.0 / (1.0 + np.maximum(d[i], d[j])))


@RULES.register("max_degree")
@_rule
def max_degree(G: nx.Graph):
    n = G.number_of_nodes()
    i, j = _edges(G)
    return _symmetric(n, i, j, np.full(len(i), 1.0 / (1.0 + _degrees(G, n).max())))


@RULES.register("lazy_metropolis")
@_rule
def lazy_metropolis(G: nx.Graph):
    import scipy.sparse as sp

    return (0.5 * (sp.eye_array(G.number_of_nodes(), format="csr") + metropolis(G, sparse=True))).tocsr()


@RULES.register("uniform")
@_rule
def uniform(G: nx.Graph):
    n = G.number_of_nodes()
    d = _degrees(G, n)
    if d.min() != d.max():
        lo, hi = int(np.argmin(d)), int(np.argmax(d))
        raise ValueError(
            "rule 'uniform' (1/(d_i+1)) is doubly stochastic only on regular graphs; "
            f"this graph's degrees range from {int(d[lo])} (node {lo}) to {int(d[hi])} (node {hi}); "
            "use 'metropolis' or 'max_degree'"
        )
    i, j = _edges(G)
    return _symmetric(n, i, j, 1.0 / (d[i] + 1.0), 1.0 / (d[j] + 1.0))


@RULES.register("weight")
@_rule
def weight(G: nx.Graph):
    n = G.number_of_nodes()
    i, j = _edges(G)
    w = np.empty(len(i))
    for k, (a, b, data) in enumerate(G.edges(data=True)):
        if "weight" not in data:
            raise ValueError(f"rule 'weight': edge ({a}, {b}) has no 'weight' attribute")
        try:
            w[k] = float(data["weight"])
        except (TypeError, ValueError):
            raise ValueError(f"rule 'weight': edge ({a}, {b}) has non-numeric weight {data['weight']!r}") from None
        if not w[k] >= 0 or not np.isfinite(w[k]):
            raise ValueError(f"rule 'weight': edge ({a}, {b}) has weight {float(w[k])!r}; weights must be finite and >= 0")
    W = _symmetric(n, i, j, w)
    sums = 1.0 - W.diagonal()
    over = np.flatnonzero(sums > 1.0 + TOL)
    if len(over):  # say which node, rather than "W[i, i] is negative" after filling the diagonal
        k = int(over[0])
        raise ValueError(f"rule 'weight': the edge weights at node {k} sum to {_fmt(sums[k])} > 1, "
                         f"leaving self weight {_fmt(1.0 - sums[k])}; the weights at every node must sum to <= 1")
    return W


def mixing_matrix(G: nx.Graph, rule: str = "metropolis", *, sparse: bool = False):
    """The n×n float64 mixing matrix of ``G`` under weight ``rule``, validated.

    Args:
        G: undirected graph on nodes 0..n-1, without self-loops.
        rule: one of ``RULES.names()`` (see the module docstring for the maths).
        sparse: return a ``scipy.sparse.csr_array`` instead of a dense array.
            Time and memory are then O(n + edges) from graph to validated
            matrix: what large graphs (thousands of nodes) need.

    Raises:
        ValueError: unknown rule, unsuitable graph, or a result that fails
            :func:`validate` (e.g. a disconnected graph).

    Example::

        >>> W = mixing_matrix(nx.cycle_graph(1000), sparse=True)
        >>> W.shape, W.nnz    # 3 entries a row, never 1000×1000
        ((1000, 1000), 3000)
    """
    fn = RULES.get(rule)
    _check_graph(G)
    W = fn(G, sparse=True)
    validate(W, G)
    return W if sparse else W.toarray()


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def _is_sparse(W) -> bool:
    return hasattr(W, "tocsr") and hasattr(W, "nnz")


def validate(W, G: nx.Graph | None = None, *, tol: float = TOL):
    """Check that ``W`` is a valid mixing matrix (for ``G`` when given).

    Checks, in order: square 2-D, finite, non-negative, symmetric
    (|W_ij − W_ji| <= tol), every row and column sums to 1 (within tol), zero
    wherever G has no edge (diagonal excepted), and connected (the graph of
    W's non-zero off-diagonal entries, which must then also be G's edges).

    Returns ``W`` as a float64 array, or, for a ``scipy.sparse`` matrix, as a
    float64 CSR array (checked in O(n + non-zeros)). Raises ValueError naming
    the first offending row, entry or nodes and the value found.

    Example::

        >>> import numpy as np
        >>> validate(np.array([[0.5, 0.5], [0.4, 0.6]]))
        Traceback (most recent call last):
        ...
        ValueError: mixing matrix is not symmetric: W[0, 1] = 0.5 but W[1, 0] = 0.4
    """
    if _is_sparse(W):
        S = W.tocsr().astype(np.float64)
        S.sum_duplicates()
        dense = None
    else:
        try:
            dense = np.asarray(W, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mixing matrix is not numeric: {e}") from None
        if dense.ndim != 2:
            raise ValueError(f"mixing matrix must be square and non-empty, got shape {dense.shape}")
        S = None
    shape = dense.shape if S is None else S.shape
    if shape[0] != shape[1] or shape[0] == 0:
        raise ValueError(f"mixing matrix must be square and non-empty, got shape {shape}")
    n = shape[0]
    if S is None:
        import scipy.sparse as sp

        S = sp.csr_array(dense)  # the non-zero entries, row-major: the checks below see them in that order
    coo = S.tocoo()
    rows, cols, vals = coo.row, coo.col, coo.data
    order = np.lexsort((cols, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]

    def first(mask):
        k = int(np.flatnonzero(mask)[0])
        return int(rows[k]), int(cols[k]), vals[k]

    if not np.isfinite(vals).all():
        i, j, v = first(~np.isfinite(vals))
        raise ValueError(f"mixing matrix entry W[{i}, {j}] = {v} is not finite")
    if (vals < 0).any():
        i, j, v = first(vals < 0)
        raise ValueError(f"mixing matrix entry W[{i}, {j}] = {_fmt(v)} is negative")
    D = (S - S.T).tocoo()
    bad = np.abs(D.data) > tol
    if bad.any():
        k = np.lexsort((D.col[bad], D.row[bad]))[0]
        i, j = int(D.row[bad][k]), int(D.col[bad][k])
        raise ValueError(
            f"mixing matrix is not symmetric: W[{i}, {j}] = {_fmt(S[i, j])} but W[{j}, {i}] = {_fmt(S[j, i])}"
        )
    for axis, what in ((1, "row"), (0, "column")):
        sums = dense.sum(axis=axis) if dense is not None else np.asarray(S.sum(axis=axis)).ravel()
        bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
        if len(bad):
            i = bad[0]
            raise ValueError(f"mixing matrix {what} {i} sums to {_fmt(sums[i])}, not 1 (tolerance {tol:g})")
    off = (rows != cols) & (vals > 0)
    if G is not None:
        if G.number_of_nodes() != n:
            raise ValueError(f"mixing matrix is {n}x{n} but the graph has {G.number_of_nodes()} nodes")
        for i, j, v in zip(rows[off], cols[off], vals[off]):
            if not G.has_edge(int(i), int(j)):
                raise ValueError(
                    f"mixing matrix entry W[{i}, {j}] = {_fmt(v)} but nodes {i} and {j} are not linked in the graph"
                )
    _check_connected(n, rows[off], cols[off])
    return S if dense is None else dense


def _check_connected(n: int, rows: np.ndarray, cols: np.ndarray) -> None:
    """Refuse a support graph (edges rows[k]–cols[k]) with more than one component, naming a few."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import connected_components

    A = sp.csr_array((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    count, label = connected_components(A, directed=False)
    if count > 1:
        comps: dict[int, list[int]] = {}
        for node, c in enumerate(label.tolist()):
            comps.setdefault(c, []).append(node)
        ordered = sorted(comps.values(), key=lambda c: c[0])
        shown = "; ".join(str(c if len(c) <= 8 else c[:8] + ["..."]) for c in ordered[:3])
        raise ValueError(
            f"graph is not connected: {count} components ({shown}); agents could never reach consensus"
        )


class SpectralGap(NamedTuple):
    """``gap`` = 1 − ``lambda2``; ``lambda2`` = max(|λ₂|, |λₙ|), the second-largest eigenvalue modulus."""

    gap: float
    lambda2: float


def format_gap(x: float, decimals: int = 4) -> str:
    """``x`` with ``decimals`` decimals, or 4 significant digits where that would show fewer than 3.

    A large sparse graph's gap (1.3e-7 for a ring of 10,000) never prints as 0.

    >>> format_gap(0.6666667), format_gap(1.3159e-07), format_gap(0.00123, 6), format_gap(0.0)
    ('0.6667', '1.316e-07', '0.001230', '0.0000')
    """
    x = float(x)
    if x == 0 or not np.isfinite(x) or abs(x) >= 10.0 ** (2 - decimals):
        return f"{x:.{decimals}f}"
    return f"{x:.4g}"


#: from this many nodes on, :func:`spectral_gap` uses a sparse eigen-solver (below it, the dense one)
SPARSE_EIGEN_FROM = 500


def spectral_gap(W) -> SpectralGap:
    """Spectral gap and second-largest eigenvalue modulus of a symmetric mixing matrix.

    With the eigenvalues λ₁ = 1 >= λ₂ >= ... >= λₙ of a validated W,
    ``lambda2 = max(|λ₂|, |λₙ|)`` and ``gap = 1 − lambda2``; consensus error
    contracts by a factor lambda2 per mixing step. For n = 1, lambda2 = 0.

    Below :data:`SPARSE_EIGEN_FROM` nodes all eigenvalues come from the
    dense solver (``numpy.linalg.eigvalsh``, O(n³)). From there on only the
    ones that matter are computed, by ARPACK's Lanczos iteration
    (``scipy.sparse.linalg.eigsh``): first plain (a few restarts suffice for
    well-connected graphs, whose sparse LU would fill in), then, if it has
    not converged, in shift-invert mode around σ = 1 + 10⁻⁹ (λ₁ and λ₂, the
    two closest): one sparse LU factorisation of W − σI, cheap for the
    poorly connected graphs (rings, tori, paths) whose eigenvalues crowd near
    1, and fast even when the gap is 10⁻⁷ (a ring of 10,000). The gap is then ``1 − λ₂`` computed as ``(λ₁ − λ₂)`` with
    λ₁ = 1, so a gap of 10⁻⁸ keeps its significant digits. λₙ is computed
    only when Gershgorin's bound λₙ >= min_i (2·W_ii − 1) cannot rule out
    |λₙ| > λ₂.

    Example (ring of n with Metropolis weights: gap = 1 − (1/3 + 2/3·cos(2π/n))):

        >>> from topologies import build, mixing_matrix
        >>> import math
        >>> g = spectral_gap(mixing_matrix(build("ring", 10)))
        >>> math.isclose(g.gap, 1 - (1/3 + 2/3 * math.cos(2 * math.pi / 10)))
        True
    """
    if _is_sparse(W):
        S = W.tocsr().astype(np.float64)
        n = S.shape[0]
        if S.ndim != 2 or S.shape[0] != S.shape[1]:
            raise ValueError(f"spectral_gap needs a square matrix, got shape {S.shape}")
        if n and abs(S - S.T).max() > TOL:
            raise ValueError("spectral_gap needs a symmetric matrix; check it with topologies.validate first")
        if n < SPARSE_EIGEN_FROM:
            return _dense_gap(S.toarray())
        return _sparse_gap(S)
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"spectral_gap needs a square matrix, got shape {W.shape}")
    if not np.allclose(W, W.T, atol=TOL, rtol=0):
        raise ValueError("spectral_gap needs a symmetric matrix; check it with topologies.validate first")
    if W.shape[0] >= SPARSE_EIGEN_FROM and np.count_nonzero(W) < 0.1 * W.size:
        import scipy.sparse as sp

        return _sparse_gap(sp.csr_array(W))
    return _dense_gap(W)


def _dense_gap(W: np.ndarray) -> SpectralGap:
    lam = np.sort(np.linalg.eigvalsh(W))[::-1]
    if len(lam) == 1:
        return SpectralGap(1.0, 0.0)
    lambda2 = float(max(abs(lam[1]), abs(lam[-1])))
    return SpectralGap(1.0 - lambda2, lambda2)


def _sparse_gap(S) -> SpectralGap:
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    delta = 1e-9
    try:
        try:  # well-connected graphs (a large gap): plain Lanczos converges in a few restarts
            top = np.sort(eigsh(S, k=2, which="LA", return_eigenvectors=False, maxiter=20, tol=1e-12))
        except ArpackNoConvergence:  # eigenvalues crowd near 1 (a small gap): shift-invert around 1
            top = np.sort(eigsh(S, k=2, sigma=1.0 + delta, which="LM", return_eigenvectors=False))
        lam1, lam2 = float(top[1]), float(top[0])
        # λ₁ = 1 exactly for a doubly stochastic W; measure λ₂ from it to keep a tiny gap's digits
        gap = (lam1 - lam2) + (1.0 - lam1)
        # Gershgorin: λₙ >= min_i (2·W_ii − 1), as each row sums to 1; most graphs need no more
        if -float((2.0 * S.diagonal() - 1.0).min()) > 1.0 - gap:
            try:
                bottom = float(eigsh(S, k=1, which="SA", return_eigenvectors=False, maxiter=20, tol=1e-12)[0])
            except ArpackNoConvergence:
                bottom = float(eigsh(S, k=1, sigma=-1.0 - delta, which="LM", return_eigenvectors=False)[0])
            if abs(bottom) > 1.0 - gap:
                gap = 1.0 - abs(bottom)
    except (ArpackNoConvergence, RuntimeError):  # e.g. a factorisation that fails: fall back to every eigenvalue
        return _dense_gap(S.toarray())
    return SpectralGap(float(gap), float(1.0 - gap))
