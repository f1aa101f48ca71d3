"""The Triton kernel of the fp8_ds_mla cache write (`_concat_and_cache_ds_mla_kernel`: uint8
records, graphsafe.formats.fp8_ds_mla). Chosen and bound by the Triton backend
(`plan.choose_concat_and_cache_mla`, `triton.prepare_concat_and_cache_mla`).

One program per token, masked on padding slots as the copies are (triton_copy.py).
`_ds_mla_record` writes a token's record byte for byte as `quantize_records` does, with
the same float32 operations (an amax over each 128-value tile, IEEE divisions by
`div_rn`, e4m3 rounding by `e4m3_byte`, bfloat16 rounding on the bits), so the bytes
equal the reference's on the same device. Every byte is stored through the uint8 cache:
no alignment is assumed of the records (block and token strides are free).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import FP8_MAX, bf16_rounded_bits, e4m3_byte

# float32 bits: +inf (every NaN's bits, sign cleared, are above) and the NaN torch's amax gives.
F32_INF_BITS = tl.constexpr(0x7F800000)
F32_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _tile_scale(x):
    """The float32 scale of a 128-value tile (`fp8_ds_mla.tile_scales`): amax / 448 by
    IEEE division, 1 where that is 0 (amax 0, or so small the quotient underflows), NaN
    (from 0x7FC00000) where the tile has a NaN."""
    # The amax on the bits of |x|: for floats of sign 0 the integer order is the float
    # order, with +inf above every finite value and every NaN above +inf. So the max
    # cannot drop a NaN (a float max may, depending on the target).
    amax_bits = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0)
    amax_bits = tl.where(amax_bits > F32_INF_BITS, F32_NAN_BITS, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, FP8_MAX)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _bf16_bits(x):
    """The bfloat16 bits (low 16 bits of an int32) of float32 `x`, rounded to nearest even
    (overflow to +-inf, subnormals kept), as torch's `.to(torch.bfloat16)`; NaN -> 0x7FFF
    (CUDA's cvt.rn.bf16.f32 NaN). On the bits: the interpreter truncates `.to(tl.bfloat16)`."""
    return tl.where(x != x, 0x7FFF, (bf16_rounded_bits(x) >> 16) & 0xFFFF)


@triton.jit
def _as_f32(x):
    """`x` (bf16/fp16/fp32) as float32, exactly. bfloat16 through the bits (the upper half
    of a float32): the interpreter's conversion loses bf16 subnormals."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _ds_mla_record(
    kv_c_ptr, k_pe_ptr, dst_ptr, enabled,
    R: tl.constexpr, P: tl.constexpr, TILE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
):
    """Write one token's fp8_ds_mla record at `dst_ptr` (uint8): R e4m3 bytes, R / TILE
    float32 scales, P bfloat16 rope values; nothing (and nothing read) if not enabled."""
    cols = tl.arange(0, TILE)
    byte_of_word = tl.arange(0, 4)
    tile_live = tl.where(enabled, TILE, 0)
    for tile in tl.range(0, R // TILE):
        x = _as_f32(tl.load(kv_c_ptr + tile * TILE + cols, mask=cols < tile_live, other=0.0))
        scale = _tile_scale(x)
        # div_rn: IEEE division, bit-identical to the reference's x / scale.
        tl.store(dst_ptr + tile * TILE + cols, e4m3_byte(tl.math.div_rn(x, scale)), mask=cols < tile_live)
        scale_bits = scale.to(tl.int32, bitcast=True)
        tl.store(dst_ptr + R + 4 * tile + byte_of_word, ((scale_bits >> (8 * byte_of_word)) & 0xFF).to(tl.uint8),
                 mask=byte_of_word < tl.where(enabled, 4, 0))
    # Rope: byte k is the low (k even) or high byte of value k // 2, little-endian.
    k = tl.arange(0, BLOCK_ROPE)
    mask = k < tl.where(enabled, 2 * P, 0)
    x = tl.load(k_pe_ptr + k // 2, mask=mask, other=0.0)
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)  # as it is: torch's .to() is a no-op
    else:
        bits = _bf16_bits(x.to(tl.float32))
    tl.store(dst_ptr + R + 4 * (R // TILE) + k, ((bits >> (8 * (k % 2))) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _concat_and_cache_ds_mla_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr,
    num_slots, block_size,
    stride_kv_c, stride_k_pe, stride_block, stride_token,
    R: tl.constexpr, P: tl.constexpr, TILE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_slots)
    slot = tl.where(enabled, slot, 0)
    dst = cache_ptr + (slot // block_size) * stride_block + (slot % block_size) * stride_token
    _ds_mla_record(kv_c_ptr + token * stride_kv_c, k_pe_ptr + token * stride_k_pe, dst, enabled,
                   R, P, TILE, BLOCK_ROPE)
