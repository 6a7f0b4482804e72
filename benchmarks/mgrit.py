r"""Parallel-in-time GRU: serial recurrence vs MGRIT, side by side in one run.

Run::

    python benchmarks/mgrit.py [--lengths 256 1024 4096 16384] [--train-epochs 30] [--quick]

Table 1, for T in ``--lengths`` and (hidden, batch) in {(32, 8), (128, 32)}:
the wall-clock of one forward + backward pass of the implicit GRU
(``cdsgd.mgrit``) over a random sequence, loss Σ_t ⟨h_t, r_t⟩ with random
r: the serial loop (autograd), MGRIT in one process (vectorised over the
fine-grid intervals; coarsening 8, 2 levels, FCF, 2 or 3 iterations), and MGRIT
across 2 gloo processes on 127.0.0.1 (each owning half of the time
intervals, one thread each) when ``cdsgd.mgrit`` provides it; the speedup
over serial, the iterations, and the relative errors of the states and the
parameter gradients against the serial pass (‖·‖₂ / ‖serial‖₂).

Table 2, training (``--train-epochs``, default 30): ``model=pgru`` (hidden 32)
with the serial recurrence vs MGRIT (3 iterations) on PLAID (the default
series, averaged over blocks of 4 steps), on PLAID at full length
(``subsample=1``) and on a long-sequence task (``synthetic_seq`` with mean
length 1000, up to 4000): the simulator on one agent, ``msgd`` lr 0.3,
momentum 0.9, ``grad_clip`` 1, batch 16, the same seed for both; the test
accuracy and loss (evaluated with the run's own recurrence), the test
accuracy of the same parameters with the serial recurrence, and the
wall-clock of the training steps (evaluation excluded).

One thread per process throughout (``torch.set_num_threads(1)``), so the
1-process and 2-process columns use the same compute per process.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import _common  # noqa: F401,E402 - the repository on sys.path first

import torch  # noqa: E402

from cdsgd import mgrit  # noqa: E402

CF, LEVELS, ITERS = 8, 2, (2, 3)


def _problem(T, hidden, batch, seed=0):
    torch.manual_seed(seed)
    cell = mgrit.ImplicitGRUCell(8, hidden)
    x = torch.randn(batch, T, 8)
    r = torch.randn(batch, T, hidden)
    return cell, x, r


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _pass(cell, x, r, forward):
    cell.zero_grad()
    H = forward(cell, x)
    (H * r).sum().backward()
    return H.detach(), torch.cat([p.grad.reshape(-1) for p in cell.parameters()])


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _two_processes(T, hidden, batch, iters, repeats):
    """(seconds, states error, gradient error) of MGRIT over 2 gloo processes, or None if unavailable."""
    dist_fn = getattr(mgrit, "mgrit_gru_distributed", None)
    if dist_fn is None:
        return None
    from cdsgd.testing import run_ranks

    results = run_ranks(_rank_pass, 2, T, hidden, batch, iters, repeats, timeout=1800)
    return results[0]


def _rank_pass(rank, world, T, hidden, batch, iters, repeats):
    torch.set_num_threads(1)
    cell, x, r = _problem(T, hidden, batch)
    ref_H, ref_g = _pass(cell, x, r, lambda c, xx: mgrit.serial_forward(c, xx))
    fn = mgrit.mgrit_gru_distributed

    block = mgrit.time_block(T, cf=CF, levels=LEVELS)

    def one():
        cell.zero_grad()
        H = fn(cell, x, None, cf=CF, levels=LEVELS, iters=iters, fcf=True)  # this rank's block of time
        (H * r[:, block]).sum().backward()  # gradients summed over the ranks at the end of backward
        return mgrit.gather_states(H.detach()), torch.cat([p.grad.reshape(-1) for p in cell.parameters()])

    one()  # warm-up: gloo connects the pair of ranks at the first exchange
    secs, (H, g) = _timed(one, repeats)
    return secs, _rel(H, ref_H), _rel(g, ref_g)


def table_speed(lengths, quick):
    print("| T | hidden | batch | iters | serial s | MGRIT 1 proc s | speedup | MGRIT 2 procs s | speedup | "
          "state err | grad err | fall-back path s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for hidden, batch in ((32, 8), (128, 32)):
        for T in lengths:
            repeats = 1 if quick or T >= 16384 else 3
            cell, x, r = _problem(T, hidden, batch)
            serial_s, (H0, g0) = _timed(lambda: _pass(cell, x, r, lambda c, xx: mgrit.serial_forward(c, xx)),
                                        repeats)
            # the solver's own serial loop, forward and adjoint (what a fall-back runs): no autograd graph
            exact = lambda c, xx: mgrit.mgrit_gru(c, xx, cf=CF, levels=LEVELS, stats={"serial": {"forward", "backward"}})  # noqa: E731
            exact_s, _ = _timed(lambda: _pass(cell, x, r, exact), repeats)
            for iters in ITERS:
                fwd = lambda c, xx: mgrit.mgrit_gru(c, xx, cf=CF, levels=LEVELS, iters=iters, fcf=True)  # noqa: E731
                m_s, (H1, g1) = _timed(lambda: _pass(cell, x, r, fwd), repeats)
                two = _two_processes(T, hidden, batch, iters, repeats)
                two_cols = f"{two[0]:.3f} | {serial_s / two[0]:.2f}x" if two else "n/a | "
                print(f"| {T} | {hidden} | {batch} | {iters} | {serial_s:.3f} | {m_s:.3f} | {serial_s / m_s:.2f}x | "
                      f"{two_cols} | {_rel(H1, H0):.1e} | {_rel(g1, g0):.1e} | {exact_s:.3f} |", flush=True)


def _serial_accuracy(sim, test, batch=64):
    """Test accuracy of the trained parameters with the serial (exact) recurrence."""
    model = sim.agent_model(0)
    mode, model.rnn.mode = model.rnn.mode, "serial"
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x).argmax(1) for x in test[0].split(batch)])
    model.rnn.mode = mode
    return float((pred == test[1]).float().mean())


def table_training(epochs, sets=None):
    from cdsgd.data import load_dataset
    from cdsgd.executor import Simulator
    from cdsgd.models import build_model

    print("\n| data set | recurrence | epochs | test acc | every 5 epochs | test loss | acc, serial states | train s | "
          "speedup | serial solves | V-cycles every 5 epochs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    loaders = {
        "plaid (mean length 81)": lambda: load_dataset("plaid", "data"),
        "plaid, subsample=1 (mean length 324)": lambda: load_dataset("plaid", "data", subsample=1),
        "synthetic_seq (mean length 1000)": lambda: load_dataset("synthetic_seq", "data", n_train=256, n_test=128,
                                                                 mean_length=1000.0, min_length=200, max_length=4000),
    }
    for name, load in loaders.items():
        if sets and not any(key in name for key in sets):
            continue
        ds, base = load(), None
        for mode in ("serial", "mgrit"):
            def model_fn():  # the recurrence's defaults (cf 8, up to 4 V-cycles to rtol 1e-3, fall-back, frozen coarse)
                return build_model("pgru", ds.input_shape, ds.n_classes, hidden=32, mode=mode)

            sim = Simulator(model_fn, [ds.train], None, "msgd", lr=0.3, momentum=0.9, grad_clip=1.0, batch_size=16,
                            seed=0, test_set=ds.test, eval_batch_size=64)
            secs, along, solves, fallbacks, cycles = 0.0, [], 0.0, 0.0, []
            for epoch in range(1, epochs + 1):
                t0 = time.perf_counter()
                for _ in range(sim.steps_per_epoch):
                    sim.step()
                secs += time.perf_counter() - t0  # the training steps only; evaluation is off the clock
                if epoch % 5 == 0 or epoch == epochs:
                    row = sim.evaluate()  # its mgrit_* figures cover the steps since the previous row
                    along.append(f"{row['test_accuracy']:.2f}")
                    if mode == "mgrit":
                        solves, fallbacks = solves + row["mgrit_solves"], fallbacks + row["mgrit_fallbacks"]
                        cycles.append(f"{row['mgrit_iters']:.1f}")
            base = secs if base is None else base
            serial_solves = f"{fallbacks:.0f} of {solves:.0f}" if mode == "mgrit" else ""
            print(f"| {name} | {mode} | {epochs} | {row['test_accuracy']:.3f} | {' '.join(along)} | {row['test_loss']:.3f} | "
                  f"{_serial_accuracy(sim, ds.test):.3f} | {secs:.1f} | {base / secs:.2f}x | {serial_solves} | {' '.join(cycles)} |",
                  flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--train-epochs", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="one repeat, T up to 1024, no training table")
    parser.add_argument("--tables", nargs="+", choices=("speed", "training"), default=["speed", "training"])
    parser.add_argument("--sets", nargs="+", help="training table: only the data sets whose name contains one of these")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lengths = [T for T in args.lengths if not args.quick or T <= 1024]
    print(f"# benchmarks/mgrit.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  "
          f"1 thread per process; MGRIT cf {CF}, {LEVELS} levels, FCF, {' or '.join(map(str, ITERS))} iterations\n"
          f"# python benchmarks/mgrit.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    if "speed" in args.tables:
        table_speed(lengths, args.quick)
    if not args.quick and args.train_epochs and "training" in args.tables:
        table_training(args.train_epochs, args.sets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
