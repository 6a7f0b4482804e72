"""The update rules (:mod:`.rules`) and the torch.optim classes built on them (:mod:`.optim`).

``make_algorithm(name, **hyper)`` gives the :class:`Algorithm` the executors
call on the stacked parameters; :class:`CDSGD`/:class:`CDMSGD` are the
same arithmetic as ``torch.optim`` optimizers for one agent in a user's own
loop. The maths of every rule is in :mod:`cdsgd.algorithms.rules` (CDSGD, CDMSGD
and the baselines) and :mod:`cdsgd.algorithms.heterogeneous` (gradient
tracking, D², quasi-global momentum), :mod:`cdsgd.algorithms.pushsum`
(Stochastic Gradient Push on directed graphs) and :mod:`cdsgd.algorithms.messages`
(CHOCO-SGD's compressed gossip, with the operators of
:mod:`cdsgd.algorithms.compression`, and RelaySum on a spanning tree) and
:mod:`cdsgd.algorithms.adpsgd` (asynchronous pairwise gossip, run event by event).
"""

from .heterogeneous import D2Algorithm, DSGTAlgorithm, QGDSGDmAlgorithm
from .optim import CDMSGD, CDSGD, DecentralizedOptimizer
from .pushsum import SGPAlgorithm
from .messages import BeerAlgorithm, ChocoAlgorithm, RelaySumAlgorithm
from .adpsgd import ADPSGDAlgorithm, is_asynchronous
from .compression import COMPRESSORS, Compressor, make_compressor
from .factory import algorithm_params, make_algorithm
from .rules import ALGORITHMS, Algorithm, StepSize, cdsgd_update, momentum_update, with_weight_decay

__all__ = [
    "ADPSGDAlgorithm",
    "ALGORITHMS",
    "Algorithm",
    "BeerAlgorithm",
    "COMPRESSORS",
    "ChocoAlgorithm",
    "Compressor",
    "CDMSGD",
    "CDSGD",
    "D2Algorithm",
    "DSGTAlgorithm",
    "DecentralizedOptimizer",
    "QGDSGDmAlgorithm",
    "RelaySumAlgorithm",
    "SGPAlgorithm",
    "StepSize",
    "algorithm_params",
    "cdsgd_update",
    "is_asynchronous",
    "make_algorithm",
    "make_compressor",
    "momentum_update",
    "with_weight_decay",
]

