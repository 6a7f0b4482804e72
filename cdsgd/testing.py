r"""Run a function in N real gloo processes on 127.0.0.1, with a hard deadline.

For tests and benchmarks of code that needs a ``torch.distributed`` process
group, on one machine, without torchrun:

:func:`run_ranks`
    ``run_ranks(fn, world, *args)`` spawns ``world`` processes; each sets
    ``torch.set_num_threads(1)``, joins a gloo process group over a free
    loopback port (``GLOO_SOCKET_IFNAME=lo``) and calls
    ``fn(rank, world, *args)``. Returns ``{rank: return value}`` in rank
    order. A rank's exception is raised here as :class:`RanksFailed` (an
    AssertionError, so a test fails) carrying its traceback; when the
    deadline passes every rank still running is killed and TimeoutError is
    raised: a caller never hangs.
:func:`free_port`
    a TCP port that is free on an address now (never 0); its home is
    :mod:`cdsgd.base.comm` (the launcher needs it too), re-exported here.

``fn`` and ``args`` must be picklable (the processes are spawned, not
forked): ``fn`` a module-level function, ``args`` plain values or tensors.
Return values come back by value (``torch.save``), tensors included.

Usage (in a test module; ``fn`` defined at module level)::

    import torch
    import torch.distributed as dist
    from cdsgd.testing import run_ranks

    def _sum_of_ranks(rank, world, scale):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return float(t) * scale

    def test_all_reduce():
        assert run_ranks(_sum_of_ranks, 3, 2.0, timeout=60) == {0: 6.0, 1: 6.0, 2: 6.0}

Any module-level callable taking ``(rank, world)`` will do:

>>> import operator
>>> run_ranks(operator.add, 2, timeout=120)       # fn(rank, world) = rank + world
{0: 2, 1: 3}
>>> 0 < free_port() < 65536
True

Production code never imports this module (tests/test_architecture.py
checks it): it is for tests and benchmarks only.
"""

from __future__ import annotations

import datetime
import io
import os
import time
import traceback

from .base.comm import free_port

__all__ = ["RanksFailed", "free_port", "run_ranks"]


class RanksFailed(AssertionError):
    """One or more ranks raised (or died without reporting).

    ``errors`` maps each failed rank to its traceback (or a line saying how
    it exited); the message shows the lowest failed rank's.
    """

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = dict(sorted(errors.items()))
        rank = min(self.errors)
        others = sorted(self.errors)[1:]
        also = f" (ranks {others} failed too)" if others else ""
        super().__init__(f"rank {rank} failed{also}:\n{self.errors[rank]}")


def _worker(rank: int, world: int, port: int, fn, args: tuple, queue, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401 - before the join, as cdsgd.runtime.group.DistGroup explains

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
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo ranks; ``{rank: return value}``.

    Args:
        fn: a picklable (module-level) callable.
        world: the number of ranks (≥ 1).
        *args: passed to ``fn`` after ``rank`` and ``world``; picklable.
        timeout: the hard deadline, in seconds, for the whole group (start-up
            included). Past it, the ranks still running are killed and
            TimeoutError names them.
        pg_timeout: the process group's timeout (``init_process_group``'s),
            the default for every collective and wait inside the ranks.
        expect_exit: ranks that may exit without reporting (e.g. a rank the
            test kills); their value is ``("exited", exit code)``. Any other
            rank that exits without reporting is an error.

    Raises:
        RanksFailed: a rank raised, or exited without reporting.
        TimeoutError: the deadline passed.
    """
    import torch
    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    # The children unpickle the worker by its module's name: name the package's module even when this
    # file was loaded under another name (``python -m doctest cdsgd/testing.py`` imports it as "testing").
    from cdsgd.testing import _worker as worker

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, fn, args, queue, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s "
                                   f"(finished: {sorted(results)}, failed: {sorted(errors)})")
            if not queue.empty():
                rank, status, value = queue.get()
                if status == "ok":
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
        raise RanksFailed(errors)
    return dict(sorted(results.items()))
