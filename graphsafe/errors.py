"""Exception types. Kept free of torch imports beyond typing so every layer can raise them."""

from __future__ import annotations


class GraphsafeError(RuntimeError):
    """Base class of every error graphsafe raises on purpose."""


class InputError(GraphsafeError, ValueError):
    """An op was called with an argument of the wrong shape, dtype, device or layout.

    The message always names the op, the argument, what was expected and what came in.
    """


class RegistrationError(GraphsafeError):
    """An op was registered in a way that breaks the op contract (see DESIGN.md)."""


class WorkspaceError(GraphsafeError):
    """The workspace manager refused a request (growth while locked or capturing, fake mode)."""
