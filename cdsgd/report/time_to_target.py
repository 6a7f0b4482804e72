"""time_to_target.png's drawing: how long each series took to reach a ``target_accuracy``, and who never did.

:func:`cdsgd.report.plotting.sweep_figures` decides what the series are (their panels, rows, colours and
the seeds' times); :func:`draw_time_to_target` draws them. One row per series, the first on top; a point at
the mean simulated seconds of the seeds that reached the target, a bar from the fastest to the slowest; a
seed that never reached it is a hollow marker in a grey column 'not reached' at the right of its panel
(with "1 of 2 seeds" above it when the series has several): a run is never left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .axes import format_seconds_axis, seconds_text

__all__ = ["TargetSeries", "draw_time_to_target"]


@dataclass
class TargetSeries:
    """One series of one panel: where it goes, how it looks, and its seeds' simulated seconds to the target."""

    ax: object  # the matplotlib Axes of its panel
    row: int  # its row, 0 on top
    label: str
    color: str
    marker: str
    reached: list[float] = field(default_factory=list)  # the seeds that reached the target: their seconds
    seeds: int = 1  # all its seeds, reached or not


def draw_time_to_target(fig, axes, series: list[TargetSeries], names: list[str], targets: list[float]) -> None:
    """Draw ``series`` on ``axes`` (rows of panels of ``fig``, each panel's rows named ``names``)."""
    from matplotlib import ticker

    missed: dict = {}
    reached: dict = {}
    for s in series:
        hit = np.asarray(s.reached, dtype=float)
        if len(hit):
            bar = np.clip([[hit.mean() - hit.min()], [hit.max() - hit.mean()]], 0, None)
            s.ax.errorbar(hit.mean(), s.row, xerr=bar if len(hit) > 1 else None, fmt=s.marker, color=s.color,
                          capsize=3, markersize=7, label=s.label)
            reached.setdefault(s.ax, []).extend(hit)
        if len(hit) < s.seeds:
            missed.setdefault(s.ax, []).append(s)
    fig.set_figheight(axes[0][0].get_gridspec().nrows * (1.4 + 0.45 * len(names)))  # rows of ~0.45 inch
    for ax in (ax for row in axes for ax in row):
        ax.set_yticks(range(len(names)), names)
        if ax.get_subplotspec().colspan.start:  # the rows are the same in every panel: named once, on the left
            ax.tick_params(labelleft=False)
        ax.set_ylim(len(names) - 0.5, -0.8)  # the first series on top, room above it for a count of seeds
        ax.set_xlabel(f"simulated seconds to test accuracy ≥ {' / '.join(f'{t:g}' for t in targets)}")
        hit = np.asarray(reached.get(ax, [1.0]))
        log = format_seconds_axis(ax, hit)
        lo, hi = (hit.min() / 1.5, hit.max() * 1.3) if log else (0.0, hit.max() * 1.1)  # a whole marker
        ax.set_xlim(lo, hi)
        if ax not in missed:
            continue
        # a column 'not reached' past the slowest seed that reached the target: a quarter of the panel's width
        f, inv = (np.log10, lambda v: 10 ** v) if log else (float, float)
        edge, right = hi, inv(f(lo) + (f(hi) - f(lo)) / 0.75)
        spot = inv(f(edge) + 0.5 * (f(right) - f(edge)))
        ax.set_xlim(lo, right)
        ax.axvspan(edge, right, color="0.93", zorder=0)
        ticks = ax.get_xticks() if log else ticker.MaxNLocator(nbins=4).tick_values(lo, edge)
        ticks = [t for t in ticks if lo <= t and f(t) <= f(edge) - 0.1 * (f(right) - f(lo))]  # clear of the column
        ax.xaxis.set_major_locator(ticker.FixedLocator([*ticks, spot]))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, p, spot=spot: "not\nreached"
                                                          if v == spot else seconds_text(v)))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        for s in missed[ax]:
            ax.plot([spot], [s.row], marker=s.marker, markersize=8, markerfacecolor="none", markeredgecolor=s.color,
                    linestyle="none", gid="not reached")
            if s.seeds > 1:
                ax.annotate(f"{s.seeds - len(s.reached)} of {s.seeds} seeds", (spot, s.row), xytext=(0, 7),
                            textcoords="offset points", ha="center", va="bottom", fontsize=8)
