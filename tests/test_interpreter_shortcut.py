"""graphsafe.testing.interpreter: nested @triton.jit calls skip the interpreter's redundant
re-patching; results, errors and the restored `triton.language` stay the interpreter's."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from graphsafe.testing import interpreter  # noqa: E402


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus(x, y):
    return _twice(x) + y  # nested two deep


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, FAIL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for _ in tl.range(0, 3):
        x = _plus(x, 1.0)
    if FAIL:
        tl.static_assert(BLOCK < 0, "planted failure")
    tl.store(out_ptr + offs, x, mask=offs < n)


def test_nested_calls_give_the_interpreters_results_and_restore_the_language():
    if not interpreter.install():
        pytest.skip(f"the shortcut is not installed on Triton {triton.__version__}")
    arange, store = tl.arange, tl.store
    x = torch.arange(10, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    _kernel[(1,)](x, out, 10, BLOCK=16, FAIL=False)
    assert torch.equal(out, ((x * 2 + 1) * 2 + 1) * 2 + 1)
    assert tl.arange is arange and tl.store is store, "the launch's patches are restored"
    with pytest.raises(Exception, match="planted failure"):
        _kernel[(1,)](x, out, 10, BLOCK=16, FAIL=True)
    assert tl.arange is arange, "restored after a failing launch too"
    out.fill_(float("nan"))
    _kernel[(1,)](x, out, 10, BLOCK=16, FAIL=False)  # a launch after the failure patches afresh
    assert torch.equal(out, ((x * 2 + 1) * 2 + 1) * 2 + 1)
