"""What every mixer is and owes its caller (:mod:`cdsgd.mixers` has the whole story).

:class:`Mixer` (the interface), :class:`Handle`, :func:`check_mixer`, and
the helpers that every mixer shares: where a result goes
(:func:`result_tensor`, never memory the mixer writes again), who an agent
averages with (:func:`neighbourhood`), and the exact mode's summation order
(:func:`ordered_weighted_sum`).
"""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np
import torch

import topologies

__all__ = ["Handle", "Mixer", "allreduce_bytes", "check_mixer", "is_schedule", "is_sparse", "neighbourhood",
           "ordered_mean", "ordered_weighted_sum", "overlaps", "result_tensor"]


class Handle:
    """A mixing in flight; :meth:`wait` returns Σ_l π_jl x_l."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


def allreduce_bytes(n_agents: int, numel: int, element_size: int) -> float:
    """Bytes one agent sends in a ring all-reduce of ``numel`` elements: 2(N−1)/N·P·size."""
    return 2.0 * (n_agents - 1) / n_agents * numel * element_size if n_agents > 1 else 0.0


def ordered_weighted_sum(weights: Sequence[float], tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = Σ_k w_k · t_k`` as explicit multiply-adds in the given order.

    The exact mode of both executors computes the mixing with this one
    function (self first, then neighbours in ascending rank), so that the
    simulator and the runtime round identically.
    """
    torch.mul(tensors[0], weights[0], out=out)
    for w, t in zip(weights[1:], tensors[1:]):
        out.add_(t, alpha=w)
    return out


def ordered_mean(X2: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the mean of the rows of the N×P stack X2 (those where ``mask``), summed in row order, then
    divided by their count: the exact mode's all-average, the same bits in the simulator and the runtime.

    >>> ordered_mean(torch.tensor([[1.0], [2.0], [6.0]]), None, torch.empty(1)).tolist()
    [3.0]
    """
    rows = range(X2.shape[0]) if mask is None else [int(i) for i in torch.nonzero(mask.cpu()).flatten()]
    rows = list(rows)
    out.copy_(X2[rows[0]])
    for i in rows[1:]:
        out.add_(X2[i])
    return out.div_(len(rows))


def is_sparse(W) -> bool:
    """True for a ``scipy.sparse`` matrix (what ``topologies.mixing_matrix(..., sparse=True)`` returns)."""
    return hasattr(W, "tocsr") and hasattr(W, "nnz")


def is_schedule(W) -> bool:
    """True for a time-varying :class:`topologies.Schedule` (what ``topologies.schedule(...)`` returns)."""
    return isinstance(W, topologies.Schedule)


def neighbourhood(W, j: int) -> tuple[list[float], list[int]]:
    """Row j of Π as (weights, sources): agent j itself first, then its neighbours ascending.

    The one definition of "who agent j averages with, and how much" that
    both the in-process mixer and the runtime's neighbour exchange use (and
    the order in which the exact mode adds them up). ``W`` is dense (array
    or nested lists) or a ``scipy.sparse`` matrix (then O(degree)).

    >>> neighbourhood([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]], 1)
    ([0.25, 0.5, 0.25], [1, 0, 2])
    """
    if is_sparse(W):
        S = W if getattr(W, "format", None) == "csr" else W.tocsr()
        lo, hi = S.indptr[j], S.indptr[j + 1]
        cols, vals = S.indices[lo:hi], S.data[lo:hi]
        keep = vals != 0
        found = dict(zip(cols[keep].tolist(), vals[keep].tolist()))
        src = [j] + sorted(c for c in found if c != j)
        return [float(found.get(c, 0.0)) for c in src], src
    row = np.asarray(W, dtype=np.float64)[j]
    src = [j] + [int(l) for l in np.flatnonzero(row) if l != j]
    return [float(row[l]) for l in src], src


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when tensors ``a`` and ``b`` may share memory (their byte ranges in one storage meet).

    >>> x = torch.zeros(4, 3)
    >>> overlaps(x, x[1]), overlaps(x[:2], x[2:]), overlaps(x, torch.zeros(4, 3))
    (True, False, False)
    """
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = t.data_ptr()
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
        return lo, lo + (extent + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def result_tensor(X: torch.Tensor, out: torch.Tensor | None, what: str = "mixing") -> torch.Tensor:
    """Where a mixing of X goes: a new tensor like X, or ``out`` after checking that it fits and does not overlap X."""
    if out is None:
        return torch.empty_like(X, memory_format=torch.contiguous_format)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor, got {type(out).__name__}")
    if out.shape != X.shape or out.dtype != X.dtype or out.device != X.device:
        raise ValueError(f"out must be like X for the {what}: X is {tuple(X.shape)} {X.dtype} on {X.device}, "
                         f"out is {tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous for the {what}")
    if overlaps(out, X):
        raise ValueError(f"out shares memory with X: the {what} cannot be computed in place; "
                         "give a separate buffer (or none, for a new tensor)")
    return out


class Mixer(abc.ABC):
    """Base class: ``start``/``mix`` apply Π, ``average`` applies 11ᵀ/N.

    A Mixer provides ``n_agents``, ``agents`` (the global indices of the
    rows the stacks handed to it hold), ``bytes_sent``, ``start(X, *,
    out=None)`` and ``average(X, mask=None, *, out=None)``: see
    :func:`check_mixer`. Every result is a new tensor, or ``out`` when one
    is given (never memory the mixer writes again).
    """

    #: number of agents in the whole system
    n_agents: int
    #: bytes each agent represented here has sent so far (float64 tensor, one entry per row)
    bytes_sent: torch.Tensor
    #: bytes this process has sent to other processes (0 for a mixer that keeps every agent in-process)
    bytes_across: float = 0.0
    #: the agents (global indices) whose rows the stacks handed to this mixer hold
    agents: list[int]
    #: the matrix this mixer applies (dense array, ``scipy.sparse``, or a :class:`topologies.Schedule`);
    #: None for 11ᵀ/N or when unknown (a user's own mixer). An update rule checks it once, where it meets the
    #: mixer (``Algorithm.init_state``, ``Algorithm.check_mixer``).
    matrix = None
    #: the mixer whose ``matrix`` this one applies a part of (a :class:`~cdsgd.mixers.ScheduleMixer`, on the mixer
    #: of each step it builds, with that step's ``phase`` k mod T; a lossy network's mixer names its base), or None
    part_of: "Mixer | None" = None

    @abc.abstractmethod
    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        """Begin computing Π X; the handle's ``wait()`` returns it (a new tensor, or ``out``).

        X must not change until ``wait`` returns; several mixings may be in
        flight at once (each holds its own buffers). Every process must start
        its mixings in the same order (messages to one peer pair up in order).
        """

    def mix(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Π X (blocking): ``start(X, out=out).wait()``; a new tensor, or ``out``."""
        return self.start(X, out=out).wait()

    @abc.abstractmethod
    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of the (masked) agents' X, returned to every agent (a new tensor, or ``out``)."""

    def at(self, k: int) -> "Mixer":
        """The mixer of step k (a time-varying :class:`ScheduleMixer` has one per step of its period)."""
        return self

    @property
    def edges(self):
        """The held agents' directed edges (i, l), an E×2 int64 array sorted by i then l (:mod:`cdsgd.mixers.edges`)."""
        raise NotImplementedError(f"mixer {type(self).__name__} has no per-edge messages (edges/exchange); "
                                  "MatrixMixer and the runtime's BlockMixer have them")

    def move_rows(self, moves: Sequence[tuple[int, int]], stacks: Sequence[torch.Tensor]) -> float:
        """Copy agent d's row of every stack into agent j's, for each ``(j, d)`` of ``moves`` in turn (a returning
        agent taking its donor's model and state, :mod:`cdsgd.executor.membership`); returns the bytes this
        process sent to other processes for it. Here every agent is held: local copies; the runtime's
        :class:`~cdsgd.runtime.BlockMixer` sends the rows between processes."""
        index = {a: i for i, a in enumerate(self.agents)}
        missing = [a for move in moves for a in move if a not in index]
        if missing:
            raise ValueError(f"{type(self).__name__} does not hold agent {missing[0]}: moving rows between "
                             "processes needs the runtime's BlockMixer")
        with torch.no_grad():
            for j, d in moves:
                for t in stacks:
                    t[index[j]] = t[index[d]]
        return 0.0

    def exchange(self, M: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        """Per-edge messages: M[e] goes along e = (i, l) of :attr:`edges`; ``wait()`` gives R, R[e] = what l sent i.

        See :mod:`cdsgd.mixers.edges`. A new tensor, or ``out`` (like M, not overlapping it).
        """
        raise NotImplementedError(f"mixer {type(self).__name__} has no per-edge messages (edges/exchange); "
                                  "MatrixMixer and the runtime's BlockMixer have them")


def check_mixer(mixer) -> Mixer:
    """Check that ``mixer`` provides what executors and optimizers use; returns it.

    A :class:`Mixer` with ``n_agents`` (int >= 1), ``agents`` (the global
    indices of its rows), ``bytes_sent`` (a tensor, one entry per row), and
    ``start``/``average`` taking ``out=``. ValueError naming what is missing.

    >>> from cdsgd.mixers import MatrixMixer
    >>> check_mixer(MatrixMixer([[0.5, 0.5], [0.5, 0.5]])).agents
    [0, 1]
    """
    import inspect

    if not isinstance(mixer, Mixer):
        raise ValueError(f"mixer must be a cdsgd.mixers.Mixer, got {type(mixer).__name__}")
    name = type(mixer).__name__
    missing = [a for a in ("n_agents", "agents", "bytes_sent") if not hasattr(mixer, a)]
    if missing:
        raise ValueError(f"mixer {name} must set {', '.join(missing)} (n_agents: agents in the system; agents: "
                         "the global indices of the rows it is handed; bytes_sent: one float per row)")
    if len(mixer.bytes_sent) != len(mixer.agents):
        raise ValueError(f"mixer {name}: bytes_sent has {len(mixer.bytes_sent)} entries for {len(mixer.agents)} agents")
    for method in ("start", "average"):
        params = inspect.signature(getattr(mixer, method)).parameters
        if "out" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"mixer {name}.{method} must take out= (the buffer the result goes to, or None for "
                             "a new tensor)")
    return mixer
