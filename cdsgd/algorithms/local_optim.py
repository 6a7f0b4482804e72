r"""Each agent's local optimizer, a transform of the update stack: ``sgd`` (the rule's own arithmetic) or ``adamw``.

Under ``optimizer="sgd"`` (the default) a rule steps along its update u (the gradient g + λx with the L2
term of ``weight_decay`` λ, the averaged gradient, the tracker), with its own momentum where it has one.
Under ``optimizer="adamw"`` it steps along the AdamW direction of u instead (Loshchilov & Hutter,
"Decoupled weight decay regularization", ICLR 2019; ``torch.optim.AdamW``), computed row by row of the
L×P stack U, one row per agent, with the moments m, v (L×P) and the step count t (one per agent) in the
rule's state (``adam_m``, ``adam_v``, ``adam_t``: checkpoints save them with the rest)::

    t ← t + 1
    m ← β1 m + (1 − β1) u,          v ← β2 v + (1 − β2) u²
    m̂ = m / (1 − β1^t),             v̂ = v / (1 − β2^t)
    d = m̂ / (√v̂ + ε) + λ x          (x: the agent's parameters before the step; λ decoupled, not in u)

and the rule takes d where it took g: for ``cdsgd`` x_j ← Σ_l π_jl x_l − α_k d_j, which for one agent
(Π = [1]) is ``torch.optim.AdamW``'s step x ← x − α_k λ x − α_k m̂/(√v̂ + ε). Adam's β1 moment is the
momentum: a rule's ``momentum`` and ``nesterov`` are not used under ``adamw``. Which rules take it, and
where the mixing meets the Adam step in each, is the rules' (docs/algorithms.md).

Example (one agent, one coordinate: Adam's first step is sign(g), whatever |g|)::

    >>> import torch
    >>> adam = AdamW(betas=(0.9, 0.999), eps=1e-8)
    >>> X, G = torch.tensor([[1.0]]), torch.tensor([[-4.0]])
    >>> state = adam.init_state(X)
    >>> d = adam.direction(G, X, state, weight_decay=0.0, out=torch.empty_like(X))
    >>> round(d.item(), 6), state["adam_t"].item()
    (-1.0, 1.0)
"""

from __future__ import annotations

import torch

from ..base.checks import BETAS, EPS, HYPER_DEFAULTS, OPTIMIZERS

__all__ = ["AdamW", "adamw_direction", "local_optimizer"]


def adamw_direction(U: torch.Tensor, X: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: torch.Tensor, *,
                    betas: tuple[float, float], eps: float, weight_decay: float, out: torch.Tensor,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """The AdamW direction d = m̂/(√v̂ + ε) + λx of the update U at X into ``out`` (module docstring).

    ``m``, ``v`` (shaped as U) and ``t`` (the step counts, broadcastable over U: one per row, or one
    scalar for a single tensor) are updated in place. ``rows`` (a boolean mask, shaped as t): only
    those rows take the step; the others keep their m, v and t (``out`` there is not to be used).
    ``out`` must not overlap U, X, m or v. Returns ``out``.
    """
    if rows is not None:  # a few agents (FedAvg's sampled ones): step all, then put the others back
        kept = [m.clone(), v.clone()]
        adamw_direction(U, X, m, v, t, betas=betas, eps=eps, weight_decay=weight_decay, out=out)
        t.sub_((~rows).to(t.dtype))
        m.copy_(torch.where(rows, m, kept[0]))
        v.copy_(torch.where(rows, v, kept[1]))
        return out
    beta1, beta2 = betas
    t.add_(1)
    m.mul_(beta1).add_(U, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(U, U, value=1.0 - beta2)
    bias1 = (1.0 - beta1 ** t).to(U.dtype)
    bias2 = (1.0 - beta2 ** t).sqrt_().to(U.dtype)
    torch.sqrt(v, out=out).div_(bias2).add_(eps)  # √v̂ + ε
    torch.div(m, out, out=out).div_(bias1)  # m̂ / (√v̂ + ε)
    if weight_decay:
        out.add_(X, alpha=weight_decay)
    return out


class AdamW:
    """The ``adamw`` transform of an L×P update stack (module docstring), with its ``betas`` and ``eps``."""

    def __init__(self, *, betas=HYPER_DEFAULTS["betas"], eps: float = HYPER_DEFAULTS["eps"]) -> None:
        self.betas = BETAS.check("betas", betas)
        self.eps = float(EPS.check("eps", eps))

    def init_state(self, X: torch.Tensor) -> dict:
        """m = v = 0 (shaped as X) and t = 0 per row of X (float64, shaped to broadcast over a row)."""
        t = torch.zeros(X.shape[0], *([1] * (X.dim() - 1)), dtype=torch.float64, device=X.device)
        return {"adam_m": torch.zeros_like(X), "adam_v": torch.zeros_like(X), "adam_t": t}

    def direction(self, U: torch.Tensor, X: torch.Tensor, state: dict, *, weight_decay: float, out: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """d of each row of U at X (:func:`adamw_direction`) into ``out``, with the moments of ``state``;
        ``rows``: a boolean L-vector of the rows that step (None: all)."""
        t = state["adam_t"]
        return adamw_direction(U, X, state["adam_m"], state["adam_v"], t, betas=self.betas, eps=self.eps,
                               weight_decay=weight_decay, out=out,
                               rows=None if rows is None else rows.view(t.shape).to(t.device))

    def __repr__(self) -> str:
        return f"AdamW(betas={self.betas}, eps={self.eps:g})"


def local_optimizer(optimizer: str, *, betas=HYPER_DEFAULTS["betas"], eps: float = HYPER_DEFAULTS["eps"]) -> AdamW | None:
    """The transform of ``optimizer``: None for ``"sgd"`` (the rule's own arithmetic), an :class:`AdamW` for
    ``"adamw"``; ``betas`` and ``eps`` are checked either way (a bad value is refused even where unused).

    >>> local_optimizer("sgd") is None, local_optimizer("adamw", betas=[0.9, 0.95])
    (True, AdamW(betas=(0.9, 0.95), eps=1e-08))
    """
    name = OPTIMIZERS.check("optimizer", optimizer)
    adam = AdamW(betas=betas, eps=eps)
    return adam if name == "adamw" else None
