"""The Triton kernel of `dsv4_qnorm_rope_kv_insert` and the fp8_dsv4 record writer it shares
with the compressor (`store_record`).

One program per token: its query heads (RMSNorm without weight over the 512 values, then
GPT-J RoPE on the last 64: pairs (448 + 2i, 449 + 2i) rotated by the position's cos[i],
sin[i]), zeros for the padded heads, and, for the first `num_insert` tokens, the kv row
(RoPE, bf16, then a record or a bf16 row at its slot). Rounding to bf16 and to e4m3 is
done on the float32 bits (`graphsafe.kernels.fp8_bits`): the interpreter's conversions
round wrongly, and the bytes then equal `graphsafe.formats.fp8_dsv4.quantize_tokens`'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.kernels.fp8_bits import FP8_MAX, bf16_rounded_bits, e4m3_byte

NOPE = tl.constexpr(448)
HALF_ROPE = tl.constexpr(32)
DATA_BYTES = tl.constexpr(576)
SCALE_BYTES = tl.constexpr(8)
TILE = tl.constexpr(64)
NUM_TILES = tl.constexpr(7)
AMAX_FLOOR = tl.constexpr(1e-4)
F32_INF_BITS = tl.constexpr(0x7F800000)
BF16_NAN_BITS = tl.constexpr(0x7FC0)  # torch's float32 NaN -> bf16 (a quiet NaN); bits not specified


@triton.jit
def bf16_value(x):
    """float32 `x` rounded to bfloat16 (to nearest even, on the bits), as float32; NaN kept."""
    return tl.where(x != x, x, bf16_rounded_bits(x).to(tl.float32, bitcast=True))


@triton.jit
def bf16_bits(x):
    """The bfloat16 bits (int32, low 16) of float32 `x`, rounded to nearest even; NaN 0x7FC0 (sign kept)."""
    nan = ((x.to(tl.int32, bitcast=True) >> 16) & 0x8000) | BF16_NAN_BITS
    return tl.where(x != x, nan, (bf16_rounded_bits(x) >> 16) & 0xFFFF)


@triton.jit
def rope_pair(even, odd, cos, sin):
    """GPT-J RoPE of the pairs (even, odd): (e cos - o sin, e sin + o cos), float32."""
    return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def store_tile(base, x, mask):
    """Quantise one 64-value NoPE tile `x` (float32, bf16 values) as `fp8_dsv4.scale_bytes` /
    `quantize_tokens` do and store its 64 e4m3 bytes at `base`; returns its UE8M0 byte."""
    # amax on the bits of |x|: integer order is float order for sign 0, every NaN above +inf.
    amax_bits = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0)
    nonfinite = amax_bits >= F32_INF_BITS
    amax = tl.maximum(tl.where(nonfinite, 0, amax_bits).to(tl.float32, bitcast=True), AMAX_FLOOR)
    qbits = tl.math.div_rn(amax, FP8_MAX).to(tl.int32, bitcast=True)
    e = ((qbits >> 23) & 0xFF) - 127 + ((qbits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exactly (e in [-22, 120])
    values = tl.where(nonfinite, 0x7F, e4m3_byte(x * inv).to(tl.int32)).to(tl.uint8)
    tl.store(base, values, mask=mask)
    return tl.where(nonfinite, 255, e + 127)


@triton.jit
def store_bf16_bytes(at, x, mask):
    """The bfloat16 of float32 `x` as two little-endian bytes at `at`, `at + 1` (no alignment needed)."""
    bits = bf16_bits(x)
    tl.store(at, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(at + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def store_record(cache_ptr, slot, enabled, row_ptr, even, odd, BLOCK_SIZE: tl.constexpr, stride_cb):
    """Write a token's fp8_dsv4 record at `slot` (block `slot // BLOCK_SIZE`, blocks `stride_cb`
    bytes apart): its NoPE values from `row_ptr` (float32 or bf16, 448 of them, bf16 values
    once rounded), its RoPE values `even`, `odd` ([32] float32 each, rounded to bf16 here),
    the 7 scales and the pad byte 0. Nothing is read or written unless `enabled`."""
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    base = cache_ptr + blk.to(tl.int64) * stride_cb
    data = base + off * DATA_BYTES
    scales = base + BLOCK_SIZE * DATA_BYTES + off * SCALE_BYTES
    c = tl.arange(0, TILE)
    live = c < tl.where(enabled, TILE, 0)
    k = tl.arange(0, SCALE_BYTES)
    scale_bytes = tl.zeros([SCALE_BYTES], dtype=tl.int32)  # the 8th stays 0: the pad byte
    for j in tl.static_range(NUM_TILES):
        x = bf16_value(tl.load(row_ptr + j * TILE + c, mask=live, other=0.0).to(tl.float32))
        byte = store_tile(data + j * TILE + c, x, live)
        scale_bytes = tl.where(k == j, byte, scale_bytes)
    tl.store(scales + k, scale_bytes.to(tl.uint8), mask=k < tl.where(enabled, SCALE_BYTES, 0))
    i = tl.arange(0, HALF_ROPE)
    rope_live = i < tl.where(enabled, HALF_ROPE, 0)
    store_bf16_bytes(data + NOPE + 4 * i, even, rope_live)
    store_bf16_bytes(data + NOPE + 2 + 4 * i, odd, rope_live)


@triton.jit
def qnorm_rope_kv_insert_kernel(
    q_ptr, kv_ptr, qo_ptr, cache_ptr, slot_ptr, pos_ptr, cs_ptr,
    eps, num_heads, padded_heads, num_insert, max_pos, num_slots,
    stride_qt, stride_qh, stride_kvt, stride_qot, stride_qoh, stride_cb, stride_ct, stride_cs,
    BLOCK_SIZE: tl.constexpr, RECORDS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos)  # a position outside the table: a padding token
    pos = tl.where(ok, pos, 0)
    i = tl.arange(0, HALF_ROPE)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < tl.where(ok, HALF_ROPE, 0), other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF_ROPE + i, mask=i < tl.where(ok, HALF_ROPE, 0), other=0.0)
    cols = tl.arange(0, 512)
    nope = cols < NOPE

    # Queries: RMSNorm (IEEE sqrt and division) and RoPE of each live head; zeros for the
    # padded heads and for every head of a padding token.
    for h0 in range(0, padded_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        live = heads < tl.where(ok, num_heads, 0)  # (scalar & tensor masks: not in the interpreter)
        rows = q_ptr + t * stride_qt + heads.to(tl.int64) * stride_qh
        x = tl.load(rows[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.sum(x * x, axis=1) / 512.0 + eps))
        even = tl.load(rows[:, None] + (2 * i + NOPE)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        odd = tl.load(rows[:, None] + (2 * i + (NOPE + 1))[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        new_even, new_odd = rope_pair(even * r[:, None], odd * r[:, None], cos[None, :], sin[None, :])
        # Padded heads are zeros whatever the table row holds (0 * NaN would not be).
        new_even = tl.where(live[:, None], new_even, 0.0)
        new_odd = tl.where(live[:, None], new_odd, 0.0)
        out = qo_ptr + t * stride_qot + heads.to(tl.int64) * stride_qoh
        store = heads < padded_heads
        nope_bits = bf16_bits(tl.where(live[:, None], x * r[:, None], 0.0))
        tl.store(out[:, None] + cols[None, :], nope_bits.to(tl.int16).to(tl.bfloat16, bitcast=True),
                 mask=store[:, None] & nope[None, :])
        tl.store(out[:, None] + (2 * i + NOPE)[None, :], bf16_bits(new_even).to(tl.int16).to(tl.bfloat16, bitcast=True),
                 mask=store[:, None])
        tl.store(out[:, None] + (2 * i + (NOPE + 1))[None, :],
                 bf16_bits(new_odd).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=store[:, None])

    # The kv row: RoPE, then the record (or bf16 row) at its slot.
    slot = tl.load(slot_ptr + t, mask=t < num_insert, other=-1).to(tl.int64)
    enabled = ok & (t < num_insert) & (slot >= 0) & (slot < num_slots)
    slot = tl.where(enabled, slot, 0)
    kv_row = kv_ptr + t * stride_kvt
    i_live = i < tl.where(enabled, HALF_ROPE, 0)
    even = tl.load(kv_row + NOPE + 2 * i, mask=i_live, other=0.0).to(tl.float32)
    odd = tl.load(kv_row + NOPE + 1 + 2 * i, mask=i_live, other=0.0).to(tl.float32)
    new_even, new_odd = rope_pair(even, odd, cos, sin)
    if RECORDS:
        store_record(cache_ptr, slot, enabled, kv_row, new_even, new_odd, BLOCK_SIZE, stride_cb)
    else:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        c_live = cols < tl.where(enabled, NOPE, 0)
        tl.store(dst + cols, tl.load(kv_row + cols, mask=c_live, other=0.0), mask=c_live)
        tl.store(dst + NOPE + 2 * i, bf16_bits(new_even).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=i_live)
        tl.store(dst + NOPE + 1 + 2 * i, bf16_bits(new_odd).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=i_live)
