"""Value checks of the indexer ops for `graphsafe.debug_checks` (they read device tensors,
so they sync; off by default). Each check looks only at the ids an op reads: block-table
entries below a request's length, slots of the tokens written, and the host-int bounds
(`max_model_len`, `total_seq_lens`) that lengths must respect.
"""

from __future__ import annotations

import torch

from graphsafe import debug
from graphsafe.ops.indexer.reference import max_block_id


def _windows_inside(op: str, ks: torch.Tensor, ke: torch.Tensor, high: int, ks_arg: str, ke_arg: str) -> None:
    """Every non-empty window `[ks, ke)` lies inside `[0, high)`."""
    open_ = ke.long() > ks.long()
    debug.ids_in_range(op, ks_arg, ks, high + 1, used=open_, padding=None, what="window starts of non-empty windows")
    debug.ids_in_range(op, ke_arg, ke, high + 1, used=open_, padding=None, what="window ends of non-empty windows")


def debug_check_indexer_k_quant_and_cache(call) -> None:
    kv_cache, slot_mapping = call.kv_cache, call.slot_mapping
    nb, bs = kv_cache.shape[:2]
    debug.ids_in_range("indexer_k_quant_and_cache", "slot_mapping", slot_mapping, nb * bs, what="cache slots")


def debug_check_cp_gather_indexer_k_quant_cache(call) -> None:
    kv_cache, dst_k, block_table, cu_seq_lens = call.kv_cache, call.dst_k, call.block_table, call.cu_seq_lens
    op = "cp_gather_indexer_k_quant_cache"
    debug.non_decreasing(op, "cu_seq_lens", cu_seq_lens)
    n = dst_k.shape[0]
    debug.values_at_least(op, "cu_seq_lens", cu_seq_lens, 0, "the first row of dst_k", used=slice(0, 1))
    debug.values_at_most(op, "cu_seq_lens", cu_seq_lens, n, "the rows of dst_k", used=slice(-1, None))
    lengths = cu_seq_lens[1:].long() - cu_seq_lens[:-1].long()
    bs = kv_cache.shape[1]
    debug.ids_in_range(op, "block_table", block_table, kv_cache.shape[0], used=debug.table_entries_read(block_table, lengths, bs),
                       what="block ids (below each request's length)")


def debug_check_fp8_mqa_logits(call) -> None:
    _windows_inside("fp8_mqa_logits", call.ks, call.ke, call.k.shape[0], "ks", "ke")


def debug_check_fp8_paged_mqa_logits(call) -> None:
    kv_cache, block_table = call.kv_cache, call.block_table
    context_lens, max_model_len = call.context_lens, call.max_model_len
    op = "fp8_paged_mqa_logits"
    debug.values_at_least(op, "context_lens", context_lens, 0, "a length")
    debug.values_at_most(op, "context_lens", context_lens, max_model_len, "max_model_len")
    used = debug.table_entries_read(block_table, context_lens.long().clamp_max(max_model_len), kv_cache.shape[1])
    debug.ids_in_range(op, "block_table", block_table, kv_cache.shape[0], used=used,
                       what="block ids (below each request's context)")


def debug_check_req_local_to_global_slots(call) -> None:
    req_id_per_token, block_table, topk_indices, block_size = call
    op = "req_local_to_global_slots"
    b, max_blocks = block_table.shape
    debug.ids_in_range(op, "req_id_per_token", req_id_per_token, b, what="request ids")
    debug.ids_in_range(op, "topk_indices", topk_indices, max_blocks * block_size,
                       what="positions covered by the block table")
    # The table entries the valid (request, position) pairs reach.
    req, pos = req_id_per_token.long(), topk_indices.long()
    ok = ((req >= 0) & (req < b))[:, None] & (pos >= 0) & (pos < max_blocks * block_size)
    if b > 0 and max_blocks > 0:
        used = torch.zeros((b, max_blocks), dtype=torch.bool, device=block_table.device)
        rows = torch.where(ok, req.clamp(0, b - 1)[:, None], 0)
        cols = torch.where(ok, torch.div(pos, block_size, rounding_mode="floor").clamp(0, max_blocks - 1), 0)
        used.index_put_((rows[ok], cols[ok]), torch.ones((), dtype=torch.bool, device=used.device))
        debug.ids_in_range(op, "block_table", block_table, max_block_id(block_size), used=used,
                           what="block ids (whose slots fit int32)")


def debug_check_sparse_attn_indexer_decode(call) -> None:
    kv_cache, slot_mapping, block_table = call.kv_cache, call.slot_mapping, call.block_table
    seq_lens, max_model_len = call.seq_lens, call.max_model_len
    op = "sparse_attn_indexer_decode"
    nb, bs = kv_cache.shape[:2]
    debug.ids_in_range(op, "slot_mapping", slot_mapping, nb * bs, what="cache slots")
    debug.values_at_least(op, "seq_lens", seq_lens, 0, "a length")
    debug.values_at_most(op, "seq_lens", seq_lens, max_model_len, "max_model_len")
    debug.ids_in_range(op, "block_table", block_table, nb, used=debug.table_entries_read(block_table, seq_lens, bs),
                       what="block ids (below each request's context)")


def debug_check_sparse_attn_indexer_prefill(call) -> None:
    kv_cache, slot_mapping, block_table = call.kv_cache, call.slot_mapping, call.block_table
    cu_seq_lens, total_seq_lens = call.cu_seq_lens, call.total_seq_lens
    cu_seqlen_ks, cu_seqlen_ke = call.cu_seqlen_ks, call.cu_seqlen_ke
    op = "sparse_attn_indexer_prefill"
    nb, bs = kv_cache.shape[:2]
    debug.ids_in_range(op, "slot_mapping", slot_mapping, nb * bs, what="cache slots")
    debug.non_decreasing(op, "cu_seq_lens", cu_seq_lens)
    debug.values_at_least(op, "cu_seq_lens", cu_seq_lens, 0, "the first gathered row", used=slice(0, 1))
    debug.values_at_most(op, "cu_seq_lens", cu_seq_lens, total_seq_lens, "total_seq_lens",
                          used=slice(-1, None))
    lengths = cu_seq_lens[1:].long() - cu_seq_lens[:-1].long()
    debug.ids_in_range(op, "block_table", block_table, nb, used=debug.table_entries_read(block_table, lengths, bs),
                       what="block ids (below each request's context)")
    gathered = int(cu_seq_lens[-1]) if cu_seq_lens.numel() else 0
    _windows_inside(op, cu_seqlen_ks, cu_seqlen_ke, gathered, "cu_seqlen_ks", "cu_seqlen_ke")


__all__ = [name for name in dir() if name.startswith("debug_check_")]
