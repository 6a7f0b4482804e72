"""Many simulated agents: the edge-wise mixer, sparse W end to end, memory-bounded blocks, evaluation defaults."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import rules
from cdsgd.executor import evaluation, gradients
from cdsgd.executor.agents import build_agents, seeded_model
from cdsgd.executor.streams import AgentRNG
from cdsgd.mixers import MatrixMixer, ordered_weighted_sum
from cdsgd.executor import Simulator


def _W(name, n, sparse=False, **params):
    return topologies.mixing_matrix(topologies.build(name, n, **params), sparse=sparse)


@pytest.mark.parametrize("name", ["ring", "torus", "star", "exponential", "path", "complete"])
def test_every_product_method_computes_pi_x(name):
    n = 40
    W = _W(name, n)
    X = torch.randn(n, 3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = torch.from_numpy(W @ X.reshape(n, -1).numpy()).reshape(X.shape)
    for method in ("dense", "edges", "csr"):
        for given in (W, _W(name, n, sparse=True)):
            got = MatrixMixer(given, method=method).mix(X)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-13, msg=f"{name} {method}")


def test_the_product_is_chosen_by_the_graph():
    assert MatrixMixer(_W("ring", 5)).method == "dense"  # 15 of 25 entries: a small graph is dense
    assert MatrixMixer(_W("complete", 40)).method == "dense"
    assert MatrixMixer(_W("ring", 40)).method == "edges"
    assert MatrixMixer(_W("star", 40)).method == "csr"  # degree 39 at the hub, 1.95 on average: no padding


def test_exact_mode_is_the_ordered_sum_for_dense_and_sparse_w():
    n = 36
    W = _W("torus", n)
    X = torch.randn(n, 50, generator=torch.Generator().manual_seed(2))
    expected = torch.empty_like(X)
    for j in range(n):
        src = [j] + [int(l) for l in np.flatnonzero(W[j]) if l != j]
        ordered_weighted_sum([float(W[j, l]) for l in src], [X[l] for l in src], expected[j])
    assert torch.equal(MatrixMixer(W, exact=True).mix(X), expected)
    assert torch.equal(MatrixMixer(_W("torus", n, sparse=True), exact=True).mix(X), expected)


def test_ten_thousand_agents_on_a_ring_never_build_an_n_by_n_array():
    n = 10_000
    W = _W("ring", n, sparse=True)
    m = MatrixMixer(W)
    X = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    out = m.mix(X).squeeze(1)
    assert m._dense64 is None and m.method == "edges"
    j = torch.arange(n, dtype=torch.float64)
    torch.testing.assert_close(out, (j + (j - 1) % n + (j + 1) % n) / 3)  # each agent averages three on a ring
    assert m.bytes_sent.tolist() == [16.0] * n  # degree 2 × one float64


def test_all_average_mixer_needs_no_matrix():
    m = MatrixMixer(None, n_agents=4)
    X = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    assert m.mix(X).squeeze(1).tolist() == [3.0] * 4 and m.average(X).squeeze(1).tolist() == [3.0] * 4
    with pytest.raises(ValueError, match=r"needs n_agents >= 1, got None"):
        MatrixMixer(None)
    with pytest.raises(ValueError, match=r"mixing method 'fast' is unknown; allowed: auto, dense, edges, csr"):
        MatrixMixer(_W("ring", 4), method="fast")


def _shards(n, per=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(per, 6, generator=g), torch.randint(0, 3, (per,), generator=g)) for _ in range(n)]


def test_a_simulator_with_sparse_w_runs_as_with_dense_w():
    n = 40
    shards = _shards(n)

    def run(W, exact):
        sim = Simulator(lambda: nn.Linear(6, 3), shards, W, "cdmsgd", batch_size=4, lr=0.1, exact=exact)
        for _ in range(5):
            sim.step()
        return sim.X

    dense, sparse = _W("ring", n), _W("ring", n, sparse=True)
    assert torch.equal(run(dense, True), run(sparse, True))  # exact mode: the same ordered sums
    torch.testing.assert_close(run(dense, False), run(sparse, False))


def test_agents_of_one_seed_are_copies_of_the_same_build():
    def fn():
        return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))

    loop = build_agents(fn, [3, 3, 9], strategy="loop", exact=False)
    assert loop.strategy == "loop" and len(loop.models) == 3 and loop.models[0] is not loop.models[1]
    fresh = [loop.layout.flatten(seeded_model(k, fn)) for k in (3, 3, 9)]
    assert all(torch.equal(loop.X[i], fresh[i]) for i in range(3))
    assert not torch.equal(loop.X[0], loop.X[2])

    vm = build_agents(lambda: nn.Linear(4, 2), [5, 5, 5, 7], strategy="vmap", exact=False)
    assert vm.strategy == "vmap" and len(vm.models) == 1  # one template, rows of X for the agents
    assert torch.equal(vm.X[3], vm.layout.flatten(seeded_model(7, lambda: nn.Linear(4, 2))))
    assert all(torch.equal(vm.X[i], vm.X[0]) for i in (1, 2))


def test_agent_model_of_a_vmap_executor_holds_that_agents_parameters():
    sim = Simulator(lambda: nn.Linear(6, 3), _shards(4), _W("ring", 4), "cdmsgd", batch_size=4, lr=0.1,
                    init="independent")
    sim.step()
    m2 = sim.agent_model(2)
    assert torch.equal(sim.layout.flatten(m2), sim.X[2]) and m2 is not sim.agent_model(1)


def test_agent_random_streams_are_those_torch_manual_seed_gives():
    from cdsgd.base.seeding import derive_seed

    rng = AgentRNG(11, [0, 7], torch.device("cpu"))
    saved = torch.get_rng_state()
    for state, j in zip(rng.states, (0, 7)):
        torch.manual_seed(derive_seed(11, j, "dropout"))
        assert torch.equal(state, torch.get_rng_state())
    torch.set_rng_state(saved)


def test_blocked_updates_compute_the_same_numbers(monkeypatch):
    g = torch.Generator().manual_seed(4)
    mixed, G, buf = (torch.randn(64, 1000, generator=g) for _ in range(3))
    whole_buf, whole_out = buf.clone(), torch.empty_like(mixed)
    rules.momentum_update(mixed, G, whole_buf, 0.1, 0.9, True, whole_out)  # one block: 256 kB < 1 MB
    monkeypatch.setattr(rules, "UPDATE_BLOCK_BYTES", 4 * 333)  # blocks of 333 floats, the last one short
    blocked_buf, blocked_out = buf.clone(), torch.empty_like(mixed)
    rules.momentum_update(mixed, G, blocked_buf, 0.1, 0.9, True, blocked_out)
    assert torch.equal(blocked_buf, whole_buf) and torch.equal(blocked_out, whole_out)


def test_vmap_gradients_and_sums_in_blocks_of_agents(monkeypatch):
    n = 12
    sim = Simulator(lambda: nn.Linear(6, 3), _shards(n), _W("ring", n), "cdmsgd", batch_size=4, lr=0.1,
                    init="independent")
    active = list(range(n))
    batches = sim.data.batches(active)
    whole = sim.gradients.gradients(active, batches), sim.gradients.G.clone()
    xbar, dist = sim.average_params(), sim.consensus_distance()
    monkeypatch.setattr(gradients, "VMAP_BLOCK_BYTES", 5 * 21 * 4)  # 5 agents a block: 5, 5, 2
    monkeypatch.setattr(evaluation, "SUM_BLOCK_BYTES", 5 * 21 * 8)
    blocked = sim.gradients.gradients(active, batches), sim.gradients.G.clone()
    torch.testing.assert_close(blocked[0], whole[0])
    torch.testing.assert_close(blocked[1], whole[1])
    torch.testing.assert_close(sim.average_params(), xbar)
    assert sim.consensus_distance() == pytest.approx(dist, rel=1e-12)
    # half the agents take part (FedAvg-style): rows of the others are zero
    part = sim.gradients.gradients([1, 4, 7, 10], [batches[i] for i in (1, 4, 7, 10)])
    torch.testing.assert_close(part, whole[0][[1, 4, 7, 10]])
    assert torch.equal(sim.gradients.G[[0, 2, 3]], torch.zeros(3, 21))


def test_a_run_of_many_agents_evaluates_a_named_sample(tmp_path):
    from cdsgd.cli import main

    out = tmp_path / "run"
    assert main(["run", "n_agents=40", "dataset=digits", "model=logreg", "epochs=1", "batch_size=8",
                 f"out={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluated_agents"] == evaluation.pick_agents(40, evaluation.EVAL_AGENTS_AUTO)
    assert len(summary["evaluated_agents"]) == 32 and summary["status"] == "completed"
    main(["run", "n_agents=5", "dataset=digits", "model=logreg", "epochs=1", f"out={tmp_path / 'five'}"])
    assert json.loads((tmp_path / "five" / "summary.json").read_text())["evaluated_agents"] == [0, 1, 2, 3, 4]
