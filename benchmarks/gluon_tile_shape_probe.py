"""Which key-tile widths can a Gluon wgmma take? (Triton's blocks are powers of two.)

The fp8_ds_mla producer kernel (issue 34, benchmarks/NOTES.md) would find room in shared
memory for a third buffer of raw records with 48-key tiles (each consumer warpgroup's q.k
at N = 24 keys): 210 KiB against 256 at 64 keys. This script compiles, for sm_90 (no GPU
needed: Triton's pipeline and ptxas run on the CPU), a minimal kernel per width N: one
wgmma of a [64, 64] bf16 A and a [64, N] B from shared memory into a [64, N] fp32
accumulator, stored. It prints per N whether it compiled, and why not.

    python benchmarks/gluon_tile_shape_probe.py

Prints NO_GLUON where this Triton has no Gluon or no CUDA backend.
"""

from __future__ import annotations

import sys

WIDTHS = (16, 32, 64, 24, 48)  # powers of two (the controls), then the 48-key tile's N's


def probe(n: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

    @gluon.jit
    def tile(out_ptr, N: gl.constexpr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, N, 16])
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, N], gl.bfloat16)
        a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], a_layout)
        b = gl.allocate_shared_memory(gl.bfloat16, [64, N], b_layout)
        acc = warpgroup_mma(a, b, gl.zeros([64, N], gl.float32, layout=acc_layout))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
        gl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)

    src = GluonASTSource(fn=tile, signature={"out_ptr": "*fp32", "N": "constexpr"}, constexprs={"N": n})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # noqa: BLE001 - the answer is whether it compiles, and why not
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"N {n:3d} does not compile: {(lines[-1] if lines else type(exc).__name__)[:200]}"
    return f"N {n:3d} compiles"


def main() -> int:
    try:
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        print("NO_GLUON")
        return 0
    print(f"triton {triton.__version__}, sm_90, one warpgroup: wgmma [64, 64] x [64, N] bf16 -> [64, N] fp32")
    for n in WIDTHS:
        print(probe(n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
