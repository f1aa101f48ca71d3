"""Debug checks of the paged-cache writes (`graphsafe.debug_checks`): the values of the slots.

A slot outside the cache is skipped on every backend (the ops' docstrings); with the
switch on, a slot that is neither in `[0, num_blocks * block_size)` nor the padding
value -1 raises `InputError`, and so do two tokens writing the same slot (which of them
the slot ends up holding is unspecified).
"""

from __future__ import annotations

import torch

from graphsafe.debug import ids_in_range
from graphsafe.errors import InputError


def _distinct_slots(op: str, slots: torch.Tensor) -> None:
    """The slots >= 0 of `slots` (1-D) are pairwise distinct."""
    s = slots.detach().long().sort().values
    dup = (s[1:] == s[:-1]) & (s[1:] >= 0)
    if bool(dup.any()):
        value = int(s[1:][dup][0])
        at = [int(i) for i in (slots.detach().long() == value).nonzero().flatten()[:2]]
        raise InputError(f"graphsafe.{op}: argument 'slot_mapping' must be distinct cache slots (or -1), got "
                         f"slot {value} at indices {at} (GRAPHSAFE_DEBUG_CHECKS)")


def _check_slots(op: str, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = cache.shape[:2]
    ids_in_range(op, "slot_mapping", slot_mapping, num_blocks * block_size, what="cache slots")
    _distinct_slots(op, slot_mapping)


def debug_check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """Every slot in `[0, num_blocks * block_size)` or -1; the slots >= 0 distinct."""
    _check_slots("concat_and_cache_mla", kv_cache, slot_mapping)


def debug_check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Every slot in `[0, num_blocks * block_size)` or -1; the slots >= 0 distinct."""
    _check_slots("reshape_and_cache", key_cache, slot_mapping)
