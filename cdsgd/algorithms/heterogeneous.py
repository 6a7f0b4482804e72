r"""Update rules that survive heterogeneous data: gradient tracking, D², quasi-global momentum.

CDSGD/CDMSGD (D-PSGD) converge to a neighbourhood of the optimum whose size
grows with how much the agents' local objectives f_j differ: at a fixed
point of x_j ← Σ_l π_jl x_l − α ∇f_j(x_j) the agents' gradients do not
vanish, they balance the graph's pull. The rules below remove that bias.
Notation as in :mod:`cdsgd.algorithms.rules`: g_j = ∇f_j(x_j) (+ λ x_j), W = (π_jl),
α_k the step size, β the local momentum (``momentum``). Each is written once
over the :class:`~cdsgd.mixers.Mixer` interface, so the simulator and the
runtime run the same code; ``vectors_per_step`` P-vectors go to each neighbour
per step and ``bytes_sent_per_agent`` counts them.

Local momentum (``momentum`` β > 0) is the reference implementations' form:
m ← β m + u, direction d = u + β m (Nesterov, default) or d = m (heavy ball),
applied to the update u that the rule would otherwise take (the gradient, or
the tracker for ``dsgt``); β = 0 gives d = u.

``dsgt``  gradient tracking (Pu & Nedić, "Distributed stochastic gradient
          tracking methods", Math. Program. 2021; Koloskova, Lin & Stich,
          "An improved analysis of gradient tracking for decentralized
          machine learning", NeurIPS 2021), in the combine-then-adapt form of
          DIGing (Nedić, Olshevsky & Shi 2017, eq. 3), step k = 0, 1, …:

              y_j^k     = Σ_l π^{k−1}_jl y_l^{k−1} + g_j(x_j^k) − g_j(x_j^{k−1})   (y_j^0 = g_j(x_j^0))
              x_j^{k+1} = Σ_l π^k_jl x_l^k − α_k d(y_j^k)

          with W_k = (π^k_jl) the matrix of step k: one W for a static graph,
          W_{k mod T} of a time-varying :class:`topologies.Schedule`. As in
          DIGing, x^k and y^k are both mixed with W_k: x^k during step k, y^k
          (made at step k from g(x^k)) during step k + 1. So step k's two
          exchanges are W_k x^k (the mixer handed to step k) and W_{k−1} y^{k−1}
          (its schedule's previous step, ``mixer.part_of.at(mixer.phase − 1)``;
          at k = 0, y^{−1} = 0 and g(x^{−1}) = 0, so W_{−1} = W_{T−1} mixes zeros).
          The tracker's average equals the agents' average gradient at every
          step (every W_k is doubly stochastic), so a fixed point has
          Σ_j ∇f_j = 0 and consensus: no bias. Both exchanges need only the
          previous step, so both are posted before the backward pass.
          **Two vectors per step** (parameters and tracker).
          Under ``optimizer="adamw"`` the direction is AdamW's of the tracker,
          d = m̂/(√v̂ + ε) + λ x with m ← β1 m + (1 − β1) y^k, v ← β2 v +
          (1 − β2) (y^k)² (the tracker is built from the gradients without
          weight decay): GTAdam (Carnevale, Farina, Notarnicola & Notarstefano,
          "GTAdam: gradient tracking with adaptive momentum for distributed
          online optimization", IEEE TCNS 2023), with Adam's bias correction
          and without GTAdam's clipping of v.
``d2``    D² / exact diffusion (Tang, Lian, Yan, Zhang & Liu, "D²:
          Decentralized training over decentralized data", ICML 2018), with
          u_k = α_k d_k (d the local momentum direction of g):

              x_j^{k+1} = Σ_l π_jl (2 x_l^k − x_l^{k−1} − u_l^k + u_l^{k−1})

          with x^{−1} = x^0 and u^{−1} = 0 (the first step is D-PSGD's). The
          correction cancels the data's bias at a fixed point. Needs W's
          smallest eigenvalue λₙ > −1/3 (refused otherwise, see
          :meth:`D2Algorithm.check_mixing`; ``mixing=lazy_metropolis`` always
          qualifies). One vector per step, mixed after the gradient.
``qg_dsgdm``  quasi-global momentum (Lin, Karimireddy, Stich & Jaggi,
          "Quasi-global momentum: accelerating decentralized deep learning on
          heterogeneous data", ICML 2021): the momentum buffer m̂ follows the
          model's actual movement, gossip included, instead of the local
          gradient:

              m̃ = β m̂ + g;  d = g + β m̃ (Nesterov) or m̃
              x_j ← Σ_l π_jl (x_l − α_k d_l)
              m̂ ← β m̂ + (1 − β)(x_j^k − x_j^{k+1}) / α_k      (m̂ kept as it is when α_k = 0)

          One vector per step, mixed after the gradient.

Example (two agents with f_j(x) = ½(x − b_j)², b = (0, 4): the optimum of
the sum is 2; gradient tracking gets there, and so do its agents)::

    >>> import torch
    >>> from cdsgd.algorithms import make_algorithm
    >>> from cdsgd.mixers import MatrixMixer
    >>> mixer, alg = MatrixMixer([[0.75, 0.25], [0.25, 0.75]]), make_algorithm("dsgt", lr=0.2, momentum=0.0)
    >>> X, b = torch.zeros(2, 1, dtype=torch.float64), torch.tensor([[0.0], [4.0]], dtype=torch.float64)
    >>> state = alg.init_state(X)
    >>> for k in range(200):
    ...     _ = alg.update(X, X - b, state, k=k, mixer=mixer)
    >>> [round(v, 6) for v in X.flatten().tolist()]
    [2.0, 2.0]
"""

from __future__ import annotations

import numpy as np
import torch

import topologies

from ..mixers import is_schedule
from .rules import ALGORITHMS, Algorithm, _direction, _in_blocks, _MomentumMixin, cdsgd_update

__all__ = ["D2Algorithm", "DSGTAlgorithm", "QGDSGDmAlgorithm"]

#: D²'s condition on the mixing matrix: its smallest eigenvalue must exceed this
D2_MIN_EIGENVALUE = -1.0 / 3.0


class _LocalMomentum(_MomentumMixin):
    """``momentum`` β and ``nesterov`` for the local direction d(u) (β = 0: d(u) = u, no buffers)."""

    def _momentum_state(self, X: torch.Tensor) -> dict:
        if not self.momentum or self.adam is not None:  # adamw: β1's moment is the momentum
            return {}
        return {"momentum": torch.zeros_like(X), "direction": torch.zeros_like(X)}


@ALGORITHMS.register("dsgt")
class DSGTAlgorithm(_LocalMomentum, Algorithm):
    """Gradient tracking (module docstring): two vectors per step, both posted before the backward pass."""

    name, traffic, mixes_params, vectors_per_step, takes_adamw = "dsgt", "neighbours", True, 2, True
    why_not_periodic = "its tracker is mixed a step late, with the previous step's W"

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"tracker": torch.zeros_like(X), "previous_gradient": torch.zeros_like(X), **self._momentum_state(X)}

    def start(self, X, state, mixer):
        """Post step k's two exchanges: W_k x^k with ``mixer`` (step k's), W_{k−1} y^{k−1} with step k − 1's."""
        Y = state["tracker"]
        owner = mixer.part_of  # a time-varying schedule when mixer is one of its steps
        static = owner is None or not is_schedule(owner.matrix)  # (a lossy network's mixer of a static W: its W)
        previous = mixer if static else owner.at(mixer.phase - 1)  # built before any exchange posts
        return mixer.start(X, out=self._scratch(X, "mixed")), previous.start(Y, out=self._scratch(Y, "mixed_tracker"))

    def _step(self, X, G, state, *, k, mixer, mixed):
        mixed_x, mixed_y = mixed if mixed is not None else self.start(X, state, mixer)
        Y, G_prev = state["tracker"], state["previous_gradient"]
        Wy = mixed_y.wait()
        for Wy_b, G_b, Y_b, Gp_b in _in_blocks(Wy, G, Y, G_prev):
            torch.add(Wy_b, G_b, out=Y_b).sub_(Gp_b)  # y^k = W_{k−1} y^{k−1} + g(x^k) − g(x^{k−1})
            Gp_b.copy_(G_b)
        if self.adam is None:
            D = _direction(Y, state, self.momentum, self.nesterov)
        else:  # GTAdam's form: Adam's moments of the tracker
            D = self._local(Y, X, state)
        return cdsgd_update(mixed_x.wait(), D, self.step_size(k), out=X)


@ALGORITHMS.register("d2")
class D2Algorithm(_LocalMomentum, Algorithm):
    """D² / exact diffusion (module docstring): one vector per step, after the gradient."""

    name, traffic = "d2", "neighbours"
    why_not_periodic = "its correction x^k − x^{k−1} assumes one W on consecutive steps"
    elastic, why_not_elastic = False, why_not_periodic

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"previous_params": X.detach().clone(), "previous_update": torch.zeros_like(X),
                "half_step": torch.zeros_like(X), **self._momentum_state(X)}

    def check_mixing(self, W) -> None:
        """Refuse W unless its smallest eigenvalue exceeds −1/3 (D²'s convergence condition); refuse schedules."""
        if isinstance(W, topologies.Schedule):
            raise ValueError(f"algorithm 'd2' needs one fixed symmetric mixing matrix, not a time-varying "
                             f"schedule ({W.name}); use dsgt, cdsgd or cdmsgd with it")
        super().check_mixing(W)
        S = W if hasattr(W, "nnz") else np.asarray(W, dtype=np.float64)
        if abs(S - S.T).max() > topologies.TOL:
            raise ValueError("algorithm 'd2' needs a symmetric mixing matrix (an undirected graph)")
        lam = topologies.smallest_eigenvalue(W)
        if not lam > D2_MIN_EIGENVALUE + 1e-12:
            raise ValueError(
                f"algorithm 'd2' needs a mixing matrix whose smallest eigenvalue is > -1/3, but this one's is "
                f"{lam:.6g}; use mixing=lazy_metropolis ((I + W)/2 has eigenvalues >= 0)")

    def _step(self, X, G, state, *, k, mixer, mixed):
        D = _direction(G, state, self.momentum, self.nesterov)
        lr = self.step_size(k)
        X_prev, U_prev, H = state["previous_params"], state["previous_update"], state["half_step"]
        for X_b, D_b, Xp_b, Up_b, H_b in _in_blocks(X, D, X_prev, U_prev, H):
            torch.mul(X_b, 2.0, out=H_b).sub_(Xp_b).add_(Up_b).add_(D_b, alpha=-lr)  # 2x^k − x^{k−1} − u^k + u^{k−1}
            torch.mul(D_b, lr, out=Up_b)
            Xp_b.copy_(X_b)
        return mixer.mix(H, out=X)


@ALGORITHMS.register("qg_dsgdm")
class QGDSGDmAlgorithm(_MomentumMixin, Algorithm):
    """Quasi-global momentum (module docstring): one vector per step, after the gradient."""

    name, traffic, periodic = "qg_dsgdm", "neighbours", True

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"momentum": torch.zeros_like(X), "direction": torch.zeros_like(X), "half_step": torch.zeros_like(X)}

    def _step(self, X, G, state, *, k, mixer, mixed):
        beta, lr = self.momentum, self.step_size(k)
        M, D, H = state["momentum"], state["direction"], state["half_step"]
        for G_b, M_b, D_b, X_b, H_b in _in_blocks(G, M, D, X, H):
            torch.mul(M_b, beta, out=D_b).add_(G_b)  # m̃ = β m̂ + g
            if self.nesterov:
                D_b.mul_(beta).add_(G_b)  # d = g + β m̃
            torch.add(X_b, D_b, alpha=-lr, out=H_b)
        mixed = mixer.mix(H, out=self._scratch(X, "mixed"))
        for M_b, D_b, X_b, W_b in _in_blocks(M, D, X, mixed):
            if lr > 0:  # at α_k = 0 (a scheduler's end) the movement is gossip alone: m̂ stays
                torch.sub(X_b, W_b, out=D_b)  # x^k − x^{k+1}
                M_b.mul_(beta).add_(D_b, alpha=(1.0 - beta) / lr)
            X_b.copy_(W_b)
        return X
