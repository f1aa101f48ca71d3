"""Op registration, the op table, and backend selection.

`register_op` is the one way an op enters graphsafe. It takes a typed signature stub
(its docstring is the op's documentation), infers the schema from the type hints, and
registers through `torch.library.Library(namespace, "FRAGMENT")`:

* `define` with the inferred schema (mutated tensors marked `(a!)`),
* `impl` on the `CPU` and `CUDA` dispatch keys (`CUDA` also serves HIP builds),
* the fake impl (required: registering without one raises `RegistrationError`).

We use `Library.define/impl` rather than `@torch.library.custom_op`: the latter adds
several microseconds per call (pytorch/pytorch#139500, #177109).

Each backend of an op is one `Backend` record, exported by the backend's module
(`graphsafe/ops/<family>/{reference,triton,aiter}.py`) and named once by the family's
`register_op`: its impl, optionally a `prepare` that binds the impl to one call signature,
a `supports` predicate (per-shape fallback to the next backend, with the reason it gives)
and its worst-case workspace. Selection, sizing and launch all read these records.

A call's arguments are bound once, into the op's `Call` (a named tuple generated from the
stub: `spec.call(*args)`), and that one object goes to `check`, the fake, `supports`,
`prepare` and the debug check: a function whose first parameter is named `call` (any
other a keyword-only option) receives it; any other is called with the op's arguments
spread (`fn(*call)`), as registries of other namespaces written that way expect. The runner `prepare` returns, the hot path,
takes the op's arguments as the dispatcher passes them.

The kernel registered on each dispatch key keeps a table from the call's *signature*
(every tensor's shape, strides, dtype and device, and every other argument's value) to a
runner. The first call of a signature validates the inputs (`check`), picks the backend
(the forced one or aiter > triton > reference, the first whose `supports` accepts the
call) and asks it to `prepare` a runner: plans, launch grids and compiled kernel handles
are computed there once (see `graphsafe.launch`). Later calls of the same signature cost
the signature and one dict lookup before the runner. `use_backend` clears the tables.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import os
import threading
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from graphsafe.backends import AUTO_ORDER, BACKENDS, backend_available, unavailable_reason
from graphsafe.debug import STATE as debug_state
from graphsafe.errors import InputError, RegistrationError, as_traced_error

Impl = Callable[..., Any]
# An impl, prepare, supports or workspace function is either a function or a lazy
# "package.module:function" reference, so that importing graphsafe never imports triton
# or aiter.
BackendRef = Impl | str
WorkspaceSpecs = Sequence[tuple[Sequence[int], torch.dtype]]

DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
# Distinct call signatures kept per op and device type; past this the table is cleared
# (prefill with ever new token counts must not grow it without bound).
MAX_SIGNATURES = 1024

_lock = threading.Lock()
_forced_global: str | None = None
_forced_env_read = False
_forced_per_op: dict[str, str] = {}


def _forced_backend(qualname: str) -> str | None:
    """The backend forced for this op, if any. Reads GRAPHSAFE_BACKEND once per process."""
    global _forced_env_read, _forced_global
    if not _forced_env_read:
        env = os.environ.get("GRAPHSAFE_BACKEND") or None
        if env is not None and env not in BACKENDS:
            raise RegistrationError(
                f"GRAPHSAFE_BACKEND={env!r} is not a backend; expected one of {BACKENDS}"
            )
        _forced_global = env
        _forced_env_read = True
    return _forced_per_op.get(qualname, _forced_global)


def _resolve(ref: BackendRef | None) -> Impl | None:
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


@dataclass(frozen=True)
class Support:
    """A backend's answer to one call signature: `ok`, and where it declines, why (what
    `python -m graphsafe list --why` prints). Truthy when the backend serves the call."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


def declined(reason: str) -> Support:
    """`supports`' answer for a call the backend does not serve, and why."""
    return Support(False, reason)


def as_support(answer: Any) -> Support:
    """A `supports` function's answer as a `Support` (a plain bool is accepted)."""
    if isinstance(answer, Support):
        return answer
    return SUPPORTED if answer else Support(False, "its supports predicate declined")


def takes_call(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes the bound call: its first parameter is named `call` and any other
    is a keyword-only option with a default (tests' and tuning's overrides)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "call" and all(
        p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty for p in params[1:])


def _call_adapter(fn: Impl | None) -> Impl | None:
    """`fn` as a function of the bound call: itself where it takes the call, else one that
    spreads the call's fields as positional arguments."""
    if fn is None or takes_call(fn):
        return fn

    def spread(call: tuple) -> Any:
        return fn(*call)

    spread.__name__ = getattr(fn, "__name__", "spread")
    spread.__wrapped__ = fn  # type: ignore[attr-defined]
    return spread


@dataclass(frozen=True)
class Backend:
    """One backend of an op: what selection, workspace sizing and launch all read.

    Every field is a function (or, for registries that must not import a module early,
    a lazy "package.module:function" reference). graphsafe's own backend modules export
    their records (`graphsafe.ops.mla.triton.MLA_DECODE`, ...), named by `name`.

    * `impl(*args)`: runs the op (inputs already validated).
    * `prepare(call) -> runner`: binds the op to the signature of these args (shapes,
      strides, dtypes, devices, scalars) and returns `runner(*args)` for every later call
      with that signature: plans, grids and compiled kernel handles are computed once,
      here. Optional; without it the impl runs as is. With it, `impl` may be omitted
      (it is then `prepare(*args)(*args)`).
    * `supports(call) -> Support`: whether this backend runs this signature (`SUPPORTED`,
      or `declined("why")`; a bool is accepted); a decline hands the call to the next
      backend in the order (decided once per signature, never by catching errors per
      call). Optional: None means every valid input.
    * `workspace(**shape_params) -> [(shape, dtype), ...]`: the worst-case scratch of one
      call, from shapes; the op's `workspace_specs` takes the largest over the backends
      that may serve a device.
    """

    impl: BackendRef | None = None
    prepare: BackendRef | None = None
    supports: BackendRef | None = None
    workspace: BackendRef | None = None
    name: str = ""  # "aiter", "triton" or "reference"; a key of register_op's dict names it too
    # explain(call) -> str: what the backend runs for this call (kernel, tiles, plan), for
    # `python -m graphsafe list --why`. Optional.
    explain: Impl | None = None

    def __post_init__(self) -> None:
        if self.impl is None and self.prepare is None:
            raise RegistrationError("a Backend needs an impl or a prepare function")


@dataclass(eq=False)
class OpSpec:
    """Everything graphsafe knows about one registered op (one row of the op table)."""

    name: str
    namespace: str
    schema: str
    mutates_args: tuple[str, ...]
    check: Impl
    fake: Impl
    backends: dict[str, Backend]
    family: str
    doc: str
    overload: Any = None  # torch._ops.OpOverload, set after `define`
    public: Any = None  # the Python function users call (docstring of the stub)
    signature_key: Impl | None = field(default=None, repr=False)  # args -> hashable signature
    # The op's bound arguments: a named tuple class generated from the stub (`call`).
    call_type: Any = field(default=None, repr=False)
    # Value checks of the debug switch (graphsafe.debug): index ranges, host-int preconditions.
    debug_check: BackendRef | None = field(default=None, repr=False)
    _tables: dict[str, dict[Any, Impl]] = field(default_factory=dict, repr=False)
    _resolved: dict[tuple[str, str], Impl | None] = field(default_factory=dict, repr=False)

    @property
    def qualname(self) -> str:
        return f"{self.namespace}::{self.name}"

    def call(self, *args: Any, **kwargs: Any) -> tuple:
        """The op's arguments bound once (defaults filled in): what check, fake, supports,
        prepare and the debug check receive. A call passed in is returned as it is."""
        if len(args) == 1 and not kwargs and isinstance(args[0], self.call_type):
            return args[0]
        return self.call_type(*args, **kwargs)

    def _check_call(self, call: tuple) -> None:
        fn = self._resolved.get(("", "check"))
        if fn is None:
            fn = self._resolved[("", "check")] = _call_adapter(self.check)
        fn(call)

    # -- backends -------------------------------------------------------------------
    def _part(self, backend: str, part: str) -> Impl | None:
        """A resolved field of a backend record (lazy references imported on first use);
        `supports` and `prepare` as functions of the bound call."""
        key = (backend, part)
        try:
            return self._resolved[key]
        except KeyError:
            pass
        if backend not in self.backends:
            raise KeyError(f"{self.qualname} has no {backend!r} backend; it has {list(self.backends)}")
        fn = _resolve(getattr(self.backends[backend], part))
        if part in ("supports", "prepare"):
            fn = _call_adapter(fn)
        if part == "impl" and fn is None:
            prepare = self._part(backend, "prepare")
            call_type = self.call_type

            def fn(*args: Any, **kwargs: Any) -> Any:
                return prepare(call_type(*args, **kwargs))(*args, **kwargs)

            fn.__name__ = f"{self.name}_{backend}"
        self._resolved[key] = fn
        return fn

    def run_debug_check(self, *args: Any, **kwargs: Any) -> None:
        """The op's value checks (`graphsafe.debug_checks`): they read tensor values, so they
        sync; skipped while a CUDA graph is being captured."""
        fn = self._resolved.get(("", "debug_check"))
        if fn is None:
            fn = self._resolved[("", "debug_check")] = _call_adapter(_resolve(self.debug_check))
        from graphsafe.debug import checks_can_run

        if fn is not None and checks_can_run(*args):
            fn(self.call(*args, **kwargs))

    def run_guarded(self, run: Impl, *args: Any, **kwargs: Any) -> Any:
        """`run(*args, **kwargs)` with the workspace views it is handed guarded
        (`graphsafe.workspace.manager.guarded`: the bytes after each view filled with a
        pattern and checked after the call; the debug switch runs every op call so). The
        check reads the arena, so it syncs: skipped while a CUDA graph is being captured."""
        from graphsafe.debug import checks_can_run
        from graphsafe.workspace.manager import guarded

        if not checks_can_run(*args):
            return run(*args, **kwargs)
        with guarded(self.name):
            return run(*args, **kwargs)

    def backend_impl(self, backend: str) -> Impl:
        """The impl of `backend` (inputs unchecked; prepared afresh on every call)."""
        return self._part(backend, "impl")

    def available_backends(self, device_type: str) -> list[str]:
        """Backends of this op that can run on `device_type` here, best first."""
        return [b for b in BACKENDS if b in self.backends and backend_available(b, device_type)]

    def selection_order(self, device_type: str) -> list[str]:
        """The backends a call on `device_type` may use, in the order they are tried: the
        forced one (if it can run here), then the automatic order, up to the first one
        without a `supports` predicate (it takes every valid input; the reference, always
        last, is one)."""
        forced = _forced_backend(self.qualname)
        auto = AUTO_ORDER.get(device_type, ("reference",))
        order = [b for b in ((forced,) if forced else ()) + tuple(auto) + ("reference",)
                 if b in self.backends and backend_available(b, device_type)]
        if forced is not None and forced in self.backends and forced not in order:
            warnings.warn(
                f"graphsafe: backend {forced!r} is forced but unavailable for {self.qualname} "
                f"on {device_type}; falling back to the automatic order {auto}",
                stacklevel=3,
            )
        order = list(dict.fromkeys(order))
        for i, backend in enumerate(order):
            if self.backends[backend].supports is None:
                return order[: i + 1]
        return order

    def support(self, backend: str, *args: Any, **kwargs: Any) -> Support:
        """`backend`'s answer to a (valid) call: `SUPPORTED` where its record has no
        `supports` predicate."""
        supports = self._part(backend, "supports")
        return SUPPORTED if supports is None else as_support(supports(self.call(*args, **kwargs)))

    def explain(self, device_type: str, *args: Any, **kwargs: Any) -> list[tuple[str, Support]]:
        """Every backend of the op on `device_type`, best first, with why it does or does
        not serve this (valid) call, or, without args, whether it can run there at all:
        what `python -m graphsafe list --why` prints."""
        call = self.call(*args, **kwargs) if args or kwargs else None
        order = self.selection_order(device_type)
        answers = []
        for backend in [b for b in BACKENDS if b in self.backends]:
            if not backend_available(backend, device_type):
                answers.append((backend, declined(unavailable_reason(backend, device_type))))
            elif backend not in order:
                automatic = AUTO_ORDER.get(device_type, ("reference",))
                answers.append((backend, declined(
                    f"not chosen automatically on {device_type} (graphsafe.use_backend({backend!r}) forces it)"
                    if backend not in automatic else "not reached: an earlier backend takes every call")))
            elif call is None:
                answers.append((backend, SUPPORTED))
            else:
                answers.append((backend, self.support(backend, call)))
        return answers

    def serving_backend(self, device_type: str, *args: Any, **kwargs: Any) -> str:
        """The backend a call on `device_type` uses: with call args, the first in
        `selection_order` whose `supports` accepts them; without, the first in the order."""
        order = self.selection_order(device_type)
        if not order:
            raise RegistrationError(f"{self.qualname}: no backend can run on {device_type}")
        if not args and not kwargs:
            return order[0]
        call = self.call(*args, **kwargs)
        for backend in order:
            if self.support(backend, call):
                return backend
        return "reference"

    def prepare(self, backend: str, *args: Any, **kwargs: Any) -> Impl:
        """`backend`'s runner bound to the signature of these (valid) args."""
        prepare = self._part(backend, "prepare")
        return prepare(self.call(*args, **kwargs)) if prepare is not None else self._part(backend, "impl")

    def runner(self, backend: str) -> Impl:
        """A function that validates its inputs and runs `backend` through its `prepare`,
        as the dispatcher does, without the signature table (for tests and tools)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            call = self.call(*args, **kwargs)
            self._check_call(call)
            runner = self.prepare(backend, call)
            if debug_state[0]:  # the workspace guards of the debug switch, as the dispatcher
                return self.run_guarded(runner, *args, **kwargs)
            return runner(*args, **kwargs)

        run.__name__ = f"{self.name}[{backend}]"
        return run

    def bound(self, device_type: str, *args: Any, **kwargs: Any) -> Impl:
        """The runner the dispatcher would use for these args (validated, selected and
        prepared on the first call of their signature). Composite ops prepare their inner
        ops through this: a call then skips the dispatcher and the signature lookup."""
        table = self._tables.get(device_type)
        if table is None:
            raise KeyError(f"{self.qualname}: no kernel for device type {device_type!r}")
        try:
            return table[self.signature_key(*args, **kwargs)]
        except Exception:  # noqa: BLE001 - a new (or unhashable) signature
            return self._bind(device_type, table, args, kwargs)

    def _bind(self, device_type: str, table: dict[Any, Impl], args: tuple, kwargs: dict) -> Impl:
        """First call of a signature: bind the call, validate, select, prepare, remember."""
        call = self.call(*args, **kwargs)
        self._check_call(call)
        run = self.prepare(self.serving_backend(device_type, call), call)
        try:
            key = self.signature_key(*args, **kwargs)
            hash(key)
        except Exception:  # noqa: BLE001 - an unhashable argument: validated every call
            return run
        with _lock:
            if len(table) >= MAX_SIGNATURES:
                table.clear()
            table[key] = run
        return run

    def _reset(self) -> None:
        for table in self._tables.values():
            table.clear()

    # -- workspace ------------------------------------------------------------------
    def workspace_specs(self, *args: Any, device: torch.device | str | None = None, backend: str | None = None,
                        **kwargs: Any) -> list:
        """Worst-case workspace `[(shape, dtype), ...]` of one call on `device` (default: the
        current CUDA device, else the CPU), from shapes: the largest among the backends
        that may serve it (`selection_order`), or `backend`'s own. `device` is passed on
        to backends whose workspace function takes it."""
        from graphsafe.workspace import workspace_bytes

        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        best: list = []
        for backend in [backend] if backend is not None else self.selection_order(dev.type):
            fn = self._part(backend, "workspace")
            if fn is None:
                continue
            extra = {"device": dev} if "device" in inspect.signature(fn).parameters else {}
            specs = [(tuple(int(s) for s in shape), dtype) for shape, dtype in fn(*args, **kwargs, **extra)]
            if workspace_bytes(*specs) > workspace_bytes(*best):
                best = specs
        return best

    def workspace_bytes(self, *args: Any, **kwargs: Any) -> int:
        """Worst-case workspace bytes of one call, from shapes (no dry run)."""
        from graphsafe.workspace import workspace_bytes

        return workspace_bytes(*self.workspace_specs(*args, **kwargs))


def _call_type(stub: Impl) -> type:
    """The named tuple of the op's arguments, generated from the stub: its fields are the
    stub's parameters in order, with the stub's defaults."""
    sig = inspect.signature(stub)
    names = list(sig.parameters)
    defaults = [p.default for p in sig.parameters.values() if p.default is not inspect.Parameter.empty]
    cls = collections.namedtuple(f"{stub.__name__}_call", names, defaults=defaults or None)
    cls.__doc__ = f"The bound arguments of one `{stub.__name__}` call (graphsafe.registry.OpSpec.call)."
    return cls


def _signature_key(stub: Impl) -> Impl:
    """A function of the op's args (as the dispatcher passes them: trailing defaults may be
    missing) returning their signature: shape, strides, dtype and device index of each
    tensor, the value of every other argument. Generated per op (no loop, no isinstance)."""
    sig = inspect.signature(stub)
    hints = typing.get_type_hints(stub)
    params, parts, defaults = [], [], {}
    for name, param in sig.parameters.items():
        hint = hints.get(name)
        if param.default is inspect.Parameter.empty:
            params.append(name)
        else:
            defaults[f"_d_{name}"] = param.default
            params.append(f"{name}=_d_{name}")
        tensor = f"{name}.shape, {name}.stride(), {name}.dtype, {name}.get_device()"
        if hint is torch.Tensor:
            parts.append(tensor)
        elif hint == typing.Optional[torch.Tensor]:
            parts.append(f"None if {name} is None else ({tensor})")
        else:
            parts.append(name)
    source = f"def signature_key({', '.join(params)}):\n    return ({', '.join(parts)},)\n"
    namespace: dict[str, Any] = dict(defaults)
    exec(compile(source, f"<graphsafe signature of {stub.__name__}>", "exec"), namespace)
    return namespace["signature_key"]


_PREPARED: dict[Any, Impl] = {}


def _signature_part(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.device
    if isinstance(x, tuple):  # a bound call (a named tuple) among them
        return type(x), tuple(map(_signature_part, x))
    if isinstance(x, dict):
        return tuple(sorted((k, _signature_part(v)) for k, v in x.items()))
    return x


def prepared(prepare: Impl, *args: Any, **options: Any) -> Impl:
    """`prepare(*args, **options)`'s runner, kept per signature of `args` (tensor metadata,
    other values; a bound call counts by its fields) and options, as the dispatcher keeps
    the ops' runners. For backend entry
    points that take options beside the op's arguments (tuning configs, forced plans):
    tests and benchmarks call them in loops and must not pay a prepare per call. Inputs
    are not validated here."""
    key = (prepare, *map(_signature_part, args), *((k, _signature_part(v)) for k, v in sorted(options.items())))
    run = _PREPARED.get(key)
    if run is None:
        with _lock:
            if len(_PREPARED) >= MAX_SIGNATURES:
                _PREPARED.clear()
        run = _PREPARED[key] = prepare(*args, **options)
    return run


def _make_kernel(spec: OpSpec, device_type: str) -> Impl:
    # The hot path: the signature, one dict lookup, the runner. Any failure (a new
    # signature, an unhashable argument, an argument without tensor metadata) takes the
    # first-call path, which validates and raises a named InputError for bad inputs.
    table: dict[Any, Impl] = {}
    spec._tables[device_type] = table
    key_of = spec.signature_key

    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            run = table[key_of(*args, **kwargs)]
        except Exception:  # noqa: BLE001 - see above
            run = spec._bind(device_type, table, args, kwargs)
        if debug_state[0]:
            spec.run_debug_check(*args, **kwargs)
            return spec.run_guarded(run, *args, **kwargs)
        return run(*args, **kwargs)

    kernel.__name__ = f"graphsafe_{spec.name}_{device_type}"
    return kernel


def _fake_raising_traced_errors(fake: Impl, check: Impl, call_type: type) -> Impl:
    """The fake as registered: the call bound once and handed to the fake; an InputError
    leaves it as `as_traced_error(err)`, so that `except graphsafe.InputError` catches it
    under torch.compile too (see graphsafe.errors). Under dynamic shapes the message would
    show symbols (`got shape [s17]`): the check is then run again on fake tensors of the
    call's concrete sizes, so the message is the eager one."""
    fake_of_call, check_of_call = _call_adapter(fake), _call_adapter(check)

    @functools.wraps(fake)
    def traced_fake(*args: Any, **kwargs: Any) -> Any:
        try:
            return fake_of_call(call_type(*args, **kwargs))
        except InputError as err:
            raise as_traced_error(_concrete_error(err, check_of_call, call_type, args, kwargs)) from None

    return traced_fake


def _concrete(x: Any) -> Any:
    """A SymInt's value in this call (its hint), or `x` unchanged."""
    if isinstance(x, torch.SymInt):
        shape_env = x.node.shape_env
        # Newer torch deprecates size_hint (a FutureWarning) for guarding_hint_or_throw.
        hint = getattr(shape_env, "guarding_hint_or_throw", None) or shape_env.size_hint
        return int(hint(x.node.expr))
    return x


def _concrete_error(err: InputError, check: Impl, call_type: type, args: tuple, kwargs: dict) -> InputError:
    symbolic = [a for a in args if isinstance(a, torch.SymInt) or (
        isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*a.shape, *a.stride())))]
    if not symbolic:
        return err
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    try:
        with unset_fake_temporarily(), FakeTensorMode():
            concrete = tuple(
                torch.empty_strided([_concrete(s) for s in a.shape], [_concrete(s) for s in a.stride()],
                                    dtype=a.dtype, device=a.device)
                if isinstance(a, torch.Tensor) else _concrete(a)
                for a in args
            )
            check(call_type(*concrete, **kwargs))
    except InputError as concrete_err:
        return concrete_err
    except Exception:  # noqa: BLE001 - keep the symbolic message rather than lose the error
        return err
    return err


def _records(qualname: str, backends: dict[str, Backend | BackendRef] | Sequence[Backend]) -> dict[str, Backend]:
    """`register_op`'s backends as `{name: record}`, each record carrying its name."""
    if isinstance(backends, dict):
        named = {}
        for key, record in backends.items():
            record = record if isinstance(record, Backend) else Backend(impl=record)
            if record.name and record.name != key:
                raise RegistrationError(f"{qualname}: the record of backend {key!r} is named {record.name!r}")
            named[key] = replace(record, name=key)
        return named
    named = {}
    for record in backends:
        if not isinstance(record, Backend) or not record.name:
            raise RegistrationError(f"{qualname}: a backend given in a sequence must be a named Backend record, "
                                    f"got {record!r}")
        if record.name in named:
            raise RegistrationError(f"{qualname}: two records of backend {record.name!r}")
        named[record.name] = record
    return named


class Registry:
    """The op table of one `torch.library` namespace (`graphsafe` for the library's ops)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lib = torch.library.Library(namespace, "FRAGMENT")
        self.ops: dict[str, OpSpec] = {}

    def register_op(
        self,
        name: str,
        *,
        fake: Impl,
        check: Impl,
        backends: dict[str, Backend | BackendRef] | Sequence[Backend],
        mutates_args: Iterable[str] = (),
        family: str = "",
        debug_check: BackendRef | None = None,
    ) -> Callable[[Impl], Impl]:
        """Decorator over a typed signature stub; returns the public Python function.

        Args:
            name: op name inside the namespace (`torch.ops.<namespace>.<name>`).
            fake: the fake impl (graphsafe's: `graphsafe/ops/<family>/fake.py`): metadata only.
            check: input validation shared by the fake and the real impl.
            backends: the backends' records, each named (`Backend(..., name="triton")`, as
                the backend modules export them), or `{"reference": fn, "triton":
                Backend(...), ...}` with a record or just its impl (a function or
                "pkg.mod:fn") per name; reference required.
            mutates_args: exactly the tensor args the op writes; the op must return None.
            family: the op family folder (`cache`, `ragged`, ...).
            debug_check: value checks run on every call while `graphsafe.debug_checks` is on
                (index ranges, host-int preconditions; they may sync), a function or
                "pkg.mod:fn" (graphsafe's debug modules are named lazily: op code never
                imports them).
        """
        if isinstance(mutates_args, str):
            raise RegistrationError(
                f"{self.namespace}::{name}: mutates_args must list the mutated args exactly; "
                f"got the string {mutates_args!r} ('unknown' is never allowed)"
            )
        mutated = tuple(mutates_args)
        records = _records(f"{self.namespace}::{name}", backends)
        if fake is None or not callable(fake):
            raise RegistrationError(f"{self.namespace}::{name}: a fake impl is required")
        if check is None or not callable(check):
            raise RegistrationError(f"{self.namespace}::{name}: an input check is required")
        if "reference" not in records:
            raise RegistrationError(f"{self.namespace}::{name}: a reference backend is required")
        unknown = set(records) - set(BACKENDS)
        if unknown:
            raise RegistrationError(f"{self.namespace}::{name}: unknown backends {sorted(unknown)}")

        def decorate(stub: Impl) -> Impl:
            if name in self.ops:
                raise RegistrationError(f"{self.namespace}::{name} is registered twice")
            sig = inspect.signature(stub)
            for arg in mutated:
                if arg not in sig.parameters:
                    raise RegistrationError(f"{self.namespace}::{name}: mutates_args names {arg!r}, not a parameter")
            schema = torch.library.infer_schema(stub, mutates_args=mutated)
            returns_none = schema.endswith("-> ()")
            if mutated and not returns_none:
                raise RegistrationError(f"{self.namespace}::{name}: an op that mutates {mutated} must return None")
            if not mutated and returns_none:
                raise RegistrationError(f"{self.namespace}::{name}: an op that returns nothing must mutate something")

            spec = OpSpec(
                name=name,
                namespace=self.namespace,
                schema=schema,
                mutates_args=mutated,
                check=check,
                fake=fake,
                backends=records,
                family=family,
                doc=inspect.getdoc(stub) or "",
                signature_key=_signature_key(stub),
                call_type=_call_type(stub),
                debug_check=debug_check,
            )
            # pt2_compliant_tag: the op keeps torch.compile's custom-op rules (a schema that
            # says what it mutates, a fake, no aliasing); opcheck tests them on every op.
            self.lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
            for device_type, key in DISPATCH_KEYS.items():
                self.lib.impl(name, _make_kernel(spec, device_type), key)
            torch.library.register_fake(spec.qualname, _fake_raising_traced_errors(fake, check, spec.call_type),
                                        lib=self.lib)
            spec.overload = getattr(getattr(torch.ops, self.namespace), name).default
            self.ops[name] = spec

            overload = spec.overload

            @functools.wraps(stub)
            def public(*args: Any, **kwargs: Any) -> Any:
                return overload(*args, **kwargs)

            public.spec = spec  # type: ignore[attr-defined]
            spec.public = public
            return public

        return decorate

    def reset_backends(self) -> None:
        for spec in self.ops.values():
            spec._reset()


# The registry of the `graphsafe` namespace: every op of the library lives here.
REGISTRY = Registry("graphsafe")
register_op = REGISTRY.register_op


def ops() -> dict[str, OpSpec]:
    """The op table: name -> OpSpec, for every op registered in the `graphsafe` namespace
    (importing any part of graphsafe imports `graphsafe.ops`, which registers them)."""
    return dict(REGISTRY.ops)


def get_op(name: str) -> OpSpec:
    table = ops()
    if name not in table:
        raise KeyError(f"no graphsafe op named {name!r}; known: {sorted(table)}")
    return table[name]


class use_backend:
    """Force a backend for all ops, or for some, on every device type.

    Takes effect at once; used as a context manager it restores the previous choice on
    exit. `use_backend(None)` returns to automatic selection (and to GRAPHSAFE_BACKEND).
    Ops without the forced backend, or devices where it cannot run, fall back to the
    automatic order (aiter > triton > reference).

        graphsafe.use_backend("reference")             # everything, from now on
        with graphsafe.use_backend("triton", ops=["reshape_and_cache"]):
            ...
    """

    def __init__(self, backend: str | None, *, ops: Iterable[str] | None = None) -> None:
        global _forced_global, _forced_env_read
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
        _forced_backend("")  # make sure the environment was read before we override it
        self._saved = (_forced_global, dict(_forced_per_op))
        with _lock:
            if ops is None:
                _forced_global = backend
                _forced_per_op.clear()
            else:
                for op in ops:
                    qual = op if "::" in op else f"graphsafe::{op}"
                    if backend is None:
                        _forced_per_op.pop(qual, None)
                    else:
                        _forced_per_op[qual] = backend
        _reset_all()

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc: object) -> None:
        global _forced_global
        with _lock:
            _forced_global = self._saved[0]
            _forced_per_op.clear()
            _forced_per_op.update(self._saved[1])
        _reset_all()


_all_registries: list[Registry] = [REGISTRY]


def _reset_all() -> None:
    for reg in _all_registries:
        reg.reset_backends()


def new_registry(namespace: str) -> Registry:
    """A registry of another namespace (benchmarks, tests); `use_backend` applies to it too."""
    reg = Registry(namespace)
    _all_registries.append(reg)
    return reg
