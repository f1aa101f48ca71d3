"""Command line: `python -m graphsafe {list,check,bench,demo,soak}`.

    list    every op, its schema, the backend serving it on each device here, its fake
    check   the op contract on every op, on every device here; a table; exit 1 on failure
    bench   benchmarks (GPU for meaningful numbers); a table, optionally JSON
    demo    greedy decoding with the demo model: eager, compiled, compiled + CUDA graphs; a table
    soak    many graph replays of the demo model under changing load: memory, allocations, outputs
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch


def _ops():
    import graphsafe

    return graphsafe.op_table()


def cmd_list(args: argparse.Namespace) -> int:
    from graphsafe.backends import device_types_here

    devices = device_types_here()
    for name, spec in sorted(_ops().items()):
        serving = ", ".join(f"{d}: {spec.serving_backend(d)}" for d in devices)
        available = ", ".join(f"{d}: {'/'.join(spec.available_backends(d))}" for d in devices)
        print(f"graphsafe::{name}{spec.schema}")
        print(f"    family: {spec.family}   mutates: {', '.join(spec.mutates_args) or '-'}   fake: {spec.fake.__module__}.{spec.fake.__name__}")
        print(f"    backends: {', '.join(spec.backends)}   available here: {available}   serving: {serving}")
        sized = [b for b, record in spec.backends.items() if record.workspace is not None]
        if sized:
            print(f"    workspace ({', '.join(sized)}): worst case from shapes via OpSpec.workspace_specs(...)")
        fallbacks = [b for b, record in spec.backends.items() if record.supports is not None]
        if fallbacks:
            print(f"    per-shape support: {', '.join(fallbacks)} (other shapes go to the next backend)")
        if args.why:
            for line in _why(spec, devices):
                print(f"    {line}")
    return 0


def _why(spec, devices: list[str]) -> list[str]:
    """Per device: why each backend can or cannot run there, then for the op's example
    shapes (the realistic GPU ones on a GPU) which backend serves them, what it runs
    (its record's `explain`) and why the backends before it declined."""
    from graphsafe.testing.cases import case_for

    lines = []
    case = case_for(spec.name)
    for device_type in devices:
        answers = spec.explain(device_type)
        lines.append(f"why on {device_type}: " + "; ".join(
            f"{b} {'can run' if a else 'cannot: ' + a.reason}" for b, a in answers))
        examples = list(case.gpu_examples) if device_type == "cuda" and case.gpu_examples else [case.example]
        for i, params in enumerate(examples):
            try:
                args = case.inputs(params, device_type, i)
                label = _shape_label(params)
                served = spec.serving_backend(device_type, *args)
                order = spec.selection_order(device_type)
                declined = [f"{b}: {spec.support(b, *args).reason}" for b in order[:order.index(served)]]
                explain = spec.backends[served].explain
                what = f" ({explain(spec.call(*args))})" if explain is not None else ""
                lines.append(f"  {label}: {served}{what}" + (f"; declined: {'; '.join(declined)}" if declined else ""))
            except Exception as err:  # noqa: BLE001 - a listing never fails on one example
                lines.append(f"  {_shape_label(params)}: {type(err).__name__}: {err}")
            finally:
                args = None
    return lines


def _shape_label(params: dict) -> str:
    return " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in params.items())


def _run_check(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - every failure becomes a table cell and a detail line
        return "FAIL", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
    return ("ok" if result is None else str(result)), ""


def _check_predicates(spec, case, device: torch.device, seed: int) -> str:
    """The `supports` predicates of the backends that can run here, each option of the op
    switched on and off, over the example, edge cases and adapter examples
    (`contract.check_supports_with_each_option`): "accepted/asked"."""
    from graphsafe.testing import contract as C

    backends = [b for b in C.predicate_backends(spec) if b in spec.available_backends(device.type)]
    if not backends:
        return "none here"
    counts = {"accepted": 0, "declined": 0}
    for i, params in enumerate([case.example, *case.edge_cases, *case.adapter_examples]):
        got = C.check_supports_with_each_option(spec, case, params, device, seed + i, backends=backends)
        counts = {k: counts[k] + got[k] for k in counts}
    return f"{counts['accepted']}/{counts['accepted'] + counts['declined']}"


def _quick_params(case, device_type: str) -> dict:
    """The one input set of a default `check`: the op's example, or its smaller
    interpreter example where Triton's interpreter runs the kernels (a CPU)."""
    from graphsafe.backends import triton_interpreter_enabled

    if device_type == "cpu" and triton_interpreter_enabled():
        return case.interpreter_example or case.example
    return case.example


def cmd_check(args: argparse.Namespace) -> int:
    from graphsafe.testing import contract as C

    # The checks feed NaN and inf on purpose (and random cache bytes decode to NaN): the
    # numpy warnings of Triton's interpreter about them would break up the table. Any
    # other warning still shows.
    with C.nonfinite_expected():
        return _check_table(args)


def _check_table(args: argparse.Namespace) -> int:
    from graphsafe.backends import device_types_here
    from graphsafe.testing import contract as C
    from graphsafe.testing.cases import case_for

    devices = args.device or device_types_here()
    names = args.op or sorted(_ops())
    table = _ops()
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown op(s): {unknown}", file=sys.stderr)
        return 2
    columns = ["opcheck", "fake=real", "mutation", "kernels=ref", "bad inputs", "fake/workspace",
               "unread", "bad ids", "nan/inf", "debug ids", "predicates"]
    if any(d == "cuda" for d in devices):
        columns += ["graph replay", "no sync", "allocs"]
    header = f"{'op':<34} {'device':<6} {'serving':<10} " + " ".join(f"{c:>14}" for c in columns) + f" {'s':>6}"
    print(header)
    print("-" * len(header))
    failures = []
    for device_type in devices:
        device = torch.device(device_type)
        for name in names:
            spec = table[name]
            case = case_for(spec.name)
            sets = C.example_inputs(case, device, seed=args.seed) if args.full else [
                (params, case.inputs(params, device, args.seed)) for params in [_quick_params(case, device_type)]]
            kernels = [b for b in spec.available_backends(device_type) if b != "reference"]

            def kernels_match(spec=spec, case=case, sets=sets, kernels=kernels) -> str:
                if not kernels:
                    return "none here"
                for backend in kernels:
                    for params, a in sets:
                        C.check_backend_matches_reference(spec, case, backend, a, params)
                return "/".join(kernels)

            def each(check, spec=spec, sets=sets) -> None:
                for _, a in sets:
                    check(spec, a)

            def per_backend(check, spec=spec, case=case, sets=sets, backends=("reference", *kernels)) -> None:
                # What an op never reads, ids out of range, NaN/inf: on every backend here.
                for backend in backends:
                    if check is C.check_nonfinite_inputs_agree and backend == "reference":
                        continue
                    for params, a in sets:
                        check(spec, case, backend, params, a)

            checks: dict[str, Callable[[], object]] = {
                "opcheck": lambda: each(C.opcheck_op),
                "fake=real": lambda: each(C.check_fake_matches_real),
                "mutation": lambda: each(C.check_mutation_and_aliasing),
                "kernels=ref": kernels_match,
                "bad inputs": lambda: f"{C.check_bad_inputs(spec, case, device)} refused",
                "fake/workspace": lambda: each(C.check_fake_never_touches_workspace),
                "unread": lambda: per_backend(C.check_unread_inputs_never_matter),
                "bad ids": lambda: per_backend(C.check_out_of_range_ids_are_padding),
                "nan/inf": lambda: per_backend(C.check_nonfinite_inputs_agree),
                "debug ids": lambda: "refused" if any(
                    [C.check_debug_switch_refuses_out_of_range_ids(spec, case, p, a) for p, a in sets]) else "no ids",
                "predicates": lambda: _check_predicates(spec, case, device, args.seed),
            }
            if device_type == "cuda":
                gpu_sets = [case.example, *(case.edge_cases if args.full else ()), *case.gpu_examples]

                def each_gpu(check, spec=spec, gpu_sets=gpu_sets) -> None:
                    for params in gpu_sets:
                        check(spec, params, device)

                checks["graph replay"] = lambda: each_gpu(C.check_cuda_graph_replay)
                checks["no sync"] = lambda: each_gpu(C.check_no_host_sync)
                checks["allocs"] = lambda: each_gpu(C.check_allocates_only_outputs)
            t0 = time.perf_counter()
            cells = []
            for column in columns:
                if column not in checks:
                    cells.append("-")
                    continue
                status, detail = _run_check(checks[column])
                cells.append(status)
                if detail:
                    failures.append(f"{name} on {device_type}, {column}: {detail}")
            elapsed = time.perf_counter() - t0
            print(
                f"{name:<34} {device_type:<6} {spec.serving_backend(device_type):<10} "
                + " ".join(f"{c[:14]:>14}" for c in cells)
                + f" {elapsed:>6.1f}",
                flush=True,
            )
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            print("  " + f.replace("\n", "\n    "))
        return 1
    print(f"\nall contract checks passed ({len(names)} ops, devices: {', '.join(devices)})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from graphsafe.bench import harness

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = harness.load_cases()
    if args.list:
        for name, case in sorted(cases.items()):
            cpu = "needs a GPU" if case.shapes.cpu is None else str(len(case.shapes.cpu))
            print(f"{name:<34} shapes: default {len(case.shapes.default)}, full {len(case.shapes.full)}, cpu {cpu}")
        return 0
    if args.time_limit is not None and args.time_limit < 0:
        print("bench: --time-limit must be >= 0", file=sys.stderr)
        return 2
    harness.run(args.op, device, json_path=args.json, full=args.full, time_limit=args.time_limit,
                reference=not args.no_reference, only=args.only)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from graphsafe import demo

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    opts = demo.default_options(device)
    for name in ("steps", "prompt_len", "backend", "warmup", "seed", "plot", "threads", "tp"):
        value = getattr(args, name)
        if value is not None:
            setattr(opts, name, value)
    if args.batch:
        opts.batches = tuple(args.batch)
    if args.mode:
        opts.modes = tuple(m for m in demo.MODES if m in args.mode)
    if args.kv_cache is not None:
        opts.kv_cache = args.kv_cache
    opts.compare_caches = args.compare_caches
    if args.model_family is not None:
        opts.model_family = args.model_family
    opts.progress = not args.no_progress
    try:
        opts.model_overrides = {**opts.model_overrides, **dict(demo.parse_override(o) for o in args.model or ())}
        rows = demo.run_demo(opts)
    except demo.DemoError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    finally:
        if opts.tp > 1:  # the process group --tp started (the command owns its process)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return demo.exit_code(rows)


def cmd_soak(args: argparse.Namespace) -> int:
    from graphsafe import demo
    from graphsafe.demo import soak

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    opts = soak.default_soak_options(device)
    for name in ("steps", "max_batch", "max_prompt", "checks", "seed", "backend", "threads"):
        value = getattr(args, name)
        if value is not None:
            setattr(opts, name, value)
    if args.decode:
        opts.min_decode, opts.max_decode = args.decode
    opts.compile = args.compile
    opts.progress = not args.no_progress
    try:
        opts.model_overrides = dict(demo.parse_override(o) for o in args.model or ())
        result = soak.run_soak(opts)
    except demo.DemoError as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2
    if args.json:
        soak.write_json(result, args.json)
    return 0 if result.ok else 1


def _version_line() -> str:
    import graphsafe

    return f"graphsafe {graphsafe.__version__} (torch {torch.__version__})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphsafe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every op with its schema and the backend serving it here")
    ls.add_argument("--why", action="store_true",
                    help="per device, why each backend can or cannot run, and what serves the op's example shapes")
    check = sub.add_parser("check", help="run the op contract on every op and device here")
    check.add_argument("--op", action="append", help="only this op (repeatable)")
    check.add_argument("--device", action="append", choices=["cpu", "cuda"], help="only this device type (repeatable)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--full", action="store_true", help="every check on each op's example and every edge case "
                       "(default: the example alone; on CUDA the GPU checks also run the realistic shapes)")
    bench = sub.add_parser("bench", help="benchmarks: medians, bytes, %% of bandwidth, peers")
    bench.add_argument("--op", action="append", help="only this benchmark case (repeatable)")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    bench.add_argument("--json", help="also write the rows and the run's metadata as JSON to this path "
                       "(rewritten after every row, so a cut-off run keeps what it measured)")
    bench.add_argument("--full", action="store_true", help="the full sweep of shapes on a GPU (default: the "
                       "representative shapes of each case; on a CPU: each case's CPU shapes)")
    bench.add_argument("--time-limit", type=float, metavar="SECONDS", help="start no new row once SECONDS have "
                       "passed since the run began; the rows measured are kept")
    bench.add_argument("--no-reference", action="store_true", help="leave out the PyTorch reference rows (eager and "
                       "compiled): graphsafe and its peers only, for sweeps the reference would take most of")
    bench.add_argument("--only", action="append", metavar="TEXT", help="time only the problems whose 'case | shape' "
                       "label (as printed) contains TEXT (repeatable: any of them), e.g. --only D=64/64")
    bench.add_argument("--list", action="store_true", help="list the benchmark cases and their shape counts")
    dm = sub.add_parser("demo", help="decode with the demo model: eager, compiled, compiled + CUDA graphs; one table")
    dm.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present, else cpu")
    dm.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 4 on the CPU, 1 8 64 on a GPU)")
    dm.add_argument("--steps", type=int, help="greedy decode steps per run (default: 16 on the CPU, 64 on a GPU)")
    dm.add_argument("--prompt-len", type=int, help="prompt tokens per request (default: 16 on the CPU, 4032 on a GPU)")
    dm.add_argument("--backend", help="torch.compile backend (default: inductor; aot_eager compiles fastest)")
    dm.add_argument("--warmup", type=int, help="leading steps left out of the latency median (default: 2, 4 on a GPU)")
    dm.add_argument("--seed", type=int, help="seed of the weights and the prompts (default: 0)")
    dm.add_argument("--mode", action="append", choices=["eager", "compiled", "compiled+graphs"],
                    help="only this mode (repeatable; eager is the reference the tokens are compared with)")
    dm.add_argument("--model", action="append", metavar="KEY=VALUE",
                    help="override a field of the demo model's config, e.g. num_hidden_layers=60 (repeatable)")
    dm.add_argument("--threads", type=int, help="CPU threads during the run (default: 1, the tiny model's matrices "
                    "gain nothing from more; 0: torch's default)")
    dm.add_argument("--kv-cache", choices=["auto", "fp8_ds_mla"],
                    help="the latent MLA cache: auto (the model dtype, default) or fp8_ds_mla (DeepSeek's FP8 "
                    "record: e4m3 latent, a float32 scale per 128 values, bf16 rope; the demo model then has "
                    "kv_lora_rank 128)")
    dm.add_argument("--compare-caches", action="store_true",
                    help="run the modes with both caches on the same prompts (fp8_ds_mla fed the bf16 cache's "
                    "picks) and print a comparison: bytes per token, cache size, step ms, greedy agreement")
    dm.add_argument("--model-family", choices=["deepseek_v32", "deepseek_v4"],
                    help="the demo model: DeepSeek-V3.2-style (MLA + DSA indexer, default) or DeepSeek-V4-style "
                    "(sliding window + compressed caches, sinks, fp8_dsv4 records; graphsafe.models.dsv4)")
    dm.add_argument("--plot", metavar="PATH", help="draw step latency per mode and batch size (needs matplotlib)")
    dm.add_argument("--no-progress", action="store_true", help="no progress bar")
    dm.add_argument("--tp", type=int, help="tensor-parallel ranks, one process each: run under torchrun, e.g. "
                    "torchrun --nproc-per-node 2 -m graphsafe demo --tp 2 (NCCL on GPUs, gloo on CPUs)")
    sk = sub.add_parser("soak", help="many graph replays of the demo model with changing batches and lengths, "
                        "prefill overlapping on a second stream: memory, allocations, outputs")
    sk.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present, else cpu")
    sk.add_argument("--steps", type=int, help="decode steps in all (default: 10000 on a GPU, 48 on the CPU)")
    sk.add_argument("--max-batch", type=int, help="the largest batch (default: 64 on a GPU, 4 on the CPU)")
    sk.add_argument("--max-prompt", type=int, help="the longest prompt (default: 256 on a GPU, 24 on the CPU)")
    sk.add_argument("--decode", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="decode steps of an episode (default: 16 128 on a GPU, 4 8 on the CPU)")
    sk.add_argument("--checks", type=int, help="episodes rerun eagerly and compared (default: 5 on a GPU, 3)")
    sk.add_argument("--seed", type=int, help="seed of the weights, prompts and episode plan (default: 0)")
    sk.add_argument("--compile", action="store_true", help="capture torch.compile(fullgraph=True, dynamic=True) of "
                    "the step (default: the eager step)")
    sk.add_argument("--backend", help="torch.compile backend with --compile (default: inductor)")
    sk.add_argument("--model", action="append", metavar="KEY=VALUE", help="a field of the demo model's config")
    sk.add_argument("--threads", type=int, help="CPU threads during the run (default: 1)")
    sk.add_argument("--json", help="also write the figures as JSON to this path")
    sk.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "check" and not torch.cuda.is_available():
        # Kernel backends are checked through Triton's interpreter on CPU-only machines.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return {"list": cmd_list, "check": cmd_check, "bench": cmd_bench, "demo": cmd_demo,
            "soak": cmd_soak}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
