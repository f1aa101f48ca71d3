"""The FP8 KV cache DeepSeek-V4 is served with (FlashMLA's "MODEL1" FP8 sparse layout, vLLM's
`fp8_ds_mla` cache of DeepSeek-V4's attention layers): the reference packing and unpacking.

One latent row per token, `k [512]` = 448 "NoPE" values followed by 64 RoPE values (head_dim
512, single-latent MQA: the row is both the key and the value). A cache is a `torch.uint8`
tensor `[num_blocks, block_size, 584]` whose last two dims are contiguous (`stride(2) == 1`,
`stride(1) == 584`): the 584-byte rows of the view are NOT the tokens' records, they only give
each block its `block_size * 584` bytes. Block `b` starts at byte `b * stride(0)`; the block
stride is free (vLLM pads each block to a multiple of 576 bytes: `padded_block_bytes`).
Inside a block of `bs = block_size` tokens, token `t` (slot `s = b * bs + t`) owns:

    bytes [576 t,        576 t + 448)     its 448 NoPE values, one float8_e4m3fn byte each
    bytes [576 t + 448,  576 t + 576)     its 64 RoPE values, bfloat16, little-endian
    bytes [576 bs + 8 t, 576 bs + 8 t + 7) 7 UE8M0 scales (float8_e8m0fnu): scale j covers
                                           the NoPE values [64 j, 64 j + 64)
    byte   576 bs + 8 t + 7                padding: written 0, never read

so the block holds all its tokens' data (576 bytes each) first, then all their scales (8 bytes
each); bytes `[584 bs, stride(0))` are padding, never read or written. A UE8M0 byte `e` is the
scale `2^(e - 127)` (e = 0 is 2^-127), and `e = 255` is NaN (float8_e8m0fnu).

Sources: FlashMLA `tests/quant.py` (`FP8KVCacheLayout.MODEL1_FP8Sparse`: d 512, d_nope 448,
d_rope 64, tile 64, 7 tiles; `bytes_per_token = d_nope + 2 * d_rope + num_tiles + 1`; the
block's data `[:block_size * (d_nope + 2 * d_rope)]`, then `.view(num_blocks, block_size, 8)
[:, :, :7]` as `float8_e8m0fnu`; blocks padded to a multiple of 576), FlashMLA
`csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh` (MODEL1: a token's data at `block * stride_kv_block
+ t * (448 + 64 * 2)`, its scales at `block * stride_kv_block + block_size * 576 + t * 8`) and
`csrc/api/sparse_decode.h` (`bytes_per_token = 448 + 64 * 2 + 448 / 64 + 1`, `stride(1) ==
bytes_per_token`), vLLM `csrc/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu` (the writer).

Writing a token (`quantize_tokens`), as vLLM's `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`
writes it: the row is rounded to bfloat16 first (the value a bf16 cache would hold); then per
64-value NoPE tile, in float32:

    amax = max(max |x|, 1e-4)                 (1e-4 the float32 constant 0x38D1B717)
    e    = ceil(log2(amax / 448))             (IEEE division; the ceiling exact, from the bits)
    byte = e + 127                            (the UE8M0 scale 2^e)
    value bytes: (x * 2^-e).clamp(-448, 448) as float8_e4m3fn (round to nearest even)

and the 64 RoPE values are stored as their bfloat16 bits. A tile holding a NaN or an inf
stores scale byte 255 (NaN) and every value byte 0x7F (NaN): the whole tile reads back NaN.
(vLLM computes `e` with `ceilf(log2f(amax / 448))`; where `amax / 448` lies within a few ulps
above a power of two `log2f` may round down, giving a scale one binade smaller whose largest
values then saturate at 448. This module's ceiling is the exact one. Both are valid writers:
readers only see the bytes.)

Reading a token (`dequantize_tokens`): NoPE value c is `float(byte c as e4m3fn) *
2^(scale[c // 64] - 127)` in float32 (NaN for a NaN byte 0x7F / 0xFF or a scale byte 255;
+-inf where the product overflows), the RoPE values are the bfloat16 ones: a `[512]` float32
row. The product of an e4m3 value and a power of two is exact in float32, and in bfloat16
for scale bytes in [10, 246] (all `quantize_tokens` writes for finite bf16 rows: 105 to 247,
the latter only for rows near bfloat16's maximum), so kernels that dequantise to bf16 for
their dot products see the very rows of the reference.

Accuracy: each NoPE value carries e4m3's relative rounding (at most 2^-4 of its magnitude
for normal e4m3 values), and the power-of-two scale leaves up to half of e4m3's range unused
(a tile's largest value scales to (224, 448]); the RoPE values are exact (bf16).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HEAD_DIM = 512  # one latent row: key and value
NOPE_DIM = 448  # e4m3 values
ROPE_DIM = 64  # bfloat16 values
TILE = 64  # NoPE values per UE8M0 scale
NUM_TILES = NOPE_DIM // TILE  # 7
SCALE_BYTES = NUM_TILES + 1  # 7 scales + 1 pad byte per token
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: a token's e4m3 NoPE + bf16 RoPE
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
BLOCK_ALIGN = 576  # vLLM / FlashMLA pad every block to a multiple of 576 bytes
AMAX_FLOOR = 1e-4  # vLLM's floor on a tile's |max| (an all-zero tile gets scale 2^-22)
NAN_SCALE = 255  # float8_e8m0fnu NaN
NAN_VALUE = 0x7F  # float8_e4m3fn NaN
PAD_BYTE = 0


def block_bytes(block_size: int) -> int:
    """The bytes of one block's records: `block_size * 584`."""
    return block_size * TOKEN_BYTES


def padded_block_bytes(block_size: int) -> int:
    """vLLM's block stride: `block_bytes` rounded up to a multiple of 576."""
    return -(-block_bytes(block_size) // BLOCK_ALIGN) * BLOCK_ALIGN


def empty_cache(num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                block_stride: int | None = None) -> torch.Tensor:
    """An uninitialised cache `uint8 [num_blocks, block_size, 584]`, blocks `block_stride`
    bytes apart (default `padded_block_bytes(block_size)`, as vLLM allocates)."""
    stride = padded_block_bytes(block_size) if block_stride is None else block_stride
    if stride < block_bytes(block_size):
        raise ValueError(f"block_stride {stride} < block_size * {TOKEN_BYTES}")
    storage = torch.empty(max(num_blocks * stride, 1), dtype=torch.uint8, device=device)
    return storage.as_strided((num_blocks, block_size, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))


def is_fp8_dsv4_cache(cache: torch.Tensor) -> bool:
    """Whether `cache` has this format's tensor layout: uint8 `[num_blocks, block_size, 584]`
    with `stride(2) == 1`, `stride(1) == 584` and blocks that do not overlap."""
    return (
        cache.dtype == torch.uint8
        and cache.dim() == 3
        and cache.shape[2] == TOKEN_BYTES
        and (cache.shape[1] <= 1 or cache.stride(1) == TOKEN_BYTES)
        and cache.stride(2) == 1
        and (cache.shape[0] <= 1 or cache.stride(0) >= cache.shape[1] * TOKEN_BYTES)
    )


def block_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a cache's blocks: (data `uint8 [nb, bs, 576]`, scales `uint8 [nb, bs, 8]`).
    Writing through them writes the cache."""
    nb, bs, _ = cache.shape
    flat = cache.as_strided((nb, bs * TOKEN_BYTES), (cache.stride(0), 1))
    data = flat[:, : bs * DATA_BYTES].unflatten(1, (bs, DATA_BYTES))
    scales = flat[:, bs * DATA_BYTES :].unflatten(1, (bs, SCALE_BYTES))
    return data, scales


def _float_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def scale_bytes(rows: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., 7]` UE8M0 scale bytes of the NoPE tiles of float32 `rows [..., >= 448]`
    (already rounded to bfloat16): `ceil(log2(max(amax, 1e-4) / 448)) + 127`, 255 for a
    tile with a NaN or an inf."""
    tiles = rows[..., :NOPE_DIM].float().unflatten(-1, (NUM_TILES, TILE))
    amax = tiles.abs().amax(-1)  # NaN propagates
    finite = torch.isfinite(amax)
    amax = torch.maximum(torch.where(finite, amax, 0.0), torch.full_like(amax, AMAX_FLOOR))
    # A tensor divisor: IEEE division (see fp8_ds_mla.tile_scales).
    q = amax / torch.full_like(amax, FP8_MAX)
    bits = _float_bits(q)
    # q >= 1e-4 / 448 is a normal float32: ceil(log2 q) = its exponent, +1 unless q is a power of 2.
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.where(finite, e + 127, NAN_SCALE).to(torch.uint8)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32, exactly, for int32 exponents in [-126, 127]."""
    return ((exponent + 127) << 23).view(torch.float32)


def quantize_tokens(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of tokens `rows [T, 512]` (any float dtype; rounded to bfloat16 first):
    (data `uint8 [T, 576]`, scales `uint8 [T, 8]`, the pad byte 0), as the module
    docstring defines them."""
    t = rows.shape[0]
    x = rows.to(torch.bfloat16).float()
    scales = scale_bytes(x)  # [T, 7]
    finite = scales != NAN_SCALE
    e = scales.to(torch.int32) - 127
    inv = _pow2(torch.where(finite, -e, 0))  # 2^-e (e in [-22, 120] for finite bf16 rows)
    tiles = x[:, :NOPE_DIM].unflatten(-1, (NUM_TILES, TILE))
    values = (tiles * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    values = torch.where(finite[..., None], values, torch.full_like(values, NAN_VALUE)).reshape(t, NOPE_DIM)
    rope = x[:, NOPE_DIM:HEAD_DIM].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, 2 * ROPE_DIM)
    pad = torch.full((t, 1), PAD_BYTE, dtype=torch.uint8, device=rows.device)
    return torch.cat([values, rope], dim=1), torch.cat([scales, pad], dim=1)


def dequantize_tokens(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`float32 [..., 512]` rows of tokens' bytes: data `uint8 [..., 576]`, scales `uint8
    [..., >= 7]` (the pad byte, if given, is not read)."""
    lead = data.shape[:-1]
    data = data.reshape(-1, DATA_BYTES).contiguous()
    values = data[:, :NOPE_DIM].view(FP8).float().unflatten(-1, (NUM_TILES, TILE))
    s = scales.reshape(-1, scales.shape[-1])[:, :NUM_TILES].contiguous().view(torch.float8_e8m0fnu).float()
    nope = (values * s[..., None]).flatten(1)
    rope = data[:, NOPE_DIM:].view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1).reshape(*lead, HEAD_DIM)


def slot_valid(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Which `slots` name a token of the cache (`0 <= s < num_blocks * block_size`)."""
    nb, bs = cache.shape[:2]
    slots = slots.long()
    return (slots >= 0) & (slots < nb * bs)


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of the tokens at `slots` (any shape): (data `[..., 576]`, scales `[..., 8]`).
    Slots that are not `valid` (default: outside the cache) read slot 0's place and come
    back as zero bytes (a zero row): no slot outside the cache is ever dereferenced."""
    valid = slot_valid(cache, slots) if valid is None else valid
    nb, bs = cache.shape[:2]
    s = torch.where(valid, slots.long(), 0)
    data, scales = block_views(cache)
    d = data[s // bs, s % bs]
    sc = scales[s // bs, s % bs]
    return torch.where(valid[..., None], d, 0), torch.where(valid[..., None], sc, 0)


def read_tokens(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`float32 [..., 512]` rows of the tokens at `slots`; rows of invalid slots are 0."""
    return dequantize_tokens(*gather_tokens(cache, slots, valid))


def write_tokens(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Write tokens `rows [T, 512]` at `slots [T]` (in place; slots outside the cache are
    skipped). The reference writer: `quantize_tokens`' bytes, the pad byte 0.

    No host sync and no data-dependent shape (it runs inside captured CUDA graphs): every
    token takes part in one write per view; a skipped token writes slot 0 with the bytes
    slot 0 ends up holding anyway (its own, or those of the token written there), never a
    boolean-mask selection (which syncs to learn its size)."""
    nb, bs = cache.shape[:2]
    if rows.shape[0] == 0 or nb * bs == 0:
        return
    valid = slot_valid(cache, slots)
    data_b, scale_b = quantize_tokens(rows)
    data, scales = block_views(cache)
    s = slots.long()
    writes_slot0 = valid & (s == 0)
    # The first token written at slot 0, if any: index_select, not data_b[i] (a 0-dim index
    # tensor becomes a Python int: a sync).
    writer = writes_slot0.int().argmax().view(1)
    any_slot0 = writes_slot0.any()
    target = torch.where(valid, s, 0)
    keep = valid[:, None]
    for view, new in ((data, data_b), (scales, scale_b)):
        slot0 = torch.where(any_slot0, new.index_select(0, writer)[0], view[0, 0])
        view[target // bs, target % bs] = torch.where(keep, new, slot0)


def token_byte_offsets(block_size: int, token: int) -> tuple[range, range, int]:
    """Where token `token` of a block lives, as block byte offsets: (data bytes, the 7
    scale bytes, the pad byte)."""
    data = range(DATA_BYTES * token, DATA_BYTES * (token + 1))
    scale = DATA_BYTES * block_size + SCALE_BYTES * token
    return data, range(scale, scale + NUM_TILES), scale + NUM_TILES


__all__ = [
    "AMAX_FLOOR", "BLOCK_ALIGN", "DATA_BYTES", "HEAD_DIM", "NOPE_DIM", "NUM_TILES", "ROPE_DIM", "SCALE_BYTES",
    "TILE", "TOKEN_BYTES", "block_bytes", "block_views", "dequantize_tokens", "empty_cache", "gather_tokens",
    "is_fp8_dsv4_cache", "padded_block_bytes", "quantize_tokens", "read_tokens", "scale_bytes", "slot_valid",
    "token_byte_offsets", "write_tokens",
]
