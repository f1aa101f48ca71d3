"""Can this Triton's Gluon move a tile between the CTAs of a cluster (distributed shared memory)?

FlashMLA's FP8 sparse decode splits each key tile's dequantisation over a 2-CTA cluster and
shares the halves through distributed shared memory (DSMEM); a graphsafe kernel would need
the same from Gluon (issue 34, benchmarks/NOTES.md). Gluon expresses clusters with the
`num_ctas` launch option and CGA layouts (`cga_layout`: how the CTAs of a cluster tile a
tensor, in CTA tiles: `[[1, 0]]` splits dimension 0 into two halves, `[[0, 0]]` gives
every CTA the whole tensor). A DSMEM exchange is then a layout conversion between two such
layouts. This script compiles minimal kernels of 2 CTAs for sm_90 (no GPU needed: Triton's
pipeline and ptxas run on the CPU) and prints, per kernel, whether it compiled and how many
cluster operations its PTX holds (`mapa`: a peer CTA's shared-memory address;
`ld/st.shared::cluster`: DSMEM accesses; `barrier.cluster`):

- `split`: a [128, 64] bf16 tile loaded split by rows over the 2 CTAs and stored back (no
  exchange: the control);
- `split_to_whole`: the same tile converted to a layout in which each CTA holds all rows
  (each CTA receives the other's half: what sharing a dequantised tile needs);
- `rows_to_columns`: split by rows converted to split by columns (a half exchanged each way).

    python benchmarks/gluon_cluster_probe.py

Prints NO_GLUON where this Triton has no Gluon or no CUDA backend.
"""

from __future__ import annotations

import re
import sys

CASES = {
    # name: (cga_layout of the loaded tile, cga_layout it is converted to)
    "split": ([[1, 0]], [[1, 0]]),
    "split_to_whole": ([[1, 0]], [[0, 0]]),
    "rows_to_columns": ([[1, 0]], [[0, 1]]),
}
CLUSTER_OPS = ("mapa", "ld.shared::cluster", "st.shared::cluster", "barrier.cluster")


def probe(name: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    src_cga, dst_cga = CASES[name]
    SRC = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=src_cga))
    DST = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=dst_cga))

    @gluon.jit
    def exchange(x_ptr, y_ptr):
        rows = gl.arange(0, 128, layout=gl.SliceLayout(1, SRC))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, SRC))
        offs = rows[:, None] * 64 + cols[None, :]
        x = gl.load(x_ptr + offs)
        gl.store(y_ptr + gl.convert_layout(offs, DST), gl.convert_layout(x, DST))

    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn=exchange, signature={"x_ptr": "*bf16", "y_ptr": "*bf16"}, constexprs={}, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2})
    except Exception as exc:  # noqa: BLE001 - the answer is whether it compiles, and why not
        why = [line for line in str(exc).splitlines() if "error" in line.lower()] or [str(exc).splitlines()[-1]]
        return f"{name:16s} does not compile: {why[0].strip()[:200]}"
    ptx = kernel.asm["ptx"]
    counts = ", ".join(f"{op} {len(re.findall(re.escape(op), ptx))}" for op in CLUSTER_OPS)
    return f"{name:16s} compiles; PTX: {counts}"


def main() -> int:
    try:
        import triton
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        print("NO_GLUON")
        return 0
    print(f"triton {triton.__version__}, sm_90, num_ctas=2, 4 warps a CTA, a [128, 64] bf16 tile")
    for name in CASES:
        print(probe(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
