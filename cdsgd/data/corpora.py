"""Text corpora that need no download: documents as bytes, each from a named source.

A :class:`Corpus` is a list of documents (``bytes``: tokens are the bytes of
the files, never decoded text), the source of each, and the separator that
follows every document when documents are concatenated (see
:mod:`cdsgd.data.text`, which cuts them into windows). ``read_corpus(name)``
reads one of :data:`CORPORA`:

``fortunes``
    Debian's ``fortunes`` package (BSD licence): ``/usr/share/games/fortunes``
    holds one plain-text file per category, fortunes separated by lines
    holding only ``%``. A document is one fortune, its source the category
    (the file name). The ``.dat`` index files and the ``.u8`` links to the
    same files are skipped. Separator ``b"%\\n"``, as in the files.
    Missing folder: a FileNotFoundError saying ``apt-get install fortunes``.
``python_code``
    The Python standard library's own ``.py`` files
    (``sysconfig.get_paths()["stdlib"]``), without the ``test``, ``tests``,
    ``idlelib``, ``site-packages``, ``dist-packages`` and ``__pycache__``
    trees and the build's ``config-*`` folder. A document is one file, its
    source the top-level package (``email``, ``asyncio``, ``json``, ...) or
    ``(modules)`` for the single-file modules at the top; files holding only
    white space (empty ``__init__.py`` files) are skipped. Separator ``b"\\n"``.

Documents come in a fixed order (sorted paths; within a file, file order).
``max_bytes`` caps the corpus: the documents are visited in a seeded random
order and each is kept when it still fits in the budget; the kept ones
stay in the fixed order.

>>> c = Corpus("toy", (b"ab", b"cd", b"e"), (0, 1, 0), ("x", "y"), b"\\n")
>>> c.n_bytes, select_documents(c, max_bytes=3, seed=0).n_bytes <= 3
(5, True)
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from topologies import Registry

from ..base.checks import check_int
from ..base.seeding import derive_seed
from .datasets import LOCATORS

__all__ = ["CORPORA", "Corpus", "FORTUNES_DIR", "MAX_BYTES", "read_corpus", "select_documents"]

#: where Debian's ``fortunes`` package installs its files
FORTUNES_DIR = Path("/usr/share/games/fortunes")
#: the default cap on a corpus's bytes: all of fortunes (2.6 MB), about a third of the standard library
MAX_BYTES = 4_000_000
#: folders of the standard library that are not read as code (tests, IDLE, installed packages, the build)
_SKIPPED_TREES = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, eq=False)
class Corpus:
    """Documents (bytes), the source id of each, the source names, and the separator after each document.

    ``sources[i]`` indexes ``source_names``; every source has at least one document.
    """

    name: str
    documents: tuple[bytes, ...]
    sources: tuple[int, ...]
    source_names: tuple[str, ...]
    separator: bytes

    def __post_init__(self) -> None:
        if len(self.documents) != len(self.sources):
            raise ValueError(f"corpus {self.name!r}: {len(self.documents)} documents but {len(self.sources)} sources")
        used = set(self.sources)
        if used != set(range(len(self.source_names))):
            raise ValueError(f"corpus {self.name!r}: source ids {sorted(used)} must be exactly "
                             f"0..{len(self.source_names) - 1}, one per source name, each used")

    @property
    def n_bytes(self) -> int:
        """The documents' bytes (separators not counted)."""
        return sum(map(len, self.documents))


def _corpus(name: str, docs: list[tuple[str, bytes]], separator: bytes) -> Corpus:
    """A corpus from (source name, document) pairs in order; sources numbered in sorted name order."""
    names = tuple(sorted({s for s, _ in docs}))
    index = {s: i for i, s in enumerate(names)}
    return Corpus(name, tuple(d for _, d in docs), tuple(index[s] for s, _ in docs), names, separator)


def select_documents(corpus: Corpus, *, max_bytes: int | None, seed: int) -> Corpus:
    """The documents that fit in ``max_bytes``, visited in a seeded random order (None: all of them).

    With ``rng = numpy.random.default_rng(derive_seed(seed, "corpus", name))``
    the documents are visited in the order ``rng.permutation(n)``; each is
    kept when the kept bytes stay ≤ max_bytes. The result keeps the corpus's
    order and only the sources that still have a document.
    """
    if max_bytes is None or corpus.n_bytes <= max_bytes:
        return corpus
    rng = np.random.default_rng(derive_seed(seed, "corpus", corpus.name))
    keep, total = [], 0
    for i in rng.permutation(len(corpus.documents)).tolist():
        if total + len(corpus.documents[i]) <= max_bytes:
            keep.append(i)
            total += len(corpus.documents[i])
    if not keep:
        raise ValueError(f"{corpus.name}: max_bytes={max_bytes} holds no document (the shortest has "
                         f"{min(map(len, corpus.documents))} bytes); allowed: an integer ≥ that, or None")
    keep.sort()
    return _corpus(corpus.name, [(corpus.source_names[corpus.sources[i]], corpus.documents[i]) for i in keep],
                   corpus.separator)


# --------------------------------------------------------------------------- #
# The corpora
# --------------------------------------------------------------------------- #

CORPORA: Registry[Callable[[], Corpus]] = Registry("text corpus")


def _locate_fortunes(data_dir: Path | None = None) -> list[Path]:
    """The category files of the fortunes package, or the one-line FileNotFoundError saying how to get them."""
    files = sorted(p for p in FORTUNES_DIR.iterdir() if p.is_file() and not p.is_symlink()
                   and p.suffix not in (".dat", ".u8")) if FORTUNES_DIR.is_dir() else []
    if not files:
        raise FileNotFoundError(f"fortunes: no fortune files in {FORTUNES_DIR} (Debian's fortunes package); "
                                "install them with `apt-get install fortunes` (Debian/Ubuntu)")
    return files


LOCATORS["fortunes"] = _locate_fortunes


@CORPORA.register("fortunes")
def _read_fortunes() -> Corpus:
    """Each fortune of each category file, the file name its source; blank fortunes skipped."""
    docs = []
    for path in _locate_fortunes():
        for doc in re.split(rb"(?m)^%(?:\n|\Z)", path.read_bytes()):
            if doc.strip():
                docs.append((path.name, doc))
    return _corpus("fortunes", docs, b"%\n")


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(source, path) of every ``.py`` file under ``root`` outside the skipped trees, in sorted path order.

    The skipped trees are pruned from the walk, never entered (site-packages may hold thousands of files).
    """
    out = []
    for folder, subfolders, names in os.walk(root):
        rel = Path(folder).relative_to(root).parts
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_TREES and not (not rel and d.startswith("config-"))]
        out += [(rel[0] if rel else "(modules)", Path(folder, n)) for n in names
                if n.endswith(".py") and Path(folder, n).is_file()]
    return sorted(out, key=lambda sp: sp[1])


@CORPORA.register("python_code")
def _read_python_code() -> Corpus:
    """Every file of :func:`_stdlib_files` over the running interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"python_code: no .py files under {root}, the standard library of this Python "
                                "(sysconfig.get_paths()['stdlib']); a Python installed without its sources "
                                "cannot serve this data set")
    docs = [(s, p.read_bytes()) for s, p in files]
    return _corpus("python_code", [(s, d) for s, d in docs if d.strip()], b"\n")


def read_corpus(name: str, *, max_bytes: int | None = MAX_BYTES, seed: int = 0) -> Corpus:
    """The corpus ``name`` of :data:`CORPORA`, capped at ``max_bytes`` by :func:`select_documents`."""
    reader = CORPORA.get(name)
    if max_bytes is not None:
        max_bytes = check_int("max_bytes", max_bytes, 1, what=f"{name}: ")
    seed = check_int("seed", seed, 0, what=f"{name}: ")
    return select_documents(reader(), max_bytes=max_bytes, seed=seed)
