"""The lines a run says when something needs the user: evaluation that costs more than training,
a diverged run, an interrupted one. Each names the keys to change and the command to type.

    >>> from cdsgd.config import load_config
    >>> diverged_hint(load_config(overrides=["lr=1e6", "momentum=0.95"]))
    'lr=1e+06 is likely too high for this run: try a lower lr (e.g. lr=1e+05) or a lower momentum than 0.95'
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from .plan import hyperparameters
from .progress import format_seconds

__all__ = ["EVAL_HINT_SECONDS", "diverged_hint", "eval_hint", "resume_hint"]

#: evaluation shorter than this (in seconds, all evaluations so far) is never worth a hint
EVAL_HINT_SECONDS = 1.0


def eval_hint(cfg: Config, sim) -> str:
    """When evaluation took longer than training (and at least :data:`EVAL_HINT_SECONDS`): the keys
    that make it cheaper; else ``""``. ``sim``: the executor (its clocks, evaluated agents, test set)."""
    train, evaluation = sim.train_seconds, sim.eval_seconds
    if evaluation <= train or evaluation < EVAL_HINT_SECONDS:
        return ""
    return (f"evaluation took {format_seconds(evaluation)} against {format_seconds(train)} of training; "
            f"it evaluates {len(sim.eval_agents)} agent(s) on {len(sim.test_set[1]) if sim.test_set else 0} "
            f"test samples every {f'{cfg.eval_steps} step(s)' if cfg.eval_steps else f'{cfg.eval_every} epoch(s)'}: "
            "eval_agents=, eval_samples= or a larger eval_every= (eval_steps=) make it cheaper (docs/running.md)")


def diverged_hint(cfg: Config) -> str:
    """What to change after a run diverged: a lower step size (a tenth, as an example), or less momentum."""
    hint = f"lr={cfg.lr:g} is likely too high for this run: try a lower lr (e.g. lr={cfg.lr / 10:.3g})"
    if "momentum" in hyperparameters(cfg):
        hint += f" or a lower momentum than {cfg.momentum:g}"
    return hint


def resume_hint(cfg: Config, out: Path, world: int, *, saved: bool = False) -> str:
    """How to continue an interrupted run; ``saved``: it wrote a checkpoint when it stopped."""
    verb = f"cdsgd launch --nproc-per-node {world}" if cfg.executor == "torch" else "cdsgd run"
    how = f"{verb} {out / 'config.toml'} resume=true"
    if not (cfg.checkpoint_every or saved):
        return (f"it wrote no checkpoints (checkpoint_every=0), so '{how}' would start over; "
                "set checkpoint_every= to make runs resumable")
    return f"continue it with: {how}"
