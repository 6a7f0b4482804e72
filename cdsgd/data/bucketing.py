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
:class:`cdsgd.simulator.BatchStream` (``next()``, ``state_dict()``,
``load_state_dict()``). The order of an epoch: within each bucket the indices
are shuffled and cut into batches of ``batch_size`` (the last one of a bucket
may be shorter), then the batches of all buckets are put in a random order.

>>> lengths = [1, 1, 2, 5, 5, 6, 9]
>>> b = bucket_boundaries(lengths, 2)
>>> b, padding_cost(lengths, b), padding_cost(lengths, bucket_boundaries(lengths, 2, "quantile"))
([2, 9], 13, 14)
>>> bucket_of(lengths, b).tolist()
[0, 0, 0, 1, 1, 1, 1]
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from topologies import Registry

from ..checks import check_int
from ..seeding import generator

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
]

BUCKET_RULES: Registry[Callable[..., list[int]]] = Registry("bucketing rule")

# int64 holds every padding cost below this (the DP adds and compares such costs)
_COST_LIMIT = 1 << 60
# largest DP block (rows × columns) held at once: 2**21 int64 = 16 MiB
_BLOCK = 1 << 21


# --------------------------------------------------------------------------
# validation at the door


def _int_array(name: str, values, *, what: str = "positive integers") -> np.ndarray:
    """``values`` as a non-empty 1-D int64 array of positive integers, or a ValueError naming the bad entry."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of {what}, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty; it must hold at least one value")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must hold {what}, got dtype {arr.dtype} ({name}[0] = {arr[0]!r})")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] = {arr[i].item()!r} is not an integer; {name} must hold {what}")
        if np.abs(arr).max() >= 2.0**62:
            raise ValueError(f"{name} holds {arr.max().item()!r}, too large for a length")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(arr[i])} is not positive; {name} must hold {what}")
    return arr


def _lengths(lengths) -> np.ndarray:
    return _int_array("lengths", lengths)


def _boundaries(boundaries) -> np.ndarray:
    b = _int_array("boundaries", boundaries, what="positive integers in increasing order")
    bad = np.flatnonzero(np.diff(b) <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"boundaries must increase strictly, but boundaries[{i}] = {int(b[i])} "
                         f">= boundaries[{i + 1}] = {int(b[i + 1])}")
    return b


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
    arr = _lengths(lengths)
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
    arr = np.sort(_lengths(lengths))
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
    v = np.unique(_lengths(lengths))
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


# --------------------------------------------------------------------------
# measures


def bucket_of(lengths, boundaries) -> np.ndarray:
    """Bucket index of every length: i with b_{i−1} < l ≤ b_i (b_0 = 0).

    A length above the last bound is refused.

    >>> bucket_of([1, 3, 4, 8], [3, 8]).tolist()
    [0, 0, 1, 1]
    """
    arr, b = _lengths(lengths), _boundaries(boundaries)
    over = np.flatnonzero(arr > b[-1])
    if over.size:
        i = int(over[0])
        raise ValueError(f"lengths[{i}] = {int(arr[i])} exceeds the last bucket bound {int(b[-1])}")
    return np.searchsorted(b, arr, side="left")


def padding_cost(lengths, boundaries) -> int:
    """Total padding Σ_i Σ_{l ∈ bucket i} (b_i − l) when every sequence is padded to its bucket's bound.

    >>> padding_cost([1, 1, 2, 5, 5, 6, 9], [2, 9])  # (1 + 1 + 0) + (4 + 4 + 3 + 0)
    13
    """
    arr, b = _lengths(lengths), _boundaries(boundaries)
    return int((b[bucket_of(arr, b)] - arr).sum())


def padded_fraction(lengths, batches: Sequence[Sequence[int]]) -> float:
    """Fraction of padding when every batch is padded to its own longest sequence.

        Σ_batch (|batch|·max_batch − Σ_{s ∈ batch} l_s) / Σ_batch |batch|·max_batch

    ``batches`` are index batches into ``lengths`` (empty batches count for nothing).

    >>> padded_fraction([1, 3, 2, 2], [[0, 1], [2, 3]])  # (2·3 − 4 + 0) / (6 + 4)
    0.2
    """
    arr = _lengths(lengths)
    sizes, parts = [], []
    for k, batch in enumerate(batches):
        idx = np.asarray(batch.tolist() if isinstance(batch, torch.Tensor) else batch).reshape(-1)
        if idx.size and (not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0 or idx.max() >= len(arr)):
            raise ValueError(f"batches[{k}] holds {idx.tolist()!r}; indices must be integers in [0, {len(arr)})")
        if idx.size:
            sizes.append(idx.size)
            parts.append(idx)
    if not sizes:
        raise ValueError("batches holds no index; padded_fraction needs at least one non-empty batch")
    flat = arr[np.concatenate(parts)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    padded_total = int((np.maximum.reduceat(flat, starts) * np.asarray(sizes)).sum())
    return (padded_total - int(flat.sum())) / padded_total


# --------------------------------------------------------------------------
# batches


def _buckets(lengths, boundaries) -> list[torch.Tensor]:
    """The indices of every non-empty bucket, ascending, as LongTensors."""
    which = bucket_of(lengths, boundaries)
    order = np.argsort(which, kind="stable")
    cuts = np.flatnonzero(np.diff(which[order])) + 1
    return [torch.from_numpy(part.astype(np.int64)) for part in np.split(order, cuts)]


def _n_batches(size: int, batch_size: int, drop_last: bool) -> int:
    return size // batch_size if drop_last else -(-size // batch_size)


def _epoch(buckets: list[torch.Tensor], batch_size: int, drop_last: bool,
           gen: torch.Generator | None) -> list[torch.Tensor]:
    """One epoch's batches: per bucket (in bucket order) shuffle and cut, then shuffle the batches.

    ``gen=None`` shuffles nothing (batches in bucket order). The draws from
    ``gen`` are: one randperm per bucket, in bucket order, then one randperm
    over all batches.
    """
    batches = []
    for idx in buckets:
        if gen is not None:
            idx = idx[torch.randperm(len(idx), generator=gen)]
        parts = list(torch.split(idx, batch_size))
        if drop_last and len(parts[-1]) < batch_size:
            parts.pop()
        batches.extend(parts)
    if gen is not None:
        batches = [batches[k] for k in torch.randperm(len(batches), generator=gen).tolist()]
    return batches


class BucketBatchSampler:
    """One epoch of index batches per iteration, each batch from a single bucket.

    Epoch e's batches depend only on (seed, e): they are drawn from the
    generator :func:`cdsgd.seeding.generator` ``(seed, "bucketing", e)``. As
    with torch's ``DistributedSampler``, :meth:`set_epoch` picks the epoch;
    every ``iter()`` then uses the current epoch and moves on to the next, so
    iterating repeatedly without ``set_epoch`` walks through epochs 0, 1, ….

    With ``drop_last=False`` every index appears exactly once per epoch; with
    ``drop_last=True`` each bucket's last, partial batch is left out.

    Args:
        lengths: positive integer sequence lengths; the batches index into them.
        batch_size: the most indices per batch, >= 1.
        boundaries: the buckets' increasing upper bounds (see :func:`bucket_boundaries`).
        shuffle: shuffle within buckets and the order of batches (else bucket order).
        seed: the seed of every epoch's order.
        drop_last: drop each bucket's partial last batch.

    >>> s = BucketBatchSampler([1, 5, 2, 6, 1], 2, [2, 6], seed=0)
    >>> len(s), [sorted(b) for b in s]  # epoch 0; buckets {0, 2, 4} and {1, 3}
    (3, [[0, 4], [2], [1, 3]])
    >>> [sorted(b) for b in s]  # epoch 1
    [[1, 3], [0], [2, 4]]
    """

    def __init__(self, lengths, batch_size: int, boundaries, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self._buckets = _buckets(lengths, boundaries)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` yields."""
        self.epoch = check_int("epoch", epoch, 0)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s batches (does not change :attr:`epoch`)."""
        epoch = check_int("epoch", epoch, 0)
        gen = generator(self.seed, "bucketing", epoch) if self.shuffle else None
        return [b.tolist() for b in _epoch(self._buckets, self.batch_size, self.drop_last, gen)]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return sum(_n_batches(len(b), self.batch_size, self.drop_last) for b in self._buckets)


class BucketStream:
    """Endless bucketed batches of indices, with the interface of :class:`cdsgd.simulator.BatchStream`.

    Epoch after epoch as :class:`BucketBatchSampler` with ``shuffle=True,
    drop_last=False``, but every epoch's order is drawn from ``gen`` (so the
    simulator can seed it per agent). A batch may be shorter than
    ``batch_size`` (a bucket's last batch); each epoch has
    :attr:`batches_per_epoch` batches and covers every index once.

    >>> s = BucketStream([1, 5, 2, 6, 1], 2, [2, 6], torch.Generator().manual_seed(0))
    >>> s.batches_per_epoch, sorted(torch.cat([s.next() for _ in range(3)]).tolist())
    (3, [0, 1, 2, 3, 4])
    """

    def __init__(self, lengths, batch_size: int, boundaries, gen: torch.Generator) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self._buckets = _buckets(lengths, boundaries)
        self.n = sum(len(b) for b in self._buckets)
        self.gen = gen
        self._sizes = sorted(len(p) for b in self._buckets for p in torch.split(b, self.batch_size))
        self.batches_per_epoch = len(self._sizes)
        self._new_epoch()

    def _new_epoch(self) -> None:
        self._batches = _epoch(self._buckets, self.batch_size, False, self.gen)
        self._pos = 0

    def state_dict(self) -> dict:
        """The position in the stream: this epoch's batches, the place in them, the generator state.

        Only tensors and ints, so ``torch.load(weights_only=True)`` reads it back.
        """
        return {"order": torch.cat(self._batches),
                "sizes": torch.tensor([len(b) for b in self._batches], dtype=torch.int64),
                "pos": self._pos, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        order, sizes, pos = state["order"], state["sizes"], int(state["pos"])
        if (order.shape != (self.n,) or sorted(sizes.tolist()) != self._sizes
                or not torch.equal(torch.sort(order).values, torch.arange(self.n))
                or not 0 <= pos <= self.batches_per_epoch):
            raise ValueError(f"bucketed stream state is for {order.numel()} samples in {sizes.numel()} batches, "
                             f"not {self.n} samples in {self.batches_per_epoch} batches of these buckets")
        self._batches = list(torch.split(order.clone(), sizes.tolist()))
        self._pos = pos
        self.gen.set_state(state["gen"])

    def next(self) -> torch.Tensor:
        if self._pos == self.batches_per_epoch:
            self._new_epoch()
        batch = self._batches[self._pos]
        self._pos += 1
        return batch
