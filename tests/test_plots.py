"""Figures: what a reader can read off them (ticks, titles, panels, labels), not just that a PNG was written.

Sweep folders are written by hand in the run-output format (results.csv, and
metrics.csv per run) so that each test picks its numbers; one tiny real run
checks ``plot_run`` against the files a run really writes.
"""

from __future__ import annotations

import csv

import networkx as nx
import numpy as np
import pytest

import topologies
from cdsgd import cli
from cdsgd.report.plotting import draw_topology, plot_run, plot_sweep, run_figure, sweep_figures, topology_figure
from cdsgd.run.sweep import RESULT_COLUMNS

METRICS = ["epoch", "step", "train_loss", "test_loss", "test_accuracy", "test_accuracy_avg_model",
           "consensus_distance", "bytes_sent_per_agent", "wall_seconds", "sim_seconds"]
#: what a run dict of :func:`make_sweep` may hold besides its varying keys
RUN_FIELDS = ("seed", "acc", "avg", "bytes", "secs", "loss", "sim", "target")


def write_csv(path, fields, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def make_sweep(root, runs, epochs=(1.0, 2.0, 3.0)):
    """A sweep folder: ``runs`` are dicts of the varying keys plus seed, acc, avg (final accuracies
    of the agents and of the average model) and bytes; metrics rise linearly to the final values.
    Optional: secs (training seconds per epoch), loss, sim (simulated seconds per epoch: a network's
    clock) and target (target_accuracy: the *_to_target columns as a run computes them)."""
    from cdsgd.run.experiment import to_target

    keys = [k for k in runs[0] if k not in RUN_FIELDS]
    rows = []
    for r in runs:
        name = ",".join(f"{k}={r[k]}" for k in keys + ["seed"])
        last = len(epochs)
        metrics = [
            {"epoch": e, "step": 10 * (k + 1), "train_loss": 1.0 / (k + 1),
             "test_loss": r.get("loss", 1.2) / (k + 1),
             "test_accuracy": r["acc"] * (k + 1) / last,
             "test_accuracy_avg_model": r["avg"] and r["avg"] * (k + 1) / last,  # "": not evaluated
             "consensus_distance": 0.5 / (k + 1), "bytes_sent_per_agent": r["bytes"] * (k + 1) / last,
             "wall_seconds": r.get("secs", 1.0) * k, "sim_seconds": r["sim"] * (k + 1) if "sim" in r else float("nan")}
            for k, e in enumerate(epochs)]
        write_csv(root / name / "metrics.csv", METRICS, metrics)
        timed = {"simulated_seconds": metrics[-1]["sim_seconds"]} if "sim" in r else {}
        if r.get("target"):
            timed.update(to_target(metrics, r["target"]))
        rows.append({**{k: r[k] for k in keys}, "seed": r["seed"], "spectral_gap": 0.5, "effective_neighbours": 3.0,
                     "epoch": epochs[-1], "step": 10 * last, "test_accuracy": r["acc"],
                     "test_accuracy_avg_model": r["avg"], "consensus_distance": 0.1, "bytes_sent_per_agent": r["bytes"],
                     "status": "completed", "run": name,
                     **{k: v for k, v in timed.items() if k in RESULT_COLUMNS and v is not None}})
    write_csv(root / "results.csv", keys + RESULT_COLUMNS, rows)
    return root


@pytest.fixture(autouse=True)
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def finals(ax):
    """Each labelled curve's or error-bar point's last y value, by label."""
    out = {line.get_label(): line.get_ydata()[-1] for line in ax.get_lines() if not line.get_label().startswith("_")}
    out.update({c.get_label(): c.lines[0].get_ydata()[-1] for c in ax.containers})
    return out


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def labelled_xticks(ax):
    """(position, text) of the major x ticks inside the axis' view that carry a label, after drawing."""
    ax.figure.canvas.draw()
    lo, hi = sorted(ax.get_xlim())
    return [(t.get_loc(), t.label1.get_text()) for t in ax.xaxis.get_major_ticks()
            if lo <= t.get_loc() <= hi and t.label1.get_visible() and t.label1.get_text()]


def title(fig):
    return fig._suptitle.get_text() if fig._suptitle else ""


# ------------------------------------------------------------------------------ sweep figures


@pytest.mark.parametrize("byte_values", [
    (124_800, 187_200),            # one ring and one complete graph of 4 agents: 1.5x apart
    (2e5, 9e6),                    # 45x: a log axis within few decades
    (3e5, 3e6),                    # just 10x: a log axis within one decade
    (1e3, 5e9),                    # 6 decades
    (3e5, 3e5),                    # every run sent the same
    (0.0, 2e6),                    # a run that sent nothing
])
def test_bytes_axis_has_labelled_ticks_whatever_the_range(tmp_path, byte_values):
    runs = [{"topology": t, "seed": 0, "acc": 0.9, "avg": 0.8, "bytes": b}
            for t, b in zip(("complete", "ring"), byte_values)]
    fig = sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_bytes.png"]
    for ax in visible_axes(fig):
        ticks = labelled_xticks(ax)
        assert len(ticks) >= 2, (byte_values, ticks, ax.get_xlim())
        assert len({text for _, text in ticks}) == len(ticks), ticks  # no two ticks read the same
        unit_in_ticks = all(any(u in text for u in ("kB", "MB", "GB", " B")) or text == "0" for _, text in ticks)
        assert unit_in_ticks or any(u in ax.get_xlabel() for u in ("kB", "MB", "GB", "bytes")), ax.get_xlabel()


def test_bytes_axis_reads_in_units(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.9, "avg": 0.8, "bytes": b}
            for t, b in (("complete", 1e4), ("ring", 2e6), ("star", 3e9))]
    ax = visible_axes(sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_bytes.png"])[0]
    assert ax.get_xscale() == "log"
    texts = [text for _, text in labelled_xticks(ax)]
    assert {"100 kB", "1 MB", "1 GB"} <= set(texts), texts


def test_average_model_is_drawn_beside_the_agents(tmp_path):
    """Non-IID sweeps: the agents' mean (0.73) and the average model (0.26) differ; both are shown, labelled."""
    runs = [{"partition": "classes", "seed": s, "acc": 0.73, "avg": 0.26, "bytes": 1e5} for s in (0, 1)] + \
           [{"partition": "iid", "seed": s, "acc": 0.9, "avg": 0.91, "bytes": 1e5} for s in (0, 1)]
    figures = sweep_figures(make_sweep(tmp_path, runs))
    for name in ("accuracy_vs_epoch.png", "accuracy_vs_spectral_gap.png", "accuracy_vs_bytes.png"):
        axes = {ax.get_title(): ax for ax in visible_axes(figures[name])}
        agents = next(ax for t, ax in axes.items() if "agents" in t)
        average = next(ax for t, ax in axes.items() if "average model" in t)
        final = {ax: finals(ax) for ax in (agents, average)}
        assert final[agents]["partition=classes"] == pytest.approx(0.73), (name, final)
        assert final[average]["partition=classes"] == pytest.approx(0.26), (name, final)
        assert final[average]["partition=iid"] == pytest.approx(0.91), (name, final)


def test_no_average_panel_when_results_lack_it(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.9, "avg": "", "bytes": 1e5} for t in ("ring", "star")]
    fig = sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_epoch.png"]
    assert [ax.get_title() for ax in visible_axes(fig)] == [""]


@pytest.mark.parametrize("seeds,expect,absent", [
    ((0,), "one seed per group", "band"),
    ((0, 1), "mean over 2 seeds, band: min–max", None),
    ((0, 1, 2), "mean over 3 seeds, band: min–max", None),
])
def test_band_is_mentioned_only_with_several_seeds(tmp_path, seeds, expect, absent):
    runs = [{"topology": t, "seed": s, "acc": 0.8 + 0.01 * s, "avg": 0.7, "bytes": 1e5}
            for t in ("ring", "star") for s in seeds]
    figures = sweep_figures(make_sweep(tmp_path, runs))
    for name, fig in figures.items():
        text = title(fig)
        wanted = expect.replace("band", "bar") if name.startswith("accuracy_vs_") and "epoch" not in name else expect
        assert wanted in text, (name, text)
        assert absent is None or (absent not in text and "bar:" not in text), (name, text)
    bands = [c for ax in visible_axes(figures["accuracy_vs_epoch.png"]) for c in ax.collections]
    assert (len(bands) > 0) == (len(seeds) > 1)


def test_groups_of_different_seed_counts(tmp_path):
    runs = [{"topology": "ring", "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5}] + \
           [{"topology": "star", "seed": s, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for s in (0, 1, 2)]
    assert "mean over 1–3 seeds, band: min–max" in title(sweep_figures(make_sweep(tmp_path, runs))[
        "accuracy_vs_epoch.png"])


def test_text_valued_keys_keep_their_order_and_colours(tmp_path):
    """Colours follow the sorted values; a NaN sort key used to leave the order (and colours) to chance."""
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for t in ("star", "complete", "ring")]
    ax = visible_axes(sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_epoch.png"])[0]
    colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert colours == {"topology=complete": "C0", "topology=ring": "C1", "topology=star": "C2"}


def test_numeric_keys_are_listed_in_numeric_order(tmp_path):
    """The legend read "bucketing=1, 16, 2, 4, 8" (text order) while the colours went by value."""
    runs = [{"bucketing": k, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for k in (16, 2, 1, 8)]
    for name, fig in sweep_figures(make_sweep(tmp_path, runs)).items():
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == [f"bucketing={k}" for k in (1, 2, 8, 16)], name
        if name in ("accuracy_vs_epoch.png", "consensus_vs_epoch.png", "loss_vs_time.png"):  # curves
            colours = {line.get_label(): line.get_color() for ax in visible_axes(fig) for line in ax.get_lines()}
            assert colours == {"bucketing=1": "C0", "bucketing=2": "C1", "bucketing=8": "C2",
                               "bucketing=16": "C3"}, name


def test_whole_epochs_get_integer_ticks_in_sweeps(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for t in ("ring", "star")]
    ax = visible_axes(sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_epoch.png"])[0]
    assert [text for _, text in labelled_xticks(ax)] == ["1", "2", "3"]


def test_loss_vs_time_puts_each_evaluation_at_its_training_seconds(tmp_path):
    """Bucket counts as in the bucketing study: a faster epoch moves the whole curve left; with two seeds of
    different speed each evaluation sits at their mean time and loss, the band spanning their losses."""
    runs = [{"bucketing": 1, "seed": 0, "acc": 0.7, "avg": 0.7, "bytes": 1e5, "secs": 3.0, "loss": 2.0},
            {"bucketing": 8, "seed": 0, "acc": 0.7, "avg": 0.7, "bytes": 1e5, "secs": 1.0, "loss": 2.4},
            {"bucketing": 8, "seed": 1, "acc": 0.7, "avg": 0.7, "bytes": 1e5, "secs": 2.0, "loss": 1.6}]
    fig = sweep_figures(make_sweep(tmp_path, runs))["loss_vs_time.png"]
    (ax,) = visible_axes(fig)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["bucketing=1", "bucketing=8"]
    np.testing.assert_allclose(lines["bucketing=1"].get_xdata(), [0.0, 3.0, 6.0])
    np.testing.assert_allclose(lines["bucketing=1"].get_ydata(), [2.0, 1.0, 2.0 / 3])
    np.testing.assert_allclose(lines["bucketing=8"].get_xdata(), [0.0, 1.5, 3.0])  # mean of 1 s and 2 s per epoch
    np.testing.assert_allclose(lines["bucketing=8"].get_ydata(), [2.0, 1.0, 2.0 / 3])  # mean of 2.4 and 1.6
    (band,) = ax.collections
    lo, hi = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (lo, hi) == pytest.approx((1.6 / 3, 2.4))
    assert ax.get_xlabel().startswith("training seconds") and ax.get_ylabel() == "test loss"
    assert title(fig).startswith("test loss vs training seconds (mean over 1–2 seeds")


def test_plot_sweep_keeps_its_file_list_api(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for t in ("ring", "star")]
    files = plot_sweep(make_sweep(tmp_path / "s", runs), tmp_path / "figs")
    assert [f.rsplit("/", 1)[1] for f in files] == [
        "accuracy_vs_epoch.png", "consensus_vs_epoch.png", "loss_vs_time.png", "accuracy_vs_spectral_gap.png",
        "accuracy_vs_effective_neighbours.png", "accuracy_vs_bytes.png"]
    assert all(open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for f in files)


# ------------------------------------------------------------------------------ simulated network time


def network_sweep(root, target=0.0, seeds=(0, 1)):
    """topology × network, as experiments/ablations/network_smoke.toml: an edge network's seconds are 100x a
    datacenter's; per epoch the ring takes 1 unit, the complete graph 4 (a seed's evaluations 10 % apart)."""
    runs = [{"topology": topo, "network": net, "seed": s, "acc": acc, "avg": acc, "bytes": 1e5,
             "sim": unit * scale * (1 + 0.1 * s), "target": target}
            for topo, unit, acc in (("complete", 4.0, 0.9), ("ring", 1.0, 0.75))
            for net, scale in (("datacenter", 0.01), ("edge", 1.0)) for s in seeds]
    return make_sweep(root, runs)


def test_accuracy_vs_sim_time_draws_every_run_at_its_simulated_seconds(tmp_path):
    """One panel per network (own x scale) and model; one curve per topology at the seeds' mean simulated
    seconds, a band over the seeds; the target's level in the agents' panels."""
    fig = sweep_figures(network_sweep(tmp_path, target=0.8))["accuracy_vs_sim_time.png"]
    axes = {ax.get_title(): ax for ax in visible_axes(fig)}
    assert sorted(axes) == sorted(f"network={n}\n{m}" for n in ("datacenter", "edge")
                                  for m in ("agents' own models (mean)", "average model x̄"))
    for title_, ax in axes.items():
        lines = {line.get_label(): line for line in ax.get_lines()}
        scale = 0.01 if "datacenter" in title_ else 1.0
        for topo, unit, acc in (("complete", 4.0, 0.9), ("ring", 1.0, 0.75)):  # no run's points missing
            line = lines[f"topology={topo}"]
            np.testing.assert_allclose(line.get_xdata(), unit * scale * 1.05 * np.arange(1, 4))  # seeds' mean
            np.testing.assert_allclose(line.get_ydata(), acc * np.arange(1, 4) / 3)
        assert ("target accuracy 0.8" in lines) == ("agents" in title_)
        assert len(ax.collections) == 2  # a band per topology: two seeds
        assert ax.get_xlabel() == "simulated seconds" and ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert title(fig) == "test accuracy vs simulated seconds (mean over 2 seeds, band: min–max)"


def test_time_to_target_shows_runs_that_never_reached_it(tmp_path):
    """The complete graph reaches 0.8 at its third evaluation (0.9 · 3/3), the ring never (0.75): a hollow
    marker in a column 'not reached' per panel, with its count of seeds; none is dropped."""
    fig = sweep_figures(network_sweep(tmp_path, target=0.8))["time_to_target.png"]
    assert fig.legends == []  # the series are the rows, named on the y axis
    for ax in visible_axes(fig):
        named = [t.get_text() for t in ax.get_yticklabels() if t.get_visible()] if ax.yaxis.get_tick_params().get(
            "labelleft", True) else []
        # the rows, named once on the left of each line of panels
        assert named == (["topology=complete", "topology=ring"] if ax.get_subplotspec().colspan.start == 0 else [])
        (point,) = ax.containers
        scale = 0.01 if "datacenter" in ax.get_title() else 1.0
        x, y = point.lines[0].get_xdata()[0], point.lines[0].get_ydata()[0]
        assert (x, y) == (pytest.approx(3 * 4.0 * scale * 1.05), 0)  # the seeds' mean, on the complete row
        bar = point.lines[2][0].get_segments()[0]
        assert bar[:, 0] == pytest.approx([3 * 4.0 * scale, 3 * 4.0 * scale * 1.1])  # min–max over seeds
        (hollow,) = [line for line in ax.get_lines() if line.get_gid() == "not reached"]
        assert hollow.get_markerfacecolor() == "none" and list(hollow.get_ydata()) == [1]  # the ring's row
        assert hollow.get_xdata()[0] > ax.get_xlim()[0] + 0.75 * (ax.get_xlim()[1] - ax.get_xlim()[0])
        assert [t.get_text() for t in ax.texts] == ["2 of 2 seeds"]
        assert "not\nreached" in [text for _, text in labelled_xticks(ax)]
        assert ax.get_xlabel() == "simulated seconds to test accuracy ≥ 0.8"


def test_time_to_target_counts_a_seed_that_missed_beside_one_that_reached(tmp_path):
    runs = [{"topology": "ring", "network": "edge", "seed": 0, "acc": 0.9, "avg": 0.9, "bytes": 1e5, "sim": 2.0,
             "target": 0.85},
            {"topology": "ring", "network": "edge", "seed": 1, "acc": 0.8, "avg": 0.8, "bytes": 1e5, "sim": 2.0,
             "target": 0.85},
            {"topology": "torus", "network": "edge", "seed": 0, "acc": 0.9, "avg": 0.9, "bytes": 1e5, "sim": 3.0,
             "target": 0.85}]
    (ax,) = visible_axes(sweep_figures(make_sweep(tmp_path, runs))["time_to_target.png"])
    reached = {c.get_label(): c.lines[0].get_xdata()[0] for c in ax.containers}
    assert reached == {"topology=ring": pytest.approx(6.0), "topology=torus": pytest.approx(9.0)}
    assert [t.get_text() for t in ax.texts] == ["1 of 2 seeds"]


def test_network_alone_gets_a_log_time_axis_in_plain_numbers(tmp_path):
    """Networks as the colours, in one panel: their seconds lie 100x apart, so the time axes are logarithmic,
    ticks reading 0.1 or 10 rather than 10⁻¹."""
    runs = [{"network": net, "seed": 0, "acc": 0.9, "avg": 0.9, "bytes": 1e5, "sim": secs, "target": 0.5}
            for net, secs in (("datacenter", 0.02), ("lan", 0.2), ("edge", 2.0))]
    figures = sweep_figures(make_sweep(tmp_path, runs))
    for name in ("accuracy_vs_sim_time.png", "time_to_target.png"):
        ax = visible_axes(figures[name])[0]
        assert ax.get_xscale() == "log", name
        texts = [text for _, text in labelled_xticks(ax)]
        assert texts and all(t.replace(".", "").isdigit() for t in texts), (name, texts)


def test_no_time_figures_without_a_network_or_a_target(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.9, "avg": 0.9, "bytes": 1e5, "target": 0.5} for t in ("ring", "star")]
    assert not {"accuracy_vs_sim_time.png", "time_to_target.png"} & set(sweep_figures(make_sweep(tmp_path / "a", runs)))
    for r in runs:
        r.update(sim=1.0, target=0.0)
    names = set(sweep_figures(make_sweep(tmp_path / "b", runs)))
    assert "accuracy_vs_sim_time.png" in names and "time_to_target.png" not in names


# ------------------------------------------------------------------------------ one run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    code = cli.main(["run", "dataset=digits", "model=logreg", "n_agents=4", "topology=ring", "algorithm=cdsgd",
                     "epochs=2", "test_subset=50", f"out={out}", "--no-progress"])
    assert code == 0
    return out


def test_run_figure_names_the_run_and_uses_integer_epochs(real_run):
    fig = run_figure(real_run)
    text = title(fig)
    for part in ("cdsgd", "ring", "n=4", "digits", "logreg", "seed 0"):
        assert part in text, text
    axes = visible_axes(fig)
    assert len(axes) == 3  # accuracy, loss, consensus distance
    for ax in axes:
        ticks = [text for _, text in labelled_xticks(ax)]
        assert ticks and all(t.lstrip("−-").isdigit() for t in ticks), ticks
    accuracy, loss, _ = axes
    assert {"agents' own models (mean)", "average model x̄"} <= {line.get_label() for line in accuracy.get_lines()}
    assert any(line.get_label().startswith("training") for line in loss.get_lines())
    files = plot_run(real_run)
    assert files == [str(real_run / "curves.png")]


def test_run_figure_fractional_epochs_and_no_train_loss(tmp_path):
    rows = [{"epoch": e, "step": k, "test_accuracy": 0.5, "test_accuracy_avg_model": 0.6, "consensus_distance": 0.1,
             "test_loss": "", "train_loss": ""} for k, e in enumerate((0.25, 0.5, 0.75, 1.0))]
    write_csv(tmp_path / "metrics.csv", list(rows[0]), rows)
    fig = run_figure(tmp_path)
    assert len(visible_axes(fig)) == 2  # no loss panel: the run logged none
    assert title(fig) == tmp_path.name  # no config.toml / summary.json: the folder's name
    ticks = [loc for loc, _ in labelled_xticks(visible_axes(fig)[0])]
    assert any(loc != round(loc) for loc in ticks), ticks


def test_run_figure_adds_accuracy_against_simulated_seconds(tmp_path):
    """A run on a simulated network: a fourth panel (the four in a square) with both accuracies against
    sim_seconds and the target's level; the title names the network."""
    import json

    rows = [{"epoch": e, "step": 3 * e, "test_accuracy": 0.3 * e, "test_accuracy_avg_model": 0.31 * e,
             "consensus_distance": 0.1, "train_loss": 1.0 / e, "test_loss": 1.1 / e, "sim_seconds": 2.5 * e}
            for e in (1, 2, 3)]
    write_csv(tmp_path / "metrics.csv", list(rows[0]), rows)
    (tmp_path / "summary.json").write_text(json.dumps(
        {"algorithm": "cdsgd", "topology": "ring", "n_agents": 16, "mixing": "metropolis", "network": "edge",
         "dataset": "digits", "partition": "iid", "model": "mlp", "seed": 0, "target_accuracy": 0.8}))
    fig = run_figure(tmp_path)
    axes = visible_axes(fig)
    assert len(axes) == 4 and fig.get_figwidth() == fig.get_figheight() / 4.4 * 5.2  # 2 x 2
    timed = next(ax for ax in axes if ax.get_xlabel() == "simulated seconds")
    lines = {line.get_label(): line for line in timed.get_lines()}
    for label, per_epoch in (("agents' own models (mean)", 0.3), ("average model x̄", 0.31)):
        np.testing.assert_allclose(lines[label].get_xdata(), [2.5, 5.0, 7.5])
        np.testing.assert_allclose(lines[label].get_ydata(), per_epoch * np.arange(1, 4))
    assert list(lines["target accuracy 0.8"].get_ydata()) == [0.8, 0.8]
    assert "edge network" in title(fig)
    assert sum(ax.get_xlabel() == "epoch" for ax in axes) == 3


# ------------------------------------------------------------------------------ topology drawings


def edge_labels(fig):
    return [t for t in fig.axes[0].texts if t.get_gid() == "edge weight"]


def test_cli_draw_title_carries_the_builder_parameters(tmp_path, monkeypatch):
    import cdsgd.report.plotting

    seen = {}
    monkeypatch.setattr(cdsgd.report.plotting, "draw_topology", lambda G, W, path, *, title="": seen.update(title=title))
    argv = ["topo", "small_world", "--n", "16", "--param", "k=4", "--param", "p=0.3", "--param", "seed=1",
            "--draw", str(tmp_path / "g.png")]
    assert cli.main(argv) == 0
    assert seen["title"] == "small_world (n=16, k=4, p=0.3, seed=1), metropolis weights"


def test_cli_draw_writes_the_picture(tmp_path, capsys):
    png = tmp_path / "sub" / "t.png"
    assert cli.main(["topo", "torus", "--n", "16", "--draw", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_uniform_weights_are_stated_once_not_on_every_edge():
    G = topologies.build("hypercube", 16)
    fig = topology_figure(G, topologies.mixing_matrix(G, "metropolis"), title="hypercube")
    text = fig.axes[0].get_title()
    assert "every edge weight 1/5 ≈ 0.2" in text and "self weight 1/5 ≈ 0.2" in text, text
    assert edge_labels(fig) == []


def test_edge_labels_through_the_centre_do_not_stack():
    """A regular graph on a circle with differing weights: its diameters all cross at the centre,
    where midpoint labels would sit on top of each other."""
    G = topologies.build("hypercube", 8)
    for k, (i, j) in enumerate(G.edges()):
        G.edges[i, j]["weight"] = 0.05 + 0.01 * k
    W = topologies.mixing_matrix(G, "weight")
    fig = topology_figure(G, W)
    labels = edge_labels(fig)
    assert len(labels) == G.number_of_edges()
    assert sorted(t.get_text() for t in labels) == sorted(f"{W[i, j]:.3g}" for i, j in G.edges())
    spots = np.array([t.get_position() for t in labels])
    gaps = np.linalg.norm(spots[:, None] - spots[None], axis=2) + np.eye(len(spots))
    assert gaps.min() > 0.1, gaps.min()
    nodes = np.array(list(nx.circular_layout(G).values()))
    assert np.linalg.norm(spots[:, None] - nodes[None], axis=2).min() > 0.1


def test_torus_wrap_around_edges_carry_their_weights():
    G = topologies.build("torus", 9)
    for k, (i, j) in enumerate(G.edges()):
        G.edges[i, j]["weight"] = 0.1 + 0.01 * k
    W = topologies.mixing_matrix(G, "weight")
    fig = topology_figure(G, W)
    texts = sorted(t.get_text() for t in edge_labels(fig))
    wraps = [(i, j) for i, j in G.edges() if abs(i - j) not in (1, 3)]
    assert len(wraps) == 6  # three rows and three columns of 3
    # a wrap-around edge is labelled at both of its stubs, every other edge once
    assert texts == sorted([f"{W[i, j]:.3g}" for i, j in G.edges()] + [f"{W[i, j]:.3g}" for i, j in wraps])
    assert "wrap-around" in fig.axes[0].get_title()


def test_dense_graph_is_drawn_thin_and_says_so(tmp_path):
    G = topologies.build("complete", 64)
    fig = topology_figure(G, topologies.mixing_matrix(G, "metropolis", sparse=True))
    text = fig.axes[0].get_title()
    assert "dense graph: 2016 edges drawn thin and transparent" in text and "every edge weight 1/64" in text
    assert edge_labels(fig) == []
    lines = next(c for c in fig.axes[0].collections if len(c.get_segments()) == 2016)
    assert lines.get_alpha() < 0.5 and max(lines.get_linewidths()) < 1


def test_directed_graph_labels_each_arrow_with_what_the_receiver_takes():
    G = topologies.build("erdos_renyi", 10, p=0.4, seed=0)
    W = topologies.mixing_matrix(G, "push_sum")  # P[j, i] = 1/(1 + out-degree of i): not symmetric
    fig = topology_figure(G, W)
    texts = sorted(t.get_text() for t in edge_labels(fig))
    arcs = [(i, j) for i, j in G.edges()] + [(j, i) for i, j in G.edges()]
    assert texts == sorted(f"{W[j, i]:.3g}" for i, j in arcs)
    assert "arrow i→j: W[j, i]" in fig.axes[0].get_title()


def test_draw_topology_keeps_its_api_and_names_a_bad_path(tmp_path):
    G = topologies.build("ring", 5)
    W = topologies.mixing_matrix(G, "metropolis")
    draw_topology(G, W, tmp_path / "a" / "ring.png", title="ring")
    assert (tmp_path / "a" / "ring.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="cannot write the drawing .*file/ring.png"):
        draw_topology(G, W, tmp_path / "file" / "ring.png")


def test_a_key_that_follows_from_the_series_does_not_split_the_panels(tmp_path):
    """algorithm is cdmsgd exactly when compression is none: the uncompressed point is drawn in the same panel
    as the compressed ones (one panel per topology), and its label says the algorithm."""
    runs = [{"algorithm": alg, "compression": comp, "compression_params": params, "topology": topo, "seed": s,
             "acc": acc, "avg": acc, "bytes": b}
            for alg, comp, params, acc, b in [("cdmsgd", "none", "{}", 0.85, 4e8), ("choco", "top_k", "r1", 0.84, 9e6),
                                              ("choco", "top_k", "r10", 0.85, 9e7), ("choco", "sign", "{}", 0.85, 1.4e7)]
            for topo in ("ring", "torus") for s in (0, 1)]
    fig = sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_bytes.png"]
    axes = visible_axes(fig)
    assert len(axes) == 4  # 2 topologies × (agents, average model), not × 2 algorithms
    labels = finals(axes[0])
    assert any("compression=none" in k and "algorithm=cdmsgd" in k for k in labels), labels
    assert len(labels) == 4
