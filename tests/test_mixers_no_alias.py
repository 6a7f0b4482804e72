"""A mixer's result is the caller's: ``x = m.mix(x)`` in a loop computes W^k x0, for every mixer.

The answers are computed independently, with numpy's matrix powers (or the
schedule's matrices multiplied in turn) in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.mixers import MatrixMixer, Mixer, ScheduleMixer, make_mixer, overlaps
from dist_harness import run_ranks


def ring(n=8):
    return topologies.mixing_matrix(topologies.build("ring", n))


def power_apply(W, x0, k):
    """W^k x0 in float64 numpy, the independent answer."""
    return np.linalg.matrix_power(np.asarray(W, dtype=np.float64), k) @ x0


def start_x0(n=8, p=5, seed=0):
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


MIXERS = {
    "dense": lambda W: MatrixMixer(W, method="dense"),
    "edges": lambda W: MatrixMixer(sp.csr_array(W), method="edges"),
    "csr": lambda W: MatrixMixer(sp.csr_array(W), method="csr"),
    "exact": lambda W: MatrixMixer(W, exact=True),
    "auto sparse": lambda W: make_mixer(sp.csr_array(W)),
}


@pytest.mark.parametrize("kind", sorted(MIXERS))
@pytest.mark.parametrize("call", ["mix", "start"])
def test_plain_loop_gives_matrix_power(kind, call):
    W = ring(8)
    m = MIXERS[kind](W)
    x0 = start_x0()
    x = x0.clone()
    for _ in range(400):
        x = m.mix(x) if call == "mix" else m.start(x).wait()
    np.testing.assert_allclose(x.numpy(), power_apply(W, x0.numpy(), 400), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_two_results_held_at_once_stay_correct(kind):
    W = ring(8)
    m = MIXERS[kind](W)
    A, B = start_x0(seed=1), start_x0(seed=2)
    a, b = m.mix(A), m.mix(B)
    assert a is not b and not overlaps(a, b)
    np.testing.assert_allclose(a.numpy(), W @ A.numpy(), rtol=0, atol=1e-14)
    np.testing.assert_allclose(b.numpy(), W @ B.numpy(), rtol=0, atol=1e-14)
    h1, h2 = m.start(A), m.start(B)  # two mixings in flight
    np.testing.assert_allclose(h2.wait().numpy(), W @ B.numpy(), rtol=0, atol=1e-14)
    np.testing.assert_allclose(h1.wait().numpy(), W @ A.numpy(), rtol=0, atol=1e-14)


def test_out_is_written_and_returned_and_overlap_is_refused():
    W = ring(8)
    m = MatrixMixer(W)
    X, out = start_x0(), torch.empty(8, 5, dtype=torch.float64)
    assert m.mix(X, out=out) is out
    np.testing.assert_allclose(out.numpy(), W @ X.numpy(), rtol=0, atol=1e-14)
    # ping-pong between two owned buffers: the allocation-free form of the loop
    a, b = X.clone(), torch.empty_like(X)
    for _ in range(50):
        a, b = m.mix(a, out=b), a
    np.testing.assert_allclose(a.numpy(), power_apply(W, X.numpy(), 50), rtol=0, atol=1e-12)
    for bad in (X, X[:, :5]):
        with pytest.raises(ValueError, match="shares memory with X"):
            m.mix(X, out=bad)
    with pytest.raises(ValueError, match="out must be like X"):
        m.mix(X, out=torch.empty(8, 4, dtype=torch.float64))
    avg = m.average(X)
    assert not overlaps(avg, m.average(X))
    np.testing.assert_allclose(avg.numpy(), np.tile(X.numpy().mean(axis=0), (8, 1)), rtol=0, atol=1e-14)


def test_steady_state_with_out_allocates_nothing_new():
    """With out= the mixer's own scratch is made once: its buffers do not change across steps."""
    W = sp.csr_array(ring(64))
    m = MatrixMixer(W, method="edges")
    X, out = start_x0(64, 300), torch.empty(64, 300, dtype=torch.float64)
    m.mix(X, out=out)
    before = {k: v.data_ptr() for k, v in m._buffers.items()}
    for _ in range(5):
        m.mix(X, out=out)
    assert {k: v.data_ptr() for k, v in m._buffers.items()} == before


def test_schedule_mixer_applies_its_steps_in_turn():
    S = topologies.schedule("one_peer_exponential", 8)
    m = make_mixer(S)
    assert isinstance(m, ScheduleMixer)
    x0 = start_x0()
    x, expect = x0.clone(), x0.numpy().copy()
    for t in range(7):
        x = m.mix(x)
        expect = np.asarray(S[t % len(S)], dtype=np.float64) @ expect
        np.testing.assert_allclose(x.numpy(), expect, rtol=0, atol=1e-13)
    # one period of one-peer exponential mixing averages exactly (log2 8 = 3 steps)
    m2 = make_mixer(S)
    y = x0.clone()
    for _ in range(3):
        y = m2.start(y).wait()
    np.testing.assert_allclose(y.numpy(), np.tile(x0.numpy().mean(axis=0), (8, 1)), rtol=0, atol=1e-13)


def test_make_mixer_takes_every_kind_of_input():
    W = ring(6)
    assert make_mixer(W).method == "dense"
    assert make_mixer(sp.csr_array(ring(200))).method == "edges"
    mean = make_mixer(None, n_agents=5)
    X = start_x0(5, 3)
    np.testing.assert_allclose(mean.mix(X).numpy(), np.tile(X.numpy().mean(axis=0), (5, 1)), atol=1e-14)
    ready = MatrixMixer(W)
    assert make_mixer(ready, n_agents=6) is ready
    with pytest.raises(ValueError, match="for 6 agents but there are 7"):
        make_mixer(ready, n_agents=7)
    P = topologies.mixing_matrix(topologies.build("directed_ring", 4), "push_sum")
    with pytest.raises(ValueError, match="symmetric"):
        make_mixer(P)  # a push-sum matrix is not doubly stochastic
    sgp = make_mixer(P, column_stochastic=make_algorithm("sgp", lr=0.1).column_stochastic)
    Z = start_x0(4, 2)
    np.testing.assert_allclose(sgp.mix(Z).numpy(), np.asarray(P) @ Z.numpy(), atol=1e-14)
    with pytest.raises(ValueError, match="needs n_agents"):
        make_mixer(None)
    with pytest.raises(TypeError, match="algorithm"):  # the mixers layer knows no update rule
        make_mixer(ring(4), algorithm=make_algorithm("cdsgd", lr=0.1))


def test_a_torch_tensor_w_is_taken():
    W = ring(5)
    X = start_x0(5, 3)
    for m in (make_mixer(torch.as_tensor(W)), MatrixMixer(torch.as_tensor(W))):
        np.testing.assert_allclose(m.mix(X).numpy(), W @ X.numpy(), atol=1e-7)


def test_matrix_mixer_names_the_factory_for_a_schedule():
    S = topologies.schedule("one_peer_exponential", 8)
    with pytest.raises(ValueError, match=r"make_mixer\(schedule\)"):
        MatrixMixer(S)


def test_rule_checks_the_matrix_of_a_ready_mixer():
    """No door around validation: a rule refuses a matrix it would refuse, however the mixer was made, where it
    meets the mixer (init_state with the mixer, or check_mixer)."""
    X, G = start_x0(4, 2), torch.zeros(4, 2, dtype=torch.float64)
    # a W whose smallest eigenvalue is -1 (a 4-ring of weight 1/2, no self weight): D² refuses it as a matrix ...
    W = 0.5 * np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=float)
    d2 = make_algorithm("d2", lr=0.1)
    with pytest.raises(ValueError, match="smallest eigenvalue"):
        d2.check_mixing(W)
    # ... and as a ready mixer, however it was built
    for mixer in (MatrixMixer(W), make_mixer(W)):
        with pytest.raises(ValueError, match="smallest eigenvalue"):
            d2.init_state(X, mixer)
        with pytest.raises(ValueError, match="smallest eigenvalue"):
            d2.check_mixer(mixer)
    # a column-stochastic (not doubly stochastic) matrix behind validate=False cannot run cdsgd
    P = np.array([[1 / 3, 0, 1 / 2], [1 / 3, 1 / 2, 0], [1 / 3, 1 / 2, 1 / 2]])  # push-sum: 0→1, 0→2, 1→2, 2→0
    cd = make_algorithm("cdsgd", lr=0.1)
    with pytest.raises(ValueError, match="doubly stochastic"):
        cd.init_state(X[:3], MatrixMixer(P, validate=False))
    sgp = make_algorithm("sgp", lr=0.1)  # while push-sum takes it
    mixer = MatrixMixer(P, validate=False)
    sgp.update(X[:3].clone(), G[:3], sgp.init_state(X[:3], mixer), k=0, mixer=mixer)
    # rows summing to 1 but columns not: refused too
    R = np.array([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5]])
    with pytest.raises(ValueError, match="doubly stochastic"):
        cd.check_mixer(MatrixMixer(R, validate=False))
    # a schedule refused by d2, as a whole ScheduleMixer or through one of its steps
    S = make_mixer(topologies.schedule("one_peer_exponential", 4))
    for mixer in (S, S.at(1)):
        with pytest.raises(ValueError, match="time-varying"):
            d2.init_state(X, mixer)
    # a mixer whose matrix is unknown (all-reduce, a user's own) is taken on trust
    assert make_algorithm("sgd", lr=0.1).check_mixer(make_mixer(None, n_agents=4)).matrix is None


def test_a_rule_checks_its_mixer_once_not_every_step_and_writes_nothing_into_it(monkeypatch):
    """The check runs where rule and mixer meet (init_state); update only mixes, and leaves the mixer as it was."""
    calls = []
    X = start_x0(6, 3)
    W = topologies.mixing_matrix(topologies.build("ring", 6), "lazy_metropolis")
    for name in ("cdsgd", "cdmsgd", "dsgt", "d2", "qg_dsgdm", "sgp"):
        alg, mixer = make_algorithm(name, lr=0.1), make_mixer(W)
        check = alg.check_mixing
        monkeypatch.setattr(alg, "check_mixing", lambda W, check=check, name=name: calls.append(name) or check(W))
        before = dict(vars(mixer))
        state = alg.init_state(X, mixer)
        for k in range(3):
            alg.update(X.clone(), X - 1.0, state, k=k, mixer=mixer)
        assert calls == [name], name
        assert vars(mixer).keys() == before.keys(), name  # no bookkeeping of the rule's in the mixer
        calls.clear()


def test_a_user_loop_may_hand_update_a_whole_schedule_mixer():
    """update mixes with W_k of a ScheduleMixer at step k: cdsgd's x ← W_k x − α g, against the matrices."""
    S = topologies.schedule("one_peer_exponential", 8)
    mixer = make_mixer(S)
    alg = make_algorithm("cdsgd", lr=0.1)
    X = start_x0(8, 3)
    B = start_x0(8, 3).flip(0)
    state = alg.init_state(X, mixer)
    want = X.numpy().copy()
    for k in range(5):
        alg.update(X, X - B, state, k=k, mixer=mixer)
        want = np.asarray(S[k % len(S)], dtype=np.float64) @ want - 0.1 * (want - B.numpy())
        np.testing.assert_allclose(X.numpy(), want, rtol=0, atol=1e-13)


class Alone(Mixer):
    """A user's own mixer written to the old contract (no agents, start without out=)."""

    n_agents = 1

    def __init__(self):
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)

    def start(self, x):
        raise AssertionError("not reached")

    def average(self, x, mask=None):
        raise AssertionError("not reached")


def test_a_mixer_missing_what_rules_use_is_named():
    from cdsgd.algorithms import DecentralizedOptimizer
    from cdsgd.mixers import check_mixer

    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="must set agents"):
        DecentralizedOptimizer([w], Alone(), "dsgt", lr=0.1)
    m = Alone()
    m.agents = [0]
    with pytest.raises(ValueError, match=r"start must take out="):
        check_mixer(m)


# ---------------------------------------------------------------- across gloo ranks


def _rank_loops(rank, world, W, per_rank, steps, schedule_name):
    from cdsgd.mixers import make_mixer
    from cdsgd.runtime import BlockMixer, NeighbourMixer

    n = W.shape[0]
    X0 = torch.randn(n, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mine = X0[rank * per_rank:(rank + 1) * per_rank].clone()
    m = (NeighbourMixer(W, rank, timeout=30) if per_rank == 1
         else BlockMixer(W, rank, world, timeout=30))
    x = mine.clone()
    for t in range(steps):
        x = m.mix(x) if t % 2 else m.start(x).wait()
    a_in, b_in = mine, 2 * mine + 1
    a, b = m.mix(a_in), m.mix(b_in)  # two results held at once
    ha, hb = m.start(a_in), m.start(b_in)  # two in flight
    c, d = hb.wait(), ha.wait()
    # the allocation-free form: ping-pong between two owned buffers, the pool not growing
    p, q = mine.clone(), torch.empty_like(mine)
    for _ in range(3):
        p, q = m.mix(p, out=q), p
    pool = sum(len(v) for v in m._pool.values())
    for _ in range(3):
        p, q = m.mix(p, out=q), p
    pool_after = sum(len(v) for v in m._pool.values())
    sched = None
    if schedule_name:
        def block(Wk, *, exact, validate, n_agents=None):
            return BlockMixer(Wk, rank, world, timeout=30, exact=exact, validate=validate)
        s = make_mixer(topologies.schedule(schedule_name, n), per_matrix=block)
        y = mine.clone()
        for _ in range(5):
            y = s.mix(y)
        sched = y
    return x, a, b, c, d, p, pool, pool_after, sched


def _check_rank_results(results, W, world, per_rank, steps, schedule_name):
    n = W.shape[0]
    X0 = torch.randn(n, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64).numpy()
    Wd = np.asarray(W.toarray() if sp.issparse(W) else W)
    expect = power_apply(Wd, X0, steps)
    for r in range(world):
        x, a, b, c, d, p, pool, pool_after, sched = results[r]
        rows = slice(r * per_rank, (r + 1) * per_rank)
        np.testing.assert_allclose(x.numpy().reshape(per_rank, -1), expect[rows], rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.numpy().reshape(per_rank, -1), (Wd @ X0)[rows], atol=1e-14)
        np.testing.assert_allclose(b.numpy().reshape(per_rank, -1), (Wd @ (2 * X0 + 1))[rows], atol=1e-13)
        np.testing.assert_allclose(d.numpy().reshape(per_rank, -1), (Wd @ X0)[rows], atol=1e-14)
        np.testing.assert_allclose(c.numpy().reshape(per_rank, -1), (Wd @ (2 * X0 + 1))[rows], atol=1e-13)
        np.testing.assert_allclose(p.numpy().reshape(per_rank, -1), power_apply(Wd, X0, 6)[rows], atol=1e-13)
        assert pool == pool_after
        if schedule_name:
            S = topologies.schedule(schedule_name, n)
            y = X0.copy()
            for t in range(5):
                y = np.asarray(S[t % len(S)], dtype=np.float64) @ y
            np.testing.assert_allclose(sched.numpy().reshape(per_rank, -1), y[rows], rtol=0, atol=1e-13)


def test_neighbour_mixer_loops_on_ranks_ring_and_path():
    """100 ring averages and 200 path averages across 4 ranks (after Bluefog's and PyTorch's own cases)."""
    for build, steps in (("ring", 100), ("path", 200)):
        W = topologies.mixing_matrix(topologies.build(build, 4))
        results = run_ranks(_rank_loops, 4, W, 1, steps, "one_peer_exponential" if build == "ring" else None,
                            timeout=120)
        _check_rank_results(results, W, 4, 1, steps, "one_peer_exponential" if build == "ring" else None)


def test_block_mixer_loops_on_two_ranks_of_four_agents():
    W = topologies.mixing_matrix(topologies.build("ring", 8), sparse=True)
    results = run_ranks(_rank_loops, 2, W, 4, 60, "one_peer_exponential", timeout=120)
    _check_rank_results(results, W, 2, 4, 60, "one_peer_exponential")
