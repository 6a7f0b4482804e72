"""Figures, drawn headless with matplotlib's Agg backend."""

from __future__ import annotations

import os

import networkx as nx
import numpy as np

import topologies

__all__ = ["draw_topology", "plot_run", "plot_sweep"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def draw_topology(G: nx.Graph, W, path: str | os.PathLike, *, title: str = "") -> None:
    """Save a picture of ``G`` with each edge labelled by its weight W[i, j]
    and each node by its index and self weight W[i, i].

    Grid graphs (``G.graph["shape"]``) are drawn on their grid, with
    wrap-around edges dashed; graphs whose degrees are all equal on a
    circle; others with a seeded spring layout. Labels are drawn for n <= 32.
    """
    plt = _pyplot()
    W = np.asarray(W)
    n = G.number_of_nodes()
    degrees = {d for _, d in G.degree()}
    shape = G.graph.get("shape")
    if shape:
        cols = shape[1]
        pos = {i: np.array([i % cols, -(i // cols)], dtype=float) for i in G.nodes}
    else:
        pos = nx.circular_layout(G) if len(degrees) == 1 else nx.spring_layout(G, seed=0)
    # edges longer than one grid step are the torus' wrap-around links
    wrap = [(i, j) for i, j in G.edges() if shape and np.abs(pos[i] - pos[j]).sum() > 1.5]
    size = min(12.0, 4.0 + 0.25 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    nx.draw_networkx_edges(G, pos, ax=ax, edge_color="0.5", edgelist=[e for e in G.edges() if e not in wrap])
    if wrap:
        nx.draw_networkx_edges(G, pos, ax=ax, edge_color="0.75", style="dashed", edgelist=wrap,
                               arrows=True, arrowstyle="-", connectionstyle="arc3,rad=0.15")
    nx.draw_networkx_nodes(G, pos, ax=ax, node_color="#9ecae1", node_size=700 if n <= 32 else 120)
    if n <= 32:
        nx.draw_networkx_labels(G, pos, ax=ax, labels={i: f"{i}\n{W[i, i]:.2f}" for i in G.nodes}, font_size=8)
        nx.draw_networkx_edge_labels(
            G, pos, ax=ax, edge_labels={(i, j): f"{W[i, j]:.3f}" for i, j in G.edges() if (i, j) not in wrap},
            font_size=7
        )
    legend = "node: index / self weight; edge: weight" + ("; dashed: wrap-around" if wrap else "")
    ax.set_title((title + "\n" if title else "") + legend, fontsize=10)
    ax.set_axis_off()
    fig.tight_layout()
    try:
        directory = os.path.dirname(os.fspath(path))
        if directory:
            os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as e:  # name the file we were asked to write, not an inner folder
        raise OSError(f"cannot write the drawing {os.fspath(path)!r}: {e.strerror or e}") from None
    except ValueError as e:  # matplotlib: an unknown image format
        raise ValueError(f"cannot write the drawing {os.fspath(path)!r}: {e}") from None
    finally:
        plt.close(fig)


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


def plot_run(folder, out=None) -> list[str]:
    """Curves of one run folder: test accuracy (agents' mean and average model) and
    consensus distance against epochs. Returns the files written."""
    from pathlib import Path

    plt = _pyplot()
    folder = Path(folder)
    rows = _read_csv(folder / "metrics.csv",
                     ("epoch", "test_accuracy", "test_accuracy_avg_model", "consensus_distance"))
    if not rows:
        raise ValueError(f"{folder / 'metrics.csv'} has no rows yet")
    ep = [_num(r["epoch"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ep, [_num(r["test_accuracy"]) for r in rows], marker="o", label="agents' own models (mean)")
    a.plot(ep, [_num(r["test_accuracy_avg_model"]) for r in rows], marker="s", label="average model")
    a.set_xlabel("epoch")
    a.set_ylabel("test accuracy")
    a.grid(alpha=0.3)
    a.legend()
    b.semilogy(ep, [_num(r["consensus_distance"]) for r in rows], marker="o", color="C2")
    b.set_xlabel("epoch")
    b.set_ylabel("consensus distance sqrt(mean ||x_j - x̄||²)")
    b.grid(alpha=0.3, which="both")
    fig.suptitle(folder.name)
    fig.tight_layout()
    path = Path(out or folder) / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


def plot_sweep(folder, out=None) -> list[str]:
    """The sweep figures from ``folder/results.csv`` and the runs' metrics.csv.

    Runs are grouped by their varying keys except the seed; curves show the
    mean over seeds with a band from the lowest to the highest seed. To stay
    readable with many groups, the varying key with the most values sets the
    colour, the next one the line style / marker, and any further keys split
    the figure into panels; a key that varies only together with another
    (a zip group) is shown through that one. Writes accuracy_vs_epoch.png,
    consensus_vs_epoch.png, accuracy_vs_spectral_gap.png,
    accuracy_vs_effective_neighbours.png (when results.csv has the column) and
    accuracy_vs_bytes.png.
    """
    from pathlib import Path

    from .sweep import RESULT_COLUMNS

    plt = _pyplot()
    folder = Path(folder)
    out = Path(out or folder)
    need = ("status", "run", "test_accuracy", "spectral_gap", "bytes_sent_per_agent")
    results = [r for r in _read_csv(folder / "results.csv", need) if r["status"] == "completed"]
    if not results:
        raise ValueError(f"{folder} holds no run to plot: no metrics.csv (a run folder), and "
                         f"{folder / 'results.csv'} lists no completed run (a sweep folder)")

    from .config import short_value as show

    varying = [k for k in results[0] if k not in RESULT_COLUMNS]
    # a key that only mirrors another (e.g. mixing zipped with topology) adds no information
    for k in reversed(list(varying)):  # keep the first of two mirrored keys
        for k2 in varying:
            if k2 != k and len({(r[k], r[k2]) for r in results}) == len({r[k] for r in results}) == \
                    len({r[k2] for r in results}):
                varying.remove(k)
                break
    values = {k: sorted({r[k] for r in results}, key=lambda v: (_num(v), v)) for k in varying}
    keys = sorted(varying, key=lambda k: -len(values[k]))
    hue = keys[0] if keys else None
    style = keys[1] if len(keys) > 1 else None
    facet_keys = keys[2:]
    facets = sorted({tuple(r[k] for k in facet_keys) for r in results}, key=lambda t: [(_num(v), v) for v in t])
    colors = {v: f"C{i % 10}" for i, v in enumerate(values[hue])} if hue else {}
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    style_of = {v: i for i, v in enumerate(values[style])} if style else {}

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((tuple(r[k] for k in facet_keys), r[hue] if hue else "", r[style] if style else ""),
                          []).append(r)

    def label(h, st):
        parts = ([f"{hue}={show(h)}"] if hue else []) + ([f"{style}={show(st)}"] if style else [])
        return ", ".join(parts) or "runs"

    def panels():
        n = len(facets)
        cols = min(n, 3)
        rows_ = (n + cols - 1) // cols
        fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols + 3.2, 4.2 * rows_), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat[:n])

    def finish(fig, axes, name, title):
        for ax, f in zip(axes, facets):
            if facet_keys:
                ax.set_title(", ".join(f"{k}={show(v)}" for k, v in zip(facet_keys, f)), fontsize=10)
            ax.grid(alpha=0.3, which="both")
        seen = {}
        for ax in axes:  # every panel: a group may appear in some panels only
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        seen = dict(sorted(seen.items()))
        fig.legend(seen.values(), seen.keys(), loc="center right", fontsize=8)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout(rect=(0, 0, 1 - 3.0 / fig.get_figwidth(), 0.95))
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        return str(out / name)

    written = []
    for column, name, ylabel, log in (
        ("test_accuracy", "accuracy_vs_epoch.png", "test accuracy (mean over agents)", False),
        ("consensus_distance", "consensus_vs_epoch.png", "consensus distance", True),
    ):
        fig, axes = panels()
        for (f, h, st), runs in sorted(groups.items()):
            ax = axes[facets.index(f)]
            series = [_read_csv(folder / r["run"] / "metrics.csv", ("epoch", column)) for r in runs]
            n = min(len(x) for x in series)
            if n == 0:
                continue
            ep = np.array([_num(x["epoch"]) for x in series[0][:n]])
            vals = np.array([[_num(x[column]) for x in srs[:n]] for srs in series])
            color = colors.get(h, "C0")
            ax.plot(ep, vals.mean(0), color=color, linestyle=styles[style_of.get(st, 0) % len(styles)],
                    label=label(h, st))
            ax.fill_between(ep, vals.min(0), vals.max(0), color=color, alpha=0.12)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
        written.append(finish(fig, axes, name, f"{ylabel} vs epoch (mean over seeds, band: min-max)"))

    for xcol, name, xlabel, logx in (
        ("spectral_gap", "accuracy_vs_spectral_gap.png", "spectral gap 1 − λ₂", False),
        ("effective_neighbours", "accuracy_vs_effective_neighbours.png",
         f"effective number of neighbours n_W(γ = {topologies.EFFECTIVE_DECAY})", False),
        ("bytes_sent_per_agent", "accuracy_vs_bytes.png", "bytes sent per agent (whole run)", True),
    ):
        if any(r.get(xcol) in (None, "") for r in results):  # e.g. results.csv of an older release
            continue
        fig, axes = panels()
        for (f, h, st), runs in sorted(groups.items()):
            ax = axes[facets.index(f)]
            xs = np.array([_num(r[xcol]) for r in runs])
            ys = np.array([_num(r["test_accuracy"]) for r in runs])
            ax.errorbar(xs.mean(), ys.mean(), yerr=[[ys.mean() - ys.min()], [ys.max() - ys.mean()]],
                        fmt=markers[style_of.get(st, 0) % len(markers)], color=colors.get(h, "C0"), capsize=3,
                        label=label(h, st))
            if logx:
                ax.set_xscale("symlog", linthresh=1.0)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("final test accuracy (agents' mean)")
        written.append(finish(fig, axes, name, f"final accuracy vs {xlabel} (mean over seeds, bar: min-max)"))
    return written
