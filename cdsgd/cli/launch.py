"""How ``cdsgd launch`` drives torchrun: its argument list, and one line on why the workers failed."""

from __future__ import annotations

__all__ = ["describe_launch_failure", "launch_argv"]


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
