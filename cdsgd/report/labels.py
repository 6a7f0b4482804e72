"""How figures and tables name things: algorithms as the literature writes them, series as words.

A sweep's series is a set of (key, value) pairs; :func:`series_label` reads it as a reader would
write it in a paper: ``ring, CDMSGD`` rather than ``topology=ring, algorithm=cdmsgd``. Keys whose
values name themselves (an algorithm, a topology, a data set, a model, a network) show the value
alone; a network and a few counts read as words (``edge network``, ``16 agents``); any other key stays ``key=value``, so no value
is ever ambiguous.

>>> series_label([("topology", "ring"), ("algorithm", "cdmsgd")])
'ring, CDMSGD'
>>> series_label([("algorithm", "qg_dsgdm"), ("n_agents", 16), ("lr", 0.1)])
'QG-DSGDm, 16 agents, lr=0.1'
>>> algorithm_name("d2"), algorithm_name("my_rule")
('D²', 'my_rule')
"""

from __future__ import annotations

__all__ = ["ALGORITHM_NAMES", "algorithm_name", "value_label", "series_label", "status_note"]

#: the registry's names (cdsgd.algorithms.ALGORITHMS) as papers write them
ALGORITHM_NAMES = {
    "cdsgd": "CDSGD", "cdmsgd": "CDMSGD", "sgd": "SGD", "msgd": "momentum SGD", "fedavg": "FedAvg",
    "local": "local only", "dsgt": "DSGT", "d2": "D²", "qg_dsgdm": "QG-DSGDm", "sgp": "SGP",
    "choco": "CHOCO-SGD", "relaysum": "RelaySum", "beer": "BEER", "adpsgd": "AD-PSGD",
}

#: keys whose value names itself in a legend (a graph file by its stem)
_SELF_NAMED = ("algorithm", "topology", "dataset", "model")

#: keys whose value reads as a count of something
_COUNTS = {"n_agents": "agents", "epochs": "epochs", "local_steps": "local steps", "bucketing": "buckets"}


def algorithm_name(name: str) -> str:
    """An algorithm's name as the literature writes it; an unknown name unchanged."""
    return ALGORITHM_NAMES.get(str(name), str(name))


def value_label(key: str, value) -> str:
    """One (key, value) pair in words: ``CDMSGD``, ``ring``, ``16 agents``, ``lr=0.1``.

    >>> value_label("compression", "none"), value_label("partition", "classes")
    ('no compression', 'partition=classes')
    """
    from ..config import short_value

    text = short_value(value)
    if key == "algorithm":
        return algorithm_name(text)
    if key in _SELF_NAMED:
        return text
    if key == "network":
        return f"{text} network"
    if key == "compression":
        return "no compression" if text == "none" else text
    if key in _COUNTS and text.isdigit():
        return f"{text} {_COUNTS[key][:-1] if text == '1' else _COUNTS[key]}"
    return f"{key}={text}"


def series_label(pairs) -> str:
    """A series' (key, value) pairs as a legend reads them, in their order; 'runs' when there are none."""
    return ", ".join(value_label(k, v) for k, v in pairs) or "runs"


def status_note(counts: dict[str, int], seeds: int) -> str:
    """What a legend adds for runs that did not complete: ' (diverged)', ' (1 of 3 diverged)', ''.

    >>> status_note({"diverged": 2}, 2), status_note({"diverged": 1, "failed": 1}, 3), status_note({}, 2)
    (' (diverged)', ' (1 of 3 diverged, 1 of 3 failed)', '')
    """
    if not counts:
        return ""
    if len(counts) == 1 and sum(counts.values()) == seeds:
        return f" ({next(iter(counts))})"
    return " (" + ", ".join(f"{n} of {seeds} {s}" for s, n in sorted(counts.items())) + ")"
