"""Host cost of every op outside a graph, next to the floors of the same run.

`host_cost`: each registered op called back to back at its test case's `example`
parameters (small shapes: the GPU finishes each call long before the host issues the
next, so the time is the host's), us per call; and per call the device operations it
launches (CUDA profiler: kernels, memsets, copies) and the launches that went through
Triton's binder (`kernel[grid]`) instead of a bound handle (`graphsafe.launch`). The
floors: `torch.add` of two small tensors, an empty `torch.library` op, a Triton launch of
a trivial kernel through `kernel[grid]` and through `graphsafe.launch.bind`.

`demo_step`: the demo model's decode step at B = 1 in eager, compiled (no graphs) and
graph-replay mode (`graphsafe.demo`), and the compiled/graph step ratio: what host cost
does to a user's first `torch.compile` of a model.
"""

from __future__ import annotations

import functools
import io

import torch

from graphsafe.bench.cases.foundation import dispatch_variants
from graphsafe.bench.harness import Problem, Shapes, bench_case, time_loop_us
from graphsafe.registry import ops
from graphsafe.testing.cases import case_for


@functools.cache
def _trivial_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one_kernel(x_ptr):
        tl.store(x_ptr, 1.0)

    return _store_one_kernel


def _floors(device: torch.device) -> dict:
    a, b = torch.randn(16, device=device), torch.randn(16, device=device)
    _lib, lib_op, _custom, gs_public = dispatch_variants()
    x = torch.empty(16, device=device)
    impls = {
        "torch.add": lambda: torch.add(a, b),
        "empty Library op": lambda: lib_op(x),
        "graphsafe no-op op": lambda: gs_public.spec.overload(x),
    }
    if device.type == "cuda":
        from graphsafe.launch import bind

        kernel = _trivial_kernel()
        bound = bind(kernel, (1,), x)
        impls["triton kernel[grid]"] = lambda: kernel[(1,)](x)
        impls["triton bound launch"] = lambda: bound(x)
    return impls


def device_ops_per_call(fn, device: torch.device, calls: int = 20) -> float | None:
    """Device operations (kernels, memsets, copies) one call launches, from the profiler."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    kinds = (torch.autograd.DeviceType.CUDA,)
    count = sum(1 for e in prof.events() if e.device_type in kinds)
    return count / calls


def plain_launches_per_call(fn, calls: int = 20) -> float:
    from graphsafe.launch import plain_launch_count

    fn()
    before = plain_launch_count()
    for _ in range(calls):
        fn()
    return (plain_launch_count() - before) / calls


# GPU only: on a CPU an op's call time is its compute, not host cost.
@bench_case("host_cost", Shapes(default=("every op",), full=("every op",), cpu=None))
def host_cost(device: torch.device, shapes: tuple):
    yield Problem(case="host_cost", shape="floors", impls=_floors(device), unit="us", graph=False,
                  note="host us per call, round-robin medians")
    for name, spec in sorted(ops().items()):
        case = case_for(spec.name)
        params = case.example if device.type == "cuda" else (case.interpreter_example or case.example)
        args = case.inputs(params, device, 0)
        backend = spec.serving_backend(device.type, *args)
        op = spec.overload

        def call(op=op, args=args):
            return op(*args)

        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        kernels = device_ops_per_call(call, device)
        plain = plain_launches_per_call(call)
        yield Problem(
            case="host_cost", shape=name, impls={f"graphsafe[{backend}]": call}, unit="us", graph=False,
            note=(f"{name}: {'-' if kernels is None else f'{kernels:g}'} device ops per call, "
                  f"{plain:g} plain (binder) launches per call"),
        )


# Full sweep only (it compiles the demo model: minutes), and GPU only (`python -m
# graphsafe demo` is the CPU's run of the demo).
@bench_case("demo_step", Shapes(default=(), full=("B=1",), cpu=None))
def demo_step(device: torch.device, shapes: tuple):
    """One row per mode: median step ms of the demo model at B = 1 (a short run)."""
    from graphsafe.demo import DemoOptions, run_demo

    steps = 32 if device.type == "cuda" else 6
    opts = DemoOptions(device=device.type, batches=(1,), steps=steps, prompt_len=256 if device.type == "cuda" else 16,
                       warmup=4 if device.type == "cuda" else 2, progress=False)
    rows = run_demo(opts, out=io.StringIO())
    times = {r.mode: r.step_ms for r in rows if r.step_ms is not None}
    graphs = times.get("compiled+graphs")
    note = "; ".join(f"{m} {t:.3f} ms" for m, t in times.items())
    if graphs:
        note += "; " + ", ".join(f"{m}/graphs {t / graphs:.2f}x" for m, t in times.items() if m != "compiled+graphs")
    # The demo times its own steps (CUDA events around each step); the harness reports them.
    yield Problem(case="demo_step", shape=f"demo model B=1, {steps} steps", impls={}, unit="ms", graph=False,
                  note=note, measured=times)

