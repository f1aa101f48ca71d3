"""GPU tests of the composite indexer steps: both
composites against the reference at realistic shapes, captured in CUDA graphs and
replayed with other context lengths, several batch buckets sharing one reserved and
locked workspace, no host sync, no caching-allocator allocation, and a decode step's
indexer under Inductor."""

from __future__ import annotations

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.indexer import plan
from graphsafe.testing import contract as C
from graphsafe.testing import no_sync
from graphsafe.workspace import current_workspace_manager

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
DECODE, PREFILL = "sparse_attn_indexer_decode", "sparse_attn_indexer_prefill"
NAMES = (DECODE, PREFILL)


def _params(name):
    case = case_for(name)
    return [case.example, *case.gpu_examples]


@pytest.mark.parametrize("name", NAMES)
def test_triton_matches_reference_at_realistic_shapes(name):
    spec = graphsafe.get_op(name)
    for params in _params(name):
        args = case_for(spec.name).inputs(params, CUDA, seed=7)
        C.check_backend_matches_reference(spec, case_for(spec.name), "triton", args, params)


@pytest.mark.parametrize("name", NAMES)
def test_graph_replay_with_other_contexts_equals_eager(name):
    """Capture on one input set, copy another (other context lengths, slots, block
    tables, windows) into the static inputs, replay, compare with eager on it."""
    spec = graphsafe.get_op(name)
    for params in _params(name):
        C.check_cuda_graph_replay(spec, params, CUDA)


@pytest.mark.parametrize("name", NAMES)
def test_no_host_sync(name):
    spec = graphsafe.get_op(name)
    for params in _params(name):
        C.check_no_host_sync(spec, params, CUDA)


@pytest.mark.parametrize("name", NAMES)
def test_no_caching_allocator_allocation(name):
    """The composites have no outputs: every intermediate comes from the workspace."""
    spec = graphsafe.get_op(name)
    for params in _params(name):
        args = case_for(spec.name).inputs(params, CUDA, seed=4)
        spec.public(*C.clone_args(args))  # warm-up: compilation, workspace growth
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats(CUDA)["allocation.all.allocated"]
        spec.public(*args)
        after = torch.cuda.memory_stats(CUDA)["allocation.all.allocated"]
        assert after == before, f"{name}: {after - before} caching-allocator allocations"


def test_decode_buckets_share_one_reserved_workspace():
    """Warm up once at the largest bucket's max_num_batched_tokens, lock the workspace,
    then capture every bucket (no growth is possible) and replay each with new contexts."""
    spec = graphsafe.get_op(DECODE)
    base = {**case_for(spec.name).gpu_examples[0], "pad": 0.2, "reserve_tokens": 64}
    buckets = (1, 8, 32, 64)
    warm = case_for(spec.name).inputs({**base, "B": buckets[-1]}, CUDA, seed=0)
    spec.public(*warm)
    torch.cuda.synchronize()
    ws = current_workspace_manager(CUDA)
    assert ws.size_bytes >= plan.decode_bytes(64, base["max_model_len"], base["topk"])
    size = ws.size_bytes
    graphs = []
    with ws.locked():
        for b in buckets:
            static = C.clone_args(case_for(spec.name).inputs({**base, "B": b}, CUDA, seed=1))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                spec.public(*C.clone_args(static))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                spec.public(*static)
            graphs.append((b, graph, static))
        for b, graph, static in graphs:
            fresh = case_for(spec.name).inputs({**base, "B": b}, CUDA, seed=b + 10)
            for s, f in zip(static, fresh):
                if isinstance(s, torch.Tensor):
                    s.copy_(f)
            with no_sync():
                graph.replay()
            eager = C.clone_args(fresh)
            spec.public(*eager)
            torch.cuda.synchronize()
            case_for(spec.name).compare(None, None, eager, static, None)
    assert ws.size_bytes == size
    del graphs
    torch.cuda.synchronize()
    ws.forget_captures()


def test_prefill_reservation_covers_later_captures():
    """A prefill warm-up with (max_num_batched_tokens, max_total_seq_lens) sizes the arena
    for a capture of a smaller prefill with a locked workspace."""
    spec = graphsafe.get_op(PREFILL)
    big = {**case_for(spec.name).gpu_examples[0], "reserve_tokens": 4096, "reserve_keys": 40000}
    spec.public(*case_for(spec.name).inputs(big, CUDA, seed=0))
    torch.cuda.synchronize()
    ws = current_workspace_manager(CUDA)
    with ws.locked():
        small = {**case_for(spec.name).gpu_examples[1], "reserve_tokens": 4096, "reserve_keys": 40000}
        C.check_cuda_graph_replay(spec, small, CUDA)


def test_decode_step_indexer_under_inductor():
    spec = graphsafe.get_op(DECODE)
    params = case_for(spec.name).gpu_examples[1]
    args = case_for(spec.name).inputs(params, CUDA, seed=5)
    t, bs = args[1].shape[0], args[0].shape[1]
    req = torch.arange(args[5].shape[0], dtype=torch.int32, device=CUDA).repeat_interleave(params["next_n"])

    def step(*a):
        graphsafe.sparse_attn_indexer_decode(*a)
        return graphsafe.req_local_to_global_slots(req, a[6], a[7][:t], bs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    eager_args, compiled_args = C.clone_args(args), C.clone_args(args)
    want = step(*eager_args)
    got = compiled(*compiled_args)
    case_for(spec.name).compare(None, None, eager_args, compiled_args, params)
    # Same top-k sets up to ties: compare the slots of rows whose indices agree exactly.
    same = (eager_args[7][:t] == compiled_args[7][:t]).all(dim=1)
    assert torch.equal(want[same], got[same])
