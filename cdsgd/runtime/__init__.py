"""The distributed runtime: everything about process groups, in one package.

- :mod:`.group`: the processes a run lives in, as one object
  (:class:`LocalGroup` for one process, :class:`DistGroup` for a torchrun
  launch: joining under a per-attempt store prefix, agreement, barrier,
  naming a lost rank, dying with the launcher);
- :mod:`.exchange`: :class:`NeighbourMixer` (Σ_l π_jl x_l by point-to-point
  exchange with the graph neighbours only), :class:`DistReducer`
  (evaluation all-reduces) and :func:`check_agreement`.

Communication primitives (:class:`CommError`, waits with a timeout, posting
a batch of sends and receives) live one layer down in :mod:`cdsgd.comm`,
shared with the MGRIT time chain; ``CommError`` is re-exported here.
"""

from ..comm import CommError
from .exchange import DistReducer, NeighbourMixer, check_agreement
from .group import DistGroup, Failure, Group, LocalGroup, Terminated, describe, join

__all__ = [
    "CommError",
    "DistGroup",
    "DistReducer",
    "Failure",
    "Group",
    "LocalGroup",
    "NeighbourMixer",
    "Terminated",
    "check_agreement",
    "describe",
    "join",
]
