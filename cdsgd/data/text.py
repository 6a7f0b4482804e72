"""Byte-level text data sets: a document split, windows of T + 1 bytes, the bigram floor.

From a :class:`~cdsgd.data.corpora.Corpus` (documents as bytes, each from a
source), :func:`text_dataset` builds a token :class:`~cdsgd.data.records.Dataset`:

1. **Split by document** (:func:`split_documents`): ⌈f·n⌉ of the n
   documents (f = ``val_fraction``) go to validation, k_s of source s's n_s,
   in proportion to n_s (:func:`validation_counts`), drawn by a seeded
   permutation; the rest, at least one per source, to training. No
   validation byte is in any training window.
2. **Streams**: per split and per source, the source's documents of that
   split in corpus order, each followed by the corpus's separator, are
   concatenated into one byte stream s (tokens = bytes, vocabulary 256).
3. **Windows** (:func:`byte_windows`): stride T, length T + 1: window i is
   input ``x = s[iT : iT + T]`` and target ``y = s[iT + 1 : iT + T + 1]``,
   for i < ⌊(|s| − 1)/T⌋, so every byte of s but the first is a target
   exactly once (the last < T bytes of a stream are dropped). Windows never
   cross sources or splits.

The data set's ``groups`` hold the source of each training window (what
:func:`~cdsgd.data.partition.partition` splits by: ``iid`` over windows,
``dirichlet`` and ``classes`` over sources), ``bytes_per_token`` is 1.0.

===============  ==============  ==========  ==========================================
name             input shape     vocabulary  source
===============  ==============  ==========  ==========================================
``fortunes``     (context,)      256         Debian's ``fortunes``: 15,000 fortunes in 43
                                             categories, 2.6 MB of English (BSD licence)
``python_code``  (context,)      256         the standard library's ``.py`` files, one
                                             source per top-level package
===============  ==============  ==========  ==========================================

Options of both: ``context=128`` (T), ``val_fraction=0.1``, ``seed=0``
(document choice and split), ``max_bytes=4_000_000`` (see
:mod:`cdsgd.data.corpora`).

>>> x, y = byte_windows(b"abcdefg", 3)
>>> x.tolist(), y.tolist()
([[97, 98, 99], [100, 101, 102]], [[98, 99, 100], [101, 102, 103]])
>>> from cdsgd.data.corpora import Corpus
>>> corpus = Corpus("toy", (b"one two", b"three", b"four five", b"six"), (0, 0, 1, 1), ("a", "b"), b"\\n")
>>> split_documents(corpus, val_fraction=0.5, seed=0).tolist()    # validation: one document of each source
[False, True, True, False]
>>> ds = text_dataset(corpus, context=2, val_fraction=0.5)
>>> ds.input_shape, ds.n_classes, ds.group_names, ds.bytes_per_token
((2,), 256, ('a', 'b'), 1.0)
>>> round(bigram_loss(ds), 3) > 0
True
"""

from __future__ import annotations


import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from ..base.checks import Bounds, check_int
from ..base.seeding import derive_seed
from .corpora import MAX_BYTES, Corpus, read_corpus
from .records import DATASETS, Dataset

__all__ = ["CONTEXT", "VAL_FRACTION", "bigram_loss", "byte_divergence", "byte_windows", "split_documents",
           "text_dataset", "validation_counts"]

#: the default window length T (tokens of context)
CONTEXT = 128
#: the default share of each source's documents held out for validation
VAL_FRACTION = 0.1
_VAL_BOUNDS = Bounds(low=0, high=1, low_open=True, high_open=True)
_VOCABULARY = 256


def split_documents(corpus: Corpus, *, val_fraction: float = VAL_FRACTION, seed: int = 0) -> np.ndarray:
    """Which documents are validation ones: a bool array, one per document (see the module docstring, step 1).

    k_s comes from :func:`validation_counts`; with ``rng =
    numpy.random.default_rng(derive_seed(seed, "text split", corpus.name))``,
    source by source in id order, the first k_s documents of
    ``rng.permutation`` of the source's documents are validation ones.
    """
    val_fraction = _VAL_BOUNDS.check(f"{corpus.name}: val_fraction", val_fraction)
    rng = np.random.default_rng(derive_seed(check_int("seed", seed, 0, what=f"{corpus.name}: "),
                                            "text split", corpus.name))
    sources = np.asarray(corpus.sources, dtype=np.int64)
    counts = np.bincount(sources, minlength=len(corpus.source_names))
    is_val = np.zeros(len(sources), dtype=bool)
    for s, k in enumerate(validation_counts(counts, val_fraction).tolist()):
        is_val[rng.permutation(np.flatnonzero(sources == s))[:k]] = True
    return is_val


def validation_counts(counts, val_fraction: float) -> np.ndarray:
    """How many of each source's documents go to validation: k_s ≤ n_s − 1, Σ k_s = min(⌈f·n⌉, n − S).

    n = Σ n_s documents in S sources, f = ``val_fraction``. The K = min(⌈f·n⌉,
    n − S) validation documents are apportioned to the sources in proportion
    to n_s by largest remainder (exact integer arithmetic; ties to the lower
    id), with each source keeping one document in training (k_s ≤ n_s − 1);
    what a capped source cannot take goes on to the others, again by largest
    remainder. So small sources still give their share of the validation set.

    >>> validation_counts([20, 2, 1], 0.1).tolist(), validation_counts([20, 2, 1], 0.5).tolist()
    ([3, 0, 0], [11, 1, 0])
    """
    counts = np.asarray(counts, dtype=np.int64)
    n, cap = int(counts.sum()), counts - 1
    # f as the decimal it was written as: ⌈0.1 · 30⌉ is 3, though 0.1 * 30 is 3.0000000000000004 in floats
    total = min(math.ceil(Fraction(repr(float(val_fraction))) * n), int(cap.sum()))
    share, remainder = np.divmod(counts * total, n)
    k = np.minimum(share, cap)
    while k.sum() < total:  # each pass gives one more document to as many uncapped sources as still needed
        open_ = np.flatnonzero(k < cap)
        order = open_[np.argsort(-remainder[open_], kind="stable")][:total - int(k.sum())]
        k[order] += 1
    return k


def byte_windows(data: bytes, context: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-byte targets, int64 (n, T) each, n = ⌊(len(data) − 1)/T⌋ (module docstring, step 3)."""
    context = check_int("context", context, 1)
    s = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    n = max(0, (len(s) - 1) // context)
    return s[:n * context].reshape(n, context), s[1:n * context + 1].reshape(n, context)


def _split_windows(corpus: Corpus, docs: np.ndarray, context: int) -> tuple[Tensor, Tensor, Tensor]:
    """The windows of the documents ``docs`` (indices, in order), source by source, and each one's source."""
    xs, ys, groups = [], [], []
    sources = np.asarray(corpus.sources, dtype=np.int64)[docs]
    for s in range(len(corpus.source_names)):
        stream = b"".join(corpus.documents[i] + corpus.separator for i in docs[sources == s].tolist())
        x, y = byte_windows(stream, context)
        xs.append(x)
        ys.append(y)
        groups.append(torch.full((len(x),), s, dtype=torch.int64))
    return torch.cat(xs), torch.cat(ys), torch.cat(groups)


def text_dataset(corpus: Corpus, *, context: int = CONTEXT, val_fraction: float = VAL_FRACTION,
                 seed: int = 0) -> Dataset:
    """The byte-level data set of ``corpus``: documents split by :func:`split_documents`, then windows.

    Train and test are ``(x, y)`` int64 of shape (n, context) with ``y`` the
    next byte of each ``x`` position; ``groups`` the source of each training
    window, ``group_names`` the corpus's source names, ``n_classes`` 256,
    ``bytes_per_token`` 1.0. A split without any window is a ValueError.
    """
    context = check_int("context", context, 1, what=f"{corpus.name}: ")
    is_val = split_documents(corpus, val_fraction=val_fraction, seed=seed)
    train_x, train_y, groups = _split_windows(corpus, np.flatnonzero(~is_val), context)
    test_x, test_y, _ = _split_windows(corpus, np.flatnonzero(is_val), context)
    for split, x, docs in (("training", train_x, ~is_val), ("validation", test_x, is_val)):
        if len(x) == 0:
            raise ValueError(f"{corpus.name}: the {split} split ({int(docs.sum())} documents) holds no window of "
                             f"context={context} + 1 bytes; lower context, or change val_fraction={val_fraction} "
                             "or max_bytes")
    return Dataset(corpus.name, (train_x, train_y), (test_x, test_y), _VOCABULARY, (context,),
                   groups=groups, group_names=corpus.source_names, bytes_per_token=1.0)


def _load_text(name: str, context: int, val_fraction: float, seed: int, max_bytes: int | None) -> Dataset:
    context = check_int("context", context, 1, what=f"{name}: ")  # the options first: a bad one fails at once
    _VAL_BOUNDS.check(f"{name}: val_fraction", val_fraction)
    corpus = read_corpus(name, max_bytes=max_bytes, seed=seed)
    return text_dataset(corpus, context=context, val_fraction=val_fraction, seed=seed)


@DATASETS.register("fortunes")
def _load_fortunes(data_dir, download: bool, *, context: int = CONTEXT, val_fraction: float = VAL_FRACTION,
                   seed: int = 0, max_bytes: int | None = MAX_BYTES) -> Dataset:
    """Debian's fortunes, byte-level (:mod:`cdsgd.data.corpora`); ``data_dir`` and ``download`` are unused."""
    return _load_text("fortunes", context, val_fraction, seed, max_bytes)


@DATASETS.register("python_code")
def _load_python_code(data_dir, download: bool, *, context: int = CONTEXT, val_fraction: float = VAL_FRACTION,
                      seed: int = 0, max_bytes: int | None = MAX_BYTES) -> Dataset:
    """The standard library's sources, byte-level (:mod:`cdsgd.data.corpora`); ``data_dir``, ``download`` unused."""
    return _load_text("python_code", context, val_fraction, seed, max_bytes)


# --------------------------------------------------------------------------- #
# What a text data set holds: the bigram floor, the agents' byte distributions
# --------------------------------------------------------------------------- #


def _tokens(dataset: Dataset, what: str) -> None:
    x, y = dataset.train
    if x.dtype != torch.int64 or x.shape != y.shape:
        raise ValueError(f"{what} needs a token data set (int64 inputs and labels of one shape, e.g. fortunes, "
                         f"python_code); {dataset.name!r} has {x.dtype} inputs {tuple(x.shape)} and labels "
                         f"{tuple(y.shape)}")


def bigram_loss(dataset: Dataset) -> float:
    """Validation loss, in nats per token, of the add-one bigram model of the training windows.

    With V = ``n_classes`` (256 for bytes), c(a, b) the number of positions
    t of the training windows where x_t = a and y_t = b, and c(a) = Σ_b c(a, b):

        p(b | a) = (c(a, b) + 1) / (c(a) + V)

    (Laplace smoothing), and the result is −(1/M) Σ log p(y_t | x_t) over the
    M positions of the validation windows: the floor a language model must
    beat to have learned more than which byte follows which.
    """
    _tokens(dataset, "bigram_loss")
    v = dataset.n_classes
    (xt, yt), (xv, yv) = dataset.train, dataset.test
    counts = torch.bincount((xt * v + yt).flatten(), minlength=v * v).reshape(v, v).double()
    log_p = torch.log(counts + 1) - torch.log(counts.sum(1, keepdim=True) + v)
    val = torch.bincount((xv * v + yv).flatten(), minlength=v * v).reshape(v, v).double()
    if val.sum() == 0:
        raise ValueError(f"bigram_loss: data set {dataset.name!r} has no validation position")
    return float(-(val * log_p).sum() / val.sum())


def _js_bits(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen–Shannon divergence of two distributions, in bits (0 log 0 = 0)."""
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:  # KL(a ‖ m); m > 0 wherever a > 0
        on = a > 0
        return float(np.sum(a[on] * np.log2(a[on] / m[on])))

    return 0.5 * kl(p) + 0.5 * kl(q)


def byte_divergence(dataset: Dataset, shards) -> np.ndarray:
    """Each agent's Jensen–Shannon divergence, in bits, between its token histogram and the training set's.

    ``shards`` are index arrays into the training windows (as
    :func:`~cdsgd.data.partition.partition` returns). With P_j the
    distribution of the input tokens of agent j's windows and Q that of all
    training windows, ``out[j] = JS(P_j, Q) = ½ KL(P_j ‖ M) + ½ KL(Q ‖ M)``,
    M = (P_j + Q)/2, logarithms base 2: 0 for the same distribution, at most 1.
    NaN for an agent without windows.

    >>> x = torch.tensor([[0, 0], [1, 1]])
    >>> ds = Dataset("toy", (x, x), (x, x), 256, (2,))
    >>> byte_divergence(ds, [np.array([0]), np.array([0, 1])]).round(4).tolist()
    [0.3113, 0.0]
    """
    _tokens(dataset, "byte_divergence")
    x, v = dataset.train[0], dataset.n_classes
    whole = torch.bincount(x.flatten(), minlength=v).double().numpy()
    q = whole / whole.sum()
    out = []
    for idx in shards:
        h = torch.bincount(x[torch.as_tensor(np.asarray(idx, dtype=np.int64))].flatten(), minlength=v)
        h = h.double().numpy()
        out.append(_js_bits(h / h.sum(), q) if h.sum() else float("nan"))
    return np.asarray(out)
