"""Sequence bucketing: optimal boundaries against brute force, samplers cover, streams resume."""

from __future__ import annotations

import io
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from cdsgd.data.bucketing import (
    BUCKET_RULES,
    BucketBatchSampler,
    BucketStream,
    bucket_boundaries,
    bucket_of,
    optimal_bucket_boundaries,
    padded_fraction,
    padding_cost,
    quantile_bucket_boundaries,
    uniform_bucket_boundaries,
)


def direct_cost(lengths, bounds):
    """Σ (smallest bound ≥ l) − l, straight from the definition."""
    return sum(min(b for b in bounds if b >= l) - l for l in lengths)


def brute_force_cost(lengths, n_buckets):
    """Least padding over every set of at most n_buckets observed lengths that contains the maximum."""
    values = sorted(set(lengths))
    # pair[a][b]: padding of the bucket (values[a], values[b]] (a = -1: from 0), computed directly
    pair = {(a, b): sum(values[b] - l for l in lengths if (a < 0 or l > values[a]) and l <= values[b])
            for b in range(len(values)) for a in range(-1, b)}
    last = len(values) - 1
    best = None
    for k in range(min(n_buckets, len(values))):
        for inner in itertools.combinations(range(last), k):
            idx = (-1, *inner, last)
            cost = sum(pair[idx[t], idx[t + 1]] for t in range(len(idx) - 1))
            best = cost if best is None else min(best, cost)
    return best


def assert_valid_bounds(lengths, bounds, n_buckets):
    assert all(isinstance(b, int) for b in bounds)
    assert bounds == sorted(set(bounds)) and 1 <= len(bounds) <= max(1, n_buckets)
    assert set(bounds) <= {int(x) for x in lengths} and bounds[-1] == max(lengths)


# --------------------------------------------------------------------------
# boundaries


def test_optimal_equals_brute_force_on_random_cases():
    rng = np.random.default_rng(0)
    for case in range(200):
        n = int(rng.integers(1, 22))
        lengths = rng.integers(1, 31, size=n).tolist()
        K = int(rng.integers(1, 6))
        bounds = optimal_bucket_boundaries(lengths, K)
        assert_valid_bounds(lengths, bounds, K)
        expected = brute_force_cost(lengths, K)
        assert direct_cost(lengths, bounds) == expected, (case, lengths, K, bounds)
        assert padding_cost(lengths, bounds) == expected
        assert len(bounds) == min(K, len(set(lengths)))
        assert optimal_bucket_boundaries(lengths, K) == bounds  # deterministic


def test_optimal_small_block_matches_one_block(monkeypatch):
    """The row-block loop gives the same answer when the blocks are tiny."""
    from cdsgd.data import bucketing

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 200, size=500)
    whole = optimal_bucket_boundaries(lengths, 6)
    monkeypatch.setattr(bucketing, "_BLOCK", 7)
    assert optimal_bucket_boundaries(lengths, 6) == whole


def test_more_buckets_than_distinct_lengths():
    lengths = [5, 3, 5, 9, 3]
    assert optimal_bucket_boundaries(lengths, 10) == [3, 5, 9]
    assert padding_cost(lengths, [3, 5, 9]) == 0
    assert bucket_boundaries(lengths, 10, "quantile") == [3, 5, 9]
    # equal widths: edges 3 + 6·k/10 are all above 3, so the shortest length gets no bound of its own
    assert bucket_boundaries(lengths, 10, "uniform") == [5, 9]


def test_single_length_and_one_bucket():
    assert optimal_bucket_boundaries([7], 3) == [7]
    assert optimal_bucket_boundaries([4, 4, 4], 2) == [4]
    for rule in BUCKET_RULES:
        assert bucket_boundaries([2, 9, 4], 0, rule) == [9]
        assert bucket_boundaries([2, 9, 4], 1, rule) == [9]
    assert optimal_bucket_boundaries([2, 9, 4], 1) == [9]


def test_accepts_arrays_tensors_and_integral_floats():
    assert optimal_bucket_boundaries(np.array([1, 2, 8], dtype=np.int32), 2) == [2, 8]
    assert optimal_bucket_boundaries(torch.tensor([1, 2, 8]), 2) == [2, 8]
    assert optimal_bucket_boundaries([1.0, 2.0, 8.0], 2) == [2, 8]


@pytest.mark.parametrize("call, match", [
    (lambda: optimal_bucket_boundaries([], 2), "lengths is empty"),
    (lambda: optimal_bucket_boundaries([3, 0, 2], 2), r"lengths\[1\] = 0 is not positive"),
    (lambda: optimal_bucket_boundaries([3, -4], 2), r"lengths\[1\] = -4 is not positive"),
    (lambda: optimal_bucket_boundaries([3, 2.5], 2), r"lengths\[1\] = 2\.5 is not an integer"),
    (lambda: optimal_bucket_boundaries([3, float("nan")], 2), r"lengths\[1\] = nan is not an integer"),
    (lambda: optimal_bucket_boundaries(["3"], 2), "dtype <U1"),
    (lambda: optimal_bucket_boundaries([True, False], 2), "dtype bool"),
    (lambda: optimal_bucket_boundaries([[1, 2]], 2), r"shape \(1, 2\)"),
    (lambda: optimal_bucket_boundaries([1, 2], 0), "n_buckets must be an integer >= 1, got 0"),
    (lambda: optimal_bucket_boundaries([1, 2], 2.0), "n_buckets must be an integer >= 1, got 2.0"),
    (lambda: quantile_bucket_boundaries([], 2), "lengths is empty"),
    (lambda: uniform_bucket_boundaries([1, 0], 2), r"lengths\[1\] = 0"),
    (lambda: bucket_boundaries([1, 2], -1), "n_buckets must be an integer >= 0, got -1"),
    (lambda: bucket_boundaries([1, 2], 2, "optimum"), "bucketing rule 'optimum' is unknown; did you mean 'optimal'"),
    (lambda: bucket_boundaries([1, 2], 2, "xyz"), "Known: optimal, quantile, uniform"),
    (lambda: bucket_of([1, 9], [3, 8]), r"lengths\[1\] = 9 exceeds the last bucket bound 8"),
    (lambda: bucket_of([1, 2], [3, 3]), r"boundaries\[0\] = 3 >= boundaries\[1\] = 3"),
    (lambda: bucket_of([1, 2], []), "boundaries is empty"),
    (lambda: padding_cost([1, 2], [0, 3]), r"boundaries\[0\] = 0 is not positive"),
    (lambda: padded_fraction([1, 2], [[0, 2]]), r"batches\[0\] holds \[0, 2\]"),
    (lambda: padded_fraction([1, 2], [[]]), "no index"),
    (lambda: BucketBatchSampler([1, 2], 0, [2]), "batch_size must be an integer >= 1, got 0"),
    (lambda: BucketBatchSampler([1, 2], 1, [2]).set_epoch(-1), "epoch must be an integer >= 0, got -1"),
    (lambda: BucketStream([1, 5], 1, [4], torch.Generator()), r"lengths\[1\] = 5 exceeds"),
])
def test_bad_inputs_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_quantile_and_uniform_valid_and_never_beat_optimal():
    rng = np.random.default_rng(2)
    for _ in range(100):
        lengths = rng.integers(1, int(rng.integers(2, 60)), size=int(rng.integers(1, 80))).tolist()
        K = int(rng.integers(1, 9))
        best = padding_cost(lengths, optimal_bucket_boundaries(lengths, K))
        for fn in (quantile_bucket_boundaries, uniform_bucket_boundaries):
            bounds = fn(lengths, K)
            assert_valid_bounds(lengths, bounds, K)
            assert padding_cost(lengths, bounds) >= best


def test_quantile_and_uniform_hand_examples():
    assert quantile_bucket_boundaries([8, 1, 7, 2, 6, 3, 5, 4], 4) == [2, 4, 6, 8]
    assert quantile_bucket_boundaries([1, 1, 1, 9], 3) == [1, 9]
    # edges 1 + 19·k/2 = 10.5, 20 → rounded up to observed 11, 20
    assert uniform_bucket_boundaries([1, 2, 3, 10, 11, 20], 2) == [11, 20]
    # edges 1 + 9·k/3 = 4, 7, 10 → observed 5, 10, 10 → deduplicated
    assert uniform_bucket_boundaries([1, 5, 10], 3) == [5, 10]


def test_optimal_completes_on_1e5_lognormal_lengths():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(np.log(200), 1.0, 100_000)), 1, 2000).astype(np.int64)
    bounds = optimal_bucket_boundaries(lengths, 16)
    assert len(bounds) == 16 and bounds[-1] == lengths.max() and bounds == sorted(bounds)
    assert np.isin(bounds, lengths).all()
    cost = padding_cost(lengths, bounds)
    assert cost <= padding_cost(lengths, quantile_bucket_boundaries(lengths, 16))
    assert cost <= padding_cost(lengths, uniform_bucket_boundaries(lengths, 16))


# --------------------------------------------------------------------------
# measures


def test_bucket_of_and_padding_cost_by_hand():
    lengths = [1, 1, 2, 5, 5, 6, 9]
    assert bucket_of(lengths, [2, 9]).tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert bucket_of([3, 4, 8], [3, 8]).tolist() == [0, 1, 1]  # bounds are inclusive
    # (2−1)+(2−1)+(2−2) + (9−5)+(9−5)+(9−6)+(9−9) = 2 + 11
    assert padding_cost(lengths, [2, 9]) == 13
    # bounds need not be observed, and may leave a bucket empty
    assert padding_cost(lengths, [3, 4, 10]) == (2 + 2 + 1) + 0 + (5 + 5 + 4 + 1)
    assert padding_cost(lengths, [1, 2, 5, 6, 9]) == 0


def test_padded_fraction_by_hand():
    lengths = [1, 3, 2, 2, 4]
    # batch [0, 1]: max 3, 2·3 − 4 = 2 padded of 6; batch [2, 3]: none of 4; batch [4]: none of 4
    assert padded_fraction(lengths, [[0, 1], [2, 3], [4]]) == pytest.approx(2 / 14)
    assert padded_fraction(lengths, [torch.tensor([4, 0])]) == pytest.approx(3 / 8)
    assert padded_fraction(lengths, [[2, 3], []]) == 0.0


# --------------------------------------------------------------------------
# the sampler


def sample_lengths(n=203, seed=4):
    return np.random.default_rng(seed).integers(1, 50, size=n)


def assert_epoch_ok(lengths, bounds, batches, batch_size):
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    which = bucket_of(lengths, bounds)
    for b in batches:
        assert 1 <= len(b) <= batch_size and len({int(which[i]) for i in b}) == 1  # one bucket per batch
    # at most one partial batch per bucket
    partial = Counter(int(which[b[0]]) for b in batches if len(b) < batch_size)
    assert all(v == 1 for v in partial.values())


def test_sampler_covers_each_index_once_within_buckets():
    lengths = sample_lengths()
    bounds = optimal_bucket_boundaries(lengths, 4)
    s = BucketBatchSampler(lengths, 8, bounds, seed=1)
    sizes = np.bincount(bucket_of(lengths, bounds))
    assert len(s) == sum(-(-int(c) // 8) for c in sizes)
    for _ in range(3):
        batches = list(s)
        assert len(batches) == len(s)
        assert all(isinstance(i, int) for b in batches for i in b)
        assert_epoch_ok(lengths, bounds, batches, 8)
    assert s.epoch == 3


def test_sampler_deterministic_and_varies_with_epoch_and_seed():
    lengths = sample_lengths()
    bounds = [10, 25, 49]
    a = BucketBatchSampler(lengths, 8, bounds, seed=1)
    b = BucketBatchSampler(lengths, 8, bounds, seed=1)
    first_a, first_b = list(a), list(b)
    assert first_a == first_b
    second = list(a)  # iterating again moves on to epoch 1
    assert second != first_a
    a.set_epoch(0)
    assert list(a) == first_a  # set_epoch picks the epoch, like DistributedSampler
    a.set_epoch(1)
    assert list(a) == second == a.epoch_batches(1)
    assert list(BucketBatchSampler(lengths, 8, bounds, seed=2)) != first_a


def test_sampler_without_shuffle_is_bucket_order():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    s = BucketBatchSampler(lengths, 2, [2, 5, 9], shuffle=False)
    expected = [[1, 3], [6], [0, 2], [4], [5, 7]]
    assert list(s) == expected and list(s) == expected


def test_drop_last_drops_exactly_the_partial_batches():
    lengths = sample_lengths()
    bounds = [10, 25, 49]
    sizes = np.bincount(bucket_of(lengths, bounds))
    full = BucketBatchSampler(lengths, 8, bounds, seed=5)
    dropped = BucketBatchSampler(lengths, 8, bounds, seed=5, drop_last=True)
    assert len(dropped) == sum(int(c) // 8 for c in sizes)
    kept = list(dropped)
    assert len(kept) == len(dropped) and all(len(b) == 8 for b in kept)
    # the left-out indices are, per bucket, exactly the remainder c mod 8
    which = bucket_of(lengths, bounds)
    seen = np.zeros(len(lengths), dtype=int)
    for b in kept:
        seen[b] += 1
    assert seen.max() == 1
    missing = Counter(int(which[i]) for i in np.flatnonzero(seen == 0))
    assert dict(missing) == {k: int(c) % 8 for k, c in enumerate(sizes) if c % 8}
    assert sum(1 for b in list(full) if len(b) < 8) == sum(1 for c in sizes if c % 8)


def test_bucketing_cuts_padding():
    lengths = np.random.default_rng(6).integers(1, 200, size=2000)
    one = padded_fraction(lengths, list(BucketBatchSampler(lengths, 32, [int(lengths.max())])))
    eight = padded_fraction(lengths, list(BucketBatchSampler(lengths, 32, optimal_bucket_boundaries(lengths, 8))))
    assert eight < one / 3


# --------------------------------------------------------------------------
# the endless stream


def make_stream(seed=0, lengths=None, batch_size=7):
    lengths = sample_lengths() if lengths is None else lengths
    return BucketStream(lengths, batch_size, [10, 25, 49], torch.Generator().manual_seed(seed))


def test_stream_epochs_cover_and_stay_in_buckets():
    lengths = sample_lengths()
    s = make_stream(lengths=lengths)
    assert s.batches_per_epoch == len(BucketBatchSampler(lengths, 7, [10, 25, 49]))
    epochs = []
    for _ in range(3):
        batches = [s.next() for _ in range(s.batches_per_epoch)]
        assert all(b.dtype == torch.int64 for b in batches)
        assert_epoch_ok(lengths, [10, 25, 49], [b.tolist() for b in batches], 7)
        epochs.append([b.tolist() for b in batches])
    assert epochs[0] != epochs[1] != epochs[2]
    same, other = make_stream(seed=0), make_stream(seed=1)
    assert [same.next().tolist() for _ in range(s.batches_per_epoch)] == epochs[0]
    assert [other.next().tolist() for _ in range(s.batches_per_epoch)] != epochs[0]


@pytest.mark.parametrize("k", [0, 3, 29, 30, 31, 64])  # 30 batches per epoch: around an epoch's end
def test_stream_state_round_trip(k):
    s = make_stream(seed=3)
    assert s.batches_per_epoch == 30
    for _ in range(k):
        s.next()
    state = s.state_dict()
    ahead = [s.next().tolist() for _ in range(40)]

    fresh = make_stream(seed=99)
    fresh.load_state_dict(state)
    assert [fresh.next().tolist() for _ in range(40)] == ahead

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    again = make_stream(seed=7)
    again.load_state_dict(loaded)
    assert [again.next().tolist() for _ in range(40)] == ahead


def test_stream_state_is_plain():
    state = make_stream().state_dict()
    assert set(state) == {"order", "sizes", "pos", "gen"}
    assert all(isinstance(v, (torch.Tensor, int, list)) for v in state.values())


def test_stream_refuses_state_of_another_shard():
    other = make_stream(lengths=sample_lengths(n=150)).state_dict()
    with pytest.raises(ValueError, match="bucketed stream state is for 150 samples"):
        make_stream().load_state_dict(other)


# --------------------------------------------------------------------------
# fill (config bucket_fill): a bucket's partial batch carried into the next


def test_fill_without_shuffle_cuts_the_bucket_ordered_indices_into_full_batches():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]  # buckets by [2, 5, 9]: {1, 3, 6}, {0, 2, 4}, {5, 7}
    s = BucketBatchSampler(lengths, 2, [2, 5, 9], shuffle=False, fill=True)
    assert list(s) == [[1, 3], [6, 0], [2, 4], [5, 7]] and len(s) == 4
    lengths = sample_lengths()
    bounds = [10, 25, 49]
    order = np.argsort(bucket_of(lengths, bounds), kind="stable").tolist()
    filled = list(BucketBatchSampler(lengths, 8, bounds, shuffle=False, fill=True))
    assert filled == [order[i:i + 8] for i in range(0, len(order), 8)]


def test_fill_every_batch_full_but_the_last_each_index_once_and_few_mixed_batches():
    lengths = sample_lengths()  # 203 lengths: 25 full batches of 8 and one of 3
    bounds = optimal_bucket_boundaries(lengths, 8)
    which = bucket_of(lengths, bounds)
    s = BucketBatchSampler(lengths, 8, bounds, seed=1, fill=True)
    assert len(s) == 26
    for _ in range(3):
        batches = list(s)
        assert sorted(i for b in batches for i in b) == list(range(203))
        assert sorted(len(b) for b in batches) == [3] + [8] * 25
        spans = [sorted({int(which[i]) for i in b}) for b in batches]
        assert all(sp == list(range(sp[0], sp[-1] + 1)) for sp in spans)  # adjacent buckets only
        assert sum(len(sp) > 1 for sp in spans) <= len(bounds) - 1
    # the same seed shuffles each bucket as without fill: only the cut differs
    plain = BucketBatchSampler(lengths, 8, bounds, seed=1)
    assert list(plain) != s.epoch_batches(0)
    dropped = BucketBatchSampler(lengths, 8, bounds, seed=1, fill=True, drop_last=True)
    kept = list(dropped)
    assert len(dropped) == len(kept) == 25 and all(len(b) == 8 for b in kept)


def test_fill_pads_little_more_than_per_bucket_batches():
    lengths = np.random.default_rng(6).integers(1, 200, size=2000)
    one = padded_fraction(lengths, list(BucketBatchSampler(lengths, 32, [int(lengths.max())])))
    bounds = optimal_bucket_boundaries(lengths, 8)
    per_bucket = list(BucketBatchSampler(lengths, 32, bounds))
    filled = list(BucketBatchSampler(lengths, 32, bounds, fill=True))
    assert len(filled) == 63 < len(per_bucket)
    assert padded_fraction(lengths, filled) < one / 3


@pytest.mark.parametrize("k", [0, 28, 29, 30, 64])  # 29 batches per epoch
def test_fill_stream_epochs_cover_and_state_round_trips(k):
    lengths = sample_lengths()
    s = BucketStream(lengths, 7, [10, 25, 49], torch.Generator().manual_seed(3), fill=True)
    assert s.batches_per_epoch == 29  # ⌈203 / 7⌉
    epoch = [s.next().tolist() for _ in range(29)]
    assert sorted(i for b in epoch for i in b) == list(range(203)) and all(len(b) == 7 for b in epoch)
    for _ in range(k):
        s.next()
    state = s.state_dict()
    ahead = [s.next().tolist() for _ in range(40)]
    fresh = BucketStream(lengths, 7, [10, 25, 49], torch.Generator().manual_seed(99), fill=True)
    fresh.load_state_dict(state)
    assert [fresh.next().tolist() for _ in range(40)] == ahead
    with pytest.raises(ValueError, match="bucketed stream state"):
        make_stream().load_state_dict(state)  # per-bucket batches: 30 of them, not these 29
