"""MLA attention on the GPU: DeepSeek shapes against the reference (bf16 included, which
the CPU interpreter cannot check), CUDA-graph capture at one set of lengths/indices and
replay with others, no host sync, workspace sized by the published worst case, and a
loose bandwidth floor. Skipped without a CUDA/HIP device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.mla.bench import TUNE_TILES, decode_inputs, fp8_cache, sparse_inputs, with_fp8_cache
from graphsafe.bench.harness import measure_copy_bandwidth, measure_matmul_peak, time_ms
from graphsafe.ops.mla import mla_decode_workspace_specs, sparse_mla_workspace_specs
from graphsafe.ops.mla import reference as ref
from graphsafe.ops.mla import plan as mla_plan
from graphsafe.ops.mla import triton as tri
from graphsafe.testing import no_sync
from graphsafe.ops.mla import cases as cases
from graphsafe.workspace import current_workspace_manager

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
R, D = 512, 576
# out: relative to the output's magnitude (p is rounded to the input dtype before p @ V)
OUT_RTOL = {torch.bfloat16: 2**-6, torch.float16: 2**-8}


def _close(expected, actual):
    (e_out, e_lse), (a_out, a_lse) = expected, actual
    assert not torch.isnan(a_out).any() and not torch.isnan(a_lse).any()
    tol = OUT_RTOL[e_out.dtype]
    scale = e_out.float().abs().amax().clamp(min=1e-3)
    torch.testing.assert_close(a_out.float(), e_out.float(), rtol=tol, atol=tol * scale)
    assert torch.equal(torch.isneginf(a_lse), torch.isneginf(e_lse))
    torch.testing.assert_close(a_lse, e_lse, rtol=1e-4, atol=1e-4)


def _random_lens(batch, capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, capacity + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = 0, capacity  # an empty and a full request
    return lens.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_deepseek_shapes_match_reference(dtype, heads, num_splits):
    q, kv, bt, lens, scale, r = decode_inputs(24, heads, 4096, CUDA, seed=1, dtype=dtype)
    lens = _random_lens(24, 4096, 1)
    args = (q, kv, bt, lens, scale, r)
    _close(ref.mla_decode(*args), tri.mla_decode(*args, num_splits=num_splits))


def test_decode_long_context_matches_reference():
    q, kv, bt, _, scale, r = decode_inputs(4, 16, 32768, CUDA, seed=2)
    lens = torch.tensor([32768, 1, 20000, 31], dtype=torch.int32, device=CUDA)
    args = (q, kv, bt, lens, scale, r)
    _close(ref.mla_decode(*args), graphsafe.mla_decode(*args))


@pytest.mark.parametrize("heads", [16, 128])
def test_lone_long_request_uses_many_splits_and_matches_reference(heads):
    """B = 1 at 32k tokens: the plan spreads the request over the GPU (256 splits of 128
    tokens for 16 heads), and the combine merges them."""
    q, kv, bt, _, scale, r = decode_inputs(1, heads, 32768, CUDA, seed=14)
    _, plan = mla_plan.plan_launch(1, heads, 32768, CUDA)
    assert plan.num_splits >= 64, plan
    for n in (32768, 30001, 5):
        args = (q, kv, bt, torch.tensor([n], dtype=torch.int32, device=CUDA), scale, r)
        _close(ref.mla_decode(*args), graphsafe.mla_decode(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_sparse_deepseek_shapes_match_reference(dtype, heads, num_splits):
    q, kv, idx, scale, r = sparse_inputs(32, heads, 2048, CUDA, seed=3, dtype=dtype)
    idx[1] = -1  # a token without keys
    idx[2, 700:] = -1  # later splits empty
    idx[3, ::3] = idx[3, 1::3][: idx[3, ::3].shape[0]]  # duplicates
    _close(ref.sparse_mla(q, kv, idx, scale, r), tri.sparse_mla(q, kv, idx, scale, r, num_splits=num_splits))


def _gluon_serves_fp8(q, kv, heads) -> bool:
    """Whether this device runs the fp8_ds_mla cache on the Gluon kernel (sm_90), with the
    tiles the runner picks for `heads`."""
    cfg = mla_plan.few_heads_wide_tiles(heads, CUDA) or mla_plan.fp8_ds_kernel_config(heads, CUDA)
    return mla_plan.warpgroup_split_applies(q, kv, cfg, R, D - R)


def _fp8_close(expected, actual, args):
    out, lse = actual
    assert not out.isnan().any() and not lse.isnan().any()
    cases.compare_attention(expected, actual, args, args, None)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_fp8_ds_decode_deepseek_shapes_match_reference(heads, block_size, num_splits):
    """DeepSeek's fp8_ds_mla records (656 bytes a key) on the kernel this device runs
    (sm_90: at 128 heads the producer kernel, `mla_plan.fp8_producer_fits`; at 16 heads the
    warp-specialised few-heads kernel, `mla_plan.few_heads_fp8_fits`),
    against the reference over the dequantized records: random lengths with an empty
    and a full request, a padding block inside a request, garbage ids past the ends;
    records no request reads hold 0xFF (NaN bytes, NaN scales) and change no output bit."""
    q, kv, bt, _, scale, r = decode_inputs(12, heads, 2048, CUDA, seed=11)
    kv = fp8_cache(kv.view(-1, block_size, D))
    bt = torch.randperm(kv.shape[0], device=CUDA)[: 12 * (2048 // block_size)].view(12, -1).int()
    lens = _random_lens(12, 2048, 11)
    lens[3] = 700
    bt[3, 700 // block_size + 1 :] = 10**6  # past the end: never read
    bt[4, 1] = -1  # a padding block: no key
    assert _gluon_serves_fp8(q, kv, heads) == (torch.cuda.get_device_capability(CUDA) == (9, 0))
    args = (q, kv, bt, lens, scale, r)
    out = tri.mla_decode(*args, num_splits=num_splits)
    _fp8_close(ref.mla_decode(*args), out, args)
    _, _, read = cases.decode_reads(kv, bt, lens)
    dirty = kv.clone()
    dirty[~read.to(CUDA)] = 0xFF
    poisoned = tri.mla_decode(q, dirty, bt, lens, scale, r, num_splits=num_splits)
    assert torch.equal(out[0], poisoned[0]) and torch.equal(out[1], poisoned[1])


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("options", [False, True])
def test_fp8_ds_sparse_deepseek_shapes_match_reference(heads, num_splits, options):
    """sparse_mla over fp8_ds_mla records (sm_90: the producer kernel at 128 heads, the
    heads-on-N kernel at 16), with and without
    the sink and `topk_length`; a token without keys, empty later splits, ids outside the
    cache; unread records poisoned with 0xFF change no output bit."""
    q, kv, idx, scale, r = sparse_inputs(24, heads, 2048, CUDA, seed=12)
    kv = fp8_cache(kv)
    idx[1] = -1
    idx[2, 700:] = -1
    idx[3, ::5] = -7
    idx[4, ::3] = kv.shape[0] * kv.shape[1]  # one past the cache
    sink = torch.randn(heads, device=CUDA) if options else None
    lengths = torch.randint(0, 2049, (24,), device=CUDA, dtype=torch.int32) if options else None
    if options:
        lengths[:4] = torch.tensor([0, 1, 65, 2048], dtype=torch.int32)
    assert _gluon_serves_fp8(q, kv, heads) == (torch.cuda.get_device_capability(CUDA) == (9, 0))
    args = (q, kv, idx, scale, r, sink, lengths)
    out = tri.sparse_mla(*args, num_splits=num_splits)
    _fp8_close(ref.sparse_mla(*args), out, args)
    _, read = cases.sparse_reads(kv, idx, lengths)
    dirty = kv.clone()
    dirty[~read.to(CUDA)] = 0xFF
    poisoned = tri.sparse_mla(q, dirty, idx, scale, r, sink, lengths, num_splits=num_splits)
    assert torch.equal(out[0], poisoned[0]) and torch.equal(out[1], poisoned[1])


@pytest.mark.parametrize("heads", [64, 128])
def test_fp8_ds_past_16_heads_runs_the_producer_kernel(monkeypatch, heads):
    """On sm_90 both ops over fp8_ds_mla records past 16 heads run the kernel whose producer
    warpgroup dequantises (`mla_plan.fp8_producer_fits`); its outputs equal the 64-head
    kernel's dequantising variant (the fallback, forced here) to the rounding of p, dense
    and sparse, with splits."""
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90")
    q, kv, idx, scale, r = sparse_inputs(20, heads, 2048, CUDA, seed=21)
    kv = fp8_cache(kv)
    idx[2, ::7] = -1
    sparse = (q, kv, idx, scale, r)
    qd, kvd, bt, _, _, _ = decode_inputs(6, heads, 4096, CUDA, seed=22)
    kvd = fp8_cache(kvd)
    dense = (qd, kvd, bt, _random_lens(6, 4096, 22), scale, r)
    for op, args in (("sparse_mla", sparse), ("mla_decode", dense)):
        choice = mla_plan.choose(graphsafe.get_op(op).call(*args), sparse=op == "sparse_mla")
        assert choice.kernels[:2] == (mla_plan.GLUON_FP8_PRODUCER, mla_plan.GLUON_WGMMA), choice.kernels
    producer = (tri.sparse_mla(*sparse, num_splits=3), tri.mla_decode(*dense, num_splits=3))
    monkeypatch.setattr(mla_plan, "fp8_producer_fits", lambda *a: False)
    cfg = mla_plan.fp8_ds_kernel_config(heads, CUDA)  # (a config: a runner of its own, prepared now)
    wgmma = (tri.sparse_mla(*sparse, config=cfg, num_splits=3), tri.mla_decode(*dense, config=cfg, num_splits=3))
    for (p_out, p_lse), (w_out, w_lse) in zip(producer, wgmma):
        torch.testing.assert_close(p_out.float(), w_out.float(), rtol=2**-6, atol=2**-6 * w_out.float().abs().amax())
        assert torch.equal(torch.isneginf(p_lse), torch.isneginf(w_lse))
        torch.testing.assert_close(p_lse, w_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "dtype"), [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)])
def test_16_bit_sparse_past_16_heads_runs_the_rows_producer(monkeypatch, heads, dtype):
    """On sm_90 `sparse_mla` over a 16-bit cache past 16 heads runs the producer kernel with
    a producer warpgroup copying rows (`mla_plan.rows_producer_fits`); its outputs equal the
    64-head kernel's (the fallback, forced here) to the rounding of p, with splits, padding
    ids, the sink and topk_length; no NaN of an unread cache row reaches them."""
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90")
    q, kv, idx, scale, r = sparse_inputs(20, heads, 2048, CUDA, seed=23, dtype=dtype)
    idx[2, ::7] = -1
    read = torch.zeros(kv.shape[0] * kv.shape[1], dtype=torch.bool, device=CUDA)
    read[idx[idx >= 0].long()] = True
    kv.view(-1, kv.shape[-1])[~read] = float("nan")  # rows no index names: never read
    sink = torch.randn(heads, device=CUDA)
    lengths = torch.randint(0, 2049, (20,), device=CUDA, dtype=torch.int32)
    call = graphsafe.get_op("sparse_mla").call(q, kv, idx, scale, r)
    assert mla_plan.choose(call, sparse=True).kernels[:2] == (mla_plan.GLUON_FP8_PRODUCER, mla_plan.GLUON_WGMMA)
    producer = (tri.sparse_mla(q, kv, idx, scale, r, num_splits=3), tri.sparse_mla(q, kv, idx, scale, r, sink, lengths))
    monkeypatch.setattr(mla_plan, "ROWS_PRODUCER", False)
    cfg = mla_plan.kernel_config(heads, "cuda", mla_plan.max_shared_memory(CUDA))  # (a runner of its own)
    assert mla_plan.choose(call, sparse=True, config=cfg).kernels[0] == mla_plan.GLUON_WGMMA
    wgmma = (tri.sparse_mla(q, kv, idx, scale, r, config=cfg, num_splits=3),
             tri.sparse_mla(q, kv, idx, scale, r, sink, lengths, config=cfg))
    for (p_out, p_lse), (w_out, w_lse) in zip(producer, wgmma):
        assert not p_out.isnan().any()
        torch.testing.assert_close(p_out.float(), w_out.float(), rtol=OUT_RTOL[dtype],
                                   atol=OUT_RTOL[dtype] * w_out.float().abs().amax())
        assert torch.equal(torch.isneginf(p_lse), torch.isneginf(w_lse))
        torch.testing.assert_close(p_lse, w_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_ds_decode_graph_replays_long_lengths_in_the_published_workspace(heads):
    """A decode step over fp8_ds_mla records captured at length 1 replays full, empty and
    random lengths, its partials inside the published (locked) workspace."""
    batch, capacity = 16, 4096
    q, kv, bt, _, scale, r = decode_inputs(batch, heads, capacity, CUDA, seed=13)
    kv = fp8_cache(kv)
    lens = torch.ones(batch, dtype=torch.int32, device=CUDA)
    ws = current_workspace_manager(CUDA)
    ws.reserve(*mla_decode_workspace_specs(batch, heads, r, capacity, device=CUDA))
    with ws.locked():
        graph, (out, lse) = _capture(lambda *a: graphsafe.mla_decode(*a, scale, r), (q, kv, bt, lens))
        for new_lens in (torch.full((batch,), capacity), torch.zeros(batch), _random_lens(batch, capacity, 14)):
            lens.copy_(new_lens.to(torch.int32))
            q.copy_(torch.randn_like(q))
            graph.replay()
            torch.cuda.synchronize()
            _fp8_close(ref.mla_decode(q, kv, bt, lens, scale, r), (out, lse), (q, kv))
    del graph
    ws.forget_captures()


@pytest.mark.parametrize("tiles", [(128, t) for t in TUNE_TILES[128]] + [(16, t) for t in TUNE_TILES[16]], ids=str)
def test_tuning_and_fallback_tiles_match_reference(tiles):
    """Every tile set the tune bench times (the fallbacks for GPUs with less shared memory
    among them) is correct, dense and sparse, with splits."""
    heads, t = tiles
    cfg = mla_plan.KernelConfig(*t)
    q, kv, bt, _, scale, r = decode_inputs(6, heads, 2048, CUDA, seed=11)
    args = (q, kv, bt, _random_lens(6, 2048, 11), scale, r)
    _close(ref.mla_decode(*args), tri.mla_decode(*args, config=cfg))
    _close(ref.mla_decode(*args), tri.mla_decode(*args, config=cfg, num_splits=3))
    q, kv, idx, scale, r = sparse_inputs(6, heads, 2048, CUDA, seed=12)
    idx[1, 500:] = -1
    _close(ref.sparse_mla(q, kv, idx, scale, r), tri.sparse_mla(q, kv, idx, scale, r, config=cfg, num_splits=2))


def _sm90():
    if torch.version.hip is not None or torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("sm_90 only")


def test_wide_tiles_fit_the_shared_memory_of_hopper():
    """128 heads run 64x64 tiles: the Gluon kernel (224 KiB of shared memory) by default,
    the Triton kernel with 2 stages (216 KiB) when asked. If this Triton needs more, the
    Gluon launch falls back to the Triton kernel, and that one to one stage (correct,
    slower): flag both."""
    _sm90()
    cfg, _ = mla_plan.plan_launch(4, 128, 4096, CUDA)
    assert (cfg.block_n, cfg.value_chunks, cfg.warpgroup_split) == (64, 2, True), (cfg, mla_plan.max_shared_memory(CUDA))
    q, kv, bt, lens, scale, r = decode_inputs(4, 128, 4096, CUDA, seed=13)
    assert mla_plan.warpgroup_split_applies(q, kv, cfg, r, q.shape[-1] - r)
    tri.mla_decode(q, kv, bt, lens, scale, r)
    tri.sparse_mla(*sparse_inputs(4, 128, 2048, CUDA, seed=13))
    assert not tri._GLUON_FAILED, f"the Gluon kernel did not compile: {tri._GLUON_FAILED}"
    triton_cfg = dataclasses.replace(cfg, warpgroup_split=False)
    tri.mla_decode(q, kv, bt, lens, scale, r, config=triton_cfg)
    launched = [n for key, n in tri._STAGES.items() if key[0] == triton_cfg]
    assert launched and set(launched) == {triton_cfg.num_stages}, f"stages {launched}: this Triton needs more shared memory"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r", [512, 256])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_warpgroup_split_kernel_edges_match_reference(dtype, r, block_size):
    """The Gluon kernel's own edges: a partial second head tile (80 heads), cache blocks
    of 1, 16 and 64 rows, lengths at and around the 64-key tile (0, 1, 63, 64, 65, 127,
    full), R = 256, sparse slots that are -1, out of range or repeated, with and without
    splits. Before each call, NaN blocks of the outputs' sizes are freed into the caching
    allocator, which hands them back as the outputs: an unwritten element shows as NaN."""
    _sm90()
    gen = torch.Generator(device=CUDA).manual_seed(21)
    heads, p, capacity = 80, 64, 1024
    lens = torch.tensor([0, 1, 63, 64, 65, 127, 1000, capacity], dtype=torch.int32, device=CUDA)
    batch = lens.numel()
    num_blocks = batch * capacity // block_size + 3
    kv = torch.randn(num_blocks, block_size, r + p, generator=gen, device=CUDA, dtype=dtype)
    bt = torch.randperm(num_blocks, generator=gen, device=CUDA)[: batch * capacity // block_size]
    bt = bt.view(batch, -1).to(torch.int32)
    q = torch.randn(batch, heads, r + p, generator=gen, device=CUDA, dtype=dtype)
    scale = (r + p) ** -0.5
    cfg, _ = mla_plan.plan_launch(batch, 128, capacity, CUDA)
    assert mla_plan.warpgroup_split_applies(q, kv, cfg, r, p)
    def poisoned(call):
        for numel, dt in ((batch * heads * r, dtype), (batch * heads, torch.float32)):
            del_me = torch.full((numel,), float("nan"), dtype=dt, device=CUDA)
            del del_me
        return call()

    for num_splits in (None, 1, 3):
        expected = ref.mla_decode(q, kv, bt, lens, scale, r)
        _close(expected, poisoned(lambda: tri.mla_decode(q, kv, bt, lens, scale, r, config=cfg, num_splits=num_splits)))
    slots = num_blocks * block_size
    idx = torch.randint(0, slots, (batch, 300), generator=gen, device=CUDA, dtype=torch.int32)
    idx[0] = -1
    idx[1, 1:] = -1
    idx[2, 63:] = -1
    idx[3, ::5] = slots + 7  # out of range: no key
    idx[4, 1::2] = idx[4, ::2]
    for num_splits in (None, 1, 3):
        expected = ref.sparse_mla(q, kv, idx, scale, r)
        _close(expected, poisoned(lambda: tri.sparse_mla(q, kv, idx, scale, r, config=cfg, num_splits=num_splits)))
    assert not tri._GLUON_FAILED, tri._GLUON_FAILED


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("heads", [128, 80, 16])
def test_paged_tma_kernel_matches_reference(monkeypatch, dtype, page, heads):
    """The dense decode's TMA kernel (kernels/gluon_paged_tma.py) on its own edges: lengths at and
    around the 64-key tile and the tile pair (0, 1, 63, 64, 65, 127, 128, 129, full),
    block ids outside the cache inside a sequence (-1, past the end, negative), NaN in the
    cache rows past each sequence's end (the cut tile's rows TMA reads), a partial head
    tile (80 heads), 16 heads (their own plan on the 64-head tiles), with and without
    splits; outputs poisoned (NaN blocks freed into the caching allocator). Every call runs
    the paged kernel: its fallback never runs."""
    _sm90()
    fallbacks = []
    paged = tri._paged_launch

    def counted(grid, q, kv, r, scalars, bs, split, where, fallback):
        return paged(grid, q, kv, r, scalars, bs, split, where, lambda *a: fallbacks.append(1) or fallback(*a))

    monkeypatch.setattr(tri, "_paged_launch", counted)
    gen = torch.Generator(device=CUDA).manual_seed(page + heads)
    r, p, capacity = 512, 64, 1024
    lens = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129, 1000, capacity, 700], dtype=torch.int32, device=CUDA)
    batch = lens.numel()
    num_blocks = batch * capacity // page + 3
    kv = torch.randn(num_blocks, page, r + p, generator=gen, device=CUDA, dtype=dtype)
    bt = torch.randperm(num_blocks, generator=gen, device=CUDA)[: batch * capacity // page]
    bt = bt.view(batch, -1).to(torch.int32)
    bt[8, 2], bt[8, 5], bt[10, 0] = -1, num_blocks + 5, -7  # no keys there (the reference agrees)
    for b, n in enumerate(lens.tolist()):  # NaN past each sequence's end in its last page
        if n % page:
            kv[bt[b, n // page].clamp(0, num_blocks - 1), n % page:] = float("nan")
    q = torch.randn(batch, heads, r + p, generator=gen, device=CUDA, dtype=dtype)
    scale = (r + p) ** -0.5
    cfg = mla_plan.few_heads_wide_tiles(heads, CUDA) or mla_plan.plan_launch(batch, heads, capacity, CUDA)[0]
    assert mla_plan.paged_tma_fits(q, kv, cfg, r, p)
    for num_splits in (None, 1, 3):
        expected = ref.mla_decode(q, kv, bt, lens, scale, r)
        for numel, dt in ((batch * heads * r, dtype), (batch * heads, torch.float32)):
            del_me = torch.full((numel,), float("nan"), dtype=dt, device=CUDA)
            del del_me
        _close(expected, tri.mla_decode(q, kv, bt, lens, scale, r, num_splits=num_splits))
    assert not fallbacks and not tri._GLUON_FAILED, tri._GLUON_FAILED


@pytest.mark.parametrize("layout", ["q_rows_16", "q_rows_8", "cache_rows_8"])
def test_warpgroup_split_takes_strided_inputs_it_can_copy(layout):
    """Row strides that are multiples of 16 elements run the Gluon kernel on strided views;
    others (its 16-byte copies would not compile) run the Triton kernel. Both match."""
    _sm90()
    q, kv, bt, lens, scale, r = decode_inputs(6, 128, 2048, CUDA, seed=22)
    lens = _random_lens(6, 2048, 22)
    pad = 8 if layout.endswith("_8") else 16
    if layout.startswith("q"):
        q = torch.cat([q, torch.randn(*q.shape[:2], pad, device=CUDA, dtype=q.dtype)], -1)[..., : q.shape[-1]]
    else:
        kv = torch.cat([kv, torch.randn(*kv.shape[:2], pad, device=CUDA, dtype=kv.dtype)], -1)[..., : kv.shape[-1]]
    cfg, _ = mla_plan.plan_launch(6, 128, 2048, CUDA)
    assert mla_plan.warpgroup_split_applies(q, kv, cfg, r, q.shape[-1] - r) == (pad == 16)
    args = (q, kv, bt, lens, scale, r)
    _close(ref.mla_decode(*args), tri.mla_decode(*args))
    _close(ref.mla_decode(*args), tri.mla_decode(*args, num_splits=3))
    assert not tri._GLUON_FAILED, tri._GLUON_FAILED


def test_triton_serves_cuda_on_nvidia():
    if torch.version.hip is None:
        assert graphsafe.get_op("mla_decode").serving_backend("cuda") == "triton"
        assert graphsafe.get_op("sparse_mla").serving_backend("cuda") == "triton"


@pytest.fixture(autouse=True)
def _release_captures():
    """Graphs here are dropped at the end of each test: let the arena grow again after."""
    yield
    torch.cuda.synchronize()
    current_workspace_manager(CUDA).forget_captures()


def _capture(fn, static_args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    return graph, out


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_graph_captured_at_short_lengths_replays_long_ones(heads):
    """The vLLM #51119 scenario: capture with tiny seq_lens, replay with long and empty."""
    batch, capacity = 16, 8192
    q, kv, bt, _, scale, r = decode_inputs(batch, heads, capacity, CUDA, seed=4)
    lens = torch.ones(batch, dtype=torch.int32, device=CUDA)
    ws = current_workspace_manager(CUDA)
    ws.reserve(*mla_decode_workspace_specs(batch, heads, r, capacity, device=CUDA))
    with ws.locked():
        graph, (out, lse) = _capture(lambda *a: graphsafe.mla_decode(*a, scale, r), (q, kv, bt, lens))
        for seed, new_lens in enumerate([torch.full((batch,), capacity), torch.zeros(batch), _random_lens(batch, capacity, 5)]):
            lens.copy_(new_lens.to(torch.int32))
            q.copy_(torch.randn_like(q))
            bt.copy_(bt[torch.randperm(batch, device=CUDA)])
            graph.replay()
            torch.cuda.synchronize()
            _close(ref.mla_decode(q, kv, bt, lens, scale, r), (out, lse))
    del graph


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("cache", ["bf16", "fp8_ds_mla"])
def test_sparse_graph_replays_with_new_indices(heads, cache):
    tokens, topk = 24, 2048
    q, kv, idx, scale, r = sparse_inputs(tokens, heads, topk, CUDA, seed=6)
    if cache == "fp8_ds_mla":
        kv = fp8_cache(kv)
    fresh = idx.clone()
    idx.fill_(-1)
    ws = current_workspace_manager(CUDA)
    ws.reserve(*sparse_mla_workspace_specs(tokens, heads, r, topk, device=CUDA))
    with ws.locked():
        graph, (out, lse) = _capture(lambda *a: graphsafe.sparse_mla(*a, scale, r), (q, kv, idx))
        partial = fresh.clone()
        partial[::2, 100:] = -1
        for new in (fresh, partial, torch.full_like(fresh, -1)):
            idx.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            if cache == "fp8_ds_mla":
                _fp8_close(ref.sparse_mla(q, kv, idx, scale, r), (out, lse), (q, kv))
            else:
                _close(ref.sparse_mla(q, kv, idx, scale, r), (out, lse))
    del graph


def test_decode_step_with_cache_write_in_one_graph():
    """concat_and_cache_mla then mla_decode, captured once, replayed with new tokens."""
    batch, capacity, heads = 8, 2048, 16
    q, kv, bt, _, scale, r = decode_inputs(batch, heads, capacity, CUDA, seed=7)
    lens = torch.full((batch,), 100, dtype=torch.int32, device=CUDA)
    kv_c = torch.randn(batch, R, device=CUDA, dtype=kv.dtype)
    k_pe = torch.randn(batch, D - R, device=CUDA, dtype=kv.dtype)
    slots = torch.zeros(batch, dtype=torch.int64, device=CUDA)

    def step(q, kv_c, k_pe, kv, slots, bt, lens):
        graphsafe.concat_and_cache_mla(kv_c, k_pe, kv, slots)
        return graphsafe.mla_decode(q, kv, bt, lens, scale, r)

    def slots_of(lens):  # the new token is the last of each request
        pos = (lens - 1).long()
        return bt[torch.arange(batch, device=CUDA), pos // 64].long() * 64 + pos % 64

    slots.copy_(slots_of(lens))
    graph, (out, lse) = _capture(step, (q, kv_c, k_pe, kv, slots, bt, lens))
    for new_len in (1, 777, capacity):
        lens.fill_(new_len)
        slots.copy_(slots_of(lens))
        kv_c.copy_(torch.randn_like(kv_c))
        k_pe.copy_(torch.randn_like(k_pe))
        eager_kv = kv.clone()
        graph.replay()
        expected = step(q, kv_c, k_pe, eager_kv, slots, bt, lens)
        torch.cuda.synchronize()
        assert torch.equal(kv, eager_kv)
        _close(expected, (out, lse))
    del graph


@pytest.mark.parametrize("cache", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_no_host_sync_at_deepseek_shapes(op, heads, cache):
    """A second call (its kernel bound at the first) runs under sync-debug "error": on sm_90
    the fp8_ds_mla cache reaches the producer kernel at 128 heads and the few-heads one at 16."""
    if op == "mla_decode":
        args = decode_inputs(64, heads, 8192, CUDA)
        args = (*args[:3], _random_lens(64, 8192, 8), *args[4:])
    else:
        args = sparse_inputs(64, heads, 2048, CUDA)
    if cache == "fp8_ds_mla":
        args = with_fp8_cache(args)
    fn = getattr(graphsafe, op)
    fn(*args)
    torch.cuda.synchronize()
    with no_sync():
        fn(*args)
    torch.cuda.synchronize()


@pytest.mark.parametrize("heads", [16, 128])
def test_inductor_fullgraph_decode_step(heads):
    params = {**cases.EXAMPLE_DECODE, **cases.DEEPSEEK, "B": 4, "H": heads, "block_size": 64, "max_blocks": 8, "dtype": torch.bfloat16}
    args = case_for("mla_decode").inputs(params, CUDA, 9)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, kv, bt, lens: graphsafe.mla_decode(q, kv, bt, lens, args[4], args[5]), fullgraph=True)
    _close(graphsafe.mla_decode(*args), compiled(*args[:4]))


@pytest.mark.parametrize("cache", ["bf16", "fp8_ds_mla"])
def test_inductor_fullgraph_sparse_step_past_16_heads_replays_in_a_graph(cache):
    """sparse_mla at 128 heads (sm_90: the producer kernel, copying rows of a bf16 cache or
    dequantising records) compiled whole by Inductor, then that compiled step captured in a
    CUDA graph and replayed with new indices: each result the eager op's."""
    q, kv, idx, scale, r = sparse_inputs(12, 128, 2048, CUDA, seed=31)
    if cache == "fp8_ds_mla":
        kv = fp8_cache(kv)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, kv, idx: graphsafe.sparse_mla(q, kv, idx, scale, r), fullgraph=True)
    _close(graphsafe.sparse_mla(q, kv, idx, scale, r), compiled(q, kv, idx))
    ws = current_workspace_manager(CUDA)
    ws.reserve(*sparse_mla_workspace_specs(12, 128, r, 2048, device=CUDA))
    with ws.locked():
        graph, (out, lse) = _capture(compiled, (q, kv, idx))
        idx.copy_(sparse_inputs(12, 128, 2048, CUDA, seed=32)[2])
        graph.replay()
        torch.cuda.synchronize()
    _close(graphsafe.sparse_mla(q, kv, idx, scale, r), (out, lse))
    del graph


@pytest.mark.slow
def test_decode_bandwidth_floor_at_the_anchor_shape():
    """A loose floor (the target is 60% of copy bandwidth, see the bench): catches a
    kernel configuration that spills or serialises, not a few percent."""
    args = decode_inputs(64, 16, 8192, CUDA)
    ms = time_ms(lambda: graphsafe.mla_decode(*args), CUDA)
    moved = 64 * 8192 * D * 2
    ratio = moved / (ms / 1e3) / measure_copy_bandwidth(CUDA)
    assert ratio > 0.35, f"mla_decode B=64 H=16 ctx=8192: {ms:.3f} ms, {100 * ratio:.0f}% of copy bandwidth"


@pytest.mark.slow
def test_many_head_decode_compute_floor():
    """128 heads are compute-bound: a loose floor over the measured bf16 matmul peak (the
    64x16 tiles before reached 15%): catches a fallback to narrow tiles or heavy spills."""
    args = decode_inputs(64, 128, 8192, CUDA)
    ms = time_ms(lambda: graphsafe.mla_decode(*args), CUDA)
    flops = 2 * 64 * 128 * 8192 * (D + R)
    ratio = flops / (ms / 1e3) / measure_matmul_peak(CUDA)
    assert ratio > 0.2, f"mla_decode B=64 H=128 ctx=8192: {ms:.3f} ms, {100 * ratio:.0f}% of matmul peak"


# -- sparse_mla's FlashMLA options ----------------------------------------------------------
def _sparse_options(tokens: int, heads: int, topk: int, seed: int):
    """A sink per head around the lse's scale (about log(topk) for these scores; +inf and
    -inf at heads 0 and 1) and per-token lengths (0, K, 1, 700, then random in [0, K])."""
    gen = torch.Generator().manual_seed(seed)
    sink = torch.randn(heads, generator=gen) * 2 + float(torch.log(torch.tensor(float(topk))))
    sink[0], sink[1] = float("inf"), float("-inf")
    length = torch.randint(0, topk + 1, (tokens,), generator=gen, dtype=torch.int32)
    length[:4] = torch.tensor([0, topk, 1, 700])
    return sink.to(CUDA), length.to(CUDA)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_sparse_options_match_reference(heads, num_splits):
    """attn_sink and topk_length at DeepSeek shapes, bf16: the Triton kernel at 16 heads,
    the Gluon kernel at 128 on sm_90 (the Triton one elsewhere), its epilogue applying the
    sink with one split and the combine with several; the Triton backend serves them."""
    q, kv, idx, scale, r = sparse_inputs(32, heads, 2048, CUDA, seed=31)
    idx[4] = -1  # a token without a valid entry, whatever its length
    idx[5, 100:] = -1
    sink, length = _sparse_options(32, heads, 2048, 31)
    args = (q, kv, idx, scale, r, sink, length)
    assert graphsafe.get_op("sparse_mla").serving_backend("cuda", *args) == "triton"
    cfg, _ = mla_plan.plan_launch(32, heads, 2048, CUDA)
    gluon = torch.version.hip is None and torch.cuda.get_device_capability(CUDA) == (9, 0) and heads == 128
    assert mla_plan.warpgroup_split_applies(q, kv, cfg, r, q.shape[-1] - r) == gluon
    out, lse = tri.sparse_mla(*args, num_splits=num_splits)
    _close(ref.sparse_mla(*args), (out, lse))
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))  # a +inf sink
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()  # length 0
    plain = tri.sparse_mla(q, kv, idx, scale, r, None, length, num_splits=num_splits)
    assert torch.equal(lse, plain[1]) and torch.equal(out[:, 1], plain[0][:, 1])  # lse stays; a -inf sink
    assert not tri._GLUON_FAILED, tri._GLUON_FAILED


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_graph_with_options_replays_with_new_lengths_and_sinks(heads):
    tokens, topk = 24, 2048
    q, kv, idx, scale, r = sparse_inputs(tokens, heads, topk, CUDA, seed=32)
    sink, length = _sparse_options(tokens, heads, topk, 32)
    ws = current_workspace_manager(CUDA)
    ws.reserve(*sparse_mla_workspace_specs(tokens, heads, r, topk, device=CUDA))
    with ws.locked():
        def step(q, kv, idx, sink, length):
            return graphsafe.sparse_mla(q, kv, idx, scale, r, sink, length)

        graph, (out, lse) = _capture(step, (q, kv, idx, sink, length))
        for seed in (33, 34):
            new_sink, new_length = _sparse_options(tokens, heads, topk, seed)
            sink.copy_(new_sink)
            length.copy_(new_length.flip(0))
            graph.replay()
            torch.cuda.synchronize()
            _close(ref.sparse_mla(q, kv, idx, scale, r, sink, length), (out, lse))
    del graph
