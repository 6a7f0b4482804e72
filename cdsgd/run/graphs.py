"""The communication graph of a run: which rules use one (:func:`uses_graph`), the one a rule brings itself
(:func:`own_graph`: NoLoCo's random groups, a compressed all-gather's complete graph), the config's topology
(:func:`plan_topology`) and, for a rule without a graph, the spectral gap of its averaging (:func:`baseline_gap`).
"""

from __future__ import annotations

import networkx as nx
import topologies

from ..algorithms import ALGORITHMS, Algorithm
from ..config import Config, key_info

__all__ = ["baseline_gap", "own_graph", "plan_topology", "uses_graph"]


def uses_graph(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` mixes with neighbours over a graph (its ``traffic`` is ``"neighbours"``).

    The others need none: ``sgd``, ``msgd`` and ``fedavg`` average over all
    agents by all-reduce (W None), ``local`` never communicates. They run
    for any n_agents >= 1, whatever ``topology`` says.
    """
    return algorithm.traffic == "neighbours"


def baseline_gap(algorithm: Algorithm, n_agents: int) -> topologies.SpectralGap:
    """The spectral gap of the averaging an algorithm without a graph does, in closed form.

    All-reduce (``sgd``, ``msgd``, ``fedavg``): the exact mean Π = 11ᵀ/n,
    eigenvalues 1, 0, …, 0: λ₂ = 0, gap 1. No communication (``local``):
    Π = I, λ₂ = 1, gap 0. One agent: λ₂ = 0 either way (as
    :func:`topologies.spectral_gap` has it for n = 1).

    >>> from cdsgd.algorithms import make_algorithm
    >>> baseline_gap(make_algorithm("msgd", lr=0.1), 8), baseline_gap(make_algorithm("local", lr=0.1), 8)
    (SpectralGap(gap=1.0, lambda2=0.0), SpectralGap(gap=0.0, lambda2=1.0))
    """
    lambda2 = 1.0 if algorithm.traffic == "none" and n_agents > 1 else 0.0
    return topologies.SpectralGap(gap=1.0 - lambda2, lambda2=lambda2)


def own_graph(cfg: Config, algorithm: Algorithm):
    """The graph and mixing of a rule that brings its own, whatever ``topology`` says, as ``(G, W)``; else None.

    ``noloco``: random groups of ``group_size``, a new partition each outer step
    (``topologies.schedule("random_groups", ...)`` seeded by the run's seed; W is the schedule, G its union).
    ``diloco`` with a compressor and ``outer_mixing="allreduce"``: the complete graph with weights 1/N (the
    compressed messages are all-gathered: each agent sends its message to every other).
    """
    if getattr(algorithm, "needs_groups", False):
        if cfg.n_agents % algorithm.group_size:
            raise ValueError(f"group_size={algorithm.group_size} must divide n_agents={cfg.n_agents} (noloco "
                             "partitions the agents into groups of that size)")
        W = topologies.schedule("random_groups", cfg.n_agents, group_size=algorithm.group_size, seed=cfg.seed)
        return W.union_graph(), W
    if getattr(algorithm, "needs_complete", False):
        if cfg.n_agents < 2:
            raise ValueError(f"n_agents must be >= 2 for a compressed all-reduce, got {cfg.n_agents}")
        G = nx.complete_graph(cfg.n_agents)
        return G, topologies.mixing_matrix(G, "uniform")
    return None


def plan_topology(cfg: Config):
    """The graph and mixing matrix of ``cfg.topology``, ``cfg.mixing`` and ``cfg.topology_params`` on
    ``cfg.n_agents`` agents: ``(G, W)`` by :func:`topologies.graph_and_mixing` (W a Schedule for a
    time-varying topology). Fewer than 2 agents are refused, naming ``n_agents``.

        >>> from cdsgd.config import load_config
        >>> plan_topology(load_config(overrides=["n_agents=1"]))
        Traceback (most recent call last):
        ...
        ValueError: n_agents must be >= 2 with algorithm='cdmsgd', which mixes over a graph (only sgd, msgd, fedavg, local, diloco run on 1 agent), got 1
    """
    if cfg.n_agents < 2:  # the one message: the topologies' own ("n must be ...") does not name the config key
        alone = ", ".join(a for a in ALGORITHMS if ALGORITHMS.get(a).traffic != "neighbours")
        raise ValueError(f"n_agents must be >= 2 with algorithm={cfg.algorithm!r}, which mixes over a graph "
                         f"(only {alone} run on 1 agent), got {cfg.n_agents}")
    # mixing left at its default is "not given": a schedule refuses only a rule the user chose
    rule = None if cfg.mixing == key_info("mixing")["default"] else cfg.mixing
    return topologies.graph_and_mixing(cfg.topology, cfg.n_agents, rule, **cfg.topology_params)
