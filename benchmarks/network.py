r"""The simulated network clock against a real shaped network: ``cdsgd launch`` on two network namespaces.

Run (as root; needs iproute2's ``ip`` and ``tc``)::

    python benchmarks/network.py              # ring, complete × 10, 100 Mbit/s: about 4 min on 2 cores
    python benchmarks/network.py --quick      # ring at 100 Mbit/s only, fewer epochs (< 1 min)
    python benchmarks/network.py --markdown   # the same table as Markdown

The rig is tests/netns_rig.py's (the one tests/test_netns.py runs): two
network namespaces joined by a veth pair, private addresses that exist only
inside them. Each veth end is shaped inside its namespace, its egress being
the other node's ingress, with

    tc qdisc replace dev <veth> root netem rate <B>mbit delay <L>ms

where the kernel has netem (``--shaper netem``). Where it has not (this
repository's machine: ``CONFIG_NET_SCH_NETEM`` is not set, ``tc`` answers
"Specified qdisc kind is unknown"), ``--shaper auto`` falls back to the
kernel's token bucket, ``tbf rate <B>mbit`` with a bucket of 1 ms of the
rate and a queue of 1 s of it (nothing is dropped): the rate is shaped, no
delay is added, and the clock is given ``latency_ms = 0`` (the veth's own
latency is tens of microseconds).

For each bandwidth B and graph, ``cdsgd launch --nproc-per-node 2 --nnodes
2`` runs in both namespaces (4 ranks, ``n_agents = 4``, one agent per rank,
agents 0 and 1 on node 0) the same run with ``network_params = {bandwidth_mbps
= B, latency_ms = L, agents_per_host = 2}`` and no ``compute_ms`` (each
agent's computation is measured from the run): CDMSGD, ``dataset = digits``,
``model = mlp`` (50,826 float32 parameters: one message is 203,304 bytes,
0.163 s at 10 Mbit/s), batch 32 (12 steps per epoch), evaluation of one
agent on 100 test samples after every epoch. A message between agents 0 and
1 (or 2 and 3) goes over the namespace's loopback (the ranks reach each other
at their node's own address), which the clock counts as free; the others
cross the shaped veth, host by host, as the clock's uplinks per host do.

Figures, per run, from metrics.csv (one row per epoch):

``real s/step``
    steady state: (wall_seconds of the last row − of the first) / (steps
    between them), rank 0's training seconds (evaluation excluded). The first
    epoch is warm-up and left out: its first step waits for every rank to
    have started (processes start at different times on 2 cores) and opens
    the connections, several seconds that are no part of a step.
``clock s/step``
    the same difference of the rows' ``sim_seconds``: what the clock
    predicts for those steps from the bytes sent and each agent's measured
    computation.
``real/clock``
    their quotient; the target is 1 ± 0.2.
``per epoch``
    the slowest and fastest epoch's real s/step after the first (stability).
``network only``
    the clock's prediction with ``compute_ms = 0`` (the network's share:
    ``cdsgd.network.NetworkClock`` fed the same messages, no computation).
``whole run``
    ``train_seconds / simulated_seconds`` from summary.json, warm-up
    included, for comparison.

Options beyond the grid: ``--tcp reno|bbr`` sets the TCP congestion control
inside the two namespaces (only the two a namespace may choose here; BBR
paces each of a host's two flows at its estimated share, which leaves the
link partly idle: about 10–20 % slower steps here).

The runtime posts each exchange's receives before its sends
(:func:`cdsgd.base.comm.exchange`): gloo sends a message only once the
receiver's "receive ready" notification has arrived, and a rank that posted
its sends first wrote that notification on the TCP connection behind its own
outgoing message, so each cross-host pair's two directions took turns
(1.4–1.65× the clock before that change, docs/benchmarks.md).

The header names the machine, the kernel, the load average (other work on
the machine slows the ranks' computation and the kernel's packet handling:
the 100 Mbit/s rows feel it most), the shaper (``tc qdisc show``) and the
TCP congestion control inside the namespaces; the script prints each veth's
``tc -s qdisc`` drop count after each run (0 expected).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import pathlib
import platform
import signal
import sys
import tempfile
import time

from _common import ROOT, cpu_model  # noqa: E402 - the repository on sys.path first

sys.path.insert(0, str(ROOT / "tests"))  # the two-namespace rig, shared with tests/test_netns.py
import netns_rig  # noqa: E402

#: the run every measurement makes (besides topology, network_params, epochs and out)
RUN = ["dataset=digits", "model=mlp", "algorithm=cdmsgd", "n_agents=4", "batch_size=32", "eval_every=1",
       "eval_agents=1", "eval_samples=100", "overwrite=true"]
N_AGENTS, AGENTS_PER_HOST = 4, 2
STEPS_PER_EPOCH = 12  # digits' 1,437 training samples over 4 agents in batches of 32 (planning only)


def message_floats() -> int:
    """P, the parameters of RUN's model (the mlp on digits' 1×8×8 inputs, 10 classes): one message's floats."""
    from cdsgd.models import build_model

    return sum(p.numel() for p in build_model("mlp", (1, 8, 8), 10).parameters())


def network_only(topology: str, bandwidth: float, latency: float, floats: int, steps: int = 50) -> float:
    """The clock's seconds per step with no computation: the messages alone (cdsgd.network.NetworkClock)."""
    import numpy as np

    import topologies
    from cdsgd.network import NetworkClock, network_spec

    W = topologies.mixing_matrix(topologies.build(topology, N_AGENTS))
    spec = network_spec("none", {"bandwidth_mbps": bandwidth, "latency_ms": latency, "compute_ms": 0,
                                 "agents_per_host": AGENTS_PER_HOST})
    clock = NetworkClock(spec, W)
    degree = ((np.asarray(W) != 0).sum(axis=0) - 1).astype(float)
    for _ in range(steps):
        clock.advance(np.zeros(N_AGENTS), degree * floats * 4)
    return clock.seconds / steps


def epochs_for(seconds: float, per_step: float, least: int) -> int:
    """1 warm-up epoch, then enough epochs for ``seconds`` of timed steps (at least ``least``)."""
    return 1 + max(least, math.ceil(seconds / (STEPS_PER_EPOCH * per_step)))


def read_rows(out: pathlib.Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def measure(rows: list[dict], summary: dict) -> dict:
    first, last = rows[0], rows[-1]
    steps = last["step"] - first["step"]
    per_epoch = [(b["wall_seconds"] - a["wall_seconds"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])]
    real = (last["wall_seconds"] - first["wall_seconds"]) / steps
    clock = (last["sim_seconds"] - first["sim_seconds"]) / steps
    return {"steps": int(steps), "real": real, "clock": clock, "ratio": real / clock,
            "epoch_min": min(per_epoch), "epoch_max": max(per_epoch),
            "whole": summary["train_seconds"] / summary["simulated_seconds"]}


def fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def table(results: list[dict], markdown: bool) -> str:
    head = ["graph", "Mbit/s", "delay ms", "timed steps", "real s/step", "clock s/step", "real/clock",
            "within 20 %", "per epoch (real)", "network only", "whole run"]
    rows = [[r["topology"], f"{r['bandwidth']:g}", f"{r['latency']:g}", str(r["steps"]), fmt(r["real"]),
             fmt(r["clock"]), f"{r['ratio']:.2f}", "yes" if abs(r["ratio"] - 1) <= 0.2 else "no",
             f"{fmt(r['epoch_min'])}–{fmt(r['epoch_max'])}", fmt(r["net"]), f"{r['whole']:.2f}"]
            for r in results]
    if markdown:
        align = ["---:"] * len(head)
        align[0] = ":---"
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [head, *rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[10.0, 100.0], help="Mbit/s (default 10 100)")
    parser.add_argument("--topologies", nargs="+", default=["ring", "complete"], help="default: ring complete")
    parser.add_argument("--latency-ms", type=float, default=5.0,
                        help="netem's delay and the clock's latency_ms (default 5; 0 with the tbf shaper)")
    parser.add_argument("--shaper", choices=("auto", "netem", "tbf"), default="auto",
                        help="auto: netem where the kernel has it, else tbf (rate only, no delay)")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="timed seconds per run (after the warm-up epoch) the epochs are chosen for (default 15)")
    parser.add_argument("--tcp", choices=("default", "reno", "bbr"), default="default",
                        help="TCP congestion control inside the two namespaces (default: the namespaces' own)")
    parser.add_argument("--quick", action="store_true", help="ring at 100 Mbit/s only, 5 timed seconds")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--keep", type=pathlib.Path, help="write the runs' folders here (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.bandwidths, args.topologies, args.seconds = [100.0], ["ring"], 5.0
    why = netns_rig.unavailable(tc=True)
    if why:
        print(f"benchmarks/network.py: {why}", file=sys.stderr)
        return 2

    def terminate(signum, frame):  # SIGTERM as Ctrl-C: the launches are stopped and the namespaces removed
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cdsgd-network-") as tmp:
        base = args.keep or pathlib.Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        try:
            with netns_rig.netns_pair() as nodes:
                shaper = args.shaper
                if shaper == "auto":
                    shaper = "netem" if netns_rig.has_netem(nodes[0]) else "tbf"
                latency = args.latency_ms if shaper == "netem" else 0.0
                for node in nodes:
                    if args.tcp != "default":
                        netns_rig.run_in(node, "sysctl", "-q", f"net.ipv4.tcp_congestion_control={args.tcp}")
                cc = netns_rig.run_in(nodes[0], "sysctl", "-n", "net.ipv4.tcp_congestion_control").stdout.strip()
                env = {}
                import torch

                print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
                print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; kernel {platform.release()}; torch "
                      f"{torch.__version__}, python {platform.python_version()}; load average (1 min) before "
                      f"{os.getloadavg()[0]:.2f}")
                print(f"rig: two network namespaces joined by a veth pair; cdsgd launch 2 nodes x 2 ranks, "
                      f"n_agents={N_AGENTS}, agents_per_host={AGENTS_PER_HOST}; TCP congestion control {cc}")
                if shaper == "tbf" and args.shaper == "auto":
                    print(f"shaper: tbf (this kernel has no netem qdisc): rate only, no added delay; the clock's "
                          f"latency_ms = 0 (asked: {args.latency_ms:g} ms)")
                else:
                    print(f"shaper: {shaper}")
                floats = message_floats()
                print(f"run: {' '.join(RUN)}; one message {floats:,} float32 = {4 * floats:,} bytes")
                print(flush=True)
                results = []
                for bw in args.bandwidths:
                    for node in nodes:
                        shown = netns_rig.shape(node, bw, latency, shaper)
                    print(f"# {shown}", flush=True)
                    for topo in args.topologies:
                        net = network_only(topo, bw, latency, floats)
                        epochs = epochs_for(args.seconds, net, least=2)
                        out = base / f"{topo}-{bw:g}mbit"
                        params = f"{{bandwidth_mbps={bw:g}, latency_ms={latency:g}, agents_per_host={AGENTS_PER_HOST}}}"
                        run_args = [*RUN, f"topology={topo}", f"epochs={epochs}", f"network_params={params}"]
                        timeout = 180 + 3 * epochs * STEPS_PER_EPOCH * net
                        t0 = time.perf_counter()
                        launched = netns_rig.launch(nodes, 2, run_args, out, base, timeout, env=env)
                        if not launched.ok:
                            print(launched.log(), file=sys.stderr)
                            return 1
                        summary = json.loads((out / "summary.json").read_text())
                        r = {"topology": topo, "bandwidth": bw, "latency": latency, "net": net,
                             **measure(read_rows(out), summary)}
                        results.append(r)
                        drops = [netns_rig.qdisc_stats(n).split("dropped ")[1].split(",")[0] for n in nodes]
                        print(f"# {topo} at {bw:g} Mbit/s: {epochs} epochs in {time.perf_counter() - t0:.0f} s; "
                              f"real {fmt(r['real'])} s/step, clock {fmt(r['clock'])} s/step, ratio "
                              f"{r['ratio']:.2f}; drops on the veth ends {drops[0]} / {drops[1]}", flush=True)
        except netns_rig.Unavailable as e:
            print(f"benchmarks/network.py: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # the launches are stopped and the namespaces removed by now
            print("benchmarks/network.py: interrupted", file=sys.stderr)
            return 130
        print()
        print(table(results, args.markdown))
        print(f"\ntotal {time.perf_counter() - started:.0f} s; load average (1 min) after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
