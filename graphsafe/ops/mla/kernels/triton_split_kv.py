"""The Triton split-KV flash-decoding kernel of the MLA ops and its split combine.

`mla_attn_kernel`: one program per (head tile, split, query) walks its split's keys (a
dense request's block table or a sparse token's slots) and writes the final outputs (one
split) or f32 partials (several); `combine_kernel` merges the partials. What each
constexpr selects, and where the host side decides them: `graphsafe.ops.mla.triton` (the
runner) and `graphsafe.ops.mla.plan` (the choice, once per call signature).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import bf16_rounded_bits, e4m3_bytes_to_f16

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
def mla_attn_kernel(
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
    # key tile, q tile and accumulator (why 2 for 64-head tiles: plan.kernel_config).
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
def combine_kernel(
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
