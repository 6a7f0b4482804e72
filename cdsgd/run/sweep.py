"""Sweeps: one TOML file → many runs → one tidy results table.

A sweep file::

    [base]                          # config keys shared by every run
    file = "experiments/paper/fashion_mnist_ring_iid.toml"   # optional: start from a config file
    dataset = "digits"
    epochs = 5

(or just ``base = "path/to/config.toml"``)

    [grid]                          # every combination of these lists
    algorithm = ["cdsgd", "cdmsgd"]
    seed = [0, 1, 2]

    [[zip]]                         # keys that vary together (one dimension of the grid)
    topology = ["ring", "torus"]
    n_agents = [9, 9]

    [[exclude]]                     # drop every run matching all of these keys
    algorithm = "cdsgd"
    topology = "torus"

expands to the cartesian product of the ``grid`` lists and the ``zip``
groups, minus the exclusions. Each run is a normal run folder (the run-output
contract) under the sweep folder, named readably and stably from its varying
keys (``algorithm=cdsgd,seed=0,topology=ring,n_agents=9``, made file-safe).
A run is identified by its resolved config (a digest of every key but
``out``/``overwrite``), not by its folder: re-running a sweep skips runs whose
completed (or diverged) folder holds the same config, and reruns failed or
interrupted ones. ``results.csv`` holds one row per run and can be rebuilt from the
folders at any time (:func:`collect`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

import topologies

from ..base.files import atomic_write
from ..config import VOLATILE_KEYS, Config, dump_config, load_config, short_value
from ..runtime.group import Terminated
from .preflight import output_folder, require, rerun_report, stop_hint
from .sweep_file import SweepRun, load_sweep, run_identity

__all__ = ["SweepRun", "load_sweep", "run_sweep", "collect", "group_table", "group_keys", "run_identity",
           "RESULT_COLUMNS"]

#: the fixed columns of results.csv, after the sweep's varying keys: the run's summary.json values (empty
#: where it has none: ``simulated_seconds`` without a network, the ``*_target`` ones without a
#: ``target_accuracy`` or, but ``target_accuracy``, when the run never reached it; likewise ``*_target_loss``
#: and ``target_loss``; the text figures and ``bigram_loss`` but for text), then its status and folder
RESULT_COLUMNS = ["seed", "spectral_gap", "effective_neighbours", "topology_draw", "epoch", "step", "train_loss",
                  "test_loss", "test_accuracy", "test_accuracy_avg_model", "test_loss_avg_model", "consensus_distance",
                  "bytes_sent_per_agent", "best_test_accuracy", "wall_seconds", "simulated_seconds", "target_accuracy", "steps_to_target",
                  "sim_seconds_to_target", "test_bits_per_byte", "test_bits_per_byte_avg_model", "bigram_loss",
                  "target_loss", "steps_to_target_loss", "sim_seconds_to_target_loss", "status", "run"]


def _same_run(folder: Path, identity: str) -> bool:
    """The folder holds (the start of) this very run."""
    try:
        return run_identity(load_config(folder / "config.toml")) == identity
    except (OSError, ValueError):
        return False


#: the statuses of a run that is over: running it again would give the same result
FINISHED = ("completed", "diverged")


def _status(folder: Path) -> dict:
    try:
        return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _finished(folder: Path, identity: str) -> bool:
    return _status(folder).get("status") in FINISHED and _same_run(folder, identity)


def _last_error_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[-1].strip()


def _threads_per_run(jobs: int) -> int:
    """``OMP_NUM_THREADS`` when the user set it (a positive integer), else the cores shared by the jobs."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // jobs)


def run_sweep(runs: list[SweepRun], out: str | os.PathLike, *, jobs: int = 1,
              log: Callable[[str], None] = print) -> dict:
    """Run every unfinished run (``jobs`` at a time, in subprocesses), then write results.csv.

    Each run is ``python -m cdsgd run CONFIG`` with its resolved config, so a
    crash or a bad run cannot take the others down. With J jobs each run gets
    max(1, cores // J) threads, unless ``OMP_NUM_THREADS`` is set (then every
    run gets that many, as with ``cdsgd launch``). A run that diverged (status ``diverged``) is
    over, not failed: it is listed apart and not run again. Returns
    {"done": [...], "skipped": [...], "diverged": [(name, error)], "failed": [(name, error)]}.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    require([r.config for r in runs])  # data the runs need: one error before any folder exists
    out = output_folder(out, option="--out")
    threads = _threads_per_run(jobs)
    todo, skipped = _to_run(runs, log)
    log(f"cdsgd sweep: running {len(todo)} runs, {jobs} at a time, {threads} thread(s) each, in {out}")
    processes = _Processes(threads)
    try:
        done, diverged, failed = _run_all(todo, jobs, processes, log)
    finally:
        if processes.stopping:
            finished = len(skipped) + sum(_finished(r.folder, r.identity) for r in todo)
            how = "stopped by SIGTERM" if processes.stopping == "term" else "interrupted"
            log(stop_hint(out, finished, len(runs), how=how))
    rows = collect(out)
    log(f"cdsgd sweep: {len(done)} done, {len(skipped)} skipped, {len(diverged)} diverged, {len(failed)} failed; "
        f"{len(rows)} rows in {out / 'results.csv'}")
    for name, msg in diverged:
        log(f"  diverged: {name}: {msg}")
    for name, msg in failed:
        log(f"  failed: {name}: {msg}")
    return {"done": done, "skipped": [r.folder.name for r in skipped], "diverged": diverged, "failed": failed}


def _to_run(runs: list[SweepRun], log: Callable[[str], None]) -> tuple[list[SweepRun], list[SweepRun]]:
    """(the runs to run, the runs already finished with the same config), the split logged."""
    todo, skipped, reruns, replaced = [], [], [], []
    for r in runs:
        if _finished(r.folder, r.identity):
            skipped.append(r)
            continue
        todo.append(r)
        if _same_run(r.folder, r.identity):
            reruns.append((r.folder.name, _status(r.folder).get("status", "no summary")))
        elif (r.folder / "config.toml").is_file():
            replaced.append(r.folder.name)
    if skipped:
        log(f"cdsgd sweep: {len(skipped)} of {len(runs)} runs already finished (same config): skipped")
    for line in rerun_report(reruns, replaced, len(todo) - len(reruns) - len(replaced)):
        log(line)
    return todo, skipped


class _Processes:
    """The sweep's runs in progress, each a ``python -m cdsgd run`` process with ``threads`` threads."""

    def __init__(self, threads: int):
        self.threads = threads
        self.live: set[subprocess.Popen] = set()  # the runs in progress
        self.lock = threading.Lock()
        self.stopping: str | bool = False  # "term" or "int" once the sweep is stopped

    def run(self, r: SweepRun) -> tuple[SweepRun, bool, str, float]:
        """(the run, whether it succeeded, its last error line or its output, its seconds), once it has run."""
        r.folder.mkdir(parents=True, exist_ok=True)
        # the same run stopped half-way continues from its latest checkpoint (if it wrote any);
        # anything else in the folder is replaced
        cfg = Config(**{**r.config.__dict__, "overwrite": True, "resume": _same_run(r.folder, r.identity)})
        spec = r.folder / "sweep-config.toml"
        spec.write_text(dump_config(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        t0 = time.perf_counter()
        with self.lock:
            if self.stopping:
                raise Terminated("the sweep was stopped before this run started")
            p = subprocess.Popen([sys.executable, "-m", "cdsgd", "run", str(spec), "--no-progress"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            self.live.add(p)
        stdout, stderr = p.communicate()
        with self.lock:
            self.live.discard(p)
        spec.unlink(missing_ok=True)
        (r.folder / "run.log").write_text(stdout + stderr)
        return r, p.returncode == 0, _last_error_line(stderr) if p.returncode else stdout.strip(), \
            time.perf_counter() - t0

    def stop(self, e: KeyboardInterrupt) -> None:
        """Start no more runs; on SIGTERM (``e`` a Terminated), pass it on to the runs in progress."""
        with self.lock:
            self.stopping = "term" if isinstance(e, Terminated) else "int"
            for p in self.live if self.stopping == "term" else ():
                p.terminate()


def _run_all(todo: list[SweepRun], jobs: int, processes: _Processes, log: Callable[[str], None]) -> tuple:
    """(the names of the runs done, (name, error) of those that diverged, of those that failed), once all have run."""
    failed, done, diverged = [], [], []
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(processes.run, r) for r in todo]
        for i, fut in enumerate(as_completed(futures), 1):
            r, ok, msg, secs = fut.result()
            name = r.folder.name
            if ok:
                done.append(name)
                log(f"[{i}/{len(todo)}] done    {name} ({secs:.0f} s): {msg}")
            elif _status(r.folder).get("status") == "diverged":
                diverged.append((name, _status(r.folder).get("error", msg)))
                log(f"[{i}/{len(todo)}] DIVERGED {name} ({secs:.0f} s): {diverged[-1][1]}")
            else:
                failed.append((name, msg))
                log(f"[{i}/{len(todo)}] FAILED  {name} ({secs:.0f} s): {msg}")
    except KeyboardInterrupt as e:
        # SIGTERM reached the sweep alone (``kill PID``, a scheduler stopping the job's main process): pass it
        # on to the runs, which write their files and say "interrupted", rather than leave them running
        # without the sweep. (Ctrl-C reaches every process of the terminal's group by itself.)
        processes.stop(e)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the runs in progress end (and write their files) first
    return done, diverged, failed


def collect(out: str | os.PathLike) -> list[dict]:
    """Rebuild ``out/results.csv`` from the run folders below ``out``; returns its rows.

    The varying keys are the config keys whose values differ between the runs
    (``out``, ``overwrite`` excepted); then come RESULT_COLUMNS. Runs without
    a summary (never started) are left out; interrupted or failed runs appear
    with their status.
    """
    out = Path(out)
    found = []
    for cfg_path in sorted(out.glob("*/config.toml")):
        folder = cfg_path.parent
        try:
            cfg = load_config(cfg_path)
            summary = json.loads((folder / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        found.append((folder, cfg, summary))
    keys = [k for k in Config.__dataclass_fields__ if k not in VOLATILE_KEYS and k not in RESULT_COLUMNS]
    varying = [k for k in keys if len({json.dumps(getattr(c, k), sort_keys=True) for _, c, _ in found}) > 1]
    rows = []
    for folder, cfg, summary in found:
        row = {k: _cell(getattr(cfg, k)) for k in varying}
        row["seed"] = cfg.seed
        for k in RESULT_COLUMNS[1:-1]:
            row[k] = _cell(summary.get(k))  # topology_draw, a random graph's {"seed", "redraws"}: JSON
        row["run"] = folder.name
        rows.append(row)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=varying + RESULT_COLUMNS)
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in row.items()})
    atomic_write(out / "results.csv", text.getvalue())
    return rows


def _cell(v):
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v


def group_keys(rows: list[dict]) -> list[str]:
    """The keys that group rows of results.csv into runs differing only by their seed: the sweep's varying
    keys, and ``target_accuracy`` when it differs between the rows (a config key kept among RESULT_COLUMNS)."""
    keys = [k for k in (rows[0] if rows else ()) if k not in RESULT_COLUMNS]
    return keys + [t for t in ("target_accuracy", "target_loss") if len({r.get(t) for r in rows}) > 1]


def group_table(out: str | os.PathLike) -> str:
    """A Markdown table of ``out/results.csv``: runs grouped by their varying keys except the seed,
    with the mean (± standard deviation over seeds) of the final metrics; with a network the simulated
    seconds, and with a ``target_accuracy`` the steps (and simulated seconds) to it over the seeds that
    reached it ("2/3 reached"; "not reached" when none did). Runs that did not complete (diverged,
    failed, interrupted) are never left out: a ``status`` column then says, for each group, how many
    seeds ended so and at which epoch (``diverged at epoch 0.8``), in a row of their own."""
    import statistics

    out = Path(out)
    with open(out / "results.csv", newline="") as f:
        every = list(csv.DictReader(f))
    if not every:
        raise ValueError(f"{out / 'results.csv'} lists no run")
    varying = group_keys(every)
    groups: dict[tuple, list[dict]] = {}
    for r in every:  # a group per status: the completed seeds' means, and apart from them the others
        groups.setdefault((*(r[k] for k in varying), r["status"]), []).append(r)
    rows = [r for r in every if r["status"] == "completed"] or every
    stopped = any(r["status"] != "completed" for r in every)

    def stat(runs, col, fmt):
        vals = [float(r[col]) for r in runs if r.get(col) not in ("", None)]
        if not vals:
            return ""
        m = statistics.fmean(vals)
        if len(vals) > 1:
            return f"{m:{fmt}} ± {statistics.stdev(vals):{fmt}}"
        return f"{m:{fmt}}"

    def to_target(runs, col, fmt):
        reached = [r for r in runs if r.get("steps_to_target" + col.partition("_to_target")[2]) not in ("", None)]
        if not reached:
            return "not reached"
        return stat(reached, col, fmt) + (f" ({len(reached)}/{len(runs)} reached)" if len(reached) < len(runs) else "")

    has = {c for c in ("simulated_seconds", "target_accuracy", "target_loss", "test_bits_per_byte")
           if any(r.get(c) not in ("", None) for r in rows)}

    def target_name(key, what):
        targets = sorted({r[key] for r in rows if r.get(key) not in ("", None)})
        return f"{what} {targets[0]}" if len(targets) == 1 else key.replace("_", " ")

    target, loss = target_name("target_accuracy", "acc ≥"), target_name("target_loss", "loss ≤")
    cols = [("test_accuracy", "test acc (agents)", ".3f"), ("test_accuracy_avg_model", "test acc (avg model)", ".3f"),
            ("consensus_distance", "consensus dist.", ".3g"), ("train_loss", "train loss", ".3f"),
            ("test_loss", "test loss", ".3f")]
    cols += [("test_loss_avg_model", "test loss (avg model)", ".3f"), ("test_bits_per_byte", "bits/byte (agents)", ".3f"),
             ("test_bits_per_byte_avg_model", "bits/byte (avg model)", ".3f"),
             ("bigram_loss", "bigram loss", ".3f")] * ("test_bits_per_byte" in has)
    extra = [(c, head, fmt, cell) for c, head, fmt, cell, need in (
        ("simulated_seconds", "simulated s", ".3g", stat, ("simulated_seconds",)),
        ("steps_to_target", f"steps to {target}", ".0f", to_target, ("target_accuracy",)),
        ("sim_seconds_to_target", f"simulated s to {target}", ".3g", to_target, ("simulated_seconds", "target_accuracy")),
        ("steps_to_target_loss", f"steps to {loss}", ".0f", to_target, ("target_loss",)),
        ("sim_seconds_to_target_loss", f"simulated s to {loss}", ".3g", to_target, ("simulated_seconds", "target_loss")))
        if has.issuperset(need)]
    keys = [*varying, "status"] if stopped else varying
    head = [*keys, "seeds", "spectral gap", *(c[1] for c in cols), "MB sent/agent", *(e[1] for e in extra)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" :--- "] * len(keys) + [" ---: "] * (len(head) - len(keys))) + "|"]
    def order(key):  # numbers by value (16 before 256), other values as text
        def one(v):
            try:
                return (0, float(v), "")
            except (TypeError, ValueError):
                return (1, 0.0, str(v))
        return [one(v) for v in key]

    for key, runs in sorted(groups.items(), key=lambda kv: order(kv[0][:-1]) + [kv[0][-1] != "completed"]):
        cells = [short_value(v) for v in key[:-1]]
        if stopped:  # where the others stopped: their metrics are not final, so not shown as such
            epochs = sorted({f"{float(r['epoch']):g}" for r in runs if r.get("epoch") not in ("", None)}, key=float)
            at = f" at epoch {' to '.join(dict.fromkeys([epochs[0], epochs[-1]]))}" if epochs else ""
            cells.append(key[-1] if key[-1] == "completed" else f"**{key[-1]}**{at}")
        cells += [str(len(runs)), topologies.format_gap(float(runs[0]['spectral_gap']), 3)]
        cells += [stat(runs, c, fmt) if key[-1] == "completed" else "—" for c, _, fmt in cols]
        cells += [f"{float(runs[0]['bytes_sent_per_agent']) / 1e6:.1f}"]
        cells += [cell(runs, c, fmt) for c, _, fmt, cell in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
