"""What a new user trips over (issue 16): honest times, runs that stop and say why, exit codes, pipes.

Each test reproduces one reported defect through the command line or the
API a user calls, and checks the behaviour against values computed here.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import topologies
from cdsgd import cli
from cdsgd.config import load_config
from cdsgd.executor import Diverged, Executor
from cdsgd.run.experiment import run_experiment
from cdsgd.run.hints import eval_hint
from cdsgd.run.plan import validate_config
from cdsgd.run.progress import Progress, format_seconds, pick_mode, safe_stream

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["dataset=synthetic", "model=logreg", "n_agents=4", "epochs=2", "batch_size=16", "lr=0.1"]


def _shards(n, bad=None):
    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(16, 3, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(n)]
    if bad is not None:
        shards[bad][0][:] = float("nan")  # every batch of this agent has a NaN loss
    return shards


# ----------------------------------------------------------------- item 3: divergence


def test_executor_stops_at_the_first_nonfinite_loss_naming_the_agent():
    W = topologies.mixing_matrix(topologies.build("ring", 5))
    ex = Executor.build(lambda: nn.Linear(3, 2), _shards(5, bad=3), W, "cdsgd", lr=0.1, batch_size=4)
    rows = []
    with pytest.raises(Diverged) as e:
        ex.run(steps=20, eval_every_steps=10, callback=rows.append)
    assert (e.value.step, e.value.agent, e.value.what) == (1, 3, "training loss")
    assert ex.k == 1 and [r["step"] for r in rows] == [1]  # stopped at once, with that step's row


def test_executor_names_parameters_that_become_nan_while_the_loss_was_finite():
    """loss = sqrt(0 · ‖out‖²) is 0, its gradient ∞ · 0 = NaN: the first loss is finite, the update is not."""
    W = topologies.mixing_matrix(topologies.build("ring", 4))

    def loss_fn(out, y):
        return torch.sqrt((out * 0).pow(2).sum(1)).mean()

    ex = Executor.build(lambda: nn.Linear(3, 2), _shards(4), W, "cdsgd", lr=0.1, batch_size=4, loss_fn=loss_fn)
    with pytest.raises(Diverged) as e:
        ex.run(steps=5)
    assert (e.value.step, e.value.agent, e.value.what) == (1, 0, "parameters")


def test_diverged_state_survives_a_checkpoint():
    W = topologies.mixing_matrix(topologies.build("ring", 5))
    ex = Executor.build(lambda: nn.Linear(3, 2), _shards(5, bad=2), W, "cdsgd", lr=0.1, batch_size=4)
    ex.step()  # noted, not yet agreed (no evaluation yet)
    again = Executor.build(lambda: nn.Linear(3, 2), _shards(5, bad=2), W, "cdsgd", lr=0.1, batch_size=4)
    again.load_state_dict(ex.state_dict())
    again.evaluate()
    assert again.diverged == (1, 2, "training loss")


def test_sweep_lists_a_diverged_run_apart_and_does_not_rerun_it(tmp_path):
    from cdsgd.run.sweep import collect, load_sweep, run_sweep

    spec = tmp_path / "s.toml"
    spec.write_text('[base]\ndataset = "synthetic"\nmodel = "mlp"\nn_agents = 4\nepochs = 1\n'
                    'batch_size = 16\nalgorithm = "local"\n[grid]\nlr = [0.1, 1e10]\n')
    lines = []
    runs = load_sweep(spec, tmp_path / "out")
    report = run_sweep(runs, tmp_path / "out", log=lines.append)
    assert len(report["done"]) == 1 and not report["failed"] and len(report["diverged"]) == 1
    assert "non-finite at step" in report["diverged"][0][1]
    assert any(line.startswith("  diverged: ") for line in lines)
    statuses = sorted(r["status"] for r in collect(tmp_path / "out"))
    assert statuses == ["completed", "diverged"]
    again = run_sweep(load_sweep(spec, tmp_path / "out"), tmp_path / "out", log=lines.append)
    assert len(again["skipped"]) == 2 and not again["diverged"]


# ----------------------------------------------------------- items 2, 10: time and progress


def test_summary_splits_the_wall_time_and_the_cli_says_it(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(["run", *TINY, f"out={out}", "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["train_seconds"] == s["wall_seconds"] > 0 and s["eval_seconds"] > 0
    assert s["total_seconds"] >= s["train_seconds"] + s["eval_seconds"]
    assert isinstance(s["eval_bytes_per_agent"], int)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{format_seconds(s['total_seconds'])} in all" in line
    assert (f"({format_seconds(s['train_seconds'])} training, {format_seconds(s['warmup_seconds'])} warm-up, "
            f"{format_seconds(s['eval_seconds'])} evaluation)") in line


def test_eval_hint_only_when_evaluation_dominates():
    class Sim:
        eval_agents, test_set = [0, 1], (torch.zeros(300, 2), torch.zeros(300))

    cfg = load_config()
    sim = Sim()
    sim.train_seconds, sim.eval_seconds = 10.0, 3.0
    assert eval_hint(cfg, sim) == ""
    sim.eval_seconds = 30.0
    hint = eval_hint(cfg, sim)
    assert "eval_agents=" in hint and "eval_samples=" in hint and "2 agent(s) on 300 test samples" in hint
    assert "every 1 epoch(s)" in hint
    assert "every 7 step(s)" in eval_hint(load_config(overrides=["eval_steps=7"]), sim)


def test_eta_counts_the_evaluations_still_to_come():
    total, every = 103, 10
    timing = {"v": (0.0, 0, 0.0, 0)}
    p = Progress(total=total, every=every, mode="off", log=lambda m: None, timing=lambda: timing["v"])
    for k in range(0, total + 1):  # the evaluations after step k, counted one by one
        assert p.evaluations_left(k) == sum(1 for j in range(k + 1, total + 1) if j % every == 0 or j == total)
    timing["v"] = (39.0, 39, 12.0, 4)  # 39 timed steps (the first is warm-up) in 39 s, 4 evaluations in 12 s
    assert p.eta(40) == pytest.approx(63 * 1.0 + 7 * 3.0)


def test_lines_mode_prints_a_heartbeat_between_evaluations():
    lines = []
    p = Progress(total=10, every=5, mode="lines", log=lines.append, timing=lambda: (1.0, 1, 0.0, 0), interval=0.0)
    p.step(1)
    p.row("epoch 1", {"train_loss": 0.5, "test_accuracy": 0.8, "test_accuracy_avg_model": 0.9})
    assert lines[0].startswith("step 1/10 (10%), ETA ") and lines[1] == "epoch 1"


def test_bar_keeps_every_evaluation_line_above_it():
    stream = io.StringIO()
    p = Progress(total=4, every=2, mode="bar", log=lambda m: None, timing=lambda: (1.0, 1, 1.0, 1), stream=stream)
    for k in range(1, 5):
        p.step(k)
        if k % 2 == 0:
            p.row(f"epoch {k // 2}.00 line", {"train_loss": 0.25, "test_accuracy": 0.5, "test_accuracy_avg_model": 0.75})
    p.close()
    text = stream.getvalue()
    assert "epoch 1.00 line\n" in text and "epoch 2.00 line\n" in text  # history kept
    assert "loss 0.2500" in text and "avg model 0.750" in text and "ETA" in text


def test_no_terminal_means_lines_not_silence():
    assert pick_mode(io.StringIO(), None) == "lines"
    assert pick_mode(sys.stderr, False) == "lines"


# --------------------------------------------------------- item 4: failures leave a trace


def test_missing_data_leaves_no_empty_folder(tmp_path):
    out = tmp_path / "never"
    code = cli.main(["run", "dataset=cifar10", f"data_dir={tmp_path / 'empty'}", f"out={out}", "--no-progress"])
    assert code == 2 and not out.exists()


def test_a_failure_after_the_folder_exists_leaves_summary_failed(tmp_path, monkeypatch):
    import cdsgd.run.experiment as experiment

    def broken(*a, **k):
        raise RuntimeError("the executor could not be built")

    monkeypatch.setattr(experiment, "build_executor", broken)
    out = tmp_path / "r"
    with pytest.raises(RuntimeError):
        run_experiment(load_config(overrides=[*TINY, f"out={out}"]), progress=False, log=lambda m: None)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "failed" and "the executor could not be built" in s["error"]
    assert load_config(out / "config.toml").n_agents == 4


# --------------------------------------------------- items 5, 12: settings without effect


def test_weighted_graph_file_with_a_rule_that_ignores_weights_is_noted(tmp_path):
    weighted, plain = tmp_path / "w.edgelist", tmp_path / "p.edgelist"
    weighted.write_text("0 1 0.3\n1 2 0.3\n2 0 0.3\n")
    plain.write_text("0 1\n1 2\n2 0\n")
    notes = validate_config(load_config(overrides=[f"topology={weighted}", "n_agents=3"])).notes
    assert any("carries edge weights" in n and "mixing=weight" in n for n in notes), notes
    assert not validate_config(load_config(overrides=[f"topology={weighted}", "n_agents=3", "mixing=weight"])).notes
    assert not validate_config(load_config(overrides=[f"topology={plain}", "n_agents=3"])).notes


def test_momentum_with_a_rule_without_momentum_is_noted(tmp_path):
    notes = validate_config(load_config(overrides=["algorithm=cdsgd", "momentum=0.5"])).notes
    assert any(n.startswith("momentum=0.5 has no effect with algorithm='cdsgd'") and "cdmsgd" in n for n in notes)
    assert not validate_config(load_config(overrides=["algorithm=cdmsgd", "momentum=0.5"])).notes
    out = tmp_path / "r"
    s = run_experiment(load_config(overrides=[*TINY, "algorithm=cdsgd", "momentum=0.5", f"out={out}"]),
                       progress=False, log=lambda m: None)
    assert s["warnings"] == notes


@pytest.mark.parametrize("key", ["bucket_sync", "bucket_fill"])
def test_bucket_options_without_bucketing_are_noted(key):
    notes = validate_config(load_config(overrides=[f"{key}=true"])).notes
    assert notes == [f"{key}=true has no effect with bucketing=0 (it needs bucketing > 1)"]
    assert not validate_config(load_config(overrides=[f"{key}=true", "bucketing=4"])).notes


# ------------------------------------------------------------------ item 7: exit codes


@pytest.mark.parametrize("argv", [
    ["run", "missing.toml"],
    ["run", "topology=missing.edgelist"],
    ["sweep", "missing.toml"],
    ["launch", "--nproc-per-node", "2", "missing.toml"],
])
def test_missing_files_are_input_errors(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["--debug", *argv]) == 2  # --debug shows the traceback and keeps the status
    assert "Traceback" in capsys.readouterr().err
    assert cli.main([argv[0], "--debug", *argv[1:]]) == 2  # accepted after the verb too


@pytest.mark.parametrize("argv,hint", [
    (["run", "--lr=0.1"], "lr=0.1"),
    (["run", "--epochs", "3"], "epochs=VALUE"),
])
def test_dashed_config_keys_get_a_hint(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert f"without dashes: {hint}" in capsys.readouterr().err


def test_key_and_value_as_two_words_get_a_hint(capsys):
    assert cli.main(["run", "lr", "0.1"]) == 2
    assert "'lr' is a config key: write lr=0.1" in capsys.readouterr().err


# ----------------------------------------------------------------- item 8: closed pipes


def test_topo_into_a_closed_pipe_is_quiet():
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-m", "cdsgd", "topo", "ring", "--n", "300", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.read(10)
        p.stdout.close()  # as `| head -c 10` does
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0 and err == "", err


def test_a_run_survives_its_reader_going_away(tmp_path):
    """``cdsgd run ... 2>&1 | head -1``: the run goes on to the end and says completed."""
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "cdsgd", "run", *TINY, "epochs=4", f"out={out}", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=300) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def test_safe_stream_stops_writing_once_the_reader_is_gone():
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no descriptor")

    s = safe_stream(Closed())
    s.write("x")
    s.flush()
    assert s.closed_by_reader and safe_stream(s) is s


# ----------------------------------------------------- item 9: a run into a sweep folder


def test_a_run_is_not_written_into_a_sweep_folder(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "lr=0.1").mkdir(parents=True)
    (sweep / "lr=0.1" / "config.toml").write_text("")
    with pytest.raises(ValueError, match="holds a sweep"):
        run_experiment(load_config(overrides=[*TINY, f"out={sweep}", "overwrite=true"]), progress=False,
                       log=lambda m: None)
    assert sorted(p.name for p in sweep.iterdir()) == ["lr=0.1"]


# ----------------------------------------------- item 10: interrupted says how to resume


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_interrupted_run_says_how_to_continue(tmp_path):
    out = tmp_path / "r"
    # SIGINT as a terminal's Ctrl-C delivers it, even when pytest itself was started in the background
    # (`cmd &` in a script starts it with SIGINT ignored, and the child would inherit that)
    p = subprocess.Popen([sys.executable, "-m", "cdsgd", "run", *TINY, "epochs=400", "checkpoint_every=1",
                          f"out={out}", "--no-progress"], stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out / "metrics.csv").exists() or len((out / "metrics.csv").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 130, err
    assert f"continue it with: cdsgd run {out / 'config.toml'} resume=true" in err, err


# ------------------------------------------------------------- extend a finished run


def test_a_finished_run_extends_with_more_epochs_bit_for_bit(tmp_path):
    common = [*TINY, "checkpoint_every=1", "save_params=true"]
    short, long_ = tmp_path / "short", tmp_path / "long"
    run_experiment(load_config(overrides=[*common, "epochs=2", f"out={short}"]), progress=False, log=lambda m: None)
    first = (short / "metrics.csv").read_text().splitlines()
    s = run_experiment(load_config(overrides=[*common, "epochs=3", f"out={short}", "resume=true"]), progress=False,
                       log=lambda m: None)
    assert s["status"] == "completed" and s["resumed_from_step"] == 2 * s["steps_per_epoch"]
    run_experiment(load_config(overrides=[*common, "epochs=3", f"out={long_}"]), progress=False, log=lambda m: None)
    assert torch.equal(torch.load(short / "params.pt"), torch.load(long_ / "params.pt"))
    extended = (short / "metrics.csv").read_text().splitlines()
    assert extended[:len(first)] == first  # the first part is kept as it was

    def no_wall(lines):
        wall = lines[0].split(",").index("wall_seconds")
        return [",".join(c for i, c in enumerate(ln.split(",")) if i != wall) for ln in lines]

    assert no_wall(extended) == no_wall((long_ / "metrics.csv").read_text().splitlines())
    with pytest.raises(ValueError, match="can be extended, not shortened"):
        run_experiment(load_config(overrides=[*common, "epochs=1", f"out={short}", "resume=true"]), progress=False,
                       log=lambda m: None)


def test_launch_dry_run_prints_the_layout(capsys):
    assert cli.main(["launch", "--nproc-per-node", "2", "n_agents=8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 process(es), 4 agent(s) each" in out and "--nproc-per-node=2" in out
    assert cli.main(["launch", "--nproc-per-node", "3", "n_agents=8", "--dry-run"]) == 2


def test_launcher_names_the_signal_torchrun_passed_on():
    from cdsgd.cli.launch import describe_launch_failure

    class Stop(Exception):
        sigval = signal.SIGINT

    assert describe_launch_failure(Stop()) == "stopped by SIGINT; every rank was sent SIGINT"
    assert math.isfinite(os.cpu_count() or 1)


def test_a_flat_model_on_sequences_is_noted(tmp_path):
    from cdsgd.run.plan import prepare

    cfg = load_config(overrides=["dataset=synthetic_seq", "model=mlp", "n_agents=3"])
    assert any("flat vector" in n for n in prepare(cfg).plan.notes)
    cfg = load_config(overrides=["dataset=synthetic_seq", "model=gru", "n_agents=3"])
    assert not prepare(cfg).plan.notes


def test_diverged_in_the_runtime_names_the_same_step_and_agent_as_the_simulator(tmp_path):
    """Ranks agree at the next evaluation; the step and agent named are the first ones, as in the simulator."""
    args = [*TINY, "model=mlp", "algorithm=local", "lr=1e10", "n_agents=4"]
    sim, tor = tmp_path / "sim", tmp_path / "torch"
    r = subprocess.run([sys.executable, "-m", "cdsgd", "run", *args, f"out={sim}", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "cdsgd", "launch", "--nproc-per-node", "2", *args, f"out={tor}",
                        "comm_timeout=60"], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0, r.stdout + r.stderr
    s_sim, s_tor = (json.loads((p / "summary.json").read_text()) for p in (sim, tor))
    assert s_tor["status"] == "diverged", s_tor
    keys = ("diverged_at_step", "diverged_agent", "diverged_what")
    assert {k: s_tor[k] for k in keys} == {k: s_sim[k] for k in keys}
    assert s_tor["step"] >= s_sim["step"] == s_sim["diverged_at_step"]  # the runtime stops at its next evaluation


def test_plot_draws_both_when_a_run_sits_in_a_sweep_folder(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for lr in ("0.1", "0.2"):
        run_experiment(load_config(overrides=[*TINY, "epochs=1", f"lr={lr}", f"out={sweep / ('lr=' + lr)}"]),
                       progress=False, log=lambda m: None)
    run_experiment(load_config(overrides=[*TINY, "epochs=1", f"out={tmp_path / 'single'}"]), progress=False,
                   log=lambda m: None)
    for name in ("metrics.csv", "summary.json", "config.toml"):  # as earlier releases let overwrite=true do
        (sweep / name).write_bytes((tmp_path / "single" / name).read_bytes())
    assert cli.main(["plot", str(sweep)]) == 0
    out = capsys.readouterr()
    drawn = {pathlib.Path(line).name for line in out.out.split()}
    assert {"curves.png", "accuracy_vs_epoch.png", "table.md"} <= drawn
    assert "drawing both" in out.err


def test_eta_of_a_resumed_run_uses_the_clocks_since_step_0():
    """The executor's clocks survive a checkpoint: 99 timed steps in 99 s mean 1 s a step, whatever the resume step."""
    p = Progress(total=200, every=50, mode="off", log=lambda m: None, timing=lambda: (99.0, 99, 8.0, 2), initial=90)
    assert p.eta(100) == pytest.approx(100 * 1.0 + 2 * 4.0)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_a_stopped_sweep_stops_its_runs(tmp_path):
    """SIGTERM to the sweep alone (``kill PID``) reaches the run in progress, which writes its files and says
    "interrupted"; no run is left behind without its sweep, and none starts after the stop."""
    spec = tmp_path / "s.toml"
    spec.write_text('[base]\ndataset = "synthetic"\nmodel = "logreg"\nn_agents = 4\nbatch_size = 16\nlr = 0.1\n'
                    'epochs = 400\n[grid]\nseed = [0, 1, 2]\n')
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "cdsgd", "sweep", str(spec), "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = out / "seed=0" / "metrics.csv"
    deadline = time.monotonic() + 300
    while not first.exists() or len(first.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 143, (stdout, stderr)
    assert "cdsgd sweep: stopped by SIGTERM" in stderr and "Run the same command again to continue" in stdout
    assert json.loads((out / "seed=0" / "summary.json").read_text())["status"] == "interrupted"
    assert not (out / "seed=1" / "summary.json").exists() and not (out / "seed=2" / "summary.json").exists()
    left = [c for c in (pathlib.Path("/proc").glob("[0-9]*/cmdline")) if _reads(c).find(str(out)) >= 0]
    assert not left, [_reads(c) for c in left]


def _reads(path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # the process ended while we looked
        return ""
