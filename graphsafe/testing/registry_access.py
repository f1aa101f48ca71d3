"""Registry look-ups for the testing package (kept tiny to avoid import cycles)."""

from __future__ import annotations

from graphsafe.registry import OpSpec, get_op


def spec(name: str) -> OpSpec:
    return get_op(name)
