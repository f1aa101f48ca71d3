"""Triton backend of the MLA attention ops: split-KV flash decoding over the latent cache.

One kernel serves both ops; they differ only in how a key position maps to a cache row:
`mla_decode` walks its request's block table up to `seq_lens[b]`, `sparse_mla` reads the
token's own list of cache slots (`-1` = none). A block id or slot outside the cache (-1,
the padding, or any other) holds no key: sparse calls fold one unsigned compare per key
into the key mask; dense calls launch the kernel twice (CHECK_IDS off and on) and each
program, having scanned its split's block ids, works in the launch that matches, so the
common case (every id valid) runs the loop without a per-key check (see the kernel); on
the Gluon kernel, short splits launch once instead (`one_dense_launch`).
Masked keys address row 0 and load as 0: no id is ever dereferenced and no unread row
reaches the math. Non-finite scores follow the softmax arithmetic
(the ops' docstrings): a NaN or +inf score leaves l NaN, which the epilogue and the
combine keep NaN (only l == 0 means "no key").

Program = (head tile, split, query). It holds the query tile `[BLOCK_H, R + P]` (all
heads of a request for H = 16, or a 64-head tile for H = 128), so every cache row is read
once per request and head tile, and streams BLOCK_N rows at a time: scores through
`tl.dot` (f32 accumulation; wgmma/mma on the GPU), the online softmax in f32 (base 2),
and `acc[BLOCK_H, R] += p @ V` where V is the first R columns of the very tile just
loaded (the latent cache has no separate V). The R columns are one tile, or (64-head
tiles, `KernelConfig.value_chunks = 2`) two tiles of R/2 columns, each with its own q
tile, key tile and accumulator: fewer live row pointers per thread, so fewer spills
(splits.kernel_config says why). With one split the kernel writes the final
outputs; with several it writes f32 partials into the workspace (a split without a valid
key writes out 0, lse -inf) and `_combine_kernel` merges them, giving out 0, lse -inf
to a row whose splits are all empty.

`prepare_mla_decode` / `prepare_sparse_mla` (the registry's `prepare`, once per call
signature) fix the plan, config, grid, workspace specs and constexprs and bind both
kernels (`graphsafe.launch.bind`); the runner they return allocates the outputs, takes
the partials from the workspace and launches. A kernel compiles at the first call of its
binding, so that is where the runner meets what a compile can raise: `OutOfResources`
(one pipeline stage fewer, `_triton_launch`) and a failed Gluon compile (the Triton
kernel, `_attention_launch`); neither launched anything, so the runner relaunches.
`mla_decode` / `sparse_mla` take `config` / `num_splits` overrides (tests, tuning) and
keep a runner per signature and overrides.

The split plan comes from shapes only (see splits.py), so the launch captured into a
CUDA graph is right for every replay. The cache's block size is a compile-time constant
(a shift, not an integer division, per key row); 64-head tiles on NVIDIA also prefetch
the next key tile into L2 while the current one is scored (`KernelConfig.l2_prefetch`).

`sparse_mla`'s FlashMLA options are constexprs (a call without them compiles as before).
`topk_length` (TOPK_LENGTH) comes in the lengths slot, which a sparse call reads only
then: a token's key loop ends at its length, as a dense request's ends at `seq_lens`, so
the entries right of it are never read and a split past it runs no iteration. The
attention sink (HAS_SINK) scales out where the final out is written, by
`sigmoid(lse - sink)` as the denominator term `exp(sink - max)`: in the attention
kernel's epilogue with one split, in `_combine_kernel` (once, against the global max)
with several; the lse is returned without it.

On sm_90 the 64-head tiles run `_gluon_hopper.mla_attn_wgmma_kernel` instead (same grid,
plan and partials; `warpgroup_split_applies` says where): Triton's layouts make both
warpgroups compute the whole q.k score tile of this kernel, the Gluon kernel splits it.
The shapes, strides and device decide it once per signature (`warpgroup_split_fits`);
each call then tests that q and the cache are 16-byte aligned (the Triton kernel runs a
call whose pointers are not). Dense calls whose pages hold a multiple of 64 slots, with q
and the cache readable as 2-D TMA views (`paged_tma_fits`), run
`_gluon_paged.mla_decode_tma_kernel` instead, in one launch (TMA page tiles, two
warpgroups scoring alternate tiles; its module docstring), with the same grid, plan and
partials; a failed compile or a misaligned call runs the 64-head kernel (one launch or
two: `one_dense_launch`).

Triton's CPU interpreter computes `tl.dot` on bf16 operands wrongly; there (and only
there) bf16 dots run on f32 copies of the operands (DOT_F32), after rounding the
probabilities to bf16 as the GPU path does. Its float32 -> bf16 conversion truncates:
there the dequantized keys of an fp8_ds_mla cache (below) are rounded to nearest even
on their bits first, as the GPU's conversion rounds them.

An fp8_ds_mla cache (uint8 records, `graphsafe.formats.fp8_ds_mla`) runs the same kernel with
FP8_DS on (float caches compile without any of it: a constexpr branch). Its pointers
and strides count bytes. Per key tile the kernel loads the latent bytes of the keys'
records, converts them from e4m3 (`float8e4nv` in hardware where `has_ocp_e4m3`;
elsewhere, and in the interpreter, which turns the NaN bytes 0x7F / 0xFF into +-480,
exactly with integer ops), multiplies each by its record's float32 scale of that 128-column
tile (one load per key and tile, from byte R + 4 t) and rounds the products
to bf16, q's dtype, for the dots; the rope values are read through a bf16 view from
byte R + 4 R/128. Masked keys load nothing, as for a float cache. On sm_90 DeepSeek's
records (R = 512) run the Gluon kernel's FP8_DS variant instead (same numerics: the
products rounded to bf16; its module docstring), also at up to 16 heads, on its 64-head
tiles' plan (a tile dequantised once for all heads; the heads on wgmma's N, `heads_on_n`);
the dense TMA kernel reads 16-bit rows only. Dense decode over those records at up to 16
heads runs `_gluon_fp8_few_heads.mla_fp8_few_heads_kernel` (`few_heads_fp8_fits`: producer
warps dequantise the next tile while a consumer warpgroup multiplies this one; one launch,
the same grid, plan and partials; a failed compile or a misaligned call runs the one above).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime import OutOfResources

from graphsafe.backends import triton_interpreter_enabled
from graphsafe.device_info import has_ocp_e4m3
from graphsafe.ops.mla.fake import check_fp8_ds_mla_offset
from graphsafe.launch import bind, output_allocator
from graphsafe.kernels.fp8_bits import bf16_rounded_bits, e4m3_bytes_to_f16
from graphsafe.formats.fp8_ds_mla import is_fp8_ds_mla
from graphsafe.ops.mla.splits import (
    KernelConfig, SplitPlan, few_heads_wide_tiles, forced_plan, fp8_ds_kernel_config, max_shared_memory,
    partial_specs, plan_launch,
)
from graphsafe.registry import prepared
from graphsafe.workspace import current_workspace_manager

LOG2E = 1.4426950408889634
Launch = Callable[..., None]


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _prefetch_l2(ptrs):
    """PTX `prefetch.global.L2` of each address (a hint: never faults, changes no data)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _in_range(ids, n):
    """0 <= ids < n in one unsigned compare (a negative id wraps to a huge one); n >= 0."""
    return ids.to(tl.uint32, bitcast=True) < n


@triton.jit
def _block_ids_in_range(map_row, start, end, num_blocks, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """Whether the block ids of key positions [start, end) are all in [0, num_blocks)."""
    stop = tl.cdiv(end, BLOCK_SIZE)
    bad = tl.zeros([], dtype=tl.int32)
    for i0 in range(start // BLOCK_SIZE, stop, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        ids = tl.load(map_row + i, mask=i < stop, other=0)
        bad += tl.sum((~_in_range(ids, num_blocks)).to(tl.int32), axis=0)
    return bad == 0


@triton.jit
def _load_cols(rows, cols, row_mask, col_mask):
    """rows [N] pointers x cols [C] -> [N, C]; 0 where a row or a column is masked."""
    return tl.load(rows[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _round_bf16_bits(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even) on its bits, NaN kept:
    what the GPU's float32 -> bf16 conversion does, which the interpreter's truncates."""
    return tl.where(x != x, x, bf16_rounded_bits(x).to(tl.float32, bitcast=True))


@triton.jit
def _load_latent(rows, cols, row_mask, col_mask, FIRST: tl.constexpr, BLOCK_C: tl.constexpr, R: tl.constexpr,
                 FP8_DS: tl.constexpr, FP8_NATIVE: tl.constexpr, ROUND_BITS: tl.constexpr):
    """The latent columns `cols` (BLOCK_C of them, from column FIRST on) of the key rows
    `rows` ([N] pointers): [N, BLOCK_C] dot operands, 0 where a row or a column is
    masked. A float cache: its values. An fp8_ds_mla cache (FP8_DS; uint8 records,
    `rows` in bytes): byte c as e4m3 times the row's float32 scale of tile c // 128 (at
    byte R + 4 t), in float32, which is `dequantize_records` exactly, then rounded to
    bf16 (to nearest even; ROUND_BITS: on the bits first, for the interpreter); only the
    scales of the tiles these columns span are loaded, and masked rows load none."""
    if FP8_DS:
        mask = row_mask[:, None] & col_mask[None, :]
        b = tl.load(rows[:, None] + cols[None, :], mask=mask, other=0)
        if FP8_NATIVE:
            x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # exact on every target (the interpreter's fp8 conversion makes NaN bytes finite)
            x = e4m3_bytes_to_f16(b).to(tl.float32)
        scale_rows = (rows + R).to(tl.pointer_type(tl.float32))
        tile = cols // 128
        scale = tl.zeros_like(x)  # masked columns: 0 * 0
        for t in tl.static_range(FIRST // 128, (FIRST + BLOCK_C + 127) // 128):
            if t < R // 128:
                s_t = tl.load(scale_rows + t, mask=row_mask, other=0.0)
                scale = tl.where((tile == t)[None, :], s_t[:, None], scale)
        keys = x * scale
        if ROUND_BITS:
            keys = _round_bf16_bits(keys)
        keys = keys.to(tl.bfloat16)
    else:
        keys = _load_cols(rows, cols, row_mask, col_mask)
    return keys


@triton.jit
def _with_sink(l, m, no_key, sink):
    """The softmax denominator with the attention sink, in base 2 (`m` the running max of
    the base-2 scores, `l = sum_j 2^(s_j - m)`): `l + 2^(sink * log2(e) - m)`, so that
    `acc / it = (acc / l) * sigmoid(lse - sink)`, as the reference scales out. A +inf sink
    gives inf (out 0), a -inf one adds exactly 0 (out bit-equal to no sink), NaN gives
    NaN; 1 for a row without a key (its out stays 0 whatever the sink, never -inf - -inf)."""
    return tl.where(no_key, 1.0, l + tl.exp2(sink * 1.4426950408889634 - m))


@triton.jit
def _mla_attn_kernel(
    q_ptr, kv_ptr, map_ptr, lens_ptr, sink_ptr,
    out_ptr, lse_ptr, pout_ptr, plse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, head_tiles, num_splits, tokens_per_split, kv_capacity, num_slots,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_map,
    stride_or, stride_oh, stride_lr, stride_sink,
    R: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr, LINES: tl.constexpr, CHECK_IDS: tl.constexpr,
    FP8_DS: tl.constexpr, FP8_NATIVE: tl.constexpr, TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr,
):
    # Head tile varies fastest: the tiles of one (query, split) read the same rows
    # back to back, the second from L2.
    pid = tl.program_id(0)
    pid_h = pid % head_tiles
    split = (pid // head_tiles) % num_splits
    row = (pid // (head_tiles * num_splits)).to(tl.int64)

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_capacity)
    if not SPARSE or TOPK_LENGTH:
        # Positions past the request's length (dense) or entries right of the token's
        # topk_length (sparse) hold no key and are never read: the loop stops there, so
        # a split past the end runs zero iterations (a neutral partial).
        end = tl.minimum(end, tl.maximum(tl.load(lens_ptr + row), 0))
    num_blocks = num_slots // BLOCK_SIZE
    map_row = map_ptr + row * stride_map
    store_heads = num_heads
    if not SPARSE:
        # Block ids outside [0, num_blocks) are padding blocks (no key). A per-key check
        # in the pipelined loop costs 15% (H200, H = 16, B = 128), so a dense call
        # launches this kernel twice, without and with it (CHECK_IDS): a program scans
        # its split's ids first and runs (loads q, walks its keys, stores) in the launch
        # that matches; in the other it reads and writes nothing.
        # (16 ids per scan step: 32 and 256 measured slower, the loop's registers.)
        mine = _block_ids_in_range(map_row, start, end, num_blocks, BLOCK_SIZE, 16) != CHECK_IDS
        end = tl.where(mine, end, start)
        store_heads = tl.where(mine, num_heads, 0)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < store_heads  # nothing read for rows the other launch serves (dense)
    # The R value columns are CHUNKS (1 or 2) chunks of BLOCK_R columns, each with its own
    # key tile, q tile and accumulator (why 2 for 64-head tiles: splits.kernel_config).
    # Column masks are all-true when the chunks cover R exactly: the masks then vary
    # along rows only, which keeps the row loads 16-byte vectorised.
    c0 = tl.arange(0, BLOCK_R)
    c0_mask = c0 < R if BLOCK_R * CHUNKS != R else tl.full([BLOCK_R], 1, tl.int1)
    q_rows = q_ptr + row * stride_qr + heads.to(tl.int64) * stride_qh
    q0 = _load_cols(q_rows, c0, hmask, c0_mask)
    if CHUNKS == 2:
        c1 = BLOCK_R + c0
        c1_mask = c1 < R if BLOCK_R * CHUNKS != R else tl.full([BLOCK_R], 1, tl.int1)
        q1 = _load_cols(q_rows, c1, hmask, c1_mask)
    if P > 0:
        pp = tl.arange(0, BLOCK_P)
        pmask = pp < P if BLOCK_P != P else tl.full([BLOCK_P], 1, tl.int1)
        q_pe = _load_cols(q_rows + R, pp, hmask, pmask)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    if CHUNKS == 2:
        acc1 = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end
        # An id outside the cache (-1, the padding, or any other) holds no key: it joins
        # the mask, and masked lanes address row 0, so no id is ever dereferenced.
        if SPARSE:
            slot = tl.load(map_row + offs, mask=nmask, other=-1)
            nmask = nmask & _in_range(slot, num_slots)
            slot = tl.where(nmask, slot, 0)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
        else:
            # Masked: block-table entries past the sequence may be garbage.
            blk = tl.load(map_row + offs // BLOCK_SIZE, mask=nmask, other=0)
            if CHECK_IDS:
                nmask = nmask & _in_range(blk, num_blocks)
                blk = tl.where(nmask, blk, 0)
            off = offs % BLOCK_SIZE
        kv_rows = kv_ptr + blk.to(tl.int64) * stride_kb + off.to(tl.int64) * stride_kt
        if PREFETCH:
            # Triton issues the next tile's copy at the end of this iteration (2 stages),
            # where only the p @ V wgmmas overlap its latency. Pull the next tile's rows
            # into L2 now, one prefetch per 128-byte line, issued after the q.k wgmmas
            # (below) so that the index load here has landed by then.
            nxt = offs + BLOCK_N
            nxt_mask = nxt < end
            if SPARSE:
                nxt_slot = tl.load(map_row + nxt, mask=nxt_mask, other=0)
                nxt_mask = nxt_mask & _in_range(nxt_slot, num_slots)
                nxt_blk = nxt_slot // BLOCK_SIZE
                nxt_off = nxt_slot % BLOCK_SIZE
            else:
                nxt_blk = tl.load(map_row + nxt // BLOCK_SIZE, mask=nxt_mask, other=0)
                if CHECK_IDS:
                    nxt_mask = nxt_mask & _in_range(nxt_blk, num_blocks)
                nxt_off = nxt % BLOCK_SIZE
            nxt_rows = kv_ptr + nxt_blk.to(tl.int64) * stride_kb + nxt_off.to(tl.int64) * stride_kt
            lines = tl.arange(0, LINES) * 64  # 128-byte lines of 16-bit elements
            line_ok = nxt_mask[:, None] & (lines < R + P)[None, :]
            # Rows without a key (past the end, padding ids) prefetch the cache's first line instead.
            nxt_lines = tl.where(line_ok, nxt_rows[:, None] + lines[None, :], kv_ptr)
        # Masked rows load as 0 (never garbage, which could be NaN): p = 0 times 0.
        # (DOT_F32, the interpreter: dequantized fp8_ds_mla keys round to bf16 on the bits.)
        k0 = _load_latent(kv_rows, c0, nmask, c0_mask, 0, BLOCK_R, R, FP8_DS, FP8_NATIVE, DOT_F32)
        s = _dot(q0, tl.trans(k0), None, DOT_F32)
        if CHUNKS == 2:
            k1 = _load_latent(kv_rows, c1, nmask, c1_mask, BLOCK_R, BLOCK_R, R, FP8_DS, FP8_NATIVE, DOT_F32)
            s = _dot(q1, tl.trans(k1), s, DOT_F32)
        if P > 0:
            if FP8_DS:  # the bf16 rope values after the latent bytes and the scales
                pe_rows = (kv_rows + (R + 4 * (R // 128))).to(tl.pointer_type(tl.bfloat16))
            else:
                pe_rows = kv_rows + R
            k_pe = _load_cols(pe_rows, pp, nmask, pmask)
            s = _dot(q_pe, tl.trans(k_pe), s, DOT_F32)
        if PREFETCH:
            _prefetch_l2(nxt_lines)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no valid key so far keeps m = -inf; shift it by 0 (not -inf - -inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # The value of a key is the first R columns of the very tiles just loaded.
        p = p.to(q_ptr.dtype.element_ty)  # the cache's dtype, or bf16 for fp8_ds_mla records
        acc0 = _dot(p, k0, acc0 * alpha[:, None], DOT_F32)
        if CHUNKS == 2:
            acc1 = _dot(p, k1, acc1 * alpha[:, None], DOT_F32)
        m_i = m_new

    # l = 0 exactly when no valid key scored above -inf (the largest contributes exp2(0) = 1).
    # A NaN l (a NaN or +inf score) is not "no key": out and lse stay NaN.
    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    lse = tl.where(no_key, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if SPLIT:
        part = (row * num_splits + split) * num_heads + heads.to(tl.int64)
        o_rows = pout_ptr + part * R
        tl.store(o_rows[:, None] + c0[None, :], acc0 / l_safe[:, None], mask=hmask[:, None] & c0_mask[None, :])
        if CHUNKS == 2:
            tl.store(o_rows[:, None] + c1[None, :], acc1 / l_safe[:, None], mask=hmask[:, None] & c1_mask[None, :])
        tl.store(plse_ptr + part, lse, mask=hmask)
    else:
        l_out = l_safe
        if HAS_SINK:
            l_out = _with_sink(l_i, m_i, no_key, tl.load(sink_ptr + heads * stride_sink, mask=hmask, other=0.0))
        o_rows = out_ptr + row * stride_or + heads.to(tl.int64) * stride_oh
        o_ty = out_ptr.dtype.element_ty
        o0 = (acc0 / l_out[:, None]).to(o_ty)
        tl.store(o_rows[:, None] + c0[None, :], o0, mask=hmask[:, None] & c0_mask[None, :])
        if CHUNKS == 2:
            o1 = (acc1 / l_out[:, None]).to(o_ty)
            tl.store(o_rows[:, None] + c1[None, :], o1, mask=hmask[:, None] & c1_mask[None, :])
        tl.store(lse_ptr + row * stride_lr + heads, lse, mask=hmask)


@triton.jit
def _combine_kernel(
    pout_ptr, plse_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, num_splits, r_chunks, stride_or, stride_oh, stride_lr, stride_sink,
    R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """out[row, h] = sum_s exp(lse_s - lse) * out_s, lse = logsumexp_s lse_s (natural log).
    With the attention sink (HAS_SINK), out is scaled by `sigmoid(lse - sink[h])`: its
    term `exp(sink - m)` joins the denominator once, against the global max m; lse stays.

    One program per (row, head, chunk of BLOCK_R columns): a batch of one request still
    spreads the partials' read over many SMs."""
    pid = tl.program_id(0)
    chunk = pid % r_chunks
    h = (pid // r_chunks) % num_heads
    row = (pid // (r_chunks * num_heads)).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    part = (row * num_splits + s) * num_heads + h
    lse_s = tl.load(plse_ptr + part, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights exp(-inf) = 0
    w = tl.exp(lse_s - m_use)  # NaN for a NaN partial, whatever max did with it
    total = tl.sum(w, 0)
    no_key = total == 0.0  # a NaN total (a NaN partial) keeps out and lse NaN
    total_safe = tl.where(no_key, 1.0, total)
    denominator = total_safe
    if HAS_SINK:  # +inf: out 0, -inf: out unchanged, NaN: NaN; a row without a key stays 0
        denominator = tl.where(no_key, 1.0, total + tl.exp(tl.load(sink_ptr + h * stride_sink) - m_use))
    scale = w / denominator
    rr = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rr < R
    vals = tl.load(pout_ptr + part[:, None] * R + rr[None, :], mask=smask[:, None] & rmask[None, :], other=0.0)
    o = tl.sum(vals * scale[:, None], 0)
    tl.store(out_ptr + row * stride_or + h * stride_oh + rr, o.to(out_ptr.dtype.element_ty), mask=rmask)
    lse = tl.where(no_key, float("-inf"), m_use + tl.log(total_safe))
    tl.store(lse_ptr + row * stride_lr + h, lse, mask=chunk == 0)


def _pow2(n: int, least: int = 16) -> int:
    return max(triton.next_power_of_2(max(n, 1)), least)


# Pipeline depth that compiled within the device's shared memory, per (config, device,
# dtype, head dim, cache dtype, variant). The configs are sized for their GPUs (splits.kernel_config);
# this only guards against a Triton version that allocates a little more shared memory:
# one stage fewer keeps the tiles, so the split plan and the workspace stay the same.
_STAGES: dict[tuple, int] = {}


def _variant(constexprs: dict) -> tuple:
    """The kernel variant a binding compiles, as a memo key part: every constexpr (sparse or
    dense, split, id check, the sparse options, the cache format...), so what one variant
    learnt (a failed compile, the depth that fitted) is never applied to another."""
    return tuple(sorted(constexprs.items()))


def _triton_launch(grid, args, constexprs, cfg: KernelConfig, where: tuple) -> Launch:
    """The Triton attention kernel bound to one signature (`graphsafe.launch.bind`), called
    with its 9 tensors. The kernel compiles at the first call of a binding (and at a call
    whose pointers Triton specialises differently): where the compiled kernel needs more
    shared memory than the device has (`OutOfResources`, raised before anything is
    launched), it is bound again with one pipeline stage fewer and launched, down to one
    stage; the depth that compiled is remembered in `_STAGES` for later bindings."""
    key = (cfg, *where, _variant(constexprs))
    stages = _STAGES.get(key, cfg.num_stages)

    def make(stages: int) -> Launch:
        return bind(_mla_attn_kernel, grid, *args, **constexprs, num_warps=cfg.num_warps, num_stages=stages)

    launch = make(stages)
    recorded = False

    def run(*tensors):
        nonlocal launch, stages, recorded
        while True:
            try:
                launch(*tensors)
            except OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
                launch = make(stages)
                recorded = False
                continue
            break
        if not recorded:
            _STAGES[key] = stages
            recorded = True

    return run


@functools.cache
def _gluon_module():
    """The Gluon kernel's module, or None where this Triton has no Gluon. Imported on first
    use only: CPU runs and other GPUs never need it."""
    try:
        from graphsafe.ops.mla import _gluon_hopper
    except (ImportError, AttributeError):  # no Gluon, or one without the Hopper ops used
        return None
    return _gluon_hopper


@functools.cache
def _paged_module():
    """The dense decode's TMA kernel module (_gluon_paged.py), or None where this Triton
    lacks the Gluon ops it uses (warp specialisation, TMA descriptors)."""
    try:
        from graphsafe.ops.mla import _gluon_paged
    except (ImportError, AttributeError):
        return None
    return _gluon_paged


# (device, dtype, head dim, cache dtype, variant) keys whose Gluon kernel failed to compile: those
# calls run the Triton kernel (a warning says why, once per key).
_GLUON_FAILED: set[tuple] = set()
# What a failed Gluon compile raises (RuntimeError: a failed MLIR pass).
_GLUON_COMPILE_ERRORS = (OutOfResources, triton.CompilationError, RuntimeError)


def warpgroup_split_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """The part of `warpgroup_split_applies` fixed by a call signature (shapes, strides,
    dtype, device), decided once in `prepare`: all of it but the data pointers'
    alignment, which the runner tests per call."""
    if not cfg.warpgroup_split:
        return False
    fp8_ds = kv_cache.dtype != q.dtype  # an fp8_ds_mla cache (the ops check its records)
    if q.device.type != "cuda" or torch.version.hip is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if r not in (256, 512) or p != 64:  # the shapes its copy layout and GPU tests cover
        return False
    # Strides in elements: 16-bit rows (bytes for an fp8_ds_mla cache) of whole 16-byte copies.
    if any(st % 16 for st in (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1))):
        return False
    module = _gluon_module()
    if module is None or (cfg.block_h, cfg.block_n) != (module.BLOCK_H, module.BLOCK_N):
        return False
    # The records dequantise to bf16, q's dtype (the ops refuse other queries with them).
    records = q.dtype == torch.bfloat16 and is_fp8_ds_mla(kv_cache, r, r + p) and module.fp8_ds_supported(r, p)
    if fp8_ds and not records:
        return False
    smem = max_shared_memory(q.device)
    return smem is not None and module.shared_memory_bytes(r, p, fp8_ds) <= smem


def paged_tma_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether dense decode calls of this signature run `_gluon_paged.mla_decode_tma_kernel`
    (the runner tests each call's 16-byte alignment): where the 64-head Gluon kernel would
    (`warpgroup_split_fits`), with pages of a multiple of 64 slots (a 64-key tile lies in
    one page), q's heads evenly spaced through its rows and the cache's pages through its
    blocks (TMA reads each as one 2-D [rows, R + P] view), row strides of whole 16 bytes
    and row counts TMA coordinates (int32) reach."""
    if kv_cache.dtype != q.dtype or not warpgroup_split_fits(q, kv_cache, cfg, r, p):  # (its 64-key tiles included)
        return False  # (an fp8_ds_mla cache: the 64-head kernel reads it, this one 16-bit rows only)
    rows, heads, d = q.shape
    nb, bs = kv_cache.shape[:2]
    if bs % 64 or q.stride(2) != 1 or kv_cache.stride(2) != 1:
        return False
    if q.stride(0) != heads * q.stride(1) or kv_cache.stride(0) != bs * kv_cache.stride(1):
        return False
    if q.stride(1) % 8 or kv_cache.stride(1) % 8 or max(rows * heads, nb * bs) + 64 >= 2**31:
        return False
    module = _paged_module()
    smem = max_shared_memory(q.device)
    return module is not None and smem is not None and module.shared_memory_bytes(r, p) <= smem


@functools.cache
def _few_heads_module():
    """The warp-specialised fp8_ds_mla kernel's module (_gluon_fp8_few_heads.py), or None
    where this Triton lacks the Gluon ops it uses."""
    try:
        from graphsafe.ops.mla import _gluon_fp8_few_heads
    except (ImportError, AttributeError):
        return None
    return _gluon_fp8_few_heads


def few_heads_fp8_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether dense decode calls of this signature run `_gluon_fp8_few_heads`' kernel (the
    runner tests each call's 16-byte alignment): fp8_ds_mla records with the heads on N
    (`heads_on_n`: up to 16 heads) where the 64-head Gluon kernel would run
    (`warpgroup_split_fits`: sm_90, bf16 q, 16-byte strides, DeepSeek's records), and
    the shared memory it needs."""
    if kv_cache.dtype == q.dtype or not heads_on_n(q.shape[1], True) or not warpgroup_split_fits(q, kv_cache, cfg, r, p):
        return False
    module = _few_heads_module()
    smem = max_shared_memory(q.device)
    return module is not None and module.supported(r, p) and smem is not None and module.shared_memory_bytes(r, p) <= smem


def warpgroup_split_applies(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether a launch with `cfg` runs the Gluon kernel (_gluon_hopper.py): a config that
    asks for it with the kernel's tiles (64 heads, 64 keys), a CUDA sm_90 device (wgmma;
    Blackwell has none), a 16-bit dtype, R = 512 (DeepSeek) or 256 with P = 64, rows the
    16-byte copies can address (q and the cache 16-byte aligned, their row strides
    multiples of 16 elements: what Triton's specialisation proves; without it the cp.async
    copies do not compile), a cache of q's dtype or DeepSeek's fp8_ds_mla records (R =
    512; the kernel dequantises them), and the shared memory the kernel needs."""
    return not (q.data_ptr() | kv_cache.data_ptr()) & 15 and warpgroup_split_fits(q, kv_cache, cfg, r, p)


def _gluon_failed(key: tuple, exc: BaseException) -> None:
    if key not in _GLUON_FAILED:
        _GLUON_FAILED.add(key)
        warnings.warn(f"graphsafe mla: the sm_90 Gluon kernel did not compile for {key} ({exc}); "
                      "running the Triton kernel", RuntimeWarning, stacklevel=4)


def heads_on_n(num_heads: int, fp8_ds: bool) -> bool:
    """Whether the Gluon kernel computes with keys on wgmma's M and the heads on its N
    (HEADS_ON_N: s^T = k q^T, O^T += V^T p^T): over fp8_ds_mla records, up to 16 heads,
    where 64-row head tiles would be three quarters padding. Measured on an H200 against
    the 64-row tiles (`benchmarks/results/h200_s30_fp8_heads_on_n.txt`, graph replays):
    dense decode at 16 heads, ctx 8192, B 1 / 8 / 32 / 64 / 128: 0.91 / 0.88 / 0.91 / 0.90 /
    0.88x; ctx 32768, B 64: 0.89x; sparse, K 2048, T 64 / 128: 0.80x. On an H100
    (`h100_s30_fp8_heads_on_n.txt`): 1.03 / 0.92 / 0.90 / 0.91 / 0.88x, 0.88x, 0.78x."""
    return fp8_ds and num_heads <= 16


# Dense decode on the Gluon kernel: one launch (`IDS_PER_PROGRAM`) where a program walks
# at most this many key tiles, else two (`IDS_UNCHECKED`, `IDS_CHECKED`). The one launch's
# branch per key tile costs 2-5% at 32-128 tiles a program; the second launch costs a few
# microseconds of device time (0.003 ms at B 1) and ~10 us of host time per eager call.
# Measured on an H100 (benchmarks/NOTES.md): one / two launches 0.86-0.97 at 2-8 tiles,
# 0.97-1.00 at 16, 1.00-1.05 at 32 and more.
ONE_LAUNCH_MAX_TILES = 16


def one_dense_launch(plan: SplitPlan, cfg: KernelConfig) -> bool:
    """Whether a dense call on the Gluon kernel launches it once (`ONE_LAUNCH_MAX_TILES`)."""
    return triton.cdiv(plan.tokens_per_split, cfg.block_n) <= ONE_LAUNCH_MAX_TILES


def _attention_launch(grid, args, gluon_constexprs, triton_constexprs, cfg: KernelConfig, where: tuple,
                      gluon: bool, dense: bool, one_launch: bool) -> Launch:
    """The attention kernel's launch, called with its 9 tensors: the Triton kernel, or
    where `gluon` (the signature part of `warpgroup_split_applies`) the Gluon kernel for
    calls whose q and cache are 16-byte aligned, the Triton kernel (bound on first need)
    for the others and for good once the Gluon kernel fails to compile (a failed compile
    launched nothing: the Triton kernel then runs the call). `dense`: the kernel launches
    twice, without and with the per-key id check (CHECK_IDS: each program works in the
    launch its split's ids call for), but the Gluon kernel launches once where
    `one_launch` (`IDS_PER_PROGRAM`)."""
    def triton_launch(check_ids: bool) -> Launch:
        return _triton_launch(grid, args, {**triton_constexprs, "CHECK_IDS": check_ids}, cfg, where)

    def gluon_launch(check_ids: str, fallback: Callable[[], Launch]) -> Launch:
        """The Gluon kernel with CHECK_IDS = its module's `check_ids`, else `fallback()`."""
        if not gluon:
            return fallback()
        module = _gluon_module()
        constexprs = {**gluon_constexprs, "CHECK_IDS": int(getattr(module, check_ids))}
        key = (*where, _variant(constexprs))
        if key in _GLUON_FAILED:
            return fallback()
        wgmma = bind(module.mla_attn_wgmma_kernel, grid, *args, **constexprs, num_warps=module.NUM_WARPS)
        return _gluon_or_fallback(key, wgmma, fallback)

    def both(first: Launch, second: Launch) -> Launch:
        def run(*tensors):
            first(*tensors)
            second(*tensors)

        return run

    def triton_pair() -> Launch:
        return both(triton_launch(False), triton_launch(True))

    if not dense:  # (sparse: slots are checked per key)
        return gluon_launch("IDS_UNCHECKED", lambda: triton_launch(False))
    if not gluon:
        return triton_pair()
    if one_launch:
        return gluon_launch("IDS_PER_PROGRAM", triton_pair)
    return both(gluon_launch("IDS_UNCHECKED", lambda: triton_launch(False)),
                gluon_launch("IDS_CHECKED", lambda: triton_launch(True)))


def _gluon_or_fallback(key: tuple, gluon: Launch | None, make_fallback: Callable[[], Launch]) -> Launch:
    """`run(q, kv, *rest)`: `gluon(q, kv, *rest)` for calls whose q and cache are 16-byte
    aligned, until it fails to compile (nothing launched: `_gluon_failed` remembers `key`
    and warns once), else the launch `make_fallback()` returns (made on first need)."""
    fallback = None

    def run(q, kv, *rest):
        nonlocal gluon, fallback
        if gluon is not None and not (q.data_ptr() | kv.data_ptr()) & 15:
            try:
                return gluon(q, kv, *rest)
            except _GLUON_COMPILE_ERRORS as exc:
                gluon = None
                _gluon_failed(key, exc)
        if fallback is None:
            fallback = make_fallback()
        fallback(q, kv, *rest)

    return run


def _paged_launch(grid, q: torch.Tensor, kv_cache: torch.Tensor, r: int, scalars: tuple, block_size: int, split: bool,
                  where: tuple, fallback: Launch) -> Launch:
    """The dense decode's attention launch, called with the 9 tensors of the others:
    `_gluon_paged.mla_decode_tma_kernel` (one launch, ids checked per tile) for calls whose
    q and cache are 16-byte aligned, `fallback` (the 64-head kernel's launches) for the
    others and for good once it fails to compile (a failed compile launched nothing)."""
    module = _paged_module()
    key = (*where, "paged", block_size, split)
    if key in _GLUON_FAILED:
        return fallback
    ph = _placeholder(q.device)
    kernel = bind(module.mla_decode_tma_kernel, grid, *module.tma_descriptors(q, kv_cache, r),
                  ph, ph, ph, ph, ph, ph, *scalars, BLOCK_SIZE=block_size, SPLIT=split,
                  CONSUMER_REGS=module.CONSUMER_REGS, LOADER_REGS=module.LOADER_REGS, num_warps=module.NUM_WARPS)

    def paged(q, kv, key_map, lens, sink, out, lse, pout, plse):  # q and the cache each as two descriptors
        kernel(q, q, kv, kv, key_map, lens, out, lse, pout, plse)

    return _gluon_or_fallback(key, paged, lambda: fallback)


def _few_heads_launch(grid, device: torch.device, scalars: tuple, r: int, p: int, block_size: int, split: bool,
                      where: tuple, fallback: Launch) -> Launch:
    """The dense decode's attention launch over fp8_ds_mla records at up to 16 heads, called
    with the 9 tensors of the others: `_gluon_fp8_few_heads.mla_fp8_few_heads_kernel` (one
    launch, ids checked per key) for calls whose q and cache are 16-byte aligned,
    `fallback` (the 64-head kernel's launch) for the others and for good once it fails to
    compile (a failed compile launched nothing)."""
    module = _few_heads_module()
    key = (*where, "few heads", block_size, split)
    if key in _GLUON_FAILED:
        return fallback
    ph = _placeholder(device)
    kernel = bind(module.mla_fp8_few_heads_kernel, grid, ph, ph, ph, ph, ph, ph, ph, ph, *scalars, R=r, P=p,
                  BLOCK_SIZE=block_size, SPLIT=split, PRODUCER_REGS=module.PRODUCER_REGS, num_warps=module.NUM_WARPS)

    def few_heads(q, kv, key_map, lens, sink, out, lse, pout, plse):  # (no sink in dense decode)
        kernel(q, kv, key_map, lens, out, lse, pout, plse)

    return _gluon_or_fallback(key, few_heads, lambda: fallback)


def _offset_checked(op: str, attention: Launch) -> Launch:
    """`attention` refusing (`InputError`) an fp8_ds_mla cache whose storage offset is not
    a multiple of 4 bytes (the kernel loads the scales as float32; the strides, part of
    the signature, were checked at its first call)."""
    def run(q, kv_cache, *rest):
        check_fp8_ds_mla_offset(op, kv_cache)
        attention(q, kv_cache, *rest)

    return run


def _combine_launch(rows: int, num_heads: int, r: int, num_splits: int, args: tuple, sink_stride: int | None) -> Launch:
    """`_combine_kernel` bound to one signature (`sink_stride`: the attention sink's, None
    without one); called with (pout, plse, sink, out, lse), the sink never read without it."""
    block_s = _pow2(num_splits, 2)
    block_r = min(_pow2(r), max(32, 4096 // block_s))
    r_chunks = triton.cdiv(r, block_r)
    return bind(
        _combine_kernel, (rows * num_heads * r_chunks,),
        *args, num_heads, num_splits, r_chunks, num_heads * r, r, num_heads, sink_stride or 0,
        R=r, BLOCK_S=block_s, BLOCK_R=block_r, HAS_SINK=sink_stride is not None, num_warps=4,
    )


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """A tensor on `device` that holds no memory: what `bind` takes at tensor positions."""
    return torch.empty(0, device=device)


def _prepare(
    op: str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    key_map: torch.Tensor,
    sparse: bool,
    kv_capacity: int,
    sm_scale: float,
    kv_lora_rank: int,
    config: KernelConfig | None,
    num_splits: int | None,
    topk_length: bool = False,
    sink_stride: int | None = None,
):
    """`attend(q, kv_cache, key_map, lens, sink) -> (out, lse)` for calls with the signature
    of these args: plan, config, grid, workspace specs, constexprs and the bound launches
    are fixed here; a call allocates the outputs, takes the partials from the workspace
    and launches. Holds no tensor of the call. `lens` cuts each row's keys (dense: the
    sequence lengths; sparse: read only with `topk_length`, the entries each token
    uses); `sink` is the `[H]` attention sink, read only where `sink_stride` (its stride)
    is not None (a placeholder tensor otherwise)."""
    rows, num_heads, head_dim = q.shape
    r, p = kv_lora_rank, head_dim - kv_lora_rank
    device, dtype = q.device, q.dtype
    fp8_ds = is_fp8_ds_mla(kv_cache, r, head_dim)
    sink = sink_stride is not None
    new_out = output_allocator((rows, num_heads, r), dtype, device)
    new_lse = output_allocator((rows, num_heads), torch.float32, device)
    if rows == 0 or num_heads == 0:
        def nothing(q, kv_cache, key_map, lens, sink):
            return new_out(), new_lse()

        return nothing
    if config is None and fp8_ds:
        config = fp8_ds_kernel_config(num_heads, device)
        # Up to 16 heads: the Gluon kernel's 64-head tiles (a quarter used) where they run,
        # faster than the 16-head Triton tiles that dequantise each key tile in registers
        # (benchmarks/NOTES.md); the published workspaces cover both plans.
        wide = few_heads_wide_tiles(num_heads, device)
        if wide is not None and warpgroup_split_fits(q, kv_cache, wide, r, p):
            config = wide
    elif config is None and not sparse:  # up to 16 heads: the TMA kernel's tiles where it runs
        wide = few_heads_wide_tiles(num_heads, device)
        if wide is not None and paged_tma_fits(q, kv_cache, wide, r, p):
            config = wide
    cfg, plan = plan_launch(rows, num_heads, kv_capacity, device, config)
    if num_splits is not None:  # tests and tuning only
        plan = forced_plan(kv_capacity, cfg.block_n, num_splits)
    split = plan.num_splits > 1
    specs = tuple(partial_specs(rows, num_heads, r, plan))
    nb, bs = kv_cache.shape[:2]
    head_tiles = triton.cdiv(num_heads, cfg.block_h)
    dot_f32 = dtype == torch.bfloat16 and device.type == "cpu" and triton_interpreter_enabled()
    grid = (head_tiles * plan.num_splits * rows,)
    # The tensors (q, the cache, the key map, the lengths, the sink, out, lse, the
    # partials) are placeholders at `bind`, which reads only their device: the runner
    # keeps none of the call's tensors alive.
    ph = _placeholder(device)
    args = (
        ph, ph, ph, ph, ph, ph, ph, ph, ph,
        float(sm_scale) * LOG2E,
        num_heads, head_tiles, plan.num_splits, plan.tokens_per_split, kv_capacity, nb * bs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), key_map.stride(0),
        num_heads * r, r, num_heads,  # out and lse are contiguous
        sink_stride or 0,
    )
    where = (device, dtype, head_dim, kv_cache.dtype)

    attention = _attention_launch(
        grid, args,
        dict(R=r, P=p, BLOCK_SIZE=bs, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPARSE=sparse, SPLIT=split,
             TOPK_LENGTH=topk_length, HAS_SINK=sink, FP8_DS=fp8_ds, HEADS_ON_N=heads_on_n(num_heads, fp8_ds)),
        dict(
            R=r, P=p, BLOCK_SIZE=bs, BLOCK_R=max(_pow2(r) // cfg.value_chunks, 16), CHUNKS=cfg.value_chunks,
            BLOCK_P=_pow2(p), BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPARSE=sparse, SPLIT=split,
            DOT_F32=dot_f32,
            # PTX prefetch: NVIDIA only (not the interpreter, not ROCm); its lines count
            # 16-bit elements, so not for fp8_ds_mla records (no default config prefetches).
            PREFETCH=cfg.l2_prefetch and device.type == "cuda" and torch.version.hip is None and not fp8_ds,
            LINES=_pow2(triton.cdiv(head_dim, 64), 1),
            FP8_DS=fp8_ds, FP8_NATIVE=fp8_ds and has_ocp_e4m3(device), TOPK_LENGTH=topk_length, HAS_SINK=sink,
        ),
        cfg, where, warpgroup_split_fits(q, kv_cache, cfg, r, p), not sparse, one_dense_launch(plan, cfg),
    )
    if not sparse:
        if paged_tma_fits(q, kv_cache, cfg, r, p):
            attention = _paged_launch(
                grid, q, kv_cache, r,
                (float(sm_scale) * LOG2E, num_heads, head_tiles, plan.num_splits, plan.tokens_per_split, kv_capacity,
                 nb, nb * bs, key_map.stride(0), num_heads * r, r, num_heads),
                bs, split, where, attention)
        elif few_heads_fp8_fits(q, kv_cache, cfg, r, p):
            attention = _few_heads_launch(
                grid, device,
                (float(sm_scale) * LOG2E, num_heads, plan.num_splits, plan.tokens_per_split, kv_capacity, nb * bs,
                 q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), key_map.stride(0), num_heads * r, r,
                 num_heads),
                r, p, bs, split, where, attention)

    if fp8_ds:  # the storage offset is no part of the signature: checked per call
        attention = _offset_checked(op, attention)
    if not split:  # the attention kernel applies the sink
        def attend(q, kv_cache, key_map, lens, sink):
            out, lse = new_out(), new_lse()
            attention(q, kv_cache, key_map, lens, sink, out, lse, out, lse)  # partials untouched (SPLIT off)
            return out, lse

        return attend
    combine = _combine_launch(rows, num_heads, r, plan.num_splits, (ph, ph, ph, ph, ph), sink_stride)

    def attend_split(q, kv_cache, key_map, lens, sink):  # the combine applies the sink
        out, lse = new_out(), new_lse()
        pout, plse = current_workspace_manager(device).get_simultaneous(*specs, owner=op)
        attention(q, kv_cache, key_map, lens, sink, out, lse, pout, plse)
        combine(pout, plse, sink, out, lse)
        return out, lse

    return attend_split


def prepare_mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, config=None, num_splits=None):
    """The Triton runner of `mla_decode` for calls with the signature of these args;
    `config` / `num_splits` override the plan (tests, tuning)."""
    capacity = block_table.shape[1] * kv_cache.shape[1]
    attend = _prepare("mla_decode", q, kv_cache, block_table, False, capacity, sm_scale, kv_lora_rank, config,
                      num_splits)

    def run(q, kv_cache, block_table, seq_lens, *_):
        return attend(q, kv_cache, block_table, seq_lens, seq_lens)  # the sink slot is never read (no sink)

    return run


def prepare_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink=None, topk_length=None, *,
                       config=None, num_splits=None):
    """The Triton runner of `sparse_mla` for calls with the signature of these args
    (`attn_sink` and `topk_length` None or not is part of it); `config` / `num_splits`
    as for `prepare_mla_decode`."""
    attend = _prepare("sparse_mla", q, kv_cache, indices, True, indices.shape[1], sm_scale, kv_lora_rank, config,
                      num_splits, topk_length=topk_length is not None,
                      sink_stride=None if attn_sink is None else attn_sink.stride(0))

    def run(q, kv_cache, indices, sm_scale=None, kv_lora_rank=None, attn_sink=None, topk_length=None):
        # Where an option is None its slot gets `indices`, which the kernels then never read.
        return attend(q, kv_cache, indices, indices if topk_length is None else topk_length,
                      indices if attn_sink is None else attn_sink)

    return run


# Runners of direct calls (tests, the tune bench), per signature and overrides.
def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, config=None, num_splits=None):
    """Dense absorbed-MLA decode (inputs unchecked); `config` / `num_splits` override the
    plan (tests, tuning). Prepared once per signature and overrides."""
    args = (q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank)
    return prepared(prepare_mla_decode, *args, config=config, num_splits=num_splits)(*args)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink=None, topk_length=None, *, config=None,
               num_splits=None):
    """Sparse absorbed-MLA attention over each token's own cache slots, with FlashMLA's
    optional sink and per-token lengths (inputs unchecked)."""
    args = (q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink, topk_length)
    return prepared(prepare_sparse_mla, *args, config=config, num_splits=num_splits)(*args)
