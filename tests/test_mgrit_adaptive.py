"""MGRIT's adaptive solves: rtol stopping, the serial fall-back and its back-off, the frozen coarse step,
``gradient_error`` and the mgrit_* metrics columns.

Every expected figure is computed independently: fixed-iteration solves (``rtol=None``), the serial loop
with autograd, or the solve reports heard by a spy. Exactness is checked in float64.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import test_mgrit
from test_mgrit import _one_thread  # noqa: F401 - autouse fixture: one thread in this module too

from cdsgd.mgrit import (ImplicitGRUCell, ParallelGRU, SolveLog, gradient_error, implicit_gru_step, mgrit_backward,
                         mgrit_forward, mgrit_gru, serial_forward)
from cdsgd.mgrit.solver import _adjoint_solve, _linearise, _Solver

D = torch.float64
NAMES = ("x", "h0", "weight_ih", "weight_hh", "bias_ih", "bias_hh")
MGRIT_COLUMNS = ("mgrit_iters", "mgrit_residual", "mgrit_fallbacks", "mgrit_solves")


# test_mgrit's problem with 3 sequences of 2 inputs; its one-thread fixture (autouse here too) and serial gradients
problem = functools.partial(test_mgrit.problem, B=3, I=2)
serial_grads = test_mgrit.serial_grads


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in NAMES)


def time_major(h0, H):
    """u = (h_0, h_1, …, h_T) as the solver holds it: (T+1, B, H)."""
    return torch.cat([h0.unsqueeze(0), H.transpose(0, 1)])


def between(rel, k):
    """An rtol strictly between rel[k] and rel[k−1] (their geometric mean; 2·rel[0] for k = 0)."""
    return 2 * rel[0] if k == 0 else math.sqrt(rel[k] * rel[k - 1])


# ------------------------------------------------------------- the rtol stop

@pytest.mark.parametrize("fcf", [False, True])
def test_rtol_stops_at_the_first_relative_residual_below_it(fcf):
    """Fixed-k solves give norms[k]/max|H_k|; an rtol solve stops at the first k below rtol, with H_k."""
    cell, x, h0 = problem()
    fixed = [mgrit_forward(cell, x, h0, cf=4, iters=k, fcf=fcf) for k in range(7)]
    assert all(len(res) == k + 1 for k, (_, res) in enumerate(fixed))
    rel = [res[k] / float(H.abs().max()) for k, (H, res) in enumerate(fixed)]
    assert all(b < a for a, b in zip(rel, rel[1:])), rel      # contracting: only the rtol rule can stop it
    for k in range(6):
        st = {}
        H, res = mgrit_forward(cell, x, h0, cf=4, iters=50, fcf=fcf, rtol=between(rel, k), stats=st)
        assert torch.equal(H, fixed[k][0]) and res == fixed[k][1], k
        assert st == {"iters": k, "residual": pytest.approx(rel[k], rel=1e-12), "converged": True,
                      "fallback": False, "serial": False}, k
    # iters reached before rtol: the fixed solve, not converged
    st = {}
    H, res = mgrit_forward(cell, x, h0, cf=4, iters=3, fcf=fcf, rtol=between(rel, 5), stats=st)
    assert torch.equal(H, fixed[3][0]) and st["iters"] == 3 and st["converged"] is False
    assert st["residual"] == pytest.approx(rel[3], rel=1e-12)


@pytest.mark.parametrize("fcf", [False, True])
def test_adjoint_rtol_is_relative_to_max_lambda(fcf):
    """The adjoint stops at the first k with norms[k]/max|λ_k| <= rtol; gradients are the fixed-k solve's."""
    cell, x, h0 = problem()
    S = serial_forward(cell, x, h0).detach()
    W = torch.randn_like(S)
    u, G = time_major(h0, S), W.transpose(0, 1)
    rel, norms = [], []
    for k in range(7):
        lam, _, info = _adjoint_solve(cell, x, u, G, 4, 2, k, None, fcf)
        assert info["iters"] == k
        rel.append(info["norms"][k] / float(lam.abs().max()))
        norms.append(info["norms"])
    assert all(b < a for a, b in zip(rel, rel[1:])), rel
    for k in range(6):
        st = {}
        g, res = mgrit_backward(cell, x, S, W, h0, cf=4, iters=50, fcf=fcf, rtol=between(rel, k), stats=st)
        ref, ref_res = mgrit_backward(cell, x, S, W, h0, cf=4, iters=k, fcf=fcf)
        assert res == ref_res == norms[k], k
        assert all(torch.equal(g[n], ref[n]) for n in NAMES), k
        assert st == {"iters": k, "residual": pytest.approx(rel[k], rel=1e-12), "converged": True,
                      "fallback": False, "serial": False}, k


def test_a_stalled_iteration_stops_the_solve_only_with_rtol(monkeypatch):
    """V-cycles that change nothing: rtol allows one iteration without progress, stops at the second (not
    converged); tol alone runs all ``iters``."""
    cell, x, h0 = problem()
    S = serial_forward(cell, x, h0).detach()
    W = torch.randn_like(S)
    relaxed, _ = mgrit_forward(cell, x, h0, cf=4, iters=0)          # the F-relaxed initial guess
    g0, _ = mgrit_backward(cell, x, S, W, h0, cf=4, iters=0)
    monkeypatch.setattr(_Solver, "_vcycle", lambda self, l, u, g, r: None)
    for solve in (lambda **o: mgrit_forward(cell, x, h0, cf=4, **o),
                  lambda **o: mgrit_backward(cell, x, S, W, h0, cf=4, **o)):
        st = {}
        out, res = solve(iters=5, rtol=1e-12, stats=st)
        assert len(res) == 3 and res[2] == res[1] == res[0] > 0
        assert st["iters"] == 2 and st["converged"] is False and st["fallback"] is False
        st = {}
        _, res = solve(iters=5, tol=1e-12, stats=st)
        assert len(res) == 6 and st["iters"] == 5 and st["converged"] is False
        st = {}
        _, res = solve(iters=5, tol=1e-12, rtol=1e-12, stats=st)   # rtol's stall rule also with a tol
        assert len(res) == 3 and st["iters"] == 2
    assert torch.equal(mgrit_forward(cell, x, h0, cf=4, iters=5, rtol=1e-12)[0], relaxed)
    g, _ = mgrit_backward(cell, x, S, W, h0, cf=4, iters=5, rtol=1e-12)
    assert all(torch.equal(g[n], g0[n]) for n in NAMES)
    st = {}
    H, _ = mgrit_forward(cell, x, h0, cf=4, iters=5, rtol=1e-12, fallback=True, stats=st)
    assert st["iters"] == 2 and st["fallback"] is True and (H - S).abs().max() < 1e-12


def test_one_rise_of_the_residual_is_allowed(monkeypatch):
    """A first iteration that raises the residual (here: C-points pushed off by 3) does not stop an rtol solve;
    the real V-cycles after it converge."""
    cell, x, h0 = problem()
    vcycle, calls = _Solver._vcycle, []

    def rising_first(self, l, u, g, r):
        calls.append(l)
        if len(calls) == 1:
            u[self.cf::self.cf] += 3.0
        else:
            vcycle(self, l, u, g, r)

    monkeypatch.setattr(_Solver, "_vcycle", rising_first)
    st = {}
    H, res = mgrit_forward(cell, x, h0, cf=4, iters=20, rtol=1e-8, stats=st)
    assert res[1] > res[0] and res[2] < res[0], res
    assert st["converged"] is True and st["iters"] == len(res) - 1 > 2
    assert (H - serial_forward(cell, x, h0)).abs().max() < 1e-6


def test_a_non_finite_residual_stops_the_solve_and_falls_back(monkeypatch):
    cell, x, h0 = problem()
    S = serial_forward(cell, x, h0).detach()
    monkeypatch.setattr(_Solver, "_vcycle", lambda self, l, u, g, r: u[1:].fill_(math.nan))
    st = {}
    H, res = mgrit_forward(cell, x, h0, cf=4, iters=5, rtol=1e-3, fallback=True, stats=st)
    assert len(res) == 2 and math.isnan(res[1]) and st["iters"] == 1 and st["fallback"] is True
    assert (H - S).abs().max() < 1e-12
    _, res = mgrit_forward(cell, x, h0, cf=4, iters=5, tol=1e-3)       # tol alone: all iterations
    assert len(res) == 6


# ------------------------------------------------------------- the fall-back

@pytest.mark.parametrize("iters", [0, 1])
def test_fallback_gives_serial_states_and_gradients(iters):
    cell, x, h0 = problem()
    S = serial_forward(cell, x, h0).detach()
    W = torch.randn_like(S)
    ref = serial_grads(cell, x, h0, W)
    opts = {"cf": 4, "iters": iters, "rtol": 1e-12}
    failed = {"iters": iters, "residual": 0.0, "converged": False, "fallback": True, "serial": False}
    st = {}
    H, res = mgrit_forward(cell, x, h0, fallback=True, stats=st, **opts)
    assert (H - S).abs().max() < 1e-12 and st == failed
    assert len(res) == iters + 1 and res[-1] > 1e-9               # the attempt's norms are still reported
    st = {}
    g, _ = mgrit_backward(cell, x, H, W, h0, fallback=True, stats=st, **opts)
    assert max_diff(g, ref) < 1e-10 and st == failed
    # through the autograd function
    xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
    cell.zero_grad()
    st = {}
    out = mgrit_gru(cell, xg, hg, fallback=True, stats=st, **opts)
    (out * W).sum().backward()
    got = {"x": xg.grad, "h0": hg.grad, **{n: p.grad for n, p in cell.named_parameters()}}
    assert (out.detach() - S).abs().max() < 1e-12 and max_diff(got, ref) < 1e-10
    assert st["forward_info"] == failed and st["backward_info"] == failed
    # without the fall-back: MGRIT's approximate answer
    st = {}
    Ha, _ = mgrit_forward(cell, x, h0, fallback=False, stats=st, **opts)
    assert (Ha - S).abs().max() > 1e-6
    assert st["fallback"] is False and st["converged"] is False and st["residual"] > 1e-12
    st = {}
    ga, _ = mgrit_backward(cell, x, S, W, h0, fallback=False, stats=st, **opts)
    assert max_diff(ga, ref) > 1e-6 and st["fallback"] is False


CELL = ImplicitGRUCell(3, 8)
X = torch.randn(2, 64, 3)
BAD = [
    (lambda: mgrit_forward(CELL, X, fallback=True), r"fallback=True needs a tolerance"),
    (lambda: mgrit_backward(CELL, X, torch.zeros(2, 64, 8), torch.zeros(2, 64, 8), fallback=True),
     r"fallback=True needs a tolerance"),
    (lambda: mgrit_gru(CELL, X, fallback=True), r"fallback=True needs a tolerance"),
    (lambda: ParallelGRU(3, 8, rtol=None), r"fallback=True needs a tolerance"),    # fallback's default: True
    (lambda: mgrit_forward(CELL, X, fallback="yes", rtol=1e-3), r"fallback must be true or false, got 'yes'"),
    (lambda: mgrit_forward(CELL, X, rtol=0.0), r"rtol must be None or a positive number, got 0.0"),
    (lambda: mgrit_forward(CELL, X, rtol=-1e-3), r"rtol must be None or a positive number, got -0.001"),
    (lambda: mgrit_forward(CELL, X, rtol=math.nan), r"rtol must be None or a positive number, got nan"),
    (lambda: mgrit_forward(CELL, X, rtol=math.inf), r"rtol must be None or a positive number, got inf"),
    (lambda: mgrit_forward(CELL, X, rtol=True), r"rtol must be None or a positive number, got True"),
    (lambda: mgrit_forward(CELL, X, rtol="1e-3"), r"rtol must be None or a positive number, got '1e-3'"),
    (lambda: ParallelGRU(3, 8, rtol=0), r"rtol must be None or a positive number, got 0"),
    (lambda: mgrit_forward(CELL, X, coarse="implicit"),
     r"coarse must be one of \('euler', 'frozen'\), got 'implicit'"),
    (lambda: mgrit_backward(CELL, X, torch.zeros(2, 64, 8), torch.zeros(2, 64, 8), coarse=None),
     r"coarse must be one of \('euler', 'frozen'\), got None"),
    (lambda: ParallelGRU(3, 8, coarse="Frozen"), r"coarse must be one of \('euler', 'frozen'\), got 'Frozen'"),
]


@pytest.mark.parametrize("call,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_options(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# --------------------------------------------------------------- the back-off

def test_parallel_gru_adaptive_defaults():
    gru = ParallelGRU(2, 4)
    assert (gru.iters, gru.rtol, gru.fallback, gru.coarse, gru.tol) == (4, 1e-3, True, "frozen", None)


def hopeless_gru(seed=0):
    """A float64 ParallelGRU whose every MGRIT attempt falls back (1 iteration cannot reach rtol 1e-12)."""
    torch.manual_seed(seed)
    return ParallelGRU(2, 4, cf=4, iters=1, rtol=1e-12, fallback=True).double()


def train_calls(gru, x, W, calls):
    """Training calls (forward + backward); per call (forward tried MGRIT, backward tried MGRIT).

    Each call's states and gradients must be the serial loop's (tried and failed, or skipped)."""
    tried = []
    for _ in range(calls):
        gru.zero_grad()
        H, _ = gru(x)
        (H * W).sum().backward()
        fwd, bwd = gru.last_residuals["forward_info"], gru.last_residuals["backward_info"]
        for info in (fwd, bwd):
            assert not (info["serial"] and info["fallback"]), info
        if gru.rtol is not None and gru.rtol < 1:
            S = serial_forward(gru.cell, x)
            ref = torch.autograd.grad((S * W).sum(), list(gru.cell.parameters()))
            assert (H.detach() - S.detach()).abs().max() < 1e-12
            assert max(float((p.grad - r).abs().max()) for p, r in zip(gru.cell.parameters(), ref)) < 1e-10
        tried.append((not fwd["serial"], not bwd["serial"]))
    return tried


def attempts(tried, start=1):
    """The call numbers (from ``start``) that tried MGRIT, the same in both directions."""
    assert all(f == b for f, b in tried)
    return [start + i for i, (f, _) in enumerate(tried) if f]


def test_backoff_doubles_up_to_max_and_counts():
    """After the i-th failed attempt the next min(2^(i−1), 32) calls go serial: attempts at 1, 3, 6, 11, …"""
    assert SolveLog.MAX_BACKOFF == 32
    gru = hopeless_gru()
    x, W = torch.randn(2, 16, 2, dtype=D), torch.randn(2, 16, 4, dtype=D)
    tried = train_calls(gru, x, W, 104)
    # gaps of 1, 2, 4, 8, 16, 32, 32 serial calls
    expected = [1, 3, 6, 11, 20, 37, 70, 103]
    assert attempts(tried) == expected
    n, a = len(tried), len(expected)
    assert gru.take_solve_stats() == {"solves": 2 * n, "mgrit_solves": 2 * a, "iters": 2 * a, "fallbacks": 2 * n,
                                      "residual": 0.0}
    assert gru.take_solve_stats() == {"solves": 0, "mgrit_solves": 0, "iters": 0, "fallbacks": 0, "residual": 0.0}


def test_a_converged_solve_resets_the_backoff():
    gru = hopeless_gru()
    x, W = torch.randn(2, 16, 2, dtype=D), torch.randn(2, 16, 4, dtype=D)
    assert attempts(train_calls(gru, x, W, 5)) == [1, 3]            # calls 4, 5 serial; the next skip would be 4
    gru.take_solve_stats()
    gru.rtol = 10.0
    assert attempts(train_calls(gru, x, W, 1), 6) == [6]
    for d in ("forward_info", "backward_info"):
        assert gru.last_residuals[d]["converged"] and not gru.last_residuals[d]["fallback"]
    stats = gru.take_solve_stats()
    assert (stats["solves"], stats["mgrit_solves"], stats["fallbacks"]) == (2, 2, 0) and stats["residual"] <= 10.0
    gru.rtol = 1e-12
    # reset: the failure at 7 skips 1 call (not 4), the one at 9 skips 2
    assert attempts(train_calls(gru, x, W, 6), 7) == [7, 9, 12]


def test_evaluation_solves_are_not_counted_but_steer_the_backoff():
    gru = hopeless_gru()
    x, W = torch.randn(2, 16, 2, dtype=D), torch.randn(2, 16, 4, dtype=D)
    with torch.no_grad():
        H, _ = gru(x)
    assert gru.last_residuals["forward_info"]["fallback"] and (H - serial_forward(gru.cell, x)).abs().max() < 1e-12
    assert gru.take_solve_stats() == {"solves": 0, "mgrit_solves": 0, "iters": 0, "fallbacks": 0, "residual": 0.0}
    assert train_calls(gru, x, W, 1) == [(False, True)]             # the forward skips once; the adjoint tries
    assert gru.take_solve_stats() == {"solves": 2, "mgrit_solves": 1, "iters": 1, "fallbacks": 2, "residual": 0.0}


def test_an_evaluation_call_leaves_the_adjoint_backoff_alone():
    """A no-grad call solves no adjoint, so it consumes only the forward's back-off step."""
    gru = hopeless_gru()
    x, W = torch.randn(2, 16, 2, dtype=D), torch.randn(2, 16, 4, dtype=D)
    assert train_calls(gru, x, W, 1) == [(True, True)]                # both fall back: each skips its next solve
    with torch.no_grad():
        gru(x)
    assert gru.last_residuals["forward_info"]["serial"]                # the forward's skip is used here
    assert train_calls(gru, x, W, 1) == [(True, False)]               # the adjoint's is still there


def test_fixed_iteration_solves_report_an_unknown_residual():
    """Without rtol a solve has no relative residual: the row says nan, not the 0 of an exact solve."""
    torch.manual_seed(0)
    gru = ParallelGRU(2, 4, cf=4, iters=1, rtol=None, fallback=False).double()
    x, W = torch.randn(2, 16, 2, dtype=D), torch.randn(2, 16, 4, dtype=D)
    train_calls(gru, x, W, 1)
    stats = gru.take_solve_stats()
    assert stats["solves"] == 2 and stats["fallbacks"] == 0 and math.isnan(stats["residual"])


def test_pgru_rtol_zero_means_fixed_iterations():
    from cdsgd.models import build_model

    rnn = build_model("pgru", (40, 2), 3, hidden=4, rtol=0, fallback=False).rnn
    assert rnn.rtol is None and not rnn.fallback and rnn.iters == 4
    with pytest.raises(ValueError, match="fallback=True needs a tolerance"):
        build_model("pgru", (40, 2), 3, hidden=4, rtol=0)


# --------------------------------------------------------- the frozen coarse step

def gates(h, xp, whh, bhh):
    gr, gz, gn = (h @ whh.T + bhh).chunk(3, -1)
    xr, xz, xn = xp.chunk(3, -1)
    r, z = torch.sigmoid(xr + gr), torch.sigmoid(xz + gz)
    return z, torch.tanh(xn + r * gn)


@pytest.mark.parametrize("m", [2.0, 4.0, 16.0])
def test_frozen_step_formula_and_linearised_vjp(m):
    """Φ_m = n + (h − n)(1 + z)^(−m); _linearise(coarse="frozen") equals torch.func.vjp of it."""
    cell, x, _ = problem(H=6)
    xp = cell.project(x[:, :5]).transpose(0, 1).detach()           # (5, B, 3H)
    hs, mu = torch.randn(5, 3, 6, dtype=D), torch.randn(5, 3, 6, dtype=D)
    whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()
    z, n = gates(hs, xp, whh, bhh)
    step = implicit_gru_step(hs, xp, whh, bhh, m, "frozen")
    assert torch.allclose(step, n + (hs - n) * (1 + z) ** -m, atol=1e-15)
    assert (step - implicit_gru_step(hs, xp, whh, bhh, m, "euler")).abs().max() > 1e-3
    _, vjp = torch.func.vjp(lambda h_, a_: implicit_gru_step(h_, a_, whh, bhh, m, "frozen"), hs, xp)
    dh, da = vjp(mu)
    beta, alpha, alpha2 = _linearise(hs, xp, whh, bhh, m, "frozen")
    mu3 = torch.cat([mu, mu, mu], -1)
    assert torch.allclose(mu * beta + (mu3 * alpha2) @ whh, dh, atol=1e-13)
    assert torch.allclose(mu3 * alpha, da, atol=1e-13)


def test_frozen_equals_euler_at_dt_1():
    cell, x, h = problem(H=6)
    xp = cell.project(x[:, 0]).detach()
    whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()
    assert torch.equal(implicit_gru_step(h, xp, whh, bhh, 1.0, "frozen"), implicit_gru_step(h, xp, whh, bhh, 1.0))
    for a, b in zip(_linearise(h, xp, whh, bhh, 1.0, "frozen"), _linearise(h, xp, whh, bhh, 1.0, "euler")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("levels,iters,fcf", [(2, 16, False), (3, 40, True)])
def test_frozen_coarse_grid_converges_to_serial(levels, iters, fcf):
    """T/cf F-iterations (or a tight tol on 3 levels) reproduce the serial states and gradients with the frozen
    coarse step; one iteration differs from the Euler coarse step's (the option reaches forward and adjoint)."""
    cell, x, h0 = problem()
    S = serial_forward(cell, x, h0).detach()
    W = torch.randn_like(S)
    ref = serial_grads(cell, x, h0, W)
    opts = {"cf": 4, "levels": levels, "iters": iters, "fcf": fcf, "coarse": "frozen",
            "tol": 1e-13 if levels > 2 else None}
    H, _ = mgrit_forward(cell, x, h0, **opts)
    assert (H - S).abs().max() < 1e-12
    g, _ = mgrit_backward(cell, x, H, W, h0, **opts)
    assert max_diff(g, ref) < 1e-10
    xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
    cell.zero_grad()
    (mgrit_gru(cell, xg, hg, **opts) * W).sum().backward()
    got = {"x": xg.grad, "h0": hg.grad, **{n: p.grad for n, p in cell.named_parameters()}}
    assert max_diff(got, ref) < 1e-10
    one = {**opts, "iters": 1, "tol": None}
    Hf, _ = mgrit_forward(cell, x, h0, **one)
    He, _ = mgrit_forward(cell, x, h0, **{**one, "coarse": "euler"})
    assert (Hf - He).abs().max() > 1e-6
    gf, _ = mgrit_backward(cell, x, S, W, h0, **one)
    ge, _ = mgrit_backward(cell, x, S, W, h0, **{**one, "coarse": "euler"})
    assert max_diff(gf, ge) > 1e-6


# ------------------------------------------------------------ gradient_error

class GRUHead(nn.Module):
    def __init__(self, **opts):
        super().__init__()
        self.gru = ParallelGRU(2, 8, **opts)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.gru(x)[1][0])


def test_gradient_error_matches_independent_gradients():
    torch.manual_seed(0)
    net = GRUHead(cf=4, iters=1, rtol=None, fallback=False).double()
    x, y = torch.randn(3, 32, 2, dtype=D), torch.randn(3, 1, dtype=D)

    def loss_fn():
        return (net(x) - y).pow(2).mean()

    def loss_of(states):
        return (net.out(states[:, -1]) - y).pow(2).mean()

    params = list(net.parameters())
    ls = loss_of(serial_forward(net.gru.cell, x))
    lm = loss_of(mgrit_gru(net.gru.cell, x, cf=4, iters=1, fcf=True, coarse="frozen"))  # the layer's defaults
    gs = torch.cat([g.reshape(-1) for g in torch.autograd.grad(ls, params)])
    gm = torch.cat([g.reshape(-1) for g in torch.autograd.grad(lm, params)])
    expected = {"cosine": float(gm @ gs / (gm.norm() * gs.norm())), "norm_ratio": float(gm.norm() / gs.norm()),
                "rel_error": float((gm - gs).norm() / gs.norm()), "loss_mgrit": float(lm.detach()),
                "loss_serial": float(ls.detach())}
    assert expected["rel_error"] > 1e-4                                # the one-iteration solve is approximate
    loss_fn().backward()                                               # .grad set: it must survive
    before = [p.grad.clone() for p in params]
    for mode in ("mgrit", "serial"):
        net.gru.mode = mode
        err = gradient_error(net, loss_fn)
        assert set(err) == set(expected)
        for k, v in expected.items():
            assert abs(err[k] - v) < 1e-10, (k, err[k], v)
        assert net.gru.mode == mode
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    fresh = GRUHead(cf=4, iters=1, rtol=None, fallback=False).double()
    gradient_error(fresh, lambda: fresh(x).sum())
    assert all(p.grad is None for p in fresh.parameters())


def test_gradient_error_restores_the_mode_on_error_and_refuses_no_parallel_gru():
    net = GRUHead(cf=4, iters=2)
    x = torch.randn(2, 16, 2)

    def fails_serially():
        if net.gru.mode == "serial":
            raise RuntimeError("boom")
        return net(x).sum()

    with pytest.raises(RuntimeError, match="boom"):
        gradient_error(net, fails_serially)
    assert net.gru.mode == "mgrit"
    lin = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="gradient_error needs a module holding a ParallelGRU, got Linear"):
        gradient_error(lin, lambda: lin(torch.zeros(1, 2)).sum())


# ------------------------------------------------------------- metrics columns

def run_rows(monkeypatch, model, n_agents, steps, **options):
    """Two metrics rows (after ``steps`` steps, then right after) and the solve reports a spy heard."""
    from cdsgd.data import load_dataset
    from cdsgd.executor import METRIC_COLUMNS, Simulator
    from cdsgd.models import build_model

    heard = []
    record = SolveLog.record

    def spy(self, direction, info, counted=True):
        heard.append((direction, dict(info), counted))
        return record(self, direction, info, counted)

    monkeypatch.setattr(SolveLog, "record", spy)
    if model == "pgru":
        ds = load_dataset("synthetic_seq", n_train=32, n_test=16, mean_length=40.0, max_length=80)
    else:
        ds = load_dataset("synthetic", n_train=40, n_test=20)
    x, y = ds.train
    shards = [(x[j::n_agents], y[j::n_agents]) for j in range(n_agents)]
    sim = Simulator(lambda: build_model(model, ds.input_shape, ds.n_classes, **options), shards, None, "sgd",
                    batch_size=8, lr=0.1, test_set=ds.test)
    for _ in range(steps):
        sim.step()
    rows = [sim.evaluate(), sim.evaluate()]
    assert all(list(r) == list(METRIC_COLUMNS) for r in rows) and set(MGRIT_COLUMNS) <= set(METRIC_COLUMNS)
    return rows, heard


@pytest.mark.parametrize("n_agents,options", [(1, {}), (2, {}), (1, {"iters": 1, "rtol": 1e-9})],
                         ids=["defaults", "two-agents", "falling-back"])
def test_metrics_rows_count_the_training_solves(monkeypatch, n_agents, options):
    steps = 3
    rows, heard = run_rows(monkeypatch, "pgru", n_agents, steps, hidden=8, **options)
    row = rows[0]
    train = [info for _, info, counted in heard if counted]
    assert len(train) == 2 * steps * n_agents                          # a forward and an adjoint per step and agent
    assert any(not counted for _, _, counted in heard)                  # evaluation solved too, uncounted
    tried = [i for i in train if not i["serial"]]
    fallbacks = sum(i["serial"] or i["fallback"] for i in train)
    assert row["mgrit_solves"] == 2 * steps * n_agents
    assert row["mgrit_fallbacks"] == fallbacks and float(row["mgrit_fallbacks"]).is_integer()
    assert 0 <= row["mgrit_fallbacks"] <= row["mgrit_solves"]
    assert row["mgrit_iters"] == pytest.approx(sum(i["iters"] for i in tried) / len(tried), rel=1e-12)
    assert math.isfinite(row["mgrit_iters"]) and row["mgrit_iters"] >= 0
    assert row["mgrit_residual"] == max([0.0] + [i["residual"] for i in train])
    rtol = options.get("rtol", 1e-3)
    assert 0 <= row["mgrit_residual"] <= rtol                          # converged, or exact after a fall-back
    if options:
        assert fallbacks == len(train) and row["mgrit_residual"] == 0.0 and row["mgrit_iters"] == 1.0
    assert all(math.isnan(rows[1][c]) for c in MGRIT_COLUMNS)          # nothing since the previous row


@pytest.mark.parametrize("model,options", [("logreg", {}), ("pgru", {"hidden": 8, "mode": "serial"})])
def test_metrics_columns_are_nan_without_mgrit_solves(monkeypatch, model, options):
    rows, heard = run_rows(monkeypatch, model, 1, 2, **options)
    assert heard == []
    for row in rows:
        assert all(math.isnan(row[c]) for c in MGRIT_COLUMNS)
        assert math.isfinite(row["test_loss"])


def test_a_pgru_run_writes_and_shows_the_mgrit_columns(tmp_path):
    """`cdsgd run model=pgru`: metrics.csv has the four columns per row, and the progress line names them."""
    import csv

    from cdsgd.config import load_config
    from cdsgd.run.experiment import run_experiment

    lines = []
    overrides = ["dataset=synthetic_seq", "model=pgru", "n_agents=3", "epochs=2", f"out={tmp_path / 'r'}",
                 "dataset_params={n_train = 48, n_test = 12, mean_length = 40.0, max_length = 80}",
                 "model_params={hidden = 8}"]
    run_experiment(load_config(overrides=overrides), progress=False, log=lines.append)
    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    for row, before in zip(rows, [0] + steps):
        assert float(row["mgrit_solves"]) == 2 * 3 * (int(row["step"]) - before)   # forward + adjoint, 3 agents
        assert 0 <= float(row["mgrit_fallbacks"]) <= float(row["mgrit_solves"])
        assert 0 <= float(row["mgrit_residual"]) <= 1e-3 and float(row["mgrit_iters"]) >= 0
    shown = [line for line in lines if line.startswith("epoch ")]
    assert len(shown) == len(rows) and all(" serial" in line and "mgrit " in line for line in shown)
