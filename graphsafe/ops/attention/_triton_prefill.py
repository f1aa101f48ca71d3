"""Triton kernel of `flash_attn_varlen`: FlashAttention-2 forward over packed sequences.

One program per (query block of BLOCK_M rows, sequence, query head). Programs of one
(sequence, head) are adjacent in the launch order, heaviest (last) query block first, so
a head's K/V stay in L2 and causal work is balanced. The key loop runs in two phases:
blocks every row of the query block sees (no mask at all), then the diagonal/tail blocks
(masked). exp2 with log2(e) folded into the scale; online softmax in fp32.

Head dims that are not a power of two (192 for MLA prefill) are split into two dot
products (128 + 64) instead of padding to 256.

FP8: q, k and V^T are float8e4nv. V is read from a transposed (token-contiguous) buffer
so both products have K-major operands, as Hopper's fp8 wgmma requires. P is scaled by
P_SCALE before its fp8 cast (e4m3 has no room below 2^-9); the output undoes it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.ops.attention._triton_quant import cast_fp8
from graphsafe.ops.attention.fp8 import AMAX_EPS, FP8_MAX, P_SCALE

LOG2E = 1.4426950408889634
_P_SCALE = tl.constexpr(P_SCALE)
_EPS = tl.constexpr(AMAX_EPS)
_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantize_tile(x, descale, EMULATE: tl.constexpr):
    """The per-tensor quantisation of `fp8.quantize_per_tensor`, bit for bit."""
    return cast_fp8(tl.clamp(tl.math.div_rn(x.to(tl.float32), descale), -_MAX, _MAX), EMULATE)


@triton.jit
def _load_kt(base, rel_n, offs_d, stride_kt, n_mask, D: tl.constexpr, NMASK: tl.constexpr, DMASK: tl.constexpr):
    """K^T tile [BLOCK_D, BLOCK_N] (D contiguous: the K-major B operand of q @ K^T)."""
    ptrs = base + offs_d[:, None] + rel_n[None, :] * stride_kt
    if NMASK and DMASK:
        return tl.load(ptrs, mask=n_mask[None, :] & (offs_d[:, None] < D), other=0.0)
    elif NMASK:
        return tl.load(ptrs, mask=n_mask[None, :], other=0.0)
    elif DMASK:
        return tl.load(ptrs, mask=offs_d[:, None] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _key_block(
    acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, k_len, diag, qk_scale,
    stride_kt, stride_vt, stride_vd,
    D: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr,
):
    """Keys [start_n, start_n + BLOCK_N) (at pointers k_blk, v_blk) into the online
    softmax; MASKED blocks check lengths and causality."""
    rel_n = tl.arange(0, BLOCK_N)
    offs_n = start_n + rel_n
    n_mask = offs_n < k_len
    offs_da = tl.arange(0, BLOCK_DA)
    s = tl.dot(q_a, _load_kt(k_blk, rel_n, offs_da, stride_kt, n_mask, D, MASKED, BLOCK_DA > D))
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        s = tl.dot(q_b, _load_kt(k_blk, rel_n, offs_db, stride_kt, n_mask, D, MASKED, BLOCK_DA + BLOCK_DB > D), s)
    s = s * qk_scale
    if MASKED:
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)

    offs_dv = tl.arange(0, BLOCK_DV)
    v_ptrs = v_blk + rel_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd
    if MASKED:
        v = tl.load(v_ptrs, mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    elif BLOCK_DV > DV:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if FP8:
        acc = acc * alpha[:, None] + tl.dot(cast_fp8(p * _P_SCALE, EMULATE), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _varlen_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, qd_ptr, kd_ptr, vd_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h,
    qk_scale, num_q_heads, num_m_blocks,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FP8: tl.constexpr, HAS_DESCALE: tl.constexpr, Q_QUANT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Q_QUANT: q is bf16/fp16 and `qd_ptr` holds its amax; the program quantises its own
    query tile (saving a pass over q, the largest input under GQA)."""
    pid = tl.program_id(0)
    seq_head = pid // num_m_blocks
    m_block = num_m_blocks - 1 - pid % num_m_blocks  # heaviest causal block first
    b = seq_head // num_q_heads
    head = seq_head % num_q_heads
    kv_head = head // GROUP
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    k_start = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k_start

    rel_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + rel_m
    m_mask = offs_m < q_len
    q_base = q_ptr + (q_start + m0).to(tl.int64) * stride_qt + head * stride_qh
    offs_da = tl.arange(0, BLOCK_DA)
    q_rows = q_base + rel_m[:, None] * stride_qt
    q_a = tl.load(q_rows + offs_da[None, :], mask=m_mask[:, None] & (offs_da[None, :] < D), other=0.0)
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        q_b = tl.load(q_rows + offs_db[None, :], mask=m_mask[:, None] & (offs_db[None, :] < D), other=0.0)
    else:
        q_b = q_a
    if HAS_DESCALE:
        if Q_QUANT:
            q_descale = tl.math.div_rn(tl.maximum(tl.load(qd_ptr), _EPS), _MAX)
            q_a = _quantize_tile(q_a, q_descale, EMULATE)
            if BLOCK_DB > 0:
                q_b = _quantize_tile(q_b, q_descale, EMULATE)
        else:
            q_descale = tl.load(qd_ptr + b * stride_qd_b + kv_head * stride_qd_h)
        qk_scale = qk_scale * q_descale
        qk_scale = qk_scale * tl.load(kd_ptr + b * stride_kd_b + kv_head * stride_kd_h)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh

    # Keys [0, full_end) are visible to every row of the block; [full_end, hi) need masks.
    diag = k_len - q_len  # bottom-right causal alignment: row i sees keys j <= i + diag
    if CAUSAL:
        hi = tl.maximum(tl.minimum(k_len, m0 + BLOCK_M + diag), 0)
        full_end = tl.maximum(tl.minimum(k_len, m0 + diag + 1), 0)
    else:
        hi = k_len
        full_end = k_len
    full_end = (full_end // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Block pointers advance in 64-bit (long sequences overflow int32 offsets); the
    # masked phase continues where the unmasked one stopped (full_end is block aligned).
    k_blk = k_base
    v_blk = v_base
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _key_block(
            acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, k_len, diag, qk_scale,
            stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
            False, CAUSAL, FP8, EMULATE,
        )
        k_blk += BLOCK_N * stride_kt
        v_blk += BLOCK_N * stride_vt
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _key_block(
            acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, k_len, diag, qk_scale,
            stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
            True, CAUSAL, FP8, EMULATE,
        )
        k_blk += BLOCK_N * stride_kt
        v_blk += BLOCK_N * stride_vt

    norm = tl.where(l_i > 0.0, l_i, 1.0)  # rows that see no key: acc is 0, out is 0
    if FP8:
        norm = norm * _P_SCALE
    if HAS_DESCALE:
        acc = acc * tl.load(vd_ptr + b * stride_vd_b + kv_head * stride_vd_h)
    o = acc / norm[:, None]
    offs_dv = tl.arange(0, BLOCK_DV)
    out = out_ptr + (q_start + m0).to(tl.int64) * stride_ot + head * stride_oh
    out = out + rel_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _zero_tail_kernel(out_ptr, cu_q_ptr, batch, n_rows, row_len, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows outside every sequence (t >= cu_seqlens_q[B]) get 0. `out` is contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.load(cu_q_ptr + batch)
    rows_mask = (rows >= first) & (rows < n_rows)
    if tl.sum(rows_mask.to(tl.int32), axis=0) > 0:
        for c0 in range(0, row_len, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ptrs = out_ptr + rows[:, None].to(tl.int64) * row_len + cols[None, :]
            zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=out_ptr.dtype.element_ty)
            tl.store(ptrs, zeros, mask=rows_mask[:, None] & (cols[None, :] < row_len))


def launch_zero_tail(out, cu_q) -> None:
    """Zero the rows of contiguous `out` [Tq, Hq, Dv] past `cu_q[B]` (read on the device)."""
    tq, hq, dv = out.shape
    if tq > 0 and hq * dv > 0:
        _zero_tail_kernel[(triton.cdiv(tq, 64),)](
            out, cu_q, cu_q.shape[0] - 1, tq, hq * dv, BLOCK_R=64, BLOCK_C=min(1024, triton.next_power_of_2(hq * dv))
        )


def _split_head_dim(d: int, min_block: int) -> tuple[int, int]:
    """D = BLOCK_DA (+ BLOCK_DB): a power of two and a power-of-two remainder, each at
    least `min_block` (the dot's smallest K: 16, or 32 for fp8 operands)."""
    block_da = max(min_block, 1 << (d.bit_length() - 1))
    rest = d - block_da
    return block_da, (0 if rest <= 0 else max(min_block, triton.next_power_of_2(rest)))


def launch_varlen(
    q, k, v, out, cu_q, cu_k, max_seqlen_q, scale, causal, descales, v_strides, fp8, config, emulate, q_quant=False
):
    """Launch the forward kernel (and the tail zeroing). `descales` is None or three
    (tensor, stride_b, stride_h); `v_strides` (t, h, d) of `v` (transposed for fp8).
    `q_quant`: q is bf16/fp16 and the first descale entry points at its amax."""
    hq, d = q.shape[1:]
    hk, dv = k.shape[1], out.shape[2]
    batch = cu_q.shape[0] - 1
    block_m, block_n, num_warps, num_stages = config
    launch_zero_tail(out, cu_q)
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    if batch == 0 or num_m_blocks == 0 or hq == 0:
        return
    block_da, block_db = _split_head_dim(d, 32 if fp8 else 16)
    if descales is None:
        (qd, sqb, sqh), (kd, skb, skh), (vd, svb, svh) = ((q, 0, 0),) * 3
    else:
        (qd, sqb, sqh), (kd, skb, skh), (vd, svb, svh) = descales
    vt, vh, vdd = v_strides
    _varlen_fwd_kernel[(num_m_blocks * batch * hq,)](
        q, k, v, out, cu_q, cu_k, qd, kd, vd,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vt, vh, vdd, out.stride(0), out.stride(1),
        sqb, sqh, skb, skh, svb, svh,
        scale * LOG2E, hq, num_m_blocks,
        GROUP=hq // hk, D=d, BLOCK_DA=block_da, BLOCK_DB=block_db,
        DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, FP8=fp8, HAS_DESCALE=descales is not None, Q_QUANT=q_quant, EMULATE=emulate,
        num_warps=num_warps, num_stages=num_stages,
    )
