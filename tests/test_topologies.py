"""topologies: builders, weight rules, validation, spectral gap, graph files."""

from __future__ import annotations

import math
import re

import networkx as nx
import numpy as np
import pytest

import topologies
from topologies import build, load, mixing_matrix, spectral_gap, validate

# (name, n, params, expected degree set or None for random graphs)
BUILDER_CASES = [
    ("complete", 6, {}, {5}),
    ("ring", 7, {}, {2}),
    ("path", 5, {}, {1, 2}),
    ("star", 6, {}, {1, 5}),
    ("torus", 12, {}, {4}),
    ("torus", 15, {"rows": 3, "cols": 5}, {4}),
    ("grid", 12, {}, {2, 3, 4}),
    ("hypercube", 16, {}, {4}),
    ("exponential", 8, {}, {5}),
    ("erdos_renyi", 12, {"p": 0.4, "seed": 3}, None),
    ("small_world", 12, {"k": 4, "p": 0.2, "seed": 3}, None),
    ("random_regular", 12, {"d": 3, "seed": 3}, {3}),
]


#: directed builders (for push-sum): (name, n, out-degree of every node)
DIRECTED_CASES = [("directed_ring", 7, 1), ("directed_exponential", 8, 3), ("directed_exponential", 6, 3)]


def test_every_builder_is_covered():
    assert {c[0] for c in BUILDER_CASES + DIRECTED_CASES} == set(topologies.BUILDERS.names())


@pytest.mark.parametrize("name,n,out_degree", DIRECTED_CASES)
def test_directed_builders(name, n, out_degree):
    G = build(name, n)
    assert G.is_directed() and sorted(G.nodes) == list(range(n)) and nx.is_strongly_connected(G)
    assert {d for _, d in G.out_degree()} == {out_degree} and nx.number_of_selfloops(G) == 0
    steps = [1] if name == "directed_ring" else [2 ** k for k in range(math.ceil(math.log2(n)))]
    assert sorted(G.edges()) == sorted({(i, (i + s) % n) for i in range(n) for s in steps})


@pytest.mark.parametrize("name,n,params,degrees", BUILDER_CASES)
def test_builder_shape(name, n, params, degrees):
    G = build(name, n, **params)
    assert sorted(G.nodes) == list(range(n))
    assert nx.is_connected(G)
    assert nx.number_of_selfloops(G) == 0 and not G.is_directed()
    if degrees is not None:
        assert {d for _, d in G.degree()} == degrees
    # deterministic: the same call gives the same graph
    assert sorted(build(name, n, **params).edges()) == sorted(G.edges())


def test_builder_edge_counts_from_formulas():
    assert build("complete", 9).number_of_edges() == 9 * 8 // 2
    assert build("hypercube", 32).number_of_edges() == 32 * 5 // 2
    assert build("torus", 20, rows=4, cols=5).number_of_edges() == 2 * 20
    assert build("grid", 12, rows=3, cols=4).number_of_edges() == 3 * 3 + 2 * 4
    assert build("star", 7).degree(0) == 6


def test_structure_details():
    # torus: (r, c) ~ (r±1, c), (r, c±1) with wrap-around, row-major numbering
    G = build("torus", 12, rows=3, cols=4)
    assert set(G.neighbors(0)) == {1, 3, 4, 8}
    # hypercube: neighbours differ in one bit
    H = build("hypercube", 8)
    assert all(bin(u ^ v).count("1") == 1 for u, v in H.edges())
    # exponential: i ~ i ± 2^k mod n
    E = build("exponential", 12)
    assert set(E.neighbors(0)) == {1, 2, 4, 8, 11, 10}


def test_random_builders_depend_on_seed():
    a = build("erdos_renyi", 20, p=0.3, seed=1)
    b = build("erdos_renyi", 20, p=0.3, seed=2)
    assert sorted(a.edges()) != sorted(b.edges())
    c = build("small_world", 20, k=4, p=0.5, seed=1)
    d = build("small_world", 20, k=4, p=0.5, seed=2)
    assert sorted(c.edges()) != sorted(d.edges())


# --------------------------------------------------------------------- rules

RULE_GRAPHS = [build("ring", 8), build("star", 6), build("torus", 9), build("path", 5),
               build("erdos_renyi", 10, p=0.4, seed=0), build("hypercube", 8)]


@pytest.mark.parametrize("rule", ["metropolis", "max_degree", "lazy_metropolis"])
@pytest.mark.parametrize("G", RULE_GRAPHS, ids=lambda G: f"{G.graph['name']}{G.number_of_nodes()}")
def test_rules_doubly_stochastic_symmetric_on_graph(G, rule):
    W = mixing_matrix(G, rule)
    n = G.number_of_nodes()
    assert W.shape == (n, n) and W.dtype == np.float64
    np.testing.assert_allclose(W.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(W, W.T)
    assert (W >= 0).all()
    for i in range(n):
        for j in range(n):
            if i != j and not G.has_edge(i, j):
                assert W[i, j] == 0.0


@pytest.mark.parametrize("G", RULE_GRAPHS, ids=lambda G: f"{G.graph['name']}{G.number_of_nodes()}")
def test_metropolis_equals_formula(G):
    W = mixing_matrix(G, "metropolis")
    n = G.number_of_nodes()
    deg = dict(G.degree())
    expected = np.zeros((n, n))
    for i in range(n):
        for j in G.neighbors(i):
            expected[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
    for i in range(n):
        expected[i, i] = 1.0 - sum(expected[i, j] for j in range(n) if j != i)
    np.testing.assert_allclose(W, expected, rtol=0, atol=1e-15)


def test_max_degree_and_lazy_formulas():
    G = build("star", 5)  # d_max = 4
    W = mixing_matrix(G, "max_degree")
    assert W[0, 1] == pytest.approx(1 / 5) and W[0, 0] == pytest.approx(1 / 5) and W[1, 1] == pytest.approx(4 / 5)
    L = mixing_matrix(G, "lazy_metropolis")
    np.testing.assert_allclose(L, 0.5 * (np.eye(5) + mixing_matrix(G, "metropolis")))
    # lazy: all eigenvalues in [0, 1]
    assert np.linalg.eigvalsh(L).min() >= -1e-12


def test_uniform_on_regular_graph():
    W = mixing_matrix(build("hypercube", 8), "uniform")
    np.testing.assert_allclose(W[0, [0, 1, 2, 4]], 0.25)
    np.testing.assert_allclose(W, mixing_matrix(build("hypercube", 8), "metropolis"))


def test_weight_rule_paper_ring():
    G = build("ring", 5)
    nx.set_edge_attributes(G, 0.33, "weight")
    W = mixing_matrix(G, "weight")
    np.testing.assert_allclose(np.diag(W), 0.34)
    assert W[0, 1] == 0.33 and W[0, 4] == 0.33 and W[0, 2] == 0.0


@pytest.mark.parametrize("n", [4, 5, 8, 13, 32])
def test_ring_spectral_gap_closed_form(n):
    gap, lam = spectral_gap(mixing_matrix(build("ring", n), "metropolis"))
    closed = 1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / n))
    assert gap == pytest.approx(closed, abs=1e-12)
    assert lam == pytest.approx(1 - closed, abs=1e-12)


def test_spectral_gap_other_closed_forms():
    assert spectral_gap(mixing_matrix(build("complete", 7))).gap == pytest.approx(1.0)
    for k in (2, 3, 4):
        assert spectral_gap(mixing_matrix(build("hypercube", 2**k))).gap == pytest.approx(2 / (k + 1))
    # a bipartite graph with max_degree weights can have |λ_n| > λ_2: gap uses the modulus
    W = np.array([[0.0, 1.0], [1.0, 0.0]])
    assert spectral_gap(W) == (0.0, 1.0)


def test_sparser_graph_has_smaller_gap():
    n = 64  # (at n = 16 the 4x4 torus *is* the 4-cube: equal gaps)
    gaps = [spectral_gap(mixing_matrix(build(name, n))).gap for name in ("complete", "hypercube", "torus", "ring")]
    assert gaps == sorted(gaps, reverse=True) and len(set(gaps)) == 4


# ------------------------------------------------------------- graph files


def test_load_edgelist_natural_order(tmp_path):
    p = tmp_path / "g.edgelist"
    p.write_text("# a comment\nn10 n2\nn2 n1 0.25\nn1\tn10\n")
    G = load(p)
    assert [G.nodes[i]["label"] for i in range(3)] == ["n1", "n2", "n10"]
    assert sorted(G.edges()) == [(0, 1), (0, 2), (1, 2)]
    assert G.edges[0, 1]["weight"] == 0.25


def test_load_integer_labels_numeric_order(tmp_path):
    p = tmp_path / "g.txt"
    p.write_text("10 2\n2 1\n1 10\n")
    G = load(p)
    assert [G.nodes[i]["label"] for i in range(3)] == ["1", "2", "10"]


def test_load_matrices_csv_npy_graphml(tmp_path):
    A = nx.to_numpy_array(build("ring", 6))
    (tmp_path / "a.csv").write_text("\n".join(",".join(f"{x:g}" for x in row) for row in A))
    np.save(tmp_path / "a.npy", A)
    G0 = build("ring", 6)
    nx.write_graphml(G0, tmp_path / "a.graphml")
    for name in ("a.csv", "a.npy", "a.graphml"):
        G = load(tmp_path / name)
        assert sorted(G.edges()) == sorted(G0.edges()), name
        np.testing.assert_allclose(mixing_matrix(G), mixing_matrix(G0))


def test_load_weighted_csv_with_weight_rule(tmp_path):
    A = 0.33 * nx.to_numpy_array(build("ring", 5))
    (tmp_path / "w.csv").write_text("\n".join(",".join(str(x) for x in row) for row in A))
    W = mixing_matrix(load(tmp_path / "w.csv"), "weight")
    np.testing.assert_allclose(np.diag(W), 0.34)


def test_resolve_name_and_file(tmp_path):
    p = tmp_path / "g.edgelist"
    p.write_text("0 1\n1 2\n")
    assert topologies.resolve(p).number_of_nodes() == 3
    assert topologies.resolve(str(p), 3).number_of_edges() == 2
    assert topologies.resolve("ring", 5).number_of_edges() == 5


# ----------------------------------------------------------------- bad input


def _write(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(p, content)
    else:
        p.write_text(content)
    return p


def _disconnected():
    G = nx.Graph([(0, 1), (2, 3)])
    return G


def _nonsym():
    return np.array([[0.5, 0.5, 0.0], [0.3, 0.4, 0.3], [0.2, 0.1, 0.7]])


# (callable taking tmp_path, error type, message regex)
BAD = [
    (lambda t: build("rnig", 8), ValueError, r"topology 'rnig' is unknown; did you mean 'ring'\? Known: complete"),
    (lambda t: build("ring", 1), ValueError, r"n must be an integer >= 2, got 1"),
    (lambda t: build("ring", 2), ValueError, r"n must be an integer >= 3 for a ring"),
    (lambda t: build("ring", 8.5), ValueError, r"n must be an integer >= 2, got 8.5"),
    (lambda t: build("ring", 8, p=0.1), ValueError, r"topology 'ring' takes no parameter 'p'; allowed: none"),
    (lambda t: build("erdos_renyi", 8, q=0.1), ValueError, r"no parameter 'q'; allowed: p, seed, max_tries"),
    (lambda t: build("erdos_renyi", 8, p=1.5), ValueError, r"p must be a number in \(0, 1\], got 1.5"),
    (lambda t: build("erdos_renyi", 30, p=0.01, max_tries=5), ValueError, r"no connected graph in 5 draws"),
    (lambda t: build("hypercube", 12), ValueError, r"hypercube: n must be a power of two, got n=12"),
    (lambda t: build("torus", 7), ValueError, r"torus: n=7 cannot be written as rows x cols with both >= 3"),
    (lambda t: build("torus", 12, rows=3, cols=5), ValueError, r"rows x cols must equal n, got rows=3, cols=5, n=12"),
    (lambda t: build("random_regular", 7, d=3), ValueError, r"n\*d must be even, got n=7, d=3"),
    (lambda t: build("small_world", 6, k=6), ValueError, r"k must be < n, got k=6, n=6"),
    (lambda t: mixing_matrix(build("ring", 5), "metropollis"), ValueError, r"mixing rule 'metropollis' is unknown; did you mean 'metropolis'"),
    (lambda t: mixing_matrix(build("star", 5), "uniform"), ValueError, r"only on regular graphs.*range from 1 \(node 1\) to 4 \(node 0\)"),
    (lambda t: mixing_matrix(build("ring", 5), "weight"), ValueError, r"edge \(0, 1\) has no 'weight' attribute"),
    (lambda t: mixing_matrix(_disconnected(), "metropolis"), ValueError, r"graph is not connected: 2 components \(\[0, 1\]; \[2, 3\]\)"),
    (lambda t: mixing_matrix(nx.DiGraph([(0, 1), (1, 0)]), "metropolis"), ValueError, r"graph is directed"),
    (lambda t: mixing_matrix(nx.Graph([(0, 1), (1, 1)]), "metropolis"), ValueError, r"self-loop at node 1"),
    (lambda t: validate(np.ones((2, 3)) / 3), ValueError, r"must be square and non-empty, got shape \(2, 3\)"),
    (lambda t: validate([[1.2, -0.2], [-0.2, 1.2]]), ValueError, r"entry W\[0, 1\] = -0.2 is negative"),
    (lambda t: validate([[np.nan, 0.5], [0.5, 0.5]]), ValueError, r"W\[0, 0\] = nan is not finite"),
    (lambda t: validate(_nonsym()), ValueError, r"not symmetric: W\[0, 1\] = 0.5 but W\[1, 0\] = 0.3"),
    (lambda t: validate([[0.5, 0.4], [0.4, 0.5]]), ValueError, r"row 0 sums to 0.9, not 1 \(tolerance 1e-08\)"),
    (lambda t: validate(mixing_matrix(build("complete", 4)), build("ring", 4)), ValueError, r"W\[0, 2\] = 0.25 but nodes 0 and 2 are not linked"),
    (lambda t: validate(np.eye(3)), ValueError, r"graph is not connected: 3 components"),
    (lambda t: spectral_gap(np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])), ValueError,
     r"needs a symmetric or a column-stochastic \(push-sum\) matrix"),
    (lambda t: load(t / "missing.edgelist"), FileNotFoundError, r"missing.edgelist' does not exist"),
    (lambda t: load(_write(t, "g.json", "{}")), ValueError, r"unknown graph file extension '.json'; allowed: .edgelist, .txt"),
    (lambda t: load(_write(t, "e.edgelist", "# nothing\n")), ValueError, r"graph is empty \(no nodes\)"),
    (lambda t: load(_write(t, "e.txt", "a\nb\n")), ValueError, r"graph has no edges \(2 isolated nodes\)"),
    (lambda t: load(_write(t, "l.edgelist", "0 1\n1 1\n")), ValueError, r"l.edgelist:2: self-loop at node '1' has no weight"),
    (lambda t: load(_write(t, "m.edgelist", "0 1 2 3\n")), ValueError, r"m.edgelist:1: expected 'u v' or 'u v weight'"),
    (lambda t: load(_write(t, "w.edgelist", "0 1 heavy\n")), ValueError, r"w.edgelist:1: weight 'heavy' is not a number"),
    (lambda t: load(_write(t, "r.edgelist", "0 1 0.5\n1 0 0.4\n")), ValueError, r"edge \(1, 0\) repeated with another weight"),
    (lambda t: load(_write(t, "d.csv", "0,1\n0,0\n")), ValueError, r"not symmetric \(a directed graph\): entry \(0, 1\) = 1 but \(1, 0\) = 0"),
    (lambda t: mixing_matrix(load(_write(t, "s.csv", "1,1\n1,0\n")), "weight"), ValueError,
     r"node 0's self weight 1 and edge weights 1 sum to 2, not 1 \(tolerance 1e-08\): each row of W must sum to 1"),
    (lambda t: load(_write(t, "x.csv", "0,1\n1,zero\n")), ValueError, r"x.csv:2: entry 1 is 'zero', not a number"),
    (lambda t: load(_write(t, "g.csv", "0,1,1\n1,0\n1,1,0\n")), ValueError, r"g.csv:2: row has 2 entries but the first row has 3"),
    (lambda t: load(_write(t, "r.npy", np.zeros((2, 3)))), ValueError, r"adjacency matrix must be square, got shape \(2, 3\)"),
    (lambda t: load(_write(t, "o.npy", np.array([{"a": 1}], dtype=object))), ValueError, r"not a plain numeric .npy array"),
    (lambda t: load(_write(t, "b.graphml", "<graphml><broken")), ValueError, r"b.graphml: not valid GraphML"),
    (lambda t: load(_write(t, "dir.graphml", _graphml(True))), ValueError, r"GraphML graph is directed"),
    (lambda t: topologies.resolve(_write(t, "n.edgelist", "0 1\n"), 5), ValueError, r"has 2 nodes but n=5 was asked for"),
    (lambda t: topologies.resolve("ring"), ValueError, r"topology 'ring' needs the number of nodes n"),
]


def _graphml(directed: bool) -> str:
    import io

    G = nx.DiGraph([(0, 1), (1, 2)]) if directed else nx.Graph([(0, 1)])
    buf = io.BytesIO()
    nx.write_graphml(G, buf)
    return buf.getvalue().decode()


@pytest.mark.parametrize("call,exc,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input(tmp_path, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(tmp_path)


def test_validate_accepts_within_tolerance_and_returns_float():
    W = np.array([[0.5, 0.5], [0.5, 0.5]]) + 1e-10
    out = validate(W)
    assert out.dtype == np.float64
    with pytest.raises(ValueError, match=re.escape("row 0 sums to")):
        validate(np.array([[0.5, 0.5], [0.5, 0.5]]) + 1e-7)


# ---------------------------------------------------------------- large graphs: sparse matrices


@pytest.mark.parametrize("rule", ["metropolis", "max_degree", "lazy_metropolis"])
@pytest.mark.parametrize("name", ["ring", "star", "torus", "erdos_renyi", "small_world"])
def test_sparse_mixing_matrix_equals_the_dense_one(name, rule):
    G = build(name, 36)
    S = mixing_matrix(G, rule, sparse=True)
    assert S.format == "csr" and S.nnz == 36 + 2 * G.number_of_edges()
    np.testing.assert_array_equal(S.toarray(), mixing_matrix(G, rule))


def test_sparse_weight_and_uniform_rules_equal_the_dense_ones():
    G = build("hypercube", 16)
    np.testing.assert_array_equal(mixing_matrix(G, "uniform", sparse=True).toarray(), mixing_matrix(G, "uniform"))
    H = nx.cycle_graph(5)
    nx.set_edge_attributes(H, 0.25, "weight")
    np.testing.assert_array_equal(mixing_matrix(H, "weight", sparse=True).toarray(), mixing_matrix(H, "weight"))


def _sparse(A):
    import scipy.sparse as sp

    return sp.csr_array(np.asarray(A, dtype=np.float64))


@pytest.mark.parametrize("W, message", [
    ([[1.2, -0.2], [-0.2, 1.2]], r"entry W\[0, 1\] = -0.2 is negative"),
    ([[np.nan, 0.5], [0.5, 0.5]], r"W\[0, 0\] = nan is not finite"),
    ([[0.5, 0.5, 0.0], [0.3, 0.4, 0.3], [0.2, 0.1, 0.7]], r"not symmetric: W\[0, 1\] = 0.5 but W\[1, 0\] = 0.3"),
    # symmetric within tol, but agent 0 would average with 2 while 2 ignores 0 (the runtime's peers must be mutual)
    ([[0.5, 0.5, 3e-9], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]],
     r"not symmetric: W\[0, 2\] = 3e-09 but W\[2, 0\] = 0: the zero pattern is not symmetric"),
    ([[0.5, 0.4], [0.4, 0.5]], r"row 0 sums to 0.9, not 1"),
    (np.eye(3), r"graph is not connected: 3 components"),
])
def test_sparse_validation_names_the_same_faults(W, message):
    with pytest.raises(ValueError, match=message):
        validate(W)
    with pytest.raises(ValueError, match=message):
        validate(_sparse(W))


def test_one_sided_zero_pattern_is_for_directed_matrices_only():
    """symmetric=False (a schedule's step, push-sum's column-stochastic W) takes what symmetric=True refuses."""
    W = np.array([[1 - 5e-9, 5e-9], [0.0, 1.0]])
    np.testing.assert_array_equal(validate(W, symmetric=False), W)
    P = mixing_matrix(build("directed_ring", 4), "push_sum")  # every entry one-sided by design
    assert validate(P, symmetric=False, row_sums=False) is not None
    with pytest.raises(ValueError, match=r"not symmetric: W\[0, 1\] = 0 but W\[1, 0\] = 0.5"):
        validate(P)


def test_sparse_validation_checks_the_graph_support():
    with pytest.raises(ValueError, match=r"W\[0, 2\] = 0.25 but nodes 0 and 2 are not linked"):
        validate(mixing_matrix(build("complete", 4), sparse=True), build("ring", 4))


@pytest.mark.parametrize("name, params", [
    ("ring", {}), ("path", {}), ("star", {}), ("torus", {}), ("exponential", {}),
    ("erdos_renyi", {"p": 0.02}), ("small_world", {}), ("random_regular", {}), ("complete", {}),
])
def test_sparse_spectral_gap_agrees_with_the_dense_eigenvalues(name, params):
    """Above SPARSE_EIGEN_FROM nodes the gap comes from Lanczos (plain or shift-invert); at 600 both solvers run."""
    from topologies.spectral import SPARSE_EIGEN_FROM

    n = 600
    assert n >= SPARSE_EIGEN_FROM
    for rule in ("metropolis", "max_degree"):
        W = mixing_matrix(build(name, n, **params), rule, sparse=True)
        lam = np.sort(np.linalg.eigvalsh(W.toarray()))
        expected = 1 - max(abs(lam[-2]), abs(lam[0]))
        got = spectral_gap(W)
        assert got.gap == pytest.approx(expected, rel=1e-8, abs=1e-12), (rule, got, expected)
        assert got.lambda2 == pytest.approx(1 - expected, abs=1e-12)
        assert spectral_gap(W.toarray()).gap == pytest.approx(expected, rel=1e-8, abs=1e-12)  # dense input, same


def test_sparse_spectral_gap_keeps_the_digits_of_a_tiny_gap():
    """A ring of 10,000 (gap 1.3e-7, closed form 1 − (1/3 + 2/3·cos(2π/n))): O(edges) from graph to gap."""
    n = 10_000
    W = mixing_matrix(build("ring", n), sparse=True)
    assert W.nnz == 3 * n
    exact = (2 / 3) * (1 - math.cos(2 * math.pi / n))  # 1 − λ₂ without cancellation
    assert spectral_gap(W).gap == pytest.approx(exact, rel=1e-6)
