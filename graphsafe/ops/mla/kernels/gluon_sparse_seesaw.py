"""Hopper (sm_90) sparse MLA over a 16-bit cache past 16 heads, in Gluon: the dense decode's
two warpgroups taking turns ("seesaw", `gluon_paged_tma`), fed by a producer warpgroup that
gathers the rows the indices name.

Why a sixth kernel: `gluon_fp8_producer` with its rows producer (what ran these calls)
scores each 64-key tile with both consumer warpgroups at N = 32 (q, 72 KiB, read from shared
memory once per 32 keys a warpgroup) and meets at two barriers a tile; FlashMLA's sparse
prefill kept the tensor pipe 72% busy against its 43% (benchmarks/NOTES.md). Here, per
64-head tile of one query token:

- producer (a worker partition of 4 warps): q once, then the key tiles in order, tile t into
  stage t % 2, each tile as three parts (value columns [0, R/2), [R/2, R), the rope part),
  cp.async'd once both warpgroups released the stage, each part published by the copies
  themselves as they land (cp.async.mbarrier.arrive), so the producer only ever waits for a
  free stage and a tile's q.k starts on its first part. Rows without a key (an index outside the
  cache, -1 the padding, positions past the end or past `topk_length`) read nothing and
  are zero-filled;
- consumers: `gluon_paged_tma`'s schedule over those stages (its module docstring): warpgroup
  0 scores the even tiles, warpgroup 1 the odd ones, each with N = 64 wgmmas over all
  R + P columns; each holds half of the [64, R] output; one running max, published by WG0
  for tile A, taken over by WG1 for tile B; p of each tile meets the other half of its V
  through shared memory, where that tile's rope part was. Which keys of a tile exist comes
  from the ids again, per key (L1).

Program = (64-head tile, split, query) with the other kernels' grid, split plan, partials and
`combine_kernel`; the sparse options: TOPK_LENGTH, HAS_SINK (with one split). Shared memory:
q [64, R + P] 72 KiB + two stages [64, R + P] 144 KiB + the row statistics. Requirements
(`plan.sparse_seesaw_fits`): sm_90, a 16-bit q and cache, more than 16 heads, R = 512 and
P = 64, 16-byte strides and data pointers (the runner checks those per call).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from graphsafe.kernels.gluon_compat import cp_async, cta_barrier
from graphsafe.ops.mla.kernels.gluon_fp8_producer import _program
from graphsafe.ops.mla.kernels.gluon_paged_tma import _stage
from graphsafe.ops.mla.kernels.gluon_wgmma import _key_ids, _key_rows, _with_sink

BLOCK_H = 64  # heads a program holds: one wgmma M
BLOCK_N = 64  # keys a tile
NUM_WARPS = 4  # the default partition (warpgroup 0); the workers add warpgroup 1 and the producer's 4 warps
PRODUCER_WARPS = 4
CONSUMER_REGS = 232  # warpgroup 1's; the default partition gets 512 - 232 - 40 - 8 = 232
PRODUCER_REGS = 40


def shared_memory_bytes(r: int, p: int) -> int:
    """Shared memory of a launch: q [64, R + P], two key stages [64, R + P] and p_B [64, 64]
    in 16 bits, five [64] f32 rows (the running max, two scales, two row sums), 17
    mbarriers, and 1 KiB for the alignment of the swizzled buffers: 231,816 bytes of
    Hopper's 232,448 at DeepSeek's R and P."""
    return 2 * (3 * BLOCK_H * (r + p) + BLOCK_H * BLOCK_N) + 5 * 4 * BLOCK_H + 17 * 8 + 1024


def supported(r: int, p: int) -> bool:
    """DeepSeek's latent and rope widths (R = 512: two 256-column halves, one wgmma N each)."""
    return r == 512 and p == 64


@gluon.jit
def _copy_part(base, rows, valid, part, c0, LOAD: gl.constexpr):
    """cp.async rows [64] (element offsets from base, in LOAD's row layout), columns
    [c0, c0 + part's width) -> part, 64 columns a copy (few address registers a thread);
    invalid rows read as 0."""
    WIDTH: gl.constexpr = part.shape[1]
    ptrs = base + rows[:, None]
    mask = valid[:, None]
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD))[None, :]
    for c in gl.static_range(0, WIDTH, 64):
        cp_async(part.slice(c, 64, dim=1), ptrs + (c0 + c + cols), mask=mask)


@gluon.jit
def _producer(q_ptr, kv_ptr, map_ptr, lens_ptr, q_l, q_r, q_pe, k_l, k_r, k_pe, bars, num_heads, head_tiles,
              num_splits, tokens_per_split, kv_capacity, num_slots, stride_qr, stride_qh, stride_kb, stride_kt,
              stride_map, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, TOPK_LENGTH: gl.constexpr):
    """The producer partition (module docstring): q, then tile t into stage t % 2, part by
    part. Each thread's copies of a part arrive on the part's barrier when they land
    (cp.async.mbarrier.arrive: the barrier counts every producer thread), so the producer
    never waits for a copy: only for a stage to be free; both stages' tiles can be in flight."""
    q_full, full, empty_l, empty_r = bars[0], bars[1], bars[2], bars[3]
    W: gl.constexpr = gl.num_warps()
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])  # 16 bytes a thread, [64, 64] a copy
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    HALF: gl.constexpr = k_l.shape[2]
    pid_h, _, row, map_row, start, end, n_tiles = _program(map_ptr, lens_ptr, head_tiles, num_splits,
                                                           tokens_per_split, kv_capacity, stride_map, SPARSE,
                                                           TOPK_LENGTH)
    heads = pid_h * 64 + gl.arange(0, 64, layout=ROWS)
    q_rows = row * stride_qr + heads.to(gl.int64) * stride_qh
    q_ok = heads < num_heads
    _copy_part(q_ptr, q_rows, q_ok, q_l, 0, LOAD)
    _copy_part(q_ptr, q_rows, q_ok, q_r, HALF, LOAD)
    _copy_part(q_ptr, q_rows, q_ok, q_pe, 2 * HALF, LOAD)
    async_copy.mbarrier_arrive(q_full, increment_count=False)
    for i in range((n_tiles + 1) // 2):  # whole pairs: an odd count's last B tile holds no key
        phase = (i & 1) ^ 1
        rows_a, valid_a = _key_rows(map_row, start + 128 * i, end, num_slots, stride_kb, stride_kt, ROWS, 64,
                                    BLOCK_SIZE, SPARSE)  # (past the end: no key, nothing read)
        # In the order the halves are released: A's value columns [0, R/2) (WG0's A product
        # done), A's [R/2, R) and rope part (WG1's), B's [R/2, R) and rope part (WG1's B
        # product), B's [0, R/2) (WG0's).
        mbarrier.wait(empty_l.index(0), phase)
        _copy_part(kv_ptr, rows_a, valid_a, k_l.index(0), 0, LOAD)
        async_copy.mbarrier_arrive(full[0].index(0), increment_count=False)
        mbarrier.wait(empty_r.index(0), phase)
        _copy_part(kv_ptr, rows_a, valid_a, k_r.index(0), HALF, LOAD)
        async_copy.mbarrier_arrive(full[1].index(0), increment_count=False)
        _copy_part(kv_ptr, rows_a, valid_a, k_pe.index(0), 2 * HALF, LOAD)
        async_copy.mbarrier_arrive(full[2].index(0), increment_count=False)
        rows_b, valid_b = _key_rows(map_row, start + 128 * i + 64, end, num_slots, stride_kb, stride_kt, ROWS, 64,
                                    BLOCK_SIZE, SPARSE)
        mbarrier.wait(empty_r.index(1), phase)
        _copy_part(kv_ptr, rows_b, valid_b, k_r.index(1), HALF, LOAD)
        async_copy.mbarrier_arrive(full[1].index(1), increment_count=False)
        _copy_part(kv_ptr, rows_b, valid_b, k_pe.index(1), 2 * HALF, LOAD)
        async_copy.mbarrier_arrive(full[2].index(1), increment_count=False)
        mbarrier.wait(empty_l.index(1), phase)
        _copy_part(kv_ptr, rows_b, valid_b, k_l.index(1), 0, LOAD)
        async_copy.mbarrier_arrive(full[0].index(1), increment_count=False)


@gluon.jit
def _scores(q_l, q_r, q_pe, k_l, k_r, k_pe, full, phase, S_MMA: gl.constexpr, LEFT_FIRST: gl.constexpr):
    """q.k of a stage's tile: three wgmmas (the value halves, the rope part), each issued
    once its part landed (`full`: the stage's three barriers) and this thread's view of the
    producer's copies is fenced for the tensor cores; left in flight (three groups). The
    left half first (LEFT_FIRST: tile A, whose left half is copied first), else the right
    half and the rope part first (tile B)."""
    s = gl.zeros([64, 64], gl.float32, layout=S_MMA)  # (not read: use_acc=False)
    if LEFT_FIRST:
        mbarrier.wait(full[0], phase)
        fence_async_shared()
        s = warpgroup_mma(q_l, k_l.permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.wait(full[1], phase)
    fence_async_shared()
    s = warpgroup_mma(q_r, k_r.permute((1, 0)), s, use_acc=LEFT_FIRST, is_async=True)
    mbarrier.wait(full[2], phase)
    fence_async_shared()
    s = warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)
    if not LEFT_FIRST:
        mbarrier.wait(full[0], phase)
        fence_async_shared()
        s = warpgroup_mma(q_l, k_l.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, key_ok, m_prev, qk_scale):
    """The probabilities of a tile (keys not `key_ok` score -inf) at the new running max:
    (p, the max, the old max's scale)."""
    s = gl.where(key_ok[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key so far: shift by 0, not -inf - -inf
    return gl.exp2(s - m_use[:, None]), m_new, gl.exp2(m_prev - m_use)


@gluon.jit
def _epilogue(o, l_own, m, l_smem, l_ready, WG: gl.constexpr, row, pid_h, split, num_heads, num_splits,
              sink_ptr, stride_sink, out_ptr, lse_ptr, pout_ptr, plse_ptr, stride_or, stride_oh, stride_lr,
              S_ROW: gl.constexpr, O_MMA: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    """Both warpgroups: exchange the row sums, then store this warpgroup's half of out
    (divided by the row sum, with the attention sink where one split writes out) or the
    split's f32 partial; WG1 stores the lse (without the sink, as the other kernels)."""
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
    heads_s = pid_h * 64 + gl.arange(0, 64, layout=S_ROW)
    l_out = l_safe
    if HAS_SINK and not SPLIT:
        sink = gl.load(sink_ptr + heads_s * stride_sink, mask=heads_s < num_heads, other=0.0)
        l_out = _with_sink(l_i, m, no_key, sink)
    o = o / gl.convert_layout(l_out, gl.SliceLayout(1, O_MMA))[:, None]
    heads = pid_h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_MMA))
    cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_MMA))
    o_mask = (heads < num_heads)[:, None]
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
def _consumer(q_l, q_r, q_pe, k_l, k_r, k_pe, p_b_smem, stats, l_smem, bars, map_ptr, lens_ptr, sink_ptr, out_ptr, lse_ptr,
              pout_ptr, plse_ptr, qk_scale, num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity,
              num_slots, stride_map, stride_or, stride_oh, stride_lr, stride_sink, WG: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr, TOPK_LENGTH: gl.constexpr,
              HAS_SINK: gl.constexpr):
    """Warpgroup WG: `gluon_paged_tma._consumer`'s turns over the producer's stages, with the
    keys of each tile checked per key. Per tile pair (A = 2i, B = 2i + 1):
    WG0: softmax A over the max so far, publish p_A (in A's rope buffer), m_A and scale_A;
         O_L = O_L scale_A + p_A V_A; once WG1 published B: O_L = O_L scale_B + p_B V_B.
    WG1: once A is published: O_R = O_R scale_A + p_A V_A; softmax B over m_A, publish p_B
         (in B's rope buffer), m_B and scale_B; O_R = O_R scale_B + p_B V_B.
    Each stage is released by halves, each by its last reader, so the next pair's copies
    start as early as they can: A's value columns [0, R/2) by WG0 after its A product, A's
    [R/2, R) and rope part (p_A) by WG1 after its A product, B's [R/2, R) and rope part by
    WG1 after its B product, B's [0, R/2) (and p_B's buffer) by WG0 after its B product.
    WG0 takes m_B with scale_B, so both halves end at the same running max (the sink's)."""
    q_full, full, empty_l, empty_r, a_ready, b_ready, l_ready, a_issued = bars
    m_smem, scale_a_smem, scale_b_smem = stats
    dtype: gl.constexpr = q_l.dtype
    HALF: gl.constexpr = k_l.shape[2]
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HALF, 16])
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_KEYS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    pid_h, split, row, map_row, start, end, n_tiles = _program(map_ptr, lens_ptr, head_tiles, num_splits,
                                                               tokens_per_split, kv_capacity, stride_map, SPARSE,
                                                               TOPK_LENGTH)
    if WG == 0:
        m_smem.store(gl.full([64], float("-inf"), gl.float32, layout=S_ROW))  # the running max so far
        cta_barrier()
    mbarrier.wait(q_full, 0)
    fence_async_shared()  # the producer's copies of q, for the tensor cores
    m_i = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
    l_i = gl.zeros([64], gl.float32, layout=S_ROW)
    o = gl.zeros([64, HALF], gl.float32, layout=O_MMA)
    for i in range(n_tiles // 2 + n_tiles % 2):
        phase = i & 1
        offs = start + 128 * i + 64 * WG + gl.arange(0, 64, layout=S_KEYS)
        if WG == 1:  # after WG0's q.k: the tensor cores finish A's scores first, B's run under A's softmax
            mbarrier.wait(a_issued, phase)
        s = _scores(q_l, q_r, q_pe, k_l.index(WG), k_r.index(WG), k_pe.index(WG), _stage(full, WG), phase, S_MMA,
                    WG == 0)
        if WG == 0:
            mbarrier.arrive(a_issued)
        _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, SPARSE)
        if WG == 0:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, m_i, scale_a = _softmax(s, key_ok, m_smem.load(S_ROW), qk_scale)
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
            m_i = m_smem.load(S_ROW)  # m_B: what both halves end at
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
            mbarrier.arrive(empty_l.index(0))  # A's left half: its last reader done
            l_i = l_i * scale_b
            o = o * gl.convert_layout(scale_b, O_ROW)[:, None]
            o = warpgroup_mma(p_b_smem, k_l.index(1), o, is_async=True)  # p_B x V_B
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            mbarrier.arrive(empty_l.index(1))  # B's left half and p_B's buffer
        else:
            mbarrier.wait(a_ready, phase)
            m_a = m_smem.load(S_ROW)
            scale_a = scale_a_smem.load(S_ROW)
            l_i = l_i * scale_a
            o = o * gl.convert_layout(scale_a, O_ROW)[:, None]
            o = warpgroup_mma(k_pe.index(0), k_r.index(0), o, is_async=True)  # p_A x V_A
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p, m_i, scale_b = _softmax(s, key_ok, m_a, qk_scale)
            p_b_smem.store(p.to(dtype))  # p_B (B's rope part stays: B's right half is released on its own)
            m_smem.store(m_i)
            scale_b_smem.store(scale_b)
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(b_ready)
            l_i = l_i * scale_b + gl.sum(p, axis=1)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            mbarrier.arrive(empty_r.index(0))  # A's right half and rope part (p_A): the last reader done
            o = o * gl.convert_layout(scale_b, O_ROW)[:, None]
            p_op = gl.convert_layout(p.to(dtype), P_OP)
            o = warpgroup_mma(p_op, k_r.index(1), o, is_async=True)
            o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
            mbarrier.arrive(empty_r.index(1))  # B's right half and rope part: q.k and this product done
    _epilogue(o, l_i, m_i, l_smem, l_ready, WG, row, pid_h, split, num_heads, num_splits, sink_ptr, stride_sink,
              out_ptr, lse_ptr, pout_ptr, plse_ptr, stride_or, stride_oh, stride_lr, S_ROW, O_MMA, SPLIT, HAS_SINK)


@gluon.jit
def mla_sparse_seesaw_kernel(
    q_ptr, kv_ptr, map_ptr, lens_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_map,
    stride_or, stride_oh, stride_lr, stride_sink,
    R: gl.constexpr, P: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
    TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Sparse MLA over a 16-bit cache, 64-head tiles (module docstring); the arguments of
    `gluon_wgmma.mla_attn_wgmma_kernel` (element strides). Launch with num_warps=4
    (warpgroup 0; the workers add warpgroup 1 and the producer's warps)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = R // 2
    L_HALF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HALF], dtype)
    L_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, P], dtype)
    q_l = gl.allocate_shared_memory(dtype, [64, HALF], L_HALF)
    q_r = gl.allocate_shared_memory(dtype, [64, HALF], L_HALF)
    q_pe = gl.allocate_shared_memory(dtype, [64, P], L_PE)
    k_l = gl.allocate_shared_memory(dtype, [2, 64, HALF], L_HALF)
    k_r = gl.allocate_shared_memory(dtype, [2, 64, HALF], L_HALF)
    k_pe = gl.allocate_shared_memory(dtype, [2, 64, P], L_PE)
    p_b = gl.allocate_shared_memory(dtype, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], dtype))
    # The running max (the last tile's), the scales of tiles A and B, the row sums (epilogue).
    ROW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    stats = (gl.allocate_shared_memory(gl.float32, [64], ROW), gl.allocate_shared_memory(gl.float32, [64], ROW),
             gl.allocate_shared_memory(gl.float32, [64], ROW))
    l_smem = (gl.allocate_shared_memory(gl.float32, [64], ROW), gl.allocate_shared_memory(gl.float32, [64], ROW))
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    # Per stage a barrier per part (value halves, rope part): the q.k starts on the first that lands.
    full = (gl.allocate_shared_memory(gl.int64, [2, 1], BAR), gl.allocate_shared_memory(gl.int64, [2, 1], BAR),
            gl.allocate_shared_memory(gl.int64, [2, 1], BAR))
    empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)  # a stage's halves, released apart
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    single = gl.allocate_shared_memory(gl.int64, [5, 1], BAR)
    q_full, a_ready, b_ready, l_ready, a_issued = (single.index(0), single.index(1), single.index(2),
                                                   single.index(3), single.index(4))
    # One arrive each (one warpgroup's), but both warpgroups publish their row sums; q and the
    # parts of a stage land on one arrive per producer thread.
    for i in gl.static_range(2):
        mbarrier.init(empty_l.index(i), count=1)
        mbarrier.init(empty_r.index(i), count=1)
        for part in gl.static_range(3):
            mbarrier.init(full[part].index(i), count=PRODUCER_WARPS * 32)
    mbarrier.init(q_full, count=PRODUCER_WARPS * 32)
    mbarrier.init(a_ready, count=1)
    mbarrier.init(b_ready, count=1)
    mbarrier.init(l_ready, count=2)
    mbarrier.init(a_issued, count=1)
    bars = (q_full, full, empty_l, empty_r, a_ready, b_ready, l_ready, a_issued)
    gl.warp_specialize([
        (_consumer, (q_l, q_r, q_pe, k_l, k_r, k_pe, p_b, stats, l_smem, bars, map_ptr, lens_ptr, sink_ptr, out_ptr,
                     lse_ptr, pout_ptr, plse_ptr, qk_scale, num_heads, head_tiles, num_splits, tokens_per_split,
                     kv_capacity, num_slots, stride_map, stride_or, stride_oh, stride_lr, stride_sink, 0,
                     BLOCK_SIZE, SPARSE, SPLIT, TOPK_LENGTH, HAS_SINK)),
        (_consumer, (q_l, q_r, q_pe, k_l, k_r, k_pe, p_b, stats, l_smem, bars, map_ptr, lens_ptr, sink_ptr, out_ptr,
                     lse_ptr, pout_ptr, plse_ptr, qk_scale, num_heads, head_tiles, num_splits, tokens_per_split,
                     kv_capacity, num_slots, stride_map, stride_or, stride_oh, stride_lr, stride_sink, 1,
                     BLOCK_SIZE, SPARSE, SPLIT, TOPK_LENGTH, HAS_SINK)),
        (_producer, (q_ptr, kv_ptr, map_ptr, lens_ptr, q_l, q_r, q_pe, k_l, k_r, k_pe, bars, num_heads, head_tiles,
                     num_splits, tokens_per_split, kv_capacity, num_slots, stride_qr, stride_qh, stride_kb,
                     stride_kt, stride_map, BLOCK_SIZE, SPARSE, TOPK_LENGTH)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
