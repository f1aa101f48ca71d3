"""`python -m graphsafe demo`: greedy decoding with the DeepSeek-V3.2-style demo model in
three modes, and one table comparing them.

For every batch size, each mode starts from the same prompts (random token ids from a
seeded generator), prefills them eagerly, then decodes `--steps` tokens greedily:

    eager             the model's decode step as Python calls the ops
    compiled          torch.compile(fullgraph=True, dynamic=True) of the same step
    compiled+graphs   the compiled step captured into one CUDA graph per batch bucket
                      (graphsafe.graphs.GraphRunner; CUDA only)

The step that every mode runs is `decode_step(inputs).argmax(-1)`: greedy sampling sits
inside the compiled / captured region, so a replay hands back the next tokens and
nothing else. Per row the table gives the median step latency (the first `--warmup`
steps, where compilation, Triton JIT and autotuning happen, are left out), tokens/s,
graph breaks and recompiles seen by dynamo, host syncs and caching-allocator allocations
per step (CUDA only: sync-debug "warn" warnings and `memory_stats` counters, for the
forward alone and for the whole step with the metadata build), the one-off set-up time
(compile or capture) and whether each mode's greedy picks equal eager's: every mode is
fed eager's tokens (teacher forcing), so one pick flipped at a near-tie of the logits
stays one pick instead of forking the rest of the sequence.

The latent MLA cache is the model dtype's (`--kv-cache auto`) or DeepSeek's FP8 record
(`--kv-cache fp8_ds_mla`; the model then has kv_lora_rank 128, since the demo model's 64
has no record layout); the table's header gives its bytes per token, per layer and in
all layers. `--compare-caches` runs the modes with both caches on the same prompts and
weights, the fp8_ds_mla run fed the bf16 run's picks, and adds a table of bytes per
token, cache size, step times and greedy agreement (`format_cache_comparison`).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, TextIO

import torch

from graphsafe.errors import GraphsafeError

MODES = ("eager", "compiled", "compiled+graphs")
GRAPHS = "compiled+graphs"
# The latent MLA cache kinds (`ModelConfig.kv_cache_dtype`): the model dtype, DeepSeek's FP8 record.
KV_CACHES = ("auto", "fp8_ds_mla")
# fp8_ds_mla keeps one float32 scale per 128 latent values: the demo model's kv_lora_rank
# (64) has no record layout, so a run with that cache builds the model with this one.
FP8_CACHE_KV_LORA_RANK = 128


class DemoError(GraphsafeError):
    """The demo cannot run as asked (a missing optional package, bad options)."""


@dataclass
class DemoOptions:
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 4)
    steps: int = 16
    prompt_len: int = 16
    backend: str = "inductor"
    warmup: int = 2
    seed: int = 0
    modes: tuple[str, ...] = MODES
    dtype: torch.dtype = torch.bfloat16
    plot: str | None = None
    progress: bool = True
    # Tests: off CUDA, run the graph mode through GraphRunner(emulate=True) (no graphs,
    # the same bucketing, padding and static outputs) instead of printing "n/a".
    emulate_graphs: bool = False
    # CPU intra-op threads during the run (restored after). The demo model's matrices
    # are a few hundred wide: OpenMP fork/join costs more than it saves, and on a shared
    # machine spinning threads stall for milliseconds. 0 leaves torch's setting.
    threads: int = 1
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # Tensor-parallel ranks (one process each, started by torchrun): each rank runs its
    # shard (graphsafe.models.parallel); picks are compared with a one-device model of the
    # same weights that every rank also runs eagerly.
    tp: int = 1
    # The latent MLA cache: "auto" (the model dtype) or "fp8_ds_mla" (656 bytes a token for
    # DeepSeek). With either fp8_ds_mla or `compare_caches`, kv_lora_rank is 128 unless
    # `model_overrides` names a multiple of 128 (the demo model's 64 has no record layout).
    kv_cache: str = "auto"
    # Run the modes with both caches on the same prompts and weights (bf16 first; every
    # fp8_ds_mla row is fed the bf16 run's picks) and print a comparison table after the two
    # tables. `kv_cache` is then not used.
    compare_caches: bool = False


def default_options(device: str) -> DemoOptions:
    """Defaults that finish in well under a minute on a 2-core CPU; on a GPU, the decode
    benchmark of issue 5 (B = 1, 8, 64, contexts growing to 4096 tokens); both with
    DeepSeek-V3.2's index_topk of 2048. The demo model's own 16 would keep 16 of 4096 tokens: fp8
    near-ties in the indexer then swap a token carrying 1/16 of the attention whenever
    compiled code rounds the indexer's query differently, and about a fifth of the greedy
    picks of this random model flipped against eager in the first GPU run."""
    if device == "cuda":
        return DemoOptions(
            device="cuda", batches=(1, 8, 64), steps=64, prompt_len=4096 - 64, warmup=4,
            model_overrides={"index_topk": 2048},
        )
    # The CPU too: with the model's own 16 the selection drops tokens after 16 of the 32
    # positions, and fp8 near-ties in the indexer then flip picks by more than rounding.
    return DemoOptions(device="cpu", model_overrides={"index_topk": 2048})


@dataclass
class Row:
    mode: str
    batch: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    graph_breaks: int | None = None
    recompiles: int | None = None
    syncs_fwd: float | None = None
    syncs_step: float | None = None
    allocs_fwd: float | None = None
    allocs_step: float | None = None
    setup_s: float | None = None
    allreduce_ms: float | None = None  # tensor parallel: the step's all-reduces alone
    kv_cache: str = "auto"  # the latent cache kind of the run (KV_CACHES)
    agree: str = ""
    note: str = ""  # why a row has no numbers ("n/a (no CUDA)", an error)
    tokens: torch.Tensor | None = field(default=None, repr=False)  # [steps, batch] on the CPU

    @property
    def ok(self) -> bool:
        return not self.note.startswith("error")


# -- measurement helpers --------------------------------------------------------------------
# What sync-debug "warn" says of a synchronizing call. Matched exactly: the first
# set_sync_debug_mode() of a process also warns, once, that the mode "does not yet detect
# all synchronizing operations", which an earlier looser match counted as a sync (a
# phantom 1/60 per step in one row of the first GPU run).
SYNC_WARNING = "called a synchronizing CUDA operation"


class _Counters:
    """Host syncs (sync-debug "warn" warnings) and caching-allocator allocations inside
    `window()` blocks, summed over the measured steps. Counts nothing off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.syncs = 0
        self.allocs = 0

    @contextmanager
    def window(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        before = torch.cuda.memory_stats(self.device).get("allocation.all.allocated", 0)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.syncs += sum(SYNC_WARNING in str(w.message) for w in caught)
        self.allocs += torch.cuda.memory_stats(self.device).get("allocation.all.allocated", 0) - before


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """On a terminal: tqdm when it is installed, else a small text bar redrawn in place.
    Elsewhere (logs, CI): a line per 10%. Nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.stream = stream or sys.stderr
        self._bar = None
        self._last_pct = -1
        if not self.enabled or not self.stream.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, file=self.stream, unit="step", leave=False, dynamic_ncols=True)

    def update(self, n: int = 1, label: str = "") -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            if label:
                self._bar.set_description(label, refresh=False)
            self._bar.update(n)
            return
        pct = 100 * self.done // self.total
        interactive = self.stream.isatty()
        if pct == self._last_pct or (not interactive and pct < 100 and pct - self._last_pct < 10):
            return
        self._last_pct = pct
        filled = 30 * self.done // self.total
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {pct:3d}% {label}"
        self.stream.write(("\r" + line) if interactive else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


# -- one row ---------------------------------------------------------------------------------
# A pick that flips where the top two logits are this close (relative to the top one:
# two bf16 ulps) flips by rounding: compiled code rounds bf16 differently than eager.
NEAR_TIE = 4 * 2.0**-8


def _agreement(tokens: torch.Tensor, reference: torch.Tensor | None, near_tie: torch.Tensor | None = None) -> str:
    """"yes" when every greedy pick equals the reference's. Otherwise how many do and
    whether every flip is at a near-tie (`near_tie`: a bool mask of the positions where
    either run's top two logits are within NEAR_TIE of each other): "near-tie: 14/16
    picks (2 flips, all at near-ties)", or "NO: ..." when a flip is not at a near-tie
    (or nothing says)."""
    if reference is None:
        return "n/a (no eager run)"
    if torch.equal(tokens, reference):
        return "yes"
    flips = tokens != reference
    equal, n = int((~flips).sum()), int(flips.sum())
    plural = "flip" if n == 1 else "flips"
    if near_tie is not None and bool(near_tie[flips].all()):
        where = "at a near-tie" if n == 1 else "all at near-ties"
        return f"near-tie: {equal}/{tokens.numel()} picks ({n} {plural}, {where})"
    off = n if near_tie is None else int((~near_tie[flips]).sum())
    return f"NO: {equal}/{tokens.numel()} picks ({off} of {n} {plural} not at a near-tie)"


def greedy_with_near_ties(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax picks, whether the top two logits are within NEAR_TIE of the top one):
    two reductions, no sort (a top-k over a dynamic batch does not compile everywhere)."""
    x = logits.float()
    top = x.amax(-1, keepdim=True)
    near = (x >= top - NEAR_TIE * top.abs()).sum(-1) >= 2
    return logits.argmax(-1), near


@torch.no_grad()
def _decode(
    model: Any,
    step: Callable[[Any], torch.Tensor],
    prompts: list[list[int]],
    opts: DemoOptions,
    device: torch.device,
    progress: Progress,
    label: str,
    forced: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
) -> tuple[list[float], _Counters, _Counters, torch.Tensor]:
    """Prefill `prompts`, then `opts.steps` greedy steps through `step`. Returns the step
    times (s), the counters of the measured steps (forward only, whole step), and each
    step's greedy picks and near-tie flags (`greedy_with_near_ties`), each `[steps, batch]`
    on the CPU. With `forced` (eager's picks), step i + 1 is fed `forced[i]` instead of
    this run's own pick (teacher forcing); with `first` too, step 0 is fed `first` instead
    of the prefill's pick."""
    state = model.new_state()
    tokens = model.prefill(state, prompts).argmax(-1)
    if first is not None:
        tokens = first.to(device)
    # Tokens are kept on the device until the end: reading them back each step would be
    # a host sync that the table should not charge to the step.
    generated = torch.empty(opts.steps, len(prompts), dtype=torch.int64, device=device)
    near_ties = torch.empty(opts.steps, len(prompts), dtype=torch.bool, device=device)
    feed = generated if forced is None else forced.to(device)
    fwd, whole = _Counters(device), _Counters(device)
    times = []
    _sync(device)
    for i in range(opts.steps):
        measured = i >= min(opts.warmup, opts.steps - 1)
        t0 = time.perf_counter()
        with whole.window() if measured else nullcontext():
            inputs = model.decode_inputs(state, tokens)
            with fwd.window() if measured else nullcontext():
                picks, near = step(inputs)
            generated[i].copy_(picks)  # a graph's output is a static buffer: keep our own copy
            near_ties[i].copy_(near)
            tokens = feed[i]
            model.advance(state, tokens)
        _sync(device)
        times.append(time.perf_counter() - t0)
        progress.update(1, label)
    # The inner window recorded the forward's sync warnings, which the outer one then
    # never saw (allocation counters are deltas: the outer delta covers the inner).
    whole.syncs += fwd.syncs
    return times, fwd, whole, (generated.cpu(), near_ties.cpu())


def _fill_row(row: Row, times: list[float], fwd: _Counters, whole: _Counters, opts: DemoOptions) -> None:
    measured = times[min(opts.warmup, len(times) - 1):]
    row.step_ms = 1e3 * statistics.median(measured)
    row.tokens_per_s = row.batch / (row.step_ms / 1e3)
    if fwd.cuda:
        n = len(measured)
        row.syncs_fwd, row.syncs_step = fwd.syncs / n, whole.syncs / n
        row.allocs_fwd, row.allocs_step = fwd.allocs / n, whole.allocs / n


# -- the demo ---------------------------------------------------------------------------------
def _build_default(device: torch.device, dtype: torch.dtype, seed: int, **overrides: Any):
    from graphsafe.models import build_demo_model

    return build_demo_model(device, dtype=dtype, seed=seed, with_hf=False, **overrides)


def model_sizes(opts: DemoOptions) -> dict[str, Any]:
    """Model sizes the run needs (user overrides win): room for the largest batch, and a
    context just long enough for the prompt plus the decoded tokens (the indexer's decode
    logits are `max_model_len` wide, so a tight bound keeps the step honest and small);
    with an fp8_ds_mla cache (`uses_fp8_cache`), kv_lora_rank FP8_CACHE_KV_LORA_RANK."""
    sizes: dict[str, Any] = {"max_batch": max(opts.batches), "max_model_len": opts.prompt_len + opts.steps}
    if uses_fp8_cache(opts):
        sizes["kv_lora_rank"] = FP8_CACHE_KV_LORA_RANK
    return {**sizes, **opts.model_overrides}


def uses_fp8_cache(opts: DemoOptions) -> bool:
    """Whether some run of the demo builds the model with the fp8_ds_mla cache."""
    return opts.compare_caches or opts.kv_cache == "fp8_ds_mla"


def _fp8_rank_note(opts: DemoOptions, default_build: bool) -> list[str]:
    """The header's note when the demo changed the model's kv_lora_rank for the fp8 cache."""
    if not (default_build and uses_fp8_cache(opts)) or "kv_lora_rank" in opts.model_overrides:
        return []
    both = " (both caches run this model)" if opts.compare_caches else ""
    return [f"note: kv_lora_rank={FP8_CACHE_KV_LORA_RANK}{both}: the demo model's own 64 has no fp8_ds_mla record "
            f"layout (one float32 scale per {FP8_CACHE_KV_LORA_RANK} latent values)"]


def _config(model: Any) -> Any:
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def _describe(model: Any) -> str:
    cfg = _config(model)
    names = ("num_layers", "hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
             "index_head_dim", "index_topk", "vocab_size")
    parts = [f"{n}={getattr(cfg, n)}" for n in names if hasattr(cfg, n)]
    for n in ("max_batch", "max_model_len", "block_size"):
        if hasattr(model, n):
            parts.append(f"{n}={getattr(model, n)}")
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        parts.append(f"tensor parallel over {tp.size} ranks (num_heads is per rank)")
    return ", ".join(parts) or repr(cfg)


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise DemoError(
            "--plot needs matplotlib, an optional extra: pip install 'graphsafe[plot]' (or pip install matplotlib)"
        ) from err


@contextmanager
def _batch_dim_not_specialised() -> Iterator[None]:
    """One dynamic graph for every batch size. Dynamo specialises a size-1 dimension
    (0/1 specialisation), so B = 1 would compile a graph of its own: backed_size_oblivious
    treats it like any size. Duck sizing would tie the batch to any other dimension of
    the same size at the first call (B = 1 and a one-block table): off. Where this torch
    lacks the switches, nothing changes (a recompile shows in the table)."""
    try:
        import torch.fx.experimental._config as fx_config

        patch = fx_config.patch(backed_size_oblivious=True, use_duck_shape=False)
    except (ImportError, AttributeError, KeyError):
        patch = nullcontext()
    with patch:
        yield


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
    _validate(opts, device)
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
                return _build_default(device, dtype=opts.dtype, seed=opts.seed, **model_sizes(opts), **extra)[0]
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


def _init_tensor_parallel(opts: DemoOptions):
    from graphsafe.models.parallel import init_from_environment

    try:
        tp, device = init_from_environment(opts.device)
    except RuntimeError as err:
        raise DemoError(str(err)) from None
    if tp.size != opts.tp:
        raise DemoError(f"--tp {opts.tp}, but torchrun started {tp.size} processes (--nproc-per-node {opts.tp})")
    return tp, device


def _report_ranks(rows: list[Row], opts: DemoOptions, device: torch.device, build_s: float, model: Any, tp: Any,
                  out: TextIO) -> list[Row]:
    """Rank 0 prints every rank's table (syncs and allocations are per rank); every rank
    returns all ranks' rows, so each exits with the same code."""
    import torch.distributed as dist

    for r in rows:
        r.note = r.note or ""
    gathered: list[Any] = [None] * tp.size
    dist.all_gather_object(gathered, [(r, device.index) for r in rows], group=tp.group)
    if tp.rank == 0:
        for rank, rank_rows in enumerate(gathered):
            index = rank_rows[0][1] if rank_rows else None
            rank_device = device if index is None else torch.device(device.type, index)
            print(f"== rank {rank} of {tp.size}", file=out)
            table = format_table([r for r, _ in rank_rows], opts, rank_device, build_s, model,
                                 legend=rank == tp.size - 1)
            print(table, file=out)
    return [r for rank_rows in gathered for r, _ in rank_rows]


def allreduce_ms(model: Any, batch: int, device: torch.device, captured: bool, repeats: int = 20) -> float | None:
    """Milliseconds of one decode step's all-reduces run alone: as many as the step
    makes (two a layer), of the same `[batch, hidden]` tensors, eagerly (eager and
    compiled modes call them one by one) or replayed from a CUDA graph (the graph mode)."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return None
    import torch.distributed._functional_collectives as funcol

    count = 2 * model.cfg.num_layers
    x = torch.ones(batch, model.cfg.hidden_size, dtype=model.dtype, device=device)

    def step() -> None:
        for _ in range(count):
            funcol.wait_tensor(tp.all_reduce(x))

    run = step
    if captured and device.type == "cuda":
        step()  # warm-up outside capture (communicator set-up)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _validate(opts: DemoOptions, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device here")
    unknown = [m for m in opts.modes if m not in MODES]
    if unknown or not opts.modes:
        raise DemoError(f"modes: expected some of {list(MODES)}, got {list(opts.modes)}")
    if opts.tp < 1:
        raise DemoError(f"--tp: expected a positive number of ranks, got {opts.tp}")
    if opts.kv_cache not in KV_CACHES:
        raise DemoError(f"--kv-cache: expected one of {list(KV_CACHES)}, got {opts.kv_cache!r}")
    if opts.compare_caches and opts.tp > 1:
        raise DemoError("--compare-caches runs on one device: leave out --tp")
    if uses_fp8_cache(opts):
        _validate_fp8_layout(opts.model_overrides)
    if not opts.batches or min(opts.batches) < 1 or opts.steps < 1 or opts.prompt_len < 1:
        raise DemoError("batch sizes, steps and the prompt length must be positive")
    if opts.plot:
        check_plot_available()  # before any work


def _validate_fp8_layout(overrides: dict[str, Any]) -> None:
    """The fp8_ds_mla record needs kv_lora_rank a multiple of 128 and an even rope width:
    refuse overrides without a layout before building anything."""
    rank = overrides.get("kv_lora_rank", FP8_CACHE_KV_LORA_RANK)
    rope = overrides.get("qk_rope_head_dim", 0)
    if not isinstance(rank, int) or rank <= 0 or rank % FP8_CACHE_KV_LORA_RANK:
        raise DemoError(
            f"the fp8_ds_mla cache needs kv_lora_rank a multiple of {FP8_CACHE_KV_LORA_RANK} (one float32 scale "
            f"per {FP8_CACHE_KV_LORA_RANK} latent values), got --model kv_lora_rank={rank}; without the override "
            f"the demo uses {FP8_CACHE_KV_LORA_RANK}"
        )
    if not isinstance(rope, int) or rope % 2:
        raise DemoError(f"the fp8_ds_mla cache needs an even qk_rope_head_dim, got --model qk_rope_head_dim={rope}")


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


# -- output ------------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"cpu (torch {torch.__version__})"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _pair(fwd: float | None, step: float | None) -> str:
    if fwd is None:
        return "n/a"
    return f"{fwd:g} / {step:g}"


COLUMNS = [
    ("mode", 15), ("batch", 5), ("step ms", 9), ("tokens/s", 10), ("breaks", 6), ("recompiles", 10),
    ("syncs fwd/step", 14), ("allocs fwd/step", 15), ("setup s", 7), ("picks = eager", 0),
]


def format_table(rows: Sequence[Row], opts: DemoOptions, device: torch.device, build_s: float = 0.0,
                 model: Any = None, legend: bool = True, notes: Sequence[str] = ()) -> str:
    """The demo's table: the run, the model and its MLA cache's bytes per token (per
    layer and in all layers), `notes`, one line per (mode, batch), then what the
    columns mean."""
    lines = [
        f"graphsafe demo on {_device_name(device)}: prompt {opts.prompt_len} tokens, {opts.steps} greedy steps "
        f"(median over steps {min(opts.warmup, opts.steps - 1) + 1}..{opts.steps}), compile backend "
        f"{opts.backend}, model built in {build_s:.1f} s",
    ]
    if model is not None:
        lines.append(f"model: {_describe(model)}")
        cache = _cache_line(model)
        if cache:
            lines.append(cache)
    lines += list(notes)
    parallel = any(r.allreduce_ms is not None for r in rows)
    columns = COLUMNS[:-1] + ([("all-reduce ms (share)", 21), ("picks = one-device eager", 0)] if parallel
                              else COLUMNS[-1:])
    header = " ".join(f"{name:<{w}}" if w else name for name, w in columns)
    lines += [header, "-" * len(header)]
    for r in rows:
        if r.step_ms is None:
            cells = [r.mode, str(r.batch), r.note]
            lines.append(f"{cells[0]:<15} {cells[1]:<5} {cells[2]}")
            continue
        cells = [
            r.mode, str(r.batch), _num(r.step_ms, ".3f"), _num(r.tokens_per_s, ".1f"),
            "-" if r.graph_breaks is None else str(r.graph_breaks),
            "-" if r.recompiles is None else str(r.recompiles),
            _pair(r.syncs_fwd, r.syncs_step), _pair(r.allocs_fwd, r.allocs_step),
            "-" if r.setup_s is None else f"{r.setup_s:.1f}",
        ]
        if parallel:
            cells.append("-" if r.allreduce_ms is None else f"{r.allreduce_ms:.3f} ({r.allreduce_ms / r.step_ms:.0%})")
        cells.append(r.agree)
        lines.append(" ".join(f"{c:<{w}}" if w else c for c, (_, w) in zip(cells, columns)))
    if not legend:
        return "\n".join(lines)
    lines += [
        "",
        "step ms: median wall time of a whole step (metadata build, forward with greedy argmax, state advance,",
        "  device synchronised at the end). breaks / recompiles: dynamo graph breaks and graphs compiled beyond the",
        "  first (fullgraph=True, dynamic=True). syncs, allocs: per step, host syncs (sync-debug warn) and",
        "  caching-allocator allocations, for the forward alone / the whole step (CUDA only). setup s: compile",
        "  (first step) or warm-up + capture of every bucket. picks = eager: every mode is fed eager's tokens",
        "  (teacher forcing) and its greedy picks are compared with eager's. Compiled code rounds bf16 differently",
        "  (fused ops, ~1 ulp); the logits come out of a bf16 lm_head (0.0625 apart near 10), so this random",
        "  model's top two often tie within an ulp and a pick can flip: \"near-tie\" means every flip is at a",
        "  position where eager's or this mode's top two logits are within 4 * 2^-8 of the top one (two bf16",
        "  ulps); \"NO\" counts the flips that are not. Graphs replay the compiled kernels: at a bucket's own",
        "  batch size, picks equal compiled's.",
    ]
    if parallel:
        lines += [
            "Tensor parallel: every mode, eager included, is fed and compared with the picks of a one-device",
            "  model of the same weights run eagerly on each rank. all-reduce ms: the step's all-reduces (two a",
            "  layer, [batch, hidden]) timed alone, eagerly or replayed from a CUDA graph as the mode runs them,",
            "  and their share of the step's median.",
        ]
    return "\n".join(lines)


def _cache_line(model: Any) -> str | None:
    """"MLA cache: <kind> (<row layout>): N bytes per token per layer, M in all L layers"
    for a model with `cache_bytes_per_token` (None otherwise)."""
    per_token = getattr(model, "cache_bytes_per_token", None)
    cfg = _config(model)
    if per_token is None or cfg is None:
        return None
    total, layers = per_token(), cfg.num_layers
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.kv_cache_dtype == "fp8_ds_mla":
        scales = r // 128
        layout = (f"fp8_ds_mla records: {r} e4m3 latent bytes, {scales} float32 scale{'s' * (scales > 1)}, "
                  f"{p} bf16 rope values")
    else:
        layout = f"auto: {r} + {p} values in {str(model.dtype).removeprefix('torch.')}"
    return f"MLA cache ({layout}): {total // layers} bytes per token per layer, {total} in all {layers} layers"


def _size(nbytes: float) -> str:
    """Bytes in B, KiB, MiB or GiB (the largest unit that keeps the number >= 1)."""
    units, power = ("B", "KiB", "MiB", "GiB"), 0
    while nbytes >= 1024 and power < len(units) - 1:
        nbytes /= 1024
        power += 1
    return f"{nbytes:.0f} B" if power == 0 else f"{nbytes:.1f} {units[power]}"


def _picks_equal(tokens: torch.Tensor | None, reference: torch.Tensor) -> str:
    if tokens is None:
        return "-"
    equal = int((tokens == reference).sum())
    return f"{equal}/{tokens.numel()} ({equal / tokens.numel():.0%})"


def format_cache_comparison(runs: Sequence[Any]) -> str:
    """`--compare-caches`' table: per cache kind, the MLA cache's bytes per token (a layer,
    all layers) and its size at max_model_len x max_batch tokens; per (mode, batch), each
    cache's median step ms, their ratio, and how many of the fp8_ds_mla run's greedy picks
    equal the bf16 run's (both fed the bf16 run's picks). `runs`: the bf16 run, then fp8_ds_mla."""
    base, other = runs
    layers = _config(base.model).num_layers
    tokens = base.model.max_model_len * base.model.max_batch
    lines = [
        f"KV cache comparison: same weights and prompts; every {other.kind} row is fed the {base.kind} run's picks",
        f"{'cache':<17} {'bytes/token/layer':<18} {f'bytes/token ({layers} layers)':<24} "
        f"cache at max_model_len x max_batch ({base.model.max_model_len} x {base.model.max_batch})",
    ]
    base_bytes = base.model.cache_bytes_per_token()
    for run in runs:
        per_token = run.model.cache_bytes_per_token()
        ratio = "" if run is base else f" ({per_token / base_bytes:.2f}x)"
        name = f"{run.kind} ({str(run.model.dtype).removeprefix('torch.')})" if run.kind == "auto" else run.kind
        lines.append(f"{name:<17} {per_token // layers:<18} {per_token:<24} {_size(per_token * tokens)}{ratio}")
    ref_modes = sorted({mode for mode, _ in base.fed.values()})
    header = (f"{'mode':<15} {'batch':<5} {f'{base.kind} ms':<9} {f'{other.kind} ms':<14} {'ratio':<6} "
              f"{other.kind} picks = {base.kind} {'/'.join(ref_modes)}'s")
    lines += ["", header, "-" * len(header)]
    by_mode = {(r.mode, r.batch): r for r in other.rows}
    for r in base.rows:
        o = by_mode[(r.mode, r.batch)]
        if r.step_ms is None or o.step_ms is None:
            lines.append(f"{r.mode:<15} {r.batch:<5} {r.note or o.note}")
            continue
        agree = _picks_equal(o.tokens, base.fed[r.batch][1])
        lines.append(f"{r.mode:<15} {r.batch:<5} {r.step_ms:<9.3f} {o.step_ms:<14.3f} "
                     f"{o.step_ms / r.step_ms:<6.2f} {agree}")
    lines += [
        "",
        "bytes: the latent MLA cache only (the indexer's fp8 keys are the same for both). ms: median step, as",
        f"  above. picks: the {other.kind} run's greedy picks equal to the {base.kind} run's at the same",
        "  positions (teacher forcing). e4m3 rounds each latent value by up to 2^-4 of it; a pick flips where",
        "  the top two logits are closer than that moves them (README, \"FP8 MLA cache\").",
    ]
    return "\n".join(lines)


def plot_rows(rows: Sequence[Row], path: str, title: str = "graphsafe demo") -> None:
    """Step latency per mode against the batch size, to `path` (png, svg, pdf...)."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    kinds = [k for k in KV_CACHES if any(r.kv_cache == k for r in rows)]
    for kind in kinds:
        for mode in MODES:
            points = sorted((r.batch, r.step_ms) for r in rows
                            if r.mode == mode and r.kv_cache == kind and r.step_ms is not None)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", linestyle="-" if kind == kinds[0] else "--",
                        label=mode if len(kinds) == 1 else f"{mode}, {kind} cache")
    ax.set_xscale("log", base=2)
    batches = sorted({r.batch for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size")
    ax.set_ylabel("step latency, median (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--model`: ints, floats, true/false, else the string."""
    if "=" not in text:
        raise DemoError(f"--model expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def exit_code(rows: Sequence[Row]) -> int:
    """1 when a mode failed, or when graph replays gave other tokens than the compiled
    step they captured; else 0. Compiled tokens may legitimately drift from eager's
    (fused bf16 arithmetic can flip a near-tie in the argmax): the table reports it."""
    bad = [r for r in rows if not r.ok or r.agree.endswith("= compiled: NO")]
    return 1 if bad else 0


__all__ = [
    "MODES", "KV_CACHES", "DemoError", "DemoOptions", "Row", "Progress", "default_options", "run_demo",
    "format_table", "format_cache_comparison", "plot_rows", "parse_override", "exit_code",
]
