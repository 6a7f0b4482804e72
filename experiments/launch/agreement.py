"""How far the runtime drifts from the simulator in default mode: the same config, run both ways.

    python experiments/launch/agreement.py --epochs 40 --eval-every 4 --out runs/agreement

runs ``cdsgd run`` (the simulator) and ``cdsgd launch --nproc-per-node 2``
(2 ranks of 2 agents, gloo) on the digits MLP, then prints, for each
evaluation row, the absolute and relative difference of train_loss,
test_loss and consensus_distance and the difference in test accuracy, and
at the end the largest parameter difference. Extra ``key=value`` arguments
are passed to both runs. Folders that hold a finished run are reused.
Results: docs/distributed.md (what each rank does).
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import subprocess
import sys

import torch

COLUMNS = ("train_loss", "test_loss", "consensus_distance")


def _cdsgd(*argv: str) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    r = subprocess.run([sys.executable, "-m", "cdsgd", *argv], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"cdsgd {argv[0]} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")


def _rows(out: pathlib.Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=40)
    parser.add_argument("--eval-every", type=float, default=4)
    parser.add_argument("--out", default="runs/agreement")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    cfg = ["dataset=digits", "model=mlp", "n_agents=4", "batch_size=16", "lr=0.05", "momentum=0.9",
           f"epochs={args.epochs:g}", f"eval_every={args.eval_every:g}", "save_params=true", "overwrite=true",
           *args.overrides]
    root = pathlib.Path(args.out)
    sim, tor = root / "sim", root / "torch"
    if not (sim / "params.pt").exists():
        _cdsgd("run", *cfg, f"out={sim}", "--no-progress")
    if not (tor / "params.pt").exists():
        _cdsgd("launch", "--nproc-per-node", "2", *cfg, f"out={tor}")
    print("step  " + "  ".join(f"{c} |diff| (rel)" for c in COLUMNS) + "  test_accuracy |diff|")
    for a, b in zip(_rows(sim), _rows(tor), strict=True):
        cells = [f"{abs(a[c] - b[c]):.1e} ({abs(a[c] - b[c]) / max(abs(a[c]), 1e-30):.1e})" for c in COLUMNS]
        print(f"{int(a['step']):>5} " + "  ".join(cells) + f"  {abs(a['test_accuracy'] - b['test_accuracy']):.1e}")
    ps, pt = torch.load(sim / "params.pt"), torch.load(tor / "params.pt")
    print(f"parameters: max |diff| {float((ps - pt).abs().max()):.1e} (max |x| {float(ps.abs().max()):.2f})")


if __name__ == "__main__":
    main()
