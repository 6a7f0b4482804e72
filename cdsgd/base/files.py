"""Writing files so that a file that exists is whole: one helper for every output of cdsgd.

:func:`atomic_write` writes to a temporary file beside the target, flushes
and fsyncs it, renames it over the target (``os.replace``) and fsyncs the
folder, so that a process killed at any moment leaves either the old file or
the new one, never half of one (only a ``.*.tmp`` that readers ignore).
Checkpoints, ``config.toml``, ``summary.json``, ``params.pt`` and sweep
tables all go through it.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = atomic_write(pathlib.Path(d) / "a.txt", "hello\\n")
    ...     p.read_text(), sorted(x.name for x in p.parent.iterdir())
    ('hello\\n', ['a.txt'])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, IO

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder (so that a rename in it survives a crash); silently skipped where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write ``data`` (text, bytes, or a function writing into a binary file) to ``path`` atomically.

    Returns the path. The temporary file is named ``.NAME.PID.tmp`` in the
    same folder (a rename never crosses file systems) and removed on failure.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
