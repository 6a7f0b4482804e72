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
    stops every worker when one dies), host the store they agree through, count a worker's death in it
    (:data:`cdsgd.runtime.elastic.DEAD`) so that the survivors leave it behind at once, and start a
    replacement for a lost rank while ``--max-restarts`` allows (it joins the running run). Returns 0 when
    the run completed on the ranks alive at its end, else the first failure's status."""
    import datetime
    import signal
    import subprocess
    import time

    import torch.distributed as dist

    from ..base.comm import free_port
    from ..runtime.elastic import DEAD, ELASTIC_ENV, JOIN, JOIN_ENV

    port = args.master_port if args.master_port is not None else free_port(args.master_addr)
    n, restarts = args.nproc_per_node, args.max_restarts
    store = dist.TCPStore(args.master_addr, port, n, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    cmd = [sys.executable, "-m", "cdsgd", "run", *([path] if path else []), *overrides, "executor=torch"]
    env = {**os.environ, ELASTIC_ENV: "1", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port)}

    def start(r: int, joining: bool) -> subprocess.Popen:
        return subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), JOIN_ENV: str(int(joining))})

    procs = {r: start(r, False) for r in range(n)}
    lost: list[tuple[int, int]] = []  # (rank, status) of every worker that failed, in order
    codes: dict[int, int] = {}

    stopped: list[int] = []  # the signal the launcher got, if any

    def stop(signum, frame):  # pass the launcher's SIGINT/SIGTERM on: each rank checkpoints and stops
        nonlocal restarts
        restarts = 0
        stopped.append(signum)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while len(codes) < n:
            for r, p in list(procs.items()):
                if r in codes or p.poll() is None:
                    continue
                if p.returncode == 0:
                    codes[r] = 0
                    continue
                if stopped:  # stopped on purpose, not lost
                    codes[r] = p.returncode
                    continue
                lost.append((r, p.returncode))
                store.delete_key(JOIN.format(r))  # a replacement that died before it was admitted
                replace = restarts > 0 and any(q not in codes and q != r for q in procs)
                if replace:  # said before the death, so that a survivor that sees the death sees this too
                    store.set(JOIN.format(r), "starting")  # (min_ranks: the survivors may wait for it)
                store.add(DEAD.format(r), 1)  # the survivors stop waiting for it
                if replace:
                    restarts -= 1
                    procs[r] = start(r, True)
                else:
                    codes[r] = p.returncode
            time.sleep(0.02)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return _supervised_status(stopped, lost, codes)


def _supervised_status(stopped: list[int], lost: list[tuple[int, int]], codes: dict[int, int]) -> int:
    """One line on how a supervised (elastic) launch ended, and its exit status."""
    import signal

    if stopped:
        name = signal.Signals(stopped[0]).name
        print(f"cdsgd launch: stopped by {name}; every rank was sent SIGTERM", file=sys.stderr)
        return 128 + stopped[0]
    if not lost:
        return 0

    def how(c):
        return f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit status {c}"

    said = ", ".join(f"rank {r} ({how(c)})" for r, c in lost)
    completed = any(c == 0 for c in codes.values())
    print(f"cdsgd launch: lost {said}; " + ("the run went on" if completed else "no rank finished"), file=sys.stderr)
    if completed:
        return 0
    first = lost[0][1]
    return 128 - first if first < 0 else first
