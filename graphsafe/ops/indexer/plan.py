"""Workspace plans of the composite indexer ops, from host ints only (no triton import:
the registry reads the worst case through these functions without loading a backend).

Decode (`sparse_attn_indexer_decode`) carves one region, the logits
`[T, max_model_len]` f32, holds it, and the nested `top_k_per_row_decode` places its own
scratch after it. Prefill (`sparse_attn_indexer_prefill`) carves the gathered keys
`[N, D]` fp8, their scales `[N]` f32 and one logits chunk `[rows, N]` f32, holds them,
and runs `top_k_per_row_prefill` once per chunk of query rows.

A prefill chunk's size is what it costs in the workspace: its logits plus the nested
top-k's scratch for those rows (the top-k keeps per-row candidate lists: ~106 KB a row at
topk = 2048 in its current plan, more than an 8k-wide logits row). `prefill_chunk_rows` picks the most rows
whose chunk fits `max_chunk_bytes`; vLLM bounds the logits alone
(`VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`, 512 MiB by default, `split_indexer_prefill_chunks`
sub-chunks the query rows of one request group the same way), which here would let the
top-k scratch triple the peak.

Every size is a function of host ints the caller passes (CPU mirrors): the plans are the
same at capture and at every replay of a CUDA graph, whatever the context lengths.
"""

from __future__ import annotations

import functools

import torch

from graphsafe.workspace import ALIGNMENT, workspace_bytes

FP8 = torch.float8_e4m3fn
F32 = torch.float32
# Default bound of one prefill chunk (logits + nested top-k scratch), as vLLM's default
# bound of the logits (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512).
DEFAULT_MAX_CHUNK_BYTES = 512 << 20
# Gathered key rows one prefill call may hold by default when sizing the worst case:
# vLLM's `get_max_prefill_buffer_size` (40 * max_model_len rows of 132 bytes; 825 MB for
# DeepSeek-V3.2's 163840). The caller splits larger prefill batches over several calls.
PREFILL_BUFFER_FACTOR = 40

Spec = tuple[tuple[int, ...], torch.dtype]


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


TOPK_OPS = ("top_k_per_row_prefill", "top_k_per_row_decode")


def _selection() -> tuple:
    """What the nested top-k's scratch depends on besides shapes: the default device and
    the backends that may serve the top-k ops there (`use_backend` changes them). Every
    cached plan below is keyed on it, so a forced backend never meets a stale size."""
    from graphsafe.registry import get_op

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (device, *(tuple(get_op(name).selection_order(device)) for name in TOPK_OPS))


def _topk_specs(decode: bool, rows: int, width: int, topk: int) -> list[Spec]:
    """The nested top-k's scratch, from its registered worst case (the topk family owns it)."""
    from graphsafe.registry import get_op

    spec = get_op(TOPK_OPS[decode])
    return spec.workspace_specs(num_rows=rows, width=width, topk=topk)


# -- decode --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _decode_specs(rows: int, max_model_len: int, topk: int, selection: tuple) -> tuple[Spec, ...]:
    return (((rows, max_model_len), F32), *_topk_specs(True, rows, max_model_len, topk))


def decode_specs(rows: int, max_model_len: int, topk: int) -> tuple[Spec, ...]:
    """Regions of one decode call, in arena order: the logits, then the top-k's scratch."""
    return _decode_specs(rows, max_model_len, topk, _selection())


def decode_bytes(rows: int, max_model_len: int, topk: int) -> int:
    return workspace_bytes(*decode_specs(rows, max_model_len, topk))


def sparse_attn_indexer_decode_workspace(
    max_num_batched_tokens: int, max_model_len: int, num_heads: int, head_dim: int, topk: int = 2048
) -> list[Spec]:
    """Worst-case scratch `[(shape, dtype), ...]` of one `sparse_attn_indexer_decode` call
    with at most `max_num_batched_tokens` query tokens: feed it to
    `WorkspaceManager.reserve(*specs)` before capturing graphs. `num_heads` and `head_dim`
    do not change it (the logits reduce over heads; the keys are read from the cache in
    place); they are taken so that callers size every composite from the same shapes."""
    return list(decode_specs(int(max_num_batched_tokens), int(max_model_len), int(topk)))


# -- prefill -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _prefill_chunk_bytes(rows: int, total_seq_lens: int, topk: int, selection: tuple) -> int:
    specs = (((rows, total_seq_lens), F32), *_topk_specs(False, rows, total_seq_lens, topk))
    return workspace_bytes(*specs)


def prefill_chunk_bytes(rows: int, total_seq_lens: int, topk: int) -> int:
    """Workspace bytes of one prefill chunk of `rows` query rows: the logits `[rows, N]` f32
    and the nested top-k's scratch after them (N = total_seq_lens)."""
    return _prefill_chunk_bytes(rows, total_seq_lens, topk, _selection())


@functools.lru_cache(maxsize=1024)
def _prefill_chunk_rows(num_tokens: int, total_seq_lens: int, topk: int, max_chunk_bytes: int,
                        selection: tuple) -> int:
    if num_tokens <= 0:
        return 0

    def need(rows: int) -> int:
        return _prefill_chunk_bytes(rows, total_seq_lens, topk, selection)

    lo, hi = 1, num_tokens  # chunk bytes grow with the rows: binary search the last fit
    if need(hi) <= max_chunk_bytes:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid) <= max_chunk_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefill_chunk_rows(num_tokens: int, total_seq_lens: int, topk: int, max_chunk_bytes: int) -> int:
    """Query rows per prefill chunk: the most rows (at most `num_tokens`) whose chunk
    (`prefill_chunk_bytes`) fits `max_chunk_bytes`; at least 1 (a bound below one row's
    need is exceeded by that one row, as vLLM does). 0 when there are no tokens."""
    return _prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes, _selection())


def prefill_chunks(num_tokens: int, total_seq_lens: int, topk: int, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """The query-row ranges `[(start, end), ...]` of one prefill call, in order."""
    rows = prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes)
    return [(m0, min(m0 + rows, num_tokens)) for m0 in range(0, num_tokens, max(rows, 1))]


def prefill_specs(
    num_tokens: int, total_seq_lens: int, head_dim: int, topk: int, max_chunk_bytes: int
) -> tuple[Spec, ...]:
    """Regions one prefill call carves itself: gathered keys, scales, one logits chunk."""
    rows = prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes)
    return (((total_seq_lens, head_dim), FP8), ((total_seq_lens,), F32), ((rows, total_seq_lens), F32))


def prefill_bytes(num_tokens: int, total_seq_lens: int, head_dim: int, topk: int, max_chunk_bytes: int) -> int:
    """Arena bytes of one prefill call, the nested top-k's scratch included."""
    own = prefill_specs(num_tokens, total_seq_lens, head_dim, topk, max_chunk_bytes)
    rows = own[2][0][0]
    # The chunk's logits region starts 256-aligned after the keys and scales.
    return _align(workspace_bytes(*own[:2])) + prefill_chunk_bytes(rows, total_seq_lens, topk)


def sparse_attn_indexer_prefill_workspace(
    max_num_batched_tokens: int,
    max_model_len: int,
    num_heads: int,
    head_dim: int,
    topk: int = 2048,
    max_total_seq_lens: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> list[Spec]:
    """Worst-case scratch of one `sparse_attn_indexer_prefill` call with at most
    `max_num_batched_tokens` query tokens and `max_total_seq_lens` gathered keys (default
    `PREFILL_BUFFER_FACTOR * max_model_len`, vLLM's prefill buffer). `num_heads` does not
    change it (see the decode workspace).

    A chunk of rows r < M fits `max_chunk_bytes` by construction, one row may exceed it,
    and a chunk never needs more than all M rows: so no call with M <= max_num_batched_tokens
    and N <= max_total_seq_lens needs more than the keys and scales at N = max and
    `min(chunk(M, N), max(bound, chunk(1, N)))` (chunk bytes grow with rows and keys).
    """
    n = int(PREFILL_BUFFER_FACTOR * max_model_len if max_total_seq_lens is None else max_total_seq_lens)
    m = int(max_num_batched_tokens)
    if m <= 0:
        chunk = 0
    else:
        one = prefill_chunk_bytes(1, n, topk)
        chunk = min(prefill_chunk_bytes(m, n, topk), max(int(max_chunk_bytes), one))
    return [((n, int(head_dim)), FP8), ((n,), F32), ((chunk,), torch.uint8)]
