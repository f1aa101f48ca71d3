"""Triton pieces of the fp8 prefill path: per-tensor amax and quantisation into workspace
buffers, the fp8 cast helper, and the device probe behind `fp8_prefill_supported`.

Quantisation matches `fp8.quantize_per_tensor` bit for bit: `descale = max(amax, EPS) /
448` and `x / descale` use IEEE division (`div_rn`), the cast rounds to nearest even.
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
from graphsafe.ops.attention.fp8 import AMAX_EPS, FP8_MAX

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
    return tl.where(x < 0, -r * quantum, r * quantum)


@triton.jit
def cast_fp8(x, EMULATE: tl.constexpr):
    """fp32 (already within +-448) -> float8e4nv, rounding to nearest even."""
    if EMULATE:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, n_tokens, stride_t, stride_h, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < n_tokens) & (offs_d[None, :] < D)
    src = x_ptr + offs_t[:, None].to(tl.int64) * stride_t + head * stride_h + offs_d[None, :]
    x = tl.load(src, mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _quant_kernel(
    x_ptr, dst_ptr, amax_ptr, descale_ptr, n_tokens,
    stride_t, stride_h, dst_t, dst_h, dst_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, EMULATE: tl.constexpr,
):
    """dst[t, h, d] (any strides: V is written transposed) = fp8(x / descale), or a plain
    copy of fp8 x when not QUANT."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < n_tokens) & (offs_d[None, :] < D)
    src = x_ptr + offs_t[:, None].to(tl.int64) * stride_t + head * stride_h + offs_d[None, :]
    x = tl.load(src, mask=mask, other=0.0)
    if QUANT:
        descale = tl.math.div_rn(tl.maximum(tl.load(amax_ptr), _EPS), _MAX)
        if (pid_t == 0) & (head == 0):
            tl.store(descale_ptr, descale)
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), descale), -_MAX, _MAX)
        x = cast_fp8(x, EMULATE)
    dst = dst_ptr + offs_t[:, None].to(tl.int64) * dst_t + head * dst_h + offs_d[None, :].to(tl.int64) * dst_d
    tl.store(dst, x, mask=mask)


def _tiles(n_tokens: int, d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(max(d, 1))
    block_t = 16 if EMULATE_FP8_CAST else max(16, min(256, 32768 // block_d))
    return block_t, block_d, triton.cdiv(n_tokens, block_t)


def amax_into(x: torch.Tensor, scales: torch.Tensor, slot: int) -> None:
    """`scales[slot] = max(scales[slot], amax(|x|))` for `x` [T, H, D] (zero it first)."""
    t, h, d = x.shape
    if t == 0 or h == 0:
        return
    block_t, block_d, grid_t = _tiles(t, d)
    _amax_kernel[(grid_t, h)](
        x, scales[slot:], t, x.stride(0), x.stride(1), D=d, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=8
    )


def quantize_into(x: torch.Tensor, dst: torch.Tensor, scales: torch.Tensor, slot: int, dst_strides=None) -> None:
    """Quantise `x` [T, H, D] per tensor into `dst` (fp8; `dst_strides` (t, h, d) overrides
    dst's own, e.g. a transposed layout). `scales[slot]` receives amax (must be zero
    beforehand) and `scales[slot + 3]` the descale. Two launches, no host sync."""
    t, h, d = x.shape
    if t == 0 or h == 0:
        return
    amax_into(x, scales, slot)
    block_t, block_d, grid_t = _tiles(t, d)
    amax, descale = scales[slot:], scales[slot + 3:]
    st, sh, sd = dst_strides or dst.stride()
    _quant_kernel[(grid_t, h)](
        x, dst, amax, descale, t, x.stride(0), x.stride(1), st, sh, sd,
        D=d, BLOCK_T=block_t, BLOCK_D=block_d, QUANT=True, EMULATE=EMULATE_FP8_CAST, num_warps=8,
    )


def copy_fp8_into(x: torch.Tensor, dst: torch.Tensor, dst_strides) -> None:
    """Copy fp8 `x` [T, H, D] into `dst` with strides `dst_strides` (t, h, d)."""
    t, h, d = x.shape
    if t == 0 or h == 0:
        return
    block_t, block_d, grid_t = _tiles(t, d)
    st, sh, sd = dst_strides
    _quant_kernel[(grid_t, h)](
        x, dst, x, x, t, x.stride(0), x.stride(1), st, sh, sd,
        D=d, BLOCK_T=block_t, BLOCK_D=block_d, QUANT=False, EMULATE=EMULATE_FP8_CAST, num_warps=8,
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
    _fp8_probe_kernel[(1,)](a, b, p, v, s, o, EMULATE=EMULATE_FP8_CAST, num_warps=4)
    want_s = a.float() @ b.float().t()
    want_o = p @ v.float().t()
    return bool(
        torch.allclose(s, want_s, atol=1e-2, rtol=1e-3) and torch.allclose(o, want_o, atol=1e-2, rtol=1e-3)
    )
