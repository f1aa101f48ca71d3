"""The op contract (docs/design.md), checked for every registered op: no op can skip it.

Parametrised over the registry, so a new op is picked up without editing this file, and
fails here until it has a fake, a reference and a Triton backend, a test case, and
passes every check on every device present.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphsafe
from graphsafe.backends import device_types_here
from graphsafe.testing import case_for, contract as C

OPS = sorted(graphsafe.op_table())
DEVICES = device_types_here()


def _draw(data, name: str, device: str):
    case = case_for(name)
    params = data.draw(case.params(), label="params")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    return params, case.inputs(params, device, seed)


def test_registry_is_not_empty():
    assert len(OPS) >= 3


@pytest.mark.parametrize("name", OPS)
def test_registration(name):
    spec = graphsafe.get_op(name)
    fake_module = f"graphsafe.ops.{spec.family}.fake"
    assert spec.fake.__module__ == fake_module, "fakes live in graphsafe/ops/<family>/fake.py"
    assert spec.check.__module__ == fake_module, "checks live beside the fakes"
    assert "reference" in spec.backends and "triton" in spec.backends, "every op has reference and triton"
    assert case_for(name).op == name
    assert spec.doc and "Args:" in spec.doc, "the docstring documents every argument"
    # mutates_args is exact: the schema marks exactly those args as written.
    written = {a.name for a in spec.overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == set(spec.mutates_args)
    if spec.mutates_args:
        assert spec.overload._schema.returns == [], "a mutating op returns None"
    for arg in spec.mutates_args:
        assert arg in inspect.signature(spec.public).parameters
    assert spec.public is getattr(graphsafe, name) and spec.overload is getattr(torch.ops.graphsafe, name).default


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck_examples(name, device):
    spec = graphsafe.get_op(name)
    for _, args in C.example_inputs(case_for(spec.name), torch.device(device)):
        C.opcheck_op(spec, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
@given(data=st.data())
def test_opcheck_drawn(name, device, data):
    spec = graphsafe.get_op(name)
    _, args = _draw(data, name, device)
    C.opcheck_op(spec, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
@given(data=st.data())
def test_fake_matches_real(name, device, data):
    _, args = _draw(data, name, device)
    C.check_fake_matches_real(graphsafe.get_op(name), args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
@given(data=st.data())
def test_mutation_is_exact_and_outputs_are_fresh(name, device, data):
    _, args = _draw(data, name, device)
    C.check_mutation_and_aliasing(graphsafe.get_op(name), args)


def _backend_params():
    for name in OPS:
        spec = graphsafe.get_op(name)
        for device in DEVICES:
            for backend in spec.available_backends(device):
                if backend != "reference":
                    yield pytest.param(name, device, backend, id=f"{name}-{device}-{backend}")


@pytest.mark.parametrize("name,device,backend", list(_backend_params()))
@given(data=st.data())
def test_backend_matches_reference(name, device, backend, data):
    spec = graphsafe.get_op(name)
    params, args = _draw(data, name, device)
    C.check_backend_matches_reference(spec, case_for(spec.name), backend, args, params)


def _every_backend_params():
    for name in OPS:
        for device in DEVICES:
            for backend in graphsafe.get_op(name).available_backends(device):
                yield pytest.param(name, device, backend, id=f"{name}-{device}-{backend}")


@pytest.mark.parametrize("name", OPS)
def test_case_declares_unread_out_of_range_and_nonfinite(name):
    """Every op states what it never reads, which ids it takes, how it treats NaN/inf,
    and has value checks for the debug switch: a new op cannot skip these checks."""
    spec = graphsafe.get_op(name)
    case = case_for(spec.name)
    for field in ("unread", "out_of_range", "nonfinite"):
        assert getattr(case, field) is not None, (
            f"{name}: OpCase.{field} is not declared (use reads_every_element / takes_no_ids / reads_no_floats "
            "from graphsafe.testing.cases when it does not apply)")
    assert spec.debug_check is not None, f"{name}: register_op(..., debug_check=...) is missing"


@pytest.mark.parametrize("name,device,backend", list(_every_backend_params()))
@given(data=st.data())
def test_unread_inputs_never_reach_an_output(name, device, backend, data):
    spec = graphsafe.get_op(name)
    params, args = _draw(data, name, device)
    C.check_unread_inputs_never_matter(spec, case_for(spec.name), backend, params, args)


@pytest.mark.parametrize("name,device,backend", list(_every_backend_params()))
def test_unread_inputs_never_reach_an_output_on_edge_cases(name, device, backend):
    spec = graphsafe.get_op(name)
    for params, args in C.example_inputs(case_for(spec.name), torch.device(device)):
        C.check_unread_inputs_never_matter(spec, case_for(spec.name), backend, params, args)


@pytest.mark.parametrize("name,device,backend", list(_every_backend_params()))
@given(data=st.data())
def test_out_of_range_ids_act_as_padding(name, device, backend, data):
    spec = graphsafe.get_op(name)
    params, args = _draw(data, name, device)
    C.check_out_of_range_ids_are_padding(spec, case_for(spec.name), backend, params, args, seed=data.draw(st.integers(0, 99)))


@pytest.mark.parametrize("name,device,backend", list(_backend_params()))
@given(data=st.data())
def test_nonfinite_inputs_give_the_reference_result(name, device, backend, data):
    spec = graphsafe.get_op(name)
    params, args = _draw(data, name, device)
    C.check_nonfinite_inputs_agree(spec, case_for(spec.name), backend, params, args, seed=data.draw(st.integers(0, 99)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_debug_switch_refuses_out_of_range_ids(name, device):
    spec = graphsafe.get_op(name)
    for params, args in C.example_inputs(case_for(spec.name), torch.device(device)):
        C.check_debug_switch_refuses_out_of_range_ids(spec, case_for(spec.name), params, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_bad_inputs_raise_input_error_under_compile(name, device):
    """The same InputError, first line and class, from `torch.compile(fullgraph=True)`."""
    spec = graphsafe.get_op(name)
    for bad in case_for(spec.name).bad_inputs(torch.device(device), torch.Generator().manual_seed(0)):
        with pytest.raises(graphsafe.InputError) as eager:
            spec.public(*C.clone_args(bad.args))
        for dynamic in (False, True):  # symbolic sizes in the message read as their values
            torch._dynamo.reset()
            compiled = torch.compile(spec.public, fullgraph=True, backend="aot_eager", dynamic=dynamic)
            with pytest.raises(graphsafe.InputError) as traced:
                compiled(*C.clone_args(bad.args))
            assert str(traced.value).splitlines()[0] == str(eager.value).splitlines()[0], (bad.what, dynamic)


@pytest.mark.parametrize("name,device,backend", list(_backend_params()))
def test_backend_matches_reference_on_edge_cases(name, device, backend):
    spec = graphsafe.get_op(name)
    for params, args in C.example_inputs(case_for(spec.name), torch.device(device)):
        C.check_backend_matches_reference(spec, case_for(spec.name), backend, args, params)


@pytest.mark.parametrize("name,device,backend", list(_backend_params()))
def test_repeated_calls_through_the_dispatcher_match_reference(name, device, backend):
    """The per-signature runner (prepared once, launched many times) is right on every call."""
    spec = graphsafe.get_op(name)
    params = case_for(spec.name).interpreter_example or case_for(spec.name).example
    C.check_repeated_calls_match_reference(spec, case_for(spec.name), backend, params, torch.device(device))
    C.check_runner_keeps_no_inputs(spec, case_for(spec.name), backend, params, torch.device(device))


def test_every_op_has_a_non_reference_backend_tested_here():
    """On a CPU-only machine the Triton kernels must run through the interpreter."""
    for name in OPS:
        assert any(b != "reference" for d in DEVICES for b in graphsafe.get_op(name).available_backends(d)), (
            f"{name}: no kernel backend is tested on this machine (set TRITON_INTERPRET=1 without a GPU)"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_bad_inputs_are_refused_alike(name, device):
    spec = graphsafe.get_op(name)
    assert C.check_bad_inputs(spec, case_for(spec.name), torch.device(device)) >= 3, "each op lists at least 3 bad inputs"


@pytest.mark.parametrize("name", OPS)
def test_fake_never_touches_workspace(name):
    spec = graphsafe.get_op(name)
    for _, args in C.example_inputs(case_for(spec.name), torch.device("cpu")):
        C.check_fake_never_touches_workspace(spec, args)


@pytest.mark.parametrize("name", OPS)
def test_reference_needs_no_tensor_values_on_the_host(name):
    """The reference backend serves CUDA graphs too (GRAPHSAFE_BACKEND=reference): it runs
    on FakeTensors at the example and every edge case, so it never syncs to read a value
    or a data-dependent size (the GPU half: test_contract_gpu.py::
    test_reference_backend_also_captures)."""
    spec = graphsafe.get_op(name)
    for _, args in C.example_inputs(case_for(spec.name), torch.device("cpu")):
        C.check_reference_has_no_data_dependent_shape(spec, args)


@pytest.mark.parametrize("name", OPS)
def test_fullgraph_compile_matches_eager(name):
    """Dynamo traces the op through its fake (aot_eager), with no graph break."""
    spec = graphsafe.get_op(name)
    params, args = C.example_inputs(case_for(spec.name), torch.device("cpu"))[0]
    torch._dynamo.reset()
    compiled = torch.compile(spec.public, fullgraph=True, backend="aot_eager", dynamic=True)
    eager_args, compiled_args = C.clone_args(args), C.clone_args(args)
    expected = spec.public(*eager_args)
    actual = compiled(*compiled_args)
    from graphsafe.testing.compare import default_compare

    default_compare(spec, expected, actual, eager_args, compiled_args, exact=True)


@pytest.mark.parametrize("name,device,backend", list(_every_backend_params()))
def test_launch_fits_the_workspace_reserved_from_shapes(name, device, backend):
    """Decide once: the workspace a backend's launch takes is at most what its record
    reserves from shapes alone, on the example, every edge case and (on a GPU) the
    realistic shapes: sizing and launch read the same decision."""
    spec = graphsafe.get_op(name)
    case = case_for(spec.name)
    sets = [case.example, *case.edge_cases] + (list(case.gpu_examples) if device == "cuda" else [])
    if device == "cpu" and case.interpreter_example is not None:
        sets = [case.interpreter_example, *case.edge_cases]
    for i, params in enumerate(sets):
        C.check_launch_fits_the_reservation(spec, case, backend, params, case.inputs(params, device, i))


# -- supports predicates with each option -------------------------------------------------
# aiter's adapters run here on the CPU stand-in (tests/aiter_standin) of both architectures
# it serves; every backend with a `supports` predicate is checked (aiter's, so far).
AITER_ARCHS = ("gfx942", "gfx950")
PREDICATE_OPS = [name for name in OPS if C.predicate_backends(graphsafe.get_op(name))]


@pytest.mark.parametrize("name", OPS)
def test_case_switches_every_option_of_an_op_with_a_predicate(name):
    """An op with a predicate backend has an `OpCase.options` switch for each of its
    optional arguments, so a new option is switched on and off in front of every predicate
    (and no switch names an argument the op does not have)."""
    spec = graphsafe.get_op(name)
    options = case_for(name).options
    assert set(options) <= set(C.optional_arguments(spec)), f"{name}: switches of no optional argument"
    if C.predicate_backends(spec):
        missing = [arg for arg in C.optional_arguments(spec) if arg not in options]
        assert not missing, f"{name}: OpCase.options has no switch for {missing}"


def _predicate_params():
    return [pytest.param(name, arch, id=f"{name}-{arch}") for name in PREDICATE_OPS for arch in AITER_ARCHS]


_PREDICATE_SETTINGS = settings(suppress_health_check=[*settings.default.suppress_health_check,
                                                      HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name,arch", _predicate_params())
@_PREDICATE_SETTINGS
@given(data=st.data())
def test_supports_predicates_hold_with_each_option(aiter_standin, name, arch, data):
    """Every predicate over the draws, each option switched on and off: every call one
    accepts runs on that backend and matches the reference (contract.check_supports_with_each_option)."""
    aiter_standin(arch)
    spec = graphsafe.get_op(name)
    params = data.draw(case_for(name).params(), label="params")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    C.check_supports_with_each_option(spec, case_for(name), params, torch.device("cpu"), seed)


@pytest.mark.parametrize("name,arch", _predicate_params())
def test_supports_predicates_hold_with_each_option_on_edge_cases(aiter_standin, name, arch):
    """The same over the example, the edge cases and the adapter examples (the shapes the
    adapters serve, which the draws never reach)."""
    aiter_standin(arch)
    spec, case = graphsafe.get_op(name), case_for(name)
    for i, params in enumerate([case.example, *case.edge_cases, *case.adapter_examples]):
        C.check_supports_with_each_option(spec, case, params, torch.device("cpu"), seed=i)


def test_cli_check_prints_the_table_alone():
    """`python -m graphsafe check`: the table and its verdict, nothing else (the NaN and inf
    its checks feed on purpose make Triton's interpreter warn: filtered inside)."""
    import subprocess
    import sys

    ops = ["indexer_k_quant_and_cache", "mla_decode"]  # quick, and both warned before
    proc = subprocess.run([sys.executable, "-m", "graphsafe", "check", "--device", "cpu", *(a for op in ops for a in ("--op", op))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["op", "device", "serving"] and set(lines[1]) == {"-"}
    assert [line.split()[0] for line in lines[2:-2]] == ops and lines[-2] == ""
    assert lines[-1] == "all contract checks passed (2 ops, devices: cpu)"
