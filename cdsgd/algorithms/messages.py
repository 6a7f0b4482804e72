r"""Rules that send per-edge messages: compressed gossip (``choco``) and RelaySum (``relaysum``).

Both are written over :meth:`Mixer.exchange <cdsgd.mixers.Mixer.exchange>`
(each agent sends a tensor along each of its edges, see
:mod:`cdsgd.mixers.edges`), so the simulator and the runtime run the same
code, and ``bytes_sent_per_agent`` counts the messages as they are: the
compressed bytes, the relayed sums. Notation as in
:mod:`cdsgd.algorithms.rules`; d(g) is the local momentum direction
(``momentum`` β, Nesterov or heavy ball; β = 0: d = g).

``choco``  CHOCO-SGD (Koloskova, Stich & Jaggi, "Decentralized stochastic
           optimization and gossip algorithms with compressed communication",
           ICML 2019; Koloskova, Lin, Stich & Jaggi, "Decentralized deep
           learning with arbitrary communication compression", ICLR 2020,
           Algorithm 2 with local momentum). Each agent j keeps a public copy
           x̂_j of its parameters that its neighbours hold too, and
           s_j = Σ_l w_jl x̂_l (the memory-efficient form: the neighbours'
           copies enter only through this sum). With C the compressor
           (``compression``, :mod:`cdsgd.algorithms.compression`) and γ the
           consensus step (``consensus_step``):

               x_j^{k+½} = x_j^k − α_k d(g_j(x_j^k))
               q_j = C(x_j^{k+½} − x̂_j)                 (sent to every neighbour: its bytes)
               x̂_j ← x̂_j + q_j,   s_j ← s_j + w_jj q_j + Σ_l w_jl q_l
               x_j^{k+1} = x_j^{k+½} + γ (s_j − x̂_j)    (= x^{k+½} + γ Σ_l w_jl (x̂_l − x̂_j))

           x̂ = s = 0 at the start. With ``compression="none"`` and γ = 1,
           x̂ = x^{k+½} and the step is x ← W(x − α d): D-PSGD. C's
           randomness (random_k, qsgd) at step k for agent j comes from the
           seed (seed, "compression", j, k): nothing to checkpoint but x̂, s
           and the momentum. ``consensus_step = "auto"`` (the default) tunes γ
           before training on a simulated consensus problem on the same
           graph, compressor and parameter count (:func:`tune_consensus_step`):
           the reference code's grid search, on gossip instead of training runs.
``beer``   BEER (Zhao, Li, Richtárik & Chi, "BEER: fast O(1/T) rate for
           decentralized nonconvex optimization with communication
           compression", NeurIPS 2022): gradient tracking (``dsgt``) whose two
           exchanges are CHOCO's compressed gossip. Public copies ĥ (of x) and
           ĝ (of the tracker v), with their mixed sums s_h = Σ_l w_jl ĥ_l and
           s_g, all zero at the start, and g_j(x^{−1}) = 0:

               v_j^k = v_j^{k−1} + γ (s_g,j − ĝ_j) + g_j(x^k) − g_j(x^{k−1})
               ĝ_j ← ĝ_j + C(v_j^k − ĝ_j)                      (sent: one message)
               x_j^{k+1} = x_j^k + γ (s_h,j − ĥ_j) − α_k d(v_j^k)
               ĥ_j ← ĥ_j + C(x_j^{k+1} − ĥ_j)                  (sent: the second)

           Σ_j (s_g,j − ĝ_j) = 0 for a doubly stochastic W, so the trackers'
           mean is the agents' mean gradient at every step, compressed or not.
           γ, its tuning and the compressors are choco's.
``relaysum``  RelaySGD (Vogels, He, Koloskova, Karimireddy, Lin, Stich &
           Jaggi, "RelaySum for decentralized deep learning on heterogeneous
           data", NeurIPS 2021, Algorithm 1, the model variant) on a
           **spanning tree** (the run builds one: ``topologies.spanning_tree``).
           Agent i sends each tree neighbour j the sum of its own half-step
           and what its *other* neighbours sent it the step before, with the
           number of agents that sum holds:

               x_i^{k+½} = x_i^k − α_k d(g_i(x_i^k))
               m_{i→j} = x_i^{k+½} + Σ_{l ∈ N(i)∖j} m_{l→i}^{k−1},   c_{i→j} = 1 + Σ_{l ∈ N(i)∖j} c_{l→i}^{k−1}
               n_i = 1 + Σ_{j ∈ N(i)} c_{j→i},
               x_i^{k+1} = (x_i^{k+½} + Σ_{j ∈ N(i)} m_{j→i} + (N − n_i) x_i^0) / N

           (m, c = 0 before step 0; x_i^0 the fallback for the agents not yet
           heard from). On a network that loses messages (an empty message: no
           value, a count of 0, so n_i < N again) the fallback is the agent's
           latest model x_i^k instead of x_i^0, as the RelaySGD reference code
           runs its dropped-message experiments (``relaysum_model_update_ref_state``:
           the fallback follows the average after each step); x^0 would pull
           every short-counted average back to the initial model.
           On a tree each agent's half-step reaches
           every other agent exactly once, delayed by their distance: after
           diam steps n_i = N and x_i is the average of the agents' delayed
           models, without the spectral gap's slow mixing and unbiased by
           heterogeneous data. The count travels with the message (one
           element more per message).
"""

from __future__ import annotations

import numpy as np
import torch

import topologies

from ..base.checks import HYPER_DEFAULTS
from ..base.seeding import derive_seed
from ..mixers import MatrixMixer, is_schedule
from ..mixers.edges import edge_table
from .compression import Compressor, make_compressor
from .heterogeneous import _LocalMomentum
from .rules import ALGORITHMS, Algorithm, _direction

__all__ = ["CONSENSUS_STEPS", "BeerAlgorithm", "ChocoAlgorithm", "RelaySumAlgorithm", "tune_consensus_step"]

#: the grid ``consensus_step = "auto"`` searches (largest first: ties go to the larger step)
CONSENSUS_STEPS = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.035, 0.025, 0.018, 0.012, 0.008, 0.005)
#: the simulated consensus problem of the tuning: this many gossip steps, on at most this many coordinates in all
TUNE_STEPS, TUNE_ELEMENTS = 100, 1 << 18
#: the tuning takes the largest γ whose consensus error is within this factor of the best one's ...
TUNE_SLACK = 1.5
#: ... and whose gossip still converges (error < 1) at every grid step up to this multiple of γ (a stability margin)
TUNE_MARGIN = 2.0


def seeds_for(seed: int, agents, k: int, purpose: str = "compression") -> list[int]:
    """The seeds of the held agents' step-k messages: (seed, purpose, j, k) for each agent j."""
    return [derive_seed(seed, purpose, int(j), int(k)) for j in agents]


def compressed_mix(mixer, compressor: Compressor, V: torch.Tensor,
                   seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Send q_j = C(v_j) (row j of the L×P stack V, seeded by ``seeds[j]``) to every neighbour; returns
    (q, W q): the held agents' own decoded messages and each one's weighted sum Σ_l w_jl q_l of what it holds.

    Every message goes through ``mixer.exchange`` (its bytes are counted
    there). A mixer that holds every agent (the simulator) received the very
    bytes its agents sent, so the received q_l are the senders' decoded rows
    (the same floats: decoding is deterministic) and are not decoded again;
    its fast mode adds them up by the mixer's product W q.
    """
    table = edge_table(mixer)
    P = V.shape[1]
    payload = compressor.encode(V, seeds)  # L×B bytes: one message per agent, the same to each neighbour
    received = mixer.exchange(payload.index_select(0, table.senders(payload.device))).wait()  # E×B
    q_self = compressor.decode(payload, P, V.dtype)
    exact, alone = getattr(mixer, "exact", False), len(mixer.agents) == mixer.n_agents
    if alone and not exact and hasattr(mixer, "product"):
        return q_self, mixer.product(q_self, torch.empty_like(q_self))
    q_recv = (q_self.index_select(0, table.sources(q_self.device)) if alone
              else compressor.decode(received, P, V.dtype))
    return q_self, table.weighted_sum(q_self, q_recv, torch.empty_like(q_self), exact=exact)


def _compressed_gossip(mixer, compressor: Compressor, target: torch.Tensor, public: torch.Tensor,
                       mixed: torch.Tensor, seeds: list[int]) -> None:
    """Send q_j = C(target_j − x̂_j) to every neighbour; x̂ += q (the public copies), s += W q (their mixed sum)."""
    L = len(seeds)
    public2, mixed2 = public.view(L, -1), mixed.view(L, -1)
    q_self, Wq = compressed_mix(mixer, compressor, target.view(L, -1) - public2, seeds)
    public2.add_(q_self)
    mixed2.add_(Wq)


def _choco_gossip(mixer, compressor: Compressor, X: torch.Tensor, Xhat: torch.Tensor, S: torch.Tensor,
                  gamma: float, seeds: list[int]) -> torch.Tensor:
    """One compressed gossip step on the held rows (X in place): x += γ (s − x̂) after sending C(x − x̂)."""
    _compressed_gossip(mixer, compressor, X, Xhat, S, seeds)
    return X.add_(S - Xhat, alpha=gamma)


def tuning_size(numel: int, n_agents: int) -> int:
    """Coordinates per agent of the tuning's simulated consensus problem: min(numel, TUNE_ELEMENTS / N), at least 1."""
    return max(1, min(int(numel), TUNE_ELEMENTS // n_agents))


def tune_consensus_step(W, compressor: Compressor, numel: int, *, seed: int = 0,
                        steps: int = TUNE_STEPS) -> tuple[float, dict]:
    """γ for CHOCO on mixing matrix ``W`` with ``compressor``, from its gossip on a simulated consensus problem.

    The problem: N agents start from independent standard normal vectors of
    :func:`tuning_size` coordinates (seeded by ``seed``) and run ``steps``
    steps of CHOCO's gossip (no gradients) for each γ of
    :data:`CONSENSUS_STEPS`; the score is the remaining consensus error
    ‖X − X̄‖² / ‖X₀ − X̄₀‖². The choice is the largest γ whose score is within
    :data:`TUNE_SLACK` of the best and whose gossip still converges (score < 1)
    at every grid step up to :data:`TUNE_MARGIN` × γ (the best score's γ when
    none qualifies). Training is a moving target, where mixing fast matters
    more than the last digits of a fixed consensus (Fashion-MNIST, 16 agents on
    a ring, top_k 1 %: the best score's γ = 0.035 gave 83.1 % average-model
    accuracy, γ = 0.1 gave 83.9 %), but a γ at the edge of the gossip's
    stability diverges once gradients perturb it (qsgd with 16 levels: γ =
    0.25, next to a diverging 0.5, diverged in every training run). Returns (γ, {γ: score}).
    """
    mixer = MatrixMixer(W, validate=False)
    n = mixer.n_agents
    d = tuning_size(numel, n)
    X0 = torch.randn(n, d, generator=torch.Generator().manual_seed(derive_seed(seed, "consensus_step")),
                     dtype=torch.float64)
    start = float(((X0 - X0.mean(0)) ** 2).sum())
    scores = {}
    for gamma in CONSENSUS_STEPS:
        X, Xhat, S = X0.clone(), torch.zeros_like(X0), torch.zeros_like(X0)
        for k in range(steps):
            _choco_gossip(mixer, compressor, X, Xhat, S, gamma, seeds_for(seed, range(n), k))
        err = float(((X - X.mean(0)) ** 2).sum()) / start
        scores[gamma] = err if np.isfinite(err) else float("inf")
    best = min(scores.values())
    for g in CONSENSUS_STEPS:  # largest first
        stable = all(scores[h] < 1.0 for h in CONSENSUS_STEPS if g < h <= TUNE_MARGIN * g)
        if scores[g] <= TUNE_SLACK * best and stable:
            return g, scores
    return min(CONSENSUS_STEPS, key=lambda g: scores[g]), scores


def _check_static(name: str, W) -> None:
    if is_schedule(W):
        raise ValueError(f"algorithm {name!r} takes one fixed mixing matrix, not a time-varying schedule "
                         f"({W.name})")


@ALGORITHMS.register("choco")
class ChocoAlgorithm(_LocalMomentum, Algorithm):
    """CHOCO-SGD (module docstring): one compressed message per agent per step, sent to every neighbour."""

    name, traffic = "choco", "neighbours"
    why_not_periodic = "no reference defines compressed gossip with local steps"
    elastic = False
    why_not_elastic = "its neighbours keep a public copy of each agent's model that a departure or a return would split"
    #: every agent keeps its neighbours' public copies in step: a lost compressed message would split them
    lost_message = None

    def __init__(self, *, compression: str = HYPER_DEFAULTS["compression"], compression_params: dict | None = None,
                 consensus_step: float | str = HYPER_DEFAULTS["consensus_step"], **common) -> None:
        super().__init__(**common)  # momentum, nesterov, lr, ...
        if compression_params is None:  # each compressor's own defaults
            compression_params = dict(HYPER_DEFAULTS["compression_params"])
        self.compressor = make_compressor(compression, compression_params)
        if consensus_step == "auto":
            self.consensus_step = "auto"
        elif (isinstance(consensus_step, (int, float)) and not isinstance(consensus_step, bool)
              and 0 < consensus_step <= 1):
            self.consensus_step = float(consensus_step)
        else:
            raise ValueError(f"consensus_step must be a number in (0, 1] or \"auto\", got {consensus_step!r}")
        #: the γ in use (the tuned one when consensus_step="auto"; None until the first step tunes it)
        self.gamma: float | None = None if self.consensus_step == "auto" else self.consensus_step
        self.tuning: dict | None = None

    def check_mixing(self, W) -> None:
        _check_static(self.name, W)
        super().check_mixing(W)

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"public": torch.zeros_like(X), "public_mixed": torch.zeros_like(X), **self._momentum_state(X)}

    def prepare(self, mixer, X: torch.Tensor) -> list[str]:
        """Tune γ now when it is ``"auto"`` (else at the first step); returns what to tell the user."""
        if self.gamma is not None:
            return []
        W = (mixer.part_of or mixer).matrix
        if W is None:
            raise ValueError("consensus_step=\"auto\" needs the mixer's matrix (mixer.matrix) to tune γ on; "
                             "give a number instead")
        self.gamma, scores = tune_consensus_step(W, self.compressor, X[0].numel(), seed=self.seed)
        self.tuning = scores
        P = X[0].numel()
        d = tuning_size(P, W.shape[0])
        line = (f"consensus_step=auto chose γ = {self.gamma:g} for compression={self.compressor.name} on this graph "
                f"(consensus error {scores[self.gamma]:.3g}, best {min(scores.values()):.3g}, after {TUNE_STEPS} "
                f"simulated gossip steps on {d} of the {P} coordinates)")
        if self.compressor.name == "qsgd" and d < P:
            line += ("; qsgd's noise grows with the dimension, so the tuned γ can be too large for the model: "
                     "if training diverges, give consensus_step (0.05 worked for 16 agents on a ring, docs/results.md)")
        return [line]

    def summary(self) -> dict:
        return {"consensus_step_used": self.gamma, "consensus_step_auto": self.consensus_step == "auto"}

    def _step(self, X, G, state, *, k, mixer, mixed):
        if self.gamma is None:
            self.prepare(mixer, X)
        D = _direction(G, state, self.momentum, self.nesterov)
        X.add_(D, alpha=-self.step_size(k))  # x^{k+½}
        _choco_gossip(mixer, self.compressor, X, state["public"], state["public_mixed"], self.gamma,
                      seeds_for(self.seed, mixer.agents, k))
        return X


@ALGORITHMS.register("relaysum")
class RelaySumAlgorithm(_LocalMomentum, Algorithm):
    """RelaySGD (module docstring): a different message to each tree neighbour per step."""

    name, traffic = "relaysum", "neighbours"
    why_not_periodic = "its relayed sums assume a message on every step"
    elastic, why_not_elastic = False, "its relayed sums pass through every agent of one spanning tree"
    #: the rule runs on a spanning tree of the topology (the run builds it: ``topologies.spanning_tree``)
    needs_tree = True

    def __init__(self, **common) -> None:
        super().__init__(**common)
        #: what stands in for the agents not yet heard from: "initial" (x_i^0) or "latest" (x_i^k, under losses)
        self.fallback = "initial"

    def expect_losses(self) -> None:
        """Lost messages short the counts at any step: fall back on the agent's latest model (module docstring)."""
        self.fallback = "latest"

    def check_mixing(self, W) -> None:
        """Refuse a schedule and a graph that is not a tree (connected, N − 1 edges)."""
        _check_static(self.name, W)
        super().check_mixing(W)
        G = topologies.graph_of(W)
        if not topologies.is_tree(G):
            raise ValueError(f"algorithm 'relaysum' runs on a spanning tree, but this mixing matrix's graph has "
                             f"{G.number_of_edges()} edges on {G.number_of_nodes()} agents (a tree has N − 1 and "
                             "no cycle); build W on topologies.spanning_tree(G) (cdsgd run does)")

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        """The fallback (x^0; x^k under losses), the momentum, and the messages received the step before
        (E×(P+1): each relayed sum, then its count; zero before step 0), sized by ``mixer``'s edges (made at the
        first step when no mixer is given)."""
        state = {"initial": X.detach().clone(), **self._momentum_state(X)}
        if mixer is not None:
            self._received(state, X, mixer)
        return state

    @staticmethod
    def _received(state: dict, X: torch.Tensor, mixer) -> torch.Tensor:
        """``state["received"]``, made (zero: nothing received before step 0) when it is not there yet."""
        if "received" not in state:
            state["received"] = X.new_zeros((len(mixer.edges), X[0].numel() + 1))
        return state["received"]

    def _step(self, X, G, state, *, k, mixer, mixed):
        table = edge_table(mixer)
        D = _direction(G, state, self.momentum, self.nesterov)
        L, N = len(mixer.agents), mixer.n_agents
        H = X.view(L, -1).add_(D.view(L, -1), alpha=-self.step_size(k))  # x^{k+½}, in place
        received = self._received(state, X, mixer)
        P = H.shape[1]
        own = torch.cat([H, H.new_ones(L, 1)], dim=1)  # the half-step and its count, 1
        send = table.sum_others(own, received, torch.empty_like(received))
        received.copy_(mixer.exchange(send).wait())
        total = table.sum_received(own, received, torch.empty_like(own))
        missing = (N - total[:, P:]).clamp_(min=0)  # N − n_i agents not yet heard from: the fallback stands in
        X.view(L, -1).copy_(total[:, :P].addcmul_(state["initial"].view(L, -1), missing).div_(N))
        if self.fallback == "latest":
            state["initial"].copy_(X)
        return X


@ALGORITHMS.register("beer")
class BeerAlgorithm(ChocoAlgorithm):
    """BEER (module docstring): gradient tracking over compressed gossip, two compressed messages per step."""

    name = "beer"

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        zeros = {name: torch.zeros_like(X) for name in ("public", "public_mixed", "tracker", "tracker_public",
                                                        "tracker_mixed", "previous_gradient")}
        return {**zeros, **self._momentum_state(X)}

    def _step(self, X, G, state, *, k, mixer, mixed):
        if self.gamma is None:
            self.prepare(mixer, X)
        V, G_prev = state["tracker"], state["previous_gradient"]
        V.add_(state["tracker_mixed"] - state["tracker_public"], alpha=self.gamma).add_(G).sub_(G_prev)  # v^k
        G_prev.copy_(G)
        _compressed_gossip(mixer, self.compressor, V, state["tracker_public"], state["tracker_mixed"],
                           seeds_for(self.seed, mixer.agents, k, "compression-tracker"))  # ĝ^k
        D = _direction(V, state, self.momentum, self.nesterov)
        X.add_(state["public_mixed"] - state["public"], alpha=self.gamma).add_(D, alpha=-self.step_size(k))
        _compressed_gossip(mixer, self.compressor, X, state["public"], state["public_mixed"],
                           seeds_for(self.seed, mixer.agents, k))  # ĥ^{k+1}
        return X
