"""aiter/jit/utils/chip_info.py: the architecture (stand-in: from AITER_STANDIN_ARCH)."""

import os

# Compute units of the parts the stand-in models: MI300X (gfx942) and MI355X (gfx950).
_CU_NUM = {"gfx942": 304, "gfx950": 256}


def get_gfx_runtime() -> str:
    """aiter runs rocminfo; the stand-in reads AITER_STANDIN_ARCH."""
    return os.environ.get("AITER_STANDIN_ARCH", "gfx942")


def get_gfx() -> str:
    """aiter: GPU_ARCHS, else rocminfo (`get_gfx_custom_op_core`)."""
    return get_gfx_runtime()


def get_cu_num() -> int:
    return _CU_NUM.get(get_gfx_runtime(), 304)
