"""Launching Triton kernels without Triton's per-call binder: `bind` once, call many times.

`kernel[grid](*args, **meta)` re-derives everything on every call: it binds the Python
arguments to the kernel's signature, specialises each one (dtype, 16-byte alignment,
integer divisibility), builds a cache key that includes `str()` of the options, looks the
compiled kernel up, builds launch metadata for the profiler hooks, and only then calls the
C launcher, which asks each tensor for `data_ptr()` and the driver whether that pointer is
a device pointer. On a loaded host that is 15-20 us per launch, more than a small kernel
runs on the GPU.

`bind(kernel, grid, *args, **meta)` takes the same arguments once, for one *signature*:
the grid, every non-tensor argument (sizes, strides, scalars), the constexprs and the
options are fixed; the tensor arguments are what each call passes. The returned callable
takes the tensors only, in the order they appear among `args`:

    launch = bind(_copy_kernel, (n_blocks,), src, dst, n, src.stride(0), BLOCK=1024)
    launch(src, dst)          # every later call with tensors of the same dtypes

A call costs one `data_ptr()` per tensor, an alignment test, the current stream and the C
launcher with plain integers for pointers (Inductor and vLLM launch their compiled
kernels the same way). On a Triton whose launcher this module has read (3.6), the C
launch function is called directly, skipping the Python `__call__` of Triton's
`CudaLauncher` (about 1 us a launch): see `direct_c_launch`. The first call goes through `kernel[grid]` (compiling if needed)
and keeps the compiled kernel it returns; later calls launch that handle directly.
Triton specialises a kernel on which pointers are 16-byte aligned, so handles are kept
per alignment pattern: the all-aligned one is the hot path, a view at an odd offset gets
its own handle on its first call.

What keeps it correct on any Triton:
* the handle is kept only if the object `kernel[grid]` returns has the `run`,
  `function` and `packed_metadata` attributes of Triton's `CompiledKernel` (Triton 3.3 to
  3.9 at least; their `run` takes every bound argument, constexprs included, in signature
  order). Otherwise, and always under `TRITON_INTERPRET=1`, every call is the plain
  `kernel[grid](...)` launch: slower, never wrong;
* a call that runs while launch hooks are installed (a profiler such as Proton), or
  whose current device is not the bound tensors' device, takes the plain launch too;
  so does every call after a compiled kernel's `run` refused its arguments (a
  calling convention this module does not know: the C launcher parses before it
  launches, so nothing ran);
* what the handle bakes in (non-tensor arguments, constexprs, tensor dtypes) is what the
  caller fixed at `bind`: one binding serves one signature. The registry (`prepare`
  functions of the backends) keeps one binding per call signature.

TMA descriptors: an argument given to `bind` as a host `TensorDescriptor` (Gluon's or
`triton.tools`') is a per-call argument like a tensor: the call passes the tensor the
descriptor views (its base), and the binding keeps the rest (shape, strides, block,
layout), fixed by the signature. Triton's launcher encodes a descriptor's 128-byte
`CUtensorMap` on every launch (about 2 us each); where the C launch function is called
directly (see above), the encoded map is kept per base address instead (`_tensor_maps`),
so a call whose tensors sit where an earlier call's did (a step replayed on the same
buffers) encodes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Options of `kernel[grid](...)` that are not kernel parameters.
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid")


def _triton_runtime() -> tuple[Any, Any]:
    """(Triton's active driver, its runtime knobs) or (None, None) where either is missing."""
    try:
        from triton import knobs
        from triton.runtime import driver
    except ImportError:  # Triton < 3.3: no knobs module; the plain launch is used
        return None, None
    return driver, getattr(knobs, "runtime", None)


def _hooks_probe(runtime: Any) -> Callable[[], bool] | None:
    """A cheap test of "launch hooks are installed", or None where we cannot tell."""
    enter = getattr(runtime, "launch_enter_hook", None)
    exit_ = getattr(runtime, "launch_exit_hook", None)
    if hasattr(enter, "calls") and hasattr(exit_, "calls"):  # Triton 3.4+: HookChain objects
        return lambda: bool(enter.calls or exit_.calls)
    if enter is None and exit_ is None:  # older: plain optional attributes
        return lambda: runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None
    return None


def interpreter_enabled() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    from graphsafe.backends import triton_interpreter_enabled

    return triton_interpreter_enabled()


# The current CUDA device, asked on every fast launch. torch.cuda.current_device() checks
# lazy initialisation first (~0.3 us); a bound launch exists only after a CUDA tensor was
# seen, so CUDA is initialised and the raw query is enough where this torch has it.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _tensor_device(t: torch.Tensor) -> int | None:
    """The CUDA device index of `t`, None off CUDA (no fast launch there)."""
    if t.device.type != "cuda":
        return None
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def compiled_handle(compiled: Any) -> tuple[Callable, Any, Any] | None:
    """(run, function, packed_metadata) of what `kernel[grid](...)` returned, or None when it
    is not a compiled kernel this module knows how to launch (the interpreter returns None)."""
    try:
        return compiled.run, compiled.function, compiled.packed_metadata
    except Exception:  # noqa: BLE001 - anything unexpected means "use the plain launch"
        return None


# Triton releases whose `CudaLauncher.__call__(gridX, gridY, gridZ, stream, function,
# *args)` was read: with no global or profile scratch (sizes 0) and GSan off, it only
# calls its C `launch(gridX, gridY, gridZ, stream, function, cooperative, pdl,
# global_scratch, profile_scratch, *args)` with None scratch. Other releases (3.9 passes
# the launch metadata and signature separately) keep the launcher's `__call__`.
_DIRECT_C_LAUNCH_RELEASES = ("3.6.",)
_LAUNCHER_CALL_PARAMS = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


def direct_c_launch(run: Any) -> tuple[Callable, tuple[Any, ...]] | None:
    """(C launch function, the arguments it takes between `function` and the packed
    metadata) for a compiled kernel's `run` (its launcher) when calling the C function
    directly is what `run` would do; None otherwise (the launcher is then called)."""
    try:
        import triton

        if not triton.__version__.startswith(_DIRECT_C_LAUNCH_RELEASES) or type(run).__name__ != "CudaLauncher":
            return None
        if list(inspect.signature(type(run).__call__).parameters) != _LAUNCHER_CALL_PARAMS:
            return None
        if run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", False):
            return None
        return run.launch, (bool(run.launch_cooperative_grid), bool(run.launch_pdl), None, None)
    except Exception:  # noqa: BLE001 - anything unexpected: call the launcher
        return None


def _is_tensor_descriptor(value: Any) -> bool:
    """A host TMA descriptor of Triton (Gluon's `TensorDescriptor` or `triton.tools`')."""
    return type(value).__name__ == "TensorDescriptor" and all(
        hasattr(value, a) for a in ("base", "shape", "strides", "block_shape"))


def _descriptor_factory(template: Any) -> Callable[[torch.Tensor], Any]:
    """`factory(base)`: a TensorDescriptor like `template` (same shape, strides, block,
    layout) viewing `base`. The template's own base is not kept."""
    fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(template) if f.name != "base"}
    return functools.partial(type(template), **fields)


def _unwrapped_tensordesc_launch(launch: Any) -> Callable | None:
    """The C launch function inside Triton 3.6's tensor-descriptor wrapper of it (the
    wrapper encodes each TensorDescriptor argument into a tensor map, shape and strides on
    every call), or None when `launch` is not that wrapper."""
    code = getattr(launch, "__code__", None)
    if code is None or launch.__name__ != "inner" or "launcher" not in code.co_freevars:
        return None
    inner = launch.__closure__[code.co_freevars.index("launcher")].cell_contents
    return inner if callable(inner) else None


def _tensor_maps(factory: Callable, meta: Any, encode: Callable, capacity: int = 64) -> Callable:
    """`expand(tensor, address)`: the C launch function's arguments for the descriptor
    `factory(tensor)` of `tensor` at `address` (the encoded tensor map, then the shape and
    strides), encoded by `encode(descriptor, meta)` (Triton's `make_tensordesc_arg`) once
    per address. The map depends on nothing else: the shape, strides, block and dtype
    are the binding's. At most `capacity` addresses are kept (then the cache starts afresh)."""
    maps: dict[int, tuple] = {}

    def expand(tensor: torch.Tensor, address: int) -> tuple:
        args = maps.get(address)
        if args is None:
            if len(maps) >= capacity:
                maps.clear()
            args = maps[address] = tuple(encode(factory(tensor), meta))
        return args

    return expand


class LaunchState:
    """What a bound launch did so far (tests and the bench read it).

    `fast`: calls launch the compiled handle (False until the first aligned call, and
    forever under the interpreter or an unknown Triton). `plain_calls`: calls that took
    the plain `kernel[grid]` path.
    """

    __slots__ = ("kernel", "grid", "num_tensors", "plain_calls", "_ns")

    @property
    def direct(self) -> bool:
        """Whether the fast path calls Triton's C launch function directly."""
        return self.fast and self._ns.get("DIRECT", False)

    def __init__(self, kernel: Any, grid: tuple[int, int, int], num_tensors: int, ns: dict[str, Any]) -> None:
        self.kernel = kernel
        self.grid = grid
        self.num_tensors = num_tensors
        self.plain_calls = 0
        self._ns = ns

    @property
    def fast(self) -> bool:
        """Whether a call with all tensors 16-byte aligned launches a compiled handle."""
        return self._ns.get("RUN") is not None


Launch = Callable[..., Any]
_PLAIN_LAUNCHES = [0]


@functools.cache
def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed kernel compile raises at a launch (nothing launched): OutOfResources,
    triton.CompilationError, RuntimeError (a failed MLIR pass). The runners that have a
    fallback kernel catch these around their Gluon launches."""
    import triton
    from triton.runtime import OutOfResources

    return OutOfResources, triton.CompilationError, RuntimeError


def plain_launch_count() -> int:
    """Launches so far, in this process, that went through `kernel[grid]` (the binder)."""
    return _PLAIN_LAUNCHES[0]


_MISSING = object()


class _Unadoptable(Exception):
    """The compiled kernel's `run` refused our arguments (an unknown Triton): plain launches."""


def _make_launch(kernel: Any, grid: tuple[int, int, int], full_args: list[Any], tensor_slots: list[int],
                 num_positional: int, keywords: dict[str, Any], device: int | None,
                 descriptors: dict[int, Any]) -> Launch:
    """The generated launch function. `full_args`: every kernel parameter in signature
    order (None at tensor slots); the plain launch passes the first `num_positional` by
    position and `keywords` (the rest by name, and the options) by keyword.

    Compiled handles are kept per alignment mask (bit i: tensor i 16-byte aligned), the
    one property of the tensors Triton specialises on: the all-aligned handle is the
    fast path's, others serve views at odd offsets from the second such call on.
    `descriptors`: {tensor index: `_descriptor_factory`} of the tensors that are passed
    as TMA descriptors (their calls all-aligned, as TMA requires)."""
    n = len(tensor_slots)
    slot_of = {arg: i for i, arg in enumerate(tensor_slots)}
    ts = ", ".join(f"t{i}" for i in range(n))
    ps = ", ".join(f"p{i}" for i in range(n))

    def tensor_arg(i: int, form: str) -> str:
        """Tensor i as the plain launch, a kept handle's launcher ("handle") or the adopted
        fast launch takes it."""
        if i not in descriptors:  # the C launcher takes an int as the device address
            return f"t{i}" if form == "plain" else f"p{i}"
        # A descriptor: the object itself, or on the fast launch its launcher's form (X: the
        # object or the encoded map with its shape and strides, chosen at adoption).
        return f"*X{i}(t{i}, p{i})" if form == "fast" else f"D{i}(t{i})"

    def arg_list(count: int, form: str) -> list[str]:
        return [tensor_arg(slot_of[i], form) if i in slot_of else f"A[{i}]" for i in range(count)]

    # The plain launch: `kernel[grid](*positional args, **the rest and the options)`.
    plain_args = ", ".join([*arg_list(num_positional, "plain"), "**KW"])
    # The fast launch: every parameter in order, pointers as integers (the C launcher takes
    # an int as the device address and skips its data_ptr() call and driver query).
    fast_args = ", ".join(arg_list(len(full_args), "fast"))
    handle_args = ", ".join(arg_list(len(full_args), "handle"))
    ptrs = "; ".join(f"p{i} = t{i}.data_ptr()" for i in range(n)) or "pass"
    any_misaligned = " | ".join(f"p{i}" for i in range(n)) or "0"
    mask = " | ".join(f"((p{i} & 15) == 0) << {i}" for i in range(n)) or "0"
    source = f"""
def plain({ts}):
    STATE.plain_calls += 1
    PLAIN[0] += 1
    if DEVICE is not None and CURRENT_DEVICE() != DEVICE:
        with DEVICE_GUARD(DEVICE):
            return KERNEL[GRID]({plain_args})
    return KERNEL[GRID]({plain_args})

def slow({ts}{", " if n else ""}{ps}):
    if not ENABLED[0] or HOOKS() or CURRENT_DEVICE() != DEVICE:
        return plain({ts})
    mask = {mask}
    handle = HANDLES.get(mask, MISSING)
    if handle is MISSING:
        return ADOPT(mask, plain({ts}))
    if handle is None:
        return plain({ts})
    try:
        handle[0](G0, G1, G2, STREAM(DEVICE), handle[1], handle[2], None, None, None, {handle_args})
    except TypeError:
        REFUSED()
        return plain({ts})

def launch({ts}):
    {ptrs}
    if RUN is None or ({any_misaligned}) & 15 or HOOKS() or CURRENT_DEVICE() != DEVICE:
        return slow({ts}{", " if n else ""}{ps})
    try:  # free when nothing is raised (zero-cost exceptions)
        RUN(G0, G1, G2, STREAM(DEVICE), FUNC, *HEAD, {fast_args})
    except UNADOPTABLE:
        return plain({ts})
"""
    driver, runtime = _triton_runtime()
    hooks = _hooks_probe(runtime) if runtime is not None else None
    enabled = device is not None and driver is not None and hooks is not None
    ns: dict[str, Any] = {
        "KERNEL": kernel, "GRID": grid, "KW": keywords, "A": full_args, "DEVICE": device,
        "G0": grid[0], "G1": grid[1], "G2": grid[2], "HOOKS": hooks, "RUN": None,
        "HANDLES": {}, "MISSING": _MISSING, "ENABLED": [enabled], "PLAIN": _PLAIN_LAUNCHES,
        "UNADOPTABLE": _Unadoptable,
        "CURRENT_DEVICE": _current_device if device is not None else None, "DEVICE_GUARD": torch.cuda.device,
    }
    for i, factory in descriptors.items():
        ns[f"D{i}"] = factory
        ns[f"X{i}"] = functools.partial(_as_object, factory)
    state = ns["STATE"] = LaunchState(kernel, grid, n, ns)
    exec(compile(source, f"<graphsafe.launch {getattr(kernel, '__name__', kernel)}>", "exec"), ns)
    launch = ns["launch"]
    launch.state = state
    all_aligned = (1 << n) - 1

    def refused() -> None:
        # Triton's C launcher parses every argument before it launches: a TypeError means
        # a calling convention this module does not know, and nothing ran. Plain from now.
        ns["ENABLED"][0] = False
        ns["RUN"] = None
        ns["HANDLES"].clear()

    def adopt(mask: int, compiled: Any) -> None:
        handle = compiled_handle(compiled)
        if handle is not None:
            try:
                ns["STREAM"] = driver.active.get_current_stream
            except Exception:  # noqa: BLE001 - no active driver: keep the plain launch
                handle = None
        if descriptors and mask != all_aligned:
            handle = None  # (TMA needs 16-byte aligned bases: the plain launch says so)
        ns["HANDLES"][mask] = handle  # None: this mask stays plain (one try)
        if handle is None or mask != all_aligned:
            return
        run, head = handle[0], (handle[2], None, None, None)  # packed metadata, launch metadata, hooks
        direct = direct_c_launch(run)
        if direct is not None:
            run, head = direct[0], (*direct[1], *head)
            if descriptors:
                run = _adopt_tensor_maps(run, compiled, descriptors, ns)
        ns["DIRECT"] = direct is not None

        def run_first(*launch_args: Any) -> None:
            ns["RUN"] = None  # until this first fast launch went through
            try:
                run(*launch_args)
            except TypeError:
                refused()
                raise _Unadoptable from None
            ns["RUN"] = run

        ns["FUNC"], ns["HEAD"] = handle[1], head
        ns["RUN"] = run_first

    ns["ADOPT"], ns["REFUSED"] = adopt, refused
    return launch


def _as_object(factory: Callable, tensor: torch.Tensor, address: int) -> tuple:
    """A descriptor argument as the TensorDescriptor object (what Triton's launcher takes)."""
    return (factory(tensor),)


def _adopt_tensor_maps(launch: Callable, compiled: Any, descriptors: dict[int, Any], ns: dict[str, Any]) -> Callable:
    """The launch function of a direct C launch with descriptors: where `launch` is Triton
    3.6's wrapper that encodes them on every call, the C function inside it, and the
    descriptor arguments (`X{i}`) from per-address caches of encoded maps; else `launch`
    unchanged (it takes the descriptor objects)."""
    raw = _unwrapped_tensordesc_launch(launch)
    metas = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:
        return launch
    if raw is None or not metas or len(metas) != len(descriptors):
        return launch
    # tensordesc_meta lists the descriptor parameters in signature order, as the slots are.
    for meta, (i, factory) in zip(metas, sorted(descriptors.items())):
        ns[f"X{i}"] = _tensor_maps(factory, meta, make_tensordesc_arg)
    return raw


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    g = tuple(int(x) for x in grid)
    if not 1 <= len(g) <= 3:
        raise ValueError(f"a launch grid has 1 to 3 dimensions, got {grid!r}")
    return g + (1,) * (3 - len(g))  # type: ignore[return-value]


def bind(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> Launch:
    """Bind `kernel` (a `@triton.jit` or Gluon function) to a grid, its non-tensor arguments,
    constexprs and options; the result is called with the tensor arguments only, in order.

    `args` and `meta` are what `kernel[grid](*args, **meta)` would take. Tensor positions
    are placeholders here (only their device is read: a CUDA tensor makes the binding
    eligible for the fast launch on that device); no tensor is kept. A TensorDescriptor
    argument is a template: each call passes the tensor it is to view (module docstring).
    """
    fn = getattr(kernel, "fn", None)
    if fn is None:
        raise TypeError(f"bind() needs a @triton.jit function, got {type(kernel).__name__}")
    keywords = {k: meta.pop(k) for k in _OPTIONS if k in meta}
    bound = inspect.signature(fn).bind(*args, **meta)
    bound.apply_defaults()
    full_args: list[Any] = []
    tensor_slots: list[int] = []
    descriptors: dict[int, Any] = {}
    device: int | None = None
    for i, (name, value) in enumerate(bound.arguments.items()):
        descriptor = _is_tensor_descriptor(value)
        if isinstance(value, torch.Tensor) or descriptor:
            if i >= len(args):
                raise TypeError(f"{fn.__name__}: pass tensor argument {name!r} by position to bind()")
            if descriptor:
                descriptors[len(tensor_slots)] = _descriptor_factory(value)
                value = value.base
            tensor_slots.append(i)
            if device is None:
                device = _tensor_device(value)
            value = None
        elif i >= len(args):
            keywords[name] = value
        full_args.append(value)
    return _make_launch(kernel, _grid3(grid), full_args, tensor_slots, len(args), keywords, device, descriptors)


def output_allocator(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    """A function returning a new uninitialised contiguous tensor of `shape` on each call.

    Runners allocate their outputs with it: `torch.empty_strided` with the strides worked
    out once costs about 1 us less a call than `torch.empty(shape, dtype=, device=)` (H200
    host, Triton 3.6), which re-derives them."""
    shape = tuple(int(s) for s in shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    strides = tuple(reversed(strides))
    empty_strided = torch.empty_strided

    def new_output() -> torch.Tensor:
        return empty_strided(shape, strides, dtype=dtype, device=device)

    return new_output
