"""Triton kernels of `paged_attention_decode`: split-KV flash decoding over the paged cache.

One program per (request, KV head, split) handles the whole group of query heads that
share the KV head, so every cached K/V row is read once per request: scores are one
`tl.dot` of the group's queries [BLOCK_G, D] with a tile of keys, online softmax in fp32
with exp2 (log2(e) folded into the scale). Each request divides its own length (read on
the device) evenly among the splits; the split count itself is fixed from shapes on the
host (plan.py). With one split the kernel writes the output; otherwise it writes a
normalised partial output and its log2-sum-exp, and `_combine_kernel` merges them.
`bind_paged_decode` and `bind_combine` bind the two launches to a call signature.

The variants are constexpr switches, so the default path compiles as before:
HAS_WINDOW (a request's keys start at `max(0, len - 1 - window_left)`, and its splits
divide that range, so nothing before the window is read), SOFTCAP (`c * tanh(s / c)`
on the scores) and HAS_SINKS (the sink joins the normaliser where the output is made:
in the decode kernel's epilogue with one split, in the combine kernel with several).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.launch import Launch, bind
from graphsafe.ops.attention.kernels.triton_softcap import tanh_of_exp2

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # kernels may only read constexpr globals


@triton.jit
def _ids_in_range(table_row, stride_tm, start, end, block_size, num_blocks, CHUNK: tl.constexpr):
    """Whether every block id of positions [start, end) is in [0, num_blocks): one
    unsigned compare per id (a negative id wraps to a huge one)."""
    first = start // block_size
    stop = tl.cdiv(end, block_size)
    bad = tl.zeros([], dtype=tl.int32)
    for i0 in range(first, stop, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        ids = tl.load(table_row + i * stride_tm, mask=i < stop, other=0)
        bad += tl.sum((ids.to(tl.uint32, bitcast=True) >= num_blocks).to(tl.int32), axis=0)
    return bad == 0


@triton.jit
def _softcapped(s, cap_log2, cap_rate):
    """`c * tanh(s / c)` of scores `s` in log2 units (`s = t * log2(e)`), in log2 units:
    `cap_log2 = c * log2(e)`, `cap_rate = 2 / c` (tanh's exp2 argument per log2-unit score)."""
    return cap_log2 * tanh_of_exp2(s * cap_rate)


@triton.jit
def _attend_tiles(
    q, k_head, v_head, table_row, start, end, stride_kb, stride_kt, stride_vb, stride_vt, stride_tm,
    block_size, num_blocks, qk_scale, cap_log2, cap_rate, offs_d, offs_dv, d_mask, dv_mask,
    BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
    CHECK_IDS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online softmax over key positions [start, end): (m, l, acc) in log2 units.
    CHECK_IDS: mask tokens of padding blocks (ids outside [0, num_blocks)); without it
    every id must be valid (`_ids_in_range`). SOFTCAP: cap the scores (`_softcapped`)."""
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table_row + (offs_n // block_size) * stride_tm, mask=n_mask, other=0)
        if CHECK_IDS:
            # One unsigned compare; masked lanes address block 0.
            n_mask = n_mask & (block.to(tl.uint32, bitcast=True) < num_blocks)
            block = tl.where(n_mask, block, 0)
        block = block.to(tl.int64)
        in_block = (offs_n % block_size).to(tl.int64)
        k = tl.load(
            k_head + (block * stride_kb + in_block * stride_kt)[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :], other=0.0,
        )
        v = tl.load(
            v_head + (block * stride_vb + in_block * stride_vt)[:, None] + offs_dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )
        if KV_FP8:  # fp8 -> the query dtype is exact; the cache scales are applied outside
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if SOFTCAP:  # before the mask: a masked key stays -inf, not -c
            s = _softcapped(s, cap_log2, cap_rate)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet (padding blocks)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _with_sink(l_i, m_i, has_keys, sinks_ptr, heads, g_mask, stride_sinks):
    """The normaliser `l` (log2 units, max `m`) with the heads' sinks added, `+ 2^(sink *
    log2(e) - m)`, where the row has a key (one without any stays 0, whatever the sink)."""
    sink = tl.load(sinks_ptr + heads * stride_sinks, mask=g_mask & has_keys, other=float("-inf"))
    return l_i + tl.exp2(sink * _LOG2E - tl.where(has_keys, m_i, 0.0))


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb, stride_tm, stride_lens, stride_sinks,
    stride_ob, stride_oh,
    max_len, block_size, num_blocks, qk_scale, window_left, cap_log2, cap_rate,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_FP8: tl.constexpr, CHECK_IDS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.minimum(tl.maximum(tl.load(lens_ptr + b * stride_lens), 0), max_len)
    span = length
    if HAS_WINDOW:  # keys [first, length): the splits share the window, not [0, length)
        first = tl.maximum(length - 1 - window_left, 0)
        span = length - first
    # This request's share, in whole tiles: splits past its end are empty.
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    if HAS_WINDOW:
        start += first
    end = tl.minimum(start + chunk, length)

    table_row = table_ptr + b * stride_tb
    # Block ids outside [0, num_blocks) are padding blocks (no key). Checking them per
    # token in the tile loop costs 25% (H200, B = 64): the pipelined loads then carry a
    # loaded mask per stage; a loop chosen by a branch in the kernel costs 15%. So each
    # call launches this kernel twice, without and with the per-token check
    # (CHECK_IDS): a program scans its split's ids first and runs its tiles, and loads q
    # and stores, in the launch that matches; in the other it reads and writes nothing.
    # (BLOCK_N ids per scan step: 16 and 256 measured slower.)
    ids_ok = _ids_in_range(table_row, stride_tm, start, end, block_size, num_blocks, BLOCK_N)
    mine = ids_ok != CHECK_IDS

    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < tl.where(mine, GROUP, 0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    m_i, l_i, acc = _attend_tiles(
        q, k_head, v_head, table_row, start, tl.where(mine, end, start), stride_kb, stride_kt, stride_vb, stride_vt,
        stride_tm, block_size, num_blocks, qk_scale, cap_log2, cap_rate, offs_d, offs_dv, d_mask, dv_mask,
        BLOCK_G, BLOCK_DV, BLOCK_N, KV_FP8, CHECK_IDS, SOFTCAP,
    )

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    has_keys = l_i > 0.0
    if HAS_SINKS:  # (bound only with one split: partials stay sink-free for the combine)
        l_i = _with_sink(l_i, m_i, has_keys, sinks_ptr, heads, g_mask, stride_sinks)
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    else:
        # Partial layout [B, Hq, S, DV] / [B, Hq, S], contiguous (workspace views).
        row = (b * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], o, mask=g_mask[:, None] & dv_mask[None, :])
        # An empty split is neutral: lse = -inf (its partial output is 0, never NaN).
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_q_heads, stride_sinks, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = b * num_q_heads + head
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight is 0, out 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    has_keys = denom > 0.0
    if HAS_SINKS:
        # Against the largest lse, not the largest score: the ratio is the same. A row
        # without a key (denom 0) stays 0 whatever the sink; a NaN sink gives NaN.
        sink = tl.load(sinks_ptr + head * stride_sinks)
        denom += tl.where(has_keys, tl.exp2(sink * _LOG2E - m), 0.0)
    o = tl.load(
        part_o_ptr + (row * NUM_SPLITS + offs_s)[:, None] * DV + offs_dv[None, :],
        mask=s_mask[:, None] & dv_mask[None, :], other=0.0,
    )
    out = tl.sum(o * w[:, None], axis=0) / tl.where(has_keys, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty), mask=dv_mask)


def bind_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, num_splits: int, config: tuple[int, int, int], kv_fp8: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> Launch:
    """The decode kernel bound to these inputs' shapes and strides and to the variants
    (`window_left`, `softcap`, whether there are `sinks`), into a contiguous `[B, Hq, Dv]`
    output: `launch(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sinks,
    out, part_o, part_lse)`. `kv_fp8`: the caches are float8_e4m3fn (the plan's
    `DecodeChoice.kv_fp8`); bf16/fp16 caches read no scales, a call without sinks reads
    none, and one split writes no partials: pass any tensor of the device there (e.g. q,
    out). With several splits the partials leave the sinks out (the combine adds them).
    Two launches of the kernel, without and with the per-token id check (see the kernel)."""
    b, hq, d = q.shape
    _, block_size, hk, dv = v_cache.shape
    group = hq // hk
    block_n, num_warps, num_stages = config
    # softcap c in log2 units: c * log2(e); tanh(t / c) = tanh_of_exp2(s * 2 / c) (s = t log2(e)).
    cap_log2, cap_rate = (softcap * LOG2E, 2.0 / softcap) if softcap > 0 else (0.0, 0.0)
    unchecked, checked = (bind(
        _paged_decode_kernel, (b, hk, num_splits),
        q, k_cache, v_cache, block_table, seq_lens, q, q, q, q, q, q,  # scales, sinks, out, partials: placeholders
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), block_table.stride(1), seq_lens.stride(0), 0 if sinks is None else sinks.stride(0),
        hq * dv, dv,  # the output's strides
        block_table.shape[1] * block_size, block_size, k_cache.shape[0], scale * LOG2E, max(window_left, 0),
        cap_log2, cap_rate,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_N=block_n, NUM_SPLITS=num_splits, KV_FP8=kv_fp8, CHECK_IDS=check,
        HAS_WINDOW=window_left >= 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None and num_splits == 1,
        num_warps=num_warps, num_stages=num_stages,
    ) for check in (False, True))

    def launch(*tensors: torch.Tensor) -> None:
        unchecked(*tensors)
        checked(*tensors)

    return launch


def bind_combine(
    like: torch.Tensor, batch: int, num_q_heads: int, head_dim_v: int, num_splits: int,
    sinks: torch.Tensor | None = None,
) -> Launch:
    """The combine kernel bound for `num_splits` partials per (request, query head):
    `launch(part_o, part_lse, sinks, out)`, out contiguous `[B, Hq, Dv]`; with `sinks`
    (bound here by stride) each head's sink joins the normaliser once, without them the
    `sinks` argument is not read (pass any tensor of the device). `like`: any tensor of
    the device (placeholder for the tensor arguments)."""
    return bind(
        _combine_kernel, (batch, num_q_heads),
        like, like, like, like, num_q_heads, 0 if sinks is None else sinks.stride(0),
        num_q_heads * head_dim_v, head_dim_v,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        DV=head_dim_v, BLOCK_DV=triton.next_power_of_2(head_dim_v), HAS_SINKS=sinks is not None, num_warps=4,
    )
