"""Same config and seed, same output: two runs write identical metrics.csv (bar wall_seconds).

Both executors: ``cdsgd run`` (executor=sim) and ``cdsgd launch --nproc-per-node 3`` (executor=torch,
real torchrun/gloo processes on loopback). executor=sim: the first run of a pair is ``cdsgd.cli.main`` in
this process (whose global torch random state earlier runs have moved), the second a fresh
``python -m cdsgd run``. executor=torch: two launches. The subprocesses get PYTHONHASHSEED values unlike
each other and this process's, so set or dict ordering cannot hide in the results. A negative control
(seed=1 against seed=0) shows the comparison does catch a difference. Every subprocess has a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["dataset=digits", "train_subset=300", "test_subset=100", "batch_size=32", "lr=0.1"]
CASES = {  # name: overrides; cnn is the small model with dropout (two Dropout(0.25) layers)
    "cdmsgd-mlp": ["algorithm=cdmsgd", "model=mlp", "epochs=3", "momentum=0.9"],
    "fedavg-half": ["algorithm=fedavg", "model=mlp", "epochs=3", "fedavg_fraction=0.5", "local_steps=2",
                    "topology=complete"],
    "cdsgd-cnn-dropout": ["algorithm=cdsgd", "model=cnn", "epochs=2"],
    "fedavg-half-cnn-dropout": ["algorithm=fedavg", "model=cnn", "epochs=3", "fedavg_fraction=0.5",
                                "local_steps=2", "topology=complete"],
}
SIM_CASES = ("cdmsgd-mlp", "fedavg-half", "cdsgd-cnn-dropout")
TORCH_CASES = ("cdmsgd-mlp", "fedavg-half-cnn-dropout")
# PYTHONHASHSEED of a pair's first and second subprocess run
HASH_SEEDS = ("0", "4242")
SIM_TIMEOUT, LAUNCH_TIMEOUT = 120, 180


def _run(argv: list[str], timeout: float, hash_seed: str) -> tuple[int, str]:
    """``python -m cdsgd ARGV`` in its own process group: (exit status, output). On timeout SIGTERM the
    group (torchrun then stops its workers), SIGKILL whatever is left, and fail with the output."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}  # torchrun sets 1 anyway
    p = subprocess.Popen([sys.executable, "-m", "cdsgd", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        pytest.fail(f"cdsgd {argv[0]} did not finish within {timeout} s:\n{out}")
    return p.returncode, out


def _run_in_process(argv: list[str]) -> tuple[int, str]:
    """``cdsgd.cli.main(ARGV)`` here, on one thread like the subprocess runs (the conftest fixture restores
    the thread count). A fresh process starts torch's global generator at a fixed seed; here it is moved on
    first, so a run drawing from it unseeded would not repeat."""
    import contextlib
    import io

    import torch

    from cdsgd.cli import main

    torch.set_num_threads(1)
    torch.rand(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        status = main(argv)
    return status, buf.getvalue()


class RunFailed(AssertionError):
    pass


class Runs:
    """Output folders, made once per (executor, case, seed, repetition) and shared by the tests."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def get(self, executor: str, case: str, seed: int = 0, rep: int = 0) -> Path:
        key = (executor, case, seed, rep)
        if key not in self.done:
            out = self.root / f"{executor}-{case}-seed{seed}-{rep}"
            overrides = [*TINY, *CASES[case], f"seed={seed}", f"out={out}"]
            if executor == "sim":
                argv, timeout = ["run", *overrides, "--no-progress"], SIM_TIMEOUT
            else:
                argv, timeout = ["launch", "--nproc-per-node", "3", *overrides, "n_agents=3"], LAUNCH_TIMEOUT
            if executor == "sim" and rep == 0:
                status, log = _run_in_process(argv)
            else:
                status, log = _run(argv, timeout, HASH_SEEDS[rep])
            if status != 0:
                raise RunFailed(f"cdsgd {' '.join(argv)} exited {status}:\n{log}")
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("determinism"))


def metrics_without_wall(folder: Path) -> str:
    """metrics.csv as written, with the wall_seconds column cut out of every line."""
    lines = (folder / "metrics.csv").read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\r\n").split(",")
    assert "wall_seconds" in header and len(lines) > 1, lines
    i = header.index("wall_seconds")
    kept = []
    for line in lines:
        body = line.rstrip("\r\n")
        fields = body.split(",")
        assert len(fields) == len(header), line
        kept.append(",".join(fields[:i] + fields[i + 1:]) + line[len(body):])
    return "".join(kept)


#: the summary's clock readings: they differ between two runs of one config
TIME_KEYS = ("wall_seconds", "train_seconds", "warmup_seconds", "eval_seconds", "total_seconds")


def summary_without_wall(folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return {k: v for k, v in summary.items() if k not in TIME_KEYS + ("out",)}


def config_without_out(folder: Path) -> str:
    return "".join(line for line in (folder / "config.toml").read_text().splitlines(keepends=True)
                   if not line.startswith("out ="))


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = metrics_without_wall(a), metrics_without_wall(b)
    if ma != mb:  # show the first differing line, not two walls of numbers
        la, lb = ma.splitlines(), mb.splitlines()
        first = next(((x, y) for x, y in zip(la, lb) if x != y), (f"{len(la)} lines", f"{len(lb)} lines"))
        pytest.fail(f"metrics.csv differs between {a.name} and {b.name}: first difference\n  {first[0]}\n  {first[1]}")
    sa, sb = summary_without_wall(a), summary_without_wall(b)
    assert sa == sb, {k: (sa.get(k), sb.get(k)) for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k)}
    assert config_without_out(a) == config_without_out(b)


@pytest.mark.parametrize("case", SIM_CASES)
def test_sim_runs_repeat_exactly(runs, case):
    a, b = runs.get("sim", case, rep=0), runs.get("sim", case, rep=1)
    assert summary_without_wall(a)["executor"] == "sim"
    assert_same_run(a, b)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_launches_repeat_exactly(runs, case):
    a, b = runs.get("torch", case, rep=0), runs.get("torch", case, rep=1)
    s = summary_without_wall(a)
    assert s["executor"] == "torch" and s["n_agents"] == 3
    assert_same_run(a, b)


def test_torch_fedavg_partial_participation_with_vmap(runs):
    """executor=torch, fedavg_fraction < 1, the vmap strategy (mlp): a rank left out of a round steps with no
    gradient (this once crashed in Simulator._gradients: torch.stack of no batches)."""
    a, b = runs.get("torch", "fedavg-half", rep=0), runs.get("torch", "fedavg-half", rep=1)
    assert_same_run(a, b)


@pytest.mark.parametrize("executor", ["sim", "torch"])
def test_negative_control_other_seed_differs(runs, executor):
    """The comparison is not vacuous: seed=1 against seed=0, same everything else, must fail it."""
    a, b = runs.get(executor, "cdmsgd-mlp", seed=0), runs.get(executor, "cdmsgd-mlp", seed=1)
    ma, mb = metrics_without_wall(a), metrics_without_wall(b)
    assert ma.splitlines()[0] == mb.splitlines()[0]  # same columns, different numbers
    assert ma != mb
    assert summary_without_wall(a) != summary_without_wall(b)
    with pytest.raises(pytest.fail.Exception, match="metrics.csv differs"):
        assert_same_run(a, b)
