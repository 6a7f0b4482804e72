r"""Compression operators for compressed gossip (CHOCO-SGD): what crosses an edge, byte for byte.

Koloskova, Stich & Jaggi, "Decentralized stochastic optimization and gossip
algorithms with compressed communication" (ICML 2019) gossip C(x̂_j − x_j)
instead of x_j, for an operator C that is a **contraction** with some
δ ∈ (0, 1]::

    E_C ‖C(x) − x‖² ≤ (1 − δ) ‖x‖²            for every x ∈ ℝ^P

An operator is **unbiased** when E_C[C(x)] = x. Each operator here encodes
the rows of an L×P stack (one agent's vector per row) into an L×B uint8
tensor, row i the message agent i sends, with B = ``message_bytes(P, dtype)``
counted exactly; ``decode`` turns any rows of such a payload (reordered,
duplicated: what a neighbour received) back into vectors, from the bytes
alone. The randomness of row i comes only from a ``torch.Generator`` seeded
with ``seeds[i]`` (taken mod 2⁶⁴), never from the global RNG, so that the
simulator and the runtime draw the same messages. Below, P is the vector's
length and e the element size of its dtype (4 for float32, 8 for float64);
values are stored in the machine's byte order.

=============  ===================================================  ========================  ==========
name           C(x)                                                 message bytes             δ / unbiased
=============  ===================================================  ========================  ==========
``none``       x                                                    P·e                       1 / yes
``top_k``      x on the k largest |x_i|, 0 elsewhere                k·e + k·w (w: index)      k/P / no
``random_k``   x on k coordinates drawn from the seed (× P/k if     8 + k·e                   k/P unscaled / if scaled
               ``scaled``), 0 elsewhere
``sign``       ‖x‖₁/P · sign(x)                                     e + ⌈P/8⌉                 ‖x‖₁²/(P‖x‖₂²) / no
``qsgd``       ‖x‖₂ · sign(x_i) · ξ_i / s  (÷ τ if ``rescale``)     e + ⌈P·(1+b)/8⌉           1/τ rescaled / if not
=============  ===================================================  ========================  ==========

with k = max(1, round(ratio·P)) (Python's ``round``, halves to even: the
rule ``fedavg_fraction`` uses), w the width of the narrowest integer type
holding P − 1 (uint8 up to P = 256, int16 up to 2¹⁵, int32 up to 2³¹, else
int64), s the qsgd levels, b = ⌈log₂(s + 1)⌉ and τ = 1 + min(P/s², √P/s).
Bits are packed least significant first: bit t of a row's bit stream is bit
t mod 8 of byte ⌊t/8⌋, padded with zeros to a whole byte.

PowerGossip's low-rank compression (Vogels, Karimireddy & Jaggi, NeurIPS
2020) is not provided yet: its messages depend on state kept per edge (the
previous power-iteration vectors), not on one vector and a seed.

Example (one agent, P = 4)::

    >>> import torch
    >>> from cdsgd.algorithms.compression import make_compressor
    >>> c = make_compressor("top_k", {"ratio": 0.5})
    >>> X = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    >>> payload = c.encode(X, seeds=[0])
    >>> payload.dtype, payload.shape[1], c.message_bytes(4, torch.float32)  # 2 float32 values + 2 uint8 indices
    (torch.uint8, 10, 10)
    >>> c.decode(payload, 4, torch.float32).tolist()
    [[0.0, -3.0, 0.0, 2.0]]
    >>> make_compressor("sign").compress(X, [0]).tolist()  # ‖x‖₁/P = 6.5/4
    [[1.625, -1.625, 1.625, 1.625]]
    >>> make_compressor("qsgd", {"level": 4})
    Traceback (most recent call last):
    ...
    ValueError: compression 'qsgd' takes no parameter 'level'; allowed: levels, rescale
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from topologies import Registry

from ..base.checks import Bounds, check_int

__all__ = ["COMPRESSORS", "MAX_LEVELS", "RATIO", "Compressor", "NoCompression", "QSGD", "RandomK", "Sign", "TopK",
           "make_compressor"]

#: the compression operators by name: ``make_compressor(name, params)`` builds one
COMPRESSORS: Registry[type[Compressor]] = Registry("compression")

#: ``ratio`` of the sparsifiers: the fraction of the coordinates a message keeps, in (0, 1]
RATIO = Bounds(low=0, high=1, low_open=True)
#: the most qsgd levels: every level ξ ≤ s is then exact in float32 (and a field fits 26 bits)
MAX_LEVELS = 1 << 24

_FLOATS = (torch.float32, torch.float64)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _check_levels(name: str, value: Any) -> int:
    if check_int(name, value, 1) > MAX_LEVELS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_LEVELS}], got {value!r}")
    return int(value)


#: one check per parameter name, shared by every operator that takes it
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "ratio": lambda name, v: float(RATIO.check(name, v)), "levels": _check_levels, "scaled": _check_bool,
    "rescale": _check_bool}


def _element_size(dtype: Any) -> int:
    if dtype not in _FLOATS:
        raise ValueError(f"compression works on float32 or float64 values, got {dtype!r}")
    return dtype.itemsize


def _generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` mod 2⁶⁴ (a message stores the seed as its int64 bit pattern)."""
    return torch.Generator().manual_seed(int(seed) % (1 << 64))


def _as_int64(seed: int) -> int:
    """``seed`` mod 2⁶⁴ as the signed 64-bit integer with the same bits."""
    return (int(seed) + (1 << 63)) % (1 << 64) - (1 << 63)


def _bytes(*parts: torch.Tensor) -> torch.Tensor:
    """The rows of 2-D tensors as bytes, side by side: a new L×B uint8 tensor."""
    rows = []
    for p in parts:  # an L×1 or empty tensor may be contiguous with stride(-1) ≠ 1, which view(uint8) refuses
        if not (p.is_contiguous() and p.stride(-1) == 1):
            p = torch.empty_like(p, memory_format=torch.contiguous_format).copy_(p)
        rows.append(p.view(torch.uint8))
    return torch.cat(rows, dim=1)


def _field(payload: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``count`` values of ``dtype`` per row from byte ``start`` on (copied: a column slice is not aligned
    for ``view(dtype)``), and the byte after them."""
    stop = start + count * dtype.itemsize
    raw = payload[:, start:stop].clone(memory_format=torch.contiguous_format)
    return raw.view(dtype), stop


def _pack(fields: torch.Tensor, width: int) -> torch.Tensor:
    """R×n codes in [0, 2^width) → R×⌈n·width/8⌉ bytes: bit j of code i is bit i·width + j of the row's stream
    (least significant first: numpy's ``packbits(bitorder="little")``, which packs CPU tensors)."""
    R, n = fields.shape
    nbytes = (n * width + 7) // 8
    shifts = torch.arange(width, dtype=fields.dtype, device=fields.device)
    bits = ((fields.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(R, n * width)
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.numpy(), axis=1, bitorder="little"))
    bits = torch.nn.functional.pad(bits, (0, nbytes * 8 - n * width))
    return (bits.view(R, nbytes, 8) << torch.arange(8, dtype=torch.uint8, device=bits.device)).sum(
        dim=2, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """The R×n int32 codes :func:`_pack` wrote into ``packed`` (R×⌈n·width/8⌉ bytes)."""
    R, nbytes = packed.shape
    if packed.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, count=n * width, bitorder="little"))
    else:
        shifts8 = torch.arange(8, dtype=torch.uint8, device=packed.device)
        bits = ((packed.unsqueeze(-1) >> shifts8) & 1).reshape(R, nbytes * 8)[:, :n * width]
    shifts = torch.arange(width, dtype=torch.int32, device=packed.device)
    return (bits.reshape(R, n, width).to(torch.int32) << shifts).sum(dim=2, dtype=torch.int32)


class Compressor:
    """A compression operator: ``encode`` rows into messages, ``decode`` messages into rows.

    Subclasses declare ``name``, ``unbiased`` and ``defaults`` (their keyword
    parameters and default values, each checked by the one check of its name)
    and write ``_message_bytes(numel, element_size)``, ``_encode(X, seeds)`` and
    ``_decode(payload, numel, dtype)``; this class checks the public methods'
    arguments. The maths is in the module docstring.
    """

    name: ClassVar[str] = ""
    #: E[decode(encode(x))] = x
    unbiased: bool = False
    #: the keyword parameters of the operator and their defaults
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **params: Any) -> None:
        for key in params:
            if key not in self.defaults:
                allowed = ", ".join(self.defaults) or "(none)"
                raise ValueError(f"compression {self.name!r} takes no parameter {key!r}; allowed: {allowed}")
        for key, default in self.defaults.items():
            setattr(self, key, _CHECKS[key](f"compression_params {key}", params.get(key, default)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.defaults)})"

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """The exact size in bytes of one message standing for a ``numel``-vector of ``dtype``."""
        return self._message_bytes(check_int("numel", numel), _element_size(dtype))

    def encode(self, X: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """The messages of the rows of the L×P stack ``X`` (a new L×B uint8 tensor on X's device); row i's
        randomness comes from a generator seeded with ``seeds[i]`` alone."""
        if not isinstance(X, torch.Tensor) or X.dim() != 2 or X.dtype not in _FLOATS or X.shape[1] < 1:
            got = f"{tuple(X.shape)} {X.dtype}" if isinstance(X, torch.Tensor) else type(X).__name__
            raise ValueError(f"compression encodes an L×P stack (P >= 1) of float32 or float64 rows, got {got}")
        seeds = list(seeds)
        if len(seeds) != X.shape[0]:
            raise ValueError(f"compression needs one seed per row: {X.shape[0]} rows, got {len(seeds)} seeds")
        bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
        if bad:
            raise ValueError(f"compression seeds must be integers, got {bad[0]!r}")
        return self._encode(X.contiguous(), seeds)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The R×numel tensor of ``dtype`` the R messages (rows of ``payload``) stand for; needs no seed nor
        other state: the same bytes give the same values, bit for bit."""
        size = self.message_bytes(numel, dtype)
        shape = (payload.dtype, tuple(payload.shape[1:])) if isinstance(payload, torch.Tensor) else None
        if shape != (torch.uint8, (size,)):
            got = f"{tuple(payload.shape)} {payload.dtype}" if shape else type(payload).__name__
            raise ValueError(f"compression {self.name!r} decodes R×{size} uint8 messages (numel={numel}, {dtype}), "
                             f"got {got}")
        return self._decode(payload, numel, dtype)

    def compress(self, X: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """``decode(encode(X, seeds))``: C applied to each row, as the receivers see it."""
        return self.decode(self.encode(X, seeds), X.shape[1], X.dtype)


@COMPRESSORS.register("none")
class NoCompression(Compressor):
    """C(x) = x: the message is the vector's raw bytes (P·e). Unbiased, δ = 1 (plain gossip)."""

    name, unbiased = "none", True

    def _message_bytes(self, numel, size):
        return numel * size

    def _encode(self, X, seeds):
        return _bytes(X)

    def _decode(self, payload, numel, dtype):
        return _field(payload, 0, numel, dtype)[0]


class _Sparsifier(Compressor):
    """Keeps k = max(1, round(ratio·P)) coordinates of each row."""

    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01}
    ratio: float

    def kept(self, numel: int) -> int:
        """k = max(1, round(ratio·numel)), the coordinates a message of a ``numel``-vector carries."""
        return min(numel, max(1, round(self.ratio * numel)))


@COMPRESSORS.register("top_k")
class TopK(_Sparsifier):
    r"""Top-k sparsification: keep the k entries of largest magnitude, zero the rest.

    Stich, Cordonnier & Jaggi, "Sparsified SGD with memory" (NeurIPS 2018);
    Alistarh et al., "The convergence of sparsified gradient methods"
    (NeurIPS 2018). With S the k indices of largest |x_i| (ties as
    ``torch.topk`` breaks them, the same for the same input)::

        C(x)_i = x_i if i ∈ S else 0,      ‖C(x) − x‖² = Σ_{i∉S} x_i² ≤ (1 − k/P) ‖x‖²

    (the P − k smallest squares average at most ‖x‖²/P). Deterministic, biased.
    Message: the k values (dtype), then their k indices at :meth:`index_dtype`.
    """

    name = "top_k"

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        """The narrowest integer type holding the indices 0 … numel − 1."""
        for dtype, limit in ((torch.uint8, 1 << 8), (torch.int16, 1 << 15), (torch.int32, 1 << 31)):
            if numel <= limit:
                return dtype
        return torch.int64

    def _message_bytes(self, numel, size):
        return self.kept(numel) * (size + self.index_dtype(numel).itemsize)

    def _encode(self, X, seeds):
        idx = X.abs().topk(self.kept(X.shape[1]), dim=1).indices
        return _bytes(X.gather(1, idx), idx.to(self.index_dtype(X.shape[1])))

    def _decode(self, payload, numel, dtype):
        k = self.kept(numel)
        values, at = _field(payload, 0, k, dtype)
        idx, _ = _field(payload, at, k, self.index_dtype(numel))
        out = torch.zeros(payload.shape[0], numel, dtype=dtype, device=payload.device)
        return out.scatter_(1, idx.long(), values)


@COMPRESSORS.register("random_k")
class RandomK(_Sparsifier):
    r"""Random-k sparsification: keep k coordinates drawn from the row's seed.

    Stich, Cordonnier & Jaggi (NeurIPS 2018); Koloskova, Stich & Jaggi (ICML
    2019). S = ``torch.randperm(P, generator=g)[:k]`` with g seeded by the
    row's seed, so each coordinate is kept with probability k/P::

        C(x)_i = c · x_i if i ∈ S else 0,   c = P/k (``scaled=True``) or 1

    ``scaled=True``: E[C(x)] = x (unbiased), E‖C(x) − x‖² = (P/k − 1) ‖x‖².
    ``scaled=False``: the contraction E‖C(x) − x‖² = (1 − k/P) ‖x‖².
    Message: the seed (8 bytes, int64) then the k values x_S (dtype), unscaled;
    no indices: the receiver draws S again from the seed, and scales.
    """

    name = "random_k"
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01, "scaled": False}
    scaled: bool

    @property
    def unbiased(self) -> bool:
        return self.scaled

    def _message_bytes(self, numel, size):
        return 8 + self.kept(numel) * size

    def _indices(self, seeds: list[int], numel: int, device: torch.device) -> torch.Tensor:
        """The kept coordinates of each row (R×k int64 on ``device``), drawn on the CPU from each seed."""
        k = self.kept(numel)
        rows = [torch.randperm(numel, generator=_generator(s))[:k] for s in seeds]
        return (torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)).to(device)

    def _encode(self, X, seeds):
        stored = torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64, device=X.device).view(-1, 1)
        return _bytes(stored, X.gather(1, self._indices(seeds, X.shape[1], X.device)))

    def _decode(self, payload, numel, dtype):
        stored, at = _field(payload, 0, 1, torch.int64)
        values, _ = _field(payload, at, self.kept(numel), dtype)
        if self.scaled:
            values = values * (numel / self.kept(numel))
        idx = self._indices(stored.view(-1).tolist(), numel, payload.device)
        return torch.zeros(payload.shape[0], numel, dtype=dtype, device=payload.device).scatter_(1, idx, values)


@COMPRESSORS.register("sign")
class Sign(Compressor):
    r"""Scaled sign: C(x) = ‖x‖₁/P · sign(x), one bit per coordinate and one scale.

    Bernstein, Wang, Azizzadenesheli & Anandkumar, "signSGD: compressed
    optimisation for non-convex problems" (ICML 2018); the ‖x‖₁/P scale is
    Karimireddy, Rebjock, Stich & Jaggi, "Error feedback fixes SignSGD and
    other gradient compression schemes" (ICML 2019). sign(0) = +1 here (the
    bit is set for x_i < 0 only); x·sign(x) = |x| and ‖sign(x)‖² = P still
    hold, so exactly::

        ‖C(x) − x‖² = ‖x‖₂² − ‖x‖₁²/P = (1 − δ(x)) ‖x‖₂²,   δ(x) = ‖x‖₁² / (P ‖x‖₂²) ≥ 1/P

    Deterministic, biased; x = 0 gives 0. Message: the scale ‖x‖₁/P (dtype),
    then ⌈P/8⌉ bytes of sign bits (1 for x_i < 0).
    """

    name = "sign"

    def _message_bytes(self, numel, size):
        return size + (numel + 7) // 8

    def _encode(self, X, seeds):
        scale = X.abs().sum(dim=1, keepdim=True) / X.shape[1]
        return _bytes(scale, _pack((X < 0).to(torch.int32), 1))

    def _decode(self, payload, numel, dtype):
        scale, at = _field(payload, 0, 1, dtype)
        negative = _unpack(payload[:, at:], numel, 1)
        return scale * (1 - 2 * negative).to(dtype)


@COMPRESSORS.register("qsgd")
class QSGD(Compressor):
    r"""QSGD: stochastic rounding of |x_i|/‖x‖₂ to s levels, with a sign bit.

    Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: communication-efficient
    SGD via gradient quantization and encoding" (NeurIPS 2017)::

        Q(x)_i = ‖x‖₂ · sign(x_i) · ξ_i / s,   r_i = s |x_i| / ‖x‖₂,
        ξ_i = ⌊r_i⌋ + Bernoulli(r_i − ⌊r_i⌋)   (u_i < r_i − ⌊r_i⌋, u_i uniform from the row's seed)

    so E[ξ_i] = r_i and E[Q(x)] = x, with E‖Q(x) − x‖² ≤ (τ − 1) ‖x‖²,
    τ = 1 + min(P/s², √P/s). ``rescale=True`` (default) decodes Q(x)/τ, the
    form CHOCO-SGD uses (Koloskova, Stich & Jaggi, ICML 2019, their qsgd
    example), a contraction with δ = 1/τ though no longer unbiased::

        E‖Q(x)/τ − x‖² = (1 − 1/τ)² ‖x‖² + E‖Q(x) − x‖²/τ² ≤ (1 − 1/τ) ‖x‖²

    ``rescale=False`` decodes Q(x) itself (unbiased). x = 0 gives 0.
    Message: ‖x‖₂ (dtype), then per coordinate a field of 1 + b bits,
    b = ⌈log₂(s + 1)⌉: bit 0 the sign (1 for x_i < 0), bits 1 … b the level ξ_i,
    all packed into ⌈P·(1 + b)/8⌉ bytes.
    """

    name = "qsgd"
    defaults: ClassVar[dict[str, Any]] = {"levels": 16, "rescale": True}
    levels: int
    rescale: bool

    @property
    def unbiased(self) -> bool:
        return not self.rescale

    @property
    def bits(self) -> int:
        """b = ⌈log₂(s + 1)⌉, the bits of a level ξ ∈ {0, …, s}."""
        return self.levels.bit_length()

    def tau(self, numel: int) -> float:
        """τ = 1 + min(P/s², √P/s): E‖Q(x) − x‖² ≤ (τ − 1)‖x‖²."""
        return 1 + min(numel / self.levels ** 2, math.sqrt(numel) / self.levels)

    def _message_bytes(self, numel, size):
        return size + (numel * (1 + self.bits) + 7) // 8

    def _encode(self, X, seeds):
        L, P = X.shape
        s = self.levels
        norm = torch.linalg.vector_norm(X, dim=1, keepdim=True)
        r = X.abs() / torch.where(norm > 0, norm, torch.ones_like(norm)) * s  # |x_i| ≤ ‖x‖: no overflow; x = 0: 0
        low = r.floor()
        draws = [torch.rand(P, generator=_generator(seed), dtype=X.dtype) for seed in seeds]
        u = (torch.stack(draws) if draws else torch.empty(0, P, dtype=X.dtype)).to(X.device)
        level = (low + (u < r - low).to(X.dtype)).clamp_(max=s).to(torch.int32)  # rounding may leave s·(1 + ε)
        return _bytes(norm, _pack((level << 1) | (X < 0).to(torch.int32), 1 + self.bits))

    def _decode(self, payload, numel, dtype):
        norm, at = _field(payload, 0, 1, dtype)
        codes = _unpack(payload[:, at:], numel, 1 + self.bits)
        out = norm * ((1 - 2 * (codes & 1)) * (codes >> 1)).to(dtype) / self.levels
        return out / self.tau(numel) if self.rescale else out


def make_compressor(name: str, params: dict | None = None) -> Compressor:
    """The operator registered as ``name`` with its keyword ``params`` (checked; defaults for the rest).

    >>> make_compressor("random_k", {"ratio": 0.1, "scaled": True})
    RandomK(ratio=0.1, scaled=True)
    """
    cls = COMPRESSORS.get(name)
    params = {} if params is None else params
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise ValueError(f"compression_params must be a table of parameter names to values, got {params!r}")
    return cls(**params)
