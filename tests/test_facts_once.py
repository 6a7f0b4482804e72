"""Each fact once: the algorithms' bounds and schedules are declared in cdsgd.base.checks and every door
(the config's validation, make_algorithm, the torch.optim classes, the executor) refuses a bad value with
the same message; the executor leaves the unknown-hyperparameter check to make_algorithm."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import CDMSGD, CDSGD, StepSize, make_algorithm
from cdsgd.algorithms.factory import UnknownHyperparameter
from cdsgd.base import checks
from cdsgd.base.checks import Bounds
from cdsgd.config import Config, check_ranges, key_info
from cdsgd.executor import Simulator, simulate
from cdsgd.mixers import MatrixMixer
from cdsgd.run import plan
from cdsgd.run.plan import validate_config

#: (config key, a bad value, an algorithm that takes the key, the one message both doors give)
BAD = [
    ("lr", -0.1, "cdsgd", r"^lr must be a finite number > 0, got -0\.1$"),
    ("lr", 0.0, "cdmsgd", r"^lr must be a finite number > 0, got 0\.0$"),
    ("momentum", 1.0, "cdmsgd", r"^momentum must be in \[0, 1\), got 1\.0$"),
    ("momentum", -0.5, "msgd", r"^momentum must be in \[0, 1\), got -0\.5$"),
    ("lr_power", 0.5, "cdsgd", r"^lr_power must be in \(0\.5, 1\] so that Σα = ∞ and Σα² < ∞, got 0\.5$"),
    ("lr_power", 1.5, "cdmsgd", r"^lr_power must be in \(0\.5, 1\] so that Σα = ∞ and Σα² < ∞, got 1\.5$"),
    ("lr_tau", 0.0, "cdsgd", r"^lr_tau must be > 0, got 0\.0$"),
    ("weight_decay", -1.0, "cdsgd", r"^weight_decay must be a finite number >= 0, got -1\.0$"),
    ("fedavg_fraction", 1.5, "fedavg", r"^fedavg_fraction must be in \(0, 1\], got 1\.5$"),
    ("fedavg_fraction", 0.0, "fedavg", r"^fedavg_fraction must be in \(0, 1\], got 0\.0$"),
    ("lr_schedule", "cosin", "cdsgd",
     r"^lr_schedule 'cosin' is unknown; did you mean 'cosine'\? allowed: constant, diminishing, cosine, step$"),
    ("optimizer", "adam", "cdsgd", r"^optimizer 'adam' is unknown; did you mean 'adamw'\? allowed: sgd, adamw, auto$"),
    ("eps", 0.0, "cdsgd", r"^eps must be a finite number > 0, got 0\.0$"),
    ("lr_gamma", 1.5, "cdsgd", r"^lr_gamma must be in \(0, 1\], got 1\.5$"),
]
IDS = [f"{k}={v}" for k, v, _, _ in BAD]

D, C = 3, 2


def _message(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def _config(key: str, value, algorithm: str) -> Config:
    cfg = Config(algorithm=algorithm)
    setattr(cfg, key, value)
    return cfg


def _shards(n=3, m=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(m, D, generator=g), torch.randint(0, C, (m,), generator=g)) for _ in range(n)]


def _ring(n=3):
    return topologies.mixing_matrix(topologies.build("ring", n))


@pytest.mark.parametrize("key,value,algorithm,pattern", BAD, ids=IDS)
def test_config_door_and_make_algorithm_refuse_alike(key, value, algorithm, pattern):
    from_config = _message(lambda: validate_config(_config(key, value, algorithm)))
    assert re.search(pattern, from_config), from_config
    hyper = {"lr": 0.1, key: value}
    assert _message(lambda: make_algorithm(algorithm, **hyper)) == from_config


@pytest.mark.parametrize("key,value,algorithm,pattern", BAD, ids=IDS)
def test_the_config_refuses_before_building_the_algorithm(key, value, algorithm, pattern, monkeypatch):
    def no_algorithm(*a, **k):
        raise AssertionError("validate_config reached make_algorithm with a bad value")

    monkeypatch.setattr(plan, "make_algorithm", no_algorithm)
    assert re.search(pattern, _message(lambda: check_ranges(_config(key, value, algorithm))))
    assert re.search(pattern, _message(lambda: validate_config(_config(key, value, algorithm))))


def test_the_config_refuses_a_bound_even_for_an_algorithm_that_ignores_the_key():
    # momentum is declared for every algorithm; a value outside its bounds is an error, not a no-op
    assert _message(lambda: validate_config(_config("momentum", 1.5, "cdsgd"))) == \
        "momentum must be in [0, 1), got 1.5"


@pytest.mark.parametrize("key,value,algorithm,pattern", [b for b in BAD if b[0] in ("lr", "momentum", "weight_decay")],
                         ids=[i for i, b in zip(IDS, BAD) if b[0] in ("lr", "momentum", "weight_decay")])
def test_the_torch_optimizers_refuse_alike(key, value, algorithm, pattern):
    from_config = _message(lambda: validate_config(_config(key, value, algorithm)))
    model = nn.Linear(D, C)
    hyper = {"lr": 0.1, key: value}
    assert _message(lambda: CDMSGD(model.parameters(), MatrixMixer(_ring()), **hyper)) == from_config
    if key != "momentum":
        assert _message(lambda: CDSGD(model.parameters(), MatrixMixer(_ring()), **hyper)) == from_config


@pytest.mark.parametrize("key,value,algorithm,pattern", BAD, ids=IDS)
def test_the_simulator_refuses_alike(key, value, algorithm, pattern):
    from_config = _message(lambda: validate_config(_config(key, value, algorithm)))
    hyper = {"lr": 0.1, key: value}
    W = _ring() if algorithm.startswith("cd") else None
    assert _message(lambda: simulate(lambda: nn.Linear(D, C), _shards(), W, algorithm, steps=1, **hyper)) == \
        from_config


def test_each_number_and_schedule_lives_once():
    """The config declares its keys with the very objects the checks use; help texts are derived from them."""
    for name, bounds in [("lr", checks.LR), ("momentum", checks.MOMENTUM), ("lr_power", checks.LR_POWER),
                         ("lr_tau", checks.LR_TAU), ("weight_decay", checks.WEIGHT_DECAY),
                         ("fedavg_fraction", checks.FEDAVG_FRACTION), ("lr_min", checks.LR_MIN),
                         ("lr_gamma", checks.LR_GAMMA), ("betas", checks.BETAS), ("eps", checks.EPS)]:
        assert key_info(name)["bounds"] is bounds, name
    assert key_info("lr_schedule")["choices"] is checks.LR_SCHEDULES
    assert key_info("optimizer")["choices"] is checks.OPTIMIZERS
    assert StepSize.SCHEDULES == checks.LR_SCHEDULES.names == ("constant", "diminishing", "cosine", "step")
    assert key_info("lr_schedule")["help"].startswith("constant | diminishing | cosine | step:")
    assert key_info("lr_power")["help"].endswith(", in (0.5, 1]")
    assert str(checks.MOMENTUM) == "in [0, 1)" and str(checks.LR) == "a finite number > 0"


def test_config_shorthand_bounds():
    assert key_info("n_agents")["bounds"] == Bounds(low=1, note=" (>= 2 for an algorithm that mixes over a graph)")
    assert key_info("epochs")["bounds"] == Bounds(low=0, low_open=True)
    assert key_info("comm_timeout")["bounds"] == Bounds(low=0, low_open=True, unit=" seconds")
    assert key_info("algorithm")["bounds"] is None


def test_bounds_check():
    assert checks.MOMENTUM.check("momentum", 0) == 0 and checks.check_momentum(0) == 0.0
    assert checks.check_lr(2) == 2.0 and isinstance(checks.check_lr(2), float)
    assert 1.0 in checks.LR_POWER and 0.5 not in checks.LR_POWER and float("nan") not in checks.MOMENTUM
    with pytest.raises(ValueError, match=r"^lr must be a finite number > 0, got inf$"):
        make_algorithm("cdsgd", lr=float("inf"))
    with pytest.raises(ValueError, match=r"^lr must be a number, got nan$"):
        make_algorithm("cdsgd", lr=float("nan"))
    with pytest.raises(ValueError, match=r"^momentum must be a number, got True$"):
        checks.check_momentum(True)
    with pytest.raises(ValueError, match=r"^x must be <= 2 \(two at most\), got 3$"):
        Bounds(high=2, note=" (two at most)").check("x", 3)


def test_unknown_hyperparameter_is_checked_by_make_algorithm_alone():
    with pytest.raises(UnknownHyperparameter, match=r"^algorithm 'cdsgd' takes no hyperparameter 'momentum'; "
                                                    r"allowed: lr, lr_schedule, lr_tau, lr_power, lr_min, "
                                                    r"lr_decay_steps, lr_step_size, lr_gamma, lr_warmup, "
                                                    r"weight_decay, optimizer, betas, eps, local_steps$") as e:
        make_algorithm("cdsgd", lr=0.1, momentum=0.9)
    assert isinstance(e.value, ValueError) and (e.value.algorithm, e.value.name) == ("cdsgd", "momentum")
    with pytest.raises(ValueError, match=r"^unknown option 'batchsize': not a Simulator option \(.*batch_size.*\) "
                                         r"nor a hyperparameter of algorithm 'sgd' "
                                         r"\(lr, .*weight_decay, optimizer, betas, eps, local_steps\)$") as e:
        Simulator(lambda: nn.Linear(D, C), _shards(), None, "sgd", lr=0.1, batchsize=4)
    assert isinstance(e.value.__context__, UnknownHyperparameter)  # make_algorithm's refusal, reworded
    with pytest.raises(ValueError, match=r"hyperparameters \['lr'\] given with a ready Algorithm"):
        Simulator(lambda: nn.Linear(D, C), _shards(), None, make_algorithm("sgd", lr=0.1), lr=0.1)
