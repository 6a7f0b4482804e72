"""`cdsgd run` / run_experiment: the output-folder contract, configs, interruption, `cdsgd data`."""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import topologies
from cdsgd import cli
from cdsgd.config import load_config
from cdsgd.run.experiment import run_experiment, validate_config
from cdsgd.executor import METRIC_COLUMNS

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTRACT_COLUMNS = ["epoch", "step", "train_loss", "test_loss", "test_accuracy", "test_accuracy_avg_model",
                    "consensus_distance", "bytes_sent_per_agent", "wall_seconds", "sim_seconds",
                    "test_loss_avg_model", "mgrit_iters", "mgrit_residual", "mgrit_fallbacks", "mgrit_solves",
                    "test_bits_per_byte", "test_perplexity", "test_bits_per_byte_avg_model", "test_perplexity_avg_model"]
SMALL = ["dataset=synthetic", "model=logreg", "n_agents=4", "epochs=2", "batch_size=16", "lr=0.1"]


def read_metrics(out):
    with open(out / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CONTRACT_COLUMNS
        return [{k: float(v) for k, v in row.items()} for row in reader]


def test_eval_steps_evaluates_every_k_steps_and_at_the_end(tmp_path):
    """eval_steps=3 overrides eval_every (epochs): rows at steps 3, 6, ... and the last step."""
    out = tmp_path / "r"
    run_experiment(load_config(overrides=SMALL + [f"out={out}", "eval_steps=3"]), progress=False, log=lambda m: None)
    rows = read_metrics(out)
    total = int(rows[-1]["step"])
    assert rows[-1]["epoch"] == 2.0 and total > 6
    assert [int(r["step"]) for r in rows] == list(range(3, total + 1, 3)) + ([total] if total % 3 else [])


def test_metric_columns_are_the_contract():
    assert list(METRIC_COLUMNS) == CONTRACT_COLUMNS


def test_main_job_default_config(tmp_path):
    """The README's main job: no config, digits, 5 agents, ring, CDMSGD; accuracy >= 0.90."""
    out = tmp_path / "main"
    r = subprocess.run([sys.executable, "-m", "cdsgd", "run", f"out={out}"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "test accuracy" in r.stdout
    rows = read_metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["test_accuracy"] >= 0.90 and summary["test_accuracy_avg_model"] >= 0.90
    assert (summary["algorithm"], summary["topology"], summary["n_agents"], summary["dataset"]) == \
        ("cdmsgd", "ring", 5, "digits")
    gap = topologies.spectral_gap(topologies.mixing_matrix(topologies.build("ring", 5))).gap
    assert summary["spectral_gap"] == pytest.approx(gap)
    assert len(rows) == 30 and rows[-1]["test_accuracy"] == summary["test_accuracy"]
    # bytes: degree 2 × P floats × 4 bytes × steps
    assert rows[-1]["bytes_sent_per_agent"] == 2 * summary["n_parameters"] * 4 * rows[-1]["step"]
    assert load_config(out / "config.toml") == load_config(overrides=[f"out={out}"])


def test_run_folder_contract_and_summary(tmp_path):
    out = tmp_path / "r"
    summary = run_experiment(load_config(overrides=SMALL + [f"out={out}", "eval_every=1"]), progress=False,
                             log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "metrics.csv", "summary.json"]
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == [1.0, 2.0]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    for key in ["algorithm", "topology", "n_agents", "spectral_gap", "seed", "torch_version", "cdsgd_version",
                *CONTRACT_COLUMNS]:
        assert key in summary, key
    assert summary["best_test_accuracy"] == max(r["test_accuracy"] for r in rows)
    assert summary["test_accuracy"] > 0.7  # synthetic classes are well separated


def test_same_seed_same_metrics(tmp_path):
    a = run_experiment(load_config(overrides=SMALL + [f"out={tmp_path / 'a'}"]), progress=False, log=lambda m: None)
    b = run_experiment(load_config(overrides=SMALL + [f"out={tmp_path / 'b'}"]), progress=False, log=lambda m: None)
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    for x, y in zip(ra, rb):
        assert ({k: repr(v) for k, v in x.items() if k != "wall_seconds"}
                == {k: repr(v) for k, v in y.items() if k != "wall_seconds"})  # repr: nan == nan (no network)
    assert a["test_accuracy"] == b["test_accuracy"]


def test_nonempty_out_refused(tmp_path):
    (tmp_path / "x.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"output folder .* is not empty; choose another out=, set overwrite=true, or resume=true"):
        run_experiment(load_config(overrides=SMALL + [f"out={tmp_path}"]), progress=False, log=lambda m: None)
    assert (tmp_path / "x.txt").read_text() == "keep me"


def test_interrupt_leaves_complete_files(tmp_path, interrupt_at):
    out = tmp_path / "int"
    interrupt_at(lambda sim: 2 * sim.steps_per_epoch + 1)  # mid-way through epoch 3
    status = cli.main(["run", *SMALL, "epochs=5", f"out={out}", "--no-progress"])
    assert status == 130
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == [1.0, 2.0]
    assert all(not math.isnan(r["test_accuracy"]) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["epoch"] == 2.0


def test_print_config_and_bad_input_exit_codes(tmp_path, capsys):
    assert cli.main(["run", "lr=0.5", "--print-config"]) == 0
    text = capsys.readouterr().out
    p = tmp_path / "c.toml"
    p.write_text(text)
    assert load_config(p).lr == 0.5
    assert cli.main(["run", "lrr=0.5"]) == 2
    assert "config key 'lrr' is unknown; did you mean 'lr'?" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "missing.toml")]) == 2  # input errors exit 2, a missing file too
    assert "does not exist" in capsys.readouterr().err


def test_data_verb_histogram(capsys):
    assert cli.main(["data", "digits", "--agents", "5", "--partition", "classes"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [list(map(int, line.split())) for line in out[2:7]]
    for j, row in enumerate(table):
        assert row[0] == j and row[1] == sum(row[2:])
        assert [c for c, v in enumerate(row[2:]) if v] == [2 * j, 2 * j + 1]


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "paper").glob("*.toml")), ids=lambda p: p.name)
def test_experiment_configs_load_and_validate(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    validate_config(cfg)
    G = topologies.resolve(cfg.topology, cfg.n_agents, **cfg.topology_params)
    W = topologies.mixing_matrix(G, cfg.mixing)
    expected = np.full(5, 0.2) if cfg.topology == "complete" else np.full(5, 0.34)
    np.testing.assert_allclose(np.diag(W), expected)
    assert (cfg.n_agents, cfg.batch_size, cfg.lr, cfg.momentum) == (5, 128, 0.01, 0.95)


FASHION = pathlib.Path("/usr/share/datasets/fashion-mnist")
REQUIRE_FASHION = os.environ.get("CDSGD_REQUIRE_FASHION_MNIST") == "1"


@pytest.mark.slow  # a study of tens of seconds in one process: the whole suite runs it, the fast tier does not
def test_end_to_end_fashion_mnist(tmp_path):
    """Real Fashion-MNIST: 5 agents, ring, CDMSGD (μ 0.95), the paper's CNN, 10,000 training samples.

    Threshold 0.75: this run measured 0.806 (average model 0.814) here, in
    about 40 s on 2 cores; the paper's CNN exceeds 0.9 on the full set after
    more epochs. 0.75 leaves room for thread-count and platform rounding
    while still failing for a model that did not learn (chance is 0.10) or
    for agents that drifted apart (the average model is checked too).
    """
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        if REQUIRE_FASHION:
            pytest.fail(f"CDSGD_REQUIRE_FASHION_MNIST=1 but {FASHION} has no Fashion-MNIST files")
        pytest.skip(f"Fashion-MNIST not installed at {FASHION} (apt-get install dataset-fashion-mnist)")
    out = tmp_path / "fm"
    summary = run_experiment(load_config(overrides=[
        "dataset=fashion-mnist", f"data_dir={tmp_path / 'nodata'}", "n_agents=5", "topology=ring",
        "algorithm=cdmsgd", "model=cnn", "train_subset=10000", "test_subset=2000", "epochs=3",
        "batch_size=32", "lr=0.01", "momentum=0.95", f"out={out}"]), progress=False, log=lambda m: None)
    rows = read_metrics(out)
    assert len(rows) == 3
    assert summary["test_accuracy"] > 0.75, summary
    assert summary["test_accuracy_avg_model"] > 0.75, summary


def test_diverged_run_stops_and_says_so(tmp_path):
    """A run whose loss becomes NaN stops at that step with status diverged, names step and agent, exits 1."""
    out = tmp_path / "div"
    r = subprocess.run([sys.executable, "-m", "cdsgd", "run", *SMALL, "model=mlp", "lr=1e10", "algorithm=local",
                        f"out={out}", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = read_metrics(out)
    step, agent = summary["diverged_at_step"], summary["diverged_agent"]
    assert summary["status"] == "diverged" and summary["train_loss"] is None
    assert f"agent {agent}'s {summary['diverged_what']} became non-finite at step {step}" in r.stderr
    # it stopped at that very step: the last row is that step's, the rows before it are finite
    assert rows[-1]["step"] == step < summary["steps_per_epoch"] * 2
    assert all(math.isfinite(row["train_loss"]) for row in rows[:-1]) and math.isnan(rows[-1]["train_loss"])
