r"""Across processes: the neighbour exchange, evaluation reductions, and the agreement check.

Each rank holds a contiguous block of agents (:func:`agent_block`): with
R ranks and N agents (N a multiple of R), rank r holds agents
r·N/R … (r+1)·N/R − 1; one agent per rank (N = R) is the case L = 1.
Contiguous blocks keep graph neighbours together where the numbering does:
a ring is cut into R arcs, a torus (numbered row by row) into strips of
whole rows when N/R is a multiple of its row length.

:class:`BlockMixer` computes Σ_l π_jl x_l for the block's L agents. Rows
whose neighbours are all held mix in place, as in the simulator (the block
of W among the held agents, applied by :class:`cdsgd.mixers.MatrixMixer`'s
product); for the cut edges, each rank sends every neighbouring rank, in
one message, exactly the rows that rank's agents need and receives the
rows its own agents need into a preallocated halo; the step posts all of
them at once (:func:`cdsgd.base.comm.exchange`: pairing every send and receive
of a step is what keeps a neighbour exchange free of deadlocks) and adds
the halo's contributions after the wait. CDSGD/CDMSGD steps issue no
collective at all. Centralized SGD and FedAvg all-reduce, as their
definitions require; evaluation gathers per-agent figures and the average
model (:class:`cdsgd.runtime.reduce.DistReducer`), counted apart from training traffic.
:class:`NeighbourMixer` is the one-agent form, for a user's own loop.

The executor is the simulator's (``Executor.build(..., agents=block)``) with this
mixer and reducer, so the ranks together reproduce the simulator's agents:
the same update rule, the same (seed, j) streams for initialisation, data
order and dropout. In exact mode each row is summed as the simulator's
exact mode sums it (self first, then neighbours in ascending order), so
parameters are bit-identical.

Works with gloo on CPU tensors and nccl on CUDA tensors (the device follows
the tensor), in the world or in a subgroup (ranks and W's indices are the
group's ranks). Every wait has a timeout (``comm_timeout``): a neighbour that
does not answer is an error naming it, not a hang.

Example, inside a process group (e.g. under torchrun)::

    W = topologies.mixing_matrix(topologies.build("ring", dist.get_world_size()))
    mixer = NeighbourMixer(W, dist.get_rank(), timeout=60)
    opt = CDMSGD(model.parameters(), mixer, lr=0.01)    # see docs/distributed.md
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

import topologies

from ..base.comm import exchange, wait, wait_peers
from .edges import EdgeMessages
from ..mixers import (DENSE_FRACTION, Handle, MatrixMixer, Mixer, allreduce_bytes, is_sparse, neighbourhood,
                      ordered_mean, ordered_weighted_sum, result_tensor)

__all__ = ["BlockMixer", "NeighbourMixer", "agent_block", "agents_per_process"]


def agents_per_process(n_agents: int, processes: int) -> int:
    """The number of agents each of ``processes`` processes holds, n_agents / processes.

    A ValueError naming both counts and the process counts ``n_agents``
    allows when ``processes`` does not divide it. The one check of the rule,
    used by ``cdsgd launch`` (before any process starts), by
    :func:`cdsgd.runtime.group.join` (WORLD_SIZE under torchrun) and by
    :func:`agent_block`.

    >>> agents_per_process(64, 2)
    32
    >>> agents_per_process(4, 3)
    Traceback (most recent call last):
    ...
    ValueError: 3 processes but n_agents=4: the number of processes must divide n_agents (each process holds \
n_agents/processes agents); n_agents=4 allows 1, 2 or 4 processes, or make n_agents a multiple of 3
    """
    if n_agents < 1:
        raise ValueError(f"n_agents must be an integer >= 1, got {n_agents}")
    if processes >= 1 and n_agents % processes == 0:
        return n_agents // processes
    divisors = sorted({d for i in range(1, math.isqrt(n_agents) + 1) if n_agents % i == 0 for d in (i, n_agents // i)})
    shown, more = divisors, ""
    if len(divisors) > 8:  # a long list helps less than the counts nearest the one asked for
        shown = [d for d in divisors if d < processes][-1:] + [d for d in divisors if d > processes][:1]
        more = f" (the nearest of its {len(divisors)} divisors)"
    text = [str(d) for d in shown]
    allowed = f"{', '.join(text[:-1])} or {text[-1]}" if len(text) > 1 else text[0]
    allowed = f"n_agents={n_agents} allows {allowed} process{'es' if shown != [1] else ''}{more}"
    if processes >= 1:
        allowed += f", or make n_agents a multiple of {processes}"
    raise ValueError(f"{processes} processes but n_agents={n_agents}: the number of processes must divide n_agents "
                     f"(each process holds n_agents/processes agents); {allowed}")


def agent_block(n_agents: int, world: int, rank: int) -> list[int]:
    """The agents rank ``rank`` of ``world`` holds: a contiguous block of N/R (N a multiple of R:
    :func:`agents_per_process`).

    >>> agent_block(8, 2, 1), agent_block(4, 4, 2)
    ([4, 5, 6, 7], [2])
    """
    per = agents_per_process(n_agents, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the {world} processes")
    return list(range(rank * per, (rank + 1) * per))


class _BlockHandle(Handle):
    def __init__(self, mixer: "BlockMixer", works, peers, X2, halo, out, shape, lent) -> None:
        self.mixer, self.works, self.peers = mixer, works, peers
        self.X2, self.halo, self.out, self.shape = X2, halo, out, shape
        self.lent = lent  # the pool buffers (halo, send copies) this exchange holds until it completes
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            m = self.mixer
            wait_peers(self.peers, self.works, m.timeout, m.rank, "parameters")
            if m.exact:
                stacks = (self.X2, self.halo)
                for i, (weights, src) in enumerate(m._rows):
                    ordered_weighted_sum(weights, [stacks[s][a] for s, a in src], self.out[i])
            elif m.halo_agents:
                torch.addmm(self.out, m._remote(self.X2), self.halo, out=self.out)
            self._done = True
            m.give_back(self.lent)
            self.lent = []
        return self.out.view(self.shape)


class BlockMixer(EdgeMessages, Mixer):
    """Σ_l π_jl x_l for the block of agents this rank holds, exchanging only the cut edges' rows.

    Args:
        W: the N×N mixing matrix, dense or ``scipy.sparse`` (the same on every
            rank: checked by :func:`check_agreement`).
        rank, world: this process's rank in ``group`` and the group's size; it
            holds :func:`agent_block` (N, world, rank), and agent l lives on rank
            l // (N/world). Peers are ranks of ``group`` (:mod:`cdsgd.base.comm`'s one
            convention), translated to global ranks where a message is posted,
            so a subgroup (e.g. global ranks 1, 2, 3 of four) works as the
            world does. Under a process group, a ``rank`` or ``world`` that is
            not this process's place in ``group`` is refused at once.
        group: the process group (default: the world); only its members
            build its mixer, and all of them must.
        timeout: seconds any single wait may take (``comm_timeout``).
        exact: sum each row as :func:`ordered_weighted_sum` over the agent
            itself, then its neighbours in ascending order (the simulator's
            exact mode: bit-identical results).
        validate: check W with :func:`topologies.validate`.
        view: under elastic membership, the :class:`~cdsgd.runtime.elastic.View` that places ``rank``'s
            peers (ranks of the launch) in the current process group; ``rank`` and ``world`` stay the
            launch's, and so does the agents' layout.

    ``start(X, out=None)`` takes the block's L×P stack (any trailing shape;
    a P-vector when L = 1), posts one send and one receive per neighbouring
    rank (the rows that rank needs, the rows this block needs) and, in the
    fast mode, computes the in-block part W_bb X_b meanwhile; ``wait()``
    completes the exchange, adds W_bh H (H: the received halo rows) and
    returns the result: a new tensor, or ``out`` (see :mod:`cdsgd.mixers`).
    X must not change until ``wait``. The halo and send buffers come from a
    pool: each exchange in flight holds its own and gives them back when it
    completes, so any number may be in flight and the steady state
    allocates nothing (with ``out`` given). After a :class:`CommError`
    the process group is not usable any more: stop, do not retry.

    ``W=None`` (with ``n_agents``) is Π = 11ᵀ/N: ``average`` all-reduces
    (the centralized baselines' only exchange) and ``start`` is the same
    all-reduced mean.

    Traffic: ``bytes_sent`` counts, per held agent, what it would send over
    its graph edges (degree·P·size per mixing, as the simulator counts);
    ``bytes_across`` counts what this process really sent to other processes.

    Setup is O(edges of the block): the rows come from :func:`neighbourhood`.
    """

    def __init__(self, W, rank: int, world: int, *, group=None, timeout: float = 120.0, exact: bool = False,
                 validate: bool = True, n_agents: int | None = None, view=None) -> None:
        if not timeout > 0:
            raise ValueError(f"comm_timeout must be > 0 seconds, got {timeout!r}")
        self.timeout, self.exact = float(timeout), bool(exact)
        self.rank, self.world, self.group, self.view = int(rank), int(world), group, view
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self.bytes_across = 0.0
        if W is None:  # Π = 11ᵀ/N: all-reduce only
            if n_agents is None:
                raise ValueError(f"{type(self).__name__}(None) stands for Π = 11ᵀ/N and needs n_agents")
            self.n_agents, self.matrix = int(n_agents), None
            self.agents = agent_block(self.n_agents, world, rank)
            self._check_place()
            self.degrees = torch.full((len(self.agents),), float(self.n_agents - 1), dtype=torch.float64)
            self.bytes_sent = torch.zeros(len(self.agents), dtype=torch.float64)
            self.neighbours, self.halo_agents = [], []
            return
        W = topologies.validate(W) if validate else (W if is_sparse(W) else np.asarray(W, dtype=np.float64))
        self.n_agents = n = W.shape[0]
        self.agents = agent_block(n, world, rank)
        self._check_place()
        per, lo = len(self.agents), self.agents[0]
        S = (W.tocsr() if is_sparse(W) else sp.csr_array(W)).astype(np.float64)
        S.sort_indices()
        self.matrix = S  # the whole W (what update rules check: Algorithm.check_mixing)

        rows = [neighbourhood(S, j) for j in self.agents]
        held = range(lo, lo + per)
        self.halo_agents = sorted({l for _, src in rows for l in src if l not in held})
        position = {l: h for h, l in enumerate(self.halo_agents)}
        #: row i's (weights, [(0, local row) | (1, halo row)]): self first, then neighbours ascending
        self._rows = [(w, [(0, l - lo) if l in held else (1, position[l]) for l in src]) for w, src in rows]
        self.degrees = torch.tensor([len(src) - 1 for _, src in rows], dtype=torch.float64)

        # Per neighbouring rank: the slice of the halo it fills (from W's rows: x_l with W[j, l] != 0 for a
        # held j) and the held rows it needs (from W's columns: x_j goes to l's rank when W[l, j] != 0).
        # Every rank reads the same non-zeros, so what p sends q is exactly what q receives from p, whatever
        # W's zero pattern (a directed push-sum W too): no rank waits on a message nobody sends.
        self._recv: dict[int, tuple[int, int]] = {}
        for h, l in enumerate(self.halo_agents):
            a, _ = self._recv.get(l // per, (h, h))
            self._recv[l // per] = (a, h + 1)
        St = S.T.tocsr()
        St.sort_indices()
        send: dict[int, set[int]] = {}
        for i, j in enumerate(self.agents):
            for l in neighbourhood(St, j)[1][1:]:  # the agents whose rows use x_j
                if l not in held:
                    send.setdefault(l // per, set()).add(i)
        self._send = {q: sorted(v) for q, v in send.items()}
        self._rows_out = sum(len(v) for v in self._send.values())  # rows one mixing sends to other processes
        #: the neighbouring ranks (for one agent per rank: the neighbour agents)
        self.neighbours = sorted(set(self._recv) | set(self._send))

        self._local = MatrixMixer(S[lo:lo + per][:, lo:lo + per], validate=False)
        self._halo_w = S[lo:lo + per][:, self.halo_agents] if self.halo_agents else None
        self.bytes_sent = torch.zeros(per, dtype=torch.float64)

    def _check_place(self) -> None:
        """Refuse a rank or size that is not this process's place in ``group`` (peers are its ranks)."""
        if not (dist.is_available() and dist.is_initialized()) or self.view is not None:
            return  # built outside a process group (nothing to compare with yet), or placed by an elastic view
        me, size, glob = dist.get_rank(self.group), dist.get_world_size(self.group), dist.get_rank()
        name = type(self).__name__
        if me < 0:
            raise ValueError(f"{name}: this process (global rank {glob}) is not a member of the given group; "
                             "only the group's ranks may exchange in it")
        if size != self.world:
            raise ValueError(f"{name}: the mixing matrix places its {self.n_agents} agents on {self.world} "
                             f"ranks, but the group has {size}")
        if me != self.rank:
            raise ValueError(f"{name}: rank {self.rank} was given, but this process is rank {me} of the group "
                             f"(global rank {glob}); rank and the neighbour indices are ranks of the group")

    def _post(self, ops: list, what: str) -> list:
        """:func:`exchange` of ``ops`` whose peers are ranks of the launch (placed by the view, if any)."""
        if self.view is not None:
            ops = [(kind, t, self.view.peer(q)) for kind, t, q in ops]
        return exchange(ops, group=self.group, what=what)

    # ------------------------------------------------------------ buffers

    def _flat(self, X: torch.Tensor) -> torch.Tensor:
        per = len(self.agents)
        if X.dim() == 1 and per == 1:
            X = X.unsqueeze(0)
        if X.dim() < 2 or X.shape[0] != per:
            raise ValueError(f"{type(self).__name__} takes the stack of this rank's {per} agent(s) "
                             f"({per}×P{' or a P-vector' if per == 1 else ''}), got shape {tuple(X.shape)}")
        if not X.is_contiguous():
            raise ValueError(f"{type(self).__name__} needs a contiguous parameter stack")
        return X.reshape(per, -1)

    def _lend(self, X2: torch.Tensor, rows: int, lent: list) -> torch.Tensor:
        """A rows×P buffer from the pool, held by one exchange in flight (added to ``lent``) until it completes."""
        key = (rows, X2.shape[1], X2.dtype, X2.device)
        free = self._pool.setdefault(key, [])
        buf = free.pop() if free else X2.new_empty((rows, X2.shape[1]))
        lent.append((key, buf))
        return buf

    def give_back(self, lent: list) -> None:
        """Return the pool buffers an exchange held (its handle's ``lent``) once it has completed."""
        for key, buf in lent:
            self._pool[key].append(buf)

    def _remote(self, X2: torch.Tensor) -> torch.Tensor:
        """W_bh, the weights of the halo rows (dense when dense enough, else sparse CSR)."""
        key = ("W_bh", X2.dtype, X2.device)
        if key not in self._buffers:
            B = self._halo_w
            if B.nnz > DENSE_FRACTION * B.shape[0] * B.shape[1]:
                t = torch.as_tensor(B.toarray(), dtype=X2.dtype, device=X2.device)
            else:
                with warnings.catch_warnings():  # "sparse CSR support is in beta": the product used here is stable
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.sparse_csr_tensor(torch.as_tensor(B.indptr, dtype=torch.int64),
                                                torch.as_tensor(B.indices, dtype=torch.int64),
                                                torch.as_tensor(B.data, dtype=X2.dtype), size=B.shape,
                                                device=X2.device, check_invariants=False)
            self._buffers[key] = t
        return self._buffers[key]

    def _outgoing(self, X2: torch.Tensor, q: int, lent: list) -> torch.Tensor:
        """The held rows rank q needs, as one contiguous tensor (a view when they are consecutive)."""
        idx = self._send[q]
        if idx[-1] - idx[0] + 1 == len(idx):
            return X2[idx[0]:idx[-1] + 1]
        key = ("send-index", q, X2.device)
        if key not in self._buffers:
            self._buffers[key] = torch.as_tensor(idx, device=X2.device)
        return torch.index_select(X2, 0, self._buffers[key], out=self._lend(X2, len(idx), lent))

    # ------------------------------------------------------------ mixing

    def start(self, X: torch.Tensor, *, out: torch.Tensor | None = None) -> Handle:
        X2 = self._flat(X)
        out = result_tensor(X, out)
        if self.matrix is None:  # Π = 11ᵀ/N
            return Handle(self.average(X, out=out))
        out2, lent = out.view(X2.shape), []
        halo = self._lend(X2, len(self.halo_agents), lent)
        ops = [("send", self._outgoing(X2, q, lent), q) for q in self.neighbours if q in self._send]
        ops += [("recv", halo[a:b], q) for q, (a, b) in sorted(self._recv.items())]
        peers = [(kind, q) for kind, _, q in ops]
        works = self._post(ops, f"rank {self.rank}: posting the exchange with neighbour ranks {self.neighbours}")
        if not self.exact:  # the in-block part while the halo travels
            self._local.product(X2, out2)
        row_bytes = X2.shape[1] * X2.element_size()
        self.bytes_sent += self.degrees * row_bytes
        self.bytes_across += self._rows_out * row_bytes
        return _BlockHandle(self, works, peers, X2, halo, out2, X.shape, lent)

    def move_rows(self, moves, stacks) -> float:
        """Agent d's row of every stack into agent j's, for each ``(j, d)`` in turn: a copy when this rank holds
        both, else one message per stack from d's rank to j's (every rank walks ``moves`` in the same order, so
        the messages pair up). Returns the bytes this rank sent."""
        per, lo = len(self.agents), self.agents[0]
        ops, into, sent = [], [], 0.0
        with torch.no_grad():
            for j, d in moves:
                to, frm = j // per, d // per
                for t in stacks:
                    if to == frm == self.rank:
                        t[j - lo] = t[d - lo]
                    elif frm == self.rank:
                        ops.append(("send", t[d - lo].contiguous(), to))
                        sent += t[d - lo].numel() * t.element_size()
                    elif to == self.rank:
                        buffer = torch.empty_like(t[j - lo])
                        ops.append(("recv", buffer, frm))
                        into.append((t, j - lo, buffer))
            works = self._post(ops, f"rank {self.rank}: a returning agent's model and state")
            wait_peers([(kind, q) for kind, _, q in ops], works, self.timeout, self.rank, "a returning agent's model")
            for t, row, buffer in into:
                t[row] = buffer
        self.bytes_across += sent
        return sent

    def average(self, X: torch.Tensor, mask: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        X2 = self._flat(X)
        out = result_tensor(X, out, "average")
        lo, per = self.agents[0], len(self.agents)
        if self.exact:
            return self._ordered_average(X2, mask, out)
        if mask is None:
            part, count = X2.sum(dim=0), self.n_agents
        else:
            mine = mask[lo:lo + per].to(torch.bool).to(X2.device)
            part, count = X2[mine].sum(dim=0), int(mask.sum())
        work = dist.all_reduce(part, group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {self.rank}: all-reduce of {X2.shape[1]} values")
        P, size = X2.shape[1], X2.element_size()
        self.bytes_sent += allreduce_bytes(self.n_agents, P, size)
        self.bytes_across += allreduce_bytes(self.world, P, size)
        out.view(X2.shape).copy_(part.div_(count).expand_as(X2))
        return out


    def _ordered_average(self, X2: torch.Tensor, mask, out: torch.Tensor) -> torch.Tensor:
        """The exact mode's average: every block gathered, the rows summed in agent order (:func:`ordered_mean`,
        as the simulator's exact mode), so the result has the simulator's bits."""
        live = dist.get_world_size(self.group)  # the world, but for ranks an elastic run has lost
        blocks = [torch.empty_like(X2) for _ in range(live)]
        work = dist.all_gather(blocks, X2.contiguous(), group=self.group, async_op=True)
        wait(work, self.timeout, f"rank {self.rank}: all-gather of {X2.shape[1]} values per agent (exact mode)")
        P, size = X2.shape[1], X2.element_size()
        self.bytes_sent += allreduce_bytes(self.n_agents, P, size)
        self.bytes_across += (live - 1) * X2.numel() * size
        every = torch.cat(blocks) if self.view is None else self.view.spread(blocks, 0.0)  # a lost rank's rows: 0
        mean = ordered_mean(every, mask, torch.empty(P, dtype=X2.dtype, device=X2.device))
        out.view(X2.shape).copy_(mean.expand_as(X2))
        return out


class NeighbourMixer(BlockMixer):
    """Σ_l π_jl x_l for this rank's one agent (agent = rank), by exchange with its neighbours.

    The one-agent-per-rank :class:`BlockMixer`, for a user's own training
    loop (see :mod:`cdsgd.algorithms.optim`): ``start(x)`` takes this rank's
    P-vector (or a 1×P stack), ``neighbours`` are the neighbour ranks.

    Args:
        W: the N×N mixing matrix (N = the group's size); this rank uses its row.
        rank: this agent's index: its rank in ``group``, ``dist.get_rank(group)``
            (not its global rank), as are W's indices.
        group, timeout, exact, validate: as :class:`BlockMixer`.
    """

    def __init__(self, W, rank: int, *, group=None, timeout: float = 120.0, exact: bool = False,
                 validate: bool = True) -> None:
        n = W.shape[0] if is_sparse(W) else np.shape(W)[0]
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} is outside the {n} agents of the mixing matrix")
        super().__init__(W, rank, n, group=group, timeout=timeout, exact=exact, validate=validate)
