"""Bad inputs as data: one table of CLI cases, one generic test that runs them all.

Each :class:`Case` is an argv for ``cdsgd`` (``{tmp}`` stands for the test's
tmp_path), the files it needs there first, the exit status, a regex for the
error line, and the bad value that line must name. The contract checked for
every case (see ``cdsgd/cli/commands.py``): exit status 2 for invalid input
(ValueError), 1 for other failures (a missing file); no traceback; exactly
ONE error line on stderr (argparse's usage block aside), ``cdsgd[ VERB]:
error: ...``, naming the bad value; nothing on stdout; and no side effect
listed in ``absent`` (e.g. the marker file a malicious pickle would write).

The cases run in-process through ``cdsgd.cli.main`` (fast); a few also run as
``python -m cdsgd`` subprocesses to show that no traceback reaches a terminal.
"""

from __future__ import annotations

import builtins
import gzip
import os
import pickle
import re
import shlex
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from cdsgd.cli import main

REPO = Path(__file__).resolve().parent.parent

#: a file's content: text, bytes, a function of tmp_path giving bytes, or None for a folder
Content = str | bytes | Callable[[Path], bytes] | None


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # after "cdsgd"; "{tmp}" is replaced by tmp_path
    status: int  # 2: invalid input (ValueError, argparse); 1: other failures (missing files)
    error: str  # regex, searched in the one error line
    bad: str  # the bad value, which must appear verbatim in that line ("{tmp}" replaced)
    files: dict[str, Content] = field(default_factory=dict)  # created under tmp_path first
    env: dict[str, str] = field(default_factory=dict)
    absent: tuple[str, ...] = ()  # paths under tmp_path that must not exist afterwards
    xfail: str = ""  # a known defect in a file this test's author may not edit: the reason


# --------------------------------------------------------------------------- file makers


def idx_bytes(arr, magic: int | None = None) -> bytes:
    """An IDX file (uint8 elements) holding ``arr``."""
    arr = np.asarray(arr, dtype=np.uint8)
    magic = 0x0800 | arr.ndim if magic is None else magic
    return struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


_IDX_STEMS = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
              "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def mnist_set(folder: str, **edit: Callable[[bytes], bytes | None]) -> dict[str, Content]:
    """The four IDX files of a tiny MNIST (20 train, 10 test images) in ``folder``.

    ``edit``: per file (train_images, train_labels, test_images, test_labels),
    a function of its good bytes giving the bytes to write, or None to leave it out.
    All four files are written (unless dropped) so that the folder is the one
    the loader picks: Debian's /usr/share/datasets/fashion-mnist is never reached.
    """
    rng = np.random.RandomState(0)
    good = {}
    for split, n in (("train", 20), ("test", 10)):
        good[f"{split}_images"] = idx_bytes(rng.randint(0, 256, (n, 28, 28)))
        good[f"{split}_labels"] = idx_bytes(np.arange(n) % 10)
    files: dict[str, Content] = {}
    for key, data in good.items():
        data = edit[key](data) if key in edit else data
        if data is not None:
            files[f"{folder}/{_IDX_STEMS[key]}"] = data
    return files


def drop(_: bytes) -> None:
    return None


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


class _Gadget:
    """Pickles as ``fn(arg)``: what a malicious 'CIFAR batch' would run on load."""

    def __init__(self, fn, arg) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def evil_batch(fn, arg_of_tmp: Callable[[Path], str]) -> Callable[[Path], bytes]:
    """A CIFAR-shaped pickle whose b'data' calls ``fn(arg_of_tmp(tmp_path))`` when unpickled."""
    return lambda tmp: pickle.dumps({b"data": _Gadget(fn, arg_of_tmp(tmp)), b"labels": [0]}, protocol=2)


def touch_marker(tmp: Path) -> str:
    return f"touch {shlex.quote(str(tmp / 'PWNED'))}"


def write_marker(tmp: Path) -> str:
    return f"open({str(tmp / 'PWNED')!r}, 'w').write('pwned')"


def cifar10_set(folder: str, **batches: Content) -> dict[str, Content]:
    """``folder/cifar-10-batches-py/`` with six genuine tiny batches, some replaced by ``batches``."""
    good = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, protocol=2)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {f"{folder}/cifar-10-batches-py/{n}": batches.get(n, good) for n in names}


GRAPHML_DIRECTED = """<?xml version="1.0" encoding="UTF-8"?>
<graphml xmlns="http://graphml.graphdrawing.org/xmlns">
  <graph edgedefault="directed">
    <node id="a"/><node id="b"/><node id="c"/>
    <edge source="a" target="b"/><edge source="b" target="c"/><edge source="c" target="a"/>
  </graph>
</graphml>
"""


def npy_bytes(arr, allow_pickle: bool = False) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


SUGGEST = r"; did you mean '{}'\? Known: "
TORCH_ENV = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

# --------------------------------------------------------------------------- the table

CASES = [
    # ---- config: keys, types, values, names (each unknown name with its suggestion)
    Case("config-unknown-key", ("run", "lrr=0.1"), 2,
         r"config key 'lrr' is unknown" + SUGGEST.format("lr"), "'lrr'"),
    Case("config-wrong-type-str-for-float", ("run", "lr=fast"), 2,
         r"config key 'lr' must be float, got 'fast' \(str\)", "'fast'"),
    Case("config-wrong-type-float-for-int", ("run", "n_agents=2.5"), 2,
         r"config key 'n_agents' must be int, got 2\.5 \(float\)", "2.5"),
    Case("config-negative-lr", ("run", "lr=-0.1", "out={tmp}/out"), 2,
         r"lr must be a finite number > 0, got -0\.1$", "-0.1"),
    Case("config-zero-batch-size", ("run", "batch_size=0"), 2, r"batch_size must be >= 1, got 0$", "got 0"),
    Case("config-negative-batch-size", ("run", "batch_size=-8"), 2, r"batch_size must be >= 1, got -8$", "-8"),
    Case("config-n-agents-vs-graph-file", ("run", "topology={tmp}/ring4.edgelist", "n_agents=5", "out={tmp}/out"), 2,
         r"graph file '.*ring4\.edgelist' has 4 nodes but n=5 was asked for", "{tmp}/ring4.edgelist",
         files={"ring4.edgelist": "0 1\n1 2\n2 3\n3 0\n"}, absent=("out",)),  # refused before a folder is made
    Case("config-unknown-algorithm", ("run", "algorithm=cdsdg"), 2,
         r"algorithm 'cdsdg' is unknown" + SUGGEST.format("cdsgd") + r".*\bcdmsgd\b", "'cdsdg'"),
    Case("config-unknown-topology", ("run", "topology=rnig"), 2,
         r"topology 'rnig' is unknown" + SUGGEST.format("ring") + r".*\btorus\b", "'rnig'"),
    Case("config-unknown-dataset", ("run", "dataset=fashion_mnist"), 2,
         r"data set 'fashion_mnist' is unknown" + SUGGEST.format("fashion-mnist"), "'fashion_mnist'"),
    Case("config-unknown-model", ("run", "model=lenett"), 2,
         r"model 'lenett' is unknown" + SUGGEST.format("lenet"), "'lenett'"),
    Case("config-negative-checkpoint-every", ("run", "checkpoint_every=-1"), 2,
         r"checkpoint_every must be >= 0 \(0: no checkpoints\), got -1", "-1"),
    Case("config-fractional-checkpoint-steps", ("run", "checkpoint_every=2.5", "checkpoint_unit=steps"), 2,
         r"checkpoint_every must be a whole number of steps with checkpoint_unit='steps', got 2.5", "2.5"),
    Case("config-unknown-checkpoint-unit", ("run", "checkpoint_every=1", "checkpoint_unit=epoch"), 2,
         r"checkpoint_unit 'epoch' is unknown" + SUGGEST.format("epochs"), "'epoch'"),
    Case("config-pgru-coarsening-one", ("run", "dataset=japanese_vowels", "model=pgru", "model_params.cf=1",
                                        "out={tmp}/out"), 2, r"cf must be an integer >= 2, got 1", "got 1"),
    Case("config-unknown-bucket-rule", ("run", "bucket_rule=optimum"), 2,
         r"bucketing rule 'optimum' is unknown" + SUGGEST.format("optimal"), "'optimum'"),
    Case("config-negative-bucketing", ("run", "bucketing=-2"), 2, r"bucketing must be >= 0", "-2"),
    Case("config-bucketing-on-images", ("run", "bucketing=4", "out={tmp}/out"), 2,
         r"bucketing=4 needs a sequence data set .* not 'digits'", "'digits'"),
    Case("config-recurrent-model-on-images", ("run", "model=lstm", "out={tmp}/out"), 2,
         r"recurrent models need sequences of shape \(T, 1 \+ C\).* got input_shape \(1, 8, 8\)", "(1, 8, 8)"),
    Case("config-bad-model-option", ("run", "model=mlp", "model_params.width=3", "out={tmp}/out"), 2,
         r"model 'mlp': bad options \['width'\]", "'width'"),
    Case("config-unknown-partition", ("run", "partition=clases"), 2,
         r"partition 'clases' is unknown" + SUGGEST.format("classes") + r".*\bdirichlet\b", "'clases'"),
    Case("config-unknown-mixing", ("run", "mixing=metropolis_hastings"), 2,
         r"mixing rule 'metropolis_hastings' is unknown" + SUGGEST.format("metropolis"), "'metropolis_hastings'"),
    Case("config-file-not-toml", ("run", "{tmp}/bad.toml"), 2,
         r"config file '.*bad\.toml' is not valid TOML: .*line 1", "{tmp}/bad.toml", files={"bad.toml": "lr = = 3\n"}),
    Case("config-file-missing", ("run", "{tmp}/nope.toml"), 2,
         r"config file '.*nope\.toml' does not exist", "{tmp}/nope.toml"),
    Case("config-table-for-scalar", ("run", "{tmp}/tab.toml"), 2,
         r"config file '.*tab\.toml': 'lr' must be float, got a table", "'lr'", files={"tab.toml": "[lr]\nx = 1\n"}),
    Case("config-file-not-utf8", ("run", "{tmp}/latin1.toml"), 2,
         r"config file '.*latin1\.toml' is not", "{tmp}/latin1.toml",
         files={"latin1.toml": 'out = "r\xe9sultats"\n'.encode("latin-1")}),
    Case("config-world-size-not-dividing-n-agents",
         ("run", "executor=torch", "n_agents=4", "comm_timeout=5", "out={tmp}/out"),
         2, r"3 processes but n_agents=4: the number of processes must divide n_agents", "n_agents=4", env=TORCH_ENV,
         absent=("out",)),
    # ---- graph files given as topology=PATH
    Case("graph-empty-file", ("run", "topology={tmp}/empty.edgelist"), 2,
         r"empty\.edgelist: graph is empty \(no nodes\)", "{tmp}/empty.edgelist", files={"empty.edgelist": ""}),
    Case("graph-self-loop", ("run", "topology={tmp}/loop.edgelist", "n_agents=3"), 2,
         r"loop\.edgelist:2: self-loop at node '1'", "{tmp}/loop.edgelist",
         files={"loop.edgelist": "0 1\n1 1\n1 2\n2 0\n"}),
    Case("graph-directed-graphml", ("run", "topology={tmp}/d.graphml", "n_agents=3"), 2,
         r"d\.graphml: GraphML graph is directed; cdsgd needs undirected graphs", "{tmp}/d.graphml",
         files={"d.graphml": GRAPHML_DIRECTED}),
    Case("graph-disconnected", ("run", "topology={tmp}/two.edgelist", "n_agents=4"), 2,
         r"graph is not connected: 2 components \(\[0, 1\]; \[2, 3\]\)", "[0, 1]; [2, 3]",
         files={"two.edgelist": "0 1\n2 3\n"}),
    Case("graph-csv-non-numeric", ("run", "topology={tmp}/nn.csv", "n_agents=3"), 2,
         r"nn\.csv:2: entry 2 is 'x', not a number", "'x'", files={"nn.csv": "0,1,1\n1,0,x\n1,1,0\n"}),
    Case("graph-csv-ragged", ("run", "topology={tmp}/rag.csv", "n_agents=3"), 2,
         r"rag\.csv:2: row has 2 entries but the first row has 3", "{tmp}/rag.csv",
         files={"rag.csv": "0,1,1\n1,0\n1,1,0\n"}),
    Case("graph-edgelist-bad-weight", ("run", "topology={tmp}/w.edgelist", "n_agents=2"), 2,
         r"w\.edgelist:1: weight 'heavy' is not a number", "'heavy'", files={"w.edgelist": "0 1 heavy\n"}),
    Case("graph-unknown-extension", ("run", "topology={tmp}/g.gml", "n_agents=3"), 2,
         r"g\.gml: unknown graph file extension '\.gml'; allowed: \.edgelist, .*\.graphml", "'.gml'",
         files={"g.gml": "graph [ ]\n"}),
    Case("graph-file-missing", ("run", "topology={tmp}/missing.edgelist"), 2,
         r"graph file '.*missing\.edgelist' does not exist", "{tmp}/missing.edgelist"),
    Case("graph-path-is-a-folder", ("topo", "{tmp}/graphs.edgelist"), 2,
         r"graph file '.*graphs\.edgelist' is a folder; give the path of a graph file", "{tmp}/graphs.edgelist",
         files={"graphs.edgelist": None}),
    Case("graph-npy-pickled-object-array", ("topo", "{tmp}/obj.npy"), 2,
         r"obj\.npy: not a plain numeric \.npy array", "{tmp}/obj.npy",
         files={"obj.npy": npy_bytes(np.array([{"a": 1}], dtype=object), allow_pickle=True)}),
    Case("graph-file-with-builder-params", ("run", "topology={tmp}/ring4.edgelist", "topology_params.p=0.3",
                                            "n_agents=4"), 2,
         r"graph file '.*ring4\.edgelist' takes no builder parameters, got \['p'\]", "['p']",
         files={"ring4.edgelist": "0 1\n1 2\n2 3\n3 0\n"}),
    # ---- mixing matrices (cdsgd topo NAME_OR_PATH --rule R)
    Case("mixing-unknown-rule", ("topo", "ring", "--n", "5", "--rule", "metropolis_hastings"), 2,
         r"mixing rule 'metropolis_hastings' is unknown" + SUGGEST.format("metropolis"), "'metropolis_hastings'"),
    Case("mixing-weight-rule-without-weights", ("topo", "{tmp}/ring4.edgelist", "--rule", "weight"), 2,
         r"rule 'weight': edge \(0, 1\) has no 'weight' attribute", "(0, 1)",
         files={"ring4.edgelist": "0 1\n1 2\n2 3\n3 0\n"}),
    Case("mixing-weights-sum-over-one", ("topo", "{tmp}/heavy.edgelist", "--rule", "weight"), 2,
         r"rule 'weight': the edge weights at node 0 sum to 1\.4 > 1, leaving self weight -0\.4", "1.4",
         files={"heavy.edgelist": "a b 0.7\nb c 0.7\nc a 0.7\n"}),
    Case("mixing-negative-weight", ("topo", "{tmp}/neg.edgelist", "--rule", "weight"), 2,
         r"rule 'weight': edge \(0, 1\) has weight -0\.2; weights must be finite and >= 0", "-0.2",
         files={"neg.edgelist": "0 1 -0.2\n1 2 0.3\n2 0 0.3\n"}),
    Case("mixing-uniform-on-irregular-graph", ("topo", "star", "--n", "4", "--rule", "uniform"), 2,
         r"rule 'uniform' .* doubly stochastic only on regular graphs; .* from 1 \(node 1\) to 3 \(node 0\)",
         "'uniform'"),
    Case("mixing-builder-bad-param", ("topo", "erdos_renyi", "--n", "8", "--param", "p=1.5"), 2,
         r"p must be a number in \(0, 1\], got 1\.5", "1.5"),
    # ---- data files (MNIST-like IDX, CIFAR pickles) under data_dir
    Case("data-idx-missing-files", ("run", "dataset=mnist", "data_dir={tmp}/data"), 2,
         r"mnist: no folder holds all four IDX files .* \(missing: t10k-labels-idx1-ubyte\); .*no such folder"
         r".*download=True", "{tmp}/data",
         files=mnist_set("data", test_labels=drop)),
    Case("data-idx-truncated", ("run", "dataset=fashion-mnist", "data_dir={tmp}/data"), 2,
         r"IDX file .*train-images-idx3-ubyte is truncated: shape \(20, 28, 28\) of uint8 needs 15696 bytes "
         r"\(decompressed\), the file has 1000", "{tmp}/data/train-images-idx3-ubyte",
         files=mnist_set("data", train_images=lambda b: b[:1000])),
    Case("data-idx-truncated-gzip", ("run", "dataset=mnist", "data_dir={tmp}/data"), 2,
         r"IDX file .*train-images-idx3-ubyte\.gz is a damaged or truncated gzip file",
         "{tmp}/data/train-images-idx3-ubyte.gz",
         files={**mnist_set("data", train_images=drop),
                "data/train-images-idx3-ubyte.gz": half(
                    gzip.compress(idx_bytes(np.random.RandomState(1).randint(0, 256, (20, 28, 28)))))}),
    Case("data-idx-wrong-magic", ("run", "dataset=mnist", "data_dir={tmp}/data"), 2,
         r"IDX file .*train-labels-idx1-ubyte has magic number 0x00000803; expected 0x00000801",
         "{tmp}/data/train-labels-idx1-ubyte",
         files=mnist_set("data", train_labels=lambda b: b[:3] + b"\x03" + b[4:])),
    Case("data-idx-labels-out-of-range", ("run", "dataset=fashion-mnist", "data_dir={tmp}/data"), 2,
         r"fashion-mnist: .*train-labels-idx1-ubyte holds label 11; allowed 0\.\.9", "label 11",
         files=mnist_set("data", train_labels=lambda b: idx_bytes(np.arange(20) % 12))),
    Case("data-idx-count-mismatch", ("run", "dataset=mnist", "data_dir={tmp}/data"), 2,
         r"mnist: .*t10k-images-idx3-ubyte holds 10 images but .*t10k-labels-idx1-ubyte holds 9 labels", "9 labels",
         files=mnist_set("data", test_labels=lambda b: idx_bytes(np.arange(9)))),
    Case("data-cifar-pickle-os-system", ("run", "dataset=cifar10", "data_dir={tmp}/data"), 2,
         r"data_batch_1: refusing to unpickle global (posix|nt|os)\.system; .*not a genuine CIFAR batch",
         "{tmp}/data/cifar-10-batches-py/data_batch_1",
         files=cifar10_set("data", data_batch_1=evil_batch(os.system, touch_marker)), absent=("PWNED",)),
    Case("data-cifar-pickle-builtins-exec", ("run", "dataset=cifar10", "data_dir={tmp}/data"), 2,
         r"test_batch: refusing to unpickle global (builtins|__builtin__)\.exec", "{tmp}/data/cifar-10-batches-py/test_batch",
         files=cifar10_set("data", test_batch=evil_batch(builtins.exec, write_marker)), absent=("PWNED",)),
    Case("data-cifar-not-a-pickle", ("run", "dataset=cifar10", "data_dir={tmp}/data"), 2,
         r"data_batch_2 is not a readable CIFAR batch: UnpicklingError", "{tmp}/data/cifar-10-batches-py/data_batch_2",
         files=cifar10_set("data", data_batch_2=b"<html>404 not found</html>")),
    Case("data-cifar-missing-batch", ("run", "dataset=cifar10", "data_dir={tmp}/data"), 2,
         r"cifar10: missing .*data_batch_5\. Looked in .*cifar-10-batches-py\. .*download=True",
         "{tmp}/data/cifar-10-batches-py/data_batch_5",
         files={k: v for k, v in cifar10_set("data").items() if not k.endswith("data_batch_5")}),
    # ---- sweeps
    Case("sweep-file-missing", ("sweep", "{tmp}/nope.toml"), 2,
         r"sweep file '.*nope\.toml' does not exist", "{tmp}/nope.toml"),
    Case("sweep-zip-not-tables", ("sweep", "{tmp}/s.toml", "--dry-run"), 2,
         r"sweep 'zip' must be tables \(\[\[zip\]\] groups of config keys\), got \[1, 2\]", "[1, 2]",
         files={"s.toml": "zip = [1, 2]\n[grid]\nseed = [0]\n"}),
    Case("sweep-base-file-not-a-path", ("sweep", "{tmp}/s.toml", "--dry-run"), 2,
         r"sweep base\.file must be a config file path \(a string\), got 3$", "got 3",
         files={"s.toml": "[base]\nfile = 3\n"}),
    Case("sweep-grid-negative-lr", ("sweep", "{tmp}/s.toml", "--out", "{tmp}/sw", "--dry-run"), 2,
         r"lr must be a finite number > 0, got -1", "-1", files={"s.toml": "[grid]\nlr = [0.1, -1]\n"}),
    # ---- CLI misuse
    Case("cli-unknown-verb", ("frobnicate",), 2, r"^cdsgd: error: argument VERB: invalid choice: 'frobnicate'",
         "'frobnicate'"),
    Case("cli-launch-missing-nproc", ("launch",), 2,
         r"^cdsgd launch: error: the following arguments are required: --nproc-per-node", "--nproc-per-node"),
    Case("cli-launch-nproc-zero", ("launch", "--nproc-per-node", "0"), 2,
         r"--nproc-per-node must be >= 1, got 0$", "--nproc-per-node"),
    Case("cli-run-stray-argument", ("run", "{tmp}/c.toml", "lenet"), 2,
         r"expected key=value after the config file, got 'lenet'", "'lenet'", files={"c.toml": "lr = 0.1\n"}),
    Case("cli-topo-param-without-value", ("topo", "ring", "--n", "5", "--param", "k"), 2,
         r"--param expects KEY=VALUE, got 'k'", "'k'"),
    Case("cli-plot-folder-without-run", ("plot", "{tmp}/empty"), 2,
         r"empty holds no run to plot: no metrics\.csv .* lists no run", "{tmp}/empty",
         files={"empty": None}),
    Case("cli-plot-not-a-folder", ("plot", "{tmp}/nowhere"), 2, r"'.*nowhere' is not a folder", "{tmp}/nowhere"),
    Case("cli-plot-foreign-metrics-csv", ("plot", "{tmp}/r"), 2,
         r"metrics\.csv lacks the column\(s\) epoch, .*; not a CSV file written by cdsgd \(found: a, b\)",
         "{tmp}/r/metrics.csv", files={"r/metrics.csv": "a,b\n1,2\n"}),
    # ---- churn and elastic membership
    Case("churn-membership-misspelt", ("run", "membership=elastc", "out={tmp}/out"), 2,
         r"membership 'elastc' is unknown" + SUGGEST.format("elastic"), "'elastc'", absent=("out",)),
    Case("churn-rate-one", ("run", "membership=elastic", "network_params={churn = 1.0}", "out={tmp}/out"), 2,
         r"network_params\.churn = 1\.0 is out of range: .*\[0, 1\)", "1.0", absent=("out",)),
    Case("churn-trace-unknown-agent", ("run", "membership=elastic", "n_agents=4",
                                       "network_params={churn_trace = '{tmp}/t.csv'}", "out={tmp}/out"), 2,
         r"churn trace row 1 names agent 9; the agents are 0\.\.3", "agent 9",
         files={"t.csv": "agent,leave_step,return_step\n9,2,5\n"}, absent=("out",)),
    Case("churn-trace-returns-before-leaving", ("run", "membership=elastic",
                                                "network_params={churn_trace = '{tmp}/t.csv'}", "out={tmp}/out"), 2,
         r"agent 1 returns at step 2, not after it left \(step 6\)", "step 2",
         files={"t.csv": "agent,leave_step,return_step\n1,6,2\n"}, absent=("out",)),
    Case("churn-elastic-rule-that-cannot", ("run", "membership=elastic", "algorithm=relaysum", "out={tmp}/out"), 2,
         r"algorithm 'relaysum' cannot go on when agents leave and return \(its relayed sums pass through every "
         r"agent of one spanning tree\)", "'relaysum'", absent=("out",)),
]

#: cases also run as a real ``python -m cdsgd`` subprocess
SUBPROCESS = ["config-unknown-key", "graph-directed-graphml", "data-cifar-pickle-os-system", "cli-unknown-verb"]


def _params(cases):
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
            for c in cases]


def _make_files(case: Case, tmp: Path) -> None:
    for rel, content in case.files.items():
        path = tmp / rel
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content = content(tmp)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


#: appended to every ``cdsgd run``: should a bad input slip through, the run is one step, not 30 epochs
TINY_RUN = ("epochs=0.01", "test_subset=20")


def _argv(case: Case, tmp: Path) -> list[str]:
    argv = [_fill(a, tmp) for a in case.argv]
    return argv + list(TINY_RUN) if argv[0] == "run" else argv


def _error_lines(stderr: str) -> list[str]:
    """stderr's lines without argparse's usage block ("usage: ..." and its indented continuation)."""
    lines, in_usage = [], False
    for line in stderr.splitlines():
        if line.startswith("usage:"):
            in_usage = True
        elif in_usage and line.startswith(" "):
            pass
        else:
            in_usage = False
            if line.strip():
                lines.append(line)
    return lines


def _check(case: Case, tmp: Path, status, out: str, err: str) -> None:
    assert "Traceback" not in err, err
    assert status == case.status, f"exit status {status}, expected {case.status}; stderr:\n{err}"
    lines = _error_lines(err)
    assert len(lines) == 1, f"expected ONE error line, got {len(lines)}:\n{err}"
    line = lines[0]
    verb = case.argv[0]
    assert line.startswith(("cdsgd: error: ", f"cdsgd {verb}: error: ")), line
    assert re.search(case.error, line), f"{case.error!r} not found in {line!r}"
    assert _fill(case.bad, tmp) in line, f"the bad value {_fill(case.bad, tmp)!r} is not named in {line!r}"
    assert out == "", f"a failing command printed to stdout: {out!r}"
    for rel in case.absent:
        assert not (tmp / rel).exists(), f"{rel} was created: the bad input had a side effect"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Run in tmp_path (default outputs land there), outside any torchrun environment."""
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input(case: Case, sandbox: Path, monkeypatch, capsys):
    _make_files(case, sandbox)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    try:
        status = main(_argv(case, sandbox))
    except SystemExit as e:  # argparse refuses the command line itself
        status = e.code
    captured = capsys.readouterr()
    _check(case, sandbox, status, captured.out, captured.err)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.id in SUBPROCESS]))
def test_bad_input_in_a_real_process(case: Case, sandbox: Path):
    """As the user sees it: ``python -m cdsgd ...`` prints one line, no traceback."""
    _make_files(case, sandbox)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(case.env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-m", "cdsgd", *_argv(case, sandbox)],
                       capture_output=True, text=True, cwd=sandbox, env=env, timeout=120, check=False)
    _check(case, sandbox, r.returncode, r.stdout, r.stderr)


def test_the_malicious_pickles_are_live(tmp_path):
    """The CIFAR cases prove something only if their pickles would write the marker when loaded naively."""
    for make in (touch_marker, write_marker):
        pickle.loads(evil_batch(os.system if make is touch_marker else builtins.exec, make)(tmp_path))
        assert (tmp_path / "PWNED").exists()
        (tmp_path / "PWNED").unlink()
    assert len(CASES) >= 32 and len({c.id for c in CASES}) == len(CASES)
