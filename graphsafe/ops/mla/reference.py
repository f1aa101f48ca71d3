"""Reference backend of the MLA attention ops: the executable spec, vectorised PyTorch.

Float32 math throughout. No host sync: invalid keys (positions past a request's length,
padding blocks, padding or out-of-range slots) are masked (score -inf), never filtered
out. Their cache reads are redirected to slot 0 so that no id is ever dereferenced out
of range (a negative id never wraps around), and the rows read there are replaced by 0
with `torch.where` before any arithmetic, so whatever slot 0 holds (NaN, inf) cannot
reach an output. An fp8_ds_mla cache (uint8 records) is read the same way: the records
gathered for masked keys are zeroed (bytes) first, then the gathered records are
dequantized (`dequantize_records`; an all-zero record is a row of zeros).
"""

from __future__ import annotations

import torch

from graphsafe.formats.fp8_ds_mla import dequantize_records
from graphsafe.registry import Backend


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, kv_lora_rank: int,
           attn_sink: torch.Tensor | None = None):
    """Absorbed MLA attention of each query row over its own gathered keys.

    q `[N, H, D]`, keys `[N, L, D]` (the cached rows; a row's value is its first
    `kv_lora_rank` entries), valid bool `[N, L]`; rows where `valid` is False never
    influence the result, whatever they hold. Returns out `[N, H, R]` in q's dtype and
    the natural-log LSE f32 `[N, H]`; a row without valid keys gets 0 and -inf.
    `attn_sink` (`[H]` float32, FlashMLA's): out is scaled by `exp(lse) / (exp(lse) +
    exp(sink))` = `sigmoid(lse - sink)` in float32 before its rounding; lse stays.

    The arithmetic of the kernels, so that non-finite inputs give the same places:
    `m = max_j s_j`, `p_j = exp(s_j - m)`, `l = sum_j p_j`, `out = sum_j (p_j / l) v_j`,
    `lse = m + log(l)`. A NaN score makes m NaN, a +inf score makes its p NaN (inf - inf):
    either way out and lse are NaN. A -inf score is a weight of 0, and `0 * v_j` still
    enters the sum (NaN where v_j is infinite).
    """
    qf = q.float()
    kf = torch.where(valid[..., None], keys.float(), 0.0)
    scores = torch.einsum("nhd,nld->nhl", qf, kf) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    if scores.shape[-1] == 0:  # no key position at all (max_blocks = 0, K = 0)
        m = scores.new_full(scores.shape[:-1], float("-inf"))
    else:
        m = scores.amax(dim=-1)
    # exp(-inf - (-inf)) would be NaN for rows without a valid key: shift those by 0.
    m = torch.where(m == float("-inf"), 0.0, m)
    probs = torch.exp(scores - m[..., None])
    total = probs.sum(dim=-1)
    empty = total == 0  # no valid key (a NaN total is not empty: it stays NaN)
    probs = probs / torch.where(empty, 1.0, total)[..., None]
    out = torch.einsum("nhl,nlr->nhr", probs, kf[..., :kv_lora_rank])
    lse = torch.where(empty, float("-inf"), m + torch.log(total))
    if attn_sink is not None:
        # +inf sink: 0, -inf: 1, NaN: NaN; a row without a key stays 0 (never -inf - -inf).
        kept = torch.where(empty, 0.0, torch.sigmoid(lse - attn_sink.float()[None, :]))
        out = out * kept[..., None]
    return _dense(out, q.dtype), _dense(lse, torch.float32)


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a fresh contiguous tensor (the strides of the fake, empty shapes included)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def decode_keys(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """The key rows `[B, L, D]` (L = max_blocks * block_size) of each request and which of
    them hold a key: the position is below the request's length and its block id is in
    `[0, num_blocks)` (anything else, -1 the documented padding, holds no key)."""
    num_blocks, block_size = kv_cache.shape[:2]
    capacity = block_table.shape[1] * block_size
    pos = torch.arange(capacity, device=kv_cache.device)
    blocks = block_table[:, pos // block_size].long()  # [B, L]
    valid = (pos[None, :] < seq_lens[:, None].long()) & (blocks >= 0) & (blocks < num_blocks)
    blocks = torch.where(valid, blocks, 0)
    return kv_cache[blocks, (pos % block_size)[None, :]], valid


def sparse_keys(kv_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None):
    """The key rows `[T, K, D]` of each token's slots and which of them hold a key (slot in
    `[0, num_blocks * block_size)`; -1, the documented padding, and any other slot do not;
    with `topk_length`, entry j of token t only when `j < topk_length[t]`)."""
    num_blocks, block_size = kv_cache.shape[:2]
    slots = indices.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    if topk_length is not None:
        columns = torch.arange(indices.shape[1], device=indices.device)
        valid = valid & (columns[None, :] < topk_length.long()[:, None])
    slots = torch.where(valid, slots, 0)
    return kv_cache[slots // block_size, slots % block_size], valid


def key_rows(gathered: torch.Tensor, valid: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The key rows of gathered cache entries: the entries themselves for a float cache
    (`attend` masks them), the float32 `[..., R + P]` rows of gathered
    fp8_ds_mla records (uint8), those of masked keys (`valid` False) zeroed before any
    arithmetic."""
    if gathered.dtype != torch.uint8:
        return gathered
    return dequantize_records(torch.where(valid[..., None], gathered, 0), kv_lora_rank)


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    keys, valid = decode_keys(kv_cache, block_table, seq_lens)
    return attend(q, key_rows(keys, valid, kv_lora_rank), valid, sm_scale, kv_lora_rank)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink=None, topk_length=None):
    keys, valid = sparse_keys(kv_cache, indices, topk_length)
    return attend(q, key_rows(keys, valid, kv_lora_rank), valid, sm_scale, kv_lora_rank, attn_sink)


MLA_DECODE = Backend(name="reference", impl=mla_decode)
SPARSE_MLA = Backend(name="reference", impl=sparse_mla)
