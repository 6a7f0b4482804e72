"""Per-agent streams of an executor: data order (:class:`BatchStream`) and random draws (:class:`AgentRNG`).

Every stream of agent j is seeded from (seed, j, purpose) by
:func:`cdsgd.base.seeding.derive_seed`, so an executor holding any subset of the
agents (all of them, a block, or one per rank) draws exactly what the
others would for the same agents.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..base.checks import check_int
from ..base.flat import kept as kept_buffer
from ..base.seeding import derive_seed, generator

__all__ = ["AgentRNG", "BatchStream", "DataFeed", "check_shards", "gather"]


class BatchStream:
    """Endless full batches of indices 0..n-1: concatenated random permutations.

    Batch k is positions [k·b, (k+1)·b) of perm₀ ‖ perm₁ ‖ …, so each pass
    covers every index once and every batch has exactly ``batch_size``
    indices (also when n < batch_size).

    >>> s = BatchStream(5, 2, torch.Generator().manual_seed(0))
    >>> sorted(torch.cat([s.next() for _ in range(5)]).tolist())
    [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    """

    def __init__(self, n: int, batch_size: int, gen: torch.Generator) -> None:
        if n < 1:
            raise ValueError(f"an agent's shard is empty (n={n}); every agent needs data")
        self.n, self.batch_size, self.gen = n, batch_size, gen
        self._perm = torch.randperm(n, generator=gen)
        self._pos = 0

    def state_dict(self) -> dict:
        """The position in the stream: the current permutation, the place in it, the generator state."""
        return {"perm": self._perm.clone(), "pos": self._pos, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        perm = state["perm"]
        if perm.shape != (self.n,) or not 0 <= int(state["pos"]) <= self.n:
            raise ValueError(f"data stream state is for a shard of {perm.numel()} samples, not {self.n}")
        self._perm, self._pos = perm.clone(), int(state["pos"])
        self.gen.set_state(state["gen"])

    def next(self) -> torch.Tensor:
        parts, need = [], self.batch_size
        while need:
            if self._pos == self.n:
                self._perm = torch.randperm(self.n, generator=self.gen)
                self._pos = 0
            take = min(need, self.n - self._pos)
            parts.append(self._perm[self._pos:self._pos + take])
            self._pos += take
            need -= take
        return parts[0] if len(parts) == 1 else torch.cat(parts)



class AgentRNG:
    """Per-agent global-RNG states: run agent j's forward on its own stream."""

    def __init__(self, seed: int, agents: Sequence[int], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            saved = self._get()
            self.states = []
            for j in agents:
                torch.manual_seed(derive_seed(seed, j, "dropout"))
                self.states.append(self._get())
            self._set(saved)
        else:  # the state torch.manual_seed would give, without its per-call cost (it seeds every backend)
            self.states = [torch.Generator().manual_seed(derive_seed(seed, j, "dropout")).get_state() for j in agents]

    def state_dict(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def load_state_dict(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.states):
            raise ValueError(f"random streams of {len(states)} agents, but this executor holds {len(self.states)}")
        self.states = [s.clone() for s in states]

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def _set(self, state) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def run(self, i: int, fn: Callable, *args):
        """fn(*args) on the i-th held agent's stream."""
        saved = self._get()
        self._set(self.states[i])
        try:
            return fn(*args)
        finally:
            self.states[i] = self._get()
            self._set(saved)


def gather(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, store: dict, key) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[idx], y[idx]) written into buffers kept in ``store`` under (``key``, batch size), reused every step
    (:func:`cdsgd.base.flat.kept`).

    A fresh batch per agent and step (N of them) made the allocator hand
    pages back to the kernel and take zeroed ones again, step after step;
    a stream of equal batches now allocates nothing. The result is valid
    until the next gather of the same key and size.
    """
    bx = kept_buffer(store, ("inputs", key), (len(idx), *x.shape[1:]), x)
    by = kept_buffer(store, ("targets", key), (len(idx), *y.shape[1:]), y)
    return (torch.index_select(x, 0, idx.to(x.device), out=bx),
            torch.index_select(y, 0, idx.to(y.device), out=by))


def check_shards(shards: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The number of agents: one per shard, each an (inputs, targets) pair of equal lengths (else a ValueError)."""
    if len(shards) < 1:
        raise ValueError("shards is empty; the simulator needs at least one agent")
    for j, shard in enumerate(shards):
        if not (isinstance(shard, (tuple, list)) and len(shard) == 2):
            raise ValueError(f"shard {j} must be an (inputs, targets) pair, got {type(shard).__name__}")
        if len(shard[0]) != len(shard[1]):
            raise ValueError(f"shard {j} has {len(shard[0])} inputs but {len(shard[1])} targets")
    return len(shards)


class DataFeed:
    """The held agents' training data: their shards, batch streams and augmentation streams.

    Agent j draws batches from ``batch_stream(j, generator(seed, j, "data"))`` (default: a
    :class:`BatchStream` over its shard) and, with ``augment``, transforms each batch with its own
    generator seeded from (seed, j, "augment"). An epoch is ``steps_per_epoch`` steps (default
    ceil(mean shard size / batch_size), the mean over all N shards).

        >>> feed = DataFeed([(torch.zeros(6, 2), torch.zeros(6)), (torch.ones(4, 2), torch.ones(4))], [1],
        ...                 batch_size=2, seed=0)
        >>> feed.n_agents, feed.steps_per_epoch, feed.batches([0])[0][0].tolist()
        (2, 3, [[1.0, 1.0], [1.0, 1.0]])
    """

    def __init__(self, shards: Sequence[tuple[torch.Tensor, torch.Tensor]], held: Sequence[int], *,
                 batch_size: int = 32, seed: int = 0, device: torch.device | str | None = None,
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
                 batch_stream: Callable[[int, torch.Generator], object] | None = None,
                 steps_per_epoch: int | None = None) -> None:
        self.n_agents = n = check_shards(shards)
        self.batch_size = check_int("batch_size", batch_size)
        self.shards = [(shards[j][0].to(device), shards[j][1].to(device)) if device is not None else shards[j]
                       for j in held]
        if batch_stream is None:
            def batch_stream(j, gen):
                return BatchStream(len(shards[j][1]), self.batch_size, gen)
        self.streams = [batch_stream(j, generator(seed, j, "data")) for j in held]
        self.augment = augment
        self.augment_generators = [generator(seed, j, "augment") for j in held] if augment else []
        self._kept: dict = {}
        mean_shard = sum(len(y) for _, y in shards) / n
        self.steps_per_epoch = (max(1, math.ceil(mean_shard / self.batch_size)) if steps_per_epoch is None
                                else check_int("steps_per_epoch", steps_per_epoch))

    def batches(self, active: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next training batch of each active held agent (into buffers kept for it; augmented on its own
        stream). Valid until the next call."""
        out = []
        for i in active:
            xb, yb = gather(*self.shards[i], self.streams[i].next(), self._kept, i)
            out.append((xb if self.augment is None else self.augment(xb, self.augment_generators[i]), yb))
        return out

    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams],
                "augment": [g.get_state() for g in self.augment_generators]}

    def load_state_dict(self, state: dict) -> None:
        for stream, s in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(s)
        for g, s in zip(self.augment_generators, state["augment"], strict=True):
            g.set_state(s)
