"""The simulated network clock (cdsgd.network): closed forms, an independent message-by-message model, losses.

The reference :func:`reference_clock` below is written from docs/network.md's
formulas, message by message with plain Python lists, and shares no code
with :class:`cdsgd.network.NetworkClock`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import topologies
from cdsgd.config import load_config
from cdsgd.executor import Executor
from cdsgd.mixers import MatrixMixer
from cdsgd.network import LossyMixer, NetworkClock, network_spec, stragglers
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import validate_config


def spec(**params):
    return network_spec("none", params)


def ring_like(name, n, **kw):
    return topologies.mixing_matrix(topologies.build(name, n, **kw))


# ------------------------------------------------------------------ the reference model


def reference_clock(W, steps, compute, sent, *, bandwidth_mbps, latency_ms, overlap, hosts=None, lost=None):
    """Start times after each step, message by message (docs/network.md), in plain Python.

    ``compute[k][j]`` and ``sent[k][j]`` per step; ``lost[k]``: a set of (receiver, sender) pairs lost
    at step k, with ``("failed", i, j)`` marking a failed link's message (not sent at all).
    """
    W = np.asarray(W)
    n = len(W)
    hosts = list(range(n)) if hosts is None else list(hosts)
    out_nb = {j: [i for i in range(n) if i != j and W[i, j] != 0] for j in range(n)}
    start = [0.0] * n
    uplink = {h: 0.0 for h in set(hosts)}
    times = []
    for k in range(steps):
        lost_k = lost[k] if lost else set()
        done = [start[j] + compute[k][j] for j in range(n)]
        ready = [start[j] if overlap else done[j] for j in range(n)]
        queue = []  # cross-host messages: (ready, sender, receiver)
        arrivals = {i: [] for i in range(n)}
        for j in range(n):
            if sent[k][j] == 0:
                continue
            m = sent[k][j] / len(out_nb[j])
            for i in out_nb[j]:
                if ("failed", i, j) in lost_k:
                    continue
                if hosts[i] == hosts[j]:
                    if (i, j) not in lost_k:
                        arrivals[i].append(ready[j])
                else:
                    queue.append((ready[j], j, i, m))
        for h in sorted(set(hosts)):
            t = uplink[h]
            for r, j, i, m in sorted(q for q in queue if hosts[q[1]] == h):
                t = max(t, r) + m * 8 / (bandwidth_mbps * 1e6)
                if (i, j) not in lost_k:
                    arrivals[i].append(t + latency_ms / 1e3)
            uplink[h] = t
        start = [max([done[i]] + arrivals[i]) for i in range(n)]
        times.append(list(start))
    return times


@pytest.mark.parametrize("name,n,kw", [("ring", 6, {}), ("torus", 9, {}), ("complete", 5, {}), ("star", 6, {}),
                                       ("erdos_renyi", 10, {"p": 0.4, "seed": 1})])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("per_host", [1, 2])
def test_clock_matches_the_message_by_message_model(name, n, kw, overlap, per_host):
    W = ring_like(name, n, **kw)
    rng = np.random.default_rng(n + per_host)
    steps = 12
    compute = rng.random((steps, n)) * 0.004
    degree = (np.asarray(W) != 0).sum(0) - 1
    sent = rng.integers(1, 4, (steps, n)) * 1000.0 * degree
    sent[3, 2] = 0  # an agent that sends nothing one step: nobody waits for it
    clock = NetworkClock(spec(bandwidth_mbps=5, latency_ms=1.5, agents_per_host=per_host), W, overlap=overlap)
    got = [clock.advance(compute[k], sent[k]) and clock.start.copy() for k in range(steps)]
    want = reference_clock(W, steps, compute, sent, bandwidth_mbps=5, latency_ms=1.5, overlap=overlap,
                           hosts=np.arange(n) // per_host)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-12)


def test_clock_with_losses_matches_the_reference():
    W = ring_like("torus", 9)
    net = spec(bandwidth_mbps=2, latency_ms=3, drop=0.2, link_failure=0.1)
    clock = NetworkClock(net, W, seed=5)
    g = clock.graph(0)
    steps, n = 15, 9
    compute = np.full((steps, n), 0.001)
    sent = np.full((steps, n), 4 * 500.0)
    lost = []
    for k in range(steps):
        dropped, failed = clock.losses(k)
        lost.append({(int(i), int(j)) for i, j, d in zip(g.recv, g.send, dropped) if d}
                    | {("failed", int(i), int(j)) for i, j, f in zip(g.recv, g.send, failed) if f})
    assert sum(len(s) for s in lost) > 0
    got = [clock.advance(compute[k], sent[k]) and clock.start.copy() for k in range(steps)]
    want = reference_clock(W, steps, compute, sent, bandwidth_mbps=2, latency_ms=3, overlap=True, lost=lost)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-12)
    assert clock.lost_messages == sum(len(s) for s in lost)


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("name,n,d", [("ring", 8, 2), ("torus", 16, 4), ("complete", 6, 5), ("hypercube", 8, 3)])
@pytest.mark.parametrize("overlap", [True, False])
def test_d_regular_graph_takes_d_tau_plus_latency_per_step(name, n, d, overlap):
    W = ring_like(name, n)
    m, B, L, K = 12_500.0, 10.0, 4.0, 7  # bytes per message, Mbit/s, ms, steps
    tau = m * 8 / (B * 1e6)
    for c in (0.0, 0.002, 0.05):
        clock = NetworkClock(spec(bandwidth_mbps=B, latency_ms=L, compute_ms=c * 1e3), W, overlap=overlap)
        for _ in range(K):
            clock.advance(np.zeros(n), np.full(n, d * m))
        per_step = max(c, d * tau + L / 1e3) if overlap else c + d * tau + L / 1e3
        assert clock.seconds == pytest.approx(K * per_step, rel=1e-12)
        if c == 0:
            assert clock.seconds == pytest.approx(K * (d * tau + L / 1e3), rel=1e-12)


def test_a_straggler_paces_the_ring():
    """With overlap, one agent computing C = s·c ≥ c + 2(2τ + L) sets the pace: K steps take K·C."""
    n, K, c, s = 8, 20, 0.010, 5.0
    W = ring_like("ring", n)
    net = spec(bandwidth_mbps=8, latency_ms=2, compute_ms=c * 1e3, stragglers=1 / n, straggler_slowdown=s)
    clock = NetworkClock(net, W, seed=3)
    assert clock.straggler.sum() == 1
    m = 1000.0  # 1 ms per message
    for _ in range(K):
        clock.advance(np.zeros(n), np.full(n, 2 * m))
    assert clock.seconds == pytest.approx(K * s * c, rel=1e-12)
    assert clock.start[clock.straggler][0] == pytest.approx(K * s * c, rel=1e-12)
    fast = NetworkClock(spec(bandwidth_mbps=8, latency_ms=2, compute_ms=c * 1e3), W)
    for _ in range(K):
        fast.advance(np.zeros(n), np.full(n, 2 * m))
    assert fast.seconds == pytest.approx(K * c, rel=1e-12)


def test_stragglers_are_drawn_by_the_seed():
    net = spec(stragglers=0.25)
    a, b = stragglers(net, 16, 0), stragglers(net, 16, 1)
    assert a.sum() == b.sum() == 4 and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, stragglers(net, 16, 0))
    assert stragglers(network_spec("lan"), 16, 0).sum() == 0


def test_allreduce_and_server_charges():
    n, P, b, c = 8, 1000, 4, 0.01
    net = spec(bandwidth_mbps=1, latency_ms=5, compute_ms=c * 1e3)
    ring = NetworkClock(net, n_agents=n, traffic="allreduce")
    sent = 2 * (n - 1) / n * P * b
    ring.advance(np.zeros(n), np.full(n, sent))
    assert ring.seconds == pytest.approx(c + sent * 8 / 1e6 + 2 * (n - 1) * 0.005, rel=1e-12)
    star = NetworkClock(net, n_agents=n, traffic="server", message_bytes=P * b)
    star.advance(np.zeros(n), np.zeros(n))  # a local step: computation only
    assert star.seconds == pytest.approx(c)
    part = np.zeros(n)
    part[:4] = sent  # 4 participants
    star.advance(np.zeros(n), part)
    assert star.seconds == pytest.approx(2 * c + P * b * 8 / 1e6 + 0.005 + 4 * P * b * 8 / 1e6 + 0.005, rel=1e-12)


def test_losses_are_reproducible_and_at_their_rate():
    W = ring_like("torus", 16)
    clock = NetworkClock(spec(drop=0.1, link_failure=0.05), W, seed=2)
    g = clock.graph(0)
    total_drop = total_fail = 0
    for k in range(400):
        dropped, failed = clock.losses(k)
        d2, f2 = clock.losses(k)
        assert np.array_equal(dropped, d2) and np.array_equal(failed, f2)
        assert not (dropped & failed).any()
        # a failed link is down both ways
        down = {(int(i), int(j)) for i, j, f in zip(g.recv, g.send, failed) if f}
        assert all((j, i) in down for i, j in down)
        total_drop, total_fail = total_drop + dropped.sum(), total_fail + failed.sum()
    E = len(g.recv) * 400
    p_fail = 0.05
    assert abs(total_fail / E - p_fail) < 5 * math.sqrt(p_fail * (1 - p_fail) / (E / 2))
    p_drop = 0.1 * (1 - p_fail)
    assert abs(total_drop / E - p_drop) < 5 * math.sqrt(p_drop * (1 - p_drop) / E)
    none = NetworkClock(network_spec("lan"), W)
    assert not any(m.any() for m in none.losses(3))


# ------------------------------------------------------------------ lossy mixing


@pytest.mark.parametrize("mode", ["own", "lost"])
def test_lossy_mixing_is_the_surviving_matrix(mode):
    W = ring_like("torus", 9)
    clock = NetworkClock(spec(drop=0.3), W, seed=1)
    g = clock.graph(0)
    dropped, failed = clock.losses(4)
    lost = dropped | failed
    assert lost.any()
    X = torch.randn(9, 5, dtype=torch.float64)
    got = LossyMixer(MatrixMixer(W), g.recv, g.send, g.weight, lost, mode).mix(X)
    Wl = np.array(W, dtype=np.float64)
    for i, j in zip(g.recv[lost], g.send[lost]):
        if mode == "own":
            Wl[i, i] += Wl[i, j]
        Wl[i, j] = 0.0
    torch.testing.assert_close(got, torch.as_tensor(Wl) @ X, rtol=0, atol=1e-12)
    if mode == "own":
        np.testing.assert_allclose(Wl.sum(1), 1.0)


def test_lossy_exchange_hands_empty_messages():
    W = topologies.mixing_matrix(topologies.build("path", 5))
    clock = NetworkClock(spec(drop=0.5), W, seed=0)
    g = clock.graph(0)
    dropped, _ = clock.losses(1)
    base = MatrixMixer(W)
    M = torch.arange(len(base.edges) * 3, dtype=torch.float64).reshape(-1, 3) + 1
    R = LossyMixer(base, g.recv, g.send, g.weight, dropped, "own").exchange(M).wait()
    full = MatrixMixer(W).exchange(M).wait()
    assert dropped.any() and not dropped.all()
    assert (R[torch.as_tensor(dropped)] == 0).all()
    torch.testing.assert_close(R[torch.as_tensor(~dropped)], full[torch.as_tensor(~dropped)])


def test_relaysum_under_losses_is_the_reference_codes_rule():
    """Empty messages for the lost ones, and the latest model (not x^0) for the agents not heard from."""
    from cdsgd.algorithms import make_algorithm
    from test_messages import _relaysum_naive

    T = topologies.spanning_tree(topologies.build("torus", 9))
    W = topologies.mixing_matrix(T)
    clock = NetworkClock(spec(drop=0.2), W, seed=3)
    g = clock.graph(0)
    B = torch.randn(9, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X0 = torch.randn(9, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    base = MatrixMixer(W)

    def run(lossy_rule: bool) -> torch.Tensor:
        alg = make_algorithm("relaysum", lr=0.1, momentum=0.0).bind(n_agents=9, steps_per_epoch=1, seed=0)
        if lossy_rule:
            alg.expect_losses()
        X = X0.clone()
        state = alg.init_state(X, mixer=base)
        for k in range(25):
            dropped, failed = clock.losses(k)
            alg.update(X, X - B, state, k=k, mixer=LossyMixer(base, g.recv, g.send, g.weight, dropped | failed, "own"))
        return X

    def lost(k):
        dropped, failed = clock.losses(k)
        return {(int(l), int(i)) for i, l, x in zip(g.recv, g.send, dropped | failed) if x}

    assert sum(len(lost(k)) for k in range(25)) > 10
    X = run(lossy_rule=True)
    torch.testing.assert_close(X, _relaysum_naive(T, B, X0, 25, 0.1, lost=lost), rtol=0, atol=1e-12)
    # the lossless rule's x^0 fallback would give another answer
    assert float((X - run(lossy_rule=False)).abs().max()) > 1e-3
    # an executor on a lossy network switches the rule; on a lossless one it does not
    shards = [(torch.randn(16, 3), torch.randint(0, 2, (16,))) for _ in range(4)]
    path = topologies.mixing_matrix(topologies.build("path", 4))
    for drop, want in ((0.1, "latest"), (0.0, "initial")):
        ex = Executor.build(lambda: torch.nn.Linear(3, 2), shards, path, "relaysum", lr=0.1, batch_size=8,
                      network=spec(compute_ms=1, drop=drop))
        assert ex.algorithm.fallback == want


# ------------------------------------------------------------------ runs


SMALL = ["dataset=synthetic", "model=logreg", "n_agents=6", "epochs=2", "batch_size=16", "lr=0.1"]


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    run_experiment(load_config(overrides=[*SMALL, *extra, f"out={out}"]), progress=False, log=lambda m: None)
    rows = (out / "metrics.csv").read_text().splitlines()
    return out, rows, json.loads((out / "summary.json").read_text())


def test_a_clock_leaves_the_arithmetic_alone(tmp_path):
    _, plain, s0 = _run(tmp_path, "plain")
    _, timed, s1 = _run(tmp_path, "timed", "network=wan", "network_params={compute_ms=2, stragglers=0.5}")
    w = plain[0].split(",").index("wall_seconds")  # all but wall_seconds and sim_seconds, the last two
    cut = [",".join(r.split(",")[:w]) for r in plain]
    assert cut == [",".join(r.split(",")[:w]) for r in timed]
    assert s0["simulated_seconds"] is None and plain[1].split(",")[plain[0].split(",").index("sim_seconds")] == "nan"
    # ring, 6 agents, logreg: each step sends 2 messages of P·4 bytes; compute 2 ms (×4 for stragglers) with overlap
    P, steps = s1["n_parameters"], s1["step"]
    per_step = max(0.008, 2 * P * 4 * 8 / 100e6 + 0.030)
    assert s1["simulated_seconds"] == pytest.approx(steps * per_step, rel=1e-9)
    assert s1["network"] == "wan" and len(s1["stragglers"]) == 3 and s1["lost_messages"] == 0


def test_dropped_messages_change_the_run_and_are_counted(tmp_path):
    _, plain, _ = _run(tmp_path, "plain", "network_params={compute_ms=1}")
    _, lossy, s = _run(tmp_path, "lossy", "network_params={compute_ms=1, drop=0.2}")
    assert s["lost_messages"] > 0 and s["status"] == "completed"
    header = plain[0].split(",")
    at = header.index("consensus_distance")
    assert plain[1].split(",")[at] != lossy[1].split(",")[at]  # the consensus distance differs
    _, again, s2 = _run(tmp_path, "again", "network_params={compute_ms=1, drop=0.2}")
    def no_wall(rows):
        i = header.index("wall_seconds")
        return [r.split(",")[:i] + r.split(",")[i + 1:] for r in rows]

    assert no_wall(again) == no_wall(lossy) and s2["lost_messages"] == s["lost_messages"]  # the seed decides


def test_target_accuracy_reports_the_first_evaluation_reaching_it(tmp_path):
    out, rows, s = _run(tmp_path, "t", "network=edge", "network_params={compute_ms=1}", "target_accuracy=0.5",
                        "eval_every=1")
    header = rows[0].split(",")
    first = next(dict(zip(header, r.split(","))) for r in rows[1:]
                 if float(dict(zip(header, r.split(",")))["test_accuracy"]) >= 0.5)
    assert s["steps_to_target"] == int(first["step"])
    assert s["sim_seconds_to_target"] == pytest.approx(float(first["sim_seconds"]))
    _, _, never = _run(tmp_path, "never", "target_accuracy=1.0", "epochs=0.2")
    assert never["steps_to_target"] is None and never["sim_seconds_to_target"] is None


@pytest.mark.parametrize("overrides,pattern", [
    (["network=lna"], r"network 'lna' is unknown; did you mean 'lan'\?"),
    (["network_params={bandwith_mbps=5}"], r"network_params key 'bandwith_mbps' is unknown; did you mean"),
    (["network_params={bandwidth_mbps=-1}"], r"network_params.bandwidth_mbps = -1 is out of range"),
    (["network_params={drop=1}"], r"network_params.drop = 1 is out of range"),
    (["network_params={latency_ms='x'}"], r"network_params.latency_ms must be a number, got 'x'"),
    (["network_params={agents_per_host=0}"], r"agents_per_host must be an integer >= 1, got 0"),
    (["network_params={drop=0.1}", "algorithm=choco"], r"algorithm 'choco' cannot lose messages"),
    (["network_params={drop=0.1}", "algorithm=msgd"], r"algorithm 'msgd' cannot lose messages \(it does not gossip"),
    (["network_params={link_failure=0.1}", "executor=torch"], r"simulated with every agent in one process"),
])
def test_bad_networks_are_refused_in_one_line(overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        validate_config(load_config(overrides=overrides))
    assert "\n" not in str(e.value)


def test_checkpoint_resume_continues_the_clock(tmp_path):
    shards = [(torch.randn(32, 3), torch.randint(0, 2, (32,))) for _ in range(4)]
    W = ring_like("ring", 4)
    net = spec(bandwidth_mbps=1, latency_ms=1, compute_ms=1, stragglers=0.25, drop=0.1)

    def make():
        return Executor.build(lambda: torch.nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=8, network=net)

    a = make()
    rows = a.run(steps=7, eval_every_steps=3)
    saved = a.state_dict()
    rows += a.run(steps=6, eval_every_steps=3)
    b = make()
    b.load_state_dict(torch.load(_save(tmp_path, saved), weights_only=True))
    again = b.run(steps=6, eval_every_steps=3)
    assert [r["sim_seconds"] for r in again] == [r["sim_seconds"] for r in rows[-len(again):]]
    assert torch.equal(a.X, b.X)
    with pytest.raises(ValueError, match="simulated network"):
        Executor.build(lambda: torch.nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=8).load_state_dict(saved)


def _save(tmp_path, state):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path
