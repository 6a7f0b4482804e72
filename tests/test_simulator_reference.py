"""The simulator against a naive reference written independently here.

The reference keeps one nn.Module per agent, takes gradients with plain
autograd (loss.backward()), and writes every update rule out with explicit
per-agent loops and sums. Batches are whole shards, so the data order
cannot matter; the batch streams are tested separately.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import topologies
from cdsgd.executor import Simulator

N, D, C, M = 4, 6, 3, 12  # agents, input dim, classes, samples per agent
STEPS = 24


def make_shards(seed=0, n=N, m=M, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, D, generator=g, dtype=dtype), torch.randint(0, C, (m,), generator=g)) for _ in range(n)]


def model_fn():
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, C)).double()


def ring_w(n=N):
    return topologies.mixing_matrix(topologies.build("ring", n) if n > 2 else topologies.build("path", n))


def flat_params(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def set_flat(module, vec):
    i = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(vec[i:i + p.numel()].view_as(p))
            i += p.numel()


def reference(alg, shards, W, X0, steps, *, lr, momentum=0.0, nesterov=True, weight_decay=0.0,
              lr_at=None, local_steps=None, masks=None):
    """Explicit per-agent loops. Returns the N×P parameters after ``steps`` steps."""
    n = len(shards)
    models = [model_fn() for _ in range(n)]
    for j in range(n):
        set_flat(models[j], X0[j])
    x = [X0[j].clone() for j in range(n)]
    m = [torch.zeros_like(X0[0]) for _ in range(n)]
    for k in range(steps):
        a = lr if lr_at is None else lr_at(k)
        # gradients at each agent's own pre-update parameters
        g = []
        for j in range(n):
            set_flat(models[j], x[j])
            models[j].zero_grad()
            loss = F.cross_entropy(models[j](shards[j][0]), shards[j][1])
            loss.backward()
            gj = torch.cat([p.grad.reshape(-1) for p in models[j].parameters()])
            g.append(gj + weight_decay * x[j])
        new = []
        if alg in ("cdsgd", "cdmsgd"):
            for j in range(n):
                mixed = torch.zeros_like(x[j])
                for l in range(n):
                    mixed = mixed + float(W[j][l]) * x[l]
                if alg == "cdsgd":
                    new.append(mixed - a * g[j])
                else:
                    m[j] = momentum * m[j] - a * g[j]
                    new.append(mixed + momentum * m[j] - a * g[j] if nesterov else mixed + m[j])
        elif alg in ("sgd", "msgd"):
            gbar = sum(g) / n
            for j in range(n):
                if alg == "sgd":
                    new.append(x[j] - a * gbar)
                else:
                    m[j] = momentum * m[j] - a * gbar
                    new.append(x[j] + momentum * m[j] - a * gbar if nesterov else x[j] + m[j])
        elif alg == "local":
            new = [x[j] - a * g[j] for j in range(n)]
        elif alg == "fedavg":
            mask = masks[k] if masks is not None else [True] * n
            new = [x[j] - a * g[j] if mask[j] else x[j] for j in range(n)]
            if (k + 1) % local_steps == 0:
                part = [new[j] for j in range(n) if mask[j]]
                avg = sum(part) / len(part)
                new = [avg.clone() for _ in range(n)]
        x = new
    return torch.stack(x)


CASES = [
    ("cdsgd", {"lr": 0.2}),
    ("cdsgd", {"lr": 0.3, "weight_decay": 0.05, "lr_schedule": "diminishing", "lr_tau": 5.0, "lr_power": 0.75}),
    ("cdmsgd", {"lr": 0.1, "momentum": 0.9}),
    ("cdmsgd", {"lr": 0.1, "momentum": 0.8, "nesterov": False}),
    ("sgd", {"lr": 0.2}),
    ("msgd", {"lr": 0.1, "momentum": 0.9}),
    ("fedavg", {"lr": 0.2, "local_steps": 3}),
    ("local", {"lr": 0.2, "momentum": 0.0}),  # the reference has no momentum for local (default 0.95)
]


@pytest.mark.parametrize("alg,hyper", CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_simulator_matches_naive_reference(alg, hyper, strategy):
    shards = make_shards()
    W = ring_w()
    sim = Simulator(model_fn, shards, W, alg, batch_size=M, seed=3, init="independent", strategy=strategy, **hyper)
    X0 = sim.X.clone()
    if alg in ("sgd", "msgd", "fedavg"):
        assert torch.equal(X0, X0[0].expand_as(X0)), "one-model baselines start every agent alike"
    else:
        assert not torch.equal(X0[0], X0[1]), "init=independent gives different starting points"
    for _ in range(STEPS):
        sim.step()
    sched = sim.algorithm.step_size
    ref = reference(alg, shards, W, X0, STEPS, lr=hyper["lr"], momentum=hyper.get("momentum", 0.0),
                    nesterov=hyper.get("nesterov", True), weight_decay=hyper.get("weight_decay", 0.0),
                    lr_at=None if hyper.get("lr_schedule") is None else
                    (lambda k: hyper["lr"] / (1 + k / hyper["lr_tau"]) ** hyper["lr_power"]),
                    local_steps=hyper.get("local_steps"))
    assert sched(0) == hyper["lr"]
    torch.testing.assert_close(sim.X, ref, rtol=0, atol=1e-6)
    assert (sim.X - X0).abs().max() > 1e-2, "the parameters moved"


def test_fedavg_partial_participation_matches_reference():
    shards = make_shards(n=6)
    sim = Simulator(model_fn, shards, None, "fedavg", batch_size=M, seed=1, lr=0.2, local_steps=4,
                    fedavg_fraction=0.5)
    masks = [sim.algorithm.participants(k).tolist() for k in range(STEPS)]
    # three of six agents per round, the same within a round, not always the same three
    assert all(sum(mk) == 3 for mk in masks)
    assert all(masks[k] == masks[k - k % 4] for k in range(STEPS))
    assert len({tuple(mk) for mk in masks}) > 1
    X0 = sim.X.clone()
    for _ in range(STEPS):
        sim.step()
    ref = reference("fedavg", shards, None, X0, STEPS, lr=0.2, local_steps=4, masks=masks)
    torch.testing.assert_close(sim.X, ref, rtol=0, atol=1e-6)


def test_fedavg_local_epochs_sets_round_length():
    shards = make_shards(m=20)
    sim = Simulator(model_fn, shards, None, "fedavg", batch_size=5, lr=0.1, local_epochs=2)
    assert sim.steps_per_epoch == 4 and sim.algorithm.round_length == 8
    for k in range(8):
        sim.step()
        assert (sim.consensus_distance() < 1e-12) == (k == 7)


@pytest.mark.parametrize("alg", ["cdsgd", "cdmsgd"])
def test_loop_and_vmap_agree_with_minibatches(alg):
    shards = make_shards(m=20, dtype=torch.float32)

    def f32():
        return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, C))

    W = topologies.mixing_matrix(topologies.build("star", N))
    sims = [Simulator(f32, shards, W, alg, batch_size=6, seed=7, init="independent", strategy=s, lr=0.05)
            for s in ("loop", "vmap")]
    for _ in range(30):
        losses = [s.step() for s in sims]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(sims[0].X, sims[1].X, rtol=0, atol=1e-5)
    rows = [s.evaluate() for s in sims]
    for key in ("consensus_distance", "bytes_sent_per_agent"):
        assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-5)


def test_zero_gradients_give_powers_of_pi():
    shards = make_shards()
    W = topologies.mixing_matrix(topologies.build("erdos_renyi", N, p=0.7, seed=2), "lazy_metropolis")
    zero_loss = lambda out, y: 0.0 * out.sum()  # noqa: E731
    sim = Simulator(model_fn, shards, W, "cdsgd", batch_size=M, init="independent", loss_fn=zero_loss, lr=0.5)
    X0 = sim.X.clone().numpy()
    K = 15
    for _ in range(K):
        sim.step()
    np.testing.assert_allclose(sim.X.numpy(), np.linalg.matrix_power(W, K) @ X0, rtol=0, atol=1e-12)
    # the agents' mean is preserved by a doubly stochastic Π
    np.testing.assert_allclose(sim.X.numpy().mean(0), X0.mean(0), atol=1e-12)


@pytest.mark.parametrize("alg,opt_kw", [("sgd", {}), ("msgd", {"momentum": 0.9, "nesterov": True}),
                                        ("msgd", {"momentum": 0.9, "nesterov": False})])
def test_centralized_equals_single_model_on_concatenated_batch(alg, opt_kw):
    shards = make_shards()
    sim = Simulator(model_fn, shards, None, alg, batch_size=M, lr=0.1, **opt_kw)
    single = model_fn()
    set_flat(single, sim.X[0])
    opt = torch.optim.SGD(single.parameters(), lr=0.1, **opt_kw)
    xs = torch.cat([x for x, _ in shards])
    ys = torch.cat([y for _, y in shards])
    for _ in range(STEPS):
        sim.step()
        opt.zero_grad()
        F.cross_entropy(single(xs), ys).backward()
        opt.step()
    for j in range(N):
        torch.testing.assert_close(sim.X[j], flat_params(single), rtol=0, atol=1e-10)


def test_float32_reference_cdmsgd():
    """The default dtype too: float32 within 1e-5 of a float64 reference run from the same start."""
    shards64 = make_shards()
    shards32 = [(x.float(), y) for x, y in shards64]

    def f32():
        return model_fn().float()

    W = ring_w()
    sim = Simulator(f32, shards32, W, "cdmsgd", batch_size=M, init="independent", lr=0.1, momentum=0.9)
    X0 = sim.X.double().clone()
    for _ in range(STEPS):
        sim.step()
    ref = reference("cdmsgd", shards64, W, X0, STEPS, lr=0.1, momentum=0.9)
    torch.testing.assert_close(sim.X.double(), ref, rtol=0, atol=1e-5)
    assert copy.deepcopy(sim.X).dtype == torch.float32
