"""The test tiers (tests/conftest.py): what starts a process is marked ``dist`` without anyone marking it,
and a test that starts one unmarked fails instead of slowing the fast tier down unseen."""

from __future__ import annotations

import pathlib

CONFTEST = (pathlib.Path(__file__).resolve().parent / "conftest.py").read_text()
INI = """[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    dist: starts processes
    slow: a slow study
    data: needs an installed data set
"""


def _suite(pytester, source: str):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_sample=source)


def test_process_starters_are_marked_dist_and_the_rest_is_not(pytester):
    _suite(pytester, '''
import subprocess
import pytest


def _helper():
    return subprocess.run(["true"])


def _indirect():
    return _helper()


@pytest.fixture
def started():
    import multiprocessing
    return multiprocessing


def test_uses_subprocess():
    subprocess.run(["true"])


def test_through_helpers():
    _indirect()


def test_through_a_fixture(started):
    pass


def test_launch_words():
    main = print
    main(["launch", "--nproc-per-node", "2"])


def test_local_import():
    from cdsgd.testing import run_ranks
    run_ranks


@pytest.mark.slow
def test_a_slow_study():
    pass


def test_plain_arithmetic():
    """Docstrings may say subprocess or torchrun: prose starts nothing."""
    assert 1 + 1 == 2


def test_fashion_mnist_needs_data():
    "x"
    name = "fashion_mnist"
    assert name
''')
    fast = pytester.runpytest_inprocess("--co", "-q", "-m", "not dist")
    fast.stdout.fnmatch_lines(["test_sample.py::test_plain_arithmetic", "test_sample.py::test_fashion_mnist_needs_data",
                               "2/8 tests collected (6 deselected)*"])
    data = pytester.runpytest_inprocess("--co", "-q", "-m", "data")
    data.stdout.fnmatch_lines(["test_sample.py::test_fashion_mnist_needs_data", "1/8 tests collected*"])


def test_an_unmarked_test_that_starts_a_process_fails_and_says_why(pytester):
    _suite(pytester, '''
import importlib


def test_hidden_process_start():
    module = importlib.import_module("sub" + "process")  # hidden from the reading at collection
    module.run(["true"])
''')
    result = pytester.runpytest_inprocess("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_hidden_process_start starts a process but is not marked 'dist'*"])


def test_a_helper_imported_from_a_test_module_not_collected_still_marks_dist(pytester):
    """Running one file: a helper it imports in a test's body from another test module is read too."""
    _suite(pytester, '''
def test_through_another_module():
    from test_tier_helpers_elsewhere import start_pair
    start_pair()


def test_plain():
    assert True
''')
    pytester.makepyfile(test_tier_helpers_elsewhere='''
import subprocess


def start_pair():
    return subprocess.run(["true"])
''')
    fast = pytester.runpytest_inprocess("--co", "-q", "-m", "not dist", "test_sample.py")
    fast.stdout.fnmatch_lines(["test_sample.py::test_plain", "1/2 tests collected (1 deselected)*"])


def test_an_attribute_named_like_a_helper_elsewhere_does_not_mark_dist(pytester):
    """``x.shape`` is not a call of another test module's ``shape`` helper that starts processes."""
    _suite(pytester, '''
import test_tier_rig


def test_attribute_only():
    x = type("X", (), {"shape": (2, 3)})()
    assert x.shape == (2, 3)


def test_the_helper_itself():
    from test_tier_rig import shape
    shape()
''')
    pytester.makepyfile(test_tier_rig='''
import subprocess


def shape():
    return subprocess.run(["true"])
''')
    fast = pytester.runpytest_inprocess("--co", "-q", "-m", "not dist", "test_sample.py")
    fast.stdout.fnmatch_lines(["test_sample.py::test_attribute_only", "1/2 tests collected (1 deselected)*"])
