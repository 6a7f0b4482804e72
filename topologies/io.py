"""Reading user graphs from files: ``load(path) -> networkx.Graph``.

Formats, chosen by the file's extension:

``.edgelist``, ``.txt``
    One edge per line, ``u v`` or ``u v weight`` separated by spaces, tabs or
    commas; a line with one label declares a node; ``#`` starts a comment.
    A repeated edge must repeat the same weight.
``.csv``
    A dense n×n adjacency matrix of numbers (no header). A non-zero entry
    (i, j) is an edge with that value as its "weight" (1 for a 0/1 matrix).
    Must be symmetric. A non-zero diagonal makes it a full mixing matrix W:
    every node then carries its diagonal entry as ``self_weight`` (zeros
    included) and every edge its weight.
``.npy``
    The same matrix as a NumPy array (loaded with ``allow_pickle=False``).
``.graphml``
    GraphML, which must be undirected; a numeric "weight" attribute is kept.

Self weights: a self-loop with a weight (``u u w`` in an edge list, a
matrix's diagonal, a weighted GraphML loop) is node u's self weight W[u, u],
kept in the node attribute ``self_weight``; ``mixing=weight`` uses it (the
rows must then sum to 1), the other rules compute their own. A self-loop
without a weight is refused.

Node order: a matrix's row i is node i. Labels from edge lists and GraphML
are relabelled 0..n-1 in *natural* order: numbers compare numerically, also
inside labels (``2 < 10``, ``n2 < n10``), other text alphabetically. The
original label is kept in each node's ``label`` attribute.

Refused naming the file and the problem: a missing file (FileNotFoundError);
with a ValueError, a path that is not a regular file, an unknown extension,
empty graphs, self-loops without a weight, directed graphs (including
non-symmetric matrices), non-numeric or ragged matrices, malformed lines.
Connectivity is checked later, by :func:`topologies.validate`.

Example::

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "g.edgelist")
    >>> _ = open(p, "w").write("a b\\nb c 0.5\\n")
    >>> G = load(p)
    >>> sorted(G.edges(data=True))
    [(0, 1, {}), (1, 2, {'weight': 0.5})]
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import networkx as nx
import numpy as np

__all__ = ["load", "FORMATS"]

FORMATS = {".edgelist": "edge list", ".txt": "edge list", ".csv": "adjacency matrix",
           ".npy": "adjacency matrix", ".graphml": "GraphML"}


_NO_SELF_WEIGHT = ("has no weight; a weighted self-loop gives the node's self weight W[u, u] (mixing=weight), "
                   "without one the mixing rule sets it: leave the loop out")


def _natural_key(label: str):
    parts = re.split(r"(\d+)", label)
    return [int(p) if i % 2 else p for i, p in enumerate(parts)]


def _relabel(G: nx.Graph) -> nx.Graph:
    order = sorted(G.nodes, key=lambda v: _natural_key(str(v)))
    mapping = {v: i for i, v in enumerate(order)}
    H = nx.Graph()
    for v in order:
        H.add_node(mapping[v], label=str(v), **{k: x for k, x in G.nodes[v].items() if k == "self_weight"})
    for u, v, data in G.edges(data=True):
        H.add_edge(mapping[u], mapping[v], **data)
    return H


def _read_edgelist(path: Path) -> nx.Graph:
    G = nx.Graph()
    for lineno, raw in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tok = [t for t in re.split(r"[\s,]+", line) if t]
        where = f"{path}:{lineno}"
        if len(tok) == 1:
            G.add_node(tok[0])
            continue
        if len(tok) > 3:
            raise ValueError(f"{where}: expected 'u v' or 'u v weight', got {raw.strip()!r}")
        u, v = tok[0], tok[1]
        attrs = {}
        if len(tok) == 3:
            try:
                attrs["weight"] = float(tok[2])
            except ValueError:
                raise ValueError(f"{where}: weight {tok[2]!r} is not a number") from None
        if u == v:
            if "weight" not in attrs:
                raise ValueError(f"{where}: self-loop at node {u!r} {_NO_SELF_WEIGHT}")
            if G.nodes.get(u, {}).get("self_weight", attrs["weight"]) != attrs["weight"]:
                raise ValueError(f"{where}: self weight of node {u!r} repeated with another value "
                                 f"({G.nodes[u]['self_weight']} vs {attrs['weight']})")
            G.add_node(u, self_weight=attrs["weight"])
            continue
        if G.has_edge(u, v) and G.edges[u, v].get("weight") != attrs.get("weight"):
            raise ValueError(
                f"{where}: edge ({u}, {v}) repeated with another weight "
                f"({G.edges[u, v].get('weight')} vs {attrs.get('weight')}); edges are undirected"
            )
        G.add_edge(u, v, **attrs)
    return G


def _read_csv_matrix(path: Path) -> np.ndarray:
    rows = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        cells = [c.strip() for c in raw.split(",")]
        row = []
        for col, c in enumerate(cells):
            try:
                row.append(float(c))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: entry {col} is {c!r}, not a number") from None
        rows.append((lineno, row))
    if rows and any(len(r) != len(rows[0][1]) for _, r in rows):
        lineno, r = next((ln, r) for ln, r in rows if len(r) != len(rows[0][1]))
        raise ValueError(f"{path}:{lineno}: row has {len(r)} entries but the first row has {len(rows[0][1])}")
    return np.array([r for _, r in rows], dtype=np.float64).reshape(len(rows), -1 if rows else 0)


def _matrix_graph(A: np.ndarray, path: Path) -> nx.Graph:
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"{path}: adjacency matrix must be square, got shape {A.shape}")
    if A.shape[0] == 0:
        raise ValueError(f"{path}: graph is empty (no nodes)")
    if not np.issubdtype(A.dtype, np.number) or np.issubdtype(A.dtype, np.complexfloating):
        raise ValueError(f"{path}: adjacency matrix must hold real numbers, got dtype {A.dtype}")
    A = A.astype(np.float64)
    bad = np.argwhere(~np.isfinite(A))
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"{path}: entry ({i}, {j}) is {A[i, j]}, not finite")
    bad = np.argwhere(A != A.T)
    if len(bad):
        i, j = bad[0]
        raise ValueError(
            f"{path}: matrix is not symmetric (a directed graph): entry ({i}, {j}) = {A[i, j]:g} "
            f"but ({j}, {i}) = {A[j, i]:g}; cdsgd needs undirected graphs"
        )
    n = A.shape[0]
    G = nx.Graph()
    full = bool(np.diag(A).any())  # a diagonal: a full W, self weights (zeros too) and every edge's weight
    G.add_nodes_from((i, {"self_weight": float(A[i, i])} if full else {}) for i in range(n))
    binary = not full and bool(np.all((A == 0) | (A == 1)))
    for i, j in np.argwhere(A != 0):
        if i < j:
            G.add_edge(int(i), int(j), **({} if binary else {"weight": float(A[i, j])}))
    return G


def load(path: str | os.PathLike) -> nx.Graph:
    """Read a user graph (format by extension, see the module docstring).

    Returns an undirected graph on nodes 0..n-1 (original labels in the
    ``label`` node attribute). Raises FileNotFoundError for a missing file
    and ValueError for anything malformed, naming the file.
    """
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: unknown graph file extension {ext or '(none)'!r}; allowed: {', '.join(FORMATS)}")
    if not path.is_file():
        if path.exists():
            what = "a folder" if path.is_dir() else "not a regular file"
            raise ValueError(f"graph file {str(path)!r} is {what}; give the path of a graph file")
        raise FileNotFoundError(f"graph file {str(path)!r} does not exist")
    if ext in (".edgelist", ".txt"):
        G = _relabel(_read_edgelist(path))
    elif ext == ".csv":
        G = _matrix_graph(_read_csv_matrix(path), path)
    elif ext == ".npy":
        try:
            A = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a plain numeric .npy array ({e})") from None
        G = _matrix_graph(A, path)
    else:
        try:
            raw = nx.read_graphml(path)
        except Exception as e:  # networkx raises several parse error types
            raise ValueError(f"{path}: not valid GraphML ({type(e).__name__}: {e})") from None
        if raw.is_directed():
            raise ValueError(f"{path}: GraphML graph is directed; cdsgd needs undirected graphs (edgedefault=\"undirected\")")
        for u, v, data in raw.edges(data=True):
            if "weight" in data:
                try:
                    data["weight"] = float(data["weight"])
                except (TypeError, ValueError):
                    raise ValueError(f"{path}: edge ({u}, {v}) has non-numeric weight {data['weight']!r}") from None
        for u, _, data in list(nx.selfloop_edges(raw, data=True)):
            if "weight" not in data:
                raise ValueError(f"{path}: self-loop at node {u!r} {_NO_SELF_WEIGHT}")
            raw.nodes[u]["self_weight"] = data["weight"]
            raw.remove_edge(u, u)
        G = _relabel(raw)
    if G.number_of_nodes() == 0:
        raise ValueError(f"{path}: graph is empty (no nodes)")
    if G.number_of_edges() == 0:
        raise ValueError(f"{path}: graph has no edges ({G.number_of_nodes()} isolated nodes)")
    G.graph["name"] = str(path)
    return G
