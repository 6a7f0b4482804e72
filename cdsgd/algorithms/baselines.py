r"""The baselines, run by the same machinery as the decentralized rules: ``sgd``, ``msgd``, ``fedavg``, ``local``.

Notation as in :mod:`cdsgd.algorithms.rules`.

``sgd``     x_j ← x_j − α ḡ,  ḡ = (1/N) Σ_l g_l        (centralized: one model
            trained on the union of the agents' batches)
``msgd``    the same with momentum on ḡ (Nesterov or heavy ball as ``cdmsgd``,
            with Σ_l π_jl x_l replaced by x_j)
``fedavg``  each agent runs ``local_steps`` SGD steps on its shard (or
            ``local_epochs`` epochs), then x_j ← mean of the participating
            agents' x (all agents by default; ``fedavg_fraction`` samples
            max(1, round(fraction·N)) agents per round; the others sit the
            round out and receive the average)
``local``   Π = I: x_j ← x_j − α g_j (momentum as in cdmsgd when μ > 0);
            no communication.

Under ``optimizer="adamw"`` (:mod:`cdsgd.algorithms.local_optim`; d(u) = m̂/(√v̂ + ε) + λx):

``sgd``, ``msgd``  x_j ← x_j − α_k d(ḡ): AdamW on the averaged gradient, i.e.
            data-parallel AdamW (``torch.optim.AdamW`` under DDP); every agent
            keeps the same moments. ``msgd`` is the same rule (β1 is its momentum).
``fedavg``  local AdamW steps x_j ← x_j − α_k d(g_j), then the average of x;
            the moments stay local and are never averaged (the inner optimizer
            of DiLoCo, Douillard et al. 2023, with an outer step of 1 and no
            outer momentum). An agent sitting a round out keeps its moments.
``local``   x_j ← x_j − α_k d(g_j): each agent alone is ``torch.optim.AdamW``.

Example (two agents, all-reduce: both step along the mean gradient)::

    >>> import torch
    >>> from cdsgd.algorithms import make_algorithm
    >>> from cdsgd.mixers import make_mixer
    >>> alg, X = make_algorithm("sgd", lr=0.5), torch.zeros(2, 1)
    >>> alg.update(X, torch.tensor([[1.0], [3.0]]), alg.init_state(X), k=0, mixer=make_mixer(None, n_agents=2)).tolist()
    [[-1.0], [-1.0]]
"""

from __future__ import annotations

import torch

from ..base.checks import FEDAVG_FRACTION, HYPER_DEFAULTS, check_int
from ..base.seeding import derive_seed
from .rules import ALGORITHMS, Algorithm, _MomentumMixin, cdsgd_update, momentum_update

__all__ = ["FedAvgAlgorithm", "LocalAlgorithm", "MSGDAlgorithm", "SGDAlgorithm"]


@ALGORITHMS.register("sgd")
class SGDAlgorithm(Algorithm):
    name, traffic, same_init, takes_adamw = "sgd", "allreduce", True, True
    why_not_periodic = "it all-reduces gradients on every step; local steps between averages are fedavg or diloco"

    def _step(self, X, G, state, *, k, mixer, mixed):
        G = mixer.average(G, out=self._scratch(X, "average"))
        return cdsgd_update(X, self._local(G, X, state), self.step_size(k), out=X)


@ALGORITHMS.register("msgd")
class MSGDAlgorithm(_MomentumMixin, Algorithm):
    name, traffic, same_init, takes_adamw = "msgd", "allreduce", True, True
    why_not_periodic = SGDAlgorithm.why_not_periodic

    def _step(self, X, G, state, *, k, mixer, mixed):
        G = mixer.average(G, out=self._scratch(X, "average"))
        if self.adam is not None:  # sgd's step along AdamW's direction
            return cdsgd_update(X, self._local(G, X, state), self.step_size(k), out=X)
        return momentum_update(X, G, state["momentum"], self.step_size(k), self.momentum, self.nesterov, out=X)


@ALGORITHMS.register("fedavg")
class FedAvgAlgorithm(Algorithm):
    name, traffic, same_init, takes_adamw = "fedavg", "allreduce", True, True

    def __init__(self, *, local_steps: int | None = HYPER_DEFAULTS["local_steps"], local_epochs: int | None = None,
                 fedavg_fraction: float = HYPER_DEFAULTS["fedavg_fraction"], **common) -> None:
        super().__init__(**common)
        if local_steps is not None and local_epochs is not None:
            raise ValueError(f"give local_steps or local_epochs, not both (got {local_steps} and {local_epochs})")
        self.local_steps = None if local_steps is None else check_int("local_steps", local_steps, 1)
        self.local_epochs = None if local_epochs is None else check_int("local_epochs", local_epochs, 1)
        if self.local_steps is None and self.local_epochs is None:  # local_epochs None: "not given", so that
            self.local_epochs = HYPER_DEFAULTS["local_epochs"]  # giving both is refused above
        self.fraction = float(FEDAVG_FRACTION.check("fedavg_fraction", fedavg_fraction))
        self._round_mask: tuple[int | None, torch.Tensor | None] = (None, None)  # (round, participants)

    @property
    def round_length(self) -> int:
        return self.local_steps if self.local_steps is not None else self.local_epochs * self.steps_per_epoch

    def communicates(self, k: int) -> bool:
        return (k + 1) % self.round_length == 0

    def participants(self, k: int) -> torch.Tensor | None:
        if self.fraction == 1.0:
            return None
        r = k // self.round_length
        if self._round_mask[0] != r:  # drawn once per round, asked for by the executor and by update
            g = torch.Generator().manual_seed(derive_seed(self.seed, "fedavg", r))
            m = max(1, round(self.fraction * self.n_agents))
            mask = torch.zeros(self.n_agents, dtype=torch.bool)
            mask[torch.randperm(self.n_agents, generator=g)[:m]] = True
            self._round_mask = (r, mask)
        return self._round_mask[1]

    def _step(self, X, G, state, *, k, mixer, mixed):
        mask = self.participants(k)
        if mask is None:
            cdsgd_update(X, self._local(G, X, state), self.step_size(k), out=X)
        else:  # agents sitting the round out keep their parameters (and their AdamW moments)
            D = self._local(G, X, state, rows=mask[mixer.agents])
            X.copy_(torch.where(_rows(mask[mixer.agents], X), X - self.step_size(k) * D, X))
        if self.communicates(k):
            X.copy_(mixer.average(X, mask, out=self._scratch(X, "average")))
        return X


def _rows(mask: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A mask over the stack's rows, broadcastable over the L×P stack."""
    return mask.view(-1, *([1] * (X.dim() - 1)))


@ALGORITHMS.register("local")
class LocalAlgorithm(_MomentumMixin, Algorithm):
    name, traffic, takes_adamw = "local", "none", True
    why_not_periodic = "it never communicates: every step is local"

    def _step(self, X, G, state, *, k, mixer, mixed):
        if self.momentum and self.adam is None:
            return momentum_update(X, G, state["momentum"], self.step_size(k), self.momentum, self.nesterov, out=X)
        return cdsgd_update(X, self._local(G, X, state), self.step_size(k), out=X)
