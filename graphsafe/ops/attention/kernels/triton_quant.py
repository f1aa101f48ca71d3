"""Triton pieces of the fp8 prefill path: per-tensor amax and quantisation into workspace
buffers, the fp8 cast helper, and the device probe behind `fp8_prefill_supported`.

Launches of the fp8 path (bf16/fp16 inputs), each bound once per call signature by a
`bind_*` function here (`graphsafe.launch.bind`): `bind_prepare` (zero the output tail and
reset the scale slots), `bind_amax` (amax of q, k and v, one pass each, one launch, float
atomic max), `bind_quantize_kv` (k and V^T into the workspace, one launch), then the
attention kernel, which quantises each query tile once, from q's amax. fp8 inputs skip
the amax and k: `bind_quantize_kv(..., quant=False)` only builds V^T.

Quantisation matches `fp8.quantize_per_tensor` bit for bit: `descale = max(amax, EPS) /
448` uses IEEE division (`div_rn`), and so does `x / descale` in effect: each element
takes a multiply by the correctly rounded reciprocal and one FMA correction step
(Markstein's), three instructions instead of a full division (about fifteen, with a
slow-path check) per element. For finite inputs this is the correctly rounded quotient:
checked exactly (rational arithmetic) for every bf16 and every fp16 input against every
bf16 / fp16 amax mantissa; the tests compare it with torch's division bit for bit. The
cast rounds to nearest even.
Triton's CPU interpreter (3.9) casts fp32 -> e4m3 wrongly (it drops the carry into the
next binade: 31.8 -> 16, and flushes subnormals), so under the interpreter `cast_fp8`
first rounds in fp32 (exact bit arithmetic) and then casts a value the interpreter
converts exactly. On GPUs the hardware conversion (round-to-nearest-even) is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.backends import triton_interpreter_enabled
from graphsafe.device_info import num_sms
from graphsafe.launch import Launch, bind
from graphsafe.ops.attention.fp8_format import (
    AMAX_EPS,
    AMAX_K,
    AMAX_Q,
    AMAX_V,
    DESCALE_K,
    DESCALE_Q,
    DESCALE_V,
    FP8_MAX,
    ONE,
    SCALE_SLOTS,
    vt_columns,
)

EMULATE_FP8_CAST = triton_interpreter_enabled()
_EPS = tl.constexpr(AMAX_EPS)
_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32."""
    ax = tl.abs(x)
    exponent = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3 subnormals share the quantum of 2^-6's binade
    # quantum = 2^(exponent - 3): 3 mantissa bits; built from bits so scaling is exact.
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)
    y = ax * inv_quantum
    r = tl.floor(y + 0.5)
    tie_to_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    r = tl.where(tie_to_odd, r - 1.0, r)
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0
    return tl.where(negative, -(r * quantum), r * quantum)


@triton.jit
def cast_fp8(x, EMULATE: tl.constexpr):
    """fp32 (already within +-448) -> float8e4nv, rounding to nearest even."""
    if EMULATE:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


# The scale slots of the fp8 path's float32 scratch (fp8_format.SCALE_SLOTS), as constexprs.
_SCALE_SLOTS = tl.constexpr(SCALE_SLOTS)
_AMAX_Q = tl.constexpr(AMAX_Q)
_AMAX_K = tl.constexpr(AMAX_K)
_AMAX_V = tl.constexpr(AMAX_V)
_DESCALE_K = tl.constexpr(DESCALE_K)
_DESCALE_V = tl.constexpr(DESCALE_V)
_ONE = tl.constexpr(ONE)
_DESCALE_Q = tl.constexpr(DESCALE_Q)


@triton.jit
def _tile_absmax(
    x_ptr, n_tokens, n_heads, stride_t, stride_h, pid, nprog,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """max |x| over the tiles (BLOCK_T tokens of one head) of x [T, H, D] that program
    `pid` of `nprog` owns (grid-stride). The running max stays elementwise: one
    reduction at the end, not one per tile."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    run = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    n_tiles = tl.cdiv(n_tokens, BLOCK_T) * n_heads
    for tile in range(pid, n_tiles, nprog):
        t_tile = tile // n_heads  # one division per tile, not per row
        h = tile - t_tile * n_heads
        t = t_tile * BLOCK_T + offs_t
        src = x_ptr + h.to(tl.int64) * stride_h + t[:, None].to(tl.int64) * stride_t + offs_d[None, :]
        x = tl.load(src, mask=(t < n_tokens)[:, None] & (offs_d[None, :] < D), other=0.0)
        ax = tl.abs(x.to(tl.float32))
        # NaN counts as inf (max ignores NaN on GPUs): a non-finite amax -> descale NaN.
        run = tl.maximum(run, tl.where(ax == ax, ax, float("inf")))
    return tl.max(tl.max(run, axis=1), axis=0)


@triton.jit
def _amax_kernel(
    q_ptr, k_ptr, v_ptr, scales_ptr, tq, tk, hq, hk,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """amax(|q|), amax(|k|), amax(|v|) in one launch: every program reduces its share of
    each tensor and folds it into the slots with one float atomic max each (|x| >= 0,
    so the float order is the integer order of the bits)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    aq = _tile_absmax(q_ptr, tq, hq, sq_t, sq_h, pid, nprog, D, BLOCK_T, BLOCK_D)
    tl.atomic_max(scales_ptr + _AMAX_Q, aq)
    ak = _tile_absmax(k_ptr, tk, hk, sk_t, sk_h, pid, nprog, D, BLOCK_T, BLOCK_D)
    tl.atomic_max(scales_ptr + _AMAX_K, ak)
    av = _tile_absmax(v_ptr, tk, hk, sv_t, sv_h, pid, nprog, DV, BLOCK_T, BLOCK_DV)
    tl.atomic_max(scales_ptr + _AMAX_V, av)


@triton.jit
def descale_of(amax):
    """`max(amax, EPS) / 448` (IEEE division) and its correctly rounded reciprocal; NaN
    for an amax of inf (the amax kernel counts NaN as inf), as `fp8.quantize_per_tensor`."""
    descale = tl.math.div_rn(tl.maximum(amax, _EPS), _MAX)
    descale = tl.where(amax < float("inf"), descale, float("nan"))
    return descale, tl.math.div_rn(1.0, descale)


@triton.jit
def quantize_values(x, descale, inv_descale, EMULATE: tl.constexpr):
    """fp8(clamp(x / descale, +-448)), x / descale correctly rounded: q = x * (1/d) is
    within about an ulp, r = x - q * d is one FMA, q + r * (1/d) rounds to the quotient
    (see the module docstring). Zeros keep their sign (the FMAs would give +0); a NaN
    descale or x gives NaN (torch's `x / descale` then clamp)."""
    x = x.to(tl.float32)
    q = x * inv_descale
    r = tl.fma(q, 0.0 - descale, x)
    q = tl.fma(r, inv_descale, q)
    q = tl.where(x == 0.0, x * inv_descale, q)
    return cast_fp8(tl.clamp(q, -_MAX, _MAX, propagate_nan=tl.PropagateNan.ALL), EMULATE)


@triton.jit
def _quantize(x, amax_ptr, QUANT: tl.constexpr, EMULATE: tl.constexpr):
    """fp8(x / descale) with `descale = max(amax, EPS) / 448` (bit for bit
    `fp8.quantize_per_tensor`); x itself (already fp8) when not QUANT."""
    if QUANT:
        descale, inv_descale = descale_of(tl.load(amax_ptr))
        x = quantize_values(x, descale, inv_descale, EMULATE)
    return x


@triton.jit
def _quantize_rows(x_ptr, x8_ptr, amax_ptr, t, head, n_tokens, n_heads, s_t, s_h,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """Tokens `t` of one head of x [T, H, D] (strides s_t, s_h) quantised per tensor from
    the amax at `amax_ptr` into x8 [T, H, D] (contiguous); tokens past n_tokens skipped."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (t < n_tokens)[:, None] & (offs_d[None, :] < D)
    src = x_ptr + t[:, None].to(tl.int64) * s_t + head * s_h + offs_d[None, :]
    x8 = _quantize(tl.load(src, mask=mask, other=0.0), amax_ptr, True, EMULATE)
    tl.store(x8_ptr + (t[:, None].to(tl.int64) * n_heads + head) * D + offs_d[None, :], x8, mask=mask)


@triton.jit
def _quant_kv_kernel(
    k_ptr, v_ptr, k8_ptr, vt_ptr, scales_ptr, n_tokens, n_heads, n_k_tiles,
    sk_t, sk_h, sv_t, sv_h, vt_h, vt_d,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr, EMULATE: tl.constexpr,
):
    """One launch for both operands of the attention kernel. Programs [0, n_k_tiles) of
    axis 0 quantise a tile of BLOCK_T tokens of k (one head: axis 1) into k8 [T, H, D]
    (contiguous); the rest write a tile of v, quantised (QUANT) or copied (fp8 inputs),
    transposed into V^T rows `vt[h, d, t]` (token-contiguous; columns [T, T_pad) get 0,
    so the attention kernel may read whole 16-token groups)."""
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if QUANT:
        if (pid == 0) & (head == 0):
            tl.store(scales_ptr + _DESCALE_K, descale_of(tl.load(scales_ptr + _AMAX_K))[0])
            tl.store(scales_ptr + _DESCALE_V, descale_of(tl.load(scales_ptr + _AMAX_V))[0])
    offs = tl.arange(0, BLOCK_T)
    # (Names differ between the branches: the compiler wants one type per name.)
    if pid < n_k_tiles:
        if QUANT:  # fp8 inputs: k is used as given
            _quantize_rows(k_ptr, k8_ptr, scales_ptr + _AMAX_K, pid * BLOCK_T + offs, head, n_tokens, n_heads,
                           sk_t, sk_h, D, BLOCK_D, EMULATE)
    else:
        tv = (pid - n_k_tiles) * BLOCK_T + offs
        offs_dv = tl.arange(0, BLOCK_DV)
        v_src = v_ptr + tv[:, None].to(tl.int64) * sv_t + head * sv_h + offs_dv[None, :]
        v8 = tl.load(v_src, mask=(tv < n_tokens)[:, None] & (offs_dv[None, :] < DV), other=0.0)
        v8 = _quantize(v8, scales_ptr + _AMAX_V, QUANT, EMULATE)
        # [BLOCK_DV, BLOCK_T] with t contiguous: the store goes out in 16-byte rows.
        vt_dst = vt_ptr + head * vt_h + offs_dv[:, None].to(tl.int64) * vt_d + tv[None, :]
        tl.store(vt_dst, tl.trans(v8), mask=(offs_dv[:, None] < DV) & (tv[None, :] < vt_d))


@triton.jit
def _quant_q_kernel(
    q_ptr, q8_ptr, scales_ptr, n_tokens, n_heads, sq_t, sq_h,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr,
):
    """q -> q8 [T, H, D] (contiguous), quantised per tensor from the q amax slot, a tile
    of BLOCK_T tokens of one head (axis 1) per program; program (0, 0) stores the q
    descale. For the sm_90 fp8 kernel, whose q comes by TMA from memory (the Triton
    kernel quantises its own q tile instead)."""
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if (pid == 0) & (head == 0):
        tl.store(scales_ptr + _DESCALE_Q, descale_of(tl.load(scales_ptr + _AMAX_Q))[0])
    _quantize_rows(q_ptr, q8_ptr, scales_ptr + _AMAX_Q, pid * BLOCK_T + tl.arange(0, BLOCK_T), head, n_tokens,
                   n_heads, sq_t, sq_h, D, BLOCK_D, EMULATE)


def bind_quantize_q(q: torch.Tensor) -> Launch | None:
    """`_quant_q_kernel` bound to q's shape and strides: `launch(q, q8, scales)` writes
    q8 (contiguous, float8_e4m3fn) and scales[DESCALE_Q] (the amax launch first). None
    when q has no element."""
    tq, hq, d = q.shape
    if tq * hq * d == 0:
        return None
    block_t = 16 if EMULATE_FP8_CAST else 64
    return bind(
        _quant_q_kernel, (triton.cdiv(tq, block_t), hq), q, q, q, tq, hq, q.stride(0), q.stride(1),
        D=d, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(d), EMULATE=EMULATE_FP8_CAST, num_warps=4,
    )


@triton.jit
def _running_max(cu_ptr, n, CHUNK: tl.constexpr):
    """max(cu[0 .. n)) of int32 `cu` (n >= 1), CHUNK entries per step."""
    top = tl.load(cu_ptr)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        top = tl.maximum(top, tl.max(tl.load(cu_ptr + offs, mask=offs < n, other=-2147483648), axis=0))
    return top


@triton.jit
def sequence_bounds(cu_ptr, b, total, CHUNK: tl.constexpr):
    """Rows `[start, end)` of sequence b: `reference.sequence_bounds`, the running maximum
    of cu_seqlens clamped to `[0, total]`. Never outside the tensor, whatever cu holds."""
    start = _running_max(cu_ptr, b + 1, CHUNK)
    end = tl.maximum(start, tl.load(cu_ptr + b + 1))
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, 0), total)
    return start, end


@triton.jit
def _prepare_kernel(
    out_ptr, cu_q_ptr, scales_ptr, batch, n_rows, row_len,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """Rows of contiguous `out` outside every sequence (before the first sequence's start
    or at or past the last one's end, `sequence_bounds`) get 0, and
    (HAS_SCALES) program 0 resets the scale slots: amax slots 0 (atomic max targets), the
    ONE slot 1.0. The attention kernel later writes every other row."""
    pid = tl.program_id(0)
    if HAS_SCALES:
        if pid == 0:
            slots = tl.arange(0, _SCALE_SLOTS)
            tl.store(scales_ptr + slots, tl.where(slots == _ONE, 1.0, 0.0))
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.minimum(tl.maximum(tl.load(cu_q_ptr), 0), n_rows)
    last = tl.minimum(tl.maximum(_running_max(cu_q_ptr, batch + 1, 128), 0), n_rows)
    rows_mask = ((rows < first) | (rows >= last)) & (rows < n_rows)
    if tl.sum(rows_mask.to(tl.int32), axis=0) > 0:
        for c0 in range(0, row_len, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ptrs = out_ptr + rows[:, None].to(tl.int64) * row_len + cols[None, :]
            zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=out_ptr.dtype.element_ty)
            tl.store(ptrs, zeros, mask=rows_mask[:, None] & (cols[None, :] < row_len))


def bind_prepare(like: torch.Tensor, num_seqs: int, n_rows: int, row_len: int, has_scales: bool) -> Launch | None:
    """`_prepare_kernel` bound for a contiguous output of `n_rows` rows of `row_len`
    elements and `num_seqs` sequences: `launch(out, cu_q, scales)` zeroes the rows outside
    every sequence (before the first, at or past the last: bounds read on the device)
    and, with `has_scales`, resets `scales` (float32 [SCALE_SLOTS]; without, pass any
    tensor there, e.g. `out`). At least one
    program when `has_scales` (the reset always happens); None when there is nothing to
    do. `like`: any tensor of the device (placeholder for the tensor arguments)."""
    if not has_scales and (n_rows == 0 or row_len == 0):
        return None
    return bind(
        _prepare_kernel, (max(1, triton.cdiv(n_rows, 64)),),
        like, like, like, num_seqs, n_rows, row_len, BLOCK_R=64,
        BLOCK_C=min(1024, triton.next_power_of_2(max(row_len, 1))), HAS_SCALES=has_scales,
    )


def _programs(device: torch.device, tiles: int) -> int:
    """Grid of the grid-stride amax: a few programs per SM, all resident at once (enough
    loads in flight to stream at full bandwidth, no second wave), never more than there
    are tiles."""
    per_device = 6 * num_sms(device) if device.type == "cuda" else 3
    return max(1, min(per_device, tiles))


def bind_amax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Launch:
    """`_amax_kernel` bound to the shapes and strides of q, k, v [T, H, D]:
    `launch(q, k, v, scales)` sets `scales[AMAX_*] = max(scales[AMAX_*], amax(|x|))` for
    the three in one launch (reset the slots first: the prepare kernel)."""
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    block_d, block_dv = triton.next_power_of_2(max(d, 1)), triton.next_power_of_2(max(dv, 1))
    # 8 KiB of bf16 per tile (4 warps: 64 bytes per thread per tile, four 16-byte loads);
    # 6 programs per SM (~64 registers each: all resident) keep ~48 KiB in flight per SM.
    block_t = 16 if EMULATE_FP8_CAST else max(16, 4096 // max(block_d, block_dv))
    tiles = max(triton.cdiv(tq, block_t) * hq, triton.cdiv(tk, block_t) * hk)
    return bind(
        _amax_kernel, (_programs(q.device, tiles),),
        q, k, v, q, tq, tk, hq, hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        D=d, DV=dv, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=4,
    )


def bind_quantize_kv(k: torch.Tensor, v: torch.Tensor, quant: bool = True) -> Launch | None:
    """`_quant_kv_kernel` bound to the shapes and strides of k [Tk, Hk, D], v [Tk, Hk, Dv]:
    `launch(k, v, k8, vt, scales)` writes k -> k8 [Tk, Hk, D] (contiguous) and v -> V^T
    `vt` [Hk, Dv, Tk_pad] (contiguous, Tk_pad = `vt_columns(Tk)`), quantised per tensor
    from the amax slots (the amax launch first; the descales land in
    scales[DESCALE_K/V]). `quant=False` (fp8 inputs): only V^T, a transposed copy of v;
    k and k8 are not touched (pass `vt` for k8). None when there is nothing to write."""
    tk, hk, d = k.shape
    dv = v.shape[2]
    if hk == 0 or tk == 0:
        return None
    columns = vt_columns(tk)
    block_d, block_dv = triton.next_power_of_2(max(d, 1)), triton.next_power_of_2(max(dv, 1))
    block_t = 16 if EMULATE_FP8_CAST else 64
    k_tiles = triton.cdiv(tk, block_t) if quant else 0
    v_tiles = triton.cdiv(columns, block_t)
    return bind(
        _quant_kv_kernel, (k_tiles + v_tiles, hk),
        k, v, k, k, k, tk, hk, k_tiles,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), dv * columns, columns,  # vt's strides
        D=d, DV=dv, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, QUANT=quant, EMULATE=EMULATE_FP8_CAST,
        num_warps=4,
    )


# -- the probe ----------------------------------------------------------------------------
@triton.jit
def _fp8_probe_kernel(a_ptr, b_ptr, p_ptr, v_ptr, s_ptr, o_ptr, EMULATE: tl.constexpr):
    """The attention kernel's two fp8 products at its tile shapes' granularity (M = 64:
    one warpgroup, the wgmma path on Hopper), with its operand layouts."""
    rm = tl.arange(0, 64)
    rk = tl.arange(0, 32)
    a = tl.load(a_ptr + rm[:, None] * 32 + rk[None, :])  # [64, 32] fp8, like q
    bt = tl.load(b_ptr + rm[None, :] * 32 + rk[:, None])  # [32, 64] fp8, K-major like K^T
    tl.store(s_ptr + rm[:, None] * 64 + rm[None, :], tl.dot(a, bt))
    p = cast_fp8(tl.load(p_ptr + rm[:, None] * 64 + rm[None, :]), EMULATE)  # in-kernel fp32 -> fp8
    v = tl.load(v_ptr + rm[:, None] + rk[None, :] * 64)  # [64, 32] fp8, token-contiguous like V^T
    tl.store(o_ptr + rm[:, None] * 32 + rk[None, :], tl.dot(p, v))


def run_fp8_probe(device: torch.device) -> bool:
    """Compile and run a tiny fp8 kernel (both products of the attention kernel, and an
    in-kernel fp32 -> fp8 cast); True when it gives the right answer."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(64, 32, generator=gen).to(torch.float8_e4m3fn)
    p = torch.rand(64, 64, generator=gen).to(torch.float8_e4m3fn).float()  # exactly representable
    v = torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn)  # V^T: [Dv, tokens]
    s = torch.empty(64, 64, device=device)
    o = torch.empty(64, 32, device=device)
    a, b, p, v = (x.to(device) for x in (a, b, p, v))
    # Run once per device (fp8_prefill_supported caches the answer): no binding to keep.
    _fp8_probe_kernel[(1,)](  # graphsafe: plain-launch (one-time probe)
        a, b, p, v, s, o, EMULATE=EMULATE_FP8_CAST, num_warps=4,
    )
    want_s = a.float() @ b.float().t()
    want_o = p @ v.float().t()
    return bool(
        torch.allclose(s, want_s, atol=1e-2, rtol=1e-3) and torch.allclose(o, want_o, atol=1e-2, rtol=1e-3)
    )
