"""The effective number of neighbours (Vogels et al. 2022) against closed forms and a brute-force covariance."""

from __future__ import annotations

import numpy as np
import pytest

import topologies


def brute_force(mats, gamma, periods=None):
    """Iterate Σ ← W_k (γ Σ + I) W_kᵀ (the covariance of x ← W_k(√γ x + ξ)) until it settles; end of a period."""
    n = mats[0].shape[0]
    sigma = np.zeros((n, n))
    T = len(mats)
    periods = periods or int(np.ceil(60 / (T * (1 - gamma)))) + 1  # γ^(steps) far below 1e-12
    for _ in range(periods):
        for W in mats:
            sigma = W @ (gamma * sigma + np.eye(n)) @ W.T
    return (1 / (1 - gamma)) / np.mean(np.diag(sigma))


def dense(W):
    return W.toarray() if hasattr(W, "toarray") else np.asarray(W)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99])
def test_isolated_agents_have_one_and_the_complete_graph_has_n(gamma):
    assert topologies.effective_neighbours(np.eye(7), gamma) == pytest.approx(1.0, rel=1e-12)
    assert topologies.effective_neighbours(np.full((7, 7), 1 / 7), gamma) == pytest.approx(7.0, rel=1e-12)


@pytest.mark.parametrize("name", ["ring", "torus", "star", "exponential"])
def test_at_zero_decay_it_is_n_over_the_squared_frobenius_norm(name):
    W = topologies.mixing_matrix(topologies.build(name, 16))
    assert topologies.effective_neighbours(W, 0.0) == pytest.approx(16 / (W ** 2).sum(), rel=1e-12)


@pytest.mark.parametrize("name,gamma", [("ring", 0.9), ("star", 0.5), ("erdos_renyi", 0.95), ("torus", 0.99)])
def test_static_graphs_match_the_brute_force_covariance(name, gamma):
    W = topologies.mixing_matrix(topologies.build(name, 12))
    assert topologies.effective_neighbours(W, gamma) == pytest.approx(brute_force([W], gamma), rel=1e-9)


@pytest.mark.parametrize("n,gamma", [(16, 0.9), (12, 0.5), (8, 0.99)])
def test_schedules_match_the_brute_force_covariance(n, gamma):
    s = topologies.schedule("one_peer_exponential", n)
    assert topologies.effective_neighbours(s, gamma) == pytest.approx(brute_force([dense(W) for W in s], gamma),
                                                                     rel=1e-9)


def test_a_non_symmetric_static_matrix_goes_through_the_lyapunov_equation():
    W = dense(topologies.schedule("one_peer_exponential", 8)[0])  # doubly stochastic, not symmetric
    assert topologies.effective_neighbours(W, 0.8) == pytest.approx(brute_force([W], 0.8), rel=1e-9)


def test_the_ring_and_the_one_peer_exponential_graph_reference_values():
    """Values published with the paper's code for n = 16 (ring with weights 1/3; one-peer exponential)."""
    ring = topologies.mixing_matrix(topologies.build("ring", 16))
    s = topologies.schedule("one_peer_exponential", 16)
    assert [round(topologies.effective_neighbours(ring, g), 3) for g in (0.5, 0.9)] == [3.720, 6.601]
    assert [round(topologies.effective_neighbours(s, g), 3) for g in (0.5, 0.9)] == [2.977, 7.801]


def test_it_ranks_where_the_spectral_gap_does_not():
    """At γ = 0.9 the one-peer exponential schedule (1 neighbour per step) beats the static ring (2), while the
    ring's spectral gap says nothing about memory: the ranking changes with γ (2.98 < 3.72 at γ = 0.5)."""
    ring = topologies.mixing_matrix(topologies.build("ring", 16))
    s = topologies.schedule("one_peer_exponential", 16)
    assert topologies.effective_neighbours(s, 0.5) < topologies.effective_neighbours(ring, 0.5)
    assert topologies.effective_neighbours(s, 0.9) > topologies.effective_neighbours(ring, 0.9)


def test_bad_decay_and_too_many_agents():
    W = topologies.mixing_matrix(topologies.build("ring", 6))
    with pytest.raises(ValueError, match=r"decay gamma must be in \[0, 1\), got 1.0"):
        topologies.effective_neighbours(W, 1.0)
    big = topologies.mixing_matrix(topologies.build("ring", topologies.spectral.EFFECTIVE_NEIGHBOURS_UP_TO + 1),
                                   sparse=True)
    assert np.isnan(topologies.effective_neighbours(big))
