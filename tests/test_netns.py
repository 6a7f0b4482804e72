"""Two real "hosts": ``cdsgd launch`` across two Linux network namespaces.

The test creates two network namespaces joined by a veth pair, with private
addresses (10.231.X.1/24 and 10.231.X.2/24) that exist only inside them: no
route leads out, so no traffic leaves the pair. It runs

    ip netns exec NS python -m cdsgd launch --nproc-per-node 2 --nnodes 2 --node-rank R
        --master-addr <node 0's address> --master-port P ... out=<shared folder>

in both namespaces at once (torchrun's default static rendezvous: node 0's
agent hosts the TCPStore on the master port, node 1's connects to it), with
GLOO_SOCKET_IFNAME set to the namespace's veth (without it gloo takes the
hostname's address, 127.0.0.1, which node 1 cannot reach). The result must be
identical to a one-node ``cdsgd launch --nproc-per-node 4`` on loopback.

Needs root and iproute2 (``ip``); skipped with the reason otherwise, or when
the kernel refuses to create a namespace. The namespaces (and with them the
veth ends) are removed whatever happens. Every subprocess has a hard timeout,
after which it is stopped (SIGTERM, then SIGKILL to it and to every worker it
started) and its output shown.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from launch_harness import finish, report, start
from test_runtime_run import BASE, NO_WALL, metrics

LAUNCH_TIMEOUT = 90  # seconds per launch (a run takes ~10 s here)
IP_TIMEOUT = 20
MASTER_PORT = 29500  # fresh namespaces: nothing else listens there


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair: yields [(ns, ifname, address), ...] for node 0 and node 1."""
    if sys.platform != "linux":
        pytest.skip("network namespaces need Linux")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's 'ip' command is not installed")
    pid = os.getpid()
    subnet = f"10.231.{pid % 254 + 1}"  # private, and only ever assigned inside the two namespaces
    token = f"{pid}-{os.urandom(3).hex()}"
    nodes = [(f"cdsgd-{token}-n{i}", f"cdv{i}", f"{subnet}.{i + 1}") for i in range(2)]
    created = []
    try:
        for ns, _, _ in nodes:
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                if "exists" in r.stderr:
                    raise RuntimeError(f"ip netns add {ns}: {r.stderr.strip()}")
                pytest.skip(f"cannot create a network namespace here: ip netns add: {r.stderr.strip()}")
            created.append(ns)
        (ns0, if0, _), (ns1, if1, _) = nodes
        # created straight inside the namespaces: the veth never exists in the host's namespace
        _ip("link", "add", "name", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
        for ns, ifname, addr in nodes:
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:  # deleting a namespace destroys the veth end inside it, and with it the peer
        for ns in created:
            try:
                _ip("netns", "del", ns, check=False)
            except subprocess.TimeoutExpired:  # still try the other one
                pass


def _launch_on_two_hosts(netns_pair, tmp_path, nproc, args, out):
    """``cdsgd launch --nnodes 2`` with ``nproc`` processes in each namespace; asserts both nodes exit 0."""
    master = netns_pair[0][2]
    procs, names, logs = [], [], []
    for rank, (ns, ifname, addr) in enumerate(netns_pair):
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "cdsgd", "launch", "--nproc-per-node", str(nproc),
                "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
                "--master-port", str(MASTER_PORT), *args, f"out={out}"]
        logs.append(tmp_path / f"node{rank}.log")
        procs.append(start(argv, {"GLOO_SOCKET_IFNAME": ifname}, logs[-1]))
        names.append(f"node {rank} (namespace {ns}, {ifname} {addr})")
    timed_out = finish(procs, LAUNCH_TIMEOUT)
    assert all(p.returncode == 0 for p in procs) and not timed_out, report(names, procs, logs, timed_out)


def _reference(tmp_path, argv, name):
    out, log = tmp_path / name, tmp_path / f"{name}.log"
    p = start([sys.executable, "-m", "cdsgd", *argv, f"out={out}"], {}, log)
    timed_out = finish([p], LAUNCH_TIMEOUT)
    assert p.returncode == 0 and not timed_out, report([name], [p], [log], timed_out)
    return out


def _assert_same_run(a, b):
    assert torch.equal(torch.load(a / "params.pt"), torch.load(b / "params.pt"))
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb) == 2
    for x, y in zip(ma, mb):
        assert {k: x[k] for k in NO_WALL} == {k: y[k] for k in NO_WALL}


def test_two_nodes_in_network_namespaces_equal_one_node(tmp_path, netns_pair):
    one = _reference(tmp_path, ["launch", "--nproc-per-node", "4", *BASE], "one")
    _launch_on_two_hosts(netns_pair, tmp_path, 2, BASE, tmp_path / "two")
    _assert_same_run(one, tmp_path / "two")


def test_hybrid_on_two_namespace_hosts_is_bit_identical_to_the_simulator(tmp_path, netns_pair):
    """8 agents, 4 on each "host" (one process per namespace), exact mode: the simulator's numbers exactly."""
    args = [*BASE, "n_agents=8", "exact=true", "topology=ring"]
    sim = _reference(tmp_path, ["run", "--no-progress", *args], "sim")
    _launch_on_two_hosts(netns_pair, tmp_path, 1, args, tmp_path / "two")
    _assert_same_run(sim, tmp_path / "two")
