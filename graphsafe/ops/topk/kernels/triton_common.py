"""Triton helpers that both top-k kernels share (triton_two_launch.py and
triton_rowwise.py's one-launch decode kernel): the sortable key of a float, a row's
valid range, the exact radix select over a row (the fallback of both) and over a
candidate list, and the writes of positions and -1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.ops.topk.plan import NMETA

_NMETA = tl.constexpr(NMETA)  # kernels may only read constexpr globals


@triton.jit
def sortable_key(x):
    """float32 -> uint32 with the float order (negatives flipped, positives offset)."""
    bits = x.to(tl.int32, bitcast=True)
    # Sign-extended sign bit: all ones for negatives (flip every bit), else set the top
    # bit. Two ALU ops, no predicate (predicate registers are scarce next to masked loads).
    return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def row_bounds(row, starts_ptr, ends_ptr, seq_lens_ptr, next_n, width, DECODE: tl.constexpr):
    """[lo, hi): the row's valid columns, inside [0, width); shift: position origin (lo).

    Bounds are clamped to [0, width) first (the ops' documented rule for bounds outside
    the row): a prefill row sees [clamp(start), max(clamp(end), clamp(start))), a decode
    row sees n < clamp(seq_len) - next_n + i + 1. Clamping the length first also keeps
    the int32 arithmetic from wrapping around for any seq_len."""
    if DECODE:
        b = row // next_n
        seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), width)
        hi = tl.maximum(seq_len - next_n + (row - b * next_n) + 1, 0)
        lo = hi * 0
    else:
        lo = tl.minimum(tl.maximum(tl.load(starts_ptr + row), 0), width)
        hi = tl.minimum(tl.maximum(tl.load(ends_ptr + row), lo), width)
    return lo, hi, lo


# -- looped exact selection (candidate lists too large for registers, and the row) -----
@triton.jit
def _src_block(
    FROM_ROW: tl.constexpr, b, row_ptr, lo, hi, shift, cand_row, meta_row,
    P1: tl.constexpr, REG: tl.constexpr, BLOCK: tl.constexpr,
):
    """Block b of a selection source: the row's valid entries, or the kept candidates."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    if FROM_ROW:
        m = (offs >= lo) & (offs < hi)
        key = sortable_key(tl.load(row_ptr + offs, mask=m, other=0.0))
        pos = offs - shift
    else:
        inside = offs < P1 * REG
        meta = meta_row + (offs // REG) * _NMETA
        kept = tl.minimum(tl.load(meta + 1, mask=inside, other=0) + tl.load(meta + 2, mask=inside, other=0), REG)
        m = inside & ((offs % REG) < kept)
        packed = tl.load(cand_row + offs, mask=m, other=0)
        key = (packed.to(tl.uint64, bitcast=True) >> 32).to(tl.uint32)
        pos = tl.where(m, packed.to(tl.int32), -1)
    return key, pos, m


@triton.jit
def radix_kth(
    FROM_ROW: tl.constexpr, b0, b1, row_ptr, lo, hi, shift, cand_row, meta_row, topk,
    P1: tl.constexpr, REG: tl.constexpr, BLOCK: tl.constexpr,
):
    """(t, need): the topk-th largest key of the source (radix select, 8 bits a round)
    and how many entries == t complete the top-k after those > t."""
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    need = topk  # entries still to take among those matching `prefix` so far
    for d in tl.static_range(4):
        SHIFT = 24 - 8 * d
        hist = tl.zeros([256], dtype=tl.int32)
        for b in range(b0, b1):
            key, pos, m = _src_block(FROM_ROW, b, row_ptr, lo, hi, shift, cand_row, meta_row, P1, REG, BLOCK)
            if d > 0:
                m = m & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=m)
        # The digit: the largest bin whose suffix count still covers `need`.
        suffix = tl.cumsum(hist, 0, reverse=True)
        digit = tl.max(tl.where(suffix >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << SHIFT)
    return prefix, need


@triton.jit
def radix_write(
    FROM_ROW: tl.constexpr, b0, b1, row_ptr, lo, hi, shift, cand_row, meta_row, t, need, topk, out_row,
    P1: tl.constexpr, REG: tl.constexpr, BLOCK: tl.constexpr,
):
    """Write every key > t, then the first `need` keys == t."""
    n_above = topk - need
    c_above = need * 0
    c_eq = need * 0
    for b in range(b0, b1):
        key, pos, m = _src_block(FROM_ROW, b, row_ptr, lo, hi, shift, cand_row, meta_row, P1, REG, BLOCK)
        above = m & (key > t)
        tie = m & (key == t)
        slot = c_above + tl.cumsum(above.to(tl.int32), 0) - 1
        rank = c_eq + tl.cumsum(tie.to(tl.int32), 0) - 1
        tl.store(out_row + slot, pos, mask=above)
        tl.store(out_row + n_above + rank, pos, mask=tie & (rank < need))
        c_above += tl.sum(above.to(tl.int32), axis=0)
        c_eq += tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def select_row(row_ptr, lo, hi, shift, topk, out_row, BLOCK: tl.constexpr):
    """Exact top-k of the row itself (the fallback)."""
    b0 = lo // BLOCK
    b1 = (hi + BLOCK - 1) // BLOCK
    t, need = radix_kth(True, b0, b1, row_ptr, lo, hi, shift, row_ptr, row_ptr, topk, 1, 1, BLOCK)
    radix_write(True, b0, b1, row_ptr, lo, hi, shift, row_ptr, row_ptr, t, need, topk, out_row, 1, 1, BLOCK)


@triton.jit
def write_positions(out_row, first, count, start, out_cols, LBLOCK: tl.constexpr):
    """out_row[c] = start + c for first <= c < count, then -1 up to out_cols."""
    offs = tl.arange(0, LBLOCK)
    for c0 in range(first, out_cols, LBLOCK):
        c = c0 + offs
        tl.store(out_row + c, tl.where(c < count, start + c, -1), mask=c < out_cols)
