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
The records' `supports` predicates (`supports_*`) hand what aiter cannot serve (a `topk`
other than 2048 on an aiter without `k`; empty shapes) to the Triton backend, which runs
on ROCm too: decided once per call signature. `prepare_*` bind a runner to a signature;
the two small Triton kernels around the aiter call come from `triton_external`.
"""

from __future__ import annotations

import functools
import inspect

import torch

from graphsafe.ops.topk.plan import aiter_workspace_specs, aiter_workspace_specs_decode
from graphsafe.ops.topk.triton_external import bind_decode_row_ends, bind_finish_external
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


def supports_top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk) -> bool:
    """Whether aiter serves this call signature (else the Triton backend does)."""
    rows, width = logits.shape
    return rows > 0 and width > 0 and topk > 0 and _usable("top_k_per_row_prefill", topk) is not None


def supports_top_k_per_row_decode(logits, next_n, seq_lens, indices, topk) -> bool:
    """Whether aiter serves this call signature (else the Triton backend does)."""
    rows, width = logits.shape
    return rows > 0 and width > 0 and topk > 0 and _usable("top_k_per_row_decode", topk) is not None


def _entry_of(name: str, topk: int):
    """The usable entry; prepare runs only where `supports` said yes."""
    entry = _usable(name, topk)
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
    # Absolute columns -> positions relative to the (unclipped) row start.
    finish = bind_finish_external(indices, indices.stride(0) if direct else topk, topk, True)

    def run(logits, row_starts, row_ends, indices, topk) -> None:
        views = current_workspace_manager(device).get_simultaneous(*specs, owner=owner)
        lo, hi = views[0], views[1]
        torch.clamp(row_starts, 0, width, out=lo)
        torch.clamp(row_ends, max=width, out=hi)
        torch.maximum(hi, lo, out=hi)
        dst = indices if direct else views[2]
        fn(logits, lo, hi, dst, None, rows, stride0, stride1, **kwargs)
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
