r"""The single-process simulator: all N agents stacked in one process.

This is :class:`cdsgd.executor.Executor` holding every agent, with the dense
or sparse in-process Mixer; the names below are re-exported from
:mod:`cdsgd.executor` (their home) so that ``from cdsgd.simulator import
Simulator`` keeps working. The semantics (synchronous steps, per-agent
streams, strategies, metrics) are documented there.

Example (4 agents on a ring learn a linear classifier)::

    >>> import torch, topologies
    >>> from torch import nn
    >>> g = torch.Generator().manual_seed(0)
    >>> Xs = torch.randn(400, 5, generator=g); ys = (Xs[:, 0] > 0).long()
    >>> shards = [(Xs[i::4], ys[i::4]) for i in range(4)]
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> result = simulate(lambda: nn.Linear(5, 2), shards, W, "cdsgd", lr=0.5,
    ...                   epochs=5, batch_size=20, test_set=(Xs, ys))
    >>> result.metrics[-1]["test_accuracy"] > 0.9, result.params.shape
    (True, torch.Size([4, 12]))
"""

from .executor import (
    INITS,
    METRIC_COLUMNS,
    STRATEGIES,
    BatchStream,
    Executor,
    Reducer,
    SimulationResult,
    Simulator,
    simulate,
)
from .flat import ParamLayout

__all__ = [
    "BatchStream",
    "Executor",
    "INITS",
    "METRIC_COLUMNS",
    "ParamLayout",
    "Reducer",
    "STRATEGIES",
    "SimulationResult",
    "Simulator",
    "simulate",
]
