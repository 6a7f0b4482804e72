"""The update rules (:mod:`.rules`) and the torch.optim classes built on them (:mod:`.optim`).

``make_algorithm(name, **hyper)`` gives the :class:`Algorithm` the executors
call on the stacked parameters; :class:`CDSGD`/:class:`CDMSGD` are the
same arithmetic as ``torch.optim`` optimizers for one agent in a user's own
loop. The maths of every rule is in :mod:`cdsgd.algorithms.rules` (CDSGD, CDMSGD),
:mod:`cdsgd.algorithms.baselines` (sgd, msgd, fedavg, local) and :mod:`cdsgd.algorithms.heterogeneous` (gradient
tracking, D², quasi-global momentum), :mod:`cdsgd.algorithms.pushsum`
(Stochastic Gradient Push on directed graphs) and :mod:`cdsgd.algorithms.messages`
(CHOCO-SGD's compressed gossip, with the operators of
:mod:`cdsgd.algorithms.compression`, and RelaySum on a spanning tree) and
:mod:`cdsgd.algorithms.adpsgd` (asynchronous pairwise gossip, run event by event) and
:mod:`cdsgd.algorithms.outer` (local steps and an outer optimizer: DiLoCo, Streaming DiLoCo's fragments,
NoLoCo). Every rule
takes its step sizes from :mod:`cdsgd.algorithms.step_sizes` and, where one is defined, an AdamW
local optimizer from :mod:`cdsgd.algorithms.local_optim` (``optimizer="adamw"``).
"""

from .rules import ALGORITHMS, Algorithm, cdsgd_update, momentum_update, with_weight_decay
from .baselines import FedAvgAlgorithm, LocalAlgorithm, MSGDAlgorithm, SGDAlgorithm
from .heterogeneous import D2Algorithm, DSGTAlgorithm, QGDSGDmAlgorithm
from .optim import CDMSGD, CDSGD, DecentralizedOptimizer
from .pushsum import SGPAlgorithm
from .messages import BeerAlgorithm, ChocoAlgorithm, RelaySumAlgorithm
from .adpsgd import ADPSGDAlgorithm, is_asynchronous
from .outer import DiLoCoAlgorithm, NoLoCoAlgorithm
from .compression import COMPRESSORS, Compressor, make_compressor
from .factory import algorithm_params, make_algorithm
from .local_optim import AdamW, adamw_direction
from .step_sizes import StepSize

__all__ = [
    "ADPSGDAlgorithm",
    "AdamW",
    "ALGORITHMS",
    "Algorithm",
    "BeerAlgorithm",
    "COMPRESSORS",
    "ChocoAlgorithm",
    "Compressor",
    "CDMSGD",
    "CDSGD",
    "D2Algorithm",
    "DiLoCoAlgorithm",
    "DSGTAlgorithm",
    "DecentralizedOptimizer",
    "FedAvgAlgorithm",
    "LocalAlgorithm",
    "MSGDAlgorithm",
    "NoLoCoAlgorithm",
    "QGDSGDmAlgorithm",
    "RelaySumAlgorithm",
    "SGDAlgorithm",
    "SGPAlgorithm",
    "StepSize",
    "adamw_direction",
    "algorithm_params",
    "cdsgd_update",
    "is_asynchronous",
    "make_algorithm",
    "make_compressor",
    "momentum_update",
    "with_weight_decay",
]

