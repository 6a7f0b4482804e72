r"""The MGRIT solver, single process: forward state solve and adjoint (gradient) solve.

:class:`_Solver` is MGRIT (F/FCF relaxation, FAS coarse-grid correction,
V-cycles over ``levels`` grids) for any one-step recurrence
u_j = Φ^l_j(u_{j−1}) + g_j; :func:`mgrit_forward` applies it to the implicit
GRU's states, :func:`mgrit_backward` to the adjoint λ backward in time and
turns λ into the gradients. The distributed solver
(:mod:`cdsgd.mgrit.distributed`) subclasses :class:`_Solver`. The maths:
:mod:`cdsgd.mgrit`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..base.checks import check_int
from .cell import ImplicitGRUCell, _check_x_h0, implicit_gru_step

__all__ = ["mgrit_backward", "mgrit_forward"]


def _check_options(cf, levels, iters, tol, fcf) -> None:
    for key, value, low in (("cf", cf, 2), ("levels", levels, 2), ("iters", iters, 0)):
        check_int(key, value, low)
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                            or not math.isfinite(tol) or tol <= 0):
        raise ValueError(f"tol must be None or a positive number, got {tol!r}")
    if not isinstance(fcf, bool):
        raise ValueError(f"fcf must be true or false, got {fcf!r}")


def _check_length(T: int, cf: int, levels: int) -> None:
    most = 1
    while T % cf ** most == 0 and T // cf ** most >= 2:
        most += 1
    if cf ** (levels - 1) * 2 > T:
        raise ValueError(f"levels={levels} is too many for T={T} with cf={cf}: the coarsest level would have "
                         f"T/cf**(levels-1) = {T / cf ** (levels - 1):g} < 2 points; allowed: levels <= {most}"
                         + ("" if most >= 2 else f" (none: T={T} has no coarse grid with cf={cf})"))
    if T % cf ** (levels - 1):
        raise ValueError(f"T={T} is not divisible by cf**(levels-1) = {cf ** (levels - 1)} (cf={cf}, "
                         f"levels={levels}); pad the sequence to a multiple of {cf ** (levels - 1)}"
                         + (f" or use levels <= {most}" if most >= 2 else ""))


# ------------------------------------------------------------- MGRIT solver

class _Solver:
    r"""MGRIT for u_j = Φ^l_j(u_{j−1}) + g_j, j = 1..N_l, u_0 given, on every level l.

    ``data[l]`` is a tuple of tensors with leading dimension N_l: what step j
    of level l needs (entry j − 1); ``apply(d, u, l)`` is the step on a batch
    of such entries. On the states u (N_l + 1, B, H) everything is in place.
    """

    def __init__(self, apply: Callable, data: Sequence[tuple], cf: int, fcf: bool) -> None:
        self.apply, self.data, self.cf, self.fcf = apply, data, cf, fcf

    def _f_relax(self, l, u, g) -> None:
        c, N = self.cf, u.shape[0] - 1
        uv = u[:N].view(N // c, c, *u.shape[1:])
        dv = [d.view(N // c, c, *d.shape[1:]) for d in self.data[l]]
        gv = None if g is None else g.view(N // c, c, *g.shape[1:])
        for i in range(1, c):
            new = self.apply([d[:, i - 1] for d in dv], uv[:, i - 1], l)
            uv[:, i] = new if gv is None else new + gv[:, i - 1]

    def _residual(self, l, u, g) -> torch.Tensor:
        """r_k = g_{kc} − u_{kc} + Φ(u_{kc−1}), k = 1..N/c: one batched step."""
        c = self.cf
        img = self.apply([d[c - 1::c] for d in self.data[l]], u[c - 1:-1:c], l)
        if g is not None:
            img = img + g[c - 1::c]
        return img - u[c::c]

    def _serial(self, l, u, g) -> None:
        d = self.data[l]
        for j in range(1, u.shape[0]):
            new = self.apply([x[j - 1] for x in d], u[j - 1], l)
            u[j] = new if g is None else new + g[j - 1]

    def _vcycle(self, l, u, g, r) -> None:
        """One V-cycle from level l; on entry the F-points are relaxed and r is the C-residual."""
        c = self.cf
        if self.fcf:
            u[c::c] += r                       # C-relaxation: u_C = Φ(u_{C−1}) + g_C
            self._after_c_relax(u)
            self._f_relax(l, u, g)
            r = self._residual(l, u, g)
        v = u[0::c].clone()
        gc = r + v[1:] - self.apply(list(self.data[l + 1]), v[:-1], l + 1)   # FAS τ-correction
        if l + 1 == len(self.data) - 1:
            self._serial(l + 1, v, gc)
        else:
            self._f_relax(l + 1, v, gc)
            self._vcycle(l + 1, v, gc, self._residual(l + 1, v, gc))
        u[0::c] = v                            # u_C += v − v⁰
        self._f_relax(l, u, g)

    def _after_c_relax(self, u) -> None:
        """Hook after a C-relaxation: the distributed solver refreshes its ghost point u[0] here."""

    def _norm(self, r) -> float:
        """Max-norm of the C-residual (the distributed solver takes the max over ranks)."""
        return r.abs().max().item()

    def solve(self, u, g, iters, tol) -> list[float]:
        self._f_relax(0, u, g)
        r = self._residual(0, u, g)
        norms = [self._norm(r)]
        for _ in range(iters):
            if tol is not None and norms[-1] <= tol:
                break
            self._vcycle(0, u, g, r)
            r = self._residual(0, u, g)
            norms.append(self._norm(r))
        return norms


def _forward_solve(cell, x, h0, cf, levels, iters, tol, fcf):
    """States (T+1, B, H) time-major, h_0 included, and the residual norms; no autograd."""
    T = x.shape[1]
    with torch.no_grad():
        xp = cell.project(x).transpose(0, 1).contiguous()        # (T, B, 3H), entry t−1 is step t
        data = [(xp[c_l - 1::c_l].contiguous(),) for c_l in (cf ** l for l in range(levels))]
        whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()

        def apply(d, u, l):
            return implicit_gru_step(u, d[0], whh, bhh, float(cf ** l))

        u = h0.detach().unsqueeze(0).repeat(T + 1, 1, 1)        # initial guess: h_0 everywhere
        norms = _Solver(apply, data, cf, fcf).solve(u, None, iters, tol)
    return u, norms


def mgrit_forward(cell: ImplicitGRUCell, x: torch.Tensor, h0: torch.Tensor | None = None, *, cf: int = 4,
                  levels: int = 2, iters: int = 2, tol: float | None = None, fcf: bool = True):
    """MGRIT solve of h_t = Φ_1(h_{t−1}, x_t): states (B, T, H) and the residual norms.

    ``x`` (B, T, I), ``h0`` (B, H) or None (zeros). The norms are max-norms of
    the fine C-point residual: entry 0 for the initial guess (after its
    F-relaxation), entry k after iteration k. No autograd: use
    :func:`mgrit_gru` or :class:`ParallelGRU` to train.
    """
    h0 = _check_x_h0(cell, x, h0)
    _check_options(cf, levels, iters, tol, fcf)
    _check_length(x.shape[1], cf, levels)
    u, norms = _forward_solve(cell, x, h0, cf, levels, iters, tol, fcf)
    return u[1:].transpose(0, 1), norms


# ------------------------------------------------------------------ adjoint

def _linearise(h, xp, weight_hh, bias_hh, dt):
    r"""Coefficients of the VJP of Φ_Δt at (h, xp): for μ = ∂L/∂h⁺ (d = 1 + Δt z)

    ∂L/∂h = μ⊙β + [μα_r, μα_z, μα_n⊙r] U,   ∂L/∂a = [μα_r, μα_z, μα_n],
    β = 1/d, α_n = Δt z (1−n²)/d, α_z = Δt (n − h⁺) z(1−z)/d, α_r = α_n g_n r(1−r),

    with a = W x + b the projected input and g = U h + c. Returns
    (β, α (…, 3H), α' = [α_r, α_z, α_n r] (…, 3H)).
    """
    gr, gz, gn = F.linear(h, weight_hh, bias_hh).chunk(3, -1)
    xr, xz, xn = xp.chunk(3, -1)
    r = torch.sigmoid(xr + gr)
    z = torch.sigmoid(xz + gz)
    n = torch.tanh(xn + r * gn)
    d = 1 + dt * z
    hn = (h + dt * z * n) / d
    a_n = dt * z * (1 - n * n) / d
    a_z = dt * (n - hn) * z * (1 - z) / d
    a_r = a_n * gn * r * (1 - r)
    return 1 / d, torch.cat([a_r, a_z, a_n], -1), torch.cat([a_r, a_z, a_n * r], -1)


def _rep3(mu):
    return torch.cat([mu, mu, mu], -1)


def _adjoint_solve(cell, x, u, G, cf, levels, iters, tol, fcf):
    """λ_1..λ_T (T, B, H), the linearisation and the residual norms, from u (T+1, B, H), G (T, B, H)."""
    T = x.shape[1]
    whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()
    xp = cell.project(x.detach()).detach().transpose(0, 1).contiguous()
    beta, alpha, alpha2 = _linearise(u[:-1], xp, whh, bhh, 1.0)        # step t at (h_{t−1}, x_t), all t
    data = []
    for l in range(levels):
        m = cf ** l
        if l == 0:
            b_l, a_l = beta[1:].flip(0), alpha2[1:].flip(0)            # step s is the VJP of step T+2−s
        else:                                                          # Δt = m step from h_{T+1−jm}
            j = torch.arange(2, T // m + 1, device=x.device)
            b_l, _, a_l = _linearise(u[T + 1 - j * m], xp[T - (j - 1) * m], whh, bhh, float(m))
        zb, za = b_l.new_zeros(1, *b_l.shape[1:]), a_l.new_zeros(1, *a_l.shape[1:])
        data.append((torch.cat([zb, b_l]), torch.cat([za, a_l])))      # s = 1 acts on λ_{T+1} = 0

    def apply(d, mu, l):
        return mu * d[0] + torch.matmul(_rep3(mu) * d[1], whh)

    lam = G.new_zeros(T + 1, *G.shape[1:])                            # initial guess: 0
    norms = _Solver(apply, data, cf, fcf).solve(lam, G.flip(0).contiguous(), iters, tol)
    return lam[1:].flip(0), (beta, alpha, alpha2), norms


def _gradients(cell, x, u, lam, lin):
    beta, alpha, alpha2 = lin
    lam3 = _rep3(lam)
    ga, gg = lam3 * alpha, lam3 * alpha2                               # ∂L/∂a_t, ∂L/∂(U h_{t−1} + c)
    xt = x.detach().transpose(0, 1)
    g_whh = torch.einsum("tbk,tbh->kh", gg, u[:-1])
    g_bhh = gg.sum((0, 1))
    g_wih = torch.einsum("tbk,tbi->ki", ga, xt)
    g_bih = ga.sum((0, 1))
    g_x = torch.matmul(ga, cell.weight_ih.detach()).transpose(0, 1)
    g_h0 = lam[0] * beta[0] + torch.matmul(gg[0], cell.weight_hh.detach())
    return g_x, g_h0, g_wih, g_whh, g_bih, g_bhh


def mgrit_backward(cell: ImplicitGRUCell, x: torch.Tensor, H: torch.Tensor, G: torch.Tensor,
                   h0: torch.Tensor | None = None, *, cf: int = 4, levels: int = 2, iters: int = 2,
                   tol: float | None = None, fcf: bool = True):
    """Gradients from states ``H`` (B, T, H) and upstream gradients ``G`` = ∂L/∂H by an MGRIT adjoint solve.

    Returns ``(grads, norms)``: ``grads`` a dict with ``x``, ``h0`` and the
    cell's parameter names, ``norms`` the adjoint residual norms (as in
    :func:`mgrit_forward`). Converged, the gradients are autograd's through the serial loop:

    >>> from cdsgd.mgrit import serial_forward
    >>> _ = torch.manual_seed(0); cell = ImplicitGRUCell(2, 4).double()
    >>> x, G = torch.randn(3, 16, 2, dtype=torch.float64), torch.randn(3, 16, 4, dtype=torch.float64)
    >>> H, _ = mgrit_forward(cell, x, cf=4, iters=4, fcf=False)            # iters = T/c: exact
    >>> grads, norms = mgrit_backward(cell, x, H, G, cf=4, iters=4, fcf=False)
    >>> (serial_forward(cell, x) * G).sum().backward()
    >>> bool(torch.allclose(grads["weight_hh"], cell.weight_hh.grad, atol=1e-12)), len(norms)
    (True, 5)
    """
    h0 = _check_x_h0(cell, x, h0)
    _check_options(cf, levels, iters, tol, fcf)
    _check_length(x.shape[1], cf, levels)
    if tuple(H.shape) != (x.shape[0], x.shape[1], cell.hidden_size) or H.shape != G.shape:
        raise ValueError(f"H and G must have shape (B, T, hidden_size) = "
                         f"{(x.shape[0], x.shape[1], cell.hidden_size)}, got {tuple(H.shape)} and {tuple(G.shape)}")
    with torch.no_grad():
        u = torch.cat([h0.unsqueeze(0), H.transpose(0, 1)]).to(x.dtype)
        lam, lin, norms = _adjoint_solve(cell, x, u, G.transpose(0, 1).to(x.dtype), cf, levels, iters, tol, fcf)
        g = _gradients(cell, x, u, lam, lin)
    names = ("x", "h0", "weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return dict(zip(names, g)), norms

