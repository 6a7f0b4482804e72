"""Sequence tasks that learn (issue 17): per-series z-normalisation, subsampling, and a short run above chance.

The normalisation tests recompute each series' statistics here from the
padded tensor, over its real length only (the mask), and compare the
subsampled series with block means computed by hand.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from cdsgd.data import load_dataset, read_ts, sequence_lengths
from cdsgd.data import sequences as S

needs_sktime = pytest.mark.skipif(importlib.util.find_spec("sktime") is None,
                                  reason="needs the 'sequences' extra (sktime)")

OPTS = {"n_train": 80, "n_test": 40, "mean_length": 30.0, "max_length": 120, "channels": 2}


def _check_series_normalised(x: torch.Tensor) -> None:
    """Every series: mean 0 and population std 1 per channel over its real steps; padding all zero."""
    lengths = sequence_lengths(x)
    for i, n in enumerate(lengths.tolist()):
        real = x[i, :n, 1:].double()
        if n > 1:
            torch.testing.assert_close(real.mean(0), torch.zeros(real.shape[1], dtype=torch.float64), atol=1e-5, rtol=0)
            torch.testing.assert_close(real.std(0, unbiased=False), torch.ones(real.shape[1], dtype=torch.float64),
                                       atol=1e-4, rtol=0)
        assert torch.equal(x[i, :n, 0], torch.ones(n)) and not x[i, n:].any()  # mask intact, padding untouched


def test_synthetic_seq_series_are_z_normalised():
    ds = load_dataset("synthetic_seq", **OPTS)
    for x in (ds.train[0], ds.test[0]):
        _check_series_normalised(x)


def test_series_normalisation_is_an_affine_map_of_the_split_normalised_series():
    """Same generated data: each "series" sequence is (v − mean(v)) / std(v) of its "split" sequence v."""
    a = load_dataset("synthetic_seq", **OPTS)
    b = load_dataset("synthetic_seq", **OPTS, normalize="split")
    assert torch.equal(sequence_lengths(a.train[0]), sequence_lengths(b.train[0]))
    for i in (0, 7, 79):
        n = int(sequence_lengths(b.train[0])[i])
        v = b.train[0][i, :n, 1:].double()
        expected = (v - v.mean(0)) / v.std(0, unbiased=False)
        torch.testing.assert_close(a.train[0][i, :n, 1:].double(), expected, atol=1e-5, rtol=1e-5)


def test_constant_series_are_centred_not_blown_up():
    seqs = [np.full((4, 1), 3.0), np.array([[1.0], [3.0]])]
    ds = S._sequence_dataset("t", (seqs, ["a", "b"]), (seqs[:1], ["a"]), normalize="series")
    assert ds.train[0][:, :, 1].tolist() == [[0.0] * 4, [-1.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="normalize must be one of series, split; got 'z'"):
        S._sequence_dataset("t", (seqs, ["a", "b"]), (seqs[:1], ["a"]), normalize="z")


def test_subsample_takes_block_means():
    s = np.arange(10.0).reshape(-1, 1) ** 2  # 0, 1, 4, …, 81
    expected = [(0 + 1 + 4 + 9) / 4, (16 + 25 + 36 + 49) / 4, (64 + 81) / 2]
    assert S._subsample(s, 4)[:, 0].tolist() == expected
    assert S._subsample(s, 1)[:, 0].tolist() == s[:, 0].tolist()


@needs_sktime
def test_plaid_series_normalised_and_subsampled():
    ds = load_dataset("plaid")  # subsample = 4 by default
    assert ds.input_shape == (336, 2)  # ⌈1344 / 4⌉
    raw, _ = read_ts(S._sktime_files("plaid", "PLAID")[0])
    lengths = sequence_lengths(ds.train[0])
    assert lengths.tolist() == [-(-len(r) // 4) for r in raw]
    full = load_dataset("plaid", subsample=1)
    assert full.input_shape == (1344, 2) and sequence_lengths(full.train[0]).tolist() == [len(r) for r in raw]
    _check_series_normalised(full.train[0][:50])
    _check_series_normalised(ds.train[0])
    _check_series_normalised(ds.test[0])
    i = 5
    v = np.array([raw[i][t: t + 4, 0].mean() for t in range(0, len(raw[i]), 4)])
    np.testing.assert_allclose(ds.train[0][i, : len(v), 1].double().numpy(), (v - v.mean()) / v.std(), atol=1e-5)
    with pytest.raises(ValueError, match="plaid: subsample must be an integer ≥ 1, got 0"):
        load_dataset("plaid", subsample=0)


@needs_sktime
def test_japanese_vowels_keeps_the_split_statistics():
    x = load_dataset("japanese_vowels").train[0]
    n = sequence_lengths(x)
    means = torch.stack([x[i, : n[i], 1:].mean(0) for i in range(len(n))])
    assert means.abs().max() > 0.5  # series keep their levels (they tell speakers apart)
    flat = torch.cat([x[i, : n[i], 1:] for i in range(len(n))]).double()
    torch.testing.assert_close(flat.mean(0), torch.zeros(12, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.slow  # a study of tens of seconds in one process: the whole suite runs it, the fast tier does not
def test_a_short_synthetic_seq_run_learns_far_above_chance():
    """CDMSGD, 4 agents on a ring, GRU (hidden 32), grad_clip 1: 150 steps on 400 short sequences.

    Chance is 0.25 (4 balanced classes). Measured here: test accuracy 0.949, average model 0.965
    (without clipping: 0.744); asserted with a wide margin, ≥ 0.6.
    """
    import topologies

    from cdsgd.models import build_model
    from cdsgd.executor import Simulator

    torch.set_num_threads(1)  # the result below was measured so; the test fixture restores the count
    ds = load_dataset("synthetic_seq", n_train=400, n_test=200, mean_length=40.0, max_length=80)
    x, y = ds.train
    shards = [(x[j::4], y[j::4]) for j in range(4)]
    W = topologies.mixing_matrix(topologies.build("ring", 4))
    sim = Simulator(lambda: build_model("gru", ds.input_shape, 4, hidden=32), shards, W, "cdmsgd", lr=0.3,
                    momentum=0.9, batch_size=16, grad_clip=1.0, test_set=ds.test)
    for _ in range(150):
        sim.step()
    row = sim.evaluate()
    assert row["test_accuracy"] >= 0.6 and row["test_accuracy_avg_model"] >= 0.6, row
