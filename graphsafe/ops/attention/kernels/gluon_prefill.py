"""Hopper (sm_90) kernels of `flash_attn_varlen` in Gluon: bf16/fp16, wgmma with the two
products of a key tile in flight together.

Why: Triton's kernel (triton_prefill.py) waits for each product before the next starts:
q.k of a tile, its softmax, then p.V, so the tensor cores idle through every softmax
(3.35 ms, 329 TFLOP/s on an H200 at 8 x 4096 causal, 32/8 heads; FlashAttention-3 1.74).
Here the q.k of tile j + 1 is issued, and then p.V of tile j, before the softmax of tile
j + 1: that softmax runs while p.V still computes (FlashAttention-3's intra-warpgroup
overlap). Each warpgroup owns 64 query rows; per key tile it computes
- s = q K^T from shared memory (q [64, D], K-major K^T), f32 (D = 192: three wgmma
  chains of 64 columns, a shared buffer being a power of two wide);
- the online softmax in f32, base 2, one FMA per score (log2(e) folded into qk_scale > 0),
  masked only in the tiles the causal diagonal or the sequence's end cuts through;
- acc += p V with p in registers (the score tile's layout is the A operand's: no shuffle)
  and V [BLOCK_N, Dv] from shared memory.

Three kernels share that loop (`plan.varlen_kernel` picks):
- `varlen_fwd_tma_kernel` (128-row blocks, D = Dv = 128 or MLA prefill's D = 192,
  Dv = 128, heads contiguous): persistent (a program per SM walks the work tiles,
  sequence by sequence: dealt statically, or claimed one at a time from a ticket counter
  where `plan.tma_claims_tiles` measured that faster) and warp-specialised: one loader
  warp issues a TMA copy per
  tile (q into two buffers, K and V into a ring), two consumer warpgroups compute,
  synchronised by mbarriers only, so the consumers never wait for each other and a
  program's next tile loads while its current one computes (1.99 ms at the shape
  above). A sequence's tiles run in sections of heads whose K/V fits a share of L2
  (`plan.tma_heads_per_section`).
  TMA reads whole tiles: rows past a sequence are masked (K) or zeroed in shared memory
  before use (V, `_zero_rows_outside`), so no neighbour's NaN meets a p = 0. Shared memory
  at D = 128: two q buffers [128, D] 64 KiB + 2 stages x (K 32 + V 32) KiB = 192 KiB;
  at D = 192: one q buffer 48 KiB + 2 stages x (K 48 + V 32) KiB = 208 KiB (a consumer
  releases q after its last q.k, so the next tile's q lands during the last p.V).
  Its FP8 variant (constexpr) serves the fp8 path at D = Dv = 128: q, k and V^T (the
  fp8 path's transposed copy, so both products read K-major operands as fp8 wgmma
  needs) by TMA, p through shared memory (Triton 3.6 cannot keep 8-bit registers of an
  in-flight wgmma), descales per tensor or per (sequence, head), P scaled by P_SCALE as
  in the Triton kernel; V^T tiles start at 16-token columns (TMA), so the keys run in a
  frame from the sequence's first token rounded down to 16 (1.63 ms at the shape above
  on fp8 inputs).
- `varlen_fwd_ws_kernel` (128-row blocks at D = 128 in other layouts): the same with a
  loader warpgroup of 16-byte cp.async copies (2.25 ms); keys past the sequence (or
  past the last tile a block reads) are zero-filled, never read.
- `varlen_fwd_wgmma_kernel` (64-row blocks, D = 64): one program per (query block,
  sequence, head), heaviest causal block first; every warp loads (cp.async) and
  computes, a CTA barrier per tile publishing the copies (2.60 ms at the shape above
  with 128-row blocks). Shared memory: q + 2 stages of K and V.

`paged_fwd_tma_kernel` (`paged_attention_prefill`) is `varlen_fwd_tma_kernel` with its
loader walking the block table: a key tile as boxes of min(block size, BLOCK_N) rows, each
a TMA copy from its cache block (`_tma_boxes`); padding blocks are TMA's zeros and their
keys hidden (`_bad_boxes`).

The TMA kernels take the op's variants as constexprs (16-bit only): a sliding window
(`_window_tiles`: tiles from the first key a work tile's first row sees), the logit
softcap and sinks; D = Dv = 64, 128 or 256 and D 192 / Dv 128 (`plan.tma_key_tile`,
`plan.tma_q_buffers`: 64-key tiles and one q buffer at D 256).

Semantics as the Triton kernel's (module docstring there), which stays the kernel of
every other case (other head dims, fp8 but at D = Dv = 128 with 128-row
blocks, other GPUs, the CPU interpreter, which cannot run Gluon): sequence bounds cut at the tensors' ends, bottom-right causal
alignment, a row that sees no key writes 0, NaN scores keep their row NaN, rows outside
every sequence are the prepare kernel's.

Only imported where Gluon exists (Triton >= 3.4); `plan.gluon_plan` says
where the kernels run.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from graphsafe.ops.attention.fp8_format import P_SCALE
from graphsafe.kernels.gluon_compat import cp_async, cta_barrier, nvmma_chunks, tma_load, tma_store

P_LOG2 = gl.constexpr(int(P_SCALE).bit_length() - 1)  # P_SCALE = 2^P_LOG2
FLT_MIN = gl.constexpr(1.1754943508222875e-38)  # smallest normal float32


def shared_memory_bytes(block_m: int, block_n: int, d: int, dv: int, stages: int = 2, q_buffers: int = 1,
                        elem_bytes: int = 2, p_tiles: int = 0, o_buffers: int = 0, o_pieces: int = 1) -> int:
    """Shared memory of a launch: `q_buffers` of q [BLOCK_M, D] (the persistent kernels
    load the next tile's q into a second one), `stages` stages of K [BLOCK_N, D] and V
    [BLOCK_N, Dv] and `p_tiles` p buffers [64, BLOCK_N] (the fp8 kernel's), of
    `elem_bytes` each, `o_buffers` 16-bit output staging buffers [64, Dv / o_pieces] (the
    TMA store), plus 1 KiB for Triton's scratch and the mbarriers."""
    return (elem_bytes * (q_buffers * block_m * d + stages * block_n * (d + dv) + p_tiles * 64 * block_n)
            + 2 * o_buffers * 64 * (dv // o_pieces) + 1024)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


def _descriptor(like: torch.Tensor, shape: list[int], strides: list[int], block: list[int]) -> TensorDescriptor:
    """A descriptor template of `like`'s dtype and device (its stand-in base: an empty
    tensor, not kept by the binding)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[like.dtype])
    return TensorDescriptor(like.new_empty(0), shape, strides, block, layout)


def _rows(like: torch.Tensor, shape: tuple[int, int, int], token_stride: int, block_rows: int, cols: int):
    """x [tokens, heads, head dim] (heads contiguous) as 2-D [tokens, heads * head dim]."""
    return _descriptor(like, [shape[0], shape[1] * shape[2]], [token_stride, 1], [block_rows, cols])


def tma_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple:
    """Host TMA descriptors (templates for `graphsafe.launch.bind`: each call passes its own
    q, k, v) of `varlen_fwd_tma_kernel`: q, k, v as 2-D [tokens, heads * head dim] (the
    caller checked the head stride is the head dim). Blocks: [64, c] of q, [BLOCK_N, c]
    of k, c the head dim's power-of-two column chunk (192 = 3 x 64), and [BLOCK_N, Dv]
    of v, in the shared layouts the wgmmas read."""
    d, dv = q.shape[2], v.shape[2]
    chunk = d & -d  # the largest power of two dividing d: 128 -> 128, 192 -> 64
    return (_rows(q, q.shape, q.stride(0), 64, chunk), _rows(k, k.shape, k.stride(0), block_n, chunk),
            _rows(v, v.shape, v.stride(0), block_n, dv))


def out_descriptor(like: torch.Tensor, shape: tuple[int, int, int], pieces: int = 1) -> TensorDescriptor:
    """Host TMA descriptor template of the TMA kernels' output where they store it by TMA
    (O_BUFFERS > 0; each call passes its out): out [tokens, heads, Dv], contiguous, as 2-D
    [tokens, heads x Dv] with [64, Dv / pieces] blocks (`pieces` stores a row block: 1 or
    2). `like`: a tensor of out's dtype and device."""
    return _rows(like, shape, shape[1] * shape[2], 64, shape[2] // pieces)


def tma_descriptors_fp8(like: torch.Tensor, q_view: tuple, k_view: tuple, vt_shape: tuple[int, int, int],
                        block_n: int) -> tuple:
    """The fp8 kernel's descriptors (dtype and device of `like`): q and k as in
    `tma_descriptors` from their (shape, token stride) views (fp8 inputs, or the
    contiguous fp8 copies the op quantises bf16/fp16 inputs into), and V^T (the fp8
    path's workspace [kv heads, Dv, token columns] of shape `vt_shape`, contiguous) as
    [kv heads x Dv, columns] with blocks [Dv, BLOCK_N]: a tile's keys are its columns."""
    (q_shape, q_stride), (k_shape, k_stride) = q_view, k_view
    hk, dv, columns = vt_shape
    return (_rows(like, q_shape, q_stride, 64, q_shape[2]), _rows(like, k_shape, k_stride, block_n, k_shape[2]),
            _descriptor(like, [hk * dv, columns], [columns, 1], [dv, block_n]))


@gluon.jit
def _sequence_bounds(cu_ptr, b, total, num_warps: gl.constexpr):
    """Rows `[start, end)` of sequence b: the running maximum of cu_seqlens clamped to
    `[0, total]` (`triton_quant.sequence_bounds`, written again: a Gluon kernel cannot
    call a `triton.jit` helper). Never outside the tensor, whatever cu holds."""
    CHUNK: gl.constexpr = 32 * num_warps
    IDS: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    top = gl.load(cu_ptr)
    for c0 in range(0, b + 1, CHUNK):
        offs = c0 + gl.arange(0, CHUNK, layout=IDS)
        top = gl.maximum(top, gl.max(gl.load(cu_ptr + offs, mask=offs < b + 1, other=-2147483648), axis=0))
    end = gl.maximum(top, gl.load(cu_ptr + b + 1))
    start = gl.minimum(gl.maximum(top, 0), total)
    end = gl.minimum(gl.maximum(end, 0), total)
    return start, end


@gluon.jit
def _copy_rows(smem, base, row0, row_end, stride, ROWS: gl.constexpr, D: gl.constexpr, LOAD: gl.constexpr):
    """cp.async rows [row0, row0 + ROWS) of a [*, D] matrix at `base` (row stride `stride`)
    into smem [ROWS, D]; rows at or past `row_end` are zero-filled, not read."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    ptrs = base + (rows.to(gl.int64) * stride)[:, None] + cols[None, :]
    cp_async(smem, ptrs, mask=(rows < row_end)[:, None])


@gluon.jit
def _softmax_step(s, m_i, l_i, n0, offs_m, k_len, diag, qk_scale,
                  BLOCK_N: gl.constexpr, S_COL: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                  FP8: gl.constexpr = False, lead=0, bad=0, BOX: gl.constexpr = 0,
                  WINDOW_LEFT: gl.constexpr = -1, SOFTCAP: gl.constexpr = 0.0):
    """One key tile's scores s [BLOCK_M, BLOCK_N] (keys n0 ...) into the online softmax:
    (p unnormalised, alpha = the old rows' rescale, the new row max, the new row sum).
    MASKED tiles hide keys past the sequence and, CAUSAL, past row i's diagonal (n > i + diag).
    FP8: qk_scale carries the descales, so any sign (nonzero: the caller's): the row's
    largest scaled score is its max or its min score, and a hidden key's score is the
    value that scales to -inf; p comes scaled by P_SCALE (e4m3 has no room below 2^-9),
    in l as in acc, so it cancels; keys before `lead` (`_ws_bounds`' frame) are hidden too.
    BOX > 0 (the paged kernel): bit i of `bad` hides keys [n0 + i BOX, n0 + (i + 1) BOX),
    a cache block whose id is outside the cache (`_bad_boxes`).
    Variants (16-bit only, as the Triton kernel's): WINDOW_LEFT >= 0 hides, in MASKED tiles,
    keys before row i's window (n < i + diag - WINDOW_LEFT); SOFTCAP > 0 (the cap in log2
    units) caps the scores to SOFTCAP * tanh(.) before the mask, qk_scale being the tanh
    argument's scale (the capped scores are in log2 units already)."""
    if FP8:
        positive = qk_scale > 0
        hidden = gl.where(positive, float("-inf"), float("inf"))
    else:
        hidden = float("-inf")
    if SOFTCAP > 0:
        # tanh(x) = 1 - 2 / (2^(2 x log2(e)) + 1) (qk_scale folds that factor in): +-inf
        # scores cap to +-1, NaN stays NaN; the scale is spent here.
        s = SOFTCAP * (1.0 - 2.0 / (gl.exp2(s * qk_scale) + 1.0))
        qk_scale = 1.0
    if MASKED:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=S_COL)
        visible = (offs_n < k_len)[None, :]
        if FP8:
            visible = visible & (offs_n >= lead)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        if BOX > 0:
            visible = visible & (((bad >> ((offs_n - n0) // BOX)) & 1) == 0)[None, :]
        if WINDOW_LEFT >= 0:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + (diag - WINDOW_LEFT))
        s = gl.where(visible, s, hidden)
    if FP8:
        if positive:
            top = gl.max(s, axis=1)
        else:
            top = gl.min(s, axis=1)
        m_new = gl.maximum(m_i, top * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_ref = m_new
    alpha = gl.exp2(m_i - m_ref)
    if FP8:
        m_ref = m_ref - P_LOG2  # p * P_SCALE straight from the exponent
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _full_tiles(r0, k_len, diag, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles [0, result) every row from r0 on sees (causal: row r0's diagonal bounds
    them): their softmax needs no mask."""
    if CAUSAL:
        full_end = gl.maximum(gl.minimum(k_len, r0 + diag + 1), 0)
    else:
        full_end = k_len
    return full_end // BLOCK_N


@gluon.jit
def _softmax_tile(s, m_i, l_i, t, full_tiles, offs_m, k_len, diag, qk_scale,
                  BLOCK_N: gl.constexpr, S_COL: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr = False,
                  lead=0, bad=0, BOX: gl.constexpr = 0, first_full=0, WINDOW_LEFT: gl.constexpr = -1,
                  SOFTCAP: gl.constexpr = 0.0):
    """`_softmax_step` of key tile t: unmasked when it is one of the first `full_tiles`
    (FP8: not tile 0 of a frame with a lead; paged, BOX > 0: no bad box; WINDOW_LEFT >= 0:
    not before `first_full`, the first tile inside every row's window), masked otherwise."""
    unmasked = t < full_tiles
    if WINDOW_LEFT >= 0:
        unmasked = unmasked & (t >= first_full)
    if FP8:
        unmasked = unmasked & ((t > 0) | (lead == 0))
    if BOX > 0:
        unmasked = unmasked & (bad == 0)
    if unmasked:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, t * BLOCK_N, offs_m, k_len, diag, qk_scale,
                                           BLOCK_N, S_COL, False, CAUSAL, FP8, lead, SOFTCAP=SOFTCAP)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, t * BLOCK_N, offs_m, k_len, diag, qk_scale,
                                           BLOCK_N, S_COL, True, CAUSAL, FP8, lead, bad, BOX, WINDOW_LEFT, SOFTCAP)
    return p, alpha, m_i, l_i


@gluon.jit
def _output_tile(acc, l_i, rows, k_len, diag, O_MMA: gl.constexpr, CAUSAL: gl.constexpr, v_scale=1.0,
                 FP8: gl.constexpr = False, m_i=0.0, sink=0.0, HAS_SINKS: gl.constexpr = False):
    """The output rows `rows` (O_MMA's row slice), float32: acc / l (FP8: acc * v_scale /
    l), 0 for a row that sees no key (decided from indices, as the Triton kernel), NaN
    where the sum is NaN (NaN scores). HAS_SINKS: the head's sink logit `sink` joins the
    normaliser once, against the final row max m_i (0 for a row whose scores are all
    -inf, as in the reference): l += 2^(sink log2(e) - m)."""
    if HAS_SINKS:
        l_i = l_i + gl.exp2(sink * 1.4426950408889634 - gl.where(m_i == float("-inf"), 0.0, m_i))
    norm = gl.where(l_i == 0.0, 1.0, l_i)
    if FP8:
        acc = acc * v_scale
    o = acc / gl.convert_layout(norm, gl.SliceLayout(1, O_MMA))[:, None]
    if CAUSAL:
        row_sees = (k_len > 0) & (rows + diag >= 0)
    else:
        row_sees = (k_len > 0) & (rows >= 0)
    return gl.where(row_sees[:, None], o, 0.0)


@gluon.jit
def _store_rows(acc, l_i, out_base, rows, q_len, k_len, diag, stride_ot,
                D: gl.constexpr, O_MMA: gl.constexpr, CAUSAL: gl.constexpr, v_scale=1.0, FP8: gl.constexpr = False,
                m_i=0.0, sink=0.0, HAS_SINKS: gl.constexpr = False):
    """out rows `rows` = `_output_tile`, in out's dtype; rows at or past q_len are not
    written."""
    o = _output_tile(acc, l_i, rows, k_len, diag, O_MMA, CAUSAL, v_scale, FP8, m_i, sink, HAS_SINKS)
    _store_tile(o, out_base, rows, q_len, stride_ot, D, O_MMA)


@gluon.jit
def _store_tile(o, out_base, rows, q_len, stride_ot, D: gl.constexpr, O_MMA: gl.constexpr):
    """The output rows `rows` of `o` (O_MMA's layout) into out, in out's dtype, by
    `gl.store`; rows at or past q_len are not written."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_MMA))
    out = out_base + (rows.to(gl.int64) * stride_ot)[:, None] + cols[None, :]
    gl.store(out, o.to(out_base.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def _stage_and_store(o, o_desc, o_buf, row0, col0):
    """One TMA store of `o` (16-bit, o_buf's shape) at (row0, col0) of o_desc through
    `o_buf`, left in flight; first waits for this warpgroup's previous store to have read
    o_buf."""
    tma.store_wait(0)  # this warpgroup's previous store has read o_buf
    cta_barrier()  # ... before any of its threads writes o_buf
    o_buf.store(o)
    fence_async_shared()
    cta_barrier()  # every thread's part of o_buf, before the one TMA store
    tma_store(o_desc, [row0, col0], o_buf)


@gluon.jit
def _store_rows_tma(acc, l_i, out_base, rows, q_len, k_len, diag, stride_ot, o_desc, o_buf, row0, col0,
                    D: gl.constexpr, O_MMA: gl.constexpr, CAUSAL: gl.constexpr, v_scale=1.0,
                    FP8: gl.constexpr = False, m_i=0.0, sink=0.0, HAS_SINKS: gl.constexpr = False):
    """`_store_rows` for a consumer warpgroup's 64 rows, by TMA where all of them lie in the
    sequence (rows[0] + 64 <= q_len): through `o_buf` (this warpgroup's, in o_desc's
    layout), [64, D] in one TMA store, or [64, D / 2] (o_desc's blocks that wide: where
    two full buffers do not fit) in two, the second after the first has read the buffer;
    each at (row0, col0 + its first column) of out's 2-D view o_desc, the last left in
    flight (the next use of o_buf waits for it to have read the buffer); else (the last
    rows of a sequence: the box would cover the next sequence's) as `_store_rows`."""
    o = _output_tile(acc, l_i, rows, k_len, diag, O_MMA, CAUSAL, v_scale, FP8, m_i, sink, HAS_SINKS)
    if gl.max(rows, axis=0) < q_len:
        OC: gl.constexpr = o_desc.block_type.shape[1]  # output columns a store
        o16 = o.to(o_buf.dtype)
        if OC == D:
            _stage_and_store(o16, o_desc, o_buf, row0, col0)
        else:  # two halves: columns [0, OC) and [OC, D) (column bit OC is a register bit of O_MMA)
            lo, hi = gl.split(gl.permute(gl.reshape(o16, [64, 2, OC]), [0, 2, 1]))
            _stage_and_store(lo, o_desc, o_buf, row0, col0)
            _stage_and_store(hi, o_desc, o_buf, row0, col0 + OC)
    else:
        _store_tile(o, out_base, rows, q_len, stride_ot, D, O_MMA)


@gluon.jit
def varlen_fwd_wgmma_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, num_q_heads, num_m_blocks, total_q, total_k,
    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
):
    """qk_scale: the softmax scale times log2(e), > 0 (the caller's condition)."""
    NUM_WARPS: gl.constexpr = BLOCK_M // 16
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Copies: 16 bytes a thread, D / 8 threads a row.
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [NUM_WARPS, 1], [1, 0])
    # Warpgroup w owns rows [64 w, 64 w + 64) of every tile.
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                    instr_shape=[16, D, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_COL: gl.constexpr = gl.SliceLayout(0, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)

    pid = gl.program_id(0)
    seq_head = pid // num_m_blocks
    m_block = num_m_blocks - 1 - pid % num_m_blocks  # heaviest causal block first
    b = seq_head // num_q_heads
    head = seq_head % num_q_heads
    kv_head = head // GROUP
    q_start, q_end = _sequence_bounds(cu_q_ptr, b, total_q, NUM_WARPS)
    q_len = q_end - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    k_start, k_end = _sequence_bounds(cu_k_ptr, b, total_k, NUM_WARPS)
    k_len = k_end - k_start
    diag = k_len - q_len  # row i sees keys n <= i + diag (bottom-right causal)
    if CAUSAL:
        hi = gl.maximum(gl.minimum(k_len, m0 + BLOCK_M + diag), 0)
    else:
        hi = k_len
    full_tiles = _full_tiles(m0, k_len, diag, BLOCK_N, CAUSAL)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    key_end = gl.minimum(k_len, n_tiles * BLOCK_N)  # copies read no key past the last tile

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))

    q_base = q_ptr + q_start.to(gl.int64) * stride_qt + head * stride_qh
    k_base = k_ptr + k_start.to(gl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start.to(gl.int64) * stride_vt + kv_head * stride_vh
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=S_ROW)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=S_ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=S_ROW)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_MMA)
    if n_tiles > 0:
        # Prologue: q and K_0, then V_0 and K_1; s_0 and its softmax.
        _copy_rows(q_smem, q_base, m0, q_len, stride_qt, BLOCK_M, D, LOAD)
        _copy_rows(k_smem.index(0), k_base, 0, key_end, stride_kt, BLOCK_N, D, LOAD)
        async_copy.commit_group()
        _copy_rows(v_smem.index(0), v_base, 0, key_end, stride_vt, BLOCK_N, D, LOAD)
        _copy_rows(k_smem.index(1), k_base, BLOCK_N, key_end, stride_kt, BLOCK_N, D, LOAD)
        async_copy.commit_group()
        async_copy.wait_group(1)
        cta_barrier()
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_MMA), use_acc=False)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, full_tiles, offs_m, k_len, diag, qk_scale,
                                           BLOCK_N, S_COL, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), P_OPERAND)

        for j in range(0, n_tiles - 1):
            # In: p_op of tile j (acc already rescaled to its row max). The copies of V_j
            # and K_{j+1} land; the barrier frees the stages tile j - 1 was read from.
            async_copy.wait_group(0)
            cta_barrier()
            fence_async_shared()
            stage = j % 2
            _copy_rows(v_smem.index(1 - stage), v_base, (j + 1) * BLOCK_N, key_end, stride_vt, BLOCK_N, D, LOAD)
            _copy_rows(k_smem.index(stage), k_base, (j + 2) * BLOCK_N, key_end, stride_kt, BLOCK_N, D, LOAD)
            async_copy.commit_group()
            # Both products in flight: q.k of tile j + 1 first, so waiting for it leaves
            # p.V of tile j running through the softmax below.
            s = warpgroup_mma(q_smem, k_smem.index(1 - stage).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_MMA), use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j + 1, full_tiles, offs_m, k_len, diag,
                                               qk_scale, BLOCK_N, S_COL, CAUSAL)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            acc = acc * gl.convert_layout(alpha, O_ROW)[:, None]
            p_op = gl.convert_layout(p.to(dtype), P_OPERAND)

        # The last tile's p.V.
        async_copy.wait_group(0)
        cta_barrier()
        fence_async_shared()
        acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % 2), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    out_base = out_ptr + q_start.to(gl.int64) * stride_ot + head * stride_oh
    _store_rows(acc, l_i, out_base, m0 + gl.arange(0, BLOCK_M, layout=O_ROW), q_len, k_len, diag, stride_ot,
                D, O_MMA, CAUSAL)


# -- warp-specialised, persistent variant ----------------------------------------------------------
WS_LOADER_WARPS = gl.constexpr(4)


@gluon.jit
def _ws_tile(tile, num_m_blocks, heads, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work tile `tile` -> (sequence, query head, kv head, first row). `heads`: (q heads,
    q heads a section, a multiple of GROUP). Sequence by sequence; within one, section by
    section of its heads (`plan.tma_heads_per_section`: as many as keep their K/V in L2);
    within a section its heaviest query blocks first across its heads (block index major,
    descending), so the programs that take a section's tiles round-robin get equal shares
    of its causal work while they read that section's K/V only (L2-resident). The last
    section may be narrower."""
    num_q_heads, section = heads
    per_seq = num_m_blocks * num_q_heads
    b = tile // per_seq
    r = tile % per_seq
    per_section = num_m_blocks * section
    first = (r // per_section) * section  # the section's first head
    width = gl.minimum(section, num_q_heads - first)
    r = r % per_section
    head = first + r % width
    return b, head, head // GROUP, (num_m_blocks - 1 - r // width) * BLOCK_M


@gluon.jit
def _ws_bounds(cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, WARPS: gl.constexpr, KV_ALIGN: gl.constexpr = 1, PAGED: gl.constexpr = False,
               stride_lens=1):
    """(q_start, q_len, k_start, k_len, diag, n_tiles, lead) of a work tile, its keys in a
    frame that starts at k_start rounded down to KV_ALIGN tokens (the fp8 kernel's V^T
    tiles start at whole 16-byte columns, as TMA needs): k_start is the frame's first
    token, frame keys [0, lead) are the previous sequence's (masked), k_len = the
    sequence's keys + lead, and row i sees frame keys n <= i + diag (bottom-right causal).
    KV_ALIGN = 1: lead = 0, the sequence's own bounds. n_tiles = 0 when the block starts
    past its sequence's rows (every partition skips the tile) or when no row of it sees
    a key (the loader skips it, the consumers write its rows' zeros).
    PAGED: cu_k_ptr is seq_lens (stride `stride_lens`) and total_k the keys a block table
    row holds; the keys are the cache's positions [0, k_len), k_len = seq_lens[b] clamped
    to [0, total_k] (k_start 0: the loader maps positions to cache rows)."""
    q_start, q_end = _sequence_bounds(cu_q_ptr, b, total_q, WARPS)
    q_len = q_end - q_start
    if PAGED:
        k_start = 0
        k_len = gl.minimum(gl.maximum(gl.load(cu_k_ptr + b * stride_lens), 0), total_k)
    else:
        k_start, k_end = _sequence_bounds(cu_k_ptr, b, total_k, WARPS)
        k_len = k_end - k_start
    diag = k_len - q_len  # row i sees keys n <= i + diag (bottom-right causal)
    lead = 0
    if KV_ALIGN > 1:
        lead = k_start % KV_ALIGN
        k_start = k_start - lead
        k_len = k_len + lead
        diag = diag + lead
    if CAUSAL:
        hi = gl.maximum(gl.minimum(k_len, m0 + BLOCK_M + diag), 0)
    else:
        hi = k_len
    n_tiles = gl.where(m0 < q_len, gl.cdiv(hi, BLOCK_N), 0)
    return q_start, q_len, k_start, k_len, diag, n_tiles, lead


@gluon.jit
def _window_tiles(m0, diag, n_tiles, BLOCK_N: gl.constexpr, WINDOW_LEFT: gl.constexpr):
    """(first key tile, key tiles, key_lo) of a work tile from row m0 on: with a window
    (WINDOW_LEFT >= 0) the tiles start at the tile of key_lo, the first key row m0 sees
    (earlier tiles are never loaded; the loader zeroes the first tile's values before
    key_lo, so keys no row of the block sees never enter the arithmetic, not even as
    0 * NaN, as in the Triton kernel); else tile 0 and key_lo 0."""
    if WINDOW_LEFT >= 0:
        key_lo = gl.maximum(m0 + diag - WINDOW_LEFT, 0)
        t_lo = key_lo // BLOCK_N
        n_tiles = gl.maximum(n_tiles - t_lo, 0)
    else:
        key_lo = 0
        t_lo = 0
    return t_lo, n_tiles, key_lo


@gluon.jit
def _tma_tile_keys(cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, paging, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr, FP8: gl.constexpr,
                   PAGE: gl.constexpr, WINDOW_LEFT: gl.constexpr):
    """The keys of a TMA kernel's work tile (sequence b, rows from m0), as its loader and its
    consumers both read them (so they walk the same tiles): (q_start, q_len, k_start, k_len,
    diag, lead, t_lo, n_tiles, key_lo, table_row, stride_tm, num_blocks). `_ws_bounds`'
    bounds (FP8: the 16-token frame; PAGE > 0: seq_lens, with `paging` = (block table, its
    two strides, seq_lens' stride, cache blocks) giving the sequence's table row, its
    column stride and the block count; else those three 0), then `_window_tiles`' tiles.
    WARPS: the calling partition's warps."""
    table_row = 0
    stride_tm = 0
    num_blocks = 0
    if PAGE > 0:
        table_ptr, stride_tb, stride_tm, stride_lens, num_blocks = paging
        table_row = table_ptr + b.to(gl.int64) * stride_tb
        q_start, q_len, k_start, k_len, diag, n_tiles, lead = _ws_bounds(
            cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, BLOCK_M, BLOCK_N, CAUSAL, WARPS, 1, True, stride_lens)
    else:
        q_start, q_len, k_start, k_len, diag, n_tiles, lead = _ws_bounds(
            cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, BLOCK_M, BLOCK_N, CAUSAL, WARPS, 16 if FP8 else 1)
    t_lo, n_tiles, key_lo = _window_tiles(m0, diag, n_tiles, BLOCK_N, WINDOW_LEFT)
    return q_start, q_len, k_start, k_len, diag, lead, t_lo, n_tiles, key_lo, table_row, stride_tm, num_blocks


@gluon.jit
def _ws_copy_tile(smem, base, row0, row_end, stride, ROWS: gl.constexpr, D: gl.constexpr, LOAD: gl.constexpr):
    """The loader's copy of rows [row0, row0 + ROWS) into smem [ROWS, D], 32 rows at a time
    (few live addresses in the loader's small register budget); rows at or past `row_end`
    zero-filled."""
    CHUNK: gl.constexpr = 32
    for r in gl.static_range(0, ROWS, CHUNK):
        _copy_rows(smem.slice(r, CHUNK), base, row0 + r, row_end, stride, CHUNK, D, LOAD)


@gluon.jit
def _ws_loader(q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
               q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               heads, num_m_blocks, num_work, total_q, total_k,
               GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Loader partition (WS_LOADER_WARPS warps). Per work tile of this program: q into
    buffer (tile count % 2) once both consumers released that buffer, then K_t and V_t of
    every key tile into ring stage (ring count % STAGES) once both released it. The ring
    and the q buffers carry on across work tiles, so the next tile's loads overlap this
    tile's last products. Every loader thread signals a buffer full with
    `cp.async.mbarrier.arrive.noinc` (the barrier completes when all their copies landed);
    a fresh barrier passes a wait for parity 1 at once (the first round of each buffer)."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    ring = 0
    count = 0
    for tile in range(gl.program_id(0), num_work, gl.num_programs(0)):
        b, head, kv_head, m0 = _ws_tile(tile, num_m_blocks, heads, GROUP, BLOCK_M)
        q_start, q_len, k_start, k_len, diag, n_tiles, _ = _ws_bounds(cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k,
                                                                       BLOCK_M, BLOCK_N, CAUSAL, 4)
        if n_tiles > 0:
            qb = count % 2
            mbarrier.wait(q_empty.index(qb), ((count // 2) & 1) ^ 1)
            q_base = q_ptr + q_start.to(gl.int64) * stride_qt + head * stride_qh
            for w in gl.static_range(2):
                _ws_copy_tile(q_smem.index(2 * qb + w), q_base, m0 + 64 * w, q_len, stride_qt, 64, D, LOAD)
            async_copy.mbarrier_arrive(q_full.index(qb), increment_count=False)
            k_base = k_ptr + k_start.to(gl.int64) * stride_kt + kv_head * stride_kh
            v_base = v_ptr + k_start.to(gl.int64) * stride_vt + kv_head * stride_vh
            key_end = gl.minimum(k_len, n_tiles * BLOCK_N)  # no key past the last tile is read
            for t in range(n_tiles):
                s = ring % STAGES
                free_phase = ((ring // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(s), free_phase)
                _ws_copy_tile(k_smem.index(s), k_base, t * BLOCK_N, key_end, stride_kt, BLOCK_N, D, LOAD)
                async_copy.mbarrier_arrive(k_full.index(s), increment_count=False)
                mbarrier.wait(v_empty.index(s), free_phase)
                _ws_copy_tile(v_smem.index(s), v_base, t * BLOCK_N, key_end, stride_vt, BLOCK_N, D, LOAD)
                async_copy.mbarrier_arrive(v_full.index(s), increment_count=False)
                ring += 1
            count += 1
    async_copy.wait_group(0)  # no copy outlives the program


@gluon.jit
def _scores(q_smem, q0, k_smem, k0, zeros, CHUNKS: gl.constexpr, ASYNC: gl.constexpr):
    """q.k^T of q chunks q_smem[q0 + c] and k chunks k_smem[k0 + c] (c < CHUNKS, the head
    dim in column chunks: a shared buffer is a power of two wide, so 192 is 3 x 64), one
    wgmma chain; ASYNC leaves it in flight (the caller waits), else it is waited for."""
    if CHUNKS == 1 and not ASYNC:
        s = warpgroup_mma(q_smem.index(q0), k_smem.index(k0).permute((1, 0)), zeros, use_acc=False)
    else:
        s = warpgroup_mma(q_smem.index(q0), k_smem.index(k0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        for c in gl.static_range(1, CHUNKS):
            s = warpgroup_mma(q_smem.index(q0 + c), k_smem.index(k0 + c).permute((1, 0)), s, is_async=True)
        if not ASYNC:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    return s


@gluon.jit
def _v_operand(v_smem, stage, FP8: gl.constexpr):
    """p.V's B operand [BLOCK_N, Dv] from ring stage `stage`: the V tile, or (FP8) the V^T
    tile [Dv, BLOCK_N] seen transposed (K-major, as fp8 wgmma needs)."""
    if FP8:
        return v_smem.index(stage).permute((1, 0))
    else:
        return v_smem.index(stage)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, P_OPERAND: gl.constexpr, p_smem, FP8: gl.constexpr):
    """p.V's A operand from the probabilities p: in registers (the score layout is the
    16-bit A operand's), or (FP8) stored to `p_smem` (the caller waited for the p.V that
    read it last), fenced for the tensor cores and published to the warpgroup."""
    if FP8:
        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()
        return p_smem
    else:
        return gl.convert_layout(p.to(dtype), P_OPERAND)


@gluon.jit
def _bad_boxes(table_row, stride_tm, num_blocks, t, k_len, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
               BOX: gl.constexpr):
    """The paged kernel's key tile t as BLOCK_N / BOX boxes of BOX keys (BOX = min(PAGE,
    BLOCK_N), a box in one cache block): bit i set where box i starts inside the sequence
    (before k_len) but its block id, `table_row[(t BLOCK_N + i BOX) // PAGE]`, is outside
    [0, num_blocks) (a padding block: its keys are hidden, as the reference's). Reads no
    table entry past the sequence's last block."""
    bad = 0
    for i in gl.static_range(BLOCK_N // BOX):
        key0 = t * BLOCK_N + i * BOX
        inside = key0 < k_len
        block = gl.load(table_row + gl.where(inside, key0 // PAGE, 0) * stride_tm)
        # One unsigned compare: a negative id wraps to a huge one.
        bad = bad | gl.where(inside & (block.to(gl.uint32, bitcast=True) >= num_blocks), 1 << i, 0)
    return bad


@gluon.jit
def _box_row(table_row, stride_tm, num_blocks, key0, k_len, PAGE: gl.constexpr, BOX: gl.constexpr):
    """The cache row (of the [blocks x PAGE, heads x head dim] view) of position key0, the
    first of a box of BOX keys in one block; -BOX (a box wholly outside the view: TMA fills
    it with zeros, reading nothing) for a box past the sequence or in a padding block."""
    inside = key0 < k_len
    block = gl.load(table_row + gl.where(inside, key0 // PAGE, 0) * stride_tm)
    ok = inside & (block.to(gl.uint32, bitcast=True) < num_blocks)
    return gl.where(ok, block * PAGE + key0 % PAGE, -BOX)


@gluon.jit
def _tma_boxes(desc, table_row, stride_tm, num_blocks, key0, k_len, col, barrier, smem, first,
               CHUNKS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr):
    """The paged kernel's copies of the key tile at positions [key0, key0 + BLOCK_N): per
    box of BOX keys one TMA copy [BOX, 64] per 64-column chunk c (columns col + 64 c on)
    into rows [i BOX, (i + 1) BOX) of smem[first + c] ([BLOCK_N, 64] chunks, 128-byte rows:
    a box lands in whole 1-KiB swizzle atoms)."""
    for i in gl.static_range(BLOCK_N // BOX):
        row = _box_row(table_row, stride_tm, num_blocks, key0 + i * BOX, k_len, PAGE, BOX)
        for c in gl.static_range(CHUNKS):
            tma_load(desc, [row, col + c * 64], barrier, smem.index(first + c).slice(i * BOX, BOX))


@gluon.jit
def _ws_key_loop(q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                 acc, m_i, l_i, r0, k_len, diag, n_tiles, ring, count, qk_scale,
                 WG: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 CHUNKS: gl.constexpr, FP8: gl.constexpr = False, p_smem=None, lead=0,
                 table_row=0, stride_tm=0, num_blocks=0, PAGE: gl.constexpr = 0, BOX: gl.constexpr = 0,
                 t_lo=0, q_len=0, WINDOW_LEFT: gl.constexpr = -1, SOFTCAP: gl.constexpr = 0.0):
    """One warpgroup's key loop over a work tile's n_tiles (> 0) key tiles, at ring position
    `ring` and q buffer `count % (q buffers)`: (acc, row max, row sum). Releases every
    buffer it read.
    DV: v's head dim. q and k come in CHUNKS column chunks (`_scores`): q half w of
    buffer qb is q_smem[(2 qb + w) CHUNKS + c], ring stage s of k is k_smem[s CHUNKS + c].
    FP8: q, k and p are float8e4nv, v_smem holds V^T tiles [DV, BLOCK_N] (fp8 wgmma reads
    both operands K-major), qk_scale any nonzero value (`_softmax_step`); p goes through
    this warpgroup's `p_smem` [64, BLOCK_N] (Triton 3.6 cannot keep 8-bit registers of
    an in-flight wgmma alive: no 8-bit operands in registers).
    PAGE > 0 (the paged kernel): keys of a padding block are hidden (`_bad_boxes` of
    `table_row`, read beside the copies). The n_tiles key tiles are tiles t_lo, t_lo + 1,
    ... (`_window_tiles`); WINDOW_LEFT, SOFTCAP: `_softmax_step`'s variants (q_len: the
    sequence's query rows, for the tiles inside every row's window)."""
    dtype: gl.constexpr = q_smem.dtype
    K_STEP: gl.constexpr = 32 if FP8 else 16  # wgmma's K: 32 bytes of the operands' rows
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, K_STEP])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, DV, K_STEP])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=4 if FP8 else 2)
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_COL: gl.constexpr = gl.SliceLayout(0, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    offs_m = r0 + gl.arange(0, 64, layout=S_ROW)
    full_tiles = _full_tiles(r0, k_len, diag, BLOCK_N, CAUSAL)
    first_full = 0
    if WINDOW_LEFT >= 0:  # the tile from which the window of this warpgroup's last row holds every key
        r_last = gl.maximum(gl.minimum(r0 + 64, q_len) - 1, r0)
        first_full = gl.cdiv(gl.maximum(r_last + diag - WINDOW_LEFT, 0), BLOCK_N)
    Q_BUFFERS: gl.constexpr = q_full.shape[0]
    qb = count % Q_BUFFERS
    q0 = (2 * qb + WG) * CHUNKS
    mbarrier.wait(q_full.index(qb), (count // Q_BUFFERS) & 1)
    bad = 0
    if PAGE > 0:
        bad = _bad_boxes(table_row, stride_tm, num_blocks, t_lo, k_len, BLOCK_N, PAGE, BOX)
    s0 = ring % STAGES
    mbarrier.wait(k_full.index(s0), (ring // STAGES) & 1)
    fence_async_shared()
    s = _scores(q_smem, q0, k_smem, s0 * CHUNKS, gl.zeros([64, BLOCK_N], gl.float32, layout=S_MMA), CHUNKS, False)
    mbarrier.arrive(k_empty.index(s0))
    # q is released once its last q.k is done (not after the last p.V): the loader can
    # fill the buffer for the next work tile meanwhile (with one q buffer, no bubble).
    mbarrier.arrive(q_empty.index(qb), pred=n_tiles == 1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, t_lo, full_tiles, offs_m, k_len, diag, qk_scale,
                                       BLOCK_N, S_COL, CAUSAL, FP8, lead, bad, BOX, first_full, WINDOW_LEFT, SOFTCAP)
    p_op = _p_operand(p, dtype, P_OPERAND, p_smem, FP8)
    for j in range(0, n_tiles - 1):
        # In: p_op of key tile j (ring position ring + j), acc at its row max.
        sk = (ring + j + 1) % STAGES
        sv = (ring + j) % STAGES
        if PAGE > 0:
            bad = _bad_boxes(table_row, stride_tm, num_blocks, t_lo + j + 1, k_len, BLOCK_N, PAGE, BOX)
        mbarrier.wait(k_full.index(sk), ((ring + j + 1) // STAGES) & 1)
        mbarrier.wait(v_full.index(sv), ((ring + j) // STAGES) & 1)
        fence_async_shared()
        # q.k of tile j + 1 first, so waiting for it leaves p.V of tile j running through
        # the softmax below.
        s = _scores(q_smem, q0, k_smem, sk * CHUNKS, gl.zeros([64, BLOCK_N], gl.float32, layout=S_MMA), CHUNKS, True)
        acc = warpgroup_mma(p_op, _v_operand(v_smem, sv, FP8), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(sk))
        mbarrier.arrive(q_empty.index(qb), pred=j + 2 == n_tiles)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, t_lo + j + 1, full_tiles, offs_m, k_len, diag,
                                           qk_scale, BLOCK_N, S_COL, CAUSAL, FP8, lead, bad, BOX, first_full,
                                           WINDOW_LEFT, SOFTCAP)
        if FP8:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        else:
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(sv))
        acc = acc * gl.convert_layout(alpha, O_ROW)[:, None]
        p_op = _p_operand(p, dtype, P_OPERAND, p_smem, FP8)
    sv = (ring + n_tiles - 1) % STAGES
    mbarrier.wait(v_full.index(sv), ((ring + n_tiles - 1) // STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma(p_op, _v_operand(v_smem, sv, FP8), acc, is_async=True)
    if FP8:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    else:
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(sv))
    return acc, m_i, l_i


@gluon.jit
def _fp8_scales(descales, b, kv_head, qk_scale):
    """(the scores' scale, the output's) of sequence b, kv head `kv_head`: qk_scale x its q
    and k descales (0 becomes the smallest normal float, so a hidden key's infinite score
    still scales to -inf; NaN stays NaN: every score NaN, as in the reference), and its v
    descale. `descales`: (q, k, v pointers, then each one's sequence and head strides;
    per-tensor descales have strides 0)."""
    qd_ptr, kd_ptr, vd_ptr, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h = descales
    scale = qk_scale * gl.load(qd_ptr + b * sqd_b + kv_head * sqd_h)
    scale = scale * gl.load(kd_ptr + b * skd_b + kv_head * skd_h)
    scale = gl.where(scale == 0.0, FLT_MIN, scale)
    return scale, gl.load(vd_ptr + b * svd_b + kv_head * svd_h)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                 out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                 total_q, total_k, WG: gl.constexpr, GROUP: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CHUNKS: gl.constexpr,
                 FP8: gl.constexpr = False, descales=None, p_smem=None, paging=None, PAGE: gl.constexpr = 0,
                 BOX: gl.constexpr = 0, sinks=None, WINDOW_LEFT: gl.constexpr = -1, SOFTCAP: gl.constexpr = 0.0,
                 HAS_SINKS: gl.constexpr = False, sched=None, DYNAMIC: gl.constexpr = False, out_store=None,
                 O_BUFFERS: gl.constexpr = 0):
    """Consumer partition WG (one warpgroup): rows [m0 + 64 WG, m0 + 64 WG + 64) of each
    work tile, the key loop of `varlen_fwd_wgmma_kernel` on the buffers the loader fills;
    a buffer is released (one arrive per consumer) once this warpgroup's wgmma read it.
    The work tiles: program_id, program_id + programs, ... (static), or (DYNAMIC) those
    the loader claims, read from the id ring `sched` (`_read_tile`). O_BUFFERS > 0: the
    output rows go out by TMA (`_store_rows_tma`; `out_store` = (out's 2-D descriptor, the
    [O_BUFFERS, 64, its block's columns] staging buffers, WG's its own)).
    FP8: `descales` = (q, k, v descale pointers, their (sequence, kv head) strides): each
    work tile's scores are scaled by qk_scale x its q and k descales, its output by its v
    descale; `p_smem` [2, 64, BLOCK_N]: each warpgroup's p buffer.
    PAGE > 0 (`paged_fwd_tma_kernel`): cu_k_ptr is seq_lens, total_k the keys of a block
    table row, `paging` = (block table, its two strides, seq_lens' stride, cache blocks).
    Variants (16-bit): WINDOW_LEFT, SOFTCAP (`_softmax_step`), HAS_SINKS (`sinks` = (the
    sinks' pointer, their stride): `_store_rows`)."""
    K_STEP: gl.constexpr = 32 if FP8 else 16
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, K_STEP])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, DV, K_STEP])
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)

    ring = 0
    count = 0
    if DYNAMIC:
        it = 0
        tile = _read_tile(sched, it)
        while tile < num_work:
            ring, count = _consume_tile(
                tile, ring, count, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, out_ptr,
                cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, total_q, total_k, WG,
                GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, FP8, descales, p_smem, paging, PAGE, BOX, sinks,
                WINDOW_LEFT, SOFTCAP, HAS_SINKS, S_ROW, O_MMA, O_ROW, out_store, O_BUFFERS)
            it += 1
            tile = _read_tile(sched, it)
    else:
        for tile in range(gl.program_id(0), num_work, gl.num_programs(0)):
            ring, count = _consume_tile(
                tile, ring, count, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, out_ptr,
                cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, total_q, total_k, WG,
                GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, FP8, descales, p_smem, paging, PAGE, BOX, sinks,
                WINDOW_LEFT, SOFTCAP, HAS_SINKS, S_ROW, O_MMA, O_ROW, out_store, O_BUFFERS)
    if O_BUFFERS > 0:
        tma.store_wait(0)  # the last output store has read its buffer before the program ends


@gluon.jit
def _consume_tile(tile, ring, count, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                  out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, total_q,
                  total_k, WG: gl.constexpr, GROUP: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CHUNKS: gl.constexpr,
                  FP8: gl.constexpr, descales, p_smem, paging, PAGE: gl.constexpr, BOX: gl.constexpr, sinks,
                  WINDOW_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr, S_ROW: gl.constexpr,
                  O_MMA: gl.constexpr, O_ROW: gl.constexpr, out_store, O_BUFFERS: gl.constexpr):
    """`_ws_consumer`'s work on one work tile; returns its (ring, count) after it."""
    b, head, kv_head, m0 = _ws_tile(tile, num_m_blocks, heads, GROUP, BLOCK_M)
    q_start, q_len, k_start, k_len, diag, lead, t_lo, n_tiles, key_lo, table_row, stride_tm, num_blocks = \
        _tma_tile_keys(cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, paging, BLOCK_M, BLOCK_N, CAUSAL, 4, FP8,
                       PAGE, WINDOW_LEFT)
    if m0 < q_len:  # (a block past its sequence's rows has nothing to write)
        r0 = m0 + 64 * WG
        m_i = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
        l_i = gl.zeros([64], gl.float32, layout=S_ROW)
        acc = gl.zeros([64, DV], gl.float32, layout=O_MMA)
        tile_scale = qk_scale
        v_scale = 1.0
        p_buffer = None
        if FP8:
            tile_scale, v_scale = _fp8_scales(descales, b, kv_head, qk_scale)
            p_buffer = p_smem.index(WG)
        if n_tiles > 0:  # (else no row of the block sees a key: it writes 0)
            acc, m_i, l_i = _ws_key_loop(q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                                         acc, m_i, l_i, r0, k_len, diag, n_tiles, ring, count, tile_scale,
                                         WG, DV, BLOCK_N, STAGES, CAUSAL, CHUNKS, FP8, p_buffer, lead,
                                         table_row, stride_tm, num_blocks, PAGE, BOX, t_lo, q_len, WINDOW_LEFT,
                                         SOFTCAP)
            ring += n_tiles
            count += 1
        out_base = out_ptr + q_start.to(gl.int64) * stride_ot + head * stride_oh
        # (the sequence's own key count and diagonal: without the frame's lead)
        sink = 0.0
        if HAS_SINKS:
            sinks_ptr, stride_sinks = sinks
            sink = gl.load(sinks_ptr + head * stride_sinks)
        rows = r0 + gl.arange(0, 64, layout=O_ROW)
        if O_BUFFERS > 0:
            o_desc, o_smem = out_store
            _store_rows_tma(acc, l_i, out_base, rows, q_len, k_len - lead, diag - lead, stride_ot, o_desc,
                            o_smem.index(WG), q_start + r0, head * DV, DV, O_MMA, CAUSAL, v_scale, FP8, m_i, sink,
                            HAS_SINKS)
        else:
            _store_rows(acc, l_i, out_base, rows, q_len, k_len - lead, diag - lead, stride_ot, DV, O_MMA, CAUSAL,
                        v_scale, FP8, m_i, sink, HAS_SINKS)
    return ring, count


@gluon.jit
def varlen_fwd_ws_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, num_q_heads, num_m_blocks, total_q, total_k, num_seqs,
    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """`varlen_fwd_wgmma_kernel`'s work, persistent and warp-specialised: each program
    (a few per GPU: launch one per SM) walks the work tiles (query block, sequence, head)
    pid, pid + grid, ... in three partitions: two consumer warpgroups (64 query rows each;
    the launch's 4 warps run the first) and a loader warpgroup, synchronised by mbarriers
    only, so neither consumer waits for the other and the loads of a program's next tile
    overlap the products of its current one. BLOCK_M is 128; launch with num_warps=4."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [4, 64, D], gl.NVMMASharedLayout.get_default_for([64, D], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype))
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Full: every loader thread arrives (its copies landed); empty: each consumer once.
    for i in gl.static_range(2):
        mbarrier.init(q_full.index(i), count=32 * WS_LOADER_WARPS)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=32 * WS_LOADER_WARPS)
        mbarrier.init(v_full.index(i), count=32 * WS_LOADER_WARPS)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    num_work = num_m_blocks * num_seqs * num_q_heads
    heads = (num_q_heads, num_q_heads)  # (q heads, q heads a section: one section)
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, total_k, 0, GROUP, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 1)),
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, total_k, 1, GROUP, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL, 1)),
        (_ws_loader, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                      q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                      stride_vh, heads, num_m_blocks, num_work, total_q, total_k,
                      GROUP, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
    ], [4, WS_LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


# -- warp-specialised, persistent, TMA loads ---------------------------------------------------------
@gluon.jit
def _zero_rows_outside(tile, lo, hi, ROWS: gl.constexpr, D: gl.constexpr):
    """Zero the rows outside [lo, hi) of the shared tile [ROWS, D] (one warp, 8 rows at a
    time, generic-proxy stores: the caller fences before the tensor cores read the tile)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [1, 1], [1, 0])
    for r in gl.static_range(0, ROWS, 8):
        if (r < lo) | (r + 8 > hi):
            chunk = tile.slice(r, 8)
            rows = r + gl.arange(0, 8, layout=gl.SliceLayout(1, L))
            chunk.store(gl.where(((rows >= lo) & (rows < hi))[:, None], chunk.load(L), 0.0))


@gluon.jit
def _zero_columns_outside(tile, lo, hi, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Zero the columns outside [lo, hi) of the shared fp8 tile [ROWS, COLS] (a V^T tile:
    columns are keys), 8 rows at a time, by their bits (fp8 has no arithmetic); one warp."""
    L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (COLS // 16), COLS // 16], [1, 1], [1, 0])
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, L))
    keep = ((cols >= lo) & (cols < hi))[None, :]
    for r in gl.static_range(0, ROWS, 8):
        chunk = tile.slice(r, 8)
        bits = chunk.load(L).to(gl.int8, bitcast=True)
        chunk.store(gl.where(keep, bits, 0).to(tile.dtype, bitcast=True))


@gluon.jit
def _tma_chunks(desc, row, col, barrier, smem, first, CHUNKS: gl.constexpr):
    """TMA copies of rows [row, row + the block's rows) into smem[first + c] (c < CHUNKS):
    columns col + c * (the block's width) on."""
    for c in gl.static_range(CHUNKS):
        tma_load(desc, [row, col + c * desc.block_type.shape[1]], barrier, smem.index(first + c))


@gluon.jit
def _tma_loader(q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed,
                q_desc, k_desc, v_desc, cu_q_ptr, cu_k_ptr, heads, num_m_blocks, num_work, total_q, total_k,
                GROUP: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr,
                paging=None, v_boxes=None, PAGE: gl.constexpr = 0, BOX: gl.constexpr = 0,
                WINDOW_LEFT: gl.constexpr = -1, sched=None, DYNAMIC: gl.constexpr = False):
    """Loader partition (one warp) of `varlen_fwd_tma_kernel`: `_ws_loader`'s order of
    copies, each one TMA copy (q in two 64-row halves) completing its buffer's barrier by
    the bytes it lands. The copies read whole tiles at the sequence's rows: rows past a
    sequence are the next sequence's (or zeros past the tensor). Their scores are masked,
    and a V tile that runs past the sequence's keys has those rows zeroed before the
    consumers see it (else 0 * a neighbour's NaN would reach p.V): the loader waits for
    that tile (`v_landed`), zeroes the rows, fences and releases it (one arrive). FP8:
    v_desc is V^T's [kv heads x Dv, tokens], its tiles [Dv, BLOCK_N], keys its columns;
    a TMA tile must start at a 16-byte column, so the keys run in `_ws_bounds`' frame
    from the sequence's first token rounded down to 16, and the first tile's columns
    before the sequence are zeroed too.
    PAGE > 0 (`paged_fwd_tma_kernel`): a key tile is BLOCK_N / BOX boxes, each read from its
    cache block (`_tma_boxes`: `paging` as `_ws_consumer`'s; `v_boxes` the V stages seen
    as [STAGES x DV / 64, BLOCK_N, 64] chunks); boxes past the sequence or in a padding
    block are TMA's zeros. WINDOW_LEFT >= 0: the tiles from `_window_tiles`' first on, that
    tile's values before key_lo zeroed as the tail's.
    DYNAMIC: the work tiles are claimed, not dealt: program_id first, then programs + a
    ticket from the launch's counter (`sched`'s pointer), each published to the consumers
    on the id ring before its copies (`_publish_tile`), the end too; the last program out
    resets the counter for the next launch (`_schedule_done`)."""
    CHUNKS: gl.constexpr = DK // q_desc.block_type.shape[1]
    Q_BUFFERS: gl.constexpr = q_full.shape[0]
    if PAGE > 0:  # a V tile: DV / 64 chunks of BLOCK_N / BOX boxes
        V_BYTES: gl.constexpr = (DV // 64) * (BLOCK_N // BOX) * v_desc.block_type.nbytes
    else:
        V_BYTES: gl.constexpr = v_desc.block_type.nbytes
    ring = 0
    count = 0
    fixes = 0
    if DYNAMIC:
        ids, id_full, id_empty, sched_ptr = sched
        tile = gl.program_id(0)
        it = 0
        _publish_tile(ids, id_full, id_empty, it, tile)
        while tile < num_work:
            ring, count, fixes = _load_tile(
                tile, ring, count, fixes, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed, q_desc, k_desc,
                v_desc, cu_q_ptr, cu_k_ptr, heads, num_m_blocks, total_q, total_k, GROUP, DK, DV, BLOCK_M,
                BLOCK_N, STAGES, CAUSAL, FP8, paging, v_boxes, PAGE, BOX, WINDOW_LEFT, CHUNKS, Q_BUFFERS, V_BYTES)
            tile = gl.num_programs(0) + gl.atomic_add(sched_ptr, 1, sem="relaxed")
            it += 1
            _publish_tile(ids, id_full, id_empty, it, tile)
        _schedule_done(sched_ptr)
    else:
        for tile in range(gl.program_id(0), num_work, gl.num_programs(0)):
            ring, count, fixes = _load_tile(
                tile, ring, count, fixes, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed, q_desc, k_desc,
                v_desc, cu_q_ptr, cu_k_ptr, heads, num_m_blocks, total_q, total_k, GROUP, DK, DV, BLOCK_M,
                BLOCK_N, STAGES, CAUSAL, FP8, paging, v_boxes, PAGE, BOX, WINDOW_LEFT, CHUNKS, Q_BUFFERS, V_BYTES)


@gluon.jit
def _load_tile(tile, ring, count, fixes, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
               v_landed, q_desc, k_desc, v_desc, cu_q_ptr, cu_k_ptr, heads, num_m_blocks, total_q, total_k,
               GROUP: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr, paging, v_boxes, PAGE: gl.constexpr,
               BOX: gl.constexpr, WINDOW_LEFT: gl.constexpr, CHUNKS: gl.constexpr, Q_BUFFERS: gl.constexpr,
               V_BYTES: gl.constexpr):
    """`_tma_loader`'s copies of one work tile; returns its (ring, count, fixes) after it."""
    b, head, kv_head, m0 = _ws_tile(tile, num_m_blocks, heads, GROUP, BLOCK_M)
    q_start, q_len, k_start, k_len, diag, lead, t_lo, n_tiles, key_lo, table_row, stride_tm, num_blocks = \
        _tma_tile_keys(cu_q_ptr, cu_k_ptr, b, m0, total_q, total_k, paging, BLOCK_M, BLOCK_N, CAUSAL, 1, FP8,
                       PAGE, WINDOW_LEFT)
    if n_tiles > 0:
        qb = count % Q_BUFFERS
        mbarrier.wait(q_empty.index(qb), ((count // Q_BUFFERS) & 1) ^ 1)
        mbarrier.expect(q_full.index(qb), 2 * CHUNKS * q_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_chunks(q_desc, q_start + m0 + 64 * w, head * DK, q_full.index(qb), q_smem, (2 * qb + w) * CHUNKS,
                        CHUNKS)
        for j in range(n_tiles):
            t = t_lo + j
            s = ring % STAGES
            free_phase = ((ring // STAGES) & 1) ^ 1
            row = k_start + t * BLOCK_N
            mbarrier.wait(k_empty.index(s), free_phase)
            if PAGE > 0:
                mbarrier.expect(k_full.index(s), CHUNKS * (BLOCK_N // BOX) * k_desc.block_type.nbytes)
                _tma_boxes(k_desc, table_row, stride_tm, num_blocks, t * BLOCK_N, k_len, kv_head * DK,
                           k_full.index(s), k_smem, s * CHUNKS, CHUNKS, BLOCK_N, PAGE, BOX)
            else:
                mbarrier.expect(k_full.index(s), CHUNKS * k_desc.block_type.nbytes)
                _tma_chunks(k_desc, row, kv_head * DK, k_full.index(s), k_smem, s * CHUNKS, CHUNKS)
            mbarrier.wait(v_empty.index(s), free_phase)
            keys = k_len - t * BLOCK_N  # keys of the sequence (frame) in this tile
            if FP8:
                v_at = [kv_head * DV, row]
                first = gl.where(t == 0, lead, 0)  # frame keys before `lead`: the previous sequence's
            else:
                v_at = [row, kv_head * DV]
                first = 0
                if WINDOW_LEFT >= 0:  # the first tile's keys before key_lo: no row of the block sees them
                    first = gl.where(j == 0, key_lo - t * BLOCK_N, 0)
            if (keys >= BLOCK_N) & (first == 0):
                mbarrier.expect(v_full.index(s), V_BYTES)
                if PAGE > 0:
                    _tma_boxes(v_desc, table_row, stride_tm, num_blocks, t * BLOCK_N, k_len, kv_head * DV,
                               v_full.index(s), v_boxes, s * (DV // 64), DV // 64, BLOCK_N, PAGE, BOX)
                else:
                    tma_load(v_desc, v_at, v_full.index(s), v_smem.index(s))
            else:
                mbarrier.expect(v_landed.index(0), V_BYTES)
                if PAGE > 0:
                    _tma_boxes(v_desc, table_row, stride_tm, num_blocks, t * BLOCK_N, k_len, kv_head * DV,
                               v_landed.index(0), v_boxes, s * (DV // 64), DV // 64, BLOCK_N, PAGE, BOX)
                else:
                    tma_load(v_desc, v_at, v_landed.index(0), v_smem.index(s))
                mbarrier.wait(v_landed.index(0), fixes & 1)
                fixes += 1
                if FP8:
                    _zero_columns_outside(v_smem.index(s), first, keys, DV, BLOCK_N)
                else:
                    _zero_rows_outside(v_smem.index(s), first, keys, BLOCK_N, DV)
                fence_async_shared()
                mbarrier.arrive(v_full.index(s))
            ring += 1
        count += 1
    return ring, count, fixes


@gluon.jit
def _schedule_and_output(sched_ptr, o_desc, placeholder, DYNAMIC: gl.constexpr, O_BUFFERS: gl.constexpr):
    """The TMA kernels' partition arguments for DYNAMIC and O_BUFFERS: (the id ring and the
    ticket counter `sched_ptr`, `_schedule_ring`; (o_desc, the [O_BUFFERS, 64, its block's
    columns] output staging buffers in its layout)); without either, `placeholder` in its
    place (a partition takes no None; never read)."""
    if DYNAMIC:
        ids, id_full, id_empty = _schedule_ring()
    else:
        ids = placeholder
        id_full = placeholder
        id_empty = placeholder
    if O_BUFFERS > 0:
        OC: gl.constexpr = o_desc.block_type.shape[1]  # DV, or DV / 2 (`_store_rows_tma`)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [O_BUFFERS, 64, OC], o_desc.layout)
    else:
        o_smem = placeholder
    return (ids, id_full, id_empty, sched_ptr), (o_desc, o_smem)


@gluon.jit
def _schedule_ring():
    """The DYNAMIC schedule's id ring: (ids [2, 32] int32, id_full, id_empty), initialised.
    The loader writes a claimed work tile into slot i % 2 (all 32 words) and arrives on
    id_full; each consumer reads it and arrives on id_empty (count 2)."""
    ids = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    id_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(id_full.index(i), count=1)
        mbarrier.init(id_empty.index(i), count=2)
    return ids, id_full, id_empty


@gluon.jit
def _publish_tile(ids, id_full, id_empty, it, tile):
    """Loader (one warp): work tile `tile` (num_work or more: the end) into slot it % 2 of
    the id ring, once both consumers have read what the slot held two tiles ago."""
    slot = it % 2
    mbarrier.wait(id_empty.index(slot), ((it // 2) & 1) ^ 1)
    ids.index(slot).store(gl.full([32], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
    cta_barrier()  # the warp's stores, before its one arrive
    mbarrier.arrive(id_full.index(slot))


@gluon.jit
def _read_tile(sched, it):
    """Consumer (one warpgroup): the work tile in slot it % 2 of the id ring (`sched`), the
    slot released once every warp of the warpgroup has read it."""
    ids, id_full, id_empty, _ = sched
    slot = it % 2
    mbarrier.wait(id_full.index(slot), (it // 2) & 1)
    tile = gl.max(ids.index(slot).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)
    cta_barrier()  # every warp has read the slot, before the one arrive
    mbarrier.arrive(id_empty.index(slot))
    return tile


@gluon.jit
def _schedule_done(sched_ptr):
    """Loader, after its last claim: count this program out; the last one resets the ticket
    counter and the count (sched_ptr[0], [1]) to 0 for the next launch on this stream (every
    program's last claim came before its count)."""
    done = gl.atomic_add(sched_ptr + 1, 1, sem="acq_rel")
    if done == gl.num_programs(0) - 1:
        gl.atomic_xchg(sched_ptr, 0, sem="relaxed")
        gl.atomic_xchg(sched_ptr + 1, 0, sem="relaxed")


@gluon.jit
def _tma_barriers(Q_BUFFERS: gl.constexpr, STAGES: gl.constexpr):
    """The TMA kernels' mbarriers, initialised: (q_full, q_empty, k_full, v_full, k_empty,
    v_empty, v_landed). Full: the loader's one arrive with the bytes it expects; empty:
    each consumer once; v_landed: the loader's own wait for a V tile it fixes up."""
    q_full = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_landed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(v_landed.index(0), count=1)
    return q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed


@gluon.jit
def varlen_fwd_tma_kernel(
    q_desc, k_desc, v_desc, o_desc, out_ptr, cu_q_ptr, cu_k_ptr, qd_ptr, kd_ptr, vd_ptr, sinks_ptr, sched_ptr, stride_ot,
    stride_oh, stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h, stride_sinks,
    qk_scale, num_q_heads, num_m_blocks, total_q, total_k, num_seqs, heads_per_section,
    GROUP: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    FP8: gl.constexpr, Q_BUFFERS: gl.constexpr = 2, WINDOW_LEFT: gl.constexpr = -1, SOFTCAP: gl.constexpr = 0.0,
    HAS_SINKS: gl.constexpr = False, DYNAMIC: gl.constexpr = False, O_BUFFERS: gl.constexpr = 0,
):
    """`varlen_fwd_ws_kernel` with a one-warp TMA loader: q, k, v come as TMA descriptors
    of their 2-D views [tokens, heads * head dim] (blocks [64, DK] for q, [BLOCK_N, DK]
    for k, [BLOCK_N, DV] for v, the layouts the wgmmas read), so the loader issues one instruction a tile instead
    of 128 threads' 16-byte copies, and its registers go to the consumers. BLOCK_M is
    128; launch with num_warps=4.

    FP8: q, k float8e4nv and v_desc V^T (the fp8 path's transposed copy [kv heads x Dv,
    tokens], blocks [Dv, BLOCK_N]); qd/kd/vd_ptr the descales, each (sequence, kv head)
    strided (0, 0 for one per tensor); qk_scale may be negative. Without FP8 they are
    placeholders, never read.

    Variants (16-bit only), as the Triton kernel's: WINDOW_LEFT >= 0 a sliding window (tiles
    from the first key a work tile's first row sees), SOFTCAP > 0 the logit cap in log2
    units (qk_scale the tanh argument's scale), HAS_SINKS a sink logit per query head
    (`sinks_ptr`, stride `stride_sinks`; else a placeholder, never read).

    DYNAMIC: the programs claim work tiles one at a time from a ticket counter, `sched_ptr`
    (int32 [2], 0 before the launch and left 0 after it: `_tma_loader`), rather than take
    every programs-th tile, so each tile goes to whichever program is free first
    (`plan.tma_claims_tiles` says where); without, `sched_ptr` is a placeholder, never read.

    O_BUFFERS = 2: each consumer stores its full 64-row output blocks by TMA through its own
    staging buffer (`o_desc`: out as 2-D [tokens, heads x DV], blocks [64, DV], or [64, DV /
    2] for a block in two stores: `_store_rows_tma`); 0: every row by `gl.store` (`o_desc` a
    placeholder, never read)."""
    dtype: gl.constexpr = q_desc.dtype
    KC: gl.constexpr = q_desc.block_type.shape[1]  # q and k columns a chunk
    CHUNKS: gl.constexpr = DK // KC
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS * CHUNKS, 64, KC], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, BLOCK_N, KC], k_desc.layout)
    V_ROWS: gl.constexpr = v_desc.block_type.shape[0]  # [BLOCK_N, DV], FP8: V^T's [DV, BLOCK_N]
    V_COLS: gl.constexpr = v_desc.block_type.shape[1]
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, V_ROWS, V_COLS], v_desc.layout)
    q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed = _tma_barriers(Q_BUFFERS, STAGES)
    sched, out_store = _schedule_and_output(sched_ptr, o_desc, q_smem, DYNAMIC, O_BUFFERS)
    if FP8:  # each consumer's p (an fp8 A operand comes from shared memory)
        p_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
    else:
        p_smem = q_smem  # (not read: a partition takes no None)
    num_work = num_m_blocks * num_seqs * num_q_heads
    heads = (num_q_heads, heads_per_section)
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, total_k, 0, GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, FP8,
                        (qd_ptr, kd_ptr, vd_ptr, stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b,
                         stride_vd_h), p_smem, (sinks_ptr, stride_sinks), 0, 0, (sinks_ptr, stride_sinks), WINDOW_LEFT,
                        SOFTCAP, HAS_SINKS, sched, DYNAMIC, out_store, O_BUFFERS)),
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, cu_k_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, total_k, 1, GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, FP8,
                        (qd_ptr, kd_ptr, vd_ptr, stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b,
                         stride_vd_h), p_smem, (sinks_ptr, stride_sinks), 0, 0, (sinks_ptr, stride_sinks), WINDOW_LEFT,
                        SOFTCAP, HAS_SINKS, sched, DYNAMIC, out_store, O_BUFFERS)),
        (_tma_loader, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed,
                       q_desc, k_desc, v_desc, cu_q_ptr, cu_k_ptr, heads, num_m_blocks, num_work, total_q, total_k,
                       GROUP, DK, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, FP8, (sinks_ptr, stride_sinks), v_smem, 0, 0,
                       WINDOW_LEFT, sched, DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# -- paged prefill: the TMA kernel walking the block table --------------------------------------
def paged_tma_descriptors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple:
    """Host TMA descriptors (templates: each call passes its own q and caches) of
    `paged_fwd_tma_kernel`: q as 2-D [tokens, heads x D] with [64, 64] blocks, the caches
    as 2-D [blocks x block size, kv heads x D] (the caller checked a block's rows follow
    each other: block stride = block size x token stride) with [BOX, 64] blocks, BOX =
    min(block size, BLOCK_N): one box of a key tile lies in one cache block."""
    num_blocks, page, hk, d = k_cache.shape
    box = min(page, block_n)
    return (_rows(q, q.shape, q.stride(0), 64, 64),
            _descriptor(k_cache, [num_blocks * page, hk * d], [k_cache.stride(1), 1], [box, 64]),
            _descriptor(v_cache, [num_blocks * page, hk * v_cache.shape[3]], [v_cache.stride(1), 1], [box, 64]))


@gluon.jit
def paged_fwd_tma_kernel(
    q_desc, k_desc, v_desc, o_desc, out_ptr, cu_q_ptr, lens_ptr, table_ptr, sinks_ptr, sched_ptr, stride_ot, stride_oh,
    stride_lens, stride_tb, stride_tm, stride_sinks, qk_scale, num_q_heads, num_m_blocks, total_q, max_len, num_seqs,
    num_blocks, heads_per_section,
    GROUP: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    PAGE: gl.constexpr, Q_BUFFERS: gl.constexpr = 2, WINDOW_LEFT: gl.constexpr = -1, SOFTCAP: gl.constexpr = 0.0,
    HAS_SINKS: gl.constexpr = False, DYNAMIC: gl.constexpr = False, O_BUFFERS: gl.constexpr = 0,
):
    """`paged_attention_prefill` (bf16/fp16, no variant) as `varlen_fwd_tma_kernel`: the same
    persistent work tiles, loader warp and consumer warpgroups, with each sequence's keys
    the cache positions [0, seq_lens[b]) of its block table row (query token i at position
    i + seq_lens[b] - its query count, bottom-right causal). The loader reads a key tile
    as boxes of BOX = min(PAGE, BLOCK_N) rows, each from its block (`_tma_boxes`): every
    box a TMA copy of [BOX, 64] (head dims as 64-column chunks, so a box fills whole
    swizzle atoms of its rows); a box past the sequence or in a padding block (an id
    outside [0, num_blocks)) is TMA's zeros, and the consumers hide a padding block's keys
    (`_bad_boxes`), rows past seq_lens[b] as in varlen. max_len: keys a table row holds
    (its columns x PAGE); DK = DV = a multiple of 64; launch with num_warps=4. The variants
    (WINDOW_LEFT, SOFTCAP, HAS_SINKS with `sinks_ptr`, `stride_sinks`) as
    `varlen_fwd_tma_kernel`'s, and DYNAMIC with `sched_ptr`, O_BUFFERS with `o_desc`."""
    dtype: gl.constexpr = q_desc.dtype
    CHUNKS: gl.constexpr = DK // 64
    BOX: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS * CHUNKS, 64, 64], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, BLOCK_N, 64], k_desc.layout)
    # V stages as p.V reads them, [BLOCK_N, DV]; a 128-byte swizzled buffer wider than 64
    # columns lies as its 64-column chunks one after another, so the loader writes them
    # as [BLOCK_N, 64] chunks (`v_boxes`).
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype))
    v_boxes = nvmma_chunks(v_smem, dtype, STAGES * (DV // 64), BLOCK_N, 64)
    q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed = _tma_barriers(Q_BUFFERS, STAGES)
    sched, out_store = _schedule_and_output(sched_ptr, o_desc, q_smem, DYNAMIC, O_BUFFERS)
    num_work = num_m_blocks * num_seqs * num_q_heads
    paging = (table_ptr, stride_tb, stride_tm, stride_lens, num_blocks)
    heads = (num_q_heads, heads_per_section)
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, lens_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, max_len, 0, GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, False,
                        paging, q_smem, paging, PAGE, BOX, (sinks_ptr, stride_sinks), WINDOW_LEFT, SOFTCAP,
                        HAS_SINKS, sched, DYNAMIC, out_store, O_BUFFERS)),
        (_ws_consumer, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                        out_ptr, cu_q_ptr, lens_ptr, stride_ot, stride_oh, qk_scale, heads, num_m_blocks, num_work,
                        total_q, max_len, 1, GROUP, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, CHUNKS, False,
                        paging, q_smem, paging, PAGE, BOX, (sinks_ptr, stride_sinks), WINDOW_LEFT, SOFTCAP,
                        HAS_SINKS, sched, DYNAMIC, out_store, O_BUFFERS)),
        (_tma_loader, (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, v_landed,
                       q_desc, k_desc, v_desc, cu_q_ptr, lens_ptr, heads, num_m_blocks, num_work, total_q,
                       max_len, GROUP, DK, DV, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False, paging, v_boxes, PAGE, BOX,
                       WINDOW_LEFT, sched, DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
