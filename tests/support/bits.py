"""Bit-level helpers of the kernel tests: compare tensors by their bits, fill them with
every bit pattern."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN payloads compare equal, -0.0 differs from 0.0)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def randomize(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` with random bit patterns (NaNs included), so only bit equality passes."""
    b = bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, b.shape, generator=gen, dtype=torch.int64))
    return t
