"""Spectra of mixing matrices: the spectral gap, the smallest eigenvalue (D²'s condition), the
effective number of neighbours (a ranking of topologies beyond the spectral gap), and warnings for a
matrix that never reaches consensus (periodic, or gap 0).

Dense eigen-solvers below :data:`SPARSE_EIGEN_FROM` nodes; above, ARPACK's
Lanczos iteration on the sparse matrix (only the eigenvalues that matter).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .mixing import TOL, _is_sparse

__all__ = ["EFFECTIVE_DECAY", "EFFECTIVE_NEIGHBOURS_UP_TO", "GAP_TOL", "SPARSE_EIGEN_FROM", "SpectralGap",
           "effective_neighbours", "format_gap", "is_periodic", "mixing_warnings", "smallest_eigenvalue",
           "spectral_gap"]


class SpectralGap(NamedTuple):
    """``gap`` = 1 − ``lambda2``; ``lambda2`` = max(|λ₂|, |λₙ|), the second-largest eigenvalue modulus."""

    gap: float
    lambda2: float


def format_gap(x: float, decimals: int = 4) -> str:
    """``x`` with ``decimals`` decimals, or 4 significant digits where that would show fewer than 3.

    A large sparse graph's gap (1.3e-7 for a ring of 10,000) never prints as 0.

    >>> format_gap(0.6666667), format_gap(1.3159e-07), format_gap(0.00123, 6), format_gap(0.0)
    ('0.6667', '1.316e-07', '0.001230', '0.0000')
    """
    x = float(x)
    if x == 0 or not np.isfinite(x) or abs(x) >= 10.0 ** (2 - decimals):
        return f"{x:.{decimals}f}"
    return f"{x:.4g}"


#: from this many nodes on, :func:`spectral_gap` uses a sparse eigen-solver (below it, the dense one)
SPARSE_EIGEN_FROM = 500


def spectral_gap(W) -> SpectralGap:
    """Spectral gap and second-largest eigenvalue modulus of a symmetric mixing matrix.

    With the eigenvalues λ₁ = 1 >= λ₂ >= ... >= λₙ of a validated W,
    ``lambda2 = max(|λ₂|, |λₙ|)`` and ``gap = 1 − lambda2``; consensus error
    contracts by a factor lambda2 per mixing step. For n = 1, lambda2 = 0.

    Below :data:`SPARSE_EIGEN_FROM` nodes all eigenvalues come from the
    dense solver (``numpy.linalg.eigvalsh``, O(n³)). From there on only the
    ones that matter are computed, by ARPACK's Lanczos iteration
    (``scipy.sparse.linalg.eigsh``): first plain (a few restarts suffice for
    well-connected graphs, whose sparse LU would fill in), then, if it has
    not converged, in shift-invert mode around σ = 1 + 10⁻⁹ (λ₁ and λ₂, the
    two closest): one sparse LU factorisation of W − σI, cheap for the
    poorly connected graphs (rings, tori, paths) whose eigenvalues crowd near
    1, and fast even when the gap is 10⁻⁷ (a ring of 10,000). The gap is then ``1 − λ₂`` computed as ``(λ₁ − λ₂)`` with
    λ₁ = 1, so a gap of 10⁻⁸ keeps its significant digits. λₙ is computed
    only when Gershgorin's bound λₙ >= min_i (2·W_ii − 1) cannot rule out
    |λₙ| > λ₂.

    For a column-stochastic push-sum matrix (not symmetric), ``lambda2`` is
    its second-largest eigenvalue modulus (the rate at which push-sum's
    de-biased values agree), from ``numpy.linalg.eigvals`` or ARPACK's
    ``eigs``; a non-symmetric matrix whose columns do not sum to 1 is refused.
    For a time-varying :class:`~topologies.schedules.Schedule` of period T,
    ``lambda2`` is the per-step equivalent of its period's rate,
    ``consensus_rate() ** (1/T)``, and ``gap = 1 − lambda2``.

    Example (ring of n with Metropolis weights: gap = 1 − (1/3 + 2/3·cos(2π/n))):

        >>> from topologies import build, mixing_matrix
        >>> import math
        >>> g = spectral_gap(mixing_matrix(build("ring", 10)))
        >>> math.isclose(g.gap, 1 - (1/3 + 2/3 * math.cos(2 * math.pi / 10)))
        True
    """
    if hasattr(W, "consensus_rate"):  # a time-varying Schedule: the per-step equivalent of its period's rate
        rate = W.consensus_rate() ** (1.0 / len(W))
        return SpectralGap(1.0 - rate, rate)
    if _is_sparse(W):
        S = W.tocsr().astype(np.float64)
        n = S.shape[0]
        if S.ndim != 2 or S.shape[0] != S.shape[1]:
            raise ValueError(f"spectral_gap needs a square matrix, got shape {S.shape}")
        if n and abs(S - S.T).max() > TOL:
            return _push_sum_gap(S)
        if n < SPARSE_EIGEN_FROM:
            return _dense_gap(S.toarray())
        return _sparse_gap(S)
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"spectral_gap needs a square matrix, got shape {W.shape}")
    if not np.allclose(W, W.T, atol=TOL, rtol=0):
        return _push_sum_gap(W)
    if W.shape[0] >= SPARSE_EIGEN_FROM and np.count_nonzero(W) < 0.1 * W.size:
        import scipy.sparse as sp

        return _sparse_gap(sp.csr_array(W))
    return _dense_gap(W)


def _push_sum_gap(W) -> SpectralGap:
    """1 − |λ₂| of a column-stochastic (push-sum) matrix."""
    sparse = _is_sparse(W)
    n = W.shape[0]
    cols = np.asarray(W.sum(axis=0)).ravel()
    if np.abs(cols - 1.0).max() > TOL:
        raise ValueError("spectral_gap needs a symmetric or a column-stochastic (push-sum) matrix; "
                         "check it with topologies.validate first")
    moduli = None
    if sparse and n >= SPARSE_EIGEN_FROM:
        from scipy.sparse.linalg import ArpackNoConvergence, eigs

        try:
            moduli = np.sort(np.abs(eigs(W.astype(np.float64), k=2, which="LM", return_eigenvectors=False,
                                          tol=1e-10, maxiter=5000)))[::-1]
        except (ArpackNoConvergence, RuntimeError):
            moduli = None
    if moduli is None:
        D = W.toarray() if sparse else np.asarray(W, dtype=np.float64)
        moduli = np.sort(np.abs(np.linalg.eigvals(D)))[::-1]
    lambda2 = float(moduli[1]) if n > 1 else 0.0
    return SpectralGap(1.0 - lambda2, lambda2)


def _dense_gap(W: np.ndarray) -> SpectralGap:
    lam = np.sort(np.linalg.eigvalsh(W))[::-1]
    if len(lam) == 1:
        return SpectralGap(1.0, 0.0)
    lambda2 = float(max(abs(lam[1]), abs(lam[-1])))
    return SpectralGap(1.0 - lambda2, lambda2)


def _sparse_gap(S) -> SpectralGap:
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    delta = 1e-9
    try:
        try:  # well-connected graphs (a large gap): plain Lanczos converges in a few restarts
            top = np.sort(eigsh(S, k=2, which="LA", return_eigenvectors=False, maxiter=20, tol=1e-12))
        except ArpackNoConvergence:  # eigenvalues crowd near 1 (a small gap): shift-invert around 1
            top = np.sort(eigsh(S, k=2, sigma=1.0 + delta, which="LM", return_eigenvectors=False))
        lam1, lam2 = float(top[1]), float(top[0])
        # λ₁ = 1 exactly for a doubly stochastic W; measure λ₂ from it to keep a tiny gap's digits
        gap = (lam1 - lam2) + (1.0 - lam1)
        # Gershgorin: λₙ >= min_i (2·W_ii − 1), as each row sums to 1; most graphs need no more
        if -float((2.0 * S.diagonal() - 1.0).min()) > 1.0 - gap:
            try:
                bottom = float(eigsh(S, k=1, which="SA", return_eigenvectors=False, maxiter=20, tol=1e-12)[0])
            except ArpackNoConvergence:
                bottom = float(eigsh(S, k=1, sigma=-1.0 - delta, which="LM", return_eigenvectors=False)[0])
            if abs(bottom) > 1.0 - gap:
                gap = 1.0 - abs(bottom)
    except (ArpackNoConvergence, RuntimeError):  # e.g. a factorisation that fails: fall back to every eigenvalue
        return _dense_gap(S.toarray())
    return SpectralGap(float(gap), float(1.0 - gap))


def smallest_eigenvalue(W) -> float:
    """λₙ, the smallest eigenvalue of a symmetric mixing matrix (dense or sparse).

    D² (exact diffusion) converges only when λₙ > −1/3 (``lazy_metropolis``
    gives W_ii >= 1/2, hence λₙ >= 0). The dense solver below
    :data:`SPARSE_EIGEN_FROM` nodes, ARPACK (which="SA") above.

        >>> from topologies import build, mixing_matrix
        >>> round(smallest_eigenvalue(mixing_matrix(build("ring", 6))), 6)   # 1/3 + 2/3·cos(π)
        -0.333333
        >>> round(smallest_eigenvalue(mixing_matrix(build("ring", 6), "lazy_metropolis")), 6)   # (1 − 1/3)/2
        0.333333
    """
    S = W.tocsr().astype(np.float64) if _is_sparse(W) else None
    n = (S if S is not None else np.asarray(W)).shape[0]
    if S is not None and n >= SPARSE_EIGEN_FROM:
        from scipy.sparse.linalg import ArpackNoConvergence, eigsh

        try:
            return float(eigsh(S, k=1, which="SA", return_eigenvectors=False, maxiter=200, tol=1e-10)[0])
        except (ArpackNoConvergence, RuntimeError):
            return float(np.linalg.eigvalsh(S.toarray())[0])
    D = S.toarray() if S is not None else np.asarray(W, dtype=np.float64)
    return float(np.linalg.eigvalsh(D)[0])

#: a spectral gap at most this is 0: consensus is never reached (:func:`mixing_warnings`)
GAP_TOL = 1e-12

#: what :func:`mixing_warnings` suggests instead of a periodic or gap-0 matrix
_REMEDY = ("use mixing=lazy_metropolis (cdsgd topo --rule lazy_metropolis), or weights that leave every node a "
           "self weight > 0")


def is_periodic(W) -> bool:
    """Whether a symmetric mixing matrix is periodic: every self weight is 0 and the graph of its non-zero
    entries is bipartite, so that W has the eigenvalue −1 (its spectral gap is 0) and the agents oscillate
    between two states instead of agreeing. Exact (no eigenvalues), O(n + non-zeros).

        >>> import numpy as np
        >>> ring4 = np.array([[0, .5, 0, .5], [.5, 0, .5, 0], [0, .5, 0, .5], [.5, 0, .5, 0]])
        >>> is_periodic(ring4), is_periodic((np.eye(4) + ring4) / 2)
        (True, False)
    """
    import scipy.sparse as sp
    from scipy.sparse.csgraph import breadth_first_order

    S = sp.csr_array(W.tocsr() if _is_sparse(W) else np.asarray(W, dtype=np.float64))
    n = S.shape[0]
    if n < 2 or np.abs(S.diagonal()).max() > TOL:
        return False
    side = np.full(n, -1)
    for start in range(n):  # 2-colour each component along a breadth-first order
        if side[start] >= 0:
            continue
        order, pred = breadth_first_order(S, start, directed=False)
        side[start] = 0
        for v in order[1:]:
            side[v] = 1 - side[pred[v]]
    A = S.tocoo()
    off = (A.row != A.col) & (A.data != 0)
    return bool(np.all(side[A.row[off]] != side[A.col[off]]))


def mixing_warnings(W, gap: SpectralGap | None = None) -> list[str]:
    """What is wrong, though valid, with a mixing matrix (or schedule) ``W``: one line each, [] if nothing.

    A periodic W (:func:`is_periodic`: zero self weights on a bipartite
    graph, e.g. a ring of 4 with 0.5 per edge) and a spectral gap of 0 (at
    most :data:`GAP_TOL`) let the agents oscillate or drift apart for ever;
    each line says so and suggests ``mixing=lazy_metropolis`` or self weights.
    ``gap``: :func:`spectral_gap` ``(W)`` when already computed. ``cdsgd topo``
    prints these lines, and runs add them to ``summary.json``'s ``warnings``.

        >>> import numpy as np
        >>> mixing_warnings(np.array([[0.0, 1.0], [1.0, 0.0]]))[0][:60]
        'the mixing matrix is periodic (every self weight is 0 on a b'
        >>> mixing_warnings(np.array([[0.5, 0.5], [0.5, 0.5]]))
        []
    """
    gap = spectral_gap(W) if gap is None else gap
    schedule = hasattr(W, "consensus_rate")
    if not schedule and is_periodic(W):
        return [f"the mixing matrix is periodic (every self weight is 0 on a bipartite graph): it has the eigenvalue "
                f"-1, spectral gap {format_gap(gap.gap)}, and the agents oscillate instead of agreeing; {_REMEDY}"]
    if gap.gap <= GAP_TOL:
        what = "schedule's" if schedule else "mixing matrix's"
        return [f"the {what} spectral gap is {format_gap(gap.gap)} (second-largest eigenvalue modulus "
                f"{gap.lambda2:.10g}): the agents never reach consensus; {_REMEDY}"]
    return []


#: the decay γ at which runs record the effective number of neighbours (summary.json, results.csv)
EFFECTIVE_DECAY = 0.9
#: the effective number of neighbours is computed (dense linear algebra) up to this many agents; NaN beyond
EFFECTIVE_NEIGHBOURS_UP_TO = 2000


def effective_neighbours(W, gamma: float = EFFECTIVE_DECAY) -> float:
    """The effective number of neighbours n_W(γ) of a mixing matrix or a time-varying schedule.

    Vogels, Hendrikx & Jaggi, "Beyond spectral gap: the role of the topology
    in decentralized learning" (NeurIPS 2022): the spectral gap mis-ranks
    topologies for learning, because what matters at a step size is how
    many agents' noise an agent averages over within the memory of the
    iteration. Model: each agent adds fresh unit noise and gossips,
    x ← W(√γ·x + ξ); at stationarity agent i's variance is Σ_ii, against
    1/(1−γ) for an agent that never communicates; then

        n_W(γ) = (1/(1−γ)) / mean_i Σ_ii.

    For symmetric W with eigenvalues λ_j, mean_i Σ_ii = (1/n) Σ_j λ_j²/(1 − γλ_j²);
    otherwise Σ solves Σ = γ W Σ Wᵀ + W Wᵀ; for a schedule of period T
    (measured after its last step), Σ = γ^T M Σ Mᵀ + Σ_j γ^(T−1−j) P_j P_jᵀ
    with P_j = W_(T−1) ⋯ W_j and M = P_0. n_W = 1 for W = I and n for
    W = 11ᵀ/n at every γ; it grows from n/‖W‖_F² (γ = 0) to n (γ → 1) for a
    connected graph. γ plays the role of the learning dynamics' memory (small
    steps: γ near 1); runs record it at :data:`EFFECTIVE_DECAY`. Dense linear
    algebra: up to :data:`EFFECTIVE_NEIGHBOURS_UP_TO` agents (NaN beyond).

        >>> from topologies import build, mixing_matrix
        >>> round(effective_neighbours(mixing_matrix(build("ring", 16)), 0.9), 4)
        6.6011
        >>> round(effective_neighbours(mixing_matrix(build("complete", 16)), 0.9), 6)
        16.0
    """
    gamma = float(gamma)
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"the decay gamma must be in [0, 1), got {gamma!r}")
    schedule = hasattr(W, "consensus_rate")
    n = W.n if schedule else W.shape[0]
    if n > EFFECTIVE_NEIGHBOURS_UP_TO:
        return float("nan")

    def dense(A):
        return A.toarray() if _is_sparse(A) else np.asarray(A, dtype=np.float64)

    from scipy.linalg import solve_discrete_lyapunov

    if schedule:
        mats = [dense(A) for A in W]
        Q, P = np.zeros((n, n)), np.eye(n)
        for j in reversed(range(len(mats))):  # P_j = W_(T−1) ⋯ W_j, built from the last step back
            P = P @ mats[j]
            Q += gamma ** (len(mats) - 1 - j) * (P @ P.T)
        sigma = solve_discrete_lyapunov(np.sqrt(gamma ** len(mats)) * P, Q)
        mean_var = float(np.trace(sigma)) / n
    else:
        D = dense(W)
        if np.abs(D - D.T).max() <= TOL:
            lam2 = np.linalg.eigvalsh(D) ** 2
            mean_var = float(np.mean(lam2 / (1.0 - gamma * lam2)))
        else:
            mean_var = float(np.trace(solve_discrete_lyapunov(np.sqrt(gamma) * D, D @ D.T))) / n
    return (1.0 / (1.0 - gamma)) / mean_var

