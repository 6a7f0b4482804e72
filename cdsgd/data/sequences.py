"""Variable-length sequence data sets: padded tensors whose channel 0 is a mask.

A sequence data set is an ordinary :class:`~cdsgd.data.datasets.Dataset`
whose inputs are float32 tensors of shape (n, L_max, 1 + C):

- channel 0 is the **mask**: ``x[i, t, 0] = 1`` for the valid steps
  t < L_i of sequence i, ``0`` at the padding;
- channels 1..C are the features, valid steps first (left-aligned), zeros
  after them;
- ``input_shape = (L_max, 1 + C)`` and labels are int64 in 0..K−1.

Features are normalised per channel, ``x_c ← (x_c − m_c) / s_c`` (s_c the
population standard deviation, 1 for a constant channel), as the loaders'
option ``normalize`` says: ``"series"`` (z-normalisation, the time-series
habit; default of ``plaid`` and ``synthetic_seq``) over each sequence's own
steps; ``"split"`` (default of ``japanese_vowels``, whose channel levels tell
speakers apart) over the valid steps of the *training* split. Padding stays
exactly zero; a sequence's length is the mask's sum, :func:`sequence_lengths`.

===================  ==============  =======  ===========  ===============================
name                 input shape     classes  train/test   source
===================  ==============  =======  ===========  ===============================
``plaid``            (336, 2)        11       537 / 537    PLAID appliance currents,
                                                           lengths 100..1344 averaged
                                                           by 4 (``.ts`` in sktime)
``japanese_vowels``  (29, 13)        9        270 / 370    12 LPC cepstra, 9 speakers,
                                                           lengths 7..29 (``.ts`` files
                                                           inside sktime)
``synthetic_seq``    (L_max, 1 + C)  4        2000 / 500   generated noisy sinusoids with
                                                           log-normal lengths (options)
===================  ==============  =======  ===========  ===============================

``plaid`` and ``japanese_vowels`` read the UEA/sktime ``.ts`` files that ship
inside the installed ``sktime`` package (the ``sequences`` extra:
``pip install 'cdsgd[sequences]'``). The package is located with
``importlib.util.find_spec`` and never imported (its import is slow and
heavy). Class labels are mapped to 0..K−1 in sorted order (numerically when
every label is a number). See docs/data.md.

>>> x = pad_sequences([np.array([[1.0], [2.0]]), np.array([[3.0], [4.0], [5.0]])])
>>> tuple(x.shape), x.dtype
((2, 3, 2), torch.float32)
>>> x[0].tolist()
[[1.0, 1.0], [1.0, 2.0], [0.0, 0.0]]
>>> sequence_lengths(x).tolist()
[2, 3]
>>> from cdsgd.data import load_dataset
>>> ds = load_dataset("synthetic_seq", n_train=40, n_test=8, mean_length=20.0, max_length=60)
>>> ds.n_classes, ds.input_shape[1], ds.train[0].shape[1] == ds.input_shape[0]
(4, 2, True)
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .datasets import DATASETS, LOCATORS, Dataset

__all__ = ["pad_sequences", "read_ts", "sequence_lengths"]


# --------------------------------------------------------------------------- #
# Padding and lengths
# --------------------------------------------------------------------------- #


def pad_sequences(seqs: Sequence, length: int | None = None) -> Tensor:
    """Stack sequences of shape (L_i, C) into a float32 tensor (n, L, 1 + C).

    ``out[i, t, 0] = 1`` and ``out[i, t, 1:] = seqs[i][t]`` for t < L_i;
    every other entry is 0. L = max_i L_i, or ``length`` when given (it must
    be at least max_i L_i). Each sequence must be 2-D (use
    ``a.reshape(-1, 1)`` for a univariate one) with at least one step, and
    all must have the same number of channels C.
    """
    arrays = []
    for i, s in enumerate(seqs):
        a = np.asarray(s, dtype=np.float32)
        if a.ndim != 2:
            raise ValueError(f"pad_sequences: sequence {i} must be 2-D (length, channels), got shape {a.shape}")
        if a.shape[0] < 1:
            raise ValueError(f"pad_sequences: sequence {i} has length 0; allowed lengths ≥ 1")
        arrays.append(a)
    if not arrays:
        raise ValueError("pad_sequences: got no sequences; need at least one")
    c = arrays[0].shape[1]
    for i, a in enumerate(arrays):
        if a.shape[1] != c:
            raise ValueError(f"pad_sequences: sequence {i} has {a.shape[1]} channels; sequence 0 has {c}")
    longest = max(len(a) for a in arrays)
    if length is None:
        length = longest
    elif isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < longest:
        raise ValueError(f"pad_sequences: length must be an integer ≥ the longest sequence ({longest}), "
                         f"got {length!r}")
    out = np.zeros((len(arrays), int(length), 1 + c), dtype=np.float32)
    for i, a in enumerate(arrays):
        out[i, : len(a), 0] = 1.0
        out[i, : len(a), 1:] = a
    return torch.from_numpy(out)


def sequence_lengths(x: Tensor) -> Tensor:
    """The length of each padded sequence: ``x[:, :, 0].sum(1)`` as int64, shape (n,).

    ``x`` is (n, L, 1 + C) with the mask in channel 0 (see the module
    docstring); the mask is trusted, not checked.
    """
    if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] < 1:
        desc = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"sequence_lengths needs a tensor of shape (n, L, 1 + C), got {desc}")
    return x[:, :, 0].sum(dim=1).round().to(torch.int64)


# --------------------------------------------------------------------------- #
# The .ts format (UEA / sktime)
# --------------------------------------------------------------------------- #

_TS_BOOLEAN_TAGS = ("@timestamps", "@missing", "@univariate", "@equallength")
_TS_TAGS = ("@problemname", *_TS_BOOLEAN_TAGS, "@dimensions", "@serieslength", "@classlabel",
            "@targetlabel", "@data")


def read_ts(path: str | os.PathLike) -> tuple[list[np.ndarray], list[str]]:
    """Read a classification ``.ts`` file: (sequences (L_i, C) float64, labels as str).

    The format (UEA/UCR archive, sktime): lines starting with ``#`` are
    comments; header lines start with ``@`` (``@problemName``,
    ``@timeStamps``, ``@missing``, ``@univariate``, ``@dimensions``,
    ``@equalLength``, ``@seriesLength``, ``@classLabel true <labels…>``) and
    end with ``@data``, which is followed by one line per case: the C
    dimensions separated by ``:``, each a comma-separated list of numbers,
    then the class label, e.g. ``1,2,3:4,5,6:a`` is a case of length 3 with
    2 channels and label ``a``. All dimensions of a case have the same
    length; lengths may differ between cases unless ``@equalLength true``.

    Refused, with a one-line ValueError naming the file, the line and the
    problem: no ``@data`` line or no case after it; a header after
    ``@data`` or an unknown header; ``@timeStamps true`` (the ``(t,v)``
    form is not supported); no ``@classLabel true …`` (regression files);
    missing values ``?`` (not supported: nothing here imputes); non-numeric
    or non-finite values; an empty dimension; dimensions of unequal length
    within a case; a number of dimensions other than the header's
    (``@dimensions``, or 1 for ``@univariate true``) or than the first
    case's; a label not declared in ``@classLabel``; unequal lengths under
    ``@equalLength true``.
    """
    path = Path(path)

    def fail(lineno: int, problem: str) -> ValueError:
        return ValueError(f"{path}, line {lineno}: {problem}")

    head: dict = {}  # the header's values by lower-case tag (@dimensions: an int, @classlabel: the labels)
    cases, lineno = [], 0  # each case's (sequence, label); the line read last
    with open(path, encoding="utf-8-sig") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if line.startswith("@"):
                _ts_header(head, line, lineno, fail)
            elif line and not line.startswith("#"):
                cases.append(_ts_case(head, line, lineno, fail, len(cases[0][0]) if cases else None))
    if "@data" not in head:
        raise fail(lineno, "end of file without a @data line")
    if not cases:
        raise fail(lineno, "no cases after @data")
    return [seq for seq, _ in cases], [label for _, label in cases]


def _ts_header(head: dict, line: str, lineno: int, fail) -> None:
    """Take the header line ``line`` (``@…``) into ``head``, the header's values by lower-case tag."""
    tag, *args = line.split()
    key, given, truth = tag.lower(), " ".join(args), args[0].lower() if args else None
    if "@data" in head:
        raise fail(lineno, f"header {tag} after @data")
    if key not in _TS_TAGS:
        raise fail(lineno, f"unknown header {tag}; known: @problemName, @timeStamps, @missing, "
                           "@univariate, @dimensions, @equalLength, @seriesLength, @classLabel, @data")
    if key in _TS_BOOLEAN_TAGS:
        if len(args) != 1 or truth not in ("true", "false"):
            raise fail(lineno, f"{tag} must be followed by true or false, got {given!r}")
        head[key] = truth == "true"
        if key == "@timestamps" and head[key]:
            raise fail(lineno, "@timeStamps true is not supported; allowed: @timeStamps false")
        if key == "@univariate" and head[key]:
            if head.get("@dimensions") not in (None, 1):
                raise fail(lineno, f"@univariate true contradicts @dimensions {head['@dimensions']}")
            head["@dimensions"] = 1
    elif key == "@dimensions":
        if len(args) != 1 or not args[0].isdigit() or int(args[0]) < 1:
            raise fail(lineno, f"@dimensions must be followed by an integer ≥ 1, got {given!r}")
        if head.get("@univariate") and int(args[0]) != 1:
            raise fail(lineno, f"@dimensions {args[0]} contradicts @univariate true")
        head[key] = int(args[0])
    elif key == "@classlabel":
        if truth not in ("true", "false"):
            raise fail(lineno, f"@classLabel must be followed by true or false, got {given!r}")
        if truth == "false":
            raise fail(lineno, "@classLabel false: only classification files are supported")
        if len(args) < 2:
            raise fail(lineno, "@classLabel true declares no labels")
        head[key] = args[1:]
    elif key == "@targetlabel":
        raise fail(lineno, "@targetLabel (regression) is not supported; only classification files")
    elif key == "@data":
        if "@classlabel" not in head:
            raise fail(lineno, "@data before any @classLabel true line")
        head[key] = True  # (@problemName and @seriesLength carry nothing needed here)


def _ts_case(head: dict, line: str, lineno: int, fail, first: int | None) -> tuple[np.ndarray, str]:
    """A case line's sequence (L, C) and label, checked against the header and the ``first`` case's length."""
    if "@data" not in head:
        raise fail(lineno, "data before the @data line")
    *dims, label = line.split(":")
    label = label.strip()
    if not dims:
        raise fail(lineno, "expected the dimensions and a class label separated by ':'")
    n_dims = head.setdefault("@dimensions", len(dims))  # no header said: the first case decides
    if len(dims) != n_dims:
        raise fail(lineno, f"{len(dims)} dimensions; expected {n_dims}")
    if label not in (classes := head["@classlabel"]):
        raise fail(lineno, f"class label {label!r} is not declared in @classLabel ({' '.join(classes)})")
    columns = [_ts_values(text, d, lineno, fail) for d, text in enumerate(dims)]
    lengths = [len(c) for c in columns]
    if len(set(lengths)) > 1:
        raise fail(lineno, f"dimensions of unequal lengths {lengths}; all dimensions of a case "
                           "must have the same length")
    if head.get("@equallength") and first is not None and lengths[0] != first:
        raise fail(lineno, f"length {lengths[0]} differs from the first case's {first} under @equalLength true")
    return np.stack(columns, axis=1), label


def _ts_values(text: str, d: int, lineno: int, fail) -> np.ndarray:
    """One dimension of a case: comma-separated numbers as a float64 vector."""
    tokens = [t.strip() for t in text.split(",")]
    if tokens == [""]:
        raise fail(lineno, f"dimension {d} is empty")
    try:
        values = np.array(tokens, dtype=np.float64)
    except ValueError:
        bad = next(t for t in tokens if not _is_float(t))
        if bad == "?":
            raise fail(lineno, f"missing value '?' in dimension {d}; missing values are not supported") from None
        raise fail(lineno, f"non-numeric value {bad!r} in dimension {d}") from None
    if not np.isfinite(values).all():
        bad = tokens[int(np.flatnonzero(~np.isfinite(values))[0])]
        raise fail(lineno, f"non-finite value {bad!r} in dimension {d}; allowed: finite numbers")
    return values


def _is_float(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- #
# Building a Dataset from lists of sequences
# --------------------------------------------------------------------------- #


def _class_order(labels: Sequence[str]) -> list[str]:
    """Distinct labels, sorted numerically when all are numbers, else as strings."""
    distinct = set(labels)
    if all(_is_float(s) for s in distinct):
        return sorted(distinct, key=lambda s: (float(s), s))
    return sorted(distinct)


def _standardize(s: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return (s - mean) / np.where(std > 0, std, 1.0)  # a constant channel is centred, not blown up


def _subsample(s: np.ndarray, k: int) -> np.ndarray:
    """Means of consecutive blocks of k steps (the last block may be shorter): ⌈L/k⌉ steps."""
    return np.add.reduceat(s, np.arange(0, len(s), k), axis=0) / np.diff([*range(0, len(s), k), len(s)])[:, None]


def _sequence_dataset(name: str, train: tuple[list, Sequence], test: tuple[list, Sequence],
                      classes: Sequence | None = None, *, normalize: str = "split") -> Dataset:
    """Normalise (``"series"``: each on its own; ``"split"``: the training split's statistics), pad to one L_max."""
    (xtr, ytr), (xte, yte) = train, test
    if normalize not in ("series", "split"):
        raise ValueError(f"{name}: normalize must be one of series, split; got {normalize!r}")
    if normalize == "series":
        xtr, xte = ([_standardize(s, s.mean(axis=0), s.std(axis=0)) for s in xs] for xs in (xtr, xte))
    else:
        flat = np.concatenate(xtr, axis=0)
        mean, std = flat.mean(axis=0), flat.std(axis=0)
        xtr, xte = ([_standardize(s, mean, std) for s in xs] for xs in (xtr, xte))
    length = max(len(s) for s in (*xtr, *xte))
    if classes is None:
        classes = _class_order([*ytr, *yte])
    index = {c: k for k, c in enumerate(classes)}

    def labels(y: Sequence) -> Tensor:
        return torch.tensor([index[v] for v in y], dtype=torch.int64)

    return Dataset(name, (pad_sequences(xtr, length), labels(ytr)), (pad_sequences(xte, length), labels(yte)),
                   len(classes), (length, 1 + xtr[0].shape[1]))


# --------------------------------------------------------------------------- #
# plaid and japanese_vowels: .ts files inside the installed sktime
# --------------------------------------------------------------------------- #


def _sktime_files(name: str, problem: str) -> tuple[Path, Path]:
    """``<sktime>/datasets/data/<problem>/<problem>_{TRAIN,TEST}.ts``, without importing sktime."""
    spec = importlib.util.find_spec("sktime")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"data set {name!r} needs the optional extra: pip install 'cdsgd[sequences]' "
                         "(the files ship inside the sktime package)")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "datasets" / "data" / problem
        files = (folder / f"{problem}_TRAIN.ts", folder / f"{problem}_TEST.ts")
        if all(f.is_file() for f in files):
            return files
    raise FileNotFoundError(f"data set {name!r}: the installed sktime lacks {problem}_TRAIN.ts and "
                            f"{problem}_TEST.ts under {folder}; reinstall it: pip install 'cdsgd[sequences]'")


def _load_ts_pair(name: str, problem: str, normalize: str, subsample: int = 1) -> Dataset:
    subsample = _int_option("subsample", subsample, 1, name)
    train_file, test_file = _sktime_files(name, problem)
    (xtr, ytr), (xte, yte) = read_ts(train_file), read_ts(test_file)
    if subsample > 1:
        xtr, xte = ([_subsample(s, subsample) for s in xs] for xs in (xtr, xte))
    return _sequence_dataset(name, (xtr, ytr), (xte, yte), normalize=normalize)


LOCATORS.update({name: (lambda data_dir, n=name, p=problem: _sktime_files(n, p))  # what check_data looks for
                 for name, problem in (("plaid", "PLAID"), ("japanese_vowels", "JapaneseVowels"))})


@DATASETS.register("plaid")
def _load_plaid(data_dir: Path, download: bool, *, normalize: str = "series", subsample: int = 4) -> Dataset:
    """PLAID (Plug Load Appliance Identification Dataset, 2013): 11 appliance types.

    Univariate current signatures, 537 train / 537 test, lengths 100..1344;
    ``subsample = k`` (default 4; 1: the archive's series) replaces each block
    of k steps by its mean (⌈L/k⌉ steps, 25..336 at k = 4) before normalising.
    Read from sktime's bundled copy; ``data_dir``, ``download`` unused.
    """
    return _load_ts_pair("plaid", "PLAID", normalize, subsample)


@DATASETS.register("japanese_vowels")
def _load_japanese_vowels(data_dir: Path, download: bool, *, normalize: str = "split") -> Dataset:
    """Japanese Vowels (UCI; Kudo, Toyama and Shimbo 1999): 9 speakers.

    12 LPC cepstrum coefficients per frame, 270 train / 370 test, lengths
    7..29. Read from sktime's bundled copy; ``data_dir``, ``download`` unused.
    """
    return _load_ts_pair("japanese_vowels", "JapaneseVowels", normalize)


# --------------------------------------------------------------------------- #
# synthetic_seq
# --------------------------------------------------------------------------- #


def _int_option(name: str, value, minimum: int, dataset: str = "synthetic_seq") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{dataset}: {name} must be an integer ≥ {minimum}, got {value!r}")
    return int(value)


def _float_option(name: str, value, minimum: float, strict: bool) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and math.isfinite(value) and (value > minimum if strict else value >= minimum))
    if not ok:
        raise ValueError(f"synthetic_seq: {name} must be a finite number {'>' if strict else '≥'} {minimum}, "
                         f"got {value!r}")
    return float(value)


def _synthetic_frequencies(n_classes: int) -> np.ndarray:
    """Class k's frequency in cycles per step: 0.02 + 0.16·k/(K−1), from 0.02 to 0.18."""
    return 0.02 + 0.16 * np.arange(n_classes) / (n_classes - 1)


@DATASETS.register("synthetic_seq")
def _load_synthetic_seq(data_dir: Path, download: bool, *, n_train: int = 2000, n_test: int = 500,
                        n_classes: int = 4, channels: int = 1, mean_length: float = 100.0,
                        length_spread: float = 0.5, min_length: int = 5, max_length: int = 1000,
                        noise: float = 0.5, seed: int = 0, normalize: str = "series") -> Dataset:
    """Generated variable-length noisy sinusoids; the class is the frequency.

    With ``rng = numpy.random.default_rng(seed)``, for the training split and
    then the test split (n samples each):

    - labels: a random permutation of (0, 1, …, K−1, 0, 1, …) of length n,
      so every class has ⌊n/K⌋ or ⌈n/K⌉ samples;
    - lengths: L = clip(round(exp(N(μ, σ²))), min_length, max_length) with
      σ = length_spread and μ = ln(mean_length) − σ²/2, so that E[exp(N)]
      is mean_length (clipping and rounding shift it slightly);
    - per sequence and channel c, a phase φ_c ~ U[0, 2π) and an amplitude
      a_c ~ U[0.5, 1.5]; then for t = 0..L−1
      ``x[t, c] = a_c · sin(2π f_y t + φ_c) + noise · ε[t, c]``, ε ~ N(0, 1),
      with f_k = 0.02 + 0.16·k/(K−1) cycles per step.

    The random phase and amplitude make a single step uninformative about
    the class; the frequency is readable from the whole sequence (a
    periodogram peak, or an LSTM). Each sequence is then z-normalised
    (``normalize = "series"``; ``"split"``: the training split's statistics).
    """
    n_train = _int_option("n_train", n_train, 1)
    n_test = _int_option("n_test", n_test, 1)
    n_classes = _int_option("n_classes", n_classes, 2)
    channels = _int_option("channels", channels, 1)
    min_length = _int_option("min_length", min_length, 1)
    max_length = _int_option("max_length", max_length, min_length)
    mean_length = _float_option("mean_length", mean_length, 0.0, strict=True)
    if not min_length <= mean_length <= max_length:
        raise ValueError(f"synthetic_seq: mean_length must lie in [min_length, max_length] = "
                         f"[{min_length}, {max_length}], got {mean_length!r}")
    sigma = _float_option("length_spread", length_spread, 0.0, strict=False)
    noise = _float_option("noise", noise, 0.0, strict=False)
    seed = _int_option("seed", seed, 0)
    rng = np.random.default_rng(seed)
    freqs = _synthetic_frequencies(n_classes)
    mu = math.log(mean_length) - sigma**2 / 2

    def split(n: int) -> tuple[list[np.ndarray], np.ndarray]:
        y = rng.permutation(np.arange(n) % n_classes)
        lengths = np.clip(np.rint(rng.lognormal(mu, sigma, n)), min_length, max_length).astype(np.int64)
        phase = rng.uniform(0.0, 2 * math.pi, (n, channels))
        amp = rng.uniform(0.5, 1.5, (n, channels))
        eps = rng.standard_normal((int(lengths.sum()), channels))
        ends = np.cumsum(lengths)
        seqs = []
        for i in range(n):
            t = np.arange(lengths[i], dtype=np.float64)[:, None]
            signal = amp[i] * np.sin(2 * math.pi * freqs[y[i]] * t + phase[i])
            seqs.append(signal + noise * eps[ends[i] - lengths[i]: ends[i]])
        return seqs, y

    train = split(n_train)  # then the test split, from the same stream
    return _sequence_dataset("synthetic_seq", train, split(n_test), classes=range(n_classes), normalize=normalize)
