"""Data augmentation: :func:`random_crop_flip`, the standard CIFAR crop-and-flip."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["random_crop_flip"]


def random_crop_flip(x: Tensor, generator: torch.Generator, padding: int = 4, *,
                     flip_p: float = 0.5) -> Tensor:
    """Standard CIFAR augmentation of a batch ``x`` of shape (N, C, H, W).

    Each image is zero-padded by ``padding`` on every side, cropped back to
    H×W at a random offset (i, j), 0 ≤ i, j ≤ 2·padding, and flipped left-right
    with probability ``flip_p``. Randomness comes only from ``generator``,
    drawn in this order: ``i = randint(0, 2p+1, (N,))``, ``j`` likewise, then
    ``u = rand(N)``, flipping where u < flip_p. One gather, no per-sample loop.

    The inputs are normally already normalised, so the zero border is the
    data set's mean colour (torchvision pads the raw image with black).

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    >>> random_crop_flip(x, g, padding=1).shape
    torch.Size([2, 3, 4, 4])
    >>> torch.equal(random_crop_flip(x, g, padding=0, flip_p=1.0), x.flip(-1))
    True
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"random_crop_flip needs a batch of shape (N, C, H, W), got {shape}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an integer ≥ 0, got {padding!r}")
    if not 0.0 <= flip_p <= 1.0:
        raise ValueError(f"flip_p must be in [0, 1], got {flip_p!r}")
    n, _, h, w = x.shape
    dev = generator.device
    i = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    j = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=dev).to(x.device)
    flip = (torch.rand(n, generator=generator, device=dev) < flip_p).to(x.device)
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding)) if padding else x
    rows = i[:, None] + torch.arange(h, device=x.device)                  # (N, H)
    cols = j[:, None] + torch.arange(w, device=x.device)                  # (N, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)                 # flip = read columns backwards
    return padded[torch.arange(n, device=x.device)[:, None, None, None],
                  torch.arange(x.shape[1], device=x.device)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
