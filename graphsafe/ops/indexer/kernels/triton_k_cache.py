"""Triton kernels of the indexer K cache (`graphsafe.formats.indexer_k`): the quantising
write (`indexer_k_quant_and_cache`) and the gather into contiguous rows
(`cp_gather_indexer_k_quant_cache`). Launched by `graphsafe/ops/indexer/triton.py`.

Quantisation matches the reference bit for bit: IEEE division (`div_rn`), the UE8M0
round-up done on the exponent bits, fp32 -> e4m3 rounding done exactly in fp32
(`round_to_e4m3`; Triton's CPU interpreter rounds some values wrongly otherwise) and the
byte assembled with integer ops (`e4m3_bits`), so no fp8 type is needed. The gather moves
bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import e4m3_bits, round_to_e4m3


@triton.jit
def _round_up_pow2(s):
    """2^ceil(log2 s) for positive normal float32 s (UE8M0 scales), from the bits."""
    bits = s.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


# -- indexer_k_quant_and_cache -----------------------------------------------------------
@triton.jit
def quant_and_cache_kernel(
    k_ptr, val_ptr, scale_ptr, slot_ptr,
    num_tokens, num_slots, block_size, stride_k, stride_blk, stride_blk_f32, scale_base,
    D: tl.constexpr, G: tl.constexpr, QB: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, UE8M0: tl.constexpr,
):
    """Program (token tile, group g): quantise group g of BLOCK_T tokens."""
    g = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    ok = (offs_t < num_tokens) & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    offs_q = tl.arange(0, BLOCK_Q)
    col = g * QB + offs_q
    mask = ok[:, None] & (offs_q < QB)[None, :]
    x = tl.load(k_ptr + offs_t.to(tl.int64)[:, None] * stride_k + col[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    if UE8M0:
        s = _round_up_pow2(s)
    # tl.max drops NaNs (on the GPU too): a group with a NaN gets the canonical NaN scale
    # explicitly, as the reference's amax does (indexer_k.quantize defines the NaN bits).
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    s = tl.where(has_nan, tl.full(s.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), s)
    y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    # NaN / x, x / NaN and inf / inf are NaN: byte 0x7F whatever the NaN's sign (the
    # rounding helpers below are exact for finite values only).
    y_nan = y != y
    y = e4m3_bits(round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0)))
    y = tl.where(y_nan, 0x7F, y).to(tl.uint8)
    tl.store(val_ptr + (blk * stride_blk + off * D)[:, None] + col[None, :], y, mask=mask)
    tl.store(scale_ptr + blk * stride_blk_f32 + scale_base + off * G + g, s, mask=ok)


# -- cp_gather_indexer_k_quant_cache -----------------------------------------------------
# n_iter is not specialised: at 1 (a batch of one request) Triton unrolls the search loop
# and Triton 3.6's layout pass then fails on the masks below ("arith.select ... expected
# condition type to have the same shape"; found by the demo at B=1 on an H200).
@triton.jit(do_not_specialize=["n_iter"])
def gather_kernel(
    val_ptr, scale_ptr, dst_k_ptr, dst_s_ptr, bt_ptr, cu_ptr,
    num_rows, num_reqs, num_blocks, max_blocks, block_size,
    stride_blk, stride_blk_f32, scale_base, stride_bt, stride_dk, stride_ds, n_iter,
    D: tl.constexpr, G: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """Program: BLOCK_R destination rows. Row r belongs to the request b with
    cu[b] <= r < cu[b+1], found by a branch-free binary search over cu."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_in = rows < num_rows
    lo = tl.zeros([BLOCK_R], tl.int32)
    hi = tl.zeros([BLOCK_R], tl.int32) + num_reqs
    for _ in range(n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(cu_ptr + mid + 1, mask=r_in & active, other=0)
        right = end <= rows
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    owned = r_in & (lo < num_reqs)
    start = tl.load(cu_ptr + lo, mask=owned, other=0)
    t = rows - start
    # The search guarantees rows < cu[lo + 1]; rows below cu[lo] (a decreasing
    # cu_seq_lens) belong to no request and stay untouched.
    owned = owned & (t >= 0)
    t = tl.where(owned, t, 0)
    logical = t // block_size
    valid = owned & (logical < max_blocks)
    blk = tl.load(bt_ptr + lo.to(tl.int64) * stride_bt + logical, mask=valid, other=0)
    # A block id outside [0, num_blocks) (padding -1) gives a zero row: the masked loads
    # below return 0 bytes and a +0.0 scale, stored for every owned row.
    valid = valid & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(valid, blk, 0).to(tl.int64)
    off = tl.where(valid, t % block_size, 0).to(tl.int64)
    src = tl.multiple_of(blk * stride_blk + off * D, ROW_ALIGN)
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = (offs_d < D)[None, :]
    x = tl.load(val_ptr + src[:, None] + offs_d[None, :], mask=valid[:, None] & d_in, other=0)
    tl.store(dst_k_ptr + rows64[:, None] * stride_dk + offs_d[None, :], x, mask=owned[:, None] & d_in)
    offs_g = tl.arange(0, BLOCK_G)
    g_in = (offs_g < G)[None, :]
    sc = tl.load(scale_ptr + (blk * stride_blk_f32 + scale_base + off * G)[:, None] + offs_g[None, :],
                 mask=valid[:, None] & g_in, other=0.0)
    tl.store(dst_s_ptr + rows64[:, None] * stride_ds + offs_g[None, :], sc, mask=owned[:, None] & g_in)
