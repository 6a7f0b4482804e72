r"""The executor's meters: each watches one thing about the held agents and owns its state.

* :class:`StepTimer`: measured time. A process's first step pays for
  compilation and first calls (the ``vmap`` strategy: about 0.9 s against
  2 ms for a later step of the digits MLP): its seconds are
  ``warmup_seconds``; ``train_seconds`` (each row's ``wall_seconds``, the
  ETA) counts the later steps only. Evaluation time is kept apart too.
* :class:`LossMeter`: each held agent's training-loss sum and count since
  the last evaluation (summed per agent, so that a row does not depend on
  how agents are spread over processes).
* :class:`NonFiniteWatch`: each held agent's first step with a non-finite
  batch loss or parameter.
* :class:`ModelStats`: statistics the models report through their own hook
  (:data:`cdsgd.models.STAT_PROVIDERS`); this module names no model.

Each has ``state_dict()`` / ``load_state_dict()``; :class:`Meters` holds them
and its state is the dict of theirs.

    >>> t = StepTimer()
    >>> for s in (0.9, 0.002, 0.002):
    ...     t.charge(s)
    >>> t.warmup_seconds, t.train_seconds, t.timed_steps
    (0.9, 0.004, 2)
"""

from __future__ import annotations

import torch

from ..models import STAT_PROVIDERS
from .gradients import nonfinite_rows

__all__ = ["LossMeter", "Meters", "ModelStats", "NonFiniteWatch", "StepTimer"]


class StepTimer:
    """Seconds of training (after the warm-up step), of the warm-up step, and of evaluation."""

    def __init__(self) -> None:
        self.train_seconds = 0.0
        #: seconds of the first step this process ran (compilation, first calls): not in train_seconds
        self.warmup_seconds = 0.0
        #: the steps counted in train_seconds
        self.timed_steps = 0
        #: seconds spent in evaluation (not in train_seconds)
        self.eval_seconds = 0.0
        self.warm = False

    def charge(self, seconds: float) -> None:
        """One step's ``seconds``: this process's first to ``warmup_seconds``, every later one to training."""
        if self.warm:
            self.train_seconds += seconds
            self.timed_steps += 1
        else:
            self.warmup_seconds += seconds
            self.warm = True

    def state_dict(self) -> dict:
        return {"train_seconds": self.train_seconds, "warmup_seconds": self.warmup_seconds, "timed_steps": self.timed_steps,
                "eval_seconds": self.eval_seconds}

    def load_state_dict(self, state: dict) -> None:
        """A resumed process warms up again: its first step is warm-up (``warm`` stays false)."""
        self.train_seconds = float(state["train_seconds"])
        self.warmup_seconds = float(state["warmup_seconds"])
        self.timed_steps = int(state["timed_steps"])
        self.eval_seconds = float(state["eval_seconds"])


class LossMeter:
    """Each held agent's train-loss sum and count since the last :meth:`take`, and the last step's mean."""

    def __init__(self, held: int) -> None:
        self.sums = torch.zeros(held, dtype=torch.float64)
        self.counts = torch.zeros(held, dtype=torch.float64)
        #: the mean batch loss of the agents held here at the last step (NaN if none stepped)
        self.last = float("nan")

    def add(self, active: list[int], losses: torch.Tensor) -> None:
        """One step: the batch ``losses`` (float64, CPU) of the held agents ``active``."""
        self.sums[active] += losses
        self.counts[active] += 1
        self.last = float(losses.mean()) if active else float("nan")

    def add_one(self, i: int, loss: float) -> None:
        """One batch ``loss`` of held agent ``i`` (an asynchronous event; :attr:`last` is the caller's)."""
        self.sums[i] += loss
        self.counts[i] += 1

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, counts) since the last call, then reset."""
        out = self.sums.clone(), self.counts.clone()
        self.sums.zero_()
        self.counts.zero_()
        return out

    def state_dict(self) -> dict:
        return {"loss_sums": self.sums.clone(), "loss_counts": self.counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.sums.copy_(state["loss_sums"])
        self.counts.copy_(state["loss_counts"])


class NonFiniteWatch:
    """Each held agent's first non-finite step (0: none) and whether its parameters (1) or loss (0) were so."""

    def __init__(self, held: int, X: torch.Tensor) -> None:
        #: L×2 float64: (first non-finite step or 0, 1 if the parameters were non-finite else 0)
        self.first = torch.zeros(held, 2, dtype=torch.float64)
        self._row_sums = X.new_empty(held, dtype=torch.promote_types(X.dtype, torch.float32))

    @property
    def any(self) -> bool:
        """Whether a held agent has met a non-finite loss or parameter."""
        return bool(self.first[:, 0].any())

    def check(self, active: list[int], losses: torch.Tensor, X: torch.Tensor, k: int) -> None:
        """Note each held agent's first step ``k`` with a non-finite batch loss or parameter (one reduction)."""
        if bool(self.first[:, 0].all()):
            return  # every held agent is noted already
        held = len(self.first)
        bad_loss = torch.zeros(held, dtype=torch.bool)
        bad_loss[active] = ~torch.isfinite(losses)
        todo = ~bad_loss & (self.first[:, 0] == 0)  # the rows whose parameters are still to look at
        bad = bad_loss | nonfinite_rows(X.reshape(held, -1), self._row_sums, todo)
        new = bad & (self.first[:, 0] == 0)
        self.first[new, 0] = k
        self.first[new, 1] = (~bad_loss[new]).double()

    def state_dict(self) -> dict:
        return {"nonfinite": self.first.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.first.copy_(state["nonfinite"])


class ModelStats:
    """Statistics the held agents' models report through their own hook, one block of columns per provider.

    A provider (a class in :data:`cdsgd.models.STAT_PROVIDERS`) declares ``stat_keys`` (the per-agent
    figures its ``take_stats()`` returns, then resets), ``combine_stats(a, b)`` (two such modules of
    one agent), ``stat_columns`` (its metrics.csv columns) and ``stats_row(every)`` (the columns from
    the N×len(stat_keys) figures of all agents). A model without such a module gives zeros, and the
    provider's ``stats_row`` says what a row without any is (NaN for MGRIT's).
    """

    def __init__(self, models) -> None:
        self.models = list(models)
        #: the width of :meth:`take`'s rows
        self.width = sum(len(p.stat_keys) for p in STAT_PROVIDERS)

    @staticmethod
    def columns() -> tuple[str, ...]:
        """The metrics columns of every provider, in order."""
        return tuple(c for p in STAT_PROVIDERS for c in p.stat_columns)

    def take(self, held: int) -> torch.Tensor:
        """The L×width figures of the held agents since the last call (zeros where the models are shared)."""
        out = torch.zeros(held, self.width, dtype=torch.float64)
        if len(self.models) != held:  # vmap: one template serves every agent; it reports nothing per agent
            return out
        for i, model in enumerate(self.models):
            row = []
            for p in STAT_PROVIDERS:
                acc = [0.0] * len(p.stat_keys)
                for m in model.modules():
                    if isinstance(m, p):
                        acc = p.combine_stats(acc, m.take_stats())
                row += acc
            out[i] = torch.tensor(row, dtype=torch.float64)
        return out

    @staticmethod
    def row(every: torch.Tensor) -> dict:
        """The metrics columns from the N×width figures of all agents."""
        out, start = {}, 0
        for p in STAT_PROVIDERS:
            out.update(p.stats_row(every[:, start:start + len(p.stat_keys)]))
            start += len(p.stat_keys)
        return out


class Meters:
    """The executor's meters: ``timer``, ``loss``, ``nonfinite``, ``stats`` and the simulated ``clock`` (or None)."""

    def __init__(self, held: int, X: torch.Tensor, models) -> None:
        self.timer = StepTimer()
        self.loss = LossMeter(held)
        self.nonfinite = NonFiniteWatch(held, X)
        self.stats = ModelStats(models)
        #: the simulated network's clock (:class:`cdsgd.executor.timing.ClockFeed`), or None
        self.clock = None

    def state_dict(self) -> dict:
        return {"timer": self.timer.state_dict(), "loss": self.loss.state_dict(),
                "nonfinite": self.nonfinite.state_dict(),
                "network": None if self.clock is None else self.clock.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.timer.load_state_dict(state["timer"])
        self.loss.load_state_dict(state["loss"])
        self.nonfinite.load_state_dict(state["nonfinite"])
        if (state.get("network") is None) != (self.clock is None):
            raise ValueError("checkpoint and this run differ in their simulated network (one has a clock, the "
                             "other none); resume with the network of the checkpoint's run")
        if self.clock is not None:
            self.clock.load_state_dict(state["network"])
