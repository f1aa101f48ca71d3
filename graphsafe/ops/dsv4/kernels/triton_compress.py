"""The Triton kernels of `dsv4_compress_kv`: the compressor's partial-state save and its
gated pooling -> RMSNorm -> RoPE -> cache write.

`save_state_kernel`, one program per token: the state row `[kv | score + ape[pos % ratio]]`
(float32) at the token's state slot. `compress_kernel`, one program per token, after it (a
window's states may come from other tokens of the same call): a token that completes a
window gathers the window's `coff * ratio` states through its request's state block table,
pools each channel by the softmax of its scores, RMS-normalises (weight, IEEE sqrt and
division), rotates the last 64 values (GPT-J pairs, at the window's first position) and
writes the entry: an fp8_dsv4 record (`store_tile` / `store_bf16_bytes`, the bytes of
`graphsafe.formats.fp8_dsv4.quantize_tokens`) or a bf16 row.

The D channels are pooled 64 at a time, twice: once for the RMS (sum of squares), once to
write (the same arithmetic, so the same values); the RoPE chunk as its even and odd
channels. A program so holds `[BLOCK_S, 64]` tiles, never a `[S, D]` one (S = 128 states
for DeepSeek-V4's ratio-128 layers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.ops.dsv4.kernels.triton_qnorm_rope_insert import bf16_bits, bf16_value, store_bf16_bytes, store_tile

CHUNK = tl.constexpr(64)
HALF = tl.constexpr(32)
DATA_BYTES = tl.constexpr(576)
SCALE_BYTES = tl.constexpr(8)


@triton.jit
def save_state_kernel(
    kv_ptr, score_ptr, ape_ptr, pos_ptr, state_ptr, slot_ptr,
    max_pos, num_state_slots, stride_kv, stride_score, stride_ape, stride_sb, stride_st,
    W: tl.constexpr, STATE_BLOCK: tl.constexpr, RATIO: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos) & (slot >= 0) & (slot < num_state_slots)
    pos = tl.where(ok, pos, 0)
    slot = tl.where(ok, slot, 0)
    row = state_ptr + (slot // STATE_BLOCK) * stride_sb + (slot % STATE_BLOCK) * stride_st
    ape_row = ape_ptr + (pos % RATIO) * stride_ape
    for c0 in tl.static_range(0, W, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        live = c < tl.where(ok, W, 0)
        kv = tl.load(kv_ptr + t * stride_kv + c, mask=live, other=0.0).to(tl.float32)
        score = tl.load(score_ptr + t * stride_score + c, mask=live, other=0.0).to(tl.float32)
        tl.store(row + c, kv, mask=live)
        tl.store(row + W + c, score + tl.load(ape_row + c, mask=live, other=0.0), mask=live)


@triton.jit
def _pool(rows, present, cols, W: tl.constexpr):
    """Channels `cols` ([C]) pooled over the window's states (`rows`, [BLOCK_S] pointers to
    each state's channel block, `present` those that exist): sum_i softmax_i(score) kv_i,
    0 where no state exists."""
    score = tl.load(rows[:, None] + W + cols[None, :], mask=present[:, None], other=float("-inf"))
    kv = tl.load(rows[:, None] + cols[None, :], mask=present[:, None], other=0.0)
    m = tl.max(score, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(score - m[None, :])
    total = tl.sum(p, 0)
    return tl.sum(p * kv, 0) / tl.where(total == 0.0, 1.0, total)


@triton.jit
def compress_kernel(
    pos_ptr, state_ptr, state_slot_ptr, table_ptr, req_ptr, weight_ptr, cs_ptr, cache_ptr, kv_slot_ptr,
    eps, max_pos, num_state_slots, num_state_blocks, num_reqs, max_state_blocks, num_slots,
    stride_sb, stride_st, stride_table, stride_cs, stride_cb, stride_ct,
    D: tl.constexpr, W: tl.constexpr, RATIO: tl.constexpr, S: tl.constexpr, STATE_BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_SIZE: tl.constexpr, RECORDS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    own = tl.load(state_slot_ptr + t).to(tl.int64)
    boundary = (pos >= 0) & (pos < max_pos) & (own >= 0) & (own < num_state_slots) & ((pos + 1) % RATIO == 0)
    # Read only for tokens that complete a window.
    slot = tl.load(kv_slot_ptr + t, mask=boundary, other=-1).to(tl.int64)
    req = tl.load(req_ptr + t, mask=boundary, other=-1).to(tl.int64)
    enabled = boundary & (slot >= 0) & (slot < num_slots) & (req >= 0) & (req < num_reqs)
    slot = tl.where(enabled, slot, 0)
    req = tl.where(enabled, req, 0)
    pos = tl.where(enabled, pos, 0)

    # The window: positions pos - S + 1 ... pos (S = ratio, or 2 ratio for overlapping windows,
    # W = 2 D: the previous window's states through their first D channels, this window's
    # through the next D).
    i = tl.arange(0, BLOCK_S)
    q = pos - S + 1 + i
    in_table = (i < tl.where(enabled, S, 0)) & (q >= 0) & (q // STATE_BLOCK < max_state_blocks)
    blk = tl.load(table_ptr + req * stride_table + q // STATE_BLOCK, mask=in_table, other=-1)
    present = in_table & (blk >= 0) & (blk < num_state_blocks)
    blk = tl.where(present, blk, 0).to(tl.int64)
    offset = tl.where(present, q % STATE_BLOCK, 0)
    rows = state_ptr + blk * stride_sb + offset * stride_st
    if S > RATIO:
        rows += tl.where(i >= RATIO, D, 0)

    NOPE_CHUNKS: tl.constexpr = (D - CHUNK) // CHUNK
    c = tl.arange(0, CHUNK)
    h = tl.arange(0, HALF)
    even_cols = 2 * h + (D - CHUNK)
    # Pass 1: the sum of squares of the pooled row.
    sumsq = tl.zeros((), dtype=tl.float32)
    for j in tl.static_range(NOPE_CHUNKS):
        x = _pool(rows, present, c + j * CHUNK, W)
        sumsq += tl.sum(x * x, 0)
    even = _pool(rows, present, even_cols, W)
    odd = _pool(rows, present, even_cols + 1, W)
    sumsq += tl.sum(even * even, 0) + tl.sum(odd * odd, 0)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq / D + eps))

    # Pass 2: pool again (the same values), normalise, rotate, write.
    rope_pos = (pos // RATIO) * RATIO
    h_live = h < tl.where(enabled, HALF, 0)
    cos = tl.load(cs_ptr + rope_pos * stride_cs + h, mask=h_live, other=0.0)
    sin = tl.load(cs_ptr + rope_pos * stride_cs + HALF + h, mask=h_live, other=0.0)
    ne = even * r * tl.load(weight_ptr + even_cols, mask=h_live, other=0.0)
    no = odd * r * tl.load(weight_ptr + even_cols + 1, mask=h_live, other=0.0)
    new_even = ne * cos - no * sin
    new_odd = ne * sin + no * cos
    c_live = c < tl.where(enabled, CHUNK, 0)
    if RECORDS:
        base = cache_ptr + (slot // BLOCK_SIZE) * stride_cb
        data = base + (slot % BLOCK_SIZE) * DATA_BYTES
        k = tl.arange(0, SCALE_BYTES)
        scale_bytes = tl.zeros([SCALE_BYTES], dtype=tl.int32)  # the 8th stays 0: the pad byte
        for j in tl.static_range(NOPE_CHUNKS):
            cols = c + j * CHUNK
            x = _pool(rows, present, cols, W) * r * tl.load(weight_ptr + cols, mask=c_live, other=0.0)
            byte = store_tile(data + cols, bf16_value(x), c_live)
            scale_bytes = tl.where(k == j, byte, scale_bytes)
        scales = base + BLOCK_SIZE * DATA_BYTES + (slot % BLOCK_SIZE) * SCALE_BYTES
        tl.store(scales + k, scale_bytes.to(tl.uint8), mask=k < tl.where(enabled, SCALE_BYTES, 0))
        store_bf16_bytes(data + (D - CHUNK) + 4 * h, new_even, h_live)
        store_bf16_bytes(data + (D - CHUNK) + 2 + 4 * h, new_odd, h_live)
    else:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        for j in tl.static_range(NOPE_CHUNKS):
            cols = c + j * CHUNK
            x = _pool(rows, present, cols, W) * r * tl.load(weight_ptr + cols, mask=c_live, other=0.0)
            tl.store(dst + cols, bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=c_live)
        tl.store(dst + even_cols, bf16_bits(new_even).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=h_live)
        tl.store(dst + even_cols + 1, bf16_bits(new_odd).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=h_live)
