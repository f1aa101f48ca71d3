"""The workspace manager: one flat uint8 arena per (device, lane) that real impls carve
their scratch buffers from.

One function, `plan_layout`, both sizes and places the regions of a request, so the
bytes that `reserve` sizes for are exactly the bytes `get_simultaneous` will use.

Steady state is a dictionary hit: the views of each request signature are cached and
handed out again; growth drops the cache. Growth frees the old arena before allocating
the new one (no 2x spike) and is refused while the manager is locked, while the current
CUDA stream is capturing a graph, and after views were handed out inside a capture (a
captured graph keeps reading the arena's address). Every call raises under an active
FakeTensorMode: fake impls must never reach here.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from graphsafe.errors import WorkspaceError

ALIGNMENT = 256
# Growth rounds the arena up to a multiple of this (the CUDA caching allocator rounds
# large blocks to 2 MiB anyway); a request never gets less than it asked for.
GROWTH_GRANULARITY = 1 << 20
# Distinct request signatures whose views are kept; past this the cache is cleared
# (prefill with many shapes should not grow it without bound).
MAX_CACHED_SIGNATURES = 4096

Spec = tuple[Sequence[int], torch.dtype]

log = logging.getLogger("graphsafe.workspace")
if os.environ.get("GRAPHSAFE_DEBUG_WORKSPACE", "0") == "1":
    if not log.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[graphsafe.workspace] %(message)s"))
        log.addHandler(_handler)
    log.setLevel(logging.DEBUG)

_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_get_mode = torch._C._get_dispatch_mode


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_layout(specs: Sequence[Spec], guard: int = 0) -> tuple[tuple[int, ...], int]:
    """Byte offsets of each region and the total bytes of one `get_simultaneous` call.

    Regions are placed in order, each at a 256-byte aligned offset. `guard`: at least that
    many free bytes after every region, the last one included (the layout of a request
    while its op's views are guarded, `guarded`).
    """
    offsets = []
    cursor = 0
    for shape, dtype in specs:
        cursor = _align(cursor)
        offsets.append(cursor)
        cursor += math.prod(shape) * dtype.itemsize + guard
    return tuple(offsets), cursor


def workspace_bytes(*specs: Spec) -> int:
    """Arena bytes one `get_simultaneous(*specs)` needs."""
    return plan_layout(specs)[1]


def _fake_mode_active() -> bool:
    return _get_mode(_FAKE_KEY) is not None


def _caller() -> str:
    """file:line of the first frame outside the workspace package."""
    frame = sys._getframe(1)
    here = os.path.dirname(__file__)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and _stream_capturing()


@dataclass(frozen=True)
class WorkspaceStats:
    device: str
    lane: int
    size_bytes: int
    peak_request_bytes: int
    grow_count: int
    requests: dict[str, int]
    locked: bool
    cached_signatures: int
    captured: bool


class _Hold:
    """The context of `WorkspaceManager.hold`: a class, not a generator (a composite op
    enters one per call, and @contextmanager costs a few microseconds more)."""

    __slots__ = ("_manager", "_base", "_previous")

    def __init__(self, manager: WorkspaceManager, base: int) -> None:
        self._manager, self._base = manager, base

    def __enter__(self) -> None:
        self._previous = self._manager._base
        self._manager._base = self._base

    def __exit__(self, *exc: object) -> None:
        self._manager._base = self._previous


class WorkspaceManager:
    """Scratch memory for one (device, lane). Get one with `current_workspace_manager`."""

    def __init__(self, device: torch.device, lane: int = 0) -> None:
        self.device = device
        self.lane = lane
        self._arena: torch.Tensor | None = None
        self._size = 0
        self._locked = False
        self._captured = False
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._peak = 0
        self._grow_count = 0
        self._requests: dict[str, int] = {}  # a plain dict: Counter's += costs twice as much
        self._is_cuda = device.type == "cuda"
        # Start of the free part of the arena: 0, or the end of views held by `hold`.
        self._base = 0

    # -- the hot path -----------------------------------------------------------------
    def get_simultaneous(self, *specs: Spec, owner: str = "unnamed") -> list[torch.Tensor]:
        """Views into the arena, one per `(shape, dtype)`, disjoint and 256-byte aligned.

        The memory is uninitialised. A later call (of any owner) reuses the same bytes,
        so the views are valid until the next call on this manager: use them inside one
        op and never return them. `owner` names the op for `stats()` and errors.
        """
        if _get_mode(_FAKE_KEY) is not None:
            raise WorkspaceError(
                f"workspace requested by {owner!r} while a FakeTensorMode is active: fake impls "
                f"must compute metadata only and never touch the workspace ({_caller()})"
            )
        if _guard_scopes:  # an op call under the debug switch: guarded views (slow path)
            return self._get_guarded(specs, owner)
        try:
            views = self._views[specs if self._base == 0 else (self._base, specs)]
        except (KeyError, TypeError):
            views = self._carve(specs, owner)
        if self._is_cuda and not self._captured and _stream_capturing():
            self._captured = True
        requests = self._requests
        requests[owner] = requests.get(owner, 0) + 1
        return list(views)

    # -- the slow path ----------------------------------------------------------------
    def _carve(self, specs: Sequence[Spec], owner: str) -> tuple[torch.Tensor, ...]:
        key_specs = tuple((tuple(int(s) for s in shape), dtype) for shape, dtype in specs)
        for shape, dtype in key_specs:
            if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
                raise WorkspaceError(f"{owner}: bad workspace request {shape}, {dtype}")
        base = self._base
        views = self._views.get(key_specs if base == 0 else (base, key_specs))
        if views is None:
            offsets, total = plan_layout(key_specs)
            offsets = tuple(base + o for o in offsets)
            total += base
            self._peak = max(self._peak, total)
            self._ensure(total, owner)
            assert self._arena is not None or total == 0
            views = tuple(
                self._view(offset, shape, dtype) for offset, (shape, dtype) in zip(offsets, key_specs)
            )
            if len(self._views) >= MAX_CACHED_SIGNATURES:
                self._views.clear()
            self._views[key_specs if base == 0 else (base, key_specs)] = views
        try:
            self._views[specs if base == 0 else (base, specs)] = views  # the caller's own spelling too
        except TypeError:
            pass  # unhashable spelling (lists): the normalised key is cached
        return views

    def _can_grow(self) -> bool:
        """Whether `_ensure` may grow the arena now (see its refusals)."""
        return not (self._locked or self._base or self._captured or _capturing(self.device))

    def _get_guarded(self, specs: Sequence[Spec], owner: str) -> list[torch.Tensor]:
        """`get_simultaneous` inside a `guarded` scope: views carved afresh (not cached) with
        GUARD_BYTES free after each (`plan_layout(..., guard=)`), or, where that layout does
        not fit an arena that may not grow now (locked, views held, a capture), the usual
        layout with the bytes up to the next region (its alignment padding) and, after the
        last one, up to GUARD_BYTES before the arena's end as guards. Each guard is filled
        with GUARD_PATTERN and recorded in the innermost scope; guards of earlier requests
        whose bytes this one reuses are checked first (views of separate requests alias)."""
        key_specs = tuple((tuple(int(x) for x in shape), dtype) for shape, dtype in specs)
        for shape, dtype in key_specs:
            if not isinstance(dtype, torch.dtype) or any(x < 0 for x in shape):
                raise WorkspaceError(f"{owner}: bad workspace request {shape}, {dtype}")
        base = self._base
        offsets, total = plan_layout(key_specs, guard=GUARD_BYTES)
        tight = base + total > self._size and not self._can_grow()
        if tight:
            offsets, total = plan_layout(key_specs)
        if base + total > self._size:
            _check_guards(self, 0, self._size)  # growth frees the arena: check what it holds first
        self._peak = max(self._peak, base + total)
        self._ensure(base + total, owner)
        self._requests[owner] = self._requests.get(owner, 0) + 1
        if self._is_cuda and not self._captured and _stream_capturing():
            self._captured = True
        starts = [base + o for o in offsets]
        ends = [start + math.prod(shape) * dtype.itemsize for start, (shape, dtype) in zip(starts, key_specs)]
        last = min(ends[-1] + GUARD_BYTES, self._size) if ends else base
        _check_guards(self, base, max(last, base + total))
        views = [self._view(start, shape, dtype) for start, (shape, dtype) in zip(starts, key_specs)]
        if self._arena is None:
            return views
        scope = _guard_scopes[-1]
        for i, (start, end) in enumerate(zip(starts, ends)):
            stop = starts[i + 1] if i + 1 < len(starts) else last
            if stop > end:
                self._arena[end:stop].fill_(GUARD_PATTERN)
                shape, dtype = key_specs[i]
                scope.guards.append(_Guard(self, self._arena, end, stop, i, len(key_specs), owner, shape, dtype,
                                           start))
        return views

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._arena is None:  # a zero-byte request before any growth
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._arena[offset : offset + nbytes].view(dtype).view(shape)

    def _ensure(self, required: int, owner: str) -> None:
        if required <= self._size:
            return
        where = _caller()
        if self._locked:
            raise WorkspaceError(
                f"workspace on {self.device} (lane {self.lane}) is locked: {owner} needs "
                f"{required} bytes, the arena has {self._size} bytes (requested at {where}). "
                f"Reserve the worst case before locking (WorkspaceManager.reserve)."
            )
        if _capturing(self.device):
            raise WorkspaceError(
                f"workspace on {self.device} (lane {self.lane}) cannot grow while the current stream "
                f"is capturing a CUDA graph: {owner} needs {required} bytes, the arena has "
                f"{self._size} bytes (requested at {where}). Reserve the worst case before capture."
            )
        if self._base:
            raise WorkspaceError(
                f"workspace on {self.device} (lane {self.lane}) cannot grow while views are held "
                f"(WorkspaceManager.hold): {owner} needs {required} bytes, the arena has {self._size} "
                f"bytes (requested at {where}). Reserve the nested worst case before holding views."
            )
        if self._captured:
            raise WorkspaceError(
                f"workspace on {self.device} (lane {self.lane}) was used inside a CUDA graph capture, "
                f"which still reads the arena: {owner} needs {required} bytes, the arena has "
                f"{self._size} bytes (requested at {where}). Reserve the worst case before capture, "
                f"or call forget_captures() once those graphs are destroyed."
            )
        new_size = -(-required // GROWTH_GRANULARITY) * GROWTH_GRANULARITY
        log.debug(
            "grow %s lane %d: %d -> %d bytes for %s (needs %d) at %s",
            self.device, self.lane, self._size, new_size, owner, required, where,
        )
        # Free first: drop every cached view and the arena, then allocate.
        self._views.clear()
        self._arena = None
        self._size = 0
        self._arena = torch.empty(new_size, dtype=torch.uint8, device=self.device)
        self._size = new_size
        self._grow_count += 1

    # -- sizing and state -------------------------------------------------------------
    def reserve(self, *specs: Spec, nbytes: int = 0, owner: str = "reserve") -> None:
        """Grow the arena now to hold `get_simultaneous(*specs)` (and at least `nbytes`)."""
        if _fake_mode_active():
            raise WorkspaceError(f"workspace reserve by {owner!r} while a FakeTensorMode is active ({_caller()})")
        required = max(nbytes, workspace_bytes(*specs))
        self._peak = max(self._peak, required)
        self._ensure(required, owner)

    def hold(self, *views: torch.Tensor) -> _Hold:
        """Keep `views` (from this manager) valid while nested requests are served.

        A composite op that carves its intermediates and then calls other graphsafe ops
        (which take their own scratch from this manager) wraps those calls in `hold`:
        nested requests are placed after the held views instead of over them. The arena
        cannot grow while views are held, so the composite reserves its worst case,
        nested needs included, before carving (`reserve`).

            logits, = ws.get_simultaneous(((rows, width), torch.float32), owner="composite")
            with ws.hold(logits):
                torch.ops.graphsafe.top_k_per_row_decode(logits, ...)
        """
        if self._arena is None:
            return _Hold(self, self._base)
        start = self._arena.data_ptr()
        end = self._base
        for v in views:
            offset = v.data_ptr() - start
            nbytes = v.numel() * v.element_size()
            if nbytes and not (0 <= offset and offset + nbytes <= self._size):
                raise WorkspaceError("hold() takes views returned by this manager's get_simultaneous")
            end = max(end, offset + nbytes)
        return _Hold(self, _align(end))

    def lock(self) -> None:
        """Refuse growth from now on (requests that fit are still served)."""
        self._locked = True

    def unlock(self) -> None:
        self._locked = False

    @contextmanager
    def locked(self) -> Iterator[WorkspaceManager]:
        previous = self._locked
        self._locked = True
        try:
            yield self
        finally:
            self._locked = previous

    @property
    def is_locked(self) -> bool:
        return self._locked

    @property
    def size_bytes(self) -> int:
        return self._size

    def forget_captures(self) -> None:
        """Allow growth again once every graph captured over this arena is destroyed."""
        self._captured = False

    def stats(self) -> WorkspaceStats:
        return WorkspaceStats(
            device=str(self.device),
            lane=self.lane,
            size_bytes=self._size,
            peak_request_bytes=self._peak,
            grow_count=self._grow_count,
            requests=dict(self._requests),
            locked=self._locked,
            cached_signatures=len(self._views),
            captured=self._captured,
        )


# -- guards (the debug switch) ----------------------------------------------------------
# With `graphsafe.debug_checks` on, every op call runs inside `guarded(op)`: the bytes after
# each view it is handed are filled with GUARD_PATTERN and checked when the call returns (or
# raises), so a kernel that writes past its view, or a view reserved too small for what a
# kernel writes into it, fails on any device, where on a GPU it would land silently in the
# arena's alignment padding or the next region.
GUARD_BYTES = ALIGNMENT
GUARD_PATTERN = 0xA5


@dataclass(eq=False)
class _Guard:
    manager: WorkspaceManager
    arena: torch.Tensor  # the arena the view was carved from (growth replaces it)
    start: int  # the guarded bytes [start, end) of the arena: right after the view
    end: int
    index: int  # the view's place in its request
    count: int
    owner: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    view_start: int

    def overrun(self) -> tuple[int, int] | None:
        """(bytes changed, offset past the view's end of the first) or None (syncs)."""
        changed = (self.arena[self.start : self.end] != GUARD_PATTERN).cpu()
        if not bool(changed.any()):
            return None
        return int(changed.sum()), int(changed.nonzero()[0, 0])

    def describe(self) -> str:
        return (f"view {self.index} of {self.count} of the workspace request by {self.owner!r} "
                f"({list(self.shape)}, {str(self.dtype).replace('torch.', '')}: arena bytes "
                f"[{self.view_start}, {self.start}) on {self.manager.device}, lane {self.manager.lane})")


class GuardScope:
    """The guards of the views handed out during one op call (`guarded`)."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.guards: list[_Guard] = []
        self.checked = 0  # guards checked so far (at reuse or at the end)

    def check(self, guards: Sequence[_Guard] | None = None) -> None:
        """Check `guards` (default: all this scope still holds) and drop them; raise a
        WorkspaceError naming the op, the view and the bytes written past it."""
        guards = list(self.guards) if guards is None else list(guards)
        for guard in guards:
            self.guards.remove(guard)
        for guard in guards:
            self.checked += 1
            hit = guard.overrun()
            if hit is not None:
                changed, first = hit
                raise WorkspaceError(
                    f"graphsafe.{self.op}: workspace overrun past {guard.describe()}: {changed} of the "
                    f"{guard.end - guard.start} bytes after it were written, the first {first} bytes past its "
                    f"end (GRAPHSAFE_DEBUG_CHECKS guard, pattern {GUARD_PATTERN:#04x}): a kernel writes past "
                    "this view, or the op reserves it too small")


_guard_scopes: list[GuardScope] = []


def _check_guards(manager: WorkspaceManager, start: int, end: int) -> None:
    """Check and drop the outstanding guards of `manager` overlapping bytes [start, end)
    (a new request is about to reuse them), in every scope."""
    for scope in _guard_scopes:
        hit = [g for g in scope.guards if g.manager is manager and g.start < end and start < g.end]
        if hit:
            scope.check(hit)


class guarded:
    """`with guarded("op"):` the workspace views handed out inside are guarded (above) and
    checked on exit; an overrun raises a WorkspaceError naming the op, the view and the
    bytes (chained to the op's own error when the call raised). The registry enters one
    per op call while `graphsafe.debug_checks` is on; nested scopes nest."""

    def __init__(self, op: str) -> None:
        self.scope = GuardScope(op)

    def __enter__(self) -> GuardScope:
        _guard_scopes.append(self.scope)
        return self.scope

    def __exit__(self, kind, err, tb) -> None:
        _guard_scopes.remove(self.scope)
        if err is None:
            self.scope.check()
            return
        try:
            self.scope.check()
        except WorkspaceError as overrun:
            raise overrun from err


# -- per-device, per-lane managers -----------------------------------------------------
_lane: ContextVar[int] = ContextVar("graphsafe_workspace_lane", default=0)
_managers: dict[tuple[object, int], WorkspaceManager] = {}


def _normalise(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def current_workspace_manager(device: torch.device | str | int | None = None) -> WorkspaceManager:
    """The manager of `device` (default: the current CUDA device, else the CPU) in the current lane."""
    lane = _lane.get()
    try:
        return _managers[(device, lane)]
    except (KeyError, TypeError):
        pass
    if _fake_mode_active():
        raise WorkspaceError(f"current_workspace_manager() called while a FakeTensorMode is active ({_caller()})")
    dev = _normalise(device)
    manager = _managers.get((dev, lane))
    if manager is None:
        manager = _managers[(dev, lane)] = WorkspaceManager(dev, lane)
    # Cache the caller's spelling only when it names one device for good ("cuda" alone
    # follows the current device, so it is normalised on every call).
    if device is not None and not isinstance(device, int) and torch.device(device) == dev:
        try:
            _managers[(device, lane)] = manager
        except TypeError:
            pass
    return manager


@contextmanager
def workspace_lane(lane: int) -> Iterator[None]:
    """Use the arenas of `lane` inside the block (overlapping micro-batches need their own)."""
    token = _lane.set(lane)
    try:
        yield
    finally:
        _lane.reset(token)


def current_lane() -> int:
    return _lane.get()


def all_workspace_managers() -> list[WorkspaceManager]:
    return list({id(m): m for m in _managers.values()}.values())


def drop_workspace_manager(device: torch.device | str | int | None = None) -> None:
    """Drop the manager (and its arena) of `device` in the current lane; the next request
    there starts a fresh one. Only where no captured graph uses its arena."""
    manager = current_workspace_manager(device)
    for key in [k for k, m in _managers.items() if m is manager]:
        del _managers[key]


def reset_workspace_managers() -> None:
    """Drop every manager and its arena (tests; after destroying captured graphs)."""
    _managers.clear()
