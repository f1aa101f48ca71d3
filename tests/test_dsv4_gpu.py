"""DeepSeek-V4 on the GPU (skipped without one): the sparse attention against FlashMLA's
MODEL1 kernel on the same bytes (where `flash_mla` imports), and the DeepSeek-V4-style
model's decode step compiled by Inductor, captured into a CUDA graph, replayed with no
host sync (sync-debug "error") and no allocation. The registry-wide GPU contract
(tests/test_contract_gpu.py) runs the ops at their `gpu_examples` (DeepSeek-V4 shapes)."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphsafe
from graphsafe.formats import fp8_dsv4
from graphsafe.models.dsv4 import build_dsv4_demo_model
from graphsafe.ops.dsv4.bench import decode_inputs, flashmla_peer
from graphsafe.testing import no_sync

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("tokens,heads,extra_topk", [(64, 64, 512), (64, 128, 1024), (3, 64, 0)])
def test_sparse_attn_matches_flashmla_model1(tokens, heads, extra_topk):
    pytest.importorskip("flash_mla")
    args = decode_inputs(tokens, heads, 128, extra_topk, DEVICE)
    out, lse = graphsafe.dsv4_sparse_attn(*args)
    peers, note = flashmla_peer(args, (out, lse))
    assert peers, note
    theirs, their_lse = next(iter(peers.values()))()
    torch.testing.assert_close(out.float(), theirs[:, 0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, their_lse.reshape(tokens, heads), rtol=1e-3, atol=1e-3)


def _poison_unread(cache, slots, lengths):
    """Every record of `cache` no entry of `slots [T, K]` below its token's length reads
    becomes NaN (e4m3 bytes 0x7F, UE8M0 byte 255): a kernel that reads one shows it."""
    data, scales = fp8_dsv4.block_views(cache)
    nb, bs = data.shape[:2]
    live = torch.arange(slots.shape[1], device=slots.device)[None, :] < lengths[:, None].long()
    ids = slots.long()[live & (slots >= 0) & (slots < nb * bs)]
    read = torch.zeros(nb * bs, dtype=torch.bool, device=cache.device)
    read[ids] = True
    unread = ~read.view(nb, bs)
    data[unread] = fp8_dsv4.NAN_VALUE
    scales[unread] = fp8_dsv4.NAN_SCALE


@pytest.mark.parametrize("tokens,heads,window,extra_topk,num_splits", [
    (5, 64, 128, 512, None), (3, 128, 100, 300, None), (4, 16, 70, 0, 1), (2, 64, 128, 200, 3), (6, 64, 128, 64, 1)])
def test_gluon_kernel_matches_the_reference_and_the_triton_kernel(tokens, heads, window, extra_topk, num_splits):
    """The sm_90 Gluon kernel (the automatic choice for bf16 q over fp8_dsv4 records) on
    lengths that end lists mid-tile (0 included), padding ids (-1) and ids past the cache,
    every unread record NaN: equal to the reference up to bf16 rounding, and to the Triton
    kernel on the same split plan; split or not, with and without the compressed cache."""
    from graphsafe.ops.dsv4 import plan, reference, triton as tri

    q, swa, idx, scale, sink, length, comp, xidx, xlength = decode_inputs(tokens, heads, window, extra_topk, DEVICE,
                                                                          seed=heads + window)
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    for slots, lens, cache in ((idx, length, swa), (xidx, xlength, comp)):
        if slots is None:
            continue
        k = slots.shape[1]
        lens.copy_(torch.randint(0, k + 1, (tokens,), generator=g, device=DEVICE, dtype=torch.int32))
        lens[0] = k
        slots[torch.rand(slots.shape, generator=g, device=DEVICE) < 0.1] = -1
        slots[0, 1] = cache.shape[0] * cache.shape[1] + 5  # past the cache: no key
        if tokens > 1:
            lens[1] = 0
        _poison_unread(cache, slots, lens)
    args = (q, swa, idx, scale, sink, length, comp, xidx, xlength)
    choice = plan.choose(graphsafe.get_op("dsv4_sparse_attn").call(*args))
    assert choice.kernel == plan.GLUON_SPARSE_ATTN, choice.describe()
    # (no Gluon compile may have failed in this process, this call's or an earlier one's:
    # a runner bound after a failure runs the Triton kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed Gluon compile (the fallback's warning) fails
        out, lse = tri.dsv4_sparse_attn(*args, num_splits=num_splits)
    assert not tri._GLUON_FAILED, tri._GLUON_FAILED
    ref_out, ref_lse = reference.dsv4_sparse_attn(*args)
    tri_out, tri_lse = tri.dsv4_sparse_attn(*args, config=plan.tiles(heads, "cuda"),
                                            num_splits=num_splits or choice.plan.num_splits)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), tri_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, tri_lse, rtol=1e-4, atol=1e-4)


def _model(**overrides):
    sizes = dict(max_batch=8, max_model_len=512, block_size=64, padded_heads=64, num_heads=8, window=128,
                 compress_ratios=(0, 4, 128, 4), index_topk=64)
    return build_dsv4_demo_model(DEVICE, **{**sizes, **overrides})[0]


def _prefilled(model, batch=8, length=300):
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, length), generator=g).tolist()
    state = model.new_state()
    tok = model.prefill(state, prompts).argmax(-1)
    return state, tok


def test_inductor_step_captured_replays_without_sync_or_allocation():
    model = _model()
    state, tok = _prefilled(model)
    torch._dynamo.reset()
    step = torch.compile(model.decode_step, fullgraph=True, dynamic=True)
    inputs = model.decode_inputs(state, tok)
    eager = model.decode_step(inputs).clone()
    compiled = step(inputs).clone()
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75
    model.decode_workspace_reserve()
    static = model.decode_builder.build_for_capture(8)
    inputs.copy_into(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step(static)
    torch.cuda.synchronize()
    keys = ("allocation.all.allocated", "segment.all.allocated")
    before = {k: torch.cuda.memory_stats().get(k, 0) for k in keys}
    with no_sync():
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    after = {k: torch.cuda.memory_stats().get(k, 0) for k in keys}
    assert after == before
    replayed = logits.clone()
    # The replay recomputes the step of the same inputs (its cache writes repeat the same values).
    direct = step(static)
    assert torch.equal(replayed, direct)
