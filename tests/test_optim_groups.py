"""The torch.optim classes as torch optimizers: lr schedulers, add_param_group, user-written mixers, the matrix check.

Every trajectory is compared with an independent computation: ``torch.optim.SGD``
on the same data for one agent (Π = [1], where every rule reduces to SGD), or a
naive per-agent numpy transcription of the paper's recurrence for several
agents exchanging through an in-process board.
"""

from __future__ import annotations

import doctest

import networkx as nx
import numpy as np
import pytest
import torch

import topologies
from cdsgd.algorithms import CDMSGD, CDSGD, DecentralizedOptimizer, make_algorithm
from cdsgd.algorithms import optim as optim_module
from cdsgd.mixers import Handle, MatrixMixer, Mixer, result_tensor

F64 = torch.float64


def _docstring_mixer():
    """The ``Alone`` mixer exactly as the optim module's docstring writes it."""
    scope = {"torch": torch, "Handle": Handle, "Mixer": Mixer, "result_tensor": result_tensor}
    for ex in doctest.DocTestParser().get_examples(optim_module.__doc__):
        if "class Alone" in ex.source:
            exec(ex.source, scope)
            return scope["Alone"]
    raise AssertionError("the optim docstring no longer defines its Alone mixer")


Alone = _docstring_mixer()


# --------------------------------------------------------------- one agent: the rules are SGD

D_IN, N_SAMPLES = 4, 16
G = torch.Generator().manual_seed(3)
DATA_X = torch.randn(N_SAMPLES, D_IN, generator=G, dtype=F64)
DATA_Y = torch.randn(N_SAMPLES, generator=G, dtype=F64)
EXTRA_X = torch.randn(N_SAMPLES, 3, generator=G, dtype=F64)


def loss_of(w, v=None):
    pred = DATA_X @ w + (0.0 if v is None else EXTRA_X @ v)
    return ((pred - DATA_Y) ** 2).mean()


def run_single(make_opt, steps, *, scheduler=None, add_at=None, add_group=None):
    """Train w (and, from step ``add_at``, v) by least squares; the parameters' values after each step."""
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, D_IN, dtype=F64))
    v = torch.nn.Parameter(torch.full((3,), 0.5, dtype=F64))
    opt = make_opt([w])
    sched = scheduler(opt) if scheduler else None
    path = []
    for k in range(steps):
        if k == add_at:
            opt.add_param_group({"params": [v], **(add_group or {})})
        opt.zero_grad()
        loss_of(w, v if add_at is not None and k >= add_at else None).backward()
        opt.step()
        if sched:
            sched.step()
        path.append(torch.cat([w.detach(), v.detach()]).clone())
    return torch.stack(path)


# the rules whose one-agent form is torch's SGD (nesterov: m ← μm + g, d = g + μm; x ← x − α_k d)
SGD_LIKE = [
    ("cdsgd", {}, {}),
    ("dsgt", {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}),
    ("dsgt", {"momentum": 0.9, "nesterov": False}, {"momentum": 0.9}),
    ("d2", {"momentum": 0.5}, {"momentum": 0.5, "nesterov": True}),
    ("sgp", {"momentum": 0.5}, {"momentum": 0.5, "nesterov": True}),
]


@pytest.mark.parametrize("name,hyper,sgd_hyper", SGD_LIKE)
def test_step_lr_halves_the_step_as_for_torch_sgd(name, hyper, sgd_hyper):
    """StepLR(gamma=0.5) on DecentralizedOptimizer (one agent) follows torch.optim.SGD under the same StepLR."""
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)  # noqa: E731
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), name, lr=0.1, **hyper), 10, scheduler=sched)
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.1, **sgd_hyper), 10, scheduler=sched)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_step_lr_on_cdsgd_and_the_closed_form_of_the_halved_steps():
    """CDSGD's lr follows StepLR: with a constant gradient g, x_k = x_0 − g Σ_{i<k} 0.1·0.5^⌊i/2⌋."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    opt = CDSGD([w], Alone(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.tensor([1.0, -2.0], dtype=F64)
    for k in range(7):
        w.grad = g.clone()
        opt.step()
        sched.step()
        steps = sum(0.1 * 0.5 ** (i // 2) for i in range(k + 1))
        torch.testing.assert_close(w.detach(), -steps * g, rtol=0, atol=1e-15)


def test_the_rules_own_schedule_applies_on_top_of_the_torch_scheduler():
    """α_k = lr_k · (1 + k/τ)^−p: DecentralizedOptimizer(lr_schedule=diminishing) + StepLR = SGD + LambdaLR(product)."""
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), "dsgt", lr=0.1, momentum=0.0,
                                                       lr_schedule="diminishing", lr_tau=2.0, lr_power=1.0),
                      9, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.1), 9,
                     scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5 ** (k // 3) / (1 + k / 2)))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_one_cycle_drives_lr_and_momentum_as_for_torch_sgd():
    sched = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=12)  # noqa: E731
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), "dsgt", lr=0.1, momentum=0.9), 12, scheduler=sched)
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), 12, scheduler=sched)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,hyper,sgd_hyper", SGD_LIKE + [("cdmsgd", {"momentum": 0.9},
                                                              {"momentum": 0.9, "nesterov": True})])
def test_add_param_group_mid_run_follows_torch_sgd(name, hyper, sgd_hyper):
    """A group added at step 3 starts the rule afresh from its current values (D²: x^{-1} = x^0; tracker: y = g)."""
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), name, lr=0.05, **hyper), 8, add_at=3)
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.05, **sgd_hyper), 8, add_at=3)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert not torch.allclose(ours[-1, D_IN:], torch.full((3,), 0.5, dtype=F64))  # the new parameters moved


@pytest.mark.parametrize("klass,hyper,sgd_hyper", [(CDSGD, {"weight_decay": 0.1}, {"weight_decay": 0.1}),
                                                   (CDMSGD, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True})])
def test_consensus_optimizers_add_a_group_with_its_own_lr_as_torch_sgd(klass, hyper, sgd_hyper):
    ours = run_single(lambda p: klass(p, Alone(), lr=0.05, **hyper), 8, add_at=3, add_group={"lr": 0.02})
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.05, **sgd_hyper), 8, add_at=3, add_group={"lr": 0.02})
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_state_dict_keeps_the_schedulers_lr_and_resumes_bit_for_bit():
    def fresh():
        w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, D_IN, dtype=F64))
        opt = DecentralizedOptimizer([w], Alone(), "dsgt", lr=0.1, momentum=0.9)
        return w, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def steps(w, opt, sched, n):
        for _ in range(n):
            opt.zero_grad(); loss_of(w).backward(); opt.step(); sched.step()

    w, opt, sched = fresh()
    steps(w, opt, sched, 9)
    w1, opt1, sched1 = fresh()
    steps(w1, opt1, sched1, 5)
    saved, saved_sched, saved_w = opt1.state_dict(), sched1.state_dict(), w1.detach().clone()
    assert saved["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    w2, opt2, sched2 = fresh()
    with torch.no_grad():
        w2.copy_(saved_w)
    opt2.load_state_dict(saved)
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]
    steps(w2, opt2, sched2, 4)
    assert torch.equal(w2, w)


# --------------------------------------------------------------- several agents through a board


class Board:
    """An in-process exchange: the t-th start of every agent pairs with the t-th start of the others."""

    def __init__(self, W):
        self.W, self.posted = np.asarray(W, dtype=np.float64), {}


class BoardMixer(Mixer):
    def __init__(self, board, j):
        self.board, self.j, self.t = board, j, 0
        self.n_agents, self.agents, self.matrix = len(board.W), [j], board.W
        self.bytes_sent = torch.zeros(1, dtype=torch.float64)

    def start(self, x, *, out=None):
        board, j, t = self.board, self.j, self.t
        self.t += 1
        board.posted[(j, t)] = x.clone()
        out = result_tensor(x, out)

        class _Pending(Handle):
            def wait(self_inner):
                row = board.W[j]
                return out.copy_(sum(float(row[l]) * board.posted[(l, t)] for l in np.flatnonzero(row)))

        return _Pending(out)

    def average(self, x, mask=None, *, out=None):
        raise NotImplementedError


N = 3
W_RING = topologies.mixing_matrix(topologies.build("ring", N))
RNG = np.random.default_rng(5)
A = RNG.uniform(0.5, 2.0, size=(N, 5))       # f_j(x) = ½ Σ_i a_ji (x_i − b_ji)²: separable, heterogeneous
B = RNG.normal(0.0, 2.0, size=(N, 5))
X0 = RNG.normal(size=(N, 5))
P1 = 2  # coordinates 0..1 in the first group, 2..4 in the group added later


def agents_loop(make_opt, steps, *, add_at=None, add_group=None, schedulers=None):
    """Agents j = 0..N−1, each with its optimizer; every one posts, then all compute gradients, then all step."""
    board = Board(W_RING)
    ws = [torch.nn.Parameter(torch.tensor(X0[j, :P1])) for j in range(N)]
    vs = [torch.nn.Parameter(torch.tensor(X0[j, P1:])) for j in range(N)]
    opts = [make_opt([ws[j]], BoardMixer(board, j)) for j in range(N)]
    scheds = [schedulers(o) for o in opts] if schedulers else []
    path = []
    for k in range(steps):
        if k == add_at:
            for o, v in zip(opts, vs):  # every agent adds the same group before the same step
                o.add_param_group({"params": [v], **(add_group or {})})
        for o in opts:
            o.post()
        for j in range(N):
            a, b = torch.tensor(A[j]), torch.tensor(B[j])
            ws[j].grad = a[:P1] * (ws[j].detach() - b[:P1])
            vs[j].grad = a[P1:] * (vs[j].detach() - b[P1:])
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        path.append(np.stack([np.concatenate([ws[j].detach().numpy(), vs[j].detach().numpy()]) for j in range(N)]))
    return np.stack(path)


def diging(x0, a, b, lrs):
    """DIGing (Nedić, Olshevsky & Shi 2017), per agent: y ← W y + g(x^k) − g(x^{k−1}); x ← W x − α_k y (numpy)."""
    x, y, g_prev, path = x0.copy(), np.zeros_like(x0), np.zeros_like(x0), []
    for lr in lrs:
        g = a * (x - b)
        y = W_RING @ y + g - g_prev
        g_prev = g
        x = W_RING @ x - lr * y
        path.append(x.copy())
    return np.stack(path)


def cdsgd_reference(x0, a, b, lrs, momentum=0.0):
    """x ← W x − α g (momentum μ: m ← μ m − α g; x ← W x + μ m − α g), per agent (numpy)."""
    x, m, path = x0.copy(), np.zeros_like(x0), []
    for lr in lrs:
        g = a * (x - b)
        m = momentum * m - lr * g
        x = W_RING @ x + momentum * m - lr * g if momentum else W_RING @ x - lr * g
        path.append(x.copy())
    return np.stack(path)


def test_dsgt_agents_under_step_lr_follow_diging_with_the_halved_steps():
    lrs = [0.2 * 0.5 ** (k // 3) for k in range(10)]
    ours = agents_loop(lambda p, m: DecentralizedOptimizer(p, m, "dsgt", lr=0.2, momentum=0.0), 10, add_at=0,
                       schedulers=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))
    np.testing.assert_allclose(ours, diging(X0, A, B, lrs), rtol=0, atol=1e-12)


def test_dsgt_agents_adding_a_group_start_its_tracker_afresh():
    """Coordinates are independent (separable f, one W): the old ones run 9 DIGing steps, the new ones 5 from x0."""
    ours = agents_loop(lambda p, m: DecentralizedOptimizer(p, m, "dsgt", lr=0.1, momentum=0.0), 9, add_at=4)
    old = diging(X0[:, :P1], A[:, :P1], B[:, :P1], [0.1] * 9)
    new = diging(X0[:, P1:], A[:, P1:], B[:, P1:], [0.1] * 5)
    np.testing.assert_allclose(ours[:, :, :P1], old, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours[:4, :, P1:], np.broadcast_to(X0[:, P1:], (4, N, 5 - P1)))  # not yet trained
    np.testing.assert_allclose(ours[4:, :, P1:], new, rtol=0, atol=1e-12)


@pytest.mark.parametrize("klass,hyper", [(CDSGD, {}), (CDMSGD, {"momentum": 0.8})])
def test_consensus_agents_adding_a_group_with_its_own_lr(klass, hyper):
    ours = agents_loop(lambda p, m: klass(p, m, lr=0.1, **hyper), 8, add_at=3, add_group={"lr": 0.05})
    mu = hyper.get("momentum", 0.0)
    old = cdsgd_reference(X0[:, :P1], A[:, :P1], B[:, :P1], [0.1] * 8, mu)
    new = cdsgd_reference(X0[:, P1:], A[:, P1:], B[:, P1:], [0.05] * 5, mu)
    np.testing.assert_allclose(ours[:, :, :P1], old, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours[3:, :, P1:], new, rtol=0, atol=1e-12)


# --------------------------------------------------------------- what is refused, and how


def test_groups_of_decentralized_optimizer_share_lr_and_leave_the_rule_its_own():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"every group must have the same lr; got \[0.1, 0.01\]"):
        DecentralizedOptimizer([{"params": [a]}, {"params": [b], "lr": 0.01}], Alone(), "dsgt", lr=0.1)
    opt = DecentralizedOptimizer([a], Alone(), "dsgt", lr=0.1, momentum=0.0)
    with pytest.raises(ValueError, match="weight_decay belongs to the rule 'dsgt'"):
        opt.add_param_group({"params": [b], "weight_decay": 0.1})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    opt.param_groups[0]["momentum"] = 0.5  # e.g. a cyclic scheduler; the rule was built without a buffer
    a.grad = torch.ones(2)
    with pytest.raises(ValueError, match="built with momentum 0 and keeps no momentum buffer"):
        opt.step()


def test_a_scheduled_lr_may_reach_zero_but_not_below_nor_infinity_and_groups_check_nesterov():
    a = torch.nn.Parameter(torch.ones(2, dtype=F64))
    opt = DecentralizedOptimizer([a], Alone(), "dsgt", lr=0.1)
    a.grad = torch.ones(2, dtype=F64)
    opt.param_groups[0]["lr"] = 0.0  # a scheduler's last step: no move
    opt.step()
    assert a.tolist() == [1.0, 1.0]
    for bad in (-0.1, float("inf"), "0.1"):
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=r"lr in param_groups must be (a finite number >= 0|a number)"):
            opt.step()
    m = CDMSGD([a], Alone(), lr=0.1)
    with pytest.raises(ValueError, match="nesterov must be true or false, got 'yes'"):
        m.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1, dtype=F64))], "nesterov": "yes"})
    assert len(m.param_groups) == 1


def test_add_param_group_is_refused_while_an_exchange_is_in_flight_or_for_another_dtype():
    a = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    for opt in (CDSGD([a], Alone(), lr=0.1), DecentralizedOptimizer([a], Alone(), "dsgt", lr=0.1)):
        opt.post()
        with pytest.raises(RuntimeError, match="between post\\(\\) and step\\(\\)"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1, dtype=F64))]})
        opt.step()
        with pytest.raises(ValueError, match="must share one dtype and device"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))]})
        assert len(opt.param_groups) == 1


class NoAgents(Mixer):  # the old docstring example: ``rows`` instead of ``agents``, start without out=
    n_agents, rows = 1, [0]

    def __init__(self):
        self.bytes_sent = torch.zeros(1)

    def start(self, x):
        return Handle(x.clone())

    def average(self, x, mask=None):
        return x.clone()


class NoOut(NoAgents):
    agents = [0]


@pytest.mark.parametrize("build", [lambda p, m: CDSGD(p, m, lr=0.1), lambda p, m: CDMSGD(p, m, lr=0.1),
                                   lambda p, m: DecentralizedOptimizer(p, m, "dsgt", lr=0.1)])
def test_a_mixer_without_agents_or_out_gets_check_mixers_error(build):
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="mixer NoAgents must set agents"):
        build(p, NoAgents())
    with pytest.raises(ValueError, match=r"mixer NoOut.start must take out="):
        build(p, NoOut())


def test_the_docstring_mixer_runs_dsgt_as_sgd():
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), "dsgt", lr=0.1, momentum=0.0), 6)
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.1), 6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # with the default momentum (0.95, Nesterov: cdsgd.base.checks.HYPER_DEFAULTS), torch's SGD with the same
    ours = run_single(lambda p: DecentralizedOptimizer(p, Alone(), "dsgt", lr=0.1), 6)
    ref = run_single(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.95, nesterov=True), 6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


ROW_ONLY = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])  # rows sum to 1, columns do not


@pytest.mark.parametrize("build", [lambda p, m: CDSGD(p, m, lr=0.1), lambda p, m: CDMSGD(p, m, lr=0.1),
                                   lambda p, m: DecentralizedOptimizer(p, m, "cdsgd", lr=0.1)])
def test_consensus_optimizers_refuse_a_matrix_that_is_not_doubly_stochastic(build):
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="needs a doubly stochastic mixing matrix"):
        build(p, MatrixMixer(ROW_ONLY, validate=False))
    push = topologies.mixing_matrix(topologies.build("directed_ring", 3), "push_sum")
    build(p, MatrixMixer(push, validate=False))  # the directed ring's P is doubly stochastic: accepted


def test_optimizers_check_the_rule_at_construction_d2_and_sgp():
    p = [torch.nn.Parameter(torch.zeros(2))]
    bad_d2 = np.array([[0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])  # eigenvalues 1, −½, −½
    assert np.linalg.eigvalsh(bad_d2).min() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="smallest eigenvalue is > -1/3"):
        DecentralizedOptimizer(p, MatrixMixer(bad_d2, validate=False), "d2", lr=0.1)
    DecentralizedOptimizer(p, MatrixMixer((np.eye(3) + bad_d2) / 2), "d2", lr=0.1)  # lazy: eigenvalues >= 1/4
    column_only = topologies.mixing_matrix(nx.DiGraph([(0, 1), (1, 2), (2, 0), (0, 2)]), "push_sum")
    assert np.abs(column_only.sum(axis=1) - 1).max() > 0.1
    DecentralizedOptimizer(p, MatrixMixer(column_only, validate=False), "sgp", lr=0.1)
    with pytest.raises(ValueError, match="push-sum matrix .* is for algorithm=sgp"):
        CDSGD(p, MatrixMixer(column_only, validate=False), lr=0.1)
