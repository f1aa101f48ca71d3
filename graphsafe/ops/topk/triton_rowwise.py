"""Decode top-k of long rows, first launch: one program a row collects every entry at or
above a bound taken from a sample of the row; `triton._final_kernel` then selects among
them (triton.py's `_launch_rowwise`; chosen by `plan.rowwise_applies`).

The two-launch plan of triton.py splits a row over several programs, each finding its
own bound by a radix search over column maxima and placing its kept entries with
CTA-wide scans: chains of CTA-wide steps, not memory-bound (benchmarks/NOTES.md,
"Top-k"). With about as many rows as SMs, one program a row needs no per-program bound,
and its pass over the row has no CTA-wide step:

A. Sample (`_sample_bound`). S positions spread evenly over the row's valid range. With
   p = topk / n, about mu = p * S samples lie at or above the row's topk-th largest key,
   give or take sigma = sqrt(S p (1 - p)). The bound `vlo` is a sample key with about
   mu + Z sigma + 2 samples at or above it (a radix select over the samples: three
   rounds of a 32-bin `tl.histogram`): at least topk entries of the row lie at or above
   it unless the sample is off by more than Z sigma.
B. Collect (`_collect`). The row in [E, 32 * warps] tiles (entry (e, t) in register e of
   thread t); every entry >= vlo goes to its warp's region of the scratch (key << 32 |
   position). A warp places its entries with one ballot a register (`vote.ballot` and
   `popc`, inline PTX; a reshape-and-cumsum emulation in the interpreter): no shuffles,
   no shared memory, no CTA-wide step. When the sample saw ties at the bound, entries
   == vlo go to the top of the region instead, so a run of equal scores cannot crowd out
   a larger one.
C. If fewer than topk entries were kept, or a region overflowed, the pass runs once
   more with the bound RETRY_Z sigma out (too few) or Z/2 in (overflow).

Each warp's region is one "program" of `_final_kernel` (bound vlo, #entries above, #ties
at the top: EQ_AT_TOP): it checks that the regions hold >= topk entries >= the bound,
selects among them, and falls back to the exact select over the row when they do not
(both passes failed). Rows with at most topk valid entries are left to `_final_kernel`,
which writes them without data. Nothing is zeroed, no atomics; the regions' order is
fixed (warp, then position), so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.ops.topk.plan import NMETA
from graphsafe.ops.topk.triton import _row_bounds, _sortable_key

_NMETA = tl.constexpr(NMETA)


@triton.jit
def _sample_bound(row_ptr, lo, n, topk, S: tl.constexpr, Z):
    """vlo: about the largest sample key with mu + Z sigma + 2 samples at or above it,
    from a radix select over the S samples: three rounds of a 32-bin histogram
    (`tl.histogram`: ballots) of the next 5 key bits. A 15-bit prefix is enough: vlo is
    the smallest sample key that shares or exceeds it (a few more candidates, never
    fewer)."""
    q = n // S
    rem = n - q * S
    j = tl.arange(0, S)
    skey = _sortable_key(tl.load(row_ptr + lo + j * q + (j * rem) // S))
    p = topk.to(tl.float32) / n.to(tl.float32)
    mu = p * S
    need = tl.minimum((mu + Z * tl.sqrt(mu * (1.0 - p))).to(tl.int32) + 2, S)
    bins = tl.arange(0, 32)
    prefix = tl.full([], 0, tl.uint32)
    for d in tl.static_range(3):
        SHIFT = 27 - 5 * d
        if d == 0:
            m = skey >= 0
        else:
            m = (skey >> (SHIFT + 5)) == (prefix >> (SHIFT + 5))
        hist = tl.histogram(((skey >> SHIFT) & 31).to(tl.int32), 32, mask=m)
        # The digit: the largest bin whose suffix count still reaches `need` (0 if none).
        digit = tl.max(tl.where(tl.cumsum(hist, 0, reverse=True) >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << SHIFT)
    # The smallest sample key in the prefix's range (the prefix's low edge would split a
    # run of equal keys, ties of the sample, into "above" and "tied"); at least 1, as
    # key 0 means "no key" (masked entries).
    vlo = tl.maximum(tl.min(tl.where(skey >= prefix, skey, 0xFFFFFFFF), axis=0), 1)
    # Ties at the bound in the sample: the row likely holds a run of them.
    return vlo, tl.sum((skey == vlo).to(tl.int32), axis=0) > 1


@triton.jit
def _load_keys(ptrs, mask, ASM: tl.constexpr):
    """Keys of the floats at `ptrs` (0 where masked off). On a GPU the load is PTX: a
    `tl.load` gets the layout Triton picks for loads (vector runs a thread), and every
    scattered store after it then shuffles its operands through shared memory; an
    elementwise asm keeps the pointers' one-entry-a-thread layout."""
    if ASM:
        bits = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.L1::no_allocate.b32 $0, [$1]; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
        return tl.where(mask, _sortable_key(bits.to(tl.float32, bitcast=True)), 0)
    else:
        return tl.where(mask, _sortable_key(tl.load(ptrs, mask=mask, other=0.0)), 0)


@triton.jit
def _warp_rank(flag, E: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """For an [E, T] tile whose entry (e, t) thread t holds: (rank, total) with rank = #
    entries (e, t') of t's warp with t' < t and the flag set, total = # in the warp.

    On a GPU one ballot a register (`vote.ballot` + `popc`): no shuffles, no shared
    memory. The tile must then have the layout with entry (e, t) in register e of
    thread t (Triton's default for [E, 32 * warps]; checked by the sm_90 compile test)."""
    if ASM:
        rank, total = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 b, m; setp.ne.b32 p, $2, 0; vote.sync.ballot.b32 b, p, 0xffffffff; "
            "mov.b32 m, %lanemask_lt; and.b32 m, m, b; popc.b32 $0, m; popc.b32 $1, b; }",
            "=r,=r,r", [flag.to(tl.int32)], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return rank, total
    else:
        f = tl.reshape(flag.to(tl.int32), [E, T // 32, 32])
        rank = tl.cumsum(f, 2) - f
        total = tl.broadcast_to(tl.sum(f, 2)[:, :, None], [E, T // 32, 32])
        return tl.reshape(rank, [E, T]), tl.reshape(total, [E, T])


@triton.jit
def _collect(row_ptr, lo, hi, shift, vlo, ties, regions, E: tl.constexpr, T: tl.constexpr, CAPW: tl.constexpr,
             ASM: tl.constexpr):
    """One pass over the row into the warps' CAPW-slot regions (key << 32 | position).
    Returns [T] tensors, each lane its warp's: (#entries above, #ties still in the region).

    Without `ties`, every entry >= vlo goes up from the bottom of its warp's region (one
    ballot a register). With `ties` (the sample saw a run of equal keys at the bound, or
    a first pass overflowed): entries > vlo go up from the bottom, entries == vlo down
    from the top while they stay above every larger entry placed so far, so a run of
    ties cannot crowd out a larger key and a region need not hold the run (a later larger
    key may overwrite a tie). A uniform branch a step: one loop body for both.

    A step is an [E, T] tile, entry (e, t) at position base + e*T + t (thread t, register
    e). A warp ranks its entries with ballots, register by register: the warps need no
    CTA-wide step. The next tile is loaded before the current one is sorted out."""
    CH: tl.constexpr = E * T
    tile = tl.arange(0, E)[:, None] * T + tl.arange(0, T)[None, :]
    region = (tl.arange(0, T) // 32) * CAPW
    n_gt = tl.zeros([T], dtype=tl.int32)
    n_eq = tl.zeros([T], dtype=tl.int32)  # ties seen
    eq_room = tl.zeros([T], dtype=tl.int32) + CAPW  # ties stored: slots [eq_room, CAPW)
    ties = ties & (vlo < 0xFFFFFFFF)
    above = tl.where(ties, vlo + 1, vlo)  # entries that go up from the bottom: key >= above
    base = (lo // 16) * 16
    pos = base + tile
    key = _load_keys(row_ptr + pos, (pos >= lo) & (pos < hi), ASM)
    while base < hi:
        pos = base + tile
        pos_n = pos + CH
        key_next = _load_keys(row_ptr + pos_n, pos_n < hi, ASM)
        gt = key >= above  # above >= 1: masked entries (key 0) never count
        rank, total = _warp_rank(gt, E, T, ASM)
        slot = n_gt[None, :] + (tl.cumsum(total, 0) - total) + rank
        n_gt += tl.sum(total, 0)
        keep_eq = gt & False
        if ties:
            eq = key == vlo
            rank_eq, total_eq = _warp_rank(eq, E, T, ASM)
            slot_eq = CAPW - 1 - (n_eq[None, :] + (tl.cumsum(total_eq, 0) - total_eq) + rank_eq)
            keep_eq = eq & (slot_eq >= n_gt[None, :])
            n_eq += tl.sum(total_eq, 0)
            eq_room = tl.minimum(eq_room, tl.maximum(CAPW - n_eq, n_gt))
            slot = tl.where(gt, slot, slot_eq)
        rel = pos - shift
        packed = (key.to(tl.uint64) << 32) | rel.to(tl.uint32).to(tl.uint64)
        # Stored as a flat [CH] tensor: a 2-D store whose offsets Triton cannot analyse
        # gets a layout of its own (and a shuffle of its operands through shared memory).
        tl.store(regions + tl.reshape(region[None, :] + slot, [CH]), tl.reshape(packed.to(tl.int64, bitcast=True), [CH]),
                 mask=tl.reshape((gt & (slot < CAPW)) | keep_eq, [CH]))
        key = key_next
        base += CH
    # Ties below the final count of larger entries were overwritten by them.
    return n_gt, CAPW - tl.maximum(eq_room, n_gt)


@triton.jit(do_not_specialize=["topk"])
def _collect_kernel(
    logits_ptr, stride_lr, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, topk,
    cand_ptr, stride_cr, meta_ptr, stride_mr,
    S: tl.constexpr, Z: tl.constexpr, RETRY_Z: tl.constexpr, E: tl.constexpr,
    NW: tl.constexpr, CAPW: tl.constexpr, DECODE: tl.constexpr, ASM: tl.constexpr,
    SAMPLE_ONLY: tl.constexpr = False,
):
    T: tl.constexpr = 32 * NW
    row = tl.program_id(0)
    lo, hi, shift = _row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE)
    n = hi - lo
    if n > topk:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
        regions = cand_ptr + row.to(tl.int64) * stride_cr  # NW regions of CAPW slots
        attempt = n * 0
        why = attempt
        z = Z + 0.0 * attempt
        vlo = attempt.to(tl.uint32)
        n_kept = attempt
        n_gt = tl.zeros([T], dtype=tl.int32)
        n_eq = n_gt
        while (attempt < 2) & (why != 1):
            vlo, ties = _sample_bound(row_ptr, lo, n, topk, S, z)
            if not SAMPLE_ONLY:
                # [T]: each lane its warp's counts; ties also after a first pass overflowed.
                n_gt, n_eq = _collect(row_ptr, lo, hi, shift, vlo, ties | (why == 2), regions, E, T, CAPW, ASM)
            else:
                n_gt = tl.zeros([T], dtype=tl.int32) + topk // NW + 1 + (vlo & 1).to(tl.int32)
                n_eq = n_gt * 0
            n_kept = tl.sum(n_gt + n_eq, 0) // 32
            why = tl.where(tl.max(n_gt, 0) > CAPW, 2, tl.where(n_kept < topk, 0, 1))
            # A second pass moves the bound the way the first one missed.
            z = tl.where(why == 0, RETRY_Z, 0.5 * Z)
            attempt += 1
        # For _final_kernel (EQ_AT_TOP): warp w's region is its "program" w, with n_gt
        # entries > vlo at the bottom and n_eq ties at the top (none when both passes
        # failed: its check then fails, and it selects over the row itself). Every lane
        # of a warp writes the same words.
        meta = meta_ptr + row.to(tl.int64) * stride_mr + (tl.arange(0, T) // 32) * _NMETA
        tl.store(meta, tl.zeros([T], dtype=tl.int32) + vlo.to(tl.int32, bitcast=True))
        tl.store(meta + 1, tl.where(why == 1, n_gt, 0))
        tl.store(meta + 2, tl.where(why == 1, n_eq, 0))
        tl.store(meta + 3, tl.zeros([T], dtype=tl.int32) + attempt * 4 + why)  # passes, last outcome (tests)


# -- host side ----------------------------------------------------------------------
def collect(logits, starts, ends, seq_lens, next_n, topk, decode, meta, cand, cfg, sample_only=False) -> None:
    """Launch 1 of the one-program-a-row plan: `meta` int32 [rows, >= cfg.warps, NMETA]
    and `cand` int64 [rows, >= cfg.slots] get what `_final_kernel` reads with P1 =
    cfg.warps programs of REG = cfg.slots_per_warp slots (EQ_AT_TOP). `sample_only`
    times the sample alone (profiles: the state it leaves is not valid)."""
    rows, width = logits.shape
    assert meta.stride(0) >= NMETA * cfg.warps and meta.stride(-1) == 1, "meta scratch smaller than the plan"
    assert cand.shape[1] >= cfg.slots and cand.dtype.itemsize == 8, "candidate scratch smaller than the plan"
    _collect_kernel[(rows,)](
        logits, logits.stride(0), starts, ends, seq_lens, next_n, width, topk, cand, cand.stride(0), meta, meta.stride(0),
        S=32 * cfg.warps * cfg.samples_per_thread, Z=cfg.z, RETRY_Z=cfg.retry_z, E=cfg.per_thread, NW=cfg.warps,
        CAPW=cfg.slots_per_warp, DECODE=decode, ASM=logits.is_cuda and torch.version.hip is None,
        SAMPLE_ONLY=sample_only, num_warps=cfg.warps,
    )
