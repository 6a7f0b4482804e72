"""Gradient tracking, D² and quasi-global momentum against independent recurrences and closed-form optima."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.mixers import MatrixMixer
from cdsgd.executor import Simulator

N, P = 5, 3
RNG = np.random.default_rng(7)
A = RNG.uniform(0.5, 2.0, size=(N, P))   # f_j(x) = ½ Σ_p a_jp (x_p − b_jp)²: heterogeneous curvature and optima
B = RNG.normal(0.0, 3.0, size=(N, P))
X_STAR = (A * B).sum(axis=0) / A.sum(axis=0)  # the minimiser of Σ_j f_j
W = topologies.mixing_matrix(topologies.build("ring", N))


def grad(X: np.ndarray) -> np.ndarray:
    return A * (X - B)


def lr_at(k, lr, schedule):
    return lr if schedule == "constant" else lr / (1.0 + k / 4.0)


# ---- the papers' recurrences, written out directly on the N×P matrix (numpy, float64)

def reference(name, steps, *, lr, momentum, nesterov, schedule, X0):
    X = X0.copy()
    m, y, g_prev = np.zeros_like(X), np.zeros_like(X), np.zeros_like(X)
    x_prev, u_prev = X.copy(), np.zeros_like(X)

    def direction(u):
        nonlocal m
        if not momentum:
            return u
        m = momentum * m + u
        return u + momentum * m if nesterov else m

    for k in range(steps):
        a, g = lr_at(k, lr, schedule), grad(X)
        if name == "dsgt":  # y^k = W y^{k-1} + g^k - g^{k-1};  x^{k+1} = W x^k - a d(y^k)
            y = W @ y + g - g_prev
            g_prev = g
            X = W @ X - a * direction(y)
        elif name == "d2":  # x^{k+1} = W(2x^k - x^{k-1} - u^k + u^{k-1}),  u = a d(g)
            u = a * direction(g)
            X, x_prev, u_prev = W @ (2 * X - x_prev - u + u_prev), X, u
        elif name == "qg_dsgdm":  # m~ = b m + g; d = g + b m~; x+ = W(x - a d); m = b m + (1-b)(x - x+)/a
            tilde = momentum * m + g
            d = g + momentum * tilde if nesterov else tilde
            new = W @ (X - a * d)
            m = momentum * m + (1 - momentum) * (X - new) / a
            X = new
    return X


CASES = [("dsgt", 0.0, True, "constant"), ("dsgt", 0.5, True, "diminishing"), ("dsgt", 0.5, False, "constant"),
         ("d2", 0.0, True, "constant"), ("d2", 0.5, True, "diminishing"), ("d2", 0.5, False, "constant"),
         ("qg_dsgdm", 0.9, True, "constant"), ("qg_dsgdm", 0.5, False, "diminishing")]


@pytest.mark.parametrize("name,momentum,nesterov,schedule", CASES)
def test_update_rules_follow_their_papers_recurrences(name, momentum, nesterov, schedule):
    hyper = {"lr": 0.1, "momentum": momentum, "nesterov": nesterov, "lr_schedule": schedule, "lr_tau": 4.0}
    alg = make_algorithm(name, **hyper)
    X0 = RNG.normal(size=(N, P))
    X = torch.tensor(X0)
    mixer = MatrixMixer(W)
    alg.check_mixing(W)
    state = alg.init_state(X)
    for k in range(12):
        G = torch.tensor(grad(X.numpy()))
        mixed = alg.start(X, state, mixer) if alg.mixes_params else None
        alg.update(X, G, state, k=k, mixer=mixer, mixed=mixed)
    want = reference(name, 12, lr=0.1, momentum=momentum, nesterov=nesterov, schedule=schedule, X0=X0)
    np.testing.assert_allclose(X.numpy(), want, rtol=0, atol=1e-12)


def _solve(name, steps=3000, lr=0.1, **hyper):
    alg = make_algorithm(name, lr=lr, **hyper)
    X = torch.zeros(N, P, dtype=torch.float64)
    mixer, state = MatrixMixer(W), alg.init_state(X)
    for k in range(steps):
        G = torch.tensor(grad(X.numpy()))
        alg.update(X, G, state, k=k, mixer=mixer)
    return X.numpy()


@pytest.mark.parametrize("name,hyper", [("dsgt", {"momentum": 0.0}), ("dsgt", {"momentum": 0.5}),
                                        ("d2", {"momentum": 0.0}), ("d2", {"momentum": 0.5})])
def test_tracking_and_d2_reach_the_exact_optimum_with_a_constant_step(name, hyper):
    """Heterogeneous quadratics, exact gradients, constant step: every agent ends at argmin Σ f_j."""
    X = _solve(name, **hyper)
    np.testing.assert_allclose(X, np.broadcast_to(X_STAR, X.shape), rtol=0, atol=1e-9)


def test_cdsgd_keeps_the_heterogeneity_bias_that_they_remove():
    """The same problem and step: D-PSGD's agents stay visibly away from the optimum (the test above can fail)."""
    X = _solve("cdsgd")
    assert np.abs(X - X_STAR).max() > 1e-2


def test_the_tracker_averages_the_agents_gradients_at_every_step():
    alg = make_algorithm("dsgt", lr=0.05, momentum=0.9)
    X = torch.tensor(RNG.normal(size=(N, P)))
    mixer, state = MatrixMixer(W), alg.init_state(X)
    for k in range(20):
        G = torch.tensor(grad(X.numpy()))
        alg.update(X, G, state, k=k, mixer=mixer)
        np.testing.assert_allclose(state["tracker"].mean(0).numpy(), G.mean(0).numpy(), rtol=0, atol=1e-12)


def test_d2_refuses_a_matrix_with_an_eigenvalue_at_or_below_minus_a_third():
    ring6 = topologies.mixing_matrix(topologies.build("ring", 6))  # λ_min = 1/3 + 2/3·cos(π) = −1/3 exactly
    with pytest.raises(ValueError, match=r"smallest eigenvalue is > -1/3, but this one's is -0\.333333.*lazy_metropolis"):
        make_algorithm("d2", lr=0.1).check_mixing(ring6)
    make_algorithm("d2", lr=0.1).check_mixing(topologies.mixing_matrix(topologies.build("ring", 6), "lazy_metropolis"))
    with pytest.raises(ValueError, match="lazy_metropolis"):  # the executor asks too
        Simulator(lambda: nn.Linear(2, 2), [(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))] * 6, ring6,
                  "d2", lr=0.1)


def test_d2_refusal_reaches_the_cli_before_any_data(tmp_path, capsys):
    from cdsgd import cli

    out = tmp_path / "never"
    assert cli.main(["run", "algorithm=d2", "topology=ring", "n_agents=6", f"out={out}"]) == 2
    assert "lazy_metropolis" in capsys.readouterr().err and not out.exists()


def _shards(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(24, 5, generator=g), torch.randint(0, 3, (24,), generator=g)) for _ in range(n)]


def _model():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("name,vectors", [("dsgt", 2), ("d2", 1), ("qg_dsgdm", 1)])
def test_bytes_count_the_vectors_each_step_sends(name, vectors):
    Wr = topologies.mixing_matrix(topologies.build("ring", 4), "lazy_metropolis")
    sim = Simulator(_model, _shards(), Wr, name, lr=0.05, batch_size=6, momentum=0.5)
    sim.run(steps=5)
    assert make_algorithm(name, lr=0.1).vectors_per_step == vectors
    assert sim.mixer.bytes_sent.tolist() == [vectors * 2 * sim.layout.numel * 4 * 5] * 4  # ring: degree 2


@pytest.mark.parametrize("name", ["dsgt", "d2", "qg_dsgdm", "sgp"])
def test_resume_from_state_dict_continues_bit_for_bit(name):
    Wr = topologies.mixing_matrix(topologies.build("ring", 4), "lazy_metropolis")

    def make():
        return Simulator(_model, _shards(), Wr, name, lr=0.05, batch_size=6, momentum=0.9, seed=3)

    whole = make()
    whole.run(steps=10)
    first = make()
    first.run(steps=4)
    saved = first.state_dict()
    second = make()
    second.load_state_dict(saved)
    second.run(steps=6)
    assert torch.equal(whole.X, second.X)
    for key in whole.state:
        assert torch.equal(whole.state[key], second.state[key]), key


def _own_loop(rank, world, name, hyper, X0, steps, resume_at):
    """One agent per gloo rank: f_j(x) = ½ Σ a_j (x − b_j)², DecentralizedOptimizer with a NeighbourMixer;
    the optimizer is rebuilt from its state_dict at step ``resume_at``."""
    from cdsgd.algorithms import DecentralizedOptimizer
    from cdsgd.runtime import NeighbourMixer

    x = torch.nn.Parameter(torch.tensor(X0[rank]))
    a, b = torch.tensor(A[rank]), torch.tensor(B[rank])
    mixer = NeighbourMixer(W, rank, timeout=30)
    opt = DecentralizedOptimizer([x], mixer, name, **hyper)
    for k in range(steps):
        if k == resume_at:
            saved = opt.state_dict()
            opt = DecentralizedOptimizer([x], mixer, name, **hyper)
            opt.load_state_dict(saved)
        opt.post()
        opt.zero_grad()
        (0.5 * (a * (x - b) ** 2).sum()).backward()
        opt.step()
    return x.detach().clone()


@pytest.mark.parametrize("name,momentum,nesterov,schedule", [CASES[1], CASES[4], CASES[6]])
def test_own_training_loop_in_gloo_ranks_follows_the_recurrence(name, momentum, nesterov, schedule):
    from dist_harness import run_ranks

    hyper = {"lr": 0.1, "momentum": momentum, "nesterov": nesterov, "lr_schedule": schedule, "lr_tau": 4.0}
    X0 = RNG.normal(size=(N, P))
    results = run_ranks(_own_loop, N, name, hyper, X0, 12, 5, timeout=120)
    got = np.stack([results[r].numpy() for r in range(N)])
    want = reference(name, 12, lr=0.1, momentum=momentum, nesterov=nesterov, schedule=schedule, X0=X0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_decentralized_optimizer_refuses_all_reduce_rules():
    from cdsgd.algorithms import DecentralizedOptimizer

    with pytest.raises(ValueError, match="'sgd' is not a neighbour rule"):
        DecentralizedOptimizer([torch.nn.Parameter(torch.zeros(2))], MatrixMixer(W), "sgd", lr=0.1)


def test_qg_dsgdm_at_a_zero_step_size_keeps_its_momentum_and_stays_finite():
    """A scheduler annealing lr to 0 (CosineAnnealingLR's default eta_min): the step is gossip alone, m̂ stays."""
    alg = make_algorithm("qg_dsgdm", lr=0.1, momentum=0.9)
    W = topologies.mixing_matrix(topologies.build("ring", 4))
    mixer = MatrixMixer(W)
    X = torch.randn(4, 3, dtype=torch.float64)
    G = torch.randn(4, 3, dtype=torch.float64)
    state = alg.init_state(X)
    alg.update(X, G, state, k=0, mixer=mixer)
    m_before, X_before = state["momentum"].clone(), X.clone()
    alg.step_size.lr = 0.0
    alg.update(X, G, state, k=1, mixer=mixer)
    assert torch.equal(state["momentum"], m_before)
    np.testing.assert_allclose(X.numpy(), W @ X_before.numpy(), atol=1e-14)
