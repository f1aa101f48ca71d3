"""The sparse-indexer family: semantics the issue lists, checked against loop-by-loop
oracles written straight from the byte layout (independent of layout.py), and the
Triton kernels (through the CPU interpreter) against the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.testing import case_for
import graphsafe
from graphsafe.errors import InputError
from graphsafe.formats import indexer_k as layout
from graphsafe.ops.indexer import plan
from graphsafe.ops.indexer import reference as ref
from graphsafe.ops.indexer import triton as tri
from graphsafe.kernels.fp8_bits import e4m3_bits, e4m3_bytes_to_f16, round_to_e4m3
from graphsafe.ops.indexer import cases as cases
from graphsafe.testing.contract import clone_args, run_backend

FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")


def _spec(name):
    return graphsafe.get_op(name)


def _inputs(name, params, seed=0):
    return case_for(name).inputs(params, "cpu", seed)


# -- oracles: loops over tokens, byte offsets spelled out ------------------------------
def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def oracle_quant_and_cache(k, cache, slots, qbs, fmt):
    cache = cache.clone()
    nb, bs, width = cache.shape
    d = k.shape[1]
    g = d // qbs
    for t in range(k.shape[0]):
        slot = int(slots[t])
        if slot < 0 or slot >= nb * bs:
            continue
        blk, j = divmod(slot, bs)
        block = cache[blk].reshape(-1)  # the block's bytes
        for gi in range(g):
            x = k[t, gi * qbs : (gi + 1) * qbs].float()
            s = torch.maximum(x.abs().max(), _f32(1e-4)) / _f32(448.0)
            if fmt == "ue8m0":
                mant, exp = math.frexp(float(s))
                s = _f32(2.0 ** (exp - 1) if mant == 0.5 else 2.0**exp)
            q = (x / s).clamp(-448, 448).to(FP8)
            block[j * d + gi * qbs : j * d + (gi + 1) * qbs] = q.view(torch.uint8)
            at = bs * d + 4 * (j * g + gi)
            block[at : at + 4] = s.reshape(1).view(torch.uint8)
    return cache


def _token(cache, d, slot):
    """(fp8 values as float64 [D], scales float64 [G]) of one cache slot, from the bytes."""
    nb, bs, width = cache.shape
    g = (width - d) // 4
    blk, j = divmod(slot, bs)
    block = cache[blk].reshape(-1)
    vals = block[j * d : (j + 1) * d].view(FP8).double()
    scales = block[bs * d + 4 * j * g : bs * d + 4 * (j + 1) * g].view(torch.float32).double()
    return vals, scales


def oracle_gather(cache, dst_k, dst_scale, table, cu):
    dst_k, dst_scale = dst_k.clone(), dst_scale.clone()
    bs = cache.shape[1]
    d = dst_k.shape[1]
    for b in range(table.shape[0]):
        for t in range(int(cu[b + 1] - cu[b])):
            row = int(cu[b]) + t
            blk = int(table[b, t // bs])
            vals, scales = _token(cache, d, blk * bs + t % bs)
            dst_k[row] = vals.to(FP8)
            dst_scale.view(dst_k.shape[0], -1)[row] = scales.float()
    return dst_k, dst_scale


def oracle_mqa(q, k, k_scale, w, ks, ke):
    m, n = q.shape[0], k.shape[0]
    out = torch.full((m, n), NEG_INF, dtype=torch.float64)
    kf = k.double()
    for i in range(m):
        row = (torch.relu(q[i].double() @ kf.T) * w[i].double()[:, None]).sum(0) * k_scale.double()
        for j in range(max(int(ks[i]), 0), min(int(ke[i]), n)):
            out[i, j] = row[j]
    return out


def oracle_paged(q, cache, w, lens, table, length):
    b, next_n, h, d = q.shape
    bs = cache.shape[1]
    out = torch.full((b * next_n, length), NEG_INF, dtype=torch.float64)
    for r in range(b):
        for i in range(next_n):
            row = r * next_n + i
            for n in range(min(int(lens[r]) - next_n + i + 1, length)):
                vals, scale = _token(cache, d, int(table[r, n // bs]) * bs + n % bs)
                s = torch.relu(q[r, i].double() @ vals)
                out[row, n] = float((s * w[row].double()).sum() * scale[0])
    return out


def oracle_slots(req, table, idx, bs):
    out = torch.full(idx.shape, -1, dtype=torch.int32)
    b, mb = table.shape
    for t in range(idx.shape[0]):
        r = int(req[t])
        for j in range(idx.shape[1]):
            p = int(idx[t, j])
            if p >= 0 and p // bs < mb and 0 <= r < b:
                out[t, j] = int(table[r, p // bs]) * bs + p % bs
    return out


def close_logits(expected, actual, tol=1e-5):
    cases.compare_logits(expected.float(), actual)
    fin = expected != NEG_INF
    if fin.any():
        scale = expected.abs().max().clamp_min(1e-6)
        assert ((actual.double() - expected)[fin].abs().max() / scale) <= tol


# -- the reference against the oracles (hypothesis over the cases' strategies) ---------
@settings(max_examples=15)
@given(p=cases._params_quant(), seed=st.integers(0, 2**31 - 1))
def test_reference_quant_and_cache_is_the_byte_layout(p, seed):
    k, cache, slots, qbs, fmt = _inputs("indexer_k_quant_and_cache", p, seed)
    expected = oracle_quant_and_cache(k, cache, slots, qbs, fmt)
    ref.indexer_k_quant_and_cache(k, cache, slots, qbs, fmt)
    assert torch.equal(cache, expected)


@settings(max_examples=15)
@given(p=cases._params_gather(), seed=st.integers(0, 2**31 - 1))
def test_reference_gather_is_the_byte_layout(p, seed):
    cache, dst_k, dst_scale, table, cu = _inputs("cp_gather_indexer_k_quant_cache", p, seed)
    exp_k, exp_s = oracle_gather(cache, dst_k, dst_scale, table, cu)
    ref.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, cu)
    assert torch.equal(dst_k.view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(dst_scale.view(torch.int32), exp_s.view(torch.int32))  # poison rows untouched, bit for bit


@settings(max_examples=10)
@given(p=cases._params_mqa(), seed=st.integers(0, 2**31 - 1))
def test_reference_mqa_logits(p, seed):
    args = _inputs("fp8_mqa_logits", p, seed)
    close_logits(oracle_mqa(*args), ref.fp8_mqa_logits(*args))


@settings(max_examples=10)
@given(p=cases._params_paged(), seed=st.integers(0, 2**31 - 1))
def test_reference_paged_logits(p, seed):
    args = _inputs("fp8_paged_mqa_logits", p, seed)
    close_logits(oracle_paged(*args), ref.fp8_paged_mqa_logits(*args))


@settings(max_examples=15)
@given(p=cases._params_slots(), seed=st.integers(0, 2**31 - 1))
def test_reference_slots(p, seed):
    args = _inputs("req_local_to_global_slots", p, seed)
    assert torch.equal(ref.req_local_to_global_slots(*args), oracle_slots(*args))


# -- quantisation semantics ---------------------------------------------------------------
def _quant_params(**kw):
    return {**cases.EXAMPLE_QUANT, **kw}


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_quant_is_bit_exact(fmt, groups, dtype):
    """The case's comparison allows one e4m3 step (for aiter); our kernel matches exactly."""
    p = _quant_params(T=12, D=64, groups=groups, block_size=4, dtype=dtype, scale_fmt=fmt, strided_cache=True)
    args = _inputs("indexer_k_quant_and_cache", p, seed=3)
    a, b = clone_args(args), clone_args(args)
    run_backend(_spec("indexer_k_quant_and_cache"), "reference", a)
    run_backend(_spec("indexer_k_quant_and_cache"), "triton", b)
    assert torch.equal(a[1], b[1])


def test_e4m3_rounding_and_bytes_match_torch():
    """Every float32 near every e4m3 value (ties, binade carries, subnormals) rounds as
    torch does, and the integer-only encode/decode give torch's bytes and values."""
    grid = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)]
    ys = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid * (1 + 2**-10), grid * (1 - 2**-10), torch.tensor([31.8, 447.9, 2**-10, 3 * 2**-11])])
    ys = torch.cat([ys, -ys]).clamp(-448, 448).contiguous()
    out = torch.empty_like(ys)
    out_bytes = torch.empty(ys.shape, dtype=torch.uint8)
    decoded = torch.empty(ys.shape, dtype=torch.float16)

    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, o_ptr, b_ptr, d_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        r = round_to_e4m3(x)
        b = e4m3_bits(r)
        tl.store(o_ptr + offs, r, mask=offs < n)
        tl.store(b_ptr + offs, b, mask=offs < n)
        tl.store(d_ptr + offs, e4m3_bytes_to_f16(b), mask=offs < n)

    kernel[(1,)](ys, out, out_bytes, decoded, ys.numel(), BLOCK=triton.next_power_of_2(ys.numel()))
    want = ys.to(FP8)
    assert torch.equal(out.view(torch.int32), want.float().view(torch.int32))
    assert torch.equal(out_bytes, want.view(torch.uint8))
    assert torch.equal(decoded.view(torch.int16), want.half().view(torch.int16))


def test_amax_floor_and_zero_rows():
    k = torch.zeros(3, 32, dtype=torch.bfloat16)
    k[1, 5] = 1e-6  # amax below the floor
    k[2] = 1.0
    cache = torch.zeros(1, 4, 36, dtype=torch.uint8)
    for backend in ("reference", "triton"):
        c = cache.clone()
        run_backend(_spec("indexer_k_quant_and_cache"), backend, (k, c, torch.tensor([0, 1, 2]), 32, None))
        vals, scales = layout.unpack(c, 32)
        floor = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(448.0)
        assert scales[0, 0, 0] == floor and scales[0, 1, 0] == floor
        assert scales[0, 2, 0] == torch.tensor(1.0) / torch.tensor(448.0)
        assert torch.equal(vals[0, 0].float(), torch.zeros(32))
        assert torch.equal(vals[0, 2].float(), torch.full((32,), 448.0))


def test_ue8m0_scales_are_the_smallest_power_of_two():
    k = torch.randn(64, 128) * torch.logspace(-5, 3, 64)[:, None]
    k[0, 0] = 448.0 * 2.0**-3 * (1 + 2**-23)  # just above a power of two times 448
    cache = torch.zeros(64, 1, 132, dtype=torch.uint8)
    graphsafe.indexer_k_quant_and_cache(k, cache, torch.arange(64), 128, "ue8m0")
    _, s = layout.unpack(cache, 128)
    s = s.flatten()
    need = k.abs().amax(1).clamp_min(1e-4) / 448
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all(), "scales are powers of two"
    assert (s >= need).all() and (s / 2 < need).all(), "and the smallest that cover amax / 448"
    assert s[0] == 2.0**-2


def test_padding_and_out_of_range_slots_are_skipped():
    k = torch.randn(4, 16)
    cache = torch.randint(0, 255, (2, 2, 20), dtype=torch.uint8)
    before = cache.clone()
    for backend in ("reference", "triton"):
        c = before.clone()
        run_backend(_spec("indexer_k_quant_and_cache"), backend, (k, c, torch.tensor([-1, 3, 4, -7]), 16, None))
        vals, scales = layout.unpack(c, 16)
        vals0, scales0 = layout.unpack(before, 16)
        # Block 0 and token 0 of block 1 untouched (the [BS, W] dims are not tokens: compare tokens).
        assert torch.equal(c[0], before[0])
        assert torch.equal(vals[1, 0].view(torch.uint8), vals0[1, 0].view(torch.uint8))
        assert torch.equal(scales[1, 0].view(torch.int32), scales0[1, 0].view(torch.int32))
        q, s = layout.quantize(k[1:2], 16, None)
        assert torch.equal(vals[1, 1].view(torch.uint8), q[0].view(torch.uint8)) and scales[1, 1, 0] == s[0, 0]


def test_layout_round_trip_and_byte_positions():
    values = cases.fp8_randn((3 * 4, 32), "cpu", torch.Generator().manual_seed(0)).view(3, 4, 32)
    scales = torch.rand(3, 4, 2)
    cache = layout.pack(values, scales)
    assert cache.shape == (3, 4, 32 + 8)
    v, s = layout.unpack(cache, 32)
    assert torch.equal(v.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s, scales)
    block = cache[1].reshape(-1)
    assert torch.equal(block[2 * 32 : 3 * 32], values[1, 2].view(torch.uint8))  # token 2's values
    assert torch.equal(block[4 * 32 + 8 * 2 : 4 * 32 + 8 * 3].view(torch.float32), scales[1, 2])  # its scales


# -- gather semantics -----------------------------------------------------------------------
def test_gather_leaves_rows_past_the_requests_untouched():
    p = {**cases.EXAMPLE_GATHER, "row_offset": 3, "groups": 2}
    cache, dst_k, dst_scale, table, cu = _inputs("cp_gather_indexer_k_quant_cache", p, seed=5)
    cu = torch.tensor([3, 3, 10, 12], dtype=torch.int32)  # an empty request, rows 0-2 and 12+ untouched
    for backend in ("reference", "triton"):
        args = clone_args((cache, dst_k, dst_scale, table, cu))
        run_backend(_spec("cp_gather_indexer_k_quant_cache"), backend, args)
        exp_k, exp_s = oracle_gather(cache, dst_k, dst_scale, table, cu)
        assert torch.equal(args[1].view(torch.uint8), exp_k.view(torch.uint8))
        assert torch.equal(args[2].view(torch.int32), exp_s.view(torch.int32))
        assert torch.equal(args[1][12:].view(torch.uint8), dst_k[12:].view(torch.uint8))


# -- logits semantics -----------------------------------------------------------------------
def _nan_out(shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("dim", [64, 128])
def test_paged_logits_grid_of_shapes(next_n, block_size, heads, dim):
    """Issue grid: next_n 1/2, block_size 1/64, H 16/32/64, D 64/128; every output element
    written (NaN-poisoned output), against the reference, with many small chunks."""
    p = {"B": 2, "next_n": next_n, "H": heads, "D": dim, "block_size": block_size, "max_model_len": 70, "extra_cols": 1}
    args = _inputs("fp8_paged_mqa_logits", p, seed=next_n + heads + dim + block_size)
    q, cache, w, lens, table, length = args
    lens = torch.tensor([next_n, 70], dtype=torch.int32)  # a context of exactly next_n, a full one
    expected = ref.fp8_paged_mqa_logits(q, cache, w, lens, table, length)
    out = _nan_out(expected.shape)
    tri.paged_mqa_logits_into(out, q, cache, w, lens, table, length, config={"BLOCK_N": 16, "programs_per_sm": 4})
    cases.compare_logits(expected, out)
    # Row (b, i) has exactly max(0, ctx - next_n + i + 1) finite columns.
    finite = (out != NEG_INF).sum(1).view(2, next_n)
    for i in range(next_n):
        assert finite[0, i] == i + 1 and finite[1, i] == 70 - next_n + i + 1


def test_paged_logits_empty_and_short_contexts():
    p = {**cases.EXAMPLE_PAGED, "B": 3, "next_n": 2, "max_model_len": 20}
    q, cache, w, _, table, length = _inputs("fp8_paged_mqa_logits", p, seed=1)
    lens = torch.tensor([0, 1, 20], dtype=torch.int32)  # no key at all; shorter than next_n
    out = _nan_out((6, 20))
    tri.paged_mqa_logits_into(out, q, cache, w, lens, table, length)
    cases.compare_logits(ref.fp8_paged_mqa_logits(q, cache, w, lens, table, length), out)
    assert (out[:3] == NEG_INF).all() and (out[3] != NEG_INF).sum() == 1


def test_paged_logits_fp16_fallback_path():
    """Devices without e4m3fn matrix units upcast to fp16 (exact) and use fp16 dots."""
    args = _inputs("fp8_paged_mqa_logits", {**cases.EXAMPLE_PAGED, "H": 32, "D": 128}, seed=2)
    out = _nan_out((4, 30))
    tri.paged_mqa_logits_into(out, *args, fp8_dot=False)
    cases.compare_logits(ref.fp8_paged_mqa_logits(*args), out)


def test_paged_grid_covers_max_model_len():
    for batch in (1, 3, 128):
        for length in (1, 15, 16, 17, 4096, 32768, 163840):
            for min_tiles in (1, 2):
                chunk, chunks = plan.paged_grid(batch, length, 128, torch.device("cpu"), 16, min_tiles)
                assert chunk % 128 == 0 and chunk >= 128 * min_tiles
                assert chunks * chunk >= length > (chunks - 1) * chunk


@pytest.mark.parametrize("fp8_dot", [True, False])
def test_mqa_logits_tile_skipping_and_windows(fp8_dot):
    """Several 16x16 tiles: causal windows (upper tiles skipped), empty and reversed windows."""
    p = {"M": 40, "N": 50, "H": 16, "D": 64, "window": "causal"}
    q, k, k_scale, w, ks, ke = _inputs("fp8_mqa_logits", p, seed=4)
    ks[3], ke[3] = 10, 10  # empty window
    ks[4], ke[4] = 30, 5  # reversed window
    ks[5], ke[5] = -4, 80  # clipped to [0, N)
    out = _nan_out((40, 50))
    tri.mqa_logits_into(out, q, k, k_scale, w, ks, ke, fp8_dot=fp8_dot)
    close_logits(oracle_mqa(q, k, k_scale, w, ks, ke), out)
    assert (out[3] == NEG_INF).all() and (out[4] == NEG_INF).all() and (out[5] != NEG_INF).all()


def test_prefill_and_decode_paths_agree():
    """Quantise into the cache, gather a request, and its prefill logits equal its decode logits."""
    gen = torch.Generator().manual_seed(0)
    d, bs, ctx, next_n, h = 64, 4, 23, 2, 16
    k = torch.randn(ctx, d, generator=gen, dtype=torch.float32).bfloat16()
    table = torch.tensor([[5, 2, 7, 0, 3, 6]], dtype=torch.int32)
    slots = (table[0, torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs).long()
    cache = torch.zeros(8, bs, d + 4, dtype=torch.uint8)
    graphsafe.indexer_k_quant_and_cache(k, cache, slots, d, "ue8m0")
    dst_k, dst_s = torch.empty(ctx, d, dtype=FP8), torch.empty(ctx)
    graphsafe.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, table, torch.tensor([0, ctx], dtype=torch.int32))
    q = cases.fp8_randn((1, next_n, h, d), "cpu", gen)
    w = torch.randn(next_n, h, generator=gen)
    lens = torch.tensor([ctx], dtype=torch.int32)
    decode = graphsafe.fp8_paged_mqa_logits(q, cache, w, lens, table, 24)
    ke = torch.tensor([ctx - 1, ctx], dtype=torch.int32)
    prefill = graphsafe.fp8_mqa_logits(q[0], dst_k, dst_s, w, torch.zeros(2, dtype=torch.int32), ke)
    cases.compare_logits(decode[:, :ctx], prefill)
    assert (decode[:, ctx:] == NEG_INF).all()


# -- slots and errors -----------------------------------------------------------------------
def test_slots_minus_one_stays_minus_one():
    req = torch.tensor([0, 1, -1], dtype=torch.int32)
    table = torch.tensor([[4, 9], [7, 1]], dtype=torch.int32)
    idx = torch.tensor([[-1, 0, 5, 8], [3, 4, -1, 7], [0, 1, 2, 3]], dtype=torch.int32)
    want = torch.tensor([[-1, 16, 37, -1], [31, 4, -1, 7], [-1, -1, -1, -1]], dtype=torch.int32)
    for backend in ("reference", "triton"):
        assert torch.equal(run_backend(_spec("req_local_to_global_slots"), backend, (req, table, idx, 4)), want)


def test_block_table_too_short_is_an_error_from_fake_and_real():
    q, cache, w, lens, table, _ = _inputs("fp8_paged_mqa_logits", cases.EXAMPLE_PAGED)
    with pytest.raises(InputError, match="block_table.*wide enough"):
        graphsafe.fp8_paged_mqa_logits(q, cache, w, lens, table, table.shape[1] * cache.shape[1] + 1)
    compiled = torch.compile(graphsafe.fp8_paged_mqa_logits, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="wide enough"):
        compiled(q, cache, w, lens, table, table.shape[1] * cache.shape[1] + 1)


# -- sm_90 compilation (no GPU needed) -----------------------------------------------------
_COMPILE_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.indexer import plan
from graphsafe.ops.indexer.kernels import triton_k_cache, triton_mqa_logits, triton_paged_mqa_logits

PTRS = {
    "paged_mqa_logits_kernel": dict(q_ptr="*fp8e4nv", val_ptr="*fp8e4nv", scale_ptr="*fp32", w_ptr="*fp32",
                                     ctx_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32"),
    "mqa_logits_kernel": dict(q_ptr="*fp8e4nv", k_ptr="*fp8e4nv", k_scale_ptr="*fp32", w_ptr="*fp32",
                               ks_ptr="*i32", ke_ptr="*i32", out_ptr="*fp32"),
    "quant_and_cache_kernel": dict(k_ptr="*bf16", val_ptr="*u8", scale_ptr="*fp32", slot_ptr="*i64"),
    "gather_kernel": dict(val_ptr="*u8", scale_ptr="*fp32", dst_k_ptr="*u8", dst_s_ptr="*fp32", bt_ptr="*i32", cu_ptr="*i32"),
}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def build(fn, constexprs, ints, warps, stages):
    # As the launcher would: ints equal to 1 become constexprs, multiples of 16 carry
    # the divisibility hint (the values are those of a realistic shape).
    sig, consts, attrs = {}, dict(constexprs), {}
    ptrs = dict(PTRS[fn.__name__])
    if constexprs.get("FP8_DOT") is False:  # the launcher passes the fp8 tensors as bytes
        ptrs.update({k: "*u8" for k, v in ptrs.items() if v == "*fp8e4nv"})
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ptrs:
            sig[p.name] = ptrs[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints.get(p.name, 0) == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32"
            if ints.get(p.name, 0) % 16 == 0 and p.name in ints:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(k.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    return (int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1,
            len(re.findall(r"QGMMA|HGMMA", sass)), k.metadata.shared)


paged = plan.PAGED_CONFIG["cuda"]
mqa = plan.MQA_CONFIG["cuda"]


def paged_ints(next_n, h, bs):
    return dict(stride_qb=next_n * h * 128, stride_qn=h * 128, stride_qh=128, stride_wr=h, stride_wh=1,
                stride_blk=bs * 132, stride_blk_f32=bs * 33, scale_base=bs * 32, stride_bt=512, stride_out=32768,
                max_model_len=32768, chunk=3712)


cases = [
    ("paged n1 clean", triton_paged_mqa_logits.paged_mqa_logits_kernel, dict(H=64, D=128, BS=64, NEXT_N=1, BLOCK_H=64, BLOCK_D=128,
     BLOCK_N=paged["BLOCK_N"], FP8_DOT=True, ROW_ALIGN=16, CLEAN=True), paged_ints(1, 64, 64),
     paged["num_warps"], paged["num_stages"], True),
    ("paged n2", triton_paged_mqa_logits.paged_mqa_logits_kernel, dict(H=64, D=128, BS=64, NEXT_N=2, BLOCK_H=64, BLOCK_D=128,
     BLOCK_N=paged["BLOCK_N"], FP8_DOT=True, ROW_ALIGN=16, CLEAN=False), paged_ints(2, 64, 64),
     paged["num_warps"], paged["num_stages"], True),
    ("paged bs1 fp16", triton_paged_mqa_logits.paged_mqa_logits_kernel, dict(H=32, D=128, BS=1, NEXT_N=2, BLOCK_H=32, BLOCK_D=128,
     BLOCK_N=paged["BLOCK_N"], FP8_DOT=False, ROW_ALIGN=4, CLEAN=False), paged_ints(2, 32, 1),
     paged["num_warps"], paged["num_stages"], False),
    ("mqa", triton_mqa_logits.mqa_logits_kernel, dict(D=128, BLOCK_M=mqa["BLOCK_M"], BLOCK_N=mqa["BLOCK_N"], BLOCK_D=128, FP8_DOT=True,
     CLEAN=False), dict(M=8192, N=8192, H=64, stride_qm=8192, stride_qh=128, stride_kn=128, stride_ks=1, stride_wm=64,
     stride_wh=1, stride_out=8192), mqa["num_warps"], mqa["num_stages"], True),
    ("quant", triton_k_cache.quant_and_cache_kernel, dict(D=128, G=1, QB=128, BLOCK_T=32, BLOCK_Q=128, UE8M0=True),
     dict(stride_k=128, stride_blk=8448, stride_blk_f32=2112, scale_base=2048, block_size=64), 4, 1, False),
    ("gather", triton_k_cache.gather_kernel, dict(D=128, G=1, BLOCK_R=64, BLOCK_D=128, BLOCK_G=1, ROW_ALIGN=16),
     dict(stride_blk=8448, stride_blk_f32=2112, scale_base=2048, stride_bt=512, stride_dk=128, stride_ds=1, block_size=64),
     4, 1, False),
]
for name, fn, ce, ints, warps, stages, mma in cases:
    regs, local, mmas, smem = build(fn, ce, ints, warps, stages)
    print(name, "regs", regs, "local", local, "wgmma", mmas, "smem", smem)
    assert local == 0, f"{name}: {local} bytes of local memory (register spills)"
    assert not mma or mmas > 0, f"{name}: no wgmma in the SASS"
print("OK")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter never compiles: catch GPU-only errors and check the fp8 logits
    kernels use wgmma without spilling, by compiling the launch variants for sm_90."""
    compile_for_sm90(_COMPILE_SCRIPT)


# -- ids out of range, decreasing cu_seq_lens, non-finite keys (the "nothing silently wrong" issue)
BACKENDS = ("reference", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_logits_padding_and_bad_block_ids_score_minus_inf(backend):
    """A block id of -1, 10**6, -2 or num_blocks holds no keys: its positions are -inf in
    every row, the other positions unchanged; -2 never reads block num_blocks - 2."""
    q, cache, w, lens, table, length = _inputs("fp8_paged_mqa_logits", cases.EXAMPLE_PAGED)
    lens = torch.full_like(lens, length)
    nb, bs = cache.shape[:2]
    base = run_backend(_spec("fp8_paged_mqa_logits"), backend, (q, cache, w, lens, table, length))
    for bad in (-1, 10**6, -2, nb):
        t2 = table.clone()
        t2[0, 1] = bad
        out = run_backend(_spec("fp8_paged_mqa_logits"), backend, (q, cache, w, lens, t2, length))
        hole = torch.zeros(length, dtype=torch.bool)
        hole[bs:2 * bs] = True
        rows = q.shape[1]
        assert (out[:rows, hole] == NEG_INF).all(), bad
        assert torch.equal(out[:rows, ~hole], base[:rows, ~hole]) and torch.equal(out[rows:], base[rows:]), bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_padding_block_gives_zero_rows_and_negative_ids_never_wrap(backend):
    cache, dst_k, dst_scale, table, cu = _inputs("cp_gather_indexer_k_quant_cache", cases.EXAMPLE_GATHER)
    bs = cache.shape[1]
    cu = torch.tensor([0, 2 * bs, 2 * bs, 2 * bs + 1], dtype=torch.int32)
    for bad in (-1, -2, cache.shape[0], 10**6):
        t2 = table.clone()
        t2[0, 1] = bad
        k2, s2 = dst_k.clone(), dst_scale.clone()
        run_backend(_spec("cp_gather_indexer_k_quant_cache"), backend, (cache, k2, s2, t2, cu))
        assert (k2.view(torch.uint8)[bs:2 * bs] == 0).all() and (s2[bs:2 * bs] == 0).all(), bad
        # Rows of the valid block 0 are copied; rows past cu[B] untouched.
        values, scales = layout.cache_views(cache, dst_k.shape[1])
        assert torch.equal(k2.view(torch.uint8)[:bs], values[int(table[0, 0])]), bad
        assert torch.equal(k2.view(torch.uint8)[2 * bs + 1:], dst_k.view(torch.uint8)[2 * bs + 1:]), bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_decreasing_cu_seq_lens_is_defined_and_refused_by_the_debug_switch(backend):
    """cu = [0, 6, 2, 9]: request 1 (negative length) owns no row; rows go to the request
    the binary search finds and only inside its range; both backends agree bit for bit."""
    cache, dst_k, dst_scale, table, _ = _inputs("cp_gather_indexer_k_quant_cache", cases.EXAMPLE_GATHER)
    cu = torch.tensor([0, 6, 2, 9], dtype=torch.int32)
    outs = []
    for b in BACKENDS:
        k2, s2 = dst_k.clone(), dst_scale.clone()
        run_backend(_spec("cp_gather_indexer_k_quant_cache"), b, (cache, k2, s2, table, cu))
        outs.append((k2.view(torch.uint8), s2))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
    req = ref.request_of_rows(torch.arange(dst_k.shape[0]), cu)
    assert req[:2].tolist() == [0, 0] and req[2:9].tolist() == [2] * 7  # rows 2..5: request 2 (search), 6..8 too
    values, _ = layout.cache_views(cache, dst_k.shape[1])
    bs = cache.shape[1]
    assert torch.equal(outs[0][0][4], values[int(table[2, 2 // bs]), 2 % bs])  # row 4 = token 2 of request 2
    assert torch.equal(outs[0][0][9:], dst_k.view(torch.uint8)[9:])
    with graphsafe.debug_checks(True), pytest.raises(InputError, match="cu_seq_lens.*non-decreasing"):
        graphsafe.cp_gather_indexer_k_quant_cache(cache, dst_k.clone(), dst_scale.clone(), table, cu)


def test_debug_switch_names_the_true_index_of_a_bad_cu_seq_lens_entry():
    """The bound checks look at cu_seq_lens' first and last entries: the message names
    the entry's index in the argument (3 here), not its index in a slice of it."""
    cache, dst_k, dst_scale, table, cu = _inputs("cp_gather_indexer_k_quant_cache", cases.EXAMPLE_GATHER)
    n, last = dst_k.shape[0], cu.shape[0] - 1
    assert last > 0
    past_end = cu.clone()
    past_end[last] = n + 81
    below_zero = cu.clone()
    below_zero[0] = -1
    with graphsafe.debug_checks(True):
        with pytest.raises(InputError, match=rf"'cu_seq_lens'.*at most {n} .*got {n + 81} at index \[{last}\]"):
            graphsafe.cp_gather_indexer_k_quant_cache(cache, dst_k.clone(), dst_scale.clone(), table, past_end)
        with pytest.raises(InputError, match=r"'cu_seq_lens'.*at least 0 .*got -1 at index \[0\]"):
            graphsafe.cp_gather_indexer_k_quant_cache(cache, dst_k.clone(), dst_scale.clone(), table, below_zero)


@pytest.mark.nonfinite
def test_quant_nan_and_inf_scales_agree_bit_for_bit():
    """NaN in a group: scale 0x7FC00000 and all values 0x7F; +-inf: scale +inf, finite
    values +-0, the infs NaN (0x7F). Reference and Triton write the same bytes."""
    k = torch.randn(4, 64) * 3
    k[0, 5] = float("nan")
    k[1, 7], k[1, 9] = float("inf"), float("-inf")
    k[2, 40] = -float("nan")
    slots = torch.tensor([0, 1, 2, -1])
    for fmt in (None, "ue8m0"):
        caches = []
        for backend in BACKENDS:
            cache = torch.zeros((2, 4, 64 + 8), dtype=torch.uint8)
            run_backend(_spec("indexer_k_quant_and_cache"), backend, (k.bfloat16(), cache, slots, 32, fmt))
            caches.append(cache)
        assert torch.equal(caches[0], caches[1]), fmt
        values, scales = layout.cache_views(caches[0], 64)
        bits = scales.view(torch.int32)
        assert bits[0, 0, 0] == 0x7FC00000 and (values[0, 0, :32] == 0x7F).all()
        assert bits[0, 1, 0] == 0x7F800000 and values[0, 1, 7] == 0x7F and values[0, 1, 9] == 0x7F
        assert ((values[0, 1, :32] & 0x7F) == 0).sum() == 30  # the finite values: +-0
        assert bits[0, 2, 1] == 0x7FC00000 and (values[0, 2, 32:] == 0x7F).all()
        assert torch.isfinite(scales[0, 2, 0]) and torch.isfinite(scales[0, 1, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_negative_block_ids_and_bad_requests_give_minus_one(backend):
    req = torch.tensor([0, 1, -2, 5], dtype=torch.int32)
    table = torch.tensor([[3, -1], [-2, 7]], dtype=torch.int32)
    idx = torch.tensor([[0, 5], [1, 6], [0, 1], [0, 1]], dtype=torch.int32)
    out = run_backend(_spec("req_local_to_global_slots"), backend, (req, table, idx, 4))
    assert out.tolist() == [[12, -1], [-1, 30], [-1, -1], [-1, -1]]


def test_debug_switch_refuses_bad_slots_and_block_ids():
    q, cache, w, lens, table, length = _inputs("fp8_paged_mqa_logits", cases.EXAMPLE_PAGED)
    lens = torch.full_like(lens, length)
    t2 = table.clone()
    t2[1, 0] = -2
    with graphsafe.debug_checks(True):
        graphsafe.fp8_paged_mqa_logits(q, cache, w, lens, table, length)
        with pytest.raises(InputError, match=r"fp8_paged_mqa_logits.*block_table.*-2"):
            graphsafe.fp8_paged_mqa_logits(q, cache, w, lens, t2, length)
