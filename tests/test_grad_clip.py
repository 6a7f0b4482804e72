"""grad_clip: each agent's gradient scaled to at most norm c, the same in both gradient strategies.

The expected gradients are computed here independently: one fresh module per
agent, loaded with that agent's row of X, ``torch.autograd.grad`` on its own
batch, flattened and clipped by hand with c / ‖g‖ (a plain Python norm).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cdsgd.executor import Executor
from cdsgd.executor.gradients import clip_rows_

N, D, K, B = 4, 5, 3, 6


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, K))


def _shards():
    g = torch.Generator().manual_seed(3)
    # agent j's inputs are scaled by 10^(j-1): unclipped gradient norms 0.11, 0.72, 1.87, 1.16 (c = 0.5 and 1 cut some)
    return [(torch.randn(B, D, generator=g) * 10.0 ** (j - 1), torch.randint(0, K, (B,), generator=g))
            for j in range(N)]


def _manual(X: torch.Tensor, batches, c: float) -> torch.Tensor:
    rows = []
    for x_row, (xb, yb) in zip(X, batches):
        m = _model()
        torch.nn.utils.vector_to_parameters(x_row.detach().clone(), m.parameters())
        grads = torch.autograd.grad(nn.functional.cross_entropy(m(xb), yb), list(m.parameters()))
        g = torch.cat([t.reshape(-1) for t in grads]).double()
        norm = math.sqrt(sum(v * v for v in g.tolist()))
        rows.append(g * (c / norm) if c > 0 and norm > c else g)
    return torch.stack(rows)


def _computed(strategy: str, c: float):
    ex = Executor.build(_model, _shards(), None, "sgd", lr=0.1, batch_size=B, strategy=strategy, grad_clip=c)
    assert ex.strategy == strategy
    batches = ex.data.batches(list(range(N)))
    ex.gradients.gradients(list(range(N)), batches)
    return ex.X.clone(), batches, ex.gradients.G.clone().double()


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
@pytest.mark.parametrize("c", [0.0, 0.5, 1.0])
def test_clipped_gradients_match_a_manual_computation(strategy, c):
    X, batches, G = _computed(strategy, c)
    expected = _manual(X, batches, c)
    torch.testing.assert_close(G, expected, rtol=1e-5, atol=1e-6)
    norms = G.norm(dim=1)
    if c > 0:
        assert (norms <= c * (1 + 1e-5)).all()
    raw = _manual(X, batches, 0.0)
    below = raw.norm(dim=1) <= c
    if c > 0:  # the thresholds cut some agents and spare others
        assert below.any() and (~below).any()
        torch.testing.assert_close(G[below], raw[below], rtol=1e-5, atol=1e-6)  # rows below c unchanged


def test_zero_is_a_no_op_and_strategies_agree():
    _, _, plain = _computed("loop", 0.0)
    ex = Executor.build(_model, _shards(), None, "sgd", lr=0.1, batch_size=B, strategy="loop")
    ex.gradients.gradients(list(range(N)), ex.data.batches(list(range(N))))
    assert torch.equal(plain, ex.gradients.G.double())  # grad_clip=0 is bit for bit the default
    for c in (0.5, 1.0):
        torch.testing.assert_close(_computed("loop", c)[2], _computed("vmap", c)[2], rtol=1e-5, atol=1e-6)


def test_clip_rows_by_hand():
    G = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.6, 0.8], [-6.0, 8.0]])
    clip_rows_(G, 1.0)
    torch.testing.assert_close(G, torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.6, 0.8], [-0.6, 0.8]]))
    same = torch.tensor([[3.0, 4.0]])
    assert torch.equal(clip_rows_(same, 0.0), torch.tensor([[3.0, 4.0]]))


def test_the_update_sees_clipped_gradients():
    """One plain SGD step (no mixing) moves X by exactly −lr · the clipped gradients."""
    ex = Executor.build(_model, _shards(), None, "local", lr=0.1, momentum=0.0, batch_size=B, strategy="loop",
                  grad_clip=0.5)
    X0 = ex.X.clone()
    batches = [(x[:B], y[:B]) for x, y in ex.shards]  # a full shard is one batch: order does not matter
    ex.step()
    torch.testing.assert_close((X0 - ex.X).double(), 0.1 * _manual(X0, batches, 0.5), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "1"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="grad_clip must be a finite number >= 0"):
        Executor.build(_model, _shards(), None, "sgd", lr=0.1, batch_size=B, grad_clip=bad)
