"""Gradient strategies: how an executor computes the gradients of the agents it holds.

Two strategies with identical numerics (to float rounding):

``loop``   agent by agent, each on its own module whose parameters are views
           of its row of the parameter stack X and whose ``.grad`` are views
           of its row of the gradient stack G (backward accumulates in place:
           no copies in or out);
``vmap``   one function of the parameters, ``torch.func.grad`` of the loss
           through ``functional_call``, vectorised over agents with ``torch.vmap``,
           a block of agents at a time (:data:`VMAP_BLOCK_BYTES`); the batches
           are stacked into buffers kept from step to step.

Neither allocates anything N×P-sized in a step: G is filled in place, and
what torch allocates afresh (a block's gradients and activations) is bounded
by the block, not by N.

Either strategy can clip each agent's gradient to a global norm c
(``grad_clip``, 0: off) after computing it: row j of G becomes
g_j · min(1, c/‖g_j‖₂) (:func:`clip_rows_`), before the update rule sees G.

``auto`` picks ``vmap`` for models without convolutions, attention, dropout
or buffers (dense networks) and ``loop`` otherwise: dropout and buffers need
per-agent state that vmap cannot keep exactly, and for convolutions and
attention the loop is faster on CPU (the figures are in docs/benchmarks.md,
from ``benchmarks/simulator.py`` and ``benchmarks/transformer.py``; torch has
no vmap batching rule for its CPU attention kernel, so under vmap attention
runs agent by agent anyway). Inputs may be of any dtype (token ids are
int64) and targets of any shape (a language model's (B, T) next tokens).
Forcing ``vmap`` on a model with dropout or buffers is refused. The exact
mode uses the loop.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..base.flat import ParamLayout
from ..models import has_convolutions, vmap_blockers
from ..transformer import has_attention
from .streams import AgentRNG

__all__ = ["STRATEGIES", "GradientStrategy", "LoopGradients", "VmapGradients", "choose_strategy", "clip_rows_",
           "cross_entropy", "make_strategy", "nonfinite_rows"]

def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy −ln softmax(o)_y over every prediction: one per sample for logits (B, C) and
    labels (B,); one per position for a sequence model's logits (B, T, V) and next tokens (B, T), so a
    language model's loss is in nats per token.

        >>> o = torch.zeros(2, 3, 4); float(cross_entropy(o, torch.zeros(2, 3, dtype=torch.long)))  # ln 4
        1.3862943649291992
    """
    if logits.dim() == target.dim() + 1 and logits.dim() > 2:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return torch.nn.functional.cross_entropy(logits, target)


#: the names ``strategy=`` takes
STRATEGIES = ("auto", "loop", "vmap")


#: ``vmap`` computes the gradients of this many bytes of parameter rows at a time (a block of agents),
#: so its temporaries (the gradients it returns, the activations) stay bounded at any N. torch.func
#: returns them as fresh tensors (copied into G, then freed): one block's are alive at a time, each
#: below glibc's largest dynamic mmap threshold (32 MiB), so after the first step malloc reuses the
#: memory it holds instead of mapping (and the kernel zeroing) fresh pages every step. Smaller blocks
#: cost more per agent (vmap's fixed cost per call), larger ones no less (benchmarks/scale.py's MLP).
VMAP_BLOCK_BYTES = 1 << 25


def clip_rows_(G: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each row g_j of ``G`` in place by min(1, max_norm / ‖g_j‖₂); ``max_norm = 0`` leaves G as it is.

    A row at or below the threshold (a zero row too) is left unchanged. Returns ``G``.

    >>> clip_rows_(torch.tensor([[3.0, 4.0], [0.3, 0.4]]), 1.0).tolist()
    [[0.6000000238418579, 0.800000011920929], [0.30000001192092896, 0.4000000059604645]]
    """
    if max_norm > 0:
        norms = torch.linalg.vector_norm(G, dim=1, keepdim=True)
        G.mul_(torch.where(norms > max_norm, max_norm / norms, torch.ones_like(norms)))
    return G


def nonfinite_rows(X: torch.Tensor, sums: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Which rows of the L×P stack ``X`` hold a NaN or an infinity: a bool L-vector on the CPU.

    One read of X into ``sums`` (an L-vector the caller keeps, float32 or wider) and no L×P
    temporaries, as ``torch.isfinite(X)`` would make: a finite row sum proves a finite row (a NaN
    makes the sum NaN, an infinity makes it infinite or NaN), and only a row whose sum is not finite
    (non-finite entries, or finite ones whose sum overflows) is checked entry by entry. ``rows``
    (a bool L-vector) restricts the answer to those rows (the others are False).

    >>> X = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3e38, 3e38], [float("inf"), -float("inf")]])
    >>> nonfinite_rows(X, torch.empty(4)).tolist()
    [False, True, False, True]
    """
    torch.sum(X, dim=1, dtype=sums.dtype, out=sums)
    suspect = ~torch.isfinite(sums).cpu()
    if rows is not None:
        suspect &= rows
    for i in suspect.nonzero().flatten().tolist():  # rare: a diverging run, once per agent
        suspect[i] = not bool(torch.isfinite(X[i]).all())
    return suspect


def choose_strategy(strategy: str, template: nn.Module, *, exact: bool = False) -> str:
    """``loop`` or ``vmap`` for ``strategy`` (one of :data:`STRATEGIES`) and this model."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
    blockers = vmap_blockers(template)
    if strategy == "auto":
        return "loop" if blockers or exact or has_convolutions(template) or has_attention(template) else "vmap"
    if strategy == "vmap" and blockers:
        raise ValueError(f"strategy 'vmap' cannot simulate this model exactly: {'; '.join(blockers)}; use 'loop'")
    return strategy


class GradientStrategy:
    """Gradients of the held agents' losses, and model outputs for evaluation.

    ``models[i]`` is the i-th held agent's module; ``X``/``G`` are the L×P
    parameter and gradient stacks; ``rng`` runs agent i's forward pass on its
    own random stream (used when the model draws, e.g. dropout); ``grad_clip``
    the largest norm of an agent's gradient (0: no clipping, see :func:`clip_rows_`).
    """

    name: str

    def __init__(self, models: Sequence[nn.Module], layout: ParamLayout, X: torch.Tensor, G: torch.Tensor,
                 loss_fn: Callable, rng: AgentRNG, *, grad_clip: float = 0.0) -> None:
        self.models, self.layout, self.X, self.G, self.loss_fn, self.rng = list(models), layout, X, G, loss_fn, rng
        self.grad_clip = float(grad_clip)
        self.draws = bool(vmap_blockers(self.models[0]))  # per-agent RNG streams matter only for models that draw

    def gradients(self, active: list[int], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Fill the rows ``active`` (local indices) of G with their (clipped) gradients at X (other rows zero).

        ``batches[i]`` is the (inputs, targets) batch of ``active[i]``.
        Returns the batch losses, one per active row.
        """
        losses = self._gradients(active, batches)
        clip_rows_(self.G, self.grad_clip)
        return losses

    def _gradients(self, active, batches) -> torch.Tensor:
        raise NotImplementedError

    def outputs(self, flats: torch.Tensor, model_ids: list[int], xb: torch.Tensor) -> list[torch.Tensor]:
        """The outputs on ``xb`` of the models with parameters ``flats[i]`` (module ``model_ids[i]``)."""
        views = self.layout.views
        return [functional_call(self.models[m], views(f), (xb,)) for m, f in zip(model_ids, flats)]


class LoopGradients(GradientStrategy):
    """Agent by agent with plain autograd on modules bound to the stacks (see the module docstring)."""

    name = "loop"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the i-th module's parameters become views of X[i], their .grad views of G[i]
        for i, model in enumerate(self.models):
            for p, xv, gv in zip(model.parameters(), self.layout.views(self.X[i]).values(),
                                 self.layout.views(self.G[i]).values()):
                p.data = xv
                p.grad = gv
        self._grad_views = [[p.grad for p in m.parameters()] for m in self.models]

    def _backward(self, i: int, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.models[i](xb), yb)
        loss.backward()
        return loss.detach()

    def _gradients(self, active, batches):
        self.G.zero_()  # backward accumulates into G
        losses = []
        for i, (xb, yb) in zip(active, batches):
            losses.append(self.rng.run(i, self._backward, i, xb, yb) if self.draws else self._backward(i, xb, yb))
            for p, gv in zip(self.models[i].parameters(), self._grad_views[i]):
                if p.grad is not gv:  # autograd replaced the buffer instead of accumulating: copy back
                    gv.copy_(p.grad)
                    p.grad = gv
        return torch.stack(losses) if losses else torch.zeros(0)


class VmapGradients(GradientStrategy):
    """All held agents at once: ``vmap(grad_and_value(loss))`` over the parameter stack."""

    name = "vmap"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._grad = vmap(grad_and_value(self._loss))
        self._batch_buffers: list[torch.Tensor] = []  # the stacked inputs and targets, kept from step to step

    def _loss(self, params, xb, yb):
        return self.loss_fn(functional_call(self.models[0], params, (xb,)), yb)

    def _stacked(self, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """The active agents' batches stacked into buffers kept from step to step (no fresh allocation)."""
        stacked = []
        for k, part in enumerate(zip(*batches)):
            first = part[0]
            shape = (len(part), *first.shape)
            buf = self._batch_buffers[k] if k < len(self._batch_buffers) else None
            if buf is None or buf.shape != shape or buf.dtype != first.dtype or buf.device != first.device:
                buf = first.new_empty(shape)
                self._batch_buffers[k:k + 1] = [buf]
            stacked.append(torch.stack(part, out=buf))
        return stacked[0], stacked[1]

    def _gradients(self, active, batches):
        G, views = self.G, self.layout.views
        if not active:  # no agent held here takes part in this step (FedAvg)
            G.zero_()
            return torch.zeros(0)
        xb, yb = self._stacked(batches)
        every = len(active) == self.X.shape[0]  # every row is overwritten
        if not every:
            G.zero_()
        G_views = views(G)  # each parameter's (L, *shape) view of G
        losses = []
        block = max(1, VMAP_BLOCK_BYTES // (self.X.shape[1] * self.X.element_size()))  # agents per vmap call
        for b0 in range(0, len(active), block):  # a block of agents at a time: bounded temporaries
            b1 = min(len(active), b0 + block)
            rows = slice(b0, b1) if every else torch.tensor(active[b0:b1], device=self.X.device)
            g, loss = self._grad(views(self.X[rows]), xb[b0:b1], yb[b0:b1])
            for name, v in G_views.items():
                if every:
                    v[rows].copy_(g[name])
                else:
                    v.index_copy_(0, rows, g[name])
            losses.append(loss.detach())
            del g  # before the next block's: one block of temporaries alive at a time (see VMAP_BLOCK_BYTES)
        return torch.cat(losses)

    def outputs(self, flats, model_ids, xb):
        model, views = self.models[0], self.layout.views
        return list(vmap(lambda f: functional_call(model, views(f), (xb,)))(flats))


def make_strategy(name: str, *args, **kwargs) -> GradientStrategy:
    """The strategy ``name`` (``loop`` or ``vmap``, as :func:`choose_strategy` returns) over the stacks."""
    return {"loop": LoopGradients, "vmap": VmapGradients}[name](*args, **kwargs)
