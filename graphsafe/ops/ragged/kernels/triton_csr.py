"""Triton kernels of `build_ragged_indices_from_dense`: two launches, no host sync
(bound by `graphsafe/ops/ragged/triton.py`).

1. one program scans the clamped lengths into `indptr` (a blocked cumsum with a carry);
2. one program per (row, column block) writes every element of `flat` exactly once:
   element j of row i goes to `indptr[i] + j` when j < len_i, and otherwise to the
   -1 tail at `total + i*W - indptr[i] + (j - len_i)` (the tail holds each row's unused
   columns in row order, so the tail is filled without a second pass).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def indptr_kernel(lengths_ptr, indptr_ptr, n, w, BLOCK: tl.constexpr):
    carry = tl.zeros((), dtype=tl.int32)
    tl.store(indptr_ptr, carry)
    for start in tl.range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        counts = tl.minimum(tl.maximum(tl.load(lengths_ptr + offs, mask=mask, other=0), 0), w)
        inclusive = tl.cumsum(counts, 0) + carry
        tl.store(indptr_ptr + 1 + offs, inclusive, mask=mask)
        carry += tl.sum(counts, 0)


@triton.jit
def fill_kernel(
    indices_ptr, lengths_ptr, indptr_ptr, flat_ptr, n, w, num_rows,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < w
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), w)
    start = tl.load(indptr_ptr + row).to(tl.int64)
    total = tl.load(indptr_ptr + n).to(tl.int64)
    valid = cols < length
    # Only the kept entries are read: the rest of the row goes to the -1 tail.
    values = tl.load(indices_ptr + row * w + cols, mask=mask & valid, other=-1)
    if num_rows >= 0:
        values = tl.where((values >= 0) & (values < num_rows), values, -1)
    dest = tl.where(valid, start + cols, total + row * w - start + (cols - length))
    tl.store(flat_ptr + dest, tl.where(valid, values, -1), mask=mask)

