"""aiter backend of the per-row top-k ops (ROCm; gfx942 and gfx950, see graphsafe.aiter_support).

Read against aiter v0.1.20-46-ge4048607a5 (commit e4048607a535ace3a2b51ded31b1c8c2d45c0879).
aiter's public entry points (aiter/ops/topk.py, plain Python wrappers around the compiled
`_top_k_per_row_prefill` / `_top_k_per_row_decode` of
csrc/kernels/topk_per_row_kernels.cu, built from HIP source for the device):

    top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows,
                          stride0, stride1, k=2048, stable=False)
    top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1,
                         k=2048, stable=False)

Older aiter releases have no `k` (the kernels are built for 2048). What we adapt:
* aiter writes a dense `[numRows, k]` int32 block (`out_idx + b * k`,
  radix_topk_one_block_kernel) whatever `indices`' strides. When `indices` is wider
  than `topk` or strided, aiter writes into workspace scratch and a small kernel copies
  it over (and writes the -1 columns past `topk`).
* The prefill kernel returns absolute columns; we localise them (`n - row_starts[m]`,
  -1 kept), as vLLM's ROCm path does after the same call.
* Row bounds are clipped to `[0, N]` first: aiter reads `logits + b * stride0 + rowStart`
  for `rowEnd - rowStart` values unclamped. The decode row ends
  `seq_lens[b] - next_n + i + 1` are precomputed per row and passed with `next_n = 1`
  (vLLM's ROCm call pattern), so aiter never reads past a row.
* Prefill passes `stable=True`: aiter then takes its one-block kernel (ascending
  positions, the smallest position first at ties). Without it, aiter may pick its
  multi-block kernel (`topk_use_mulblocks(numRows, stride0)`), whose zeroed scratch it
  allocates and caches itself per (device, stream, size) (aiter/ops/topk.py:
  get_topk_mb_workspace): inside a graph capture that buffer would be created on the
  capture stream. Decode always takes the one-block kernel.
Allocations aiter makes itself: the one-block kernel's scratch, `torch.empty` on every
call (aiter/ops/topk.py:get_topk_scratch_workspace); the public wrappers take no
workspace argument, so it cannot come from graphsafe's workspace manager (capturable:
the graph pool serves it). Our own scratch (clipped bounds, row ends, the dense block)
comes from the workspace manager.
The records' `supports` predicates (`supports_*`) hand what aiter cannot serve (another
architecture, non-float32 logits, a `topk` other than 2048 on an aiter without `k`, a
prefill without `stable`, empty shapes), with the reason, to the Triton backend, which
runs on ROCm too: decided once per call signature. `prepare_*` bind a runner to a signature
(`plan.choose_aiter_*`: aiter writes `indices` directly or into scratch); the two small
Triton kernels around the aiter call (kernels/triton_external.py) are imported there.
"""

from __future__ import annotations

import functools
import inspect

import torch

from graphsafe import aiter_support, device_info
from graphsafe.launch import bind
from graphsafe.ops.topk.plan import (
    aiter_workspace_specs,
    aiter_workspace_specs_decode,
    choose_aiter_top_k_per_row_decode,
    choose_aiter_top_k_per_row_prefill,
    pow2,
)
from graphsafe.registry import SUPPORTED, Backend, Support, declined
from graphsafe.workspace import current_workspace_manager


@functools.cache
def _entry(name: str):
    """(aiter function, its parameter names) or None when this aiter has no such function."""
    import aiter

    fn = getattr(aiter, name, None)
    if fn is None:
        return None
    try:
        params = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a compiled binding without a Python signature
        params = frozenset()
    return fn, params


# Prefill needs `stable` (the one-block kernel, see the module docstring).
_NEEDS = {"top_k_per_row_prefill": ("stable",), "top_k_per_row_decode": ()}


def _unusable(name: str, topk: int) -> str:
    """Why this aiter's `name` cannot serve `topk` ("" when it can)."""
    entry = _entry(name)
    if entry is None:
        return f"this aiter has no aiter.{name}"
    fn, params = entry
    missing = [p for p in _NEEDS[name] if p not in params]
    if missing:
        return (f"this aiter's {name} takes no {', '.join(repr(p) for p in missing)} argument "
                "(needed for its one-block kernel, see graphsafe/ops/topk/aiter.py): update aiter")
    if "k" not in params and topk != 2048:
        return f"this aiter's {name} takes no `k` (its kernels are built for topk = 2048); got topk = {topk}"
    return ""


def _served(name: str, logits, topk: int) -> Support:
    rows, width = logits.shape
    if not aiter_support.serves(name, logits.device):
        archs = "/".join(aiter_support.CAPABILITIES[name].archs)
        here = device_info.rocm_arch(logits.device) or f"{logits.device.type}, not a ROCm GPU"
        return declined(f"aiter serves {name} on {archs} only (graphsafe.aiter_support); this device is {here}")
    # aiter reads the logits as float* (no dtype check in its host code) and takes
    # stride0 as the row length and pitch (a [1, N] view may carry any row stride).
    if logits.dtype != torch.float32:
        return declined(f"aiter reads float32 logits only; got {logits.dtype}")
    if rows == 0 or width == 0:
        return declined(f"aiter needs at least one row and one column; logits has shape {list(logits.shape)}")
    if logits.stride(0) < width:
        return declined(f"aiter takes logits.stride(0) as the row pitch, which must be >= the width {width}; "
                        f"got {logits.stride(0)}")
    if topk <= 0:
        return declined(f"aiter needs topk >= 1; got topk = {topk}")
    why = _unusable(name, topk)
    return declined(why) if why else SUPPORTED


def supports_top_k_per_row_prefill(call) -> Support:
    """Whether aiter serves this call signature (else the Triton backend does), and why not."""
    return _served("top_k_per_row_prefill", call.logits, call.topk)


def supports_top_k_per_row_decode(call) -> Support:
    """Whether aiter serves this call signature (else the Triton backend does), and why not."""
    return _served("top_k_per_row_decode", call.logits, call.topk)


def _entry_of(name: str, topk: int):
    """(aiter function, takes `k`); prepare runs only where `supports` said yes."""
    why = _unusable(name, topk)
    if why:
        raise NotImplementedError(f"{name}: {why} (see supports_{name})")
    fn, params = _entry(name)
    return fn, "k" in params


def _nothing(*tensors) -> None:
    return None


def _bind_finish_external(indices, src_stride: int, topk: int, localize: bool):
    """`launch(src, indices, shift)`: indices[:, :topk] <- src (minus shift[r] where >= 0
    when `localize`), -1 after. `src` rows lie `src_stride` apart; without `localize`
    `shift` is not read (pass any tensor of the device). `indices` is a placeholder here
    (its shape and row stride are read)."""
    from graphsafe.ops.topk.kernels.triton_external import _finish_external_kernel

    rows, cols = indices.shape
    if rows == 0 or cols == 0:
        return _nothing
    blk = min(1024, pow2(cols))
    return bind(
        _finish_external_kernel, (rows, -(-cols // blk)),
        indices, src_stride, indices, indices.stride(0), indices, topk, cols,
        LOCALIZE=localize, BLOCK=blk,
    )


def _bind_decode_row_ends(seq_lens, rows: int, next_n: int, width: int):
    """`launch(seq_lens, ends)`: ends[r] = max(clamp(seq_lens[r // next_n], 0, width) - next_n
    + r % next_n + 1, 0) for r < rows (`seq_lens` is a placeholder here)."""
    from graphsafe.ops.topk.kernels.triton_external import _decode_row_ends_kernel

    if rows == 0:
        return _nothing
    return bind(_decode_row_ends_kernel, (-(-rows // 1024),), seq_lens, seq_lens, rows, next_n, width, BLOCK=1024)


def prepare_top_k_per_row_prefill(call):
    fn, takes_k = _entry_of("top_k_per_row_prefill", call.topk)
    logits, indices, topk = call.logits, call.indices, call.topk
    rows, width = logits.shape
    # aiter writes a contiguous [rows, topk] block: into indices when it is one.
    choice = choose_aiter_top_k_per_row_prefill(call)
    direct, specs = choice.direct, choice.scratch
    device, owner = logits.device, "top_k_per_row_prefill"
    stride0, stride1 = logits.stride()
    kwargs = {"k": topk} if takes_k else {}
    # Absolute columns -> positions relative to the clipped row start (the op's origin).
    finish = _bind_finish_external(indices, indices.stride(0) if direct else topk, topk, True)

    def run(logits, row_starts, row_ends, indices, topk) -> None:
        views = current_workspace_manager(device).get_simultaneous(*specs, owner=owner)
        lo, hi = views[0], views[1]
        torch.clamp(row_starts, 0, width, out=lo)
        torch.clamp(row_ends, max=width, out=hi)
        torch.maximum(hi, lo, out=hi)
        dst = indices if direct else views[2]
        fn(logits, lo, hi, dst, None, rows, stride0, stride1, stable=True, **kwargs)
        finish(dst, indices, lo)

    return run


def prepare_top_k_per_row_decode(call):
    fn, takes_k = _entry_of("top_k_per_row_decode", call.topk)
    logits, indices, topk, next_n = call.logits, call.indices, call.topk, call.next_n
    rows, width = logits.shape
    choice = choose_aiter_top_k_per_row_decode(call)
    direct, specs = choice.direct, choice.scratch
    device, owner = logits.device, "top_k_per_row_decode"
    stride0, stride1 = logits.stride()
    kwargs = {"k": topk} if takes_k else {}
    row_ends = _bind_decode_row_ends(call.seq_lens, rows, next_n, width)
    # Only the copy into a wider or strided indices (decode positions are absolute already).
    finish = None if direct else _bind_finish_external(indices, topk, topk, False)

    def run(logits, next_n, seq_lens, indices, topk) -> None:
        views = current_workspace_manager(device).get_simultaneous(*specs, owner=owner)
        ends = views[0]
        row_ends(seq_lens, ends)
        dst = indices if finish is None else views[1]
        fn(logits, 1, ends, dst, rows, stride0, stride1, **kwargs)
        if finish is not None:
            finish(dst, indices, indices)

    return run


# -- the records --------------------------------------------------------------------
TOP_K_PER_ROW_PREFILL = Backend(
    name="aiter", prepare=prepare_top_k_per_row_prefill, supports=supports_top_k_per_row_prefill,
    workspace=aiter_workspace_specs,
)
TOP_K_PER_ROW_DECODE = Backend(
    name="aiter", prepare=prepare_top_k_per_row_decode, supports=supports_top_k_per_row_decode,
    workspace=aiter_workspace_specs_decode,
)
