"""The indexer K cache layout (DeepGEMM's) and the quantisation math, in pure PyTorch.

A cache is `uint8 [num_blocks, block_size, D + 4 * G]`, G = D // quant_block_size
scale groups per token (G = 1, one scale per token, is DeepSeek-V3.2's layout). The last
two dims only give the size of a block; inside block `b` the bytes are

    [ block_size * D fp8 (e4m3fn) values, token by token | block_size * G float32 scales ]

so token `j`'s values are bytes `j*D : (j+1)*D` of the block and its scales are the
float32s `j*G : (j+1)*G` of the scale region. Slot `s` is token `s % block_size` of block
`s // block_size`. Blocks may be strided (a view into a larger allocation), but the bytes
of one block are contiguous, and the block stride and storage offset are multiples of 4
so that the scale region is float32-aligned.

The reference backend and the tests use these helpers; the Triton kernels implement the
same arithmetic (see `quantize`).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# vLLM's and DeepGEMM's floor on a group's absolute maximum: an all-zero (or tiny) group
# still gets a finite, positive scale.
AMAX_FLOOR = 1e-4
# The NaNs the quantiser stores (bit-exact on every backend): float32 0x7FC00000 for a
# scale, e4m3fn byte 0x7F (positive NaN) for a value.
CANONICAL_NAN = float("nan")
FP8_NAN_BYTE = 0x7F


def scale_groups(cache_last_dim: int, head_dim: int) -> int:
    """G, the scales per token of a cache whose last dim is `D + 4 * G`."""
    return (cache_last_dim - head_dim) // 4


def cache_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views into the cache: (values uint8 `[NB, BS, D]`, scales float32 `[NB, BS, G]`).

    Writing through them writes the cache. Plain slices and dtype views: traceable.
    """
    nb, bs, width = kv_cache.shape
    g = scale_groups(width, head_dim)
    flat = kv_cache.view(torch.uint8).view(nb, bs * width)
    values = flat[:, : bs * head_dim].view(nb, bs, head_dim)
    scales = flat[:, bs * head_dim :].view(torch.float32).view(nb, bs, g)
    return values, scales


def unpack(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache contents: (values fp8 `[NB, BS, D]`, scales float32 `[NB, BS, G]`)."""
    values, scales = cache_views(kv_cache, head_dim)
    return values.view(FP8).clone(), scales.clone()


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous cache `uint8 [NB, BS, D + 4G]` holding fp8 `values` `[NB, BS, D]`
    and float32 `scales` `[NB, BS, G]` (or `[NB, BS]` for G = 1)."""
    nb, bs, d = values.shape
    scales = scales.reshape(nb, bs, -1).to(torch.float32)
    g = scales.shape[-1]
    cache = torch.empty((nb, bs, d + 4 * g), dtype=torch.uint8, device=values.device)
    v, s = cache_views(cache, d)
    v.copy_(values.view(torch.uint8))
    s.copy_(scales)
    return cache


def round_scale_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 s) for positive normal float32 `s`, exactly, from the bits.

    The mantissa is rounded up into the exponent: `(bits + 0x7FFFFF) & 0x7F800000`.
    `exp2(ceil(log2(s)))` is the same number except where `log2` rounds (s just above a
    power of two), which this avoids.
    """
    bits = s.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize(k: torch.Tensor, quant_block_size: int, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group fp8 quantisation: (fp8 `[T, D]`, float32 scales `[T, G]`).

    Per group of `quant_block_size` values: `s = max(amax, 1e-4) / 448`, rounded up to a
    power of two when `scale_fmt == "ue8m0"`; the stored value is `k / s` (IEEE division)
    saturated to +-448 and rounded to nearest-even e4m3.

    Non-finite values: a NaN in a group makes its scale the canonical NaN (bits
    0x7FC00000) and every value of the group NaN; else a +-inf makes the scale +inf, the
    group's finite values +-0 (sign kept) and its +-inf values NaN. Every NaN value is
    stored as the byte 0x7F.
    """
    t, d = k.shape
    g = d // quant_block_size
    x = k.to(torch.float32).reshape(t, g, quant_block_size)
    amax = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # Divide by a device tensor, not a Python scalar: CUDA turns `tensor / scalar` into a
    # multiply by the rounded reciprocal, which is not IEEE division.
    s = amax / amax.new_full((), FP8_MAX)
    if scale_fmt == "ue8m0":
        s = round_scale_ue8m0(s)
    # NaN in a group: a canonical NaN scale (the UE8M0 bit trick would turn NaN into 0),
    # so every value of the group divides to NaN below.
    s = torch.where(torch.isnan(amax), amax.new_full((), CANONICAL_NAN), s)
    y = x / s.unsqueeze(-1)
    q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    # One NaN byte for every NaN value, whatever the sign of the NaN the division made.
    q = torch.where(torch.isnan(y), q.new_full((), FP8_NAN_BYTE), q).view(FP8)
    return q.reshape(t, d), s


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 `[..., D]` from fp8 values `[..., D]` and scales `[..., G]`."""
    g = scales.shape[-1]
    x = values.to(torch.float32).unflatten(-1, (g, -1))
    return (x * scales.unsqueeze(-1)).flatten(-2)
