"""A/B of the 64-head MLA kernels over fp8_ds_mla records on the GPU: the producer kernel
(`kernels/gluon_fp8_producer.py`, a warpgroup dequantising beside the products) against the
64-head wgmma kernel's dequantising variant, which ran these calls before it.

    python benchmarks/mla_fp8_producer_ab.py [--kernel producer|wgmma] [--prefetch 0|1]
        [--producer-regs N] BENCH ARGS...

runs `python -m graphsafe bench BENCH ARGS...` with the chosen kernel for every call the
producer kernel would take (`--kernel wgmma` declines it in the plan, so the runner takes
the next kernel of the choice); the bench's other rows and peers run as usual. Run it once
per kernel on one machine and compare the fp8_ds_mla rows.
"""

from __future__ import annotations

import argparse
import sys

from graphsafe.__main__ import main
from graphsafe.ops.mla import plan


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("producer", "wgmma"), default="producer")
    parser.add_argument("--prefetch", type=int, choices=(0, 1), default=None,
                        help="the producer's PREFETCH (default: the module's)")
    parser.add_argument("--producer-regs", type=int, default=None, help="the producer's registers a thread")
    args, rest = parser.parse_known_args(argv)
    if args.kernel == "wgmma":
        plan.fp8_producer_fits = lambda *_: False
    module = plan.kernel_module(plan.GLUON_FP8_PRODUCER)
    if args.prefetch is not None:
        module.PREFETCH = bool(args.prefetch)
    if args.producer_regs is not None:
        module.PRODUCER_REGS = args.producer_regs
    print(f"fp8_ds_mla past 16 heads on: gluon_{args.kernel}"
          + (f" (PREFETCH {module.PREFETCH}, {module.PRODUCER_REGS} producer registers)" if args.kernel == "producer"
             else ""), flush=True)
    return main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
