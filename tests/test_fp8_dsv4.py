"""The DeepSeek-V4 FP8 cache format (graphsafe.formats.fp8_dsv4): known answers computed by
hand, the block layout byte by byte, and a second reader written from FlashMLA's
`tests/quant.py` (MODEL1) slicing."""

from __future__ import annotations

import pytest
import torch

from graphsafe.formats import fp8_dsv4 as f

NAN = float("nan")
INF = float("inf")


def test_sizes():
    assert (f.NOPE_DIM, f.ROPE_DIM, f.TILE, f.NUM_TILES) == (448, 64, 64, 7)
    assert f.DATA_BYTES == 576 and f.TOKEN_BYTES == 584 and f.SCALE_BYTES == 8
    # vLLM: block_size 64 -> 64 * 576 data + 64 * 8 scales = 37376 bytes, padded to 65 * 576.
    assert f.block_bytes(64) == 37376 and f.padded_block_bytes(64) == 37440
    assert f.block_bytes(4) == 2336 and f.padded_block_bytes(4) == 2880
    assert f.padded_block_bytes(72) == 72 * 584  # 42048 = 73 * 576 already
    cache = f.empty_cache(3, 4)
    assert cache.shape == (3, 4, 584) and cache.stride() == (2880, 584, 1) and f.is_fp8_dsv4_cache(cache)
    assert f.is_fp8_dsv4_cache(torch.empty(3, 4, 584, dtype=torch.uint8))  # unpadded blocks
    assert not f.is_fp8_dsv4_cache(torch.empty(3, 4, 585, dtype=torch.uint8)[..., :584])  # rows 585 apart


def _row(tiles: dict[int, list[float]], rope: list[float]) -> torch.Tensor:
    x = torch.zeros(512)
    for j, values in tiles.items():
        x[64 * j : 64 * j + len(values)] = torch.tensor(values)
    x[448 : 448 + len(rope)] = torch.tensor(rope)
    return x


# Hand-computed: tile j's scale byte, and (value -> e4m3 byte, value read back) for its first entries.
KNOWN = {
    # amax 448: 448 / 448 = 1 = 2^0 -> byte 127; values as they are. 448 -> 0x7E (1.75 * 2^8),
    # 2^-9 -> the smallest subnormal 0x01, 2^-10 -> half way to it, ties to even -> 0x00,
    # 3 * 2^-10 -> 1.5 units, ties to even -> 2 units 0x02, 1 -> 0x38, -2 -> 0xC0.
    0: (127, [(448.0, 0x7E, 448.0), (-448.0, 0xFE, -448.0), (2**-9, 0x01, 2**-9), (2**-10, 0x00, 0.0),
              (3 * 2**-10, 0x02, 2**-8), (1.0, 0x38, 1.0), (-2.0, 0xC0, -2.0)]),
    # all zero: amax floored at 1e-4; log2(1e-4 / 448) = -22.09 -> e = -22 -> byte 105.
    1: (105, [(0.0, 0x00, 0.0)]),
    # amax 1: log2(1 / 448) = -8.81 -> e = -8 -> byte 119; 1 * 2^8 = 256 -> 0x78, 0.5 -> 128 -> 0x70.
    3: (119, [(1.0, 0x78, 1.0), (0.5, 0x70, 0.5)]),
    # amax 56 = 448 / 8: exactly 2^-3 -> e = -3 -> byte 124 (not one binade up); 56 * 8 = 448.
    4: (124, [(56.0, 0x7E, 56.0), (1.0, 0x50, 1.0)]),
    # amax 56.25, just above: e = -2 -> byte 125; 56.25 * 4 = 225 -> 224 (0x76) -> 56;
    # -0.001 is bf16 -0.00099945 -> * 4 = -3.998e-3 = -2.05 units of 2^-9 -> -2 units 0x82 -> -2^-10.
    5: (125, [(56.25, 0x76, 56.0), (-0.001, 0x82, -(2**-10))]),
}


def test_known_answer_token():
    tiles = {j: [v for v, _, _ in entries] for j, (_, entries) in KNOWN.items()}
    tiles[2] = [1.0, NAN, 3.0]  # a NaN tile: scale byte 255, every value byte 0x7F
    tiles[6] = [INF, 1.0]  # an inf tile: the same
    row = _row(tiles, rope=[1.0, -2.0, 0.5, 3.140625])
    data, scales = f.quantize_tokens(row[None])
    data, scales = data[0].tolist(), scales[0].tolist()
    assert scales == [127, 105, 255, 119, 124, 125, 255, 0]  # the 8th byte is the pad
    for j, (_, entries) in KNOWN.items():
        for i, (_, byte, _) in enumerate(entries):
            assert data[64 * j + i] == byte, (j, i)
        assert all(b in (0x00, 0x80) for b in data[64 * j + len(entries) : 64 * (j + 1)])
    assert data[128:192] == [0x7F] * 64 and data[384:448] == [0x7F] * 64
    # RoPE: bf16 little-endian: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00, 3.140625 = 0x4049.
    assert data[448:456] == [0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x49, 0x40]
    assert data[456:576] == [0] * 120

    back = f.dequantize_tokens(torch.tensor(data, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8))
    for j, (_, entries) in KNOWN.items():
        for i, (_, _, value) in enumerate(entries):
            assert back[64 * j + i].item() == value, (j, i)
    assert back[128:192].isnan().all() and back[384:448].isnan().all()
    assert back[448:452].tolist() == [1.0, -2.0, 0.5, 3.140625]


def test_e4m3_and_ue8m0_limits():
    big = torch.tensor(3.3895313892515355e38)  # bf16's largest finite value, 0x7F7F = 1.9921875 * 2^127
    assert big.to(torch.bfloat16).view(torch.int16).item() == 0x7F7F
    tiny = 2.0**-20  # below the 1e-4 floor: the scale is the floor's, 2^-22
    row = _row({0: [big.item(), 2.0**126, 1e30], 1: [tiny, 2.0**-32, 3 * 2.0**-32]}, rope=[])
    data, scales = f.quantize_tokens(row[None])
    # bf16 max / 448 = 1.138 * 2^119 -> e = 120 -> byte 247; 0x7F7F * 2^-120 = 255 -> e4m3 256 (0x78):
    # read back 256 * 2^120 = 2^128, beyond float32: +inf.
    assert scales[0, :2].tolist() == [247, 105]
    assert data[0, 0].item() == 0x78
    back = f.dequantize_tokens(data, scales)[0]
    assert back[0].item() == INF
    # 2^126 * 2^-120 = 64 = 2^6 -> 0x68, read back exactly; 1e30 (about 2^99.7) * 2^-120 is far
    # below e4m3's smallest subnormal 2^-9: 0x00.
    assert data[0, 1:3].tolist() == [0x68, 0x00] and back[1].item() == 2.0**126 and back[2].item() == 0.0
    # 2^-20 * 2^22 = 4 -> 0x48; 2^-32 * 2^22 = 2^-10: a tie, to even 0 -> 0x00; 3 * 2^-10 -> 2 units 0x02.
    assert data[0, 64:67].tolist() == [0x48, 0x00, 0x02]
    assert back[64:67].tolist() == [tiny, 0.0, 2.0**-30]  # 2 * 2^-9 * 2^-22
    # Scale bytes read as float8_e8m0fnu: 0 is 2^-127, 254 is 2^127, 255 is NaN.
    one = torch.full((1, 576), 0x38, dtype=torch.uint8)  # every NoPE value 1.0, RoPE 0x3838
    for byte, value in ((0, 2.0**-127), (1, 2.0**-126), (127, 1.0), (254, 2.0**127)):
        s = torch.full((1, 8), byte, dtype=torch.uint8)
        assert f.dequantize_tokens(one, s)[0, :448].eq(value).all(), byte
    assert f.dequantize_tokens(one, torch.full((1, 8), 255, dtype=torch.uint8))[0, :448].isnan().all()
    assert f.dequantize_tokens(one, torch.full((1, 8), 255, dtype=torch.uint8))[0, 448:].isfinite().all()


def test_zero_tile_and_signed_zero():
    row = torch.zeros(512)
    row[1] = -0.0
    data, scales = f.quantize_tokens(row[None])
    assert scales[0].tolist() == [105] * 7 + [0]
    assert data[0, 0].item() == 0x00 and data[0, 1].item() == 0x80  # the sign of -0.0 is kept
    assert data[0, 2:448].eq(0).all() and data[0, 448:].eq(0).all()


def test_nan_rope_value_is_stored_as_is():
    row = torch.zeros(512)
    row[450] = NAN
    data, scales = f.quantize_tokens(row[None])
    assert scales[0, :7].eq(105).all()  # the NoPE tiles are not affected
    assert f.dequantize_tokens(data, scales)[0, 450].isnan()
    assert f.dequantize_tokens(data, scales)[0, :450].eq(0).all()


def test_block_layout_byte_by_byte():
    bs, nb = 4, 3
    cache = f.empty_cache(nb, bs)
    storage = torch.as_strided(cache, (nb * f.padded_block_bytes(bs),), (1,))
    storage.fill_(0xAB)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn((6, 512), generator=gen) * 3
    # block 1 token 1, padding, block 2 token 3, one past the end, block 0 token 0, negative:
    f.write_tokens(cache, rows, torch.tensor([5, -1, 11, nb * bs, 0, -7]))
    rows, slots = rows[[0, 2, 4]], torch.tensor([5, 11, 0])
    data, scales = f.quantize_tokens(rows)
    block = f.padded_block_bytes(bs)
    written = torch.zeros(nb * block, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, bs)
        d, sc, pad = f.token_byte_offsets(bs, t)
        assert (d.start, sc.start, pad) == (576 * t, 576 * 4 + 8 * t, 576 * 4 + 8 * t + 7)
        assert torch.equal(storage[b * block + d.start : b * block + d.stop], data[i])
        assert torch.equal(storage[b * block + sc.start : b * block + sc.stop], scales[i, :7])
        assert storage[b * block + pad].item() == 0
        written[b * block + d.start : b * block + d.stop] = True
        written[b * block + sc.start : b * block + pad + 1] = True
    assert storage[~written].eq(0xAB).all(), "bytes of other tokens and the block padding are never written"
    # Reading back through the cache view equals dequantising the token bytes.
    assert torch.equal(f.read_tokens(cache, slots), f.dequantize_tokens(data, scales))
    # Invalid slots read as zero rows, whatever the cache holds.
    out = f.read_tokens(cache, torch.tensor([-1, nb * bs, 10**9]))
    assert out.eq(0).all()


def _flashmla_model1_dequantize(quant_k_cache: torch.Tensor) -> torch.Tensor:
    """FlashMLA `tests/quant.py::dequantize_k_cache` for MODEL1_FP8Sparse, slicing as it does
    (its bf16 arithmetic; exact for the scales used here)."""
    d, d_nope, d_rope, tile_size, num_tiles = 512, 448, 64, 64, 7
    num_blocks, block_size = quant_k_cache.shape[:2]
    flat = torch.as_strided(quant_k_cache, (num_blocks, block_size * 584), (quant_k_cache.stride(0), 1))
    result = torch.empty((num_blocks, block_size, d), dtype=torch.bfloat16)
    input_nope_rope = flat[:, : block_size * (d_nope + 2 * d_rope)].reshape(num_blocks, block_size, d_nope + 2 * d_rope)
    input_nope = input_nope_rope[:, :, :d_nope].contiguous().view(torch.float8_e4m3fn)
    input_rope = input_nope_rope[:, :, d_nope:].contiguous().view(torch.bfloat16)
    input_scale = flat[:, block_size * (d_nope + 2 * d_rope) :].reshape(num_blocks, block_size, 8)[:, :, :7]
    input_scale = input_scale.contiguous().view(torch.float8_e8m0fnu)
    result[..., d_nope:] = input_rope
    for tile_idx in range(num_tiles):
        cur_nope = input_nope[..., tile_idx * tile_size : (tile_idx + 1) * tile_size].to(torch.bfloat16)
        cur_scales = input_scale[:, :, tile_idx].to(torch.bfloat16).unsqueeze(-1)
        result[..., tile_idx * tile_size : (tile_idx + 1) * tile_size] = cur_nope * cur_scales
    return result


@pytest.mark.parametrize("bs", [1, 4, 64])
def test_a_second_reader_from_flashmla_slicing_agrees(bs):
    nb = 3
    gen = torch.Generator().manual_seed(bs)
    rows = torch.randn((nb * bs, 512), generator=gen) * (10.0 ** torch.randint(-3, 4, (nb * bs, 1), generator=gen))
    cache = f.empty_cache(nb, bs)
    f.write_tokens(cache, rows, torch.arange(nb * bs))
    theirs = _flashmla_model1_dequantize(cache).float().reshape(nb * bs, 512)
    ours = f.read_tokens(cache, torch.arange(nb * bs))
    assert torch.equal(ours, theirs)


def test_round_trip_error_is_e4m3_rounding():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn((64, 512), generator=gen) * (2.0 ** torch.randint(-12, 12, (64, 8), generator=gen)).repeat_interleave(64, 1)
    x = rows.to(torch.bfloat16).float()
    data, scales = f.quantize_tokens(rows)
    y = f.dequantize_tokens(data, scales)
    scale = 2.0 ** (scales[:, :7].float() - 127).repeat_interleave(64, 1)
    # normal e4m3: half an ulp is 2^-4 relative; subnormal: half of 2^-9 times the scale.
    bound = torch.maximum(x[:, :448].abs() * 2.0**-4, scale * 2.0**-10)
    assert ((y[:, :448] - x[:, :448]).abs() <= bound).all()
    assert torch.equal(y[:, 448:], x[:, 448:])
    # The largest value of a tile lands in (224, 448] before rounding (power-of-two scale).
    tile_max = (x[:, :448].abs() / scale).unflatten(1, (7, 64)).amax(-1)
    assert ((tile_max > 224) & (tile_max <= 448)).all()
