"""Config: defaults, TOML files, overrides, round trip, bad keys/types/values."""

from __future__ import annotations

import dataclasses

import pytest

from cdsgd.config import Config, dump_config, load_config, parse_override
from cdsgd.run.experiment import validate_config

CONTRACT_KEYS = ["algorithm", "topology", "n_agents", "mixing", "dataset", "data_dir", "partition",
                 "dirichlet_alpha", "model", "epochs", "batch_size", "lr", "lr_schedule", "momentum",
                 "weight_decay", "seed", "executor", "eval_every", "out"]


def test_contract_keys_exist():
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(CONTRACT_KEYS) <= names


def test_defaults_are_the_main_job():
    cfg = load_config()
    assert (cfg.dataset, cfg.n_agents, cfg.topology, cfg.mixing, cfg.algorithm) == \
        ("digits", 5, "ring", "metropolis", "cdmsgd")
    validate_config(cfg)


def test_file_then_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('# a comment\nalgorithm = "cdsgd"\nlr = 0.1\nepochs = 3\n[topology_params]\np = 0.4\n')
    cfg = load_config(p, ["lr=0.2", "topology=erdos_renyi", "topology_params.seed=3", "nesterov=false",
                          "out=runs/x y", "data_dir=/tmp/some/where"])
    assert cfg.algorithm == "cdsgd" and cfg.lr == 0.2 and cfg.epochs == 3.0 and isinstance(cfg.epochs, float)
    assert cfg.topology == "erdos_renyi" and cfg.topology_params == {"p": 0.4, "seed": 3}
    assert cfg.nesterov is False and cfg.out == "runs/x y" and cfg.data_dir == "/tmp/some/where"


def test_round_trip(tmp_path):
    cfg = load_config(overrides=["lr=0.125", "topology_params={k = 4, p = 0.25}", "topology=small_world",
                                 'out="a \\"quoted\\" name"', "epochs=2.5", "seed=7"])
    p = tmp_path / "config.toml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    assert load_config(p, ["seed=8"]).seed == 8


def test_parse_override_values():
    assert parse_override("lr=1e-3") == ("lr", 0.001)
    assert parse_override("n_agents = 8") == ("n_agents", 8)
    assert parse_override("topology=ring") == ("topology", "ring")
    assert parse_override('topology="ring"') == ("topology", "ring")
    assert parse_override("download=true") == ("download", True)


BAD = [
    (["lrr=0.1"], ValueError, r"config key 'lrr' is unknown; did you mean 'lr'\?"),
    (["topolgy=ring"], ValueError, r"config key 'topolgy' is unknown; did you mean 'topology'\?"),
    (["n_agents=2.5"], ValueError, r"config key 'n_agents' must be int, got 2.5 \(float\)"),
    (["n_agents=true"], ValueError, r"config key 'n_agents' must be int, got True \(bool\)"),
    (["lr=fast"], ValueError, r"config key 'lr' must be float, got 'fast' \(str\)"),
    (["lr=nan"], ValueError, r"config key 'lr' must be a finite number, got nan"),
    (["nesterov=1"], ValueError, r"config key 'nesterov' must be bool, got 1 \(int\)"),
    (["topology=5"], ValueError, r"config key 'topology' must be str, got 5 \(int\)"),
    (["lr.x=1"], ValueError, r"config key 'lr' is not a table"),
    (["noequals"], ValueError, r"override must look like key=value, got 'noequals'"),
]


@pytest.mark.parametrize("overrides,exc,pattern", BAD, ids=[b[0][0] for b in BAD])
def test_bad_overrides(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        load_config(overrides=overrides)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file '.*nope.toml' does not exist"):
        load_config(tmp_path / "nope.toml")
    p = tmp_path / "bad.toml"
    p.write_text("lr = = 3\n")
    with pytest.raises(ValueError, match=r"is not valid TOML"):
        load_config(p)
    p.write_text("[lr]\nx = 1\n")
    with pytest.raises(ValueError, match=r"'lr' must be float, got a table"):
        load_config(p)


VALUE_BAD = [
    ("algorithm=cdsdg", r"algorithm 'cdsdg' is unknown; did you mean 'cdsgd'\?"),
    ("executor=mpi", r"executor 'mpi' is unknown; Known: sim"),
    ("mixing=metropolis_hastings", r"mixing rule 'metropolis_hastings' is unknown; did you mean 'metropolis'\?"),
    ("dataset=mnsit", r"data set 'mnsit' is unknown; did you mean 'mnist'\?"),
    ("partition=noniid", r"partition 'noniid' is unknown"),
    ("model=resnet", r"model 'resnet' is unknown"),
    ("n_agents=0", r"^n_agents must be >= 1 \(>= 2 for an algorithm that mixes over a graph\), got 0$"),
    ("epochs=0", r"epochs must be > 0, got 0"),
    ("batch_size=0", r"batch_size must be >= 1, got 0"),
    ("train_subset=-1", r"train_subset must be >= 0 \(0 means all/off\), got -1"),
    ("eval_steps=-1", r"eval_steps must be >= 0 \(0 means off\), got -1"),
    ("eval_steps=2.5", r"config key .eval_steps. must be int, got 2.5"),
    ("dirichlet_alpha=-1", r"dirichlet_alpha must be > 0"),
    ("strategy=gpu", r"strategy 'gpu' is unknown"),
]


@pytest.mark.parametrize("override,pattern", VALUE_BAD, ids=[v[0] for v in VALUE_BAD])
def test_bad_values(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_config(load_config(overrides=[override]))
