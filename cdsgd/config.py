"""One typed config for one run: TOML files plus ``key=value`` overrides.

Every key of :class:`Config` has a type and a commented default. A TOML
file sets any of them (flat, top-level keys; ``topology_params`` is a
table); ``key=value`` overrides on the command line come after the file and
are parsed as TOML values, falling back to a plain string
(``lr=0.05``, ``nesterov=false``, ``topology=torus``,
``topology_params.p=0.3``). Unknown keys and wrong types are refused with
the key, the value, and a suggestion::

    >>> load_config(overrides=["lrr=0.1"])
    Traceback (most recent call last):
    ...
    ValueError: config key 'lrr' is unknown; did you mean 'lr'? Known: algorithm, augment, ...

The resolved config is saved beside every result (``config.toml``) and
reads back to an equal Config (:func:`dump_config` / :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Sequence

from topologies import unknown_name_error

__all__ = ["Config", "load_config", "dump_config", "parse_override", "config_keys", "short_value"]


@dataclass
class Config:
    """A run's settings. Defaults: the README's main job (digits, 5 agents, ring, CDMSGD)."""

    # --- algorithm and executor
    algorithm: str = "cdmsgd"  # cdsgd | cdmsgd | sgd | msgd | fedavg | local
    executor: str = "sim"  # sim: all agents in one process; torch: one torchrun rank per agent
    device: str = "cpu"  # cpu (gloo between ranks) | cuda (nccl between ranks)
    comm_timeout: float = 120.0  # seconds any wait on a neighbour or collective may take (torch executor)
    overlap: bool = True  # exchange parameters during the backward pass (False: after it, for measurement)
    # --- communication graph
    topology: str = "ring"  # builder name (ring, torus, complete, ...) or a graph file path
    topology_params: dict = field(default_factory=dict)  # builder parameters, e.g. {p = 0.3, seed = 1}
    n_agents: int = 5
    mixing: str = "metropolis"  # weight rule: metropolis | max_degree | lazy_metropolis | uniform | weight
    # --- data
    dataset: str = "digits"  # digits | mnist | fashion-mnist | cifar10 | cifar100 | synthetic
    data_dir: str = "data"  # where data files are looked for (and downloaded to)
    download: bool = False  # fetch missing MNIST/Fashion-MNIST/CIFAR files (SHA-256 verified)
    partition: str = "iid"  # iid | classes | dirichlet
    dirichlet_alpha: float = 0.5  # Dirichlet concentration (partition = "dirichlet")
    min_shard_size: int = 10  # least samples per agent (partition = "dirichlet")
    train_subset: int = 0  # use only this many training samples (0: all), a seeded random subset
    test_subset: int = 0  # evaluate on this many test samples (0: all), a seeded random subset
    augment: bool = False  # random crop + horizontal flip per batch (image data sets)
    bucketing: int = 0  # sequence data: batches from this many length buckets per agent (0 or 1: off)
    bucket_rule: str = "optimal"  # bucket boundaries: optimal (least padding) | quantile | uniform
    # --- model
    model: str = "mlp"  # logreg | mlp | fcn | lenet | cnn | big_cnn | lstm | gru
    model_params: dict = field(default_factory=dict)  # model options, e.g. {hidden = 32, layers = 1, packed = true}
    # --- optimisation
    epochs: float = 30.0  # epochs of ceil(mean shard size / batch_size) synchronous steps
    batch_size: int = 32  # per agent
    lr: float = 0.05  # step size α (α₀ when diminishing)
    lr_schedule: str = "constant"  # constant | diminishing: α₀ / (1 + k/lr_tau)^lr_power
    lr_tau: float = 1000.0
    lr_power: float = 1.0  # in (0.5, 1]
    momentum: float = 0.95  # μ for cdmsgd, msgd and local (other algorithms take none)
    nesterov: bool = True  # Nesterov form (the paper's) or heavy ball
    weight_decay: float = 0.0
    local_steps: int = 0  # fedavg: local steps per round (0: use local_epochs)
    local_epochs: int = 1  # fedavg: local epochs per round
    fedavg_fraction: float = 1.0  # fedavg: fraction of agents sampled per round
    init: str = "same"  # same | independent initial parameters across agents
    strategy: str = "auto"  # simulator strategy: auto | loop | vmap
    exact: bool = False  # mix with ordered multiply-adds (as the runtime's exact mode)
    seed: int = 0
    # --- evaluation and output
    eval_every: int = 1  # evaluate every this many epochs (and at the end)
    eval_agents: int = 0  # evaluate this many agents, evenly spaced (0: all)
    eval_samples: int = 0  # evaluate agents on this many test samples (0: the whole test subset)
    eval_batch_size: int = 1024
    out: str = ""  # output folder ("": runs/<algorithm>-<topology>-<dataset>-<time>)
    overwrite: bool = False  # allow writing into an existing non-empty output folder
    save_params: bool = False  # also write params.pt: the final N×P parameters (torch.save)
    # --- reliability (docs/reliability.md)
    checkpoint_every: float = 0.0  # write a checkpoint every this many checkpoint_units (0: never)
    checkpoint_unit: str = "epochs"  # epochs (fractions allowed) | steps
    resume: bool = False  # continue from the latest complete checkpoint in out (fresh start if none)

    def identity(self) -> dict:
        """The keys that identify a run in summaries."""
        return {k: getattr(self, k) for k in ("algorithm", "topology", "n_agents", "mixing", "dataset",
                                               "partition", "model", "seed")}


_TYPES = {f.name: f.type for f in dataclasses.fields(Config)}
_PY = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict}


def short_value(v) -> str:
    """A config value as shown in folder names, tables and legends: a graph file by its stem.

    >>> short_value("experiments/topologies/paper_ring5.edgelist"), short_value(0.5)
    ('paper_ring5', '0.5')
    """
    from pathlib import Path

    from topologies import is_graph_file

    return Path(v).stem if isinstance(v, str) and is_graph_file(v) else str(v)


def config_keys() -> list[str]:
    """All config keys, in declaration order."""
    return list(_TYPES)


def _check_key(key: str) -> None:
    if key not in _TYPES:
        raise unknown_name_error("config key", key, _TYPES)


def _coerce(key: str, value: Any) -> Any:
    """``value`` as the type of ``key``, or a ValueError naming both."""
    want = _PY[_TYPES[key]]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        got = type(value).__name__
        raise ValueError(f"config key {key!r} must be {_TYPES[key]}, got {value!r} ({got})")
    if want is float and not math.isfinite(value):
        raise ValueError(f"config key {key!r} must be a finite number, got {value!r}")
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``"key=value"`` → (key, value): the value as TOML if it parses, else the raw string."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ValueError(f"override must look like key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _apply(cfg: Config, key: str, value: Any) -> None:
    if "." in key:
        head, sub = key.split(".", 1)
        _check_key(head)
        if _TYPES[head] != "dict":
            raise ValueError(f"config key {head!r} is not a table; {key!r} cannot be set")
        getattr(cfg, head)[sub] = value
        return
    _check_key(key)
    value = _coerce(key, value)
    setattr(cfg, key, dict(value) if isinstance(value, dict) else value)


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``key=value`` overrides."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {os.fspath(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {os.fspath(path)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {os.fspath(path)!r} is not UTF-8 text (byte {e.start}: "
                             f"{e.object[e.start:e.start + 1]!r})") from None
        for key, value in data.items():
            if isinstance(value, dict) and key in _TYPES and _TYPES[key] != "dict":
                raise ValueError(f"config file {os.fspath(path)!r}: {key!r} must be {_TYPES[key]}, got a table")
            _apply(cfg, key, value)
    for text in overrides:
        _apply(cfg, *parse_override(text))
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {v!r} as TOML")


def dump_config(cfg: Config) -> str:
    """The config as TOML text (all keys, resolved), readable by :func:`load_config`."""
    lines = ["# cdsgd run config (fully resolved)"]
    lines += [f"{k} = {_toml_value(getattr(cfg, k))}" for k in _TYPES]
    return "\n".join(lines) + "\n"
