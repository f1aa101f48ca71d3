"""Fakes and input checks of the DeepSeek-V4 ops (`graphsafe.ops.dsv4`)."""

from __future__ import annotations

import torch

from graphsafe import checks as c
from graphsafe.formats import fp8_dsv4

RECORDS = "fp8_dsv4"  # a uint8 cache of DeepSeek-V4 records (graphsafe.formats.fp8_dsv4)


def cache_kind(cache: torch.Tensor) -> str:
    """"fp8_dsv4" for a uint8 cache (records), else the name of the cache's dtype."""
    return RECORDS if cache.dtype == torch.uint8 else str(cache.dtype).removeprefix("torch.")


def check_cache(op: str, arg: str, cache: torch.Tensor, head_dim: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """A cache of DeepSeek-V4 latent rows: fp8_dsv4 records (uint8 `[num_blocks, block_size,
    584]`, stride(2) 1, stride(1) 584, blocks that do not overlap; head_dim must be 512), or
    rows of `dtype` `[num_blocks, block_size, head_dim]` with a contiguous last dim."""
    c.tensor(op, arg, cache, ndim=3, device=device)
    if cache.dtype == torch.uint8:
        if head_dim != fp8_dsv4.HEAD_DIM:
            c.fail(op, arg, f"a cache of rows of {head_dim} values of dtype {str(dtype).removeprefix('torch.')} "
                   f"(uint8 fp8_dsv4 records hold rows of {fp8_dsv4.HEAD_DIM})", "uint8")
        c.shape(op, arg, cache, (None, None, fp8_dsv4.TOKEN_BYTES),
                "[num_blocks, block_size, 584] (fp8_dsv4 records, bytes)")
        if not fp8_dsv4.is_fp8_dsv4_cache(cache):
            c.fail(op, arg, "an fp8_dsv4 cache: each block's bytes contiguous (stride(2) 1, stride(1) 584) and "
                   "blocks at least block_size * 584 bytes apart", f"strides {cache.stride()}")
    else:
        if cache.dtype != dtype:
            c.fail(op, arg, f"of dtype {str(dtype).removeprefix('torch.')} or uint8 (fp8_dsv4 records)",
                   str(cache.dtype).removeprefix("torch."))
        c.shape(op, arg, cache, (None, None, head_dim), "[num_blocks, block_size, head_dim]")
        c.last_dim_contiguous(op, arg, cache)
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        c.fail(op, arg, "of at least one block of at least one slot", f"shape {list(cache.shape)}")


def _check_lengths(op: str, arg: str, lengths, rows: int, device: torch.device) -> None:
    if lengths is not None:
        c.tensor(op, arg, lengths, dtypes=(torch.int32,), ndim=1, device=device)
        c.shape(op, arg, lengths, (rows,), "[T]")
        # (is_contiguous, not last_dim_contiguous: its `size > 1` test would make a traced
        # call guard on T, and compiled code recompile per batch size.)
        c.contiguous(op, arg, lengths)


def _check_indices(op: str, arg: str, indices, rows: int, device: torch.device) -> None:
    c.tensor(op, arg, indices, dtypes=(torch.int32,), ndim=2, device=device)
    c.shape(op, arg, indices, (rows, None), "[T, K]")
    c.last_dim_contiguous(op, arg, indices)


def check_dsv4_sparse_attn(call) -> None:
    op = "dsv4_sparse_attn"
    q = call.q
    c.tensor(op, "q", q, dtypes=(torch.bfloat16,), ndim=3)
    c.last_dim_contiguous(op, "q", q)
    rows, heads, d = q.shape
    if d < 1:
        c.fail(op, "q", "of a head dim of at least 1", f"shape {list(q.shape)}")
    check_cache(op, "kv_cache", call.kv_cache, d, q.device)
    _check_indices(op, "indices", call.indices, rows, q.device)
    if call.attn_sink is not None:
        c.tensor(op, "attn_sink", call.attn_sink, dtypes=(torch.float32,), ndim=1, device=q.device)
        c.shape(op, "attn_sink", call.attn_sink, (heads,), "[H]")
    _check_lengths(op, "topk_length", call.topk_length, rows, q.device)
    extra = call.extra_kv_cache
    if extra is None:
        for arg in ("extra_indices", "extra_topk_length"):
            if getattr(call, arg) is not None:
                c.fail(op, arg, "None when 'extra_kv_cache' is None", "a tensor")
        return
    check_cache(op, "extra_kv_cache", extra, d, q.device)
    if cache_kind(extra) != cache_kind(call.kv_cache):
        c.fail(op, "extra_kv_cache", f"of the kind of 'kv_cache' ({cache_kind(call.kv_cache)})", cache_kind(extra))
    if call.extra_indices is None:
        c.fail(op, "extra_indices", "a tensor when 'extra_kv_cache' is given", None)
    _check_indices(op, "extra_indices", call.extra_indices, rows, q.device)
    _check_lengths(op, "extra_topk_length", call.extra_topk_length, rows, q.device)


def fake_dsv4_sparse_attn(call):
    check_dsv4_sparse_attn(call)
    q = call.q
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


INDEX_DTYPES = (torch.int64, torch.int32)


def check_dsv4_qnorm_rope_kv_insert(call) -> None:
    op = "dsv4_qnorm_rope_kv_insert"
    q, kv, q_out = call.q, call.kv, call.q_out
    d = fp8_dsv4.HEAD_DIM
    c.tensor(op, "q", q, dtypes=(torch.bfloat16,), ndim=3)
    t, h = q.shape[:2]
    c.shape(op, "q", q, (None, None, d), "[T, H, 512]")
    c.last_dim_contiguous(op, "q", q)
    c.tensor(op, "kv", kv, dtypes=(torch.bfloat16,), ndim=2, device=q.device)
    c.shape(op, "kv", kv, (t, d), "[T, 512]")
    c.last_dim_contiguous(op, "kv", kv)
    c.tensor(op, "q_out", q_out, dtypes=(torch.bfloat16,), ndim=3, device=q.device)
    c.shape(op, "q_out", q_out, (t, None, d), "[T, Hp, 512]")
    if q_out.shape[1] < h:
        c.fail(op, "q_out", f"of at least the heads of 'q' ({h}): [T, Hp >= H, 512]", f"shape {list(q_out.shape)}")
    c.last_dim_contiguous(op, "q_out", q_out)
    check_cache(op, "kv_cache", call.kv_cache, d, q.device)
    slots = call.slot_mapping
    c.tensor(op, "slot_mapping", slots, dtypes=INDEX_DTYPES, ndim=1, device=q.device)
    c.contiguous(op, "slot_mapping", slots)
    if slots.shape[0] > t:
        c.fail(op, "slot_mapping", f"of at most T = {t} entries (the first tokens' slots)", f"shape {list(slots.shape)}")
    c.tensor(op, "positions", call.positions, dtypes=INDEX_DTYPES, ndim=1, device=q.device)
    c.shape(op, "positions", call.positions, (t,), "[T]")
    c.contiguous(op, "positions", call.positions)
    cs = call.cos_sin_cache
    c.tensor(op, "cos_sin_cache", cs, dtypes=(torch.float32,), ndim=2, device=q.device)
    c.shape(op, "cos_sin_cache", cs, (None, 2 * (fp8_dsv4.ROPE_DIM // 2)), "[max_pos, 64] (cos | sin)")
    c.last_dim_contiguous(op, "cos_sin_cache", cs)
    if cs.shape[0] < 1:
        c.fail(op, "cos_sin_cache", "of at least one position", f"shape {list(cs.shape)}")


def fake_dsv4_qnorm_rope_kv_insert(call) -> None:
    check_dsv4_qnorm_rope_kv_insert(call)


def check_dsv4_compress_kv(call) -> None:
    op = "dsv4_compress_kv"
    kv, score = call.kv, call.score
    c.tensor(op, "kv", kv, dtypes=(torch.bfloat16,), ndim=2)
    t, w = kv.shape
    dev = kv.device
    c.last_dim_contiguous(op, "kv", kv)
    c.tensor(op, "score", score, dtypes=(torch.bfloat16,), ndim=2, device=dev)
    c.shape(op, "score", score, (t, w), "[T, W] (the shape of 'kv')")
    c.last_dim_contiguous(op, "score", score)
    weight = call.norm_weight
    c.tensor(op, "norm_weight", weight, dtypes=(torch.float32,), ndim=1, device=dev)
    d = weight.shape[0]
    rope = fp8_dsv4.ROPE_DIM
    if d < rope or d % 64:
        c.fail(op, "norm_weight", f"of a head dim D that is a multiple of 64 (the last {rope} values rotated)",
               f"shape {list(weight.shape)}")
    if w not in (d, 2 * d):
        c.fail(op, "kv", f"of width D or 2 D (overlapping windows), D = {d} (the norm weight's)", f"shape {list(kv.shape)}")
    ratio = call.compress_ratio
    if ratio < 1:
        c.fail(op, "compress_ratio", "a positive int", ratio)
    c.tensor(op, "ape", call.ape, dtypes=(torch.float32,), ndim=2, device=dev)
    c.shape(op, "ape", call.ape, (ratio, w), "[compress_ratio, W]")
    c.last_dim_contiguous(op, "ape", call.ape)
    for arg in ("positions", "state_slot_mapping", "kv_slot_mapping"):
        v = getattr(call, arg)
        c.tensor(op, arg, v, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        c.shape(op, arg, v, (t,), "[T]")
        c.contiguous(op, arg, v)
    c.tensor(op, "token_to_req", call.token_to_req, dtypes=(torch.int32,), ndim=1, device=dev)
    c.shape(op, "token_to_req", call.token_to_req, (t,), "[T]")
    c.contiguous(op, "token_to_req", call.token_to_req)
    state = call.state_cache
    c.tensor(op, "state_cache", state, dtypes=(torch.float32,), ndim=3, device=dev)
    c.shape(op, "state_cache", state, (None, None, 2 * w), "[num_state_blocks, state_block_size, 2 W]")
    c.last_dim_contiguous(op, "state_cache", state)
    if state.shape[0] < 1 or state.shape[1] < 1:
        c.fail(op, "state_cache", "of at least one block of at least one slot", f"shape {list(state.shape)}")
    table = call.state_block_table
    c.tensor(op, "state_block_table", table, dtypes=(torch.int32,), ndim=2, device=dev)
    c.last_dim_contiguous(op, "state_block_table", table)
    cs = call.cos_sin_cache
    c.tensor(op, "cos_sin_cache", cs, dtypes=(torch.float32,), ndim=2, device=dev)
    c.shape(op, "cos_sin_cache", cs, (None, rope), "[max_pos, 64] (cos | sin)")
    c.last_dim_contiguous(op, "cos_sin_cache", cs)
    if cs.shape[0] < 1:
        c.fail(op, "cos_sin_cache", "of at least one position", f"shape {list(cs.shape)}")
    check_cache(op, "kv_cache", call.kv_cache, d, dev)


def fake_dsv4_compress_kv(call) -> None:
    check_dsv4_compress_kv(call)
