"""Reading the data sets' file formats: IDX (MNIST-like) and CIFAR python pickles.

:func:`read_idx` reads LeCun's IDX format, gzipped or raw. CIFAR batches are
read by :func:`read_cifar_batch` through a restricted unpickler that admits
only the globals needed to rebuild numpy arrays; any other global is refused
before it is looked up. Every malformed file is a ValueError naming the file.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from pathlib import Path

import numpy as np

__all__ = ["read_cifar_batch", "read_idx"]


# --------------------------------------------------------------------------- #
# IDX files
# --------------------------------------------------------------------------- #

# IDX type byte -> numpy dtype (big-endian, as the format specifies).
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_IMAGES = 0x00000803  # uint8, 3 dimensions (n, rows, cols)
_IDX_LABELS = 0x00000801  # uint8, 1 dimension (n,)


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


def read_cifar_batch(path: Path, label_key: bytes, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
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
