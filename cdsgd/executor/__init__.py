"""The executor: the agents one process holds, stacked, stepped by the update rule.

:class:`Executor` (also named ``Simulator``) holds all N agents (the
simulator), one (a runtime rank) or a block of them; :func:`simulate` runs
it on your own model and data. Parts: :mod:`.streams` (per-agent data order
and random streams), :mod:`.gradients` (loop/vmap strategies),
:mod:`.evaluation` (metrics rows), :mod:`.reducer` (sums over agents held
elsewhere).
"""

from .core import INITS, Diverged, Executor, SimulationResult, Simulator, simulate
from .evaluation import METRIC_COLUMNS
from .gradients import STRATEGIES
from .reducer import Reducer
from .streams import AgentRNG, BatchStream

__all__ = [
    "AgentRNG",
    "BatchStream",
    "Diverged",
    "Executor",
    "INITS",
    "METRIC_COLUMNS",
    "Reducer",
    "STRATEGIES",
    "SimulationResult",
    "Simulator",
    "simulate",
]
