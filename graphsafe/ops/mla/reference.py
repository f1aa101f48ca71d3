"""Reference backend of the MLA attention ops: the executable spec, vectorised PyTorch.

Float32 math throughout. No host sync: invalid keys are masked (score -inf), never
filtered out, and their cache reads are redirected to slot 0 so garbage block-table
entries or indices are never dereferenced.
"""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, kv_lora_rank: int):
    """Absorbed MLA attention of each query row over its own gathered keys.

    q `[N, H, D]`, keys `[N, L, D]` (the cached rows; a row's value is its first
    `kv_lora_rank` entries), valid bool `[N, L]`. Returns out `[N, H, R]` in q's dtype
    and the natural-log LSE f32 `[N, H]`; a row without valid keys gets 0 and -inf.
    """
    qf, kf = q.float(), keys.float()
    scores = torch.einsum("nhd,nld->nhl", qf, kf) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - (-inf)) would be NaN for rows without a valid key: shift those by 0.
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - shift[..., None])
    out = torch.einsum("nhl,nlr->nhr", probs, kf[..., :kv_lora_rank])
    return out.to(q.dtype), lse


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    pos = torch.arange(capacity, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, L]; negative lengths: no key
    blocks = torch.where(valid, block_table[:, pos // block_size], 0).long()
    keys = kv_cache[blocks, (pos % block_size)[None, :]]  # [B, L, D]
    return attend(q, keys, valid, sm_scale, kv_lora_rank)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank):
    num_blocks, block_size = kv_cache.shape[:2]
    slots = indices.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    slots = torch.where(valid, slots, 0)
    keys = kv_cache[slots // block_size, slots % block_size]  # [T, K, D]
    return attend(q, keys, valid, sm_scale, kv_lora_rank)
