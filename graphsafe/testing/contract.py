"""The op contract as executable checks (docs/design.md, "The op contract").

Each `check_*` function raises AssertionError (or the op's own error) on a violation.
The pytest suite parametrises them over the registry; `python -m graphsafe check` runs
them over the example inputs of every op on every device here.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphsafe.errors import InputError
from graphsafe.registry import OpSpec, ops
from graphsafe.testing.cases import case_for
from graphsafe.testing.cases import OpCase, Params
from graphsafe.testing.compare import default_compare, mutated_args

# torch.library.opcheck utilities we hold every op to. test_autograd_registration is
# left out on purpose: these are inference ops with no autograd formula, and calling
# them on inputs that require grad is not supported.
CONTRACT_TEST_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def clone_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides, also for views with gaps (strided caches)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def clone_args(args: tuple) -> tuple:
    return tuple(clone_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)


def run_backend(spec: OpSpec, backend: str, args: tuple) -> Any:
    """Validate and run one backend directly (bypassing selection)."""
    return spec.runner(backend)(*args)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def fake_outputs(spec: OpSpec, args: tuple) -> Any:
    """Run the op under a FakeTensorMode on fake copies of `args`; returns fake outputs."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        return spec.overload(*fake_args)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def opcheck_op(spec: OpSpec, args: tuple) -> tuple[str, ...]:
    """torch.library.opcheck with CONTRACT_TEST_UTILS; returns the utils that ran.

    With fp8 tensors among the args test_schema is replaced by our bitwise
    `check_mutation_and_aliasing`: torch's SchemaCheckMode compares tensors with
    `allclose`, which has no fp8 kernels.
    """
    utils = CONTRACT_TEST_UTILS
    if any(t.dtype in _FP8 for t in _tensors(args)):
        utils = tuple(u for u in utils if u != "test_schema")
        check_mutation_and_aliasing(spec, args)
    torch.library.opcheck(spec.overload, clone_args(args), test_utils=utils)
    return utils


def check_fake_matches_real(spec: OpSpec, args: tuple) -> None:
    real = _tensors(spec.overload(*clone_args(args)))
    fake = _tensors(fake_outputs(spec, args))
    assert len(real) == len(fake), f"{spec.name}: real returns {len(real)} tensors, fake {len(fake)}"
    for i, (r, f) in enumerate(zip(real, fake)):
        got = (tuple(f.shape), f.dtype, tuple(f.stride()), f.device)
        want = (tuple(r.shape), r.dtype, tuple(r.stride()), r.device)
        assert got == want, f"{spec.name} output {i}: fake (shape, dtype, strides, device) {got} != real {want}"


def check_backend_matches_reference(spec: OpSpec, case: OpCase, backend: str, args: tuple, params: Params) -> None:
    ref_args, test_args = clone_args(args), clone_args(args)
    with nonfinite_expected():  # random cache bytes hold NaN and huge fp8 scales
        expected = run_backend(spec, "reference", ref_args)
        actual = run_backend(spec, backend, test_args)
    if case.compare is not None:
        case.compare(expected, actual, ref_args, test_args, params)
    else:
        default_compare(spec, expected, actual, ref_args, test_args)


def check_repeated_calls_match_reference(
    spec: OpSpec, case: OpCase, backend: str, params: Params, device: torch.device, seeds: tuple[int, ...] = (21, 22, 23),
) -> int:
    """Calls through the dispatcher with `backend` forced, on fresh inputs of one signature:
    the first call validates and prepares, later ones reuse the runner (and on a GPU
    launch compiled handles, `graphsafe.launch`); each must equal the reference. Returns
    the plain `kernel[grid]` launches of the last call (0 on a GPU: none pays the binder)."""
    from graphsafe.launch import plain_launch_count
    from graphsafe.registry import use_backend

    plain = 0
    with use_backend(backend, ops=[spec.qualname]):
        for seed in seeds:
            args = case.inputs(params, device, seed)
            ref_args, test_args = clone_args(args), clone_args(args)
            expected = run_backend(spec, "reference", ref_args)
            before = plain_launch_count()
            actual = spec.overload(*test_args)
            plain = plain_launch_count() - before
            if case.compare is not None:
                case.compare(expected, actual, ref_args, test_args, params)
            else:
                default_compare(spec, expected, actual, ref_args, test_args)
    return plain


def check_runner_keeps_no_inputs(spec: OpSpec, case: OpCase, backend: str, params: Params, device: torch.device) -> None:
    """The runners the registry keeps per signature hold shapes and plans, never the call's
    tensors: after the call, nothing keeps an input alive."""
    import gc
    import weakref

    from graphsafe.registry import use_backend

    with use_backend(backend, ops=[spec.qualname]):
        args = case.inputs(params, device, 31)
        refs = [weakref.ref(t) for t in args if isinstance(t, torch.Tensor)]
        out = spec.overload(*args)
        del args, out
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert not alive, f"{spec.name}[{backend}]: tensor inputs {alive} stay alive after the call"


# -- unread elements, ids out of range, non-finite inputs ---------------------------------
# What Triton's CPU interpreter (numpy underneath) warns when a kernel computes with NaN or
# inf (inf - inf, 0 * inf, exp2 of a huge score, a row of NaN). Expected wherever NaN or inf
# are fed on purpose, and where random cache bytes decode to NaN or huge scales (the
# comparisons with the reference, the ids check): the checks below filter exactly these,
# from the interpreter only, and tests that feed them take the `nonfinite` mark
# (tests/conftest.py); any other warning still shows.
NONFINITE_WARNINGS = (
    "invalid value encountered in",
    "overflow encountered in",
    "divide by zero encountered in",
    "All-NaN slice encountered",
)
# The interpreter's own module, or numpy's where the interpreter reduces (np.max of a NaN row).
INTERPRETER_MODULE = r"(triton\.runtime\.interpreter|numpy\._core\.fromnumeric)"


def nonfinite_warning_filters() -> list[str]:
    """NONFINITE_WARNINGS as pytest `filterwarnings` entries ("action:message:category:module")."""
    return [f"ignore:{m}:RuntimeWarning:{INTERPRETER_MODULE}" for m in NONFINITE_WARNINGS]


@contextmanager
def nonfinite_expected() -> Iterator[None]:
    """Inside: the interpreter's NONFINITE_WARNINGS are not shown (NaN or inf fed on purpose)."""
    with warnings.catch_warnings():
        for message in NONFINITE_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=RuntimeWarning, module=INTERPRETER_MODULE)
        yield


def poison_value(dtype: torch.dtype) -> Any:
    """What an unread element is filled with: NaN for floats (fp8 included), 0xFF bytes
    for uint8 (an fp8 NaN, a NaN float32 scale), the most negative value for other ints."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.uint8:
        return 0xFF
    return torch.iinfo(dtype).min


def poisoned(args: tuple, marks) -> tuple:
    """Copies of `args` with every element in `marks` ([(arg_index, mask), ...]) poisoned."""
    out = list(clone_args(args))
    for index, mask in marks:
        t = out[index]
        assert isinstance(t, torch.Tensor) and mask.shape == t.shape, f"unread mask of argument {index}: shape"
        if t.dtype in _FP8:
            t.view(torch.uint8).masked_fill_(mask.to(t.device), 0x7F)
        else:
            t.masked_fill_(mask.to(t.device), poison_value(t.dtype))
    return tuple(out)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(bits) if t.dim() else t.reshape(1).view(bits)


def assert_bits_equal(expected: Any, actual: Any, what: str) -> None:
    """Recursively: same tensors bit for bit (a NaN equals a NaN of the same bits)."""
    e_list, a_list = _tensors(expected), _tensors(actual)
    assert len(e_list) == len(a_list), f"{what}: {len(a_list)} tensors, expected {len(e_list)}"
    for i, (e, a) in enumerate(zip(e_list, a_list)):
        assert e.shape == a.shape and e.dtype == a.dtype, f"{what}[{i}]: shape/dtype differ"
        diff = (_as_bits(e) != _as_bits(a)).cpu()
        if diff.any():
            first = tuple(int(x) for x in diff.nonzero()[0])
            raise AssertionError(
                f"{what}[{i}]: {int(diff.sum())} of {diff.numel()} elements differ; first at {first}: "
                f"{a.contiguous().reshape(diff.shape)[first]} instead of {e.contiguous().reshape(diff.shape)[first]}"
            )


def _mutated_indices(spec: OpSpec) -> list[int]:
    return [i for i, a in enumerate(spec.overload._schema.arguments) if a.name in spec.mutates_args]


def check_unread_inputs_never_matter(spec: OpSpec, case: OpCase, backend: str, params: Params, args: tuple) -> int:
    """Poison every element the case marks unread: outputs stay bit-equal to the clean
    call's, and a mutated argument holds, element by element, what the clean call left
    there or (where the op wrote nothing) the poison. Returns the number of poisoned elements."""
    assert case.unread is not None, f"{spec.name}: its test case does not declare `unread`"
    marks = list(case.unread(params, args))
    if not marks:
        return 0
    clean, dirty = clone_args(args), poisoned(args, marks)
    dirty_before = clone_args(dirty)
    with nonfinite_expected():
        expected = run_backend(spec, backend, clean)
        actual = run_backend(spec, backend, dirty)
    assert_bits_equal(expected, actual, f"{spec.name}[{backend}] output with unread elements poisoned")
    for i in _mutated_indices(spec):
        if i >= len(args) or not isinstance(args[i], torch.Tensor):
            continue
        got, want, untouched = _as_bits(dirty[i]), _as_bits(clean[i]), _as_bits(dirty_before[i])
        bad = ((got != want) & (got != untouched)).cpu()
        assert not bad.any(), (
            f"{spec.name}[{backend}]: argument {i} differs from the clean call at {int(bad.sum())} elements "
            f"with unread elements poisoned (first at {tuple(int(x) for x in bad.nonzero()[0])})"
        )
    return sum(int(m.sum()) for _, m in marks)


def check_out_of_range_ids_are_padding(spec: OpSpec, case: OpCase, backend: str, params: Params, args: tuple,
                                       seed: int = 0) -> bool:
    """Ids outside their range act as the documented padding value, bit for bit, and the
    backend agrees with the reference on them. Returns False when the op takes no ids."""
    assert case.out_of_range is not None, f"{spec.name}: its test case does not declare `out_of_range`"
    pair = case.out_of_range(params, args, torch.Generator().manual_seed(seed))
    if pair is None:
        return False
    bad, padded = pair
    bad_args, padded_args = clone_args(bad), clone_args(padded)
    with nonfinite_expected():  # random cache bytes hold NaN and huge fp8 scales
        out_bad = run_backend(spec, backend, bad_args)
        out_padded = run_backend(spec, backend, padded_args)
    assert_bits_equal(out_padded, out_bad, f"{spec.name}[{backend}] output with out-of-range ids vs padding")
    for i in _mutated_indices(spec):
        if i < len(args) and isinstance(args[i], torch.Tensor):
            assert_bits_equal(padded_args[i], bad_args[i], f"{spec.name}[{backend}] argument {i} with out-of-range ids")
    if backend != "reference":
        ref_args = clone_args(bad)
        expected = run_backend(spec, "reference", ref_args)
        _compare_case(spec, expected, out_bad, ref_args, bad_args, params)
    return True


def _nonfinite_masks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = x.float() if x.dtype.is_floating_point else x
    if not f.dtype.is_floating_point:
        zero = torch.zeros(x.shape, dtype=torch.bool)
        return zero, zero, zero
    f = f.cpu()
    return torch.isnan(f), torch.isposinf(f), torch.isneginf(f)


def _finite(x: Any) -> Any:
    """Tensors with NaN and +-inf replaced by 0 (same dtype), recursively."""
    if isinstance(x, (tuple, list)):
        return type(x)(_finite(i) for i in x)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        return x
    if x.dtype in _FP8:
        bad = ~torch.isfinite(x.float())
        y = clone_tensor(x)
        y.view(torch.uint8).masked_fill_(bad, 0)
        return y
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def check_nonfinite_inputs_agree(spec: OpSpec, case: OpCase, backend: str, params: Params, args: tuple,
                                 seed: int = 0) -> bool:
    """NaN and +-inf in elements the op reads: the backend puts NaN, +inf and -inf at the
    same output places as the reference and agrees with it elsewhere. Returns False when
    the op reads no floating-point input."""
    assert case.nonfinite is not None, f"{spec.name}: its test case does not declare `nonfinite`"
    bad = case.nonfinite(params, args, torch.Generator().manual_seed(seed))
    if bad is None:
        return False
    ref_args, test_args = clone_args(bad), clone_args(bad)
    with nonfinite_expected():
        expected = run_backend(spec, "reference", ref_args)
        actual = run_backend(spec, backend, test_args)
    if case.compare_nonfinite is not None:
        case.compare_nonfinite(expected, actual, ref_args, test_args, params)
        return True
    pairs = list(zip(_tensors(expected), _tensors(actual)))
    pairs += [(ref_args[i], test_args[i]) for i in _mutated_indices(spec) if i < len(bad)
              and isinstance(bad[i], torch.Tensor)]
    for k, (e, a) in enumerate(pairs):
        for kind, em, am in zip(("NaN", "+inf", "-inf"), _nonfinite_masks(e), _nonfinite_masks(a)):
            if not torch.equal(em, am):
                where = tuple(int(x) for x in (em != am).nonzero()[0])
                raise AssertionError(f"{spec.name}[{backend}] result {k}: {kind} places differ from the reference "
                                     f"(first at {where}: reference {em[where]}, {backend} {am[where]})")
    _compare_case(spec, _finite(expected), _finite(actual), _finite(ref_args), _finite(test_args), params)
    return True


def check_debug_switch_refuses_out_of_range_ids(spec: OpSpec, case: OpCase, params: Params, args: tuple,
                                                seed: int = 0) -> bool:
    """With `graphsafe.debug_checks` on, the call with the documented padding passes and
    the call with ids out of range raises an InputError naming the op (eager, through the
    dispatcher). Returns False when the op takes no ids."""
    from graphsafe.debug import debug_checks

    assert spec.debug_check is not None, f"{spec.name}: registered without a debug_check"
    pair = case.out_of_range(params, args, torch.Generator().manual_seed(seed))
    if pair is None:
        return False
    bad, padded = pair
    with debug_checks(True):
        spec.overload(*clone_args(padded))
        try:
            spec.overload(*clone_args(bad))
        except InputError as err:
            assert f"graphsafe.{spec.name}" in str(err).splitlines()[0], f"{spec.name}: debug error names the op: {err}"
        else:
            raise AssertionError(f"{spec.name}: the debug switch accepted ids out of range")
    return True


def check_mutation_and_aliasing(spec: OpSpec, args: tuple) -> None:
    """Only the declared args change; outputs never alias an input."""
    call_args = clone_args(args)
    before = clone_args(call_args)
    out = spec.overload(*call_args)
    mutated = mutated_args(spec, call_args)
    names = [a.name for a in spec.overload._schema.arguments]
    for name, a, b in zip(names, call_args, before):
        if isinstance(a, torch.Tensor) and name not in mutated:
            assert _bits_equal(a, b), f"{spec.name}: argument '{name}' changed but is not in mutates_args"
    inputs = {t.untyped_storage().data_ptr() for t in _tensors(call_args) if t.numel() > 0}
    for i, t in enumerate(_tensors(out)):
        if t.numel() > 0:
            assert t.untyped_storage().data_ptr() not in inputs, f"{spec.name}: output {i} aliases an input"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check_bad_inputs(spec: OpSpec, case: OpCase, device: torch.device, seed: int = 0) -> int:
    """Every bad input is refused by the real impl and the fake with the same message."""
    gen = torch.Generator().manual_seed(seed)
    bad_cases = case.bad_inputs(device, gen)
    for bad in bad_cases:
        messages = []
        for mode in ("real", "fake"):
            try:
                if mode == "real":
                    spec.overload(*clone_args(bad.args))
                else:
                    fake_outputs(spec, bad.args)
            except InputError as err:
                messages.append(str(err))
            else:
                raise AssertionError(f"{spec.name}: {mode} impl accepted bad input: {bad.what}")
        for msg in messages:
            assert f"graphsafe.{spec.name}" in msg and f"'{bad.arg}'" in msg, (
                f"{spec.name}: error for {bad.what} must name the op and '{bad.arg}': {msg}"
            )
            assert re.search(bad.match, msg), f"{spec.name}: error for {bad.what} lacks /{bad.match}/: {msg}"
        assert messages[0] == messages[1], f"{spec.name}: real and fake disagree on {bad.what}: {messages}"
    return len(bad_cases)


@contextmanager
def workspace_spy() -> Iterator[list[str]]:
    """Record every call into the workspace manager inside the block."""
    from graphsafe.workspace import manager as wm

    calls: list[str] = []
    originals = {
        "get_simultaneous": wm.WorkspaceManager.get_simultaneous,
        "reserve": wm.WorkspaceManager.reserve,
    }
    original_current = wm.current_workspace_manager

    def spy(name, fn):
        def wrapper(*a, **k):
            calls.append(name)
            return fn(*a, **k)

        return wrapper

    for name, fn in originals.items():
        setattr(wm.WorkspaceManager, name, spy(name, fn))
    wm.current_workspace_manager = spy("current_workspace_manager", original_current)
    import graphsafe.workspace as pkg

    pkg_original = pkg.current_workspace_manager
    pkg.current_workspace_manager = wm.current_workspace_manager
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(wm.WorkspaceManager, name, fn)
        wm.current_workspace_manager = original_current
        pkg.current_workspace_manager = pkg_original


def check_fake_never_touches_workspace(spec: OpSpec, args: tuple) -> None:
    with workspace_spy() as calls:
        fake_outputs(spec, args)
    assert not calls, f"{spec.name}: the fake impl called the workspace manager: {calls}"


def check_reference_has_no_data_dependent_shape(spec: OpSpec, args: tuple) -> None:
    """The reference impl runs on FakeTensors: nothing in it needs a tensor's values on the
    host (`.item()`, `int(t)`, boolean-mask indexing and `nonzero`, `unique`, ...). Each of
    those syncs on a GPU and cannot be captured into a CUDA graph, which the reference
    backend must be (tests/test_contract_gpu.py::test_reference_backend_also_captures); the
    CPU catches them here, where the GPU run could only."""
    impl = spec.backend_impl("reference")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        try:
            impl(*fake_args)
        except Exception as err:  # noqa: BLE001 - FakeTensor's data-dependent errors, reported with the op
            raise AssertionError(f"{spec.name}: the reference needs tensor values on the host "
                                 f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err


def takes_scratch(spec: OpSpec) -> bool:
    """Whether any backend of the op sizes a workspace (its record names `workspace`)."""
    return any(record.workspace is not None for record in spec.backends.values())


def check_launch_fits_the_reservation(spec: OpSpec, case: OpCase, backend: str, params: Params, args: tuple) -> str:
    """Sizing and launch agree: a fresh workspace lane reserved from shapes alone
    (`spec.workspace_specs` for `backend`, the case's `workspace_args`) and then locked
    serves the call; a launch that asks for more than the reservation is refused by the
    locked manager (`WorkspaceError`). The call runs with the debug switch's workspace
    guards (`graphsafe.workspace.manager.guarded`): a kernel that writes past a view it
    is handed, or a view reserved smaller than what is written into it, raises a
    WorkspaceError naming the op and the view, on the CPU and on a GPU alike. (The guarded
    layout leaves GUARD_BYTES after each view where the locked arena has room, as the
    growth granularity nearly always leaves; else the views' alignment padding is the guard.)"""
    from graphsafe.workspace import current_workspace_manager, workspace_lane
    from graphsafe.workspace.manager import drop_workspace_manager, guarded

    if not takes_scratch(spec):
        return "no scratch"
    assert case.workspace_args is not None, f"{spec.name}: a backend takes scratch but OpCase.workspace_args is None"
    ws_args, ws_kwargs = case.workspace_args(params, args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with workspace_lane(RESERVATION_LANE):
        manager = current_workspace_manager(device)
        assert manager.size_bytes == 0, "the reservation lane must start empty"
        try:
            specs = spec.workspace_specs(*ws_args, **ws_kwargs, device=device, backend=backend)
            manager.reserve(*specs, owner=f"{spec.name} reservation")
            with manager.locked(), guarded(spec.name):
                spec.runner(backend)(*clone_args(args))
        finally:
            drop_workspace_manager(device)
    return "fits"


# A workspace lane no op or test uses otherwise: `check_launch_fits_the_reservation` starts
# it empty and releases it after.
RESERVATION_LANE = 97


# -- supports predicates with each option -----------------------------------------------
def optional_arguments(spec: OpSpec) -> list[str]:
    """The op's optional arguments: the stub's parameters with a default, in order."""
    return [name for name in spec.call_type._fields if name in spec.call_type._field_defaults]


def predicate_backends(spec: OpSpec) -> list[str]:
    """The op's backends whose record has a `supports` predicate."""
    return [name for name, record in spec.backends.items() if record.supports is not None]


def option_present(spec: OpSpec, call: tuple, name: str) -> bool:
    """Whether optional argument `name` of the bound `call` is other than its default."""
    default, actual = spec.call_type._field_defaults[name], getattr(call, name)
    return actual is not None if default is None else actual != default


def option_variants(spec: OpSpec, case: OpCase, params: Params) -> list[tuple[str, dict[str, bool], Params]]:
    """The parameter sets the predicate contract runs for `params`, each with the options
    it must have present (True) or absent (False): `params` as drawn; every optional
    argument absent; each one alone present (the others absent, but for what it needs);
    and each one switched
    on and off in `params` as drawn (`OpCase.options`). Duplicates and the sets a switch
    cannot make (None) are left out. Returns [(what, {option: present}, params)]."""
    names = optional_arguments(spec)
    bare: Params | None = params
    for name in names:
        bare = None if bare is None else case.options[name](bare, False)
    candidates: list[tuple[str, dict[str, bool], Params | None]] = [("as drawn", {}, params)]
    if bare is not None:
        candidates.append(("every option absent", dict.fromkeys(names, False), bare))
        for name in names:  # (a switch may bring what the option needs: descales need fp8 inputs)
            candidates.append((f"{name} alone present", {name: True}, case.options[name](bare, True)))
    for name in names:
        for present in (True, False):
            what = f"{name} {'present' if present else 'absent'}"
            candidates.append((what, {name: present}, case.options[name](params, present)))
    out, seen = [], []
    for what, checks, variant in candidates:
        if variant is not None and variant not in seen:
            seen.append(variant)
            out.append((what, checks, variant))
    return out


def check_supports_with_each_option(spec: OpSpec, case: OpCase, params: Params, device: torch.device, seed: int = 0,
                                    backends: list[str] | None = None) -> dict[str, int]:
    """Every `supports` predicate of the op (or of `backends`), over `params` with each
    optional argument switched on and off (`option_variants`): each answer is a `Support`
    with a reason where it declines, and every call a predicate accepts runs on that
    backend (its workspace views guarded, as with the debug switch) and matches the
    reference. So a predicate that accepts an option (or a shape) its adapter drops or
    mishandles fails here. The backends must be runnable on `device` (on the CPU: aiter
    through its stand-in, tests/aiter_standin). Returns {"accepted": n, "declined": n}."""
    from graphsafe.registry import Support
    from graphsafe.workspace.manager import guarded

    backends = predicate_backends(spec) if backends is None else backends
    counts = {"accepted": 0, "declined": 0}
    for what, checks, variant in option_variants(spec, case, params):
        args = case.inputs(variant, device, seed)
        call = spec.call(*args)
        for name, present in checks.items():
            assert option_present(spec, call, name) == present, (
                f"{spec.name}: OpCase.options[{name!r}] ({what}) gives {name}={getattr(call, name)!r}")
        for backend in backends:
            answer = spec.support(backend, call)
            assert isinstance(answer, Support), f"{spec.name}[{backend}]: supports answered {answer!r}"
            if not answer:
                assert answer.reason, f"{spec.name}[{backend}]: declined without a reason"
                counts["declined"] += 1
                continue
            counts["accepted"] += 1
            try:
                with guarded(spec.name):
                    check_backend_matches_reference(spec, case, backend, args, params=variant)
            except AssertionError as err:
                raise AssertionError(f"{spec.name}[{backend}] accepted a call ({what}: {variant}) and differs "
                                     f"from the reference: {err}") from err
    return counts


def example_inputs(case: OpCase, device: torch.device, seed: int = 0) -> list[tuple[Params, tuple]]:
    params = [case.example, *case.edge_cases]
    return [(p, case.inputs(p, device, seed + i)) for i, p in enumerate(params)]


def opcheck_all(device: torch.device | str = "cpu", seed: int = 0) -> dict[str, int]:
    """`torch.library.opcheck` of every registered op on its example and edge-case inputs.

    Returns {op: number of input sets checked}; raises on the first failure.
    """
    device = torch.device(device)
    done = {}
    for name, spec in sorted(ops().items()):
        sets = example_inputs(case_for(spec.name), device, seed)
        for _, args in sets:
            opcheck_op(spec, args)
        done[name] = len(sets)
    return done


# -- GPU checks ---------------------------------------------------------------------------
def _compare_case(spec: OpSpec, expected, actual, exp_args, act_args, params) -> None:
    if case_for(spec.name).compare is not None:
        case_for(spec.name).compare(expected, actual, exp_args, act_args, params)
    else:
        default_compare(spec, expected, actual, exp_args, act_args)


def check_cuda_graph_replay(spec: OpSpec, params: Params, device: torch.device, seeds: tuple[int, int] = (1, 2)) -> None:
    """Capture the op on one input set, copy a second set into the static inputs, replay,
    and compare with eager on the second set (outputs and mutated args)."""
    static = clone_args(case_for(spec.name).inputs(params, device, seeds[0]))
    fresh = case_for(spec.name).inputs(params, device, seeds[1])
    for s, f in zip(static, fresh):
        if not isinstance(s, torch.Tensor):
            assert s == f, f"{spec.name}: host ints must come from params only ({s!r} != {f!r})"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (Triton compiles, the workspace grows) off the capture
        for _ in range(2):
            spec.public(*clone_args(static))
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        # An op with nothing to do (T=0 edge cases) captures an empty graph, on purpose.
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(graph):
            static_out = spec.public(*static)
    for s, f in zip(static, fresh):
        if isinstance(s, torch.Tensor):
            s.copy_(f)
    graph.replay()
    eager_args = clone_args(fresh)
    expected = spec.public(*eager_args)
    torch.cuda.synchronize(device)
    _compare_case(spec, expected, static_out, eager_args, static, params)
    # The graph is gone after this check: let later (larger) cases grow the workspace.
    del graph, static_out
    torch.cuda.synchronize(device)
    from graphsafe.workspace import current_workspace_manager

    current_workspace_manager(device).forget_captures()


def check_no_host_sync(spec: OpSpec, params: Params, device: torch.device, seed: int = 3) -> None:
    from graphsafe.testing.sync import no_sync

    args = case_for(spec.name).inputs(params, device, seed)
    spec.public(*clone_args(args))  # warm-up: compilation and workspace growth may sync
    torch.cuda.synchronize(device)
    with no_sync():
        spec.public(*args)
    torch.cuda.synchronize(device)


def _count_tensors(out: Any) -> int:
    return len(_tensors(out))


def check_allocates_only_outputs(spec: OpSpec, params: Params, device: torch.device, seed: int = 4) -> None:
    """Scratch comes from the workspace: the caching allocator sees the outputs only."""
    args = case_for(spec.name).inputs(params, device, seed)
    spec.public(*clone_args(args))  # warm-up sizes the workspace
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_stats(device)["allocation.all.allocated"]
    out = spec.public(*args)
    after = torch.cuda.memory_stats(device)["allocation.all.allocated"]
    assert after - before <= _count_tensors(out), (
        f"{spec.name}: {after - before} caching-allocator allocations for {_count_tensors(out)} outputs"
    )
