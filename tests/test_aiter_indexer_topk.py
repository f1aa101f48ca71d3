"""The aiter adapters of the sparse indexer (graphsafe/ops/indexer/aiter.py) and the per-row
top-k (graphsafe/ops/topk/aiter.py) against the CPU stand-in aiter (tests/aiter_standin),
per architecture: supports as graphsafe.aiter_support says, results equal to the
reference (padding, unread poison, NaN/inf), and a stand-in that rejects what aiter does."""

from __future__ import annotations

import importlib

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe import aiter_support
from graphsafe.testing import contract as C

MQA, PREFILL, DECODE = "fp8_mqa_logits", "top_k_per_row_prefill", "top_k_per_row_decode"
REMOVED = ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache", "fp8_paged_mqa_logits")
MQA_MODULE = "aiter.ops.triton.attention.fp8_mqa_logits"


def _adapter(name: str):
    family = "topk" if name in (PREFILL, DECODE) else "indexer"
    return importlib.import_module(f"graphsafe.ops.{family}.aiter")


def _supports(name: str, args):
    """The aiter record's answer to these args (a `Support`: truthy where aiter serves them)."""
    return graphsafe.get_op(name).support("aiter", *args)


def _check_against_reference(name: str, params: dict, seed: int) -> None:
    """The aiter backend on the case's inputs: equal to the reference, unread elements
    never matter, out-of-range ids act as padding, NaN/inf land where the reference's do."""
    spec = graphsafe.get_op(name)
    args = case_for(spec.name).inputs(params, "cpu", seed)
    assert _supports(name, args), (name, params)
    C.check_backend_matches_reference(spec, case_for(spec.name), "aiter", args, params)
    C.check_unread_inputs_never_matter(spec, case_for(spec.name), "aiter", params, args)
    C.check_out_of_range_ids_are_padding(spec, case_for(spec.name), "aiter", params, args, seed)
    assert C.check_nonfinite_inputs_agree(spec, case_for(spec.name), "aiter", params, args, seed), (name, params)


# -- the records -----------------------------------------------------------------------
def test_removed_indexer_ops_have_no_aiter_backend():
    adapter = _adapter(MQA)
    for name in REMOVED:
        assert "aiter" not in graphsafe.get_op(name).backends, name
        assert not aiter_support.CAPABILITIES[name].archs, name
        assert not hasattr(adapter, f"supports_{name}") and not hasattr(adapter, f"prepare_{name}"), name
    for name in (MQA, PREFILL, DECODE):
        assert "aiter" in graphsafe.get_op(name).backends, name


# -- fp8_mqa_logits ----------------------------------------------------------------------
MQA_PARAMS = (
    {"M": 8, "N": 24, "H": 16, "D": 64, "window": "causal"},
    {"M": 1, "N": 1, "H": 16, "D": 64, "window": "full"},
    {"M": 9, "N": 70, "H": 64, "D": 128, "window": "random"},
    {"M": 5, "N": 256, "H": 32, "D": 64, "window": "random"},  # aiter's view is contiguous: no copy
)


def test_fp8_mqa_logits_on_gfx950_matches_the_reference(aiter_standin):
    aiter_standin("gfx950")
    for seed, params in enumerate(MQA_PARAMS):
        _check_against_reference(MQA, params, seed)


def test_fp8_mqa_logits_on_gfx950_propagates_nan(aiter_standin):
    aiter_standin("gfx950")
    q, k, k_scale, w, ks, ke = case_for(MQA).inputs(MQA_PARAMS[0], "cpu", 3)
    ks, ke = torch.zeros_like(ks), torch.full_like(ke, k.shape[0])
    q.view(torch.uint8)[2, 5, 7] = 0x7F  # one head of query 2: relu(NaN) = NaN
    call = graphsafe.get_op(MQA).call(q, k, k_scale, w, ks, ke)
    out = _adapter(MQA).prepare_fp8_mqa_logits(call)(q, k, k_scale, w, ks, ke)
    ref = graphsafe.get_op(MQA).runner("reference")(q, k, k_scale, w, ks, ke)
    assert torch.isnan(ref[2]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[:2]).all() and out.is_contiguous()


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_fp8_mqa_logits_goes_to_triton_off_gfx950(aiter_standin, arch):
    aiter_standin(arch)
    args = case_for(MQA).inputs(MQA_PARAMS[0], "cpu", 0)
    assert not _supports(MQA, args)
    # Later aiter releases ship a gfx942 Gluon kernel too: the capability table still decides.
    with pytest.MonkeyPatch.context() as mp:
        module = importlib.import_module(MQA_MODULE)
        mp.setattr(module, "_gluon_fp8_mqa_logits_kernel", module._gluon_scores)
        assert not _supports(MQA, args)


def test_fp8_mqa_logits_needs_the_gluon_kernel_and_its_shapes(aiter_standin):
    aiter_standin("gfx950")
    import triton

    case = case_for(MQA)
    args = case.inputs(MQA_PARAMS[0], "cpu", 0)
    assert _supports(MQA, args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton, "__version__", "3.5.1")  # aiter takes its Triton kernel: relu(NaN) = 0
        assert not _supports(MQA, args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.import_module(MQA_MODULE), "_gluon_fp8_mqa_logits_kernel", None)  # import failed
        assert not _supports(MQA, args)
    for bad in ({"H": 24}, {"D": 8}, {"M": 0}, {"N": 0}):
        assert not _supports(MQA, case.inputs({**MQA_PARAMS[0], **bad}, "cpu", 0)), bad


def test_fp8_mqa_logits_declines_head_dims_the_gluon_kernel_cannot_compile(aiter_standin):
    """Finding 1 of issue 36: aiter's gfx950 Gluon kernel multiplies with MFMA of K 64 or
    128 (the head dim is K); at D 16 and 32 Triton's AMD backend aborts the process while
    compiling it (no exception to catch, no fallback). D 64 to 1024 compile."""
    aiter_standin("gfx950")
    case = case_for(MQA)
    mqa = importlib.import_module(MQA_MODULE).fp8_mqa_logits
    for d in (16, 32):
        args = case.inputs({**MQA_PARAMS[0], "D": d}, "cpu", 0)
        why = _supports(MQA, args)
        assert not why and "[64, 1024]" in why.reason, (d, why)
        with pytest.raises(RuntimeError, match="aborts the process"):
            mqa(*args)
    for d in (64, 128, 256, 512, 1024):
        assert _supports(MQA, case.inputs({**MQA_PARAMS[0], "D": d}, "cpu", 0)), d
    assert not _supports(MQA, case.inputs({**MQA_PARAMS[0], "D": 2048}, "cpu", 0))


def test_fp8_mqa_logits_declines_a_strided_k_scale(aiter_standin):
    """Finding 4 of issue 36: aiter's kernels read kv_scales (and cu_starts / cu_ends) from
    the data pointer with unit stride, whatever the tensor's strides. The stand-in reads
    them so: a strided k_scale would give other keys' scales (NaN here)."""
    aiter_standin("gfx950")
    q, k, k_scale, w, ks, ke = case_for(MQA).inputs(MQA_PARAMS[2], "cpu", 0)
    strided = torch.stack([k_scale, torch.full_like(k_scale, float("nan"))], 1)[:, 0]  # stride 2
    args = (q, k, strided, w, ks, ke)
    why = _supports(MQA, args)
    assert not why and "unit stride" in why.reason
    out = importlib.import_module(MQA_MODULE).fp8_mqa_logits(*args)
    ref = graphsafe.get_op(MQA).runner("reference")(*args)
    inside = torch.isfinite(ref)
    assert inside.any() and torch.isnan(out[inside]).any(), "aiter reads the NaN in between"
    assert _supports(MQA, (q, k, strided.contiguous(), w, ks, ke))
    assert _supports(MQA, (q, k[:1], strided[:1], w, ks, ke)), "one key: no stride is read"


def test_fp8_mqa_logits_copies_only_the_windows(aiter_standin, monkeypatch):
    """Finding 8 of issue 36: where aiter's 256-column padded output is not contiguous, the
    adapter asks aiter not to fill it (`clean_logits=False`: only the windows are written)
    and writes the contiguous output from the windows, -inf elsewhere, in one launch;
    where it is (N a multiple of 256) aiter's output is returned as it is."""
    aiter_standin("gfx950")
    module = importlib.import_module(MQA_MODULE)
    original, calls = module.fp8_mqa_logits, []
    monkeypatch.setattr(module, "fp8_mqa_logits", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    spec = graphsafe.get_op(MQA)
    for params, clean in ((MQA_PARAMS[2], False), (MQA_PARAMS[0], False), (MQA_PARAMS[3], True)):
        args = case_for(MQA).inputs(params, "cpu", 1)
        out = _adapter(MQA).prepare_fp8_mqa_logits(spec.call(*args))(*args)
        assert calls[-1].get("clean_logits", True) is clean, params
        ref = spec.runner("reference")(*args)
        assert out.is_contiguous() and out.shape == ref.shape
        case_for(MQA).compare(ref, out, args, args, params)
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref))


def test_standin_fp8_mqa_logits_is_aiters(aiter_standin):
    case = case_for(MQA)
    aiter_standin("gfx950")
    mqa = importlib.import_module(MQA_MODULE).fp8_mqa_logits
    with pytest.raises(AssertionError, match="power of 2"):
        mqa(*case.inputs({**MQA_PARAMS[0], "H": 24}, "cpu", 0))
    args = case.inputs(MQA_PARAMS[0], "cpu", 0)
    out = mqa(*args)
    assert out.shape == (8, 24) and out.stride() == (256, 1) and not out.is_contiguous()
    # gfx942: e4m3fn inputs become e4m3fnuz copies and relu(NaN) is 0 (why Triton serves it).
    aiter_standin("gfx942")
    mqa = importlib.import_module(MQA_MODULE).fp8_mqa_logits
    q, k, k_scale, w, ks, ke = args
    q = q.clone()
    q.view(torch.uint8)[7, 0, 0] = 0x7F  # the last query sees every key (causal)
    out = mqa(q, k, k_scale, w, ks, ke)
    ref = graphsafe.get_op(MQA).runner("reference")(q, k, k_scale, w, ks, ke)
    assert torch.isnan(ref[7]).all() and torch.isfinite(out[7]).all()


# -- top-k -------------------------------------------------------------------------------
_PREFILL_EX = {"M": 4, "N": 200, "topk": 12, "extra_k": 0, "values": "normal", "ranges": "causal", "strided": False}
_DECODE_EX = {"B": 3, "next_n": 2, "L": 250, "topk": 10, "extra_k": 0, "values": "normal", "lens": "random",
              "strided": False}
TOPK_PARAMS = {
    PREFILL: (
        _PREFILL_EX,  # aiter writes indices directly
        {**_PREFILL_EX, "values": "ties", "ranges": "full", "strided": True},
        {**_PREFILL_EX, "values": "ties_inf", "ranges": "wild", "extra_k": 3},
        {**_PREFILL_EX, "N": 10, "topk": 16},  # every row shorter than topk
    ),
    DECODE: (
        _DECODE_EX,
        {**_DECODE_EX, "values": "ties", "lens": "full", "strided": True, "extra_k": 3},
        {**_DECODE_EX, "next_n": 3, "values": "ties_inf", "lens": "short"},
    ),
}


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("name", [PREFILL, DECODE])
def test_top_k_matches_the_reference(aiter_standin, arch, name):
    aiter_standin(arch)
    for seed, params in enumerate(TOPK_PARAMS[name]):
        _check_against_reference(name, params, seed)


def test_top_k_prefill_asks_for_the_stable_kernel(aiter_standin):
    aiter_standin("gfx942")
    spec = graphsafe.get_op(PREFILL)
    params = {**_PREFILL_EX, "values": "ties", "ranges": "full"}
    args = case_for(spec.name).inputs(params, "cpu", 5)
    _adapter(PREFILL).prepare_top_k_per_row_prefill(spec.call(*args))(*args)
    idx = args[3]
    assert (idx >= 0).all()
    assert (idx[:, 1:] > idx[:, :-1]).all(), "stable=True: ascending positions"


def test_top_k_supports(aiter_standin):
    aiter = aiter_standin("gfx950")
    logits, wide = torch.zeros(2, 16), torch.empty(2, 2048, dtype=torch.int32)
    rows = torch.zeros(2, dtype=torch.int32)
    prefill, decode = (lambda *a: _supports(PREFILL, a)), (lambda *a: _supports(DECODE, a))
    assert prefill(logits, rows, rows, wide, 2048) and decode(logits, 1, rows, wide, 2048)
    assert not prefill(logits[:0], rows[:0], rows[:0], wide[:0], 8)
    assert not decode(logits[:, :0], 1, rows, wide, 8)
    assert not prefill(logits, rows, rows, wide, 0)

    def no_stable(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048):
        raise AssertionError("not called")

    def no_k(logits, next_n, seqLens, indices, numRows, stride0, stride1):
        raise AssertionError("not called")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aiter, PREFILL, no_stable)
        mp.setattr(aiter, DECODE, no_k)
        _adapter(PREFILL)._entry.cache_clear()
        assert not prefill(logits, rows, rows, wide, 2048), "an aiter without `stable`"
        assert decode(logits, 1, rows, wide, 2048) and not decode(logits, 1, rows, wide, 8), "an aiter without `k`"
    _adapter(PREFILL)._entry.cache_clear()
    aiter_standin("gfx90a")
    assert not prefill(logits, rows, rows, wide, 2048) and not decode(logits, 1, rows, wide, 2048)


def test_standin_top_k_follows_aiters_kernel(aiter_standin):
    aiter = aiter_standin("gfx942")
    nan = float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0],
                           [-0.0, -nan, float("inf"), 0.0, nan, float("-inf")]])
    out = torch.empty(2, 3, dtype=torch.int32)
    starts, ends = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([6, 6], dtype=torch.int32)
    aiter.top_k_per_row_prefill(logits, starts, ends, out, None, 2, 6, 1, k=3, stable=True)
    # Absolute columns, ascending; +NaN > +inf > +0 > -0 > -inf > -NaN.
    assert out.tolist() == [[1, 2, 4], [2, 3, 4]]
    two = torch.empty(2, 2, dtype=torch.int32)
    aiter.top_k_per_row_prefill(logits, starts, ends, two, None, 2, 6, 1, k=2)
    assert sorted(two[0].tolist()) == [2, 4], "unstable: another tie-break"
    # Rows of at most k values: rowStart + i, then -1 (negative lengths too).
    short_starts, short_ends = torch.tensor([4, 3], dtype=torch.int32), torch.tensor([6, 1], dtype=torch.int32)
    aiter.top_k_per_row_prefill(logits, short_starts, short_ends, out, None, 2, 6, 1, k=3)
    assert out.tolist() == [[4, 5, -1], [-1, -1, -1]]
    # Decode: rowEnd = seqLens[b // next_n] - next_n + b % next_n + 1, positions from 0.
    out = torch.empty(4, 6, dtype=torch.int32)
    aiter.top_k_per_row_decode(torch.zeros(4, 6), 2, torch.tensor([5, 3], dtype=torch.int32), out, 4, 6, 1, k=6)
    assert (out >= 0).sum(1).tolist() == [4, 5, 2, 3]
    before = out.clone()
    aiter.top_k_per_row_decode(torch.zeros(4, 6), 2, torch.tensor([5, 3], dtype=torch.int32), out, 0, 6, 1, k=6)
    assert torch.equal(out, before), "numRows <= 0: nothing happens"


def test_standin_top_k_rejects_what_aiter_rejects(aiter_standin):
    aiter = aiter_standin("gfx950")
    logits = torch.randn(2, 8)
    lo, hi = torch.zeros(2, dtype=torch.int32), torch.full((2,), 8, dtype=torch.int32)
    out = torch.empty(2, 4, dtype=torch.int32)
    call = aiter.top_k_per_row_prefill
    for kwargs, error, match in (
        ({"numRows": 2.0}, TypeError, "numRows"),  # pybind: ints only
        ({"stride0": torch.tensor(8)}, TypeError, "stride0"),
        ({"stable": 1}, TypeError, "stable"),
        ({"logits": logits.double()}, AssertionError, "Unsupported dtype: torch.float64"),
        ({"rowEnds": torch.full((2,), 9, dtype=torch.int32)}, IndexError, "outside"),  # unclipped bounds
        ({"rowStarts": torch.full((2,), -1, dtype=torch.int32)}, IndexError, "outside"),
        ({"rowStarts": lo.long()}, ValueError, "int32"),
        ({"indices": torch.empty(2, 7, dtype=torch.int32)[:, :4]}, ValueError, "dense"),  # strided
        ({"indices": torch.empty(2, 5, dtype=torch.int32)}, ValueError, "dense"),  # wider than k
        ({"logits": torch.randn(8, 2).t()}, ValueError, "contiguous columns"),
    ):
        full = dict(logits=logits, rowStarts=lo, rowEnds=hi, indices=out, values=None, numRows=2, stride0=8,
                    stride1=1, k=4)
        with pytest.raises(error, match=match):
            call(**{**full, **kwargs})
    # A row pitch (stride0) larger than the logits' own: the last row reads past the storage.
    with pytest.raises(IndexError, match="storage"):
        aiter.top_k_per_row_decode(torch.randn(3, 8)[1:], 1, torch.tensor([8, 8], dtype=torch.int32),
                                   out, 2, 16, 1, k=4)
