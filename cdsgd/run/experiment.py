"""One Config → one run → the output folder of the run-output contract.

``run_experiment(cfg)`` builds the graph and mixing matrix, loads and
partitions the data, builds the model, runs the executor and writes, into
``cfg.out``:

``config.toml``
    the fully resolved config that produced the run;
``metrics.csv``
    one row per evaluation (every ``eval_every`` epochs and at the end) with
    the columns ``epoch, step, train_loss, test_loss, test_accuracy,
    test_accuracy_avg_model, consensus_distance, bytes_sent_per_agent,
    wall_seconds``; each row is flushed to disk as soon as it exists;
``summary.json``
    the final row, ``best_test_accuracy``, the config identity (algorithm,
    topology, n_agents, mixing, dataset, partition, model, seed), the
    spectral gap and lambda2, ``topology_used`` (false for the centralized
    baselines sgd, msgd, fedavg and local: no graph was built, and the gap
    is that of their averaging, :func:`~cdsgd.run.plan.baseline_gap`),
    ``status`` (``completed`` or ``interrupted``), and the versions of torch
    and cdsgd.

On Ctrl-C (or SIGTERM) a run in one process finishes the step in progress and
writes a checkpoint of it (:mod:`cdsgd.run.interrupt`), so ``resume=true``
continues from that very step; the rows of the evaluations done stay
complete, summary.json is written with ``status = "interrupted"``, and
KeyboardInterrupt propagates.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import topologies
from .. import __version__
from ..base.comm import CommError
from ..base.files import atomic_write
from ..config import Config, dump_config, load_config, short_value
from ..data import random_crop_flip
from ..executor import METRIC_COLUMNS, Diverged, Executor
from ..executor.asynchronous import executor_class
from ..executor.evaluation import default_eval_agents
from ..runtime.group import Failure, Group, LocalGroup, Terminated, join
from . import checkpoint as ckpt
from .hints import diverged_hint, eval_hint, resume_hint
from .interrupt import StopBetweenSteps
from .logger import make_logger
from .plan import Parts, Plan, hyperparameters, prepare, validate_config
from .progress import Progress, pick_mode, safe_stream

__all__ = ["CHECKPOINT_UNITS", "Diverged", "EXECUTORS", "Terminated", "default_out", "hyperparameters", "prepare",
           "run_experiment", "validate_config"]

#: executors ``cdsgd run`` knows (the distributed runtime adds "torch")
EXECUTORS = ("sim", "torch")
#: units of ``checkpoint_every``
CHECKPOINT_UNITS = ("epochs", "steps")


def default_out(cfg: Config) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{cfg.algorithm}-{short_value(cfg.topology)}-{short_value(cfg.dataset)}-{stamp}"
    return os.path.join("runs", re.sub(r"[^\w.=+-]", "_", name))  # "mine:blobs" (the user's loader) → "mine_blobs"


def _prepare_out(cfg: Config, *, resume: bool = False) -> str:
    """The output folder, made. Resuming, it may hold files, but only of a run with the same config."""
    from .preflight import output_folder  # makes it, or one line naming it and why it cannot

    out = output_folder(cfg.out or default_out(cfg), option="out=")
    if resume and (out / "config.toml").is_file():
        try:
            there = load_config(out / "config.toml")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot resume into {str(out)!r}: its config.toml does not load ({e})") from None
        diff = ckpt.config_mismatch(ckpt.config_for_checkpoint(there.__dict__),
                                    ckpt.config_for_checkpoint(cfg.__dict__))
        if diff:
            raise ValueError(f"cannot resume into {str(out)!r}: it holds a run with another config ({diff})")
    elif out.is_dir() and any(out.iterdir()) and not resume:
        sweep = (out / "results.csv").is_file() or any((d / "config.toml").is_file() for d in out.iterdir()
                                                      if d.is_dir() and d.name != "checkpoints")
        if sweep:  # overwrite=true would mix one run's files among the runs of a sweep
            raise ValueError(f"output folder {str(out)!r} holds a sweep (results.csv or run folders); "
                             "a run cannot be written into it, even with overwrite=true: choose another out=")
        if not cfg.overwrite:
            raise ValueError(f"output folder {str(out)!r} is not empty; choose another out=, set overwrite=true, "
                             "or resume=true to continue the run there")
    return str(out)


def _checkpoint_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Steps between checkpoints (0: none)."""
    if not cfg.checkpoint_every:
        return 0
    if cfg.checkpoint_unit == "steps":
        return int(cfg.checkpoint_every)
    return max(1, round(cfg.checkpoint_every * steps_per_epoch))


def _find_checkpoint(cfg: Config, out: Path, group: Group, *, log: Callable[[str], None]) -> dict | None:
    """The payload of the latest checkpoint every rank holds, loaded and checked; None if there is none."""
    rank, world = group.rank, group.world
    steps = group.agree(ckpt.steps_on_disk(out, rank))
    common = set(steps[0]).intersection(*map(set, steps[1:]))
    if not common:
        held = {r: s[-1] for r, s in enumerate(steps) if s}
        log(f"resume: no checkpoint held by all {world} rank(s) in {out / 'checkpoints'}"
            + (f" (latest per rank: {held})" if held else "") + "; starting from step 0")
        return None
    step = max(common)
    path = ckpt.checkpoint_path(out, step, rank)
    try:
        payload, problem = ckpt.load(path, config=ckpt.config_for_checkpoint(cfg.__dict__), world=world,
                                     rank=rank), None
    except ValueError as e:
        payload, problem = None, str(e)
    problems = [p for p in group.agree(problem) if p]
    if problems:  # every rank stops, with the first problem found
        raise ValueError(problems[0])
    log(f"resume: continuing from the checkpoint of step {step} ({path.parent})")
    return payload


def _json_number(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def make_executor(cfg: Config, parts: Parts, group: Group) -> Executor:
    """The executor of this process: every agent (one process) or the block of agents its rank holds."""
    return executor_class(parts.plan.algorithm)(  # AsyncExecutor for adpsgd
        parts.model_fn, parts.shards, group.mixer(parts.W, exact=cfg.exact, n_agents=cfg.n_agents), parts.plan.algorithm,
        batch_size=cfg.batch_size, seed=cfg.seed, init=cfg.init, strategy=cfg.strategy,
        test_set=parts.test_set, eval_batch_size=cfg.eval_batch_size,
        eval_agents=cfg.eval_agents or default_eval_agents(cfg.n_agents), eval_samples=cfg.eval_samples or None, exact=cfg.exact,
        augment=random_crop_flip if cfg.augment else None, overlap=cfg.overlap, device=cfg.device,
        batch_stream=parts.batch_stream, steps_per_epoch=parts.steps_per_epoch, grad_clip=cfg.grad_clip,
        agents=group.agents, reducer=group.reducer(torch.device(cfg.device)), network=parts.plan.network,
    )


def to_target(rows: list[dict], target: float) -> dict:
    """The first evaluation whose ``test_accuracy`` reaches ``target``: its step, simulated and wall seconds.

    ``{"target_accuracy": target, "steps_to_target": ..., "sim_seconds_to_target": ...,
    "wall_seconds_to_target": ...}``, the last three None when no row reaches it (or, for the
    simulated seconds, when the run has no network).

    >>> to_target([{"step": 5, "test_accuracy": 0.7, "sim_seconds": 1.0, "wall_seconds": 0.1},
    ...            {"step": 10, "test_accuracy": 0.85, "sim_seconds": 2.0, "wall_seconds": 0.2}], 0.8)["steps_to_target"]
    10
    """
    hit = next((r for r in rows if r["test_accuracy"] >= target), None)
    out = {"target_accuracy": target, "steps_to_target": None, "sim_seconds_to_target": None,
           "wall_seconds_to_target": None}
    if hit is not None:
        out.update(steps_to_target=hit["step"], sim_seconds_to_target=_json_number(hit.get("sim_seconds", float("nan"))),
                   wall_seconds_to_target=hit["wall_seconds"])
    return out


def _default_log(msg: str) -> None:
    print(msg, file=safe_stream(sys.stderr), flush=True)  # a reader gone away stops the output, not the run


def _write_failure(out: Path, cfg: Config, e: BaseException, started: float, status: str) -> None:
    """The summary.json of a run that stopped before training (e.g. its data failed to load), or whose
    summary still says ``running`` (a SIGTERM cut short the writing of its final one): ``status`` and
    the error; the fields it had are kept."""
    try:
        had = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        had = {}
    if had.get("status", "running") != "running":
        return
    summary = {**had, "status": status, "error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
               "out": str(out), **cfg.identity(), "executor": cfg.executor,
               "total_seconds": had.get("total_seconds", time.perf_counter() - started),
               "torch_version": torch.__version__, "cdsgd_version": __version__}
    if not (out / "config.toml").exists():
        atomic_write(out / "config.toml", dump_config(cfg))
    atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")


def run_experiment(cfg: Config, *, progress: bool | None = None, log: Callable[[str], None] | None = None,
                   plan: Plan | None = None) -> dict:
    """Run one experiment and write its output folder. Returns the summary dict.

    ``executor="sim"`` runs all agents in this process. ``executor="torch"``
    must run in every rank of a torchrun launch (``cdsgd launch``): rank j is
    agent j, rank 0 writes the output folder, the others write nothing there.
    Both go through the same steps; only the :class:`~cdsgd.runtime.Group` differs.

    ``progress``: a tqdm bar with evaluation lines above it (default: when
    stderr is a terminal of known size); otherwise lines through ``log``
    (default: print to stderr): one per evaluation and, between them, one
    at most every 30 s with the step and the ETA (:mod:`cdsgd.run.progress`).
    A run that meets a non-finite loss or parameter stops with status
    ``diverged`` and raises :class:`Diverged` naming the step and agent.
    ``plan``: the result of :func:`validate_config` for this config, if the
    caller has it already (the config is validated once per run).
    """
    started = time.perf_counter()
    log = log or _default_log
    plan = plan if plan is not None else validate_config(cfg)
    if cfg.exact:
        torch.set_num_threads(1)  # as each torchrun worker: identical rounding in both executors
    group = join(device=cfg.device, comm_timeout=cfg.comm_timeout, n_agents=cfg.n_agents) \
        if cfg.executor == "torch" else LocalGroup()
    completed, out, failure = False, None, None
    try:
        mode = pick_mode(sys.stderr, progress) if group.rank == 0 else "off"
        if group.rank != 0:
            log = lambda msg: None  # noqa: E731 - only rank 0 talks
        resume = cfg.resume or group.attempt > 0
        if group.attempt > 0:
            log(f"cdsgd run: attempt {group.attempt + 1} after a restart: resuming from the latest complete "
                "checkpoint" + ("" if cfg.checkpoint_every else " (checkpoint_every=0: none, so from step 0)"))
        parts = prepare(cfg, plan)  # the data loads before the output folder exists: a missing file leaves none
        out = Path(group.decide(lambda: _prepare_out(cfg, resume=resume)))
        cfg = Config(**{**cfg.__dict__, "out": str(out)})
        sim = make_executor(cfg, parts, group)
        if not resume:
            ckpt.remove_all(out)  # an earlier run's checkpoints (overwrite=true) must never be resumed into this one
        # "resume" differs between a first attempt and a restart: compare the config without it
        group.check({"mixing matrix": parts.W, "n_agents": cfg.n_agents, "world size": group.world,
                     "parameter count": sim.layout.numel,
                     "config": dump_config(Config(**{**cfg.__dict__, "resume": False}))})
        payload = _find_checkpoint(cfg, out, group, log=log) if resume else None
        summary = _drive(cfg, sim, parts, out, group, mode=mode, log=log, resume=payload, started=started)
        completed = True
        return summary
    except CommError as e:
        failure = group.diagnose(e)
        raise CommError(failure.message, e.peer) from None
    except Terminated as e:
        if isinstance(group, LocalGroup):
            raise
        failure = group.diagnose(e)
        raise Terminated(failure.message) from None
    finally:
        if not completed and out is not None and group.rank == 0:
            e = sys.exc_info()[1]  # a no-op once _drive has written its final summary
            _write_failure(out, cfg, e, started, (failure or Failure("")).status(e))  # undiagnosed: by its type
        if completed:
            group.close()
        else:
            group.release()


def _csv_row(row: dict) -> dict:
    return {k: repr(v) if isinstance(v, float) else v for k, v in row.items()}


def _drive(cfg: Config, sim: Executor, parts: Parts, out: Path, group: Group, *, mode: str,
           log: Callable[[str], None], resume: dict | None = None, started: float | None = None) -> dict:
    """Run the executor; rank 0 writes config.toml, metrics.csv, summary.json (and params.pt).

    Every process writes its own checkpoints (``checkpoint_every``).
    ``resume``: a checkpoint payload to continue from; its metrics rows are
    written again, and the run goes on from its step.
    """
    started = time.perf_counter() if started is None else started
    writer, rank, world = group.rank == 0, group.rank, group.world
    total = max(1, round(cfg.epochs * sim.steps_per_epoch))
    every = _checkpoint_steps(cfg, sim.steps_per_epoch)
    gap = parts.spectral_gap
    summary = {
        "status": "running",
        "out": str(out),
        **cfg.identity(),
        "executor": cfg.executor,
        "processes": world,
        "topology_used": parts.plan.uses_graph,  # false: sgd, msgd, fedavg, local (the gap is their averaging's)
        "spectral_gap": gap.gap,
        "lambda2": gap.lambda2,
        "effective_neighbours": _json_number(parts.plan.effective_neighbours()) if writer else None,
        "effective_neighbours_decay": topologies.EFFECTIVE_DECAY,
        "topology_draw": parts.graph.graph.get("draw") if parts.plan.uses_graph else None,  # random graphs'
        "n_parameters": sim.layout.numel,
        "steps_per_epoch": sim.steps_per_epoch,
        "strategy": sim.strategy,
        "evaluated_agents": sim.eval_agents,
        "warnings": list(parts.plan.notes),
        "torch_version": torch.__version__,
        "cdsgd_version": __version__,
    }
    rows: list[dict] = []
    before = 0.0  # seconds the run took before its checkpoint (a resumed run's total counts them)
    if resume is not None:
        sim.load_state_dict(resume["simulator"])
        if sim.k > total:
            raise ValueError(f"the checkpoint is of step {sim.k}, beyond this run's {total} steps "
                             f"(epochs={cfg.epochs:g}); a run can be extended, not shortened")
        rows = [dict(r) for r in resume["rows"]]
        before = float(resume.get("total_seconds", 0.0))
        summary["resumed_from_step"] = sim.k
    if writer:
        atomic_write(out / "config.toml", dump_config(cfg))
    graph = (f"on {cfg.topology} (n={cfg.n_agents}, spectral gap {topologies.format_gap(gap.gap)})"
             if parts.plan.uses_graph else f"(n={cfg.n_agents}, "
             f"{'all-reduce' if parts.plan.algorithm.traffic == 'allreduce' else 'no communication'}, no graph)")
    log(f"cdsgd run: {cfg.algorithm} {graph}, "
        f"{cfg.dataset}/{cfg.partition}, model {cfg.model} ({sim.layout.numel} parameters), "
        f"{total} steps, executor {cfg.executor}"
        + (f" ({cfg.n_agents // world} agent(s) in each of {world} processes)" if world > 1 else "")
        + f", output {out}"
        + (f", checkpoint every {every} steps" if every else ""))
    for note in parts.plan.notes:
        log(f"warning: {note}")
    for line in sim.algorithm.prepare(sim.mixer.at(sim.k), sim.X):  # e.g. CHOCO's consensus_step="auto"
        log(line)
    if sim.clock is not None:
        clock = sim.clock.clock
        summary.update(network_params_used=clock.spec.params(), stragglers=np.flatnonzero(clock.straggler).tolist())
        log(f"simulated network {clock.spec.name}: " + ", ".join(f"{k} {v:g}" for k, v in clock.spec.params().items()
                                                                  if v is not None) + " (sim_seconds in metrics.csv)")
    if getattr(parts.plan.algorithm, "needs_tree", False):
        summary["tree"] = sorted([min(u, v), max(u, v)] for u, v in parts.plan.graph.edges())
    eval_steps = cfg.eval_steps or cfg.eval_every * sim.steps_per_epoch
    shown = Progress(total=total, every=eval_steps, mode=mode, log=log, initial=sim.k,
                     timing=lambda: (sim._wall, sim.timed_steps, sim.eval_seconds, len(rows)))  # since step 0
    board = make_logger(cfg.logger if writer else "none", out,
                        purge_step=(sim.k + 1) if resume is not None else (0 if cfg.overwrite else None))
    board.text("config", dump_config(cfg))
    board.replay(rows)  # a resumed run's rows (those the stopped run logged already are kept as they are)
    f = open(out / "metrics.csv", "w", newline="") if writer else None
    hinted = False
    try:
        csv_writer = None
        if f is not None:
            csv_writer = csv.DictWriter(f, fieldnames=list(METRIC_COLUMNS))
            csv_writer.writeheader()
            csv_writer.writerows(_csv_row(r) for r in rows)  # a resumed run's rows up to its checkpoint
            f.flush()
            os.fsync(f.fileno())

        def on_row(row: dict) -> None:
            nonlocal hinted
            rows.append(row)
            board.row(row)
            if csv_writer is not None:
                csv_writer.writerow(_csv_row(row))
                f.flush()
                os.fsync(f.fileno())
            shown.row(f"epoch {row['epoch']:.2f}  train_loss {row['train_loss']:.4f}  "
                      f"test_acc {row['test_accuracy']:.4f}  avg_model_acc {row['test_accuracy_avg_model']:.4f}  "
                      f"consensus {row['consensus_distance']:.3g}"
                      + (f"  mgrit {row['mgrit_iters']:.1f} it, {row['mgrit_fallbacks']:.0f}/{row['mgrit_solves']:.0f} "
                         f"serial" if row.get("mgrit_solves", 0) > 0 else ""), row)
            hint = "" if hinted else eval_hint(cfg, sim)
            if hint:
                hinted = True
                shown.note(f"note: {hint}")

        def on_step(k: int) -> None:
            shown.step(k)
            board.train_loss(k, sim.last_loss)

        def save_checkpoint(k: int) -> None:
            state = {"config": ckpt.config_for_checkpoint(cfg.__dict__), "world": world,
                     "simulator": sim.state_dict(), "rows": rows,
                     "total_seconds": before + time.perf_counter() - started}
            ckpt.save(out, k, rank, state)
            sim.reducer.barrier(f"checkpoint of step {k} (waiting for every rank to write its file)")
            ckpt.prune(out, rank, keep=k)  # step k is complete on every rank: older ones are not needed

        stop = StopBetweenSteps(enabled=world == 1)  # ranks could not agree on the step to stop at

        def after_step(k: int) -> None:
            periodic = every and (k % every == 0 or k == total)  # and at the end: a finished run can be extended
            if periodic or stop.requested:  # Ctrl-C/SIGTERM held until now: a checkpoint of the step it stopped
                save_checkpoint(k)
            if stop.requested:
                summary["checkpoint_at_interruption"] = k
                stop.deliver()

        try:
            if total > sim.k:
                with stop:
                    sim.run(steps=total - sim.k, eval_every_steps=eval_steps, callback=on_row, progress=on_step,
                            after_step=after_step)
            if cfg.save_params:
                params = sim.reducer.gather(sim.X)
                if writer:
                    atomic_write(out / "params.pt", lambda f: torch.save(params.cpu(), f))
            summary["status"] = "completed"
        except Diverged as e:
            summary.update(status="diverged", error=str(e), diverged_at_step=e.step, diverged_agent=e.agent,
                           diverged_what=e.what)
            shown.close()
            log(f"cdsgd run: stopped at step {e.step} of {total}, status diverged; {diverged_hint(cfg)}")
            raise
        except (Exception, KeyboardInterrupt) as e:
            try:
                failure = group.diagnose(e)
            except Terminated:  # torchrun stopping every rank after the same loss, while this rank asked who
                failure = group.diagnose(e)  # was lost: the loss is the cause; ask again (SIGTERM comes once)
            summary["error"], summary["status"] = failure.message, failure.status(e)
            if summary["status"] == "interrupted":
                shown.close()
                saved = "checkpoint_at_interruption" in summary
                log(f"cdsgd run: interrupted at step {sim.k} of {total}; {resume_hint(cfg, out, world, saved=saved)}")
            raise
        finally:
            shown.close()
            board.close()
            final = rows[-1] if rows else {}
            accs = [r["test_accuracy"] for r in rows if not math.isnan(r["test_accuracy"])]
            summary.update({k: _json_number(v) for k, v in final.items()})
            summary["best_test_accuracy"] = max(accs) if accs else None
            summary["simulated_seconds"] = _json_number(final.get("sim_seconds", float("nan")))
            if sim.clock is not None:
                summary["lost_messages"] = sim.clock.clock.lost_messages
            if cfg.target_accuracy:
                summary.update(to_target(rows, cfg.target_accuracy))
            summary["evaluations"] = len(rows)
            summary["train_seconds"] = sim._wall
            summary["warmup_seconds"] = sim.warmup_seconds  # the first step of each process, not in train_seconds
            summary["eval_seconds"] = sim.eval_seconds
            summary["total_seconds"] = before + time.perf_counter() - started
            summary["eval_bytes_per_agent"] = int(round(sim.reducer.bytes))
            summary["bytes_across_processes"] = sim.bytes_across_processes
            summary.update(sim.algorithm.summary())
            if writer:
                atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    finally:
        if f is not None:
            f.close()
    return summary
