"""Reference backend of the ragged-index ops: vectorised PyTorch, no host sync."""

from __future__ import annotations

import torch

from graphsafe.registry import Backend


def build_ragged_indices_from_dense(indices: torch.Tensor, lengths: torch.Tensor, num_rows: int):
    n, w = indices.shape
    counts = lengths.clamp(0, w)
    # indptr by zeros + cumsum: its size comes from the shape, never from the data.
    indptr = torch.zeros(n + 1, dtype=torch.int32, device=indices.device)
    indptr[1:] = torch.cumsum(counts, 0)
    if n * w == 0:
        return torch.empty(0, dtype=torch.int32, device=indices.device), indptr
    # Gather instead of scatter: output position p belongs to the row whose span holds
    # it; positions past the last span are the -1 tail. No boolean masks, no .item().
    pos = torch.arange(n * w, device=indices.device, dtype=torch.int32)
    row = torch.searchsorted(indptr[1:], pos, right=True).clamp_max(n - 1)
    col = (pos - indptr[row]).clamp(0, w - 1)
    in_span = pos < indptr[n]
    # Entries past a row's length are never selected: `col` stays below the row's length
    # for positions in a span, and the tail is replaced by -1 through `torch.where`.
    values = indices[row.long(), col.long()]
    if num_rows >= 0:
        values = torch.where((values >= 0) & (values < num_rows), values, -1)
    flat = torch.where(in_span, values, -1).to(torch.int32)
    return flat, indptr


# -- the record (graphsafe/ops/ragged/__init__.py names it) --------------------------------
BUILD_RAGGED_INDICES_FROM_DENSE = Backend(name="reference", impl=build_ragged_indices_from_dense)
