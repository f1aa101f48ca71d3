"""The standard peers of an op: graphsafe through the dispatcher, and its reference
backend eager and (on a GPU) under torch.compile, all on the same inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphsafe.registry import OpSpec


def op_peers(spec: OpSpec, args: tuple, device: torch.device, compile_reference: bool = True) -> dict[str, Callable[[], Any]]:
    """graphsafe[serving backend], "reference eager" and, with `compile_reference` and a
    GPU, "reference compiled" (on a CPU the compile would take longer than the whole CPU
    run of the bench)."""
    compile_reference = compile_reference and device.type != "cpu"
    backend = spec.serving_backend(device.type)
    public = spec.public
    reference = spec.backend_impl("reference")
    impls: dict[str, Callable[[], Any]] = {f"graphsafe[{backend}]": lambda: public(*args)}
    impls["reference eager"] = lambda: reference(*args)
    if compile_reference:
        # Automatic dynamic shapes: the first shape compiles static, later shapes share one
        # dynamic graph, so a sweep neither recompiles per shape nor hits Dynamo's
        # recompile limit (past which it would silently run eager).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled = torch.compile(reference)
        impls["reference compiled"] = lambda: compiled(*args)
    return impls


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def same_picks(values: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of rows where two `[rows, k]` top-k index tensors pick the same values of
    `values [rows, N]` (as multisets: at a tie of the k-th value either index is right;
    a row of a 131072-wide normal sample ties there about once in 100 rows)."""
    a = torch.sort(values.gather(1, a.long()), dim=1).values
    b = torch.sort(values.gather(1, b.long()), dim=1).values
    return (a == b).all(dim=1).float().mean().item()


# The labels of the external peers' rows (graphsafe.bench.flashinfer, graphsafe.bench.flashmla).
PEER_PREFIXES = ("flashinfer", "flashmla")


def ratio_note(rows: list, prefixes: tuple[str, ...] = PEER_PREFIXES) -> str:
    """"graphsafe / <peer> = r" for each external peer's row of a problem (labels starting
    with one of `prefixes`), from its first (graphsafe) row: > 1 means graphsafe is slower."""
    if not rows or rows[0].error is not None:
        return ""
    first = rows[0].median_ms
    parts = [f"graphsafe / {r.impl} = {first / r.median_ms:.2f}" for r in rows[1:]
             if r.impl.startswith(prefixes) and r.error is None and r.median_ms > 0]
    return "; ".join(parts)
