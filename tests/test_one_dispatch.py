"""Each fact decided once: the process-count rule and the reading of a topology string.

- ``n_agents`` must be a multiple of the number of processes: ``cdsgd launch``
  (before torchrun starts anything), a rank joining a plain torchrun launch
  (``cdsgd run executor=torch``, :func:`cdsgd.runtime.group.join`) and
  :func:`cdsgd.runtime.agent_block` refuse a bad count with one message, the one
  :func:`cdsgd.runtime.exchange.agents_per_process` writes.
- ``cdsgd topo`` and ``cdsgd run`` read a builder name, a schedule name and a
  graph file the same way (:func:`topologies.graph_and_mixing`): the same graph,
  the same W, stored the same way (dense up to ``topologies.DENSE_UP_TO``).
"""

from __future__ import annotations

import inspect
import json
import os

import numpy as np
import pytest

import topologies
from cdsgd.cli import main
from cdsgd.config import key_info, load_config
from cdsgd.run.plan import validate_config
from cdsgd.runtime import agent_block, join
from cdsgd.runtime.exchange import agents_per_process

PAPER_RING = os.path.join(os.path.dirname(__file__), "..", "experiments", "topologies", "paper_ring5.edgelist")

# ------------------------------------------------------------------ the process count


def _message(n_agents: int, processes: int) -> str:
    with pytest.raises(ValueError) as e:
        agents_per_process(n_agents, processes)
    return str(e.value)


def test_the_message_names_the_counts_and_what_is_allowed():
    assert _message(5, 3) == ("3 processes but n_agents=5: the number of processes must divide n_agents (each "
                              "process holds n_agents/processes agents); n_agents=5 allows 1 or 5 processes, or "
                              "make n_agents a multiple of 3")
    assert "n_agents=3 allows 1 or 3 processes, or make n_agents a multiple of 6" in _message(3, 6)
    assert _message(5, 0).endswith("n_agents=5 allows 1 or 5 processes")  # no multiple of 0
    assert "n_agents=720 allows 6 or 8 processes (the nearest of its 30 divisors)" in _message(720, 7)
    assert agents_per_process(64, 2) == 32 and agents_per_process(5, 5) == 1 and agents_per_process(7, 1) == 7
    with pytest.raises(ValueError, match=r"^n_agents must be an integer >= 1, got 0$"):
        agents_per_process(0, 1)


@pytest.mark.parametrize("n_agents,processes", [(5, 3), (4, 3), (8, 3), (3, 6)])
def test_agent_block_and_join_refuse_with_the_same_message(n_agents, processes, monkeypatch):
    want = _message(n_agents, processes)
    with pytest.raises(ValueError) as e:
        agent_block(n_agents, processes, 0)
    assert str(e.value) == want
    env = {"RANK": "0", "WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:  # refused before any process group is joined
        join(device="cpu", comm_timeout=5, n_agents=n_agents)
    assert str(e.value) == want


@pytest.fixture
def no_torchrun(monkeypatch, tmp_path):
    """torchrun's entry point replaced by one that records its calls (none must happen); cwd is tmp_path."""
    from torch.distributed import run as torchrun

    calls = []
    monkeypatch.setattr(torchrun, "main", lambda *a, **k: calls.append(a))
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return calls


@pytest.mark.parametrize("argv,n_agents,processes", [
    (["--nproc-per-node", "3", "n_agents=5"], 5, 3),
    (["--nproc-per-node", "3", "n_agents=4"], 4, 3),
    (["--nproc-per-node", "2", "--nnodes", "2", "--master-port", "1234", "n_agents=6", "out=x"], 6, 4),
])
def test_cdsgd_launch_refuses_before_starting_a_process(argv, n_agents, processes, no_torchrun, tmp_path, capsys):
    assert main(["launch", *argv]) == 2
    out, err = capsys.readouterr()
    assert err == f"cdsgd launch: error: {_message(n_agents, processes)}\n" and out == ""
    assert no_torchrun == [] and os.listdir(tmp_path) == []  # torchrun never called, no output folder


def test_cdsgd_launch_dry_run_uses_the_same_count(no_torchrun, capsys):
    assert main(["launch", "--nproc-per-node", "2", "n_agents=8", "--dry-run"]) == 0
    assert "2 process(es), 4 agent(s) each" in capsys.readouterr().out and no_torchrun == []


def test_cdsgd_run_under_a_plain_torchrun_refuses_with_the_same_message(monkeypatch, tmp_path, capsys):
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["run", "executor=torch", "n_agents=5", "comm_timeout=5", f"out={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err == f"cdsgd run: error: {_message(5, 3)}\n"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the topology string


def _topo(capsys, *argv) -> dict:
    assert main(["topo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _plan(*overrides):
    return validate_config(load_config(overrides=list(overrides)))


@pytest.fixture
def readings(monkeypatch):
    """Every (G, W) topologies.graph_and_mixing returns, in call order: both doors must go through it."""
    got, real = [], topologies.graph_and_mixing

    def recording(*a, **k):
        got.append(real(*a, **k))
        return got[-1]

    monkeypatch.setattr(topologies, "graph_and_mixing", recording)
    return got


def _same_storage(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    np.testing.assert_array_equal(a.toarray() if hasattr(a, "toarray") else a,
                                  b.toarray() if hasattr(b, "toarray") else b)


@pytest.mark.parametrize("n", [9, 20, 40])  # 20: dense for both now (`cdsgd topo` once cut at 16); 40: sparse
def test_a_builder_name_gives_the_same_graph_and_W(n, readings, capsys):
    info = _topo(capsys, "ring", "--n", str(n), "--rule", "max_degree")
    plan = _plan("topology=ring", f"n_agents={n}", "mixing=max_degree")
    assert len(readings) == 2
    (G_topo, W_topo), (G_run, W_run) = readings
    assert W_run is plan.W and G_run is plan.graph
    _same_storage(W_topo, W_run)
    assert isinstance(W_run, np.ndarray) == (n <= topologies.DENSE_UP_TO)
    assert info["edge_list"] == sorted([min(u, v), max(u, v)] for u, v in plan.graph.edges())
    np.testing.assert_array_equal(np.array(info["matrix"]), W_run.toarray() if hasattr(W_run, "toarray") else W_run)
    assert info["spectral_gap"] == plan.spectral_gap.gap and info["rule"] == "max_degree"


def test_builder_parameters_reach_both_doors(capsys):
    info = _topo(capsys, "erdos_renyi", "--n", "12", "--param", "p=0.4", "--param", "seed=5")
    plan = _plan("topology=erdos_renyi", "n_agents=12", "topology_params.p=0.4", "topology_params.seed=5")
    assert info["rule"] == "metropolis" == key_info("mixing")["default"]
    np.testing.assert_array_equal(np.array(info["matrix"]), plan.W)


@pytest.mark.parametrize("name,params", [("one_peer_exponential", {}), ("random_matching", {"seed": 3, "period": 4})])
def test_a_schedule_name_gives_the_same_schedule(name, params, readings, capsys):
    info = _topo(capsys, name, "--n", "8", *[f"--param={k}={v}" for k, v in params.items()])
    plan = _plan(f"topology={name}", "n_agents=8", *[f"topology_params.{k}={v}" for k, v in params.items()])
    (G_topo, s_topo), (G_run, s_run) = readings
    assert isinstance(s_run, topologies.Schedule) and s_run is plan.W and info["schedule"] is True
    assert sorted(G_topo.edges()) == sorted(G_run.edges()) == sorted(plan.graph.edges())
    assert info["period"] == len(s_run) and info["spectral_gap"] == plan.spectral_gap.gap
    for Wk_json, Wk_topo, Wk_run in zip(info["matrices"], s_topo, s_run):
        _same_storage(Wk_topo, Wk_run)
        np.testing.assert_array_equal(np.array(Wk_json), Wk_run)


def test_a_schedule_refuses_a_weight_rule_at_both_doors(capsys):
    assert main(["topo", "one_peer_exponential", "--n", "8", "--rule", "uniform"]) == 2
    topo_err = capsys.readouterr().err
    with pytest.raises(ValueError) as e:
        _plan("topology=one_peer_exponential", "n_agents=8", "mixing=uniform")
    assert topo_err == f"cdsgd topo: error: {e.value}\n"
    assert "mixing='uniform' does not apply to it" in str(e.value)


@pytest.mark.parametrize("n", [5, 24, 40])
def test_a_graph_file_gives_the_same_graph_and_W(n, tmp_path, readings, capsys):
    if n == 5:
        path, rule = os.path.abspath(PAPER_RING), "weight"  # the paper's weighted ring
    else:
        path, rule = str(tmp_path / f"ring{n}.edgelist"), "metropolis"
        with open(path, "w") as f:
            f.writelines(f"{i} {(i + 1) % n}\n" for i in range(n))
    info = _topo(capsys, path, "--rule", rule)
    plan = _plan(f"topology={path}", f"n_agents={n}", f"mixing={rule}")
    (G_topo, W_topo), (G_run, W_run) = readings
    _same_storage(W_topo, W_run)
    assert sorted(G_topo.edges()) == sorted(G_run.edges()) and info["n"] == n
    np.testing.assert_array_equal(np.array(info["matrix"]), W_run.toarray() if hasattr(W_run, "toarray") else W_run)
    assert info["spectral_gap"] == plan.spectral_gap.gap


def test_the_unset_rule_is_the_same_default_everywhere():
    """``mixing`` left at the config's default is "no rule given", which topologies reads as its own default."""
    assert key_info("mixing")["default"] == inspect.signature(topologies.mixing_matrix).parameters["rule"].default
