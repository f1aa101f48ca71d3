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
prefill without `stable`, empty shapes) to the Triton backend, which runs on ROCm too:
decided once per call signature. `prepare_*` bind a runner to a signature; the two small
Triton kernels around the aiter call come from `triton_external`.
"""

from __future__ import annotations

import functools
import inspect

import torch

from graphsafe import aiter_support
from graphsafe.ops.topk.plan import aiter_workspace_specs, aiter_workspace_specs_decode
from graphsafe.ops.topk.triton_external import bind_decode_row_ends, bind_finish_external
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


def _usable(name: str, topk: int, needs: tuple[str, ...] = ()):
    """(aiter function, accepts k) when this aiter serves `topk` and takes `needs`."""
    entry = _entry(name)
    if entry is None:
        return None
    fn, params = entry
    takes_k = "k" in params
    if (not takes_k and topk != 2048) or not all(p in params for p in needs):
        return None
    return fn, takes_k


# Prefill needs `stable` (the one-block kernel, see the module docstring).
_NEEDS = {"top_k_per_row_prefill": ("stable",), "top_k_per_row_decode": ()}


def _served(name: str, logits, topk: int) -> bool:
    rows, width = logits.shape
    # aiter reads the logits as float* (no dtype check in its host code) and takes
    # stride0 as the row length and pitch (a [1, N] view may carry any row stride).
    return (aiter_support.serves(name, logits.device) and logits.dtype == torch.float32
            and rows > 0 and width > 0 and logits.stride(0) >= width and topk > 0
            and _usable(name, topk, _NEEDS[name]) is not None)


def supports_top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk) -> bool:
    """Whether aiter serves this call signature (else the Triton backend does)."""
    return _served("top_k_per_row_prefill", logits, topk)


def supports_top_k_per_row_decode(logits, next_n, seq_lens, indices, topk) -> bool:
    """Whether aiter serves this call signature (else the Triton backend does)."""
    return _served("top_k_per_row_decode", logits, topk)


def _entry_of(name: str, topk: int):
    """The usable entry; prepare runs only where `supports` said yes."""
    entry = _usable(name, topk, _NEEDS[name])
    if entry is None:
        raise NotImplementedError(f"{name}: this aiter does not serve topk={topk} (see supports_{name})")
    return entry


def prepare_top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk):
    fn, takes_k = _entry_of("top_k_per_row_prefill", topk)
    rows, width = logits.shape
    # aiter writes a contiguous [rows, topk] block: into indices when it is one.
    direct = indices.shape[1] == topk and indices.is_contiguous()
    specs = tuple(aiter_workspace_specs(rows, width, topk)[: 2 if direct else 3])
    device, owner = logits.device, "top_k_per_row_prefill"
    stride0, stride1 = logits.stride()
    kwargs = {"k": topk} if takes_k else {}
    # Absolute columns -> positions relative to the clipped row start (the op's origin).
    finish = bind_finish_external(indices, indices.stride(0) if direct else topk, topk, True)

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


def prepare_top_k_per_row_decode(logits, next_n, seq_lens, indices, topk):
    fn, takes_k = _entry_of("top_k_per_row_decode", topk)
    rows, width = logits.shape
    direct = indices.shape[1] == topk and indices.is_contiguous()
    specs = tuple(aiter_workspace_specs_decode(rows, width, topk)[: 1 if direct else 2])
    device, owner = logits.device, "top_k_per_row_decode"
    stride0, stride1 = logits.stride()
    kwargs = {"k": topk} if takes_k else {}
    row_ends = bind_decode_row_ends(seq_lens, rows, next_n, width)
    # Only the copy into a wider or strided indices (decode positions are absolute already).
    finish = None if direct else bind_finish_external(indices, topk, topk, False)

    def run(logits, next_n, seq_lens, indices, topk) -> None:
        views = current_workspace_manager(device).get_simultaneous(*specs, owner=owner)
        ends = views[0]
        row_ends(seq_lens, ends)
        dst = indices if finish is None else views[1]
        fn(logits, 1, ends, dst, rows, stride0, stride1, **kwargs)
        if finish is not None:
            finish(dst, indices, indices)

    return run
