"""GPU tests of the per-row top-k (H100/H200): realistic shapes against the reference,
every selection path compiled for the GPU, structured rows (a run of high scores, a
trend, clumps of equal scores) staying on the fast path, determinism, CUDA-graph replay
with a locked workspace, and a loose speed check.

tests/test_contract_gpu.py also runs the gpu_examples of both cases (graph replay with
new inputs, no host sync, no allocation beyond outputs, Inductor).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.topk import reference as ref
from graphsafe.testing import contract as C
from graphsafe.testing import no_sync
from graphsafe.ops.topk import plan
from graphsafe.ops.topk.kernels import triton_rowwise as rowwise
from graphsafe.ops.topk.cases import assert_topk_rows, decode_ranges, final_paths, prefill_ranges, rowwise_outcomes

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PREFILL, DECODE = "top_k_per_row_prefill", "top_k_per_row_decode"


def _decode_args(rows, width, mode="normal", next_n=1, lens="full", seed=0, topk=2048):
    params = {"B": rows // next_n, "next_n": next_n, "L": width, "topk": topk, "extra_k": 0,
              "values": mode, "lens": lens, "strided": False}
    return case_for(DECODE).inputs(params, CUDA, seed)


def _check_decode(args, out):
    logits, next_n, seq_lens, _, topk = args
    expected = C.clone_args(args)
    ref.top_k_per_row_decode(*expected)
    lo, hi, shift = decode_ranges(seq_lens, next_n, logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, expected[3], out, topk)


def _triton():
    from graphsafe.ops.topk import triton as tt

    return tt


@pytest.mark.parametrize("mode", ["normal", "ties", "ties_inf", "neg_inf_rows"])
@pytest.mark.parametrize(
    "rows,width", [(1, 32768), (32, 32768), (128, 32768), (1, 131072), (32, 131072), (128, 131072)]
)
def test_decode_matches_reference(rows, width, mode):
    args = _decode_args(rows, width, mode, lens="random", seed=rows)
    out = C.clone_args(args)
    _triton().top_k_per_row_decode(*out)
    _check_decode(args, out[3])


@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_mtp_and_short_contexts(next_n):
    args = _decode_args(64, 65536, "normal", next_n=next_n, lens="short", seed=3)
    out = C.clone_args(args)
    _triton().top_k_per_row_decode(*out)
    _check_decode(args, out[3])


@pytest.mark.parametrize(
    "m,n,ranges", [(2048, 8192, "causal"), (2048, 32768, "causal"), (1024, 16384, "random"), (512, 8192, "wild")]
)
def test_prefill_matches_reference(m, n, ranges):
    params = {"M": m, "N": n, "topk": 2048, "extra_k": 0, "values": "normal", "ranges": ranges, "strided": True}
    args = case_for(PREFILL).inputs(params, CUDA, 0)
    out = C.clone_args(args)
    _triton().top_k_per_row_prefill(*out)
    expected = C.clone_args(args)
    ref.top_k_per_row_prefill(*expected)
    lo, hi, shift = prefill_ranges(args[1], args[2], n)
    assert_topk_rows(args[0], lo, hi, shift, expected[3], out[3], 2048)


@pytest.mark.parametrize("rows", [16, 128])  # the two-launch plan, the one-launch kernel
def test_distinct_scores_give_exactly_torch_topk(rows):
    # Distinct by construction: a permutation of 0 .. rows * 131072 - 1, exact in float32
    # (< 2^24). Random normal scores tie at the k-th place in ~0.1% of 128K-wide rows,
    # and then any of the tied positions is a right answer.
    gen = torch.Generator(device=CUDA).manual_seed(rows)
    logits = torch.randperm(rows * 131072, device=CUDA, generator=gen).float().view(rows, 131072)
    seq_lens = torch.full((rows,), 131072, dtype=torch.int32, device=CUDA)
    idx = torch.empty(rows, 2048, dtype=torch.int32, device=CUDA)
    graphsafe.top_k_per_row_decode(logits, 1, seq_lens, idx, 2048)
    want = torch.topk(logits, 2048, dim=1).indices.sort(dim=1).values
    assert torch.equal(idx.long().sort(dim=1).values, want)


# Overrides that force each path of the two-launch plan at realistic sizes (see triton.py's
# docstring).
PATH_OVERRIDES = {
    "registers": ("normal", {"rowwise": False}),
    "ties": ("ties", {"rowwise": False}),
    "two_programs_a_row": ("normal", {"p1": 2}),
    "sixteen_programs_a_row": ("normal", {"p1": 16}),
    "list_radix": ("normal", {"max_slots": 2048}),
    "row_after_slot_overflow": ("normal", {"reg": 64}),
    "row_after_weak_bounds": ("normal", {"margin": -6.0}),
}


@pytest.mark.parametrize("path", sorted(PATH_OVERRIDES))
def test_every_selection_path_on_the_gpu(path):
    mode, overrides = PATH_OVERRIDES[path]
    args = _decode_args(32, 32768, mode, lens="random", seed=11)
    out = C.clone_args(args)
    _triton().top_k_per_row_decode(*out, **overrides)
    _check_decode(args, out[3])


def _structured(rows, width, pattern, gen):
    pos = torch.arange(width, device=CUDA, dtype=torch.float32)
    noise = torch.randn(rows, width, device=CUDA, generator=gen)
    if pattern == "recent_run":  # the last 3000 tokens score higher
        return noise + 3.0 * (pos > width - 3000)
    if pattern == "trend":
        return noise + 3.0 * pos / width
    if pattern == "smooth":
        return noise * 0.3 + torch.sin(pos / 700.0) + torch.sin(pos / 53.0)
    if pattern == "clumps_of_16":  # 16 equal scores in a row: the granule a program owns
        return noise[:, ::16].repeat_interleave(16, dim=1)[:, :width].contiguous()
    return noise * 3.0


@pytest.mark.parametrize("pattern", ["normal", "recent_run", "trend", "smooth", "clumps_of_16"])
@pytest.mark.parametrize("width", [32768, 131072])
def test_structured_rows_take_the_fast_path(pattern, width):
    """Rows of these stay on the register selection, not the slow exact select over the
    row: the bound's margin covers a program's share of the top-k (12 sigma for scores
    drawn independently; clumps of 16 equal scores shrink it to ~3 sigma: ~0.5% of rows)."""
    rows, topk = 64, 2048
    gen = torch.Generator(device=CUDA).manual_seed(width)
    logits = _structured(rows, width, pattern, gen)
    seq_lens = torch.full((rows,), width, dtype=torch.int32, device=CUDA)
    idx = torch.empty(rows, topk, dtype=torch.int32, device=CUDA)
    pl = plan.two_launch_plan(rows, width, topk)
    scratch = [torch.empty(shape, dtype=dtype, device=CUDA) for shape, dtype in plan.specs(rows, pl.p1, pl.cap)]
    _triton().top_k_per_row_decode(logits, 1, seq_lens, idx, topk, scratch=scratch, rowwise=False)
    lo, hi, shift = decode_ranges(seq_lens, 1, width)
    paths = final_paths(scratch[0], scratch[1], pl, lo, hi, topk)
    allowed = 3 if pattern == "clumps_of_16" else 0
    assert set(paths) <= {"registers", "row"} and paths.count("row") <= allowed, (
        f"{pattern}: {paths.count('row')} of {rows} rows took the row fallback"
    )
    expected = torch.empty_like(idx)
    ref.top_k_per_row_decode(logits, 1, seq_lens, expected, topk)
    assert_topk_rows(logits, lo, hi, shift, expected, idx, topk)


# -- the one-launch decode kernel (one program a row): decode's plan from 32 rows -------
def _rowwise(args, cfg=None, **kw):
    """Run decode through the one-launch kernel; return the rows' (passes, outcome)."""
    logits = args[0]
    cfg = cfg or plan.rowwise_plan(logits.shape[1])
    meta = torch.full((logits.shape[0], cfg.warps, plan.NMETA), -1, dtype=torch.int32, device=CUDA)
    cand = torch.full((logits.shape[0], cfg.slots), -5, dtype=torch.int64, device=CUDA)
    out = C.clone_args(args)
    out[3].fill_(-7)
    _triton().top_k_per_row_decode(*out, rowwise=cfg, scratch=(meta, cand), **kw)
    _check_decode(args, out[3])
    return rowwise_outcomes(meta)


@pytest.mark.parametrize("mode", ["normal", "ties", "ties_inf", "neg_inf_rows"])
@pytest.mark.parametrize("width,lens", [(32768, "random"), (131072, "random"), (65536, "full"), (16384, "short")])
def test_rowwise_decode_matches_reference(width, lens, mode):
    assert plan.rowwise_applies(128, width, 2048), "the default decode plan at 128 rows"
    outcomes = _rowwise(_decode_args(128, width, mode, lens=lens, seed=width))
    collected = [o for o in outcomes if o != (-1, -1)]
    assert all(o[1] == 1 for o in collected), f"{mode}: rows the regions could not hold: {collected}"


@pytest.mark.parametrize("pattern", ["normal", "recent_run", "trend", "smooth", "clumps_of_16"])
@pytest.mark.parametrize("width", [32768, 131072])
def test_rowwise_structured_rows_take_one_pass(pattern, width):
    """The sample spans the row, so a run of high scores or a trend moves the bound, not
    the odds: every row is held by its first pass. Clumps of 16 equal scores make the
    sample coarser and the warps' shares lumpy: a few rows may need the second pass."""
    gen = torch.Generator(device=CUDA).manual_seed(width + 1)
    logits = _structured(128, width, pattern, gen)
    seq_lens = torch.full((128,), width, dtype=torch.int32, device=CUDA)
    args = (logits, 1, seq_lens, torch.empty(128, 2048, dtype=torch.int32, device=CUDA), 2048)
    outcomes = _rowwise(args)
    assert all(o[1] == 1 for o in outcomes), outcomes
    assert sum(o[0] == 2 for o in outcomes) <= (4 if pattern == "clumps_of_16" else 0), outcomes


ROW_LAYOUTS = {
    # name: (extra columns of the [rows, width + extra] buffer, logits from it, 16-byte paths)
    "aligned": (4, lambda x, w: x[:, :w].contiguous(), True),
    "width_not_a_multiple_of_4": (4, lambda x, w: x[:, :w - 1].contiguous(), False),
    "row_stride_not_a_multiple_of_4": (1, lambda x, w: x[:, :w], False),
    "start_not_16_byte_aligned": (4, lambda x, w: x[:, 1:w + 1], False),
}


@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("cfg", ["ROWWISE_NARROW", "ROWWISE"])
def test_rowwise_row_layouts(layout, cfg):
    """The pass's 16-byte loads where the rows allow them, 4-byte loads
    elsewhere; ragged lengths end rows inside a group of 4. Both plans at one width."""
    extra, make, vec = ROW_LAYOUTS[layout]
    gen = torch.Generator(device=CUDA).manual_seed(11)
    rows, width = 128, 32768
    buf = torch.randn(rows, width + extra, device=CUDA, generator=gen)
    logits = make(buf, width)
    assert _triton().vector_loads(logits) == vec
    w = logits.shape[1]
    seq_lens = torch.randint(w // 2, w + 1, (rows,), device=CUDA, generator=gen, dtype=torch.int32)
    seq_lens[:4] = torch.tensor([w, w - 1, w - 2, w - 3], dtype=torch.int32)
    args = (logits, 1, seq_lens, torch.empty(rows, 2048, dtype=torch.int32, device=CUDA), 2048)
    assert _rowwise(args, getattr(plan, cfg)) == [(1, 1)] * rows


@pytest.mark.parametrize("fill", [0.0, 0.3, float("-inf")])
def test_rowwise_rows_of_one_score(fill):
    # Every entry ties: the ties fill the regions from the top, one pass.
    logits = torch.full((128, 65536), fill, device=CUDA)
    seq_lens = torch.full((128,), 65536, dtype=torch.int32, device=CUDA)
    args = (logits, 1, seq_lens, torch.empty(128, 2048, dtype=torch.int32, device=CUDA), 2048)
    assert _rowwise(args) == [(1, 1)] * 128


@pytest.mark.parametrize("overrides,want", [
    ({"z": -8.0}, (2, 1)),  # a bound far too high: the second pass, RETRY_Z sigma out
    ({"slots_per_warp": 16}, (2, 2)),  # regions too small: the exact select over the row
])
def test_rowwise_retry_and_exact_paths(overrides, want):
    import dataclasses

    args = _decode_args(128, 65536, "normal", lens="full", seed=4)
    cfg = dataclasses.replace(plan.ROWWISE, **overrides)
    assert _rowwise(args, cfg) == [want] * 128


def test_all_equal_rows():
    # 0.3 has nonzero low mantissa bits; every entry ties: the ties fill the slots.
    logits = torch.full((16, 32768), 0.3, device=CUDA)
    seq_lens = torch.full((16,), 32768, dtype=torch.int32, device=CUDA)
    idx = torch.empty(16, 2048, dtype=torch.int32, device=CUDA)
    graphsafe.top_k_per_row_decode(logits, 1, seq_lens, idx, 2048)
    assert (idx >= 0).all() and all(len(set(r)) == 2048 for r in idx.tolist())


def test_repeated_calls_give_identical_results():
    """No atomics: slots come from prefix sums, so every call writes the same indices."""
    args = _decode_args(128, 131072, "normal", lens="random", seed=5)
    expected = C.clone_args(args)
    ref.top_k_per_row_decode(*expected)
    first = None
    for i in range(20):
        out = C.clone_args(args)
        out[3].fill_(-7)
        graphsafe.top_k_per_row_decode(*out)
        if first is None:
            first = out[3].clone()
            want = expected[3].long().sort(dim=1).values
            assert torch.equal(first.long().sort(dim=1).values, want), "random scores are distinct: sets must agree"
        assert torch.equal(out[3], first), f"call {i} differs from the first"


@pytest.mark.parametrize("rows", [16, 128])  # the two-launch plan, the one-launch kernel
def test_graph_replay_with_reserved_locked_workspace(rows):
    spec = graphsafe.get_op(DECODE)
    width = 65536
    static = C.clone_args(_decode_args(rows, width, lens="random", seed=1))
    fresh = _decode_args(rows, width, lens="random", seed=2)
    with graphsafe.workspace_lane(7):  # a fresh arena, sized only by the declared worst case
        manager = graphsafe.current_workspace_manager(CUDA)
        manager.reserve(nbytes=spec.workspace_bytes(num_rows=rows, width=width, topk=2048), owner="test")
        with manager.locked():
            spec.public(*C.clone_args(static))  # warm-up (compilation) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                spec.public(*static)
            for i in (0, 2):  # logits and seq_lens change between replays
                static[i].copy_(fresh[i])
            with no_sync():
                graph.replay()
            torch.cuda.synchronize()
    _check_decode(fresh, static[3])


def _ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def test_faster_than_the_reference_at_the_benchmark_shape():
    args = _decode_args(128, 131072, "normal", lens="full")
    out = C.clone_args(args)
    kernel = _ms(lambda: graphsafe.top_k_per_row_decode(*out))
    reference = _ms(lambda: ref.top_k_per_row_decode(*out))
    assert kernel < reference, f"triton {kernel:.3f} ms vs reference eager {reference:.3f} ms"


def test_aiter_adapter_on_rocm():
    pytest.importorskip("aiter")
    spec = graphsafe.get_op(DECODE)
    for params in case_for(spec.name).gpu_examples[:2]:
        args = case_for(spec.name).inputs(params, CUDA, 0)
        C.check_backend_matches_reference(spec, case_for(spec.name), "aiter", args, params)
    spec = graphsafe.get_op(PREFILL)
    params = case_for(spec.name).gpu_examples[0]
    C.check_backend_matches_reference(spec, case_for(spec.name), "aiter", case_for(spec.name).inputs(params, CUDA, 0), params)


@triton.jit
def _asm_probe(out_ptr, seed, lo_k, hi_k, sh, c_above, E: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    j = tl.arange(0, E)[:, None] * T + tl.arange(0, T)[None, :]
    key = ((j.to(tl.uint32) * 2654435761) ^ seed.to(tl.uint32)) >> 1  # keys in the ballots' layout
    buf = rowwise._shared_buffer(2 * T, ASM)
    # Targets 1, 2, 4, ..., 2^13 (past the 2^13 keys: bin 0), the halves of the buffer in
    # turn as the search's rounds use them.
    for i in tl.static_range(14):
        digit, above, n = rowwise._ranked_bin(key, lo_k.to(tl.uint32), hi_k.to(tl.uint32), sh, c_above, 1 << i,
                                              buf + (i % 2) * T * 4, E, T, ASM)
        tl.store(out_ptr + 3 * i, digit)
        tl.store(out_ptr + 3 * i + 1, above)
        tl.store(out_ptr + 3 * i + 2, n)


@pytest.mark.parametrize("lo,hi,sh,c_above", [
    (0, 2**31 - 1, 26, 0),  # every key, bins of 2^26
    (2**20, 2**28, 23, 5),  # a window, keys above it clamped into bin 31
    (2**29, 2**29 + 2**24, 19, 0),  # a narrow window
])
def test_rowwise_asm_bin_pick_matches_its_emulation(lo, hi, sh, c_above):
    """The PTX round (each lane counts its own bin by ballots, the warps' counts summed
    through shared memory, the suffix sums shuffled) against the portable code the
    interpreter runs, on 16 warps' worth of keys, for targets from the top bin to past
    the last key."""
    out = {}
    for asm in (True, False):
        buf = torch.full((46,), -9, dtype=torch.int32, device=CUDA)
        _asm_probe[(1,)](buf, 12345, lo, hi, sh, c_above, E=4, T=512, ASM=asm, num_warps=16)
        out[asm] = buf.tolist()
    assert out[True] == out[False]
    picks = [out[True][3 * i:3 * i + 3] for i in range(14)]
    assert len({tuple(p) for p in picks}) > 3 and out[True][42:] == [-9] * 4, picks


def test_bench_cold_timing_reads_from_hbm():
    """The bench's cold column (`time_graph_cold_ms`) must time a read from HBM: a 16 MiB
    sum, which back-to-back replays keep in the 50 MiB L2, reads no faster than the
    measured copy rate once L2 is flushed before each call."""
    from graphsafe.bench.harness import l2_bytes, measure_copy_bandwidth, time_graph_cold_ms, time_graph_ms

    x = torch.randn(4 << 20, device=CUDA)
    out = torch.empty((), device=CUDA)
    fn = lambda: torch.sum(x, dim=0, out=out)  # noqa: E731
    assert x.numel() * 4 < l2_bytes(CUDA), "the test needs an input that fits in L2"
    warm, cold = time_graph_ms(fn, CUDA), time_graph_cold_ms(fn, CUDA)
    copy_rate = measure_copy_bandwidth(CUDA)
    assert cold > warm * 0.9, (warm, cold)
    assert x.numel() * 4 / (cold / 1e3) <= 1.15 * copy_rate, (cold, copy_rate)
