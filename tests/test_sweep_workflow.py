"""The path a sweep takes before and around its runs: what the runs need (checked once, before the first),
overrides on the command line, dotted grid keys and folder names, output-folder errors, re-runs and stops."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from cdsgd import cli
from cdsgd.config import load_config
from cdsgd.run.preflight import missing_requirements, rerun_report, stop_hint
from cdsgd.run.sweep import load_sweep
from test_sweep import TINY, write  # one tiny sweep base for both files

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "experiments" / "ablations" / "topology.toml"

def lines(text):
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------ what the runs need, checked once


def test_missing_data_stops_the_sweep_with_one_error_before_anything_is_written(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = write(tmp_path, TINY + f'data_dir = "{empty}"\n[grid]\ndataset = ["digits", "mnist", "cifar10"]\n'
                                  "seed = [0, 1, 2]\n")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = lines(captured.err)  # one error for 9 runs, each missing thing named once
    assert line.startswith("cdsgd sweep: error: nothing was run: ")
    assert line.count("data set 'mnist'") == 1 and line.count("data set 'cifar10'") == 1
    assert f"data set 'mnist' in data_dir '{empty}' (3 of 9 runs)" in line
    assert f"data set 'cifar10' in data_dir '{empty}' (3 of 9 runs)" in line
    assert "download=true" in line and "dataset=digits" in line
    assert "data set 'digits'" not in line
    assert not out.exists()


def test_dry_run_lists_the_runs_then_the_same_check(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = write(tmp_path, TINY.replace('"digits"', '"mnist"') + f'data_dir = "{empty}"\n[grid]\nseed = [0, 1]\n')
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert lines(captured.out) == [str(out / "seed=0"), str(out / "seed=1"), "2 runs"]
    (line,) = lines(captured.err)
    assert "data set 'mnist'" in line and "(2 of 2 runs)" in line and "no folder holds all four IDX files" in line
    # the same sweep on a data set that needs nothing: everything is here
    assert cli.main(["sweep", str(spec), "--out", str(out), "--dry-run", "dataset=digits"]) == 0
    captured = capsys.readouterr()
    assert lines(captured.out)[-1] == "everything the runs need is here (data sets, packages, graph files)"
    assert captured.err == "" and not out.exists()


def test_a_data_set_that_is_downloaded_or_needs_nothing_is_not_missing(tmp_path):
    empty = str(tmp_path)
    configs = [load_config(overrides=[f"dataset={d}", f"data_dir={empty}", *extra])
               for d, extra in (("mnist", ["download=true"]), ("digits", []), ("synthetic", []))]
    assert missing_requirements(configs) == []
    (missing,) = missing_requirements(configs + [load_config(overrides=["dataset=cifar100", f"data_dir={empty}"])])
    assert (missing.runs, missing.fetchable) == (1, True) and "cifar-100-python" in missing.how


def test_the_readme_ablation_says_what_it_needs_and_runs_on_digits_with_one_override(tmp_path, monkeypatch, capsys):
    """No Fashion-MNIST on this machine (its Debian folder hidden, an empty working folder): the README's
    headline sweep stops at once naming it and how to get it; with dataset=digits everything is here."""
    from cdsgd.data import datasets

    monkeypatch.setitem(datasets._IDX_SETS, "fashion-mnist", ("FashionMNIST/raw", ()))
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", str(TOPOLOGY), "--out", "runs/topology", "--jobs", "2"]
    assert cli.main(argv + ["--dry-run"]) == 2
    captured = capsys.readouterr()
    assert lines(captured.out)[-1] == "78 runs"
    (line,) = lines(captured.err)
    assert "data set 'fashion-mnist' in data_dir 'data' (78 of 78 runs)" in line
    assert "apt-get install dataset-fashion-mnist" in line and "dataset=digits" in line
    assert cli.main(argv) == 2 and not (tmp_path / "runs").exists()  # the real command: the same error, no folder
    assert len(lines(capsys.readouterr().err)) == 1
    assert cli.main(argv + ["--dry-run", "dataset=digits"]) == 0
    assert "everything the runs need is here" in capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    assert "cdsgd sweep experiments/ablations/topology.toml --out runs/topology-digits --jobs 2 dataset=digits" in readme


# ------------------------------------------------------------------ overrides on the command line


def test_overrides_apply_to_every_run_and_a_grid_key_keeps_its_folders(tmp_path):
    spec = write(tmp_path, TINY + "[grid]\nseed = [0, 1, 2]\nalgorithm = [\"cdsgd\", \"cdmsgd\"]\n")
    full = load_sweep(spec, tmp_path / "out")
    runs = load_sweep(spec, tmp_path / "out", ["lr=0.05", "epochs=2"])
    assert [r.folder for r in runs] == [r.folder for r in full]  # same names: the varying keys did not change
    assert {(r.config.lr, r.config.epochs) for r in runs} == {(0.05, 2)}
    # a key the grid varies: every run takes the override; runs that became the same are one, in its folder
    seed0 = load_sweep(spec, tmp_path / "out", ["seed=0"])
    assert [r.folder.name for r in seed0] == ["seed=0,algorithm=cdsgd", "seed=0,algorithm=cdmsgd"]
    assert [r.identity for r in seed0] == [r.identity for r in full if r.config.seed == 0]


def test_an_override_of_a_zipped_key_and_the_exclusions_after_it(tmp_path):
    spec = write(tmp_path, TINY + "[grid]\nalgorithm = [\"cdsgd\", \"cdmsgd\"]\n[[zip]]\ntopology = [\"ring\", \"torus\"]\n"
                                  "n_agents = [4, 9]\n[[exclude]]\ntopology = \"ring\"\nn_agents = 9\n")
    runs = load_sweep(spec, tmp_path / "out", ["n_agents=9"])  # (ring, 9) is excluded
    assert [(r.config.algorithm, r.config.topology, r.config.n_agents) for r in runs] == [
        ("cdsgd", "torus", 9), ("cdmsgd", "torus", 9)]


@pytest.mark.parametrize("overrides,pattern", [
    (["out=elsewhere"], r"out= is set per run by the sweep; give the sweep folder with --out DIR"),
    (["lrr=0.1"], r"config key 'lrr' is unknown; did you mean 'lr'\?"),
    (["topology=hypercube", "n_agents=6"], r"hypercube: n must be a power of two, got n=6"),
    (["lr"], r"'lr' is a config key: write lr=VALUE"),
])
def test_bad_overrides_are_one_line_errors(tmp_path, capsys, overrides, pattern):
    import re

    spec = write(tmp_path, TINY + "[grid]\nseed = [0, 1]\n")
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "out"), *overrides]) == 2
    (line,) = lines(capsys.readouterr().err)
    assert re.search(pattern, line), line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ dotted grid keys, folder names


def test_a_grid_over_one_topology_parameter_merges_into_the_base_table(tmp_path):
    spec = write(tmp_path, TINY + 'topology = "erdos_renyi"\ntopology_params = { seed = 3 }\n'
                                  "[grid]\ntopology_params.p = [0.5, 0.9]\n")
    runs = load_sweep(spec, tmp_path / "out")
    assert [r.folder.name for r in runs] == ["topology_params.p=0.5", "topology_params.p=0.9"]
    assert [r.config.topology_params for r in runs] == [{"seed": 3, "p": 0.5}, {"seed": 3, "p": 0.9}]
    assert runs[0].identity != runs[1].identity
    # the same runs as written by hand, one table each
    spec2 = write(tmp_path, TINY + 'topology = "erdos_renyi"\n[grid]\n'
                                   "topology_params = [{ seed = 3, p = 0.5 }, { seed = 3, p = 0.9 }]\n", "t.toml")
    tables = load_sweep(spec2, tmp_path / "out")
    assert [r.identity for r in tables] == [r.identity for r in runs]
    assert [r.folder.name for r in tables] == ["topology_params.seed=3,topology_params.p=0.5",
                                               "topology_params.seed=3,topology_params.p=0.9"]


def test_dotted_keys_in_zip_and_exclude_and_an_override_of_one_entry(tmp_path):
    spec = write(tmp_path, TINY + 'topology = "erdos_renyi"\n[[zip]]\ntopology_params.p = [0.5, 0.7, 0.9]\n'
                                  "topology_params.seed = [1, 2, 3]\n[[exclude]]\ntopology_params.p = 0.7\n")
    runs = load_sweep(spec, tmp_path / "out")
    assert [r.config.topology_params for r in runs] == [{"p": 0.5, "seed": 1}, {"p": 0.9, "seed": 3}]
    assert [r.folder.name for r in runs] == ["topology_params.p=0.5,topology_params.seed=1",
                                             "topology_params.p=0.9,topology_params.seed=3"]
    again = load_sweep(spec, tmp_path / "out", ["topology_params.seed=7"])
    assert [r.config.topology_params for r in again] == [{"p": 0.5, "seed": 7}, {"p": 0.9, "seed": 7}]
    assert [r.folder.name for r in again] == ["topology_params.p=0.5,topology_params.seed=7",
                                              "topology_params.p=0.9,topology_params.seed=7"]


def test_plain_keys_keep_the_folder_names_of_earlier_sweeps(tmp_path):
    """Users resume old sweeps: names of plain keys (a graph file by its stem) do not change."""
    graph = ROOT / "experiments" / "topologies" / "paper_ring5.edgelist"
    spec = write(tmp_path, TINY.replace("n_agents = 4", "n_agents = 5") + f'[grid]\ntopology = ["{graph}", "ring"]\nlr = [0.1, 1e-3]\n')
    assert [r.folder.name for r in load_sweep(spec, tmp_path / "out")] == [
        "topology=paper_ring5,lr=0.1", "topology=paper_ring5,lr=0.001", "topology=ring,lr=0.1",
        "topology=ring,lr=0.001"]


def test_a_bad_dotted_key_names_itself(tmp_path):
    spec = write(tmp_path, TINY + "[grid]\nlr.x = [0.1]\n")
    with pytest.raises(ValueError, match=r"config key 'lr' is not a table; 'lr.x' cannot be set"):
        load_sweep(spec, tmp_path / "out")


@pytest.mark.dist
def test_real_sweep_with_a_dotted_grid_and_an_override_then_a_rerun(tmp_path, capsys):
    """The sweep file asks for MNIST, which is not here; ``dataset=digits`` after ``--out`` makes it run.
    A re-run skips both runs; after one is marked interrupted and another loses its summary, the re-run
    names them and runs them again."""
    spec = write(tmp_path, TINY.replace('dataset = "digits"', 'dataset = "mnist"')
                 + f'data_dir = "{tmp_path / "none"}"\ntopology = "erdos_renyi"\ntopology_params = {{ seed = 1 }}\n'
                 "[grid]\ntopology_params.p = [0.6, 1.0]\nseed = [0, 1]\n")
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out)]) == 2  # mnist is not here
    capsys.readouterr()
    assert cli.main(["sweep", str(spec), "--out", str(out), "dataset=digits"]) == 0
    capsys.readouterr()
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == ["topology_params.p=0.6,seed=0", "topology_params.p=0.6,seed=1",
                                             "topology_params.p=1.0,seed=0", "topology_params.p=1.0,seed=1"]
    assert all(r["status"] == "completed" for r in rows)
    assert {r["run"]: json.loads(r["topology_params"]) for r in rows}["topology_params.p=1.0,seed=1"] == {
        "seed": 1, "p": 1.0}
    complete = [r for r in rows if r["run"].startswith("topology_params.p=1.0")]
    assert all(float(r["spectral_gap"]) == pytest.approx(1.0) for r in complete)  # p = 1: K4, W = 11ᵀ/4, λ₂ = 0
    assert cli.main(["sweep", str(spec), "--out", str(out), "dataset=digits"]) == 0
    text = capsys.readouterr().out
    assert "4 of 4 runs already finished (same config): skipped" in text and "running again" not in text
    victim = out / "topology_params.p=0.6,seed=1" / "summary.json"
    victim.write_text(json.dumps({**json.loads(victim.read_text()), "status": "interrupted"}))
    (out / "topology_params.p=1.0,seed=0" / "summary.json").unlink()
    assert cli.main(["sweep", str(spec), "--out", str(out), "dataset=digits"]) == 0
    text = capsys.readouterr().out
    assert "2 of 4 runs already finished (same config): skipped" in text
    assert ("running again 2 runs that did not finish: topology_params.p=0.6,seed=1 (interrupted), "
            "topology_params.p=1.0,seed=0 (no summary); 0 new") in text
    assert "2 done, 2 skipped, 0 diverged, 0 failed" in text
    # the sweep file changed (lr) for the same folders: the re-run says it replaces them
    spec.write_text(spec.read_text().replace("lr = 0.1", "lr = 0.2"))
    assert cli.main(["sweep", str(spec), "--out", str(out), "dataset=digits", "seed=0"]) == 0
    text = capsys.readouterr().out
    assert ("replacing 2 run folders that hold another config (the sweep file or overrides changed): "
            "topology_params.p=0.6,seed=0, topology_params.p=1.0,seed=0") in text


# ------------------------------------------------------------------ output folders


def _one_error(capsys) -> str:
    (line,) = lines(capsys.readouterr().err)
    return line


@pytest.mark.parametrize("verb", ["run", "sweep"])
def test_an_output_folder_that_cannot_be_made_is_one_line_naming_it(tmp_path, capsys, verb):
    spec = write(tmp_path, TINY + "[grid]\nseed = [0]\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, reason in (("/proc/x/y", "cannot be created: No such file or directory"),
                        (str(blocker / "sub"), "cannot be created: Not a directory"),
                        (str(blocker), "exists and is not a folder")):
        argv = ["run", "dataset=digits", "epochs=1", f"out={out}"] if verb == "run" else \
            ["sweep", str(spec), "--out", out]
        assert cli.main(argv) == 2
        option = "out=" if verb == "run" else "--out"
        assert _one_error(capsys) == f"cdsgd {verb}: error: output folder {out!r} {reason}; choose another {option}"


def test_an_output_folder_without_permission_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """As a user who may not write there (simulated: root may write anywhere): mkdir refused, or an
    existing folder that is not writable."""
    import pathlib as pl

    spec = write(tmp_path, TINY + "[grid]\nseed = [0]\n")
    real_mkdir = pl.Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name == "denied":
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pl.Path, "mkdir", mkdir)
    out = str(tmp_path / "denied")
    assert cli.main(["run", "dataset=digits", f"out={out}"]) == 2
    assert _one_error(capsys) == f"cdsgd run: error: output folder {out!r} cannot be created: Permission denied; " \
                                 "choose another out="
    assert cli.main(["sweep", str(spec), "--out", out]) == 2
    assert _one_error(capsys) == f"cdsgd sweep: error: output folder {out!r} cannot be created: Permission denied; " \
                                 "choose another --out"
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: pl.Path(path) != readonly)
    assert cli.main(["sweep", str(spec), "--out", str(readonly)]) == 2
    assert _one_error(capsys) == (f"cdsgd sweep: error: output folder {str(readonly)!r} is not writable "
                                  "(Permission denied); choose another --out")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write in a read-only folder")
def test_a_read_only_folder_for_real(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        out = str(ro / "x")
        assert cli.main(["run", "dataset=digits", f"out={out}"]) == 2
        assert _one_error(capsys) == (f"cdsgd run: error: output folder {out!r} cannot be created: "
                                      "Permission denied; choose another out=")
    finally:
        ro.chmod(0o755)


# ------------------------------------------------------------------ re-runs and stops


def test_the_rerun_and_stop_lines():
    assert rerun_report([], [], 4) == []
    assert rerun_report([("a", "failed")], ["b"], 0) == [
        "cdsgd sweep: running again 1 run that did not finish: a (failed); 0 new",
        "cdsgd sweep: replacing 1 run folder that holds another config (the sweep file or overrides changed): b"]
    many = rerun_report([(f"seed={i}", "interrupted") for i in range(10)], [], 1)[0]
    assert many.endswith("seed=7 (interrupted) and 2 more; 1 new") and "seed=8" not in many
    assert stop_hint("runs/x", 2, 5, how="interrupted") == (
        "cdsgd sweep: interrupted with 2 of 5 runs finished. Run the same command again to continue: finished "
        "runs are skipped, interrupted ones resume (runs/x)")


@pytest.mark.dist
def test_ctrl_c_stops_the_sweep_saying_how_to_continue(tmp_path):
    """SIGINT to the sweep's process group, as Ctrl-C sends it, while its first run is under way."""
    spec = write(tmp_path, TINY.replace("epochs = 1", "epochs = 200") + "[grid]\nseed = [0, 1]\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "cdsgd", "sweep", str(spec), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = out / "seed=0" / "metrics.csv"
    try:
        deadline = time.monotonic() + 120
        while not first.exists() or len(first.read_text().splitlines()) < 2:  # the run is under way
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert (f"cdsgd sweep: interrupted with 0 of 2 runs finished. Run the same command again to continue: "
            f"finished runs are skipped, interrupted ones resume ({out})") in stdout
    assert "cdsgd sweep: interrupted" in stderr
    assert json.loads((out / "seed=0" / "summary.json").read_text())["status"] == "interrupted"
    assert not (out / "seed=1" / "summary.json").exists()  # no run starts after the stop
