"""The executor's public state: the N×P parameter stack ``X`` and push-sum's de-biasing weights."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import SGPAlgorithm, make_algorithm
from cdsgd.executor import Executor, Simulator
from cdsgd.mixers import MatrixMixer

N = 5
# out-degrees 2, 1, 1, 1, 1: push-sum's P is column- but not row-stochastic, so the weights move
DIGRAPH = nx.DiGraph([(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 2)])
P = topologies.mixing_matrix(DIGRAPH, "push_sum")


def shards(n=N, m=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, 3, generator=g), torch.randint(0, 2, (m,), generator=g)) for _ in range(n)]


def test_push_sum_weights_are_p_to_the_k_times_ones():
    """w^k = P^k 1 (the weights are mixed like the numerators, from w = 1), whatever the gradients."""
    sim = Simulator(lambda: nn.Linear(3, 2), shards(), P, "sgp", lr=0.1, momentum=0.5, batch_size=4)
    np.testing.assert_array_equal(sim.push_sum_weights.numpy(), np.ones(N))
    for k in range(1, 7):
        sim.step()
        expected = np.linalg.matrix_power(P, k) @ np.ones(N)
        np.testing.assert_allclose(sim.push_sum_weights.numpy(), expected, rtol=0, atol=1e-6)
        assert float(sim.push_sum_weights.sum()) == pytest.approx(N, abs=1e-5)  # Σ_j w_j = N
    assert np.abs(expected - 1).max() > 0.05  # an irregular digraph: the weights really moved


def test_push_sum_weights_are_a_copy_and_none_for_other_rules():
    sim = Simulator(lambda: nn.Linear(3, 2), shards(), P, "sgp", lr=0.1, batch_size=4)
    sim.step()
    w = sim.push_sum_weights
    w.fill_(7.0)  # the caller's tensor: the run is untouched
    assert not torch.equal(sim.push_sum_weights, w)
    ring = topologies.mixing_matrix(topologies.build("ring", N))
    assert Simulator(lambda: nn.Linear(3, 2), shards(), ring, "cdsgd", lr=0.1, batch_size=4).push_sum_weights is None


def test_sgp_weights_of_a_state_and_the_numerators_they_de_bias():
    """SGPAlgorithm.weights(state) on the stack: Σ_j z_j·w_j moves as centralized SGD's sum (−α Σ_j g_j)."""
    alg = make_algorithm("sgp", lr=0.05, momentum=0.0)  # Σ_j x_j moves by −α Σ_j g_j (momentum: by −α Σ_j d_j)
    X = torch.tensor(np.random.default_rng(0).normal(size=(N, 3)))
    state, mixer = alg.init_state(X), MatrixMixer(P, validate=False)
    for k in range(5):
        before = (X * alg.weights(state)[:, None]).sum(0)
        G = X - 1.0
        alg.update(X, G, state, k=k, mixer=mixer)
        torch.testing.assert_close((X * alg.weights(state)[:, None]).sum(0), before - 0.05 * G.sum(0),
                                   rtol=0, atol=1e-12)
    np.testing.assert_allclose(SGPAlgorithm.weights(state).numpy(), np.linalg.matrix_power(P, 5) @ np.ones(N),
                               rtol=0, atol=1e-12)


def test_x_is_the_documented_stack_of_the_agents_flat_parameters():
    """X is L×P, row i is agent agents[i]'s parameters in layout order; the docs name it on the class."""
    data = shards()
    ring = topologies.mixing_matrix(topologies.build("ring", N))
    sim = Executor.build(lambda: nn.Linear(3, 2), data, ring, "cdsgd", lr=0.1, batch_size=8, init="independent",
                   strategy="loop")
    X0 = sim.X.clone()
    sim.step()
    # one CDSGD step by hand from X0: x_j ← Σ_l π_jl x_l − α ∇f_j(x_j) on agent j's (only) batch
    expected = torch.as_tensor(ring, dtype=X0.dtype) @ X0
    for j in range(N):
        model = nn.Linear(3, 2)
        sim.layout.load_into(model, X0[j])
        loss = nn.functional.cross_entropy(model(data[j][0]), data[j][1])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        expected[j] -= 0.1 * torch.cat([g.reshape(-1) for g in grads])
    torch.testing.assert_close(sim.X, expected, rtol=0, atol=1e-6)
    assert sim.layout.views(sim.X[2])["weight"].shape == (2, 3)
    doc = Executor.__doc__
    assert "X: the L×P stack of the held agents" in doc and "push_sum_weights" in doc
