"""Process groups (cdsgd.runtime.group) and the one P2P convention (cdsgd.base.comm), in real gloo processes."""

from __future__ import annotations

import math

import pytest
import torch

import topologies
from cdsgd.base.comm import CommError
from cdsgd.runtime import Failure, LocalGroup, Terminated
from dist_harness import run_ranks


def _subgroup_exchange(rank, world):
    """Ranks 1..3 form a subgroup; inside it, group rank g sends g to group rank (g+1) mod 3."""
    import torch.distributed as dist

    from cdsgd.base.comm import exchange, wait
    from cdsgd.runtime import NeighbourMixer

    group = dist.new_group([1, 2, 3])
    if rank == 0:
        dist.barrier()  # rank 0 hosts the store: it stays until the others are done with it
        return None
    g = dist.get_rank(group)
    x, buf = torch.full((3,), float(g)), torch.empty(3)
    works = exchange([("send", x, (g + 1) % 3), ("recv", buf, (g - 1) % 3)], group=group, what="ring shift")
    for w in works:
        wait(w, 30, "ring shift")
    # the neighbour mixer takes the same convention: a 3-ring inside the subgroup
    W = topologies.mixing_matrix(topologies.build("ring", 3))
    mixed = NeighbourMixer(W, g, group=group, timeout=30).mix(torch.full((2,), float(g)))
    dist.barrier()
    return g, buf.tolist(), mixed.tolist()


def test_peers_are_ranks_of_the_given_group():
    results = run_ranks(_subgroup_exchange, 4, timeout=120)
    assert results[0] is None
    for rank in (1, 2, 3):
        g, got, mixed = results[rank]
        assert g == rank - 1
        assert got == [float((g - 1) % 3)] * 3  # from the previous group rank, not global rank g-1
        assert mixed == pytest.approx([1.0] * 2)  # a 3-ring averages 0, 1, 2 with weight 1/3 each


def _avg_model_row(rank, world):
    from torch import nn

    from cdsgd.executor import Executor
    from cdsgd.runtime import DistReducer, NeighbourMixer

    g = torch.Generator().manual_seed(3)
    X = torch.randn(64, 4, generator=g)
    y = (X[:, 0] > 0).long()
    shards = [(X[i::world], y[i::world]) for i in range(world)]
    W = topologies.mixing_matrix(topologies.build("ring", world))
    ex = Executor.build(lambda: nn.Linear(4, 2), shards, NeighbourMixer(W, rank, timeout=30), "cdsgd", lr=0.3,
                  batch_size=8, agents=[rank], reducer=DistReducer(timeout=30), test_set=(X, y))
    for _ in range(3):
        ex.step()
    return ex.evaluate()


def test_average_model_metrics_are_the_same_number_on_every_rank():
    rows = run_ranks(_avg_model_row, 3, timeout=120)
    values = [rows[r]["test_accuracy_avg_model"] for r in range(3)]
    assert not any(math.isnan(v) for v in values)
    assert values[0] == values[1] == values[2]
    # the whole row is the same on every rank, but for each rank's own wall clock; with no simulated
    # network sim_seconds is NaN everywhere (and NaN != NaN, so it is checked apart)
    assert all(math.isnan(r["sim_seconds"]) for r in rows.values())
    same = [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()
             if k not in ("wall_seconds", "sim_seconds")} for r in rows.values()]
    assert same[0] == same[1] == same[2]
    assert all(same[0][k] == "nan" for k in ("mgrit_iters", "mgrit_residual", "mgrit_fallbacks", "mgrit_solves"))


def test_local_group_is_one_process_that_agrees_with_itself():
    g = LocalGroup()
    assert (g.rank, g.world, g.attempt) == (0, 1, 0)
    assert g.agree("x") == ["x"] and g.decide(lambda: 7) == 7
    assert g.diagnose(ValueError("bad\nsecond line")).message == "bad"
    assert g.diagnose(Terminated()).message == "SIGTERM"


@pytest.mark.parametrize("error,lost,stopped,status", [
    (ValueError("x"), [], False, "failed"),
    (CommError("x", peer=2), [2], False, "failed"),
    (CommError("x", peer=2), [], True, "interrupted"),    # a neighbour left because the launcher stopped the run
    (KeyboardInterrupt(), [], False, "interrupted"),
    (Terminated(), [1], False, "failed"),                 # torchrun's SIGTERM after a rank died
])
def test_failure_status(error, lost, stopped, status):
    assert Failure("m", lost, stopped).status(error) == status


def _store(world, *, down=(), elsewhere=()):
    """A rendezvous store as the ranks leave it: who runs where, and who said it was going down."""
    import os
    import socket

    import torch.distributed as dist

    store = dist.HashStore()
    for r in range(world):  # ranks in ``elsewhere`` run on another host (no local pid to check)
        host = "another-host" if r in elsewhere else socket.gethostname()
        store.set(f"cdsgd/proc/rank{r}", f"{host} {os.getpid()}")
    for r in down:
        store.set(f"cdsgd/down/rank{r}", "1")
    return store


def test_a_neighbour_that_left_after_its_own_failure_is_not_named_lost():
    """Ring 0-1-2-3: rank 3 (another host) dies; ranks 0 and 2 fail and leave; rank 1 then sees rank 0's connection
    close. Rank 0 said it was going down, so rank 1 must not record it as lost: it names the silent rank 3."""
    from cdsgd.runtime.group import _lost_ranks

    store = _store(4, down=(0, 2), elsewhere=(3,))
    e = CommError("rank 1: receiving parameters from neighbour rank 0 failed: Connection reset by peer", 0)
    assert _lost_ranks(store, e, 1, 4) == ([3], 1, False)
    assert not store.check(["cdsgd/lost/rank"])  # the knock-on was not recorded for the others to read


def test_a_knock_on_failure_reads_the_record_of_the_first_report():
    """Once a neighbour of the dead rank recorded it, a rank failing by a knock-on reads that record."""
    import threading

    from cdsgd.runtime.group import _lost_ranks

    store = _store(4, down=(0,), elsewhere=(3,))
    first = CommError("rank 2: receiving parameters from neighbour rank 3 failed", 3)
    later = threading.Timer(0.2, lambda: _lost_ranks(store, first, 2, 4))
    later.start()  # rank 2's report arrives while rank 1 waits
    try:
        knock_on = CommError("rank 1: receiving parameters from neighbour rank 0 failed", 0)
        assert _lost_ranks(store, knock_on, 1, 4) == ([3], 2, False)
    finally:
        later.join()


def test_a_vanished_peer_is_recorded_by_the_first_rank_to_see_it():
    from cdsgd.runtime.group import _lost_ranks

    store = _store(3)
    e = CommError("rank 0: receiving parameters from neighbour rank 1 failed", 1)
    assert _lost_ranks(store, e, 0, 3) == ([1], 0, False)
    assert store.get("cdsgd/lost/rank").decode() == "1 0"
