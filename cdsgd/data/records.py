"""The data set record, its registry and the entry point ``load_dataset``.

A :class:`Dataset` holds train and test tensors; :data:`DATASETS` maps each
name to its builder (the builders live in :mod:`cdsgd.data.datasets`,
:mod:`cdsgd.data.sequences` and :mod:`cdsgd.data.text`); :func:`load_dataset`
looks a name up and calls its builder. :data:`NORMALIZATION` holds the
per-channel constants with which the image builders normalise their inputs
(:func:`_normalize`).
"""

from __future__ import annotations

import difflib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from topologies import Registry

__all__ = ["DATASETS", "Dataset", "NORMALIZATION", "load_dataset"]


@dataclass(frozen=True, eq=False)  # eq=False: comparing tuples of tensors with == is ambiguous
class Dataset:
    """A data set held in memory as tensors: a classifier's, or a token sequence model's.

    ``train`` and ``test`` are ``(inputs, labels)``, checked on construction,
    of one of two kinds:

    - **classification**: inputs float32 of shape (n, *input_shape), already
      normalised; labels int64 of shape (n,) with values in 0..n_classes-1;
    - **tokens** (text): inputs int64 token ids of shape (n, T), with
      ``input_shape = (T,)``, and labels int64 of the same shape (the next
      token at each position); ids and labels lie in 0..n_classes-1, so
      n_classes is the vocabulary.

    Optional fields (their defaults leave a classification set as it was):
    ``groups``, int64 of shape (n_train,), the source (0..len(group_names)-1)
    of each training sample, named by ``group_names``; ``bytes_per_token``,
    how many bytes of text one token stands for (1.0 for byte-level text,
    None when the inputs are not text), with which the metrics turn nats per
    token into bits per byte. :attr:`partition_labels` is what partitions
    split by.

    >>> x = torch.tensor([[1, 2], [2, 3]])
    >>> ds = Dataset("toy", (x, x + 1), (x, x + 1), 5, (2,), groups=torch.tensor([0, 1]),
    ...              group_names=("a", "b"), bytes_per_token=1.0)
    >>> ds.partition_labels.tolist()
    [0, 1]
    """

    name: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    n_classes: int
    input_shape: tuple[int, ...]
    groups: Tensor | None = None
    group_names: tuple[str, ...] = ()
    bytes_per_token: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        object.__setattr__(self, "group_names", tuple(self.group_names))
        for split, (x, y) in (("train", self.train), ("test", self.test)):
            _check_split(f"data set {self.name!r}, {split} split", x, y, self.input_shape, self.n_classes)
        self._check_groups()
        b = self.bytes_per_token
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0):
            raise ValueError(f"data set {self.name!r}: bytes_per_token must be a number > 0 or None, "
                             f"got {self.bytes_per_token!r}")

    def _check_groups(self) -> None:
        where, g, names = f"data set {self.name!r}", self.groups, self.group_names
        if g is None:
            if names:
                raise ValueError(f"{where}: group_names {names} given without groups")
            return
        n = len(self.train[1])
        if not isinstance(g, Tensor) or g.dtype != torch.int64 or tuple(g.shape) != (n,):
            desc = f"{g.dtype} {tuple(g.shape)}" if isinstance(g, Tensor) else type(g).__name__
            raise ValueError(f"{where}: groups must be int64 of shape ({n},) (one per training sample), got {desc}")
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= len(names)):
            raise ValueError(f"{where}: groups span {int(g.min())}..{int(g.max())}; allowed 0..{len(names) - 1} "
                             f"(one per name in group_names, {len(names)} given)")

    @property
    def partition_labels(self) -> Tensor:
        """What partitions split the training set by: ``groups`` when given, else the training labels."""
        return self.groups if self.groups is not None else self.train[1]

    def __repr__(self) -> str:
        return (f"Dataset(name={self.name!r}, train={len(self.train[1])}, test={len(self.test[1])}, "
                f"n_classes={self.n_classes}, input_shape={self.input_shape})")


def _check_split(where: str, x: Tensor, y: Tensor, input_shape: tuple[int, ...], n_classes: int) -> None:
    """One split's inputs and labels, of either kind (see :class:`Dataset`)."""
    tokens = x.dtype == torch.int64
    if not (tokens or x.dtype == torch.float32) or tuple(x.shape[1:]) != input_shape:
        raise ValueError(f"{where}: inputs must be float32 (or int64 token ids) of shape (n, *{input_shape}), "
                         f"got {x.dtype} {tuple(x.shape)}")
    shape = tuple(x.shape) if tokens else (x.shape[0],)
    if y.dtype != torch.int64 or tuple(y.shape) != shape:
        raise ValueError(f"{where}: labels must be int64 of shape {shape}{' (as the token ids)' if tokens else ''}, "
                         f"got {y.dtype} {tuple(y.shape)}")
    for what, t in (("token ids", x), ("labels", y)) if tokens else (("labels", y),):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_classes):
            raise ValueError(f"{where}: {what} span {int(t.min())}..{int(t.max())}; allowed 0..{n_classes - 1}")


#: ``name -> (mean per channel, std per channel)``, in units of the [0, 1]-scaled
#: pixels, applied as ``(x − mean) / std``. Where each comes from:
#:
#: - digits: computed here over the 1,437-image training split (pixels / 16);
#:   ``tests/test_datasets.py`` recomputes it.
#: - mnist: the usual (0.1307, 0.3081) of the PyTorch examples
#:   (pytorch/examples, mnist/main.py): mean and std of the 60,000 training
#:   images' pixels.
#: - fashion-mnist: computed here over the 60,000 training images (Debian's
#:   dataset-fashion-mnist files): mean 0.28604, std 0.35302.
#: - cifar10 / cifar100: the per-channel mean and (population) std of the
#:   50,000 training images' pixels, as widely published with the data sets.
#:   (The also widely copied CIFAR-10 std (0.2023, 0.1994, 0.2010) is not the
#:   pixel std; it is not used here.)
#: - synthetic: chosen, not computed: the generator already yields inputs of
#:   mean ≈ 0 and scale ≈ 1, so normalisation is the identity.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "digits": ((0.3058,), (0.3766,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "synthetic": ((0.0,), (1.0,)),
}

DATASETS: Registry[Callable[..., Dataset]] = Registry("data set")


def load_dataset(name: str, data_dir: str | os.PathLike = "data", *, download: bool = False,
                 **options) -> Dataset:
    """Load the data set ``name`` (see :mod:`cdsgd.data.datasets` for the list).

    Files are looked for under ``data_dir``; with ``download=True`` missing
    files of mnist, fashion-mnist, cifar10 and cifar100 are fetched and
    verified first (digits and synthetic need no files and ignore it).
    ``options`` go to the loader, as keyword arguments (``synthetic``:
    ``n_train, n_test, n_classes, seed``; the text corpora: ``context,
    val_fraction, seed, max_bytes``; ...). An unknown name or option is a
    ValueError naming the allowed ones.
    """
    loader = DATASETS.get(name)
    allowed = [p.name for p in inspect.signature(loader).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise ValueError(f"data set {name!r} has no option {', '.join(map(repr, unknown))}; "
                         + (f"did you mean {close[0]!r}? " if close else "")
                         + f"allowed: {', '.join(allowed) or '(none)'}")
    return loader(Path(data_dir), bool(download), **options)


def _normalize(x: np.ndarray, scale: float, name: str) -> Tensor:
    """``(x / scale − mean_c) / std_c`` as a float32 tensor; x is (n, C, H, W)."""
    mean, std = NORMALIZATION[name]
    out = x.astype(np.float32)  # a fresh, writable array: the rest is in place
    out *= np.float32(1.0 / scale)
    c = out.shape[1]
    if len(mean) != c or len(std) != c:
        raise ValueError(f"NORMALIZATION[{name!r}] has {len(mean)} means and {len(std)} stds "
                         f"for {c} channels")
    out -= np.asarray(mean, dtype=np.float32).reshape(1, c, 1, 1)
    out /= np.asarray(std, dtype=np.float32).reshape(1, c, 1, 1)
    return torch.from_numpy(out)


def _labels(y: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
