"""The composite indexer steps (`sparse_attn_indexer_decode` / `_prefill`): the semantics
issue 3 lists, checked against the unchunked composition of the reference ops, the
prefill chunk plan at its boundaries, and the workspace discipline (reservation, held
views, no growth once reserved). Triton kernels run through the CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.testing import case_for
import graphsafe
from graphsafe.errors import InputError, WorkspaceError
from graphsafe.ops.indexer import plan
from graphsafe.ops.indexer import reference as ref
from graphsafe.ops.indexer import cases as cases
from graphsafe.testing.contract import clone_args, run_backend
from graphsafe.workspace import current_workspace_manager, workspace_bytes

DECODE, PREFILL = "sparse_attn_indexer_decode", "sparse_attn_indexer_prefill"
BACKENDS = ("reference", "triton")
# The interpreter's logits differ from the reference's by float32 summation order only.
CPU_TOL = 1e-5


def _spec(name):
    return graphsafe.get_op(name)


def _decode_args(seed=0, **kw):
    return case_for(DECODE).inputs({**cases.EXAMPLE_COMPOSITE_DECODE, **kw}, "cpu", seed)


def _prefill_args(seed=0, **kw):
    return case_for(PREFILL).inputs({**cases.EXAMPLE_COMPOSITE_PREFILL, **kw}, "cpu", seed)


def _run(name, backend, args, nested=None):
    """Run one backend of a composite on copies; `nested="triton"` forces the nested
    public ops onto their Triton kernels too (the CPU default is their reference)."""
    args = clone_args(args)
    if nested is None:
        run_backend(_spec(name), backend, args)
    else:
        with graphsafe.use_backend(nested):
            run_backend(_spec(name), backend, args)
    return args


# -- oracles: the unchunked composition of the reference ops -----------------------------
def oracle_decode(args):
    """(cache after the write, logits [T, L]) of a decode step."""
    cache, q, k, w, slots, lens, table, _, fmt, _, length, next_n, _ = clone_args(args)
    t, h, d = q.shape
    ref.indexer_k_quant_and_cache(k, cache, slots, d, fmt)
    return cache, ref.fp8_paged_mqa_logits(q.view(-1, next_n, h, d), cache, w, lens, table, length)


def decode_ranges(args):
    lens, next_n, length, t = args[5], args[11], args[10], args[1].shape[0]
    i = torch.arange(t) % next_n
    hi = (lens.long().repeat_interleave(next_n) - next_n + i + 1).clamp(0, length)
    return torch.zeros_like(hi), hi, torch.zeros_like(hi)


def oracle_prefill(args):
    cache, q, k, w, slots, table, cu, ks, ke, _, fmt, _, n = clone_args(args)[:13]
    d = q.shape[2]
    ref.indexer_k_quant_and_cache(k, cache, slots, d, fmt)
    keys = torch.zeros((n, d), dtype=torch.uint8).view(cases.FP8)
    scales = torch.zeros(n)
    ref.cp_gather_indexer_k_quant_cache(cache, keys, scales, table, cu)
    return cache, ref.fp8_mqa_logits(q, keys, scales, w, ks, ke)


def prefill_ranges(args):
    ks, ke, n = args[7].long(), args[8].long(), args[12]
    lo = ks.clamp(0, n)
    return lo, torch.maximum(ke.clamp(max=n), lo), ks


def check_decode(args, out, tol):
    cache, logits = oracle_decode(args)
    assert torch.equal(out[0], cache), "decode: the cache differs from the reference write"
    t = args[1].shape[0]
    assert torch.equal(out[7][t:], args[7][t:]), "decode: topk_indices rows >= T changed"
    cases.assert_topk_near(logits, *decode_ranges(args), out[7][:t], args[9], "decode", tol)


def check_prefill(args, out, tol):
    cache, logits = oracle_prefill(args)
    assert torch.equal(out[0], cache), "prefill: the cache differs from the reference write"
    t = args[1].shape[0]
    assert torch.equal(out[9][t:], args[9][t:]), "prefill: topk_indices rows >= T changed"
    cases.assert_topk_near(logits, *prefill_ranges(args), out[9][:t], args[11], "prefill", tol)


def _tol(backend):
    return 0.0 if backend == "reference" else CPU_TOL


# -- the grid ------------------------------------------------------------------
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_grid(next_n, block_size, heads, dim):
    """next_n 1/2, block_size 1/64, H 16/32/64, D 64/128, both scale formats; padding
    requests, contexts of exactly next_n and full ones (the case's context mix)."""
    fmt = "ue8m0" if (heads + dim + block_size) % 2 else None
    args = _decode_args(seed=heads + dim, next_n=next_n, block_size=block_size, H=heads, D=dim,
                        max_model_len=70, topk=12, scale_fmt=fmt, pad=0.3)
    for backend in BACKENDS:
        check_decode(args, _run(DECODE, backend, args), _tol(backend))


@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_grid(block_size, heads, dim):
    fmt = None if (heads + dim + block_size) % 2 else "ue8m0"
    args = _prefill_args(seed=heads + dim, block_size=block_size, H=heads, D=dim, max_ctx=30, topk=12,
                         scale_fmt=fmt, chunk="3")
    for backend in BACKENDS:
        check_prefill(args, _run(PREFILL, backend, args), _tol(backend))


@settings(max_examples=8)
@given(p=cases._params_composite_decode(), seed=st.integers(0, 2**31 - 1))
def test_decode_drawn_with_every_kernel(p, seed):
    """Drawn shapes, with the nested ops on their Triton kernels too (interpreter)."""
    args = case_for(DECODE).inputs(p, "cpu", seed)
    check_decode(args, _run(DECODE, "triton", args, nested="triton"), CPU_TOL)


@pytest.mark.nonfinite  # unread cache rows hold random bytes (NaN / huge fp8 scales) on purpose
@settings(max_examples=8)
@given(p=cases._params_composite_prefill(), seed=st.integers(0, 2**31 - 1))
def test_prefill_drawn_with_every_kernel(p, seed):
    args = case_for(PREFILL).inputs(p, "cpu", seed)
    check_prefill(args, _run(PREFILL, "triton", args, nested="triton"), CPU_TOL)


# -- targeted semantics -------------------------------------------------------------------
def _decode_custom(lens, next_n=2, length=24, topk=8, bs=4, seed=0):
    """A decode batch with the given contexts (the last request may be padding: len 0)."""
    lens = torch.tensor(lens, dtype=torch.int32)
    args = list(_decode_args(seed, B=len(lens), next_n=next_n, max_model_len=length, topk=topk,
                             block_size=bs, pad=0.0, extra_cols=2))
    pad = lens == 0
    args[5] = lens
    args[4] = cases._decode_slots(lens, next_n, args[6], bs, pad)
    return tuple(args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_short_contexts_pad_the_tail_and_padding_rows_are_minus_one(backend):
    # next_n = 2: a padding request, a context of exactly next_n, one shorter than topk,
    # and one longer than topk.
    args = _decode_custom([0, 2, 5, 24])
    out = _run(DECODE, backend, args)
    idx = out[7][:8]
    assert (idx[0:2] == -1).all(), "padding request: all -1"
    # Exactly next_n: token i sees positions 0..i, all of them chosen.
    assert sorted(idx[2][idx[2] >= 0].tolist()) == [0] and sorted(idx[3][idx[3] >= 0].tolist()) == [0, 1]
    assert sorted(idx[4][idx[4] >= 0].tolist()) == [0, 1, 2, 3] and sorted(idx[5][idx[5] >= 0].tolist()) == [0, 1, 2, 3, 4]
    assert (idx[6:8] >= 0).sum(1).tolist() == [8, 8] and (idx[:, 8:] == -1).all(), "topk = 8 columns, then -1"
    check_decode(args, out, _tol(backend))
    # The padding request's slots are -1: nothing of its keys reached the cache.
    cache0, _ = oracle_decode(args)
    assert torch.equal(out[0], cache0)


@pytest.mark.nonfinite  # unread cache rows hold random bytes (NaN / huge fp8 scales) on purpose
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_padding_tokens_and_exact_contexts(backend):
    args = _prefill_args(seed=3, B=2, T=12, max_ctx=4, topk=3)  # at most 8 real tokens: padding
    out = _run(PREFILL, backend, args)
    ks, ke, slots = args[7], args[8], args[4]
    pad = slots < 0
    assert pad.any(), "the case spreads some padding tokens"
    assert (out[9][:12][pad] == -1).all() and (ke[pad] <= ks[pad]).all()
    # A row with fewer window keys than topk lists its whole window (request-local 0..w-1).
    width = (ke - ks).clamp_min(0)
    for r in range(12):
        if 0 < width[r] <= 3:
            assert sorted(out[9][r][out[9][r] >= 0].tolist()) == list(range(int(width[r])))
    check_prefill(args, out, _tol(backend))


def _tied_cache(args, d, distinct=3, seed=0):
    """Every cached key one of `distinct` vectors (same bytes and scale): logits tie."""
    gen = torch.Generator().manual_seed(seed)
    cache = args[0].clone()
    nb, bs, _ = cache.shape
    vals = cases.fp8_randn((distinct, d), "cpu", gen)
    pick = torch.randint(0, distinct, (nb, bs), generator=gen)
    from graphsafe.formats import indexer_k as layout

    v, s = layout.cache_views(cache, d)
    v.copy_(vals[pick].view(torch.uint8))
    s.fill_(0.02)
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_compare_as_sets_of_scores(backend):
    """Few distinct keys: long runs of equal logits straddle the k-th value. Any set of
    tied positions is right; the chosen scores must be exactly the top-k multiset."""
    args = list(_decode_args(seed=5, next_n=1, max_model_len=60, topk=10, pad=0.0, scale_fmt=None))
    args[0] = _tied_cache(args, args[1].shape[2])
    args[4] = torch.full_like(args[4], -1)  # keep the tied cache as it is
    args = tuple(args)
    out = _run(DECODE, backend, args)
    _, logits = oracle_decode(args)
    lo, hi, shift = decode_ranges(args)
    t = args[1].shape[0]
    cases.assert_topk_near(logits, lo, hi, shift, out[7][:t], 10, "ties", tol=0.0)
    # The reference's own choice passes the same check, and so does any tie-broken one:
    # the comparison is of scores, not positions.
    assert (logits[:, :60].unique().numel()) <= 3 * t + 1


def test_topk_check_rejects_a_wrong_choice():
    """The comparison the case and these tests use can fail: a lowest-k choice is caught."""
    args = _decode_args(seed=1, next_n=1, max_model_len=40, topk=5, pad=0.0)
    out = _run(DECODE, "reference", args)
    _, logits = oracle_decode(args)
    lo, hi, shift = decode_ranges(args)
    t = args[1].shape[0]
    wrong = out[7][:t].clone()
    for r in range(t):
        c = int(min(5, hi[r]))
        if c:
            wrong[r, :c] = logits[r, : int(hi[r])].argsort()[:c].int()  # the lowest scores
    with pytest.raises(AssertionError, match="not a top-5"):
        cases.assert_topk_near(logits, lo, hi, shift, wrong, 5, "wrong")
    swapped = out[7][:t].clone()
    row = int((hi > 0).nonzero()[0, 0])
    swapped[row, 0] = -1
    with pytest.raises(AssertionError, match="-1 tail"):
        cases.assert_topk_near(logits, lo, hi, shift, swapped, 5, "tail")


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_keys_are_cached_before_they_are_scored(backend):
    """The newest token's key is scored from the cache the step just wrote: its old slot
    holds zeros (logit 0), the new key is large (a large positive logit with positive
    weights), the other keys are small: the top-1 must be the new token."""
    from graphsafe.formats import indexer_k as layout

    args = list(_decode_custom([8], next_n=1, length=8, topk=1))
    cache, slot = args[0], int(args[4][0])
    vals, scales = layout.cache_views(cache, args[1].shape[2])
    scales.fill_(1e-4)
    vals[slot // cache.shape[1], slot % cache.shape[1]] = 0
    scales[slot // cache.shape[1], slot % cache.shape[1]] = 0.0
    args[2] = args[2].float().sign() * 1000.0  # the new key: every entry +-1000
    args[3] = args[3].abs()
    out = _run(DECODE, backend, tuple(args))
    assert out[7][0, 0] == 7 and (out[7][0, 1:] == -1).all()


# -- the prefill chunk plan ----------------------------------------------------------------
def _bounds_ok(m, n, topk, bound, rows):
    need = plan.prefill_chunk_bytes
    assert 1 <= rows <= m
    assert need(rows, n, topk) <= bound or rows == 1
    assert rows == m or need(rows + 1, n, topk) > bound


@pytest.mark.parametrize("m,n,topk", [(12, 60, 8), (100, 1000, 64), (5000, 40000, 2048), (7, 0, 4)])
def test_chunk_rows_at_the_boundaries(m, n, topk):
    for r in (1, 2, 3, m // 2, m - 1):
        if r < 1:
            continue
        exact = plan.prefill_chunk_bytes(r, n, topk)
        for bound in (exact - 1, exact, exact + 1):
            rows = plan.prefill_chunk_rows(m, n, topk, bound)
            _bounds_ok(m, n, topk, bound, rows)
        assert plan.prefill_chunk_rows(m, n, topk, exact) >= r
        if r > 1 and plan.prefill_chunk_bytes(r - 1, n, topk) < exact:
            assert plan.prefill_chunk_rows(m, n, topk, exact - 1) < r
    if plan.prefill_chunk_bytes(1, n, topk) > 1:  # without keys or top-k scratch every row fits (0 bytes)
        assert plan.prefill_chunk_rows(m, n, topk, 1) == 1, "a bound below one row still makes progress"
    assert plan.prefill_chunk_rows(m, n, topk, 1 << 62) == m, "one chunk when everything fits"
    assert plan.prefill_chunk_rows(0, n, topk, 1 << 20) == 0


def test_chunk_rows_include_the_nested_top_k_scratch():
    n, topk = 8192, 2048
    logits_row = 4 * n
    # The Triton top-k (which takes scratch) serves: on a CPU-only machine the default
    # is its reference, which takes none.
    with graphsafe.use_backend("triton", ops=["top_k_per_row_prefill"]):
        rows = plan.prefill_chunk_rows(100000, n, topk, plan.DEFAULT_MAX_CHUNK_BYTES)
        topk_bytes = graphsafe.get_op("top_k_per_row_prefill").workspace_bytes(num_rows=rows, width=n, topk=topk)
    assert topk_bytes > 0 and rows * logits_row < plan.DEFAULT_MAX_CHUNK_BYTES
    assert rows * logits_row + topk_bytes <= plan.DEFAULT_MAX_CHUNK_BYTES


def test_chunks_cover_the_rows_in_order():
    for m, rows_bound in ((10, "1"), (10, "3"), (10, "3-1"), (10, "default")):
        bound = cases.prefill_chunk_bound(rows_bound, m, 60, 8)
        chunks = plan.prefill_chunks(m, 60, 8, bound)
        assert chunks[0][0] == 0 and chunks[-1][1] == m
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        rows = plan.prefill_chunk_rows(m, 60, 8, bound)
        assert all(e - s <= rows for s, e in chunks) and len(chunks) == -(-m // rows)


@pytest.mark.nonfinite  # unread cache rows hold random bytes (NaN / huge fp8 scales) on purpose
@pytest.mark.parametrize("tokens", [12, 11])  # 11: a shorter last chunk
@pytest.mark.parametrize("chunk", ["1", "2", "3-1", "3", "3+1", "default"])
def test_prefill_result_does_not_depend_on_the_chunking(chunk, tokens, monkeypatch):
    """Bound just below / at / above a 3-row chunk, one row per chunk (many chunks), one
    chunk: equal to the unchunked oracle, with the planned number of nested top-k calls,
    each on at most the planned rows."""
    args = _prefill_args(seed=11, T=tokens, chunk=chunk)
    m, n, topk, bound = tokens, args[12], args[11], args[13]
    calls = []
    # The composite binds the nested top-k once per chunk size (OpSpec.bound, at prepare):
    # wrap the runners it gets, and check every call's views have the bound signature.
    select = graphsafe.get_op("top_k_per_row_prefill")
    real_bound = select.bound

    def spy_bound(device_type, *bound_args):
        real = real_bound(device_type, *bound_args)
        signature = select.signature_key(*bound_args)

        def spy(logits, ks, ke, idx, k):
            assert select.signature_key(logits, ks, ke, idx, k) == signature
            calls.append(logits.shape[0])
            return real(logits, ks, ke, idx, k)

        return spy

    monkeypatch.setattr(select, "bound", spy_bound)
    out = _run(PREFILL, "triton", args)
    check_prefill(args, out, CPU_TOL)
    rows = plan.prefill_chunk_rows(m, n, topk, bound)
    assert calls == [e - s for s, e in plan.prefill_chunks(m, n, topk, bound)]
    assert max(calls) == rows
    expect = -(-m // {"1": 1, "2": 2, "3-1": 2, "3": 3, "3+1": 3, "default": m}[chunk])
    assert len(calls) == expect, (chunk, calls)
    check_prefill(args, _run(PREFILL, "reference", args), 0.0)


# -- workspace -----------------------------------------------------------------------------
def test_decode_workspace_is_the_logits_then_the_top_k_scratch():
    with graphsafe.use_backend("triton"):  # the Triton composite and top-k (CPU: the reference by default)
        specs = plan.sparse_attn_indexer_decode_workspace(64, 4096, 64, 128, topk=2048)
        topk_specs = graphsafe.get_op("top_k_per_row_decode").workspace_specs(num_rows=64, width=4096, topk=2048)
        op_bytes = _spec(DECODE).workspace_bytes(64, 4096, 64, 128, topk=2048)
    assert specs[0] == ((64, 4096), torch.float32) and topk_specs
    assert workspace_bytes(*specs) == workspace_bytes(specs[0]) + (-workspace_bytes(specs[0]) % 256) + workspace_bytes(*topk_specs)
    assert op_bytes == workspace_bytes(*specs)


def test_decode_reserves_the_worst_case_then_never_grows():
    """A call with max_num_batched_tokens = 32 sizes the arena for any T <= 32: a locked
    workspace then serves other batch sizes, and refuses a larger one clearly."""
    length, topk = 30, 8
    big = _decode_args(seed=1, B=3, next_n=2, max_model_len=length, topk=topk)
    with graphsafe.use_backend("triton"):  # the nested top-k takes scratch too
        args = list(clone_args(big))
        args[12] = 32
        graphsafe.sparse_attn_indexer_decode(*args)
        ws = current_workspace_manager("cpu")
        size = ws.size_bytes
        assert size >= plan.decode_bytes(32, length, topk)
        with ws.locked():
            for b in (1, 2, 3):
                small = list(_decode_args(seed=b, B=b, next_n=2, max_model_len=length, topk=topk))
                small[12] = 32
                graphsafe.sparse_attn_indexer_decode(*small)
                check_decode(tuple(_decode_args(seed=b, B=b, next_n=2, max_model_len=length, topk=topk)), small, CPU_TOL)
            assert ws.size_bytes == size
            huge = list(clone_args(big))
            huge[12] = 4096
            with pytest.raises(WorkspaceError, match="locked"):
                graphsafe.sparse_attn_indexer_decode(*huge)


def test_decode_reservation_equals_its_need_without_a_maximum():
    with graphsafe.use_backend("triton"):
        args = _decode_args(seed=2)
        graphsafe.sparse_attn_indexer_decode(*clone_args(args))
        stats = current_workspace_manager("cpu").stats()
        t, length, topk = args[1].shape[0], args[10], args[9]
        need = plan.decode_bytes(t, length, topk)  # with the Triton top-k's scratch
    assert stats.peak_request_bytes == need
    assert stats.requests.get(DECODE) == 1 and stats.requests.get("top_k_per_row_decode") == 1


def test_prefill_reservation_covers_every_smaller_call():
    """The worst case for (M, N) bounds the need of any call with fewer tokens and keys."""
    for topk, bound in ((8, 1 << 14), (64, 1 << 18), (2048, 512 << 20)):
        for mmax, nmax in ((16, 100), (300, 5000), (8192, 200000)):
            worst = workspace_bytes(*plan.sparse_attn_indexer_prefill_workspace(mmax, 0, 64, 128, topk, nmax, bound))
            for m in (1, mmax // 3 + 1, mmax):
                for n in (0, 1, nmax // 7, nmax // 2 + 3, nmax):
                    assert plan.prefill_bytes(m, n, 128, topk, bound) <= worst, (topk, bound, m, n)
    default = plan.sparse_attn_indexer_prefill_workspace(8192, 1000, 64, 128)
    assert default[0][0][0] == plan.PREFILL_BUFFER_FACTOR * 1000


def test_prefill_locked_after_a_worst_case_call():
    with graphsafe.use_backend("triton"):
        args = list(_prefill_args(seed=4))
        args[14], args[15] = 64, 500  # max_num_batched_tokens, max_total_seq_lens
        graphsafe.sparse_attn_indexer_prefill(*args)
        ws = current_workspace_manager("cpu")
        size = ws.size_bytes
        with ws.locked():
            for seed, kw in ((5, {"T": 7}), (6, {"B": 2, "max_ctx": 24})):
                a = list(_prefill_args(seed, **kw))
                a[14], a[15] = 64, 500
                expect = tuple(_prefill_args(seed, **kw))
                graphsafe.sparse_attn_indexer_prefill(*a)
                check_prefill(expect, a, CPU_TOL)
        assert ws.size_bytes == size


# -- logits launchers without the -inf fill (what the composites use) -----------------------
def test_paged_logits_without_clean_write_the_valid_columns_only():
    from graphsafe.ops.indexer import triton as tri

    p = {**cases.EXAMPLE_PAGED, "B": 3, "max_model_len": 50}
    q, cache, w, lens, table, length = case_for("fp8_paged_mqa_logits").inputs(p, "cpu", 2)
    lens = torch.tensor([0, 7, 50], dtype=torch.int32)
    full = torch.full((6, 50), float("nan"))
    part = full.clone()
    tri.paged_mqa_logits_into(full, q, cache, w, lens, table, length, config={"BLOCK_N": 16, "min_tiles": 4})
    tri.paged_mqa_logits_into(part, q, cache, w, lens, table, length, config={"BLOCK_N": 16, "min_tiles": 4}, clean=False)
    row_len = torch.tensor([0, 0, 6, 7, 49, 50])
    for r in range(6):
        assert torch.equal(part[r, : row_len[r]], full[r, : row_len[r]])
    assert part[0].isnan().all() and part[2, 16:].isnan().all(), "nothing past the last computed tile is written"
    cases.compare_logits(ref.fp8_paged_mqa_logits(q, cache, w, lens, table, length), full)


def test_mqa_logits_without_clean_skip_dead_tiles_only():
    from graphsafe.ops.indexer import triton as tri

    q, k, k_scale, w, ks, ke = case_for("fp8_mqa_logits").inputs(
        {"M": 20, "N": 50, "H": 16, "D": 64, "window": "causal"}, "cpu", 1)
    ks[:], ke[:] = 0, torch.arange(20, dtype=torch.int32) + 1  # causal over the first 20 keys only
    full, part = torch.full((20, 50), float("nan")), torch.full((20, 50), float("nan"))
    tri.mqa_logits_into(full, q, k, k_scale, w, ks, ke)
    tri.mqa_logits_into(part, q, k, k_scale, w, ks, ke, clean=False)
    valid = torch.arange(50)[None, :] < ke[:, None]
    assert torch.equal(part[valid], full[valid])
    assert part[:, 32:].isnan().all(), "tiles past every window (16-wide on the CPU) are not written"
    assert not full.isnan().any()


# -- errors and compilation --------------------------------------------------------------
def test_block_table_too_short_is_refused_by_fake_and_real():
    args = list(_decode_args())
    args[6] = args[6][:, :2]
    with pytest.raises(InputError, match="block_table.*wide enough"):
        graphsafe.sparse_attn_indexer_decode(*args)
    compiled = torch.compile(graphsafe.sparse_attn_indexer_decode, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="wide enough"):
        compiled(*args)


def test_step_compiles_fullgraph_with_the_slot_mapping():
    """A decode step's indexer (composite + request-local -> global slots) in one graph."""
    args = _decode_args(seed=7, pad=0.0)
    t, bs = args[1].shape[0], args[0].shape[1]
    req = torch.arange(args[5].shape[0], dtype=torch.int32).repeat_interleave(args[11])

    def step(*a):
        graphsafe.sparse_attn_indexer_decode(*a)
        return graphsafe.req_local_to_global_slots(req, a[6], a[7][:t], bs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_args, compiled_args = clone_args(args), clone_args(args)
    assert torch.equal(step(*eager_args), compiled(*compiled_args))
    assert torch.equal(eager_args[0], compiled_args[0]) and torch.equal(eager_args[7], compiled_args[7])


@pytest.mark.parametrize("name", [DECODE, PREFILL])
def test_nested_ops_are_bound_once_per_signature(name, monkeypatch):
    """The first call of a signature binds the nested ops (OpSpec.bound); later calls run
    their runners directly, and give the same results."""
    with graphsafe.use_backend("triton"):
        args = case_for(name).inputs(case_for(name).example, "cpu", 3)
        first = clone_args(args)
        _spec(name).public(*first)

        def refuse(*a, **kw):
            raise AssertionError("a nested op was bound again for a known signature")

        for nested in ("indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache", "top_k_per_row_decode",
                       "top_k_per_row_prefill"):
            monkeypatch.setattr(graphsafe.get_op(nested), "bound", refuse)
        again = clone_args(args)
        _spec(name).public(*again)
    for a, b in zip(first, again):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
