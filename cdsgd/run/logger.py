"""Optional run loggers: the metrics of a run as TensorBoard scalars beside its metrics.csv.

``make_logger(cfg.logger, out)`` returns a :class:`RunLogger`: ``"none"``
(the default) does nothing; ``"tensorboard"`` writes event files through
``torch.utils.tensorboard.SummaryWriter`` into ``out`` itself, one run per
folder, so that ``tensorboard --logdir runs/`` compares the runs of a sweep.
The tensorboard package is an optional extra (``pip install
'cdsgd[tensorboard]'``): importing this module never imports it, and
:func:`check_logger` tells, without creating a file, whether a name can be
used.

What is written (global step = the optimisation step, as in metrics.csv):

* :meth:`RunLogger.row`: every column of a metrics row except ``step``
  (:data:`cdsgd.executor.METRIC_COLUMNS`, then any other column) as the
  scalar ``metrics/<column>`` (:func:`row_tag`), e.g.
  ``metrics/test_accuracy``, at ``global_step = row["step"]``; the writer is
  flushed after each row, as metrics.csv is;
* :meth:`RunLogger.train_loss`: the mean batch loss of one step as
  ``train/loss_per_step`` (:data:`LOSS_TAG`);
* :meth:`RunLogger.text`: a text once (the config), shown verbatim.

NaN and ±inf are written as they are (a value of ``None`` is skipped), so
that the event files agree with metrics.csv and show where a run diverged.
Values are stored as float32, as TensorBoard scalars always are.

Resuming (``purge_step``): a resumed run writes a new event file into the same
folder, and readers differ on values logged twice. TensorBoard's data server
keeps the latest: a value at step ``s`` replaces the values of its tag at
steps >= ``s`` read before it. The Python reader (``EventAccumulator``,
``--load_fast=false``) keeps them all unless the new file marks a step from
which earlier values are stale: ``make_logger(name, out, purge_step=k + 1)``,
for a run resumed from the checkpoint of step ``k``, writes that mark (a
SessionLog START at step ``k + 1``). What the stopped run wrote after its
checkpoint is then dropped, and what it wrote up to step ``k`` (its rows and
per-step losses) is kept; :meth:`RunLogger.replay` logs the checkpoint's rows
again only where no earlier event file holds them, so each tag has one value
per step in either reader.

    >>> log = make_logger("none", "runs/x")   # writes nothing, creates no folder
    >>> with log:
    ...     log.row({"epoch": 1.0, "step": 10, "train_loss": 0.5})
    ...     log.train_loss(11, 0.4)
    >>> row_tag("test_accuracy"), LOSS_TAG
    ('metrics/test_accuracy', 'train/loss_per_step')
    >>> check_logger("tensorbord")
    Traceback (most recent call last):
    ...
    ValueError: logger 'tensorbord' is unknown; did you mean 'tensorboard'? Known: none, tensorboard

With the extra installed (rank 0 of a run only)::

    with make_logger("tensorboard", out, purge_step=resumed_step + 1 if resumed else None) as log:
        log.text("config", config_toml_text)
        log.replay(rows_from_checkpoint)
        ...   # log.train_loss(k, loss) each step, log.row(row) each evaluation
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Iterable

import torch

from ..base.checks import check_choice, check_int
from ..executor import METRIC_COLUMNS

__all__ = ["EVENT_FILE_PREFIX", "LOGGERS", "LOSS_TAG", "RunLogger", "TensorBoardLogger", "check_logger",
           "make_logger", "row_tag"]

#: the loggers ``make_logger`` knows (the config key ``logger``)
LOGGERS = ("none", "tensorboard")
#: the tag of the per-step training loss
LOSS_TAG = "train/loss_per_step"
#: TensorBoard's event files start with this name
EVENT_FILE_PREFIX = "events.out.tfevents."
#: the writer writes pending per-step losses to disk at least this often (rows are flushed at once)
FLUSH_SECONDS = 30


def row_tag(column: str) -> str:
    """The TensorBoard tag of a metrics.csv column: ``metrics/<column>``."""
    return f"metrics/{column}"


def _summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or the ValueError saying how to install it (creates no file)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(f"logger='tensorboard' needs the tensorboard package: pip install 'cdsgd[tensorboard]' "
                         f"(the import failed: {e})") from e
    return SummaryWriter


def check_logger(name: Any) -> str:
    """``name`` if it is one of :data:`LOGGERS` and usable here (its package imports); creates no file.

    Cheap enough for config validation, before the output folder exists.
    """
    check_choice("logger", name, LOGGERS)
    if name == "tensorboard":
        _summary_writer_class()
    return name


def _scalar(column: str, value: Any) -> float | None:
    """A row value as a float (None: no value to write); ValueError naming the column otherwise."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"metrics column {column!r} must be a number (or None), got {value!r}")
    return float(value)


def _ordered(row: dict) -> list[str]:
    """The columns of ``row`` to write: METRIC_COLUMNS first (in their order), then any others; never ``step``."""
    ordered = [c for c in METRIC_COLUMNS if c in row] + [c for c in row if c not in METRIC_COLUMNS]
    return [c for c in ordered if c != "step"]


def _row_step(row: dict) -> int:
    if "step" not in row:
        raise ValueError(f"a metrics row needs its 'step' (the global step), got the columns {sorted(row)}")
    return check_int("step", row["step"], low=0, what="metrics row: ")


class RunLogger:
    """The interface of a run logger, and the ``"none"`` logger: every method checks its input and writes nothing.

    A context manager: ``with make_logger(...) as log:`` closes it on exit.
    """

    name = "none"

    def row(self, row: dict) -> None:
        """Log one metrics row: each column except ``step`` as ``row_tag(column)`` at ``row["step"]``."""
        step = _row_step(row)
        for column in _ordered(row):
            value = _scalar(column, row[column])
            if value is not None:
                self._scalar(row_tag(column), value, step)
        self.flush()

    def replay(self, rows: Iterable[dict]) -> int:
        """Log a resumed run's rows up to its checkpoint (as metrics.csv writes them again); returns how many.

        Rows that earlier event files of ``out`` hold already (those of a step
        before ``purge_step``, when ``out`` held event files before this logger
        opened) are not written twice; all rows are otherwise.
        """
        written = 0
        for r in rows:
            if not self._holds(_row_step(r)):
                self.row(r)
                written += 1
        return written

    def train_loss(self, step: int, loss: float) -> None:
        """Log the training loss of one step as :data:`LOSS_TAG` at ``step``."""
        step = check_int("step", step, low=0, what="train_loss: ")
        value = _scalar(LOSS_TAG, loss)
        if value is not None:
            self._scalar(LOSS_TAG, value, step)

    def text(self, tag: str, text: str, *, step: int = 0) -> None:
        """Log ``text`` verbatim (e.g. the run's config.toml) under ``tag``; TensorBoard shows it in its Text tab."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"text: tag must be a non-empty string, got {tag!r}")
        if not isinstance(text, str):
            raise ValueError(f"text: text must be a string, got {type(text).__name__}")
        self._text(tag, text, check_int("step", step, low=0, what="text: "))

    def flush(self) -> None:
        """Write what is pending to disk (e.g. at a checkpoint)."""

    def close(self) -> None:
        """Flush and close; closing again does nothing."""

    # the hooks a writing logger overrides
    def _scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def _text(self, tag: str, text: str, step: int) -> None:
        pass

    def _holds(self, step: int) -> bool:
        """Whether earlier event files hold the row of ``step`` (so that :meth:`replay` skips it)."""
        return False

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TensorBoardLogger(RunLogger):
    """Writes TensorBoard event files into ``out`` (``SummaryWriter(log_dir=out, purge_step=purge_step)``).

    Build it with :func:`make_logger`. ``purge_step``: the first step this
    logger writes anew; readers drop what earlier event files in ``out`` hold
    at this step and later: ``k + 1`` for a run resumed from the checkpoint
    of step ``k`` (module docstring), ``0`` for a fresh run written into a
    reused folder (``overwrite``), whose old event files are all stale.
    """

    name = "tensorboard"

    def __init__(self, out: str | Path, *, purge_step: int | None = None) -> None:
        writer_class = _summary_writer_class()
        self.out = Path(out)
        self.purge_step = purge_step
        # read before the writer creates its own file: do earlier event files hold this run's first steps?
        self.earlier_files = self.out.is_dir() and any(self.out.glob(EVENT_FILE_PREFIX + "*"))
        self._writer = writer_class(log_dir=str(self.out), purge_step=purge_step, flush_secs=FLUSH_SECONDS)
        self._closed = False

    def _open(self):
        if self._closed:  # SummaryWriter would silently start a new event file
            raise RuntimeError(f"the tensorboard logger of {self.out} is closed")
        return self._writer

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self._open().add_scalar(tag, value, global_step=step)

    def _text(self, tag: str, text: str, step: int) -> None:
        # TensorBoard renders text as Markdown: an indented block keeps a config's '#' and '[' as they are
        block = "\n".join("    " + line for line in text.splitlines())
        self._open().add_text(tag, block, global_step=step)

    def _holds(self, step: int) -> bool:
        return self.earlier_files and self.purge_step is not None and step < self.purge_step

    def flush(self) -> None:
        self._open().flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardLogger(out={str(self.out)!r}, purge_step={self.purge_step!r})"


def make_logger(name: str, out: str | Path, *, purge_step: int | None = None) -> RunLogger:
    """The logger ``name`` (one of :data:`LOGGERS`) writing into the run folder ``out``.

    ``"none"`` creates nothing; ``"tensorboard"`` creates ``out`` and an
    event file in it at once. ``purge_step`` (an integer >= 0, or None): see
    :class:`TensorBoardLogger`; checked and ignored by ``"none"``. Raises
    ValueError for an unknown name or a missing tensorboard package.
    """
    check_choice("logger", name, LOGGERS)
    if purge_step is not None:
        purge_step = check_int("purge_step", purge_step, low=0)
    if name == "none":
        return RunLogger()
    return TensorBoardLogger(out, purge_step=purge_step)
