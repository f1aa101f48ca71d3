"""Triton backend of the per-row top-k ops: the host side (records, prepare, runners).

`prepare_top_k_per_row_*(call)` take the call signature's choice once (`plan.choose_*`:
nothing to do, a fill of -1, decode in one launch, or the two-launch plan; its geometry
and scratch) and bind its kernels (`graphsafe.launch.bind`): the one-launch decode kernel
(kernels/triton_rowwise.py) or the bound and final launches (kernels/triton_two_launch.py);
those modules' docstrings describe the algorithms. The runner they return takes its
scratch from the workspace manager (exactly the worst case the records declare) and
launches. Kernel modules are imported when a signature is first bound, never at import
time: `import graphsafe` does not import triton.
"""

from __future__ import annotations

import torch

from graphsafe.device_info import is_hip
from graphsafe.launch import bind
from graphsafe.ops.topk import plan as _plan
from graphsafe.ops.topk.plan import NMETA, SEGW, workspace_specs, workspace_specs_decode
from graphsafe.registry import Backend, get_op
from graphsafe.workspace import current_workspace_manager


# -- binding ------------------------------------------------------------------------
def vector_loads(logits) -> bool:
    """Whether the one-launch kernel may read the rows 16 bytes at a time: every row
    starts 16-byte aligned and holds whole groups of 4 (a group that starts before a
    row's end then ends inside the row's storage)."""
    return logits.data_ptr() % 16 == 0 and _whole_groups(logits)


def _whole_groups(logits) -> bool:
    """The part of `vector_loads` a call signature fixes (the row stride and width)."""
    return logits.stride(0) % 4 == 0 and logits.shape[1] % 4 == 0


def bind_rowwise(logits, next_n, indices, topk, meta_stride, cand_stride, cfg, until=9):
    """The whole decode top-k in one launch, one program a row (`_rowwise_kernel`), bound
    to a call signature: returns `launch(logits, seq_lens, indices, meta, cand)`. Scratch:
    `meta` int32 [rows, >= cfg.warps, NMETA] (each warp's counts, read by tests), rows
    `meta_stride` apart, and `cand` int64 [rows, >= cfg.slots] (the warps' regions), rows
    `cand_stride` apart. `until` < 5 runs a prefix of the kernel (profiles,
    `_rowwise_kernel`'s UNTIL: the indices it leaves are not valid).

    16-byte loads need a 16-byte aligned logits pointer, which the signature does not
    fix: where the rows allow them, both variants are bound and each call picks one."""
    from graphsafe.ops.topk.kernels.triton_rowwise import _rowwise_kernel

    rows, width = logits.shape
    assert meta_stride >= NMETA * cfg.warps, "meta scratch smaller than the plan"
    assert cand_stride >= cfg.slots, "candidate scratch smaller than the plan"
    assert cfg.per_thread % 4 == 0, "a step's 16-byte loads fill groups of 4 registers"

    def bound(vec: bool):
        # Tensor placeholders (only their device is read): seq_lens, cand, meta.
        return bind(
            _rowwise_kernel, (rows,),
            logits, logits.stride(0), logits, next_n, width, topk, indices, indices.stride(0), indices.shape[1],
            logits, cand_stride, logits, meta_stride,
            S=32 * cfg.warps * cfg.samples_per_thread, Z=cfg.z, RETRY_Z=cfg.retry_z, E=cfg.per_thread, NW=cfg.warps,
            CAPW=cfg.slots_per_warp, LBLOCK=1024, VEC=vec,
            ASM=logits.is_cuda and not is_hip(logits.device), UNTIL=until, num_warps=cfg.warps,
        )

    scalar = bound(False)
    if not _whole_groups(logits):

        def launch(logits, seq_lens, indices, meta, cand) -> None:
            scalar(logits, seq_lens, indices, cand, meta)

        return launch
    vector = bound(True)

    def launch(logits, seq_lens, indices, meta, cand) -> None:
        (scalar if logits.data_ptr() % 16 else vector)(logits, seq_lens, indices, cand, meta)

    return launch


def _bind_two_launch(logits, indices, topk: int, next_n: int, choice: _plan.TopkChoice, strides):
    """`steps(logits, starts, ends, seq_lens, indices, meta, cand)`: the bound and final
    launches of `choice.plan`, the scratch rows `strides` apart."""
    from graphsafe.ops.topk.kernels.triton_two_launch import _bound_kernel, _final_kernel

    rows, width = logits.shape
    plan = choice.plan
    # Tensor placeholders (only their device is read): starts, ends, seq_lens, meta, cand.
    t = logits
    common = (logits, logits.stride(0), t, t, t, next_n, width, topk)
    bound = bind(
        _bound_kernel, (rows * plan.p1,),
        *common, t, strides[0], t, strides[1],
        P1=plan.p1, BJ=plan.bj, DP=plan.dp, REG=plan.reg, SEGW=SEGW, MARGIN=plan.margin, DECODE=choice.decode,
        SC=choice.bound_columns, TUPLE=logits.is_cuda,  # (native sums under the interpreter: same values)
        num_warps=choice.bound_warps,
    )
    final = bind(
        _final_kernel, (rows,),
        *common, indices, indices.stride(0), indices.shape[1], t, strides[0], t, strides[1],
        P1=plan.p1, REG=plan.reg, IN_REGS=plan.in_registers, LBLOCK=choice.lblock,
        DECODE=choice.decode, SC=choice.final_columns, TUPLE=logits.is_cuda,
        num_warps=choice.final_warps,
    )

    def steps(logits, starts, ends, seq_lens, indices, meta, cand) -> None:
        bound(logits, starts, ends, seq_lens, meta, cand)
        final(logits, starts, ends, seq_lens, indices, meta, cand)

    return steps


def _nothing(*tensors) -> None:
    return None


def _fill_indices(logits, starts, ends, seq_lens, indices, meta, cand) -> None:
    indices.fill_(-1)


def _bind(call, next_n: int, choice: _plan.TopkChoice, scratch=None):
    """`choice` bound: `(specs, strides, steps)`. `steps(logits, starts, ends, seq_lens,
    indices, meta, cand)` launches the kernels; `specs` is the scratch `(meta, cand)` it
    takes from the workspace (`choice.scratch`; None: it takes none) and `strides` their
    row strides, bound into the launches.

    `scratch` (a caller's own `(meta, cand)`, tests) is read for its shapes and strides
    only: the runner must then be called with the same views."""
    if choice.kernel == "none":
        return None, None, _nothing
    if choice.kernel == "fill":
        return None, None, _fill_indices
    if scratch is None:
        specs = choice.scratch
        (meta_shape, _), (cand_shape, cand_dtype) = specs
        # Workspace views are contiguous.
        strides = (meta_shape[1] * NMETA, cand_shape[1])
    else:
        specs = None
        meta, cand = scratch
        assert meta.stride(-1) == 1 and meta.stride(1) == NMETA, "meta scratch: [rows, programs, NMETA] rows"
        meta_shape, cand_shape, cand_dtype = tuple(meta.shape), tuple(cand.shape), cand.dtype
        strides = (meta.stride(0), cand.stride(0))
    assert meta_shape[1] >= choice.programs and cand_shape[1] >= choice.slots and cand_dtype == torch.int64, (
        "scratch smaller than the plan")
    if choice.kernel == "rowwise":
        launch = bind_rowwise(call.logits, next_n, call.indices, call.topk, strides[0], strides[1], choice.rowwise)

        def steps(logits, starts, ends, seq_lens, indices, meta, cand) -> None:
            launch(logits, seq_lens, indices, meta, cand)

        return specs, strides, steps
    return specs, strides, _bind_two_launch(call.logits, call.indices, call.topk, next_n, choice, strides)


def _scratch_source(specs, strides, device: torch.device, owner: str):
    """`take(scratch) -> (meta, cand)` of a prepared call: the workspace's views (specs
    from the choice), or the caller's own `scratch` (tests), which must have the strides
    the launches were bound with; (None, None) where the choice needs none."""
    if strides is None:
        return lambda scratch: (None, None)

    def take(scratch):
        if scratch is None:
            return current_workspace_manager(device).get_simultaneous(*specs, owner=owner)
        assert (scratch[0].stride(0), scratch[1].stride(0)) == strides, "run with the scratch it was prepared with"
        return scratch

    return take


# -- the ops ------------------------------------------------------------------------
def _prefill_runner(call, choice: _plan.TopkChoice, scratch=None):
    specs, strides, steps = _bind(call, 1, choice, scratch)
    take = _scratch_source(specs, strides, call.logits.device, "top_k_per_row_prefill")

    def run(logits, row_starts, row_ends, indices, topk, scratch=None) -> None:
        meta, cand = take(scratch)
        steps(logits, row_starts, row_ends, row_starts, indices, meta, cand)

    return run


def _decode_runner(call, choice: _plan.TopkChoice, scratch=None):
    specs, strides, steps = _bind(call, call.next_n, choice, scratch)
    take = _scratch_source(specs, strides, call.logits.device, "top_k_per_row_decode")

    def run(logits, next_n, seq_lens, indices, topk, scratch=None) -> None:
        meta, cand = take(scratch)
        steps(logits, seq_lens, seq_lens, seq_lens, indices, meta, cand)

    return run


def prepare_top_k_per_row_prefill(call):
    """The runner of one call signature: its choice and launches are fixed here."""
    return _prefill_runner(call, _plan.choose_top_k_per_row_prefill(call))


def prepare_top_k_per_row_decode(call):
    """The runner of one call signature (see `prepare_top_k_per_row_prefill`)."""
    return _decode_runner(call, _plan.choose_top_k_per_row_decode(call))


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk, *, scratch=None, **overrides) -> None:
    """Choose, prepare and run once, with the plan overrides of `plan.choose` and/or a
    caller's own `scratch` `(meta, cand)` (sized by `plan.specs`): tests and tuning."""
    call = get_op("top_k_per_row_prefill").call(logits, row_starts, row_ends, indices, topk)
    choice = _plan.choose_top_k_per_row_prefill(call, **overrides)
    _prefill_runner(call, choice, scratch)(logits, row_starts, row_ends, indices, topk, scratch)


def top_k_per_row_decode(logits, next_n, seq_lens, indices, topk, *, scratch=None, **overrides) -> None:
    """Choose, prepare and run once (see `top_k_per_row_prefill`)."""
    call = get_op("top_k_per_row_decode").call(logits, next_n, seq_lens, indices, topk)
    choice = _plan.choose_top_k_per_row_decode(call, **overrides)
    _decode_runner(call, choice, scratch)(logits, next_n, seq_lens, indices, topk, scratch)


# -- the records --------------------------------------------------------------------
TOP_K_PER_ROW_PREFILL = Backend(name="triton", prepare=prepare_top_k_per_row_prefill, workspace=workspace_specs)
TOP_K_PER_ROW_DECODE = Backend(name="triton", prepare=prepare_top_k_per_row_decode, workspace=workspace_specs_decode)
