"""Two real "hosts" on one machine: two Linux network namespaces joined by a veth pair, and launches across them.

:func:`netns_pair` creates two network namespaces joined by a veth pair,
with private addresses (10.231.X.1/24 and 10.231.X.2/24) that exist only
inside them: no route leads out, so no traffic leaves the pair. The veth is
created straight inside the namespaces (it never exists in the host's
namespace), and the namespaces (and with them the veth ends) are removed
whatever happens, Ctrl-C included. :func:`shape` shapes one node's veth end
inside its namespace (its egress, which is the other's ingress) with ``tc
qdisc ... netem rate ... delay ...``, or with ``tbf rate ...`` on kernels
built without netem (:func:`has_netem`). :func:`launch` runs

    ip netns exec NS python -m cdsgd launch --nproc-per-node K --nnodes 2 --node-rank R
        --master-addr <node 0's address> --master-port P ... out=<shared folder>

in both namespaces at once (torchrun's default static rendezvous: node 0's
agent hosts the TCPStore on the master port, node 1's connects to it), with
GLOO_SOCKET_IFNAME set to the namespace's veth (without it gloo takes the
hostname's address, 127.0.0.1, which node 1 cannot reach). Ranks of one
node reach each other at the node's own address, which the kernel routes
over the namespace's loopback, not the veth: only traffic between the nodes
crosses the veth (and its shaping).

Needs root and iproute2 (``ip``, and ``tc`` for :func:`shape`):
:func:`unavailable` says why not, and :func:`netns_pair` raises
:class:`Unavailable` when the kernel refuses to create a namespace. Every
launch has a hard timeout, after which it is stopped (SIGTERM, then SIGKILL
to it and to every worker it started: :mod:`launch_harness`).

Used by tests/test_netns.py and benchmarks/network.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from launch_harness import finish, report, start

__all__ = ["Node", "Unavailable", "unavailable", "netns_pair", "run_in", "has_netem", "shape", "qdisc_stats",
           "launch", "Launch", "MASTER_PORT"]

IP_TIMEOUT = 20  # seconds per ip / tc command
MASTER_PORT = 29500  # fresh namespaces: nothing else listens there


class Unavailable(RuntimeError):
    """The rig cannot be built on this machine (the message says why)."""


@dataclass(frozen=True)
class Node:
    """One "host": its namespace, its veth end's name and its address."""

    ns: str
    ifname: str
    address: str


def unavailable(tc: bool = False) -> str | None:
    """Why the rig cannot be built here (not Linux, not root, no ``ip``; no ``tc`` when ``tc``), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command is not installed"
    if tc and shutil.which("tc") is None:
        return "iproute2's 'tc' command is not installed"
    return None


def _run(argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _ip(*args, check=True):
    return _run(["ip", *args], check=check)


@contextlib.contextmanager
def netns_pair():
    """Two namespaces joined by a veth pair: yields [Node, Node] for node 0 and node 1; removes them on exit."""
    why = unavailable()
    if why:
        raise Unavailable(why)
    pid = os.getpid()
    subnet = f"10.231.{pid % 254 + 1}"  # private, and only ever assigned inside the two namespaces
    token = f"{pid}-{os.urandom(3).hex()}"
    nodes = [Node(f"cdsgd-{token}-n{i}", f"cdv{i}", f"{subnet}.{i + 1}") for i in range(2)]
    created = []
    try:
        for node in nodes:
            r = _ip("netns", "add", node.ns, check=False)
            if r.returncode != 0:
                if "exists" in r.stderr:
                    raise RuntimeError(f"ip netns add {node.ns}: {r.stderr.strip()}")
                raise Unavailable(f"cannot create a network namespace here: ip netns add: {r.stderr.strip()}")
            created.append(node.ns)
        n0, n1 = nodes
        # created straight inside the namespaces: the veth never exists in the host's namespace
        _ip("link", "add", "name", n0.ifname, "netns", n0.ns, "type", "veth", "peer", "name", n1.ifname, "netns", n1.ns)
        for node in nodes:
            _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.ns, "link", "set", node.ifname, "up")
            _ip("-n", node.ns, "link", "set", "lo", "up")
        yield nodes
    finally:  # deleting a namespace destroys the veth end inside it, and with it the peer
        for ns in created:
            try:
                _ip("netns", "del", ns, check=False)
            except subprocess.TimeoutExpired:  # still try the other one
                pass


def run_in(node: Node, *argv, check=True) -> subprocess.CompletedProcess:
    """Run a short command (``argv``) inside ``node``'s namespace; a RuntimeError when it fails (``check``)."""
    return _run(["ip", "netns", "exec", node.ns, *argv], check=check)


def _tc(node: Node, *args, check=True):
    return run_in(node, "tc", *args, check=check)


def has_netem(node: Node) -> bool:
    """Whether this kernel has the netem qdisc (tried on ``node``'s veth end, then removed)."""
    r = _tc(node, "qdisc", "replace", "dev", node.ifname, "root", "netem", "delay", "0ms", check=False)
    if r.returncode == 0:
        _tc(node, "qdisc", "del", "dev", node.ifname, "root", check=False)
        return True
    if "unknown" in r.stderr:
        return False
    raise RuntimeError(f"tc qdisc replace dev {node.ifname} root netem failed ({r.returncode}): {r.stderr.strip()}")


def shape(node: Node, rate_mbit: float, delay_ms: float = 0.0, qdisc: str = "netem") -> str:
    """Shape ``node``'s veth end (its egress, the other node's ingress) inside its namespace; returns the qdisc as
    ``tc qdisc show`` prints it.

    ``qdisc="netem"``: ``netem rate <rate_mbit>mbit delay <delay_ms>ms``. ``qdisc="tbf"`` (for kernels built
    without netem): ``tbf rate <rate_mbit>mbit``, a token bucket of 1 ms of the rate (at least two full-size
    frames) and a queue of 1 s of it (no drops), and no delay: ``delay_ms`` must be 0.
    """
    if qdisc == "netem":
        args = ["netem", "rate", f"{rate_mbit:g}mbit", "delay", f"{delay_ms:g}ms"]
    elif qdisc == "tbf":
        if delay_ms:
            raise ValueError(f"tbf adds no delay: delay_ms must be 0 with qdisc='tbf', got {delay_ms:g}")
        rate = rate_mbit * 1e6 / 8  # bytes per second
        args = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(max(2 * 1514, int(rate / 1000))),
                "limit", str(int(rate))]
    else:
        raise ValueError(f"qdisc must be 'netem' or 'tbf', got {qdisc!r}")
    _tc(node, "qdisc", "replace", "dev", node.ifname, "root", *args)
    return _tc(node, "qdisc", "show", "dev", node.ifname).stdout.strip()


def qdisc_stats(node: Node) -> str:
    """``tc -s qdisc show`` of ``node``'s veth end (sent bytes, drops, overlimits, backlog)."""
    return _tc(node, "-s", "qdisc", "show", "dev", node.ifname).stdout.strip()


@dataclass
class Launch:
    """What :func:`launch` ran: ``ok`` when both nodes exited 0 in time; ``log()`` their outputs."""

    procs: list
    names: list
    logs: list
    timed_out: list

    @property
    def ok(self) -> bool:
        return all(p.returncode == 0 for p in self.procs) and not self.timed_out

    def log(self) -> str:
        return report(self.names, self.procs, self.logs, self.timed_out)


def launch(nodes, nproc: int, args, out, logdir, timeout: float, master_port: int = MASTER_PORT,
           env: dict | None = None) -> Launch:
    """``cdsgd launch --nnodes 2`` with ``nproc`` processes in each namespace, ``args`` and ``out=<out>``; waits
    for both with one deadline of ``timeout`` seconds (stopping them at it). Logs go to ``logdir``/node<R>.log;
    ``env`` adds environment variables."""
    master = nodes[0].address
    procs, names, logs = [], [], []
    try:
        for rank, node in enumerate(nodes):
            argv = ["ip", "netns", "exec", node.ns, sys.executable, "-m", "cdsgd", "launch", "--nproc-per-node",
                    str(nproc), "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
                    "--master-port", str(master_port), *args, f"out={out}"]
            logs.append(logdir / f"node{rank}.log")
            procs.append(start(argv, {**(env or {}), "GLOO_SOCKET_IFNAME": node.ifname}, logs[-1]))
            names.append(f"node {rank} (namespace {node.ns}, {node.ifname} {node.address})")
    except BaseException:  # node 1 failed to start (or Ctrl-C): stop node 0 now
        finish(procs, 0)
        raise
    return Launch(procs, names, logs, finish(procs, timeout))  # finish stops both on its deadline or on Ctrl-C
