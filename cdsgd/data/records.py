"""The data set record, its registry and the entry point ``load_dataset``.

A :class:`Dataset` holds train and test tensors; :data:`DATASETS` maps each
name to its builder (the builders live in :mod:`cdsgd.data.datasets` and
:mod:`cdsgd.data.sequences`); :func:`load_dataset` looks a name up and calls
its builder. :data:`NORMALIZATION` holds the per-channel constants with which
the image builders normalise their inputs (:func:`_normalize`).
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
    """A classification data set held in memory as tensors.

    ``train`` and ``test`` are ``(inputs, labels)``: inputs float32 of shape
    (n, *input_shape), already normalised; labels int64 of shape (n,) with
    values in 0..n_classes-1. Checked on construction.
    """

    name: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    n_classes: int
    input_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        for split, (x, y) in (("train", self.train), ("test", self.test)):
            where = f"data set {self.name!r}, {split} split"
            if x.dtype != torch.float32 or tuple(x.shape[1:]) != self.input_shape:
                raise ValueError(f"{where}: inputs must be float32 of shape (n, *{self.input_shape}), "
                                 f"got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"{where}: labels must be int64 of shape ({x.shape[0]},), "
                                 f"got {y.dtype} {tuple(y.shape)}")
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.n_classes):
                raise ValueError(f"{where}: labels span {int(y.min())}..{int(y.max())}; "
                                 f"allowed 0..{self.n_classes - 1}")

    def __repr__(self) -> str:
        return (f"Dataset(name={self.name!r}, train={len(self.train[1])}, test={len(self.test[1])}, "
                f"n_classes={self.n_classes}, input_shape={self.input_shape})")


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
    ``options`` go to the loader; only ``synthetic`` takes any
    (``n_train, n_test, n_classes, seed``). An unknown name or option is a
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
