"""Per-row top-k of the sparse indexer: the positions of the K largest logits of each row.

Shared contract of both ops:
* Positions are relative: row r writes `n - origin[r]` for the chosen columns n (the
  prefill origin is the row's clamped start, see below; the decode origin is 0).
* Bounds outside the row act as the nearest bound, on every backend: a row start, row
  end or sequence length is clamped to `[0, logits.shape[1]]` before use (a negative
  one acts as 0, one past the width as the width), and an end below the start is an
  empty row. No backend reads a logit outside its row's valid columns, whatever the
  bounds. The debug switch (`graphsafe.debug_checks`) refuses bounds outside
  `[0, logits.shape[1]]`.
* Only valid columns are ever chosen; every valid score counts, -inf and NaN included
  (vLLM's kernels treat -inf as an ordinary value too). Scores are ranked by the
  order-preserving integer image of the float bits, the order of a radix select: the
  float order on non-NaN values, +0.0 above -0.0, positive NaNs (sign bit clear) above
  +inf and negative NaNs below -inf, NaNs among themselves by their bits. Every backend
  returns a set of positions with the same multiset of bit patterns.
* `indices[r, :c]` with `c = min(topk, #valid columns of r)` holds distinct positions
  whose scores are the c largest of the row (any such set when scores tie; order within
  a row unspecified); `indices[r, c:]` is -1, also the columns past `topk`.
* No host sync and no data-dependent shapes: the ops capture into CUDA graphs, and the
  backends take their scratch from the workspace manager (worst case:
  `spec.workspace_bytes(num_rows=..., width=..., topk=...)`).
* Each backend's `prepare` fixes a call signature's plan once (`plan.py`: one launch or
  two, the geometry, the scratch) and binds its kernels; a call then takes its scratch
  and launches.
"""

from __future__ import annotations

from torch import Tensor

from graphsafe.ops.topk import aiter, reference, triton
from graphsafe.ops.topk import fake as fakes
from graphsafe.registry import register_op


@register_op(
    "top_k_per_row_prefill",
    fake=fakes.fake_top_k_per_row_prefill,
    check=fakes.check_top_k_per_row_prefill,
    mutates_args=("indices",),
    family="topk",
    backends=(reference.TOP_K_PER_ROW_PREFILL, triton.TOP_K_PER_ROW_PREFILL, aiter.TOP_K_PER_ROW_PREFILL),
    debug_check="graphsafe.ops.topk.debug:debug_check_top_k_per_row_prefill",
)
def top_k_per_row_prefill(logits: Tensor, row_starts: Tensor, row_ends: Tensor, indices: Tensor, topk: int) -> None:
    """Top-`topk` positions of each row of prefill indexer logits, relative to the row start.

    Row m considers the columns n with `s <= n < e`, where `s = clamp(row_starts[m], 0, N)`
    and `e = clamp(row_ends[m], 0, N)`, and writes `n - s` for the `topk` largest
    `logits[m, n]`; rows with fewer valid columns write all of them, then -1. See the
    module docstring for ties, NaN, -inf and ordering.

    Args:
        logits: `[M, N]` float32, last dim contiguous (the row stride is free, e.g. a
            slice of a wider buffer), as produced by `fp8_mqa_logits`. Only the columns
            `[s, e)` of row m are read (`-inf` or NaN outside `[ks, ke)` does not matter).
        row_starts: `[M]` int32, contiguous: first valid column of each row (`ks`),
            expected in `[0, N]`; a value outside acts as the nearest bound (0 or N).
            The debug switch checks the range.
        row_ends: `[M]` int32, contiguous: one past the last valid column (`ke`),
            expected in `[0, N]`, likewise clamped; an end below the start is an empty
            row (all -1). The debug switch checks the range.
        indices: `[M, K]` int32, mutated; last dim contiguous, row stride free (a slice
            of a shared `topk_indices` buffer works). Columns `>= topk` are set to -1.
        topk: number of positions per row, `0 <= topk <= K` (DeepSeek-V3.2: 2048).

    Returns None; mutates `indices` only.
    """


@register_op(
    "top_k_per_row_decode",
    fake=fakes.fake_top_k_per_row_decode,
    check=fakes.check_top_k_per_row_decode,
    mutates_args=("indices",),
    family="topk",
    backends=(reference.TOP_K_PER_ROW_DECODE, triton.TOP_K_PER_ROW_DECODE, aiter.TOP_K_PER_ROW_DECODE),
    debug_check="graphsafe.ops.topk.debug:debug_check_top_k_per_row_decode",
)
def top_k_per_row_decode(logits: Tensor, next_n: int, seq_lens: Tensor, indices: Tensor, topk: int) -> None:
    """Top-`topk` positions of each row of decode indexer logits (the paged-logits layout).

    Row `r = b * next_n + i` (query token i of request b; next_n > 1 with MTP) considers
    the columns `0 <= n < clamp(seq_lens[b], 0, L) - next_n + i + 1` (the valid range of
    `fp8_paged_mqa_logits`; none when that is <= 0) and writes the positions n of its
    `topk` largest logits; rows with fewer valid columns write all of them, then -1.
    See the module docstring for ties, NaN, -inf and ordering.

    Args:
        logits: `[B * next_n, L]` float32 (L = max_model_len), last dim contiguous, row
            stride free. Only each row's valid columns are read.
        next_n: query tokens per request, >= 1.
        seq_lens: `[B]` int32, contiguous: context length of each request, the new
            tokens included, expected in `[0, L]`; a length outside acts as the nearest
            bound (a negative one as 0: empty rows; one past L as L). The debug switch
            checks the range.
        indices: `[B * next_n, K]` int32, mutated; last dim contiguous, row stride free.
            Columns `>= topk` are set to -1.
        topk: number of positions per row, `0 <= topk <= K` (DeepSeek-V3.2: 2048).

    Returns None; mutates `indices` only.
    """
