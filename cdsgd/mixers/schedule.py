"""Time-varying mixing (:class:`ScheduleMixer`, and :class:`LocalStepMixer`: Π = I between the communications of
periodic gossip) and the one way from a matrix to a mixer (:func:`make_mixer`)."""

from __future__ import annotations

import numpy as np
import torch

import topologies

from .base import Handle, Mixer, check_mixer, is_schedule, is_sparse, result_tensor
from .matrix import MatrixMixer

__all__ = ["LocalStepMixer", "ScheduleMixer", "make_mixer"]


class LocalStepMixer(Mixer):
    """Π = I for the agents of ``base``: a step of periodic gossip between communications (``local_steps`` > 1).

    ``start(X)`` gives X back (a copy, or into ``out``) and sends nothing: its
    ``bytes_sent`` is its own counter of zeros, so the run's (``base``'s)
    does not grow. ``average`` is refused: a rule that all-reduces does not
    take local steps this way. ``part_of`` names ``base``.

    >>> import torch
    >>> from cdsgd.mixers import MatrixMixer
    >>> m = LocalStepMixer(MatrixMixer([[0.5, 0.5], [0.5, 0.5]]))
    >>> m.mix(torch.tensor([[1.0], [3.0]])).tolist(), m.bytes_sent.tolist()
    ([[1.0], [3.0]], [0.0, 0.0])
    """

    def __init__(self, base: Mixer) -> None:
        self.part_of, self.n_agents, self.agents = base, base.n_agents, list(base.agents)
        self.bytes_sent = torch.zeros(len(self.agents), dtype=torch.float64)
        self.exact = getattr(base, "exact", False)

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        return Handle(result_tensor(X, out).copy_(X))

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError("a local step sends nothing: there is no average between communications")


class ScheduleMixer(Mixer):
    """Π_k X for a time-varying :class:`topologies.Schedule`: one mixer per step of its period.

    ``at(k)`` is the mixer of W_{k mod T}, built on first use by ``make(W_k)``
    (a :class:`MatrixMixer` in the simulator, the runtime's ``BlockMixer``
    across processes, which then exchanges with that step's peers only);
    it carries ``part_of`` (this ScheduleMixer) and ``phase`` (k mod T), so
    a rule handed the mixer of step k can reach step k − 1's,
    ``part_of.at(phase − 1)``.
    Executors and :class:`~cdsgd.algorithms.DecentralizedOptimizer` call
    ``at(k)`` with their step counter. ``start``/``mix`` without a step apply
    W_0, W_1, … in turn (the t-th call applies W_{t mod T}), so
    ``x = m.mix(x)`` k times computes W_{k−1} ⋯ W_1 W_0 x. The phases share
    one ``bytes_sent`` counter; ``average`` needs no W and uses the first.

    >>> import torch, topologies
    >>> from cdsgd.mixers import make_mixer
    >>> m = make_mixer(topologies.schedule("one_peer_exponential", 4))   # a ScheduleMixer
    >>> x = torch.arange(4.0).unsqueeze(1)
    >>> for _ in range(2):
    ...     x = m.mix(x)
    >>> x.squeeze(1).tolist()     # exact average after log2(4) steps
    [1.5, 1.5, 1.5, 1.5]
    """

    def __init__(self, schedule, make) -> None:
        self.schedule, self._make = schedule, make
        self.matrix = schedule
        self._phases: dict[int, Mixer] = {}
        self._calls = 0
        first = self.at(0)
        self.n_agents, self.agents = first.n_agents, list(first.agents)
        self.bytes_sent = first.bytes_sent

    def at(self, k: int) -> Mixer:
        k = int(k) % len(self.schedule)
        if k not in self._phases:
            mixer = self._make(self.schedule[k])
            if self._phases:
                mixer.bytes_sent = self.bytes_sent  # one counter for every step of the period
            mixer.part_of = self  # its matrix is the schedule (what update rules check), not one of its steps
            mixer.phase = k  # W_k's place in the period: dsgt mixes its tracker with part_of.at(phase − 1)
            self._phases[k] = mixer
        return self._phases[k]

    @property
    def bytes_across(self) -> float:
        """What this process sent to other processes, over every step of the period."""
        return float(sum(m.bytes_across for m in self._phases.values()))

    @bytes_across.setter
    def bytes_across(self, value: float) -> None:
        for k, m in self._phases.items():
            m.bytes_across = float(value) if k == 0 else 0.0

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        """W_t X for the t-th call (t = 0, 1, …): the schedule's steps in turn."""
        t, self._calls = self._calls, self._calls + 1
        return self.at(t).start(X, out=out)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.at(0).average(X, mask, out=out)


def make_mixer(W, *, n_agents: int | None = None, exact: bool = False, column_stochastic: bool = False,
               per_matrix=None, validated: bool = False) -> Mixer:
    """The one way from a mixing matrix to a Mixer.

    Args:
        W: a dense (numpy, nested lists, a torch tensor on any device) or ``scipy.sparse`` N×N matrix, a
            :class:`topologies.Schedule` (time-varying: a :class:`ScheduleMixer`),
            None (Π = 11ᵀ/N, i.e. all-reduce; needs ``n_agents``), or a ready
            :class:`Mixer` (checked and returned as it is).
        n_agents: the number of agents the caller has (checked against W).
        exact: the exact (runtime-identical rounding) mode of :class:`MatrixMixer`.
        column_stochastic: validate W as a push-sum matrix (columns sum to 1, rows
            need not) instead of a doubly stochastic one: for a rule that takes
            one (``Algorithm.column_stochastic``: ``sgp``).
        per_matrix: ``per_matrix(W_k, exact=..., validate=False)`` builds the
            mixer of one (validated) matrix: :class:`MatrixMixer` by default;
            the runtime passes its ``BlockMixer``.
        validated: W was validated already (the run path: ``topologies.mixing_matrix``
            validates what it builds), so it is not validated again.

    A matrix is validated once (:func:`topologies.validate`; a schedule's
    steps were validated when it was built); ValueError naming what is wrong.
    Whether an update rule can run with it (D²'s eigenvalue condition, ...)
    is the rule's to say where it meets the mixer (``Algorithm.init_state``).

    >>> import topologies
    >>> m = make_mixer(topologies.mixing_matrix(topologies.build("ring", 4)), n_agents=4)
    >>> type(m).__name__, m.method
    ('MatrixMixer', 'dense')
    >>> type(make_mixer(topologies.schedule("one_peer_exponential", 8))).__name__
    'ScheduleMixer'
    """
    per_matrix = MatrixMixer if per_matrix is None else per_matrix
    if isinstance(W, Mixer):
        mixer = check_mixer(W)
        if n_agents is not None and mixer.n_agents != n_agents:
            raise ValueError(f"mixer is for {mixer.n_agents} agents but there are {n_agents} agents")
        return mixer
    if W is None:
        if n_agents is None:
            raise ValueError("W=None stands for Π = 11ᵀ/N (all-reduce) and needs n_agents")
        return per_matrix(None, exact=exact, validate=False, n_agents=n_agents)
    if is_schedule(W):
        if n_agents is not None and W.n != n_agents:
            raise ValueError(f"schedule {W!r} is for {W.n} agents but there are {n_agents} agents")
        return ScheduleMixer(W, lambda Wk: per_matrix(Wk, exact=exact, validate=False))
    if isinstance(W, torch.Tensor):  # on any device: W is small next to X, and read on the host
        W = W.detach().cpu().numpy()
    if not is_sparse(W):
        W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"a mixing matrix must be square (N×N), got shape {tuple(W.shape)}; a time-varying "
                         "schedule is a topologies.Schedule (topologies.schedule(...))")
    if n_agents is not None and W.shape[0] != n_agents:
        raise ValueError(f"mixing matrix W is {'x'.join(map(str, W.shape))} but there are {n_agents} agents")
    if not validated:
        W = topologies.validate(W, symmetric=not column_stochastic, row_sums=not column_stochastic)
    return per_matrix(W, exact=exact, validate=False)
