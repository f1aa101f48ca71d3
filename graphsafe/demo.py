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
) -> tuple[list[float], _Counters, _Counters, torch.Tensor]:
    """Prefill `prompts`, then `opts.steps` greedy steps through `step`. Returns the step
    times (s), the counters of the measured steps (forward only, whole step), and each
    step's greedy picks and near-tie flags (`greedy_with_near_ties`), each `[steps, batch]`
    on the CPU. With `forced` (eager's picks), step i + 1 is fed `forced[i]` instead of
    this run's own pick (teacher forcing)."""
    state = model.new_state()
    tokens = model.prefill(state, prompts).argmax(-1)
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
    logits are `max_model_len` wide, so a tight bound keeps the step honest and small)."""
    return {"max_batch": max(opts.batches), "max_model_len": opts.prompt_len + opts.steps, **opts.model_overrides}


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
    `model_sizes(opts)`."""
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

        def make(**extra: Any) -> Any:
            if build is None:
                return _build_default(device, dtype=opts.dtype, seed=opts.seed, **model_sizes(opts), **extra)[0]
            return build(device, dtype=opts.dtype, seed=opts.seed, **opts.model_overrides, **extra)[0]

        reference = None if tp is None else make()
        model = make() if tp is None else make(tp=tp)
        build_s = time.perf_counter() - t0
        rows = _Run(model, opts, device, reference).rows()
    finally:
        torch.set_num_threads(previous_threads)
    if tp is not None:
        return _report_ranks(rows, opts, device, build_s, model, tp, out)
    print(format_table(rows, opts, device, build_s, model), file=out)
    if opts.plot:
        plot_rows(rows, opts.plot, title=f"graphsafe demo on {_device_name(device)}")
        print(f"plot written to {opts.plot}", file=out)
    return rows


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
    if not opts.batches or min(opts.batches) < 1 or opts.steps < 1 or opts.prompt_len < 1:
        raise DemoError("batch sizes, steps and the prompt length must be positive")
    if opts.plot:
        check_plot_available()  # before any work


class _Run:
    """The rows of one demo run: every mode (outer) at every batch size (inner), so
    eager's picks exist when the compiled modes of that batch run."""

    def __init__(self, model: Any, opts: DemoOptions, device: torch.device, reference: Any = None) -> None:
        self.model, self.opts, self.device = model, opts, device
        # A one-device model of the same weights (tensor parallel): its eager picks are the
        # reference every mode (eager included) is fed and compared with.
        self.reference = reference
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
                f"{mode} B={batch}", forced=self.eager_picks.get(batch),
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
                 model: Any = None, legend: bool = True) -> str:
    """The demo's table: one line per (mode, batch), then what the columns mean."""
    lines = [
        f"graphsafe demo on {_device_name(device)}: prompt {opts.prompt_len} tokens, {opts.steps} greedy steps "
        f"(median over steps {min(opts.warmup, opts.steps - 1) + 1}..{opts.steps}), compile backend "
        f"{opts.backend}, model built in {build_s:.1f} s",
    ]
    if model is not None:
        lines.append(f"model: {_describe(model)}")
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


def plot_rows(rows: Sequence[Row], path: str, title: str = "graphsafe demo") -> None:
    """Step latency per mode against the batch size, to `path` (png, svg, pdf...)."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in MODES:
        points = sorted((r.batch, r.step_ms) for r in rows if r.mode == mode and r.step_ms is not None)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=mode)
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
    "MODES", "DemoError", "DemoOptions", "Row", "Progress", "default_options", "run_demo", "format_table",
    "plot_rows", "parse_override", "exit_code",
]
