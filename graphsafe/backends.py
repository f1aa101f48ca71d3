"""Which backends can run here: cached availability probes and the preference order.

`reference` runs anywhere. `triton` runs on CUDA/HIP devices, and on the CPU only through
Triton's interpreter (TRITON_INTERPRET=1, tests at small shapes): automatic selection
never picks it for the CPU, `use_backend("triton")` may. `aiter` runs on ROCm builds of
torch where `import aiter` succeeds; any exception from that import (aiter raises
RuntimeError without ROCm) means "unavailable", never a crash.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

BACKENDS = ("aiter", "triton", "reference")

# Automatic preference per device type, best first.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("aiter", "triton", "reference"),
    "cpu": ("reference",),
}


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def backend_available(backend: str, device_type: str) -> bool:
    """True when `backend` can run kernels for tensors on `device_type` in this process."""
    if backend == "reference":
        return True
    if backend == "triton":
        if device_type == "cuda":
            return torch.cuda.is_available() and _importable("triton")
        if device_type == "cpu":
            return triton_interpreter_enabled() and _importable("triton")
        return False
    if backend == "aiter":
        return device_type == "cuda" and is_rocm() and torch.cuda.is_available() and _importable("aiter")
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def device_types_here() -> list[str]:
    """Device types with a usable device in this process, CPU first."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def unavailable_reason(backend: str, device_type: str) -> str:
    """Why `backend` cannot run on `device_type` here ("" where it can)."""
    if backend_available(backend, device_type):
        return ""
    if backend == "triton":
        if device_type == "cpu":
            return "runs on the CPU only through Triton's interpreter (TRITON_INTERPRET=1, tests)"
        if not _importable("triton"):
            return "triton is not installed"
        return f"no {device_type} device here"
    if backend == "aiter":
        if device_type != "cuda":
            return f"runs on ROCm GPUs only, not on {device_type}"
        if not is_rocm():
            return "needs a ROCm build of torch"
        if not torch.cuda.is_available():
            return "no ROCm device here"
        return "aiter is not importable"
    return f"cannot run on {device_type}"
