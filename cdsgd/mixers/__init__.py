r"""Mixers: how an update rule averages with other agents.

The update rules in :mod:`cdsgd.algorithms` never know who their neighbours
are or whether the agents live in one process. They receive a :class:`Mixer`
and call two operations on it:

``start(X).wait()`` (or ``mix(X)``)
    Π X: each agent's weighted sum Σ_l π_jl x_l of its neighbours' rows
    (used by CDSGD/CDMSGD on parameters).
``average(X, mask=None)``
    the mean over all (or the masked, participating) agents, given back to
    every agent: 11ᵀX/N (centralized SGD on gradients, FedAvg on parameters).

**What a result is.** Each call returns a new tensor that belongs to the
caller, or writes into ``out=`` when one is given (and returns ``out``): a
mixer never hands out memory it will write again. So ``x = m.mix(x)`` in a
loop computes Π^k x₀, and results held at once stay what they were. ``out``
must have X's shape, dtype and device and must not overlap X (refused:
Π X cannot be computed in place). Executors and update rules pass ``out=``
with buffers they own, so their steady-state steps allocate nothing; a
user's loop may do the same. X must not change between ``start`` and
``wait`` (the exchange reads it).

In the simulator X is the N×P stack of all agents' flat parameters and the
mixer is a :class:`MatrixMixer`; in the distributed runtime X is one rank's
P-vector and the mixer exchanges it with the neighbours. ``start`` returns a
:class:`Handle` so an executor can post the exchange before the backward pass
and wait for it afterwards (the mixing of x_j and the gradient at x_j are
independent).

Every mixer counts what each agent would send (``bytes_sent``, one entry per
agent it represents): degree_j·P·(element size) per mixing step, and
2(N−1)/N·P·(element size) per all-average (a ring all-reduce's volume).

Example::

    >>> import torch, topologies
    >>> W = topologies.mixing_matrix(topologies.build("ring", 4))
    >>> m = MatrixMixer(W)
    >>> X = torch.arange(4.0, dtype=torch.float64).unsqueeze(1)   # agent j holds x_j = j
    >>> [round(v, 4) for v in m.mix(X).squeeze(1).tolist()]
    [1.3333, 1.0, 2.0, 1.6667]
    >>> m.bytes_sent.tolist()   # degree 2 × 1 element × 8 bytes
    [16.0, 16.0, 16.0, 16.0]
"""

from .base import (Handle, Mixer, allreduce_bytes, check_mixer, is_schedule, is_sparse, neighbourhood,
                   ordered_mean, ordered_weighted_sum, overlaps, result_tensor)
from .matrix import BLOCK_BYTES, DENSE_FRACTION, PAD_LIMIT, MatrixMixer
from .schedule import LocalStepMixer, ScheduleMixer, make_mixer

__all__ = [
    "BLOCK_BYTES",
    "DENSE_FRACTION",
    "Handle",
    "LocalStepMixer",
    "Mixer",
    "MatrixMixer",
    "PAD_LIMIT",
    "ScheduleMixer",
    "allreduce_bytes",
    "check_mixer",
    "is_schedule",
    "is_sparse",
    "make_mixer",
    "neighbourhood",
    "ordered_mean",
    "ordered_weighted_sum",
    "overlaps",
    "result_tensor",
]
