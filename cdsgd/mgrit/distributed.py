r"""MGRIT across processes: each torch.distributed rank solves its block of time steps.

:func:`mgrit_gru_distributed` is :func:`cdsgd.mgrit.mgrit_gru` on P ranks:
rank r owns the fine steps of :func:`time_block`, runs the single-process
solver's relaxations on them (:class:`_DistSolver`, a :class:`_Solver` with
a ghost point) and talks point-to-point to ranks r ± 1 only, along
:class:`_Chain` (every message posted by :func:`cdsgd.base.comm.exchange`, every
wait bounded by a timeout). The one collective is the all-reduce of the
parameter gradients at the end of backward. :func:`gather_states` assembles
the full sequence of states for tests and evaluation. The maths and the
communication pattern: :mod:`cdsgd.mgrit`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..base.checks import check_int
from ..base.comm import exchange, wait
from ..base.flat import flatten, unflatten
from .cell import ImplicitGRUCell, _check_x_h0, implicit_gru_step
from .solver import _check_length, _check_options, _gradients, _linearise, _rep3, _Solver

__all__ = ["gather_states", "mgrit_gru_distributed", "time_block"]


def _dist_group(group):
    """(rank, world) of this process in ``group``; refuses when no process group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("distributed MGRIT needs an initialised torch.distributed process group "
                           "(dist.init_process_group) on every rank")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_split(T: int, cf: int, levels: int, world: int) -> None:
    """T/cf**(levels−1) coarsest intervals must split evenly over ``world`` ranks (a ValueError naming all)."""
    n = cf ** (levels - 1)
    if T % (n * world):
        options = [p for p in range(1, T // n + 1) if (T // n) % p == 0]
        raise ValueError(f"T={T} cannot be split evenly over world size {world}: with cf={cf} and levels={levels} "
                         f"the coarsest grid has T/cf**(levels-1) = {T // n} intervals, not a multiple of {world} "
                         f"(T must be a multiple of cf**(levels-1)*world = {n * world}); world sizes that divide "
                         f"it: {options[:12]}{' …' if len(options) > 12 else ''}")


def time_block(T: int, *, cf: int = 4, levels: int = 2, group=None) -> slice:
    """The fine time steps this rank owns in :func:`mgrit_gru_distributed`: ``x[:, time_block(...)]``.

    Rank r of P owns the steps t = rM+1 .. (r+1)M, M = T/P (0-based:
    ``slice(r*M, (r+1)*M)``), i.e. the whole coarse intervals r·M/cf ..
    (r+1)·M/cf − 1. ``T`` must be a multiple of cf**(levels−1)·P.
    """
    _check_options(cf, levels, 0, None, True)
    check_int("T", T)
    _check_length(T, cf, levels)
    rank, world = _dist_group(group)
    _check_split(T, cf, levels, world)
    M = T // world
    return slice(rank * M, (rank + 1) * M)


class _Chain:
    r"""This rank's point-to-point links along the time axis: its predecessor and successor in solve time.

    For the forward solve the predecessor is rank r − 1, for the adjoint
    (reversed time) rank r + 1; ``None`` at the ends. Every message is one
    ``batch_isend_irecv`` list (:func:`cdsgd.base.comm.exchange`; peers are ranks
    of ``group``) and every wait has ``timeout`` seconds
    (:class:`cdsgd.base.comm.CommError` otherwise). No collective is used.
    """

    def __init__(self, rank: int, world: int, reverse: bool, group, timeout: float) -> None:
        self.rank, self.group, self.timeout = rank, group, float(timeout)
        lo, hi = (rank - 1 if rank > 0 else None), (rank + 1 if rank < world - 1 else None)
        self.prev, self.next = (hi, lo) if reverse else (lo, hi)

    def _run(self, sends, recvs, what: str) -> None:
        ops = [("send", t, p) for t, p in sends] + [("recv", t, p) for t, p in recvs]
        works = exchange(ops, group=self.group,
                         what=f"rank {self.rank}: posting the {what} with ranks {[p for _, _, p in ops]}")
        for (kind, _, peer), work in zip(ops, works):
            verb, prep = ("sending", "to") if kind == "send" else ("receiving", "from")
            wait(work, self.timeout, f"rank {self.rank}: {verb} the {what} {prep} rank {peer}", peer)

    def halo(self, u: torch.Tensor) -> None:
        """u[0] ← the predecessor's last point; this rank's last point u[−1] → the successor."""
        self._run([(u[-1], self.next)] if self.next is not None else [],
                  [(u[0], self.prev)] if self.prev is not None else [], "ghost point")

    def recv_first(self, v: torch.Tensor) -> None:
        if self.prev is not None:
            self._run([], [(v[0], self.prev)], "coarse-solve state")

    def send_last(self, v: torch.Tensor) -> None:
        if self.next is not None:
            self._run([(v[-1], self.next)], [], "coarse-solve state")

    def max(self, value: torch.Tensor) -> float:
        """Max over all ranks of a 1-element tensor: a pass along the chain and one back (2(P−1) messages)."""
        buf = value.detach().reshape(1).to(torch.float64).clone()
        if self.prev is not None:                           # the running max from the ranks before
            got = torch.empty_like(buf)
            self._run([], [(got, self.prev)], "residual norm")
            buf = torch.maximum(buf, got)
        if self.next is not None:                           # on, and the global max back
            self._run([(buf, self.next)], [], "residual norm")
            self._run([], [(buf, self.next)], "residual norm")
        if self.prev is not None:
            self._run([(buf, self.prev)], [], "residual norm")
        return buf.item()


class _DistSolver(_Solver):
    r"""The MGRIT solver of :class:`_Solver` on this rank's block of every level, with ghost point u[0].

    On level l the rank holds u (M_l + 1, B, H): u[0] is the last point of the
    predecessor's block (the initial condition on the first rank), u[1:] its
    own M_l points, M_l a multiple of cf on every level but the coarsest, so
    that every coarse interval lies inside one rank and the F-relaxation and
    residual are the single-process code on the block. Communication:

    * after each C-relaxation: u[0] ← predecessor's u[−1] (the only point the
      block's F-relaxation needs from outside; the residual needs none);
    * coarsest level: the serial solve as a pass along the ranks (receive
      v[0], step through the block, send v[−1] on);
    * after each iteration: the global residual max-norm along the chain.
    """

    def __init__(self, apply: Callable, data: Sequence[tuple], cf: int, fcf: bool, chain: _Chain) -> None:
        super().__init__(apply, data, cf, fcf)
        self.chain = chain

    def _after_c_relax(self, u) -> None:
        self.chain.halo(u)

    def _serial(self, l, u, g) -> None:
        self.chain.recv_first(u)
        super()._serial(l, u, g)
        self.chain.send_last(u)

    def _norm(self, r) -> float:
        return self.chain.max(r.abs().max())


class _Layout:
    """Who owns what: rank, world, the fine block [lo, hi), the forward and adjoint chains, options."""

    def __init__(self, T: int, rank: int, world: int, group, timeout: float, reduce_input_grads: bool) -> None:
        self.T, self.rank, self.world, self.group, self.timeout = T, rank, world, group, float(timeout)
        self.M = T // world
        self.lo, self.hi = rank * self.M, (rank + 1) * self.M
        self.last = rank == world - 1
        self.fwd = _Chain(rank, world, False, group, timeout)
        self.adj = _Chain(rank, world, True, group, timeout)
        self.reduce_input_grads = reduce_input_grads


def _dist_forward_solve(cell, x, h0, cf, levels, iters, tol, fcf, lay: _Layout):
    """This rank's states (M+1, B, H) time-major, h_{rM} (the ghost) first, and the global residual norms."""
    with torch.no_grad():
        xp = cell.project(x[:, lay.lo:lay.hi]).transpose(0, 1).contiguous()   # entry i is step rM+1+i
        data = [(xp[c_l - 1::c_l].contiguous(),) for c_l in (cf ** l for l in range(levels))]
        whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()

        def apply(d, u, l):
            return implicit_gru_step(u, d[0], whh, bhh, float(cf ** l))

        u = h0.detach().unsqueeze(0).repeat(lay.M + 1, 1, 1)                  # initial guess: h_0 everywhere
        norms = _DistSolver(apply, data, cf, fcf, lay.fwd).solve(u, None, iters, tol)
    return u, norms


def _dist_adjoint_solve(cell, x, u, G, cf, levels, iters, tol, fcf, lay: _Layout):
    r"""This rank's λ_{rM+1..(r+1)M} (M, B, H), its linearisation and the global adjoint residual norms.

    In reversed time s = T + 1 − t rank r owns s = qM+1 .. (q+1)M, q = P−1−r:
    the same layout as the forward solve with the chain reversed (its ghost
    λ_{(r+1)M+1} comes from rank r + 1). Level l's step for the coarse point
    j = qM_l + k (k = 1..M_l, M_l = M/c^l) is the VJP of the Δt = c^l step
    from h_{(r+1)M+1−k c^l} with input x_{(r+1)M+1−(k−1)c^l}: all states are
    this rank's (u), only the k = 1 input lies one step past the block (every
    rank holds all of x). On the last rank k = 1 is s = 1, the zero step.
    """
    M = lay.M
    whh, bhh = cell.weight_hh.detach(), cell.bias_hh.detach()
    xp = cell.project(x.detach()[:, lay.lo:lay.hi + (0 if lay.last else 1)]).detach().transpose(0, 1).contiguous()
    beta, alpha, alpha2 = _linearise(u[:xp.shape[0]], xp, whh, bhh, 1.0)   # step rM+1+i at (u[i], xp[i])
    data = []
    for l in range(levels):
        m = cf ** l
        if l == 0:
            b_l, a_l = beta[1:].flip(0), alpha2[1:].flip(0)
        else:
            k = torch.arange(2 if lay.last else 1, M // m + 1, device=x.device)
            b_l, _, a_l = _linearise(u[M + 1 - k * m], xp[M - (k - 1) * m], whh, bhh, float(m))
        if lay.last:                                                          # s = 1 acts on λ_{T+1} = 0
            b_l = torch.cat([b_l.new_zeros(1, *b_l.shape[1:]), b_l])
            a_l = torch.cat([a_l.new_zeros(1, *a_l.shape[1:]), a_l])
        data.append((b_l, a_l))

    def apply(d, mu, l):
        return mu * d[0] + torch.matmul(_rep3(mu) * d[1], whh)

    lam = G.new_zeros(M + 1, *G.shape[1:])                                   # initial guess: 0
    norms = _DistSolver(apply, data, cf, fcf, lay.adj).solve(lam, G.flip(0).contiguous(), iters, tol)
    return lam[1:].flip(0), (beta[:M], alpha[:M], alpha2[:M]), norms


def _dist_gradients(cell, x, u, lam, lin, lay: _Layout, need_x: bool = True):
    """This rank's share of every gradient, then one all-reduce (with a timeout) of the parameter gradients.

    Returns (g_x (B, T, I) or None when not ``need_x``, g_h0, g_wih, g_whh, g_bih, g_bhh). Without
    ``reduce_input_grads`` g_x is ∂L/∂x on this rank's steps and 0 elsewhere,
    g_h0 is ∂L/∂h_0 on rank 0 and 0 elsewhere; with it both are summed too.
    """
    g_xb, g_h0, *gp = _gradients(cell, x[:, lay.lo:lay.hi], u, lam, lin)
    g_x = None
    if need_x or lay.reduce_input_grads:
        g_x = x.new_zeros(x.shape)
        g_x[:, lay.lo:lay.hi] = g_xb
    if lay.rank != 0:
        g_h0 = torch.zeros_like(g_h0)
    parts = gp + ([g_x, g_h0] if lay.reduce_input_grads else [])
    flat = flatten(parts)
    work = dist.all_reduce(flat, group=lay.group, async_op=True)
    wait(work, lay.timeout, f"rank {lay.rank}: all-reduce of the MGRIT parameter gradients ({flat.numel()} values)")
    out = unflatten(flat, [p.shape for p in parts])
    if lay.reduce_input_grads:
        g_x, g_h0 = out[4:]
    return (g_x, g_h0, *out[:4])


class _MGRITGRUDist(torch.autograd.Function):
    """Forward: distributed MGRIT state solve. Backward: distributed adjoint + one gradient all-reduce."""

    @staticmethod
    def forward(ctx, x, h0, weight_ih, weight_hh, bias_ih, bias_hh, cell, opts, lay, stats):
        u, norms = _dist_forward_solve(cell, x, h0, *opts, lay)
        stats["forward"] = norms
        ctx.save_for_backward(x, u)
        ctx.cell, ctx.opts, ctx.lay, ctx.stats = cell, opts, lay, stats
        return u[1:].transpose(0, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gH):
        x, u = ctx.saved_tensors
        lam, lin, norms = _dist_adjoint_solve(ctx.cell, x, u, gH.transpose(0, 1).to(x.dtype), *ctx.opts, ctx.lay)
        ctx.stats["backward"] = norms
        g = _dist_gradients(ctx.cell, x, u, lam, lin, ctx.lay, ctx.needs_input_grad[0])
        return (*g, None, None, None, None)


def mgrit_gru_distributed(cell: ImplicitGRUCell, x: torch.Tensor, h0: torch.Tensor | None = None, *, cf: int = 4,
                          levels: int = 2, iters: int = 2, tol: float | None = None, fcf: bool = True, group=None,
                          timeout: float = 120.0, reduce_input_grads: bool = False,
                          stats: dict | None = None) -> torch.Tensor:
    r"""MGRIT across the ranks of ``group``: this rank's block of states (B, T/P, H), differentiable.

    Call it on every rank of ``group`` (gloo; P ranks) with the same
    ``cell`` parameters, the *full* input ``x`` (B, T, I), the same ``h0`` and
    options. Rank r owns the fine steps t = rM+1..(r+1)M, M = T/P
    (:func:`time_block`), and returns h_t for them; :func:`gather_states`
    assembles the full (B, T, H). T must be a multiple of cf**(levels−1)·P
    (the coarsest grid's intervals split evenly), otherwise a ValueError
    names T, cf, levels and the world size.

    **Same numbers as one process.** The solve is the algorithm of
    :func:`mgrit_forward` / :func:`mgrit_backward` with the same options,
    executed on blocks: every rank F-relaxes, C-relaxes and computes the
    residuals and τ-corrections of its own coarse intervals on every level
    (the blocks are whole coarse intervals on every level but the coarsest);
    the coarsest level's serial solve is a pass along the ranks, rank r
    stepping through its T/(cf**(levels−1)·P) points after rank r − 1.
    States, residual norms (``stats``) and gradients equal the single-process
    ones up to rounding (float64: ~1e-15).

    **Communication during the solve: point-to-point with rank r ± 1 only.**
    Per V-cycle and relaxed level: with FCF one ghost state (B×H) from r − 1
    after the C-relaxation; the coarsest solve passes one B×H state from each
    rank to the next; the residual norm (for ``tol`` and ``stats``) is a
    1-element max passed up the chain and back. The adjoint does the same
    with r + 1 as the predecessor (reversed time). The one collective is the
    all-reduce of the parameter gradients at the end of backward.

    **Backward.** ``loss.backward()`` runs the distributed MGRIT adjoint
    (same options) and then sums the parameter gradients over the ranks, so
    every rank's ``cell`` gets ∂(Σ_r L_r)/∂θ, the gradient of the sum of all
    ranks' losses (each L_r a function of rank r's block). Every rank must
    call backward (a rank whose loss does not use its block calls
    ``torch.autograd.backward(H, torch.zeros_like(H))``), or the others time
    out. ``x.grad`` holds ∂(Σ_r L_r)/∂x_t for this rank's steps (zeros
    elsewhere: the sum over ranks is the full gradient) and ``h0.grad`` is
    non-zero on rank 0 only; ``reduce_input_grads=True`` sums both in the same
    all-reduce (B·T·I more values) so every rank has the full input gradient,
    as a replicated layer in front of the GRU needs.

    Every wait lasts at most ``timeout`` seconds; a silent or dead neighbour
    raises :class:`cdsgd.base.comm.CommError` naming it (the group is unusable
    after that). ``stats`` (a dict) receives the global residual norms under
    ``"forward"`` and ``"backward"``, equal on all ranks. Ranks must agree on
    T, options and parameters (not checked: a mismatch shows as wrong
    numbers or a timeout).

    **Cost.** The coarsest solve stays sequential (T/cf**(levels−1) steps,
    now spread along the ranks, one after the other), the rest (fine and
    intermediate relaxations, linearisation, gradients) is divided by P: the
    sequential coarse solve bounds what more ranks can save, and more levels
    shrink it. The relative state / ∂L/∂θ errors vs the serial loop are the
    single-process MGRIT ones (in float32 the 2-process results equal the
    1-process ones to ~4e-7). Measured times and speed-ups (serial loop,
    MGRIT in 1 and 2 processes, the coarse solve's share):
    docs/benchmarks.md ("Parallel-in-time GRU") and docs/parallel-in-time.md
    ("When it pays").
    """
    h0 = _check_x_h0(cell, x, h0)
    _check_options(cf, levels, iters, tol, fcf)
    _check_length(x.shape[1], cf, levels)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(reduce_input_grads, bool):
        raise ValueError(f"reduce_input_grads must be true or false, got {reduce_input_grads!r}")
    rank, world = _dist_group(group)
    _check_split(x.shape[1], cf, levels, world)
    lay = _Layout(x.shape[1], rank, world, group, timeout, reduce_input_grads)
    return _MGRITGRUDist.apply(x, h0, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh, cell,
                               (cf, levels, iters, tol, fcf), lay, {} if stats is None else stats)


def gather_states(H: torch.Tensor, *, group=None, timeout: float = 120.0) -> torch.Tensor:
    """The full (B, T, H) from every rank's block (B, T/P, H), on every rank: one all-gather (not differentiable).

    For tests and evaluation, outside the solve.
    """
    rank, world = _dist_group(group)
    blk = H.detach().contiguous()
    parts = [torch.empty_like(blk) for _ in range(world)]
    work = dist.all_gather(parts, blk, group=group, async_op=True)
    wait(work, float(timeout), f"rank {rank}: gathering the MGRIT states")
    return torch.cat(parts, 1)
