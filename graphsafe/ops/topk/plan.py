"""The top-k decision, made once per call signature: `choose_top_k_per_row_prefill(call)`
and `choose_top_k_per_row_decode(call)` -> `TopkChoice` (which Triton kernel runs: none,
a fill of -1, the one-launch row-wise decode kernel or the two-launch bound + final
plan; its geometry, warps and block sizes; the scratch it takes), and the aiter adapter's
(`choose_aiter_*` -> `AiterTopkChoice`: whether aiter writes `indices` directly, its
scratch).

The worst-case workspace of a call from shapes (`workspace_specs*`, the backends'
records) is the largest scratch over the same candidates `choose` picks from (every
row count's two-launch plan, and for decode the one-launch kernel), and a choice takes
exactly that worst case from the workspace: sizing and launch cannot disagree.

Pure Python, no triton import (the registry reads the worst case without loading a
backend's kernels). kernels/triton_two_launch.py and kernels/triton_rowwise.py describe
the algorithms these numbers serve.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from graphsafe.device_info import is_hip

# Width (elements) of the granule a bound program owns: 64 B, one DRAM burst, so the
# programs of a row split each burst-aligned block of the row without sharing bursts.
SEGW = 16
# Elements a bound program holds in registers (64 per thread with 8 warps).
MAX_TILE = 16384
# Candidate slots the final program selects among in registers; more go through the
# looped radix select.
MAX_SLOTS = 8192
# Bound programs wanted per call; rows x programs per row. Fewer, larger programs won on
# an H200 (128 rows: 2 programs a row at 32K, 8 at 128K, where MAX_TILE sets the floor):
# every program adds a margin of candidates, and the final selection's time grows with
# them (benchmarks/NOTES.md, "Top-k").
TARGET_PROGRAMS = 256
# Strided columns of a row per top-k entry (G = COLS_PER_TOPK * pow2(topk)): the bound
# ranks column maxima, so fewer columns mean a cheaper search over them (at 32K wide rows
# 8 columns per entry left only two entries a column) and a few more candidates.
COLS_PER_TOPK = 4
# A program's share of the row's top-k is about mu = topk * its entries / the row's
# entries; its bound ranks mu + MARGIN*sqrt(mu) + 2 column maxima, so the bound lies above
# the row's k-th largest score (and the final program falls back to the slow exact
# select over the row) only when the program holds more than MARGIN standard deviations
# above its share (scores drawn independently; when scores come in clumps of c equal
# values, about MARGIN/sqrt(c) of them: 3 at c = 16, ~0.5% of rows).
MARGIN = 12.0
# More programs per row only while each holds >= this many top-k entries on average: the
# margin costs MARGIN/sqrt(mu) of extra candidates (53% at 512); 128K-wide rows need 8
# programs anyway (MAX_TILE), and 2048 / 8 = 256 (75%).
MIN_SHARE = 512
# Per-row state of a bound program: [bound key bits, #(key > bound), #(key == bound), pad].
NMETA = 4
# Block of the looped paths (radix rounds over a list or a row, the short-row writes).
LBLOCK = 1024


# -- the one-launch decode kernel (kernels/triton_rowwise.py) ------------------------
@dataclass(frozen=True)
class RowwisePlan:
    """Geometry of the one-program-a-row decode kernel (kernels/triton_rowwise.py)."""

    z: float = 4.0  # the bound sits Z sigma (+2 samples) past the expected rank
    # The second pass's, after too few entries were kept: further out, not so far that
    # its share overflows a region (10 sigma overflowed a row's 256-slot regions at 32K).
    retry_z: float = 6.0
    samples_per_thread: int = 4  # S = 32 * warps * this
    per_thread: int = 16  # entries a thread sorts out per step (a multiple of 4)
    # Each warp's region. 512: rows with clumps of 16 equal scores put ~170 +- 55 entries
    # in a warp at 32K and up to ~350 at 128K; the selection reads the lower halves only
    # when every warp's entries fit there.
    slots_per_warp: int = 512
    warps: int = 16

    @property
    def slots(self) -> int:
        return self.warps * self.slots_per_warp


# The one-launch kernel holds a row an SM. On an H100 it was faster than the two-launch
# plan at every decode shape measured from 32 rows (32 x 131072: 28.8 against 31.0 us;
# 256 rows: half the time), and at every row count for rows up to 32K wide; with a
# single row of 128K the two-launch plan, which spreads a row over several SMs, wins
# (21.6 against 28.0 us). benchmarks/NOTES.md, "Top-k in one launch".
ROWWISE_MIN_ROWS = 32
ROWWISE_ANY_ROWS_WIDTH = 32768


# The one-launch kernel's plans: 8 entries a thread a step up to 32K-wide rows, 16
# beyond. H100, 128 random rows, us with 8 / 16 (benchmarks/NOTES.md, "Top-k: a
# thread's own slots"): 32768: 15.5 / 16.1; 65536: 20.5 / 20.4; 131072: 41.6 / 37.7.
ROWWISE = RowwisePlan()
ROWWISE_NARROW = RowwisePlan(per_thread=8)
ROWWISE_NARROW_WIDTH = 32768


def rowwise_plan(width: int) -> RowwisePlan:
    """The one-launch plan for rows `width` wide (from the shape alone: graph-safe)."""
    return ROWWISE_NARROW if width <= ROWWISE_NARROW_WIDTH else ROWWISE


def rowwise_serves(topk: int) -> bool:
    """Whether the one-launch kernel serves this topk at some row count: up to half the
    regions' slots."""
    return 0 < topk <= ROWWISE.slots // 2


def rowwise_applies(rows: int, width: int, topk: int) -> bool:
    """Decode only (its scratch a row is larger than the two-launch plan's, and prefill
    calls have many rows): from ROWWISE_MIN_ROWS rows, or any rows up to
    ROWWISE_ANY_ROWS_WIDTH wide."""
    return (rows >= ROWWISE_MIN_ROWS or width <= ROWWISE_ANY_ROWS_WIDTH) and rowwise_serves(topk)


def pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def pow2_floor(n: int) -> int:
    """The largest power of two <= max(n, 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def bound_rank(topk: int, p1: int, n_c: int, n: int, margin: float = MARGIN) -> int:
    """Column maxima a bound program ranks (mirrors the kernel; n_c of the row's n entries)."""
    if p1 == 1:
        return topk
    mu = topk * n_c / n
    return int(mu + margin * math.sqrt(mu)) + 2


def slack(kc: int) -> int:
    """The bound search stops once at most kc + slack(kc) column maxima lie above it."""
    return kc // 16 + 1


# -- the two-launch plan (kernels/triton_two_launch.py) ------------------------------
@dataclass(frozen=True)
class Plan:
    """Geometry of the two-launch plan: P1 bound programs a row, then one final program."""

    p1: int  # bound programs per row
    g: int  # strided columns of a row (G); program c owns the SEGW-granules g with g % p1 == c
    bj: int  # columns per program (g // p1)
    dp: int  # G-rows per program tile (power of two >= ceil(width / g))
    reg: int  # candidate slots per program
    margin: float
    max_slots: int

    @property
    def cap(self) -> int:
        return self.p1 * self.reg

    @property
    def in_registers(self) -> bool:
        return self.cap <= self.max_slots

    @property
    def tile(self) -> int:
        return self.dp * self.bj


def _geometry(width: int, topk: int, p1: int) -> tuple[int, int, int]:
    wp = pow2(width)
    g = max(min(max(COLS_PER_TOPK * pow2(topk), 256), wp), SEGW * p1)
    bj = g // p1
    dp = pow2(-(-width // g))
    return g, bj, dp


def _reg(width: int, topk: int, p1: int, g: int, margin: float) -> int:
    """Slots for what one program of a full-width row keeps, with room to spare.

    A program keeps its entries >= its bound: kc..kc+slack column maxima and the other
    entries of those columns above the bound. With f = (kc+slack)/columns of the
    program's columns selected and D entries per column, random rows keep about
    per * (1 - (1-f)^(1/D)) entries (per = the program's entries); the extra entries
    beyond the maxima vary little (a few times their square root).
    """
    per = -(-width // p1)
    kc = bound_rank(topk, p1, per, width, margin)
    kh = kc + slack(kc)
    ncols = g // p1 if width >= g else per
    if kh >= ncols:
        expect = float(per)
    else:
        depth = max(width / g, 1.0)
        expect = per * (1.0 - (1.0 - kh / ncols) ** (1.0 / depth))
    reg = pow2(math.ceil(expect + 6.0 * math.sqrt(max(expect - kc, 1.0)) + 16))
    return max(1, min(reg, pow2(per)))


def _p1_range(width: int, topk: int) -> tuple[int, int]:
    p1_min = max(1, pow2(width) // MAX_TILE)
    p1_max = max(p1_min, pow2_floor(max(topk // MIN_SHARE, 1)))
    return p1_min, p1_max


@functools.lru_cache(maxsize=1024)
def two_launch_plan(
    rows: int, width: int, topk: int, p1: int | None = None, reg: int | None = None,
    margin: float = MARGIN, max_slots: int = MAX_SLOTS,
) -> Plan:
    """The two-launch plan of `rows` rows; `p1`/`reg`/`margin`/`max_slots` override it (tests)."""
    if p1 is None:
        p1_min, p1_max = _p1_range(width, topk)
        p1 = max(p1_min, min(p1_max, pow2(-(-TARGET_PROGRAMS // max(rows, 1)))))
    p1 = pow2(p1)
    g, bj, dp = _geometry(width, topk, p1)
    reg = pow2(reg) if reg is not None else _reg(width, topk, p1, g, margin)
    return Plan(p1=p1, g=g, bj=bj, dp=dp, reg=reg, margin=float(margin), max_slots=max_slots)


def search_columns(n: int, warps: int) -> int:
    """Columns of `_radix_search`'s [n / SC, SC] view: one a thread (its rows then lie in
    the thread's registers), and few enough that a column holds at most 255 keys."""
    sc = min(n, 32 * warps)
    while n // sc > 255:
        sc *= 2
    return sc


def bound_warps(plan: Plan) -> int:
    """64 of the tile's entries a thread (they stay in registers from load to store):
    8 warps for a [4, 4096] tile. On an H200, 16 warps of 32 entries ran 1.1-1.6x
    slower. (Smaller tiles, i.e. more programs a row, shorten this launch but add
    candidates, and the final selection then takes longer: TARGET_PROGRAMS.)"""
    return max(1, min(16, plan.tile // 2048))


def final_warps(plan: Plan) -> int:
    """8 warps for the 4K-8K candidate slots of 32K-128K-wide decode rows (16 a thread at
    8K): on an H200, 4, 16 or 32 warps took 1.05-1.75x as long."""
    return max(1, min(8, min(plan.cap, plan.max_slots) // 512))


# -- the decision -------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _candidates(width: int, topk: int, decode: bool) -> tuple[tuple[int, int], ...]:
    """(programs, slots) a row of every kernel configuration `choose` may pick for rows
    `width` wide, whatever the row count: the two-launch plan at each program count P1 in
    its range, and for decode the one-launch kernel's plan."""
    p1_min, p1_max = _p1_range(width, topk)
    need = []
    p1 = p1_min
    while p1 <= p1_max:
        plan = two_launch_plan(1, width, topk, p1=p1)
        need.append((plan.p1, plan.cap))
        p1 *= 2
    if decode and rowwise_serves(topk):
        cfg = rowwise_plan(width)
        need.append((cfg.warps, cfg.slots))
    return tuple(need)


def row_need(width: int, topk: int, decode: bool) -> tuple[int, int]:
    """(programs, slots) a row that covers every candidate: the worst case."""
    need = _candidates(width, topk, decode)
    return max(p for p, _ in need), max(s for _, s in need)


def specs(rows: int, p1: int, cap: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-program state [rows, p1, NMETA] int32; candidates [rows, cap] int64 (P1
    regions of REG slots; a slot holds key << 32 | position)."""
    return [((rows, max(p1, 1), NMETA), torch.int32), ((rows, max(cap, 1)), torch.int64)]


def scratch_specs(num_rows: int, width: int, topk: int, decode: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of one call with `num_rows` rows of `width` logits: sized for the largest
    candidate (`row_need`), so the bytes grow linearly with the rows (the indexer's
    prefill chunking searches on that), and it is what every call takes."""
    if num_rows <= 0 or width <= 0 or topk <= 0:
        return specs(max(num_rows, 0), 1, 1)
    return specs(num_rows, *row_need(width, topk, decode))


def workspace_specs(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton backend's worst case of a prefill call (its record's `workspace`)."""
    return scratch_specs(num_rows, width, topk, False)


def workspace_specs_decode(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton backend's worst case of a decode call: the two-launch plans' or the
    one-launch kernel's, whichever is larger a row."""
    return scratch_specs(num_rows, width, topk, True)


@dataclass(frozen=True)
class TopkChoice:
    """What the Triton backend runs for one call signature.

    `kernel`: "none" (no row, or no column of `indices`: nothing to write), "fill"
    (topk or the width is 0: -1 everywhere), "rowwise" (decode in one launch, `rowwise`
    its geometry) or "two_launch" (`plan` its geometry, the launches' warps and search
    views). `scratch`: the `(meta, cand)` specs it takes from the workspace (None for
    "none" and "fill"): the signature's worst case (`scratch_specs`), or more when a
    forced plan needs it (tests)."""

    kernel: str
    decode: bool
    rowwise: RowwisePlan | None = None
    plan: Plan | None = None
    bound_warps: int = 0
    final_warps: int = 0
    bound_columns: int = 0  # `_radix_search`'s view in the bound launch (`search_columns`)
    final_columns: int = 0  # and in the final one
    lblock: int = LBLOCK
    scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None

    @property
    def programs(self) -> int:
        """Per-program (or per-warp) state records a row."""
        return self.rowwise.warps if self.rowwise is not None else self.plan.p1

    @property
    def slots(self) -> int:
        """Candidate slots a row."""
        return self.rowwise.slots if self.rowwise is not None else self.plan.cap


def _scratch(rows: int, width: int, topk: int, decode: bool, programs: int, slots: int):
    specs_ = scratch_specs(rows, width, topk, decode)
    if specs_[0][0][1] < programs or specs_[1][0][1] < slots:
        specs_ = specs(rows, programs, slots)  # a forced plan larger than any candidate (tests)
    return tuple(specs_)


@functools.lru_cache(maxsize=1024)
def choose(
    rows: int, width: int, topk: int, cols: int, decode: bool, rocm: bool = False,
    p1: int | None = None, reg: int | None = None, margin: float | None = None, max_slots: int | None = None,
    rowwise: bool | RowwisePlan | None = None,
) -> TopkChoice:
    """The choice for `rows` rows of `width` logits into `cols` columns of indices.
    The keyword overrides force plans and paths (tests and tuning): `p1`/`reg`/`margin`/
    `max_slots` a two-launch plan, `rowwise` True/False (or a `RowwisePlan`) the one-launch
    decode kernel in or out."""
    if rows == 0 or cols == 0:
        return TopkChoice("none", decode)
    if topk == 0 or width == 0:
        return TopkChoice("fill", decode)
    if rowwise is None:
        # Not when a two-launch plan is forced, nor on ROCm: the one-launch kernel's
        # ballots, loads and stores are PTX (its portable path, reshapes and prefix sums,
        # is for the interpreter and has not run on an AMD GPU).
        forced = any(v is not None for v in (p1, reg, margin, max_slots))
        rowwise = not forced and not rocm and rowwise_applies(rows, width, topk)
    if decode and rowwise:
        cfg = rowwise if isinstance(rowwise, RowwisePlan) else rowwise_plan(width)
        return TopkChoice("rowwise", decode, rowwise=cfg,
                          scratch=_scratch(rows, width, topk, decode, cfg.warps, cfg.slots))
    plan = two_launch_plan(
        rows, width, topk, p1=p1, reg=reg,
        margin=MARGIN if margin is None else float(margin),
        max_slots=MAX_SLOTS if max_slots is None else int(max_slots),
    )
    # Counts of a program's tile and of the final register block are packed in 16 bits.
    assert plan.tile < 65536 and (not plan.in_registers or plan.cap < 65536), plan
    bw, fw = bound_warps(plan), final_warps(plan)
    return TopkChoice(
        "two_launch", decode, plan=plan, bound_warps=bw, final_warps=fw,
        bound_columns=search_columns(plan.bj, bw), final_columns=search_columns(plan.cap, fw),
        lblock=min(LBLOCK, pow2(max(width, plan.cap))),
        scratch=_scratch(rows, width, topk, decode, plan.p1, plan.cap),
    )


def _on_rocm(device: torch.device) -> bool:
    return is_hip(device)


def choose_top_k_per_row_prefill(call, **overrides) -> TopkChoice:
    """The Triton backend's choice for a `top_k_per_row_prefill` call (overrides: `choose`)."""
    rows, width = call.logits.shape
    return choose(rows, width, call.topk, call.indices.shape[1], False, _on_rocm(call.logits.device), **overrides)


def choose_top_k_per_row_decode(call, **overrides) -> TopkChoice:
    """The Triton backend's choice for a `top_k_per_row_decode` call (overrides: `choose`)."""
    rows, width = call.logits.shape
    return choose(rows, width, call.topk, call.indices.shape[1], True, _on_rocm(call.logits.device), **overrides)


# -- the aiter adapter (aiter.py) ----------------------------------------------------
def aiter_workspace_specs(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Prefill through aiter: the clipped row bounds (lo, hi) int32 [rows] each, and the
    contiguous [rows, topk] block aiter writes when `indices` cannot take it (the worst
    case)."""
    rows, k = max(int(num_rows), 0), max(int(topk), 0)
    return [((rows,), torch.int32), ((rows,), torch.int32), ((rows, k), torch.int32)]


def aiter_workspace_specs_decode(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Decode through aiter: the clipped row ends int32 [rows], and the contiguous
    [rows, topk] block aiter writes when `indices` cannot take it (the worst case)."""
    rows, k = max(int(num_rows), 0), max(int(topk), 0)
    return [((rows,), torch.int32), ((rows, k), torch.int32)]


@dataclass(frozen=True)
class AiterTopkChoice:
    """What the aiter adapter runs for one call signature. `direct`: aiter's dense
    `[rows, topk]` block is `indices` itself (contiguous, `topk` columns); else aiter
    writes into scratch and a small kernel copies it over. `scratch`: the specs it takes
    from the workspace (the worst case, less the block when direct)."""

    direct: bool
    scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...]


def _aiter_direct(indices: torch.Tensor, topk: int) -> bool:
    return indices.shape[1] == topk and indices.is_contiguous()


def choose_aiter_top_k_per_row_prefill(call) -> AiterTopkChoice:
    rows, width = call.logits.shape
    direct = _aiter_direct(call.indices, call.topk)
    return AiterTopkChoice(direct, tuple(aiter_workspace_specs(rows, width, call.topk)[: 2 if direct else 3]))


def choose_aiter_top_k_per_row_decode(call) -> AiterTopkChoice:
    rows, width = call.logits.shape
    direct = _aiter_direct(call.indices, call.topk)
    return AiterTopkChoice(direct, tuple(aiter_workspace_specs_decode(rows, width, call.topk)[: 1 if direct else 2]))
