"""Triton kernels around aiter's `mla_decode_fwd` (the aiter MLA adapter's pre- and post-processing).

aiter's MLA decode takes its keys as a token CSR with page size 1: `kv_indptr[r]` ..
`kv_indptr[r + 1]` index `kv_indices`, the cache slots (rows of the flat cache) of row
r's keys. These kernels write it, and aiter's other index arrays, straight into
workspace buffers (no per-call temporary of the size of the block table):

* `count` (grid rows x chunks of CHUNK key positions): the number of valid keys of each
  chunk into `counts[r * chunks + c]`, plus `qo_indptr = [0, 1, .., rows]`,
  `kv_last_page_lens = 1` and `num_kv_splits_indptr = [0, n, 2n, .., rows * n]`;
* an inclusive prefix sum of `counts` (row-major, so over rows and chunks at once) into
  `ends`, done by the caller with `torch.cumsum(counts, 0, out=ends)`;
* `scatter` (same grid): the slots of the chunk's valid keys, in position order, to
  `kv_indices[ends[i] - counts[i] ..]`, and `kv_indptr` (`kv_indptr[r + 1]` is the end of
  row r's last chunk, `kv_indptr[0] = 0`).

Valid keys: `mla_decode` (PAGED) position p of row b with `p < clamp(seq_lens[b], 0,
width)` whose block `block_table[b, p // block_size]` is in `[0, num_blocks)`, slot
`block * block_size + p % block_size`; `sparse_mla` entry j of row t with
`0 <= indices[t, j] < num_slots`, slot the entry itself. Nothing else is read: block-table
entries at or past a row's length, and invalid ids, never reach aiter.

`mask_empty` (grid rows) runs after aiter: rows whose CSR range is empty get out 0 and
lse -inf (aiter's reduce gives 0/0 and -inf there).

Callers guarantee `rows * width` and the number of cache slots fit int32 (aiter's index
arrays are int32). `bind_*` bind the kernels to one call signature (`graphsafe.launch.bind`);
the launches they return take the tensors alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.launch import bind

# Key positions per program of the count / scatter kernels.
CHUNK = 1024


def num_chunks(width: int) -> int:
    """Programs per row of the count / scatter kernels (at least 1, so that a row of no
    position still writes its zero count)."""
    return max(1, triton.cdiv(width, CHUNK))


@triton.jit
def _row_slots(src_ptr, stride_src, lens_ptr, row, pos, width, num_ids, block_size, PAGED: tl.constexpr):
    """(slot, valid) of key positions `pos` of `row`; invalid positions read nothing
    beyond their row's own block-table entry (PAGED) or index entry."""
    row_base = src_ptr + row.to(tl.int64) * stride_src
    if PAGED:
        has = pos < tl.minimum(tl.load(lens_ptr + row), width)  # a length <= 0 selects nothing
        blk = tl.load(row_base + pos // block_size, mask=has, other=-1)
        valid = has & (blk >= 0) & (blk < num_ids)
        slot = tl.where(valid, blk, 0) * block_size + pos % block_size
    else:
        idx = tl.load(row_base + pos, mask=pos < width, other=-1)
        valid = (idx >= 0) & (idx < num_ids)
        slot = idx
    return slot, valid


@triton.jit
def _count_kernel(
    src_ptr, stride_src, lens_ptr, counts_ptr, qo_indptr_ptr, last_page_ptr, splits_indptr_ptr,
    rows, chunks, width, num_ids, block_size, num_splits,
    PAGED: tl.constexpr, CHUNK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    pos = c * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    _, valid = _row_slots(src_ptr, stride_src, lens_ptr, row, pos, width, num_ids, block_size, PAGED)
    tl.store(counts_ptr + row * chunks + c, tl.sum(valid.to(tl.int32), 0))
    if c == 0:
        tl.store(qo_indptr_ptr + row, row)
        tl.store(last_page_ptr + row, 1)
        tl.store(splits_indptr_ptr + row, row * num_splits)
        if row == 0:
            tl.store(qo_indptr_ptr + rows, rows)
            tl.store(splits_indptr_ptr + rows, rows * num_splits)


@triton.jit
def _scatter_kernel(
    src_ptr, stride_src, lens_ptr, counts_ptr, ends_ptr, kv_indptr_ptr, kv_indices_ptr,
    chunks, width, num_ids, block_size,
    PAGED: tl.constexpr, CHUNK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    end = tl.load(ends_ptr + row * chunks + c)
    start = end - tl.load(counts_ptr + row * chunks + c)
    pos = c * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    slot, valid = _row_slots(src_ptr, stride_src, lens_ptr, row, pos, width, num_ids, block_size, PAGED)
    rank = tl.cumsum(valid.to(tl.int32), 0) - 1
    tl.store(kv_indices_ptr + start + rank, slot.to(tl.int32), mask=valid)
    if c == chunks - 1:
        tl.store(kv_indptr_ptr + row + 1, end)
        if row == 0:
            tl.store(kv_indptr_ptr, 0)


@triton.jit
def _mask_empty_kernel(kv_indptr_ptr, out_ptr, lse_ptr, row_elems, heads, BLOCK: tl.constexpr, HEADS: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(kv_indptr_ptr + row + 1) == tl.load(kv_indptr_ptr + row):
        out_row = out_ptr + row.to(tl.int64) * row_elems
        for off in range(0, row_elems, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            tl.store(out_row + cols, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=cols < row_elems)
        h = tl.arange(0, HEADS)
        tl.store(lse_ptr + row.to(tl.int64) * heads + h, tl.full([HEADS], float("-inf"), tl.float32), mask=h < heads)


def bind_decode_csr(block_table, seq_lens, counts, num_blocks: int, block_size: int, num_splits: int):
    """(count, scatter) launches of `mla_decode`'s CSR:
    `count(block_table, seq_lens, counts, qo_indptr, last_page_lens, splits_indptr)` and
    `scatter(block_table, seq_lens, counts, ends, kv_indptr, kv_indices)`. The tensors
    given here are placeholders (shapes and strides are read)."""
    rows, max_blocks = block_table.shape
    width = max_blocks * block_size
    return _bind_pair(rows, width, num_blocks, block_size, num_splits, block_table, seq_lens, counts, True)


def bind_sparse_csr(indices, counts, num_slots: int, num_splits: int):
    """(count, scatter) launches of `sparse_mla`'s CSR:
    `count(indices, indices, counts, qo_indptr, last_page_lens, splits_indptr)` and
    `scatter(indices, indices, counts, ends, kv_indptr, kv_indices)` (the second tensor
    stands where `mla_decode` passes `seq_lens`; it is not read)."""
    rows, width = indices.shape
    return _bind_pair(rows, width, num_slots, 1, num_splits, indices, indices, counts, False)


def _bind_pair(rows, width, num_ids, block_size, num_splits, src, lens, counts, paged: bool):
    chunks = num_chunks(width)
    grid = (rows, chunks)
    stride = src.stride(0)
    count = bind(
        _count_kernel, grid, src, stride, lens, counts, counts, counts, counts,
        rows, chunks, width, num_ids, block_size, num_splits, PAGED=paged, CHUNK_SIZE=CHUNK,
    )
    scatter = bind(
        _scatter_kernel, grid, src, stride, lens, counts, counts, counts, counts,
        chunks, width, num_ids, block_size, PAGED=paged, CHUNK_SIZE=CHUNK,
    )
    return count, scatter


def bind_mask_empty(placeholder, rows: int, heads: int, kv_lora_rank: int):
    """`launch(kv_indptr, out, lse)`: rows r with `kv_indptr[r + 1] == kv_indptr[r]` get
    `out[r] = 0` and `lse[r, :] = -inf`; `out` is a contiguous `[rows, heads, kv_lora_rank]`,
    `lse` a contiguous `[rows, heads]` float32. `placeholder`: any tensor of their device."""
    return bind(
        _mask_empty_kernel, (rows,), placeholder, placeholder, placeholder, heads * kv_lora_rank, heads,
        BLOCK=1024, HEADS=triton.next_power_of_2(heads),
    )
