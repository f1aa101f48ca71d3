"""Semantics of the attention family (paged_attention_decode, flash_attn_varlen) on the CPU.

The reference is checked against a plain per-sequence float64 loop (independent code);
the Triton kernels run through the interpreter (float16/fp8 at tiny shapes: the
interpreter computes bf16 dots wrongly; bf16 is checked on the GPU).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphsafe
from graphsafe.errors import InputError
from graphsafe.ops.attention import (
    flash_attn_varlen_workspace,
    fp8_prefill_supported,
    paged_attention_decode_workspace,
    plan,
    plan_decode_splits,
    reference,
)
from graphsafe.ops.attention.fp8 import FP8_DTYPE, quantize_per_tensor
from graphsafe.testing.cases import case_for
from graphsafe.ops.attention.cases import attention_compare
from graphsafe.workspace import current_workspace_manager, reset_workspace_managers, workspace_bytes

HAS_INTERPRETER = graphsafe.get_op("flash_attn_varlen").available_backends("cpu").count("triton") == 1
needs_triton = pytest.mark.skipif(not HAS_INTERPRETER, reason="Triton interpreter not enabled")


def _triton():
    from graphsafe.ops.attention import triton as T

    return T


# -- independent float64 loops ---------------------------------------------------------------
def naive_attention(q, k, v, scale, visible):
    """q [Lq, Hq, D], k [Lk, Hk, D], v [Lk, Hk, Dv], visible [Lq, Lk] bool -> [Lq, Hq, Dv] f64."""
    lq, hq, _ = q.shape
    hk, dv = k.shape[1], v.shape[2]
    out = torch.zeros(lq, hq, dv, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        for i in range(lq):
            keys = visible[i].nonzero().flatten()
            if len(keys) == 0:
                continue
            s = (q[i, h].double() @ kh[keys].T) * scale
            out[i, h] = torch.softmax(s, 0) @ vh[keys]
    return out


def naive_varlen(q, k, v, cu_q, cu_k, scale, causal, descales=(None, None, None)):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]].double(), k[cu_k[b] : cu_k[b + 1]].double(), v[cu_k[b] : cu_k[b + 1]].double()
        hk = k.shape[1]
        for x, d in zip((qs, ks, vs), descales):
            if d is not None:
                x *= (d[b] if d.dim() == 2 else d.expand(hk)).double().repeat_interleave(x.shape[1] // hk)[None, :, None]
        lq, lk = qs.shape[0], ks.shape[0]
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        visible = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool)
        out[cu_q[b] : cu_q[b + 1]] = naive_attention(qs, ks, vs, scale, visible)
    return out


def naive_decode(q, k_cache, v_cache, table, lens, scale, k_scale=None, v_scale=None):
    b, hq, _ = q.shape
    bs = k_cache.shape[1]
    out = torch.zeros(b, hq, v_cache.shape[3], dtype=torch.float64)
    for r in range(b):
        n = min(max(int(lens[r]), 0), table.shape[1] * bs)
        slots = [(int(table[r, j // bs]), j % bs) for j in range(n)]
        k = torch.stack([k_cache[blk, off].double() for blk, off in slots]) if slots else torch.zeros(0, *k_cache.shape[2:], dtype=torch.float64)
        v = torch.stack([v_cache[blk, off].double() for blk, off in slots]) if slots else torch.zeros(0, *v_cache.shape[2:], dtype=torch.float64)
        if k_scale is not None:
            k, v = k * float(k_scale), v * float(v_scale)
        out[r] = naive_attention(q[r : r + 1], k, v, scale, torch.ones(1, n, dtype=torch.bool))[0]
    return out


def _close(actual, expected64, dtype, what):
    tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(actual.double(), expected64, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


PLAIN = {"window_left": -1, "softcap": 0.0, "sinks": False}  # no attention variant


def _varlen_args(case, params, seed=0):
    return case.inputs(params, "cpu", seed)


# -- reference == independent loops ----------------------------------------------------------
@settings(max_examples=25)
@given(params=case_for("flash_attn_varlen").params(), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_varlen_reference_matches_loops(params, seed, dtype):
    # The loops know no variants (tests/test_attention_oracles.py checks those against the models).
    params = {**params, "dtype": dtype, "mode": "off" if params["mode"] != "fp8_inputs" else "fp8_inputs", **PLAIN}
    args = case_for("flash_attn_varlen").inputs(params, "cpu", seed)
    q, k, v, cu_q, cu_k, _, _, scale, causal, qd, kd, vd = args[:12]
    out = reference.flash_attn_varlen(*args)
    expected = naive_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, scale, causal, (qd, kd, vd))
    _close(out, expected, out.dtype, f"varlen reference {params}")


@settings(max_examples=25)
@given(params=case_for("paged_attention_decode").params(), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_decode_reference_matches_loops(params, seed, dtype):
    args = case_for("paged_attention_decode").inputs({**params, "dtype": dtype, **PLAIN}, "cpu", seed)
    out = reference.paged_attention_decode(*args)
    q, kc, vc, table, lens, scale, ks, vs = args[:8]
    expected = naive_decode(q.float(), kc.float(), vc.float(), table, lens, scale, ks, vs)
    _close(out, expected, dtype, f"decode reference {params}")


def test_causal_is_bottom_right_aligned():
    """len_q=2, len_k=5: row 0 sees keys 0..3, row 1 sees 0..4 (FlashAttention-2); with
    len_q=5, len_k=2 the first three rows see nothing and give 0."""
    torch.manual_seed(0)
    d = 16
    for lq, lk in ((2, 5), (5, 2)):
        q, k, v = torch.randn(lq, 1, d), torch.randn(lk, 1, d), torch.randn(lk, 1, d)
        cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
        out = reference.flash_attn_varlen(q.half(), k.half(), v.half(), cu_q, cu_k, lq, lk, 1.0, True, fp8="off").double()
        for i in range(lq):
            last = i + lk - lq  # the last visible key
            if last < 0:
                assert torch.equal(out[i], torch.zeros_like(out[i]))
                continue
            p = torch.softmax(q[i, 0].half().double() @ k[: last + 1, 0].half().double().T, 0)
            torch.testing.assert_close(out[i, 0], p @ v[: last + 1, 0].half().double(), rtol=2e-3, atol=2e-3)


def test_fp8_auto_is_off_on_cpu():
    assert fp8_prefill_supported("cpu") is False
    case = case_for("flash_attn_varlen")
    args = list(case.inputs({**case.example, "dtype": torch.bfloat16}, "cpu", 0))
    auto = reference.flash_attn_varlen(*args[:12], "auto")
    off = reference.flash_attn_varlen(*args[:12], "off")
    on = reference.flash_attn_varlen(*args[:12], "on")
    assert torch.equal(auto, off) and not torch.equal(on, off)


def test_fp8_default_is_off():
    """An op keeps the precision of its inputs unless the caller asks: the schema, the
    fake/check and every backend default to fp8="off" ("auto" must be asked for)."""
    import inspect

    schema = {a.name: a for a in graphsafe.get_op("flash_attn_varlen").overload._schema.arguments}
    assert schema["fp8"].default_value == "off"
    # The fake, the check, prepare and the debug check take the bound call: its defaults are the stub's.
    kernels = (_triton().flash_attn_varlen,) if HAS_INTERPRETER else ()
    call_type = graphsafe.get_op("flash_attn_varlen").call_type
    for fn in (call_type, reference.flash_attn_varlen, *kernels):
        assert inspect.signature(fn).parameters["fp8"].default == "off", fn

def test_public_ops_on_cpu_and_empty_rows_give_zero():
    case = case_for("flash_attn_varlen")
    params = {**case.example, "lens_q": [0, 3, 0], "lens_k": [5, 0, 0], "pad_q": 4}
    args = case.inputs(params, "cpu", 1)
    out = graphsafe.flash_attn_varlen(*args)
    assert out.shape == (args[0].shape[0], args[0].shape[1], args[2].shape[2])
    assert torch.equal(out, torch.zeros_like(out))  # no visible key, or a padding row
    dcase = case_for("paged_attention_decode")
    dargs = dcase.inputs({**dcase.example, "seq_lens": [0, 5, 0]}, "cpu", 1)
    dout = graphsafe.paged_attention_decode(*dargs)
    assert torch.equal(dout[0], torch.zeros_like(dout[0])) and torch.equal(dout[2], torch.zeros_like(dout[2]))
    assert dout[1].abs().sum() > 0


def test_decode_ignores_block_table_tail_and_clamps_lengths():
    case = case_for("paged_attention_decode")
    q, kc, vc, table, lens, scale = case.inputs({**case.example, "seq_lens": [3, 16, 9]}, "cpu", 2)[:6]
    base = reference.paged_attention_decode(q, kc, vc, table, lens, scale)
    junk = table.clone()
    junk[0, 1:] = 10**6  # request 0 uses one block of 4 tokens
    junk[2, 3:] = -7
    assert torch.equal(reference.paged_attention_decode(q, kc, vc, junk, lens, scale), base)
    over = torch.tensor([3, 10**6, 9], dtype=torch.int32)  # past capacity (16): clamped
    assert torch.equal(reference.paged_attention_decode(q, kc, vc, table, over, scale), base)


def test_bad_mode_and_descale_are_refused():
    case = case_for("flash_attn_varlen")
    args = case.inputs(case.example, "cpu", 0)
    with pytest.raises(InputError, match="'fp8'"):
        graphsafe.flash_attn_varlen(*args[:12], "yes")
    with pytest.raises(InputError, match="q_descale"):
        graphsafe.flash_attn_varlen(*args[:9], torch.ones(1), None, None, "auto")


# -- decode: kernels vs reference --------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_decode_kernel_split_kv(splits):
    """Forced split counts: more splits than tiles leaves empty splits (neutral partials),
    and all-empty rows (seq_len 0) combine to exactly 0 without NaN."""
    case = case_for("paged_attention_decode")
    params = {**case.example, "B": 4, "block_size": 4, "max_blocks": 6}
    args = case.inputs({**params, "seq_lens": [0, 1, 13, 24]}, "cpu", splits)
    expected = reference.paged_attention_decode(*args)
    actual = _triton().paged_attention_decode(*args, num_splits=splits)
    assert not actual.isnan().any()
    assert torch.equal(actual[0], torch.zeros_like(actual[0]))
    attention_compare(expected, actual, args[2].abs().max().item(), torch.float16, False, 0, f"splits={splits}")


@needs_triton
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 64)])
def test_decode_kernel_gqa_ratios_and_head_dims(group, d):
    case = case_for("paged_attention_decode")
    params = {**case.example, "B": 2, "Hk": 1, "group": group, "D": d, "block_size": 16, "max_blocks": 2}
    args = case.inputs(params, "cpu", group)
    expected = reference.paged_attention_decode(*args)
    attention_compare(expected, _triton().paged_attention_decode(*args, num_splits=2), args[2].abs().max().item(), torch.float16, False, 0, "gqa")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_decode_over_reshape_and_cache(backend):
    """End to end through one backend's kernels: reshape_and_cache writes K/V (also fp8),
    decode reads them back."""
    torch.manual_seed(3)
    b, hk, group, d, bs, mb = 2, 2, 4, 32, 4, 5
    lens = [7, 18]
    nb = b * mb
    table = torch.randperm(nb).reshape(b, mb).int()
    for fp8 in (False, True):
        cache_dtype = FP8_DTYPE if fp8 else torch.float16
        k_cache = torch.randn(nb, bs, hk, d).to(cache_dtype)
        v_cache = torch.randn(nb, bs, hk, d).to(cache_dtype)
        scales = (torch.tensor([0.05]), torch.tensor([0.04])) if fp8 else (None, None)
        keys = [torch.randn(n, hk, d).half() for n in lens]
        vals = [torch.randn(n, hk, d).half() for n in lens]
        slots = torch.cat([table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for r, n in enumerate(lens)])
        q = torch.randn(b, hk * group, d).half()
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        with graphsafe.use_backend(backend):
            graphsafe.reshape_and_cache(torch.cat(keys), torch.cat(vals), k_cache, v_cache, slots, *scales)
            out = graphsafe.paged_attention_decode(q, k_cache, v_cache, table, seq_lens, d**-0.5, *scales)
        for r, n in enumerate(lens):
            want = naive_attention(q[r : r + 1], keys[r], vals[r], d**-0.5, torch.ones(1, n, dtype=torch.bool))[0]
            tol = 0.1 if fp8 else 2e-3  # fp8 cache: e4m3 rounding of every cached value
            torch.testing.assert_close(out[r].double(), want, rtol=tol, atol=tol)


# -- padding, unread and non-finite inputs ------------------------------------------------------
def _both_backends():
    return ["reference", pytest.param("triton", marks=needs_triton)]


def _decode_impl(backend):
    return reference.paged_attention_decode if backend == "reference" else _triton().paged_attention_decode


def _decode_inputs(seed=5):
    """3 requests over blocks 1..(nb-1) (block 0 unused), block size 4, 4 blocks each."""
    case = case_for("paged_attention_decode")
    q, kc, vc, _, _, scale = case.inputs({**case.example, "seq_lens": [6, 16, 9]}, "cpu", seed)[:6]
    table = (torch.randperm(kc.shape[0] - 1, generator=torch.Generator().manual_seed(seed))[:12] + 1)
    return q, kc, vc, table.reshape(3, 4).int(), torch.tensor([6, 16, 9], dtype=torch.int32), scale


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_nan_in_block_zero_or_past_seq_len_never_reaches_outputs(backend, splits):
    """NaN in block 0 (which no request uses: masked lanes address it) and in the tokens
    past seq_lens inside a used block: outputs bit-equal to the clean call, finite."""
    q, kc, vc, table, lens, scale = _decode_inputs()
    kwargs = {"num_splits": splits} if backend == "triton" else {}
    clean = _decode_impl(backend)(q, kc, vc, table, lens, scale, **kwargs)
    kd, vd = kc.clone(), vc.clone()
    kd[0], vd[0] = float("nan"), float("nan")
    for r, n in ((0, 6), (2, 9)):  # the rest of each request's last block
        kd[table[r, n // 4], n % 4 :] = float("nan")
        vd[table[r, n // 4], n % 4 :] = float("inf")
    dirty = _decode_impl(backend)(q, kd, vd, table, lens, scale, **kwargs)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("backend", _both_backends())
def test_decode_padding_block_holds_no_key(backend):
    """A -1 entry inside a request's length is skipped like positions past seq_lens: the
    same as the request without that block's tokens; other out-of-range ids (too large,
    negative) give bit for bit the result of -1, and -2 does not wrap to block nb - 2."""
    q, kc, vc, table, lens, scale = _decode_inputs(6)
    impl = _decode_impl(backend)
    padded = table.clone()
    padded[1, 1] = -1  # request 1 (16 tokens): its second block is padding
    out = impl(q, kc, vc, padded, lens, scale)
    without = table.clone()
    without[1, 1:3] = table[1, 2:4].clone()  # the same tokens, the padding block left out
    short = torch.tensor([6, 12, 9], dtype=torch.int32)
    expected = reference.paged_attention_decode(q, kc, vc, without, short, scale)
    attention_compare(expected, out, vc.abs().max().item(), torch.float16, False, 0, "padding block")
    for bad in (-2, -5, kc.shape[0], 10**6):
        ids = table.clone()
        ids[1, 1] = bad
        assert torch.equal(impl(q, kc, vc, ids, lens, scale), out), bad
    wrapped = table.clone()
    wrapped[1, 1] = kc.shape[0] - 2
    assert not torch.equal(impl(q, kc, vc, wrapped, lens, scale)[1], out[1])


@pytest.mark.parametrize("backend", _both_backends())
def test_decode_only_padding_blocks_give_zero(backend):
    q, kc, vc, table, lens, scale = _decode_inputs(7)
    table[0] = -1
    table[2, :3] = torch.tensor([-3, 10**6, kc.shape[0]])
    out = _decode_impl(backend)(q, kc, vc, table, lens, scale)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))


def _varlen_impl(backend):
    return reference.flash_attn_varlen if backend == "reference" else _triton().flash_attn_varlen


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("mode", ["off", "on"])
def test_varlen_cu_seqlens_past_the_end_are_cut(backend, mode):
    """cu_seqlens past the tensors' ends: each sequence is cut at the end (the same as
    cu_seqlens ending there, bit for bit), decreasing entries make empty sequences (the
    running maximum), and the cut result matches independent loops."""
    torch.manual_seed(21)
    hq, hk, d = 2, 1, 32
    tq, tk = 20, 24
    q, k, v = (torch.randn(t, h, d).half() for t, h in ((tq, hq), (tk, hk), (tk, hk)))
    impl = _varlen_impl(backend)

    def call(cu_q, cu_k, max_q=20, max_k=24):
        cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
        return impl(q, k, v, cu_q, cu_k, max_q, max_k, d**-0.5, True, fp8=mode)

    cut = call([0, 8, 20], [0, 10, 24])
    assert torch.equal(call([0, 8, 20 + 10**6], [0, 10, 24 + 7]), cut)
    assert torch.equal(call([-5, 8, 20], [0, 10, 10**6]), cut)
    # Decreasing: [0, 8, 3, 15] acts as [0, 8, 8, 15]: sequence 1 empty, rows 15.. zero.
    assert torch.equal(call([0, 8, 3, 15], [0, 10, 2, 24]), call([0, 8, 8, 15], [0, 10, 10, 24]))
    if mode == "off":
        cu_q, cu_k = torch.tensor([0, 8, 20], dtype=torch.int32), torch.tensor([0, 10, 24], dtype=torch.int32)
        _close(cut, naive_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, d**-0.5, True), torch.float16, "cut")


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend", _both_backends())
def test_varlen_nan_outside_sequences_never_reaches_outputs(backend):
    """Rows past cu_seqlens[B] (and keys of a sequence without queries) hold NaN: the
    outputs are bit-equal to the clean call (the bf16/fp16 path: fp8 quantisation reads
    every element for its amax)."""
    torch.manual_seed(22)
    q, k, v = torch.randn(20, 2, 32).half(), torch.randn(30, 1, 32).half(), torch.randn(30, 1, 32).half()
    cu_q, cu_k = torch.tensor([0, 7, 7, 15], dtype=torch.int32), torch.tensor([0, 9, 20, 26], dtype=torch.int32)
    args = (cu_q, cu_k, 8, 11, 32**-0.5, True)
    clean = _varlen_impl(backend)(q, k, v, *args)
    qd, kd, vd = q.clone(), k.clone(), v.clone()
    qd[15:], kd[26:], vd[26:] = float("nan"), float("nan"), float("nan")
    kd[9:20], vd[9:20] = float("nan"), float("inf")  # sequence 1 has no query
    dirty = _varlen_impl(backend)(qd, kd, vd, *args)
    assert torch.isfinite(dirty).all() and torch.equal(dirty, clean)


def test_debug_switch_names_the_broken_precondition():
    """With graphsafe.debug_checks on: cu_seqlens past the end, decreasing, a length over
    max_seqlen_q, and a block id out of range in a request's length raise InputError."""
    case = case_for("flash_attn_varlen")
    q, k, v, cu_q, cu_k, mq, mk, scale, causal = case.inputs(case.example, "cpu", 0)[:9]
    tail = (scale, causal)
    past_end = cu_q.clone()
    past_end[3] = q.shape[0] + 1
    broken = [
        ("cu_seqlens_q", "rows of the packed tensor", (past_end, cu_k, mq, mk)),
        ("cu_seqlens_k", "non-decreasing", (cu_q, torch.tensor([0, 9, 4, 17], dtype=torch.int32), mq, mk)),
        ("cu_seqlens_q", "max_seqlen_q", (cu_q, cu_k, mq - 1, mk)),
    ]
    with graphsafe.debug_checks(True):
        graphsafe.flash_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, *tail)
        for arg, match, (cq, ck, xq, xk) in broken:
            with pytest.raises(InputError, match=f"'{arg}'.*{match}"):
                graphsafe.flash_attn_varlen(q, k, v, cq, ck, xq, xk, *tail)
        dq, kc, vc, table, lens, dscale = _decode_inputs()
        table[1, 3] = -2
        with pytest.raises(InputError, match="'block_table'.*-2"):
            graphsafe.paged_attention_decode(dq, kc, vc, table, lens, dscale)
        table[1, 3] = -1
        graphsafe.paged_attention_decode(dq, kc, vc, table, lens, dscale)


def test_split_plan_uses_shapes_only():
    """The plan is a function of (B, Hk, capacity, SMs): no seq_lens argument exists, so a
    graph captured at short lengths keeps a valid plan for long ones (vLLM #51119)."""
    for b, hk, cap, sms in ((1, 8, 4096, 132), (64, 8, 4096, 132), (128, 8, 32768, 132), (1, 1, 64, 132)):
        s = plan.num_kv_splits(b, hk, cap, sms, 64)
        assert 1 <= s <= plan.MAX_SPLITS
        assert s == 1 or math.ceil(cap / 64) // s >= plan.MIN_TILES_PER_SPLIT
    assert plan.num_kv_splits(1, 8, 4096, 132, 64) == 16  # 4096 tokens: 64 tiles of 4
    assert plan.num_kv_splits(64, 8, 4096, 132, 64) == 2  # 512 programs -> 1024 >= 4 x 132
    assert plan.num_kv_splits(128, 8, 4096, 132, 64) == 1
    assert plan.num_kv_splits(0, 8, 4096, 132, 64) == 1


@needs_triton
def test_decode_workspace_helper_is_exact():
    reset_workspace_managers()
    case = case_for("paged_attention_decode")
    params = {**case.example, "B": 1, "Hk": 1, "block_size": 8, "max_blocks": 16, "seq_lens": [100]}
    args = case.inputs(params, "cpu", 0)
    b, hq, _ = args[0].shape
    assert paged_attention_decode_workspace(b, hq, 1, args[2].shape[3], 16, 8, device="cpu") == []  # reference
    with graphsafe.use_backend("triton"):  # the helper sizes for the backends that may serve
        specs = paged_attention_decode_workspace(b, hq, 1, args[2].shape[3], 16, 8, device="cpu")
        assert plan_decode_splits(b, 1, 16, 8, "cpu") > 1 and specs
        graphsafe.paged_attention_decode(*args)
        op_bytes = graphsafe.get_op("paged_attention_decode").workspace_bytes(b, hq, 1, args[2].shape[3], 16, 8,
                                                                             device="cpu")
    stats = current_workspace_manager("cpu").stats()
    assert stats.requests.get("paged_attention_decode") == 1
    assert stats.peak_request_bytes == workspace_bytes(*specs)
    assert op_bytes == workspace_bytes(*specs)


# -- varlen: kernels vs reference --------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize(
    "config,mode",
    [(c, "off") for c in ((16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1), (128, 64, 8, 1), (64, 128, 4, 1))]
    + [(c, "on") for c in ((16, 32, 4, 1), (128, 64, 8, 1))],
)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_kernel_block_configs(config, mode, causal):
    """Causal block skipping and the unmasked/masked split with BLOCK_M != BLOCK_N,
    including the GPU configs; lengths straddle block edges. In fp8 ("on") the key
    frame is aligned to 16 tokens: sequences 2 and 3 start at keys 140 and 204 (lead
    12), so they get a masked lead block before their unmasked run."""
    case = case_for("flash_attn_varlen")
    params = {**case.example, "causal": causal, "max_q": 70, "max_k": 140, "lens_q": [70, 1, 33],
              "lens_k": [140, 64, 20], "mode": mode}
    args = case.inputs(params, "cpu", 5)
    expected = reference.flash_attn_varlen(*args)
    actual = _triton().flash_attn_varlen(*args, config=config)
    fp8 = mode == "on"
    vmax = args[2].abs().max().item() * (1 + 2**-4 if fp8 else 1)
    attention_compare(expected, actual, vmax, torch.float16, fp8, args[2].shape[0] if fp8 else 0, f"config {config}")


@needs_triton
def test_varlen_kernel_mla_head_dims():
    """D=192 (two dots of 128 + 64) and Dv=128, GQA 4."""
    case = case_for("flash_attn_varlen")
    params = {**case.example, "Hk": 1, "group": 4, "D": 192, "Dv": 128, "max_q": 20, "max_k": 24,
              "lens_q": [20, 3, 0], "lens_k": [24, 3, 5]}
    args = case.inputs(params, "cpu", 9)
    for mode in ("off", "on"):
        call = (*args[:12], mode)
        expected, actual = reference.flash_attn_varlen(*call), _triton().flash_attn_varlen(*call)
        vmax = args[2].abs().max().item() * (1 + 2**-4)
        attention_compare(expected, actual, vmax, torch.float16, mode == "on", args[2].shape[0], f"mla {mode}")


def _quantise_with_kernels(q, k, v):
    """The fp8 path's quantisation launches on their own: prepare (reset the slots),
    amax of q/k/v in one launch, k and V^T in one launch."""
    from graphsafe.ops.attention.kernels import triton_quant as Q

    tk, hk, d = k.shape
    k8 = torch.full((tk, hk, d), float("nan"), dtype=torch.float32).to(FP8_DTYPE)  # poison
    vt = torch.full((hk, v.shape[2], Q.vt_columns(tk)), 3.0).to(FP8_DTYPE)  # poison, padding too
    scales = torch.full((Q.SCALE_SLOTS,), 123.0)  # poison: the prepare kernel must reset the slots
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    cu = torch.zeros(1, dtype=torch.int32)
    _triton().prepare_fp8_quantisation(q, k, v, cu)(q, k, v, cu, out, k8, vt, scales)
    return k8, vt, scales


@pytest.mark.nonfinite
@needs_triton
@pytest.mark.parametrize("tokens", [16, 37])
def test_quantisation_kernels_are_bit_exact(tokens):
    """The Triton per-tensor amax and quantisation equal torch's, also on values where the
    interpreter's own fp32 -> e4m3 cast is wrong (carries into the next binade,
    subnormals, ties to even); V^T is v transposed with zeroed padding columns."""
    from graphsafe.ops.attention.kernels import triton_quant as Q

    special = torch.tensor(
        [448.0, 31.8, 15.9, 0.00117, 2**-10, 3 * 2**-10, 2**-9 * 1.5, 17.0, 19.0, -31.9, 0.0, 240.0, 232.0, 247.9, -0.0,
         -1.1875]
    )
    spread = torch.randn(tokens * 64 - 16) * torch.exp2(torch.randint(-20, 5, (tokens * 64 - 16,)).float())
    x = torch.cat([special, spread]).reshape(tokens, 4, 16).half().float()
    for dtype in (torch.float16, torch.bfloat16):
        src = x.to(dtype)
        big = torch.randn(tokens, 4, 2, 24).to(dtype) * 3  # strided k: [T, 4, 16] of a wider tensor
        k = big[:, :, 0, :16]
        q = torch.randn(tokens + 3, 8, 16).to(dtype) * 500
        k8, vt, scales = _quantise_with_kernels(q, k, src)
        want_k, want_kd = quantize_per_tensor(k)
        want_v, want_vd = quantize_per_tensor(src)
        assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(vt[..., :tokens].permute(2, 0, 1).view(torch.uint8), want_v.view(torch.uint8))
        assert torch.equal(vt[..., tokens:].view(torch.uint8), torch.zeros_like(vt[..., tokens:]).view(torch.uint8))
        assert scales[Q.AMAX_Q].item() == q.float().abs().max().item()
        assert scales[Q.DESCALE_K].item() == want_kd.item() and scales[Q.DESCALE_V].item() == want_vd.item()
        assert scales[Q.ONE].item() == 1.0
        # The q copy of the sm_90 Gluon kernel's path, from the amax slot (q strided here).
        q_view = torch.cat([q, q], dim=2)[:, :, :16] if dtype == torch.float16 else q
        q8 = torch.full(q_view.shape, float("nan")).to(FP8_DTYPE)  # poison
        Q.bind_quantize_q(q_view)(q_view, q8, scales)
        want_q, want_qd = quantize_per_tensor(q_view)
        assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8))
        assert scales[Q.DESCALE_Q].item() == want_qd.item()


def _rn32(value: Fraction) -> float:
    """A rational rounded to the nearest float32 (ties to even), exactly."""
    if value == 0:
        return 0.0
    sign, value = (-1 if value < 0 else 1), abs(value)
    e = max(value.numerator.bit_length() - value.denominator.bit_length(), -126)
    if Fraction(2) ** e > value:
        e -= 1
    m = value * Fraction(2) ** (23 - e)
    q, rem = divmod(m.numerator, m.denominator)
    if 2 * rem > m.denominator or (2 * rem == m.denominator and q % 2):
        q += 1
    return sign * float(Fraction(q) / Fraction(2) ** (23 - e))


def test_quantisation_division_is_exact_for_every_bf16():
    """The kernels divide by the descale as q = x * y (y = 1/d correctly rounded), then
    q + fma(x - q * d) * y: this emulation (float64 where it is exact, rationals where
    a double rounding could hide) equals the IEEE float32 quotient for every bf16 x
    over every bf16 amax mantissa (the rounding pattern is scale-free)."""
    import numpy as np

    mantissas = np.arange(128, 256, dtype=np.float64)
    xs = np.concatenate([mantissas * 2.0 ** (e - 7) for e in range(-14, 1)])
    xs = np.concatenate([xs, -xs]).astype(np.float32)
    for amax in (mantissas / 128).astype(np.float32):
        d = np.float32(_rn32(Fraction(float(amax)) / 448))
        y = np.float64(_rn32(1 / Fraction(float(d))))
        x = xs[np.abs(xs) <= amax].astype(np.float64)
        q0 = (x * y).astype(np.float32).astype(np.float64)  # exact product, one rounding
        r = (x - q0 * np.float64(d)).astype(np.float32).astype(np.float64)  # exact difference, one rounding
        ry = r * y  # exact
        total = q0 + ry  # may round: redo the float32 midpoints exactly
        q1 = total.astype(np.float32)
        up = np.nextafter(q1, np.float32(np.inf)).astype(np.float64)
        down = np.nextafter(q1, np.float32(-np.inf)).astype(np.float64)
        q64 = q1.astype(np.float64)
        for i in np.nonzero((total == (q64 + up) / 2) | (total == (q64 + down) / 2))[0]:
            q1[i] = _rn32(Fraction(float(q0[i])) + Fraction(float(ry[i])))
        want = (torch.from_numpy(x.astype(np.float32)) / torch.tensor(d)).numpy()
        assert np.array_equal(q1, want), (amax, x[q1 != want][:4])


@needs_triton
def test_v_transpose_copy_of_fp8_inputs():
    from graphsafe.ops.attention.kernels import triton_quant as Q

    v = torch.randn(21, 2, 2, 32).to(FP8_DTYPE)[:, :, 1]  # strided
    vt = torch.full((2, 32, Q.vt_columns(21)), 3.0).to(FP8_DTYPE)
    cu, out = torch.zeros(1, dtype=torch.int32), torch.empty(21, 2, 32, dtype=torch.bfloat16)
    copy = _triton().prepare_fp8_quantisation(v, v, v, cu, quantize=False)
    copy(v, v, v, cu, out, None, vt, torch.zeros(Q.SCALE_SLOTS))
    assert torch.equal(vt[..., :21].permute(2, 0, 1).view(torch.uint8), v.view(torch.uint8))
    assert not vt[..., 21:].view(torch.uint8).any()


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Measured (CPU, unit-Gaussian q/k/v, scale D^-0.5): relative L2 error of the fp8 path
# against the bf16/fp16 result is about 0.03-0.04; the documented bound is 0.06.
FP8_REL_L2_BOUND = 0.06


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_quantisation_accuracy_reference(causal):
    """The fp8 path's numerics (per-tensor q/k/v quantisation) against the exact result,
    at a prefill-like shape (the reference emulates the quantisation exactly)."""
    torch.manual_seed(11)
    seqs, n, hq, hk, d = 2, 256, 4, 2, 128
    q, k, v = torch.randn(seqs * n, hq, d).bfloat16(), torch.randn(seqs * n, hk, d).bfloat16(), torch.randn(seqs * n, hk, d).bfloat16()
    cu = torch.arange(seqs + 1, dtype=torch.int32) * n
    on = reference.flash_attn_varlen(q, k, v, cu, cu, n, n, d**-0.5, causal, fp8="on")
    off = reference.flash_attn_varlen(q, k, v, cu, cu, n, n, d**-0.5, causal, fp8="off")
    err = _rel_l2(on, off)
    assert 0 < err <= FP8_REL_L2_BOUND, err


@needs_triton
def test_fp8_kernel_accuracy_against_half_reference():
    """The interpreted fp8 kernel (fp8 dots, P cast to fp8) against the fp16 reference."""
    torch.manual_seed(12)
    seqs, n, hq, hk, d = 2, 48, 2, 1, 64
    q, k, v = torch.randn(seqs * n, hq, d).half(), torch.randn(seqs * n, hk, d).half(), torch.randn(seqs * n, hk, d).half()
    cu = torch.arange(seqs + 1, dtype=torch.int32) * n
    off = reference.flash_attn_varlen(q, k, v, cu, cu, n, n, d**-0.5, True, fp8="off")
    fp8 = _triton().flash_attn_varlen(q, k, v, cu, cu, n, n, d**-0.5, True, fp8="on")
    assert _rel_l2(fp8, off) <= FP8_REL_L2_BOUND


# Per-row bias of the fp8 path. Each output row is a softmax-weighted mean of values; the
# e4m3 roundings move a row by zero-mean errors: those of v (relative size up to the unit
# roundoff 2^-4) and, through the weights, those of q and k (up to 2^-4 each), so the
# projection ratio (out . ref) / (ref . ref) of a row stays within 2 * 2^-4 of 1, and its
# mean over the rows (the errors average out) within 2^-4 / 6 (measured: per row 0.93 to
# 1.04, mean 0.997 to 0.998 at these shapes). A systematic 0.97x scale (a wrong descale,
# a P_SCALE slip) moves every ratio by 0.03 and fails the mean bound.
FP8_ROW_RATIO_BAND = 2 * 2.0**-4
FP8_MEAN_RATIO_BAND = 2.0**-4 / 6


def _assert_no_row_bias(out, exact, what):
    out, exact = out.double().reshape(-1, out.shape[-1]), exact.double().reshape(-1, exact.shape[-1])
    norm2 = (exact * exact).sum(-1)
    ratio = (out * exact).sum(-1)[norm2 > 0] / norm2[norm2 > 0]
    worst = (ratio - 1).abs().max().item()
    assert worst <= FP8_ROW_RATIO_BAND, f"{what}: a row's ratio is off by {worst}"
    mean = ratio.mean().item()
    assert abs(mean - 1) <= FP8_MEAN_RATIO_BAND, f"{what}: mean ratio {mean}"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_path_has_no_per_row_bias(backend, causal):
    """The fp8 path ("on") against exact attention, row by row (the relative-L2 bound
    alone lets a 0.97x scale of every output through)."""
    torch.manual_seed(13)
    seqs, n, hq, hk, d = 2, 48, 2, 1, 64
    q, k, v = (torch.randn(seqs * n, h, d).half() for h in (hq, hk, hk))
    cu = torch.arange(seqs + 1, dtype=torch.int32) * n
    exact = naive_varlen(q.float(), k.float(), v.float(), cu, cu, d**-0.5, causal)
    impl = reference if backend == "reference" else _triton()
    out = impl.flash_attn_varlen(q, k, v, cu, cu, n, n, d**-0.5, causal, fp8="on")
    _assert_no_row_bias(out, exact, f"fp8 {backend} causal={causal}")


@needs_triton
def test_fp8_inputs_with_per_sequence_descales():
    case = case_for("flash_attn_varlen")
    params = {**case.example, "mode": "fp8_inputs", "descale": "per_seq"}
    args = case.inputs(params, "cpu", 4)
    expected = reference.flash_attn_varlen(*args)
    q, k, v, cu_q, cu_k, _, _, scale, causal, qd, kd, vd = args[:12]
    loops = naive_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, scale, causal, (qd, kd, vd))
    _close(expected, loops, torch.bfloat16, "fp8-input reference")
    actual = _triton().flash_attn_varlen(*args)
    vmax = (v.float().abs().amax() * vd.abs().amax()).item()
    attention_compare(expected, actual, vmax, torch.bfloat16, True, v.shape[0], "fp8 inputs")


@needs_triton
def test_negative_and_zero_score_scales():
    """The kernel moves a negative scale (or a negative product of descales) into q's sign
    bits and keeps qk_scale > 0; a zero scale gives uniform attention, not NaN."""
    case = case_for("flash_attn_varlen")
    base = case.inputs({**case.example, "mode": "fp8_inputs", "descale": "per_seq"}, "cpu", 6)
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, qd, kd, vd, mode = base[:13]
    qd = qd * torch.tensor([[1.0, -1.0], [-2.0, 1.0], [1.0, 1.0]])  # some products negative
    qh, kh, vh = (x.float().half() for x in (q, k, v))
    for args, fp8 in (
        ((q, k, v, cu_q, cu_k, mq, mk, -scale, causal, qd, kd, vd, mode), True),
        ((qh, kh, vh, cu_q, cu_k, mq, mk, -0.7, causal, None, None, None, "off"), False),
        ((qh, kh, vh, cu_q, cu_k, mq, mk, 0.0, causal, None, None, None, "off"), False),
    ):
        expected = reference.flash_attn_varlen(*args)
        actual = _triton().flash_attn_varlen(*args)
        assert not actual.isnan().any()
        vmax = args[2].float().abs().max().item() * (vd.abs().max().item() if fp8 else 1.0)
        attention_compare(expected, actual, vmax, expected.dtype, fp8, args[2].shape[0] if fp8 else 0, f"scale {args[7]}")


@needs_triton
def test_varlen_workspace_helper_covers_the_fp8_call():
    assert flash_attn_varlen_workspace(100, 120, 8, 2, 128, 128, device="cpu") == []  # the reference serves
    with graphsafe.use_backend("triton"):
        specs = flash_attn_varlen_workspace(100, 120, 8, 2, 128, 128, device="cpu")
        assert workspace_bytes(*specs) >= 120 * 2 * 128 + 2 * 128 * 128  # k in fp8, V^T in fp8 (q: in-kernel)
        assert flash_attn_varlen_workspace(100, 120, 8, 2, 128, 128, fp8=False, device="cpu") == []
        reset_workspace_managers()
        case = case_for("flash_attn_varlen")
        for mode in ("on", "fp8_inputs"):
            args = case.inputs({**case.example, "mode": mode}, "cpu", 0)
            q, k, v = args[:3]
            graphsafe.flash_attn_varlen(*args)
            peak = current_workspace_manager("cpu").stats().peak_request_bytes
            shapes = (q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2])
            assert 0 < peak <= workspace_bytes(*flash_attn_varlen_workspace(*shapes, device="cpu"))


@needs_triton
def test_fp8_probe_kernel_logic_in_the_interpreter():
    """The probe's own kernel and expected values agree (on the GPU it decides 'auto')."""
    from graphsafe.ops.attention.kernels.triton_quant import run_fp8_probe

    assert run_fp8_probe(torch.device("cpu"))


# -- decode variants on the Triton kernel ------------------------------------------------------
def _variant_inputs(seq_lens, seed, **params):
    """Decode inputs (float16, 2 KV heads of 4 query heads, block size 4) as a mutable list."""
    case = case_for("paged_attention_decode")
    max_blocks = params.pop("max_blocks", 8)
    return list(case.inputs({**case.example, "B": len(seq_lens), "seq_lens": seq_lens, "max_blocks": max_blocks,
                             **params}, "cpu", seed))


@pytest.mark.nonfinite
@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_sink_infinities(splits):
    """A sink of -inf changes nothing (bit for bit), +inf gives 0, NaN gives NaN, per
    head; a request without a key stays 0 whatever the sink."""
    args = _variant_inputs([0, 5, 27], 11)
    decode = _triton().paged_attention_decode
    plain = decode(*args, num_splits=splits)
    hq = args[0].shape[1]
    args[10] = torch.full((hq,), float("-inf"))
    assert torch.equal(decode(*args, num_splits=splits), plain)
    args[10] = torch.tensor([float("inf"), float("nan")] * (hq // 2))
    out = decode(*args, num_splits=splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1:, 0::2], torch.zeros_like(out[1:, 0::2]))
    assert out[1:, 1::2].isnan().all()


@pytest.mark.nonfinite
@needs_triton
@pytest.mark.parametrize("splits", [1, 4, 7])
def test_decode_kernel_window_never_reads_before_it(splits):
    """A window of 10 keys at the end of 29 and 61 tokens: with several splits (where
    splits over [0, len) would lie wholly before the window), block-table entries of
    blocks before the window hold junk ids and tokens before it NaN: the output is bit
    for bit the clean call's and matches the reference."""
    from graphsafe.testing.contract import poisoned

    case = case_for("paged_attention_decode")
    params = {**case.example, "B": 2, "seq_lens": [29, 61], "max_blocks": 16, "window_left": 9, "sinks": True}
    args = case.inputs(params, "cpu", 3)
    marks = case.unread(params, args)
    dirty = list(poisoned(args, marks))
    table_before = marks[2][1] & (torch.arange(16)[None, :] < torch.tensor([[4], [12]]))
    assert table_before.sum() == 4 + 12  # entries wholly before the window are among those poisoned
    dirty[3] = torch.where(table_before, torch.tensor([-1, 10**6, 0], dtype=torch.int32).repeat(7)[:16], args[3])
    clean = _triton().paged_attention_decode(*args, num_splits=splits)
    assert torch.equal(_triton().paged_attention_decode(*dirty, num_splits=splits), clean)
    expected = reference.paged_attention_decode(*args)
    attention_compare(expected, clean, args[2].abs().max().item(), torch.float16, False, 0, f"window, {splits} splits")


@needs_triton
@pytest.mark.parametrize("variant", [{"window_left": 5}, {"softcap": 0.5}, {"sinks": True},
                                     {"window_left": 13, "softcap": 4.0, "sinks": True}])
def test_decode_kernel_split_counts_agree_on_variants(variant):
    """One split (sinks in the decode epilogue) and several (sinks in the combine) give
    the reference's result, also with empty splits and an empty request."""
    args = _variant_inputs([0, 3, 22, 32], 4, **variant)
    expected = reference.paged_attention_decode(*args)
    vmax = args[2].abs().max().item()
    for splits in (1, 2, 5, 9):
        actual = _triton().paged_attention_decode(*args, num_splits=splits)
        assert torch.equal(actual[0], torch.zeros_like(actual[0]))
        attention_compare(expected, actual, vmax, torch.float16, False, 0, f"{variant}, {splits} splits")


@pytest.mark.nonfinite
@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_softcap_of_infinite_scores(splits):
    """Softcap maps +-inf scores to +-c: a query with +inf in one component over keys
    whose component is positive (+inf scores) or negative (-inf) gives finite weights,
    the reference's; without the softcap the +inf scores make the row NaN."""
    args = _variant_inputs([7, 20], 8, softcap=2.0)
    q, k_cache = args[0].clone(), args[1].clone()
    q[:, :, 0] = float("inf")
    k_cache[..., 0] = k_cache[..., 0].abs() + 0.1
    k_cache[::2, :, :, 0] = -k_cache[::2, :, :, 0]  # every other block: -inf scores
    args[0], args[1] = q, k_cache
    out = _triton().paged_attention_decode(*args, num_splits=splits)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_decode(*args)
    attention_compare(expected, out, args[2].abs().max().item(), torch.float16, False, 0, f"softcap, {splits} splits")
    args[9] = 0.0
    assert _triton().paged_attention_decode(*args, num_splits=splits).isnan().any()
