r"""Many agents per process: 64 agents on 2 ranks against the simulator on the same cores.

Run::

    python benchmarks/hybrid.py                 # ring, torus, Erdős–Rényi; 64 agents; 2 repeats
    python benchmarks/hybrid.py --quick         # 16 agents, ring only (a smoke test)
    python benchmarks/hybrid.py --markdown      # the table as Markdown

Each row trains the same run twice, side by side (the order alternating
over the repeats, medians reported): ``cdsgd run`` (the simulator: one
process, torch's default threads, i.e. every core) and ``cdsgd launch
--nproc-per-node 2`` (the hybrid executor: 2 torchrun processes with one
thread each, N/2 agents in each, exchanging only the rows of the cut edges).
The run: the ``mlp`` model (235,146 parameters) on Fashion-MNIST (8,192
training samples, 128 per agent, batch 32; the sklearn digits set when
Fashion-MNIST is not installed, said in the output), ``cdmsgd``, 10 epochs (40 steps),
evaluation of 8 agents on 1,000 test samples at the end only.

``sim s``, ``hybrid s``
    training wall time (``wall_seconds`` of the last metrics row: steps only,
    evaluation excluded), and their ratio ``hybrid/sim``.
``cut rows``
    parameter rows one step sends across the process boundary (both ranks).
``across MB``
    ``bytes_across_processes`` from the hybrid run's summary.json: the
    training bytes that really crossed between the two processes.
``1 agent/rank MB``
    what the same run sends between processes with one agent per process
    (every graph edge crosses a boundary): ``bytes_sent_per_agent`` × N.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from _common import ROOT, FASHION

GRAPHS = {"ring": ["topology=ring"], "torus": ["topology=torus"],
          "erdos_renyi": ["topology=erdos_renyi", "topology_params.p=0.1", "topology_params.seed=1"]}


def _base_args(n: int, epochs: int) -> list[str]:
    data = (["dataset=fashion-mnist", "train_subset=8192", "eval_samples=1000"] if FASHION.is_dir()
            else ["dataset=digits"])
    return [*data, "model=mlp", f"n_agents={n}", "algorithm=cdmsgd", "lr=0.01", "momentum=0.9", "batch_size=32",
            f"epochs={epochs}", f"eval_every={epochs}", "eval_agents=8"]


def _run(argv: list[str], out: pathlib.Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "cdsgd", *argv, f"out={out}"], capture_output=True, text=True,
                       timeout=1800, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"cdsgd {' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    with open(out / "metrics.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    summary = json.loads((out / "summary.json").read_text())
    return {"wall": float(last["wall_seconds"]), "sent": float(last["bytes_sent_per_agent"]),
            "across": float(summary["bytes_across_processes"]), "P": summary["n_parameters"],
            "steps": int(last["step"]), "acc": float(last["test_accuracy"])}


def measure(graph: str, n: int, epochs: int, repeats: int) -> dict:
    args = [*_base_args(n, epochs), *GRAPHS[graph]]
    sims, hybrids = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            order = ("sim", "hybrid") if rep % 2 == 0 else ("hybrid", "sim")
            for kind in order:
                out = pathlib.Path(tmp) / f"{kind}{rep}"
                if kind == "sim":
                    sims.append(_run(["run", "--no-progress", *args], out))
                else:
                    hybrids.append(_run(["launch", "--nproc-per-node", "2", *args], out))
    h = hybrids[-1]
    row_bytes = h["P"] * 4
    return {"graph": graph, "n": n, "sim_s": statistics.median(r["wall"] for r in sims),
            "hybrid_s": statistics.median(r["wall"] for r in hybrids),
            "cut_rows": h["across"] / (row_bytes * h["steps"]), "across_mb": h["across"] / 1e6,
            "one_per_rank_mb": h["sent"] * n / 1e6, "acc_sim": sims[-1]["acc"], "acc_hybrid": h["acc"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 agents, ring only, 1 repeat")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    n, graphs, repeats, epochs = (16, ["ring"], 1, 2) if args.quick else (64, list(GRAPHS), 2, 10)
    print(f"# data: {'fashion-mnist' if FASHION.is_dir() else 'digits (Fashion-MNIST not installed)'}; "
          f"{os.cpu_count()} cores", flush=True)
    head = ["graph", "N", "sim s", "hybrid s", "hybrid/sim", "cut rows", "across MB", "1 agent/rank MB",
            "across/1-per-rank"]
    rows = []
    for g in graphs:
        m = measure(g, n, epochs, repeats)
        rows.append([g, str(m["n"]), f"{m['sim_s']:.2f}", f"{m['hybrid_s']:.2f}", f"{m['hybrid_s'] / m['sim_s']:.2f}",
                     f"{m['cut_rows']:.0f}", f"{m['across_mb']:.1f}", f"{m['one_per_rank_mb']:.1f}",
                     f"{m['across_mb'] / m['one_per_rank_mb']:.3f}"])
        print("  ".join(rows[-1]) + f"   (final agents' accuracy sim {m['acc_sim']:.3f}, "
              f"hybrid {m['acc_hybrid']:.3f})", flush=True)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
