"""The FP8 MLA cache DeepSeek-V3.2 is served with ("fp8_ds_mla" in vLLM, FlashMLA's FP8
sparse decoding format): the reference packing and unpacking of one token record.

A cache in this format is a `torch.uint8` tensor `[num_blocks, block_size, record]`,
`record = R + 4 * (R // 128) + 2 * P` bytes per token (656 for DeepSeek: R = 512 latent
values, P = 64 rope values). Token record, byte by byte:

    [0, R)                        the latent `kv_c`, one float8_e4m3fn byte per value
    [R, R + 4 * R/128)            R/128 float32 scales (little-endian), scale t for the
                                  latent values [128 t, 128 t + 128)
    [R + 4 * R/128, record)       the rope key `k_pe`, P bfloat16 values (little-endian)

Writing a token (`quantize_records`), per 128-value tile of its latent, in float32:
`amax = max |x|`; `scale = amax / 448` (IEEE division), or 1 where that is 0 (`amax` 0, or
below 448 times the smallest float32 subnormal, so the tile's values round to 0); each value
is stored as torch's `(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` (IEEE division,
round to nearest even). The rope values are rounded to bfloat16. Non-finite latents: a NaN
in a tile makes its scale NaN and so every value of the tile NaN (byte 0x7F); an inf makes
the scale inf, its own value NaN (inf / inf) and the tile's finite values 0, which read
back as NaN (0 * inf). So a tile holding a non-finite value reads back all NaN.

Reading a token (`dequantize_records`): latent value c is `float(byte c as e4m3fn) *
scale[c // 128]` in float32, the rope values are the bfloat16 values; the row is
`[R + P]` float32, the key (and, its first R entries, the value) of absorbed MLA.
Accuracy against a bf16 cache: each latent value carries e4m3's relative rounding of at
most 2^-4 of its tile's scale-normalised magnitude (3 mantissa bits), about 8x bf16's.

Requires R a multiple of 128 and P even (4-byte aligned scales, 2-byte aligned rope).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
# DeepSeek-V3.2: 512 latent values + 64 rope values -> 656 bytes.
DEEPSEEK_RECORD_BYTES = 656
# A cache of records is a byte tensor; a cache of values (bf16, fp16, fp32 or
# float8_e4m3fn) never is: the dtype alone tells the two kinds apart.
DTYPE = torch.uint8


def holds_records(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` is an fp8_ds_mla cache (uint8 records) rather than a cache of
    values: the one test of the format for code that takes either kind (fakes, references
    and kernels alike; an op's input check then holds the record layout)."""
    return kv_cache.dtype == DTYPE


def record_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token record for latent width R and rope width P."""
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope_dim


def layout_supported(kv_lora_rank: int, rope_dim: int) -> bool:
    """Whether R and P have a record layout (R a positive multiple of 128, P even, >= 0)."""
    return kv_lora_rank > 0 and kv_lora_rank % TILE == 0 and rope_dim >= 0 and rope_dim % 2 == 0


def is_fp8_ds_mla(kv_cache: torch.Tensor, kv_lora_rank: int, head_dim: int) -> bool:
    """Whether `kv_cache` is an fp8_ds_mla cache for R = kv_lora_rank and R + P = head_dim:
    uint8 with `record_bytes(R, P)` bytes per token."""
    rope = head_dim - kv_lora_rank
    return (
        holds_records(kv_cache)
        and layout_supported(kv_lora_rank, rope)
        and kv_cache.shape[-1] == record_bytes(kv_lora_rank, rope)
    )


def tile_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """`[T, R // 128]` float32 scales of the latent rows `kv_c [T, R]` (module docstring)."""
    t, r = kv_c.shape
    amax = kv_c.float().reshape(t, r // TILE, TILE).abs().amax(-1)
    # A tensor divisor: torch turns division by a Python scalar into a multiplication by
    # its reciprocal on CUDA, which is not the IEEE quotient the kernels compute.
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_records(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """`[T, record]` uint8 records of the tokens `kv_c [T, R]`, `k_pe [T, P]` (module docstring)."""
    t, r = kv_c.shape
    scales = tile_scales(kv_c)
    x = kv_c.float().reshape(t, r // TILE, TILE) / scales[..., None]
    values = x.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(t, r).view(torch.uint8)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(t, 4 * (r // TILE))
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, 2 * k_pe.shape[1])
    return torch.cat([values, scale_bytes, rope_bytes], dim=1)


def dequantize_records(records: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """`[..., R + P]` float32 rows of the uint8 records `[..., record]` (module docstring)."""
    r = kv_lora_rank
    lead = records.shape[:-1]
    flat = records.reshape(-1, records.shape[-1]).contiguous()
    n_scales = r // TILE
    values = flat[:, :r].view(FP8).float()
    scales = flat[:, r : r + 4 * n_scales].view(torch.float32)
    rope = flat[:, r + 4 * n_scales :].view(torch.bfloat16).float()
    latent = (values.reshape(-1, n_scales, TILE) * scales[..., None]).reshape(-1, r)
    return torch.cat([latent, rope], dim=1).reshape(*lead, r + rope.shape[1])


__all__ = [
    "DEEPSEEK_RECORD_BYTES", "DTYPE", "TILE", "record_bytes", "layout_supported", "holds_records", "is_fp8_ds_mla",
    "tile_scales", "quantize_records", "dequantize_records",
]
