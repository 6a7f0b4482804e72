r"""The agents' models and their parameter stack, and the mixer, built once per executor.

Agent j's initial parameters come from ``model_fn()`` called under the seed
``keys[i]`` (:func:`seeded_model`); agents with equal keys (``init="same"``,
and every agent of the one-model algorithms) start from identical
parameters. What is built depends on the gradient strategy:

``loop``
    one module per held agent (each keeps its own buffers and dropout
    state); an agent whose key was built already gets a deep copy instead of
    a second call of ``model_fn`` (the same parameters, bit for bit, at a
    fraction of the cost). The strategy then binds each module's parameters
    to its row of X, so the modules add no memory of their own.
``vmap``
    a single template module (``vmap`` calls it functionally with each
    agent's row of X); other agents' modules are never built, and agents
    sharing the template's key are copies of its row. So N agents cost one
    L×P stack, not N modules.

Example::

    >>> import torch
    >>> from torch import nn
    >>> built = build_agents(lambda: nn.Linear(3, 2), [7, 7, 7], strategy="vmap", exact=False)
    >>> built.X.shape, len(built.models), torch.equal(built.X[0], built.X[2])
    (torch.Size([3, 8]), 1, True)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..base.flat import ParamLayout
from ..mixers import Mixer, make_mixer
from .gradients import choose_strategy

__all__ = ["Agents", "build_agents", "held_mixer", "seeded_model"]


def seeded_model(seed: int, model_fn: Callable[[], nn.Module]) -> nn.Module:
    """``model_fn()`` under ``torch.manual_seed(seed)``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    return model


@dataclass
class Agents:
    """What :func:`build_agents` returns."""

    #: one module per held agent (``loop``) or the one template (``vmap``)
    models: list[nn.Module]
    layout: ParamLayout
    #: the L×P stack of the held agents' flat parameters
    X: torch.Tensor
    #: ``loop`` or ``vmap``
    strategy: str
    device: torch.device


def build_agents(model_fn: Callable[[], nn.Module], keys: Sequence[int], *, strategy: str, exact: bool,
                 device: str | torch.device | None = None) -> Agents:
    """Build the held agents' models (seeded by ``keys``, one per agent) and their parameter stack."""
    template = seeded_model(keys[0], model_fn)
    layout = ParamLayout(template)
    if layout.numel == 0:
        raise ValueError("the model has no parameters")
    first = next(template.parameters())
    dev = torch.device(device) if device is not None else first.device
    template.to(dev)
    strategy = choose_strategy(strategy, template, exact=exact)
    first_row = layout.flatten(template)
    X = torch.empty((len(keys), layout.numel), dtype=first_row.dtype, device=dev)
    X[0] = first_row
    models, built = [template], {keys[0]: (template, 0)}
    if strategy == "vmap" and all(key == keys[0] for key in keys):  # every agent starts from the template
        X[1:] = X[0]
        keys = keys[:1]
    for i, key in enumerate(keys[1:], 1):
        if key in built:
            model, row = built[key]
            if strategy == "loop":
                models.append(copy.deepcopy(model))
            X[i] = X[row]
            continue
        model = seeded_model(key, model_fn).to(dev)
        X[i] = layout.flatten(model)
        if strategy == "loop":
            models.append(model)
            built[key] = (model, i)
        else:
            built[key] = (template, i)  # only the row is kept
    for m in models:
        m.train()
    return Agents(models, layout, X, strategy, dev)


def held_mixer(W, algorithm, n: int, agents: list[int], *, exact: bool) -> Mixer:
    """The executor's Mixer: :func:`cdsgd.mixers.make_mixer` for ``n`` agents, checked to hold ``agents``.

    A matrix, a schedule or None serve only an executor holding every agent;
    one holding a block needs a Mixer that reaches the others (the runtime's).
    """
    if not isinstance(W, Mixer) and len(agents) < n:
        raise ValueError(f"an executor holding agents {agents} of {n} needs a Mixer that reaches the "
                         "others (e.g. cdsgd.runtime.BlockMixer), not a matrix")
    mixer = make_mixer(W, algorithm=algorithm, n_agents=n, exact=exact)
    if list(mixer.agents) != agents:
        raise ValueError(f"mixer holds agents {list(mixer.agents)} but this executor holds {agents}")
    return mixer
