"""Benchmarks of the paged-cache writes."""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.registry import get_op
from graphsafe.testing.cases import case_for


# (tokens, fp8 cache). T=128: a decode batch (launch-bound); T=65536: ~150 MB, well past
# the 50 MB L2, so the % of bandwidth is not flattered by cache hits across repeated calls
# (the default: the NOTES rows).
@bench_case("concat_and_cache_mla", Shapes(
    default=((65536, False), (65536, True)),
    full=((128, False), (8192, False), (65536, False), (65536, True)),
    cpu=((256, False), (256, True)),
))
def concat_and_cache_mla(device: torch.device, shapes: tuple):
    spec, case = get_op("concat_and_cache_mla"), case_for("concat_and_cache_mla")
    for t, fp8 in shapes:
        params = {"T": t, "R": 512, "P": 64, "block_size": 64, "dtype": torch.bfloat16, "fp8_cache": fp8,
                  "strided_cache": False}
        args = case.inputs(params, device, seed=0)
        kv_c, k_pe, kv_cache, slots, _ = args
        live = int((slots >= 0).sum())  # host read at set-up only; padding tokens move nothing
        row_in = (512 + 64) * kv_c.element_size()
        row_out = (512 + 64) * kv_cache.element_size()
        yield Problem(
            case=spec.name,
            shape=f"T={t} ({live} live) R=512 P=64 bs=64 {'fp8' if fp8 else 'bf16'} cache",
            impls=op_peers(spec, args, device),
            bytes=nbytes(slots) + live * (row_in + row_out),
            note="bytes count the live tokens only (about a quarter of the drawn slots are padding, -1)",
        )


# (tokens, fp8 cache), as for concat_and_cache_mla.
@bench_case("reshape_and_cache", Shapes(
    default=((65536, False), (65536, True)),
    full=((64, False), (8192, False), (65536, False), (65536, True)),
    cpu=((256, False), (256, True)),
))
def reshape_and_cache(device: torch.device, shapes: tuple):
    spec, case = get_op("reshape_and_cache"), case_for("reshape_and_cache")
    for t, fp8 in shapes:
        params = {"T": t, "Hk": 8, "D": 128, "Dv": None, "block_size": 16, "dtype": torch.bfloat16, "fp8_cache": fp8, "strided_cache": False}
        args = case.inputs(params, device, seed=0)
        key, value, k_cache, v_cache, slots, _, _ = args
        live = int((slots >= 0).sum())  # host read at set-up only; padding tokens move nothing
        row = 2 * 8 * 128  # k and v elements of one token
        yield Problem(
            case=spec.name,
            shape=f"T={t} ({live} live) Hk=8 D=128 bs=16 {'fp8' if fp8 else 'bf16'} cache",
            impls=op_peers(spec, args, device),
            bytes=nbytes(slots) + live * row * (key.element_size() + k_cache.element_size()),
            note="bytes count the live tokens only (about a quarter of the drawn slots are padding, -1)",
        )

