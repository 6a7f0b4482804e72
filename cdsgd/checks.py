"""Validators for user-given values: one set, used by every layer of cdsgd.

Each check returns the value in its canonical type or raises a ValueError
that names the value and what is allowed (never an ``assert``)::

    >>> check_int("batch_size", 32), check_number("lr", 1)
    (32, 1.0)
    >>> check_int("batch_size", 0)
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be an integer >= 1, got 0
    >>> check_choice("executor", "thread", ("sim", "torch"))
    Traceback (most recent call last):
    ...
    ValueError: executor 'thread' is unknown; Known: sim, torch

Pure Python: importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

from topologies import unknown_name_error

__all__ = ["check_choice", "check_int", "check_lr", "check_momentum", "check_number", "check_weight_decay"]


def check_int(name: str, value: Any, low: int = 1, *, what: str = "") -> int:
    """``value`` as an int >= ``low`` (bools refused); ``what`` prefixes the message (e.g. ``"synthetic: "``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{what}{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_number(name: str, value: Any) -> float:
    """``value`` as a float (bools, non-numbers and NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def check_lr(lr: Any) -> float:
    """A step size: finite and > 0."""
    lr = check_number("lr", lr)
    if not lr > 0 or math.isinf(lr):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    return lr


def check_momentum(momentum: Any) -> float:
    """A momentum μ in [0, 1)."""
    momentum = check_number("momentum", momentum)
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return momentum


def check_weight_decay(wd: Any) -> float:
    """An L2 coefficient λ: finite and >= 0."""
    wd = check_number("weight_decay", wd)
    if not wd >= 0 or math.isinf(wd):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")
    return wd


def check_choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``; else the did-you-mean error every registry gives."""
    allowed = list(allowed)
    if value not in allowed:
        raise unknown_name_error(name, value, allowed)
    return value
