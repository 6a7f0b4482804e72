"""cdsgd: decentralized collaborative learning over a fixed communication graph.

N agents train one model together, each exchanging parameters only with its
graph neighbours (CDSGD/CDMSGD, Jiang et al., NIPS 2017). Graphs and mixing
matrices live in the sibling package :mod:`topologies`.

This is the public front: what a user needs, importable from ``cdsgd``
itself, loaded lazily (``import cdsgd`` imports neither torch nor an
optional extra; a name's module loads on first use). Stacked over agents
every algorithm is ``X ← Π X − α G(X)``:

=========================  ===================================================
simulate, Simulator        all agents in one process (:mod:`cdsgd.executor`)
Executor, SimulationResult
make_algorithm, Algorithm  update rules on stacked flat parameters
ALGORITHMS                 (:mod:`cdsgd.algorithms`)
CDSGD, CDMSGD,             the same rules as ``torch.optim`` optimizers for
DecentralizedOptimizer     one agent in a user's own loop
make_mixer, Mixer,         Π X in-process (:mod:`cdsgd.mixers`); make_mixer is
MatrixMixer, ScheduleMixer the one way from a matrix, schedule or None to a mixer
NeighbourMixer, BlockMixer Π X across torch.distributed ranks (:mod:`cdsgd.runtime`)
Config, load_config        the typed config (:mod:`cdsgd.config`)
validate_config,           one run as ``cdsgd run`` does it (:mod:`cdsgd.run`)
run_experiment
build_model, MODELS        the paper's networks (:mod:`cdsgd.models`)
load_dataset, partition    data sets and partitions (:mod:`cdsgd.data`)
=========================  ===================================================

Example (4 agents on a ring learn a linear classifier)::

    >>> import torch, topologies, cdsgd
    >>> from torch import nn
    >>> g = torch.Generator().manual_seed(0)
    >>> Xs = torch.randn(400, 5, generator=g); ys = (Xs[:, 0] > 0).long()
    >>> shards = [(Xs[i::4], ys[i::4]) for i in range(4)]
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> result = cdsgd.simulate(lambda: nn.Linear(5, 2), shards, W, "cdsgd", lr=0.5,
    ...                         epochs=5, batch_size=20, test_set=(Xs, ys))
    >>> result.metrics[-1]["test_accuracy"] > 0.9, result.params.shape
    (True, torch.Size([4, 12]))
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

#: public name → the module that defines it (imported on first use)
_HOMES = {
    "simulate": "cdsgd.executor",
    "Simulator": "cdsgd.executor",
    "Executor": "cdsgd.executor",
    "SimulationResult": "cdsgd.executor",
    "make_algorithm": "cdsgd.algorithms",
    "Algorithm": "cdsgd.algorithms",
    "ALGORITHMS": "cdsgd.algorithms",
    "CDSGD": "cdsgd.algorithms",
    "CDMSGD": "cdsgd.algorithms",
    "DecentralizedOptimizer": "cdsgd.algorithms",
    "Mixer": "cdsgd.mixers",
    "make_mixer": "cdsgd.mixers",
    "MatrixMixer": "cdsgd.mixers",
    "ScheduleMixer": "cdsgd.mixers",
    "NeighbourMixer": "cdsgd.runtime",
    "BlockMixer": "cdsgd.runtime",
    "Config": "cdsgd.config",
    "load_config": "cdsgd.config",
    "validate_config": "cdsgd.run.plan",
    "run_experiment": "cdsgd.run.experiment",
    "build_model": "cdsgd.models",
    "MODELS": "cdsgd.models",
    "load_dataset": "cdsgd.data",
    "partition": "cdsgd.data",
}

__all__ = ["__version__", *_HOMES]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cdsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
