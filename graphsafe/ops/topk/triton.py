"""Triton backend of the per-row top-k ops: two streaming passes over each row.

Keys are the order-preserving uint32 image of the float bits (`_sortable_key`, the same
order as the reference's `sortable_keys`). A row's valid range is [lo, hi); rows with at
most `topk` valid entries need no data: their positions are written directly.

Pass 1 (`_threshold_kernel`) finds a lower bound `t` on the topk-th largest key. View
the row as a [g, G] matrix (column j holds positions j, j+G, j+2G, ...; G = 4*topk) and
take each column's maximum. The topk-th largest column maximum `T` is a valid bound:
topk distinct valid entries (the maxima of topk columns) are >= T. Columns are strided,
so neighbouring positions (whose scores are correlated) fall into different columns, and
few entries besides the true top-k exceed T: -G*ln(1 - topk/G) ~ 1.15*topk on random
rows, about topk on rows that trend with position. The programs of a row each reduce a
block of columns; the last to finish (an atomic ticket) finds T's top 16 bits by a
bisection over the G maxima and stores `t` = T rounded down to them.

Pass 2 (`_select_kernel`) streams the row again, in the reverse program order so that
the rows pass 1 read last (still in L2) come first. Entries with key > t are appended
(key, position) to a candidate list of capacity `cap` (4*topk), entries with key == t
to a tie list of capacity topk; each block reserves its slots with one relaxed atomic
add and places its entries with a prefix sum. The last program of the row (again an
atomic ticket) writes the answer:
  * #(key > t) < topk: all of them, then the first topk - #(key > t) ties;
  * else an exact selection among the candidates: a 32-bit bisection (two bits per
    CTA-wide reduction) in registers when they fit BLOCK_F (the common case), a radix
    select (four 8-bit histogram rounds) over the list otherwise, or over the row itself
    when the list overflowed (adversarial rows only: many equal scores with nonzero low
    bits, or scores periodic in G).
Columns past topk (and past the row length) get -1.

The hand-offs between programs follow the usual pattern: every thread's stores, a CTA
barrier, then one thread's acq_rel atomic ticket; the last program reads the shared
data with L2 (.cg) loads. Scratch (per-row state, column maxima, candidate and tie
lists) comes from the workspace manager; the per-row counters are zeroed with one
memset per call. Launch geometry depends on shapes only, never on sequence lengths, so
CUDA-graph replays stay valid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphsafe.device_info import num_sms
from graphsafe.ops.topk.plan import NSTATE, plan_sizes, pow2, specs as _specs, workspace_specs  # noqa: F401
from graphsafe.workspace import current_workspace_manager

# Streaming block of pass 2 (elements per iteration).
BLOCK = 2048
# Pass 2 loads block b+1 before the reductions and atomics of block b, so a block's
# loads are in flight during the previous block's latency chain (sum, atomic, scan).
PREFETCH = True
# Block of the final stage's list loops (radix rounds, copies, the -1 tail).
LBLOCK = 1024
# Register counts on sm_90 with triton 3.6 (ptxas): pass 1 ~77 at G=8192 (3 CTAs/SM);
# pass 2 ~128 with BLOCK=2048, BLOCK_F=4096 and the prefetch (2 CTAs/SM, a few words
# spilled outside the streaming loop). Two CTAs per SM overlap each other's barrier and
# atomic latency and run two rows' final selections at once (prefill has many rows).
NUM_WARPS = 8
NUM_WARPS_SELECT = 8
_NSTATE = tl.constexpr(NSTATE)  # kernels may only read constexpr globals


@triton.jit
def _sortable_key(x):
    """float32 -> uint32 with the float order (negatives flipped, positives offset)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE: tl.constexpr):
    """[lo, hi): the row's valid columns clipped to [0, width); shift: position origin."""
    if DECODE:
        b = row // next_n
        end = tl.load(seq_lens_ptr + b) - next_n + (row - b * next_n) + 1
        start = end * 0
        shift = start
    else:
        start = tl.load(starts_ptr + row)
        end = tl.load(ends_ptr + row)
        shift = start
    lo = tl.minimum(tl.maximum(start, 0), width)
    hi = tl.minimum(tl.maximum(end, lo), width)
    return lo, hi, shift


@triton.jit
def _kth_largest(keys, valid, k, NBITS: tl.constexpr):
    """Largest v whose low 32-NBITS bits are 0 with #(valid & keys >= v) >= k; 0 if none.

    Two bits per round: the counts of the three candidate extensions are packed in one
    int64 (21 bits each; callers pass < 2^21 keys) and summed in one reduction, so a
    32-bit search costs 16 CTA-wide reductions (each a barrier round) instead of 32.
    """
    v = tl.full([], 0, tl.uint32)
    for r in tl.static_range(NBITS // 2):
        SH = 30 - 2 * r
        c1 = v | (1 << SH)
        c2 = v | (2 << SH)
        c3 = v | (3 << SH)
        packed = (
            (valid & (keys >= c1)).to(tl.int64)
            + ((valid & (keys >= c2)).to(tl.int64) << 21)
            + ((valid & (keys >= c3)).to(tl.int64) << 42)
        )
        total = tl.sum(packed, axis=0)
        n1 = (total & 0x1FFFFF).to(tl.int32)
        n2 = ((total >> 21) & 0x1FFFFF).to(tl.int32)
        n3 = (total >> 42).to(tl.int32)
        best = tl.where(n3 >= k, 3, tl.where(n2 >= k, 2, tl.where(n1 >= k, 1, 0)))
        v = v | (best.to(tl.uint32) << SH)
    return v


@triton.jit(do_not_specialize=["topk"])
def _threshold_kernel(
    logits_ptr, stride_lr, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, topk,
    colmax_ptr, state_ptr, progs_per_row,
    G: tl.constexpr, BJ: tl.constexpr, GI: tl.constexpr, DECODE: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // progs_per_row
    cb = pid - row * progs_per_row
    lo, hi, _shift = _row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE)
    if hi - lo > topk:
        cols = cb * BJ + tl.arange(0, BJ)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
        acc = tl.zeros([BJ], dtype=tl.uint32)
        for i0 in range(lo // G, (hi + G - 1) // G, GI):
            n = (i0 + tl.arange(0, GI))[:, None] * G + cols[None, :]
            m = (n >= lo) & (n < hi)
            x = tl.load(row_ptr + n, mask=m, other=0.0)
            key = tl.where(m, _sortable_key(x), tl.zeros([GI, BJ], dtype=tl.uint32))
            acc = tl.maximum(acc, tl.max(key, axis=0))
        col_base = colmax_ptr + row.to(tl.int64) * G
        tl.store(col_base + cols, acc.to(tl.int32, bitcast=True))
        # Every thread's stores are issued before the ticket (acq_rel) is taken.
        tl.debug_barrier()
        ticket = tl.atomic_add(state_ptr + row * _NSTATE, 1)
        if ticket == progs_per_row - 1:
            allc = tl.arange(0, G)
            colmax = tl.load(col_base + allc, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            # Empty columns hold 0 and every tested bound is >= 2^16: they never count.
            t = _kth_largest(colmax, allc < G, topk, 16)
            tl.store(state_ptr + row * _NSTATE + 1, t.to(tl.int32, bitcast=True))


@triton.jit
def _src_block(
    FROM_ROW: tl.constexpr, b, row_ptr, lo, hi, shift, t, key_base, pos_base, n_src,
    BLOCK: tl.constexpr,
):
    """Block b of a selection source: the candidate list, or the row filtered by key > t."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    if FROM_ROW:
        m0 = (offs >= lo) & (offs < hi)
        key = _sortable_key(tl.load(row_ptr + offs, mask=m0, other=0.0))
        m = m0 & (key > t)
        pos = offs - shift
    else:
        m = offs < n_src
        key = tl.load(key_base + offs, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        pos = tl.load(pos_base + offs, mask=m, other=-1, cache_modifier=".cg")
    return key, pos, m


@triton.jit
def _select_looped(
    FROM_ROW: tl.constexpr, row_ptr, lo, hi, shift, t, key_base, pos_base, n_src, topk, out_row,
    BLOCK: tl.constexpr,
):
    """Exact top-`topk` of a source too large for registers: radix select, 8 bits a round."""
    if FROM_ROW:
        b0 = lo // BLOCK
        b1 = (hi + BLOCK - 1) // BLOCK
    else:
        b0 = n_src * 0
        b1 = (n_src + BLOCK - 1) // BLOCK
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    need = topk  # entries still to take among those matching `prefix` so far
    for d in tl.static_range(4):
        SHIFT = 24 - 8 * d
        hist = tl.zeros([256], dtype=tl.int32)
        for b in range(b0, b1):
            key, pos, m = _src_block(FROM_ROW, b, row_ptr, lo, hi, shift, t, key_base, pos_base, n_src, BLOCK)
            if d > 0:
                m = m & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=m)
        # The digit: the largest bin whose suffix count still covers `need`.
        suffix = tl.cumsum(hist, 0, reverse=True)
        digit = tl.max(tl.where(suffix >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << SHIFT)
    # Write: every key > prefix, then the first `need` keys == prefix.
    n_above = topk - need
    c_above = need * 0
    c_eq = need * 0
    for b in range(b0, b1):
        key, pos, m = _src_block(FROM_ROW, b, row_ptr, lo, hi, shift, t, key_base, pos_base, n_src, BLOCK)
        above = m & (key > prefix)
        tie = m & (key == prefix)
        slot = c_above + tl.cumsum(above.to(tl.int32), 0) - 1
        rank = c_eq + tl.cumsum(tie.to(tl.int32), 0) - 1
        tl.store(out_row + slot, pos, mask=above)
        tl.store(out_row + n_above + rank, pos, mask=tie & (rank < need))
        c_above += tl.sum(above.to(tl.int32), axis=0)
        c_eq += tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _select_registers(key_base, pos_base, n_src, topk, out_row, BLOCK_F: tl.constexpr):
    """Exact top-`topk` of at most BLOCK_F candidates held in registers."""
    c = tl.arange(0, BLOCK_F)
    m = c < n_src
    key = tl.load(key_base + c, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    pos = tl.load(pos_base + c, mask=m, other=-1, cache_modifier=".cg")
    kth = _kth_largest(key, m, topk, 32)
    above = m & (key > kth)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    tie = m & (key == kth)
    rank = tl.cumsum(tie.to(tl.int32), 0) - 1
    sel = above | (tie & (rank < topk - n_above))
    slot = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_row + slot, pos, mask=sel)


@triton.jit
def _copy_prefix(src, dst, n, BLOCK: tl.constexpr):
    for c0 in range(0, n, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        tl.store(dst + c, tl.load(src + c, mask=c < n, cache_modifier=".cg"), mask=c < n)


@triton.jit
def _finish_row(
    row, lo, hi, shift, t, row_ptr, out_row, out_cols, topk, st, cand_key_ptr, cand_pos_ptr, eq_pos_ptr, cap,
    BLOCK: tl.constexpr, BLOCK_F: tl.constexpr,
):
    # BLOCK here is the small block of the list loops (LBLOCK): the fused final stage
    # must not raise the register count of the streaming loop it shares a kernel with.
    n_gt = tl.atomic_add(st + 2, 0)  # an L2 read of the final count
    key_base = cand_key_ptr + row.to(tl.int64) * cap
    pos_base = cand_pos_ptr + row.to(tl.int64) * cap
    if n_gt >= topk:
        if n_gt > cap:  # the list overflowed: select from the row itself
            _select_looped(True, row_ptr, lo, hi, shift, t, key_base, pos_base, n_gt, topk, out_row, BLOCK)
        elif n_gt <= BLOCK_F:
            _select_registers(key_base, pos_base, n_gt, topk, out_row, BLOCK_F)
        else:
            _select_looped(False, row_ptr, lo, hi, shift, t, key_base, pos_base, n_gt, topk, out_row, BLOCK)
    else:
        # #(key >= t) >= topk, so the tie list holds at least topk - n_gt entries.
        _copy_prefix(pos_base, out_row, n_gt, BLOCK)
        _copy_prefix(eq_pos_ptr + row.to(tl.int64) * topk, out_row + n_gt, topk - n_gt, BLOCK)
    for c0 in range(topk, out_cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        tl.store(out_row + c, tl.full([BLOCK], -1, tl.int32), mask=c < out_cols)


@triton.jit(do_not_specialize=["topk"])
def _select_kernel(
    logits_ptr, stride_lr, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, topk,
    out_ptr, stride_or, out_cols,
    state_ptr, cand_key_ptr, cand_pos_ptr, eq_pos_ptr, cap,
    chunks_per_row, blocks_per_chunk,
    BLOCK: tl.constexpr, LBLOCK: tl.constexpr, BLOCK_F: tl.constexpr, DECODE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # Reverse order: pass 1 read the last rows last, so they are the ones still in L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row = pid // chunks_per_row
    ch = pid - row * chunks_per_row
    lo, hi, shift = _row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    offs = tl.arange(0, BLOCK)
    if hi - lo <= topk:
        # Short row: every valid position, then -1; no data needed.
        if ch == 0:
            for c0 in range(0, out_cols, BLOCK):
                c = c0 + offs
                tl.store(out_row + c, tl.where(c < hi - lo, lo - shift + c, -1), mask=c < out_cols)
    else:
        st = state_ptr + row * _NSTATE
        t = tl.load(st + 1).to(tl.uint32, bitcast=True)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
        cand_base = row.to(tl.int64) * cap
        eq_base = eq_pos_ptr + row.to(tl.int64) * topk
        b_first = tl.maximum(ch * blocks_per_chunk, lo // BLOCK)
        b_last = tl.minimum((ch + 1) * blocks_per_chunk, (hi + BLOCK - 1) // BLOCK)
        # Loads stop at the end of this program's chunk (limit), not only at the row end.
        limit = tl.minimum(hi, b_last * BLOCK)
        n = b_first * BLOCK + offs
        x = tl.load(row_ptr + n, mask=(n >= lo) & (n < limit), other=0.0)
        for b in range(b_first, b_last):
            n = b * BLOCK + offs
            m = (n >= lo) & (n < hi)
            key = _sortable_key(x)
            if PREFETCH:
                # The next block's loads are in flight while this one waits on its atomics.
                x = tl.load(row_ptr + n + BLOCK, mask=n + BLOCK < limit, other=0.0)
            gt = m & (key > t)
            tie = m & (key == t)
            # Both counts in one reduction (one barrier): a block holds < 65536 entries.
            counts = tl.sum(gt.to(tl.int32) + tie.to(tl.int32) * 65536, axis=0)
            n_gt = counts & 65535
            n_tie = counts >> 16
            if n_gt > 0:
                slot = tl.atomic_add(st + 2, n_gt, sem="relaxed") + tl.cumsum(gt.to(tl.int32), 0) - 1
                ok = gt & (slot < cap)
                tl.store(cand_key_ptr + cand_base + slot, key.to(tl.int32, bitcast=True), mask=ok)
                tl.store(cand_pos_ptr + cand_base + slot, n - shift, mask=ok)
            if n_tie > 0:
                slot = tl.atomic_add(st + 3, n_tie, sem="relaxed") + tl.cumsum(tie.to(tl.int32), 0) - 1
                tl.store(eq_base + slot, n - shift, mask=tie & (slot < topk))
            if not PREFETCH:
                x = tl.load(row_ptr + n + BLOCK, mask=n + BLOCK < limit, other=0.0)
        tl.debug_barrier()
        ticket = tl.atomic_add(st + 4, 1)
        if ticket == chunks_per_row - 1:
            _finish_row(
                row, lo, hi, shift, t, row_ptr, out_row, out_cols, topk, st,
                cand_key_ptr, cand_pos_ptr, eq_pos_ptr, cap, LBLOCK, BLOCK_F,
            )


@triton.jit
def _finish_external_kernel(
    src_ptr, stride_src, dst_ptr, stride_dst, shift_ptr, topk, out_cols,
    LOCALIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """dst[r, c] = src[r, c] - shift[r] (or -1 where src < 0) for c < topk, -1 after.

    Used by the aiter adapter: aiter's prefill top-k returns absolute columns, and its
    output is a contiguous [rows, topk] buffer. In place when src is dst.
    """
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + row * stride_src + c, mask=c < topk, other=-1)
    if LOCALIZE:
        v = tl.where(v >= 0, v - tl.load(shift_ptr + row), -1)
    tl.store(dst_ptr + row * stride_dst + c, tl.where(c < topk, v, -1), mask=c < out_cols)


@triton.jit
def _decode_row_ends_kernel(seq_lens_ptr, ends_ptr, rows, next_n, width, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = r // next_n
    end = tl.load(seq_lens_ptr + b, mask=r < rows, other=0) - next_n + (r - b * next_n) + 1
    tl.store(ends_ptr + r, tl.minimum(tl.maximum(end, 0), width), mask=r < rows)


# -- host side ----------------------------------------------------------------------
_pow2 = pow2


@functools.lru_cache(maxsize=1024)
def _geometry(rows: int, width: int, topk: int, sms: int, g_cols: int, block: int) -> tuple[int, int, int, int, int]:
    """Programs per row of both passes, sized so that >= ~4 programs per SM exist."""
    want = max(1, -(-4 * sms // max(rows, 1)))
    progs1 = min(_pow2(want), max(1, g_cols // 64))
    bj = g_cols // progs1
    g_rows = -(-width // g_cols)
    gi = max(1, min(_pow2(g_rows), max(1, 8192 // bj)))
    blocks_per_row = max(1, -(-width // block))
    chunks = min(want, blocks_per_row)
    per_chunk = -(-blocks_per_row // chunks)
    chunks = -(-blocks_per_row // per_chunk)
    return progs1, bj, gi, chunks, per_chunk


def _launch(
    logits, starts, ends, seq_lens, next_n, indices, topk, decode: bool,
    *, scratch=None, g_cols=None, cap=None, block_f=None, block=None,
) -> None:
    """Run both passes. `scratch` (the views of `workspace_specs`) lets a composite that
    already holds workspace views pass its own; the keyword overrides exist for tests."""
    rows, width = logits.shape
    if indices.numel() == 0:
        return
    if rows == 0:
        return
    if topk == 0 or width == 0:
        indices.fill_(-1)
        return
    g0, cap0, bf0 = plan_sizes(width, topk)
    g_cols, cap, block_f = g_cols or g0, cap or cap0, block_f or bf0
    block = block or min(BLOCK, max(64, _pow2(width)))
    # A row with fewer than topk keys above the bound copies them all from the list.
    assert cap >= min(topk, width), f"candidate capacity {cap} < topk {topk}"
    if scratch is None:
        specs = _specs(rows, g_cols, cap, topk)
        scratch = current_workspace_manager(logits.device).get_simultaneous(*specs, owner=_OWNER[decode])
    state, colmax, cand_key, cand_pos, eq_pos = scratch
    state.zero_()
    progs1, bj, gi, chunks, per_chunk = _geometry(rows, width, topk, num_sms(logits.device), g_cols, block)
    common = (logits, logits.stride(0), starts, ends, seq_lens, next_n, width, topk)
    _threshold_kernel[(rows * progs1,)](
        *common, colmax, state, progs1, G=g_cols, BJ=bj, GI=gi, DECODE=decode, num_warps=NUM_WARPS,
    )
    _select_kernel[(rows * chunks,)](
        *common, indices, indices.stride(0), indices.shape[1],
        state, cand_key, cand_pos, eq_pos, cap, chunks, per_chunk,
        BLOCK=block, LBLOCK=min(block, LBLOCK), BLOCK_F=block_f, DECODE=decode, PREFETCH=PREFETCH,
        num_warps=NUM_WARPS_SELECT,
    )


_OWNER = {False: "top_k_per_row_prefill", True: "top_k_per_row_decode"}


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk, **kw) -> None:
    _launch(logits, row_starts, row_ends, row_starts, 1, indices, topk, False, **kw)


def top_k_per_row_decode(logits, next_n, seq_lens, indices, topk, **kw) -> None:
    _launch(logits, seq_lens, seq_lens, seq_lens, next_n, indices, topk, True, **kw)


# -- helpers for the aiter adapter --------------------------------------------------
def finish_external(src: torch.Tensor, indices: torch.Tensor, topk: int, row_starts: torch.Tensor | None) -> None:
    """indices[:, :topk] <- src (minus row_starts where >= 0, when given), -1 after."""
    rows, cols = indices.shape
    if rows == 0 or cols == 0:
        return
    blk = min(1024, _pow2(cols))
    _finish_external_kernel[(rows, triton.cdiv(cols, blk))](
        src, src.stride(0), indices, indices.stride(0),
        row_starts if row_starts is not None else indices, topk, cols,
        LOCALIZE=row_starts is not None, BLOCK=blk,
    )


def decode_row_ends(seq_lens: torch.Tensor, next_n: int, width: int, out: torch.Tensor) -> None:
    """out[r] = clamp(seq_lens[r // next_n] - next_n + r % next_n + 1, 0, width)."""
    rows = out.shape[0]
    if rows:
        _decode_row_ends_kernel[(triton.cdiv(rows, 1024),)](seq_lens, out, rows, next_n, width, BLOCK=1024)
