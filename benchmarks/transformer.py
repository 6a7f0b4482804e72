r"""Gradient strategies for ``model = "gpt"``: the loop against vmap, and both against the compute limit.

Run::

    python benchmarks/transformer.py              # N ∈ {8, 64}, two model sizes; ~15-25 min on 2 cores
    python benchmarks/transformer.py --quick      # N = 8, the small model, fewer steps (smoke test, < 60 s)
    python benchmarks/transformer.py --markdown   # the same table as Markdown
    python benchmarks/transformer.py --threads 1 --clock cpu   # 1 torch thread, CPU seconds (a shared machine)
    python benchmarks/transformer.py --optimizer adamw --loop-only   # AdamW agents against torch.optim.AdamW

What is measured, for N agents and two sizes of ``cdsgd.models.build_model("gpt", (T,), 256, width=d,
context=T)`` (2 layers, 4 heads; d = 64 with T = 64 tokens, d = 128 with T = 128) on random byte
windows (256 tokens, 32 windows per agent, per-agent batch ``BATCH`` = 16 windows, the next token as the
target at every position; only speed is measured):

``loop``, ``vmap``
    simulated agent-steps per second of ``Simulator(...).step()`` with that strategy (CDMSGD, lr 0.01,
    momentum 0.95, on a ring): N × steps / seconds.
``limit``
    the compute limit: one model from the same ``build_model`` call trained by hand (forward,
    cross-entropy over every position, backward, ``torch.optim.SGD`` with momentum) on batches of 16
    windows; agent-steps per second = 1 / (time of one such step), timed over N × steps steps.

With ``--optimizer adamw`` every agent is an AdamW agent (CDMSGD with ``optimizer="adamw"``, lr 1e-3,
betas (0.9, 0.999), weight decay 0.01: the moments as N × P stacks, the update written once for the
stack) and the limit steps ``torch.optim.AdamW`` with the same hyper-parameters: ``loop/limit`` is then
the N gpt agents of the simulator against N single-model AdamW steps (the goal: at least 0.8 at N = 8
and N = 64).
``auto``
    the strategy ``strategy="auto"`` picks for this model.
``vmap/loop``, ``grad vmap/loop``
    vmap's rate over the loop's, for whole steps and for the gradient part alone (the batches and
    every agent's forward and backward, without the mixing and the update both strategies share).

Method as benchmarks/simulator.py (warm-up steps first, then repeats, each timing every variant once
over a fixed number of steps, the variants interleaved, their order rotated from repeat to repeat),
but 5 repeats and each rate the best of them, not the median: on a shared machine other work only
ever slows a variant down, and the fastest of 5 interleaved timings is the least disturbed one.
``--clock cpu`` times with ``time.process_time`` (the CPU seconds of this process) instead of the wall
clock: with ``--threads 1`` that is the work itself, whatever else runs on the machine.

What it showed (docs/benchmarks.md): vmap is 0.72-0.86x the loop, so ``auto`` picks the loop for
attention. torch 2.13 has no vmap batching rule for the CPU kernel of ``scaled_dot_product_attention``
(it warns "There is a performance drop ..."), so under vmap the attention runs agent by agent through
functorch's fallback, and what vmap batches (the dense layers, already large matrix products per
agent) gains nothing over the loop.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

import _common  # noqa: F401 - the repository on sys.path first

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import topologies  # noqa: E402
from cdsgd.executor import Simulator  # noqa: E402
from cdsgd.models import build_model  # noqa: E402

LR, MOMENTUM = 0.01, 0.95
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
OPTIMIZER = "sgd"  # --optimizer
STRATEGIES = ("loop", "vmap")  # --loop-only: ("loop",)
VOCAB, SHARD, BATCH = 256, 32, 16
REPEATS = 5
#: (width, tokens per window), and the simulator steps per timed run (full, quick) for each
SIZES = {(64, 64): (4, 2), (128, 128): (2, 1)}
VARIANTS = ("limit", "loop", "vmap", "loop_grad", "vmap_grad")


def shards_for(n: int, T: int, gen: torch.Generator):
    """``n`` shards of SHARD random byte windows: inputs (SHARD, T), targets the next token (SHARD, T)."""
    out = []
    for _ in range(n):
        s = torch.randint(0, VOCAB, (SHARD, T + 1), generator=gen)
        out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return out


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def timed(fn, count: int) -> float:
    t0 = clock()
    for _ in range(count):
        fn()
    return clock() - t0


def single_step(model_fn, shard):
    """One model trained by hand: returns a callable doing one step on the next batch."""
    model = model_fn().train()
    opt = (torch.optim.AdamW(model.parameters(), **ADAMW) if OPTIMIZER == "adamw"
           else torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    x, y = shard
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, SHARD, BATCH)]
    count = [0]

    def step() -> None:
        xb, yb = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb).reshape(-1, VOCAB), yb.reshape(-1)).backward()
        opt.step()

    return step


def bench(n: int, width: int, T: int, steps: int, log) -> dict:
    """Median rates (agent-steps/s) of every variant for one (N, width, T)."""
    shards = shards_for(n, T, torch.Generator().manual_seed(1234 + n))
    W = topologies.mixing_matrix(topologies.build("ring", n))

    def model_fn():
        return build_model("gpt", (T,), VOCAB, width=width, context=T)

    def simulator(strategy: str) -> Simulator:
        rule = ({"optimizer": "adamw", **{k: list(v) if k == "betas" else v for k, v in ADAMW.items()}}
                if OPTIMIZER == "adamw" else {"lr": LR, "momentum": MOMENTUM})
        return Simulator(model_fn, shards, W, "cdmsgd", batch_size=BATCH, seed=0, strategy=strategy, **rule)

    everyone = list(range(n))
    variants = {"limit": (single_step(model_fn, shards[0]), n * steps)}
    for strategy in STRATEGIES:
        sim = simulator(strategy)
        variants[strategy] = (sim.step, steps)
        variants[strategy + "_grad"] = (
            lambda sim=sim: sim.gradients.gradients(everyone, sim.data.batches(everyone)), steps)
    auto = simulator("auto").strategy
    for v, (fn, calls) in variants.items():  # warm-up: one step each (N for the single model)
        timed(fn, n if v == "limit" else 1)
    names = [v for v in VARIANTS if v in variants]
    rates: dict[str, list[float]] = {v: [] for v in names}
    for r in range(REPEATS):
        for v in names[r % len(names):] + names[:r % len(names)]:
            fn, calls = variants[v]
            rates[v].append(n * steps / timed(fn, calls))
        log(f"  repeat {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:.1f}/s" for v in names))
    nan = float("nan")  # the vmap variants under --loop-only
    return {"N": n, "width": width, "T": T, "auto": auto, **dict.fromkeys(VARIANTS, nan),
            **{v: max(x) for v, x in rates.items()}}


def table(results: list[dict], markdown: bool) -> str:
    header = ["N", "width", "T", "limit/s", "loop/s", "vmap/s", "auto", "loop/limit", "vmap/limit", "vmap/loop",
              "grad vmap/loop"]
    rows = [[str(r["N"]), str(r["width"]), str(r["T"]), f"{r['limit']:.1f}", f"{r['loop']:.1f}",
             f"{r['vmap']:.1f}", r["auto"], f"{r['loop'] / r['limit']:.2f}", f"{r['vmap'] / r['limit']:.2f}",
             f"{r['vmap'] / r['loop']:.2f}", f"{r['vmap_grad'] / r['loop_grad']:.2f}"] for r in results]
    if markdown:
        sep = [":---" if h == "auto" else "---:" for h in header]
        return "\n".join("| " + " | ".join(c) + " |" for c in [header, sep, *rows])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [header, *rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=8, the small model, fewer steps (smoke test)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall", help="wall time or this process's CPU time")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="the agents' local optimizer, and the limit's (torch.optim.SGD or AdamW)")
    parser.add_argument("--loop-only", action="store_true", help="time the loop strategy only (no vmap columns)")
    args = parser.parse_args(argv)
    global clock, OPTIMIZER, STRATEGIES
    clock, OPTIMIZER = CLOCK[args.clock], args.optimizer
    STRATEGIES = ("loop",) if args.loop_only else STRATEGIES
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")  # said once, in the docstring
    torch.manual_seed(0)
    q = int(args.quick)
    cases = [(n, w, T) for n in ((8,) if q else (8, 64)) for (w, T) in list(SIZES)[:1 if q else None]]
    info = [f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
            f"os.cpu_count() = {os.cpu_count()}, python {platform.python_version()}, {platform.machine()}",
            f"gpt: 2 layers, 4 heads, vocabulary {VOCAB}; {SHARD} windows/agent, batch {BATCH}/agent, "
            f"cdmsgd on a ring, {OPTIMIZER} agents, best of {REPEATS} repeats; rates in agent-steps/s of {args.clock} time"]
    for line in info:
        print(line + ("  " if args.markdown else ""), flush=True)
    print(flush=True)
    t0 = time.perf_counter()
    results = []
    for n, width, T in cases:
        steps = SIZES[(width, T)][q]
        print(f"N={n}, width={width}, T={T}: {steps} steps x {REPEATS} repeats", file=sys.stderr, flush=True)
        results.append(bench(n, width, T, steps, lambda m: print(m, file=sys.stderr, flush=True)))
    print(table(results, args.markdown))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
