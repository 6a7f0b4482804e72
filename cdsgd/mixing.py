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

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np
import torch

import topologies

__all__ = [
    "Handle",
    "Mixer",
    "MatrixMixer",
    "allreduce_bytes",
    "neighbourhood",
    "ordered_weighted_sum",
]


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


def neighbourhood(W, j: int) -> tuple[list[float], list[int]]:
    """Row j of Π as (weights, sources): agent j itself first, then its neighbours ascending.

    The one definition of "who agent j averages with, and how much" that
    both the in-process mixer and the runtime's neighbour exchange use (and
    the order in which the exact mode adds them up).

    >>> neighbourhood([[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]], 1)
    ([0.25, 0.5, 0.25], [1, 0, 2])
    """
    row = np.asarray(W, dtype=np.float64)[j]
    src = [j] + [int(l) for l in np.flatnonzero(row) if l != j]
    return [float(row[l]) for l in src], src


class Mixer(abc.ABC):
    """Base class: ``start``/``mix`` apply Π, ``average`` applies 11ᵀ/N.

    Results may live in buffers the mixer reuses: they are valid until the
    mixer's next call of the same kind (executors consume them at once).
    """

    #: number of agents in the whole system
    n_agents: int
    #: bytes each agent represented here has sent so far (float64 tensor, one entry per row)
    bytes_sent: torch.Tensor
    #: the agents (global indices) whose rows the stacks handed to this mixer hold
    agents: list[int]

    @property
    def rows(self) -> list[int]:
        """The old name of :attr:`agents`."""
        return self.agents

    @abc.abstractmethod
    def start(self, X: torch.Tensor) -> Handle:
        """Begin computing Π X; the handle's ``wait()`` returns it."""

    def mix(self, X: torch.Tensor) -> torch.Tensor:
        """Π X (blocking): ``start(X).wait()``."""
        return self.start(X).wait()

    @abc.abstractmethod
    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of the (masked) agents' X, returned to every agent."""


def _numel_per_agent(X: torch.Tensor) -> int:
    return X[0].numel() if X.dim() > 1 else X.numel()


class MatrixMixer(Mixer):
    """Π @ X for an N×P stack of all agents (the simulator's mixer).

    Args:
        W: the N×N mixing matrix (validated with :func:`topologies.validate`).
        exact: compute each row as :func:`ordered_weighted_sum` over the
            agent itself and then its neighbours in ascending order, instead
            of one matrix product: slower, but rounds exactly as the runtime.
        validate: check W (turn off only for matrices that are not meant to be
            doubly stochastic, e.g. in tests).
    """

    def __init__(self, W, *, exact: bool = False, validate: bool = True) -> None:
        W = np.asarray(W, dtype=np.float64)
        if validate:
            topologies.validate(W)
        self.W64 = W
        self.n_agents = W.shape[0]
        self.agents = list(range(self.n_agents))
        self.exact = exact
        # row j's (weights, sources): self first, then neighbours ascending
        self._rows = [neighbourhood(W, j) for j in range(self.n_agents)]
        self.degrees = torch.tensor([len(src) - 1 for _, src in self._rows], dtype=torch.float64)
        self.bytes_sent = torch.zeros(self.n_agents, dtype=torch.float64)
        self._W: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _matrix(self, X: torch.Tensor) -> torch.Tensor:
        key = (X.dtype, X.device)
        if key not in self._W:
            self._W[key] = torch.as_tensor(self.W64, dtype=X.dtype, device=X.device)
        return self._W[key]

    def _buffer(self, X: torch.Tensor, purpose: str) -> torch.Tensor:
        """A preallocated output like X (reused: valid until the next call)."""
        key = (purpose, X.shape, X.dtype, X.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty_like(X, memory_format=torch.contiguous_format)
        return buf

    def _check(self, X: torch.Tensor) -> None:
        if X.dim() < 1 or X.shape[0] != self.n_agents:
            raise ValueError(f"MatrixMixer expects a stack of {self.n_agents} agents (N×P), got shape {tuple(X.shape)}")

    def start(self, X: torch.Tensor) -> Handle:
        self._check(X)
        self.bytes_sent += self.degrees * (_numel_per_agent(X) * X.element_size())
        out = self._buffer(X, "mix")
        if not self.exact:
            torch.mm(self._matrix(X), X.reshape(self.n_agents, -1), out=out.view(self.n_agents, -1))
            return Handle(out)
        for j, (weights, src) in enumerate(self._rows):
            ordered_weighted_sum(weights, [X[l] for l in src], out[j])
        return Handle(out)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check(X)
        self.bytes_sent += allreduce_bytes(self.n_agents, _numel_per_agent(X), X.element_size())
        mean = X.mean(dim=0, keepdim=True) if mask is None else X[mask.to(torch.bool)].mean(dim=0, keepdim=True)
        return self._buffer(X, "average").copy_(mean.expand_as(X))

