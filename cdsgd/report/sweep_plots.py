"""A sweep's figures (:func:`sweep_figures`), drawn from ``results.csv`` and the runs' ``metrics.csv``.

:func:`cdsgd.report.plotting.plot_sweep` saves them and says what each shows. Every run appears: a run
that diverged, failed or was stopped is drawn as far as it went, ending in an ✕ (at the axis' bottom
edge where it has no finite value), and its legend entry says so ("ring, CDSGD (diverged)"); the means
and bands are over the completed seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import topologies

from .axes import bytes_axis, bytes_text, format_bytes_axis, format_seconds_axis, log_if_wide, whole_epochs
from .csvs import column, num, order, read_csv
from .labels import series_label, status_note
from .style import MARKERS, paper_style, panels, place_legend
from .time_to_target import TargetSeries, draw_time_to_target

__all__ = ["sweep_figures", "seed_note", "target_line", "DONE"]

#: the status of a run whose final metrics a figure averages
DONE = "completed"
#: how an unfinished run's end is marked
_END = dict(marker="X", markersize=6, markeredgecolor="white", markeredgewidth=0.5, linestyle="none", zorder=5)
#: the line style of each value of the style key, in turn
_LINES = ["-", "--", ":", "-."]


def seed_note(groups, spread: str) -> str:
    """'one seed per group', or 'mean over 3 seeds, band: min–max' (1–3 seeds when groups differ)."""
    counts = sorted({len(runs) for runs in groups.values()})
    if counts[-1] == 1:
        return "one seed per group"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return f"mean over {n} seeds, {spread}: min–max"


def target_line(ax, targets) -> None:
    """A dotted level at each ``target_accuracy`` (it is the agents' mean that must reach it)."""
    for t in targets:
        ax.axhline(t, color="0.35", linestyle=":", linewidth=1.0, label=f"target accuracy {t:g}")


def _at_edge(ax, x, color, label="_nolegend_") -> None:
    """An ✕ at ``x`` on the bottom edge of ``ax``: a run with no value to show there."""
    ax.plot([x], [0.0], color=color, transform=ax.get_xaxis_transform(), clip_on=False, label=label, **_END)


def _varying(results) -> list[str]:
    """The keys that tell the groups apart, less a key that only mirrors another (mixing zipped with
    topology, lr with algorithm): the first of two mirrored keys is kept."""
    from ..run.sweep import group_keys

    varying = group_keys(results)
    for k in reversed(list(varying)):
        for k2 in varying:
            if k2 != k and len({(r[k], r[k2]) for r in results}) == len({r[k] for r in results}) == \
                    len({r[k2] for r in results}):
                varying.remove(k)
                break
    return varying


def sweep_figures(folder) -> dict:
    """The Figures of :func:`cdsgd.report.plotting.plot_sweep`, by file name (``*.png``)."""
    with paper_style():
        return _figures(folder)


def _figures(folder) -> dict:
    """The figures of :func:`sweep_figures` by file name, in the style already set."""
    sweep = _read_sweep(Path(folder))
    simulated = any(r.get("simulated_seconds") not in (None, "") for r in sweep.results)  # a network's clock ran
    targets = sorted({t for r in sweep.results if np.isfinite(t := num(r.get("target_accuracy")))})
    figures = {}
    for curve in _curves(sweep):
        if curve.xcol != "sim_seconds" or simulated:
            figures[curve.name] = _curve_figure(sweep, curve, targets)
    for xcol, name, xlabel in (
        ("spectral_gap", "accuracy_vs_spectral_gap.png", "spectral gap 1 − λ₂"),
        ("effective_neighbours", "accuracy_vs_effective_neighbours.png",
         f"effective number of neighbours n_W(γ = {topologies.EFFECTIVE_DECAY})"),
        ("bytes_sent_per_agent", "accuracy_vs_bytes.png", "{} sent per agent (whole run)"),
    ):
        if any(r.get(xcol) in (None, "") for r in sweep.done):  # e.g. results.csv of an older release
            continue
        figures[name] = _final_figure(sweep, xcol, xlabel)
    if simulated and targets:
        figures["time_to_target.png"] = _target_figure(sweep, targets)
    return figures


# ------------------------------------------------------------------------------ the series, shared by every figure


@dataclass
class _Sweep:
    """A sweep's runs grouped into series (one per group of seeds) and panels, and how each series is drawn."""

    folder: Path
    results: list[dict]
    done: list[dict]  # the completed runs (all of them when none completed): the scales and columns go by these
    hue: str | None  # the key that sets the colours
    style: str | None  # the key that sets the line styles
    also: dict  # the told keys' values of each series
    facet_keys: list[str]
    facets: list[tuple]
    colors: dict
    style_of: dict
    ordered: list  # ((facet, hue value, style value), runs), in the order of their values
    seeds: dict  # the runs each mean is over: the completed ones (all of them when none completed)
    models: list  # (results column, panel title): the agents' mean and, when the runs recorded it, x̄'s
    rank: dict = field(default_factory=dict)  # each series' label (its status left out): its place
    metrics: dict = field(default_factory=dict)  # each run's metrics.csv rows, once read

    def series(self, run) -> list[dict]:
        """The rows of ``run``'s metrics.csv; none for a run that failed at its start."""
        if run not in self.metrics:
            path = self.folder / run / "metrics.csv"
            self.metrics[run] = read_csv(path, ("epoch",)) if path.exists() else []
        return self.metrics[run]

    def base(self, h, st) -> str:
        """The label of a series, the status of its runs left out."""
        pairs = ([(self.hue, h)] if self.hue else []) + ([(self.style, st)] if self.style else []) + \
            self.also.get((h, st), [])
        return series_label(pairs)

    def label(self, h, st, runs) -> str:
        """The legend entry of a series: its label, and how many of its ``runs`` did not complete."""
        counts: dict[str, int] = {}
        for r in runs:
            if r["status"] != DONE:
                counts[r["status"]] = counts.get(r["status"], 0) + 1
        return self.base(h, st) + status_note(counts, len(runs))

    def look(self, h, st) -> tuple:
        """Colour, marker and line style of a series: a marker of its own, so that no two series look alike."""
        return (self.colors.get(h, "C0"), MARKERS[self.rank[self.base(h, st)] % len(MARKERS)],
                _LINES[self.style_of.get(st, 0) % len(_LINES)])

    def make(self, per_facet) -> tuple:
        """(figure, one row of ``per_facet`` axes (sharing y) per facet), up to 2 facets across."""
        n = len(self.facets)
        cols = min(n, max(1, 2 // per_facet))
        fig, grid = panels((n + cols - 1) // cols, cols * per_facet)
        flat = list(grid.flat)
        for ax in flat[n * per_facet:]:
            ax.set_visible(False)
        out = [flat[i * per_facet:(i + 1) * per_facet] for i in range(n)]
        for f, row in zip(self.facets, out):
            for ax, (_, what) in zip(row, self.models if per_facet > 1 else [(None, "")]):
                ax.set_title("\n".join(filter(None, [self.facet_keys and series_label(zip(self.facet_keys, f)), what])))
                if ax is not row[0]:
                    ax.sharey(row[0])
        return fig, out

    def finish(self, fig, axes, title, legend=True):
        """``fig`` with its legend (every panel's entries, in the series' order) and its title."""
        seen = {}
        for ax in (ax for row in axes for ax in row):  # every panel: a group may appear in some panels only
            for h, lab in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(lab, h)
        firsts = sorted(self.rank, key=len, reverse=True)  # a label's series: the longest base it starts with

        def where(lab):
            return self.rank.get(next((b for b in firsts if lab.startswith(b)), lab), len(self.rank))
        seen = dict(sorted(seen.items(), key=lambda kv: where(kv[0]))) if legend else {}
        share = place_legend(fig, [ax for row in axes for ax in row if ax.get_visible()], list(seen.values()),
                             list(seen))
        fig.suptitle(title, x=share / 2)  # centred over the panels, clear of a legend beside them
        return fig


def _read_sweep(folder: Path) -> _Sweep:
    """The runs of the sweep folder ``folder`` (its results.csv), grouped into series and panels."""
    need = ("status", "run", "test_accuracy", "spectral_gap", "bytes_sent_per_agent")
    results = read_csv(folder / "results.csv", need)
    if not results:
        raise ValueError(f"{folder} holds no run to plot: no metrics.csv (a run folder), and "
                         f"{folder / 'results.csv'} lists no run (a sweep folder)")
    done = [r for r in results if r["status"] == DONE] or results  # the scales and columns go by these
    values, hue, style, told, facet_keys = _roles(results)
    also = {}  # the told keys' values of each series
    for r in results:
        also[(r[hue] if hue else "", r[style] if style else "")] = [(k, r[k]) for k in told]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((tuple(r[k] for k in facet_keys), r[hue] if hue else "", r[style] if style else ""),
                          []).append(r)
    # groups (and legends) in the order of their values: 2 before 16, as the colours go
    ordered = sorted(groups.items(), key=lambda g: ([order(v) for v in g[0][0]], order(g[0][1]), order(g[0][2])))
    # the seeds each mean is over: the completed ones (all of them when none completed)
    seeds = {g: ok for g, runs in groups.items() if (ok := [r for r in runs if r["status"] == DONE])} or groups
    # the average model x̄'s beside the agents' mean: they differ most on non-IID data
    models = [("test_accuracy", "agents' own models (mean)")]
    if np.isfinite([num(r.get("test_accuracy_avg_model")) for r in done]).any():
        models.append(("test_accuracy_avg_model", "average model x̄"))
    sweep = _Sweep(
        folder, results, done, hue, style, also, facet_keys,
        facets=sorted({tuple(r[k] for k in facet_keys) for r in results}, key=lambda t: [order(v) for v in t]),
        colors={v: f"C{i % 10}" for i, v in enumerate(values[hue])} if hue else {},
        style_of={v: i for i, v in enumerate(values[style])} if style else {},
        ordered=ordered, seeds=seeds, models=models)
    for (_, h, st), _runs in ordered:
        sweep.rank.setdefault(sweep.base(h, st), len(sweep.rank))
    return sweep


def _roles(results) -> tuple:
    """(each varying key's values, the hue key, the style key, the told keys, the facet keys) of ``results``."""
    varying = _varying(results)
    values = {k: sorted({r[k] for r in results}, key=order) for k in varying}
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
    return values, hue, style, told, facet_keys


# ------------------------------------------------------------------------------ curves against epochs or seconds


@dataclass
class _Curve:
    """A figure of curves, metrics.csv ``columns`` (one panel each) against ``xcol``, and what it has drawn."""

    name: str
    columns: list  # (metrics.csv column, what the panel shows)
    ylabel: str
    log: bool  # a log y axis when the values span a decade or more
    xcol: str
    drawn: list = field(default_factory=list)  # every (x, values) plotted: the axes' scales are decided on all of them
    ends: dict = field(default_factory=dict)  # each panel's curves' last x: a log time axis when they lie 10x apart

    @property
    def xlabel(self) -> str:
        """The x axis' label."""
        return {"epoch": "epoch", "wall_seconds": "training seconds (evaluation excluded)",
                "sim_seconds": "simulated seconds", "step": "step",
                "bytes_sent_per_agent": "bytes sent per agent"}[self.xcol]


def _curves(sweep: _Sweep) -> list[_Curve]:
    """The curve figures (a text sweep's loss against steps and bytes first), the one against simulated seconds last."""
    # the average model's test loss beside the agents' when the runs recorded it
    losses = [("test_loss", "agents' own models (mean)")]
    if any("test_loss_avg_model" in (sweep.series(r["run"])[:1] or [{}])[0] for r in sweep.done):
        losses.append(("test_loss_avg_model", "average model x̄"))
    # a language model's (text runs report bits per byte): its loss against steps and against bytes sent
    text = any(np.isfinite(num(r.get("test_bits_per_byte"))) for r in sweep.done)
    return [_Curve(f"loss_vs_{x}.png", losses, "test loss (nats/token)", False, col)
            for x, col in (("step", "step"), ("bytes", "bytes_sent_per_agent")) if text] + [
        _Curve("accuracy_vs_epoch.png", sweep.models, "test accuracy", False, "epoch"),
        _Curve("consensus_vs_epoch.png", [("consensus_distance", "")], "consensus distance", True, "epoch"),
        # time to a loss, the measure of Khomenko et al. (2016) for bucketing: training seconds (evaluation
        # excluded); with several seeds the curve sits at the mean time and loss of each evaluation
        _Curve("loss_vs_time.png", losses, "test loss", True, "wall_seconds"),
        # time to accuracy on the simulated network (cdsgd.network): its seconds, not this machine's
        _Curve("accuracy_vs_sim_time.png", sweep.models, "test accuracy", False, "sim_seconds")]


def _curve_figure(sweep: _Sweep, curve: _Curve, targets):
    """The figure of ``curve``: each series' mean over its completed seeds, and each other run as far as it went."""
    fig, axes = sweep.make(len(curve.columns))
    for (f, h, st), runs in sweep.ordered:
        look = sweep.look(h, st)
        ok = [r for r in runs if r["status"] == DONE]
        for ax, (col, _) in zip(axes[sweep.facets.index(f)], curve.columns):
            lab = sweep.label(h, st, runs)  # on each panel: the legend gathers every panel's
            lab = _mean_curve(ax, sweep, curve, col, ok, look, lab)
            _stopped_curves(ax, sweep, curve, col, [r for r in runs if r["status"] != DONE], look, lab)
    _curve_axes(axes, curve)
    if curve.xcol == "sim_seconds":
        for row in axes:
            target_line(row[0], targets)  # the agents' mean is what must reach it
    return sweep.finish(fig, axes, f"{curve.ylabel} vs {curve.xlabel.split(' (')[0]}\n"
                                   f"({seed_note(sweep.seeds, 'band')})")


def _mean_curve(ax, sweep: _Sweep, curve: _Curve, col, ok, look, lab) -> str:
    """The legend label left for the series' next mark, once the mean of the runs ``ok`` is drawn with a band."""
    color, marker, line = look
    rows = [sweep.series(r["run"]) for r in ok]
    n = min((len(x) for x in rows), default=0)
    ep = np.array([column(x[:n], curve.xcol) for x in rows]).mean(0) if n else np.array([np.nan])
    if not np.isfinite(ep).any():
        return lab
    curve.ends.setdefault(ax, []).append(ep[np.isfinite(ep)][-1])
    vals = np.array([column(x[:n], col) for x in rows])
    ax.plot(ep, vals.mean(0), color=color, linestyle=line, marker=marker, markersize=3.5,
            markevery=max(1, n // 8), label=lab, zorder=3)
    if len(ok) > 1:
        ax.fill_between(ep, vals.min(0), vals.max(0), color=color, alpha=0.12, linewidth=0, zorder=1)
    curve.drawn.append((ep, vals))
    return "_nolegend_"


def _stopped_curves(ax, sweep: _Sweep, curve: _Curve, col, stopped, look, lab) -> None:
    """Draw each run of ``stopped`` (one that did not complete) as far as it went, an ✕ where it stopped."""
    color, _, line = look
    for r in stopped:
        rows = sweep.series(r["run"])
        x, y = column(rows, curve.xcol), column(rows, col)
        if not np.isfinite(x).any():  # no evaluation, or no network in this run
            if lab != "_nolegend_":
                ax.plot([], [], color=color, label=lab, **_END)  # named in the legend all the same
                lab = "_nolegend_"
            continue
        good = np.isfinite(x) & np.isfinite(y)
        ax.plot(x[good], y[good], color=color, linestyle=line, linewidth=0.8, alpha=0.8, zorder=2)
        if good.any():
            last = np.flatnonzero(good)[-1]
            ax.plot([x[last]], [y[last]], color=color, label=lab, **_END)
            curve.drawn.append((x[good], y[good][None]))
        else:
            _at_edge(ax, x[np.isfinite(x)][-1], color, lab)
        lab = "_nolegend_"


def _curve_axes(axes, curve: _Curve) -> None:
    """Label the axes of ``curve``'s figure and set their scales by everything drawn on them."""
    for row in axes:
        for ax, (_, what) in zip(row, curve.columns):
            ax.set_xlabel(curve.xlabel)
            ax.set_ylabel(curve.ylabel if len(curve.columns) > 1 or not what else
                          f"{curve.ylabel} ({what.replace(' own models (mean)', ' mean')})")  # agents' mean
            if curve.drawn:
                if curve.xcol == "epoch":
                    whole_epochs(ax, np.concatenate([e for e, _ in curve.drawn]))
                if curve.log:
                    log_if_wide(ax, np.concatenate([v.ravel() for _, v in curve.drawn]))
            if curve.xcol == "bytes_sent_per_agent":
                ax.xaxis.set_major_formatter(bytes_text)  # '200 kB', '1 MB'
            if curve.xcol == "sim_seconds" and not format_seconds_axis(ax, curve.ends.get(ax, [])):
                ax.set_xlim(left=0)  # time to accuracy from the start: distances read as ratios


# ------------------------------------------------------------------------------ final accuracy against a run's value


@dataclass
class _Final:
    """A figure of final accuracies against results.csv's ``xcol`` (in units of ``scale``), and every x drawn."""

    xcol: str
    scale: float
    xs: list = field(default_factory=list)


def _final_figure(sweep: _Sweep, xcol, xlabel):
    """Final test accuracy against ``xcol``: each series' mean over its seeds, with a min–max bar."""
    scale, unit, logx = bytes_axis([num(r[xcol]) for r in sweep.results]) if "{}" in xlabel else (1.0, "", False)
    final = _Final(xcol, scale)
    fig, axes = sweep.make(len(sweep.models))
    shifts = _shifts(sweep, xcol)
    for (f, h, st), runs in sweep.ordered:
        look = sweep.look(h, st)
        for ax, (col, _) in zip(axes[sweep.facets.index(f)], sweep.models):
            _final_marks(ax, final, col, runs, look, _shifted(ax, shifts[(f, h, st)]), sweep.label(h, st, runs))
            ax.set_xlabel(xlabel.format(unit))
            ax.set_ylabel("final test accuracy")
    for ax in (ax for row in axes for ax in row):
        ax.margins(x=0.08)  # room for the points set apart
        if "{}" in xlabel:
            format_bytes_axis(ax, logx, final.xs)
    early = "; ✕: stopped early" if any(r["status"] != DONE for r in sweep.results) else ""
    return sweep.finish(fig, axes, f"final test accuracy vs {xlabel.format('bytes')}\n"
                                   f"({seed_note(sweep.seeds, 'bar')}{early})")


def _shifts(sweep: _Sweep, xcol) -> dict:
    """Each series' offset in points: series at one x in a panel (one graph, several algorithms) 3 points apart."""
    spot = {g: (g[0], round(np.mean([num(r[xcol]) for r in runs]), 9)) for g, runs in sweep.seeds.items()}
    together = {}
    for g in (g for g, _ in sweep.ordered if g in spot):
        together.setdefault(spot[g], []).append(g)
    near = {g: together.get(spot.get(g), [g]) for g, _ in sweep.ordered}
    return {g: (near[g].index(g) - (len(near[g]) - 1) / 2) * 3.0 for g in near}


def _final_marks(ax, final: _Final, col, runs, look, at, lab) -> None:
    """Draw a series' completed ``runs`` as their mean with a min–max bar, each other run as an ✕ at the edge."""
    color, marker, _ = look
    ok = [r for r in runs if r["status"] == DONE]
    if ok:
        xs = np.array([num(r[final.xcol]) for r in ok]) / final.scale
        ys = np.array([num(r.get(col)) for r in ok])
        final.xs.extend(xs)
        bar = np.clip([[ys.mean() - ys.min()], [ys.max() - ys.mean()]], 0, None)  # not -1e-17
        ax.errorbar(xs.mean(), ys.mean(), yerr=bar if len(ok) > 1 else None, fmt=marker, color=color,
                    markerfacecolor="white", markeredgewidth=1.2, transform=at, label=lab, zorder=3)
        ax.update_datalim([(xs.mean(), ys.min()), (xs.mean(), ys.max())])  # shifted: not counted
        ax.autoscale_view()
        lab = "_nolegend_"
    for r in (r for r in runs if r["status"] != DONE):
        x = num(r.get(final.xcol)) / final.scale
        if np.isfinite(x):
            final.xs.append(x)
            _at_edge(ax, x, color, lab)
        elif lab != "_nolegend_":
            ax.plot([], [], color=color, label=lab, **_END)
        lab = "_nolegend_"


# ------------------------------------------------------------------------------ simulated seconds to the target


def _target_figure(sweep: _Sweep, targets):
    """The simulated seconds each series took to the target accuracy (a run of no network has no clock)."""
    fig, axes = sweep.make(1)
    series_ = []
    for (f, h, st), runs in sweep.ordered:
        runs = [r for r in runs if r.get("simulated_seconds") not in (None, "")]  # runs of no network: no clock
        if runs:
            color, marker, _ = sweep.look(h, st)
            hit = [num(r["sim_seconds_to_target"]) for r in runs if r.get("steps_to_target") not in ("", None)]
            series_.append(TargetSeries(axes[sweep.facets.index(f)][0], sweep.rank[sweep.base(h, st)],
                                        sweep.label(h, st, runs), color, marker, hit, len(runs)))
    draw_time_to_target(fig, axes, series_, sorted(sweep.rank, key=sweep.rank.get), targets)
    return sweep.finish(fig, axes, f"simulated seconds to the target accuracy\n({seed_note(sweep.seeds, 'bar')})",
                        legend=False)


def _shifted(ax, points: float):
    """``ax``'s data transform moved ``points`` to the right (on screen and on paper alike)."""
    from matplotlib.transforms import offset_copy

    return offset_copy(ax.transData, fig=ax.figure, x=points, y=0, units="points")

