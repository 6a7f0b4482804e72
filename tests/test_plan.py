"""The validation door (cdsgd.run.plan): one check of a config, before any data is loaded."""

from __future__ import annotations

import numpy as np
import pytest

import topologies
from cdsgd.run import plan as P
from cdsgd.config import VOLATILE_KEYS, load_config


def _no_data(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("validate_config must not load data")
    monkeypatch.setattr(P, "load_dataset", refuse)


@pytest.mark.parametrize("overrides,message", [
    (["dataset=plaid", "model=pgru", "model_params={cf = 1}"], r"cf must be an integer >= 2, got 1"),
    (["model=mlp", "model_params={hiden = [32]}"], r"bad options \['hiden'\] .*did you mean 'hidden'"),
    (["model=lstm", "model_params={hidden = 0}"], r"model option hidden must be an integer >= 1, got 0"),
])
def test_model_options_are_checked_before_any_data(monkeypatch, overrides, message):
    _no_data(monkeypatch)
    with pytest.raises(ValueError, match=message):
        P.validate_config(load_config(overrides=overrides))


def test_the_plan_holds_what_was_built(monkeypatch):
    _no_data(monkeypatch)
    plan = P.validate_config(load_config(overrides=["topology=torus", "n_agents=9", "mixing=max_degree",
                                                    "algorithm=cdmsgd", "momentum=0.5"]))
    expect = topologies.mixing_matrix(topologies.build("torus", 9), "max_degree")
    np.testing.assert_array_equal(plan.W, expect)
    assert plan.spectral_gap.gap == pytest.approx(topologies.spectral_gap(expect).gap)
    assert plan.algorithm.momentum == 0.5 and plan.graph.number_of_nodes() == 9


@pytest.mark.parametrize("overrides,expect", [
    (["algorithm=fedavg"], {"local_epochs": 1}),                    # local_steps=0 means "not given"
    (["algorithm=fedavg", "local_steps=5"], {"local_steps": 5}),    # then local_epochs is not passed
    (["algorithm=cdsgd"], {}),
])
def test_hyperparameters_follow_the_declarations(overrides, expect):
    hyper = P.hyperparameters(load_config(overrides=overrides))
    for key in ("local_steps", "local_epochs"):
        assert hyper.get(key) == expect.get(key)
    assert "momentum" not in hyper if "algorithm=cdsgd" in overrides else "lr" in hyper


def test_volatile_keys_are_declared_on_the_fields():
    assert set(VOLATILE_KEYS) == {"out", "overwrite", "resume", "comm_timeout", "checkpoint_every",
                                  "checkpoint_unit", "download", "logger", "min_ranks"}


def test_parts_answer_attributes_only():
    cfg = load_config(overrides=["train_subset=100", "test_subset=20"])
    parts = P.prepare(cfg)
    assert parts.W is parts.plan.W
    assert sum(len(y) for _, y in parts.shards) == 100 and len(parts.test_set[1]) == 20
    with pytest.raises(TypeError, match="not subscriptable"):
        parts["shards"]  # the dict-style access of the unreleased layout is gone
