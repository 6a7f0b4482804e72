r"""What MGRIT's solves did during training, and how far its gradients are from the serial ones.

:class:`SolveLog` counts the solves of one :class:`~cdsgd.mgrit.ParallelGRU`
since they were last taken (the V-cycles, the largest relative residual of
the states and adjoints used, the solves that fell back to the serial loop)
and keeps the back-off: after a solve falls back, the next ``k`` solves in
that direction (forward or adjoint) go straight to the serial loop, ``k``
doubling (1, 2, 4, …, :attr:`SolveLog.MAX_BACKOFF`) while attempts keep
failing and resetting to 1 after one converges. Training thus pays for
failed MGRIT attempts only now and then while the learned dynamics defeat
MGRIT, and returns to MGRIT when they stop doing so.

:func:`gradient_error` runs one loss twice, through MGRIT and through the
serial loop, and compares the parameter gradients: the monitor that tells
whether MGRIT's gradients can be trusted on a batch.

>>> import torch
>>> from cdsgd.mgrit import ParallelGRU
>>> _ = torch.manual_seed(0); gru = ParallelGRU(2, 8, cf=4, iters=8, rtol=1e-6)
>>> x = torch.randn(3, 32, 2)
>>> err = gradient_error(gru, lambda: gru(x)[0].square().mean())
>>> err["cosine"] > 0.999999, abs(err["norm_ratio"] - 1) < 1e-4
(True, True)
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

__all__ = ["SolveLog", "gradient_error"]

DIRECTIONS = ("forward", "backward")


class SolveLog:
    """Counts of one layer's solves since :meth:`take`, and the back-off after fall-backs (see module)."""

    MAX_BACKOFF = 32

    def __init__(self) -> None:
        self._skip = dict.fromkeys(DIRECTIONS, 0)
        self._backoff = dict.fromkeys(DIRECTIONS, 1)
        self.take()

    def plan(self, directions=DIRECTIONS) -> set[str]:
        """Which of the next call's ``directions`` go to the serial loop (each consumes one back-off step).

        A call without autograd solves only ``{"forward"}``: it must not use up the adjoint's back-off.
        """
        serial = {d for d in directions if self._skip[d] > 0}
        for d in serial:
            self._skip[d] -= 1
        return serial

    def record(self, direction: str, info: dict, counted: bool = True) -> None:
        """Hear of one solve (``info`` from the solver); ``counted`` False updates only the back-off."""
        if info["fallback"]:
            self._skip[direction] = self._backoff[direction]
            self._backoff[direction] = min(2 * self._backoff[direction], self.MAX_BACKOFF)
        elif not info["serial"]:
            self._backoff[direction] = 1
        if not counted:
            return
        c = self.counts
        c["solves"] += 1
        if info["serial"] or info["fallback"]:
            c["fallbacks"] += 1
        if not info["serial"]:
            c["mgrit_solves"] += 1
            c["iters"] += info["iters"]
        # a fixed-iteration solve (no rtol) has no relative residual: the figure is then unknown (nan), not 0
        c["residual"] = math.nan if math.isnan(c["residual"]) or math.isnan(info["residual"]) \
            else max(c["residual"], info["residual"])

    def take(self) -> dict:
        """The counts since the last call (``solves``, ``mgrit_solves``, ``iters``, ``fallbacks``,
        ``residual``: the largest relative residual of the solutions used, 0 for serial ones, nan when a
        fixed-iteration solve had none), then reset them."""
        out = getattr(self, "counts", None)
        self.counts = {"solves": 0, "mgrit_solves": 0, "iters": 0, "fallbacks": 0, "residual": 0.0}
        return out


def gradient_error(module: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> dict:
    r"""MGRIT's parameter gradients against the serial loop's, for the loss ``loss_fn()``.

    Every :class:`~cdsgd.mgrit.ParallelGRU` inside ``module`` runs once in
    ``mgrit`` mode and once in ``serial`` mode (then gets its mode back); g_m
    and g_s are the gradients of all of ``module``'s parameters. Returns
    ``cosine`` = ⟨g_m, g_s⟩/(‖g_m‖‖g_s‖), ``norm_ratio`` = ‖g_m‖/‖g_s‖,
    ``rel_error`` = ‖g_m − g_s‖/‖g_s‖ and both losses. The parameters'
    ``.grad`` are left as they were.
    """
    layers = [m for m in module.modules() if isinstance(getattr(m, "solve_log", None), SolveLog)]  # ParallelGRUs
    if not layers:
        raise ValueError(f"gradient_error needs a module holding a ParallelGRU, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    modes = [m.mode for m in layers]
    out = {}
    try:
        for mode in ("mgrit", "serial"):
            for m in layers:
                m.mode = mode
            loss = loss_fn()
            out[mode] = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in
                                   zip(torch.autograd.grad(loss, params, allow_unused=True), params)])
            out["loss_" + mode] = float(loss.detach())
    finally:
        for m, mode in zip(layers, modes):
            m.mode = mode
    gm, gs = out.pop("mgrit").double(), out.pop("serial").double()
    scale = float(gs.norm())
    return {"cosine": float(gm @ gs) / max(float(gm.norm()) * scale, 1e-300),
            "norm_ratio": float(gm.norm()) / max(scale, 1e-300),
            "rel_error": float((gm - gs).norm()) / max(scale, 1e-300), **out}
