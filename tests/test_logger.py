"""cdsgd.run.logger: what a run logs is what TensorBoard reads back, tag by tag, step by step.

The tensorboard tests need the optional extra; without it they are skipped,
unless CDSGD_REQUIRE_TENSORBOARD=1 (CI) makes its absence a failure.
"""

from __future__ import annotations

import doctest
import importlib.util
import math
import os
import sys
import time

import numpy as np
import pytest

import cdsgd.run.logger as L
from cdsgd.executor import METRIC_COLUMNS

try:
    import torch.utils.tensorboard  # noqa: F401  (what the logger needs)
    from tensorboard.backend.event_processing import event_accumulator as ea
except ImportError:
    ea = None

needs_tensorboard = pytest.mark.skipif(
    ea is None and os.environ.get("CDSGD_REQUIRE_TENSORBOARD") != "1",
    reason="the tensorboard package is not installed (pip install 'cdsgd[tensorboard]'); "
           "CDSGD_REQUIRE_TENSORBOARD=1 turns this skip into a failure")


# ------------------------------------------------------------------ helpers

def _read(folder) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})  # 0: keep every value
    acc.Reload()
    return acc


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = _read(folder)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(v: float) -> float:
    """A value as TensorBoard stores it (float32 scalars)."""
    return float(np.float32(v))


def _assert_series(got: list[tuple[int, float]], want: list[tuple[int, float]], tag: str) -> None:
    assert [s for s, _ in got] == [s for s, _ in want], tag
    for (step, g), (_, w) in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == _f32(w), (tag, step, g, w)


def _row(step: int, seed: float) -> dict:
    """A metrics row with every METRIC_COLUMN, values that float32 rounds (1/3-ish), ints where the CSV has them."""
    row = {c: seed + i / 3 for i, c in enumerate(METRIC_COLUMNS)}
    row["step"] = step
    row["epoch"] = step / 10
    row["bytes_sent_per_agent"] = 4096 * step
    return row


def _expected(rows: list[dict], losses: dict[int, float]) -> dict[str, list[tuple[int, float]]]:
    want: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for c, v in r.items():
            if c != "step" and v is not None:
                want.setdefault(L.row_tag(c), []).append((r["step"], v))
    if losses:
        want[L.LOSS_TAG] = sorted(losses.items())
    return want


def _next_second() -> None:
    """Wait for the clock's next second: event files are named by the second they open in, and read in name order."""
    t = int(time.time())
    while int(time.time()) == t:
        time.sleep(0.02)


def _logger_without_tensorboard(monkeypatch, blocked: dict):
    """A fresh copy of cdsgd.run.logger imported while ``blocked`` modules cannot be imported (None in sys.modules)."""
    for name, value in blocked.items():
        if value is None:
            monkeypatch.setitem(sys.modules, name, None)
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("cdsgd.run._logger_without_tensorboard", L.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MISSING = "logger='tensorboard' needs the tensorboard package: pip install 'cdsgd[tensorboard]'"


# ------------------------------------------------------------------ tensorboard round trip

@needs_tensorboard
def test_rows_and_losses_read_back_tag_by_tag_step_by_step(tmp_path):
    rows = [_row(0, 0.1), _row(10, 0.2), _row(20, 0.3)]
    rows[0]["train_loss"] = float("nan")  # no step trained yet: the CSV says nan, and so does TensorBoard
    rows[1]["test_loss"] = float("inf")
    rows[2]["lr"] = 0.05  # a column beyond METRIC_COLUMNS is logged too
    rows[2]["consensus_distance"] = None  # None: no value, nothing written
    rng = np.random.default_rng(0)
    losses = {k: float(rng.random()) * 3 for k in range(1, 21)}
    with L.make_logger("tensorboard", tmp_path / "run") as log:
        for k in range(1, 21):
            if k in (1, 11):
                log.row(rows[k // 10])
            log.train_loss(k, losses[k])
        log.row(rows[2])
    got, want = _scalars(tmp_path / "run"), _expected(rows, losses)
    assert set(got) == set(want)
    assert {L.row_tag(c) for c in METRIC_COLUMNS if c != "step"} | {L.row_tag("lr"), L.LOSS_TAG} == set(want)
    for tag in want:
        _assert_series(got[tag], want[tag], tag)
    assert len(got[L.row_tag("consensus_distance")]) == 2


@needs_tensorboard
def test_rows_are_on_disk_as_soon_as_logged(tmp_path):
    """Like metrics.csv: a run killed after a row leaves that row readable (the writer is not closed here)."""
    log = L.make_logger("tensorboard", tmp_path)
    log.train_loss(1, 0.7)
    log.row(_row(1, 0.5))
    got = _scalars(tmp_path)
    _assert_series(got[L.LOSS_TAG], [(1, 0.7)], L.LOSS_TAG)
    _assert_series(got[L.row_tag("test_accuracy")], [(1, _row(1, 0.5)["test_accuracy"])], "test_accuracy")
    log.close()


@needs_tensorboard
def test_text_is_logged_verbatim(tmp_path):
    config = '# why: a ring\ntopology = "ring"\n[extra]\nlr = 0.1'
    with L.make_logger("tensorboard", tmp_path) as log:
        log.text("config", config)
    acc = _read(tmp_path)
    assert acc.Tags()["tensors"] == ["config/text_summary"]  # torch's add_text names its tag so
    (event,) = acc.Tensors("config/text_summary")
    shown = event.tensor_proto.string_val[0].decode()
    assert event.step == 0
    assert shown == "\n".join("    " + line for line in config.splitlines())  # a Markdown code block


@needs_tensorboard
def test_close_is_idempotent_and_a_closed_logger_refuses_to_write(tmp_path):
    log = L.make_logger("tensorboard", tmp_path)
    with log:
        log.train_loss(1, 0.5)
    log.close()
    with pytest.raises(RuntimeError, match="is closed"):
        log.train_loss(2, 0.4)
    assert len(list(tmp_path.glob(L.EVENT_FILE_PREFIX + "*"))) == 1


@needs_tensorboard
def test_check_logger_creates_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert L.check_logger("tensorboard") == "tensorboard"
    assert L.check_logger("none") == "none"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ resume

@needs_tensorboard
def test_resume_with_purge_step_leaves_one_value_per_step(tmp_path):
    """Run A logs to step 35 and stops; its checkpoint is of step 20; run B resumes there and goes to step 40.

    B's values differ from A's after step 20 (as a nondeterministic rerun's
    would): TensorBoard must show A's up to step 20 and B's after, once each.
    """
    out = tmp_path / "run"
    a_rows = [_row(s, 0.1) for s in (10, 20, 30)]
    a_losses = {k: 1.0 / k for k in range(1, 36)}
    with L.make_logger("tensorboard", out) as log:
        for k in range(1, 36):
            log.train_loss(k, a_losses[k])
            if k % 10 == 0:
                log.row(a_rows[k // 10 - 1])
    checkpoint_step, checkpoint_rows = 20, a_rows[:2]
    _next_second()
    b_rows = [_row(s, 0.7) for s in (30, 40)]
    b_losses = {k: 2.0 / k for k in range(21, 41)}
    with L.make_logger("tensorboard", out, purge_step=checkpoint_step + 1) as log:
        assert log.replay(checkpoint_rows) == 0  # A's event file holds them (each row was flushed)
        for k in range(21, 41):
            log.train_loss(k, b_losses[k])
            if k % 10 == 0:
                log.row(b_rows[k // 10 - 3])
    got = _scalars(out)
    want = _expected(checkpoint_rows + b_rows, {**{k: v for k, v in a_losses.items() if k <= 20}, **b_losses})
    assert set(got) == set(want)
    for tag in want:
        steps = [s for s, _ in got[tag]]
        assert len(steps) == len(set(steps)), (tag, steps)
        _assert_series(got[tag], want[tag], tag)


@needs_tensorboard
def test_resume_into_a_folder_without_event_files_replays_every_row(tmp_path):
    """The stopped run had logger=none: the resumed one writes the checkpoint's rows itself."""
    rows = [_row(s, 0.2) for s in (10, 20)]
    with L.make_logger("tensorboard", tmp_path, purge_step=21) as log:
        assert log.replay(rows) == 2
        log.train_loss(21, 0.3)
    got = _scalars(tmp_path)
    want = _expected(rows, {21: 0.3})
    assert set(got) == set(want)
    for tag in want:
        _assert_series(got[tag], want[tag], tag)


@needs_tensorboard
def test_replay_without_purge_step_writes_every_row(tmp_path):
    with L.make_logger("tensorboard", tmp_path) as log:
        log.train_loss(1, 0.5)
    _next_second()
    with L.make_logger("tensorboard", tmp_path) as log:
        assert log.replay([_row(10, 0.1)]) == 1



@needs_tensorboard
def test_a_fresh_run_in_a_reused_folder_with_purge_step_0_hides_the_old_one(tmp_path):
    with L.make_logger("tensorboard", tmp_path) as log:
        for k in range(1, 11):
            log.train_loss(k, 1.0)
    _next_second()
    with L.make_logger("tensorboard", tmp_path, purge_step=0) as log:
        for k in range(1, 6):
            log.train_loss(k, 2.0)
    _assert_series(_scalars(tmp_path)[L.LOSS_TAG], [(k, 2.0) for k in range(1, 6)], L.LOSS_TAG)

# ------------------------------------------------------------------ none, names, missing package

def test_none_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with L.make_logger("none", out, purge_step=5) as log:
        log.text("config", "a = 1")
        log.row(_row(10, 0.1))
        assert log.replay([_row(20, 0.2)]) == 1
        log.train_loss(11, float("nan"))
        log.flush()
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("call", [L.make_logger, L.check_logger], ids=["make_logger", "check_logger"])
def test_unknown_name_lists_the_allowed(tmp_path, call):
    args = ("tensorbord", tmp_path / "run") if call is L.make_logger else ("tensorbord",)
    with pytest.raises(ValueError) as e:
        call(*args)
    assert "'tensorbord'" in str(e.value) and "did you mean 'tensorboard'" in str(e.value)
    assert f"Known: {', '.join(L.LOGGERS)}" in str(e.value)
    assert list(tmp_path.iterdir()) == []


BAD = [  # (what is called on a "none" logger or make_logger, the message's regex)
    (lambda log, tmp: L.make_logger("none", tmp, purge_step=-1), r"purge_step must be an integer >= 0, got -1"),
    (lambda log, tmp: L.make_logger("none", tmp, purge_step=2.5), r"purge_step must be an integer >= 0, got 2.5"),
    (lambda log, tmp: L.make_logger(None, tmp), r"logger None is unknown.*Known: none, tensorboard"),
    (lambda log, tmp: log.row({"epoch": 1.0}), r"needs its 'step'.*\['epoch'\]"),
    (lambda log, tmp: log.row({"step": -1}), r"metrics row: step must be an integer >= 0, got -1"),
    (lambda log, tmp: log.row({"step": 1, "status": "ok"}), r"column 'status' must be a number \(or None\), got 'ok'"),
    (lambda log, tmp: log.train_loss(1.5, 0.1), r"train_loss: step must be an integer >= 0, got 1.5"),
    (lambda log, tmp: log.train_loss(1, "low"), r"must be a number \(or None\), got 'low'"),
    (lambda log, tmp: log.text("", "x"), r"tag must be a non-empty string, got ''"),
    (lambda log, tmp: log.text("config", b"x"), r"text must be a string, got bytes"),
]


@pytest.mark.parametrize("call, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_inputs_name_the_value(tmp_path, call, message):
    with pytest.raises(ValueError, match=message):
        call(L.RunLogger(), tmp_path)


@pytest.mark.parametrize("blocked", [{"torch.utils.tensorboard": None},
                                     {"torch.utils.tensorboard": "unloaded", "tensorboard": None}],
                         ids=["torch.utils.tensorboard", "tensorboard"])
def test_without_the_package_the_core_imports_and_tensorboard_says_how_to_install(tmp_path, monkeypatch, blocked):
    mod = _logger_without_tensorboard(monkeypatch, blocked)
    assert mod.check_logger("none") == "none"
    with mod.make_logger("none", tmp_path / "run") as log:
        log.row(_row(1, 0.1))
    for call in (lambda: mod.check_logger("tensorboard"), lambda: mod.make_logger("tensorboard", tmp_path / "run")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(MISSING)
        assert isinstance(e.value.__cause__, ImportError)
    assert list(tmp_path.iterdir()) == []


def test_docstring_examples():
    result = doctest.testmod(L, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@needs_tensorboard
def test_a_run_with_logger_tensorboard_logs_what_metrics_csv_holds(tmp_path):
    """End to end: every metrics.csv column per evaluation, and one training loss per step, read back."""
    import csv

    from cdsgd.config import load_config
    from cdsgd.run.experiment import run_experiment

    out = tmp_path / "run"
    s = run_experiment(load_config(overrides=["dataset=synthetic", "model=logreg", "n_agents=4", "epochs=2",
                                              "batch_size=16", "logger=tensorboard", f"out={out}"]),
                       progress=False, log=lambda m: None)
    with open(out / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    got = _scalars(out)
    for column in METRIC_COLUMNS:
        if column != "step":
            _assert_series(got[L.row_tag(column)], [(int(r["step"]), r[column]) for r in rows], column)
    losses = got[L.LOSS_TAG]
    assert [step for step, _ in losses] == list(range(1, 2 * s["steps_per_epoch"] + 1))
    # the mean of the per-step losses since the last evaluation is that row's train_loss (float32 rounding)
    first = [v for step, v in losses if step <= rows[0]["step"]]
    assert sum(first) / len(first) == pytest.approx(rows[0]["train_loss"], rel=1e-5)
