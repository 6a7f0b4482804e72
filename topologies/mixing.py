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

__all__ = ["mixing_matrix", "validate", "spectral_gap", "SpectralGap", "RULES", "TOL"]

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


def _degrees(G: nx.Graph, n: int) -> np.ndarray:
    return np.array([G.degree(i) for i in range(n)], dtype=np.float64)


def _fill_diagonal(W: np.ndarray) -> np.ndarray:
    np.fill_diagonal(W, 0.0)
    np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    return W


@RULES.register("metropolis")
def metropolis(G: nx.Graph) -> np.ndarray:
    n = G.number_of_nodes()
    d = _degrees(G, n)
    W = np.zeros((n, n))
    for i, j in G.edges():
        W[i, j] = W[j, i] = 1.0 / (1.0 + max(d[i], d[j]))
    return _fill_diagonal(W)


@RULES.register("max_degree")
def max_degree(G: nx.Graph) -> np.ndarray:
    n = G.number_of_nodes()
    w = 1.0 / (1.0 + _degrees(G, n).max())
    W = np.zeros((n, n))
    for i, j in G.edges():
        W[i, j] = W[j, i] = w
    return _fill_diagonal(W)


@RULES.register("lazy_metropolis")
def lazy_metropolis(G: nx.Graph) -> np.ndarray:
    return 0.5 * (np.eye(G.number_of_nodes()) + metropolis(G))


@RULES.register("uniform")
def uniform(G: nx.Graph) -> np.ndarray:
    n = G.number_of_nodes()
    d = _degrees(G, n)
    if d.min() != d.max():
        lo, hi = int(np.argmin(d)), int(np.argmax(d))
        raise ValueError(
            "rule 'uniform' (1/(d_i+1)) is doubly stochastic only on regular graphs; "
            f"this graph's degrees range from {int(d[lo])} (node {lo}) to {int(d[hi])} (node {hi}); "
            "use 'metropolis' or 'max_degree'"
        )
    W = np.zeros((n, n))
    for i, j in G.edges():
        W[i, j] = 1.0 / (d[i] + 1.0)
        W[j, i] = 1.0 / (d[j] + 1.0)
    return _fill_diagonal(W)


@RULES.register("weight")
def weight(G: nx.Graph) -> np.ndarray:
    n = G.number_of_nodes()
    W = np.zeros((n, n))
    for i, j, data in G.edges(data=True):
        if "weight" not in data:
            raise ValueError(f"rule 'weight': edge ({i}, {j}) has no 'weight' attribute")
        try:
            w = float(data["weight"])
        except (TypeError, ValueError):
            raise ValueError(f"rule 'weight': edge ({i}, {j}) has non-numeric weight {data['weight']!r}") from None
        if not w >= 0 or not np.isfinite(w):
            raise ValueError(f"rule 'weight': edge ({i}, {j}) has weight {w!r}; weights must be finite and >= 0")
        W[i, j] = W[j, i] = w
    np.fill_diagonal(W, 0.0)
    sums = W.sum(axis=1)
    over = np.flatnonzero(sums > 1.0 + TOL)
    if len(over):  # say which node, rather than "W[i, i] is negative" after filling the diagonal
        i = int(over[0])
        raise ValueError(f"rule 'weight': the edge weights at node {i} sum to {_fmt(sums[i])} > 1, "
                         f"leaving self weight {_fmt(1.0 - sums[i])}; the weights at every node must sum to <= 1")
    return _fill_diagonal(W)


def mixing_matrix(G: nx.Graph, rule: str = "metropolis") -> np.ndarray:
    """The n×n float64 mixing matrix of ``G`` under weight ``rule``, validated.

    Args:
        G: undirected graph on nodes 0..n-1, without self-loops.
        rule: one of ``RULES.names()`` (see the module docstring for the maths).

    Raises:
        ValueError: unknown rule, unsuitable graph, or a result that fails
            :func:`validate` (e.g. a disconnected graph).
    """
    fn = RULES.get(rule)
    _check_graph(G)
    W = fn(G)
    validate(W, G)
    return W


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def validate(W, G: nx.Graph | None = None, *, tol: float = TOL) -> np.ndarray:
    """Check that ``W`` is a valid mixing matrix (for ``G`` when given).

    Checks, in order: square 2-D, finite, non-negative, symmetric
    (|W_ij − W_ji| <= tol), every row and column sums to 1 (within tol), zero
    wherever G has no edge (diagonal excepted), and connected (the graph of
    W's non-zero off-diagonal entries, which must then also be G's edges).

    Returns ``W`` as a float64 array. Raises ValueError naming the first
    offending row, entry or nodes and the value found.

    Example::

        >>> import numpy as np
        >>> validate(np.array([[0.5, 0.5], [0.4, 0.6]]))
        Traceback (most recent call last):
        ...
        ValueError: mixing matrix is not symmetric: W[0, 1] = 0.5 but W[1, 0] = 0.4
    """
    try:
        W = np.asarray(W, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"mixing matrix is not numeric: {e}") from None
    if W.ndim != 2 or W.shape[0] != W.shape[1] or W.shape[0] == 0:
        raise ValueError(f"mixing matrix must be square and non-empty, got shape {W.shape}")
    n = W.shape[0]
    bad = np.argwhere(~np.isfinite(W))
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"mixing matrix entry W[{i}, {j}] = {W[i, j]} is not finite")
    bad = np.argwhere(W < 0)
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"mixing matrix entry W[{i}, {j}] = {_fmt(W[i, j])} is negative")
    bad = np.argwhere(np.abs(W - W.T) > tol)
    if len(bad):
        i, j = bad[0]
        raise ValueError(
            f"mixing matrix is not symmetric: W[{i}, {j}] = {_fmt(W[i, j])} but W[{j}, {i}] = {_fmt(W[j, i])}"
        )
    for axis, what in ((1, "row"), (0, "column")):
        sums = W.sum(axis=axis)
        bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
        if len(bad):
            i = bad[0]
            raise ValueError(f"mixing matrix {what} {i} sums to {_fmt(sums[i])}, not 1 (tolerance {tol:g})")
    if G is not None:
        if G.number_of_nodes() != n:
            raise ValueError(f"mixing matrix is {n}x{n} but the graph has {G.number_of_nodes()} nodes")
        for i, j in np.argwhere(W > 0):
            if i != j and not G.has_edge(int(i), int(j)):
                raise ValueError(
                    f"mixing matrix entry W[{i}, {j}] = {_fmt(W[i, j])} but nodes {i} and {j} are not linked in the graph"
                )
    support = nx.Graph()
    support.add_nodes_from(range(n))
    support.add_edges_from((int(i), int(j)) for i, j in np.argwhere(W > 0) if i < j)
    if not nx.is_connected(support):
        comps = sorted((sorted(c) for c in nx.connected_components(support)), key=lambda c: c[0])
        shown = "; ".join(str(c if len(c) <= 8 else c[:8] + ["..."]) for c in comps[:3])
        raise ValueError(
            f"graph is not connected: {len(comps)} components ({shown}); agents could never reach consensus"
        )
    return W


class SpectralGap(NamedTuple):
    """``gap`` = 1 − ``lambda2``; ``lambda2`` = max(|λ₂|, |λₙ|), the second-largest eigenvalue modulus."""

    gap: float
    lambda2: float


def spectral_gap(W) -> SpectralGap:
    """Spectral gap and second-largest eigenvalue modulus of a symmetric mixing matrix.

    With the eigenvalues λ₁ = 1 >= λ₂ >= ... >= λₙ of a validated W,
    ``lambda2 = max(|λ₂|, |λₙ|)`` and ``gap = 1 − lambda2``; consensus error
    contracts by a factor lambda2 per mixing step. For n = 1, lambda2 = 0.

    Example (ring of n with Metropolis weights: gap = 1 − (1/3 + 2/3·cos(2π/n))):

        >>> from topologies import build, mixing_matrix
        >>> import math
        >>> g = spectral_gap(mixing_matrix(build("ring", 10)))
        >>> math.isclose(g.gap, 1 - (1/3 + 2/3 * math.cos(2 * math.pi / 10)))
        True
    """
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"spectral_gap needs a square matrix, got shape {W.shape}")
    if not np.allclose(W, W.T, atol=TOL, rtol=0):
        raise ValueError("spectral_gap needs a symmetric matrix; check it with topologies.validate first")
    lam = np.sort(np.linalg.eigvalsh(W))[::-1]
    if len(lam) == 1:
        return SpectralGap(1.0, 0.0)
    lambda2 = float(max(abs(lam[1]), abs(lam[-1])))
    return SpectralGap(1.0 - lambda2, lambda2)
