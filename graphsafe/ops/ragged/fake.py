"""Fakes and input checks of the ragged-index ops: `check_<op>(call)` and `fake_<op>(call)`
take the op's bound call (`OpSpec.call`)."""

from __future__ import annotations

import torch

from graphsafe import checks as c


def check_build_ragged_indices_from_dense(call) -> None:
    op = "build_ragged_indices_from_dense"
    indices, lengths = call.indices, call.lengths
    c.tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2)
    c.contiguous(op, "indices", indices)
    c.tensor(op, "lengths", lengths, dtypes=(torch.int32,), ndim=1, device=indices.device)
    c.shape(op, "lengths", lengths, (indices.shape[0],), "[N]")


def fake_build_ragged_indices_from_dense(call):
    check_build_ragged_indices_from_dense(call)
    n, w = call.indices.shape
    flat = call.indices.new_empty((n * w,))
    indptr = call.indices.new_empty((n + 1,))
    return flat, indptr
