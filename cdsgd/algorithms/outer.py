r"""Local steps and an outer optimizer: ``diloco`` (with Streaming DiLoCo's fragments and compressed
pseudo-gradients) and ``noloco``.

Notation as in :mod:`cdsgd.algorithms.rules`; H = ``local_steps``, η = ``outer_lr``, μ = ``outer_momentum``,
d_j the local (inner) optimizer's direction (AdamW's, m̂/(√v̂ + ε) + λx, by default for these two rules;
``optimizer="sgd"``: g_j), φ_j agent j's outer parameters (the last synchronised ones; φ_j = x_j^0).
Every step is an inner step x_j ← x_j − α_k d_j; every H-th step (k + 1 ≡ 0 mod H) is also an outer step:

``diloco``  DiLoCo (Douillard et al., "DiLoCo: distributed low-communication training of language
            models", 2023, Algorithm 1)::

                Δ_j = φ_j − x_j                                         (the pseudo-gradient: sent)
                Δ̄_j = (1/N) Σ_l Δ_l    (``outer_mixing="allreduce"``)  or  Σ_l w_jl Δ_l  (``"graph"``)
                m_j ← μ m_j + Δ̄_j;   φ_j ← φ_j − η (Δ̄_j + μ m_j)    (Nesterov, as torch.optim.SGD's)
                x_j ← φ_j

            All-reduce: one ring all-reduce of P values per outer step (2(N−1)/N·P·e bytes per agent),
            every φ_j the same. Graph: decentralized DiLoCo, one P-vector to each neighbour per outer step.
            **Fragments** F (Streaming DiLoCo, Douillard et al. 2025): the flat vector is cut at tensor
            boundaries into F fragments of about P/F values; fragment p runs the outer step above on its
            own columns at the steps k + 1 = o_p + mH (m ≥ 1, o_p = ⌊pH/F⌋: staggered), so each outer
            step sends P/F values. **Overlap** τ = ``overlap_steps``: the averaged fragment sent at step
            k is applied at the end of step k + τ, after τ more inner steps (the clock waits for it only
            then: :meth:`message_delay`), merged as x_p ← ½ x_p + ½ φ_p (the paper's mixing factor,
            :data:`STREAMING_MIX`); τ = 0 replaces x_p by φ_p. **Compression** C (``compression``,
            the operators of :mod:`cdsgd.algorithms.compression`): agent j sends q_j = C(Δ_j), or with
            ``error_feedback`` (SparseLoCo's form) q_j = C(Δ_j + e_j), e_j ← Δ_j + e_j − q_j; Δ̄_j = Σ_l w_jl
            q_l over the graph, or over the complete graph with weights 1/N for ``"allreduce"`` (an
            all-gather of the compressed messages: the run builds the complete graph, whatever ``topology``), each
            message's bytes counted as CHOCO's.
``noloco``  NoLoCo (Kolehmainen et al., "NoLoCo: no-all-reduce low communication training method for
            large models", 2025), as the authors' code (``jkolehm/noloco``,
            ``src/noloco/sparse_optimizer_c.py``, ``outer_step``) computes it. At each outer step r a
            seeded random partition of the agents into groups G of ``group_size`` n
            (``topologies.schedule("random_groups", ...)``, phase r) and, for agent j in group G::

                m_j ← μ m_j + η (1/n) Σ_{l∈G} (x_l − φ_l) + η ((1/n) Σ_{l∈G} φ_l − φ_j)
                φ_j ← φ_j + m_j;   x_j ← φ_j

            Two P-vectors (x_l − φ_l and φ_l) to each of the n − 1 other members: 2(n−1)·P·e bytes per
            agent per outer step; no all-reduce. The paper writes its Eq. 2 with a separate coefficient
            γ for the pull towards the group's mean and calls the momentum Nesterov; the code (followed
            here) uses γ = η and heavy-ball momentum, and draws the partition from the step count alone
            (here from the run's seed and r).

With H = 1, η = 1, μ = 0 and ``optimizer="sgd"``, ``diloco`` (all-reduce) is centralized SGD: φ ← φ − ḡα.

Example (two agents, all-reduce, one local step: the mean of the two inner steps)::

    >>> import torch
    >>> from cdsgd.algorithms import make_algorithm
    >>> from cdsgd.mixers import make_mixer
    >>> alg = make_algorithm("diloco", lr=0.5, local_steps=1, outer_lr=1.0, outer_momentum=0.0, optimizer="sgd")
    >>> X = torch.zeros(2, 1); mixer = make_mixer(None, n_agents=2)
    >>> _ = alg.bind(n_agents=2, steps_per_epoch=1, seed=0)
    >>> alg.update(X, torch.tensor([[1.0], [3.0]]), alg.init_state(X, mixer), k=0, mixer=mixer).tolist()
    [[-1.0], [-1.0]]
"""

from __future__ import annotations

import numpy as np
import torch

from ..base.checks import HYPER_DEFAULTS, MOMENTUM, OUTER_LR, OUTER_MIXINGS, OUTER_RULE_DEFAULTS, check_int
from .compression import make_compressor
from .messages import compressed_mix, seeds_for
from .rules import ALGORITHMS, Algorithm

__all__ = ["DiLoCoAlgorithm", "NoLoCoAlgorithm", "STREAMING_MIX", "fragment_columns"]

#: the weight of the local fragment when an overlapped outer step lands (Streaming DiLoCo's α)
STREAMING_MIX = 0.5


def fragment_columns(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """The column ranges of ``fragments`` fragments of a flat vector of tensors of ``sizes`` elements: whole
    tensors, in order, each fragment's end the tensor boundary nearest p·P/F (at least one tensor each).

    >>> fragment_columns([4, 4, 4, 4], 2), fragment_columns([10, 1, 1, 10], 2)
    ([(0, 8), (8, 16)], [(0, 11), (11, 22)])
    """
    sizes = [int(s) for s in sizes]
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"fragments={fragments}: fragments are whole parameter tensors and this model has "
                         f"{len(sizes)}; allowed: 1 to {len(sizes)}")
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    cuts, last = [], 0
    for p in range(1, fragments):
        lo, hi = last + 1, len(sizes) - (fragments - p)  # tensors in the first p fragments
        best = min(range(lo, hi + 1), key=lambda i: (abs(ends[i - 1] - p * total / fragments), i))
        cuts.append(best)
        last = best
    bounds = [0] + [ends[i - 1] for i in cuts] + [total]
    return list(zip(bounds[:-1], bounds[1:]))


class _OuterRule(Algorithm):
    """What diloco and noloco share: H inner steps of the local optimizer, then an outer step on φ."""

    same_init, takes_adamw, default_optimizer = True, True, "adamw"

    def __init__(self, *, local_steps: int = OUTER_RULE_DEFAULTS["local_steps"],
                 outer_lr: float = HYPER_DEFAULTS["outer_lr"], outer_momentum: float = HYPER_DEFAULTS["outer_momentum"],
                 **common) -> None:
        super().__init__(**common)
        self.local_steps = check_int("local_steps", local_steps, 1)
        self.outer_lr = float(OUTER_LR.check("outer_lr", outer_lr))
        self.outer_momentum = float(MOMENTUM.check("outer_momentum", outer_momentum))

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        return {"outer": X.detach().clone(), "outer_momentum": torch.zeros_like(X)}

    def _inner(self, X: torch.Tensor, G: torch.Tensor, state: dict, k: int) -> None:
        X.add_(self._local(G, X, state), alpha=-self.step_size(k))


@ALGORITHMS.register("diloco")
class DiLoCoAlgorithm(_OuterRule):
    """DiLoCo (module docstring): all-reduce or graph averaging of the pseudo-gradients; fragments, overlap,
    compression with error feedback."""

    name, traffic = "diloco", "allreduce"
    lost_message = None  # an outer step's average must reach every agent

    def __init__(self, *, outer_mixing: str = HYPER_DEFAULTS["outer_mixing"],
                 fragments: int = HYPER_DEFAULTS["fragments"], overlap_steps: int = HYPER_DEFAULTS["overlap_steps"],
                 compression: str = HYPER_DEFAULTS["compression"], compression_params: dict | None = None,
                 error_feedback: bool = HYPER_DEFAULTS["error_feedback"], **common) -> None:
        super().__init__(**common)
        self.outer_mixing = OUTER_MIXINGS.check("outer_mixing", outer_mixing)
        self.fragments = check_int("fragments", fragments, 1)
        self.overlap_steps = check_int("overlap_steps", overlap_steps, 0)
        if self.overlap_steps >= self.local_steps:
            raise ValueError(f"overlap_steps={self.overlap_steps} must be below local_steps={self.local_steps} "
                             f"(a fragment's outer step lands before its next one is sent); allowed: 0 to "
                             f"{self.local_steps - 1}")
        if self.fragments > self.local_steps:
            raise ValueError(f"fragments={self.fragments} must be at most local_steps={self.local_steps} "
                             "(each fragment is sent on its own step of the H)")
        self.compressor = make_compressor(compression, dict(compression_params or {}))
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be true or false, got {error_feedback!r}")
        if error_feedback and self.compressor.name == "none":
            raise ValueError("error_feedback=true needs a compressor (compression = top_k | random_k | sign | qsgd): "
                             "with compression='none' there is no residual to feed back")
        self.error_feedback = error_feedback
        self.compressed = self.compressor.name != "none"
        #: gossip over a graph, or the complete graph for a compressed all-gather; all-reduce otherwise
        self.traffic = "neighbours" if outer_mixing == "graph" or self.compressed else "allreduce"
        #: the run mixes over the complete graph, weights 1/N (a compressed all-reduce: an all-gather)
        self.needs_complete = self.compressed and outer_mixing == "allreduce"

    def columns(self, P: int) -> list[tuple[int, int]]:
        """The fragments' column ranges of the flat P-vector (one fragment: all of it)."""
        if self.fragments == 1:
            return [(0, P)]
        if self.tensor_sizes is None:
            raise ValueError(f"fragments={self.fragments} needs the model's parameter tensors: bind(tensor_sizes=...)"
                             " (the executors do)")
        return fragment_columns(self.tensor_sizes, self.fragments)

    def bind(self, **system) -> "DiLoCoAlgorithm":
        """As :meth:`Algorithm.bind`; fragments the model's tensors (``tensor_sizes``) cannot make are refused here."""
        super().bind(**system)
        if self.tensor_sizes is not None:
            self.columns(sum(self.tensor_sizes))
        return self

    def check_mixing(self, W) -> None:
        if self.needs_complete and W is not None:
            dense = np.asarray(W.toarray() if hasattr(W, "toarray") else W, dtype=np.float64)
            if np.abs(dense - 1.0 / dense.shape[0]).max() > 1e-12:
                raise ValueError("a compressed all-reduce (outer_mixing='allreduce' with compression) is an all-gather "
                                 "over the complete graph with weights 1/N; give that W, or outer_mixing='graph'")
        super().check_mixing(W)

    def _init_state(self, X: torch.Tensor, mixer) -> dict:
        self.columns(X[0].numel())  # fragments the model's tensors cannot make are refused before training
        state = super()._init_state(X, mixer)
        if self.error_feedback:
            state["residual"] = torch.zeros_like(X)
        if self.overlap_steps:
            state["in_flight"] = torch.zeros_like(X)
        return state

    def sends(self, p: int, k: int) -> bool:
        """Whether fragment p sends its pseudo-gradient at step k: k + 1 = o_p + mH, m >= 1."""
        t = k + 1 - (p * self.local_steps) // self.fragments
        return t >= self.local_steps and t % self.local_steps == 0

    def communicates(self, k: int) -> bool:
        return any(self.sends(p, k) for p in range(self.fragments))

    def message_delay(self, k: int) -> int:
        return self.overlap_steps

    def summary(self) -> dict:
        if self.fragments == 1 or self.tensor_sizes is None:
            return {}
        return {"fragment_columns": [list(c) for c in self.columns(sum(self.tensor_sizes))]}

    def _average(self, D: torch.Tensor, mixer, state: dict, cols: slice, k: int) -> torch.Tensor:
        """Δ̄ of the held rows' pseudo-gradients D (L×P_p): all-reduce, W-mix, or their compressed forms."""
        if self.compressed:
            if self.error_feedback:
                D = D + state["residual"][:, cols]
            q, mixed = compressed_mix(mixer, self.compressor, D, seeds_for(self.seed, mixer.agents, k, "outer"))
            if self.error_feedback:
                state["residual"][:, cols] = D - q
            return mixed
        if self.outer_mixing == "allreduce":
            return mixer.average(D)
        return mixer.mix(D)

    def _apply(self, X: torch.Tensor, state: dict, cols: slice, mean: torch.Tensor, *, merge: bool) -> None:
        phi, m = state["outer"][:, cols], state["outer_momentum"][:, cols]
        m.mul_(self.outer_momentum).add_(mean)
        phi.sub_(mean + self.outer_momentum * m, alpha=self.outer_lr)
        if merge:
            X[:, cols].mul_(STREAMING_MIX).add_(phi, alpha=1.0 - STREAMING_MIX)
        else:
            X[:, cols] = phi

    def _step(self, X, G, state, *, k, mixer, mixed):
        self._inner(X, G, state, k)
        L = X.shape[0]
        X2 = X.view(L, -1)
        flat = {name: t.view(L, -1) for name, t in state.items()}
        for p, (a, b) in enumerate(self.columns(X2.shape[1])):
            cols = slice(a, b)
            if self.overlap_steps and k >= self.overlap_steps and self.sends(p, k - self.overlap_steps):
                self._apply(X2, flat, cols, flat["in_flight"][:, cols], merge=True)
            if self.sends(p, k):
                mean = self._average(flat["outer"][:, cols] - X2[:, cols], mixer, flat, cols, k)
                if self.overlap_steps:
                    flat["in_flight"][:, cols] = mean
                else:
                    self._apply(X2, flat, cols, mean, merge=False)
        return X


@ALGORITHMS.register("noloco")
class NoLoCoAlgorithm(_OuterRule):
    """NoLoCo (module docstring): each outer step averages within a random group of ``group_size`` agents."""

    name, traffic, vectors_per_step = "noloco", "neighbours", 2
    lost_message = None
    elastic, why_not_elastic = False, "its random groups are drawn over every agent at each outer step"
    #: the run mixes over ``topologies.schedule("random_groups", N, group_size=..., seed=...)``
    needs_groups = True

    def __init__(self, *, group_size: int = HYPER_DEFAULTS["group_size"], **common) -> None:
        super().__init__(**common)
        self.group_size = check_int("group_size", group_size, 2)

    def check_mixing(self, W) -> None:
        if getattr(W, "name", None) != "random_groups":
            raise ValueError("algorithm 'noloco' mixes within random groups: its mixer is "
                             "topologies.schedule('random_groups', N, group_size=...), which cdsgd run builds")

    def step_mixer(self, mixer, k: int):
        """The groups of outer step r = ⌊k/H⌋ (the schedule's phase r)."""
        return mixer.at(k // self.local_steps)

    def _step(self, X, G, state, *, k, mixer, mixed):
        self._inner(X, G, state, k)
        if not self.communicates(k):
            return X
        phi, m = state["outer"], state["outer_momentum"]
        progress = mixer.mix(X - phi)  # (1/n) Σ_G (x_l − φ_l)
        centre = mixer.mix(phi)  # (1/n) Σ_G φ_l
        m.mul_(self.outer_momentum).add_(progress, alpha=self.outer_lr).add_(centre - phi, alpha=self.outer_lr)
        phi.add_(m)
        return X.copy_(phi)
