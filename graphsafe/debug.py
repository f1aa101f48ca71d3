"""Debug checks: what an op cannot check without reading its tensors' values.

Index values (block ids, cache slots, row ranges) and host-int preconditions (a
`max_seqlen` at least every real length, `cu_seqlens` that never decrease) need the
values of device tensors, so checking them costs a host sync per call: never on by
default, never inside a captured CUDA graph. An id out of range is not an error for the
ops (each op documents it as padding, the same on every backend); it usually is a bug in
the caller, and this switch finds it: with it on, every op call runs its `debug_check`,
which raises `graphsafe.InputError` naming the op, the argument, the allowed range and
the first offending value.

    GRAPHSAFE_DEBUG_CHECKS=1 python my_server.py       # or, from Python:
    graphsafe.debug_checks(True)
    with graphsafe.debug_checks():                      # on inside the block
        ...

The switch also guards the workspace: during each op call, the bytes after every view
the workspace manager hands out are filled with a pattern (a gap of GUARD_BYTES is left
after each view where the arena has room) and checked when the call returns, so a kernel
that writes past its view, or a view reserved smaller than what a kernel writes into it,
raises a `graphsafe.WorkspaceError` naming the op, the view and the bytes written, on a
GPU as on the CPU (`graphsafe.workspace.manager.guarded`). Turn the switch on before
reserving and locking the workspace, so the reservation has the room for the gaps.

The checks are skipped while the current stream captures a CUDA graph (a sync there
would invalidate the capture) and while torch.compile traces (fake tensors have no values).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphsafe.errors import InputError

# Read by the registry's dispatcher kernel on every call: one list index, no function call.
STATE = [os.environ.get("GRAPHSAFE_DEBUG_CHECKS", "0").strip().lower() not in ("", "0", "false", "no", "off")]


class debug_checks:
    """Turn the debug checks on (default) or off; as a context manager, restore on exit."""

    def __init__(self, enabled: bool = True) -> None:
        self._saved = STATE[0]
        STATE[0] = bool(enabled)

    def __enter__(self) -> debug_checks:
        return self

    def __exit__(self, *exc: object) -> None:
        STATE[0] = self._saved


def checks_can_run(*tensors: Any) -> bool:
    """False while a CUDA graph is being captured on the current stream."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return not torch.cuda.is_current_stream_capturing()
    return True


def _fail(op: str, arg: str, expected: str, got: str) -> None:
    raise InputError(f"graphsafe.{op}: argument '{arg}' must be {expected}, got {got} (GRAPHSAFE_DEBUG_CHECKS)")


# The entries a check looks at: a bool mask of the checked tensor's shape, or an index into it.
Used = torch.Tensor | slice | int | None


def _refuse_first(op: str, arg: str, values: torch.Tensor, bad: torch.Tensor, used: Used, expected: str) -> None:
    """Raise naming the first True of `bad` (of values's shape) where `used` holds, by its
    index in `values`: the whole argument goes in and `used` selects entries (a bool mask
    of values's shape, or an index such as `slice(-1, None)`), so the message names the
    argument's own index, never one of a slice."""
    if used is not None:
        if not isinstance(used, torch.Tensor):
            mask = torch.zeros(values.shape, dtype=torch.bool, device=bad.device)
            mask[used] = True
            used = mask
        bad = bad & used.to(bad.device)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.cpu().nonzero()[0])
        _fail(op, arg, expected, f"{int(values.detach().cpu()[at])} at index {list(at)}")


def ids_in_range(op: str, arg: str, ids: torch.Tensor, high: int, *, used: Used = None,
                 padding: int | None = -1, what: str = "ids") -> None:
    """Every id (where `used`, a bool mask of ids's shape or an index into ids, holds) is
    in `[0, high)` or equals `padding`."""
    ids = ids.detach()
    bad = (ids < 0) | (ids >= high)
    if padding is not None:
        bad &= ids != padding
    pad = f" or {padding} (padding)" if padding is not None else ""
    _refuse_first(op, arg, ids, bad, used, f"{what} in [0, {high}){pad}")


def table_entries_read(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool `[B, max_blocks]`: the block-table entries a request of `lengths[b]` cached
    tokens reads (the first `ceil(lengths[b] / block_size)` of row b; none for a length
    <= 0)."""
    blocks = torch.div(lengths.detach().long().clamp_min(0) + block_size - 1, block_size, rounding_mode="floor")
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    return columns[None, :] < blocks.to(block_table.device)[:, None]


def values_distinct(op: str, arg: str, values: torch.Tensor, what: str) -> None:
    """The entries >= 0 of 1-D `values` are pairwise distinct (negative ones are padding)."""
    v = values.detach().long()
    s = v.sort().values
    dup = (s[1:] == s[:-1]) & (s[1:] >= 0)
    if bool(dup.any()):
        value = int(s[1:][dup][0])
        at = [int(i) for i in (v == value).nonzero().flatten()[:2]]
        _fail(op, arg, f"distinct {what} (or -1)", f"{what.rstrip('s')} {value} at indices {at}")


def values_at_most(op: str, arg: str, values: torch.Tensor, limit: int, why: str, *, used: Used = None) -> None:
    """Every value of `values` (where `used` holds, as for `ids_in_range`) is <= `limit`
    (`why` names the limit)."""
    _refuse_first(op, arg, values, values.detach() > limit, used, f"at most {limit} ({why})")


def values_at_least(op: str, arg: str, values: torch.Tensor, limit: int, why: str, *, used: Used = None) -> None:
    """Every value of `values` (where `used` holds) is >= `limit`."""
    _refuse_first(op, arg, values, values.detach() < limit, used, f"at least {limit} ({why})")


def non_decreasing(op: str, arg: str, values: torch.Tensor) -> None:
    """`values` (1-D) never decreases."""
    v = values.detach().reshape(-1)
    if v.numel() > 1:
        down = v[1:] < v[:-1]
        if bool(down.any()):
            i = int(down.nonzero()[0, 0])
            _fail(op, arg, "non-decreasing", f"{int(v[i])} then {int(v[i + 1])} at index {i}")


def max_of_differences_at_most(op: str, arg: str, cu: torch.Tensor, limit: int, limit_arg: str) -> None:
    """Every length `cu[i + 1] - cu[i]` is at most `limit` (the value passed as `limit_arg`)."""
    v = cu.detach().reshape(-1).to(torch.int64)
    if v.numel() > 1:
        lengths = v[1:] - v[:-1]
        over = lengths > limit
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            _fail(op, arg, f"a length of at most {limit_arg} = {limit} per sequence",
                  f"length {int(lengths[i])} for sequence {i}")
