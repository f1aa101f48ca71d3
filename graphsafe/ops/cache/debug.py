"""Debug checks of the paged-cache writes (`graphsafe.debug_checks`): the values of the slots.

A slot outside the cache is skipped on every backend (the ops' docstrings); with the
switch on, a slot that is neither in `[0, num_blocks * block_size)` nor the padding
value -1 raises `InputError`, and so do two tokens writing the same slot (which of them
the slot ends up holding is unspecified).
"""

from __future__ import annotations

import torch

from graphsafe.debug import ids_in_range, values_distinct


def _check_slots(op: str, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = cache.shape[:2]
    ids_in_range(op, "slot_mapping", slot_mapping, num_blocks * block_size, what="cache slots")
    values_distinct(op, "slot_mapping", slot_mapping, "cache slots")


def debug_check_concat_and_cache_mla(call) -> None:
    """Every slot in `[0, num_blocks * block_size)` or -1; the slots >= 0 distinct."""
    _check_slots("concat_and_cache_mla", call.kv_cache, call.slot_mapping)


def debug_check_reshape_and_cache(call) -> None:
    """Every slot in `[0, num_blocks * block_size)` or -1; the slots >= 0 distinct."""
    _check_slots("reshape_and_cache", call.key_cache, call.slot_mapping)
