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
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..base.checks import check_int
from ..base.flat import ParamLayout
from ..base.seeding import derive_seed
from ..mixers import Mixer, make_mixer
from .gradients import STRATEGIES, choose_strategy, cross_entropy, make_strategy
from .streams import AgentRNG

__all__ = ["AgentStack", "Agents", "INITS", "build_agents", "held_mixer", "seeded_model"]

#: how agents' initial parameters relate (``init=``)
INITS = ("same", "independent")


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
    W is validated as ``algorithm`` takes it (a push-sum P for ``sgp``); whether
    the rule can run with it, the rule says once, when the executor builds its
    state (``algorithm.init_state(X, mixer)``).
    """
    if not isinstance(W, Mixer) and len(agents) < n:
        raise ValueError(f"an executor holding agents {agents} of {n} needs a Mixer that reaches the "
                         "others (e.g. cdsgd.runtime.BlockMixer), not a matrix")
    if W is None and algorithm.traffic == "neighbours":
        raise ValueError(f"algorithm {algorithm.name!r} mixes with neighbours: give the mixing matrix W")
    mixer = make_mixer(W, n_agents=n, exact=exact, column_stochastic=algorithm.column_stochastic)
    if list(mixer.agents) != agents:
        raise ValueError(f"mixer holds agents {list(mixer.agents)} but this executor holds {agents}")
    return mixer


class AgentStack:
    """The agents this process holds: their models, the L×P parameter stack X, random streams and gradients.

    ``ids`` are the held agents' indices among ``n_agents`` (all of them in the simulator, a block per
    rank in the runtime); ``X[i]`` is agent ``ids[i]``'s flat parameters (``layout`` names them).
    ``init="same"`` builds every agent's module under one seed (identical copies); ``"independent"``
    under (seed, j, "init"), except that ``same_init`` (the one-model algorithms sgd, msgd, fedavg)
    starts every agent from agent 0's. ``gradients`` (:mod:`cdsgd.executor.gradients`) fills
    ``gradients.G`` at X; agent j's forward passes draw from its own ``rng`` stream.

        >>> from torch import nn
        >>> stack = AgentStack(lambda: nn.Linear(3, 2), 4, seed=0, ids=[2, 3])
        >>> stack.X.shape, stack.strategy, stack.ids
        (torch.Size([2, 8]), 'vmap', [2, 3])
    """

    def __init__(self, model_fn: Callable[[], nn.Module], n_agents: int, *, seed: int = 0,
                 ids: Sequence[int] | None = None, init: str = "same", same_init: bool = False,
                 strategy: str = "auto", exact: bool = False, device: str | torch.device | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
                 grad_clip: float = 0.0) -> None:
        n = self.n_agents = int(n_agents)
        self.seed = check_int("seed", seed, 0)
        if init not in INITS:
            raise ValueError(f"init {init!r} is unknown; allowed: {', '.join(INITS)}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is unknown; allowed: {', '.join(STRATEGIES)}")
        if not (isinstance(grad_clip, (int, float)) and 0 <= grad_clip < math.inf):
            raise ValueError(f"grad_clip must be a finite number >= 0 (0: off), got {grad_clip!r}")
        self.ids = list(range(n)) if ids is None else [int(j) for j in ids]
        if not self.ids or any(not 0 <= j < n for j in self.ids) or len(set(self.ids)) != len(self.ids):
            raise ValueError(f"agents must be distinct indices in 0..{n - 1}, got {ids!r}")
        self.exact = bool(exact)

        def init_key(j: int) -> int:
            if init == "same":
                return derive_seed(self.seed, "init")
            return derive_seed(self.seed, 0 if same_init else j, "init")

        built = build_agents(model_fn, [init_key(j) for j in self.ids], strategy=strategy, exact=exact,
                             device=device)
        self.models, self.layout, self.X, self.device = built.models, built.layout, built.X, built.device
        self.dtype, self.strategy, self.loss_fn = self.X.dtype, built.strategy, loss_fn
        self.rng = AgentRNG(self.seed, self.ids, self.device)
        self.gradients = make_strategy(self.strategy, self.models, self.layout, self.X, torch.zeros_like(self.X),
                                       loss_fn, self.rng, grad_clip=grad_clip)

    def model(self, j: int) -> nn.Module:
        """Agent j's module holding its current parameters (j must be held here).

        With the ``loop`` strategy it is the agent's own module (its parameters
        are views of X); with ``vmap``, a fresh copy of the template each call.
        """
        i = self.ids.index(j)
        model = self.models[i] if len(self.models) == len(self.ids) else copy.deepcopy(self.models[0])
        self.layout.load_into(model, self.X[i])
        return model

    def state_dict(self) -> dict:
        return {"X": self.X.detach().cpu().clone(), "rng": [s.cpu() for s in self.rng.state_dict()]}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["X"].shape) != tuple(self.X.shape):
            raise ValueError(f"checkpoint parameters have shape {tuple(state['X'].shape)}, "
                             f"this run {tuple(self.X.shape)}")
        with torch.no_grad():
            self.X.copy_(state["X"])  # in place: the loop strategy's modules are views of X
        self.rng.load_state_dict([s.to(self.rng.states[0].device) for s in state["rng"]])
