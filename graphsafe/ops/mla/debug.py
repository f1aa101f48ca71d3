"""Debug checks of the MLA attention ops (`graphsafe.debug_checks`): the values of their ids.

An id outside the cache acts as padding on every backend (the ops' docstrings); with the
switch on, any id the op reads that is neither in range nor the padding value -1 raises
`InputError`, and so do lengths the op would silently clamp.
"""

from __future__ import annotations

import torch

from graphsafe.debug import ids_in_range, table_entries_read, values_at_least, values_at_most


def debug_check_mla_decode(call) -> None:
    """`seq_lens` at most `max_blocks * block_size` (longer requests would be cut; a length
    <= 0 is documented as "no key" and passes); every block-table entry of a position below
    its request's length in `[0, num_blocks)` or -1 (entries past it are never read)."""
    op = "mla_decode"
    kv_cache, block_table, seq_lens = call.kv_cache, call.block_table, call.seq_lens
    num_blocks, block_size = kv_cache.shape[:2]
    max_blocks = block_table.shape[1]
    capacity = max_blocks * block_size
    values_at_most(op, "seq_lens", seq_lens, capacity, "max_blocks * block_size: longer requests would be cut")
    used = table_entries_read(block_table, seq_lens, block_size)
    ids_in_range(op, "block_table", block_table, num_blocks, used=used, what="block ids")


def debug_check_sparse_mla(call) -> None:
    """Every entry of `indices` the op reads (all, or those left of `topk_length[t]`) in
    `[0, num_blocks * block_size)` or -1; `topk_length` within `[0, K]`."""
    op = "sparse_mla"
    kv_cache, indices, topk_length = call.kv_cache, call.indices, call.topk_length
    num_blocks, block_size = kv_cache.shape[:2]
    used = None
    if topk_length is not None:
        values_at_least(op, "topk_length", topk_length, 0, "a number of entries")
        values_at_most(op, "topk_length", topk_length, indices.shape[1], "K, the entries of a row of indices")
        columns = torch.arange(indices.shape[1], device=indices.device)
        used = columns[None, :] < topk_length.detach().long()[:, None]
    ids_in_range(op, "indices", indices, num_blocks * block_size, used=used, what="cache slots")
