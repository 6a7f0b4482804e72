"""A language model through ``cdsgd run``: the text metrics, the bigram floor and the time to a target loss.

Every expected figure is computed here from the run's own outputs or the
corpus: bits per byte and perplexity from the test loss, the bigram floor
from counts made with numpy, the test loss and next-token accuracy by
evaluating the saved parameters with a plain forward pass.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import torch
from torch.func import functional_call

from cdsgd.base.flat import ParamLayout
from cdsgd.config import load_config
from cdsgd.data import load_dataset
from cdsgd.executor.evaluation import TEXT_COLUMNS
from cdsgd.models import build_model
from cdsgd.run.experiment import run_experiment

CORPUS = {"context": 32, "max_bytes": 60_000}
MODEL = {"width": 16, "heads": 2, "layers": 1, "context": 32}
TEXT_RUN = ["dataset=python_code", "dataset_params={context = 32, max_bytes = 60000}", "model=gpt",
            "model_params={width = 16, heads = 2, layers = 1, context = 32}", "n_agents=3", "topology=ring",
            "algorithm=cdsgd", "lr=0.3", "batch_size=8", "epochs=1", "eval_steps=20", "save_params=true"]


def _rows(out):
    with open(out / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, [{k: float(v) for k, v in r.items()} for r in reader]


def _bigram_by_counts(ds) -> float:
    """−mean log p(y|x) over the test positions, p(b|a) = (c(a,b) + 1) / (c(a) + 256), counted with np.add.at."""
    counts = np.zeros((256, 256))
    np.add.at(counts, (ds.train[0].numpy().ravel(), ds.train[1].numpy().ravel()), 1)
    p = (counts + 1) / (counts.sum(1, keepdims=True) + 256)
    xv, yv = ds.test[0].numpy().ravel(), ds.test[1].numpy().ravel()
    return float(-np.log(p[xv, yv]).mean())


def test_a_text_run_reports_bits_per_byte_perplexity_the_bigram_floor_and_time_to_target(tmp_path):
    out, lines = tmp_path / "lm", []
    run_experiment(load_config(overrides=TEXT_RUN + [f"out={out}", "target_loss=4.0"]), progress=False,
                   log=lines.append)
    names, rows = _rows(out)
    assert tuple(names[-len(TEXT_COLUMNS):]) == TEXT_COLUMNS  # appended after every existing column
    for r in rows:
        assert math.isclose(r["test_bits_per_byte"], r["test_loss"] / math.log(2), rel_tol=1e-12)
        assert math.isclose(r["test_perplexity"], math.exp(r["test_loss"]), rel_tol=1e-12)
        assert math.isclose(r["test_bits_per_byte_avg_model"], r["test_loss_avg_model"] / math.log(2), rel_tol=1e-12)
        assert math.isclose(r["test_perplexity_avg_model"], math.exp(r["test_loss_avg_model"]), rel_tol=1e-12)
    summary = json.loads((out / "summary.json").read_text())
    ds = load_dataset("python_code", **CORPUS)
    assert math.isclose(summary["bigram_loss"], _bigram_by_counts(ds), rel_tol=1e-9)
    assert sum("bigram floor" in line for line in lines) == 1
    # time to the target loss: the first evaluation at or below it
    hit = next((r for r in rows if r["test_loss"] <= 4.0), None)
    assert rows[0]["test_loss"] > 4.0 and hit is not None, "the run must start above the target and reach it"
    assert summary["target_loss"] == 4.0 and summary["steps_to_target_loss"] == hit["step"]
    assert summary["wall_seconds_to_target_loss"] == hit["wall_seconds"]

    # the last row's test loss and next-token accuracy, recomputed from the saved parameters
    X = torch.load(out / "params.pt", weights_only=True)
    model = build_model("gpt", ds.input_shape, ds.n_classes, **MODEL).eval()
    layout = ParamLayout(model)
    tx, ty = ds.test
    losses, accs = [], []
    with torch.no_grad():
        for row in X:
            logits = functional_call(model, layout.views(row), (tx,))
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ty.reshape(-1))))
            accs.append(float((logits.argmax(-1) == ty).double().mean()))
    assert math.isclose(rows[-1]["test_loss"], np.mean(losses), rel_tol=1e-4)
    assert math.isclose(rows[-1]["test_accuracy"], np.mean(accs), rel_tol=1e-9, abs_tol=1e-9)


def test_an_image_run_has_no_text_figures(tmp_path):
    out = tmp_path / "img"
    run_experiment(load_config(overrides=["dataset=synthetic", "model=logreg", "n_agents=3", "epochs=1",
                                          "lr=0.1", f"out={out}"]), progress=False, log=lambda m: None)
    _, rows = _rows(out)
    assert all(math.isnan(r[c]) for r in rows for c in TEXT_COLUMNS)
    assert "bigram_loss" not in json.loads((out / "summary.json").read_text())
