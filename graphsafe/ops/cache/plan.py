"""The cache writes' decision, made once per call signature: `choose_concat_and_cache_mla(call)`
and `choose_reshape_and_cache(call)` -> `WriteChoice`: which Triton kernel writes (none
for no token, the copy of kernels/triton_copy.py, or the fp8_ds_mla record writer of
kernels/triton_ds_mla.py), whether values are stored as e4m3 bytes, and the kernel's
block sizes. The cache's kind is read from the formats (`fp8_ds_mla.holds_records`) and
the checks (`FP8_DTYPES`: the caches that need a scale), not re-derived here.

Pure Python, no triton import. The writes take no scratch (no workspace).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphsafe.checks import FP8_DTYPES
from graphsafe.formats import fp8_ds_mla


@dataclass(frozen=True)
class WriteChoice:
    """What the Triton backend launches for one call signature.

    `kernel`: "none" (nothing to write), "copy" (values as they are, or as e4m3 bytes when
    `quant`) or "records" (fp8_ds_mla records); `blocks`: the kernel's block constexprs."""

    kernel: str
    quant: bool = False
    blocks: tuple[tuple[str, int], ...] = ()


NONE = WriteChoice("none")


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` (0 for 0), without importing triton."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _block(n: int, cap: int = 1024) -> int:
    return min(next_power_of_2(max(n, 1)), cap)


def choose_concat_and_cache_mla(call) -> WriteChoice:
    t, r = call.kv_c.shape
    p = call.k_pe.shape[1]
    if t == 0:
        return NONE
    if fp8_ds_mla.holds_records(call.kv_cache):
        # One program a token (a record is 656 bytes for DeepSeek); rope bytes in one block.
        return WriteChoice("records", blocks=(("BLOCK_ROPE", next_power_of_2(max(2 * p, 1))),))
    quant = call.kv_cache.dtype in FP8_DTYPES
    return WriteChoice("copy", quant, (("BLOCK_R", _block(r)), ("BLOCK_P", _block(p))))


def choose_reshape_and_cache(call) -> WriteChoice:
    t, hk, d = call.key.shape
    dv = call.value.shape[2]
    if t == 0 or hk == 0:
        return NONE
    quant = call.key_cache.dtype in FP8_DTYPES
    block_d, block_dv = next_power_of_2(d), next_power_of_2(dv)
    # Keep a tile at <= 4096 elements: the head loop covers the rest.
    block_h = max(1, min(next_power_of_2(hk), 4096 // max(block_d, block_dv)))
    return WriteChoice("copy", quant, (("BLOCK_H", block_h), ("BLOCK_D", block_d), ("BLOCK_DV", block_dv)))
