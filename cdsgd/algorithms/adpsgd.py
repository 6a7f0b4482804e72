r"""Asynchronous decentralized parallel SGD (``adpsgd``): no agent waits; pairs average when one is done.

Lian, Zhang, Zhang & Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent" (ICML 2018). Every agent computes gradients one after
another without waiting for anyone. When agent i has its gradient g_i,
computed at the parameters x̂_i it read when that computation started, it
picks ONE neighbour j of the graph uniformly at random and, atomically::

    x_i, x_j ← (x_i + x_j) / 2                 (both: a pairwise average with j's current parameters)
    x_i      ← x_i − α_t · d_i(g_i + λ x̂_i)    (d: local momentum as in dsgt/sgp; μ = 0: d(g) = g)

t is agent i's own count of gradients applied (the step size of a diminishing
schedule follows it), λ the weight decay, applied at x̂_i where the gradient
was taken. j is drawn from the stream (seed, "adpsgd", i, t): uniform over
i's neighbours in increasing order (:meth:`ADPSGDAlgorithm.partner`). Each
pairwise average keeps Σ_j x_j, so with α = 0 the mean of the agents never
moves. x_i − x̂_i (what neighbours averaged in while i computed) is the
staleness of i's gradient; the order of events comes from a time model, in
:mod:`cdsgd.executor.asynchronous` (:class:`~cdsgd.executor.asynchronous.AsyncExecutor`),
which is the only executor that runs this rule (``cdsgd run`` picks it).

The graph: W's off-diagonal non-zeros are the edges (its weights are not
used); a pairwise exchange needs each edge both ways, so W's pattern must be
symmetric, and one fixed graph (a time-varying schedule is refused).

Example (3 agents on a path, zero gradients: agent 1 averages with agent 0)::

    >>> import torch
    >>> from cdsgd.algorithms import make_algorithm
    >>> alg = make_algorithm("adpsgd", lr=0.1)
    >>> X = torch.tensor([[0.0], [4.0], [8.0]]); state = alg.init_state(X)
    >>> alg.exchange(X, torch.zeros(1), state, i=1, j=0, t=0).tolist()
    [[2.0], [2.0], [8.0]]
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ..base.seeding import derive_seed
from ..mixers import is_schedule, is_sparse
from .heterogeneous import _LocalMomentum
from .rules import ALGORITHMS, Algorithm, _direction, cdsgd_update, with_weight_decay

__all__ = ["ADPSGDAlgorithm", "is_asynchronous"]


def is_asynchronous(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` runs event by event in the asynchronous executor (``adpsgd``), not in steps."""
    return bool(getattr(algorithm, "asynchronous", False))


@ALGORITHMS.register("adpsgd")
class ADPSGDAlgorithm(_LocalMomentum, Algorithm):
    """AD-PSGD (module docstring): one pairwise average and one local step per gradient, no waiting."""

    name, traffic = "adpsgd", "neighbours"
    why_not_periodic = "it is asynchronous: every event is one pairwise exchange"
    elastic, why_not_elastic = False, "its asynchronous executor has no membership of steps"
    #: runs in :class:`cdsgd.executor.asynchronous.AsyncExecutor`, one gradient application at a time
    asynchronous: ClassVar[bool] = True
    #: a lost exchange is not simulated: networks with ``drop`` or ``link_failure`` are refused
    lost_message = None

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return self._momentum_state(X)

    def check_mixing(self, W) -> None:
        """One fixed graph whose every edge goes both ways (W's weights are not used, only its pattern)."""
        if is_schedule(W):
            raise ValueError(f"algorithm 'adpsgd' gossips over one fixed graph; topology {W.name!r} is a "
                             "time-varying schedule: give a graph (ring, torus, ...)")
        if W is None:
            return
        S = W.tocoo() if is_sparse(W) else None
        rows, cols = (S.row[S.data != 0], S.col[S.data != 0]) if S is not None else np.asarray(W).nonzero()
        edges = set(zip(rows.tolist(), cols.tolist()))
        one_way = sorted((i, j) for i, j in edges if (j, i) not in edges)
        if one_way:
            i, j = one_way[0]
            raise ValueError(f"algorithm 'adpsgd' averages pairs of neighbours both ways, but W[{i}, {j}] ≠ 0 "
                             f"and W[{j}, {i}] = 0: give an undirected graph")
        super().check_mixing(W)  # doubly stochastic, as every neighbour rule's (its weights are not used)

    def partner(self, i: int, t: int, neighbours: list[int]) -> int:
        """The neighbour agent i averages with at its t-th gradient: uniform over ``neighbours`` by (seed, "adpsgd", i, t)."""
        rng = np.random.default_rng(derive_seed(self.seed, "adpsgd", i, t))
        return neighbours[int(rng.integers(len(neighbours)))]

    def exchange(self, X: torch.Tensor, g: torch.Tensor, state: dict, *, i: int, j: int, t: int,
                 at: torch.Tensor | None = None) -> torch.Tensor:
        """One event on the stack X (in place): rows i and j averaged, then row i steps along d_i(g + λ·at).

        ``g`` is agent i's gradient (a P-vector) taken at ``at`` (its snapshot x̂_i; default: x_i before
        the event, which only matters for weight decay); ``t`` is i's count of gradients applied so far.
        Returns X.
        """
        at = X[i].clone() if at is None and self.weight_decay else at
        g = with_weight_decay(g, at, self.weight_decay)
        avg = torch.add(X[i], X[j]).mul_(0.5)
        X[j].copy_(avg)
        rows = {name: buf[i] for name, buf in state.items()}  # agent i's momentum rows (views)
        d = _direction(g, rows, self.momentum, self.nesterov)
        cdsgd_update(avg, d, self.step_size(t), out=X[i])
        return X

    def update(self, X, G, state, *, k, mixer, mixed=None):  # not Algorithm.update: no synchronous step at all
        raise ValueError("algorithm 'adpsgd' is asynchronous: it runs one gradient application at a time in "
                         "cdsgd.executor.asynchronous.AsyncExecutor (cdsgd run picks it), not in synchronous steps")

