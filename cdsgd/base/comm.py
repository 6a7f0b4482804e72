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
    post a list of sends and receives together and return the work handles:
    one ``batch_isend_irecv`` on nccl (pairing every send and receive of a
    step in one batch is what keeps a neighbour exchange free of deadlocks),
    one posting per operation on gloo (what gloo's batch does anyway), so
    that an operation whose peer is gone fails alone, naming that peer.

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
import socket
from typing import Sequence

import torch

__all__ = ["CommError", "exchange", "first_line", "free_port", "global_rank", "wait", "wait_peers"]


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


def wait_peers(peers, works, timeout: float, rank: int, noun: str) -> None:
    """Wait for each posted send and receive of an exchange (:func:`exchange`'s works, with their
    ``(kind, peer)``), naming the neighbour rank and what travelled (``noun``) in a :class:`CommError`."""
    for (kind, peer), work in zip(peers, works):
        verb = f"receiving {noun} from" if kind == "recv" else f"sending {noun} to"
        wait(work, timeout, f"rank {rank}: {verb} neighbour rank {peer}", peer)


def global_rank(group, peer: int) -> int:
    """The global rank of rank ``peer`` of ``group`` (the default group: itself)."""
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return int(peer)
    return dist.get_global_rank(group, int(peer))


class _Failed:
    """The work of an operation that could not even be posted: waiting on it raises the posting's error."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self, timeout=None):
        raise self.error

    def is_completed(self) -> bool:
        return True


def exchange(ops: Sequence[tuple[str, torch.Tensor, int]], *, group=None, what: str) -> list:
    """Post ``[("send"|"recv", tensor, peer), ...]``; return the works (same order).

    ``peer`` is a rank of ``group``. On gloo each operation is posted on its
    own, every receive before the sends (gloo's ``batch_isend_irecv`` is that same loop), so an operation that
    cannot even be posted (its peer's connection is closed) fails alone: its
    work raises on :func:`wait`, which then names that peer, while the others
    stay posted. On other backends (nccl needs the grouping to stay free of
    deadlocks) the list is one ``batch_isend_irecv``, and a failed posting is
    a CommError naming ``what``.
    """
    import torch.distributed as dist

    if not ops:
        return []
    kinds = {"send": dist.isend, "recv": dist.irecv}
    for kind, _, _ in ops:
        if kind not in kinds:
            raise ValueError(f"operation {kind!r} is unknown; allowed: send, recv")
    targets = [(kinds[kind], tensor, global_rank(group, peer)) for kind, tensor, peer in ops]
    if dist.get_backend(group) == "gloo":
        # receives are posted before sends: gloo sends a message only once its receiver has said it is
        # ready, and a rank's notice rides its TCP connection behind the rank's own outgoing message, so
        # sends first made the two directions of a pair take turns on a slow link (about 1.5 times the
        # step time at 10 Mbit/s, benchmarks/network.py). Sends keep their order, and so do receives:
        # the messages pair up as before.
        works: list = [None] * len(targets)
        for i in sorted(range(len(targets)), key=lambda i: ops[i][0] != "recv"):
            post, tensor, peer = targets[i]
            try:
                works[i] = post(tensor, peer, group)
            except RuntimeError as e:  # a closed connection fails the posting itself
                works[i] = _Failed(e)
        return works
    p2p = [dist.P2POp(post, tensor, peer, group) for post, tensor, peer in targets]
    try:
        return dist.batch_isend_irecv(p2p)
    except RuntimeError as e:  # a closed connection can fail the posting itself
        raise CommError(f"{what} failed (a neighbour's process is gone?): {first_line(e)}") from None


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``addr`` now (never 0: torchrun hangs on port 0).

    The OS picks it; another process may take it before it is used, so use
    it at once. ``addr`` may be IPv4 or IPv6.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    if not 0 < port < 65536:
        raise OSError(f"the OS gave port {port} on {addr}, not a usable port")
    return port
