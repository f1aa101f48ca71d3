"""Value checks of the attention ops for `graphsafe.debug_checks` (they read tensor
values: a host sync per call, so only while the switch is on).

Each raises `graphsafe.InputError` naming the op, the argument, the allowed range and
the first offending value, for inputs the ops accept and define (ids out of range act
as padding, cu_seqlens are cut at the tensors' ends) but that are almost surely a bug
in the caller. Each takes the op's bound call (`OpSpec.call`).
"""

from __future__ import annotations

import torch

from graphsafe.debug import (
    ids_in_range,
    max_of_differences_at_most,
    non_decreasing,
    table_entries_read,
    values_at_least,
    values_at_most,
)


def _paged_entries_read(block_table, lengths, first_visible, block_size: int) -> torch.Tensor:
    """The entries of blocks holding a token in `[first_visible[b], lengths[b])`."""
    used = table_entries_read(block_table, lengths, block_size)
    first_block = torch.div(first_visible.clamp_min(0), block_size, rounding_mode="floor")
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    return used & (columns[None, :] >= first_block.to(block_table.device)[:, None])


def _check_paged(op, k_cache, block_table, seq_lens, first_visible) -> torch.Tensor:
    """`seq_lens` within `[0, capacity]`; the block-table entries read (from the block of
    token `first_visible(lengths)` to the last) in `[0, num_blocks)` or -1. Returns the
    clamped lengths."""
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_table.shape[1] * block_size
    values_at_least(op, "seq_lens", seq_lens, 0, "a number of cached tokens")
    values_at_most(op, "seq_lens", seq_lens, capacity, "max_blocks_per_seq * block_size")
    lengths = seq_lens.detach().long().clamp(0, capacity)
    used = _paged_entries_read(block_table, lengths, first_visible(lengths), block_size)
    ids_in_range(op, "block_table", block_table, num_blocks, used=used, what="block ids (num_blocks)")
    return lengths


def debug_check_paged_attention_decode(call) -> None:
    """`seq_lens` within `[0, max_blocks_per_seq * block_size]`; the block-table entries
    a request reads (those of its first `ceil(seq_lens[b] / block_size)` blocks, less
    the blocks wholly before a sliding window) are block ids in `[0, num_blocks)` or -1
    (padding)."""
    window_left = call.window_left

    def first_visible(lengths):
        return lengths - 1 - window_left if window_left >= 0 else torch.zeros_like(lengths)

    _check_paged("paged_attention_decode", call.k_cache, call.block_table, call.seq_lens, first_visible)


def _check_cu_seqlens(op: str, arg: str, cu: torch.Tensor, total: int, max_len: int, max_arg: str) -> None:
    values_at_least(op, arg, cu, 0, "a row offset")
    non_decreasing(op, arg, cu)
    values_at_most(op, arg, cu, total, "the rows of the packed tensor")
    max_of_differences_at_most(op, arg, cu, max_len, max_arg)


def debug_check_flash_attn_varlen(call) -> None:
    """cu_seqlens_q / cu_seqlens_k: entries in `[0, Tq]` / `[0, Tk]`, non-decreasing, and
    no sequence longer than `max_seqlen_q` / `max_seqlen_k`."""
    op = "flash_attn_varlen"
    _check_cu_seqlens(op, "cu_seqlens_q", call.cu_seqlens_q, call.q.shape[0], call.max_seqlen_q, "max_seqlen_q")
    _check_cu_seqlens(op, "cu_seqlens_k", call.cu_seqlens_k, call.k.shape[0], call.max_seqlen_k, "max_seqlen_k")


def debug_check_paged_attention_prefill(call) -> None:
    """cu_seqlens_q as for `flash_attn_varlen`; `seq_lens` and the block-table entries
    read (from the block of the first query row's window) as for
    `paged_attention_decode`."""
    op = "paged_attention_prefill"
    cu_seqlens_q, window_left = call.cu_seqlens_q, call.window_left
    _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, call.q.shape[0], call.max_seqlen_q, "max_seqlen_q")
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).detach().long()

    def first_visible(lengths):
        # Row 0 sits at key position len_k - len_q; its window starts window_left before.
        return lengths - lens_q - window_left if window_left >= 0 else torch.zeros_like(lengths)

    _check_paged(op, call.k_cache, call.block_table, call.seq_lens, first_visible)
