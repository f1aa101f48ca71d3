"""Can this Triton's Gluon give its copies an L2 cache hint (FlashMLA's EVICT_FIRST / evict_last)?

FlashMLA's dense decode reads the cache by TMA with `CacheHintSm90::EVICT_FIRST` ("improves L2
cache hit rates", its deep dive), and its sparse kernels gather rows by cp.async with an
evict_last policy (issue 34, benchmarks/NOTES.md). This script compiles minimal Gluon kernels
for sm_90 (no GPU needed: Triton's pipeline runs on the CPU) and prints, per copy kind, whether
this Triton's Gluon takes a cache hint and how many copies in its PTX carry one
(`.L2::cache_hint`, or an `evict_*` qualifier):

- `tma`: a [64, 64] bf16 tile by TMA (the paged decode kernel's copy) with no hint: the control;
- `tma_evict_first`: the same with `cache_policy="evict_first"` where the API has that argument;
- `cp_async_evict_last`: a [64, 64] bf16 tile by cp.async with `eviction_policy="evict_last"`
  (the sparse kernels' row gathers).

    python benchmarks/gluon_cache_hint_probe.py

Prints NO_GLUON where this Triton has no Gluon or no CUDA backend.
"""

from __future__ import annotations

import inspect
import re
import sys

HINTS = (r"L2::cache_hint", r"evict_first", r"evict_last")


def _hints(ptx: str) -> str:
    copies = [line for line in ptx.splitlines() if re.search(r"cp\.async\.(ca|cg|bulk\.tensor)", line)]
    return f"{len(copies)} copy instruction(s), " + ", ".join(
        f"{h} {sum(bool(re.search(re.escape(h), c)) for c in copies)}" for h in HINTS)


def _compile(fn, signature: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    src = GluonASTSource(fn=fn, signature=signature, constexprs={}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def probe_tma(hint: bool) -> str:
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    name = "tma_evict_first" if hint else "tma"
    api = inspect.signature(getattr(load, "__wrapped__", load))
    if hint and "cache_policy" not in api.parameters:
        return f"{name:20s} not expressible: {load.__name__}{api}"
    policy = None
    if hint:  # Triton >= 3.9 spells the hint as an object; a plain string where that is what the API takes
        try:
            from triton.experimental.gluon.language.nvidia.ampere import CachePolicy, FractionalEvictionPolicy
            policy = CachePolicy(l2=FractionalEvictionPolicy("evict_first", 1.0))
        except ImportError:
            policy = "evict_first"
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    desc = TensorDescriptor(torch.empty(0, dtype=torch.bfloat16), [4096, 64], [64, 1], [64, 64], layout)
    POLICY = gl.constexpr(policy)
    OUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def copy_tile(desc, y_ptr):
        smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, desc.block_type.nbytes)
        if POLICY is None:
            load(desc, [0, 0], bar, smem)
        else:
            load(desc, [0, 0], bar, smem, cache_policy=POLICY)
        mbarrier.wait(bar, 0)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, OUT))
        gl.store(y_ptr + rows[:, None] * 64 + cols[None, :], smem.load(OUT))

    try:
        ptx = _compile(copy_tile, {"desc": mangle_type(desc), "y_ptr": "*bf16"})
    except Exception as exc:  # noqa: BLE001 - the answer is whether it compiles, and why not
        return f"{name:20s} does not compile: {str(exc).splitlines()[-1][:200]}"
    return f"{name:20s} compiles; PTX: {_hints(ptx)}"


def probe_cp_async() -> str:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy

    load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def gather(x_ptr, y_ptr):
        smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64],
                                                                                                   gl.bfloat16))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
        load(smem, x_ptr + rows[:, None] * 64 + cols[None, :], eviction_policy="evict_last")
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.store(y_ptr + rows[:, None] * 64 + cols[None, :], smem.load(L))

    try:
        ptx = _compile(gather, {"x_ptr": "*bf16", "y_ptr": "*bf16"})
    except Exception as exc:  # noqa: BLE001
        return f"{'cp_async_evict_last':20s} does not compile: {str(exc).splitlines()[-1][:200]}"
    return f"{'cp_async_evict_last':20s} compiles; PTX: {_hints(ptx)}"


def main() -> int:
    try:
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        print("NO_GLUON")
        return 0
    print(f"triton {triton.__version__}, sm_90, 4 warps, a [64, 64] bf16 tile")
    print(probe_tma(False))
    print(probe_tma(True))
    print(probe_cp_async())
    return 0


if __name__ == "__main__":
    sys.exit(main())
