"""CHOCO-SGD and RelaySum against naive per-agent transcriptions of their papers, closed forms, and the runtime."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.algorithms.compression import make_compressor
from cdsgd.base.seeding import derive_seed
from cdsgd.mixers import MatrixMixer

N, P = 6, 40


def _quadratic(n=N, p=P, seed=0):
    """f_j(x) = ½‖x − b_j‖²: the gradient at X is X − B; the optimum of the sum is mean(b)."""
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(alg, W, B, X0, steps):
    mixer = MatrixMixer(W)
    alg.bind(n_agents=len(B), steps_per_epoch=1, seed=7)
    X = X0.clone()
    state = alg.init_state(X, mixer=mixer)
    for k in range(steps):
        alg.update(X, X - B, state, k=k, mixer=mixer)
    return X


# ---------------------------------------------------------------- CHOCO


def _send_compressed(compressor, copies, targets, purpose, k, seed):
    """Every agent j sends q_j = C(target_j − its own copy x̂_j) (seeded by (seed, purpose, j, k)); every agent
    holding a copy of j (j's neighbours and j itself) adds the q_j it receives to it."""
    q = [compressor.compress((targets[j] - copies[j][j])[None], [derive_seed(seed, purpose, j, k)])[0]
         for j in range(len(targets))]
    for held in copies:
        for j in held:
            held[j] = held[j] + q[j]


def _choco_naive(W, B, X0, steps, lr, gamma, compressor, seed=7):
    """ICLR 2020's Algorithm (no momentum), as written: agent i keeps a copy x̂_j of every neighbour j
    (and of itself), updated from the q_j it receives; x_i += γ Σ_j w_ij (x̂_j − x̂_i)."""
    n = len(B)
    W = np.asarray(W)
    x = [X0[i].clone() for i in range(n)]
    copies = [{j: torch.zeros(X0.shape[1], dtype=X0.dtype) for j in range(n) if W[i, j] != 0} for i in range(n)]
    for k in range(steps):
        half = [x[i] - lr * (x[i] - B[i]) for i in range(n)]
        _send_compressed(compressor, copies, half, "compression", k, seed)
        for i in range(n):
            x[i] = half[i] + gamma * sum(W[i, j] * (copies[i][j] - copies[i][i]) for j in copies[i])
    return torch.stack(x)


@pytest.mark.parametrize("name,params", [("none", {}), ("top_k", {"ratio": 0.1}), ("random_k", {"ratio": 0.2}),
                                         ("sign", {}), ("qsgd", {"levels": 4})])
def test_choco_matches_the_papers_algorithm_agent_by_agent(name, params):
    W = topologies.mixing_matrix(topologies.build("erdos_renyi", N, p=0.5, seed=2))
    B, X0 = _quadratic(), _quadratic(seed=1)
    alg = make_algorithm("choco", lr=0.1, momentum=0.0, compression=name, compression_params=params,
                         consensus_step=0.3)
    got = _run(alg, W, B, X0, 25)
    want = _choco_naive(W, B, X0, 25, 0.1, 0.3, make_compressor(name, params))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_choco_uncompressed_with_unit_step_is_dpsgd():
    """C = identity, γ = 1: x̂ = x^{k+½}, so x ← W (x − α g) (adapt then combine), in closed form."""
    W = topologies.mixing_matrix(topologies.build("ring", N))
    B, X0 = _quadratic(), _quadratic(seed=1)
    got = _run(make_algorithm("choco", lr=0.2, momentum=0.0, consensus_step=1.0), W, B, X0, 30)
    X, Wt = X0.clone(), torch.as_tensor(W)
    for _ in range(30):
        X = Wt @ (X - 0.2 * (X - B))
    torch.testing.assert_close(got, X, rtol=0, atol=1e-12)


def test_choco_with_top_k_reaches_the_fixed_point_in_closed_form():
    """At a fixed point q = 0, so x̂ = x^{k+½} and x = W_γ x^{k+½} with W_γ = (1 − γ)I + γW: D-PSGD's
    (adapt then combine) fixed point for W_γ, x = (I − (1 − α)W_γ)⁻¹ α W_γ b, whatever the compressor."""
    W = topologies.mixing_matrix(topologies.build("ring", N))
    B = _quadratic()
    lr, gamma = 0.05, 0.5
    alg = make_algorithm("choco", lr=lr, momentum=0.0, compression="top_k", compression_params={"ratio": 0.25},
                         consensus_step=gamma)
    X = _run(alg, W, B, torch.zeros(N, P, dtype=torch.float64), 3000)
    Wg = (1 - gamma) * np.eye(N) + gamma * W
    fixed = np.linalg.solve(np.eye(N) - (1 - lr) * Wg, lr * Wg @ B.numpy())
    np.testing.assert_allclose(X.numpy(), fixed, rtol=0, atol=1e-9)


def test_consensus_step_auto_tunes_and_says_so():
    W = topologies.mixing_matrix(topologies.build("ring", 8))
    alg = make_algorithm("choco", lr=0.1, compression="top_k", compression_params={"ratio": 0.05})
    alg.bind(n_agents=8, steps_per_epoch=1, seed=0)
    lines = alg.prepare(MatrixMixer(W), torch.zeros(8, 200))
    best = min(alg.tuning.values())
    assert alg.tuning[alg.gamma] <= 1.5 * best  # the largest γ within TUNE_SLACK of the best score
    assert all(alg.tuning[g] > 1.5 * best for g in alg.tuning if g > alg.gamma)
    assert f"γ = {alg.gamma:g}" in lines[0]
    # compressing harder needs a smaller step: top_k 5 % picks a smaller γ than no compression
    plain = make_algorithm("choco", lr=0.1)
    plain.bind(n_agents=8, steps_per_epoch=1, seed=0)
    plain.prepare(MatrixMixer(W), torch.zeros(8, 200))
    assert plain.gamma == 1.0 and alg.gamma < plain.gamma
    assert alg.summary() == {"consensus_step_used": alg.gamma, "consensus_step_auto": True}


@pytest.mark.parametrize("bad,match", [
    ({"consensus_step": 0.0}, r"consensus_step must be a number in \(0, 1\] or \"auto\", got 0.0"),
    ({"consensus_step": "fast"}, "got 'fast'"),
    ({"compression": "topk"}, "top_k"),
    ({"compression": "top_k", "compression_params": {"ratio": 1.5}}, "1.5"),
])
def test_choco_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        make_algorithm("choco", lr=0.1, **bad)


def _beer_naive(W, B, X0, steps, lr, gamma, compressor, seed=7):
    """BEER (Zhao et al. 2022, Algorithm 1) agent by agent: every agent keeps copies h_j, g_j of each neighbour's
    public vectors, updated from the two compressed messages it receives per step."""
    n = len(B)
    W = np.asarray(W)
    nb = [[j for j in range(n) if W[i, j] != 0] for i in range(n)]
    zero = torch.zeros(X0.shape[1], dtype=X0.dtype)
    h = [{j: zero.clone() for j in nb[i]} for i in range(n)]
    g = [{j: zero.clone() for j in nb[i]} for i in range(n)]
    x, v, prev = [X0[i].clone() for i in range(n)], [zero.clone() for _ in range(n)], [zero.clone() for _ in range(n)]
    for k in range(steps):
        grad = [x[i] - B[i] for i in range(n)]
        v = [v[i] + gamma * sum(W[i, j] * (g[i][j] - g[i][i]) for j in nb[i]) + grad[i] - prev[i] for i in range(n)]
        prev = grad
        _send_compressed(compressor, g, v, "compression-tracker", k, seed)
        x = [x[i] + gamma * sum(W[i, j] * (h[i][j] - h[i][i]) for j in nb[i]) - lr * v[i] for i in range(n)]
        _send_compressed(compressor, h, x, "compression", k, seed)
    return torch.stack(x)


@pytest.mark.parametrize("name,params", [("none", {}), ("top_k", {"ratio": 0.2}), ("qsgd", {"levels": 8})])
def test_beer_matches_the_papers_algorithm_agent_by_agent(name, params):
    W = topologies.mixing_matrix(topologies.build("erdos_renyi", N, p=0.5, seed=2))
    B, X0 = _quadratic(), _quadratic(seed=1)
    alg = make_algorithm("beer", lr=0.1, momentum=0.0, compression=name, compression_params=params,
                         consensus_step=0.3)
    got = _run(alg, W, B, X0, 20)
    torch.testing.assert_close(got, _beer_naive(W, B, X0, 20, 0.1, 0.3, make_compressor(name, params)),
                               rtol=0, atol=1e-12)


def test_beer_with_top_k_reaches_the_exact_optimum_where_choco_stays_biased():
    """Gradient tracking removes the heterogeneity bias: BEER's agents all reach mean(b); CHOCO's stay apart."""
    W = topologies.mixing_matrix(topologies.build("ring", N))
    B = _quadratic(p=10)
    hyper = dict(lr=0.1, momentum=0.0, compression="top_k", compression_params={"ratio": 0.3}, consensus_step=0.5)
    beer = _run(make_algorithm("beer", **hyper), W, B, torch.zeros(N, 10, dtype=torch.float64), 600)
    torch.testing.assert_close(beer, B.mean(0).expand(N, 10), rtol=0, atol=1e-10)
    choco = _run(make_algorithm("choco", **hyper), W, B, torch.zeros(N, 10, dtype=torch.float64), 600)
    assert float((choco - B.mean(0)).abs().max()) > 0.01


# ---------------------------------------------------------------- RelaySum


def _relaysum_naive(tree, B, X0, steps, lr, lost=None):
    """RelaySGD (Algorithm 1 of Vogels et al. 2021, the model variant), message by message on a dict of edges.

    ``lost(k)``: the directed edges (sender, receiver) whose step-k message is lost; such a message arrives
    empty (no value, a count of 0) and is relayed no further, and the agents not heard from are then filled
    with the agent's latest model instead of x^0 (the reference code's dropped-message runs)."""
    n = len(B)
    nb = {i: sorted(tree.neighbors(i)) for i in range(n)}
    m = {(i, j): torch.zeros(X0.shape[1], dtype=X0.dtype) for i in nb for j in nb[i]}
    c = {e: 0 for e in m}
    x = [X0[i].clone() for i in range(n)]
    for k in range(steps):
        half = [x[i] - lr * (x[i] - B[i]) for i in range(n)]
        gone = lost(k) if lost else set()
        new_m = {(i, j): torch.zeros_like(half[i]) if (i, j) in gone else
                 half[i] + sum((m[(l, i)] for l in nb[i] if l != j), torch.zeros_like(half[i])) for (i, j) in m}
        new_c = {(i, j): 0 if (i, j) in gone else 1 + sum(c[(l, i)] for l in nb[i] if l != j) for (i, j) in m}
        m, c = new_m, new_c
        for i in range(n):
            count = 1 + sum(c[(j, i)] for j in nb[i])
            fallback = x[i] if lost else X0[i]
            x[i] = (half[i] + sum(m[(j, i)] for j in nb[i]) + (n - count) * fallback) / n
    return torch.stack(x)


@pytest.mark.parametrize("graph", ["path", "star", "torus_tree"])
def test_relaysum_matches_the_papers_algorithm_message_by_message(graph):
    T = (topologies.spanning_tree(topologies.build("torus", 9)) if graph == "torus_tree"
         else topologies.build(graph, N))
    n = T.number_of_nodes()
    W = topologies.mixing_matrix(T)
    B, X0 = _quadratic(n), _quadratic(n, seed=1)
    got = _run(make_algorithm("relaysum", lr=0.1, momentum=0.0), W, B, X0, 20)
    torch.testing.assert_close(got, _relaysum_naive(T, B, X0, 20, 0.1), rtol=0, atol=1e-12)


def test_relaysum_reaches_the_exact_optimum_on_heterogeneous_quadratics():
    """At a fixed point every agent averages every half-step x* − α(x* − b_l): consensus at mean(b), no bias."""
    T = topologies.build("path", N)
    B = _quadratic()
    X = _run(make_algorithm("relaysum", lr=0.2, momentum=0.0), topologies.mixing_matrix(T), B,
             torch.zeros(N, P, dtype=torch.float64), 300)
    torch.testing.assert_close(X, B.mean(0).expand(N, P), rtol=0, atol=1e-10)


def test_relaysum_refuses_a_graph_with_a_cycle():
    with pytest.raises(ValueError, match="spanning tree"):
        _run(make_algorithm("relaysum", lr=0.1), topologies.mixing_matrix(topologies.build("ring", N)),
             _quadratic(), _quadratic(), 1)


def test_spanning_tree_keeps_a_tree_and_builds_a_shallow_one():
    path = topologies.build("path", 7)
    assert sorted(topologies.spanning_tree(path).edges()) == sorted(path.edges())
    G = topologies.build("torus", 16)
    T = topologies.spanning_tree(G)
    assert topologies.is_tree(T) and set(T.edges()) <= {tuple(sorted(e)) for e in G.edges()} | set(G.edges())
    import networkx as nx
    assert nx.diameter(T) <= 2 * nx.radius(G)


def test_run_config_refuses_what_the_rules_cannot_use_and_notes_what_they_ignore():
    from cdsgd.config import load_config
    from cdsgd.run.plan import validate_config

    with pytest.raises(ValueError, match=r"compression='top_k' needs an algorithm that sends compressed messages "
                                         r"\(choco, beer, diloco\); algorithm='cdmsgd' sends full vectors"):
        validate_config(load_config(overrides=["compression=top_k"]))
    with pytest.raises(ValueError, match="compression_params"):
        validate_config(load_config(overrides=["compression_params.ratio=0.1"]))
    with pytest.raises(ValueError, match="time-varying"):
        validate_config(load_config(overrides=["algorithm=relaysum", "topology=one_peer_exponential", "n_agents=8"]))
    plan = validate_config(load_config(overrides=["algorithm=relaysum", "topology=ring", "n_agents=6",
                                                  "mixing=max_degree"]))
    assert topologies.is_tree(plan.graph) and plan.graph.number_of_edges() == 5
    assert any("mixing='max_degree' has no effect" in note for note in plan.notes)
    plan = validate_config(load_config(overrides=["algorithm=cdmsgd", "consensus_step=0.5"]))
    assert any("consensus_step=0.5 has no effect" in note for note in plan.notes)
