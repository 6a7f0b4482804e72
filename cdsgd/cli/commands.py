"""The ``cdsgd`` command line.

Each verb is a function ``_cmd_<verb>(args)`` plus its parser set-up in
``_add_<verb>``. Errors on user input print one line and exit with status 2;
other failures exit 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import __version__
from .args import split_run_args
from .data import _add_data
from .export import _add_export
from .launch import describe_launch_failure, launch_argv, supervise
from .sweep import _add_sweep
from .topo import _add_topo

__all__ = ["main", "build_parser"]

EPILOG = """exit status: 0 success, 1 runtime failure (a run that diverged included), 2 bad usage or invalid
input (a missing config, sweep or graph file included), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM.
Config keys are given as key=value after the verb, without dashes: cdsgd run lr=0.1 epochs=5.
Run 'cdsgd VERB --help' for a verb's options."""


# ---------------------------------------------------------------------- run


def _config_help() -> str:
    """Every config key with its default, where that comes from, and help, as each field of Config declares them."""
    from ..config import FAMILY_DEFAULTS, config_keys, key_info, toml_value

    families = {k: [] for k in config_keys()}
    for family, models, defaults in FAMILY_DEFAULTS:
        for k, v in defaults.items():
            families[k].append(f"{', '.join(models)}: {toml_value(v)}, the {family} models' default")
    lines = ["config keys (key = default [where the default comes from, if not the config's own choice]: meaning; "
             "(model: value): that model's default, used unless the key is set in the config file or on the "
             "command line):"]
    for name in config_keys():
        info = key_info(name)
        source = f" [{info['source']}]" if info["source"] else ""
        family = f" ({'; '.join(families[name])})" if families[name] else ""
        lines.append(f"  {name} = {toml_value(info['default'])}{source}{family}: {info['help']}")
    return "\n".join(lines)


def _config_text(cfg, taken: dict) -> str:
    """``--print-config``: the resolved config (:func:`cdsgd.config.dump_config`), each value that is a key's
    declared default followed by a comment saying where that default comes from (``key_info(k)["source"]``)."""
    from ..config import config_keys, dump_config, key_info

    lines = dump_config(cfg, taken).splitlines()
    keys = set(config_keys())
    for i, line in enumerate(lines):
        name = line.split(" = ", 1)[0]
        if name not in keys or name in taken:  # a comment line, or a model family's default (dump_config says so)
            continue
        info = key_info(name)
        if info["source"] and getattr(cfg, name) == info["default"]:
            lines[i] = f"{line}  # {info['source']}"
    return "\n".join(lines) + "\n"


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run one experiment and write its output folder",
        description="Run one experiment from a TOML config and key=value overrides (both optional: the "
        "defaults are the README's main job: digits, 5 agents, ring, Metropolis weights, CDMSGD). Writes "
        "config.toml, metrics.csv and summary.json into the folder given by out=.",
        epilog=_config_help() + "\n"
        "examples:\n  cdsgd run\n  cdsgd run experiments/paper/fashion_mnist_ring_iid.toml epochs=2\n"
        "  cdsgd run algorithm=cdsgd topology=torus n_agents=9 lr=0.1 out=runs/torus9\n"
        "docs: docs/running.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG.toml] [key=value ...]",
                   help="an optional TOML config file, then overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit (a comment "
                   "says where each default comes from: the algorithms' own, cdsgd run's, or the model family's)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    from ..config import resolve_config
    from ..run.experiment import run_experiment, validate_config

    path, overrides = split_run_args(args.args)
    cfg, taken = resolve_config(path, overrides)
    plan = validate_config(cfg)
    if args.print_config:
        print(_config_text(cfg, taken), end="")
        return 0
    summary = run_experiment(cfg, progress=False if args.no_progress else None, plan=plan)
    if cfg.executor == "torch" and os.environ.get("RANK", "0") != "0":
        return 0  # rank 0 reports for everyone
    def num(key, fmt):  # NaN is stored as null in summary.json (e.g. a diverged run)
        v = summary.get(key)
        return "nan" if v is None else format(v, fmt)

    from ..run.progress import format_seconds

    if summary.get("bigram_loss") is not None:  # a language model: its loss against the bigram floor
        print(f"test loss {num('test_loss', '.4f')} nats/token, {num('test_bits_per_byte', '.4f')} bits/byte (average "
              f"model {num('test_loss_avg_model', '.4f')}, {num('test_bits_per_byte_avg_model', '.4f')}); bigram floor "
              f"{num('bigram_loss', '.4f')}; next-token accuracy {num('test_accuracy', '.4f')}")
    print(f"test accuracy {num('test_accuracy', '.4f')} (average model {num('test_accuracy_avg_model', '.4f')}), "
          f"consensus distance {num('consensus_distance', '.4g')}; {format_seconds(summary['total_seconds'])} in all "
          f"({format_seconds(summary['train_seconds'])} training, {format_seconds(summary['warmup_seconds'])} warm-up, "
          f"{format_seconds(summary['eval_seconds'])} evaluation); results in {summary['out']}")
    return 0


# ------------------------------------------------------------------- launch


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run one experiment in torchrun processes (one or more agents each)",
        description="A thin front for torchrun (torch.distributed.run): starts --nproc-per-node workers on "
        "this node, each running 'cdsgd run ... executor=torch'. The processes of all nodes share the "
        "n_agents agents in contiguous blocks (n_agents must be a multiple of the number of processes; "
        "one agent per process when they are equal). On one node it picks a free "
        "port itself; for several nodes run the same command on every node with --nnodes, --node-rank, "
        "--master-addr and --master-port. Under membership=elastic (one node) cdsgd launch starts and "
        "watches the workers itself: a rank that dies is left behind, and --max-restarts starts "
        "replacements that join the running run.",
        epilog="examples:\n"
        "  cdsgd launch --nproc-per-node 5\n"
        "  cdsgd launch --nproc-per-node 5 experiments/paper/fashion_mnist_ring_iid.toml epochs=1\n"
        "  cdsgd launch --nproc-per-node 2 n_agents=64 topology=ring     # 32 agents in each process\n"
        "  cdsgd launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 "
        "--master-port 29500 n_agents=4 out=runs/two-nodes\n"
        "docs: docs/distributed.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG.toml] [key=value ...]")
    p.add_argument("--nproc-per-node", type=int, required=True, help="worker processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="port on node 0 (default on one node: a free port; required for several nodes)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun's elastic restarts after a rank fails (default 0); restarted ranks resume "
                   "from the latest complete checkpoint (checkpoint_every=...). With membership=elastic (one "
                   "node), cdsgd launch starts the workers itself, a rank that dies is left behind, and K is "
                   "how many replacements it starts: each joins the running run at its next step")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and the process layout, print the torchrun command, and exit")
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    import time

    from ..config import load_config
    from ..run.experiment import default_out, validate_config
    from ..runtime.exchange import agents_per_process  # loaded with run.experiment already

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    path, overrides = split_run_args(args.args)
    cfg = load_config(path, overrides + ["executor=torch"])
    validate_config(cfg)
    world = args.nproc_per_node * args.nnodes
    per_process = agents_per_process(cfg.n_agents, world)  # before torchrun starts any process
    if not cfg.out:  # every rank (and every node) must write to the same folder name
        if args.nnodes > 1:
            raise ValueError("give out=FOLDER with --nnodes > 1 (every node must agree on it)")
        overrides = overrides + [f"out={default_out(cfg)}"]
    if args.master_addr.startswith("127.") and args.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback, not the hostname's address
    if cfg.membership == "elastic":
        return _launch_elastic(args, cfg, overrides, path, world, per_process)
    from torch.distributed import run as torchrun

    argv = launch_argv(args, overrides, path)
    if args.dry_run:
        import shlex

        print("python -m torch.distributed.run " + shlex.join(argv))
        print(f"{world} process(es), {per_process} agent(s) each")
        return 0
    # torchrun sets OMP_NUM_THREADS=1 (with a banner) when it is unset; give each worker its share of the cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    t0 = time.perf_counter()
    try:
        torchrun.main(argv)
    except SystemExit as e:  # torchrun exits with the workers' status
        return int(e.code or 0)
    except Exception as e:  # ChildFailedError, SignalException: the workers printed their own errors
        print(f"cdsgd launch: {describe_launch_failure(e)} after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 128 + int(e.sigval) if hasattr(e, "sigval") else 1
    return 0


def _launch_elastic(args, cfg, overrides: list[str], path: str | None, world: int, per_process: int) -> int:
    """membership = "elastic": cdsgd launch starts and watches the workers itself (cdsgd.cli.launch.supervise)."""
    if args.nnodes > 1:
        raise ValueError(f"membership='elastic' runs on one node for now (--nnodes {args.nnodes} given): "
                         "cdsgd launch watches its own workers; use --nnodes 1, or membership='fixed'")
    if cfg.min_ranks > world:
        raise ValueError(f"min_ranks = {cfg.min_ranks} is more than the {world} process(es) launched: give at most "
                         f"{world} (0: never wait for a replacement)")
    if args.dry_run:
        print(f"{world} process(es), {per_process} agent(s) each, started and watched by cdsgd launch "
              "(membership='elastic': a rank that dies is left behind, docs/reliability.md)")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    return supervise(args, overrides, path)


# --------------------------------------------------------------------- plot


def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="draw the figures of a run or a sweep",
        description="For a run folder (with metrics.csv): curves.png (test accuracy of the agents and of "
        "the average model, training and test loss, consensus distance vs epoch; with a simulated network, "
        "accuracy vs simulated seconds). For a sweep folder: "
        "accuracy_vs_epoch.png, consensus_vs_epoch.png, loss_vs_time.png (test loss against training "
        "seconds), accuracy_vs_spectral_gap.png, "
        "accuracy_vs_effective_neighbours.png and accuracy_vs_bytes.png (the agents' mean accuracy and the "
        "average model's side by side; mean and min-max band over seeds when a group has several); with a "
        "simulated network (network=), accuracy_vs_sim_time.png, and with target_accuracy, time_to_target.png "
        "(simulated seconds to the target per graph, a seed that never reached it marked so); and "
        "table.md: the final metrics per group of runs (mean ± std over seeds). Series are named as words "
        "(ring, CDMSGD), each with its own marker; a run that diverged, failed or was stopped is drawn as far "
        "as it went, ending in an X, and marked in the legend and in table.md. A panel is 3.3 x 2.5 inches "
        "(a paper's column) with 8-point text.",
        epilog="examples:\n  cdsgd plot runs/topology\n  cdsgd plot runs/topology --format png,pdf --dpi 300 "
        "--out paper/figures",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ..report.style import DPI, FORMATS

    p.add_argument("folder", metavar="DIR", help="a run folder or a sweep folder")
    p.add_argument("--out", default=None, help="where to write the figures and table.md (default: DIR)")
    p.add_argument("--format", dest="formats", action="append", metavar="FMT",
                   help=f"file format(s) of the figures: {', '.join(FORMATS)}; several as a comma-separated list "
                   "(--format png,pdf); default: png")
    p.add_argument("--dpi", type=float, default=DPI, help=f"resolution of PNG files (default: {DPI}; PDF and "
                   "SVG are vector files)")
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args) -> int:
    from pathlib import Path

    from ..report.plotting import plot_run, plot_sweep
    from ..run.sweep import collect

    from ..report.style import parse_formats

    folder = Path(args.folder)
    if not folder.is_dir():
        raise ValueError(f"{args.folder!r} is not a folder")
    formats = parse_formats(args.formats)
    if not (args.dpi > 0 and args.dpi < float("inf")):
        raise ValueError(f"--dpi must be a positive number, got {args.dpi:g} (e.g. --dpi 300)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    runs = [d for d in folder.iterdir() if d.is_dir() and (d / "metrics.csv").exists()]
    single = (folder / "metrics.csv").exists()
    files = plot_run(folder, args.out, formats, args.dpi) if single else []
    if runs or not single:
        if single:  # a run written into a sweep folder (earlier releases allowed it): draw both, and say so
            print(f"cdsgd plot: {args.folder!r} holds a run's metrics.csv and {len(runs)} run folder(s); "
                  "drawing both (write single runs elsewhere)", file=sys.stderr)
        if not (folder / "results.csv").exists():
            collect(folder)
        files += plot_sweep(folder, args.out, formats, args.dpi)
        from ..run.sweep import group_table

        table = Path(args.out or folder) / "table.md"
        table.write_text(group_table(folder))
        files.append(str(table))
    for f in files:
        print(f)
    return 0


# --------------------------------------------------------------------- main

_VERBS = (_add_run, _add_launch, _add_sweep, _add_plot, _add_data, _add_topo, _add_export)


class _Parser(argparse.ArgumentParser):
    """argparse, with a hint when a config key was written as an option (``--lr=0.1``)."""

    def error(self, message: str):
        import re

        from ..config import config_keys

        for name, value in re.findall(r"--([A-Za-z][\w.-]*)(?:=(\S+))?", message):
            key = name.replace("-", "_")
            if key in config_keys() or key.split(".")[0] in config_keys():
                message += f"\nhint: config keys are written key=value, without dashes: {key}={value or 'VALUE'}"
                break
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cdsgd",
        description="Decentralized collaborative learning (CDSGD/CDMSGD) over a fixed communication graph.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cdsgd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for add in _VERBS:
        add(sub)
    for verb in sub.choices.values():  # 'cdsgd run --debug' as well as 'cdsgd --debug run'
        verb.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show Python tracebacks on errors")
    return parser


def _input_error(e: BaseException) -> bool:
    """Errors in what the user gave (exit status 2): bad values, and files that are not there."""
    return isinstance(e, (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError))


def _terminate(signum, frame) -> None:
    import signal

    from ..runtime.group import Terminated  # its home: a SIGTERM during the import of run.experiment must not fail here

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough: let the run write its files
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    import signal
    import threading

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "args") and not any(a.startswith("-") for a in extra):
        args.args += extra  # key=value after an option: cdsgd sweep FILE --out DIR dataset=digits
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.verb in ("run", "sweep") and threading.current_thread() is threading.main_thread():
        # SIGTERM (a scheduler's stop, torchrun stopping its workers) ends a run as Ctrl-C does:
        # the files of the evaluations done are complete and summary.json says "interrupted"
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        from ..runtime.group import Terminated
        from ..run.progress import safe_stream

        term = isinstance(e, Terminated)
        rank = os.environ.get("RANK") if "TORCHELASTIC_RUN_ID" in os.environ else None
        who = f"cdsgd {args.verb}" + (f" (rank {rank})" if rank is not None else "")
        detail = f" ({e})" if str(e) else ""
        print(f"{who}: {'stopped by SIGTERM' if term else 'interrupted'}{detail}", file=safe_stream(sys.stderr))
        return 143 if term else 130
    except BrokenPipeError:
        from ..run.progress import silence

        silence(sys.stdout)  # the output was cut short by its reader (`cdsgd topo ... | head`): not an error
        return 0
    except Exception as e:
        from ..run.progress import safe_stream

        status = 2 if _input_error(e) else 1
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"cdsgd {args.verb}: error: {e}", file=safe_stream(sys.stderr))
        return status
    finally:
        if args.verb in ("run", "sweep") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # leaving: a late SIGTERM just ends the process
