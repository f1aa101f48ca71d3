"""Known-answer records of graphsafe's byte formats (graphsafe/formats/), checked on every
backend that writes or reads them.

Every other byte test takes its expected bytes from the formats' own quantisers
(`fp8_ds_mla.quantize_records`, `indexer_k.quantize`), so an error shared by a quantiser
and the kernels (a wrong constant in the format itself: a tile scale of amax / 447) moves
the spec and the code together and passes. Here each record is written out by hand, as
literal numbers and bytes: the inputs, the e4m3 byte each value must become, the float32
scale bytes (little-endian), the bfloat16 rope bytes, and the values a reader must get
back. Nothing below calls a quantiser to make an expected value.

The records (e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; 448 = 0x7E the
largest finite value, 2^-9 = 0x01 the smallest subnormal, 0x7F / 0xFF NaN):

* fp8_ds_mla (DeepSeek-V3.2's 656-byte record: R = 512 latent values in 4 tiles of 128,
  4 float32 scales, P = 64 bf16 rope values). Record A: tile 0 of amax 448 (scale 1.0, so
  each quotient is the value itself: the limits, subnormals, ties rounded to even, a
  rounding that crosses into the next binade); tile 1 of amax 1.0 (scale 1/448, float32
  0x3B124925: quotients just under e4m3 values); tile 2 a zero tile (scale 1.0, -0.0 kept);
  tile 3 of amax 896 (scale 2.0: ties made by the division); rope values exact in bf16,
  fp16 and fp32, so the record is the same from each input dtype. Record B: a NaN tile.
  Record C (float32 inputs): a tile whose amax / 448 underflows (scale 1.0), a tile of
  scale 2^-149 (float32's smallest subnormal; quotients saturate to 448), an inf tile,
  rope values rounded to bfloat16 (ties to even, overflow to inf, subnormals).
* The indexer K cache (DeepGEMM's layout: a block is its tokens' e4m3 bytes, then their
  float32 scales; `s = max(amax, 1e-4) / 448`, rounded up to a power of two for "ue8m0"):
  keys at the limits, a zero key (the 1e-4 floor), a NaN key (canonical NaN scale), an inf
  key, the same under "ue8m0", and a key of two scale groups (quant_block_size 64).

NaN bits that the ops leave to the device's IEEE division (fp8_ds_mla: a NaN tile's scale,
the NaN quotients of an inf tile) are the x86 CPU's here (NaN operands kept, inf / inf =
0xFFC00000); on another device those bytes must be NaN, their bits are not compared.
"""

from __future__ import annotations

import struct

import pytest
import torch

import graphsafe
from graphsafe.backends import device_types_here
from graphsafe.formats import fp8_ds_mla, indexer_k
from graphsafe.testing import contract as C

DEVICES = device_types_here()
BF16, FP16, FP32, FP8, U8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8
NAN, INF = float("nan"), float("inf")
F32_MAX = 3.4028234663852886e38
SUB = 2.0**-149  # float32's smallest subnormal


def _f32_bytes(*words: int) -> list[int]:
    """Little-endian bytes of float32 bit patterns."""
    return [b for w in words for b in struct.pack("<I", w)]


# == fp8_ds_mla ========================================================================
R, P = 512, 64
RECORD = 656  # R + 4 * R / 128 + 2 * P
SCALES_AT, ROPE_AT = R, R + 4 * (R // 128)

# (latent column, input value, stored e4m3 byte, value read back). Columns not listed hold 0.0 -> 0x00 -> 0.0.
A_LATENT = [
    # tile 0: amax 448, scale 448 / 448 = 1.0: the quotient is the value.
    (0, 448.0, 0x7E, 448.0),  # e4m3's largest finite value
    (1, -448.0, 0xFE, -448.0),
    (2, 2.0**-9, 0x01, 2.0**-9),  # the smallest subnormal
    (3, -(2.0**-9), 0x81, -(2.0**-9)),
    (4, 2.0**-10, 0x00, 0.0),  # half the smallest subnormal: a tie, to even (0)
    (5, 3 * 2.0**-10, 0x02, 2.0**-8),  # between 2^-9 (0x01) and 2^-8 (0x02): to even
    (6, 1.0625, 0x38, 1.0),  # between 1.0 (0x38) and 1.125 (0x39): to even
    (7, 1.1875, 0x3A, 1.25),  # between 1.125 (0x39) and 1.25 (0x3A): to even
    (8, 432.0, 0x7E, 448.0),  # between 416 (0x7D) and 448 (0x7E): to even
    (9, -400.0, 0xFC, -384.0),  # between -384 (0xFC) and -416 (0xFD): to even
    (10, 2.0**-6, 0x08, 2.0**-6),  # the smallest normal
    (11, 7 * 2.0**-9, 0x07, 7 * 2.0**-9),  # the largest subnormal
    (12, 1.0, 0x38, 1.0),
    (13, -0.0, 0x80, -0.0),  # the sign of zero is kept
    (14, 0.5, 0x30, 0.5),
    (15, 240.0, 0x77, 240.0),
    (16, 250.0, 0x78, 256.0),  # above the 248 midpoint: rounds up into the next binade
    (17, 15.5, 0x58, 16.0),  # between 15 (0x57) and 16 (0x58, next binade): to even
    (18, 247.0, 0x77, 240.0),
    # tile 1: amax 1.0, scale 1/448 = float32 0x3B124925 (rounded up: 1 / s = 447.99997).
    (128, 1.0, 0x7E, 1.0),  # 447.99997 -> 448; 448 * s = 1.0000000447 -> 1.0 in float32
    (129, -1.0, 0xFE, -1.0),
    (130, 0.5, 0x76, 0.5),  # 223.99998 -> 224
    (131, 0.25, 0x6E, 0.25),  # 111.99999 -> 112
    (132, -0.125, 0xE6, -0.125),  # -55.999996 -> -56
    (133, 2.0**-7, 0x46, 2.0**-7),  # 3.4999998 -> 3.5
    # tile 2: a zero tile: amax 0, scale 0 / 448 = 0 -> 1.0.
    (261, -0.0, 0x80, -0.0),
    # tile 3: amax 896, scale 2.0: the division makes the ties.
    (384, 896.0, 0x7E, 896.0),
    (385, -3.0, 0xBC, -3.0),  # -1.5
    (386, 2.0**-8, 0x01, 2.0**-8),  # 2^-9
    (387, 2.0**-9, 0x00, 0.0),  # 2^-10: a tie, to even (0)
    (388, 2.125, 0x38, 2.0),  # 1.0625: a tie, to even (1.0)
]
A_SCALES = _f32_bytes(0x3F800000, 0x3B124925, 0x3F800000, 0x40000000)  # 1.0, 1/448, 1.0, 2.0
# (rope index, input, bf16 bytes little-endian, value read back): exact in bf16, fp16 and
# fp32. Others 0.0 -> 00 00.
A_ROPE = [(0, 1.0, 0x80, 0x3F, 1.0), (1, -2.5, 0x20, 0xC0, -2.5), (2, 3.140625, 0x49, 0x40, 3.140625),
          (3, -0.0, 0x00, 0x80, -0.0), (4, 2.0**-9, 0x00, 0x3B, 2.0**-9), (5, 448.0, 0xE0, 0x43, 448.0),
          (6, 65280.0, 0x7F, 0x47, 65280.0)]

# Record B: a NaN in tile 0 makes its scale NaN and every value byte of the tile NaN (0x7F:
# x / NaN keeps a NaN operand, here positive); tiles 1-3 are zero tiles. The NaN input is
# the positive quiet NaN of each dtype (POSITIVE_NAN): torch's float32 -> bfloat16
# conversion of a NaN may set the sign bit on a CPU.
B_LATENT = [(0, 1.0), (1, -3.0), (5, NAN), (127, 2.0**-9)]
POSITIVE_NAN = {BF16: (torch.int16, 0x7FC0), FP16: (torch.int16, 0x7E00), FP32: (torch.int32, 0x7FC00000)}
B_SCALES = _f32_bytes(0x7FC00000, 0x3F800000, 0x3F800000, 0x3F800000)  # NaN (x86: amax's NaN kept), 1.0 x 3

# Record C (float32 inputs): (latent column, input, byte, value read back).
C_LATENT = [
    # tile 0: amax 2^-142, amax / 448 = 0.29 * 2^-149 underflows to 0 -> scale 1.0; the values round to +-0.
    (0, 2.0**-142, 0x00, 0.0),
    (1, -(2.0**-142), 0x80, -0.0),
    # tile 1: amax 2^-140, amax / 448 = 1.14 * 2^-149 -> 2^-149 (bits 0x00000001).
    (128, 2.0**-140, 0x7E, 448 * SUB),  # 2^-140 / 2^-149 = 512: saturated to 448
    (129, 2.0**-148, 0x40, 2 * SUB),  # 2.0
    # tile 2: +-inf and finite values: scale inf, inf / inf NaN (x86: 0xFFC00000, byte 0xFF),
    # finite / inf = +-0 (read back 0 * inf = NaN): the whole tile reads back NaN.
    (256, INF, 0xFF, NAN),
    (257, 5.0, 0x00, NAN),
    (258, -5.0, 0x80, NAN),
    (259, -INF, 0xFF, NAN),
]
C_SCALES = _f32_bytes(0x3F800000, 0x00000001, 0x7F800000, 0x3F800000)  # 1.0, 2^-149, inf, 1.0
C_ROPE = [
    (0, 1 + 2.0**-8, 0x80, 0x3F, 1.0),  # halfway between bf16 1.0 and 1.0078125: to even
    (1, 1 + 3 * 2.0**-8, 0x82, 0x3F, 1.015625),  # halfway between 1.0078125 and 1.015625: to even
    (2, 1 + 2.0**-8 + 2.0**-20, 0x81, 0x3F, 1.0078125),  # just above halfway: up
    (3, F32_MAX, 0x80, 0x7F, INF),  # overflows bfloat16: +inf
    (4, -F32_MAX, 0x80, 0xFF, -INF),
    (5, 2.0**-140, 0x00, 0x00, 0.0),  # under half of bf16's smallest subnormal 2^-133: +0
    (6, 1.5 * 2.0**-133, 0x02, 0x00, 2.0**-132),  # halfway between subnormals 2^-133 and 2^-132: to even
]
# Device-defined NaN bits (module docstring): byte ranges of each record compared as "NaN" off the CPU.
B_DEVICE_NAN = [(SCALES_AT, SCALES_AT + 4), (5, 6)]
C_DEVICE_NAN = [(256, 257), (259, 260)]


def _record(latent, scales, rope, default_byte: int = 0x00) -> torch.Tensor:
    """The literal 656 bytes: value bytes (`latent` rows' third entries, others
    `default_byte`), the scale bytes, the rope bytes (others 00 00)."""
    out = [default_byte] * R + list(scales) + [0x00] * (2 * P)
    for row in latent:
        if len(row) > 2:
            out[row[0]] = row[2]
    for i, _, lo, hi, _ in rope:
        out[ROPE_AT + 2 * i], out[ROPE_AT + 2 * i + 1] = lo, hi
    return torch.tensor(out, dtype=U8)


def _inputs(latent, rope, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kv_c, k_pe = torch.zeros(1, R, dtype=FP32), torch.zeros(1, P, dtype=FP32)
    for row in latent:
        kv_c[0, row[0]] = row[1]
    for i, v, *_ in rope:
        k_pe[0, i] = v
    kv_c, k_pe = kv_c.to(dtype), k_pe.to(dtype)
    bits, nan = POSITIVE_NAN[dtype]
    kv_c.view(bits)[torch.isnan(kv_c)] = nan
    return kv_c, k_pe


def _read_back(latent, rope) -> torch.Tensor:
    """[R + P] float32: the row a reader must get (value column of the tables)."""
    row = torch.zeros(R + P, dtype=FP32)
    for c, *_, v in latent:
        row[c] = v
    for i, *_, v in rope:
        row[R + i] = v
    return row


RECORD_A = _record(A_LATENT, A_SCALES, A_ROPE)
RECORD_B = _record([], B_SCALES, [], default_byte=0x7F)
RECORD_B[128:R] = 0x00  # only tile 0 is the NaN tile
RECORD_C = _record(C_LATENT, C_SCALES, C_ROPE)
ROW_A = _read_back(A_LATENT, A_ROPE)
ROW_B = torch.cat([torch.full((128,), NAN), torch.zeros(R - 128 + P)])
ROW_C = _read_back(C_LATENT, C_ROPE)
ROW_C[256:384] = NAN  # the inf tile: 0 * inf and NaN bytes


def test_the_literal_records_have_the_layout():
    assert fp8_ds_mla.record_bytes(R, P) == RECORD == fp8_ds_mla.DEEPSEEK_RECORD_BYTES
    for record in (RECORD_A, RECORD_B, RECORD_C):
        assert record.shape == (RECORD,)
    assert RECORD_A[SCALES_AT:ROPE_AT].tolist() == [0x00, 0x00, 0x80, 0x3F, 0x25, 0x49, 0x12, 0x3B,
                                                    0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40]


def _assert_record(got: torch.Tensor, want: torch.Tensor, device_nan, what: str, device: str = "cpu") -> None:
    """`got` equals the literal bytes; off the CPU, the device-defined NaN ranges need only be NaN."""
    got = got.cpu()
    keep = torch.ones(RECORD, dtype=torch.bool)
    if device != "cpu":
        for lo, hi in device_nan:
            keep[lo:hi] = False
            chunk = got[lo:hi].contiguous()
            nan = torch.isnan(chunk.view(FP32)).all() if hi - lo == 4 else ((chunk & 0x7F) == 0x7F).all()
            assert nan, f"{what}: bytes [{lo}, {hi}) {chunk.tolist()} are not NaN"
    diff = (got != want) & keep
    if diff.any():
        at = diff.nonzero()[:, 0].tolist()
        raise AssertionError(f"{what}: {len(at)} bytes differ from the literal record, first at byte {at[0]}: "
                             f"{[hex(int(got[i])) for i in at[:8]]} instead of {[hex(int(want[i])) for i in at[:8]]}")


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_fp8_ds_mla_quantize_records_gives_the_literal_records(dtype):
    """The format's own spec functions against the hand-computed bytes and values."""
    records = [(A_LATENT, A_ROPE, RECORD_A, ROW_A, []), (B_LATENT, [], RECORD_B, ROW_B, B_DEVICE_NAN)]
    if dtype == FP32:
        records.append((C_LATENT, C_ROPE, RECORD_C, ROW_C, C_DEVICE_NAN))
    for latent, rope, record, row, device_nan in records:
        kv_c, k_pe = _inputs(latent, rope, dtype)
        _assert_record(fp8_ds_mla.quantize_records(kv_c, k_pe)[0], record, device_nan, "quantize_records")
        back = fp8_ds_mla.dequantize_records(record[None], R)[0]
        torch.testing.assert_close(back, row, rtol=0, atol=0, equal_nan=True)


def _cache_writers(device: str):
    spec = graphsafe.get_op("concat_and_cache_mla")
    return [(spec, b) for b in spec.available_backends(device)]


@pytest.mark.nonfinite  # the literal records hold a NaN tile on purpose
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ds_mla_cache_writes_are_the_literal_records(device, dtype):
    """`concat_and_cache_mla` into a uint8 cache, on every backend: records A, B (and C from
    float32) at their slots, byte for byte; the bytes of every other slot untouched."""
    latents = [(A_LATENT, A_ROPE, RECORD_A, []), (B_LATENT, [], RECORD_B, B_DEVICE_NAN)]
    if dtype == FP32:
        latents.append((C_LATENT, C_ROPE, RECORD_C, C_DEVICE_NAN))
    inputs = [_inputs(latent, rope, dtype) for latent, rope, *_ in latents]
    kv_c = torch.cat([i[0] for i in inputs]).to(device)
    k_pe = torch.cat([i[1] for i in inputs]).to(device)
    slots = torch.tensor([5, 2, 7][: len(latents)], device=device)
    nb, bs = 2, 4
    for spec, backend in _cache_writers(device):
        cache = torch.randint(0, 256, (nb, bs, RECORD), generator=torch.Generator().manual_seed(3)).to(U8)
        before = cache.clone()
        cache = cache.to(device)
        C.run_backend(spec, backend, (kv_c, k_pe, cache, slots))
        cache = cache.cpu()
        for (_, _, record, device_nan), slot in zip(latents, slots.tolist()):
            _assert_record(cache[slot // bs, slot % bs], record, device_nan, f"{backend} slot {slot}", device)
            before[slot // bs, slot % bs] = cache[slot // bs, slot % bs]
        assert torch.equal(cache, before), f"{backend}: bytes outside the written records changed"


def _ds_cache(device: str) -> tuple[torch.Tensor, dict[str, int]]:
    """A cache of 8 one-token blocks: record A at slot 1, B at 6, C at 4, random bytes
    elsewhere (never read)."""
    cache = torch.randint(0, 256, (8, 1, RECORD), generator=torch.Generator().manual_seed(4)).to(U8)
    slots = {"A": 1, "B": 6, "C": 4}
    for name, record in (("A", RECORD_A), ("B", RECORD_B), ("C", RECORD_C)):
        cache[slots[name], 0] = record
    return cache.to(device), slots


# q one-hot per head: (head, column): the score of a key is sm_scale times that column of its row.
Q_COLUMNS = [(0, 0), (1, 2), (2, R + 5), (3, 384)]  # A: 448, 2^-9, 448 (rope 5), 896 (tile 3)
SM_SCALE = 1.0 / 32


def _one_hot_q(rows: int) -> torch.Tensor:
    q = torch.zeros(rows, len(Q_COLUMNS), R + P, dtype=BF16)
    for h, c in Q_COLUMNS:
        q[:, h, c] = 1.0
    return q


def _check_mla_read(out: torch.Tensor, lse: torch.Tensor, order: list[str], what: str) -> None:
    """Rows reading one key each: out = that key's latent (the only softmax weight is 1), lse
    = sm_scale * its column; a key of a NaN or inf tile (B, C) makes every head NaN."""
    out, lse = out.float().cpu(), lse.cpu()
    for row, name in enumerate(order):
        if name == "A":
            want_out = ROW_A[:R].to(BF16).float().expand(len(Q_COLUMNS), R)
            want_lse = torch.tensor([SM_SCALE * float(ROW_A[c]) for _, c in Q_COLUMNS])
        else:
            want_out = torch.full((len(Q_COLUMNS), R), NAN)
            want_lse = torch.full((len(Q_COLUMNS),), NAN)
        torch.testing.assert_close(out[row], want_out, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}: out of the row reading record {name}: {m}")
        torch.testing.assert_close(lse[row], want_lse, rtol=1e-6, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}: lse of the row reading record {name}: {m}")


def _readers(op: str, device: str) -> list[str]:
    """The backends of `op` that read the format here; an aiter record (ROCm) must decline it
    (checked with the stand-in in `test_aiter_declines_fp8_ds_mla_caches`)."""
    return [b for b in graphsafe.get_op(op).available_backends(device) if b != "aiter"]


@pytest.mark.nonfinite  # the literal records hold a NaN tile on purpose
@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_reads_the_literal_records(device):
    cache, slots = _ds_cache(device)
    order = ["A", "B", "C"]
    block_table = torch.tensor([[slots[n], -1] for n in order], dtype=torch.int32, device=device)
    seq_lens = torch.ones(len(order), dtype=torch.int32, device=device)
    q = _one_hot_q(len(order)).to(device)
    spec = graphsafe.get_op("mla_decode")
    for backend in _readers("mla_decode", device):
        out, lse = C.run_backend(spec, backend, (q, cache, block_table, seq_lens, SM_SCALE, R))
        _check_mla_read(out, lse, order, f"mla_decode[{backend}]")


@pytest.mark.nonfinite  # the literal records hold a NaN tile on purpose
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_mla_reads_the_literal_records(device):
    cache, slots = _ds_cache(device)
    order = ["A", "B", "C"]
    indices = torch.tensor([[-1, slots[n]] for n in order], dtype=torch.int32, device=device)
    q = _one_hot_q(len(order)).to(device)
    spec = graphsafe.get_op("sparse_mla")
    for backend in _readers("sparse_mla", device):
        out, lse = C.run_backend(spec, backend, (q, cache, indices, SM_SCALE, R))
        _check_mla_read(out, lse, order, f"sparse_mla[{backend}]")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_aiter_declines_fp8_ds_mla_caches(aiter_standin, arch):
    """aiter's MLA kernels read a cache of q's dtype only: its predicates must hand the
    format to Triton (so no aiter backend reads it)."""
    aiter_standin(arch)
    cache, _ = _ds_cache("cpu")
    q = _one_hot_q(2)
    q = torch.cat([q] * 4, 1)  # 16 heads, a head count aiter serves
    table, lens = torch.tensor([[1], [6]], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for op, args in (("mla_decode", (q, cache, table, lens, SM_SCALE, R)),
                     ("sparse_mla", (q, cache, table, SM_SCALE, R))):
        spec = graphsafe.get_op(op)
        answer = spec.support("aiter", *args)
        assert not answer and answer.reason, (op, answer)


# == the indexer K cache ================================================================
D, BS = 128, 4
# (column, input, stored byte). Columns not listed hold 0.0 -> 0x00.
K_LIMITS = [(0, 448.0, 0x7E), (1, -448.0, 0xFE), (2, 2.0**-9, 0x01), (3, -(2.0**-9), 0x81), (4, 2.0**-10, 0x00),
            (5, 3 * 2.0**-10, 0x02), (6, 1.0625, 0x38), (7, 1.1875, 0x3A), (8, 432.0, 0x7E), (9, -400.0, 0xFC),
            (10, 250.0, 0x78), (11, -0.0, 0x80)]  # amax 448: s = 448 / 448 = 1.0 (also under ue8m0)
K_ZERO = [(11, -0.0, 0x80)]  # amax 0 -> the 1e-4 floor: s = float32(1e-4) / 448 = 0x346FACAD
K_NAN = [(0, 1.0), (1, -3.0), (5, NAN)]  # every byte 0x7F, scale the canonical NaN 0x7FC00000
K_INF = [(0, INF, 0x7F), (1, 5.0, 0x00), (2, -5.0, 0x80), (3, -INF, 0x7F)]  # scale +inf
# ue8m0, amax 1.0: s = 1/448 rounded up to 2^-8 (0x3B800000): the values times 256.
K_UE8M0 = [(0, 1.0, 0x78), (1, -1.0, 0xF8), (2, 0.5, 0x70), (3, 0.875, 0x76), (4, 2.0**-17, 0x01),
           (5, 0.0625, 0x58), (6, 2.0**-18, 0x00)]  # 256, -256, 128, 224, 2^-9, 16, 2^-10 (tie: 0)
# Scales (float32 bits) of each key: plain, and under ue8m0.
K_SCALES = {"limits": (0x3F800000, 0x3F800000), "zero": (0x346FACAD, 0x34800000),  # ue8m0: 2^-22
            "nan": (0x7FC00000, 0x7FC00000), "inf": (0x7F800000, 0x7F800000), "ue8m0": (None, 0x3B800000)}
K_ROWS = {"limits": K_LIMITS, "zero": K_ZERO, "nan": K_NAN, "inf": K_INF, "ue8m0": K_UE8M0}
# Which keys each scale_fmt writes, in slot order 0..3 of block 0.
K_KEYS = {None: ["limits", "zero", "nan", "inf"], "ue8m0": ["limits", "zero", "nan", "ue8m0"]}


def _key_bytes(name: str) -> list[int]:
    if name == "nan":
        return [0x7F] * D
    out = [0x00] * D
    for c, _, byte in K_ROWS[name]:
        out[c] = byte
    return out


def _key_input(name: str) -> list[float]:
    out = [0.0] * D
    for c, v, *_ in K_ROWS[name]:
        out[c] = v
    return out


def _k_block(fmt: str | None) -> torch.Tensor:
    """The literal block 0 (`BS * (D + 4)` bytes): the 4 keys' value bytes, token by token,
    then their 4 float32 scales (little-endian)."""
    names = K_KEYS[fmt]
    scales = [K_SCALES[n][0 if fmt is None else 1] for n in names]
    return torch.tensor([b for n in names for b in _key_bytes(n)] + _f32_bytes(*scales), dtype=U8)


def test_indexer_k_block_layout_is_the_literal_one():
    block = _k_block(None)
    assert block.numel() == BS * (D + 4)
    assert block[BS * D:].tolist() == [0x00, 0x00, 0x80, 0x3F, 0xAD, 0xAC, 0x6F, 0x34,
                                       0x00, 0x00, 0xC0, 0x7F, 0x00, 0x00, 0x80, 0x7F]


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_indexer_k_quantize_gives_the_literal_keys(dtype, fmt):
    k = torch.tensor([_key_input(n) for n in K_KEYS[fmt]]).to(dtype)
    values, scales = indexer_k.quantize(k, D, fmt)
    block = _k_block(fmt)
    assert values.view(U8).reshape(-1).tolist() == block[: BS * D].tolist()
    assert scales.reshape(-1).view(torch.int32).tolist() == [int(x) for x in block[BS * D:].view(torch.int32)]


def _k_cache(device: str, groups: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(6)
    return torch.randint(0, 256, (2, BS, D + 4 * groups), generator=gen).to(U8).to(device)


def _k_writes(device: str):
    out = []
    for op in ("indexer_k_quant_and_cache",):
        spec = graphsafe.get_op(op)
        out += [(spec, b) for b in spec.available_backends(device)]
    return out


@pytest.mark.nonfinite  # the literal records hold a NaN tile on purpose
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("device", DEVICES)
def test_indexer_k_cache_writes_are_the_literal_block(device, dtype, fmt):
    """`indexer_k_quant_and_cache` and the decode composite that calls it, on every backend:
    block 0 byte for byte, block 1 untouched."""
    k = torch.tensor([_key_input(n) for n in K_KEYS[fmt]]).to(dtype).to(device)
    slots = torch.arange(BS, device=device)
    want = _k_block(fmt)
    for spec, backend in _k_writes(device):
        cache = _k_cache(device)
        before = cache.cpu().clone()
        C.run_backend(spec, backend, (k, cache, slots, D, fmt))
        got = cache.cpu()
        assert got[0].reshape(-1).tolist() == want.tolist(), f"{spec.name}[{backend}]: block 0"
        assert torch.equal(got[1], before[1]), f"{spec.name}[{backend}]: block 1 changed"
    # The decode composite writes its tokens' keys through the same format.
    spec = graphsafe.get_op("sparse_attn_indexer_decode")
    q = torch.zeros(BS, 1, D, device=device).to(FP8)
    weights = torch.ones(BS, 1, device=device)
    seq_lens = torch.arange(1, BS + 1, dtype=torch.int32, device=device)
    table = torch.zeros(BS, 1, dtype=torch.int32, device=device)
    for backend in spec.available_backends(device):
        cache = _k_cache(device)
        topk = torch.full((BS, 1), -7, dtype=torch.int32, device=device)
        C.run_backend(spec, backend, (cache, q, k, weights, slots, seq_lens, table, topk, fmt, 1, BS))
        assert cache.cpu()[0].reshape(-1).tolist() == want.tolist(), f"{spec.name}[{backend}]: block 0"


def test_indexer_k_cache_of_two_scale_groups_is_the_literal_block():
    """quant_block_size 64 (G = 2): the first half of amax 448 (scale 1.0), the second of
    amax 896 (scale 2.0); the block's scale region holds the tokens' two scales each."""
    row = [0.0] * D
    row[0], row[1], row[64], row[65], row[66] = 448.0, 2.0**-9, 896.0, -3.0, 2.0**-9
    k = torch.tensor([row])
    values = [0x00] * D
    values[0], values[1], values[64], values[65], values[66] = 0x7E, 0x01, 0x7E, 0xBC, 0x00  # 2^-10: tie -> 0
    spec = graphsafe.get_op("indexer_k_quant_and_cache")
    for backend in spec.available_backends("cpu"):
        cache = _k_cache("cpu", groups=2)
        before = cache.clone()
        C.run_backend(spec, backend, (k, cache, torch.tensor([2]), 64, None))
        flat = cache[0].reshape(-1)
        assert flat[2 * D : 3 * D].tolist() == values, backend
        assert flat[BS * D + 16 : BS * D + 24].tolist() == _f32_bytes(0x3F800000, 0x40000000), backend
        keep = torch.ones_like(flat, dtype=torch.bool)
        keep[2 * D : 3 * D] = False
        keep[BS * D + 16 : BS * D + 24] = False
        assert torch.equal(flat[keep], before[0].reshape(-1)[keep]) and torch.equal(cache[1], before[1]), backend


def _literal_k_cache(fmt: str | None, device: str) -> torch.Tensor:
    cache = _k_cache(device).cpu()
    cache[0] = _k_block(fmt).view(BS, D + 4)
    return cache.to(device)


# Head h of the query reads column Q_COLUMNS_K[h] with weight WEIGHTS_K[h]: a key's logit is
# its scale times (value[0] + value[2] / 2), its values the read-back e4m3 values.
K_LOGITS = {None: [448.0 + 2.0**-10, 0.0, NAN, NAN],  # limits; zero; NaN; inf (its column 0 is a NaN byte)
            "ue8m0": [448.0 + 2.0**-10, 0.0, NAN, 1.0 + 0.25]}  # ...; ue8m0: 2^-8 * (256 + 128 / 2)
Q_COLUMNS_K, WEIGHTS_K = (0, 2), (1.0, 0.5)


def _k_query(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.zeros(len(Q_COLUMNS_K), D)
    for h, c in enumerate(Q_COLUMNS_K):
        q[h, c] = 1.0
    return q.to(FP8).to(device), torch.tensor([WEIGHTS_K], device=device)


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("device", DEVICES)
def test_indexer_k_cache_readers_read_the_literal_block(device, fmt):
    """The gather (bytes and scale bits), the paged logits and the logits of the gathered
    rows, on every backend, from the literal block."""
    cache = _literal_k_cache(fmt, device)
    block = _k_block(fmt)
    want_values = block[: BS * D].view(BS, D)
    want_scales = block[BS * D:].view(torch.int32)
    table = torch.tensor([[0, -1]], dtype=torch.int32, device=device)
    spec = graphsafe.get_op("cp_gather_indexer_k_quant_cache")
    for backend in spec.available_backends(device):
        dst_k = torch.full((BS + 1, D), 0x55, dtype=U8, device=device).view(FP8)
        dst_s = torch.full((BS + 1,), -1.5, device=device)
        C.run_backend(spec, backend, (cache, dst_k, dst_s, table, torch.tensor([0, BS], dtype=torch.int32,
                                                                               device=device)))
        assert torch.equal(dst_k.view(U8)[:BS].cpu(), want_values), f"gather[{backend}]: values"
        assert dst_s[:BS].cpu().view(torch.int32).tolist() == want_scales.tolist(), f"gather[{backend}]: scales"
        assert int(dst_k.view(U8)[BS, 0]) == 0x55 and float(dst_s[BS]) == -1.5, f"gather[{backend}]: row past the end"
    q, weights = _k_query(device)
    want = torch.tensor(K_LOGITS[fmt] + [-INF] * 4)
    spec = graphsafe.get_op("fp8_paged_mqa_logits")
    lens = torch.tensor([BS], dtype=torch.int32, device=device)
    for backend in spec.available_backends(device):
        out = C.run_backend(spec, backend, (q[None, None], cache, weights, lens, table, 2 * BS))
        torch.testing.assert_close(out.cpu()[0], want, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"fp8_paged_mqa_logits[{backend}]: {m}")
    spec = graphsafe.get_op("fp8_mqa_logits")
    k = want_values.view(FP8).to(device)
    k_scale = want_scales.view(FP32).to(device)
    ks, ke = torch.zeros(1, dtype=torch.int32, device=device), torch.full((1,), BS, dtype=torch.int32, device=device)
    for backend in spec.available_backends(device):
        out = C.run_backend(spec, backend, (q[None], k, k_scale, weights, ks, ke))
        torch.testing.assert_close(out.cpu()[0], want[:BS], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"fp8_mqa_logits[{backend}]: {m}")


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
def test_aiter_fp8_mqa_logits_reads_the_literal_keys(aiter_standin, fmt):
    """aiter's fp8_mqa_logits (gfx950, the CPU stand-in) on the literal keys."""
    aiter_standin("gfx950")
    block = _k_block(fmt)
    q, weights = _k_query("cpu")
    k, k_scale = block[: BS * D].view(BS, D).view(FP8), block[BS * D:].view(FP32)
    args = (q[None], k, k_scale, weights, torch.zeros(1, dtype=torch.int32), torch.full((1,), BS, dtype=torch.int32))
    spec = graphsafe.get_op("fp8_mqa_logits")
    assert spec.support("aiter", *args), spec.support("aiter", *args).reason
    out = C.run_backend(spec, "aiter", args)
    torch.testing.assert_close(out[0], torch.tensor(K_LOGITS[fmt]), rtol=0, atol=0, equal_nan=True)
