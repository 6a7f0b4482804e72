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
RUN_FIELDS = ("seed", "acc", "avg", "bytes", "secs", "loss", "sim", "target", "status", "avg_loss")


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
    clock), target (target_accuracy: the *_to_target columns as a run computes them), avg_loss (the
    average model's final test loss: a ``test_loss_avg_model`` column) and status: a run that did not
    complete stopped at its first evaluation (epoch 0.8) with NaN losses and chance accuracy, as a
    diverged run does; a failed one left no metrics.csv."""
    from cdsgd.run.summary import to_target

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
        status = r.get("status", "completed")
        if "avg_loss" in r:
            for k, m in enumerate(metrics):
                m["test_loss_avg_model"] = r["avg_loss"] / (k + 1)
        if status != "completed":
            metrics = [{**metrics[0], "epoch": 0.8, "train_loss": float("nan"), "test_loss": float("nan"),
                        "test_accuracy": 0.1, "consensus_distance": float("nan")}]
        if status != "failed":
            write_csv(root / name / "metrics.csv", list(metrics[0]), metrics)
        else:
            (root / name).mkdir(parents=True)
        timed = {"simulated_seconds": metrics[-1]["sim_seconds"]} if "sim" in r else {}
        if r.get("target"):
            timed.update(to_target(metrics, r["target"]))
        rows.append({**{k: r[k] for k in keys}, "seed": r["seed"], "spectral_gap": 0.5, "effective_neighbours": 3.0,
                     "epoch": epochs[-1], "step": 10 * last, "test_accuracy": r["acc"],
                     "test_accuracy_avg_model": r["avg"], "consensus_distance": 0.1, "bytes_sent_per_agent": r["bytes"],
                     **({"epoch": 0.8, "test_accuracy": 0.1} if status != "completed" else {}),
                     "status": status, "run": name,
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


def legends(fig):
    """The figure's legends: one beside or below the panels, or one inside a lone panel."""
    return fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]


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
    assert colours == {"complete": "C0", "ring": "C1", "star": "C2"}  # a topology names itself


def test_numeric_keys_are_listed_in_numeric_order(tmp_path):
    """The legend read "bucketing=1, 16, 2, 4, 8" (text order) while the colours went by value."""
    runs = [{"bucketing": k, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for k in (16, 2, 1, 8)]
    for name, fig in sweep_figures(make_sweep(tmp_path, runs)).items():
        (legend,) = legends(fig)
        assert [t.get_text() for t in legend.get_texts()] == ["1 bucket", "2 buckets", "8 buckets", "16 buckets"], name
        if name in ("accuracy_vs_epoch.png", "consensus_vs_epoch.png", "loss_vs_time.png"):  # curves
            colours = {line.get_label(): line.get_color() for ax in visible_axes(fig) for line in ax.get_lines()}
            assert colours == {"1 bucket": "C0", "2 buckets": "C1", "8 buckets": "C2", "16 buckets": "C3"}, name


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
    assert sorted(lines) == ["1 bucket", "8 buckets"]
    np.testing.assert_allclose(lines["1 bucket"].get_xdata(), [0.0, 3.0, 6.0])
    np.testing.assert_allclose(lines["1 bucket"].get_ydata(), [2.0, 1.0, 2.0 / 3])
    np.testing.assert_allclose(lines["8 buckets"].get_xdata(), [0.0, 1.5, 3.0])  # mean of 1 s and 2 s per epoch
    np.testing.assert_allclose(lines["8 buckets"].get_ydata(), [2.0, 1.0, 2.0 / 3])  # mean of 2.4 and 1.6
    (band,) = ax.collections
    lo, hi = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (lo, hi) == pytest.approx((1.6 / 3, 2.4))
    assert ax.get_xlabel().startswith("training seconds") and ax.get_ylabel() == "test loss (agents' mean)"
    assert title(fig).startswith("test loss vs training seconds\n(mean over 1–2 seeds")


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
    assert sorted(axes) == sorted(f"{n} network\n{m}" for n in ("datacenter", "edge")
                                  for m in ("agents' own models (mean)", "average model x̄"))
    for title_, ax in axes.items():
        lines = {line.get_label(): line for line in ax.get_lines()}
        scale = 0.01 if "datacenter" in title_ else 1.0
        for topo, unit, acc in (("complete", 4.0, 0.9), ("ring", 1.0, 0.75)):  # no run's points missing
            line = lines[topo]
            np.testing.assert_allclose(line.get_xdata(), unit * scale * 1.05 * np.arange(1, 4))  # seeds' mean
            np.testing.assert_allclose(line.get_ydata(), acc * np.arange(1, 4) / 3)
        assert ("target accuracy 0.8" in lines) == ("agents" in title_)
        assert len(ax.collections) == 2  # a band per topology: two seeds
        assert ax.get_xlabel() == "simulated seconds" and ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert title(fig) == "test accuracy vs simulated seconds\n(mean over 2 seeds, band: min–max)"


def test_time_to_target_shows_runs_that_never_reached_it(tmp_path):
    """The complete graph reaches 0.8 at its third evaluation (0.9 · 3/3), the ring never (0.75): a hollow
    marker in a column 'not reached' per panel, with its count of seeds; none is dropped."""
    fig = sweep_figures(network_sweep(tmp_path, target=0.8))["time_to_target.png"]
    assert fig.legends == []  # the series are the rows, named on the y axis
    for ax in visible_axes(fig):
        named = [t.get_text() for t in ax.get_yticklabels() if t.get_visible()] if ax.yaxis.get_tick_params().get(
            "labelleft", True) else []
        # the rows, named once on the left of each line of panels
        assert named == (["complete", "ring"] if ax.get_subplotspec().colspan.start == 0 else [])
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
    assert reached == {"ring": pytest.approx(6.0), "torus": pytest.approx(9.0)}
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
    for part in ("CDSGD", "ring", "n=4", "digits", "logreg", "seed 0"):
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
    assert len(axes) == 4 and fig.get_figwidth() == fig.get_figheight() / 2.5 * 3.3  # 2 x 2 panels of 3.3 x 2.5 in
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
    assert any("no compression" in k and "CDMSGD" in k for k in labels), labels
    assert len(labels) == 4


# ------------------------------------------------------------------------------ figures for a paper (issue 29)

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<?xml"}


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    head = open(path, "rb").read(24)
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_every_format_is_written_at_the_dpi_asked(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for t in ("ring", "star")]
    folder = make_sweep(tmp_path / "s", runs)
    files = plot_sweep(folder, tmp_path / "f", formats=("png", "pdf", "svg"), dpi=200)
    names = list(sweep_figures(folder))
    assert sorted(files) == sorted(str(tmp_path / "f" / n.replace(".png", f".{x}")) for n in names for x in MAGIC)
    for f in files:
        head = open(f, "rb").read(200)
        assert head.startswith(MAGIC[f.rsplit(".", 1)[1]]) and (not f.endswith(".svg") or b"<svg" in head), f
    sizes = {n: fig.get_size_inches() for n, fig in sweep_figures(folder).items()}
    for name, (w, h) in sizes.items():
        pw, ph = png_size(tmp_path / "f" / name)
        assert abs(pw - w * 200) <= 1 and abs(ph - h * 200) <= 1, (name, pw, ph, w, h)
    (run,) = plot_run(folder / "topology=ring,seed=0", tmp_path / "r", formats=("pdf",), dpi=72)
    assert run.endswith("curves.pdf") and open(run, "rb").read(5) == b"%PDF-"


def test_cli_plot_takes_formats_and_dpi_and_names_a_bad_one(tmp_path, capsys):
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5} for t in ("ring", "star")]
    folder = make_sweep(tmp_path / "s", runs)
    assert cli.main(["plot", str(folder), "--format", "pdf,svg", "--dpi", "72", "--out", str(tmp_path / "o")]) == 0
    written = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert "accuracy_vs_epoch.pdf" in written and "accuracy_vs_epoch.svg" in written and "table.md" in written
    assert not [n for n in written if n.endswith(".png")], written
    assert cli.main(["plot", str(folder), "--format", "png", "--dpi", "50", "--out", str(tmp_path / "p")]) == 0
    fig = sweep_figures(folder)["consensus_vs_epoch.png"]
    assert png_size(tmp_path / "p" / "consensus_vs_epoch.png")[0] == pytest.approx(fig.get_figwidth() * 50, abs=1)
    capsys.readouterr()
    for bad, named in ((["--format", "png,jpg"], "'jpg'"), (["--dpi", "0"], "--dpi")):
        assert cli.main(["plot", str(folder), "--out", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err, err
        assert bad[0] != "--format" or "png, pdf, svg" in err, err
        assert not (tmp_path / "bad").exists()


def test_legends_read_as_words_in_the_literatures_names(tmp_path):
    runs = [{"topology": t, "algorithm": a, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5}
            for t in ("ring", "complete", "torus") for a in ("cdmsgd", "qg_dsgdm")]
    for name, fig in sweep_figures(make_sweep(tmp_path, runs)).items():
        (legend,) = legends(fig)
        assert [t.get_text() for t in legend.get_texts()] == [
            f"{t}, {a}" for t in ("complete", "ring", "torus") for a in ("CDMSGD", "QG-DSGDm")], name


def diverging_sweep(root):
    """CDMSGD completes on both graphs; CDSGD diverges on the complete graph (both seeds) and on one seed of
    the ring; DSGT's run on the ring failed before its first evaluation (no metrics.csv)."""
    runs = [{"topology": t, "algorithm": "cdmsgd", "seed": s, "acc": 0.8, "avg": 0.8, "bytes": 1e5}
            for t in ("ring", "complete") for s in (0, 1)]
    runs += [{"topology": "complete", "algorithm": "cdsgd", "seed": s, "acc": 0.1, "avg": 0.1, "bytes": 2e4,
              "status": "diverged"} for s in (0, 1)]
    runs += [{"topology": "ring", "algorithm": "cdsgd", "seed": 0, "acc": 0.1, "avg": 0.1, "bytes": 2e4,
              "status": "diverged"},
             {"topology": "ring", "algorithm": "cdsgd", "seed": 1, "acc": 0.7, "avg": 0.7, "bytes": 1e5}]
    runs += [{"topology": "ring", "algorithm": "dsgt", "seed": 0, "acc": 0.0, "avg": 0.0, "bytes": 0.0,
              "status": "failed"}]
    return make_sweep(root, runs)


def test_diverged_and_failed_runs_stay_in_every_figure(tmp_path):
    folder = diverging_sweep(tmp_path)
    for name, fig in sweep_figures(folder).items():
        (legend,) = legends(fig)
        texts = [t.get_text() for t in legend.get_texts()]
        for wanted in ("CDSGD, complete (diverged)", "CDSGD, ring (1 of 2 diverged)", "DSGT, ring (failed)"):
            assert wanted in texts, (name, texts)
        ends = [line for ax in visible_axes(fig) for line in ax.get_lines() if line.get_marker() == "X"]
        drawn = [line for line in ends if len(line.get_xdata())]
        assert len(drawn) >= 3, name  # the 3 diverged runs, in each panel
        if name.endswith("epoch.png"):  # where they stopped: epoch 0.8
            assert all(float(line.get_xdata()[-1]) == pytest.approx(0.8) for line in drawn), name


def test_table_lists_runs_that_did_not_complete(tmp_path):
    from cdsgd.run.sweep import group_table

    lines = group_table(diverging_sweep(tmp_path)).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    got = {(r["algorithm"], r["topology"], r["status"], r["seeds"]) for r in rows}
    assert got == {("cdmsgd", "complete", "completed", "2"), ("cdmsgd", "ring", "completed", "2"),
                   ("cdsgd", "complete", "**diverged** at epoch 0.8", "2"),
                   ("cdsgd", "ring", "completed", "1"), ("cdsgd", "ring", "**diverged** at epoch 0.8", "1"),
                   ("dsgt", "ring", "**failed** at epoch 0.8", "1")}
    diverged = next(r for r in rows if r["topology"] == "complete" and r["algorithm"] == "cdsgd")
    assert diverged["test acc (agents)"] == "—"  # a stopped run's accuracy is not a final one
    ring = next(r for r in rows if r["status"] == "completed" and r["algorithm"] == "cdsgd")
    assert ring["test acc (agents)"] == "0.700"


def _covered(fig) -> float:
    """The fraction of the figure's width under a panel (with its labels) or the legend."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    xs = np.zeros(int(fig.bbox.width) + 1, bool)
    for b in [ax.get_tightbbox(r) for ax in visible_axes(fig)] + [lg.get_window_extent(r) for lg in legends(fig)]:
        xs[max(0, int(b.x0)):int(b.x1) + 1] = True
    return xs.mean()


def test_legends_sit_inside_or_tight_beside_the_panels(tmp_path):
    from cdsgd.report.style import PANEL

    few = [{"topology": t, "seed": 0, "acc": 0.8, "avg": "", "bytes": 1e5} for t in ("ring", "star")]
    fig = sweep_figures(make_sweep(tmp_path / "few", few))["consensus_vs_epoch.png"]
    (ax,) = visible_axes(fig)
    fig.canvas.draw()
    assert not fig.legends and ax.get_legend() is not None  # inside the lone panel
    inner, box = ax.get_window_extent(), ax.get_legend().get_window_extent()
    assert inner.x0 <= box.x0 and box.x1 <= inner.x1 and inner.y0 <= box.y0 and box.y1 <= inner.y1
    many = [{"topology": t, "algorithm": a, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5}
            for t in ("ring", "complete", "torus") for a in ("cdmsgd", "dsgt", "qg_dsgdm")]
    for name, fig in sweep_figures(make_sweep(tmp_path / "many", many)).items():
        (legend,) = legends(fig)
        fig.canvas.draw()
        box, whole = legend.get_window_extent(), fig.bbox
        assert whole.x0 - 1 <= box.x0 and box.x1 <= whole.x1 + 1 and whole.y0 - 1 <= box.y0, name
        assert _covered(fig) > 0.9, name  # before: legends beside a box of blank, ~35 % of the width unused
        below = box.y1 <= min(ax.get_window_extent().y0 for ax in visible_axes(fig))
        assert (box.height / whole.height if below else box.width / whole.width) < 0.5, name  # panels keep the rest
        grown = fig.get_figheight() - box.height / fig.dpi if below else fig.get_figwidth() - box.width / fig.dpi
        assert grown >= (PANEL[1] if below else PANEL[0]), name  # the figure grew by the legend: panels kept their size


def test_series_at_the_same_x_have_their_own_marker_and_place(tmp_path):
    """DSGT's marker disappeared under QG-DSGDm's at the same spectral gap: each series has a marker shape of
    its own and points at one x are set a few points apart."""
    runs = [{"topology": "ring", "algorithm": a, "seed": 0, "acc": acc, "avg": acc, "bytes": 1e5}
            for a, acc in (("cdmsgd", 0.80), ("dsgt", 0.81), ("qg_dsgdm", 0.81))]
    fig = sweep_figures(make_sweep(tmp_path, runs))["accuracy_vs_spectral_gap.png"]
    ax = visible_axes(fig)[0]
    fig.canvas.draw()
    points = {c.get_label(): c.lines[0] for c in ax.containers}
    assert len({line.get_marker() for line in points.values()}) == 3, points
    xs = sorted(line.get_transform().transform(np.column_stack([line.get_xdata(), line.get_ydata()]))[0, 0]
                for line in points.values())
    apart = 3.0 * fig.dpi / 72  # 3 points, in pixels
    assert np.diff(xs) == pytest.approx([apart, apart], rel=1e-6)
    curves = visible_axes(sweep_figures(make_sweep(tmp_path / "c", runs))["accuracy_vs_epoch.png"])[0]
    assert len({line.get_marker() for line in curves.get_lines()}) == 3


def test_average_models_test_loss_beside_the_agents(tmp_path):
    runs = [{"topology": t, "seed": 0, "acc": 0.8, "avg": 0.7, "bytes": 1e5, "loss": 1.2, "avg_loss": al}
            for t, al in (("ring", 0.9), ("star", 0.6))]
    fig = sweep_figures(make_sweep(tmp_path / "with", runs))["loss_vs_time.png"]
    agents, average = visible_axes(fig)
    assert "agents" in agents.get_title() and "average model" in average.get_title()
    assert finals(average) == {"ring": pytest.approx(0.3), "star": pytest.approx(0.2)}
    assert finals(agents) == {"ring": pytest.approx(0.4), "star": pytest.approx(0.4)}
    without = [{k: v for k, v in r.items() if k != "avg_loss"} for r in runs]
    (ax,) = visible_axes(sweep_figures(make_sweep(tmp_path / "without", without))["loss_vs_time.png"])
    assert ax.get_ylabel() == "test loss (agents' mean)"
    fig = run_figure(tmp_path / "with" / "topology=ring,seed=0")
    loss = next(ax for ax in visible_axes(fig) if ax.get_ylabel() == "loss")
    lines = {line.get_label(): line.get_ydata()[-1] for line in loss.get_lines()}
    assert lines["test (average model x̄)"] == pytest.approx(0.3) and lines["test (agents' own models, mean)"] == \
        pytest.approx(0.4)
