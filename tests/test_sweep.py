"""Sweeps: grid expansion, run identity, resume, failures, results.csv, plots."""

from __future__ import annotations

import csv
import json

import pytest

from cdsgd import cli
from cdsgd.run.sweep import RESULT_COLUMNS, load_sweep, run_identity

TINY = """
[base]
dataset = "digits"
model = "logreg"
n_agents = 4
epochs = 1
batch_size = 32
lr = 0.1
"""


def write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_grid_zip_exclude_expansion(tmp_path):
    p = write(tmp_path, TINY + """
[grid]
algorithm = ["cdsgd", "cdmsgd"]
seed = [0, 1, 2]
[[zip]]
topology = ["ring", "torus"]
n_agents = [4, 9]
[[exclude]]
algorithm = "cdsgd"
topology = "torus"
""")
    runs = load_sweep(p, tmp_path / "out")
    combos = {(r.config.algorithm, r.config.seed, r.config.topology, r.config.n_agents) for r in runs}
    expected = {(a, s, t, n) for a in ("cdsgd", "cdmsgd") for s in (0, 1, 2) for t, n in (("ring", 4), ("torus", 9))
                if not (a == "cdsgd" and t == "torus")}
    assert combos == expected and len(runs) == 9
    names = [r.folder.name for r in runs]
    assert len(set(names)) == len(names)
    assert "algorithm=cdmsgd,seed=1,topology=torus,n_agents=9" in names
    assert all(r.config.out == str(r.folder) for r in runs)
    # stable: the same file gives the same folders and identities
    again = load_sweep(p, tmp_path / "out")
    assert [r.folder for r in again] == [r.folder for r in runs]
    assert [r.identity for r in again] == [r.identity for r in runs]


def test_identity_ignores_folder_but_not_settings(tmp_path):
    runs = load_sweep(write(tmp_path, TINY + "[grid]\nseed = [0, 1]\n"), tmp_path / "a")
    other = load_sweep(write(tmp_path, TINY + "[grid]\nseed = [0, 1]\n", "t.toml"), tmp_path / "b")
    assert runs[0].identity == other[0].identity != runs[1].identity
    before = runs[0].identity
    cfg = runs[0].config
    cfg.lr = 0.2
    assert run_identity(cfg) != before


@pytest.mark.parametrize("text,pattern", [
    (TINY + "[grid]\nlrr = [0.1]\n", r"config key 'lrr' is unknown; did you mean 'lr'\?"),
    (TINY + "[grid]\nseed = 3\n", r"sweep grid.seed must be a non-empty list"),
    (TINY + "[[zip]]\ntopology = ['ring', 'torus']\nn_agents = [4]\n", r"zip group keys must have lists of one length"),
    (TINY + "[grid]\nseed = [0]\n[[zip]]\nseed = [1]\n", r"sweep key 'seed' appears in more than one"),
    (TINY + "[griid]\nseed = [0]\n", r"unknown table or key 'griid'; allowed: base, grid, zip, exclude"),
    (TINY + "[grid]\nseed = [0]\n[[exclude]]\nseed = 0\n", r"expands to no run"),
    (TINY + "[grid]\nalgorithm = ['cdsdg']\n", r"algorithm 'cdsdg' is unknown; did you mean 'cdsgd'"),
])
def test_bad_sweep_files(tmp_path, text, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_sweep(write(tmp_path, text), tmp_path / "out")


def read_results(out):
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_real_sweep_resume_failures_results_and_plots(tmp_path, capsys):
    spec = write(tmp_path, TINY + """
[grid]
topology = ["ring", "complete"]
seed = [0, 1]
""")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--jobs", "2"]) == 0
    fields, rows = read_results(out)
    assert fields == ["topology"] + RESULT_COLUMNS
    assert len(rows) == 4 and all(r["status"] == "completed" for r in rows)
    assert {(r["topology"], r["seed"]) for r in rows} == {(t, s) for t in ("ring", "complete") for s in ("0", "1")}
    for r in rows:  # the row is the run's own summary
        summary = json.loads((out / r["run"] / "summary.json").read_text())
        assert float(r["test_accuracy"]) == summary["test_accuracy"] > 0.5
        assert float(r["spectral_gap"]) == pytest.approx(summary["spectral_gap"])
    capsys.readouterr()

    # resume: nothing to do; then an interrupted run is rerun and only it
    assert cli.main(["sweep", str(spec), "--out", str(out)]) == 0
    assert "4 of 4 runs already finished (same config): skipped" in capsys.readouterr().out
    victim = out / rows[0]["run"] / "summary.json"
    data = json.loads(victim.read_text())
    data["status"] = "interrupted"
    victim.write_text(json.dumps(data))
    assert cli.main(["sweep", str(spec), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 of 4 runs already finished" in text and f"done    {rows[0]['run']}" in text
    assert json.loads(victim.read_text())["status"] == "completed"

    # --collect rebuilds the same table
    (out / "results.csv").unlink()
    assert cli.main(["sweep", "--collect", str(out)]) == 0
    assert len(read_results(out)[1]) == 4

    # plots: the four sweep figures, and a single run's curves
    assert cli.main(["plot", str(out)]) == 0
    for name in ("accuracy_vs_epoch.png", "consensus_vs_epoch.png", "accuracy_vs_spectral_gap.png",
                 "accuracy_vs_effective_neighbours.png", "accuracy_vs_bytes.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, name
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| topology | seeds | spectral gap | test acc (agents) |")
    ring = next(line for line in table if line.startswith("| ring |"))
    accs = [float(r["test_accuracy"]) for r in rows if r["topology"] == "ring"]
    assert f"| 2 | 0.667 | {sum(accs) / 2:.3f} ± " in ring
    run = out / rows[0]["run"]
    assert cli.main(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 10000


def test_failing_run_is_reported_and_the_rest_finish(tmp_path, capsys):
    """A run that passes validation but fails when it runs (its data set's files are missing)."""
    spec = write(tmp_path, TINY + f"""data_dir = "{tmp_path / 'no-data'}"
[grid]
dataset = ["digits", "mnist"]
""")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--jobs", "2"]) == 1
    text = capsys.readouterr().out
    assert "1 done, 0 skipped, 0 diverged, 1 failed" in text
    assert "failed: dataset=mnist: cdsgd run: error: mnist: no folder holds all four IDX files" in text
    fields, rows = read_results(out)
    assert [r["run"] for r in rows] == ["dataset=digits"]
    assert "no folder holds all four IDX files" in (out / "dataset=mnist" / "run.log").read_text()


def test_bad_grid_value_is_refused_before_any_run(tmp_path, capsys):
    spec = write(tmp_path, TINY + """
[grid]
topology = ["ring", "hypercube"]
n_agents = [6]
""")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out)]) == 2
    assert "hypercube: n must be a power of two, got n=6" in capsys.readouterr().err
    assert not list(out.glob("*/summary.json"))


@pytest.mark.parametrize("name,count", [("topology.toml", 78), ("paper_claims.toml", 16)])
def test_shipped_studies_expand_and_validate(tmp_path, monkeypatch, name, count):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    runs = load_sweep(root / "experiments" / "ablations" / name, tmp_path / "out")
    assert len(runs) == count
    assert all(r.config.dataset == "fashion-mnist" for r in runs)


@pytest.mark.parametrize("env,jobs,expect", [(None, 1, "cores"), (None, 2, "cores/2"), ("1", 1, 1), ("3", 2, 3),
                                             ("", 1, "cores"), ("abc", 1, "cores"), ("0", 1, "cores")])
def test_threads_per_run_keep_the_users_omp_num_threads(monkeypatch, env, jobs, expect):
    import os

    from cdsgd.run.sweep import _threads_per_run

    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert _threads_per_run(jobs) == {"cores": 8, "cores/2": 4}.get(expect, expect)


def test_bucketing_study_expands_to_five_bucket_counts(tmp_path, monkeypatch):
    """experiments/sequences/plaid_buckets.toml: the seed paper's comparison, 1..16 buckets x 3 seeds, on
    the settings docs/sequences.md says learn PLAID."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    runs = load_sweep(root / "experiments" / "sequences" / "plaid_buckets.toml", tmp_path / "out")
    assert sorted({(r.config.bucketing, r.config.seed) for r in runs}) == [
        (k, s) for k in (1, 2, 4, 8, 16) for s in (0, 1, 2)]
    assert {(r.config.bucketing > 1, r.config.epochs) for r in runs} == {(False, 40), (True, 50)}
    assert {(r.config.dataset, r.config.model, r.config.n_agents, r.config.grad_clip, r.config.eval_every)
            for r in runs} == {("plaid", "lstm", 4, 1.0, 1)}


def test_bucket_fill_study_is_the_bucketing_study_with_filled_batches(tmp_path, monkeypatch):
    """experiments/sequences/plaid_buckets_fill.toml: plaid_buckets.toml's settings but bucket_fill=true,
    and 60 epochs for the bucketed runs (an equal budget of training seconds)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    study = root / "experiments" / "sequences"
    plain, filled = ({(r.config.bucketing, r.config.seed): r.config for r in load_sweep(study / name, tmp_path / name)}
                     for name in ("plaid_buckets.toml", "plaid_buckets_fill.toml"))
    assert sorted(filled) == [(k, s) for k in (1, 4, 8, 16) for s in (0, 1, 2)]
    for key, cfg in filled.items():
        assert cfg.bucket_fill and cfg.epochs == (40 if cfg.bucketing == 1 else 60)
        same = {**cfg.__dict__, "bucket_fill": False, "epochs": plain[key].epochs, "out": ""}
        assert same == {**plain[key].__dict__, "out": ""}
