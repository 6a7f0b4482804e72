"""Every model runs forward and backward on every image shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cdsgd.models import MODELS, build_model, n_parameters, vmap_blockers

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODELS.names())
def test_forward_backward(name, shape):
    torch.manual_seed(0)
    n_classes = 100 if shape[0] == 3 else 10
    model = build_model(name, shape, n_classes)
    x = torch.randn(3, *shape)
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
])
def test_bad_models(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
