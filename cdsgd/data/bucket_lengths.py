"""Lengths and boundaries checked, the bucket of each length, and the padding a bucketing costs.

The definitions (boundaries b_1 < … < b_K, the cost P(b)) are in
:mod:`cdsgd.data.bucketing`, the front of this part of the package.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["bucket_of", "check_boundaries", "check_lengths", "padded_fraction", "padding_cost"]


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


def check_lengths(lengths) -> np.ndarray:
    return _int_array("lengths", lengths)


def check_boundaries(boundaries) -> np.ndarray:
    b = _int_array("boundaries", boundaries, what="positive integers in increasing order")
    bad = np.flatnonzero(np.diff(b) <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"boundaries must increase strictly, but boundaries[{i}] = {int(b[i])} "
                         f">= boundaries[{i + 1}] = {int(b[i + 1])}")
    return b


# --------------------------------------------------------------------------
# measures


def bucket_of(lengths, boundaries) -> np.ndarray:
    """Bucket index of every length: i with b_{i−1} < l ≤ b_i (b_0 = 0).

    A length above the last bound is refused.

    >>> bucket_of([1, 3, 4, 8], [3, 8]).tolist()
    [0, 0, 1, 1]
    """
    arr, b = check_lengths(lengths), check_boundaries(boundaries)
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
    arr, b = check_lengths(lengths), check_boundaries(boundaries)
    return int((b[bucket_of(arr, b)] - arr).sum())


def padded_fraction(lengths, batches: Sequence[Sequence[int]]) -> float:
    """Fraction of padding when every batch is padded to its own longest sequence.

        Σ_batch (|batch|·max_batch − Σ_{s ∈ batch} l_s) / Σ_batch |batch|·max_batch

    ``batches`` are index batches into ``lengths`` (empty batches count for nothing).

    >>> padded_fraction([1, 3, 2, 2], [[0, 1], [2, 3]])  # (2·3 − 4 + 0) / (6 + 4)
    0.2
    """
    arr = check_lengths(lengths)
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
