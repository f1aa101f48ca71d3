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
P_SCALE before its fp8 cast (e4m3 has no room below 2^-9): the scale is folded into the
exponent (`exp2(s - m + log2(P_SCALE))`), so l and acc both carry it and `acc / l`
cancels it without an extra multiply per element.

Aligned key frame (KV_ALIGN > 1, the fp8 path): the V^T rows of a sequence start at token
`k_start`, which is arbitrary, so V^T tile addresses would have no known alignment and
Triton could neither copy them asynchronously (cp.async needs >= 4 aligned bytes) nor
pipeline them; the tile would go through registers byte by byte. The kernel therefore
walks keys from `kv0 = k_start` rounded down to KV_ALIGN tokens: key n of the frame is
key `n - lead` of the sequence (`lead = k_start - kv0`), keys n < lead are masked (only
block 0 of a sequence with lead > 0 pays a masked block). Masked blocks load V^T in
whole KV_ALIGN-token groups (still 16-byte copies) and zero the values of keys outside
the sequence in registers, so a neighbour's NaN never meets a p = 0.

Softmax arithmetic per score: the row max is taken over the raw q.k (qk_scale > 0: the
kernel moves a negative scale's sign into q), the exponent is one FMA, the fp8 P cast
needs no multiply, and acc is rescaled and then accumulated in place by the MMA.

Variants, each a constexpr switch (off: the code above, unchanged):
* WINDOW_LEFT >= 0 (sliding window): row i sees frame keys n >= i + diag - WINDOW_LEFT.
  The key loop starts at the block of the first key the query block's first row sees
  (earlier blocks are never loaded) and runs in three phases: blocks the window's lower
  edge cuts through the query block (masked; their loads stop below that first key, so
  keys no row of the block sees never enter the arithmetic, not even as 0 * NaN), blocks
  every row sees (unmasked), then the diagonal/tail blocks (masked).
* SOFTCAP > 0 (the cap in log2 units, softcap * log2(e)): scores become
  SOFTCAP * tanh(t / SOFTCAP) of the log2-unit score t, tanh as 1 - 2 / (e^2x + 1)
  (+-inf give +-1, NaN stays NaN), before masking; the row max is then taken over the
  capped scores.
* HAS_SINKS: the sink logit of the query head joins the normaliser once, after the key
  loop, against the final row max: l += 2^(sink * log2(e) - m) (times P_SCALE for fp8,
  like the rest of l).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.launch import Launch, bind
from graphsafe.ops.attention.kernels.triton_quant import cast_fp8, descale_of, quantize_values, sequence_bounds
from graphsafe.ops.attention.kernels.triton_softcap import tanh_of_exp2
from graphsafe.ops.attention.fp8_format import P_SCALE

LOG2E = 1.4426950408889634
# V^T rows are read from multiples of KV_ALIGN tokens (16 fp8 bytes: cp.async's widest copy).
KV_ALIGN = 16
_P_LOG2 = tl.constexpr(int(P_SCALE).bit_length() - 1)  # exp2 shift: P_SCALE = 2^_P_LOG2
assert 2.0**_P_LOG2.value == P_SCALE
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _negate_if(x, flip, FP8: tl.constexpr):
    """-x where the scalar `flip` holds, by flipping sign bits (exact, also for fp8,
    which has no arithmetic of its own). x: fp8 if FP8, else bf16/fp16."""
    if FP8:
        sign = tl.where(flip, -128, 0).to(tl.int8)
        return (x.to(tl.int8, bitcast=True) ^ sign).to(x.dtype, bitcast=True)
    else:
        sign = tl.where(flip, -32768, 0).to(tl.int16)
        return (x.to(tl.int16, bitcast=True) ^ sign).to(x.dtype, bitcast=True)


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
def _zero_keys(v, n_mask, offs_n, lead):
    """v (fp8) with the rows of keys outside `n_mask` or before `lead` zeroed, bitwise
    (no arithmetic on fp8)."""
    v_bits = v.to(tl.int8, bitcast=True)
    token_ok = n_mask & (offs_n >= lead)
    return tl.where(token_ok[:, None], v_bits, tl.zeros_like(v_bits)).to(v.dtype, bitcast=True)


@triton.jit
def _key_block(
    acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, lead, k_hi, diag, key_lo, qk_scale,
    stride_kt, stride_vt, stride_vd,
    D: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr,
    KV_ALIGN: tl.constexpr, WINDOW_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Keys [start_n, start_n + BLOCK_N) of the (aligned) key frame, at pointers k_blk,
    v_blk, into the online softmax. MASKED blocks hide keys outside [lead, k_hi), when
    CAUSAL keys past row i's diagonal (n > i + diag) and, with a window (WINDOW_LEFT >= 0),
    keys before row i's window (n < i + diag - WINDOW_LEFT); they load no key below
    `key_lo` (the first key the query block's first row sees; window only). With SOFTCAP,
    `qk_scale` is the tanh argument's scale (see the kernel) and scores are capped before
    the mask."""
    rel_n = tl.arange(0, BLOCK_N)
    offs_n = start_n + rel_n
    n_mask = offs_n < k_hi
    if WINDOW_LEFT >= 0:
        if MASKED:
            n_mask = n_mask & (offs_n >= key_lo)
    offs_da = tl.arange(0, BLOCK_DA)
    s = tl.dot(q_a, _load_kt(k_blk, rel_n, offs_da, stride_kt, n_mask, D, MASKED, BLOCK_DA > D))
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        s = tl.dot(q_b, _load_kt(k_blk, rel_n, offs_db, stride_kt, n_mask, D, MASKED, BLOCK_DA + BLOCK_DB > D), s)
    if SOFTCAP > 0:
        # The capped score in log2 units, SOFTCAP * tanh(t / SOFTCAP) with tanh(x) =
        # 1 - 2 / (2^(x * 2 log2(e)) + 1) (qk_scale folds that factor in): the scale is
        # spent here, and a masked key's -inf comes after the cap.
        s = SOFTCAP * tanh_of_exp2(s * qk_scale)
    # qk_scale > 0 (the kernel folded any sign into q): the row max of the raw scores
    # scaled is the max of the scaled scores, and the exponent is one FMA per score.
    if MASKED:
        visible = n_mask[None, :]
        if KV_ALIGN > 1:
            visible = visible & (offs_n[None, :] >= lead)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        if WINDOW_LEFT >= 0:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + (diag - WINDOW_LEFT))
        s = tl.where(visible, s, float("-inf"))
    if SOFTCAP > 0:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    if FP8:
        # p * P_SCALE straight from the exponent: P's fp8 operand without a multiply.
        m_ref = m_ref - _P_LOG2
    if SOFTCAP > 0:
        p = tl.exp2(s - m_ref[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    offs_dv = tl.arange(0, BLOCK_DV)
    v_ptrs = v_blk + rel_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd
    if MASKED:
        if KV_ALIGN > 1:
            # The load masks whole KV_ALIGN-token groups (V^T rows are token-contiguous, so
            # a per-token mask would break it into byte loads); keys of a neighbouring
            # sequence that it brings in are then zeroed in registers: p = 0 there, but
            # 0 * NaN is not 0, and a neighbour's NaN must not reach this sequence.
            group_ok = (offs_n // KV_ALIGN) * KV_ALIGN < k_hi
            v = tl.load(v_ptrs, mask=group_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if WINDOW_LEFT >= 0:  # key_lo cuts groups anywhere
                v = _zero_keys(v, n_mask, offs_n, lead)
            elif (lead > 0) | (k_hi % KV_ALIGN != 0):  # (sequences on group bounds skip this)
                v = _zero_keys(v, n_mask, offs_n, lead)
        else:
            v = tl.load(v_ptrs, mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    elif BLOCK_DV > DV:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs)
    # Rescale first, then accumulate in place (the MMA adds into acc: no second
    # accumulator tile in registers).
    acc = acc * alpha[:, None]
    if FP8:
        acc = tl.dot(cast_fp8(p, EMULATE), v, acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _varlen_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, qd_ptr, kd_ptr, vd_ptr, sinks_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh,
    stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h,
    qk_scale, num_q_heads, num_m_blocks, total_q, total_k, stride_sinks,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FP8: tl.constexpr, HAS_DESCALE: tl.constexpr, Q_QUANT: tl.constexpr,
    EMULATE: tl.constexpr, KV_ALIGN: tl.constexpr, WINDOW_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Q_QUANT: q is bf16/fp16 and `qd_ptr` holds its amax; the program quantises its own
    query tile once, before the key loop (saving a pass over q, the largest input under
    GQA). KV_ALIGN: see the module docstring (1: keys from k_start itself). Variants
    (module docstring): WINDOW_LEFT (-1: none), SOFTCAP (in log2 units; 0: none),
    HAS_SINKS (`sinks_ptr` [Hq] float32 with stride `stride_sinks`; else a placeholder
    never read)."""
    pid = tl.program_id(0)
    seq_head = pid // num_m_blocks
    m_block = num_m_blocks - 1 - pid % num_m_blocks  # heaviest causal block first
    b = seq_head // num_q_heads
    head = seq_head % num_q_heads
    kv_head = head // GROUP
    # Sequence bounds cut at the tensors' ends (a decreasing cu entry: empty sequence).
    q_start, q_end = sequence_bounds(cu_q_ptr, b, total_q, 128)
    q_len = q_end - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    k_start, k_end = sequence_bounds(cu_k_ptr, b, total_k, 128)
    k_len = k_end - k_start
    kv0 = (k_start // KV_ALIGN) * KV_ALIGN  # a multiple of KV_ALIGN: aligned V^T rows
    lead = k_start - kv0  # frame keys [0, lead) belong to the previous sequence: masked

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
            # The per-tensor quantisation of `fp8.quantize_per_tensor`, bit for bit.
            q_descale, q_inv = descale_of(tl.load(qd_ptr))
            q_a = quantize_values(q_a, q_descale, q_inv, EMULATE)
            if BLOCK_DB > 0:
                q_b = quantize_values(q_b, q_descale, q_inv, EMULATE)
        else:
            q_descale = tl.load(qd_ptr + b * stride_qd_b + kv_head * stride_qd_h)
        qk_scale = qk_scale * q_descale
        qk_scale = qk_scale * tl.load(kd_ptr + b * stride_kd_b + kv_head * stride_kd_h)
    # The key loop wants qk_scale > 0: a negative one (a negative scale or descale) moves
    # its sign into q (exact: a sign-bit flip), and 0 becomes the smallest normal float
    # (scores ~0 either way, and -inf * qk_scale stays -inf for masked keys).
    q_a = _negate_if(q_a, qk_scale < 0, FP8)
    if BLOCK_DB > 0:
        q_b = _negate_if(q_b, qk_scale < 0, FP8)
    # (A NaN descale stays NaN: every score NaN, as in the reference.)
    qk_scale = tl.maximum(tl.abs(qk_scale), _FLT_MIN, propagate_nan=tl.PropagateNan.ALL)
    if SOFTCAP > 0:
        qk_scale = qk_scale * (2 * _LOG2E / SOFTCAP)  # the tanh's exp2 argument per raw score
    k_base = k_ptr + kv0.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + kv0.to(tl.int64) * stride_vt + kv_head * stride_vh

    # Frame keys [lead, k_hi) are the sequence's; row i sees n <= i + diag (bottom-right
    # causal alignment, shifted by lead). Blocks [lo, full_end) are visible to every row
    # of the query block (no mask at all); block 0 when lead > 0 and [full_end, hi) are
    # masked.
    k_hi = k_len + lead
    diag = k_len - q_len + lead
    if CAUSAL:
        hi = tl.maximum(tl.minimum(k_hi, m0 + BLOCK_M + diag), 0)
        full_end = tl.maximum(tl.minimum(k_hi, m0 + diag + 1), 0)
    else:
        hi = k_hi
        full_end = k_hi
    full_end = (full_end // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if WINDOW_LEFT >= 0:
        # Row i sees n >= i + diag - WINDOW_LEFT. key_lo: the first key (of the sequence)
        # row m0 sees; blocks before its block are skipped, never loaded. From `lo` on,
        # every (computed) row's window and the sequence hold the whole block (the lead
        # keys sit in block 0, so lead > 0 puts lo at BLOCK_N or later): blocks before lo
        # are the window's masked edge.
        key_lo = tl.maximum(m0 + diag - WINDOW_LEFT, lead)
        m_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
        lo = tl.cdiv(tl.maximum(m_last + diag - WINDOW_LEFT, lead), BLOCK_N) * BLOCK_N
        first = (key_lo // BLOCK_N) * BLOCK_N
        k_blk = k_base + first.to(tl.int64) * stride_kt
        v_blk = v_base + first.to(tl.int64) * stride_vt
        for start_n in range(first, tl.minimum(lo, hi), BLOCK_N):
            acc, l_i, m_i = _key_block(
                acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, lead, k_hi, diag, key_lo, qk_scale,
                stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
                True, CAUSAL, FP8, EMULATE, KV_ALIGN, WINDOW_LEFT, SOFTCAP,
            )
            k_blk += BLOCK_N * stride_kt
            v_blk += BLOCK_N * stride_vt
        # The unmasked run starts at lo (empty when lo >= full_end); the masked tail
        # right after it.
        k_blk = k_base + lo.to(tl.int64) * stride_kt
        v_blk = v_base + lo.to(tl.int64) * stride_vt
        tail = tl.maximum(full_end, lo)
    else:
        key_lo = lead  # (not read without a window)
        # Block 0 holds keys of the previous sequence when lead > 0: masked, before the
        # unmasked run (when it is not a masked tail block anyway).
        lead_block = (lead > 0) & (full_end > 0)
        lo = tl.where(lead_block, BLOCK_N, 0)
        if KV_ALIGN > 1:
            if lead_block:
                acc, l_i, m_i = _key_block(
                    acc, l_i, m_i, q_a, q_b, k_base, v_base, 0, offs_m, lead, k_hi, diag, key_lo, qk_scale,
                    stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
                    True, CAUSAL, FP8, EMULATE, KV_ALIGN, WINDOW_LEFT, SOFTCAP,
                )
        # Block pointers advance in 64-bit (long sequences overflow int32 offsets); the
        # masked phase continues where the unmasked one stopped (full_end is block aligned,
        # and lo <= full_end: a lead block implies full_end >= BLOCK_N).
        k_blk = k_base + lo * stride_kt
        v_blk = v_base + lo * stride_vt
        tail = full_end
    for start_n in range(lo, full_end, BLOCK_N):
        acc, l_i, m_i = _key_block(
            acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, lead, k_hi, diag, key_lo, qk_scale,
            stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
            False, CAUSAL, FP8, EMULATE, KV_ALIGN, WINDOW_LEFT, SOFTCAP,
        )
        k_blk += BLOCK_N * stride_kt
        v_blk += BLOCK_N * stride_vt
    for start_n in range(tail, hi, BLOCK_N):
        acc, l_i, m_i = _key_block(
            acc, l_i, m_i, q_a, q_b, k_blk, v_blk, start_n, offs_m, lead, k_hi, diag, key_lo, qk_scale,
            stride_kt, stride_vt, stride_vd, D, BLOCK_DA, BLOCK_DB, DV, BLOCK_DV, BLOCK_N,
            True, CAUSAL, FP8, EMULATE, KV_ALIGN, WINDOW_LEFT, SOFTCAP,
        )
        k_blk += BLOCK_N * stride_kt
        v_blk += BLOCK_N * stride_vt

    if HAS_SINKS:
        # The sink joins the normaliser once, against the final row max (0 for a row
        # whose scores are all -inf, as in the reference), in l's units (fp8: P_SCALE).
        sink = tl.load(sinks_ptr + head * stride_sinks) * _LOG2E
        if FP8:
            sink = sink + _P_LOG2
        l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    norm = tl.where(l_i == 0.0, 1.0, l_i)  # a NaN sum (NaN scores) keeps the row NaN
    if HAS_DESCALE:
        acc = acc * tl.load(vd_ptr + b * stride_vd_b + kv_head * stride_vd_h)
    o = acc / norm[:, None]
    # A row that sees no key is 0, decided from indices (a value it does not see may be
    # NaN in a block it shares with rows that see it: p = 0 times NaN). A window never
    # empties a row: its own diagonal key (or, without causal, the last key) is inside.
    if CAUSAL:
        row_sees = (k_len > 0) & (offs_m + (k_len - q_len) >= 0)
    else:
        row_sees = (k_len > 0) & (offs_m >= 0)
    o = tl.where(row_sees[:, None], o, 0.0)
    offs_dv = tl.arange(0, BLOCK_DV)
    out = out_ptr + (q_start + m0).to(tl.int64) * stride_ot + head * stride_oh
    out = out + rel_m[:, None] * stride_ot + offs_dv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))


def _split_head_dim(d: int, min_block: int) -> tuple[int, int]:
    """D = BLOCK_DA (+ BLOCK_DB): a power of two and a power-of-two remainder, each at
    least `min_block` (the dot's smallest K: 16, or 32 for fp8 operands)."""
    block_da = max(min_block, 1 << (d.bit_length() - 1))
    rest = d - block_da
    return block_da, (0 if rest <= 0 else max(min_block, triton.next_power_of_2(rest)))


def bind_varlen(
    q: torch.Tensor, num_seqs: int, num_kv_heads: int, head_dim_v: int,
    k_strides: tuple[int, int], v_strides: tuple[int, int, int], max_seqlen_q: int, scale: float, causal: bool,
    descale_strides: tuple[tuple[int, int], ...] | None, fp8: bool, config: tuple[int, int, int, int],
    emulate: bool, num_k_rows: int, q_quant: bool = False, window_left: int = -1, softcap: float = 0.0,
    sinks_stride: int | None = None,
) -> Launch | None:
    """The forward kernel bound to q's shape and strides and the rest of the call's
    shape: `launch(q, k, v, out, cu_q, cu_k, q_descale, k_descale, v_descale, sinks)` into
    a contiguous `out` [Tq, Hq, Dv] (the caller zeroes its tail: `bind_prepare`).
    `window_left`, `softcap`, `sinks_stride` (None: no sinks): the op's variants
    (constexprs; without sinks pass any tensor of the device for `sinks`). A window of `num_k_rows` keys
    or more holds every key of every sequence (none is longer): it compiles as no window.
    `k_strides` (t, h) of k; `v_strides` (t, h, d) of v (of V^T for fp8).
    `descale_strides`: None (no descales: pass any tensor of the device for them) or
    three (stride_b, stride_h). `q_quant`: q is bf16/fp16 and `q_descale` points at its
    amax. `num_k_rows`: Tk (sequences are cut at the tensors' ends). None when there is
    nothing to compute."""
    hq, d = q.shape[1:]
    block_m, block_n, num_warps, num_stages = config
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    if num_seqs == 0 or num_m_blocks == 0 or hq == 0:
        return None
    block_da, block_db = _split_head_dim(d, 32 if fp8 else 16)
    (sqb, sqh), (skb, skh), (svb, svh) = descale_strides or ((0, 0),) * 3
    vt, vh, vdd = v_strides
    window_left = window_left if window_left < num_k_rows else -1
    return bind(
        _varlen_fwd_kernel, (num_m_blocks * num_seqs * hq,),
        q, q, q, q, q, q, q, q, q, q,  # placeholders: only their device is read
        q.stride(0), q.stride(1), k_strides[0], k_strides[1], vt, vh, vdd, hq * head_dim_v, head_dim_v,
        sqb, sqh, skb, skh, svb, svh,
        scale * LOG2E, hq, num_m_blocks, q.shape[0], num_k_rows, sinks_stride or 0,
        GROUP=hq // num_kv_heads, D=d, BLOCK_DA=block_da, BLOCK_DB=block_db,
        DV=head_dim_v, BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, FP8=fp8, HAS_DESCALE=descale_strides is not None, Q_QUANT=q_quant, EMULATE=emulate,
        KV_ALIGN=KV_ALIGN if fp8 else 1, WINDOW_LEFT=window_left, SOFTCAP=softcap * LOG2E,
        HAS_SINKS=sinks_stride is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
