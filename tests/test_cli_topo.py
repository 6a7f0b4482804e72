"""`cdsgd topo`: text, --json round trip, --draw, errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import topologies
from cdsgd.cli import main


def run_cli(*argv):
    """Run the real console entry point in a subprocess."""
    return subprocess.run([sys.executable, "-m", "cdsgd", *argv], capture_output=True, text=True, timeout=120)


def test_json_round_trip():
    r = run_cli("topo", "erdos_renyi", "--n", "12", "--param", "p=0.4", "--param", "seed=5", "--rule", "max_degree", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    G = topologies.build("erdos_renyi", 12, p=0.4, seed=5)
    W = topologies.mixing_matrix(G, "max_degree")
    assert {"n", "edges", "rule", "lambda2", "spectral_gap", "matrix"} <= set(info)
    assert info["n"] == 12 and info["edges"] == G.number_of_edges() and info["rule"] == "max_degree"
    np.testing.assert_array_equal(np.array(info["matrix"]), W)
    gap = topologies.spectral_gap(W)
    assert info["spectral_gap"] == gap.gap and info["lambda2"] == gap.lambda2
    assert sorted(map(tuple, info["edge_list"])) == sorted((min(e), max(e)) for e in G.edges())
    # the printed matrix is itself a valid mixing matrix for the graph
    topologies.validate(info["matrix"], G)


def test_text_output(capsys):
    assert main(["topo", "ring", "--n", "8"]) == 0
    out = capsys.readouterr().out
    closed = 1 - (1 / 3 + 2 / 3 * np.cos(2 * np.pi / 8))
    assert f"spectral gap  {closed:.6f}" in out
    assert "degree        2..2" in out and "diameter      4" in out and "edges         8" in out
    assert "mixing matrix" in out and out.count("0.333") == 24


def test_text_output_of_a_large_ring_keeps_the_gaps_digits(capsys):
    """A ring of 2,000: gap 2/3·(1 − cos(2π/n)) ≈ 3.29e-06 prints with its digits, not as 0.000000."""
    assert main(["topo", "ring", "--n", "2000"]) == 0
    out = capsys.readouterr().out
    closed = 2 / 3 * (1 - np.cos(2 * np.pi / 2000))
    assert f"spectral gap  {closed:.4g}" in out, out
    assert "diameter      1000" in out and "edges         2000" in out and "mixing matrix" not in out


def test_large_n_omits_matrix(capsys):
    assert main(["topo", "ring", "--n", "17"]) == 0
    assert "mixing matrix" not in capsys.readouterr().out


def test_file_input_and_draw(tmp_path):
    g = tmp_path / "g.edgelist"
    g.write_text("a b 0.33\nb c 0.33\nc d 0.33\nd e 0.33\ne a 0.33\n")
    png = tmp_path / "out" / "g.png"
    r = run_cli("topo", str(g), "--rule", "weight", "--draw", str(png), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    np.testing.assert_allclose(np.diag(info["matrix"]), 0.34)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize(
    "argv,status,pattern",
    [
        (["topo", "rnig", "--n", "8"], 2, "topology 'rnig' is unknown; did you mean 'ring'?"),
        (["topo", "ring"], 2, "topology 'ring' needs the number of nodes n"),
        (["topo", "ring", "--n", "8", "--rule", "nope"], 2, "mixing rule 'nope' is unknown"),
        (["topo", "ring", "--n", "8", "--param", "novalue"], 2, "--param expects KEY=VALUE, got 'novalue'"),
        (["topo", "missing.edgelist"], 2, "graph file 'missing.edgelist' does not exist"),
        (["topo", "ring", "--n", "eight"], 2, "invalid int value: 'eight'"),
        (["nosuchverb"], 2, "invalid choice: 'nosuchverb'"),
    ],
)
def test_errors_one_line_and_exit_status(argv, status, pattern):
    r = run_cli(*argv)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert pattern in r.stderr
    assert "Traceback" not in r.stderr


def test_debug_shows_traceback():
    r = run_cli("--debug", "topo", "rnig", "--n", "8")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_help_lists_builders_and_rules():
    r = run_cli("topo", "--help")
    assert r.returncode == 0
    for name in topologies.BUILDERS.names() + topologies.RULES.names():
        assert name in r.stdout
