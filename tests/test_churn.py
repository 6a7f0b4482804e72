"""Churn in the simulator: agents that leave and come back (``network_params`` churn, ``membership = "elastic"``).

The semantics are checked against an independent transcription: with a zero loss a step is pure mixing, so the
parameters must follow X ← W_k X with W_k the weight rule on the surviving subgraph (written out here with
networkx and numpy), offline rows frozen and a returning agent starting from its donor's row. The clock and
the bytes against closed forms; the seeded trace against its stated rate and mean durations.
"""

from __future__ import annotations

import csv
import json
import math

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.config import load_config
from cdsgd.executor import Executor
from cdsgd.network import MembershipTrace, NetworkClock, load_trace, network_spec, random_churn
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import validate_config

N = 6


def metropolis_on(G: nx.Graph, online: np.ndarray) -> np.ndarray:
    """W over the online agents written out: 1/(1 + max(d_i, d_j)) on the surviving edges, identity offline."""
    deg = {j: sum(1 for i in G.neighbors(j) if online[i]) for j in G.nodes}
    W = np.zeros((len(online), len(online)))
    for i, j in G.edges:
        if online[i] and online[j]:
            W[i, j] = W[j, i] = 1.0 / (1 + max(deg[i], deg[j]))
    W[np.diag_indices_from(W)] = 1.0 - W.sum(axis=1)
    return W


def shards(n=N, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (12,), generator=g))
            for _ in range(n)]


def trace_file(tmp_path, rows):
    path = tmp_path / "trace.csv"
    path.write_text("agent,leave_step,return_step\n" + "".join(f"{a},{l},{'' if r is None else r}\n"
                                                              for a, l, r in rows))
    return str(path)


def executor(tmp_path, rows, algorithm="cdsgd", graph="ring", **options):
    W = topologies.mixing_matrix(topologies.build(graph, N))
    net = network_spec("none", {"churn_trace": trace_file(tmp_path, rows), "compute_ms": 1})
    torch.manual_seed(0)
    return Executor.build(lambda: nn.Linear(3, 2).double(), shards(), W, algorithm, batch_size=4,
                          network=net, **{"lr": 0.1, **options})


# ------------------------------------------------------------------------------------------------ the trace

def test_a_trace_says_who_is_offline_from_leave_up_to_return():
    t = MembershipTrace(3, [(1, 2, 4), (1, 6, None), (0, 0, 1)])
    got = np.array([t.online(k) for k in range(8)]).astype(int)
    assert got[:, 1].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert got[:, 0].tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert got[:, 2].all()


@pytest.mark.parametrize("rows,message", [
    ([(3, 1, 2)], r"^churn trace row 1 names agent 3; the agents are 0\.\.2$"),
    ([(0, 1, 2), (1, 5, 5)], r"^churn trace row 2: agent 1 returns at step 5, not after it left \(step 5\)"),
    ([(0, -1, 2)], r"^churn trace row 1: leave_step must be a step >= 0, got -1$"),
    ([(0, 1, 5), (0, 4, 8)], r"^churn trace row 2: agent 0's interval \[4, 8\) overlaps its interval from step 1$"),
])
def test_a_bad_trace_is_refused_naming_its_row(rows, message):
    with pytest.raises(ValueError, match=message):
        MembershipTrace(3, rows)


def test_a_trace_file_reads_never_and_empty_returns_and_refuses_a_bad_header(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("agent,leave_step,return_step\n0,2,\n1,1,never\n2,0,3\n")
    t = load_trace(path, 3)
    assert t.intervals(0) == [(2, None)] and t.intervals(1) == [(1, None)] and t.intervals(2) == [(0, 3)]
    path.write_text("agent,leave,return\n0,2,3\n")
    with pytest.raises(ValueError, match=r"has the header \['agent', 'leave', 'return'\]; it must be "
                                         r"agent,leave_step,return_step$"):
        load_trace(path, 3)
    path.write_text("agent,leave_step,return_step\n0,two,3\n")
    with pytest.raises(ValueError, match=r"row 1: .* is not whole numbers"):
        load_trace(path, 3)


@pytest.mark.parametrize("rate,down", [(0.1, 5.0), (0.3, 20.0)])
def test_seeded_churn_is_offline_its_rate_of_the_steps_in_periods_of_its_mean(rate, down):
    t = random_churn(200, rate, down, seed=1)
    steps = 6000
    online = np.array([t.online(k) for k in range(steps)])
    assert abs(1 - online[steps // 2:].mean() - rate) < 0.02  # after the start (everyone online at step 0)
    lengths = [(r if r is not None else steps) - l for j in range(200) for l, r in t.intervals(j) if l < steps // 2]
    assert abs(np.mean(lengths) / down - 1) < 0.06
    again = random_churn(200, rate, down, seed=1)
    assert np.array_equal(again.online(steps - 1), online[-1])  # the trace does not depend on how it was asked
    assert not np.array_equal(random_churn(200, rate, down, seed=2).online(steps - 1), online[-1])


# ------------------------------------------------------------------------------------------ the mixing

def test_the_surviving_mixing_is_the_weight_rule_on_the_online_subgraph():
    G = topologies.build("torus", 9)
    online = np.array([1, 1, 0, 1, 0, 1, 1, 1, 1], dtype=bool)
    s = topologies.surviving_mixing(G, online)
    assert np.allclose(s.W, metropolis_on(G, online), atol=1e-15)
    assert len(s.parts) == 1 and np.isclose(s.gap.gap, topologies.spectral_gap(
        metropolis_on(G, online)[np.ix_(online, online)]).gap)
    every = topologies.surviving_mixing(G, np.ones(9, dtype=bool))
    assert np.array_equal(every.W, topologies.mixing_matrix(G))
    with pytest.raises(ValueError, match=r"^mixing 'uniform' cannot be re-weighted"):
        topologies.surviving_mixing(G, online, "uniform")


def test_without_gradients_a_step_is_the_surviving_mixing_and_a_return_copies_the_donor(tmp_path):
    rows = [(2, 1, 4), (3, 2, None), (0, 3, 5)]
    ex = executor(tmp_path, rows, init="independent", loss_fn=lambda out, y: (0 * out).sum())  # no gradient
    G, trace = topologies.build("ring", N), load_trace(tmp_path / "trace.csv", N)
    X = ex.X.detach().numpy().copy()
    for k in range(7):
        before, online = trace.online(k - 1) if k else np.ones(N, bool), trace.online(k)
        for j in np.flatnonzero(~before & online):  # back: the lowest neighbour online at k − 1 and k
            donor = min(i for i in G.neighbors(j) if before[i] and online[i])
            X[j] = X[donor]
        X = metropolis_on(G, online) @ X
        ex.step()
        assert np.allclose(ex.X.numpy(), X, rtol=0, atol=1e-14), k
    changes = [r["step"] for r in ex.membership.rows]
    assert changes == [1, 2, 3, 4, 5]
    assert ex.membership.rows[2]["left"] == "0" and ex.membership.rows[3]["donors"] == "2<1"


def test_an_agent_offline_from_the_start_keeps_its_parameters_state_and_data_untouched(tmp_path):
    ex = executor(tmp_path, [(4, 0, None)], algorithm="cdmsgd")
    x0 = ex.X[4].clone()
    position = [s.state_dict() for s in ex.streams]
    ex.run(steps=9, eval_every_steps=3)
    assert torch.equal(ex.X[4], x0) and not ex.state["momentum"][4].any()
    now = [s.state_dict() for s in ex.streams]
    assert now[4]["pos"] == position[4]["pos"] and torch.equal(now[4]["perm"], position[4]["perm"])
    assert now[3]["pos"] != position[3]["pos"] or not torch.equal(now[3]["perm"], position[3]["perm"])
    assert ex.mixer.bytes_sent[4] == 0


def test_a_trace_where_nobody_leaves_is_bit_identical_to_no_churn(tmp_path):
    churned = executor(tmp_path, [], algorithm="cdmsgd")
    W = topologies.mixing_matrix(topologies.build("ring", N))
    torch.manual_seed(0)
    plain = Executor.build(lambda: nn.Linear(3, 2).double(), shards(), W, "cdmsgd", lr=0.1, batch_size=4,
                           network=network_spec("none", {"compute_ms": 1}))
    a, b = churned.run(steps=8), plain.run(steps=8)
    assert torch.equal(churned.X, plain.X) and a[-1]["sim_seconds"] == b[-1]["sim_seconds"]
    assert torch.equal(churned.mixer.bytes_sent, plain.mixer.bytes_sent)


def test_bytes_follow_the_surviving_degrees_and_a_return_costs_its_donor_the_model_and_state(tmp_path):
    ex = executor(tmp_path, [(2, 1, 3)], algorithm="cdmsgd")
    P = ex.layout.numel * 8
    ex.run(steps=4)
    ring = np.full(N, 2.0)
    degrees = [ring, np.array([2, 1, 0, 1, 2, 2.0]), np.array([2, 1, 0, 1, 2, 2.0]), ring]
    expect = sum(degrees) * P
    expect[1] += 2 * P  # agent 2 came back at step 3 from agent 1: its parameters and its momentum
    assert np.array_equal(ex.mixer.bytes_sent.numpy(), expect)


def test_evaluation_averages_over_the_online_agents(tmp_path):
    ex = executor(tmp_path, [(1, 2, None), (4, 3, None)], init="independent")
    ex.run(steps=5)
    online = [0, 2, 3, 5]
    xbar = ex.X[online].mean(dim=0)
    assert torch.allclose(ex.average_params(), xbar, rtol=0, atol=1e-14)
    spread = ((ex.X[online] - xbar) ** 2).sum(dim=1).mean().sqrt().item()
    assert abs(ex.consensus_distance() - spread) < 1e-12


def test_with_nobody_online_the_figures_of_the_models_are_nan_and_the_run_goes_on(tmp_path):
    ex = executor(tmp_path, [(j, 2, 4) for j in range(N)], test_set=shards()[0])
    rows = ex.run(steps=6, eval_every_steps=3)
    nobody, back = rows
    assert all(math.isnan(nobody[k]) for k in ("test_accuracy", "test_accuracy_avg_model", "consensus_distance"))
    assert not math.isnan(back["test_accuracy_avg_model"]) and back["train_loss"] > 0


@pytest.mark.parametrize("algorithm,hyper", [("sgd", {}), ("diloco", {"local_steps": 2, "optimizer": "sgd"})])
def test_an_all_average_spans_the_online_agents(tmp_path, algorithm, hyper):
    net = network_spec("none", {"churn_trace": trace_file(tmp_path, [(1, 0, None)]), "compute_ms": 1})
    torch.manual_seed(0)
    ex = Executor.build(lambda: nn.Linear(3, 2).double(), shards(), None, algorithm, batch_size=4, lr=0.1,
                        network=net, **hyper)
    x0 = ex.X[1].clone()
    ex.run(steps=4)
    online = [0, 2, 3, 4, 5]
    assert torch.equal(ex.X[1], x0)
    assert all(torch.equal(ex.X[online[0]], ex.X[j]) for j in online)  # one model among the online agents
    assert not torch.equal(ex.X[0], x0)


# --------------------------------------------------------------------------------------------- the clock

def test_the_clock_skips_an_offline_agent_and_charges_a_return_over_the_donors_uplink():
    spec = network_spec("none", {"bandwidth_mbps": 8, "latency_ms": 1, "compute_ms": 0})
    W = topologies.mixing_matrix(topologies.build("ring", 4))
    clock = NetworkClock(spec, W)
    m = 1000.0
    tau, L = m * 8 / 8e6, 1e-3
    clock.advance(np.zeros(4), np.array([m, 2 * m, m, 0.0]), online=np.array([1, 1, 1, 0], dtype=bool))
    # the path 0-1-2: agent 1 sends to 0 then 2; 0 and 2 send one message each; agent 3 stays where it was
    assert np.allclose(clock.start, [tau + L, tau + L, 2 * tau + L, 0.0], rtol=0, atol=1e-15)
    joined = 4 * m
    clock.advance(np.zeros(4), np.zeros(4), joins=[(3, 0, joined)])
    assert np.isclose(clock.start[3], (tau + L) + joined * 8 / 8e6 + L, rtol=0, atol=1e-15)


# ------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides,message", [
    (["membership=elastc"], r"^membership 'elastc' is unknown; did you mean 'elastic'\? Known: elastic, fixed$"),
    (["membership=elastic", "network_params={churn=1.0}"], r"^network_params\.churn = 1\.0 is out of range"),
    (["membership=elastic", "network_params={churn=-0.1}"], r"^network_params\.churn = -0\.1 is out of range"),
    (["network_params={churn=0.1}"], r"^network_params churn makes agents leave .* set membership = \"elastic\"$"),
    (["membership=elastic", "algorithm=d2"], r"^membership='elastic' \(churn\): algorithm 'd2' cannot go on when "
                                             r"agents leave and return \(its correction .*\); elastic membership "
                                             r"is for .*cdmsgd"),
    (["membership=elastic", "algorithm=relaysum"], r"relayed sums pass through every agent"),
    (["membership=elastic", "network_params={churn=0.1, churn_trace='t.csv'}"], r"give one"),
    (["min_ranks=2"], r"^min_ranks = 2 waits for replacements, which join under membership = 'elastic' only"),
    (["membership=elastic", "min_ranks=-1"], r"^min_ranks"),
    (["membership=elastic", "network_params={churn=0.1}", "mixing=uniform"], r"^mixing = 'uniform' is doubly"),
    (["membership=elastic", "network_params={churn=0.1}", "topology=one_peer_exponential", "n_agents=4"],
     r"time-varying topology"),
    (["membership=elastic", "network_params={churn=0.1, drop=0.1}"], r"one kind of failure at a time"),
    (["membership=elastic", "network_params={churn_down_steps=0.5, churn=0.1}"], r"churn_down_steps = 0\.5 is out"),
])
def test_bad_churn_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        validate_config(load_config(overrides=["n_agents=5", *overrides]))
    assert "\n" not in str(e.value)


def test_elastic_runtime_outside_cdsgd_launch_is_refused_in_one_line(tmp_path):
    """torchrun stops every rank at the first loss: an elastic runtime run is started by cdsgd launch."""
    from cdsgd.run.experiment import run_experiment

    cfg = load_config(overrides=["n_agents=4", "membership=elastic", "executor=torch", f"out={tmp_path / 'out'}"])
    with pytest.raises(ValueError, match=r"^membership = 'elastic' with executor = 'torch' runs under cdsgd launch"):
        run_experiment(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows,message", [([(7, 1, 2)], r"names agent 7; the agents are 0\.\.4"),
                                          ([(1, 4, 2)], r"agent 1 returns at step 2, not after it left")])
def test_a_trace_naming_a_missing_agent_or_an_early_return_is_refused_before_the_run(tmp_path, rows, message):
    path = trace_file(tmp_path, rows)
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(overrides=["n_agents=5", "membership=elastic",
                                               f"network_params={{churn_trace='{path}'}}"]))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ a run

SMALL = ["dataset=synthetic", "model=logreg", "n_agents=5", "batch_size=16", "lr=0.1", "membership=elastic",
         "save_params=true", "exact=true"]


def test_a_run_records_every_change_in_membership_csv_and_resumes_bit_for_bit(tmp_path):
    trace = trace_file(tmp_path, [(1, 2, 9), (3, 5, None), (4, 5, 7)])
    net = f"network_params={{churn_trace='{trace}', compute_ms=2}}"
    whole = run_experiment(load_config(overrides=SMALL + [net, "epochs=2", f"out={tmp_path / 'a'}"]),
                           progress=False, log=lambda m: None)
    with open(tmp_path / "a" / "membership.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["left"], r["joined"], r["online"]) for r in rows] == [
        ("2", "1", "", "4"), ("5", "3 4", "", "2"), ("7", "", "4", "3"), ("9", "", "1", "4")]
    assert rows[2]["donors"] == "4<0" and rows[3]["donors"] == "1<0"
    assert float(rows[1]["sim_seconds"]) > float(rows[0]["sim_seconds"]) > 0
    assert rows[1]["parts"] == "2" and float(rows[1]["spectral_gap"]) == 0.0  # agents 0, 2 of a 5-ring minus 1, 3, 4
    assert whole["status"] == "completed" and whole["departures"] == 3 and whole["returns"] == 2
    assert whole["final_online"] == 4 and whole["min_online"] == 2 and whole["membership"] == "elastic"
    b = tmp_path / "b"
    run_experiment(load_config(overrides=SMALL + [net, "epochs=1", "checkpoint_every=1", f"out={b}"]),
                   progress=False, log=lambda m: None)
    run_experiment(load_config(overrides=SMALL + [net, "epochs=2", "resume=true", f"out={b}"]),
                   progress=False, log=lambda m: None)
    assert torch.equal(torch.load(b / "params.pt"), torch.load(tmp_path / "a" / "params.pt"))
    assert (b / "membership.csv").read_text().count("\n") == (tmp_path / "a" / "membership.csv").read_text().count("\n")
    assert json.loads((b / "summary.json").read_text())["departures"] == 3
