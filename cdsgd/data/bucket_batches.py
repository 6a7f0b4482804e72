"""Batches drawn from length buckets: one epoch at a time (:class:`BucketBatchSampler`), endless
(:class:`BucketStream`), or endless with the bucket agreed across agents (:class:`SyncBucketStream`).

The order of an epoch and an example are in :mod:`cdsgd.data.bucketing`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..base.checks import check_int
from ..base.seeding import generator
from .bucket_lengths import bucket_of

__all__ = ["BucketBatchSampler", "BucketStream", "SyncBucketStream", "bucket_part_sizes", "shared_bucket_order",
           "sync_steps_per_bucket"]


# --------------------------------------------------------------------------
# batches


def _buckets(lengths, boundaries) -> list[torch.Tensor]:
    """The indices of every non-empty bucket, ascending, as LongTensors."""
    which = bucket_of(lengths, boundaries)
    order = np.argsort(which, kind="stable")
    cuts = np.flatnonzero(np.diff(which[order])) + 1
    return [torch.from_numpy(part.astype(np.int64)) for part in np.split(order, cuts)]


def _batch_sizes(bucket_sizes, batch_size: int, drop_last: bool, fill: bool) -> list[int]:
    """The sizes of one epoch's batches, ascending (see :func:`_epoch`)."""
    if fill:  # every batch full but the epoch's last
        n = sum(bucket_sizes)
        return ([n % batch_size] if n % batch_size and not drop_last else []) + [batch_size] * (n // batch_size)
    sizes = [batch_size] * sum(m // batch_size for m in bucket_sizes)
    return sorted(sizes + ([] if drop_last else [m % batch_size for m in bucket_sizes if m % batch_size]))


def _epoch(buckets: list[torch.Tensor], batch_size: int, drop_last: bool,
           gen: torch.Generator | None, fill: bool = False) -> list[torch.Tensor]:
    """One epoch's batches: per bucket (in bucket order) shuffle and cut, then shuffle the batches.

    ``fill``: a bucket's last, partial batch is not cut off; its indices go
    first into the next (longer) bucket's, so every batch is full but the
    epoch's last (a batch that straddles two buckets is padded to the longer).
    ``drop_last`` then drops only that last batch.

    ``gen=None`` shuffles nothing (batches in bucket order). The draws from
    ``gen`` are: one randperm per bucket, in bucket order, then one randperm
    over all batches.
    """
    batches, carried = [], torch.empty(0, dtype=torch.int64)
    for idx in buckets:
        if gen is not None:
            idx = idx[torch.randperm(len(idx), generator=gen)]
        parts = list(torch.split(torch.cat([carried, idx]) if fill else idx, batch_size))
        carried = parts.pop() if len(parts[-1]) < batch_size and (fill or drop_last) else carried[:0]
        batches.extend(parts)
    if fill and len(carried) and not drop_last:
        batches.append(carried)
    if gen is not None:
        batches = [batches[k] for k in torch.randperm(len(batches), generator=gen).tolist()]
    return batches


class BucketBatchSampler:
    """One epoch of index batches per iteration, each batch from a single bucket.

    Epoch e's batches depend only on (seed, e): they are drawn from the
    generator :func:`cdsgd.base.seeding.generator` ``(seed, "bucketing", e)``. As
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
        drop_last: drop each bucket's partial last batch (with ``fill``: the epoch's).
        fill: carry a bucket's partial last batch into the next bucket (config ``bucket_fill``).

    >>> s = BucketBatchSampler([1, 5, 2, 6, 1], 2, [2, 6], seed=0)
    >>> len(s), [sorted(b) for b in s]  # epoch 0; buckets {0, 2, 4} and {1, 3}
    (3, [[0, 4], [2], [1, 3]])
    >>> [sorted(b) for b in s]  # epoch 1
    [[1, 3], [0], [2, 4]]
    """

    def __init__(self, lengths, batch_size: int, boundaries, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, fill: bool = False) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.shuffle, self.drop_last, self.fill = bool(shuffle), bool(drop_last), bool(fill)
        self._buckets = _buckets(lengths, boundaries)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` yields."""
        self.epoch = check_int("epoch", epoch, 0)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s batches (does not change :attr:`epoch`)."""
        epoch = check_int("epoch", epoch, 0)
        gen = generator(self.seed, "bucketing", epoch) if self.shuffle else None
        return [b.tolist() for b in _epoch(self._buckets, self.batch_size, self.drop_last, gen, self.fill)]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return len(_batch_sizes([len(b) for b in self._buckets], self.batch_size, self.drop_last, self.fill))


class BucketStream:
    """Endless bucketed batches of indices, with the interface of :class:`cdsgd.executor.BatchStream`.

    Epoch after epoch as :class:`BucketBatchSampler` with ``shuffle=True,
    drop_last=False`` (and its ``fill``), but every epoch's order is drawn
    from ``gen`` (so the simulator can seed it per agent). A batch may be
    shorter than ``batch_size`` (a bucket's last batch; with ``fill`` only the
    epoch's last); each epoch has :attr:`batches_per_epoch` batches and covers
    every index once.

    >>> s = BucketStream([1, 5, 2, 6, 1], 2, [2, 6], torch.Generator().manual_seed(0))
    >>> s.batches_per_epoch, sorted(torch.cat([s.next() for _ in range(3)]).tolist())
    (3, [0, 1, 2, 3, 4])
    """

    def __init__(self, lengths, batch_size: int, boundaries, gen: torch.Generator, *, fill: bool = False) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self._buckets = _buckets(lengths, boundaries)
        self.n = sum(len(b) for b in self._buckets)
        self.gen, self.fill = gen, bool(fill)
        self._sizes = _batch_sizes([len(b) for b in self._buckets], self.batch_size, False, self.fill)
        self.batches_per_epoch = len(self._sizes)
        self._new_epoch()

    def _new_epoch(self) -> None:
        self._batches = _epoch(self._buckets, self.batch_size, False, self.gen, self.fill)
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


# --------------------------------------------------------------------------
# buckets agreed across agents (config key bucket_sync)


def bucket_part_sizes(lengths_per_agent, boundaries) -> np.ndarray:
    """n[j, i]: how many of agent j's sequences fall in bucket i of the common ``boundaries``.

    >>> bucket_part_sizes([[1, 1, 5], [6, 5, 2]], [2, 6]).tolist()
    [[2, 1], [1, 2]]
    """
    K = len(boundaries)
    return np.stack([np.bincount(bucket_of(ln, boundaries), minlength=K) for ln in lengths_per_agent])


def sync_steps_per_bucket(part_sizes, batch_size: int) -> list[int]:
    r"""m_i = ⌈N_i / (A·B)⌉ steps of bucket i per pass, N_i = Σ_j n[j, i] over the A agents, B = ``batch_size``.

    The weights are the bucket sizes summed over agents, in batches of the
    mean agent: when every agent holds n_i = N_i / A sequences of bucket i,
    m_i = ⌈n_i / B⌉ is exactly the number of batches one pass over its part
    takes. A bucket no agent holds gets no step.

    >>> sync_steps_per_bucket([[2, 1], [1, 2], [3, 3]], 2)  # N = (6, 6), A·B = 6
    [1, 1]
    """
    sizes = np.asarray(part_sizes, dtype=np.int64)
    per = sizes.shape[0] * check_int("batch_size", batch_size, 1)
    return [int(-(-int(total) // per)) for total in sizes.sum(axis=0)]


def shared_bucket_order(seed: int, steps_per_bucket, pass_index: int) -> torch.Tensor:
    """Pass ``pass_index``'s bucket sequence: bucket i m_i times, in the order of a randperm.

    The randperm comes from :func:`cdsgd.base.seeding.generator` ``(seed,
    "buckets", pass_index)``, so every agent and rank computes the same
    sequence without communicating.
    """
    m = torch.as_tensor(list(steps_per_bucket), dtype=torch.int64)
    multiset = torch.repeat_interleave(torch.arange(len(m)), m)
    return multiset[torch.randperm(len(multiset), generator=generator(seed, "buckets", pass_index))]


class SyncBucketStream:
    r"""Agent j's endless batches when all agents take the same bucket at every step (``bucket_sync``).

    Every agent's stream walks one shared bucket sequence: pass p is
    :func:`shared_bucket_order` ``(seed, steps_per_bucket, p)``, the M = Σ_i m_i
    buckets of :attr:`batches_per_epoch` steps, the same on every agent and
    rank. At a step whose bucket is i, agent j takes the next batch of its own
    part of bucket i (its sequences with lengths in (b_{i−1}, b_i]):

    - **Rounds of a part.** Each part is gone through in rounds: the part is
      shuffled with the agent's own ``gen`` (every part once at the start, in
      bucket order; a part again when its round is used up), and consecutive
      draws of the bucket take the next ``batch_size`` indices, the last batch
      of a round shorter. So every c_{j,i} = ⌈n_{j,i} / B⌉ consecutive draws
      of a part, from a round's start, hold each of its sequences exactly once;
      rounds run on across passes (a part larger than the mean is not reset at
      a pass's end, a smaller one starts a new round within the pass).
    - **Equal parts, exact epochs.** When c_{j,i} = m_i for every bucket
      (e.g. every agent holds the same number of sequences of each bucket),
      each pass is one round of every part: every sequence of the agent's
      shard exactly once per pass.
    - **Empty part.** If agent j holds nothing of bucket i, it draws from its
      nearest non-empty bucket below i (never longer than the bucket chosen),
      else the nearest above; that draw counts in that part's round.

    Args:
        lengths: the agent's sequence lengths (its batches index into them).
        batch_size: the most indices per batch, >= 1.
        boundaries: the common bucket bounds (every agent the same).
        gen: the agent's own generator (order within its parts).
        steps_per_bucket: m_i per bucket (:func:`sync_steps_per_bucket`), the same on every agent.
        seed: the run seed of the shared bucket sequence.

    >>> s = SyncBucketStream([1, 5, 2, 6, 1], 2, [2, 6], torch.Generator().manual_seed(0),
    ...                      steps_per_bucket=[2, 1], seed=0)
    >>> s.batches_per_epoch, sorted(torch.cat([s.next() for _ in range(3)]).tolist())
    (3, [0, 1, 2, 3, 4])
    """

    def __init__(self, lengths, batch_size: int, boundaries, gen: torch.Generator, *, steps_per_bucket,
                 seed: int) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        which = bucket_of(lengths, boundaries)
        K = len(boundaries)
        self.steps_per_bucket = [check_int("steps_per_bucket", m, 0) for m in steps_per_bucket]
        if len(self.steps_per_bucket) != K:
            raise ValueError(f"steps_per_bucket holds {len(self.steps_per_bucket)} counts for {K} buckets")
        self.batches_per_epoch = sum(self.steps_per_bucket)
        if self.batches_per_epoch < 1:
            raise ValueError("steps_per_bucket are all 0; a pass needs at least one step")
        self._parts = [torch.from_numpy(np.flatnonzero(which == i).astype(np.int64)) for i in range(K)]
        self.n = len(which)
        self._source = [self._nearest(i) for i in range(K)]
        self.gen = gen
        self._perm = [p[torch.randperm(len(p), generator=gen)] if len(p) else p for p in self._parts]
        self._used = [0] * K
        self._pass, self._pos = 0, 0
        self._order = shared_bucket_order(self.seed, self.steps_per_bucket, 0)
        #: the shared bucket of the last batch (−1 before the first); the agent's own may differ if its part is empty
        self.bucket = -1

    def _nearest(self, i: int) -> int:
        """The bucket agent draws from when bucket i is chosen: i, else the nearest non-empty below, else above."""
        below = [k for k in range(i, -1, -1) if len(self._parts[k])]
        return below[0] if below else next(k for k in range(i + 1, len(self._parts)) if len(self._parts[k]))

    def state_dict(self) -> dict:
        """The pass and the place in it, each part's current round (order and indices used), the generator state.

        Only tensors and ints, so ``torch.load(weights_only=True)`` reads it back.
        """
        return {"pass": self._pass, "pos": self._pos, "bucket": self.bucket,
                "steps": torch.tensor(self.steps_per_bucket, dtype=torch.int64),
                "perm": torch.cat(self._perm), "used": torch.tensor(self._used, dtype=torch.int64),
                "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        missing = {"pass", "pos", "bucket", "steps", "perm", "used", "gen"} - set(state)
        if missing:
            raise ValueError(f"stream state lacks {sorted(missing)}: it is not of a bucket_sync stream "
                             "(was the run started with another bucket_sync?)")
        sizes = [len(p) for p in self._parts]
        perm, used, pos = state["perm"], state["used"], int(state["pos"])
        ok = (state["steps"].tolist() == self.steps_per_bucket and perm.shape == (self.n,)
              and used.shape == (len(sizes),) and 0 <= pos <= self.batches_per_epoch and int(state["pass"]) >= 0)
        if ok:
            chunks = list(torch.split(perm, sizes))
            ok = all(torch.equal(torch.sort(c).values, p) and 0 <= u <= len(p)
                     for c, p, u in zip(chunks, self._parts, used.tolist()))
        if not ok:
            raise ValueError(f"bucket_sync stream state is for {perm.numel()} samples and bucket steps "
                             f"{state['steps'].tolist()}, not {self.n} samples in these buckets with steps "
                             f"{self.steps_per_bucket}")
        self._perm = [c.clone() for c in chunks]
        self._used = used.tolist()
        self._pass, self._pos, self.bucket = int(state["pass"]), pos, int(state["bucket"])
        self._order = shared_bucket_order(self.seed, self.steps_per_bucket, self._pass)
        self.gen.set_state(state["gen"])

    def next(self) -> torch.Tensor:
        if self._pos == self.batches_per_epoch:
            self._pass, self._pos = self._pass + 1, 0
            self._order = shared_bucket_order(self.seed, self.steps_per_bucket, self._pass)
        self.bucket = int(self._order[self._pos])
        self._pos += 1
        k = self._source[self.bucket]
        if self._used[k] == len(self._parts[k]):  # the round of this part is used up: a new one
            self._perm[k] = self._parts[k][torch.randperm(len(self._parts[k]), generator=self.gen)]
            self._used[k] = 0
        batch = self._perm[k][self._used[k]:self._used[k] + self.batch_size]
        self._used[k] += len(batch)
        return batch
