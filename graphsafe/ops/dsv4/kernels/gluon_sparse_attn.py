"""Hopper (sm_90) `dsv4_sparse_attn` over fp8_dsv4 records in Gluon: 64-head tiles, two warpgroups.

The MLA ops' 64-head Gluon kernel (graphsafe/ops/mla/kernels/gluon_wgmma.py) on DeepSeek-V4's
record (graphsafe/formats/fp8_dsv4.py: 448 e4m3 NoPE bytes and 64 bf16 RoPE values per token,
the block's UE8M0 scales after all its tokens), over two caches: a query's window entries
(`indices` into `kv_cache`, cut at `topk_length`) then its compressed entries
(`extra_indices` into `extra_kv_cache`, cut at `extra_topk_length`), and the attention sink.
Single-latent MQA: the key row is 512 values (448 dequantised + 64 RoPE) and the value is
the same row, so q.k and p.V read one working tile.

Program = (64-head tile, split, token), the head tile fastest (the tiles of one token and
split read the same records back to back, the second from L2): the grid and split plan of
the Triton kernel (plan.py), so both fill the same partials and share the MLA ops'
`combine_kernel`. A program walks its split of the K + K2 key positions as two phases, the
window cache's then the compressed cache's, each the same pipeline:

- cp.async copies a tile's 64 records (gathered through the slots; a slot outside the cache,
  -1 the padding, is no key: its row is zero-filled and its score -inf) into one of two
  stages: the NoPE bytes as four pieces of power-of-two width, columns [0, 128), [128, 256),
  [256, 384) and [384, 448) (`raw0` ... `raw3`), and the RoPE values `[64, 64]` bf16 (`pe`);
  the token's 7 scale bytes are loaded into registers when its copy is issued. The tile
  after is copied while this one is awaited and computed (two tiles in flight), and the
  slots of the one after that are loaded a tile ahead.
- s = q.k as five wgmmas from shared memory, each warpgroup scoring 32 of the 64 keys: the
  RoPE part first (no conversion), while the threads dequantise NoPE columns [0, 256) into
  the bf16 working pieces `w0`, `w1` (e4m3 -> float32 in hardware, times the 64-column
  tile's scale 2^(e - 127), rounded to bf16: `dequantize_tokens` exactly); then those
  pieces' q.k while [256, 448) converts into `w2`, `w3`, then theirs. The bytes are read in
  a layout where a thread's 16 bytes lie in one scale tile (its scale is chosen per
  register, not per value: fewer live registers), and each piece is its own buffer written
  by one store: Triton's hazard analysis puts a CTA barrier before any store into a buffer
  an in-flight wgmma or an earlier store touched.
- the online softmax in f32, base 2 (the MLA kernel's `_softmax_keys`), p -> shared memory,
  and acc += p.V as five wgmmas into five accumulators (value columns [0, 128), [128, 256),
  [256, 384), [384, 448), [448, 512)), each warpgroup holding half of each one's columns.

Shared memory: q 64 KiB + 2 stages x (28 KiB of NoPE bytes + 8 KiB of RoPE) + 56 KiB of
working tile + p 8 KiB = 200 KiB (Hopper: 227 KiB). With one split the program writes out
and lse (the sink in the denominator); with several, the f32 partials. Registers: 255 a
thread with ~60 bytes of spills (ptxas of Triton 3.6 for sm_90a): the five accumulators
alone hold 128.

Only imported where Gluon exists (Triton >= 3.4); graphsafe/ops/dsv4/plan.py chooses it on
sm_90 for bf16 queries of head dim 512 over fp8_dsv4 records with 16-byte strides (the
runner checks each call's pointers) and keeps the Triton kernel for everything else.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from graphsafe.kernels.gluon_compat import cp_async, cta_barrier
# The MLA 64-head kernel's helpers: slots -> (block, offset, holds a key), program bounds,
# the online softmax, the sink and the value stores (same partial layout).
from graphsafe.ops.mla.kernels.gluon_wgmma import (
    _denominator,
    _key_ids,
    _softmax_keys,
    _split_bounds,
    _store_lse,
    _store_values,
)

NUM_WARPS = 8
BLOCK_H = 64  # one wgmma M (a warpgroup's 4 warps x 16 rows)
BLOCK_N = 64  # keys per tile: each warpgroup scores 32 of them
HEAD_DIM = 512  # the key row and the value row: 448 NoPE + 64 RoPE
# The same, as the kernels read them (a global in @gluon.jit code must be a constexpr).
TILE_H = gl.constexpr(BLOCK_H)
TILE_N = gl.constexpr(BLOCK_N)
ROW = gl.constexpr(HEAD_DIM)

# fp8_dsv4 record geometry (graphsafe.formats.fp8_dsv4)
DATA_BYTES = gl.constexpr(576)  # a token's NoPE bytes + RoPE values, inside its block
SCALE_BYTES = gl.constexpr(8)  # a token's 7 UE8M0 scales + 1 pad byte, after the block's data
NOPE = gl.constexpr(448)
POW2_M127 = gl.constexpr(5.877471754111438e-39)  # 2^-127: the UE8M0 byte 0


def shared_memory_bytes() -> int:
    """Shared memory of a launch: q [64, 512] bf16, two stages of NoPE bytes [64, 448] and
    RoPE [64, 64] bf16, the working tile [64, 448] bf16, p [64, 64] bf16, plus 1 KiB of
    Triton's scratch (the row-max reduction)."""
    q = BLOCK_H * HEAD_DIM * 2
    stages = 2 * (BLOCK_N * (256 + 128 + 64) + BLOCK_N * 64 * 2)
    work = BLOCK_N * 448 * 2
    return q + stages + work + BLOCK_H * BLOCK_N * 2 + 1024


@gluon.jit
def _ue8m0(e):
    """float32 value of UE8M0 bytes `e`: 2^(e - 127); byte 0 is 2^-127, 255 NaN."""
    e = e.to(gl.int32)
    pow2 = (e << 23).to(gl.float32, bitcast=True)
    pow2 = gl.where(e == 0, POW2_M127, pow2)
    return gl.where(e == 255, float("nan"), pow2)


@gluon.jit
def _tile_records(map_row, n0, end, num_slots, stride_kb, ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Byte offsets of the data and of the scales of the records of key positions n0 ...
    n0 + TILE_N - 1 of one index row, and which hold a key (below `end`, slot in the cache)."""
    offs = n0 + gl.arange(0, TILE_N, layout=ROWS)
    blk, off, valid = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, True)
    block = blk.to(gl.int64) * stride_kb
    return block + off * DATA_BYTES, block + (BLOCK_SIZE * DATA_BYTES + off * SCALE_BYTES), valid


@gluon.jit
def _copy_records(base, data, scales, valid, raw0, raw1, raw2, raw3, pe, LOAD: gl.constexpr, LOAD8: gl.constexpr):
    """cp.async a tile's records (byte offsets `data` of their data from `base`): NoPE bytes
    [0, 128), [128, 256), [256, 384), [384, 448) -> raw0 ... raw3, the RoPE values -> pe;
    rows without a key read as 0. Returns their 7 scale bytes (loaded now, used a tile
    later; 127, 2^0, for rows without a key)."""
    data8 = gl.convert_layout(data, gl.SliceLayout(1, LOAD8))
    valid8 = gl.convert_layout(valid, gl.SliceLayout(1, LOAD8))
    rows8 = base + data8[:, None]
    c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD8))[None, :]
    cp_async(raw0, rows8 + c128, mask=valid8[:, None])
    cp_async(raw1, rows8 + (128 + c128), mask=valid8[:, None])
    cp_async(raw2, rows8 + (256 + c128), mask=valid8[:, None])
    cp_async(raw3, rows8 + (384 + gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD8)))[None, :], mask=valid8[:, None])
    pe_rows = (base + data + NOPE).to(gl.pointer_type(pe.dtype))
    cp = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD))
    cp_async(pe, pe_rows[:, None] + cp[None, :], mask=valid[:, None])
    s8 = base + gl.convert_layout(scales, gl.SliceLayout(1, LOAD8))
    e0 = gl.load(s8, mask=valid8, other=127)
    e1 = gl.load(s8 + 1, mask=valid8, other=127)
    e2 = gl.load(s8 + 2, mask=valid8, other=127)
    e3 = gl.load(s8 + 3, mask=valid8, other=127)
    e4 = gl.load(s8 + 4, mask=valid8, other=127)
    e5 = gl.load(s8 + 5, mask=valid8, other=127)
    e6 = gl.load(s8 + 6, mask=valid8, other=127)
    return e0, e1, e2, e3, e4, e5, e6


@gluon.jit
def _dequantize(raw, work, e0, e1, LAYOUT: gl.constexpr):
    """A piece of the NoPE bytes (raw [BLOCK_N, W], W = 64 or 128: one or two 64-column
    tiles, scale bytes e0, e1) into work [BLOCK_N, W]: each e4m3 byte times its tile's scale
    in float32, rounded to work's dtype (exact: `dequantize_tokens`). One store (module
    docstring). In LAYOUT a thread's 16 bytes of a row lie in one tile and its second 16
    (W = 128) in the other, so the scale is chosen per register, not per value."""
    b = raw.load(LAYOUT)
    x = b.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    if raw.shape[1] == 64:
        scale = _ue8m0(e0)[:, None]
    else:
        cols = gl.arange(0, raw.shape[1], layout=gl.SliceLayout(0, LAYOUT))
        scale = gl.where((cols < 64)[None, :], _ue8m0(e0)[:, None], _ue8m0(e1)[:, None])
    work.store((x * scale).to(work.dtype))


@gluon.jit
def _alpha(acc, alpha):
    """acc rescaled by the softmax's alpha (one value per head row)."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _attend(kv_ptr, map_row, start, end, num_slots, stride_kb, qk_scale, m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe,
            q0, q1, q2, q3, q_pe, raw0, raw1, raw2, raw3, pe, w0, w1, w2, w3, p_smem,
            BLOCK_SIZE: gl.constexpr, S_MMA: gl.constexpr, LOAD: gl.constexpr, LOAD8: gl.constexpr):
    """The online softmax over the key positions [start, end) of one index row (`map_row`,
    slots of the cache at kv_ptr): the pipeline of the module docstring. Returns the state."""
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    S_KEYS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), TILE_N)
    # The stages may still be read by the other warpgroup's last wgmmas of a previous phase.
    cta_barrier()
    data, scales, valid = _tile_records(map_row, start, end, num_slots, stride_kb, ROWS, BLOCK_SIZE)
    e0, e1, e2, e3, e4, e5, e6 = _copy_records(kv_ptr, data, scales, valid, raw0.index(0), raw1.index(0),
                                               raw2.index(0), raw3.index(0), pe.index(0), LOAD, LOAD8)
    async_copy.commit_group()
    data, scales, valid = _tile_records(map_row, start + TILE_N, end, num_slots, stride_kb, ROWS, BLOCK_SIZE)
    for it in range(n_tiles):
        stage = it % 2
        n0 = start + it * TILE_N
        # The next tile goes into the other stage, read by the previous tile's wgmmas: the
        # barrier after each warpgroup's wait for them frees it.
        cta_barrier()
        c0, c1, c2, c3, c4, c5, c6 = e0, e1, e2, e3, e4, e5, e6
        e0, e1, e2, e3, e4, e5, e6 = _copy_records(kv_ptr, data, scales, valid, raw0.index(1 - stage),
                                                   raw1.index(1 - stage), raw2.index(1 - stage),
                                                   raw3.index(1 - stage), pe.index(1 - stage), LOAD, LOAD8)
        async_copy.commit_group()
        data, scales, valid = _tile_records(map_row, n0 + 2 * TILE_N, end, num_slots, stride_kb, ROWS, BLOCK_SIZE)
        async_copy.wait_group(1)
        # This tile's copies (and q's) are complete: the barrier shows them to every warp (and
        # frees the working tile: every warpgroup's last p.V is done), the fence to the wgmmas.
        cta_barrier()
        fence_async_shared()
        kp = pe.index(stage)
        s = gl.zeros([TILE_H, TILE_N], gl.float32, layout=S_MMA)
        s = warpgroup_mma(q_pe, kp.permute((1, 0)), s, use_acc=False, is_async=True)
        _dequantize(raw0.index(stage), w0, c0, c1, LOAD8)
        _dequantize(raw1.index(stage), w1, c2, c3, LOAD8)
        fence_async_shared()
        cta_barrier()
        s = warpgroup_mma(q0, w0.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q1, w1.permute((1, 0)), s, is_async=True)
        _dequantize(raw2.index(stage), w2, c4, c5, LOAD8)
        _dequantize(raw3.index(stage), w3, c6, c6, LOAD8)
        fence_async_shared()
        cta_barrier()
        s = warpgroup_mma(q2, w2.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q3, w3.permute((1, 0)), s, is_async=True)
        # Which keys of this tile exist, in the scores' layout: the slots again, from L1.
        offs = n0 + gl.arange(0, TILE_N, layout=S_KEYS)
        _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        p, alpha, m_i, l_acc = _softmax_keys(s, key_ok, m_i, l_acc, qk_scale, 1)

        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        cta_barrier()  # both halves of p are in shared memory
        acc0 = warpgroup_mma(p_smem, w0, _alpha(acc0, alpha), is_async=True)
        acc1 = warpgroup_mma(p_smem, w1, _alpha(acc1, alpha), is_async=True)
        acc2 = warpgroup_mma(p_smem, w2, _alpha(acc2, alpha), is_async=True)
        acc3 = warpgroup_mma(p_smem, w3, _alpha(acc3, alpha), is_async=True)
        acc_pe = warpgroup_mma(p_smem, kp, _alpha(acc_pe, alpha), is_async=True)
        acc0, acc1, acc2, acc3, acc_pe = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3, acc_pe))
    async_copy.wait_group(0)  # the last copies (masked: they read nothing) before the stages are reused
    return m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe


@gluon.jit
def _copy_q(q_ptr, q_rows, hmask, q_smem, COL0: gl.constexpr, LOAD: gl.constexpr):
    """cp.async q's columns [COL0, COL0 + width) of the rows `q_rows` (element offsets) -> q_smem."""
    cols = COL0 + gl.arange(0, q_smem.shape[1], layout=gl.SliceLayout(0, LOAD))
    cp_async(q_smem, q_ptr + q_rows[:, None] + cols[None, :], mask=hmask[:, None])


@gluon.jit
def dsv4_attn_wgmma_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, xkv_ptr, xidx_ptr, xlen_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e)
    num_heads, head_tiles, num_splits, tokens_per_split, topk, extra_topk, num_slots, extra_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_idx, stride_xkb, stride_xkt, stride_xidx,
    stride_or, stride_oh, stride_lr, stride_sink,
    BLOCK_SIZE: gl.constexpr, EXTRA_BLOCK_SIZE: gl.constexpr, HAS_EXTRA: gl.constexpr, TOPK_LENGTH: gl.constexpr,
    EXTRA_TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
):
    """The arguments of `triton_sparse_attn.dsv4_attn_kernel` (stride_kt, stride_xkt unused:
    a record's place in its block is fixed by the format); the cache is fp8_dsv4 records."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Copies: 16 bytes a thread. bf16: a warp covers 4 rows x 64 columns; NoPE bytes: 8 rows x
    # 64 bytes (a thread's 16 bytes in one 64-column scale tile; its next 16 of a 128-byte
    # piece in the next tile), the layout the dequantisation reads them in.
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    # Warpgroup w holds columns [w N / 2, (w + 1) N / 2) of each result tile.
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
    O_64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    S_HEADS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    L128: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_H, 128], dtype)
    L64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_H, 64], dtype)
    R128: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, 128], gl.uint8)
    R64: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, 64], gl.uint8)

    # q, the NoPE bytes' stages, the RoPE stages and the working tile, each in the pieces
    # [0, 128), [128, 256), [256, 384), [384, 448) (+ RoPE [448, 512)).
    q0 = gl.allocate_shared_memory(dtype, [TILE_H, 128], L128)
    q1 = gl.allocate_shared_memory(dtype, [TILE_H, 128], L128)
    q2 = gl.allocate_shared_memory(dtype, [TILE_H, 128], L128)
    q3 = gl.allocate_shared_memory(dtype, [TILE_H, 64], L64)
    q_pe = gl.allocate_shared_memory(dtype, [TILE_H, 64], L64)
    raw0 = gl.allocate_shared_memory(gl.uint8, [2, TILE_N, 128], R128)
    raw1 = gl.allocate_shared_memory(gl.uint8, [2, TILE_N, 128], R128)
    raw2 = gl.allocate_shared_memory(gl.uint8, [2, TILE_N, 128], R128)
    raw3 = gl.allocate_shared_memory(gl.uint8, [2, TILE_N, 64], R64)
    pe = gl.allocate_shared_memory(dtype, [2, TILE_N, 64], L64)
    w0 = gl.allocate_shared_memory(dtype, [TILE_N, 128], L128)
    w1 = gl.allocate_shared_memory(dtype, [TILE_N, 128], L128)
    w2 = gl.allocate_shared_memory(dtype, [TILE_N, 128], L128)
    w3 = gl.allocate_shared_memory(dtype, [TILE_N, 64], L64)
    p_smem = gl.allocate_shared_memory(dtype, [TILE_H, TILE_N], L64)

    pid_h, split, row, start, end = _split_bounds(head_tiles, num_splits, tokens_per_split, topk + extra_topk)

    # q's rows (the first phase's barrier and fence publish them to the wgmmas).
    heads = pid_h * TILE_H + gl.arange(0, TILE_H, layout=ROWS)
    hmask = heads < num_heads
    q_rows = row * stride_qr + heads.to(gl.int64) * stride_qh
    _copy_q(q_ptr, q_rows, hmask, q0, 0, LOAD)
    _copy_q(q_ptr, q_rows, hmask, q1, 128, LOAD)
    _copy_q(q_ptr, q_rows, hmask, q2, 256, LOAD)
    _copy_q(q_ptr, q_rows, hmask, q3, 384, LOAD)
    _copy_q(q_ptr, q_rows, hmask, q_pe, 448, LOAD)
    async_copy.commit_group()

    m_i = gl.full([TILE_H], float("-inf"), gl.float32, layout=S_HEADS)
    l_acc = gl.zeros([TILE_H, TILE_N], gl.float32, layout=S_MMA)
    acc0 = gl.zeros([TILE_H, 128], gl.float32, layout=O_128)
    acc1 = gl.zeros([TILE_H, 128], gl.float32, layout=O_128)
    acc2 = gl.zeros([TILE_H, 128], gl.float32, layout=O_128)
    acc3 = gl.zeros([TILE_H, 64], gl.float32, layout=O_64)
    acc_pe = gl.zeros([TILE_H, 64], gl.float32, layout=O_64)

    # This split's key positions [start, end) of the token's K + K2: window entries [0, K),
    # compressed entries [K, K + K2); each list ends at its length.
    main_len = topk
    if TOPK_LENGTH:
        main_len = gl.minimum(gl.maximum(gl.load(len_ptr + row), 0), topk)
    m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe = _attend(
        kv_ptr, idx_ptr + row * stride_idx, start, gl.minimum(end, main_len), num_slots, stride_kb, qk_scale,
        m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe, q0, q1, q2, q3, q_pe, raw0, raw1, raw2, raw3, pe, w0, w1, w2, w3,
        p_smem, BLOCK_SIZE, S_MMA, LOAD, LOAD8)
    if HAS_EXTRA:
        extra_len = extra_topk
        if EXTRA_TOPK_LENGTH:
            extra_len = gl.minimum(gl.maximum(gl.load(xlen_ptr + row), 0), extra_topk)
        m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe = _attend(
            xkv_ptr, xidx_ptr + row * stride_xidx, gl.maximum(start - topk, 0), gl.minimum(end - topk, extra_len),
            extra_slots, stride_xkb, qk_scale, m_i, l_acc, acc0, acc1, acc2, acc3, acc_pe,
            q0, q1, q2, q3, q_pe, raw0, raw1, raw2, raw3, pe, w0, w1, w2, w3, p_smem,
            EXTRA_BLOCK_SIZE, S_MMA, LOAD, LOAD8)

    heads_s = pid_h * TILE_H + gl.arange(0, TILE_H, layout=S_HEADS)
    l_out, lse = _denominator(l_acc, m_i, heads_s, num_heads, sink_ptr, stride_sink, 1, HAS_SINK, SPLIT)
    out_args = (pid_h * TILE_H, num_heads, row, split, num_heads, num_splits, out_ptr, pout_ptr, stride_or, stride_oh)
    _store_values(acc0, l_out, 0, ROW, *out_args, SPLIT)
    _store_values(acc1, l_out, 128, ROW, *out_args, SPLIT)
    _store_values(acc2, l_out, 256, ROW, *out_args, SPLIT)
    _store_values(acc3, l_out, 384, ROW, *out_args, SPLIT)
    _store_values(acc_pe, l_out, 448, ROW, *out_args, SPLIT)
    _store_lse(lse, heads_s, num_heads, row, split, num_heads, num_splits, lse_ptr, plse_ptr, stride_lr, SPLIT)
