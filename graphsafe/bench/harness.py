"""Benchmark harness: medians from CUDA events after warm-up, bytes moved, % of the copy
bandwidth (or of the matmul peak) measured in the same run, the same for every peer on
the same inputs; rows printed as they are measured and, optionally, a JSON file rewritten
after every row.

A benchmark case is a function registered with `@bench_case("name", Shapes(...))` in an op
family's `graphsafe/ops/<family>/bench.py` (or, for cases across families, a module of
`graphsafe.bench.cases`); it is called with the device and the shapes to run
(picked by `Shapes.pick`) and yields `Problem`s. Each problem lists its implementations
(graphsafe and its peers) as zero-argument callables over inputs built once.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from graphsafe.bench import peers


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
    median_ms: float  # device time per call: graph replay when capturable, else eager; NaN on error (JSON null)
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


# -- cases and their shapes ---------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """The shapes (any values the case function understands) a benchmark case runs.

    `default`: the representative shapes, run by `bench` on a GPU; `full`: the whole sweep,
    run with `--full` (it contains every default shape); `cpu`: shapes sized for a CPU run
    (small enough that every case's CPU shapes together take well under 2 GB and ~2
    minutes), or None for a case that only makes sense on a GPU (skipped on a CPU with
    "needs a GPU: skipped").
    """

    default: tuple
    full: tuple
    cpu: tuple | None

    def __post_init__(self) -> None:
        missing = [s for s in self.default if s not in self.full]
        if missing:
            raise ValueError(f"default shapes {missing} are not in the full sweep")

    def pick(self, device_type: str, full: bool, named: bool) -> tuple | None:
        """The shapes to run: on a CPU `cpu` (None: skip the case); on a GPU `full` with
        `--full`, else `default`, except that a case with no default shapes (tuning sweeps,
        the demo step) runs its `full` shapes when named with `--op`."""
        if device_type == "cpu":
            return self.cpu
        if full or (named and not self.default):
            return self.full
        return self.default


@dataclass(frozen=True)
class BenchCase:
    name: str
    fn: Callable[[torch.device, tuple], Iterator[Problem]]
    shapes: Shapes


CASES: dict[str, BenchCase] = {}


def bench_case(name: str, shapes: Shapes) -> Callable:
    """Register `fn(device, shapes) -> Iterator[Problem]` as benchmark case `name`."""

    def register(fn: Callable[[torch.device, tuple], Iterator[Problem]]):
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} registered twice")
        CASES[name] = BenchCase(name, fn, shapes)
        return fn

    return register


def load_cases() -> dict[str, BenchCase]:
    """Every bench case: each op family's (`graphsafe/ops/<family>/bench.py`) and the
    cross-cutting ones of `graphsafe.bench.cases` (dispatch overhead, host cost)."""
    import importlib
    import importlib.util
    import pkgutil

    import graphsafe.bench.cases as pkg
    from graphsafe.ops import families

    for family in families():
        if importlib.util.find_spec(f"graphsafe.ops.{family}.bench") is not None:
            importlib.import_module(f"graphsafe.ops.{family}.bench")
    for m in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        importlib.import_module(f"{pkg.__name__}.{m}")
    return CASES


# -- timing -------------------------------------------------------------------------------
# A slow call (a reference peer at a large shape: 0.1-1 s) needs neither 10 warm-up calls
# nor 50 timed ones for a stable median; the full sweep spent most of its time there.
# Warm-up and timed calls stop growing past this many ms (at least 2 warm-up, 5 timed).
SLOW_CALL_BUDGET_MS = 3000.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(fn: Callable[[], Any], device: torch.device, warmup: int, budget_ms: float) -> None:
    """`warmup` calls, or fewer (at least 2) once they have taken `budget_ms` together."""
    t0 = time.perf_counter()
    for i in range(warmup):
        fn()
        if i >= 1:
            _sync(device)
            if (time.perf_counter() - t0) * 1e3 > budget_ms:
                break


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 10, reps: int = 50, min_ms: float = 200.0,
            budget_ms: float = SLOW_CALL_BUDGET_MS) -> float:
    """Median milliseconds of one call.

    On CUDA each call is bracketed by its own pair of CUDA events (after `warmup` calls,
    fewer, at least 2, once they took `budget_ms`); the number of reps grows from `reps`
    until they cover `min_ms` (at most 10000), and shrinks (to at least 5) where `reps`
    calls would take more than `budget_ms`. On the CPU: perf_counter around each call,
    after min(warmup, 2) warm-up calls; at least 3 calls and until `min_ms` have passed.
    """
    if device.type != "cuda":
        return _time_cpu_ms(fn, min(warmup, 2), min_ms)
    _warm_up(fn, device, warmup, budget_ms)
    torch.cuda.synchronize(device)
    # Estimate the per-call time to pick the number of reps.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-4)
    n = int(min(max(reps, min_ms / est), 10_000, max(5, budget_ms / est)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _time_cpu_ms(fn: Callable[[], Any], warmup: int, min_ms: float) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + min_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100_000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], Any], device: torch.device, reps: int = 30,
                  budget_ms: float = SLOW_CALL_BUDGET_MS) -> float:
    """Median milliseconds of one call, from replays of a CUDA graph holding k calls.

    Removes the host's launch cost (Python, dispatch, Triton launcher) from the number:
    the device time a captured decode step pays. `reps` replays, fewer (at least 5) where
    they would take more than `budget_ms`. Raises if `fn` cannot be captured.
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
    est = max(start.elapsed_time(end), 1e-3)
    k = int(min(max(math.ceil(1.0 / est), 2), 50))
    reps = int(min(reps, max(5, budget_ms / (k * est))))
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
# The CPU's copy is measured on 64 MiB: past its caches, and cheap in time and memory.
CPU_COPY_BYTES = 1 << 26


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Copy rate on `device` in bytes/s (device-to-device on a GPU, memory-to-memory on a
    CPU, there over at most `CPU_COPY_BYTES`), counting bytes read plus bytes written."""
    if device.type == "cpu":
        nbytes = min(nbytes, CPU_COPY_BYTES)
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
            print(f"[bench] matmul peak for {dtype} unavailable: {err}", flush=True)
            value = None
        if value is not None:
            peaks[str(dtype).removeprefix("torch.")] = value
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(device=name, copy_bytes_per_s=measure_copy_bandwidth(device), matmul_flops_per_s=peaks)


# -- measuring ----------------------------------------------------------------------------
# The clock of `--time-limit` (a module attribute so that tests can drive it).
clock = time.monotonic


class Deadline:
    """`expired()` once `seconds` have passed since construction (never with None);
    `hit` records that it was found expired."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = clock()
        self.hit = False

    def elapsed(self) -> float:
        return clock() - self.start

    def expired(self) -> bool:
        if self.seconds is not None and self.elapsed() >= self.seconds:
            self.hit = True
        return self.hit


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


def measure_impl(problem: Problem, label: str, fn: Callable[[], Any] | float, device: torch.device,
             host_us: dict[str, float | Exception]) -> tuple[str, float, float | None, float | None, str | None]:
    """(label, ms, eager_ms, cold_ms, error) of one impl; ms is NaN when it failed."""
    cold_ms = None
    try:
        if not callable(fn):
            return label, fn, None, None, None
        if problem.unit == "us":
            value = host_us[label]
            if isinstance(value, Exception):
                raise value
            return label, value / 1e3, None, None, None
        ms = eager_ms = time_ms(fn, device)
        if device.type == "cuda" and problem.graph:
            try:
                ms = time_graph_ms(fn, device)
                if problem.bound == "memory" and 0 < problem.bytes <= 2 * l2_bytes(device):
                    cold_ms = time_graph_cold_ms(fn, device)
            except Exception as err:  # noqa: BLE001 - not capturable: keep the eager time
                label = f"{label} (no graph)"
                print(f"[bench] {problem.case} {label}: graph capture failed: {str(err).splitlines()[0][:120]}", flush=True)
                torch.cuda.synchronize(device)
        return label, ms, eager_ms, cold_ms, None
    except Exception as err:  # noqa: BLE001 - a failing peer is reported in its row
        first_line = str(err).splitlines()[0][:160] if str(err) else ""
        return label, math.nan, None, None, f"{type(err).__name__}: {first_line}"


def _row(problem: Problem, label: str, ms: float, eager_ms: float | None, cold_ms: float | None, error: str | None,
         ceilings: Ceilings, first_ms: float | None) -> Row:
    """The row of one measured impl: rates from the problem's bytes and flops over `ms`."""
    seconds = ms / 1e3
    ok = error is None and seconds > 0
    gbps = problem.bytes / seconds / 1e9 if problem.bytes and ok else None
    pct_bw = pct_bw_cold = None
    if gbps is not None and ceilings.copy_bytes_per_s:
        pct_bw = 100 * gbps * 1e9 / ceilings.copy_bytes_per_s
        if cold_ms and cold_ms > 0:
            pct_bw_cold = 100 * problem.bytes / (cold_ms / 1e3) / ceilings.copy_bytes_per_s
    tflops = problem.flops / seconds / 1e12 if problem.flops and ok else None
    peak = ceilings.matmul_flops_per_s.get(str(problem.peak_dtype).removeprefix("torch."))
    pct_peak = 100 * tflops * 1e12 / peak if tflops is not None and peak else None
    return Row(
        case=problem.case, shape=problem.shape, impl=label, median_ms=ms, eager_ms=eager_ms, cold_ms=cold_ms,
        pct_bandwidth_cold=pct_bw_cold, bytes=problem.bytes, flops=problem.flops, gbps=gbps, pct_bandwidth=pct_bw,
        tflops=tflops, pct_peak=pct_peak, speedup_vs_first=(ms / first_ms) if first_ms and error is None else None,
        unit=problem.unit, error=error,
    )


def measure_rows(problem: Problem, device: torch.device, ceilings: Ceilings,
                 deadline: Deadline | None = None) -> Iterator[Row]:
    """The problem's rows, each yielded as soon as it is measured: its impls in order,
    then its `measured` entries. Stops before measuring an impl once `deadline` has
    expired (host-time problems measure all their impls together, before the first row)."""
    first_ms = None
    host_us: dict[str, float | Exception] = {}
    if problem.unit == "us" and problem.impls:
        if deadline is not None and deadline.expired():
            return
        host_us = _interleaved_host_us(problem, device)
    scale = 1e-3 if problem.unit == "us" else 1.0
    entries = [*problem.impls.items(), *((label, value * scale) for label, value in problem.measured.items())]
    for label, fn in entries:
        if callable(fn) and problem.unit != "us" and deadline is not None and deadline.expired():
            return
        label, ms, eager_ms, cold_ms, error = measure_impl(problem, label, fn, device, host_us)
        if first_ms is None and error is None:
            first_ms = ms
        yield _row(problem, label, ms, eager_ms, cold_ms, error, ceilings, first_ms)


def run_problem(problem: Problem, device: torch.device, ceilings: Ceilings) -> list[Row]:
    """Every row of `problem` (no deadline)."""
    return list(measure_rows(problem, device, ceilings))


# -- formatting ---------------------------------------------------------------------------
IMPL_WIDTH = 34  # impl labels longer than this go on a line of their own, the numbers below
# (name, width): each cell is printed right-aligned after one space, so cells never touch.
COLUMNS = (("time", 12), ("eager", 9), ("MB", 8), ("GB/s", 9), ("%bw", 6), ("cold", 9), ("%cold", 6),
           ("TFLOP/s", 9), ("%peak", 6), ("x first", 7))


def _missing(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def format_number(x: float | None, digits: int = 3) -> str:
    """`digits` significant digits (all integer digits from 10**(digits-1) up); never
    rounds a non-zero value to 0; "-" for None / NaN."""
    if _missing(x):
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    return "-" if _missing(x) else (f"{x:.1f}" if abs(x) >= 1 else format_number(x, 2))


def _time(ms: float | None, unit: str) -> str:
    if _missing(ms):
        return "-"
    return f"{format_number(ms * 1e3, 4)} us" if unit == "us" else f"{format_number(ms, 4)} ms"


def legend(ceilings: Ceilings, device: torch.device, sweep: str) -> list[str]:
    """The lines printed once before the header: what the columns mean, the ceilings."""
    bw = ceilings.copy_bytes_per_s
    peaks = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in ceilings.matmul_flops_per_s.items())
    lines = [
        "time: device ms per call from CUDA-graph replays (host launch cost excluded) where the impl "
        "captures, else eager; eager: ms per call launched from Python; %bw: of the copy bandwidth below; "
        "cold, %cold: the same with L2 flushed before each call (memory-bound inputs up to twice the L2 size, "
        "which back-to-back replays keep in L2)",
        f"device: {ceilings.device}; measured copy bandwidth: {format_number(bw and bw / 1e9)} GB/s"
        + (f"; matmul peak: {peaks}" if peaks else "") + f"; shapes: {sweep}",
    ]
    if device.type == "cpu":
        lines.append("cpu: small shapes, perf_counter times; peers that need torch.compile are left out (their "
                     "compile takes longer than the whole CPU run); the numbers say nothing about a GPU")
    return lines


def header() -> str:
    return "  " + f"{'impl':<{IMPL_WIDTH}}" + "".join(f" {name:>{width}}" for name, width in COLUMNS)


def problem_title(problem: Problem) -> str:
    return f"{problem.case} | {problem.shape}"


def format_row(r: Row) -> str:
    """One row (two lines when its impl label is longer than IMPL_WIDTH), and its error."""
    eager = format_number(r.eager_ms, 4) if r.eager_ms is not None and r.eager_ms != r.median_ms else "-"
    num = format_number
    cells = ("ERROR" if r.error else _time(r.median_ms, r.unit), eager, num(r.bytes / 1e6 if r.bytes else None),
             num(r.gbps), _pct(r.pct_bandwidth), num(r.cold_ms, 4), _pct(r.pct_bandwidth_cold), num(r.tflops),
             _pct(r.pct_peak), num(r.speedup_vs_first))
    numbers = "".join(f" {cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS))
    if len(r.impl) > IMPL_WIDTH:
        lines = [f"  {r.impl}", "  " + " " * IMPL_WIDTH + numbers]
    else:
        lines = [f"  {r.impl:<{IMPL_WIDTH}}{numbers}"]
    if r.error:
        lines.append(f"  {'':<{IMPL_WIDTH}}error: {r.error}")
    return "\n".join(lines)


# -- the JSON file ------------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """NaN / inf as None: the file stays strict JSON (json.dump would write NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_json_atomic(path: str, document: dict) -> None:
    """Write `document` to a temporary file next to `path` and rename it over `path`: a
    reader (or a run killed at any moment) sees the previous complete file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".bench-", suffix=".json.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _versions() -> dict[str, str | None]:
    import graphsafe

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - no (working) triton: recorded as None
        triton_version = None
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    return {"graphsafe": graphsafe.__version__, "torch": torch.__version__, "triton": triton_version,
            "cuda": cuda, "python": platform.python_version()}


class RunLog:
    """Rows and metadata of one run; with a path, the JSON file is rewritten (atomically)
    at the start, after every row and at the end."""

    def __init__(self, path: str | None, meta: dict, ceilings: Ceilings) -> None:
        self.path, self.meta, self.ceilings = path, meta, ceilings
        self.rows: list[Row] = []
        self.write()

    def document(self) -> dict:
        return {"meta": self.meta, "ceilings": {k: _finite(v) for k, v in asdict(self.ceilings).items()},
                "rows": [{k: _finite(v) for k, v in asdict(r).items()} for r in self.rows]}

    def write(self) -> None:
        if self.path:
            write_json_atomic(self.path, self.document())

    def add(self, row: Row, elapsed_s: float) -> None:
        self.rows.append(row)
        self.meta["elapsed_s"] = round(elapsed_s, 3)
        self.write()

    def skip(self, case: str, reason: str) -> None:
        self.meta["skipped"][case] = reason
        self.write()

    def finish(self, elapsed_s: float, stopped: str | None) -> None:
        self.meta.update(elapsed_s=round(elapsed_s, 3), complete=stopped is None, stopped=stopped)
        self.write()


# -- running ------------------------------------------------------------------------------
def _echo(line: str) -> None:
    print(line, flush=True)


REFERENCE_PREFIX = "reference"  # the PyTorch reference's rows: "reference eager", "reference compiled"


def _without_reference(problem: Problem) -> Problem:
    """`problem` without its PyTorch reference rows (never called, so never compiled)."""
    impls = {label: fn for label, fn in problem.impls.items() if not label.startswith(REFERENCE_PREFIX)}
    if len(impls) == len(problem.impls):
        return problem
    return replace(problem, impls=impls)


def _run_case(case: BenchCase, shapes: tuple, device: torch.device, ceilings: Ceilings, log: RunLog,
              deadline: Deadline, echo: Callable[[str], None], reference: bool = True,
              only: Sequence[str] | None = None) -> None:
    """Print and log each row of the case as it is measured; return early (with
    `deadline.hit` set) once the deadline has expired. Without `reference`, the PyTorch
    reference's rows are left out. With `only`, a problem whose "case | shape" label
    contains none of its texts is passed over (built by the case, never timed)."""
    problems = case.fn(device, shapes)
    try:
        for problem in problems:
            if deadline.expired():
                return
            if only and not any(text in f"{problem.case} | {problem.shape}" for text in only):
                continue
            if not reference:
                problem = _without_reference(problem)
            echo(problem_title(problem))
            rows = []
            for row in measure_rows(problem, device, ceilings, deadline):
                log.add(row, deadline.elapsed())
                echo(format_row(row))
                rows.append(row)
            note = "; ".join(x for x in (problem.note, peers.ratio_note(rows)) if x)
            if note:
                echo(f"  note: {note}")
            if deadline.hit:
                return
            del problem
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        problems.close()


def run(
    names: Sequence[str] | None,
    device: torch.device,
    json_path: str | None = None,
    full: bool = False,
    time_limit: float | None = None,
    matmul_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float8_e4m3fn),
    echo: Callable[[str], None] = _echo,
    reference: bool = True,
    only: Sequence[str] | None = None,
) -> list[Row]:
    """Run the cases `names` (all when None) and return their rows.

    Prints the legend and the column header once, then each problem's title line and
    each row as soon as it is measured. Shapes per case: `Shapes.pick` (CPU shapes on a
    CPU; cases without them print "<case>: needs a GPU: skipped"). With `time_limit`, no
    row starts once that many seconds have passed since the run began (the ceilings'
    measurement included): the run says so and keeps the rows measured. With `json_path`,
    the file is a complete JSON document from the start and after every row: {"meta":
    device, versions, sweep, cases, time limit, elapsed_s, skipped cases, complete,
    stopped; "ceilings": the copy bandwidth and matmul peaks; "rows": every row so far}
    (NaN written as null). Without `reference`, no problem times the PyTorch reference
    ("reference eager" / "compiled": in a GPU sweep most of the time goes to them), and the
    meta says so ("reference": false). With `only` (texts), only the problems whose "case |
    shape" label contains one of them are timed (meta "only").
    """
    cases = load_cases()
    selected = list(names or sorted(cases))
    unknown = [n for n in selected if n not in cases]
    if unknown:
        raise SystemExit(f"unknown benchmark case(s) {unknown}; known: {sorted(cases)}")
    deadline = Deadline(time_limit)
    sweep = "cpu" if device.type == "cpu" else ("full" if full else "default")
    ceilings = measure_ceilings(device, matmul_dtypes if device.type == "cuda" else ())
    meta = {"device": ceilings.device, "device_type": device.type, **_versions(), "sweep": sweep, "cases": selected,
            "time_limit_s": time_limit, "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "elapsed_s": round(deadline.elapsed(), 3), "skipped": {}, "complete": False, "stopped": None,
            "reference": reference, "only": list(only) if only else None}
    log = RunLog(json_path, meta, ceilings)
    for line in legend(ceilings, device, sweep):
        echo(line)
    echo(header())
    try:
        for name in selected:
            shapes = cases[name].shapes.pick(device.type, full, named=names is not None)
            if shapes is None or not shapes:
                reason = "needs a GPU" if shapes is None else "in the full sweep only (--full)"
                echo(f"{name}: {reason}: skipped")
                log.skip(name, reason)
                continue
            _run_case(cases[name], shapes, device, ceilings, log, deadline, echo, reference, only)
            if deadline.hit:
                break
    except BaseException as err:
        log.finish(deadline.elapsed(), f"interrupted: {type(err).__name__}")
        raise
    stopped = None
    if deadline.hit:
        stopped = f"time limit of {time_limit:g} s reached after {deadline.elapsed():.1f} s: no new rows started"
        echo(f"[bench] {stopped}; {len(log.rows)} rows measured")
    log.finish(deadline.elapsed(), stopped)
    written = f", written to {json_path}" if json_path else ""
    echo(f"[bench] {len(log.rows)} rows in {deadline.elapsed():.1f} s{written}")
    return log.rows
