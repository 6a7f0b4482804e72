r"""Parallel-in-time GRU training with MGRIT (Moon & Cyr, ICLR 2022), single process.

The recurrence of an *implicit* GRU (the paper's cell) is a time-stepping
problem, solved for all t at once by multigrid reduction in time (MGRIT,
Falgout et al. 2014/2017) instead of by the serial loop.

**Cell.** With input x_t and previous state h (gates ordered r, z, n as in
``nn.GRU``)::

    r = σ(W_r x_t + b_r + U_r h + c_r)
    z = σ(W_z x_t + b_z + U_z h + c_z)
    n = tanh(W_n x_t + b_n + r ⊙ (U_n h + c_n))
    h⁺ = Φ_Δt(h, x_t) = (h + Δt·z⊙n) / (1 + Δt·z)

a backward-Euler step of dh/dt = z⊙(n − h): a convex combination of h and n
for every Δt > 0, so it stays stable on coarse grids with large Δt. The fine
grid has Δt = 1. The input projections a_t = W x_t + b of all t are one
batched matmul, done once: the rest of a step needs only h.

**Forward problem.** h_t = Φ_1(h_{t−1}, x_t), t = 1..T, h_0 given. MGRIT with
coarsening factor c: level l has the points t = j·c^l, j = 0..T/c^l, and the
coarse step Δt_l = c^l (the paper's choice), taking the input at the point it
lands on: the step from t − c^l to t uses x_t. C-points of level l are those
of level l + 1, the rest are F-points.

* F-relaxation: u at the F-points of every interval from its C-point, all
  T/c intervals together (one batched step over intervals × batch for each of
  the c − 1 F-points); C-relaxation: u at all C-points from their left
  neighbours, one batched step. FCF = F, C, F.
* FAS coarse-grid correction (the nonlinear form): the residual at C-points
  r_k = g_{kc} − u_{kc} + Φ(u_{kc−1}), restricted by injection, v⁰ = u_C; the
  coarse problem v_k − Φ^c(v_{k−1}) = r_k + v⁰_k − Φ^c(v⁰_{k−1}) (the
  τ-correction) is solved serially on the coarsest level and by one recursive
  V-cycle on the others; then u_C ← v and the F-points are F-relaxed again
  (ideal interpolation).
* Stopping: after ``iters`` V-cycles, or earlier once the max-norm of the
  fine C-point residual is ≤ ``tol`` or ≤ ``rtol``·max|h| (relative), or,
  with ``rtol``, once an iteration fails to reduce it (the iteration does not
  contract, so more would not help). ``fallback=True``: a solve that missed
  its tolerance is replaced by the serial loop, so what is returned is
  within the tolerance or exact. Initial guess: h_0 at every point.
* Coarse step (``coarse``): ``"euler"``, backward Euler with Δt = c^l (the
  paper's), q = 1/(1 + Δt z) in h⁺ = n + (h − n) q; or ``"frozen"``, c^l fine
  steps with z, n held at their values at the interval's start,
  q = (1 + z)^(−c^l): as forgetful as the fine steps it stands for.
  The sequential depth of one two-level iteration is 2c + T/c batched steps
  with F-relaxation, 3c + T/c with FCF (T/c of them the serial coarse solve),
  not T; with more levels the serial part shrinks to T/c^(levels−1).

Exactness (the standard MGRIT/parareal property, verified in the tests): after
k two-level iterations with F-relaxation the first k C-points (and the
F-points of the interval after them) are exact to rounding; with FCF the first
2k. So ``iters = T/c`` (F) reproduces the serial states; fewer iterations give
*approximate* states and therefore approximate gradients.

**Backward (adjoint).** With upstream gradients G_t = ∂L/∂h_t,
λ_T = G_T, λ_t = G_t + (∂Φ(h_t, x_{t+1})/∂h_t)ᵀ λ_{t+1}: a linear problem
backward in time, solved by the same MGRIT code (reversed time,
s = T + 1 − t, λ_{T+1} = 0, initial guess 0). The fine operator is the exact
vector–Jacobian product at the stored states; the coarse operator of level l
is the VJP of the Δt = c^l step at the coarse points' states. The VJPs are
linearised once for all t (one batched pass), then
∂L/∂θ = Σ_t (∂Φ(h_{t−1}, x_t)/∂θ)ᵀ λ_t, ∂L/∂x_t and ∂L/∂h_0 for all t at once.

Sequence lengths: T must be divisible by c^(levels−1); other lengths are
refused (pad the sequence yourself; padding at the end does not change
earlier states).

**Across processes** (:func:`mgrit_gru_distributed`). The same solver on P
torch.distributed ranks: rank r owns the contiguous block of steps
t = rM+1..(r+1)M, M = T/P (whole coarse intervals on every level, so T must
be a multiple of c^(levels−1)·P), keeps one ghost state (the last point of
rank r − 1) and relaxes, computes residuals and τ-corrections of its own
intervals. During the solve it talks point-to-point to ranks r ± 1 only: the
ghost state after each C-relaxation, the coarsest level's serial solve as a
pass along the ranks (rank r steps through its part after rank r − 1), the
residual max-norm along the chain; the adjoint runs the same with the chain
reversed. Parameter gradients are summed by one all-reduce at the end. The
states, norms and gradients are those of :func:`mgrit_forward` /
:func:`mgrit_backward` with the same options, up to rounding.

The package, by concern: :mod:`~cdsgd.mgrit.cell` (the cell Φ_Δt and the
serial loop), :mod:`~cdsgd.mgrit.solver` (MGRIT forward and adjoint solves),
:mod:`~cdsgd.mgrit.layer` (the autograd function and :class:`ParallelGRU`),
:mod:`~cdsgd.mgrit.monitor` (the solve counts and back-off of a training
run, and :func:`gradient_error`, MGRIT's gradient against the serial one),
:mod:`~cdsgd.mgrit.distributed` (the solve across torch.distributed ranks;
fixed iterations and the backward-Euler coarse step only).

>>> import torch
>>> _ = torch.manual_seed(0); cell = ImplicitGRUCell(2, 4).double()
>>> x = torch.randn(3, 16, 2, dtype=torch.float64)
>>> H, res = mgrit_forward(cell, x, cf=4, iters=4, fcf=False)   # iters = T/c: exact
>>> bool(torch.allclose(H, serial_forward(cell, x), atol=1e-12)), len(res)
(True, 5)
"""

from __future__ import annotations

from .cell import COARSE_STEPS, ImplicitGRUCell, classic_gru_step, implicit_gru_step, serial_forward
from .distributed import gather_states, mgrit_gru_distributed, time_block
from .layer import ParallelGRU, mgrit_gru
from .monitor import SolveLog, gradient_error
from .solver import mgrit_backward, mgrit_forward

__all__ = [
    "COARSE_STEPS",
    "ImplicitGRUCell",
    "ParallelGRU",
    "SolveLog",
    "classic_gru_step",
    "gather_states",
    "gradient_error",
    "implicit_gru_step",
    "mgrit_backward",
    "mgrit_forward",
    "mgrit_gru",
    "mgrit_gru_distributed",
    "serial_forward",
    "time_block",
]
