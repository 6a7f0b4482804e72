"""A steady-state simulator step reuses its buffers: nothing N×P-sized (or N×batch-sized) is allocated afresh.

Fresh large buffers every step cost page faults (the kernel maps and zeroes
each new page) and memory traffic; benchmarks/scale.py reports the faults
per step. These tests check the cause deterministically: the largest tensor
any operation of a steady-state step creates does not grow with the number
of agents, and the stacks keep their memory from step to step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import topologies
from cdsgd.executor import Executor, Simulator, gradients


def _simulator(n: int, algorithm: str = "cdmsgd", **options) -> Executor:
    g = torch.Generator().manual_seed(n)
    shards = [(torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]
    W = topologies.mixing_matrix(topologies.build("ring", n), sparse=True)
    return Simulator(lambda: nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 4)), shards, W, algorithm,
                     batch_size=4, lr=0.05, **options)


def _largest_allocation(sim: Executor) -> int:
    """The most bytes one operation of a steady-state step allocated (net, as the profiler counts it)."""
    for _ in range(2):
        sim.step()  # the rule's and the mixer's own buffers are made at the first step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sim.step()
    return max(max(e.self_cpu_memory_usage, e.cpu_memory_usage if e.name == "[memory]" else 0)
               for e in prof.events())


@pytest.mark.parametrize("algorithm", ["cdmsgd", "cdsgd"])
def test_no_allocation_of_a_step_grows_with_the_number_of_agents(monkeypatch, algorithm):
    P = 24 * 32 + 32 + 32 * 4 + 4
    monkeypatch.setattr(gradients, "VMAP_BLOCK_BYTES", 8 * P * 4)  # vmap blocks of 8 agents
    small, large = (_largest_allocation(_simulator(n, algorithm)) for n in (32, 128))
    assert large <= small  # bounded by a block of agents, not by N (the stacked batches of 128 would be 49 kB)
    assert large < 8 * P * 4  # within one block's temporaries: nothing like a 128×P stack (477 kB)


def test_the_stacks_keep_their_memory_from_step_to_step():
    sim = _simulator(40)
    sim.step()
    buffers = {"X": sim.X, "G": sim.gradients.G, **{f"state {k}": v for k, v in sim.state.items()}}
    before = {k: v.data_ptr() for k, v in buffers.items()}
    for _ in range(3):
        sim.step()
    assert {k: v.data_ptr() for k, v in buffers.items()} == before
    assert sim.X.data_ptr() == before["X"] and sim.state["momentum"].data_ptr() == before["state momentum"]


def _rows_flagged(values: list[list[float]]) -> list[bool]:
    sim = _simulator(len(values))
    with torch.no_grad():
        sim.X.zero_()
        for i, row in enumerate(values):
            sim.X[i, :len(row)] = torch.tensor(row)
    watch = sim.meters.nonfinite  # as after a first step, which notes a row with k = 1; finite losses: parameters decide
    watch.check(list(range(len(values))), torch.zeros(len(values), dtype=torch.float64), sim.X, 1)
    return (watch.first[:, 0] > 0).tolist()


def test_nonfinite_parameter_rows_are_found_without_isfinite_of_the_stack():
    big = torch.finfo(torch.float32).max
    inf, nan = float("inf"), float("nan")
    # a finite row whose sum overflows is finite; +inf and -inf in one row sum to NaN and are caught
    assert _rows_flagged([[1.0], [nan], [inf], [-inf, 2.0], [big, big], [inf, -inf], [-big, -big, -big]]) == \
        [False, True, True, True, False, True, False]


def test_a_half_precision_stack_whose_row_sum_would_overflow_is_finite():
    X = torch.full((4, 30), 60000.0, dtype=torch.float16)  # each entry finite in float16, the row sum far beyond
    X[2, 5] = float("nan")
    assert gradients.nonfinite_rows(X, torch.empty(4)).tolist() == [False, False, True, False]
    assert gradients.nonfinite_rows(X, torch.empty(4), torch.tensor([True, True, False, True])).tolist() == [False] * 4
