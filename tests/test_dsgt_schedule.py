"""``dsgt`` on time-varying graphs against DIGing (Nedić, Olshevsky & Shi 2017, eq. 3), written out per agent.

DIGing, step k = 0, 1, …, with y^0 = ∇f(x^0):

    x^{k+1} = W_k x^k − α y^k
    y^{k+1} = W_k y^k + ∇f(x^{k+1}) − ∇f(x^k)

x^k and y^k are mixed with the same W_k. The reference below is a plain loop
over agents and their neighbours (numpy, float64) with W_k taken from the
schedule itself; ``tracker_shift=1`` mixes y^k with W_{k+1} instead, which is
what the rule did before (it mixed step k's tracker with the matrix of the
executor step that used it). The objectives are quadratics
f_j(x) = ½‖A_j x − b_j‖², ∇f_j(x) = A_jᵀ(A_j x − b_j).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import make_algorithm
from cdsgd.executor import Simulator
from cdsgd.mixers import MatrixMixer, make_mixer

N, P, M = 8, 3, 6  # agents, parameters, rows of each agent's A_j
RNG = np.random.default_rng(26)
A = RNG.normal(size=(N, M, P)) / np.sqrt(M)  # heterogeneous least squares: each agent its own A_j, b_j
B = RNG.normal(0.0, 2.0, size=(N, M))
X_STAR = np.linalg.solve(sum(a.T @ a for a in A), sum(a.T @ b for a, b in zip(A, B)))  # argmin Σ_j f_j
LR, STEPS = 0.1, 13

SCHEDULES = {"one_peer_exponential": lambda: topologies.schedule("one_peer_exponential", N),  # T = 3
             "random_matching": lambda: topologies.schedule("random_matching", N, seed=2, period=5)}


def dense(W) -> np.ndarray:
    return np.asarray(W.toarray() if hasattr(W, "toarray") else W, dtype=np.float64)


def grad_j(j: int, x: np.ndarray) -> np.ndarray:
    return A[j].T @ (A[j] @ x - B[j])


def grads(X: np.ndarray) -> np.ndarray:
    return np.stack([grad_j(j, X[j]) for j in range(len(X))])


def diging(W_of, X0, steps, lr, *, tracker_shift=0):
    """DIGing's eq. 3 agent by agent: [x^1, …, x^steps] (each N×P) and [y^0, …, y^{steps−1}].

    ``W_of(k)`` is W_k; the tracker y^k is mixed with ``W_of(k + tracker_shift)``.
    """
    n = len(X0)
    x = [np.array(X0[j], dtype=np.float64) for j in range(n)]
    y = [grad_j(j, x[j]) for j in range(n)]
    xs, ys = [], []
    for k in range(steps):
        Wx, Wy = dense(W_of(k)), dense(W_of(k + tracker_shift))
        ys.append(np.stack(y))
        x_new = []
        for j in range(n):
            s = np.zeros(P)
            for l in range(n):
                if Wx[j, l] != 0.0:
                    s += Wx[j, l] * x[l]
            x_new.append(s - lr * y[j])
        y_new = []
        for j in range(n):
            s = np.zeros(P)
            for l in range(n):
                if Wy[j, l] != 0.0:
                    s += Wy[j, l] * y[l]
            y_new.append(s + grad_j(j, x_new[j]) - grad_j(j, x[j]))
        x, y = x_new, y_new
        xs.append(np.stack(x))
    return xs, ys


def drive(alg, mixer, X0, steps, *, post_first: bool):
    """The rule called directly as the executor does: mixer.at(k) at step k; [x^1, …] and the trackers [y^0, …]."""
    X = torch.tensor(X0)
    state = alg.init_state(X)
    xs, ys = [], []
    for k in range(steps):
        at = mixer.at(k)
        mixed = alg.start(X, state, at) if post_first else None  # both exchanges posted before the gradient
        G = torch.tensor(grads(X.numpy()))
        alg.update(X, G, state, k=k, mixer=at, mixed=mixed)
        xs.append(X.numpy().copy())
        ys.append(state["tracker"].numpy().copy())
    return xs, ys


@pytest.mark.parametrize("post_first", [True, False], ids=["posted-before-gradient", "update-only"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_dsgt_follows_diging_step_by_step_on_a_schedule(name, post_first):
    S = SCHEDULES[name]()
    X0 = RNG.normal(size=(N, P))
    want_x, want_y = diging(lambda k: S[k], X0, STEPS, LR)
    old_x, _ = diging(lambda k: S[k], X0, STEPS, LR, tracker_shift=1)
    assert max(np.abs(a - b).max() for a, b in zip(want_x, old_x)) > 1e-2  # the two pairings are told apart
    got_x, got_y = drive(make_algorithm("dsgt", lr=LR, momentum=0.0), make_mixer(S), X0, STEPS, post_first=post_first)
    for k in range(STEPS):
        np.testing.assert_allclose(got_y[k], want_y[k], rtol=0, atol=1e-12, err_msg=f"y^{k}")
        np.testing.assert_allclose(got_x[k], want_x[k], rtol=0, atol=1e-12, err_msg=f"x^{k + 1}")


def test_the_old_pairing_is_what_diging_is_not():
    """The reading of the defect: mixing y^k with W_{k+1} (the rule before the fix) is a different recursion."""
    S = SCHEDULES["one_peer_exponential"]()
    X0 = RNG.normal(size=(N, P))
    want_x, _ = diging(lambda k: S[k], X0, 2, LR)
    old_x, _ = diging(lambda k: S[k], X0, 2, LR, tracker_shift=1)
    np.testing.assert_allclose(old_x[0], want_x[0], rtol=0, atol=1e-15)  # x^1 = W_0 x^0 − α ∇f(x^0) either way
    assert np.abs(old_x[1] - want_x[1]).max() > 1e-2  # x^2 = W_1 x^1 − α y^1 and y^1 = W_0 y^0 + …, not W_1 y^0


@pytest.mark.parametrize("post_first", [True, False])
def test_on_a_static_matrix_the_two_pairings_coincide_and_dsgt_follows_them(post_first):
    W = topologies.mixing_matrix(topologies.build("ring", N))
    X0 = RNG.normal(size=(N, P))
    want_x, want_y = diging(lambda k: W, X0, STEPS, LR)
    old_x, _ = diging(lambda k: W, X0, STEPS, LR, tracker_shift=1)
    for a, b in zip(want_x, old_x):
        np.testing.assert_array_equal(a, b)
    for mixer in (MatrixMixer(W), make_mixer(W)):
        got_x, got_y = drive(make_algorithm("dsgt", lr=LR, momentum=0.0), mixer, X0, STEPS, post_first=post_first)
        for k in range(STEPS):
            np.testing.assert_allclose(got_y[k], want_y[k], rtol=0, atol=1e-12)
            np.testing.assert_allclose(got_x[k], want_x[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_tracker_averages_the_gradients_at_every_step_of_a_schedule(name, momentum):
    """mean_j y_j^k = mean_j ∇f_j(x_j^k) at every k: each W_k is doubly stochastic, whichever W_k meets y."""
    alg, mixer = make_algorithm("dsgt", lr=0.05, momentum=momentum), make_mixer(SCHEDULES[name]())
    X = torch.tensor(RNG.normal(size=(N, P)))
    state = alg.init_state(X)
    for k in range(3 * STEPS):
        G = torch.tensor(grads(X.numpy()))
        alg.update(X, G, state, k=k, mixer=mixer.at(k), mixed=alg.start(X, state, mixer.at(k)))
        np.testing.assert_allclose(state["tracker"].mean(0).numpy(), G.mean(0).numpy(), rtol=0, atol=1e-12)


def test_dsgt_reaches_the_exact_optimum_on_a_schedule():
    """Exact gradients, a constant step, one peer per step: every agent ends at argmin Σ_j f_j."""
    alg, mixer = make_algorithm("dsgt", lr=LR, momentum=0.0), make_mixer(SCHEDULES["one_peer_exponential"]())
    X = torch.zeros(N, P, dtype=torch.float64)
    state = alg.init_state(X)
    for k in range(1500):
        alg.update(X, torch.tensor(grads(X.numpy())), state, k=k, mixer=mixer.at(k))
    np.testing.assert_allclose(X.numpy(), np.broadcast_to(X_STAR, X.shape), rtol=0, atol=1e-9)


def _shards():
    return [(torch.tensor(A[j]), torch.tensor(B[j])) for j in range(N)]


def _half_squared_error(out, target):
    return 0.5 * ((out.squeeze(-1) - target) ** 2).sum()  # f_j over a full-shard batch


@pytest.mark.parametrize("overlap", [True, False])
def test_simulator_runs_diging_on_a_schedule(overlap):
    """The executor path (mixer.at(k) at step k, exchanges posted before the backward pass or after)."""
    S = SCHEDULES["one_peer_exponential"]()
    sim = Simulator(lambda: nn.Linear(P, 1, bias=False).double(), _shards(), S, "dsgt", lr=LR, momentum=0.0,
                    batch_size=M, loss_fn=_half_squared_error, overlap=overlap, init="independent", seed=1)
    X0 = sim.X.numpy().copy()
    want_x, _ = diging(lambda k: S[k], X0, STEPS, LR)
    for k in range(STEPS):
        sim.step()
        np.testing.assert_allclose(sim.X.numpy(), want_x[k], rtol=0, atol=1e-10, err_msg=f"x^{k + 1}")
    # two vectors per step, one peer per step of one_peer_exponential: the bytes say so
    assert sim.mixer.bytes_sent.tolist() == [2 * 1 * P * 8 * STEPS] * N


def _ranks_loop(rank, world, X0, steps):
    """Two agents per gloo rank, a BlockMixer per step of the schedule (as the runtime's group builds them)."""
    from cdsgd.runtime import BlockMixer

    def block(Wk, *, exact, validate, n_agents=None):
        return BlockMixer(Wk, rank, world, timeout=30, exact=exact, validate=validate, n_agents=n_agents)

    mixer = make_mixer(SCHEDULES["one_peer_exponential"](), n_agents=N, per_matrix=block)
    rows = mixer.agents
    alg = make_algorithm("dsgt", lr=LR, momentum=0.0)
    X = torch.tensor(X0[rows])
    state = alg.init_state(X)
    for k in range(steps):
        at = mixer.at(k)
        mixed = alg.start(X, state, at)
        G = torch.tensor(np.stack([grad_j(j, X[i].numpy()) for i, j in enumerate(rows)]))
        alg.update(X, G, state, k=k, mixer=at, mixed=mixed)
    return rows, X.clone()


def test_dsgt_on_a_schedule_across_gloo_ranks_follows_diging():
    from dist_harness import run_ranks

    S = SCHEDULES["one_peer_exponential"]()
    X0 = RNG.normal(size=(N, P))
    results = run_ranks(_ranks_loop, 4, X0, 7, timeout=120)
    got = np.zeros((N, P))
    for rows, X in results.values():
        got[rows] = X.numpy()
    want_x, _ = diging(lambda k: S[k], X0, 7, LR)
    np.testing.assert_allclose(got, want_x[-1], rtol=0, atol=1e-12)
