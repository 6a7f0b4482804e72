"""Runtime guarantees in real gloo processes: no collectives in CDSGD steps,
agreement at start, and a silent or dead neighbour is an error naming it."""

from __future__ import annotations

import os
import time

import pytest
import torch

import topologies
from dist_harness import run_ranks

COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "all_gather_object", "reduce", "barrier",
               "monitored_barrier", "reduce_scatter", "all_to_all", "gather", "scatter",
               "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]


class CollectiveCalled(RuntimeError):
    pass


def _forbid_collectives():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved = []
    for name in COLLECTIVES:
        for mod in (dist, c10d):
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))

                def boom(*a, _name=name, **k):
                    raise CollectiveCalled(f"collective {_name} called during a training step")

                setattr(mod, name, boom)
    return saved


def _restore(saved):
    for mod, name, fn in saved:
        setattr(mod, name, fn)


def _steps(rank, world, algorithm, hyper):
    from torch import nn

    from cdsgd.runtime import DistReducer, NeighbourMixer
    from cdsgd.simulator import Simulator

    W = topologies.mixing_matrix(topologies.build("ring", world))
    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(world)]
    sim = Simulator(lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), shards,
                    NeighbourMixer(W, rank, timeout=30), algorithm, batch_size=4, agents=[rank],
                    reducer=DistReducer(), **hyper)
    saved = _forbid_collectives()
    try:
        for _ in range(6):
            sim.step()
        result = ("ok", float(sim.mixer.bytes_sent[0]), sim.layout.numel)
    except CollectiveCalled as e:
        result = ("collective", str(e), 0)
    finally:
        _restore(saved)
    return result


@pytest.mark.parametrize("algorithm,hyper", [("cdsgd", {"lr": 0.1}), ("cdmsgd", {"lr": 0.1, "momentum": 0.9})])
def test_cdsgd_steps_issue_no_collective(algorithm, hyper):
    results = run_ranks(_steps, 4, algorithm, hyper, timeout=120)
    for rank, (status, sent, P) in results.items():
        assert status == "ok", sent
        assert sent == 2 * P * 4 * 6  # ring degree 2, float32, 6 steps


def test_the_proof_catches_collectives():
    """The same harness fails centralized SGD, which must all-reduce: the patch is effective."""
    results = run_ranks(_steps, 4, "sgd", {"lr": 0.1}, timeout=120)
    assert all(r[0] == "collective" and "all_reduce" in r[1] for r in results.values())


def _agree(rank, world):
    from cdsgd.runtime import check_agreement

    W = topologies.mixing_matrix(topologies.build("star" if rank == 2 else "ring", world))
    try:
        check_agreement({"mixing matrix": W, "n_agents": world, "config": {"lr": 0.1}})
    except ValueError as e:
        return str(e)
    return "agreed"


def test_ranks_disagreeing_on_the_matrix_are_named():
    results = run_ranks(_agree, 4, timeout=120)
    for msg in results.values():
        assert msg.startswith("ranks disagree at start: mixing matrix differs: ranks [0, 1, 3] have ")
        assert "; ranks [2] have " in msg
        assert "n_agents" not in msg and "config" not in msg


def _silent(rank, world, timeout):
    import torch.distributed as dist

    from cdsgd.runtime import CommError, NeighbourMixer

    W = topologies.mixing_matrix(topologies.build("ring", world))
    if rank == world - 1:
        # stalled but alive: wait for a message nobody sends, until the group's own timeout
        try:
            dist.recv(torch.zeros(1), src=0, tag=77)
        except RuntimeError:
            pass
        return ("stalled", 0.0)
    t0 = time.monotonic()
    try:
        NeighbourMixer(W, rank, timeout=timeout).mix(torch.ones(100))
    except CommError as e:
        return (str(e), time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


def test_stalled_neighbour_times_out_naming_it():
    results = run_ranks(_silent, 3, 2.0, timeout=90, pg_timeout=10)
    for rank in (0, 1):  # both are neighbours of rank 2 on a ring of 3
        msg, waited = results[rank]
        assert f"rank {rank}: " in msg and "neighbour rank 2" in msg and "comm_timeout=2 s" in msg, msg
        assert 1.5 < waited < 10


def _dead(rank, world):
    from cdsgd.runtime import CommError, NeighbourMixer

    W = topologies.mixing_matrix(topologies.build("ring", world))
    if rank == 1:
        os._exit(0)  # the process vanishes
    t0 = time.monotonic()
    try:
        NeighbourMixer(W, rank, timeout=20).mix(torch.ones(100))
    except CommError as e:
        return (str(e), time.monotonic() - t0)
    return ("no error", 0.0)


def test_dead_neighbour_is_an_error_naming_it():
    """A vanished peer: its neighbours' exchange fails at once (connection closed), naming it."""
    results = run_ranks(_dead, 3, timeout=90, expect_exit=frozenset({1}))
    assert results[1] == ("exited", 0)
    for rank in (0, 2):  # both neighbours of rank 1 on a ring of 3
        msg, waited = results[rank]
        # the failure shows either while waiting (naming rank 1) or already when posting the batch
        # (gloo then cannot say which peer closed: both neighbours are named)
        assert msg.startswith(f"rank {rank}: "), msg
        assert "neighbour rank 1" in msg or "neighbour ranks [0, 1]" in msg or "neighbour ranks [1, 2]" in msg, msg
        assert waited < 20  # well before comm_timeout=20 s: the closed connection is noticed
