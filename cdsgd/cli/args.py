"""The arguments of the verbs that take a config: ``[CONFIG.toml] [key=value ...]``."""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["split_run_args"]


def split_run_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.toml] [key=value ...]`` → (the config file or None, the overrides): ``cdsgd run``,
    ``launch`` and ``sweep`` (whose file is a sweep file).

    >>> split_run_args(["experiments/ablations/topology.toml", "dataset=digits", "epochs=1"])
    ('experiments/ablations/topology.toml', ['dataset=digits', 'epochs=1'])
    """
    from ..config import config_keys

    path, overrides = None, []
    for i, a in enumerate(args):
        if i == 0 and (a.endswith(".toml") or os.path.isfile(a)):
            path = a  # the config file (its path may contain '=')
        elif "=" in a:
            overrides.append(a)
        elif a in config_keys() or a.split(".")[0] in config_keys():
            after = args[i + 1] if i + 1 < len(args) else "VALUE"
            raise ValueError(f"{a!r} is a config key: write {a}={after} (one word, no spaces around '=')")
        elif i == 0:
            path = a
        else:
            raise ValueError(f"expected key=value after the config file, got {a!r}")
    return path, overrides
