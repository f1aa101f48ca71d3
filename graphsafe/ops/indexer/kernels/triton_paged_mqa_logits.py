"""Triton kernel of `fp8_paged_mqa_logits` (decode logits against the paged K cache).
Launched by `graphsafe/ops/indexer/triton.py`, configured (tiles, grid, pipelining) by
`graphsafe/ops/indexer/plan.py`.

Memory-bound: every key byte of every context is read once. A program owns a (request,
chunk of keys) pair; the grid is sized from shapes and the SM count only (CUDA-graph
safe), so programs whose chunk lies past the context just write `-inf`. The request's
queries `q[b]` (next_n x [H, D] fp8) are loaded once per program; each key tile
`[BLOCK_N, D]` is the A operand of an fp8 `tl.dot` against `q[b, i]^T` (`[D, H]`, both
K-major as Hopper's fp8 wgmma wants), so the reduction over heads runs along the
accumulator's N axis: a few in-thread adds and quad shuffles. With next_n > 1 each query
is its own dot over the same key tile in shared memory: stacking the queries into one
`[D, next_n*H]` operand would double the live accumulator (fewer CTAs per SM, the
kernel's real limit: latency hiding) and split the head reduction. The key tiles are
pipelined by Triton; the per-key scales are prefetched by hand one tile ahead (see the
kernel). `CLEAN=False` leaves the -inf columns past each context unwritten (for readers
of the valid range only). `FP8_DOT=False`: the fp8 bytes are decoded to fp16 in registers
(exact) for fp16 dots, on devices without fp8 e4m3fn matrix units.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import e4m3_bytes_to_f16

NEG_INF = tl.constexpr(float("-inf"))  # jit code reads only constexpr globals


@triton.jit
def _load_query(q_ptr, w_ptr, b, i, stride_qb, stride_qn, stride_qh, stride_wr, stride_wh, offs_d, offs_h,
                H: tl.constexpr, D: tl.constexpr, NEXT_N: tl.constexpr, FP8_DOT: tl.constexpr):
    """q[b, i]^T as a `[BLOCK_D, BLOCK_H]` dot operand (D contiguous: K-major) and w[b*next_n+i]."""
    ptrs = q_ptr + b * stride_qb + i * stride_qn + offs_h[None, :] * stride_qh + offs_d[:, None]
    q_t = tl.load(ptrs, mask=(offs_d < D)[:, None] & (offs_h < H)[None, :], other=0.0)
    if not FP8_DOT:  # bytes
        q_t = e4m3_bytes_to_f16(q_t)
    w = tl.load(w_ptr + (b * NEXT_N + i) * stride_wr + offs_h * stride_wh, mask=offs_h < H, other=0.0)
    return q_t, w


@triton.jit
def _row_logits(k, q_t, w, scale):
    """scale[n] * sum_h w[h] * relu(k[n] . q[h]) for a key tile: [BLOCK_N]."""
    s = tl.dot(k, q_t)
    # relu(NaN) = NaN, as the reference's clamp_min (tl.maximum drops NaN by default).
    return tl.sum(tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :], axis=1) * scale


@triton.jit
def _store_row(out_row, n, logits, visible, stop):
    tl.store(out_row + n, tl.where(visible, logits, NEG_INF), mask=n < stop)


@triton.jit
def _tile_blocks(bt_ptr, b, stride_bt, n, compute_stop, num_blocks, BS: tl.constexpr):
    """Cache block of each key position `n` of request b: -1 past the computed range
    and where the table's id is outside [0, num_blocks) (a padding block: no keys)."""
    blk = tl.load(bt_ptr + b * stride_bt + n // BS, mask=n < compute_stop, other=-1)
    return tl.where((blk >= 0) & (blk < num_blocks), blk, -1).to(tl.int64)


@triton.jit
def _tile_scales(scale_ptr, blk, n, stride_blk_f32, scale_base, BS: tl.constexpr):
    """Scales of a tile's keys (0.0 where `blk` is -1: nothing read)."""
    has = blk >= 0
    return tl.load(scale_ptr + tl.where(has, blk, 0) * stride_blk_f32 + scale_base + (n % BS), mask=has, other=0.0)


@triton.jit
def paged_mqa_logits_kernel(
    q_ptr, val_ptr, scale_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    stride_qb, stride_qn, stride_qh, stride_wr, stride_wh,
    stride_blk, stride_blk_f32, scale_base, stride_bt, stride_out, max_model_len, chunk, num_blocks,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NEXT_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_DOT: tl.constexpr, ROW_ALIGN: tl.constexpr, CLEAN: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.program_id(1) * chunk
    stop = tl.minimum(start + chunk, max_model_len)
    ctx = tl.load(ctx_ptr + b)
    # Keys [start, compute_stop) are read; the rest of the chunk is -inf for every row.
    compute_stop = tl.minimum(stop, tl.minimum(tl.maximum(ctx, 0), max_model_len))
    # Row i of this request sees keys n < ctx - next_n + i + 1.
    limit = ctx - NEXT_N + 1
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    out_row = out_ptr + (b * NEXT_N).to(tl.int64) * stride_out
    q0, w0 = _load_query(q_ptr, w_ptr, b, 0, stride_qb, stride_qn, stride_qh, stride_wr, stride_wh,
                         offs_d, offs_h, H, D, NEXT_N, FP8_DOT)
    q1, w1, q2, w2, q3, w3 = q0, w0, q0, w0, q0, w0  # unused unless NEXT_N says so
    if NEXT_N > 1:
        q1, w1 = _load_query(q_ptr, w_ptr, b, 1, stride_qb, stride_qn, stride_qh, stride_wr, stride_wh,
                             offs_d, offs_h, H, D, NEXT_N, FP8_DOT)
    if NEXT_N > 2:
        q2, w2 = _load_query(q_ptr, w_ptr, b, 2, stride_qb, stride_qn, stride_qh, stride_wr, stride_wh,
                             offs_d, offs_h, H, D, NEXT_N, FP8_DOT)
    if NEXT_N > 3:
        q3, w3 = _load_query(q_ptr, w_ptr, b, 3, stride_qb, stride_qn, stride_qh, stride_wr, stride_wh,
                             offs_d, offs_h, H, D, NEXT_N, FP8_DOT)
    d_in = offs_d < D
    # The key tiles are software-pipelined by Triton (async copies, num_stages), their
    # block ids included. The scales are not (their loads feed no dot): loaded in the
    # tile that uses them, their latency was exposed on top of the tiles' (on sm_90 the
    # scale is converted to the MMA layout before the dot, so the load is waited on at
    # once). So they are prefetched by hand in registers: block ids two tiles ahead,
    # scales one tile ahead, each load's address ready when it issues.
    n = start + offs_n
    sblk_nxt = _tile_blocks(bt_ptr, b, stride_bt, n + BLOCK_N, compute_stop, num_blocks, BS)
    scale = _tile_scales(scale_ptr, _tile_blocks(bt_ptr, b, stride_bt, n, compute_stop, num_blocks, BS), n,
                         stride_blk_f32, scale_base, BS)
    for n0 in range(start, compute_stop, BLOCK_N):
        n = n0 + offs_n
        sblk_far = _tile_blocks(bt_ptr, b, stride_bt, n + 2 * BLOCK_N, compute_stop, num_blocks, BS)
        scale_nxt = _tile_scales(scale_ptr, sblk_nxt, n + BLOCK_N, stride_blk_f32, scale_base, BS)
        blk = tl.load(bt_ptr + b * stride_bt + n // BS, mask=n < compute_stop, other=-1)
        # A block id outside [0, num_blocks) holds no keys: nothing is loaded from it
        # (the address uses block 0) and its positions are -inf for every row.
        has_key = (blk >= 0) & (blk < num_blocks)
        off = (n % BS).to(tl.int64)
        row = tl.multiple_of(tl.where(has_key, blk, 0).to(tl.int64) * stride_blk + off * D, ROW_ALIGN)
        k = tl.load(val_ptr + row[:, None] + offs_d[None, :], mask=has_key[:, None] & d_in[None, :], other=0.0)
        if not FP8_DOT:  # bytes
            k = e4m3_bytes_to_f16(k)
        _store_row(out_row, n, _row_logits(k, q0, w0, scale), has_key & (n < limit), stop)
        if NEXT_N > 1:
            _store_row(out_row + stride_out, n, _row_logits(k, q1, w1, scale), has_key & (n < limit + 1), stop)
        if NEXT_N > 2:
            _store_row(out_row + 2 * stride_out, n, _row_logits(k, q2, w2, scale), has_key & (n < limit + 2), stop)
        if NEXT_N > 3:
            _store_row(out_row + 3 * stride_out, n, _row_logits(k, q3, w3, scale), has_key & (n < limit + 3), stop)
        sblk_nxt = sblk_far
        scale = scale_nxt
    if CLEAN:
        # The whole [B*next_n, max_model_len] output is written: -inf past the context.
        tail = start + tl.cdiv(tl.maximum(compute_stop - start, 0), BLOCK_N) * BLOCK_N
        neg = tl.full([BLOCK_N], NEG_INF, tl.float32)
        for n0 in range(tail, stop, BLOCK_N):
            n = n0 + offs_n
            for i in tl.static_range(NEXT_N):
                tl.store(out_row + i * stride_out + n, neg, mask=n < stop)
