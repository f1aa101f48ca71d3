"""Public testing helpers: hypothesis strategies per op, `opcheck_all`, `no_sync`, and
the contract runners the test-suite and `python -m graphsafe check` share.
"""

from graphsafe.testing.cases import BadInput, OpCase, all_cases, case_for
from graphsafe.testing.contract import (
    CONTRACT_TEST_UTILS,
    clone_args,
    fake_outputs,
    opcheck_all,
    opcheck_op,
    run_backend,
)
from graphsafe.testing.strategies import op_inputs, op_params
from graphsafe.testing.sync import no_sync

__all__ = [
    "BadInput",
    "CONTRACT_TEST_UTILS",
    "OpCase",
    "all_cases",
    "case_for",
    "clone_args",
    "fake_outputs",
    "no_sync",
    "op_inputs",
    "op_params",
    "opcheck_all",
    "opcheck_op",
    "run_backend",
]
