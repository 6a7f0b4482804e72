"""The runtime's per-edge messages (:meth:`BlockMixer.exchange <cdsgd.runtime.BlockMixer.exchange>`).

What :mod:`cdsgd.mixers.edges` defines, across processes: each edge inside a
rank's block is a gather, as in the simulator; the rows of the cut edges to
one neighbouring rank travel as one message, in an order both sides know
(sender, then receiver), and every send and receive of a step is posted at
once (:func:`cdsgd.base.comm.exchange`), like the mixing's exchange.
"""

from __future__ import annotations

import numpy as np
import torch

from ..base.comm import wait_peers
from ..mixers import Handle, result_tensor
from ..mixers.edges import edge_list, out_degrees, reverse_positions

__all__ = ["EdgeMessages"]


class _EdgeHandle(Handle):
    def __init__(self, mixer, works, peers, recvs, out2, out, lent) -> None:
        self.mixer, self.works, self.peers, self.recvs = mixer, works, peers, recvs
        self.out2, self.out, self.lent, self._done = out2, out, lent, False

    def wait(self) -> torch.Tensor:
        if not self._done:
            m = self.mixer
            wait_peers(self.peers, self.works, m.timeout, m.rank, "messages")
            for q, rbuf in self.recvs:
                self.out2.index_copy_(0, m._index(("recv", q), m._edge_peers[q][1], rbuf.device), rbuf)
            self._done = True
            m.give_back(self.lent)
            self.lent = []
        return self.out


class EdgeMessages:
    """Mixin of :class:`~cdsgd.runtime.BlockMixer`: ``edges`` and ``exchange`` over its block and process group.

    Uses the mixer's ``matrix``, ``agents``, ``rank``, ``group``, ``timeout``,
    ``bytes_sent``, ``bytes_across`` and its buffer pool (``_lend``, ``give_back``).
    """

    @property
    def edges(self) -> np.ndarray:
        """The held agents' directed edges (i, l), sorted (:mod:`cdsgd.mixers.edges`)."""
        if "_edge_list" not in self.__dict__:
            if self.matrix is None:
                raise ValueError(f"{type(self).__name__}(None) (Π = 11ᵀ/N) has no graph edges to send along")
            self._edge_list = edge_list(self.matrix, self.agents)
            E, per = self._edge_list, len(self.agents)
            inside = np.asarray([e for e, (i, l) in enumerate(E) if l // per == self.rank], dtype=np.int64)
            self._edge_inside = (inside, reverse_positions(E, inside))  # in-block edges: R[e] = M[reverse]
            # per neighbouring rank q: the edges whose messages go to q, ordered by (sender, receiver) (i, l),
            # and the edges whose messages come from q, ordered by q's sender first ((l, i) for our e = (i, l)):
            # the same order on both sides, so one message per rank pair carries every cut edge's row.
            self._edge_peers = {}
            for e, (i, l) in enumerate(E):
                q = int(l) // per
                if q != self.rank:
                    send, recv = self._edge_peers.setdefault(q, ([], []))
                    send.append(e)
                    recv.append(e)
            for q, (send, recv) in self._edge_peers.items():
                recv.sort(key=lambda e: (int(E[e, 1]), int(E[e, 0])))
                self._edge_peers[q] = (np.asarray(send, dtype=np.int64), np.asarray(recv, dtype=np.int64))
            self._edge_out_degree = out_degrees(E, self.agents)
        return self._edge_list

    def _index(self, name, idx: np.ndarray, device) -> torch.Tensor:
        key = ("edge-index", name, device)
        if key not in self._buffers:
            self._buffers[key] = torch.as_tensor(idx, dtype=torch.int64, device=device)
        return self._buffers[key]

    def exchange(self, M: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        """Per-edge messages (:mod:`cdsgd.mixers.edges`): in-block edges gathered, each cut edge's row in one
        message per neighbouring rank, all posted at once; ``bytes_across`` counts the rows really sent."""
        E = len(self.edges)
        if M.dim() < 1 or M.shape[0] != E:
            raise ValueError(f"exchange takes one message per edge of this rank's agents ({E}×…), "
                             f"got shape {tuple(M.shape)}")
        if not M.is_contiguous():
            raise ValueError(f"{type(self).__name__}.exchange needs a contiguous message stack")
        out = result_tensor(M, out, "exchange")
        M2, out2, lent = M.reshape(E, -1), out.view(E, -1), []
        if M2.shape[1] == 0:
            return Handle(out)
        ops, recvs = [], []
        for q in sorted(self._edge_peers):
            send, recv = self._edge_peers[q]
            sbuf = torch.index_select(M2, 0, self._index(("send", q), send, M.device),
                                      out=self._lend(M2, len(send), lent))
            rbuf = self._lend(M2, len(recv), lent)
            ops += [("send", sbuf, q), ("recv", rbuf, q)]
            recvs.append((q, rbuf))
        peers = [(kind, q) for kind, _, q in ops]
        works = self._post(ops, f"rank {self.rank}: posting per-edge messages to neighbour ranks "
                                f"{sorted(self._edge_peers)}")
        inside, source = self._edge_inside
        if len(inside):
            out2.index_copy_(0, self._index("inside", inside, M.device),
                             M2.index_select(0, self._index("source", source, M.device)))
        row_bytes = M2.shape[1] * M2.element_size()
        self.bytes_sent += self._edge_out_degree * row_bytes
        self.bytes_across += sum(len(s) for s, _ in self._edge_peers.values()) * row_bytes
        return _EdgeHandle(self, works, peers, recvs, out2, out, lent)

