"""Random graphs' draws (distinct seeds, distinct graphs; the draw recorded), periodic mixing matrices
(warned of), full mixing matrices read from files (their diagonal kept), and the messages around them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from itertools import combinations

import networkx as nx
import numpy as np
import pytest

import topologies
from cdsgd.cli import main
from cdsgd.config import load_config
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import validate_config
from cdsgd.run.sweep import collect

SMALL = ["dataset=synthetic", "model=logreg", "epochs=0.5", "batch_size=16", "lr=0.1"]

#: (builder, parameters, networkx's generator for one draw): sparse enough that some seeds need redraws
RANDOM = [
    ("erdos_renyi", {"p": 0.2}, lambda n, s: nx.gnp_random_graph(n, 0.2, seed=s)),
    ("random_regular", {"d": 2}, lambda n, s: nx.random_regular_graph(2, n, seed=s)),
    ("small_world", {"k": 2, "p": 0.5}, lambda n, s: nx.watts_strogatz_graph(n, 2, 0.5, seed=s)),
]


def edges(G) -> frozenset:
    return frozenset((min(u, v), max(u, v)) for u, v in G.edges())


def eigen_gap(W) -> float:
    """1 − the second-largest eigenvalue modulus, straight from numpy's eigenvalues."""
    lam = np.sort(np.linalg.eigvalsh(np.asarray(W, dtype=float)))
    return 1.0 - max(abs(lam[0]), abs(lam[-2]))


# ------------------------------------------------------------------ item 3: random graphs' seeds


@pytest.mark.parametrize("name,params,one_draw", RANDOM, ids=[r[0] for r in RANDOM])
def test_distinct_seeds_give_distinct_connected_graphs(name, params, one_draw):
    """Seeds 0..9 give 10 pairwise distinct graphs, each connected (earlier, a redraw with seed+1 made
    erdos_renyi's seeds 0..4 one graph), and at least one of them needed a redraw."""
    graphs = [topologies.build(name, 12, seed=s, **params) for s in range(10)]
    assert all(nx.is_connected(G) and G.number_of_nodes() == 12 for G in graphs)
    for (a, Ga), (b, Gb) in combinations(enumerate(graphs), 2):
        assert edges(Ga) != edges(Gb), f"{name}: seeds {a} and {b} give the same graph"
    assert any(G.graph["draw"]["redraws"] > 0 for G in graphs)


@pytest.mark.parametrize("name,params,one_draw", RANDOM, ids=[r[0] for r in RANDOM])
def test_the_recorded_draw_reproduces_the_graph(name, params, one_draw):
    """Same seed, same graph; G.graph["draw"]["seed"] given to networkx's generator once gives the graph,
    and given as the builder's seed gives it at the first draw; "redraws" counts the disconnected draws."""
    for seed in range(10):
        G = topologies.build(name, 12, seed=seed, **params)
        assert edges(topologies.build(name, 12, seed=seed, **params)) == edges(G)
        draw = G.graph["draw"]
        assert edges(one_draw(12, draw["seed"])) == edges(G)
        again = topologies.build(name, 12, seed=draw["seed"], **params)
        assert edges(again) == edges(G) and again.graph["draw"] == {"seed": draw["seed"], "redraws": 0}
        # the disconnected draws before it, replayed one by one
        tried = [one_draw(12, topologies.draw_seed(seed, k)) for k in range(draw["redraws"] + 1)]
        assert [nx.is_connected(T) for T in tried] == [False] * draw["redraws"] + [True]
        assert 0 <= draw["seed"] < 2 ** 63  # a TOML integer: topology_params.seed can take it


def test_redraws_are_streams_of_their_own():
    """Seed S's k-th redraw is never seed S+k's first draw (nor any other (seed, redraw)'s)."""
    seeds = {(s, k): topologies.draw_seed(s, k) for s in range(40) for k in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(topologies.draw_seed(s, 0) == s for s in range(40))


def test_seed_none_records_a_draw_that_reproduces_the_graph():
    G = topologies.build("erdos_renyi", 12, p=0.2, seed=None)
    assert edges(topologies.build("erdos_renyi", 12, p=0.2, seed=G.graph["draw"]["seed"])) == edges(G)


def test_deterministic_graphs_record_no_draw():
    G, W = topologies.graph_and_mixing("ring", 6)
    assert topologies.describe(G, W)["draw"] is None


def test_cdsgd_topo_shows_the_draw(capsys):
    G = topologies.build("erdos_renyi", 12, p=0.2, seed=0)
    assert main(["topo", "erdos_renyi", "--n", "12", "-p", "p=0.2", "-p", "seed=0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draw"] == G.graph["draw"]
    assert main(["topo", "erdos_renyi", "--n", "12", "-p", "p=0.2", "-p", "seed=0"]) == 0
    draw = G.graph["draw"]
    assert f"draw          seed {draw['seed']} after {draw['redraws']} redraw(s)" in capsys.readouterr().out


def test_summary_and_results_csv_record_the_draw(tmp_path):
    """summary.json's topology_draw and results.csv's column hold the draw the run's graph came from."""
    out = tmp_path / "sweep" / "run"
    cfg = load_config(overrides=SMALL + ["topology=erdos_renyi", "topology_params={p = 0.3, seed = 3}",
                                         "n_agents=8", f"out={out}"])
    run_experiment(cfg, progress=False, log=lambda m: None)
    want = topologies.build("erdos_renyi", 8, p=0.3, seed=3).graph["draw"]
    assert json.loads((out / "summary.json").read_text())["topology_draw"] == want
    collect(tmp_path / "sweep")
    with open(tmp_path / "sweep" / "results.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert json.loads(row["topology_draw"]) == want


# ------------------------------------------------------------------ item 4: periodic and full W


def ring_file(tmp_path, n=4, w=0.5):
    path = tmp_path / f"ring{n}.edgelist"
    path.write_text("".join(f"{i} {(i + 1) % n} {w}\n" for i in range(n)))
    return path


def test_periodic_ring_is_warned_of_in_the_plan_and_the_run(tmp_path):
    """A 4-ring, 0.5 per edge, zero self weights: eigenvalue −1, gap 0; the plan, stderr and summary.json
    say so and name lazy_metropolis."""
    path = ring_file(tmp_path)
    W = topologies.mixing_matrix(topologies.load(path), "weight")
    assert np.linalg.eigvalsh(W)[0] == pytest.approx(-1.0) and eigen_gap(W) == pytest.approx(0.0, abs=1e-12)
    out = tmp_path / "r"
    said = []
    run_experiment(load_config(overrides=SMALL + [f"topology={path}", "n_agents=4", "mixing=weight", f"out={out}"]),
                   progress=False, log=said.append)
    warnings = json.loads((out / "summary.json").read_text())["warnings"]
    assert len(warnings) == 1 and "periodic" in warnings[0] and "mixing=lazy_metropolis" in warnings[0]
    assert f"warning: {warnings[0]}" in said


@pytest.mark.parametrize("n", [4, 5, 6, 8])
@pytest.mark.parametrize("rule", ["metropolis", "lazy_metropolis", "max_degree"])
def test_rings_with_self_weights_are_not_warned_of(n, rule):
    plan = validate_config(load_config(overrides=["topology=ring", f"n_agents={n}", f"mixing={rule}"]))
    assert plan.notes == [] and eigen_gap(plan.W) > 0.05


def test_is_periodic_is_the_eigenvalue_minus_one():
    """is_periodic (zero diagonal on a bipartite graph) against numpy's smallest eigenvalue, over even and
    odd rings, a path, complete graphs and bipartite graphs, with and without self weights."""
    cases = []
    for G in (nx.cycle_graph(4), nx.cycle_graph(6), nx.cycle_graph(5), nx.path_graph(2), nx.complete_graph(3),
              nx.complete_bipartite_graph(2, 3), nx.hypercube_graph(3)):
        G = nx.convert_node_labels_to_integers(G)
        d = max(dict(G.degree()).values())
        A = nx.to_numpy_array(G)
        if np.allclose(A.sum(1), d):  # regular: 1/d per edge and a zero diagonal is doubly stochastic
            cases.append(A / d)
        cases.append(topologies.mixing_matrix(G, "metropolis"))
        cases.append(topologies.mixing_matrix(G, "lazy_metropolis"))
    assert sum(topologies.is_periodic(W) for W in cases) == 4  # C4, C6, P2, Q3 at 1/d
    for W in cases:
        periodic = bool(np.isclose(np.linalg.eigvalsh(W)[0], -1.0))
        assert topologies.is_periodic(W) == periodic
        assert topologies.is_periodic(__import__("scipy.sparse").sparse.csr_array(W)) == periodic
        assert bool(topologies.mixing_warnings(W)) == periodic


def test_cdsgd_topo_warns_of_a_periodic_matrix(tmp_path):
    path = ring_file(tmp_path)
    r = subprocess.run([sys.executable, "-m", "cdsgd", "topo", str(path), "--rule", "weight", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["spectral_gap"] == pytest.approx(0.0, abs=1e-12)
    assert len(info["warnings"]) == 1 and "mixing=lazy_metropolis" in info["warnings"][0]
    assert r.stderr == f"warning: {info['warnings'][0]}\n"
    r = subprocess.run([sys.executable, "-m", "cdsgd", "topo", str(path), "--rule", "lazy_metropolis"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and "spectral gap" in r.stdout


def test_schedules_carry_warnings_too(capsys):
    assert main(["topo", "one_peer_exponential", "--n", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def full_w(seed=0, n=7):
    """A symmetric doubly stochastic W with unequal self weights: lazy Metropolis of a random graph, then
    a little weight moved between two neighbours' self weights and their edge."""
    G = topologies.build("erdos_renyi", n, p=0.5, seed=seed)
    W = topologies.mixing_matrix(G, "lazy_metropolis")
    i, j = next(iter(G.edges()))
    W[i, j] += 0.1
    W[j, i] += 0.1
    W[i, i] -= 0.1
    W[j, j] -= 0.1
    return G, W


def _write_full(path, W):
    n = len(W)
    if path.suffix == ".csv":
        np.savetxt(path, W, delimiter=",", fmt="%.17g")
    elif path.suffix == ".npy":
        np.save(path, W)
    elif path.suffix == ".edgelist":
        path.write_text("".join(f"{i} {j} {float(W[i, j])!r}\n" for i in range(n) for j in range(i, n) if W[i, j]))
    else:
        G = nx.Graph()
        G.add_nodes_from(range(n))
        G.add_weighted_edges_from((i, j, float(W[i, j])) for i in range(n) for j in range(i, n) if W[i, j])
        nx.write_graphml(G, path)
    return path


@pytest.mark.parametrize("ext", [".csv", ".npy", ".edgelist", ".graphml"])
def test_a_full_w_with_its_diagonal_round_trips(tmp_path, ext):
    """A full W (its diagonal as self-loops) read back under mixing=weight is W, entry for entry; its gap is
    numpy's."""
    G, W = full_w()
    assert len(set(np.round(np.diag(W), 12))) > 1  # self weights that no rule would compute
    path = _write_full(tmp_path / f"w{ext}", W)
    plan = validate_config(load_config(overrides=[f"topology={path}", f"n_agents={len(W)}", "mixing=weight"]))
    np.testing.assert_allclose(plan.W, W, rtol=0, atol=1e-15)
    assert plan.spectral_gap.gap == pytest.approx(eigen_gap(W), abs=1e-12) and plan.notes == []
    r = subprocess.run([sys.executable, "-m", "cdsgd", "topo", str(path), "--rule", "weight", "--json"],
                       capture_output=True, text=True, timeout=120)
    info = json.loads(r.stdout)
    np.testing.assert_allclose(info["matrix"], W, rtol=0, atol=1e-15)
    assert info["spectral_gap"] == pytest.approx(eigen_gap(W), abs=1e-12)


def test_a_full_w_whose_row_does_not_sum_to_one_is_refused(tmp_path):
    G, W = full_w()
    W[3, 3] += 0.05
    path = _write_full(tmp_path / "bad.csv", W)
    with pytest.raises(ValueError, match=r"^rule 'weight': node 3's self weight .* sum to 1.05, not 1"):
        validate_config(load_config(overrides=[f"topology={path}", f"n_agents={len(W)}", "mixing=weight"]))


def test_other_rules_ignore_a_files_self_weights_and_say_so(tmp_path):
    G, W = full_w()
    path = _write_full(tmp_path / "w.csv", W)
    plan = validate_config(load_config(overrides=[f"topology={path}", f"n_agents={len(W)}"]))
    np.testing.assert_array_equal(plan.W, topologies.mixing_matrix(G, "metropolis"))
    assert plan.notes == [f"graph file {str(path)!r} carries edge weights and self weights, which "
                          "mixing='metropolis' ignores (it computes its own); set mixing=weight to mix with the "
                          "file's weights"]


@pytest.mark.parametrize("name,text,pattern", [
    ("l.edgelist", "0 1 0.5\n1 1\n", r"l\.edgelist:2: self-loop at node '1' has no weight"),
    ("r.edgelist", "0 1 0.5\n1 1 0.5\n1 1 0.4\n", r"r\.edgelist:3: self weight of node '1' repeated"),
    ("g.graphml", None, r"g\.graphml: self-loop at node '1' has no weight"),
])
def test_self_loops_without_one_weight_are_refused(tmp_path, name, text, pattern):
    path = tmp_path / name
    if text is None:
        nx.write_graphml(nx.Graph([(0, 1), (1, 1)]), path)
    else:
        path.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        topologies.load(path)


# ------------------------------------------------------------------ item 8: the drawing's title, n_agents


def test_the_drawing_of_file_weights_is_not_titled_weight_weights(tmp_path, monkeypatch):
    import cdsgd.report.plotting as plotting

    titles = []
    monkeypatch.setattr(plotting, "draw_topology", lambda G, W, path, title="": titles.append(title))
    path = ring_file(tmp_path, 5, 0.33)
    assert main(["topo", str(path), "--rule", "weight", "--draw", str(tmp_path / "g.png")]) == 0
    assert main(["topo", "ring", "--n", "5", "--draw", str(tmp_path / "g.png")]) == 0
    assert titles == [f"{path} (n=5), weights as given (mixing=weight)", "ring (n=5), metropolis weights"]


@pytest.mark.parametrize("argv,message", [
    (["n_agents=0"], "n_agents must be >= 1 (>= 2 for an algorithm that mixes over a graph), got 0"),
    (["n_agents=1"], "n_agents must be >= 2 with algorithm='cdmsgd', which mixes over a graph (only sgd, msgd, "
                     "fedavg, local, diloco run on 1 agent), got 1"),
    (["n_agents=1", "topology=one_peer_exponential", "algorithm=dsgt"],
     "n_agents must be >= 2 with algorithm='dsgt', which mixes over a graph (only sgd, msgd, fedavg, local, diloco "
     "run on 1 agent), got 1"),
])
def test_too_few_agents_one_line_naming_n_agents(tmp_path, argv, message):
    r = subprocess.run([sys.executable, "-m", "cdsgd", "run", *argv, f"out={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == f"cdsgd run: error: {message}\n"
    assert not (tmp_path / "o").exists()
