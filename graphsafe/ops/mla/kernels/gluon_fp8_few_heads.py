"""Hopper (sm_90) dense MLA decode over fp8_ds_mla records at up to 16 heads, in Gluon:
warp-specialised, the dequantisation in producer warps beside the products.

Why a fourth kernel: `gluon_wgmma.mla_attn_wgmma_kernel` (HEADS_ON_N) runs the copies,
the dequantisation, q.k, the softmax and p @ V of each tile in the same 8 warps, one
after the other: one CTA of 8 warps per SM, about 3.3 us a tile on an H100 at B 64, and
every way of putting more tiles in flight there added instructions to those warps and
lost (benchmarks/NOTES.md, "fp8_ds_mla records by TMA"). Here the work is split by kind,
so tile t + 1 is dequantised while tile t is multiplied:

- a producer partition (8 warps) walks the program's tiles. The latent bytes come by
  cp.async into four raw buffers [64, 128] (one 128-column scale tile each), a tile
  ahead; the four float32 scales into registers, a tile ahead; the bf16 rope part
  straight into the working stage. Rows without a key (padding ids, rows past the end)
  are zero-filled and read nothing. Once the consumer has released stage t % 2, each
  piece is dequantised into it (e4m3 -> float32, times its scale, rounded to bf16:
  `dequantize_records`, then the other kernels' rounding) and its raw buffer refilled
  at once with the next tile's piece (each thread reads and rewrites only the bytes its
  own copies wrote); then the stage is published (`full`);
- a consumer warpgroup (the default partition, 4 warps) scores the 16 heads with the keys
  on wgmma's M and the heads on N (s^T [64 keys, 16] = k q^T: the rope part and the four
  pieces), masks keys without an id in the cache, runs the online softmax over the keys,
  stores p^T and accumulates O^T [R, 16] += V^T p^T (V^T: the stage's pieces seen
  transposed; four accumulators [128, 16]), then releases the stage (`empty`).
Every working buffer is its own allocation written by one store: Triton's hazard analysis
does not tell slices of one buffer apart and would put a barrier between stores into it.

Program = (split, request) as the other kernels' grid at up to 16 heads (one head tile);
same plan, partials and `combine_kernel`. Ids are checked per key (as the other kernels'
checked launch), so one launch. Shared memory: q [16, R + P] 18 KiB, two working stages
[64, R + P] 144 KiB, the raw latent [64, R] 32 KiB, p^T 2 KiB (196 KiB). Requirements
(`triton.few_heads_fp8_fits`): sm_90, bf16 q of at most 16 heads, DeepSeek's records
(R = 512, P = 64), 16-byte strides. Measured (H100, graph replays, against the
heads-on-N kernel): 0.85-0.97x the time at B 1-64, ctx 8192-32768; 0.99x at B 128.
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
from graphsafe.ops.mla.kernels.gluon_wgmma import (
    _key_ids, _key_rows, _load_q_rows, _softmax_end, _softmax_keys, _split_bounds, _store_lse, _store_values,
)

HEADS = gl.constexpr(16)  # heads a program holds: wgmma's N
BLOCK_N = gl.constexpr(64)  # keys a tile: wgmma's M
NUM_WARPS = gl.constexpr(4)  # the consumer warpgroup (the default partition); the producer adds PRODUCER_WARPS
PRODUCER_WARPS = gl.constexpr(8)
PRODUCER_REGS = 112  # a producer thread's registers (ptxas: no spills down to 96); the consumer gets the rest
PIECE = gl.constexpr(128)  # latent columns a working buffer holds: one scale tile


def shared_memory_bytes(r: int, p: int) -> int:
    """Shared memory of a launch: q [16, R + P], two working stages [64, R + P] and p^T
    [64, 16] in 16 bits, the raw latent bytes [64, R], four mbarriers and 1 KiB of
    Triton's scratch (the max over keys)."""
    heads, keys = int(HEADS), int(BLOCK_N)
    return 2 * (heads * (r + p) + 2 * keys * (r + p) + keys * heads) + keys * r + 4 * 8 + 1024


def supported(r: int, p: int) -> bool:
    """The records this kernel reads: DeepSeek's (R = 512, four 128-column scale tiles; P = 64)."""
    return r == 4 * int(PIECE) and p == 64


@gluon.jit
def _program(lens_ptr, num_splits, tokens_per_split, kv_capacity):
    """(split, request row, first key, end of its keys, tiles) of this program."""
    _, split, row, start, end = _split_bounds(1, num_splits, tokens_per_split, kv_capacity)
    end = gl.minimum(end, gl.maximum(gl.load(lens_ptr + row), 0))
    return split, row, start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)


@gluon.jit
def _copy_piece(kv_ptr, rows, valid, k: gl.constexpr, raw, LOAD8: gl.constexpr):
    """cp.async latent bytes [128 k, 128 k + 128) of the records at byte offsets `rows` [64]
    into `raw` [64, 128] (16 bytes a thread, LOAD8: the threads that convert them later);
    rows not `valid` are zero-filled and touch no memory. One commit group."""
    cols = k * PIECE + gl.arange(0, PIECE, layout=gl.SliceLayout(0, LOAD8))
    cp_async(raw, kv_ptr + rows[:, None] + cols[None, :], mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _scale(kv_ptr, rows, valid, k: gl.constexpr, R: gl.constexpr):
    """The float32 scale of latent piece k of each record (0 for rows not `valid`)."""
    return gl.load((kv_ptr + rows + R).to(gl.pointer_type(gl.float32)) + k, mask=valid, other=0.0)


@gluon.jit
def _copy_rope(kv_ptr, rows, valid, rope, R: gl.constexpr, LOADP: gl.constexpr):
    """cp.async the bf16 rope part [64, 64] of the records (after the latent and its
    scales) into `rope`; rows not `valid` are zero-filled. One commit group. LOADP's rows
    are LOAD8's threads' rows: the offsets change layout for free."""
    rows = gl.convert_layout(rows, gl.SliceLayout(1, LOADP))
    valid = gl.convert_layout(valid, gl.SliceLayout(1, LOADP))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LOADP))
    base = (kv_ptr + rows + (R + 4 * (R // PIECE))).to(gl.pointer_type(rope.dtype))
    cp_async(rope, base[:, None] + cols[None, :], mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _convert_and_refill(raw, scale, work, kv_ptr, rows, valid, k: gl.constexpr, LOAD8: gl.constexpr):
    """Latent piece k: wait for its bytes (the 4 commit groups issued after them may stay in
    flight), dequantise them (e4m3 -> float32, times the row's scale, rounded to bf16:
    `dequantize_records`, then the other kernels' rounding) into `work` [64, 128], then
    refill `raw` with the next tile's piece k. Each thread reads only the bytes its own
    copies wrote and rewrites only those: no barrier between the steps."""
    async_copy.wait_group(4)
    x = raw.load(LOAD8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
    work.store(x.to(work.dtype))
    _copy_piece(kv_ptr, rows, valid, k, raw, LOAD8)


@gluon.jit
def _producer(kv_ptr, map_ptr, lens_ptr, raw, work, rope_smem, full, empty, num_splits, tokens_per_split,
              kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Producer partition (8 warps): the latent bytes of each tile come by cp.async into
    `raw` (four [64, 128] pieces) a tile ahead, the scales into registers a tile ahead, the
    rope part straight into the stage; each piece is dequantised into stage t % 2 once the
    consumer released it, and its raw buffer refilled with the next tile's piece at once;
    then the stage is published on `full`."""
    W: gl.constexpr = PRODUCER_WARPS
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [W, 1], [1, 0])  # [64, 128] bytes, 16 a thread
    LOADP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])  # [64, 64] bf16, the same rows
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD8)
    split, row, start, end, n_tiles = _program(lens_ptr, num_splits, tokens_per_split, kv_capacity)
    map_row = map_ptr + row * stride_map
    rows, valid = _key_rows(map_row, start, end, num_slots, stride_kb, stride_kt, ROWS, BLOCK_N, BLOCK_SIZE, False)
    for k in gl.static_range(4):
        _copy_piece(kv_ptr, rows, valid, k, raw[k], LOAD8)
    s0 = _scale(kv_ptr, rows, valid, 0, R)
    s1 = _scale(kv_ptr, rows, valid, 1, R)
    s2 = _scale(kv_ptr, rows, valid, 2, R)
    s3 = _scale(kv_ptr, rows, valid, 3, R)
    for t in range(n_tiles):
        cur_rows, cur_valid = rows, valid
        # The next tile's rows (past the end they are invalid: its copies read nothing).
        rows, valid = _key_rows(map_row, start + (t + 1) * BLOCK_N, end, num_slots, stride_kb, stride_kt, ROWS,
                                BLOCK_N, BLOCK_SIZE, False)
        stage = t % 2
        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1)
        _copy_rope(kv_ptr, cur_rows, cur_valid, rope_smem.index(stage), R, LOADP)
        # In flight now: pieces 0-3 of this tile, then its rope part; each step waits for
        # the oldest and adds one group.
        _convert_and_refill(raw[0], s0, work[0].index(stage), kv_ptr, rows, valid, 0, LOAD8)
        s0 = _scale(kv_ptr, rows, valid, 0, R)
        _convert_and_refill(raw[1], s1, work[1].index(stage), kv_ptr, rows, valid, 1, LOAD8)
        s1 = _scale(kv_ptr, rows, valid, 1, R)
        _convert_and_refill(raw[2], s2, work[2].index(stage), kv_ptr, rows, valid, 2, LOAD8)
        s2 = _scale(kv_ptr, rows, valid, 2, R)
        _convert_and_refill(raw[3], s3, work[3].index(stage), kv_ptr, rows, valid, 3, LOAD8)
        s3 = _scale(kv_ptr, rows, valid, 3, R)
        async_copy.wait_group(4)  # the rope part (the next tile's four pieces stay in flight)
        fence_async_shared()  # the stores and copies, before the consumer's wgmmas read them
        cta_barrier()  # every producer warp's, before the one arrive
        mbarrier.arrive(full.index(stage))
    async_copy.wait_group(0)  # the last (masked, empty) copies, before exit


@gluon.jit
def _consumer(q_ptr, map_ptr, lens_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, q_nope, q_pe, work, rope_smem, p_smem,
              full, empty, qk_scale, num_heads, num_splits, tokens_per_split, kv_capacity, num_slots, stride_qr,
              stride_qh, stride_map, stride_or, stride_oh, stride_lr, R: gl.constexpr, P: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr):
    """Consumer partition (one warpgroup): the products and the softmax of each tile with the
    keys on wgmma's M and the 16 heads on N, then the epilogue."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 16])
    S_HEADS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    S_KEYS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    split, row, start, end, n_tiles = _program(lens_ptr, num_splits, tokens_per_split, kv_capacity)
    map_row = map_ptr + row * stride_map
    _load_q_rows(q_ptr, row * stride_qr, stride_qh, num_heads, q_nope, q_pe, R, P, NUM_WARPS)
    fence_async_shared()
    cta_barrier()  # q in shared memory, for the whole warpgroup's wgmmas

    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=S_HEADS)
    l_acc = gl.zeros([BLOCK_N, HEADS], gl.float32, layout=S_MMA)
    acc0 = gl.zeros([PIECE, HEADS], gl.float32, layout=O_MMA)
    acc1 = gl.zeros([PIECE, HEADS], gl.float32, layout=O_MMA)
    acc2 = gl.zeros([PIECE, HEADS], gl.float32, layout=O_MMA)
    acc3 = gl.zeros([PIECE, HEADS], gl.float32, layout=O_MMA)
    for t in range(n_tiles):
        stage = t % 2
        n0 = start + t * BLOCK_N
        mbarrier.wait(full.index(stage), (t // 2) & 1)
        s = gl.zeros([BLOCK_N, HEADS], gl.float32, layout=S_MMA)
        s = warpgroup_mma(rope_smem.index(stage), q_pe.permute((1, 0)), s, use_acc=False, is_async=True)
        for k in gl.static_range(4):
            s = warpgroup_mma(work[k].index(stage), q_nope.slice(k * PIECE, PIECE, dim=1).permute((1, 0)), s,
                              is_async=True)
        # Which keys exist: the ids again (from L1/L2), while the products run.
        offs = n0 + gl.arange(0, BLOCK_N, layout=S_KEYS)
        _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, False)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        p, alpha, m_i, l_acc = _softmax_keys(s, key_ok, m_i, l_acc, qk_scale, 0)

        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()  # p^T in shared memory, for the whole warpgroup's wgmmas
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, O_MMA))[None, :]
        acc0 = warpgroup_mma(work[0].index(stage).permute((1, 0)), p_smem, acc0 * alpha_o, is_async=True)
        acc1 = warpgroup_mma(work[1].index(stage).permute((1, 0)), p_smem, acc1 * alpha_o, is_async=True)
        acc2 = warpgroup_mma(work[2].index(stage).permute((1, 0)), p_smem, acc2 * alpha_o, is_async=True)
        acc3 = warpgroup_mma(work[3].index(stage).permute((1, 0)), p_smem, acc3 * alpha_o, is_async=True)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
        mbarrier.arrive(empty.index(stage))  # the stage's last reader is done

    _, _, l_safe, lse = _softmax_end(l_acc, m_i, 0)
    out_args = (0, num_heads, row, split, num_heads, num_splits, out_ptr, pout_ptr, stride_or, stride_oh)
    _store_values(acc0, l_safe, 0, R, *out_args, SPLIT, True)
    _store_values(acc1, l_safe, PIECE, R, *out_args, SPLIT, True)
    _store_values(acc2, l_safe, 2 * PIECE, R, *out_args, SPLIT, True)
    _store_values(acc3, l_safe, 3 * PIECE, R, *out_args, SPLIT, True)
    heads = gl.arange(0, HEADS, layout=S_HEADS)
    _store_lse(lse, heads, num_heads, row, split, num_heads, num_splits, lse_ptr, plse_ptr, stride_lr, SPLIT)


@gluon.jit
def mla_fp8_few_heads_kernel(
    q_ptr, kv_ptr, map_ptr, lens_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, num_splits, tokens_per_split, kv_capacity, num_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_map, stride_or, stride_oh, stride_lr,
    R: gl.constexpr, P: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Dense MLA decode over fp8_ds_mla records (byte offsets and strides of kv), up to 16
    heads (module docstring). Program = (split, request row); launch with num_warps=4 (the
    consumer; the producer adds 8 warps)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_nope = gl.allocate_shared_memory(dtype, [HEADS, R], gl.NVMMASharedLayout.get_default_for([HEADS, R], dtype))
    q_pe = gl.allocate_shared_memory(dtype, [HEADS, P], gl.NVMMASharedLayout.get_default_for([HEADS, P], dtype))
    RAW_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, PIECE], gl.uint8)
    raw = (gl.allocate_shared_memory(gl.uint8, [BLOCK_N, PIECE], RAW_LAYOUT),
           gl.allocate_shared_memory(gl.uint8, [BLOCK_N, PIECE], RAW_LAYOUT),
           gl.allocate_shared_memory(gl.uint8, [BLOCK_N, PIECE], RAW_LAYOUT),
           gl.allocate_shared_memory(gl.uint8, [BLOCK_N, PIECE], RAW_LAYOUT))
    PIECE_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, PIECE], dtype)
    work = (gl.allocate_shared_memory(dtype, [2, BLOCK_N, PIECE], PIECE_LAYOUT),
            gl.allocate_shared_memory(dtype, [2, BLOCK_N, PIECE], PIECE_LAYOUT),
            gl.allocate_shared_memory(dtype, [2, BLOCK_N, PIECE], PIECE_LAYOUT),
            gl.allocate_shared_memory(dtype, [2, BLOCK_N, PIECE], PIECE_LAYOUT))
    rope_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, P], gl.NVMMASharedLayout.get_default_for([BLOCK_N, P],
                                                                                                      dtype))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEADS], gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEADS],
                                                                                                    dtype))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):  # one arrive each: the producer's, the consumer's
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (q_ptr, map_ptr, lens_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, q_nope, q_pe, work, rope_smem,
                     p_smem, full, empty, qk_scale, num_heads, num_splits, tokens_per_split, kv_capacity, num_slots,
                     stride_qr, stride_qh, stride_map, stride_or, stride_oh, stride_lr, R, P, BLOCK_SIZE, SPLIT)),
        (_producer, (kv_ptr, map_ptr, lens_ptr, raw, work, rope_smem, full, empty, num_splits, tokens_per_split,
                     kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R, BLOCK_SIZE)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
