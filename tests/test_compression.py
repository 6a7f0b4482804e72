"""The compression operators (cdsgd.algorithms.compression) against closed forms and independent numpy computations.

Sizes against the formulas of the module docstring, top_k against a numpy sort, sign against ‖x‖₁/P·sign(x),
random_k against the seeded draw, the bit layout against numpy.packbits, and the expectations (unbiasedness,
contraction) statistically over many seeds with bounds stated from the draws' own standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cdsgd.algorithms.compression import COMPRESSORS, QSGD, Compressor, RandomK, TopK, make_compressor

DTYPES = [torch.float32, torch.float64]
#: one configuration of each operator (small ratios and levels, so that compression actually happens)
CONFIGS = [("none", {}), ("top_k", {"ratio": 0.2}), ("random_k", {"ratio": 0.3}),
           ("random_k", {"ratio": 0.3, "scaled": True}), ("sign", {}), ("qsgd", {"levels": 3}),
           ("qsgd", {"levels": 16, "rescale": False})]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in CONFIGS]


def _stack(L: int, P: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((L, P))).to(dtype)


def _k(ratio: float, P: int) -> int:
    return max(1, round(ratio * P))


def _expected_bytes(name: str, params: dict, P: int, dtype: torch.dtype) -> int:
    """The message size written out from the module docstring's table, independently of the code."""
    e = 4 if dtype == torch.float32 else 8
    if name == "none":
        return P * e
    if name == "top_k":
        width = 1 if P <= 256 else 2 if P <= 32768 else 4 if P <= 2 ** 31 else 8
        return _k(params.get("ratio", 0.01), P) * (e + width)
    if name == "random_k":
        return 8 + _k(params.get("ratio", 0.01), P) * e
    if name == "sign":
        return e + math.ceil(P / 8)
    b = math.ceil(math.log2(params.get("levels", 16) + 1))
    return e + math.ceil(P * (1 + b) / 8)


def test_the_registry_holds_the_five_operators_with_their_flags():
    assert COMPRESSORS.names() == ["none", "top_k", "random_k", "sign", "qsgd"]
    flags = {(n, tuple(p.items())): make_compressor(n, p).unbiased for n, p in CONFIGS}
    assert [flags[(n, tuple(p.items()))] for n, p in CONFIGS] == [True, False, False, True, False, False, True]
    for name in COMPRESSORS:
        c = make_compressor(name)
        assert isinstance(c, Compressor) and c.name == name and type(c) is COMPRESSORS.get(name)
    assert (make_compressor("top_k").ratio, make_compressor("qsgd").levels, make_compressor("qsgd").rescale) == \
        (0.01, 16, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P", [1, 7, 100, 256, 257, 32768, 32769])
@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_message_size_is_the_closed_form(name, params, P, dtype):
    c = make_compressor(name, params)
    payload = c.encode(_stack(2, P, dtype), seeds=[3, 4])
    assert payload.dtype == torch.uint8 and payload.shape == (2, c.message_bytes(P, dtype))
    assert c.message_bytes(P, dtype) == _expected_bytes(name, params, P, dtype)


def test_top_k_index_width_beyond_int32():
    P = 2 ** 31 + 1  # too long to encode here: the size alone says int64 indices
    assert make_compressor("top_k", {"ratio": 1e-9}).message_bytes(P, torch.float32) == 2 * (4 + 8)
    assert [TopK.index_dtype(P) for P in (256, 257, 32768, 32769, 2 ** 31, P)] == \
        [torch.uint8, torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]


@pytest.mark.parametrize("P,width,np_index", [(256, 1, np.uint8), (257, 2, np.int16), (32768, 2, np.int16),
                                              (32769, 4, np.int32)])
def test_top_k_indices_are_stored_at_the_narrowest_width(P, width, np_index):
    """The largest entry sits at the last index P − 1, the one that needs the full width."""
    x = np.zeros(P)
    x[[0, P // 2, P - 1]] = [1.0, -2.0, 3.0]
    c = make_compressor("top_k", {"ratio": 3 / P})
    raw = c.encode(torch.from_numpy(x)[None], [0]).numpy()[0].tobytes()
    values = np.frombuffer(raw[:3 * 8], dtype=np.float64)
    index = np.frombuffer(raw[3 * 8:], dtype=np_index)
    assert len(raw) == 3 * (8 + width)
    assert sorted(zip(index.tolist(), values.tolist())) == [(0, 1.0), (P // 2, -2.0), (P - 1, 3.0)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_is_the_raw_bytes_and_exact(dtype):
    X = _stack(3, 50, dtype)
    c = make_compressor("none")
    payload = c.encode(X, [0, 1, 2])
    assert payload.numpy().tobytes() == X.numpy().tobytes()
    assert torch.equal(c.decode(payload, 50, dtype), X)
    payload[0, 0] ^= 1  # the message is the caller's own copy, not a view of X
    assert torch.equal(c.decode(c.encode(X, [0, 1, 2]), 50, dtype), X)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio,P", [(0.1, 50), (0.5, 7), (1.0, 9), (0.01, 1000), (0.3, 1)])
def test_top_k_keeps_exactly_the_largest_entries(ratio, P, dtype):
    X = _stack(4, P, dtype, seed=P)
    Y = make_compressor("top_k", {"ratio": ratio}).compress(X, [0] * 4).numpy()
    x = X.numpy()
    k = _k(ratio, P)
    expected = np.zeros_like(x)
    for i in range(4):  # numpy, independently: the k largest |x| (continuous draws: no ties)
        keep = np.argsort(-np.abs(x[i]))[:k]
        expected[i, keep] = x[i, keep]
    assert np.array_equal(Y, expected)
    assert ((Y != 0).sum(axis=1) == k).all()


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
def test_top_k_is_a_contraction(ratio):
    """‖C(x) − x‖² ≤ (1 − k/P)‖x‖² for every x: Gaussian, heavy-tailed, constant and one-spike vectors."""
    P = 200
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal(P), rng.standard_cauchy(P), np.ones(P), np.eye(P)[17], rng.uniform(-1, 1, P) ** 9]
    X = torch.tensor(np.array(rows))
    err = (make_compressor("top_k", {"ratio": ratio}).compress(X, [0] * len(rows)) - X).pow(2).sum(1)
    bound = (1 - _k(ratio, P) / P) * X.pow(2).sum(1)
    assert (err <= bound * (1 + 1e-12)).all(), (err, bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled", [False, True])
def test_random_k_keeps_the_seeded_set_and_decodes_from_the_bytes_alone(scaled, dtype):
    P, ratio, seeds = 40, 0.25, [5, 2 ** 63 + 11, 2 ** 64 - 1]
    k = _k(ratio, P)
    X = _stack(3, P, dtype)
    payload = make_compressor("random_k", {"ratio": ratio, "scaled": scaled}).encode(X, seeds)
    fresh = make_compressor("random_k", {"ratio": ratio, "scaled": scaled})  # knows no seed: reads it from the bytes
    Y = fresh.decode(payload, P, dtype)
    for i, seed in enumerate(seeds):
        kept = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:k]
        expected = torch.zeros(P, dtype=dtype)
        expected[kept] = X[i, kept] * (P / k if scaled else 1)
        assert torch.equal(Y[i], expected)
        stored = np.frombuffer(payload[i, :8].numpy().tobytes(), dtype=np.int64)[0]
        assert int(stored) % 2 ** 64 == seed  # the first 8 bytes are the seed
    assert (Y != 0).sum(1).tolist() == [k] * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_is_the_scaled_sign_and_its_exact_contraction(dtype):
    X = _stack(3, 37, dtype)
    X[1, 5] = 0.0  # sign(0) = +1
    Y = make_compressor("sign").compress(X, [0, 1, 2]).to(torch.float64).numpy()
    x = X.to(torch.float64).numpy()
    P = x.shape[1]
    expected = np.abs(x).sum(1, keepdims=True) / P * np.where(x < 0, -1.0, 1.0)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    np.testing.assert_allclose(Y, expected, rtol=tol)
    assert Y[1, 5] > 0
    # ‖C(x) − x‖² = ‖x‖₂² − ‖x‖₁²/P exactly (x·sign(x) = |x| and ‖sign(x)‖² = P hold with sign(0) = +1 too)
    np.testing.assert_allclose(((Y - x) ** 2).sum(1), (x ** 2).sum(1) - np.abs(x).sum(1) ** 2 / P, rtol=1e3 * tol)


def test_bit_layout_is_least_significant_first():
    """The documented layout, built with numpy.packbits: fields of 1 + b bits, sign bit first, then the level."""
    x = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0]])
    signs = make_compressor("sign").encode(x, [0])[0, 4:].numpy()
    assert signs.tolist() == np.packbits((x.numpy()[0] < 0).astype(np.uint8), bitorder="little").tolist() == [9, 1]
    # qsgd, s = 3 (b = 2), x = (0, −4, 0, 0, 0): r = s|x|/‖x‖ = (0, 3, 0, 0, 0) is whole, so no draw matters
    q = make_compressor("qsgd", {"levels": 3}).encode(torch.tensor([[0.0, -4.0, 0.0, 0.0, 0.0]]), [0])[0].numpy()
    assert np.frombuffer(q[:4].tobytes(), dtype=np.float32)[0] == 4.0
    fields = [0, (3 << 1) | 1, 0, 0, 0]
    bits = [(f >> j) & 1 for f in fields for j in range(3)]
    assert q[4:].tolist() == np.packbits(np.array(bits, dtype=np.uint8), bitorder="little").tolist() == [56, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_decode_of_reordered_and_duplicated_rows(name, params, dtype):
    c = make_compressor(name, params)
    X = _stack(3, 30, dtype)
    payload = c.encode(X, [7, 8, 9])
    whole = c.decode(payload, 30, dtype)
    order = [2, 0, 2, 1, 1]
    assert torch.equal(c.decode(payload[order], 30, dtype), whole[order])
    assert torch.equal(c.decode(payload[order], 30, dtype), whole[order])  # bit for bit, every time


@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_same_seeds_same_bytes(name, params):
    c = make_compressor(name, params)
    X = _stack(4, 64, torch.float32)
    first = c.encode(X, [1, 2, 3, 4])
    assert torch.equal(first, make_compressor(name, params).encode(X.clone(), [1, 2, 3, 4]))
    assert torch.equal(first[1:2], c.encode(X[1:2], [2]))  # a row's message depends on its own seed only


@pytest.mark.parametrize("name,params", [("random_k", {"ratio": 0.3}), ("qsgd", {"levels": 3})])
def test_different_seeds_different_messages(name, params):
    c = make_compressor(name, params)
    X = _stack(1, 64, torch.float32).repeat(4, 1)
    payload = c.encode(X, [1, 2, 3, 4])
    assert len({bytes(row.numpy()) for row in payload}) == 4
    values = c.decode(payload, 64, torch.float32)
    assert len({bytes(row.numpy()) for row in values}) == 4  # the vectors differ too, not only the stored seeds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,params", [("qsgd", {"levels": 2, "rescale": False}),
                                         ("random_k", {"ratio": 0.3, "scaled": True})])
def test_unbiased_operators_average_to_x(name, params, dtype):
    """Over N seeds the mean of C(x) is within 5 standard errors (sd/√N, sd from the draws) of x, per coordinate.

    With 12 coordinates a miss of a true-mean check would have probability about 12·6e-7; the seeds are fixed,
    so the test is deterministic anyway. A coordinate whose draws do not vary (sd = 0) must equal x to rounding.
    """
    N, P = 4000, 12
    x = _stack(1, P, dtype, seed=3)
    draws = make_compressor(name, params).compress(x.repeat(N, 1), list(range(N))).to(torch.float64)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(N)
    tol = 5 * se + (1e-5 if dtype == torch.float32 else 1e-12) * x.abs()[0].to(torch.float64)
    assert ((mean - x[0].to(torch.float64)).abs() <= tol).all(), (mean, x, se)
    assert (se > 0).any()


def test_unscaled_random_k_averages_to_k_over_p_times_x():
    """The contractive random_k is biased: E[C(x)] = (k/P)·x (again within 5 standard errors)."""
    N, P, ratio = 4000, 10, 0.3
    x = _stack(1, P, torch.float64, seed=4)
    draws = make_compressor("random_k", {"ratio": ratio}).compress(x.repeat(N, 1), list(range(N)))
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(N)
    assert ((mean - 0.3 * x[0]).abs() <= 5 * se).all()
    err = (draws - x).pow(2).sum(1)  # E‖C(x) − x‖² = (1 − k/P)‖x‖²
    assert abs(err.mean() - 0.7 * x.pow(2).sum()) <= 5 * err.std() / math.sqrt(N)


def test_rescaled_qsgd_is_a_contraction_in_expectation():
    """E‖Q(x)/τ − x‖² ≤ (1 − 1/τ)‖x‖² and E‖Q(x) − x‖² ≤ (τ − 1)‖x‖², τ = 1 + min(P/s², √P/s) (= 3.5 here).

    The means over N seeds plus 5 of their standard errors stay below the bounds (which are not tight).
    """
    N, P, s = 2000, 100, 4
    x = _stack(1, P, torch.float64, seed=5)
    norm2 = x.pow(2).sum()
    tau = 1 + min(P / s ** 2, math.sqrt(P) / s)
    assert QSGD(levels=s).tau(P) == tau == 3.5
    errors = {}
    for rescale, bound in ((True, (1 - 1 / tau) * norm2), (False, (tau - 1) * norm2)):
        err = (make_compressor("qsgd", {"levels": s, "rescale": rescale}).compress(x.repeat(N, 1), list(range(N)))
               - x).pow(2).sum(1)
        errors[rescale] = (err.mean(), err.std() / math.sqrt(N))
        assert errors[rescale][0] + 5 * errors[rescale][1] <= bound, (rescale, err.mean(), bound)
    # unrescaled, this Q is no contraction here (E‖Q(x) − x‖² ≈ 1.04‖x‖² > ‖x‖², by more than 5 standard errors):
    # dividing by τ is what makes it one
    assert errors[False][0] - 5 * errors[False][1] > norm2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,params", [("qsgd", {}), ("qsgd", {"rescale": False}), ("sign", {}),
                                         ("top_k", {"ratio": 0.5}), ("random_k", {"ratio": 0.5, "scaled": True})])
def test_zero_rows_give_zero(name, params, dtype):
    X = _stack(3, 20, dtype)
    X[1] = 0.0
    Y = make_compressor(name, params).compress(X, [0, 1, 2])
    assert torch.isfinite(Y).all() and torch.equal(Y[1], torch.zeros(20, dtype=dtype))
    assert (Y[0] != 0).any()


@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_an_empty_stack(name, params):
    c = make_compressor(name, params)
    payload = c.encode(torch.zeros(0, 9), [])
    assert payload.shape == (0, c.message_bytes(9, torch.float32))
    assert c.decode(payload, 9, torch.float32).shape == (0, 9)


BAD_PARAMS = [
    ("top_k", {"levels": 4}, r"^compression 'top_k' takes no parameter 'levels'; allowed: ratio$"),
    ("qsgd", {"ratio": 0.1}, r"compression 'qsgd' takes no parameter 'ratio'; allowed: levels, rescale"),
    ("none", {"ratio": 0.1}, r"compression 'none' takes no parameter 'ratio'; allowed: \(none\)"),
    ("top_k", {"ratio": 1.5}, r"^compression_params ratio must be in \(0, 1\], got 1\.5$"),
    ("random_k", {"ratio": 0}, r"compression_params ratio must be in \(0, 1\], got 0"),
    ("random_k", {"ratio": float("nan")}, r"compression_params ratio must be a number, got nan"),
    ("top_k", {"ratio": True}, r"compression_params ratio must be a number, got True"),
    ("top_k", {"ratio": "0.1"}, r"compression_params ratio must be a number, got '0\.1'"),
    ("random_k", {"scaled": 1}, r"compression_params scaled must be true or false, got 1"),
    ("qsgd", {"rescale": "yes"}, r"compression_params rescale must be true or false, got 'yes'"),
    ("qsgd", {"levels": 0}, r"compression_params levels must be an integer >= 1, got 0"),
    ("qsgd", {"levels": True}, r"compression_params levels must be an integer >= 1, got True"),
    ("qsgd", {"levels": 2.0}, r"compression_params levels must be an integer >= 1, got 2\.0"),
    ("qsgd", {"levels": 2 ** 24 + 1}, r"compression_params levels must be an integer in \[1, 16777216\], got 16777217"),
    ("topk", None, r"compression 'topk' is unknown; did you mean 'top_k'\? Known: none, qsgd, random_k, sign, top_k"),
    ("top_k", [("ratio", 0.1)], r"compression_params must be a table"),
]


@pytest.mark.parametrize("name,params,message", BAD_PARAMS)
def test_bad_parameters_are_refused_by_name(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(name, params)


def test_the_classes_refuse_bad_parameters_too():
    with pytest.raises(ValueError, match="compression 'top_k' takes no parameter 'levels'; allowed: ratio"):
        TopK(levels=3)
    with pytest.raises(ValueError, match=r"compression_params ratio must be in \(0, 1\], got -0\.1"):
        RandomK(ratio=-0.1, scaled=True)


def test_bad_stacks_seeds_and_payloads_are_refused():
    c = make_compressor("qsgd")
    for X, message in [(torch.zeros(2, 3, dtype=torch.int64), r"float32 or float64 rows, got \(2, 3\) torch.int64"),
                       (torch.zeros(3), r"an L×P stack .* got \(3,\)"), (torch.zeros(2, 0), r"P >= 1")]:
        with pytest.raises(ValueError, match=message):
            c.encode(X, [0] * len(X))
    with pytest.raises(ValueError, match="one seed per row: 2 rows, got 1 seeds"):
        c.encode(torch.zeros(2, 3), [0])
    with pytest.raises(ValueError, match="seeds must be integers, got True"):
        c.encode(torch.zeros(2, 3), [0, True])
    # 4 bytes of norm + 3 fields of 1 + 5 bits (s = 16) in 3 bytes
    with pytest.raises(ValueError, match=r"compression 'qsgd' decodes R×7 uint8 messages \(numel=3, torch.float32\), "
                                         r"got \(2, 8\) torch.uint8"):
        c.decode(torch.zeros(2, 8, dtype=torch.uint8), 3, torch.float32)
    with pytest.raises(ValueError, match="decodes R×7 uint8"):
        c.decode(torch.zeros(2, 7), 3, torch.float32)
    with pytest.raises(ValueError, match="decodes R×7 uint8"):
        c.decode(torch.zeros(7, dtype=torch.uint8), 3, torch.float32)
    with pytest.raises(ValueError, match="numel must be an integer >= 1, got 0"):
        c.message_bytes(0, torch.float32)
    with pytest.raises(ValueError, match="float32 or float64 values, got torch.float16"):
        c.message_bytes(4, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_a_cuda_stack_gives_the_same_messages(name, params):
    """Randomness is drawn on the CPU from each seed, so a GPU stack gives the CPU's bytes, on the GPU."""
    c = make_compressor(name, params)
    X = _stack(3, 300, torch.float64)
    payload = c.encode(X.cuda(), [1, 2, 3])
    assert payload.device.type == "cuda"
    if name != "top_k":  # top_k's ties could differ across devices; the draws here have none, sizes agree anyway
        assert torch.equal(payload.cpu(), c.encode(X, [1, 2, 3]))
    Y = c.decode(payload, 300, torch.float64)
    assert Y.device.type == "cuda" and torch.equal(Y.cpu(), c.decode(payload.cpu(), 300, torch.float64))
