"""Fakes and input checks of the MLA attention ops (`mla_decode`, `sparse_mla`)."""

from __future__ import annotations

import torch

from graphsafe import checks as c
from graphsafe.formats import fp8_ds_mla

# A uint8 kv_cache is an fp8_ds_mla cache (graphsafe.formats.fp8_ds_mla).
TILE = fp8_ds_mla.TILE


def _check_q_and_cache(op: str, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    c.tensor(op, "q", q, dtypes=c.HALF_DTYPES, ndim=3)
    d = q.shape[2]
    c.last_dim_contiguous(op, "q", q)
    c.tensor(op, "kv_cache", kv_cache, ndim=3, device=q.device)
    if kv_lora_rank < 1 or kv_lora_rank > d:
        c.fail(op, "kv_lora_rank", f"the value width R, an int in [1, R + P] = [1, {d}]", kv_lora_rank)
    if fp8_ds_mla.holds_records(kv_cache):
        _check_fp8_ds_mla_cache(op, q, kv_cache, kv_lora_rank)
    else:
        if kv_cache.dtype != q.dtype:
            c.fail(op, "kv_cache", f"of the same dtype as 'q' ({q.dtype}) or uint8 (an fp8_ds_mla cache)",
                   kv_cache.dtype)
        c.shape(op, "kv_cache", kv_cache, (None, None, d), "[num_blocks, block_size, R + P] (R + P = q.shape[2])")
    c.last_dim_contiguous(op, "kv_cache", kv_cache)
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        c.fail(op, "kv_cache", "of at least one block of at least one slot", f"shape {list(kv_cache.shape)}")


def _check_fp8_ds_mla_cache(op: str, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """A uint8 cache is an fp8_ds_mla cache (graphsafe.formats.fp8_ds_mla): R a multiple of 128,
    P = q.shape[2] - R even, `record_bytes(R, P)` bytes per token, q bf16, and every record
    4-byte aligned (the kernels load its scales as float32: strides and the storage
    offset multiples of 4 bytes)."""
    r, p = kv_lora_rank, q.shape[2] - kv_lora_rank
    when = "when 'kv_cache' is uint8 (an fp8_ds_mla cache)"
    if q.dtype != torch.bfloat16:
        c.fail(op, "q", f"of dtype bfloat16 {when}", str(q.dtype).removeprefix("torch."))
    if r % TILE:
        c.fail(op, "kv_lora_rank", f"a multiple of {TILE} {when}", r)
    if p % 2:
        c.fail(op, "q", f"of last dim R + P with P (the rope width) even {when}", f"P = {p}")
    c.shape(op, "kv_cache", kv_cache, (None, None, fp8_ds_mla.record_bytes(r, p)),
            "[num_blocks, block_size, R + 4 * R/128 + 2 * P] (the fp8_ds_mla record, bytes)")
    if kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4:
        c.fail(op, "kv_cache", f"of 4-byte aligned records (block and token strides multiples of 4) {when}",
               f"strides {kv_cache.stride()}")
    check_fp8_ds_mla_offset(op, kv_cache)


def check_fp8_ds_mla_offset(op: str, kv_cache: torch.Tensor) -> None:
    """An fp8_ds_mla cache's storage offset must be a multiple of 4 bytes. Not part of a
    call's signature (the registry validates a signature's first call only), so the
    Triton runner, whose kernel loads the scales as float32, repeats this per call."""
    if kv_cache.storage_offset() % 4:
        c.fail(op, "kv_cache", "of 4-byte aligned records (a storage offset multiple of 4) when 'kv_cache' is "
               "uint8 (an fp8_ds_mla cache)", f"storage offset {kv_cache.storage_offset()}")


def check_mla_decode(call) -> None:
    op = "mla_decode"
    q, kv_cache, block_table, seq_lens = call.q, call.kv_cache, call.block_table, call.seq_lens
    _check_q_and_cache(op, q, kv_cache, call.kv_lora_rank)
    b = q.shape[0]
    c.tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2, device=q.device)
    c.shape(op, "block_table", block_table, (b, None), "[B, max_blocks]")
    c.last_dim_contiguous(op, "block_table", block_table)
    c.tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=q.device)
    c.shape(op, "seq_lens", seq_lens, (b,), "[B]")
    c.last_dim_contiguous(op, "seq_lens", seq_lens)


def _outputs(q: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, h = q.shape[:2]
    out = q.new_empty((rows, h, kv_lora_rank))
    lse = q.new_empty((rows, h), dtype=torch.float32)
    return out, lse


def fake_mla_decode(call):
    check_mla_decode(call)
    return _outputs(call.q, call.kv_lora_rank)


def check_sparse_mla(call) -> None:
    op = "sparse_mla"
    q, indices, attn_sink, topk_length = call.q, call.indices, call.attn_sink, call.topk_length
    _check_q_and_cache(op, q, call.kv_cache, call.kv_lora_rank)
    c.tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2, device=q.device)
    c.shape(op, "indices", indices, (q.shape[0], None), "[T, K]")
    c.last_dim_contiguous(op, "indices", indices)
    if attn_sink is not None:
        c.tensor(op, "attn_sink", attn_sink, dtypes=(torch.float32,), ndim=1, device=q.device)
        c.shape(op, "attn_sink", attn_sink, (q.shape[1],), "[H]")
    if topk_length is not None:
        c.tensor(op, "topk_length", topk_length, dtypes=(torch.int32,), ndim=1, device=q.device)
        c.shape(op, "topk_length", topk_length, (q.shape[0],), "[T]")
        c.last_dim_contiguous(op, "topk_length", topk_length)


def fake_sparse_mla(call):
    check_sparse_mla(call)
    return _outputs(call.q, call.kv_lora_rank)
