"""Reference backend of the DeepSeek-V4 ops: the executable spec, vectorised PyTorch.

No host sync and no data-dependent shape (the reference backend must capture into CUDA
graphs too, tests/test_contract_gpu.py): writes never select their tokens with a boolean
mask, the tokens a write skips are redirected instead (`fp8_dsv4.write_tokens`,
`graphsafe.ops.cache.reference.scatter_tokens`). Keys that hold nothing (padding or
out-of-range slots, entries right of a length) are masked, never filtered out: their
reads are redirected to slot 0 and the bytes (records) or rows (bf16) read there are
replaced by zeros before any arithmetic, so whatever slot 0 holds cannot reach an output.
The attention arithmetic, and with it where NaN and inf land, is
`graphsafe.ops.mla.reference.attend` (the MLA ops'), with the whole 512-value row as the
value.
"""

from __future__ import annotations

import torch

from graphsafe.formats import fp8_dsv4
from graphsafe.ops.cache.reference import scatter_tokens
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


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) RoPE of float32 `x [..., 2n]`: pair i is (x[2i], x[2i + 1]), rotated
    by `cos [..., n]`, `sin [..., n]`: (e cos - o sin, e sin + o cos)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """(ok `[T]`: the position is a row of the table, cos `[T, 32]`, sin `[T, 32]`; rows of
    positions outside the table are zeros, nothing read for them)."""
    pos = positions.long()
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    rows = torch.where(ok[:, None], cos_sin_cache[torch.where(ok, pos, 0)].float(), 0.0)
    half = rows.shape[1] // 2
    return ok, rows[:, :half], rows[:, half:]


def qnorm_rope(q: torch.Tensor, ok: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 `[T, H, 512]`: each head RMS-normalised without weight (`x / sqrt(sum(x^2) / 512
    + eps)`, IEEE sqrt and division), then RoPE on its last 64 values; zeros where not `ok`."""
    nope = fp8_dsv4.NOPE_DIM
    x = torch.where(ok[:, None, None], q.float(), 0.0)
    r = 1.0 / torch.sqrt((x * x).sum(-1) / x.shape[-1] + eps)
    y = x * r[..., None]
    y = torch.cat([y[..., :nope], rope_pairs(y[..., nope:], cos[:, None], sin[:, None])], dim=-1)
    return torch.where(ok[:, None, None], y, 0.0)


def kv_rope(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float32 `[T, 512]`: the kv rows with RoPE on their last 64 values."""
    nope = fp8_dsv4.NOPE_DIM
    x = kv.float()
    return torch.cat([x[:, :nope], rope_pairs(x[:, nope:], cos, sin)], dim=1)


def scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`cache[s // block_size, s % block_size] = rows[t]` for each slot `s = slots[t]` in the
    cache (others skipped), sync-free (`scatter_tokens`); nothing for a cache without slots."""
    if cache.shape[0] * cache.shape[1]:
        scatter_tokens(cache, slots, rows)


def insert_rows(kv_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, enabled: torch.Tensor) -> None:
    """Write float32 `rows [N, 512]` (rounded to bf16) at `slots` where `enabled` and the
    slot lies in the cache: fp8_dsv4 records (`write_tokens`) or bf16 rows."""
    slots = torch.where(enabled & fp8_dsv4.slot_valid(kv_cache, slots), slots.long(), -1)
    if kv_cache.dtype == torch.uint8:
        fp8_dsv4.write_tokens(kv_cache, rows, slots)
        return
    scatter_rows(kv_cache, slots, rows.to(kv_cache.dtype))


def dsv4_qnorm_rope_kv_insert(q, kv, q_out, kv_cache, slot_mapping, positions, cos_sin_cache, eps):
    t, h, _ = q.shape
    ok, cos, sin = rope_tables(positions, cos_sin_cache)
    q_out[:, :h] = qnorm_rope(q, ok, cos, sin, eps).to(q_out.dtype)
    q_out[:, h:] = 0
    n = slot_mapping.shape[0]
    insert_rows(kv_cache, kv_rope(kv[:n], cos[:n], sin[:n]), slot_mapping, ok[:n])


def save_states(kv, score, ape, ok, positions, state_cache, state_slot_mapping) -> torch.Tensor:
    """The compressor's partial-state save; returns which tokens saved (position in the
    table and a state slot in the cache)."""
    nsb, sbs = state_cache.shape[:2]
    slots = state_slot_mapping.long()
    save = ok & (slots >= 0) & (slots < nsb * sbs)
    ratio = ape.shape[0]
    rows = torch.cat([kv.float(), score.float() + ape[torch.where(ok, positions.long() % ratio, 0)]], dim=1)
    scatter_rows(state_cache, torch.where(save, slots, -1), rows)
    return save


def pool_windows(state_cache, state_block_table, token_to_req, positions, enabled, head_dim: int, ratio: int):
    """`[T, D]` float32: each enabled token's window of `S` states (positions pos - S + 1 ...
    pos; S = ratio, or 2 ratio when the state rows hold 2 D channels: the previous window's
    states through their first D channels, this window's through the next D), each channel
    pooled by the softmax of its scores; states outside the table or the cache are missing
    (a window without any state pools to 0)."""
    nsb, sbs, width = state_cache.shape
    w = width // 2
    s = ratio * (w // head_dim)
    t = positions.shape[0]
    i = torch.arange(s, device=positions.device)
    q = positions.long()[:, None] - s + 1 + i[None, :]
    block = q.div(sbs, rounding_mode="floor")
    in_table = enabled[:, None] & (q >= 0) & (block < state_block_table.shape[1])
    req = torch.where(enabled, token_to_req.long(), 0)
    ids = state_block_table[req[:, None], torch.where(in_table, block, 0)].long()
    present = in_table & (ids >= 0) & (ids < nsb)
    states = state_cache[torch.where(present, ids, 0), torch.where(present, q % sbs, 0)]  # [T, S, 2W]
    channel = (i >= ratio).long() * head_dim if s > ratio else torch.zeros_like(i)
    cols = channel[:, None] + torch.arange(head_dim, device=i.device)[None, :]  # [S, D]
    kv = torch.gather(states[..., :w], 2, cols[None].expand(t, s, head_dim))
    score = torch.gather(states[..., w:], 2, cols[None].expand(t, s, head_dim))
    kv = torch.where(present[..., None], kv, 0.0)
    score = torch.where(present[..., None], score, float("-inf"))
    m = score.amax(dim=1) if s else score.new_full((t, head_dim), float("-inf"))
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(score - m[:, None])
    total = p.sum(dim=1)
    return (p * kv).sum(dim=1) / torch.where(total == 0, 1.0, total)


def dsv4_compress_kv(kv, score, ape, positions, state_cache, state_slot_mapping, state_block_table, token_to_req,
                     norm_weight, eps, cos_sin_cache, kv_cache, kv_slot_mapping, compress_ratio):
    d = norm_weight.shape[0]
    ok, _, _ = rope_tables(positions, cos_sin_cache)
    saved = save_states(kv, score, ape, ok, positions, state_cache, state_slot_mapping)
    pos = positions.long()
    slots = kv_slot_mapping.long()
    nb, bs = kv_cache.shape[:2]
    reqs = token_to_req.long()
    enabled = (saved & ((pos + 1) % compress_ratio == 0) & (slots >= 0) & (slots < nb * bs)
               & (reqs >= 0) & (reqs < state_block_table.shape[0]))
    pooled = pool_windows(state_cache, state_block_table, token_to_req, positions, enabled, d, compress_ratio)
    normed = pooled * (1.0 / torch.sqrt((pooled * pooled).sum(-1) / d + eps))[:, None] * norm_weight.float()
    _, cos, sin = rope_tables(torch.where(enabled, (pos // compress_ratio) * compress_ratio, -1), cos_sin_cache)
    rope = fp8_dsv4.ROPE_DIM
    rows = torch.cat([normed[:, : d - rope], rope_pairs(normed[:, d - rope :], cos, sin)], dim=1)
    insert_rows(kv_cache, rows, slots, enabled)


DSV4_SPARSE_ATTN = Backend(name="reference", impl=dsv4_sparse_attn)
DSV4_COMPRESS_KV = Backend(name="reference", impl=dsv4_compress_kv)
DSV4_QNORM_ROPE_KV_INSERT = Backend(name="reference", impl=dsv4_qnorm_rope_kv_insert)
