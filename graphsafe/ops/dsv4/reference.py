"""Reference backend of the DeepSeek-V4 ops: the executable spec, vectorised PyTorch.

No host sync. Keys that hold nothing (padding or out-of-range slots, entries right of a
length) are masked, never filtered out: their reads are redirected to slot 0 and the
bytes (records) or rows (bf16) read there are replaced by zeros before any arithmetic,
so whatever slot 0 holds cannot reach an output. The attention arithmetic, and with it
where NaN and inf land, is `graphsafe.ops.mla.reference.attend` (the MLA ops'), with the
whole 512-value row as the value.
"""

from __future__ import annotations

import torch

from graphsafe.formats import fp8_dsv4
from graphsafe.ops.mla.reference import attend
from graphsafe.registry import Backend


def lengths_valid(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """`[T, K]` bool: entry j of token t is left of its length (all entries without one;
    lengths clamped to [0, K])."""
    columns = torch.arange(indices.shape[1], device=indices.device)
    if lengths is None:
        return torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    return columns[None, :] < lengths.long().clamp(0, indices.shape[1])[:, None]


def cache_keys(cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None):
    """The key rows `[T, K, D]` of each token's entries and which of them hold a key (a slot
    in the cache, left of the token's length). Records are dequantised (`fp8_dsv4`) to
    float32; those of masked entries are zero bytes, a zero row."""
    valid = lengths_valid(indices, lengths) & fp8_dsv4.slot_valid(cache, indices)
    if cache.dtype == torch.uint8:
        return fp8_dsv4.read_tokens(cache, indices, valid), valid
    nb, bs = cache.shape[:2]
    slots = torch.where(valid, indices.long(), 0)
    rows = cache[slots // bs, slots % bs]
    return torch.where(valid[..., None], rows, 0), valid


def dsv4_sparse_attn(q, kv_cache, indices, sm_scale, attn_sink=None, topk_length=None, extra_kv_cache=None,
                     extra_indices=None, extra_topk_length=None):
    keys, valid = cache_keys(kv_cache, indices, topk_length)
    if extra_kv_cache is not None:
        extra_keys, extra_valid = cache_keys(extra_kv_cache, extra_indices, extra_topk_length)
        keys = torch.cat([keys.float(), extra_keys.float()], dim=1)
        valid = torch.cat([valid, extra_valid], dim=1)
    return attend(q, keys, valid, sm_scale, q.shape[2], attn_sink)


DSV4_SPARSE_ATTN = Backend(name="reference", impl=dsv4_sparse_attn)
