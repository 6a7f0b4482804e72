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
``cifar10``       (3, 32, 32)  10       ``cifar-10-batches-py/`` python pickles
``cifar100``      (3, 32, 32)  100      ``cifar-100-python/`` python pickles (fine labels)
``synthetic``     (1, 8, 8)    4        generated: class means + Gaussian noise
================  ===========  =======  ==============================================

Nothing is downloaded unless asked: ``download=True`` fetches the MNIST-like
and CIFAR files from their public mirrors (:data:`MIRRORS`), verifies each
against a published SHA-256 (:data:`SHA256`) and writes it atomically. CIFAR
pickles are read through a restricted unpickler that admits only the
globals needed to rebuild numpy arrays. See docs/data.md.

>>> ds = load_dataset("digits")
>>> ds
Dataset(name='digits', train=1437, test=360, n_classes=10, input_shape=(1, 8, 8))
>>> ds.train[0].dtype, ds.train[1].dtype, tuple(ds.test[0].shape)
(torch.float32, torch.int64, (360, 1, 8, 8))
>>> load_dataset("synthetic", n_train=100, n_test=20, seed=1).n_classes
4
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import os
import pickle
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from topologies import Registry

__all__ = [
    "DATASETS",
    "Dataset",
    "MIRRORS",
    "NORMALIZATION",
    "SHA256",
    "load_dataset",
    "random_crop_flip",
    "read_idx",
]


# --------------------------------------------------------------------------- #
# The data set record
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Constants: normalisation, mirrors, digests
# --------------------------------------------------------------------------- #

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

#: Base URL per data set for ``download=True`` (a file's URL is base + file name).
#: Module-level so that tests can point it at a local server.
MIRRORS: dict[str, str] = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/",
    "cifar100": "https://www.cs.toronto.edu/~kriz/",
}

#: Published SHA-256 of every file ``download=True`` fetches, per data set. A
#: data set (or file) missing here cannot be downloaded: the loader refuses
#: rather than accept an unverified file. Sources:
#:
#: - mnist: TensorFlow Datasets, tensorflow_datasets/url_checksums/mnist.txt
#:   (same files on the cvdf-datasets mirror, same sizes: 9912422, 28881,
#:   1648877, 4542 bytes) and torchvision's prototype datasets
#:   (torchvision/prototype/datasets/_builtin/mnist.py, which lists the ossci
#:   mirror with these digests).
#: - fashion-mnist: TensorFlow Datasets, url_checksums/fashion_mnist.txt (for
#:   exactly these URLs); the same values in keras/src/datasets/fashion_mnist.py
#:   and torchvision's prototype mnist.py.
#: - cifar10 / cifar100 (python tarballs): torchvision's prototype
#:   torchvision/prototype/datasets/_builtin/cifar.py and Keras
#:   (keras/src/datasets/cifar10.py, cifar100.py ``file_hash``).
SHA256: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
        "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
        "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
        "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
    },
    "cifar10": {
        "cifar-10-python.tar.gz": "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
    },
    "cifar100": {
        "cifar-100-python.tar.gz": "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
    },
}

_DOWNLOAD_TIMEOUT_S = 60.0  # per blocking socket operation, not for the whole file

DATASETS: Registry[Callable[..., Dataset]] = Registry("data set")


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def load_dataset(name: str, data_dir: str | os.PathLike = "data", *, download: bool = False,
                 **options) -> Dataset:
    """Load the data set ``name`` (see the module docstring for the list).

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
        raise ValueError(f"data set {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(allowed) or '(none)'}")
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

# IDX type byte -> numpy dtype (big-endian, as the format specifies).
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_IMAGES = 0x00000803  # uint8, 3 dimensions (n, rows, cols)
_IDX_LABELS = 0x00000801  # uint8, 1 dimension (n,)
_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def read_idx(path: str | os.PathLike, *, magic: int | None = None) -> np.ndarray:
    """Read an IDX file (LeCun's MNIST format), gzipped or raw, into a numpy array.

    Format: a big-endian 4-byte magic number ``0x0000TTDD`` (TT the element
    type, 0x08 = uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64; DD the number of dimensions), DD big-endian uint32 sizes,
    then the elements in C order. MNIST images are 0x00000803 (n, 28, 28),
    labels 0x00000801 (n,). A file starting with the gzip signature is
    decompressed first, whatever its name.

    ``magic``, if given, is the magic number the file must carry. A bad
    magic number, a truncated file or trailing bytes are ValueErrors naming
    the file (and the expected vs actual byte counts).

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = pathlib.Path(d, "labels-idx1-ubyte")
    ...     _ = p.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 0, 9]))  # magic, n = 3, labels
    ...     read_idx(p, magic=0x00000801)
    array([7, 0, 9], dtype=uint8)
    """
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as e:
            raise ValueError(f"IDX file {path} is a damaged or truncated gzip file: {e}") from None
    if len(data) < 4:
        raise ValueError(f"IDX file {path} is truncated: {len(data)} bytes, shorter than the 4-byte magic number")
    found = int.from_bytes(data[:4], "big")
    type_code, ndim = data[2], data[3]
    if magic is not None and found != magic:
        raise ValueError(f"IDX file {path} has magic number 0x{found:08x}; expected 0x{magic:08x} "
                         f"(element type 0x{(magic >> 8) & 0xFF:02x}, {magic & 0xFF} dimensions)")
    if data[:2] != b"\0\0" or type_code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(f"{path} is not an IDX file: magic number 0x{found:08x}; expected 0x0000TTDD "
                         f"with type TT in {', '.join(f'0x{t:02x}' for t in _IDX_DTYPES)} and DD ≥ 1 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"IDX file {path} is truncated: {len(data)} bytes, shorter than its "
                         f"{header}-byte header")
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header declares"
        raise ValueError(f"IDX file {path} is {what}: shape {shape} of {dtype.name} needs "
                         f"{expected} bytes (decompressed), the file has {len(data)}")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))  # a native-order, writable copy


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


def _load_idx_set(name: str, data_dir: Path, download: bool) -> Dataset:
    files, report = _find_idx(name, data_dir)
    if files is None and download:
        _download_files(name, data_dir / _IDX_SETS[name][0])
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


@DATASETS.register("mnist")
def _load_mnist(data_dir: Path, download: bool) -> Dataset:
    """MNIST from ``data_dir`` or ``data_dir/MNIST/raw`` (torchvision's layout)."""
    return _load_idx_set("mnist", data_dir, download)


@DATASETS.register("fashion-mnist")
def _load_fashion_mnist(data_dir: Path, download: bool) -> Dataset:
    """Fashion-MNIST from ``data_dir``, ``data_dir/FashionMNIST/raw`` or Debian's package folder."""
    return _load_idx_set("fashion-mnist", data_dir, download)


# --------------------------------------------------------------------------- #
# CIFAR python pickles, through a restricted unpickler
# --------------------------------------------------------------------------- #


def _numpy_reconstruct():
    try:  # numpy ≥ 2 (importing numpy.core there warns)
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _allowed_globals() -> dict[tuple[str, str], object]:
    import _codecs

    reconstruct = _numpy_reconstruct()
    return {
        # ndarray.__reduce__ gives (_reconstruct, (ndarray, (0,), b"b"), state); the
        # module is numpy.core in files written by numpy 1.x, numpy._core by 2.x.
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        # Python 3 writes a bytes object under protocol ≤ 2 as _codecs.encode(str, "latin1").
        ("_codecs", "encode"): _codecs.encode,
    }


class _RefusedGlobal(ValueError):
    """A pickle asked for a global outside the allowlist."""


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch; any global outside the allowlist is refused."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="bytes")  # Python 2 str (keys, file names) -> bytes
        self._path = path
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            allowed = ", ".join(f"{m}.{n}" for m, n in self._allowed)
            raise _RefusedGlobal(f"{self._path}: refusing to unpickle global {module}.{name}; a CIFAR batch "
                             f"needs only {allowed}. The file is not a genuine CIFAR batch.") from None


def _read_cifar_batch(path: Path, label_key: bytes, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(images (n, 3, 32, 32) uint8, labels (n,) int64)`` from one pickled batch."""
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, path).load()
    except _RefusedGlobal:
        raise
    except Exception as e:  # an untrusted file: whatever breaks, say which file
        raise ValueError(f"{path} is not a readable CIFAR batch: {type(e).__name__}: {e}") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"{path}: expected a dict with keys b'data' and {label_key!r}; found {keys}")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {desc}")
    labels = batch[label_key]
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: {label_key!r} must be a list of integers") from None
    if labels.shape != (len(data),):
        raise ValueError(f"{path}: {len(data)} images but {labels.size} labels under {label_key!r}")
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(f"{path}: labels span {labels.min()}..{labels.max()}; allowed 0..{n_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


_CIFAR_SETS = {  # name -> (folder, tarball, train files, test files, label key, classes)
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz",
                tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), b"labels", 10),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",), b"fine_labels", 100),
}


def _load_cifar(name: str, data_dir: Path, download: bool) -> Dataset:
    folder, tarball, train_files, test_files, key, n_classes = _CIFAR_SETS[name]
    root = data_dir / folder

    def missing():
        return [root / f for f in (*train_files, *test_files) if not (root / f).is_file()]

    if missing() and download:
        _download_files(name, data_dir)
        _safe_extract(data_dir / tarball, data_dir)
    if lacking := missing():
        raise FileNotFoundError(
            f"{name}: missing {', '.join(map(str, lacking))}. Looked in {root}. To obtain them: "
            f"load_dataset({name!r}, {str(data_dir)!r}, download=True) (download = true in a config), "
            f"or fetch {MIRRORS.get(name, '')}{tarball} and extract it into {data_dir}.")
    splits = []
    for files in (train_files, test_files):
        parts = [_read_cifar_batch(root / f, key, n_classes) for f in files]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        splits.append((_normalize(x, 255.0, name), _labels(y)))
    return Dataset(name, splits[0], splits[1], n_classes, (3, 32, 32))


@DATASETS.register("cifar10")
def _load_cifar10(data_dir: Path, download: bool) -> Dataset:
    """CIFAR-10 from ``data_dir/cifar-10-batches-py/`` (data_batch_1..5, test_batch)."""
    return _load_cifar("cifar10", data_dir, download)


@DATASETS.register("cifar100")
def _load_cifar100(data_dir: Path, download: bool) -> Dataset:
    """CIFAR-100 (fine labels) from ``data_dir/cifar-100-python/`` (train, test)."""
    return _load_cifar("cifar100", data_dir, download)


# --------------------------------------------------------------------------- #
# Downloads: verified, atomic
# --------------------------------------------------------------------------- #


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download_files(name: str, dest_dir: Path) -> None:
    """Fetch every file of ``SHA256[name]`` from ``MIRRORS[name]`` into ``dest_dir``.

    A file already there with the right digest is kept, not fetched again.
    """
    digests = SHA256.get(name)
    if not digests or name not in MIRRORS:
        raise ValueError(f"download=True is not available for {name!r}: no published SHA-256 digest or "
                         "mirror is recorded for its files, and unverified downloads are refused. "
                         "Place the files yourself (see docs/data.md)")
    for fname, digest in digests.items():
        dest = dest_dir / fname
        if dest.is_file() and _sha256_of(dest) == digest:
            continue
        _fetch(MIRRORS[name] + fname, dest, digest)


def _fetch(url: str, dest: Path, sha256: str) -> None:
    """Download ``url`` to ``dest`` atomically, only if its SHA-256 is ``sha256``.

    The bytes go to a temporary file beside ``dest``, are fsynced and
    verified, then renamed over ``dest`` (os.replace). On any failure the
    temporary file is removed and ``dest`` is left as it was.
    """
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"refusing to download {url}: scheme {scheme!r}; allowed: http, https")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
                    while chunk := response.read(1 << 20):
                        h.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError) as e:
                raise OSError(f"downloading {url} failed: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        got = h.hexdigest()
        if got != sha256:
            raise ValueError(f"download of {url} has SHA-256 {got}; expected {sha256}. "
                             "The file was discarded")
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _safe_extract(archive: Path, dest: Path) -> None:
    """Extract a .tar.gz into ``dest``, refusing anything but plain files and folders.

    Every member is checked before anything is written: an absolute name, a
    ``..`` component, a link, a device or a FIFO is a ValueError naming the
    archive and the member. Files are extracted into a temporary folder in
    ``dest`` and then moved into place one by one.
    """
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        for m in members:
            p = PurePosixPath(m.name)
            if p.is_absolute() or ".." in p.parts:
                raise ValueError(f"{archive}: refusing member {m.name!r}: absolute or parent-relative path")
            if not (m.isfile() or m.isdir()):
                kind = "link" if (m.issym() or m.islnk()) else "device or special file"
                raise ValueError(f"{archive}: refusing member {m.name!r}: a {kind}; "
                                 "only regular files and folders are extracted")
        with tempfile.TemporaryDirectory(prefix=".extract-", dir=dest) as tmp:
            if hasattr(tarfile, "data_filter"):  # Python ≥ 3.11.4: a second line of defence
                tar.extractall(tmp, members=members, filter="data")
            else:  # pragma: no cover
                tar.extractall(tmp, members=members)
            for folder, _, names in os.walk(tmp):
                rel = Path(folder).relative_to(tmp)
                (dest / rel).mkdir(parents=True, exist_ok=True)
                for n in names:
                    os.replace(Path(folder) / n, dest / rel / n)


# --------------------------------------------------------------------------- #
# Augmentation
# --------------------------------------------------------------------------- #


def random_crop_flip(x: Tensor, generator: torch.Generator, padding: int = 4, *,
                     flip_p: float = 0.5) -> Tensor:
    """Standard CIFAR augmentation of a batch ``x`` of shape (N, C, H, W).

    Each image is zero-padded by ``padding`` on every side, cropped back to
    H×W at a random offset (i, j), 0 ≤ i, j ≤ 2·padding, and flipped left-right
    with probability ``flip_p``. Randomness comes only from ``generator``,
    drawn in this order: ``i = randint(0, 2p+1, (N,))``, ``j`` likewise, then
    ``u = rand(N)``, flipping where u < flip_p. One gather, no per-sample loop.

    The inputs are normally already normalised, so the zero border is the
    data set's mean colour (torchvision pads the raw image with black).

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    >>> random_crop_flip(x, g, padding=1).shape
    torch.Size([2, 3, 4, 4])
    >>> torch.equal(random_crop_flip(x, g, padding=0, flip_p=1.0), x.flip(-1))
    True
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"random_crop_flip needs a batch of shape (N, C, H, W), got {shape}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an integer ≥ 0, got {padding!r}")
    if not 0.0 <= flip_p <= 1.0:
        raise ValueError(f"flip_p must be in [0, 1], got {flip_p!r}")
    n, _, h, w = x.shape
    dev = generator.device
    i = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    j = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    flip = (torch.rand(n, generator=generator, device=dev) < flip_p).to(x.device)
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding)) if padding else x
    rows = i[:, None] + torch.arange(h, device=x.device)                  # (N, H)
    cols = j[:, None] + torch.arange(w, device=x.device)                  # (N, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)                 # flip = read columns backwards
    return padded[torch.arange(n, device=x.device)[:, None, None, None],
                  torch.arange(x.shape[1], device=x.device)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
