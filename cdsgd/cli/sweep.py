"""``cdsgd sweep``: expand a sweep file into runs, check what they need, run them, tabulate them."""

from __future__ import annotations

import argparse
import sys

from .args import split_run_args

__all__: list[str] = []

EXAMPLES = """\
overrides: key=value after the sweep file apply to every run, as with 'cdsgd run' (dotted keys too:
topology_params.p=0.1). A key the grid varies takes the override's value in every run (seed=0: only
the seed-0 runs, in the folders the full sweep gives them, so a later full sweep skips them).

before the first run the sweep checks, once for all its runs, that the data sets they need are on
disk (and the packages holding mnist5k, PLAID); if not it stops with one error naming what is missing
and how to get it, and writes nothing. --dry-run lists the runs and does the same check.

examples:
  cdsgd sweep experiments/ablations/topology.toml --out runs/topology --jobs 2     # Fashion-MNIST
  cdsgd sweep experiments/ablations/topology.toml --out runs/topology-digits --jobs 2 dataset=digits
  cdsgd sweep experiments/ablations/topology.toml --dry-run
  cdsgd sweep --collect runs/topology
  cdsgd plot runs/topology
docs: docs/sweeps.md"""


def _add_sweep(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a grid of experiments and tabulate them",
        description="Expand a sweep file (a [base] table of config keys or base = \"config.toml\", a [grid] of "
        "lists, optional [[zip]] groups and [[exclude]] tables; grid keys may be dotted: topology_params.p = "
        "[0.05, 0.1]) into runs, run those not finished yet (a run is identified by its resolved config), and "
        "write DIR/results.csv. One failing run does not stop the others. A re-run says which runs it runs "
        "again; a stopped sweep says how to continue.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="SWEEP.toml [key=value ...]",
                   help="the sweep file (not needed with --collect), then overrides for every run")
    p.add_argument("--out", default=None, help="sweep folder (default: runs/<sweep file name>)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, in separate processes, each with cores/J threads "
                   "unless OMP_NUM_THREADS is set (default 1)")
    p.add_argument("--collect", metavar="DIR", default=None, help="only rebuild DIR/results.csv from its runs")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs, check that what they need is here, and exit (status 2 if something is missing)")
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args) -> int:
    from pathlib import Path

    from ..run.preflight import describe_missing, missing_requirements
    from ..run.sweep import collect, load_sweep, run_sweep

    path, overrides = split_run_args(args.args)
    if args.collect:
        if path or overrides:
            raise ValueError(f"--collect DIR takes no sweep file or overrides, got {' '.join(args.args)!r}")
        if not Path(args.collect).is_dir():
            raise ValueError(f"--collect: {args.collect!r} is not a folder")
        rows = collect(args.collect)
        print(f"{len(rows)} runs in {Path(args.collect) / 'results.csv'}")
        return 0
    if not path:
        raise ValueError("give a sweep file (or --collect DIR)")
    out = args.out or str(Path("runs") / Path(path).stem)
    runs = load_sweep(path, out, overrides)
    if args.dry_run:
        for r in runs:
            print(r.folder)
        print(f"{len(runs)} runs")
        missing = missing_requirements([r.config for r in runs])
        if missing:
            print(f"cdsgd sweep: error: {describe_missing(missing, len(runs))}", file=sys.stderr)
            return 2
        print("everything the runs need is here (data sets, packages, graph files)")
        return 0
    from ..run.progress import safe_stream

    stdout = safe_stream(sys.stdout)  # `cdsgd sweep ... | head` must not stop the sweep
    report = run_sweep(runs, out, jobs=args.jobs, log=lambda line: print(line, file=stdout, flush=True))
    return 1 if report["failed"] else 0
