"""Launch geometry and scratch sizes of the Triton top-k, and the aiter adapter's
scratch, from shapes only (no triton import: the registry reads each backend's worst
case through `workspace_specs*` without loading a backend). See triton.py for the
algorithm these numbers serve.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

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


# -- the one-launch decode kernel (triton_rowwise.py) --------------------------------
@dataclass(frozen=True)
class RowwisePlan:
    """Geometry of the one-program-a-row decode kernel (triton_rowwise.py)."""

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


def rowwise_applies(rows: int, width: int, topk: int) -> bool:
    """Decode only (its scratch a row is larger than the two-launch plan's, and prefill
    calls have many rows). topk up to half the regions' slots."""
    return (rows >= ROWWISE_MIN_ROWS or width <= ROWWISE_ANY_ROWS_WIDTH) and 0 < topk <= ROWWISE.slots // 2


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


@dataclass(frozen=True)
class Plan:
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
def choose(
    rows: int, width: int, topk: int, p1: int | None = None, reg: int | None = None,
    margin: float = MARGIN, max_slots: int = MAX_SLOTS,
) -> Plan:
    """The plan of one call; `p1`/`reg`/`margin`/`max_slots` override it (tests)."""
    if p1 is None:
        p1_min, p1_max = _p1_range(width, topk)
        p1 = max(p1_min, min(p1_max, pow2(-(-TARGET_PROGRAMS // max(rows, 1)))))
    p1 = pow2(p1)
    g, bj, dp = _geometry(width, topk, p1)
    reg = pow2(reg) if reg is not None else _reg(width, topk, p1, g, margin)
    return Plan(p1=p1, g=g, bj=bj, dp=dp, reg=reg, margin=float(margin), max_slots=max_slots)


@functools.lru_cache(maxsize=256)
def _row_need(width: int, topk: int) -> tuple[int, int]:
    """(programs, slots) per row that any row count's plan may use: the worst case."""
    p1_min, p1_max = _p1_range(width, topk)
    p1s, caps = [], []
    p1 = p1_min
    while p1 <= p1_max:
        plan = choose(1, width, topk, p1=p1)
        p1s.append(plan.p1)
        caps.append(plan.cap)
        p1 *= 2
    return max(p1s), max(caps)


def specs(rows: int, p1: int, cap: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-program state [rows, p1, NMETA] int32; candidates [rows, cap] int64 (P1
    regions of REG slots; a slot holds key << 32 | position)."""
    return [((rows, max(p1, 1), NMETA), torch.int32), ((rows, max(cap, 1)), torch.int64)]


def workspace_specs_decode(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Decode's worst case: the two-launch plans' or the one-launch kernel's, whichever
    is larger a row (the same for every row count, so the bytes grow linearly with rows)."""
    specs_ = workspace_specs(num_rows, width, topk)
    if num_rows <= 0 or not rowwise_applies(max(num_rows, ROWWISE_MIN_ROWS), width, topk):
        return specs_
    (meta_shape, _), (cand_shape, _) = specs_
    return specs(num_rows, max(meta_shape[1], ROWWISE.warps), max(cand_shape[1], ROWWISE.slots))


def workspace_specs(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of one call with `num_rows` rows of `width` logits (the worst case is the need).

    Sized for the largest plan any row count could pick, so the bytes grow linearly with
    the rows (the indexer's prefill chunking searches on that)."""
    if num_rows <= 0 or width <= 0 or topk <= 0:
        return specs(max(num_rows, 0), 1, 1)
    p1, cap = _row_need(width, topk)
    return specs(num_rows, p1, cap)


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
