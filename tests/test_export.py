"""``cdsgd export`` and cdsgd.report.export: a run's params.pt back into the run's model.

Expected outputs are computed here from params.pt rows directly: the MLP's
forward pass written out in numpy, its weights cut from the row in the order
of the model's layers (not through cdsgd.base.flat).
"""

from __future__ import annotations

import doctest
import re
import shlex
import shutil

import numpy as np
import pytest
import torch

import cdsgd.report.export
from cdsgd.cli import build_parser, main
from cdsgd.cli.export import EXAMPLES
from cdsgd.report.export import export_model, load_model
from cdsgd.models import build_model

HIDDEN = 12
N = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    assert main(["run", f"n_agents={N}", "epochs=1", "save_params=true", f"model_params.hidden=[{HIDDEN}]",
                 "init=independent", f"out={out}", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def rows(run):
    return torch.load(run / "params.pt", weights_only=True).double().numpy()


@pytest.fixture(scope="module")
def inputs():
    return torch.randn(7, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def _mlp_logits(row: np.ndarray, x: torch.Tensor) -> np.ndarray:
    """The 64-HIDDEN-10 ReLU MLP of one flat row: W1 (HIDDEN×64), b1, W2 (10×HIDDEN), b2, in that order."""
    sizes = [HIDDEN * 64, HIDDEN, 10 * HIDDEN, 10]
    assert len(row) == sum(sizes)
    w1, b1, w2, b2 = np.split(row, np.cumsum(sizes)[:-1])
    h = np.maximum(x.double().numpy().reshape(len(x), 64) @ w1.reshape(HIDDEN, 64).T + b1, 0)
    return h @ w2.reshape(10, HIDDEN).T + b2


def _run_model(state: dict) -> torch.nn.Module:
    model = build_model("mlp", (1, 8, 8), 10, hidden=[HIDDEN])
    model.load_state_dict(state)  # strict: every key of the run's model, nothing else
    return model.eval()


def test_agents_differ(rows):
    assert rows.shape[0] == N and not np.allclose(rows[0], rows[1])


@pytest.mark.parametrize("agent", range(N))
def test_agent_state_dict_reproduces_its_row(run, rows, inputs, agent):
    with torch.no_grad():
        got = _run_model(export_model(run, agent=agent))(inputs).double().numpy()
    np.testing.assert_allclose(got, _mlp_logits(rows[agent], inputs), rtol=1e-5, atol=1e-5)


def test_average_is_the_mean_of_rows(run, rows, inputs):
    mean = rows.mean(axis=0)
    for state in (export_model(run), export_model(run, average=True)):  # the default is the average
        flat = torch.cat([v.reshape(-1) for v in state.values()]).double().numpy()
        np.testing.assert_allclose(flat, mean, rtol=0, atol=1e-6)
        with torch.no_grad():
            got = _run_model(state)(inputs).double().numpy()
        np.testing.assert_allclose(got, _mlp_logits(mean, inputs), rtol=1e-5, atol=1e-5)


def test_load_model_skips_the_data_set_when_told_its_shape(run, rows, inputs):
    model = load_model(run, agent=1, input_shape=(1, 8, 8), n_classes=10)
    assert not model.training
    with torch.no_grad():
        np.testing.assert_allclose(model(inputs).double().numpy(), _mlp_logits(rows[1], inputs), atol=1e-5)


def test_cli_writes_a_loadable_state_dict(run, rows, inputs, tmp_path, capsys):
    for args, row in ((["--agent", "1"], rows[1]), ([], rows.mean(axis=0)), (["--average"], rows.mean(axis=0))):
        path = tmp_path / "m.pt"
        assert main(["export", str(run), *args, "-o", str(path)]) == 0
        assert f"wrote {path}" in capsys.readouterr().out
        with torch.no_grad():
            got = _run_model(torch.load(path, weights_only=True))(inputs).double().numpy()
        np.testing.assert_allclose(got, _mlp_logits(row, inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--agent", "3"], r"agent 3 is out of range: the run has 3 agents, 0\.\.2"),
    (["--agent", "-1"], r"agent -1 is out of range: the run has 3 agents, 0\.\.2"),
])
def test_cli_refuses_bad_agent(run, tmp_path, capsys, args, message):
    assert main(["export", str(run), *args, "-o", str(tmp_path / "m.pt")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "m.pt").exists()


def test_agent_and_average_are_exclusive(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), "--agent", "1", "--average", "-o", str(tmp_path / "m.pt")])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"choose agent=1 or average=True, not both"):
        export_model(run, agent=1, average=True)


def test_run_without_params_says_to_save_them(run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "config.toml", bare / "config.toml")
    assert main(["export", str(bare), "-o", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "has no params.pt" in err and "save_params=true" in err
    assert main(["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "m.pt")]) == 2
    assert "is not a folder; expected a run folder" in capsys.readouterr().err


def test_params_of_another_model_are_refused(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    text = (other / "config.toml").read_text().replace(f"model_params = {{hidden = [{HIDDEN}]}}",
                                                     "model_params = {hidden = [13]}")
    (other / "config.toml").write_text(text)
    with pytest.raises(ValueError, match=r"holds 910 values per agent, but model 'mlp' .* has 985 parameters"):
        export_model(other)


def test_help_says_the_default_and_its_examples_run(tmp_path, monkeypatch, capsys):
    """Every command of ``cdsgd export --help`` runs as written, then its Python lines load the file."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--help"])
    text = capsys.readouterr().out
    assert "(the default)" in text and EXAMPLES.splitlines()[1] in text
    monkeypatch.chdir(tmp_path)
    lines = EXAMPLES.splitlines()
    commands = [line.strip() for line in lines if line.startswith("  cdsgd ")]
    assert len(commands) == 3
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    python = [line.strip() for line in lines[lines.index("then, in Python:") + 1:] if line.startswith("  ")]
    scope: dict = {}
    exec("\n".join(python), scope)  # the snippet as printed, loading average.pt with strict keys
    assert isinstance(scope["model"], torch.nn.Module)
    assert (tmp_path / "agent2.pt").is_file()


def test_docstring_examples():
    assert doctest.testmod(cdsgd.report.export, optionflags=doctest.ELLIPSIS).failed == 0
