"""Debug checks of the ragged-index ops (`graphsafe.debug_checks`): lengths and kept ids.

Lengths outside `[0, W]` are clamped and kept ids outside `[0, num_rows)` become -1 on
every backend (the op's docstring); with the switch on, either raises `InputError`.
"""

from __future__ import annotations

import torch

from graphsafe.debug import ids_in_range, values_at_least, values_at_most


def debug_check_build_ragged_indices_from_dense(call) -> None:
    """`lengths` in `[0, W]`; when `num_rows >= 0`, every kept entry (column below its
    row's length) in `[0, num_rows)` or -1."""
    indices, lengths, num_rows = call
    op = "build_ragged_indices_from_dense"
    width = indices.shape[1]
    values_at_least(op, "lengths", lengths, 0, "a number of entries")
    values_at_most(op, "lengths", lengths, width, "indices.shape[1]: longer rows would be cut")
    if num_rows >= 0:
        kept = torch.arange(width, device=indices.device)[None, :] < lengths.long()[:, None]
        ids_in_range(op, "indices", indices, num_rows, used=kept, what="kept ids")
