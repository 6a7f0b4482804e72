"""The architecture's promises (docs/architecture.md): layers, no import circle, small modules, one build per run."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the layers, bottom first; a module may import only from its own layer or the ones below
LAYERS = [
    ["topologies"],
    ["cdsgd", "cdsgd.checks", "cdsgd.seeding", "cdsgd.files", "cdsgd.flat", "cdsgd.comm", "cdsgd.config",
     "cdsgd.testing"],
    ["cdsgd.mixing", "cdsgd.checkpoint"],
    ["cdsgd.algorithms"],
    ["cdsgd.mgrit", "cdsgd.data"],
    ["cdsgd.models"],
    ["cdsgd.executor", "cdsgd.simulator"],
    ["cdsgd.runtime"],
    ["cdsgd.logger", "cdsgd.progress"],
    ["cdsgd.plan", "cdsgd.experiment"],
    ["cdsgd.sweep", "cdsgd.plotting", "cdsgd.topology_drawing", "cdsgd.export"],
    ["cdsgd.cli", "cdsgd.cli_topo", "cdsgd.cli_export", "cdsgd.__main__"],
]


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
    from cdsgd import cli, plan

    calls = {"mixing_matrix": 0, "make_algorithm": 0, "validate": 0}

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(topologies, "mixing_matrix", counting("mixing_matrix", topologies.mixing_matrix))
    monkeypatch.setattr(plan, "make_algorithm", counting("make_algorithm", plan.make_algorithm))
    validate = counting("validate", topologies.validate)  # one wrapper, wherever the name is looked up
    for mod in ("topologies", "topologies.mixing", "cdsgd.mixing", "cdsgd.runtime.exchange"):
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
