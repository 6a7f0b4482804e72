"""membership = "elastic" in the runtime: ranks really die (SIGKILL), the survivors go on.

Each test kills ranks of a 4-process ``cdsgd launch`` at a known point
(``CDSGD_FAULT``, :func:`cdsgd.runtime.elastic.fault`) and compares the
survivors with the simulator given the churn trace of those departures, in
exact mode: the survivors' parameters bit for bit, and every evaluation's
figures (simulated seconds included). Every launch has a hard timeout;
``comm_timeout`` bounds every wait inside it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import torch

RUN = ["dataset=digits", "model=mlp", "n_agents=4", "epochs=1", "batch_size=16", "save_params=true", "exact=true",
       "membership=elastic", "eval_steps=6", "network=wan", "comm_timeout=30"]
#: a row's train_loss is not compared: the lost rank's batch losses since the previous evaluation leave with it
COMPARED = ("step", "test_loss", "test_accuracy_avg_model", "consensus_distance", "sim_seconds")


def cdsgd(*argv, fault="", timeout=240):
    env = {**os.environ, "CDSGD_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "cdsgd", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def launch(tmp_path, fault, extra=(), restarts=0):
    """The 4-rank launch with ``fault``; its output folder and the launcher's stderr."""
    tor = tmp_path / "torch"
    r = cdsgd("launch", "--nproc-per-node", "4", "--max-restarts", str(restarts), *RUN, *extra,
              "network_params={compute_ms=4}", f"out={tor}", fault=fault)
    assert r.returncode == 0, r.stdout + r.stderr
    return tor, r.stderr


def simulate(tmp_path, trace, extra=()):
    """The simulator given the churn ``trace`` rows (agent, leave, return or None); its output folder."""
    tmp_path.mkdir(exist_ok=True)
    sim, path = tmp_path / "sim", tmp_path / "trace.csv"
    path.write_text("agent,leave_step,return_step\n" + "".join(f"{j},{k},{'' if b is None else b}\n"
                                                               for j, k, b in trace))
    r = cdsgd("run", *RUN, *extra, f"network_params={{compute_ms=4, churn_trace='{path}'}}", f"out={sim}",
              "--no-progress")
    assert r.returncode == 0, r.stderr
    return sim


def launch_and_simulate(tmp_path, fault, trace, extra=()):
    """The 4-rank launch with ``fault`` and the simulator with the churn ``trace`` rows; their output folders."""
    tor, err = launch(tmp_path, fault, extra)
    return tor, simulate(tmp_path, [(j, k, None) for j, k in trace], extra), err


def assert_same_run(tor, sim, survivors, extended=False):
    pt, ps = torch.load(tor / "params.pt"), torch.load(sim / "params.pt")
    for j in survivors:
        assert torch.equal(pt[j], ps[j]), j
    mt, ms = rows(tor / "metrics.csv"), rows(sim / "metrics.csv")
    if extended:  # the shorter run's last evaluation is a row of the extended one only
        mt = [r for r in mt if r["step"] in {q["step"] for q in ms}]
    for a, b in zip(mt, ms, strict=True):
        for k in COMPARED:
            assert a[k] == b[k], (k, a[k], b[k])
    drop_wall = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows(tor / "membership.csv")]
    assert drop_wall == [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows(sim / "membership.csv")]
    summary = json.loads((tor / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_online"] == len(survivors)
    return summary


def test_a_rank_killed_at_a_known_step_is_left_behind_and_the_run_equals_the_simulators(tmp_path):
    tor, sim, _ = launch_and_simulate(tmp_path, "die:2:5", [(2, 5)])
    summary = assert_same_run(tor, sim, [0, 1, 3])
    assert summary["departures"] == 1
    (change,) = rows(tor / "membership.csv")
    assert (change["step"], change["left"], change["online"]) == ("5", "2", "3")
    assert abs(float(change["spectral_gap"]) - 1 / 3) < 1e-12  # Metropolis on the path 3-0-1: eigenvalues 1, 2/3, 0


def test_two_ranks_killed_inside_a_step_the_step_is_taken_again_without_them(tmp_path):
    """Both die after agreeing to take step 7: their neighbours meet closed connections inside the exchange,
    every rank puts its state back, and step 7 is taken again by ranks 0 and 3 alone."""
    tor, sim, _ = launch_and_simulate(tmp_path, "die:1:7:exchange,die:2:7:exchange", [(1, 7), (2, 7)])
    assert_same_run(tor, sim, [0, 3])
    (change,) = rows(tor / "membership.csv")
    assert (change["step"], change["left"], change["online"], change["parts"]) == ("7", "1 2", "2", "1")


def test_a_rank_killed_while_writing_a_checkpoint_loses_no_checkpoint(tmp_path):
    """Rank 3 dies writing the checkpoint of step 12: the others go on (it leaves at step 12), the last
    checkpoint every rank wrote (step 6) is kept, and the run extended by a resume continues from its last
    checkpoint with the membership it was taken with (rank 3's agent still lost): equal to the simulator's
    longer run given the same trace."""
    every = ["checkpoint_every=6", "checkpoint_unit=steps"]
    tor, sim, _ = launch_and_simulate(tmp_path, "die:3:12:checkpoint", [(3, 12)], every)
    assert_same_run(tor, sim, [0, 1, 2])
    held = {p.parent.name: sorted(q.name for q in p.parent.glob("rank-*.pt"))
            for p in (tor / "checkpoints").glob("step-*/rank-*.pt")}
    assert held["step-000000006"] == [f"rank-{r}.pt" for r in range(4)]
    assert held["step-000000023"] == [f"rank-{r}.pt" for r in range(3)]
    longer = [*every, "epochs=2"]
    r = cdsgd("launch", "--nproc-per-node", "4", *RUN, *longer, "network_params={compute_ms=4}", f"out={tor}",
              "resume=true")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = assert_same_run(tor, simulate(tmp_path / "longer", [(3, 12, None)], longer), [0, 1, 2], True)
    assert summary["resumed_from_step"] == 23


#: the survivors wait (at most comm_timeout) for the replacement to join while fewer than 4 ranks are live
WAIT = ["min_ranks=4"]


def test_a_killed_rank_restarted_joins_and_the_run_finishes_with_four_agents(tmp_path):
    """--max-restarts 1: a replacement of rank 2 joins at step 6 (the first after the loss: min_ranks=4 waits
    for it), takes its agent's model and state from its lowest live neighbour and its data stream where the
    lost rank left it; equal to the simulator given the trace 2,5,6."""
    tor, err = launch(tmp_path, "die:2:5", WAIT, restarts=1)
    assert "lost rank 2 (killed by SIGKILL); the run went on" in err
    left, back = rows(tor / "membership.csv")
    assert (left["step"], left["left"], back["step"], back["joined"], back["donors"], back["online"]) == \
        ("5", "2", "6", "2", "2<1", "4")
    sim = simulate(tmp_path, [(2, 5, int(back["step"]))], WAIT)
    summary = assert_same_run(tor, sim, [0, 1, 2, 3])
    assert summary["returns"] == 1


def test_a_joiner_whose_neighbour_dies_while_it_joins_takes_its_model_from_the_other(tmp_path):
    """Rank 1 (the joiner's donor) dies at the step the replacement of rank 2 joins, after agreeing to it: the
    step is taken again without rank 1, and agent 2 takes its model from agent 3."""
    tor, err = launch(tmp_path, "die:2:5,die:1:*:join", WAIT, restarts=1)
    left, change = rows(tor / "membership.csv")
    assert (change["left"], change["joined"], change["donors"], change["online"]) == ("1", "2", "2<3", "3")
    J = int(change["step"])
    sim = simulate(tmp_path, [(2, 5, J), (1, J, None)], WAIT)
    assert_same_run(tor, sim, [0, 2, 3])
