"""Fakes and input checks of the per-row top-k ops (`top_k_per_row_prefill`, `_decode`).

Both ops write into a caller-owned `indices` buffer and return None, so the fakes only
validate. `topk` may be smaller than `indices.shape[1]` (a shared buffer wider than
this layer's top-k): the columns past `topk` are written with -1.
"""

from __future__ import annotations

import torch

from graphsafe import checks as c


def _check_logits(op: str, logits: torch.Tensor) -> None:
    c.tensor(op, "logits", logits, dtypes=(torch.float32,), ndim=2)
    c.last_dim_contiguous(op, "logits", logits)


def _check_indices(op: str, indices: torch.Tensor, rows, device: torch.device, names: str) -> None:
    c.tensor(op, "indices", indices, dtypes=(torch.int32,), ndim=2, device=device)
    c.shape(op, "indices", indices, (rows, None), names)
    c.last_dim_contiguous(op, "indices", indices)


def _check_topk(op: str, topk: int, indices: torch.Tensor) -> None:
    k = indices.shape[1]
    if topk < 0 or topk > k:
        c.fail(op, "topk", f"an int in [0, indices.shape[1]] = [0, {k}]", topk)


def _check_row_vector(op: str, arg: str, t: torch.Tensor, rows, device: torch.device, names: str) -> None:
    c.tensor(op, arg, t, dtypes=(torch.int32,), ndim=1, device=device)
    c.shape(op, arg, t, (rows,), names)
    c.contiguous(op, arg, t)


def check_top_k_per_row_prefill(call) -> None:
    op = "top_k_per_row_prefill"
    logits, indices = call.logits, call.indices
    _check_logits(op, logits)
    dev = logits.device
    m = logits.shape[0]
    _check_row_vector(op, "row_starts", call.row_starts, m, dev, "[M]")
    _check_row_vector(op, "row_ends", call.row_ends, m, dev, "[M]")
    _check_indices(op, indices, m, dev, "[M, K]")
    _check_topk(op, call.topk, indices)


def fake_top_k_per_row_prefill(call) -> None:
    check_top_k_per_row_prefill(call)


def check_top_k_per_row_decode(call) -> None:
    op = "top_k_per_row_decode"
    logits, next_n, seq_lens, indices = call.logits, call.next_n, call.seq_lens, call.indices
    _check_logits(op, logits)
    dev = logits.device
    if next_n < 1:
        c.fail(op, "next_n", "an int >= 1", next_n)
    c.tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev)
    c.contiguous(op, "seq_lens", seq_lens)
    rows = seq_lens.shape[0] * next_n
    if logits.shape[0] != rows:
        c.fail(
            op, "logits", f"of shape [B * next_n, L] with B * next_n = {seq_lens.shape[0]} * {next_n} = {rows} rows",
            f"shape {list(logits.shape)}",
        )
    _check_indices(op, indices, rows, dev, "[B * next_n, K]")
    _check_topk(op, call.topk, indices)


def fake_top_k_per_row_decode(call) -> None:
    check_top_k_per_row_decode(call)
