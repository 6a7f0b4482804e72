"""Every model runs forward and backward on every shape of its kind (images, padded sequences, or token windows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cdsgd.models import MODELS, build_model, n_parameters, vmap_blockers

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
SEQUENCE_SHAPES = [(29, 13), (200, 2)]  # (T, mask + channels): japanese_vowels, a univariate set
RECURRENT = ("lstm", "gru", "pgru")
TOKEN_SHAPES = [(16,), (64,)]  # (T,): windows of token ids, for the language models (tests/test_gpt.py for more)
LANGUAGE = ("gpt",)
CASES = [(n, s) for n in MODELS.names()
         for s in (SEQUENCE_SHAPES if n in RECURRENT else TOKEN_SHAPES if n in LANGUAGE else SHAPES)]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_forward_backward(name, shape):
    torch.manual_seed(0)
    n_classes = 100 if shape[0] == 3 else 10
    model = build_model(name, shape, n_classes)
    x = torch.randn(3, *shape)
    if name in RECURRENT:
        x[:, :, 0] = (torch.arange(shape[0]) < torch.tensor([[shape[0]], [1], [shape[0] // 2]])).float()
    if name in LANGUAGE:  # token ids in, one next-token prediction per position out
        x = torch.randint(0, n_classes, (3, *shape))
        out = model(x)
        assert out.shape == (3, shape[0], n_classes)
        F.cross_entropy(out.reshape(-1, n_classes), x.roll(-1, dims=1).reshape(-1)).backward()
    else:
        out = model(x)
        assert out.shape == (3, n_classes)
        F.cross_entropy(out, torch.tensor([0, 1, 2])).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_paper_architectures():
    cnn = build_model("cnn", (3, 32, 32), 10)
    convs = [m for m in cnn.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 32, 64, 64] and all(c.kernel_size == (3, 3) for c in convs)
    dropouts = [m.p for m in cnn.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.25, 0.25]
    dense = [m for m in cnn.modules() if isinstance(m, torch.nn.Linear)]
    assert [d.out_features for d in dense] == [512, 10] and dense[0].in_features == 64 * 8 * 8
    big = build_model("big_cnn", (3, 32, 32), 100)
    assert [c.out_channels for c in big.modules() if isinstance(c, torch.nn.Conv2d)] == [64] * 3 + [128] * 3 + [256] * 3
    assert [d.out_features for d in big.modules() if isinstance(d, torch.nn.Linear)] == [512, 512, 100]
    fcn = build_model("fcn", (1, 28, 28), 10)
    assert [d.out_features for d in fcn.modules() if isinstance(d, torch.nn.Linear)] == [50] * 20 + [10]
    assert n_parameters(build_model("logreg", (1, 8, 8), 10)) == 64 * 10 + 10


def test_vmap_blockers():
    assert vmap_blockers(build_model("mlp", (1, 8, 8), 10)) == []
    assert "dropout" in vmap_blockers(build_model("cnn", (1, 8, 8), 10))[0]
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert "buffers" in vmap_blockers(bn)[0]


@pytest.mark.parametrize("call,pattern", [
    (lambda: build_model("resnet", (1, 8, 8), 10), r"model 'resnet' is unknown"),
    (lambda: build_model("cnn", (64,), 10), r"convolutional models need images of shape \(C, H, W\)"),
    (lambda: build_model("mlp", (1, 8, 8), 1), r"n_classes must be an integer >= 2, got 1"),
    (lambda: build_model("mlp", (1, 0, 8), 10), r"input_shape must be positive sizes"),
    (lambda: build_model("mlp", (1, 8, 8), 10, width=3), r"model 'mlp': bad options \['width'\]"),
    (lambda: build_model("lstm", (1, 8, 8), 10), r"recurrent models need sequences of shape \(T, 1 \+ C\)"),
    (lambda: build_model("gru", (20, 1), 10), r"recurrent models need sequences .* got input_shape \(20, 1\)"),
    (lambda: build_model("lstm", (20, 3), 10, hidden=0), r"model option hidden must be an integer >= 1, got 0"),
    (lambda: build_model("lstm", (20, 3), 10, packed="yes"), r"model option packed must be true or false"),
])
def test_bad_models(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def _sequences(lengths, T=24, C=3, seed=0):
    """A padded batch in the sequence layout: mask channel, then C features, zeros after each length."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(lengths), T, 1 + C)
    for i, n in enumerate(lengths):
        x[i, :n, 0] = 1
        x[i, :n, 1:] = torch.randn(n, C, generator=g)
    return x


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_packed_and_padded_recurrent_models_agree(cell):
    """Packed sequences skip padded steps; padded runs compute them but pick each sequence's own last state:
    the same logits and gradients (to rounding)."""
    x, y = _sequences([24, 3, 17, 1, 9]), torch.tensor([0, 1, 2, 1, 0])
    torch.manual_seed(1)
    packed = build_model(cell, (24, 4), 3, hidden=16, layers=2, packed=True)
    padded = build_model(cell, (24, 4), 3, hidden=16, layers=2)
    padded.load_state_dict(packed.state_dict())
    outs, grads = [], []
    for m in (packed, padded):
        out = m(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


def test_recurrent_output_ignores_padding_and_longer_batches():
    """A sequence's logits depend on its own steps only: not on padding values, nor on the batch's other lengths."""
    torch.manual_seed(0)
    m = build_model("lstm", (30, 4), 3, hidden=8)
    x = _sequences([5, 12])
    alone = m(x[:1, :5])  # the first sequence cut to its own length
    noisy = x.clone()
    noisy[0, 5:, 1:] = 7.0  # garbage where the mask says padding
    torch.testing.assert_close(m(noisy)[0], alone[0], rtol=0, atol=1e-6)
    # the model's hand-rolled reference: run the LSTM cell by cell over the 5 valid steps
    h = torch.zeros(1, 8)
    c = torch.zeros(1, 8)
    cellwise = torch.nn.LSTMCell(3, 8)
    cellwise.weight_ih.data, cellwise.weight_hh.data = m.rnn.weight_ih_l0.data, m.rnn.weight_hh_l0.data
    cellwise.bias_ih.data, cellwise.bias_hh.data = m.rnn.bias_ih_l0.data, m.rnn.bias_hh_l0.data
    for t in range(5):
        h, c = cellwise(x[:1, t, 1:], (h, c))
    torch.testing.assert_close(m.head(h)[0], alone[0], rtol=0, atol=1e-6)
    assert "recurrent" in vmap_blockers(m)[0]
