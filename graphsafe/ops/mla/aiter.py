"""aiter backend of the MLA ops (ROCm, gfx942 and gfx950): `aiter.mla.mla_decode_fwd`.

Read against aiter v0.1.20-46-ge4048607a5 (ROCm/aiter); it cannot run here (no ROCm).
Both ops call `mla_decode_fwd` the way vLLM's ROCm MLA backends do (token-granular
paging, `page_size=1`, `kv_buffer = kv_cache.view(-1, 1, 1, 576)`, every row one query
token), in its NON-persistent mode, on gfx942 and gfx950 alike:

* `mla_decode`: row b's keys are the valid positions of its block table (below
  `clamp(seq_lens[b], 0, capacity)`, block id in `[0, num_blocks)`), in position order.
* `sparse_mla`: token t's keys are its index entries in `[0, num_slots)`, in entry order
  (a repeated slot counts once per occurrence).

Why this call:
* It needs aiter v0.1.19 or later (`aiter_support.release_missing`, read from aiter's
  version): before #4308, asm_mla.cu:mla_decode_stage1_asm_fwd set
  `lse_flag = lse != nullptr` and the non-persistent path passes `final_lse` whenever
  `return_lse`, so this call looked for an lse=1 non-persistent bf16 kernel, which no
  csv lists ("cannot get heuristic kernel!" on every call). v0.1.16 to v0.1.18 take every
  keyword the call passes, so no signature probe can tell.
* Persistent mode (`work_meta_data` from `get_mla_metadata_v1`) with `return_lse=True`
  needs a bf16 kernel with lse=1, and gfx942 ships none: `hsa/gfx942/mla/mla_asm.csv` has
  lse=1 rows for fp8 only, so `csrc/py_itfs_cu/asm_mla.cu:get_heuristic_kernel_mla` raises
  "cannot get heuristic kernel!" on every bf16 call (H=128 too: aiter/mla.py:mla_decode_fwd
  folds it to 16 heads first). Non-persistent mode never asks for an lse kernel
  (asm_mla.cu:mla_decode_stage1_asm_fwd: `lse_flag = lse != nullptr && persistent`); its
  LSE comes from the Triton reduce `aiter/mla.py:_fwd_kernel_stage2_asm`, in natural log.
* The split count `n` is ours, never aiter's `get_meta_param` (aiter/mla.py): that one
  allocates its `num_kv_splits_indptr` on the current device once per lru-cache key (inside
  a graph capture: from the capture's pool) and may pick `n = 1`, and with one split
  `_fwd_kernel_stage2_asm` takes its FINAL_OUT branch for H=128 (`MAYBE_FINAL_OUT`), a copy
  that never stores `final_lse` (left `torch.empty` garbage). We pass both `num_kv_splits=n`
  and `num_kv_splits_indptr = [0, n, .., rows * n]` (written into the workspace each
  call), so `get_meta_param` is skipped (aiter/mla.py:mla_decode_fwd calls it only when
  either is None). `n = min(16, max(2, ceil(2 * CUs / rows)))`: stage 1 runs
  `rows * n` workgroups (asm_mla.cu grid `(1, bs, kv_split)` for H 16 and 128), about two
  per CU, at least the 2 splits that make the reduce write the LSE, at most the 16
  `get_meta_param` itself would consider. From shapes alone (graph-stable).
* Rows without a valid key: aiter's reduce gives out 0/0 = NaN and lse -inf; a small
  kernel then writes out 0 and lse -inf into those rows (`aiter_csr.bind_mask_empty`).

Our scratch (the token CSR `qo_indptr / kv_indptr / kv_indices / kv_last_page_lens`, the
splits indptr, the per-chunk counts) comes from the workspace manager and is written by
the Triton kernels of `aiter_csr`, bound once per signature in `prepare_*`. What aiter
allocates itself per call with `torch.empty`/`torch.full` (non-persistent path of
aiter/mla.py:mla_decode_fwd), outside graphsafe's workspace: `logits` float32
`[rows, n, H, 512]` (n >= 2: never aliased to `out`), `attn_lse` float32
`[rows, n, H, 1]`, `final_lse` float32 `[rows, H]` (returned as our `lse`), and
`valid_split_count` int32 `[rows]`. For a large `sparse_mla` prefill that is large
(`rows * n * H * 2 KiB` of `logits`: 8 GiB for 16384 tokens at H=128).

Signatures aiter has no kernel for with our semantics go to the Triton backend (which
runs on ROCm): `mla_decode_supports` / `sparse_mla_supports` decline them and the
registry picks the next backend once per signature. aiter serves: an architecture the
capability table (`graphsafe.aiter_support`) lists, bf16, head dim 576 with
kv_lora_rank 512, H 16 or 128 (the non-persistent bf16 kernels of both csv tables:
gqa 16 `mla_dec_stage1_bf16_a16w16_subQ16_mqa16` and gqa 128
`mla_dec_stage1_bf16_a16w16_subQ128_mqa128`), a contiguous q (asm_mla.cu AITER_CHECK
`Q->is_contiguous()`; no per-call copy), a cache of contiguous blocks of contiguous rows
(aiter passes only `kv_buffer.stride(0)`, so one slot must be one 576-element row) of at
most 4 GiB, int32-addressable slots and CSR, and aiter >= v0.1.19.
The 4 GiB: those two kernels date from 2025 (hsa/<arch>/mla/*.co, "Asm extend chip arch"
#332) and compute a KV byte offset `page_id * page bytes` in 32 bits; #4341 and #4452
(v0.1.19.post2, v0.1.20) rebuilt the persistent and fp8 kernels of gfx950 with 64-bit
offsets ("use v_mul_lo_u32 with v_mul_hi_u32"), not these. A cache past 4 GiB (3.7M
slots of 1152 bytes) goes to Triton.

Not verifiable without an AMD GPU: the numerics of the asm stage-1 kernels (in
particular NaN/inf propagation, which graphsafe's contract fixes: a NaN in a read input
must give NaN where the reference gives it), the stage-1 handling of rows with fewer
keys than splits and of zero-length rows (our masking covers the latter's outputs), and
whether non-persistent mode with `return_lse=True` works at all on hardware: aiter's
own test skips its asm baseline for that combination (op_tests/test_mla.py, "The ASM
decode baseline aborts for these MLA configs when lse is requested"; #4308 removed the
skip with its fix, the pinned commit has it again), so this path is untested upstream;
and whether the 32-bit KV byte offset of these kernels wraps at 4 GiB or earlier (a
signed offset would at 2 GiB: aiter's own large-pool test, op_tests/test_mla_ltx.py,
covers only the rebuilt gfx950 kernels).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from graphsafe import aiter_support, device_info
from graphsafe.formats import fp8_ds_mla
from graphsafe.registry import SUPPORTED, Backend, Support, declined
from graphsafe.workspace import current_workspace_manager

DEEPSEEK_R, DEEPSEEK_D = 512, 576
AITER_HEADS = (16, 128)
# aiter's index arrays are int32 (csr slots, indptrs).
INT32_LIMIT = 2**31
# get_meta_param (aiter/mla.py) tries 1..16 splits; 2 is the fewest whose reduce writes the LSE.
MIN_SPLITS, MAX_SPLITS = 2, 16
# aiter allocates its split partials itself on every call (fp32 `logits` [rows, n, H, 512]
# and `attn_lse`, aiter/mla.py:mla_decode_fwd), outside graphsafe's workspace: calls whose
# partials would exceed this go to Triton (a 16K-token sparse prefill at H = 128 would
# allocate 8 GiB per call).
MAX_SPLIT_PARTIAL_BYTES = 256 * 2**20
# The aiter release whose non-persistent stage 1 no longer asks for an lse kernel (#4308):
# the capability table's.
NEEDED_RELEASE = aiter_support.CAPABILITIES["mla_decode"].release
# The non-persistent bf16 kernels address the cache with a 32-bit byte offset.
KV_BYTE_OFFSET_LIMIT = 2**32


def _mla_decode_fwd() -> Any:
    from aiter.mla import mla_decode_fwd

    return mla_decode_fwd


def _shapes_supported(num_heads: int, head_dim: int, kv_lora_rank: int, dtype: torch.dtype) -> bool:
    deepseek = head_dim == DEEPSEEK_D and kv_lora_rank == DEEPSEEK_R
    return dtype == torch.bfloat16 and deepseek and num_heads in AITER_HEADS


@functools.cache
def _csr():
    """kernels/triton_aiter_csr.py (imported at the first prepare: `import graphsafe` never
    imports triton)."""
    from graphsafe.ops.mla.kernels import triton_aiter_csr

    return triton_aiter_csr


def _support(op: str, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, width: int) -> Support:
    if not aiter_support.serves(op, q.device):
        return declined(f"the capability table does not list {device_info.rocm_arch(q.device)} for aiter's {op} "
                        "(graphsafe.aiter_support)")
    rows, heads, d = q.shape
    num_blocks, block_size = kv_cache.shape[:2]
    if not _shapes_supported(heads, d, kv_lora_rank, q.dtype):
        return declined(f"aiter's MLA kernels take bf16 q of head dim {DEEPSEEK_D} (kv_lora_rank {DEEPSEEK_R}) with "
                        f"{' or '.join(map(str, AITER_HEADS))} heads; got {q.dtype} q of head dim {d} "
                        f"(kv_lora_rank {kv_lora_rank}) with {heads} heads")
    if fp8_ds_mla.holds_records(kv_cache):
        return declined("the adapter reads a cache of q's dtype; got an fp8_ds_mla cache (Triton serves it)")
    if not q.is_contiguous():
        return declined(f"aiter reads q contiguous; got strides {q.stride()}")
    if not (kv_cache.stride(2) == 1 and kv_cache.stride(1) == d and kv_cache.stride(0) == block_size * d):
        return declined(f"aiter reads the cache as contiguous blocks of contiguous rows; got strides {kv_cache.stride()}")
    cache_bytes = num_blocks * block_size * d * kv_cache.element_size()
    if cache_bytes > KV_BYTE_OFFSET_LIMIT:
        return declined(f"aiter's non-persistent bf16 MLA kernels address the cache with a 32-bit byte offset: "
                        f"the cache's {cache_bytes} bytes ({num_blocks * block_size} slots) must stay within 4 GiB "
                        f"({KV_BYTE_OFFSET_LIMIT // (d * kv_cache.element_size())} slots)")
    if num_blocks * block_size >= INT32_LIMIT or rows * width >= INT32_LIMIT:
        return declined(f"aiter's slots and CSR are int32: {num_blocks * block_size} cache slots and "
                        f"{rows * width} CSR entries must stay below 2**31")
    partials = split_partial_bytes(rows, heads, kv_lora_rank, q.device)
    if partials > MAX_SPLIT_PARTIAL_BYTES:
        return declined(f"aiter would allocate {partials >> 20} MiB of split partials per call, outside the "
                        f"workspace (at most {MAX_SPLIT_PARTIAL_BYTES >> 20} MiB)")
    why = aiter_support.release_missing(
        aiter_support.CAPABILITIES[op].release,
        "a non-persistent mla_decode_fwd with return_lse finds its kernel (asm_mla.cu, #4308)")
    return declined(why) if why else SUPPORTED


def split_partial_bytes(rows: int, num_heads: int, kv_lora_rank: int, device) -> int:
    """Bytes of the split partials aiter allocates for one call (fp32 outputs and LSEs)."""
    return rows * num_kv_splits(rows, device) * num_heads * (kv_lora_rank + 1) * 4


def mla_decode_supports(call) -> Support:
    """Whether aiter serves this signature: the capability table lists q's architecture
    for `mla_decode`; bf16; head dim 576 with kv_lora_rank 512; H 16 or 128; contiguous
    q; a cache of contiguous blocks of contiguous rows, at most 4 GiB; slots and
    `B * capacity` below 2**31; aiter's own split partials at most MAX_SPLIT_PARTIAL_BYTES;
    aiter >= NEEDED_RELEASE. The registry hands other signatures to the next backend
    (Triton)."""
    width = call.block_table.shape[1] * call.kv_cache.shape[1]
    return _support("mla_decode", call.q, call.kv_cache, call.kv_lora_rank, width)


def sparse_mla_supports(call) -> Support:
    """As `mla_decode_supports`, for `sparse_mla` (`T * K` below 2**31), without an
    attention sink or `topk_length` (not adapted: Triton serves them)."""
    if call.attn_sink is not None or call.topk_length is not None:
        return declined("the adapter passes no attention sink or topk_length to aiter (Triton serves them)")
    return _support("sparse_mla", call.q, call.kv_cache, call.kv_lora_rank, call.indices.shape[1])


def num_kv_splits(rows: int, device: torch.device | str | None) -> int:
    """The split count passed to aiter: `min(16, max(2, ceil(2 * CUs / rows)))` (module
    docstring: why at least 2, why at most 16)."""
    wanted = math.ceil(2 * device_info.num_sms(device) / max(rows, 1))
    return min(MAX_SPLITS, max(MIN_SPLITS, wanted))


def _csr_specs(rows: int, width: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """qo_indptr, kv_indptr, kv_indices (every position may hold a key), kv_last_page_lens,
    num_kv_splits_indptr, and the per-chunk key counts and their running sums."""
    i32 = torch.int32
    cells = rows * _csr().num_chunks(width)
    return [((rows + 1,), i32), ((rows + 1,), i32), ((max(1, rows * width),), i32), ((rows,), i32),
            ((rows + 1,), i32), ((cells,), i32), ((cells,), i32)]


def _workspace(op: str, rows: int, num_heads: int, kv_lora_rank: int, width: int, device, head_dim, dtype):
    head_dim = head_dim or kv_lora_rank + 64
    if rows == 0 or not _shapes_supported(num_heads, head_dim, kv_lora_rank, dtype):
        return []
    if not aiter_support.serves(op, device):
        return []
    return _csr_specs(rows, width)


def mla_decode_workspace(batch, num_heads, kv_lora_rank, max_kv_len, device=None, head_dim=None, dtype=torch.bfloat16):
    """Worst-case workspace of one aiter `mla_decode` call, from shapes: the token CSR with
    room for every position of the block table, the splits indptr, the chunk counts.
    Nothing where aiter does not serve the shapes or the architecture (Triton sizes those)."""
    return _workspace("mla_decode", batch, num_heads, kv_lora_rank, max_kv_len, device, head_dim, dtype)


def sparse_mla_workspace(num_tokens, num_heads, kv_lora_rank, topk, device=None, head_dim=None, dtype=torch.bfloat16):
    """Worst-case workspace of one aiter `sparse_mla` call (see `mla_decode_workspace`)."""
    return _workspace("sparse_mla", num_tokens, num_heads, kv_lora_rank, topk, device, head_dim, dtype)


def _empty_outputs(rows: int, num_heads: int, kv_lora_rank: int, dtype: torch.dtype, device: torch.device):
    def run(*_):
        out = torch.empty((rows, num_heads, kv_lora_rank), dtype=dtype, device=device)
        return out, torch.empty((rows, num_heads), dtype=torch.float32, device=device)

    return run


def _bind_attend(q: torch.Tensor, kv_lora_rank: int, sm_scale: float, splits: int):
    """`attend(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_lens, splits_indptr)`
    -> (out, lse): the aiter call on a written CSR, then rows without a key set to 0 / -inf."""
    rows, heads, head_dim = q.shape
    device, dtype, scale = q.device, q.dtype, float(sm_scale)
    decode_fwd = _mla_decode_fwd()
    mask_empty = _csr().bind_mask_empty(q, rows, heads, kv_lora_rank)

    def attend(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_lens, splits_indptr):
        out = torch.empty((rows, heads, kv_lora_rank), dtype=dtype, device=device)
        # aiter writes `out` in place and returns (logits, final_lse) (aiter/mla.py:mla_decode_fwd).
        _, lse = decode_fwd(
            q, kv_cache.view(-1, 1, 1, head_dim), out, qo_indptr, kv_indptr, kv_indices, last_page_lens, 1,
            page_size=1, nhead_kv=1, sm_scale=scale,
            num_kv_splits=splits, num_kv_splits_indptr=splits_indptr, return_lse=True,
        )
        mask_empty(kv_indptr, out, lse)
        return out, lse

    return attend


def _get_workspace(device: torch.device, specs: tuple, owner: str) -> list[torch.Tensor]:
    return current_workspace_manager(device).get_simultaneous(*specs, owner=owner)


def _csr_attend(owner: str, device: torch.device, specs: tuple, count, scatter, attend):
    """`run(q, kv_cache, ids, lens)`: the CSR written into the workspace (the per-chunk
    counts, their running sums, the scatter of the valid slots), then aiter's call."""

    def run(q, kv_cache, ids, lens):
        qo_indptr, kv_indptr, kv_indices, last_page, splits_indptr, counts, ends = _get_workspace(
            device, specs, owner)
        count(ids, lens, counts, qo_indptr, last_page, splits_indptr)
        torch.cumsum(counts, 0, dtype=torch.int32, out=ends)
        scatter(ids, lens, counts, ends, kv_indptr, kv_indices)
        return attend(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page, splits_indptr)

    return run


def prepare_mla_decode(call):
    """The aiter runner of `mla_decode` for calls with this signature (one
    `mla_decode_supports` accepts): the split count, workspace specs and the CSR kernels
    are fixed here; a call writes the CSR and calls aiter."""
    q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank = call
    rows, heads, _ = q.shape
    device = q.device
    if rows == 0:
        return _empty_outputs(rows, heads, kv_lora_rank, q.dtype, device)
    num_blocks, block_size = kv_cache.shape[:2]
    specs = tuple(_csr_specs(rows, block_table.shape[1] * block_size))
    splits = num_kv_splits(rows, device)
    count, scatter = _csr().bind_decode_csr(block_table, seq_lens, q, num_blocks, block_size, splits)
    attend = _bind_attend(q, kv_lora_rank, sm_scale, splits)

    attend_csr = _csr_attend("mla_decode", device, specs, count, scatter, attend)

    def run(q, kv_cache, block_table, seq_lens, *_):
        return attend_csr(q, kv_cache, block_table, seq_lens)

    return run


def prepare_sparse_mla(call):
    """The aiter runner of `sparse_mla` for calls with this signature (one
    `sparse_mla_supports` accepts), as `prepare_mla_decode`."""
    q, kv_cache, indices, sm_scale, kv_lora_rank = call[:5]
    rows, heads, _ = q.shape
    device = q.device
    if rows == 0:
        return _empty_outputs(rows, heads, kv_lora_rank, q.dtype, device)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    specs = tuple(_csr_specs(rows, indices.shape[1]))
    splits = num_kv_splits(rows, device)
    count, scatter = _csr().bind_sparse_csr(indices, q, num_slots, splits)
    attend = _bind_attend(q, kv_lora_rank, sm_scale, splits)

    attend_csr = _csr_attend("sparse_mla", device, specs, count, scatter, attend)

    def run(q, kv_cache, indices, *_):
        return attend_csr(q, kv_cache, indices, indices)  # the sparse kernels read no lengths

    return run


MLA_DECODE = Backend(name="aiter", prepare=prepare_mla_decode, supports=mla_decode_supports,
                     workspace=mla_decode_workspace)
SPARSE_MLA = Backend(name="aiter", prepare=prepare_sparse_mla, supports=sparse_mla_supports,
                     workspace=sparse_mla_workspace)


def _call(op: str, *args):
    from graphsafe.registry import get_op

    return get_op(op).call(*args)


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    """aiter's `mla_decode` (a signature `mla_decode_supports` accepts), prepared afresh."""
    args = (q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank)
    return prepare_mla_decode(_call("mla_decode", *args))(*args)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink=None, topk_length=None):
    """aiter's `sparse_mla` (a signature `sparse_mla_supports` accepts, so no sink or
    `topk_length`), prepared afresh."""
    args = (q, kv_cache, indices, sm_scale, kv_lora_rank)
    return prepare_sparse_mla(_call("sparse_mla", *args))(*args)
