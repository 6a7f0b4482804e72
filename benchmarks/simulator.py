r"""Speed of the single-process simulator against the compute limit.

Run::

    python benchmarks/simulator.py             # N ∈ {8, 32}, a few minutes on 2 cores
    python benchmarks/simulator.py --quick     # N = 8, fewer steps (smoke test, < 60 s)
    python benchmarks/simulator.py --markdown  # the same table as Markdown

What is measured, for N agents ∈ {8, 32} and the models ``mlp``, ``lenet``
and ``cnn`` (``cdsgd.models.build_model(name, (1, 28, 28), 10)``) on
MNIST-shaped synthetic data (random inputs and labels, 64 samples per agent,
per-agent batch size 32; only speed is measured):

``loop``, ``vmap``
    simulated agent-steps per second of ``Simulator(...).step()`` with that
    strategy: N × steps / seconds. The algorithm is ``cdmsgd`` (lr 0.01,
    momentum 0.95) on a ring (``topologies.mixing_matrix(topologies.build(
    "ring", N))``). ``vmap`` is ``n/a`` for models the Simulator refuses to
    vectorise (dropout or buffers, e.g. ``cnn``).
``limit``
    the compute limit: one ``nn.Module`` from the same ``build_model`` call
    trained in a plain loop (forward, cross-entropy, backward,
    ``torch.optim.SGD`` step) on batches of 32, timed over N × steps single
    steps (the same number of sample-gradients as the simulator's runs);
    reported as agent-steps per second = 1 / (time of one single step).
    N agents cannot be simulated faster than N independent single-model steps
    unless the work is batched across agents (which is what vmap tries).

Method: a few warm-up steps of every variant first; then 3 repeats, each
timing every variant (limit, loop, vmap) once with ``time.perf_counter``
over a fixed number of steps, the variants interleaved within the repeat
(their order rotated from repeat to repeat) so that load changes on the
machine hit all of them alike. Each rate is the median of its 3 repeats and
the ratios are quotients of those medians.

How to read the ratios:

``best/limit``
    the faster strategy's rate over the compute limit. 1.0 means the
    simulator costs no more than training N models one after the other by
    hand; below 1.0 is simulator overhead (per-agent RNG switching,
    ``torch.func`` transforms under vmap, mixing, the update on the N×P
    stack); above 1.0 means the simulator beat the per-model loop (batching
    across agents, or one fused update of the whole stack instead of
    ``torch.optim.SGD``'s per-parameter steps).
``auto/limit``
    the same for the strategy ``strategy="auto"`` picks (named in the
    ``auto`` column). If it differs from ``best/limit`` the automatic choice
    is not the faster one on this machine.
``vmap/loop``
    the speed-up of vectorising agents with ``torch.vmap`` over the Python
    loop (> 1: vmap is faster), whole steps.
``grad vmap/loop``
    the same for the gradient part of a step alone (drawing the batches and
    every agent's forward/backward), without the mixing and the update of
    the N×P stack, which both strategies share.

Goals (stated, not asserted; the numbers depend on the machine and load):
the simulator should reach ≥ 0.9× the compute limit for CNNs, and vmap
should be ≥ 1.5× the loop for MLPs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from _common import BATCH, INPUT_SHAPE, N_CLASSES, SHARD, make_shards  # noqa: E402 - the repository on sys.path first

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import topologies  # noqa: E402
from cdsgd.models import build_model  # noqa: E402
from cdsgd.executor import Simulator  # noqa: E402

LR, MOMENTUM = 0.01, 0.95
REPEATS = 3
MODELS = ("mlp", "lenet", "cnn")

#: simulator steps per timed run (full, quick); the compute limit runs N × as many single steps
STEPS = {"mlp": (60, 8), "lenet": (30, 4), "cnn": (6, 2)}
WARMUP = {"full": 3, "quick": 2}


class SingleModel:
    """One nn.Module trained the plain way: the compute limit per agent-step."""

    def __init__(self, name: str, shard) -> None:
        self.model = build_model(name, INPUT_SHAPE, N_CLASSES)
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = shard
        self.batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, SHARD, BATCH)]
        self.i = 0

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()


def timed(fn, count: int) -> float:
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return time.perf_counter() - t0


def bench(name: str, n: int, steps: int, warmup: int, log) -> dict:
    """Rates (agent-steps/s, medians over the repeats) of limit, loop, vmap for one (model, N)."""
    gen = torch.Generator().manual_seed(1234 + n)
    shards = make_shards(n, gen)
    W = topologies.mixing_matrix(topologies.build("ring", n))

    def model_fn():
        return build_model(name, INPUT_SHAPE, N_CLASSES)

    def simulator(strategy: str) -> Simulator:
        return Simulator(model_fn, shards, W, "cdmsgd", batch_size=BATCH, seed=0, strategy=strategy,
                         lr=LR, momentum=MOMENTUM)

    single = SingleModel(name, shards[0])
    # variant -> (callable, number of calls per timed run, agent-steps per timed run)
    variants = {"limit": (single.step, n * steps, n * steps)}
    everyone = list(range(n))

    def add(strategy: str) -> None:
        sim = simulator(strategy)
        variants[strategy] = (sim.step, steps, n * steps)
        # the gradient part of a step alone (batches + forward/backward of all agents)
        variants[strategy + "_grad"] = (lambda: sim.gradients.gradients(everyone, sim.data.batches(everyone)), steps,
                                        n * steps)

    add("loop")
    try:
        add("vmap")
    except ValueError as e:
        log(f"  vmap refused: {e}")
    auto = simulator("auto").strategy

    for v, (fn, calls, _) in variants.items():
        timed(fn, warmup * (n if v == "limit" else 1))

    names = list(variants)
    rates: dict[str, list[float]] = {v: [] for v in names}
    for r in range(REPEATS):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            fn, calls, work = variants[v]
            rates[v].append(work / timed(fn, calls))
        log("  repeat %d: %s" % (r + 1, ", ".join(f"{v} {rates[v][-1]:.0f}/s" for v in names)))
    med = {v: statistics.median(x) for v, x in rates.items()}
    return {"model": name, "n": n, "auto": auto, **med}


def rows_of(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "N", "limit/s", "loop/s", "vmap/s", "auto", "best/limit", "auto/limit", "vmap/loop",
              "grad vmap/loop"]
    rows = []
    for r in results:
        limit, loop, vmap = r["limit"], r["loop"], r.get("vmap")
        best = max(loop, vmap) if vmap is not None else loop
        auto_rate = vmap if r["auto"] == "vmap" else loop
        rows.append([
            r["model"], str(r["n"]), f"{limit:.0f}", f"{loop:.0f}",
            f"{vmap:.0f}" if vmap is not None else "n/a", r["auto"],
            f"{best / limit:.2f}", f"{auto_rate / limit:.2f}" if auto_rate is not None else "n/a",
            f"{vmap / loop:.2f}" if vmap is not None else "n/a",
            f"{r['vmap_grad'] / r['loop_grad']:.2f}" if vmap is not None else "n/a",
        ])
    return header, rows


def format_plain(header, rows) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    left = {0, 5}  # text columns

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def format_markdown(header, rows) -> str:
    left = {0, 5}
    sep = [":---" if i in left else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, sep, *rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and N=8 only (smoke test)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    ns = (8,) if args.quick else (8, 32)
    torch.manual_seed(0)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
        f"os.cpu_count() = {os.cpu_count()}, python {platform.python_version()}, {platform.machine()}",
        f"mode: {mode}; input {INPUT_SHAPE}, {SHARD} samples/agent, batch {BATCH}/agent, cdmsgd on a ring, "
        f"{REPEATS} repeats (median), steps per run: "
        + ", ".join(f"{m} {STEPS[m][0 if mode == 'full' else 1]}" for m in MODELS),
        "rates in agent-steps/s; limit = 1 / (one single-model training step)",
    ]
    for line in info:  # header first, so a long run shows what it is measuring
        print(line if not args.markdown else line + "  ", flush=True)
    print(flush=True)

    t_start = time.perf_counter()
    results = []
    for n in ns:
        for name in MODELS:
            steps = STEPS[name][0 if mode == "full" else 1]
            log(f"{name}, N={n}: {steps} steps x {REPEATS} repeats")
            results.append(bench(name, n, steps, WARMUP[mode], log))
    header, rows = rows_of(results)
    print(format_markdown(header, rows) if args.markdown else format_plain(header, rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
