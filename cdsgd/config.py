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

A key that neither sets takes its declared default, or its model family's
(:data:`FAMILY_DEFAULTS`: the recurrent models ``lstm``, ``gru``, ``pgru``
clip gradients and take a smaller batch and a larger step, the settings
measured to learn). The resolved config is saved beside every result (``config.toml``) and
reads back to an equal Config (:func:`dump_config` / :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from topologies import unknown_name_error

from .base.checks import (BETAS, EPS, FEDAVG_FRACTION, HYPER_DEFAULTS, LR, LR_GAMMA, LR_MIN, LR_POWER, LR_SCHEDULES,
                          LR_TAU, MOMENTUM, OPTIMIZERS, OUTER_LR, OUTER_MIXINGS, WEIGHT_DECAY, Bounds, Choices, Numbers,
                          check_choice)

__all__ = ["ALGORITHMS_DEFAULT", "Config", "FAMILY_DEFAULTS", "IDENTITY_KEYS", "VOLATILE_KEYS", "check_ranges",
           "config_keys", "dump_config", "family_defaults", "hyper_key", "key", "key_info", "load_config",
           "parse_override", "resolve_config", "short_value", "toml_value"]

#: where the default of an algorithm hyperparameter comes from (a key declared with :func:`hyper_key`)
ALGORITHMS_DEFAULT = "every algorithm's default, cdsgd.base.checks.HYPER_DEFAULTS"



def key(default: Any, help: str, *, choices: Sequence[str] | Choices = (), registry: str = "",
        bounds: Bounds | Numbers | None = None, low: float | None = None, above: float | None = None, note: str = "",
        unit: str = "", volatile: bool = False, identity: bool = False, unset: Any = None, overridden_by: str = "",
        source: str = ""):
    """A config field with everything known about it, declared once, next to the field.

    ``help`` is the text of ``--help`` and docs; ``choices`` the allowed
    names (a :class:`~cdsgd.base.checks.Choices`, shared with the layer that
    takes the value, is checked with its own message), or ``registry`` the registry
    that holds them (resolved by the validation door,
    :func:`cdsgd.run.plan.validate_config`); ``bounds`` the allowed interval
    (a :class:`~cdsgd.base.checks.Bounds`, e.g. the algorithms' own, or a
    :class:`~cdsgd.base.checks.Numbers` for a list of them), or
    the shorthand ``low`` (>=) or ``above`` (>), with ``note``/``unit`` for
    its message; ``volatile``: where or how, not what, is computed (may
    differ between a run and its resumption, and never identifies a run);
    ``identity``: names the run in summaries; ``unset``: the value that
    means "not given" to the algorithm (None: every value is given);
    ``overridden_by``: another key that, when given, makes this one not
    passed to the algorithm; ``source``: where the default comes from, when
    it is not the config's own choice (``--help`` and ``--print-config`` say
    it: e.g. :data:`ALGORITHMS_DEFAULT`, see :func:`hyper_key`).
    """
    if low is not None or above is not None:
        if bounds is not None or (low is not None and above is not None):
            raise TypeError("declare one of bounds, low and above")
        bounds = Bounds(low=above if low is None else low, low_open=low is None, unit=unit, note=note)
    meta = {"help": help, "choices": choices if isinstance(choices, Choices) else tuple(choices),
            "registry": registry, "bounds": bounds, "volatile": volatile, "identity": identity, "unset": unset,
            "overridden_by": overridden_by, "source": source}
    if isinstance(default, Mapping):
        return field(default_factory=lambda: dict(default), metadata=meta)
    if isinstance(default, (list, tuple)):  # a list key (betas): TOML's arrays; a tuple default read as a list
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def hyper_key(name: str, help: str, **meta):
    """The config key of algorithm hyperparameter ``name``: :func:`key` with the algorithms' own default
    (:data:`~cdsgd.base.checks.HYPER_DEFAULTS`, declared once for every door), and says so (``source``)."""
    return key(HYPER_DEFAULTS[name], help, source=ALGORITHMS_DEFAULT, **meta)


@dataclass
class Config:
    """A run's settings. Defaults: the README's main job (digits, 5 agents, ring, CDMSGD)."""

    # --- algorithm and executor
    algorithm: str = key("cdmsgd", "update rule: cdsgd | cdmsgd | dsgt | d2 | qg_dsgdm | sgp | choco | beer | "
                         "relaysum | adpsgd | sgd | msgd | fedavg | local | diloco | noloco",
                         registry="algorithm", identity=True)
    executor: str = key("sim", "sim: all agents in one process; torch: torchrun ranks, each holding "
                        "n_agents/ranks agents", choices=("sim", "torch"))
    device: str = key("cpu", "cpu (gloo between ranks) | cuda (nccl between ranks)", choices=("cpu", "cuda"))
    comm_timeout: float = key(120.0, "seconds any wait on a neighbour or collective may take (torch executor)",
                              above=0, unit=" seconds", volatile=True)
    overlap: bool = key(True, "exchange parameters during the backward pass (False: after it, for measurement)")
    membership: str = key("fixed", "fixed: a lost peer stops the run | elastic: the run goes on over the agents online "
                          "(network_params churn, ranks lost)", choices=("fixed", "elastic"), identity=True)
    min_ranks: int = key(0, "elastic: each step waits up to comm_timeout for a replacement while fewer ranks are live "
                         "(0: never)", low=0, volatile=True)
    # --- communication graph
    topology: str = key("ring", "builder name (ring, torus, complete, ...), time-varying schedule "
                        "(one_peer_exponential, random_matching) or a graph file path; not used by sgd, msgd, "
                        "fedavg, local (no graph)", identity=True)
    topology_params: dict = key({}, "builder parameters, e.g. {p = 0.3, seed = 1}")
    n_agents: int = key(5, "number of agents", low=1, identity=True,
                        note=" (>= 2 for an algorithm that mixes over a graph)")
    mixing: str = key("metropolis", "weight rule: metropolis | max_degree | lazy_metropolis | uniform | weight",
                      registry="mixing", identity=True)
    # --- data
    dataset: str = key("digits", "digits | mnist | fashion-mnist | mnist5k | cifar10 | cifar100 | synthetic | "
                       "plaid | japanese_vowels | synthetic_seq | fortunes | python_code (byte-level text) | "
                       "package.module:loader (your own)",
                       registry="dataset", identity=True)
    dataset_params: dict = key({}, "data set options, e.g. {subsample = 1} for plaid (its full-length series), "
                               "{context = 128} for text (its window length in bytes); "
                               "each data set's options: docs/data.md")
    data_dir: str = key("data", "where data files are looked for (and downloaded to)")
    download: bool = key(False, "fetch missing MNIST/Fashion-MNIST/CIFAR files (SHA-256 verified)", volatile=True)
    partition: str = key("iid", "iid | classes | dirichlet", registry="partition", identity=True)
    dirichlet_alpha: float = key(0.5, "Dirichlet concentration (partition = \"dirichlet\")", above=0)
    min_shard_size: int = key(10, "least samples per agent (partition = \"dirichlet\")", low=1)
    train_subset: int = key(0, "use only this many training samples (0: all), a seeded random subset",
                            low=0, note=" (0 means all/off)")
    test_subset: int = key(0, "evaluate on this many test samples (0: all), a seeded random subset",
                           low=0, note=" (0 means all/off)")
    augment: bool = key(False, "random crop + horizontal flip per batch (image data sets)")
    bucketing: int = key(0, "sequence data: batches from this many length buckets per agent (0 or 1: off)",
                         low=0, note=" (0 means all/off)")
    bucket_rule: str = key("optimal", "bucket boundaries: optimal (least padding) | quantile | uniform",
                           registry="bucket_rule")
    bucket_sync: bool = key(False, "bucketing: every agent takes its batch from the same bucket at each step "
                            "(common boundaries over all shards, a shared seeded bucket sequence)")
    bucket_fill: bool = key(False, "bucketing: a bucket's last, partial batch is filled up from the next longer "
                            "bucket (every batch full but an epoch's last; needs bucket_sync=false)")
    # --- model
    model: str = key("mlp", "logreg | mlp | fcn | lenet | cnn | big_cnn | lstm | gru | pgru | gpt (text: a decoder-"
                     "only transformer; model_params layers, heads, width, context, dropout) | "
                     "package.module:factory (your own)", registry="model",
                     identity=True)
    model_params: dict = key({}, "model options, e.g. {hidden = 32, layers = 1, packed = true}")
    # --- optimisation
    epochs: float = key(30.0, "epochs of ceil(mean shard size / batch_size) synchronous steps", above=0)
    batch_size: int = key(32, "per agent", low=1)
    # the bounds, schedules and defaults below are the algorithms' own (cdsgd.base.checks), so that a bad value is
    # refused here, before any run starts, with the message make_algorithm gives, and a key left unset trains with
    # the value make_algorithm, simulate and the optimizers default to (hyper_key). lr has no such default: the API
    # doors need it given; 0.05 is the config's, the default job's (digits, MLP) step size
    lr: float = key(0.05, "step size α (α₀ when diminishing)", bounds=LR,
                    source="cdsgd run's own default; make_algorithm, simulate and the optimizers need lr given")
    lr_schedule: str = hyper_key("lr_schedule", f"{LR_SCHEDULES}: constant α₀; diminishing α₀ / (1 + k/lr_tau)^lr_power; "
                                 "cosine lr_min + (α₀ − lr_min)·½(1 + cos(π·min(k, K)/K)), K = lr_decay_steps or "
                                 "the run's total steps; step α₀·lr_gamma^⌊k/lr_step_size⌋", choices=LR_SCHEDULES)
    lr_tau: float = hyper_key("lr_tau", "τ of the diminishing schedule", bounds=LR_TAU)
    lr_power: float = hyper_key("lr_power", f"p of the diminishing schedule, {LR_POWER}", bounds=LR_POWER)
    lr_min: float = hyper_key("lr_min", "α_min, the step size a cosine schedule decays to (<= lr)", bounds=LR_MIN)
    lr_decay_steps: int = key(0, "K, the steps a cosine schedule decays over (0: the run's total steps)", low=0,
                              note=" (0 means the run's total steps)", unset=0,
                              source=ALGORITHMS_DEFAULT + " (none, written 0)")
    lr_step_size: int = hyper_key("lr_step_size", "s of the step schedule: α₀·lr_gamma^⌊k/s⌋", low=1)
    lr_gamma: float = hyper_key("lr_gamma", f"γ of the step schedule, {LR_GAMMA}", bounds=LR_GAMMA)
    lr_warmup: int = hyper_key("lr_warmup", "linear warm-up steps w, for every schedule: α_k scaled by (k + 1)/w "
                               "for k < w (0: none)", low=0, note=" (0 means none)")
    momentum: float = hyper_key("momentum", "μ of every algorithm that takes one (all but cdsgd, sgd, fedavg; "
                                "unused under optimizer=adamw, whose β1 is the momentum)",
                                bounds=MOMENTUM)
    nesterov: bool = hyper_key("nesterov", "Nesterov form (the paper's) or heavy ball")
    weight_decay: float = hyper_key("weight_decay", "λ: the L2 term g + λx (optimizer=sgd); decoupled, "
                                    "x ← x − αλx, under optimizer=adamw", bounds=WEIGHT_DECAY)
    optimizer: str = hyper_key("optimizer", f"each agent's local optimizer, {OPTIMIZERS}: the rule's own SGD "
                               "(and momentum), or AdamW's direction m̂/(√v̂ + ε) + λx in place of the gradient "
                               "(cdsgd, cdmsgd, dsgt, sgd, msgd, fedavg, local, diloco, noloco; momentum and "
                               "nesterov unused: β1 is the momentum; docs/algorithms.md); auto: the rule's default "
                               "(adamw for diloco and noloco, sgd for the others)", choices=OPTIMIZERS)
    betas: list = hyper_key("betas", f"AdamW's (β1, β2), {BETAS}", bounds=BETAS)
    eps: float = hyper_key("eps", "AdamW's ε, added to √v̂", bounds=EPS)
    grad_clip: float = key(0.0, "largest norm of each agent's gradient: g_j scaled by min(1, c/‖g_j‖₂) (0: off)",
                           low=0, note=" (0 means off)")
    local_steps: int = key(0, "H: local steps per communication (0: not given: fedavg uses local_epochs, diloco "
                           "and noloco 50, the others 1); periodic gossip for cdsgd, cdmsgd, qg_dsgdm, sgp (Π = I "
                           "between communications); refused by the rules that must communicate every step", low=0,
                           note=" (0 means all/off)", unset=0, source=ALGORITHMS_DEFAULT + " (none, written 0)")
    local_epochs: int = hyper_key("local_epochs", "fedavg: local epochs per round", low=1,
                                  overridden_by="local_steps")
    fedavg_fraction: float = hyper_key("fedavg_fraction", "fedavg: fraction of agents sampled per round",
                                       bounds=FEDAVG_FRACTION)
    # --- local steps and an outer optimizer (docs/algorithms.md: diloco, noloco)
    outer_lr: float = hyper_key("outer_lr", "diloco, noloco: the outer step size η", bounds=OUTER_LR)
    outer_momentum: float = hyper_key("outer_momentum", "diloco (Nesterov), noloco (heavy ball): the outer "
                                      "momentum μ", bounds=MOMENTUM)
    outer_mixing: str = hyper_key("outer_mixing", f"diloco: how pseudo-gradients are averaged, {OUTER_MIXINGS} "
                                  "(allreduce: over every agent; graph: with the topology's W)", choices=OUTER_MIXINGS)
    fragments: int = hyper_key("fragments", "diloco: F fragments of whole parameter tensors, synchronised in turn "
                               "(Streaming DiLoCo)", low=1)
    overlap_steps: int = hyper_key("overlap_steps", "diloco: τ inner steps a fragment's outer step overlaps before "
                                   "it is applied (0: none, < local_steps)", low=0, note=" (0 means none)")
    error_feedback: bool = hyper_key("error_feedback", "diloco with a compression: add each agent's residual of "
                                     "what compression dropped to its next pseudo-gradient (SparseLoCo)")
    group_size: int = hyper_key("group_size", "noloco: agents per random group each outer step (divides n_agents)",
                                low=2)
    # --- communication-constrained rules (docs/algorithms.md: choco, beer, relaysum, diloco)
    compression: str = hyper_key("compression", "choco, beer, diloco: what each message is compressed with: none | top_k | "
                                 "random_k | sign | qsgd (docs/algorithms.md gives each one's bytes)",
                                 registry="compression", identity=True)
    compression_params: dict = hyper_key("compression_params", "compressor options, e.g. {ratio = 0.01} (top_k, "
                                         "random_k), {levels = 16} (qsgd); {}: the compressor's own defaults")
    consensus_step: float | str = hyper_key("consensus_step", "choco, beer: the consensus step γ in (0, 1], or "
                                            "\"auto\": tuned before training on a simulated consensus problem (the "
                                            "run says what it chose)")
    # --- simulated network (docs/network.md)
    network: str = key("none", "simulated network clock: none | datacenter | lan | wan | edge (a preset), giving "
                       "metrics.csv's sim_seconds; network_params alone defines a custom one", identity=True)
    network_params: dict = key({}, "overrides of the network: bandwidth_mbps, latency_ms, compute_ms (absent: "
                               "measured), stragglers, straggler_slowdown, drop, link_failure, agents_per_host, "
                               "churn, churn_down_steps, churn_trace")
    target_accuracy: float = key(0.0, "a test accuracy to reach: summary.json and the sweep's results.csv give the "
                                 "steps and simulated seconds to it (0: off)", low=0, note=" (0 means off)")
    target_loss: float = key(0.0, "a test loss to reach (nats per token for text): summary.json and the sweep's "
                             "results.csv give the steps and simulated seconds to reach it (0: off)", low=0,
                             note=" (0 means off)")
    init: str = key("same", "same | independent initial parameters across agents", choices=("same", "independent"))
    strategy: str = key("auto", "simulator strategy: auto | loop | vmap", choices=("auto", "loop", "vmap"))
    exact: bool = key(False, "mix with ordered multiply-adds (as the runtime's exact mode)")
    seed: int = key(0, "root of every random stream", low=0, note=" (0 means all/off)", identity=True)
    # --- evaluation and output
    eval_every: int = key(1, "evaluate every this many epochs (and at the end)", low=1)
    eval_steps: int = key(0, "evaluate every this many steps instead of eval_every epochs (0: off), for a time "
                             "to accuracy finer than an epoch", low=0, note=" (0 means off)")
    eval_agents: int = key(0, "evaluate this many agents, evenly spaced (0: all up to 32, else 32; summary.json's "
                              "evaluated_agents names them)", low=0, note=" (0 means automatic)")
    eval_samples: int = key(0, "evaluate agents on this many test samples (0: the whole test subset)", low=0,
                            note=" (0 means all/off)")
    eval_batch_size: int = key(1024, "test inputs per forward pass in evaluation", low=1)
    out: str = key("", "output folder (\"\": runs/<algorithm>-<topology>-<dataset>-<time>)", volatile=True)
    overwrite: bool = key(False, "allow writing into an existing non-empty output folder", volatile=True)
    save_params: bool = key(False, "also write params.pt: the final N×P parameters (torch.save)")
    logger: str = key("none", "none | tensorboard: also write TensorBoard event files into out (every metrics.csv "
                      "column per evaluation, the training loss per step); needs the tensorboard extra",
                      choices=("none", "tensorboard"), volatile=True)
    # --- reliability (docs/reliability.md)
    checkpoint_every: float = key(0.0, "write a checkpoint every this many checkpoint_units (0: never)", low=0,
                                  note=" (0: no checkpoints)", volatile=True)
    checkpoint_unit: str = key("epochs", "epochs (fractions allowed) | steps", choices=("epochs", "steps"),
                               volatile=True)
    resume: bool = key(False, "continue from the latest complete checkpoint in out (fresh start if none)",
                       volatile=True)

    def identity(self) -> dict:
        """The keys that identify a run in summaries (declared with ``identity=True``)."""
        return {k: getattr(self, k) for k in IDENTITY_KEYS}


_TYPES = {f.name: f.type for f in dataclasses.fields(Config)}
_PY = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "list": list,
       "float | str": (float, str)}
_META = {f.name: f.metadata for f in dataclasses.fields(Config)}

#: keys that may differ between a run and its resumption (where and how, not what, is computed)
VOLATILE_KEYS = tuple(k for k, m in _META.items() if m["volatile"])
#: keys that identify a run in summaries
IDENTITY_KEYS = tuple(k for k, m in _META.items() if m["identity"])


def key_info(name: str) -> dict:
    """What is declared about config key ``name``: type, default, help, choices, registry, bounds, flags."""
    _check_key(name)
    f = Config.__dataclass_fields__[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return {"type": _TYPES[name], "default": default, **_META[name]}


def check_ranges(cfg: "Config") -> None:
    """Every declared choice and bound of ``cfg``, in declaration order; a ValueError naming the first bad value."""
    for name, m in _META.items():
        value = getattr(cfg, name)
        if isinstance(m["choices"], Choices):
            m["choices"].check(name, value)  # shared with the layer that takes the value: its message
        elif m["choices"]:
            check_choice(name, value, m["choices"])
        if m["bounds"] is not None:
            m["bounds"].check(name, value)


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
    if (want is float or want == (float, str)) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        got = type(value).__name__
        raise ValueError(f"config key {key!r} must be {_TYPES[key]}, got {value!r} ({got})")
    if isinstance(value, float) and not math.isfinite(value):
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


#: defaults of a model family: (family name, its models, {key: default}). A config file and ``key=value``
#: overrides always win; a key they leave unset takes the family's default instead of the declared one. The
#: recurrent models' defaults are the settings measured to learn (docs/sequences.md, "Settings that learn").
#: A model-family matter, applied by the config alone (cdsgd run, launch, sweep): make_algorithm, simulate and
#: the optimizers know no model family (lr is given there; batch_size and grad_clip are simulate's options).
FAMILY_DEFAULTS = (
    ("recurrent", ("lstm", "gru", "pgru"), {"batch_size": 8, "lr": 0.3, "grad_clip": 1.0}),
)


def family_defaults(model: str) -> tuple[str, dict]:
    """The family of ``model`` and the defaults it replaces: ``("", {})`` for a model that has none.

    >>> family_defaults("gru")
    ('recurrent', {'batch_size': 8, 'lr': 0.3, 'grad_clip': 1.0})
    >>> family_defaults("mlp")
    ('', {})
    """
    for family, models, defaults in FAMILY_DEFAULTS:
        if model in models:
            return family, dict(defaults)
    return "", {}


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``key=value`` overrides; a key neither sets
    takes the model family's default where there is one (:data:`FAMILY_DEFAULTS`)."""
    return resolve_config(path, overrides)[0]


def resolve_config(path: str | os.PathLike | None = None,
                   overrides: Sequence[str] = ()) -> tuple[Config, dict]:
    """:func:`load_config`'s config, and the family defaults it took: ``{key: value}`` for each key that the
    file and the overrides leave unset and the model's family sets (``{}`` for most models).

    >>> resolve_config(overrides=["model=lstm", "lr=0.1"])[1]
    {'batch_size': 8, 'grad_clip': 1.0}
    """
    cfg, given = Config(), set()
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
            given.add(key.split(".", 1)[0])
    for text in overrides:
        key, value = parse_override(text)
        _apply(cfg, key, value)
        given.add(key.split(".", 1)[0])
    taken = {k: _coerce(k, v) for k, v in family_defaults(cfg.model)[1].items() if k not in given}
    for k, v in taken.items():
        setattr(cfg, k, v)
    return cfg, taken


def toml_value(v: Any) -> str:
    """A value as TOML text (the inverse of the override parser)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {v!r} as TOML")


def dump_config(cfg: Config, taken: dict | None = None) -> str:
    """The config as TOML text (all keys, resolved), readable by :func:`load_config`; ``taken`` (the family
    defaults :func:`resolve_config` applied) marks those keys with a comment saying where they come from."""
    lines = ["# cdsgd run config (fully resolved)"]
    taken = taken or {}
    if taken:
        family, _ = family_defaults(cfg.model)
        models = next(m for f, m, _ in FAMILY_DEFAULTS if f == family)
        lines.append(f"# model {cfg.model!r} takes the {family} models' defaults ({', '.join(models)}) for "
                     f"{', '.join(taken)}, which are not set here; a key set in the config file or as key=value wins")
    for k in _TYPES:
        line = f"{k} = {toml_value(getattr(cfg, k))}"
        if k in taken:
            line += f"  # {family} models' default (other models: {toml_value(key_info(k)['default'])})"
        lines.append(line)
    return "\n".join(lines) + "\n"

