"""Random tensor builders for test cases: always on a seeded CPU generator, then moved.

Drawing on the CPU keeps a case's inputs identical across devices for the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def randint(low: int, high: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high, tuple(shape), generator=gen, dtype=torch.int64).to(dtype).to(device)


def poison(shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random bytes of any dtype (finite for floats): the content of an output before an op writes it."""
    if dtype.is_floating_point:
        return randn(shape, dtype, device, gen, scale=3.0)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return randint(low, high, shape, dtype, device, gen)


def distinct_slots(num: int, num_slots: int, gen: torch.Generator, pad_fraction: float = 0.25) -> torch.Tensor:
    """`num` distinct cache slots in `[0, num_slots)`, about `pad_fraction` of them -1 (padding)."""
    if num > num_slots:
        raise ValueError(f"cannot draw {num} distinct slots from {num_slots}")
    slots = torch.randperm(num_slots, generator=gen)[:num]
    pad = torch.rand(num, generator=gen) < pad_fraction
    return torch.where(pad, torch.full_like(slots, -1), slots)
