r"""Communication primitives shared by everything that talks across processes.

One place for what the neighbour mixer, the runtime's reducers and group,
and the MGRIT time chain all need:

:class:`CommError`
    a peer or collective did not answer in time, or its connection broke;
    ``peer`` names the rank (of the group) when it is known.
:func:`wait`
    wait for a ``torch.distributed`` work handle with a timeout, turning
    gloo's failures into a one-line :class:`CommError`.
:func:`exchange`
    post a list of sends and receives as **one** ``batch_isend_irecv``
    (pairing every send and receive of a step in one batch is what keeps a
    neighbour exchange free of deadlocks) and return the work handles.

One point-to-point convention everywhere: **a peer is a rank of the given
group** (of the default group when ``group`` is None). :func:`exchange`
translates it to the global rank that ``P2POp`` takes, with
``dist.get_global_rank``, so subgroups are addressed correctly on every
torch release this package supports (≥ 2.4).

Example (inside a process group of two ranks)::

    x = torch.full((4,), float(rank)); buf = torch.empty(4)
    works = exchange([("send", x, 1 - rank), ("recv", buf, 1 - rank)], what="swap")
    for w in works:
        wait(w, 60, "swap")
"""

from __future__ import annotations

import datetime
import re
from typing import Sequence

import torch

__all__ = ["CommError", "exchange", "first_line", "global_rank", "wait"]


class CommError(RuntimeError):
    """A neighbour or collective did not answer in time, or its connection broke.

    ``peer`` is the rank (of the group used) that did not answer when one is
    known (a neighbour exchange names it), else None (a collective, or a
    batch that failed as it was posted).
    """

    def __init__(self, msg: str, peer: int | None = None) -> None:
        super().__init__(msg)
        self.peer = peer


def first_line(e: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", msg)
    return msg.split(". This is typically caused")[0]


def wait(work, timeout: float, what: str, peer: int | None = None) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a CommError saying ``what`` failed otherwise."""
    try:
        ok = work.wait(datetime.timedelta(seconds=float(timeout)))
    except RuntimeError as e:
        msg = first_line(e)
        if "timed out" in msg.lower() or "timeout" in msg.lower():
            raise CommError(f"{what}: no answer within comm_timeout={timeout:g} s ({msg})", peer) from None
        raise CommError(f"{what} failed: {msg}", peer) from None
    if ok is False:
        raise CommError(f"{what}: no answer within comm_timeout={timeout:g} s", peer)


def global_rank(group, peer: int) -> int:
    """The global rank of rank ``peer`` of ``group`` (the default group: itself)."""
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return int(peer)
    return dist.get_global_rank(group, int(peer))


def exchange(ops: Sequence[tuple[str, torch.Tensor, int]], *, group=None, what: str) -> list:
    """Post ``[("send"|"recv", tensor, peer), ...]`` as one batch; return the works (same order).

    ``peer`` is a rank of ``group``. A batch that cannot even be posted (a
    closed connection) is a CommError naming ``what``.
    """
    import torch.distributed as dist

    if not ops:
        return []
    kinds = {"send": dist.isend, "recv": dist.irecv}
    p2p = []
    for kind, tensor, peer in ops:
        if kind not in kinds:
            raise ValueError(f"operation {kind!r} is unknown; allowed: send, recv")
        p2p.append(dist.P2POp(kinds[kind], tensor, global_rank(group, peer), group))
    try:
        return dist.batch_isend_irecv(p2p)
    except RuntimeError as e:  # a closed connection can fail the posting itself
        raise CommError(f"{what} failed (a neighbour's process is gone?): {first_line(e)}") from None
