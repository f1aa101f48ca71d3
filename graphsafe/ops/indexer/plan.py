"""The indexer family's decisions, made once per call signature (pure Python: no triton
import; the registry and the public workspace helpers read it without loading a backend).

* `choose_<op>(call) -> <Op>Choice` for every op of the Triton backend: the kernels'
  tiles and launch options, the logits kernels' configurations (`MQA_CONFIG`,
  `PAGED_CONFIG`), whether they take fp8 dots or decode the fp8 bytes to fp16
  (`fp8_dot_supported`), the paged grid (`paged_grid`), and for the composites the whole
  plan: the regions carved, the prefill chunks, the logits launch of each, and the bytes
  reserved before carving.
* The composites' worst-case workspace from shapes (`sparse_attn_indexer_decode_workspace`,
  `sparse_attn_indexer_prefill_workspace`: the Triton records' `workspace`), computed by
  the same functions `choose_sparse_attn_indexer_*` reserves with, so sizing and launch
  cannot disagree. Each region is spelled once (`_logits_region`, `_gathered_regions`).

Decode (`sparse_attn_indexer_decode`) carves one region, the logits
`[T, max_model_len]` f32, holds it, and the nested `top_k_per_row_decode` places its own
scratch after it. Prefill (`sparse_attn_indexer_prefill`) carves the gathered keys
`[N, D]` fp8, their scales `[N]` f32 and one logits chunk `[rows, N]` f32, holds them,
and runs `top_k_per_row_prefill` once per chunk of query rows. The K-cache write, the
gather and the logits kernels take no scratch; the nested top-k's scratch is its own
registered worst case (the topk family owns it), for the backends that may serve it on
the call's device.

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
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from graphsafe.device_info import has_ocp_e4m3, num_sms
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= n (and >= lo), as triton.next_power_of_2."""
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def _row_align(*strides: int) -> int:
    """The largest power of two <= 16 dividing every byte offset a row can start at."""
    g = 16
    for s in strides:
        g = math.gcd(g, int(s))
    return g


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


# -- the logits kernels' configurations --------------------------------------------------------
# Launch configurations, per device type; the CUDA ones are tuned on an H100/H200 (bench case `fp8_paged_mqa_logits_tune`).
MQA_CONFIG = {
    "cuda": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "cpu": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
}
# Paged decode: `programs_per_sm` sets how many (request, chunk) programs the grid aims
# for; `min_tiles` keeps at least that many key tiles per program so the loads of the
# next tiles overlap the current one's dots (num_stages > 1 needs a loop to pipeline).
# num_stages=5: the key tile's load chain (block id, then keys) takes two stages, so 5
# gives three tile buffers and one more tile in flight while a tile is computed (sm_90,
# Triton 3.9: 3 buffers, 124/156 registers and 59/68 KB of shared memory for next_n 1/2,
# 3 CTAs per SM, i.e. 6 tiles of ~17 KB in flight per SM). num_stages=3 had 2 buffers:
# each tile's copy was issued after the previous tile's math and waited for in full, and
# next_n=2 (150 registers) ran 3 CTAs per SM against next_n=1's 4 (114): measured 53%
# and 69% of copy bandwidth, near that 3:4 ratio.
PAGED_CONFIG = {
    "cuda": dict(BLOCK_N=128, num_warps=4, num_stages=5, programs_per_sm=8, min_tiles=2),
    "cpu": dict(BLOCK_N=16, num_warps=4, num_stages=1, programs_per_sm=1, min_tiles=1),
}


@functools.cache
def fp8_dot_supported(device: torch.device) -> bool:
    """Whether tl.dot takes float8e4nv operands on `device`. The CPU interpreter does, but
    its fp8 conversion turns NaN bytes (0x7F/0xFF) into finite values, so it runs the
    byte-decoding fp16 path, which keeps them NaN (tests still force the fp8 path).
    Devices without fp8 e4m3fn matrix units (pre-sm89, MI300's fnuz-only units) read the
    fp8 tiles as bytes, decode them to fp16 in registers (exact) and use fp16 dots."""
    return has_ocp_e4m3(device)


def _fp8_dot(device: torch.device, override: bool | None) -> bool:
    return fp8_dot_supported(device) if override is None else override


def _config(table: dict, device: torch.device, overrides: dict | None) -> dict:
    cfg = dict(table["cuda" if device.type == "cuda" else "cpu"])
    cfg.update(overrides or {})
    return cfg


def paged_grid(
    batch: int, max_model_len: int, block_n: int, device: torch.device, programs_per_sm: int, min_tiles: int = 1
) -> tuple[int, int]:
    """(chunk, chunks per request): from shapes and the SM count only (graph-safe).

    Enough chunks that `batch * chunks` reaches `programs_per_sm` programs per SM (many
    short programs balance uneven contexts), each a whole number of key tiles, at least
    `min_tiles` of them.
    """
    tiles = cdiv(max_model_len, block_n)
    per_row = max(1, min(tiles, cdiv(programs_per_sm * num_sms(device), max(batch, 1))))
    chunk = max(cdiv(tiles, per_row), min_tiles) * block_n
    return chunk, cdiv(max_model_len, chunk)


@dataclass(frozen=True)
class MqaLogitsChoice:
    """How `mqa_logits_kernel` (kernels/triton_mqa_logits.py) runs for one signature."""

    block_m: int
    block_n: int
    block_d: int
    fp8_dot: bool  # fp8 dots, or the fp8 bytes decoded to fp16 in registers
    clean: bool  # write -inf outside the windows too (False: the composites' top-k reads the windows only)
    grid: tuple[int, int]  # (key tiles, query tiles)
    options: tuple[tuple[str, Any], ...]  # num_warps, num_stages, ...

    @property
    def launch_options(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class PagedLogitsChoice:
    """How `paged_mqa_logits_kernel` (kernels/triton_paged_mqa_logits.py) runs for one signature."""

    block_n: int
    block_h: int
    block_d: int
    chunk: int  # keys per program (a whole number of key tiles)
    grid: tuple[int, int]  # (requests, chunks per request)
    fp8_dot: bool
    clean: bool  # write the -inf tail past each context up to max_model_len
    row_align: int
    options: tuple[tuple[str, Any], ...]

    @property
    def launch_options(self) -> dict[str, Any]:
        return dict(self.options)


def choose_mqa_logits(m: int, n: int, h: int, d: int, device: torch.device, *, fp8_dot: bool | None = None,
                      config: dict | None = None, clean: bool = True) -> MqaLogitsChoice | None:
    """The prefill logits launch of `[M, H, D]` queries against N keys (None: nothing to
    compute); `fp8_dot` / `config` override the device's choice (tests, tuning)."""
    if m == 0 or n == 0:
        return None
    cfg = _config(MQA_CONFIG, device, config)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    return MqaLogitsChoice(
        block_m=block_m, block_n=block_n, block_d=_pow2(d, 32),
        fp8_dot=_fp8_dot(device, fp8_dot), clean=clean,
        grid=(cdiv(n, block_n), cdiv(m, block_m)), options=tuple(cfg.items()),
    )


def choose_fp8_mqa_logits(call) -> MqaLogitsChoice | None:
    m, h, d = call.q.shape
    return choose_mqa_logits(m, call.k.shape[0], h, d, call.q.device)


def choose_paged_mqa_logits(q_shape, kv_cache, max_model_len: int, device: torch.device, *,
                            fp8_dot: bool | None = None, config: dict | None = None,
                            clean: bool = True) -> PagedLogitsChoice | None:
    """The decode logits launch of queries `[B, next_n, H, D]` against `kv_cache` (None:
    no request); `fp8_dot` / `config` override the device's choice (tests, tuning)."""
    b, _, h, d = q_shape
    if b == 0:
        return None
    cfg = _config(PAGED_CONFIG, device, config)
    block_n = cfg.pop("BLOCK_N")
    chunk, chunks = paged_grid(b, max_model_len, block_n, device, cfg.pop("programs_per_sm"), cfg.pop("min_tiles"))
    return PagedLogitsChoice(
        block_n=block_n, block_h=_pow2(h, 16), block_d=_pow2(d, 32), chunk=chunk, grid=(b, chunks),
        fp8_dot=_fp8_dot(device, fp8_dot), clean=clean,
        row_align=_row_align(kv_cache.stride(0), d), options=tuple(cfg.items()),
    )


def choose_fp8_paged_mqa_logits(call) -> PagedLogitsChoice | None:
    return choose_paged_mqa_logits(call.q.shape, call.kv_cache, call.max_model_len, call.q.device)


# -- the K cache and the slots --------------------------------------------------------------
@dataclass(frozen=True)
class QuantChoice:
    """How `quant_and_cache_kernel` (kernels/triton_k_cache.py) runs: a program per (token tile, group)."""

    groups: int  # scales per token
    block_t: int
    block_q: int
    ue8m0: bool
    grid: tuple[int, int]
    num_warps: int = 4


def choose_indexer_k_quant_and_cache(call) -> QuantChoice | None:
    """None: no token or no cache block (nothing is written)."""
    t, d = call.k.shape
    if t == 0 or call.kv_cache.shape[0] == 0:
        return None
    g = d // call.quant_block_size
    block_q = _pow2(call.quant_block_size)
    block_t = max(1, min(4096 // block_q, 64, _pow2(t)))
    return QuantChoice(groups=g, block_t=block_t, block_q=block_q, ue8m0=call.scale_fmt == "ue8m0",
                       grid=(cdiv(t, block_t), g))


@dataclass(frozen=True)
class GatherChoice:
    """How `gather_kernel` (kernels/triton_k_cache.py) runs: a program per BLOCK_R destination rows."""

    groups: int
    block_r: int
    block_d: int
    block_g: int
    row_align: int
    search_steps: int  # of the binary search over cu_seq_lens
    grid: tuple[int]
    num_warps: int = 4


def choose_cp_gather_indexer_k_quant_cache(call) -> GatherChoice | None:
    """None: no destination row or no request (the owned rows would be zero rows: none)."""
    n, d = call.dst_k.shape
    b = call.block_table.shape[0]
    if n == 0 or b == 0:
        return None
    g = (call.kv_cache.shape[2] - d) // 4
    block_d = _pow2(d)
    block_r = max(1, min(64, 8192 // block_d, _pow2(n)))
    return GatherChoice(groups=g, block_r=block_r, block_d=block_d, block_g=_pow2(g),
                        row_align=_row_align(call.kv_cache.stride(0), d), search_steps=max(1, b.bit_length()),
                        grid=(cdiv(n, block_r),))


@dataclass(frozen=True)
class SlotsChoice:
    """How `req_local_to_global_slots` runs: `path` "empty" (no row or column: an empty
    output), "padding" (an empty block table: every slot -1) or "kernel"."""

    path: str
    block_k: int = 0
    grid: tuple[int, int] = (0, 0)
    last_block_id: int = 0  # the largest block id whose slots fit int32
    num_warps: int = 4


def choose_req_local_to_global_slots(call) -> SlotsChoice:
    t, k = call.topk_indices.shape
    b, mb = call.block_table.shape
    if t == 0 or k == 0:
        return SlotsChoice("empty")
    if b == 0 or mb == 0:
        return SlotsChoice("padding")
    block_k = min(1024, _pow2(k, 16))
    return SlotsChoice("kernel", block_k=block_k, grid=(t, cdiv(k, block_k)),
                       last_block_id=2**31 // call.block_size - 1)


# -- the composites: regions, nested top-k scratch, worst cases -----------------------------
TOPK_OPS = ("top_k_per_row_prefill", "top_k_per_row_decode")


def _selection(device: torch.device | str | None = None) -> tuple:
    """What the nested top-k's scratch depends on besides shapes: the device type (default:
    CUDA if present, else the CPU) and the backends that may serve the top-k ops there
    (`use_backend` changes them). Every cached plan below is keyed on it, so a forced
    backend never meets a stale size."""
    from graphsafe.registry import get_op

    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return (kind, *(tuple(get_op(name).selection_order(kind)) for name in TOPK_OPS))


def _topk_specs(decode: bool, rows: int, width: int, topk: int, selection: tuple) -> list[Spec]:
    """The nested top-k's scratch, from its registered worst case (the topk family owns it)."""
    from graphsafe.registry import get_op

    spec = get_op(TOPK_OPS[decode])
    return spec.workspace_specs(num_rows=rows, width=width, topk=topk, device=selection[0])


def _logits_region(rows: int, width: int) -> Spec:
    """The logits the composites carve: `[rows, width]` f32."""
    return ((rows, width), F32)


def _gathered_regions(keys: int, head_dim: int) -> tuple[Spec, Spec]:
    """The keys prefill gathers, `[N, D]` fp8, and their scales `[N]` f32."""
    return ((keys, head_dim), FP8), ((keys,), F32)


# -- decode ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _decode_specs(rows: int, max_model_len: int, topk: int, selection: tuple) -> tuple[Spec, ...]:
    return (_logits_region(rows, max_model_len), *_topk_specs(True, rows, max_model_len, topk, selection))


def decode_specs(rows: int, max_model_len: int, topk: int, device=None) -> tuple[Spec, ...]:
    """Regions of one decode call, in arena order: the logits, then the top-k's scratch."""
    return _decode_specs(rows, max_model_len, topk, _selection(device))


def decode_bytes(rows: int, max_model_len: int, topk: int, device=None) -> int:
    return workspace_bytes(*decode_specs(rows, max_model_len, topk, device))


def sparse_attn_indexer_decode_workspace(
    max_num_batched_tokens: int, max_model_len: int, num_heads: int, head_dim: int, topk: int = 2048, device=None
) -> list[Spec]:
    """Worst-case scratch `[(shape, dtype), ...]` of one `sparse_attn_indexer_decode` call
    with at most `max_num_batched_tokens` query tokens on `device` (default: CUDA if
    present): feed it to `WorkspaceManager.reserve(*specs)` before capturing graphs.
    `num_heads` and `head_dim` do not change it (the logits reduce over heads; the keys
    are read from the cache in place); they are taken so that callers size every
    composite from the same shapes."""
    return list(decode_specs(int(max_num_batched_tokens), int(max_model_len), int(topk), device))


@dataclass(frozen=True)
class DecodeChoice:
    """The plan of one `sparse_attn_indexer_decode` signature (Triton composite)."""

    reserve_bytes: int  # made sure of first, on every call: the worst case of max(T, max_num_batched_tokens) tokens
    regions: tuple[Spec, ...]  # carved and held while the top-k runs: the logits [T, max_model_len] f32
    logits: PagedLogitsChoice | None  # the logits launch into that region; None: T = 0, the keys are cached only
    slice_topk: bool  # topk_indices has rows past T: the top-k writes topk_indices[:T]


def choose_sparse_attn_indexer_decode(call) -> DecodeChoice:
    q = call.q
    t, h, d = q.shape
    selection = _selection(q.device)
    length, topk = call.max_model_len, call.topk
    worst = max(workspace_bytes(*_decode_specs(max(t, call.max_num_batched_tokens), length, topk, selection)),
                workspace_bytes(*_decode_specs(t, length, topk, selection)))
    if t == 0:
        return DecodeChoice(reserve_bytes=worst, regions=(), logits=None, slice_topk=False)
    b = call.seq_lens.shape[0]
    # clean=False: the top-k reads each row's valid range only; the -inf tail is skipped.
    logits = choose_paged_mqa_logits((b, call.next_n, h, d), call.kv_cache, length, q.device, clean=False)
    return DecodeChoice(reserve_bytes=worst, regions=_decode_specs(t, length, topk, selection)[:1], logits=logits,
                        slice_topk=call.topk_indices.shape[0] != t)


# -- prefill ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _prefill_chunk_bytes(rows: int, total_seq_lens: int, topk: int, selection: tuple) -> int:
    specs = (_logits_region(rows, total_seq_lens), *_topk_specs(False, rows, total_seq_lens, topk, selection))
    return workspace_bytes(*specs)


def prefill_chunk_bytes(rows: int, total_seq_lens: int, topk: int, device=None) -> int:
    """Workspace bytes of one prefill chunk of `rows` query rows: the logits `[rows, N]` f32
    and the nested top-k's scratch after them (N = total_seq_lens)."""
    return _prefill_chunk_bytes(rows, total_seq_lens, topk, _selection(device))


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


def prefill_chunk_rows(num_tokens: int, total_seq_lens: int, topk: int, max_chunk_bytes: int, device=None) -> int:
    """Query rows per prefill chunk: the most rows (at most `num_tokens`) whose chunk
    (`prefill_chunk_bytes`) fits `max_chunk_bytes`; at least 1 (a bound below one row's
    need is exceeded by that one row, as vLLM does). 0 when there are no tokens."""
    return _prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes, _selection(device))


def _chunk_sizes(num_tokens: int, rows: int) -> tuple[int, ...]:
    """The query rows of each chunk of a call, in order: `rows` each, the last maybe fewer."""
    return tuple(min(rows, num_tokens - m0) for m0 in range(0, num_tokens, max(rows, 1)))


def prefill_chunks(num_tokens: int, total_seq_lens: int, topk: int, max_chunk_bytes: int,
                   device=None) -> list[tuple[int, int]]:
    """The query-row ranges `[(start, end), ...]` of one prefill call, in order."""
    rows = prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes, device)
    bounds = (0, *itertools.accumulate(_chunk_sizes(num_tokens, rows)))
    return list(zip(bounds, bounds[1:]))


def _prefill_bytes(rows: int, total_seq_lens: int, head_dim: int, topk: int, selection: tuple) -> int:
    # The chunk's logits region starts 256-aligned after the keys and scales.
    return (_align(workspace_bytes(*_gathered_regions(total_seq_lens, head_dim)))
            + _prefill_chunk_bytes(rows, total_seq_lens, topk, selection))


def prefill_bytes(num_tokens: int, total_seq_lens: int, head_dim: int, topk: int, max_chunk_bytes: int,
                  device=None) -> int:
    """Arena bytes of one prefill call, the nested top-k's scratch included."""
    selection = _selection(device)
    rows = _prefill_chunk_rows(num_tokens, total_seq_lens, topk, max_chunk_bytes, selection)
    return _prefill_bytes(rows, total_seq_lens, head_dim, topk, selection)


@functools.lru_cache(maxsize=256)
def _prefill_worst(max_tokens: int, max_keys: int, head_dim: int, topk: int, max_chunk_bytes: int,
                   selection: tuple) -> tuple[Spec, ...]:
    """The keys and scales at N = max_keys, and the largest chunk a call of at most
    `max_tokens` rows may carve after them (see `sparse_attn_indexer_prefill_workspace`)."""
    if max_tokens <= 0:
        chunk = 0
    else:
        one = _prefill_chunk_bytes(1, max_keys, topk, selection)
        chunk = min(_prefill_chunk_bytes(max_tokens, max_keys, topk, selection), max(max_chunk_bytes, one))
    return (*_gathered_regions(max_keys, head_dim), ((chunk,), torch.uint8))


def sparse_attn_indexer_prefill_workspace(
    max_num_batched_tokens: int,
    max_model_len: int,
    num_heads: int,
    head_dim: int,
    topk: int = 2048,
    max_total_seq_lens: int | None = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    device=None,
) -> list[Spec]:
    """Worst-case scratch of one `sparse_attn_indexer_prefill` call with at most
    `max_num_batched_tokens` query tokens and `max_total_seq_lens` gathered keys (default
    `PREFILL_BUFFER_FACTOR * max_model_len`, vLLM's prefill buffer) on `device` (default:
    CUDA if present). `num_heads` does not change it (see the decode workspace).

    A chunk of rows r < M fits `max_chunk_bytes` by construction, one row may exceed it,
    and a chunk never needs more than all M rows: so no call with M <= max_num_batched_tokens
    and N <= max_total_seq_lens needs more than the keys and scales at N = max and
    `min(chunk(M, N), max(bound, chunk(1, N)))` (chunk bytes grow with rows and keys).
    """
    n = int(PREFILL_BUFFER_FACTOR * max_model_len if max_total_seq_lens is None else max_total_seq_lens)
    worst = _prefill_worst(int(max_num_batched_tokens), n, int(head_dim), int(topk), int(max_chunk_bytes),
                           _selection(device))
    return list(worst)


@dataclass(frozen=True)
class PrefillChoice:
    """The plan of one `sparse_attn_indexer_prefill` signature (Triton composite)."""

    reserve_bytes: int  # made sure of first, on every call: the worst case of the call's max_* bounds
    regions: tuple[Spec, ...]  # carved and held: keys [N, D] fp8, scales [N] f32, a logits chunk [rows, N] f32
    chunks: tuple[int, ...]  # query rows of each chunk, in order (() for T = 0: the keys are cached only)
    logits: tuple[tuple[int, MqaLogitsChoice | None], ...]  # (rows, the logits launch) per chunk size
    extra_rows: int  # rows of topk_indices past T (left untouched)

    @property
    def path(self) -> str:
        """"cache only" (T = 0), "one chunk" (the whole call, no slices) or "chunks"."""
        return "cache only" if not self.chunks else "one chunk" if len(self.chunks) == 1 else "chunks"


def choose_sparse_attn_indexer_prefill(call) -> PrefillChoice:
    q = call.q
    t, h, d = q.shape
    n, topk, bound = call.total_seq_lens, call.topk, call.max_chunk_bytes
    selection = _selection(q.device)
    rows = _prefill_chunk_rows(t, n, topk, bound, selection)
    worst = _prefill_worst(max(t, call.max_num_batched_tokens), max(n, call.max_total_seq_lens), d, topk, bound,
                           selection)
    reserve = max(_prefill_bytes(rows, n, d, topk, selection), workspace_bytes(*worst))
    if t == 0:
        return PrefillChoice(reserve_bytes=reserve, regions=(), chunks=(), logits=(), extra_rows=0)
    chunks = _chunk_sizes(t, rows)
    # clean=False: the top-k reads the windows only; tiles outside every window are skipped.
    logits = tuple((r, choose_mqa_logits(r, n, h, d, q.device, clean=False)) for r in dict.fromkeys(chunks))
    return PrefillChoice(reserve_bytes=reserve, regions=(*_gathered_regions(n, d), _logits_region(rows, n)),
                         chunks=chunks, logits=logits, extra_rows=call.topk_indices.shape[0] - t)
