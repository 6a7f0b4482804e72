r"""Buckets agreed across agents (``bucket_sync``): step time and padding in the distributed runtime.

Run::

    python benchmarks/bucket_sync.py [--dataset synthetic_seq] [--dataset-params '{subsample = 1}'] [--agents 2]
                                     [--buckets 8] [--epochs 2] [--repeats 2]

For ``msgd`` (gradients averaged every step) and ``cdmsgd`` (neighbour
mixing), with and without ``bucket_sync``, it launches
``cdsgd launch --nproc-per-node 2 ... executor=torch`` (2 gloo ranks on
this machine, the agents split between them) training a GRU (hidden 32,
batch 32) on the bucketed sequences, and prints per configuration:

* ``s/step``: ``train_seconds / step`` from the run's ``summary.json``, the
  fastest of ``--repeats`` runs (taken round robin over the configurations,
  so that a change in the machine's load hits them all);
* ``padded``: the padded-element fraction of every agent's batches, each
  padded to its own longest sequence (``padded_fraction``);
* ``step-padded``: the same with every agent's batch counted as padded to the
  longest sequence of *any* agent at that step, the length a synchronous step
  waits for: Σ_j (|b_j|·L_step − Σ l) / Σ_j |b_j|·L_step;
* ``mean L_step``: that longest length, averaged over the steps;
* ``rank steps``: per step, the recurrence steps Σ_{j on rank r} max(b_j) of
  the busier of the 2 ranks (each rank holds a contiguous block of agents and
  computes them one after the other), averaged over the steps: what a
  synchronous step waits for on a CPU, where a recurrent batch costs about
  its longest sequence whatever its size (docs/benchmarks.md, sequence
  bucketing). With one agent per rank it is ``mean L_step``.

``--padding-only`` skips the runs and prints the padding columns (exact,
seconds) for the steps of ``--epochs`` epochs.

The padding figures replay the runs' own streams (``prepare(cfg).batch_stream(j,
generator(seed, j, "data"))``, what both executors draw), so they are exact for
the steps run; the times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile

from _common import ROOT  # noqa: E402 - the repository on sys.path first

import numpy as np  # noqa: E402

from cdsgd.config import load_config  # noqa: E402
from cdsgd.data import sequence_lengths  # noqa: E402
from cdsgd.data.bucketing import padded_fraction  # noqa: E402
from cdsgd.run.plan import prepare  # noqa: E402
from cdsgd.base.seeding import generator  # noqa: E402

ALGORITHMS = ("msgd", "cdmsgd")


def overrides(args, algorithm: str, sync: bool) -> list[str]:
    topology = "path" if args.agents == 2 else "ring"
    return [f"dataset={args.dataset}", f"dataset_params={args.dataset_params}", "model=gru",
            "model_params={hidden = 32}", f"n_agents={args.agents}", f"topology={topology}", "batch_size=32",
            f"bucketing={args.buckets}", f"bucket_sync={str(sync).lower()}", f"algorithm={algorithm}", "lr=0.05",
            "momentum=0.9", "grad_clip=0", f"epochs={args.epochs}", f"eval_every={max(1, math.ceil(args.epochs))}",
            "test_subset=200"]  # grad_clip=0: the GRU's default is 1; the figures in docs/benchmarks.md ran without


def padding(cfg, steps: int) -> tuple[float, float, float, float]:
    """(padded, step-padded, mean L_step, rank steps) over the first ``steps`` steps of every agent's stream."""
    parts = prepare(cfg)
    lengths = [sequence_lengths(x).numpy() for x, _ in parts.shards]
    streams = [parts.batch_stream(j, generator(cfg.seed, j, "data")) for j in range(cfg.n_agents)]
    batches = [[s.next().numpy() for _ in range(steps)] for s in streams]
    own = padded_fraction(np.concatenate(lengths), [b + sum(len(x) for x in lengths[:j])
                                                    for j in range(len(lengths)) for b in batches[j]])
    total = real = 0
    tops, work = [], []
    block = len(lengths) // 2  # agents per rank
    for t in range(steps):
        top = max(int(lengths[j][batches[j][t]].max()) for j in range(len(lengths)))
        tops.append(top)
        for j in range(len(lengths)):
            total += len(batches[j][t]) * top
            real += int(lengths[j][batches[j][t]].sum())
        work.append(max(sum(int(lengths[j][batches[j][t]].max()) for j in range(r * block, (r + 1) * block))
                        for r in range(2)))
    return own, (total - real) / total, float(np.mean(tops)), float(np.mean(work))


def launch(args, algorithm: str, sync: bool, out: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "cdsgd", "launch", "--nproc-per-node", "2", *overrides(args, algorithm, sync),
           "executor=torch", f"out={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads((out / "summary.json").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="synthetic_seq", help="synthetic_seq or plaid")
    parser.add_argument("--dataset-params", default="{}",
                        help="the config key dataset_params, e.g. '{subsample = 1}' for PLAID's full-length series")
    parser.add_argument("--agents", type=int, default=2, help="agents (split between the 2 ranks)")
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--padding-only", action="store_true", help="no runs: the padding columns only")
    args = parser.parse_args(argv)
    print(f"{args.dataset} {args.dataset_params}, {args.agents} agents on 2 gloo ranks, GRU hidden 32, batch 32, "
          f"bucketing={args.buckets}, {args.epochs:g} epochs, fastest of {args.repeats}\n")
    print("| algorithm | bucket_sync | steps | s/step | padded | step-padded | mean L_step | rank steps |")
    print("|---|---|---|---|---|---|---|---|")
    configs = [(a, sync) for a in (ALGORITHMS[:1] if args.padding_only else ALGORITHMS) for sync in (False, True)]
    runs = {c: [] for c in configs}
    if not args.padding_only:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):  # round robin: a change in the machine's load hits every configuration
                for algorithm, sync in configs:
                    out = pathlib.Path(tmp) / f"{algorithm}-{sync}-{r}"
                    runs[algorithm, sync].append(launch(args, algorithm, sync, out))
    for algorithm, sync in configs:
        cfg = load_config(overrides=overrides(args, algorithm, sync))
        if args.padding_only:
            steps, per_step = round(args.epochs * prepare(cfg).steps_per_epoch), float("nan")
        else:
            steps = runs[algorithm, sync][0]["step"]
            per_step = min(s["train_seconds"] for s in runs[algorithm, sync]) / steps
        own, step_pad, top, work = padding(cfg, steps)
        print(f"| {algorithm} | {str(sync).lower()} | {steps} | {per_step:.4f} | {own:.3f} | "
              f"{step_pad:.3f} | {top:.0f} | {work:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
