"""The graph runner on a GPU: one CUDA graph per bucket of a step built from graphsafe ops
(reshape_and_cache + paged_attention_decode, Triton kernels), replayed with new inputs of
every batch size: equal to eager, no host sync under sync-debug "error", no
caching-allocator allocation across 100 replays, the workspace locked and never grown
after capture; then the same with the demo model's compiled decode step. Skipped without
a CUDA/HIP device."""

from __future__ import annotations

import pytest
import torch

from graphsafe.graphs import DEFAULT_BUCKETS, GraphRunner, GraphRunnerError, bucket_for, static_inputs_like
from graphsafe.ops.attention import paged_attention_decode_workspace
from graphsafe.testing import no_sync
from graphsafe.workspace import current_workspace_manager, workspace_bytes
from test_graphs import ToyStep, random_inputs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BATCHES = (1, 2, 3, 4, 5, 8, 13, 16, 31, 32, 50, 64, 100, 127, 128)


def _toy() -> ToyStep:
    # Realistic head sizes, distinct blocks for up to 128 requests of 128 tokens.
    return ToyStep(CUDA, vocab=512, hq=8, hk=2, d=64, block_size=16, max_blocks=8, num_blocks=128 * 8)


def _reserve(toy: ToyStep):
    def reserve(max_batch: int) -> None:
        # Split-KV scratch depends on the batch and need not grow with it: size for the
        # worst batch up to max_batch (eager comparisons at unpadded sizes run after the
        # lock too), as a model's decode_workspace_reserve does.
        need = max(
            workspace_bytes(*paged_attention_decode_workspace(b, toy.hq, toy.hk, toy.d, toy.max_blocks,
                                                              toy.block_size, CUDA))
            for b in range(1, max_batch + 1)
        )
        current_workspace_manager(CUDA).reserve(nbytes=need)

    return reserve


def _padded(inputs, bucket):
    padded = static_inputs_like(inputs, bucket)
    inputs.copy_into(padded)
    return padded


def _bf16_close(actual, expected):
    scale = expected.float().abs().amax().clamp(min=1e-3)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=2**-6 * scale)


def test_toy_replay_equals_eager_for_every_batch_size():
    toy = _toy()
    twin_pad, twin = toy.clone(), toy.clone()
    runner = GraphRunner(toy, toy.template(), reserve=_reserve(toy)).capture()
    assert runner.stats.captures == len(DEFAULT_BUCKETS)
    torch.testing.assert_close(toy.k_cache, twin.k_cache, rtol=0, atol=0)  # warm-up wrote no slot
    gen = torch.Generator().manual_seed(0)
    for batch in BATCHES:
        inputs = random_inputs(toy, batch, gen)
        bucket = bucket_for(batch, runner.buckets)
        logits, summary = runner(inputs)
        # Eager on the same padded rows runs the same kernels with the same plans: equal.
        exp_logits, exp_summary = twin_pad(_padded(inputs, bucket))
        torch.cuda.synchronize()
        assert logits.shape == (batch, toy.vocab)
        torch.testing.assert_close(logits, exp_logits[:batch], rtol=0, atol=0)
        torch.testing.assert_close(summary, exp_summary[:batch], rtol=0, atol=0)
        torch.testing.assert_close(toy.k_cache, twin_pad.k_cache, rtol=0, atol=0)
        torch.testing.assert_close(toy.v_cache, twin_pad.v_cache, rtol=0, atol=0)
        # Eager on the unpadded batch: padding changes nothing beyond kernel-plan rounding.
        ref_logits, _ = twin(inputs)
        _bf16_close(logits, ref_logits)
        _bf16_close(toy.k_cache, twin.k_cache)
    assert runner.stats.total_replays == len(BATCHES)
    assert runner.stats.replays[128] == 3 and runner.stats.replays[1] == 1


def test_replays_do_not_sync_allocate_or_grow_the_workspace():
    toy = _toy()
    runner = GraphRunner(toy, toy.template(), reserve=_reserve(toy)).capture()
    ws = current_workspace_manager(CUDA)
    assert ws.is_locked
    gen = torch.Generator().manual_seed(1)
    batches = [BATCHES[i % len(BATCHES)] for i in range(100)]
    steps = [random_inputs(toy, b, gen) for b in batches]  # host-to-device copies happen here
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(CUDA)
    with no_sync():
        for inputs in steps:
            logits, _ = runner(inputs)
    after = torch.cuda.memory_stats(CUDA)
    torch.cuda.synchronize()
    for key in ("allocation.all.allocated", "allocation.all.freed", "segment.all.allocated"):
        assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]} across 100 replays"
    assert runner.stats.total_replays == 100
    s = ws.stats()
    assert s.locked and s.size_bytes == runner.stats.workspace_bytes_at_capture
    assert s.grow_count == runner.stats.workspace_grows_at_capture
    with pytest.raises(Exception, match="locked|capture"):
        ws.reserve(nbytes=s.size_bytes + 1)
    assert torch.isfinite(logits).all()
    runner.close()


def test_compiled_toy_captured_per_bucket_equals_eager():
    toy = _toy()
    twin = toy.clone()
    compiled = torch.compile(toy.__call__, fullgraph=True, dynamic=True)  # Inductor
    runner = GraphRunner(compiled, toy.template(), buckets=(1, 4, 16, 64), reserve=_reserve(toy)).capture()
    gen = torch.Generator().manual_seed(2)
    for batch in (1, 3, 4, 9, 16, 40, 64):
        inputs = random_inputs(toy, batch, gen)
        logits, summary = runner(inputs)
        ref_logits, ref_summary = twin(inputs)
        torch.cuda.synchronize()
        _bf16_close(logits, ref_logits)
        _bf16_close(summary, ref_summary)
        _bf16_close(toy.k_cache, twin.k_cache)
    with pytest.raises(GraphRunnerError, match="batch size 65 exceeds the largest captured bucket 64"):
        runner(random_inputs(toy, 65, gen))


# -- the demo model --------------------------------------------------------------------------------
PROMPT = 40  # longer than the demo model's index_topk (16): decode attends to a sparse selection


def _model():
    from graphsafe.models import build_demo_model

    model, _ = build_demo_model(CUDA, torch.bfloat16, seed=0, with_hf=False, max_batch=16, max_model_len=256)
    return model


def _prompts(model, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, PROMPT), generator=gen).tolist()


@torch.no_grad()
def _decode(model, step, prompts, steps, forced=None):
    """Greedy picks `[steps, B]` of `step(DecodeInputs) -> tokens`; with `forced`, step
    i + 1 is fed forced[i] (teacher forcing) instead of the run's own pick."""
    state = model.new_state()
    tokens = model.prefill(state, prompts).argmax(-1)
    picks = torch.empty(steps, len(prompts), dtype=torch.int64, device=CUDA)
    feed = picks if forced is None else forced
    for i in range(steps):
        picks[i].copy_(step(model.decode_inputs(state, tokens)))
        tokens = feed[i]
        model.advance(state, tokens)
    return picks


@torch.no_grad()
def _runner(model, fn, buckets) -> GraphRunner:
    # The builder's persistent buffers are the static inputs (decode_inputs builds in place).
    static = model.decode_builder.build_for_capture(max(buckets))
    model.prefill_workspace_reserve()  # prefills after capture must fit the locked workspace
    return GraphRunner(fn, static, buckets=buckets, reserve=model.decode_workspace_reserve, static=static).capture()


def test_model_replay_equals_eager_token_for_token():
    model = _model()

    def greedy(inputs):
        return model.decode_step(inputs).argmax(-1)

    eager = {b: _decode(model, greedy, _prompts(model, b, b), 16) for b in (1, 3, 8, 16)}
    runner = _runner(model, greedy, (1, 2, 4, 8, 16))
    for b, expected in eager.items():
        replayed = _decode(model, runner, _prompts(model, b, b), 16)
        if b in runner.buckets:
            # The eager step, captured: the same kernels at the same shapes, token for token.
            assert torch.equal(replayed, expected), (b, replayed.T, expected.T)
        else:
            # B = 3 replays the 4-row graph: kernel plans of 4 rows may round differently;
            # fed the same tokens, nearly every pick agrees.
            forced = _decode(model, runner, _prompts(model, b, b), 16, forced=expected)
            assert (forced == expected).float().mean() >= 0.9, (forced.T, expected.T)
    assert runner.stats.replays[4] > 0 and runner.stats.replays[16] > 0
    runner.close()


def test_compiled_model_replays_without_syncs_allocations_or_workspace_growth():
    model = _model()

    def greedy(inputs):
        return model.decode_step(inputs).argmax(-1)

    compiled = torch.compile(greedy, fullgraph=True, dynamic=True)  # Inductor
    eager = _decode(model, greedy, _prompts(model, 8, 0), 8)
    reference = _decode(model, compiled, _prompts(model, 8, 0), 8, forced=eager)
    runner = _runner(model, compiled, (1, 2, 4, 8, 16))
    ws = current_workspace_manager(CUDA)
    assert ws.is_locked
    # Graphs replay the compiled kernels at their own batch size: the same picks.
    assert torch.equal(_decode(model, runner, _prompts(model, 8, 0), 8, forced=eager), reference)

    state = model.new_state()
    with torch.no_grad():
        tokens = model.prefill(state, _prompts(model, 8, 1)).argmax(-1)
        inputs = model.decode_inputs(state, tokens)
        runner(inputs)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats(CUDA)
        with no_sync():  # 100 replays of one step (views of the static buffers: no copy)
            for _ in range(100):
                out = runner(inputs)
        after = torch.cuda.memory_stats(CUDA)
        torch.cuda.synchronize()
        for key in ("allocation.all.allocated", "segment.all.allocated"):
            assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]} across 100 replays"
        assert out.shape == (8,)
        # Whole decode steps: metadata build from the CPU mirrors, replay, bookkeeping.
        picks = torch.empty(100, 8, dtype=torch.int64, device=CUDA)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats(CUDA)
        with no_sync():
            for i in range(100):
                picks[i].copy_(runner(model.decode_inputs(state, tokens)))
                tokens = picks[i]
                model.advance(state, tokens)
        after = torch.cuda.memory_stats(CUDA)
        torch.cuda.synchronize()
        assert after["allocation.all.allocated"] == before["allocation.all.allocated"]
        assert ((picks >= 0) & (picks < model.cfg.vocab_size)).all()
    s = ws.stats()
    assert s.size_bytes == runner.stats.workspace_bytes_at_capture
    assert s.grow_count == runner.stats.workspace_grows_at_capture
    runner.close()


def test_demo_on_the_gpu_reports_sync_and_allocation_free_graphs():
    import io

    from graphsafe import demo

    opts = demo.DemoOptions(device="cuda", batches=(1, 8), steps=12, prompt_len=40, warmup=4, progress=False)
    out = io.StringIO()
    rows = demo.run_demo(opts, out=out)
    text = out.getvalue()
    assert demo.exit_code(rows) == 0, text
    by = {(r.mode, r.batch): r for r in rows}
    for b in (1, 8):
        graphs = by[(demo.GRAPHS, b)]
        assert graphs.ok and graphs.step_ms is not None, text
        assert graphs.syncs_fwd == 0 and graphs.allocs_fwd == 0, text
        assert graphs.graph_breaks == 0, text
        assert "= compiled: NO" not in graphs.agree, text
        assert by[("eager", b)].syncs_fwd is not None, text  # counted on CUDA


@pytest.mark.slow
def test_ten_thousand_replays_of_the_demo_step_grow_nothing():
    """10,000 whole decode steps (metadata build, replay, bookkeeping) of the demo model's
    compiled step captured as the demo does, contexts growing from 40 to 10,040 tokens: the
    caching allocator's counters and the workspace stay where they were after the first
    steps, and no step syncs."""
    from graphsafe.models import build_demo_model

    steps, prompt = 10_000, PROMPT
    model, _ = build_demo_model(CUDA, torch.bfloat16, seed=0, with_hf=False, max_batch=4,
                                max_model_len=prompt + steps + 64)

    def greedy(inputs):
        return model.decode_step(inputs).argmax(-1)

    runner = _runner(model, torch.compile(greedy, fullgraph=True, dynamic=True), (1, 2, 4))
    ws = current_workspace_manager(CUDA)
    keys = ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.current",
            "reserved_bytes.all.current", "num_alloc_retries")
    with torch.no_grad():
        state = model.new_state()
        tokens = model.prefill(state, _prompts(model, 4, 7)).argmax(-1)
        picks = torch.empty(2, 4, dtype=torch.int64, device=CUDA)

        def step(i, tokens):
            picks[i % 2].copy_(runner(model.decode_inputs(state, tokens)))
            model.advance(state, picks[i % 2])
            return picks[i % 2]

        warm = 8  # the first steps create every lazy host/device buffer
        for i in range(warm):
            tokens = step(i, tokens)
        torch.cuda.synchronize()
        before = {k: torch.cuda.memory_stats(CUDA).get(k, 0) for k in keys}
        ws_before = (ws.size_bytes, ws.stats().grow_count)
        with no_sync():
            for i in range(warm, steps):
                tokens = step(i, tokens)
        torch.cuda.synchronize()
    after = {k: torch.cuda.memory_stats(CUDA).get(k, 0) for k in keys}
    assert after == before, {k: (before[k], after[k]) for k in keys if before[k] != after[k]}
    assert (ws.size_bytes, ws.stats().grow_count) == ws_before
    assert runner.stats.total_replays == steps
    assert state.seq_lens[:4].tolist() == [prompt + steps] * 4
    runner.close()
