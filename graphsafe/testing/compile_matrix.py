"""Compile every Triton launch the runners bind, for a GPU target, on a machine without one.

`python -m graphsafe.testing.compile_matrix gfx942 gfx950 sm90` (what
`tests/test_compile_matrix.py` runs, in a fresh interpreter without TRITON_INTERPRET)
records the launches each op's runners bind at the ops' contract and GPU-test shapes (the
`example`, `edge_cases` and `gpu_examples` of their test cases) as a device of the target
would bind them, compiles each distinct launch once with Triton's whole pipeline for the
target (`triton.compile` of the launcher's specialisation: the AMD backend's LLVM for
gfx942 / gfx950, ptxas for sm_90) and checks that it fits the target's shared memory
(LDS on AMD). It prints one line per compiled launch and a matrix of entry point x target
(compiled / fitted launches), and ends with OK when every launch compiled and fitted.

How a target is emulated (`emulate`): the device facts that plans read
(`graphsafe.device_info`: capability, architecture, CUs, shared memory per block, fp8
units) answer as the target's device does (ROCm reports capability (9, 4) on gfx942 and
(9, 5) on gfx950, and 64 / 160 KiB of LDS), the inputs are fake CUDA tensors
(`FakeTensorMode`: shapes, strides and dtypes, no memory), `graphsafe.launch.bind` records
instead of binding, and the runners run (their launches record the call's tensors). The
aiter adapters' own Triton kernels (the CSR, bounds and copy kernels around aiter's call)
are recorded with a stand-in `aiter` whose functions only allocate their outputs. On
sm_90 the Gluon kernels are switched off, so the Triton kernels that back them are the
ones bound (the Gluon kernels have their own sm_90 compile tests).

What cannot be known this way: whether a launch that compiles and fits runs correctly and
fast on the hardware (occupancy, spills, the numerics of the target's instructions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU as the plans see it and as Triton compiles for it."""

    name: str
    backend: str  # Triton's: "hip" or "cuda"
    arch: str | int  # "gfx942" / 90
    warp_size: int
    capability: tuple[int, int]  # what torch.cuda.get_device_capability answers (ROCm: (9, 4) on gfx942)
    shared_memory: int  # bytes per block (opt-in on NVIDIA; LDS per workgroup on AMD)
    cus: int  # multiprocessors / compute units
    fp8_units: bool
    ocp_e4m3: bool

    @property
    def hip(self) -> bool:
        return self.backend == "hip"


TARGETS = {
    # MI300X: 64 KiB of LDS per workgroup, 304 CUs.
    "gfx942": Target("gfx942", "hip", "gfx942", 64, (9, 4), 64 * 1024, 304, True, False),
    # MI355X: 160 KiB of LDS, 256 CUs.
    "gfx950": Target("gfx950", "hip", "gfx950", 64, (9, 5), 160 * 1024, 256, True, True),
    # H100 / H200: 227 KiB of opt-in shared memory per block, 132 SMs.
    "sm90": Target("sm90", "cuda", 90, 32, (9, 0), 227 * 1024, 132, True, True),
}


# -- emulating a target ------------------------------------------------------------------------
def _replace_everywhere(original: Any, replacement: Any) -> None:
    """Every graphsafe module's name bound to `original` now names `replacement` (modules
    import device facts and `bind` by name)."""
    for name, module in list(sys.modules.items()):
        if not (name == "graphsafe" or name.startswith("graphsafe.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def _on_gpu(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _facts(target: Target) -> dict[str, Callable]:
    """The emulated `graphsafe.device_info` functions (the real ones answer for the CPU)."""
    from graphsafe import device_info as info

    real = {name: getattr(info, name) for name in (
        "num_sms", "compute_capability", "rocm_arch", "max_shared_memory", "has_fp8_matrix_units",
        "has_ocp_e4m3", "is_hip")}

    def fact(name: str, value: Any) -> Callable:
        def answer(device=None, *args: Any) -> Any:
            return value if device is None or _on_gpu(device) else real[name](device, *args)

        answer.__name__ = name
        return answer

    return {
        "num_sms": fact("num_sms", target.cus),
        "compute_capability": fact("compute_capability", target.capability),
        "rocm_arch": fact("rocm_arch", target.arch if target.hip else None),
        "max_shared_memory": fact("max_shared_memory", target.shared_memory),
        "has_fp8_matrix_units": fact("has_fp8_matrix_units", target.fp8_units),
        "has_ocp_e4m3": fact("has_ocp_e4m3", target.ocp_e4m3),
        "is_hip": fact("is_hip", target.hip),
    }


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel, its arguments (the call's tensors in the
    placeholders' places), constexprs and options, and what recorded it."""

    kernel: Any
    args: tuple
    meta: dict
    origin: str


def _recording_bind(launches: list[Launch], origin: list[str]) -> Callable:
    def bind(kernel, grid, *args, **meta):  # graphsafe.launch.bind: record each launch, run nothing
        def launch(*tensors):
            it = iter(tensors)
            launches.append(Launch(kernel, tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args),
                                   dict(meta), origin[0]))

        launch.state = None
        return launch

    return bind


def _stand_in_aiter() -> types.ModuleType:
    """An `aiter` whose functions allocate their outputs and compute nothing: what the
    adapters call between the Triton launches they bind."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                               dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                               return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                               out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None):
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                       num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
                       reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                       kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False,
                       g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True):
        return None, q.new_empty(o.shape[:2], dtype=torch.float32)

    def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048,
                              stable=False):
        return None

    def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False):
        return None

    def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):
        n = KV.shape[0]
        return Q.new_empty((Q.shape[0], -(-n // 256) * 256), dtype=torch.float32)[:, :n]

    def get_cu_num():
        return 0

    aiter = types.ModuleType("aiter")
    aiter.__path__ = []
    aiter.flash_attn_varlen_func = flash_attn_varlen_func
    aiter.top_k_per_row_prefill = top_k_per_row_prefill
    aiter.top_k_per_row_decode = top_k_per_row_decode
    aiter.get_cu_num = get_cu_num
    modules = {"aiter": aiter}
    for path in ("aiter.mla", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.attention",
                 "aiter.ops.triton.attention.fp8_mqa_logits", "aiter._version"):
        module = types.ModuleType(path)
        module.__path__ = []
        modules[path] = module
    modules["aiter.mla"].mla_decode_fwd = mla_decode_fwd
    modules["aiter.ops.triton.attention.fp8_mqa_logits"].fp8_mqa_logits = fp8_mqa_logits
    modules["aiter.ops.triton.attention.fp8_mqa_logits"]._gluon_fp8_mqa_logits_kernel = object()
    modules["aiter._version"].__version__ = "0.1.21.dev46+ge4048607a5"
    aiter.mla = modules["aiter.mla"]
    aiter.__version__ = modules["aiter._version"].__version__
    for path, module in modules.items():
        parent, _, child = path.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


def _basic_index(t: torch.Tensor, index: Any) -> torch.Tensor:
    """`t[index]` for basic indexing (ints, slices, None, Ellipsis) through aten view ops:
    Python indexing of a fake CUDA tensor asks for a CUDA device guard, which a CPU build
    of torch cannot give."""
    aten = torch.ops.aten
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        fill = t.dim() - sum(i is not None for i in items if i is not Ellipsis)
        items[at:at + 1] = [slice(None)] * fill
    dim = 0
    for item in items:
        if item is None:
            t = aten.unsqueeze(t, dim)
            dim += 1
        elif isinstance(item, slice):
            start, stop, step = item.indices(t.shape[dim])
            t = aten.slice(t, dim, start, max(stop, start), step)
            dim += 1
        elif isinstance(item, int):
            t = aten.select(t, dim, item)
        else:
            raise TypeError(f"compile_matrix: advanced indexing of a fake CUDA tensor ({type(item).__name__})")
    return t


def _basic_setitem(t: torch.Tensor, index: Any, value: Any) -> None:
    view = _basic_index(t, index)
    if isinstance(value, torch.Tensor):
        view.copy_(value)
    else:
        view.fill_(value)


def _clear_plan_caches() -> None:
    """Every graphsafe function cache (plans keyed by device, and the runners' builders that
    hold bound launches): another target's answers and the recording `bind`'s launches must
    not leak into or out of an emulation."""
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "graphsafe" or name.startswith("graphsafe.")) or module is None:
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and id(value) not in seen:
                seen.add(id(value))
                value.cache_clear()


@contextlib.contextmanager
def emulate(target: Target, launches: list[Launch], origin: list[str]) -> Iterator[Any]:
    """Inside: plans see `target`'s device facts, `bind` records into `launches` (each
    tagged with `origin[0]`), fake CUDA tensors stand for the inputs. Yields the fake
    tensor mode."""
    import graphsafe
    import graphsafe.backends
    import graphsafe.launch
    import graphsafe.ops.attention.fp8 as fp8
    import graphsafe.workspace.manager as manager
    from graphsafe import device_info
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    patches: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        patches.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    replaced: list[tuple[Any, Any]] = []
    for name, fake in _facts(target).items():
        original = getattr(device_info, name)
        _replace_everywhere(original, fake)
        replaced.append((fake, original))
    bind, real_bind = _recording_bind(launches, origin), graphsafe.launch.bind
    _replace_everywhere(real_bind, bind)  # (graphsafe.launch.bind itself included)
    replaced.append((bind, real_bind))
    patch(torch.version, "hip", "emulated" if target.hip else None)
    # Fake tensors have no memory: every pointer reads as 16-byte aligned.
    patch(FakeTensor, "data_ptr", lambda self: 1 << 20)
    getitem, setitem = FakeTensor.__getitem__, FakeTensor.__setitem__
    patch(FakeTensor, "__getitem__", lambda self, index: _basic_index(self, index) if self.is_cuda
          else getitem(self, index))
    patch(FakeTensor, "__setitem__", lambda self, index, value: _basic_setitem(self, index, value) if self.is_cuda
          else setitem(self, index, value))
    patch(manager, "_get_mode", lambda key: None)  # the workspace refuses fake modes (fakes never take scratch)
    patch(manager, "_stream_capturing", lambda: False)  # (a CPU build of torch has no CUDA streams)
    available, real_available = (lambda backend, device_type: backend in ("triton", "reference"),  # noqa: E731
                                 graphsafe.backends.backend_available)
    _replace_everywhere(real_available, available)
    replaced.append((available, real_available))
    if not target.hip:  # sm_90: the Triton kernels, not the Gluon ones (their own tests compile those)
        import graphsafe.ops.attention.plan as attention_plan
        import graphsafe.ops.dsv4.plan as dsv4_plan
        import graphsafe.ops.mla.plan as mla_plan

        patch(attention_plan, "gluon_module", lambda: None)
        patch(dsv4_plan, "gluon_module", lambda: None)
        patch(mla_plan, "kernel_module", lambda kernel: None)
    saved_aiter = {name: module for name, module in sys.modules.items() if name == "aiter" or name.startswith("aiter.")}
    sys.modules.update(_stand_in_aiter())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    gpu = torch.device("cuda", 0)
    fp8._probe_results[gpu] = target.fp8_units
    _clear_plan_caches()
    try:
        with graphsafe.use_backend(None), mode:  # (fresh signature tables: the composites bind through them)
            yield mode
    finally:
        _clear_plan_caches()
        fp8._probe_results.pop(gpu, None)
        for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
            del sys.modules[name]
        sys.modules.update(saved_aiter)
        for obj, attr, value in reversed(patches):
            setattr(obj, attr, value)
        for fake, original in reversed(replaced):
            _replace_everywhere(fake, original)
        manager._managers.clear()


# -- recording the launches --------------------------------------------------------------------
def _on_cuda(x: Any) -> Any:
    """A fake CUDA tensor of `x`'s shape, strides and dtype (other values unchanged)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
    return x


def _params(case) -> list[dict]:
    seen, out = [], []
    for p in [case.example, *case.edge_cases, *case.gpu_examples]:
        if p not in seen:
            seen.append(p)
            out.append(p)
    return out


# A make that reads values it drew (counts, masks) cannot run on fake tensors: it builds
# real CPU inputs instead, as long as they stay this small (the fake CUDA copies hold nothing).
REAL_INPUT_BYTES = 256 << 20


def _fake_inputs(case, params: dict) -> tuple:
    """Fake CUDA tensors of the shapes, strides and dtypes `case.make` gives `params`: made
    on fake tensors, or for real on the CPU where the make reads the values it drew."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def make() -> tuple:
        return tuple(case.make(params, torch.device("cpu"), torch.Generator().manual_seed(0)))

    try:
        return tuple(_on_cuda(a) for a in make())
    except (torch._subclasses.fake_tensor.DataDependentOutputException, GuardOnDataDependentSymNode):
        pass
    with unset_fake_temporarily():
        real = make()
        size = sum(a.numel() * a.element_size() for a in real if isinstance(a, torch.Tensor))
    if size > REAL_INPUT_BYTES:
        raise MemoryError(f"real inputs of {size} bytes")
    return tuple(_on_cuda(a) for a in real)


def record(target: Target, ops: list[str] | None = None) -> tuple[list[Launch], list[str]]:
    """The launches the runners bind for every op (or `ops`) at its test case's shapes on
    `target`, and the (op, backend, params) that could not be recorded, with why."""
    from graphsafe.registry import REGISTRY
    from graphsafe.testing.cases import all_cases

    cases = all_cases()
    launches: list[Launch] = []
    origin = [""]
    skipped: list[str] = []
    with emulate(target, launches, origin):
        for op, spec in REGISTRY.ops.items():
            if ops is not None and op not in ops or op not in cases:
                continue
            case = cases[op]
            backends = ["triton"] + (["aiter"] if target.hip and "aiter" in spec.backends else [])
            for i, params in enumerate(_params(case)):
                try:
                    args = _fake_inputs(case, params)
                except Exception as exc:  # noqa: BLE001 - a value-dependent make: reported
                    skipped.append(f"{op} params {i}: inputs not built ({type(exc).__name__}: {str(exc)[:80]})")
                    continue
                for backend in backends:
                    if backend not in spec.backends:
                        continue
                    origin[0] = f"{op}[{backend}] params {i}"
                    call = spec.call(*args)
                    if backend == "aiter" and not spec.support(backend, call):
                        continue
                    spec.prepare(backend, call)(*args)
        if target.fp8_units:
            origin[0] = "flash_attn_varlen fp8 probe"
            _record_fp8_probe(launches, origin[0])
    return launches, skipped


def _record_fp8_probe(launches: list[Launch], origin: str) -> None:
    """The one plain launch of the ops: the fp8 probe `fp8_prefill_supported` runs once per
    device (kernels/triton_quant.py:run_fp8_probe), as it launches it on a GPU."""
    from graphsafe.ops.attention.kernels import triton_quant

    fp8 = [torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda") for n in (64 * 32, 64 * 32)]
    p, v = torch.empty(64 * 64, device="cuda"), torch.empty(32 * 64, dtype=torch.float8_e4m3fn, device="cuda")
    s, o = torch.empty(64 * 64, device="cuda"), torch.empty(64 * 32, device="cuda")
    launches.append(Launch(triton_quant._fp8_probe_kernel, (*fp8, p, v, s, o), {"EMULATE": False, "num_warps": 4},
                           origin))


# -- compiling ---------------------------------------------------------------------------------
_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
    torch.float8_e4m3fnuz: "fp8e4b8", torch.float8_e5m2fnuz: "fp8e5b16",
}


def specialise(fn, args: tuple, meta: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher specialises this launch: every
    pointer 16-byte aligned (what the runners' tensors are, the hot path), ints divisible by
    16 marked so, ints equal to 1 constants, None a constexpr."""
    sig, consts, attrs = {}, {}, {}
    pos = iter(args)
    for i, p in enumerate(_kernel_params(fn)):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = meta[p.name] if p.name in meta else p.default
            continue
        if p.name in meta:  # passed by keyword
            v = meta[p.name]
        else:
            try:
                v = next(pos)
            except StopIteration:
                v = p.default
        if isinstance(v, torch.Tensor):
            sig[p.name], attrs[(i,)] = "*" + _TYPES[v.dtype], [["tt.divisibility", 16]]
        elif v is None:
            sig[p.name], consts[p.name] = "constexpr", None
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v == 1 and i not in getattr(fn, "do_not_specialize", ()) and p.name not in _no_specialise(fn):
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and p.name not in _no_specialise(fn):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


@dataclasses.dataclass(frozen=True)
class _Param:
    name: str
    is_constexpr: bool
    default: Any


def _kernel_params(fn) -> list:
    """A kernel's parameters: a JITFunction's own, or (under TRITON_INTERPRET, where a
    kernel is an InterpretedFunction) read from the Python function's annotations."""
    if hasattr(fn, "params"):
        return fn.params
    import inspect

    out = []
    for p in inspect.signature(fn.fn).parameters.values():
        constexpr = "constexpr" in str(p.annotation)
        out.append(_Param(p.name, constexpr, None if p.default is inspect.Parameter.empty else p.default))
    return out


def _no_specialise(fn) -> set[str]:
    names = set()
    params = _kernel_params(fn)
    for item in getattr(fn, "do_not_specialize", ()) or ():
        names.add(params[item].name if isinstance(item, int) else item)
    return names


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclasses.dataclass
class Variant:
    """One distinct compile: the kernel (its module and name), the launcher's specialisation
    (signature, constexprs, hints), the options, and the launches that recorded it."""

    kernel: str
    launch: Launch
    sig: dict
    consts: dict
    attrs: dict
    options: dict
    origins: list[str]

    @property
    def key(self) -> tuple:
        return (self.kernel, tuple(self.sig.items()), tuple(sorted(self.consts.items(), key=str)),
                tuple(sorted(self.attrs)), tuple(sorted(self.options.items())))


@dataclasses.dataclass
class Compiled:
    variant: Variant
    shared: int | None
    error: str | None
    seconds: float
    bound: int | None  # the plan's LDS bound of this launch, where the plan has one

    @property
    def kernel(self) -> str:
        return self.variant.kernel


def _kernel_name(fn) -> str:
    return f"{fn.fn.__module__.rpartition('.')[2]}.{fn.__name__}"


def distinct(launches: list[Launch]) -> list[Variant]:
    """One variant per distinct compile (kernel, signature, constexprs, hints, options)."""
    out: dict[tuple, Variant] = {}
    for launch in launches:
        options = {k: v for k, v in launch.meta.items() if k in _OPTIONS}
        meta = {k: v for k, v in launch.meta.items() if k not in _OPTIONS}
        sig, consts, attrs = specialise(launch.kernel, launch.args, meta)
        variant = Variant(_kernel_name(launch.kernel), launch, sig, consts, attrs, options, [launch.origin])
        if variant.key in out:
            if launch.origin not in out[variant.key].origins:
                out[variant.key].origins.append(launch.origin)
            continue
        out[variant.key] = variant
    return list(out.values())


def _tiles(variant: Variant) -> int:
    """A proxy of a variant's shared memory: the product of its BLOCK_* constexprs and
    pipeline stages (Triton's default: 2)."""
    size = variant.options.get("num_stages", 2)
    for name, value in variant.consts.items():
        if name.startswith("BLOCK") and isinstance(value, int) and not isinstance(value, bool) and value > 1:
            size *= value
    return size


def _features(variant: Variant) -> int:
    """How many code paths a variant switches on: truthy flag constexprs (bools, nonzero
    floats, a window >= 0) and 8-bit pointers."""
    flags = sum(1 for v in variant.consts.values() if (isinstance(v, bool) and v) or
                (isinstance(v, float) and v != 0.0))
    return flags + sum(1 for t in variant.sig.values() if t.startswith("*fp8"))


def ci_selection(variants: list[Variant]) -> list[Variant]:
    """The variants the CI test compiles (one or two per entry point and pointer dtypes):
    per (kernel, pointer types; bf16 and fp16 as one), the largest (`_tiles`: the one the shared memory is tightest
    for) and the one with the most code paths on (`_features`), which may be the same. The
    full matrix (`--all`) compiles every variant."""
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        # bf16 and fp16 compile alike: one group of "16-bit" pointers.
        pointers = {"*16" if t in ("*bf16", "*fp16") else t for t in v.sig.values() if t.startswith("*")}
        groups.setdefault((v.kernel, tuple(sorted(pointers - {"*i32", "*i64", "*fp32"}))), []).append(v)
    chosen: dict[tuple, Variant] = {}
    for group in groups.values():
        for pick in (max(group, key=lambda v: (_tiles(v), _features(v))),
                     max(group, key=lambda v: (_features(v), _tiles(v)))):
            chosen[pick.key] = pick
    return list(chosen.values())


def plan_bound(variant: Variant, direct: bool = False) -> int | None:
    """The LDS its plan bounds this launch by (the models ROCm's configs are fitted with:
    `graphsafe.ops.attention.plan.*_shared_bytes`, `graphsafe.ops.mla.plan.shared_memory_bytes`;
    `direct`: the target loads straight into LDS, gfx950), None for kernels without one."""
    from graphsafe.ops.attention import plan as attention
    from graphsafe.ops.mla import plan as mla

    c, stages, warps = variant.consts, variant.options.get("num_stages", 2), variant.options.get("num_warps", 4)
    if variant.kernel == "triton_prefill._varlen_fwd_kernel":
        return attention.varlen_shared_bytes((c["BLOCK_M"], c["BLOCK_N"], warps, stages), c["D"], c["DV"], c["FP8"],
                                             direct)
    if variant.kernel == "triton_decode._paged_decode_kernel":
        return attention.decode_shared_bytes((c["BLOCK_N"], warps, stages), c["D"], c["DV"], c["KV_FP8"], direct)
    if variant.kernel == "triton_paged_prefill._paged_prefill_kernel":
        return attention.paged_prefill_shared_bytes((c["BLOCK_M"], c["BLOCK_N"], warps, stages), c["D"], c["DV"],
                                                    c["KV_FP8"], direct)
    if variant.kernel == "triton_split_kv.mla_attn_kernel":
        cfg = mla.KernelConfig(block_h=c["BLOCK_H"], block_n=c["BLOCK_N"], num_warps=warps, num_stages=stages)
        return mla.shared_memory_bytes(cfg, c["R"], c["P"], c["FP8_DS"])
    return None


def compile_all(target: Target, variants: list[Variant], report: Callable[[Compiled], None] | None = None
                ) -> list[Compiled]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gpu = GPUTarget(target.backend, target.arch, target.warp_size)
    results = []
    for v in variants:
        start = time.perf_counter()
        shared, error = None, None
        try:
            k = triton.compile(ASTSource(fn=v.launch.kernel, signature=v.sig, constexprs=v.consts, attrs=v.attrs),
                               target=gpu, options=v.options)
            shared = int(k.metadata.shared)
        except Exception as exc:  # noqa: BLE001 - reported per launch
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        bound = plan_bound(v, target.arch == "gfx950") if target.hip else None
        results.append(Compiled(v, shared, error, time.perf_counter() - start, bound))
        if report is not None:
            report(results[-1])
    return results


def check(target: Target, r: Compiled) -> str:
    """"" when the launch compiled, fits the target's shared memory and (on ROCm) stays
    within its plan's bound; else what went wrong."""
    if r.error:
        return "FAILED " + r.error
    if r.shared > target.shared_memory:
        return f"DOES NOT FIT ({r.shared} > {target.shared_memory})"
    if r.bound is not None and r.shared > r.bound:
        return f"OVER THE PLAN'S BOUND ({r.shared} > {r.bound})"
    return ""


def main(argv: list[str]) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    names = [a for a in argv if not a.startswith("-")] or list(TARGETS)
    ops = None
    for a in argv:
        if a.startswith("--ops="):
            ops = a.split("=", 1)[1].split(",")
    everything = "--all" in argv
    ok = True
    matrix: dict[str, dict[str, tuple[int, int, int]]] = {}
    for name in names:
        target = TARGETS[name]
        start = time.perf_counter()
        launches, skipped = record(target, ops)
        variants = distinct(launches)
        chosen = variants if everything else ci_selection(variants)
        recorded = time.perf_counter() - start
        for s in skipped:
            print(f"[{name}] skipped {s}", flush=True)

        def report(r: Compiled) -> None:
            problem = check(target, r)
            v = r.variant
            more = f" +{len(v.origins) - 1}" if len(v.origins) > 1 else ""
            print(f"[{name}] {r.kernel} {v.consts} {v.options} shared {r.shared} bound {r.bound} "
                  f"({problem or 'fits'}; {r.seconds:.1f}s) <- {v.origins[0]}{more}", flush=True)

        results = compile_all(target, chosen, report)
        for r in results:
            ok &= not check(target, r)
            row = matrix.setdefault(r.kernel, {})
            n, c, f = row.get(name, (0, 0, 0))
            row[name] = (n + 1, c + (r.error is None), f + (r.error is None and r.shared <= target.shared_memory))
        print(f"[{name}] {len(launches)} launches recorded ({len(variants)} distinct) in {recorded:.1f}s; "
              f"{len(results)} compiled in {sum(r.seconds for r in results):.1f}s", flush=True)
    print("| kernel | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for kernel in sorted(matrix):
        cells = []
        for name in names:
            n, c, f = matrix[kernel].get(name, (0, 0, 0))
            cells.append(f"{c}/{n} compile, {f}/{n} fit" if n else "-")
        print(f"| `{kernel}` | " + " | ".join(cells) + " |")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
