"""Algorithms by name: :func:`make_algorithm` and the hyperparameters each takes."""

from __future__ import annotations

from .rules import ALGORITHMS, Algorithm

__all__ = ["UnknownHyperparameter", "algorithm_params", "make_algorithm"]


def algorithm_params(name: str) -> list[str]:
    """The hyperparameters ``make_algorithm(name, ...)`` accepts."""
    import inspect

    names = []
    for klass in ALGORITHMS.get(name).__mro__[:-1]:  # all but object
        if "__init__" in klass.__dict__:
            params = inspect.signature(klass.__dict__["__init__"]).parameters.values()
            names += [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.name not in names]
    return names


class UnknownHyperparameter(ValueError):
    """:func:`make_algorithm` was given a hyperparameter ``name`` that algorithm ``algorithm`` does not take.

    ``allowed`` lists the ones it takes, so that a caller with options of
    its own (the executor) can name both in its message.
    """

    def __init__(self, algorithm: str, name: str, allowed: list[str]) -> None:
        self.algorithm, self.name, self.allowed = algorithm, name, list(allowed)
        super().__init__(f"algorithm {algorithm!r} takes no hyperparameter {name!r}; allowed: {', '.join(allowed)}")


def make_algorithm(name: str, **hyper) -> Algorithm:
    """The algorithm ``name`` with hyperparameters ``hyper``.

    Common: ``lr`` (required: no step size suits every model), ``lr_schedule``,
    ``lr_tau``, ``lr_power``, ``lr_min``, ``lr_decay_steps``, ``lr_step_size``,
    ``lr_gamma``, ``lr_warmup`` (:class:`~cdsgd.algorithms.StepSize`),
    ``weight_decay``, ``optimizer``, ``betas``, ``eps`` (the local optimizer,
    :mod:`cdsgd.algorithms.local_optim`; ``"adamw"`` for the rules that take
    it, refused by the others). Every rule but ``cdsgd``,
    ``sgd`` and ``fedavg``: ``momentum``, ``nesterov``. ``fedavg``:
    ``local_steps`` or ``local_epochs``, ``fedavg_fraction``. ``choco``,
    ``beer``: ``compression``, ``compression_params``, ``consensus_step``
    (:func:`algorithm_params` lists each rule's). A hyperparameter not given
    takes its default, the same for every rule and door (``cdsgd run``
    included): :data:`cdsgd.base.checks.HYPER_DEFAULTS` (``momentum`` 0.95,
    ``nesterov`` True, ``weight_decay`` 0, one local epoch per FedAvg round, ...).
    Unknown names are refused, naming the known ones; unknown
    hyperparameters with :class:`UnknownHyperparameter`, naming the allowed ones.
    """
    klass = ALGORITHMS.get(name)
    allowed = algorithm_params(name)
    unknown = sorted(set(hyper) - set(allowed))
    if unknown:
        raise UnknownHyperparameter(name, unknown[0], allowed)
    if "lr" not in hyper:
        raise ValueError(f"algorithm {name!r} needs lr")
    return klass(**hyper)
