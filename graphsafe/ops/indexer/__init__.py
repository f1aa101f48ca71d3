"""Sparse-indexer ops of DeepSeek-V3.2's DSA "lightning indexer": the quantised K cache
(write and gather), the fp8 MQA logits of prefill and of paged decode, and the mapping of
request-local top-k positions to cache slots.

K cache layout (DeepGEMM's): `uint8 [num_blocks, block_size, D + 4*G]`. Inside block b,
the first `block_size * D` bytes are the e4m3fn values token by token, then
`block_size * G` float32 scales (token-major); G = D // quant_block_size scales per
token, G = 1 for DeepSeek-V3.2 (`D + 4`). Slot s is token `s % block_size` of block
`s // block_size`. Helpers to pack/unpack it: `graphsafe.ops.indexer.layout`.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from graphsafe.fake_impls import indexer as fakes
from graphsafe.registry import register_op


def _backends(name: str, aiter: bool = True) -> dict[str, str]:
    b = {
        "reference": f"graphsafe.ops.indexer.reference:{name}",
        "triton": f"graphsafe.ops.indexer.triton:{name}",
    }
    if aiter:
        b["aiter"] = f"graphsafe.ops.indexer.aiter:{name}"
    return b


@register_op(
    "indexer_k_quant_and_cache",
    fake=fakes.fake_indexer_k_quant_and_cache,
    check=fakes.check_indexer_k_quant_and_cache,
    mutates_args=("kv_cache",),
    family="indexer",
    backends=_backends("indexer_k_quant_and_cache"),
)
def indexer_k_quant_and_cache(
    k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int, scale_fmt: Optional[str] = None
) -> None:
    """Quantise each token's indexer key to fp8 and write it, with its scales, into the K cache.

    Per group of `quant_block_size` values of a token: `s = max(amax, 1e-4) / 448`; with
    `scale_fmt == "ue8m0"`, `s` is rounded up to a power of two (2^ceil(log2 s), exact);
    the cache stores `k / s` (IEEE division, saturated to +-448, round-to-nearest-even
    e4m3fn) and `s` (float32).

    Args:
        k: `[T, D]` bf16/fp16/fp32, the new keys; last dim contiguous. D a multiple of 16.
        kv_cache: `uint8 [num_blocks, block_size, D + 4*G]`, mutated, G = D // quant_block_size
            (`D + 4` for one scale per token). Contiguous inside each block; the block
            stride and storage offset are multiples of 4 bytes. Only the slots written
            change (their D value bytes and G scales).
        slot_mapping: `[T]` int64 (int32 accepted), the cache slot of each token. Slots
            below 0 (padding) or past `num_blocks * block_size` are skipped.
        quant_block_size: values per scale group; divides D (D for DeepSeek-V3.2).
        scale_fmt: None (plain float32 scales) or "ue8m0" (power-of-two scales).

    Returns None; mutates `kv_cache` only.
    """


@register_op(
    "cp_gather_indexer_k_quant_cache",
    fake=fakes.fake_cp_gather_indexer_k_quant_cache,
    check=fakes.check_cp_gather_indexer_k_quant_cache,
    mutates_args=("dst_k", "dst_scale"),
    family="indexer",
    backends=_backends("cp_gather_indexer_k_quant_cache"),
)
def cp_gather_indexer_k_quant_cache(
    kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor, cu_seq_lens: Tensor
) -> None:
    """Gather the quantised keys of B requests from the paged K cache into contiguous rows.

    Row `cu_seq_lens[b] + t` of `dst_k`/`dst_scale` receives token t of request b (its
    fp8 values and scales, bit for bit), for `0 <= t < cu_seq_lens[b+1] - cu_seq_lens[b]`.
    Rows outside `[cu_seq_lens[0], cu_seq_lens[B])` are left untouched, so N may be an
    upper bound (no host sync to size it). Rows whose block-table entry is out of range
    (`t // block_size >= max_blocks`, or a block id outside `[0, num_blocks)`) are left
    untouched too.

    Args:
        kv_cache: `uint8 [num_blocks, block_size, D + 4*G]`, the K cache (layout above).
        dst_k: `[N, D]` float8_e4m3fn, mutated; last dim contiguous.
        dst_scale: float32, mutated: `[N]` when G = 1 (one scale per token), else `[N, G]`.
        block_table: `[B, max_blocks]` int32, last dim contiguous; the blocks of request b
            in order.
        cu_seq_lens: `[B + 1]` int32, non-decreasing; request b owns rows
            `[cu_seq_lens[b], cu_seq_lens[b+1])`.

    Returns None; mutates `dst_k` and `dst_scale` only.
    """


@register_op(
    "fp8_mqa_logits",
    fake=fakes.fake_fp8_mqa_logits,
    check=fakes.check_fp8_mqa_logits,
    family="indexer",
    backends=_backends("fp8_mqa_logits"),
)
def fp8_mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor) -> Tensor:
    """Indexer logits of M query tokens against N contiguous keys (prefill; DeepGEMM semantics).

    `out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])` for
    `ks[m] <= n < ke[m]`, `-inf` elsewhere. Products are exact in float32 and
    accumulated in float32 (fp8 tensor cores accumulate with slightly less precision).

    Args:
        q: `[M, H, D]` float8_e4m3fn, the indexer queries; last dim contiguous.
        k: `[N, D]` float8_e4m3fn, the keys (e.g. from `cp_gather_indexer_k_quant_cache`);
            last dim contiguous.
        k_scale: `[N]` float32, the per-key dequantisation scales.
        weights: `[M, H]` float32, the per-head weights (softmax scale folded in).
        ks: `[M]` int32, first key of row m's window (inclusive).
        ke: `[M]` int32, end of row m's window (exclusive); an empty window gives a -inf row.

    Returns:
        logits: `[M, N]` float32, contiguous.
    """


@register_op(
    "fp8_paged_mqa_logits",
    fake=fakes.fake_fp8_paged_mqa_logits,
    check=fakes.check_fp8_paged_mqa_logits,
    family="indexer",
    backends=_backends("fp8_paged_mqa_logits"),
)
def fp8_paged_mqa_logits(
    q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor, max_model_len: int
) -> Tensor:
    """Indexer logits of decode queries against their requests' paged K cache (DeepGEMM semantics).

    Row `r = b * next_n + i` (query i of request b; the last query is the newest token):
    `out[r, n] = scale[n] * sum_h weights[r, h] * relu(q[b, i, h] . key_b[n])` for
    `n < context_lens[b] - next_n + i + 1` (keys up to the query's own position), `-inf`
    for every other column up to `max_model_len`: the whole output is written. Key n of
    request b is slot `block_table[b, n // block_size] * block_size + n % block_size`.

    Args:
        q: `[B, next_n, H, D]` float8_e4m3fn, 1 <= next_n <= 4 (MTP); last dim contiguous.
        kv_cache: `uint8 [num_blocks, block_size, D + 4]`, one scale per token (layout above).
        weights: `[B * next_n, H]` float32, per-head weights of each row.
        context_lens: `[B]` int32, tokens in each request's cache (the new ones included).
            Values are clamped to `[0, max_model_len]` for reading keys.
        block_table: `[B, max_blocks]` int32, last dim contiguous. Needs
            `max_blocks * block_size >= max_model_len` (checked); entries for positions
            below the context must be valid block ids.
        max_model_len: the output width (a host int, so the output shape never depends on data).

    Returns:
        logits: `[B * next_n, max_model_len]` float32, contiguous.
    """


@register_op(
    "req_local_to_global_slots",
    fake=fakes.fake_req_local_to_global_slots,
    check=fakes.check_req_local_to_global_slots,
    family="indexer",
    backends=_backends("req_local_to_global_slots", aiter=False),
)
def req_local_to_global_slots(req_id_per_token: Tensor, block_table: Tensor, topk_indices: Tensor, block_size: int) -> Tensor:
    """Map request-local token positions (top-k results) to global cache slots.

    `out[t, j] = block_table[r, p // block_size] * block_size + p % block_size` with
    `r = req_id_per_token[t]`, `p = topk_indices[t, j]`; `-1` where `p < 0` (padding), where
    `p // block_size >= max_blocks`, or where `r` is outside `[0, B)`.

    Args:
        req_id_per_token: `[T]` int32, the request of each token.
        block_table: `[B, max_blocks]` int32, last dim contiguous.
        topk_indices: `[T, K]` int32, request-local positions, `-1` for none.
        block_size: tokens per cache block (the cache that the slots index).

    Returns:
        slots: `[T, K]` int32, contiguous.
    """
