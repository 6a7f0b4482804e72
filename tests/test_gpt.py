"""model = "gpt": shapes, causal masking, tied embeddings, its parameter count, bad options, and the
simulator's strategies (loop ≡ vmap, exact mode) on token windows."""

from __future__ import annotations

import pytest
import torch

import topologies
from cdsgd.executor import Simulator
from cdsgd.executor.door import simulate
from cdsgd.executor.gradients import choose_strategy
from cdsgd.models import build_model, check_model_options, vmap_blockers
from cdsgd.transformer import gpt_parameters, has_attention

TINY = {"layers": 2, "heads": 2, "width": 16, "context": 16}


def tiny(T: int = 12, vocab: int = 32, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", (T,), vocab, **{**TINY, **options})


def token_shards(n: int, T: int = 12, vocab: int = 32, windows: int = 24, seed: int = 0):
    """``n`` shards of random token windows, the next token as the target at every position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = torch.randint(0, vocab, (windows, T + 1), generator=g)
        out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return out


def test_shapes_and_dtypes():
    m = tiny()
    out = m(torch.randint(0, 32, (3, 12)))
    assert out.shape == (3, 12, 32) and out.dtype == torch.float32
    assert m(torch.randint(0, 32, (2, 5))).shape == (2, 5, 32)  # shorter windows than the data's are fine
    assert not [x for x in m.modules() if isinstance(x, torch.nn.Dropout)]  # dropout 0: no modules at all


def test_no_position_sees_a_later_token():
    """Changing token t changes no logit at positions < t, and does change the logits at every position >= t."""
    m = tiny().eval()
    x = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = m(x)
        for t in (0, 5, 11):
            y = x.clone()
            y[:, t] = (y[:, t] + 1) % 32
            changed = (m(y) - base).abs().amax(dim=-1)  # (B, T): the largest change at each position
            assert torch.equal(changed[:, :t], torch.zeros_like(changed[:, :t])), (t, changed)
            assert (changed[:, t:] > 0).all(), (t, changed)


def test_input_and_output_embeddings_are_one_parameter():
    m = tiny(vocab=32)
    names = [n for n, p in m.named_parameters() if p.shape == (32, 16)]
    assert names == ["tok.weight"]
    # inputs use tokens 0 and 1 only: any gradient in rows 2.. of the embedding comes from the output side
    x = torch.randint(0, 2, (4, 12))
    torch.nn.functional.cross_entropy(m(x).reshape(-1, 32), x.roll(-1, 1).reshape(-1)).backward()
    grad = m.tok.weight.grad
    assert grad[2:].abs().sum(dim=1).gt(0).all()
    # and the logits read that parameter: moving row v moves logit v
    with torch.no_grad():
        before = m(x)
        m.tok.weight[7] += 1.0
        after = m(x)
    moved = (after - before).abs().amax(dim=(0, 1))
    assert moved[7] > 0 and torch.equal(moved[2:7], torch.zeros(5))


@pytest.mark.parametrize("V,layers,width,context", [(32, 2, 16, 16), (256, 1, 8, 64), (7, 3, 12, 5)])
def test_parameter_count_in_closed_form(V, layers, width, context):
    m = build_model("gpt", (min(context, 5),), V, layers=layers, heads=4, width=width, context=context)
    d = width
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = V * d + context * d + layers * per_block + 2 * d  # tok, pos, blocks, final LayerNorm
    assert sum(p.numel() for p in m.parameters()) == expected == gpt_parameters(V, layers=layers, width=width,
                                                                                context=context)


def test_initialisation_follows_nanogpt():
    m = build_model("gpt", (16,), 256, layers=4, width=128)
    with torch.no_grad():
        assert all(float(p.abs().max()) == 0 for n, p in m.named_parameters() if n.endswith("bias"))
        assert abs(float(m.tok.weight.std()) - 0.02) < 2e-3
        assert abs(float(m.blocks[0].proj.weight.std()) - 0.02 / (2 * 4) ** 0.5) < 1e-3


@pytest.mark.parametrize("shape,options,pattern", [
    ((16,), {"heads": 3, "width": 32}, r"width=32 is not divisible by heads=3"),
    ((300,), {}, r"the data's windows are T=300 tokens, longer than the model's context=256; raise "
                 r"model_params.context or lower dataset_params.context"),
    ((16,), {"layers": 0}, r"model option layers must be an integer >= 1, got 0"),
    ((16,), {"heads": 0}, r"model option heads must be an integer >= 1, got 0"),
    ((16,), {"width": 0}, r"model option width must be an integer >= 1, got 0"),
    ((16,), {"context": 0}, r"model option context must be an integer >= 1, got 0"),
    ((16,), {"dropout": 1.0}, r"model option dropout must be in \[0, 1\), got 1.0"),
    ((16,), {"dropout": -0.1}, r"model option dropout must be in \[0, 1\), got -0.1"),
    ((16,), {"dropout": "high"}, r"model option dropout must be a number"),
    ((16,), {"width": 64.0}, r"model option width must be an integer for model 'gpt' \(default 128\)"),
    ((16,), {"layres": 2}, r"bad options \['layres'\] \(option 'layres' is unknown; did you mean 'layers'\?"),
    ((1, 28, 28), {}, r"model 'gpt' reads windows of token ids of shape \(T,\), got input_shape \(1, 28, 28\)"),
])
def test_bad_options(shape, options, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_model("gpt", shape, 256, **options)


def test_options_are_checked_before_any_data():
    check_model_options("gpt", {"layers": 1, "width": 32, "heads": 8, "context": 16})
    with pytest.raises(ValueError, match=r"width=30 is not divisible by heads=4"):
        check_model_options("gpt", {"width": 30})
    with pytest.raises(ValueError, match=r"T=64 tokens, longer than the model's context=32"):
        check_model_options("gpt", {"context": 32}, input_shape=(64,), n_classes=256)


def test_dropout_draws_in_training_only_and_sends_the_agents_to_the_loop():
    m = tiny(dropout=0.5)
    x = torch.randint(0, 32, (2, 12))
    assert not torch.equal(m(x), m(x))  # training: attention and residual dropout draw
    m.eval()
    assert torch.equal(m(x), m(x))
    assert "dropout" in vmap_blockers(m)[0]
    assert choose_strategy("auto", m) == "loop"
    with pytest.raises(ValueError, match="strategy 'vmap' cannot simulate this model exactly: it has dropout"):
        choose_strategy("vmap", m)
    assert vmap_blockers(tiny()) == []


def test_auto_picks_the_loop_for_attention():
    """benchmarks/transformer.py: vmap is no faster than the loop for gpt on CPU (attention has no batching rule)."""
    assert has_attention(tiny()) and not has_attention(build_model("mlp", (1, 8, 8), 10))
    assert choose_strategy("auto", tiny()) == "loop"
    assert choose_strategy("vmap", tiny()) == "vmap"


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_loop_and_vmap_compute_the_same_gradients():
    shards, W = token_shards(3), topologies.mixing_matrix(topologies.build("ring", 3))
    G, losses = {}, {}
    for strategy in ("loop", "vmap"):
        sim = Simulator(lambda: tiny(), shards, W, "cdsgd", batch_size=4, seed=0, init="independent",
                        strategy=strategy, lr=0.1)
        assert sim.strategy == strategy
        losses[strategy] = sim.gradients.gradients([0, 1, 2], sim.data.batches([0, 1, 2]))
        G[strategy] = sim.gradients.G.clone()
    assert G["loop"].abs().amax(dim=1).gt(0).all()
    torch.testing.assert_close(G["vmap"], G["loop"], rtol=0, atol=1e-5)
    torch.testing.assert_close(losses["vmap"], losses["loop"], rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_a_run_under_every_strategy_and_the_exact_mode():
    """Three agents, a few steps with evaluation: vmap ≡ loop to float tolerance; exact mode runs the loop."""
    shards, W = token_shards(3), topologies.mixing_matrix(topologies.build("ring", 3))
    finals = {}
    for name, opts in {"loop": {"strategy": "loop"}, "vmap": {"strategy": "vmap"}, "exact": {"exact": True}}.items():
        res = simulate(lambda: tiny(), shards, W, "cdmsgd", steps=3, eval_every_steps=3, batch_size=4, seed=0,
                       test_set=shards[0], lr=0.05, momentum=0.9, **opts)
        assert res.simulator.strategy == ("loop" if name == "exact" else name)
        row = res.metrics[-1]
        assert 0 < row["test_loss"] < 10 and 0 <= row["test_accuracy"] <= 1
        finals[name] = res.params
    torch.testing.assert_close(finals["vmap"], finals["loop"], rtol=0, atol=1e-5)
    torch.testing.assert_close(finals["exact"], finals["loop"], rtol=0, atol=1e-5)


def test_learns_a_deterministic_next_token():
    """A repeating sequence 0 1 2 ... 6 0 1 ...: every next token is determined by the current one, so the
    loss (ln 7 ≈ 1.95 at the start) must fall well below it in a few dozen steps (to ~0.06 in 30 here)."""
    period, T = 7, 8
    seq = torch.arange(400) % period
    windows = torch.stack([seq[i:i + T + 1] for i in range(0, 300, 3)])
    shard = (windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
    W = topologies.mixing_matrix(topologies.build("path", 2))
    sim = Simulator(lambda: tiny(T=T, vocab=period), [shard, shard], W, "cdmsgd", batch_size=8, seed=0,
                    lr=0.1, momentum=0.9)
    first = sim.step()
    for _ in range(30):
        last = sim.step()
    assert first > 1.5 and last < 0.3 * first, (first, last)
