"""Benchmarks of the per-row top-k ops (issue 3: >= 40% of the copy bandwidth, bytes =
logits read, and faster than the reference under torch.compile).

Bytes count the valid logits of rows longer than topk, read once: rows with at most
topk valid columns need no data. Extra peer: `torch.topk` over the raw rows (no ranges,
values + indices out), the library kernel a caller would otherwise reach for.
"""

from __future__ import annotations

import torch

from graphsafe.bench import flashinfer
from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import op_peers, same_picks
from graphsafe.registry import get_op
from graphsafe.testing.cases import case_for

TOPK = 2048


def _valid_bytes(lo: torch.Tensor, hi: torch.Tensor, topk: int) -> int:
    lengths = (hi - lo).clamp(min=0)
    return int(torch.where(lengths > topk, lengths, 0).sum()) * 4


def _raw_topk(logits: torch.Tensor, topk: int):
    return lambda: torch.topk(logits, topk, dim=1)



def _impls(spec, args, device, logits, topk):
    # The harness times every impl from CUDA-graph replays too (the "time" column).
    impls = op_peers(spec, args, device)
    impls["torch.topk raw rows"] = _raw_topk(logits, topk)
    return impls


def _decode_full(spec, case, device, rows: int, width: int, topk: int) -> Problem:
    params = {"B": rows, "next_n": 1, "L": width, "topk": topk, "extra_k": 0,
              "values": "normal", "lens": "full", "strided": False}
    args = case.inputs(params, device, seed=0)
    logits, _, seq_lens, indices = args[:4]
    spec.public(*args)  # graphsafe's picks, compared with torch.topk's and FlashInfer's
    picks = indices.clone()
    same = same_picks(logits, picks[:, :topk], torch.topk(logits, topk, dim=1).indices)
    impls = _impls(spec, args, device, logits, topk)
    fi_impls, fi_note = flashinfer.topk_decode_peers(logits, seq_lens, topk, picks)
    note = f"rows picking torch.topk's values: {same:.3f}" + (f"; {fi_note}" if fi_note else "")
    return Problem(case=spec.name, shape=f"rows={rows} L={width} K={topk} full",
                   impls={**impls, **fi_impls}, bytes=rows * width * 4, note=note)


def _decode_ragged(spec, case, device, batch: int, next_n: int, width: int, topk: int) -> Problem:
    """MTP (next_n > 1) with ragged contexts: bytes are the valid columns only."""
    params = {"B": batch, "next_n": next_n, "L": width, "topk": topk, "extra_k": 0,
              "values": "normal", "lens": "random", "strided": False}
    args = case.inputs(params, device, seed=0)
    logits, _, seq_lens = args[:3]
    rows = logits.shape[0]
    i = torch.arange(rows, device=device) % next_n
    hi = (seq_lens.long().repeat_interleave(next_n) - next_n + i + 1).clamp(0, logits.shape[1])
    return Problem(case=spec.name, shape=f"B={batch} next_n={next_n} L={width} K={topk} ragged",
                   impls=_impls(spec, args, device, logits, topk), bytes=_valid_bytes(torch.zeros_like(hi), hi, topk))


# ("full", rows, L, K) and ("ragged", B, next_n, L, K); by default the NOTES targets (128 rows).
@bench_case("top_k_per_row_decode", Shapes(
    default=(("full", 128, 32768, TOPK), ("full", 128, 131072, TOPK)),
    full=(*(("full", r, w, TOPK) for w in (32768, 131072) for r in (1, 32, 128)), ("ragged", 64, 2, 65536, TOPK)),
    cpu=(("full", 4, 4096, 64), ("ragged", 4, 2, 2048, 64)),
))
def top_k_per_row_decode(device: torch.device, shapes: tuple):
    spec, case = get_op("top_k_per_row_decode"), case_for("top_k_per_row_decode")
    for kind, *dims in shapes:
        yield (_decode_full if kind == "full" else _decode_ragged)(spec, case, device, *dims)


# (M, N, K, label)
@bench_case("top_k_per_row_prefill", Shapes(
    default=((8192, 8192, TOPK, "one 8k request, causal"),),
    full=((8192, 8192, TOPK, "one 8k request, causal"), (2048, 32768, TOPK, "2k chunk after a 30k prefix")),
    cpu=((256, 1024, 64, "causal"),),
))
def top_k_per_row_prefill(device: torch.device, shapes: tuple):
    spec, case = get_op("top_k_per_row_prefill"), case_for("top_k_per_row_prefill")
    for m, n, topk, label in shapes:
        params = {"M": m, "N": n, "topk": topk, "extra_k": 0, "values": "normal", "ranges": "causal", "strided": False}
        args = case.inputs(params, device, seed=0)
        logits, starts, ends = args[:3]
        impls = _impls(spec, args, device, logits, topk)
        yield Problem(
            case=spec.name,
            shape=f"M={m} N={n} K={topk} {label}",
            impls=impls,
            bytes=_valid_bytes(starts.long().clamp(0, n), ends.long().clamp(0, n), topk),
        )
