r"""Thousands of simulated agents: speed against the compute limit, setup time and memory.

Run::

    python benchmarks/scale.py                  # N = 32, 256, 1000 MLP agents, then 10,000 logistic regressions
    python benchmarks/scale.py --n 32 256       # only these N (MLP table)
    python benchmarks/scale.py --quick          # N = 32 and 128, fewer steps (smoke test, about a minute)
    python benchmarks/scale.py --markdown       # the tables as Markdown

**MLP table.** N agents, each the ``mlp`` model (235,146 parameters) on
MNIST-shaped synthetic data (64 samples per agent, batch 32), on a ring,
algorithm ``cdmsgd`` (lr 0.01, momentum 0.95), one process (the simulator).
Each N runs in a fresh subprocess, so that its peak memory is its own.

``setup s``
    graph → mixing matrix (sparse beyond 32 agents) → validation → spectral
    gap → ``Simulator`` (models, the N×P stack, the mixer).
``sim/s``, ``limit/s``
    simulated agent-steps per second (N × steps / seconds), against the
    compute limit: one ``nn.Module`` trained in a plain loop (forward,
    cross-entropy, backward, ``torch.optim.SGD`` step) on batches of 32,
    reported as 1 / (time of one single step); N agents cost at least N
    such steps unless work is batched across agents.
``sim/limit``
    the ratio of the two, measured side by side: 3 repeats, each timing both
    (the order alternating), medians.
``µs/agent-step``
    the simulator's cost per agent and step: flat over N means the cost is
    proportional to N (no N² term left).
``peak MB``, ``model MB``
    the process's peak resident memory above its resident memory after
    imports and data (``ru_maxrss`` minus the baseline), against the model:
    (number of N×P stacks the algorithm keeps + 1) × N × P × 4 bytes.
    CDMSGD keeps four stacks (parameters X, gradients G, momentum, the
    mixer's output), so the model is 5 × N × P × 4 bytes.

**10,000 agents.** Logistic regression (7,850 parameters) on Fashion-MNIST
(the Debian package ``dataset-fashion-mnist``; synthetic data of its shape
when it is missing, said in the output), 60,000 training samples split iid
over 10,000 agents (6 each), batch 3 (2 steps per epoch), a ring, ``cdmsgd``:
one epoch in one process, with the default evaluation (32 agents evenly
spaced and the average model on the full test set); time of setup, the
epoch's steps and the evaluation, and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from _common import BATCH, INPUT_SHAPE, N_CLASSES, ROOT, SHARD  # noqa: E402 - the repository on sys.path first

LR, MOMENTUM = 0.01, 0.95
REPEATS = 3
STACKS = {"cdmsgd": 4}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_mlp(n: int, steps: int) -> dict:
    """One N in this process: setup, rates (median of REPEATS), memory."""
    import torch
    import torch.nn.functional as F

    import topologies
    from topologies import DENSE_UP_TO
    from cdsgd.models import build_model
    from cdsgd.executor import Simulator

    torch.set_num_threads(int(os.environ.get("SCALE_THREADS", "1")))
    gen = torch.Generator().manual_seed(1234 + n)
    data_x = torch.randn(n * SHARD, *INPUT_SHAPE, generator=gen)
    data_y = torch.randint(0, N_CLASSES, (n * SHARD,), generator=gen)
    shards = [(data_x[j * SHARD:(j + 1) * SHARD], data_y[j * SHARD:(j + 1) * SHARD]) for j in range(n)]
    baseline = _current_rss_mb()

    def model_fn():
        return build_model("mlp", INPUT_SHAPE, N_CLASSES)

    t0 = time.perf_counter()
    W = topologies.mixing_matrix(topologies.build("ring", n), sparse=n > DENSE_UP_TO)
    gap = topologies.spectral_gap(W)
    sim = Simulator(model_fn, shards, W, "cdmsgd", batch_size=BATCH, seed=0, lr=LR, momentum=MOMENTUM)
    setup = time.perf_counter() - t0

    single = build_model("mlp", INPUT_SHAPE, N_CLASSES)
    opt = torch.optim.SGD(single.parameters(), lr=LR, momentum=MOMENTUM)
    x0, y0 = shards[0]
    batches = [(x0[i:i + BATCH], y0[i:i + BATCH]) for i in range(0, SHARD, BATCH)]

    def limit_steps(count):
        t = time.perf_counter()
        for i in range(count):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(single(x), y).backward()
            opt.step()
        return time.perf_counter() - t

    def sim_steps(count):
        t = time.perf_counter()
        for _ in range(count):
            sim.step()
        return time.perf_counter() - t

    sim_steps(1)
    limit_steps(min(n, 64))
    sim_rates, limit_rates, ratios = [], [], []
    for r in range(REPEATS):
        pair = {}
        for what in (("sim", "limit") if r % 2 == 0 else ("limit", "sim")):
            if what == "sim":
                pair["sim"] = n * steps / sim_steps(steps)
            else:
                count = n * steps
                pair["limit"] = count / limit_steps(count)
        sim_rates.append(pair["sim"])
        limit_rates.append(pair["limit"])
        ratios.append(pair["sim"] / pair["limit"])
    P = sim.layout.numel
    model_mb = (STACKS["cdmsgd"] + 1) * n * P * 4 / 2**20
    return {"n": n, "P": P, "setup": setup, "gap": gap.gap, "mixing": sim.mixer.method, "strategy": sim.strategy,
            "sim": statistics.median(sim_rates), "limit": statistics.median(limit_rates),
            "ratio": statistics.median(ratios), "peak_mb": _rss_mb() - baseline, "model_mb": model_mb}


def measure_ten_thousand(n: int) -> dict:
    import torch

    import topologies
    from cdsgd.data import load_dataset, partition
    from cdsgd.executor.evaluation import default_eval_agents
    from cdsgd.models import build_model
    from cdsgd.executor import Simulator

    torch.set_num_threads(int(os.environ.get("SCALE_THREADS", "1")))
    try:
        ds = load_dataset("fashion-mnist")
        source = "Fashion-MNIST"
    except (ValueError, OSError) as e:
        gen = torch.Generator().manual_seed(0)
        from cdsgd.data.records import Dataset

        ds = Dataset("synthetic", (torch.randn(60000, 1, 28, 28, generator=gen), torch.randint(0, 10, (60000,))),
                     (torch.randn(10000, 1, 28, 28, generator=gen), torch.randint(0, 10, (10000,))), 10, (1, 28, 28))
        source = f"synthetic of Fashion-MNIST's shape ({str(e).splitlines()[0][:80]})"
    x, y = ds.train
    parts = partition(y.numpy(), n, "iid", seed=0)
    shards = [(x[idx], y[idx]) for idx in parts]
    baseline = _current_rss_mb()
    t0 = time.perf_counter()
    W = topologies.mixing_matrix(topologies.build("ring", n), sparse=True)
    gap = topologies.spectral_gap(W)
    sim = Simulator(lambda: build_model("logreg", ds.input_shape, ds.n_classes), shards, W, "cdmsgd",
                    batch_size=3, seed=0, lr=0.05, momentum=0.9, test_set=ds.test,
                    eval_agents=default_eval_agents(n))
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(sim.steps_per_epoch):
        sim.step()
    epoch = time.perf_counter() - t1
    t2 = time.perf_counter()
    row = sim.evaluate()
    evaluation = time.perf_counter() - t2
    P = sim.layout.numel
    return {"n": n, "P": P, "source": source, "setup": setup, "epoch": epoch, "steps": sim.steps_per_epoch,
            "evaluation": evaluation, "eval_agents": len(sim.eval_agents), "gap": gap.gap,
            "mixing": sim.mixer.method, "strategy": sim.strategy,
            "accuracy": row["test_accuracy"], "avg_accuracy": row["test_accuracy_avg_model"],
            "peak_mb": _rss_mb() - baseline, "model_mb": (STACKS["cdmsgd"] + 1) * n * P * 4 / 2**20,
            "data_mb": baseline}


def _child(kind: str, n: int, steps: int) -> dict:
    """Run one measurement in a fresh interpreter (its own peak memory); return its JSON result."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import scale; print('RESULT ' + json.dumps(scale.{kind}({n}{', ' + str(steps) if steps else ''})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{kind}({n}) failed:\n{out.stdout}\n{out.stderr}")


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="*", default=None, help="N values of the MLP table (default 32 256 1000)")
    ap.add_argument("--steps", type=int, default=None, help="simulator steps per timed repeat")
    ap.add_argument("--quick", action="store_true", help="N = 32, 128 and few steps; no 10,000-agent run")
    ap.add_argument("--no-10k", action="store_true", help="skip the 10,000-agent epoch")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    ns = args.n or ([32, 128] if args.quick else [32, 256, 1000])
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"threads {os.environ.get('SCALE_THREADS', '1')}", flush=True)
    rows = []
    for n in ns:
        steps = args.steps or (2 if args.quick else max(3, 3000 // n))
        r = _child("measure_mlp", n, steps)
        print(f"  N={n}: {json.dumps(r)}", file=sys.stderr, flush=True)
        rows.append([str(n), f"{r['setup']:.2f}", r["mixing"], r["strategy"], f"{r['sim']:.0f}", f"{r['limit']:.0f}",
                     f"{r['ratio']:.2f}", f"{1e6 / r['sim']:.0f}", f"{r['peak_mb']:.0f}", f"{r['model_mb']:.0f}"])
    print(table(["N", "setup s", "mixing", "strategy", "sim/s", "limit/s", "sim/limit", "µs/agent-step",
                 "peak MB", "model MB"], rows, args.markdown), flush=True)
    if args.quick or args.no_10k:
        return 0
    r = _child("measure_ten_thousand", 10_000, 0)
    print(f"\n10,000 agents ({r['source']}): logreg P={r['P']}, ring (gap {r['gap']:.4g}), mixing {r['mixing']}, "
          f"strategy {r['strategy']}")
    print(table(["setup s", "epoch s", "steps", "evaluation s", "evaluated agents", "test acc", "avg-model acc",
                 "peak MB", "model MB"],
                [[f"{r['setup']:.2f}", f"{r['epoch']:.2f}", str(r["steps"]), f"{r['evaluation']:.2f}",
                  str(r["eval_agents"]), f"{r['accuracy']:.3f}", f"{r['avg_accuracy']:.3f}", f"{r['peak_mb']:.0f}",
                  f"{r['model_mb']:.0f}"]], args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
