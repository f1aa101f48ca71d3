"""Hopper (sm_90) kernel of `flash_attn_varlen` in Gluon: bf16/fp16, wgmma with the two
products of a key tile in flight together.

Why a second kernel: Triton's kernel (_triton_prefill.py) waits for each product before
the next starts: q.k of a tile, its softmax, then p.V, so the tensor cores idle through
every softmax (337 TFLOP/s on an H200 at 8 x 4096 causal, FlashAttention-3 579). Here the
q.k of tile j + 1 is issued, and then p.V of tile j, before the softmax of tile j + 1:
that softmax runs while p.V still computes (FlashAttention-3's intra-warpgroup overlap).

Program = (query block of BLOCK_M rows, sequence, query head): the grid, launch order
(heaviest causal block first) and semantics of the Triton kernel, which stays the
kernel of every other case (fp8, the variants, other head dims, other GPUs, the CPU
interpreter, which cannot run Gluon). BLOCK_M / 16 warps, each warpgroup owning 64 rows.

Data flow:
- cp.async (16 bytes a thread) copies q once, and K and V tiles [BLOCK_N, D] into two
  stages each; keys past the sequence (or past the last tile this block reads) are
  zero-filled, never read. At the top of iteration j the copies of V_j and K_{j+1} are
  awaited, a CTA barrier publishes them (and frees the stages read in iteration j - 1),
  and the copies of V_{j+1} and K_{j+2} are issued: one iteration of compute hides them.
- s = q K^T from shared memory (q [BLOCK_M, D], K-major K^T), f32;
- online softmax in f32, base 2, one FMA per score (log2(e) folded into qk_scale > 0);
  masked only in the blocks the causal diagonal or the sequence's end cuts through;
- acc += p V with p in registers (the score tile's layout is the A operand's: no shuffle)
  and V [BLOCK_N, D] from shared memory.
Shared memory (D = 128, BLOCK_N = 128): q 32 KiB + 2 x (K 32 + V 32) KiB = 160 KiB.

Semantics as the Triton kernel's (module docstring there): sequence bounds cut at the
tensors' ends, bottom-right causal alignment, a row that sees no key writes 0, NaN
scores keep their row NaN, rows outside every sequence are the prepare kernel's.

Only imported where Gluon exists (Triton >= 3.4); `gluon_varlen_fits` in triton.py says
where it runs.
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

# cp.async global -> shared: `async_load` from Triton 3.7 on, `async_copy_global_to_shared`
# before (3.6 is the GPU machines' Triton; the same arguments).
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# A CTA-wide barrier (bar.sync): `barrier` from 3.7 on, `thread_barrier` before.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

HEAD_DIMS = (64, 128)  # D (= Dv) this kernel serves


def shared_memory_bytes(block_m: int, block_n: int, d: int) -> int:
    """Shared memory of a launch: q [BLOCK_M, D] and two stages of K and V [BLOCK_N, D],
    16-bit, plus 1 KiB of Triton's scratch."""
    return 2 * (block_m + 4 * block_n) * d + 1024


@gluon.jit
def _sequence_bounds(cu_ptr, b, total, num_warps: gl.constexpr):
    """Rows `[start, end)` of sequence b: the running maximum of cu_seqlens clamped to
    `[0, total]` (`_triton_quant.sequence_bounds`, written again: a Gluon kernel cannot
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
    _cp_async(smem, ptrs, mask=(rows < row_end)[:, None])


@gluon.jit
def _softmax_step(s, m_i, l_i, n0, offs_m, k_len, diag, qk_scale,
                  BLOCK_N: gl.constexpr, S_COL: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """One key tile's scores s [BLOCK_M, BLOCK_N] (keys n0 ...) into the online softmax:
    (p unnormalised, alpha = the old rows' rescale, the new row max, the new row sum).
    MASKED tiles hide keys past the sequence and, CAUSAL, past row i's diagonal (n > i + diag)."""
    if MASKED:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=S_COL)
        visible = (offs_n < k_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_ref = m_new
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


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
    O_COL: gl.constexpr = gl.SliceLayout(0, O_MMA)

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
        full_end = gl.maximum(gl.minimum(k_len, m0 + diag + 1), 0)
    else:
        hi = k_len
        full_end = k_len
    full_tiles = full_end // BLOCK_N  # tiles [0, full_tiles) are visible to every row: no mask
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
        _cta_barrier()
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_MMA), use_acc=False)
        if full_tiles > 0:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, offs_m, k_len, diag, qk_scale,
                                               BLOCK_N, S_COL, False, CAUSAL)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, offs_m, k_len, diag, qk_scale,
                                               BLOCK_N, S_COL, True, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), P_OPERAND)

        for j in range(0, n_tiles - 1):
            # In: p_op of tile j (acc already rescaled to its row max). The copies of V_j
            # and K_{j+1} land; the barrier frees the stages tile j - 1 was read from.
            async_copy.wait_group(0)
            _cta_barrier()
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
            if j + 1 < full_tiles:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, (j + 1) * BLOCK_N, offs_m, k_len, diag, qk_scale,
                                                   BLOCK_N, S_COL, False, CAUSAL)
            else:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, (j + 1) * BLOCK_N, offs_m, k_len, diag, qk_scale,
                                                   BLOCK_N, S_COL, True, CAUSAL)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            acc = acc * gl.convert_layout(alpha, O_ROW)[:, None]
            p_op = gl.convert_layout(p.to(dtype), P_OPERAND)

        # The last tile's p.V.
        async_copy.wait_group(0)
        _cta_barrier()
        fence_async_shared()
        acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % 2), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    norm = gl.where(l_i == 0.0, 1.0, l_i)  # a NaN sum (NaN scores) keeps the row NaN
    o = acc / gl.convert_layout(norm, O_ROW)[:, None]
    # A row that sees no key is 0, decided from indices (as the Triton kernel).
    rows = m0 + gl.arange(0, BLOCK_M, layout=O_ROW)
    if CAUSAL:
        row_sees = (k_len > 0) & (rows + diag >= 0)
    else:
        row_sees = (k_len > 0) & (rows >= 0)
    o = gl.where(row_sees[:, None], o, 0.0)
    cols = gl.arange(0, D, layout=O_COL)
    out = out_ptr + q_start.to(gl.int64) * stride_ot + head * stride_oh
    out = out + (rows.to(gl.int64) * stride_ot)[:, None] + cols[None, :]
    gl.store(out, o.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])
