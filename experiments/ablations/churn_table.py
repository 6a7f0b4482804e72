"""The churn study's table (experiments/ablations/churn.toml): one row per rule, graph and churn rate.

    python experiments/ablations/churn_table.py runs/churn

Reads the sweep's run folders (summary.json) and prints, over the seeds, the average model's final test
accuracy (mean ± standard deviation of the runs that completed), the agents' own mean accuracy, the
simulated seconds of the whole run on the wan preset, the agents online on average, the departures per run,
and how many runs diverged. A diverged run counts in no mean.
"""

from __future__ import annotations

import json
import statistics
import sys
import tomllib
from collections import defaultdict
from pathlib import Path


def rule_of(cfg: dict) -> str:
    steps = cfg.get("local_steps", 0)
    return cfg["algorithm"] + (f" H={steps}" if steps and steps > 1 else "")


def main(folder: str) -> None:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for summary in sorted(Path(folder).glob("*/summary.json")):
        cfg = tomllib.loads((summary.parent / "config.toml").read_text())
        churn = cfg.get("network_params", {}).get("churn", 0.0)
        groups[(rule_of(cfg), cfg["topology"], churn)].append(json.loads(summary.read_text()))
    print("| rule | graph | churn | avg-model acc | agents' acc | sim s | online | departures | diverged |")
    print("|---|---|---|---|---|---|---|---|---|")
    order = {"cdmsgd": 0, "dsgt": 1, "cdmsgd H=10": 2, "diloco H=10": 3}
    for (rule, graph, churn), runs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1:])):
        done = [r for r in runs if r["status"] == "completed"]

        def stat(key: str, fmt: str = ".3f") -> str:
            vals = [r[key] for r in done if r.get(key) is not None]
            if not vals:
                return "–"
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            return f"{statistics.mean(vals):{fmt}} ± {sd:{fmt}}"

        online = [r.get("mean_online") or r["n_agents"] for r in runs]
        departures = [r.get("departures") or 0 for r in runs]
        print(f"| {rule} | {graph} | {churn:.0%} | {stat('test_accuracy_avg_model')} | {stat('test_accuracy')} | "
              f"{statistics.mean(r['simulated_seconds'] for r in done):.2f} | "
              f"{statistics.mean(online):.1f} | {statistics.mean(departures):.0f} | "
              f"{len(runs) - len(done)} of {len(runs)} |" if done else
              f"| {rule} | {graph} | {churn:.0%} | – | – | – | {statistics.mean(online):.1f} | "
              f"{statistics.mean(departures):.0f} | {len(runs)} of {len(runs)} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/ablations/churn_table.py SWEEP_FOLDER")
    main(sys.argv[1])
