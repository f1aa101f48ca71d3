"""Reference backend of the sparse-indexer ops: the executable spec, vectorised PyTorch.

No host sync anywhere (no .item(), no boolean-mask indexing, no data-dependent shapes):
invalid entries are redirected to a safe index and masked with `torch.where` instead.
The logits ops loop over heads (never over tokens) so that the largest temporary is one
`[rows, keys]` float32 matrix rather than `[rows, heads, keys]`. The composites are the
composition of the reference ops (the top-k ones through the registry's reference
backend), with the prefill logits chunked by the same plan as the Triton backend.
"""

from __future__ import annotations

import torch

from graphsafe.formats import indexer_k as layout
from graphsafe.ops.cache.reference import scatter_tokens
from graphsafe.ops.indexer import plan
from graphsafe.registry import Backend

NEG_INF = float("-inf")


def _dense(x: torch.Tensor) -> torch.Tensor:
    """`x` with exactly the row-major strides of a fresh tensor (what the fakes promise),
    also for empty shapes, where `.contiguous()` may keep odd strides."""
    strides, acc = [], 1
    for size in reversed(x.shape):
        strides.append(acc)
        acc *= max(size, 1)
    if tuple(x.stride()) == tuple(reversed(strides)):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None) -> None:
    d = k.shape[1]
    values, scales = layout.cache_views(kv_cache, d)
    if k.shape[0] == 0 or values.shape[0] == 0:
        return
    q, s = layout.quantize(k, quant_block_size, scale_fmt)
    scatter_tokens(values, slot_mapping, q.view(torch.uint8))
    scatter_tokens(scales, slot_mapping, s)


def request_of_rows(rows: torch.Tensor, cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """The request each row falls to: the binary search over `cu_seq_lens` that the
    Triton kernel runs (`lo, hi = 0, B; while lo < hi: mid = (lo + hi) // 2; lo, hi =
    (mid + 1, hi) if cu[mid + 1] <= r else (lo, mid)`), vectorised over rows. For a
    non-decreasing `cu` it is `searchsorted(cu[1:], r, right=True)`; for a decreasing one
    it is still one defined request per row (the loop runs bit_length(B) steps, not
    one per row)."""
    b = cu_seq_lens.shape[0] - 1
    lo = torch.zeros_like(rows)
    hi = torch.full_like(rows, b)
    ends = cu_seq_lens[1:].long()
    for _ in range(max(1, b.bit_length())):
        active = lo < hi
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        right = ends[mid.clamp(0, max(b - 1, 0))] <= rows
        lo = torch.where(active & right, mid + 1, lo)
        hi = torch.where(active & ~right, mid, hi)
    return lo


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    n, d = dst_k.shape
    values, scales = layout.cache_views(kv_cache, d)
    num_blocks, block_size = values.shape[:2]
    b, max_blocks = block_table.shape
    if n == 0 or b == 0:
        return
    rows = torch.arange(n, device=dst_k.device)
    req = request_of_rows(rows, cu_seq_lens)
    req_c = req.clamp_max(b - 1)
    t = rows - cu_seq_lens[req_c].long()
    # Row r belongs to request req if it lies in [cu[req], cu[req + 1]); the binary
    # search guarantees the upper end, `t >= 0` the lower one.
    owned = (req < b) & (t >= 0)
    logical = torch.div(t, block_size, rounding_mode="floor")
    in_table = owned & (logical < max_blocks)
    if max_blocks > 0:
        blk = block_table[req_c, logical.clamp(0, max_blocks - 1)].long()
    else:
        blk = torch.full_like(t, -1)
    # A padding block (or a position past the table) gives a zero row: value bytes 0x00,
    # scale +0.0. Indexing goes to token 0 of block 0 instead, discarded by the where.
    valid = in_table & (blk >= 0) & (blk < num_blocks)
    if num_blocks > 0:
        blk = torch.where(valid, blk, 0)
        off = torch.where(valid, t % block_size, 0)
        k_rows = torch.where(valid[:, None], values[blk, off], 0)  # [N, D] uint8
        s_rows = torch.where(valid[:, None], scales[blk, off], 0.0).reshape(dst_scale.shape)
    else:
        k_rows = torch.zeros((n, d), dtype=torch.uint8, device=dst_k.device)
        s_rows = torch.zeros(dst_scale.shape, dtype=torch.float32, device=dst_k.device)
    dst_u8 = dst_k.view(torch.uint8)
    dst_u8.copy_(torch.where(owned[:, None], k_rows, dst_u8))
    keep = owned.view(-1, *([1] * (dst_scale.dim() - 1)))
    dst_scale.copy_(torch.where(keep, s_rows, dst_scale))


def fp8_mqa_logits(q, k, k_scale, weights, ks, ke):
    m, h, _ = q.shape
    n = k.shape[0]
    kf = k.to(torch.float32)
    acc = torch.zeros((m, n), dtype=torch.float32, device=q.device)
    for head in range(h):
        s = q[:, head].to(torch.float32) @ kf.T
        acc += s.clamp_min(0) * weights[:, head : head + 1]
    logits = acc * k_scale[None, :]
    cols = torch.arange(n, device=q.device)
    valid = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    return _dense(torch.where(valid, logits, NEG_INF))


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_model_len):
    b, next_n, h, d = q.shape
    values, scales = layout.cache_views(kv_cache, d)
    num_blocks, block_size = values.shape[:2]
    length = max_model_len
    # Key n of request r lives in block block_table[r, n // block_size]. A block id
    # outside [0, num_blocks) (padding -1 or garbage) holds no keys: its positions are
    # -inf, like positions past the context. Invalid ids index block 0, discarded below.
    pos = torch.arange(length, device=q.device)
    raw = block_table[:, pos // block_size].long()
    has_key = (raw >= 0) & (raw < num_blocks)  # [B, L]
    blk = torch.where(has_key, raw, 0)
    off = torch.where(has_key, pos % block_size, 0)
    if num_blocks == 0:  # nothing to index: every position is a padding block's
        values, scales = values.new_zeros((1, 1, d)), scales.new_zeros((1, 1, 1))
    keys = values[blk, off].view(layout.FP8).to(torch.float32)  # [B, L, D]
    key_scale = scales[blk, off, 0]  # [B, L]
    acc = torch.zeros((b, next_n, length), dtype=torch.float32, device=q.device)
    w = weights.view(b, next_n, h)
    for head in range(h):
        s = torch.bmm(q[:, :, head].to(torch.float32), keys.transpose(1, 2))  # [B, next_n, L]
        acc += s.clamp_min(0) * w[:, :, head, None]
    logits = acc * key_scale[:, None, :]
    # Row (r, i) sees keys n < context_lens[r] - next_n + i + 1 (its own position).
    limit = context_lens.long()[:, None] - next_n + 1 + torch.arange(next_n, device=q.device)[None, :]
    valid = (pos[None, None, :] < limit[:, :, None]) & has_key[:, None, :]
    return _dense(torch.where(valid, logits, NEG_INF).reshape(b * next_n, length))


def req_local_to_global_slots(req_id_per_token, block_table, topk_indices, block_size):
    b, max_blocks = block_table.shape
    if b == 0 or max_blocks == 0:
        return _dense(torch.full(topk_indices.shape, -1, dtype=torch.int32, device=topk_indices.device))
    req = req_id_per_token.long()
    req_ok = (req >= 0) & (req < b)
    pos = topk_indices.long()
    logical = torch.div(pos, block_size, rounding_mode="floor")
    valid = req_ok[:, None] & (pos >= 0) & (logical < max_blocks)
    blk = block_table[req.clamp(0, b - 1)[:, None], logical.clamp(0, max_blocks - 1)].long()
    # A block id outside [0, 2^31 // block_size) (padding -1) has no int32 slots: -1.
    valid = valid & (blk >= 0) & (blk < max_block_id(block_size))
    slots = blk * block_size + pos % block_size
    return _dense(torch.where(valid, slots, -1).to(torch.int32))


def max_block_id(block_size: int) -> int:
    """The block ids whose slots fit int32: `[0, 2^31 // block_size)`."""
    return 2**31 // block_size


def _reference(op: str):
    from graphsafe.registry import get_op

    return get_op(op).backend_impl("reference")


def sparse_attn_indexer_decode(
    kv_cache, q, k, weights, slot_mapping, seq_lens, block_table, topk_indices,
    scale_fmt, topk, max_model_len, next_n=1, max_num_batched_tokens=0,
) -> None:
    t, h, d = q.shape
    indexer_k_quant_and_cache(k, kv_cache, slot_mapping, d, scale_fmt)
    if t == 0:
        return
    b = seq_lens.shape[0]
    logits = fp8_paged_mqa_logits(q.view(b, next_n, h, d), kv_cache, weights, seq_lens, block_table, max_model_len)
    _reference("top_k_per_row_decode")(logits, next_n, seq_lens, topk_indices[:t], topk)


def sparse_attn_indexer_prefill(
    kv_cache, q, k, weights, slot_mapping, block_table, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke, topk_indices,
    scale_fmt, topk, total_seq_lens, max_chunk_bytes=plan.DEFAULT_MAX_CHUNK_BYTES,
    max_num_batched_tokens=0, max_total_seq_lens=0,
) -> None:
    t, h, d = q.shape
    indexer_k_quant_and_cache(k, kv_cache, slot_mapping, d, scale_fmt)
    if t == 0:
        return
    # Zeros, not empty: rows past cu_seq_lens[B] are never scored, but stay defined.
    keys = torch.zeros((total_seq_lens, d), dtype=torch.uint8, device=q.device).view(layout.FP8)
    scales = torch.zeros((total_seq_lens,), dtype=torch.float32, device=q.device)
    cp_gather_indexer_k_quant_cache(kv_cache, keys, scales, block_table, cu_seq_lens)
    select = _reference("top_k_per_row_prefill")
    for m0, m1 in plan.prefill_chunks(t, total_seq_lens, topk, max_chunk_bytes, q.device):
        ks, ke = cu_seqlen_ks[m0:m1], cu_seqlen_ke[m0:m1]
        logits = fp8_mqa_logits(q[m0:m1], keys, scales, weights[m0:m1], ks, ke)
        select(logits, ks, ke, topk_indices[m0:m1], topk)


# -- the records (graphsafe/ops/indexer/__init__.py names them) ------------------------------
INDEXER_K_QUANT_AND_CACHE = Backend(name="reference", impl=indexer_k_quant_and_cache)
CP_GATHER_INDEXER_K_QUANT_CACHE = Backend(name="reference", impl=cp_gather_indexer_k_quant_cache)
FP8_MQA_LOGITS = Backend(name="reference", impl=fp8_mqa_logits)
FP8_PAGED_MQA_LOGITS = Backend(name="reference", impl=fp8_paged_mqa_logits)
REQ_LOCAL_TO_GLOBAL_SLOTS = Backend(name="reference", impl=req_local_to_global_slots)
SPARSE_ATTN_INDEXER_DECODE = Backend(name="reference", impl=sparse_attn_indexer_decode)
SPARSE_ATTN_INDEXER_PREFILL = Backend(name="reference", impl=sparse_attn_indexer_prefill)
