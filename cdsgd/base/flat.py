"""Flat parameter vectors: one helper for packing tensors into a P-vector and viewing it back.

Everything that exchanges or stacks parameters works on flat vectors: the
executor's N×P stack, the torch.optim classes' exchange buffer, the MGRIT
gradient all-reduce. :func:`flatten` packs, :func:`unflatten` gives views
in the original shapes, :class:`ParamLayout` remembers a module's names,
shapes and offsets. :func:`kept` is the one cache of work buffers that a
step reuses instead of allocating (the rules' mixing outputs, the mixer's
scratch, the agents' batches).

    >>> a, b = torch.ones(2, 2), torch.zeros(3)
    >>> flat = flatten([a, b]); flat.tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    >>> [tuple(v.shape) for v in unflatten(flat, [a.shape, b.shape])]
    [(2, 2), (3,)]
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["ParamLayout", "flatten", "kept", "unflatten"]


def kept(store: dict, key, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A buffer of ``shape`` with ``like``'s dtype and device, made on the first request and kept in ``store``.

    The same (``key``, shape, dtype, device) gives the same memory every time,
    so a steady state allocates nothing; the caller owns what the buffer holds
    between requests.

    >>> store, x = {}, torch.zeros(3)
    >>> kept(store, "out", (2, 3), x) is kept(store, "out", (2, 3), x), kept(store, "out", (4,), x).shape
    (True, torch.Size([4]))
    """
    shape = tuple(shape)
    k = (key, shape, like.dtype, like.device)
    buf = store.get(k)
    if buf is None:
        buf = store[k] = like.new_empty(shape)
    return buf


def flatten(tensors: Iterable[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' values, one after the other, as a flat detached vector.

    With ``out`` (a preallocated vector of the total size) the values are
    copied into it and it is returned; otherwise a new vector is made.
    """
    tensors = list(tensors)
    if out is None:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset:offset + n].copy_(t.detach().reshape(-1))
        offset += n
    if offset != out.numel():
        raise ValueError(f"flatten: the tensors hold {offset} values but out has {out.numel()}")
    return out


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` (a P-vector, or a stack (…, P)) in the given shapes, in order.

    A stack keeps its leading dimensions: an N×P stack gives N×shape views.
    """
    lead = flat.shape[:-1]
    views, offset = [], 0
    for s in shapes:
        n = math.prod(s)
        views.append(flat[..., offset:offset + n].view(*lead, *s))
        offset += n
    if offset != flat.shape[-1]:
        raise ValueError(f"unflatten: the shapes hold {offset} values but the vector has {flat.shape[-1]}")
    return views


class ParamLayout:
    """Where each named parameter of a model lives in the flat P-vector."""

    def __init__(self, module: nn.Module) -> None:
        self.names, self.shapes, self.offsets = [], [], []
        offset = 0
        for name, p in module.named_parameters():
            self.names.append(name)
            self.shapes.append(p.shape)
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """The module's parameters as one flat detached P-vector (a copy)."""
        return flatten(module.parameters())

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name → view of ``flat`` in that parameter's shape.

        ``flat`` is a P-vector, or a stack (…, P) of them: then each view has
        the leading dimensions too (an N×P stack gives N×shape views).
        """
        return dict(zip(self.names, unflatten(flat, self.shapes)))

    def load_into(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy a flat P-vector into the module's parameters."""
        with torch.no_grad():
            for p, v in zip(module.parameters(), self.views(flat).values()):
                p.copy_(v)
