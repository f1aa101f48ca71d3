"""Result comparison for the contract tests: outputs and mutated arguments."""

from __future__ import annotations

from typing import Any

import torch

from graphsafe.backends import triton_interpreter_enabled

# (rtol, atol) per dtype for results that come from arithmetic; copies compare exactly.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    # One e4m3 step is 2^-3 relative: allow a one-step rounding difference. Triton's
    # CPU interpreter (3.9) drops the carry when fp32 -> e4m3 rounds up into the next
    # binade (31.8 -> 16 instead of 32), so under it a step of the binade below passes.
    torch.float8_e4m3fn: (0.5 if triton_interpreter_enabled() else 0.125, 2.0**-9),
}


def as_comparable(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.float()
    return t


def assert_same(expected: Any, actual: Any, what: str, exact: bool = False) -> None:
    """Recursively compare tensors (or tuples/lists of them) with dtype tolerances."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), f"{what}: structure differs"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{what}[{i}]", exact)
        return
    if expected is None:
        assert actual is None, f"{what}: expected None, got {type(actual).__name__}"
        return
    assert isinstance(actual, torch.Tensor), f"{what}: expected a Tensor, got {type(actual).__name__}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    e, a = as_comparable(expected).cpu(), as_comparable(actual).cpu()
    # fp8 results allow one e4m3 rounding step even when `exact`: Triton's CPU
    # interpreter converts fp32 -> e4m3 with another rounding than torch does.
    fp8 = expected.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if (exact and not fp8) or not e.dtype.is_floating_point:
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        rtol, atol = TOLERANCES.get(expected.dtype, (1e-5, 1e-5))
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def mutated_args(spec: Any, args: tuple) -> dict[str, Any]:
    """The mutated arguments of a call, by name."""
    names = list(spec.overload._schema.arguments)
    return {a.name: args[i] for i, a in enumerate(names) if a.name in spec.mutates_args and i < len(args)}


def default_compare(spec: Any, expected_out: Any, actual_out: Any, expected_args: tuple, actual_args: tuple, exact: bool = False) -> None:
    assert_same(expected_out, actual_out, f"{spec.name} output", exact)
    exp_mut, act_mut = mutated_args(spec, expected_args), mutated_args(spec, actual_args)
    for name in exp_mut:
        assert_same(exp_mut[name], act_mut[name], f"{spec.name} mutated '{name}'", exact)


def exact_compare(op: str):
    """An `OpCase.compare` for ops whose results are copies or integers: bit-exact
    (fp8 aside, see `assert_same`), outputs and mutated args."""

    def compare(expected, actual, expected_args, actual_args, params) -> None:
        from graphsafe.registry import get_op

        default_compare(get_op(op), expected, actual, expected_args, actual_args, exact=True)

    return compare
