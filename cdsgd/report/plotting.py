"""Figures of runs and sweeps, drawn headless with matplotlib's Agg backend.

Each ``*_figure`` function returns the matplotlib Figure (for tests and
notebooks); ``plot_run`` and ``plot_sweep`` save them. Pictures of a topology
(``draw_topology``) live in :mod:`cdsgd.report.topology_drawing` and are re-exported here.
"""

from __future__ import annotations

import numpy as np

import topologies

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


def _whole_epochs(ax, epochs) -> None:
    """Integer ticks on an epoch axis whose points all fall on whole epochs (no 1.25 between 1 and 2)."""
    from matplotlib.ticker import MaxNLocator

    e = np.asarray(epochs, dtype=float)
    e = e[np.isfinite(e)]
    if len(e) and np.all(e == np.round(e)):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _log_if_wide(ax, values) -> None:
    """A log y axis when the positive values span 10x or more (a narrower span gets only minor ticks)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) and v.min() > 0 and v.max() >= 10 * v.min():
        ax.set_yscale("log")


def _run_title(folder) -> str:
    """Algorithm, topology, n, data set ... of a run, from its summary.json (or config.toml while it runs)."""
    import json
    import tomllib

    info = {}
    for name, read in (("config.toml", tomllib.loads), ("summary.json", json.loads)):
        try:
            info.update(read((folder / name).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass
    if "algorithm" not in info:
        return folder.name
    from ..config import short_value as show

    return (f"{info['algorithm']} on {show(info.get('topology'))} (n={info.get('n_agents')}, "
            f"{info.get('mixing')}), {info.get('dataset')} ({info.get('partition')}), {info.get('model')}, "
            f"seed {info.get('seed')}\n{folder.name}")


def run_figure(folder):
    """The Figure of :func:`plot_run`."""
    from pathlib import Path

    plt = pyplot()
    folder = Path(folder)
    rows = _read_csv(folder / "metrics.csv",
                     ("epoch", "test_accuracy", "test_accuracy_avg_model", "consensus_distance"))
    if not rows:
        raise ValueError(f"{folder / 'metrics.csv'} has no rows yet")
    ep = _column(rows, "epoch")
    losses = [(k, lab) for k, lab in (("train_loss", "training (batch loss)"),
                                           ("test_loss", "test"))
              if np.isfinite(_column(rows, k)).any()]
    fig, axes = plt.subplots(1, 2 + bool(losses), figsize=(5.2 * (2 + bool(losses)), 4.4))
    a, b = axes[0], axes[-1]
    a.plot(ep, _column(rows, "test_accuracy"), marker="o", label="agents' own models (mean)")
    a.plot(ep, _column(rows, "test_accuracy_avg_model"), marker="s", linestyle="--", label="average model x̄")
    a.set_ylabel("test accuracy")
    a.legend()
    if losses:
        for k, lab in losses:
            axes[1].plot(ep, _column(rows, k), marker="o" if k == "train_loss" else "s", label=lab)
        axes[1].set_ylabel("loss (mean over agents' own models)")
        axes[1].legend()
    dist = _column(rows, "consensus_distance")
    b.plot(ep, dist, marker="o", color="C2")
    _log_if_wide(b, dist)
    b.set_ylabel("consensus distance sqrt(mean ||x_j - x̄||²)")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3, which="both")
        _whole_epochs(ax, ep)
    fig.suptitle(_run_title(folder), fontsize=11)
    fig.tight_layout()
    return fig


def plot_run(folder, out=None) -> list[str]:
    """Curves of one run folder, saved as ``curves.png``: test accuracy (agents' mean and the
    average model), training and test loss (when metrics.csv has them) and consensus distance
    against epochs; the title names the algorithm, topology, n, data set, model and seed.
    Returns the files written."""
    from pathlib import Path

    return [save_figure(run_figure(folder), Path(out or folder) / "curves.png", "figure")]


_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def _bytes_axis(values) -> tuple[float, str, bool]:
    """How to show bytes: (divisor, unit, log scale). Log only when the values span 10x or more."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    lo, hi = (float(v.min()), float(v.max())) if len(v) else (0.0, 0.0)
    log = lo > 0 and hi / lo >= 10
    scale, unit = next(((s, u) for s, u in _UNITS if hi >= s), (1.0, "bytes"))
    return (1.0, "bytes", True) if log else (scale, unit, False)


def _bytes_text(v, _pos=None) -> str:
    """A byte count with its unit: '200 kB', '1 MB', '5 GB'."""
    s, u = next(((s, u) for s, u in _UNITS if abs(v) >= s), (1.0, "B"))
    return f"{v / s:.3g} {u}" if v else "0"


def _format_bytes_axis(ax, log: bool, xs) -> None:
    """Labelled ticks whatever the range: a log axis gets 1-2-5 ticks (one per decade beyond 100x)
    labelled with their units; a plain axis, in the label's unit, is widened around a single value."""
    from matplotlib import ticker

    if log:
        ax.set_xscale("log")
        lo, hi = np.nanmin(xs), np.nanmax(xs)
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0) if hi / lo < 100 else (1.0,)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(_bytes_text))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    else:
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter(useOffset=False))
        lo, hi = np.nanmin(xs), np.nanmax(xs)
        if hi - lo <= 0.05 * abs(hi):  # one value (or nearly): show it with a margin, not at 1e-3 resolution
            mid, half = (lo + hi) / 2, max(0.1 * abs(hi), 1.0)
            ax.set_xlim(mid - half, mid + half)


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
    from ..run.sweep import RESULT_COLUMNS

    plt = pyplot()
    folder = Path(folder)
    need = ("status", "run", "test_accuracy", "spectral_gap", "bytes_sent_per_agent")
    results = [r for r in _read_csv(folder / "results.csv", need) if r["status"] == "completed"]
    if not results:
        raise ValueError(f"{folder} holds no run to plot: no metrics.csv (a run folder), and "
                         f"{folder / 'results.csv'} lists no completed run (a sweep folder)")

    varying = [k for k in results[0] if k not in RESULT_COLUMNS]
    # a key that only mirrors another (e.g. mixing zipped with topology) adds no information
    for k in reversed(list(varying)):  # keep the first of two mirrored keys
        for k2 in varying:
            if k2 != k and len({(r[k], r[k2]) for r in results}) == len({r[k] for r in results}) == \
                    len({r[k2] for r in results}):
                varying.remove(k)
                break
    values = {k: sorted({r[k] for r in results}, key=_order) for k in varying}
    keys = sorted(varying, key=lambda k: -len(values[k]))
    hue = keys[0] if keys else None
    style = keys[1] if len(keys) > 1 else None
    # a key that follows from the series' keys (algorithm=cdmsgd whenever compression=none) names the series
    # further instead of splitting the panels: the uncompressed point is drawn beside the compressed ones
    series_keys = [k for k in (hue, style) if k]
    told = [k for k in keys[2:] if series_keys and len({tuple(r[j] for j in series_keys) for r in results}) ==
            len({(tuple(r[j] for j in series_keys), r[k]) for r in results})]
    facet_keys = [k for k in keys[2:] if k not in told]
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
        cols = max(1, 3 // per_facet) if n > 1 else 1
        rows_ = (n + cols - 1) // cols
        fig, grid = plt.subplots(rows_, cols * per_facet, figsize=(5.0 * cols * per_facet + 3.2, 4.2 * rows_),
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

    def finish(fig, axes, title):
        seen = {}
        for ax in (ax for row in axes for ax in row):  # every panel: a group may appear in some panels only
            ax.grid(alpha=0.3)
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        seen = dict(sorted(seen.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        fig.legend(seen.values(), seen.keys(), loc="center right", fontsize=8)
        fig.suptitle(title, fontsize=11)
        # room for the legend: about 0.06 inch per character at 8 points, plus the marker
        margin = max(3.0, 0.06 * max(map(len, seen), default=0) + 0.6)
        fig.set_figwidth(fig.get_figwidth() + margin - 3.0)
        fig.tight_layout(rect=(0, 0, 1 - margin / fig.get_figwidth(), 0.95))
        return fig

    figures = {}
    for name, columns, ylabel, log, xcol in (
        ("accuracy_vs_epoch.png", [m for m, _ in models], "test accuracy", False, "epoch"),
        ("consensus_vs_epoch.png", ["consensus_distance"], "consensus distance", True, "epoch"),
        # time to a loss, the measure of Khomenko et al. (2016) for bucketing: training seconds (evaluation
        # excluded); with several seeds the curve sits at the mean time and loss of each evaluation
        ("loss_vs_time.png", ["test_loss"], "test loss", True, "wall_seconds"),
    ):
        fig, axes = panels(len(columns))
        drawn = []  # every (x, values) plotted: the axes' scales are decided on all of them
        for (f, h, st), runs in ordered:
            for ax, column in zip(axes[facets.index(f)], columns):
                rows = [series(r["run"]) for r in runs]
                n = min(len(x) for x in rows)
                if n == 0:
                    continue
                ep = np.array([_column(x[:n], xcol) for x in rows]).mean(0)
                vals = np.array([_column(x[:n], column) for x in rows])
                color = colors.get(h, "C0")
                ax.plot(ep, vals.mean(0), color=color, linestyle=styles[style_of.get(st, 0) % len(styles)],
                        label=label(h, st))
                if len(runs) > 1:
                    ax.fill_between(ep, vals.min(0), vals.max(0), color=color, alpha=0.12)
                drawn.append((ep, vals))
        xlabel = "epoch" if xcol == "epoch" else "training seconds (evaluation excluded)"
        for ax in (ax for row in axes for ax in row):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if drawn:
                if xcol == "epoch":
                    _whole_epochs(ax, np.concatenate([e for e, _ in drawn]))
                if log:
                    _log_if_wide(ax, np.concatenate([v.ravel() for _, v in drawn]))
        figures[name] = finish(fig, axes, f"{ylabel} vs {xlabel.split(' (')[0]} ({_seed_note(groups, 'band')})")

    for xcol, name, xlabel in (
        ("spectral_gap", "accuracy_vs_spectral_gap.png", "spectral gap 1 − λ₂"),
        ("effective_neighbours", "accuracy_vs_effective_neighbours.png",
         f"effective number of neighbours n_W(γ = {topologies.EFFECTIVE_DECAY})"),
        ("bytes_sent_per_agent", "accuracy_vs_bytes.png", "{} sent per agent (whole run)"),
    ):
        if any(r.get(xcol) in (None, "") for r in results):  # e.g. results.csv of an older release
            continue
        scale, unit, logx = _bytes_axis([_num(r[xcol]) for r in results]) if "{}" in xlabel else (1.0, "", False)
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
                _format_bytes_axis(ax, logx, xs_all)
        figures[name] = finish(fig, axes, f"final test accuracy vs {xlabel.format('bytes')} "
                                          f"({_seed_note(groups, 'bar')})")
    return figures


def plot_sweep(folder, out=None) -> list[str]:
    """The sweep figures from ``folder/results.csv`` and the runs' metrics.csv.

    Runs are grouped by their varying keys except the seed; curves show the
    mean over seeds with a band from the lowest to the highest seed (when a
    group has more than one). To stay readable with many groups, the varying
    key with the most values sets the colour, the next one the line style /
    marker, and any further keys split the figure into panels; a key that
    varies only together with another (a zip group) is shown through that
    one. Accuracy figures have two panels side by side: the agents' own
    models (mean) and the average model x̄. Writes accuracy_vs_epoch.png,
    consensus_vs_epoch.png, loss_vs_time.png (test loss against the training
    seconds, ``wall_seconds``; with several seeds each evaluation sits at the
    seeds' mean time), accuracy_vs_spectral_gap.png,
    accuracy_vs_effective_neighbours.png (when results.csv has the column) and
    accuracy_vs_bytes.png (log axis with 1-2-5 ticks in kB/MB/GB when the
    runs' bytes span 10x or more).
    """
    from pathlib import Path

    out = Path(out or folder)
    return [save_figure(fig, out / name, "figure") for name, fig in sweep_figures(folder).items()]
