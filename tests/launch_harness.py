"""Launchers as real process trees, for tests: start one, find its workers, stop it whatever happens.

``start`` runs a command (a ``cdsgd launch``) in a session of its own with
its output (and its workers') in a file; ``finish`` waits for launchers with
one hard deadline and stops those still running; ``stop`` ends a launcher and
every worker it started (SIGTERM first, so torchrun stops its workers itself;
then SIGKILL to the group and each worker: torchrun puts each worker in a
session of its own, so killing the launcher alone could leave them running).
``workers`` finds the live worker processes of a launcher by their RANK.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["start", "stat", "descendants", "workers", "stop", "finish", "report", "wait_until"]


def start(argv, env, log):
    """Start a launcher in its own process group, its output (and its workers') going to the file ``log``."""
    with open(log, "w") as f:  # a file, not a pipe: an orphaned worker holding a pipe open could block a read
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)


def stat(pid):
    """(parent pid, start time) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        if fields[0] == "Z":  # a zombie has exited: only its parent's wait is missing
            return None
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid):
    """{pid: start time} of every live descendant of ``pid``."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    found, todo = {}, [pid]
    while todo:
        for child, start_time in children.get(todo.pop(), []):
            found[child] = start_time
            todo.append(child)
    return found


def workers(pids):
    """{RANK: pid} of the live torchrun workers among ``pids``."""
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env and stat(pid) is not None:
            found[int(env[b"RANK"])] = pid
    return found


def wait_until(condition, timeout, what, step=0.02):
    """Poll ``condition()`` until it is truthy (returned) or ``timeout`` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def stop(p, grace=15.0):
    """End a launcher that ran out of time, and every worker it started."""
    procs = descendants(p.pid)
    try:
        os.kill(p.pid, signal.SIGTERM)
        p.wait(timeout=grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    procs.update(descendants(p.pid))
    for pid, start_time in procs.items():
        st = stat(pid)
        if st is not None and st[1] == start_time:  # still that same process, not a recycled pid
            os.kill(pid, signal.SIGKILL)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def finish(procs, timeout):
    """Wait for every launcher with one shared deadline; stop those still running at it. Returns the pids
    that were stopped."""
    deadline = time.monotonic() + timeout
    timed_out = []
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.append(p.pid)
                stop(p)
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)
    return timed_out


def report(names, procs, logs, timed_out):
    return "\n".join(f"===== {n}: exit {p.returncode}{' (stopped on timeout)' if p.pid in timed_out else ''}\n"
                     f"{log.read_text(errors='replace')}" for n, p, log in zip(names, procs, logs))
