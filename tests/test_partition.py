"""Partitions: disjoint, complete, deterministic, class counts as promised."""

from __future__ import annotations

import numpy as np
import pytest

from cdsgd.data import class_histogram, partition


def labels_of(n_classes=10, per_class=30, seed=0):
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(n_classes), per_class))


def assert_disjoint(shards):
    allidx = np.concatenate(shards)
    assert len(allidx) == len(np.unique(allidx))


@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_iid_equal_disjoint_nearly_complete(n):
    y = labels_of()
    shards = partition(y, n, "iid", seed=1)
    assert len(shards) == n and {len(s) for s in shards} == {len(y) // n}
    assert_disjoint(shards)
    assert len(y) - sum(map(len, shards)) == len(y) % n
    assert all(np.all(np.diff(s) > 0) for s in shards)  # sorted


def test_iid_is_shuffled_and_seeded():
    y = labels_of()
    a, b, c = (partition(y, 4, "iid", seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(x, z) for x, z in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))
    # iid shards hold most classes
    assert all(len(np.unique(y[s])) >= 8 for s in a)


def test_classes_paper_split():
    y = labels_of(10, 30)
    shards = partition(y, 5, "classes")
    for j, s in enumerate(shards):
        assert sorted(np.unique(y[s])) == [2 * j, 2 * j + 1]
        assert len(s) == 60  # whole classes
    assert_disjoint(shards)
    assert sum(map(len, shards)) == len(y)


def test_classes_uneven_and_more_agents_than_classes():
    y = labels_of(10, 30)
    shards = partition(y, 4, "classes")  # 10 classes among 4 agents: 3, 3, 2, 2
    assert [len(np.unique(y[s])) for s in shards] == [3, 3, 2, 2]
    assert sum(map(len, shards)) == len(y)
    y3 = labels_of(3, 30)
    shards = partition(y3, 7, "classes", seed=4)  # agents dealt to classes: 3, 2, 2
    assert [int(np.unique(y3[s])[0]) for s in shards] == [0, 0, 0, 1, 1, 2, 2]
    assert all(len(np.unique(y3[s])) == 1 for s in shards)
    assert [len(s) for s in shards] == [10, 10, 10, 15, 15, 15, 15]
    assert_disjoint(shards)
    assert sum(map(len, shards)) == len(y3)


def test_dirichlet_complete_min_size_and_skew():
    y = labels_of(10, 100)
    skewed = partition(y, 8, "dirichlet", alpha=0.1, min_size=20, seed=3)
    flat = partition(y, 8, "dirichlet", alpha=100.0, min_size=20, seed=3)
    for shards in (skewed, flat):
        assert_disjoint(shards)
        assert sum(map(len, shards)) == len(y)
        assert min(map(len, shards)) >= 20
    h_skew = class_histogram(y, skewed, 10) / np.array([len(s) for s in skewed])[:, None]
    h_flat = class_histogram(y, flat, 10) / np.array([len(s) for s in flat])[:, None]
    # small α: each agent dominated by few classes; large α: close to uniform 0.1
    assert h_skew.max(axis=1).mean() > 0.4
    assert np.abs(h_flat - 0.1).max() < 0.1
    again = partition(y, 8, "dirichlet", alpha=0.1, min_size=20, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again))


def test_class_histogram_counts():
    y = np.array([0, 1, 1, 2, 2, 2])
    h = class_histogram(y, [np.array([0, 1]), np.array([2, 3, 4, 5])], 3)
    assert h.tolist() == [[1, 1, 0], [0, 1, 3]]


@pytest.mark.parametrize("call,pattern", [
    (lambda: partition(labels_of(), 3, "random"), r"partition 'random' is unknown; Known: classes, dirichlet, iid"),
    (lambda: partition(labels_of(), 0), r"n_agents must be an integer >= 1, got 0"),
    (lambda: partition(np.arange(3), 5), r"cannot split 3 samples among n_agents=5 agents"),
    (lambda: partition(np.zeros((2, 2), int), 2), r"labels must be a 1-D integer array"),
    (lambda: partition(labels_of(), 3, "dirichlet", alpha=0), r"dirichlet_alpha must be a number > 0, got 0"),
    (lambda: partition(labels_of(2, 10), 10, "dirichlet", alpha=0.01, min_size=5),
     r"no draw in 100 gave every one of 10 agents at least min_shard_size=5"),
])
def test_bad_partitions(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
