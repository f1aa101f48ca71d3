"""Hopper (sm_90) MLA over fp8_ds_mla records at 64-head tiles, in Gluon: a producer
warpgroup dequantises the records into the bf16 key stages of the 16-bit kernel. With FP8
off, the same kernel runs sparse calls over a 16-bit cache: the producer only copies a
tile's rows into its stage (`_produce_rows`), so the consumers no longer issue the gather
themselves (H200, T 128 at 128 / 64 heads, K 2048: 0.182 / 0.098 ms against 0.195 / 0.105
for the 64-head kernel; sparse prefill s_q 4096, 128 heads: 5.50 against 5.81-5.91 ms;
`benchmarks/results/h200/2026-11-29-0803_rows_producer_ab.txt`).

Why a fifth kernel: `gluon_wgmma.mla_attn_wgmma_kernel` (FP8_DS) converts each tile in the
8 warps that then wait for its wgmmas, so the conversion (a latency-bound chain a 16-byte
piece) runs between the loads and the products, and an fp8_ds_mla cache, 57% of the bytes,
was slower than a bf16 one (sparse, T 128, 128 heads: 0.272 vs 0.197 ms on an H200;
benchmarks/NOTES.md). Here the 64-head consumers run the 16-bit kernel's loop unchanged
over two bf16 stages [64, R + P], and a producer warpgroup fills them:

- producer (worker partition, 4 warps): for tile t, once the consumers released stage t % 2
  (`empty`), cp.async the tile's raw latent bytes into the second half of that stage's
  latent buffer (four [64, 128] byte pieces, 8 KiB each, where value pieces 2 and 3 will
  lie), its rope part straight into the stage's rope buffer, its float32 scales into
  registers; then dequantise piece k (e4m3 -> float32, times the row's scale of that
  128-column tile, rounded to bf16: `dequantize_records`, then the other kernels'
  rounding) into value columns [128 k, 128 k + 128), which is bytes [16 k, 16 k + 16) KiB
  of the stage: pieces 0 and 1 land where no raw byte lies, piece 2 over raw pieces 0 and
  1 (read by then: a barrier of the four warps first), piece 3 over raw pieces 2 and 3
  (its bytes are in registers before the barrier that precedes its store). Then the
  stage is published (`full`). The slots (or block ids) of tile t + 1 are loaded while
  tile t's copies fly. Rows without a key (a slot outside the cache, -1 the padding, a
  block id outside the cache, positions past the end) are zero-filled, scale 0, and read
  nothing;
- consumers (the default partition, 8 warps: the 16-bit kernel's two warpgroups, each
  scoring 32 of a tile's 64 keys and holding half of the [64, R] output): wait for stage
  t % 2, s = q.k as two wgmmas, the keys' validity from the ids again (L1), the online
  softmax in base 2, p -> shared memory, acc += p.V (the stage's latent as V), then
  release the stage once both warpgroups' wgmmas are done (one barrier, one arrive).
So tile t + 1 is copied and dequantised while tile t is multiplied. Measured (H200, graph
replays, `benchmarks/results/h200/2026-11-29-0440_fp8_producer_ab_*`): sparse K 2048, T 128 at 128
/ 64 heads 0.233 / 0.121 ms against 0.271 / 0.145 for the 64-head kernel's dequantising variant
(FlashMLA 0.188 / 0.115); dense decode about 1% faster. What bounds it: a tile's copy and its
conversion follow each other in the producer (about 3.6 us a tile together), because the raw
bytes can only land in a free stage; benchmarks/NOTES.md ("fp8_ds_mla past 16 heads against
FlashMLA") has the tries (the next tile's bytes in registers: slower) and what would close it.

Program = (64-head tile, split, query) with the other kernels' grid, split plan, partials
and `combine_kernel`; ids are checked per key (one launch for dense calls too). Shared
memory: q [64, R + P] 72 KiB + two stages [64, R + P] 144 KiB + p [64, 64] 8 KiB = 224
KiB, four mbarriers and Triton's scratch (the row max across the two warpgroups):
exactly the 16-bit kernel's, because the raw bytes wait inside the stage they become.
`sparse_mla`'s options as the other kernels: TOPK_LENGTH, HAS_SINK (with one split).
Requirements (`plan.fp8_producer_fits`): sm_90, bf16 q with more than 16 heads (up to 16
the heads-on-N kernels run), DeepSeek's records (R = 512, P = 64), 16-byte strides and
data pointers (the runner checks those per call).
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

from graphsafe.kernels.gluon_compat import cp_async, cta_barrier, nvmma_chunks
from graphsafe.ops.mla.kernels.gluon_wgmma import (
    _copy_rows, _denominator, _key_ids, _key_rows, _softmax_keys, _split_bounds, _store_lse, _store_values,
)

BLOCK_H = 64  # heads a program holds: one wgmma M
BLOCK_N = 64  # keys a tile: each consumer warpgroup scores 32 of them
NUM_WARPS = 8  # the consumers (the default partition); the producer adds PRODUCER_WARPS
PRODUCER_WARPS = 4
PRODUCER_REGS = 80  # a producer thread's registers (the consumers get 208; ptxas of Triton 3.6: 8 bytes of spills)
TILE_H = gl.constexpr(BLOCK_H)
TILE_N = gl.constexpr(BLOCK_N)
PIECE = gl.constexpr(128)  # latent columns of one float32 scale
PIECE_BYTES = gl.constexpr(BLOCK_N * 128)  # a raw piece [64, 128] of bytes: 8 KiB


def shared_memory_bytes(r: int, p: int) -> int:
    """Shared memory of a launch: q [64, R + P], two key stages [64, R + P] and p [64, 64]
    in bf16, four mbarriers and 1 KiB of Triton's scratch (the row max)."""
    return 2 * (BLOCK_H * (r + p) + 2 * BLOCK_N * (r + p) + BLOCK_H * BLOCK_N) + 4 * 8 + 1024


def supported(r: int, p: int) -> bool:
    """The records this kernel reads: DeepSeek's (R = 512, four 128-column scale tiles; P = 64)."""
    return r == 512 and p == 64


@gluon.jit
def _program(map_ptr, lens_ptr, head_tiles, num_splits, tokens_per_split, kv_capacity, stride_map,
             SPARSE: gl.constexpr, TOPK_LENGTH: gl.constexpr):
    """(head tile, split, query row, its index row, first key, end of its keys, tiles)."""
    pid_h, split, row, start, end = _split_bounds(head_tiles, num_splits, tokens_per_split, kv_capacity)
    if not SPARSE or TOPK_LENGTH:  # the request's length, or the token's topk_length: nothing past it is read
        end = gl.minimum(end, gl.maximum(gl.load(lens_ptr + row), 0))
    return pid_h, split, row, map_ptr + row * stride_map, start, end, gl.cdiv(gl.maximum(end - start, 0), TILE_N)


@gluon.jit
def _dequantize(raw, out, scale, BARRIER: gl.constexpr, LOAD8: gl.constexpr):
    """A raw piece [64, 128] of e4m3 bytes times each row's `scale` (float32), rounded to
    out's dtype, into `out` [64, 128]. BARRIER: the store overwrites raw bytes the four
    warps read (this piece's, or earlier ones'): all of them are read before any is written."""
    x = raw.load(LOAD8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
    if BARRIER:
        cta_barrier()
    out.store(x.to(out.dtype))


@gluon.jit
def _producer(kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits, tokens_per_split,
              kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R: gl.constexpr, P: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, TOPK_LENGTH: gl.constexpr, FP8: gl.constexpr):
    """The producer partition (module docstring): copies and dequantises tile t into stage t % 2
    (FP8), or copies a 16-bit cache's rows into it."""
    if FP8:
        _produce_records(kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits,
                         tokens_per_split, kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R, P, BLOCK_SIZE,
                         SPARSE, TOPK_LENGTH)
    else:
        _produce_rows(kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits,
                      tokens_per_split, kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R, P, BLOCK_SIZE,
                      SPARSE, TOPK_LENGTH)


@gluon.jit
def _produce_rows(kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits, tokens_per_split,
                  kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R: gl.constexpr, P: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, TOPK_LENGTH: gl.constexpr):
    """A 16-bit cache's tile t: its rows cp.async'd into stage t % 2 once the consumers freed
    it, the next tile's rows looked up while they fly, then published; rows without a key
    read nothing and are zero-filled."""
    W: gl.constexpr = gl.num_warps()
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])  # 16 bytes a thread
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    _, _, _, map_row, start, end, n_tiles = _program(map_ptr, lens_ptr, head_tiles, num_splits, tokens_per_split,
                                                     kv_capacity, stride_map, SPARSE, TOPK_LENGTH)
    rows, valid = _key_rows(map_row, start, end, num_slots, stride_kb, stride_kt, ROWS, TILE_N, BLOCK_SIZE, SPARSE)
    for t in range(n_tiles):
        stage = t % 2
        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1)
        _copy_rows(kv_ptr, rows, valid, k_nope.index(stage), k_pe.index(stage), R, P, LOAD)
        async_copy.commit_group()
        rows, valid = _key_rows(map_row, start + (t + 1) * TILE_N, end, num_slots, stride_kb, stride_kt, ROWS,
                                TILE_N, BLOCK_SIZE, SPARSE)
        async_copy.wait_group(0)
        fence_async_shared()  # the copies, before the consumers' wgmmas read them
        cta_barrier()  # every producer thread's copies have landed, before the one arrive
        mbarrier.arrive(full.index(stage))


@gluon.jit
def _produce_records(kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits,
                     tokens_per_split, kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R: gl.constexpr,
                     P: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, TOPK_LENGTH: gl.constexpr):
    """fp8_ds_mla records' tile t: copied and dequantised into stage t % 2 (module docstring)."""
    W: gl.constexpr = gl.num_warps()
    # 16 bytes a thread; a warp covers 4 rows x 128 bytes (a piece's row is one 128-byte line).
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [W, 1], [1, 0])
    LOADP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])  # the rope part [64, 64], same rows
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD8)
    _, _, _, map_row, start, end, n_tiles = _program(map_ptr, lens_ptr, head_tiles, num_splits, tokens_per_split,
                                                     kv_capacity, stride_map, SPARSE, TOPK_LENGTH)
    # The key stages as [16, 64, 128] byte chunks (8 KiB each, stage s = chunks 8 s ... 8 s + 7):
    # value columns [128 k, 128 k + 128) of stage s are chunks 8 s + 2 k and 8 s + 2 k + 1,
    # raw piece j waits in chunk 8 s + 4 + j.
    chunks = nvmma_chunks(k_nope, gl.uint8, 16, TILE_N, PIECE)
    cols8 = gl.arange(0, PIECE, layout=gl.SliceLayout(0, LOAD8))[None, :]
    cols_p = gl.arange(0, P, layout=gl.SliceLayout(0, LOADP))[None, :]
    rows, valid = _key_rows(map_row, start, end, num_slots, stride_kb, stride_kt, ROWS, TILE_N, BLOCK_SIZE, SPARSE)
    for t in range(n_tiles):
        stage = t % 2
        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1)
        src = kv_ptr + rows[:, None]
        for j in gl.static_range(4):
            cp_async(chunks.index(8 * stage + 4 + j), src + (j * PIECE + cols8), mask=valid[:, None])
        rows_p = gl.convert_layout(rows, gl.SliceLayout(1, LOADP))  # the same threads' rows: free
        valid_p = gl.convert_layout(valid, gl.SliceLayout(1, LOADP))
        rope = (kv_ptr + rows_p + (R + 4 * (R // PIECE))).to(gl.pointer_type(k_pe.dtype))
        cp_async(k_pe.index(stage), rope[:, None] + cols_p, mask=valid_p[:, None])
        async_copy.commit_group()
        scales = (kv_ptr + rows + R).to(gl.pointer_type(gl.float32))
        s0 = gl.load(scales, mask=valid, other=0.0)
        s1 = gl.load(scales + 1, mask=valid, other=0.0)
        s2 = gl.load(scales + 2, mask=valid, other=0.0)
        s3 = gl.load(scales + 3, mask=valid, other=0.0)
        # The next tile's rows (past the end they hold no key: its copies read nothing).
        rows, valid = _key_rows(map_row, start + (t + 1) * TILE_N, end, num_slots, stride_kb, stride_kt, ROWS,
                                TILE_N, BLOCK_SIZE, SPARSE)
        async_copy.wait_group(0)
        cta_barrier()  # every producer thread's copies have landed
        work = k_nope.index(stage)
        _dequantize(chunks.index(8 * stage + 4), work.slice(0, PIECE, dim=1), s0, False, LOAD8)
        _dequantize(chunks.index(8 * stage + 5), work.slice(PIECE, PIECE, dim=1), s1, False, LOAD8)
        _dequantize(chunks.index(8 * stage + 6), work.slice(2 * PIECE, PIECE, dim=1), s2, True, LOAD8)
        _dequantize(chunks.index(8 * stage + 7), work.slice(3 * PIECE, PIECE, dim=1), s3, True, LOAD8)
        fence_async_shared()  # the stores and the rope copies, before the consumers' wgmmas read them
        cta_barrier()  # every producer warp's, before the one arrive
        mbarrier.arrive(full.index(stage))


@gluon.jit
def _consumer(q_ptr, map_ptr, lens_ptr, sink_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, q_nope, q_pe, k_nope, k_pe,
              p_smem, full, empty, qk_scale, num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity,
              num_slots, stride_qr, stride_qh, stride_map, stride_or, stride_oh, stride_lr, stride_sink,
              R: gl.constexpr, P: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr,
              SPLIT: gl.constexpr, TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr):
    """The consumer partition (two warpgroups): the 16-bit kernel's products and softmax
    over the stages the producer publishes, then the epilogue."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    # Warpgroup w holds columns [w N / 2, (w + 1) N / 2) of each result tile.
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, TILE_N // 2, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16])
    S_HEADS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_KEYS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    pid_h, split, row, map_row, start, end, n_tiles = _program(map_ptr, lens_ptr, head_tiles, num_splits,
                                                               tokens_per_split, kv_capacity, stride_map, SPARSE,
                                                               TOPK_LENGTH)
    heads = pid_h * TILE_H + gl.arange(0, TILE_H, layout=ROWS)
    _copy_rows(q_ptr, row * stride_qr + heads.to(gl.int64) * stride_qh, heads < num_heads, q_nope, q_pe, R, P, LOAD)
    async_copy.commit_group()
    async_copy.wait_group(0)
    cta_barrier()  # q in shared memory, from every consumer thread's copies
    fence_async_shared()

    m_i = gl.full([TILE_H], float("-inf"), gl.float32, layout=S_HEADS)
    l_acc = gl.zeros([TILE_H, TILE_N], gl.float32, layout=S_MMA)
    acc = gl.zeros([TILE_H, R], gl.float32, layout=O_MMA)
    for t in range(n_tiles):
        stage = t % 2
        mbarrier.wait(full.index(stage), (t // 2) & 1)
        kn = k_nope.index(stage)
        s = gl.zeros([TILE_H, TILE_N], gl.float32, layout=S_MMA)
        s = warpgroup_mma(q_nope, kn.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, k_pe.index(stage).permute((1, 0)), s, is_async=True)
        # Which keys of this tile exist, in the scores' layout: the ids again, from L1.
        offs = start + t * TILE_N + gl.arange(0, TILE_N, layout=S_KEYS)
        _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, SPARSE)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        p, alpha, m_i, l_acc = _softmax_keys(s, key_ok, m_i, l_acc, qk_scale, 1)

        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()  # both halves of p are in shared memory
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
        acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        cta_barrier()  # both warpgroups' products are done with the stage and with p
        mbarrier.arrive(empty.index(stage))

    heads_s = pid_h * TILE_H + gl.arange(0, TILE_H, layout=S_HEADS)
    l_out, lse = _denominator(l_acc, m_i, heads_s, num_heads, sink_ptr, stride_sink, 1, HAS_SINK, SPLIT)
    _store_values(acc, l_out, 0, R, pid_h * TILE_H, num_heads, row, split, num_heads, num_splits, out_ptr, pout_ptr,
                  stride_or, stride_oh, SPLIT)
    _store_lse(lse, heads_s, num_heads, row, split, num_heads, num_splits, lse_ptr, plse_ptr, stride_lr, SPLIT)


@gluon.jit
def mla_fp8_producer_kernel(
    q_ptr, kv_ptr, map_ptr, lens_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_map,
    stride_or, stride_oh, stride_lr, stride_sink,
    R: gl.constexpr, P: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
    TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    FP8: gl.constexpr = True,
):
    """MLA over fp8_ds_mla records (FP8: byte offsets and strides of kv) or a 16-bit cache
    (kv of q's dtype, element strides), 64-head tiles (module docstring); the arguments of
    `gluon_wgmma.mla_attn_wgmma_kernel`. Launch with num_warps=8 (the consumers; the
    producer adds 4 warps)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_nope = gl.allocate_shared_memory(dtype, [TILE_H, R], gl.NVMMASharedLayout.get_default_for([TILE_H, R], dtype))
    q_pe = gl.allocate_shared_memory(dtype, [TILE_H, P], gl.NVMMASharedLayout.get_default_for([TILE_H, P], dtype))
    k_nope = gl.allocate_shared_memory(dtype, [2, TILE_N, R], gl.NVMMASharedLayout.get_default_for([TILE_N, R], dtype))
    k_pe = gl.allocate_shared_memory(dtype, [2, TILE_N, P], gl.NVMMASharedLayout.get_default_for([TILE_N, P], dtype))
    p_smem = gl.allocate_shared_memory(dtype, [TILE_H, TILE_N],
                                       gl.NVMMASharedLayout.get_default_for([TILE_H, TILE_N], dtype))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):  # one arrive each: the producer's, the consumers'
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (q_ptr, map_ptr, lens_ptr, sink_ptr, out_ptr, lse_ptr, pout_ptr, plse_ptr, q_nope, q_pe, k_nope,
                     k_pe, p_smem, full, empty, qk_scale, num_heads, head_tiles, num_splits, tokens_per_split,
                     kv_capacity, num_slots, stride_qr, stride_qh, stride_map, stride_or, stride_oh, stride_lr,
                     stride_sink, R, P, BLOCK_SIZE, SPARSE, SPLIT, TOPK_LENGTH, HAS_SINK)),
        (_producer, (kv_ptr, map_ptr, lens_ptr, k_nope, k_pe, full, empty, head_tiles, num_splits, tokens_per_split,
                     kv_capacity, num_slots, stride_kb, stride_kt, stride_map, R, P, BLOCK_SIZE, SPARSE,
                     TOPK_LENGTH, FP8)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
