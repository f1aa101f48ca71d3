"""Fakes and input checks of the ragged-index ops."""

from __future__ import annotations

import torch

from graphsafe import checks as c


def check_build_ragged_indices_from_dense(indices: torch.Tensor, lengths: torch.Tensor, num_rows: int) -> None:
    op = "build_ragged_indices_from_dense"
    c.tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2)
    c.contiguous(op, "indices", indices)
    c.tensor(op, "lengths", lengths, dtypes=(torch.int32,), ndim=1, device=indices.device)
    c.shape(op, "lengths", lengths, (indices.shape[0],), "[N]")


def fake_build_ragged_indices_from_dense(indices, lengths, num_rows):
    check_build_ragged_indices_from_dense(indices, lengths, num_rows)
    n, w = indices.shape
    flat = indices.new_empty((n * w,))
    indptr = indices.new_empty((n + 1,))
    return flat, indptr
