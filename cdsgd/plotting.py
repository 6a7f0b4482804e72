"""Figures, drawn headless with matplotlib's Agg backend."""

from __future__ import annotations

import os

import networkx as nx
import numpy as np

__all__ = ["draw_topology"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def draw_topology(G: nx.Graph, W, path: str | os.PathLike, *, title: str = "") -> None:
    """Save a picture of ``G`` with each edge labelled by its weight W[i, j]
    and each node by its index and self weight W[i, i].

    Grid graphs (``G.graph["shape"]``) are drawn on their grid, with
    wrap-around edges dashed; graphs whose degrees are all equal on a
    circle; others with a seeded spring layout. Labels are drawn for n <= 32.
    """
    plt = _pyplot()
    W = np.asarray(W)
    n = G.number_of_nodes()
    degrees = {d for _, d in G.degree()}
    shape = G.graph.get("shape")
    if shape:
        cols = shape[1]
        pos = {i: np.array([i % cols, -(i // cols)], dtype=float) for i in G.nodes}
    else:
        pos = nx.circular_layout(G) if len(degrees) == 1 else nx.spring_layout(G, seed=0)
    # edges longer than one grid step are the torus' wrap-around links
    wrap = [(i, j) for i, j in G.edges() if shape and np.abs(pos[i] - pos[j]).sum() > 1.5]
    size = min(12.0, 4.0 + 0.25 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    nx.draw_networkx_edges(G, pos, ax=ax, edge_color="0.5", edgelist=[e for e in G.edges() if e not in wrap])
    if wrap:
        nx.draw_networkx_edges(G, pos, ax=ax, edge_color="0.75", style="dashed", edgelist=wrap,
                               arrows=True, arrowstyle="-", connectionstyle="arc3,rad=0.15")
    nx.draw_networkx_nodes(G, pos, ax=ax, node_color="#9ecae1", node_size=700 if n <= 32 else 120)
    if n <= 32:
        nx.draw_networkx_labels(G, pos, ax=ax, labels={i: f"{i}\n{W[i, i]:.2f}" for i in G.nodes}, font_size=8)
        nx.draw_networkx_edge_labels(
            G, pos, ax=ax, edge_labels={(i, j): f"{W[i, j]:.3f}" for i, j in G.edges() if (i, j) not in wrap},
            font_size=7
        )
    legend = "node: index / self weight; edge: weight" + ("; dashed: wrap-around" if wrap else "")
    ax.set_title((title + "\n" if title else "") + legend, fontsize=10)
    ax.set_axis_off()
    fig.tight_layout()
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
