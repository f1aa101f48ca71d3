"""Exception types. Kept free of torch imports at module level so every layer can raise them.

Catching a bad input works the same way in eager code and under `torch.compile`:
`except graphsafe.InputError`. Under compile the input checks run in the op's fake impl,
inside Dynamo's fake-tensor propagation, which turns every exception it does not know into
a `TorchRuntimeError` ("RuntimeError when making fake tensor call"). The registry's fake
wrapper therefore re-raises an `InputError` as `as_traced_error(err)`: the same message,
an instance of `InputError` and of Dynamo's `Unsupported`, which Dynamo passes on as is.
With `fullgraph=True` the caller gets it directly; without, Dynamo breaks the graph at the
op, runs it eagerly, and the eager check raises the plain `InputError`.
"""

from __future__ import annotations

from typing import Any


class GraphsafeError(RuntimeError):
    """Base class of every error graphsafe raises on purpose."""


class InputError(GraphsafeError, ValueError):
    """An op was called with an argument of the wrong shape, dtype, device, layout or value.

    The message's first line names the op, the argument, what was expected and what came
    in. Catch it as `graphsafe.InputError` in eager code and under `torch.compile` alike.
    """


class RegistrationError(GraphsafeError):
    """An op was registered in a way that breaks the op contract (see docs/design.md)."""


class WorkspaceError(GraphsafeError):
    """The workspace manager refused a request (growth while locked or capturing, fake mode)."""


_traced_class: Any = None


def _traced_input_error_class() -> Any:
    global _traced_class
    if _traced_class is None:
        try:
            from torch._dynamo.exc import Unsupported
        except ImportError:  # a torch without Dynamo: nothing wraps the fake's errors
            _traced_class = InputError
        else:

            class TracedInputError(InputError, Unsupported):  # type: ignore[misc]
                """An `InputError` raised while torch.compile traces an op (see the module doc)."""

                def __init__(self, msg: str) -> None:
                    Unsupported.__init__(self, msg, "graphsafe input error")

                def __str__(self) -> str:
                    return self.msg

            TracedInputError.__module__ = __name__
            TracedInputError.__qualname__ = "InputError"
            _traced_class = TracedInputError
    return _traced_class


def as_traced_error(err: InputError) -> InputError:
    """`err` as the exception the fake impls raise: still an `InputError` with the same
    message, and one that `torch.compile` lets through unchanged."""
    cls = _traced_input_error_class()
    if isinstance(err, cls):
        return err
    return cls(str(err))
