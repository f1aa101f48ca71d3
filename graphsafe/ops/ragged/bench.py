"""Benchmarks of the ragged-index helpers."""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.registry import get_op
from graphsafe.testing.cases import case_for


# (rows N, width W)
@bench_case("build_ragged_indices_from_dense", Shapes(
    default=((8192, 2048),),
    full=((64, 2048), (8192, 2048)),
    cpu=((64, 256),),
))
def build_ragged_indices_from_dense(device: torch.device, shapes: tuple):
    spec, case = get_op("build_ragged_indices_from_dense"), case_for("build_ragged_indices_from_dense")
    for n, w in shapes:
        args = case.inputs({"N": n, "W": w, "num_rows": 100_000}, device, seed=0)
        indices, lengths, _ = args
        yield Problem(
            case=spec.name,
            shape=f"N={n} W={w}",
            impls=op_peers(spec, args, device),
            # read indices + lengths, write flat + indptr
            bytes=nbytes(indices, lengths) + n * w * 4 + (n + 1) * 4,
        )
