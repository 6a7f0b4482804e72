"""Spanning trees, for rules that run on a tree (RelaySum): :func:`spanning_tree`, :func:`is_tree`, :func:`graph_of`.

RelaySum (Vogels et al., NeurIPS 2021) relays each agent's model along a
spanning tree; the delay with which agent j's model reaches agent i is
their distance in the tree, so a shallow tree mixes fastest. A graph that
is a tree already (a chain, a star, a given tree file) is used as it is;
otherwise :func:`spanning_tree` takes the breadth-first tree from a
*centre* of the graph (a node of least eccentricity): every node's depth is
then its distance from the centre, at most the graph's radius, so the
tree's diameter is at most twice the radius (at most twice the graph's
diameter), against up to N − 1 for a depth-first tree.

    >>> import topologies
    >>> T = spanning_tree(topologies.build("torus", 16))
    >>> T.number_of_edges(), is_tree(T), max(d for _, d in T.degree())
    (15, True, 4)
"""

from __future__ import annotations

import networkx as nx
import numpy as np

__all__ = ["CENTRE_UP_TO", "graph_of", "is_tree", "spanning_tree"]

#: beyond this many nodes the breadth-first tree starts at node 0 (finding a centre costs a search from every node)
CENTRE_UP_TO = 2000


def is_tree(G: nx.Graph) -> bool:
    """True when G (undirected) is connected with N − 1 edges (one node: True)."""
    n = G.number_of_nodes()
    return n >= 1 and G.number_of_edges() == n - 1 and nx.is_connected(G)


def graph_of(W) -> nx.Graph:
    """The undirected graph of a mixing matrix's off-diagonal non-zeros (dense or ``scipy.sparse``), nodes 0..N−1."""
    import scipy.sparse as sp

    A = sp.csr_array(W) if not hasattr(W, "tocsr") else W.tocsr()
    A = (abs(A) + abs(A.T)).tocoo()
    G = nx.Graph()
    G.add_nodes_from(range(A.shape[0]))
    G.add_edges_from((int(i), int(j)) for i, j, v in zip(A.row, A.col, A.data) if i < j and v != 0)
    return G


def spanning_tree(G: nx.Graph) -> nx.Graph:
    """G itself when it is a tree; else the breadth-first spanning tree from a centre of G (module docstring).

    Neighbours are visited in ascending order and the centre is the smallest
    node of least eccentricity, so the tree is a function of G alone. A
    random graph's ``G.graph["draw"]`` is kept. ValueError for a disconnected or directed graph.
    """
    if G.is_directed():
        raise ValueError("a spanning tree for RelaySum needs an undirected graph; got a directed one")
    if G.number_of_nodes() == 0 or not nx.is_connected(G):
        raise ValueError("a spanning tree needs a connected graph")
    if is_tree(G):
        return nx.Graph(G)
    nodes = sorted(G.nodes())
    if len(nodes) <= CENTRE_UP_TO:
        ecc = nx.eccentricity(G)
        root = min(nodes, key=lambda v: (ecc[v], v))
    else:
        root = nodes[0]
    T = nx.Graph(**{k: v for k, v in G.graph.items() if k == "draw"})  # a random graph's draw stays recorded
    T.add_nodes_from(nodes)
    seen, frontier = {root}, [root]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(G.neighbors(u)):
                if v not in seen:
                    seen.add(v)
                    T.add_edge(u, v)
                    nxt.append(v)
        frontier = nxt
    assert T.number_of_edges() == len(nodes) - 1 and np.all([v in seen for v in nodes])
    return T
