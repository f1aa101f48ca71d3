"""Paged-cache writes: the latent MLA cache and the paged K/V cache of GQA attention."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from graphsafe.ops.cache import fake as fakes
from graphsafe.ops.cache import reference, triton
from graphsafe.registry import register_op


@register_op(
    "concat_and_cache_mla",
    fake=fakes.fake_concat_and_cache_mla,
    check=fakes.check_concat_and_cache_mla,
    mutates_args=("kv_cache",),
    family="cache",
    backends=(reference.CONCAT_AND_CACHE_MLA, triton.CONCAT_AND_CACHE_MLA),
    debug_check="graphsafe.ops.cache.debug:debug_check_concat_and_cache_mla",
)
def concat_and_cache_mla(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, scale: Optional[Tensor] = None
) -> None:
    """Write each token's latent KV and rope key into the paged MLA cache.

    Three cache kinds, told apart by `kv_cache`'s dtype:

    - the dtype of `kv_c`: values are written as they are (NaN and +-inf included);
    - float8_e4m3fn: each entry `x` is stored as the bytes of torch's
      `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` on every backend:
      IEEE division, saturation to +-448 (+-inf included), round to nearest even, NaN kept
      (byte 0x7F, 0xFF for a negative NaN);
    - uint8 with `record = R + 4 * (R // 128) + 2 * P` bytes per token ("fp8_ds_mla",
      DeepSeek-V3.2's FP8 MLA cache, 656 bytes for R = 512, P = 64; R a multiple of 128,
      P even): token `t`'s record is `graphsafe.formats.fp8_ds_mla.quantize_records(kv_c[t:t+1],
      k_pe[t:t+1])[0]`. Byte by byte:

        [0, R)                    `kv_c`, one float8_e4m3fn byte per value: byte c is
                                  that of `(x_c / s_j).clamp(-448, 448)` (IEEE division,
                                  round to nearest even), j = c // 128
        [R + 4 j, R + 4 j + 4)    s_j, the float32 scale of tile j (values [128 j, 128 j +
                                  128)), little-endian: `amax_j / 448` (IEEE division,
                                  float32 subnormals kept) with `amax_j = max |x_c|` over
                                  the tile in float32, or 1.0 where that quotient is 0
        [R + 4 R/128 + 2 i, +2)   `k_pe[t, i]` rounded to bfloat16 (to nearest even,
                                  overflow to +-inf), little-endian; bf16 inputs are
                                  copied bit for bit

      A tile holding a NaN gets a NaN scale and every value byte of the tile NaN (0x7F,
      0xFF where the float32 quotient is a negative NaN). A tile with +-inf and no NaN
      gets s_j = +inf: its +-inf values become NaN bytes (inf / inf) and its finite values
      +-0 (bytes 0x00 / 0x80), so the whole tile reads back NaN. A tile whose `amax / 448`
      is 0 (amax 0, or 0 < amax <= 224 * 2^-149, float32 subnormals) gets s_j = 1: its
      values round to e4m3 as they are (subnormal floats become +-0).
      The NaN bits (scale, quotients) are those the device's IEEE float32 division gives
      (an x86 CPU keeps a NaN operand and returns 0xFFC00000 for inf / inf; NVIDIA GPUs
      return 0x7FFFFFFF); every backend divides as the reference does on the same device,
      and a NaN amax is taken as 0x7FC00000 before the division, as torch's amax gives.
      A NaN rope value of a float16 / float32 input is a bfloat16 NaN whose bits are not
      specified (the Triton backend writes 0x7FFF, as CUDA's conversion does; torch on a
      CPU gives 0xFFFF or 0x7FC0 depending on the input dtype).

    Args:
        kv_c: `[T, R]` bf16/fp16/fp32, the compressed latent (R = kv_lora_rank, 512 for
            DeepSeek); last dim contiguous. Rows of skipped tokens are not read.
        k_pe: `[T, P]`, same dtype as `kv_c`, the rope part of the key (P = 64). Rows of
            skipped tokens are not read.
        kv_cache: `[num_blocks, block_size, R + P]` of the dtype of `kv_c` or
            float8_e4m3fn (then `scale` is required), or `[num_blocks, block_size,
            record]` uint8 (fp8_ds_mla, then `scale` must be None); mutated: only the
            slots written change, all bytes of their records. Token `s` of the cache is
            `kv_cache[s // block_size, s % block_size]`: for the first two kinds its
            first R entries are `kv_c`, the last P are `k_pe`. Last dim contiguous;
            block and token strides are free (any byte offsets for uint8).
        slot_mapping: `[T]` int64 (int32 accepted), the cache slot of each token. -1 is
            padding: the token is skipped (nothing read, nothing written). Any other slot
            outside `[0, num_blocks * block_size)` (negative or too large) is skipped
            the same way on every backend, never wrapped around; the debug switch
            (`graphsafe.debug_checks`) refuses it. The slots >= 0 must be distinct
            (which token a shared slot ends up holding is unspecified; the debug switch
            checks it).
        scale: `[1]` float32, only for a float8_e4m3fn cache (see above); not read when
            every token is skipped. None for the other kinds.

    Returns None; mutates `kv_cache` only.
    """


@register_op(
    "reshape_and_cache",
    fake=fakes.fake_reshape_and_cache,
    check=fakes.check_reshape_and_cache,
    mutates_args=("key_cache", "value_cache"),
    family="cache",
    backends=(reference.RESHAPE_AND_CACHE, triton.RESHAPE_AND_CACHE),
    debug_check="graphsafe.ops.cache.debug:debug_check_reshape_and_cache",
)
def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> None:
    """Write new keys and values into the paged K/V caches (flash layout).

    Values are written as they are into caches of their dtype (NaN and +-inf included).
    Into fp8 caches each entry `x` is stored as the bytes of torch's
    `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` on every backend
    (`k_scale` for keys, `v_scale` for values): IEEE division, saturation to +-448 (+-inf
    included), round to nearest even, NaN kept (byte 0x7F, 0xFF for a negative NaN).

    Args:
        key: `[T, Hk, D]` bf16/fp16/fp32; last dim contiguous. Rows of skipped tokens
            are not read.
        value: `[T, Hk, Dv]`, same dtype as `key`. Rows of skipped tokens are not read.
        key_cache: `[num_blocks, block_size, Hk, D]`, mutated: only the slots written
            change. Dtype of `key` or float8_e4m3fn (then `k_scale` is required). Last
            dim contiguous.
        value_cache: `[num_blocks, block_size, Hk, Dv]`, mutated like `key_cache`; same
            dtype as `key_cache`.
        slot_mapping: `[T]` int64 (int32 accepted); token `t` goes to block
            `slot // block_size`, offset `slot % block_size`. -1 is padding: the token is
            skipped (nothing read, nothing written). Any other slot outside
            `[0, num_blocks * block_size)` (negative or too large) is skipped the same
            way on every backend, never wrapped around; the debug switch
            (`graphsafe.debug_checks`) refuses it. The slots >= 0 must be distinct
            (which token a shared slot ends up holding is unspecified; the debug switch
            checks it).
        k_scale, v_scale: `[1]` float32, for fp8 caches (see above); not read when every
            token is skipped.

    Returns None; mutates `key_cache` and `value_cache` only.
    """
