"""Running the demo: every mode at every batch size, the cache comparison, graph capture
(see graphsafe.demo)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch

from graphsafe.demo.measure import (
    Progress, _agreement, _batch_dim_not_specialised, _decode, _dynamo_counts, _fill_row, greedy_with_near_ties,
)
from graphsafe.demo.options import DemoOptions, GRAPHS, KV_CACHES, Row, _validate, model_sizes
from graphsafe.demo.parallel import _init_tensor_parallel, _report_ranks, allreduce_ms
from graphsafe.demo.table import (
    _config, _device_name, _fp8_rank_note, format_cache_comparison, format_table, plot_rows,
)


# -- the demo ---------------------------------------------------------------------------------
def _build_default(device: torch.device, dtype: torch.dtype, seed: int, family: str = "deepseek_v32",
                   **overrides: Any):
    if family == "deepseek_v4":
        from graphsafe.models.dsv4 import build_dsv4_demo_model

        return build_dsv4_demo_model(device, dtype=dtype, seed=seed, **overrides)
    from graphsafe.models import build_demo_model

    return build_demo_model(device, dtype=dtype, seed=seed, with_hf=False, **overrides)


def run_demo(
    opts: DemoOptions,
    build: Callable[..., Any] | None = None,
    out: TextIO | None = None,
) -> list[Row]:
    """Run every mode at every batch size, print the table to `out`, return the rows.

    `build(device, dtype=, seed=, **opts.model_overrides) -> (model, _)` replaces the
    demo model (tests); by default `graphsafe.models.build_demo_model` with the sizes of
    `model_sizes(opts)`. A run with the fp8_ds_mla cache passes `kv_cache_dtype=
    "fp8_ds_mla"` to either (the "auto" cache passes nothing). With `compare_caches` the
    rows of both runs come back, bf16 first (`Row.kv_cache` tells them apart)."""
    out = out or sys.stdout
    device = torch.device(opts.device)
    _validate(opts, device, default_build=build is None)
    tp = None
    if opts.tp > 1:
        tp, device = _init_tensor_parallel(opts)
        if tp.rank != 0:  # one progress bar (rank 0's)
            opts = replace(opts, progress=False)
    previous_threads = torch.get_num_threads()
    if device.type == "cpu" and opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        torch.manual_seed(opts.seed)
        t0 = time.perf_counter()

        def make(kv_cache: str, **extra: Any) -> Any:
            if kv_cache != "auto":
                extra["kv_cache_dtype"] = kv_cache
            if build is None:
                return _build_default(device, dtype=opts.dtype, seed=opts.seed, family=opts.model_family,
                                      **model_sizes(opts), **extra)[0]
            return build(device, dtype=opts.dtype, seed=opts.seed, **opts.model_overrides, **extra)[0]

        if opts.compare_caches:
            runs = _cache_runs(make, opts, device)
        else:
            reference = None if tp is None else make(opts.kv_cache)
            model = make(opts.kv_cache) if tp is None else make(opts.kv_cache, tp=tp)
            build_s = time.perf_counter() - t0
            rows = _Run(model, opts, device, reference).rows()
            for row in rows:
                row.kv_cache = opts.kv_cache
    finally:
        torch.set_num_threads(previous_threads)
    notes = _fp8_rank_note(opts, build is None)
    if opts.compare_caches:
        rows = _report_caches(runs, opts, device, notes, out)
    elif tp is not None:
        return _report_ranks(rows, opts, device, build_s, model, tp, out)
    else:
        print(format_table(rows, opts, device, build_s, model, notes=notes), file=out)
    if opts.plot:
        plot_rows(rows, opts.plot, title=f"graphsafe demo on {_device_name(device)}")
        print(f"plot written to {opts.plot}", file=out)
    return rows


@dataclass
class _CacheRun:
    """One cache kind's run of `--compare-caches`."""

    kind: str
    model: Any
    rows: list[Row]
    build_s: float
    # batch -> (mode, picks [steps, batch]) of the bf16 run's row whose picks were fed to
    # every row of that batch in the fp8_ds_mla run (the same for both runs).
    fed: dict[int, tuple[str, torch.Tensor]]


def _cache_runs(make: Callable[..., Any], opts: DemoOptions, device: torch.device) -> list[_CacheRun]:
    """Every mode at every batch with the bf16 cache, then with fp8_ds_mla, on the same
    prompts and weights (same seed). The fp8_ds_mla rows are all fed the bf16 run's
    tokens (teacher forcing: its prefill's pick, then its eager picks, or those of its
    first mode without eager), so both runs decode the same tokens and their picks
    compare position by position."""
    runs: list[_CacheRun] = []
    feed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    for kind in KV_CACHES:
        t0 = time.perf_counter()
        model = make(kind)
        build_s = time.perf_counter() - t0
        run = _Run(model, opts, device, feed=feed)
        rows = run.rows()
        for row in rows:
            row.kv_cache = kind
        if feed is None:
            fed = _fed_picks(rows)
            feed = {b: (_prefill_picks(model, run.prompts[b]), picks) for b, (_, picks) in fed.items()}
        runs.append(_CacheRun(kind, model, rows, build_s, runs[0].fed if runs else fed))
    return runs


@torch.no_grad()
def _prefill_picks(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """The greedy picks of an eager prefill of `prompts` (what every run's step 0 is fed)."""
    return model.prefill(model.new_state(), prompts).argmax(-1)


def _fed_picks(rows: Sequence[Row]) -> dict[int, tuple[str, torch.Tensor]]:
    """Per batch, the mode and picks of the first row with picks: no eager picks existed
    before it, so it was fed its own picks, the tokens its run decoded (eager's, when
    eager runs, since the modes run in order)."""
    fed: dict[int, tuple[str, torch.Tensor]] = {}
    for row in rows:
        if row.tokens is not None and row.batch not in fed:
            fed[row.batch] = (row.mode, row.tokens)
    return fed


def _report_caches(runs: Sequence[_CacheRun], opts: DemoOptions, device: torch.device, notes: list[str],
                   out: TextIO) -> list[Row]:
    """Each cache's table (the legend once), then the comparison; returns all rows."""
    for i, run in enumerate(runs):
        legend = i == len(runs) - 1
        print(format_table(run.rows, opts, device, run.build_s, run.model, legend=legend, notes=notes), file=out)
        print(file=out)
    print(format_cache_comparison(runs), file=out)
    return [row for run in runs for row in run.rows]


class _Run:
    """The rows of one demo run: every mode (outer) at every batch size (inner), so
    eager's picks exist when the compiled modes of that batch run."""

    def __init__(self, model: Any, opts: DemoOptions, device: torch.device, reference: Any = None,
                 feed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.model, self.opts, self.device = model, opts, device
        # A one-device model of the same weights (tensor parallel): its eager picks are the
        # reference every mode (eager included) is fed and compared with.
        self.reference = reference
        # Per batch, (first, forced) tokens [batch], [steps, batch] fed to every mode instead of
        # its prefill's pick and eager's picks (the bf16 cache's in a cache comparison); the
        # picks are still compared with eager's.
        self.feed = feed or {}
        gen = torch.Generator().manual_seed(opts.seed)
        vocab = _config(model).vocab_size
        self.prompts = {b: torch.randint(0, vocab, (b, opts.prompt_len), generator=gen).tolist() for b in opts.batches}
        self.graphs_here = device.type == "cuda" or opts.emulate_graphs
        self.eager_picks: dict[int, torch.Tensor] = {}
        self.eager_near_ties: dict[int, torch.Tensor] = {}
        self.compiled_picks: dict[int, torch.Tensor] = {}
        self.compiled_near_ties: dict[int, torch.Tensor] = {}
        self.compiled: Callable | None = None
        self.compiled_once = False
        self.runner: Any = None

        def greedy(inputs):
            return greedy_with_near_ties(model.decode_step(inputs))

        self.greedy = greedy

    def rows(self) -> list[Row]:
        opts = self.opts
        runnable = [m for m in opts.modes if m != GRAPHS or self.graphs_here]
        runs = len(runnable) + (self.reference is not None)
        self.progress = Progress(runs * len(opts.batches) * opts.steps, opts.progress)
        rows = []
        try:
            if self.reference is not None:
                self._reference_picks()
            for mode in opts.modes:
                for batch in opts.batches:
                    row = Row(mode, batch)
                    rows.append(row)
                    if mode == GRAPHS and not self.graphs_here:
                        row.note = "n/a (no CUDA)"
                        continue
                    try:
                        self._run_row(row)
                    except Exception as err:  # noqa: BLE001 - a failing mode is reported in its row
                        first = str(err).splitlines()[0] if str(err) else ""
                        row.note = f"error: {type(err).__name__}: {first}"
        finally:
            self.progress.close()
            if self.runner is not None:
                self.runner.close()
        return rows

    def _reference_picks(self) -> None:
        reference = self.reference

        def greedy(inputs):
            return greedy_with_near_ties(reference.decode_step(inputs))

        for batch in self.opts.batches:
            _, _, _, (picks, near) = _decode(reference, greedy, self.prompts[batch], self.opts, self.device,
                                             self.progress, f"one-device eager B={batch}")
            self.eager_picks[batch] = picks
            self.eager_near_ties[batch] = near

    def _fed(self, batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`_decode`'s (forced, first) for a row of `batch`: the feed's when there is one,
        else eager's picks once eager has run (and the row's own prefill pick)."""
        if batch in self.feed:
            first, forced = self.feed[batch]
            return forced, first
        return self.eager_picks.get(batch), None

    def _step_fn(self, row: Row) -> Callable:
        if row.mode == "eager":
            return self.greedy
        if self.compiled is None:
            self.compiled = torch.compile(self.greedy, fullgraph=True, dynamic=True, backend=self.opts.backend)
        if row.mode == "compiled":
            return self.compiled
        if self.runner is None:
            t0 = time.perf_counter()
            self.runner = _capture(self.model, self.compiled, self.prompts, self.opts, self.device)
            row.setup_s = time.perf_counter() - t0
        return self.runner

    def _run_row(self, row: Row) -> None:
        mode, batch = row.mode, row.batch
        breaks0, graphs0 = _dynamo_counts()
        step = self._step_fn(row)
        with _batch_dim_not_specialised():
            times, fwd, whole, (picks, near) = _decode(
                self.model, step, self.prompts[batch], self.opts, self.device, self.progress,
                f"{mode} B={batch}", *self._fed(batch),
            )
        _fill_row(row, times, fwd, whole, self.opts)
        row.tokens = picks
        row.allreduce_ms = allreduce_ms(self.model, batch, self.device, captured=mode == GRAPHS)
        breaks1, graphs1 = _dynamo_counts()
        if mode == "eager" and self.reference is None:
            self.eager_picks[batch] = picks
            self.eager_near_ties[batch] = near
            row.agree = "(reference)"
            return
        new_graphs = graphs1 - graphs0
        row.graph_breaks = breaks1 - breaks0
        row.recompiles = new_graphs - (0 if self.compiled_once else min(new_graphs, 1))
        self.compiled_once = self.compiled_once or new_graphs > 0
        if mode == "eager":  # tensor parallel: compared with the one-device model
            row.graph_breaks = row.recompiles = None
            row.agree = _agreement(picks, self.eager_picks[batch], self.eager_near_ties[batch] | near)
            return
        if mode == "compiled" and new_graphs:
            row.setup_s = times[0]  # the first step of the row holds its compile
        eager_near = self.eager_near_ties.get(batch)
        row.agree = _agreement(picks, self.eager_picks.get(batch), None if eager_near is None else eager_near | near)
        if mode == "compiled":
            self.compiled_picks[batch] = picks
            self.compiled_near_ties[batch] = near
        elif batch in self.compiled_picks:
            # A batch that is a bucket replays the compiled kernels at its own size: the
            # picks must equal compiled's exactly (else exit 1). A padded batch runs them
            # at the bucket's size, where rounding may differ.
            reference = self.compiled_picks[batch]
            same = torch.equal(picks, reference)
            if not same or row.agree != "yes":
                exact = batch in self.runner.buckets
                verdict = "yes" if same else (
                    "NO" if exact else _agreement(picks, reference, near | self.compiled_near_ties[batch]))
                row.agree += "; = compiled: " + verdict


@torch.no_grad()
def _capture(model: Any, compiled: Callable, prompts: dict[int, list[list[int]]], opts: DemoOptions,
             device: torch.device):
    """A graph runner over the compiled step with buckets up to the largest batch.

    The model builds each step's inputs into its metadata builder's persistent buffers,
    so those buffers are the graphs' static inputs (no copy per step). The workspace is
    locked after capture: the prefill of the rows to come gets its worst case first."""
    from graphsafe.graphs import GraphRunner, buckets_up_to

    buckets = buckets_up_to(max(opts.batches))
    builder = getattr(model, "decode_builder", None)
    if builder is not None:
        static = builder.build_for_capture(buckets[-1])
        template = static
    else:  # a model without persistent buffers: a throw-away state's first step is the template
        state = model.new_state()
        template = model.decode_inputs(state, model.prefill(state, prompts[min(prompts)]).argmax(-1))
        static = None
    reserve_prefill = getattr(model, "prefill_workspace_reserve", None)
    if reserve_prefill is not None:
        reserve_prefill()
    runner = GraphRunner(
        compiled, template, buckets=buckets, reserve=model.decode_workspace_reserve, static=static,
        emulate=device.type != "cuda",
    )
    with _batch_dim_not_specialised():
        runner.capture()
    return runner
