"""How cdsgd's run and sweep figures look on paper, and the files they are written to.

A panel is one column of a two-column paper (3.3 x 2.5 inches) with 8-point text, so a figure printed
at its own size reads as drawn; a figure of two panels side by side spans the page. Legends sit inside
a lone panel when they fit (``loc="best"``), else tight beside it or below a row of panels: the figure
is laid out by matplotlib's constrained layout around them, with no width reserved by guess.

>>> parse_formats(["png,pdf", "svg"])
('png', 'pdf', 'svg')
"""

from __future__ import annotations

import os

__all__ = ["PAPER", "PANEL", "MARKERS", "FORMATS", "DPI", "paper_style", "panels", "place_legend",
           "parse_formats", "save_formats"]

#: matplotlib settings of every run and sweep figure: 8-point text, thin lines, a light grid
PAPER = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "legend.fontsize": 7, "figure.titlesize": 8.5, "lines.linewidth": 1.3, "lines.markersize": 4.5,
    "axes.linewidth": 0.6, "grid.linewidth": 0.5, "grid.alpha": 0.35, "axes.grid": True,
    "legend.frameon": True, "legend.framealpha": 0.85, "legend.borderaxespad": 0.3,
    "legend.handlelength": 2.2, "errorbar.capsize": 2.5, "savefig.pad_inches": 0.03,
}
#: one panel, in inches: a column of a two-column paper
PANEL = (3.3, 2.5)
#: one marker shape per series, in the order of the series (filled and open shapes alternate)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "*")
#: the file formats ``cdsgd plot --format`` writes
FORMATS = ("png", "pdf", "svg")
#: the default resolution of PNG files (PDF and SVG are vector files)
DPI = 150
#: a lone panel keeps its legend inside when it has at most this many entries
INSIDE_AT_MOST = 5


def paper_style():
    """A context in which figures are made with :data:`PAPER`'s settings (text sizes are fixed when drawn)."""
    from .topology_drawing import pyplot

    return pyplot().rc_context(PAPER)


def panels(rows: int, cols: int):
    """A constrained-layout figure of rows x cols panels of :data:`PANEL` size; (fig, 2-D array of axes)."""
    from .topology_drawing import pyplot

    return pyplot().subplots(rows, cols, figsize=(PANEL[0] * cols, PANEL[1] * rows), squeeze=False,
                        layout="constrained")


def place_legend(fig, axes, handles, labels) -> float:
    """One legend for ``fig``: inside a lone panel when it has few entries, else beside a single column of
    panels or below a row of them (in as many columns as the width holds); the figure grows by the
    legend's size, so that the panels keep theirs. Returns the fraction of the width the panels take."""
    if not labels:
        return 1.0
    cols = max(ax.get_subplotspec().colspan.stop for ax in axes)
    if len(axes) == 1 and len(labels) <= INSIDE_AT_MOST:
        axes[0].legend(handles, labels, loc="best")
        return 1.0
    beside = cols == 1
    if beside:
        legend = fig.legend(handles, labels, loc="outside right upper")
    else:  # about 0.055 inch per character at 7 points, plus the handle and the gaps
        entry = 0.055 * max(map(len, labels)) + 0.55
        legend = fig.legend(handles, labels, loc="outside lower center",
                            ncols=max(1, min(len(labels), int(fig.get_figwidth() // entry))))
    fig.draw_without_rendering()
    box = legend.get_window_extent()
    if not beside:
        fig.set_figheight(fig.get_figheight() + box.height / fig.dpi + 0.05)
        return 1.0
    width = fig.get_figwidth()
    fig.set_figwidth(width + box.width / fig.dpi + 0.05)
    return width / fig.get_figwidth()


def parse_formats(values) -> tuple[str, ...]:
    """File formats from ``--format`` values (each one or a comma-separated list), in order, once each;
    a ValueError naming a format that is not one of :data:`FORMATS`."""
    out: list[str] = []
    for value in values or ("png",):
        for f in str(value).split(","):
            f = f.strip().lower().lstrip(".")
            if f not in FORMATS:
                raise ValueError(f"unknown figure format {f!r}; allowed: {', '.join(FORMATS)} "
                                 "(several as --format png,pdf)")
            if f not in out:
                out.append(f)
    return tuple(out)


def save_formats(fig, path, formats=("png",), dpi: float = DPI) -> list[str]:
    """Write ``fig`` as ``path`` with each suffix of ``formats`` (``curves.png`` → ``curves.pdf``...), then
    close it; the files written."""
    from .topology_drawing import save_figure

    stem = os.path.splitext(os.fspath(path))[0]
    out = []
    for i, f in enumerate(formats):
        out.append(save_figure(fig, f"{stem}.{f}", "figure", dpi=dpi, close=i == len(formats) - 1))
    return out
