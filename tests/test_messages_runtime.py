"""choco and relaysum on the runtime: bit for bit the simulator in exact mode, compressed bytes across
processes (measured), and checkpoints that restore every piece of their state."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import topologies
from cdsgd import Simulator
from cdsgd.algorithms import make_compressor
from test_runtime_run import NO_WALL, metrics, run_pair

RUN = ["dataset=digits", "model=mlp", "epochs=2", "batch_size=16", "save_params=true", "n_agents=8", "exact=true"]


@pytest.mark.parametrize("name,extra", [
    ("choco", ["algorithm=choco", "topology=ring", "compression=top_k", "compression_params.ratio=0.05",
               "consensus_step=0.4"]),
    ("relaysum", ["algorithm=relaysum", "topology=path"]),
])
def test_runtime_is_the_simulator_bit_for_bit_with_the_bytes_that_crossed(tmp_path, name, extra):
    sim, tor = run_pair(tmp_path, [*RUN, *extra], 2, launch_timeout=300)
    assert torch.equal(torch.load(sim / "params.pt"), torch.load(tor / "params.pt"))
    for a, b in zip(metrics(sim), metrics(tor), strict=True):
        assert {k: a[k] for k in NO_WALL} == {k: b[k] for k in NO_WALL}
    s = json.loads((tor / "summary.json").read_text())
    steps, P = int(metrics(tor)[-1]["step"]), s["n_parameters"]
    if name == "choco":
        # a ring of 8 in two arcs: 2 cut edges, each carrying one message each way per step
        message = make_compressor("top_k", {"ratio": 0.05}).message_bytes(P, torch.float32)
        assert s["bytes_across_processes"] == 4 * message * steps
        assert message * 10 <= P * 4  # 5 % of the values with their int32 indices: a tenth of the vector's bytes
        assert s["consensus_step_used"] == 0.4
    else:
        # a path of 8 in two halves: one cut edge, a message each way per step: the relayed sum and its count
        assert s["bytes_across_processes"] == 2 * (P + 1) * 4 * steps
        assert s["tree"] == [[i, i + 1] for i in range(7)]


def _shards(n=6, per=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(per, 5, generator=g), torch.randint(0, 3, (per,), generator=g)) for _ in range(n)]


def _sim(alg, W, **hyper):
    return Simulator(lambda: nn.Linear(5, 3), _shards(), W, alg, batch_size=4, seed=3, lr=0.1, **hyper)


@pytest.mark.parametrize("alg,graph,hyper", [
    ("choco", "ring", {"compression": "random_k", "compression_params": {"ratio": 0.3}, "consensus_step": "auto"}),
    ("choco", "ring", {"compression": "qsgd", "compression_params": {"levels": 4}, "momentum": 0.9,
                       "consensus_step": 0.2}),
    ("relaysum", "star", {"momentum": 0.9}),
    ("beer", "ring", {"compression": "random_k", "compression_params": {"ratio": 0.3}, "consensus_step": 0.3}),
])
def test_checkpoint_resume_restores_the_compression_and_relay_state_bit_for_bit(alg, graph, hyper):
    W = topologies.mixing_matrix(topologies.build(graph, 6))
    straight = _sim(alg, W, **hyper)
    straight.run(steps=14)
    first = _sim(alg, W, **hyper)
    first.run(steps=6)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = _sim(alg, W, **hyper)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.run(steps=8)
    assert torch.equal(resumed.X, straight.X)
    assert torch.equal(resumed.mixer.bytes_sent, straight.mixer.bytes_sent)
    for key in straight.state:  # public copies, their mixed sum, relayed messages, momentum
        assert torch.equal(resumed.state[key], straight.state[key]), key
