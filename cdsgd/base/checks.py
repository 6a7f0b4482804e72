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

The bounds and choices of the algorithms' hyperparameters are declared here
once, as :class:`Bounds` and :class:`Choices` objects: the update rules
(:mod:`cdsgd.algorithms`) check their arguments with them and the config
(:mod:`cdsgd.config`) declares its keys with the same objects, so both doors
refuse a bad value with one message::

    >>> MOMENTUM.check("momentum", 1.0)
    Traceback (most recent call last):
    ...
    ValueError: momentum must be in [0, 1), got 1.0
    >>> str(LR_POWER), str(LR_SCHEDULES), str(BETAS)
    ('in (0.5, 1]', 'constant | diminishing | cosine | step', 'two numbers, each in [0, 1)')
    >>> OPTIMIZERS.check("optimizer", "adam")
    Traceback (most recent call last):
    ...
    ValueError: optimizer 'adam' is unknown; did you mean 'adamw'? allowed: sgd, adamw, auto

Their defaults are declared here once too, in :data:`HYPER_DEFAULTS`: the
algorithms' signatures, the ``torch.optim`` classes and the config's keys
read them from there, so ``cdsgd run``, :func:`~cdsgd.algorithms.make_algorithm`,
:func:`~cdsgd.simulate` and the optimizers train with the same values::

    >>> HYPER_DEFAULTS["momentum"], HYPER_DEFAULTS["nesterov"]
    (0.95, True)

Pure Python: importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable

from topologies import unknown_name_error

__all__ = ["BETAS", "EPS", "FEDAVG_FRACTION", "HYPER_DEFAULTS", "LR", "LR_GAMMA", "LR_MIN", "LR_POWER", "LR_SCHEDULES",
           "LR_TAU", "MOMENTUM", "OPTIMIZERS", "OUTER_LR", "OUTER_MIXINGS", "OUTER_RULE_DEFAULTS", "SCHEDULED_LR", "WEIGHT_DECAY", "Bounds", "Choices", "Numbers",
           "check_choice", "check_int", "check_lr", "check_momentum", "check_nesterov", "check_number",
           "check_weight_decay"]


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


@dataclass(frozen=True)
class Bounds:
    """An interval of allowed numbers, declared once and checked wherever a value enters.

    ``low``/``high``: the ends (None: unbounded on that side); ``low_open``/
    ``high_open``: the end itself is excluded; ``finite``: infinity is refused
    too; ``unit`` and ``note`` follow the interval in the error message.
    ``str(bounds)`` is the interval as the messages and help texts write it.

    >>> Bounds(low=0, low_open=True).check("epochs", 0)
    Traceback (most recent call last):
    ...
    ValueError: epochs must be > 0, got 0
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    unit: str = ""
    note: str = ""

    def __contains__(self, value: float) -> bool:
        if self.finite and math.isinf(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or bool(value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        prefix = "a finite number " if self.finite else ""
        if self.low is not None:
            return f"{prefix}{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{prefix}{'<' if self.high_open else '<='} {self.high:g}"
        return prefix.strip() or "a number"

    def check(self, name: str, value: Any) -> Any:
        """``value`` itself if it is a number within these bounds; else a ValueError naming ``name``, them and it."""
        check_number(name, value)  # bools, non-numbers and NaN get check_number's message
        if value not in self:
            raise ValueError(f"{name} must be {self}{self.unit}{self.note}, got {value!r}")
        return value


@dataclass(frozen=True)
class Choices:
    """The allowed names of a value, in order, declared once for every layer that takes it.

    ``str(choices)`` is ``"a | b"``, as help texts write the alternatives.
    """

    names: tuple[str, ...]

    def __iter__(self):
        return iter(self.names)

    def __str__(self) -> str:
        return " | ".join(self.names)

    def check(self, name: str, value: Any) -> str:
        """``value`` if it is one of the names; else a ValueError naming ``name``, ``value``, the closest name
        (when one is close) and the names."""
        if value not in self.names:
            close = difflib.get_close_matches(str(value), self.names, n=1, cutoff=0.6)
            hint = f" did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{name} {value!r} is unknown;{hint} allowed: {', '.join(self.names)}")
        return value


@dataclass(frozen=True)
class Numbers:
    """A fixed count of numbers, each within ``each`` (AdamW's ``betas``); checked as one value.

    >>> Numbers(2, Bounds(low=0, high=1, high_open=True)).check("betas", [0.9, 1.0])
    Traceback (most recent call last):
    ...
    ValueError: betas must be two numbers, each in [0, 1), got [0.9, 1.0]
    """

    count: int
    each: Bounds

    def __str__(self) -> str:
        words = {1: "one number", 2: "two numbers", 3: "three numbers"}
        return f"{words.get(self.count, f'{self.count} numbers')}, each {self.each}"

    def check(self, name: str, value: Any) -> tuple[float, ...]:
        """``value`` as a tuple of floats if it is a list or tuple of ``count`` numbers within ``each``; else
        a ValueError naming ``name``, what is allowed and ``value``."""
        ok = isinstance(value, (list, tuple)) and len(value) == self.count and all(
            not isinstance(v, bool) and isinstance(v, numbers.Real) and not math.isnan(v) and v in self.each
            for v in value)
        if not ok:
            raise ValueError(f"{name} must be {self}, got {value!r}")
        return tuple(float(v) for v in value)


# The algorithms' hyperparameters (cdsgd.algorithms.make_algorithm, the torch.optim classes, the config keys).
#: step size α: finite and > 0
LR = Bounds(low=0, low_open=True, finite=True)
#: the lr a torch scheduler may set in an optimizer's param_groups: finite and >= 0 (annealed to 0 at the end)
SCHEDULED_LR = Bounds(low=0, finite=True)
#: momentum μ: in [0, 1)
MOMENTUM = Bounds(low=0, high=1, high_open=True)
#: L2 coefficient λ: finite and >= 0
WEIGHT_DECAY = Bounds(low=0, finite=True)
#: τ of the diminishing step size: > 0
LR_TAU = Bounds(low=0, low_open=True)
#: p of the diminishing step size: in (0.5, 1], the condition under which CDSGD reaches exact consensus
LR_POWER = Bounds(low=0.5, high=1, low_open=True, note=" so that Σα = ∞ and Σα² < ∞")
#: the step-size schedules α_k (cdsgd.algorithms.StepSize)
LR_SCHEDULES = Choices(("constant", "diminishing", "cosine", "step"))
#: the floor α_min a cosine schedule decays to: finite and >= 0
LR_MIN = Bounds(low=0, finite=True)
#: γ of the step schedule (α₀·γ^⌊k/s⌋): in (0, 1]
LR_GAMMA = Bounds(low=0, high=1, low_open=True)
#: each agent's local optimizer (cdsgd.algorithms.local_optim): the rule's own SGD arithmetic, or AdamW; auto: the
#: rule's default (adamw for diloco and noloco, as their papers train; sgd for the others)
OPTIMIZERS = Choices(("sgd", "adamw", "auto"))
#: AdamW's (β1, β2): two numbers, each in [0, 1)
BETAS = Numbers(2, Bounds(low=0, high=1, high_open=True))
#: AdamW's ε: finite and > 0
EPS = Bounds(low=0, low_open=True, finite=True)
#: the fraction of agents FedAvg samples per round: in (0, 1]
FEDAVG_FRACTION = Bounds(low=0, high=1, low_open=True)
#: the outer step size of DiLoCo and NoLoCo: finite and > 0
OUTER_LR = Bounds(low=0, low_open=True, finite=True)
#: how DiLoCo averages its pseudo-gradients: an all-reduce over every agent, or the graph's mixing W
OUTER_MIXINGS = Choices(("allreduce", "graph"))

#: The default of every hyperparameter, one value per key for every algorithm that takes it, declared once: the
#: update rules' signatures (cdsgd.algorithms), the torch.optim classes (cdsgd.algorithms.optim) and the config's
#: keys (cdsgd.config) read it from here, so that every door trains an algorithm with the same values. ``lr`` has
#: none: the API doors need it given (the config's 0.05 is the default job's step size, cdsgd.config).
#: ``lr_decay_steps`` None: a cosine decays over the run's total steps (the config writes it 0).
#: ``local_steps`` None: FedAvg rounds of ``local_epochs`` epochs (the config writes it 0); ``compression_params``
#: empty: each compressor's own defaults (cdsgd.algorithms.compression). Read-only: copy before changing.
HYPER_DEFAULTS = MappingProxyType({
    "lr_schedule": "constant",
    "lr_tau": 1000.0,
    "lr_power": 1.0,
    "lr_min": 0.0,
    "lr_decay_steps": None,  # cosine: decay over the run's total steps (the config writes 0)
    "lr_step_size": 1000,
    "lr_gamma": 0.1,  # torch.optim.lr_scheduler.StepLR's
    "lr_warmup": 0,
    "weight_decay": 0.0,
    "optimizer": "auto",  # each rule's own: sgd, adamw for diloco and noloco
    "betas": (0.9, 0.999),  # torch.optim.AdamW's
    "eps": 1e-8,
    "momentum": 0.95,  # CDMSGD's (the paper's), for every rule with a momentum
    "nesterov": True,
    "local_steps": None,
    "local_epochs": 1,  # the paper's FedAvg: one local epoch per round
    "fedavg_fraction": 1.0,
    "compression": "none",
    "compression_params": MappingProxyType({}),
    "consensus_step": "auto",
    "outer_lr": 0.7,  # DiLoCo's (Douillard et al. 2023) and NoLoCo's
    "outer_momentum": 0.9,  # DiLoCo's Nesterov μ, the NoLoCo code's default
    "outer_mixing": "allreduce",
    "group_size": 2,  # NoLoCo's experiments: pairs
    "fragments": 1,
    "overlap_steps": 0,
    "error_feedback": False,
})


#: The two rules of local steps and an outer optimizer (diloco, noloco) differ from HYPER_DEFAULTS here: H = 50
#: inner steps per outer step (the config writes it unset, 0); their papers' runs use 50 to 500.
OUTER_RULE_DEFAULTS = MappingProxyType({"local_steps": 50})


def check_lr(lr: Any) -> float:
    """A step size as a float, within :data:`LR`."""
    return float(LR.check("lr", lr))


def check_momentum(momentum: Any) -> float:
    """A momentum μ as a float, within :data:`MOMENTUM`."""
    return float(MOMENTUM.check("momentum", momentum))


def check_nesterov(nesterov: Any) -> bool:
    """``nesterov`` if it is True or False (the Nesterov form of momentum, or heavy ball)."""
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be true or false, got {nesterov!r}")
    return nesterov


def check_weight_decay(wd: Any) -> float:
    """An L2 coefficient λ as a float, within :data:`WEIGHT_DECAY`."""
    return float(WEIGHT_DECAY.check("weight_decay", wd))


def check_choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``; else the did-you-mean error every registry gives."""
    allowed = list(allowed)
    if value not in allowed:
        raise unknown_name_error(name, value, allowed)
    return value
