r"""Step sizes α_k: a schedule, a linear warm-up on top, and the horizon a cosine decays over.

k counts the rule's steps from 0 (for ``adpsgd``, agent i's own count of gradients applied).

``constant``     α_k = α₀
``diminishing``  α_k = α₀ / (1 + k/τ)^p with 0.5 < p ≤ 1 (``lr_tau`` τ, ``lr_power`` p), so that
                 Σ_k α_k = ∞ and Σ_k α_k² < ∞ (the condition under which CDSGD reaches exact consensus)
``cosine``       α_k = α_min + (α₀ − α_min)·½(1 + cos(π·min(k, K)/K)) (Loshchilov & Hutter, "SGDR",
                 ICLR 2017, without restarts): α₀ at k = 0, α_min (``lr_min``) from k = K on. K is
                 ``lr_decay_steps`` when given, else the run's total steps, which the executor tells the
                 rule when it runs (:meth:`Algorithm.bind <cdsgd.algorithms.Algorithm.bind>`'s
                 ``total_steps``: the step at which :meth:`Executor.run <cdsgd.executor.Executor.run>`
                 ends); with neither (an optimizer class in a loop of your own) it is refused, asking for
                 ``lr_decay_steps``
``step``         α_k = α₀·γ^⌊k/s⌋ (``lr_gamma`` γ, ``lr_step_size`` s; torch's ``StepLR``)

**Warm-up** (``lr_warmup`` w ≥ 0, every schedule): α_k is scaled by (k + 1)/w for k < w, so the first
step takes α₀/w and step w − 1 the schedule's full value; the schedule itself runs from k = 0 as
without warm-up (a cosine's K still counts the warm-up steps).

>>> s = StepSize(0.1, "diminishing", tau=10, power=1.0)
>>> [round(s(k), 4) for k in (0, 10, 30)]
[0.1, 0.05, 0.025]
>>> c = StepSize(1.0, "cosine", lr_min=0.1, decay_steps=4, warmup=2)
>>> [round(c(k), 4) for k in range(6)]   # warm-up halves step 0; K = 4; α_min after
[0.5, 0.8682, 0.55, 0.2318, 0.1, 0.1]
>>> [StepSize(1.0, "step", step_size=2, gamma=0.5)(k) for k in range(5)]
[1.0, 1.0, 0.5, 0.5, 0.25]
>>> StepSize(1.0, "cosine")(0)
Traceback (most recent call last):
...
ValueError: lr_schedule 'cosine' needs its horizon K: give lr_decay_steps (steps), or run the rule in an executor, which gives it the run's total steps
"""

from __future__ import annotations

import math

from ..base.checks import (HYPER_DEFAULTS, LR_GAMMA, LR_MIN, LR_POWER, LR_SCHEDULES, LR_TAU, check_int,
                           check_lr)

__all__ = ["StepSize"]


class StepSize:
    """α_k of one rule (module docstring): ``StepSize(lr, schedule, *, tau, power, lr_min, decay_steps,
    step_size, gamma, warmup)``, each keyword the config key ``lr_<name>`` (``lr_min`` itself).

    ``lr`` is public and may change during a run (:class:`~cdsgd.algorithms.DecentralizedOptimizer` sets
    it from ``param_groups``); ``total_steps`` is the run's (None until an executor's run says it).
    """

    SCHEDULES = LR_SCHEDULES.names

    def __init__(self, lr: float, schedule: str = HYPER_DEFAULTS["lr_schedule"], *,
                 tau: float = HYPER_DEFAULTS["lr_tau"], power: float = HYPER_DEFAULTS["lr_power"],
                 lr_min: float = HYPER_DEFAULTS["lr_min"], decay_steps: int | None = HYPER_DEFAULTS["lr_decay_steps"],
                 step_size: int = HYPER_DEFAULTS["lr_step_size"], gamma: float = HYPER_DEFAULTS["lr_gamma"],
                 warmup: int = HYPER_DEFAULTS["lr_warmup"]) -> None:
        self.lr = check_lr(lr)
        self.schedule = LR_SCHEDULES.check("lr_schedule", schedule)
        self.tau = float(LR_TAU.check("lr_tau", tau))
        self.power = float(LR_POWER.check("lr_power", power))
        self.lr_min = float(LR_MIN.check("lr_min", lr_min))
        if self.schedule == "cosine" and self.lr_min > self.lr:
            raise ValueError(f"lr_min must be <= lr ({self.lr:g}) for lr_schedule 'cosine', got {lr_min!r}")
        self.decay_steps = None if decay_steps is None else check_int("lr_decay_steps", decay_steps, 1)
        self.step_size = check_int("lr_step_size", step_size, 1)
        self.gamma = float(LR_GAMMA.check("lr_gamma", gamma))
        self.warmup = check_int("lr_warmup", warmup, 0)
        #: the run's total steps (a cosine's K when ``decay_steps`` is None); set by Algorithm.bind
        self.total_steps: int | None = None

    def horizon(self) -> int:
        """K of the cosine: ``decay_steps``, else the run's ``total_steps``; a ValueError when neither is known."""
        K = self.decay_steps if self.decay_steps is not None else self.total_steps
        if K is None:
            raise ValueError("lr_schedule 'cosine' needs its horizon K: give lr_decay_steps (steps), or run the "
                             "rule in an executor, which gives it the run's total steps")
        return K

    def __call__(self, k: int) -> float:
        if self.schedule == "constant":
            alpha = self.lr
        elif self.schedule == "diminishing":
            alpha = self.lr / (1.0 + k / self.tau) ** self.power
        elif self.schedule == "cosine":
            K = self.horizon()
            alpha = self.lr_min + (self.lr - self.lr_min) * 0.5 * (1.0 + math.cos(math.pi * min(k, K) / K))
        else:  # step
            alpha = self.lr * self.gamma ** (k // self.step_size)
        if k < self.warmup:
            alpha *= (k + 1) / self.warmup
        return alpha
