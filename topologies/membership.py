r"""Mixing over the agents that are online: the weight rule on the surviving subgraph.

When some agents are offline (churn, a dead peer), the agents that remain
mix with the run's weight rule applied to the subgraph of the graph they
induce; an offline agent's row and column are those of the identity (it
neither sends nor receives). If the surviving subgraph falls apart, each
connected part gets the rule's matrix of its own subgraph, so every part
keeps averaging within itself (and the gap of the whole is 0: the parts
cannot agree until they meet again).

Example (a ring of 5 without agent 2 is the path 3-4-0-1; Metropolis weights on it)::

    >>> import numpy as np
    >>> from topologies import build
    >>> s = surviving_mixing(build("ring", 5), [True, True, False, True, True])
    >>> s.parts, s.W[2].tolist()
    ([[0, 1, 3, 4]], [0.0, 0.0, 1.0, 0.0, 0.0])
    >>> np.round(s.W[1], 4).tolist()          # agent 1 kept one neighbour: 1/(1 + max(1, 2)) = 1/3
    [0.3333, 0.6667, 0.0, 0.0, 0.0]
    >>> s2 = surviving_mixing(build("ring", 6), [True, True, False, True, True, False])
    >>> s2.parts, s2.gap.gap
    ([[0, 1], [3, 4]], 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from .mixing import COLUMN_RULES, RULES, mixing_matrix
from .spectral import SpectralGap, spectral_gap

__all__ = ["REGULAR_ONLY_RULES", "Surviving", "surviving_mixing"]

#: weight rules that are doubly stochastic on regular graphs only: a graph that loses an agent is not regular
REGULAR_ONLY_RULES = ("uniform",)


@dataclass(frozen=True)
class Surviving:
    """The mixing over the online agents: ``W`` (n×n; identity rows for the offline), the connected ``parts``
    of the online agents (each sorted, in order of their first agent), and ``gap``: the spectral gap of W
    restricted to the online agents (0 when they form several parts)."""

    W: object
    parts: list[list[int]]
    gap: SpectralGap


def surviving_mixing(G: nx.Graph, online, rule: str = "metropolis", *, sparse: bool = False) -> Surviving:
    """The mixing matrix of graph ``G`` (nodes 0..n−1) when only the agents where ``online`` is true take part.

    Each connected part P of the subgraph the online agents induce gets
    ``mixing_matrix(G[P], rule)`` (nodes renumbered in order), placed at P's rows and columns;
    every offline agent j has W_jj = 1. With every agent online this is ``mixing_matrix(G, rule)`` itself.

    Raises ValueError for a push-sum rule (column-stochastic mixing is not re-weighted here), a rule
    refused on irregular graphs (:data:`REGULAR_ONLY_RULES`), or an ``online`` mask of the wrong length.
    """
    RULES.get(rule)
    if rule in COLUMN_RULES or rule in REGULAR_ONLY_RULES:
        raise ValueError(f"mixing {rule!r} cannot be re-weighted over the online agents (it is "
                         f"{'column-stochastic (push-sum)' if rule in COLUMN_RULES else 'doubly stochastic on regular graphs only'}); "
                         f"use one of {', '.join(r for r in RULES.names() if r not in COLUMN_RULES + REGULAR_ONLY_RULES)}")
    import scipy.sparse as sp

    n = G.number_of_nodes()
    online = np.asarray(online, dtype=bool).reshape(-1)
    if len(online) != n:
        raise ValueError(f"online mask has {len(online)} entries but the graph has {n} agents")
    sub = G.subgraph(np.flatnonzero(online).tolist())
    parts = sorted((sorted(c) for c in nx.connected_components(sub)), key=lambda c: c[0])
    rows, cols, vals = [np.flatnonzero(~online)], [np.flatnonzero(~online)], [np.ones(int((~online).sum()))]
    for part in parts:
        index = np.asarray(part, dtype=np.int64)
        H = nx.relabel_nodes(G.subgraph(part), {j: i for i, j in enumerate(part)})
        Wp = sp.coo_array(mixing_matrix(H, rule, sparse=True))
        rows.append(index[Wp.row])
        cols.append(index[Wp.col])
        vals.append(Wp.data)
    W = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))
    if len(parts) == 1:
        keep = np.asarray(parts[0])
        gap = spectral_gap(W[keep][:, keep])
    else:
        gap = SpectralGap(0.0, 1.0)
    return Surviving(W=W if sparse else W.toarray(), parts=parts, gap=gap)
