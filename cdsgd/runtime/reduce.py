"""Across processes, besides the neighbour exchange: evaluation's reductions and the agreement check.

:class:`DistReducer` sums, gathers and chains per-agent figures across the
ranks for evaluation (counted apart from training traffic);
:func:`check_agreement` checks once, at setup, that every rank holds the
same facts (mixing matrix, sizes, config).
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..base.comm import exchange, global_rank, wait
from ..executor.reducer import Reducer
from ..mixers import allreduce_bytes, is_sparse

__all__ = ["DistReducer", "check_agreement"]


class DistReducer(Reducer):
    """Evaluation's reductions across ranks (all-reduce, all-gather, an ordered chain); counts its own bytes.

    ``view``: under elastic membership, the :class:`~cdsgd.runtime.elastic.View` of the live ranks; what is
    gathered comes back in the launch's agent order, a lost rank's rows 0 (they are offline: no figure counts
    them).
    """

    def __init__(self, *, group=None, device: torch.device | str = "cpu", timeout: float = 120.0,
                 view=None) -> None:
        self.group, self.device, self.timeout, self.view = group, torch.device(device), float(timeout), view
        self.bytes = 0.0

    def _wait(self, work, what: str, peer: int | None = None) -> None:
        wait(work, self.timeout, f"rank {dist.get_rank(self.group)}: {what}", peer)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.detach().to(self.device, copy=True)
        self._wait(dist.all_reduce(buf, group=self.group, async_op=True), "evaluation all-reduce")
        n = dist.get_world_size(self.group)
        self.bytes += allreduce_bytes(n, buf.numel(), buf.element_size())
        return buf.to(t.device)

    def agent_values(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's L×k block of per-agent figures, stacked in rank (= agent) order (an all-gather)."""
        mine = local.detach().to(self.device).contiguous()
        n = dist.get_world_size(self.group)
        blocks = [torch.empty_like(mine) for _ in range(n)]
        self._wait(dist.all_gather(blocks, mine, group=self.group, async_op=True), "gathering per-agent figures")
        self.bytes += (n - 1) * mine.numel() * mine.element_size()
        return self._spread(blocks).to(local.device)

    def _spread(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(blocks) if self.view is None else self.view.spread(blocks, 0.0)

    def sum_in_order(self, acc: torch.Tensor, add: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """A chain through the ranks: rank r receives the running sum from r − 1, adds its agents
        (``add(acc)``, in place), passes it on; the last rank's total goes to every rank.

        The additions happen in agent order whatever the layout, so the result is
        the one the simulator gets by adding its rows one by one (exact mode).
        """
        rank, n = dist.get_rank(self.group), dist.get_world_size(self.group)
        buf = acc.to(self.device)
        if rank > 0:
            works = exchange([("recv", buf, rank - 1)], group=self.group, what="the ordered evaluation sum")
            self._wait(works[0], f"receiving the running sum from rank {rank - 1}", rank - 1)
        add(buf)
        if rank < n - 1:
            works = exchange([("send", buf, rank + 1)], group=self.group, what="the ordered evaluation sum")
            self._wait(works[0], f"sending the running sum to rank {rank + 1}", rank + 1)
            self.bytes += buf.numel() * buf.element_size()
        last = global_rank(self.group, n - 1)
        self._wait(dist.broadcast(buf, src=last, group=self.group, async_op=True), "broadcasting the ordered sum")
        if rank == n - 1:
            self.bytes += (n - 1) * buf.numel() * buf.element_size()
        return buf.to(acc.device)

    def barrier(self, what: str) -> None:
        """Every rank reached this point (a 1-element all-reduce with the timeout; not counted as traffic)."""
        self._wait(dist.all_reduce(torch.zeros(1, device=self.device), group=self.group, async_op=True), what)

    def gather(self, X: torch.Tensor) -> torch.Tensor | None:
        """Every rank's L×P block, stacked in rank (= agent) order on rank 0; None on the others."""
        block = X.reshape(X.shape[0], -1).contiguous().to(self.device)
        rank, n = dist.get_rank(self.group), dist.get_world_size(self.group)
        blocks = [torch.empty_like(block) for _ in range(n)] if rank == 0 else None
        first = global_rank(self.group, 0)
        self._wait(dist.gather(block, blocks, dst=first, group=self.group, async_op=True), "gathering parameters")
        if rank != 0:
            self.bytes += block.numel() * block.element_size()
            return None
        return self._spread(blocks).to(X.device)


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

