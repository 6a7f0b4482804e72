"""Per-edge messages (Mixer.edges / Mixer.exchange): closed form in one process, and across gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import topologies
from cdsgd.mixers import MatrixMixer
from cdsgd.mixers.edges import edge_table
from dist_harness import run_ranks


def _messages(edges: np.ndarray, width: int, dtype=torch.float64) -> torch.Tensor:
    """M[e] for e = (i, l): a row that names its sender and receiver (1000·i + l, then 0, 1, 2, ... added)."""
    base = torch.tensor([1000.0 * i + l for i, l in edges.tolist()], dtype=torch.float64)
    return (base[:, None] + torch.arange(width, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("name,n", [("ring", 6), ("star", 5), ("torus", 9), ("erdos_renyi", 8)])
def test_simulator_exchange_is_the_reversed_edge(name, n):
    G = topologies.build(name, n)
    m = MatrixMixer(topologies.mixing_matrix(G))
    E = m.edges
    assert len(E) == 2 * G.number_of_edges()
    assert sorted(map(tuple, E.tolist())) == sorted([(u, v) for u, v in G.edges()] + [(v, u) for u, v in G.edges()])
    assert E.tolist() == sorted(E.tolist())  # sorted by sender, then receiver
    M = _messages(E, 3)
    R = m.exchange(M).wait()
    expect = torch.stack([_messages(np.array([[l, i]]), 3)[0] for i, l in E.tolist()])
    assert torch.equal(R, expect)
    degrees = np.array([G.degree(j) for j in range(n)])
    assert m.bytes_sent.tolist() == (degrees * 3 * 8).tolist()  # out-degree × one row's bytes


def test_exchange_result_is_new_or_out_and_refuses_overlap():
    m = MatrixMixer(topologies.mixing_matrix(topologies.build("path", 3)))
    M = _messages(m.edges, 2)
    R = m.exchange(M).wait()
    assert R.data_ptr() != M.data_ptr()
    out = torch.empty_like(M)
    assert m.exchange(M, out=out).wait() is out
    with pytest.raises(ValueError, match="shares memory"):
        m.exchange(M, out=M)
    with pytest.raises(ValueError, match="one message per edge"):
        m.exchange(M[:2])


def test_weighted_sum_is_the_mixing():
    """Σ over received rows with W's weights is Π X (the exact order and the padded one)."""
    W = topologies.mixing_matrix(topologies.build("erdos_renyi", 7, p=0.5, seed=1))
    m = MatrixMixer(W)
    X = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    table = edge_table(m)
    R = m.exchange(X.index_select(0, table.senders(X.device))).wait()
    expect = torch.as_tensor(W) @ X
    for exact in (False, True):
        got = table.weighted_sum(X, R, torch.empty_like(X), exact=exact)
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-14)
    exact = table.weighted_sum(X, R, torch.empty_like(X), exact=True)
    assert torch.equal(exact, MatrixMixer(W, exact=True).mix(X))  # the simulator's exact order, bit for bit


def _rank_exchange(rank, world, cases):
    from cdsgd.runtime import BlockMixer

    out = []
    for W, width, dtype in cases:
        mixer = BlockMixer(W, rank, world, timeout=30)
        M = _messages(mixer.edges, width, dtype)
        R = mixer.exchange(M).wait().clone()
        out.append((mixer.edges.copy(), R, mixer.bytes_sent.clone(), mixer.bytes_across))
    return out


def test_runtime_exchange_matches_the_simulator_blocks_and_single_agents():
    ring6 = topologies.mixing_matrix(topologies.build("ring", 6))
    star6 = topologies.mixing_matrix(topologies.build("star", 6))
    cases = [(ring6, 4, torch.float64), (star6, 3, torch.float32), (ring6, 7, torch.uint8)]
    results = run_ranks(_rank_exchange, 2, cases, timeout=120)
    for c, (W, width, dtype) in enumerate(cases):
        sim = MatrixMixer(W)
        want = sim.exchange(_messages(sim.edges, width, dtype)).wait()
        got_edges = np.concatenate([results[r][c][0] for r in range(2)])
        got = torch.cat([results[r][c][1] for r in range(2)])
        assert got_edges.tolist() == sim.edges.tolist()
        assert torch.equal(got, want)
        assert torch.cat([results[r][c][2] for r in range(2)]).tolist() == sim.bytes_sent.tolist()
        row = width * torch.empty(0, dtype=dtype).element_size()
        for r in range(2):  # bytes really sent to the other process: one row per cut edge leaving this block
            held = set(range(3 * r, 3 * r + 3))
            cut = sum(1 for i, l in sim.edges.tolist() if i in held and l not in held)
            assert results[r][c][3] == cut * row
