r"""Mixing when messages are lost: the step's mixer with the lost edges taken out.

A message from l to i lost at step k (dropped, or its link down) changes
what i computes, in the way the algorithm's ``lost_message`` says:

``"own"`` (the gossip rules: cdsgd, cdmsgd, dsgt, d2, qg_dsgdm)
    i mixes with the weights of the surviving graph, the missing weight
    added to its own: (Π X)_i + π_il (x_i − x_l). Rows still sum to 1.
``"lost"`` (push-sum, ``sgp``)
    the mass π_il x_l (numerator and weight alike) never arrives:
    (Π X)_i − π_il x_l. Σ_j w_j shrinks, and the de-biased z = x / w stays
    an average of what survived (push-sum's own robustness).
per-edge messages (``relaysum``)
    ``exchange`` hands i an empty message along that edge (all zeros: no
    value and a count of 0), as the RelaySGD reference code deletes it;
    the receiver's count then falls short and x⁰ fills the gap.

Without losses a run's arithmetic is untouched (no wrapper is made).
"""

from __future__ import annotations

import numpy as np
import torch

from ..mixers import Mixer
from ..mixers.base import Handle

__all__ = ["LOSS_MODES", "LossyMixer"]

#: how an algorithm's receiver treats a lost message (Algorithm.lost_message)
LOSS_MODES = ("own", "lost")


class _Corrected(Handle):
    def __init__(self, handle: Handle, X: torch.Tensor, owner: "LossyMixer") -> None:
        self._handle, self._X, self._owner = handle, X, owner

    def wait(self) -> torch.Tensor:
        out = self._handle.wait()
        self._owner._correct(self._X, out)
        return out


class LossyMixer(Mixer):
    """``base`` (the mixer of one step, holding every agent) with the edges ``recv[lost] ← send[lost]`` lost.

    Args:
        base: the step's mixer (``mixer.at(k)``), holding all N agents.
        recv, send, weight: the directed edges of W_k (i ← l, sorted by (i, l)) and π_il.
        lost: boolean mask over those edges.
        mode: ``"own"`` or ``"lost"`` (:data:`LOSS_MODES`; the module docstring says what each does).
    """

    def __init__(self, base: Mixer, recv: np.ndarray, send: np.ndarray, weight: np.ndarray, lost: np.ndarray,
                 mode: str) -> None:
        if mode not in LOSS_MODES:
            raise ValueError(f"lost-message mode {mode!r} is unknown; allowed: {', '.join(LOSS_MODES)}")
        if list(base.agents) != list(range(base.n_agents)):
            raise ValueError("lost messages are simulated with every agent in one process (executor=sim)")
        self.base, self.mode = base, mode
        self.part_of = getattr(base, "part_of", None) or base
        self.n_agents, self.agents, self.matrix = base.n_agents, base.agents, base.matrix
        self._recv, self._send = recv[lost], send[lost]
        self._weight = weight[lost]
        self._edges_lost = (recv, send, lost)
        self._tensors: dict = {}

    @property
    def bytes_sent(self) -> torch.Tensor:  # lost messages were sent: the count is the base mixer's
        return self.base.bytes_sent

    @property
    def bytes_across(self) -> float:
        return self.base.bytes_across

    def at(self, k: int) -> Mixer:
        return self

    def _index(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._tensors:
            self._tensors[device] = (torch.as_tensor(self._recv, device=device),
                                     torch.as_tensor(self._send, device=device),
                                     torch.as_tensor(self._weight, device=device))
        return self._tensors[device]

    def _correct(self, X: torch.Tensor, out: torch.Tensor) -> None:
        if not len(self._recv):
            return
        recv, send, w = self._index(X.device)
        X2, out2 = X.reshape(len(X), -1), out.reshape(len(out), -1)
        w = w.to(X.dtype).unsqueeze(1)
        if self.mode == "own":
            out2.index_add_(0, recv, w * (X2[recv] - X2[send]))
        else:
            out2.index_add_(0, recv, -(w * X2[send]))

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        return _Corrected(self.base.start(X, out=out), X, self)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.base.average(X, mask, out=out)  # an all-reduce is not gossip: nothing is lost

    @property
    def edges(self) -> np.ndarray:
        return self.base.edges

    def exchange(self, M: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        R = self.base.exchange(M, out=out).wait()
        recv, send, lost = self._edges_lost
        edges = self.base.edges
        if len(edges) != len(recv) or not (np.array_equal(edges[:, 0], recv) and np.array_equal(edges[:, 1], send)):
            raise ValueError("the mixer's edges differ from the mixing matrix's: cannot place the lost messages")
        if lost.any():
            R[torch.as_tensor(np.flatnonzero(lost), device=R.device)] = 0
        return Handle(R)
