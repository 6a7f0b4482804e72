"""How the axes of cdsgd's figures read: whole-epoch ticks, a log scale only when the values span 10x or
more, and byte or second counts in words ('200 kB', '0.5 s') rather than powers of ten.

Used by :mod:`cdsgd.report.plotting` (runs and sweeps) and :mod:`cdsgd.report.time_to_target`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["whole_epochs", "log_if_wide", "spans_decade", "bytes_axis", "bytes_text", "format_bytes_axis",
           "seconds_text", "format_seconds_axis"]

_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def whole_epochs(ax, epochs) -> None:
    """Integer ticks on an epoch axis whose points all fall on whole epochs (no 1.25 between 1 and 2)."""
    from matplotlib.ticker import MaxNLocator

    e = np.asarray(epochs, dtype=float)
    e = e[np.isfinite(e)]
    if len(e) and np.all(e == np.round(e)):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def spans_decade(values) -> bool:
    """The finite values are all positive and the largest is 10x the smallest or more.

    >>> spans_decade([0.5, 4.0]), spans_decade([0.5, 5.0]), spans_decade([0.0, 9.0])
    (False, True, False)
    """
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return bool(len(v) and v.min() > 0 and v.max() >= 10 * v.min())


def log_if_wide(ax, values) -> None:
    """A log y axis when the positive values span 10x or more (a narrower span gets only minor ticks)."""
    if spans_decade(values):
        ax.set_yscale("log")


def bytes_axis(values) -> tuple[float, str, bool]:
    """How to show bytes: (divisor, unit, log scale). Log only when the values span 10x or more."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    hi = float(v.max()) if len(v) else 0.0
    log = spans_decade(v)
    scale, unit = next(((s, u) for s, u in _UNITS if hi >= s), (1.0, "bytes"))
    return (1.0, "bytes", True) if log else (scale, unit, False)


def bytes_text(v, _pos=None) -> str:
    """A byte count with its unit: '200 kB', '1 MB', '5 GB'."""
    s, u = next(((s, u) for s, u in _UNITS if abs(v) >= s), (1.0, "B"))
    return f"{v / s:.3g} {u}" if v else "0"


def seconds_text(v, _pos=None) -> str:
    """Seconds as a reader writes them on a log axis: '0.01', '0.5', '20', '1000' (no 10⁻², no 1e+03)."""
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _log_ticks(axis, lo: float, hi: float, text) -> None:
    """1-2-5 ticks on a log axis (one per decade beyond 100x), each labelled by ``text``."""
    from matplotlib import ticker

    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0) if hi / lo < 100 else (1.0,)))
    axis.set_major_formatter(ticker.FuncFormatter(text))
    axis.set_minor_formatter(ticker.NullFormatter())


def format_bytes_axis(ax, log: bool, xs) -> None:
    """Labelled ticks whatever the range: a log axis gets 1-2-5 ticks (one per decade beyond 100x)
    labelled with their units; a plain axis, in the label's unit, is widened around a single value."""
    from matplotlib import ticker

    lo, hi = np.nanmin(xs), np.nanmax(xs)
    if log:
        ax.set_xscale("log")
        _log_ticks(ax.xaxis, lo, hi, bytes_text)
    else:
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter(useOffset=False))
        if hi - lo <= 0.05 * abs(hi):  # one value (or nearly): show it with a margin, not at 1e-3 resolution
            mid, half = (lo + hi) / 2, max(0.1 * abs(hi), 1.0)
            ax.set_xlim(mid - half, mid + half)


def format_seconds_axis(ax, spread) -> bool:
    """A log x axis of seconds, ticks labelled in plain numbers, when ``spread`` (the values that must be
    told apart, e.g. each curve's last time) spans 10x or more; else the plain axis. Returns whether log."""
    v = np.asarray(spread, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if not spans_decade(v):
        return False
    ax.set_xscale("log")
    _log_ticks(ax.xaxis, v.min(), v.max(), seconds_text)
    return True
