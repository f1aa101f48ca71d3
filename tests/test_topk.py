"""Per-row top-k (`top_k_per_row_prefill`, `top_k_per_row_decode`): the semantics of
issue 3 against a plain-Python oracle, every path of the Triton selection (through the
interpreter on CPU) and the workspace contract (the aiter adapter: test_aiter_indexer_topk.py,
against the stand-in aiter).

The contract suite (tests/test_contract.py) already runs opcheck, fake==real, exact
mutation, bad inputs and Triton==reference on drawn inputs for both ops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.topk import plan
from graphsafe.ops.topk import reference as ref
from graphsafe.ops.topk.kernels.triton_two_launch import _radix_search
from graphsafe.testing import contract as C
from graphsafe.ops.topk.cases import (
    assert_topk_rows,
    decode_ranges,
    final_paths,
    make_logits,
    prefill_ranges,
    rowwise_outcomes,
    rowwise_search,
    sortable_keys,
)

PREFILL, DECODE = "top_k_per_row_prefill", "top_k_per_row_decode"
needs_interpreter = pytest.mark.skipif(
    not graphsafe.get_op(PREFILL).available_backends("cpu").count("triton"),
    reason="the Triton backend runs on CPU only through TRITON_INTERPRET=1",
)


def _tt():
    from graphsafe.ops.topk import triton as tt

    return tt


# -- the spec, against a plain-Python oracle ---------------------------------------
def _oracle(logits: torch.Tensor, bounds: list[tuple[int, int, int]], k_cols: int, topk: int) -> torch.Tensor:
    """Row by row: sort the valid columns by score (ties by position), keep topk, pad -1."""
    keys = sortable_keys(logits)
    out = torch.full((len(bounds), k_cols), -1, dtype=torch.int32)
    for r, (start, end, origin) in enumerate(bounds):
        width = logits.shape[1]
        cols = [n for n in range(max(start, 0), min(end, width))]
        cols.sort(key=lambda n: (-int(keys[r, n]), n))
        for j, n in enumerate(cols[:topk]):
            out[r, j] = n - origin
    return out


def _clamp(x, width: int) -> int:
    return min(max(int(x), 0), width)


def _prefill_bounds(starts: torch.Tensor, ends: torch.Tensor, width: int) -> list[tuple[int, int, int]]:
    """Bounds clamped to [0, width]; positions relative to the clamped start."""
    return [(_clamp(s, width), _clamp(e, width), _clamp(s, width)) for s, e in zip(starts, ends)]


def _decode_bounds(seq_lens: torch.Tensor, next_n: int, width: int) -> list[tuple[int, int, int]]:
    """Lengths clamped to [0, width] first."""
    return [(0, _clamp(seq_lens[r // next_n], width) - next_n + r % next_n + 1, 0)
            for r in range(seq_lens.shape[0] * next_n)]


@given(data=st.data())
def test_reference_matches_python_oracle(data):
    for name in (PREFILL, DECODE):
        case = case_for(name)
        params = data.draw(case.params(), label=name)
        args = C.clone_args(case.inputs(params, "cpu", data.draw(st.integers(0, 2**31 - 1))))
        graphsafe.get_op(name).runner("reference")(*args)
        if name == PREFILL:
            logits, starts, ends, idx, topk = args
            bounds = _prefill_bounds(starts, ends, logits.shape[1])
            lo, hi, shift = prefill_ranges(starts, ends, logits.shape[1])
        else:
            logits, next_n, seq_lens, idx, topk = args
            bounds = _decode_bounds(seq_lens, next_n, logits.shape[1])
            lo, hi, shift = decode_ranges(seq_lens, next_n, logits.shape[1])
        oracle = _oracle(logits, bounds, idx.shape[1], topk)
        assert_topk_rows(logits, lo, hi, shift, oracle, idx, topk, f"{name} reference")


BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]


def _run(backend: str, name: str, *args) -> None:
    graphsafe.get_op(name).runner(backend)(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_rows_write_every_position_then_minus_one(backend):
    logits = torch.randn(3, 40)
    starts = torch.tensor([5, 0, 30], dtype=torch.int32)
    ends = torch.tensor([9, 0, 40], dtype=torch.int32)  # 4, 0 and 10 valid columns
    idx = torch.full((3, 12), 99, dtype=torch.int32)
    _run(backend, PREFILL, logits, starts, ends, idx, 10)
    assert sorted(idx[0, :4].tolist()) == [0, 1, 2, 3] and (idx[0, 4:] == -1).all()
    assert (idx[1] == -1).all()
    assert sorted(idx[2, :10].tolist()) == list(range(10)) and (idx[2, 10:] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_positions_are_relative_to_the_row_start(backend):
    logits = torch.zeros(2, 64)
    logits[0, 20], logits[0, 33] = 5.0, 4.0
    logits[1, 50], logits[1, 2] = 7.0, 6.0  # 2 is outside row 1's range [40, 64)
    starts = torch.tensor([16, 40], dtype=torch.int32)
    ends = torch.tensor([48, 64], dtype=torch.int32)
    idx = torch.empty(2, 2, dtype=torch.int32)
    _run(backend, PREFILL, logits, starts, ends, idx, 1)
    assert idx[:, 0].tolist() == [20 - 16, 50 - 40] and idx[:, 1].tolist() == [-1, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_outside_the_row_act_as_the_nearest_bound(backend):
    """Starts, ends and lengths outside [0, width] are clamped first (positions count
    from the clamped start); the oracle row by row, and bit-equal to the clamped call."""
    width = 24
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([-5, -2**31, 3, 10**6, width + 1, 2], dtype=torch.int32)
    ends = torch.tensor([10, width, 2**31 - 1, width, -3, -7], dtype=torch.int32)
    got = torch.full((6, 8), 99, dtype=torch.int32)
    _run(backend, PREFILL, logits, starts, ends, got, 8)
    clamped = torch.full((6, 8), 99, dtype=torch.int32)
    _run(backend, PREFILL, logits, starts.clamp(0, width), ends.clamp(0, width), clamped, 8)
    assert torch.equal(got, clamped)
    oracle = _oracle(logits, _prefill_bounds(starts, ends, width), 8, 8)
    assert torch.equal(got.sort(dim=1).values, oracle.sort(dim=1).values)  # order within a row is free
    assert (got[3:] == -1).all()

    next_n = 2
    seq_lens = torch.tensor([-2**31, -1, 10**6, width + 1, 2**31 - 1], dtype=torch.int32)
    dec = torch.randn(5 * next_n, width, generator=torch.Generator().manual_seed(6))
    got = torch.full((5 * next_n, 8), 99, dtype=torch.int32)
    _run(backend, DECODE, dec, next_n, seq_lens, got, 8)
    clamped = torch.full((5 * next_n, 8), 99, dtype=torch.int32)
    _run(backend, DECODE, dec, next_n, seq_lens.clamp(0, width), clamped, 8)
    assert torch.equal(got, clamped) and (got[:4] == -1).all()
    oracle = _oracle(dec, _decode_bounds(seq_lens, next_n, width), 8, 8)
    assert torch.equal(got.sort(dim=1).values, oracle.sort(dim=1).values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_rank_by_their_bits(backend):
    """+NaN above +inf, -NaN below -inf, -inf an ordinary score, +0.0 above -0.0."""
    nan = torch.tensor(float("nan"))
    row = torch.tensor([1.0, float("inf"), -nan.item(), float("-inf"), 0.0, -0.0, 5.0, nan.item(), -3.0, 2.0])
    row[2] = -nan  # sign bit set
    width = row.numel()
    order = [7, 1, 6, 9, 0, 4, 5, 8, 3, 2]  # positions by rank
    for k in range(1, width + 1):
        got = torch.full((1, width), 99, dtype=torch.int32)
        _run(backend, PREFILL, row[None].clone(), torch.tensor([0], dtype=torch.int32),
             torch.tensor([width], dtype=torch.int32), got, k)
        assert sorted(got[0, :k].tolist()) == sorted(order[:k]) and (got[0, k:] == -1).all(), k
        got = torch.full((1, width), 99, dtype=torch.int32)
        _run(backend, DECODE, row[None].clone(), 1, torch.tensor([width], dtype=torch.int32), got, k)
        assert sorted(got[0, :k].tolist()) == sorted(order[:k]), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_ranges_follow_the_paged_logits_rows(backend):
    # next_n = 2 (MTP): row 2b+i sees n < seq_lens[b] - 2 + i + 1; request 1's context is exactly next_n.
    next_n, width = 2, 32
    logits = torch.arange(4 * width, dtype=torch.float32).reshape(4, width)  # larger columns score higher
    seq_lens = torch.tensor([10, 2], dtype=torch.int32)
    idx = torch.empty(4, 3, dtype=torch.int32)
    _run(backend, DECODE, logits, next_n, seq_lens, idx, 3)
    assert sorted(idx[0].tolist()) == [6, 7, 8]  # 9 columns valid
    assert sorted(idx[1].tolist()) == [7, 8, 9]  # 10 columns valid
    assert idx[2].tolist()[:1] == [0] and idx[2, 1:].tolist() == [-1, -1]  # 1 column valid
    assert sorted(idx[3, :2].tolist()) == [0, 1] and idx[3, 2] == -1  # 2 columns valid


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_is_an_ordinary_score(backend):
    logits = torch.full((2, 50), float("-inf"))
    logits[0, 7] = 1.0
    seq_lens = torch.tensor([50, 30], dtype=torch.int32)
    idx = torch.empty(2, 4, dtype=torch.int32)
    _run(backend, DECODE, logits, 1, seq_lens, idx, 4)
    assert idx[0, 0] == 7 or 7 in idx[0].tolist()
    assert (idx >= 0).all(), "-inf entries inside the valid range are chosen like any score"
    assert (idx[1] < 30).all() and len(set(idx[1].tolist())) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_columns_past_topk_are_minus_one(backend):
    logits = torch.randn(3, 100)
    seq_lens = torch.tensor([100, 100, 100], dtype=torch.int32)
    big = torch.full((3, 20), 5, dtype=torch.int32)
    idx = big[:, :16]  # a slice of a wider shared buffer
    _run(backend, DECODE, logits, 1, seq_lens, idx, 9)
    assert (idx[:, :9] >= 0).all() and (idx[:, 9:] == -1).all()
    assert (big[:, 16:] == 5).all(), "nothing outside the given view is written"
    want = torch.topk(logits, 9, dim=1).indices.sort(dim=1).values
    assert torch.equal(idx[:, :9].long().sort(dim=1).values, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_return_any_set_with_the_top_scores(backend):
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    idx = torch.empty(1, 3, dtype=torch.int32)
    _run(backend, PREFILL, logits, torch.tensor([0], dtype=torch.int32), torch.tensor([7], dtype=torch.int32), idx, 3)
    chosen = idx[0].tolist()
    assert len(set(chosen)) == 3 and set(chosen) <= {1, 2, 3, 5}


# -- every path of the Triton selection --------------------------------------------
def _triton_run(logits, starts, ends, topk, k_cols=None, **overrides):
    """Run the Triton prefill on private scratch sized for the (overridden) plan;
    return (indices, per-program state, candidates, plan)."""
    tt = _tt()
    rows, width = logits.shape
    forced = {k: v for k, v in overrides.items() if k in ("p1", "reg", "margin", "max_slots")}
    pl = plan.two_launch_plan(rows, width, topk, **forced)
    scratch = [torch.empty(shape, dtype=dtype) for shape, dtype in plan.specs(rows, pl.p1, pl.cap)]
    idx = torch.full((rows, k_cols or topk), 77, dtype=torch.int32)
    tt.top_k_per_row_prefill(logits, starts, ends, idx, topk, scratch=scratch, **overrides)
    return idx, scratch[0], scratch[1], pl


def _check_against_reference(logits, starts, ends, idx, topk):
    expected = torch.empty_like(idx)
    ref.top_k_per_row_prefill(logits, starts, ends, expected, topk)
    lo, hi, shift = prefill_ranges(starts, ends, logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, expected, idx, topk, "triton indices")


def _full_rows(rows, width):
    return torch.zeros(rows, dtype=torch.int32), torch.full((rows,), width, dtype=torch.int32)


def _randn(rows, width, seed):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def _top_in_one_program(rows=2, width=1000, topk=16):
    # The topk largest scores all lie in program 0's granules (P1 = 4: granules 0, 4, 8,
    # ... of 16 entries): with no margin its bound sits above the row's k-th largest.
    x = _randn(rows, width, 5)
    x[:, 0:16] += 10.0
    return x


PATHS = {
    # name: (logits, topk, overrides, expected final path of every row)
    "one_program_exact": (lambda: _randn(3, 1000, 1), 16, {}, "registers"),
    "programs_share_rows": (lambda: _randn(3, 1000, 2), 16, {"p1": 4}, "registers"),
    "eight_programs_short_rows": (lambda: _randn(2, 300, 3), 16, {"p1": 8}, "registers"),
    "list_radix": (lambda: _randn(3, 1000, 4), 16, {"p1": 4, "max_slots": 64}, "list"),
    "row_after_slot_overflow": (lambda: _randn(2, 1000, 6), 16, {"p1": 2, "reg": 4}, "row"),
    "row_after_failed_check": (_top_in_one_program, 16, {"p1": 4, "margin": 0.0}, "row"),
    "row_after_too_few_kept": (lambda: _randn(2, 1000, 7), 16, {"p1": 4, "margin": -3.0}, "row"),
    "equal_scores": (lambda: torch.full((2, 700), 0.3), 16, {"p1": 4}, "registers"),
    # 40 entries in granules of 16: programs 3..7 own none (their bound must not block the fast path)
    "programs_without_entries": (lambda: _randn(2, 40, 12), 16, {"p1": 8, "reg": 16}, "registers"),
    "neg_inf_rows": (lambda: torch.full((2, 700), float("-inf")), 16, {}, "registers"),
    "ties_at_the_bound": (lambda: torch.where(torch.arange(900) % 37 == 0, 2.0, 1.0).expand(2, 900).contiguous(), 20,
                          {"p1": 2}, "registers"),
    "periodic_in_g": (lambda: _randn(1, 256, 8).repeat(2, 4), 16, {"p1": 2, "reg": 16}, "row"),
}


@needs_interpreter
@pytest.mark.parametrize("path", sorted(PATHS))
def test_triton_selection_paths(path):
    make, topk, overrides, want = PATHS[path]
    logits = make()
    rows, width = logits.shape
    starts, ends = _full_rows(rows, width)
    idx, meta, cand, pl = _triton_run(logits, starts, ends, topk, k_cols=topk + 3, **overrides)
    lo, hi, _ = prefill_ranges(starts, ends, width)
    assert final_paths(meta, cand, pl, lo, hi, topk) == [want] * rows, f"{path}: meta {meta[:, :, :3].tolist()}"
    _check_against_reference(logits, starts, ends, idx, topk)


# -- the one-launch decode kernel (one program a row), through the interpreter ---------
# A small geometry: 2 warps of 4 entries a thread, regions of 256 slots, 128 samples.
SMALL_ROWWISE = plan.RowwisePlan(per_thread=4, slots_per_warp=256, warps=2, samples_per_thread=2)


def _rowwise_run(logits, next_n, seq_lens, topk, k_cols, cfg=SMALL_ROWWISE):
    rows = logits.shape[0]
    meta = torch.full((rows, cfg.warps, plan.NMETA), -1, dtype=torch.int32)
    cand = torch.full((rows, cfg.slots), -5, dtype=torch.int64)  # poison: unwritten slots must not count
    idx = torch.full((rows, k_cols), 77, dtype=torch.int32)
    _tt().top_k_per_row_decode(logits, next_n, seq_lens, idx, topk, rowwise=cfg, scratch=(meta, cand))
    expected = torch.empty_like(idx)
    ref.top_k_per_row_decode(logits, next_n, seq_lens, expected, topk)
    lo, hi, shift = decode_ranges(seq_lens, next_n, logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, expected, idx, topk, "rowwise indices")
    return rowwise_outcomes(meta)


def _few_values(rows, width, seed):
    return torch.randint(0, 5, (rows, width), generator=torch.Generator().manual_seed(seed)).float()


def _mostly_neg_inf(rows, width, seed):
    x = _randn(rows, width, seed)
    return torch.where(torch.rand(rows, width, generator=torch.Generator().manual_seed(seed + 1)) < 0.97,
                       float("-inf"), x)


ROWWISE_CASES = {
    # name: (logits, plan, outcome of every full row)
    "random": (lambda: _randn(3, 3000, 21), SMALL_ROWWISE, (1, 1)),
    # a run of ties at the bound: ties go to the top of the regions, larger keys first
    "equal_scores": (lambda: torch.full((3, 3000), 0.3), SMALL_ROWWISE, (1, 1)),
    "five_values": (lambda: _few_values(3, 3000, 22), SMALL_ROWWISE, (1, 1)),
    "mostly_neg_inf": (lambda: _mostly_neg_inf(3, 3000, 23), SMALL_ROWWISE, (1, 1)),
    # a bound far too high (too few kept): the second pass, RETRY_Z sigma out, holds them
    "retry_after_too_few": (lambda: _randn(3, 3000, 24), dataclasses.replace(SMALL_ROWWISE, z=-8.0, retry_z=4.0), (2, 1)),
    # regions too small for any bound: both passes overflow, the exact select over the row
    "exact_after_overflow": (lambda: _randn(3, 3000, 25), dataclasses.replace(SMALL_ROWWISE, slots_per_warp=16), (2, 2)),
}


@needs_interpreter
@pytest.mark.parametrize("case", sorted(ROWWISE_CASES))
def test_rowwise_paths(case):
    make, cfg, want = ROWWISE_CASES[case]
    logits = make()
    seq_lens = torch.full((3,), 3000, dtype=torch.int32)
    assert _rowwise_run(logits, 1, seq_lens, 64, 70, cfg) == [want] * 3


# Rows the pass can read 16 bytes at a time (whole groups of 4, 16-byte aligned: a
# register group a load) and rows it cannot (4-byte loads).
ROW_LAYOUTS = {
    "aligned": (lambda x: x, True),
    "width_not_a_multiple_of_4": (lambda x: x[:, :2999].contiguous(), False),
    "row_stride_not_a_multiple_of_4": (lambda x: torch.cat([x, x[:, :1]], 1)[:, :3000], False),
    "start_not_16_byte_aligned": (lambda x: torch.cat([x[:, :4], x], 1)[:, 1:3001], False),
}


@needs_interpreter
@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
def test_rowwise_row_layouts(layout):
    make, vec = ROW_LAYOUTS[layout]
    logits = make(_randn(3, 3000, 27))
    assert _tt().vector_loads(logits) == vec
    width = logits.shape[1]
    # Ragged lengths: partial last steps that end inside a group of 4; two sample sizes.
    seq_lens = torch.tensor([width, width - 3, width - 1001], dtype=torch.int32)
    for cfg in (SMALL_ROWWISE, dataclasses.replace(SMALL_ROWWISE, samples_per_thread=4)):
        assert _rowwise_run(logits, 1, seq_lens, 64, 70, cfg) == [(1, 1)] * 3


@needs_interpreter
@pytest.mark.parametrize("next_n", [1, 2])
def test_rowwise_mtp_short_and_empty_rows(next_n):
    # Full, ragged, shorter than topk (written without data), empty and past L.
    width = 2000
    seq_lens = torch.tensor([2000, 1500, 40, 0, 2600], dtype=torch.int32)
    logits = _randn(5 * next_n, width, 26 + next_n)
    outcomes = _rowwise_run(logits, next_n, seq_lens, 64, 66)
    full = [r for r in range(5 * next_n) if int(seq_lens[r // next_n]) - next_n + r % next_n + 1 > 64]
    assert [outcomes[r] for r in full] == [(1, 1)] * len(full)


@needs_interpreter
@settings(max_examples=8)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 2500),
    topk=st.integers(1, 80),
    mode=st.sampled_from(["normal", "ties", "ties_inf", "neg_inf_rows"]),
    next_n=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rowwise_matches_reference(rows, width, topk, mode, next_n, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(rows * next_n, width, mode, "cpu", gen)
    seq_lens = torch.randint(0, width + 3, (rows,), generator=gen, dtype=torch.int32)
    _rowwise_run(logits, next_n, seq_lens, topk, topk + 2)


@needs_interpreter
def test_rowwise_search_takes_both_tiles():
    # After the first round the bin's keys move to a small tile when they fit in it
    # (random rows: a few dozen of the ~400 kept), else the search stays on the whole
    # tile (all scores in five values: the bin is a whole value); in one-value rows the
    # first round finds the value. Every result is checked against the reference.
    seq_lens = torch.full((3,), 3000, dtype=torch.int32)
    cases = {"random": _randn(3, 3000, 31), "five_values": _few_values(3, 3000, 32), "one_value": torch.full((3, 3000), 0.3)}
    seen = {}
    for name, logits in cases.items():
        meta = torch.full((3, SMALL_ROWWISE.warps, plan.NMETA), -1, dtype=torch.int32)
        cand = torch.full((3, SMALL_ROWWISE.slots), -5, dtype=torch.int64)
        idx = torch.full((3, 64), 77, dtype=torch.int32)
        _tt().top_k_per_row_decode(logits, 1, seq_lens, idx, 64, rowwise=SMALL_ROWWISE, scratch=(meta, cand))
        expected = torch.empty_like(idx)
        ref.top_k_per_row_decode(logits, 1, seq_lens, expected, 64)
        lo, hi, shift = decode_ranges(seq_lens, 1, 3000)
        assert_topk_rows(logits, lo, hi, shift, expected, idx, 64, name)
        seen[name] = rowwise_search(meta)
    assert all(r >= 2 and moved for r, moved in seen["random"]), seen
    assert all(r >= 1 and not moved for r, moved in seen["five_values"]), seen
    assert seen["one_value"] == [(1, False)] * 3, seen


def test_rowwise_plan_and_worst_case():
    # From 32 rows at any width; below that only up to 32K (wider rows keep the two-launch plan).
    assert plan.rowwise_applies(32, 131072, 2048) and not plan.rowwise_applies(16, 131072, 2048)
    assert plan.rowwise_applies(1, 32768, 2048) and plan.rowwise_applies(128, 4096, 2048)
    assert not plan.rowwise_applies(128, 131072, plan.ROWWISE.slots // 2 + 1)
    # Shorter steps up to 32K-wide rows, one shape of scratch for both plans.
    assert plan.rowwise_plan(32768).per_thread == 8 and plan.rowwise_plan(32772).per_thread == 16
    assert plan.ROWWISE_NARROW.slots == plan.ROWWISE.slots and plan.ROWWISE_NARROW.warps == plan.ROWWISE.warps
    for width in (4096, 32768, 65536, 131072, 262144):
        assert plan.rowwise_applies(128, width, 2048)
        cfg = plan.rowwise_plan(width)
        assert cfg.per_thread % 4 == 0 and cfg.samples_per_thread == 4, "a step's 16-byte loads fill groups of 4; 4 samples a thread"
        (meta_shape, _), (cand_shape, _) = plan.workspace_specs_decode(1, width, 2048)
        assert meta_shape[1] >= cfg.warps and cand_shape[1] >= cfg.slots, "the decode worst case covers the one-launch kernel"
        assert 2048 <= cfg.slots // 2


@triton.jit
def _search_probe(keys_ptr, out_ptr, n, k_lo, k_hi, BLOCK: tl.constexpr, TUPLE: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + offs, mask=offs < n, other=0).to(tl.uint32, bitcast=True)
    v, m = _radix_search(key, k_lo, k_hi, n, BLOCK // 32, 32, TUPLE)
    tl.store(out_ptr, v.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, m)


@needs_interpreter
@settings(max_examples=25)
@given(
    keys=st.lists(st.integers(1, 2**32 - 1) | st.sampled_from([1, 7, 2**31, 2**31 + 5, 2**32 - 1]), min_size=1, max_size=64),
    k=st.integers(1, 64),
    slack=st.sampled_from([0, 0, 3]),
)
@example(keys=[2**31 + 5] * 4 + [7], k=2, slack=0)  # ties: the search runs to the last bit
@example(keys=[2**32 - 1, 2**32 - 1, 1], k=2, slack=0)
@example(keys=[2**31, 2**31 - 1, 2**31 - 1], k=2, slack=0)  # keys that differ in the top bit
@example(keys=[12345] * 9, k=3, slack=3)  # all equal: the prefix is the key
def test_radix_search_finds_the_kth_largest_key(keys, k, slack):
    """The bound search behind both launches: run to the last bit it returns the k-th
    largest key; else it stops at a prefix with k..k+slack keys at or above it. With the
    GPU's tuple reduction and the interpreter's native sums alike (the same counts)."""
    k = min(k, len(keys))
    t = torch.tensor(keys, dtype=torch.int64)
    outs = []
    for tuple_reduce in (True, False):
        out = torch.zeros(2, dtype=torch.int32)
        _search_probe[(1,)](t.to(torch.int32), out, len(keys), k, k + slack, BLOCK=64, TUPLE=tuple_reduce)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), outs
    out = outs[0]
    v, m = int(out[0]) & 0xFFFFFFFF, int(out[1])
    kth = int(t.sort(descending=True).values[k - 1])
    assert m == int((t >= v).sum()) >= k, "n counts the keys at or above the bound"
    assert v <= kth, "the bound is never above the k-th largest key"
    assert m <= k + slack or v == kth, "the search stops once k..k+slack keys lie above, or on the k-th key"


@needs_interpreter
def test_programs_split_a_run_of_high_scores_evenly():
    # A run of high scores (recent tokens): granules interleave across programs, so each
    # program holds about its share and every row passes the check with the default margin.
    x = _randn(2, 1000, 9)
    x[:, 700:900] += 3.0
    starts, ends = _full_rows(2, 1000)
    idx, meta, cand, pl = _triton_run(x, starts, ends, 16, p1=4)
    assert final_paths(meta, cand, pl, *prefill_ranges(starts, ends, 1000)[:2], 16) == ["registers"] * 2
    _check_against_reference(x, starts, ends, idx, 16)


@needs_interpreter
@settings(max_examples=10)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 700),
    topk=st.integers(1, 24),
    mode=st.sampled_from(["normal", "ties", "ties_inf", "neg_inf_rows"]),
    p1=st.sampled_from([None, 2, 4, 8]),
    reg=st.sampled_from([None, None, 8, 32]),
    margin=st.sampled_from([None, 12.0, 0.0, -2.0]),
    max_slots=st.sampled_from([None, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_with_forced_plans(rows, width, topk, mode, p1, reg, margin, max_slots, seed):
    """Forced program counts, small slot regions and register blocks, and weak bounds push
    rows through every path, on random ranges (empty, short, partial, full)."""
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(rows, width, mode, "cpu", gen)
    starts = torch.randint(-3, width + 1, (rows,), generator=gen, dtype=torch.int32)
    ends = torch.randint(0, width + 4, (rows,), generator=gen, dtype=torch.int32)
    overrides = {k: v for k, v in dict(p1=p1, reg=reg, margin=margin, max_slots=max_slots).items() if v is not None}
    idx, *_ = _triton_run(logits, starts, ends, topk, k_cols=topk + 2, **overrides)
    _check_against_reference(logits, starts, ends, idx, topk)


@needs_interpreter
def test_triton_rows_of_other_lengths_in_one_call():
    # Rows shorter than topk, empty, just above topk and full, in one launch.
    logits = _randn(5, 700, 4)
    starts = torch.tensor([0, 100, 50, 0, 690], dtype=torch.int32)
    ends = torch.tensor([700, 100, 83, 700, 700], dtype=torch.int32)
    for p1 in (None, 4):
        idx, *_ = _triton_run(logits, starts, ends, 32, k_cols=40, p1=p1)
        _check_against_reference(logits, starts, ends, idx, 32)


@needs_interpreter
@pytest.mark.parametrize("next_n", [1, 2])
def test_triton_decode_with_programs_sharing_rows(next_n):
    # MTP rows (next_n = 2) and contexts of exactly next_n, empty and past L, with P1 = 4.
    tt = _tt()
    width, topk = 600, 12
    seq_lens = torch.tensor([600, 2, 0, 650, 40], dtype=torch.int32)
    rows = seq_lens.shape[0] * next_n
    logits = _randn(rows, width, 10 + next_n)
    pl = plan.two_launch_plan(rows, width, topk, p1=4)
    scratch = [torch.empty(shape, dtype=dtype) for shape, dtype in plan.specs(rows, pl.p1, pl.cap)]
    idx = torch.full((rows, topk + 1), 5, dtype=torch.int32)
    tt.top_k_per_row_decode(logits, next_n, seq_lens, idx, topk, scratch=scratch, p1=4)
    expected = torch.empty_like(idx)
    ref.top_k_per_row_decode(logits, next_n, seq_lens, expected, topk)
    lo, hi, shift = decode_ranges(seq_lens, next_n, width)
    assert_topk_rows(logits, lo, hi, shift, expected, idx, topk, "triton decode indices")


def test_search_view_keeps_a_column_within_a_byte():
    # `_radix_search` sums thermometer codes in byte fields per column of an [R, SC]
    # view: every launch shape must give R <= 255 keys a column and an exact split.
    for n in (1, 2, 16, 64, 1024, 4096, 8192, 16384, 65536):
        for warps in (1, 2, 4, 8, 16):
            sc = plan.search_columns(n, warps)
            assert n % sc == 0 and n // sc <= 255, (n, warps, sc)


def test_plan_keeps_programs_and_slots_in_bounds():
    # DeepSeek decode widths: tiles fit the registers (<= MAX_TILE), the final selection
    # fits its register block, and the declared worst case covers every row count's plan.
    for width in (8192, 32768, 65536, 131072, 163840):
        need_p1, need_cap = plan.row_need(width, 2048, False)
        for rows in (1, 32, 128, 2048):
            pl = plan.two_launch_plan(rows, width, 2048)
            assert pl.tile <= plan.MAX_TILE and pl.in_registers, (width, rows, pl)
            assert pl.p1 <= need_p1 and pl.cap <= need_cap and pl.cap >= 2048
            assert pl.bj * pl.p1 == pl.g and pl.dp * pl.g >= width
# -- workspace ----------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("name", [PREFILL, DECODE])
def test_workspace_request_is_the_declared_worst_case(name):
    from graphsafe.workspace import manager as wm

    spec = graphsafe.get_op(name)
    params = {**case_for(spec.name).example}
    args = case_for(spec.name).inputs(params, "cpu", 0)
    rows, width = args[0].shape
    topk = args[4]
    requested = []
    original = wm.WorkspaceManager.get_simultaneous

    def spy(self, *specs, owner="unnamed"):
        requested.append((owner, wm.workspace_bytes(*specs)))
        return original(self, *specs, owner=owner)

    wm.WorkspaceManager.get_simultaneous = spy
    try:
        spec.runner("triton")(*C.clone_args(args))
    finally:
        wm.WorkspaceManager.get_simultaneous = original
    # The op's worst case over the backends that may serve (the CPU's automatic order has
    # the reference only: the Triton backend forced, as the interpreter runs it).
    with graphsafe.use_backend("triton", ops=[name]):
        declared = spec.workspace_bytes(num_rows=rows, width=width, topk=topk, device="cpu")
    assert requested == [(name, declared)] and declared > 0


def test_workspace_worst_case_grows_with_shapes_only():
    # Each backend's own worst case (the op's is the largest of those that may serve a
    # device: none but the reference on a CPU).
    from graphsafe.workspace import workspace_bytes

    for fn in (plan.workspace_specs_decode, plan.aiter_workspace_specs_decode):
        small = workspace_bytes(*fn(num_rows=1, width=32768, topk=2048))
        big = workspace_bytes(*fn(num_rows=128, width=131072, topk=2048))
        assert 0 < small < big < 128 * 131072 * 4, "scratch stays well below the logits it selects from"


# -- GPU compilation, without a GPU ------------------------------------------------
_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.topk.kernels import triton_external as ext, triton_two_launch as tt

def sig_of(fn, ones):
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in ones:  # what the launcher's specialisation does to an int equal to 1
            sig[name], consts[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            sig[name] = {"logits_ptr": "*fp32", "cand_ptr": "*i64"}.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name.startswith("stride") or name == "width":  # multiples of 16 at realistic shapes
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs

target = GPUTarget("cuda", 90, 32)
B, F = tt._bound_kernel, tt._final_kernel
cases = [
    # decode at 128K (P1 = 8), at 32K (P1 = 4), prefill (one program a row), tiny shapes
    (B, dict(P1=8, BJ=2048, DP=8, REG=1024, SEGW=16, MARGIN=12.0, DECODE=True, SC=256, TUPLE=True), ("next_n",), 8),
    (B, dict(P1=4, BJ=4096, DP=2, REG=1024, SEGW=16, MARGIN=12.0, DECODE=True, SC=512, TUPLE=True), ("next_n",), 16),
    (B, dict(P1=1, BJ=8192, DP=1, REG=4096, SEGW=16, MARGIN=12.0, DECODE=False, SC=512, TUPLE=True), (), 16),
    (B, dict(P1=2, BJ=128, DP=4, REG=64, SEGW=16, MARGIN=12.0, DECODE=False, SC=32, TUPLE=True), ("next_n", "width"), 1),
    (F, dict(P1=8, REG=1024, IN_REGS=True, LBLOCK=1024, DECODE=True, SC=512, TUPLE=True), ("next_n",), 16),
    (F, dict(P1=1, REG=4096, IN_REGS=True, LBLOCK=1024, DECODE=False, SC=256, TUPLE=True), (), 8),
    (F, dict(P1=16, REG=1024, IN_REGS=False, LBLOCK=1024, DECODE=True, SC=256, TUPLE=True), ("next_n", "out_cols", "width"), 8),
    (ext._finish_external_kernel, {"LOCALIZE": True, "BLOCK": 1024}, ("topk",), 4),
    (ext._decode_row_ends_kernel, {"BLOCK": 1024}, ("next_n",), 4),
]
# The one-launch decode kernel (both plans): next_n = 1 and MTP; 4-byte loads; the
# profiles' prefixes.
import re
from graphsafe.ops.topk import plan
from graphsafe.ops.topk.kernels import triton_rowwise as rw
for cfg, ones, until, vec in ((plan.ROWWISE, ("next_n",), 9, True), (plan.ROWWISE, (), 9, True),
                               (plan.ROWWISE_NARROW, (), 9, True), (plan.ROWWISE, (), 9, False),
                               (plan.ROWWISE, (), 2, True), (plan.ROWWISE, (), 4, True)):
    cases.append((rw._rowwise_kernel, dict(S=32 * cfg.warps * cfg.samples_per_thread, Z=cfg.z, RETRY_Z=cfg.retry_z,
                  E=cfg.per_thread, NW=cfg.warps, CAPW=cfg.slots_per_warp, LBLOCK=1024,
                  VEC=vec, ASM=True, UNTIL=until), ones, cfg.warps))
for fn, constexprs, ones, warps in cases:
    sig, consts, attrs = sig_of(fn, ones)
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**constexprs, **consts}, attrs=attrs),
                       target=target, options={"num_warps": warps})
    print("compiled", fn.__name__, sorted(consts), "shared", k.metadata.shared)
    if fn is rw._rowwise_kernel:
        # The ballots rank (and histogram) entry (e, t) among the lanes of register e: an
        # [E, 32 * warps] tile must sit one entry a thread, a row of it across the warps'
        # lanes; the 16-byte loads (pack=4) then fill registers 4j..4j+3 of a thread.
        # `_warp_scan` needs a thread's count in its lane, the CTA-wide steps through shared
        # memory a thread's value in word tid (its warp's bin j in lane j), and the reads
        # back ([32] tensors: the bin pick's shuffles) element j in lane j of every warp:
        # [32] or [32 * warps] tensors, one a lane.
        ttgir = k.asm["ttgir"]
        aliases = dict(line.split(" = ", 1) for line in ttgir.splitlines() if line.startswith("#blocked"))
        tile = f"sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, {warps}], order = [1, 0]"
        lanes = "sizePerThread = [1], threadsPerWarp = [32]"
        asms = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
        exchanges = [line for line in asms if "bar.sync" in line or "%laneid" in line]
        ballots = [line for line in asms if "vote.sync.ballot" in line and line not in exchanges]
        scans = [line for line in asms if "shfl.sync.up" in line]
        loads4 = [line for line in asms if "ld.global.nc" in line and "v4.b32" in line]
        assert ballots and scans and exchanges, "no ballot, warp scan or shared-memory exchange in the kernel"
        assert constexprs["UNTIL"] < 4 or any("shfl.sync" in line for line in exchanges), "no bin pick in the kernel"
        assert bool(loads4) == constexprs["VEC"], "16-byte loads where VEC asks for them"
        for line in ballots + scans + loads4 + exchanges:
            want = lanes if "shfl.sync" in line or line in exchanges else tile
            layouts = re.findall(r"tensor<[^>]*, (#blocked\d*)>", line)
            assert layouts and all(want in aliases[a] for a in layouts), (line, aliases)
        print("asm layouts ok", len(ballots), len(scans), len(loads4), len(exchanges))
print("OK")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter never compiles: catch GPU-only errors (types, constexpr misuse,
    ints specialised to 1) by compiling the launch variants for sm_90 with ptxas."""
    compile_for_sm90(_COMPILE_SCRIPT)
