"""Op registration, the op table, and backend selection.

`register_op` is the one way an op enters graphsafe. It takes a typed signature stub
(its docstring is the op's documentation), infers the schema from the type hints, and
registers through `torch.library.Library(namespace, "FRAGMENT")`:

* `define` with the inferred schema (mutated tensors marked `(a!)`),
* `impl` on the `CPU` and `CUDA` dispatch keys (`CUDA` also serves HIP builds),
* the fake impl (required: registering without one raises `RegistrationError`).

We use `Library.define/impl` rather than `@torch.library.custom_op`: the latter adds
several microseconds per call (pytorch/pytorch#139500, #177109).

The kernel registered on each dispatch key is a small closure over a one-element slot.
On its first call it resolves the backend for that device type (aiter > triton >
reference, or the one forced by `GRAPHSAFE_BACKEND` / `use_backend`) and caches the
pair (input check, backend impl); later calls cost one list index and the two calls on
top of the dispatcher. `use_backend` clears the slots.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphsafe.backends import AUTO_ORDER, BACKENDS, backend_available
from graphsafe.errors import RegistrationError

Impl = Callable[..., Any]
# A backend is either a function or a lazy "package.module:function" reference, so that
# importing graphsafe never imports triton or aiter.
BackendRef = Impl | str

DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

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


@dataclass(eq=False)
class OpSpec:
    """Everything graphsafe knows about one registered op (one row of the op table)."""

    name: str
    namespace: str
    schema: str
    mutates_args: tuple[str, ...]
    check: Impl
    fake: Impl
    backends: dict[str, BackendRef]
    family: str
    doc: str
    workspace: Callable[..., Sequence[tuple[Sequence[int], torch.dtype]]] | None = None
    overload: Any = None  # torch._ops.OpOverload, set after `define`
    public: Any = None  # the Python function users call (docstring of the stub)
    _slots: dict[str, list[Any]] = field(default_factory=dict, repr=False)
    _resolved: dict[str, Impl] = field(default_factory=dict, repr=False)

    @property
    def qualname(self) -> str:
        return f"{self.namespace}::{self.name}"

    # -- backends -------------------------------------------------------------------
    def backend_impl(self, backend: str) -> Impl:
        """The raw impl of `backend` (lazy references are imported on first use)."""
        if backend not in self.backends:
            raise KeyError(f"{self.qualname} has no {backend!r} backend; it has {list(self.backends)}")
        fn = self._resolved.get(backend)
        if fn is None:
            ref = self.backends[backend]
            if isinstance(ref, str):
                module, _, attr = ref.partition(":")
                fn = getattr(importlib.import_module(module), attr)
            else:
                fn = ref
            self._resolved[backend] = fn
        return fn

    def available_backends(self, device_type: str) -> list[str]:
        """Backends of this op that can run on `device_type` here, best first."""
        return [b for b in BACKENDS if b in self.backends and backend_available(b, device_type)]

    def serving_backend(self, device_type: str) -> str:
        """The backend a call on `device_type` uses (resolving it if needed)."""
        forced = _forced_backend(self.qualname)
        order = AUTO_ORDER.get(device_type, ("reference",))
        if forced is not None:
            if forced in self.backends and backend_available(forced, device_type):
                return forced
            if forced in self.backends:
                warnings.warn(
                    f"graphsafe: backend {forced!r} is forced but unavailable for {self.qualname} "
                    f"on {device_type}; falling back to the automatic order {order}",
                    stacklevel=3,
                )
        for backend in order:
            if backend in self.backends and backend_available(backend, device_type):
                return backend
        raise RegistrationError(f"{self.qualname}: no backend can run on {device_type}")

    def runner(self, backend: str) -> Impl:
        """A function that validates its inputs and runs `backend` (for tests and tools)."""
        check, impl = self.check, self.backend_impl(backend)

        def run(*args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            return impl(*args, **kwargs)

        run.__name__ = f"{self.name}[{backend}]"
        return run

    def _bind(self, device_type: str, slot: list[Any]) -> tuple[Impl, Impl]:
        with _lock:
            pair = (self.check, self.backend_impl(self.serving_backend(device_type)))
            slot[0] = pair
        return pair

    def _reset(self) -> None:
        for slot in self._slots.values():
            slot[0] = None

    # -- workspace ------------------------------------------------------------------
    def workspace_bytes(self, *args: Any, **kwargs: Any) -> int:
        """Worst-case workspace bytes of one call, from shapes (no dry run)."""
        if self.workspace is None:
            return 0
        from graphsafe.workspace import workspace_bytes

        return workspace_bytes(*self.workspace(*args, **kwargs))

    # -- testing hooks ----------------------------------------------------------------
    @property
    def case(self) -> Any:
        """The op's test case (input strategy, example inputs, comparison), see graphsafe.testing."""
        from graphsafe.testing.cases import case_for

        return case_for(self.name)


def _make_kernel(spec: OpSpec, device_type: str) -> Impl:
    # The slot holds (check, backend impl) once resolved. The kernel calls both itself,
    # with no wrapper in between: every Python call level costs ~0.1 us per op call.
    slot: list[Any] = [None]
    spec._slots[device_type] = slot

    def kernel(*args: Any, **kwargs: Any) -> Any:
        pair = slot[0]
        if pair is None:
            pair = spec._bind(device_type, slot)
        pair[0](*args, **kwargs)
        return pair[1](*args, **kwargs)

    kernel.__name__ = f"graphsafe_{spec.name}_{device_type}"
    return kernel


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
        backends: dict[str, BackendRef],
        mutates_args: Iterable[str] = (),
        family: str = "",
        workspace: Callable[..., Sequence[tuple[Sequence[int], torch.dtype]]] | None = None,
    ) -> Callable[[Impl], Impl]:
        """Decorator over a typed signature stub; returns the public Python function.

        Args:
            name: op name inside the namespace (`torch.ops.<namespace>.<name>`).
            fake: the fake impl (in `graphsafe/fake_impls/`): metadata only.
            check: input validation shared by the fake and the real impl.
            backends: `{"reference": fn, "triton": "pkg.mod:fn", ...}`; reference required.
            mutates_args: exactly the tensor args the op writes; the op must return None.
            family: the op family folder (`cache`, `ragged`, ...).
            workspace: `f(**shape_params) -> [(shape, dtype), ...]`, the worst case of one call.
        """
        if isinstance(mutates_args, str):
            raise RegistrationError(
                f"{self.namespace}::{name}: mutates_args must list the mutated args exactly; "
                f"got the string {mutates_args!r} ('unknown' is never allowed)"
            )
        mutated = tuple(mutates_args)
        if fake is None or not callable(fake):
            raise RegistrationError(f"{self.namespace}::{name}: a fake impl is required")
        if check is None or not callable(check):
            raise RegistrationError(f"{self.namespace}::{name}: an input check is required")
        if "reference" not in backends:
            raise RegistrationError(f"{self.namespace}::{name}: a reference backend is required")
        unknown = set(backends) - set(BACKENDS)
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
                backends=dict(backends),
                family=family,
                doc=inspect.getdoc(stub) or "",
                workspace=workspace,
            )
            self.lib.define(name + schema)
            for device_type, key in DISPATCH_KEYS.items():
                self.lib.impl(name, _make_kernel(spec, device_type), key)
            torch.library.register_fake(spec.qualname, fake, lib=self.lib)
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
    """The op table: name -> OpSpec, for every op registered in the `graphsafe` namespace."""
    import graphsafe.ops  # noqa: F401 - registers the op families

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
