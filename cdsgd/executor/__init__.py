"""The executor: the agents one process holds, stacked, stepped by the update rule.

:class:`Executor` holds all N agents (the simulator), one (a runtime rank)
or a block of them, and is built from parts that each own their state:
:class:`AgentStack` (models, the parameter stack, random streams,
gradients: :mod:`.gradients`), :class:`DataFeed` (per-agent data order,
:mod:`.streams`), the mixer, the rule, the :class:`Reducer` (sums over
agents held elsewhere), the :class:`Evaluator` (:mod:`.evaluation`, the
metrics rows) and the :class:`Meters` (:mod:`.meters`). :meth:`Executor.build`
(``Simulator``) and :func:`simulate` build them from keyword arguments.
"""

from .agents import INITS, AgentStack
from .core import Diverged, Executor, Simulator
from .door import SimulationResult, simulate
from .evaluation import METRIC_COLUMNS, TEXT_COLUMNS, Evaluator
from .gradients import STRATEGIES, cross_entropy
from .meters import Meters
from .reducer import Reducer
from .streams import AgentRNG, BatchStream, DataFeed

__all__ = [
    "AgentRNG",
    "AgentStack",
    "BatchStream",
    "DataFeed",
    "Diverged",
    "Evaluator",
    "Executor",
    "INITS",
    "METRIC_COLUMNS",
    "Meters",
    "Reducer",
    "STRATEGIES",
    "SimulationResult",
    "Simulator",
    "TEXT_COLUMNS",
    "cross_entropy",
    "simulate",
]
