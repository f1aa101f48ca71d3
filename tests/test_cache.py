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


# -- fp8_ds_mla caches (uint8 records, graphsafe.formats.fp8_ds_mla) ----------------------------
from graphsafe.formats import fp8_ds_mla as ds_mla  # noqa: E402
from graphsafe.ops.cache.cases import compare_mla  # noqa: E402

TILE = ds_mla.TILE
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ds_cache(nb: int, bs: int, record: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A strided uint8 cache view (gaps after each token and block) and its base tensor."""
    base = torch.randint(0, 256, (nb, bs + 1, record + 12), generator=torch.Generator().manual_seed(5)).to(torch.uint8)
    return base[:, :bs, :record], base


def _ds_args(kv_c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, nb: int, bs: int = 4):
    cache, base = _ds_cache(nb, bs, ds_mla.record_bytes(kv_c.shape[1], k_pe.shape[1]))
    return (kv_c, k_pe, cache, slots), base


def _random_tiles(t: int, r: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """randn tiles times 2^k, k drawn per tile over the dtype's range."""
    span = 12 if dtype == torch.float16 else 120
    k = torch.randint(-span, span + 1, (t, r // TILE, 1), generator=gen).float()
    return (torch.randn(t, r // TILE, TILE, generator=gen) * torch.pow(2.0, k)).reshape(t, r)


def _special_tiles(dtype: torch.dtype) -> torch.Tensor:
    """Tiles where the scale or the e4m3 rounding is delicate, one row each: values on and
    next to e4m3 rounding boundaries under a power-of-two scale (448 s as amax, so the
    quotients are the boundary values exactly), zeros, -0.0, NaN, +-inf, huge and tiny
    magnitudes (scales near and below float32's smallest normal, and 0)."""
    b = _boundary_values()
    b = b[torch.isfinite(b) & (b.abs() <= 448)]
    n = TILE - 1
    b = torch.cat([b, torch.zeros(-b.numel() % n)]).reshape(-1, n)
    scales = [1.0] if dtype == torch.float16 else [1.0, 2.0**-100, 2.0**100, 0.0371]
    rows = [torch.cat([torch.full((b.shape[0], 1), 448.0 * s), b * s], 1) for s in scales]
    base = torch.randn(TILE, generator=torch.Generator().manual_seed(9))
    nan, inf = float("nan"), float("inf")

    def put(values: dict) -> torch.Tensor:
        row = base.clone()
        for i, v in values.items():
            row[i] = v
        return row[None]

    rows += [torch.zeros(1, TILE), torch.full((1, TILE), -0.0), put({5: nan}), put({0: inf}), put({127: -inf}),
             put({3: inf, 4: -inf}), put({1: nan, 2: inf})]
    if dtype != torch.float16:
        d = 2.0**-149  # float32's smallest subnormal
        for amax in (3e38, 3.4028e38, 1e-30, 448 * 2.0**-126, 447 * 2.0**-126, 2.0**-126, 2.0**-133,
                     225 * d, 224 * d, d):
            rows.append(torch.cat([torch.tensor([[amax]]), (base[None, 1:] / 3).clamp(-1, 1) * amax], 1))
    return torch.cat(rows).to(dtype)


def _special_rope(t: int, p: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rope rows with bfloat16 rounding ties and their neighbours, overflow, subnormals, +-inf, NaN."""
    bf = torch.randn(t * p, generator=gen).to(torch.bfloat16).float()
    half_ulp = bf.abs() * 2.0**-9  # for values that are not powers of two, within a factor 2
    tie = bf + torch.where(torch.rand(t * p, generator=gen) < 0.5, half_ulp, -half_ulp)
    x = torch.where(torch.rand(t * p, generator=gen) < 0.5, tie, torch.randn(t * p, generator=gen) * 100)
    specials = torch.tensor([3.4e38, -3.4e38, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), -0.0,
                             1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20])
    x[: specials.numel()] = specials
    return x.reshape(t, p).to(dtype)


def _ds_run_both(args: tuple) -> tuple[tuple, tuple]:
    return _run("concat_and_cache_mla", "reference", args), _run("concat_and_cache_mla", "triton", args)


@pytest.mark.nonfinite
@pytest.mark.parametrize("dtype", DTYPES)
def test_ds_mla_reference_writes_quantize_records_per_token(dtype):
    """Each written slot holds `quantize_records` of its token alone; skipped tokens
    (-1, -2, num_slots, 10**6) and the gaps of the strided cache stay untouched."""
    gen = torch.Generator().manual_seed(11)
    t, r, p, nb, bs = 9, 2 * TILE, 16, 3, 4
    kv_c, k_pe = _random_tiles(t, r, dtype, gen).to(dtype), torch.randn(t, p, generator=gen).to(dtype)
    kv_c[1, 7], kv_c[6, 200] = float("nan"), float("inf")  # stays in its own token (and tile)
    slots = torch.tensor([5, -1, 11, -2, nb * bs, 0, 10**6, 7, 3])
    args, base = _ds_args(kv_c, k_pe, slots, nb, bs)
    before = base.clone()
    run_backend(graphsafe.get_op("concat_and_cache_mla"), "reference", args)  # in place: into base
    cache = args[2]
    written = torch.zeros_like(base, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < nb * bs:
            want = ds_mla.quantize_records(kv_c[i : i + 1], k_pe[i : i + 1])[0]
            assert torch.equal(cache[s // bs, s % bs], want), f"slot {s}: not token {i}'s record"
            written[s // bs, s % bs, : want.numel()] = True
    assert torch.equal(base[~written], before[~written]), "bytes outside the written records changed"


@pytest.mark.nonfinite
@pytest.mark.parametrize("p", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ds_mla_triton_bytes_equal_reference(dtype, p):
    """The Triton records equal the reference's byte for byte (a NaN rope value of an
    fp16/fp32 input: NaN at the same place, bits free, see the op's docstring)."""
    gen = torch.Generator().manual_seed(12)
    special = _special_tiles(dtype)
    kv_c = torch.cat([special, _random_tiles(special.shape[0], TILE, dtype, gen).to(dtype)], 1)
    t = kv_c.shape[0]
    k_pe = _special_rope(t, p, dtype, gen)
    nb, bs = -(-t // 4) + 1, 4
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    args, _ = _ds_args(kv_c, k_pe, slots, nb, bs)
    ref, tri = _ds_run_both(args)
    compare_mla(None, None, ref, tri, {"ds_mla_cache": True, "dtype": dtype, "P": p})
    # The rope of bf16 inputs is copied, NaN bits included.
    if dtype == torch.bfloat16:
        assert_bits_equal(ref[2], tri[2], "fp8_ds_mla records from bf16")


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend", BACKENDS)
def test_ds_mla_slots_outside_the_cache_write_nothing(backend):
    """-1, -2, -5, num_slots, 10**6: nothing written (no wrap-around), nothing read (the
    skipped rows are NaN); the valid tokens' records are written."""
    nb, bs, p = 2, 4, 16
    slots = torch.tensor([3, -2, nb * bs, 10**6, -1, 7, -5])
    gen = torch.Generator().manual_seed(4)
    kv_c, k_pe = torch.randn(7, TILE, generator=gen), torch.randn(7, p, generator=gen)
    skipped = torch.tensor([s < 0 or s >= nb * bs for s in slots.tolist()])
    kv_c[skipped], k_pe[skipped] = float("nan"), float("nan")
    args, _ = _ds_args(kv_c, k_pe, slots, nb, bs)
    out = _run("concat_and_cache_mla", backend, args)[2]
    want = args[2].clone()
    want[0, 3], want[1, 3] = ds_mla.quantize_records(kv_c[[0, 5]], k_pe[[0, 5]])
    assert torch.equal(out, want), backend


def _ds_error(args: tuple) -> str:
    with pytest.raises(graphsafe.InputError) as err:
        graphsafe.concat_and_cache_mla(*args)
    return str(err.value)


def test_ds_mla_check_names_the_argument_the_expected_and_the_actual():
    t, nb, bs = 3, 2, 4
    kv_c, k_pe = torch.randn(t, TILE), torch.randn(t, 16)
    slots = torch.tensor([0, 1, 2])
    cache = torch.zeros(nb, bs, 164, dtype=torch.uint8)
    msg = _ds_error((kv_c, k_pe, cache[..., :160], slots))
    assert "'kv_cache'" in msg and "164" in msg and "[2, 4, 160]" in msg, msg
    msg = _ds_error((torch.randn(t, 192), k_pe, cache, slots))
    assert "'kv_c'" in msg and "multiple of 128" in msg and "R = 192" in msg, msg
    msg = _ds_error((kv_c, torch.randn(t, 15), cache, slots))
    assert "'k_pe'" in msg and "P even" in msg and "P = 15" in msg, msg
    msg = _ds_error((kv_c, k_pe, cache, slots, torch.ones(1)))
    assert "'scale'" in msg and "must be None" in msg and "float32 tensor of shape [1]" in msg, msg
    # The other kinds are unchanged: a bf16 cache of R + P entries is still accepted.
    graphsafe.concat_and_cache_mla(kv_c, k_pe, torch.zeros(nb, bs, TILE + 16), slots)


_DS_COMPILE_SCRIPT = r"""
import re
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); raise SystemExit(0)
from graphsafe.ops.cache.kernels import triton_ds_mla as ct

fn = ct._concat_and_cache_ds_mla_kernel
for dtype in ("bf16", "fp16", "fp32"):
    for r, p in ((512, 64), (128, 16)):
        ptrs = {"kv_c_ptr": "*" + dtype, "k_pe_ptr": "*" + dtype, "cache_ptr": "*u8", "slot_ptr": "*i64"}
        ints = lambda name: "i64" if name.startswith("stride") else "i32"  # noqa: E731
        sig = {q.name: "constexpr" if q.is_constexpr else ptrs.get(q.name, ints(q.name)) for q in fn.params}
        consts = dict(R=r, P=p, TILE=128, BLOCK_ROPE=triton.next_power_of_2(2 * p))
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        ptx = k.asm["ptx"]
        divs = set(re.findall(r"div\.[a-z0-9.]*f32", ptx))
        print(dtype, r, p, sorted(divs))
        # IEEE division, float32 subnormals kept (scales of tiny tiles): no .ftz anywhere.
        assert divs == {"div.rn.f32"} and ".ftz" not in ptx, divs
        assert ".local" not in ptx, "local memory (spills)"
print("OK")
"""


def test_ds_mla_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter never compiles: the fp8_ds_mla kernel for sm_90 (each input dtype,
    DeepSeek's and a small layout), with IEEE float32 division (div.rn, no flush to zero)."""
    compile_for_sm90(_DS_COMPILE_SCRIPT)
