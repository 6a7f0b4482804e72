"""Gossip beside the DiLoCo family on one graph, one data split and one modelled network (docs/results.md).

Every run trains 16 agents of a small byte-level gpt on Debian's fortunes corpus (``--workload fashion``:
an MLP on Fashion-MNIST, the cross-check) for ``--steps`` steps; the
trajectory does not depend on the network (no message is lost), so each run is trained once and its trace
(the bytes each agent sent at each step, how late each message may land, the schedule phase) is replayed
through the clock of every network (datacenter, wan, edge) with a fixed computation time per step
(``--compute-ms``, standing for an accelerator's step, so the figures do not depend on this machine).
What it reports per (rule, split, seed, network): the steps, simulated seconds and bytes per agent until the
average model's validation loss first reaches ``--target`` nats/token, and the final loss.

    python experiments/lowcomm/study.py --out docs/results/lowcomm            # about 40 minutes on 2 cores
    python experiments/lowcomm/study.py --only diloco_h50 --splits iid --steps 200 --out /tmp/quick
    python experiments/lowcomm/study.py --workload fashion --target 0.5 --out docs/results/lowcomm_fashion

Writes results.csv (one row per rule, split, seed and network), curves.csv (every evaluation with its
simulated time on each network) and loss_vs_time_<split>.png.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

from cdsgd.config import load_config
from cdsgd.executor.timing import ClockFeed
from cdsgd.network import network_spec
from cdsgd.run.plan import build_executor, prepare, validate_config
from cdsgd.runtime.group import LocalGroup

#: the workloads: the config every run shares, and the step sizes of the AdamW and the SGD rules
WORKLOADS = {
    "lm": (["dataset=fortunes", "dataset_params={context = 32}", "model=gpt",
            "model_params={layers = 2, heads = 2, width = 32, context = 32}", "n_agents=16", "topology=ring",
            "batch_size=8", "lr_schedule=cosine", "lr_warmup=50", "weight_decay=0.01", "eval_samples=512"],
           "0.006", "0.3"),
    "fashion": (["dataset=fashion-mnist", "model=mlp", "n_agents=16", "topology=ring", "batch_size=32",
                 "lr_schedule=cosine", "lr_warmup=20", "eval_samples=2000", "test_subset=2000"], "0.002", "0.05"),
}
ADAMW = ["optimizer=adamw", "lr={adamw}"]
SGD = ["optimizer=sgd", "lr={sgd}", "momentum=0.9"]
#: the rules compared, each a list of config overrides on top of the workload's
RULES = {
    "cdsgd_adamw": ["algorithm=cdsgd", *ADAMW],
    "choco_top5": ["algorithm=choco", *SGD, "compression=top_k", "compression_params={ratio = 0.05}"],
    "relaysum": ["algorithm=relaysum", *SGD],
    "gossip_h10": ["algorithm=cdsgd", *ADAMW, "local_steps=10"],
    "diloco_h10": ["algorithm=diloco", *ADAMW, "local_steps=10"],
    "diloco_h50": ["algorithm=diloco", *ADAMW, "local_steps=50"],
    "diloco_h200": ["algorithm=diloco", *ADAMW, "local_steps=200"],
    # the outer step's own settings: plain averaging (η = 1, μ = 0: FedAvg with AdamW inside), NoLoCo's μ = 0.5
    "diloco_h10_avg": ["algorithm=diloco", *ADAMW, "local_steps=10", "outer_lr=1.0", "outer_momentum=0"],
    "diloco_h50_avg": ["algorithm=diloco", *ADAMW, "local_steps=50", "outer_lr=1.0", "outer_momentum=0"],
    "diloco_h50_mu05": ["algorithm=diloco", *ADAMW, "local_steps=50", "outer_momentum=0.5"],
    "diloco_graph_h10": ["algorithm=diloco", *ADAMW, "local_steps=10", "outer_mixing=graph"],
    "diloco_graph_h50": ["algorithm=diloco", *ADAMW, "local_steps=50", "outer_mixing=graph"],
    "diloco_graph_h50_avg": ["algorithm=diloco", *ADAMW, "local_steps=50", "outer_mixing=graph", "outer_lr=1.0",
                             "outer_momentum=0"],
    "noloco_h50": ["algorithm=noloco", *ADAMW, "local_steps=50"],
    "noloco_h50_mu05": ["algorithm=noloco", *ADAMW, "local_steps=50", "outer_momentum=0.5"],  # the paper's runs
    "streaming_h50_f4": ["algorithm=diloco", *ADAMW, "local_steps=50", "fragments=4", "overlap_steps=2"],
    "sparseloco_h50": ["algorithm=diloco", *ADAMW, "local_steps=50", "compression=top_k",
                       "compression_params={ratio = 0.03}", "error_feedback=true"],
    "sparseloco_h50_avg": ["algorithm=diloco", *ADAMW, "local_steps=50", "compression=top_k",
                           "compression_params={ratio = 0.03}", "error_feedback=true", "outer_lr=1.0",
                           "outer_momentum=0"],
}
SPLITS = {"iid": ["partition=iid"], "dirichlet": ["partition=dirichlet", "dirichlet_alpha=0.1"]}
NETWORKS = ("datacenter", "wan", "edge")


def train(overrides: list[str], steps: int, every: int, compute_ms: float):
    """One run: its evaluations, each with the step, the losses and the bytes per agent, and the simulated
    seconds on every network of NETWORKS."""
    cfg = load_config(overrides=overrides)
    plan = validate_config(cfg)
    parts = prepare(cfg, plan)
    ex = build_executor(cfg, parts, LocalGroup())
    ex.algorithm.bind(n_agents=ex.n_agents, steps_per_epoch=ex.steps_per_epoch, seed=ex.seed, total_steps=steps)
    ex.algorithm.prepare(ex.mixer.at(0), ex.X)  # choco's γ
    clocks = {name: ClockFeed(network_spec(name, {"compute_ms": compute_ms}), ex) for name in NETWORKS}
    everyone = list(range(len(ex.agents)))
    rows = []
    for k in range(steps):
        before = ex.mixer.bytes_sent.clone()
        mixer = ex.algorithm.step_mixer(ex.mixer, k)
        ex.step()
        sent = ex.mixer.bytes_sent - before
        for feed in clocks.values():
            feed.record(everyone, 0.0, sent, ex.algorithm.message_delay(k), getattr(mixer, "phase", None))
        if (k + 1) % every == 0 or k + 1 == steps:
            row = ex.evaluate()
            rows.append({"step": k + 1, "loss_avg_model": row["test_loss_avg_model"], "loss": row["test_loss"],
                         "bytes_per_agent": row["bytes_sent_per_agent"],
                         **{f"sim_seconds_{n}": feed.flush(ex.reducer) for n, feed in clocks.items()}})
            if not math.isfinite(row["test_loss_avg_model"]):
                break
    return rows, parts.bigram_loss


def write_tables(out: Path, results: list[dict], curves: list[dict]) -> None:
    for name, table in (("results.csv", results), ("curves.csv", curves)):
        with open(out / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)


def first_reach(rows: list[dict], target: float) -> dict | None:
    return next((r for r in rows if r["loss_avg_model"] <= target), None)


def plot(curves: list[dict], split: str, target: float, floor: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(NETWORKS), figsize=(13, 4.2), sharey=True)
    rules = list(dict.fromkeys(c["rule"] for c in curves if c["split"] == split))
    first = min(c["seed"] for c in curves)  # one curve per rule: the first seed's
    for ax, net in zip(axes, NETWORKS):
        for i, rule in enumerate(rules):
            pts = [c for c in curves if c["split"] == split and c["rule"] == rule and c["seed"] == first]
            style = "-" if rule.startswith(("diloco", "noloco", "streaming", "sparseloco")) else "--"
            ax.plot([p[f"sim_seconds_{net}"] for p in pts], [p["loss_avg_model"] for p in pts], style,
                    color=plt.cm.tab20(i % 20), label=rule, lw=1.4)
        ax.axhline(target, color="k", lw=0.8, ls=":")
        if floor is not None:
            ax.axhline(floor, color="grey", lw=0.8, ls="-.")
        ax.set_xscale("log")
        ax.set_title(f"{net} network")
        ax.set_xlabel("simulated seconds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss of the average model (nats)")
    low = min(c["loss_avg_model"] for c in curves if math.isfinite(c["loss_avg_model"]))
    axes[0].set_ylim(0.95 * low, 1.3 * target)
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"16 agents, {split} split: dotted the target loss" + (", dash-dotted the bigram floor"
                                                                       if floor is not None else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", default="lm", choices=list(WORKLOADS))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="evaluate every this many steps")
    p.add_argument("--compute-ms", type=float, default=20.0, help="simulated computation per step")
    p.add_argument("--target", type=float, default=2.75, help="validation loss to reach (nats/token)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    p.add_argument("--only", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--replot", nargs="+", type=Path, default=[],
                   help="no training: draw --only's curves from these folders' curves.csv into --out")
    p.add_argument("--floor", type=float, default=None, help="with --replot: the bigram floor to draw")
    args = p.parse_args(argv)
    if args.replot:
        curves = [{k: (v if k in ("rule", "split") else float(v)) for k, v in row.items()}
                  for d in args.replot for row in csv.DictReader(open(d / "curves.csv"))]
        curves = [c for c in curves if c["rule"] in args.only]
        curves.sort(key=lambda c: args.only.index(c["rule"]))
        for split in args.splits:
            plot(curves, split, args.target, args.floor, args.out / f"loss_vs_time_{split}.png")
        return 0
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results, curves, floor = [], [], float("nan")
    for split in args.splits:
        for rule in args.only:
            for seed in args.seeds:
                t0 = time.perf_counter()
                base, adamw, sgd = WORKLOADS[args.workload]
                rule_keys = [o.replace("{adamw}", adamw).replace("{sgd}", sgd) for o in RULES[rule]]
                rows, floor = train([*base, *rule_keys, *SPLITS[split], f"seed={seed}"], args.steps, args.every,
                                    args.compute_ms)
                for r in rows:
                    curves.append({"rule": rule, "split": split, "seed": seed, **r})
                hit = first_reach(rows, args.target)
                for net in NETWORKS:
                    results.append({
                        "rule": rule, "split": split, "seed": seed, "network": net,
                        "steps_to_target": hit["step"] if hit else "",
                        "sim_seconds_to_target": round(hit[f"sim_seconds_{net}"], 3) if hit else "",
                        "bytes_to_target": int(hit["bytes_per_agent"]) if hit else "",
                        "final_loss": round(rows[-1]["loss_avg_model"], 4),
                        "final_sim_seconds": round(rows[-1][f"sim_seconds_{net}"], 3),
                        "final_bytes": int(rows[-1]["bytes_per_agent"])})
                print(f"{split:9s} {rule:18s} seed {seed}: final loss {rows[-1]['loss_avg_model']:.4f}, target at "
                      f"step {hit['step'] if hit else '-'}, " + ", ".join(
                          f"{n} {rows[-1][f'sim_seconds_{n}']:.1f} s" for n in NETWORKS)
                      + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
                write_tables(args.out, results, curves)  # after every run: a failure later loses nothing
    for split in args.splits:
        plot(curves, split, args.target, floor, args.out / f"loss_vs_time_{split}.png")
    print((f"bigram floor {floor:.4f}; " if floor is not None else "") + f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
