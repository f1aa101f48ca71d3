"""How far a parameter travels: the files and hops a tensor argument crosses from the public
op to the kernel launch, on a call's first run (validation, selection, prepare) and at steady
state (the bound runner), and how often the path climbs back into a file it already left.

    python benchmarks/param_trace.py [--op mla_decode] [--arg kv_cache] [--fp8]

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1 is set here), or on a GPU
(`--device cuda`, with `--gpu-example N` for the case's realistic shapes, where the sm_90
kernels are chosen), with the Triton backend forced. A frame "holds" the parameter when one of its locals is the very
tensor object (or a named tuple / view whose base is it); the path is the sequence of files
of such frames in call order, consecutive repeats merged.
"""
from __future__ import annotations

import argparse
import os
import sys

if "--device" not in sys.argv or "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def _holds(frame, target) -> bool:
    for value in frame.f_locals.values():
        if value is target:
            return True
        if isinstance(value, tuple) and any(v is target for v in value):
            return True
    return False


def trace(fn, target, root: str) -> list[str]:
    path: list[str] = []

    def tracer(frame, event, arg):
        if event == "call":
            fname = frame.f_code.co_filename
            if fname.startswith(root + "graphsafe" + os.sep) and _holds(frame, target):
                rel = os.path.relpath(fname, root)
                if not path or path[-1] != rel:
                    path.append(rel)
        return None

    sys.setprofile(None)
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return path


def summary(path: list[str]) -> str:
    climbs = sum(1 for i, f in enumerate(path) if f in path[:i])
    return f"{len(set(path))} files, {max(len(path) - 1, 0)} hops, {climbs} climbs back\n    " + " -> ".join(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="mla_decode")
    ap.add_argument("--arg", default="kv_cache")
    ap.add_argument("--fp8", action="store_true", help="an fp8_ds_mla cache (MLA ops)")
    ap.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    ap.add_argument("--gpu-example", type=int, default=None, help="the case's gpu_examples[N] instead of its small example")
    opts = ap.parse_args()

    import graphsafe
    from graphsafe.registry import get_op
    from graphsafe.testing import case_for

    spec = get_op(opts.op)
    case = case_for(opts.op)
    params = dict(case.interpreter_example or case.example) if opts.gpu_example is None else dict(
        case.gpu_examples[opts.gpu_example])
    if opts.fp8:  # an fp8_ds_mla record needs R a multiple of 128 and bf16 queries
        params.update(cache="fp8_ds_mla", R=128, P=16, dtype=torch.bfloat16)
    args = case.inputs(params, opts.device, 0)
    names = list(__import__("inspect").signature(spec.public).parameters)
    target = args[names.index(opts.arg)]
    root = os.path.dirname(os.path.dirname(graphsafe.__file__)) + os.sep  # files shown relative to the repo
    with graphsafe.use_backend("triton"):
        first = trace(lambda: spec.public(*args), target, root)
        steady = trace(lambda: spec.public(*args), target, root)
    label = f"{opts.op}({opts.arg}{', fp8_ds_mla' if opts.fp8 else ''}) on {opts.device}"
    print(f"{label}, first call: {summary(first)}")
    print(f"{label}, steady state: {summary(steady)}")


if __name__ == "__main__":
    main()
