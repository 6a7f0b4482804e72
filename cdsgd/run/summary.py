"""summary.json of a run: what it is (identity, versions), what it was built as, how it ended.

The dict is assembled here and only here: :func:`summary_identity` (every summary, a failed run's too),
:func:`summary_start` (before training), :func:`summary_end` (after it, however it stopped).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import topologies
import torch

from .. import __version__
from ..config import Config
from ..base.files import atomic_write
from ..executor import Executor
from ..executor.membership import MEMBERSHIP_COLUMNS
from .plan import Parts

__all__ = ["TARGETS", "json_number", "summary_end", "summary_identity", "summary_start", "to_target", "versions",
           "write_membership"]


def json_number(v):
    """``v`` as JSON has it: NaN becomes None."""
    return None if isinstance(v, float) and math.isnan(v) else v


#: what a target is reached by: the metrics column, whether reaching means at least (or at most) the target,
#: and the summary keys of the target, the steps, simulated and wall seconds to it
TARGETS = {
    "accuracy": ("test_accuracy", True,
                 ("target_accuracy", "steps_to_target", "sim_seconds_to_target", "wall_seconds_to_target")),
    "loss": ("test_loss", False,
             ("target_loss", "steps_to_target_loss", "sim_seconds_to_target_loss", "wall_seconds_to_target_loss")),
}


def to_target(rows: list[dict], target: float, kind: str = "accuracy") -> dict:
    """The first evaluation whose ``test_accuracy`` reaches ``target`` (kind ``"accuracy"``: at least it)
    or whose ``test_loss`` does (kind ``"loss"``: at most it): its step, simulated and wall seconds.

    ``{"target_accuracy": target, "steps_to_target": ..., "sim_seconds_to_target": ...,
    "wall_seconds_to_target": ...}`` (for a loss: ``target_loss``, ``steps_to_target_loss``, ...), the last
    three None when no row reaches it (or, for the simulated seconds, when the run has no network).

    >>> rows = [{"step": 5, "test_accuracy": 0.7, "test_loss": 2.0, "sim_seconds": 1.0, "wall_seconds": 0.1},
    ...         {"step": 10, "test_accuracy": 0.85, "test_loss": 1.2, "sim_seconds": 2.0, "wall_seconds": 0.2}]
    >>> to_target(rows, 0.8)["steps_to_target"], to_target(rows, 1.5, "loss")["steps_to_target_loss"]
    (10, 10)
    """
    column, at_least, (key, steps, sim, wall) = TARGETS[kind]
    hit = next((r for r in rows if (r[column] >= target if at_least else r[column] <= target)), None)
    out = {key: target, steps: None, sim: None, wall: None}
    if hit is not None:
        out.update({steps: hit["step"], sim: json_number(hit.get("sim_seconds", float("nan"))),
                    wall: hit["wall_seconds"]})
    return out


def summary_identity(cfg: Config, out: Path) -> dict:
    """What every summary.json says of its run, finished or not: folder, config identity, executor."""
    return {"out": str(out), **cfg.identity(), "executor": cfg.executor}


def versions() -> dict:
    """The versions of torch and cdsgd, the last keys of every summary.json."""
    return {"torch_version": torch.__version__, "cdsgd_version": __version__}


def summary_start(cfg: Config, sim: Executor, parts: Parts, out: Path, world: int, writer: bool) -> dict:
    """The summary of a run about to train: what it is and what it was built as (status ``running``)."""
    gap, plan = parts.spectral_gap, parts.plan
    summary = {
        "status": "running",
        **summary_identity(cfg, out),
        "processes": world,
        "topology_used": plan.uses_graph,  # false: sgd, msgd, fedavg, local (the gap is their averaging's)
        "spectral_gap": gap.gap,
        "lambda2": gap.lambda2,
        "effective_neighbours": json_number(plan.effective_neighbours()) if writer else None,
        "effective_neighbours_decay": topologies.EFFECTIVE_DECAY,
        "topology_draw": parts.graph.graph.get("draw") if plan.uses_graph else None,  # random graphs'
        "n_parameters": sim.layout.numel,
        "steps_per_epoch": sim.steps_per_epoch,
        "strategy": sim.strategy,
        "evaluated_agents": sim.eval_agents,
        "warnings": list(plan.notes),
        **({} if parts.bigram_loss is None else {"bigram_loss": parts.bigram_loss}),  # text: the floor to beat
        **versions(),
    }
    return summary


def summary_end(summary: dict, cfg: Config, sim: Executor, rows: list[dict], seconds: float) -> None:
    """Fill ``summary`` with how the run ended: the last row, the best accuracy, time, bytes, the rule's choices."""
    final = rows[-1] if rows else {}
    accs = [r["test_accuracy"] for r in rows if not math.isnan(r["test_accuracy"])]
    summary.update({k: json_number(v) for k, v in final.items()})
    summary["best_test_accuracy"] = max(accs) if accs else None
    summary["simulated_seconds"] = json_number(final.get("sim_seconds", float("nan")))
    if sim.clock is not None:
        summary["lost_messages"] = sim.clock.clock.lost_messages
    if getattr(sim, "membership", None) is not None:
        summary.update(sim.membership.summary())  # churn: changes, departures, returns, agents online
    if cfg.target_accuracy:
        summary.update(to_target(rows, cfg.target_accuracy))
    if cfg.target_loss:
        summary.update(to_target(rows, cfg.target_loss, "loss"))
    summary["evaluations"] = len(rows)
    summary["train_seconds"] = sim.train_seconds
    summary["warmup_seconds"] = sim.warmup_seconds  # the first step of each process, not in train_seconds
    summary["eval_seconds"] = sim.eval_seconds
    summary["total_seconds"] = seconds
    summary["eval_bytes_per_agent"] = int(round(sim.reducer.bytes))
    summary["bytes_across_processes"] = sim.bytes_across_processes
    summary.update(sim.algorithm.summary())


def write_membership(out: Path | None, sim: Executor) -> None:
    """membership.csv in ``out`` (rank 0; None: nothing), when the run has a membership that changes."""
    members = getattr(sim, "membership", None)
    if out is None or members is None:
        return

    def write(f) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(MEMBERSHIP_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in r.items()} for r in members.rows)
        f.write(text.getvalue().encode())

    atomic_write(out / "membership.csv", write)
