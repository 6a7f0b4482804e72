"""The neighbour exchange against closed form, in real gloo processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import topologies
from dist_harness import run_ranks

GRAPHS = {
    "ring": lambda n: topologies.build("ring", n),
    "star": lambda n: topologies.build("star", n),
    "complete": lambda n: topologies.build("complete", n),
    "erdos_renyi": lambda n: topologies.build("erdos_renyi", n, p=0.6, seed=2),
    "path": lambda n: topologies.build("path", n),
}
RULES = ["metropolis", "max_degree", "lazy_metropolis"]


def _exchange(rank, world, cases):
    from cdsgd.runtime import NeighbourMixer

    out = []
    for W in cases:
        mixer = NeighbourMixer(W, rank, timeout=30)
        x_const = torch.full((1000,), float(rank), dtype=torch.float64)
        x_rand = torch.randn(257, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
        a = mixer.mix(x_const).clone()
        h = mixer.start(x_rand.unsqueeze(0))  # a 1×P stack works too
        b = h.wait().clone()
        out.append((a, b, float(mixer.bytes_sent[0]), len(mixer.neighbours)))
    return out


def test_exchange_closed_form_many_graphs_and_rules():
    world = 4
    cases = [topologies.mixing_matrix(build(world), rule) for build in GRAPHS.values() for rule in RULES]
    results = run_ranks(_exchange, world, cases, timeout=120)
    xs_rand = np.stack([torch.randn(257, generator=torch.Generator().manual_seed(100 + r),
                                    dtype=torch.float64).numpy() for r in range(world)])
    for c, W in enumerate(cases):
        for j in range(world):
            a, b, sent, deg = results[j][c]
            # x_l = l: agent j receives exactly Σ_l π_jl · l
            np.testing.assert_allclose(a.numpy(), np.full(1000, W[j] @ np.arange(world)), rtol=0, atol=1e-14)
            np.testing.assert_allclose(b.numpy().ravel(), W[j] @ xs_rand, rtol=0, atol=1e-14)
            assert deg == np.count_nonzero(W[j]) - 1
            assert sent == deg * (1000 + 257) * 8  # bytes: degree × P × element size per exchange


def test_exchange_torus_nine_ranks():
    W = topologies.mixing_matrix(topologies.build("torus", 9))
    results = run_ranks(_exchange, 9, [W], timeout=180)
    for j in range(9):
        a, _, _, deg = results[j][0]
        assert deg == 4
        np.testing.assert_allclose(a.numpy(), np.full(1000, W[j] @ np.arange(9)), rtol=0, atol=1e-14)


def _exact_match(rank, world, W):
    """The runtime's sum equals the simulator's exact mode bit for bit."""
    from cdsgd.runtime import NeighbourMixer

    x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    return NeighbourMixer(W, rank, exact=True).mix(x).clone()


def test_runtime_mixing_bit_identical_to_simulator_exact_mode():
    from cdsgd.mixing import MatrixMixer

    W = topologies.mixing_matrix(topologies.build("erdos_renyi", 4, p=0.7, seed=5))
    results = run_ranks(_exact_match, 4, W, timeout=120)
    X = torch.stack([torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(4)])
    sim = MatrixMixer(W, exact=True).mix(X)
    for j in range(4):
        assert torch.equal(results[j], sim[j])


def _average(rank, world, mask):
    from cdsgd.runtime import NeighbourMixer

    W = topologies.mixing_matrix(topologies.build("ring", world))
    x = torch.full((10,), float(rank + 1))
    return NeighbourMixer(W, rank).average(x, mask).clone()


@pytest.mark.parametrize("mask", [None, torch.tensor([True, False, True, False])])
def test_average_all_and_masked(mask):
    results = run_ranks(_average, 4, mask, timeout=120)
    expected = 2.5 if mask is None else 2.0  # mean of 1..4, or of ranks 0 and 2 (values 1 and 3)
    for j in range(4):
        assert torch.equal(results[j], torch.full((10,), expected))
