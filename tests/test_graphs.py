"""The graph runner without CUDA: bucket choice, errors, padding, the capture order, the
workspace lock, counters and output semantics, through the emulated driver (the step
re-runs on the static buffers instead of a graph replay). The CUDA half is in
tests/test_graphs_gpu.py; `ToyStep` and `random_inputs` are shared with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphsafe
from graphsafe.errors import WorkspaceError
from graphsafe.graphs import (
    DEFAULT_BUCKETS,
    GraphRunner,
    GraphRunnerError,
    bucket_for,
    buckets_up_to,
    normalize_buckets,
    rows_of,
    static_inputs_like,
)
from graphsafe.metadata import DecodeInputs
from graphsafe.workspace import current_workspace_manager

CPU = torch.device("cpu")


class ToyStep:
    """A decode step built from graphsafe ops: embed the token and its position, write
    K/V with `reshape_and_cache`, attend with `paged_attention_decode`, project to logits.
    Reads every DecodeInputs field; returns (logits [B, V] f32, a per-row summary [B])."""

    def __init__(self, device, *, vocab=48, hq=4, hk=2, d=16, block_size=4, max_blocks=6, num_blocks=48,
                 dtype=torch.bfloat16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hk, self.d, self.dtype = hq, hk, d, dtype
        self.block_size, self.max_blocks, self.num_blocks, self.vocab = block_size, max_blocks, num_blocks, vocab
        width = hq * d
        self.emb = torch.randn(vocab, width, generator=g).to(device)
        self.pos = (0.1 * torch.randn(max_blocks * block_size, width, generator=g)).to(device)
        self.wk = (torch.randn(width, hk * d, generator=g) / width**0.5).to(device)
        self.wv = (torch.randn(width, hk * d, generator=g) / width**0.5).to(device)
        self.wo = (torch.randn(width, vocab, generator=g) / width**0.5).to(device)
        self.k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)
        self.v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(device, dtype)

    def clone(self) -> ToyStep:
        """Same weights, own copies of the caches (an eager twin to compare with)."""
        twin = object.__new__(ToyStep)
        twin.__dict__.update(self.__dict__)
        twin.k_cache, twin.v_cache = self.k_cache.clone(), self.v_cache.clone()
        return twin

    def __call__(self, inputs: DecodeInputs):
        x = self.emb[inputs.input_ids] + self.pos[inputs.positions]
        q = x.view(-1, self.hq, self.d).to(self.dtype)
        k = (x @ self.wk).view(-1, self.hk, self.d).to(self.dtype)
        v = (x @ self.wv).view(-1, self.hk, self.d).to(self.dtype)
        graphsafe.reshape_and_cache(k, v, self.k_cache, self.v_cache, inputs.slot_mapping)
        out = graphsafe.paged_attention_decode(q, self.k_cache, self.v_cache, inputs.block_table, inputs.seq_lens,
                                               self.d**-0.5)
        h = out.float().flatten(1)
        return h @ self.wo, h.sum(-1)

    def template(self) -> DecodeInputs:
        return DecodeInputs.empty(1, self.max_blocks, self.k_cache.device)


def random_inputs(toy: ToyStep, batch: int, gen: torch.Generator) -> DecodeInputs:
    """A decode batch of `batch` requests with distinct cache blocks (so no two requests
    write one slot), random lengths in [1, capacity], the new token at the last position."""
    device = toy.k_cache.device
    cap = toy.max_blocks * toy.block_size
    assert batch * toy.max_blocks <= toy.num_blocks
    seq = torch.randint(1, cap + 1, (batch,), generator=gen)
    blocks = torch.randperm(toy.num_blocks, generator=gen)[: batch * toy.max_blocks].view(batch, toy.max_blocks)
    pos = seq - 1
    slots = blocks.gather(1, (pos // toy.block_size)[:, None])[:, 0] * toy.block_size + pos % toy.block_size
    return DecodeInputs(
        input_ids=torch.randint(0, toy.vocab, (batch,), generator=gen).to(device),
        positions=pos.to(device),
        seq_lens=seq.int().to(device),
        block_table=blocks.int().to(device),
        slot_mapping=slots.to(device),
    )


def assert_step_matches(actual, expected, toy: ToyStep, twin: ToyStep):
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(toy.k_cache, twin.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(toy.v_cache, twin.v_cache, rtol=0, atol=0)


# -- buckets -------------------------------------------------------------------------------
def test_normalize_buckets_sorts_and_deduplicates():
    assert normalize_buckets([8, 1, 4, 4, 2]) == (1, 2, 4, 8)
    assert normalize_buckets(DEFAULT_BUCKETS) == (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize("bad", [[], [0, 2], [-1], [2.0], [True, 4], ["8"]])
def test_normalize_buckets_refuses_bad_lists(bad):
    with pytest.raises(GraphRunnerError, match="buckets"):
        normalize_buckets(bad)


@given(
    buckets=st.lists(st.integers(1, 300), min_size=1, max_size=10).map(normalize_buckets),
    batch=st.integers(1, 400),
)
def test_bucket_for_is_the_smallest_bucket_holding_the_batch(buckets, batch):
    holding = [b for b in buckets if b >= batch]
    if holding:
        assert bucket_for(batch, buckets) == min(holding)
    else:
        with pytest.raises(GraphRunnerError) as err:
            bucket_for(batch, buckets)
        message = str(err.value)
        assert f"batch size {batch}" in message and str(list(buckets)) in message


def test_bucket_for_default_buckets_and_empty_batch():
    assert [bucket_for(b, DEFAULT_BUCKETS) for b in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    with pytest.raises(GraphRunnerError, match="exceeds the largest captured bucket 128"):
        bucket_for(129, DEFAULT_BUCKETS)
    with pytest.raises(GraphRunnerError, match="at least one request"):
        bucket_for(0, DEFAULT_BUCKETS)


def test_buckets_up_to():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(5) == (1, 2, 4, 5)
    assert buckets_up_to(300) == (*DEFAULT_BUCKETS, 300)
    assert buckets_up_to(1) == (1,)


# -- static buffers and padding -----------------------------------------------------------
def test_static_inputs_hold_each_fields_pad_value():
    template = random_inputs(ToyStep(CPU), 3, torch.Generator().manual_seed(0))
    static = static_inputs_like(template, 8)
    for (name, t, pad), (_, s, _) in zip(template.items(), static.items()):
        assert s.shape == (8, *t.shape[1:]) and s.dtype == t.dtype and s.device == t.device, name
        assert bool((s == pad).all()), name
    assert bool((static.slot_mapping == -1).all()) and bool((static.seq_lens == 0).all())
    view = rows_of(static, 2)
    assert view.batch_size == 2 and view.block_table.data_ptr() == static.block_table.data_ptr()


def test_copy_into_pads_rows_a_previous_larger_batch_left_behind():
    toy = ToyStep(CPU)
    gen = torch.Generator().manual_seed(1)
    runner = GraphRunner(toy, toy.template(), buckets=[4], emulate=True).capture()
    runner(random_inputs(toy, 4, gen))
    assert bool((runner.static_inputs(4).slot_mapping >= 0).all())
    small = random_inputs(toy, 3, gen)
    runner(small)
    static = runner.static_inputs(4)
    for name, t, pad in static.items():
        assert torch.equal(t[:3], getattr(small, name)), name
        assert bool((t[3:] == pad).all()), f"{name}: a stale row of the previous step was not re-padded"


# -- the runner, emulated -------------------------------------------------------------------
def test_replay_with_new_inputs_equals_eager_for_every_batch_size():
    toy = ToyStep(CPU)
    twin = toy.clone()
    gen = torch.Generator().manual_seed(2)
    runner = GraphRunner(toy, toy.template(), buckets=[1, 2, 4, 8], emulate=True).capture()
    # Warm-up and capture ran on padding inputs: no cache slot was written.
    assert_step_matches((), (), toy, twin)
    for batch in (3, 1, 8, 5, 2, 7, 4, 6):
        inputs = random_inputs(toy, batch, gen)
        actual = runner(inputs)
        expected = twin(inputs)
        assert_step_matches(actual, expected, toy, twin)
    assert runner.stats.replays == {1: 1, 2: 1, 4: 2, 8: 4}
    assert runner.stats.total_replays == 8


def test_capture_order_reserve_warmup_capture_lock():
    toy = ToyStep(CPU)
    seen: list[object] = []

    def step(inputs):
        seen.append(("run", inputs.batch_size, current_workspace_manager(CPU).is_locked))
        return toy(inputs)

    def reserve(max_batch):
        seen.append(("reserve", max_batch))
        current_workspace_manager(CPU).reserve(nbytes=1 << 16)

    runner = GraphRunner(step, toy.template(), buckets=[2, 8, 1, 4], reserve=reserve, warmup_steps=2, emulate=True)
    assert not runner.captured
    runner.capture()
    warm = [("run", b, False) for b in (8, 8, 4, 4, 2, 2, 1, 1)]
    captures = [("run", b, False) for b in (8, 4, 2, 1)]
    assert seen == [("reserve", 8), *warm, *captures]
    assert runner.captured and runner.stats.captures == 4 and runner.stats.warmup_runs == 8
    ws = current_workspace_manager(CPU)
    assert ws.is_locked
    assert runner.stats.workspace_bytes_at_capture == ws.size_bytes >= 1 << 16
    grows = ws.stats().grow_count
    with pytest.raises(WorkspaceError, match="locked"):
        ws.reserve(nbytes=ws.size_bytes + 1)
    runner(random_inputs(toy, 3, torch.Generator().manual_seed(3)))
    assert ws.stats().grow_count == grows == runner.stats.workspace_grows_at_capture
    runner.close()
    assert not ws.is_locked and not runner.captured


def test_the_workspace_stays_locked_until_the_last_runner_closes():
    toy = ToyStep(CPU)
    ws = current_workspace_manager(CPU)
    a = GraphRunner(toy, toy.template(), buckets=[2], emulate=True).capture()
    b = GraphRunner(toy, toy.template(), buckets=[4], emulate=True).capture()
    assert ws.is_locked
    a.close()
    assert ws.is_locked, "b's graphs still read the arena"
    b.close()
    assert not ws.is_locked
    # A lock the caller took is the caller's to release.
    ws.lock()
    c = GraphRunner(toy, toy.template(), buckets=[2], emulate=True).capture()
    c.close()
    assert ws.is_locked
    ws.unlock()


def test_outputs_are_views_of_static_buffers_valid_until_the_next_replay():
    toy = ToyStep(CPU)
    gen = torch.Generator().manual_seed(4)
    runner = GraphRunner(toy, toy.template(), buckets=[4, 8], emulate=True).capture()
    logits, summary = runner(random_inputs(toy, 3, gen))
    assert logits.shape == (3, toy.vocab) and summary.shape == (3,)
    first = logits.clone()
    # A view of the bucket's static output: the next replay of the bucket overwrites it.
    logits_again, _ = runner(random_inputs(toy, 4, gen))
    assert logits.data_ptr() == logits_again.data_ptr()
    assert not torch.equal(logits, first)
    assert torch.equal(logits, logits_again[:3])


def test_single_tensor_output_comes_back_as_a_tensor():
    toy = ToyStep(CPU)
    runner = GraphRunner(lambda x: toy(x)[0], toy.template(), buckets=[2], emulate=True).capture()
    out = runner(random_inputs(toy, 1, torch.Generator().manual_seed(5)))
    assert isinstance(out, torch.Tensor) and out.shape == (1, toy.vocab)


def test_compiled_step_through_the_runner_equals_eager():
    toy = ToyStep(CPU)
    twin = toy.clone()
    compiled = torch.compile(toy.__call__, fullgraph=True, dynamic=True, backend="aot_eager")
    runner = GraphRunner(compiled, toy.template(), buckets=[2, 4], emulate=True).capture()
    gen = torch.Generator().manual_seed(6)
    for batch in (4, 1, 3):
        inputs = random_inputs(toy, batch, gen)
        assert_step_matches(runner(inputs), twin(inputs), toy, twin)


def test_static_buffers_of_a_metadata_builder_replay_without_a_copy(monkeypatch):
    """A builder's persistent buffers as the static inputs: builds write in place, the
    runner sees views of its own rows and skips the copy, and the builder's tail padding
    keeps every bucket's extra rows inert."""
    from graphsafe.metadata import BatchSpec, DecodeMetadataBuilder

    toy = ToyStep(CPU)
    twin = toy.clone()
    builder = DecodeMetadataBuilder(max_batch=8, max_blocks=toy.max_blocks, block_size=toy.block_size, device=CPU)
    static = builder.build_for_capture(8)
    runner = GraphRunner(toy, static, buckets=[2, 4, 8], static=static, emulate=True).capture()
    copies = []
    monkeypatch.setattr(DecodeInputs, "copy_into", lambda self, dst: copies.append(1))
    gen = torch.Generator().manual_seed(10)
    for batch in (7, 3, 8, 1, 5):
        want = random_inputs(toy, batch, gen)
        spec = BatchSpec(
            query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
            block_table_cpu=want.block_table.cpu(),
            seq_lens_cpu=want.seq_lens.cpu(),
        )
        built = builder.build(spec, want.input_ids).inputs
        for name, t, _ in want.items():
            assert torch.equal(getattr(built, name), t), name
        assert_step_matches(runner(built), twin(want), toy, twin)
    assert not copies, "inputs built in the static buffers are not copied again"
    with pytest.raises(GraphRunnerError, match="static buffers"):
        GraphRunner(toy, static, buckets=[16], static=static, emulate=True)


# -- errors ------------------------------------------------------------------------------------
def test_batch_larger_than_the_largest_bucket_is_refused_by_name():
    toy = ToyStep(CPU, num_blocks=60)
    runner = GraphRunner(toy, toy.template(), buckets=[1, 2, 4], emulate=True).capture()
    with pytest.raises(GraphRunnerError, match=r"batch size 5 exceeds the largest captured bucket 4 \(buckets: \[1, 2, 4\]\)"):
        runner(random_inputs(toy, 5, torch.Generator().manual_seed(7)))
    assert runner.stats.total_replays == 0


def test_replay_before_capture_and_double_capture_are_refused():
    toy = ToyStep(CPU)
    runner = GraphRunner(toy, toy.template(), buckets=[2], emulate=True)
    inputs = random_inputs(toy, 2, torch.Generator().manual_seed(8))
    with pytest.raises(GraphRunnerError, match="before capture"):
        runner(inputs)
    runner.capture()
    with pytest.raises(GraphRunnerError, match="already captured"):
        runner.capture()


@pytest.mark.parametrize(
    "change",
    [
        lambda i: setattr(i, "block_table", i.block_table[:, :-1]),  # another max_blocks
        lambda i: setattr(i, "seq_lens", i.seq_lens.long()),  # int64 where int32 was captured
        lambda i: setattr(i, "slot_mapping", i.slot_mapping.float()),
    ],
)
def test_inputs_with_another_layout_are_refused(change):
    toy = ToyStep(CPU)
    runner = GraphRunner(toy, toy.template(), buckets=[4], emulate=True).capture()
    inputs = random_inputs(toy, 2, torch.Generator().manual_seed(9))
    change(inputs)
    with pytest.raises(GraphRunnerError, match="captured layout"):
        runner(inputs)


def test_cuda_graphs_need_a_cuda_template():
    toy = ToyStep(CPU)
    with pytest.raises(GraphRunnerError, match="emulate=True"):
        GraphRunner(toy, toy.template())


def test_outputs_must_be_batch_first_tensors():
    toy = ToyStep(CPU)
    for step, message in [
        (lambda x: toy(x)[0].sum(), "first dimension"),
        (lambda x: toy(x)[0].t(), "first dimension"),
        (lambda x: {"logits": toy(x)[0]}, "tensor or a tuple"),
    ]:
        with pytest.raises(GraphRunnerError, match=message):
            GraphRunner(step, toy.template(), buckets=[2], emulate=True).capture()
    with pytest.raises(GraphRunnerError, match="warmup_steps"):
        GraphRunner(toy, toy.template(), warmup_steps=0, emulate=True)
