"""AdamW agents (``optimizer="adamw"``) and the step-size schedules, against independent computations.

One agent (and N agents that always agree) against ``torch.optim.AdamW`` step for step; three agents with a
known Π against the decentralized AdamW step written out in numpy; the bias correction in closed form; a
stopped and resumed run against an uninterrupted one; the optimizer classes; bad inputs as one table; the
schedules against their formulas.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd import simulate
from cdsgd.algorithms import CDMSGD, CDSGD, DecentralizedOptimizer, StepSize, make_algorithm
from cdsgd.config import load_config
from cdsgd.mixers import Handle, MatrixMixer, Mixer, make_mixer, result_tensor
from cdsgd.run.experiment import run_experiment
from cdsgd.run.plan import validate_config

LR, WD, BETAS, EPS, STEPS = 0.01, 0.1, (0.9, 0.99), 1e-8, 20


def closed_form(k: int, *, lr, schedule="constant", K=None, lr_min=0.0, s=1000, gamma=0.1, warmup=0,
                tau=1000.0, p=1.0) -> float:
    """α_k as the docs write it (not the code's)."""
    if schedule == "constant":
        a = lr
    elif schedule == "diminishing":
        a = lr / (1 + k / tau) ** p
    elif schedule == "cosine":
        a = lr_min + (lr - lr_min) * 0.5 * (1 + math.cos(math.pi * min(k, K) / K))
    else:
        a = lr * gamma ** (k // s)
    return a * (k + 1) / warmup if k < warmup else a


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def flat(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def torch_adamw_run(schedule: dict, steps: int = STEPS):
    """torch.optim.AdamW on a small model, lr set to the closed form at each step: the parameters and the
    flat gradient of every step (taken at torch's own parameters)."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    params, grads = [flat(model)], []
    for k in range(steps):
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        for group in opt.param_groups:
            group["lr"] = closed_form(k, lr=LR, **schedule)
        opt.step()
        params.append(flat(model))
    return params, grads


SCHEDULE = {"schedule": "cosine", "K": 15, "lr_min": 0.001, "warmup": 4}
HYPER = {"lr": LR, "weight_decay": WD, "optimizer": "adamw", "betas": BETAS, "eps": EPS, "lr_schedule": "cosine",
         "lr_decay_steps": 15, "lr_min": 0.001, "lr_warmup": 4}


@pytest.fixture(scope="module")
def reference():
    """torch's AdamW run with the cosine and warm-up of HYPER, and its gradients (one run for every case)."""
    return torch_adamw_run(SCHEDULE)


@pytest.mark.parametrize("name,mixer", [("cdsgd", lambda n: MatrixMixer(np.ones((n, n)) / n)),
                                        ("cdmsgd", lambda n: MatrixMixer(np.ones((n, n)) / n)),
                                        ("dsgt", lambda n: MatrixMixer(np.ones((n, n)) / n)),
                                        ("sgd", lambda n: make_mixer(None, n_agents=n)),
                                        ("local", lambda n: make_mixer(None, n_agents=n))])
@pytest.mark.parametrize("n", [1, 4])
def test_agents_that_agree_are_torch_adamw_step_for_step(name, mixer, n, reference):
    """One agent (Π = [1]), or N agents with the complete graph's uniform Π, the same start and the same
    gradients, equal torch.optim.AdamW (weight decay, cosine with warm-up) to 1e-6 at every step."""
    params, grads = reference
    alg, mix = make_algorithm(name, **HYPER), mixer(n)
    X = params[0].repeat(n, 1)
    state = alg.init_state(X, mixer=mix)
    for k, g in enumerate(grads):
        alg.update(X, g.repeat(n, 1), state, k=k, mixer=mix)
        assert (X - params[k + 1]).abs().max() < 1e-6, (name, k)
    assert state["adam_t"].flatten().tolist() == [float(STEPS)] * n


def test_simulate_with_agreeing_agents_is_torch_adamw():
    """End to end: 4 agents, uniform Π, one full batch each of the same data, every step: torch's AdamW on it."""
    x, y = torch.randn(16, 5, generator=torch.Generator().manual_seed(2)), torch.arange(16) % 3
    ref = small_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for _ in range(10):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    out = simulate(small_model, [(x, y)] * 4, np.ones((4, 4)) / 4, "cdsgd", steps=10, batch_size=16, lr=LR,
                   weight_decay=WD, optimizer="adamw", betas=BETAS, eps=EPS).params
    assert (out - flat(ref)).abs().max() < 1e-5


# --------------------------------------------------------- three agents, a known Π, written out in numpy


def numpy_adamw(rule: str, W, X0, grads, *, lr, betas, eps, wd):
    """The decentralized AdamW step of docs/algorithms.md, agent by agent, in float64 numpy."""
    b1, b2 = betas
    X, m, v = X0.copy(), np.zeros_like(X0), np.zeros_like(X0)
    Y, G_prev = np.zeros_like(X0), np.zeros_like(X0)
    for t, G in enumerate(grads, start=1):
        U = G
        if rule == "dsgt":  # the tracker: W y + g − g_prev (y^0 = g^0), built from gradients without decay
            Y = W @ Y + G - G_prev
            G_prev, U = G, Y
        m = b1 * m + (1 - b1) * U
        v = b2 * v + (1 - b2) * U ** 2
        d = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        X = W @ X - lr * (d + wd * X)
    return X


@pytest.mark.parametrize("rule", ["cdsgd", "dsgt"])
def test_three_agents_with_a_known_pi_match_numpy(rule):
    W = np.array([[0.5, 0.25, 0.25], [0.25, 0.75, 0.0], [0.25, 0.0, 0.75]])
    rng = np.random.default_rng(0)
    X0, grads = rng.normal(size=(3, 4)), [rng.normal(size=(3, 4)) for _ in range(6)]
    expect = numpy_adamw(rule, W, X0, grads, lr=0.05, betas=(0.8, 0.95), eps=1e-3, wd=0.2)
    alg = make_algorithm(rule, lr=0.05, optimizer="adamw", betas=[0.8, 0.95], eps=1e-3, weight_decay=0.2)
    X, mixer = torch.tensor(X0), MatrixMixer(W)
    state = alg.init_state(X, mixer=mixer)
    for k, G in enumerate(grads):
        alg.update(X, torch.tensor(G), state, k=k, mixer=mixer)
    np.testing.assert_allclose(X.numpy(), expect, rtol=0, atol=1e-12)


def test_bias_correction_undoes_the_zero_start():
    """A constant gradient g: m̂ = g and v̂ = g² at every t (without the correction, m = (1 − β1^t) g), so each
    step is d = g/(|g| + ε) exactly; and the step count is the state's."""
    alg = make_algorithm("local", lr=1.0, optimizer="adamw", betas=[0.9, 0.999], eps=1e-3)
    g = torch.tensor([[2.0, -0.5, 1e-4]], dtype=torch.float64)
    X = torch.zeros_like(g)
    state, before = alg.init_state(X), X.clone()
    for t in range(1, 6):
        alg.update(X, g, state, k=t - 1, mixer=None)
        torch.testing.assert_close(before - X, g / (g.abs() + 1e-3), rtol=0, atol=1e-14)
        torch.testing.assert_close(state["adam_m"], (1 - 0.9 ** t) * g, rtol=0, atol=1e-14)
        assert state["adam_t"].item() == t
        before = X.clone()


def test_fedavg_agents_sitting_a_round_out_keep_their_moments():
    alg = make_algorithm("fedavg", lr=0.1, optimizer="adamw", local_steps=2, fedavg_fraction=0.5)
    alg.bind(n_agents=4, steps_per_epoch=2, seed=3)
    X = torch.zeros(4, 3, dtype=torch.float64)
    state, mixer = alg.init_state(X), make_mixer(None, n_agents=4)
    alg.update(X, torch.ones_like(X), state, k=0, mixer=mixer)
    took = alg.participants(0)
    assert state["adam_t"].flatten().tolist() == took.double().tolist()
    assert torch.equal(state["adam_m"][~took], torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(X[~took], torch.zeros(2, 3, dtype=torch.float64))


# ------------------------------------------------------------------------------- checkpoints


BASE = ["dataset=digits", "train_subset=200", "test_subset=40", "n_agents=4", "model=mlp", "batch_size=25",
        "epochs=4", "lr=0.01", "optimizer=adamw", "betas=[0.85, 0.99]", "weight_decay=0.05", "lr_schedule=cosine",
        "lr_warmup=3", "eval_every=4", "save_params=true", "checkpoint_every=3", "checkpoint_unit=steps"]


def test_a_stopped_and_resumed_adamw_run_equals_the_uninterrupted_one(tmp_path, monkeypatch, interrupt_at):
    """The moments and step counts are in the checkpoint, and the cosine's horizon (the run's 8 steps) is the
    same for the resumed part."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_experiment(load_config(overrides=[*BASE, f"out={ref}"]), progress=False, log=lambda m: None)
    interrupt_at(5)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(overrides=[*BASE, f"out={out}"]), progress=False, log=lambda m: None)
    monkeypatch.undo()
    run_experiment(load_config(overrides=[*BASE, f"out={out}", "resume=true"]), progress=False, log=lambda m: None)
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 3
    assert torch.equal(torch.load(out / "params.pt", weights_only=True),
                       torch.load(ref / "params.pt", weights_only=True))
    saved = torch.load(next((out / "checkpoints").rglob("*.pt")), weights_only=True)
    assert {"adam_m", "adam_v", "adam_t"} <= set(saved["simulator"]["rule"])


# ------------------------------------------------------------------------------- the optimizer classes


class Alone(Mixer):
    """One agent, no neighbours: Σ_l π_jl x_l = x_j."""

    n_agents, agents, matrix = 1, [0], None

    def __init__(self):
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)

    def start(self, x, *, out=None):
        return Handle(result_tensor(x, out).copy_(x))

    def average(self, x, mask=None, *, out=None):
        return result_tensor(x, out).copy_(x)


@pytest.mark.parametrize("make", [
    lambda ps, **h: CDSGD(ps, Alone(), **h),
    lambda ps, **h: CDMSGD(ps, Alone(), momentum=0.5, **h),  # momentum unused under adamw
])
def test_the_optimizer_classes_alone_are_torch_adamw_group_by_group(make):
    ours, ref = small_model(), small_model()
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.03,  # noqa: E731
                                                          "weight_decay": 0.0, "betas": (0.5, 0.9)}]
    opt = make(groups(ours), lr=LR, weight_decay=WD, optimizer="adamw", betas=BETAS, eps=EPS)
    torch_opt = torch.optim.AdamW(groups(ref), lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    g = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        for model, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            o.step()
        assert (flat(ours) - flat(ref)).abs().max() < 1e-6
    state = opt.state[next(ours.parameters())]
    assert set(state) == {"exp_avg", "exp_avg_sq", "step"} and state["step"].item() == STEPS


def test_decentralized_optimizer_with_adamw_keeps_the_moments_in_its_state_dict():
    model, ref = small_model(), small_model()
    opt = DecentralizedOptimizer(model.parameters(), Alone(), "cdsgd", lr=LR, optimizer="adamw", weight_decay=WD,
                                 betas=BETAS, eps=EPS)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    x, y = torch.randn(8, 5), torch.arange(8) % 3
    for _ in range(5):
        for m, o in ((model, opt), (ref, torch_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert (flat(model) - flat(ref)).abs().max() < 1e-6
    saved = opt.state_dict()
    assert {"adam_m", "adam_v", "adam_t"} <= set(saved["rule_state"]) and saved["rule_state"]["adam_t"].item() == 5
    assert "momentum" not in opt.param_groups[0]


# ------------------------------------------------------------------------------- bad inputs


def _optimizer(**h):
    return CDSGD(small_model().parameters(), Alone(), lr=0.1, **h)


BAD = [
    (lambda: make_algorithm("cdsgd", lr=0.1, optimizer="adam"),
     r"^optimizer 'adam' is unknown; did you mean 'adamw'\? allowed: sgd, adamw, auto$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, optimizer="adamw", betas=[1.0, 0.9]),
     r"^betas must be two numbers, each in \[0, 1\), got \[1\.0, 0\.9\]$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, optimizer="adamw", betas=[0.9]),
     r"^betas must be two numbers, each in \[0, 1\), got \[0\.9\]$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, optimizer="adamw", betas=[0.9, -0.1]), r"^betas must be two numbers"),
    (lambda: make_algorithm("cdsgd", lr=0.1, optimizer="adamw", eps=0), r"^eps must be a finite number > 0, got 0$"),
    (lambda: make_algorithm("d2", lr=0.1, optimizer="adamw"),
     r"^algorithm 'd2' takes optimizer='sgd' only \(.*\); optimizer='adamw' is for cdsgd, cdmsgd, sgd, msgd, "
     r"fedavg, local, dsgt, diloco, noloco$"),
    *[(lambda name=name: make_algorithm(name, lr=0.1, optimizer="adamw"), rf"^algorithm '{name}' takes optimizer='sgd'")
      for name in ("qg_dsgdm", "sgp", "choco", "beer", "relaysum", "adpsgd")],
    (lambda: validate_config(load_config(overrides=["optimizer=adam"])), r"^optimizer 'adam' is unknown; did you mean"),
    (lambda: validate_config(load_config(overrides=["optimizer=adamw", "betas=[0.9, 1.0]"])),
     r"^betas must be two numbers, each in \[0, 1\), got \[0\.9, 1\.0\]$"),
    (lambda: validate_config(load_config(overrides=["optimizer=adamw", "algorithm=d2", "mixing=lazy_metropolis"])),
     r"^algorithm 'd2' takes optimizer='sgd' only"),
    (lambda: load_config(overrides=["betas=0.9"]), r"config key 'betas' must be list, got 0\.9 \(float\)"),
    (lambda: _optimizer(optimizer="adam"), r"^optimizer 'adam' is unknown; did you mean 'adamw'\?"),
    (lambda: _optimizer(optimizer="adamw", betas=(0.9, 1.0)), r"^betas must be two numbers"),
    (lambda: _optimizer(optimizer="adamw", eps=-1.0), r"^eps must be a finite number > 0, got -1\.0$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_schedule="cosine", lr_min=0.5),
     r"^lr_min must be <= lr \(0\.1\) for lr_schedule 'cosine', got 0\.5$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_decay_steps=0), r"^lr_decay_steps must be an integer >= 1, got 0$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_gamma=0.0), r"^lr_gamma must be in \(0, 1\], got 0\.0$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_warmup=-1), r"^lr_warmup must be an integer >= 0, got -1$"),
    (lambda: make_algorithm("cdsgd", lr=0.1, lr_step_size=0), r"^lr_step_size must be an integer >= 1, got 0$"),
    (lambda: DecentralizedOptimizer(small_model().parameters(), Alone(), "cdsgd", lr=0.1, lr_schedule="cosine"),
     r"^lr_schedule 'cosine' needs its horizon K: give lr_decay_steps"),
]


@pytest.mark.parametrize("call,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input(call, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        call()
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------- step-size schedules


@pytest.mark.parametrize("kw,hyper", [
    ({"schedule": "constant"}, {}),
    ({"schedule": "diminishing", "tau": 5.0, "p": 0.75}, {"lr_schedule": "diminishing", "lr_tau": 5.0, "lr_power": 0.75}),
    ({"schedule": "cosine", "K": 12, "lr_min": 0.01}, {"lr_schedule": "cosine", "lr_decay_steps": 12, "lr_min": 0.01}),
    ({"schedule": "step", "s": 4, "gamma": 0.5}, {"lr_schedule": "step", "lr_step_size": 4, "lr_gamma": 0.5}),
])
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_each_schedule_is_its_closed_form_with_and_without_warmup(kw, hyper, warmup):
    alg = make_algorithm("cdsgd", lr=0.1, lr_warmup=warmup, **hyper)
    got = [alg.step_size(k) for k in range(20)]
    want = [closed_form(k, lr=0.1, warmup=warmup, **kw) for k in range(20)]
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    if warmup > 1:
        assert got[0] == pytest.approx(want[0]) == pytest.approx(closed_form(0, lr=0.1, **kw) / warmup)


def test_cosine_decays_over_the_run_total_steps_or_lr_decay_steps():
    """K = the run's total steps when lr_decay_steps is not given (the executor's run says it), else K; after K,
    α_min; the same run with lr_decay_steps = its total steps is the same run."""
    data = [(torch.randn(8, 5, generator=torch.Generator().manual_seed(j)), torch.arange(8) % 3) for j in range(3)]
    W = topologies.mixing_matrix(topologies.build("ring", 3))
    common = dict(steps=6, batch_size=4, lr=0.05, lr_schedule="cosine", lr_min=0.005, optimizer="adamw")
    by_run = simulate(small_model, data, W, "cdsgd", **common)
    assert by_run.simulator.algorithm.step_size.total_steps == 6
    given = simulate(small_model, data, W, "cdsgd", lr_decay_steps=6, **common)
    assert torch.equal(by_run.params, given.params)
    shorter = StepSize(0.05, "cosine", lr_min=0.005, decay_steps=3)
    assert [shorter(k) for k in (3, 4, 100)] == [0.005] * 3
    assert shorter(1) == pytest.approx(closed_form(1, lr=0.05, schedule="cosine", K=3, lr_min=0.005))
