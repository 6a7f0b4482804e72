"""Reading the CSV files a run or a sweep writes (metrics.csv, results.csv) for figures.

>>> num("0.5"), num(""), [order(v)[0] for v in ("16", "ring")]
(0.5, nan, [0, 1])
"""

from __future__ import annotations

import numpy as np

__all__ = ["read_csv", "num", "order", "column"]


def read_csv(path, need: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a CSV file written by cdsgd; a ValueError naming the file if it lacks a ``need`` column."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} is not a CSV file written by cdsgd ({type(e).__name__}: {e})") from None
    missing = [c for c in need if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}; not a CSV file written by cdsgd "
                         f"(found: {', '.join(reader.fieldnames or ()) or 'no header'})")
    return rows


def num(v) -> float:
    """A cell as a float; NaN when empty or not a number."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def order(v) -> tuple:
    """Sort key: numbers by value, then text (a NaN key would leave the order to chance)."""
    x = num(v)
    return (0, x, "") if np.isfinite(x) else (1, 0.0, str(v))


def column(rows, key) -> np.ndarray:
    """One column of ``rows`` as floats (NaN where empty)."""
    return np.array([num(r.get(key)) for r in rows])
