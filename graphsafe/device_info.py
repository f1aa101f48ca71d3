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


def is_hip(device: torch.device | str) -> bool:
    """Whether `device` is an AMD GPU: a CUDA device of a ROCm build of torch (HIP)."""
    return torch.device(device).type == "cuda" and getattr(torch.version, "hip", None) is not None


@functools.cache
def compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """What torch reports as the device's capability, None off CUDA/HIP. On ROCm this is
    not an NVIDIA architecture: gfx942 (MI300) reports (9, 4) and gfx950 (MI350) (9, 5),
    so a test for Hopper must also ask `is_hip` (`is_sm90`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


def is_sm90(device: torch.device | str) -> bool:
    """Whether `device` is an NVIDIA sm_90 GPU (H100 / H200: wgmma, TMA), never a ROCm one."""
    return not is_hip(device) and compute_capability(device) == (9, 0)


@functools.cache
def rocm_arch(device: torch.device | str) -> str | None:
    """The AMD GPU architecture of a HIP device ("gfx942", "gfx950", ...), None elsewhere.

    From HIP's `gcnArchName` (e.g. "gfx942:sramecc+:xnack-"), the property aiter's C++
    dispatchers read; no subprocess (aiter's Python side runs rocminfo, which agrees on a
    machine of one GPU model)."""
    device = torch.device(device)
    if not is_hip(device):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
    return name.split(":")[0] or None


@functools.cache
def has_fp8_matrix_units(device: torch.device | str) -> bool:
    """sm89+ on NVIDIA, gfx942+ (MI300) on ROCm."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if is_hip(device):
        return (rocm_arch(device) or "").startswith(("gfx942", "gfx950", "gfx12"))
    cc = compute_capability(device)
    return cc is not None and cc >= (8, 9)


@functools.cache
def has_ocp_e4m3(device: torch.device | str) -> bool:
    """Whether the device converts OCP e4m3fn (Triton's float8e4nv) in hardware: sm89+ on
    NVIDIA, gfx950 / gfx12 on ROCm (MI300's units are e4m3fnuz only); never the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if is_hip(device):
        return (rocm_arch(device) or "").startswith(("gfx950", "gfx12"))
    cc = compute_capability(device)
    return cc is not None and cc >= (8, 9)


# LDS per workgroup of the AMD architectures graphsafe plans for, where Triton's driver
# cannot be asked: MI300X / MI325X (CDNA3) 64 KiB, MI350X / MI355X (CDNA4) 160 KiB.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "gfx90a": 64 * 1024}


@functools.cache
def max_shared_memory(device: torch.device) -> int | None:
    """Opt-in shared memory per block of a CUDA/HIP device (LDS per workgroup on AMD: 64 KiB
    on gfx942, 160 KiB on gfx950), from Triton's driver query; on ROCm, where the driver
    cannot be asked, from `LDS_BYTES` by architecture; else None (the plans then assume
    their GPU's; `graphsafe.ops.*.plan` choose their kernels' configs from this value)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no driver: the architecture's LDS on ROCm, else unknown
        return LDS_BYTES.get(rocm_arch(device) or "") if is_hip(device) else None


def config_shared_memory(device: torch.device | str) -> int | None:
    """The shared memory the plans fit their Triton configs to, up front (never by failing a
    launch): on ROCm the LDS per workgroup (`max_shared_memory`: 64 KiB on gfx942, 160 KiB
    on gfx950), where the capability torch reports ((9, 4), (9, 5)) says nothing about it.
    None on NVIDIA, whose configs are sized and measured per capability for its GPUs'
    shared memory (and compiled for sm_90 by the tests), and off GPUs."""
    return max_shared_memory(torch.device(device)) if is_hip(device) else None


def lds_direct_loads(device: torch.device | str) -> bool:
    """Whether Triton's AMD backend loads global memory straight into LDS on this device
    (CDNA4, gfx950: `buffer_load_to_local`, async copies). It then pipelines with more LDS
    buffers and stages an attention kernel's p tile in LDS (measured with Triton 3.9: the
    varlen kernel at D 128 takes 116 KiB for 3 stages on gfx950, 80 KiB on gfx942); the
    plans' LDS bounds read this."""
    return is_hip(device) and (rocm_arch(device) or "").startswith("gfx950")

