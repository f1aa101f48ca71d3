"""Triton kernel of `fp8_mqa_logits` (prefill logits against contiguous keys). Launched
by `graphsafe/ops/indexer/triton.py`, configured by `graphsafe/ops/indexer/plan.py`.

Compute-bound: a program owns a `[BLOCK_M, BLOCK_N]` logits tile, keeps its K tile
resident and loops over heads (`q[:, h]` tiles stream from L2). Tiles entirely outside
every row's `[ks, ke)` window skip the head loop and only write `-inf` (or, with
`CLEAN=False`, nothing). Devices without fp8 e4m3fn matrix units (`FP8_DOT=False`) read
the fp8 tiles as bytes, decode them to fp16 in registers (exact, `e4m3_bytes_to_f16`) and
use fp16 dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import e4m3_bytes_to_f16

NEG_INF = tl.constexpr(float("-inf"))  # jit code reads only constexpr globals


@triton.jit
def mqa_logits_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N, H,
    stride_qm, stride_qh, stride_kn, stride_ks, stride_wm, stride_wh, stride_out,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_DOT: tl.constexpr, CLEAN: tl.constexpr,
):
    pid_n = tl.program_id(0)  # fastest: neighbouring programs share the q rows (L2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < M
    n_in = offs_n < N
    d_in = offs_d < D
    row_lo = tl.load(ks_ptr + offs_m, mask=m_in, other=2147483647)
    row_hi = tl.load(ke_ptr + offs_m, mask=m_in, other=-2147483648)
    n_start = pid_n * BLOCK_N
    # A tile no row's window reaches costs one -inf store: the head loop runs 0 times.
    live = (n_start < tl.max(row_hi)) & (n_start + BLOCK_N > tl.min(row_lo))
    num_h = tl.where(live, H, 0)
    # tl.where rather than `n_in & live`: Triton's interpreter rejects block & scalar masks.
    n_live = tl.where(live, n_in, False)
    k = tl.load(k_ptr + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=n_live[:, None] & d_in[None, :], other=0.0)
    if not FP8_DOT:  # k holds bytes
        k = e4m3_bytes_to_f16(k)
    k_t = tl.trans(k)
    q_rows = q_ptr + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    q_mask = m_in[:, None] & d_in[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(0, num_h):
        q = tl.load(q_rows + h * stride_qh, mask=q_mask, other=0.0)
        if not FP8_DOT:
            q = e4m3_bytes_to_f16(q)
        w = tl.load(w_ptr + offs_m * stride_wm + h * stride_wh, mask=m_in, other=0.0)
        s = tl.dot(q, k_t)
        # relu(NaN) = NaN, as the reference's clamp_min (tl.maximum drops NaN by default).
        acc += tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]
    scale = tl.load(k_scale_ptr + offs_n * stride_ks, mask=n_live, other=0.0)
    logits = acc * scale[None, :]
    valid = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    if CLEAN:
        tl.store(out, tl.where(valid, logits, NEG_INF), mask=m_in[:, None] & n_in[None, :])
    else:  # a dead tile is outside every row's window: nobody reads it, skip the store
        tl.store(out, tl.where(valid, logits, NEG_INF), mask=tl.where(live, m_in[:, None] & n_in[None, :], False))
