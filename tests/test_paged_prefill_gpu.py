"""The sm_90 Gluon kernel of `paged_attention_prefill` (`gluon_prefill.paged_fwd_tma_kernel`:
the varlen TMA kernel walking the block table) on the GPU: against the float32 reference
and the Triton kernel on fresh inputs whose every unread cache row is NaN (blocks no
sequence owns, rows past a sequence's length in its last block), with padding block ids
(-1 and past the cache) inside sequences, block sizes 16 to 256, chunked prefill and
prefix-cache shapes, rows that see no key, empty sequences; CUDA-graph replay with new
lengths and tables; misaligned inputs on the Triton kernel; no host sync.
"""

from __future__ import annotations

import math

import pytest
import torch

import graphsafe
from graphsafe.ops.attention import plan, reference
from graphsafe.testing import no_sync

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _triton():
    from graphsafe.ops.attention import triton as T

    return T


def _paged_inputs(lens_q, lens_k, hq, hk, block_size, dtype, seed, padding=(), spare=3, d=128, table_cols=None,
                  num_blocks=None, q_rows=None, window_left=-1):
    """q [sum(lens_q) + 16, Hq, d] (its last 16 rows NaN: outside every sequence), caches
    of shuffled blocks, every row no sequence reads NaN (blocks no sequence owns, rows
    past a sequence's length in its last block), table entries past a sequence's last
    block -1; `padding`: (sequence, table column, id) entries overwritten with padding
    ids (-1 or >= the block count) inside sequences. `table_cols`, `num_blocks`, `q_rows`
    fix the table's columns, the cache's blocks and q's rows (a replay's new inputs).
    `window_left` >= 0: the keys before every query row's window are NaN too (no row reads
    them)."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    mb = table_cols or max(1, max(math.ceil(n / block_size) for n in lens_k))
    nb = num_blocks or len(lens_k) * mb + spare
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(lens_k), mb), -1, dtype=torch.int32)
    k_cache = torch.full((nb, block_size, hk, d), float("nan"), dtype=dtype, device=CUDA)
    v_cache = torch.full((nb, block_size, hk, d), float("nan"), dtype=dtype, device=CUDA)
    for b, n in enumerate(lens_k):
        used = math.ceil(n / block_size)
        table[b, :used] = torch.tensor(order[b * mb : b * mb + used], dtype=torch.int32)
        pos = torch.arange(n)
        blocks = table[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = torch.randn(n, hk, d, device=CUDA, dtype=dtype, generator=gen)
        v_cache[blocks, pos % block_size] = torch.randn(n, hk, d, device=CUDA, dtype=dtype, generator=gen)
        if window_left >= 0:
            unseen = pos[pos < n - lens_q[b] - window_left]
            k_cache[blocks[unseen], unseen % block_size] = float("nan")
            v_cache[blocks[unseen], unseen % block_size] = float("nan")
    for b, col, block_id in padding:
        table[b, col] = block_id
    tq = sum(lens_q)
    q = torch.randn(q_rows or tq + 16, hq, d, device=CUDA, dtype=dtype, generator=gen)
    q[tq:] = float("nan")
    cu = torch.tensor([0, *lens_q], dtype=torch.int64).cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, table.to(CUDA), torch.tensor(lens_k, dtype=torch.int32, device=CUDA), cu.to(CUDA)


def _float_reference(args):
    floats = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return reference.paged_attention_prefill(*floats).to(args[0].dtype)


def _chosen(args):
    """The Choice of this call (skips where the Gluon kernel does not serve it)."""
    choice = plan.choose_paged_attention_prefill(graphsafe.get_op("paged_attention_prefill").call(*args))
    if choice.gluon is None:
        pytest.skip("the paged Gluon kernel serves sm_90 GPUs only")
    return choice


def _assert_gluon_compiled():
    from graphsafe.ops.attention import triton as T

    assert not T._FAILED, f"a Gluon kernel did not compile for {T._FAILED}: Triton ran"


def _run_against_reference(args, choice):
    """(the call's output, the Triton kernel's with the plan's tiles, the float32 reference's,
    the max error of each of the first two against the reference) after asserting no Gluon
    compile failed (the call ran the Gluon kernel)."""
    T = _triton()
    actual = T.paged_attention_prefill(*args)
    triton_kernel = T.paged_attention_prefill(*args, config=choice.config)
    expected = _float_reference(args)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    err = (actual.float() - expected.float()).abs().max().item()
    triton_err = (triton_kernel.float() - expected.float()).abs().max().item()
    return actual, expected, err, triton_err


# (lens_q, lens_k, Hq, Hk, block size, dtype, causal, padding)
CASES = {
    "chunk-over-prefix-bs16": ([512, 300], [4096, 1000], 8, 2, 16, torch.bfloat16, True, ()),
    "prefix-cache-bs64-fp16": ([700, 129, 65], [900, 129, 2000], 8, 2, 64, torch.float16, True, ()),
    "whole-prompts-bs32": ([300, 1, 77, 1000], [300, 1, 77, 1000], 8, 2, 32, torch.bfloat16, True, ()),
    "not-causal-bs16": ([200, 90], [1000, 90], 4, 4, 16, torch.bfloat16, False, ()),
    "block-128": ([257, 130], [1029, 2000], 4, 1, 128, torch.bfloat16, True, ()),
    "block-256-spans-tiles": ([300, 100], [1300, 700], 4, 2, 256, torch.float16, True, ()),
    "padding-ids-bs16": ([300, 200], [2048, 700], 8, 2, 16, torch.bfloat16, True,
                         ((0, 3, -1), (0, 70, 1 << 20), (1, 10, -7))),
    "padding-ids-bs64-not-causal": ([150, 100], [640, 300], 4, 2, 64, torch.bfloat16, False, ((0, 2, -1),)),
    "rows-see-no-key": ([512, 10], [100, 10], 4, 2, 16, torch.bfloat16, True, ()),
    "empty-and-tiny": ([0, 65, 0, 200, 3], [5, 65, 0, 4000, 3], 8, 2, 16, torch.bfloat16, True, ()),
    "llama-8x512-over-4096": ([512] * 8, [4096] * 8, 32, 8, 16, torch.bfloat16, True, ()),
    "d64-bs16": ([512, 300], [4096, 1000], 8, 2, 16, torch.bfloat16, True, (), 64),
    "d64-padding-bs64-fp16": ([300, 200], [2048, 700], 8, 2, 64, torch.float16, True, ((0, 3, -1),), 64),
    "d256-padding-bs16": ([512, 300], [4096, 1000], 4, 2, 16, torch.bfloat16, True, ((0, 9, -1),), 256),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_gluon_kernel_against_reference(case):
    """The Gluon kernel (the default plain bf16/fp16 path on sm_90) against the float32
    reference: within twice the Triton kernel's error (or 2e-2), no NaN where the
    reference has none (NaN rows are never read), the rows outside every sequence 0."""
    lens_q, lens_k, hq, hk, bs, dtype, causal, padding, *d = CASES[case]
    d = d[0] if d else 128
    q, k_cache, v_cache, table, lens, cu = _paged_inputs(lens_q, lens_k, hq, hk, bs, dtype, seed=31, padding=padding,
                                                         d=d)
    args = (q, k_cache, v_cache, table, lens, cu, max(lens_q), d**-0.5, causal)
    choice = _chosen(args)
    assert choice.kernels == ("gluon-paged-tma", "triton")
    actual, expected, err, triton_err = _run_against_reference(args, choice)
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN exactly where the reference has NaN (nowhere)"
    assert not expected.isnan().any()
    print(f"{case}: Gluon max error {err:.3g}, Triton {triton_err:.3g}")
    assert err <= max(2 * triton_err, 2e-2), (err, triton_err)
    assert not actual[sum(lens_q) :].any(), "rows outside every sequence are 0"


# name: (lens_q, lens_k, block size, causal, window_left, softcap, sinks)
VARIANT_CASES = {
    "window-100-bs16": ([512, 300], [4096, 1000], 16, True, 100, 0.0, False),
    "window-700-not-causal-bs64": ([300, 129], [2000, 700], 64, False, 700, 0.0, False),
    "window-0-bs16": ([200], [900], 16, True, 0, 0.0, False),
    "softcap-30-bs16": ([512, 77], [3000, 900], 16, True, -1, 30.0, False),
    "sinks-bs64": ([512, 300], [600, 300], 64, True, -1, 0.0, True),
    "all-three-bs16": ([512, 200, 65], [4096, 1000, 65], 16, True, 127, 50.0, True),
    "gpt-oss-d64-sinks-window-bs16": ([512, 200], [4096, 1000], 16, True, 127, 0.0, True, 64),
    "d64-sinks-bs64": ([512, 65], [1000, 65], 64, True, -1, 0.0, True, 64),
    "gemma-d256-window-softcap-bs16": ([512, 200], [4096, 1000], 16, True, 1023, 50.0, False, 256),
}


@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_paged_gluon_variants_against_reference(case):
    """Sliding window, logit softcap and sinks (the kernel's constexprs) against the float32
    reference and the Triton kernel; keys before every row's window are NaN (never read)."""
    lens_q, lens_k, bs, causal, window_left, softcap, with_sinks, *d = VARIANT_CASES[case]
    d = d[0] if d else 128
    q, k_cache, v_cache, table, lens, cu = _paged_inputs(lens_q, lens_k, 8, 2, bs, torch.bfloat16, seed=36,
                                                         window_left=window_left, d=d)
    sinks = torch.randn(8, device=CUDA) * 2 if with_sinks else None
    args = (q, k_cache, v_cache, table, lens, cu, max(lens_q), d**-0.5, causal, None, None, window_left, softcap,
            sinks)
    choice = _chosen(args)
    actual, expected, err, triton_err = _run_against_reference(args, choice)
    assert not expected.isnan().any() and not actual.isnan().any()
    assert err <= max(2 * triton_err, 2e-2), (err, triton_err)


def test_paged_gluon_graph_replay_with_new_lengths_and_tables():
    """Captured once, replayed with other lengths, a rewritten block table and new q and
    cache values, under sync-debug "error": each replay matches the reference."""
    lens_q, lens_k = [400, 300], [1500, 1000]
    q, k_cache, v_cache, table, lens, cu = _paged_inputs(lens_q, lens_k, 8, 2, 16, torch.bfloat16, seed=32)
    args = (q, k_cache, v_cache, table, lens, cu, 512, 128**-0.5, True)
    _chosen(args)
    runner = _triton().prepare_paged_attention_prefill(graphsafe.get_op("paged_attention_prefill").call(*args))
    runner(*args)  # warm-up: the kernels compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner(*args)
    _assert_gluon_compiled()
    for new_q, new_k in (([512, 188], [1500, 900]), ([100, 512], [300, 512]), ([512, 0], [512, 0])):
        new = _paged_inputs(new_q, new_k, 8, 2, 16, torch.bfloat16, seed=34 + new_q[1], table_cols=table.shape[1],
                            num_blocks=k_cache.shape[0], q_rows=q.shape[0])
        for old, fresh in zip((q, k_cache, v_cache, table, lens, cu), new, strict=True):
            old.copy_(fresh)
        with no_sync():
            graph.replay()
        expected = _float_reference(args)
        torch.cuda.synchronize()
        err = (out.float() - expected.float()).abs().max().item()
        assert not out.isnan().any() and err < 2e-2, (new_q, new_k, err)


def test_paged_gluon_misaligned_q_runs_the_triton_kernel():
    """q as a view at a 1-element (2-byte) offset: the call of the Gluon kernel's signature
    runs the Triton kernel (bit-equal to it) and matches the aligned call."""
    q, k_cache, v_cache, table, lens, cu = _paged_inputs([300, 200], [1000, 200], 8, 2, 16, torch.bfloat16, seed=35)
    shifted = torch.empty(q.numel() + 1, device=CUDA, dtype=q.dtype)[1:].view(q.shape)
    shifted.copy_(q)
    rest = (k_cache, v_cache, table, lens, cu, 300, 128**-0.5, True)
    choice = _chosen((shifted, *rest))
    T = _triton()
    aligned = T.paged_attention_prefill(q, *rest)
    misaligned = T.paged_attention_prefill(shifted, *rest)
    triton_kernel = T.paged_attention_prefill(shifted, *rest, config=choice.config)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    assert torch.equal(misaligned, triton_kernel), "the misaligned call ran the Triton kernel"
    assert (misaligned.float() - aligned.float()).abs().max().item() < 2e-2


def test_paged_gluon_head_sections_match_one_section(monkeypatch):
    """The paged kernel's work tiles section by section of heads (`plan.L2_SECTION_BYTES`
    set so that 3 kv heads make a section of two and a narrower last one) against every
    head in one section: the same bits, and the reference's values."""
    hq, hk = 12, 3
    q, k_cache, v_cache, table, lens, cu = _paged_inputs([400, 1, 300], [1500, 1, 1000], hq, hk, 16, torch.bfloat16,
                                                         seed=36)
    args = (q, k_cache, v_cache, table, lens, cu, 400, 128**-0.5, True)
    _chosen(args)
    call = graphsafe.get_op("paged_attention_prefill").call(*args)
    max_len = table.shape[1] * 16
    monkeypatch.setattr(plan, "L2_SECTION_BYTES", 2 * max_len * 2 * 128 * 2)
    assert plan.tma_heads_per_section(hq, hk, max_len, 128, 128, 2) == 8
    sections = _triton().prepare_paged_attention_prefill(call)
    monkeypatch.setattr(plan, "L2_SECTION_BYTES", None)
    whole = _triton().prepare_paged_attention_prefill(call)
    expected = whole(*args).clone()
    out = sections(*args)
    reference_out = _float_reference(args)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    assert torch.equal(out, expected)
    assert (out.float() - reference_out.float()).abs().max().item() < 2e-2
