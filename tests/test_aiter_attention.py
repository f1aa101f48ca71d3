"""The aiter adapter of `flash_attn_varlen` (graphsafe/ops/attention/aiter.py) against the
CPU stand-in aiter (tests/aiter_standin), on gfx942 and gfx950: results equal to the
reference (malformed cu_seqlens, rows outside every sequence, unread poison, NaN/inf),
`supports` as graphsafe.aiter_support says, and a stand-in that rejects what aiter would
mishandle (so the adapter's old call with raw cu_seqlens fails here).
`paged_attention_decode` has no aiter backend (see the adapter's docstring)."""

from __future__ import annotations

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.attention import aiter as adapter
from graphsafe.ops.attention.kernels import triton_sequence_bounds
from graphsafe.ops.attention.reference import sequence_bounds
from graphsafe.testing import contract as C

VARLEN = "flash_attn_varlen"
ARCHS = ("gfx942", "gfx950")
NAN = float("nan")


def _call(args, name: str = VARLEN):
    """The op's bound call of `args` (what `supports` and `prepare` take)."""
    return graphsafe.get_op(name).call(*args)


def _aiter(name: str, args):
    """The adapter's runner on `args` (supports must accept them)."""
    assert getattr(adapter, f"supports_{name}")(_call(args, name)), name
    return getattr(adapter, f"prepare_{name}")(_call(args, name))(*args)


def _compare(name: str, args, actual):
    spec = graphsafe.get_op(name)
    expected = spec.runner("reference")(*C.clone_args(args))
    # The tolerance scales with max|v|: taken over the finite values (unread ones are NaN).
    finite = tuple(torch.nan_to_num(a, nan=0.0) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                   for a in args)
    case_for(spec.name).compare(expected, actual, finite, finite, {})
    return expected


# -- varlen prefill ---------------------------------------------------------------------
VARLEN_BASE = {
    "B": 3, "max_q": 20, "max_k": 33, "self_attn": False, "Hk": 2, "group": 2, "D": 32, "Dv": None,
    "causal": True, "dtype": torch.float16, "mode": "off", "descale": "tensor", "pad_q": 2, "pad_k": 1,
    "lens_q": [5, 0, 20], "lens_k": [9, 3, 17],
}
VARLEN_PARAMS = (
    VARLEN_BASE,
    {**VARLEN_BASE, "causal": False, "dtype": torch.bfloat16, "Dv": 20},  # aiter pads Dv to 24 and slices
    {**VARLEN_BASE, "self_attn": True, "lens_q": [20, 7, 1], "lens_k": [20, 7, 1]},
    {**VARLEN_BASE, "B": 2, "Hk": 1, "D": 192, "Dv": 128, "max_q": 9, "max_k": 17, "lens_q": [9, 4],
     "lens_k": [17, 4]},
    # bf16 at 192 / 128: aiter's OPUS kernel on gfx950, fmha v3 on gfx942
    {**VARLEN_BASE, "B": 2, "Hk": 1, "D": 192, "Dv": 128, "max_q": 9, "max_k": 17, "lens_q": [9, 4],
     "lens_k": [17, 4], "dtype": torch.bfloat16},
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", VARLEN_PARAMS, ids=lambda p: f"D{p['D']}-Dv{p['Dv']}-causal{p['causal']}")
def test_varlen_matches_the_reference_on_the_case(aiter_standin, arch, params):
    aiter_standin(arch)
    spec = graphsafe.get_op(VARLEN)
    args = case_for(spec.name).inputs(params, "cpu", 0)
    assert adapter.supports_flash_attn_varlen(_call(args))
    C.check_backend_matches_reference(spec, case_for(spec.name), "aiter", args, params)
    C.check_unread_inputs_never_matter(spec, case_for(spec.name), "aiter", params, args)
    C.check_out_of_range_ids_are_padding(spec, case_for(spec.name), "aiter", params, args, 0)
    assert C.check_nonfinite_inputs_agree(spec, case_for(spec.name), "aiter", params, args, 0)


def _varlen_inputs(cu_q, cu_k, tq=24, tk=30, causal=True, max_q=10, max_k=14):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tq, 4, 64, generator=gen).half()
    k = torch.randn(tk, 2, 64, generator=gen).half()
    v = torch.randn(tk, 2, 64, generator=gen).half()
    cu = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32))
    return (q, k, v, *cu, max_q, max_k, 0.125, causal, None, None, None, "off")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        ([3, 8, 8, 17], [0, 6, 20, 30]),  # rows 0-2 before the first sequence, 17-23 after the last
        ([2, 9, 5, 14, 10**6], [-5, 7, 3, 20, 31]),  # decreasing, negative, past the tensors
        ([30, 40], [0, 12]),  # starts past the end: no row of any sequence
    ],
)
def test_varlen_sanitises_cu_seqlens(aiter_standin, arch, causal, cu_q, cu_k):
    aiter_standin(arch)
    args = _varlen_inputs(cu_q, cu_k, causal=causal)
    bounds_q = sequence_bounds(args[3], 24)
    inside = torch.zeros(24, dtype=torch.bool)
    inside[int(bounds_q[0]):int(bounds_q[-1])] = True
    args[0][~inside] = NAN  # unread query rows
    out = _aiter(VARLEN, args)
    _compare(VARLEN, args, out)
    assert (out[~inside] == 0).all() and torch.isfinite(out.float()).all()


def test_sequence_bounds_kernel():
    cu_q = torch.tensor([2, 9, 5, 14, 10**6, -3], dtype=torch.int32)
    cu_k = torch.tensor([-5, 7, 3, 20, 31, 8], dtype=torch.int32)
    bq, bk = torch.empty(6, dtype=torch.int32), torch.empty(6, dtype=torch.int32)
    triton_sequence_bounds.bind_sequence_bounds(cu_q, 5, 24, 30)(cu_q, cu_k, bq, bk)
    assert bq.tolist() == [2, 9, 9, 14, 24, 24] and bk.tolist() == [0, 7, 7, 20, 30, 30]


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_without_keys_or_rows_skips_aiter(aiter_standin, arch):
    aiter_standin(arch)
    for args in (_varlen_inputs([0, 4, 9], [0, 0, 0], tk=0), _varlen_inputs([0, 0], [0, 5], max_q=0),
                 _varlen_inputs([0, 0], [0, 0], tq=0)):
        out = _aiter(VARLEN, args)
        _compare(VARLEN, args, out)
        assert (out == 0).all()


def test_varlen_supports_per_the_table(aiter_standin):
    args = _varlen_inputs([0, 4, 9], [0, 6, 20])
    for arch in ARCHS:
        aiter_standin(arch)
        assert adapter.supports_flash_attn_varlen(_call(args)), arch
    aiter_standin("gfx90a")
    assert not adapter.supports_flash_attn_varlen(_call(args))
    aiter_standin("gfx950")
    q, k, v, cu_q, cu_k = args[:5]
    fp8 = torch.float8_e4m3fn
    declined = {
        "B = 0": (q, k, v, cu_q[:1], cu_k[:1], *args[5:]),
        "fp8 on": (*args[:9], None, None, None, "on"),
        "fp8 auto": (*args[:9], None, None, None, "auto"),
        "fp8 inputs": (q.to(fp8), k.to(fp8), v.to(fp8), *args[3:]),
        "head 264": (q.new_zeros(24, 4, 264), k.new_zeros(30, 2, 264), v, *args[3:]),
    }
    for what, bad in declined.items():
        assert not adapter.supports_flash_attn_varlen(_call(bad)), what


def _with_scale(args, scale):
    return (*args[:7], scale, *args[8:])


def test_varlen_declines_a_scale_opus_would_replace(aiter_standin):
    """Finding 5 of issue 36: on gfx950 aiter serves bf16 at head dims 192 / 128 with its
    OPUS kernel (since v0.1.18), which replaces a scale <= 0 by 1/sqrt(192); fmha v3 (gfx942)
    and older aiter take the scale as given."""
    spec = graphsafe.get_op(VARLEN)
    params = VARLEN_PARAMS[4]
    args = case_for(VARLEN).inputs(params, "cpu", 0)
    for scale in (0.0, -0.08):
        bad = _with_scale(args, scale)
        aiter = aiter_standin("gfx950")
        why = adapter.supports_flash_attn_varlen(_call(bad))
        assert not why and "OPUS" in why.reason, (scale, why)
        out = aiter.flash_attn_varlen_func(*bad[:7], softmax_scale=scale, causal=bad[8])
        with torch.no_grad():
            expected = spec.runner("reference")(*bad)
        assert not torch.allclose(out[:13].float(), expected[:13].float(), atol=0.05), "OPUS used another scale"
        for arch, version in (("gfx942", None), ("gfx950", "0.1.17")):  # fmha v3: the scale as given
            aiter_standin(arch, version)
            assert adapter.supports_flash_attn_varlen(_call(bad)), (arch, version, scale)
            C.check_backend_matches_reference(spec, case_for(VARLEN), "aiter", bad, params)
    aiter_standin("gfx950")
    assert adapter.supports_flash_attn_varlen(_call(args))
    fp16 = case_for(VARLEN).inputs(VARLEN_PARAMS[3], "cpu", 0)  # CK at any scale
    assert adapter.supports_flash_attn_varlen(_call(_with_scale(fp16, 0.0)))


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_on_inputs_that_require_grad(aiter_standin, arch):
    """Finding 9 of issue 36: with grad enabled and an input requiring it (the dispatcher
    passes such tensors as they are), aiter asserts `return_lse` (its autograd forward
    saves the LSE); graphsafe's op has no backward, so aiter runs without grad."""
    aiter = aiter_standin(arch)
    args = _varlen_inputs([0, 4, 9], [0, 6, 20])
    q = args[0].clone().requires_grad_()
    with pytest.raises(AssertionError):
        aiter.flash_attn_varlen_func(q, *args[1:7], softmax_scale=args[7], causal=args[8])
    grad_args = (q, *args[1:])
    out = _aiter(VARLEN, grad_args)
    with torch.no_grad():
        _compare(VARLEN, args, out.detach())
    assert torch.is_grad_enabled()


def test_standin_varlen_rejects_what_aiter_would_misread(aiter_standin):
    aiter = aiter_standin("gfx942")
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal = _varlen_inputs([0, 4, 9], [0, 6, 20])[:9]
    call = aiter.flash_attn_varlen_func
    with pytest.raises(RuntimeError, match="batch size must be postive"):
        call(q, k, v, cu_q[:1], cu_k[:1], max_q, max_k, softmax_scale=scale, causal=causal)
    for bad_q in ([0, 9, 4], [-1, 4, 9], [0, 4, 25]):  # the old adapter passed these raw
        with pytest.raises(RuntimeError, match="out of bounds"):
            call(q, k, v, torch.tensor(bad_q, dtype=torch.int32), cu_k, max_q, max_k, softmax_scale=scale)
    with pytest.raises(RuntimeError, match="int32"):
        call(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="divide"):
        call(q[:, :3], k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="at most 256"):
        call(q.new_zeros(24, 4, 264), k.new_zeros(30, 2, 264), v, cu_q, cu_k, max_q, max_k)
    out = call(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)
    assert isinstance(out, torch.Tensor) and torch.isnan(out[9:]).all()  # rows after the last sequence: unset
