"""The workspace manager: layout, aliasing, growth rules, fake-mode refusal, stats, lanes."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from graphsafe.errors import WorkspaceError
from graphsafe.workspace import (
    ALIGNMENT,
    GROWTH_GRANULARITY,
    WorkspaceManager,
    current_workspace_manager,
    plan_layout,
    workspace_bytes,
    workspace_lane,
)

CPU = torch.device("cpu")
DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]

specs_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple), st.sampled_from(DTYPES)),
    min_size=1,
    max_size=6,
)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


@given(specs=specs_strategy)
def test_views_are_aligned_disjoint_and_exact(specs):
    ws = WorkspaceManager(CPU)
    views = ws.get_simultaneous(*specs, owner="prop")
    assert len(views) == len(specs)
    base = None
    for (shape, dtype), v in zip(specs, views):
        assert tuple(v.shape) == tuple(shape) and v.dtype == dtype and v.is_contiguous()
        if v.numel():
            base = base or ws._arena.data_ptr()
            assert (v.data_ptr() - base) % ALIGNMENT == 0
    spans = sorted(_span(v) for v in views if v.numel())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "regions of one call overlap"
    # The layout function that sizes is the one that places.
    offsets, total = plan_layout(specs)
    assert ws.size_bytes >= total and workspace_bytes(*specs) == total
    assert all(o % ALIGNMENT == 0 for o in offsets)


def test_views_are_writable_and_hold_data_within_a_call():
    ws = WorkspaceManager(CPU)
    a, b, c = ws.get_simultaneous(((7, 3), torch.float32), ((5,), torch.int64), ((33,), torch.uint8))
    a.fill_(1.5)
    b.fill_(-7)
    c.fill_(9)
    assert a.eq(1.5).all() and b.eq(-7).all() and c.eq(9).all()


def test_separate_calls_alias():
    ws = WorkspaceManager(CPU)
    (x,) = ws.get_simultaneous(((64,), torch.float32), owner="a")
    (y,) = ws.get_simultaneous(((16,), torch.int32), owner="b")
    assert x.data_ptr() == y.data_ptr(), "a new call reuses the arena from its start"


def test_steady_state_returns_cached_views_and_fresh_lists():
    ws = WorkspaceManager(CPU)
    specs = (((4, 4), torch.float32), ((8,), torch.int32), ((3,), torch.float16))
    first = ws.get_simultaneous(*specs)
    second = ws.get_simultaneous(*specs)
    assert all(a is b for a, b in zip(first, second)), "views are cached per request signature"
    assert first is not second, "each call gets its own list"
    # Another spelling of the same request (lists, torch.Size) hits the same layout.
    third = ws.get_simultaneous(([4, 4], torch.float32), (torch.Size([8]), torch.int32), ([3], torch.float16))
    assert [t.data_ptr() for t in third] == [t.data_ptr() for t in first]


def test_growth_frees_first_rounds_and_drops_the_cache():
    ws = WorkspaceManager(CPU)
    (small,) = ws.get_simultaneous(((10,), torch.uint8))
    assert ws.size_bytes == GROWTH_GRANULARITY and ws.stats().grow_count == 1
    big_elems = GROWTH_GRANULARITY // 4 + 1  # just over the arena
    (big,) = ws.get_simultaneous(((big_elems,), torch.float32))
    assert ws.stats().grow_count == 2
    assert ws.size_bytes == 2 * GROWTH_GRANULARITY
    assert ws.stats().cached_signatures == 1, "growth dropped the stale views"
    # Requests that fit never grow again.
    ws.get_simultaneous(((10,), torch.uint8), ((100,), torch.float32))
    assert ws.stats().grow_count == 2


def test_growth_releases_the_old_arena_before_allocating(monkeypatch):
    ws = WorkspaceManager(CPU)
    ws.reserve(nbytes=10)
    old = ws._arena
    seen = []
    real_empty = torch.empty

    def spy_empty(*args, **kwargs):
        seen.append(ws._arena)  # what the manager still holds when it allocates
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy_empty)
    ws.reserve(nbytes=3 * GROWTH_GRANULARITY)
    assert seen == [None], "the old arena must be dropped before the new one is allocated"
    assert old is not ws._arena


def test_locked_manager_refuses_growth_with_a_useful_error():
    ws = WorkspaceManager(CPU)
    ws.reserve(((1024,), torch.float32))
    ws.lock()
    ws.get_simultaneous(((1024,), torch.float32))  # fits: served
    with pytest.raises(WorkspaceError) as err:
        ws.get_simultaneous(((GROWTH_GRANULARITY,), torch.float32), owner="my_op")
    msg = str(err.value)
    assert "locked" in msg and "my_op" in msg
    assert str(4 * GROWTH_GRANULARITY) in msg and str(GROWTH_GRANULARITY) in msg, "required and current bytes"
    assert "test_workspace.py:" in msg, "the caller's file:line"
    ws.unlock()
    ws.get_simultaneous(((GROWTH_GRANULARITY,), torch.float32))


def test_locked_context_restores_state():
    ws = WorkspaceManager(CPU)
    with ws.locked():
        assert ws.is_locked
        with pytest.raises(WorkspaceError):
            ws.reserve(nbytes=5)
    assert not ws.is_locked
    ws.reserve(nbytes=5)


def test_fake_mode_calls_raise():
    ws = WorkspaceManager(CPU)
    ws.reserve(nbytes=100)
    with FakeTensorMode():
        with pytest.raises(WorkspaceError, match="FakeTensorMode"):
            ws.get_simultaneous(((4,), torch.float32), owner="fake_op")
        with pytest.raises(WorkspaceError, match="FakeTensorMode"):
            ws.reserve(nbytes=10)
        with pytest.raises(WorkspaceError, match="FakeTensorMode"):
            current_workspace_manager("meta")  # a new manager would be created


def test_stats_count_requests_per_owner_and_peak():
    ws = WorkspaceManager(CPU)
    ws.get_simultaneous(((100,), torch.float32), owner="a")
    ws.get_simultaneous(((100,), torch.float32), owner="a")
    ws.get_simultaneous(((10,), torch.float32), ((10,), torch.float32), owner="b")
    s = ws.stats()
    assert s.requests == {"a": 2, "b": 1}
    assert s.peak_request_bytes == 400
    assert s.size_bytes == GROWTH_GRANULARITY and s.grow_count == 1 and not s.locked


def test_reserve_sizes_for_a_later_request_exactly():
    ws = WorkspaceManager(CPU)
    specs = (((3000, 7), torch.float32), ((5,), torch.int64), ((1 << 20,), torch.uint8))
    ws.reserve(*specs)
    ws.lock()
    ws.get_simultaneous(*specs)  # no growth needed, so no error while locked
    assert ws.stats().grow_count == 1


def test_zero_sized_requests():
    ws = WorkspaceManager(CPU)
    (a,) = ws.get_simultaneous(((0, 5), torch.float32))
    assert a.shape == (0, 5)
    assert ws.size_bytes == 0


def test_bad_requests_are_refused():
    ws = WorkspaceManager(CPU)
    with pytest.raises(WorkspaceError):
        ws.get_simultaneous(((-1,), torch.float32))
    with pytest.raises(WorkspaceError):
        ws.get_simultaneous(((4,), "float32"))


def test_managers_are_per_device_and_per_lane():
    main = current_workspace_manager("cpu")
    assert current_workspace_manager(torch.device("cpu")) is main
    with workspace_lane(1):
        other = current_workspace_manager("cpu")
        assert other is not main and other.lane == 1
        with workspace_lane(2):
            assert current_workspace_manager("cpu").lane == 2
        assert current_workspace_manager("cpu") is other
    assert current_workspace_manager("cpu") is main
    (x,) = main.get_simultaneous(((256,), torch.float32))
    (y,) = other.get_simultaneous(((256,), torch.float32))
    assert x.data_ptr() != y.data_ptr(), "lanes have their own arenas"


def test_lanes_are_context_local_across_threads():
    seen = {}

    def worker(lane):
        with workspace_lane(lane):
            seen[lane] = current_workspace_manager("cpu").lane

    threads = [threading.Thread(target=worker, args=(i,)) for i in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {3: 3, 4: 4}
    assert current_workspace_manager("cpu").lane == 0


def test_debug_logging_reports_growth(caplog):
    import logging

    ws = WorkspaceManager(CPU)
    logger = logging.getLogger("graphsafe.workspace")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="graphsafe.workspace"):
            ws.get_simultaneous(((10,), torch.float32), owner="logged_op")
    finally:
        logger.setLevel(old)
    assert any("logged_op" in r.getMessage() and "grow" in r.getMessage() for r in caplog.records)


def test_debug_env_var_enables_logging_in_a_fresh_process():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from graphsafe.workspace import WorkspaceManager\n"
        "WorkspaceManager(torch.device('cpu')).get_simultaneous(((10,), torch.float32), owner='env_op')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**__import__("os").environ, "GRAPHSAFE_DEBUG_WORKSPACE": "1"}
    )
    assert out.returncode == 0, out.stderr
    assert "env_op" in out.stderr and "grow" in out.stderr


# -- GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_growth_is_refused_while_capturing_and_after_capture():
    ws = WorkspaceManager(torch.device("cuda", torch.cuda.current_device()))
    ws.reserve(((1024,), torch.float32))
    x = torch.ones(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    error = None
    with torch.cuda.graph(graph):
        (buf,) = ws.get_simultaneous(((1024,), torch.float32), owner="captured_op")
        buf.copy_(x * 2)
        try:
            ws.get_simultaneous(((GROWTH_GRANULARITY,), torch.float32), owner="growing_op")
        except WorkspaceError as err:
            error = err
    assert error is not None and "capturing" in str(error) and "growing_op" in str(error)
    graph.replay()
    torch.cuda.synchronize()
    assert buf.eq(2).all()
    assert ws.stats().captured
    with pytest.raises(WorkspaceError, match="used inside a CUDA graph capture"):
        ws.reserve(nbytes=4 * GROWTH_GRANULARITY)
    del graph
    ws.forget_captures()
    ws.reserve(nbytes=4 * GROWTH_GRANULARITY)


@pytest.mark.gpu
def test_cuda_steady_state_allocates_nothing():
    ws = WorkspaceManager(torch.device("cuda", torch.cuda.current_device()))
    specs = (((4096,), torch.float32), ((64, 64), torch.bfloat16), ((17,), torch.int32))
    ws.get_simultaneous(*specs)
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(100):
        ws.get_simultaneous(*specs)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_hold_places_nested_requests_after_held_views():
    ws = WorkspaceManager(CPU)
    ws.reserve(nbytes=1 << 16)
    (outer,) = ws.get_simultaneous(((100,), torch.float32), owner="composite")
    outer.fill_(3.0)
    with ws.hold(outer):
        inner, other = ws.get_simultaneous(((50,), torch.float32), ((7,), torch.int64), owner="nested")
        inner.fill_(-1.0)
        other.fill_(5)
        lo, hi = _span(outer)
        for v in (inner, other):
            start, end = _span(v)
            assert start >= hi and (start - ws._arena.data_ptr()) % ALIGNMENT == 0
        # The same nested request again hits its own cached layout.
        again = ws.get_simultaneous(((50,), torch.float32), ((7,), torch.int64), owner="nested")
        assert again[0].data_ptr() == inner.data_ptr()
    assert outer.eq(3.0).all(), "nested requests never overwrite held views"
    # After the hold, requests start at the arena's beginning again.
    (after,) = ws.get_simultaneous(((50,), torch.float32))
    assert after.data_ptr() == outer.data_ptr()


def test_growth_is_refused_while_views_are_held():
    ws = WorkspaceManager(CPU)
    (outer,) = ws.get_simultaneous(((16,), torch.float32))
    with ws.hold(outer):
        with pytest.raises(WorkspaceError, match="held"):
            ws.get_simultaneous(((GROWTH_GRANULARITY,), torch.float32), owner="nested")
    ws.get_simultaneous(((GROWTH_GRANULARITY,), torch.float32))  # fine once released


def test_hold_rejects_foreign_tensors():
    ws = WorkspaceManager(CPU)
    ws.reserve(nbytes=1024)
    with pytest.raises(WorkspaceError, match="views returned by this manager"):
        with ws.hold(torch.empty(8)):
            pass
