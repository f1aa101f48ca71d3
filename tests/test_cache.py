"""The paged-cache writes (`concat_and_cache_mla`, `reshape_and_cache`): fp8 bytes bit for
bit against the reference, and slots outside the cache skipped on every backend.

The contract tests (tests/test_contract.py) compare random inputs; these tests aim at the
places fp32 -> e4m3fn rounding goes wrong: ties between two e4m3 values (round to even),
values just above and below a tie, carries into the next binade, subnormals, the
saturation at 448, +-inf, NaN of both signs and -0.0.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.testing.contract import assert_bits_equal, clone_args, run_backend

BACKENDS = ("reference", "triton")
FP8 = torch.float8_e4m3fn


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value (both signs), as float32."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(FP8).float()
    return values[torch.isfinite(values)]


def _boundary_values() -> torch.Tensor:
    """float32 values where rounding to e4m3fn is delicate (see the module docstring)."""
    pos = _e4m3_values()
    pos = pos[pos > 0].unique()  # sorted: 2^-9 ... 448
    mid = (pos[1:] + pos[:-1]) / 2  # ties: exact in float32
    ulp = lambda x, d: torch.nextafter(x, torch.full_like(x, d))  # noqa: E731
    special = torch.tensor([0.0, -0.0, 2.0**-10, 3 * 2.0**-11, 2.0**-11, 1e-30, 2.0**-7 * 0.99,
                            448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 511.0, 1e6, 3e38,
                            float("inf"), float("-inf"), float("nan")])
    x = torch.cat([pos, mid, ulp(mid, 0.0), ulp(mid, 1e9), ulp(pos, 0.0), ulp(pos, 1e9), special])
    x = torch.cat([x, -x])
    return x


def _run(name: str, backend: str, args: tuple) -> tuple:
    args = clone_args(args)
    run_backend(graphsafe.get_op(name), backend, args)
    return args


def _mla_args(values: torch.Tensor, scale: float, p: int = 8, block_size: int = 4):
    """Every value written once: rows of R + P entries (P from the same values)."""
    r = 32
    per_row = r + p
    t = -(-values.numel() // per_row)
    flat = torch.cat([values, torch.zeros(t * per_row - values.numel())]).reshape(t, per_row)
    kv_c, k_pe = flat[:, :r].contiguous(), flat[:, r:].contiguous()
    nb = -(-t // block_size) + 1
    cache = torch.full((nb, block_size, per_row), 0x55, dtype=torch.uint8).view(FP8)
    slots = torch.randperm(nb * block_size, generator=torch.Generator().manual_seed(0))[:t]
    return kv_c, k_pe, cache, slots, torch.tensor([scale])


def _kv_args(values: torch.Tensor, scale: float, hk: int = 2, d: int = 16, block_size: int = 4):
    per_row = hk * d
    t = -(-values.numel() // per_row)
    flat = torch.cat([values, torch.zeros(t * per_row - values.numel())]).reshape(t, hk, d)
    nb = -(-t // block_size) + 1
    k_cache = torch.full((nb, block_size, hk, d), 0x55, dtype=torch.uint8).view(FP8)
    v_cache = torch.full((nb, block_size, hk, d), 0x33, dtype=torch.uint8).view(FP8)
    slots = torch.randperm(nb * block_size, generator=torch.Generator().manual_seed(1))[:t]
    # Values and keys differ (reversed), and so do their scales.
    return flat, flat.flip(0).contiguous(), k_cache, v_cache, slots, torch.tensor([scale]), torch.tensor([scale * 2])


def _assert_reference_is_torch_cast(cache: torch.Tensor, expect: torch.Tensor, slots: torch.Tensor) -> None:
    """The reference itself: bytes of `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`."""
    flat = cache.view(torch.uint8).reshape(-1, *cache.shape[2:])
    got = flat[slots.long()]
    assert torch.equal(got, expect.view(torch.uint8)), "reference bytes differ from torch's cast"


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0371])
def test_fp8_mla_cache_bytes_are_exact(scale):
    values = _boundary_values() * scale  # x / scale lands on the boundaries (exactly for 1 and 0.5)
    args = _mla_args(values, scale)
    ref = _run("concat_and_cache_mla", "reference", args)
    tri = _run("concat_and_cache_mla", "triton", args)
    kv_c, k_pe, _, slots, _ = args
    expect = (torch.cat([kv_c, k_pe], 1) / scale).clamp(-448, 448).to(FP8)
    _assert_reference_is_torch_cast(ref[2], expect, slots)
    assert_bits_equal(ref[2].view(torch.uint8), tri[2].view(torch.uint8), "concat_and_cache_mla fp8 cache bytes")


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0713])
def test_fp8_kv_cache_bytes_are_exact(scale):
    values = _boundary_values() * scale
    args = _kv_args(values, scale)
    ref = _run("reshape_and_cache", "reference", args)
    tri = _run("reshape_and_cache", "triton", args)
    key, value, _, _, slots, k_scale, v_scale = args
    _assert_reference_is_torch_cast(ref[2], (key / k_scale).clamp(-448, 448).to(FP8), slots)
    _assert_reference_is_torch_cast(ref[3], (value / v_scale).clamp(-448, 448).to(FP8), slots)
    assert_bits_equal(ref[2].view(torch.uint8), tri[2].view(torch.uint8), "reshape_and_cache fp8 key_cache bytes")
    assert_bits_equal(ref[3].view(torch.uint8), tri[3].view(torch.uint8), "reshape_and_cache fp8 value_cache bytes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_bytes_are_exact_from_half_inputs(dtype):
    """Random bf16/fp16 inputs and a random scale: every quotient rounded as torch rounds it."""
    gen = torch.Generator().manual_seed(7)
    values = (torch.randn(4000, generator=gen) * torch.rand(4000, generator=gen) * 30).to(dtype).float()
    for op, make in (("concat_and_cache_mla", _mla_args), ("reshape_and_cache", _kv_args)):
        args = list(make(values, 0.0419))
        args[0], args[1] = args[0].to(dtype), args[1].to(dtype)
        ref, tri = _run(op, "reference", tuple(args)), _run(op, "triton", tuple(args))
        for i in (2, 3) if op == "reshape_and_cache" else (2,):
            assert_bits_equal(ref[i].view(torch.uint8), tri[i].view(torch.uint8), f"{op} fp8 cache {i} ({dtype})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_slots_outside_the_cache_write_nothing(backend, fp8):
    """Slots -1, -2, -5, num_slots and 10**6 are skipped: no write, no wrap-around (slot -2
    must not write the second-last slot), the valid tokens are written."""
    nb, bs, hk, d = 3, 4, 2, 8
    num_slots = nb * bs
    slots = torch.tensor([5, -1, -2, num_slots, 10**6, -5, 0, num_slots - 1])
    t = slots.numel()
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(t, hk, d, generator=gen), torch.randn(t, hk, d, generator=gen)
    dtype = FP8 if fp8 else torch.float32
    caches = [torch.full((nb, bs, hk, d), 0x11, dtype=torch.uint8).view(dtype) if fp8
              else torch.full((nb, bs, hk, d), 7.0) for _ in range(2)]
    scales = (torch.tensor([0.01]), torch.tensor([0.02])) if fp8 else (None, None)
    out = _run("reshape_and_cache", backend, (key, value, *caches, slots, *scales))
    for cache, src, scale in ((out[2], key, scales[0]), (out[3], value, scales[1])):
        flat = cache.view(torch.uint8 if fp8 else dtype).reshape(num_slots, hk, d)
        written = torch.zeros(num_slots, dtype=torch.bool)
        for i, s in enumerate(slots.tolist()):
            if 0 <= s < num_slots:
                written[s] = True
                want = (src[i] / scale).clamp(-448, 448).to(FP8).view(torch.uint8) if fp8 else src[i]
                assert torch.equal(flat[s], want), f"slot {s}: token {i} not written"
        untouched = torch.full((1,), 0x11, dtype=torch.uint8) if fp8 else torch.tensor([7.0])
        assert (flat[~written] == untouched).all(), "a slot outside the cache wrote into it"


def test_mla_slots_outside_the_cache_write_nothing():
    nb, bs, r, p = 2, 4, 8, 4
    slots = torch.tensor([3, -2, nb * bs, 10**6, -1, 7])
    gen = torch.Generator().manual_seed(4)
    kv_c, k_pe = torch.randn(6, r, generator=gen), torch.randn(6, p, generator=gen)
    cache = torch.full((nb, bs, r + p), 9.0)
    outs = [_run("concat_and_cache_mla", b, (kv_c, k_pe, cache, slots))[2] for b in BACKENDS]
    want = cache.clone().reshape(nb * bs, r + p)
    want[3], want[7] = torch.cat([kv_c[0], k_pe[0]]), torch.cat([kv_c[5], k_pe[5]])
    for backend, out in zip(BACKENDS, outs):
        assert torch.equal(out.reshape(nb * bs, r + p), want), backend
