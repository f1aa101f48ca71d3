"""Hopper (sm_90) dense MLA decode in Gluon: page tiles by TMA, two warpgroups taking turns.

Why a third kernel: `gluon_wgmma.mla_attn_wgmma_kernel` runs one tile at a time (cp.async
load, q.k, softmax, p.V, nothing in flight across the steps) and scores each tile with
N = 32 wgmmas, whose q operand is read from shared memory twice as often per product as
with N = 64. At 128 heads it keeps the tensor pipe busy 48% of the time (FlashInfer's
fa3 64%: benchmarks/NOTES.md). Here, per 64-head tile of one request:

- a one-warp loader copies q once and the key tiles by TMA, tile t into stage t % 2. A
  tile is 64 positions of one page (a page size that is a multiple of 64): 64 contiguous
  cache rows, read as 64-column chunks of the values (`VALUE_CHUNK`) and the rope part,
  each part on its own barrier, so a tile's q.k starts on the first 8 KiB that lands (H200,
  B 64 at 128 heads: 0.261-0.264 ms at ctx 8192 and 1.045-1.054 at 32768 against
  0.287-0.296 and 1.193-1.243 with the value halves as two parts; at 16 heads 0.160-0.164
  against 0.172-0.175: `benchmarks/results/h200/2026-11-29-1133_mla_decode_value_chunk_ab.txt`);
- two consumer warpgroups take the tiles in turns (FlashMLA's "seesaw"): warpgroup 0
  scores the even tiles ("A"), warpgroup 1 the odd ones ("B"), each with N = 64 wgmmas
  over all R + P columns. Each holds half of the [64, R] output (WG0 the value columns
  [0, R/2), WG1 the rest: 128 f32 registers a thread), so every tile's p meets both
  halves of its V: its own warpgroup's from registers, the other's through shared memory,
  where the tile's rope part was (its q.k is done by then);
- one running max: WG0 takes tile A's over the max so far (m_A, scale_A = 2^(m_prev -
  m_A)) and publishes p_A, m_A and scale_A; WG1 rescales its half by scale_A, adds p_A V_A,
  then takes tile B's max over m_A (m_B, scale_B) and publishes p_B and scale_B; WG0
  rescales by scale_B and adds p_B V_B. Each warpgroup keeps the row sum of its own
  tiles (scaled alike); the epilogue adds the two.
So a stage is held for one tile's q.k, softmax and products (not a pair's: that left
the loads no time), WG1 issues its q.k after WG0's (A's scores finish first and B's run
under A's softmax), and nothing stays in flight across a loop iteration (ptxas
serialises a wgmma pipeline across the back edge when registers run short).

Keys: tile t covers positions start + 64 t ... of the program's split (the plan of
plan.py, as both other kernels: same grid, same partials, `combine_kernel`). A tile
whose block id is outside the cache, or that lies past the sequence, is copied from rows
past the end of the cache view (TMA writes zeros there) and its scores are masked; the
last tile of a sequence, cut by its end, is copied and its value rows past the end are
zeroed by the loader before it publishes the tile (a NaN in an unread row never meets a
p = 0). An odd tile count leaves the last B tile empty: masked, its V zero. No id is read
per key and the program needs no scan of its ids (one launch, not the other kernels'
two).

Shared memory: q [64, R + P] 72 KiB + 2 stages [64, R + P] 144 KiB + the row statistics.
Requirements (the caller, `triton.paged_tma_fits`, checks): sm_90, bf16/fp16 q and cache,
P = 64, R = 512 or 256, a page size that is a multiple of 64, q [rows, heads, R + P] whose
heads, and a cache whose pages, are evenly spaced rows (each one 2-D view for TMA, padded
rows allowed), 16-byte aligned.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from graphsafe.kernels.gluon_compat import cta_barrier, tma_load
from graphsafe.ops.mla.kernels.gluon_wgmma import _in_range, _split_bounds

BLOCK_H = 64  # heads per program: one wgmma M
BLOCK_N = 64  # keys per tile
CONSUMER_REGS = 232
LOADER_REGS = 24  # the default partition gets the rest: 512 - 232 - 24 - 8 = 248 a thread
NUM_WARPS = 4  # the default partition (warpgroup 0); the workers add 4 + 1 warps
# Value columns of a key tile a barrier covers: each 64-column chunk of the value halves is
# copied and published on its own (FlashMLA's granularity), so a tile's q.k starts on its
# first 8 KiB; R / 2 gives the three parts a stage of before (value halves, rope part).
VALUE_CHUNK = 64

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _value_chunk(r: int) -> int:
    """Value columns a key part's barrier covers at latent width R (`VALUE_CHUNK`, at most a
    value half): the cache descriptor's box width, which the kernel reads its parts from."""
    return min(VALUE_CHUNK, r // 2)


def shared_memory_bytes(r: int, p: int) -> int:
    """Shared memory of a launch: q [64, R + P] and two key stages [64, R + P] in 16 bits,
    five [64] f32 rows (the running max, two scales, two row sums), the mbarriers (a part of
    a stage each: the value chunks and the rope part; 8 more), and 1 KiB for the alignment
    of the swizzled buffers."""
    parts = 2 * ((r // 2) // _value_chunk(r)) + 1
    return 2 * 3 * BLOCK_H * (r + p) + 5 * 4 * BLOCK_H + (2 * parts + 8) * 8 + 1024


def _descriptor(base: torch.Tensor, rows: int, row_stride: int, cols: int, block_cols: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, block_cols], _GL_DTYPES[base.dtype])
    return TensorDescriptor(base.new_empty(0), [rows, cols], [row_stride, 1], [BLOCK_N, block_cols], layout)


def tma_descriptors(q: torch.Tensor, kv_cache: torch.Tensor, r: int) -> tuple:
    """Host TMA descriptors (templates for `graphsafe.launch.bind`: a call passes q, q, kv,
    kv) of q as [rows x heads, R + P] and of the cache as [blocks x page, R + P] (their
    rows contiguous, checked by the caller): blocks [64, R / 2] (q's value halves), [64,
    VALUE_CHUNK] (the cache's value chunks, a barrier each) and [64, P] (the rope parts)."""
    rows, heads, d = q.shape
    nb, bs = kv_cache.shape[:2]
    return (_descriptor(q, rows * heads, q.stride(1), d, r // 2), _descriptor(q, rows * heads, q.stride(1), d, d - r),
            _descriptor(kv_cache, nb * bs, kv_cache.stride(1), d, _value_chunk(r)),
            _descriptor(kv_cache, nb * bs, kv_cache.stride(1), d, d - r))


@gluon.jit
def _work(lens_ptr, map_ptr, stride_map, head_tiles, num_splits, tokens_per_split, kv_capacity):
    """This program's (request row, head tile, split, first key, end of its keys, tile pairs,
    block-table row): the 64-head kernel's program layout, its keys cut at the request's length."""
    pid_h, split, row, start, end = _split_bounds(head_tiles, num_splits, tokens_per_split, kv_capacity)
    end = gl.minimum(end, gl.maximum(gl.load(lens_ptr + row), 0))
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), 64)
    return row, pid_h, split, start, end, (n_tiles + 1) // 2, map_ptr + row * stride_map


@gluon.jit
def _tile_block(map_row, pos, end, num_blocks, BLOCK_SIZE: gl.constexpr):
    """(block id, holds keys) of the tile at key position `pos` (a multiple of 64): past
    the end, or an id outside the cache, holds none (its id is not dereferenced)."""
    blk = gl.load(map_row + pos // BLOCK_SIZE, mask=pos < end, other=-1)
    return blk, (pos < end) & _in_range(blk, num_blocks)


@gluon.jit
def _zero_rows_from(tile, first, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Zero rows [first, ROWS) of the shared tile [ROWS, COLS] (one warp, generic-proxy
    stores: the caller fences before the tensor cores read the tile)."""
    # [8, 64] pieces (a 128-byte swizzle atom wide): 8 values a thread, so the loader's few
    # registers hold them.
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    for r in gl.static_range(0, ROWS, 8):
        if r + 8 > first:
            rows = r + gl.arange(0, 8, layout=gl.SliceLayout(1, L))
            for c in gl.static_range(0, COLS, 64):
                chunk = tile.slice(r, 8).slice(c, 64, dim=1)
                chunk.store(gl.where((rows < first)[:, None], chunk.load(L), 0.0))


@gluon.jit
def _load_tile(kv_desc, kv_pe_desc, k_l, k_r, k_pe, full, stage, empty, landed, fixes, phase, map_row, pos, end,
               num_blocks, cache_rows, BLOCK_SIZE: gl.constexpr):
    """Loader: the key tile at position `pos` into a stage (`k_l`, `k_r`: value columns
    [0, R/2) and [R/2, R); `k_pe`: the rope part) once both warpgroups released it
    (`empty`), published part by part on the stage's `full` barriers (`_full`: the value
    chunks of k_l, of k_r, then the rope part). A tile without keys reads rows past the
    cache view (zeros); a tile cut by the sequence's end has its value rows past the end
    zeroed first, then every part is published at once."""
    blk, has_keys = _tile_block(map_row, pos, end, num_blocks, BLOCK_SIZE)
    row = gl.where(has_keys, blk * BLOCK_SIZE + pos % BLOCK_SIZE, cache_rows)  # past the view: zeros
    keys = end - pos
    HALF: gl.constexpr = k_l.shape[1]
    CH: gl.constexpr = kv_desc.block_type.shape[1]
    NV: gl.constexpr = HALF // CH
    nbytes: gl.constexpr = 2 * NV * kv_desc.block_type.nbytes + kv_pe_desc.block_type.nbytes
    mbarrier.wait(empty, phase ^ 1)
    if has_keys & (keys < 64):  # zero V's rows past the sequence before the warpgroups see the tile
        mbarrier.expect(landed, nbytes)
        for c in gl.static_range(NV):
            tma_load(kv_desc, [row, c * CH], landed, k_l.slice(c * CH, CH, dim=1))
            tma_load(kv_desc, [row, HALF + c * CH], landed, k_r.slice(c * CH, CH, dim=1))
        tma_load(kv_pe_desc, [row, 2 * HALF], landed, k_pe)
        mbarrier.wait(landed, fixes & 1)
        _zero_rows_from(k_l, keys, 64, HALF)
        _zero_rows_from(k_r, keys, 64, HALF)
        fence_async_shared()
        for part in gl.static_range(2 * NV + 1):
            mbarrier.arrive(_full(full, part, stage))
        fixes += 1
    else:  # a barrier per part: the q.k starts on the first part that lands
        for c in gl.static_range(NV):
            bar = _full(full, c, stage)
            mbarrier.expect(bar, kv_desc.block_type.nbytes)
            tma_load(kv_desc, [row, c * CH], bar, k_l.slice(c * CH, CH, dim=1))
        for c in gl.static_range(NV):
            bar = _full(full, NV + c, stage)
            mbarrier.expect(bar, kv_desc.block_type.nbytes)
            tma_load(kv_desc, [row, HALF + c * CH], bar, k_r.slice(c * CH, CH, dim=1))
        bar = _full(full, 2 * NV, stage)
        mbarrier.expect(bar, kv_pe_desc.block_type.nbytes)
        tma_load(kv_pe_desc, [row, 2 * HALF], bar, k_pe)
    return fixes


@gluon.jit
def _loader(q_desc, q_pe_desc, kv_desc, kv_pe_desc, q_l, q_r, q_pe, k_l, k_r, k_pe, bars,
            lens_ptr, map_ptr, stride_map, num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity,
            num_blocks, cache_rows, BLOCK_SIZE: gl.constexpr):
    """Loader partition (one warp): q, then the key tiles in order, tile t into stage t % 2."""
    q_full, full, empty, landed = bars[0], bars[1], bars[2], bars[3]
    row, pid_h, split, start, end, n_pairs, map_row = _work(lens_ptr, map_ptr, stride_map, head_tiles, num_splits,
                                                            tokens_per_split, kv_capacity)
    HALF: gl.constexpr = q_desc.block_type.shape[1]
    q_row = (row * num_heads + pid_h * 64).to(gl.int32)
    mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_full, q_l)
    tma_load(q_desc, [q_row, HALF], q_full, q_r)
    tma_load(q_pe_desc, [q_row, 2 * HALF], q_full, q_pe)
    fixes = 0
    for i in range(n_pairs):
        for w in gl.static_range(2):
            fixes = _load_tile(kv_desc, kv_pe_desc, k_l.index(w), k_r.index(w), k_pe.index(w), full, w,
                               empty.index(w), landed, fixes, i & 1, map_row, start + 128 * i + 64 * w, end,
                               num_blocks, cache_rows, BLOCK_SIZE)


@gluon.jit
def _epilogue(o, l_own, m, l_smem, l_ready, WG: gl.constexpr, row, pid_h, split, num_heads, num_splits,
              out_ptr, lse_ptr, pout_ptr, plse_ptr, stride_or, stride_oh, stride_lr,
              S_ROW: gl.constexpr, O_MMA: gl.constexpr, SPLIT: gl.constexpr):
    """Both warpgroups: exchange the row sums (`l_smem`: WG0's, WG1's), then store this warpgroup's
    half of out (or the split's f32 partial); WG1 stores the lse."""
    HALF: gl.constexpr = o.shape[1]
    l_smem[WG].store(l_own)
    cta_barrier()
    mbarrier.arrive(l_ready)
    mbarrier.wait(l_ready, 0)
    l_i = l_own + l_smem[1 - WG].load(S_ROW)
    # l = 0 exactly when no key scored above -inf: out 0, lse -inf; a NaN l (a NaN or +inf
    # score) keeps both NaN, as the other kernels.
    no_key = l_i == 0.0
    l_safe = gl.where(no_key, 1.0, l_i)
    o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, O_MMA))[:, None]
    heads = pid_h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_MMA))
    cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_MMA))
    o_mask = (heads < num_heads)[:, None]
    heads_s = pid_h * 64 + gl.arange(0, 64, layout=S_ROW)
    lse = gl.where(no_key, float("-inf"), (m + gl.log2(l_safe)) * 0.6931471805599453)
    if SPLIT:
        part = (row * num_splits + split) * num_heads
        gl.store(pout_ptr + (part + heads.to(gl.int64))[:, None] * (2 * HALF) + cols[None, :], o, mask=o_mask)
        if WG == 1:
            gl.store(plse_ptr + part + heads_s, lse, mask=heads_s < num_heads)
    else:
        o_rows = out_ptr + row * stride_or + heads.to(gl.int64) * stride_oh
        gl.store(o_rows[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WG == 1:
            gl.store(lse_ptr + row * stride_lr + heads_s, lse, mask=heads_s < num_heads)


@gluon.jit
def _full(full, part, stage):
    """The barrier of part `part` of ring stage `stage` (`full`: [parts x 2, 1])."""
    return full.index(part * 2 + stage)


@gluon.jit
def _scores(q_l, q_r, q_pe, k_l, k_r, k_pe, full, stage, phase, S_MMA: gl.constexpr, CH: gl.constexpr):
    """q.k of a stage's tile: a wgmma per part (the value chunks of CH columns, the rope
    part), each issued once its part landed (`_full`), left in flight."""
    HALF: gl.constexpr = k_l.shape[1]
    NV: gl.constexpr = HALF // CH
    s = gl.zeros([64, 64], gl.float32, layout=S_MMA)  # (not read: use_acc=False)
    for c in gl.static_range(NV):
        mbarrier.wait(_full(full, c, stage), phase)
        s = warpgroup_mma(q_l.slice(c * CH, CH, dim=1), k_l.slice(c * CH, CH, dim=1).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    for c in gl.static_range(NV):
        mbarrier.wait(_full(full, NV + c, stage), phase)
        s = warpgroup_mma(q_r.slice(c * CH, CH, dim=1), k_r.slice(c * CH, CH, dim=1).permute((1, 0)), s,
                          is_async=True)
    mbarrier.wait(_full(full, 2 * NV, stage), phase)
    return warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, pos, end, has_keys, m_prev, qk_scale):
    """The probabilities of the tile at `pos` (`has_keys`: its block id is inside the cache)
    at the new running max: (p, the max, the old max's scale). Positions from `end` on, or
    in a tile without keys, score -inf."""
    offs = pos + gl.arange(0, 64, layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where(((offs < end) & has_keys)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key so far: shift by 0, not -inf - -inf
    return gl.exp2(s - m_use[:, None]), m_new, gl.exp2(m_prev - m_use)


@gluon.jit
def _consumer(q_l, q_r, q_pe, k_l, k_r, k_pe, stats, l_smem, bars,
              lens_ptr, map_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, qk_scale, stride_map,
              num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_blocks,
              stride_or, stride_oh, stride_lr, WG: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr,
              CH: gl.constexpr):
    """Warpgroup WG: scores the tiles of stage WG (WG0 the even ones, WG1 the odd ones), its
    q.k a wgmma per part of CH value columns (and the rope part), and accumulates value half
    WG of every tile. Per tile pair (A = 2i, B = 2i + 1):
    WG0: softmax A over the max so far, publish p_A (in A's rope buffer), m_A and scale_A;
         O_L = O_L scale_A + p_A V_A; once WG1 published B: O_L = O_L scale_B + p_B V_B.
    WG1: once A is published: O_R = O_R scale_A + p_A V_A; softmax B over m_A, publish p_B
         (in B's rope buffer), m_B and scale_B; O_R = O_R scale_B + p_B V_B.
    A stage is released (one arrive per warpgroup) once both of its products are done."""
    q_full, full, empty, landed, a_ready, b_ready, l_ready, a_issued = bars
    m_smem, scale_a_smem, scale_b_smem = stats
    dtype: gl.constexpr = q_l.dtype
    HALF: gl.constexpr = k_l.shape[2]
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HALF, 16])
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    row, pid_h, split, start, end, n_pairs, map_row = _work(lens_ptr, map_ptr, stride_map, head_tiles, num_splits,
                                                            tokens_per_split, kv_capacity)
    if WG == 0:
        m_smem.store(gl.full([64], float("-inf"), gl.float32, layout=S_ROW))  # the running max so far
        cta_barrier()
    mbarrier.wait(q_full, 0)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
    l_i = gl.zeros([64], gl.float32, layout=S_ROW)
    o = gl.zeros([64, HALF], gl.float32, layout=O_MMA)
    # Nothing stays in flight across iterations (a wgmma pipeline across the loop's back
    # edge runs out of registers: ptxas then serialises the wgmmas); the two warpgroups'
    # interleaved products keep the tensor cores busy instead.
    for i in range(n_pairs):
        phase = i & 1
        pos = start + 128 * i + 64 * WG
        _, has_keys = _tile_block(map_row, pos, end, num_blocks, BLOCK_SIZE)
        if WG == 1:  # after WG0's q.k: the tensor cores finish A's scores first, B's run under A's softmax
            mbarrier.wait(a_issued, phase)
        s = _scores(q_l, q_r, q_pe, k_l.index(WG), k_r.index(WG), k_pe.index(WG), full, WG, phase, S_MMA, CH)
        if WG == 0:
            mbarrier.arrive(a_issued)
        if WG == 0:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, m_i, scale_a = _softmax(s, pos, end, has_keys, m_smem.load(S_ROW), qk_scale)
            k_pe.index(0).store(p.to(dtype))  # p_A, where A's rope part was (its q.k is done)
            m_smem.store(m_i)
            scale_a_smem.store(scale_a)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(a_ready)
            l_i = l_i * scale_a + gl.sum(p, axis=1)
            o = o * gl.convert_layout(scale_a, O_ROW)[:, None]
            p_op = gl.convert_layout(p.to(dtype), P_OP)
            o = warpgroup_mma(p_op, k_l.index(0), o, is_async=True)
            mbarrier.wait(b_ready, phase)
            scale_b = scale_b_smem.load(S_ROW)
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
            mbarrier.arrive(empty.index(0))  # A: q.k and this half's product done
            l_i = l_i * scale_b
            o = o * gl.convert_layout(scale_b, O_ROW)[:, None]
            o = warpgroup_mma(k_pe.index(1), k_l.index(1), o, is_async=True)  # p_B x V_B
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            mbarrier.arrive(empty.index(1))
        else:
            mbarrier.wait(a_ready, phase)
            m_a = m_smem.load(S_ROW)
            scale_a = scale_a_smem.load(S_ROW)
            l_i = l_i * scale_a
            o = o * gl.convert_layout(scale_a, O_ROW)[:, None]
            o = warpgroup_mma(k_pe.index(0), k_r.index(0), o, is_async=True)  # p_A x V_A
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p, m_i, scale_b = _softmax(s, pos, end, has_keys, m_a, qk_scale)
            k_pe.index(1).store(p.to(dtype))  # p_B, where B's rope part was
            m_smem.store(m_i)
            scale_b_smem.store(scale_b)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(b_ready)
            l_i = l_i * scale_b + gl.sum(p, axis=1)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            mbarrier.arrive(empty.index(0))  # A: this half's product done
            o = o * gl.convert_layout(scale_b, O_ROW)[:, None]
            p_op = gl.convert_layout(p.to(dtype), P_OP)
            o = warpgroup_mma(p_op, k_r.index(1), o, is_async=True)
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
            mbarrier.arrive(empty.index(1))  # B: q.k and this half's product done
    _epilogue(o, l_i, m_i, l_smem, l_ready, WG, row, pid_h, split, num_heads, num_splits, out_ptr, lse_ptr, pout_ptr,
              plse_ptr, stride_or, stride_oh, stride_lr, S_ROW, O_MMA, SPLIT)


@gluon.jit
def mla_decode_tma_kernel(
    q_desc, q_pe_desc, kv_desc, kv_pe_desc, map_ptr, lens_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_blocks, cache_rows,
    stride_map, stride_or, stride_oh, stride_lr,
    BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """Dense MLA decode over page tiles (module docstring). Program = (64-head tile, split,
    request), the grid of the other kernels; launch with num_warps=4 (warpgroup 0; the
    workers add warpgroup 1 and the loader warp). q_desc / kv_desc: blocks [64, R / 2],
    q_pe_desc / kv_pe_desc: [64, P] (`tma_descriptors`); `cache_rows` = blocks x page size,
    the first row past the cache view."""
    dtype: gl.constexpr = q_desc.dtype
    HALF: gl.constexpr = q_desc.block_type.shape[1]
    PE: gl.constexpr = q_pe_desc.block_type.shape[1]
    q_l = gl.allocate_shared_memory(dtype, [64, HALF], q_desc.layout)
    q_r = gl.allocate_shared_memory(dtype, [64, HALF], q_desc.layout)
    q_pe = gl.allocate_shared_memory(dtype, [64, PE], q_pe_desc.layout)
    k_l = gl.allocate_shared_memory(dtype, [2, 64, HALF], kv_desc.layout)
    k_r = gl.allocate_shared_memory(dtype, [2, 64, HALF], kv_desc.layout)
    k_pe = gl.allocate_shared_memory(dtype, [2, 64, PE], kv_pe_desc.layout)
    # The running max (the last tile's), the scales of tiles A and B, the row sums (epilogue).
    ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    stats = (gl.allocate_shared_memory(gl.float32, [64], ROW), gl.allocate_shared_memory(gl.float32, [64], ROW),
             gl.allocate_shared_memory(gl.float32, [64], ROW))
    l_smem = (gl.allocate_shared_memory(gl.float32, [64], ROW), gl.allocate_shared_memory(gl.float32, [64], ROW))
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    # Per stage a barrier per part (value chunks, rope part): the q.k starts on the first that lands.
    CH: gl.constexpr = kv_desc.block_type.shape[1]  # value columns a part (`VALUE_CHUNK`)
    PARTS: gl.constexpr = 2 * (HALF // CH) + 1  # the value chunks and the rope part
    full = gl.allocate_shared_memory(gl.int64, [2 * PARTS, 1], BAR)  # `_full(full, part, stage)`
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    single = gl.allocate_shared_memory(gl.int64, [6, 1], BAR)
    q_full, landed, a_ready, b_ready, l_ready = (single.index(0), single.index(1), single.index(2), single.index(3),
                                                 single.index(4))
    a_issued = single.index(5)
    # One arrive each (the loader's with the bytes it expects, or one warpgroup's), but a
    # stage is released by both warpgroups and both publish their row sums.
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=2)
        for part in gl.static_range(PARTS):
            mbarrier.init(_full(full, part, i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(single.index(i), count=1)
    mbarrier.init(a_issued, count=1)
    mbarrier.init(l_ready, count=2)
    bars = (q_full, full, empty, landed, a_ready, b_ready, l_ready, a_issued)
    gl.warp_specialize([
        (_consumer, (q_l, q_r, q_pe, k_l, k_r, k_pe, stats, l_smem, bars,
                     lens_ptr, map_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, qk_scale, stride_map,
                     num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_blocks,
                     stride_or, stride_oh, stride_lr, 1, BLOCK_SIZE, SPLIT, CH)),
        (_consumer, (q_l, q_r, q_pe, k_l, k_r, k_pe, stats, l_smem, bars,
                     lens_ptr, map_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, qk_scale, stride_map,
                     num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_blocks,
                     stride_or, stride_oh, stride_lr, 0, BLOCK_SIZE, SPLIT, CH)),
        (_loader, (q_desc, q_pe_desc, kv_desc, kv_pe_desc, q_l, q_r, q_pe, k_l, k_r, k_pe, bars,
                   lens_ptr, map_ptr, stride_map, num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity,
                   num_blocks, cache_rows, BLOCK_SIZE)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
