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
from .cell import COARSE_STEPS, ImplicitGRUCell, _check_x_h0, _damping, implicit_gru_step

__all__ = ["mgrit_backward", "mgrit_forward"]


def _check_options(cf, levels, iters, tol, fcf, rtol=None, fallback=False, coarse="euler") -> None:
    for key, value, low in (("cf", cf, 2), ("levels", levels, 2), ("iters", iters, 0)):
        check_int(key, value, low)
    for key, value in (("tol", tol), ("rtol", rtol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{key} must be None or a positive number, got {value!r}")
    for key, value in (("fcf", fcf), ("fallback", fallback)):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    if coarse not in COARSE_STEPS:
        raise ValueError(f"coarse must be one of {COARSE_STEPS}, got {coarse!r}")
    if fallback and rtol is None and tol is None:
        raise ValueError("fallback=True needs a tolerance (rtol or tol) to tell a converged solve from one that is not")


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

def _progressing(norms: list[float]) -> bool:
    """False once the residual is not finite, or two or more iterations have not brought it below the initial one.

    MGRIT's residual may rise in the first iteration and then converge (the
    first coarse correction of a poor initial guess overshoots: on PLAID
    after some training 1.0, 1.4, 0.6, 0.3, 8e-3, …), so one rise is allowed;
    after two iterations still above the start it is diverging or too slow
    for the iteration budget (on the long synthetic task after eight epochs:
    0.98, 5.7, 4.6, …, the states leaving [−1, 1]).
    """
    return math.isfinite(norms[-1]) and (len(norms) < 3 or norms[-1] < norms[0])


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

    def solve(self, u, g, iters, tol, rtol=None) -> list[float]:
        """Up to ``iters`` V-cycles; the C-residual max-norms, entry 0 for the initial guess.

        Stops once the residual is ≤ ``tol`` or ≤ ``rtol``·‖u‖∞ (then
        ``self.converged`` is True) and, with ``rtol``, as soon as it is not
        progressing (:func:`_progressing`). ``self.relative`` is the last
        residual over ‖u‖∞ (computed only with ``rtol``).
        """
        self._f_relax(0, u, g)
        r = self._residual(0, u, g)
        norms = [self._norm(r)]
        self.converged, self.relative = False, math.nan
        while True:
            if rtol is not None:
                self.relative = norms[-1] / max(self._norm(u[1:]), 1e-30)
            if (tol is not None and norms[-1] <= tol) or (rtol is not None and self.relative <= rtol):
                self.converged = True
                break
            if len(norms) > iters or (rtol is not None and not _progressing(norms)):
                break
            self._vcycle(0, u, g, r)
            r = self._residual(0, u, g)
            norms.append(self._norm(r))
        return norms

    def serial(self, u, g) -> None:
        """The fine problem solved exactly by the serial loop (the fall-back)."""
        self._serial(0, u, g)


def _run(solver: _Solver, u, g, iters, tol, rtol, fallback, serial) -> dict:
    """Solve in place: MGRIT (``serial`` False) with the serial fall-back when allowed; what happened."""
    if serial:
        solver.serial(u, g)
        return {"norms": [], "iters": 0, "residual": 0.0, "converged": True, "fallback": False, "serial": True}
    norms = solver.solve(u, g, iters, tol, rtol)
    info = {"norms": norms, "iters": len(norms) - 1, "residual": solver.relative, "converged": solver.converged,
            "fallback": False, "serial": False}
    if fallback and not solver.converged:
        solver.serial(u, g)
        info.update(fallback=True, residual=0.0)
    return info


def _summary(info: dict) -> dict:
    """What a solve did (:func:`_run`), without its residual norms: the ``stats`` callers receive."""
    return {k: v for k, v in info.items() if k != "norms"}


def _forward_solve(cell, x, h0, cf, levels, iters, tol, fcf, rtol=None, fallback=False, coarse="euler",
                   serial=False):
    """States (T+1, B, H) time-major, h_0 included, and what the solve did (:func:`_run`); no autograd."""
    T = x.shape[1]
    with torch.no_grad():
        xp = cell.project(x).transpose(0, 1).contiguous()        # (T, B, 3H), entry t−1 is step t
        data = [(xp[c_l - 1::c_l].contiguous(),) for c_l in (cf ** l for l in range(levels))]
        whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()

        def apply(d, u, l):
            return implicit_gru_step(u, d[0], whh, bhh, float(cf ** l), coarse)

        u = h0.detach().unsqueeze(0).repeat(T + 1, 1, 1)        # initial guess: h_0 everywhere
        info = _run(_Solver(apply, data, cf, fcf), u, None, iters, tol, rtol, fallback, serial)
    return u, info


def mgrit_forward(cell: ImplicitGRUCell, x: torch.Tensor, h0: torch.Tensor | None = None, *, cf: int = 4,
                  levels: int = 2, iters: int = 2, tol: float | None = None, fcf: bool = True,
                  rtol: float | None = None, fallback: bool = False, coarse: str = "euler",
                  stats: dict | None = None):
    """MGRIT solve of h_t = Φ_1(h_{t−1}, x_t): states (B, T, H) and the residual norms.

    ``x`` (B, T, I), ``h0`` (B, H) or None (zeros). The norms are max-norms of
    the fine C-point residual: entry 0 for the initial guess (after its
    F-relaxation), entry k after iteration k. At most ``iters`` iterations;
    fewer once the residual is ≤ ``tol``, or ≤ ``rtol``·max|h| (relative),
    or, with ``rtol``, once it is not progressing (:func:`_progressing`: not
    finite, or above the initial residual after two iterations). ``fallback=True``
    replaces a solve that did not reach its tolerance by the serial loop
    (exact). ``coarse`` is the coarse step (:data:`~cdsgd.mgrit.cell.COARSE_STEPS`).
    If ``stats`` is a dict it receives ``iters``, ``residual`` (relative; 0
    after a fall-back, nan without ``rtol``), ``converged``, ``fallback`` and
    ``serial`` (False: solved by the serial loop only on request, see
    :func:`~cdsgd.mgrit.mgrit_gru`). No autograd: use
    :func:`mgrit_gru` or :class:`ParallelGRU` to train.
    """
    h0 = _check_x_h0(cell, x, h0)
    _check_options(cf, levels, iters, tol, fcf, rtol, fallback, coarse)
    _check_length(x.shape[1], cf, levels)
    u, info = _forward_solve(cell, x, h0, cf, levels, iters, tol, fcf, rtol, fallback, coarse)
    if stats is not None:
        stats.update(_summary(info))
    return u[1:].transpose(0, 1), info["norms"]


# ------------------------------------------------------------------ adjoint

def _linearise(h, xp, weight_hh, bias_hh, dt, coarse="euler"):
    r"""Coefficients of the VJP of Φ_Δt at (h, xp): for μ = ∂L/∂h⁺, with Φ = n + (h − n)·q(z)

    ∂L/∂h = μ⊙β + [μα_r, μα_z, μα_n⊙r] U,   ∂L/∂a = [μα_r, μα_z, μα_n],
    β = q, α_n = (1 − q)(1 − n²), α_z = (h − n) q'(z) z(1−z), α_r = α_n g_n r(1−r),

    with a = W x + b the projected input, g = U h + c and q, q' of
    :func:`~cdsgd.mgrit.cell._damping` (backward Euler: q = 1/(1 + Δt z),
    q' = −Δt q²). Returns (β, α (…, 3H), α' = [α_r, α_z, α_n r] (…, 3H)).
    """
    gr, gz, gn = F.linear(h, weight_hh, bias_hh).chunk(3, -1)
    xr, xz, xn = xp.chunk(3, -1)
    r = torch.sigmoid(xr + gr)
    z = torch.sigmoid(xz + gz)
    n = torch.tanh(xn + r * gn)
    q, dq = _damping(z, dt, coarse)
    a_n = (1 - q) * (1 - n * n)
    a_z = (h - n) * dq * z * (1 - z)
    a_r = a_n * gn * r * (1 - r)
    return q, torch.cat([a_r, a_z, a_n], -1), torch.cat([a_r, a_z, a_n * r], -1)


def _rep3(mu):
    return torch.cat([mu, mu, mu], -1)


def _adjoint_solve(cell, x, u, G, cf, levels, iters, tol, fcf, rtol=None, fallback=False, coarse="euler",
                   serial=False):
    """λ_1..λ_T (T, B, H), the linearisation and what the solve did, from u (T+1, B, H), G (T, B, H)."""
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
            b_l, _, a_l = _linearise(u[T + 1 - j * m], xp[T - (j - 1) * m], whh, bhh, float(m), coarse)
        zb, za = b_l.new_zeros(1, *b_l.shape[1:]), a_l.new_zeros(1, *a_l.shape[1:])
        data.append((torch.cat([zb, b_l]), torch.cat([za, a_l])))      # s = 1 acts on λ_{T+1} = 0

    def apply(d, mu, l):
        return mu * d[0] + torch.matmul(_rep3(mu) * d[1], whh)

    lam = G.new_zeros(T + 1, *G.shape[1:])                            # initial guess: 0
    info = _run(_Solver(apply, data, cf, fcf), lam, G.flip(0).contiguous(), iters, tol, rtol, fallback, serial)
    return lam[1:].flip(0), (beta, alpha, alpha2), info


def _gradients(cell, x, u, lam, lin):
    beta, alpha, alpha2 = lin
    lam3 = _rep3(lam)
    ga, gg = lam3 * alpha, lam3 * alpha2                               # ∂L/∂a_t, ∂L/∂(U h_{t−1} + c)
    xt = x.detach().transpose(0, 1)
    g_whh = gg.flatten(0, 1).t() @ u[:-1].flatten(0, 1)              # Σ_t,b: one matmul (einsum was slower)
    g_bhh = gg.sum((0, 1))
    g_wih = ga.flatten(0, 1).t() @ xt.flatten(0, 1)
    g_bih = ga.sum((0, 1))
    g_x = torch.matmul(ga, cell.weight_ih.detach()).transpose(0, 1)
    g_h0 = lam[0] * beta[0] + torch.matmul(gg[0], cell.weight_hh.detach())
    return g_x, g_h0, g_wih, g_whh, g_bih, g_bhh


def mgrit_backward(cell: ImplicitGRUCell, x: torch.Tensor, H: torch.Tensor, G: torch.Tensor,
                   h0: torch.Tensor | None = None, *, cf: int = 4, levels: int = 2, iters: int = 2,
                   tol: float | None = None, fcf: bool = True, rtol: float | None = None, fallback: bool = False,
                   coarse: str = "euler", stats: dict | None = None):
    """Gradients from states ``H`` (B, T, H) and upstream gradients ``G`` = ∂L/∂H by an MGRIT adjoint solve.

    Returns ``(grads, norms)``: ``grads`` a dict with ``x``, ``h0`` and the
    cell's parameter names, ``norms`` the adjoint residual norms (as in
    :func:`mgrit_forward`; the other options too, ``rtol`` relative to
    max|λ|). Converged, the gradients are autograd's through the serial loop:

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
    _check_options(cf, levels, iters, tol, fcf, rtol, fallback, coarse)
    _check_length(x.shape[1], cf, levels)
    if tuple(H.shape) != (x.shape[0], x.shape[1], cell.hidden_size) or H.shape != G.shape:
        raise ValueError(f"H and G must have shape (B, T, hidden_size) = "
                         f"{(x.shape[0], x.shape[1], cell.hidden_size)}, got {tuple(H.shape)} and {tuple(G.shape)}")
    with torch.no_grad():
        u = torch.cat([h0.unsqueeze(0), H.transpose(0, 1)]).to(x.dtype)
        lam, lin, info = _adjoint_solve(cell, x, u, G.transpose(0, 1).to(x.dtype), cf, levels, iters, tol, fcf,
                                        rtol, fallback, coarse)
        g = _gradients(cell, x, u, lam, lin)
    if stats is not None:
        stats.update(_summary(info))
    names = ("x", "h0", "weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return dict(zip(names, g)), info["norms"]

