r"""The implicit GRU cell Φ_Δt of Moon & Cyr and the serial recurrence it defines.

:func:`implicit_gru_step` is the step h⁺ = (h + Δt·z⊙n) / (1 + Δt·z) on a
projected input (batched over any leading dimensions: MGRIT steps all
intervals at once); :class:`ImplicitGRUCell` holds its parameters (those of
``nn.GRUCell``); :func:`classic_gru_step` is ``nn.GRUCell``'s step with the
same parameters; :func:`serial_forward` is the plain loop over t, the
reference every MGRIT solve is measured against. The maths: :mod:`cdsgd.mgrit`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base.checks import check_int

__all__ = ["COARSE_STEPS", "ImplicitGRUCell", "classic_gru_step", "implicit_gru_step", "serial_forward"]


#: the coarse steps Φ_m of MGRIT's coarse grids (m = c^l fine steps): see :func:`implicit_gru_step`
COARSE_STEPS = ("euler", "frozen")


def _damping(z: torch.Tensor, dt: float, coarse: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q(z) with Φ = n + (h − n)·q, and dq/dz: 1/(1 + Δt z) (backward Euler) or (1 + z)^(−Δt) (frozen)."""
    if coarse == "euler" or dt == 1.0:
        q = 1 / (1 + dt * z)
        return q, -dt * q * q
    q = (1 + z) ** (-dt)
    return q, -dt * q / (1 + z)


def implicit_gru_step(h: torch.Tensor, xp: torch.Tensor, weight_hh: torch.Tensor, bias_hh: torch.Tensor,
                      dt: float = 1.0, coarse: str = "euler") -> torch.Tensor:
    """Φ_Δt(h, x): one implicit GRU step from the projected input ``xp = W x + b`` (…, 3H).

    ``h`` may carry any leading dimensions (intervals × batch): the step is
    batched over all of them. Written as h⁺ = n + (h − n)·q, the fine step
    (Δt = 1) has q = 1/(1 + z). A step of Δt = m > 1 stands for m fine steps:
    ``coarse="euler"`` is backward Euler with step m, q = 1/(1 + m z) (the
    paper's coarse step); ``coarse="frozen"`` is m fine steps with the gates
    z, n held at their values at (h, x), q = (1 + z)^(−m): exact when the
    gates do not change over the interval, and as forgetful as the fine
    steps (1/(1 + m z) forgets far more slowly than (1 + z)^(−m)).
    """
    gr, gz, gn = F.linear(h, weight_hh, bias_hh).chunk(3, -1)
    xr, xz, xn = xp.chunk(3, -1)
    r = torch.sigmoid(xr + gr)
    z = torch.sigmoid(xz + gz)
    n = torch.tanh(xn + r * gn)
    if coarse == "euler" or dt == 1.0:  # = n + (h − n)·q with _damping's q, in the form that keeps its old rounding
        dz = dt * z
        return (h + dz * n) / (1 + dz)
    return n + (h - n) * _damping(z, dt, coarse)[0]


class ImplicitGRUCell(nn.Module):
    r"""Parameters of a GRU cell and its implicit step Φ_Δt (maths: :mod:`cdsgd.mgrit`).

    Parameter names and shapes are those of ``nn.GRUCell`` (``weight_ih``
    (3H, I), ``weight_hh`` (3H, H), ``bias_ih``, ``bias_hh`` (3H), gates r, z, n),
    initialised the same way (uniform ±1/√H), so :func:`classic_gru_step`
    with these parameters is exactly ``nn.GRUCell``.

    >>> cell = ImplicitGRUCell(3, 5)
    >>> cell.step(torch.zeros(2, 5), torch.randn(2, 3), dt=4.0).shape
    torch.Size([2, 5])
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size, self.hidden_size = check_int("input_size", input_size), check_int("hidden_size", hidden_size)
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(3 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(3 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W x_t + b for all t at once (one batched matmul): (…, I) → (…, 3H)."""
        return F.linear(x, self.weight_ih, self.bias_ih)

    def step(self, h: torch.Tensor, x: torch.Tensor, dt: float = 1.0) -> torch.Tensor:
        """h⁺ = (h + Δt·z⊙n) / (1 + Δt·z) for the raw input ``x`` (…, I)."""
        return implicit_gru_step(h, self.project(x), self.weight_hh, self.bias_hh, dt)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"


def classic_gru_step(cell: ImplicitGRUCell, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The classic GRU step h⁺ = (1 − z)⊙n + z⊙h with ``cell``'s parameters (= ``nn.GRUCell``)."""
    gr, gz, gn = F.linear(h, cell.weight_hh, cell.bias_hh).chunk(3, -1)
    xr, xz, xn = cell.project(x).chunk(3, -1)
    r, z = torch.sigmoid(xr + gr), torch.sigmoid(xz + gz)
    n = torch.tanh(xn + r * gn)
    return (1 - z) * n + z * h


# ------------------------------------------------------ input check, serial loop

def _check_x_h0(cell: ImplicitGRUCell, x, h0):
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != cell.input_size or x.shape[1] < 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor of shape (B, T, input_size={cell.input_size}) with T >= 1, "
                         f"got {shape}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    B, H = x.shape[0], cell.hidden_size
    if h0 is None:
        return x.new_zeros(B, H)
    if not isinstance(h0, torch.Tensor) or tuple(h0.shape) not in ((B, H), (1, B, H)):
        shape = tuple(h0.shape) if isinstance(h0, torch.Tensor) else type(h0).__name__
        raise ValueError(f"h0 must have shape (B, hidden_size) = {(B, H)} or (1, B, hidden_size), got {shape}")
    return h0.reshape(B, H).to(x.dtype)


def serial_forward(cell: ImplicitGRUCell, x: torch.Tensor, h0: torch.Tensor | None = None, *,
                   kind: str = "implicit") -> torch.Tensor:
    """States h_1..h_T (B, T, H) by the plain loop; differentiable by autograd.

    ``kind="implicit"`` runs h_t = Φ_1(h_{t−1}, x_t) (the problem MGRIT
    solves), ``kind="classic"`` the classic GRU step. ``x`` is (B, T, I),
    ``h0`` (B, H) or None (zeros).
    """
    if kind not in ("implicit", "classic"):
        raise ValueError(f"kind must be 'implicit' or 'classic', got {kind!r}")
    h = _check_x_h0(cell, x, h0)
    out = []
    # unbind, not x[:, t]: the backward of T selects would build T full-size gradients (O(T²))
    for xt in (cell.project(x) if kind == "implicit" else x).unbind(1):
        h = implicit_gru_step(h, xt, cell.weight_hh, cell.bias_hh) if kind == "implicit" else \
            classic_gru_step(cell, h, xt)
        out.append(h)
    return torch.stack(out, 1)

