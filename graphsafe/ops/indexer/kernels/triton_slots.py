"""Triton kernel of `req_local_to_global_slots`: request-local top-k positions to cache
slots through the block table. Launched by `graphsafe/ops/indexer/triton.py`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def req_local_to_global_kernel(
    req_ptr, bt_ptr, idx_ptr, out_ptr,
    num_reqs, max_blocks, K, stride_bt, stride_it, stride_ik, stride_out,
    BS: tl.constexpr, BLOCK_K: tl.constexpr, LAST_BLOCK_ID: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < K
    req = tl.load(req_ptr + t)
    pos = tl.load(idx_ptr + t * stride_it + offs * stride_ik, mask=kmask, other=-1)
    logical = pos // BS
    valid = tl.where((req >= 0) & (req < num_reqs), (pos >= 0) & (logical < max_blocks), False)
    req_c = tl.where((req >= 0) & (req < num_reqs), req, 0).to(tl.int64)
    blk = tl.load(bt_ptr + req_c * stride_bt + tl.where(valid, logical, 0), mask=kmask & valid, other=-1)
    # A block id outside [0, 2^31 // BS) (padding -1) has no int32 slot: -1.
    valid = valid & (blk >= 0) & (blk <= LAST_BLOCK_ID)
    slot = blk.to(tl.int64) * BS + pos % BS
    tl.store(out_ptr + t * stride_out + offs, tl.where(valid, slot, -1).to(tl.int32), mask=kmask)
