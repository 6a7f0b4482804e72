"""Local steps and outer optimizers: periodic gossip, ``diloco`` (fragments, overlap, compression with error
feedback) and ``noloco``, against independent transcriptions and closed forms.

DiLoCo's Algorithm 1 is written out with ``torch.optim.AdamW`` per worker inside and ``torch.optim.SGD``
(Nesterov) outside, the way its paper states it; NoLoCo's outer step as the authors' code computes it, with
the groups read off the schedule's matrices. Both in float64, to 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from cdsgd.algorithms import ALGORITHMS, make_algorithm
from cdsgd.algorithms.compression import make_compressor
from cdsgd.algorithms.outer import STREAMING_MIX, fragment_columns
from cdsgd.config import load_config
from cdsgd.executor import Executor
from cdsgd.mixers import MatrixMixer, make_mixer
from cdsgd.network import NetworkClock, network_spec
from cdsgd.run.plan import validate_config

N, P, H, ROUNDS = 4, 6, 3, 4
ADAM = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def problem(seed: int = 0):
    """Agent j's quadratic f_j(x) = ½ xᵀA_j x − b_jᵀx (A_j SPD): its gradient at x is A_j x − b_j."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(N, P, P, generator=g, dtype=torch.float64)
    A = M @ M.transpose(1, 2) / P + torch.eye(P, dtype=torch.float64)
    b = torch.randn(N, P, generator=g, dtype=torch.float64)
    x0 = torch.randn(P, generator=g, dtype=torch.float64)
    return A, b, x0


def grad(A, b, X):
    return torch.einsum("npq,nq->np", A, X) - b


def run_rule(alg, mixer, steps, seed=0):
    A, b, x0 = problem(seed)
    X = x0.repeat(N, 1)
    alg.bind(n_agents=N, steps_per_epoch=1, seed=0)
    state = alg.init_state(X, mixer)
    for k in range(steps):
        alg.update(X, grad(A, b, X), state, k=k, mixer=mixer)
    return X, state


def test_diloco_is_algorithm_1_of_its_paper_with_adamw_inside_and_nesterov_outside():
    """Per worker: H torch AdamW steps from θ^(t−1); Δ = mean(θ^(t−1) − θ_i); torch SGD with Nesterov on Δ."""
    A, b, x0 = problem()
    outer = x0.clone().requires_grad_()
    outer_opt = torch.optim.SGD([outer], lr=0.7, momentum=0.9, nesterov=True)
    workers = [x0.clone().requires_grad_() for _ in range(N)]
    inner = [torch.optim.AdamW([w], **ADAM) for w in workers]  # the inner state lives on across rounds
    for _ in range(ROUNDS):
        for j, (w, opt) in enumerate(zip(workers, inner)):
            with torch.no_grad():
                w.copy_(outer)
            for _ in range(H):
                w.grad = (A[j] @ w - b[j]).detach()
                opt.step()
        outer.grad = torch.stack([(outer - w).detach() for w in workers]).mean(0)
        outer_opt.step()
    alg = make_algorithm("diloco", local_steps=H, **ADAM)  # AdamW inside, η 0.7 and μ 0.9 outside: the defaults
    X, state = run_rule(alg, make_mixer(None, n_agents=N), ROUNDS * H)
    assert alg.adam is not None and (alg.outer_lr, alg.outer_momentum) == (0.7, 0.9)
    for j in range(N):
        assert (X[j] - outer.detach()).abs().max() < 1e-12
        assert (state["outer"][j] - outer.detach()).abs().max() < 1e-12


def test_noloco_is_the_authors_outer_step_within_the_schedules_groups():
    """m_i ← μ m_i + η·mean_G(θ^H − φ) + η·(mean_G φ − φ_i); φ_i ← φ_i + m_i; θ_i ← φ_i (jkolehm/noloco)."""
    A, b, x0 = problem(1)
    W = topologies.schedule("random_groups", N, group_size=2, seed=5)
    eta, mu = 0.7, 0.5
    phi = [x0.clone() for _ in range(N)]
    m = [torch.zeros(P, dtype=torch.float64) for _ in range(N)]
    theta = [x0.clone().requires_grad_() for _ in range(N)]
    inner = [torch.optim.AdamW([t], **ADAM) for t in theta]
    for r in range(ROUNDS):
        for j in range(N):
            for _ in range(H):
                theta[j].grad = (A[j] @ theta[j] - b[j]).detach()
                inner[j].step()
        Wr = np.asarray(W[r])
        groups = [np.flatnonzero(Wr[j]) for j in range(N)]
        assert all(len(G) == 2 and j in G for j, G in enumerate(groups))
        new = []
        for j, G in enumerate(groups):
            progress = torch.stack([theta[l].detach() - phi[l] for l in G]).mean(0)
            centre = torch.stack([phi[l] for l in G]).mean(0)
            m[j] = mu * m[j] + eta * progress + eta * (centre - phi[j])
            new.append(phi[j] + m[j])
        phi = new
        for j in range(N):
            with torch.no_grad():
                theta[j].copy_(phi[j])
    alg = make_algorithm("noloco", local_steps=H, outer_momentum=mu, **ADAM)
    X, _ = run_rule(alg, make_mixer(W, n_agents=N), ROUNDS * H, seed=1)
    for j in range(N):
        assert (X[j] - phi[j]).abs().max() < 1e-12


def test_diloco_with_one_local_sgd_step_and_a_plain_outer_step_is_centralized_sgd():
    sgd, _ = run_rule(make_algorithm("sgd", lr=0.1), make_mixer(None, n_agents=N), 10)
    alg = make_algorithm("diloco", lr=0.1, local_steps=1, outer_lr=1.0, outer_momentum=0.0, optimizer="sgd")
    diloco, _ = run_rule(alg, make_mixer(None, n_agents=N), 10)
    assert (diloco - sgd).abs().max() < 1e-12


@pytest.mark.parametrize("extra", [{}, {"fragments": 2, "overlap_steps": 1}])
def test_graph_mixing_on_the_complete_graph_with_uniform_weights_is_the_all_reduce(extra):
    uniform = np.full((N, N), 1.0 / N)
    runs = []
    for mixing, mixer in (("allreduce", make_mixer(None, n_agents=N)), ("graph", MatrixMixer(uniform))):
        alg = make_algorithm("diloco", lr=0.05, local_steps=H, outer_mixing=mixing, **extra)
        alg.tensor_sizes = [2, 4]
        runs.append(run_rule(alg, mixer, 4 * H)[0])
    assert (runs[0] - runs[1]).abs().max() < 1e-12


GOSSIP = [name for name in ALGORITHMS if ALGORITHMS.get(name).traffic == "neighbours"
          and name not in ("noloco", "adpsgd")]


def executor(algorithm, W, **hyper):
    g = torch.Generator().manual_seed(3)
    shards = [(torch.randn(12, 3, generator=g), torch.randint(0, 2, (12,), generator=g)) for _ in range(N)]
    extra = {"consensus_step": 0.5} if algorithm in ("choco", "beer") else {}
    return Executor.build(lambda: nn.Linear(3, 2), shards, W, algorithm, lr=0.1, batch_size=4, **extra, **hyper)


def graph_for(name):
    """A path (a tree: relaysum's) with lazy Metropolis weights (D²'s eigenvalue condition), push-sum for sgp."""
    return topologies.mixing_matrix(topologies.build("path", N), "push_sum" if name == "sgp" else "lazy_metropolis")


@pytest.mark.parametrize("name", GOSSIP)
def test_one_local_step_leaves_every_gossip_rule_unchanged(name):
    W = graph_for(name)
    plain, one = executor(name, W), executor(name, W, local_steps=1)
    for _ in range(5):
        plain.step(), one.step()
    assert torch.equal(plain.X, one.X) and torch.equal(plain.mixer.bytes_sent, one.mixer.bytes_sent)


PERIODIC = [name for name in ALGORITHMS if ALGORITHMS.get(name).periodic]


@pytest.mark.parametrize("name", PERIODIC)
def test_local_steps_send_one_hth_of_the_bytes_and_step_alone_between(name):
    """Over K·H steps with local_steps=H exactly 1/H of the bytes; between communications X moves by the
    local step alone (Π = I), on a communication step by the rule's mixing."""
    W = graph_for(name)
    every, periodic = executor(name, W), executor(name, W, local_steps=H)
    for k in range(4 * H):
        every.step()
        before = periodic.mixer.bytes_sent.clone()
        periodic.step()
        sent = periodic.mixer.bytes_sent - before
        assert bool((sent > 0).all()) == ((k + 1) % H == 0), k
    assert torch.equal(periodic.mixer.bytes_sent * H, every.mixer.bytes_sent)
    assert set(PERIODIC) == {"cdsgd", "cdmsgd", "qg_dsgdm", "sgp"}


def test_a_local_step_of_cdsgd_is_sgd_alone():
    W = topologies.mixing_matrix(topologies.build("ring", N))
    ex = executor("cdsgd", W, local_steps=H)
    X0 = ex.X.clone()
    ex.step()  # step 0 of H = 3: no message
    alone = executor("local", None, momentum=0.0)
    alone.step()
    assert torch.equal(ex.X, alone.X) and not torch.equal(ex.X, X0)


@pytest.mark.parametrize("name,why", [("dsgt", "tracker"), ("d2", "correction"), ("choco", "compressed gossip"),
                                      ("relaysum", "relayed sums"), ("sgd", "fedavg or diloco"),
                                      ("local", "never communicates")])
def test_rules_without_a_local_step_form_refuse_it_in_one_line(name, why):
    with pytest.raises(ValueError, match=rf"^local_steps=2: algorithm '{name}' takes local_steps=1 only \(.*{why}"
                                         r".*\); local steps are for cdsgd, cdmsgd, .*diloco, noloco$"):
        make_algorithm(name, lr=0.1, local_steps=2)


def diloco_bytes(steps, **hyper):
    """bytes_sent per agent after ``steps`` steps of diloco: all-reduce (the None mixer; compressed: the
    complete graph's uniform W, as the run builds) or a ring."""
    alg = make_algorithm("diloco", lr=0.05, **hyper)
    alg.tensor_sizes = [2, 4]
    if alg.outer_mixing == "graph":
        mixer = MatrixMixer(topologies.mixing_matrix(topologies.build("ring", N)))
    else:
        mixer = MatrixMixer(np.full((N, N), 1.0 / N)) if alg.compressed else make_mixer(None, n_agents=N)
    run_rule(alg, mixer, steps)
    return mixer.bytes_sent


@pytest.mark.parametrize("mixing", ["allreduce", "graph"])
def test_diloco_sends_one_hth_of_the_bytes_of_one_local_step(mixing):
    one = diloco_bytes(4 * H, local_steps=1, outer_mixing=mixing)
    assert torch.equal(diloco_bytes(4 * H, local_steps=H, outer_mixing=mixing) * H, one)
    per_step = 2 * (N - 1) / N * P * 8 if mixing == "allreduce" else 2 * P * 8  # ring all-reduce; ring degree 2
    assert one.tolist() == [4 * H * per_step] * N


@pytest.mark.parametrize("mixing,receivers", [("allreduce", N - 1), ("graph", 2)])
def test_compressed_pseudo_gradients_cost_their_message_bytes_to_each_receiver(mixing, receivers):
    c = make_compressor("top_k", {"ratio": 0.5})
    sent = diloco_bytes(4 * H, local_steps=H, outer_mixing=mixing, compression="top_k",
                        compression_params={"ratio": 0.5})
    assert sent.tolist() == [4 * receivers * c.message_bytes(P, torch.float64)] * N


def test_error_feedback_loses_nothing_what_was_dropped_is_sent_later():
    """Σ_t q_t + e_T = Σ_t Δ_t for every agent: the residual holds exactly what compression has not sent."""
    alg = make_algorithm("diloco", lr=0.05, local_steps=H, outer_mixing="graph", compression="top_k",
                         compression_params={"ratio": 0.34}, error_feedback=True, outer_lr=1.0, outer_momentum=0.0)
    A, b, x0 = problem()
    X = x0.repeat(N, 1)
    mixer = MatrixMixer(topologies.mixing_matrix(topologies.build("ring", N)))
    alg.bind(n_agents=N, steps_per_epoch=1, seed=0)
    state = alg.init_state(X, mixer)
    total_delta = torch.zeros_like(X)
    total_sent = torch.zeros_like(X)
    c = alg.compressor
    for k in range(4 * H):
        if alg.communicates(k):
            probe = X.clone()
            alg._inner(probe, grad(A, b, X) + 0.0, {n: t.clone() for n, t in state.items()}, k)
            delta = state["outer"] - probe
            v = delta + state["residual"]
            total_delta += delta
            total_sent += c.compress(v, [0] * N)  # top_k draws nothing: the seeds do not matter
        alg.update(X, grad(A, b, X), state, k=k, mixer=mixer)
    assert (total_sent + state["residual"] - total_delta).abs().max() < 1e-12
    assert state["residual"].abs().sum() > 0


def test_fragments_are_whole_tensors_sent_in_turn_and_each_lands_after_its_overlap():
    assert fragment_columns([3, 1, 1, 3], 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match=r"^fragments=5: fragments are whole parameter tensors and this model has 4; "
                                         r"allowed: 1 to 4$"):
        fragment_columns([3, 1, 1, 3], 5)
    alg = make_algorithm("diloco", lr=0.05, local_steps=4, fragments=2, overlap_steps=1, outer_lr=1.0,
                         outer_momentum=0.0, optimizer="sgd")
    alg.tensor_sizes = [3, 3]
    sends = {p: [k for k in range(12) if alg.sends(p, k)] for p in range(2)}
    assert sends == {0: [3, 7, 11], 1: [5, 9]}  # k + 1 = o_p + 4m, o = (0, 2), m >= 1
    mixer = make_mixer(None, n_agents=N)
    X0 = torch.arange(N * P, dtype=torch.float64).view(N, P)
    Gc = torch.randn(N, P, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    X, a = X0.clone(), 0.05
    alg.bind(n_agents=N, steps_per_epoch=1, seed=0)
    state = alg.init_state(X, mixer)
    for k in range(4):  # fragment 0 is sent at k = 3, after four inner steps: Δ_j = 4α g_j, nothing applied yet
        alg.update(X, Gc, state, k=k, mixer=mixer)
    assert (X - (X0 - 4 * a * Gc)).abs().max() < 1e-12
    assert (state["in_flight"][:, :3] - 4 * a * Gc[:, :3].mean(0)).abs().max() < 1e-12
    alg.update(X, Gc, state, k=4, mixer=mixer)  # ... and lands after step 4: φ ← φ − mean Δ; x ← ½ x + ½ φ
    phi = X0[:, :3] - 4 * a * Gc[:, :3].mean(0)
    x4 = X0 - 5 * a * Gc
    assert (X[:, :3] - (STREAMING_MIX * x4[:, :3] + (1 - STREAMING_MIX) * phi)).abs().max() < 1e-12
    assert (X[:, 3:] - x4[:, 3:]).abs().max() < 1e-12  # fragment 1 goes out at k = 5


def test_the_clock_waits_for_an_overlapped_message_only_when_it_is_due():
    """Two agents, all-reduce of T seconds sent after step 0's computation c, delay d: step d + 1 starts at
    max((d + 1)·c, c + T)."""
    spec = network_spec("none", {"bandwidth_mbps": 8, "latency_ms": 0, "compute_ms": 100})
    c, T = 0.1, 0.35  # 350 kB at 8 Mbit/s
    for d, expect in ((0, c + T), (2, c + T), (5, 6 * c)):
        clock = NetworkClock(spec, None, n_agents=2, traffic="allreduce")
        clock.advance(np.zeros(2), np.full(2, 350_000.0), delay=d)
        for _ in range(d):
            clock.advance(np.zeros(2), np.zeros(2))
        assert clock.seconds == pytest.approx((d + 1) * c if d else c + T)
        clock.advance(np.zeros(2), np.zeros(2))  # step d + 1 starts when the message has landed
        assert clock.start.tolist() == pytest.approx([expect + c] * 2), d


def test_a_checkpoint_mid_round_resumes_bit_for_bit():
    W = topologies.mixing_matrix(topologies.build("ring", N))
    hyper = dict(local_steps=4, outer_mixing="graph", fragments=2, overlap_steps=1, compression="top_k",
                 compression_params={"ratio": 0.3}, error_feedback=True)
    net = network_spec("wan", {"compute_ms": 5})
    whole = executor("diloco", W, network=net, **hyper)
    whole.run(steps=14, eval_every_steps=7)
    first = executor("diloco", W, network=net, **hyper)
    first.run(steps=6, eval_every_steps=7)  # stops inside a round, a fragment in flight
    saved = first.state_dict()
    second = executor("diloco", W, network=net, **hyper)
    second.load_state_dict(saved)
    second.run(steps=8, eval_every_steps=7)
    assert torch.equal(second.X, whole.X)
    for name in whole.state:
        assert torch.equal(second.state[name], whole.state[name]), name
    assert second.clock.clock.seconds == whole.clock.clock.seconds > 0


@pytest.mark.parametrize("overrides,message", [
    (["outer_lr=0"], r"^outer_lr must be a finite number > 0, got 0\.0$"),
    (["outer_momentum=1.0"], r"^outer_momentum must be in \[0, 1\), got 1\.0$"),
    (["local_steps=0", "algorithm=cdsgd"], None),  # 0 is "not given" in the config: H = 1
    (["outer_mixing=gossip"], r"^outer_mixing 'gossip' is unknown; allowed: allreduce, graph$"),
    (["error_feedback=true"], r"^error_feedback=true needs a compressor"),
    (["fragments=9", "local_steps=4"], r"^fragments=9 must be at most local_steps=4"),
    (["overlap_steps=4", "local_steps=4"], r"^overlap_steps=4 must be below local_steps=4 .*allowed: 0 to 3$"),
    (["algorithm=noloco", "group_size=3", "n_agents=4"], r"^group_size=3 must divide n_agents=4"),
])
def test_bad_outer_settings_are_refused_in_one_line(overrides, message):
    cfg = load_config(overrides=["algorithm=diloco", "n_agents=4", *overrides])
    if message is None:
        assert validate_config(cfg).algorithm.local_steps == 1
        return
    with pytest.raises(ValueError, match=message) as e:
        validate_config(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0, 2.5, -1])
def test_local_steps_zero_or_fractional_is_refused_by_the_rules(value):
    with pytest.raises(ValueError, match=rf"^local_steps must be an integer >= 1, got {value}$"):
        make_algorithm("diloco", lr=0.1, local_steps=value)


def test_fragments_beyond_the_models_tensors_are_refused_before_training():
    with pytest.raises(ValueError, match=r"^fragments=3: fragments are whole parameter tensors and this model has "
                                         r"2; allowed: 1 to 2$"):
        executor("diloco", None, local_steps=4, fragments=3)


def test_the_run_builds_noloco_groups_and_diloco_all_gathers_compressed_messages():
    plan = validate_config(load_config(overrides=["algorithm=noloco", "n_agents=6", "group_size=3", "seed=4"]))
    assert isinstance(plan.W, topologies.Schedule) and plan.W.name == "random_groups"
    assert plan.W.params["group_size"] == 3 and plan.W.params["seed"] == 4
    plan = validate_config(load_config(overrides=["algorithm=diloco", "n_agents=5", "compression=sign"]))
    assert np.allclose(plan.W, 0.2) and plan.algorithm.traffic == "neighbours"
    plan = validate_config(load_config(overrides=["algorithm=diloco", "n_agents=5"]))
    assert plan.W is None and plan.algorithm.traffic == "allreduce" and plan.algorithm.adam is not None


@pytest.mark.parametrize("name,overlaps", [("cdsgd", True), ("d2", False), ("diloco", False)])
def test_only_a_rule_that_mixes_the_pre_gradient_parameters_overlaps_its_messages(name, overlaps):
    """With overlap=true the clock hides a step's messages behind its computation for cdsgd, not for a rule
    that sends what the gradient made (d2) or an outer step (diloco)."""
    net = network_spec("edge", {"compute_ms": 30})
    W = graph_for("cdsgd" if name == "diloco" else name)
    hyper = {"local_steps": 2, "outer_mixing": "graph"} if name == "diloco" else {}
    seconds = []
    for overlap in (True, False):
        ex = executor(name, W, network=net, overlap=overlap, **hyper)
        ex.run(steps=4, eval_every_steps=4)
        seconds.append(ex.clock.clock.seconds)
    assert (seconds[0] < seconds[1]) == overlaps and seconds[0] <= seconds[1]
