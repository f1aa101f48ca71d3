"""Triton's interpreter, faster for nested `@triton.jit` calls (test runs on the CPU).

The interpreter patches `triton.language` (its builtins, tensor methods, `range`, ...)
once per kernel launch, and restores it when the launch ends (`GridExecutor.__call__`:
`_patch_lang`, then `restore()` in a `finally`). It also calls `_patch_lang` again at every
call of a nested `@triton.jit` function (`InterpretedFunction.__call__`), which re-scans the
modules with `inspect.getmembers` and changes nothing: the patches are set on the module
objects, which the running launch has already patched. In the DSv4 and top-k kernels that
re-scan is 40% of an interpreted launch (a `dsv4_compress_kv` call: ~1.7 -> ~0.8 s).

`install()` wraps `_patch_lang` so that a nested call whose language modules the running
launch has patched skips the re-scan; the first (launch-level) call and a nested call that
needs a module not yet patched go through unchanged. Semantics are the interpreter's own.
Installed only on the Triton versions whose interpreter was read for this (3.9); elsewhere
`install()` returns False and changes nothing.
"""
from __future__ import annotations

import inspect

SUPPORTED = ("3.9.",)


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` (idempotent). True when installed."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith(SUPPORTED):
        return False
    original = interpreter._patch_lang
    if getattr(original, "graphsafe_wrapped", False):
        return True
    if not hasattr(interpreter, "_LangPatchScope"):
        return False
    active: list[frozenset[int] | None] = [None]  # the language modules the running launch patched

    def patch_lang(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
        if active[0] is not None and langs <= active[0]:
            return interpreter._LangPatchScope()  # nothing to do: the launch's patches hold
        scope = original(fn)
        if active[0] is None:  # a launch: its scope's restore() ends it
            active[0] = langs
            restore = scope.restore

            def restore_and_end() -> None:
                active[0] = None
                restore()

            scope.restore = restore_and_end
        else:  # a nested function that sees another module: patched now (and, as without this
            # wrapper, never restored: the interpreter drops a nested call's scope)
            active[0] = active[0] | langs
        return scope

    patch_lang.graphsafe_wrapped = True
    interpreter._patch_lang = patch_lang
    return True
