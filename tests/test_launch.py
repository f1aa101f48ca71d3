"""graphsafe.launch: kernels bound once per signature, launched without Triton's binder.

On the CPU the kernels run through Triton's interpreter, where `kernel[grid]` returns no
compiled kernel: every call must take the plain launch and give the right answer. The
fast path is driven here with a stand-in compiled kernel that records what its `run`
receives, and compared with what Triton's own launch passes (`*bound_args.values()`:
every parameter in signature order, constexprs and defaults included); on the GPU,
tests/test_launch_gpu.py runs it for real.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphsafe import launch as L


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, stride_x, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0.0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y + SHIFT, mask=mask)


def _bind(x, y, out, n, **meta):
    return L.bind(_axpy_kernel, (triton.cdiv(n, 16),), x, y, out, n, 2.0, x.stride(0), BLOCK=16, **meta)


@pytest.mark.parametrize("n", [1, 16, 37])
def test_plain_launch_on_the_cpu_is_exact(n):
    if not L.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU-only machines)")
    x, y, out = torch.randn(2 * n)[::2], torch.randn(n), torch.full((n,), float("nan"))
    launch = _bind(x, y, out, n, SHIFT=0.5)
    for _ in range(3):
        x.normal_(), y.normal_(), out.fill_(float("nan"))
        launch(x, y, out)
        torch.testing.assert_close(out, 2.0 * x + y + 0.5)
    assert not launch.state.fast and launch.state.plain_calls == 3


class _Compiled:
    """Stands in for Triton's CompiledKernel: records each run(...) call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.function, self.packed_metadata = object(), object()

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """Stands in for a JIT function: `kernel[grid](...)` records the plain launch and
    returns the compiled stand-in (or None, as Triton's interpreter does)."""

    def __init__(self, fn, compiled):
        self.fn, self.params, self.compiled, self.plain = fn, (), compiled, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            return self.compiled

        return launch


class _Driver:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.active
        @staticmethod
        def get_current_stream(device):
            return 1000 + device


class _Tensor(torch.Tensor):
    pass


def _fake_cuda(monkeypatch, compiled):
    """Bind as if on cuda:0 with a Triton whose launch hooks are empty."""
    hooks = type("Hooks", (), {"calls": []})

    class Runtime:
        launch_enter_hook = hooks()
        launch_exit_hook = hooks()

    monkeypatch.setattr(L, "_triton_runtime", lambda: (_Driver, Runtime))
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_tensor_device", lambda t: 0)
    return Runtime


def test_fast_launch_passes_what_triton_passes(monkeypatch):
    compiled = _Compiled()
    _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_axpy_kernel.fn, compiled)
    x, y, out = torch.randn(8), torch.randn(8), torch.empty(8)
    launch = L.bind(kernel, (3, 2), x, y, out, 8, 2.0, 1, BLOCK=16, num_warps=2)
    launch(x, y, out)  # first call: the plain launch, whose compiled kernel is adopted
    assert kernel.plain == [((3, 2, 1), (x, y, out, 8, 2.0, 1), {"BLOCK": 16, "SHIFT": 0.0, "num_warps": 2})]
    assert launch.state.fast and not compiled.calls
    x2, y2, out2 = torch.randn(8), torch.randn(8), torch.empty(8)
    launch(x2, y2, out2)
    assert len(kernel.plain) == 1, "the second call skips kernel[grid]"
    (call,) = compiled.calls
    grid, stream, function, packed, hooks = call[:3], call[3], call[4], call[5], call[6:9]
    assert grid == (3, 2, 1) and stream == 1000 and function is compiled.function and packed is compiled.packed_metadata
    assert hooks == (None, None, None)
    # Triton's launch passes every parameter in order: pointers here as integers.
    assert call[9:] == (x2.data_ptr(), y2.data_ptr(), out2.data_ptr(), 8, 2.0, 1, 16, 0.0)


def test_each_alignment_pattern_gets_its_own_handle_and_hooks_take_the_plain_launch(monkeypatch):
    compiled = _Compiled()
    runtime = _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_axpy_kernel.fn, compiled)
    base = torch.randn(64)
    x, y, out = base[:8], torch.randn(8), torch.empty(8)
    launch = L.bind(kernel, (1,), x, y, out, 8, 2.0, 1, BLOCK=16)
    launch(base[1:9], y, out)  # misaligned first call: plain, its handle kept for that pattern
    assert not launch.state.fast and len(kernel.plain) == 1
    launch(x, y, out)  # all aligned: plain once more (Triton specialises on alignment)
    assert launch.state.fast and len(kernel.plain) == 2
    launch(base[1:9], y, out)
    launch(x, y, out)
    assert len(kernel.plain) == 2 and len(compiled.calls) == 2, "both patterns launch their handles"
    assert compiled.calls[0][9] == base[1:9].data_ptr()
    runtime.launch_enter_hook.calls.append(print)  # a profiler's hook: it must be called
    launch(x, y, out)
    assert len(kernel.plain) == 3 and len(compiled.calls) == 2
    runtime.launch_enter_hook.calls.clear()
    launch(x, y, out)
    assert len(compiled.calls) == 3


def test_another_current_device_takes_the_guarded_plain_launch(monkeypatch):
    compiled = _Compiled()
    _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_axpy_kernel.fn, compiled)
    x, y, out = torch.randn(8), torch.randn(8), torch.empty(8)
    monkeypatch.setattr(L, "_current_device", lambda: 1)  # tensors on cuda:0, cuda:1 current
    guarded = []
    monkeypatch.setattr(L.torch.cuda, "device", lambda d: guarded.append(d) or __import__("contextlib").nullcontext())
    launch = L.bind(kernel, (1,), x, y, out, 8, 2.0, 1, BLOCK=16)
    launch(x, y, out)
    launch(x, y, out)
    assert len(kernel.plain) == 2 and not compiled.calls and guarded == [0, 0]


def test_unknown_compiled_object_keeps_the_plain_launch(monkeypatch):
    _fake_cuda(monkeypatch, None)
    kernel = _Kernel(_axpy_kernel.fn, None)  # what the interpreter returns
    x, y, out = torch.randn(8), torch.randn(8), torch.empty(8)
    launch = L.bind(kernel, (1,), x, y, out, 8, 2.0, 1, BLOCK=16)
    for _ in range(3):
        launch(x, y, out)
    assert not launch.state.fast and len(kernel.plain) == 3 and launch.state.plain_calls == 3


def test_bind_refuses_what_it_cannot_bind():
    x = torch.randn(4)
    with pytest.raises(TypeError, match="jit"):
        L.bind(lambda x: x, (1,), x)
    with pytest.raises(TypeError, match="by position"):
        L.bind(_axpy_kernel, (1,), x, x, out_ptr=x, n=4, alpha=2.0, stride_x=1, BLOCK=16)
    with pytest.raises(ValueError, match="1 to 3"):
        L.bind(_axpy_kernel, (1, 1, 1, 1), x, x, x, 4, 2.0, 1, BLOCK=16)


def test_a_run_that_refuses_its_arguments_reverts_to_the_plain_launch(monkeypatch):
    class Refusing(_Compiled):
        def run(self, *args):
            self.calls.append(args)
            raise TypeError("function takes exactly 12 arguments")

    compiled = Refusing()
    _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_axpy_kernel.fn, compiled)
    x, y, out = torch.randn(8), torch.randn(8), torch.empty(8)
    launch = L.bind(kernel, (1,), x, y, out, 8, 2.0, 1, BLOCK=16)
    for _ in range(4):
        launch(x, y, out)
    assert len(compiled.calls) == 1, "one refused try, then never again"
    assert len(kernel.plain) == 4 and not launch.state.fast


def test_direct_c_launch_only_for_a_launcher_whose_call_was_read(monkeypatch):
    """`direct_c_launch` takes a launcher's C function only where Triton's `__call__` is
    the one read (3.6's signature, no scratch, no GSan); anything else keeps `__call__`."""
    import triton

    from graphsafe.launch import direct_c_launch

    class CudaLauncher:  # the shape of Triton 3.6's launcher
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self):
            self.launch = object()

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("not called")

    run = CudaLauncher()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert direct_c_launch(run) == (run.launch, (False, True, None, None))
    monkeypatch.setattr(triton, "__version__", "3.9.0")  # its launcher takes other arguments
    assert direct_c_launch(run) is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    run.gsan_enabled = True
    assert direct_c_launch(run) is None
    run.gsan_enabled = False
    run.global_scratch_size = 64
    assert direct_c_launch(run) is None
    assert direct_c_launch(lambda *a: None) is None


# -- TMA descriptor arguments ------------------------------------------------------------------
def _descriptor_kernel(x_desc, out_ptr, n, BLOCK):  # the signature bind() reads
    pass


def _template(t: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [4, 16], [16, 1], [4, 8])


def test_a_descriptor_argument_views_each_calls_tensor(monkeypatch):
    """A TensorDescriptor given to bind() is a template: each call passes a tensor, and the
    plain and the fast launch get a descriptor of that tensor with the template's shape,
    strides and block; the template's own tensor is not kept."""
    import gc
    import weakref

    compiled = _Compiled()
    _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_descriptor_kernel, compiled)
    placeholder = torch.zeros(64)
    kept = weakref.ref(placeholder)
    launch = L.bind(kernel, (1,), _template(placeholder), placeholder, 64, BLOCK=8)
    del placeholder
    gc.collect()
    assert kept() is None, "the binding keeps no tensor"
    x, out = torch.randn(64), torch.empty(64)
    launch(x, out)  # plain: kernel[grid](descriptor of x, out, 64, BLOCK=8)
    (_, args, kwargs), = kernel.plain
    desc = args[0]
    assert desc.base is x and list(desc.shape) == [4, 16] and list(desc.strides) == [16, 1]
    assert list(desc.block_shape) == [4, 8] and args[1:] == (out, 64) and kwargs == {"BLOCK": 8}
    x2 = torch.randn(64)
    launch(x2, out)  # fast (a launcher that is not the C function: the object itself)
    (call,) = compiled.calls
    assert call[9].base is x2 and list(call[9].block_shape) == [4, 8]
    assert call[10:] == (out.data_ptr(), 64, 8)


def test_misaligned_calls_of_a_descriptor_binding_take_the_plain_launch(monkeypatch):
    """TMA needs 16-byte aligned bases: such a call keeps no handle of its own (the plain
    launch, where Triton's descriptor checks the base, says what is wrong)."""
    compiled = _Compiled()
    _fake_cuda(monkeypatch, compiled)
    kernel = _Kernel(_descriptor_kernel, compiled)
    base = torch.zeros(80)
    launch = L.bind(kernel, (1,), _template(base[:64]), base, 64, BLOCK=8)
    out = torch.empty(64)
    launch(base[:64], out)
    launch(base[:64], base[1:65])  # out misaligned: plain every time
    launch(base[:64], base[1:65])
    assert len(kernel.plain) == 3 and len(compiled.calls) == 0


def test_direct_launch_encodes_a_tensor_map_once_per_address(monkeypatch):
    """Where the C launch function is called directly, Triton 3.6's wrapper that encodes
    descriptors on every call is replaced by the C function inside it, and each descriptor
    argument comes from a cache of encoded maps keyed by the tensor's address."""
    import triton.backends.nvidia.driver as nvidia_driver

    def c_launch(*args):
        pass

    def wrap(launcher):  # the shape of Triton 3.6's `wrap_handle_tensordesc`
        def inner(*args):
            return launcher(*args)

        return inner

    encoded = []

    def encode(desc, meta):  # stands in for make_tensordesc_arg: [map, *shape, *strides]
        encoded.append((desc.base.data_ptr(), meta))
        return [f"map@{desc.base.data_ptr()}", *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    compiled = type("Compiled", (), {"metadata": type("Meta", (), {"tensordesc_meta": [{"swizzle": 3}]})()})()
    factory = L._descriptor_factory(_template(torch.zeros(64)))
    ns: dict = {}
    assert L._adopt_tensor_maps(wrap(c_launch), compiled, {0: factory}, ns) is c_launch
    a, b = torch.zeros(64), torch.zeros(64)
    first = ns["X0"](a, a.data_ptr())
    assert first == (f"map@{a.data_ptr()}", 4, 16, 16, 1)
    assert ns["X0"](a, a.data_ptr()) is first and ns["X0"](b, b.data_ptr())[0] == f"map@{b.data_ptr()}"
    assert encoded == [(a.data_ptr(), {"swizzle": 3}), (b.data_ptr(), {"swizzle": 3})]
    # Anything else (no wrapper, no metadata) keeps the launch function it was given.
    assert L._adopt_tensor_maps(c_launch, compiled, {0: factory}, {}) is c_launch
    no_meta = type("Compiled", (), {"metadata": None})()
    assert L._adopt_tensor_maps(wrap(c_launch), no_meta, {0: factory}, {}).__name__ == "inner"
