r"""Across processes: the neighbour exchange, evaluation all-reduces, and the agreement check.

Rank j is agent j. It holds only its own parameters x_j (a 1×P stack) and
talks only to its graph neighbours: :class:`NeighbourMixer` computes
Σ_l π_jl x_l by posting every send and receive of a step as one
``dist.batch_isend_irecv`` list (pairing them in one batch is what keeps a
neighbour exchange free of deadlocks), into preallocated receive buffers,
and finishes with one ordered multiply-add pass. CDSGD/CDMSGD steps issue no
collective at all. Centralized SGD and FedAvg all-reduce, as their
definitions require; evaluation sums metrics over ranks with all-reduces
(:class:`DistReducer`), counted apart from training traffic.

The executor is the simulator's (``Simulator(..., agents=[rank])``) with
this mixer and reducer, so rank j reproduces the simulator's agent j: the
same update rule, the same (seed, j) streams for initialisation, data order
and dropout.

Works with gloo on CPU tensors and nccl on CUDA tensors (the device follows
the tensor). Every wait has a timeout (``comm_timeout``): a neighbour that
does not answer is an error naming it, not a hang.

Example, inside a process group (e.g. under torchrun)::

    W = topologies.mixing_matrix(topologies.build("ring", dist.get_world_size()))
    mixer = NeighbourMixer(W, dist.get_rank(), timeout=60)
    opt = CDMSGD(model.parameters(), mixer, lr=0.01)    # see docs/distributed.md
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch
import torch.distributed as dist

import topologies

from ..comm import exchange, wait
from ..executor.reducer import Reducer
from ..mixing import Handle, Mixer, allreduce_bytes, is_sparse, neighbourhood, ordered_weighted_sum

__all__ = ["DistReducer", "NeighbourMixer", "check_agreement"]


class _NeighbourHandle(Handle):
    def __init__(self, mixer: "NeighbourMixer", works, peers, x, bufs, out, shape) -> None:
        self.mixer, self.works, self.peers = mixer, works, peers
        self.x, (self.bufs_matrix, self.bufs), self.out, self.shape = x, bufs, out, shape
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            m = self.mixer
            for (kind, peer), work in zip(self.peers, self.works):
                verb = "receiving parameters from" if kind == "recv" else "sending parameters to"
                wait(work, m.timeout, f"rank {m.rank}: {verb} neighbour rank {peer}", peer)
            if m.exact or not self.bufs:
                ordered_weighted_sum(m.weights, [self.x, *self.bufs], self.out)
            else:  # one fused pass: π_jj·x_j + R^T w over the stacked receive buffers
                torch.addmv(self.x, self.bufs_matrix.t(), m._wvec(self.x), beta=m.weights[0], out=self.out)
            self._done = True
        return self.out.view(self.shape)


class NeighbourMixer(Mixer):
    """Σ_l π_jl x_l for this rank, by point-to-point exchange with its neighbours.

    Args:
        W: the N×N mixing matrix (the same on every rank: checked by
            :func:`check_agreement`); this rank uses its row.
        rank: this agent's index (its rank in ``group``); its neighbours are
            ranks of ``group`` too (:mod:`cdsgd.comm`'s one convention).
        group: the process group (default: the world).
        timeout: seconds any single wait may take (``comm_timeout``).

    ``start(x)`` takes this rank's P-vector (or a 1×P stack), posts all sends
    and receives in one ``batch_isend_irecv``, and returns a handle whose
    ``wait()`` completes them and returns the weighted sum π_jj·x_j + Σ_l π_jl·x_l:
    one fused pass (``addmv`` over the degree×P receive matrix) by default;
    with ``exact=True`` explicit multiply-adds, self first and then the
    neighbours in ascending order, as the simulator's exact mode. Receive
    buffers and the output are allocated once per shape and reused: a result
    is valid until the next ``start``. ``x`` must not change until ``wait``.
    After a :class:`CommError` the process group is not usable any more
    (gloo's state after a failed wait): stop, do not retry with this mixer.
    """

    def __init__(self, W, rank: int, *, group=None, timeout: float = 120.0, exact: bool = False,
                 validate: bool = True) -> None:
        W = topologies.validate(W) if validate else (W if is_sparse(W) else np.asarray(W, dtype=np.float64))
        self.n_agents = W.shape[0]
        if not 0 <= rank < self.n_agents:
            raise ValueError(f"rank {rank} is outside the {self.n_agents} agents of the mixing matrix")
        if not timeout > 0:
            raise ValueError(f"comm_timeout must be > 0 seconds, got {timeout!r}")
        self.rank, self.group, self.timeout, self.exact = rank, group, float(timeout), bool(exact)
        self.agents = [rank]
        self.weights, sources = neighbourhood(W, rank)
        self.neighbours = sources[1:]
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)
        self._buffers: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def _flat(self, X: torch.Tensor) -> torch.Tensor:
        if X.dim() == 2 and X.shape[0] == 1:
            X = X[0]
        if X.dim() != 1:
            raise ValueError(f"NeighbourMixer takes this rank's P-vector (or a 1×P stack), got shape {tuple(X.shape)}")
        if not X.is_contiguous():
            raise ValueError("NeighbourMixer needs a contiguous parameter vector")
        return X

    def _bufs(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], torch.Tensor]:
        """The receive buffers (a degree×P matrix and its rows, one per neighbour) and the output."""
        key = (x.numel(), x.dtype, x.device)
        if key not in self._buffers:
            recv = x.new_empty((len(self.neighbours), x.numel()))
            self._buffers[key] = ((recv, list(recv)), torch.empty_like(x))
        return self._buffers[key]

    def _wvec(self, x: torch.Tensor) -> torch.Tensor:
        key = ("w", x.dtype, x.device)
        if key not in self._buffers:
            self._buffers[key] = torch.tensor(self.weights[1:], dtype=x.dtype, device=x.device)
        return self._buffers[key]

    def start(self, X: torch.Tensor) -> Handle:
        x = self._flat(X)
        bufs, out = self._bufs(x)
        ops = [("send", x, peer) for peer in self.neighbours]
        ops += [("recv", buf, peer) for peer, buf in zip(self.neighbours, bufs[1])]
        peers = [(kind, peer) for kind, _, peer in ops]
        works = exchange(ops, group=self.group,
                         what=f"rank {self.rank}: posting the exchange with neighbour ranks {self.neighbours}")
        self.bytes_sent += len(self.neighbours) * x.numel() * x.element_size()
        return _NeighbourHandle(self, works, peers, x, bufs, out, X.shape)

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self._flat(X)
        if mask is None:
            buf, count = x.clone(), self.n_agents
        else:
            buf = x.clone() if bool(mask[self.rank]) else torch.zeros_like(x)
            count = int(mask.sum())
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {self.rank}: all-reduce of {x.numel()} values")
        self.bytes_sent += allreduce_bytes(self.n_agents, x.numel(), x.element_size())
        return buf.div_(count).view(X.shape)


class DistReducer(Reducer):
    """Sums across ranks with all-reduce (evaluation only); counts its own bytes."""

    def __init__(self, *, group=None, device: torch.device | str = "cpu", timeout: float = 120.0) -> None:
        self.group, self.device, self.timeout = group, torch.device(device), float(timeout)
        self.bytes = 0.0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.detach().to(self.device, copy=True)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {dist.get_rank(self.group)}: evaluation all-reduce")
        n = dist.get_world_size(self.group)
        self.bytes += allreduce_bytes(n, buf.numel(), buf.element_size())
        return buf.to(t.device)

    def barrier(self, what: str) -> None:
        """Every rank reached this point (a 1-element all-reduce with the timeout; not counted as traffic)."""
        work = dist.all_reduce(torch.zeros(1, device=self.device), group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {dist.get_rank(self.group)}: {what}")

    def gather(self, X: torch.Tensor) -> torch.Tensor:
        """Every rank's 1×P row, stacked in rank order (an all-gather; evaluation traffic)."""
        row = X.reshape(1, -1).to(self.device)
        n = dist.get_world_size(self.group)
        rows = [torch.empty_like(row) for _ in range(n)]
        work = dist.all_gather(rows, row, group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {dist.get_rank(self.group)}: gathering parameters")
        self.bytes += (n - 1) * row.numel() * row.element_size()
        return torch.cat(rows).to(X.device)


def _digest(obj) -> str:
    if is_sparse(obj):  # a sparse matrix: its shape and canonical CSR arrays
        S = obj.tocsr().astype(np.float64)
        S.sum_duplicates()
        S.sort_indices()
        data = b"".join(np.ascontiguousarray(a).tobytes()
                        for a in (np.asarray(S.shape, dtype=np.int64), S.indptr.astype(np.int64),
                                  S.indices.astype(np.int64), S.data))
    elif isinstance(obj, np.ndarray):
        data = np.ascontiguousarray(obj, dtype=np.float64).tobytes()
    else:
        data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def check_agreement(facts: dict, *, group=None) -> None:
    """Check once, at setup, that every rank holds the same facts; else name who differs.

    ``facts`` maps a name to a value (numpy arrays and JSON-able values are
    compared by digest), e.g. ``{"mixing matrix": W, "n_agents": 5,
    "parameter count": P, "config": cfg_dict}``. Raises ValueError on every
    rank, naming the ranks on each side and what differs.
    """
    mine = {k: _digest(v) for k, v in facts.items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    problems = []
    for key in facts:
        by_value: dict[str, list[int]] = {}
        for r, d in enumerate(everyone):
            by_value.setdefault(d.get(key, "<missing>"), []).append(r)
        if len(by_value) > 1:
            groups = sorted(by_value.items(), key=lambda kv: kv[1][0])
            desc = "; ".join(f"ranks {ranks} have {digest}" for digest, ranks in groups)
            problems.append(f"{key} differs: {desc}")
    if problems:
        raise ValueError("ranks disagree at start: " + " | ".join(problems))

