"""Semantics of the MLA attention ops (`mla_decode`, `sparse_mla`) on the CPU.

The reference is checked against a plain per-request loop; the Triton kernels (through
the interpreter) against the reference with forced split counts, empty splits, empty
rows; unread cache rows holding NaN, padding and out-of-range ids (never wrapping around)
and non-finite inputs on both backends; the same over fp8_ds_mla caches (uint8 records:
the loop spec dequantizes each record it reads, 0xFF bytes poison unread records, the
input checks of this cache kind, its kernel variants compiled for sm_90); and the split
planner and workspace sizing against their contract (shapes only).
"""

from __future__ import annotations

import inspect
import math

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.testing import case_for
import graphsafe
from graphsafe import device_info
from graphsafe.formats.fp8_ds_mla import dequantize_records, quantize_records, record_bytes
from graphsafe.ops.mla import mla_decode_workspace_specs, sparse_mla_workspace_specs
from graphsafe.ops.mla import reference as ref
from graphsafe.ops.mla import plan as mla_plan
from graphsafe.ops.mla import triton as tri
from graphsafe.ops.mla.kernels import triton_split_kv as split_kv
from graphsafe.testing import contract as C
from graphsafe.testing.compile_scripts import SPECIALISE_PRELUDE
from graphsafe.ops.mla import cases as cases

CPU = torch.device("cpu")


# -- an independent spec: loops over requests, float64 --------------------------------------
def _attend_rows(q: torch.Tensor, rows: torch.Tensor, scale: float, r: int):
    """q [H, D], rows [n, D] -> out [H, R] f64, lse [H] f64 (0 and -inf without rows)."""
    h = q.shape[0]
    if rows.shape[0] == 0:
        return torch.zeros(h, r, dtype=torch.float64), torch.full((h,), -math.inf, dtype=torch.float64)
    s = scale * q.double() @ rows.double().T
    m = s.max(dim=1, keepdim=True).values
    w = torch.exp(s - m)
    lse = m[:, 0] + torch.log(w.sum(1))
    return (w / w.sum(1, keepdim=True)) @ rows.double()[:, :r], lse


def _key_rows(kv_cache, entries: list[tuple[int, int]], r: int, width: int) -> torch.Tensor:
    """The key rows [n, width] of the cache entries (block, offset), one by one: an
    fp8_ds_mla cache's records dequantized (`dequantize_records`, the format's spec)."""
    rows = [kv_cache[blk, off] for blk, off in entries]
    if not rows:
        return torch.zeros((0, width), dtype=torch.float64)
    if kv_cache.dtype == torch.uint8:
        return torch.stack([dequantize_records(row, r) for row in rows])
    return torch.stack(rows)


def naive_decode(q, kv_cache, block_table, seq_lens, scale, r):
    nb, bs = kv_cache.shape[:2]
    capacity = block_table.shape[1] * bs
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = max(0, min(int(seq_lens[b]), capacity))
        blocks = [int(block_table[b, j // bs]) for j in range(n)]
        entries = [(blk, j % bs) for j, blk in enumerate(blocks) if 0 <= blk < nb]  # padding: no key
        rows = _key_rows(kv_cache, entries, r, q.shape[2])
        o, l = _attend_rows(q[b], rows, scale, r)
        outs.append(o)
        lses.append(l)
    h = q.shape[1]
    return (
        torch.stack(outs).to(q.dtype) if outs else q.new_zeros((0, h, r)),
        torch.stack(lses).float() if lses else torch.zeros((0, h)),
    )


def naive_sparse(q, kv_cache, indices, scale, r, attn_sink=None, topk_length=None):
    nb, bs = kv_cache.shape[:2]
    outs, lses = [], []
    for t in range(q.shape[0]):
        used = indices[t].tolist()
        if topk_length is not None:
            used = used[: max(0, int(topk_length[t]))]
        entries = [(s // bs, s % bs) for s in used if 0 <= s < nb * bs]
        rows = _key_rows(kv_cache, entries, r, q.shape[2])
        o, l = _attend_rows(q[t], rows, scale, r)
        if attn_sink is not None and entries:
            o = o * torch.sigmoid(l - attn_sink.double())[:, None]
        outs.append(o)
        lses.append(l)
    h = q.shape[1]
    return (
        torch.stack(outs).to(q.dtype) if outs else q.new_zeros((0, h, r)),
        torch.stack(lses).float() if lses else torch.zeros((0, h)),
    )


def _check(expected, actual, args=None):
    """No NaN, and `compare_attention` (its fp8_ds_mla lse tolerance where `args` hold such
    a cache: a kernel against the exact float32 rows; none between exact computations)."""
    out, lse = actual
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the result"
    cases.compare_attention(expected, actual, args, args, None)


@given(params=cases._params_decode(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=15)
def test_reference_decode_matches_the_loop_spec(params, seed):
    args = case_for("mla_decode").inputs(params, CPU, seed)
    _check(naive_decode(*args), ref.mla_decode(*args))


@given(params=cases._params_sparse(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=15)
def test_reference_sparse_matches_the_loop_spec(params, seed):
    args = case_for("sparse_mla").inputs(params, CPU, seed)
    _check(naive_sparse(*args), ref.sparse_mla(*args))


# -- Triton (interpreter) against the reference ---------------------------------------------
LONG = {"B": 4, "H": 3, "R": 32, "P": 16, "block_size": 16, "max_blocks": 6, "dtype": torch.float16, "lens": "random", "strided": True}


def _decode_args(dtype, lens, seed=0, **over):
    params = {**LONG, "dtype": dtype, **over}
    q, kv, bt, _, scale, r = case_for("mla_decode").inputs(params, CPU, seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    # The block table's garbage must sit exactly past the new lengths.
    num_blocks = kv.shape[0]
    gen = torch.Generator().manual_seed(seed)
    bt = cases.make_block_table(params, lens, num_blocks, gen)
    return q, kv, bt, lens, scale, r


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 6])
def test_triton_decode_with_forced_splits(dtype, num_splits):
    # lengths: empty, one token, shorter than one split, one block past a split edge, full
    args = _decode_args(dtype, [0, 1, 9, 96])
    out, lse = tri.mla_decode(*args, num_splits=num_splits)
    _check(ref.mla_decode(*args), (out, lse))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all(), "empty request: 0, -inf"


# The 64-head GPU tiles hold the value columns as two chunks (value_chunks=2); the same
# code path at interpreter-sized tiles, with R a multiple of the chunk (32), a ragged one
# (24: the second chunk partly masked) and R = 16 (the second chunk all padding).
CHUNKED = mla_plan.KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, value_chunks=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("r,p", [(32, 16), (24, 8), (16, 0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_with_value_chunks(dtype, r, p, num_splits):
    args = _decode_args(dtype, [0, 1, 9, 96], R=r, P=p, H=17)
    out, lse = tri.mla_decode(*args, config=CHUNKED, num_splits=num_splits)
    _check(ref.mla_decode(*args), (out, lse))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_sparse_with_value_chunks(dtype):
    params = {**cases.EXAMPLE_SPARSE, "T": 3, "K": 70, "R": 24, "P": 8, "num_blocks": 8, "dtype": dtype, "strided": True}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, 4)[:5]
    idx[1] = -1
    out, lse = tri.sparse_mla(q, kv, idx, scale, r, config=CHUNKED, num_splits=2)
    _check(ref.sparse_mla(q, kv, idx, scale, r), (out, lse))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("num_splits", [1, 4, 7])
def test_triton_sparse_with_forced_splits(num_splits):
    params = {**cases.EXAMPLE_SPARSE, "T": 4, "K": 100, "num_blocks": 8, "dtype": torch.bfloat16, "strided": True}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, 3)[:5]
    idx[1] = -1  # a token without any key
    idx[2, 30:] = -1  # the later splits of a token hold no key
    out, lse = tri.sparse_mla(q, kv, idx, scale, r, num_splits=num_splits)
    _check(ref.sparse_mla(q, kv, idx, scale, r), (out, lse))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def test_all_rows_empty_with_splits_gives_zero_and_minus_inf():
    args = _decode_args(torch.float16, [0, 0, 0, 0])
    for n in (1, 6):
        out, lse = tri.mla_decode(*args, num_splits=n)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, kv, _, _, scale, r = args
    idx = torch.full((3, 40), -1, dtype=torch.int32)
    out, lse = tri.sparse_mla(q[:3], kv, idx, scale, r, num_splits=3)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lengths_past_capacity_are_clamped_and_negative_mean_empty(backend):
    q, kv, bt, _, scale, r = _decode_args(torch.float16, [96, 0, 96, 0])
    run = C.run_backend
    spec = graphsafe.get_op("mla_decode")
    a = run(spec, backend, (q, kv, bt, torch.tensor([96, 0, 96, 0], dtype=torch.int32), scale, r))
    b = run(spec, backend, (q, kv, bt, torch.tensor([500, -7, 2**31 - 1, -(2**31)], dtype=torch.int32), scale, r))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_single_key_returns_its_first_R_entries(op, backend):
    """Softmax over one key is 1: out = the row's value part, lse = the scaled score."""
    gen = torch.Generator().manual_seed(1)
    h, r, p, bs = 4, 32, 16, 4
    q = torch.randn(2, h, r + p, generator=gen).half()
    kv = torch.randn(3, bs, r + p, generator=gen).half()
    scale = 0.3
    if op == "mla_decode":
        args = (q, kv, torch.tensor([[2, 0], [1, 7]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), scale, r)
        rows = kv[torch.tensor([2, 1]), 0]
    else:
        args = (q, kv, torch.tensor([[-1, 9, -1], [5, -1, 99]], dtype=torch.int32), scale, r)
        rows = kv[torch.tensor([9 // bs, 5 // bs]), torch.tensor([9 % bs, 5 % bs])]
    out, lse = C.run_backend(graphsafe.get_op(op), backend, args)
    assert torch.equal(out, rows[:, None, :r].expand_as(out))
    expected = scale * torch.einsum("thd,td->th", q.float(), rows.float())
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lse_is_natural_log_and_merges_disjoint_key_sets(backend):
    """Attention over A u B = LSE-weighted merge of attention over A and over B."""
    params = {**cases.EXAMPLE_SPARSE, "T": 3, "K": 48, "num_blocks": 16, "invalid": 0.0, "dtype": torch.float16}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, 5)[:5]
    idx = torch.stack([torch.randperm(kv.shape[0] * kv.shape[1])[:48] for _ in range(3)]).int()
    spec = graphsafe.get_op("sparse_mla")
    left, right = idx.clone(), idx.clone()
    left[:, 24:] = -1
    right[:, :24] = -1
    o, l = C.run_backend(spec, backend, (q, kv, idx, scale, r))
    o1, l1 = C.run_backend(spec, backend, (q, kv, left, scale, r))
    o2, l2 = C.run_backend(spec, backend, (q, kv, right, scale, r))
    torch.testing.assert_close(l, torch.logaddexp(l1, l2), rtol=1e-5, atol=1e-5)
    merged = torch.exp(l1 - l)[..., None] * o1.float() + torch.exp(l2 - l)[..., None] * o2.float()
    torch.testing.assert_close(o.float(), merged, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_duplicate_slots_count_once_per_occurrence(backend):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 48, generator=gen).half()
    kv = torch.randn(2, 4, 48, generator=gen).half()
    idx = torch.tensor([[3, 3, 6, -1]], dtype=torch.int32)
    out, lse = C.run_backend(graphsafe.get_op("sparse_mla"), backend, (q, kv, idx, 0.2, 32))
    a, b = kv[0, 3].float(), kv[1, 2].float()
    sa, sb = 0.2 * q[0].float() @ a, 0.2 * q[0].float() @ b
    wa, wb = 2 * torch.exp(sa), torch.exp(sb)
    expected = (wa[:, None] * a[:32] + wb[:, None] * b[:32]) / (wa + wb)[:, None]
    torch.testing.assert_close(out[0].float(), expected, rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(lse[0], torch.log(wa + wb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sparse_over_the_block_table_slots_equals_decode(backend):
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [5, 0, 40, 96])
    bs = kv.shape[1]
    pos = torch.arange(bt.shape[1] * bs)
    slots = bt[:, pos // bs].long() * bs + pos % bs
    idx = torch.where(pos[None] < lens[:, None], slots, -1).int()
    dense = C.run_backend(graphsafe.get_op("mla_decode"), backend, (q, kv, bt, lens, scale, r))
    sparse = C.run_backend(graphsafe.get_op("sparse_mla"), backend, (q, kv, idx, scale, r))
    _check(dense, sparse)


# -- unread elements, padding ids, non-finite inputs ---------------------------------------
# The reference, and the Triton kernel with one split and with several (the combine).
RUNS = [("reference", None), ("triton", 1), ("triton", 3)]
NAN, INF = float("nan"), float("inf")


def _run(backend, num_splits, op, args):
    if backend == "reference":
        return getattr(ref, op)(*args)
    return getattr(tri, op)(*args, num_splits=num_splits)


def _bits_equal(a, b):
    C.assert_bits_equal(a, b, "outputs")


def _with_unread_block_0(kv):
    """The cache behind one extra block 0 that no request reads (random, finite)."""
    return torch.cat([torch.randn(kv[:1].shape, generator=torch.Generator().manual_seed(7)).to(kv.dtype), kv])


@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_nan_in_block_0_and_in_unread_rows_never_reaches_decode_outputs(backend, num_splits):
    """NaN in block 0 (a `torch.empty` cache, a stale block), in the tail of a request's
    last block and in every other row no request reads changes no output bit."""
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [0, 1, 9, 96])
    kv = _with_unread_block_0(kv)
    used = torch.arange(bt.shape[1])[None, :] * kv.shape[1] < lens[:, None]
    bt = torch.where(used, bt + 1, bt)
    _, _, rows = cases.decode_reads(kv, bt, lens)
    assert not rows[0].any() and (~rows[1:]).any()
    clean = _run(backend, num_splits, "mla_decode", (q, kv, bt, lens, scale, r))
    dirty = kv.clone()
    dirty[~rows] = NAN
    out, lse = _run(backend, num_splits, "mla_decode", (q, dirty, bt, lens, scale, r))
    _bits_equal(clean, (out, lse))
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_nan_in_slot_0_and_in_unread_rows_never_reaches_sparse_outputs(backend, num_splits):
    params = {**cases.EXAMPLE_SPARSE, "T": 3, "K": 40, "num_blocks": 8, "invalid": 0.25}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, 6)[:5]
    kv = _with_unread_block_0(kv)
    idx = torch.where(idx >= 0, idx + kv.shape[1], idx)
    idx[1] = -1  # a token without a key: 0 and -inf whatever q and the cache hold
    _, rows = cases.sparse_reads(kv, idx)
    assert not rows[0].any() and (~rows[1:]).any()
    clean = _run(backend, num_splits, "sparse_mla", (q, kv, idx, scale, r))
    dirty = kv.clone()
    dirty[~rows] = NAN
    dirty_q = q.clone()
    dirty_q[1] = NAN
    out, lse = _run(backend, num_splits, "sparse_mla", (dirty_q, dirty, idx, scale, r))
    _bits_equal(clean, (out, lse))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def _without_padding_blocks(bt, lens, block_size):
    """The same requests with their padding blocks (-1) left out: the remaining blocks in
    order, the length shortened by the positions those blocks covered."""
    table, new_lens = torch.full_like(bt, 12345), lens.clone()
    for b in range(bt.shape[0]):
        n = int(lens[b])
        used = [(int(bt[b, i]), min(block_size, n - i * block_size)) for i in range(-(-n // block_size))]
        kept = [blk for blk, _ in used if blk >= 0]
        table[b, : len(kept)] = torch.tensor(kept, dtype=bt.dtype)
        new_lens[b] = sum(count for blk, count in used if blk >= 0)
    return table, new_lens


@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_a_padding_block_inside_a_request_holds_no_key(backend, num_splits):
    """A -1 block below a request's length equals the request without those positions
    (a dense call over the remaining blocks), and a request of padding blocks only gets
    0 and -inf."""
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [40, 96, 20, 5])
    bs = kv.shape[1]
    bt = bt.clone()
    bt[0, 1] = bt[1, 0] = bt[1, 5] = bt[2, 1] = bt[3, 0] = -1  # middle, first, last, partial last, all
    out, lse = _run(backend, num_splits, "mla_decode", (q, kv, bt, lens, scale, r))
    table, short = _without_padding_blocks(bt, lens, bs)
    assert short.tolist() == [24, 64, 16, 0]
    expected = _run(backend, num_splits, "mla_decode", (q, kv, table, short, scale, r))
    _check(expected, (out, lse))
    _check(naive_decode(q, kv, bt, lens, scale, r), (out, lse))
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()


@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_negative_and_huge_ids_never_wrap_around(backend, num_splits):
    """-2 (Python indexing: the second-last block or slot), int32 min, 10**6 and
    num_blocks act exactly as -1, even with NaN in the blocks a wrap would reach."""
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [40, 96, 20, 5])
    nb, bs = kv.shape[:2]
    kv = torch.cat([kv, torch.full_like(kv[:2], NAN)])  # blocks nb, nb + 1: never read
    padded = bt.clone()
    padded[0, 1] = padded[1, 0] = padded[2, 1] = padded[3, 0] = -1
    bad = padded.clone()
    bad[0, 1], bad[1, 0], bad[2, 1], bad[3, 0] = -2, -(2**31), 10**6, nb + 2
    expected = _run(backend, num_splits, "mla_decode", (q, kv, padded, lens, scale, r))
    _bits_equal(expected, _run(backend, num_splits, "mla_decode", (q, kv, bad, lens, scale, r)))
    assert not expected[0].isnan().any()

    idx = torch.where(torch.arange(40)[None, :] < 30, torch.randint(0, nb * bs, (3, 40)), -1).int()
    bad_idx = idx.clone()
    bad_idx[:, 30:] = torch.tensor([-2, -(2**31), 10**6, (nb + 2) * bs, -bs - 1] * 2, dtype=torch.int32)
    expected = _run(backend, num_splits, "sparse_mla", (q[:3], kv, idx, scale, r))
    _bits_equal(expected, _run(backend, num_splits, "sparse_mla", (q[:3], kv, bad_idx, scale, r)))
    assert not expected[0].isnan().any()


def _same_nonfinite_places(expected, actual, args=None):
    for e, a in zip(expected, actual):
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(e.float()), test(a.float())), f"{test.__name__} places differ"
    # Elsewhere within tolerance: NaN out entries and NaN lse zeroed (lse keeps its -inf).
    finite = [(torch.nan_to_num(out, nan=0.0), torch.where(lse.isnan(), 0.0, lse)) for out, lse in (expected, actual)]
    cases.compare_attention(finite[0], finite[1], args, args, None)


@pytest.mark.nonfinite
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nonfinite_keys_and_queries_give_the_reference_places_across_splits(num_splits):
    """NaN in q or a read row, or a +inf score: NaN out and lse for that head; a -inf score
    adds 0 * value (NaN where the value is infinite); requests without keys stay 0, -inf."""
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [0, 30, 70, 96])
    q, kv = q.clone(), kv.clone()
    q[1, 0, 3] = NAN  # head 0 of request 1
    q[0, :, :] = NAN  # a request without keys
    kv[int(bt[2, 0]), 5, 1] = INF  # value column 1 of a key of request 2: +inf or -inf scores
    kv[int(bt[3, 5]), 2, r + 1] = -INF  # rope column of a key of request 3 (last split)
    expected = ref.mla_decode(q, kv, bt, lens, scale, r)
    actual = tri.mla_decode(q, kv, bt, lens, scale, r, num_splits=num_splits)
    out, lse = expected
    assert out[1, 0].isnan().all() and lse[1, 0].isnan() and not lse[1, 1:].isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    positive = (q[2, :, 1] > 0)  # score +inf: NaN; score -inf: weight 0, 0 * inf = NaN in column 1
    assert lse[2][positive].isnan().all() and not lse[2][~positive].isnan().any()
    assert out[2][~positive][:, 1].isnan().all() and not out[2][~positive][:, 2:].isnan().any()
    assert lse[3][q[3, :, r + 1] < 0].isnan().all() and not out[3][q[3, :, r + 1] > 0].isnan().any()
    _same_nonfinite_places(expected, actual)


def test_debug_switch_names_the_bad_id():
    q, kv, bt, lens, scale, r = _decode_args(torch.float16, [40, 96, 20, 5])
    with graphsafe.debug_checks(True):
        good = bt.clone()
        good[0, 1] = -1
        graphsafe.mla_decode(q, kv, good, lens, scale, r)  # padding, garbage past the lengths: fine
        bad = good.clone()
        bad[2, 1] = -2
        with pytest.raises(graphsafe.InputError, match=r"mla_decode.*'block_table'.*-2 at index \[2, 1\]"):
            graphsafe.mla_decode(q, kv, bad, lens, scale, r)
        with pytest.raises(graphsafe.InputError, match=r"mla_decode.*'seq_lens'.*at most 96"):
            graphsafe.mla_decode(q, kv, good, torch.tensor([40, 97, 20, 5], dtype=torch.int32), scale, r)
        idx = torch.tensor([[3, -1, kv.shape[0] * kv.shape[1]]], dtype=torch.int32)
        with pytest.raises(graphsafe.InputError, match=r"sparse_mla.*'indices'.*at index \[0, 2\]"):
            graphsafe.sparse_mla(q[:1], kv, idx, scale, r)
    graphsafe.mla_decode(q, kv, bad, lens, scale, r)  # switch off: -2 is padding, no error


def test_decode_over_concat_and_cache_mla_matches_attention_on_the_tokens():
    """End to end: write the latent cache with concat_and_cache_mla, then decode."""
    gen = torch.Generator().manual_seed(4)
    r, p, bs, h = 32, 16, 4, 4
    lens = [7, 3]
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    kv_cache = torch.randn(6, bs, r + p, generator=gen).half()
    kv_c = torch.randn(sum(lens), r, generator=gen).half()
    k_pe = torch.randn(sum(lens), p, generator=gen).half()
    slots = torch.tensor([int(table[b, j // bs]) * bs + j % bs for b, n in enumerate(lens) for j in range(n)])
    graphsafe.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots)
    q = torch.randn(2, h, r + p, generator=gen).half()
    with graphsafe.use_backend("triton"):
        out, lse = graphsafe.mla_decode(q, kv_cache, table, torch.tensor(lens, dtype=torch.int32), 0.15, r)
    keys = torch.cat([kv_c, k_pe], dim=1)
    starts = [0, lens[0]]
    expected = [_attend_rows(q[b], keys[starts[b] : starts[b] + lens[b]], 0.15, r) for b in range(2)]
    _check((torch.stack([e[0] for e in expected]).half(), torch.stack([e[1] for e in expected]).float()), (out, lse))


def test_decode_step_compiles_fullgraph_with_triton_kernels():
    """concat_and_cache_mla + mla_decode under torch.compile(fullgraph=True), Triton backend."""
    params = {**LONG, "strided": False}
    q, kv, bt, lens, scale, r = case_for("mla_decode").inputs(params, CPU, 9)
    kv_c, k_pe = torch.randn(4, r).half(), torch.randn(4, kv.shape[2] - r).half()
    slots = torch.tensor([3, 17, -1, 40])

    def step(q, kv_c, k_pe, kv, slots, bt, lens):
        graphsafe.concat_and_cache_mla(kv_c, k_pe, kv, slots)
        return graphsafe.mla_decode(q, kv, bt, lens, scale, r)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    with graphsafe.use_backend("triton"):
        kv_eager, kv_compiled = kv.clone(), kv.clone()
        expected = step(q, kv_c, k_pe, kv_eager, slots, bt, lens)
        actual = compiled(q, kv_c, k_pe, kv_compiled, slots, bt, lens)
    assert torch.equal(kv_eager, kv_compiled)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])


# -- fp8_ds_mla caches (uint8 records: e4m3 latent, float32 tile scales, bf16 rope) -------
FP8 = {"cache": cases.FP8_DS}  # with dtype bfloat16


@given(params=cases._params_decode(fp8_only=True), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10)
def test_reference_fp8_ds_decode_matches_the_loop_over_dequantized_rows(params, seed):
    args = case_for("mla_decode").inputs(params, CPU, seed)
    assert args[1].dtype == torch.uint8 and args[1].shape[2] == record_bytes(params["R"], params["P"])
    _check(naive_decode(*args), ref.mla_decode(*args))


@given(params=cases._params_sparse(fp8_only=True), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10)
def test_reference_fp8_ds_sparse_matches_the_loop_over_dequantized_rows(params, seed):
    args = case_for("sparse_mla").inputs(params, CPU, seed)
    _check(naive_sparse(*args), ref.sparse_mla(*args))


def test_fp8_ds_rows_are_the_dequantized_records_exactly():
    """A single key: out is its dequantized latent (rounded to bf16 once), lse its
    float32 score: the op reads the record as `dequantize_records` does, tile scales
    included (R = 256: two tiles of different scales)."""
    gen = torch.Generator().manual_seed(3)
    r, p = 256, 16
    kv_c = torch.randn(8, r, generator=gen) * torch.tensor([1.0] * 128 + [20.0] * 128)
    kv = quantize_records(kv_c, torch.randn(8, p, generator=gen)).view(2, 4, -1)
    q = torch.randn(2, 3, r + p, generator=gen).bfloat16()
    rows = dequantize_records(kv[torch.tensor([1, 0]), torch.tensor([2, 3])], r)
    for backend in ("reference", "triton"):
        idx = torch.tensor([[6, -1], [-1, 3]], dtype=torch.int32)
        out, lse = C.run_backend(graphsafe.get_op("sparse_mla"), backend, (q, kv, idx, 0.1, r))
        assert torch.equal(out, rows[:, None, :r].bfloat16().expand_as(out)), backend
        expected = 0.1 * torch.einsum("thd,td->th", q.float(), rows)
        tol = 1e-5 if backend == "reference" else cases.FP8_DS_LSE_TOLERANCE[1]  # the kernel's bf16 rows
        torch.testing.assert_close(lse, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("r,p", [(128, 16), (256, 32)])
@pytest.mark.parametrize("num_splits", [1, 2, 6])
def test_triton_fp8_ds_decode_with_forced_splits_and_padding_blocks(r, p, num_splits):
    args = _decode_args(torch.bfloat16, [0, 1, 9, 96], R=r, P=p, **FP8)
    q, kv, bt, lens, scale, r = args
    bt = bt.clone()
    bt[2, 0] = bt[3, 2] = -1  # padding blocks inside requests
    args = (q, kv, bt, lens, scale, r)
    out, lse = tri.mla_decode(*args, num_splits=num_splits)
    _check(ref.mla_decode(*args), (out, lse), args)
    _check(naive_decode(*args), (out, lse), args)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all(), "empty request: 0, -inf"


@pytest.mark.parametrize("r", [128, 256])
def test_triton_fp8_ds_decode_with_value_chunks(r):
    """Two value chunks: halves of one scale tile (R = 128) or one tile each (R = 256)."""
    args = _decode_args(torch.bfloat16, [0, 1, 9, 96], R=r, P=16, H=17, **FP8)
    out, lse = tri.mla_decode(*args, config=CHUNKED, num_splits=3)
    _check(ref.mla_decode(*args), (out, lse), args)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_triton_fp8_ds_sparse_with_forced_splits(num_splits, chunks):
    params = {**cases.EXAMPLE_SPARSE_FP8_DS, "T": 4, "K": 70, "R": 256, "P": 32, "num_blocks": 8, "strided": True}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, 3)[:5]
    idx[1] = -1  # a token without any key
    idx[2, 30:] = -1  # the later splits of a token hold no key
    args = (q, kv, idx, scale, r)
    config = CHUNKED if chunks == 2 else None
    out, lse = tri.sparse_mla(*args, config=config, num_splits=num_splits)
    _check(ref.sparse_mla(*args), (out, lse), args)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def _fp8_with_unread_block_0(kv, r, p):
    """An fp8_ds_mla cache (R = r, P = p) behind one extra block 0 of valid records that
    no request reads."""
    gen = torch.Generator().manual_seed(7)
    block = quantize_records(torch.randn(kv.shape[1], r, generator=gen), torch.randn(kv.shape[1], p, generator=gen))
    return torch.cat([block[None], kv])


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_poisoned_unread_fp8_ds_records_never_reach_outputs(backend, num_splits):
    """0xFF bytes (NaN latent bytes, NaN scales, NaN rope) in block 0, in the tail of a
    request's last block and in every other record no key reads change no output bit,
    dense and sparse; out-of-range ids act as -1 (nothing read, nothing wrapped)."""
    q, kv, bt, lens, scale, r = _decode_args(torch.bfloat16, [0, 1, 9, 96], R=128, P=16, strided=False, **FP8)
    kv = _fp8_with_unread_block_0(kv, 128, 16)
    used = torch.arange(bt.shape[1])[None, :] * kv.shape[1] < lens[:, None]
    bt = torch.where(used, bt + 1, bt)
    bt[3, 1] = -1
    _, _, rows = cases.decode_reads(kv, bt, lens)
    assert not rows[0].any() and (~rows[1:]).any()
    clean = _run(backend, num_splits, "mla_decode", (q, kv, bt, lens, scale, r))
    dirty = kv.clone()
    dirty[~rows] = 0xFF
    bad = bt.clone()
    bad[3, 1] = 10**6
    out, lse = _run(backend, num_splits, "mla_decode", (q, dirty, bad, lens, scale, r))
    _bits_equal(clean, (out, lse))
    assert not out.isnan().any() and not lse.isnan().any()

    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(kv.shape[1], kv.numel() // kv.shape[2], (3, 40), generator=gen)  # none in block 0
    idx = torch.where(torch.rand(3, 40, generator=gen) < 0.3, -1, slots).int()
    _, rows = cases.sparse_reads(kv, idx)
    clean = _run(backend, num_splits, "sparse_mla", (q[:3], kv, idx, scale, r))
    dirty = kv.clone()
    dirty[~rows] = 0xFF
    bad_ids = torch.tensor([-2, -(2**31), 10**6, kv.numel() // kv.shape[2]])  # the last: one past the end
    bad_idx = torch.where(idx < 0, bad_ids[torch.arange(40) % 4], idx).int()
    out, lse = _run(backend, num_splits, "sparse_mla", (q[:3], dirty, bad_idx, scale, r))
    _bits_equal(clean, (out, lse))
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.nonfinite
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nonfinite_fp8_ds_records_give_the_reference_places(num_splits):
    """A latent written with an inf reads back a NaN tile: every head of the requests
    reading that key gets NaN out and lse; a -inf rope value gives +-inf scores by q's
    sign (NaN for +inf; weight 0 for -inf); a NaN scale byte pattern makes its tile NaN."""
    q, kv, bt, lens, scale, r = _decode_args(torch.bfloat16, [0, 30, 70, 96], R=128, P=16, **FP8)
    q, kv = q.clone(), kv.clone()
    q[2, 0, r + 1], q[2, 1, r + 1] = 1.0, -1.0  # both signs against the -inf rope value
    latent = dequantize_records(kv[int(bt[1, 0]), 5], r)
    latent[7] = INF
    kv[int(bt[1, 0]), 5] = quantize_records(latent[None, :r], latent[None, r:])[0]
    rope_at = r + 4 * (r // 128) + 2 * 1  # rope value 1
    kv[int(bt[2, 4]), 2, rope_at : rope_at + 2] = torch.tensor([-INF], dtype=torch.bfloat16).view(torch.uint8)
    kv[int(bt[3, 3]), 0, r : r + 4] = torch.tensor([NAN]).view(torch.uint8)  # the scale of tile 0
    expected = ref.mla_decode(q, kv, bt, lens, scale, r)
    actual = tri.mla_decode(q, kv, bt, lens, scale, r, num_splits=num_splits)
    out, lse = expected
    assert out[1].isnan().all() and lse[1].isnan().all(), "a NaN tile: NaN for every head"
    assert out[3].isnan().all() and lse[3].isnan().all(), "a NaN scale: NaN for every head"
    positive = q[2, :, r + 1] < 0  # -inf rope times a negative q: +inf score, NaN
    assert positive.any() and (~positive).any()
    assert lse[2][positive].isnan().all() and not lse[2][~positive].isnan().any()
    assert not out[2][~positive].isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    _same_nonfinite_places(expected, actual, (q, kv))


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_fp8_ds_cache_checks_name_the_argument(op):
    """A uint8 cache is an fp8_ds_mla cache: the record size, R, P, q's dtype and the
    records' alignment are checked, with the argument named."""
    spec = graphsafe.get_op(op)
    example = cases.EXAMPLE_DECODE_FP8_DS if op == "mla_decode" else cases.EXAMPLE_SPARSE_FP8_DS
    q, kv, *rest = case_for(spec.name).inputs(example, CPU, 0)[:6 if op == "mla_decode" else 5]
    ids, scale, r = rest[:-2], rest[-2], rest[-1]
    spec.public(q, kv, *ids, scale, r)  # the valid call
    gapped = torch.zeros((*kv.shape[:2], kv.shape[2] + 2), dtype=torch.uint8)[..., :-2]  # token stride 166
    refused = [
        ((q.half(), kv, *ids, scale, r), r"'q' must be of dtype bfloat16 when 'kv_cache' is uint8"),
        ((q, kv[..., :-4], *ids, scale, r), r"'kv_cache' must be of shape .*fp8_ds_mla record.* = \[\?, \?, 164\]"),
        ((q, gapped, *ids, scale, r), r"'kv_cache' must be of 4-byte aligned records \(block and token strides"),
        ((q[..., :-1], kv, *ids, scale, r), r"'q' must be of last dim R \+ P with P .* even.*got P = 15"),
        ((q, kv, *ids, scale, 64), r"'kv_lora_rank' must be a multiple of 128 when 'kv_cache' is uint8.*got 64"),
    ]
    for args, match in refused:
        with pytest.raises(graphsafe.InputError, match=rf"graphsafe\.{op}: argument {match}"):
            spec.public(*args)


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_fp8_ds_cache_storage_offset_is_checked_on_every_triton_call(op):
    """The storage offset is no part of a call's signature (validated at its first call
    only): the Triton runner, whose kernel loads the scales as float32, checks it per call."""
    spec = graphsafe.get_op(op)
    example = cases.EXAMPLE_DECODE_FP8_DS if op == "mla_decode" else cases.EXAMPLE_SPARSE_FP8_DS
    q, kv, *rest = case_for(spec.name).inputs(example, CPU, 0)
    shifted = torch.empty(kv.numel() + 2, dtype=torch.uint8)[2:].view(kv.shape).copy_(kv)
    match = rf"graphsafe\.{op}: argument 'kv_cache' must be of 4-byte aligned records \(a storage offset.*offset 2"
    with graphsafe.use_backend("triton"):
        with pytest.raises(graphsafe.InputError, match=match):  # the first call of the signature: the check
            spec.public(q, shifted, *rest)
        spec.public(q, kv, *rest)
        with pytest.raises(graphsafe.InputError, match=match):  # a later one: the runner
            spec.public(q, shifted, *rest)


# -- split planning and workspace -----------------------------------------------------------
@given(
    rows=st.integers(0, 300),
    heads=st.sampled_from([1, 16, 64, 128]),
    capacity=st.integers(0, 200_000),
    block_n=st.sampled_from([16, 32, 64]),
    sms=st.sampled_from([1, 2, 78, 132, 304]),
    min_tokens=st.sampled_from([1, 128]),
)
def test_split_plan_covers_the_capacity_with_nonempty_splits(rows, heads, capacity, block_n, sms, min_tokens):
    head_tiles = -(-heads // 16)
    plan = mla_plan.plan_kv_splits(
        rows=rows, head_tiles=head_tiles, kv_capacity=capacity, block_n=block_n, num_sms=sms, min_tokens_per_split=min_tokens
    )
    assert 1 <= plan.num_splits <= mla_plan.MAX_SPLITS
    assert plan.tokens_per_split % block_n == 0 and plan.tokens_per_split > 0
    assert plan.num_splits * plan.tokens_per_split >= capacity, "every key position belongs to a split"
    if capacity > 0:
        assert (plan.num_splits - 1) * plan.tokens_per_split < capacity, "no split starts past the capacity"
    if plan.num_splits > 1:
        assert plan.tokens_per_split >= min(min_tokens, capacity) - block_n


def test_planner_reads_shapes_only():
    """The plan is a function of shapes and the SM count: no tensor reaches it."""
    for fn in (mla_plan.plan_kv_splits, mla_plan.plan_launch, mla_decode_workspace_specs, sparse_mla_workspace_specs):
        for name, param in inspect.signature(fn).parameters.items():
            assert "len" not in name or name == "max_kv_len", f"{fn.__name__} takes {name}"
            assert param.annotation not in (torch.Tensor, "torch.Tensor", "Tensor"), f"{fn.__name__}({name})"


@pytest.mark.parametrize("rows,heads,capacity", [(64, 16, 8192), (128, 16, 32768), (64, 128, 8192), (64, 16, 2048), (128, 128, 4096)])
def test_gpu_plans_fill_whole_waves_at_the_bench_shapes(rows, heads, capacity):
    """Equal-length programs on num_sms * ctas_per_sm slots: no straggling last wave."""
    cfg = mla_plan.kernel_config(heads, "cuda")
    tiles = -(-heads // cfg.block_h)
    plan = mla_plan.plan_kv_splits(
        rows=rows, head_tiles=tiles, kv_capacity=capacity, block_n=cfg.block_n, num_sms=132, ctas_per_sm=cfg.ctas_per_sm
    )
    programs, slots = rows * tiles * plan.num_splits, 132 * cfg.ctas_per_sm
    assert programs / (-(-programs // slots) * slots) >= 0.9, (plan, programs, slots)
    assert programs >= 0.9 * slots, "the GPU is filled"


def test_plan_splits_a_lone_long_request_across_the_gpu():
    plan = mla_plan.plan_kv_splits(rows=1, head_tiles=1, kv_capacity=32768, block_n=32, num_sms=132, ctas_per_sm=2)
    assert plan.num_splits >= 100 and plan.tokens_per_split >= mla_plan.MIN_TOKENS_PER_SPLIT


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_workspace_request_is_the_published_worst_case(op):
    from graphsafe.workspace import current_workspace_manager
    from graphsafe.workspace import manager as wm

    spec = graphsafe.get_op(op)
    if op == "mla_decode":
        args = _decode_args(torch.float16, [3, 0, 50, 96])
        b, h, r, cap = args[0].shape[0], args[0].shape[1], args[5], args[2].shape[1] * args[1].shape[1]
        published = mla_decode_workspace_specs(b, h, r, cap, device="cpu", backend="triton")
        with graphsafe.use_backend("triton"):
            assert mla_decode_workspace_specs(b, h, r, cap, device="cpu") == published
            assert spec.workspace_bytes(batch=b, num_heads=h, kv_lora_rank=r, max_kv_len=cap, device="cpu") > 0
    else:
        params = {**cases.EXAMPLE_SPARSE, "K": 64}
        args = case_for(spec.name).inputs(params, CPU, 0)
        t, h, r, k = args[0].shape[0], args[0].shape[1], args[4], args[2].shape[1]
        published = sparse_mla_workspace_specs(t, h, r, k, device="cpu", backend="triton")
    assert published, "these shapes split on the CPU planner"
    requests = []
    original = wm.WorkspaceManager.get_simultaneous

    def spy(self, *specs, owner="unnamed"):
        requests.append((owner, [(tuple(s), d) for s, d in specs]))
        return original(self, *specs, owner=owner)

    ws = current_workspace_manager(CPU)
    ws.reserve(*published)
    wm.WorkspaceManager.get_simultaneous = spy
    try:
        with ws.locked():  # the reserved worst case suffices: no growth
            for seed in range(2):
                call = C.clone_args(args)
                if op == "mla_decode":  # other lengths, same plan
                    call = (*call[:3], torch.tensor([[3, 0, 50, 96], [1, 0, 17, 2]][seed], dtype=torch.int32), *call[4:])
                C.run_backend(spec, "triton", call)
    finally:
        wm.WorkspaceManager.get_simultaneous = original
    assert requests == [(op, published)] * 2


def test_many_head_tiles_follow_the_shared_memory_of_the_device():
    """64x64 tiles in two value chunks where the device offers Hopper's 227 KiB; the older
    64x16 tiles on 163 KiB (A100); 16-head tiles on consumer GPUs and MI300 (64 KiB).
    Head counts up to 32 never depend on it."""
    wide = mla_plan.kernel_config(128, "cuda", 232448)
    assert (wide.block_h, wide.block_n, wide.num_warps, wide.num_stages, wide.value_chunks) == (64, 64, 8, 2, 2)
    assert mla_plan.kernel_config(128, "cuda") == wide, "unknown shared memory: a Hopper-class GPU"
    assert (mla_plan.kernel_config(128, "cuda", 166912).block_h, mla_plan.kernel_config(128, "cuda", 166912).block_n) == (64, 16)
    assert mla_plan.kernel_config(128, "cuda", 65536).block_h == 16
    for heads in (1, 16, 32):
        assert mla_plan.kernel_config(heads, "cuda", 65536) == mla_plan.kernel_config(heads, "cuda", 232448)
    assert mla_plan.max_shared_memory(torch.device("cpu")) is None


class _StandInKernel:
    """Stands in for a JIT kernel of (q, kv, SPARSE, SPLIT, CHECK_IDS): `graphsafe.launch.bind` binds it
    (CPU tensors: every call is the plain `kernel[grid]` launch), and the launch records its
    pipeline depth, then raises what `fail(num_stages)` returns, as a compile would."""

    def __init__(self, name, fail=lambda stages: None):
        def fn(q_ptr, kv_ptr, SPARSE, SPLIT, CHECK_IDS):
            pass

        self.fn, self.name, self.fail, self.calls = fn, name, fail, []

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages=None, **kw):
            self.calls.append(num_stages)
            exc = self.fail(num_stages)
            if exc is not None:
                raise exc

        return launch


_VARIANT = {"SPARSE": False, "SPLIT": True, "CHECK_IDS": False}
_WHERE = ("cuda", torch.bfloat16, 576)


def test_launch_drops_a_stage_when_shared_memory_runs_out(monkeypatch):
    """A Triton that allocates more shared memory than the config assumes gets one stage
    fewer (same tiles, so the same split plan and workspace): the bound launch fails at its
    first call (the compile), is bound again and relaunched; the depth is remembered per
    variant for later bindings."""
    from triton.runtime import OutOfResources

    fits = {"stages": 1}
    kernel = _StandInKernel("attn", lambda n: OutOfResources(240000, 232448, "shared") if n > fits["stages"] else None)
    monkeypatch.setattr(split_kv, "mla_attn_kernel", kernel)
    monkeypatch.setattr(tri, "_STAGES", {})
    cfg = mla_plan.KernelConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, value_chunks=2)
    x = torch.zeros(4)
    launch = tri._triton_launch((1,), (x, x), _VARIANT, cfg, _WHERE)
    launch(x, x)
    launch(x, x)
    assert kernel.calls == [3, 2, 1, 1], "retries down to one stage once, then launches with it directly"
    assert tri._STAGES == {(cfg, *_WHERE, tuple(sorted(_VARIANT.items()))): 1}
    kernel.calls.clear()
    tri._triton_launch((1,), (x, x), _VARIANT, cfg, _WHERE)(x, x)
    assert kernel.calls == [1], "a later binding of the variant starts from the depth that compiled"
    monkeypatch.setattr(tri, "_STAGES", {})
    fits["stages"] = 0  # not even one stage fits: the error reaches the caller
    with pytest.raises(OutOfResources):
        tri._triton_launch((1,), (x, x), _VARIANT, cfg, _WHERE)(x, x)


def _stand_in_kernel_module(monkeypatch, kernel: str, module) -> None:
    """`plan.kernel_module(kernel)` (the choice and the runner ask it) answers `module`."""
    real = mla_plan.kernel_module

    def stand_in(name):
        return module if name == kernel else real(name)

    monkeypatch.setattr(mla_plan, "kernel_module", stand_in)
    monkeypatch.setattr(tri, "kernel_module", stand_in)


def _stand_in_kernels(monkeypatch, gluon, attn):
    """The MLA runner with stand-ins for its Gluon kernel (`gluon`) and Triton kernel
    (`attn`), and no failure or pipeline depth remembered yet."""
    import types

    monkeypatch.setattr(split_kv, "mla_attn_kernel", attn)
    module = types.SimpleNamespace(mla_attn_wgmma_kernel=gluon, NUM_WARPS=8, IDS_UNCHECKED=0, IDS_CHECKED=1,
                                   IDS_PER_PROGRAM=2)
    _stand_in_kernel_module(monkeypatch, "gluon_wgmma", module)
    monkeypatch.setattr(tri, "_GLUON_FAILED", set())
    monkeypatch.setattr(tri, "_STAGES", {})


def test_gluon_compile_failure_warns_once_and_runs_the_triton_kernel(monkeypatch):
    """The Gluon kernel compiles at the first call of its binding: a failure there (nothing
    launched) warns once, is remembered per variant, and the Triton kernel runs that call
    and the later ones; calls whose q or cache is not 16-byte aligned run the Triton kernel.
    (A dense call: the Gluon kernel's one launch, the Triton kernel's two.)"""
    import warnings

    gluon = _StandInKernel("gluon", lambda n: RuntimeError("PassManager::run failed"))
    attn = _StandInKernel("attn")
    _stand_in_kernels(monkeypatch, gluon, attn)
    cfg = mla_plan.kernel_config(128, "cuda")
    x = torch.zeros(64)
    bind = lambda: tri._attention_launch((1,), (x, x), _VARIANT, _VARIANT, cfg, _WHERE, True, True, True)  # noqa: E731

    launch = bind()
    launch(x[1:], x)  # misaligned q: the Triton kernel, the Gluon one is not tried
    assert (len(gluon.calls), len(attn.calls)) == (0, 2)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        launch(x, x)
    assert (len(gluon.calls), len(attn.calls)) == (1, 4), "the failed compile launched nothing: Triton ran the call"
    assert tri._GLUON_FAILED == {(*_WHERE, tuple(sorted({**_VARIANT, "CHECK_IDS": 2}.items())))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch(x, x)
        bind()(x, x)  # a new binding of the variant: the Triton kernel at once, no warning
    assert (len(gluon.calls), len(attn.calls)) == (1, 8)


@pytest.mark.parametrize("one_launch", [True, False])
def test_dense_calls_launch_the_gluon_kernel_once_for_short_splits(monkeypatch, one_launch):
    """A dense call on the Gluon kernel: one launch checking ids per program
    (IDS_PER_PROGRAM) where `one_dense_launch`, else two (IDS_UNCHECKED, then IDS_CHECKED);
    sparse calls launch once (IDS_UNCHECKED: their slots are checked per key). The rule:
    at most ONE_LAUNCH_MAX_TILES key tiles a program."""
    runs = []

    def bind(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record the launches
        return lambda *tensors: runs.append(("gluon" if kernel is gluon else "triton", kw["CHECK_IDS"]))

    gluon, attn = object(), object()
    monkeypatch.setattr(tri, "bind", bind)
    _stand_in_kernels(monkeypatch, gluon, attn)
    cfg = mla_plan.kernel_config(128, "cuda")
    x = torch.zeros(64)
    tri._attention_launch((1,), (x, x), _VARIANT, _VARIANT, cfg, _WHERE, True, True, one_launch)(x, x)
    assert runs == ([("gluon", 2)] if one_launch else [("gluon", 0), ("gluon", 1)]), runs
    runs.clear()
    sparse = {**_VARIANT, "SPARSE": True}
    tri._attention_launch((1,), (x, x), sparse, sparse, cfg, _WHERE, True, False, one_launch)(x, x)
    assert runs == [("gluon", 0)], runs
    runs.clear()
    tri._attention_launch((1,), (x, x), _VARIANT, _VARIANT, cfg, _WHERE, False, True, one_launch)(x, x)
    assert runs == [("triton", False), ("triton", True)], "the Triton kernel: always two launches"
    most = mla_plan.ONE_LAUNCH_MAX_TILES
    for tokens, one in ((most * cfg.block_n, True), (most * cfg.block_n + 1, False), (cfg.block_n, True)):
        assert mla_plan.one_dense_launch(mla_plan.SplitPlan(1, tokens), cfg) == one, tokens


def test_a_gluon_compile_failure_stays_with_its_variant(monkeypatch):
    """The memo of a failed Gluon compile holds the whole variant: a failure of sparse_mla
    with an attention sink sends only that variant to the Triton kernel; the same shape
    without the sink still runs the Gluon kernel."""
    gluon, attn, runs = object(), object(), []

    def bind(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record which kernel runs which variant
        def launch(*tensors):
            runs.append(("gluon" if kernel is gluon else "triton", kw["HAS_SINK"]))
            if kernel is gluon and kw["HAS_SINK"]:
                raise RuntimeError("PassManager::run failed")  # the sink variant does not compile
        return launch

    monkeypatch.setattr(tri, "bind", bind)
    _stand_in_kernels(monkeypatch, gluon, attn)
    cfg = mla_plan.kernel_config(128, "cuda")
    x = torch.zeros(64)
    with_sink, plain = ({**_VARIANT, "SPARSE": True, "HAS_SINK": sink} for sink in (True, False))
    with pytest.warns(RuntimeWarning, match="did not compile"):
        tri._attention_launch((1,), (x, x), with_sink, with_sink, cfg, _WHERE, True, False, False)(x, x)
    tri._attention_launch((1,), (x, x), plain, plain, cfg, _WHERE, True, False, False)(x, x)
    tri._attention_launch((1,), (x, x), with_sink, with_sink, cfg, _WHERE, True, False, False)(x, x)
    assert runs == [("gluon", True), ("triton", True), ("gluon", False), ("triton", True)], runs
    assert tri._GLUON_FAILED == {(*_WHERE, tuple(sorted(with_sink.items())))}


def test_heads_go_on_n_for_fp8_records_up_to_16_heads():
    """The Gluon kernel's HEADS_ON_N variant (keys on wgmma's M, heads on its N): fp8_ds_mla
    records with up to 16 heads; 16-bit caches and more heads keep the 64-row head tiles."""
    for heads in (1, 8, 16):
        assert mla_plan.heads_on_n(heads, True) and not mla_plan.heads_on_n(heads, False)
    for heads in (17, 64, 128):
        assert not mla_plan.heads_on_n(heads, True)


def test_direct_calls_reuse_one_runner_per_signature_and_overrides(monkeypatch):
    """Direct calls with the same signature and overrides reuse one prepared runner."""
    args = _decode_args(torch.float16, [3, 0, 50, 96])
    prepares = []
    original = tri.prepare_mla_decode
    monkeypatch.setattr(tri, "prepare_mla_decode", lambda *a, **k: prepares.append(k) or original(*a, **k))
    first = tri.mla_decode(*args, num_splits=3)
    second = tri.mla_decode(*args, num_splits=3)
    assert torch.equal(first[0], second[0]) and len(prepares) == 1
    tri.mla_decode(*args, num_splits=2)
    assert len(prepares) == 2


def test_kernel_config_tiles_are_legal_dot_shapes():
    for heads in (1, 16, 17, 32, 64, 128):
        for dev in ("cpu", "cuda"):
            cfg = mla_plan.kernel_config(heads, dev)
            assert cfg.block_h >= 16 and cfg.block_n >= 16
            assert cfg.block_h & (cfg.block_h - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0


# -- GPU compilation, without a GPU ------------------------------------------------
# (SPECIALISE_PRELUDE: the launcher's specialisation of a recorded launch, and wgmma_shapes.)

# Records the launches the Triton wrappers make at DeepSeek dims with the GPU tile
# configs (the kernels never run), then compiles each for sm_90 with the launcher's own
# specialisation (pointers and ints divisible by 16, ints equal to 1 as constants).
# The launcher's kernels, recorded instead of run (the scripts below call the wrappers).
_RECORD_LAUNCHES = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
import torch
from graphsafe.ops.mla import plan as mla_plan, triton as tri
from graphsafe.ops.mla.kernels import triton_split_kv as split_kv

launches = []

def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record each launch, run nothing
    def launch(*tensors):  # the call's tensors take the placeholders' places
        it = iter(tensors)
        launches.append((kernel, tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args), dict(kw)))
    return launch

tri.bind = record
"""

_COMPILE_SCRIPT = _RECORD_LAUNCHES + SPECIALISE_PRELUDE + r"""
for heads in (16, 128):
    cfg = mla_plan.kernel_config(heads, "cuda")
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    kv = torch.randn(64, 64, 576, dtype=torch.bfloat16)
    table = torch.arange(64, dtype=torch.int32).view(2, 32)
    lens = torch.full((2,), 2048, dtype=torch.int32)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, config=cfg, num_splits=4)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, config=cfg, num_splits=1)
    idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
    tri.sparse_mla(q, kv, idx, 0.04, 512, config=cfg, num_splits=2)
seen = set()
for fn, args, kw in launches:
    key = (fn.__name__, tuple(sorted((k, v) for k, v in kw.items())))
    if key in seen:
        continue
    seen.add(key)
    opts = {"num_warps": kw.pop("num_warps"), "num_stages": kw.pop("num_stages", 2)}
    if kw.get("BLOCK_H") == 64:  # recorded on CPU tensors: what a CUDA tensor turns on
        kw["PREFETCH"] = mla_plan.kernel_config(128, "cuda").l2_prefetch
    k = triton.compile(specialise(fn, args, kw), target=GPUTarget("cuda", 90, 32), options=opts)
    wgmma = "wgmma.mma_async" in k.asm["ptx"]
    print("compiled", fn.__name__, kw.get("BLOCK_H"), kw.get("SPARSE"), kw.get("SPLIT"), "shared", k.metadata.shared, "wgmma", wgmma)
    if fn.__name__ == "mla_attn_kernel" and kw["BLOCK_H"] == 64:
        assert wgmma, "64-head tiles must use wgmma"
        # The default no longer prefetches into L2 (measured slower on an H200): the PTX
        # carries the prefetch exactly when the config asks for it.
        assert ("prefetch.global.L2" in k.asm["ptx"]) == kw["PREFETCH"], "L2 prefetch as configured"
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared
print("OK")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter never compiles: catch GPU-only errors (types, constexpr misuse,
    ints specialised to 1) and check that the 64-head tiles use wgmma within Hopper's
    227 KiB of shared memory, by compiling the GPU launches for sm_90 with ptxas."""
    out = compile_for_sm90(_COMPILE_SCRIPT, timeout=900)
    # Dense calls launch the kernel twice, without and with the per-key id check.
    assert out.count("compiled mla_attn_kernel") == 10 and "compiled combine_kernel" in out, out


# The fp8_ds_mla variants (DeepSeek's 656-byte records) as the launcher binds them for an
# sm_90 device: hardware e4m3 conversion (FP8_NATIVE, what a CUDA tensor turns on), and
# once the integer decoding of other targets (compiled for sm_80).
_FP8_DS_COMPILE_SCRIPT = _RECORD_LAUNCHES + SPECIALISE_PRELUDE + r"""
from graphsafe.formats.fp8_ds_mla import DEEPSEEK_RECORD_BYTES
TYPES[torch.uint8] = "u8"
for heads in (16, 128):
    cfg = mla_plan.kernel_config(heads, "cuda")
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(64, 64, DEEPSEEK_RECORD_BYTES, dtype=torch.uint8)
    table = torch.arange(64, dtype=torch.int32).view(2, 32)
    lens = torch.full((2,), 2048, dtype=torch.int32)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, config=cfg, num_splits=4)
    idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
    tri.sparse_mla(q, kv, idx, 0.04, 512, config=cfg, num_splits=1)
attn = [(args, kw) for fn, args, kw in launches if fn is split_kv.mla_attn_kernel]
assert all(kw["FP8_DS"] and not kw["FP8_NATIVE"] for _, kw in attn), "CPU tensors: the integer decoding"
assert len(attn) == 6, len(attn)  # per head count: dense without and with the id check, sparse
targets = [(args, {**kw, "FP8_NATIVE": True}, 90) for args, kw in attn]
targets.append((attn[-1][0], dict(attn[-1][1]), 80))
for args, kw, arch in targets:
    opts = {"num_warps": kw.pop("num_warps"), "num_stages": kw.pop("num_stages", 2)}
    k = triton.compile(specialise(split_kv.mla_attn_kernel, args, kw), target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    native = "e4m3x2" in ptx  # cvt.rn.f16x2.e4m3x2: the hardware conversion
    print("compiled sm", arch, kw["BLOCK_H"], kw["SPARSE"], kw["SPLIT"], kw["CHECK_IDS"], "native", native,
          "shared", k.metadata.shared, "wgmma", "wgmma.mma_async" in ptx)
    assert native == kw["FP8_NATIVE"], "hardware e4m3 conversion exactly where asked for"
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    if arch == 90 and kw["BLOCK_H"] == 64:
        assert "wgmma.mma_async" in ptx, "64-head tiles use wgmma"
print("OK")
"""


def test_fp8_ds_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The fp8_ds_mla variants of the attention kernel (DeepSeek's R = 512, P = 64, 16 and
    128 heads, dense and sparse) compile for sm_90 with the hardware e4m3 conversion,
    within Hopper's shared memory, the 64-head tiles on wgmma; the integer decoding of
    other targets compiles for sm_80."""
    out = compile_for_sm90(_FP8_DS_COMPILE_SCRIPT, timeout=900)
    assert out.count("compiled sm 90") == 6 and out.count("compiled sm 80") == 1, out


def _gluon_script_head(kernel_module: str, hopper_ops: str) -> str:
    """The head of a script compiling one of the MLA Gluon kernel modules (`kernel_module`,
    imported as G): NO_BACKEND (the test skips) where this Triton lacks Gluon or the Hopper
    ops the module uses (`hopper_ops`); the module itself is imported outside that guard, so
    an ImportError of its own fails the test. Then torch, the plan (mla_plan), the Triton backend (tri)
    and an empty `launches` list."""
    return f"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia.hopper import {hopper_ops}
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.mla.kernels import {kernel_module} as G
import torch
from graphsafe.ops.mla import plan as mla_plan, triton as tri
from graphsafe.ops.mla.kernels import triton_split_kv as split_kv

launches = []
"""


# graphsafe.launch.bind as the compile scripts replace it: each call of a binding of KERNEL
# records its arguments (the call's tensors in the placeholders' places), nothing runs.
_RECORDING_BIND = r"""
def record(kernel, grid, *args, **kw):
    def launch(*tensors):
        it = iter(tensors)
        if kernel is KERNEL:
            launches.append((tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args), dict(kw)))
    return launch

tri.bind = record
mla_plan.warpgroup_split_fits = lambda *a: True
"""


_GLUON_COMPILE_SCRIPT = _gluon_script_head("gluon_wgmma", "async_copy, warpgroup_mma") + r"""

# Record what the launcher binds on an sm_90 device (CPU tensors stand in for CUDA ones);
# the Triton kernels (the combine, the fallback) are compiled by
# test_kernels_compile_for_sm90_without_a_gpu.
KERNEL = G.mla_attn_wgmma_kernel
""" + _RECORDING_BIND + r"""
""" + SPECIALISE_PRELUDE + r"""
cfg = mla_plan.kernel_config(128, "cuda")
# Dense calls: 4 splits of 2048 keys (8 tiles a program) launch once (IDS_PER_PROGRAM), one
# split (32 tiles) twice (IDS_UNCHECKED, IDS_CHECKED): `mla_plan.one_dense_launch`.
for dtype, dense_splits in ((torch.bfloat16, (4, 1)), (torch.float16, (4,))):
    q = torch.randn(2, 128, 576, dtype=dtype)
    kv = torch.randn(64, 64, 576, dtype=dtype)
    table = torch.arange(64, dtype=torch.int32).view(2, 32)
    lens = torch.full((2,), 2048, dtype=torch.int32)
    for num_splits in dense_splits:
        tri.mla_decode(q, kv, table, lens, 0.04, 512, config=cfg, num_splits=num_splits)
    idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
    tri.sparse_mla(q, kv, idx, 0.04, 512, config=cfg, num_splits=1)
# DeepSeek's fp8_ds_mla records (656 bytes a key): the kernel's FP8_DS variant, at 128 heads
# (two launches) and (its default there) at 16 (one launch).
from graphsafe.formats.fp8_ds_mla import DEEPSEEK_RECORD_BYTES
TYPES[torch.uint8] = "u8"
mla_plan.few_heads_wide_tiles = lambda heads, device: cfg  # what an sm_90 device gives up to 16 heads
# (At 128 heads the producer kernel runs records first; this variant is its fallback.)
mla_plan.fp8_producer_fits = lambda *a: False
kv = torch.zeros(64, 64, DEEPSEEK_RECORD_BYTES, dtype=torch.uint8)
for heads, config, num_splits in ((128, cfg, 1), (16, None, 4)):
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, config=config, num_splits=num_splits)
    tri.sparse_mla(q, kv, idx, 0.04, 512, config=config, num_splits=1)
dense_ids = sorted(kw["CHECK_IDS"] for _, kw in launches if not kw["SPARSE"])
want = [G.IDS_UNCHECKED] * 2 + [G.IDS_CHECKED] * 2 + [G.IDS_PER_PROGRAM] * 3
assert dense_ids == [int(x) for x in want], dense_ids
for args, kw in launches:
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.mla_attn_wgmma_kernel, args, kw, GluonASTSource), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    fp8 = args[1].dtype == torch.uint8
    print("compiled", args[0].dtype, "fp8_ds" if fp8 else "", "SPARSE", kw["SPARSE"], "SPLIT", kw["SPLIT"],
          "CHECK_IDS", kw["CHECK_IDS"], "shared", k.metadata.shared, shapes)
    assert kw.get("FP8_DS", False) == fp8
    # Per 64 keys each warpgroup scores its 32 keys over 576 columns (36 k-steps of 16) and
    # accumulates its 256 value columns over the 64 keys (4 k-steps): no duplicated q.k.
    # (fp8_ds_mla: 128 columns of each working-tile half, 2 x 4 k-steps.) Heads on N (fp8_ds_mla,
    # 16 heads): each warpgroup scores its 8 heads on all 64 keys (N = 8, 36 k-steps) and
    # accumulates 2 x 64 of every 256 value columns of each half for all 16 heads (N = 16,
    # 2 halves x 2 x 4 k-steps).
    assert kw["HEADS_ON_N"] == (fp8 and args[0].shape[1] <= 16), kw["HEADS_ON_N"]
    if kw["HEADS_ON_N"]:
        assert shapes == {"m64n8k16": 36, "m64n16k16": 16}, shapes
    else:
        pv = {"m64n128k16": 8} if fp8 else {"m64n256k16": 4}
        assert shapes == {"m64n32k16": 36, **pv}, shapes
    assert k.metadata.shared <= G.shared_memory_bytes(512, 64, fp8) <= 227 * 1024, k.metadata.shared
    # fp8_ds_mla: the latent bytes convert in hardware (cvt.rn.f16x2.e4m3x2), 16 a thread at a time
    assert ("e4m3x2" in k.asm["ptx"]) == fp8
assert len(launches) == 11, launches
print("OK")
"""


def test_warpgroup_split_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The Gluon kernel (sm_90 only, never run by the interpreter), launched as the MLA
    launcher launches it, compiles for sm_90 with this Triton; each warpgroup issues the
    wgmmas of its own half of the scores and values (no duplicated q.k) and the kernel
    fits Hopper's 227 KiB of shared memory."""
    out = compile_for_sm90(_GLUON_COMPILE_SCRIPT)
    assert out.count("compiled") == 11 and out.count("fp8_ds") == 5, out


_PAGED_COMPILE_SCRIPT = _gluon_script_head("gluon_paged_tma", "mbarrier, tma, warpgroup_mma") + r"""

def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record the paged kernel's launches
    def launch(*tensors):  # the call's tensors take the placeholders' places; descriptors stay
        it = iter(tensors)
        def take(a):
            if isinstance(a, torch.Tensor) or type(a).__name__ == "TensorDescriptor":
                t = next(it)
                return a if type(a).__name__ == "TensorDescriptor" else t
            return a
        if kernel is G.mla_decode_tma_kernel:
            launches.append((tuple(take(a) for a in args), dict(kw)))
    return launch

tri.bind = record
mla_plan.warpgroup_split_fits = lambda *a: True
mla_plan.max_shared_memory = lambda device: 232448  # Hopper's opt-in shared memory per block
""" + SPECIALISE_PRELUDE + r"""
cfg = mla_plan.kernel_config(128, "cuda")
for dtype, page, num_splits in ((torch.bfloat16, 64, 1), (torch.bfloat16, 64, 4), (torch.float16, 128, 4)):
    q = torch.randn(2, 128, 576, dtype=dtype)
    kv = torch.randn(64, page, 576, dtype=dtype)
    table = torch.arange(64, dtype=torch.int32).view(2, 32)
    lens = torch.full((2,), 2048, dtype=torch.int32)
    assert mla_plan.paged_tma_fits(q, kv, cfg, 512, 64)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, config=cfg, num_splits=num_splits)
# R = 256 (value halves of 128 columns: two chunks each)
q = torch.randn(2, 128, 320, dtype=torch.bfloat16)
kv = torch.randn(64, 64, 320, dtype=torch.bfloat16)
assert mla_plan.paged_tma_fits(q, kv, cfg, 256, 64)
tri.mla_decode(q, kv, table, lens, 0.04, 256, config=cfg, num_splits=4)
for args, kw in launches:
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.mla_decode_tma_kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    inits = k.asm["ptx"].count("mbarrier.init")
    print("compiled", args[0].base.dtype, "page", kw["BLOCK_SIZE"], "SPLIT", kw["SPLIT"], "shared", k.metadata.shared, shapes,
          "barriers", inits)
    # Per 64-key tile its warpgroup scores all 576 columns at N = 64 (36 k-steps of 16:
    # eight 64-column value chunks and the rope part), and each warpgroup accumulates its 256
    # value columns of the tile (4 k-steps), for its own tile and the other's.
    r = args[0].shape[1] - 64
    assert shapes == {"m64n64k16": 2 * (r + 64) // 16, f"m64n{r // 2}k16": 2 * 2 * 4}, shapes
    # The cache read in [64, 64] boxes (q in its halves), a barrier each: R / 64 + 1 parts x 2
    # stages, 2 empty, q, landed, a_ready, b_ready, l_ready, a_issued.
    assert list(args[2].block_shape) == [64, G.VALUE_CHUNK] == [64, 64] and list(args[0].block_shape) == [64, r // 2]
    assert inits == (r // 64 + 1) * 2 + 2 + 6, inits
    assert k.metadata.shared <= G.shared_memory_bytes(r, 64) <= 227 * 1024, k.metadata.shared
assert len(launches) == 4, launches  # one launch per call: no id scan, no second launch
print("OK")
"""


def test_paged_tma_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The dense decode's TMA kernel (sm_90 only, never run by the interpreter), launched as
    the MLA launcher launches it (bf16 and fp16, pages of 64 and 128, with and without
    splits, R = 512 and 256), compiles for sm_90 with this Triton: one launch per call, N = 64 q.k wgmmas,
    the cache read in 64-column chunks with a barrier each, and shared memory within the
    estimate `paged_tma_fits` decides by and Hopper's 227 KiB."""
    out = compile_for_sm90(_PAGED_COMPILE_SCRIPT, timeout=900)
    assert out.count("compiled") == 4, out


_FEW_HEADS_COMPILE_SCRIPT = _gluon_script_head("gluon_fp8_few_heads", "async_copy, mbarrier, warpgroup_mma") + r"""

KERNEL = G.mla_fp8_few_heads_kernel
""" + _RECORDING_BIND + r"""
mla_plan.max_shared_memory = lambda device: 232448  # Hopper's opt-in shared memory per block
""" + SPECIALISE_PRELUDE + r"""
from graphsafe.formats.fp8_ds_mla import DEEPSEEK_RECORD_BYTES
TYPES[torch.uint8] = "u8"
cfg = mla_plan.kernel_config(128, "cuda")
mla_plan.few_heads_wide_tiles = lambda heads, device: cfg  # what an sm_90 device gives up to 16 heads
lens = torch.full((2,), 2048, dtype=torch.int32)
for page, num_splits in ((64, 4), (64, 1), (16, 4)):
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4096 // page, page, DEEPSEEK_RECORD_BYTES, dtype=torch.uint8)
    table = torch.arange(4096 // page, dtype=torch.int32).view(2, -1)
    assert mla_plan.few_heads_fp8_fits(q, kv, cfg, 512, 64)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, num_splits=num_splits)
    tri.sparse_mla(q, kv, torch.zeros(2, 64, dtype=torch.int32), 0.04, 512, num_splits=1)  # (not this kernel)
for args, kw in launches:
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.mla_fp8_few_heads_kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    ptx = k.asm["ptx"]
    print("compiled page", kw["BLOCK_SIZE"], "SPLIT", kw["SPLIT"], "shared", k.metadata.shared, shapes)
    # Per 64-key tile the consumer scores 16 heads on all keys (N = 16: the rope part and four
    # 128-column pieces, 4 + 4 x 8 k-steps) and accumulates O^T for the four pieces (2 M-tiles of
    # 64 rows x 4 k-steps each).
    assert shapes == {"m64n16k16": 36 + 32}, shapes
    assert k.metadata.shared <= G.shared_memory_bytes(512, 64) <= 227 * 1024, k.metadata.shared
    # warp-specialised (the partitions set their registers), the latent converted in hardware
    assert "setmaxnreg" in ptx and "e4m3x2" in ptx and "cp.async" in ptx
assert len(launches) == 3, launches  # one launch per dense call, none for sparse_mla
print("OK")
"""


def test_few_heads_fp8_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The warp-specialised fp8_ds_mla kernel (sm_90 only, never run by the interpreter),
    launched as the MLA launcher launches it at 16 heads (pages of 64 and 16, with and
    without splits), compiles for sm_90 with this Triton: one launch per dense call, N = 16
    wgmmas with the keys on M, and shared memory within the estimate the launcher decides
    by and Hopper's 227 KiB."""
    out = compile_for_sm90(_FEW_HEADS_COMPILE_SCRIPT, timeout=900)
    assert out.count("compiled") == 3, out


_PRODUCER_COMPILE_SCRIPT = _gluon_script_head("gluon_fp8_producer", "async_copy, mbarrier, warpgroup_mma") + r"""

KERNEL = G.mla_fp8_producer_kernel
""" + _RECORDING_BIND + r"""
mla_plan.max_shared_memory = lambda device: 232448  # Hopper's opt-in shared memory per block
""" + SPECIALISE_PRELUDE + r"""
from graphsafe.formats.fp8_ds_mla import DEEPSEEK_RECORD_BYTES
TYPES[torch.uint8] = "u8"
lens = torch.full((2,), 2048, dtype=torch.int32)
idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
for heads, page, num_splits in ((128, 64, 4), (64, 16, 1)):
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4096 // page, page, DEEPSEEK_RECORD_BYTES, dtype=torch.uint8)
    table = torch.arange(4096 // page, dtype=torch.int32).view(2, -1)
    cfg = mla_plan.fp8_ds_kernel_config(heads, torch.device("cuda"))
    assert mla_plan.fp8_producer_fits(q, kv, cfg, 512, 64)
    tri.mla_decode(q, kv, table, lens, 0.04, 512, num_splits=num_splits)
    tri.sparse_mla(q, kv, idx, 0.04, 512, num_splits=num_splits)
    tri.sparse_mla(q, kv, idx, 0.04, 512, torch.zeros(heads), lens, num_splits=1)  # sink, topk_length
q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
tri.sparse_mla(q, kv, idx, 0.04, 512, num_splits=1)  # 16 heads: the heads-on-N kernel, not this one
# A 16-bit cache: sparse calls past 16 heads (the producer only copies rows); dense decode
# runs the paged TMA kernel, not this one.
kv16 = torch.zeros(64, 64, 576, dtype=torch.bfloat16)
for heads in (128, 64):
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    cfg = mla_plan.kernel_config(heads, "cuda", 232448)
    assert mla_plan.rows_producer_fits(q, kv16, cfg, 512, 64, True)
    assert not mla_plan.rows_producer_fits(q, kv16, cfg, 512, 64, False)
    tri.sparse_mla(q, kv16, idx, 0.04, 512, num_splits=2)
tri.sparse_mla(torch.randn(2, 128, 576, dtype=torch.bfloat16), kv16, idx, 0.04, 512, torch.zeros(128), lens,
               num_splits=1)  # sink, topk_length
for args, kw in launches:
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.mla_fp8_producer_kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    ptx = k.asm["ptx"]
    print("compiled heads", args[0].shape[1], "page", kw["BLOCK_SIZE"], "SPARSE", kw["SPARSE"], "SPLIT", kw["SPLIT"],
          "FP8", kw["FP8"], "shared", k.metadata.shared, shapes)
    # The 16-bit kernel's products: per 64-key tile each consumer warpgroup scores its 32 keys
    # over 576 columns (36 k-steps) and accumulates its 256 value columns (4 k-steps).
    assert shapes == {"m64n32k16": 36, "m64n256k16": 4}, shapes
    assert k.metadata.shared <= G.shared_memory_bytes(512, 64) <= 227 * 1024, k.metadata.shared
    # warp-specialised (the partitions set their registers); over records the latent converted
    # in hardware, over a 16-bit cache no conversion
    assert "setmaxnreg" in ptx and "cp.async" in ptx
    assert ("e4m3x2" in ptx) == kw["FP8"] == (args[1].dtype == torch.uint8), kw
# one launch per call: records at 64 and 128 heads (none at 16), a 16-bit cache's sparse calls
assert len(launches) == 9, launches
assert sum(not kw["FP8"] for _, kw in launches) == 3
print("OK")
"""


def test_fp8_producer_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The 64-head fp8_ds_mla kernel with a dequantising producer (sm_90 only, never run by
    the interpreter), launched as the MLA launcher launches it at 128 and 64 heads (dense
    decode over pages of 64 and 16, with and without splits; sparse, with the sink and
    `topk_length`), compiles for sm_90 with this Triton: one launch per call, the 16-bit
    kernel's wgmma shapes, and shared memory within the estimate the plan decides by and
    Hopper's 227 KiB (the raw bytes wait inside the stage they become)."""
    out = compile_for_sm90(_PRODUCER_COMPILE_SCRIPT, timeout=900)
    assert out.count("compiled") == 9, out


def test_fp8_producer_fits_records_past_16_heads(monkeypatch):
    """Either op over fp8_ds_mla records runs the producer kernel past 16 heads where the
    64-head Gluon kernel would run, and the plan lists it first, the 64-head kernel (its
    fallback) after; up to 16 heads, a 16-bit cache, fp16 q and other GPUs keep the other kernels."""
    _hopper_stand_ins(monkeypatch)
    cfg = mla_plan.kernel_config(128, "cuda")
    records = _stand_in_tensor(torch.uint8, (64, 64, record_bytes(512, 64)))
    fits = lambda q, kv: mla_plan.fp8_producer_fits(q, kv, cfg, 512, 64)  # noqa: E731
    for heads in (17, 32, 64, 128):
        assert fits(_stand_in_tensor(torch.bfloat16, (2, heads, 576)), records)
    assert fits(_stand_in_tensor(torch.bfloat16, (2, 128, 576)), _stand_in_tensor(torch.uint8, (256, 16, 656)))
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 16, 576)), records)
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 128, 576)), _stand_in_tensor(torch.bfloat16, (64, 64, 576)))
    assert not fits(_stand_in_tensor(torch.float16, (2, 128, 576)), records)
    q = _stand_in_tensor(torch.bfloat16, (2, 128, 576))
    for sparse in (False, True):
        kernels = mla_plan._fitting_kernels(q, records, cfg, 512, 64, sparse)
        assert kernels == (mla_plan.GLUON_FP8_PRODUCER, mla_plan.GLUON_WGMMA, mla_plan.TRITON_SPLIT_KV), kernels
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (10, 0))
    assert not fits(q, records)


def test_rows_producer_fits_sparse_16_bit_calls_past_16_heads(monkeypatch):
    """`sparse_mla` over a 16-bit cache runs the producer kernel (its producer copying rows)
    past 16 heads where the 64-head Gluon kernel would run (bf16 or fp16), the 64-head kernel
    after it (its fallback); dense decode (the paged TMA kernel's), up to 16 heads, records (the
    dequantising producer's own check), `ROWS_PRODUCER` off and other GPUs do not."""
    _hopper_stand_ins(monkeypatch)
    cfg = mla_plan.kernel_config(128, "cuda")
    rows = _stand_in_tensor(torch.bfloat16, (64, 64, 576))
    fits = lambda q, kv, sparse=True: mla_plan.rows_producer_fits(q, kv, cfg, 512, 64, sparse)  # noqa: E731
    for heads in (17, 64, 128):
        assert fits(_stand_in_tensor(torch.bfloat16, (2, heads, 576)), rows)
    q = _stand_in_tensor(torch.bfloat16, (2, 128, 576))
    assert not fits(q, rows, sparse=False)
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 16, 576)), rows)
    assert fits(_stand_in_tensor(torch.float16, (2, 128, 576)), _stand_in_tensor(torch.float16, (64, 64, 576)))
    assert not fits(q, _stand_in_tensor(torch.uint8, (64, 64, record_bytes(512, 64))))
    kernels = mla_plan._fitting_kernels(q, rows, cfg, 512, 64, True)
    assert kernels == (mla_plan.GLUON_FP8_PRODUCER, mla_plan.GLUON_WGMMA, mla_plan.TRITON_SPLIT_KV), kernels
    assert mla_plan.GLUON_FP8_PRODUCER not in mla_plan._fitting_kernels(q, rows, cfg, 512, 64, False)
    monkeypatch.setattr(mla_plan, "ROWS_PRODUCER", False)
    assert not fits(q, rows)
    monkeypatch.setattr(mla_plan, "ROWS_PRODUCER", True)
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (10, 0))
    assert not fits(q, rows)


def test_few_heads_fp8_fits_dense_records_up_to_16_heads(monkeypatch):
    """Dense decode over fp8_ds_mla records runs the warp-specialised kernel up to 16 heads
    (any page size: its producer gathers rows) where the 64-head Gluon kernel would run;
    more heads, a 16-bit cache, fp16 q and other GPUs keep the other kernels."""
    _hopper_stand_ins(monkeypatch)
    cfg = mla_plan.kernel_config(128, "cuda")
    records = _stand_in_tensor(torch.uint8, (64, 64, record_bytes(512, 64)))
    fits = lambda q, kv: mla_plan.few_heads_fp8_fits(q, kv, cfg, 512, 64)  # noqa: E731
    for heads in (1, 8, 16):
        assert fits(_stand_in_tensor(torch.bfloat16, (2, heads, 576)), records)
    assert fits(_stand_in_tensor(torch.bfloat16, (2, 16, 576)), _stand_in_tensor(torch.uint8, (256, 16, 656)))
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 17, 576)), records)
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 16, 576)), _stand_in_tensor(torch.bfloat16, (64, 64, 576)))
    assert not fits(_stand_in_tensor(torch.float16, (2, 16, 576)), records)
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (10, 0))
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 16, 576)), records)


def _hopper_stand_ins(monkeypatch):
    """A stand-in sm_90 device for the fit checks: the capability, Hopper's shared memory,
    no HIP."""
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(mla_plan, "max_shared_memory", lambda device: 232448)
    monkeypatch.setattr(tri.torch.version, "hip", None)


def _stand_in_tensor(dtype, shape, stride=None):
    """A stand-in CUDA tensor of `dtype` and `shape` (contiguous strides unless given): what
    the fit checks read."""
    import types

    stride = stride or tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=shape,
                                 stride=lambda dim=None: stride if dim is None else stride[dim])


def test_paged_tma_fits_only_views_tma_can_read(monkeypatch):
    """The dense decode's TMA kernel takes pages of a multiple of 64 slots, q whose heads
    follow each other and a cache whose pages do (TMA reads each as 2-D rows, padded or
    not); other page sizes, a slice of q's heads, padded pages, an fp8_ds_mla cache and
    other GPUs keep the 64-head Gluon kernel."""
    _hopper_stand_ins(monkeypatch)
    cfg = mla_plan.kernel_config(128, "cuda")
    q = _stand_in_tensor(torch.bfloat16, (2, 128, 576))
    fits = lambda q, kv: mla_plan.paged_tma_fits(q, kv, cfg, 512, 64)  # noqa: E731
    assert fits(q, _stand_in_tensor(torch.bfloat16, (64, 64, 576)))
    assert fits(q, _stand_in_tensor(torch.bfloat16, (32, 128, 576)))
    assert not fits(q, _stand_in_tensor(torch.bfloat16, (256, 16, 576)))  # 64 keys would span 4 pages
    assert not fits(q, _stand_in_tensor(torch.bfloat16, (64, 64, 576), (64 * 576 + 64, 576, 1)))  # padded pages
    kv = _stand_in_tensor(torch.bfloat16, (64, 64, 576))
    assert fits(_stand_in_tensor(torch.bfloat16, (2, 128, 576), (128 * 640, 640, 1)), kv)  # padded heads: rows of 640
    assert not fits(_stand_in_tensor(torch.bfloat16, (2, 128, 576), (256 * 576, 576, 1)), kv)  # 128 of 256 heads
    assert not fits(q, _stand_in_tensor(torch.uint8, (64, 64, record_bytes(512, 64))))
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (10, 0))
    assert not fits(q, _stand_in_tensor(torch.bfloat16, (64, 64, 576)))


def test_few_heads_decode_takes_the_tma_kernels_tiles_and_workspace(monkeypatch):
    """Up to 16 heads, dense decode on sm_90 runs the TMA kernel's 64-head tiles where the
    cache's layout lets it (pages of 64) and keeps its 16-head tiles elsewhere (pages of 16,
    sparse_mla over 16-bit caches, other GPUs); over an fp8_ds_mla cache both ops may run
    them; the published workspaces cover the larger of the two plans."""
    _hopper_stand_ins(monkeypatch)
    monkeypatch.setattr(mla_plan, "num_sms", lambda device: 132)
    mla_plan._plan.cache_clear()
    cuda = torch.device("cuda", 0)
    try:
        wide = mla_plan.few_heads_wide_tiles(16, cuda)
        assert wide is not None and (wide.block_h, wide.block_n, wide.warpgroup_split) == (64, 64, True)
        assert mla_plan.few_heads_wide_tiles(128, cuda) is None  # 128 heads have them anyway
        for batch, ctx in ((1, 8192), (8, 8192), (64, 8192), (64, 32768)):
            _, narrow = mla_plan.plan_launch(batch, 16, ctx, cuda)
            _, broad = mla_plan.plan_launch(batch, 16, ctx, cuda, wide)
            specs = mla_plan.mla_decode_workspace(batch, 16, 512, ctx, cuda)
            assert specs == mla_plan.partial_specs(batch, 16, 512, max(narrow, broad, key=lambda p: p.num_splits))
            # sparse_mla over an fp8_ds_mla cache takes them too (topk = ctx keys)
            specs = mla_plan.sparse_mla_workspace(batch, 16, 512, ctx, cuda)
            assert specs == mla_plan.partial_specs(batch, 16, 512, max(narrow, broad, key=lambda p: p.num_splits))
        monkeypatch.setattr(device_info, "compute_capability", lambda device: (10, 0))
        assert mla_plan.few_heads_wide_tiles(16, cuda) is None
    finally:
        mla_plan._plan.cache_clear()


def test_few_heads_dense_decode_prepares_the_tma_kernels_plan(monkeypatch):
    """The runner of a 16-head dense decode plans with the 64-head tiles when the TMA kernel
    fits the call's signature, with its own tiles when it does not; sparse_mla keeps its own."""
    wide = mla_plan.kernel_config(128, "cuda")
    monkeypatch.setattr(mla_plan, "few_heads_wide_tiles", lambda num_heads, device: wide)
    planned = []
    plan = mla_plan.plan_launch
    monkeypatch.setattr(mla_plan, "plan_launch", lambda *a: planned.append(a[-1]) or plan(*a))
    args = _decode_args(torch.float32, [3, 0, 50, 96])
    for fits in (True, False):
        monkeypatch.setattr(mla_plan, "paged_tma_fits", lambda *a, fits=fits: fits)
        monkeypatch.setattr(tri, "_paged_launch", lambda *a: (lambda *t: None))  # (no sm_90 here: nothing runs)
        tri.prepare_mla_decode(graphsafe.get_op("mla_decode").call(*args))
    own = mla_plan.kernel_config(args[0].shape[1], "cpu")  # (the choice names the head count's own tiles)
    assert planned == [wide, own], planned
    planned.clear()
    q, kv = args[0], args[1]
    tri.prepare_sparse_mla(graphsafe.get_op("sparse_mla").call(
        q, kv, torch.zeros(q.shape[0], 8, dtype=torch.int32), 0.1, args[5]))
    assert planned == [own], planned


def test_few_heads_fp8_ds_prepares_the_64_head_tiles_where_the_gluon_kernel_fits(monkeypatch):
    """Up to 16 heads over an fp8_ds_mla cache, dense and sparse runners plan with the
    64-head tiles when the Gluon kernel fits the call's signature (it dequantises a tile
    once for all heads), with the fp8 cache's own tiles when it does not."""
    wide = mla_plan.kernel_config(128, "cuda")
    monkeypatch.setattr(mla_plan, "few_heads_wide_tiles", lambda num_heads, device: wide)
    monkeypatch.setattr(tri, "bind", lambda *a, **kw: (lambda *t: None))  # (no sm_90 here: nothing runs)
    planned = []
    plan = mla_plan.plan_launch
    monkeypatch.setattr(mla_plan, "plan_launch", lambda *a: planned.append(a[-1]) or plan(*a))
    args = _decode_args(torch.bfloat16, [3, 0, 50, 96], R=128, P=16, **FP8)
    q, kv = args[0], args[1]
    for fits in (True, False):
        monkeypatch.setattr(mla_plan, "warpgroup_split_fits", lambda *a, fits=fits: fits)
        tri.prepare_mla_decode(graphsafe.get_op("mla_decode").call(*args))
        tri.prepare_sparse_mla(graphsafe.get_op("sparse_mla").call(
            q, kv, torch.zeros(q.shape[0], 8, dtype=torch.int32), 0.1, args[5]))
    own = mla_plan.fp8_ds_kernel_config(q.shape[1], q.device)
    assert planned == [wide, wide, own, own], planned


def _failing_bind(monkeypatch, name: str, calls: list, bound: list | None = None) -> None:
    """`tri.bind` stand-in: every kernel it binds fails to compile at its first call (nothing
    launched; `calls` gets `name`); `bound` gets each binding's arguments."""
    def bind(kernel, grid, *args, **kw):
        if bound is not None:
            bound.append((args, kw))

        def launch(*tensors):
            calls.append(name)
            raise RuntimeError("PassManager::run failed")
        return launch

    monkeypatch.setattr(tri, "bind", bind)
    monkeypatch.setattr(tri, "_GLUON_FAILED", set())


def _assert_failure_falls_back(run, make_run, name: str, calls: list) -> None:
    """`run` (a Gluon launch bound by `make_run()` with a fallback appending "fallback" to
    `calls`): a misaligned q runs the fallback without trying the kernel; the first aligned
    call tries it (`name`), warns once and runs the fallback; later calls, and those of a
    launch made again, run the fallback without a warning."""
    import warnings

    x = torch.zeros(64)
    run(x[1:], x, *(x,) * 7)  # misaligned q
    assert calls == ["fallback"]
    with pytest.warns(RuntimeWarning, match="did not compile"):
        run(x, x, *(x,) * 7)
    assert calls == ["fallback", name, "fallback"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(x, x, *(x,) * 7)
        make_run()(x, x, *(x,) * 7)
    assert calls == ["fallback", name, "fallback", "fallback", "fallback"]


def test_paged_kernel_compile_failure_runs_the_other_launch(monkeypatch):
    """The paged kernel compiles at the first call of its binding: a failure there (nothing
    launched) warns once and the 64-head kernels' launch runs that call and the later ones;
    calls whose q or cache is not 16-byte aligned run it without trying the paged kernel."""
    import types

    calls = []
    _failing_bind(monkeypatch, "paged", calls)
    _stand_in_kernel_module(monkeypatch, "gluon_paged_tma", types.SimpleNamespace(
        mla_decode_tma_kernel=object(), tma_descriptors=lambda q, kv, r: (q, q, kv, kv), CONSUMER_REGS=232,
        LOADER_REGS=24, NUM_WARPS=4))
    x = torch.zeros(64)
    fallback = lambda *tensors: calls.append("fallback")  # noqa: E731
    make_run = lambda: tri._paged_launch((1,), x, x, 512, (), 64, False, _WHERE, fallback)  # noqa: E731
    _assert_failure_falls_back(make_run(), make_run, "paged", calls)


def test_producer_kernel_compile_failure_runs_the_other_launch(monkeypatch):
    """The fp8 producer kernel compiles at the first call of its binding: a failure there
    (nothing launched) warns once and the 64-head kernel's launch runs that call and the
    later ones, also those of a runner prepared after (the failure is kept per signature);
    calls whose q or cache is not 16-byte aligned run it without trying the producer kernel.
    The binding gets the 64-head kernel's arguments and the producer's constexprs."""
    import types

    calls, bound = [], []
    _failing_bind(monkeypatch, "producer", calls, bound)
    _stand_in_kernel_module(monkeypatch, "gluon_fp8_producer", types.SimpleNamespace(
        mla_fp8_producer_kernel=object(), PRODUCER_WARPS=4, PRODUCER_REGS=80, NUM_WARPS=8))
    fallback = lambda *tensors: calls.append("fallback")  # noqa: E731
    constexprs = dict(R=512, P=64, BLOCK_SIZE=64, SPARSE=True, SPLIT=False, TOPK_LENGTH=False, HAS_SINK=True)
    made = []

    def make_run():
        made.append(tri._producer_launch((1,), ("args",), constexprs, _WHERE, fallback))
        return made[-1]

    run = make_run()
    assert bound == [(("args",), {**constexprs, "PRODUCER_WARPS": 4, "PRODUCER_REGS": 80, "num_warps": 8})]
    _assert_failure_falls_back(run, make_run, "producer", calls)
    assert made[-1] is fallback and len(bound) == 1  # made again after the failure: not bound again


def test_fp8_producer_shared_memory_is_the_16_bit_kernels():
    """The producer kernel's shared memory (q, two bf16 key stages, p, four mbarriers, Triton's
    scratch) is the 16-bit 64-head kernel's plus its barriers: the raw bytes wait inside the
    stage they become; within Hopper's 227 KiB."""
    G = mla_plan.kernel_module("gluon_fp8_producer")
    W = mla_plan.kernel_module("gluon_wgmma")
    if G is None or W is None:
        pytest.skip("this triton has no Gluon")
    q, stages, p = 64 * 576 * 2, 2 * 64 * 576 * 2, 64 * 64 * 2
    assert G.shared_memory_bytes(512, 64) == q + stages + p + 4 * 8 + 1024 == W.shared_memory_bytes(512, 64) + 32
    assert G.shared_memory_bytes(512, 64) <= 227 * 1024
    assert G.supported(512, 64) and not G.supported(256, 64) and not G.supported(512, 32)


def test_warpgroup_split_takes_deepseek_fp8_ds_records(monkeypatch):
    """On a (stand-in) sm_90 device with the Gluon kernel's shapes, a bf16 cache and
    DeepSeek's fp8_ds_mla records (R = 512: 656 bytes a key) fit the warpgroup-split
    kernel, which then sizes its shared memory for the records; records of another
    latent width (R = 256) keep the Triton kernel, and the dense TMA kernel takes 16-bit
    caches only."""
    gluon = mla_plan.kernel_module("gluon_wgmma")
    if gluon is None:
        pytest.skip("this triton has no Gluon")
    _hopper_stand_ins(monkeypatch)
    asked = []

    def smem(r, p, fp8_ds=False):
        asked.append(fp8_ds)
        return 1

    _stand_in_kernel_module(monkeypatch, "gluon_wgmma", types.SimpleNamespace(
        BLOCK_H=64, BLOCK_N=64, shared_memory_bytes=smem, fp8_ds_supported=gluon.fp8_ds_supported))
    cfg = mla_plan.kernel_config(128, "cuda")
    q = _stand_in_tensor(torch.bfloat16, (2, 128, 576))
    assert mla_plan.warpgroup_split_fits(q, _stand_in_tensor(torch.bfloat16, (64, 64, 576)), cfg, 512, 64)
    records = _stand_in_tensor(torch.uint8, (64, 64, record_bytes(512, 64)))
    assert mla_plan.warpgroup_split_fits(q, records, cfg, 512, 64)
    assert asked == [False, True]
    assert not mla_plan.paged_tma_fits(q, records, cfg, 512, 64)
    assert not mla_plan.warpgroup_split_fits(_stand_in_tensor(torch.float16, (2, 128, 576)), records, cfg, 512, 64)
    q256 = _stand_in_tensor(torch.bfloat16, (2, 128, 320))
    assert mla_plan.warpgroup_split_fits(q256, _stand_in_tensor(torch.bfloat16, (64, 64, 320)), cfg, 256, 64)
    assert not mla_plan.warpgroup_split_fits(q256, _stand_in_tensor(torch.uint8, (64, 64, record_bytes(256, 64))), cfg,
                                        256, 64)


def test_fp8_ds_shared_memory_fits_hopper():
    """The fp8_ds_mla variant's shared memory (q, two stages of latent bytes and rope
    values, one bf16 working tile, p) fits Hopper's 227 KiB, as the bf16 variant's does."""
    G = mla_plan.kernel_module("gluon_wgmma")
    if G is None:
        pytest.skip("this triton has no Gluon")
    fp8 = G.shared_memory_bytes(512, 64, fp8_ds=True)
    q, raw, rope, work, p = 64 * 576 * 2, 2 * 64 * 512, 2 * 64 * 64 * 2, 64 * 512 * 2, 64 * 64 * 2
    assert fp8 == q + raw + rope + work + p + 1024 <= 227 * 1024
    assert G.shared_memory_bytes(512, 64) <= 227 * 1024


def test_warpgroup_split_needs_a_hopper_gpu():
    """On the CPU (and so under the interpreter) the Gluon kernel is never chosen."""
    cfg = mla_plan.kernel_config(128, "cuda")
    assert cfg.warpgroup_split
    q = torch.randn(1, 128, 576, dtype=torch.bfloat16)
    assert not mla_plan.warpgroup_split_applies(q, q, cfg, 512, 64)
    assert not mla_plan.kernel_config(128, "cpu").warpgroup_split


def test_fp8_ds_config_changes_only_the_stages(monkeypatch):
    """The fp8_ds_mla tiles differ from the bf16 cache's in pipeline stages only (16 heads),
    so the split plan, and the workspace sized from it, stay the same."""
    monkeypatch.setattr(mla_plan, "max_shared_memory", lambda device: 232448)  # sm_90
    cuda = torch.device("cuda", 0)
    for heads in (16, 128):
        base, fp8 = mla_plan.kernel_config(heads, "cuda", 232448), mla_plan.fp8_ds_kernel_config(heads, cuda)
        assert (fp8.block_h, fp8.block_n, fp8.ctas_per_sm, fp8.value_chunks) == (
            base.block_h, base.block_n, base.ctas_per_sm, base.value_chunks)
        assert fp8.num_stages == (3 if heads <= 16 else base.num_stages)
    assert mla_plan.fp8_ds_kernel_config(16, CPU) == mla_plan.kernel_config(16, "cpu")


# -- sparse_mla's FlashMLA options: attn_sink and topk_length -------------------------------
def _sparse_option_args(seed: int = 8, **over):
    """A plain sparse call (fp16; 4 tokens, K = 100 over 8 blocks of 4) whose token 1 has no valid entry."""
    params = {**cases.EXAMPLE_SPARSE, "T": 4, "K": 100, "num_blocks": 8, "invalid": 0.25, **over}
    q, kv, idx, scale, r = case_for("sparse_mla").inputs(params, CPU, seed)[:5]
    idx[1] = -1
    return q, kv, idx, scale, r


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_attn_sink_scales_out_by_the_sigmoid_and_leaves_lse(backend, num_splits):
    """Per head: a +inf sink gives out 0, -inf leaves out bit-equal to no sink, NaN gives
    NaN, a finite one scales out by sigmoid(lse - sink); lse is bit-equal to no sink, and
    the token without a key keeps out 0 and lse -inf whatever the sink."""
    q, kv, idx, scale, r = _sparse_option_args()
    plain_out, plain_lse = _run(backend, num_splits, "sparse_mla", (q, kv, idx, scale, r))
    sink = torch.tensor([INF, -INF, NAN, 0.5])
    out, lse = _run(backend, num_splits, "sparse_mla", (q, kv, idx, scale, r, sink))
    assert torch.equal(lse, plain_lse) and torch.isneginf(lse[1]).all() and torch.isfinite(lse[[0, 2, 3]]).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keyed = [0, 2, 3]
    assert torch.equal(out[keyed, 0], torch.zeros_like(out[keyed, 0]))
    C.assert_bits_equal((out[:, 1],), (plain_out[:, 1],), "out under a -inf sink")
    assert out[keyed, 2].isnan().all()
    kept = torch.sigmoid(plain_lse[:, 3] - 0.5)
    torch.testing.assert_close(out[:, 3].float(), plain_out[:, 3].float() * kept[:, None], rtol=2e-3, atol=2e-3)
    assert (kept[keyed] < 0.99).all() and (kept[keyed] > 0.01).all(), "a sink that matters"


@pytest.mark.nonfinite
@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_topk_length_zero_gives_zero_and_minus_inf_whatever_the_sink(backend, num_splits):
    q, kv, idx, scale, r = _sparse_option_args(invalid=0.0)
    length = torch.zeros(q.shape[0], dtype=torch.int32)
    sink = torch.tensor([INF, -INF, NAN, 0.5])
    for options in ((None, length), (sink, length)):
        out, lse = _run(backend, num_splits, "sparse_mla", (q, kv, idx, scale, r, *options))
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("num_splits", [1, 2, 4, 7])
def test_triton_topk_length_with_forced_splits_equals_the_entries_cut(num_splits):
    """Lengths at and past the edges of the interpreter's 16-key tiles and of the splits
    (0, 1, 16, 17, 33, 64, K), against the reference over the indices with every entry
    right of the length -1 (another path of the spec), with and without a sink."""
    q, kv, idx, scale, r = _sparse_option_args(T=7, K=100)
    idx[1] = torch.randint(0, kv.shape[0] * kv.shape[1], (idx.shape[1],), generator=torch.Generator().manual_seed(3))
    length = torch.tensor([0, 1, 16, 17, 33, 64, 100], dtype=torch.int32)
    cut = torch.where(torch.arange(idx.shape[1])[None, :] < length[:, None].long(), idx, -1)
    sink = torch.tensor([0.0, 1.0, -2.0, 3.0])
    for options in ((None, length), (sink, length)):
        expected = ref.sparse_mla(q, kv, cut, scale, r, options[0])
        out, lse = tri.sparse_mla(q, kv, idx, scale, r, *options, num_splits=num_splits)
        _check(expected, (out, lse))
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("backend,num_splits", RUNS)
def test_entries_right_of_topk_length_are_never_read(backend, num_splits):
    """Entries right of a token's topk_length holding int-min, int-max, -7 or slots of a
    NaN block, and the q rows of tokens of length 0 NaN, change no output bit."""
    q, kv, idx, scale, r = _sparse_option_args(invalid=0.0)
    kv = _with_unread_block_0(kv)
    idx = idx + kv.shape[1]  # no entry names block 0
    idx[1] = 5
    length = torch.tensor([5, 0, 64, 97], dtype=torch.int32)
    right = torch.arange(idx.shape[1])[None, :] >= length[:, None].long()
    sink = torch.tensor([0.0, 1.0, -2.0, 3.0])
    clean = _run(backend, num_splits, "sparse_mla", (q, kv, torch.where(right, -1, idx), scale, r, sink, length))
    bad = torch.tensor([-(2**31), 2**31 - 1, -7, 0, 1], dtype=torch.int32)  # slots 0, 1: block 0
    dirty_idx = torch.where(right, bad[torch.arange(idx.numel()) % bad.numel()].view(idx.shape), idx)
    dirty_kv, dirty_q = kv.clone(), q.clone()
    dirty_kv[0] = NAN
    dirty_q[1] = NAN
    out, lse = _run(backend, num_splits, "sparse_mla", (dirty_q, dirty_kv, dirty_idx, scale, r, sink, length))
    _bits_equal(clean, (out, lse))
    _check(ref.sparse_mla(q, kv, idx, scale, r, sink, length), (out, lse))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


# sparse_mla with both options as the launcher binds them at DeepSeek dims (CPU tensors
# stand in for CUDA ones): the Triton kernel at 16 and 128 heads, with one split (the sink
# in its epilogue) and two (the sink in the combine).
_OPTIONS_COMPILE_SCRIPT = _RECORD_LAUNCHES + SPECIALISE_PRELUDE + r"""
for heads in (16, 128):
    cfg = mla_plan.kernel_config(heads, "cuda")
    q = torch.randn(2, heads, 576, dtype=torch.bfloat16)
    kv = torch.randn(64, 64, 576, dtype=torch.bfloat16)
    idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
    sink, length = torch.randn(heads), torch.full((2,), 1000, dtype=torch.int32)
    for num_splits in (1, 2):
        tri.sparse_mla(q, kv, idx, 0.04, 512, sink, length, config=cfg, num_splits=num_splits)
assert len(launches) == 6, len(launches)  # per head count: attention; attention and combine
for fn, args, kw in launches:
    assert kw["HAS_SINK"] and (fn is split_kv.combine_kernel or kw["TOPK_LENGTH"]), kw
    opts = {"num_warps": kw.pop("num_warps"), "num_stages": kw.pop("num_stages", 2)}
    if kw.get("BLOCK_H") == 64:  # recorded on CPU tensors: what a CUDA tensor turns on
        kw["PREFETCH"] = mla_plan.kernel_config(128, "cuda").l2_prefetch
    k = triton.compile(specialise(fn, args, kw), target=GPUTarget("cuda", 90, 32), options=opts)
    print("compiled", fn.__name__, kw.get("BLOCK_H"), kw.get("SPLIT"), "shared", k.metadata.shared)
    if fn is split_kv.mla_attn_kernel and kw["BLOCK_H"] == 64:
        assert "wgmma.mma_async" in k.asm["ptx"], "64-head tiles must use wgmma"
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared
print("OK")
"""


def test_sparse_option_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The attention kernel with `topk_length` and the sink (one split), and with a split
    plan and the sink's combine, compile for sm_90 at 16 and 128 heads; the 64-head tiles
    on wgmma within Hopper's shared memory."""
    out = compile_for_sm90(_OPTIONS_COMPILE_SCRIPT, timeout=900)
    assert out.count("compiled mla_attn_kernel") == 4 and out.count("compiled combine_kernel") == 2, out


# The Gluon kernel with both options (64-head tiles, bf16): one split (the sink in its
# epilogue) and four (partials; the combine applies the sink).
_GLUON_OPTIONS_COMPILE_SCRIPT = _RECORD_LAUNCHES + r"""
try:
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, warpgroup_mma
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.mla.kernels import gluon_wgmma as G
mla_plan.warpgroup_split_fits = lambda *a: True
""" + SPECIALISE_PRELUDE + r"""
cfg = mla_plan.kernel_config(128, "cuda")
q = torch.randn(2, 128, 576, dtype=torch.bfloat16)
kv = torch.randn(64, 64, 576, dtype=torch.bfloat16)
idx = torch.randint(0, 4096, (2, 2048), dtype=torch.int32)
sink, length = torch.randn(128), torch.full((2,), 1000, dtype=torch.int32)
for num_splits in (1, 4):
    tri.sparse_mla(q, kv, idx, 0.04, 512, sink, length, config=cfg, num_splits=num_splits)
gluon = [(args, kw) for fn, args, kw in launches if fn is G.mla_attn_wgmma_kernel]
assert len(gluon) == 2 and all(kw["HAS_SINK"] and kw["TOPK_LENGTH"] for _, kw in gluon), gluon
for args, kw in gluon:
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.mla_attn_wgmma_kernel, args, kw, GluonASTSource), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    print("compiled SPLIT", kw["SPLIT"], "shared", k.metadata.shared, shapes)
    assert shapes == {"m64n32k16": 36, "m64n256k16": 4}, shapes  # no duplicated q.k, as without the options
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
print("OK")
"""


def test_warpgroup_split_kernel_with_sparse_options_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The Gluon kernel with `topk_length` and the sink, with and without splits, compiles
    for sm_90 with the same warpgroup split of the wgmmas, within Hopper's shared memory."""
    out = compile_for_sm90(_GLUON_OPTIONS_COMPILE_SCRIPT)
    assert out.count("compiled SPLIT") == 2, out


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attn_sink_of_any_stride(num_splits):
    """A sink view of stride 2 and an expanded one (stride 0) read as their values: bit-equal
    to the same values contiguous, and the reference's result."""
    q, kv, idx, scale, r = _sparse_option_args()
    for sink in (torch.tensor([9.0, 0.5, 9.0, -1.0, 9.0, 2.0, 9.0, 3.0])[1::2], torch.tensor(1.5).expand(4)):
        out, lse = tri.sparse_mla(q, kv, idx, scale, r, sink, num_splits=num_splits)
        _bits_equal(tri.sparse_mla(q, kv, idx, scale, r, sink.contiguous(), num_splits=num_splits), (out, lse))
        _check(ref.sparse_mla(q, kv, idx, scale, r, sink), (out, lse))
