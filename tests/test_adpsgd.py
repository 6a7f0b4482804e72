"""AD-PSGD (``adpsgd``): the asynchronous executor against a plain event loop, hand-computed event times,
the mean kept by pairwise averaging, a run end to end, checkpoints bit for bit, bad inputs refused."""

from __future__ import annotations

import csv
import doctest
import io
import json

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd import cli
from cdsgd.algorithms import make_algorithm
from cdsgd.base.checks import HYPER_DEFAULTS
from cdsgd.base.seeding import derive_seed
from cdsgd.config import load_config
from cdsgd.executor import Executor
from cdsgd.executor.asynchronous import AsyncExecutor
from cdsgd.mixers import MatrixMixer
from cdsgd.network import network_spec, stragglers
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import validate_config

D, ROWS = 3, 6  # least squares: 3 unknowns, 6 rows per agent (one full batch per gradient)


def _problem(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(D, 1, generator=g, dtype=torch.float64)
    shards = []
    for _ in range(n):
        A = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
        shards.append((A, A @ truth + 0.1 * torch.randn(ROWS, 1, generator=g, dtype=torch.float64)))
    return shards


def _model():
    return nn.Linear(D, 1, bias=False).double()


def _executor(W, shards, *, network=None, seed=0, loss_fn=nn.functional.mse_loss, **hyper):
    hyper = {"lr": 0.05, **hyper}
    return AsyncExecutor.build(_model, shards, W, "adpsgd", batch_size=ROWS, seed=seed, loss_fn=loss_fn,
                         network=network, init="independent", **hyper)


def _reference(X0, shards, W, *, steps, seed, compute, tau, latency, lr, momentum=HYPER_DEFAULTS["momentum"],
               nesterov=True, weight_decay=0.0):
    """AD-PSGD written out agent by agent (numpy): the module docstrings' time model and update, nothing shared."""
    n = len(shards)
    W = np.asarray(W)
    nbrs = [[l for l in range(n) if l != i and W[i, l] != 0] for i in range(n)]
    A = [s[0].numpy() for s in shards]
    b = [s[1].numpy()[:, 0] for s in shards]
    x, m = X0.copy(), np.zeros_like(X0)
    snap = X0.copy()
    done, free, count = list(compute), [0.0] * n, [0] * n
    events = []
    for _ in range(steps * n):
        i = min(range(n), key=lambda a: (done[a], a))  # the earliest end of a computation; ties by index
        t = count[i]
        j = nbrs[i][np.random.default_rng(derive_seed(seed, "adpsgd", i, t)).integers(len(nbrs[i]))]
        start = max(done[i], free[i], free[j])
        free[i] = free[j] = start + tau
        end = start + tau + latency
        g = 2.0 / ROWS * A[i].T @ (A[i] @ snap[i] - b[i]) + weight_decay * snap[i]  # at the snapshot
        avg = (x[i] + x[j]) / 2
        x[j] = avg
        if momentum:
            m[i] = momentum * m[i] + g
            d = g + momentum * m[i] if nesterov else m[i]
        else:
            d = g
        x[i] = avg - lr * d
        snap[i] = x[i].copy()
        count[i] += 1
        done[i] = end + compute[i]
        events.append((end, i, j))
    return x, events


NET = {"bandwidth_mbps": 0.064, "latency_ms": 2.0, "compute_ms": 10.0}  # 3 float64 parameters: τ = 3 ms


@pytest.mark.parametrize("graph,n,net,hyper", [
    ("ring", 5, None, {"momentum": 0.0}),
    ("ring", 5, {**NET, "stragglers": 0.4, "straggler_slowdown": 2.5}, {"momentum": 0.9}),
    ("path", 4, {**NET, "stragglers": 0.25}, {"momentum": 0.5, "nesterov": False, "weight_decay": 0.01}),
    ("complete", 4, {"bandwidth_mbps": 1.0, "latency_ms": 0.0, "compute_ms": 3.0, "stragglers": 0.5}, {}),
])
def test_matches_an_agent_by_agent_event_loop(graph, n, net, hyper):
    W = topologies.mixing_matrix(topologies.build(graph, n))
    spec = None if net is None else network_spec("none", net)
    ex = _executor(W, _problem(n), network=spec, seed=3, **hyper)
    X0 = ex.X.numpy().copy()
    events = []
    for _ in range(7):
        ex.step()
        events += ex.last_events
    if spec is None:  # one unit per computation, free communication
        compute, tau, latency = [1.0] * n, 0.0, 0.0
    else:
        slow = stragglers(spec, n, 3)
        compute = [spec.compute_ms / 1e3 * (spec.straggler_slowdown if s else 1.0) for s in slow]
        tau, latency = 8 * D * 8 / (spec.bandwidth_mbps * 1e6), spec.latency_ms / 1e3
    want, want_events = _reference(X0, ex.shards, W, steps=7, seed=3, compute=compute, tau=tau, latency=latency,
                                   lr=0.05, **hyper)
    assert [(i, j) for _, i, j in events] == [(i, j) for _, i, j in want_events]
    assert [e for e, _, _ in events] == pytest.approx([e for e, _, _ in want_events], abs=1e-12)
    np.testing.assert_allclose(ex.X.numpy(), want, rtol=0, atol=1e-12)
    assert sum(ex.applied) == 7 * n and ex.k == 7
    # every exchange counts one vector for each partner
    assert ex.mixer.bytes_sent.sum().item() == 2 * 7 * n * D * 8
    row = ex.evaluate()
    assert (np.isnan(row["sim_seconds"]) if spec is None
            else row["sim_seconds"] == max(e for e, _, _ in want_events))


def test_a_straggler_changes_the_event_order_as_computed_by_hand():
    """3 agents on a path 0 - 1 - 2, 10 ms computations, τ = 3 ms, L = 2 ms; with agent 0 a straggler (30 ms)
    and without. Events listed as (exchange end in ms, agent, partner)."""
    W = topologies.mixing_matrix(topologies.build("path", 3))
    shards = _problem(3)
    plain = _executor(W, shards, network=network_spec("none", NET), seed=1)
    slow_spec = network_spec("none", {**NET, "stragglers": 1 / 3, "straggler_slowdown": 3})
    assert stragglers(slow_spec, 3, 1).tolist() == [True, False, False]
    slow = _executor(W, shards, network=slow_spec, seed=1)
    assert [slow.algorithm.partner(1, t, [0, 2]) for t in range(3)] == [0, 2, 2]  # agent 1's draws (seed 1)

    def ms(ex):
        ex.step()
        return [(round(e * 1e3, 9), i, j) for e, i, j in ex.last_events]

    # all done at 10. 0+1: 10..13 (uplinks), ends 15; 1+0: uplinks free at 13, 13..16, ends 18;
    # 2+1: 1's uplink free at 16, 16..19, ends 21. Next: 0 at 25, 1 at 28, 2 at 31.
    assert ms(plain) == [(15.0, 0, 1), (18.0, 1, 0), (21.0, 2, 1)]
    # 0+1 at 25 (free since 19): ends 30; 1+2 at 28: ends 33; 2+1 at 31 (uplinks free at 31): ends 36
    assert ms(plain) == [(30.0, 0, 1), (33.0, 1, 2), (36.0, 2, 1)]

    # straggler 0 done at 30, 1 and 2 at 10. 1+0 at 10: ends 15, 1 next at 25; 2+1 at 10, 1's uplink free at
    # 13: ends 18, 2 next at 28; 1+2 at 25 (free since 16): uplinks to 28, ends 30, 1 next at 40
    assert ms(slow) == [(15.0, 1, 0), (18.0, 2, 1), (30.0, 1, 2)]
    # 2+1 at 28: uplinks to 31, ends 33; 0+1 at 30, 1's uplink free at 31: ends 36 (0 next at 66);
    # 1+2 at 40: ends 45
    assert ms(slow) == [(33.0, 2, 1), (36.0, 0, 1), (45.0, 1, 2)]
    assert slow.applied == [1, 3, 2] and slow.evaluate()["sim_seconds"] == pytest.approx(0.045, abs=1e-15)


def test_pairwise_averaging_keeps_the_mean_without_gradients():
    W = topologies.mixing_matrix(topologies.build("torus", 9))
    zero = lambda out, y: (out * 0.0).sum()  # noqa: E731 - g = 0: each event is a pure pairwise average
    ex = _executor(W, _problem(9), network=network_spec("none", {**NET, "stragglers": 0.3}), loss_fn=zero,
                   momentum=0.9)
    mean0, spread0 = ex.X.mean(0).clone(), ex.consensus_distance()
    for _ in range(40):
        ex.step()
    torch.testing.assert_close(ex.X.mean(0), mean0, rtol=0, atol=1e-13)
    assert ex.consensus_distance() < 1e-3 * spread0  # gossip alone reaches consensus at the mean


def test_checkpoint_resume_continues_bit_for_bit():
    W = topologies.mixing_matrix(topologies.build("ring", 6))
    spec = network_spec("none", {**NET, "stragglers": 0.5, "straggler_slowdown": 1.7})
    shards = _problem(6)
    straight = _executor(W, shards, network=spec, momentum=0.9)
    straight.run(steps=9)
    first = _executor(W, shards, network=spec, momentum=0.9)
    first.run(steps=4)
    assert any(first._ready)  # gradients computed but not yet applied cross the checkpoint
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = _executor(W, shards, network=spec, momentum=0.9)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    rows = resumed.run(steps=5)
    assert torch.equal(resumed.X, straight.X)
    assert torch.equal(resumed.state["momentum"], straight.state["momentum"])
    assert torch.equal(resumed.mixer.bytes_sent, straight.mixer.bytes_sent)
    assert resumed.applied == straight.applied and resumed.times.done == straight.times.done
    assert rows[-1]["sim_seconds"] == straight.evaluate()["sim_seconds"]


RUN = ["algorithm=adpsgd", "n_agents=4", "dataset=synthetic", "model=logreg", "epochs=2", "eval_every=1",
       "network=edge", "network_params={compute_ms=20, stragglers=0.25}", "save_params=true"]


def _metrics(out):
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_cdsgd_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", *RUN, f"out={out}", "--no-progress"]) == 0
    rows = _metrics(out)
    sim = [float(r["sim_seconds"]) for r in rows]
    assert len(rows) == 2 and sim[0] > 0 and sim[1] > sim[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["algorithm"] == "adpsgd"
    assert summary["simulated_seconds"] == sim[-1] and len(summary["stragglers"]) == 1
    # each of the 4 · steps exchanges sends one vector each way
    steps, P = summary["step"], summary["n_parameters"]
    assert summary["bytes_sent_per_agent"] == 2 * 4 * steps * P * 4 / 4
    assert summary["test_accuracy"] > 0.5


def test_interrupted_run_resumes_to_the_same_results(tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    run_experiment(load_config(overrides=[*RUN, f"out={ref}"]), progress=False, log=lambda m: None)
    out = tmp_path / "run"
    real = AsyncExecutor.step

    def stop_at_7(self):
        if self.k == 7:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(AsyncExecutor, "step", stop_at_7)
    ckpt = ["checkpoint_every=3", "checkpoint_unit=steps"]
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(overrides=[*RUN, f"out={out}", *ckpt]), progress=False, log=lambda m: None)
    monkeypatch.undo()
    run_experiment(load_config(overrides=[*RUN, f"out={out}", *ckpt, "resume=true"]), progress=False,
                   log=lambda m: None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 6
    drop = ("wall_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in _metrics(out)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in _metrics(ref)]
    assert torch.equal(torch.load(out / "params.pt", weights_only=True), torch.load(ref / "params.pt", weights_only=True))


@pytest.mark.parametrize("overrides,message", [
    (["executor=torch"], r"adpsgd.*executor=sim"),
    (["network=edge"], r"network 'edge' without network_params\.compute_ms.*compute_ms=20"),
    (["network=lan", "network_params={compute_ms=5, drop=0.1}"], r"drop=0\.1.*allowed: drop=0, link_failure=0"),
    (["network_params={compute_ms=5, link_failure=0.2}"], r"link_failure=0\.2.*does not simulate lost exchanges"),
    (["network_params={compute_ms=5, agents_per_host=2}"], r"agents_per_host=2.*allowed: agents_per_host=1"),
    (["topology=one_peer_exponential", "n_agents=8"], r"'one_peer_exponential' is a time-varying schedule"),
])
def test_bad_configs_are_refused_at_the_door(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(overrides=["algorithm=adpsgd", *overrides]))


def test_bad_executor_inputs_are_refused():
    W = topologies.mixing_matrix(topologies.build("ring", 3))
    shards = _problem(3)
    with pytest.raises(ValueError, match=r"asynchronous: it runs one gradient application at a time"):
        Executor.build(_model, shards, W, "adpsgd", lr=0.1, batch_size=ROWS, loss_fn=nn.functional.mse_loss).step()
    with pytest.raises(ValueError, match=r"AsyncExecutor runs the asynchronous rules \(adpsgd\), not 'cdmsgd'"):
        AsyncExecutor.build(_model, shards, W, "cdmsgd", lr=0.1, batch_size=ROWS)
    with pytest.raises(ValueError, match=r"network must be a NetworkSpec or None.*got str"):
        AsyncExecutor.build(_model, shards, W, "adpsgd", lr=0.1, batch_size=ROWS, network="edge")
    one_way = 0.5 * np.eye(3) + 0.5 * np.roll(np.eye(3), 1, axis=1)  # doubly stochastic, a directed ring
    with pytest.raises(ValueError, match=r"W\[0, 1\] = 0.5 but W\[1, 0\] = 0"):  # the matrix's validation
        AsyncExecutor.build(_model, shards, one_way, "adpsgd", lr=0.1, batch_size=ROWS)
    with pytest.raises(ValueError, match=r"both ways, but W\[0, 1\] ≠ 0 and W\[1, 0\] = 0"):  # the rule's own
        AsyncExecutor.build(_model, shards, MatrixMixer(one_way, validate=False), "adpsgd", lr=0.1, batch_size=ROWS)
    with pytest.raises(ValueError, match=r"agent 2 has no neighbour"):
        AsyncExecutor.build(_model, shards, MatrixMixer([[0.5, 0.5, 0], [0.5, 0.5, 0], [0, 0, 1.0]], validate=False),
                      "adpsgd", lr=0.1, batch_size=ROWS)
    with pytest.raises(ValueError, match=r"algorithm 'adpsgd' takes no hyperparameter 'consensus_step'"):
        make_algorithm("adpsgd", lr=0.1, consensus_step=0.5)


def test_docstring_examples():
    import cdsgd.algorithms.adpsgd
    import cdsgd.executor.asynchronous

    for module in (cdsgd.algorithms.adpsgd, cdsgd.executor.asynchronous):
        assert doctest.testmod(module).failed == 0
