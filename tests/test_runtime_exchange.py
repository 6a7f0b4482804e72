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
    from cdsgd.mixers import MatrixMixer

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


#: symmetric within topologies.TOL, but its zero pattern is not: agent 0 averages with 1, agent 1 with nobody
ONE_SIDED = np.array([[1 - 5e-9, 5e-9], [0.0, 1.0]])


def _one_sided(rank, world, timeout):
    import time

    from cdsgd.runtime import NeighbourMixer

    t0 = time.monotonic()
    try:
        NeighbourMixer(ONE_SIDED, rank, timeout=timeout)
        refused = "not refused"
    except ValueError as e:
        refused = str(e)
    # unvalidated (as the runtime takes a directed push-sum W): the sends follow W's columns, the receives its
    # rows, so rank 1 sends to rank 0, which receives, and neither waits for a message nobody sends
    mixer = NeighbourMixer(ONE_SIDED, rank, timeout=timeout, validate=False)
    x = torch.randn(64, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    mixed = mixer.mix(x).clone()
    return refused, mixed, mixer.bytes_across, time.monotonic() - t0


def test_one_sided_zero_pattern_refused_by_name_and_never_hangs():
    timeout = 10.0
    results = run_ranks(_one_sided, 2, timeout, timeout=120, pg_timeout=30)
    X = np.stack([torch.randn(64, generator=torch.Generator().manual_seed(7 + r), dtype=torch.float64).numpy()
                  for r in range(2)])
    expected = ONE_SIDED @ X
    for rank in range(2):
        refused, mixed, across, seconds = results[rank]
        assert refused == ("mixing matrix is not symmetric: W[0, 1] = 5e-09 but W[1, 0] = 0: "
                           "the zero pattern is not symmetric")
        np.testing.assert_allclose(mixed.numpy(), expected[rank], rtol=0, atol=1e-15)
        assert seconds < timeout / 2  # no wait ran into comm_timeout
    assert results[0][2] == 0  # W[1, 0] = 0: rank 0 sends nothing
    assert results[1][2] == 64 * 8  # W[0, 1] != 0: rank 1 sends its row to rank 0, once
