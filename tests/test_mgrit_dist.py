"""MGRIT across processes: real gloo ranks reproduce single-process MGRIT (states, norms, gradients).

One spawned run per world size (2 and 4 ranks, cached for the module) goes
through every setting below; the tests then check its parts. Problems as in
tests/test_mgrit.py (default init, x ~ N(0, 1), h_0 ~ N(0, 0.25), float64),
loss Σ_r Σ H_r ⊙ R_r with R random: every rank's loss uses its own block.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from dist_harness import run_ranks

from cdsgd.mgrit import (
    ImplicitGRUCell,
    mgrit_backward,
    mgrit_forward,
    mgrit_gru_distributed,
    serial_forward,
    time_block,
)

D = torch.float64
B, I, HID = 2, 3, 8

# (T, cf, levels, iters, fcf, tol, reduce_input_grads)
SETTINGS = [
    (64, 4, 2, 2, True, None, False),
    (64, 4, 2, 3, False, None, True),
    (64, 2, 3, 2, True, None, False),
    (128, 4, 3, 1, True, None, False),
    (128, 2, 4, 2, False, None, False),
    (64, 4, 2, 16, False, None, False),    # T/cf F-iterations: exact
    (64, 4, 2, 50, True, 1e-13, False),    # stops on tol: converged
]
CONVERGED = (5, 6)

COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "all_gather_object", "reduce", "barrier",
               "monitored_barrier", "reduce_scatter", "all_to_all", "gather", "scatter",
               "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]


def problem(T, seed=0):
    torch.manual_seed(seed)
    cell = ImplicitGRUCell(I, HID).to(D)
    x, h0 = torch.randn(B, T, I, dtype=D), 0.5 * torch.randn(B, HID, dtype=D)
    return cell, x, h0, torch.randn(B, T, HID, dtype=D)


def _record_collectives():
    """Replace every collective by a wrapper that records its name and calls it: (saved, log)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved, log = [], []
    for name in COLLECTIVES:
        for mod in (dist, c10d):
            if hasattr(mod, name):
                fn = getattr(mod, name)
                saved.append((mod, name, fn))

                def wrapper(*a, _name=name, _fn=fn, **k):
                    log.append(_name)
                    return _fn(*a, **k)

                setattr(mod, name, wrapper)
    return saved, log


def _one(setting, record=False):
    from cdsgd.mgrit import gather_states

    T, cf, levels, iters, fcf, tol, reduce = setting
    cell, x, h0, R = problem(T)
    blk = time_block(T, cf=cf, levels=levels)
    xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
    stats, calls = {}, {}
    saved, log = _record_collectives() if record else ([], [])
    try:
        Hb = mgrit_gru_distributed(cell, xg, hg, cf=cf, levels=levels, iters=iters, tol=tol, fcf=fcf,
                                   reduce_input_grads=reduce, stats=stats, timeout=30)
        calls["forward"] = list(log)
        (Hb * R[:, blk]).sum().backward()
        calls["backward"] = log[len(calls["forward"]):]
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return {"block": (blk.start, blk.stop), "Hb": Hb.detach(), "H": gather_states(Hb), "stats": stats,
            "x": xg.grad, "h0": hg.grad, "calls": calls, **{n: p.grad for n, p in cell.named_parameters()}}


def _refused(T, cf, levels):
    try:
        time_block(T, cf=cf, levels=levels)
        tb = "accepted"
    except ValueError as e:
        tb = str(e)
    cell, x, h0, _ = problem(T)
    try:
        mgrit_gru_distributed(cell, x, h0, cf=cf, levels=levels, timeout=30)
        return tb, "accepted"
    except ValueError as e:
        return tb, str(e)


BAD = {2: [(36, 4, 2), (80, 4, 3)], 4: [(40, 4, 2), (80, 4, 3), (48, 2, 4)]}   # (T, cf, levels)


def _worker(rank, world):
    out = {"runs": [_one(s, record=(i == 0)) for i, s in enumerate(SETTINGS)]}
    out["refused"] = [_refused(*b) for b in BAD[world]]
    return out


@functools.cache
def results(world):
    return run_ranks(_worker, world, timeout=80, pg_timeout=40)


def close(a, b, tol):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("world", [2, 4])
def test_states_norms_and_gradients_match_single_process(world):
    res = results(world)
    for i, (T, cf, levels, iters, fcf, tol, reduce) in enumerate(SETTINGS):
        cell, x, h0, R = problem(T)
        H, nf = mgrit_forward(cell, x, h0, cf=cf, levels=levels, iters=iters, tol=tol, fcf=fcf)
        g, nb = mgrit_backward(cell, x, H, R, h0, cf=cf, levels=levels, iters=iters, tol=tol, fcf=fcf)
        gx_sum = torch.zeros_like(x)
        for rank in range(world):
            got = res[rank]["runs"][i]
            lo, hi = got["block"]
            assert (lo, hi) == (rank * T // world, (rank + 1) * T // world)
            assert close(got["Hb"], H[:, lo:hi], 1e-12) and close(got["H"], H, 1e-12), (i, rank)
            for key, ref in (("forward", nf), ("backward", nb)):      # global norms, on every rank
                assert len(got["stats"][key]) == len(ref), (i, key)
                assert all(abs(a - b) <= 1e-12 + 1e-9 * b for a, b in zip(got["stats"][key], ref)), (i, key)
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):   # summed: the full gradient everywhere
                assert close(got[name], g[name], 1e-10), (i, rank, name)
            if reduce:
                assert close(got["x"], g["x"], 1e-10) and close(got["h0"], g["h0"], 1e-10), (i, rank)
            else:
                assert close(got["x"][:, lo:hi], g["x"][:, lo:hi], 1e-10), (i, rank)
                assert not got["x"][:, :lo].any() and not got["x"][:, hi:].any(), (i, rank)
                assert close(got["h0"], g["h0"] if rank == 0 else torch.zeros_like(h0), 1e-10), (i, rank)
                gx_sum += got["x"]
        if not reduce:
            assert close(gx_sum, g["x"], 1e-10), i


@pytest.mark.parametrize("world", [2, 4])
def test_converged_runs_equal_the_serial_loop(world):
    res = results(world)
    for i in CONVERGED:
        T = SETTINGS[i][0]
        cell, x, h0, R = problem(T)
        xg, hg = x.clone().requires_grad_(), h0.clone().requires_grad_()
        S = serial_forward(cell, xg, hg)
        (S * R).sum().backward()
        for rank in range(world):
            got = res[rank]["runs"][i]
            assert close(got["H"], S.detach(), 1e-11), (i, rank)
            for name, p in cell.named_parameters():
                assert close(got[name], p.grad, 1e-10), (i, rank, name)
            lo, hi = got["block"]
            assert close(got["x"][:, lo:hi], xg.grad[:, lo:hi], 1e-10)
        assert res[0]["runs"][i]["stats"]["forward"][-1] < 1e-12


@pytest.mark.parametrize("world", [2, 4])
def test_no_collective_during_the_solve(world):
    """Forward and adjoint solves are point-to-point only; backward ends with exactly one all-reduce."""
    for rank, out in results(world).items():
        calls = out["runs"][0]["calls"]
        assert calls["forward"] == [], (rank, calls)
        assert calls["backward"] == ["all_reduce"], (rank, calls)   # the recording works: it sees this one


@pytest.mark.parametrize("world", [2, 4])
def test_world_sizes_that_do_not_split_are_refused(world):
    for rank, out in results(world).items():
        for (T, cf, levels), msgs in zip(BAD[world], out["refused"]):
            n = T // cf ** (levels - 1)
            for msg in msgs:
                assert msg.startswith(f"T={T} cannot be split evenly over world size {world}: with cf={cf} and "
                                      f"levels={levels} the coarsest grid has T/cf**(levels-1) = {n} intervals, "
                                      f"not a multiple of {world}"), (rank, msg)


def _stalled(rank, world):
    from cdsgd.runtime import CommError

    if rank == 1:
        time.sleep(4.0)             # alive but never joins the solve
        return ("stalled", 0.0, None)
    cell, x, h0, _ = problem(64)
    t0 = time.monotonic()
    try:
        mgrit_gru_distributed(cell, x, h0, cf=4, timeout=1.0)
    except CommError as e:
        return (str(e), time.monotonic() - t0, e.peer)
    return ("no error", time.monotonic() - t0, None)


def test_silent_time_neighbour_times_out_naming_it():
    msg, waited, peer = run_ranks(_stalled, 2, timeout=40, pg_timeout=20)[0]
    assert msg.startswith("rank 0: ") and "rank 1" in msg and "comm_timeout=1 s" in msg, msg
    assert peer == 1 and 0.5 < waited < 4.0


def test_needs_a_process_group_and_checks_options():
    cell, x, h0, _ = problem(64)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        mgrit_gru_distributed(cell, x, h0, cf=4)
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, got 0"):
        mgrit_gru_distributed(cell, x, h0, cf=4, timeout=0)
    with pytest.raises(ValueError, match=r"reduce_input_grads must be true or false, got 1"):
        mgrit_gru_distributed(cell, x, h0, cf=4, reduce_input_grads=1)
    with pytest.raises(ValueError, match=r"T=66 is not divisible by cf\*\*\(levels-1\) = 4"):
        mgrit_gru_distributed(cell, torch.randn(B, 66, I, dtype=D), h0, cf=4)
    with pytest.raises(ValueError, match=r"cf must be an integer >= 2, got 1"):
        time_block(64, cf=1)
