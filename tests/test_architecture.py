"""The architecture's promises (docs/architecture.md): layers, no import circle, small modules, one build per run."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the layers, bottom first, as folders (sub-packages) and the few top-level modules; a module may import
#: only from its own layer or the ones below. ``cdsgd`` itself is the public front: it names its exports
#: as strings and imports them on first use (tested below), so it sits at the bottom with ``cdsgd.base``.
LAYERS = [
    ["topologies"],
    ["cdsgd", "cdsgd.base"],
    ["cdsgd.config", "cdsgd.testing"],
    ["cdsgd.mixers"],
    ["cdsgd.algorithms"],
    ["cdsgd.network"],
    ["cdsgd.mgrit", "cdsgd.data"],
    ["cdsgd.models", "cdsgd.transformer"],
    ["cdsgd.executor"],
    ["cdsgd.runtime"],
    ["cdsgd.run"],
    ["cdsgd.report"],
    ["cdsgd.cli", "cdsgd.__main__"],
]

#: the most top-level modules cdsgd/ may hold besides __init__ and __main__ (the rest live in layer folders)
MAX_TOP_LEVEL_MODULES = 8


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg in ("cdsgd", "topologies"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _layer(module: str) -> int:
    """The layer of the longest listed prefix of ``module``."""
    best, level = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, level = name, i
    assert level is not None, f"module {module} is in no layer of LAYERS: add it"
    return level


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file (lazy imports in functions too)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> nx.DiGraph:
    mods = _modules()
    G = nx.DiGraph()
    G.add_nodes_from(mods)
    for m, path in mods.items():
        for target in _imports(m, path, set(mods)):
            if not m.startswith(target + "."):  # a package's own __init__ being loaded first is not a dependency
                G.add_edge(m, target)
    return G


def test_no_import_circle():
    G = _graph()
    cycles = list(nx.simple_cycles(G))
    assert not cycles, f"import circles: {cycles[:3]}"


def test_arrows_point_down():
    up = [(a, b) for a, b in _graph().edges if _layer(b) > _layer(a)]
    assert not up, f"imports pointing up a layer: {up}"


def test_topologies_imports_neither_torch_nor_cdsgd():
    for m, path in _modules().items():
        if m.startswith("topologies"):
            text = path.read_text()
            tree = ast.parse(text)
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                assert not any(n.split(".")[0] in ("torch", "cdsgd") for n in names), (m, names)


def test_no_module_over_450_lines():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_each_package_declares_its_public_names():
    for m, path in _modules().items():
        if path.name == "__init__.py" and m != "cdsgd":
            assert "__all__" in path.read_text(), f"{m} has no __all__"


def test_one_run_builds_the_mixing_matrix_and_the_algorithm_once(tmp_path, monkeypatch):
    import topologies
    from cdsgd import cli
    from cdsgd.run import plan

    calls = {"mixing_matrix": 0, "make_algorithm": 0, "validate": 0}

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(topologies, "mixing_matrix", counting("mixing_matrix", topologies.mixing_matrix))
    monkeypatch.setattr(plan, "make_algorithm", counting("make_algorithm", plan.make_algorithm))
    validate = counting("validate", topologies.validate)  # one wrapper, wherever the name is looked up
    for mod in ("topologies", "topologies.mixing", "cdsgd.mixers", "cdsgd.runtime.exchange"):
        monkeypatch.setattr(__import__(mod, fromlist=["validate"]), "validate", validate, raising=False)
    code = cli.main(["run", "epochs=0.2", "test_subset=50", f"out={tmp_path / 'run'}", "--no-progress"])
    assert code == 0
    assert calls["mixing_matrix"] == 1 and calls["make_algorithm"] == 1, calls
    assert calls["validate"] <= 1, calls  # mixing_matrix validates what it builds; nobody validates W again


def test_every_config_key_is_documented_and_helped():
    """docs/running.md's table and `cdsgd run --help` cover every key Config declares."""
    from cdsgd.config import config_keys, key_info

    table = (ROOT / "docs" / "running.md").read_text()
    missing = [k for k in config_keys() if f"`{k}`" not in table]
    assert not missing, f"config keys missing from docs/running.md: {missing}"
    assert all(key_info(k)["help"] for k in config_keys())


def test_layers_are_folders_and_few_modules_sit_at_the_top():
    """Every sub-package of cdsgd is one layer (listed whole, never split across layers by module), and at
    most MAX_TOP_LEVEL_MODULES modules sit directly in cdsgd/ besides __init__ and __main__."""
    top = sorted(p.stem for p in (ROOT / "cdsgd").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"
    listed = [name for names in LAYERS for name in names]
    packages = sorted(f"cdsgd.{p.parent.name}" for p in (ROOT / "cdsgd").glob("*/__init__.py"))
    for pkg in packages:
        assert pkg in listed, f"package {pkg} is in no layer of LAYERS"
        assert not [n for n in listed if n.startswith(pkg + ".")], f"{pkg} is split across layers"
    for name in top:
        assert f"cdsgd.{name}" in listed, f"top-level module cdsgd.{name} is in no layer"


def test_no_production_module_imports_the_test_helpers():
    G = _graph()
    users = sorted(m for m, target in G.edges if target == "cdsgd.testing")
    assert not users, f"production modules importing cdsgd.testing: {users}"


def test_the_front_offers_the_public_names_lazily():
    """``import cdsgd`` loads neither torch nor matplotlib; every name in ``cdsgd.__all__`` resolves to the
    object of the module the front says is its home."""
    import importlib
    import subprocess
    import sys

    import cdsgd

    needed = {"simulate", "Simulator", "make_algorithm", "CDSGD", "CDMSGD", "DecentralizedOptimizer", "Mixer",
              "MatrixMixer", "load_config", "run_experiment"}
    assert needed <= set(cdsgd.__all__)
    for name in cdsgd.__all__:
        if name != "__version__":
            assert getattr(cdsgd, name) is getattr(importlib.import_module(cdsgd._HOMES[name]), name), name
    assert set(cdsgd.__all__) <= set(dir(cdsgd))
    # the front imports nothing heavy; the command line's parser (`cdsgd --help` answers at once) not torch
    probe = ("import sys; heavy = lambda: sorted(m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules); "
             "import cdsgd; print(heavy()); import cdsgd.cli; cdsgd.cli.build_parser(); print(heavy())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    front, cli = out.stdout.splitlines()
    assert front == "[]" and "torch" not in cli and "matplotlib" not in cli, out.stdout


#: the module paths of the layout before the layer packages (see CHANGELOG.md, 0.2.0); none imports
OLD_MODULE_PATHS = [
    "cdsgd.simulator", "cdsgd.mixing", "cdsgd.checks", "cdsgd.seeding", "cdsgd.files", "cdsgd.flat", "cdsgd.comm",
    "cdsgd.plan", "cdsgd.experiment", "cdsgd.checkpoint", "cdsgd.logger", "cdsgd.progress", "cdsgd.sweep",
    "cdsgd.plotting", "cdsgd.topology_drawing", "cdsgd.export", "cdsgd.cli_topo", "cdsgd.cli_export",
    "cdsgd.launch",
]


def test_old_paths_and_names_are_gone():
    """No compatibility layer: every old module path raises ModuleNotFoundError, the old names are no
    attributes, and ``import cdsgd`` installs no import hook."""
    import importlib
    import sys

    import cdsgd

    for old in OLD_MODULE_PATHS:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    assert not [f for f in sys.meta_path if type(f).__module__.split(".")[0] == cdsgd.__name__], sys.meta_path
    for module, name in [("cdsgd.config", "_toml_value"), ("cdsgd.algorithms", "check_int"),
                         ("cdsgd.algorithms", "check_lr"), ("cdsgd.algorithms", "check_momentum"),
                         ("cdsgd.algorithms", "check_weight_decay"), ("cdsgd.cli", "free_port"),
                         ("cdsgd.cli", "launch_argv"), ("cdsgd.cli", "describe_launch_failure")]:
        assert not hasattr(importlib.import_module(module), name), (module, name)
    from cdsgd.mixers import MatrixMixer
    m = MatrixMixer(torch.full((4, 4), 0.25, dtype=torch.float64))
    assert m.agents == [0, 1, 2, 3] and not hasattr(m, "rows")


def test_the_api_page_names_every_public_name():
    """docs/api.md lists each name of ``cdsgd.__all__`` (its Python examples run in tests/test_docs_code.py)."""
    import re

    import cdsgd

    page = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in cdsgd.__all__ if n != "__version__" and not re.search(rf"`{n}[`(]", page)]
    assert not missing, f"public names missing from docs/api.md: {missing}"
