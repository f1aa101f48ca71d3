"""A/B of the 64-head MLA kernels on the GPU: the producer kernel (`kernels/gluon_fp8_producer.py`,
a warpgroup dequantising fp8_ds_mla records, or copying a 16-bit cache's rows for sparse
calls, beside the products) against the 64-head wgmma kernel (its dequantising variant over
records), which ran these calls before it.

    python benchmarks/mla_fp8_producer_ab.py [--kernel producer|wgmma] BENCH ARGS...

runs `python -m graphsafe bench BENCH ARGS...` with the chosen kernel for every call the
producer kernel would take (`--kernel wgmma` declines it in the plan, so the runner takes
the next kernel of the choice); the bench's other rows and peers run as usual. Run it once
per kernel on one machine and compare the rows (fp8_ds_mla, and sparse over a 16-bit cache).
"""

from __future__ import annotations

import argparse
import sys

from graphsafe.__main__ import main
from graphsafe.ops.mla import plan


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("producer", "wgmma"), default="producer")
    args, rest = parser.parse_known_args(argv)
    if args.kernel == "wgmma":
        plan.fp8_producer_fits = lambda *_: False
        plan.ROWS_PRODUCER = False
    print(f"fp8_ds_mla past 16 heads, and sparse over a 16-bit cache past 16 heads, on: gluon_{args.kernel}", flush=True)
    return main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
