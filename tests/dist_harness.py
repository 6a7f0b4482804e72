"""Run a function in N real gloo processes on 127.0.0.1, with a hard timeout.

``run_ranks(fn, world, *args, timeout=...)`` starts ``world`` spawned
processes, each joining a gloo process group over a free loopback port and
calling ``fn(rank, world, *args)``; returns {rank: return value}. A child's
exception is re-raised here with its traceback; when the deadline passes,
every child is killed and the test fails (never hangs).
"""

from __future__ import annotations

import datetime
import io
import os
import traceback

import torch.multiprocessing as mp

from cdsgd.cli import free_port  # noqa: F401 - re-exported for the tests


def _worker(rank, world, port, fn, args, queue, pg_timeout):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # by value: a shared-memory tensor would die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
              expect_exit: frozenset = frozenset()) -> dict:
    """{rank: fn's return value}; a rank that exits without reporting is an error (exit code shown),
    except the ranks in ``expect_exit``, whose result is ("exited", exit code)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results) - set(errors))} did not finish "
                                   f"within {timeout} s (finished: {sorted(results)}, failed: {sorted(errors)})")
            if not queue.empty():
                rank, status, value = queue.get()
                if status == "ok":
                    import torch

                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors[rank] = value
            else:
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and not p.is_alive() and queue.empty():
                        if r in expect_exit:
                            results[r] = ("exited", p.exitcode)
                        else:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
                time.sleep(0.01)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return results
