"""What a run measures and says: the warm-up step kept out of wall_seconds and the ETA, the hints'
wording and thresholds, the renamed ``eval_every_steps`` keyword.

The clocks are faked (the executor's ``time`` is replaced, the gradients advance it by set amounts),
so the figures are exact, not timed."""

from __future__ import annotations

import csv
import doctest
import importlib
import json
import types
import warnings

import pytest
import torch
from torch import nn

import topologies
from cdsgd.config import load_config
from cdsgd.executor import Executor, simulate
from cdsgd.executor import core
from cdsgd.executor.gradients import GradientStrategy
from cdsgd.run.experiment import run_experiment
from cdsgd.run.hints import EVAL_HINT_SECONDS, diverged_hint, eval_hint
from cdsgd.run.progress import Progress

WARMUP, STEP = 5.0, 0.25  # binary fractions: sums of them are exact


@pytest.fixture
def fake_clock(monkeypatch):
    """The executor's clock stands still except in the gradients: the first call takes WARMUP, each later STEP."""
    now = {"t": 0.0, "calls": 0}
    monkeypatch.setattr(core, "time", types.SimpleNamespace(perf_counter=lambda: now["t"]))

    def wrap(real):
        def gradients(self, *args, **kwargs):
            now["t"] += WARMUP if now["calls"] == 0 else STEP
            now["calls"] += 1
            return real(self, *args, **kwargs)
        return gradients

    monkeypatch.setattr(GradientStrategy, "gradients", wrap(GradientStrategy.gradients))  # loop and vmap alike
    return now


def _executor(**kw):
    torch.manual_seed(0)
    shards = [(torch.randn(16, 3), torch.randint(0, 2, (16,))) for _ in range(3)]
    W = topologies.mixing_matrix(topologies.build("path", 3))
    return Executor.build(lambda: nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=4, **kw)


def test_the_first_step_is_warmup_not_training(fake_clock):
    ex = _executor()
    rows = ex.run(steps=8, eval_every_steps=4)
    assert ex.warmup_seconds == WARMUP and ex.timed_steps == 7
    assert [r["wall_seconds"] for r in rows] == [3 * STEP, 7 * STEP]  # step 1's WARMUP is in neither row


def test_a_resumed_executor_warms_up_again_and_keeps_the_counts(fake_clock):
    first = _executor()
    first.run(steps=4)
    fake_clock["calls"] = 0  # a new process: its first step pays the warm-up again
    again = _executor()
    again.load_state_dict(first.state_dict())
    again.run(steps=4)
    assert again.warmup_seconds == 2 * WARMUP and again.timed_steps == 3 + 3 and again.train_seconds == 6 * STEP


def test_eta_ignores_the_warmup_step(fake_clock):
    ex = _executor()
    for _ in range(4):
        ex.step()
    p = Progress(total=10, every=10, mode="off", log=print,
                 timing=lambda: (ex.train_seconds, ex.timed_steps, ex.eval_seconds, 0))
    # 6 steps still to come at STEP each, 1 evaluation of unknown cost (none so far: 0 s)
    assert p.eta(4) == 6 * STEP
    # the old formula, (total time / steps done) per step, would have said 6 * (WARMUP + 3 * STEP) / 4
    assert p.eta(4) != 6 * (WARMUP + 3 * STEP) / 4
    before = Progress(total=10, every=10, mode="off", log=print, timing=lambda: (0.0, 0, 0.0, 0))
    assert before.eta(1) != before.eta(1)  # NaN ("ETA ?") while only the warm-up step is done


def test_summary_reports_warmup_apart_from_training(fake_clock, tmp_path):
    out = tmp_path / "r"
    run_experiment(load_config(overrides=["dataset=synthetic", "model=logreg", "n_agents=4", "epochs=2",
                                          "batch_size=16", f"out={out}"]), progress=False, log=lambda m: None)
    s = json.loads((out / "summary.json").read_text())
    steps = s["step"]
    assert s["warmup_seconds"] == WARMUP
    assert s["train_seconds"] == s["wall_seconds"] == (steps - 1) * STEP
    with open(out / "metrics.csv", newline="") as f:
        first = next(csv.DictReader(f))  # the time axis of loss_vs_time starts after the warm-up
    assert float(first["wall_seconds"]) == (int(first["step"]) - 1) * STEP


class _Sim:
    eval_agents, test_set = [0, 1], (torch.zeros(300, 2), torch.zeros(300))

    def __init__(self, train, evaluation):
        self.train_seconds, self.eval_seconds = train, evaluation


def test_eval_hint_needs_evaluation_to_cost_more_than_training_and_a_second():
    cfg = load_config()
    assert eval_hint(cfg, _Sim(0.004, 0.02)) == ""  # "evaluation took 0.0 s against 0.0 s of training": not said
    assert eval_hint(cfg, _Sim(0.0, EVAL_HINT_SECONDS * 0.99)) == ""
    hint = eval_hint(cfg, _Sim(0.5, EVAL_HINT_SECONDS * 2))
    assert hint.startswith("evaluation took 2.0 s against 0.5 s of training")


def test_divergence_hint_says_what_to_lower_not_values_to_use():
    hint = diverged_hint(load_config(overrides=["lr=1e6", "momentum=0.95"]))
    assert hint == ("lr=1e+06 is likely too high for this run: try a lower lr (e.g. lr=1e+05) "
                    "or a lower momentum than 0.95")
    plain = diverged_hint(load_config(overrides=["algorithm=cdsgd", "lr=0.3"]))  # no momentum in CDSGD
    assert plain == "lr=0.3 is likely too high for this run: try a lower lr (e.g. lr=0.03)"


def test_the_divergence_line_of_a_run(tmp_path):
    logs = []
    with pytest.raises(Exception, match="diverged"):
        run_experiment(load_config(overrides=["dataset=synthetic", "model=mlp", "n_agents=4", "epochs=1",
                                              "batch_size=16", "lr=1e10", "momentum=0.95", f"out={tmp_path / 'r'}"]),
                       progress=False, log=logs.append)
    (line,) = [m for m in logs if "status diverged" in m]
    assert line.endswith("lr=1e+10 is likely too high for this run: try a lower lr (e.g. lr=1e+09) "
                         "or a lower momentum than 0.95"), line


def test_eval_every_steps_has_no_old_name():
    """Executor.run and simulate count evaluations in steps, as ``eval_every_steps=``; ``eval_every=`` (the
    config's, in epochs) is no keyword of theirs."""
    assert [r["step"] for r in _executor().run(steps=6, eval_every_steps=2)] == [2, 4, 6]
    with pytest.raises(TypeError, match="unexpected keyword argument 'eval_every'"):
        _executor().run(steps=6, eval_every=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'eval_evry'"):
        _executor().run(steps=6, eval_evry=2)
    shards = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = simulate(lambda: nn.Linear(3, 2), shards, None, "sgd", steps=4, eval_every_steps=2, batch_size=4, lr=0.1)
    assert [r["step"] for r in res.metrics] == [2, 4]
    with pytest.raises((TypeError, ValueError), match="'eval_every'"):
        simulate(lambda: nn.Linear(3, 2), shards, None, "sgd", steps=4, eval_every=2, batch_size=4, lr=0.1)


@pytest.mark.parametrize("module", ["cdsgd.run.hints", "cdsgd.run.interrupt", "cdsgd.run.progress",
                                    "cdsgd.executor.timing"])
def test_docstring_examples(module):
    assert doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS).failed == 0
