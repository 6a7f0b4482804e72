"""Downloads for ``download=True``: verified against a published SHA-256, written atomically.

:data:`MIRRORS` gives each data set's base URL and :data:`SHA256` the digest
of every file fetched from it; a file without a recorded digest is never
downloaded. :func:`_fetch` writes to a temporary file, fsyncs it, verifies
it, renames it over the target and fsyncs the folder. :func:`_safe_extract`
unpacks a tarball after checking every member.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from ..base.files import fsync_dir

__all__ = ["MIRRORS", "SHA256"]


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
    verified, then renamed over ``dest`` (os.replace), and the folder is
    fsynced so that the rename survives a crash. On any failure the
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
    fsync_dir(dest.parent)


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
