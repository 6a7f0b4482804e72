"""The centralized baselines (sgd, msgd, fedavg, local) need no graph (issue 26).

An algorithm whose ``traffic`` is not ``"neighbours"`` runs for any
n_agents >= 1 whatever ``topology`` says: no graph is built, W is None (the
all-reduce mean; ``local`` never mixes), and summary.json records
``topology_used: false`` with the spectral gap of the rule's own averaging.
The trained parameters are checked against plain ``torch.optim.SGD`` on the
same batches (every batch is a whole shard, so the order within it cannot
matter), an independent computation; the neighbour rules keep refusing bad
graphs as before.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import topologies
from cdsgd import cli
from cdsgd.algorithms import ALGORITHMS, make_algorithm
from cdsgd.config import load_config
from cdsgd.executor import Executor
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import baseline_gap, prepare, validate_config

BASELINES = ("sgd", "msgd", "fedavg", "local")
#: the rules that gossip over the config's topology (noloco brings its own random groups: test_outer.py)
NEIGHBOUR_RULES = tuple(name for name in ALGORITHMS if ALGORITHMS.get(name).traffic == "neighbours"
                        and not getattr(ALGORITHMS.get(name), "needs_groups", False))
SAMPLES, STEPS, LR, MU = 256, 12, 0.1, 0.9


def _overrides(alg: str, n: int, out, *more: str) -> list[str]:
    # one step per epoch: every agent's batch is its whole shard (256 / n samples, iid)
    return [f"algorithm={alg}", f"n_agents={n}", "dataset=digits", "model=mlp", "model_params.hidden=16",
            f"train_subset={SAMPLES}", "test_subset=60", f"batch_size={SAMPLES // n}", f"epochs={STEPS}",
            "eval_every=4", f"lr={LR}", f"momentum={MU}", "save_params=true", f"out={out}", *more]


def _run(overrides: list[str]) -> dict:
    return run_experiment(load_config(overrides=overrides), progress=False, log=lambda m: None)


def _torch_sgd(model_fn, x0: torch.Tensor, groups, *, momentum: float) -> torch.Tensor:
    """Plain torch.optim.SGD from x0, STEPS full-batch steps on the mean over ``groups`` of each group's mean loss."""
    model = model_fn()
    vector_to_parameters(x0.clone(), model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, nesterov=momentum > 0)
    for _ in range(STEPS):
        opt.zero_grad()
        (sum(F.cross_entropy(model(x), y) for x, y in groups) / len(groups)).backward()
        opt.step()
    return parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("alg", BASELINES)
def test_baselines_train_as_torch_sgd_on_one_and_two_agents(tmp_path, alg, n):
    """n=1: every baseline is one model trained by torch SGD (with momentum for msgd and local);
    n=2 on the default ring (3 nodes needed): sgd, msgd and fedavg (one local epoch = one step here) train one
    model on the mean of the two shards' losses, local trains each agent alone on its shard."""
    out = tmp_path / "run"
    cfg = load_config(overrides=_overrides(alg, n, out))
    summary = _run(_overrides(alg, n, out))
    assert summary["status"] == "completed" and summary["steps_per_epoch"] == 1
    parts = prepare(cfg)
    assert [len(y) for _, y in parts.shards] == [SAMPLES // n] * n
    x0 = Executor.build(parts.model_fn, parts.shards, None, alg, seed=cfg.seed, init=cfg.init, lr=LR).X.clone()
    got = torch.load(out / "params.pt")
    assert got.shape == x0.shape == (n, summary["n_parameters"])
    momentum = MU if alg in ("msgd", "local") else 0.0
    for j in range(n):
        groups = [parts.shards[j]] if alg == "local" else parts.shards
        want = _torch_sgd(parts.model_fn, x0[j], groups, momentum=momentum)
        torch.testing.assert_close(got[j], want, rtol=1e-4, atol=1e-5)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [4, 8, 12] and rows[-1]["train_loss"] < rows[0]["train_loss"]


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("alg", BASELINES)
def test_summary_records_no_graph_and_the_averaging_gap(tmp_path, alg, n):
    out = tmp_path / "run"
    summary = _run(_overrides(alg, n, out, "topology=torus", "epochs=2", "eval_every=1"))
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["topology"] == "torus"  # as given, but not used
    assert summary["topology_used"] is False
    # Π of the rule's averaging, computed independently: the exact mean for all-reduce, I for local
    Pi = np.eye(n) if alg == "local" else np.full((n, n), 1.0 / n)
    gap = topologies.spectral_gap(Pi)
    assert summary["spectral_gap"] == pytest.approx(gap.gap, abs=1e-12)
    assert summary["lambda2"] == pytest.approx(gap.lambda2, abs=1e-12)
    assert summary["effective_neighbours"] == pytest.approx(topologies.effective_neighbours(Pi), rel=1e-9)
    assert any("topology='torus' has no effect" in w for w in summary["warnings"])
    if alg == "local":
        assert summary["bytes_sent_per_agent"] == 0
    rows = _metrics(out)
    assert len(rows) == 2 and rows[-1]["train_loss"] < rows[0]["train_loss"]


def _metrics(out) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.parametrize("n", range(1, 7))
def test_baseline_gap_is_that_of_the_averaging_matrix(n):
    for alg, Pi in (("sgd", np.full((n, n), 1.0 / n)), ("local", np.eye(n))):
        want = topologies.spectral_gap(Pi)
        got = baseline_gap(make_algorithm(alg, lr=0.1), n)
        assert got.gap == pytest.approx(want.gap, abs=1e-12) and got.lambda2 == pytest.approx(want.lambda2, abs=1e-12)


@pytest.mark.parametrize("alg", BASELINES)
@pytest.mark.parametrize("overrides", [
    ["n_agents=1"],                                            # "n_agents must be >= 2 with algorithm=..."
    ["n_agents=2"],                                            # "use 'path' for 2 nodes"
    ["n_agents=2", "topology=torus"],                          # a torus needs both sides >= 3
    ["n_agents=7", "topology=hypercube"],                      # a hypercube needs a power of two
    ["n_agents=3", "topology=one_peer_exponential", "mixing=max_degree"],  # a schedule refuses a rule
    ["n_agents=3", "topology=directed_ring", "mixing=push_sum"],  # columns only: for sgp
    ["n_agents=3", "topology=no/such/graph.edgelist"],
])
def test_any_topology_is_accepted_by_the_baselines(monkeypatch, alg, overrides):
    from cdsgd.run import plan as P

    monkeypatch.setattr(P, "load_dataset", lambda *a, **k: pytest.fail("validate_config must not load data"))
    plan = validate_config(load_config(overrides=[f"algorithm={alg}", *overrides]))
    assert plan.graph is None and plan.W is None and not plan.uses_graph
    unused = [o.split("=")[0] for o in overrides if not o.startswith("n_agents")]
    assert bool(plan.notes) == bool(unused)
    for key in unused:
        assert any(f"{key}=" in note and f"algorithm={alg!r}" in note for note in plan.notes)


@pytest.mark.parametrize("alg", NEIGHBOUR_RULES)
@pytest.mark.parametrize("overrides,message", [
    (["n_agents=1"], r"^n_agents must be >= 2 with algorithm='\w+', which mixes over a graph "
                     r"\(only sgd, msgd, fedavg, local, diloco run on 1 agent\), got 1$"),
    (["n_agents=2"], r"use 'path' for 2 nodes"),
    (["n_agents=2", "topology=torus"], r"torus"),
    (["n_agents=3", "topology=no/such/graph.edgelist"], r"no/such/graph.edgelist"),
])
def test_neighbour_rules_still_refuse_bad_graphs(alg, overrides, message):
    assert set(NEIGHBOUR_RULES) >= {"cdsgd", "cdmsgd", "dsgt", "d2", "qg_dsgdm", "sgp"}
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        validate_config(load_config(overrides=[f"algorithm={alg}", *overrides]))


@pytest.mark.parametrize("alg", NEIGHBOUR_RULES)
def test_neighbour_rules_build_their_graph(alg):
    extra = ["mixing=push_sum"] if ALGORITHMS.get(alg).column_stochastic else []
    plan = validate_config(load_config(overrides=[f"algorithm={alg}", "n_agents=5", "topology=ring", *extra]))
    assert plan.uses_graph and plan.graph.number_of_nodes() == 5 and plan.W.shape == (5, 5)
    assert plan.spectral_gap.gap == pytest.approx(topologies.spectral_gap(plan.W).gap)


def test_cli_runs_msgd_on_one_agent(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["run", *_overrides("msgd", 1, out, "epochs=2", "save_params=false"), "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["algorithm"], summary["n_agents"], summary["topology_used"]) == \
        ("completed", "msgd", 1, False)
    assert summary["spectral_gap"] == 1.0 and summary["effective_neighbours"] == 1.0
