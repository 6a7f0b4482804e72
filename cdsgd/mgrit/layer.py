r"""The trainable layer: MGRIT forward and adjoint as one autograd function, and ``ParallelGRU``.

:func:`mgrit_gru` returns the states of an MGRIT solve as a differentiable
tensor whose backward is the MGRIT adjoint solve (:mod:`cdsgd.mgrit.solver`);
:class:`ParallelGRU` wraps it as a drop-in ``nn.GRU``-like module that can
also run the serial loop. The maths: :mod:`cdsgd.mgrit`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .cell import ImplicitGRUCell, _check_x_h0, serial_forward
from .monitor import DIRECTIONS, SolveLog
from .solver import _adjoint_solve, _check_length, _check_options, _forward_solve, _gradients, _summary

__all__ = ["ParallelGRU", "mgrit_gru"]


class _MGRITGRU(torch.autograd.Function):
    """Forward: MGRIT state solve. Backward: MGRIT adjoint solve + batched parameter/input gradients.

    ``stats["serial"]`` (a set of "forward"/"backward") asks for the serial
    solve instead; ``stats["on_solve"](direction, info)``, if given, hears of each solve.
    """

    @staticmethod
    def forward(ctx, x, h0, weight_ih, weight_hh, bias_ih, bias_hh, cell, opts, stats):
        u, info = _forward_solve(cell, x, h0, *opts, serial="forward" in stats.get("serial", ()))
        _report(stats, "forward", info)
        ctx.save_for_backward(x, u)
        ctx.cell, ctx.opts, ctx.stats = cell, opts, stats
        return u[1:].transpose(0, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gH):
        x, u = ctx.saved_tensors
        lam, lin, info = _adjoint_solve(ctx.cell, x, u, gH.transpose(0, 1).to(x.dtype), *ctx.opts,
                                        serial="backward" in ctx.stats.get("serial", ()))
        _report(ctx.stats, "backward", info)
        g = _gradients(ctx.cell, x, u, lam, lin)
        return (*g, None, None, None)


def _report(stats: dict, direction: str, info: dict) -> None:
    stats[direction] = info["norms"]
    stats[direction + "_info"] = _summary(info)
    if "on_solve" in stats:
        stats["on_solve"](direction, info)


def mgrit_gru(cell: ImplicitGRUCell, x: torch.Tensor, h0: torch.Tensor | None = None, *, cf: int = 4,
              levels: int = 2, iters: int = 2, tol: float | None = None, fcf: bool = True,
              rtol: float | None = None, fallback: bool = False, coarse: str = "euler",
              stats: dict | None = None) -> torch.Tensor:
    """States (B, T, H) by MGRIT, differentiable: backward runs the MGRIT adjoint (same options).

    The options are :func:`~cdsgd.mgrit.mgrit_forward`'s. If ``stats`` is a
    dict, its ``"forward"`` and (after backward) ``"backward"`` entries
    receive the residual norms, ``"forward_info"`` and ``"backward_info"``
    the iterations, relative residual and whether the solve fell back to the
    serial loop. A set ``stats["serial"]`` naming ``"forward"`` and/or
    ``"backward"`` solves those by the serial loop (exact, no MGRIT): what a
    fall-back runs.
    """
    h0 = _check_x_h0(cell, x, h0)
    _check_options(cf, levels, iters, tol, fcf, rtol, fallback, coarse)
    _check_length(x.shape[1], cf, levels)
    return _MGRITGRU.apply(x, h0, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh, cell,
                           (cf, levels, iters, tol, fcf, rtol, fallback, coarse), {} if stats is None else stats)


class ParallelGRU(nn.Module):
    r"""A one-layer implicit GRU whose recurrence is solved by MGRIT (or serially).

    ``forward(x, h0=None)`` returns ``(H, h_n)`` like ``nn.GRU``: ``H`` (B, T,
    hidden) (``batch_first=True``) or (T, B, hidden), ``h_n`` (1, B, hidden);
    ``h0`` is (1, B, hidden), (B, hidden) or None (zeros). The cell is the
    implicit GRU h⁺ = (h + z⊙n)/(1 + z) (:mod:`cdsgd.mgrit`), *not* ``nn.GRU``'s
    classic step, so weights are not interchangeable with ``nn.GRU``.

    * ``mode="serial"``: the serial loop, backward by autograd;
    * ``mode="mgrit"``: up to ``iters`` MGRIT V-cycles (coarsening ``cf``,
      ``levels``, FCF or F relaxation, coarse step ``coarse``), stopping once
      the C-residual is ≤ ``rtol``·max|h| (or ≤ ``tol``) or stops falling;
      backward by the MGRIT adjoint with the same options. With
      ``fallback=True`` (the default) a solve that did not reach its
      tolerance is replaced by the serial loop, so the states and gradients
      are within the tolerance or exact; after a fall-back the next solves
      go straight to the serial loop for a while (the back-off of
      :class:`~cdsgd.mgrit.monitor.SolveLog`).

    Both modes use the one parameter set ``self.cell``; the mode can be
    switched at any time (``model.mode = "serial"``). The last residual norms
    are in ``self.last_residuals`` (``"forward"``, ``"backward"``); the
    counts of the training solves since they were last taken (iterations,
    largest relative residual, fall-backs) in :meth:`take_solve_stats`.

    **Where it is inexact.** A fixed iteration count gives approximate states,
    and the adjoint, linearised at those states and itself truncated, gives
    approximate gradients. MGRIT is exact only after T/cf two-level
    F-iterations (T/(2cf) with FCF) or once the residual reaches rounding
    (``tol``). Measured relative errors vs the serial loop (‖·‖₂ over all
    entries; float32, default init ±1/√H, hidden 32, batch 8, 8 inputs
    x ~ N(0, 1), loss Σ H⊙R with R random; two levels)::

                              states after 1 / 2 / 3 it    ∂L/∂θ after 1 / 2 / 3 it
        T=256   cf 4, F       2.0e-1  6.7e-2  2.4e-2       1.8e-1  5.1e-2  1.7e-2
        T=256   cf 4, FCF     6.0e-2  6.6e-3  7.5e-4       4.7e-2  4.4e-3  4.1e-4
        T=256   cf 8, FCF     1.9e-2  9.0e-4  4.3e-5       1.4e-2  4.8e-4  2.0e-5
        T=1024  cf 4, F       2.0e-1  7.0e-2  2.5e-2       1.9e-1  5.5e-2  1.8e-2
        T=1024  cf 4, FCF     6.2e-2  6.9e-3  8.1e-4       5.1e-2  5.1e-3  6.0e-4
        T=1024  cf 8, FCF     2.0e-2  9.8e-4  5.0e-5       1.4e-2  6.5e-4  2.7e-5

    Three levels (FCF) are within about 10 % of two. The errors do not grow
    with T at these weights (the cell forgets, so what an iteration leaves
    wrong stays local); other weights converge at other rates (with the
    update-gate bias c_z set to −2, the T = 1024, cf 4, FCF state errors were
    1.1e-1 / 1.5e-2 / 2.0e-3). These are fixed-iteration figures
    (``rtol=None, fallback=False``, ``coarse="euler"``); the defaults iterate to
    ``rtol`` and fall back when that fails. Trained weights can defeat MGRIT
    altogether (docs/parallel-in-time.md): then the fall-backs show it.

    >>> _ = torch.manual_seed(0); gru = ParallelGRU(2, 8, cf=4, iters=3)
    >>> H, h_n = gru(torch.randn(4, 32, 2)); H.shape, h_n.shape
    (torch.Size([4, 32, 8]), torch.Size([1, 4, 8]))
    >>> H.sum().backward(); gru.cell.weight_hh.grad.shape
    torch.Size([24, 8])
    """

    MODES = ("mgrit", "serial")

    def __init__(self, input_size: int, hidden_size: int, *, mode: str = "mgrit", cf: int = 4, levels: int = 2,
                 iters: int = 4, tol: float | None = None, fcf: bool = True, rtol: float | None = 1e-3,
                 fallback: bool = True, coarse: str = "frozen", batch_first: bool = True) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if not isinstance(batch_first, bool):
            raise ValueError(f"batch_first must be true or false, got {batch_first!r}")
        _check_options(cf, levels, iters, tol, fcf, rtol, fallback, coarse)
        self.cell = ImplicitGRUCell(input_size, hidden_size)
        self.mode, self.cf, self.levels, self.iters, self.tol, self.fcf = mode, cf, levels, iters, tol, fcf
        self.rtol, self.fallback, self.coarse = rtol, fallback, coarse
        self.batch_first = batch_first
        self.last_residuals: dict = {}
        self.solve_log = SolveLog()

    def take_solve_stats(self) -> dict:
        """Counts of the training solves since the last call (:meth:`SolveLog.take`), then reset."""
        return self.solve_log.take()

    # --- the statistics hook of cdsgd.models.STAT_PROVIDERS: the metrics.csv columns of MGRIT's solves

    #: the figures :meth:`take_stats` gives per agent (summed over agents and layers, ``residual`` maximised)
    stat_keys = ("solves", "mgrit_solves", "iters", "fallbacks", "residual")
    #: the metrics.csv columns :meth:`stats_row` fills
    stat_columns = ("mgrit_iters", "mgrit_residual", "mgrit_fallbacks", "mgrit_solves")

    def take_stats(self) -> list[float]:
        """:meth:`take_solve_stats` as a list in :attr:`stat_keys` order (then reset)."""
        counts = self.take_solve_stats()
        return [float(counts[k]) for k in self.stat_keys]

    @classmethod
    def combine_stats(cls, a: list[float], b: list[float]) -> list[float]:
        """Two layers' figures of one agent: counts add up, the residual is the larger."""
        return [max(x, y) if k == "residual" else x + y for x, y, k in zip(a, b, cls.stat_keys)]

    @staticmethod
    def stats_row(every: torch.Tensor) -> dict:
        """The columns over all agents (``every``: N × stat_keys) since the previous row.

        ``mgrit_iters`` (mean V-cycles of an MGRIT solve), ``mgrit_residual`` (largest relative residual
        of the states and adjoints used; 0 for serial ones), ``mgrit_fallbacks`` (solves done by the
        serial loop) and ``mgrit_solves`` (forward and adjoint solves); NaN without any solve.

        >>> ParallelGRU.stats_row(torch.tensor([[2, 1, 3, 1, 1e-7], [2, 2, 4, 0, 1e-6]], dtype=torch.float64))
        {'mgrit_iters': 2.3333333333333335, 'mgrit_residual': 1e-06, 'mgrit_fallbacks': 1.0, 'mgrit_solves': 4.0}
        """
        solves, mgrit_solves, iters, fallbacks = (math.fsum(col) for col in every[:, :4].t().tolist())
        if not solves:
            return dict.fromkeys(ParallelGRU.stat_columns, float("nan"))
        return {"mgrit_iters": iters / mgrit_solves if mgrit_solves else 0.0,
                "mgrit_residual": float(every[:, 4].max()), "mgrit_fallbacks": fallbacks, "mgrit_solves": solves}

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None):
        if self.mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {self.mode!r}")
        if isinstance(x, torch.Tensor) and x.dim() == 3 and not self.batch_first:
            x = x.transpose(0, 1)
        if self.mode == "serial":
            H = serial_forward(self.cell, x, h0)
        else:
            counted = torch.is_grad_enabled()   # training solves are counted; evaluation's only steer the back-off
            self.last_residuals = {"serial": self.solve_log.plan(DIRECTIONS if counted else ("forward",)),
                                   "on_solve": lambda d, info: self.solve_log.record(d, info, counted)}
            H = mgrit_gru(self.cell, x, h0, cf=self.cf, levels=self.levels, iters=self.iters, tol=self.tol,
                          fcf=self.fcf, rtol=self.rtol, fallback=self.fallback, coarse=self.coarse,
                          stats=self.last_residuals)
        h_n = H[:, -1].unsqueeze(0)
        return (H if self.batch_first else H.transpose(0, 1)), h_n

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, cf={self.cf}, levels={self.levels}, iters={self.iters}, tol={self.tol}, "
                f"fcf={self.fcf}, rtol={self.rtol}, fallback={self.fallback}, coarse={self.coarse!r}, "
                f"batch_first={self.batch_first}")

