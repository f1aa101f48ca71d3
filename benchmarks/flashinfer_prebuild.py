"""JIT-build FlashInfer's ragged (varlen) prefill modules for given head dims, so that a
later `python -m graphsafe bench` finds them built and adds their rows without
`GRAPHSAFE_BENCH_FLASHINFER_JIT=1` (which would build every missing module of the run,
D 192 / 128 included, and can take far longer than one device call).

The shared FlashInfer tarball ships fa2 / fa3 prefill for head dim 128 only. Run this on
the GPU machine, in the same call as the bench (the JIT cache lives in the machine's home):

    PYTHONPATH=.:<flashinfer> python benchmarks/flashinfer_prebuild.py --dims 64/64
    PYTHONPATH=.:<flashinfer> python -m graphsafe bench --op flash_attn_varlen --full

Builds the fa3 and fa2 variants of each D / Dv in one ninja run (plain causal: no window,
no softcap), with `FLASHINFER_JIT_PREBUILD_MAX_JOBS` (default: the CPU count) parallel jobs,
and prints the wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", default=["64/64"], metavar="D/DV",
                        help="head dims of q.k / v to build (default: 64/64)")
    parser.add_argument("--backend", nargs="+", default=["fa3", "fa2"], choices=["fa3", "fa2"])
    args = parser.parse_args(argv)

    if shutil.which("ninja") is None:
        print("flashinfer_prebuild: FlashInfer's JIT needs `ninja` on PATH; none found", file=sys.stderr)
        return 2
    from flashinfer.jit.core import build_jit_specs

    from graphsafe.bench.flashinfer import _prefill_spec

    specs = []
    for dims in args.dims:
        d, dv = (int(x) for x in dims.split("/"))
        for backend in args.backend:
            spec = _prefill_spec(backend, d, dv, window=False, capped=False)()
            print(f"{backend} D {d} / Dv {dv}: {spec.name}", flush=True)
            specs.append(spec)
    os.environ.setdefault("FLASHINFER_JIT_PREBUILD_MAX_JOBS", str(os.cpu_count() or 1))
    start = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    print(f"built {len(specs)} modules in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
