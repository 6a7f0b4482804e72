"""The friendliest door: :func:`simulate` builds an executor for a rule (:meth:`Executor.build`, or
:class:`~cdsgd.executor.asynchronous.AsyncExecutor`'s for an asynchronous rule) and runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..algorithms import ALGORITHMS, Algorithm
from .asynchronous import executor_class
from .core import Executor

__all__ = ["SimulationResult", "simulate"]


@dataclass
class SimulationResult:
    """What :func:`simulate` returns."""

    #: one dict per evaluation with the keys of METRIC_COLUMNS
    metrics: list[dict]
    #: final N×P parameters
    params: torch.Tensor
    simulator: "Executor" = field(repr=False)



def simulate(model_fn: Callable[[], nn.Module], shards: Sequence[tuple[torch.Tensor, torch.Tensor]], W=None,
             algorithm: str | Algorithm = "cdmsgd", *, epochs: float | None = None, steps: int | None = None,
             eval_every_steps: int | None = None, **options) -> SimulationResult:
    """Run the simulator on your own model, loss and per-agent data, evaluating every ``eval_every_steps`` steps.

    An asynchronous rule (``adpsgd``) runs in :class:`~cdsgd.executor.asynchronous.AsyncExecutor`.
    ``options`` are :meth:`Executor.build`'s keyword arguments (``batch_size``,
    ``seed``, ``test_set``, ``loss_fn``, ...) and the algorithm's
    hyperparameters (``lr``, ``momentum``, ...). Returns the metrics rows and
    the final N×P parameters (row j is agent j; ``result.simulator.layout``
    maps them back to named tensors).
    """
    rule = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else algorithm
    sim = executor_class(rule).build(model_fn, shards, W, algorithm, **options)  # AsyncExecutor for adpsgd
    metrics = sim.run(epochs=epochs, steps=steps, eval_every_steps=eval_every_steps)
    return SimulationResult(metrics=metrics, params=sim.X.clone(), simulator=sim)
