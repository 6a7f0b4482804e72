r"""A small decoder-only transformer over token ids: ``model = "gpt"``.

Input: int64 token ids of shape (B, T), T ≤ ``context``; output: logits of
shape (B, T, V) for the next token at each position (V = ``n_classes``, the
vocabulary; 256 for byte-level text). With E the token embedding (V × d),
P the learned position embedding (context × d), d = ``width``:

.. math::

    h_0 = E[x_t] + P_t, \qquad
    h \leftarrow h + \mathrm{Attn}(\mathrm{LN}(h)), \qquad
    h \leftarrow h + \mathrm{MLP}(\mathrm{LN}(h))   \quad (\text{``layers`` pre-norm blocks}),

    \mathrm{logits} = \mathrm{LN}(h_L)\, E^\top \quad (\text{tied: } E \text{ is one parameter}),

with Attn causal multi-head self-attention (``heads`` heads of d/heads,
through ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``,
so position t sees positions ≤ t only) and MLP d → 4d → d with GELU.
Parameters (V vocabulary, C context, L layers, biases everywhere as in GPT-2):

.. math:: |θ| = V d + C d + L (12 d^2 + 13 d) + 2 d.

Initialisation as nanoGPT: N(0, 0.02) for embeddings and linear weights,
N(0, 0.02/√(2L)) for the two projections that write into the residual
stream, zero biases, LayerNorms at (1, 0). ``dropout`` (default 0) is
attention dropout (SDPA's ``dropout_p``, in training only) and residual
dropout (``nn.Dropout`` after the attention projection, the MLP and the
embeddings); with 0 there are no dropout modules at all, so agents of this
model can be stacked under ``torch.vmap``, and with dropout > 0 they cannot
(each agent needs its own random stream: :func:`cdsgd.models.vmap_blockers`).

    >>> m = gpt((8,), 16, layers=1, heads=2, width=8, context=8)
    >>> m(torch.zeros(3, 8, dtype=torch.long)).shape
    torch.Size([3, 8, 16])
    >>> sum(p.numel() for p in m.parameters()) == 16 * 8 + 8 * 8 + 12 * 8 ** 2 + 13 * 8 + 2 * 8
    True
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .base.checks import Bounds, check_int

__all__ = ["GPT", "gpt", "gpt_parameters", "has_attention"]


def gpt_parameters(n_classes: int, *, layers: int, width: int, context: int) -> int:
    """|θ| of :class:`GPT` in closed form: V·d + C·d + L·(12d² + 13d) + 2d.

    >>> gpt_parameters(256, layers=2, width=128, context=256)
    462336
    """
    return n_classes * width + context * width + layers * (12 * width ** 2 + 13 * width) + 2 * width


def has_attention(module: nn.Module) -> bool:
    """Whether ``module`` holds self-attention (a :class:`GPT` block or ``nn.MultiheadAttention``).

    The simulator's ``strategy = "auto"`` runs such models agent by agent: torch has no vmap batching
    rule for the CPU attention kernel, and the loop is the faster one (docs/benchmarks.md, from
    benchmarks/transformer.py).

    >>> has_attention(gpt((4,), 8, layers=1, heads=1, width=4, context=4)), has_attention(nn.Linear(2, 2))
    (True, False)
    """
    return any(isinstance(m, (_Block, nn.MultiheadAttention)) for m in module.modules())


class _Block(nn.Module):
    """One pre-norm block: h + Attn(LN(h)), then h + MLP(LN(h))."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        # no module when dropout is 0: vmap_blockers sees no dropout and the agents can be vectorised
        self.drop_attn = nn.Dropout(dropout) if dropout else nn.Identity()
        self.drop_mlp = nn.Dropout(dropout) if dropout else nn.Identity()

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.drop_attn(self.attention(self.ln1(h)))
        return h + self.drop_mlp(self.out(F.gelu(self.fc(self.ln2(h)))))


class GPT(nn.Module):
    """The decoder-only transformer of the module docstring (build it with :func:`gpt`, which checks the options)."""

    def __init__(self, n_classes: int, *, layers: int, heads: int, width: int, context: int,
                 dropout: float) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(n_classes, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self._init(layers)

    def _init(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln."):
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "out.weight")):  # the residual writes, scaled as GPT-2
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        if T > self.context:
            raise ValueError(f"the inputs are windows of T={T} tokens, longer than the model's context={self.context}")
        h = self.drop(self.tok(idx) + self.pos.weight[:T])
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.tok.weight.t()  # tied: the output reads the token embedding itself


def gpt(input_shape: Sequence[int], n_classes: int, layers: int = 2, heads: int = 4, width: int = 128,
        context: int = 256, dropout: float = 0.0) -> GPT:
    """A :class:`GPT` for token windows of ``input_shape = (T,)`` and a vocabulary of ``n_classes``.

    Every bad option is a one-line ValueError naming the value and what is allowed.

    >>> gpt((300,), 256)
    Traceback (most recent call last):
    ...
    ValueError: the data's windows are T=300 tokens, longer than the model's context=256; raise \
model_params.context or lower dataset_params.context
    >>> gpt((16,), 256, heads=3, width=32)
    Traceback (most recent call last):
    ...
    ValueError: model 'gpt': width=32 is not divisible by heads=3; width must be a multiple of heads
    """
    for key, value in (("layers", layers), ("heads", heads), ("width", width), ("context", context)):
        check_int(key, value, 1, what="model option ")
    Bounds(low=0, high=1, high_open=True).check("model option dropout", dropout)
    if width % heads:
        raise ValueError(f"model 'gpt': width={width} is not divisible by heads={heads}; "
                         "width must be a multiple of heads")
    if len(input_shape) != 1:
        raise ValueError(f"model 'gpt' reads windows of token ids of shape (T,), got input_shape "
                         f"{tuple(input_shape)} (a text data set gives (T,), e.g. dataset = \"python_code\")")
    if input_shape[0] > context:
        raise ValueError(f"the data's windows are T={input_shape[0]} tokens, longer than the model's "
                         f"context={context}; raise model_params.context or lower dataset_params.context")
    return GPT(n_classes, layers=layers, heads=heads, width=width, context=context, dropout=float(dropout))
