"""register_op's rules, backend selection and its overrides, the aiter probe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from torch import Tensor

import graphsafe
from graphsafe import backends
from graphsafe.errors import RegistrationError
from graphsafe.registry import Backend, new_registry, takes_call
from graphsafe.testing import case_for


def _ns() -> str:
    return "gs_test_" + uuid.uuid4().hex[:8]


def _check(x, y):
    if x.shape != y.shape:
        raise graphsafe.InputError("shapes differ")


def _fake_add(x, y):
    _check(x, y)
    return torch.empty_like(x)


def _stub(x: Tensor, y: Tensor) -> Tensor:
    """Add.

    Args:
        x: any.
        y: same shape.
    """


def _calls():
    calls = []

    def ref(x, y):
        calls.append("reference")
        return x + y

    def tri(x, y):
        calls.append("triton")
        return x + y

    return calls, ref, tri


def test_registration_requires_a_fake():
    reg = new_registry(_ns())
    with pytest.raises(RegistrationError, match="fake"):
        reg.register_op("add", fake=None, check=_check, backends={"reference": lambda x, y: x + y})(_stub)


def test_registration_requires_a_reference_backend():
    reg = new_registry(_ns())
    with pytest.raises(RegistrationError, match="reference"):
        reg.register_op("add", fake=_fake_add, check=_check, backends={"triton": lambda x, y: x + y})(_stub)


def test_mutates_args_unknown_is_refused():
    reg = new_registry(_ns())
    with pytest.raises(RegistrationError, match="unknown"):
        reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": lambda x, y: x}, mutates_args="unknown")(_stub)


def test_mutating_op_must_return_none_and_name_real_args():
    reg = new_registry(_ns())
    with pytest.raises(RegistrationError, match="return None"):
        reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": lambda x, y: x}, mutates_args=("y",))(_stub)
    with pytest.raises(RegistrationError, match="not a parameter"):
        reg.register_op("add2", fake=_fake_add, check=_check, backends={"reference": lambda x, y: x}, mutates_args=("z",))(_stub)


def test_op_returning_nothing_must_mutate():
    reg = new_registry(_ns())

    def stub(x: Tensor) -> None:
        """Nothing."""

    with pytest.raises(RegistrationError, match="mutate"):
        reg.register_op("noop", fake=lambda x: None, check=lambda x: None, backends={"reference": lambda x: None})(stub)


def test_registered_op_dispatches_checks_and_has_a_fake():
    reg = new_registry(_ns())
    calls, ref, tri = _calls()
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": ref})(_stub)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(add(x, y), x + y)
    assert calls == ["reference"]
    assert add.__doc__.startswith("Add.")
    assert add.spec.schema == "(Tensor x, Tensor y) -> Tensor"
    with pytest.raises(graphsafe.InputError):
        add(x, torch.randn(4))
    compiled = torch.compile(add, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), x + y)


def test_traced_bad_input_reads_symbolic_sizes_without_deprecation_warnings():
    """Under dynamic shapes the message gives the call's sizes, read through the
    shape env's current API: torch's deprecated `size_hint` warns (FutureWarning)."""
    import warnings

    def check(x, y):
        if x.shape != y.shape:
            raise graphsafe.InputError(f"add: 'y' must be of shape {list(x.shape)}, got {list(y.shape)}")

    def fake(x, y):
        check(x, y)
        return torch.empty_like(x)

    add = new_registry(_ns()).register_op("add", fake=fake, check=check, backends={"reference": torch.add})(_stub)
    torch._dynamo.reset()
    compiled = torch.compile(add, fullgraph=True, backend="aot_eager", dynamic=True)
    compiled(torch.randn(3), torch.randn(3))  # sizes are symbols from here on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(graphsafe.InputError, match=r"add: 'y' must be of shape \[5\], got \[6\]"):
            compiled(torch.randn(5), torch.randn(6))
    ours = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
            and "graphsafe" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]


def test_each_signature_is_checked_selected_and_prepared_once(monkeypatch):
    reg = new_registry(_ns())
    calls, ref, tri = _calls()
    checks, prepared = [], []

    def check(x, y):
        checks.append(tuple(x.shape))
        _check(x, y)

    def prepare(x, y):
        prepared.append(tuple(x.shape))
        return ref

    add = reg.register_op("add", fake=_fake_add, check=check,
                          backends={"reference": Backend(prepare=prepare), "triton": tri})(_stub)
    resolutions = []
    original = add.spec.serving_backend

    def counting(device_type, *args, **kwargs):
        resolutions.append(device_type)
        return original(device_type, *args, **kwargs)

    monkeypatch.setattr(add.spec, "serving_backend", counting)
    for _ in range(5):
        add(torch.randn(2), torch.randn(2))
    assert resolutions == ["cpu"] and checks == [(2,)] and prepared == [(2,)]
    assert calls == ["reference"] * 5, "the CPU never picks triton automatically"
    add(torch.randn(3), torch.randn(3))  # a new signature: checked and prepared again
    add(torch.randn(3)[None], torch.randn(1, 3))  # same numel, another shape
    add(torch.randn(4, 2).t(), torch.randn(2, 4))  # same shape, other strides
    assert checks == [(2,), (3,), (1, 3), (2, 4)] and prepared == checks
    add(torch.randn(2).double(), torch.randn(2).double())  # another dtype
    assert len(prepared) == 5
    with pytest.raises(graphsafe.InputError):  # a bad input is never cached as valid
        add(torch.randn(2), torch.randn(5))
    with pytest.raises(graphsafe.InputError):
        add(torch.randn(2), torch.randn(5))


def test_scalar_arguments_are_part_of_the_signature():
    reg = new_registry(_ns())
    seen = []

    def stub(x: Tensor, alpha: float, mode: str = "a") -> Tensor:
        """Scale."""

    def check(x, alpha, mode="a"):
        if alpha < 0:
            raise graphsafe.InputError(f"alpha must be >= 0, got {alpha}")

    def prepare(x, alpha, mode="a"):
        seen.append((alpha, mode))
        return lambda x, alpha, mode="a": x * alpha

    scale = reg.register_op("scale", fake=lambda x, alpha, mode="a": torch.empty_like(x), check=check,
                            backends={"reference": Backend(prepare=prepare)})(stub)
    x = torch.randn(3)
    torch.testing.assert_close(scale(x, 2.0), 2 * x)
    torch.testing.assert_close(scale(x, 3.0), 3 * x)
    scale(x, 3.0, "b")
    scale(x, 3.0, "a")  # the default spelled out: the same signature as omitting it
    assert seen == [(2.0, "a"), (3.0, "a"), (3.0, "b")]
    with pytest.raises(graphsafe.InputError, match="alpha"):
        scale(x, -1.0)


def test_supports_hands_a_signature_to_the_next_backend(monkeypatch):
    reg = new_registry(_ns())
    calls, ref, tri = _calls()
    monkeypatch.setattr(graphsafe.registry, "backend_available", lambda b, d: True)
    only_even = Backend(tri, supports=lambda x, y: x.shape[0] % 2 == 0)
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": ref, "triton": only_even})(_stub)
    with graphsafe.use_backend("triton"):
        add(torch.randn(2), torch.randn(2))
        add(torch.randn(3), torch.randn(3))
        add(torch.randn(2), torch.randn(2))
        assert add.spec.serving_backend("cpu", torch.randn(3), torch.randn(3)) == "reference"
    assert calls == ["triton", "reference", "triton"]


def test_workspace_is_the_largest_of_the_backends_that_may_serve(monkeypatch):
    reg = new_registry(_ns())
    _, ref, tri = _calls()
    monkeypatch.setattr(graphsafe.registry, "backend_available", lambda b, d: True)
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={
        "reference": ref,
        "triton": Backend(tri, workspace=lambda n: [((n,), torch.float32)]),
        "aiter": Backend(tri, workspace=lambda n, device=None: [((2 * n,), torch.float32)]),
    })(_stub)
    assert add.spec.workspace_specs(64, device="cuda") == [((128,), torch.float32)]
    assert add.spec.workspace_bytes(64, device="cpu") == 0, "the CPU's automatic order is the reference alone"
    with graphsafe.use_backend("triton", ops=[add.spec.qualname]):
        assert add.spec.workspace_bytes(64, device="cpu") == 64 * 4
    with graphsafe.use_backend("reference"):
        assert add.spec.workspace_bytes(64, device="cuda") == 0, "use_backend decides the sizing too"


def test_use_backend_forces_and_restores(monkeypatch):
    reg = new_registry(_ns())
    calls, ref, tri = _calls()
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": ref, "triton": tri})(_stub)
    monkeypatch.setattr(backends, "backend_available", lambda b, d: True)
    monkeypatch.setattr(graphsafe.registry, "backend_available", lambda b, d: True)
    x = torch.randn(2)
    add(x, x)
    with graphsafe.use_backend("triton"):
        add(x, x)
        with graphsafe.use_backend("reference", ops=[add.spec.qualname]):
            add(x, x)
        add(x, x)
    add(x, x)
    assert calls == ["reference", "triton", "reference", "triton", "reference"]


def test_forced_backend_missing_on_an_op_falls_back():
    reg = new_registry(_ns())
    calls, ref, _ = _calls()
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": ref})(_stub)
    with graphsafe.use_backend("aiter"):
        add(torch.randn(2), torch.randn(2))
    assert calls == ["reference"]


def test_forced_but_unavailable_backend_warns_and_falls_back(monkeypatch):
    reg = new_registry(_ns())
    calls, ref, tri = _calls()
    add = reg.register_op("add", fake=_fake_add, check=_check, backends={"reference": ref, "triton": tri})(_stub)
    monkeypatch.setattr(graphsafe.registry, "backend_available", lambda b, d: b == "reference")
    with graphsafe.use_backend("triton"):
        with pytest.warns(UserWarning, match="unavailable"):
            add(torch.randn(2), torch.randn(2))
    assert calls == ["reference"]


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend"):
        graphsafe.use_backend("cuda")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env={**os.environ, **env}
    )


def test_graphsafe_backend_env_is_read_once():
    out = _run(
        """
        import os, torch, graphsafe
        spec = graphsafe.get_op("reshape_and_cache")
        print(spec.serving_backend("cpu"))
        os.environ["GRAPHSAFE_BACKEND"] = "reference"
        print(spec.serving_backend("cpu"))
        """,
        GRAPHSAFE_BACKEND="triton",
        TRITON_INTERPRET="1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton", "triton"]


def test_graphsafe_backend_env_rejects_garbage():
    out = _run("import graphsafe, torch; graphsafe.get_op('reshape_and_cache').serving_backend('cpu')", GRAPHSAFE_BACKEND="fast")
    assert out.returncode != 0 and "GRAPHSAFE_BACKEND" in out.stderr


def test_aiter_import_that_raises_means_unavailable(tmp_path):
    """aiter raises RuntimeError at import without ROCm: never a crash, just 'unavailable'."""
    (tmp_path / "aiter.py").write_text("raise RuntimeError('no ROCm here')\n")
    out = _run(
        """
        import torch
        torch.version.hip = "6.2"           # pretend to be a ROCm build
        torch.cuda.is_available = lambda: True
        from graphsafe import backends
        print(backends.backend_available("aiter", "cuda"))
        import graphsafe
        print(graphsafe.get_op("reshape_and_cache").available_backends("cpu"))
        """,
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "False"


def test_aiter_is_unavailable_without_rocm():
    assert backends.backend_available("aiter", "cuda") is (backends.is_rocm() and backends._importable("aiter"))
    assert not backends.backend_available("aiter", "cpu")


def test_default_arguments_reach_the_kernel():
    """An argument the caller omits must reach the backend as the schema's default.

    The dispatcher passes the args as given (trailing defaults may be missing, see
    `registry._signature_key`), so a backend uses its own Python defaults for them. Hence:
    a spy backend sees the schema's values; every backend entry point of every op (impl,
    prepare, and the runner prepare returns) has exactly the schema's defaults; a real op
    with its defaults omitted writes the same bytes as with them given."""
    import importlib
    import inspect

    from graphsafe.registry import takes_call
    from graphsafe.testing.contract import assert_bits_equal, clone_args

    def resolve(ref):
        if isinstance(ref, str):
            module, name = ref.split(":")
            return getattr(importlib.import_module(module), name)
        return ref

    def defaults(fn, names):
        params = inspect.signature(fn).parameters
        return {n: params[n].default for n in names if n in params}

    reg = new_registry(_ns())
    received = []

    def stub(x: Tensor, alpha: float = 2.5, scale: Tensor | None = None) -> Tensor:
        """Scale.

        Args:
            x: any.
            alpha: factor.
            scale: unused.
        """

    def ref(x, alpha=2.5, scale=None):
        received.append((alpha, scale))
        return x * alpha

    op = reg.register_op("scale", fake=lambda x, alpha=2.5, scale=None: torch.empty_like(x),
                         check=lambda *a, **k: None, backends={"reference": ref})(stub)
    x = torch.randn(3)
    torch.testing.assert_close(op(x), 2.5 * x)
    torch.testing.assert_close(op(x, 4.0), 4.0 * x)
    assert received == [(2.5, None), (4.0, None)]

    for name, spec in graphsafe.op_table().items():
        want = {n: p.default for n, p in inspect.signature(spec.public).parameters.items()
                if p.default is not inspect.Parameter.empty}
        case = case_for(spec.name)
        args = case.inputs(case.interpreter_example or case.example, "cpu", 0)
        # A function taking the bound call gets the stub's defaults through the call's type.
        assert spec.call_type._field_defaults == want, f"{name}: call defaults {spec.call_type._field_defaults}"
        for backend in spec.available_backends("cpu"):
            record = spec.backends[backend]
            parts = {"impl": getattr(record, "impl", record), "prepare": getattr(record, "prepare", None)}
            for part, fn in parts.items():
                if fn is not None and not takes_call(resolve(fn)):
                    got = defaults(resolve(fn), want)
                    assert got == want, f"{name}[{backend}].{part}: defaults {got}, schema {want}"
            if parts["prepare"] is not None:
                prepare = resolve(parts["prepare"])
                bound = clone_args(args)
                runner = prepare(spec.call(*bound)) if takes_call(prepare) else prepare(*bound)
                got = defaults(runner, want)
                assert got in (want, {}), f"{name}[{backend}] runner: defaults {got}, schema {want}"

    spec = graphsafe.get_op("reshape_and_cache")
    args = case_for(spec.name).inputs(case_for(spec.name).example, "cpu", 0)
    assert args[5] is None and args[6] is None, "the example has caches of the input dtype"
    omitted, explicit = clone_args(args), clone_args(args)
    torch.ops.graphsafe.reshape_and_cache(*omitted[:5])  # k_scale / v_scale omitted
    torch.ops.graphsafe.reshape_and_cache(*explicit[:5], None, None)
    assert_bits_equal(explicit[2:4], omitted[2:4], "caches with the scales omitted")
    assert not torch.equal(omitted[2], args[2]), "the call wrote the cache"


def test_op_table_introspection():
    table = graphsafe.op_table()
    for name, spec in table.items():
        assert spec.qualname == f"graphsafe::{name}"
        assert spec.schema.startswith("(")
        assert spec.serving_backend("cpu") in spec.available_backends("cpu")
        assert callable(spec.fake) and case_for(spec.name) is not None


def test_workspace_bytes_from_shapes():
    # Ops without scratch need none; ops with scratch state it from shapes (no dry run).
    for spec in graphsafe.op_table().values():
        if all(record.workspace is None for record in spec.backends.values()):
            assert spec.workspace_bytes() == 0


def test_list_why_says_why_each_backend_can_or_cannot_run(capsys):
    """`python -m graphsafe list --why`: per op and device, each backend's reason, and for
    the op's example shapes the serving backend (with what it runs, where its record
    explains it)."""
    from graphsafe.__main__ import main

    assert main(["list", "--why"]) == 0
    out = capsys.readouterr().out
    table = graphsafe.op_table()
    for name in table:
        assert f"graphsafe::{name}(" in out
    assert out.count("why on cpu: ") == len(table)
    assert "aiter cannot: runs on ROCm GPUs only, not on cpu" in out
    assert "Error" not in out, out


def test_explain_names_the_mla_kernel_plan_and_cache(monkeypatch):
    """The Triton MLA record explains its choice: kernels, tiles, splits and cache format."""
    spec = graphsafe.get_op("sparse_mla")
    case = case_for("sparse_mla")
    args = case.inputs(case.example, "cpu", 0)
    text = spec.backends["triton"].explain(spec.call(*args))
    assert text.startswith("triton_split_kv; tiles 16 heads x 16 keys") and "float16 cache" in text, text
