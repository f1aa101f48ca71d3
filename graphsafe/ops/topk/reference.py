"""Reference backend of the per-row top-k ops: the executable spec, vectorised PyTorch.

Scores are ranked by `sortable_keys`, the order-preserving integer image of the float
bits (the order a radix select uses). It agrees with float order on every non-NaN
value, counts -inf as an ordinary (smallest non-NaN) value, and puts +0.0 above -0.0,
positive NaNs above +inf and negative NaNs below -inf. Positions outside a row's valid
range get the key -1, below every real key (selected through `torch.where`, so the
logits there are never looked at), so one `torch.topk` over the masked keys picks the valid entries first
and the -1 tail falls out of the sort. No host sync: `k` is a host int from shapes.
"""

from __future__ import annotations

import torch

from graphsafe.registry import Backend


def sortable_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) with key(a) < key(b) iff a < b for non-NaN floats."""
    bits = logits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def clamp_range(start: torch.Tensor, end: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi): start and end clamped to [0, width], an end below the start an empty row."""
    lo = start.clamp(0, width)
    hi = torch.maximum(end.clamp(max=width), lo)
    return lo, hi


def decode_row_range(seq_lens: torch.Tensor, next_n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r = b*next_n + i sees columns n < clamp(seq_lens[b], 0, width) - next_n + i + 1
    (fp8_paged_mqa_logits's rows; a length outside [0, width] acts as the nearest bound)."""
    rows = seq_lens.shape[0] * next_n
    i = torch.arange(rows, device=seq_lens.device, dtype=torch.int64) % next_n
    end = seq_lens.to(torch.int64).clamp(0, width).repeat_interleave(next_n) - next_n + i + 1
    return clamp_range(torch.zeros_like(end), end, width)


def select_rows(
    logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, shift: torch.Tensor, indices: torch.Tensor, topk: int
) -> None:
    """indices[r, :topk] <- positions (minus shift[r]) of the topk largest keys in [lo[r], hi[r])."""
    rows, width = logits.shape
    k = min(topk, width)
    if k > 0:
        cols = torch.arange(width, device=logits.device)
        valid = (cols >= lo[:, None]) & (cols < hi[:, None])
        keys = torch.where(valid, sortable_keys(logits), -1)
        top, pos = torch.topk(keys, k, dim=1)
        out = torch.where(top >= 0, pos - shift.to(torch.int64)[:, None], -1)
        indices[:, :k].copy_(out)
    indices[:, k:].fill_(-1)


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, topk) -> None:
    lo, hi = clamp_range(row_starts.to(torch.int64), row_ends.to(torch.int64), logits.shape[1])
    select_rows(logits, lo, hi, lo, indices, topk)


def top_k_per_row_decode(logits, next_n, seq_lens, indices, topk) -> None:
    lo, hi = decode_row_range(seq_lens, next_n, logits.shape[1])
    select_rows(logits, lo, hi, torch.zeros_like(lo), indices, topk)


# -- the records --------------------------------------------------------------------
TOP_K_PER_ROW_PREFILL = Backend(name="reference", impl=top_k_per_row_prefill)
TOP_K_PER_ROW_DECODE = Backend(name="reference", impl=top_k_per_row_decode)
