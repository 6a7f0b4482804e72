"""Checkpoints of a run: atomic per-rank files, agreement on the latest complete one, safe loading.

Layout, inside a run's output folder::

    checkpoints/step-000000120/rank-0.pt     # the simulator: one file, all agents
    checkpoints/step-000000120/rank-3.pt     # the runtime: one file per rank, its own agent

Each file is written atomically (a temporary file in the same folder,
flushed and fsync'd, then renamed over the final name, and the folder
fsync'd), so a file that exists is whole: a process killed while writing
leaves only a ``*.tmp`` that is ignored. A step is *complete* when every
rank has its file; ranks learn it together (a barrier after writing), and
only then delete their older checkpoints, so each rank always keeps its
latest complete checkpoint. On resume the ranks exchange the steps they
hold and continue from the largest step all of them hold.

Files are read with ``torch.load(weights_only=True)``: tensors, numbers,
strings, lists and dicts only, never arbitrary pickled objects. A file that
does not load, is not a cdsgd checkpoint, or belongs to another config,
world size or rank is a ValueError naming the file and what differs.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     _ = save(out, 8, 0, {"config": {"lr": 0.1}, "world": 1, "x": torch.ones(2)})
    ...     _ = save(out, 16, 0, {"config": {"lr": 0.1}, "world": 1, "x": torch.zeros(2)})
    ...     prune(out, 0, keep=16)
    ...     steps_on_disk(out, 0), load(checkpoint_path(out, 16, 0), config={"lr": 0.1}, world=1)["x"].tolist()
    ([16], [0.0, 0.0])
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..base.files import atomic_write
from ..config import VOLATILE_KEYS
from ..executor.core import state_format_problem

__all__ = ["EXTENDABLE_KEYS", "FORMAT", "VOLATILE_KEYS", "checkpoint_path", "save", "steps_on_disk", "load", "prune",
           "config_for_checkpoint", "config_mismatch", "remove_all"]

#: the format tag every checkpoint carries (2: per-agent train-loss sums and the bytes across processes)
FORMAT = "cdsgd-checkpoint/2"



def _root(out) -> Path:
    return Path(out) / "checkpoints"


def checkpoint_path(out, step: int, rank: int) -> Path:
    """Where rank ``rank`` keeps its checkpoint of step ``step``."""
    return _root(out) / f"step-{step:09d}" / f"rank-{rank}.pt"


def save(out, step: int, rank: int, payload: dict) -> Path:
    """Write ``payload`` (plus the format tag, step and rank) as rank's checkpoint of ``step``, atomically."""
    path = checkpoint_path(out, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: torch.save({**payload, "format": FORMAT, "step": int(step),
                                                    "rank": int(rank)}, f))


def steps_on_disk(out, rank: int) -> list[int]:
    """The steps for which rank ``rank`` holds a (whole) checkpoint file, ascending."""
    root = _root(out)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        if d.name.startswith("step-") and d.name[5:].isdigit() and (d / f"rank-{rank}.pt").is_file():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def prune(out, rank: int, keep: int, spare: int | None = None) -> None:
    """Delete rank's checkpoints older than step ``keep`` but that of step ``spare`` (and step folders left
    empty)."""
    for step in steps_on_disk(out, rank):
        if step < keep and step != spare:
            path = checkpoint_path(out, step, rank)
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()  # only when no other rank's file is left in it
            except OSError:
                pass


def prune_elastic(out, rank: int, previous: int, whole: int, *, everyone: bool) -> int:
    """Under elastic membership, as rank writes a checkpoint: delete its checkpoints older than the
    ``previous`` one but the last whole one (every rank of the launch wrote it: a resume of all ranks starts
    from it). Each step's agreement says every live rank wrote ``previous``: with ``everyone`` alive, it is
    whole. Returns the step of the last whole checkpoint."""
    whole = previous if everyone else whole
    prune(out, rank, keep=previous, spare=whole)
    return whole


def remove_all(out) -> None:
    """Remove the checkpoints folder (a fresh start into a folder that held an earlier run)."""
    shutil.rmtree(_root(out), ignore_errors=True)


#: keys a resumed run may change beyond the volatile ones: ``epochs`` (a finished run can be extended)
EXTENDABLE_KEYS = ("epochs",)


def config_for_checkpoint(cfg_dict: dict) -> dict:
    """The config values a checkpoint must agree on (all keys except :data:`VOLATILE_KEYS` and ``epochs``).

    ``epochs`` may grow on resumption: the steps already taken are the same
    whatever the run's length (no schedule depends on it), so a run resumed
    with more epochs continues exactly as a longer run would have.
    """
    return {k: v for k, v in cfg_dict.items() if k not in VOLATILE_KEYS and k not in EXTENDABLE_KEYS}


def config_mismatch(saved: dict, current: dict) -> str | None:
    """The first config key whose value differs, as a phrase, or None."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            return f"{key} is {saved.get(key)!r} there but {current.get(key)!r} in this run"
    return None


def load(path, *, config: dict, world: int, rank: int = 0) -> dict:
    """Read one checkpoint file safely and check it belongs to this run; a ValueError otherwise."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(path)!r} does not exist") from None
    except Exception as e:  # noqa: BLE001 - corrupt zip, truncated file, a pickle asking for globals...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"checkpoint {str(path)!r} is corrupted or not a cdsgd checkpoint "
                         f"(torch.load with weights_only=True refused it: {type(e).__name__}: {first})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not a {FORMAT} file (written by another cdsgd version? "
                         "start the run afresh)")
    if payload.get("world") != world:
        raise ValueError(f"checkpoint {str(path)!r} was written by a run of world size {payload.get('world')}, "
                         f"this run has world size {world}")
    if payload.get("rank") != rank:
        raise ValueError(f"checkpoint {str(path)!r} holds rank {payload.get('rank')}, not rank {rank}")
    diff = config_mismatch(payload.get("config", {}), config)
    if diff:
        raise ValueError(f"checkpoint {str(path)!r} belongs to another config: {diff}")
    problem = state_format_problem(payload["simulator"]) if isinstance(payload.get("simulator"), dict) else ""
    if problem:  # refused here, before the run says it continues from this checkpoint
        raise ValueError(f"checkpoint {str(path)!r} holds executor state {problem}")
    return payload
