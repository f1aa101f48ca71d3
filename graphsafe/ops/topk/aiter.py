"""aiter backend of the per-row top-k ops (ROCm only; selected when `import aiter` works).

aiter's documented entry points (aiter/ops/topk.py):

    top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows,
                          stride0, stride1, k=2048, stable=False)
    top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1,
                         k=2048, stable=False)

Older aiter releases have no `k` (the kernels are built for 2048). What we adapt:
* aiter writes a contiguous `[numRows, k]` block. When `indices` is wider than `topk` or
  strided, aiter writes into workspace scratch and a small kernel copies it over (and
  writes the -1 columns past `topk`).
* The prefill kernel returns absolute columns; we localise them (`n - row_starts[m]`,
  -1 kept), as vLLM's ROCm path does after the same call.
* Row bounds are clipped to `[0, N)` first (our contract; aiter does not clip), and the
  decode row ends `seq_lens[b] - next_n + i + 1` are precomputed per row and passed with
  `next_n = 1` (vLLM's ROCm call pattern), so aiter never reads past a row.
Anything aiter cannot serve (a `topk` other than 2048 on an aiter without `k`) runs the
Triton kernels instead, which run on ROCm too.
"""

from __future__ import annotations

import functools
import inspect

import torch

from graphsafe.ops.topk import triton as tt
from graphsafe.workspace import current_workspace_manager


@functools.cache
def _entry(name: str):
    """(aiter function, accepts k) or None when this aiter has no such function."""
    import aiter

    fn = getattr(aiter, name, None)
    if fn is None:
        return None
    try:
        takes_k = "k" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a compiled binding without a Python signature
        takes_k = False
    return fn, takes_k


def _usable(name: str, topk: int):
    entry = _entry(name)
    if entry is None:
        return None
    fn, takes_k = entry
    if not takes_k and topk != 2048:
        return None
    return fn, takes_k


def _scratch(op: str, rows: int, topk: int, device, need_out: bool):
    """Row bounds (lo, hi) int32 [rows] each and, if needed, a contiguous [rows, topk] output."""
    specs = [((rows,), torch.int32), ((rows,), torch.int32)]
    if need_out:
        specs.append(((rows, topk), torch.int32))
    views = current_workspace_manager(device).get_simultaneous(*specs, owner=op)
    return views[0], views[1], (views[2] if need_out else None)


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk) -> None:
    rows, width = logits.shape
    entry = _usable("top_k_per_row_prefill", topk)
    if entry is None or rows == 0 or topk == 0 or width == 0:
        return tt.top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk)
    fn, takes_k = entry
    direct = indices.shape[1] == topk and indices.is_contiguous()
    lo, hi, out = _scratch("top_k_per_row_prefill", rows, topk, logits.device, not direct)
    torch.clamp(row_starts, 0, width, out=lo)
    torch.clamp(row_ends, max=width, out=hi)
    torch.maximum(hi, lo, out=hi)
    dst = indices if direct else out
    kwargs = {"k": topk} if takes_k else {}
    fn(logits, lo, hi, dst, None, rows, logits.stride(0), logits.stride(1), **kwargs)
    # Absolute columns -> positions relative to the (unclipped) row start.
    tt.finish_external(dst, indices, topk, row_starts)


def top_k_per_row_decode(logits, next_n, seq_lens, indices, topk) -> None:
    rows, width = logits.shape
    entry = _usable("top_k_per_row_decode", topk)
    if entry is None or rows == 0 or topk == 0 or width == 0:
        return tt.top_k_per_row_decode(logits, next_n, seq_lens, indices, topk)
    fn, takes_k = entry
    direct = indices.shape[1] == topk and indices.is_contiguous()
    _, ends, out = _scratch("top_k_per_row_decode", rows, topk, logits.device, not direct)
    tt.decode_row_ends(seq_lens, next_n, width, ends)
    dst = indices if direct else out
    kwargs = {"k": topk} if takes_k else {}
    fn(logits, 1, ends, dst, rows, logits.stride(0), logits.stride(1), **kwargs)
    if not direct:
        tt.finish_external(dst, indices, topk, None)
