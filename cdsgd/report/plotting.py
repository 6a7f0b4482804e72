"""Figures of runs and sweeps, drawn headless with matplotlib's Agg backend.

Each ``*_figure`` function returns the matplotlib Figure (for tests and
notebooks); ``plot_run`` and ``plot_sweep`` save them. Pictures of a topology
(``draw_topology``) live in :mod:`cdsgd.report.topology_drawing` and are re-exported here.
"""

from __future__ import annotations

import numpy as np

import topologies

from .axes import bytes_axis, format_bytes_axis, format_seconds_axis, log_if_wide, whole_epochs
from .time_to_target import TargetSeries, draw_time_to_target
from .topology_drawing import draw_topology, pyplot, save_figure, topology_figure

__all__ = ["draw_topology", "topology_figure", "plot_run", "run_figure", "plot_sweep", "sweep_figures"]


# ----------------------------------------------------------------- run / sweep figures


def _read_csv(path, need: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a CSV file written by cdsgd; a ValueError naming the file if it lacks a ``need`` column."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} is not a CSV file written by cdsgd ({type(e).__name__}: {e})") from None
    missing = [c for c in need if c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}; not a CSV file written by cdsgd "
                         f"(found: {', '.join(reader.fieldnames or ()) or 'no header'})")
    return rows


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _order(v) -> tuple:
    """Sort key: numbers by value, then text (a NaN key would leave the order to chance)."""
    x = _num(v)
    return (0, x, "") if np.isfinite(x) else (1, 0.0, str(v))


def _column(rows, key) -> np.ndarray:
    return np.array([_num(r.get(key)) for r in rows])


def _run_info(folder) -> dict:
    """A run's config.toml and summary.json (the latter winning) as one dict; {} when neither reads."""
    import json
    import tomllib

    info = {}
    for name, read in (("config.toml", tomllib.loads), ("summary.json", json.loads)):
        try:
            info.update(read((folder / name).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass
    return info


def _run_title(folder, info: dict) -> str:
    """Algorithm, topology, n, data set ... of a run (``info``: :func:`_run_info`), else the folder's name."""
    if "algorithm" not in info:
        return folder.name
    from ..config import short_value as show

    net = f", {info['network']} network" if info.get("network", "none") != "none" else ""
    return (f"{info['algorithm']} on {show(info.get('topology'))} (n={info.get('n_agents')}, "
            f"{info.get('mixing')}{net}), {info.get('dataset')} ({info.get('partition')}), {info.get('model')}, "
            f"seed {info.get('seed')}\n{folder.name}")


def _accuracy_curves(ax, x, rows, target=None) -> None:
    """The agents' mean and the average model's test accuracy against ``x``, and the target's level."""
    ax.plot(x, _column(rows, "test_accuracy"), marker="o", label="agents' own models (mean)")
    ax.plot(x, _column(rows, "test_accuracy_avg_model"), marker="s", linestyle="--", label="average model x̄")
    if target:
        _target_line(ax, [target])
    ax.set_ylabel("test accuracy")
    ax.legend()


def _target_line(ax, targets) -> None:
    """A dotted level at each ``target_accuracy`` (it is the agents' mean that must reach it)."""
    for t in targets:
        ax.axhline(t, color="0.35", linestyle=":", linewidth=1.2, label=f"target accuracy {t:g}")


def run_figure(folder):
    """The Figure of :func:`plot_run`."""
    from pathlib import Path

    plt = pyplot()
    folder = Path(folder)
    rows = _read_csv(folder / "metrics.csv",
                     ("epoch", "test_accuracy", "test_accuracy_avg_model", "consensus_distance"))
    if not rows:
        raise ValueError(f"{folder / 'metrics.csv'} has no rows yet")
    info = _run_info(folder)
    ep, sim = _column(rows, "epoch"), _column(rows, "sim_seconds")
    timed = bool(np.isfinite(sim).any())  # a simulated network: accuracy against its seconds too
    losses = [(k, lab) for k, lab in (("train_loss", "training (batch loss)"),
                                           ("test_loss", "test"))
              if np.isfinite(_column(rows, k)).any()]
    n = 2 + bool(losses) + timed
    shape = (2, 2) if n == 4 else (1, n)  # four panels in a square: a row of four would print too small
    fig, grid = plt.subplots(*shape, figsize=(5.2 * shape[1], 4.4 * shape[0]), squeeze=False)
    axes = list(grid.flat)
    a, b = axes[0], axes[-1]
    _accuracy_curves(a, ep, rows)
    if timed:
        _accuracy_curves(axes[1], sim, rows, info.get("target_accuracy"))
        axes[1].set_xlabel("simulated seconds")
        axes[1].grid(alpha=0.3, which="both")
    if losses:
        lax = axes[1 + timed]
        for k, lab in losses:
            lax.plot(ep, _column(rows, k), marker="o" if k == "train_loss" else "s", label=lab)
        lax.set_ylabel("loss (mean over agents' own models)")
        lax.legend()
    dist = _column(rows, "consensus_distance")
    b.plot(ep, dist, marker="o", color="C2")
    log_if_wide(b, dist)
    b.set_ylabel("consensus distance sqrt(mean ||x_j - x̄||²)")
    for ax in axes:
        if timed and ax is axes[1]:
            continue
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3, which="both")
        whole_epochs(ax, ep)
    fig.suptitle(_run_title(folder, info), fontsize=11)
    fig.tight_layout()
    return fig


def plot_run(folder, out=None) -> list[str]:
    """Curves of one run folder, saved as ``curves.png``: test accuracy (agents' mean and the
    average model), training and test loss (when metrics.csv has them) and consensus distance
    against epochs, and with a simulated network (``sim_seconds``) the test accuracy against
    simulated seconds (a dotted level at ``target_accuracy`` when set); the title names the
    algorithm, topology, n, network, data set, model and seed.
    Returns the files written."""
    from pathlib import Path

    return [save_figure(run_figure(folder), Path(out or folder) / "curves.png", "figure")]


def _seed_note(groups, spread: str) -> str:
    """'one seed per group', or 'mean over 3 seeds, band: min–max' (1–3 seeds when groups differ)."""
    counts = sorted({len(runs) for runs in groups.values()})
    if counts[-1] == 1:
        return "one seed per group"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return f"mean over {n} seeds, {spread}: min–max"


def sweep_figures(folder) -> dict:
    """The Figures of :func:`plot_sweep`, by file name."""
    from pathlib import Path

    from ..config import short_value as show
    from ..run.sweep import group_keys

    plt = pyplot()
    folder = Path(folder)
    need = ("status", "run", "test_accuracy", "spectral_gap", "bytes_sent_per_agent")
    results = [r for r in _read_csv(folder / "results.csv", need) if r["status"] == "completed"]
    if not results:
        raise ValueError(f"{folder} holds no run to plot: no metrics.csv (a run folder), and "
                         f"{folder / 'results.csv'} lists no completed run (a sweep folder)")

    varying = group_keys(results)
    # a key that only mirrors another (e.g. mixing zipped with topology) adds no information
    for k in reversed(list(varying)):  # keep the first of two mirrored keys
        for k2 in varying:
            if k2 != k and len({(r[k], r[k2]) for r in results}) == len({r[k] for r in results}) == \
                    len({r[k2] for r in results}):
                varying.remove(k)
                break
    values = {k: sorted({r[k] for r in results}, key=_order) for k in varying}
    keys = sorted(varying, key=lambda k: -len(values[k]))
    # the network sets the time scale (an edge network's seconds are 100x a datacenter's): with another key
    # for the colours, its values split the panels, each time axis on its own scale
    pinned = ["network"] if "network" in keys and len(keys) > 1 else []
    keys = [k for k in keys if k not in pinned]
    hue = keys[0] if keys else None
    style = keys[1] if len(keys) > 1 else None
    # a key that follows from the series' keys (algorithm=cdmsgd whenever compression=none) names the series
    # further instead of splitting the panels: the uncompressed point is drawn beside the compressed ones
    series_keys = [k for k in (hue, style) if k]
    told = [k for k in keys[2:] if series_keys and len({tuple(r[j] for j in series_keys) for r in results}) ==
            len({(tuple(r[j] for j in series_keys), r[k]) for r in results})]
    facet_keys = pinned + [k for k in keys[2:] if k not in told]
    facets = sorted({tuple(r[k] for k in facet_keys) for r in results}, key=lambda t: [_order(v) for v in t])
    colors = {v: f"C{i % 10}" for i, v in enumerate(values[hue])} if hue else {}
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    style_of = {v: i for i, v in enumerate(values[style])} if style else {}

    also = {}  # the told keys' values of each series
    for r in results:
        also[(r[hue] if hue else "", r[style] if style else "")] = [(k, r[k]) for k in told]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((tuple(r[k] for k in facet_keys), r[hue] if hue else "", r[style] if style else ""),
                          []).append(r)
    # groups (and legends) in the order of their values: 2 before 16, as the colours go
    ordered = sorted(groups.items(), key=lambda g: ([_order(v) for v in g[0][0]], _order(g[0][1]), _order(g[0][2])))
    # the average model x̄'s accuracy beside the agents' mean: they differ most on non-IID data
    models = [("test_accuracy", "agents' own models (mean)")]
    if np.isfinite([_num(r.get("test_accuracy_avg_model")) for r in results]).any():
        models.append(("test_accuracy_avg_model", "average model x̄"))
    metrics: dict[str, list[dict]] = {}

    def series(run):
        if run not in metrics:
            metrics[run] = _read_csv(folder / run / "metrics.csv", ("epoch",))
        return metrics[run]

    def label(h, st):
        parts = ([f"{hue}={show(h)}"] if hue else []) + ([f"{style}={show(st)}"] if style else [])
        parts += [f"{k}={show(v)}" for k, v in also.get((h, st), [])]
        return ", ".join(parts) or "runs"

    def panels(per_facet):
        """One row of ``per_facet`` axes (sharing y) per facet, up to 3 axes across."""
        n = len(facets)
        cols = min(n, max(1, 3 // per_facet))
        rows_ = (n + cols - 1) // cols
        fig, grid = plt.subplots(rows_, cols * per_facet, figsize=(5.0 * cols * per_facet, 4.2 * rows_),
                                 squeeze=False)
        flat = list(grid.flat)
        for ax in flat[n * per_facet:]:
            ax.set_visible(False)
        out = [flat[i * per_facet:(i + 1) * per_facet] for i in range(n)]
        for f, row in zip(facets, out):
            for ax, (_, what) in zip(row, models if per_facet > 1 else [(None, "")]):
                ax.set_title("\n".join(filter(None, [", ".join(f"{k}={show(v)}" for k, v in zip(facet_keys, f)),
                                                     what])), fontsize=10)
                if ax is not row[0]:
                    ax.sharey(row[0])
        return fig, out

    rank = {}
    for (_, h, st), _runs in ordered:
        rank.setdefault(label(h, st), len(rank))

    def finish(fig, axes, title, legend=True):
        seen = {}
        for ax in (ax for row in axes for ax in row):  # every panel: a group may appear in some panels only
            ax.grid(alpha=0.3)
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        seen = dict(sorted(seen.items(), key=lambda kv: rank.get(kv[0], len(rank)))) if legend else {}
        if seen:
            fig.legend(seen.values(), seen.keys(), loc="center right", fontsize=8)
        fig.suptitle(title, fontsize=11)
        fig.set_figwidth(max(fig.get_figwidth(), 0.085 * len(title)))  # the title fits (11 points: ~0.08 inch a letter)
        # room for the legend: about 0.06 inch per character at 8 points, plus the marker
        margin = 0.06 * max(map(len, seen), default=0) + 0.8 if seen else 0.0
        fig.set_figwidth(fig.get_figwidth() + margin)
        fig.tight_layout(rect=(0, 0, 1 - margin / fig.get_figwidth(), 0.95))
        return fig

    figures = {}
    simulated = any(r.get("simulated_seconds") not in (None, "") for r in results)  # a network's clock ran
    targets = sorted({t for r in results if np.isfinite(t := _num(r.get("target_accuracy")))})
    curves = [
        ("accuracy_vs_epoch.png", [m for m, _ in models], "test accuracy", False, "epoch"),
        ("consensus_vs_epoch.png", ["consensus_distance"], "consensus distance", True, "epoch"),
        # time to a loss, the measure of Khomenko et al. (2016) for bucketing: training seconds (evaluation
        # excluded); with several seeds the curve sits at the mean time and loss of each evaluation
        ("loss_vs_time.png", ["test_loss"], "test loss", True, "wall_seconds"),
        # time to accuracy on the simulated network (cdsgd.network): its seconds, not this machine's
        ("accuracy_vs_sim_time.png", [m for m, _ in models], "test accuracy", False, "sim_seconds")]
    for name, columns, ylabel, log, xcol in curves[:3 + simulated]:
        fig, axes = panels(len(columns))
        drawn = []  # every (x, values) plotted: the axes' scales are decided on all of them
        ends: dict = {}  # each panel's curves' last x: a log time axis when they lie 10x apart or more
        for (f, h, st), runs in ordered:
            for ax, column in zip(axes[facets.index(f)], columns):
                rows = [series(r["run"]) for r in runs]
                n = min(len(x) for x in rows)
                ep = np.array([_column(x[:n], xcol) for x in rows]).mean(0) if n else np.array([np.nan])
                if not np.isfinite(ep).any():  # no evaluation yet, or no network in this run
                    continue
                ends.setdefault(ax, []).append(ep[np.isfinite(ep)][-1])
                vals = np.array([_column(x[:n], column) for x in rows])
                color = colors.get(h, "C0")
                ax.plot(ep, vals.mean(0), color=color, linestyle=styles[style_of.get(st, 0) % len(styles)],
                        label=label(h, st))
                if len(runs) > 1:
                    ax.fill_between(ep, vals.min(0), vals.max(0), color=color, alpha=0.12)
                drawn.append((ep, vals))
        xlabel = {"epoch": "epoch", "wall_seconds": "training seconds (evaluation excluded)",
                  "sim_seconds": "simulated seconds"}[xcol]
        for ax in (ax for row in axes for ax in row):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if drawn:
                if xcol == "epoch":
                    whole_epochs(ax, np.concatenate([e for e, _ in drawn]))
                if log:
                    log_if_wide(ax, np.concatenate([v.ravel() for _, v in drawn]))
            if xcol == "sim_seconds" and not format_seconds_axis(ax, ends.get(ax, [])):
                ax.set_xlim(left=0)  # time to accuracy from the start: distances read as ratios
        if xcol == "sim_seconds":
            for row in axes:
                _target_line(row[0], targets)  # the agents' mean is what must reach it
        figures[name] = finish(fig, axes, f"{ylabel} vs {xlabel.split(' (')[0]} ({_seed_note(groups, 'band')})")

    for xcol, name, xlabel in (
        ("spectral_gap", "accuracy_vs_spectral_gap.png", "spectral gap 1 − λ₂"),
        ("effective_neighbours", "accuracy_vs_effective_neighbours.png",
         f"effective number of neighbours n_W(γ = {topologies.EFFECTIVE_DECAY})"),
        ("bytes_sent_per_agent", "accuracy_vs_bytes.png", "{} sent per agent (whole run)"),
    ):
        if any(r.get(xcol) in (None, "") for r in results):  # e.g. results.csv of an older release
            continue
        scale, unit, logx = bytes_axis([_num(r[xcol]) for r in results]) if "{}" in xlabel else (1.0, "", False)
        fig, axes = panels(len(models))
        xs_all = []
        for (f, h, st), runs in ordered:
            for ax, (column, _) in zip(axes[facets.index(f)], models):
                xs = np.array([_num(r[xcol]) for r in runs]) / scale
                ys = np.array([_num(r.get(column)) for r in runs])
                xs_all.extend(xs)
                bar = np.clip([[ys.mean() - ys.min()], [ys.max() - ys.mean()]], 0, None)  # not -1e-17
                ax.errorbar(xs.mean(), ys.mean(), yerr=bar if len(runs) > 1 else None, capsize=3,
                            fmt=markers[style_of.get(st, 0) % len(markers)], color=colors.get(h, "C0"),
                            label=label(h, st))
                ax.set_xlabel(xlabel.format(unit))
                ax.set_ylabel("final test accuracy")
        if "{}" in xlabel:
            for ax in (ax for row in axes for ax in row):
                format_bytes_axis(ax, logx, xs_all)
        figures[name] = finish(fig, axes, f"final test accuracy vs {xlabel.format('bytes')} "
                                          f"({_seed_note(groups, 'bar')})")
    if simulated and targets:
        fig, axes = panels(1)
        series_ = []
        for (f, h, st), runs in ordered:
            runs = [r for r in runs if r.get("simulated_seconds") not in (None, "")]  # runs of no network: no clock
            if runs:
                hit = [_num(r["sim_seconds_to_target"]) for r in runs if r.get("steps_to_target") not in ("", None)]
                series_.append(TargetSeries(axes[facets.index(f)][0], rank[label(h, st)], label(h, st),
                                            colors.get(h, "C0"), markers[style_of.get(st, 0) % len(markers)],
                                            hit, len(runs)))
        draw_time_to_target(fig, axes, series_, sorted(rank, key=rank.get), targets)
        figures["time_to_target.png"] = finish(fig, axes, f"simulated seconds to the target accuracy "
                                                          f"({_seed_note(groups, 'bar')})", legend=False)
    return figures


def plot_sweep(folder, out=None) -> list[str]:
    """The sweep figures from ``folder/results.csv`` and the runs' metrics.csv.

    Runs are grouped by their varying keys except the seed; curves show the
    mean over seeds with a band from the lowest to the highest seed (when a
    group has more than one). To stay readable with many groups, the varying
    key with the most values sets the colour, the next one the line style /
    marker, and any further keys split the figure into panels (``network``
    always does when another key varies: its seconds differ by orders of
    magnitude); a key that varies only together with another (a zip group)
    is shown through that one. Accuracy figures have two panels side by side: the agents' own
    models (mean) and the average model x̄. Writes accuracy_vs_epoch.png,
    consensus_vs_epoch.png, loss_vs_time.png (test loss against the training
    seconds, ``wall_seconds``; with several seeds each evaluation sits at the
    seeds' mean time), accuracy_vs_spectral_gap.png,
    accuracy_vs_effective_neighbours.png (when results.csv has the column) and
    accuracy_vs_bytes.png (log axis with 1-2-5 ticks in kB/MB/GB when the
    runs' bytes span 10x or more); with a simulated network (results.csv's
    ``simulated_seconds``) accuracy_vs_sim_time.png (accuracy against the
    simulated seconds, the target's level dotted), and with a
    ``target_accuracy`` too time_to_target.png (the simulated seconds to it
    per series; a seed that never reached it is a hollow marker in a column
    'not reached').
    """
    from pathlib import Path

    out = Path(out or folder)
    return [save_figure(fig, out / name, "figure") for name, fig in sweep_figures(folder).items()]
