r"""Mixing matrices: weight rules and validation (their spectra: :mod:`topologies.spectral`).

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
                     gives 0.34 on the diagonal). A node's ``self_weight``
                     attribute (a full W read from a file, :func:`topologies.load`)
                     is π_ii as given; its row must then sum to 1.

Example::

    >>> from topologies import build
    >>> W = mixing_matrix(build("ring", 4), "metropolis")
    >>> W[0].tolist()
    [0.33333333333333337, 0.3333333333333333, 0.0, 0.3333333333333333]
    >>> from topologies import spectral_gap
    >>> round(spectral_gap(W).gap, 6)
    0.666667
"""

from __future__ import annotations

from typing import Callable

import networkx as nx
import numpy as np

from .registry import Registry

__all__ = ["mixing_matrix", "validate", "RULES", "COLUMN_RULES", "DENSE_UP_TO", "TOL"]

#: Absolute tolerance on row/column sums and on symmetry.
TOL = 1e-8

#: A topology's mixing matrices are dense arrays up to this many nodes and scipy CSR beyond
#: (:func:`topologies.graph_and_mixing`, :class:`topologies.Schedule`).
# 32 and not 16: the runs and the schedules have always stored W by this cut-off, and `cdsgd topo` must
# describe the very W a run mixes with; its 16 was the width of the matrix it prints, a display limit, not
# a storage one. A 32×32 array is 8 KiB; beyond, the N×N array grows as N² while CSR stays O(edges). The
# numbers do not depend on the form (spectral_gap takes the dense solver below SPARSE_EIGEN_FROM either way,
# and cdsgd's mixers choose their product by the fraction of non-zeros, not by the type of W).
DENSE_UP_TO = 32

RULES: Registry[Callable[[nx.Graph], np.ndarray]] = Registry("mixing rule")


def _check_graph(G: nx.Graph, *, directed_ok: bool = False) -> int:
    if G.is_directed() and not directed_ok:
        raise ValueError("graph is directed; cdsgd needs an undirected graph (symmetric mixing), or "
                         "mixing=push_sum with algorithm=sgp for a directed one")
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
        raise ValueError(f"graph has a self-loop at node {loops[0][0]}; a self weight is the node attribute "
                         "'self_weight' (used by rule 'weight'), not an edge")
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


#: rules whose matrices are column-stochastic only (for push-sum, ``algorithm=sgp``), directed graphs allowed
COLUMN_RULES = ("push_sum",)


@RULES.register("push_sum")
@_rule
def push_sum(G: nx.Graph):
    """P[j, i] = 1/(1 + out-degree of i) for each edge i → j and for j = i: every agent splits its value
    evenly between itself and the agents it sends to. Columns sum to 1 (rows need not): push-sum's
    weights, for directed graphs (an undirected edge counts both ways)."""
    import scipy.sparse as sp

    n = G.number_of_nodes()
    e = np.array([(a, b) for a, b in G.edges()] + ([(b, a) for a, b in G.edges()] if not G.is_directed() else []),
                 dtype=np.int64).reshape(-1, 2)
    src, dst = e[:, 0], e[:, 1]
    out = np.bincount(src, minlength=n).astype(np.float64)
    share = 1.0 / (1.0 + out)
    rows = np.concatenate([dst, np.arange(n)])
    cols = np.concatenate([src, np.arange(n)])
    return sp.csr_array((share[cols], (rows, cols)), shape=(n, n))


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
    given = {int(k): v for k, v in G.nodes(data="self_weight") if v is not None}  # a full W's diagonal
    for k, v in sorted(given.items()):
        if not (np.isfinite(v) and v >= 0):
            raise ValueError(f"rule 'weight': node {k}'s self weight is {v!r}; self weights must be finite and >= 0")
        if abs(v + sums[k] - 1.0) > TOL:
            raise ValueError(f"rule 'weight': node {k}'s self weight {_fmt(v)} and edge weights {_fmt(sums[k])} "
                             f"sum to {_fmt(v + sums[k])}, not 1 (tolerance {TOL:g}): each row of W must sum to 1")
    over = np.flatnonzero(sums > 1.0 + TOL)
    if len(over):  # say which node, rather than "W[i, i] is negative" after filling the diagonal
        k = int(over[0])
        raise ValueError(f"rule 'weight': the edge weights at node {k} sum to {_fmt(sums[k])} > 1, "
                         f"leaving self weight {_fmt(1.0 - sums[k])}; the weights at every node must sum to <= 1")
    if given:  # the diagonal as given, not the remainder (equal within TOL)
        import scipy.sparse as sp

        fix = np.zeros(n)
        fix[list(given)] = [v - (1.0 - sums[k]) for k, v in given.items()]
        W = (W + sp.dia_array((fix[None, :], [0]), shape=(n, n))).tocsr()
    return W


def mixing_matrix(G: nx.Graph, rule: str = "metropolis", *, sparse: bool = False):
    """The n×n float64 mixing matrix of ``G`` under weight ``rule``, validated.

    Args:
        G: undirected graph on nodes 0..n-1, without self-loops (rule ``weight`` takes a node's
            ``self_weight`` attribute as its diagonal entry).
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
    _check_graph(G, directed_ok=rule in COLUMN_RULES)
    W = fn(G, sparse=True)
    if rule in COLUMN_RULES:  # column-stochastic only (push-sum): neither symmetric nor row-stochastic
        validate(W, G, symmetric=False, row_sums=False)
    else:
        validate(W, G)
    return W if sparse else W.toarray()


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def _is_sparse(W) -> bool:
    return hasattr(W, "tocsr") and hasattr(W, "nnz")


def validate(W, G: nx.Graph | None = None, *, tol: float = TOL, symmetric: bool = True, connected: bool = True,
             row_sums: bool = True):
    """Check that ``W`` is a valid mixing matrix (for ``G`` when given).

    Checks, in order: square 2-D, finite, non-negative, symmetric
    (|W_ij − W_ji| <= tol, and W_ij != 0 exactly where W_ji != 0: the
    neighbour relation is mutual), every row and column sums to 1 (within
    tol), zero wherever G has no edge (diagonal excepted), and connected (the
    graph of W's non-zero off-diagonal entries, which must then also be G's
    edges).
    ``symmetric=False`` and ``connected=False`` leave those two checks out:
    one step of a time-varying schedule (:mod:`topologies.schedules`) is
    doubly stochastic but may be neither; the schedule checks connectivity
    over its period. ``row_sums=False`` (with ``symmetric=False``) accepts a
    column-stochastic push-sum matrix; it must then be strongly connected
    (every agent's value reaches every other along W's directed edges, l → j
    for W[j, l] > 0), and an edge of a directed ``G`` must run l → j.

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
    S, dense = _as_csr(W)
    n = S.shape[0]
    rows, cols, vals = _entries(S)
    _check_entries(rows, cols, vals)
    if symmetric:
        _check_symmetric(S, rows, cols, vals, tol)
    _check_sums(S, dense, tol, row_sums)
    off = (rows != cols) & (vals > 0)
    if G is not None:
        _check_edges(G, n, rows[off], cols[off], vals[off])
    if connected:
        _check_connected(n, rows[off], cols[off], directed=not row_sums)
    return S if dense is None else dense


def _as_csr(W) -> tuple:
    """(``W`` as a float64 CSR matrix, ``W`` as a float64 array or None when it is sparse), if square and non-empty."""
    if _is_sparse(W):
        S = W.tocsr().astype(np.float64)
        S.sum_duplicates()
        if S.shape[0] != S.shape[1] or S.shape[0] == 0:
            raise ValueError(f"mixing matrix must be square and non-empty, got shape {S.shape}")
        return S, None
    try:
        dense = np.asarray(W, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"mixing matrix is not numeric: {e}") from None
    if dense.ndim != 2 or dense.shape[0] != dense.shape[1] or dense.shape[0] == 0:
        raise ValueError(f"mixing matrix must be square and non-empty, got shape {dense.shape}")
    import scipy.sparse as sp

    return sp.csr_array(dense), dense


def _entries(S) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, columns, values) of ``S``'s stored entries in row-major order: the checks see them in that order."""
    coo = S.tocoo()
    rows, cols, vals = coo.row, coo.col, coo.data
    order = np.lexsort((cols, rows))
    return rows[order], cols[order], vals[order]


def _check_entries(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
    """Refuse an entry that is not finite, then one that is negative: the first in row-major order."""
    if not np.isfinite(vals).all():
        k = int(np.flatnonzero(~np.isfinite(vals))[0])
        raise ValueError(f"mixing matrix entry W[{int(rows[k])}, {int(cols[k])}] = {vals[k]} is not finite")
    if (vals < 0).any():
        k = int(np.flatnonzero(vals < 0)[0])
        raise ValueError(f"mixing matrix entry W[{int(rows[k])}, {int(cols[k])}] = {_fmt(vals[k])} is negative")


def _check_symmetric(S, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, tol: float) -> None:
    """Refuse ``S`` unless |W_ij − W_ji| <= tol and W_ij != 0 exactly where W_ji != 0, naming the first entry."""
    D = (S - S.T).tocoo()
    bad = np.abs(D.data) > tol
    if bad.any():
        k = np.lexsort((D.col[bad], D.row[bad]))[0]
        i, j = int(D.row[bad][k]), int(D.col[bad][k])
        raise ValueError(
            f"mixing matrix is not symmetric: W[{i}, {j}] = {_fmt(S[i, j])} but W[{j}, {i}] = {_fmt(S[j, i])}"
        )
    # Within tol, W_ij = 5e-9 may face W_ji = 0: agent i would average with j while j ignores i. The
    # neighbour relation must be mutual for a symmetric W (push-sum's directed W is checked with
    # symmetric=False: its exchange follows rows and columns apart).
    i, j = _one_sided_entry(S.shape[0], rows, cols, vals)
    if i is not None:
        raise ValueError(f"mixing matrix is not symmetric: W[{i}, {j}] = {_fmt(S[i, j])} but W[{j}, {i}] = 0: "
                         "the zero pattern is not symmetric")


def _check_sums(S, dense: np.ndarray | None, tol: float, row_sums: bool) -> None:
    """Refuse a row (when ``row_sums``) or a column of ``S`` (``dense`` when given) not summing to 1 within tol."""
    for axis, what in ((1, "row"), (0, "column"))[0 if row_sums else 1:]:
        sums = dense.sum(axis=axis) if dense is not None else np.asarray(S.sum(axis=axis)).ravel()
        bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
        if len(bad):
            i = bad[0]
            raise ValueError(f"mixing matrix {what} {i} sums to {_fmt(sums[i])}, not 1 (tolerance {tol:g})")


def _check_edges(G: nx.Graph, n: int, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
    """Refuse ``G`` unless it has ``n`` nodes and an edge under each entry W[rows[k], cols[k]] (l → j for W[j, l])."""
    if G.number_of_nodes() != n:
        raise ValueError(f"mixing matrix is {n}x{n} but the graph has {G.number_of_nodes()} nodes")
    for i, j, v in zip(rows, cols, vals):
        if not (G.has_edge(int(j), int(i)) if G.is_directed() else G.has_edge(int(i), int(j))):
            raise ValueError(
                f"mixing matrix entry W[{i}, {j}] = {_fmt(v)} but nodes {i} and {j} are not linked in the graph"
            )


def _one_sided_entry(n: int, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> tuple:
    """The first (i, j), in row-major order, with W_ij != 0 but W_ji == 0; (None, None) when there is none."""
    import scipy.sparse as sp

    nz = vals != 0
    P = sp.csr_array((np.ones(int(nz.sum())), (rows[nz], cols[nz])), shape=(n, n))
    D = (P - P.T).tocoo()
    one_sided = D.data > 0
    if not one_sided.any():
        return None, None
    k = np.lexsort((D.col[one_sided], D.row[one_sided]))[0]
    return int(D.row[one_sided][k]), int(D.col[one_sided][k])


def _check_connected(n: int, rows: np.ndarray, cols: np.ndarray, directed: bool = False) -> None:
    """Refuse a support graph (edges rows[k]–cols[k]) with more than one component (strongly connected
    ones when ``directed``), naming a few."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import connected_components

    A = sp.csr_array((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    count, label = connected_components(A, directed=directed, connection="strong")
    if count > 1:
        comps: dict[int, list[int]] = {}
        for node, c in enumerate(label.tolist()):
            comps.setdefault(c, []).append(node)
        ordered = sorted(comps.values(), key=lambda c: c[0])
        shown = "; ".join(str(c if len(c) <= 8 else c[:8] + ["..."]) for c in ordered[:3])
        raise ValueError(
            f"graph is not {'strongly ' if directed else ''}connected: {count} components ({shown}); "
            "agents could never reach consensus"
        )
