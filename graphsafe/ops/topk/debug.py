"""Debug checks of the per-row top-k ops (`graphsafe.debug_checks`): the row bounds.

A bound outside the logits row acts as the nearest bound on every backend (the ops'
docstrings); with the switch on, a row start, row end or sequence length outside
`[0, logits.shape[1]]` raises `InputError`.
"""

from __future__ import annotations

from graphsafe.debug import values_at_least, values_at_most


def _in_row(op: str, arg: str, values, width: int, what: str) -> None:
    values_at_least(op, arg, values, 0, what)
    values_at_most(op, arg, values, width, f"logits.shape[1]: {what} past the row would be clamped")


def debug_check_top_k_per_row_prefill(call) -> None:
    """`row_starts` and `row_ends` in `[0, N]` (an end below its start is allowed: an empty row)."""
    op, width = "top_k_per_row_prefill", call.logits.shape[1]
    _in_row(op, "row_starts", call.row_starts, width, "a column")
    _in_row(op, "row_ends", call.row_ends, width, "a column")


def debug_check_top_k_per_row_decode(call) -> None:
    """`seq_lens` in `[0, L]`."""
    _in_row("top_k_per_row_decode", "seq_lens", call.seq_lens, call.logits.shape[1], "a context length")
