r"""A sweep file expanded into its runs: :func:`load_sweep` (the file format: :mod:`cdsgd.run.sweep`).

Grid and zip keys may be dotted, ``topology_params.p = [0.05, 0.1]``: one
entry of a table-valued config key, merged into the base's table. A run's
folder is named from its varying keys (``algorithm=cdsgd,seed=0``; a table
by its entries, ``topology_params.p=0.05``). Overrides given on the command
line apply to every run (:func:`load_sweep`).

>>> import pathlib, tempfile
>>> f = pathlib.Path(tempfile.mkdtemp()) / "s.toml"
>>> _ = f.write_text('[base]\ntopology = "erdos_renyi"\ntopology_params = {seed = 1}\n'
...                  '[grid]\ntopology_params.p = [0.5, 0.9]\n')
>>> [(r.folder.name, r.config.topology_params) for r in load_sweep(f, "runs/er")]
[('topology_params.p=0.5', {'seed': 1, 'p': 0.5}), ('topology_params.p=0.9', {'seed': 1, 'p': 0.9})]
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, key_info, load_config, parse_override, short_value, toml_value
from .checkpoint import config_for_checkpoint
from .plan import validate_config

__all__ = ["SweepRun", "load_sweep", "run_identity"]

_SWEEP_KEYS = {"base", "grid", "zip", "exclude"}


@dataclass
class SweepRun:
    """One run of a sweep: its varying keys, resolved config and folder."""

    varying: dict
    config: Config
    folder: Path

    @property
    def identity(self) -> str:
        return run_identity(self.config)


def run_identity(cfg: Config) -> str:
    """Digest of the resolved config without where and how it is written (out, overwrite, checkpoints...)."""
    data = config_for_checkpoint(cfg.__dict__)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _folder_name(varying: dict) -> str:
    parts = []  # a table (topology_params = {p = 0.2}) by its entries: topology_params.p=0.2
    for k, v in varying.items():
        entries = v.items() if isinstance(v, dict) else [(None, v)]
        parts += [f"{k}.{s}={short_value(x)}" if s else f"{k}={short_value(x)}" for s, x in entries]
    name = re.sub(r"[^A-Za-z0-9=,._+-]", "_", ",".join(parts)) or "run"
    if len(name) > 150:  # keep it readable and stable: truncate, then disambiguate
        name = name[:130] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return name


def _as_list(where: str, key: str, value) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"sweep {where}.{key} must be a non-empty list of values, got {value!r}")
    return value


def _dotted(table: dict) -> dict:
    """``topology_params.p = [...]`` (TOML reads it as a table ``{"topology_params": {"p": [...]}}``) as the
    key ``"topology_params.p"``: one entry of a table-valued config key, merged into the base's table."""
    return {f"{k}.{s}" if isinstance(v, dict) else k: x
            for k, v in table.items() for s, x in (v.items() if isinstance(v, dict) else [(None, v)])}


def _tables(data: dict, key: str) -> list[dict]:
    """``[[key]]`` groups (or one ``[key]`` table) of a sweep file as a list of tables, dotted keys flattened."""
    value = data.get(key, [])
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"sweep {key!r} must be tables ([[{key}]] groups of config keys), got {value!r}")
    return [_dotted(t) for t in value]


def _setting(cfg: Config, key: str):
    """The value of ``key`` (``topology_params.p`` included) in ``cfg``; None for an entry it does not set."""
    head, _, sub = key.partition(".")
    key_info(head)  # an unknown key: the error with its did-you-mean
    return getattr(cfg, head).get(sub) if sub else getattr(cfg, head)


def _override(varying: dict, overrides: dict) -> dict:
    """The varying keys with the command line's overrides applied: a key the grid varies takes the
    override's value (so its runs keep their folders), an entry of a varying table is set in the table."""
    varying = dict(varying)
    for k, v in overrides.items():
        head, _, sub = k.partition(".")
        if k in varying:
            varying[k] = v
        elif sub and isinstance(varying.get(head), dict):
            varying[head] = {**varying[head], sub: v}
    return varying


def load_sweep(path: str | os.PathLike, out: str | os.PathLike, overrides: list[str] = ()) -> list[SweepRun]:
    """Expand a sweep file into its runs (validated), with folders under ``out``.

    ``overrides`` (``key=value`` as ``cdsgd run`` takes them) apply to every
    run, after the base and the grid: a key the grid varies takes the
    override's value in every run (runs that become the same are one run,
    in the folder the sweep gives it without the override), and
    exclusions are matched against the runs as overridden.
    """
    path = Path(path)
    given = dict(parse_override(o) for o in overrides)
    if set(given) & {"out", "overwrite", "resume"}:
        raise ValueError(f"{sorted(set(given) & {'out', 'overwrite', 'resume'})[0]}= is set per run by the sweep; "
                         "give the sweep folder with --out DIR")
    data = _read_sweep_file(path)
    base_file, base = _base(data)
    dims = _dimensions(data)
    excludes = _tables(data, "exclude")
    _check_disjoint(dims)
    runs, seen = [], {}
    out = Path(out)
    for varying in _combinations(dims, given):
        cfg = load_config(base_file, [f"{k}={toml_value(v)}" for k, v in {**base, **varying}.items()] + list(overrides))
        if any(all(_setting(cfg, k) == v for k, v in ex.items()) for ex in excludes):
            continue
        name = _folder_name(varying)
        cfg.out = str(out / name)
        if name in seen:
            if seen[name] == run_identity(cfg):
                continue  # an override made two runs one
            raise ValueError(f"two runs of the sweep would share the folder {name!r}")
        validate_config(cfg)
        seen[name] = run_identity(cfg)
        runs.append(SweepRun(varying=varying, config=cfg, folder=out / name))
    if not runs:
        raise ValueError(f"sweep file {str(path)!r} expands to no run (everything excluded?)")
    return runs


def _read_sweep_file(path: Path) -> dict:
    """The tables of the sweep file ``path``, of the sweep's keys only (``base``, ``grid``, ``zip``, ``exclude``)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"sweep file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"sweep file {str(path)!r} is a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"sweep file {str(path)!r} is not UTF-8 text (byte {e.start}: "
                         f"{e.object[e.start:e.start + 1]!r})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"sweep file {str(path)!r} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - _SWEEP_KEYS)
    if unknown:
        raise ValueError(f"sweep file {str(path)!r}: unknown table or key {unknown[0]!r}; "
                         f"allowed: base, grid, zip, exclude")
    return data


def _base(data: dict) -> tuple[str | None, dict]:
    """(the config file the runs start from or None, the config keys set on top of it) of the sweep's ``base``."""
    base_file, base = None, {}
    raw_base = data.get("base", {})
    if isinstance(raw_base, str):
        base_file = raw_base
    elif isinstance(raw_base, dict):
        base = dict(raw_base)
        base_file = base.pop("file", None)
        if base_file is not None and not isinstance(base_file, str):
            raise ValueError(f"sweep base.file must be a config file path (a string), got {base_file!r}")
    else:
        raise ValueError(f"sweep 'base' must be a config file path or a table of config keys, got {raw_base!r}")
    return base_file, base


def _dimensions(data: dict) -> list[list[dict]]:
    """The dimensions of the sweep, each a list of its points ({key: value}): the grid's keys, then the zip groups."""
    grid = data.get("grid", {})
    if not isinstance(grid, dict):
        raise ValueError("sweep 'grid' must be a table mapping config keys to lists")
    grid = _dotted(grid)
    dims: list[list[dict]] = [[{k: v} for v in _as_list("grid", k, vals)] for k, vals in grid.items()]
    zips = _tables(data, "zip")
    for number, z in enumerate(zips):
        if not z:
            raise ValueError(f"sweep zip group {number} is empty; give it keys with lists of one length")
        lengths = {k: len(_as_list("zip", k, v)) for k, v in z.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"sweep zip group keys must have lists of one length, got {lengths}")
        n = next(iter(lengths.values()))
        dims.append([{k: z[k][i] for k in z} for i in range(n)])
    return dims


def _check_disjoint(dims: list[list[dict]]) -> None:
    """Refuse a key that more than one dimension of the grid varies."""
    varying_keys: list[str] = []
    for dim in dims:
        for k in dim[0]:
            if k in varying_keys:
                raise ValueError(f"sweep key {k!r} appears in more than one grid/zip dimension")
            varying_keys.append(k)


def _combinations(dims: list[list[dict]], given: dict) -> Iterator[dict]:
    """Each point of the grid, in order: its varying keys, the command line's overrides applied (:func:`_override`)."""
    for combo in itertools.product(*dims) if dims else [()]:
        varying = {}
        for part in combo:
            varying.update(part)
        yield _override(varying, given)
