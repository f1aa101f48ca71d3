"""The workspace guards of the debug switch (`graphsafe.debug_checks`,
GRAPHSAFE_DEBUG_CHECKS=1): the bytes after each view an op call is handed are filled with a
pattern and checked when the call ends, so a kernel writing past its view, or a view
reserved smaller than what a kernel writes into it, fails on any device (on a GPU the
write would land in the arena's alignment padding or the next region and pass silently).

Covered: the guard layout and its fallback in a locked arena, requests that alias
(sequential requests, `hold`), an op that raises, growth inside a guarded call, the
dispatcher and `OpSpec.runner` entering a scope per call only while the switch is on,
and the aiter MLA adapter's workspace on the CPU stand-in. Registry-wide, every op's every
backend runs guarded in `tests/test_contract.py::test_launch_fits_the_workspace_reserved_from_shapes`.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.backends import device_types_here
from graphsafe.errors import WorkspaceError
from graphsafe.testing import case_for
from graphsafe.testing import contract as C
from graphsafe.workspace import current_workspace_manager
from graphsafe.workspace.manager import GUARD_BYTES, GUARD_PATTERN, WorkspaceManager, guarded

DEVICES = device_types_here()
I32, F32 = torch.int32, torch.float32


def _arena_bytes(ws: WorkspaceManager, view: torch.Tensor, n: int) -> torch.Tensor:
    start = view.data_ptr() - ws._arena.data_ptr() + view.numel() * view.element_size()
    return ws._arena[start : start + n].cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_views_in_bounds_pass_and_the_bytes_after_each_view_hold_the_pattern(device):
    ws = WorkspaceManager(torch.device(device))
    with guarded("toy") as scope:
        a, b = ws.get_simultaneous(((64,), F32), ((5,), I32), owner="toy")  # 256 bytes: no padding after a
        assert b.data_ptr() - a.data_ptr() >= 256 + GUARD_BYTES, "a guard gap after a view of whole alignment units"
        for v in (a, b):
            assert bool((_arena_bytes(ws, v, GUARD_BYTES) == GUARD_PATTERN).all())
        a.fill_(1.0)
        b.fill_(-1)
        assert len(scope.guards) == 2
    assert scope.checked == 2 and not scope.guards


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_one_element_past_a_view_names_the_op_the_view_and_the_bytes(device):
    ws = WorkspaceManager(torch.device(device))
    with pytest.raises(WorkspaceError) as err:
        with guarded("toy"):
            _, b, _ = ws.get_simultaneous(((3,), F32), ((64,), I32), ((2,), F32), owner="toy_kernel")
            end = b.data_ptr() - ws._arena.data_ptr() + 64 * 4
            ws._arena[end : end + 4].fill_(0)  # b[64] = 0: one element past the view
    message = str(err.value)
    assert message.startswith(
        "graphsafe.toy: workspace overrun past view 1 of 3 of the workspace request by 'toy_kernel'"), message
    assert "[64], int32" in message and "4 of the 256 bytes after it were written, the first 0 bytes past" in message


def test_outside_a_guarded_call_views_are_the_cached_ones_and_nothing_is_filled():
    ws = WorkspaceManager(torch.device("cpu"))
    (a,) = ws.get_simultaneous(((3,), F32), owner="plain")
    ws._arena.zero_()
    (b,) = ws.get_simultaneous(((3,), F32), owner="plain")
    assert a.data_ptr() == b.data_ptr() and not bool(ws._arena.any())


def test_a_locked_arena_too_small_for_the_guard_layout_guards_the_alignment_padding():
    ws = WorkspaceManager(torch.device("cpu"))
    ws.reserve((((1 << 20) - 8,), torch.uint8))  # the arena is one granule: no room for a gap
    with ws.locked():
        with guarded("toy"):
            (x,) = ws.get_simultaneous((((1 << 20) - 8,), torch.uint8), owner="big")
            assert x.data_ptr() == ws._arena.data_ptr()
        with pytest.raises(WorkspaceError, match="overrun past view 0 of 1 of the workspace request by 'big'"):
            with guarded("toy"):
                (x,) = ws.get_simultaneous((((1 << 20) - 8,), torch.uint8), owner="big")
                ws._arena[-8:-7].fill_(7)  # x[len(x)]: inside the 8 bytes the layout leaves


def test_sequential_requests_alias_without_a_false_alarm_and_an_overrun_is_found_at_reuse():
    ws = WorkspaceManager(torch.device("cpu"))
    with guarded("toy") as scope:
        (a,) = ws.get_simultaneous(((10,), F32), owner="first")
        (b,) = ws.get_simultaneous(((300,), F32), owner="second")  # reuses a's bytes and its guard
        assert b.data_ptr() == a.data_ptr()
        b.fill_(3.0)
        assert scope.checked == 1
    with pytest.raises(WorkspaceError, match="overrun past view 0 of 1 of the workspace request by 'first'"):
        with guarded("toy"):
            (a,) = ws.get_simultaneous(((10,), F32), owner="first")
            ws._arena[40:41].fill_(0)
            ws.get_simultaneous(((300,), F32), owner="second")  # checked before it may overwrite


def test_held_views_and_nested_requests():
    """A composite's held views stay guarded below the nested requests; an overrun of them
    is found when the nested request starts, before it could hide it."""
    ws = WorkspaceManager(torch.device("cpu"))
    ws.reserve(nbytes=1 << 20)
    with guarded("composite"):
        (held,) = ws.get_simultaneous(((8, 10), F32), owner="composite")
        held.fill_(1.0)
        with ws.hold(held):
            (inner,) = ws.get_simultaneous(((100,), I32), owner="nested")
            inner.fill_(5)
            assert inner.data_ptr() >= held.data_ptr() + held.numel() * 4
    with pytest.raises(WorkspaceError, match="overrun past view 0 of 1 of the workspace request by 'composite'"):
        with guarded("composite"):
            (held,) = ws.get_simultaneous(((8, 10), F32), owner="composite")
            ws._arena[320:324].fill_(0)  # held[8, 0]
            with ws.hold(held):
                ws.get_simultaneous(((100,), I32), owner="nested")


def test_an_overrun_in_a_call_that_raises_is_reported_chained_to_its_error():
    ws = WorkspaceManager(torch.device("cpu"))
    with pytest.raises(WorkspaceError) as err:
        with guarded("toy"):
            (a,) = ws.get_simultaneous(((4,), I32), owner="toy")
            ws._arena[16:20].fill_(1)
            raise IndexError("the consumer read past its buffer")
    assert isinstance(err.value.__cause__, IndexError)
    with pytest.raises(IndexError):
        with guarded("toy"):
            ws.get_simultaneous(((4,), I32), owner="toy")
            raise IndexError("no overrun: the op's own error")


def test_growth_inside_a_guarded_call_checks_the_old_arena_first():
    ws = WorkspaceManager(torch.device("cpu"))
    with pytest.raises(WorkspaceError, match="overrun past view 0 of 1 of the workspace request by 'small'"):
        with guarded("toy"):
            ws.get_simultaneous(((4,), I32), owner="small")
            ws._arena[16:17].fill_(1)
            ws.get_simultaneous(((1 << 20,), I32), owner="large")  # grows: the old arena is freed


# -- through the registry ----------------------------------------------------------------
def _sparse_mla_args(device: str, backend: str):
    """Inputs on which `backend` takes scratch here: the first of the example, the edge cases
    and (on a GPU) the realistic shapes whose call asks the workspace for it (the CPU's
    example splits the keys; on an H200 its kernel needs no partials, a longer top-k does)."""
    spec, case = graphsafe.get_op("sparse_mla"), case_for("sparse_mla")
    sets = [case.example, *case.edge_cases] + (list(case.gpu_examples) if device == "cuda" else [])
    requests = lambda: current_workspace_manager(device).stats().requests.get("sparse_mla", 0)  # noqa: E731
    for i, params in enumerate(sets):
        args = case.inputs(params, device, i)
        before = requests()
        with graphsafe.use_backend(backend, ops=["sparse_mla"]):
            spec.overload(*C.clone_args(args))
        if requests() > before:
            return args
    pytest.fail(f"no sparse_mla input of its case takes scratch on {device} with {backend}")


def _plant_overrun(monkeypatch):
    """Make every workspace request of `sparse_mla` write one float32 past its last view
    right after handing it out (an overrunning kernel, on any backend that takes scratch)."""
    from graphsafe.workspace import manager as wm

    original = wm.WorkspaceManager._get_guarded

    def overrunning(self, specs, owner):
        views = original(self, specs, owner)
        if owner == "sparse_mla" and views:
            last = views[-1]
            end = last.data_ptr() - self._arena.data_ptr() + last.numel() * last.element_size()
            self._arena[end : end + 4].fill_(0)
        return views

    monkeypatch.setattr(wm.WorkspaceManager, "_get_guarded", overrunning)


@pytest.mark.parametrize("device", DEVICES)
def test_the_debug_switch_guards_every_op_call(device, monkeypatch):
    """With the switch on, the dispatcher and `OpSpec.runner` guard each call; off, nothing
    is guarded (the planted overrun goes unseen)."""
    spec = graphsafe.get_op("sparse_mla")
    backends = [b for b in spec.available_backends(device) if spec.backends[b].workspace is not None]
    if not backends:
        pytest.skip(f"no backend of sparse_mla with scratch runs on {device} here")
    backend = backends[0]
    args = _sparse_mla_args(device, backend)
    _plant_overrun(monkeypatch)
    with graphsafe.use_backend(backend, ops=["sparse_mla"]):
        spec.overload(*C.clone_args(args))  # off: no scope, the plain path
        assert current_workspace_manager(device).stats().requests.get("sparse_mla"), "the call takes scratch"
        with graphsafe.debug_checks(True):
            with pytest.raises(WorkspaceError, match=r"^graphsafe\.sparse_mla: workspace overrun past view"):
                spec.overload(*C.clone_args(args))
            with pytest.raises(WorkspaceError, match=r"^graphsafe\.sparse_mla: workspace overrun past view"):
                spec.runner(backend)(*C.clone_args(args))
        monkeypatch.undo()
        with graphsafe.debug_checks(True):
            spec.overload(*C.clone_args(args))  # in bounds: passes


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla"])
def test_aiter_mla_workspace_holds_what_its_kernels_write(aiter_standin, arch, op):
    """The aiter MLA adapter's token CSR (kernels/triton_aiter_csr.py writes `kv_indptr`,
    rows + 1 entries, among others) fits the views `_csr_specs` reserves: on a GPU a view
    one entry short passes silently (the write lands in the alignment padding); guarded, it
    fails on the CPU stand-in too, before aiter's own length check."""
    aiter_standin(arch)
    case = case_for(op)
    base = case.example
    params = {**base, "R": 512, "P": 64, "H": 16, "dtype": torch.bfloat16, "strided": False}
    args = case.inputs(params, "cpu", 3)
    spec = graphsafe.get_op(op)
    assert spec.support("aiter", *args), spec.support("aiter", *args).reason
    with graphsafe.debug_checks(True):
        out = C.run_backend(spec, "aiter", C.clone_args(args))
    expected = C.run_backend(spec, "reference", C.clone_args(args))
    case.compare(expected, out, args, args, params)
