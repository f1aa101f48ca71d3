"""DeepSeek-V4 on the GPU (skipped without one): the sparse attention against FlashMLA's
MODEL1 kernel on the same bytes (where `flash_mla` imports), and the DeepSeek-V4-style
model's decode step compiled by Inductor, captured into a CUDA graph, replayed with no
host sync (sync-debug "error") and no allocation. The registry-wide GPU contract
(tests/test_contract_gpu.py) runs the ops at their `gpu_examples` (DeepSeek-V4 shapes)."""

from __future__ import annotations

import pytest
import torch

import graphsafe
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
