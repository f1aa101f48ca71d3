"""Triton backend of the paged-cache writes: one program per token, masked on padding slots.

A token whose slot lies outside `[0, num_blocks * block_size)` loads nothing and stores
nothing (its slot is replaced by 0 before the address computation, so even its masked
lanes compute addresses inside the cache).

fp8 caches: the quotient `x / scale` (IEEE division, `div_rn`) is rounded to e4m3fn in
the kernel, on the float32 bits (`round_to_e4m3`, `e4m3_byte`), and the byte is stored
through a uint8 view of the cache. Triton's `.to(tl.float8e4nv)` is not used: the CPU
interpreter rounds it wrongly near exponent boundaries, and the explicit rounding gives
the same bytes as torch's `.to(torch.float8_e4m3fn)` on every target.

fp8_ds_mla caches (uint8 records, graphsafe.formats.fp8_ds_mla): `_ds_mla_record` writes a
token's record byte for byte as `quantize_records` does, with the same float32 operations
(an amax over each 128-value tile, IEEE divisions by `div_rn`, e4m3 rounding by
`e4m3_byte`, bfloat16 rounding on the bits), so the bytes equal the reference's on the
same device. Every byte is stored through the uint8 cache: no alignment is assumed of the
records (block and token strides are free).

`prepare_*` bind the kernel to a call signature once (`graphsafe.launch.bind`); the
runners they return launch it with the tensors alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.launch import bind
from graphsafe.formats import fp8_ds_mla as ds_mla
from graphsafe.kernels.fp8_bits import FP8_MAX, bf16_rounded_bits, e4m3_byte

# float32 bits: +inf (every NaN's bits, sign cleared, are above) and the NaN torch's amax gives.
F32_INF_BITS = tl.constexpr(0x7F800000)
F32_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _convert(x, scale_ptr, dst_ptr, QUANT: tl.constexpr):
    """x as stored in the cache: the e4m3fn byte of x / scale when QUANT (dst_ptr is then
    the uint8 view of the cache), else x in the cache's dtype."""
    if QUANT:
        # div_rn: IEEE division, bit-identical to the reference's x / scale.
        return e4m3_byte(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)))
    else:
        return x.to(dst_ptr.dtype.element_ty)


@triton.jit
def _store_row(
    src_ptr, dst_ptr, n, scale_ptr,
    BLOCK: tl.constexpr, QUANT: tl.constexpr, enabled,
):
    """Copy n contiguous elements src -> dst (quantising to fp8 when QUANT); none if not enabled."""
    n_live = tl.where(enabled, n, 0)
    for start in tl.range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_live
        x = tl.load(src_ptr + cols, mask=mask, other=0.0)
        tl.store(dst_ptr + cols, _convert(x, scale_ptr, dst_ptr, QUANT), mask=mask)


@triton.jit
def _concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr,
    num_slots, block_size,
    stride_kv_c, stride_k_pe, stride_block, stride_token,
    R: tl.constexpr, P: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_slots)
    slot = tl.where(enabled, slot, 0)
    dst = cache_ptr + (slot // block_size) * stride_block + (slot % block_size) * stride_token
    _store_row(kv_c_ptr + token * stride_kv_c, dst, R, scale_ptr, BLOCK_R, QUANT, enabled)
    _store_row(k_pe_ptr + token * stride_k_pe, dst + R, P, scale_ptr, BLOCK_P, QUANT, enabled)


def _block(n: int, cap: int = 1024) -> int:
    return min(triton.next_power_of_2(max(n, 1)), cap)


def _nothing(*args, **kwargs) -> None:
    return None


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The uint8 view of an fp8 cache (same strides): the kernel stores the e4m3fn bytes."""
    return cache.view(torch.uint8)


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


def _prepare_ds_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """The fp8_ds_mla write: one program per token (a record is 656 bytes for DeepSeek)."""
    t, r = kv_c.shape
    p = k_pe.shape[1]
    nb, bs = kv_cache.shape[:2]
    launch = bind(
        _concat_and_cache_ds_mla_kernel, (t,),
        kv_c, k_pe, kv_cache, slot_mapping,
        nb * bs, bs,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=r, P=p, TILE=ds_mla.TILE, BLOCK_ROPE=triton.next_power_of_2(max(2 * p, 1)),
    )

    def run(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
        launch(kv_c, k_pe, kv_cache, slot_mapping)

    return run


def prepare_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None):
    t, r = kv_c.shape
    p = k_pe.shape[1]
    if t == 0:
        return _nothing
    if kv_cache.dtype == torch.uint8:
        return _prepare_ds_mla(kv_c, k_pe, kv_cache, slot_mapping)
    quant = kv_cache.dtype == torch.float8_e4m3fn
    nb, bs = kv_cache.shape[:2]
    launch = bind(
        _concat_and_cache_mla_kernel, (t,),
        kv_c, k_pe, kv_cache, slot_mapping, scale if quant else kv_c,
        nb * bs, bs,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=r, P=p, BLOCK_R=_block(r), BLOCK_P=_block(p), QUANT=quant,
    )

    def run(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
        launch(kv_c, k_pe, _bytes(kv_cache) if quant else kv_cache, slot_mapping, scale if quant else kv_c)

    return run


@triton.jit
def _store_heads(
    src_ptr, stride_src_head, dst_ptr, stride_dst_head, num_heads, scale_ptr, enabled,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
):
    """Copy a [num_heads, D] tile (rows strided, D contiguous); nothing if not enabled."""
    heads_live = tl.where(enabled, num_heads, 0)
    cols = tl.arange(0, BLOCK_D)
    for h0 in tl.range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < heads_live) & (cols[None, :] < D)
        x = tl.load(src_ptr + heads[:, None] * stride_src_head + cols[None, :], mask=mask, other=0.0)
        tl.store(dst_ptr + heads[:, None] * stride_dst_head + cols[None, :], _convert(x, scale_ptr, dst_ptr, QUANT),
                 mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_slots, block_size, num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
):
    # One program per token, all heads: ~2 KiB per tensor per program at Hk=8, D=128
    # (a program per (token, head) moved too few bytes to reach the bandwidth).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_slots)
    slot = tl.where(enabled, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    _store_heads(
        key_ptr + token * stride_kt, stride_kh,
        k_cache_ptr + blk * stride_kc_block + off * stride_kc_token, stride_kc_head,
        num_heads, k_scale_ptr, enabled, D, BLOCK_H, BLOCK_D, QUANT,
    )
    _store_heads(
        value_ptr + token * stride_vt, stride_vh,
        v_cache_ptr + blk * stride_vc_block + off * stride_vc_token, stride_vc_head,
        num_heads, v_scale_ptr, enabled, DV, BLOCK_H, BLOCK_DV, QUANT,
    )


def prepare_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    t, hk, d = key.shape
    dv = value.shape[2]
    if t == 0 or hk == 0:
        return _nothing
    quant = key_cache.dtype == torch.float8_e4m3fn
    nb, bs = key_cache.shape[:2]
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    # Keep a tile at <= 4096 elements: the head loop covers the rest.
    block_h = max(1, min(triton.next_power_of_2(hk), 4096 // max(block_d, block_dv)))
    launch = bind(
        _reshape_and_cache_kernel, (t,),
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if quant else key, v_scale if quant else value,
        nb * bs, bs, hk,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        D=d, DV=dv, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv, QUANT=quant,
    )

    def run(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if quant:
            launch(key, value, _bytes(key_cache), _bytes(value_cache), slot_mapping, k_scale, v_scale)
        else:
            launch(key, value, key_cache, value_cache, slot_mapping, key, value)

    return run
