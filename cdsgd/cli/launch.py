"""How ``cdsgd launch`` drives torchrun: its argument list, and one line on why the workers failed."""

from __future__ import annotations

import os
import sys

__all__ = ["describe_launch_failure", "launch_argv", "supervise"]


def launch_argv(args, overrides: list[str], path: str | None) -> list[str]:
    """torchrun's argument list for ``cdsgd launch``."""
    from ..base.comm import free_port  # here, not at the top: `cdsgd --help` must not wait for torch

    port = args.master_port
    if port is None:
        if args.nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1 (every node must use the same port)")
        port = free_port(args.master_addr)
    if not 0 < port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {port}")
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}", f"--master-port={port}",
            f"--max-restarts={args.max_restarts}", "-m", "cdsgd", "run"]
    return argv + ([path] if path else []) + overrides + ["executor=torch"]



def describe_launch_failure(e: Exception) -> str:
    """One line on why torchrun gave up: the rank that failed first and how (exit status or signal)."""
    import signal

    sigval = getattr(e, "sigval", None)
    if sigval is not None:  # the launcher itself got SIGTERM/SIGINT: torchrun stopped every worker
        name = signal.Signals(sigval).name  # torchrun passes the signal it got on to every worker
        return f"stopped by {name}; every rank was sent {name}"
    failures = getattr(e, "failures", None)
    if not failures:
        return f"workers failed ({type(e).__name__}: {e})"
    def cause(r):  # a death by another signal than torchrun's SIGTERM first, then an error exit, then time
        code = failures[r].exitcode
        stopped = code in (-int(signal.SIGTERM), 128 + int(signal.SIGTERM))
        return (stopped, code >= 0, failures[r].timestamp, r)

    first_rank = min(failures, key=cause)
    parts = []
    for rank in sorted(failures):
        code = failures[rank].exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        parts.append(f"rank {rank} ({how})")
    return f"lost rank {first_rank} first; failed: {', '.join(parts)}; the other ranks were stopped"


def supervise(args, overrides: list[str], path: str | None) -> int:
    """``cdsgd launch`` under ``membership = "elastic"``: start the workers here (not through torchrun, which
    stops every worker when one dies), host the store they agree through, and mark a worker that exits
    before the others in it (:data:`cdsgd.runtime.elastic.DEAD`) so that the survivors leave it behind at
    once. Returns 0 when the run completed on the ranks that survived, else the first failure's status."""
    import datetime
    import signal
    import subprocess
    import time

    import torch.distributed as dist

    from ..base.comm import free_port
    from ..runtime.elastic import DEAD, ELASTIC_ENV

    port = args.master_port if args.master_port is not None else free_port(args.master_addr)
    n = args.nproc_per_node
    store = dist.TCPStore(args.master_addr, port, n, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    cmd = [sys.executable, "-m", "cdsgd", "run", *([path] if path else []), *overrides, "executor=torch"]
    env = {**os.environ, ELASTIC_ENV: "1", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port)}
    procs = {r: subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)}
    codes: dict[int, int] = {}

    def stop(signum, frame):  # pass the launcher's SIGINT/SIGTERM on: each rank checkpoints and stops
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while len(codes) < n:
            for r, p in procs.items():
                if r not in codes and p.poll() is not None:
                    codes[r] = p.returncode
                    if p.returncode != 0:  # the survivors stop waiting for it
                        store.set(DEAD.format(r), str(p.returncode))
            time.sleep(0.02)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    lost = {r: c for r, c in codes.items() if c != 0}
    if lost:
        def how(c):
            return f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit status {c}"

        said = ", ".join(f"rank {r} ({how(c)})" for r, c in sorted(lost.items()))
        went_on = len(lost) < n
        print(f"cdsgd launch: lost {said}; " + ("the run went on without it" if went_on else "no rank finished"),
              file=sys.stderr)
        if not went_on:
            first = min(lost.values(), key=lambda c: (c == 0, c))
            return 128 - first if first < 0 else first
    return 0
