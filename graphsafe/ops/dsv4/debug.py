"""Debug checks of the DeepSeek-V4 ops (`graphsafe.debug_checks`): the values of their ids.

An id outside its range acts as padding on every backend (the ops' docstrings); with the
switch on, an id the op reads that is neither in range nor the padding value -1 raises
`InputError`, and so do lengths the op would clamp.
"""

from __future__ import annotations

import torch

from graphsafe.debug import ids_in_range, values_at_least, values_at_most, values_distinct


def _entries_read(op: str, arg: str, indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor | None:
    if lengths is None:
        return None
    values_at_least(op, arg, lengths, 0, "a number of entries")
    values_at_most(op, arg, lengths, indices.shape[1], "K, the entries of a row of indices")
    columns = torch.arange(indices.shape[1], device=indices.device)
    return columns[None, :] < lengths.detach().long()[:, None]


def debug_check_dsv4_sparse_attn(call) -> None:
    """Every entry of `indices` / `extra_indices` the op reads (all, or those left of the
    token's length) in `[0, num_blocks * block_size)` of its cache or -1; the lengths in
    `[0, K]`."""
    op = "dsv4_sparse_attn"
    pairs = [("", call.kv_cache, call.indices, call.topk_length)]
    if call.extra_kv_cache is not None:
        pairs.append(("extra_", call.extra_kv_cache, call.extra_indices, call.extra_topk_length))
    for prefix, cache, indices, lengths in pairs:
        used = _entries_read(op, f"{prefix}topk_length", indices, lengths)
        num_blocks, block_size = cache.shape[:2]
        ids_in_range(op, f"{prefix}indices", indices, num_blocks * block_size, used=used, what="cache slots")


def debug_check_dsv4_qnorm_rope_kv_insert(call) -> None:
    """`positions` in `[0, max_pos)` or -1; the slots of the tokens inserted (those with a
    position) in the cache or -1, and distinct."""
    op = "dsv4_qnorm_rope_kv_insert"
    ids_in_range(op, "positions", call.positions, call.cos_sin_cache.shape[0], what="positions")
    num_blocks, block_size = call.kv_cache.shape[:2]
    slots = call.slot_mapping
    used = call.positions[: slots.shape[0]].detach() != -1
    ids_in_range(op, "slot_mapping", slots, num_blocks * block_size, used=used, what="cache slots")
    values_distinct(op, "slot_mapping", torch.where(used, slots.detach().long(), -1), "cache slots")


def debug_check_dsv4_compress_kv(call) -> None:
    """`positions` in the table or -1; the state slots of the tokens with a position in the
    state cache or -1, and distinct; the compressed slots of the tokens that complete a
    window in the cache or -1, and distinct; their requests in range."""
    op = "dsv4_compress_kv"
    pos = call.positions.detach().long()
    ids_in_range(op, "positions", call.positions, call.cos_sin_cache.shape[0], what="positions")
    nsb, sbs = call.state_cache.shape[:2]
    live = pos != -1
    ids_in_range(op, "state_slot_mapping", call.state_slot_mapping, nsb * sbs, used=live, what="state slots")
    values_distinct(op, "state_slot_mapping", torch.where(live, call.state_slot_mapping.detach().long(), -1),
                    "state slots")
    saving = live & (call.state_slot_mapping.detach().long() >= 0)
    boundary = saving & ((pos + 1) % call.compress_ratio == 0)
    nb, bs = call.kv_cache.shape[:2]
    ids_in_range(op, "kv_slot_mapping", call.kv_slot_mapping, nb * bs, used=boundary, what="cache slots")
    values_distinct(op, "kv_slot_mapping", torch.where(boundary, call.kv_slot_mapping.detach().long(), -1),
                    "cache slots")
    table = call.state_block_table
    ids_in_range(op, "token_to_req", call.token_to_req, table.shape[0], used=boundary, what="requests")
    # The block-table entries of the windows pooled: ids in the state cache or -1.
    ratio = call.compress_ratio
    s = ratio * (call.kv.shape[1] // call.norm_weight.shape[0])
    req = call.token_to_req.detach().long()
    pooling = boundary & (req >= 0) & (req < table.shape[0])
    q = pos[:, None] - s + 1 + torch.arange(s, device=pos.device)[None, :]
    col = q.div(sbs, rounding_mode="floor")
    read = pooling[:, None] & (q >= 0) & (col < table.shape[1])
    used = torch.zeros(table.shape, dtype=torch.bool, device=table.device)
    used[torch.where(pooling, req, 0)[:, None].expand_as(col)[read], col[read]] = True
    ids_in_range(op, "state_block_table", table, nsb, used=used, what="state block ids")
