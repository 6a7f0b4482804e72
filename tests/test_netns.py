"""Two real "hosts": ``cdsgd launch`` across two Linux network namespaces.

The rig (tests/netns_rig.py, shared with benchmarks/network.py) creates two
network namespaces joined by a veth pair, with private addresses
(10.231.X.1/24 and 10.231.X.2/24) that exist only inside them: no route
leads out, so no traffic leaves the pair. It runs

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

import sys

import pytest
import torch

import netns_rig
from launch_harness import finish, report, start
from test_runtime_run import BASE, NO_WALL, metrics

LAUNCH_TIMEOUT = 90  # seconds per launch (a run takes ~10 s here)


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair (tests/netns_rig.py): [Node, Node] for node 0 and node 1."""
    why = netns_rig.unavailable()
    if why:
        pytest.skip(why)
    try:
        with netns_rig.netns_pair() as nodes:
            yield nodes
    except netns_rig.Unavailable as e:
        pytest.skip(str(e))


def _launch_on_two_hosts(netns_pair, tmp_path, nproc, args, out):
    """``cdsgd launch --nnodes 2`` with ``nproc`` processes in each namespace; asserts both nodes exit 0."""
    run = netns_rig.launch(netns_pair, nproc, args, out, tmp_path, LAUNCH_TIMEOUT)
    assert run.ok, run.log()


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
