"""One algorithm, one set of defaults, through every door (issue 40), compared bit for bit.

For every registered algorithm, on one tiny problem with every hyperparameter
left at its default (``lr`` aside: the API doors need it, and get the
config's), the final parameters of

1. ``cdsgd run``'s door, :func:`cdsgd.run.experiment.run_experiment` on a Config (``params.pt``),
2. :func:`cdsgd.simulate`,
3. an executor stepped by hand (``Executor.build``, the ``Simulator``), with ``make_algorithm(name, lr=...)``,
4. where a ``torch.optim`` class of :mod:`cdsgd.algorithms.optim` stands for the rule, one optimizer per
   agent in a plain loop,

are equal (``torch.equal``). The same holds with AdamW agents (``optimizer="adamw"``) and the newer
step-size schedules, for the rules that take them (:data:`VARIANTS`). The doors see the same data, model and W (built
by the CLI's own :func:`cdsgd.run.plan.prepare`): what could differ is the
defaults. Bit for bit needs the same arithmetic everywhere: one thread, the
exact mixing mode, the loop gradient strategy, and batches that do not depend
on the sampler's order (each agent's shard holds copies of one sample:
``partition = "classes"``, one class per agent), so that the plain loop of door
4 computes the executor's gradients without its data streams.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from cdsgd import simulate
from cdsgd.algorithms import ALGORITHMS, CDMSGD, CDSGD, DecentralizedOptimizer, make_algorithm
from cdsgd.base.checks import HYPER_DEFAULTS, OUTER_RULE_DEFAULTS
from cdsgd.config import ALGORITHMS_DEFAULT, Config, config_keys, key_info
from cdsgd.executor.asynchronous import executor_class
from cdsgd.mixers import Handle, Mixer, neighbourhood, ordered_weighted_sum, result_tensor
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import prepare, validate_config

N, B, DIM, STEPS_PER_EPOCH = 4, 2, 6, 4
LR = key_info("lr")["default"]  # the CLI's; the API doors need lr given

#: settings an algorithm needs to run at all, given alike to every door
SPECIAL = {
    "d2": {"mixing": "lazy_metropolis"},  # a 4-ring's Metropolis W has λ_min = −1/3, which D² refuses
    "adpsgd": {"network_params": {"compute_ms": 1.0}},  # the asynchronous time model needs compute times
}

#: the torch.optim classes that stand for a rule (docs/algorithms.md): door 4, each as (takes the rule's step-size
#: schedule, make(params, mixer, hyper)); CDSGD/CDMSGD leave schedules to torch.optim.lr_scheduler
OPTIMIZERS = {
    "cdsgd": [(False, lambda p, m, h: CDSGD(p, m, lr=LR, **h)),
              (True, lambda p, m, h: DecentralizedOptimizer(p, m, "cdsgd", lr=LR, **h))],
    "cdmsgd": [(False, lambda p, m, h: CDMSGD(p, m, lr=LR, **h)),
               (True, lambda p, m, h: DecentralizedOptimizer(p, m, "cdmsgd", lr=LR, **h))],
    **{name: [(True, lambda p, m, h, name=name: DecentralizedOptimizer(p, m, name, lr=LR, **h))]
       for name in ("dsgt", "d2", "qg_dsgdm", "sgp")},
}

ADAMW = {"optimizer": "adamw", "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}
#: (algorithm, hyperparameters given alike to every door) beyond the defaults: AdamW agents under the rules that
#: take them, and the schedules (a cosine's horizon given: door 3 steps by hand, with no run's total steps)
VARIANTS = [
    *[(name, ADAMW) for name in ("cdsgd", "cdmsgd", "dsgt", "sgd", "msgd", "fedavg", "local")],
    ("dsgt", {**ADAMW, "lr_schedule": "cosine", "lr_decay_steps": STEPS_PER_EPOCH, "lr_min": 0.01, "lr_warmup": 2}),
    ("cdmsgd", {"lr_schedule": "step", "lr_step_size": 2, "lr_gamma": 0.5, "lr_warmup": 1}),
]
SCHEDULE_KEYS = {"lr_schedule", "lr_decay_steps", "lr_min", "lr_warmup", "lr_step_size", "lr_gamma"}


def tiny(data_dir):
    """The data set (``dataset = "test_algorithm_doors:tiny"``): class c is STEPS_PER_EPOCH·B copies of one
    random input, so that with ``partition="classes"`` every batch of agent c is B copies of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    copies = STEPS_PER_EPOCH * B
    train = (x.repeat_interleave(copies, dim=0), torch.arange(N).repeat_interleave(copies))
    test = (torch.randn(8, DIM, generator=g), torch.arange(8) % N)
    return train, test


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(name: str, out, hyper: dict | None = None) -> Config:
    """The data, model and steps of the problem; every hyperparameter at its default but those of ``hyper``."""
    return Config(algorithm=name, dataset="test_algorithm_doors:tiny", partition="classes", n_agents=N,
                  model="mlp", model_params={"hidden": 8}, batch_size=B, epochs=1.0, strategy="loop", exact=True,
                  save_params=True, out=str(out), **SPECIAL.get(name, {}), **(hyper or {}))


def options(parts) -> dict:
    """The executor options of the problem, as the config sets them (network: adpsgd's compute times)."""
    network = {"network": parts.plan.network} if parts.plan.network is not None else {}
    return {"batch_size": B, "seed": 0, "exact": True, "strategy": "loop", "test_set": parts.test_set, **network}


def build(parts, algorithm):
    """Door 3: the executor of ``algorithm`` (an Algorithm) on the problem, not stepped yet."""
    klass = executor_class(algorithm)  # AsyncExecutor for adpsgd
    make = getattr(klass, "build", klass)
    return make(parts.model_fn, parts.shards, parts.W, algorithm, **options(parts))


# ------------------------------------------------------------------ door 4: a plain per-agent loop


class Board:
    """The agents' in-process exchange: the t-th ``start`` of each agent pairs with the t-th of the others."""

    def __init__(self, W) -> None:
        self.W, self.posted, self.ready = W, {}, threading.Condition()

    def mixer(self, j: int) -> "AgentMixer":
        return AgentMixer(self, j)


class AgentMixer(Mixer):
    """Agent j's mixer: Σ_l π_jl x_l in the exact mode's order (:func:`ordered_weighted_sum`, self first)."""

    def __init__(self, board: Board, j: int) -> None:
        self.board, self.j, self.t = board, j, 0
        self.n_agents, self.agents, self.matrix = board.W.shape[0], [j], board.W
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)
        self.weights, self.sources = neighbourhood(board.W, j)

    def start(self, x, *, out=None):
        board, t = self.board, self.t
        self.t += 1
        with board.ready:
            board.posted[(self.j, t)] = x.clone()
            board.ready.notify_all()
        out = result_tensor(x, out)
        weights, sources = self.weights, self.sources

        class Pending(Handle):
            def wait(self_):
                with board.ready:
                    if not board.ready.wait_for(lambda: all((l, t) in board.posted for l in sources), timeout=60):
                        raise TimeoutError(f"agent {self.j}: a neighbour never posted exchange {t}")
                    rows = [board.posted[(l, t)] for l in sources]
                return ordered_weighted_sum(weights, rows, out)

        return Pending(out)

    def average(self, x, mask=None, *, out=None):
        raise NotImplementedError


def optimizer_door(parts, make_opt, X0: torch.Tensor, steps: int) -> torch.Tensor:
    """N agents, each its model (from row j of X0) and optimizer, stepping in threads (a rule may mix after the
    gradient, waiting for its neighbours); every batch is B copies of the agent's one sample."""
    board = Board(parts.W)
    models = []
    for j in range(N):
        model = parts.model_fn()
        torch.nn.utils.vector_to_parameters(X0[j].clone(), model.parameters())  # (it makes them views of it)
        models.append(model)
    opts = [make_opt(list(m.parameters()), board.mixer(j)) for j, m in enumerate(models)]
    batches = [(x[:B], y[:B]) for x, y in parts.shards]

    def agent(j: int) -> None:
        torch.set_num_threads(1)
        for _ in range(steps):
            opts[j].post()
            opts[j].zero_grad()
            F.cross_entropy(models[j](batches[j][0]), batches[j][1]).backward()
            opts[j].step()

    errors = []
    threads = [threading.Thread(target=lambda j=j: _record(errors, agent, j)) for j in range(N)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _record(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - shown by the test
        errors.append(e)


# ------------------------------------------------------------------ the test


@pytest.mark.parametrize("name,hyper", [(name, {}) for name in ALGORITHMS] + VARIANTS,
                         ids=list(ALGORITHMS) + ["-".join([n, *(h[k] for k in ("optimizer", "lr_schedule") if k in h)])
                                                 for n, h in VARIANTS])
def test_every_door_trains_the_same_algorithm_with_the_same_defaults(name, hyper, tmp_path):
    cfg = config(name, tmp_path / "run", hyper)
    steps = STEPS_PER_EPOCH
    # 1. cdsgd run
    summary = run_experiment(cfg, progress=False, log=lambda msg: None)
    assert summary["step"] == steps
    cli = torch.load(tmp_path / "run" / "params.pt", weights_only=True)
    # the other doors get the CLI's data, model and W, and only what a user must give (lr)
    unused = config(name, tmp_path / "unused", hyper)
    parts = prepare(unused, validate_config(unused))
    # 3. an executor with make_algorithm's rule
    ex = build(parts, make_algorithm(name, lr=LR, **hyper))
    X0 = ex.X.clone()
    for _ in range(steps):
        ex.step()
    assert torch.equal(ex.X, cli), f"{name}: make_algorithm's defaults differ from cdsgd run's"
    # 4. the optimizer classes that stand for the rule
    for schedules, make in OPTIMIZERS.get(name, []):
        if SCHEDULE_KEYS & set(hyper) and not schedules:
            continue
        make_opt = lambda p, m, make=make: make(p, m, hyper)  # noqa: E731
        got = optimizer_door(parts, make_opt, X0, steps)
        assert torch.equal(got, cli), f"{name}: {make_opt(*_probe(parts))!r} trains with other defaults"
    # 2. simulate
    api = simulate(parts.model_fn, parts.shards, parts.W, name, steps=steps, lr=LR, **options(parts), **hyper).params
    assert torch.equal(api, cli), f"{name}: simulate's defaults differ from cdsgd run's"


def _probe(parts):
    """Arguments to build an optimizer only to name it in a message."""
    return [torch.nn.Parameter(torch.zeros(1))], Board(parts.W).mixer(0)


def test_the_defaults_are_declared_once():
    """The config's hyperparameter keys and every rule's and optimizer's signature read HYPER_DEFAULTS."""
    import inspect

    for k in config_keys():
        info = key_info(k)
        if info["source"].startswith(ALGORITHMS_DEFAULT):
            declared = HYPER_DEFAULTS[k]
            declared = list(declared) if isinstance(declared, tuple) else declared  # betas: TOML's array
            assert info["default"] == (info["unset"] if declared is None else declared), k
    for klass in [*(ALGORITHMS.get(name) for name in ALGORITHMS), CDSGD, CDMSGD]:
        for cls in klass.__mro__:
            if "__init__" not in cls.__dict__ or cls is object:
                continue
            for p in inspect.signature(cls.__dict__["__init__"]).parameters.values():
                if p.name in HYPER_DEFAULTS and p.default is not inspect.Parameter.empty and p.default is not None:
                    own = OUTER_RULE_DEFAULTS if cls.__name__ == "_OuterRule" else {}  # diloco's, noloco's
                    assert p.default == own.get(p.name, HYPER_DEFAULTS[p.name]), (cls.__name__, p.name)
