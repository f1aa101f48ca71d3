"""Input validation shared by fake impls and real impls.

Every check reads metadata only (shape, dtype, device, strides): it is safe under
FakeTensorMode and with symbolic shapes, and the real impls call the very same
functions, so the fake and the real op reject the same inputs with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphsafe.errors import InputError

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn,)
def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def fail(op: str, arg: str, expected: str, got: object) -> None:
    raise InputError(f"graphsafe.{op}: argument '{arg}' must be {expected}, got {got}")


def tensor(
    op: str,
    arg: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that `t` is a tensor of one of `dtypes`, with `ndim` dims, on `device`."""
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a Tensor", type(t).__name__)
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, arg, f"of dtype {_dtype_names(dtypes)}", str(t.dtype).removeprefix("torch."))
    if ndim is not None and t.dim() != ndim:
        fail(op, arg, f"{ndim}-D", f"shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(op, arg, f"on device {device} (the device of the op's first tensor)", t.device)
    return t


def shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[object], names: str) -> None:
    """Check `t.shape` against `expected`; entries that are None are free.

    `names` spells the expected shape symbolically for the message, e.g. "[T, R]".
    """
    got = tuple(t.shape)
    if len(got) != len(expected) or any(
        e is not None and g != e for g, e in zip(got, expected)
    ):
        want = ", ".join("?" if e is None else str(e) for e in expected)
        fail(op, arg, f"of shape {names} = [{want}]", f"shape {list(got)}")


def same_dtype(op: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, arg, f"of the same dtype as '{ref_arg}' ({ref.dtype})", t.dtype)


def last_dim_contiguous(op: str, arg: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(op, arg, "contiguous in its last dimension (stride 1)", f"strides {t.stride()}")


def contiguous(op: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail(op, arg, "contiguous", f"strides {t.stride()} for shape {tuple(t.shape)}")


def positive(op: str, arg: str, value: int) -> None:
    if value <= 0:
        fail(op, arg, "a positive int", value)


def fp8_cache_scale(op: str, arg: str, scale: object, cache: torch.Tensor, device: torch.device, when: str) -> None:
    """`scale` must be a 1-element float32 tensor when `cache` is float8_e4m3fn (ignored
    otherwise); `when` completes the message, e.g. "when 'kv_cache' is float8_e4m3fn"."""
    if cache.dtype not in FP8_DTYPES:
        return
    if scale is None:
        fail(op, arg, f"a float32 tensor of 1 element {when}", None)
    tensor(op, arg, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() != 1:
        fail(op, arg, "a tensor of 1 element", f"shape {tuple(scale.shape)}")
