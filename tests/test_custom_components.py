"""Model options refused by name, and the user's own model or data set given as "package.module:callable".

The user's module is written to tmp_path and put on sys.path; runs go
through ``cdsgd.cli.main`` as a user's would. Every bad input must be refused
with exit status 2 before the output folder exists.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import numpy as np
import pytest
import torch

from cdsgd.cli import main
from cdsgd.config import load_config
from cdsgd.report.export import load_model
from cdsgd.models import build_model, check_model_options, model_options, n_parameters
from cdsgd.run.plan import load_config_dataset, validate_config

MOD = "cdsgd_user_parts"

SOURCE = '''
import numpy as np
import torch
from torch import nn

from cdsgd.data import Dataset


def tiny(input_shape, n_classes, width=16):
    """One hidden layer of ``width`` units."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), width), nn.ReLU(),
                         nn.Linear(width, n_classes))


def anything(input_shape, n_classes, **options):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), n_classes))


def wrong_out(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), n_classes + 1))


def bad_forward(input_shape, n_classes):
    return nn.Linear(3, n_classes)  # inputs are (B, 1, 8, 8): the matmul fails


def not_module(input_shape, n_classes):
    return 3


def no_params(input_shape, n_classes):
    return nn.Flatten()


CONST = 3


def _blobs(n, seed):
    """Three well-separated Gaussian classes in 5 dimensions."""
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 3, n)
    x = rng.randn(n, 5) + 4 * np.eye(3, 5)[y]
    return x, y


def blobs(data_dir):
    """numpy arrays of float64 inputs and int32 labels: converted by cdsgd."""
    (x, y), (xt, yt) = _blobs(300, 0), _blobs(100, 1)
    return (x, y.astype(np.int32)), (xt, yt.astype(np.int32))


def as_record(data_dir):
    (x, y), (xt, yt) = _blobs(300, 0), _blobs(100, 1)
    t = lambda a, d: torch.as_tensor(a, dtype=d)
    return Dataset("blobs", (t(x, torch.float32), t(y, torch.int64)), (t(xt, torch.float32), t(yt, torch.int64)),
                   3, (5,))


def returns_list(data_dir):
    return [1, 2]


def float_labels(data_dir):
    return (np.zeros((10, 5)), np.zeros(10)), (np.zeros((4, 5)), np.zeros(4))


def int_inputs(data_dir):
    return (np.zeros((10, 5), dtype=np.int64), np.arange(10) % 2), (np.zeros((4, 5)), np.arange(4) % 2)


def one_class(data_dir):
    return (np.zeros((10, 5)), np.zeros(10, dtype=int)), (np.zeros((4, 5)), np.zeros(4, dtype=int))


def test_shape_differs(data_dir):
    return (np.zeros((10, 5)), np.arange(10) % 2), (np.zeros((4, 6)), np.arange(4) % 2)


def not_arrays(data_dir):
    return ([0.0, 1.0], [0, 1]), ([0.0], [0])


def sized(data_dir, n=300, dims=5):
    """``n`` training samples in ``dims`` dimensions: options a run passes through dataset_params."""
    (x, y), (xt, yt) = _blobs(n, 0), _blobs(100, 1)
    pad = lambda a: np.pad(a, ((0, 0), (0, dims - 5)))
    return (pad(x), y), (pad(xt), yt)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{MOD}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MOD, raising=False)  # a copy imported by an earlier test is another file
    yield MOD
    sys.modules.pop(MOD, None)


def _run(tmp_path, *overrides) -> tuple[int, dict]:
    out = tmp_path / "run"
    status = main(["run", *overrides, "epochs=2", "n_agents=3", f"out={out}", "--no-progress"])
    return status, json.loads((out / "summary.json").read_text()) if status == 0 else {}


# --------------------------------------------------------------------------- #
# model_params of the built-in models
# --------------------------------------------------------------------------- #


def _widths(model) -> list[int]:
    return [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_mlp_hidden_takes_a_list_or_one_integer():
    assert _widths(build_model("mlp", (1, 8, 8), 10, hidden=64)) == [64, 10]
    assert _widths(build_model("mlp", (1, 8, 8), 10, hidden=[64])) == [64, 10]
    assert _widths(build_model("mlp", (1, 8, 8), 10, hidden=[32, 16, 8])) == [32, 16, 8, 10]
    assert _widths(build_model("mlp", (1, 8, 8), 10, hidden=[])) == [10]
    assert _widths(build_model("mlp", (1, 8, 8), 10)) == [256, 128, 10]


def test_model_options_lists_defaults():
    assert model_options("mlp") == {"hidden": (256, 128)}
    assert model_options("lstm") == {"hidden": 64, "layers": 1, "packed": False, "trim": True}
    assert model_options("cnn") == {}


BAD_OPTIONS = [
    ("mlp", {"hiden": 32},
     r"^model 'mlp': bad options \['hiden'\] \(option 'hiden' is unknown; did you mean 'hidden'\? "
     r"allowed \(with defaults\): hidden = \[256, 128\]\)$"),
    ("mlp", {"hidden": "64"},
     r"^model option hidden must be a list of layer widths \(integers >= 1\) or one integer for model 'mlp' "
     r"\(default \[256, 128\]\), got '64' \(str\)$"),
    ("mlp", {"hidden": [64, 0]}, r"hidden must be a list of layer widths .* got \[64, 0\] \(list\)$"),
    ("mlp", {"hidden": [64.5]}, r"hidden must be a list of layer widths .* got \[64\.5\] \(list\)$"),
    ("mlp", {"hidden": True}, r"hidden must be a list of layer widths .* got True \(bool\)$"),
    ("fcn", {"detph": 3}, r"did you mean 'depth'\? allowed \(with defaults\): depth = 20, width = 50\)$"),
    ("fcn", {"depth": "3"}, r"^model option depth must be an integer for model 'fcn' \(default 20\), got '3' \(str\)$"),
    ("fcn", {"width": 0}, r"^model option width must be an integer >= 1, got 0$"),
    ("lenet", {"hidden": 3}, r"^model 'lenet': bad options \['hidden'\] \(model 'lenet' takes no options\)$"),
    ("lstm", {"packed": 1},
     r"^model option packed must be true or false for model 'lstm' \(default false\), got 1 \(int\)$"),
    ("lstm", {"hidden": True}, r"^model option hidden must be an integer for model 'lstm' \(default 64\), got True"),
    ("lstm", {"xyz": 1, "abc": 2},
     r"bad options \['abc', 'xyz'\] \(option 'abc' is unknown; allowed \(with defaults\): "
     r"hidden = 64, layers = 1, packed = false, trim = true\)$"),
    ("pgru", {"mode": 2},
     r"^model option mode must be a string for model 'pgru' \(default \"mgrit\"\), got 2 \(int\)$"),
]


@pytest.mark.parametrize("name, options, message", BAD_OPTIONS, ids=lambda v: str(v)[:20])
def test_bad_model_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        check_model_options(name, options)
    shape = (16, 2) if name in ("lstm", "pgru") else (1, 8, 8)
    with pytest.raises(ValueError, match=message):  # the same through build_model (the Python API)
        build_model(name, shape, 10, **options)


def test_cli_mlp_hidden_integer_runs_and_bad_option_is_refused(tmp_path, capsys):
    status, summary = _run(tmp_path, "model=mlp", "model_params.hidden=24")
    assert status == 0 and summary["n_parameters"] == (64 * 24 + 24) + (24 * 10 + 10)
    out = tmp_path / "refused"
    assert main(["run", "model_params={hiden = 32}", f"out={out}", "--no-progress"]) == 2
    assert "bad options ['hiden']" in capsys.readouterr().err and not out.exists()


# --------------------------------------------------------------------------- #
# the user's own model and data set
# --------------------------------------------------------------------------- #


def test_own_model_and_data_set_run(user_module, tmp_path):
    status, summary = _run(tmp_path, f"model={MOD}:tiny", f"dataset={MOD}:blobs", "model_params.width=8",
                           "save_params=true")
    assert status == 0
    assert (summary["model"], summary["dataset"]) == (f"{MOD}:tiny", f"{MOD}:blobs")
    assert summary["n_parameters"] == (5 * 8 + 8) + (8 * 3 + 3)
    assert summary["test_accuracy"] > 0.8, summary  # chance 1/3; the blobs are 4 noise sds apart
    cfg = load_config(tmp_path / "run" / "config.toml")  # the saved config repeats the run
    assert (cfg.model, cfg.dataset) == (f"{MOD}:tiny", f"{MOD}:blobs")
    model = load_model(tmp_path / "run", agent=2)  # and its model can be exported
    assert _widths(model) == [8, 3]


def test_own_model_on_a_built_in_data_set(user_module, tmp_path):
    status, summary = _run(tmp_path, f"model={MOD}:tiny")
    assert status == 0 and summary["dataset"] == "digits"
    assert summary["n_parameters"] == (64 * 16 + 16) + (16 * 10 + 10)


def test_built_in_model_on_own_data_set(user_module, tmp_path):
    status, summary = _run(tmp_path, "model=logreg", f"dataset={MOD}:as_record")
    assert status == 0 and summary["n_parameters"] == 5 * 3 + 3


def test_any_options_with_kwargs_factory(user_module):
    check_model_options(f"{MOD}:anything", {"whatever": 1, "else": [2]})


def test_loader_results_are_converted(user_module):
    ds = load_config_dataset(load_config(overrides=[f"dataset={MOD}:blobs"]))
    assert ds.name == f"{MOD}:blobs" and ds.n_classes == 3 and ds.input_shape == (5,)
    assert ds.train[0].dtype == torch.float32 and ds.train[1].dtype == torch.int64
    assert (len(ds.train[1]), len(ds.test[1])) == (300, 100)
    rng = np.random.RandomState(0)  # the loader's first draw: the training labels
    np.testing.assert_array_equal(ds.train[1].numpy(), rng.randint(0, 3, 300))


BAD_OWN = [
    (f"model={MOD}:tinny", rf"model '{MOD}:tinny': module '{MOD}' has no attribute 'tinny'; did you mean 'tiny'\?"),
    (f"model={MOD}:CONST", rf"model '{MOD}:CONST': CONST is of type int, not callable; expected a function "
                           r"factory\(input_shape, n_classes, \*\*model_params\) -> torch\.nn\.Module"),
    ("model=no_such_module_xyz:f", r"model 'no_such_module_xyz:f': module 'no_such_module_xyz' cannot be imported "
                                   r"\(ModuleNotFoundError: .*\); it must be importable"),
    (f"model={MOD}:", rf"model '{MOD}:': expected a registered name or 'package\.module:callable'"),
    (f"model={MOD}:wrong_out", rf"model '{MOD}:wrong_out': for inputs of shape \(2, 1, 8, 8\) the module returned "
                               r"torch\.float32 \(2, 11\); expected floating-point logits of shape \(2, 10\)"),
    (f"model={MOD}:not_module", r"the factory returned an object of type int; expected a torch\.nn\.Module"),
    (f"model={MOD}:no_params", r"the module has no parameters"),
    (f"model={MOD}:bad_forward", rf"model '{MOD}:bad_forward': its forward pass on inputs of shape \(2, 1, 8, 8\) "
                                 r"failed \(RuntimeError: "),
    (f"model={MOD}:tiny model_params.widht=3",
     rf"model '{MOD}:tiny': bad options \['widht'\] \(option 'widht' is unknown; did you mean 'width'\? "
     r"allowed \(with defaults\): width = 16\)"),
    (f"dataset={MOD}:returns_list", rf"data set '{MOD}:returns_list': the loader returned a list; expected a "
                                    r"cdsgd\.data\.Dataset or \(\(train_x, train_y\), \(test_x, test_y\)\)"),
    (f"dataset={MOD}:not_arrays", r"the loader's train split holds a list and a list; expected \(inputs, labels\)"),
    (f"dataset={MOD}:float_labels", r"train labels are torch\.float64 of shape \(10,\); expected integer class labels"),
    (f"dataset={MOD}:int_inputs", r"train inputs are torch\.int64 of shape \(10, 5\); expected floating-point"),
    (f"dataset={MOD}:one_class", r"the labels span 1 class\(es\); expected labels 0\.\.K-1 with K >= 2"),
    (f"dataset={MOD}:test_shape_differs", rf"data set '{MOD}:test_shape_differs', test split: inputs must be "
                                          r"float32 \(or int64 token ids\) of shape \(n, \*\(5,\)\), got torch\.float32 \(4, 6\)"),
    (f"dataset={MOD}:nope", rf"data set '{MOD}:nope': module '{MOD}' has no attribute 'nope'"),
    (f"dataset={MOD}:CONST", r"not callable; expected a function loader\(data_dir\) -> cdsgd\.data\.Dataset"),
    # plain names keep the registry's did-you-mean
    ("model=lenett", r"model 'lenett' is unknown; did you mean 'lenet'\?"),
    ("dataset=mnist_5k", r"data set 'mnist_5k' is unknown; did you mean 'mnist5k'\?"),
]


@pytest.mark.parametrize("overrides, message", BAD_OWN, ids=[b[0] for b in BAD_OWN])
def test_bad_own_components_refused_before_any_folder(user_module, tmp_path, capsys, overrides, message):
    out = tmp_path / "out"
    assert main(["run", *overrides.split(), f"out={out}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cdsgd run: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists()
    with pytest.raises(ValueError, match=message):  # the same through the Python door
        validate_config(load_config(overrides=overrides.split()))


def test_module_in_the_working_directory_is_found_without_it_on_sys_path(tmp_path, monkeypatch):
    """The installed ``cdsgd`` script does not put the working directory on sys.path; the import still finds it."""
    (tmp_path / "cdsgd_cwd_parts.py").write_text("from torch import nn\n"
                                                 "def lin(input_shape, n_classes):\n"
                                                 "    return nn.Sequential(nn.Flatten(), nn.Linear(64, n_classes))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cdsgd_cwd_parts", raising=False)
    assert n_parameters(build_model("cdsgd_cwd_parts:lin", (1, 8, 8), 10)) == 64 * 10 + 10
    assert sys.path[-1] == str(tmp_path)  # searched last: installed packages keep precedence
    sys.modules.pop("cdsgd_cwd_parts", None)


def test_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "cdsgd_broken_parts.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"model 'cdsgd_broken_parts:f': module 'cdsgd_broken_parts' cannot be "
                                         r"imported \(RuntimeError: boom\)"):
        check_model_options("cdsgd_broken_parts:f", {})


# --------------------------------------------------------------------------- #
# dataset_params: options of the data set, built-in or the user's
# --------------------------------------------------------------------------- #


def test_dataset_params_reach_a_built_in_loader():
    ds = load_config_dataset(load_config(overrides=["dataset=synthetic", "dataset_params.n_train=120",
                                                    "dataset_params.n_classes=6"]))
    assert (len(ds.train[1]), ds.n_classes, len(ds.test[1])) == (120, 6, 200)  # n_test keeps its default


def test_dataset_params_reach_the_users_loader(user_module):
    ds = load_config_dataset(load_config(overrides=[f"dataset={user_module}:sized",
                                                    "dataset_params={n = 40, dims = 7}"]))
    assert (tuple(ds.train[0].shape), ds.input_shape) == ((40, 7), (7,))


@pytest.mark.parametrize("dataset,params,message", [
    ("synthetic", "dataset_params.n_trian=5", r"data set 'synthetic' has no option 'n_trian'; did you mean "
                                              r"'n_train'\? allowed: n_train, n_test, n_classes, seed"),
    ("digits", "dataset_params.seed=1", r"data set 'digits' has no option 'seed'; allowed: \(none\)"),
    (f"{MOD}:blobs", "dataset_params.n=5", rf"data set '{MOD}:blobs': the loader cannot take dataset_params "
                                           r"\{'n': 5\}"),
])
def test_a_dataset_option_it_does_not_take_is_refused_before_the_folder(user_module, tmp_path, capsys, dataset,
                                                                         params, message):
    status, _ = _run(tmp_path, f"dataset={dataset}", params)
    assert status == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
