"""Evaluation of the agents an executor holds: one metrics row of the run-output contract.

A row (:data:`METRIC_COLUMNS`) holds the mean train loss since the last
row, each evaluated agent's test loss and accuracy averaged over the
evaluated agents (under churn, over those online at the last step: x̄ and
the consensus distance too), the test accuracy of the average model
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

import numpy as np
import torch

from ..base.checks import check_int
from ..base.seeding import generator
from .meters import ModelStats

# Every function takes the executor ``ex`` (cdsgd.executor.Executor) that holds the agents.

__all__ = ["CONTRACT_COLUMNS", "EVAL_AGENTS_AUTO", "Evaluator", "METRIC_COLUMNS", "TEXT_COLUMNS", "average_params",
           "consensus_distance", "default_eval_agents", "eval_params", "evaluate", "online_agents", "pick_agents",
           "text_figures"]

#: the columns of the run-output contract, in order (model statistics follow: :data:`METRIC_COLUMNS`)
CONTRACT_COLUMNS = (
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
)

#: a language model's figures, derived from the test losses (nats per token) of the agents and of x̄:
#: bits per byte L / (ln 2 · bytes per token) and perplexity exp(L); NaN unless the test set is text
#: (the :class:`Evaluator` was given ``bytes_per_token``). Next-token accuracy is ``test_accuracy``.
TEXT_COLUMNS = ("test_bits_per_byte", "test_perplexity", "test_bits_per_byte_avg_model", "test_perplexity_avg_model")

#: the columns of a metrics row: the contract's, then those the models' statistics hook provides
#: (:class:`cdsgd.executor.meters.ModelStats`; NaN where no model reports them), then :data:`TEXT_COLUMNS`
METRIC_COLUMNS = CONTRACT_COLUMNS + ModelStats.columns() + TEXT_COLUMNS


class Evaluator:
    """What evaluation looks at: the test set (on ``device``, cut to a seeded random ``eval_samples``),
    the evaluated agents (``eval_agents`` evenly spaced of ``n_agents``; all when None) and the
    test inputs per forward pass. It holds no state that a checkpoint needs.

        >>> ev = Evaluator((torch.zeros(10, 2), torch.zeros(10, dtype=torch.long)), 5, eval_agents=2, eval_samples=4)
        >>> ev.eval_agents, len(ev.test_set[1])
        ([0, 4], 4)
    """

    def __init__(self, test_set: tuple[torch.Tensor, torch.Tensor] | None, n_agents: int, *,
                 eval_agents: int | None = None, eval_samples: int | None = None, eval_batch_size: int = 1024,
                 seed: int = 0, device: torch.device | str | None = None,
                 bytes_per_token: float | None = None) -> None:
        self.eval_batch_size = check_int("eval_batch_size", eval_batch_size)
        if bytes_per_token is not None and not (math.isfinite(bytes_per_token) and bytes_per_token > 0):
            raise ValueError(f"bytes_per_token must be a positive number (None: not text), got {bytes_per_token!r}")
        self.bytes_per_token = bytes_per_token  # text: the figures of TEXT_COLUMNS are reported
        if eval_agents is not None:
            check_int("eval_agents", eval_agents)
        if eval_samples is not None:
            check_int("eval_samples", eval_samples)
        self.eval_agents = pick_agents(n_agents, eval_agents)
        self.test_set = None
        if test_set is not None:
            tx, ty = test_set
            if eval_samples is not None and eval_samples < len(ty):
                keep = torch.randperm(len(ty), generator=generator(seed, "eval"))[:eval_samples]
                tx, ty = tx[keep], ty[keep]
            self.test_set = (tx.to(device), ty.to(device)) if device is not None else (tx, ty)


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


def online_agents(ex) -> np.ndarray | None:
    """The boolean N-vector of the agents online at the executor's last step (churn), or None: all of them."""
    members = getattr(ex, "membership", None)
    return None if members is None or members.current.all() else members.current


def _online_count(ex) -> int:
    online = online_agents(ex)
    return ex.n_agents if online is None else int(online.sum())


def _blocks(ex):
    """The held rows as float64 blocks of about SUM_BLOCK_BYTES (one row at a time in exact mode); under churn
    the online agents' rows only."""
    X = ex.X.reshape(ex.X.shape[0], -1)
    online = online_agents(ex)
    if online is not None:
        X = X[torch.as_tensor(np.flatnonzero(online[ex.agents]), device=X.device)]
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
    """x̄ = (1/N) Σ_j x_j over all agents (a P-vector); under churn, the mean over the agents online.

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
    online = _online_count(ex)  # 0 under churn with nobody online: x̄ is undefined
    return (total / online).to(ex.dtype) if online else torch.full_like(total, math.nan, dtype=ex.dtype)


def _distances(ex, xbar: torch.Tensor) -> torch.Tensor:
    """‖x_j − x̄‖² of each held agent (float64, on the CPU; 0 for an offline one)."""
    xbar = xbar.double()
    online = online_agents(ex)
    d = [((block - xbar) ** 2).sum(dim=1).cpu() for block in _blocks(ex)]
    d = torch.cat(d) if d else torch.zeros(0, dtype=torch.float64)
    if online is None:
        return d
    full = torch.zeros(len(ex.agents), dtype=torch.float64)
    full[torch.as_tensor(np.flatnonzero(online[ex.agents]))] = d
    return full


def consensus_distance(ex, xbar: torch.Tensor | None = None) -> float:
    """sqrt(mean_j ‖x_j − x̄‖²) over all agents (under churn, those online)."""
    xbar = average_params(ex) if xbar is None else xbar
    return math.sqrt(_total(ex, _distances(ex, xbar).unsqueeze(1))[0] / _online_count(ex))


@torch.no_grad()
def eval_params(ex, flats: torch.Tensor, model_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Mean test loss and accuracy of each row of ``flats`` (evaluated with local module ``model_ids[i]``)."""
    tx, ty = ex.evaluator.test_set
    n, size = len(ty), ex.evaluator.eval_batch_size
    loss_sum = np.zeros(len(model_ids))
    correct = np.zeros(len(model_ids))
    if not model_ids:
        return loss_sum, correct
    for start in range(0, n, size):
        xb, yb = tx[start:start + size], ty[start:start + size]
        for i, o in enumerate(ex.gradients.outputs(flats, model_ids, xb)):
            loss_sum[i] += float(ex.loss_fn(o, yb)) * len(yb)
            if o.dim() == yb.dim() + 1 and not yb.is_floating_point():  # classes; for a sequence, every position
                hits = (o.argmax(dim=-1) == yb).double()
                correct[i] += float(hits.reshape(len(yb), -1).mean(dim=1).sum())
    return loss_sum / n, correct / n


def text_figures(test_loss: float, test_loss_avg_model: float, bytes_per_token: float | None) -> dict:
    """The :data:`TEXT_COLUMNS` of a row from its test losses L (nats per token): bits per byte
    L / (ln 2 · bytes per token) and perplexity exp(L); NaN for all when ``bytes_per_token`` is None.

        >>> text_figures(math.log(2), math.log(4), 1.0)["test_bits_per_byte_avg_model"]
        2.0
        >>> round(text_figures(1.0, 2.0, 1.0)["test_perplexity"], 4)
        2.7183
    """
    if bytes_per_token is None:
        return dict.fromkeys(TEXT_COLUMNS, math.nan)
    per_byte = 1.0 / (math.log(2.0) * bytes_per_token)

    def perplexity(loss: float) -> float:
        return math.inf if loss > 709.0 else math.exp(loss)  # past exp's float range; NaN stays NaN

    return {"test_bits_per_byte": test_loss * per_byte, "test_perplexity": perplexity(test_loss),
            "test_bits_per_byte_avg_model": test_loss_avg_model * per_byte,
            "test_perplexity_avg_model": perplexity(test_loss_avg_model)}


def _held_figures(ex) -> torch.Tensor:
    """The held agents' L×(11 + stats) figures of one row, before they are gathered over all agents.

    Columns: train-loss sum, train-loss count, ‖x_j − x̄‖², bytes sent, bytes across processes (on the
    process's first agent), test loss, test accuracy, average-model accuracy and loss (on agent 0), then
    (not summed) the first non-finite step of each agent and whether its parameters were so, then the
    models' statistics (:class:`~cdsgd.executor.meters.ModelStats`).
    """
    L, meters = len(ex.agents), ex.meters
    per = torch.zeros(L, 11 + meters.stats.width, dtype=torch.float64)
    per[:, 9:11] = meters.nonfinite.first
    per[:, 11:] = meters.stats.take(L)
    per[:, 0], per[:, 1] = meters.loss.take()
    xbar = average_params(ex)
    per[:, 2] = _distances(ex, xbar)
    per[:, 3] = ex.mixer.bytes_sent.cpu()
    per[0, 4] = ex.mixer.bytes_across
    if ex.evaluator.test_set is not None:
        models = ex.stack.models
        for m in models:
            m.eval()
        try:
            online = online_agents(ex)
            held = [i for i, j in enumerate(ex.agents) if j in ex.evaluator.eval_agents
                    and (online is None or online[j])]
            loss, acc = eval_params(ex, ex.X[held], held)
            per[held, 5], per[held, 6] = torch.as_tensor(loss), torch.as_tensor(acc)
            first = 0 if online is None else int(np.flatnonzero(online)[0]) if online.any() else -1
            if first in ex.agents:  # one process evaluates x̄; the sum hands its accuracy to every process
                i0 = ex.agents.index(first)
                avg_loss, avg_acc = eval_params(ex, xbar.unsqueeze(0), [i0])
                per[i0, 7], per[i0, 8] = float(avg_acc[0]), float(avg_loss[0])
        finally:
            for m in models:
                m.train()
    return per


def evaluate(ex) -> tuple[dict, tuple[int, int, str] | None, float]:
    """A metrics row for the executor's current state (resets its train-loss window), the first
    divergence seen by any process ((step, agent, what) or None), and the training bytes all processes
    have sent to other processes so far.

    Every sum over agents is a correctly rounded sum of per-agent figures
    gathered in agent order (one gather per evaluation), so a row does not
    depend on how the agents are spread over processes.
    """
    every = ex.reducer.agent_values(_held_figures(ex))
    loss_sum, loss_count, dist2, sent, across, t_loss, t_acc, acc_avg, loss_avg = (
        math.fsum(col) for col in every[:, :9].t().tolist())
    diverged = None
    if bool(every[:, 9].any()):  # the first step, then the lowest agent
        step, agent = min((int(s), j) for j, s in enumerate(every[:, 9].tolist()) if s)
        diverged = (step, agent, "parameters" if every[agent, 10] else "training loss")
    clock = ex.meters.clock
    row = {
        "epoch": ex.k / ex.steps_per_epoch,
        "step": ex.k,
        "train_loss": loss_sum / loss_count if loss_count else float("nan"),
        "test_loss": float("nan"),
        "test_accuracy": float("nan"),
        "test_accuracy_avg_model": float("nan"),
        "consensus_distance": math.sqrt(dist2 / _online_count(ex)) if _online_count(ex) else math.nan,
        "bytes_sent_per_agent": sent / ex.n_agents,
        "wall_seconds": ex.meters.timer.train_seconds,
        # the simulated network's clock (cdsgd.executor.timing): one more sum over processes when there is one
        "sim_seconds": math.nan if clock is None else clock.flush(ex.reducer),
        "test_loss_avg_model": float("nan"),
        **ModelStats.row(every[:, 11:]),
    }
    online = online_agents(ex)
    count = sum(1 for j in ex.evaluator.eval_agents if online is None or online[j])  # 0: nobody online (churn)
    if ex.evaluator.test_set is not None and count:
        row.update(test_loss=t_loss / count, test_accuracy=t_acc / count, test_accuracy_avg_model=acc_avg,
                   test_loss_avg_model=loss_avg)
    row.update(text_figures(row["test_loss"], row["test_loss_avg_model"], ex.evaluator.bytes_per_token))
    return row, diverged, across
