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
import time

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
    "sim_seconds",
    "test_loss_avg_model",  # added after the contract's first ten columns, so their places stay
    "mgrit_iters",          # MGRIT's training solves since the previous row (nan without a pgru model in mgrit mode)
    "mgrit_residual",
    "mgrit_fallbacks",
    "mgrit_solves",
)

#: per-agent columns of the MGRIT solve counts (see :func:`_mgrit_counts`), after the 11 of :func:`evaluate`
_MGRIT_KEYS = ("solves", "mgrit_solves", "iters", "fallbacks", "residual")


def _mgrit_counts(model) -> list[float]:
    """The counts of :meth:`cdsgd.mgrit.ParallelGRU.take_solve_stats` over the model's MGRIT layers, taken."""
    out = [0.0] * len(_MGRIT_KEYS)
    for m in model.modules():
        take = getattr(m, "take_solve_stats", None)
        if take is not None:
            c = take()
            out = [max(a, c[k]) if k == "residual" else a + c[k] for a, k in zip(out, _MGRIT_KEYS)]
    return out


def pick_agents(n: int, k: int | None) -> list[int]:
    """The agents evaluated: all n (k None or >= n), else k evenly spaced ones.

    >>> pick_agents(10, 3), pick_agents(4, None)
    ([0, 4, 9], [0, 1, 2, 3])
    """
    if k is None or k >= n:
        return list(range(n))
    return sorted({int(round(v)) for v in np.linspace(0, n - 1, k)})


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


def _blocks(ex):
    """The held rows as float64 blocks of about SUM_BLOCK_BYTES (one row at a time in exact mode)."""
    X = ex.X.reshape(ex.X.shape[0], -1)
    rows = 1 if ex.exact else max(1, SUM_BLOCK_BYTES // (8 * max(1, X.shape[1])))
    for b0 in range(0, X.shape[0], rows):
        yield X[b0:b0 + rows].double()


def _total(ex, local: torch.Tensor) -> list[float]:
    """Σ over all N agents of each column of the held agents' L×k figures, correctly rounded (math.fsum).

    The per-agent figures are gathered in agent order, so the sum is the same
    number whichever process holds which agent.
    """
    return [math.fsum(col) for col in ex.reducer.agent_values(local).t().tolist()]


def average_params(ex) -> torch.Tensor:
    """x̄ = (1/N) Σ_j x_j over all agents (a P-vector).

    Fast mode: float64 block sums, added across processes. Exact mode: the
    rows are added one by one in agent order, across processes too
    (:meth:`Reducer.sum_in_order`), so x̄ is bit-identical in every layout.
    """
    if ex.exact:
        def add(acc):
            for row in _blocks(ex):
                acc.add_(row[0])

        total = ex.reducer.sum_in_order(torch.zeros(ex.layout.numel, dtype=torch.float64, device=ex.device), add)
    else:
        local = torch.zeros(ex.layout.numel, dtype=torch.float64, device=ex.device)
        for block in _blocks(ex):
            local.add_(block.sum(dim=0))
        total = ex.reducer.sum(local)
    return (total / ex.n_agents).to(ex.dtype)


def _distances(ex, xbar: torch.Tensor) -> torch.Tensor:
    """‖x_j − x̄‖² of each held agent (float64, on the CPU)."""
    xbar = xbar.double()
    return torch.cat([((block - xbar) ** 2).sum(dim=1).cpu() for block in _blocks(ex)])


def consensus_distance(ex, xbar: torch.Tensor | None = None) -> float:
    """sqrt(mean_j ‖x_j − x̄‖²) over all agents."""
    xbar = average_params(ex) if xbar is None else xbar
    return math.sqrt(_total(ex, _distances(ex, xbar).unsqueeze(1))[0] / ex.n_agents)


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


def _mgrit_row(counts: torch.Tensor) -> dict:
    """``mgrit_iters`` (mean V-cycles of an MGRIT solve), ``mgrit_residual`` (largest relative residual of the
    states and adjoints used; 0 for serial ones), ``mgrit_fallbacks`` (solves done by the serial loop) and
    ``mgrit_solves`` (forward and adjoint solves), over all agents since the previous row; nan without any."""
    solves, mgrit_solves, iters, fallbacks = (math.fsum(col) for col in counts[:, :4].t().tolist())
    if not solves:
        return dict.fromkeys(("mgrit_iters", "mgrit_residual", "mgrit_fallbacks", "mgrit_solves"), float("nan"))
    return {"mgrit_iters": iters / mgrit_solves if mgrit_solves else 0.0, "mgrit_residual": float(counts[:, 4].max()),
            "mgrit_fallbacks": fallbacks, "mgrit_solves": solves}


def evaluate(ex) -> dict:
    """A metrics row for the executor's current state; resets its train-loss window.

    Every sum over agents is a correctly rounded sum of per-agent figures
    gathered in agent order (one gather per evaluation), so a row does not
    depend on how the agents are spread over processes. Also sets
    ``ex.bytes_across_processes``: the training bytes all processes have
    sent to other processes so far.
    """
    t0 = time.perf_counter()
    L = len(ex.agents)
    # columns: train-loss sum, train-loss count, ‖x_j − x̄‖², bytes sent, bytes across processes
    # (on the process's first agent), test loss, test accuracy, average-model accuracy and loss (on agent 0),
    # then (not summed) the first non-finite step of each agent and whether its parameters were so
    # then the MGRIT solve counts (_MGRIT_KEYS: summed, the residual's maximum taken)
    per = torch.zeros(L, 11 + len(_MGRIT_KEYS), dtype=torch.float64)
    per[:, 9:11] = ex._nonfinite
    if len(ex.models) == L:
        per[:, 11:] = torch.tensor([_mgrit_counts(m) for m in ex.models], dtype=torch.float64)
    per[:, 0], per[:, 1] = ex._loss_sums, ex._loss_counts
    ex._loss_sums.zero_()
    ex._loss_counts.zero_()
    xbar = average_params(ex)
    per[:, 2] = _distances(ex, xbar)
    per[:, 3] = ex.mixer.bytes_sent.cpu()
    per[0, 4] = ex.mixer.bytes_across
    if ex.test_set is not None:
        for m in ex.models:
            m.eval()
        try:
            held = [i for i, j in enumerate(ex.agents) if j in ex.eval_agents]
            loss, acc = eval_params(ex, ex.X[held], held)
            per[held, 5], per[held, 6] = torch.as_tensor(loss), torch.as_tensor(acc)
            if 0 in ex.agents:  # one process evaluates x̄; the sum hands its accuracy to every process
                i0 = ex.agents.index(0)
                avg_loss, avg_acc = eval_params(ex, xbar.unsqueeze(0), [i0])
                per[i0, 7], per[i0, 8] = float(avg_acc[0]), float(avg_loss[0])
        finally:
            for m in ex.models:
                m.train()
    every = ex.reducer.agent_values(per)
    loss_sum, loss_count, dist2, sent, across, t_loss, t_acc, acc_avg, loss_avg = (
        math.fsum(col) for col in every[:, :9].t().tolist())
    if ex.diverged is None and bool(every[:, 9].any()):  # the first step, then the lowest agent
        step, agent = min((int(s), j) for j, s in enumerate(every[:, 9].tolist()) if s)
        ex.diverged = (step, agent, "parameters" if every[agent, 10] else "training loss")
    ex.bytes_across_processes = across
    row = {
        "epoch": ex.k / ex.steps_per_epoch,
        "step": ex.k,
        "train_loss": loss_sum / loss_count if loss_count else float("nan"),
        "test_loss": float("nan"),
        "test_accuracy": float("nan"),
        "test_accuracy_avg_model": float("nan"),
        "consensus_distance": math.sqrt(dist2 / ex.n_agents),
        "bytes_sent_per_agent": sent / ex.n_agents,
        "wall_seconds": ex._wall,
        # the simulated network's clock (cdsgd.executor.timing): one more sum over processes when there is one
        "sim_seconds": math.nan if ex.clock is None else ex.clock.flush(ex.reducer),
        "test_loss_avg_model": float("nan"),
        **_mgrit_row(every[:, 11:]),
    }
    if ex.test_set is not None:
        count = len(ex.eval_agents)
        row.update(test_loss=t_loss / count, test_accuracy=t_acc / count, test_accuracy_avg_model=acc_avg,
                   test_loss_avg_model=loss_avg)
    ex.eval_seconds += time.perf_counter() - t0
    return row
