r"""Thousands of simulated agents: speed against the compute limit, setup time, page faults and memory.

Run::

    python benchmarks/scale.py                  # N = 32, 256, 1000 MLP agents, then 10,000 logistic regressions
    python benchmarks/scale.py --n 32 256       # only these N (MLP table)
    python benchmarks/scale.py --threads 2      # 2 torch threads (default 1; or SCALE_THREADS=2)
    python benchmarks/scale.py --quick          # N = 32 and 128, fewer steps (smoke test, about a minute)
    python benchmarks/scale.py --markdown       # the tables as Markdown

**Header.** The CPU model (``/proc/cpuinfo``), the CPU count, the load
average before and after, and the memory copy bandwidth measured here with 1
and 2 threads (a 256 MB ``torch`` copy, median of 5, counting the bytes read
and written): the simulator streams its N×P stacks through memory every step
while the compute limit runs in cache, so ``sim/limit`` depends on this
bandwidth as much as on the code. Compare machines by these figures.

**MLP table.** N agents, each the ``mlp`` model (235,146 parameters) on
MNIST-shaped synthetic data (64 samples per agent, batch 32), on a ring,
algorithm ``cdmsgd`` (lr 0.01, momentum 0.95), one process (the simulator).
Each N runs in a fresh subprocess, so that its peak memory is its own.

``setup s``
    graph → mixing matrix (sparse beyond 32 agents) → validation → spectral
    gap → ``Simulator`` (models, the N×P stacks, the mixer), after the
    imports (torch, scipy.sparse: paid once per process, not per simulator).
    Most of it at large N is the first touch of the stacks' memory (the
    kernel maps and zeroes every page).
``1st step s``
    the first step, not timed with the others: the rule's and the mixer's
    own N×P buffers are first touched here.
``sim/s``, ``limit/s``
    simulated agent-steps per second (N × steps / seconds), against the
    compute limit: one ``nn.Module`` trained in a plain loop (forward,
    cross-entropy, backward, ``torch.optim.SGD`` step with momentum) on
    batches of 32, reported as 1 / (time of one single step); N agents cost
    at least N such steps unless work is batched across agents.
``sim/limit``
    the ratio of the two, measured side by side: each simulator step is
    followed (or preceded, alternating) by the N single-model steps it
    stands for, so both see the same machine load; 3 repeats of ``steps``
    such pairs, medians.
``1-thread limit/s``, ``sim/(T×1-thread)``
    with T > 1 threads only: the same single-model loop on one thread
    (timed in the same pairs), and the simulator against T such loops side
    by side (T × that rate). A batch-32 model gains little from a second
    thread (on some machines it loses), so this is the stricter reference
    for T cores: T independent trainings could each use one.
``µs/agent-step``
    the simulator's cost per agent and step: flat over N means the cost is
    proportional to N (no N² term left).
``faults/step``
    minor page faults of the process during the timed simulator steps,
    divided by the steps: a steady-state step that allocates large buffers
    afresh shows here (the kernel maps and zeroes each new page), one that
    reuses its buffers shows (nearly) 0.
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

from _common import BATCH, INPUT_SHAPE, N_CLASSES, ROOT, SHARD, cpu_model  # noqa: E402 - the repository on sys.path first

LR, MOMENTUM = 0.01, 0.95
REPEATS = 3
STACKS = {"cdmsgd": 4}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _threads() -> int:
    return int(os.environ.get("SCALE_THREADS", "1"))


def transparent_hugepages() -> str:
    """The kernel's transparent-huge-page mode (the bracketed word of its sysfs file), or "n/a"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "n/a"


def measure_bandwidth(threads: tuple[int, ...] = (1, 2), mb: int = 256, repeats: int = 5) -> dict:
    """Memory copy bandwidth in GB/s (bytes read + bytes written per second) of a ``mb`` MB torch copy.

    The median of ``repeats`` copies for each thread count, after one copy
    that touches both buffers (so no page faults are timed).
    """
    import torch

    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    result = {}
    for t in threads:
        torch.set_num_threads(t)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        result[str(t)] = 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9
    return result


def _mlp_simulator(n: int) -> dict:
    """The MLP table's simulator of ``n`` agents, timed: setup parts, setup faults, the shards, the baseline RSS."""
    import scipy.sparse.linalg  # noqa: F401 - imports are paid once per process, not part of setup
    import torch

    import topologies
    from topologies import DENSE_UP_TO
    from cdsgd.models import build_model
    from cdsgd.executor import Simulator

    torch.set_num_threads(_threads())
    gen = torch.Generator().manual_seed(1234 + n)
    data_x = torch.randn(n * SHARD, *INPUT_SHAPE, generator=gen)
    data_y = torch.randint(0, N_CLASSES, (n * SHARD,), generator=gen)
    shards = [(data_x[j * SHARD:(j + 1) * SHARD], data_y[j * SHARD:(j + 1) * SHARD]) for j in range(n)]
    baseline = _current_rss_mb()

    def model_fn():
        return build_model("mlp", INPUT_SHAPE, N_CLASSES)

    t0 = time.perf_counter()
    W = topologies.mixing_matrix(topologies.build("ring", n), sparse=n > DENSE_UP_TO)
    t1 = time.perf_counter()
    gap = topologies.spectral_gap(W)
    t2 = time.perf_counter()
    f0 = _minor_faults()
    sim = Simulator(model_fn, shards, W, "cdmsgd", batch_size=BATCH, seed=0, lr=LR, momentum=MOMENTUM)
    t3 = time.perf_counter()
    return {"sim": sim, "shards": shards, "baseline": baseline, "gap": gap.gap, "setup": t3 - t0,
            "setup_parts": {"graph_matrix": t1 - t0, "spectral_gap": t2 - t1, "simulator": t3 - t2},
            "setup_faults": _minor_faults() - f0}


def measure_mlp(n: int, steps: int) -> dict:
    """One N in this process: setup, rates (median of REPEATS), page faults per step, memory."""
    import torch
    import torch.nn.functional as F

    from cdsgd.models import build_model

    built = _mlp_simulator(n)
    sim, shards = built["sim"], built["shards"]
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

    def sim_step():
        t = time.perf_counter()
        sim.step()
        return time.perf_counter() - t

    def one_thread_limit_steps(count):  # the same loop on one thread (threads > 1 only)
        torch.set_num_threads(1)
        try:
            return limit_steps(count)
        finally:
            torch.set_num_threads(threads)

    threads = _threads()
    first = sim_step()
    limit_steps(min(n, 64))
    sim_rates, limit_rates, ratios, faults, limit1_rates, ratios1 = [], [], [], [], [], []
    for r in range(REPEATS):
        sim_time = limit_time = limit1_time = 0.0
        step_faults = 0
        for s in range(steps):  # a simulator step and its N single-model steps side by side, order alternating
            if (r + s) % 2:
                limit_time += limit_steps(n)
                limit1_time += one_thread_limit_steps(n) if threads > 1 else 0.0
            f0 = _minor_faults()
            sim_time += sim_step()
            step_faults += _minor_faults() - f0
            if not (r + s) % 2:
                limit_time += limit_steps(n)
                limit1_time += one_thread_limit_steps(n) if threads > 1 else 0.0
        sim_rates.append(n * steps / sim_time)
        limit_rates.append(n * steps / limit_time)
        ratios.append(limit_time / sim_time)
        faults.append(step_faults / steps)
        if threads > 1:  # T single-threaded loops side by side would do T times the one-thread rate
            limit1_rates.append(n * steps / limit1_time)
            ratios1.append(limit1_time / (threads * sim_time))
    P = sim.layout.numel
    model_mb = (STACKS["cdmsgd"] + 1) * n * P * 4 / 2**20
    return {"n": n, "P": P, "threads": _threads(), "setup": built["setup"], "setup_parts": built["setup_parts"],
            "setup_faults": built["setup_faults"], "first_step": first, "gap": built["gap"],
            "mixing": sim.mixer.method, "strategy": sim.strategy, "sim": statistics.median(sim_rates),
            "limit": statistics.median(limit_rates), "ratio": statistics.median(ratios),
            "faults_per_step": statistics.median(faults),
            "limit_1thread": statistics.median(limit1_rates) if limit1_rates else None,
            "ratio_cores": statistics.median(ratios1) if ratios1 else None,
            "peak_mb": _rss_mb() - built["baseline"], "model_mb": model_mb}


#: the parts of a step that --phases times: (label, object attribute path, method)
PHASES = (("gradients (vmap calls)", "gradients", "_grad"), ("gradients (the rest: stack, copy into G)", "gradients",
          "gradients"), ("mixing (start)", "algorithm", "start"), ("update rule", "algorithm", "update"),
          ("divergence check", None, "_check_finite"), ("batches", None, "_batches"))


def measure_phases(n: int, steps: int) -> dict:
    """Where a steady-state step's time goes: µs per agent-step of each of PHASES (one warm-up step first)."""
    sim = _mlp_simulator(n)["sim"]
    spent = {label: 0.0 for label, _, _ in PHASES}

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t
        setattr(owner, name, wrapper)  # on the instance: this process's simulator only

    for label, owner, name in PHASES:
        timed(sim if owner is None else getattr(sim, owner), name, label)
    sim.step()
    spent = dict.fromkeys(spent, 0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        sim.step()
    total = time.perf_counter() - t0
    per = {label: 1e6 * v / (n * steps) for label, v in spent.items()}
    per[PHASES[1][0]] -= per[PHASES[0][0]]  # the strategy's call includes the vmap calls
    per["other"] = 1e6 * total / (n * steps) - sum(per.values())
    return {"n": n, "threads": _threads(), "total": 1e6 * total / (n * steps), "phases": per}


def measure_ten_thousand(n: int) -> dict:
    import scipy.sparse.linalg  # noqa: F401 - imports are not part of setup
    import torch

    import topologies
    from cdsgd.data import load_dataset, partition
    from cdsgd.executor.evaluation import default_eval_agents
    from cdsgd.models import build_model
    from cdsgd.executor import Simulator

    torch.set_num_threads(_threads())
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
    f0 = _minor_faults()
    for _ in range(sim.steps_per_epoch):
        sim.step()
    epoch = time.perf_counter() - t1
    epoch_faults = _minor_faults() - f0
    t2 = time.perf_counter()
    row = sim.evaluate()
    evaluation = time.perf_counter() - t2
    P = sim.layout.numel
    return {"n": n, "P": P, "source": source, "setup": setup, "epoch": epoch, "steps": sim.steps_per_epoch,
            "faults_per_step": epoch_faults / sim.steps_per_epoch,
            "evaluation": evaluation, "eval_agents": len(sim.eval_agents), "gap": gap.gap,
            "mixing": sim.mixer.method, "strategy": sim.strategy,
            "accuracy": row["test_accuracy"], "avg_accuracy": row["test_accuracy_avg_model"],
            "peak_mb": _rss_mb() - baseline, "model_mb": (STACKS["cdmsgd"] + 1) * n * P * 4 / 2**20,
            "data_mb": baseline}


def _child(kind: str, *args) -> dict:
    """Run ``scale.kind(*args)`` in a fresh interpreter (its own peak memory); return its JSON result."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import scale; print('RESULT ' + json.dumps(scale.{kind}({', '.join(map(repr, args))})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{kind}{args} failed:\n{out.stdout}\n{out.stderr}")


def header(bandwidth: dict, load_before: tuple, load_after: tuple | None = None) -> str:
    """The machine in one line: CPU model and count, copy bandwidth, transparent huge pages, load, threads."""
    import torch

    load = f"{load_before[0]:.2f}" + ("" if load_after is None else f" → {load_after[0]:.2f}")
    bw = ", ".join(f"{v:.1f} GB/s ({k} thread{'s' if k != '1' else ''})" for k, v in bandwidth.items())
    return (f"# {cpu_model()}, {os.cpu_count()} CPUs ({platform.machine()}); copy bandwidth {bw}; "
            f"transparent huge pages: {transparent_hugepages()}; load average (1 min) {load}; "
            f"torch {torch.__version__.split('+')[0]} with {_threads()} thread{'s' if _threads() != 1 else ''}, "
            f"python {platform.python_version()}")


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
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: SCALE_THREADS, else 1)")
    ap.add_argument("--quick", action="store_true", help="N = 32, 128 and few steps; no 10,000-agent run")
    ap.add_argument("--no-10k", action="store_true", help="skip the 10,000-agent epoch")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the tables: where a step's time goes (µs per agent-step of each part)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is not None:
        os.environ["SCALE_THREADS"] = str(args.threads)  # the children read it
    ns = args.n or ([32, 128] if args.quick else [32, 256, 1000])
    load_before = os.getloadavg()
    bandwidth = _child("measure_bandwidth")
    print(header(bandwidth, load_before), flush=True)
    if args.phases:
        results = [_child("measure_phases", n, args.steps or max(3, 1000 // n)) for n in ns]
        labels = ["total", *results[0]["phases"]]
        print(table(["µs/agent-step", *(f"N={r['n']}" for r in results)],
                    [[label, *(f"{(r['total'] if label == 'total' else r['phases'][label]):.0f}" for r in results)]
                     for label in labels], args.markdown))
        return 0
    rows = []
    for n in ns:
        steps = args.steps or (2 if args.quick else max(3, 3000 // n))
        r = _child("measure_mlp", n, steps)
        print(f"  N={n}: {json.dumps(r)}", file=sys.stderr, flush=True)
        cores = [] if r["ratio_cores"] is None else [f"{r['limit_1thread']:.0f}", f"{r['ratio_cores']:.2f}"]
        rows.append([str(n), f"{r['setup']:.2f}", f"{r['first_step']:.2f}", r["mixing"], r["strategy"],
                     f"{r['sim']:.0f}", f"{r['limit']:.0f}", f"{r['ratio']:.2f}", *cores, f"{1e6 / r['sim']:.0f}",
                     f"{r['faults_per_step']:.0f}", f"{r['peak_mb']:.0f}", f"{r['model_mb']:.0f}"])
    threads = _threads()
    cores = [] if threads == 1 else ["1-thread limit/s", f"sim/({threads}×1-thread)"]
    print(table(["N", "setup s", "1st step s", "mixing", "strategy", "sim/s", "limit/s", "sim/limit", *cores,
                 "µs/agent-step", "faults/step", "peak MB", "model MB"], rows, args.markdown), flush=True)
    if not (args.quick or args.no_10k):
        r = _child("measure_ten_thousand", 10_000)
        print(f"\n10,000 agents ({r['source']}): logreg P={r['P']}, ring (gap {r['gap']:.4g}), mixing {r['mixing']}, "
              f"strategy {r['strategy']}")
        print(table(["setup s", "epoch s", "steps", "faults/step", "evaluation s", "evaluated agents", "test acc",
                     "avg-model acc", "peak MB", "model MB"],
                    [[f"{r['setup']:.2f}", f"{r['epoch']:.2f}", str(r["steps"]), f"{r['faults_per_step']:.0f}",
                      f"{r['evaluation']:.2f}", str(r["eval_agents"]), f"{r['accuracy']:.3f}",
                      f"{r['avg_accuracy']:.3f}", f"{r['peak_mb']:.0f}", f"{r['model_mb']:.0f}"]], args.markdown))
    print(f"# load average (1 min) before → after: {load_before[0]:.2f} → {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
