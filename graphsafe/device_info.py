"""Cached facts about devices that host-side planning needs (never read per call from the driver)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def num_sms(device: torch.device | str) -> int:
    """Multiprocessors (CUs on ROCm) of a CUDA/HIP device; the CPU count for the CPU.

    Split-KV planning uses this with shapes only, never with sequence-length values, so a
    choice frozen into a CUDA graph at capture time stays right for every replay.
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).multi_processor_count
    return os.cpu_count() or 1


@functools.cache
def compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


@functools.cache
def has_fp8_matrix_units(device: torch.device | str) -> bool:
    """sm89+ on NVIDIA, gfx942+ (MI300) on ROCm."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return any(arch.startswith(a) for a in ("gfx942", "gfx950", "gfx12"))
    cc = compute_capability(device)
    return cc is not None and cc >= (8, 9)
