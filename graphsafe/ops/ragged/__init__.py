"""Ragged (CSR) index conversions."""

from __future__ import annotations

from torch import Tensor

from graphsafe.ops.ragged import fake as fakes
from graphsafe.ops.ragged import reference, triton
from graphsafe.registry import register_op


@register_op(
    "build_ragged_indices_from_dense",
    fake=fakes.fake_build_ragged_indices_from_dense,
    check=fakes.check_build_ragged_indices_from_dense,
    family="ragged",
    debug_check="graphsafe.ops.ragged.debug:debug_check_build_ragged_indices_from_dense",
    backends=(reference.BUILD_RAGGED_INDICES_FROM_DENSE, triton.BUILD_RAGGED_INDICES_FROM_DENSE),
)
def build_ragged_indices_from_dense(indices: Tensor, lengths: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Compress the first `lengths[i]` entries of each dense row into CSR form, without host sync.

    Args:
        indices: `[N, W]` int32, contiguous; row i holds candidate indices (e.g. top-k
            cache slots of token i). Only the kept entries are read (nothing past a
            row's length influences the result).
        lengths: `[N]` int32, expected in `[0, W]`; row i keeps its first
            `clamp(lengths[i], 0, W)` entries: a negative length keeps none, one past W
            the whole row. The debug switch (`graphsafe.debug_checks`) refuses lengths
            outside `[0, W]`.
        num_rows: when >= 0, kept entries outside `[0, num_rows)` become -1 (the size of
            the table the indices point into; -1 is the padding, any other value
            outside acts as -1, the debug switch refuses it); when negative, values pass
            unchanged.

    Returns:
        flat: `[N * W]` int32. Row i's kept entries are `flat[indptr[i]:indptr[i+1]]`;
            the tail `flat[indptr[N]:]` is -1. Sized from the shape, never from the data,
            so the op captures into CUDA graphs.
        indptr: `[N + 1]` int32, `indptr[0] = 0`, `indptr[i+1] = indptr[i] + kept_i`.
    """
