"""Triton backend of the sparse-indexer ops.

`prepare_<op>` runs once per call signature: it plans the launch and binds the kernel
(`graphsafe.launch.bind`); the runner it returns launches with the tensors alone. The
logits kernels also have `prepare_*_into` runners that write a caller's buffer (the
composites bind them on workspace views); `*_into` run them once (tests, benchmarks).

Design notes (H100/H200 targets in the issue):

* `fp8_paged_mqa_logits` is memory-bound: every key byte of every context is read once.
  A program owns a (request, chunk of keys) pair; the grid is sized from shapes and the
  SM count only (CUDA-graph safe), so programs whose chunk lies past the context just
  write `-inf`. The request's queries `q[b]` (next_n x [H, D] fp8) are loaded once per
  program; each key tile `[BLOCK_N, D]` is the A operand of an fp8 `tl.dot` against
  `q[b, i]^T` (`[D, H]`, both K-major as Hopper's fp8 wgmma wants), so the reduction over
  heads runs along the accumulator's N axis: a few in-thread adds and quad shuffles.
  With next_n > 1 each query is its own dot over the same key tile in shared memory:
  stacking the queries into one `[D, next_n*H]` operand would double the live
  accumulator (fewer CTAs per SM, the kernel's real limit: latency hiding) and split the
  head reduction. The key tiles are pipelined by Triton (three buffers); the per-key
  scales are prefetched by hand one tile ahead (see the kernel). `clean=False` leaves
  the -inf columns past each context unwritten (for readers of the valid range only).
* `fp8_mqa_logits` (prefill) is compute-bound: a program owns a `[BLOCK_M, BLOCK_N]`
  logits tile, keeps its K tile resident and loops over heads (`q[:, h]` tiles stream
  from L2). Tiles entirely outside every row's `[ks, ke)` window skip the head loop and
  only write `-inf`.
* Quantisation matches the reference bit for bit: IEEE division (`div_rn`), the UE8M0
  round-up done on the exponent bits, fp32 -> e4m3 rounding done exactly in fp32
  (`round_to_e4m3`; Triton's CPU interpreter rounds some values wrongly otherwise) and
  the byte assembled with integer ops (`e4m3_bits`), so no fp8 type is needed.
* Devices without fp8 e4m3fn matrix units (pre-sm89, MI300's fnuz-only units) read the
  fp8 tiles as bytes, decode them to fp16 in registers (exact, `e4m3_bytes_to_f16`) and
  use fp16 dots. The gather moves bytes. So every kernel runs on every Triton target.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from graphsafe.device_info import has_ocp_e4m3, num_sms
from graphsafe.launch import bind, output_allocator
from graphsafe.kernels.fp8_bits import e4m3_bits, e4m3_bytes_to_f16, round_to_e4m3
from graphsafe.registry import prepared

NEG_INF = tl.constexpr(float("-inf"))  # jit code reads only constexpr globals


@functools.cache
def fp8_dot_supported(device: torch.device) -> bool:
    """Whether tl.dot takes float8e4nv operands on `device`. The CPU interpreter does, but
    its fp8 conversion turns NaN bytes (0x7F/0xFF) into finite values, so it runs the
    byte-decoding fp16 path, which keeps them NaN (tests still force the fp8 path)."""
    return has_ocp_e4m3(device)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def _row_align(*strides: int) -> int:
    """The largest power of two <= 16 dividing every byte offset a row can start at."""
    g = 16
    for s in strides:
        g = math.gcd(g, int(s))
    return g


def _nothing(*args, **kwargs) -> None:
    return None


# -- helpers -----------------------------------------------------------------------------
@triton.jit
def _round_up_pow2(s):
    """2^ceil(log2 s) for positive normal float32 s (UE8M0 scales), from the bits."""
    bits = s.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


# -- indexer_k_quant_and_cache -----------------------------------------------------------
@triton.jit
def _quant_and_cache_kernel(
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
    # explicitly, as the reference's amax does (layout.quantize defines the NaN bits).
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


def prepare_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None):
    t, d = k.shape
    nb, bs, _ = kv_cache.shape
    if t == 0 or nb == 0:
        return _nothing
    g = d // quant_block_size
    block_q = _pow2(quant_block_size)
    block_t = max(1, min(4096 // block_q, 64, _pow2(t)))
    # kv_cache stands for its float32 view here (bind reads only the device).
    launch = bind(
        _quant_and_cache_kernel, (triton.cdiv(t, block_t), g),
        k, kv_cache, kv_cache, slot_mapping,
        t, nb * bs, bs, k.stride(0), kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4,
        D=d, G=g, QB=quant_block_size, BLOCK_T=block_t, BLOCK_Q=block_q, UE8M0=scale_fmt == "ue8m0",
        num_warps=4,
    )

    def run(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None) -> None:
        launch(k, kv_cache, kv_cache.view(torch.float32), slot_mapping)

    return run


# -- cp_gather_indexer_k_quant_cache -----------------------------------------------------
# n_iter is not specialised: at 1 (a batch of one request) Triton unrolls the search loop
# and Triton 3.6's layout pass then fails on the masks below ("arith.select ... expected
# condition type to have the same shape"; found by the demo at B=1 on an H200).
@triton.jit(do_not_specialize=["n_iter"])
def _gather_kernel(
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


def prepare_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    n, d = dst_k.shape
    nb, bs, width = kv_cache.shape
    g = (width - d) // 4
    b, mb = block_table.shape
    if n == 0 or b == 0:  # (no blocks or an empty table: the owned rows get zero rows)
        return _nothing
    block_d = _pow2(d)
    block_r = max(1, min(64, 8192 // block_d, _pow2(n)))
    # kv_cache and dst_k stand for their float32 / uint8 views here (bind reads only the device).
    launch = bind(
        _gather_kernel, (triton.cdiv(n, block_r),),
        kv_cache, kv_cache, dst_k, dst_scale, block_table, cu_seq_lens,
        n, b, nb, mb, bs,
        kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4, block_table.stride(0), dst_k.stride(0),
        dst_scale.stride(0), max(1, b.bit_length()),
        D=d, G=g, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_G=_pow2(g), ROW_ALIGN=_row_align(kv_cache.stride(0), d),
        num_warps=4,
    )

    def run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
        launch(kv_cache, kv_cache.view(torch.float32), dst_k.view(torch.uint8), dst_scale, block_table, cu_seq_lens)

    return run


# -- fp8_mqa_logits (prefill) --------------------------------------------------------------
@triton.jit
def _mqa_logits_kernel(
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


# Runners of the `*_into` helpers, per signature and options: `bind` costs far more than
# a launch, and benchmarks call these helpers in a loop.
# Launch configurations, per device type; the CUDA ones are tuned on an H100/H200 (bench case `fp8_paged_mqa_logits_tune`).
MQA_CONFIG = {
    "cuda": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "cpu": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
}
# Paged decode: `programs_per_sm` sets how many (request, chunk) programs the grid aims
# for; `min_tiles` keeps at least that many key tiles per program so the loads of the
# next tiles overlap the current one's dots (num_stages > 1 needs a loop to pipeline).
# num_stages=5: the key tile's load chain (block id, then keys) takes two stages, so 5
# gives three tile buffers and one more tile in flight while a tile is computed (sm_90,
# Triton 3.9: 3 buffers, 124/156 registers and 59/68 KB of shared memory for next_n 1/2,
# 3 CTAs per SM, i.e. 6 tiles of ~17 KB in flight per SM). num_stages=3 had 2 buffers:
# each tile's copy was issued after the previous tile's math and waited for in full, and
# next_n=2 (150 registers) ran 3 CTAs per SM against next_n=1's 4 (114): measured 53%
# and 69% of copy bandwidth, near that 3:4 ratio.
PAGED_CONFIG = {
    "cuda": dict(BLOCK_N=128, num_warps=4, num_stages=5, programs_per_sm=8, min_tiles=2),
    "cpu": dict(BLOCK_N=16, num_warps=4, num_stages=1, programs_per_sm=1, min_tiles=1),
}


def _config(table: dict, device: torch.device, overrides: dict | None) -> dict:
    cfg = dict(table["cuda" if device.type == "cuda" else "cpu"])
    cfg.update(overrides or {})
    return cfg


def _mqa_logits_runner(q, k, k_scale, weights, out_stride: int, fp8_dot: bool | None, config: dict | None,
                       clean: bool):
    """`run(out, q, k, k_scale, weights, ks, ke)` for this signature, `out` of row stride `out_stride`."""
    m, h, d = q.shape
    n = k.shape[0]
    if m == 0 or n == 0:
        return _nothing
    cfg = _config(MQA_CONFIG, q.device, config)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    fp8_dot = fp8_dot_supported(q.device) if fp8_dot is None else fp8_dot
    # q stands for ks, ke and out here (bind reads only the device); the uint8 views that
    # the fp16 path passes have the strides of the fp8 tensors.
    launch = bind(
        _mqa_logits_kernel, grid,
        q, k, k_scale, weights, q, q, q,
        m, n, h,
        q.stride(0), q.stride(1), k.stride(0), k_scale.stride(0), weights.stride(0), weights.stride(1), out_stride,
        D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(d, 32), FP8_DOT=fp8_dot, CLEAN=clean,
        **cfg,
    )
    if fp8_dot:
        def run(out, q, k, k_scale, weights, ks, ke) -> None:
            launch(q, k, k_scale, weights, ks, ke, out)
    else:  # the kernel decodes the bytes itself (no fp8 type needed on the target)
        def run(out, q, k, k_scale, weights, ks, ke) -> None:
            launch(q.view(torch.uint8), k.view(torch.uint8), k_scale, weights, ks, ke, out)
    return run


def prepare_fp8_mqa_logits(q, k, k_scale, weights, ks, ke):
    m, n = q.shape[0], k.shape[0]
    device = q.device
    fill = _mqa_logits_runner(q, k, k_scale, weights, n, None, None, True)  # a fresh [M, N] output
    new_out = output_allocator((m, n), torch.float32, device)

    def run(q, k, k_scale, weights, ks, ke):
        out = new_out()
        fill(out, q, k, k_scale, weights, ks, ke)
        return out

    return run


def prepare_mqa_logits_into(
    out, q, k, k_scale, weights, ks, ke, *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
):
    """`run(out, q, k, k_scale, weights, ks, ke)`, which writes every element of `out`
    `[M, N]`, for tensors of this signature; `fp8_dot`/`config` override the device choice
    (tests).

    `clean=False` (the composite: the top-k reads only the windows) skips the tiles
    outside every row's window; the rest of those tiles' rows is still -inf."""
    return _mqa_logits_runner(q, k, k_scale, weights, out.stride(0), fp8_dot, config, clean)


def mqa_logits_into(
    out, q, k, k_scale, weights, ks, ke, *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
) -> None:
    """`prepare_mqa_logits_into(...)` run once; the runner is kept per signature and options."""
    args = (out, q, k, k_scale, weights, ks, ke)
    prepared(prepare_mqa_logits_into, *args, fp8_dot=fp8_dot, config=config, clean=clean)(*args)


# -- fp8_paged_mqa_logits (decode) ---------------------------------------------------------
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
def _paged_mqa_logits_kernel(
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


def paged_grid(
    batch: int, max_model_len: int, block_n: int, device: torch.device, programs_per_sm: int, min_tiles: int = 1
) -> tuple[int, int]:
    """(chunk, chunks per request): from shapes and the SM count only (graph-safe).

    Enough chunks that `batch * chunks` reaches `programs_per_sm` programs per SM (many
    short programs balance uneven contexts), each a whole number of key tiles, at least
    `min_tiles` of them.
    """
    tiles = triton.cdiv(max_model_len, block_n)
    per_row = max(1, min(tiles, triton.cdiv(programs_per_sm * num_sms(device), max(batch, 1))))
    chunk = max(triton.cdiv(tiles, per_row), min_tiles) * block_n
    return chunk, triton.cdiv(max_model_len, chunk)


def _paged_mqa_logits_runner(q, kv_cache, weights, block_table, max_model_len: int, out_stride: int,
                             fp8_dot: bool | None, config: dict | None, clean: bool):
    """`run(out, q, kv_cache, weights, context_lens, block_table, max_model_len)` for this
    signature (q `[B, next_n, H, D]`), `out` of row stride `out_stride`."""
    b, next_n, h, d = q.shape
    if b == 0:
        return _nothing
    bs = kv_cache.shape[1]
    cfg = _config(PAGED_CONFIG, q.device, config)
    block_n = cfg.pop("BLOCK_N")
    chunk, chunks = paged_grid(b, max_model_len, block_n, q.device, cfg.pop("programs_per_sm"), cfg.pop("min_tiles"))
    fp8_dot = fp8_dot_supported(q.device) if fp8_dot is None else fp8_dot
    # Tensors stand for the views passed at run time (bind reads only the device).
    launch = bind(
        _paged_mqa_logits_kernel, (b, chunks),
        q, kv_cache, kv_cache, weights, weights, block_table, weights,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4, block_table.stride(0), out_stride,
        max_model_len, chunk, kv_cache.shape[0],
        H=h, D=d, BS=bs, NEXT_N=next_n, BLOCK_H=_pow2(h, 16), BLOCK_D=_pow2(d, 32), BLOCK_N=block_n,
        FP8_DOT=fp8_dot, ROW_ALIGN=_row_align(kv_cache.stride(0), d), CLEAN=clean,
        **cfg,
    )
    # A launch reads only each tensor's address and dtype (the strides are bound above), so
    # run takes q in any shape of the same memory: the decode composite passes its [T, H, D].
    if fp8_dot:
        def run(out, q, kv_cache, weights, context_lens, block_table, max_model_len) -> None:
            launch(q, kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32), weights, context_lens,
                   block_table, out)
    else:  # the kernel reads bytes and decodes them (no fp8 type on the target)
        def run(out, q, kv_cache, weights, context_lens, block_table, max_model_len) -> None:
            launch(q.view(torch.uint8), kv_cache, kv_cache.view(torch.float32), weights, context_lens, block_table, out)
    return run


def prepare_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_model_len):
    b, next_n = q.shape[:2]
    device = q.device
    fill = _paged_mqa_logits_runner(q, kv_cache, weights, block_table, max_model_len, max_model_len, None, None, True)
    new_out = output_allocator((b * next_n, max_model_len), torch.float32, device)

    def run(q, kv_cache, weights, context_lens, block_table, max_model_len):
        out = new_out()
        fill(out, q, kv_cache, weights, context_lens, block_table, max_model_len)
        return out

    return run


def prepare_paged_mqa_logits_into(
    out, q, kv_cache, weights, context_lens, block_table, max_model_len,
    *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
):
    """`run(out, q, kv_cache, weights, context_lens, block_table, max_model_len)`, which writes
    every element of `out` `[B*next_n, max_model_len]`, for tensors of this signature;
    `fp8_dot`/`config` override the device choice (tests use them for the fp16 path and
    many small chunks).

    `clean=False` (the composite: the top-k reads only each row's valid range) writes the
    key tiles below each context only, not the -inf tail up to `max_model_len`."""
    return _paged_mqa_logits_runner(q, kv_cache, weights, block_table, max_model_len, out.stride(0),
                                    fp8_dot, config, clean)


def paged_mqa_logits_into(
    out, q, kv_cache, weights, context_lens, block_table, max_model_len,
    *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
) -> None:
    """`prepare_paged_mqa_logits_into(...)` run once; the runner is kept per signature and options."""
    args = (out, q, kv_cache, weights, context_lens, block_table, max_model_len)
    prepared(prepare_paged_mqa_logits_into, *args, fp8_dot=fp8_dot, config=config, clean=clean)(*args)


# -- req_local_to_global_slots -------------------------------------------------------------
@triton.jit
def _req_local_to_global_kernel(
    req_ptr, bt_ptr, idx_ptr, out_ptr,
    num_reqs, max_blocks, K, stride_bt, stride_it, stride_ik, stride_out,
    BS: tl.constexpr, BLOCK_K: tl.constexpr, LAST_BLOCK_ID: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < K
    req = tl.load(req_ptr + t)
    pos = tl.load(idx_ptr + t * stride_it + offs * stride_ik, mask=kmask, other=-1)
    logical = pos // BS
    valid = tl.where((req >= 0) & (req < num_reqs), (pos >= 0) & (logical < max_blocks), False)
    req_c = tl.where((req >= 0) & (req < num_reqs), req, 0).to(tl.int64)
    blk = tl.load(bt_ptr + req_c * stride_bt + tl.where(valid, logical, 0), mask=kmask & valid, other=-1)
    # A block id outside [0, 2^31 // BS) (padding -1) has no int32 slot: -1.
    valid = valid & (blk >= 0) & (blk <= LAST_BLOCK_ID)
    slot = blk.to(tl.int64) * BS + pos % BS
    tl.store(out_ptr + t * stride_out + offs, tl.where(valid, slot, -1).to(tl.int32), mask=kmask)


def prepare_req_local_to_global_slots(req_id_per_token, block_table, topk_indices, block_size):
    t, k = topk_indices.shape
    b, mb = block_table.shape
    device = topk_indices.device
    if t == 0 or k == 0:
        def run(req_id_per_token, block_table, topk_indices, block_size):
            return torch.empty((t, k), dtype=torch.int32, device=device)
        return run
    if b == 0 or mb == 0:
        def run(req_id_per_token, block_table, topk_indices, block_size):
            return torch.full((t, k), -1, dtype=torch.int32, device=device)
        return run
    block_k = min(1024, _pow2(k, 16))
    # topk_indices stands for the output here (bind reads only the device); the output is
    # a fresh contiguous [T, K].
    launch = bind(
        _req_local_to_global_kernel, (t, triton.cdiv(k, block_k)),
        req_id_per_token, block_table, topk_indices, topk_indices,
        b, mb, k, block_table.stride(0), topk_indices.stride(0), topk_indices.stride(1), k,
        BS=block_size, BLOCK_K=block_k, LAST_BLOCK_ID=2**31 // block_size - 1, num_warps=4,
    )

    new_out = output_allocator((t, k), torch.int32, device)

    def run(req_id_per_token, block_table, topk_indices, block_size):
        out = new_out()
        launch(req_id_per_token, block_table, topk_indices, out)
        return out

    return run
