"""Measuring the demo's decode steps: syncs and allocations per step, progress, greedy
picks with their near-ties, and one mode's run of prefill + decode (see graphsafe.demo)."""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, TextIO

import torch

from graphsafe.demo.options import DemoOptions, Row, measured_steps


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
    timed = measured_steps(opts)
    for i in range(opts.steps):
        measured = i in timed
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
    measured = times[measured_steps(opts).start:]
    row.step_ms = 1e3 * statistics.median(measured)
    row.tokens_per_s = row.batch / (row.step_ms / 1e3)
    if fwd.cuda:
        n = len(measured)
        row.syncs_fwd, row.syncs_step = fwd.syncs / n, whole.syncs / n
        row.allocs_fwd, row.allocs_step = fwd.allocs / n, whole.allocs / n


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
