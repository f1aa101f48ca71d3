"""Triton kernel after aiter's `fp8_mqa_logits` (the aiter indexer adapter's output copy).

aiter allocates its own output, a `[M, ceil(N / 256) * 256]` float32 buffer, and returns
its `[:, :N]` view, which is not contiguous unless N is a multiple of 256; graphsafe's
output is a contiguous `[M, N]`. Called with `clean_logits=False`, aiter skips filling the
buffer with -inf and its kernel writes only each row's window `[max(ks[m], 0),
min(ke[m], N))`; `window_copy` (grid rows x column blocks) then writes every element of
the output once: the window from aiter's buffer, -inf elsewhere. It reads nothing outside
the windows (the buffer is uninitialised there). Against `clean_logits=True` and a copy,
this saves the fill of the padded buffer and the read of the columns outside the windows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.launch import bind

# Columns per program.
BLOCK = 1024


@triton.jit
def window_copy_kernel(src_ptr, ks_ptr, ke_ptr, out_ptr, n, stride_src, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.maximum(tl.load(ks_ptr + row), 0)
    hi = tl.minimum(tl.load(ke_ptr + row), n)
    inside = (cols >= lo) & (cols < hi)
    x = tl.load(src_ptr + row * stride_src + cols, mask=inside, other=float("-inf"))
    tl.store(out_ptr + row * stride_out + cols, x, mask=cols < n)


def bind_window_copy(like, rows: int, n: int, stride_src: int):
    """`launch(src, ks, ke, out)` for `rows` rows of `n` columns, `src` rows `stride_src`
    apart, `out` contiguous (`like`: any tensor of the device, a placeholder)."""
    block = min(BLOCK, triton.next_power_of_2(max(n, 1)))
    return bind(window_copy_kernel, (rows, triton.cdiv(n, block)), like, like, like, like, n, stride_src, n,
                BLOCK=block)
