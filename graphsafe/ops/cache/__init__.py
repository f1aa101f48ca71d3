"""Paged-cache writes: the latent MLA cache and the paged K/V cache of GQA attention."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from graphsafe.fake_impls import cache as fakes
from graphsafe.registry import Backend, register_op


@register_op(
    "concat_and_cache_mla",
    fake=fakes.fake_concat_and_cache_mla,
    check=fakes.check_concat_and_cache_mla,
    mutates_args=("kv_cache",),
    family="cache",
    backends={
        "reference": "graphsafe.ops.cache.reference:concat_and_cache_mla",
        "triton": Backend(prepare="graphsafe.ops.cache.triton:prepare_concat_and_cache_mla"),
    },
)
def concat_and_cache_mla(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, scale: Optional[Tensor] = None
) -> None:
    """Write each token's latent KV and rope key into the paged MLA cache.

    Args:
        kv_c: `[T, R]` bf16/fp16/fp32, the compressed latent (R = kv_lora_rank, 512 for
            DeepSeek); last dim contiguous.
        k_pe: `[T, P]`, same dtype as `kv_c`, the rope part of the key (P = 64).
        kv_cache: `[num_blocks, block_size, R + P]`, mutated. Dtype of `kv_c`, or
            float8_e4m3fn (then `scale` is required). Token `s` of the cache is
            `kv_cache[s // block_size, s % block_size]`: its first R entries are `kv_c`,
            the last P are `k_pe`. Last dim contiguous; block and token strides are free.
        slot_mapping: `[T]` int64 (int32 accepted), the cache slot of each token. Slots
            below 0 (padding) or past `num_blocks * block_size` are skipped.
        scale: `[1]` float32, only for an fp8 cache: stored value = `x / scale`,
            saturated to +-448.

    Returns None; mutates `kv_cache` only.
    """


@register_op(
    "reshape_and_cache",
    fake=fakes.fake_reshape_and_cache,
    check=fakes.check_reshape_and_cache,
    mutates_args=("key_cache", "value_cache"),
    family="cache",
    backends={
        "reference": "graphsafe.ops.cache.reference:reshape_and_cache",
        "triton": Backend(prepare="graphsafe.ops.cache.triton:prepare_reshape_and_cache"),
    },
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

    Args:
        key: `[T, Hk, D]` bf16/fp16/fp32; last dim contiguous.
        value: `[T, Hk, Dv]`, same dtype as `key`.
        key_cache: `[num_blocks, block_size, Hk, D]`, mutated; dtype of `key` or
            float8_e4m3fn (then `k_scale` is required). Last dim contiguous.
        value_cache: `[num_blocks, block_size, Hk, Dv]`, mutated; same dtype as `key_cache`.
        slot_mapping: `[T]` int64 (int32 accepted); token `t` goes to block
            `slot // block_size`, offset `slot % block_size`. Slots below 0 (padding) or
            past the cache are skipped.
        k_scale, v_scale: `[1]` float32, for an fp8 cache: stored value = `x / scale`.

    Returns None; mutates `key_cache` and `value_cache` only.
    """
