"""cdsgd.data.sequences: the .ts reader, padding with a mask channel, and the sequence data sets.

The .ts files in the reader tests are written by the tests themselves and
the expected arrays are typed out by hand. plaid and japanese_vowels read the
files inside the installed sktime (the ``sequences`` extra); their tests are
skipped when it is absent. sktime itself is never imported.
"""

from __future__ import annotations

import doctest
import importlib.machinery
import importlib.util
import math
import re

import numpy as np
import pytest
import torch

from cdsgd.data import DATASETS, load_dataset, pad_sequences, read_ts, sequence_lengths
from cdsgd.data import sequences as S

HAS_SKTIME = importlib.util.find_spec("sktime") is not None
needs_sktime = pytest.mark.skipif(not HAS_SKTIME, reason="needs the 'sequences' extra (sktime)")


def _write(tmp_path, text, name="x.ts", encoding="utf-8"):
    path = tmp_path / name
    path.write_text(text, encoding=encoding)
    return path


# --------------------------------------------------------------------------- #
# read_ts
# --------------------------------------------------------------------------- #

UNIVARIATE = """\
# a comment
#another one

@problemName Toy
@timeStamps false
@missing false
@univariate true
@equalLength false
@classLabel true neg pos
@data
1,2,3:pos
-0.5, 4e1 :neg

7:pos
"""

MULTIVARIATE = """\
@problemName Toy2
@univariate false
@dimensions 2
@equalLength false
@classLabel true 1 2 10
@data
1,2:3,4:10
5,6,7:8,9,10:2
0.25:-1:1
"""


def test_read_ts_univariate_variable_length(tmp_path):
    seqs, labels = read_ts(_write(tmp_path, UNIVARIATE, encoding="utf-8-sig"))  # with a byte-order mark
    assert labels == ["pos", "neg", "pos"]
    expected = [[[1.0], [2.0], [3.0]], [[-0.5], [40.0]], [[7.0]]]
    assert [s.dtype for s in seqs] == [np.float64] * 3
    assert [s.tolist() for s in seqs] == expected


def test_read_ts_multivariate_variable_length(tmp_path):
    seqs, labels = read_ts(str(_write(tmp_path, MULTIVARIATE)))  # a str path works too
    assert labels == ["10", "2", "1"]
    assert [s.tolist() for s in seqs] == [[[1.0, 3.0], [2.0, 4.0]],
                                          [[5.0, 8.0], [6.0, 9.0], [7.0, 10.0]],
                                          [[0.25, -1.0]]]


HEAD = "@problemName Bad\n@univariate false\n@classLabel true a b\n@data\n"  # data starts on line 5

MALFORMED = [
    # (file text, line named, message regex)
    ("@problemName Bad\n@classLabel true a b\n1,2:a\n", 3, r"data before the @data line"),
    ("@problemName Bad\n@classLabel true a b\n\n", 3, r"end of file without a @data line"),
    ("", 0, r"end of file without a @data line"),
    (HEAD, 4, r"no cases after @data"),
    (HEAD + "1,2:3,4:a\n1,2,3:4,5:a\n", 6, r"dimensions of unequal lengths \[3, 2\]"),
    (HEAD + "1,2:a\n1,x,3:b\n", 6, r"non-numeric value 'x' in dimension 0"),
    (HEAD + "1,2:a\n1,2:c\n", 6, r"class label 'c' is not declared in @classLabel \(a b\)"),
    (HEAD + "1,?,3:a\n", 5, r"missing value '\?' in dimension 0; missing values are not supported"),
    (HEAD + "1,2:3,4:a\n1,2:b\n", 6, r"1 dimensions; expected 2"),
    (HEAD + "1,2:a\n:b\n", 6, r"dimension 0 is empty"),
    (HEAD + "1,2:a\n1,inf:b\n", 6, r"non-finite value 'inf' in dimension 0"),
    (HEAD + "1,2:a\n1,2\n", 6, r"expected the dimensions and a class label separated by ':'"),
    (HEAD + "1,2:a\n@missing false\n", 6, r"header @missing after @data"),
    ("@univariate true\n@dimensions 3\n", 2, r"@dimensions 3 contradicts @univariate true"),
    ("@dimensions 2\n@classLabel true a\n@data\n1:2:3:a\n", 4, r"3 dimensions; expected 2"),
    ("@univariate true\n@classLabel true a\n@data\n1:2:a\n", 4, r"2 dimensions; expected 1"),
    ("@dimensions two\n", 1, r"@dimensions must be followed by an integer ≥ 1, got 'two'"),
    ("@timeStamps true\n", 1, r"@timeStamps true is not supported"),
    ("@missing maybe\n", 1, r"@missing must be followed by true or false, got 'maybe'"),
    ("@classLabel false\n@data\n", 1, r"@classLabel false: only classification files are supported"),
    ("@classLabel true\n", 1, r"@classLabel true declares no labels"),
    ("@targetLabel true\n", 1, r"@targetLabel \(regression\) is not supported"),
    ("@univariate true\n@data\n1:a\n", 2, r"@data before any @classLabel true line"),
    ("@colour blue\n", 1, r"unknown header @colour; known: @problemName"),
    ("@equalLength true\n@classLabel true a\n@data\n1,2:a\n1,2,3:a\n", 5,
     r"length 3 differs from the first case's 2 under @equalLength true"),
]


@pytest.mark.parametrize("text, line, message", MALFORMED)
def test_read_ts_refuses_malformed_files(tmp_path, text, line, message):
    path = _write(tmp_path, text, name="bad.ts")
    with pytest.raises(ValueError) as info:
        read_ts(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}, line {line}: "), msg
    assert re.search(message, msg), msg


# --------------------------------------------------------------------------- #
# pad_sequences and sequence_lengths
# --------------------------------------------------------------------------- #


def test_pad_sequences_round_trip():
    seqs = [np.array([[1.0, 10.0], [2.0, 20.0]]), np.array([[3.0, 30.0]]),
            np.array([[4.0, 40.0], [5.0, 50.0], [6.0, 60.0]])]
    x = pad_sequences(seqs)
    assert x.dtype == torch.float32 and tuple(x.shape) == (3, 3, 3)
    assert x.tolist() == [
        [[1, 1, 10], [1, 2, 20], [0, 0, 0]],
        [[1, 3, 30], [0, 0, 0], [0, 0, 0]],
        [[1, 4, 40], [1, 5, 50], [1, 6, 60]],
    ]
    lengths = sequence_lengths(x)
    assert lengths.dtype == torch.int64 and lengths.tolist() == [2, 1, 3]
    back = [x[i, :n, 1:].double().numpy() for i, n in enumerate(lengths.tolist())]
    assert all(np.array_equal(a, b) for a, b in zip(back, seqs))

    wide = pad_sequences(seqs, length=5)
    assert tuple(wide.shape) == (3, 5, 3) and torch.equal(wide[:, :3], x) and not wide[:, 3:].any()
    assert sequence_lengths(wide).tolist() == [2, 1, 3]


@pytest.mark.parametrize("call, message", [
    (lambda: pad_sequences([]), r"got no sequences"),
    (lambda: pad_sequences([np.ones(3)]), r"sequence 0 must be 2-D \(length, channels\), got shape \(3,\)"),
    (lambda: pad_sequences([np.ones((2, 1)), np.ones((0, 1))]), r"sequence 1 has length 0; allowed lengths ≥ 1"),
    (lambda: pad_sequences([np.ones((2, 1)), np.ones((2, 2))]), r"sequence 1 has 2 channels; sequence 0 has 1"),
    (lambda: pad_sequences([np.ones((4, 1))], length=3), r"length must be an integer ≥ the longest sequence \(4\), got 3"),
    (lambda: sequence_lengths(torch.zeros(2, 3)), r"needs a tensor of shape \(n, L, 1 \+ C\), got \(2, 3\)"),
    (lambda: sequence_lengths(np.zeros((2, 3, 1))), r"got ndarray"),
])
def test_pad_and_lengths_refuse_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_class_order_is_numeric_for_numbers():
    assert S._class_order(["10", "2", "1", "2"]) == ["1", "2", "10"]
    assert S._class_order(["b", "10", "a"]) == ["10", "a", "b"]


def test_module_docstring_examples():
    result = doctest.testmod(S, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------- #
# The contract every sequence data set keeps
# --------------------------------------------------------------------------- #


def _check_contract(ds, n_channels):
    """Mask left-aligned, zeros after it, features normalised on train's valid steps."""
    assert ds.input_shape[1] == 1 + n_channels
    for x, y in (ds.train, ds.test):
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        lengths = sequence_lengths(x)
        steps = torch.arange(x.shape[1])
        assert torch.equal(x[:, :, 0], (steps[None, :] < lengths[:, None]).float())
        assert not x[x[:, :, 0] == 0].any()  # padding: every channel exactly 0
        assert lengths.min() >= 1 and lengths.max() <= ds.input_shape[0]
    assert int(max(sequence_lengths(ds.train[0]).max(), sequence_lengths(ds.test[0]).max())) == ds.input_shape[0]
    x = ds.train[0]
    valid = x[x[:, :, 0] == 1][:, 1:].double()
    assert torch.allclose(valid.mean(0), torch.zeros(n_channels, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(valid.std(0, unbiased=False), torch.ones(n_channels, dtype=torch.float64), atol=1e-4)


def _length_range(x):
    lengths = sequence_lengths(x)
    return int(lengths.min()), int(lengths.max())


# --------------------------------------------------------------------------- #
# plaid and japanese_vowels
# --------------------------------------------------------------------------- #


@needs_sktime
def test_plaid():
    ds = load_dataset("plaid", normalize="split", subsample=1)  # the archive's series, the split's statistics
    assert repr(ds) == "Dataset(name='plaid', train=537, test=537, n_classes=11, input_shape=(1344, 2))"
    _check_contract(ds, 1)
    assert _length_range(ds.train[0]) == (100, 1344)
    assert _length_range(ds.test[0]) == (134, 1000)
    assert ds.train[1].bincount().tolist() == [33, 88, 57, 19, 78, 18, 57, 86, 69, 19, 13]
    assert ds.test[1].bincount().tolist() == [33, 87, 58, 19, 78, 17, 57, 86, 70, 19, 13]
    # labels "0".."10" map numerically ("10" → 10, not 2), and the features are
    # the raw values shifted and scaled with the training split's statistics
    train_file, _ = S._sktime_files("plaid", "PLAID")
    raw, labels = read_ts(train_file)
    assert ds.train[1].tolist() == [int(s) for s in labels]
    flat = np.concatenate(raw)
    mean, std = flat.mean(), flat.std()
    for i in (0, 100, 536):
        got = ds.train[0][i, : len(raw[i]), 1].double().numpy()
        np.testing.assert_allclose(got, (raw[i][:, 0] - mean) / std, rtol=1e-5, atol=1e-5)


@needs_sktime
def test_plaid_options_come_from_the_config():
    """dataset_params reach the loader: the same tensors as load_dataset with those options."""
    from cdsgd.config import load_config
    from cdsgd.run.plan import load_config_dataset

    ds = load_config_dataset(load_config(overrides=["dataset=plaid", "dataset_params={subsample = 1, "
                                                                      "normalize = \"split\"}"]))
    ref = load_dataset("plaid", normalize="split", subsample=1)
    assert ds.input_shape == (1344, 2) and torch.equal(ds.train[0], ref.train[0])


@needs_sktime
def test_japanese_vowels():
    ds = load_dataset("japanese_vowels")
    assert repr(ds) == "Dataset(name='japanese_vowels', train=270, test=370, n_classes=9, input_shape=(29, 13))"
    _check_contract(ds, 12)
    assert _length_range(ds.train[0]) == (7, 26)
    assert _length_range(ds.test[0]) == (7, 29)
    assert ds.train[1].bincount().tolist() == [30] * 9
    assert ds.test[1].bincount().tolist() == [31, 35, 88, 44, 29, 24, 40, 50, 29]
    _, test_file = S._sktime_files("japanese_vowels", "JapaneseVowels")
    assert ds.test[1].tolist() == [int(s) - 1 for s in read_ts(test_file)[1]]


@pytest.mark.parametrize("name", ["plaid", "japanese_vowels"])
def test_missing_extra_is_a_clear_error(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sktime" else real(n, *a))
    expected = (f"data set {name!r} needs the optional extra: pip install 'cdsgd[sequences]' "
                "(the files ship inside the sktime package)")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        load_dataset(name)


def test_sktime_without_the_files(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("sktime", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: spec)
    with pytest.raises(FileNotFoundError, match=r"data set 'plaid': the installed sktime lacks PLAID_TRAIN\.ts"):
        load_dataset("plaid")


# --------------------------------------------------------------------------- #
# synthetic_seq
# --------------------------------------------------------------------------- #


def test_synthetic_seq_defaults_and_contract():
    ds = load_dataset("synthetic_seq")
    assert (len(ds.train[1]), len(ds.test[1]), ds.n_classes) == (2000, 500, 4)
    _check_contract(ds, 1)
    assert ds.train[1].bincount().tolist() == [500] * 4 and ds.test[1].bincount().tolist() == [125] * 4


def test_synthetic_seq_determinism():
    opts = {"n_train": 60, "n_test": 20, "mean_length": 30.0, "max_length": 200}
    a, b = load_dataset("synthetic_seq", seed=5, **opts), load_dataset("synthetic_seq", seed=5, **opts)
    c = load_dataset("synthetic_seq", seed=6, **opts)
    for (xa, ya), (xb, yb) in ((a.train, b.train), (a.test, b.test)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.input_shape != c.input_shape or not torch.equal(a.train[0], c.train[0])
    assert not torch.equal(sequence_lengths(a.train[0]), sequence_lengths(c.train[0]))


def test_synthetic_seq_lengths():
    ds = load_dataset("synthetic_seq", n_train=20000, n_test=10, mean_length=60.0, length_spread=0.5)
    lengths = sequence_lengths(ds.train[0]).double()
    assert abs(lengths.mean().item() / 60.0 - 1) < 0.03
    # the spread: log-lengths have standard deviation ≈ σ
    assert abs(lengths.log().std().item() - 0.5) < 0.03
    clipped = load_dataset("synthetic_seq", n_train=2000, n_test=200, mean_length=100.0, length_spread=1.0,
                           min_length=40, max_length=150)
    for x in (clipped.train[0], clipped.test[0]):
        low, high = _length_range(x)
        assert 40 <= low and high <= 150
    assert _length_range(clipped.train[0]) == (40, 150)  # σ = 1 reaches both clips in 2,000 draws
    fixed = load_dataset("synthetic_seq", n_train=30, n_test=10, mean_length=12.0, length_spread=0.0)
    assert set(sequence_lengths(fixed.train[0]).tolist()) == {12} and fixed.input_shape == (12, 2)


def test_synthetic_seq_options():
    ds = load_dataset("synthetic_seq", n_train=70, n_test=13, n_classes=7, channels=3, mean_length=20.0)
    assert (len(ds.train[1]), len(ds.test[1]), ds.n_classes, ds.input_shape[1]) == (70, 13, 7, 4)
    assert set(ds.train[1].tolist()) == set(range(7)) and set(ds.test[1].tolist()) == set(range(7))
    _check_contract(ds, 3)


def test_synthetic_seq_class_is_in_the_frequency_not_the_first_step():
    """A periodogram reads the class off the whole sequence; the first step says nothing."""
    ds = load_dataset("synthetic_seq", n_train=400, n_test=200, seed=1)
    x, y = ds.test
    lengths = sequence_lengths(x)
    freqs = 0.02 + 0.16 * np.arange(4) / 3
    grid = np.linspace(0.0, 0.5, 501)
    hits = 0
    for i in range(len(y)):
        s = x[i, : lengths[i], 1].double().numpy()
        power = np.abs(np.exp(-2j * math.pi * np.outer(grid, np.arange(len(s)))) @ (s - s.mean())) ** 2
        hits += int(np.abs(freqs - grid[power.argmax()]).argmin() == y[i])
    assert hits / len(y) > 0.95
    # first step: per-class means within noise of each other
    first = ds.train[0][:, 0, 1]
    means = torch.stack([first[ds.train[1] == k].mean() for k in range(4)])
    assert (means.max() - means.min()).item() < 0.4


@pytest.mark.parametrize("options, message", [
    ({"n_train": 0}, r"synthetic_seq: n_train must be an integer ≥ 1, got 0"),
    ({"n_classes": 1}, r"n_classes must be an integer ≥ 2, got 1"),
    ({"channels": 1.5}, r"channels must be an integer ≥ 1, got 1\.5"),
    ({"min_length": 0}, r"min_length must be an integer ≥ 1, got 0"),
    ({"min_length": 50, "max_length": 40}, r"max_length must be an integer ≥ 50, got 40"),
    ({"mean_length": -1.0}, r"mean_length must be a finite number > 0\.0, got -1\.0"),
    ({"mean_length": 2000.0}, r"mean_length must lie in \[min_length, max_length\] = \[5, 1000\], got 2000\.0"),
    ({"length_spread": float("nan")}, r"length_spread must be a finite number ≥ 0\.0, got nan"),
    ({"noise": -0.1}, r"noise must be a finite number ≥ 0\.0, got -0\.1"),
    ({"seed": True}, r"seed must be an integer ≥ 0, got True"),
    ({"n_clases": 3}, (r"data set 'synthetic_seq' has no option 'n_clases'; "
     r"did you mean 'n_classes'\? allowed: n_train, n_test, n_classes, "
                       r"channels, mean_length, length_spread, min_length, max_length, noise, seed")),
])
def test_synthetic_seq_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        load_dataset("synthetic_seq", **options)


def test_registered_names():
    names = DATASETS.names()
    assert {"plaid", "japanese_vowels", "synthetic_seq"} <= set(names)
    with pytest.raises(ValueError, match=r"data set 'japanese_vowel' is unknown; did you mean 'japanese_vowels'\?"):
        load_dataset("japanese_vowel")
    with pytest.raises(ValueError, match=r"data set 'plaid' has no option 'seed'; allowed: normalize, subsample"):
        load_dataset("plaid", seed=1)
    assert S.__all__ == ["pad_sequences", "read_ts", "sequence_lengths"]
