r"""Stochastic Gradient Push (``sgp``): push-sum over directed graphs.

Assran, Loizou, Ballas & Rabbat, "Stochastic Gradient Push for distributed
deep learning" (ICML 2019). On a directed graph agents cannot agree on a
doubly stochastic W; push-sum needs only a **column-stochastic** P (each
agent splits what it holds among itself and the agents it sends to:
``mixing=push_sum``, P[j, i] = 1/(1 + out-degree of i)). Agent j carries a
numerator x_j and a weight w_j (w = 1 at the start); the de-biased
parameters z_j = x_j / w_j are what it computes gradients at and what is
evaluated (the executor's parameter stack holds z). One step:

    x_j = z_j · w_j − α_k d(g_j(z_j))          (d: local momentum, as in the other rules)
    x_j ← Σ_l P_jl x_l,   w_j ← Σ_l P_jl w_l    (one vector and one scalar to each out-neighbour)
    z_j = x_j / w_j

Column-stochastic mixing preserves Σ_j x_j and Σ_j w_j = N, so Σ_j x_j / N
moves exactly like centralized SGD's iterate on the average gradient, and
the z_j agree at the rate of P's second-largest eigenvalue modulus. With a
doubly stochastic P (any undirected graph's rules, or a regular directed
graph such as ``directed_exponential``) w stays 1 and SGP is D-PSGD (CDSGD)
in its adapt-then-combine form.

Example (a directed ring of 3, zero gradients: push-sum averages)::

    >>> import torch, topologies
    >>> from cdsgd.algorithms import make_algorithm
    >>> from cdsgd.mixers import MatrixMixer
    >>> P = topologies.mixing_matrix(topologies.build("directed_ring", 3), "push_sum")
    >>> alg, mixer = make_algorithm("sgp", lr=0.1), MatrixMixer(P, validate=False)
    >>> X = torch.tensor([[0.0], [3.0], [6.0]], dtype=torch.float64); state = alg.init_state(X)
    >>> for k in range(60):
    ...     _ = alg.update(X, torch.zeros_like(X), state, k=k, mixer=mixer)
    >>> [round(v, 6) for v in X.flatten().tolist()]
    [3.0, 3.0, 3.0]
    >>> [round(w, 6) for w in alg.weights(state).tolist()]   # a directed ring's P is doubly stochastic: w stays 1
    [1.0, 1.0, 1.0]

**Reading the weights.** :meth:`SGPAlgorithm.weights` gives the w_j of a
state (a new tensor, one per agent of the stack); the executor's
``push_sum_weights`` (``sim.push_sum_weights``) gives those of the agents it
holds, and :class:`~cdsgd.algorithms.DecentralizedOptimizer` its agent's
(``opt.algorithm.weights(opt.rule_state)``). Agent j's numerator is
x_j = z_j · w_j, z_j its row of the parameter stack (``sim.X``).
"""

from __future__ import annotations

import torch

import topologies

from .heterogeneous import _LocalMomentum
from .rules import ALGORITHMS, Algorithm, _direction

__all__ = ["SGPAlgorithm"]


@ALGORITHMS.register("sgp")
class SGPAlgorithm(_LocalMomentum, Algorithm):
    """Stochastic Gradient Push (module docstring): a vector and a scalar per out-neighbour per step."""

    name, traffic, lost_message, periodic = "sgp", "neighbours", "lost", True
    elastic = False
    why_not_elastic = "a departing agent takes its push-sum weight with it, and no reference defines a return"
    column_stochastic = True

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"weight": torch.ones(X.shape[0], 1, dtype=X.dtype, device=X.device),
                "numerator": torch.zeros_like(X), **self._momentum_state(X)}

    @staticmethod
    def weights(state: dict) -> torch.Tensor:
        """The push-sum weights w_j of the agents in ``state`` (a new L-vector, entry i for row i of X).

        Each starts at 1 and is mixed like the numerators (w ← P w), so Σ_j w_j = N
        always; z_j = x_j / w_j are the parameters the stack holds.
        """
        return state["weight"].detach().reshape(-1).clone()

    def check_mixing(self, W) -> None:
        """Accept a column-stochastic P (push-sum), directed or not; refuse a schedule."""
        if isinstance(W, topologies.Schedule):
            raise ValueError("algorithm 'sgp' takes one mixing matrix (mixing=push_sum on a directed graph), "
                             f"not a time-varying schedule ({W.name})")
        topologies.validate(W, symmetric=False, row_sums=False)

    def _step(self, X, G, state, *, k, mixer, mixed):
        D = _direction(G, state, self.momentum, self.nesterov)
        w, num = state["weight"], state["numerator"]
        w_rows = w.view(-1, *([1] * (X.dim() - 1)))
        torch.mul(X, w_rows, out=num).add_(D, alpha=-self.step_size(k))  # x = z·w − α d
        mixed_num = mixer.start(num, out=self._scratch(num, "mixed"))
        mixed_w = mixer.start(w, out=self._scratch(w, "mixed_weight"))
        w.copy_(mixed_w.wait())
        return torch.div(mixed_num.wait(), w_rows, out=X)  # z = x / w

