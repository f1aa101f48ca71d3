"""Test case of `build_ragged_indices_from_dense`."""

from __future__ import annotations

import torch

from graphsafe.testing.cases import BadInput, OpCase, Params, register_case
from graphsafe.testing.compare import exact_compare
from graphsafe.testing.tensors import randint


def _params():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {"N": st.integers(0, 9), "W": st.integers(0, 12), "num_rows": st.integers(-1, 20)}
    )


def _make(p: Params, device, gen):
    n, w, num_rows = p["N"], p["W"], p["num_rows"]
    hi = max(num_rows, 4) + 3
    indices = randint(-3, hi, (n, w), torch.int32, device, gen)
    lengths = randint(-2, w + 3, (n,), torch.int32, device, gen)
    return indices, lengths, num_rows


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
        edge_cases=(
            {"N": 0, "W": 4, "num_rows": 3},
            {"N": 3, "W": 0, "num_rows": 3},
            {"N": 5, "W": 2048, "num_rows": -1},
            {"N": 1500, "W": 3, "num_rows": 100},
        ),
        gpu_examples=({"N": 512, "W": 2048, "num_rows": 65536}, {"N": 8192, "W": 2048, "num_rows": -1}),
    )
)
