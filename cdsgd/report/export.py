"""A trained model out of a run folder: one agent's parameters, or the average of all agents'.

A run made with ``save_params = true`` leaves ``params.pt`` in its folder:
the final N×P parameters, row j agent j's flat parameter vector in the order
of ``model.named_parameters()`` (:class:`cdsgd.base.flat.ParamLayout`). This
module rebuilds the run's model from its ``config.toml``,

    ``cdsgd.models.build_model(cfg.model, input_shape, n_classes, **cfg.model_params)``

(``input_shape`` and ``n_classes`` from the run's data set), copies one row
into it, or the average x̄ = (1/N) Σ_j x_j (summed in float64, as the runs'
``test_accuracy_avg_model`` computes it), and returns its ``state_dict``.

- :func:`export_model` → the ``state_dict``; :func:`load_model` → the
  ``nn.Module`` itself, in eval mode; :func:`save_model` writes the
  ``state_dict`` with ``torch.save`` (what ``cdsgd export`` does).
- ``agent=j`` takes agent j's parameters; ``average=True``, or neither, the
  average model. Both together are refused.
- Buffers are not part of ``params.pt`` (runs exchange parameters only): a
  model with buffers (batch-norm statistics) gets those of a freshly built
  model. The built-in models have none.
- The data set is loaded once to learn the input shape and the number of
  classes (from the run's ``data_dir``, relative to the working directory);
  pass ``input_shape`` and ``n_classes`` to skip that.

>>> import tempfile
>>> from cdsgd.config import load_config
>>> from cdsgd.run.experiment import run_experiment
>>> run = tempfile.mkdtemp() + "/run"
>>> cfg = load_config(overrides=["n_agents=3", "epochs=0.2", "save_params=true", f"out={run}"])
>>> _ = run_experiment(cfg, progress=False, log=lambda m: None)
>>> model = load_model(run, agent=1)
>>> model(torch.zeros(2, 1, 8, 8)).shape
torch.Size([2, 10])
>>> state = export_model(run)  # the average model
>>> params = torch.load(f"{run}/params.pt", weights_only=True)
>>> torch.allclose(torch.cat([v.reshape(-1) for v in state.values()]), params.double().mean(0).float())
True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..base.files import atomic_write
from ..base.flat import ParamLayout
from ..config import Config, load_config
from ..models import build_model
from ..run.plan import load_config_dataset

__all__ = ["export_model", "load_model", "read_run", "save_model"]


def read_run(run_dir: str | os.PathLike) -> tuple[Config, torch.Tensor]:
    """The run's config and its N×P ``params.pt``; a ValueError saying what is missing and how to get it."""
    run = Path(run_dir)
    if not (run / "config.toml").is_file():
        what = "is not a folder" if not run.is_dir() else "has no config.toml"
        raise ValueError(f"{os.fspath(run_dir)!r} {what}; expected a run folder written by 'cdsgd run'")
    cfg = load_config(run / "config.toml")
    path = run / "params.pt"
    if not path.is_file():
        raise ValueError(f"{os.fspath(run_dir)!r} has no params.pt: the run did not save its parameters. Rerun it "
                         f"with save_params=true: cdsgd run {os.fspath(run / 'config.toml')} save_params=true "
                         "overwrite=true")
    params = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(params, torch.Tensor) or params.dim() != 2 or not params.is_floating_point() \
            or len(params) != cfg.n_agents:
        got = f"{params.dtype} {tuple(params.shape)}" if isinstance(params, torch.Tensor) else type(params).__name__
        raise ValueError(f"{os.fspath(path)!r} holds {got}; expected a floating-point tensor of shape "
                         f"({cfg.n_agents}, P): one row per agent of the run (n_agents = {cfg.n_agents})")
    return cfg, params


def _row(params: torch.Tensor, agent: int | None, average: bool) -> torch.Tensor:
    n = len(params)
    if agent is not None and average:
        raise ValueError(f"choose agent={agent} or average=True, not both (neither: the average model)")
    if agent is None:
        return (params.double().sum(0) / n).to(params.dtype)  # x̄ as the runs' average model computes it
    if isinstance(agent, bool) or not isinstance(agent, int) or not 0 <= agent < n:
        raise ValueError(f"agent {agent!r} is out of range: the run has {n} agents, 0..{n - 1}")
    return params[agent]


def load_model(run_dir: str | os.PathLike, agent: int | None = None, average: bool = False, *,
               input_shape: Sequence[int] | None = None, n_classes: int | None = None) -> nn.Module:
    """The run's model holding agent ``agent``'s final parameters, or the average model (the default); eval mode.

    ``input_shape`` and ``n_classes``: the run's data set's, given to skip
    loading it (both or neither).
    """
    cfg, params = read_run(run_dir)
    row = _row(params, agent, average)
    if (input_shape is None) != (n_classes is None):
        raise ValueError("give both input_shape and n_classes, or neither (then the run's data set tells them)")
    if input_shape is None:
        ds = load_config_dataset(cfg)
        input_shape, n_classes = ds.input_shape, ds.n_classes
    model = build_model(cfg.model, input_shape, n_classes, **cfg.model_params)
    layout = ParamLayout(model)
    if layout.numel != params.shape[1]:
        raise ValueError(f"params.pt of {os.fspath(run_dir)!r} holds {params.shape[1]} values per agent, but model "
                         f"{cfg.model!r} for inputs {tuple(input_shape)} and {n_classes} classes has {layout.numel} "
                         "parameters: the model or the data set differs from the run's")
    layout.load_into(model, row.to(next(model.parameters()).dtype))
    return model.eval()


def export_model(run_dir: str | os.PathLike, agent: int | None = None, average: bool = False, *,
                 input_shape: Sequence[int] | None = None, n_classes: int | None = None) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of :func:`load_model` (detached copies): ``build_model(...).load_state_dict(it)``."""
    return _state_dict(load_model(run_dir, agent, average, input_shape=input_shape, n_classes=n_classes))


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_model(run_dir: str | os.PathLike, path: str | os.PathLike, agent: int | None = None,
               average: bool = False) -> nn.Module:
    """Write :func:`export_model`'s ``state_dict`` to ``path`` (``torch.save``, atomically); return the model."""
    if Path(path).is_dir():
        raise ValueError(f"{os.fspath(path)!r} is a folder; give a file name such as model.pt")
    model = load_model(run_dir, agent, average)
    state = _state_dict(model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(state, f))
    return model
