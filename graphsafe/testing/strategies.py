"""Hypothesis strategies: valid inputs of every op, built from its test case."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from graphsafe.testing.cases import case_for


def op_params(op: str) -> st.SearchStrategy[dict[str, Any]]:
    """Shape parameters of `op` (small: CPU-friendly)."""
    return case_for(op).params()


def op_inputs(op: str, device: torch.device | str = "cpu") -> st.SearchStrategy[tuple]:
    """Fresh random, valid argument tuples for `op` on `device`.

        @given(graphsafe.testing.op_inputs("reshape_and_cache"))
        def test_mine(args): torch.ops.graphsafe.reshape_and_cache(*args)
    """
    case = case_for(op)
    seeds = st.integers(0, 2**31 - 1)
    return st.tuples(case.params(), seeds).map(lambda ps: case.inputs(ps[0], device, ps[1]))
