"""Benchmarks of the per-row top-k ops (issue 3: >= 40% of the copy bandwidth, bytes =
logits read, and faster than the reference under torch.compile).

Bytes count the valid logits of rows longer than topk, read once: rows with at most
topk valid columns need no data. Extra peer: `torch.topk` over the raw rows (no ranges,
values + indices out), the library kernel a caller would otherwise reach for.
"""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, bench_case
from graphsafe.bench.peers import op_peers
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


@bench_case("top_k_per_row_decode")
def top_k_per_row_decode(device: torch.device):
    spec, case = get_op("top_k_per_row_decode"), case_for("top_k_per_row_decode")
    for width in (32768, 131072):
        for rows in (1, 32, 128):
            params = {"B": rows, "next_n": 1, "L": width, "topk": TOPK, "extra_k": 0,
                      "values": "normal", "lens": "full", "strided": False}
            args = case.inputs(params, device, seed=0)
            impls = _impls(spec, args, device, args[0], TOPK)
            yield Problem(
                case=spec.name,
                shape=f"rows={rows} L={width} K={TOPK} full",
                impls=impls,
                bytes=rows * width * 4,
            )
    # MTP (next_n = 2) with ragged contexts: bytes are the valid columns only.
    params = {"B": 64, "next_n": 2, "L": 65536, "topk": TOPK, "extra_k": 0,
              "values": "normal", "lens": "random", "strided": False}
    args = case.inputs(params, device, seed=0)
    logits, next_n, seq_lens = args[:3]
    rows = logits.shape[0]
    i = torch.arange(rows, device=device) % next_n
    hi = (seq_lens.long().repeat_interleave(next_n) - next_n + i + 1).clamp(0, logits.shape[1])
    impls = _impls(spec, args, device, logits, TOPK)
    yield Problem(
        case=spec.name, shape=f"B=64 next_n=2 L=65536 K={TOPK} ragged", impls=impls,
        bytes=_valid_bytes(torch.zeros_like(hi), hi, TOPK),
    )


@bench_case("top_k_per_row_prefill")
def top_k_per_row_prefill(device: torch.device):
    spec, case = get_op("top_k_per_row_prefill"), case_for("top_k_per_row_prefill")
    for m, n, label in ((8192, 8192, "one 8k request, causal"), (2048, 32768, "2k chunk after a 30k prefix")):
        params = {"M": m, "N": n, "topk": TOPK, "extra_k": 0, "values": "normal", "ranges": "causal", "strided": False}
        args = case.inputs(params, device, seed=0)
        logits, starts, ends = args[:3]
        impls = _impls(spec, args, device, logits, TOPK)
        yield Problem(
            case=spec.name,
            shape=f"M={m} N={n} K={TOPK} {label}",
            impls=impls,
            bytes=_valid_bytes(starts.long().clamp(0, n), ends.long().clamp(0, n), TOPK),
        )
