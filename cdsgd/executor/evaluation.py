"""Evaluation of the agents an executor holds: one metrics row of the run-output contract.

A row (:data:`METRIC_COLUMNS`) holds the mean train loss since the last
row, each evaluated agent's test loss and accuracy averaged over the
evaluated agents, the test accuracy of the average model
x̄ = (1/N) Σ_j x_j, the consensus distance sqrt(mean_j ‖x_j − x̄‖²), and the
mean bytes each agent has sent. Sums over agents go through the executor's
Reducer, so every process holding agents evaluates together and gets the
same row, the average model's accuracy included (the process holding agent
0 evaluates x̄; the others add 0 to the same sum).

Cost is bounded by ``eval_batch_size`` (test inputs per forward pass),
``eval_agents`` (k evenly spaced agents) and ``eval_samples`` (a fixed
seeded subset of the test set).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

# Every function takes the executor ``ex`` (cdsgd.executor.Executor) that holds the agents.

__all__ = ["EVAL_AGENTS_AUTO", "METRIC_COLUMNS", "average_params", "consensus_distance", "default_eval_agents", "eval_params",
           "evaluate", "pick_agents"]

#: the columns of a metrics row, in the order of the run-output contract
METRIC_COLUMNS = (
    "epoch",
    "step",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "test_accuracy_avg_model",
    "consensus_distance",
    "bytes_sent_per_agent",
    "wall_seconds",
)


def pick_agents(n: int, k: int | None) -> list[int]:
    """The agents evaluated: all n (k None or >= n), else k evenly spaced ones.

    >>> pick_agents(10, 3), pick_agents(4, None)
    ([0, 4, 9], [0, 1, 2, 3])
    """
    if k is None or k >= n:
        return list(range(n))
    return sorted({int(round(v)) for v in np.linspace(0, n - 1, k)})


def _sum(ex, values: Sequence[float]) -> list[float]:
    """Sum over all agents of per-process partial sums (float64)."""
    return ex.reducer.sum(torch.tensor(values, dtype=torch.float64)).tolist()


#: sums over the parameter stack take this many bytes of float64 rows at a time (no N×P temporary)
SUM_BLOCK_BYTES = 1 << 25

#: ``cdsgd run`` with ``eval_agents=0`` evaluates every agent up to this many, else this many evenly spaced
EVAL_AGENTS_AUTO = 32


def default_eval_agents(n: int) -> int | None:
    """The agents a run evaluates when the config leaves ``eval_agents`` at 0: None (all) or a count.

    >>> default_eval_agents(5), default_eval_agents(1000)
    (None, 32)
    """
    return None if n <= EVAL_AGENTS_AUTO else EVAL_AGENTS_AUTO


def _blocks(X: torch.Tensor):
    rows = max(1, SUM_BLOCK_BYTES // (8 * max(1, X.shape[1])))
    for b0 in range(0, X.shape[0], rows):
        yield X[b0:b0 + rows].double()


def average_params(ex) -> torch.Tensor:
    """x̄ = (1/N) Σ_j x_j over all agents (a P-vector)."""
    local = None
    for block in _blocks(ex.X):
        part = block.sum(dim=0)
        local = part if local is None else local.add_(part)
    total = ex.reducer.sum(local)
    return (total / ex.n_agents).to(ex.dtype)


def consensus_distance(ex, xbar: torch.Tensor | None = None) -> float:
    """sqrt(mean_j ‖x_j − x̄‖²) over all agents."""
    xbar = (average_params(ex) if xbar is None else xbar).double()
    local = sum(float(((block - xbar) ** 2).sum()) for block in _blocks(ex.X))
    return math.sqrt(_sum(ex, [local])[0] / ex.n_agents)


@torch.no_grad()
def eval_params(ex, flats: torch.Tensor, model_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Mean test loss and accuracy of each row of ``flats`` (evaluated with local module ``model_ids[i]``)."""
    tx, ty = ex.test_set
    n = len(ty)
    loss_sum = np.zeros(len(model_ids))
    correct = np.zeros(len(model_ids))
    if not model_ids:
        return loss_sum, correct
    for start in range(0, n, ex.eval_batch_size):
        xb, yb = tx[start:start + ex.eval_batch_size], ty[start:start + ex.eval_batch_size]
        for i, o in enumerate(ex.gradients.outputs(flats, model_ids, xb)):
            loss_sum[i] += float(ex.loss_fn(o, yb)) * len(yb)
            if o.dim() == 2 and yb.dim() == 1:
                correct[i] += float((o.argmax(dim=1) == yb).sum())
    return loss_sum / n, correct / n


def evaluate(ex) -> dict:
    """A metrics row for the executor's current state; resets its train-loss window."""
    loss_sum, loss_count = _sum(ex, [ex._loss_sum, float(ex._loss_count)])
    ex._loss_sum, ex._loss_count = 0.0, 0
    xbar = average_params(ex)
    row = {
        "epoch": ex.k / ex.steps_per_epoch,
        "step": ex.k,
        "train_loss": loss_sum / loss_count if loss_count else float("nan"),
        "test_loss": float("nan"),
        "test_accuracy": float("nan"),
        "test_accuracy_avg_model": float("nan"),
        "consensus_distance": consensus_distance(ex, xbar),
        "bytes_sent_per_agent": _sum(ex, [float(ex.mixer.bytes_sent.sum())])[0] / ex.n_agents,
        "wall_seconds": ex._wall,
    }
    if ex.test_set is None:
        return row
    for m in ex.models:
        m.eval()
    try:
        held = [i for i, j in enumerate(ex.agents) if j in ex.eval_agents]
        loss, acc = eval_params(ex, ex.X[held], held)
        acc_avg = 0.0
        if 0 in ex.agents:  # one process evaluates x̄; the sum below hands its accuracy to every process
            acc_avg = float(eval_params(ex, xbar.unsqueeze(0), [ex.agents.index(0)])[1][0])
        t_loss, t_acc, acc_avg = _sum(ex, [float(loss.sum()), float(acc.sum()), acc_avg])
    finally:
        for m in ex.models:
            m.train()
    count = len(ex.eval_agents)
    row.update(test_loss=t_loss / count, test_accuracy=t_acc / count, test_accuracy_avg_model=acc_avg)
    return row
