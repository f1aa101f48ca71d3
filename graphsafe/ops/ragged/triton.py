"""Triton backend of `build_ragged_indices_from_dense`: the host side (record, prepare).

Two launches of the kernels in `graphsafe/ops/ragged/kernels/triton_csr.py` (imported
when a runner is first bound: importing this module never imports triton): one program
scans the clamped lengths into `indptr`, then one program per (row, column block) writes
every element of `flat` once.
"""

from __future__ import annotations

import torch

from graphsafe.launch import bind, output_allocator
from graphsafe.registry import Backend

# Lengths one program of the scan takes per step; columns of a row per fill program (at most).
SCAN_BLOCK = 1024
MAX_BLOCK_W = 1024


def prepare_build_ragged_indices_from_dense(call):
    from graphsafe.ops.ragged.kernels.triton_csr import fill_kernel, indptr_kernel

    indices, lengths, num_rows = call
    n, w = indices.shape
    device = indices.device
    # Placeholders for the outputs' positions in `bind` (only their device is read).
    flat = indptr = indices
    scan = bind(indptr_kernel, (1,), lengths, indptr, n, w, BLOCK=SCAN_BLOCK)
    fill = None
    if n * w > 0:
        block_w = min(1 << (w - 1).bit_length(), MAX_BLOCK_W)  # the next power of two, at most MAX_BLOCK_W
        fill = bind(fill_kernel, (n, -(-w // block_w)), indices, lengths, indptr, flat, n, w, num_rows,
                    BLOCK_W=block_w)

    new_flat = output_allocator((n * w,), torch.int32, device)
    new_indptr = output_allocator((n + 1,), torch.int32, device)

    def run(indices, lengths, num_rows):
        flat, indptr = new_flat(), new_indptr()
        scan(lengths, indptr)
        if fill is not None:
            fill(indices, lengths, indptr, flat)
        return flat, indptr

    return run


# -- the record (graphsafe/ops/ragged/__init__.py names it) --------------------------------
BUILD_RAGGED_INDICES_FROM_DENSE = Backend(name="triton", prepare=prepare_build_ragged_indices_from_dense)
