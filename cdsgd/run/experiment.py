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
``membership.csv``
    under churn (``membership = "elastic"``), one row per step at which
    agents left or came back: :data:`~cdsgd.executor.membership.MEMBERSHIP_COLUMNS`
    (rewritten whole at each evaluation);
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
from ..base.comm import CommError
from ..base.files import atomic_write
from ..config import Config, dump_config, load_config, short_value
from ..executor import METRIC_COLUMNS, Diverged, Executor
from ..runtime.elastic import adopt, check_launched, fault, join_run, resume_point
from ..runtime.group import Failure, Group, LocalGroup, Terminated, join
from . import checkpoint as ckpt
from .hints import diverged_hint, eval_hint, resume_hint
from .interrupt import StopBetweenSteps
from .logger import make_logger
from .plan import Parts, Plan, build_executor, hyperparameters, prepare, validate_config
from .progress import Progress, pick_mode, safe_stream
from .summary import summary_end, summary_identity, summary_start, versions, write_membership

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


def _find_checkpoint(cfg: Config, out: Path, group: Group, sim: Executor, *,
                     log: Callable[[str], None]) -> dict | None:
    """The payload of the latest checkpoint every rank holds (under elastic membership: but those the run had
    lost, which take the lowest holder's state, :func:`cdsgd.runtime.elastic.resume_point`), loaded and
    checked; None if there is none."""
    rank, world = group.rank, group.world
    steps = group.agree(ckpt.steps_on_disk(out, rank))
    common = set(steps[0]).intersection(*map(set, steps[1:]))
    point = resume_point(steps, group, lambda k, r: ckpt.checkpoint_path(out, k, r)) if group.elastic else None
    if point is not None and point[0] not in common:  # this rank, if it was lost, reads the lowest holder's file
        common, source = {point[0]}, (rank if point[0] in steps[rank] else point[1])
    else:
        source = rank
    if not common:
        held = {r: s[-1] for r, s in enumerate(steps) if s}
        log(f"resume: no checkpoint held by all {world} rank(s) in {out / 'checkpoints'}"
            + (f" (latest per rank: {held})" if held else "") + "; starting from step 0")
        return None
    step = max(common)
    path = ckpt.checkpoint_path(out, step, source)
    try:
        payload, problem = ckpt.load(path, config=ckpt.config_for_checkpoint(cfg.__dict__), world=world,
                                     rank=source), None
        if source != rank:
            payload["simulator"] = adopt(sim, payload["simulator"])
    except ValueError as e:
        payload, problem = None, str(e)
    problems = [p for p in group.agree(problem) if p]
    if problems:  # every rank stops, with the first problem found
        raise ValueError(problems[0])
    log(f"resume: continuing from the checkpoint of step {step} ({path.parent})")
    return payload


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
               **summary_identity(cfg, out), "total_seconds": had.get("total_seconds", time.perf_counter() - started),
               **versions()}
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
    check_launched(cfg.executor, cfg.membership)
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
        out = Path(cfg.out) if group.joining else Path(group.decide(lambda: _prepare_out(cfg, resume=resume)))
        cfg = Config(**{**cfg.__dict__, "out": str(out)})
        sim = build_executor(cfg, parts, group)
        if not (resume or group.joining):
            ckpt.remove_all(out)  # an earlier run's checkpoints (overwrite=true) must never be resumed into this one
        # "resume" differs between a first attempt and a restart: compare the config without it
        group.check({"mixing matrix": parts.W, "n_agents": cfg.n_agents, "world size": group.world,
                     "parameter count": sim.layout.numel,
                     "config": dump_config(Config(**{**cfg.__dict__, "resume": False}))})
        payload = join_run(group, sim) if group.joining else _find_checkpoint(cfg, out, group, sim, log=log) if resume \
            else None
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
        if not completed and out is not None and group.writer:
            e = sys.exc_info()[1]  # a no-op once _drive has written its final summary
            _write_failure(out, cfg, e, started, (failure or Failure("")).status(e))  # undiagnosed: by its type
        if completed:
            group.close()
        else:
            group.release()


def _announce(cfg: Config, sim: Executor, parts: Parts, out: Path, world: int, total: int, every: int,
              summary: dict, log: Callable[[str], None]) -> None:
    """Say what runs (and its warnings); do the rule's one-off preparation (CHOCO's γ); note the network."""
    plan = parts.plan
    alg = plan.algorithm
    where = (f"random groups of {alg.group_size}" if getattr(alg, "needs_groups", False) else
             "the complete graph (a compressed all-gather)" if getattr(alg, "needs_complete", False) else cfg.topology)
    graph = (f"on {where} (n={cfg.n_agents}, spectral gap {topologies.format_gap(parts.spectral_gap.gap)})"
             if plan.uses_graph else f"(n={cfg.n_agents}, "
             f"{'all-reduce' if plan.algorithm.traffic == 'allreduce' else 'no communication'}, no graph)")
    log(f"cdsgd run: {cfg.algorithm} {graph}, "
        f"{cfg.dataset}/{cfg.partition}, model {cfg.model} ({sim.layout.numel} parameters), "
        f"{total} steps, executor {cfg.executor}"
        + (f" ({cfg.n_agents // world} agent(s) in each of {world} processes)" if world > 1 else "")
        + f", output {out}"
        + (f", checkpoint every {every} steps" if every else ""))
    for note in plan.notes:
        log(f"warning: {note}")
    if parts.bigram_loss is not None:  # text: what a model must beat to have learned beyond byte frequencies
        per_byte = parts.bigram_loss / (math.log(2) * parts.dataset.bytes_per_token)
        log(f"bigram floor: a bigram model of the training text scores test_loss {parts.bigram_loss:.4f} nats/token "
            f"({per_byte:.3f} bits/byte) on the validation text (summary.json bigram_loss)")
    for line in sim.algorithm.prepare(sim.mixer.at(sim.k), sim.X):  # e.g. CHOCO's consensus_step="auto"
        log(line)
    if sim.clock is not None:
        clock = sim.clock.clock
        summary.update(network_params_used=clock.spec.params(), stragglers=np.flatnonzero(clock.straggler).tolist())
        log(f"simulated network {clock.spec.name}: " + ", ".join(
            f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in clock.spec.params().items()
            if v is not None) + " (sim_seconds in metrics.csv)")
    if getattr(plan.algorithm, "needs_tree", False):
        summary["tree"] = sorted([min(u, v), max(u, v)] for u, v in plan.graph.edges())


class _MetricsFile:
    """metrics.csv of rank 0 (nothing elsewhere): the header and any earlier rows, then each row flushed to disk."""

    def __init__(self, path: Path | None, rows: list[dict]) -> None:
        self.f = None
        if path is not None:
            self.open(path, rows)

    def open(self, path: Path, rows: list[dict]) -> None:
        """Start the file with ``rows`` (a resumed run's; all so far, taking over from a lost rank 0)."""
        self.f = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.f, fieldnames=list(METRIC_COLUMNS))
        self.writer.writeheader()
        self.write(*rows)

    def write(self, *rows: dict) -> None:
        if self.f is None:
            return
        self.writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


class _Loop:
    """What happens around the executor's steps in a run: rows written and shown, checkpoints taken."""

    def __init__(self, cfg: Config, sim: Executor, out: Path, group: Group, *, rows: list[dict], before: float,
                 started: float, total: int, every: int, shown: Progress, board, metrics: _MetricsFile,
                 summary: dict) -> None:
        self.cfg, self.sim, self.out, self.group, self.rows = cfg, sim, out, group, rows
        self.before, self.started, self.total, self.every = before, started, total, every
        self.shown, self.board, self.metrics, self.summary = shown, board, metrics, summary
        self.hinted, self.saved, self.whole = False, 0, 0  # elastic: the last checkpoint, the last whole one
        self.stop = StopBetweenSteps(enabled=group.world == 1)  # ranks could not agree on the step to stop at
        if group.elastic:
            sim.stepper.rows = rows  # what a replacement that joins is handed

    def on_row(self, row: dict) -> None:
        self.rows.append(row)
        self.board.row(row)
        if self.group.writer and self.metrics.f is None:  # rank 0 was lost (elastic): the lowest live rank writes
            self.metrics.open(self.out / "metrics.csv", self.rows)
        else:
            self.metrics.write(row)
        write_membership(self.out if self.group.writer else None, self.sim)
        text = math.isfinite(row.get("test_bits_per_byte", math.nan))  # a language model: its loss, in bits per byte
        self.shown.row(f"epoch {row['epoch']:.2f}  train_loss {row['train_loss']:.4f}  "
                       + (f"test_bpb {row['test_bits_per_byte']:.4f}  avg_model_bpb {row['test_bits_per_byte_avg_model']:.4f}  "
                          if text else f"test_acc {row['test_accuracy']:.4f}  "
                          f"avg_model_acc {row['test_accuracy_avg_model']:.4f}  ")
                       + f"consensus {row['consensus_distance']:.3g}"
                       + (f"  mgrit {row['mgrit_iters']:.1f} it, {row['mgrit_fallbacks']:.0f}/"
                          f"{row['mgrit_solves']:.0f} serial" if row.get("mgrit_solves", 0) > 0 else ""), row)
        hint = "" if self.hinted else eval_hint(self.cfg, self.sim)
        if hint:
            self.hinted = True
            self.shown.note(f"note: {hint}")

    def on_step(self, k: int) -> None:
        self.shown.step(k)
        self.board.train_loss(k, self.sim.last_loss)

    def save_checkpoint(self, k: int) -> None:
        state = {"config": ckpt.config_for_checkpoint(self.cfg.__dict__), "world": self.group.world,
                 "simulator": self.sim.state_dict(), "rows": self.rows,
                 "total_seconds": self.before + time.perf_counter() - self.started}
        fault("checkpoint", self.group.rank, k)
        ckpt.save(self.out, k, self.group.rank, state)
        if self.group.elastic:  # no barrier a lost rank could break (the next step's agreement is one)
            self.whole, self.saved = ckpt.prune_elastic(self.out, self.group.rank, self.saved, self.whole,
                                                        everyone=len(self.group.view.live) == self.group.world), k
            return
        self.sim.reducer.barrier(f"checkpoint of step {k} (waiting for every rank to write its file)")
        ckpt.prune(self.out, self.group.rank, keep=k)  # step k is complete on every rank: older ones are not needed

    def after_step(self, k: int) -> None:
        periodic = self.every and (k % self.every == 0 or k == self.total)  # at the end too: a run can be extended
        if periodic or self.stop.requested:  # Ctrl-C/SIGTERM held until now: a checkpoint of the step it stopped
            self.save_checkpoint(k)
        if self.stop.requested:
            self.summary["checkpoint_at_interruption"] = k
            self.stop.deliver()

    def train(self, eval_steps: int) -> None:
        """Run the remaining steps; then, with ``save_params``, write params.pt."""
        sim = self.sim
        if self.total > sim.k:
            with self.stop:
                sim.run(steps=self.total - sim.k, eval_every_steps=eval_steps, callback=self.on_row,
                        progress=self.on_step, after_step=self.after_step)
        if self.cfg.save_params:
            params = sim.reducer.gather(sim.X)
            if self.group.writer:
                atomic_write(self.out / "params.pt", lambda f: torch.save(params.cpu(), f))


def _restore(sim: Executor, resume: dict, total: int, cfg: Config) -> tuple[list[dict], float]:
    """Load a checkpoint payload into ``sim``: its rows and the seconds the run had taken."""
    sim.load_state_dict(resume["simulator"])
    if sim.k > total:
        raise ValueError(f"the checkpoint is of step {sim.k}, beyond this run's {total} steps "
                         f"(epochs={cfg.epochs:g}); a run can be extended, not shortened")
    return [dict(r) for r in resume["rows"]], float(resume.get("total_seconds", 0.0))


def _drive(cfg: Config, sim: Executor, parts: Parts, out: Path, group: Group, *, mode: str,
           log: Callable[[str], None], resume: dict | None = None, started: float | None = None) -> dict:
    """Run the executor; rank 0 writes config.toml, metrics.csv, summary.json (and params.pt).

    Every process writes its own checkpoints (``checkpoint_every``).
    ``resume``: a checkpoint payload to continue from; its metrics rows are
    written again, and the run goes on from its step.
    """
    started = time.perf_counter() if started is None else started
    writer, world = group.rank == 0, group.world
    total = max(1, round(cfg.epochs * sim.steps_per_epoch))
    every = _checkpoint_steps(cfg, sim.steps_per_epoch)
    summary = summary_start(cfg, sim, parts, out, world, writer)
    rows, before = [], 0.0  # before: seconds the run took before its checkpoint (a resumed run's total counts them)
    if resume is not None:
        rows, before = _restore(sim, resume, total, cfg)
        summary["joined_at_step" if resume.get("joined") else "resumed_from_step"] = sim.k
    if writer:
        atomic_write(out / "config.toml", dump_config(cfg))
    _announce(cfg, sim, parts, out, world, total, every, summary, log)
    eval_steps = cfg.eval_steps or cfg.eval_every * sim.steps_per_epoch
    shown = Progress(total=total, every=eval_steps, mode=mode, log=log, initial=sim.k,
                     timing=lambda: (sim.train_seconds, sim.timed_steps, sim.eval_seconds, len(rows)))  # since step 0
    board = make_logger(cfg.logger if writer else "none", out,
                        purge_step=(sim.k + 1) if resume is not None else (0 if cfg.overwrite else None))
    board.text("config", dump_config(cfg))
    board.replay(rows)  # a resumed run's rows (those the stopped run logged already are kept as they are)
    metrics = _MetricsFile(out / "metrics.csv" if writer else None, rows)
    loop = _Loop(cfg, sim, out, group, rows=rows, before=before, started=started, total=total, every=every,
                 shown=shown, board=board, metrics=metrics, summary=summary)
    try:
        loop.train(eval_steps)
        summary["status"] = "completed"
    except Diverged as e:
        summary.update(status="diverged", error=str(e), diverged_at_step=e.step, diverged_agent=e.agent,
                       diverged_what=e.what)
        shown.close()
        log(f"cdsgd run: stopped at step {e.step} of {total}, status diverged; {diverged_hint(cfg)}")
        raise
    except (Exception, KeyboardInterrupt) as e:
        _record_failure(summary, group, e, shown, log, cfg, sim, total, out)
        raise
    finally:
        shown.close()
        board.close()
        metrics.close()
        summary_end(summary, cfg, sim, rows, before + time.perf_counter() - started)
        if group.writer:  # rank 0, or the lowest live rank once an elastic run lost it
            atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _record_failure(summary: dict, group: Group, e: BaseException, shown: Progress, log: Callable[[str], None],
                    cfg: Config, sim: Executor, total: int, out: Path) -> None:
    """Put why the run stopped into ``summary`` (diagnosed by the group: a lost rank, an interruption, ...)."""
    try:
        failure = group.diagnose(e)
    except Terminated:  # torchrun stopping every rank after the same loss, while this rank asked who
        failure = group.diagnose(e)  # was lost: the loss is the cause; ask again (SIGTERM comes once)
    summary["error"], summary["status"] = failure.message, failure.status(e)
    if summary["status"] == "interrupted":
        shown.close()
        saved = "checkpoint_at_interruption" in summary
        log(f"cdsgd run: interrupted at step {sim.k} of {total}; {resume_hint(cfg, out, group.world, saved=saved)}")
