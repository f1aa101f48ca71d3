"""Two small Triton kernels around an external top-k kernel (the aiter adapter's pre- and
post-processing): the decode rows' ends (lengths clamped to the row), and the copy of a contiguous
`[rows, topk]` result into `indices` (positions made relative, -1 past topk).

Kept apart from the Triton backend's kernels so that the aiter adapter imports these two
kernels only; aiter.py binds them to a call signature (`graphsafe.launch.bind`).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    # The length clamped to [0, width] first (the op's rule; no int32 wrap-around).
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b, mask=r < rows, other=0), 0), width)
    tl.store(ends_ptr + r, tl.maximum(seq_len - next_n + (r - b * next_n) + 1, 0), mask=r < rows)

