"""Algorithms, mixers, optimizer classes, batch streams, metrics and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from cdsgd.algorithms import CDMSGD, CDSGD, StepSize, make_algorithm
from cdsgd.mixers import Handle, MatrixMixer, Mixer, ordered_weighted_sum, result_tensor
from cdsgd.executor import METRIC_COLUMNS, BatchStream, Simulator, simulate
from cdsgd.base.seeding import generator

D, C = 6, 3


def shards(n=4, m=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, D, generator=g), torch.randint(0, C, (m,), generator=g)) for _ in range(n)]


def mlp():
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, C))


def ring(n):
    return topologies.mixing_matrix(topologies.build("ring", n))


# ------------------------------------------------------------------ mixers


def test_matrix_mixer_exact_mode_is_ordered_sum_and_close_to_matmul():
    W = topologies.mixing_matrix(topologies.build("erdos_renyi", 6, p=0.5, seed=1))
    X = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    fast, exact = MatrixMixer(W).mix(X), MatrixMixer(W, exact=True).mix(X)
    torch.testing.assert_close(fast, exact, rtol=0, atol=1e-5)
    # exact mode: self first, then neighbours ascending, as explicit multiply-adds
    j = 2
    src = [j] + [l for l in range(6) if l != j and W[j, l] > 0]
    expected = torch.empty(1000)
    ordered_weighted_sum([float(W[j, l]) for l in src], [X[l] for l in src], expected)
    assert torch.equal(exact[j], expected)


def test_mixer_bytes():
    n, P, K = 8, 50, 7
    for topo, deg in (("ring", 2), ("hypercube", 3), ("complete", 7)):
        m = MatrixMixer(topologies.mixing_matrix(topologies.build(topo, n)))
        X = torch.zeros(n, P)
        for _ in range(K):
            m.mix(X)
        assert m.bytes_sent.tolist() == [deg * P * 4 * K] * n
    star = MatrixMixer(topologies.mixing_matrix(topologies.build("star", 5)))
    star.mix(torch.zeros(5, 10, dtype=torch.float64))
    assert star.bytes_sent.tolist() == [4 * 10 * 8] + [10 * 8] * 4
    m = MatrixMixer(ring(4))
    m.average(torch.zeros(4, 100))
    assert m.bytes_sent.tolist() == [2 * 3 / 4 * 100 * 4] * 4


@pytest.mark.parametrize("alg,per_step", [("cdsgd", lambda n, P: 2 * P * 4), ("local", lambda n, P: 0),
                                          ("sgd", lambda n, P: 2 * (n - 1) / n * P * 4)])
def test_simulator_bytes_per_agent(alg, per_step):
    n, K = 5, 6
    sim = Simulator(mlp, shards(n), ring(n), alg, batch_size=4, lr=0.1)
    for _ in range(K):
        sim.step()
    assert sim.evaluate()["bytes_sent_per_agent"] == pytest.approx(K * per_step(n, sim.layout.numel))


def test_fedavg_bytes_once_per_round():
    n = 4
    sim = Simulator(mlp, shards(n), None, "fedavg", batch_size=4, lr=0.1, local_steps=3)
    for _ in range(7):
        sim.step()
    assert sim.evaluate()["bytes_sent_per_agent"] == pytest.approx(2 * 2 * (n - 1) / n * sim.layout.numel * 4)


# ---------------------------------------------------------- step sizes


def test_diminishing_step_size_conditions():
    s = StepSize(1.0, "diminishing", tau=10.0, power=0.6)
    alphas = np.array([s(k) for k in range(200000)])
    assert alphas[0] == 1.0 and np.all(np.diff(alphas) < 0)
    assert s(10) == pytest.approx(2 ** -0.6)
    # Σα diverges (partial sums keep growing like k^0.4), Σα² converges (p > 0.5)
    assert alphas.sum() > 2 * alphas[:20000].sum()
    assert (alphas ** 2)[100000:].sum() < 0.2 * (alphas ** 2).sum()


# ---------------------------------------------------- optimizer classes


class BoardMixer(Mixer):
    """In-process stand-in for a neighbour exchange: agent j posts x_j, then reads Σ_l π_jl x_l."""

    def __init__(self, W, j, board):
        self.W, self.j, self.board, self.n_agents, self.agents = W, j, board, len(W), [j]
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)

    def start(self, x, *, out=None):
        self.board[self.j] = x.clone()
        board, row = self.board, self.W[self.j]
        out = result_tensor(x, out)

        class _H(Handle):
            def wait(self_inner):
                return out.copy_(sum(float(row[l]) * board[l] for l in range(len(row))))

        return _H(None)

    def average(self, x, mask=None, *, out=None):
        raise NotImplementedError


@pytest.mark.parametrize("klass,alg,kw", [(CDSGD, "cdsgd", {"lr": 0.1, "weight_decay": 0.01}),
                                          (CDMSGD, "cdmsgd", {"lr": 0.1, "momentum": 0.9}),
                                          (CDMSGD, "cdmsgd", {"lr": 0.1, "momentum": 0.9, "nesterov": False})])
@pytest.mark.parametrize("post_before_backward", [False, True])
def test_optimizer_classes_match_simulator(klass, alg, kw, post_before_backward):
    n, data = 4, shards(4)
    W = ring(n)
    sim = Simulator(mlp, data, W, alg, batch_size=12, init="independent", **kw)
    X0 = sim.X.clone()
    board = {}
    models, opts = [], []
    for j in range(n):
        model = mlp()
        sim.layout.load_into(model, X0[j])
        models.append(model)
        opts.append(klass(model.parameters(), BoardMixer(W, j, board), **kw))
    for _ in range(10):
        sim.step()
        if post_before_backward:  # overlap: the exchange is in flight during the backward pass
            for o in opts:
                o.post()
        for j in range(n):
            opts[j].zero_grad()
            F.cross_entropy(models[j](data[j][0]), data[j][1]).backward()
        if not post_before_backward:
            for o in opts:  # in-process board: every agent must post before any agent reads
                o.post()
        for o in opts:
            o.step()
    for j in range(n):
        torch.testing.assert_close(sim.layout.flatten(models[j]), sim.X[j], rtol=0, atol=1e-6)
    assert "momentum_buffer" in opts[0].state[next(models[0].parameters())] or klass is CDSGD


# ------------------------------------------------------------- streams


def test_batch_stream_covers_each_index_once_per_pass_and_is_deterministic():
    s1 = BatchStream(10, 3, generator(5, 0, "data"))
    s2 = BatchStream(10, 3, generator(5, 0, "data"))
    b1 = torch.cat([s1.next() for _ in range(10)])
    b2 = torch.cat([s2.next() for _ in range(10)])
    assert torch.equal(b1, b2)
    for p in range(3):
        assert sorted(b1[10 * p:10 * (p + 1)].tolist()) == list(range(10))
    assert not torch.equal(b1[:10], b1[10:20]), "a new permutation each pass"
    small = BatchStream(2, 5, generator(0))
    assert len(small.next()) == 5


def test_agent_streams_do_not_depend_on_the_number_of_agents():
    """Agent j's data order and initialisation come from (seed, j): rank j can reproduce them alone."""
    a = Simulator(mlp, shards(2), np.full((2, 2), 0.5), "cdsgd", batch_size=4, seed=9, init="independent", lr=0.1)
    b = Simulator(mlp, shards(4), ring(4), "cdsgd", batch_size=4, seed=9, init="independent", lr=0.1)
    assert torch.equal(a.X[1], b.X[1])
    assert all(torch.equal(a.streams[1].next(), b.streams[1].next()) for _ in range(5))


def test_global_rng_untouched_and_dropout_per_agent():
    def dropout_model():
        return nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, C))

    torch.manual_seed(123)
    before = torch.get_rng_state()
    data = [shards(1)[0]] * 3  # the same data for all agents: only dropout differs
    W = np.full((3, 3), 1 / 3)
    sim = Simulator(dropout_model, data, W, "local", batch_size=12, seed=4, lr=0.1)
    assert sim.strategy == "loop"
    for _ in range(3):
        sim.step()
    assert torch.equal(torch.get_rng_state(), before), "the simulator never consumes the global RNG"
    assert not torch.equal(sim.X[0], sim.X[1]), "each agent draws its own dropout masks"
    again = Simulator(dropout_model, data, W, "local", batch_size=12, seed=4, lr=0.1)
    for _ in range(3):
        again.step()
    assert torch.equal(sim.X, again.X), "deterministic under the seed"


def test_auto_strategy_rule():
    assert Simulator(mlp, shards(2), None, "sgd", lr=0.1).strategy == "vmap"

    def conv():
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, C))

    img = [(torch.randn(4, 1, 6, 6), torch.randint(0, C, (4,))) for _ in range(2)]
    assert Simulator(conv, img, None, "sgd", lr=0.1).strategy == "loop"
    assert Simulator(conv, img, None, "sgd", lr=0.1, strategy="vmap").strategy == "vmap"


# ------------------------------------------------------------- metrics


def test_metrics_rows_and_evaluation_bounds():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, D, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    data = [(x[i::6], y[i::6]) for i in range(6)]
    sim = Simulator(mlp, data, ring(6), "cdmsgd", batch_size=10, lr=0.05, test_set=(x, y),
                    eval_agents=3, eval_samples=200, eval_batch_size=64)
    assert sim.steps_per_epoch == 10 and sim.eval_agents == [0, 2, 5] and len(sim.test_set[1]) == 200
    rows = sim.run(epochs=3)
    assert len(rows) == 3 and [r["step"] for r in rows] == [10, 20, 30]
    for r in rows:
        assert tuple(r) == METRIC_COLUMNS
        assert 0 <= r["test_accuracy"] <= 1 and r["consensus_distance"] >= 0 and r["wall_seconds"] > 0
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    # the metrics equal an independent evaluation of the agents' models
    tx, ty = sim.test_set
    accs = []
    for j in sim.eval_agents:
        model = sim.agent_model(j).eval()
        accs.append(float((model(tx).argmax(1) == ty).float().mean()))
    final = sim.evaluate()
    assert final["test_accuracy"] == pytest.approx(np.mean(accs))
    avg = mlp()
    sim.layout.load_into(avg, sim.X.mean(0))
    assert final["test_accuracy_avg_model"] == pytest.approx(float((avg(tx).argmax(1) == ty).float().mean()))
    with torch.no_grad():  # and its test loss: the mean cross-entropy of x̄ on the test set
        assert final["test_loss_avg_model"] == pytest.approx(float(torch.nn.functional.cross_entropy(avg(tx), ty)),
                                                             rel=1e-5)
    Xd = sim.X.double()
    assert final["consensus_distance"] == pytest.approx(float(((Xd - Xd.mean(0)) ** 2).sum(1).mean().sqrt()))


def test_simulate_entry_point_learns():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(800, D, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    data = [(x[i:800:4], y[i:800:4]) for i in range(4)]
    res = simulate(lambda: nn.Linear(D, 2), data, ring(4), "cdmsgd", epochs=4, batch_size=20, lr=0.05,
                   test_set=(x, y))
    assert res.params.shape == (4, D * 2 + 2)
    assert res.metrics[-1]["test_accuracy"] > 0.95 and res.metrics[-1]["test_accuracy_avg_model"] > 0.95


# ----------------------------------------------------------- bad input

BAD = [
    (lambda: make_algorithm("cdsdg", lr=0.1), r"algorithm 'cdsdg' is unknown; did you mean 'cdsgd'\?"),
    (lambda: make_algorithm("cdsgd", lr=-0.1), r"lr must be a finite number > 0, got -0.1"),
    (lambda: make_algorithm("cdsgd", lr=0.0), r"lr must be a finite number > 0, got 0.0"),
    (lambda: make_algorithm("cdsgd"), r"algorithm 'cdsgd' needs lr"),
    (lambda: make_algorithm("cdmsgd", lr=0.1, momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
    (lambda: make_algorithm("cdmsgd", lr=0.1, momentum=-0.5), r"momentum must be in \[0, 1\), got -0.5"),
    (lambda: make_algorithm("cdmsgd", lr=0.1, nesterov="yes"), r"nesterov must be true or false, got 'yes'"),
    (lambda: make_algorithm("cdsgd", lr=0.1, momentum=0.9), r"algorithm 'cdsgd' takes no hyperparameter 'momentum'; allowed: lr"),
    (lambda: make_algorithm("cdsgd", lr=0.1, weight_decay=-1), r"weight_decay must be a finite number >= 0, got -1"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_schedule="cosin"),
     r"lr_schedule 'cosin' is unknown; did you mean 'cosine'\? allowed: constant, diminishing, cosine, step"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_schedule="linear"),
     r"lr_schedule 'linear' is unknown; allowed: constant, diminishing, cosine, step"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_schedule="diminishing", lr_power=0.5), r"lr_power must be in \(0.5, 1\]"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_tau=0), r"lr_tau must be > 0, got 0"),
    (lambda: make_algorithm("fedavg", lr=0.1, local_steps=0), r"local_steps must be an integer >= 1, got 0"),
    (lambda: make_algorithm("fedavg", lr=0.1, local_steps=2, local_epochs=1), r"give local_steps or local_epochs, not both"),
    (lambda: make_algorithm("fedavg", lr=0.1, fedavg_fraction=1.5), r"fedavg_fraction must be in \(0, 1\], got 1.5"),
    (lambda: Simulator(mlp, shards(4), ring(5), "cdsgd", lr=0.1), r"mixing matrix W is 5x5 but there are 4 agents"),
    (lambda: Simulator(mlp, shards(2), [[1.2, -0.2], [-0.2, 1.2]], "cdsgd", lr=0.1), r"entry W\[0, 1\] = -0.2 is negative"),
    (lambda: Simulator(mlp, shards(3), np.eye(3), "cdsgd", lr=0.1), r"graph is not connected: 3 components"),
    (lambda: Simulator(mlp, shards(2), [[0.6, 0.6], [0.4, 0.4]], "cdsgd", lr=0.1), r"not symmetric: W\[0, 1\] = 0.6 but W\[1, 0\] = 0.4"),
    (lambda: Simulator(mlp, shards(2), [[0.9, 0.2], [0.2, 0.9]], "cdsgd", lr=0.1), r"row 0 sums to 1.1, not 1"),
    (lambda: Simulator(mlp, shards(2), None, "cdsgd", lr=0.1), r"algorithm 'cdsgd' mixes with neighbours: give the mixing matrix W"),
    (lambda: Simulator(mlp, shards(2), None, "sgd", lr=0.1, init="random"), r"init 'random' is unknown; allowed: same, independent"),
    (lambda: Simulator(mlp, shards(2), None, "sgd", lr=0.1, strategy="gpu"), r"strategy 'gpu' is unknown; allowed: auto, loop, vmap"),
    (lambda: Simulator(mlp, shards(2), None, "sgd", lr=0.1, batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    (lambda: Simulator(mlp, [], None, "sgd", lr=0.1), r"shards is empty"),
    (lambda: Simulator(mlp, [(torch.zeros(3, D), torch.zeros(2))], None, "sgd", lr=0.1), r"shard 0 has 3 inputs but 2 targets"),
    (lambda: Simulator(lambda: nn.Sequential(nn.Linear(D, 4), nn.Dropout(0.2)), shards(2), None, "sgd", lr=0.1,
                       strategy="vmap"), r"strategy 'vmap' cannot simulate this model exactly: it has dropout"),
    (lambda: Simulator(mlp, shards(2), None, "sgd", lr=0.1).run(), r"give exactly one of epochs and steps"),
    (lambda: Simulator(mlp, shards(2), None, "sgd", lr=0.1, batchsize=4),
     r"unknown option 'batchsize': not a Simulator option \(.*batch_size.*\) nor a hyperparameter of algorithm 'sgd' \(lr, "),
    (lambda: CDSGD(mlp().parameters(), MatrixMixer(ring(3)), lr=-1), r"lr must be a finite number > 0, got -1"),
    (lambda: CDMSGD(mlp().parameters(), MatrixMixer(ring(3)), lr=0.1, momentum=1.2), r"momentum must be in \[0, 1\), got 1.2"),
    (lambda: CDSGD(mlp().parameters(), "ring", lr=0.1), r"mixer must be a cdsgd.mixers.Mixer, got str"),
]


@pytest.mark.parametrize("call,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_optimizer_keyword_only():
    with pytest.raises(TypeError):
        CDSGD(mlp().parameters(), MatrixMixer(ring(3)), 0.1)
