"""Process groups (cdsgd.runtime.group) and the one P2P convention (cdsgd.comm), in real gloo processes."""

from __future__ import annotations

import math

import pytest
import torch

import topologies
from cdsgd.comm import CommError
from cdsgd.runtime import Failure, LocalGroup, Terminated
from dist_harness import run_ranks


def _subgroup_exchange(rank, world):
    """Ranks 1..3 form a subgroup; inside it, group rank g sends g to group rank (g+1) mod 3."""
    import torch.distributed as dist

    from cdsgd.comm import exchange, wait
    from cdsgd.runtime import NeighbourMixer

    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    g = dist.get_rank(group)
    x, buf = torch.full((3,), float(g)), torch.empty(3)
    works = exchange([("send", x, (g + 1) % 3), ("recv", buf, (g - 1) % 3)], group=group, what="ring shift")
    for w in works:
        wait(w, 30, "ring shift")
    # the neighbour mixer takes the same convention: a 3-ring inside the subgroup
    W = topologies.mixing_matrix(topologies.build("ring", 3))
    mixed = NeighbourMixer(W, g, group=group, timeout=30).mix(torch.full((2,), float(g)))
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
    ex = Executor(lambda: nn.Linear(4, 2), shards, NeighbourMixer(W, rank, timeout=30), "cdsgd", lr=0.3,
                  batch_size=8, agents=[rank], reducer=DistReducer(timeout=30), test_set=(X, y))
    for _ in range(3):
        ex.step()
    return ex.evaluate()


def test_average_model_metrics_are_the_same_number_on_every_rank():
    rows = run_ranks(_avg_model_row, 3, timeout=120)
    values = [rows[r]["test_accuracy_avg_model"] for r in range(3)]
    assert not any(math.isnan(v) for v in values)
    assert values[0] == values[1] == values[2]
    # the whole row is the same on every rank, but for each rank's own wall clock
    same = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows.values()]
    assert same[0] == same[1] == same[2]


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
