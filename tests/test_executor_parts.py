"""The executor is built from parts, each owning its state: the checkpoint is the dict of theirs, the two
doors (the config's and the API's) build the same executor, and the code stays readable (short functions,
no writes into another object's private fields)."""

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import topologies
from cdsgd.config import load_config
from cdsgd.executor import AgentStack, DataFeed, Evaluator, Executor
from cdsgd.algorithms import make_algorithm
from cdsgd.run.plan import build_executor, prepare, validate_config
from cdsgd.runtime.group import LocalGroup

ROOT = Path(__file__).resolve().parent.parent
LONGEST = 80  # lines a function may take, its def line to its last, docstring included


def _executor(**kw) -> Executor:
    g = torch.Generator().manual_seed(0)
    shards = [(torch.randn(12, 3, generator=g), torch.randint(0, 2, (12,), generator=g)) for _ in range(4)]
    W = topologies.mixing_matrix(topologies.build("ring", 4))
    return Executor.build(lambda: nn.Linear(3, 2), shards, W, "cdmsgd", lr=0.1, batch_size=4, **kw)


def test_the_checkpoint_is_the_dict_of_the_parts_state():
    ex = _executor(augment=lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g))
    ex.run(steps=2)  # evaluated at its last step
    ex.step()
    saved = ex.state_dict()
    assert {"stack", "data", "rule", "mixer", "reducer", "meters"} <= set(saved)
    assert torch.equal(saved["stack"]["X"], ex.stack.state_dict()["X"])
    torch.testing.assert_close(saved["data"], ex.data.state_dict(), rtol=0, atol=0)
    assert saved["meters"]["loss"]["loss_counts"].tolist() == [1.0] * 4  # one step since the row of step 2, per agent
    again = _executor(augment=lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g))
    again.load_state_dict(torch.load(_roundtrip(saved), weights_only=True))
    ex.run(steps=3)
    again.run(steps=3)
    assert torch.equal(ex.X, again.X) and torch.equal(ex.state["momentum"], again.state["momentum"])


def _roundtrip(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_a_checkpoint_of_the_earlier_layout_is_refused_in_one_line():
    ex = _executor()
    old = {"k": 3, "agents": [0, 1, 2, 3], "X": ex.X.clone(), "wall": 0.0}  # format 1 had no "format" key
    with pytest.raises(ValueError, match=r"^checkpoint state is of format 1, written by an earlier cdsgd; this "
                                         r"version reads format 2: start the run afresh \(resume=false\)$"):
        ex.load_state_dict(old)


def test_the_config_door_and_the_api_door_build_the_same_executor():
    cfg = load_config(overrides=["dataset=synthetic", "n_agents=4", "batch_size=8", "exact=true", "epochs=1"])
    parts = prepare(cfg, validate_config(cfg))
    from_config = build_executor(cfg, parts, LocalGroup())
    alg = make_algorithm(cfg.algorithm, lr=cfg.lr, momentum=cfg.momentum)
    from_api = Executor.build(parts.model_fn, parts.shards, parts.W, alg, batch_size=cfg.batch_size, seed=cfg.seed,
                              exact=True, test_set=parts.test_set)
    for ex in (from_config, from_api):
        ex.run(steps=5)
    assert torch.equal(from_config.X, from_api.X)
    rows = [{k: v for k, v in ex.evaluate().items() if k != "wall_seconds"} for ex in (from_config, from_api)]
    assert str(rows[0]) == str(rows[1])  # NaN columns alike


def test_parts_refuse_what_does_not_fit():
    stack = AgentStack(lambda: nn.Linear(3, 2), 3)
    data = DataFeed([(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))] * 2, [0, 1])
    with pytest.raises(ValueError, match="the data holds 2 shards but the agents are 3"):
        Executor(stack, data, None, make_algorithm("sgd", lr=0.1))
    with pytest.raises(ValueError, match="algorithm must be an Algorithm .* got str"):
        Executor(stack, data, None, "sgd")
    with pytest.raises(ValueError, match="eval_batch_size must be"):
        Evaluator(None, 3, eval_batch_size=0)


def test_executor_takes_at_most_eight_parameters():
    params = [p for p in inspect.signature(Executor.__init__).parameters if p != "self"]
    assert len(params) <= 8, params


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_in_the_library_is_longer_than_eighty_lines():
    long = []
    for package in ("cdsgd", "topologies"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for fn in _functions(ast.parse(path.read_text())):
                if fn.end_lineno - fn.lineno + 1 > LONGEST:
                    long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1})")
    assert not long, long


def _private_writes(tree) -> list[str]:
    """Assignments to ``obj._name`` (and ``obj.__dict__`` edits) where obj is not self or cls."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for e in ast.walk(target):
                if (isinstance(e, ast.Attribute) and e.attr.startswith("_") and not e.attr.startswith("__")
                        and not (isinstance(e.value, ast.Name) and e.value.id in ("self", "cls"))):
                    found.append(ast.unparse(node))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"
                and not (isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self")):
            found.append(ast.unparse(node))
    return found


def test_no_module_writes_another_objects_private_fields():
    assert _private_writes(ast.parse("ex._wall = 1\nself._ok = 2\nm.__dict__.setdefault('_x', 0)")) == [
        "ex._wall = 1", "m.__dict__.setdefault('_x', 0)"]  # the scan itself sees what it looks for
    found = []
    for package in ("cdsgd", "topologies"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}: {w}" for w in _private_writes(ast.parse(path.read_text()))]
    assert not found, found


def test_resuming_from_a_checkpoint_of_the_earlier_layout_is_refused_before_training(tmp_path):
    from cdsgd.run.experiment import run_experiment

    keys = ["dataset=synthetic", "n_agents=3", "batch_size=16", "epochs=1", "checkpoint_every=1", f"out={tmp_path}"]
    run_experiment(load_config(overrides=keys), progress=False, log=lambda m: None)
    (path,) = (tmp_path / "checkpoints").glob("step-*/rank-0.pt")
    payload = torch.load(path, weights_only=True)
    del payload["simulator"]["format"]  # as cdsgd 0.1.0 wrote it
    torch.save(payload, path)
    logs = []
    with pytest.raises(ValueError, match=r"holds executor state of format 1, written by an earlier cdsgd; this "
                                         r"version reads format 2: start the run afresh \(resume=false\)$"):
        run_experiment(load_config(overrides=keys + ["epochs=2", "resume=true"]), progress=False, log=logs.append)
    assert not any("continuing from the checkpoint" in m for m in logs), logs
