"""The update rules (:mod:`.rules`) and the torch.optim classes built on them (:mod:`.optim`).

``make_algorithm(name, **hyper)`` gives the :class:`Algorithm` the executors
call on the stacked parameters; :class:`CDSGD`/:class:`CDMSGD` are the
same arithmetic as ``torch.optim`` optimizers for one agent in a user's own
loop. The maths of every rule is in :mod:`cdsgd.algorithms.rules` (CDSGD, CDMSGD
and the baselines) and :mod:`cdsgd.algorithms.heterogeneous` (gradient
tracking, D², quasi-global momentum) and :mod:`cdsgd.algorithms.pushsum`
(Stochastic Gradient Push on directed graphs).
"""

from ..base.compat import module_getattr
from .heterogeneous import D2Algorithm, DSGTAlgorithm, QGDSGDmAlgorithm
from .optim import CDMSGD, CDSGD, DecentralizedOptimizer
from .pushsum import SGPAlgorithm
from .factory import algorithm_params, make_algorithm
from .rules import ALGORITHMS, Algorithm, StepSize, cdsgd_update, momentum_update, with_weight_decay

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CDMSGD",
    "CDSGD",
    "D2Algorithm",
    "DSGTAlgorithm",
    "DecentralizedOptimizer",
    "QGDSGDmAlgorithm",
    "SGPAlgorithm",
    "StepSize",
    "algorithm_params",
    "cdsgd_update",
    "make_algorithm",
    "momentum_update",
    "with_weight_decay",
]

__getattr__ = module_getattr(__name__)  # old names (cdsgd.base.compat)
