"""Host staging for host-to-device copies that never synchronise.

A `non_blocking` copy from pageable memory may make the driver wait for the stream, and a
reused pinned buffer could be overwritten by the next build while its copy is still
queued. Each build therefore takes a fresh pinned block from torch's caching host
allocator: a non-blocking copy records an event on the block, and the allocator hands the
block out again only after that event has completed. No event sync, no race.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16


def _torch_dtype(a: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.ascontiguousarray(a[:0])).dtype


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for a in arrays:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += a.nbytes
    return offsets, max(total, 1)


def _carve(buf: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> list[torch.Tensor]:
    return [buf[o : o + a.nbytes].view(_torch_dtype(a)).view(a.shape) for a, o in zip(arrays, offsets)]


def stage(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host tensors holding `arrays`, carved from one allocation that is pinned when
    `device` is a GPU; copy each to the device with `non_blocking=True`."""
    offsets, total = _layout(arrays)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = _carve(buf, arrays, offsets)
    for t, a in zip(out, arrays):
        t.numpy()[...] = a
    return out


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Fresh device tensors equal to `arrays`: one staging buffer, one host-to-device copy
    (non-blocking), views carved from one device allocation."""
    offsets, total = _layout(arrays)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, a in zip(_carve(host, arrays, offsets), arrays):
        t.numpy()[...] = a
    if device.type == "cpu":
        return _carve(host, arrays, offsets)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    return _carve(dev, arrays, offsets)
