"""Triton backend of the composite indexer ops: the public ops, composed, over workspace
scratch (the pattern of vLLM PR #41002: intermediates from `get_simultaneous`).

The K-cache write, the gather and the top-k go through their public ops (so each
dispatches to its own best backend, aiter's on ROCm included). The logits kernels are
called through this family's `*_into` launchers: the public logits ops return fresh
tensors, and a composite must not allocate (its only outputs are the mutated buffers).
They run with `clean=False`: the top-k reads each row's valid range only, so the -inf
fill of the rest (up to `max_model_len`, or whole tiles outside every prefill window)
is skipped.

Workspace discipline: each call first reserves the worst case its host ints allow
(`plan.py`), nested top-k scratch included, then carves its regions and holds them
(`WorkspaceManager.hold`) while the nested ops take their own scratch after them. Growth
can only happen in that reservation, never while views are held or a graph is captured
(a warm-up call at the largest sizes grows the arena once).
"""

from __future__ import annotations

import functools

import torch

from graphsafe.ops.indexer import plan
from graphsafe.ops.indexer.triton import mqa_logits_into, paged_mqa_logits_into
from graphsafe.workspace import current_workspace_manager, workspace_bytes

_ops = torch.ops.graphsafe
# Overloads resolved once: an attribute walk per call costs microseconds.
_quant = _ops.indexer_k_quant_and_cache.default
_gather = _ops.cp_gather_indexer_k_quant_cache.default
_topk_decode = _ops.top_k_per_row_decode.default
_topk_prefill = _ops.top_k_per_row_prefill.default

DECODE = "sparse_attn_indexer_decode"
PREFILL = "sparse_attn_indexer_prefill"


def sparse_attn_indexer_decode(
    kv_cache, q, k, weights, slot_mapping, seq_lens, block_table, topk_indices,
    scale_fmt, topk, max_model_len, next_n=1, max_num_batched_tokens=0,
) -> None:
    t, h, d = q.shape
    ws = current_workspace_manager(q.device)
    worst = plan.decode_bytes(max(t, max_num_batched_tokens), max_model_len, topk)
    ws.reserve(nbytes=max(worst, plan.decode_bytes(t, max_model_len, topk)), owner=DECODE)
    _quant(k, kv_cache, slot_mapping, d, scale_fmt)
    if t == 0:
        return
    (logits,) = ws.get_simultaneous(((t, max_model_len), torch.float32), owner=DECODE)
    b = seq_lens.shape[0]
    q4 = q.view(b, next_n, h, d)
    paged_mqa_logits_into(logits, q4, kv_cache, weights, seq_lens, block_table, max_model_len, clean=False)
    with ws.hold(logits):
        _topk_decode(logits, next_n, seq_lens, topk_indices[:t], topk)


@functools.lru_cache(maxsize=256)
def _prefill_worst_bytes(tokens: int, keys: int, heads: int, head_dim: int, topk: int, max_chunk_bytes: int) -> int:
    specs = plan.sparse_attn_indexer_prefill_workspace(
        tokens, 0, heads, head_dim, topk, max_total_seq_lens=keys, max_chunk_bytes=max_chunk_bytes
    )
    return workspace_bytes(*specs)


def sparse_attn_indexer_prefill(
    kv_cache, q, k, weights, slot_mapping, block_table, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke, topk_indices,
    scale_fmt, topk, total_seq_lens, max_chunk_bytes=plan.DEFAULT_MAX_CHUNK_BYTES,
    max_num_batched_tokens=0, max_total_seq_lens=0,
) -> None:
    t, h, d = q.shape
    n = total_seq_lens
    ws = current_workspace_manager(q.device)
    need = plan.prefill_bytes(t, n, d, topk, max_chunk_bytes)
    max_t, max_n = max(t, max_num_batched_tokens), max(n, max_total_seq_lens)
    worst = _prefill_worst_bytes(max_t, max_n, h, d, topk, max_chunk_bytes)
    ws.reserve(nbytes=max(need, worst), owner=PREFILL)
    _quant(k, kv_cache, slot_mapping, d, scale_fmt)
    if t == 0:
        return
    keys, scales, logits = ws.get_simultaneous(*plan.prefill_specs(t, n, d, topk, max_chunk_bytes), owner=PREFILL)
    rows = logits.shape[0]
    with ws.hold(keys, scales, logits):
        _gather(kv_cache, keys, scales, block_table, cu_seq_lens)
        for m0 in range(0, t, rows):
            m1 = min(t, m0 + rows)
            out = logits[: m1 - m0]
            ks, ke = cu_seqlen_ks[m0:m1], cu_seqlen_ke[m0:m1]
            mqa_logits_into(out, q[m0:m1], keys, scales, weights[m0:m1], ks, ke, clean=False)
            _topk_prefill(out, ks, ke, topk_indices[m0:m1], topk)
