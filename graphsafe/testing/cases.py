"""Test cases of the ops: how to draw valid inputs, how to compare results, which inputs
must be refused. One `OpCase` per registered op, in its family's
`graphsafe/ops/<family>/cases.py`; the contract tests iterate the registry and fail for an
op without one.

A case separates *shape parameters* (a small dict: T, block sizes, dtypes, ...) from the
*tensors* built from them with a seeded generator, so that hypothesis shrinks shapes,
the CLI and benchmarks reuse `make` at fixed parameters, and every draw is fresh random
data (never zeros; mutated outputs are pre-filled with random bytes so unwritten or
wrongly written elements show).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Params = dict[str, Any]
Args = tuple[Any, ...]


@dataclass(frozen=True)
class BadInput:
    """An input the op must refuse, in the fake and the real impl alike."""

    what: str  # human description, e.g. "kv_c of dtype int32"
    args: Args
    arg: str  # the argument the message must name
    match: str  # a regex the message must contain (after the op and arg names)


@dataclass(frozen=True)
class OpCase:
    op: str
    # Hypothesis strategy of shape parameters (built lazily: hypothesis is imported here only).
    params: Callable[[], Any]
    # Representative small parameters: CLI `check`, opcheck_all, quick tests.
    example: Params
    # Build fresh random inputs from parameters.
    make: Callable[[Params, torch.device, torch.Generator], Args]
    # Parameters small enough for Triton's CPU interpreter (defaults to `example`).
    interpreter_example: Params | None = None
    # compare(expected, actual, expected_args, actual_args, params) -> None; raises on mismatch.
    compare: Callable[..., None] | None = None
    # bad_inputs(device, generator) -> [BadInput, ...]
    bad_inputs: Callable[[torch.device, torch.Generator], Sequence[BadInput]] = lambda d, g: ()
    # Extra parameter sets that must always be tested (edge cases), on top of hypothesis.
    edge_cases: Sequence[Params] = field(default_factory=tuple)
    # Realistic shapes (DeepSeek, Llama) for the GPU tests; host ints must come from the
    # params alone, so two seeds of one params set can share a captured CUDA graph.
    gpu_examples: Sequence[Params] = field(default_factory=tuple)
    # -- what the op never reads, ids out of range, non-finite inputs --------------------
    # Each must be declared (the registry-wide contract test fails on None); the constants
    # below state "does not apply" explicitly.
    #
    # unread(params, args) -> [(arg_index, bool mask of that arg's shape), ...]: elements
    # of the inputs no backend may read (cache rows no request reaches, tokens past a
    # length, ...). The contract fills them with poison (NaN; 0xFF bytes for uint8; the
    # int minimum for ints) and requires every output bit-equal to the clean call.
    unread: Callable[[Params, Args], Sequence[tuple[int, torch.Tensor]]] | None = None
    # out_of_range(params, args, generator) -> (args_with_bad_ids, args_with_padding):
    # some ids replaced by values outside their range (huge, negative, one past the end),
    # and the same args with the documented padding value at those places. Every backend
    # must give bit-equal results on both, and agree with the reference on the first.
    out_of_range: Callable[[Params, Args, torch.Generator], tuple[Args, Args]] | None = None
    # nonfinite(params, args, generator) -> args with NaN and +-inf in elements the op reads.
    # Every backend must put NaN and +-inf at the same output places as the reference (the
    # docstring defines where) and agree elsewhere (`compare_nonfinite`, default: `compare`
    # on the finite elements).
    nonfinite: Callable[[Params, Args, torch.Generator], Args] | None = None
    compare_nonfinite: Callable[..., None] | None = None
    # workspace_args(params, args) -> (args, kwargs) of `OpSpec.workspace_specs` (the
    # op's public `*_workspace_specs` helper) for these inputs: the reservation from shapes
    # that a launch must fit (`contract.check_launch_fits_the_reservation`). Required for
    # an op with a backend that takes scratch (a record with `workspace`); None otherwise.
    workspace_args: Callable[[Params, Args], tuple[tuple, dict]] | None = None
    # -- what a backend's `supports` predicate must get right ---------------------------
    # options: {argument: switch(params, present) -> params or None}, one switch for every
    # optional argument of the op (a stub parameter with a default): parameters whose
    # inputs pass the argument (present: a value other than its default) or leave it at
    # its default (absent); None where these params cannot have it so. Required for an op
    # with a backend that has a `supports` predicate (test_contract checks it): the
    # predicate contract (`contract.check_supports_with_each_option`) switches each option
    # on and off over the draws and edge cases, so a predicate accepting an option its
    # adapter drops is caught. `flag(key)` and `value(key, absent, present)` make switches.
    options: Mapping[str, Callable[[Params, bool], Params | None]] = field(default_factory=dict)
    # Small parameter sets of the shapes a vendor adapter serves where the draws and edge
    # cases never go (aiter's MLA kernels: head dim 576 at 16 or 128 heads): the predicate
    # contract runs them too, with each option switched.
    adapter_examples: Sequence[Params] = field(default_factory=tuple)

    def inputs(self, params: Params, device: torch.device | str = "cpu", seed: int = 0) -> Args:
        device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return self.make(params, device, gen)


def flag(key: str) -> Callable[[Params, bool], Params]:
    """An `OpCase.options` switch for an option the params turn on with `params[key] = True`."""

    def switch(params: Params, present: bool) -> Params:
        return {**params, key: present}

    switch.__name__ = f"flag({key!r})"
    return switch


def value(key: str, absent: Any, present: Any) -> Callable[[Params, bool], Params]:
    """An `OpCase.options` switch for an option the params hold in `params[key]`: `absent`
    (its default) off; on, the value the params hold or, where that is `absent`, `present`."""

    def switch(params: Params, on: bool) -> Params:
        if not on:
            return {**params, key: absent}
        return params if params.get(key, absent) != absent else {**params, key: present}

    switch.__name__ = f"value({key!r}, {absent!r}, {present!r})"
    return switch


def reads_every_element(params: Params, args: Args) -> Sequence[tuple[int, torch.Tensor]]:
    """`OpCase.unread` of an op that reads all of every input."""
    return ()


def takes_no_ids(params: Params, args: Args, gen: torch.Generator) -> None:
    """`OpCase.out_of_range` of an op without index arguments."""
    return None


def reads_no_floats(params: Params, args: Args, gen: torch.Generator) -> None:
    """`OpCase.nonfinite` of an op whose inputs hold no floating-point values."""
    return None


def assert_out_lse_close(expected, actual, out_tolerance: tuple[float, float],
                         lse_tolerance: tuple[float, float]) -> None:
    """An attention op's (out, lse) against the expected pair: shapes and dtypes (lse
    float32), out and lse within (rtol, atol), and the rows without a key (lse -inf) the
    same ones exactly."""
    (e_out, e_lse), (a_out, a_lse) = expected, actual
    assert a_out.shape == e_out.shape and a_out.dtype == e_out.dtype, "out: shape/dtype"
    assert a_lse.shape == e_lse.shape and a_lse.dtype == torch.float32, "lse: shape/dtype"
    rtol, atol = out_tolerance
    torch.testing.assert_close(a_out.float().cpu(), e_out.float().cpu(), rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    assert torch.equal(torch.isneginf(a_lse).cpu(), torch.isneginf(e_lse).cpu()), "lse: rows without a key differ"
    rtol, atol = lse_tolerance
    torch.testing.assert_close(a_lse.cpu(), e_lse.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"lse: {m}")


_CASES: dict[str, OpCase] = {}


def register_case(case: OpCase) -> OpCase:
    if case.op in _CASES:
        raise ValueError(f"a test case for {case.op!r} is registered twice")
    _CASES[case.op] = case
    return case


_loaded = False


def _load() -> None:
    """Import every op family's `cases` module; each registers its families' cases."""
    global _loaded
    if _loaded:
        return
    from graphsafe.ops import families

    for family in families():
        if importlib.util.find_spec(f"graphsafe.ops.{family}.cases") is not None:
            importlib.import_module(f"graphsafe.ops.{family}.cases")
    _loaded = True


def case_for(op: str) -> OpCase:
    _load()
    if op not in _CASES:
        raise KeyError(f"graphsafe op {op!r} has no test case (graphsafe/ops/<family>/cases.py)")
    return _CASES[op]


def all_cases() -> dict[str, OpCase]:
    _load()
    return dict(_CASES)
