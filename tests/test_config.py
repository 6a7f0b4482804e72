"""Config: defaults, TOML files, overrides, round trip, bad keys/types/values."""

from __future__ import annotations

import dataclasses

import pytest

from cdsgd.config import (Config, config_keys, dump_config, family_defaults, key_info, load_config, parse_override,
                          resolve_config, toml_value)
from cdsgd.models import MODELS
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


# ------------------------------------------------------------------ a model family's defaults


RECURRENT = {"batch_size": 8, "lr": 0.3, "grad_clip": 1.0}


def _declared(name):
    return key_info(name)["default"]


@pytest.mark.parametrize("model", ["lstm", "gru", "pgru"])
def test_recurrent_models_take_their_familys_defaults(model):
    cfg, taken = resolve_config(overrides=["dataset=plaid", f"model={model}"])
    assert taken == RECURRENT
    assert {k: getattr(cfg, k) for k in RECURRENT} == RECURRENT
    assert isinstance(cfg.batch_size, int) and isinstance(cfg.lr, float) and isinstance(cfg.grad_clip, float)
    others = [k for k in config_keys() if k not in RECURRENT and k not in ("dataset", "model")]
    assert all(getattr(cfg, k) == _declared(k) for k in others)
    validate_config(cfg)


@pytest.mark.parametrize("model", sorted(set(MODELS.names()) - {"lstm", "gru", "pgru"}))
def test_every_other_model_keeps_the_declared_defaults(model):
    cfg, taken = resolve_config(overrides=[f"model={model}"])
    assert taken == {} and family_defaults(model) == ("", {})
    assert all(getattr(cfg, k) == _declared(k) for k in config_keys() if k != "model")
    assert load_config(overrides=[f"model={model}"]) == cfg


def test_a_set_key_wins_over_the_family_default_even_at_the_declared_default(tmp_path):
    """Set on the command line or in a config file, a key keeps its value (0, 32, 0.05 included: set is set)."""
    cfg, taken = resolve_config(overrides=["model=lstm", "grad_clip=0", "batch_size=32"])
    assert (cfg.grad_clip, cfg.batch_size, cfg.lr) == (0.0, 32, 0.3) and taken == {"lr": 0.3}
    p = tmp_path / "c.toml"
    p.write_text('model = "gru"\nlr = 0.05\n')
    cfg, taken = resolve_config(p)
    assert (cfg.lr, cfg.batch_size, cfg.grad_clip) == (0.05, 8, 1.0) and set(taken) == {"batch_size", "grad_clip"}
    p.write_text('lr = 0.2\n')  # the model chosen on the command line, the step in the file: the file's step
    assert load_config(p, ["model=pgru"]).lr == 0.2
    p.write_text('model = "lstm"\n')  # the model from the file, the step from the command line
    assert load_config(p, ["lr=0.1"]).lr == 0.1
    assert load_config(p, ["model=mlp"]).lr == _declared("lr")  # the model is the last one given
    every = [f"{k}={toml_value(getattr(load_config(), k))}" for k in config_keys()]
    assert load_config(overrides=[*every, "model=lstm"]).grad_clip == 0.0  # a saved config: all keys set


def test_a_resolved_config_reads_back_unchanged(tmp_path):
    """config.toml (every key written) loads to the same config: its values are set, so no default applies."""
    cfg = load_config(overrides=["model=gru", "lr=0.2"])
    p = tmp_path / "config.toml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg and resolve_config(p)[1] == {}


def test_print_config_marks_the_values_taken_from_the_family(capsys, tmp_path):
    from cdsgd import cli

    assert cli.main(["run", "dataset=plaid", "model=lstm", "lr=0.2", "--print-config"]) == 0
    text = capsys.readouterr().out
    lines = dict(line.split(" = ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines["batch_size"] == "8  # recurrent models' default (other models: 32)"
    assert lines["grad_clip"] == "1.0  # recurrent models' default (other models: 0.0)"
    assert lines["lr"] == "0.2"  # set: no comment
    # a default names where it comes from: the algorithms' own declaration (one for every door)
    assert lines["momentum"] == "0.95  # every algorithm's default, cdsgd.base.checks.HYPER_DEFAULTS"
    assert "# model 'lstm' takes the recurrent models' defaults (lstm, gru, pgru) for batch_size, grad_clip" in text
    assert cli.main(["run", "model=mlp", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "recurrent" not in text and "batch_size = 32\n" in text
    assert "lr = 0.05  # cdsgd run's own default; make_algorithm, simulate and the optimizers need lr given\n" in text
    assert load_config(overrides=[]) == load_config(_written(tmp_path, text))  # the comments are TOML comments


def _written(tmp_path, text):
    p = tmp_path / "printed.toml"
    p.write_text(text)
    return p


def test_run_help_gives_the_family_defaults(capsys):
    from cdsgd import cli

    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    for k, v in RECURRENT.items():
        source = f" [{key_info(k)['source']}]" if key_info(k)["source"] else ""
        assert (f"  {k} = {toml_value(_declared(k))}{source} (lstm, gru, pgru: {toml_value(v)}, the recurrent "
                "models' default): ") in text
    # each algorithm hyperparameter's default says where it comes from; lr is the config's own
    assert "  momentum = 0.95 [every algorithm's default, cdsgd.base.checks.HYPER_DEFAULTS]: " in text
    assert "  lr = 0.05 [cdsgd run's own default; make_algorithm, simulate and the optimizers need lr given] (" in text
    assert "  batch_size = 32 (" in text and "  seed = 0: " in text  # the config's own: no source


def test_adamw_and_schedule_keys_round_trip_and_reach_the_rule(tmp_path):
    """``betas`` is a TOML array; ``lr_decay_steps`` 0 means "the run's total steps" and is not passed."""
    from cdsgd.run.plan import hyperparameters

    cfg = load_config(overrides=["optimizer=adamw", "betas=[0.8, 0.95]", "eps=1e-6", "lr_schedule=cosine",
                                 "lr_warmup=10", "lr_min=0.001"])
    assert cfg.betas == [0.8, 0.95] and key_info("betas")["default"] == [0.9, 0.999]
    p = tmp_path / "config.toml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    hyper = hyperparameters(cfg)
    assert hyper["optimizer"] == "adamw" and hyper["betas"] == [0.8, 0.95] and "lr_decay_steps" not in hyper
    assert hyperparameters(load_config(overrides=["lr_decay_steps=50"]))["lr_decay_steps"] == 50
    alg = validate_config(cfg).algorithm
    assert alg.adam.betas == (0.8, 0.95) and alg.step_size.warmup == 10 and alg.step_size.decay_steps is None


def test_target_loss_is_declared_beside_target_accuracy():
    keys = config_keys()
    assert keys.index("target_loss") == keys.index("target_accuracy") + 1
    assert key_info("target_loss")["default"] == 0.0
    with pytest.raises(ValueError, match=r"^target_loss must be >= 0 \(0 means off\), got -1\.0$"):
        validate_config(load_config(overrides=["target_loss=-1.0"]))
