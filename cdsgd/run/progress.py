"""What a run shows while it trains: a progress bar on a terminal, plain lines elsewhere, an honest ETA.

:class:`Progress` receives every step (:meth:`Progress.step`) and every
metrics row (:meth:`Progress.row`). On a terminal of known size it draws a
tqdm bar and prints each evaluation's line *above* it (the history stays on
screen); the bar's text carries the ETA, the last training loss and both
accuracies. Anywhere else (a pipe, a file, a terminal without a size) it
prints the evaluation lines and, between evaluations, a line at most every
``interval`` seconds, so a long run never goes silent.

The ETA counts evaluation too. With t_s the mean training time per timed
step so far, t_e the mean time per evaluation so far, S steps and E
evaluations still to come::

    ETA = S · t_s + E · t_e

The timed steps leave out the process's first step, whose compilation and
first calls (about 0.9 s against 2 ms a step for the ``vmap`` MLP) would
make the first ETA of a 5-second run read half an hour
(:meth:`cdsgd.executor.meters.StepTimer.charge`); until a timed step exists
the ETA is ``?``.

:func:`safe_stream` wraps a stream so that a reader that went away (``cdsgd
run … 2>&1 | head``) stops the output, never the run.

    >>> lines = []
    >>> p = Progress(total=4, every=2, mode="lines", log=lines.append, timing=lambda: (2.0, 2, 1.0, 1))
    >>> p.eta(2)  # 2 steps of 1 s each and 1 evaluation of 1 s still to come
    3.0
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Callable, TextIO

__all__ = ["MODES", "Progress", "format_seconds", "pick_mode", "safe_stream", "silence"]

#: how progress is shown: a tqdm bar, plain lines, or nothing
MODES = ("bar", "lines", "off")


def format_seconds(s: float) -> str:
    """``"12 min 43 s"``, ``"41.2 s"``, ``"1 h 03 min"``.

    >>> format_seconds(763.2), format_seconds(41.24), format_seconds(3790)
    ('12 min 43 s', '41.2 s', '1 h 03 min')
    """
    if s != s or s < 0:  # NaN or negative: unknown
        return "?"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null: once its reader has gone, later writes (and the
    interpreter's flush at exit) go nowhere instead of raising BrokenPipeError."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _SafeStream:
    """A text stream whose writes stop quietly (forever) once its reader has gone (EPIPE)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self.closed_by_reader = stream, False

    def _guard(self, fn, *args):
        if self.closed_by_reader:
            return None
        try:
            return fn(*args)
        except (BrokenPipeError, ValueError) as e:  # ValueError: the stream was closed under us
            self.closed_by_reader = True
            if isinstance(e, BrokenPipeError):
                silence(self._stream)
            return None
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            self.closed_by_reader = True
            return None

    def write(self, text: str):
        return self._guard(self._stream.write, text)

    def flush(self):
        return self._guard(self._stream.flush)

    def isatty(self) -> bool:
        return (not self.closed_by_reader) and self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def safe_stream(stream: TextIO) -> TextIO:
    """``stream`` wrapped so that a closed pipe ends the output silently instead of raising (idempotent)."""
    return stream if isinstance(stream, _SafeStream) else _SafeStream(stream)


def pick_mode(stream: TextIO, progress: bool | None) -> str:
    """``bar`` on a terminal whose size is known (when ``progress`` is None or True), else ``lines``.

    ``progress=False`` asks for plain lines (``--no-progress``).
    """
    if progress is False:
        return "lines"
    try:
        tty = stream.isatty()
        columns = os.get_terminal_size(stream.fileno()).columns if tty else 0
    except (OSError, ValueError, AttributeError):
        tty, columns = False, 0
    return "bar" if tty and columns > 0 else "lines"


class Progress:
    """Steps and rows of one run on the screen (see the module docstring).

    Args:
        total: the run's last step; ``initial``: the step it starts from (a resumed run).
        every: steps between evaluations (the last step is evaluated too).
        mode: ``bar``, ``lines`` or ``off``.
        log: where lines go (one call per line).
        timing: ``() -> (training seconds, timed steps, evaluation seconds, evaluations)`` since step 0 (a
            resumed run's included, as the executor's clocks are; warm-up steps are neither timed nor
            counted), for the ETA.
        stream: the bar's stream (default: stderr, made safe).
        interval: seconds between heartbeat lines in ``lines`` mode.
    """

    def __init__(self, *, total: int, every: int, mode: str, log: Callable[[str], None],
                 timing: Callable[[], tuple[float, int, float, int]], initial: int = 0, stream: TextIO | None = None,
                 interval: float = 30.0) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r} is unknown; allowed: {', '.join(MODES)}")
        self.total, self.every, self.mode, self.log = total, max(1, every), mode, log
        self.timing, self.k, self.interval = timing, initial, interval
        self._last_line = time.monotonic()
        self._post = ""
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=stream or safe_stream(sys.stderr),
                            dynamic_ncols=True, bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                            "[{elapsed}{postfix}]")
            self.bar.set_postfix_str("ETA ?", refresh=False)

    def evaluations_left(self, k: int) -> int:
        """Evaluations after step k: every ``every`` steps, and the last step."""
        if k >= self.total:
            return 0
        return (self.total // self.every - k // self.every) + (1 if self.total % self.every else 0)

    def eta(self, k: int) -> float:
        """Seconds still to come from step k: the mean timed step and evaluation so far (NaN before a timed step).

        >>> Progress(total=100, every=100, mode="off", log=print, timing=lambda: (0.004, 2, 0.0, 0)).eta(3)
        0.194
        """
        train, timed, evaluation, evals = self.timing()  # the warm-up step is in neither train nor timed
        if timed <= 0:
            return float("nan")
        per_eval = evaluation / evals if evals else 0.0
        return (self.total - k) * train / timed + self.evaluations_left(k) * per_eval

    def step(self, k: int) -> None:
        self.k = k
        if self.bar is not None:
            self.bar.set_postfix_str(f"ETA {format_seconds(self.eta(k))}{self._post}", refresh=False)
            self.bar.update(k - self.bar.n)
        elif self.mode == "lines" and time.monotonic() - self._last_line >= self.interval and k < self.total:
            self.log(f"step {k}/{self.total} ({100 * k / self.total:.0f}%), ETA {format_seconds(self.eta(k))}")
            self._last_line = time.monotonic()

    def row(self, line: str, row: dict) -> None:
        """An evaluation: its line (above the bar, or logged) and, on the bar, its loss and accuracies."""
        self._post = (f", loss {row['train_loss']:.4f}, acc {row['test_accuracy']:.3f} "
                      f"(avg model {row['test_accuracy_avg_model']:.3f})")
        self.note(line)
        self._last_line = time.monotonic()
        if self.bar is not None:
            self.bar.set_postfix_str(f"ETA {format_seconds(self.eta(self.k))}{self._post}")

    def note(self, line: str) -> None:
        """A line outside the rows (above the bar, or logged)."""
        if self.bar is not None:
            self.bar.write(line, file=self.bar.fp)
        elif self.mode == "lines":
            self.log(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
