"""Host-side costs of the foundation: op dispatch overhead and workspace requests.

Both are host time per call (Python loop, device synchronised around it), in us.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.registry import new_registry
from graphsafe.workspace import WorkspaceManager


def _body(x: Tensor) -> None:
    """The op body of every variant: nothing, so only the dispatch path is timed."""


def _check(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError("x must be a Tensor")


def _fake(x: Tensor) -> None:
    _check(x)


@functools.cache
def dispatch_variants():
    """The same no-op registered four ways (once per process)."""
    lib = torch.library.Library("gs_bench_lib", "DEF")
    lib.define("noop(Tensor(a!) x) -> ()")
    lib.impl("noop", _body, "CPU")
    lib.impl("noop", _body, "CUDA")
    lib._register_fake("noop", _fake)

    @torch.library.custom_op("gs_bench_co::noop", mutates_args=("x",))
    def custom_noop(x: Tensor) -> None:
        _body(x)

    @custom_noop.register_fake
    def _(x):
        return None

    reg = new_registry("gs_bench_gs")

    @reg.register_op("noop", fake=_fake, check=_check, backends={"reference": _body, "triton": _body}, mutates_args=("x",))
    def graphsafe_noop(x: Tensor) -> None:
        """No-op.

        Args:
            x: any tensor (declared mutated so the op may return None).
        """

    return lib, torch.ops.gs_bench_lib.noop.default, torch.ops.gs_bench_co.noop.default, graphsafe_noop


# One problem each, the same on every device (host time is what they measure).
ONE_PROBLEM = Shapes(default=("one",), full=("one",), cpu=("one",))


@bench_case("dispatch_overhead", ONE_PROBLEM)
def dispatch_overhead(device: torch.device, shapes: tuple):
    _lib, lib_op, custom_op, gs_public = dispatch_variants()
    gs_op = gs_public.spec.overload
    x = torch.empty(16, device=device)
    yield Problem(
        case="dispatch_overhead",
        shape=f"no-op, 1 tensor arg, {device.type}",
        impls={
            "direct python call": lambda: _body(x),
            "Library.define/impl": lambda: lib_op(x),
            "torch.library.custom_op": lambda: custom_op(x),
            "graphsafe torch.ops": lambda: gs_op(x),
            "graphsafe public fn": lambda: gs_public(x),
        },
        unit="us",
        note="host time per call; target: graphsafe torch.ops <= Library.define/impl + 0.5 us",
    )


def _arena_slices(arena: Tensor, specs) -> list[Tensor]:
    """Three views carved afresh from one arena on every call (no caching)."""
    views, offset = [], 0
    for shape, dtype in specs:
        offset = (offset + 255) // 256 * 256
        n = math.prod(shape) * dtype.itemsize
        views.append(arena[offset : offset + n].view(dtype).view(shape))
        offset += n
    return views


@bench_case("workspace", ONE_PROBLEM)
def workspace(device: torch.device, shapes: tuple):
    # The decode indexer's three buffers at B=64, next_n=1, a 32k context (logits, top-k
    # scratch, per-row counters): a realistic request signature.
    specs = (((64, 32768), torch.float32), ((64, 2048), torch.int32), ((64, 4), torch.int32))
    manager = WorkspaceManager(device)
    manager.reserve(*specs)
    arena = torch.empty(manager.size_bytes, dtype=torch.uint8, device=device)
    yield Problem(
        case="workspace",
        shape="3 buffers: [64,32768] f32, [64,2048] i32, [64,4] i32",
        impls={
            "3x torch.empty": lambda: [torch.empty(s, dtype=d, device=device) for s, d in specs],
            "3 views sliced per call": lambda: _arena_slices(arena, specs),
            "get_simultaneous (cached)": lambda: manager.get_simultaneous(*specs, owner="bench"),
        },
        unit="us",
        note="host time per call; target: get_simultaneous < 2 us",
    )
