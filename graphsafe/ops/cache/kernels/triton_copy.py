"""The Triton kernels of the plain and fp8 paged-cache writes: `_concat_and_cache_mla_kernel`
(latent + rope into the MLA cache) and `_reshape_and_cache_kernel` (keys and values into
the paged K/V caches, all heads of a token a program). Chosen and bound by the Triton
backend (`plan.choose_*`, `triton.prepare_*`).

One program per token, masked on padding slots: a token whose slot lies outside
`[0, num_blocks * block_size)` loads nothing and stores nothing (its slot is replaced by 0
before the address computation, so even its masked lanes compute addresses inside the
cache).

fp8 caches (QUANT): the quotient `x / scale` (IEEE division, `div_rn`) is rounded to
e4m3fn in the kernel, on the float32 bits (`e4m3_byte`), and the byte is stored through a
uint8 view of the cache. Triton's `.to(tl.float8e4nv)` is not used: the CPU interpreter
rounds it wrongly near exponent boundaries, and the explicit rounding gives the same
bytes as torch's `.to(torch.float8_e4m3fn)` on every target.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import e4m3_byte


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
