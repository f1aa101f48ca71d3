"""Per-row top-k (`top_k_per_row_prefill`, `top_k_per_row_decode`): the semantics of
issue 3 against a plain-Python oracle, every path of the Triton selection (through the
interpreter on CPU), the workspace contract, and the aiter adapter against a fake aiter.

The contract suite (tests/test_contract.py) already runs opcheck, fake==real, exact
mutation, bad inputs and Triton==reference on drawn inputs for both ops.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphsafe
from graphsafe.ops.topk import plan
from graphsafe.ops.topk import reference as ref
from graphsafe.testing import contract as C
from graphsafe.testing.cases.topk import (
    assert_topk_rows,
    decode_ranges,
    make_logits,
    prefill_ranges,
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


def _prefill_bounds(starts: torch.Tensor, ends: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(s), int(e), int(s)) for s, e in zip(starts, ends)]


def _decode_bounds(seq_lens: torch.Tensor, next_n: int) -> list[tuple[int, int, int]]:
    return [(0, int(seq_lens[r // next_n]) - next_n + r % next_n + 1, 0) for r in range(seq_lens.shape[0] * next_n)]


@given(data=st.data())
def test_reference_matches_python_oracle(data):
    for name in (PREFILL, DECODE):
        case = graphsafe.get_op(name).case
        params = data.draw(case.params(), label=name)
        args = C.clone_args(case.inputs(params, "cpu", data.draw(st.integers(0, 2**31 - 1))))
        graphsafe.get_op(name).runner("reference")(*args)
        if name == PREFILL:
            logits, starts, ends, idx, topk = args
            bounds = _prefill_bounds(starts, ends)
            lo, hi, shift = prefill_ranges(starts, ends, logits.shape[1])
        else:
            logits, next_n, seq_lens, idx, topk = args
            bounds = _decode_bounds(seq_lens, next_n)
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
    """Run the Triton prefill on private scratch; return (indices, per-row state)."""
    tt = _tt()
    rows, width = logits.shape
    g_cols, cap, block_f = plan.plan_sizes(width, topk)
    g_cols = overrides.get("g_cols", g_cols)
    cap = overrides.get("cap", cap)
    scratch = [torch.empty(shape, dtype=dtype) for shape, dtype in plan.specs(rows, g_cols, cap, topk)]
    idx = torch.full((rows, k_cols or topk), 77, dtype=torch.int32)
    tt.top_k_per_row_prefill(logits, starts, ends, idx, topk, scratch=scratch, **overrides)
    return idx, scratch[0]


def _check_against_reference(logits, starts, ends, idx, topk):
    expected = torch.empty_like(idx)
    ref.top_k_per_row_prefill(logits, starts, ends, expected, topk)
    lo, hi, shift = prefill_ranges(starts, ends, logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, expected, idx, topk, "triton indices")


def _full_rows(rows, width):
    return torch.zeros(rows, dtype=torch.int32), torch.full((rows,), width, dtype=torch.int32)


def _ties_below_bound(rows=2, width=300):
    # The top-k are all 0.3 (nonzero low mantissa bits): the 16-bit bound falls below them.
    x = torch.full((rows, width), 0.3)
    x[:, ::100] = 0.7
    x[-1, 5] = float("-inf")
    return x


PATHS = {
    # name: (logits, topk, overrides, check on (n_gt, n_eq, cap, block_f))
    "registers": (lambda: torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)), 16, {},
                  lambda gt, eq, cap, bf: (gt >= 16) & (gt <= bf)),
    "list_radix": (lambda: torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)), 16, {"block_f": 16},
                   lambda gt, eq, cap, bf: (gt > bf) & (gt <= cap)),
    "row_radix": (_ties_below_bound, 8, {}, lambda gt, eq, cap, bf: gt > cap),
    "row_radix_neg_inf": (lambda: torch.full((2, 300), float("-inf")), 8, {}, lambda gt, eq, cap, bf: gt > cap),
    "ties_at_bound": (lambda: torch.where(torch.arange(300) % 37 == 0, 2.0, 1.0).expand(2, 300).contiguous(), 20, {},
                      lambda gt, eq, cap, bf: (gt < 20) & (gt + eq >= 20)),
    "bound_zero_when_few_columns": (lambda: torch.randn(2, 1000, generator=torch.Generator().manual_seed(3)), 16,
                                    {"g_cols": 8}, lambda gt, eq, cap, bf: gt > bf),
}


@needs_interpreter
@pytest.mark.parametrize("path", sorted(PATHS))
def test_triton_selection_paths(path):
    make, topk, overrides, taken = PATHS[path]
    logits = make()
    rows, width = logits.shape
    starts, ends = _full_rows(rows, width)
    idx, state = _triton_run(logits, starts, ends, topk, k_cols=topk + 3, **overrides)
    _, cap, block_f = plan.plan_sizes(width, topk)
    cap, block_f = overrides.get("cap", cap), overrides.get("block_f", block_f)
    assert taken(state[:, 2], state[:, 3], cap, block_f).all(), f"{path} not taken: state {state[:, :5].tolist()}"
    _check_against_reference(logits, starts, ends, idx, topk)


@needs_interpreter
@settings(max_examples=10)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 400),
    topk=st.integers(1, 24),
    mode=st.sampled_from(["normal", "ties", "ties_inf", "neg_inf_rows"]),
    block_f=st.sampled_from([None, 16]),
    cap_extra=st.sampled_from([None, 0, 5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_with_small_capacities(rows, width, topk, mode, block_f, cap_extra, seed):
    """Small register blocks and candidate lists (down to topk) push rows through every fallback."""
    cap = None if cap_extra is None else topk + cap_extra
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(rows, width, mode, "cpu", gen)
    starts = torch.randint(-3, width + 1, (rows,), generator=gen, dtype=torch.int32)
    ends = torch.randint(0, width + 4, (rows,), generator=gen, dtype=torch.int32)
    overrides = {k: v for k, v in (("block_f", block_f), ("cap", cap)) if v is not None}
    idx, _ = _triton_run(logits, starts, ends, topk, k_cols=topk + 2, **overrides)
    _check_against_reference(logits, starts, ends, idx, topk)


@needs_interpreter
def test_triton_rows_of_other_lengths_in_one_call():
    # Rows shorter than topk, empty, just above topk and full, in one launch.
    logits = torch.randn(5, 700, generator=torch.Generator().manual_seed(4))
    starts = torch.tensor([0, 100, 50, 0, 690], dtype=torch.int32)
    ends = torch.tensor([700, 100, 83, 700, 700], dtype=torch.int32)
    idx, _ = _triton_run(logits, starts, ends, 32, k_cols=40)
    _check_against_reference(logits, starts, ends, idx, 32)


# -- workspace ----------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("name", [PREFILL, DECODE])
def test_workspace_request_is_the_declared_worst_case(name):
    from graphsafe.workspace import manager as wm

    spec = graphsafe.get_op(name)
    params = {**spec.case.example}
    args = spec.case.inputs(params, "cpu", 0)
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
    assert requested == [(name, spec.workspace_bytes(num_rows=rows, width=width, topk=topk))]


def test_workspace_worst_case_grows_with_shapes_only():
    small = graphsafe.get_op(DECODE).workspace_bytes(num_rows=1, width=32768, topk=2048)
    big = graphsafe.get_op(DECODE).workspace_bytes(num_rows=128, width=131072, topk=2048)
    assert 0 < small < big < 128 * 131072 * 4, "scratch stays well below the logits it selects from"


# -- aiter adapter, against a fake aiter -------------------------------------------
def _fake_aiter(takes_k: bool, calls: list):
    """aiter's documented behaviour: absolute columns for prefill, [rows, k] contiguous output."""

    def prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048):
        assert indices.is_contiguous() and indices.shape == (numRows, k) and values is None
        calls.append(("prefill", k))
        ref.select_rows(logits, rowStarts.long(), rowEnds.long(), torch.zeros_like(rowStarts), indices, k)

    def decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048):
        assert next_n == 1 and seqLens.shape == (numRows,) and indices.shape == (numRows, k)
        calls.append(("decode", k))
        lo = torch.zeros_like(seqLens)
        ref.select_rows(logits, lo, seqLens.long().clamp(0, logits.shape[1]), lo, indices, k)

    if not takes_k:
        def prefill_nok(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1):
            return prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1)

        def decode_nok(logits, next_n, seqLens, indices, numRows, stride0, stride1):
            return decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)

        return types.SimpleNamespace(top_k_per_row_prefill=prefill_nok, top_k_per_row_decode=decode_nok)
    return types.SimpleNamespace(top_k_per_row_prefill=prefill, top_k_per_row_decode=decode)


@needs_interpreter
@pytest.mark.parametrize("takes_k", [True, False])
@pytest.mark.parametrize("name", [PREFILL, DECODE])
def test_aiter_adapter_localises_and_fills(monkeypatch, name, takes_k):
    from graphsafe.ops.topk import aiter as adapter

    calls: list = []
    monkeypatch.setitem(sys.modules, "aiter", _fake_aiter(takes_k, calls))
    adapter._entry.cache_clear()
    try:
        spec = graphsafe.get_op(name)
        for params in (
            {**spec.case.example, "extra_k": 3, "strided": True},  # through scratch + copy
            {**spec.case.example, "extra_k": 0, "strided": False},  # aiter writes indices directly
            {**spec.case.example, "values": "ties_inf", "extra_k": 0},
        ):
            args = spec.case.inputs(params, "cpu", 1)
            C.check_backend_matches_reference(spec, spec.case, "aiter", args, params)
    finally:
        adapter._entry.cache_clear()
    if takes_k:
        assert calls and all(k == spec.case.example["topk"] for _, k in calls)
    else:
        assert not calls, "an aiter without `k` only serves topk == 2048; the rest runs the Triton kernels"


# -- GPU compilation, without a GPU ------------------------------------------------
_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.topk import triton as tt

def sig_of(fn, ones):
    sig, consts = {}, {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in ones:  # what the launcher's specialisation does to an int equal to 1
            sig[name], consts[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name == "logits_ptr" else "*i32"
        else:
            sig[name] = "i32"
    return sig, consts

target = GPUTarget("cuda", 90, 32)
cases = [
    (tt._threshold_kernel, {"G": 8192, "BJ": 1024, "GI": 8, "DECODE": True}, (), tt.NUM_WARPS),
    (tt._select_kernel, {"BLOCK": tt.BLOCK, "LBLOCK": tt.LBLOCK, "BLOCK_F": 4096, "DECODE": False,
                         "PREFETCH": tt.PREFETCH}, (), tt.NUM_WARPS_SELECT),
    (tt._threshold_kernel, {"G": 64, "BJ": 64, "GI": 1, "DECODE": False}, ("topk", "next_n", "progs_per_row"), 4),
    (tt._select_kernel, {"BLOCK": 64, "LBLOCK": 64, "BLOCK_F": 16, "DECODE": True, "PREFETCH": True},
     ("topk", "next_n", "cap", "chunks_per_row", "blocks_per_chunk", "out_cols"), 4),
    (tt._finish_external_kernel, {"LOCALIZE": True, "BLOCK": 1024}, ("topk",), 4),
    (tt._decode_row_ends_kernel, {"BLOCK": 1024}, ("next_n",), 4),
]
for fn, constexprs, ones, warps in cases:
    sig, consts = sig_of(fn, ones)
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**constexprs, **consts}), target=target,
                   options={"num_warps": warps})
    print("compiled", fn.__name__, sorted(consts))
print("OK")
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never compiles: catch GPU-only errors (types, constexpr misuse,
    ints specialised to 1) by compiling the launch variants for sm_90 with ptxas."""
    import os
    import pathlib
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if "NO_BACKEND" in proc.stdout:
        pytest.skip("this triton build cannot compile for CUDA")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
