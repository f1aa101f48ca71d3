"""The GPU half of the op contract, for every registered op: realistic shapes against the
reference, CUDA-graph capture and replay with new inputs, no host sync, no allocation
other than the outputs, and Inductor compilation. Skipped without a CUDA/HIP device."""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.testing import contract as C
from graphsafe.testing import no_sync
from graphsafe.testing.compare import default_compare

pytestmark = pytest.mark.gpu

OPS = sorted(graphsafe.op_table())
CUDA = torch.device("cuda")


def _param_sets(name):
    case = graphsafe.get_op(name).case
    return [case.example, *case.edge_cases, *case.gpu_examples]


def _compare(spec, expected, actual, exp_args, act_args, params):
    if spec.case.compare is not None:
        spec.case.compare(expected, actual, exp_args, act_args, params)
    else:
        default_compare(spec, expected, actual, exp_args, act_args)


@pytest.mark.parametrize("name", OPS)
def test_kernels_match_reference_at_realistic_shapes(name):
    spec = graphsafe.get_op(name)
    backends = [b for b in spec.available_backends("cuda") if b != "reference"]
    assert backends, f"{name}: no kernel backend on this GPU"
    for params in _param_sets(name):
        args = spec.case.inputs(params, CUDA, seed=7)
        for backend in backends:
            C.check_backend_matches_reference(spec, spec.case, backend, args, params)


def _tensor_positions(args):
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("name", OPS)
def test_cuda_graph_replay_with_new_inputs_equals_eager(name):
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        static = C.clone_args(spec.case.inputs(params, CUDA, seed=1))
        fresh = spec.case.inputs(params, CUDA, seed=2)
        for i in range(len(static)):
            if not isinstance(static[i], torch.Tensor):
                assert static[i] == fresh[i], f"{name}: host ints must come from params only"
        # Warm up (Triton compiles on first launch) on a side stream, then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                spec.public(*C.clone_args(static))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = spec.public(*static)
        # New inputs (and new cache contents) copied into the static tensors, then replay.
        for i in _tensor_positions(static):
            static[i].copy_(fresh[i])
        graph.replay()
        eager_args = C.clone_args(fresh)
        expected = spec.public(*eager_args)
        torch.cuda.synchronize()
        _compare(spec, expected, static_out, eager_args, static, params)
        del graph


@pytest.mark.parametrize("name", OPS)
def test_no_host_sync(name):
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        args = spec.case.inputs(params, CUDA, seed=3)
        spec.public(*C.clone_args(args))  # warm-up: compilation may sync
        torch.cuda.synchronize()
        with no_sync():
            spec.public(*args)
        torch.cuda.synchronize()


def _count_outputs(out):
    if isinstance(out, torch.Tensor):
        return 1
    if isinstance(out, (tuple, list)):
        return sum(_count_outputs(o) for o in out)
    return 0


@pytest.mark.parametrize("name", OPS)
def test_kernels_allocate_only_their_outputs(name):
    """Scratch comes from the workspace: the caching allocator sees the outputs only."""
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        args = spec.case.inputs(params, CUDA, seed=4)
        spec.public(*C.clone_args(args))  # warm-up: sizes the workspace
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        out = spec.public(*args)
        after = torch.cuda.memory_stats()["allocation.all.allocated"]
        assert after - before <= _count_outputs(out), (
            f"{name} {params}: {after - before} allocations for {_count_outputs(out)} outputs"
        )


@pytest.mark.parametrize("name", OPS)
def test_inductor_fullgraph_matches_eager(name):
    spec = graphsafe.get_op(name)
    params = spec.case.example
    args = spec.case.inputs(params, CUDA, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(spec.public, fullgraph=True, backend="inductor")
    eager_args, compiled_args = C.clone_args(args), C.clone_args(args)
    expected = spec.public(*eager_args)
    actual = compiled(*compiled_args)
    _compare(spec, expected, actual, eager_args, compiled_args, params)
