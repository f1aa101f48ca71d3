"""Hopper (sm_90) MLA attention kernel in Gluon: 64-head tiles whose two warpgroups split the work.

Why a second kernel: for 64-head tiles the Triton kernel (triton.py) lets Triton choose
the wgmma layouts, and Triton gives a q.k dot whose scores feed another dot all 8 warps
along M. M = 64 is one warpgroup, so both warpgroups compute the whole [64, BLOCK_N]
score tile: 1.5x the tensor-core work of the tile (benchmarks/NOTES.md, "MLA at 128
heads"). Gluon states the layouts. Here each warpgroup scores half of the keys
(`warps_per_cta = [4, 2]` for q.k) and accumulates half of the R value columns (the same
split for p @ V); the probabilities go through shared memory (`p_smem`), where each
warpgroup reads the other's half of p.

Program = (64-head tile, split, query), the grid and split plan of the Triton kernel
(plan.py), so both kernels fill the same workspace partials and share `combine_kernel`.

Data flow per key tile (BLOCK_N = 64 keys, 8 warps):
- cp.async copies a tile's rows (`[BLOCK_N, R]` and `[BLOCK_N, P]`, gathered through the
  block table or the sparse slots; rows without a key, padding ids included, are
  zero-filled and their scores masked to -inf) into one of two
  shared-memory stages while the previous tile is scored. Dense tiles are issued while
  this tile's q.k wgmmas run; sparse (gathered, longer-latency) tiles before this tile
  is awaited. The rows of the tile after are read one iteration ahead, so no
  block-table or slot load sits on the critical path;
- s = q . k: `[64, 512] x [512, 64]` plus `[64, 64] x [64, 64]` wgmmas from shared memory;
- online softmax in f32 (base 2); the row sums are kept per thread (`l_acc`) and reduced
  once at the end, so the only cross-warpgroup step per tile is the row max;
- p (bf16/fp16) -> `p_smem`, then `acc += p @ V`, V being the first R columns of the very
  key rows in shared memory.
Shared memory: q 72 KiB + 2 stages of keys 144 KiB + p 8 KiB = 224 KiB (Hopper: 227 KiB).

An fp8_ds_mla cache (FP8_DS; DeepSeek's 656-byte records, `graphsafe.formats.fp8_ds_mla`; q
bf16; offsets and strides in bytes): the stages hold the tile's raw latent bytes
`[BLOCK_N, R]` (uint8) and its bf16 rope part `[BLOCK_N, P]`, each copied by cp.async as
above; each record's four float32 scales are loaded into registers when its copy is
issued. Per tile the threads dequantise the latent into a bf16 working tile (each
thread the bytes its own copies wrote: e4m3 -> float32 in hardware, times the row's scale
of that 128-column tile, rounded to bf16, which is `dequantize_records` and then
triton.py's rounding) held as two buffers `[BLOCK_N, R/2]`, one per value half: the rope
part's q.k runs while the first half converts, the first half's q.k while the second
does, and p @ V accumulates each half into its own accumulator. Two buffers, each written
by one store, because Triton's hazard analysis does not tell slices of one swizzled
buffer apart: it put a CTA barrier before every store into a buffer that a store or an
in-flight wgmma had touched (three more a tile: 5-7% at 128 heads). Shared memory: q 72 KiB
+ 2 x (32 + 8) KiB of raw stages + 64 KiB of working tile + p 8 KiB = 224 KiB. Measured
(benchmarks/NOTES.md) about 2x the Triton kernel's speed on this cache, still slower than
a bf16 cache: the conversion (a latency-bound chain per 16 bytes, run by the warps that
then wait for the tensor cores) sits between the loads and the wgmmas.

Up to 16 heads over fp8_ds_mla records (HEADS_ON_N, `triton.heads_on_n`) the two products
run transposed: s^T [BLOCK_N, 16] = k q^T (keys on wgmma's M, the heads on N, each
warpgroup 8 of them) and O^T [R, 16] += V^T p^T (V^T: the working tile seen transposed;
warpgroup w accumulates rows 64w ... 64w + 63 of every 128 for all heads). A 64-row head
tile would be three quarters padding there: the tensor work (and the accumulator, 32
registers a thread instead of 128) now scales with the 16 heads; q takes 18 KiB, p^T 2.
The softmax reduces over the keys, across each warpgroup's warps. Measured (graph
replays, benchmarks/NOTES.md "Heads on N"): 0.88-0.92x the 64-row tiles' time for dense
decode at B 8-128, 0.78-0.80x sparse, on an H100 and an H200; the dequantisation,
unchanged, is what bounds it now.

`sparse_mla`'s options as in triton.py's kernel (constexprs): `topk_length` (TOPK_LENGTH)
ends a token's keys as `seq_lens` ends a request's; the attention sink (HAS_SINK) joins
the final out's denominator in the epilogue with one split (with several, the combine).

Only imported where Gluon exists (Triton >= 3.4); the caller (triton.py) chooses this
kernel on sm_90 for R = 512 or 256, P = 64 and 16-bit dtypes, and for fp8_ds_mla records
of R = 512 (`fp8_ds_supported`), and keeps the Triton kernel for everything else (other
GPUs, ROCm, the CPU interpreter, which cannot run Gluon).
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

NUM_WARPS = 8
BLOCK_H = 64  # one wgmma M (a warpgroup's 4 warps x 16 rows)
BLOCK_N = 64  # keys per tile: each warpgroup scores 32 of them

# CHECK_IDS of a dense call (block ids outside the cache hold no key). Two launches, as
# triton.py's kernel: the first runs the programs whose split's ids are all in the cache
# (no per-key check), the second the others (each key's id reloaded to mask its score).
# Or one launch: every program runs, reloading ids only where its split holds a bad one
# (a branch per key tile, the same for the whole program); triton.py says which is used.
IDS_UNCHECKED = gl.constexpr(0)
IDS_CHECKED = gl.constexpr(1)
IDS_PER_PROGRAM = gl.constexpr(2)
HEADS_ON_N_ROWS = gl.constexpr(16)  # HEADS_ON_N: the heads a program holds (wgmma's N)


def shared_memory_bytes(r: int, p: int, fp8_ds: bool = False) -> int:
    """Shared memory of a launch (16-bit q, keys and p): q [BLOCK_H, R + P], two key
    stages [BLOCK_N, R + P] and p [BLOCK_H, BLOCK_N], plus 1 KiB of Triton's scratch (the
    row-max reduction). An fp8_ds_mla cache (`fp8_ds`): two stages of the latent bytes
    [BLOCK_N, R] and of the rope part [BLOCK_N, P], and one 16-bit working tile of the
    dequantised latent [BLOCK_N, R]."""
    if fp8_ds:
        return 2 * (BLOCK_H * (r + p) + 2 * BLOCK_N * p + BLOCK_N * r + BLOCK_H * BLOCK_N) + 2 * BLOCK_N * r + 1024
    return 2 * ((BLOCK_H + 2 * BLOCK_N) * (r + p) + BLOCK_H * BLOCK_N) + 1024


def fp8_ds_supported(r: int, p: int) -> bool:
    """The fp8_ds_mla records this kernel reads: DeepSeek's (R = 512: four scales a row)."""
    return r == 512 and p == 64


@gluon.jit
def _in_range(ids, n):
    """0 <= ids < n in one unsigned compare (a negative id wraps to a huge one); n >= 0."""
    return ids.to(gl.uint32, bitcast=True) < n


@gluon.jit
def _split_bounds(head_tiles, num_splits, tokens_per_split, kv_capacity):
    """This program's (head tile, split, query row, first key position, end of its split's
    positions): program = (head tile, split, query), the head tile varying fastest, so the
    tiles of one (query, split) read the same rows back to back, the second from L2."""
    pid = gl.program_id(0)
    pid_h = pid % head_tiles
    split = (pid // head_tiles) % num_splits
    row = (pid // (head_tiles * num_splits)).to(gl.int64)
    start = split * tokens_per_split
    return pid_h, split, row, start, gl.minimum(start + tokens_per_split, kv_capacity)


@gluon.jit
def _key_ids(map_row, offs, valid, num_slots, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr):
    """(block, offset in block, holds a key) of key positions `offs` (`valid`: below the
    end): an id outside the cache (-1, the padding, or any other) holds no key and maps
    to block 0, offset 0, so no id is ever dereferenced."""
    if SPARSE:
        slot = gl.load(map_row + offs, mask=valid, other=-1)
        valid = valid & _in_range(slot, num_slots)
        slot = gl.where(valid, slot, 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
    else:
        # Masked: block-table entries past the sequence may be garbage.
        blk = gl.load(map_row + offs // BLOCK_SIZE, mask=valid, other=0)
        valid = valid & _in_range(blk, num_slots // BLOCK_SIZE)
        blk = gl.where(valid, blk, 0)
        off = offs % BLOCK_SIZE
    return blk, off, valid


@gluon.jit
def _block_ids_in_range(map_row, start, end, num_blocks, BLOCK_SIZE: gl.constexpr):
    """Whether the block ids of key positions [start, end) are all in [0, num_blocks)."""
    CHUNK: gl.constexpr = 128
    IDS: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])  # 8 warps: NUM_WARPS
    stop = gl.cdiv(end, BLOCK_SIZE)
    bad = gl.sum(gl.zeros([CHUNK], gl.int32, layout=IDS), axis=0)
    for i0 in range(start // BLOCK_SIZE, stop, CHUNK):
        i = i0 + gl.arange(0, CHUNK, layout=IDS)
        ids = gl.load(map_row + i, mask=i < stop, other=0)
        bad += gl.sum((ids.to(gl.uint32, bitcast=True) >= num_blocks).to(gl.int32), axis=0)
    return bad == 0


@gluon.jit
def _load_q_rows(q_ptr, row_offset, stride_qh, store_heads, q_nope, q_pe, R: gl.constexpr, P: gl.constexpr,
                 WARPS: gl.constexpr = 8):
    """q's rows of heads [0, QH) (QH = q_nope's rows; heads from `store_heads` on read as 0)
    into q_nope [QH, R] and q_pe [QH, P], through registers (16-byte loads, WARPS warps)."""
    QH: gl.constexpr = q_nope.shape[0]
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])  # 2 WARPS rows x 128 columns
    LP: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])  # 2 WARPS rows x 64 columns
    heads = gl.arange(0, QH, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, L))
    base = q_ptr + row_offset + heads.to(gl.int64)[:, None] * stride_qh
    q_nope.store(gl.load(base + cols[None, :], mask=(heads < store_heads)[:, None], other=0.0))
    heads_p = gl.arange(0, QH, layout=gl.SliceLayout(1, LP))
    cols_p = gl.arange(0, P, layout=gl.SliceLayout(0, LP))
    base_p = q_ptr + row_offset + heads_p.to(gl.int64)[:, None] * stride_qh
    q_pe.store(gl.load(base_p + (R + cols_p)[None, :], mask=(heads_p < store_heads)[:, None], other=0.0))


@gluon.jit
def _with_sink(l, m, no_key, sink):
    """The softmax denominator with the attention sink (triton.py's `_with_sink`, written
    again: a Gluon kernel cannot call a `triton.jit` helper): `l + 2^(sink * log2(e) - m)`
    in base 2, so that `acc / it = (acc / l) * sigmoid(lse - sink)`; 1 for a row without a key."""
    return gl.where(no_key, 1.0, l + gl.exp2(sink * 1.4426950408889634 - m))


@gluon.jit
def _key_rows(map_row, n0, end, num_slots, stride_kb, stride_kt,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPARSE: gl.constexpr):
    """Element offsets of the cache rows of key positions n0 ... n0 + BLOCK_N - 1, and which exist.

    The mapping of triton.py's kernel, written again: a Gluon kernel cannot call a
    `triton.jit` helper, and its aranges carry layouts."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=ROWS)
    blk, off, valid = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, SPARSE)
    return blk.to(gl.int64) * stride_kb + off.to(gl.int64) * stride_kt, valid


@gluon.jit
def _copy_rows(base, rows, valid, nope_smem, pe_smem, R: gl.constexpr, P: gl.constexpr, LOAD: gl.constexpr):
    """cp.async rows [N] (element offsets from base) -> nope_smem [N, R], pe_smem [N, P]; invalid rows read as 0."""
    ptrs = base + rows[:, None]
    mask = valid[:, None]
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, LOAD))
    cp_async(nope_smem, ptrs + cols[None, :], mask=mask)
    pe_cols = gl.arange(0, P, layout=gl.SliceLayout(0, LOAD))
    cp_async(pe_smem, ptrs + (R + pe_cols)[None, :], mask=mask)


@gluon.jit
def _copy_records(base, rows, valid, raw_smem, pe_smem, R: gl.constexpr, P: gl.constexpr, LOAD: gl.constexpr,
                  LOAD8: gl.constexpr):
    """fp8_ds_mla records (byte offsets `rows` [N] from base): cp.async their latent bytes
    -> raw_smem [N, R] (uint8) and their bf16 rope part -> pe_smem [N, P]; invalid rows
    read as 0. Returns the records' four float32 scales ([N] each, 0 for invalid rows),
    loaded now so that they have landed when the tile is dequantised an iteration later."""
    rows8 = gl.convert_layout(rows, gl.SliceLayout(1, LOAD8))
    valid8 = gl.convert_layout(valid, gl.SliceLayout(1, LOAD8))
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, LOAD8))
    cp_async(raw_smem, base + rows8[:, None] + cols[None, :], mask=valid8[:, None])
    pe_rows = (base + rows + (R + 4 * (R // 128))).to(gl.pointer_type(pe_smem.dtype))
    pe_cols = gl.arange(0, P, layout=gl.SliceLayout(0, LOAD))
    cp_async(pe_smem, pe_rows[:, None] + pe_cols[None, :], mask=valid[:, None])
    scales = (base + rows8 + R).to(gl.pointer_type(gl.float32))
    s0 = gl.load(scales, mask=valid8, other=0.0)
    s1 = gl.load(scales + 1, mask=valid8, other=0.0)
    s2 = gl.load(scales + 2, mask=valid8, other=0.0)
    s3 = gl.load(scales + 3, mask=valid8, other=0.0)
    return s0, s1, s2, s3


@gluon.jit
def _dequantize_half(raw_smem, work_smem, H: gl.constexpr, scale_lo, scale_hi, LOAD8: gl.constexpr):
    """Latent columns [256 H, 256 H + 256) of a tile (two 128-column scale tiles) into
    work_smem [BLOCK_N, 256]: e4m3 bytes (raw_smem) times the row's scale of their tile, in
    float32, rounded to work_smem's dtype (`dequantize_records` exactly, then the rounding
    triton.py's kernel applies). One store: two would each get a CTA barrier before them
    (Triton's hazard analysis does not tell slices of a swizzled buffer apart). Each thread
    reads the bytes its own cp.async wrote (the copy and this load share LOAD8's threads)."""
    b = raw_smem.slice(256 * H, 256, dim=1).load(LOAD8)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, LOAD8))
    scale = gl.where((cols < 128)[None, :], scale_lo[:, None], scale_hi[:, None])
    x = b.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale
    work_smem.store(x.to(work_smem.dtype))


@gluon.jit
def _store_values(acc, l_out, COL0: gl.constexpr, R: gl.constexpr, head0, store_heads, row, split, num_heads,
                  num_splits, out_ptr, pout_ptr, stride_or, stride_oh, SPLIT: gl.constexpr,
                  HEADS_ON_N: gl.constexpr = False):
    """Value columns [COL0, COL0 + acc's width) of out (`acc / l_out`), or of the split's f32
    partial; rows from `store_heads` on are not stored (the other launch's, dense).
    acc is [heads, columns], or (HEADS_ON_N) transposed, [columns, heads]."""
    L: gl.constexpr = acc.type.layout
    HEAD_AXIS: gl.constexpr = 1 if HEADS_ON_N else 0
    COL_AXIS: gl.constexpr = 1 - HEAD_AXIS
    o = acc / gl.expand_dims(gl.convert_layout(l_out, gl.SliceLayout(COL_AXIS, L)), COL_AXIS)
    heads = head0 + gl.arange(0, acc.shape[HEAD_AXIS], layout=gl.SliceLayout(COL_AXIS, L))
    cols = gl.expand_dims(COL0 + gl.arange(0, acc.shape[COL_AXIS], layout=gl.SliceLayout(HEAD_AXIS, L)), HEAD_AXIS)
    mask = gl.expand_dims(heads < store_heads, COL_AXIS)
    if SPLIT:
        part = (row * num_splits + split) * num_heads
        gl.store(pout_ptr + gl.expand_dims(part + heads.to(gl.int64), COL_AXIS) * R + cols, o, mask=mask)
    else:
        o_rows = out_ptr + row * stride_or + heads.to(gl.int64) * stride_oh
        gl.store(gl.expand_dims(o_rows, COL_AXIS) + cols, o.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _softmax_keys(s, key_ok, m_i, l_acc, qk_scale, KEY_AXIS: gl.constexpr):
    """One key tile's online-softmax step in base 2, the keys along KEY_AXIS of the scores
    s: keys not `key_ok` score -inf. Returns (p, alpha, the new running max, l_acc): p =
    2^(s qk_scale - max), alpha the rescale of what came before, l_acc the per-thread sums
    (reduced once, by `_softmax_end`). A head with no valid key so far keeps the max -inf
    and is shifted by 0 (not -inf - -inf)."""
    s = gl.where(gl.expand_dims(key_ok, 1 - KEY_AXIS), s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=KEY_AXIS))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - gl.expand_dims(m_use, KEY_AXIS))
    return p, alpha, m_new, l_acc * gl.expand_dims(alpha, KEY_AXIS) + p


@gluon.jit
def _softmax_end(l_acc, m_i, KEY_AXIS: gl.constexpr):
    """(l, no key, l or 1 where no key, lse) per head from `_softmax_keys`' sums and max:
    l = 0 exactly when no valid key scored above -inf (lse -inf); a NaN l (a NaN or +inf
    score) keeps out and lse NaN (triton.py's kernel does the same)."""
    l_i = gl.sum(l_acc, axis=KEY_AXIS)
    no_key = l_i == 0.0
    l_safe = gl.where(no_key, 1.0, l_i)
    return l_i, no_key, l_safe, gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)


@gluon.jit
def _denominator(l_acc, m_i, heads, store_heads, sink_ptr, stride_sink, KEY_AXIS: gl.constexpr,
                 HAS_SINK: gl.constexpr, SPLIT: gl.constexpr):
    """(what out's values divide by, lse) of the heads `heads` from `_softmax_keys`' sums and
    max: the row sum (1 where no key), with the attention sink (HAS_SINK, read for heads below
    `store_heads`) where one split writes the final out; with splits the combine applies it."""
    l_i, no_key, l_safe, lse = _softmax_end(l_acc, m_i, KEY_AXIS)
    l_out = l_safe
    if HAS_SINK and not SPLIT:
        sink = gl.load(sink_ptr + heads * stride_sink, mask=heads < store_heads, other=0.0)
        l_out = _with_sink(l_i, m_i, no_key, sink)
    return l_out, lse


@gluon.jit
def _store_lse(lse, heads, store_heads, row, split, num_heads, num_splits, lse_ptr, plse_ptr, stride_lr,
               SPLIT: gl.constexpr):
    """The lse of the heads `heads` (from `store_heads` on not stored): the final lse, or (SPLIT)
    the split's partial."""
    if SPLIT:
        gl.store(plse_ptr + (row * num_splits + split) * num_heads + heads, lse, mask=heads < store_heads)
    else:
        gl.store(lse_ptr + row * stride_lr + heads, lse, mask=heads < store_heads)


@gluon.jit
def _qk(q_part, k_part, s, use_acc: gl.constexpr, HEADS_ON_N: gl.constexpr):
    """One q.k wgmma into the scores s, left in flight: q_part [heads, c] times k_part
    [keys, c] transposed, or (HEADS_ON_N) the transpose, k_part times q_part transposed."""
    if HEADS_ON_N:
        return warpgroup_mma(k_part, q_part.permute((1, 0)), s, use_acc=use_acc, is_async=True)
    else:
        return warpgroup_mma(q_part, k_part.permute((1, 0)), s, use_acc=use_acc, is_async=True)


@gluon.jit
def mla_attn_wgmma_kernel(
    q_ptr, kv_ptr, map_ptr, lens_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_map,
    stride_or, stride_oh, stride_lr, stride_sink,
    R: gl.constexpr, P: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
    CHECK_IDS: gl.constexpr, TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, FP8_DS: gl.constexpr = False,
    HEADS_ON_N: gl.constexpr = False,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(FP8_DS or not HEADS_ON_N, "heads on N: fp8_ds_mla records only")
    # HEADS_ON_N (up to 16 heads): the products transposed, keys on wgmma's M and 16 heads on
    # its N (`heads_on_n`), so the tensor work scales with the heads instead of 64 padded rows.
    QH: gl.constexpr = HEADS_ON_N_ROWS if HEADS_ON_N else BLOCK_H  # q rows in shared memory
    KEY_AXIS: gl.constexpr = 0 if HEADS_ON_N else 1  # the keys' axis of a score tile
    # Copies: 16 bytes per thread, a warp covers 4 rows x 64 columns (four 128-byte lines).
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    # fp8_ds_mla latent bytes: 16 a thread, a warp covers 4 rows x 128 bytes; the same rows
    # per thread as LOAD, so the row offsets change layout for free.
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, LOAD)
    # Warpgroup w holds columns [w * N / 2, (w + 1) * N / 2) of each result tile (HEADS_ON_N:
    # of the scores, heads 8w ... 8w + 7 of every key).
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, QH // 2 if HEADS_ON_N else BLOCK_N // 2, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, R // 2, 16])
    S_HEADS: gl.constexpr = gl.SliceLayout(KEY_AXIS, S_MMA)  # a vector per head of a score tile
    S_KEYS: gl.constexpr = gl.SliceLayout(1 - KEY_AXIS, S_MMA)  # a vector per key
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    # fp8_ds_mla: the output in two accumulators, one per half of the working tile (each
    # warpgroup holding half the columns of each; HEADS_ON_N: O^T [R/2, 16], warpgroup w
    # rows 64w ... 64w + 63 of every 128).
    O_HALF: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1] if HEADS_ON_N else [4, 2],
                                                     instr_shape=[16, QH if HEADS_ON_N else R // 4, 16])

    q_nope = gl.allocate_shared_memory(dtype, [QH, R], gl.NVMMASharedLayout.get_default_for([QH, R], dtype))
    q_pe = gl.allocate_shared_memory(dtype, [QH, P], gl.NVMMASharedLayout.get_default_for([QH, P], dtype))
    if FP8_DS:  # two stages of raw latent bytes, dequantised into one working tile
        k_raw = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, R],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.uint8))
        # The working tile in two halves (value columns [0, R/2), [R/2, R)): the second half's
        # conversion may then run beside the first half's q.k (the wgmma reads another buffer;
        # Triton's hazard analysis would put a CTA barrier before any store into the one it reads).
        HALF_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R // 2], dtype)
        k_work_lo = gl.allocate_shared_memory(dtype, [BLOCK_N, R // 2], HALF_LAYOUT)
        k_work_hi = gl.allocate_shared_memory(dtype, [BLOCK_N, R // 2], HALF_LAYOUT)
    else:
        k_nope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype))
    k_pe = gl.allocate_shared_memory(dtype, [2, BLOCK_N, P], gl.NVMMASharedLayout.get_default_for([BLOCK_N, P], dtype))
    if HEADS_ON_N:  # p^T [keys, heads]: the B operand of O^T = V^T p^T
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, QH], gl.NVMMASharedLayout.get_default_for([BLOCK_N, QH], dtype))
    else:
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))

    pid_h, split, row, start, end = _split_bounds(head_tiles, num_splits, tokens_per_split, kv_capacity)
    map_row = map_ptr + row * stride_map
    store_heads = num_heads
    if not SPARSE or TOPK_LENGTH:  # the request's length, or the token's topk_length: nothing past it is read
        end = gl.minimum(end, gl.maximum(gl.load(lens_ptr + row), 0))
    if not SPARSE:
        # Padding blocks: a program scans its split's ids. With IDS_UNCHECKED / IDS_CHECKED
        # (a dense call's two launches, as triton.py's kernel) it runs (copies q, walks its
        # keys, stores) in the launch that matches (reloading every key's id to mask the
        # scores costs 7% at B = 64 on an H200); with IDS_PER_PROGRAM (one launch) it runs,
        # reloading the ids only where its split holds one outside the cache.
        ids_ok = _block_ids_in_range(map_row, start, end, num_slots // BLOCK_SIZE, BLOCK_SIZE)
        if CHECK_IDS != IDS_PER_PROGRAM:
            mine = ids_ok != (CHECK_IDS == IDS_CHECKED)
            end = gl.where(mine, end, start)
            store_heads = gl.where(mine, num_heads, 0)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    if HEADS_ON_N:  # q's 16 rows: loaded and stored (the loop's first barrier and fence publish them)
        _load_q_rows(q_ptr, row * stride_qr, stride_qh, store_heads, q_nope, q_pe, R, P)
    else:
        heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
        q_rows = row * stride_qr + heads.to(gl.int64) * stride_qh
        _copy_rows(q_ptr, q_rows, heads < store_heads, q_nope, q_pe, R, P, LOAD)
    async_copy.commit_group()
    rows, valid = _key_rows(map_row, start, end, num_slots, stride_kb, stride_kt, ROWS, BLOCK_N, BLOCK_SIZE, SPARSE)
    if FP8_DS:  # (s0, ..., s3): the scales of the tile whose bytes are copied last
        s0, s1, s2, s3 = _copy_records(kv_ptr, rows, valid, k_raw.index(0), k_pe.index(0), R, P, LOAD, LOAD8)
    else:
        _copy_rows(kv_ptr, rows, valid, k_nope.index(0), k_pe.index(0), R, P, LOAD)
    async_copy.commit_group()
    rows, valid = _key_rows(map_row, start + BLOCK_N, end, num_slots, stride_kb, stride_kt,
                            ROWS, BLOCK_N, BLOCK_SIZE, SPARSE)

    m_i = gl.full([QH], float("-inf"), gl.float32, layout=S_HEADS)
    if HEADS_ON_N:
        l_acc = gl.zeros([BLOCK_N, QH], gl.float32, layout=S_MMA)
        acc_lo = gl.zeros([R // 2, QH], gl.float32, layout=O_HALF)
        acc_hi = gl.zeros([R // 2, QH], gl.float32, layout=O_HALF)
    else:
        l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
        if FP8_DS:
            acc_lo = gl.zeros([BLOCK_H, R // 2], gl.float32, layout=O_HALF)
            acc_hi = gl.zeros([BLOCK_H, R // 2], gl.float32, layout=O_HALF)
        else:
            acc = gl.zeros([BLOCK_H, R], gl.float32, layout=O_MMA)
    for it in range(n_tiles):
        stage = it % 2
        n0 = start + it * BLOCK_N
        # The next tile goes into the other stage, which the previous tile's wgmmas read:
        # a barrier after each warpgroup's wait for them frees it. Gathered (sparse) rows
        # have the longer latency: their next copies start first, so that two tiles are in
        # flight while this one is awaited. Dense rows are issued once this tile's q.k
        # wgmmas run, which hides the issue and drops a barrier (measured faster for
        # each: benchmarks/NOTES.md).
        if SPARSE:
            cta_barrier()
            if FP8_DS:  # this tile's scales are the previous copy's
                c0, c1, c2, c3 = s0, s1, s2, s3
                s0, s1, s2, s3 = _copy_records(kv_ptr, rows, valid, k_raw.index(1 - stage), k_pe.index(1 - stage),
                                               R, P, LOAD, LOAD8)
            else:
                _copy_rows(kv_ptr, rows, valid, k_nope.index(1 - stage), k_pe.index(1 - stage), R, P, LOAD)
            async_copy.commit_group()
            rows, valid = _key_rows(map_row, n0 + 2 * BLOCK_N, end, num_slots, stride_kb, stride_kt,
                                    ROWS, BLOCK_N, BLOCK_SIZE, SPARSE)
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
            if FP8_DS:
                c0, c1, c2, c3 = s0, s1, s2, s3
        # This tile's copies (and q's) are complete; the barrier shows them to every warp
        # (and, for an fp8_ds_mla cache, frees the working tile: every warpgroup's last
        # p @ V is done), the fence to the wgmma reads (async proxy).
        cta_barrier()
        fence_async_shared()
        kp = k_pe.index(stage)
        if FP8_DS:
            if HEADS_ON_N:  # s^T = k q^T: keys on M (`_qk`)
                s = gl.zeros([BLOCK_N, QH], gl.float32, layout=S_MMA)
            else:
                s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
            # The rope part's q.k needs no dequantisation: it runs while the first half of
            # the latent is dequantised, that half's q.k while the second half is. Each
            # thread converts the bytes its own copies wrote.
            s = _qk(q_pe, kp, s, False, HEADS_ON_N)
            raw = k_raw.index(stage)
            _dequantize_half(raw, k_work_lo, 0, c0, c1, LOAD8)
            fence_async_shared()
            cta_barrier()
            half: gl.constexpr = R // 2
            s = _qk(q_nope.slice(0, half, dim=1), k_work_lo, s, True, HEADS_ON_N)
            _dequantize_half(raw, k_work_hi, 1, c2, c3, LOAD8)
            fence_async_shared()
            cta_barrier()
            s = _qk(q_nope.slice(half, half, dim=1), k_work_hi, s, True, HEADS_ON_N)
        else:
            kn = k_nope.index(stage)
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
            s = warpgroup_mma(q_nope, kn.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe, kp.permute((1, 0)), s, is_async=True)
        if not SPARSE:
            if FP8_DS:
                s0, s1, s2, s3 = _copy_records(kv_ptr, rows, valid, k_raw.index(1 - stage), k_pe.index(1 - stage),
                                               R, P, LOAD, LOAD8)
            else:
                _copy_rows(kv_ptr, rows, valid, k_nope.index(1 - stage), k_pe.index(1 - stage), R, P, LOAD)
            async_copy.commit_group()
            rows, valid = _key_rows(map_row, n0 + 2 * BLOCK_N, end, num_slots, stride_kb, stride_kt,
                                    ROWS, BLOCK_N, BLOCK_SIZE, SPARSE)
        # Which keys of this tile exist, in the scores' layout (the copy's validity was
        # computed an iteration ahead in another layout): the ids again, from L1.
        offs = n0 + gl.arange(0, BLOCK_N, layout=S_KEYS)
        if SPARSE or CHECK_IDS == IDS_CHECKED:
            _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, SPARSE)
        elif CHECK_IDS == IDS_PER_PROGRAM:
            if ids_ok:  # (the same branch for the whole program)
                key_ok = offs < end
            else:
                _, _, key_ok = _key_ids(map_row, offs, offs < end, num_slots, BLOCK_SIZE, SPARSE)
        else:  # every id of this split is valid (scanned above)
            key_ok = offs < end
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        p, alpha, m_i, l_acc = _softmax_keys(s, key_ok, m_i, l_acc, qk_scale, KEY_AXIS)

        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()  # both halves of p are in shared memory
        if HEADS_ON_N:  # O^T += V^T p^T, V^T the working tile seen transposed
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, O_HALF))[None, :]
            acc_lo = warpgroup_mma(k_work_lo.permute((1, 0)), p_smem, acc_lo * alpha_o, is_async=True)
            acc_hi = warpgroup_mma(k_work_hi.permute((1, 0)), p_smem, acc_hi * alpha_o, is_async=True)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
        elif FP8_DS:
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_HALF))[:, None]
            acc_lo = warpgroup_mma(p_smem, k_work_lo, acc_lo * alpha_o, is_async=True)
            acc_hi = warpgroup_mma(p_smem, k_work_hi, acc_hi * alpha_o, is_async=True)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
        else:
            acc = acc * gl.convert_layout(alpha, O_ROW)[:, None]
            acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)  # the last copies (masked: they read nothing) before exit

    heads_s = pid_h * QH + gl.arange(0, QH, layout=S_HEADS)
    l_out, lse = _denominator(l_acc, m_i, heads_s, store_heads, sink_ptr, stride_sink, KEY_AXIS, HAS_SINK, SPLIT)
    out_args = (pid_h * QH, store_heads, row, split, num_heads, num_splits, out_ptr, pout_ptr, stride_or,
                stride_oh)
    if FP8_DS:
        _store_values(acc_lo, l_out, 0, R, *out_args, SPLIT, HEADS_ON_N)
        _store_values(acc_hi, l_out, R // 2, R, *out_args, SPLIT, HEADS_ON_N)
    else:
        _store_values(acc, l_out, 0, R, *out_args, SPLIT)
    _store_lse(lse, heads_s, store_heads, row, split, num_heads, num_splits, lse_ptr, plse_ptr, stride_lr, SPLIT)
