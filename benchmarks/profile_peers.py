"""Run one bench case's impls once each inside an NVTX range, for Nsight Compute to profile
graphsafe's kernels and its peers' (FlashInfer, FlashMLA) on the same inputs:

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section WarpStateStats ... \\
        python benchmarks/profile_peers.py --case sparse_mla --shape 0 --impl graphsafe FlashMLA

`--case`: a `python -m graphsafe bench` case; `--shape`: the index of one of its default
shapes (`--full`: of its full sweep's); `--problem`: only the problems whose label
contains one of these texts (a case may yield several per shape: bf16 and fp8_ds_mla
caches, bf16 and fp8 inputs); `--impl`: only the impls whose label contains one of these
(default every impl but the PyTorch reference). Each chosen impl runs twice outside the
range (compiles, plans, workspace), then once inside it ("profile"), so ncu sees exactly
one call of each; the script prints which impl ran in which order, and the kernels each
call launched are the ncu report's in that order. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from graphsafe.bench.harness import load_cases


def chosen(label: str, impl_texts: list[str] | None) -> bool:
    """Whether the impl `label` runs: it contains one of `impl_texts`, or (none given) it is
    not a PyTorch reference row."""
    return any(text in label for text in impl_texts) if impl_texts else "reference" not in label


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", required=True)
    parser.add_argument("--shape", type=int, default=0)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--problem", nargs="*", default=None)
    parser.add_argument("--impl", nargs="*", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU: nothing profiled")
        return 0
    device = torch.device("cuda")
    case = load_cases()[args.case]
    shapes = case.shapes.full if args.full else case.shapes.default
    shape = shapes[args.shape]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "case", args.case, "shape", shape, flush=True)
    order = 0
    for problem in case.fn(device, (shape,)):
        if args.problem and not any(text in problem.shape for text in args.problem):
            continue
        for label, call in problem.impls.items():
            if not chosen(label, args.impl):
                continue
            try:
                call()
                call()
                torch.cuda.synchronize()
            except Exception as exc:  # a peer that does not take this shape: say so, go on
                print(f"  skipped {label!r} on {problem.shape}: {type(exc).__name__}: {exc}", flush=True)
                continue
            torch.cuda.nvtx.range_push("profile")
            call()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"  {order}: {problem.shape} | {label}", flush=True)
            order += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
