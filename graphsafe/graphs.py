"""Capture and replay of decode steps, one CUDA (or HIP) graph per batch-size bucket.

    runner = GraphRunner(step, template, reserve=model.decode_workspace_reserve)
    runner.capture()                  # reserve, warm up, capture largest first, lock
    logits = runner(model.decode_inputs(state, tokens))   # pad to the bucket, replay
    runner.close()                    # drop the graphs; the workspace may grow again

`step(DecodeInputs) -> Tensor | tuple[Tensor, ...]` is any step function whose outputs
have the batch as their first dimension: the model's eager `decode_step` or its
`torch.compile(fullgraph=True)` version alike. Every bucket reads one set of static
input buffers sized for the largest bucket (a bucket of n rows reads their first n
rows), so a step's inputs are copied in once, and rows past the live batch hold each
field's pad value (slot -1, seq_len 0: the ops do nothing there). With `static=` the
buffers of a metadata builder serve as those static inputs, and steps built in place
are not copied at all.

`capture()` follows the design's order (docs/design.md, "Metadata, graphs and models"):
1. `reserve(max_bucket)` sizes the workspace for the worst case (one growth, no dry run);
2. every bucket runs `warmup_steps` times on a side stream, largest first: Triton and
   Inductor compile, specialise and autotune there, never inside a capture;
3. the graphs are captured largest first into one shared memory pool, so each smaller
   graph reuses the blocks the larger ones freed;
4. the workspace manager of the device is locked: a captured graph keeps reading the
   arena's address, so it must never be freed or moved (growth now raises).
Warm-up runs the step on padding-valued inputs, which write no cache slot.

Replay does no host sync and no caching-allocator call: a host-side bucket lookup (a
batch above the largest bucket is an error naming it and the buckets), a `copy_` of
each field into the static rows plus a `fill_` of the pad rows, one graph launch on the
current stream, and views of the outputs' first B rows. Those views are the graph's static output
buffers: they are valid until the next replay of any bucket (the buckets share a memory
pool), so copy out (or consume) what must outlive it.

The CUDA-specific part is the small `_CudaGraphs` driver; `GraphRunner(..., emulate=True)`
swaps in `_EmulatedGraphs`, which re-runs the step on the static buffers and copies the
results into the static outputs, so the bucketing, padding and output semantics run (and
are tested) on any device.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from graphsafe.errors import GraphsafeError
from graphsafe.metadata.inputs import DecodeInputs

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

Outputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]
StepFn = Callable[[DecodeInputs], Outputs]


class GraphRunnerError(GraphsafeError, ValueError):
    """The graph runner was misused: a batch outside the buckets, inputs whose layout
    differs from the captured one, a replay before capture, a bad bucket list."""


# -- buckets ---------------------------------------------------------------------------
def normalize_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated positive bucket sizes (an error for anything else)."""
    values = list(buckets)
    if not values:
        raise GraphRunnerError("buckets: expected at least one batch size, got none")
    for b in values:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise GraphRunnerError(f"buckets: expected positive ints, got {b!r} in {values}")
    return tuple(sorted(set(values)))


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `batch` rows (`buckets` sorted ascending)."""
    if batch < 1:
        raise GraphRunnerError(f"batch size {batch}: a decode step needs at least one request")
    i = bisect.bisect_left(buckets, batch)
    if i == len(buckets):
        raise GraphRunnerError(
            f"batch size {batch} exceeds the largest captured bucket {buckets[-1]} (buckets: "
            f"{list(buckets)}); capture with a larger bucket or split the batch"
        )
    return buckets[i]


def buckets_up_to(batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a runner needs to serve every batch size up to `batch`: those of
    `buckets` below it, plus `batch` itself when no bucket holds it exactly."""
    below = [b for b in normalize_buckets(buckets) if b < batch]
    return normalize_buckets([*below, batch])


# -- static buffers --------------------------------------------------------------------
def static_inputs_like(template: DecodeInputs, batch: int) -> DecodeInputs:
    """Padding-valued buffers of `batch` rows with the template's per-row shapes, dtypes
    and device (any field a later DecodeInputs adds is covered through `items()`)."""
    return type(template)(
        **{
            name: torch.full((batch, *t.shape[1:]), pad, dtype=t.dtype, device=t.device)
            for name, t, pad in template.items()
        }
    )


def rows_of(static: DecodeInputs, n: int) -> DecodeInputs:
    """Views of the first n rows, of the same DecodeInputs type (a bucket's inputs)."""
    return type(static)(**{name: t[:n] for name, t, _ in static.items()})


def layout_of(inputs: DecodeInputs) -> tuple:
    """What must match between a step's inputs and the static buffers: each field's
    per-row shape, dtype and device (the batch may differ)."""
    return tuple((name, tuple(t.shape[1:]), t.dtype, t.device) for name, t, _ in inputs.items())


def _as_tuple(out: Any, bucket: int) -> tuple[tuple[torch.Tensor, ...], bool]:
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else tuple(out) if isinstance(out, (tuple, list)) else None
    if outs is None or not all(isinstance(o, torch.Tensor) for o in outs):
        raise GraphRunnerError(f"step function must return a tensor or a tuple of tensors, got {type(out).__name__}")
    for i, o in enumerate(outs):
        if o.dim() == 0 or o.shape[0] != bucket:
            raise GraphRunnerError(
                f"step output {i} has shape {tuple(o.shape)}: every output's first dimension must be "
                f"the batch ({bucket} rows in this bucket)"
            )
    return outs, single


# -- drivers: the only device-specific code --------------------------------------------
class _CudaGraphs:
    """torch.cuda graphs (also HIP graphs on ROCm builds)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def warmup(self, fn: StepFn, static: DecodeInputs, steps: int) -> None:
        # A side stream, as torch.cuda.graphs recommends: lazy initialisation (cuBLAS
        # handles, Triton launchers, Inductor's first run) stays off the capture stream.
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(steps):
                    fn(static)
            current.wait_stream(side)
            torch.cuda.synchronize(self.device)

    def capture(self, fn: StepFn, static: DecodeInputs) -> tuple[Any, Outputs]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            out = fn(static)
        return graph, out

    @staticmethod
    def replay(graph: Any) -> None:
        graph.replay()


class _EmulatedGraphs:
    """The same contract without a graph: "replay" re-runs the step on the static inputs
    and copies its results into the static outputs made at "capture" (tests, CPUs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def warmup(self, fn: StepFn, static: DecodeInputs, steps: int) -> None:
        for _ in range(steps):
            fn(static)

    def capture(self, fn: StepFn, static: DecodeInputs) -> tuple[Any, Outputs]:
        out = fn(static)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return (fn, static, outs), out

    @staticmethod
    def replay(handle: Any) -> None:
        fn, static, outs = handle
        fresh = fn(static)
        for dst, src in zip(outs, (fresh,) if isinstance(fresh, torch.Tensor) else fresh):
            dst.copy_(src)


# -- the runner --------------------------------------------------------------------------
# Per workspace manager: [captured runners not yet closed, whether they took the lock].
# The arena those graphs read stays locked until the last of them closes.
_captured_runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

@dataclass
class GraphStats:
    """Counters of one runner: graphs captured, replays per bucket, and the workspace
    state frozen at capture (a test compares it with the manager's later stats)."""

    captures: int = 0
    warmup_runs: int = 0
    replays: dict[int, int] = field(default_factory=dict)
    workspace_bytes_at_capture: int | None = None
    workspace_grows_at_capture: int | None = None

    @property
    def total_replays(self) -> int:
        return sum(self.replays.values())


class GraphRunner:
    """One captured graph per batch bucket of `fn`, replayed with padded static inputs.

    Args:
        fn: the step, `fn(DecodeInputs) -> Tensor | tuple[Tensor, ...]`, every output
            batch-first. Pure in its inputs: whatever else it reads (weights, the KV cache)
            must stay at the same address for the runner's lifetime.
        template: any DecodeInputs with the per-row layout of the steps to come (e.g. the
            first step's inputs); only its shapes, dtypes and device are used.
        buckets: batch sizes to capture (default 1, 2, 4, ..., 128).
        reserve: called once as `reserve(max_bucket)` before warm-up to size the
            workspace for the worst case (e.g. `model.decode_workspace_reserve`).
        warmup_steps: eager runs of each bucket before capture.
        emulate: re-run the step instead of replaying a graph (any device; tests). The
            default captures CUDA/HIP graphs and needs the template on a CUDA device.
        static: use these buffers (at least max_bucket rows, the template's layout) as the
            static inputs instead of allocating them: a metadata builder's persistent
            buffers, e.g. `DecodeMetadataBuilder.build_for_capture(max_bucket)`. Every row
            must hold its pad value at capture (warm-up runs the step on them), and the
            builder keeps rows past a batch padded, so a step whose inputs are views of
            the first rows of these buffers replays with no copy at all.
    """

    def __init__(
        self,
        fn: StepFn,
        template: DecodeInputs,
        *,
        buckets: Iterable[int] = DEFAULT_BUCKETS,
        reserve: Callable[[int], Any] | None = None,
        warmup_steps: int = 2,
        emulate: bool = False,
        static: DecodeInputs | None = None,
    ) -> None:
        self.fn = fn
        self.buckets = normalize_buckets(buckets)
        self.reserve = reserve
        if warmup_steps < 1:
            raise GraphRunnerError(f"warmup_steps: expected >= 1, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.device = template.input_ids.device
        if not emulate and self.device.type != "cuda":
            raise GraphRunnerError(
                f"CUDA graphs need inputs on a CUDA/HIP device, got {self.device}; "
                f"pass emulate=True to run the same bucketing without graphs"
            )
        self.emulated = emulate
        self._driver = (_EmulatedGraphs if emulate else _CudaGraphs)(self.device)
        self._layout = layout_of(template)
        if static is None:
            static = static_inputs_like(template, self.buckets[-1])
        elif layout_of(static) != self._layout or static.batch_size < self.buckets[-1]:
            raise GraphRunnerError(
                f"static buffers: expected the template's layout and at least {self.buckets[-1]} rows, got "
                f"{static.batch_size} rows of {layout_of(static)}"
            )
        self._static = static
        # data_ptr of each static field: inputs that are views of their first rows need no copy
        self._static_ptrs = [t.data_ptr() for _, t, _ in static.items()]
        self._rows = {b: rows_of(self._static, b) for b in self.buckets}
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._single = True
        # bucket of every batch size 1..max: one list index on the hot path
        self._bucket_of = [0] + [bucket_for(b, self.buckets) for b in range(1, self.buckets[-1] + 1)]
        self.stats = GraphStats(replays={b: 0 for b in self.buckets})

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def static_inputs(self, bucket: int | None = None) -> DecodeInputs:
        """The static input rows a bucket's graph reads (default: all of them)."""
        return self._static if bucket is None else self._rows[bucket]

    def workspace(self):
        from graphsafe.workspace import current_workspace_manager

        return current_workspace_manager(self.device)

    @torch.no_grad()
    def capture(self) -> GraphRunner:
        """Warm up, reserve, capture every bucket largest first, lock the workspace.
        Runs under `torch.no_grad()`: decode graphs are inference (no autograd state may
        point into the graphs' pool)."""
        if self._graphs:
            raise GraphRunnerError("graphs are already captured; close() the runner to capture again")
        if self.reserve is not None:
            self.reserve(self.max_batch)
        order = sorted(self.buckets, reverse=True)
        for b in order:
            self._driver.warmup(self.fn, self._rows[b], self.warmup_steps)
            self.stats.warmup_runs += self.warmup_steps
        ws = self.workspace()
        try:
            for b in order:
                graph, out = self._driver.capture(self.fn, self._rows[b])
                outs, self._single = _as_tuple(out, b)
                self._graphs[b], self._outputs[b] = graph, outs
                self.stats.captures += 1
        except BaseException:
            # No half-captured runner: drop what was captured (capture() may be retried).
            self._graphs.clear()
            self._outputs.clear()
            raise
        # Lock. The last captured runner over this workspace to close unlocks it, if the
        # runners locked it (a lock the caller took stays).
        entry = _captured_runners.setdefault(ws, [0, not ws.is_locked])
        entry[0] += 1
        self._ws = ws
        ws.lock()
        s = ws.stats()
        self.stats.workspace_bytes_at_capture = s.size_bytes
        self.stats.workspace_grows_at_capture = s.grow_count
        return self

    def bucket_for(self, batch: int) -> int:
        return bucket_for(batch, self.buckets)

    def __call__(self, inputs: DecodeInputs) -> Outputs:
        """Copy `inputs` into the smallest bucket holding them, replay its graph, and
        return views of the outputs' first B rows (valid until the next replay)."""
        n = inputs.input_ids.shape[0]
        try:
            bucket = self._bucket_of[n] if n > 0 else bucket_for(n, self.buckets)
        except IndexError:
            bucket = bucket_for(n, self.buckets)  # raises, naming B and the buckets
        graph = self._graphs.get(bucket)
        if graph is None:
            raise GraphRunnerError("replay before capture: call GraphRunner.capture() first")
        if layout_of(inputs) != self._layout:
            raise GraphRunnerError(
                f"inputs do not match the captured layout (per-row shape, dtype, device of each "
                f"field): expected {self._layout}, got {layout_of(inputs)}"
            )
        if [t.data_ptr() for _, t, _ in inputs.items()] != self._static_ptrs:
            inputs.copy_into(self._rows[bucket])
        # else: the inputs were built in place (a builder over the static buffers), and
        # the builder keeps rows past the batch padded.
        self._driver.replay(graph)
        self.stats.replays[bucket] += 1
        outs = self._outputs[bucket]
        if self._single:
            return outs[0][:n]
        return tuple(o[:n] for o in outs)

    def close(self) -> None:
        """Drop the graphs and their outputs. When no other runner's graphs read the same
        workspace any more, it may grow again (unlocked if this runner locked it)."""
        if not self._graphs:
            return
        self._graphs.clear()
        self._outputs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ws = self._ws
        entry = _captured_runners.get(ws, [1, False])
        entry[0] -= 1
        if entry[0] > 0:
            return
        _captured_runners.pop(ws, None)
        if entry[1]:
            ws.unlock()
        ws.forget_captures()
