r"""Cost of communication in the distributed runtime, against its floors.

Run::

    python benchmarks/comm.py             # 2, 4, 8 ranks; 1e4, 1e5, 1e6 floats (a few min on 2 cores)
    python benchmarks/comm.py --quick     # 2 and 4 ranks; 1e4, 1e5 floats; fewer repeats (1–1.5 min on 2 cores)
    python benchmarks/comm.py --markdown  # the same tables as Markdown

The script runs each world size as its own gloo process group on 127.0.0.1,
started by ``cdsgd.testing.run_ranks`` (the harness the tests use: spawned
ranks, ``GLOO_SOCKET_IFNAME=lo``, a free port, ``torch.set_num_threads(1)``
in every rank); rank 0 returns the medians to the parent. Every group has a
hard deadline: past it its ranks are killed and its table cells read
``failed`` (as when a rank raises); the script never hangs. On a machine
with fewer cores than ranks the ranks share cores (the header says so):
then every variant of a table is slowed alike, and the ratios are the
figures to read, not the milliseconds.

Method, for every figure: warm-up calls of every variant first; then
repeats, each timing every variant once (variants interleaved, their order
rotated from repeat to repeat, so that load on the machine hits all alike).
One timing is a ``dist.barrier()`` (all ranks start together), then many
calls back to back under ``time.perf_counter``; its value is the slowest
rank's elapsed time (an all-reduce MAX, outside the timed span) divided by
the number of calls. Each figure is the median of its repeats; ratios are
quotients of medians.

1. Neighbour exchange (ms per exchange), for N ranks on a ring (N = 2: the
   path 0–1, whose mixing matrix is the 2-ring's; both ring neighbours are
   the same rank, so each rank exchanges with one peer, once) and a flat
   float32 vector of P floats:

   ``raw exchange``
       the transport alone: a hand-written ``dist.batch_isend_irecv`` with
       a send to and a receive from each distinct ring neighbour, into the
       rows of a preallocated degree×P matrix, then ``wait()`` on every
       request; no weighting.
   ``fair floor (exchange + weighted sum)``
       what any implementation of the mixing step must do: the raw exchange
       followed by the same fused weighted sum the mixer computes,
       ``torch.addmv(x, R.t(), w, beta=W[rank, rank], out=out)`` over the
       stacked receive buffers R (w: this rank's neighbour weights, in x's
       dtype; ``out`` preallocated). The script checks that its result is
       bit-for-bit the mixer's.
   ``ours``
       ``NeighbourMixer(W, rank).mix(x)`` with W the ring's Metropolis
       mixing matrix: the same exchange and sum, plus the mixer's
       bookkeeping (handle, byte count) and its waits with a timeout.
   ``all_reduce``
       ``dist.all_reduce`` of a P-float buffer (zeros, so that repeated
       in-place sums stay finite), what centralized SGD pays per step.

   ``ours/fair floor`` is the overhead of the mixer over doing the same
   work by hand (1.0 = none): the main figure. ``ours/raw`` also counts the
   weighted sum, which the mixing step cannot skip (a pass over the
   degree+1 vectors, run after the exchange completes).
   ``ours/all_reduce`` < 1 means the neighbour exchange is cheaper than the
   collective it replaces.

2. A CDSGD step (ms per step), 4 ranks on a ring, each rank running the
   runtime executor ``Simulator(model_fn, shards, NeighbourMixer(W, rank),
   ..., agents=[rank], reducer=DistReducer())`` on MNIST-shaped random data
   (1×28×28 inputs, 10 classes, 64 samples per agent, batch 32, lr 0.01),
   models ``mlp`` and ``lenet`` (``cdsgd.models.build_model(name, (1, 28, 28),
   10)``):

   ``compute``
       the same executor with algorithm ``local`` (no communication): batch,
       forward, backward, update; the floor of a step.
   ``overlapped``
       algorithm ``cdsgd`` with ``overlap=True`` (the default): the exchange
       of x_j is posted before the backward pass and waited for after it.
   ``not overlapped``
       ``overlap=False``: the exchange is posted after the backward pass.

   ``overlapped/compute`` is what communication adds to a step when it runs
   behind the backward pass (1.0 = fully hidden); ``not-overlapped/compute``
   is what it would add in series.

3. Simulator vs processes: the time of K steps of the same run (cdsgd on a
   4-ring, same data, seed and hyperparameters) in ``Simulator`` holding all
   4 agents in this one process (default torch threads), against 4 gloo
   processes (the ``overlapped`` timing of table 2, taken over K steps: the
   slowest rank's time for the K steps; process start-up and group set-up
   are not counted). ``processes/simulator`` > 1 means simulating is faster
   than running the ranks as processes on this machine.

Goals (stated, not asserted; the numbers depend on the machine and load):
the mixer ≤ 1.1× the fair floor (``ours/fair floor``); the neighbour exchange
≤ 0.4× an all-reduce of the same buffer at 8 ranks (``ours/all_reduce``);
an overlapped CDSGD step ≤ 1.1× the compute-only step
(``overlapped/compute``).
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
import torch.distributed as dist  # noqa: E402

import topologies  # noqa: E402
from cdsgd.models import build_model  # noqa: E402
from cdsgd.executor import Simulator  # noqa: E402
from cdsgd.testing import run_ranks  # noqa: E402

LR = 0.01
STEP_WORLD = 4  # ranks of tables 2 and 3
MODELS = ("mlp", "lenet")
COMM_TIMEOUT = 60.0  # seconds any single wait / collective may take inside a rank

#: per mode: world sizes, buffer sizes, repeats, warm-up calls, group deadline (s)
MODES = {
    "full": dict(worlds=(2, 4, 8), sizes=(10_000, 100_000, 1_000_000), repeats=5, warmup=5, deadline=300.0),
    "quick": dict(worlds=(2, 4), sizes=(10_000, 100_000), repeats=3, warmup=3, deadline=60.0),
}
#: exchanges per timing, by buffer size (full, quick)
CALLS = {10_000: (200, 50), 100_000: (50, 20), 1_000_000: (10, 4)}
#: K: executor steps per timing (tables 2 and 3), by model (full, quick)
STEPS = {"mlp": (40, 10), "lenet": (20, 5)}


def ring_matrix(n: int):
    """The ring's Metropolis mixing matrix (n = 2: the path 0–1, the same graph)."""
    return topologies.mixing_matrix(topologies.build("path" if n == 2 else "ring", n))


def seeded_shards(n: int):
    return make_shards(n, torch.Generator().manual_seed(1234))


def model_fn_for(name: str):
    def model_fn():
        return build_model(name, INPUT_SHAPE, N_CLASSES)
    return model_fn


def fmt_ms(v) -> str:
    if v is None:
        return "failed"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def fmt_ratio(a, b) -> str:
    return "failed" if a is None or b is None else f"{a / b:.2f}"


def fmt_floats(p: int) -> str:
    e = len(str(p)) - 1
    return f"1e{e}" if p == 10 ** e else str(p)


# --------------------------------------------------------------------------- inside a rank


def _timed_max(fn, calls: int) -> float:
    """Seconds per call of ``fn``: all ranks start together; the slowest rank's time counts."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / calls


def _interleaved(variants: dict, calls: int, repeats: int, warmup: int) -> dict:
    """Median seconds per call of each variant, timed interleaved with rotated order."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    times = {v: [] for v in names}
    for r in range(repeats):
        for v in names[r % len(names):] + names[:r % len(names)]:
            times[v].append(_timed_max(variants[v], calls))
    return {v: statistics.median(t) for v, t in times.items()}


def _bench_exchange(rank: int, world: int, mode: dict, quick: bool) -> list[dict]:
    from cdsgd.runtime import NeighbourMixer

    W = ring_matrix(world)
    peers = sorted({(rank - 1) % world, (rank + 1) % world})
    out = []
    for p in mode["sizes"]:
        x = torch.randn(p, generator=torch.Generator().manual_seed(100 + rank))
        mixer = NeighbourMixer(W, rank, timeout=COMM_TIMEOUT)
        assert mixer.neighbours == peers, (mixer.neighbours, peers)
        # the floors' buffers, laid out as the mixer's: the receives land in the rows of one
        # degree×P matrix, the weights are this rank's row of W in x's dtype, the output is preallocated
        recv = x.new_empty((len(peers), p))
        rows = list(recv)
        w = torch.tensor([float(W[rank, q]) for q in peers], dtype=x.dtype)
        w_self = float(W[rank, rank])
        mixed = torch.empty_like(x)
        ar = torch.zeros_like(x)

        def raw():
            ops = [dist.P2POp(dist.isend, x, q) for q in peers]
            ops += [dist.P2POp(dist.irecv, b, q) for q, b in zip(peers, rows)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        def fair():
            raw()
            torch.addmv(x, recv.t(), w, beta=w_self, out=mixed)  # the mixer's fused pass, exactly

        def ours():
            mixer.mix(x)

        def all_reduce():
            dist.all_reduce(ar)

        # sanity: every variant delivers what it should (else the timings mean nothing)
        raw()
        xs = {q: torch.randn(p, generator=torch.Generator().manual_seed(100 + q)) for q in peers}
        for q, b in zip(peers, rows):
            assert torch.equal(b, xs[q]), f"rank {rank}: raw exchange with rank {q} delivered wrong data"
        expect = W[rank, rank] * x.double() + sum(W[rank, q] * xs[q].double() for q in peers)
        got = mixer.mix(x)
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)
        fair()
        assert torch.equal(mixed, got), f"rank {rank}: the fair floor's sum differs from the mixer's"

        calls = CALLS[p][1 if quick else 0]
        med = _interleaved({"raw": raw, "fair": fair, "ours": ours, "all_reduce": all_reduce}, calls,
                           mode["repeats"], mode["warmup"])
        out.append({"n": world, "p": p, **{k: v * 1e3 for k, v in med.items()}})
    return out


def _bench_steps(rank: int, world: int, mode: dict, quick: bool) -> list[dict]:
    from cdsgd.runtime import DistReducer, NeighbourMixer

    W = ring_matrix(world)
    shards = seeded_shards(world)
    out = []
    for name in MODELS:
        model_fn = model_fn_for(name)

        def executor(algorithm: str, overlap: bool = True) -> Simulator:
            return Simulator(model_fn, shards, NeighbourMixer(W, rank, timeout=COMM_TIMEOUT), algorithm,
                             batch_size=BATCH, seed=0, overlap=overlap, agents=[rank],
                             reducer=DistReducer(timeout=COMM_TIMEOUT), lr=LR)

        ex = {"compute": executor("local"), "overlapped": executor("cdsgd", True),
              "not_overlapped": executor("cdsgd", False)}
        k = STEPS[name][1 if quick else 0]
        med = _interleaved({v: e.step for v, e in ex.items()}, k, mode["repeats"], mode["warmup"])
        out.append({"model": name, "P": ex["compute"].layout.numel, "K": k,
                    "strategy": ex["overlapped"].strategy, **{v: s * 1e3 for v, s in med.items()}})
    return out


def _group(rank: int, world: int, plan: tuple, quick: bool):
    """One rank of a group (run by cdsgd.testing.run_ranks): the plan's benchmarks; rank 0 returns them."""
    mode = MODES["quick" if quick else "full"]
    result = {}
    if "exchange" in plan:
        result["exchange"] = _bench_exchange(rank, world, mode, quick)
    if "steps" in plan:
        result["steps"] = _bench_steps(rank, world, mode, quick)
    # leave together: a rank tearing down its connections would fail a peer still in a collective
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=COMM_TIMEOUT))
    return result if rank == 0 else None


# --------------------------------------------------------------------------- the parent


def run_group(world: int, plan: tuple, quick: bool, deadline_s: float) -> dict:
    """Run ``plan`` in ``world`` gloo ranks; rank 0's result.

    Raises (TimeoutError past the deadline, after killing every rank; RanksFailed when a rank
    raised): the caller marks that group's cells ``failed`` and goes on.
    """
    return run_ranks(_group, world, plan, quick, timeout=deadline_s, pg_timeout=COMM_TIMEOUT)[0]


def bench_simulator(mode: dict, quick: bool) -> dict:
    """Median seconds of K steps of the 4-agent Simulator (cdsgd, ring), per model."""
    W = ring_matrix(STEP_WORLD)
    shards = seeded_shards(STEP_WORLD)
    out = {}
    for name in MODELS:
        sim = Simulator(model_fn_for(name), shards, W, "cdsgd", batch_size=BATCH, seed=0, lr=LR)
        k = STEPS[name][1 if quick else 0]
        for _ in range(mode["warmup"]):
            sim.step()
        times = []
        for _ in range(mode["repeats"]):
            t0 = time.perf_counter()
            for _ in range(k):
                sim.step()
            times.append(time.perf_counter() - t0)
        out[name] = {"K": k, "seconds": statistics.median(times), "strategy": sim.strategy}
    return out


def format_plain(header, rows, left) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def format_markdown(header, rows, left) -> str:
    sep = [":---" if i in left else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, sep, *rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, 1e4 and 1e5 floats, fewer repeats")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)

    mode_name = "quick" if args.quick else "full"
    mode = MODES[mode_name]
    q = 1 if args.quick else 0
    cores = os.cpu_count() or 1
    most = max(mode["worlds"])

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"torch {torch.__version__}, gloo on 127.0.0.1 (lo), torch.get_num_threads() = {torch.get_num_threads()} "
        f"(parent: simulator), 1 per rank, os.cpu_count() = {cores}, python {platform.python_version()}, "
        f"{platform.machine()}",
        f"ranks: {', '.join(map(str, mode['worlds']))}; "
        + (f"{most} ranks on {cores} cores: oversubscribed ({most / cores:g} ranks per core), ratios are the figures"
           if most > cores else f"at most {most} ranks on {cores} cores: one core each"),
        f"mode: {mode_name}; {mode['repeats']} repeats (median of the slowest rank's time), {mode['warmup']} "
        f"warm-up calls; exchanges per timing: "
        + ", ".join(f"{fmt_floats(p)} floats {CALLS[p][q]}" for p in mode["sizes"])
        + "; steps per timing (K): " + ", ".join(f"{m} {STEPS[m][q]}" for m in MODELS),
        f"steps: input {INPUT_SHAPE}, {SHARD} samples/agent, batch {BATCH}, lr {LR}, {STEP_WORLD} ranks on a ring",
    ]
    for line in info:
        print(line if not args.markdown else line + "  ", flush=True)
    print(flush=True)

    t_start = time.perf_counter()
    failed = False
    exchange: dict[tuple[int, int], dict] = {}
    steps: dict[str, dict] = {}
    for world in mode["worlds"]:
        plan = ("exchange", "steps") if world == STEP_WORLD else ("exchange",)
        log(f"{world} ranks: {' + '.join(plan)} ...")
        t0 = time.perf_counter()
        try:
            result = run_group(world, plan, args.quick, mode["deadline"])
        except Exception as e:  # noqa: BLE001 - reported, the other tables still run
            log(f"  FAILED: {e}")
            failed = True
            continue
        log(f"  done in {time.perf_counter() - t0:.0f} s")
        for r in result.get("exchange", []):
            exchange[(r["n"], r["p"])] = r
        for r in result.get("steps", []):
            steps[r["model"]] = r
    if STEP_WORLD not in mode["worlds"]:
        log(f"{STEP_WORLD} ranks: steps ...")
        try:
            for r in run_group(STEP_WORLD, ("steps",), args.quick, mode["deadline"])["steps"]:
                steps[r["model"]] = r
        except Exception as e:  # noqa: BLE001
            log(f"  FAILED: {e}")
            failed = True
    log("simulator (one process, 4 agents) ...")
    sim = bench_simulator(mode, args.quick)

    fmt = format_markdown if args.markdown else format_plain

    print("1. Neighbour exchange on a ring, ms per exchange (float32)\n")
    header = ["N", "floats", "raw exchange ms", "fair floor ms (exchange + weighted sum)", "ours ms",
              "all_reduce ms", "ours/fair floor", "ours/raw", "ours/all_reduce"]
    rows = []
    for n in mode["worlds"]:
        for p in mode["sizes"]:
            r = exchange.get((n, p), {})
            raw, fair, o, a = r.get("raw"), r.get("fair"), r.get("ours"), r.get("all_reduce")
            rows.append([str(n), fmt_floats(p), fmt_ms(raw), fmt_ms(fair), fmt_ms(o), fmt_ms(a),
                         fmt_ratio(o, fair), fmt_ratio(o, raw), fmt_ratio(o, a)])
    print(fmt(header, rows, left=set()))

    print(f"\n2. CDSGD step, {STEP_WORLD} ranks on a ring, ms per step (runtime executor)\n")
    header = ["model", "P", "strategy", "compute ms", "overlapped ms", "not overlapped ms", "overlapped/compute",
              "not-overlapped/compute"]
    rows = []
    for name in MODELS:
        r = steps.get(name, {})
        c, o, no = r.get("compute"), r.get("overlapped"), r.get("not_overlapped")
        rows.append([name, str(r.get("P", "?")), r.get("strategy", "?"), fmt_ms(c), fmt_ms(o), fmt_ms(no),
                     fmt_ratio(o, c), fmt_ratio(no, c)])
    print(fmt(header, rows, left={0, 2}))

    print(f"\n3. K steps of cdsgd, {STEP_WORLD} agents on a ring: Simulator (one process) vs {STEP_WORLD} gloo "
          "processes, seconds\n")
    header = ["model", "K", "simulator", "simulator s", "processes s", "processes/simulator"]
    rows = []
    for name in MODELS:
        s, r = sim[name], steps.get(name)
        proc = r["overlapped"] * r["K"] / 1e3 if r else None
        rows.append([name, str(s["K"]), s["strategy"], f"{s['seconds']:.3f}",
                     f"{proc:.3f}" if proc is not None else "failed", fmt_ratio(proc, s["seconds"])])
    print(fmt(header, rows, left={0, 2}))

    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
