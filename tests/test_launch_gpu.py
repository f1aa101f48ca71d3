"""graphsafe.launch on a real GPU and the installed Triton: the bound launch adopts the
compiled kernel, gives the results of `kernel[grid]` on fresh inputs every call, falls
back for misaligned tensors, and captures into CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import triton

from graphsafe.launch import bind, plain_launch_count
from test_launch import _axpy_kernel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 100, 4096 + 3])
def test_bound_launch_adopts_the_compiled_kernel_and_is_exact(n, dtype):
    x = torch.randn(2 * n, device="cuda", dtype=dtype)[::2]
    y, out = torch.randn(n, device="cuda", dtype=dtype), torch.empty(n, device="cuda", dtype=dtype)
    launch = bind(_axpy_kernel, (triton.cdiv(n, 256),), x, y, out, n, 1.5, 2, BLOCK=256, SHIFT=0.25, num_warps=4)
    for i in range(4):
        x2 = torch.randn(2 * n, device="cuda", dtype=dtype)[::2]
        y2 = torch.randn(n, device="cuda", dtype=dtype)
        out2 = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
        expected = torch.empty_like(out2)
        _axpy_kernel[(triton.cdiv(n, 256),)](x2, y2, expected, n, 1.5, 2, BLOCK=256, SHIFT=0.25, num_warps=4)
        before = plain_launch_count()
        launch(x2, y2, out2)
        torch.cuda.synchronize()
        assert torch.equal(out2, expected)
        if i:
            assert plain_launch_count() == before, "calls after the first skip kernel[grid]"
    assert launch.state.fast
    # the Triton releases whose launcher was read take the C launch function directly
    assert launch.state.direct == triton.__version__.startswith(("3.6.",))


def test_misaligned_views_get_their_own_handle_and_stay_right():
    n = 64
    base = torch.randn(n + 1, device="cuda")
    y, out = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    launch = bind(_axpy_kernel, (1,), base[:n], y, out, n, 2.0, 1, BLOCK=64)
    launch(base[:n], y, out)
    launch(base[:n], y, out)
    assert launch.state.fast
    for i in range(3):  # 4-byte offset: Triton's aligned handle must not serve it
        base.normal_()
        before = plain_launch_count()
        launch(base[1:], y, out)
        torch.cuda.synchronize()
        assert plain_launch_count() == before + (i == 0), "the misaligned pattern compiles once, then is bound"
        torch.testing.assert_close(out, 2.0 * base[1:] + y)
    launch(base[:n], y, out)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * base[:n] + y)


def test_bound_launches_capture_into_a_cuda_graph():
    n = 1000
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    launch = bind(_axpy_kernel, (triton.cdiv(n, 128),), x, y, out, n, 3.0, 1, BLOCK=128)
    launch(x, y, out)
    launch(x, y, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(x, y, out)
    x.normal_(), y.normal_(), out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 3.0 * x + y)


def test_launch_on_another_current_device_is_guarded():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, y, out = (torch.randn(32, device="cuda:1") for _ in range(3))
    launch = bind(_axpy_kernel, (1,), x, y, out, 32, 2.0, 1, BLOCK=32)
    with torch.cuda.device(0):
        launch(x, y, out)
        launch(x, y, out)
    torch.cuda.synchronize(1)
    torch.testing.assert_close(out, 2.0 * x + y)
