"""The distributed runtime: everything about process groups, in one package.

- :mod:`.group`: the processes a run lives in, as one object
  (:class:`LocalGroup` for one process, :class:`DistGroup` for a torchrun
  launch: joining under a per-attempt store prefix, agreement, barrier,
  naming a lost rank, dying with the launcher);
- :mod:`.exchange`: :class:`BlockMixer` (Σ_l π_jl x_l for the block of
  agents a rank holds, :func:`agent_block`, exchanging only the rows of the
  cut edges with the neighbouring ranks; :class:`NeighbourMixer` is its
  one-agent form);
- :mod:`.reduce`: :class:`DistReducer` (evaluation's reductions) and
  :func:`check_agreement`.

Communication primitives (:class:`CommError`, waits with a timeout, posting
a batch of sends and receives) live one layer down in :mod:`cdsgd.base.comm`,
shared with the MGRIT time chain; ``CommError`` is re-exported here.
"""

from ..base.comm import CommError
from .exchange import BlockMixer, NeighbourMixer, agent_block
from .reduce import DistReducer, check_agreement
from .group import DistGroup, Failure, Group, LocalGroup, Terminated, describe, join

__all__ = [
    "BlockMixer",
    "CommError",
    "DistGroup",
    "DistReducer",
    "Failure",
    "Group",
    "LocalGroup",
    "NeighbourMixer",
    "Terminated",
    "agent_block",
    "check_agreement",
    "describe",
    "join",
]
