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
    """A run that passes validation and the sweep's check of its files, but fails when it reads them
    (its four MNIST files are there, but not IDX files)."""
    data = tmp_path / "bad-data"
    data.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (data / stem).write_bytes(b"not an IDX file")
    spec = write(tmp_path, TINY + f"""data_dir = "{data}"
[grid]
dataset = ["digits", "mnist"]
""")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--jobs", "2"]) == 1
    text = capsys.readouterr().out
    assert "1 done, 0 skipped, 0 diverged, 1 failed" in text
    failed = next(line for line in text.splitlines() if line.startswith("  failed: dataset=mnist: cdsgd run: error: "))
    assert "train-images-idx3-ubyte has magic number 0x6e6f7420" in failed  # b"not " read as the magic number
    fields, rows = read_results(out)
    assert [r["run"] for r in rows] == ["dataset=digits"]
    assert failed.split("cdsgd run: error: ")[1] in (out / "dataset=mnist" / "run.log").read_text()
    assert sorted(p.name for p in (out / "dataset=mnist").iterdir()) == ["run.log"]  # no partial results


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


# ------------------------------------------------------------------------------ simulated network time


def fake_run(out, name, overrides, **summary):
    """A finished run folder written by hand: its config.toml (from ``overrides``) and a summary.json."""
    from cdsgd.config import dump_config, load_config

    folder = out / name
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(dump_config(load_config(None, overrides)))
    base = {"status": "completed", "spectral_gap": 0.5, "effective_neighbours": 3.0, "epoch": 5.0, "step": 15,
            "test_accuracy": 0.9, "test_accuracy_avg_model": 0.9, "consensus_distance": 0.1,
            "bytes_sent_per_agent": 1e6, "wall_seconds": 2.0, "simulated_seconds": None}
    (folder / "summary.json").write_text(json.dumps({**base, **summary}))


def test_results_csv_and_table_carry_the_simulated_time_to_target(tmp_path):
    """results.csv takes simulated_seconds and the *_to_target values from each summary.json (empty cells where
    a run has none); table.md gives them per group over the seeds that reached the target."""
    from cdsgd.run.sweep import collect, group_table

    out = tmp_path / "out"
    reached = {"target_accuracy": 0.8, "steps_to_target": 9, "sim_seconds_to_target": 0.25,
               "wall_seconds_to_target": 1.0}
    missed = {"target_accuracy": 0.8, "steps_to_target": None, "sim_seconds_to_target": None,
              "wall_seconds_to_target": None}
    common = ["target_accuracy=0.8"]
    fake_run(out, "ring-dc-0", [*common, "topology='ring'", "network='datacenter'", "seed=0"],
             simulated_seconds=0.5, **reached)
    fake_run(out, "ring-dc-1", [*common, "topology='ring'", "network='datacenter'", "seed=1"],
             simulated_seconds=0.6, **{**reached, "steps_to_target": 12, "sim_seconds_to_target": 0.35})
    fake_run(out, "ring-edge-0", [*common, "topology='ring'", "network='edge'", "seed=0"],
             simulated_seconds=20.0, **missed)
    fake_run(out, "ring-edge-1", [*common, "topology='ring'", "network='edge'", "seed=1"],
             simulated_seconds=21.0, **{**reached, "sim_seconds_to_target": 12.0})
    fake_run(out, "ring-none-0", [*common, "topology='ring'", "network='none'", "seed=0"], **reached | {
        "sim_seconds_to_target": None})
    collect(out)
    fields, rows = read_results(out)
    assert fields == ["network"] + RESULT_COLUMNS
    assert fields[fields.index("wall_seconds") + 1:fields.index("test_bits_per_byte")] == [
        "simulated_seconds", "target_accuracy", "steps_to_target", "sim_seconds_to_target"]
    got = {r["run"]: (r["simulated_seconds"], r["target_accuracy"], r["steps_to_target"], r["sim_seconds_to_target"])
           for r in rows}
    assert got == {"ring-dc-0": ("0.5", "0.8", "9", "0.25"), "ring-dc-1": ("0.6", "0.8", "12", "0.35"),
                   "ring-edge-0": ("20.0", "0.8", "", ""), "ring-edge-1": ("21.0", "0.8", "9", "12.0"),
                   "ring-none-0": ("", "0.8", "9", "")}
    table = group_table(out).splitlines()
    assert table[0].endswith("| MB sent/agent | simulated s | steps to acc ≥ 0.8 | simulated s to acc ≥ 0.8 |")
    cells = {c[0]: c[-3:] for c in ([x.strip() for x in line.split("|")[1:-1]] for line in table[2:])}
    assert cells == {"datacenter": ["0.55 ± 0.0707", "10 ± 2", "0.3 ± 0.0707"],
                     "edge": ["20.5 ± 0.707", "9 (1/2 reached)", "12 (1/2 reached)"],
                     "none": ["", "9", ""]}


def test_table_without_a_network_or_target_has_no_time_columns(tmp_path):
    from cdsgd.run.sweep import collect, group_table

    out = tmp_path / "out"
    for t in ("ring", "torus"):
        fake_run(out, t, [f"topology='{t}'", "n_agents=9"])
    collect(out)
    assert group_table(out).splitlines()[0].endswith("| test loss | MB sent/agent |")
    fake_run(out, "complete", ["topology='complete'", "n_agents=9", "target_accuracy=0.95"], target_accuracy=0.95,
             steps_to_target=None, sim_seconds_to_target=None)
    collect(out)
    head, *_, last = group_table(out).splitlines()
    assert head.endswith("| MB sent/agent | steps to acc ≥ 0.95 |") and "simulated" not in head
    assert last.startswith("| torus |") and last.endswith("| not reached |")  # a run without it: not reached


def test_a_target_that_varies_groups_the_runs():
    """target_accuracy is a results column (the summary's), yet a sweep over it must not pool its runs as seeds."""
    from cdsgd.run.sweep import group_keys

    rows = [{"topology": "ring", "target_accuracy": t, **{c: "" for c in RESULT_COLUMNS if c != "target_accuracy"}}
            for t in ("0.8", "0.9")]
    assert group_keys(rows) == ["topology", "target_accuracy"]
    assert group_keys(rows[:1]) == ["topology"]


def test_a_grid_over_networks_expands_and_validates(tmp_path):
    p = write(tmp_path, TINY + """target_accuracy = 0.8
network_params = { compute_ms = 2.0 }
[grid]
network = ["datacenter", "edge"]
topology = ["ring", "star"]
""")
    runs = load_sweep(p, tmp_path / "out")
    assert {(r.config.network, r.config.topology) for r in runs} == {
        (n, t) for n in ("datacenter", "edge") for t in ("ring", "star")}
    assert {(r.config.target_accuracy, json.dumps(r.config.network_params)) for r in runs} == {
        (0.8, '{"compute_ms": 2.0}')}
    assert "network=edge,topology=star" in [r.folder.name for r in runs]
    with pytest.raises(ValueError, match="network 'lna' is unknown; did you mean 'lan'"):
        load_sweep(write(tmp_path, TINY + "[grid]\nnetwork = ['lna']\n", "bad.toml"), tmp_path / "bad")


def test_network_smoke_study_expands(tmp_path, monkeypatch):
    """experiments/ablations/network_smoke.toml: docs/sweeps.md's time-to-accuracy figures."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    runs = load_sweep(root / "experiments" / "ablations" / "network_smoke.toml", tmp_path / "out")
    assert sorted((r.config.topology, r.config.network, r.config.seed) for r in runs) == sorted(
        (t, n, s) for t in ("ring", "complete", "torus") for n in ("datacenter", "edge") for s in (0, 1))
    assert {(r.config.dataset, r.config.n_agents, r.config.target_accuracy) for r in runs} == {("digits", 16, 0.94)}


def test_real_sweep_on_simulated_networks_plots_time_to_accuracy(tmp_path):
    spec = write(tmp_path, TINY + """target_accuracy = 0.5
[grid]
network = ["datacenter", "edge"]
topology = ["ring", "complete"]
""")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--jobs", "2"]) == 0
    fields, rows = read_results(out)
    assert fields == ["topology", "network"] + RESULT_COLUMNS  # config keys in their order
    for r in rows:
        summary = json.loads((out / r["run"] / "summary.json").read_text())
        assert float(r["simulated_seconds"]) == summary["simulated_seconds"] > 0
        assert r["target_accuracy"] == "0.5" and r["steps_to_target"] == str(summary["steps_to_target"])
    edge = {r["topology"]: float(r["simulated_seconds"]) for r in rows if r["network"] == "edge"}
    dc = {r["topology"]: float(r["simulated_seconds"]) for r in rows if r["network"] == "datacenter"}
    assert all(edge[t] > dc[t] for t in edge)  # the same steps take longer on the slower network
    assert cli.main(["plot", str(out)]) == 0
    for name in ("accuracy_vs_sim_time.png", "time_to_target.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "| simulated s | steps to acc ≥ 0.5 | simulated s to acc ≥ 0.5 |" in (out / "table.md").read_text()


def test_a_sweep_records_the_family_defaults_its_runs_resolved_to(tmp_path):
    """A sweep over models: the recurrent runs take their family's defaults for the keys the sweep leaves
    unset (the base's lr wins), each run's config.toml holds the resolved values, and results.csv names the
    keys that differ between runs because of them, so every row says what it ran with."""
    from cdsgd.run.sweep import collect

    spec = write(tmp_path, """
[base]
dataset = "synthetic_seq"
n_agents = 4
epochs = 1
lr = 0.1

[grid]
model = ["mlp", "gru"]
""")
    runs = {r.config.model: r for r in load_sweep(spec, tmp_path / "out")}
    assert [(c.batch_size, c.lr, c.grad_clip) for c in (runs["mlp"].config, runs["gru"].config)] == \
        [(32, 0.1, 0.0), (8, 0.1, 1.0)]
    from cdsgd.config import dump_config

    for r in runs.values():  # a finished run folder, as run_experiment leaves it
        r.folder.mkdir(parents=True)
        (r.folder / "config.toml").write_text(dump_config(r.config))
        (r.folder / "summary.json").write_text(json.dumps({"status": "completed", "test_accuracy": 0.5}))
    rows = {row["model"]: row for row in collect(tmp_path / "out")}
    assert {k: rows["gru"][k] for k in ("batch_size", "grad_clip")} == {"batch_size": 8, "grad_clip": 1.0}
    assert {k: rows["mlp"][k] for k in ("batch_size", "grad_clip")} == {"batch_size": 32, "grad_clip": 0.0}
    assert "lr" not in rows["gru"]  # the same in every run: the base's
    header, _ = read_results(tmp_path / "out")
    assert {"model", "batch_size", "grad_clip"} <= set(header) and "lr" not in header
