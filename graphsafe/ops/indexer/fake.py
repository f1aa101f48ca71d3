"""Fakes and input checks of the sparse-indexer ops (K-cache quantise/gather, fp8 MQA
logits, request-local to global slots, the composites): `check_<op>(call)` and
`fake_<op>(call)` take the op's bound call (`OpSpec.call`) and read its fields.

The K-cache layout is described in `graphsafe/formats/indexer_k.py`; the checks repeat
the few facts they need (fakes never import the ops package).
"""

from __future__ import annotations

import torch

from graphsafe import checks as c

FP8 = (torch.float8_e4m3fn,)
U8 = (torch.uint8,)
F32 = (torch.float32,)
I32 = (torch.int32,)
SLOT_DTYPES = (torch.int64, torch.int32)
SCALE_FMTS = (None, "ue8m0")
MAX_NEXT_N = 4


def _head_dim(op: str, arg: str, d: int) -> None:
    # 16-byte rows: the fp8 values of a token start 16-byte aligned inside a block, and the
    # scale region (after block_size * D bytes) is float32-aligned.
    if d % 16 != 0 or d <= 0:
        c.fail(op, arg, "of a head dim D that is a positive multiple of 16", f"D = {d}")


def _k_cache(op: str, kv_cache, head_dim: int, device, groups: int | None = None) -> int:
    """Check a K cache `uint8 [NB, BS, D + 4G]`; returns G (scales per token)."""
    c.tensor(op, "kv_cache", kv_cache, dtypes=U8, ndim=3, device=device)
    width = kv_cache.shape[2]
    if groups is not None:
        c.shape(op, "kv_cache", kv_cache, (None, None, head_dim + 4 * groups), f"[num_blocks, block_size, D + {4 * groups}]")
    elif width <= head_dim or (width - head_dim) % 4 != 0 or head_dim % ((width - head_dim) // 4) != 0:
        c.fail(
            op, "kv_cache", "of shape [num_blocks, block_size, D + 4*G] with G scales per token dividing D",
            f"shape {list(kv_cache.shape)} for D = {head_dim}",
        )
    # Inside a block the bytes are contiguous (tokens, then scales); blocks may be strided.
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width:
        c.fail(op, "kv_cache", "contiguous inside each block (strides [?, D + 4G, 1])", f"strides {kv_cache.stride()}")
    if kv_cache.stride(0) % 4 != 0 or kv_cache.storage_offset() % 4 != 0:
        c.fail(
            op, "kv_cache", "float32-aligned (block stride and storage offset multiples of 4 bytes)",
            f"block stride {kv_cache.stride(0)}, storage offset {kv_cache.storage_offset()}",
        )
    return (width - head_dim) // 4


def _covers_max_model_len(op: str, block_table, bs, max_model_len) -> None:
    need = -(-max_model_len // bs)
    if block_table.shape[1] < need:
        c.fail(
            op, "block_table",
            f"wide enough for max_model_len = {max_model_len} "
            f"(at least ceil({max_model_len} / block_size {bs}) = {need} columns)",
            f"shape {list(block_table.shape)}",
        )


# -- indexer_k_quant_and_cache ---------------------------------------------------------
def check_indexer_k_quant_and_cache(call) -> None:
    op = "indexer_k_quant_and_cache"
    k, kv_cache, slot_mapping, quant_block_size, scale_fmt = call
    c.tensor(op, "k", k, dtypes=c.FLOAT_DTYPES, ndim=2)
    dev = k.device
    t, d = k.shape
    _head_dim(op, "k", d)
    c.last_dim_contiguous(op, "k", k)
    c.positive(op, "quant_block_size", quant_block_size)
    if d % quant_block_size != 0:
        c.fail(op, "quant_block_size", f"a divisor of the head dim D = {d}", quant_block_size)
    if scale_fmt not in SCALE_FMTS:
        c.fail(op, "scale_fmt", 'None or "ue8m0"', repr(scale_fmt))
    _k_cache(op, kv_cache, d, dev, groups=d // quant_block_size)
    c.tensor(op, "slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=dev)
    c.shape(op, "slot_mapping", slot_mapping, (t,), "[T]")
    c.contiguous(op, "slot_mapping", slot_mapping)


def fake_indexer_k_quant_and_cache(call) -> None:
    check_indexer_k_quant_and_cache(call)


# -- cp_gather_indexer_k_quant_cache ---------------------------------------------------
def check_cp_gather_indexer_k_quant_cache(call) -> None:
    op = "cp_gather_indexer_k_quant_cache"
    kv_cache, dst_k, dst_scale, block_table, cu_seq_lens = call
    c.tensor(op, "dst_k", dst_k, dtypes=FP8, ndim=2)
    dev = dst_k.device
    n, d = dst_k.shape
    _head_dim(op, "dst_k", d)
    c.last_dim_contiguous(op, "dst_k", dst_k)
    g = _k_cache(op, kv_cache, d, dev)
    c.tensor(op, "dst_scale", dst_scale, dtypes=F32, device=dev)
    if g == 1:
        c.shape(op, "dst_scale", dst_scale, (n,), "[N] (one scale per token)")
    else:
        c.shape(op, "dst_scale", dst_scale, (n, g), "[N, G]")
        c.last_dim_contiguous(op, "dst_scale", dst_scale)
    c.tensor(op, "block_table", block_table, dtypes=I32, ndim=2, device=dev)
    c.last_dim_contiguous(op, "block_table", block_table)
    c.tensor(op, "cu_seq_lens", cu_seq_lens, dtypes=I32, ndim=1, device=dev)
    c.shape(op, "cu_seq_lens", cu_seq_lens, (block_table.shape[0] + 1,), "[B + 1]")
    c.contiguous(op, "cu_seq_lens", cu_seq_lens)


def fake_cp_gather_indexer_k_quant_cache(call) -> None:
    check_cp_gather_indexer_k_quant_cache(call)


# -- fp8_mqa_logits --------------------------------------------------------------------
def check_fp8_mqa_logits(call) -> None:
    op = "fp8_mqa_logits"
    q, k, k_scale, weights, ks, ke = call
    c.tensor(op, "q", q, dtypes=FP8, ndim=3)
    dev = q.device
    m, h, d = q.shape
    c.last_dim_contiguous(op, "q", q)
    c.tensor(op, "k", k, dtypes=FP8, ndim=2, device=dev)
    c.shape(op, "k", k, (None, d), "[N, D]")
    c.last_dim_contiguous(op, "k", k)
    n = k.shape[0]
    c.tensor(op, "k_scale", k_scale, dtypes=F32, ndim=1, device=dev)
    c.shape(op, "k_scale", k_scale, (n,), "[N]")
    c.tensor(op, "weights", weights, dtypes=F32, ndim=2, device=dev)
    c.shape(op, "weights", weights, (m, h), "[M, H]")
    for name, x in (("ks", ks), ("ke", ke)):
        c.tensor(op, name, x, dtypes=I32, ndim=1, device=dev)
        c.shape(op, name, x, (m,), "[M]")
        c.contiguous(op, name, x)


def fake_fp8_mqa_logits(call):
    check_fp8_mqa_logits(call)
    return call.q.new_empty((call.q.shape[0], call.k.shape[0]), dtype=torch.float32)


# -- fp8_paged_mqa_logits --------------------------------------------------------------
def check_fp8_paged_mqa_logits(call) -> None:
    op = "fp8_paged_mqa_logits"
    q, kv_cache, weights, context_lens, block_table, max_model_len = call
    c.tensor(op, "q", q, dtypes=FP8, ndim=4)
    dev = q.device
    b, next_n, h, d = q.shape
    if not 1 <= next_n <= MAX_NEXT_N:
        c.fail(op, "q", f"of shape [B, next_n, H, D] with 1 <= next_n <= {MAX_NEXT_N}", f"shape {list(q.shape)}")
    _head_dim(op, "q", d)
    c.last_dim_contiguous(op, "q", q)
    _k_cache(op, kv_cache, d, dev, groups=1)
    c.tensor(op, "weights", weights, dtypes=F32, ndim=2, device=dev)
    c.shape(op, "weights", weights, (b * next_n, h), "[B * next_n, H]")
    c.tensor(op, "context_lens", context_lens, dtypes=I32, ndim=1, device=dev)
    c.shape(op, "context_lens", context_lens, (b,), "[B]")
    c.contiguous(op, "context_lens", context_lens)
    c.tensor(op, "block_table", block_table, dtypes=I32, ndim=2, device=dev)
    c.shape(op, "block_table", block_table, (b, None), "[B, max_blocks]")
    c.last_dim_contiguous(op, "block_table", block_table)
    c.positive(op, "max_model_len", max_model_len)
    _covers_max_model_len(op, block_table, kv_cache.shape[1], max_model_len)


def fake_fp8_paged_mqa_logits(call):
    check_fp8_paged_mqa_logits(call)
    q = call.q
    return q.new_empty((q.shape[0] * q.shape[1], call.max_model_len), dtype=torch.float32)


# -- req_local_to_global_slots ---------------------------------------------------------
def check_req_local_to_global_slots(call) -> None:
    op = "req_local_to_global_slots"
    req_id_per_token, block_table, topk_indices, block_size = call
    c.tensor(op, "topk_indices", topk_indices, dtypes=I32, ndim=2)
    dev = topk_indices.device
    c.tensor(op, "req_id_per_token", req_id_per_token, dtypes=I32, ndim=1, device=dev)
    c.shape(op, "req_id_per_token", req_id_per_token, (topk_indices.shape[0],), "[T]")
    c.contiguous(op, "req_id_per_token", req_id_per_token)
    c.tensor(op, "block_table", block_table, dtypes=I32, ndim=2, device=dev)
    c.last_dim_contiguous(op, "block_table", block_table)
    c.positive(op, "block_size", block_size)


def fake_req_local_to_global_slots(call):
    check_req_local_to_global_slots(call)
    return call.topk_indices.new_empty(call.topk_indices.shape)


# -- composites: sparse_attn_indexer_decode / _prefill ---------------------------------
def _composite_common(op: str, call):
    """The new tokens' tensors of a composite: returns (device, T, H, D)."""
    kv_cache, q, k, weights = call.kv_cache, call.q, call.k, call.weights
    slot_mapping, scale_fmt = call.slot_mapping, call.scale_fmt
    c.tensor(op, "kv_cache", kv_cache, dtypes=U8, ndim=3)
    dev = kv_cache.device
    c.tensor(op, "q", q, dtypes=FP8, ndim=3, device=dev)
    t, h, d = q.shape
    _head_dim(op, "q", d)
    c.last_dim_contiguous(op, "q", q)
    # One scale per token: the logits kernels read the DeepSeek-V3.2 layout `D + 4`.
    _k_cache(op, kv_cache, d, dev, groups=1)
    c.tensor(op, "k", k, dtypes=c.FLOAT_DTYPES, ndim=2, device=dev)
    c.shape(op, "k", k, (t, d), "[T, D]")
    c.last_dim_contiguous(op, "k", k)
    c.tensor(op, "weights", weights, dtypes=F32, ndim=2, device=dev)
    c.shape(op, "weights", weights, (t, h), "[T, H]")
    c.tensor(op, "slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=dev)
    c.shape(op, "slot_mapping", slot_mapping, (t,), "[T]")
    c.contiguous(op, "slot_mapping", slot_mapping)
    if scale_fmt not in SCALE_FMTS:
        c.fail(op, "scale_fmt", 'None or "ue8m0"', repr(scale_fmt))
    return dev, t, h, d


def _topk_buffer(op: str, topk_indices, rows, topk: int, dev) -> None:
    c.tensor(op, "topk_indices", topk_indices, dtypes=I32, ndim=2, device=dev)
    if topk_indices.shape[0] < rows:
        c.fail(
            op, "topk_indices", f"of shape [>= T, K] with at least T = {rows} rows", f"shape {list(topk_indices.shape)}"
        )
    c.last_dim_contiguous(op, "topk_indices", topk_indices)
    if topk < 0 or topk > topk_indices.shape[1]:
        c.fail(op, "topk", f"an int in [0, topk_indices.shape[1]] = [0, {topk_indices.shape[1]}]", topk)


def _non_negative(op: str, arg: str, value: int) -> None:
    if value < 0:
        c.fail(op, arg, "an int >= 0", value)


def check_sparse_attn_indexer_decode(call) -> None:
    op = "sparse_attn_indexer_decode"
    dev, t, _, _ = _composite_common(op, call)
    kv_cache, q, seq_lens, block_table = call.kv_cache, call.q, call.seq_lens, call.block_table
    max_model_len, next_n = call.max_model_len, call.next_n
    if not 1 <= next_n <= MAX_NEXT_N:
        c.fail(op, "next_n", f"an int in [1, {MAX_NEXT_N}]", next_n)
    c.tensor(op, "seq_lens", seq_lens, dtypes=I32, ndim=1, device=dev)
    c.contiguous(op, "seq_lens", seq_lens)
    b = seq_lens.shape[0]
    if t != b * next_n:
        c.fail(
            op, "q", f"of shape [B * next_n, H, D] with B * next_n = {b} * {next_n} = {b * next_n} tokens",
            f"shape {list(q.shape)}",
        )
    c.tensor(op, "block_table", block_table, dtypes=I32, ndim=2, device=dev)
    c.shape(op, "block_table", block_table, (b, None), "[B, max_blocks]")
    c.last_dim_contiguous(op, "block_table", block_table)
    c.positive(op, "max_model_len", max_model_len)
    _covers_max_model_len(op, block_table, kv_cache.shape[1], max_model_len)
    _topk_buffer(op, call.topk_indices, t, call.topk, dev)
    _non_negative(op, "max_num_batched_tokens", call.max_num_batched_tokens)


def fake_sparse_attn_indexer_decode(call) -> None:
    check_sparse_attn_indexer_decode(call)


def check_sparse_attn_indexer_prefill(call) -> None:
    op = "sparse_attn_indexer_prefill"
    dev, t, _, _ = _composite_common(op, call)
    block_table, cu_seq_lens = call.block_table, call.cu_seq_lens
    c.tensor(op, "block_table", block_table, dtypes=I32, ndim=2, device=dev)
    c.last_dim_contiguous(op, "block_table", block_table)
    c.tensor(op, "cu_seq_lens", cu_seq_lens, dtypes=I32, ndim=1, device=dev)
    c.shape(op, "cu_seq_lens", cu_seq_lens, (block_table.shape[0] + 1,), "[B + 1]")
    c.contiguous(op, "cu_seq_lens", cu_seq_lens)
    for name in ("cu_seqlen_ks", "cu_seqlen_ke"):
        x = getattr(call, name)
        c.tensor(op, name, x, dtypes=I32, ndim=1, device=dev)
        c.shape(op, name, x, (t,), "[T]")
        c.contiguous(op, name, x)
    _topk_buffer(op, call.topk_indices, t, call.topk, dev)
    _non_negative(op, "total_seq_lens", call.total_seq_lens)
    c.positive(op, "max_chunk_bytes", call.max_chunk_bytes)
    _non_negative(op, "max_num_batched_tokens", call.max_num_batched_tokens)
    _non_negative(op, "max_total_seq_lens", call.max_total_seq_lens)


def fake_sparse_attn_indexer_prefill(call) -> None:
    check_sparse_attn_indexer_prefill(call)
