"""Push-sum (SGP) on directed graphs: weights, the recurrence, what is preserved, and where it converges."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.mixers import MatrixMixer

N, P_DIM = 5, 3
RNG = np.random.default_rng(11)
A = RNG.uniform(0.5, 2.0, size=(N, P_DIM))
B = RNG.normal(0.0, 3.0, size=(N, P_DIM))
X_STAR = (A * B).sum(axis=0) / A.sum(axis=0)


def irregular_digraph():
    """Strongly connected, out-degrees 1..3: push-sum weights that are column- but not row-stochastic."""
    G = nx.DiGraph()
    G.add_nodes_from(range(N))
    G.add_edges_from([(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 2), (0, 3), (2, 0)])
    return G


PUSH = topologies.mixing_matrix(irregular_digraph(), "push_sum")


def test_push_sum_weights_split_each_agents_value_among_itself_and_its_out_neighbours():
    G = irregular_digraph()
    for i in range(N):
        share = 1 / (1 + G.out_degree(i))
        targets = {i, *G.successors(i)}
        np.testing.assert_allclose(PUSH[:, i], [share if j in targets else 0.0 for j in range(N)])
    np.testing.assert_allclose(PUSH.sum(axis=0), 1)
    assert np.abs(PUSH.sum(axis=1) - 1).max() > 0.1  # rows do not sum to 1: push-sum needs its weights


@pytest.mark.parametrize("n", [5, 8, 600])
def test_directed_ring_gap_is_one_minus_cos_pi_over_n(n):
    P = topologies.mixing_matrix(topologies.build("directed_ring", n), "push_sum", sparse=n > 32)
    assert topologies.spectral_gap(P).lambda2 == pytest.approx(np.cos(np.pi / n), rel=1e-9)


def test_directed_graphs_need_the_push_sum_rule_and_strong_connectivity():
    with pytest.raises(ValueError, match="graph is directed.*mixing=push_sum with algorithm=sgp"):
        topologies.mixing_matrix(topologies.build("directed_ring", 4), "metropolis")
    chain = nx.DiGraph([(0, 1), (1, 2), (2, 3)])
    with pytest.raises(ValueError, match="graph is not strongly connected"):
        topologies.mixing_matrix(chain, "push_sum")


def grad(Z):
    return A * (Z - B)


def reference(steps, lr, momentum, nesterov, Z0):
    """x = z·w − α d(g(z)); x ← P x; w ← P w; z = x / w (numpy, float64)."""
    Z, w, m = Z0.copy(), np.ones((N, 1)), np.zeros_like(Z0)
    for _ in range(steps):
        g = grad(Z)
        if momentum:
            m = momentum * m + g
            d = g + momentum * m if nesterov else m
        else:
            d = g
        x = PUSH @ (Z * w - lr * d)
        w = PUSH @ w
        Z = x / w
    return Z, w


@pytest.mark.parametrize("momentum,nesterov", [(0.0, True), (0.5, True), (0.5, False)])
def test_sgp_follows_the_push_sum_recurrence(momentum, nesterov):
    alg = make_algorithm("sgp", lr=0.05, momentum=momentum, nesterov=nesterov)
    alg.check_mixing(PUSH)
    Z0 = RNG.normal(size=(N, P_DIM))
    X = torch.tensor(Z0)
    mixer, state = MatrixMixer(PUSH, validate=False), alg.init_state(X)
    for k in range(15):
        alg.update(X, torch.tensor(grad(X.numpy())), state, k=k, mixer=mixer)
    Z, w = reference(15, 0.05, momentum, nesterov, Z0)
    np.testing.assert_allclose(X.numpy(), Z, rtol=0, atol=1e-12)
    np.testing.assert_allclose(state["weight"].numpy(), w, rtol=0, atol=1e-12)
    assert state["weight"].sum().item() == pytest.approx(N, abs=1e-12)  # Σ w is preserved


def test_sgp_keeps_the_numerators_sum_as_centralized_sgd_would():
    """Column-stochastic mixing preserves Σ_j x_j: it moves by −α Σ_j g_j(z_j) each step."""
    alg = make_algorithm("sgp", lr=0.05, momentum=0.0)
    X = torch.tensor(RNG.normal(size=(N, P_DIM)))
    mixer, state = MatrixMixer(PUSH, validate=False), alg.init_state(X)
    for k in range(10):
        before = (X * state["weight"]).sum(0)
        G = torch.tensor(grad(X.numpy()))
        alg.update(X, G, state, k=k, mixer=mixer)
        torch.testing.assert_close((X * state["weight"]).sum(0), before - 0.05 * G.sum(0), rtol=0, atol=1e-12)


def test_sgp_with_a_diminishing_step_approaches_the_optimum_on_a_directed_graph():
    """Exact gradients, α_k = 0.3/(1 + k/50): every agent's z_j closes in on argmin Σ f_j (error shrinking with k)."""
    alg = make_algorithm("sgp", lr=0.3, momentum=0.0, lr_schedule="diminishing", lr_tau=50.0)
    X = torch.zeros(N, P_DIM, dtype=torch.float64)
    mixer, state = MatrixMixer(PUSH, validate=False), alg.init_state(X)
    errors = []
    for k in range(16000):
        alg.update(X, torch.tensor(grad(X.numpy())), state, k=k, mixer=mixer)
        if k + 1 in (1000, 4000, 16000):
            errors.append(float(np.abs(X.numpy() - X_STAR).max()))
    assert errors[0] > 2.5 * errors[1] > 6 * errors[2] and errors[2] < 1e-2, errors


def test_other_rules_refuse_a_column_only_stochastic_matrix():
    with pytest.raises(ValueError, match=r"'cdsgd' needs a doubly stochastic mixing matrix, but row 0 sums to .*"
                                         r"mixing=push_sum.*algorithm=sgp"):
        make_algorithm("cdsgd", lr=0.1).check_mixing(PUSH)
    with pytest.raises(ValueError, match="'d2' needs a doubly stochastic"):
        make_algorithm("d2", lr=0.1).check_mixing(PUSH)
    ring = topologies.mixing_matrix(topologies.build("directed_exponential", 8), "push_sum")  # doubly stochastic
    with pytest.raises(ValueError, match="'d2' needs a symmetric mixing matrix"):
        make_algorithm("d2", lr=0.1).check_mixing(ring)
    make_algorithm("cdsgd", lr=0.1).check_mixing(ring)  # doubly stochastic, not symmetric: fine for D-PSGD


def test_push_sum_with_zero_gradients_reaches_the_exact_average():
    """Numerators and weights mix with the same column-stochastic P: z_j → (1/N) Σ_l z_l(0), to float64."""
    alg = make_algorithm("sgp", lr=0.1, momentum=0.0)
    Z0 = RNG.normal(size=(N, P_DIM))
    X = torch.tensor(Z0)
    mixer, state = MatrixMixer(PUSH, validate=False), alg.init_state(X)
    for k in range(300):
        alg.update(X, torch.zeros_like(X), state, k=k, mixer=mixer)
    np.testing.assert_allclose(X.numpy(), np.broadcast_to(Z0.mean(axis=0), X.shape), rtol=0, atol=1e-12)


def test_sgp_refuses_a_matrix_that_is_not_column_stochastic():
    rows_only = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])  # rows sum to 1, columns do not
    with pytest.raises(ValueError, match=r"mixing matrix column 0 sums to 1\.5, not 1"):
        make_algorithm("sgp", lr=0.1).check_mixing(rows_only)
    with pytest.raises(ValueError, match="'sgp' takes one mixing matrix.*not a time-varying schedule"):
        make_algorithm("sgp", lr=0.1).check_mixing(topologies.schedule("one_peer_exponential", 4))


def test_sgp_counts_a_vector_and_its_weight_per_out_neighbour():
    from torch import nn

    from cdsgd.executor import Simulator

    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g)) for _ in range(N)]
    sim = Simulator(lambda: nn.Linear(4, 2), shards, PUSH, "sgp", lr=0.05, batch_size=4, momentum=0.5)
    sim.run(steps=3)
    out_degree = np.array([d for _, d in sorted(irregular_digraph().out_degree())])
    # row j of P has j's in-neighbours: MatrixMixer counts what agent j receives per row, i.e. its in-degree
    in_degree = (PUSH != 0).sum(axis=1) - 1
    assert sim.mixer.bytes_sent.tolist() == (in_degree * (sim.layout.numel + 1) * 4 * 3).tolist()
    assert out_degree.sum() == in_degree.sum()


def test_schedules_take_no_mixing_rule(tmp_path, capsys):
    from cdsgd import cli

    out = tmp_path / "never"
    assert cli.main(["run", "topology=one_peer_exponential", "n_agents=4", "mixing=lazy_metropolis",
                     f"out={out}"]) == 2
    assert "mixing='lazy_metropolis' does not apply to it" in capsys.readouterr().err and not out.exists()
