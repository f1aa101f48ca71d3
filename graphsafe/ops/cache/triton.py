"""Triton backend of the paged-cache writes: one program per token, masked on padding slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


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
        x = tl.load(src_ptr + cols, mask=mask)
        if QUANT:
            # div_rn: IEEE division, bit-identical to the reference's x / scale.
            x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -FP8_MAX, FP8_MAX)
        tl.store(dst_ptr + cols, x.to(dst_ptr.dtype.element_ty), mask=mask)


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


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    t, r = kv_c.shape
    p = k_pe.shape[1]
    if t == 0:
        return
    quant = kv_cache.dtype == torch.float8_e4m3fn
    nb, bs = kv_cache.shape[:2]
    _concat_and_cache_mla_kernel[(t,)](
        kv_c, k_pe, kv_cache, slot_mapping, scale if quant else kv_c,
        nb * bs, bs,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=r, P=p, BLOCK_R=_block(r), BLOCK_P=_block(p), QUANT=quant,
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_slots, block_size, num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_slots)
    slot = tl.where(enabled, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    _store_row(
        key_ptr + token * stride_kt + head * stride_kh,
        k_cache_ptr + blk * stride_kc_block + off * stride_kc_token + head * stride_kc_head,
        D, k_scale_ptr, BLOCK_D, QUANT, enabled,
    )
    _store_row(
        value_ptr + token * stride_vt + head * stride_vh,
        v_cache_ptr + blk * stride_vc_block + off * stride_vc_token + head * stride_vc_head,
        DV, v_scale_ptr, BLOCK_DV, QUANT, enabled,
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    t, hk, d = key.shape
    dv = value.shape[2]
    if t == 0 or hk == 0:
        return
    quant = key_cache.dtype == torch.float8_e4m3fn
    nb, bs = key_cache.shape[:2]
    _reshape_and_cache_kernel[(t, hk)](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if quant else key, v_scale if quant else value,
        nb * bs, bs, hk,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        D=d, DV=dv, BLOCK_D=_block(d), BLOCK_DV=_block(dv), QUANT=quant,
    )
