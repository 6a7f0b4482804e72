"""topologies: communication graphs and their mixing matrices.

networkx + numpy, and scipy's sparse matrices and eigen-solver for large
graphs (importing it never imports torch). From a graph to the mixing
matrix Π that CDSGD averages with:

    >>> import topologies
    >>> G = topologies.build("ring", 8)              # or topologies.load("my.edgelist")
    >>> W = topologies.mixing_matrix(G, "metropolis")  # n×n, validated
    >>> round(topologies.spectral_gap(W).gap, 4)
    0.1953

For thousands of nodes, ``mixing_matrix(G, sparse=True)`` returns a
``scipy.sparse`` CSR matrix built, validated and measured (spectral gap) in
O(n + edges). See docs/topologies.md for each builder and weight rule.
"""

from __future__ import annotations

import os

import networkx as nx

from .builders import BUILDERS, build, builder_params, draw_seed
from .io import FORMATS, load
from .membership import REGULAR_ONLY_RULES, Surviving, surviving_mixing
from .mixing import COLUMN_RULES, DENSE_UP_TO, RULES, TOL, mixing_matrix, validate
from .spectral import (EFFECTIVE_DECAY, GAP_TOL, SPARSE_EIGEN_FROM, SpectralGap, effective_neighbours, format_gap,
                       is_periodic, mixing_warnings, smallest_eigenvalue, spectral_gap)
from .registry import Registry, unknown_name_error
from .schedules import SCHEDULES, Schedule, schedule, schedule_params
from .trees import graph_of, is_tree, spanning_tree

__all__ = [
    "BUILDERS",
    "COLUMN_RULES",
    "DENSE_UP_TO",
    "EFFECTIVE_DECAY",
    "FORMATS",
    "GAP_TOL",
    "REGULAR_ONLY_RULES",
    "RULES",
    "SCHEDULES",
    "SPARSE_EIGEN_FROM",
    "TOL",
    "Registry",
    "Schedule",
    "SpectralGap",
    "Surviving",
    "build",
    "builder_params",
    "describe",
    "draw_seed",
    "effective_neighbours",
    "format_gap",
    "graph_and_mixing",
    "graph_of",
    "is_graph_file",
    "is_periodic",
    "is_tree",
    "load",
    "mixing_matrix",
    "mixing_warnings",
    "resolve",
    "schedule",
    "schedule_params",
    "smallest_eigenvalue",
    "spanning_tree",
    "spectral_gap",
    "surviving_mixing",
    "unknown_name_error",
    "validate",
]


def is_graph_file(spec: str | os.PathLike) -> bool:
    """True when ``spec`` names a graph file (a known extension or a path separator)."""
    s = os.fspath(spec)
    return os.path.splitext(s)[1].lower() in FORMATS or os.sep in s or (os.altsep or os.sep) in s


def resolve(spec: str | os.PathLike, n: int | None = None, **params) -> nx.Graph:
    """A graph from a builder name or a graph file path.

    ``spec`` is a file when :func:`is_graph_file` says so; then ``n`` (if
    given) must match the file's node count and no builder parameters are
    allowed. Otherwise ``spec`` is a builder name and ``n`` is required.

    Example::

        >>> resolve("star", 5).number_of_edges()
        4
    """
    if is_graph_file(spec):
        if params:
            raise ValueError(f"graph file {os.fspath(spec)!r} takes no builder parameters, got {sorted(params)}")
        G = load(spec)
        if n is not None and n != G.number_of_nodes():
            raise ValueError(f"graph file {os.fspath(spec)!r} has {G.number_of_nodes()} nodes but n={n} was asked for")
        return G
    if n is None:
        raise ValueError(f"topology {spec!r} needs the number of nodes n")
    return build(str(spec), n, **params)


def graph_and_mixing(spec: str | os.PathLike, n: int | None = None, rule: str | None = None, **params):
    """The graph and the mixing matrix a topology string stands for: ``(G, W)``.

    The one reading of a ``topology`` (``cdsgd run``'s config key, ``cdsgd
    topo``'s argument), tried in this order:

    * a time-varying schedule name (:data:`SCHEDULES`): W is the
      :class:`Schedule` (``schedule(spec, n, **params)``) and G the union
      graph of its period. A schedule carries its own weights, so ``rule``
      must be None;
    * a graph file path or a builder name (:func:`resolve`): W is
      ``mixing_matrix(G, rule)`` (``rule`` None: ``"metropolis"``).

    ``n`` is required except for a graph file, whose node count it must
    then match. W is a dense array up to :data:`DENSE_UP_TO` nodes and a
    scipy CSR matrix beyond, a schedule's matrices likewise.

        >>> G, W = graph_and_mixing("ring", 5)
        >>> G.number_of_edges(), W.shape, round(float(W[0, 0]), 4)
        (5, (5, 5), 0.3333)
        >>> G, W = graph_and_mixing("one_peer_exponential", 8)
        >>> len(W), G.number_of_edges()
        (3, 20)
    """
    if isinstance(spec, str) and spec in SCHEDULES:
        if rule is not None:
            # `mixing` is the weight rule's name everywhere (config key, docs); `cdsgd topo` calls it --rule
            raise ValueError(f"topology {spec!r} is a time-varying schedule with its own weights; mixing={rule!r} "
                             "does not apply to it (leave mixing / --rule unset)")
        if n is None:
            raise ValueError(f"topology {spec!r} needs the number of nodes n")
        W = schedule(spec, n, **params)
        return W.union_graph(), W
    G = resolve(spec, n, **params)
    return G, mixing_matrix(G, "metropolis" if rule is None else rule, sparse=G.number_of_nodes() > DENSE_UP_TO)


def describe(G: nx.Graph, W, *, matrix: bool = True) -> dict:
    """Facts about a graph and its mixing matrix, as plain JSON-able values.

    Keys: ``n``, ``edges`` (count), ``degree_min``, ``degree_max``,
    ``diameter``, ``lambda2``, ``spectral_gap``, ``effective_neighbours``
    (:func:`effective_neighbours` at :data:`EFFECTIVE_DECAY`), ``draw`` (a
    random graph's draw, ``{"seed": s, "redraws": k}``, see :func:`draw_seed`;
    None for the others), ``warnings`` (:func:`mixing_warnings`), ``edge_list``, and
    ``matrix`` (the dense rows; left out with ``matrix=False``). ``W`` may be
    dense or sparse; the diameter comes from breadth-first searches in
    scipy (seconds for 10,000 nodes), not from n² Python steps.
    """
    degrees = [d for _, d in G.degree()]
    sg = spectral_gap(W)
    info = {
        "n": G.number_of_nodes(),
        "edges": G.number_of_edges(),
        "degree_min": min(degrees),
        "degree_max": max(degrees),
        "diameter": _diameter(G),
        "lambda2": sg.lambda2,
        "spectral_gap": sg.gap,
        "effective_neighbours": effective_neighbours(W),
        "draw": G.graph.get("draw"),
        "warnings": mixing_warnings(W, sg),
        "edge_list": sorted([min(u, v), max(u, v)] for u, v in G.edges()),
    }
    if matrix:
        dense = W.toarray() if hasattr(W, "toarray") else W
        info["matrix"] = [[float(x) for x in row] for row in dense]
    return info


def _diameter(G: nx.Graph) -> int | None:
    """The longest shortest path (None if disconnected), by BFS from every node in blocks of sources."""
    import numpy as np
    from scipy.sparse.csgraph import shortest_path

    n = G.number_of_nodes()
    if n == 1:
        return 0
    A = nx.to_scipy_sparse_array(G, nodelist=range(n), format="csr")
    longest, block = 0.0, max(1, (1 << 22) // n)
    for start in range(0, n, block):
        D = shortest_path(A, directed=False, unweighted=True, indices=np.arange(start, min(n, start + block)))
        longest = max(longest, float(D.max()))
    return None if longest == float("inf") else int(longest)
