r"""Sequence bucketing: batches of similar lengths waste little padding.

After Khomenko et al. (2016), "Accelerating recurrent neural network training
using sequence bucketing and multi-GPU data parallelization". A batch of
variable-length sequences is padded to its longest member; grouping the
sequences into K buckets by length and drawing every batch from one bucket
keeps that padding small.

Boundaries are the sorted inclusive upper bounds b_1 < … < b_K of the buckets:
bucket i holds the lengths l with b_{i−1} < l ≤ b_i (b_0 = 0), and b_K is at
least the longest length. Padding every sequence of bucket i to b_i costs

    P(b) = Σ_i Σ_{l ∈ bucket i} (b_i − l),

which :func:`optimal_bucket_boundaries` minimises exactly;
:data:`BUCKET_RULES` also holds two simple rules to compare against
(``quantile``: equal counts, ``uniform``: equal widths).

Batches: :class:`BucketBatchSampler` yields one epoch of index batches at a
time (seeded per epoch, like torch's ``DistributedSampler``);
:class:`BucketStream` is the endless variant with the interface of
:class:`cdsgd.executor.BatchStream` (``next()``, ``state_dict()``,
``load_state_dict()``). The order of an epoch: within each bucket the indices
are shuffled and cut into batches of ``batch_size`` (the last one of a bucket
may be shorter), then the batches of all buckets are put in a random order.
With ``fill`` (config ``bucket_fill``) a bucket's partial last batch is
carried into the next bucket's first, so every batch is full but the last.
:class:`SyncBucketStream` (config ``bucket_sync``) makes all agents take the
same bucket at every step, from a shared seeded bucket sequence over common
boundaries; each agent draws from its own part of that bucket.

>>> lengths = [1, 1, 2, 5, 5, 6, 9]
>>> b = bucket_boundaries(lengths, 2)
>>> b, padding_cost(lengths, b), padding_cost(lengths, bucket_boundaries(lengths, 2, "quantile"))
([2, 9], 13, 14)
>>> bucket_of(lengths, b).tolist()
[0, 0, 0, 1, 1, 1, 1]
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from topologies import Registry

from ..base.checks import check_int
from .bucket_batches import (BucketBatchSampler, BucketStream, SyncBucketStream, bucket_part_sizes,
                             shared_bucket_order, sync_steps_per_bucket)
from .bucket_lengths import bucket_of, check_lengths, padded_fraction, padding_cost

__all__ = [
    "BUCKET_RULES",
    "bucket_boundaries",
    "optimal_bucket_boundaries",
    "quantile_bucket_boundaries",
    "uniform_bucket_boundaries",
    "padding_cost",
    "padded_fraction",
    "bucket_of",
    "BucketBatchSampler",
    "BucketStream",
    "SyncBucketStream",
    "bucket_part_sizes",
    "shared_bucket_order",
    "sync_steps_per_bucket",
]

BUCKET_RULES: Registry[Callable[..., list[int]]] = Registry("bucketing rule")

# int64 holds every padding cost below this (the DP adds and compares such costs)
_COST_LIMIT = 1 << 60
# largest DP block (rows × columns) held at once: 2**21 int64 = 16 MiB
_BLOCK = 1 << 21



# --------------------------------------------------------------------------
# boundary rules


@BUCKET_RULES.register("optimal")
def optimal_bucket_boundaries(lengths, n_buckets: int) -> list[int]:
    r"""Boundaries of at most ``n_buckets`` buckets with the least total padding.

    Let v_0 < … < v_{m−1} be the distinct lengths, c_t their counts, and
    C_j = Σ_{t<j} c_t, S_j = Σ_{t<j} c_t·v_t the prefix sums. A bucket covering
    v_i … v_j (bound v_j) costs

        cost(i, j) = v_j·(C_{j+1} − C_i) − (S_{j+1} − S_i).

    An optimal bound is always an observed length, and with K ≤ m buckets
    splitting never costs more, so the optimum uses exactly K = min(n_buckets, m)
    buckets. Dynamic programming over the last bound, with D_1(j) = cost(0, j),

        D_k(j) = min_{k−2 ≤ i < j} D_{k−1}(i) + cost(i+1, j)
               = v_j·C_{j+1} − S_{j+1} + min_i [D_{k−1}(i) + S_{i+1} − v_j·C_{i+1}],

    and the answer D_K(m−1). Each layer is one numpy min over the lower
    triangle of an m×m matrix, cut into row blocks of at most 2²¹ entries.

    Complexity: O(K·m²) time, O(K·m) memory beyond the blocks, plus
    O(n log n) to count the n lengths. For n = 10⁵ lengths with m = 2000
    distinct values it takes a fraction of a second.

    Ties go to the smallest previous bound (numpy's first argmin), so the
    result is deterministic. If n_buckets ≥ m, the m distinct lengths are
    returned (zero padding).

    Args:
        lengths: positive integer sequence lengths (non-empty).
        n_buckets: the most buckets allowed, an integer >= 1.

    Returns:
        The sorted bounds [b_1, …, b_K], each an observed length, b_K = max(lengths).

    >>> optimal_bucket_boundaries([1, 1, 2, 5, 5, 6, 9], 2)
    [2, 9]
    >>> optimal_bucket_boundaries([3, 1, 3], 5)
    [1, 3]
    """
    arr = check_lengths(lengths)
    n_buckets = check_int("n_buckets", n_buckets, 1)
    v, c = np.unique(arr, return_counts=True)
    m = len(v)
    if int(v[-1]) * len(arr) >= _COST_LIMIT:
        raise ValueError(f"lengths up to {int(v[-1])} over {len(arr)} sequences overflow the int64 padding cost")
    K = min(n_buckets, m)
    if K == m:
        return v.tolist()
    C = np.concatenate([[0], np.cumsum(c)])        # C[j] = Σ_{t<j} c_t
    S = np.concatenate([[0], np.cumsum(c * v)])    # S[j] = Σ_{t<j} c_t·v_t
    head = v * C[1:] - S[1:]                        # v_j·C_{j+1} − S_{j+1} = D_1(j)
    D = head.copy()
    args = []                                       # args[k−2][j]: best previous last index i for D_k(j)
    for k in range(2, K + 1):
        A = D + S[1:]                               # D_{k−1}(i) + S_{i+1}
        B = C[1:]                                   # C_{i+1}
        lo = k - 2                                  # D_{k−1}(i) needs i >= k−2
        newD = np.zeros(m, dtype=np.int64)
        arg = np.full(m, -1, dtype=np.int64)
        j0 = k - 1
        while j0 < m:
            # rows j0..j1−1 use columns lo..j1−2; keep rows × columns under _BLOCK
            rows = max(1, _BLOCK // max(1, m - lo))
            j1 = min(m, j0 + rows)
            js = np.arange(j0, j1)
            cols = np.arange(lo, j1 - 1)
            M = A[lo:j1 - 1][None, :] - v[j0:j1, None] * B[lo:j1 - 1][None, :]
            M[cols[None, :] >= js[:, None]] = _COST_LIMIT  # i must be < j
            best = np.argmin(M, axis=1)
            arg[j0:j1] = lo + best
            newD[j0:j1] = head[j0:j1] + M[np.arange(j1 - j0), best]
            j0 = j1
        D = newD
        args.append(arg)
    bounds, j = [], m - 1
    for arg in reversed(args):
        bounds.append(int(v[j]))
        j = int(arg[j])
    bounds.append(int(v[j]))
    return bounds[::-1]


@BUCKET_RULES.register("quantile")
def quantile_bucket_boundaries(lengths, n_buckets: int) -> list[int]:
    r"""Bounds at the length quantiles k/K, k = 1..K (buckets of about equal counts).

    With the n lengths sorted, l_(1) ≤ … ≤ l_(n), bound k is the smallest
    length whose empirical CDF reaches k/K: l_(⌈k·n/K⌉). Repeated bounds are
    merged, so fewer than K buckets may come back; the last bound is the
    maximum.

    >>> quantile_bucket_boundaries([1, 2, 3, 4, 5, 6, 7, 8], 4)
    [2, 4, 6, 8]
    >>> quantile_bucket_boundaries([1, 1, 1, 9], 3)
    [1, 9]
    """
    arr = np.sort(check_lengths(lengths))
    K = check_int("n_buckets", n_buckets, 1)
    n = len(arr)
    idx = [-(-k * n // K) - 1 for k in range(1, K + 1)]
    return np.unique(arr[idx]).tolist()


@BUCKET_RULES.register("uniform")
def uniform_bucket_boundaries(lengths, n_buckets: int) -> list[int]:
    r"""Bounds at K equal-width steps from min to max, each rounded up to an observed length.

    Edge k is e_k = min + k·(max − min)/K, k = 1..K; bound k is the smallest
    observed length ≥ e_k (so e_K gives the maximum). Repeated bounds are
    merged, so fewer than K buckets may come back.

    >>> uniform_bucket_boundaries([1, 2, 3, 10, 11, 20], 2)
    [11, 20]
    >>> uniform_bucket_boundaries([1, 2, 3, 4, 5], 4)
    [2, 3, 4, 5]
    """
    v = np.unique(check_lengths(lengths))
    K = check_int("n_buckets", n_buckets, 1)
    lo, span = int(v[0]), int(v[-1] - v[0])
    # lengths are integers, so "≥ e_k" is "≥ ⌈e_k⌉", computed exactly in integers
    edges = [lo - (-(span * k) // K) for k in range(1, K + 1)]
    return np.unique(v[np.searchsorted(v, edges, side="left")]).tolist()


def bucket_boundaries(lengths, n_buckets: int, rule: str = "optimal") -> list[int]:
    """Boundaries of at most ``n_buckets`` buckets by the named rule of :data:`BUCKET_RULES`.

    ``n_buckets`` 0 or 1 both mean one bucket, ``[max(lengths)]`` (no bucketing).

    >>> bucket_boundaries([4, 2, 7], 0)
    [7]
    >>> bucket_boundaries([4, 2, 7], 2, "optmal")
    Traceback (most recent call last):
    ...
    ValueError: bucketing rule 'optmal' is unknown; did you mean 'optimal'? Known: optimal, quantile, uniform
    """
    fn = BUCKET_RULES.get(rule)
    n_buckets = check_int("n_buckets", n_buckets, 0)
    return fn(lengths, max(1, n_buckets))
