"""The runtime under failure, with real torchrun launches on 127.0.0.1 (docs/reliability.md).

* a rank SIGKILLed without restarts: every other rank exits non-zero within
  comm_timeout + a few seconds, naming the lost rank; no process is left;
  metrics.csv keeps its complete rows;
* the same across two torchrun agents (two "nodes" on loopback): the other
  node's agent knows nothing, its ranks learn it from the exchange itself;
* a rank SIGKILLed with ``--max-restarts 1``: the restarted ranks resume from
  the latest complete checkpoint and the final parameters and metrics equal an
  uninterrupted run's bit for bit;
* SIGTERM to the launcher stops every rank with complete files, and
  ``resume=true`` then finishes the run, again bit for bit;
* SIGKILL to the launcher leaves no worker behind.

Every launch has a hard deadline after which it and its workers are killed.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
import time

import pytest
import torch

from cdsgd.run import checkpoint as ckpt
from dist_harness import free_port
from launch_harness import descendants, finish, report, start, stat, wait_until, workers

# digits, 4 agents: 23 steps per epoch, 92 steps, a checkpoint each epoch; ~10 s per launch here
RUN = ["n_agents=4", "dataset=digits", "model=mlp", "epochs=4", "batch_size=16", "lr=0.05", "momentum=0.9",
       "save_params=true", "checkpoint_every=1"]
COMM_TIMEOUT = 10
DEADLINE = 150  # seconds any launch may take in all


def launch(out, *extra, nproc=4, more=()):
    return [sys.executable, "-m", "cdsgd", "launch", "--nproc-per-node", str(nproc), *more, *RUN,
            f"comm_timeout={COMM_TIMEOUT}", f"out={out}", *extra]


def metrics_without_wall(out):
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    wall = rows[0].index("wall_seconds")
    return [r[:wall] + r[wall + 1:] for r in rows]


def complete_checkpoint(out, world=4):
    """The latest step all ranks hold a checkpoint file of, or None."""
    steps = [set(ckpt.steps_on_disk(out, r)) for r in range(world)]
    common = set.intersection(*steps)
    return max(common) if common else None


def kill_rank_after_checkpoint(p, out, rank, world=4):
    """SIGKILL worker ``rank`` once a checkpoint is complete; returns (pid, time of the kill)."""
    wait_until(lambda: complete_checkpoint(out, world) or p.poll() is not None, DEADLINE, "the first checkpoint")
    assert p.poll() is None, "the run ended before it could be killed"
    pid = wait_until(lambda: workers(descendants(p.pid)).get(rank), 10, f"worker of rank {rank}")
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def no_processes_left(procs):
    """None of the processes {pid: start time} is still running (a recycled pid does not count)."""
    return not [pid for pid, t in procs.items() if (st := stat(pid)) is not None and st[1] == t]


def uninterrupted(tmp_path_factory, make_argv, name="ref"):
    """A launch that must complete (``make_argv(out)`` gives its command); returns its output folder."""
    out = tmp_path_factory.mktemp(name) / "run"
    log = out.parent / "log"
    p = start(make_argv(out), {}, log)
    timed_out = finish([p], DEADLINE)
    assert p.returncode == 0 and not timed_out, report(["reference"], [p], [log], timed_out)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted launch (with the same checkpoints)."""
    return uninterrupted(tmp_path_factory, launch)


def test_rank_killed_without_restarts_stops_everyone_naming_it(tmp_path):
    out, log = tmp_path / "run", tmp_path / "log"
    p = start(launch(out), {}, log)
    try:
        pid, t_kill = kill_rank_after_checkpoint(p, out, 2)
        procs = descendants(p.pid)
        p.wait(timeout=COMM_TIMEOUT + 20)
        took = time.monotonic() - t_kill
    finally:
        finish([p], 1)
    text = log.read_text()
    assert p.returncode != 0, text
    assert took < COMM_TIMEOUT + 10, (took, text)
    assert "cdsgd launch: lost rank 2 first" in text and "rank 2 (killed by SIGKILL)" in text, text
    for rank in (0, 1, 3):  # each survivor says it stopped, and why
        lines = [line for line in text.splitlines() if f"rank {rank}: " in line and "lost rank 2" in line]
        assert lines, (rank, text)
    wait_until(lambda: no_processes_left(procs), 10, "every worker to exit")
    # the metrics up to the last evaluation are complete, and the summary says what happened
    rows = metrics_without_wall(out)
    assert len(rows) >= 2 and all(len(r) == len(rows[0]) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "lost rank 2" in summary["error"], summary
    assert summary["evaluations"] == len(rows) - 1


def test_rank_killed_on_another_node_is_named_by_the_exchange(tmp_path):
    """Two torchrun agents (node 0: ranks 0, 1; node 1: ranks 2, 3). Node 1 loses rank 3; node 0's agent is not
    told: its ranks must find out themselves (rank 0 is rank 3's neighbour on the ring) and exit in time."""
    out = tmp_path / "run"
    port = free_port()
    logs = [tmp_path / "node0", tmp_path / "node1"]
    procs = [start(launch(out, nproc=2, more=["--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1",
                                              "--master-port", str(port)]), {"GLOO_SOCKET_IFNAME": "lo"}, logs[n])
             for n in (0, 1)]
    try:
        kill_rank_after_checkpoint(procs[1], out, 3)
        t_kill = time.monotonic()
        everyone = {**descendants(procs[0].pid), **descendants(procs[1].pid)}
        for p in procs:
            p.wait(timeout=max(1, COMM_TIMEOUT + 20 - (time.monotonic() - t_kill)))
        took = time.monotonic() - t_kill
    finally:
        timed_out = finish(procs, 1)
    text = report(["node 0", "node 1"], procs, logs, timed_out)
    assert all(p.returncode != 0 for p in procs) and took < COMM_TIMEOUT + 10, (took, text)
    node0 = logs[0].read_text()
    for rank in (0, 1):
        assert any(f"rank {rank}: lost rank 3" in line for line in node0.splitlines()), (rank, text)
    wait_until(lambda: no_processes_left(everyone), 10, "every worker to exit")


def restart_ends_as(reference, argv, out, log, world=4):
    """Launch ``argv`` (with --max-restarts 1), SIGKILL rank 1 after the first complete checkpoint: the
    restarted ranks resume from it, and the run ends with the reference's parameters and metrics, bit for bit."""
    p = start(argv, {}, log)
    try:
        kill_rank_after_checkpoint(p, out, 1, world)
        p.wait(timeout=DEADLINE)
    finally:
        timed_out = finish([p], 1)
    text = report(["restarted"], [p], [log], timed_out)
    assert p.returncode == 0, text
    assert "after a restart: resuming from the latest complete checkpoint" in text, text
    summary = json.loads((out / "summary.json").read_text())
    resumed = summary.get("resumed_from_step", 0)
    assert summary["status"] == "completed" and resumed > 0 and resumed % summary["steps_per_epoch"] == 0, summary
    assert metrics_without_wall(out) == metrics_without_wall(reference)
    assert torch.equal(torch.load(out / "params.pt", weights_only=True),
                       torch.load(reference / "params.pt", weights_only=True))


def test_rank_killed_with_restart_ends_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    restart_ends_as(reference, launch(out, more=["--max-restarts", "1"]), out, tmp_path / "log")


def test_sigterm_to_the_launcher_stops_cleanly_and_resume_finishes(reference, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log"
    p = start(launch(out), {}, log)
    try:
        wait_until(lambda: complete_checkpoint(out) or p.poll() is not None, DEADLINE, "the first checkpoint")
        procs = descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    finally:
        finish([p], 1)
    text = log.read_text()
    assert p.returncode == 128 + signal.SIGTERM, text
    assert "cdsgd launch: stopped by SIGTERM" in text, text
    wait_until(lambda: no_processes_left(procs), 10, "every worker to exit")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"].endswith("SIGTERM"), summary
    rows = metrics_without_wall(out)
    assert rows == metrics_without_wall(reference)[:len(rows)]  # complete rows, the same as the reference's

    log2 = tmp_path / "log2"
    p = start(launch(out, "resume=true"), {}, log2)
    timed_out = finish([p], DEADLINE)
    assert p.returncode == 0, report(["resumed"], [p], [log2], timed_out)
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] >= 23
    assert metrics_without_wall(out) == metrics_without_wall(reference)
    assert torch.equal(torch.load(out / "params.pt", weights_only=True),
                       torch.load(reference / "params.pt", weights_only=True))


def test_sigkilled_launcher_leaves_no_worker(tmp_path):
    out, log = tmp_path / "run", tmp_path / "log"
    p = start(launch(out), {}, log)
    try:
        wait_until(lambda: len(workers(descendants(p.pid))) == 4 or p.poll() is not None, 60, "4 workers")
        procs = descendants(p.pid)
        p.kill()
        p.wait(timeout=10)
        wait_until(lambda: no_processes_left(procs), 20, "the workers of a killed launcher to exit")
    finally:
        finish([p], 1)
