"""Checkpoints and resume (simulator): a resumed run equals an uninterrupted one; bad checkpoints are refused."""

from __future__ import annotations

import csv
import io
import json
import pathlib
import pickle
import shutil
import signal

import pytest
import torch

from cdsgd.run import checkpoint as ckpt
from cdsgd.config import load_config
from cdsgd.run.experiment import run_experiment

# a CNN with dropout on 8x8 digits, with augmentation and momentum: every random stream matters.
# 4 agents x 60 samples / batch 16 = 4 steps per epoch; checkpoints every 3 steps fall mid-epoch.
BASE = ["dataset=digits", "train_subset=240", "test_subset=60", "n_agents=4", "model=cnn", "augment=true",
        "batch_size=16", "epochs=3", "lr=0.05", "momentum=0.9", "eval_every=1", "save_params=true"]


def _cfg(out, *extra):
    return load_config(overrides=[*BASE, f"out={out}", *extra])


def _metrics_without_wall(out):
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    wall = rows[0].index("wall_seconds")
    return [r[:wall] + r[wall + 1:] for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (with checkpoints: they must not change the result)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    run_experiment(_cfg(out, "checkpoint_every=3", "checkpoint_unit=steps"), progress=False, log=lambda m: None)
    return out


def test_checkpoints_do_not_change_the_run(reference, tmp_path):
    plain = tmp_path / "plain"
    run_experiment(_cfg(plain), progress=False, log=lambda m: None)
    assert _metrics_without_wall(plain) == _metrics_without_wall(reference)
    assert torch.equal(torch.load(plain / "params.pt"), torch.load(reference / "params.pt"))
    # only the latest complete checkpoint is kept (12 steps, every 3: step 12)
    assert ckpt.steps_on_disk(reference, 0) == [12]
    assert not (plain / "checkpoints").exists()


@pytest.mark.parametrize("stop_at", [5, 7, 11])
def test_resume_mid_epoch_equals_the_uninterrupted_run(reference, tmp_path, monkeypatch, interrupt_at, stop_at):
    out = tmp_path / "run"
    logs = []
    interrupt_at(stop_at)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(out, "checkpoint_every=3", "checkpoint_unit=steps"), progress=False, log=logs.append)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    last = (stop_at // 3) * 3  # the checkpoint the interrupted run left
    assert ckpt.steps_on_disk(out, 0) == [last]
    monkeypatch.undo()

    run_experiment(_cfg(out, "checkpoint_every=3", "checkpoint_unit=steps", "resume=true"), progress=False,
                   log=logs.append)
    assert any(f"continuing from the checkpoint of step {last}" in m for m in logs), logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] == last
    assert _metrics_without_wall(out) == _metrics_without_wall(reference)
    assert torch.equal(torch.load(out / "params.pt", weights_only=True),
                       torch.load(reference / "params.pt", weights_only=True))


@pytest.fixture
def ctrl_c_in_step(monkeypatch):
    """``ctrl_c_in_step(k)``: a real SIGINT to this process in the middle of step k (1-based), as Ctrl-C sends."""
    from cdsgd.executor import Executor as Simulator  # the class whose step a run calls

    real = Simulator.step

    def arm(k: int) -> None:
        def step(self):
            if self.k == k - 1:
                signal.raise_signal(signal.SIGINT)  # its handler runs here, before the step's arithmetic
            return real(self)

        monkeypatch.setattr(Simulator, "step", step)

    return arm


@pytest.mark.parametrize("stop_at, extra", [(5, ["checkpoint_every=3", "checkpoint_unit=steps"]),
                                            (8, [])])  # 8: an evaluation step; checkpoint_every=0
def test_ctrl_c_checkpoints_the_step_it_stopped_at(reference, tmp_path, monkeypatch, ctrl_c_in_step, stop_at, extra):
    """Ctrl-C during step K: the step is finished, its checkpoint written (not the periodic one before it), and
    the resumed run ends exactly as the uninterrupted one."""
    out = tmp_path / "run"
    logs = []
    ctrl_c_in_step(stop_at)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(out, *extra), progress=False, log=logs.append)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["checkpoint_at_interruption"] == stop_at
    assert summary["step"] == (stop_at // 4) * 4  # the last row written (4 steps an epoch)
    assert ckpt.steps_on_disk(out, 0) == [stop_at]
    assert logs[-1] == (f"cdsgd run: interrupted at step {stop_at} of 12; continue it with: "
                        f"cdsgd run {out / 'config.toml'} resume=true")
    monkeypatch.undo()

    run_experiment(_cfg(out, *extra, "resume=true"), progress=False, log=logs.append)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] == stop_at
    assert _metrics_without_wall(out) == _metrics_without_wall(reference)
    assert torch.equal(torch.load(out / "params.pt", weights_only=True),
                       torch.load(reference / "params.pt", weights_only=True))


def test_a_second_ctrl_c_stops_at_once_and_sigterm_keeps_its_own_handler():
    from cdsgd.run.interrupt import StopBetweenSteps

    class Stopped(KeyboardInterrupt):
        pass

    def on_term(signum, frame):
        raise Stopped()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            with StopBetweenSteps():
                signal.raise_signal(signal.SIGINT)  # held
                signal.raise_signal(signal.SIGINT)  # raises here
                pytest.fail("the second Ctrl-C did not stop at once")
        assert type(e.value) is KeyboardInterrupt
        with pytest.raises(Stopped):
            with StopBetweenSteps() as stop:
                signal.raise_signal(signal.SIGTERM)
                assert stop.requested
                stop.deliver()  # what the SIGTERM handler raises (the CLI's: Terminated)
        with StopBetweenSteps(enabled=False) as stop:  # several processes: handlers untouched
            assert signal.getsignal(signal.SIGTERM) is on_term and not stop.requested
        assert signal.getsignal(signal.SIGTERM) is on_term
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_resume_of_a_finished_run_rewrites_the_same_results(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "params.pt").unlink()
    run_experiment(_cfg(out, "checkpoint_every=3", "checkpoint_unit=steps", "resume=true"), progress=False,
                   log=lambda m: None)
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 12
    assert _metrics_without_wall(out) == _metrics_without_wall(reference)
    assert torch.equal(torch.load(out / "params.pt"), torch.load(reference / "params.pt"))


def test_resume_without_checkpoint_starts_over(reference, tmp_path):
    logs = []
    out = tmp_path / "run"
    run_experiment(_cfg(out, "resume=true"), progress=False, log=logs.append)
    assert any("no checkpoint held by all 1 rank(s)" in m and "starting from step 0" in m for m in logs), logs
    assert _metrics_without_wall(out) == _metrics_without_wall(reference)


def test_checkpoint_every_epochs_unit(tmp_path):
    out = tmp_path / "run"
    _cfg_ = load_config(overrides=[*BASE, f"out={out}", "epochs=1.5", "checkpoint_every=0.5"])
    run_experiment(_cfg_, progress=False, log=lambda m: None)
    assert ckpt.steps_on_disk(out, 0) == [6]  # every 2 steps (half of 4), the last at step 6


def test_resume_refuses_another_config(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    with pytest.raises(ValueError, match=r"cannot resume into .*another config \(lr is 0\.05 there but 0\.1 "):
        run_experiment(_cfg(out, "resume=true", "lr=0.1"), progress=False, log=lambda m: None)
    # the checkpoint itself carries the config too (a run folder whose config.toml was replaced)
    (out / "config.toml").unlink()
    with pytest.raises(ValueError, match=r"checkpoint .*rank-0.pt.* belongs to another config: lr is 0\.05"):
        run_experiment(_cfg(out, "resume=true", "lr=0.1"), progress=False, log=lambda m: None)


def _corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_flip(path):
    data = bytearray(path.read_bytes())
    for i in range(200, len(data), 997):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


class _Evil:
    def __reduce__(self):
        return (open, ("/tmp/cdsgd-should-not-exist", "w"))


def _corrupt_malicious(path):
    """A pickle that would create a file when unpickled without restriction."""
    buf = io.BytesIO()
    torch.save({"format": ckpt.FORMAT, "evil": _Evil()}, buf)
    path.write_bytes(buf.getvalue())


def _corrupt_world(path):
    payload = torch.load(path, weights_only=True)
    payload["world"] = 3
    torch.save(payload, path)


@pytest.mark.parametrize("corrupt,pattern", [
    (_corrupt_truncate, r"is corrupted or not a cdsgd checkpoint"),
    (_corrupt_flip, r"is corrupted or not a cdsgd checkpoint"),
    (_corrupt_malicious, r"is corrupted or not a cdsgd checkpoint .*weights_only=True refused"),
    (_corrupt_world, r"was written by a run of world size 3, this run has world size 1"),
])
def test_bad_checkpoint_is_refused(reference, tmp_path, corrupt, pattern):
    marker = pathlib.Path("/tmp/cdsgd-should-not-exist")
    marker.unlink(missing_ok=True)
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    corrupt(ckpt.checkpoint_path(out, 12, 0))
    with pytest.raises(ValueError, match=pattern):
        run_experiment(_cfg(out, "resume=true"), progress=False, log=lambda m: None)
    assert not marker.exists(), "a checkpoint's pickle ran code"


def test_weights_only_refuses_what_plain_pickle_would_run(tmp_path):
    """The control for the malicious case: the same bytes do run code under plain pickle loading."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    torch.save({"evil": Evil()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_checkpoint_files_are_written_atomically(tmp_path):
    """A crash while writing leaves a hidden temporary file, never a half-written checkpoint."""
    ckpt.save(tmp_path, 4, 0, {"x": torch.ones(3)})
    stray = ckpt.checkpoint_path(tmp_path, 8, 0).parent
    stray.mkdir(parents=True)
    (stray / ".rank-0.pt.123.tmp").write_bytes(b"half")
    assert ckpt.steps_on_disk(tmp_path, 0) == [4]


def test_sweep_continues_a_stopped_run_from_its_checkpoint(reference, tmp_path, monkeypatch, interrupt_at):
    """`cdsgd sweep` re-run after a stop: the unfinished run resumes (resume=true), the result is unchanged."""
    from cdsgd import cli
    from cdsgd.run.sweep import load_sweep

    spec = tmp_path / "s.toml"
    base = "\n".join(f"{k} = {v}" if v.replace(".", "").isdigit() or v in ("true", "false") else f'{k} = "{v}"'
                     for k, v in (kv.split("=", 1) for kv in BASE))
    spec.write_text(f"[base]\n{base}\ncheckpoint_every = 3\ncheckpoint_unit = \"steps\"\n[grid]\nseed = [0]\n")
    (run,) = load_sweep(spec, tmp_path / "out")
    interrupt_at(7)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(run.config, progress=False, log=lambda m: None)
    monkeypatch.undo()
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 0
    assert "continuing from the checkpoint of step 6" in (run.folder / "run.log").read_text()
    assert _metrics_without_wall(run.folder) == _metrics_without_wall(reference)


def _sigterm_while_diagnosing(monkeypatch, times):
    """The group's diagnosis is cut short ``times`` times by a SIGTERM, as torchrun's stop of every rank
    arrives while a rank that lost a peer asks the store which one (at most once per process in the CLI)."""
    from cdsgd.runtime import LocalGroup, Terminated

    real, left = LocalGroup.diagnose, [times]

    def diagnose(self, e):
        if left[0] > 0:
            left[0] -= 1
            raise Terminated()
        return real(self, e)

    monkeypatch.setattr(LocalGroup, "diagnose", diagnose)


def test_a_sigterm_while_diagnosing_a_failure_still_ends_it_failed(tmp_path, monkeypatch, interrupt_at):
    """The loss is the cause: summary.json says failed with its message, never 'running' (a flaky CI run did)."""
    out = tmp_path / "run"
    interrupt_at(6, RuntimeError("lost the connection to rank 1"))
    _sigterm_while_diagnosing(monkeypatch, 1)
    with pytest.raises(BaseException) as raised:  # not a KeyboardInterrupt: that would stop pytest
        run_experiment(_cfg(out), progress=False, log=lambda m: None)
    assert raised.type is RuntimeError and "lost the connection" in str(raised.value)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "lost the connection to rank 1", summary
    assert summary["evaluations"] == 1  # the evaluation of epoch 1 (step 4) is kept


def test_a_summary_left_running_is_completed_with_the_error(tmp_path, monkeypatch, interrupt_at):
    """Should the failure handler be cut short anyway, the summary written on the way out says so."""
    out = tmp_path / "run"
    interrupt_at(6, RuntimeError("lost the connection to rank 1"))
    _sigterm_while_diagnosing(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(out), progress=False, log=lambda m: None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "Terminated", summary
    assert summary["evaluations"] == 1 and summary["steps_per_epoch"] == 4
