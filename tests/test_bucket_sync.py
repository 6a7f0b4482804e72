"""bucket_sync: every agent takes its batch from the same length bucket at each step (issue 17).

The expected values are computed here from the definitions (bucket sizes counted
by hand, the shared order drawn straight from its seeded generator), not read
back from the stream.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from cdsgd.cli import main
from cdsgd.config import load_config
from cdsgd.data import sequence_lengths
from cdsgd.data.bucketing import (
    BucketStream,
    SyncBucketStream,
    bucket_boundaries,
    bucket_of,
    padded_fraction,
    sync_steps_per_bucket,
)
from cdsgd.run.experiment import prepare, run_experiment
from cdsgd.base.seeding import generator
from cdsgd.executor import Simulator

SEQ = ["dataset=synthetic_seq", "model=gru", "model_params={hidden = 8}", "n_agents=4", "batch_size=16",
       "train_subset=320", "test_subset=64", "bucketing=4", "lr=0.1", "momentum=0.9"]


def bucket_counts(lengths, bounds):
    """How many lengths fall in each bucket (b_{i−1}, b_i], counted from the definition."""
    edges = [0, *bounds]
    return [sum(1 for x in lengths if edges[i] < x <= edges[i + 1]) for i in range(len(bounds))]


def shared_order(seed, m, p):
    """Pass p's bucket sequence from the definition: bucket i m_i times, permuted by generator(seed, "buckets", p)."""
    multiset = [i for i, c in enumerate(m) for _ in range(c)]
    perm = torch.randperm(len(multiset), generator=generator(seed, "buckets", p)).tolist()
    return [multiset[t] for t in perm]


def make_streams(per_agent, bounds, batch_size, seed=3):
    counts = [bucket_counts(ln, bounds) for ln in per_agent]
    m = [math.ceil(sum(c[i] for c in counts) / (len(per_agent) * batch_size)) for i in range(len(bounds))]
    assert sync_steps_per_bucket(counts, batch_size) == m
    streams = [SyncBucketStream(ln, batch_size, bounds, generator(seed, j, "data"), steps_per_bucket=m, seed=seed)
               for j, ln in enumerate(per_agent)]
    return streams, m, counts


def equal_parts(n_agents=3, seed=0):
    """Agents whose shards hold the same number of sequences of every bucket (other lengths, other order)."""
    rng = np.random.default_rng(seed)
    spans = [(1, 10), (11, 25), (26, 49)]
    sizes = [13, 7, 20]  # per agent and bucket
    return [rng.permutation(np.concatenate([rng.integers(lo, hi + 1, size=s) for (lo, hi), s in zip(spans, sizes)]))
            for _ in range(n_agents)], [10, 25, 49]


def test_same_seed_same_batches_and_every_agent_the_same_bucket():
    per_agent, bounds = equal_parts()
    a, m, _ = make_streams(per_agent, bounds, 4)
    b, _, _ = make_streams(per_agent, bounds, 4)
    buckets = [bucket_of(ln, bounds) for ln in per_agent]
    M = sum(m)
    for p in range(3):
        want = shared_order(3, m, p)
        for t in range(M):
            batches = [s.next() for s in a]
            for x, s in zip(batches, b):
                assert torch.equal(x, s.next())  # built again from the same seed: the same batches
            for j, x in enumerate(batches):
                assert set(buckets[j][x.numpy()]) == {want[t]}, (p, t, j)


def test_equal_parts_a_pass_covers_every_sample_of_every_shard_once():
    per_agent, bounds = equal_parts()
    streams, m, counts = make_streams(per_agent, bounds, 4)
    assert m == [math.ceil(13 / 4), math.ceil(7 / 4), math.ceil(20 / 4)] and streams[0].batches_per_epoch == sum(m)
    for _ in range(3):
        for j, s in enumerate(streams):
            seen = torch.cat([s.next() for _ in range(sum(m))]).tolist()
            assert sorted(seen) == list(range(len(per_agent[j])))


def test_uneven_parts_every_part_in_rounds_and_empty_parts_draw_below():
    """The guarantee for uneven parts: every ⌈n_ji / B⌉ consecutive draws of agent j's part of bucket i, from a
    round's start, hold each of its sequences once; an agent without bucket i draws from its nearest bucket below
    (else above)."""
    bounds, B = [10, 25, 49], 4
    per_agent = [[3] * 9 + [20] * 2 + [40] * 14,   # all three buckets, uneven
                 [5] * 30 + [45] * 3,              # nothing in bucket 1: draws from bucket 0 instead
                 [30] * 6 + [48] * 5]              # nothing below bucket 2: draws from bucket 2
    streams, m, counts = make_streams(per_agent, bounds, B)
    assert counts == [[9, 2, 14], [30, 0, 3], [0, 0, 11]]
    assert m == [math.ceil(39 / 12), math.ceil(2 / 12), math.ceil(28 / 12)] == [4, 1, 3]
    source = [{0: 0, 1: 1, 2: 2}, {0: 0, 1: 0, 2: 2}, {0: 2, 1: 2, 2: 2}]
    draws = [{i: [] for i in range(3)} for _ in per_agent]
    order = [i for p in range(12) for i in shared_order(3, m, p)]
    for want in order:
        for j, s in enumerate(streams):
            x = s.next()
            assert s.bucket == want
            k = source[j][want]
            assert set(bucket_of(per_agent[j], bounds)[x.numpy()]) == {k}
            draws[j][k].append(x.tolist())
    for j, ln in enumerate(per_agent):
        for k, batches in draws[j].items():
            part = [t for t, b in enumerate(bucket_of(ln, bounds)) if b == k]
            if not part:
                assert not batches
                continue
            c = math.ceil(len(part) / B)
            full = len(batches) // c * c
            assert full >= 2 * c  # at least two rounds seen
            for r in range(0, full, c):
                rnd = batches[r:r + c]
                assert sorted(sum(rnd, [])) == part and all(len(x) == B for x in rnd[:-1])


def test_bucket_frequencies_follow_the_bucket_sizes():
    bounds, B = [10, 25, 49], 2
    per_agent = [[3] * 12 + [20] * 6 + [40] * 2, [4] * 10 + [22] * 4 + [41] * 6]
    streams, m, counts = make_streams(per_agent, bounds, B)
    N = [22, 10, 8]
    assert [a + b for a, b in zip(*counts)] == N and m == [math.ceil(n / 4) for n in N] == [6, 3, 2]
    M, passes = sum(m), 300
    seen = Counter()
    first = Counter()
    for _ in range(passes):
        for t in range(M):
            streams[0].next()
            seen[streams[0].bucket] += 1
            if t == 0:
                first[streams[0].bucket] += 1
    # exactly m_i per pass, and m_i / M within one step's share of the size weights N_i / N
    assert [seen[i] for i in range(3)] == [passes * c for c in m]
    assert all(abs(m[i] / M - N[i] / sum(N)) <= 1 / M for i in range(3))
    # the order within a pass is random: even the first step of a pass follows the weights (4 standard deviations)
    for i in range(3):
        q = m[i] / M
        assert abs(first[i] - passes * q) <= 4 * math.sqrt(passes * q * (1 - q)), (i, first)


def test_state_dict_mid_pass_continues_identically():
    bounds, B = [10, 25, 49], 4
    per_agent = [[3] * 9 + [20] * 2 + [40] * 14, [5] * 30 + [45] * 3]
    a, m, _ = make_streams(per_agent, bounds, B)
    for _ in range(sum(m) + 3):  # into the second pass, some parts mid-round
        for s in a:
            s.next()
    saved = []
    for s in a:
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        buf.seek(0)
        saved.append(torch.load(buf, weights_only=True))
    b, _, _ = make_streams(per_agent, bounds, B, seed=3)
    for s, st in zip(b, saved):
        s.next()  # moved on elsewhere: loading puts it back
        s.load_state_dict(st)
    for _ in range(3 * sum(m)):
        for x, y in zip(a, b):
            assert torch.equal(x.next(), y.next()) and x.bucket == y.bucket
    with pytest.raises(ValueError, match="not of a bucket_sync stream"):
        b[0].load_state_dict(BucketStream(per_agent[0], B, bounds, torch.Generator()).state_dict())
    with pytest.raises(ValueError, match="bucket_sync stream state is for 33 samples"):
        b[0].load_state_dict(b[1].state_dict())


def test_default_leaves_the_per_agent_streams_bit_identical():
    """bucket_sync=false (the default) builds what bucketing built before: each agent's BucketStream on its own
    boundaries, and the mean pass as the epoch."""
    assert load_config().bucket_sync is False
    cfg = load_config(overrides=SEQ)
    parts = prepare(cfg)
    lengths = [sequence_lengths(x).numpy() for x, _ in parts.shards]
    own = [bucket_boundaries(ln, 4, "optimal") for ln in lengths]
    assert parts.bucket_boundaries == own and len({tuple(b) for b in own}) > 1
    per_pass = [sum(math.ceil(c / 16) for c in bucket_counts(ln, b) if c) for ln, b in zip(lengths, own)]
    assert parts.steps_per_epoch == math.ceil(sum(per_pass) / 4)
    for j, ln in enumerate(lengths):
        new = parts.batch_stream(j, generator(cfg.seed, j, "data"))
        old = BucketStream(ln, 16, own[j], generator(cfg.seed, j, "data"))
        assert type(new) is BucketStream
        for _ in range(2 * old.batches_per_epoch):
            assert torch.equal(new.next(), old.next())


def test_sync_plan_common_boundaries_over_all_shards():
    cfg = load_config(overrides=[*SEQ, "bucket_sync=true", "bucket_rule=quantile"])
    parts = prepare(cfg)
    lengths = [sequence_lengths(x).numpy() for x, _ in parts.shards]
    common = bucket_boundaries(np.concatenate(lengths), 4, "quantile")
    assert parts.bucket_boundaries == [common] * 4
    N = bucket_counts(np.concatenate(lengths).tolist(), common)
    assert parts.steps_per_epoch == sum(math.ceil(n / (4 * 16)) for n in N)


def _recorded(parts, cfg, steps):
    """Run the simulator ``steps`` steps; every agent's batch at every step, as index tensors."""
    sim = Simulator(parts.model_fn, parts.shards, parts.W, "cdmsgd", batch_size=16, lr=0.1, seed=cfg.seed,
                    batch_stream=parts.batch_stream, steps_per_epoch=parts.steps_per_epoch)
    log = [[] for _ in sim.streams]
    for j, s in enumerate(sim.streams):
        def take(s=s, out=log[j]):
            out.append(s.__class__.next(s))
            return out[-1]
        s.next = take
    for _ in range(steps):
        sim.step()
    return log


def test_simulator_padding_per_step_all_agents_in_one_bucket():
    steps = 6
    per_step = {}
    for sync in ("false", "true"):
        cfg = load_config(overrides=[*SEQ, f"bucket_sync={sync}"])
        parts = prepare(cfg)
        lengths = [sequence_lengths(x).numpy() for x, _ in parts.shards]
        log = _recorded(parts, cfg, steps)
        assert all(len(batches) == steps for batches in log)
        common = bucket_boundaries(np.concatenate(lengths), 4, "optimal")
        edges = [0, *common]
        ranges = []
        for t in range(steps):
            tops = [int(lengths[j][log[j][t].numpy()].max()) for j in range(4)]
            ranges.append({next(i for i in range(4) if edges[i] < x <= edges[i + 1]) for x in tops})
        per_step[sync] = ranges
        if sync == "true":
            # one bucket per step, and no padding beyond it: each batch's sequences lie in that bucket's range
            for t in range(steps):
                (i,) = ranges[t]
                for j in range(4):
                    batch = lengths[j][log[j][t].numpy()]
                    assert (batch > edges[i]).all() and (batch <= edges[i + 1]).all()
                    frac = padded_fraction(lengths[j], [log[j][t]])
                    assert frac <= 1 - (edges[i] + 1) / edges[i + 1]
    # without sync the agents' batches fall in different common buckets at some step
    assert any(len(r) > 1 for r in per_step["false"])


def test_cli_run_with_bucket_sync_completes_and_resumes_bit_for_bit(tmp_path, monkeypatch, interrupt_at):
    base = [*SEQ, "bucket_sync=true", "epochs=1", "checkpoint_every=2", "checkpoint_unit=steps", "save_params=true"]
    ref = tmp_path / "ref"
    assert main(["run", *base, f"out={ref}", "--no-progress"]) == 0
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["steps_per_epoch"] == prepare(load_config(overrides=base)).steps_per_epoch > 5
    out = tmp_path / "run"
    interrupt_at(5)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(overrides=[*base, f"out={out}"]), progress=False, log=lambda m: None)
    monkeypatch.undo()
    resumed = run_experiment(load_config(overrides=[*base, f"out={out}", "resume=true"]), progress=False,
                             log=lambda m: None)
    assert resumed["resumed_from_step"] == 4
    assert torch.equal(torch.load(out / "params.pt"), torch.load(ref / "params.pt"))


def test_runtime_with_bucket_sync_agrees_with_the_simulator(tmp_path):
    """Both executors build the same streams: 2 gloo ranks end where the simulator ends."""
    from test_runtime_run import run_pair

    common = ["dataset=synthetic_seq", "model=gru", "model_params={hidden = 8}", "n_agents=2", "topology=path",
              "batch_size=16", "train_subset=160", "test_subset=32", "bucketing=4", "bucket_sync=true", "epochs=1",
              "lr=0.1", "save_params=true"]
    sim, tor = run_pair(tmp_path, common, 2)
    torch.testing.assert_close(torch.load(tor / "params.pt"), torch.load(sim / "params.pt"), rtol=0, atol=1e-5)
