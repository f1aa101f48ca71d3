"""The two-launch top-k (prefill, and decode with few wide rows): `_bound_kernel`, then
`_final_kernel`; each logit read from HBM once. Chosen and bound by the Triton backend
(`plan.choose_*`, `triton.prepare_*`).

Keys are the order-preserving uint32 image of the float bits (`sortable_key`, the same
order as the reference's `sortable_keys`). A row's valid range is [lo, hi); rows with at
most `topk` valid entries need no data: their positions are written directly.

Launch 1 (`_bound_kernel`, rows x P1 programs; P1 = 2 at 32K-wide rows, 8 at 128K). View
the row as G ~ 4*topk strided columns (column j holds positions j, j+G, j+2G, ...).
Program c of a row owns the 16-entry granules g with g % P1 == c of every G-row: it
reads whole 64-byte bursts, and all P1 programs see the same mix of the row (a run of
high scores, e.g. recent tokens, is split evenly among them). A program
  1. loads its [DP G-rows, BJ columns] tile with every load in flight at once and keeps
     it in registers as keys (64 a thread), with its BJ column maxima;
  2. finds a bound w with about kc of its column maxima >= w (`_radix_search`, three
     bits a round, stopped once kc..kc+kc/16 lie above). kc = mu + 12*sqrt(mu) + 2,
     where mu = topk * (its entries / the row's entries) is its expected share of the
     row's top-k (kc = topk when one program owns the row). Each of those columns holds
     an entry >= w, so the program holds >= kc entries >= w; kc is far enough above mu
     that the row's k-th largest score is >= w unless the program's share of the top-k
     is > 12 sigma above its mean (rows of i.i.d. scores), or 3 sigma when scores come
     in clumps of 16 equal values;
  3. keeps every entry > w, then the entries == w that still fit, in its own REG slots
     of the row's candidate list (one int64 a candidate: key << 32 | position), in
     column order: slots from one scan over per-column counts, no atomics. It records
     (w, #(> w), #(== w)).

Launch 2 (`_final_kernel`, one program per row) loads the P1 x REG candidate slots and
finds t, the topk-th largest kept key (the same search over the kept keys >= every
program's bound, run until exactly topk keys lie above its prefix, or to the last bit). If no program had more entries > w than
slots and t >= every program's w, the kept entries are a valid top-k: every entry of
the row > t is > its program's w, so it was kept, and >= topk kept entries are >= t.
It then writes the kept entries > t and ties == t up to topk. Otherwise (a program's
share far above its mean, or rows built to defeat the bound, e.g. periodic in G) it
runs an exact radix select over the row itself: slow, correct. Columns past topk (and
past the row length) get -1.

The helpers both top-k kernels share (row bounds, the exact select over a row, the
position writes) live in triton_common.py; the one-launch decode kernel in
triton_rowwise.py.

Nothing is zeroed and no counter is shared: no memset, no atomic, a deterministic
result. Scratch (per-program state, candidate regions) comes from the workspace
manager; launch geometry depends on shapes only, never on sequence lengths, so
CUDA-graph replays stay valid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.ops.topk.kernels.triton_common import (
    radix_kth,
    radix_write,
    row_bounds,
    select_row,
    sortable_key,
    write_positions,
)
from graphsafe.ops.topk.plan import NMETA

_NMETA = tl.constexpr(NMETA)  # kernels may only read constexpr globals


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _pair(acc, J: tl.constexpr):
    """Byte fields J and J + 1 of `acc` (a field of 7 bytes) as the two halves of an int32."""
    lo = ((acc >> (8 * J)) & 255).to(tl.int32)
    if J + 1 < 7:
        return lo + (((acc >> (8 * (J + 1))) & 255).to(tl.int32) << 16)
    else:
        return lo


@triton.jit
def _radix_search(keys, k_lo, k_hi, n_valid, R: tl.constexpr, C: tl.constexpr, TUPLE: tl.constexpr):
    """(v, n) with n = #(keys >= v) >= k_lo, searched three bits a round.

    `keys` is a 1-D [R * C] uint32 tensor with 0 in the slots that hold no key: every
    tested bound is at least the smallest real key, so they never count
    (callers never pass a real key of 0); `n_valid` (< 2^16) counts the others. Stops as
    soon as n <= k_hi; run to the last bit it returns the largest such v (the k_lo-th
    largest key). With n_valid <= k_hi it returns v = 1 (at most every key). The search
    covers [smallest key, largest key] only: rounds ~ log8 of its width.

    A round counts the keys at or above the seven bounds v + j * 2^sh (j = 1..7) at once
    (why: each round ends in a CTA-wide reduction whose latency, not the arithmetic,
    bounded the old two-bits-a-round search): a key adds a thermometer code (one in the
    byte fields 0..d-1 of an int64, d its 3-bit digit) to its column of the [R, C] view;
    the R <= 255 keys of a column cannot overflow a byte, and the columns' bytes are then
    summed as int32 halves in one reduction. R runs along each thread's own registers
    when C is the program's thread count.
    """
    tl.static_assert(R <= 255, "a column's count must fit a byte")
    hi = tl.max(keys, axis=0)
    lo = tl.minimum(tl.min(tl.where(keys != 0, keys, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0), hi)
    # The search walks up from the smallest key: v = lo, and the k_lo-th largest key lies
    # in [v, v + 8 * 2^sh) while sh >= 0. The first sh: 2^(b+1) > hi - lo, where b is the
    # highest set bit of hi - lo, from the float exponent (rounding may say one too many:
    # an extra round, harmless); a multiple of 3, so that the last round ends on bit 0.
    b = ((((hi - lo).to(tl.float32).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127)
    b = tl.minimum(tl.maximum(b, 0), 31)
    # With n_valid <= k_hi there is nothing to search: v = 1, the smallest real key (a
    # bound program that keeps all its entries then never raises the row's max_w).
    v = tl.where(n_valid <= k_hi, 1, lo)
    n = n_valid
    sh = (b // 3) * 3
    ones = tl.full([], 0x01010101010101, tl.int64)  # seven byte fields
    while (sh >= 0) & (n > k_hi):
        d = tl.where(keys >= v, tl.minimum((keys - v) >> sh.to(tl.uint32), 7), 0).to(tl.int64)
        acc = tl.sum(tl.reshape(ones >> (56 - 8 * d), [R, C]), axis=0)
        if TUPLE:  # one tuple reduction (a GPU)
            c12, c34, c56, c7 = tl.reduce((_pair(acc, 0), _pair(acc, 2), _pair(acc, 4), _pair(acc, 6)), 0, _add4)
        else:  # the same sums, native: Triton's interpreter runs a combine function per element in Python
            c12, c34, c56, c7 = (tl.sum(_pair(acc, 0), 0), tl.sum(_pair(acc, 2), 0), tl.sum(_pair(acc, 4), 0),
                                 tl.sum(_pair(acc, 6), 0))
        # c_j = #(keys >= v + j * 2^sh), non-increasing in j: the digit is how many reach k_lo.
        c1, c2, c3, c4, c5, c6 = c12 & 0xFFFF, c12 >> 16, c34 & 0xFFFF, c34 >> 16, c56 & 0xFFFF, c56 >> 16
        best = ((c1 >= k_lo).to(tl.int32) + (c2 >= k_lo).to(tl.int32) + (c3 >= k_lo).to(tl.int32)
                + (c4 >= k_lo).to(tl.int32) + (c5 >= k_lo).to(tl.int32) + (c6 >= k_lo).to(tl.int32)
                + (c7 >= k_lo).to(tl.int32))
        n = tl.where(best == 0, n, tl.where(best == 1, c1, tl.where(best == 2, c2, tl.where(
            best == 3, c3, tl.where(best == 4, c4, tl.where(best == 5, c5, tl.where(best == 6, c6, c7)))))))
        v = v + (best.to(tl.uint32) << sh.to(tl.uint32))
        sh -= 3
    return v, n


@triton.jit
def _prefix2d(x):
    """Inclusive prefix sums of a [R, C] tensor in row-major order, and its total."""
    row_sums = tl.sum(x, axis=1)
    before = tl.cumsum(row_sums, axis=0) - row_sums
    return tl.cumsum(x, axis=1) + before[:, None], tl.sum(row_sums, axis=0)


@triton.jit
def _owned(x, c, P1: tl.constexpr, SEGW: tl.constexpr):
    """#{y < x : (y // SEGW) % P1 == c}: the positions of program c before x (x >= 0)."""
    span = SEGW * P1
    return (x // span) * SEGW + tl.minimum(tl.maximum(x % span - c * SEGW, 0), SEGW)


@triton.jit
def _in_range(pos, lo, hi, DECODE: tl.constexpr):
    if DECODE:
        return pos < hi  # decode rows start at column 0
    else:
        return (pos >= lo) & (pos < hi)


@triton.jit(do_not_specialize=["topk"])
def _bound_kernel(
    logits_ptr, stride_lr, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, topk,
    meta_ptr, stride_mr, cand_ptr, stride_cr,
    P1: tl.constexpr, BJ: tl.constexpr, DP: tl.constexpr, REG: tl.constexpr, SEGW: tl.constexpr,
    MARGIN: tl.constexpr, DECODE: tl.constexpr, SC: tl.constexpr, TUPLE: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // P1
    c = pid - row * P1
    lo, hi, shift = row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE)
    n = hi - lo
    if n > topk:
        G: tl.constexpr = BJ * P1
        base = (lo // G) * G
        # The tile is a flat [DP * BJ] (entry i: G-row i // BJ, column i % BJ), viewed
        # as [DP, BJ] for the column work: loads and the scattered candidate stores are
        # then 1-D accesses of one layout (no register shuffle through shared memory), and
        # the view keeps each thread's entries of a column in its own registers.
        ii = tl.arange(0, DP * BJ)
        jj = ii % BJ
        pos = base + (ii // BJ) * G + (jj // SEGW) * (SEGW * P1) + c * SEGW + (jj % SEGW)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
        # 1. The whole tile in one go (every load in flight at once), kept in registers
        #    as keys (0 outside the row's range). A tile inside the range (full rows)
        #    needs no masks; otherwise the loads are masked to the exact range (a logit
        #    outside it is never read) and the same mask zeroes the keys there.
        #    (The loads are not vectorised: Triton gives them the layout of the scattered
        #    stores below, one element a thread, which spares a shuffle of the tile.)
        if (base >= lo) & (base + DP * G <= hi):
            key = sortable_key(tl.load(row_ptr + pos))
        else:
            inside = _in_range(pos, lo, hi, DECODE)
            key = tl.where(inside, sortable_key(tl.load(row_ptr + pos, mask=inside, other=0.0)), 0)
        key2 = tl.reshape(key, [DP, BJ])
        # 2. The bound: about kc of the BJ column maxima lie at or above it. Empty
        #    columns hold 0 and every tested bound is >= 1: they never count.
        colmax = tl.max(key2, axis=0)
        n_c = _owned(hi, c, P1, SEGW) - _owned(lo, c, P1, SEGW)
        n_cols = tl.where(n >= G, BJ, n_c)  # a row shorter than G has one entry a column
        if P1 == 1:
            kc = topk
        else:
            mu = topk.to(tl.float32) * n_c.to(tl.float32) / n.to(tl.float32)
            kc = (mu + MARGIN * tl.sqrt(mu)).to(tl.int32) + 2
        w, _n_w = _radix_search(colmax, kc, kc + kc // 16 + 1, n_cols, BJ // SC, SC, TUPLE)
        # Key 0 is "no key": a bound of at least 1 never keeps it (the one NaN pattern
        # with key 0 is then never kept; the final check sees too few kept entries if
        # the row needs it).
        w = tl.maximum(w, 1)
        # 3. Keep every entry > w, then the entries == w that fit (a row of equal scores
        #    must not overflow the slots), from the registers: slots in column order, a
        #    column's entries consecutive, the column bases from one scan over the
        #    per-column counts (> w and == w packed in the two halves of an int32).
        word = (key2 > w).to(tl.int32) + ((key2 == w).to(tl.int32) << 16)
        col_count = tl.sum(word, axis=0)
        total = tl.sum(col_count, axis=0)
        n_gt = total & 0xFFFF
        before = (tl.cumsum(col_count, axis=0) - col_count)[None, :] + tl.cumsum(word, axis=0) - word
        before = tl.reshape(before, [DP * BJ])
        gt = key > w
        slot = tl.where(gt, before & 0xFFFF, n_gt + (before >> 16))
        # One 8-byte candidate: the key in the high half (its order), the position low.
        packed = (key.to(tl.uint64) << 32) | (pos - shift).to(tl.uint32).to(tl.uint64)
        cand = cand_ptr + row.to(tl.int64) * stride_cr + c * REG
        tl.store(cand + slot, packed.to(tl.int64, bitcast=True), mask=(gt | (key == w)) & (slot < REG))
        meta = meta_ptr + row.to(tl.int64) * stride_mr + c * _NMETA
        tl.store(meta, w.to(tl.int32, bitcast=True))
        tl.store(meta + 1, n_gt)
        tl.store(meta + 2, total >> 16)


@triton.jit
def _select_kept_registers(key, pos, kept, max_w, topk, out_row, P1: tl.constexpr, REG: tl.constexpr,
                           SC: tl.constexpr, TUPLE: tl.constexpr):
    """Top-k of the kept candidates ([P1, REG] keys and positions, the first kept[c] of
    row c valid) held in registers; 1 if written, 0 if not provably the row's top-k.

    The kept keys are a valid top-k of the row only if their topk-th largest, t, is at
    least every program's bound (max_w), that is if >= topk of them are >= max_w: the
    search runs over those alone (a narrower range of keys: fewer rounds)."""
    valid = (tl.arange(0, REG)[None, :] < kept[:, None]) & (key >= max_w)
    key = tl.where(valid, key, 0)  # max_w >= 1: no kept key is 0
    n_ok = tl.sum(tl.sum(valid.to(tl.int32), axis=1), axis=0)
    ok = (n_ok >= topk).to(tl.int32)
    if ok != 0:
        v, _n = _radix_search(tl.reshape(key, [P1 * REG]), topk, topk, n_ok, P1 * REG // SC, SC, TUPLE)
        # The topk-th largest of them (v itself when the search ran to the last bit).
        t = tl.min(tl.min(tl.where(valid & (key >= v), key, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=1), axis=0)
        above = valid & (key > t)
        tie = valid & (key == t)
        incl, total = _prefix2d(above.to(tl.int32) + (tie.to(tl.int32) << 16))
        n_above = total & 0xFFFF
        slot = tl.where(above, (incl & 0xFFFF) - 1, n_above + (incl >> 16) - 1)
        tl.store(out_row + slot, pos, mask=above | (tie & (slot < topk)))
    return ok


@triton.jit(do_not_specialize=["topk"])
def _final_kernel(
    logits_ptr, stride_lr, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, topk,
    out_ptr, stride_or, out_cols, meta_ptr, stride_mr, cand_ptr, stride_cr,
    P1: tl.constexpr, REG: tl.constexpr, IN_REGS: tl.constexpr, LBLOCK: tl.constexpr, DECODE: tl.constexpr,
    SC: tl.constexpr, TUPLE: tl.constexpr,
):
    row = tl.program_id(0)
    lo, hi, shift = row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    if hi - lo <= topk:
        # Short row: every valid position, then -1; no data needed.
        write_positions(out_row, 0, hi - lo, lo - shift, out_cols, LBLOCK)
    else:
        meta_row = meta_ptr + row.to(tl.int64) * stride_mr
        cand_row = cand_ptr + row.to(tl.int64) * stride_cr
        if IN_REGS:
            # Every slot, unmasked: these loads need not wait for the counts below
            # (slots past a program's count are ignored).
            slots = tl.arange(0, P1)[:, None] * REG + tl.arange(0, REG)[None, :]
            packed = tl.load(cand_row + slots)
            key = (packed.to(tl.uint64, bitcast=True) >> 32).to(tl.uint32)
            pos = packed.to(tl.int32)
        prog = tl.arange(0, P1)
        w = tl.load(meta_row + prog * _NMETA).to(tl.uint32, bitcast=True)
        n_gt = tl.load(meta_row + prog * _NMETA + 1)
        kept = tl.minimum(n_gt + tl.load(meta_row + prog * _NMETA + 2), REG)
        n_kept = tl.sum(kept, axis=0)
        max_w = tl.max(w, axis=0)
        # Every entry > w must have been kept, and the kept ones must cover topk.
        ok = ((tl.max(n_gt, axis=0) <= REG) & (n_kept >= topk)).to(tl.int32)
        if ok != 0:
            if IN_REGS:
                ok = _select_kept_registers(key, pos, kept, max_w, topk, out_row, P1, REG, SC, TUPLE)
            else:
                b1 = (P1 * REG + LBLOCK - 1) // LBLOCK
                t, need = radix_kth(
                    False, 0, b1, logits_ptr, lo, hi, shift, cand_row, meta_row, topk, P1, REG, LBLOCK,
                )
                ok = (t >= max_w).to(tl.int32)
                if ok != 0:
                    radix_write(
                        False, 0, b1, logits_ptr, lo, hi, shift, cand_row, meta_row, t, need, topk, out_row,
                        P1, REG, LBLOCK,
                    )
        if ok == 0:
            row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
            select_row(row_ptr, lo, hi, shift, topk, out_row, LBLOCK)
        write_positions(out_row, topk, 0, 0, out_cols, LBLOCK)  # -1 past topk
