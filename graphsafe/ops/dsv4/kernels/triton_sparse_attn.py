"""The Triton split-KV kernel of `dsv4_sparse_attn`: single-latent MQA over two caches.

One program per (head tile, split, query) walks its split of the query's K + K2 key
positions: the window entries (`indices`, slots of `kv_cache`) first, then the compressed
entries (`extra_indices`, slots of `extra_kv_cache`), each list cut at its length. A key
tile `[BLOCK_N, 512]` is gathered and, for fp8_dsv4 records, dequantised in registers
(`_load_rows`), then `s = q k^T` and `acc += p k` (the value is the whole row) with the
online softmax in f32, base 2. With one split the program writes the outputs (the sink
applied); with several it writes f32 partials that the MLA ops' `combine_kernel` merges
(graphsafe/ops/mla/kernels/triton_split_kv.py: the same partial layout and sink rule).

Where the host side decides the constexprs: graphsafe/ops/dsv4/triton.py (runner) and
graphsafe/ops/dsv4/plan.py (tiles, splits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import e4m3_bytes_to_f16
# The MLA split-KV kernel's helpers, its sink rule among them (this kernel shares its partial
# layout and combine too).
from graphsafe.ops.mla.kernels.triton_split_kv import _dot, _in_range, _round_bf16_bits, _with_sink

# fp8_dsv4 record geometry (graphsafe.formats.fp8_dsv4): globals read in @jit code are constexprs.
NOPE = tl.constexpr(448)
DATA_BYTES = tl.constexpr(576)
SCALE_BYTES = tl.constexpr(8)
TILE = tl.constexpr(64)
NAN_SCALE = tl.constexpr(255)
POW2_M127 = tl.constexpr(5.877471754111438e-39)  # 2^-127, a UE8M0 byte 0


@triton.jit
def _ue8m0(s):
    """float32 value of UE8M0 bytes `s` (int32): 2^(s - 127); byte 0 is 2^-127, 255 NaN."""
    pow2 = (s << 23).to(tl.float32, bitcast=True)
    pow2 = tl.where(s == 0, POW2_M127, pow2)
    return tl.where(s == NAN_SCALE, float("nan"), pow2)


@triton.jit
def _load_rows(cache_ptr, slots, nmask, cols, stride_kb, stride_kt,
               BLOCK_SIZE: tl.constexpr, D: tl.constexpr, RECORDS: tl.constexpr, FP8_NATIVE: tl.constexpr,
               ROUND_BITS: tl.constexpr):
    """The rows `[BLOCK_N, BLOCK_D]` of the keys at `slots` (masked lanes: slot 0, loaded as
    zeros) as bf16 dot operands.

    RECORDS (uint8 fp8_dsv4 cache, `cache_ptr` bytes): block `b` at `b * stride_kb`, token
    t's 448 e4m3 bytes at `576 t`, its 64 bf16 RoPE values right after (read byte by byte:
    no alignment is assumed), its 7 UE8M0 scales at `576 * BLOCK_SIZE + 8 t`; NoPE value c
    is `e4m3(byte c) * 2^(scale[c // 64] - 127)` in float32, exactly `dequantize_tokens`,
    then rounded to bf16 (exact for the scales a writer uses, see the format). Otherwise
    a bf16 cache: `[num_blocks, block_size, D]` rows, strides in elements."""
    blk = slots // BLOCK_SIZE
    off = slots % BLOCK_SIZE
    if RECORDS:
        base = cache_ptr + blk.to(tl.int64) * stride_kb
        data = base + off * DATA_BYTES
        nope = nmask[:, None] & (cols < NOPE)[None, :]
        b = tl.load(data[:, None] + cols[None, :], mask=nope, other=0)
        if FP8_NATIVE:
            x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # exact on every target (the interpreter's fp8 conversion makes NaN bytes finite)
            x = e4m3_bytes_to_f16(b).to(tl.float32)
        scale_row = base + BLOCK_SIZE * DATA_BYTES + off * SCALE_BYTES
        s = tl.load(scale_row[:, None] + (cols // TILE)[None, :], mask=nope, other=127).to(tl.int32)
        latent = x * _ue8m0(s)
        rope = nmask[:, None] & (cols >= NOPE)[None, :] & (cols < D)[None, :]
        at = data[:, None] + (2 * cols - NOPE)[None, :]  # byte 448 + 2 (c - 448) of the token
        lo = tl.load(at, mask=rope, other=0).to(tl.int32)
        hi = tl.load(at + 1, mask=rope, other=0).to(tl.int32)
        rope_f32 = ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)  # the bf16 value, exactly
        rows = tl.where((cols < NOPE)[None, :], latent, rope_f32)
        if ROUND_BITS:
            rows = _round_bf16_bits(rows)
        return rows.to(tl.bfloat16)
    else:
        ptrs = cache_ptr + blk.to(tl.int64) * stride_kb + off.to(tl.int64) * stride_kt
        return tl.load(ptrs[:, None] + cols[None, :], mask=nmask[:, None] & (cols < D)[None, :], other=0.0)


@triton.jit
def _attend(q, m_i, l_i, acc, cache_ptr, map_row, start, end, num_slots, stride_kb, stride_kt, qk_scale, cols,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, RECORDS: tl.constexpr,
            FP8_NATIVE: tl.constexpr, DOT_F32: tl.constexpr):
    """The online softmax over the entries [start, end) of one index row (`map_row`): an
    entry whose slot lies outside [0, num_slots) (-1, the padding, or any other) is no key,
    and masked lanes address slot 0 and load zeros."""
    for n0 in tl.range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end
        slot = tl.load(map_row + offs, mask=nmask, other=-1)
        nmask = nmask & _in_range(slot, num_slots)
        slot = tl.where(nmask, slot, 0)
        k = _load_rows(cache_ptr, slot, nmask, cols, stride_kb, stride_kt, BLOCK_SIZE, D, RECORDS, FP8_NATIVE,
                       DOT_F32)
        s = _dot(q, tl.trans(k), None, DOT_F32)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row without a valid key so far keeps m = -inf; shift it by 0 (not -inf - -inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(tl.bfloat16), k, acc * alpha[:, None], DOT_F32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def dsv4_attn_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, xkv_ptr, xidx_ptr, xlen_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e)
    num_heads, head_tiles, num_splits, tokens_per_split, topk, extra_topk, num_slots, extra_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_idx, stride_xkb, stride_xkt, stride_xidx,
    stride_or, stride_oh, stride_lr, stride_sink,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, EXTRA_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RECORDS: tl.constexpr, FP8_NATIVE: tl.constexpr,
    DOT_F32: tl.constexpr, HAS_EXTRA: tl.constexpr, TOPK_LENGTH: tl.constexpr, EXTRA_TOPK_LENGTH: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = pid % head_tiles
    split = (pid // head_tiles) % num_splits
    row = (pid // (head_tiles * num_splits)).to(tl.int64)

    # This split's key positions [start, end) of the K + K2 of the query: window entries
    # [0, K), compressed entries [K, K + K2); each list ends at its length.
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, topk + extra_topk)
    main_len = topk
    if TOPK_LENGTH:
        main_len = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), topk)
    main_end = tl.minimum(end, main_len)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    q_rows = q_ptr + row * stride_qr + heads.to(tl.int64) * stride_qh
    q = tl.load(q_rows[:, None] + cols[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, kv_ptr, idx_ptr + row * stride_idx, start, main_end, num_slots,
                            stride_kb, stride_kt, qk_scale, cols, BLOCK_SIZE, BLOCK_N, D, RECORDS, FP8_NATIVE,
                            DOT_F32)
    if HAS_EXTRA:
        extra_len = extra_topk
        if EXTRA_TOPK_LENGTH:
            extra_len = tl.minimum(tl.maximum(tl.load(xlen_ptr + row), 0), extra_topk)
        x_start = tl.maximum(start - topk, 0)
        x_end = tl.minimum(end - topk, extra_len)
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, xkv_ptr, xidx_ptr + row * stride_xidx, x_start, x_end,
                                extra_slots, stride_xkb, stride_xkt, qk_scale, cols, EXTRA_BLOCK_SIZE, BLOCK_N, D,
                                RECORDS, FP8_NATIVE, DOT_F32)

    # l = 0 exactly when no valid key scored above -inf; a NaN l (a NaN or +inf score) stays NaN.
    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    lse = tl.where(no_key, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    omask = hmask[:, None] & cmask[None, :]
    if SPLIT:
        part = (row * num_splits + split) * num_heads + heads.to(tl.int64)
        tl.store(pout_ptr + part[:, None] * D + cols[None, :], acc / l_safe[:, None], mask=omask)
        tl.store(plse_ptr + part, lse, mask=hmask)
    else:
        l_out = l_safe
        if HAS_SINK:
            l_out = _with_sink(l_i, m_i, no_key, tl.load(sink_ptr + heads * stride_sink, mask=hmask, other=0.0))
        o_rows = out_ptr + row * stride_or + heads.to(tl.int64) * stride_oh
        tl.store(o_rows[:, None] + cols[None, :], (acc / l_out[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
        tl.store(lse_ptr + row * stride_lr + heads, lse, mask=hmask)
