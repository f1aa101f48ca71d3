"""graphsafe: compile-safe attention and sparse-indexer ops for LLM inference.

Every op is a `torch.ops.graphsafe.*` op with a fake impl, so decode steps compile under
`torch.compile(fullgraph=True)` and capture into CUDA/HIP graphs; real impls draw scratch
memory from a shared per-device workspace manager.
"""

from graphsafe import ops
from graphsafe.debug import debug_checks
from graphsafe.errors import GraphsafeError, InputError, RegistrationError, WorkspaceError
from graphsafe.ops import *  # noqa: F403 - the public op functions (graphsafe.<op>)
from graphsafe.registry import get_op, ops as op_table, register_op, use_backend
from graphsafe.workspace import current_workspace_manager, workspace_lane

__version__ = "0.1.0"

__all__ = [
    "GraphsafeError",
    "InputError",
    "RegistrationError",
    "WorkspaceError",
    "current_workspace_manager",
    "debug_checks",
    "get_op",
    "op_table",
    "ops",
    "register_op",
    "use_backend",
    "workspace_lane",
    *ops.__all__,
]
