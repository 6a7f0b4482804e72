"""Pictures of a topology and its mixing weights (``cdsgd topo --draw``), and the headless
matplotlib set-up every cdsgd figure shares (:mod:`cdsgd.report.plotting` draws runs and sweeps)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction

import networkx as nx
import numpy as np

__all__ = ["draw_topology", "topology_figure", "pyplot", "save_figure"]


def pyplot():
    """matplotlib.pyplot on the Agg backend: figures are files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, what: str = "figure", dpi: float = 100, close: bool = True) -> str:
    """Write ``fig`` to ``path`` (its folder created; ``dpi`` for pixel formats) and close it (unless
    ``close`` is false: more formats to come); errors name the file asked for."""
    plt = pyplot()
    try:
        directory = os.path.dirname(os.fspath(path))
        if directory:
            os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as e:  # name the file we were asked to write, not an inner folder
        raise OSError(f"cannot write the {what} {os.fspath(path)!r}: {e.strerror or e}") from None
    except ValueError as e:  # matplotlib: an unknown image format
        raise ValueError(f"cannot write the {what} {os.fspath(path)!r}: {e}") from None
    finally:
        if close:
            plt.close(fig)
    return os.fspath(path)


def _weight_text(w: float) -> str:
    """A weight as a short fraction when it is one (``1/3 ≈ 0.333``), else to 3 digits."""
    f = Fraction(float(w)).limit_denominator(1000)
    if f.denominator > 1 and abs(float(f) - w) < 1e-9:
        return f"{f} ≈ {w:.3g}"
    return f"{w:.3g}"


def _spread(values) -> str:
    """One weight, or the range of several: '1/5 ≈ 0.2' or '0.125 to 0.25'."""
    lo, hi = float(np.min(values)), float(np.max(values))
    return _weight_text(lo) if hi - lo <= 1e-12 * max(1.0, hi) else f"{lo:.3g} to {hi:.3g}"


def _edge_label_spots(paths, nodes: np.ndarray, ts=(0.5, 0.38, 0.62, 0.28, 0.72)) -> list[np.ndarray]:
    """Where to put each edge's label: of a few points along the edge (``paths[k](t)``), the one
    farthest from every node and from the labels placed before it, so that labels of edges
    crossing at the centre (hypercube, exponential graph) or passing a node do not stack."""
    placed: list[np.ndarray] = []
    for path in paths:
        cands = np.array([path(t) for t in ts])
        clear = np.linalg.norm(cands[:, None, :] - nodes[None, :, :], axis=2).min(1)
        if placed:
            clear = np.minimum(clear, np.linalg.norm(cands[:, None, :] - np.array(placed)[None], axis=2).min(1))
        placed.append(cands[int(np.argmax(clear + 1e-9 * -np.arange(len(ts))))])
    return placed


def _clear_layout(G: nx.Graph, clearance: float = 0.1) -> dict:
    """Kamada-Kawai positions, each node then pushed off the edges (not its own) passing within
    ``clearance`` of it and off nodes nearer than twice that: an edge through a node reads as two
    edges, and its label as the node's."""
    n = G.number_of_nodes()
    if n > 200:
        return nx.spring_layout(G, seed=0)
    P = np.array([p for _, p in sorted(nx.kamada_kawai_layout(G).items())], dtype=float)
    for _ in range(50):
        moved = False
        for i, j in G.edges():
            a, d = P[i], P[j] - P[i]
            t = np.clip((P - a) @ d / max(d @ d, 1e-12), 0.0, 1.0)
            off = P - (a + t[:, None] * d)
            dist = np.linalg.norm(off, axis=1)
            near = (dist < clearance) & (t > 0) & (t < 1)
            near[[i, j]] = False
            for k in np.flatnonzero(near):
                side = off[k] / dist[k] if dist[k] > 1e-9 else np.array([-d[1], d[0]]) / np.linalg.norm(d)
                P[k] += side * (1.5 * clearance - dist[k])  # past the line, or it oscillates there
                moved = True
        gap = P[:, None] - P[None]
        dist = np.linalg.norm(gap, axis=2)
        for a, b in np.argwhere(np.triu(dist < 2 * clearance, 1)):  # and nodes off each other
            P[a] += gap[a, b] / max(dist[a, b], 1e-9) * (clearance - dist[a, b] / 2)
            P[b] -= gap[a, b] / max(dist[a, b], 1e-9) * (clearance - dist[a, b] / 2)
            moved = True
        if not moved:
            break
    return dict(enumerate(P))


def topology_figure(G: nx.Graph, W, *, title: str = ""):
    """The Figure of :func:`draw_topology`."""
    plt = pyplot()
    d = _drawing(G, W)
    size = min(12.0, 5.0 + 0.22 * d.n)
    fig, ax = plt.subplots(figsize=(size, size + 0.5))
    ax.set_aspect("equal")
    stubs = _draw_edges(ax, d)
    _draw_nodes(ax, d)
    if d.label_edges:
        _label_edges(ax, d, stubs)
    ax.set_title(_caption(d, title), fontsize=10)
    ax.set_axis_off()
    ax.margins(0.06)
    fig.tight_layout()
    return fig


@dataclass
class _Drawing:
    """A picture of a topology to draw: where each node sits, which edges are drawn how, and what is labelled."""

    G: nx.Graph
    W: np.ndarray
    pos: dict
    directed: bool  # drawn with arrows: a directed G, or an asymmetric W
    D: nx.Graph  # the graph whose edges are drawn (G with both directions of each edge when W is asymmetric)
    wrap: list  # a torus' wrap-around edges: drawn as stubs
    edges: list  # the other edges of D
    weights: np.ndarray  # W[j, i] of each edge i -> j of D
    selfs: np.ndarray
    dense: bool  # edges drawn thin and transparent
    uniform: bool  # every edge weight the same: said once, not on each edge
    label_edges: bool
    label_self: bool

    @property
    def n(self) -> int:
        """The number of nodes."""
        return self.G.number_of_nodes()

    @property
    def m(self) -> int:
        """The number of edges of G."""
        return self.G.number_of_edges()

    @property
    def node_size(self) -> int:
        """The nodes' size (matplotlib's, in points²)."""
        return 700 if self.n <= 32 else 250 if self.n <= 64 else 60

    @property
    def rad(self) -> float:
        """The curvature of the arrows (both of an edge are drawn apart), 0 for undirected edges."""
        return 0.12 if self.directed else 0.0


def _drawing(G: nx.Graph, W) -> _Drawing:
    """The picture of ``G`` and its mixing weights ``W`` to draw."""
    W = W.toarray() if hasattr(W, "toarray") else np.asarray(W, dtype=float)
    n = G.number_of_nodes()
    pos = _positions(G)
    # an arrow i -> j carries W[j, i], the share of i's value that j receives; an undirected edge with
    # W[i, j] != W[j, i] (push_sum on an irregular graph) is drawn as two arrows
    directed = G.is_directed() or not np.allclose(W, W.T)
    D = G.to_directed() if directed and not G.is_directed() else G
    shape = G.graph.get("shape")
    wrap = [(i, j) for i, j in D.edges() if shape and np.abs(pos[i] - pos[j]).sum() > 1.5]
    weights = np.array([W[j, i] for i, j in D.edges()]) if D.number_of_edges() else np.zeros(1)
    selfs = np.diag(W)
    m = G.number_of_edges()
    dense = n > 16 and m > 4 * n
    uniform = np.ptp(weights) <= 1e-12 * max(1.0, weights.max())
    return _Drawing(G, W, pos, directed, D, wrap, [e for e in D.edges() if e not in wrap], weights, selfs, dense,
                    uniform, label_edges=not uniform and not dense and n <= 32 and m <= 80,
                    label_self=n <= 32 and np.ptp(selfs) > 1e-12)


def _positions(G: nx.Graph) -> dict:
    """Each node's place: on its grid (``G.graph["shape"]``), on a circle when all degrees are equal, else spread."""
    shape = G.graph.get("shape")
    if shape:
        cols = shape[1]
        return {i: np.array([i % cols, -(i // cols)], dtype=float) for i in G.nodes}
    if len({d for _, d in G.degree()}) == 1:
        return nx.circular_layout(G)
    return _clear_layout(G)


def _draw_edges(ax, d: _Drawing) -> list:
    """The stubs drawn for the wrap-around edges, (end node, tip, weight), once every edge is drawn on ``ax``."""
    nx.draw_networkx_edges(d.D, d.pos, ax=ax, edgelist=d.edges, edge_color="0.35" if d.dense else "0.5",
                           width=0.4 if d.dense else 1.2, alpha=0.15 if d.dense else 1.0, node_size=d.node_size,
                           **(dict(arrows=True, arrowsize=12, connectionstyle=f"arc3,rad={d.rad}") if d.directed
                              else {}))
    stubs = []  # a torus' wrap-around edge: a dashed stub leaving each end outwards
    for i, j in d.wrap:
        axis = 0 if d.pos[i][1] == d.pos[j][1] else 1  # a row's or a column's two ends
        lo, hi = sorted((i, j), key=lambda v: d.pos[v][axis])
        out = 0.45 * np.eye(2)[axis]
        for end, tip in ((lo, d.pos[lo] - out), (hi, d.pos[hi] + out)):
            ax.plot(*zip(d.pos[end], tip), linestyle="--", color="0.5", zorder=1)
            stubs.append((end, tip, d.W[j, i]))
    return stubs


def _draw_nodes(ax, d: _Drawing) -> None:
    """Draw the nodes on ``ax``, with their numbers (and self weights, when labelled) up to 64 nodes."""
    nodes = nx.draw_networkx_nodes(d.G, d.pos, ax=ax, node_color="#9ecae1", node_size=d.node_size)
    nodes.set_zorder(3)
    if d.n <= 64:
        text = {i: f"{i}\n{d.selfs[i]:.2f}" if d.label_self else str(i) for i in d.G.nodes}
        for t in nx.draw_networkx_labels(d.G, d.pos, ax=ax, labels=text, font_size=8 if d.n <= 32 else 6).values():
            t.set_zorder(4)


def _label_edges(ax, d: _Drawing, stubs) -> None:
    """Write each edge's weight on ``ax``, where the edge is clear of nodes and other labels, and each stub's."""
    box = dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85)

    def path(i, j):
        p, q = d.pos[i], d.pos[j]
        c = (p + q) / 2 + d.rad * np.array([q[1] - p[1], p[0] - q[0]])  # matplotlib's arc3 control point
        return lambda t: (1 - t) ** 2 * p + 2 * t * (1 - t) * c + t ** 2 * q

    spots = _edge_label_spots([path(i, j) for i, j in d.edges], np.array([d.pos[v] for v in d.G.nodes]))
    for (i, j), xy in zip(d.edges, spots):
        e = d.pos[j] - d.pos[i]
        angle = np.degrees(np.arctan2(e[1], e[0]))
        angle = angle - 180 if angle > 90 else angle + 180 if angle <= -90 else angle
        ax.text(*xy, f"{d.W[j, i]:.3g}", fontsize=7, ha="center", va="center", rotation=angle,
                rotation_mode="anchor", bbox=box, zorder=5, gid="edge weight")
    for end, tip, w in stubs:
        ax.text(*tip, f"{w:.3g}", fontsize=7, ha="center", va="center", bbox=box, zorder=5, gid="edge weight")


def _caption(d: _Drawing, title: str) -> str:
    """The picture's title: ``title``, then what the weights are and how they are shown."""
    arrow = "arrow i→j: W[j, i], the share of i's value j receives" if d.directed else "edge i–j: W[i, j]"
    lines = [title] if title else []
    if d.uniform:
        lines.append(f"every {'arrow' if d.directed else 'edge'} weight {_spread(d.weights)}")
    elif d.label_edges:
        lines.append(f"{arrow} (labelled)")
    else:
        lines.append(f"{arrow} from {_spread(d.weights)} (not labelled: {d.m} edges)")
    lines[-1] += f"; self weight {_spread(d.selfs)}" + (" (second line in each node)" if d.label_self else
                                                        "" if np.ptp(d.selfs) <= 1e-12 else " (not labelled)")
    if d.dense:
        lines.append(f"dense graph: {d.m} edges drawn thin and transparent")
    if d.wrap:
        lines.append("dashed stubs: wrap-around edges (the two ends of each row and column are joined)")
    return "\n".join(lines)


def draw_topology(G: nx.Graph, W, path: str | os.PathLike, *, title: str = "") -> None:
    """Save a picture of ``G`` and its mixing weights ``W`` to ``path`` (PNG, SVG, PDF, ...).

    Grid graphs (``G.graph["shape"]``) are drawn on their grid, the torus'
    wrap-around edges as dashed stubs at the row and column ends; graphs
    whose degrees are all equal on a circle; others by a Kamada-Kawai layout.
    When every edge has the same weight the title says so instead of
    labelling each edge; otherwise edges are labelled (n <= 32, at most 80
    edges) at the point along the edge farthest from nodes and other labels.
    Directed graphs (and asymmetric W) are drawn with arrows i -> j labelled
    W[j, i]. Nodes show their index (n <= 64) and, when self weights differ,
    W[i, i]. Dense graphs (more than 4n edges, n > 16) get thin, transparent
    edges.
    """
    save_figure(topology_figure(G, W, title=title), path, "drawing")
