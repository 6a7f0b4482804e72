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


def _steps(rank, world, algorithm, hyper, per=1):
    """Six steps of ``per`` agents per rank on a ring of world·per agents, every collective forbidden."""
    from torch import nn

    from cdsgd.runtime import BlockMixer, DistReducer
    from cdsgd.executor import Simulator

    n = world * per
    W = topologies.mixing_matrix(topologies.build("ring", n))
    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]
    mixer = BlockMixer(W, rank, world, timeout=30)
    sim = Simulator(lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), shards,
                    mixer, algorithm, batch_size=4, agents=mixer.agents, reducer=DistReducer(), **hyper)
    saved = _forbid_collectives()
    try:
        for _ in range(6):
            sim.step()
        result = ("ok", sim.mixer.bytes_sent.tolist(), sim.layout.numel)
    except CollectiveCalled as e:
        result = ("collective", str(e), 0)
    finally:
        _restore(saved)
    return result


@pytest.mark.parametrize("algorithm,hyper,per", [("cdsgd", {"lr": 0.1}, 1), ("cdmsgd", {"lr": 0.1, "momentum": 0.9}, 1),
                                                 ("cdmsgd", {"lr": 0.1, "momentum": 0.9}, 3)])
def test_cdsgd_steps_issue_no_collective(algorithm, hyper, per):
    results = run_ranks(_steps, 4, algorithm, hyper, per, timeout=120)
    for rank, (status, sent, P) in results.items():
        assert status == "ok", sent
        assert sent == [2 * P * 4 * 6] * per  # ring degree 2, float32, 6 steps, per agent


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


def _signal(signals, name):
    with open(os.path.join(signals, name), "w"):
        pass


def _await_signals(signals, names, timeout, what):
    """Poll for the files ``names`` in ``signals`` (AssertionError after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(signals, n)) for n in names):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def _dead(rank, world, comm_timeout, signals):
    """Rank 1 vanishes while both its neighbours have their exchange with it posted.

    The two survivors are neighbours of each other too. Each stays until both have seen the failure:
    a survivor that left early would close its own connections and become a second vanished
    neighbour of the other. No wait depends on the machine's speed: every one is bounded by
    comm_timeout, like the runtime's waits on a peer.
    """
    from cdsgd.runtime import CommError, NeighbourMixer

    W = topologies.mixing_matrix(topologies.build("ring", world))
    survivors = [r for r in range(world) if r != 1]
    posted = [f"posted{r}" for r in survivors]
    if rank == 1:
        _await_signals(signals, posted, comm_timeout, "both neighbours to post their exchange")
        os._exit(0)  # the process vanishes
    mixer = NeighbourMixer(W, rank, timeout=comm_timeout)
    t0 = time.monotonic()
    try:
        handle = mixer.start(torch.ones(100))
        _signal(signals, f"posted{rank}")
        _await_signals(signals, posted, comm_timeout, "the other neighbour to post its exchange")
        t0 = time.monotonic()  # rank 1 is leaving now
        handle.wait()
        result = ("no error", time.monotonic() - t0)
    except CommError as e:
        result = (str(e), time.monotonic() - t0)
    _signal(signals, f"done{rank}")
    _await_signals(signals, [f"done{r}" for r in survivors], 2 * comm_timeout, "the other neighbour's error")
    return result


#: seconds for spawning the ranks, importing and joining the group on a loaded machine (a hang guard only)
_STARTUP = 90


def test_dead_neighbour_is_an_error_naming_it(tmp_path):
    """A vanished peer: its neighbours' exchange fails at once (connection closed), naming it."""
    comm_timeout = 20.0
    # the ranks' own waits add up to at most 4 comm_timeouts (see _dead)
    results = run_ranks(_dead, 3, comm_timeout, str(tmp_path), timeout=_STARTUP + 4 * comm_timeout,
                        expect_exit=frozenset({1}))
    assert results[1] == ("exited", 0)
    for rank in (0, 2):  # both neighbours of rank 1 on a ring of 3
        msg, waited = results[rank]
        assert msg.startswith(f"rank {rank}: ") and "neighbour rank 1" in msg, msg
        assert waited < comm_timeout  # the closed connection is noticed, not waited out
