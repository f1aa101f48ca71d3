"""Sparse-indexer ops of DeepSeek-V3.2's DSA "lightning indexer": the quantised K cache
(write and gather), the fp8 MQA logits of prefill and of paged decode, and the mapping of
request-local top-k positions to cache slots.

K cache layout (DeepGEMM's): `uint8 [num_blocks, block_size, D + 4*G]`. Inside block b,
the first `block_size * D` bytes are the e4m3fn values token by token, then
`block_size * G` float32 scales (token-major); G = D // quant_block_size scales per
token, G = 1 for DeepSeek-V3.2 (`D + 4`). Slot s is token `s % block_size` of block
`s // block_size`. Helpers to pack/unpack it: `graphsafe.formats.indexer_k`.

The composites `sparse_attn_indexer_decode` / `_prefill` run one layer's whole indexer
step (vLLM's `sparse_attn_indexer` custom op, split into its decode and prefill halves):
cache the new keys, compute the logits into workspace scratch, and write the top-k
request-local positions into a shared `topk_indices` buffer.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from graphsafe.ops.indexer import aiter, composite, reference, triton
from graphsafe.ops.indexer import fake as fakes
from graphsafe.ops.indexer.plan import (
    DEFAULT_MAX_CHUNK_BYTES,
    prefill_chunk_bytes,
    prefill_chunk_rows,
    prefill_chunks,
    sparse_attn_indexer_decode_workspace,
    sparse_attn_indexer_prefill_workspace,
)
from graphsafe.registry import register_op

__all__ = [
    "indexer_k_quant_and_cache",
    "cp_gather_indexer_k_quant_cache",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "req_local_to_global_slots",
    "sparse_attn_indexer_decode",
    "sparse_attn_indexer_prefill",
    "DEFAULT_MAX_CHUNK_BYTES",
    "prefill_chunk_bytes",
    "prefill_chunk_rows",
    "prefill_chunks",
    "sparse_attn_indexer_decode_workspace",
    "sparse_attn_indexer_prefill_workspace",
]


@register_op(
    "indexer_k_quant_and_cache",
    fake=fakes.fake_indexer_k_quant_and_cache,
    check=fakes.check_indexer_k_quant_and_cache,
    debug_check="graphsafe.ops.indexer.debug:debug_check_indexer_k_quant_and_cache",
    mutates_args=("kv_cache",),
    family="indexer",
    backends=(reference.INDEXER_K_QUANT_AND_CACHE, triton.INDEXER_K_QUANT_AND_CACHE),
)
def indexer_k_quant_and_cache(
    k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int, scale_fmt: Optional[str] = None
) -> None:
    """Quantise each token's indexer key to fp8 and write it, with its scales, into the K cache.

    Per group of `quant_block_size` values of a token: `s = max(amax, 1e-4) / 448`; with
    `scale_fmt == "ue8m0"`, `s` is rounded up to a power of two (2^ceil(log2 s), exact);
    the cache stores `k / s` (IEEE division, saturated to +-448, round-to-nearest-even
    e4m3fn) and `s` (float32).

    Non-finite keys, per group, bit for bit on every backend: a NaN anywhere in the group
    gives the scale NaN (bits 0x7FC00000) and every value of the group NaN; otherwise a
    +-inf gives the scale +inf, the group's finite values +-0 (sign kept) and its +-inf
    values NaN. A NaN value is stored as the byte 0x7F.

    Args:
        k: `[T, D]` bf16/fp16/fp32, the new keys; last dim contiguous. D a multiple of 16.
        kv_cache: `uint8 [num_blocks, block_size, D + 4*G]`, mutated, G = D // quant_block_size
            (`D + 4` for one scale per token). Contiguous inside each block; the block
            stride and storage offset are multiples of 4 bytes. Only the slots written
            change (their D value bytes and G scales).
        slot_mapping: `[T]` int64 (int32 accepted), the cache slot of each token, `-1` for
            padding. Any slot outside `[0, num_blocks * block_size)` is skipped like -1:
            nothing is written, its token's `k` row is not read. The debug switch refuses
            slots outside that range other than -1.
        quant_block_size: values per scale group; divides D (D for DeepSeek-V3.2).
        scale_fmt: None (plain float32 scales) or "ue8m0" (power-of-two scales).

    Returns None; mutates `kv_cache` only.
    """


@register_op(
    "cp_gather_indexer_k_quant_cache",
    fake=fakes.fake_cp_gather_indexer_k_quant_cache,
    check=fakes.check_cp_gather_indexer_k_quant_cache,
    debug_check="graphsafe.ops.indexer.debug:debug_check_cp_gather_indexer_k_quant_cache",
    mutates_args=("dst_k", "dst_scale"),
    family="indexer",
    backends=(reference.CP_GATHER_INDEXER_K_QUANT_CACHE, triton.CP_GATHER_INDEXER_K_QUANT_CACHE),
)
def cp_gather_indexer_k_quant_cache(
    kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor, cu_seq_lens: Tensor
) -> None:
    """Gather the quantised keys of B requests from the paged K cache into contiguous rows.

    Row `cu_seq_lens[b] + t` of `dst_k`/`dst_scale` receives token t of request b (its
    fp8 values and scales, bit for bit, NaN bytes included), for
    `0 <= t < cu_seq_lens[b+1] - cu_seq_lens[b]`. Rows outside
    `[cu_seq_lens[0], cu_seq_lens[B])` are left untouched, so N may be an upper bound
    (no host sync to size it); rows past N are not written. A token whose block is
    out of range (`t // block_size >= max_blocks`, or a block id outside
    `[0, num_blocks)`, padding -1 included) gives a zero row: value bytes 0x00 and
    scale +0.0.

    A decreasing `cu_seq_lens` (refused by the debug switch) is still safe and the same
    on every backend: a request of negative length owns no row, and each row r goes to
    at most one request, the b found by the binary search `lo, hi = 0, B; while lo < hi:
    mid = (lo + hi) // 2; lo, hi = (mid + 1, hi) if cu_seq_lens[mid + 1] <= r else
    (lo, mid)`, and only if `cu_seq_lens[b] <= r < cu_seq_lens[b + 1]` (else untouched).

    Args:
        kv_cache: `uint8 [num_blocks, block_size, D + 4*G]`, the K cache (layout above).
        dst_k: `[N, D]` float8_e4m3fn, mutated; last dim contiguous.
        dst_scale: float32, mutated: `[N]` when G = 1 (one scale per token), else `[N, G]`.
        block_table: `[B, max_blocks]` int32, last dim contiguous; the blocks of request b
            in order, `-1` for padding. Entries below a request's length should be valid
            block ids or -1 (the debug switch checks it).
        cu_seq_lens: `[B + 1]` int32, non-decreasing, `0 <= cu_seq_lens[0]`,
            `cu_seq_lens[B] <= N` (the debug switch checks all three); request b owns rows
            `[cu_seq_lens[b], cu_seq_lens[b+1])`.

    Returns None; mutates `dst_k` and `dst_scale` only.
    """


@register_op(
    "fp8_mqa_logits",
    fake=fakes.fake_fp8_mqa_logits,
    check=fakes.check_fp8_mqa_logits,
    debug_check="graphsafe.ops.indexer.debug:debug_check_fp8_mqa_logits",
    family="indexer",
    backends=(reference.FP8_MQA_LOGITS, triton.FP8_MQA_LOGITS, aiter.FP8_MQA_LOGITS),
)
def fp8_mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor) -> Tensor:
    """Indexer logits of M query tokens against N contiguous keys (prefill; DeepGEMM semantics).

    `out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])` for
    `ks[m] <= n < ke[m]`, `-inf` elsewhere. Products are exact in float32 and
    accumulated in float32 (fp8 tensor cores accumulate with slightly less precision).
    A window reaching outside `[0, N)` acts as its intersection with `[0, N)`; keys
    outside every window and queries of empty windows are not read.

    Non-finite inputs follow IEEE arithmetic with `relu(NaN) = NaN`: a NaN in `q[m]`,
    `weights[m]` or `k[n]` (byte 0x7F/0xFF) makes `out[m, n]` NaN inside the window; an
    inf weight or scale gives +-inf, or NaN where it meets a zero (`inf * 0`) or an
    opposite inf. The NaN's sign bit is not specified.

    Args:
        q: `[M, H, D]` float8_e4m3fn, the indexer queries; last dim contiguous.
        k: `[N, D]` float8_e4m3fn, the keys (e.g. from `cp_gather_indexer_k_quant_cache`);
            last dim contiguous.
        k_scale: `[N]` float32, the per-key dequantisation scales.
        weights: `[M, H]` float32, the per-head weights (softmax scale folded in).
        ks: `[M]` int32, first key of row m's window (inclusive).
        ke: `[M]` int32, end of row m's window (exclusive); an empty window gives a -inf row.
            Non-empty windows should lie in `[0, N]` (the debug switch checks it).

    Returns:
        logits: `[M, N]` float32, contiguous.
    """


@register_op(
    "fp8_paged_mqa_logits",
    fake=fakes.fake_fp8_paged_mqa_logits,
    check=fakes.check_fp8_paged_mqa_logits,
    debug_check="graphsafe.ops.indexer.debug:debug_check_fp8_paged_mqa_logits",
    family="indexer",
    backends=(reference.FP8_PAGED_MQA_LOGITS, triton.FP8_PAGED_MQA_LOGITS),
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
    A block id outside `[0, num_blocks)` (padding -1 included) holds no keys: its
    positions are `-inf` in every row, exactly like positions past the context, and
    nothing is read from the cache for them.

    Non-finite inputs follow IEEE arithmetic with `relu(NaN) = NaN`: a NaN in `q[b, i]`,
    in row r's weights, or in key n's bytes (0x7F/0xFF) or scale makes `out[r, n]` NaN
    where the key is visible; an inf weight or scale gives +-inf, or NaN where it meets a
    zero or an opposite inf. The NaN's sign bit is not specified.

    Args:
        q: `[B, next_n, H, D]` float8_e4m3fn, 1 <= next_n <= 4 (MTP); last dim contiguous.
        kv_cache: `uint8 [num_blocks, block_size, D + 4]`, one scale per token (layout above).
        weights: `[B * next_n, H]` float32, per-head weights of each row.
        context_lens: `[B]` int32, tokens in each request's cache (the new ones included).
            Values are clamped to `[0, max_model_len]` for reading keys; the debug switch
            refuses values outside that range.
        block_table: `[B, max_blocks]` int32, last dim contiguous. Needs
            `max_blocks * block_size >= max_model_len` (checked); entries for positions
            below the context should be valid block ids or -1 (padding, see above; the
            debug switch checks it).
        max_model_len: the output width (a host int, so the output shape never depends on data).

    Returns:
        logits: `[B * next_n, max_model_len]` float32, contiguous.
    """


@register_op(
    "req_local_to_global_slots",
    fake=fakes.fake_req_local_to_global_slots,
    check=fakes.check_req_local_to_global_slots,
    debug_check="graphsafe.ops.indexer.debug:debug_check_req_local_to_global_slots",
    family="indexer",
    backends=(reference.REQ_LOCAL_TO_GLOBAL_SLOTS, triton.REQ_LOCAL_TO_GLOBAL_SLOTS),
)
def req_local_to_global_slots(req_id_per_token: Tensor, block_table: Tensor, topk_indices: Tensor, block_size: int) -> Tensor:
    """Map request-local token positions (top-k results) to global cache slots.

    `out[t, j] = block_table[r, p // block_size] * block_size + p % block_size` with
    `r = req_id_per_token[t]`, `p = topk_indices[t, j]`; `-1` where `p < 0` (padding), where
    `p // block_size >= max_blocks`, where `r` is outside `[0, B)`, or where the block id
    is outside `[0, 2^31 // block_size)` (padding -1, or a slot that int32 cannot hold).
    Only the table entries of valid (r, p) pairs are read.

    Args:
        req_id_per_token: `[T]` int32, the request of each token, `-1` for padding (the
            debug switch refuses other values outside `[0, B)`).
        block_table: `[B, max_blocks]` int32, last dim contiguous (the debug switch
            checks the entries read are in `[0, 2^31 // block_size)` or -1).
        topk_indices: `[T, K]` int32, request-local positions, `-1` for none (the debug
            switch refuses other values outside `[0, max_blocks * block_size)`).
        block_size: tokens per cache block (the cache that the slots index).

    Returns:
        slots: `[T, K]` int32, contiguous.
    """


@register_op(
    "sparse_attn_indexer_decode",
    fake=fakes.fake_sparse_attn_indexer_decode,
    check=fakes.check_sparse_attn_indexer_decode,
    debug_check="graphsafe.ops.indexer.debug:debug_check_sparse_attn_indexer_decode",
    mutates_args=("kv_cache", "topk_indices"),
    family="indexer",
    backends=(reference.SPARSE_ATTN_INDEXER_DECODE, composite.SPARSE_ATTN_INDEXER_DECODE),
)
def sparse_attn_indexer_decode(
    kv_cache: Tensor,
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    topk_indices: Tensor,
    scale_fmt: Optional[str],
    topk: int,
    max_model_len: int,
    next_n: int = 1,
    max_num_batched_tokens: int = 0,
) -> None:
    """One layer's DSA indexer step for B decode requests of `next_n` tokens each (vLLM's
    `sparse_attn_indexer`, decode half).

    1. `indexer_k_quant_and_cache(k, kv_cache, slot_mapping, D, scale_fmt)`: the new
       tokens' keys enter the cache (slot < 0: padding, skipped).
    2. `fp8_paged_mqa_logits` of `q` viewed `[B, next_n, H, D]` into workspace scratch
       `[T, max_model_len]` f32: row `t = b * next_n + i` scores keys
       `n < seq_lens[b] - next_n + i + 1` (its own position included).
    3. `top_k_per_row_decode` into `topk_indices[:T]`: the request-local positions n of
       each row's `topk` largest logits (order unspecified; ties: any such set), `-1`
       for the rest of the row (short contexts, padding requests with `seq_lens[b] = 0`)
       and for columns `>= topk`. Map them to cache slots with `req_local_to_global_slots`.

    Out-of-range ids act as padding, as in the ops above: a slot outside the cache is
    skipped, a block id outside `[0, num_blocks)` holds no keys (its positions score
    -inf). Non-finite keys, queries and weights give the NaN/inf cache entries and logits
    the ops above define; the top-k then orders them as `top_k_per_row_decode` does.

    Every size comes from shapes and host ints, so the op captures into a CUDA graph and
    replays with other `seq_lens`, block tables and slots. The logits and the top-k
    scratch come from the workspace manager; before carving, the call reserves the worst
    case of `max(T, max_num_batched_tokens)` tokens
    (`sparse_attn_indexer_decode_workspace`), so a warm-up call at the largest batch sizes
    the arena for every later capture.

    Args:
        kv_cache: `uint8 [num_blocks, block_size, D + 4]`, mutated: the indexer K cache
            (module docstring), one float32 scale per token.
        q: `[T, H, D]` float8_e4m3fn, T = B * next_n query tokens, request-major (token i of
            request b is row `b * next_n + i`, its newest token last); last dim contiguous.
            The query's own quantisation scale is folded into `weights` (vLLM does so).
        k: `[T, D]` bf16/fp16/fp32, the new tokens' indexer keys; last dim contiguous.
        weights: `[T, H]` float32, per-head weights of each token (softmax scale folded in).
        slot_mapping: `[T]` int64 (int32 accepted), contiguous: the cache slot of each new
            token, `-1` for padding tokens (other slots outside the cache: skipped too;
            the debug switch refuses them).
        seq_lens: `[B]` int32, contiguous: tokens in each request's cache, the new ones
            included (`0` for a padding request). Keys are read up to `max_model_len`;
            the debug switch refuses lengths outside `[0, max_model_len]`.
        block_table: `[B, max_blocks]` int32, last dim contiguous;
            `max_blocks * block_size >= max_model_len` (checked). Entries below a
            request's context should be valid block ids or -1 (the debug switch checks it).
        topk_indices: `[>= T, K]` int32, mutated: the shared top-k buffer (e.g. vLLM's
            `topk_indices_buffer` of `max_num_batched_tokens` rows); rows `[0, T)` are
            written entirely, the rest is left untouched. Last dim contiguous.
        scale_fmt: None (float32 key scales) or "ue8m0" (power-of-two scales, DeepSeek-V3.2).
        topk: positions per row, `0 <= topk <= K` (2048 for DeepSeek-V3.2).
        max_model_len: the logits width (a host int: shapes never depend on data).
        next_n: query tokens per request, 1 to 4 (MTP: 2).
        max_num_batched_tokens: the largest T the caller will pass (sizes the workspace
            reservation); 0 means this call's T.

    Returns None; mutates `kv_cache` (the new tokens' slots) and `topk_indices` (rows < T).
    """


@register_op(
    "sparse_attn_indexer_prefill",
    fake=fakes.fake_sparse_attn_indexer_prefill,
    check=fakes.check_sparse_attn_indexer_prefill,
    debug_check="graphsafe.ops.indexer.debug:debug_check_sparse_attn_indexer_prefill",
    mutates_args=("kv_cache", "topk_indices"),
    family="indexer",
    backends=(reference.SPARSE_ATTN_INDEXER_PREFILL, composite.SPARSE_ATTN_INDEXER_PREFILL),
)
def sparse_attn_indexer_prefill(
    kv_cache: Tensor,
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    cu_seq_lens: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    topk_indices: Tensor,
    scale_fmt: Optional[str],
    topk: int,
    total_seq_lens: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    max_num_batched_tokens: int = 0,
    max_total_seq_lens: int = 0,
) -> None:
    """One layer's DSA indexer step for T prefill tokens of B requests (vLLM's
    `sparse_attn_indexer`, prefill half, with the window metadata of its
    `DeepseekV32IndexerPrefillChunkMetadata`).

    1. `indexer_k_quant_and_cache(k, kv_cache, slot_mapping, D, scale_fmt)`.
    2. `cp_gather_indexer_k_quant_cache` of every request's context (the new keys
       included) into workspace rows `[cu_seq_lens[b], cu_seq_lens[b + 1])` of a
       `[total_seq_lens, D]` fp8 buffer and its scales.
    3. In chunks of query rows: `fp8_mqa_logits` of the chunk against all gathered keys
       (windows `[cu_seqlen_ks[t], cu_seqlen_ke[t])`) into workspace scratch, then
       `top_k_per_row_prefill`, which writes `n - cu_seqlen_ks[t]`, the request-local
       positions, into `topk_indices[t]` (`-1` tail as in decode). A padding token gets
       an empty window (`cu_seqlen_ke <= cu_seqlen_ks`) and slot -1: its row is all -1.

    Out-of-range ids act as padding: a slot outside the cache is skipped; a block id
    outside `[0, num_blocks)` gathers a zero key (bytes 0x00, scale 0.0, so its logits
    are 0 for finite queries and weights). Non-finite inputs give the NaN/inf cache
    entries and logits the ops above define; the top-k orders them as
    `top_k_per_row_prefill` does. Windows reaching into gathered rows past
    `cu_seq_lens[B]` score unspecified (finite or not) workspace contents: keep them
    inside (the debug switch checks it).

    A chunk holds the most rows whose logits `[rows, N]` f32 and nested top-k scratch fit
    `max_chunk_bytes` (`prefill_chunk_rows`; at least one row). The plan depends on
    (T, total_seq_lens, topk, max_chunk_bytes) only, never on data. Before carving, the
    call reserves the worst case of `max(T, max_num_batched_tokens)` tokens and
    `max(total_seq_lens, max_total_seq_lens)` keys (`sparse_attn_indexer_prefill_workspace`).

    Args:
        kv_cache: `uint8 [num_blocks, block_size, D + 4]`, mutated: the indexer K cache.
        q: `[T, H, D]` float8_e4m3fn, the prefill queries; last dim contiguous.
        k: `[T, D]` bf16/fp16/fp32, their indexer keys; last dim contiguous.
        weights: `[T, H]` float32, per-head weights (softmax and q scales folded in).
        slot_mapping: `[T]` int64 (int32 accepted), contiguous; `-1` for padding tokens.
        block_table: `[B, max_blocks]` int32, last dim contiguous: the requests' blocks.
            Entries below each request's context should be valid block ids or -1 (the
            debug switch checks it).
        cu_seq_lens: `[B + 1]` int32, contiguous, non-decreasing, `0 <= cu_seq_lens[0]`,
            `cu_seq_lens[B] <= total_seq_lens` (the debug switch checks these): request
            b's context (the new tokens included) is gathered into rows
            `[cu_seq_lens[b], cu_seq_lens[b + 1])`.
        cu_seqlen_ks: `[T]` int32, contiguous: first gathered key of token t's window
            (`cu_seq_lens[b]` for a token of request b).
        cu_seqlen_ke: `[T]` int32, contiguous: end of token t's window (exclusive),
            `cu_seq_lens[b] + (its position in the request) + 1` for causal prefill.
            Non-empty windows must lie inside the gathered rows `[0, cu_seq_lens[B])`
            (the debug switch checks it).
        topk_indices: `[>= T, K]` int32, mutated; rows `[0, T)` written entirely (pass a
            row slice of the shared buffer, e.g. after the decode tokens).
        scale_fmt: None or "ue8m0".
        topk: positions per row, `0 <= topk <= K`.
        total_seq_lens: N, the gathered key rows: a host int `>= cu_seq_lens[B]` (an upper
            bound is fine; rows past `cu_seq_lens[B]` are never scored).
        max_chunk_bytes: bound of one chunk's logits plus top-k scratch (default 512 MiB).
        max_num_batched_tokens: the largest T the caller will pass (0: this call's T).
        max_total_seq_lens: the largest N the caller will pass (0: this call's N).

    Returns None; mutates `kv_cache` (the new tokens' slots) and `topk_indices` (rows < T).
    """
