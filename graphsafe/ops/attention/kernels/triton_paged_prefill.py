"""Triton kernel of `paged_attention_prefill`: varlen queries over the paged K/V cache.

One program per (query block, sequence, KV head), the GQA group packed into its rows:
BLOCK_M rows = BLOCK_Q query tokens x GROUP query heads (row r: token `r // GROUP`,
head `r % GROUP` of the KV head; rows past BLOCK_Q * GROUP idle when GROUP is not a
power of two), so each K/V tile is loaded once per KV head, not once per query head.
Programs of one (sequence, KV head) are adjacent in the launch order, heaviest (last)
query block first. Each key's cache row comes from the block table, per key (masked
loads; an id outside [0, num_blocks) is a padding block: its keys are masked and
address block 0). The keys are [lo, hi): lo the first key the block's first row sees
(0, or its window's start), hi one past the last row's diagonal (causal) or len_k, in
BLOCK_N tiles from lo; the tiles every row sees wholly take no causal/window mask (the
middle phase), those at the window's start and at the diagonal do. Online softmax in
fp32, base 2; P is cast to q's dtype for P.V. fp8 caches: e4m3 tiles converted to q's
dtype (exact), k_scale folded into the score scale, v_scale applied to acc at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.launch import Launch, bind
from graphsafe.ops.attention.kernels.triton_quant import sequence_bounds
from graphsafe.ops.attention.kernels.triton_softcap import tanh_of_exp2

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _key_tile(
    acc, l_i, m_i, q, k_head, v_head, table_row, n0, hi, pos, qk_scale, cap, window_left, num_blocks,
    stride_kb, stride_kt, stride_vb, stride_vt, stride_tm, offs_d, offs_dv, d_mask, dv_mask,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Keys [n0, n0 + BLOCK_N) into the online softmax (m, l, acc in log2 units). Keys of
    padding blocks are always masked; MASKED tiles also hide keys at or past `hi` and,
    per row (key position `pos`), keys past the diagonal (CAUSAL) and before the window
    (WINDOW). Unmasked tiles lie wholly inside [lo, hi) and every row's view."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = offs_n // BLOCK_SIZE
    if MASKED:
        in_seq = offs_n < hi
        block = tl.load(table_row + slot * stride_tm, mask=in_seq, other=0)
        # One unsigned compare: a negative id wraps to a huge one.
        ok = in_seq & (block.to(tl.uint32, bitcast=True) < num_blocks)
    else:
        block = tl.load(table_row + slot * stride_tm)
        ok = block.to(tl.uint32, bitcast=True) < num_blocks
    block = tl.where(ok, block, 0).to(tl.int64)  # masked keys address block 0 (never loaded)
    in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
    k_rows = block * stride_kb + in_block * stride_kt
    kt = tl.load(k_head + offs_d[:, None] + k_rows[None, :], mask=d_mask[:, None] & ok[None, :], other=0.0)
    if KV_FP8:  # e4m3 -> q's dtype is exact; k_scale is in qk_scale
        kt = kt.to(q.dtype)
    s = tl.dot(q, kt)
    if SOFTCAP:
        # qk_scale = scale (* k_scale) * 2 log2(e) / softcap, cap = softcap * log2(e).
        s = cap * tanh_of_exp2(s * qk_scale)
    else:
        s = s * qk_scale
    visible = ok[None, :]
    if MASKED:
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] >= pos[:, None] - window_left)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet (padding blocks, masks)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = block * stride_vb + in_block * stride_vt
    v = tl.load(v_head + v_rows[:, None] + offs_dv[None, :], mask=ok[:, None] & dv_mask[None, :], other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v, acc)
    return acc, l_i, m_new


# `max_len` stays a runtime int: Triton specialises an int argument equal to 1 into a
# constant, and with max_len == 1 (one block of one token per sequence) the ptxas of
# Triton 3.6 segfaults on this kernel at 3 stages (reproduced for sm_90a on the CPU).
@triton.jit(do_not_specialize=["max_len"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, cu_q_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb, stride_tm, stride_lens, stride_sinks, stride_ot, stride_oh,
    total_q, max_len, num_blocks, num_kv_heads, num_q_blocks, qk_scale, cap, window_left,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    seq_head = pid // num_q_blocks
    q_block = num_q_blocks - 1 - pid % num_q_blocks  # heaviest (causal) block first
    b = seq_head // num_kv_heads
    kv_head = seq_head % num_kv_heads
    q_start, q_end = sequence_bounds(cu_q_ptr, b, total_q, 128)
    q_len = q_end - q_start
    t0 = q_block * BLOCK_Q
    if t0 >= q_len:
        return
    len_k = tl.minimum(tl.maximum(tl.load(lens_ptr + b * stride_lens), 0), max_len)
    diag = len_k - q_len  # query token i sits at key position i + diag

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = tok + diag
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # Keys [lo, hi) are those some row sees; every row sees [full_lo, full_hi).
    t1 = tl.minimum(t0 + BLOCK_Q, q_len) - 1
    if CAUSAL:
        hi = tl.maximum(tl.minimum(len_k, t1 + diag + 1), 0)
        full_hi = tl.maximum(tl.minimum(len_k, t0 + diag + 1), 0)
    else:
        hi = len_k
        full_hi = len_k
    if WINDOW:
        lo = tl.maximum(t0 + diag - window_left, 0)
        full_lo = tl.maximum(t1 + diag - window_left, 0)
    else:
        lo = 0
        full_lo = 0
    # Tiles start at lo: [0, full_first) masked (the window's start), [full_first,
    # full_last) unmasked, [full_last, n_tiles) masked (the diagonal, the tail).
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    full_first = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N), n_tiles)
    full_last = tl.maximum((tl.maximum(full_hi - lo, 0)) // BLOCK_N, full_first)

    table_row = table_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(lo, lo + full_first * BLOCK_N, BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_head, v_head, table_row, n0, hi, pos, qk_scale, cap, window_left, num_blocks,
            stride_kb, stride_kt, stride_vb, stride_vt, stride_tm, offs_d, offs_dv, d_mask, dv_mask,
            BLOCK_N, BLOCK_SIZE, True, CAUSAL, WINDOW, SOFTCAP, KV_FP8,
        )
    for n0 in range(lo + full_first * BLOCK_N, lo + full_last * BLOCK_N, BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_head, v_head, table_row, n0, hi, pos, qk_scale, cap, window_left, num_blocks,
            stride_kb, stride_kt, stride_vb, stride_vt, stride_tm, offs_d, offs_dv, d_mask, dv_mask,
            BLOCK_N, BLOCK_SIZE, False, CAUSAL, WINDOW, SOFTCAP, KV_FP8,
        )
    for n0 in range(lo + full_last * BLOCK_N, hi, BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_head, v_head, table_row, n0, hi, pos, qk_scale, cap, window_left, num_blocks,
            stride_kb, stride_kt, stride_vb, stride_vt, stride_tm, offs_d, offs_dv, d_mask, dv_mask,
            BLOCK_N, BLOCK_SIZE, True, CAUSAL, WINDOW, SOFTCAP, KV_FP8,
        )

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if HAS_SINKS:
        # The sink joins the normaliser once, against the running max (0 when no key
        # scored above -inf, as the reference's); it carries no value.
        sink = tl.load(sinks_ptr + head * stride_sinks, mask=row_ok, other=0.0)
        m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = l_i + tl.exp2(sink * _LOG2E - m_ref)
    norm = tl.where(l_i == 0.0, 1.0, l_i)  # a NaN sum (NaN scores) keeps the row NaN
    o = acc / norm[:, None]
    # A row that sees no key is 0, decided from indices (a value it does not see may be
    # NaN in a tile it shares with rows that see it: p = 0 times NaN). Without causal
    # every row sees key len_k - 1 (its window reaches it too).
    if CAUSAL:
        o = tl.where(pos[:, None] >= 0, o, 0.0)
    else:
        o = tl.where(len_k > 0, o, 0.0)
    out_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dv_mask[None, :])


def bind_paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    num_seqs: int, max_seqlen_q: int, scale: float, causal: bool, window_left: int, softcap: float,
    sinks_stride: int | None,
    config: tuple[int, int, int, int], kv_fp8: bool,
) -> Launch | None:
    """The kernel bound to these inputs' shapes and strides, into a contiguous
    `[Tq, Hq, Dv]` output: `launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
    k_scale, v_scale, sinks, out)`; it writes every row of every sequence (the caller
    zeroes the rows outside them: `triton_quant.bind_prepare`). bf16/fp16 caches read no
    scales and `sinks_stride=None` (no sinks) none: pass any tensor of the device there (e.g. q).
    `config` is (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages); BLOCK_M is raised to
    the group size when smaller. `kv_fp8`: the caches are float8_e4m3fn (the plan's
    `PagedPrefillChoice.kv_fp8`). None when there is nothing to compute."""
    tq, hq, d = q.shape
    num_blocks, block_size, hk, dv = v_cache.shape
    group = hq // hk
    block_m, block_n, num_warps, num_stages = config
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    num_q_blocks = triton.cdiv(max_seqlen_q, block_q)
    if num_seqs == 0 or num_q_blocks == 0 or tq == 0 or hq == 0:
        return None
    # fp8 caches: head tiles of at least 32 columns. Triton 3.6 on sm_90 reads shared memory
    # out of bounds (compute-sanitizer) for a [64, 16] fp8 V tile converted for the P.V dot.
    least = 32 if kv_fp8 else 16
    if softcap > 0:
        qk_scale, cap = scale * 2 * LOG2E / softcap, softcap * LOG2E
    else:
        qk_scale, cap = scale * LOG2E, 1.0
    return bind(
        _paged_prefill_kernel, (num_q_blocks * num_seqs * hk,),
        q, k_cache, v_cache, block_table, seq_lens, q, q, q, q, q,  # cu_q, scales, sinks, out: placeholders
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), block_table.stride(1), seq_lens.stride(0), sinks_stride or 0,
        hq * dv, dv,  # out is contiguous
        tq, block_table.shape[1] * block_size, num_blocks, hk, num_q_blocks, qk_scale, cap, window_left,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        D=d, BLOCK_D=max(least, triton.next_power_of_2(d)),
        DV=dv, BLOCK_DV=max(least, triton.next_power_of_2(dv)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, CAUSAL=causal, WINDOW=window_left >= 0, SOFTCAP=softcap > 0,
        HAS_SINKS=sinks_stride is not None, KV_FP8=kv_fp8, num_warps=num_warps, num_stages=num_stages,
    )
