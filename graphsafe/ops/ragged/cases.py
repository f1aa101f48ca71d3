"""Test case of `build_ragged_indices_from_dense`."""

from __future__ import annotations

import torch

from graphsafe.testing.cases import BadInput, OpCase, Params, reads_no_floats, register_case
from graphsafe.testing.compare import exact_compare
from graphsafe.testing.tensors import randint


def _params():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {"N": st.integers(0, 9), "W": st.integers(0, 12), "num_rows": st.integers(-1, 20)}
    )


def _make(p: Params, device, gen):
    """Ids in `[0, num_rows)` or -1 (padding), lengths in `[0, W]`; with num_rows < 0 any
    ids. Values outside those ranges are `_out_of_range`'s (the debug switch refuses them)."""
    n, w, num_rows = p["N"], p["W"], p["num_rows"]
    if num_rows >= 0:
        indices = randint(-1, max(num_rows, 1), (n, w), torch.int32, device, gen)
        indices = torch.where(indices < num_rows, indices, -1)
    else:
        indices = randint(-3, 20, (n, w), torch.int32, device, gen)
    lengths = randint(0, w + 1, (n,), torch.int32, device, gen)
    return indices, lengths, num_rows


def _kept(indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(indices.shape[1])
    return cols[None, :] < lengths.cpu().long().clamp(min=0)[:, None]


def _unread(params: Params, args):
    """The entries past each row's (clamped) length."""
    indices, lengths, _ = args
    return [(0, ~_kept(indices, lengths))]


BAD = (10**6, -5, -2)


def _out_of_range(params: Params, args, gen: torch.Generator):
    """Some lengths replaced by 10**6, -5, -2 or W + 1 (paired with the bound they act as,
    0 or W: lengths are clamped, they have no padding value); with num_rows >= 0, some
    kept ids replaced by 10**6, -5, -2 or num_rows (paired with -1, the padding)."""
    indices, lengths, num_rows = args
    n, w = indices.shape
    if n == 0:
        return None
    where = torch.randperm(n, generator=gen)[: max(1, n // 3)]
    choices = torch.tensor([*BAD, w + 1], dtype=torch.int32)
    values = choices[torch.randperm(4, generator=gen)][torch.arange(where.numel()) % 4]
    bad_len, ok_len = lengths.clone(), lengths.clone()
    bad_len[where.to(lengths.device)] = values.to(lengths.device)
    ok_len[where.to(lengths.device)] = values.clamp(0, w).to(lengths.device)
    bad_ids, ok_ids = indices.clone(), indices.clone()
    kept = _kept(indices, ok_len).flatten().nonzero().flatten()
    if num_rows >= 0 and kept.numel() > 0:
        at = kept[torch.randperm(kept.numel(), generator=gen)[: max(1, kept.numel() // 4)]]
        ids = torch.tensor([*BAD, num_rows], dtype=torch.int32)[torch.arange(at.numel()) % 4]
        bad_ids.view(-1)[at.to(indices.device)] = ids.to(indices.device)
        ok_ids.view(-1)[at.to(indices.device)] = -1
    return (bad_ids, bad_len, num_rows), (ok_ids, ok_len, num_rows)


EXAMPLE: Params = {"N": 6, "W": 8, "num_rows": 10}


def _bad(device, gen):
    indices, lengths, num_rows = _make(EXAMPLE, device, gen)
    return [
        BadInput("indices int64", (indices.long(), lengths, num_rows), "indices", "dtype"),
        BadInput("indices 1-D", (indices.flatten(), lengths, num_rows), "indices", "2-D"),
        BadInput("indices not contiguous", (indices.t(), lengths, num_rows), "indices", "contiguous"),
        BadInput("lengths of other N", (indices, lengths[1:], num_rows), "lengths", r"\[N\]"),
        BadInput("lengths int64", (indices, lengths.long(), num_rows), "lengths", "dtype"),
    ]


register_case(
    OpCase(
        op="build_ragged_indices_from_dense",
        params=_params,
        example=EXAMPLE,
        make=_make,
        compare=exact_compare("build_ragged_indices_from_dense"),
        bad_inputs=_bad,
        unread=_unread,
        out_of_range=_out_of_range,
        nonfinite=reads_no_floats,
        edge_cases=(
            {"N": 0, "W": 4, "num_rows": 3},
            {"N": 3, "W": 0, "num_rows": 3},
            {"N": 5, "W": 2048, "num_rows": -1},
            {"N": 1500, "W": 3, "num_rows": 100},
        ),
        gpu_examples=({"N": 512, "W": 2048, "num_rows": 65536}, {"N": 8192, "W": 2048, "num_rows": -1}),
    )
)
