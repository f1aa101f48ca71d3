"""Benchmark harness: medians from CUDA events after warm-up, bytes moved, % of the copy
bandwidth (or of the matmul peak) measured in the same run, the same for every peer on
the same inputs, a printed table and JSON.

A benchmark case is a function registered with `@bench_case("name")` in a module of
`graphsafe.bench.cases`; it yields `Problem`s. Each problem lists its implementations
(graphsafe and its peers) as zero-argument callables over inputs built once.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Problem:
    """One benchmarked shape: its impls, and the work any impl must do at least."""

    case: str  # e.g. "reshape_and_cache"
    shape: str  # human label, e.g. "T=4096 Hk=8 D=128 bf16"
    impls: dict[str, Callable[[], Any]]  # label -> zero-arg callable
    bytes: int = 0  # fewest bytes any impl must move (each input read once, outputs written once)
    flops: int = 0  # useful floating-point operations
    bound: str = "memory"  # "memory" or "compute": which ceiling the % column uses
    peak_dtype: torch.dtype = torch.bfloat16  # matmul peak used when bound == "compute"
    note: str = ""
    # Per-call time unit: most cases time in ms; overhead cases read better in us.
    unit: str = "ms"
    # Also time replays of a CUDA graph of the calls: the device time without the host's
    # launch cost (what a captured decode step sees). Bandwidth % uses it when it exists.
    graph: bool = True
    # Times (in `unit`) measured by the case itself (e.g. the demo's step timing), reported
    # as rows after the timed impls.
    measured: dict[str, float] = field(default_factory=dict)


@dataclass
class Row:
    case: str
    shape: str
    impl: str
    median_ms: float  # device time per call: graph replay when capturable, else eager
    eager_ms: float | None  # per call launched eagerly from Python (host launch cost included)
    bytes: int
    flops: int
    gbps: float | None
    pct_bandwidth: float | None
    tflops: float | None
    pct_peak: float | None
    speedup_vs_first: float | None
    unit: str = "ms"
    error: str | None = None
    # Graph replay with L2 flushed before each call (memory-bound problems small enough to
    # stay in L2 between back-to-back replays; None otherwise): `time_graph_cold_ms`.
    cold_ms: float | None = None
    pct_bandwidth_cold: float | None = None


@dataclass
class Ceilings:
    device: str
    copy_bytes_per_s: float | None
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict)


CASES: dict[str, Callable[[torch.device], Iterator[Problem]]] = {}


def bench_case(name: str) -> Callable:
    def register(fn: Callable[[torch.device], Iterator[Problem]]):
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} registered twice")
        CASES[name] = fn
        return fn

    return register


def load_cases() -> dict[str, Callable[[torch.device], Iterator[Problem]]]:
    import importlib
    import pkgutil

    import graphsafe.bench.cases as pkg

    for m in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        importlib.import_module(f"{pkg.__name__}.{m}")
    return CASES


# -- timing -------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 10, reps: int = 50, min_ms: float = 200.0) -> float:
    """Median milliseconds of one call.

    On CUDA each call is bracketed by its own pair of CUDA events (after `warmup` calls);
    the number of reps grows until they cover `min_ms`. On the CPU: perf_counter.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # Estimate the per-call time to pick the number of reps.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-4)
        n = int(min(max(reps, min_ms / est), 10_000))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in events:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events)
    times = []
    deadline = time.perf_counter() + min_ms / 1e3
    while len(times) < reps or (time.perf_counter() < deadline and len(times) < 100_000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], Any], device: torch.device, reps: int = 30) -> float:
    """Median milliseconds of one call, from replays of a CUDA graph holding k calls.

    Removes the host's launch cost (Python, dispatch, Triton launcher) from the number:
    the device time a captured decode step pays. Raises if `fn` cannot be captured.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    k = int(min(max(math.ceil(1.0 / max(start.elapsed_time(end), 1e-3)), 2), 50))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize(device)
    del graph
    torch.cuda.synchronize(device)
    # The graph is destroyed: later problems may grow the arenas it pinned again.
    from graphsafe.workspace import all_workspace_managers

    for manager in all_workspace_managers():
        manager.forget_captures()
    return statistics.median(s.elapsed_time(e) for s, e in events) / k


def time_loop_us(fn: Callable[[], Any], device: torch.device, inner: int = 1000, reps: int = 21) -> float:
    """Median microseconds per call of `fn` called `inner` times in a Python loop.

    For host-side costs (dispatch overhead, workspace hits): the host time of the loop,
    with the device synchronised before and after, so queued kernels are not counted
    as host work. The median over `reps` loops.
    """
    for _ in range(inner // 10 + 1):
        fn()
    results = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results.append((t1 - t0) * 1e6 / inner)
    return statistics.median(results)


def l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def time_graph_cold_ms(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of one call whose inputs start in HBM, not L2: graph replays of
    (write a buffer twice the L2 size, call) minus replays of the write alone, the
    median over `reps` pairs. Back-to-back replays of the call alone keep inputs smaller
    than L2 resident (`time_graph_ms`); a decode step usually reads what the previous op
    just wrote, so that number is not wrong, but it is not an HBM rate either. The write
    leaves dirty lines that the call's reads may evict: this errs on the slow side."""
    flush = torch.empty(max(2 * l2_bytes(device), 1 << 20), dtype=torch.uint8, device=device)
    both = lambda: (flush.fill_(1), fn())  # noqa: E731
    alone = lambda: flush.fill_(1)  # noqa: E731
    diffs = [time_graph_ms(both, device) - time_graph_ms(alone, device) for _ in range(reps)]
    del flush
    return statistics.median(diffs)


# -- ceilings -----------------------------------------------------------------------------
def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=5, reps=20)
    del src, dst
    return 2 * nbytes / (ms / 1e3)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float | None:
    """Dense matmul rate in FLOP/s on random data (torch's library kernel)."""
    if device.type != "cuda":
        return None
    if dtype == torch.float8_e4m3fn:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype).t()
        one = torch.ones((), device=device)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        fn = lambda: a @ b  # noqa: E731
    ms = time_ms(fn, device, warmup=5, reps=20)
    return 2 * n**3 / (ms / 1e3)


def measure_ceilings(device: torch.device, matmul_dtypes: tuple[torch.dtype, ...] = ()) -> Ceilings:
    peaks = {}
    for dtype in matmul_dtypes:
        try:
            value = measure_matmul_peak(device, dtype)
        except Exception as err:  # noqa: BLE001 - a missing fp8 path is reported, not fatal
            print(f"[bench] matmul peak for {dtype} unavailable: {err}")
            value = None
        if value is not None:
            peaks[str(dtype).removeprefix("torch.")] = value
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(device=name, copy_bytes_per_s=measure_copy_bandwidth(device), matmul_flops_per_s=peaks)


# -- running and reporting ----------------------------------------------------------------
def _interleaved_host_us(problem: Problem, device: torch.device, rounds: int = 7) -> dict[str, float | Exception]:
    """Host us per call of each impl, measured round-robin (impl A, B, C, A, B, C, ...)
    so that clock ramps and background load hit every impl alike; median over rounds."""
    samples: dict[str, list[float]] = {label: [] for label in problem.impls}
    failed: dict[str, Exception] = {}
    for _ in range(rounds):
        for label, fn in problem.impls.items():
            if label in failed:
                continue
            try:
                samples[label].append(time_loop_us(fn, device, reps=5))
            except Exception as err:  # noqa: BLE001 - reported in the impl's row
                failed[label] = err
    return {label: failed.get(label) or statistics.median(samples[label]) for label in problem.impls}


def run_problem(problem: Problem, device: torch.device, ceilings: Ceilings) -> list[Row]:
    rows: list[Row] = []
    first_ms = None
    host_us = _interleaved_host_us(problem, device) if problem.unit == "us" else {}
    scale = 1e-3 if problem.unit == "us" else 1.0
    entries = [*problem.impls.items(), *((label, value * scale) for label, value in problem.measured.items())]
    for label, fn in entries:
        eager_ms = cold_ms = None
        try:
            if not callable(fn):
                ms = fn
            elif problem.unit == "us":
                value = host_us[label]
                if isinstance(value, Exception):
                    raise value
                ms = value / 1e3
            else:
                ms = eager_ms = time_ms(fn, device)
                if device.type == "cuda" and problem.graph:
                    try:
                        ms = time_graph_ms(fn, device)
                        if problem.bound == "memory" and 0 < problem.bytes <= 2 * l2_bytes(device):
                            cold_ms = time_graph_cold_ms(fn, device)
                    except Exception as err:  # noqa: BLE001 - not capturable: keep the eager time
                        label = f"{label} (no graph)"
                        print(f"[bench] {problem.case} {label}: graph capture failed: {str(err).splitlines()[0][:120]}")
                        torch.cuda.synchronize(device)
            error = None
        except Exception as err:  # noqa: BLE001 - a failing peer is reported in its row
            ms, error = math.nan, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        seconds = ms / 1e3
        gbps = problem.bytes / seconds / 1e9 if problem.bytes and seconds > 0 else None
        pct_bw = pct_bw_cold = None
        if gbps is not None and ceilings.copy_bytes_per_s:
            pct_bw = 100 * gbps * 1e9 / ceilings.copy_bytes_per_s
            if cold_ms and cold_ms > 0:
                pct_bw_cold = 100 * problem.bytes / (cold_ms / 1e3) / ceilings.copy_bytes_per_s
        tflops = problem.flops / seconds / 1e12 if problem.flops and seconds > 0 else None
        pct_peak = None
        peak = ceilings.matmul_flops_per_s.get(str(problem.peak_dtype).removeprefix("torch."))
        if tflops is not None and peak:
            pct_peak = 100 * tflops * 1e12 / peak
        if first_ms is None and error is None:
            first_ms = ms
        rows.append(
            Row(
                case=problem.case,
                shape=problem.shape,
                impl=label,
                median_ms=ms,
                eager_ms=eager_ms,
                cold_ms=cold_ms,
                pct_bandwidth_cold=pct_bw_cold,
                bytes=problem.bytes,
                flops=problem.flops,
                gbps=gbps,
                pct_bandwidth=pct_bw,
                tflops=tflops,
                pct_peak=pct_peak,
                speedup_vs_first=(ms / first_ms) if first_ms and error is None else None,
                unit=problem.unit,
                error=error,
            )
        )
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(rows: list[Row], ceilings: Ceilings) -> str:
    lines = []
    bw = ceilings.copy_bytes_per_s
    peaks = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in ceilings.matmul_flops_per_s.items())
    lines.append(
        "time: device ms per call from CUDA-graph replays (host launch cost excluded) where the impl "
        "captures, else eager; eager: ms per call launched from Python; %bw: of the copy bandwidth below; "
        "cold, %cold: the same with L2 flushed before each call (memory-bound inputs up to twice the L2 size, "
        "which back-to-back replays keep in L2)"
    )
    lines.append(
        f"device: {ceilings.device}; measured copy bandwidth: {_fmt(bw and bw / 1e12, '.2f')} TB/s"
        + (f"; matmul peak: {peaks}" if peaks else "")
    )
    header = (f"{'case':<28} {'shape':<40} {'impl':<24} {'time':>11} {'eager':>9} {'MB':>9} {'GB/s':>8} {'%bw':>6} "
              f"{'cold':>9} {'%cold':>6} {'TFLOP/s':>8} {'%peak':>6} {'x first':>8}")
    lines.append(header)
    lines.append("-" * len(header))
    for r in rows:
        t = "ERROR" if r.error else (f"{r.median_ms * 1e3:.2f} us" if r.unit == "us" else f"{r.median_ms:.4f} ms")
        eager = _fmt(r.eager_ms, ".4f") if r.eager_ms is not None and r.eager_ms != r.median_ms else "-"
        lines.append(
            f"{r.case:<28.28} {r.shape:<40.40} {r.impl:<24.24} {t:>11} {eager:>9} {_fmt(r.bytes / 1e6 if r.bytes else None, '.1f'):>9} "
            f"{_fmt(r.gbps, '.0f'):>8} {_fmt(r.pct_bandwidth, '.1f'):>6} {_fmt(r.cold_ms, '.4f'):>9} "
            f"{_fmt(r.pct_bandwidth_cold, '.1f'):>6} {_fmt(r.tflops, '.1f'):>8} "
            f"{_fmt(r.pct_peak, '.1f'):>6} {_fmt(r.speedup_vs_first, '.2f'):>8}"
        )
        if r.error:
            lines.append(f"{'':<28} error: {r.error}")
    return "\n".join(lines)


def run(
    names: list[str] | None,
    device: torch.device,
    json_path: str | None = None,
    matmul_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float8_e4m3fn),
    echo: Callable[[str], None] = print,
) -> list[Row]:
    cases = load_cases()
    selected = names or sorted(cases)
    unknown = [n for n in selected if n not in cases]
    if unknown:
        raise SystemExit(f"unknown benchmark case(s) {unknown}; known: {sorted(cases)}")
    ceilings = measure_ceilings(device, matmul_dtypes if device.type == "cuda" else ())
    rows: list[Row] = []
    for name in selected:
        for problem in cases[name](device):
            new = run_problem(problem, device, ceilings)
            rows.extend(new)
            echo(format_table(new, ceilings).split("\n", 4)[-1])
            if problem.note:
                echo(f"{'':<28} note: {problem.note}")
            del problem
            if device.type == "cuda":
                torch.cuda.empty_cache()
    table = format_table(rows, ceilings)
    echo("\n" + table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}, f, indent=1)
    return rows
