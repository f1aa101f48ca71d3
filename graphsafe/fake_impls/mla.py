"""Fakes and input checks of the MLA attention ops (`mla_decode`, `sparse_mla`)."""

from __future__ import annotations

import torch

from graphsafe.fake_impls import _checks as c


def _check_q_and_cache(op: str, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    c.tensor(op, "q", q, dtypes=c.HALF_DTYPES, ndim=3)
    d = q.shape[2]
    c.last_dim_contiguous(op, "q", q)
    c.tensor(op, "kv_cache", kv_cache, ndim=3, device=q.device)
    c.same_dtype(op, "kv_cache", kv_cache, "q", q)
    c.shape(op, "kv_cache", kv_cache, (None, None, d), "[num_blocks, block_size, R + P] (R + P = q.shape[2])")
    c.last_dim_contiguous(op, "kv_cache", kv_cache)
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        c.fail(op, "kv_cache", "of at least one block of at least one slot", f"shape {list(kv_cache.shape)}")
    if kv_lora_rank < 1 or kv_lora_rank > d:
        c.fail(op, "kv_lora_rank", f"the value width R, an int in [1, R + P] = [1, {d}]", kv_lora_rank)


def check_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> None:
    op = "mla_decode"
    _check_q_and_cache(op, q, kv_cache, kv_lora_rank)
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


def fake_mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    check_mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank)
    return _outputs(q, kv_lora_rank)


def check_sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> None:
    op = "sparse_mla"
    _check_q_and_cache(op, q, kv_cache, kv_lora_rank)
    c.tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2, device=q.device)
    c.shape(op, "indices", indices, (q.shape[0], None), "[T, K]")
    c.last_dim_contiguous(op, "indices", indices)


def fake_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank):
    check_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank)
    return _outputs(q, kv_lora_rank)
