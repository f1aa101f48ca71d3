"""Host cost of each op's Triton runner with Triton's C launch function called directly
(graphsafe.launch.direct_c_launch) and with the launcher's Python `__call__`, in one
process, interleaved: what the direct call saves per op call (GPU; run with PYTHONPATH=.).

The runners are called without the dispatcher and the signature lookup, at each op's
test-case `example` parameters; rows whose kernels take longer than the host's issue time
are device-bound and show less.
"""

from __future__ import annotations

import statistics
import time

import torch

import graphsafe.launch as launch
from graphsafe.registry import ops


def main(rounds: int = 11, calls: int = 500) -> None:
    direct = launch.direct_c_launch
    device = torch.device("cuda")
    for name, spec in sorted(ops().items()):
        if "triton" not in spec.backends:
            continue
        args = spec.case.inputs(spec.case.example, device, 0)
        runners = {}
        for label, probe in (("direct", direct), ("__call__", lambda run: None)):
            launch.direct_c_launch = probe  # read when a binding adopts its compiled kernel
            try:
                run = spec.prepare("triton", *args)
                run(*args)
                run(*args)
            finally:
                launch.direct_c_launch = direct
            runners[label] = run
        torch.cuda.synchronize()
        times = {label: [] for label in runners}
        for _ in range(rounds):
            for label, run in runners.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    run(*args)
                times[label].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
        d, c = statistics.median(times["direct"]), statistics.median(times["__call__"])
        print(f"{name:34s} direct {d:6.2f} us   __call__ {c:6.2f} us   saved {c - d:5.2f} us")


if __name__ == "__main__":
    main()
