"""aiter/utility/dtypes.py: per-architecture fp8 type and the pybind dtype table.

`fp8` is evaluated at import (aiter: `get_dtype_fp8()` via rocminfo, dtypes.py:11-32):
float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950, torch.uint8 on an unknown arch.
`torch_to_aiter_pybind` (dtypes.py:51-98) accepts only the dtypes of its table, so only
aiter's own fp8 type passes: an e4m3fn tensor on gfx942 raises
`AssertionError("Unsupported dtype: torch.float8_e4m3fn")` before any kernel runs.
"""

import torch

from aiter.jit.utils.chip_info import get_gfx_runtime

_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}

fp8 = _FP8.get(get_gfx_runtime(), torch.uint8)
fp8_e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
u32, i32, i16, i8, u8, i64, u64 = torch.uint32, torch.int32, torch.int16, torch.int8, torch.uint8, torch.int64, torch.uint64

_PYBIND_DTYPES = {fp8, fp8_e8m0, fp16, bf16, fp32, u32, i32, i16, i8, u8, i64, u64}


def torch_to_aiter_pybind(t: torch.Tensor) -> torch.Tensor:
    """The check of aiter's zero-copy tensor conversion for `compile_ops(develop=True)`
    functions: dtype in the table, at most 8 dims. Returns `t` (no copy, as aiter)."""
    assert t.dim() <= 8
    assert t.dtype in _PYBIND_DTYPES, f"Unsupported dtype: {t.dtype}"
    return t


def check_pybind_call(fn_name: str, params: dict, types: dict) -> None:
    """aiter's `compile_ops` wrapper: the first call's arguments are type-checked
    (`check_args`, jit/core.py:1761-1931: a `str` parameter rejects None, an `int` one a
    tensor or a float), then every tensor goes through `torch_to_aiter_pybind`."""
    for name, value in params.items():
        want = types.get(name)
        if want is not None and not (isinstance(value, want) and not (want is int and isinstance(value, bool))):
            raise TypeError(f"{fn_name}: {name} needs to be {want} but got {type(value)}")
        if isinstance(value, torch.Tensor):
            torch_to_aiter_pybind(value)
