"""float8_e4m3fn bytes from float32 and back, with integer and fp32 ops only, inside Triton kernels;
and float32 -> bfloat16 rounding on the bits (the interpreter's conversion truncates).

Kernels that write fp8 caches round explicitly instead of `.to(tl.float8e4nv)`: Triton's
CPU interpreter rounds that conversion wrongly near exponent boundaries (the tests compare
the bytes with torch's bit for bit), and MI300's Triton has only the fnuz fp8 types. The
results equal torch's `.to(torch.float8_e4m3fn)` for values within +-448.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals read inside @triton.jit code must be constexpr objects.
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def bf16_rounded_bits(x):
    """The int32 bits of float32 `x` rounded to the nearest bfloat16 (ties to even,
    overflow to +-inf, subnormals kept): the low 16 bits clear, the high 16 the bfloat16,
    as torch's `.to(torch.bfloat16)` gives for every non-NaN `x` (callers choose the NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536


@triton.jit
def round_to_e4m3(y):
    """Round float32 `y` (|y| <= 448) to the nearest-even e4m3 value, exactly, in fp32.

    Adding then subtracting 1.5 * 2^(e+20) rounds |y| to a multiple of its e4m3 ulp
    2^(e-3) with fp32's round-to-nearest-even (e = the binade of |y|, at least -6, the
    subnormal spacing). The sign is reapplied from the bits so -0.0 stays -0.0.
    """
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (a + magic) - magic
    # OR the sign bit back in: `-r` compiles to `0 - r` on the GPU, which turns -0.0
    # into +0.0 (seen on an H200: 163 of 2.1M bytes were 0x00 instead of 0x80).
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(r):
    """The e4m3fn byte of float32 `r`, which must already be an e4m3 value (`round_to_e4m3`).

    Integer ops only: no fp8 conversion instruction is needed, so the kernel writes the
    same bytes on every target (MI300's Triton has only fnuz fp8 types).
    """
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(r)
    abits = a.to(tl.int32, bitcast=True)
    exp = (abits >> 23) - 127
    normal = ((exp + 7) << 3) | ((abits >> 20) & 7)
    subnormal = (a * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6 (and zero)
    return (sign | tl.where(exp >= -6, normal, subnormal)).to(tl.uint8)


@triton.jit
def e4m3_byte(y):
    """The float8_e4m3fn byte torch's `y.clamp(-448, 448).to(torch.float8_e4m3fn)` gives
    for float32 `y`: saturated to +-448 (+-inf too), round-to-nearest-even, NaN -> 0x7F
    with the sign of `y` (0xFF for a negative NaN). Integer ops only, no fp8 type."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    nan = y != y
    # NaN is set aside first: min/max of a NaN differ between targets.
    c = tl.where(nan, 0.0, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    return tl.where(nan, sign | 0x7F, e4m3_bits(round_to_e4m3(c)).to(tl.int32)).to(tl.uint8)


@triton.jit
def e4m3_bytes_to_f16(b):
    """float16 values of e4m3fn bytes, exactly, with integer ops only (0x7F/0xFF: NaN).

    Shifting the 7 magnitude bits left by 7 gives an fp16 with the same mantissa and an
    exponent 8 too small (bias 15 vs 7); subnormals land on fp16 subnormals. Times 2^8.
    A NaN byte becomes an fp16 NaN (0x7E00 with its sign), which stays NaN times 2^8.
    """
    b16 = b.to(tl.int16)
    bits = ((b16 & 0x80) << 8) | tl.where((b16 & 0x7F) == 0x7F, 0x7E00, (b16 & 0x7F) << 7)
    return (bits.to(tl.float16, bitcast=True) * 256.0).to(tl.float16)
