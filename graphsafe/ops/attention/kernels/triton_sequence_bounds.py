"""The Triton kernel that prepares aiter's varlen inputs (the aiter adapter of
`flash_attn_varlen`, graphsafe/ops/attention/aiter.py), writing into buffers the adapter
takes from the workspace, so nothing here allocates per call.

`bind_sequence_bounds`: aiter uses `cu_seqlens` as given (no clamping); this writes
graphsafe's bounds (running maximum, clamped to [0, T]) into int32 buffers. It binds the
kernel to one call signature (`graphsafe.launch.bind`); the launch it returns takes the
tensors alone, in the order its docstring gives.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.launch import Launch, bind

_MAX_BLOCK = 1024


def _block(n: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _bounds(src_ptr, dst_ptr, n, total, BLOCK: tl.constexpr):
    """dst[i] = min(max(src[0..i]), total) clamped below at 0 (clamping first and taking
    the running maximum after gives the same: the clamp is monotone)."""
    carry = 0
    for c0 in range(0, n, BLOCK):
        i = c0 + tl.arange(0, BLOCK)
        x = tl.minimum(tl.maximum(tl.load(src_ptr + i, mask=i < n, other=0), 0), total)
        running = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)
        tl.store(dst_ptr + i, running, mask=i < n)
        carry = tl.maximum(carry, tl.max(x, axis=0))


@triton.jit
def _sequence_bounds_kernel(cu_q_ptr, cu_k_ptr, bounds_q_ptr, bounds_k_ptr, n, total_q, total_k, BLOCK: tl.constexpr):
    _bounds(cu_q_ptr, bounds_q_ptr, n, total_q, BLOCK)
    _bounds(cu_k_ptr, bounds_k_ptr, n, total_k, BLOCK)


def bind_sequence_bounds(like, batch: int, total_q: int, total_k: int) -> Launch:
    """`launch(cu_seqlens_q, cu_seqlens_k, bounds_q, bounds_k)`: the int32 [batch + 1]
    bounds graphsafe's varlen op uses (`reference.sequence_bounds`: the running maximum
    clamped to [0, total_q] resp. [0, total_k]). One program. `like`: any tensor of the
    device."""
    return bind(_sequence_bounds_kernel, (1,), like, like, like, like, batch + 1, total_q, total_k,
                BLOCK=_block(batch + 1))
