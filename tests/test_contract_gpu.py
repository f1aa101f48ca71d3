"""The GPU half of the op contract, for every registered op: realistic shapes against the
reference, CUDA-graph capture and replay with new inputs, no host sync, no allocation
other than the outputs, and Inductor compilation. Skipped without a CUDA/HIP device."""

from __future__ import annotations

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe.testing import contract as C

pytestmark = pytest.mark.gpu

OPS = sorted(graphsafe.op_table())
CUDA = torch.device("cuda")


def _param_sets(name):
    case = case_for(name)
    return [case.example, *case.edge_cases, *case.gpu_examples]


@pytest.mark.parametrize("name", OPS)
def test_kernels_match_reference_at_realistic_shapes(name):
    spec = graphsafe.get_op(name)
    backends = [b for b in spec.available_backends("cuda") if b != "reference"]
    assert backends, f"{name}: no kernel backend on this GPU"
    for params in _param_sets(name):
        args = case_for(spec.name).inputs(params, CUDA, seed=7)
        for backend in backends:
            C.check_backend_matches_reference(spec, case_for(spec.name), backend, args, params)


@pytest.mark.parametrize("name", OPS)
def test_bound_launches_match_reference_and_skip_the_binder(name):
    """Through the dispatcher, calls after the first of a signature launch compiled kernel
    handles (graphsafe.launch), never `kernel[grid]`, and stay equal to the reference."""
    spec = graphsafe.get_op(name)
    backends = [b for b in spec.available_backends("cuda") if b != "reference"]
    for params in _param_sets(name):
        for backend in backends:
            plain = C.check_repeated_calls_match_reference(spec, case_for(spec.name), backend, params, CUDA)
            assert plain == 0, f"{name}[{backend}] {params}: {plain} plain launches after the first call"
            C.check_runner_keeps_no_inputs(spec, case_for(spec.name), backend, params, CUDA)


@pytest.mark.parametrize("name", OPS)
def test_cuda_graph_replay_with_new_inputs_equals_eager(name):
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        C.check_cuda_graph_replay(spec, params, CUDA)


@pytest.mark.parametrize("name", OPS)
def test_no_host_sync(name):
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        C.check_no_host_sync(spec, params, CUDA)


@pytest.mark.parametrize("name", OPS)
def test_kernels_allocate_only_their_outputs(name):
    spec = graphsafe.get_op(name)
    for params in _param_sets(name):
        C.check_allocates_only_outputs(spec, params, CUDA)


@pytest.mark.parametrize("name", OPS)
def test_reference_backend_also_captures(name):
    """GRAPHSAFE_BACKEND=reference must still give graph-safe, sync-free ops."""
    spec = graphsafe.get_op(name)
    with graphsafe.use_backend("reference"):
        C.check_cuda_graph_replay(spec, case_for(spec.name).example, CUDA)
        C.check_no_host_sync(spec, case_for(spec.name).example, CUDA)


@pytest.mark.parametrize("name", OPS)
def test_inductor_fullgraph_matches_eager(name):
    spec = graphsafe.get_op(name)
    params = case_for(spec.name).example
    args = case_for(spec.name).inputs(params, CUDA, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(spec.public, fullgraph=True, backend="inductor")
    eager_args, compiled_args = C.clone_args(args), C.clone_args(args)
    expected = spec.public(*eager_args)
    actual = compiled(*compiled_args)
    C._compare_case(spec, expected, actual, eager_args, compiled_args, params)
