"""Per-agent random streams derived from (seed, agent, purpose).

All randomness of agent j (initialisation with ``init=independent``, data
order, dropout) comes from generators seeded by :func:`derive_seed`, never
from the global RNG's running state, so that rank j of the distributed
runtime can reproduce agent j of the simulator on its own.

>>> derive_seed(0, 3, "data") == derive_seed(0, 3, "data") != derive_seed(0, 4, "data")
True
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["derive_seed", "generator"]


def _key(k) -> int:
    if isinstance(k, str):
        return zlib.crc32(k.encode())
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0:
        return int(k)
    raise ValueError(f"seed keys must be non-negative integers or strings, got {k!r}")


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed from ``seed`` and keys (agent index, purpose name, round, ...)."""
    state = np.random.SeedSequence([_key(seed), *map(_key, keys)]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``derive_seed(seed, *keys)``."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
