"""Many agents per rank: the block mixer against the simulator's mixer, and hybrid runs against the simulator.

Mixing units run in real gloo processes (``run_ranks``); whole runs are real
``cdsgd launch`` torchrun launches on 127.0.0.1. Every launch has a hard timeout.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import topologies
from dist_harness import run_ranks
from test_runtime_run import BASE, NO_WALL, cli, metrics, run_pair

from cdsgd.algorithms import make_algorithm
from cdsgd.mixers import MatrixMixer
from cdsgd.runtime import agent_block

P = 37  # parameters per agent in the mixing units


def _stack(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, P, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mix_block(rank, world, W, exact):
    from cdsgd.runtime import BlockMixer

    mixer = BlockMixer(W, rank, world, timeout=30, exact=exact)
    X = _stack(W.shape[0])[mixer.agents].contiguous()
    first = mixer.mix(X).clone()
    second = mixer.start(X * 2).wait().clone()  # buffers are reused: a second step is right too
    mask = torch.zeros(W.shape[0], dtype=torch.bool)
    mask[::3] = True
    avg = mixer.average(X, mask).clone()
    return (mixer.agents, first, second, avg, mixer.bytes_sent.clone(), mixer.bytes_across, mixer.neighbours,
            len(mixer.halo_agents))


CASES = {
    "ring12/3": (topologies.build("ring", 12), 3),
    "torus16/4": (topologies.build("torus", 16), 4),
    "er12/2": (topologies.build("erdos_renyi", 12, p=0.4, seed=3), 2),
    "star8/4": (topologies.build("star", 8), 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("exact", [False, True])
def test_block_mixing_equals_the_simulators(case, exact):
    G, world = CASES[case]
    n = G.number_of_nodes()
    W = topologies.mixing_matrix(G)
    results = run_ranks(_mix_block, world, W, exact, timeout=120)
    X = _stack(n)
    sim = MatrixMixer(W, exact=exact)
    want = sim.mix(X).clone()
    want2 = sim.mix(X * 2).clone()
    per = n // world
    A = (W != 0) & ~np.eye(n, dtype=bool)
    for r in range(world):
        agents, first, second, avg, sent, across, neighbours, halo = results[r]
        assert agents == list(range(r * per, (r + 1) * per))
        if exact:  # the same ordered multiply-adds as the simulator's exact mode
            assert torch.equal(first, want[agents]) and torch.equal(second, want2[agents])
        else:
            torch.testing.assert_close(first, want[agents], rtol=0, atol=1e-13)
            torch.testing.assert_close(second, want2[agents], rtol=0, atol=1e-13)
        torch.testing.assert_close(avg, X[::3].mean(dim=0).expand(per, P), rtol=0, atol=1e-13)
        if exact:  # the masked mean summed in agent order, bit for bit as the simulator's exact mode
            mask = torch.zeros(n, dtype=torch.bool)
            mask[::3] = True
            assert torch.equal(avg, sim.average(X, mask)[agents])
        # per agent: degree × P × 8 bytes per mixing (two mixings), plus the all-reduce's 2(N−1)/N·P·8
        degree = A[agents].sum(axis=1)
        np.testing.assert_allclose(sent.numpy(), 2 * degree * P * 8 + 2 * (n - 1) / n * P * 8)
        # across processes: each held row once to every other rank with an agent that uses it
        owners = np.arange(n) // per
        rows_out = sum(len(set(owners[A[:, j]]) - {r}) for j in agents)
        # the all-average: an all-reduce of P values, or in exact mode an all-gather of the block (summed in
        # agent order on every rank, as the simulator's exact mode sums it)
        average = (world - 1) * per * P * 8 if exact else 2 * (world - 1) / world * P * 8
        assert across == pytest.approx(2 * rows_out * P * 8 + average)
        assert neighbours == sorted(set(owners[A[agents].any(axis=0)]) - {r})
        assert halo == len({l for j in agents for l in np.flatnonzero(A[j]) if owners[l] != r})


def test_ring_blocks_are_arcs_that_exchange_two_rows():
    """A ring of 12 on 3 ranks: each rank talks to 2 ranks, sends its 2 end rows, receives 2 (one from each)."""
    W = topologies.mixing_matrix(topologies.build("ring", 12))
    results = run_ranks(_mix_block, 3, W, False, timeout=120)
    for r in range(3):
        _, _, _, _, _, across, neighbours, halo = results[r]
        assert neighbours == sorted({(r - 1) % 3, (r + 1) % 3}) and halo == 2


@pytest.mark.parametrize("n,world", [(6, 4), (3, 6), (5, 0)])
def test_agent_block_refuses_uneven_splits(n, world):
    with pytest.raises(ValueError, match=f"{world} processes but n_agents={n}: the number of processes must divide"):
        agent_block(n, world, 0)


# ---------------------------------------------------------------- whole runs

HYBRID = ["dataset=digits", "model=mlp", "epochs=2", "batch_size=16", "save_params=true"]


def _run_pair(tmp_path, n, procs, extra):
    return run_pair(tmp_path, [*HYBRID, f"n_agents={n}", *extra], procs, launch_timeout=300)


@pytest.mark.parametrize("n,procs,topology,alg,extra", [
    (8, 2, "ring", "cdmsgd", []),
    (16, 4, "torus", "cdmsgd", []),
    (8, 2, "ring", "dsgt", []),  # two exchanges in flight per step (parameters and tracker)
    (8, 2, "ring", "d2", ["mixing=lazy_metropolis"]),
    (8, 2, "ring", "qg_dsgdm", []),
    (8, 2, "one_peer_exponential", "cdmsgd", []),  # time-varying: each step exchanges with that step's peers
    (8, 2, "directed_ring", "sgp", ["mixing=push_sum"]),  # push-sum: sends and receives differ
])
def test_hybrid_exact_mode_bit_identical_to_the_simulator(tmp_path, n, procs, topology, alg, extra):
    sim, tor = _run_pair(tmp_path, n, procs, [f"algorithm={alg}", "exact=true", f"topology={topology}", *extra])
    assert torch.equal(torch.load(sim / "params.pt"), torch.load(tor / "params.pt"))
    ms, mt = metrics(sim), metrics(tor)
    assert len(ms) == len(mt) == 2
    for a, b in zip(ms, mt):
        assert {k: a[k] for k in NO_WALL} == {k: b[k] for k in NO_WALL}
    s_sim, s_tor = (json.loads((p / "summary.json").read_text()) for p in (sim, tor))
    assert s_tor["processes"] == procs and s_sim["processes"] == 1
    assert s_sim["bytes_across_processes"] == 0
    # the rows that cross the cut: a ring of 8 in 2 arcs sends 2 rows each way per step; a 4×4 torus in
    # 4 strips of one row sends each row up and down (4 rows to each of 2 ranks); a schedule, its W_k's
    steps = int(mt[-1]["step"])
    if topology in topologies.SCHEDULES:
        s = topologies.schedule(topology, n)
        rows = sum(_cut_rows(np.asarray(s[k]), procs) for k in range(steps))
    else:
        mixing = next((a.split("=")[1] for a in extra if a.startswith("mixing=")), "metropolis")
        rows = _cut_rows(topologies.mixing_matrix(topologies.build(topology, n), mixing), procs) * steps
        assert topology != "ring" or rows == 2 * 2 * steps
        assert topology != "torus" or rows == 4 * 8 * steps
    per_row = s_tor["n_parameters"] * make_algorithm(alg, lr=0.1).vectors_per_step + (alg == "sgp")  # + w_j
    assert s_tor["bytes_across_processes"] == rows * per_row * 4


def _cut_rows(W: np.ndarray, procs: int) -> int:
    """Rows one step sends between processes: each agent's row once to every other rank that uses it."""
    n = W.shape[0]
    owner = np.arange(n) // (n // procs)
    uses = (W != 0) & ~np.eye(n, dtype=bool)  # uses[i, l]: agent i mixes x_l
    return sum(len(set(owner[uses[:, l]]) - {owner[l]}) for l in range(n))


@pytest.mark.parametrize("alg,extra", [
    ("cdsgd", ["lr=0.1", "topology=erdos_renyi", "topology_params.p=0.5"]),
    ("sgd", ["lr=0.1"]),
    ("fedavg", ["lr=0.1", "local_steps=3", "topology=complete"]),
])
def test_hybrid_agrees_with_the_simulator(tmp_path, alg, extra):
    sim, tor = _run_pair(tmp_path, 8, 2, [f"algorithm={alg}", *extra])
    for a, b in zip(metrics(sim), metrics(tor)):
        for k in NO_WALL:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (k, a[k], b[k])
    torch.testing.assert_close(torch.load(tor / "params.pt"), torch.load(sim / "params.pt"), rtol=0, atol=1e-5)


def _hybrid_launch(out, *more):
    from test_runtime_reliability import launch

    return launch(out, "n_agents=8", "epochs=6", nproc=2, more=list(more))


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    """An uninterrupted hybrid launch: 8 agents on 2 ranks, a checkpoint each epoch."""
    from test_runtime_reliability import uninterrupted

    return uninterrupted(tmp_path_factory, _hybrid_launch, "hybrid-ref")


def test_hybrid_rank_killed_with_restart_ends_bit_identical(hybrid_reference, tmp_path):
    """A rank holding 4 agents is SIGKILLed; the restarted ranks resume their blocks from the checkpoint."""
    from test_runtime_reliability import restart_ends_as

    out = tmp_path / "run"
    restart_ends_as(hybrid_reference, _hybrid_launch(out, "--max-restarts", "1"), out, tmp_path / "log", world=2)


def test_hybrid_rank_killed_without_restarts_is_named(tmp_path):
    from launch_harness import finish, start
    from test_runtime_reliability import COMM_TIMEOUT, kill_rank_after_checkpoint

    out, log = tmp_path / "run", tmp_path / "log"
    p = start(_hybrid_launch(out), {}, log)
    try:
        kill_rank_after_checkpoint(p, out, 1, world=2)
        p.wait(timeout=COMM_TIMEOUT + 20)
    finally:
        finish([p], 1)
    text = log.read_text()
    assert p.returncode != 0, text
    assert any("rank 0: lost rank 1" in line for line in text.splitlines()), text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "lost rank 1" in summary["error"], summary


def test_launch_refuses_processes_that_do_not_divide_n_agents():
    r = cli("launch", "--nproc-per-node", "3", *BASE, "n_agents=8", timeout=60)
    assert r.returncode == 2 and "3 processes but n_agents=8" in r.stderr and "must divide" in r.stderr
