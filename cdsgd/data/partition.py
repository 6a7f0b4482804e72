"""Splitting a training set among agents: ``partition(labels, n_agents, scheme)``.

Every scheme returns one sorted index array per agent; the arrays are
disjoint, deterministic under ``seed`` and (apart from the remainder noted
for ``iid``) cover the whole set.

``iid``
    Shuffle, then cut into N shards of exactly ⌊n/N⌋ samples (the n mod N
    samples left over, fewer than N, are not used, so that every agent holds
    the same amount of data as in the paper).
``classes``
    The paper's non-IID split: each agent gets whole classes. The C classes
    (in label order) are dealt out in N contiguous groups whose sizes differ
    by at most one, so agent j holds C/N classes when N divides C (5 agents
    on CIFAR-10: classes {0,1}, {2,3}, …). With more agents than classes
    (N > C) the agents are dealt out to the classes instead, as evenly as
    possible, and the agents sharing a class split its samples equally
    (in shuffled order); every agent then holds part of one class.
``dirichlet``
    For each class c, proportions p_c ~ Dir(α·1_N) over the agents; class
    c's samples (shuffled) are cut by those proportions. Small α gives very
    skewed label mixes, large α approaches IID. Redrawn (at most
    ``max_tries`` times) until every agent holds at least ``min_size``
    samples; otherwise a clear error.

>>> import numpy as np
>>> labels = np.repeat(np.arange(10), 5)
>>> [sorted(set(labels[s].tolist())) for s in partition(labels, 5, "classes")][:2]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np

from topologies import Registry

from ..base.checks import check_int
from ..base.seeding import derive_seed

__all__ = ["PARTITIONS", "partition", "class_histogram"]

PARTITIONS: Registry[Callable[..., list[np.ndarray]]] = Registry("partition")


def _rng(seed: int, scheme: str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, "partition", scheme))


@PARTITIONS.register("iid")
def _iid(labels: np.ndarray, n_agents: int, rng: np.random.Generator) -> list[np.ndarray]:
    per = len(labels) // n_agents
    perm = rng.permutation(len(labels))
    return [perm[j * per:(j + 1) * per] for j in range(n_agents)]


@PARTITIONS.register("classes")
def _classes(labels: np.ndarray, n_agents: int, rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(labels)
    shards: list[list[np.ndarray]] = [[] for _ in range(n_agents)]
    if n_agents <= len(classes):
        for j, group in enumerate(np.array_split(classes, n_agents)):
            shards[j] = [np.flatnonzero(np.isin(labels, group))]
    else:
        for c, agents in zip(classes, np.array_split(np.arange(n_agents), len(classes))):
            idx = rng.permutation(np.flatnonzero(labels == c))
            for j, part in zip(agents, np.array_split(idx, len(agents))):
                shards[j].append(part)
    return [np.concatenate(s) for s in shards]


@PARTITIONS.register("dirichlet")
def _dirichlet(labels: np.ndarray, n_agents: int, rng: np.random.Generator, *, alpha: float,
               min_size: int, max_tries: int = 100) -> list[np.ndarray]:
    classes = np.unique(labels)
    for _ in range(max_tries):
        shards: list[list[np.ndarray]] = [[] for _ in range(n_agents)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(n_agents, alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for j, part in enumerate(np.split(idx, cuts)):
                shards[j].append(part)
        out = [np.concatenate(s) for s in shards]
        if min(len(s) for s in out) >= min_size:
            return out
    raise ValueError(
        f"dirichlet partition: no draw in {max_tries} gave every one of {n_agents} agents at least "
        f"min_shard_size={min_size} samples (dirichlet_alpha={alpha}, {len(labels)} samples); "
        "raise dirichlet_alpha or lower min_shard_size"
    )


def partition(labels, n_agents: int, scheme: str = "iid", *, seed: int = 0, alpha: float = 0.5,
              min_size: int = 10) -> list[np.ndarray]:
    """Per-agent index arrays into ``labels`` (see the module docstring).

    Args:
        labels: 1-D integer class labels of the training set.
        n_agents: number of agents N >= 1.
        scheme: ``iid``, ``classes`` or ``dirichlet``.
        seed: makes the split deterministic.
        alpha: Dirichlet concentration (``dirichlet`` only), > 0.
        min_size: least samples per agent (``dirichlet`` only).
    """
    fn = PARTITIONS.get(scheme)
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype {labels.dtype}")
    n_agents = check_int("n_agents", n_agents, 1)
    if n_agents > len(labels):
        raise ValueError(f"cannot split {len(labels)} samples among n_agents={n_agents} agents")
    rng = _rng(seed, scheme)
    if scheme == "dirichlet":
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
            raise ValueError(f"dirichlet_alpha must be a number > 0, got {alpha!r}")
        min_size = check_int("min_shard_size", min_size, 1)
        shards = fn(labels, n_agents, rng, alpha=float(alpha), min_size=min_size)
    else:
        shards = fn(labels, n_agents, rng)
    return [np.sort(s) for s in shards]


def class_histogram(labels, shards: list[np.ndarray], n_classes: int) -> np.ndarray:
    """N×C matrix: how many samples of each class each agent holds."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[s], minlength=n_classes) for s in shards])
