"""Time-varying topologies: schedules of mixing matrices, their rates, and both executors stepping through them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.mixers import MatrixMixer, ScheduleMixer
from cdsgd.executor import Simulator


def dense(W):
    return W.toarray() if hasattr(W, "toarray") else np.asarray(W)


@pytest.mark.parametrize("n", [5, 8, 12, 40])
def test_one_peer_exponential_pairs_each_agent_with_i_plus_two_to_the_k(n):
    s = topologies.schedule("one_peer_exponential", n)
    tau = math.ceil(math.log2(n))
    assert len(s) == tau
    for k in range(2 * tau):  # k taken modulo the period
        W = dense(s[k])
        want = np.eye(n) / 2
        for i in range(n):
            want[i, (i + 2 ** (k % tau)) % n] += 0.5
        np.testing.assert_array_equal(W, want)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_one_peer_exponential_is_the_exact_average_after_log2_n_steps_for_powers_of_two(n):
    s = topologies.schedule("one_peer_exponential", n)
    np.testing.assert_allclose(s.product(), np.full((n, n), 1.0 / n), rtol=0, atol=1e-15)
    assert s.consensus_rate() < 1e-12 and topologies.spectral_gap(s).gap == pytest.approx(1.0)


@pytest.mark.parametrize("n", [6, 12, 40])
def test_one_peer_exponential_is_not_exact_otherwise_and_says_by_how_much(n):
    s = topologies.schedule("one_peer_exponential", n)
    M = s.product()
    rate = np.linalg.norm(M - 1.0 / n, 2)
    assert rate > 0.05
    assert s.consensus_rate() == pytest.approx(rate, rel=1e-12)
    gap = topologies.spectral_gap(s)
    assert gap.lambda2 == pytest.approx(rate ** (1 / len(s)), rel=1e-12) and gap.gap == pytest.approx(1 - gap.lambda2)


def test_the_sparse_rate_agrees_with_the_dense_one():
    s = topologies.schedule("one_peer_exponential", 600)  # above SPARSE_EIGEN_FROM: a matrix-free SVD
    assert s.sparse
    assert s.consensus_rate() == pytest.approx(np.linalg.norm(s.product() - 1 / 600, 2), rel=1e-6)


@pytest.mark.parametrize("n", [6, 7])
def test_random_matching_is_a_seeded_symmetric_matching_per_step(n):
    s = topologies.schedule("random_matching", n, seed=3, period=10)
    again = topologies.schedule("random_matching", n, seed=3, period=10)
    other = topologies.schedule("random_matching", n, seed=4, period=10)
    assert len(s) == 10 and s.symmetric
    assert any(not np.array_equal(dense(s[k]), dense(other[k])) for k in range(10))
    for k in range(10):
        W = dense(s[k])
        np.testing.assert_array_equal(W, dense(again[k]))
        np.testing.assert_allclose(W.sum(axis=0), 1) and np.testing.assert_allclose(W.sum(axis=1), 1)
        off = W - np.diag(np.diag(W))
        assert sorted((off > 0).sum(axis=1).tolist()) == [0] * (n % 2) + [1] * (n - n % 2)  # one peer, or none
        assert set(np.round(W[W > 0], 12).tolist()) <= {0.5, 1.0}


@pytest.mark.parametrize("call,pattern", [
    (lambda: topologies.schedule("one_peer_exponential", 8, seed=1), "takes no parameter 'seed'; allowed: none"),
    (lambda: topologies.schedule("random_matching", 8, peroid=3), "takes no parameter 'peroid'; allowed: seed, period"),
    (lambda: topologies.schedule("random_matching", 1), "needs n >= 2 agents, got 1"),
    (lambda: topologies.schedule("random_matching", 8, period=0), "period must be an integer >= 1, got 0"),
    (lambda: topologies.schedule("random_matching", 8, seed=-1), "seed must be an integer >= 0, got -1"),
    (lambda: topologies.schedule("random_matching", 6, period=1), "over its period of 1: graph is not connected"),
    (lambda: topologies.schedule("one_peer", 8), "schedule 'one_peer' is unknown"),
])
def test_bad_schedules_are_refused_by_name(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_the_schedule_mixer_mixes_with_w_k_at_step_k_and_counts_one_peer():
    s = topologies.schedule("one_peer_exponential", 8)
    mixer = ScheduleMixer(s, lambda W: MatrixMixer(W, validate=False))
    X = torch.randn(8, 5, dtype=torch.float64)
    for k in range(7):
        np.testing.assert_allclose(mixer.at(k).mix(X).numpy(), dense(s[k]) @ X.numpy(), rtol=0, atol=1e-15)
    assert mixer.bytes_sent.tolist() == [7 * 5 * 8] * 8  # one neighbour per step, shared over the period
    # without a step, start/mix apply W_0, W_1, ... in turn (the t-th call W_t)
    for t in range(4):
        np.testing.assert_allclose(mixer.start(X).wait().numpy(), dense(s[t % len(s)]) @ X.numpy(), atol=1e-15)


def test_a_whole_schedule_handed_to_update_mixes_with_w_k():
    """alg.update(..., k=k, mixer=schedule_mixer) uses W_k, not the mixer's own call counter."""
    from cdsgd.algorithms import make_algorithm

    s = topologies.schedule("one_peer_exponential", 8)
    mixer = ScheduleMixer(s, lambda W: MatrixMixer(W, validate=False))
    alg = make_algorithm("cdsgd", lr=0.1)
    X0 = torch.randn(8, 3, dtype=torch.float64)
    G = torch.zeros_like(X0)
    for k in (5, 1, 1):
        np.testing.assert_allclose(alg.update(X0.clone(), G, {}, k=k, mixer=mixer).numpy(),
                                   dense(s[k % len(s)]) @ X0.numpy(), atol=1e-15)


def test_simulator_steps_through_the_schedule():
    """cdsgd with a time-varying W_k equals x ← W_k x − α g(x) written out by hand (full-shard batches)."""
    s = topologies.schedule("random_matching", 6, seed=1, period=5)
    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,), generator=g))
              for _ in range(6)]
    sim = Simulator(lambda: nn.Linear(3, 2).double(), shards, s, "cdsgd", lr=0.1, batch_size=8, exact=True)
    model, layout = sim.models[0], sim.layout

    def loss(p, x, y):
        return nn.functional.cross_entropy(torch.func.functional_call(model, layout.views(p), (x,)), y)

    X = sim.X.clone()
    for k in range(7):
        G = torch.stack([torch.func.grad(loss)(X[j], *shards[j]) for j in range(6)])
        X = torch.tensor(dense(s[k])) @ X - 0.1 * G
        sim.step()
        torch.testing.assert_close(sim.X, X, rtol=0, atol=1e-12)


def test_d2_refuses_a_schedule():
    s = topologies.schedule("one_peer_exponential", 8)
    with pytest.raises(ValueError, match="'d2' needs one fixed symmetric mixing matrix, not a time-varying"):
        make_algorithm("d2", lr=0.1).check_mixing(s)


def test_cdsgd_topo_describes_a_schedule():
    r = subprocess.run([sys.executable, "-m", "cdsgd", "topo", "one_peer_exponential", "--n", "8", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["period"] == 3 and info["schedule"] and not info["symmetric"]
    assert len(info["matrices"]) == 3 and np.allclose(info["product"], 1 / 8) and info["consensus_rate"] < 1e-12
    r = subprocess.run([sys.executable, "-m", "cdsgd", "topo", "random_matching", "--n", "6", "-p", "period=4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "period          4 steps" in r.stdout and "W_3" in r.stdout and "product over a period" in r.stdout
