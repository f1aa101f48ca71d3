"""Triton backend of the composite indexer ops (`sparse_attn_indexer_decode` / `_prefill`):
the public ops, composed, over workspace scratch (the pattern of vLLM PR #41002:
intermediates from `get_simultaneous`). Its records are the composites' "triton" backend.

The K-cache write, the gather and the top-k are the public ops (so each runs on its own
best backend, aiter's on ROCm included), bound once per signature of the composite
through `OpSpec.bound`: a call runs their runners directly, without the dispatcher. The
logits kernels are bound by this family's `bind_*_logits` (graphsafe/ops/indexer/triton.py):
the public logits ops return fresh tensors, and a composite must not allocate (its only
outputs are the mutated buffers). They run with `clean=False`: the top-k reads each row's
valid range only, so the -inf fill of the rest (up to `max_model_len`, or whole tiles
outside every prefill window) is skipped.

Workspace discipline: each call first makes sure the arena holds the worst case its host
ints allow, nested top-k scratch included, then carves its regions and holds them
(`WorkspaceManager.hold`) while the nested ops take their own scratch after them.
Growth can only happen in that reservation, never while views are held or a graph is
captured (a warm-up call at the largest sizes grows the arena once).

`prepare_*(call)` takes the signature's plan from `plan.choose_sparse_attn_indexer_*`
(the bytes reserved, the regions, the prefill chunks, the logits launches: the same
decision the records' `workspace` sizes from shapes) and binds the launches and the
nested ops' runners, on workspace views carved exactly as every call carves them (same
specs, same slices: same shapes and strides, so the nested runners' signature holds for
every call).
"""

from __future__ import annotations

import torch

from graphsafe.ops.indexer import plan
from graphsafe.ops.indexer.triton import bind_mqa_logits, bind_paged_mqa_logits
from graphsafe.registry import Backend, get_op
from graphsafe.workspace import current_workspace_manager

DECODE = "sparse_attn_indexer_decode"
PREFILL = "sparse_attn_indexer_prefill"
# The owner of the views a prepare carves to bind the nested ops (`stats().requests`
# then counts the calls of each composite alone).
PREPARE = " (prepare)"


def _arena(device: torch.device, worst: int, owner: str):
    """The device's workspace manager, grown to `worst` bytes if it is smaller (reserve()
    is a no-op otherwise, but costs a call: a composite asks on every call)."""
    ws = current_workspace_manager(device)
    if ws.size_bytes < worst:
        ws.reserve(nbytes=worst, owner=owner)
    return ws


def prepare_sparse_attn_indexer_decode(call):
    choice = plan.choose_sparse_attn_indexer_decode(call)
    kv_cache, q, k, seq_lens = call.kv_cache, call.q, call.k, call.seq_lens
    t, h, d = q.shape
    device = q.device
    kind = device.type
    worst = choice.reserve_bytes
    quant = get_op("indexer_k_quant_and_cache").bound(kind, k, kv_cache, call.slot_mapping, d, call.scale_fmt)
    ws = current_workspace_manager(device)
    ws.reserve(nbytes=worst, owner=DECODE)
    if choice.logits is None:  # T = 0: the keys are cached, nothing is scored
        def run(kv_cache, q, k, weights, slot_mapping, seq_lens, block_table, topk_indices,
                scale_fmt, topk, max_model_len, next_n=1, max_num_batched_tokens=0) -> None:
            _arena(device, worst, DECODE)  # the worst case is reserved on every path
            quant(k, kv_cache, slot_mapping, d, scale_fmt)

        return run

    specs = choice.regions
    (logits,) = ws.get_simultaneous(*specs, owner=DECODE + PREPARE)
    b = seq_lens.shape[0]
    fill = bind_paged_mqa_logits(choice.logits, q.view(b, call.next_n, h, d), kv_cache, call.weights,
                                 call.block_table, call.max_model_len, logits.stride(0))
    whole = not choice.slice_topk  # no slice needed per call
    topk_indices = call.topk_indices
    select = get_op("top_k_per_row_decode").bound(kind, logits, call.next_n, seq_lens,
                                                  topk_indices if whole else topk_indices[:t], call.topk)

    def run(kv_cache, q, k, weights, slot_mapping, seq_lens, block_table, topk_indices,
            scale_fmt, topk, max_model_len, next_n=1, max_num_batched_tokens=0) -> None:
        ws = _arena(device, worst, DECODE)
        quant(k, kv_cache, slot_mapping, d, scale_fmt)
        (logits,) = ws.get_simultaneous(*specs, owner=DECODE)
        # q as [T, H, D]: the runner reads its address only (strides bound for [B, next_n, H, D]).
        fill(logits, q, kv_cache, weights, seq_lens, block_table, max_model_len)
        with ws.hold(logits):
            select(logits, next_n, seq_lens, topk_indices if whole else topk_indices[:t], topk)

    return run


def prepare_sparse_attn_indexer_prefill(call):
    choice = plan.choose_sparse_attn_indexer_prefill(call)
    kv_cache, q, k, weights = call.kv_cache, call.q, call.k, call.weights
    t, h, d = q.shape
    device = q.device
    kind = device.type
    worst = choice.reserve_bytes
    quant = get_op("indexer_k_quant_and_cache").bound(kind, k, kv_cache, call.slot_mapping, d, call.scale_fmt)
    ws = current_workspace_manager(device)
    ws.reserve(nbytes=worst, owner=PREFILL)
    if choice.path == "cache only":  # T = 0
        def run(kv_cache, q, k, weights, slot_mapping, block_table, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke,
                topk_indices, scale_fmt, topk, total_seq_lens, max_chunk_bytes=plan.DEFAULT_MAX_CHUNK_BYTES,
                max_num_batched_tokens=0, max_total_seq_lens=0) -> None:
            _arena(device, worst, PREFILL)  # the worst case is reserved on every path
            quant(k, kv_cache, slot_mapping, d, scale_fmt)

        return run

    specs = choice.regions
    keys, scales, logits = ws.get_simultaneous(*specs, owner=PREFILL + PREPARE)
    gather = get_op("cp_gather_indexer_k_quant_cache").bound(kind, kv_cache, keys, scales, call.block_table,
                                                            call.cu_seq_lens)
    select_op = get_op("top_k_per_row_prefill")
    cu_seqlen_ks, cu_seqlen_ke, topk_indices, topk = call.cu_seqlen_ks, call.cu_seqlen_ke, call.topk_indices, call.topk
    rows = logits.shape[0]
    sizes = list(choice.chunks)
    extra = choice.extra_rows  # rows of the shared buffer past this call's tokens
    launches = dict(choice.logits)

    def step(r: int):
        """(logits runner, top-k runner) of a chunk of r rows: bound on the first r rows,
        whose views have the shapes and strides of any chunk's of r rows."""
        out = logits[:r]
        ks, ke = cu_seqlen_ks[:r], cu_seqlen_ke[:r]
        fill = bind_mqa_logits(launches[r], q[:r], keys, scales, weights[:r], out.stride(0))
        return fill, select_op.bound(kind, out, ks, ke, topk_indices[:r], topk)

    if choice.path == "one chunk":  # the whole call, no slices
        fill, select = step(t)

        def run(kv_cache, q, k, weights, slot_mapping, block_table, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke,
                topk_indices, scale_fmt, topk, total_seq_lens, max_chunk_bytes=plan.DEFAULT_MAX_CHUNK_BYTES,
                max_num_batched_tokens=0, max_total_seq_lens=0) -> None:
            _arena(device, worst, PREFILL)  # the worst case is reserved on every path
            quant(k, kv_cache, slot_mapping, d, scale_fmt)
            keys, scales, logits = ws.get_simultaneous(*specs, owner=PREFILL)
            # logits is the last region: holding it holds the keys and scales before it.
            with ws.hold(logits):
                gather(kv_cache, keys, scales, block_table, cu_seq_lens)
                fill(logits, q, keys, scales, weights, cu_seqlen_ks, cu_seqlen_ke)
                select(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices if not extra else topk_indices[:t], topk)

        return run

    # Chunks of `rows` rows, the last one maybe shorter: one pair of runners per size. A
    # call cuts each per-token input into its chunks with one split_with_sizes (views).
    by_size = {r: step(r) for r in launches}
    steps = tuple(by_size[r] for r in sizes)
    tail = sizes[-1] if sizes[-1] != rows else 0
    full = len(sizes) - (1 if tail else 0)
    idx_sizes = sizes + [extra] if extra else sizes

    def run(kv_cache, q, k, weights, slot_mapping, block_table, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke,
            topk_indices, scale_fmt, topk, total_seq_lens, max_chunk_bytes=plan.DEFAULT_MAX_CHUNK_BYTES,
            max_num_batched_tokens=0, max_total_seq_lens=0) -> None:
        ws = _arena(device, worst, PREFILL)
        quant(k, kv_cache, slot_mapping, d, scale_fmt)
        keys, scales, logits = ws.get_simultaneous(*specs, owner=PREFILL)
        outs = (logits,) * full + ((logits[:tail],) if tail else ())
        chunks = zip(steps, outs, q.split_with_sizes(sizes), weights.split_with_sizes(sizes),
                     cu_seqlen_ks.split_with_sizes(sizes), cu_seqlen_ke.split_with_sizes(sizes),
                     topk_indices.split_with_sizes(idx_sizes))
        with ws.hold(logits):
            gather(kv_cache, keys, scales, block_table, cu_seq_lens)
            for (fill, select), out, q_c, w_c, ks, ke, idx in chunks:
                fill(out, q_c, keys, scales, w_c, ks, ke)
                select(out, ks, ke, idx, topk)

    return run


# -- the records (graphsafe/ops/indexer/__init__.py names them) ------------------------------
SPARSE_ATTN_INDEXER_DECODE = Backend(name="triton", prepare=prepare_sparse_attn_indexer_decode,
                                     workspace=plan.sparse_attn_indexer_decode_workspace)
SPARSE_ATTN_INDEXER_PREFILL = Backend(name="triton", prepare=prepare_sparse_attn_indexer_prefill,
                                      workspace=plan.sparse_attn_indexer_prefill_workspace)
