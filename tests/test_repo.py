"""Repository-level promises: import isolation, doctests, README vs CI."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_topologies_does_not_import_torch():
    code = "import sys, topologies; topologies.mixing_matrix(topologies.build('ring', 5)); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize(
    "module",
    ["topologies", "topologies.builders", "topologies.io", "topologies.mixing", "topologies.registry",
     "cdsgd", "cdsgd.algorithms", "cdsgd.mixers", "cdsgd.models", "cdsgd.transformer", "cdsgd.base.seeding",
     "cdsgd.config",
     "cdsgd.data.partition", "cdsgd.data.datasets", "cdsgd.data.bucketing", "cdsgd.data.sequences",
     "cdsgd.data.records", "cdsgd.data.corpora", "cdsgd.data.text",
     "cdsgd.run.checkpoint", "cdsgd.base.checks", "cdsgd.base.files", "cdsgd.base.flat", "cdsgd.run.plan",
     "cdsgd.executor.evaluation", "cdsgd.executor.core", "cdsgd.algorithms.rules", "cdsgd.algorithms.optim",
     "cdsgd.algorithms.baselines", "cdsgd.algorithms.local_optim", "cdsgd.algorithms.step_sizes",
     "cdsgd.mgrit", "cdsgd.mgrit.cell",
     "cdsgd.mgrit.solver", "cdsgd.mgrit.layer", "cdsgd.data.formats", "cdsgd.data.augment",
     "cdsgd.executor.meters", "cdsgd.executor.streams", "cdsgd.executor.agents", "cdsgd.run.summary",
     "cdsgd.executor.door",
     "cdsgd.executor.asynchronous", "cdsgd.algorithms.outer", "cdsgd.run.graphs", "cdsgd.mixers.schedule",
     "cdsgd.mixers.base", "topologies.schedules", "topologies.membership", "cdsgd.network.churn",
     "cdsgd.executor.membership", "cdsgd.runtime.elastic"],
)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def _readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    quickstart = _readme_commands()[:2]
    assert len(quickstart) == 2 and "pytest" in quickstart[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart[1] in ci, "the last step of .ci/run must be the README's test command"


@pytest.mark.parametrize("module", ["topologies", "cdsgd", "cdsgd.algorithms", "cdsgd.mixers", "cdsgd.models",
                                    "cdsgd.base.seeding", "cdsgd.executor", "cdsgd.runtime",
                                    "cdsgd.run.plan", "cdsgd.base.comm", "cdsgd.base.checks", "cdsgd.base.files",
                                    "cdsgd.base.flat", "cdsgd.config", "cdsgd.testing", "cdsgd.mgrit", "cdsgd.data",
                                    "cdsgd.cli"])
def test_public_names_declared(module):
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert hasattr(mod, name), name
