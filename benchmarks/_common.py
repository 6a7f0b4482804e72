"""What every benchmark script shares: the repository on sys.path, and the synthetic workload's shape.

A script does ``from _common import ROOT, ...`` first (its own folder is on
sys.path when it runs as ``python benchmarks/NAME.py``), so that ``cdsgd``
and ``topologies`` import from this checkout even when not installed.

The synthetic workload of the step-rate benchmarks (simulator, comm, scale):
MNIST-shaped inputs, 10 classes, ``SHARD`` samples per agent in batches of
``BATCH``; :func:`make_shards` draws it.
"""

from __future__ import annotations

import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: one sample's shape and the class count of the synthetic workload
INPUT_SHAPE = (1, 28, 28)
N_CLASSES = 10
#: per agent: samples in its shard, samples per batch
SHARD = 64
BATCH = 32
#: where Debian's dataset-fashion-mnist puts its files
FASHION = pathlib.Path("/usr/share/datasets/fashion-mnist")


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_shards(n: int, gen):
    """``n`` shards of SHARD random inputs and labels drawn from the torch generator ``gen``."""
    import torch

    return [(torch.randn(SHARD, *INPUT_SHAPE, generator=gen), torch.randint(0, N_CLASSES, (SHARD,), generator=gen))
            for _ in range(n)]
