"""Figures of runs and sweeps, drawn headless with matplotlib's Agg backend, sized for a paper.

Each ``*_figure(s)`` function returns matplotlib Figures (for tests and notebooks); ``plot_run`` and
``plot_sweep`` save them, as PNG, PDF or SVG (:mod:`cdsgd.report.style`). A sweep's figures are drawn by
:mod:`cdsgd.report.sweep_plots`; pictures of a topology (``draw_topology``) live in
:mod:`cdsgd.report.topology_drawing`; both are re-exported here.
"""

from __future__ import annotations

import numpy as np

from .axes import log_if_wide, whole_epochs
from .csvs import column as _column
from .csvs import read_csv as _read_csv
from .labels import algorithm_name
from .style import DPI, paper_style, panels, save_formats
from .sweep_plots import sweep_figures, target_line
from .topology_drawing import draw_topology, topology_figure

__all__ = ["draw_topology", "topology_figure", "plot_run", "run_figure", "plot_sweep", "sweep_figures"]


# ----------------------------------------------------------------- a run's figure


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
    status = f" ({info['status']})" if info.get("status") not in (None, "completed", "running") else ""
    return (f"{algorithm_name(info['algorithm'])} on {show(info.get('topology'))} (n={info.get('n_agents')}, "
            f"{info.get('mixing')}{net}), {info.get('dataset')} ({info.get('partition')}), {info.get('model')}, "
            f"seed {info.get('seed')}{status}\n{folder.name}")


def _accuracy_curves(ax, x, rows, target=None, *, text: bool = False) -> None:
    """The agents' mean and the average model's test accuracy (``text``: a language model's next-token
    accuracy) against ``x``, and the target's level."""
    ax.plot(x, _column(rows, "test_accuracy"), marker="o", label="agents' own models (mean)")
    ax.plot(x, _column(rows, "test_accuracy_avg_model"), marker="s", linestyle="--", label="average model x̄")
    if target:
        target_line(ax, [target])
    ax.set_ylabel("next-token accuracy" if text else "test accuracy")
    ax.legend(loc="best")


def run_figure(folder):
    """The Figure of :func:`plot_run`."""
    with paper_style():
        return _run_figure(folder)


def _run_figure(folder):
    from pathlib import Path

    folder = Path(folder)
    rows = _read_csv(folder / "metrics.csv",
                     ("epoch", "test_accuracy", "test_accuracy_avg_model", "consensus_distance"))
    if not rows:
        raise ValueError(f"{folder / 'metrics.csv'} has no rows yet")
    info = _run_info(folder)
    ep, sim = _column(rows, "epoch"), _column(rows, "sim_seconds")
    timed = bool(np.isfinite(sim).any())  # a simulated network: accuracy against its seconds too
    text = bool(np.isfinite(_column(rows, "test_bits_per_byte")).any())  # a language model: nats per token
    losses = [(k, lab) for k, lab in (("train_loss", "training (batch loss, agents' mean)"),
                                      ("test_loss", "test (agents' own models, mean)"),
                                      ("test_loss_avg_model", "test (average model x̄)"))
              if np.isfinite(_column(rows, k)).any()]
    n = 2 + bool(losses) + timed
    fig, grid = panels(*((2, 2) if n == 4 else (1, n)))  # four panels in a square: a row of four prints too small
    axes = list(grid.flat)
    a, b = axes[0], axes[-1]
    _accuracy_curves(a, ep, rows, text=text)
    if timed:
        _accuracy_curves(axes[1], sim, rows, info.get("target_accuracy"), text=text)
        axes[1].set_xlabel("simulated seconds")
    if losses:
        lax = axes[1 + timed]
        for (k, lab), (marker, line) in zip(losses, (("o", "-"), ("s", "-"), ("^", "--"))):
            lax.plot(ep, _column(rows, k), marker=marker, linestyle=line, label=lab)
        if info.get("bigram_loss") is not None:  # the floor a model must beat to have learned beyond bytes' frequencies
            lax.axhline(info["bigram_loss"], color="0.4", linestyle=":", label="bigram model (closed form)")
        lax.set_ylabel("loss (nats/token)" if text else "loss")
        lax.legend(loc="best")
    dist = _column(rows, "consensus_distance")
    b.plot(ep, dist, marker="o", color="C2")
    log_if_wide(b, dist)
    b.set_ylabel("consensus distance sqrt(mean ||x_j - x̄||²)")
    for ax in axes:
        ax.grid(True, which="both")
        if timed and ax is axes[1]:
            continue
        ax.set_xlabel("epoch")
        whole_epochs(ax, ep)
    fig.suptitle(_run_title(folder, info))
    return fig


def plot_run(folder, out=None, formats=("png",), dpi: float = DPI) -> list[str]:
    """Curves of one run folder, saved as ``curves.png`` (and ``curves.pdf``/``.svg`` with ``formats``):
    test accuracy (agents' mean and the average model), training and test loss (when metrics.csv has
    them; the average model's test loss too when it has ``test_loss_avg_model``; a text run's in nats per
    token, with its ``bigram_loss`` as a dotted level) and consensus distance
    against epochs, and with a simulated network (``sim_seconds``) the test accuracy against
    simulated seconds (a dotted level at ``target_accuracy`` when set); the title names the
    algorithm, topology, n, network, data set, model and seed (and the status of a run that did not
    complete). Returns the files written."""
    from pathlib import Path

    return save_formats(run_figure(folder), Path(out or folder) / "curves.png", formats, dpi)


def plot_sweep(folder, out=None, formats=("png",), dpi: float = DPI) -> list[str]:
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
    return [f for name, fig in sweep_figures(folder).items() for f in save_formats(fig, out / name, formats, dpi)]
