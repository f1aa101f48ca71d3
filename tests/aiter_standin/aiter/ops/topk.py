"""aiter/ops/topk.py: the per-row top-k of the sparse indexer (stand-in).

aiter's public `top_k_per_row_prefill` / `top_k_per_row_decode` are plain Python wrappers
(topk.py:378-418, 449-485) that allocate the kernel scratch themselves and call the
compiled `_top_k_per_row_*` (csrc/kernels/topk_per_row_kernels.cu). Modelled here:
* the compiled ops' pybind conversion (`dtypes.check_pybind_call`): `numRows`, `stride0`,
  `stride1`, `k` (and decode's `next_n`) must be ints, `stable` a bool, every tensor of
  a dtype in aiter's table;
* `numRows <= 0` returns at once (host code, 2831);
* the one-block kernel (`radix_topk_one_block_kernel`, 2148-2347): row b reads
  `logits + b * stride0 + rowStart` for `rowEnd - rowStart` floats, the last dim assumed
  contiguous (`stride1` is ignored); prefill bounds are `rowStarts[b]`, `rowEnds[b]`,
  decode `rowStart = 0`, `rowEnd = seqLens[b // next_n] - next_n + b % next_n + 1`.
  Nothing is clamped: a row that would read outside `[0, stride0]` (aiter reads another
  row or past the tensor), past the logits' storage, or non-float32 logits / non-int32
  bounds (aiter reads raw `float*` / `int*`) raise here;
* the output is a dense `[numRows, k]` int32 block (`out_idx + b * k`) whatever
  `indices`' strides: `indices` that is not a contiguous `[numRows, k]` int32 tensor
  raises here (aiter would write past a narrower view, or scramble a wider one). A row
  of `row_len <= k` values writes `rowStart + i` for `i < row_len`, then -1. Prefill
  positions are absolute columns, decode positions row-local (its rowStart is 0);
* ranking by `twiddle_in` (106-116): a total order on the float bits, +NaN above +inf,
  +0.0 above -0.0, -NaN below -inf. `stable=True`: the chosen positions in ascending
  order, the smallest position first at ties; otherwise (order unspecified by aiter)
  the positions by descending score, and at a tie on the boundary the largest
  positions win, so a caller relying on stable order without asking for it fails.
The kernels are built from HIP source for any gfx: both architectures behave the same.
"""

import torch

from aiter.utility import dtypes

__all__ = ["top_k_per_row_prefill", "top_k_per_row_decode"]

_TYPES = {"numRows": int, "stride0": int, "stride1": int, "k": int, "stable": bool, "next_n": int}


def _keys(row: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 image of float32 bits (larger key = higher rank)."""
    bits = row.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def _int_array(t: torch.Tensor, count: int, name: str) -> torch.Tensor:
    """aiter reads `count` ints from `t`'s data pointer."""
    if t.dtype != torch.int32 or not t.is_contiguous() or t.numel() < count:
        raise ValueError(f"aiter reads {name} as {count} contiguous int32 values; got {t.dtype} {tuple(t.shape)}")
    return t.reshape(-1)[:count].to(torch.int64)


def _flat_logits(logits: torch.Tensor) -> torch.Tensor:
    """The float32 storage from logits' first element on, as aiter's `float*` sees it."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"aiter reads logits as float32 rows of contiguous columns; got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    avail = logits.untyped_storage().nbytes() // 4 - logits.storage_offset()
    return logits.as_strided((avail,), (1,))


def _dense_out(t: torch.Tensor | None, rows: int, k: int, dtype: torch.dtype, name: str) -> None:
    if t is not None and (t.dtype != dtype or not t.is_contiguous() or tuple(t.shape) != (rows, k)):
        raise ValueError(f"aiter writes {name} as a dense [{rows}, {k}] {dtype} block; got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _row_choice(values: torch.Tensor, k: int, stable: bool) -> torch.Tensor:
    """Row-local positions of the k highest-ranked values (len(values) > k)."""
    keys = _keys(values)
    if stable:
        order = torch.sort(keys, descending=True, stable=True).indices[:k]
        return order.sort().values
    last = keys.numel() - 1
    order = torch.sort(keys.flip(0), descending=True, stable=True).indices[:k]
    return last - order


def _select(logits, starts, ends, indices, values, rows: int, stride0: int, k: int, stable: bool) -> None:
    _dense_out(indices, rows, k, torch.int32, "indices")
    _dense_out(values, rows, k, torch.float32, "values")
    flat = None
    for b in range(rows):
        start, end = int(starts[b]), int(ends[b])
        row_len = end - start
        out = torch.full((k,), -1, dtype=torch.int64)
        vals = torch.full((k,), float("-inf"))
        if row_len > 0:
            if start < 0 or end > stride0:
                raise IndexError(f"aiter reads row {b} at columns [{start}, {end}) outside [0, stride0={stride0}]")
            flat = _flat_logits(logits) if flat is None else flat
            if b * stride0 + end > flat.numel():
                raise IndexError(f"aiter reads row {b} past the logits' storage")
            row = flat[b * stride0 + start: b * stride0 + end]
            pos = torch.arange(row_len) if row_len <= k else _row_choice(row, k, stable)
            out[: pos.numel()] = pos + start
            vals[: pos.numel()] = row[pos]
        indices[b].copy_(out)
        if values is not None:
            values[b].copy_(vals)


def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048,
                          stable=False) -> None:
    """aiter: the top-k absolute columns of each row's `[rowStarts[b], rowEnds[b])`."""
    dtypes.check_pybind_call("top_k_per_row_prefill", dict(
        logits=logits, rowStarts=rowStarts, rowEnds=rowEnds, indices=indices, values=values, numRows=numRows,
        stride0=stride0, stride1=stride1, k=k, stable=stable), _TYPES)
    if numRows <= 0:
        return None
    starts = _int_array(rowStarts, numRows, "rowStarts")
    ends = _int_array(rowEnds, numRows, "rowEnds")
    _select(logits, starts, ends, indices, values, numRows, stride0, k, stable)
    return None


def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False) -> None:
    """aiter: the top-k positions of row b's `[0, seqLens[b // next_n] - next_n + b % next_n + 1)`."""
    dtypes.check_pybind_call("top_k_per_row_decode", dict(
        logits=logits, next_n=next_n, seqLens=seqLens, indices=indices, numRows=numRows, stride0=stride0,
        stride1=stride1, k=k, stable=stable), _TYPES)
    if numRows <= 0:
        return None
    lens = _int_array(seqLens, (numRows + next_n - 1) // next_n, "seqLens")
    b = torch.arange(numRows)
    ends = lens[b // next_n] - next_n + b % next_n + 1
    _select(logits, torch.zeros_like(ends), ends, indices, None, numRows, stride0, k, stable)
    return None
