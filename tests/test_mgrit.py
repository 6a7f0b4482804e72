"""MGRIT for the implicit GRU: exactness, convergence, adjoint gradients, bad inputs, the module.

Problems are small (T 32–256, hidden 8–16, batch 2–3) with the cell's default
initialisation (uniform ±1/√H), inputs x ~ N(0, 1) and h_0 ~ N(0, 0.25): the
"realistic scale" of the measurements in the module docstrings. Tight
tolerances run in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cdsgd.mgrit import (ImplicitGRUCell, ParallelGRU, classic_gru_step, implicit_gru_step, mgrit_backward,
                         mgrit_forward, mgrit_gru, serial_forward)
from cdsgd.mgrit.solver import _linearise

D = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny ops: threads only add synchronisation (conftest restores the count)


def problem(seed=0, B=2, T=64, I=3, H=8, dtype=D):
    torch.manual_seed(seed)
    cell = ImplicitGRUCell(I, H).to(dtype)
    return cell, torch.randn(B, T, I, dtype=dtype), 0.5 * torch.randn(B, H, dtype=dtype)


def n_exact_c_points(H, S, cf, atol=1e-13):
    """How many leading C-points (t = cf, 2cf, …) equal the serial states to rounding."""
    err = (H - S).abs().amax((0, 2))[cf - 1::cf]
    return int((err < atol).long().cumprod(0).sum()), err


# ------------------------------------------------------------------- the cell

def test_classic_step_is_nn_grucell():
    cell, x, h = problem()
    ref = nn.GRUCell(3, 8).to(D)
    ref.load_state_dict(cell.state_dict())
    assert torch.allclose(classic_gru_step(cell, h, x[:, 0]), ref(x[:, 0], h), atol=1e-14)
    S = serial_forward(cell, x, h, kind="classic")
    assert torch.allclose(S[:, 1], ref(x[:, 1], ref(x[:, 0], h)), atol=1e-14)


def test_implicit_step_formula_and_large_dt():
    cell, x, h = problem()
    gr, gz, gn = (h @ cell.weight_hh.T + cell.bias_hh).chunk(3, -1)
    xr, xz, xn = cell.project(x[:, 0]).chunk(3, -1)
    r, z = torch.sigmoid(xr + gr), torch.sigmoid(xz + gz)
    n = torch.tanh(xn + r * gn)
    for dt in (1.0, 4.0, 64.0):
        h1 = cell.step(h, x[:, 0], dt)
        assert torch.allclose(h1, (h + dt * z * n) / (1 + dt * z), atol=1e-15)
        lo, hi = torch.minimum(h, n), torch.maximum(h, n)      # a convex combination of h and n: stable
        assert bool(((h1 >= lo - 1e-15) & (h1 <= hi + 1e-15)).all())


@pytest.mark.parametrize("dt", [1.0, 4.0, 16.0])
def test_linearised_vjp_matches_torch_func(dt):
    """The adjoint's analytic VJP (fine and coarse Δt) equals torch.func.vjp of the step."""
    cell, x, h = problem(H=6)
    xp = cell.project(x[:, :5]).transpose(0, 1).detach()        # (5, B, 3H): batched over time
    hs = torch.randn(5, 2, 6, dtype=D)
    mu = torch.randn(5, 2, 6, dtype=D)
    whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()
    _, vjp = torch.func.vjp(lambda h_, a_: implicit_gru_step(h_, a_, whh, bhh, dt), hs, xp)
    dh, da = vjp(mu)
    beta, alpha, alpha2 = _linearise(hs, xp, whh, bhh, dt)
    mu3 = torch.cat([mu, mu, mu], -1)
    assert torch.allclose(mu * beta + (mu3 * alpha2) @ whh, dh, atol=1e-13)
    assert torch.allclose(mu3 * alpha, da, atol=1e-13)


# ------------------------------------------------------------------ exactness

@pytest.mark.parametrize("cf,T", [(4, 64), (8, 64), (2, 32)])
def test_t_over_cf_f_iterations_reproduce_serial(cf, T):
    cell, x, h0 = problem(T=T)
    S = serial_forward(cell, x, h0)
    H, res = mgrit_forward(cell, x, h0, cf=cf, levels=2, iters=T // cf, fcf=False)
    assert (H - S).abs().max() < 1e-13
    assert res[-1] < 1e-13
    H32, _ = mgrit_forward(cell.float(), x.float(), h0.float(), cf=cf, iters=T // cf, fcf=False)
    assert (H32 - S.float()).abs().max() < 1e-6


@pytest.mark.parametrize("fcf,per_iter", [(False, 1), (True, 2)])
def test_exactness_property_counted(fcf, per_iter):
    """After k two-level iterations exactly the first k (F) or 2k (FCF) C-points are exact, the next is not."""
    cell, x, h0 = problem(T=64)
    S = serial_forward(cell, x, h0)
    cf = 4
    for k in range(0, 7):
        H, _ = mgrit_forward(cell, x, h0, cf=cf, iters=k, fcf=fcf)
        n, err = n_exact_c_points(H, S, cf)
        assert n == per_iter * k, (k, err)
        assert err[n] > 1e-9                             # the first inexact C-point is clearly inexact
        # the F-points after the last exact C-point (its interval) are exact too, by the closing F-relaxation
        assert (H[:, : n * cf + cf - 1] - S[:, : n * cf + cf - 1]).abs().max() < 1e-13


def test_tol_stops_early_and_iters_caps():
    cell, x, h0 = problem(T=128)
    H, res = mgrit_forward(cell, x, h0, cf=4, iters=50, tol=1e-10)
    assert res[-1] <= 1e-10 and all(r > 1e-10 for r in res[:-1]) and len(res) < 51
    assert (H - serial_forward(cell, x, h0)).abs().max() < 1e-9
    _, res = mgrit_forward(cell, x, h0, cf=4, iters=2, tol=1e-10)
    assert len(res) == 3 and res[-1] > 1e-10            # iters reached first
    _, res = mgrit_forward(cell, x, h0, cf=4, iters=5, tol=10.0)
    assert len(res) == 1                                # the initial residual already below tol


# seeds 0-4, T = 256, B = 3, hidden 16, default init; 8 iterations (F two-level; FCF at 2, 3 levels).
@pytest.mark.parametrize("cf,levels,fcf", [(4, 2, False), (4, 2, True), (4, 3, True), (8, 2, True)])
def test_residuals_decrease_monotonically(cf, levels, fcf):
    for seed in range(5):
        cell, x, h0 = problem(seed=seed, B=3, T=256, H=16)
        _, res = mgrit_forward(cell, x, h0, cf=cf, levels=levels, iters=8, fcf=fcf)
        assert len(res) == 9
        assert all(b < a for a, b in zip(res, res[1:])), (seed, res)
        assert res[-1] < 1e-2 * res[0]


@pytest.mark.parametrize("cf,levels", [(4, 3), (2, 4), (4, 4)])
def test_multilevel_converges_to_serial(cf, levels):
    cell, x, h0 = problem(T=256, H=8)
    S = serial_forward(cell, x, h0)
    H, res = mgrit_forward(cell, x, h0, cf=cf, levels=levels, iters=40, tol=1e-12, fcf=True)
    assert (H - S).abs().max() < 1e-11, res
    assert res[-1] <= 1e-12


# ------------------------------------------------------------------- gradients

def serial_grads(cell, x, h0, W):
    xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
    cell.zero_grad()
    (serial_forward(cell, xg, hg) * W).sum().backward()
    return {"x": xg.grad, "h0": hg.grad, **{n: p.grad.clone() for n, p in cell.named_parameters()}}


@pytest.mark.parametrize("cf,levels,iters,fcf", [(4, 2, 16, False), (4, 2, 8, True), (4, 3, 30, True)])
def test_adjoint_gradients_match_autograd(cf, levels, iters, fcf):
    cell, x, h0 = problem(T=64)
    W = torch.randn(2, 64, 8, dtype=D)
    ref = serial_grads(cell, x, h0, W)
    H, _ = mgrit_forward(cell, x, h0, cf=cf, levels=levels, iters=iters, fcf=fcf)
    g, res = mgrit_backward(cell, x, H, W, h0, cf=cf, levels=levels, iters=iters, tol=1e-13, fcf=fcf)
    assert res[-1] <= 1e-12
    for k, v in ref.items():
        assert (g[k] - v).abs().max() < 1e-5 * v.abs().max(), k
        assert (g[k] - v).abs().max() < 1e-11, k
    # the same through the autograd Function
    xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
    cell.zero_grad()
    (mgrit_gru(cell, xg, hg, cf=cf, levels=levels, iters=iters, fcf=fcf) * W).sum().backward()
    got = {"x": xg.grad, "h0": hg.grad, **{n: p.grad for n, p in cell.named_parameters()}}
    for k, v in ref.items():
        assert (got[k] - v).abs().max() < 1e-11, k


def test_adjoint_exactness_property():
    """The adjoint is an MGRIT solve backward in time: after k F-iterations λ is exact on the last k·cf steps."""
    cell, x, h0 = problem(T=64)
    W = torch.randn(2, 64, 8, dtype=D)
    S = serial_forward(cell, x, h0)
    exact = mgrit_backward(cell, x, S, W, h0, cf=4, iters=16, fcf=False)[0]["x"]
    for k in (1, 3):
        gx = mgrit_backward(cell, x, S, W, h0, cf=4, iters=k, fcf=False)[0]["x"]   # ∂L/∂x_t ∝ λ_t
        err = (gx - exact).abs().amax((0, 2))
        assert err[64 - 4 * k:].max() < 1e-13 and err[: 64 - 4 * k].max() > 1e-9


# ---------------------------------------------------------------- bad inputs

CELL = ImplicitGRUCell(3, 8)
X = torch.randn(2, 64, 3)
BAD = [
    (lambda: mgrit_forward(CELL, torch.randn(2, 66, 3), cf=4), r"T=66 is not divisible by cf\*\*\(levels-1\) = 4"),
    (lambda: mgrit_forward(CELL, torch.randn(2, 72, 3), cf=4, levels=3),
     r"T=72 is not divisible by cf\*\*\(levels-1\) = 16 .*levels <= 2"),
    (lambda: mgrit_forward(CELL, X, cf=1), r"cf must be an integer >= 2, got 1"),
    (lambda: mgrit_forward(CELL, X, cf=0), r"cf must be an integer >= 2, got 0"),
    (lambda: mgrit_forward(CELL, X, cf=2.0), r"cf must be an integer >= 2, got 2.0"),
    (lambda: mgrit_forward(CELL, X, levels=1), r"levels must be an integer >= 2, got 1"),
    (lambda: mgrit_forward(CELL, X, cf=4, levels=4), r"levels=4 is too many for T=64 with cf=4.*1 < 2 points; "
                                                     r"allowed: levels <= 3"),
    (lambda: mgrit_forward(CELL, X, cf=4, levels=9), r"levels=9 is too many for T=64"),
    (lambda: mgrit_forward(CELL, torch.randn(2, 4, 3), cf=4), r"levels=2 is too many for T=4 with cf=4.*none"),
    (lambda: mgrit_forward(CELL, X, iters=-1), r"iters must be an integer >= 0, got -1"),
    (lambda: mgrit_forward(CELL, X, tol=0.0), r"tol must be None or a positive number, got 0.0"),
    (lambda: mgrit_forward(CELL, X, fcf=1), r"fcf must be true or false, got 1"),
    (lambda: mgrit_forward(CELL, torch.randn(2, 64), cf=4), r"x must be a tensor of shape \(B, T, input_size=3\)"
                                                            r".*got \(2, 64\)"),
    (lambda: mgrit_forward(CELL, torch.randn(2, 64, 5)), r"input_size=3\).*got \(2, 64, 5\)"),
    (lambda: mgrit_forward(CELL, torch.ones(2, 64, 3, dtype=torch.long)), r"floating-point tensor, got dtype"),
    (lambda: mgrit_forward(CELL, X, torch.zeros(3, 8)), r"h0 must have shape .* = \(2, 8\).*got \(3, 8\)"),
    (lambda: serial_forward(CELL, X, kind="lstm"), r"kind must be 'implicit' or 'classic', got 'lstm'"),
    (lambda: mgrit_backward(CELL, X, torch.zeros(2, 64, 8), torch.zeros(2, 63, 8)), r"H and G must have shape"),
    (lambda: ParallelGRU(3, 8, mode="parareal"), r"mode must be one of \('mgrit', 'serial'\), got 'parareal'"),
    (lambda: ParallelGRU(3, 8, cf=1), r"cf must be an integer >= 2, got 1"),
    (lambda: ParallelGRU(3, 8)(torch.randn(2, 30, 3)), r"T=30 is not divisible"),
    (lambda: ImplicitGRUCell(0, 8), r"input_size must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("call,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_inputs(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# ------------------------------------------------------------------ the module

def test_parallel_gru_modes_share_parameters_and_agree():
    torch.manual_seed(0)
    gru = ParallelGRU(3, 16, cf=4, levels=2, iters=16, fcf=False, rtol=None, fallback=False).double()
    assert sorted(gru.state_dict()) == ["cell.bias_hh", "cell.bias_ih", "cell.weight_hh", "cell.weight_ih"]
    x, h0 = torch.randn(2, 64, 3, dtype=D), torch.randn(1, 2, 16, dtype=D)
    grads = {}
    for mode in ("serial", "mgrit"):
        gru.mode = mode
        gru.zero_grad()
        H, h_n = gru(x, h0)
        assert H.shape == (2, 64, 16) and h_n.shape == (1, 2, 16) and torch.equal(h_n[0], H[:, -1])
        (H.pow(2).sum() + h_n.sum()).backward()
        grads[mode] = (H.detach(), [p.grad.clone() for p in gru.parameters()])
    assert (grads["serial"][0] - grads["mgrit"][0]).abs().max() < 1e-12
    for a, b in zip(grads["serial"][1], grads["mgrit"][1]):
        assert (a - b).abs().max() < 1e-10
    assert len(gru.last_residuals["forward"]) == 17 and gru.last_residuals["backward"][-1] < 1e-10


def test_parallel_gru_time_major_matches_batch_first():
    torch.manual_seed(0)
    a = ParallelGRU(3, 8, iters=3, batch_first=True)
    b = ParallelGRU(3, 8, iters=3, batch_first=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 32, 3)
    Ha, ha = a(x)
    Hb, hb = b(x.transpose(0, 1))
    assert torch.equal(Ha, Hb.transpose(0, 1)) and torch.equal(ha, hb)


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    gru, head = ParallelGRU(2, 16, cf=4, levels=2, iters=2), nn.Linear(16, 1)
    opt = torch.optim.Adam([*gru.parameters(), *head.parameters()], lr=1e-2)
    x = torch.randn(8, 64, 2)
    y = x[:, :, 0].mean(1, keepdim=True)                 # a target that needs the whole sequence
    losses = []
    for _ in range(30):
        opt.zero_grad()
        _, h_n = gru(x)
        loss = nn.functional.mse_loss(head(h_n[0]), y)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in gru.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
