"""Batches drawn from length buckets: one epoch at a time (:class:`BucketBatchSampler`) or endless (:class:`BucketStream`).

The order of an epoch and an example are in :mod:`cdsgd.data.bucketing`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..checks import check_int
from ..seeding import generator
from .bucket_lengths import bucket_of

__all__ = ["BucketBatchSampler", "BucketStream"]


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
