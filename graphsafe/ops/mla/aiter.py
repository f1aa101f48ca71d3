"""aiter backend of the MLA ops (ROCm): `aiter.mla.mla_decode_fwd`.

Written against aiter's documented Python API (aiter/mla.py, aiter/ops/attention.py in
ROCm/aiter) and the way vLLM's ROCm MLA backends call it; it cannot run here (no ROCm):

* `mla_decode`: token-granular paging (page_size 1, as vLLM's AiterMLABackend does):
  `kv_indices` holds the cache slot of every valid token of every request, in CSR
  form (`kv_indptr` = [0, cumsum(seq_lens)]); the persistent split schedule comes from
  `get_mla_metadata_v1` (buffer shapes from `get_mla_metadata_info_v1`), and the call is
  `mla_decode_fwd(..., work_meta_data=..., reduce_*=..., return_lse=True)`.
* `sparse_mla`: every token is its own "request" with the valid entries of its index row
  as `kv_indices` (vLLM's ROCMAiterMLASparseImpl), non-persistent `mla_decode_fwd`.

Our scratch (indptrs, indices, metadata) comes from the workspace manager; aiter's
`mla_decode_fwd` allocates its own split buffers (`logits`, `attn_lse`) with torch.empty,
which we cannot route through the workspace. Rows without a valid key are forced to
out 0 / lse -inf afterwards (aiter's reduce divides 0 by 0 there).

Inputs aiter has no kernel for (fp16, head dims other than 512 + 64, H not 16 or 128,
a cache whose blocks are not contiguous) go to the Triton backend, which runs on ROCm:
`mla_decode_supports` / `sparse_mla_supports` refuse them, and the registry picks the
next backend once per signature (this module never imports the Triton backend). The
`prepare_*` functions fix the workspace specs (aiter's metadata sizes are a host call)
and the block table's token positions once per signature.

Not verified here (no ROCm device): that the `lse` aiter returns is in natural log (its
Triton stage-2 reduce uses `exp`/`log`), the keyword names across aiter versions (we pass
only the keywords the installed functions accept), and the handling of a zero-length
request by `get_mla_metadata_v1`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from graphsafe.workspace import current_workspace_manager

DEEPSEEK_R, DEEPSEEK_D = 512, 576
AITER_HEADS = (16, 128)


def _aiter() -> Any:
    import aiter

    return aiter


def _mla_decode_fwd() -> Any:
    from aiter.mla import mla_decode_fwd

    return mla_decode_fwd


@functools.cache
def _params(fn: Any) -> frozenset[str] | None:
    """Keyword names `fn` accepts (None when its signature cannot be read: pass all)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    accepted = _params(fn)
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return fn(*args, **kwargs)


def _supported(num_heads: int, head_dim: int, kv_lora_rank: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and head_dim == DEEPSEEK_D and kv_lora_rank == DEEPSEEK_R and num_heads in AITER_HEADS


def _usable(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    d = q.shape[2]
    flat_cache = kv_cache.stride(1) == d and kv_cache.stride(0) == kv_cache.shape[1] * d
    return _supported(q.shape[1], d, kv_lora_rank, q.dtype) and flat_cache and "return_lse" in (_params(_mla_decode_fwd()) or {"return_lse"})


def mla_decode_supports(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank) -> bool:
    """Whether aiter has a kernel for this signature (bf16, 512 + 64, H 16 or 128, a cache of
    contiguous blocks, an aiter that returns the LSE); the registry hands the other
    signatures to the next backend (Triton, which runs on ROCm)."""
    return _usable(q, kv_cache, kv_lora_rank)


def sparse_mla_supports(q, kv_cache, indices, sm_scale, kv_lora_rank) -> bool:
    """As `mla_decode_supports`."""
    return _usable(q, kv_cache, kv_lora_rank)


def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape) if isinstance(shape, (tuple, list)) else (int(shape),)


def _metadata_specs(batch: int, num_heads: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    info = _call(_aiter().get_mla_metadata_info_v1, batch, 1, num_heads, dtype, dtype, is_sparse=False, fast_mode=True)
    return [(_shape(shape), dt) for shape, dt in info]


def _csr_specs(rows: int, entries: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    i32 = torch.int32
    # qo_indptr, kv_indptr, kv_indices (+1: the slot padding entries are scattered to), last_page_lens
    return [((rows + 1,), i32), ((rows + 1,), i32), ((entries + 1,), i32), ((max(rows, 1),), i32)]


def mla_decode_workspace(batch, num_heads, kv_lora_rank, max_kv_len, device=None, head_dim=None, dtype=torch.bfloat16):
    """Worst-case workspace of one aiter `mla_decode` call, from shapes: the CSR of every
    token slot and aiter's split metadata. Nothing for shapes aiter has no kernel for: the
    backend that serves them (Triton) sizes them, and the registry takes the largest."""
    head_dim = head_dim or kv_lora_rank + 64
    if not _supported(num_heads, head_dim, kv_lora_rank, dtype):
        return []
    return _csr_specs(batch, batch * max_kv_len) + _metadata_specs(batch, num_heads, dtype)


def sparse_mla_workspace(num_tokens, num_heads, kv_lora_rank, topk, device=None, head_dim=None, dtype=torch.bfloat16):
    """Worst-case workspace of one aiter `sparse_mla` call (see `mla_decode_workspace`)."""
    head_dim = head_dim or kv_lora_rank + 64
    if not _supported(num_heads, head_dim, kv_lora_rank, dtype):
        return []
    return _csr_specs(num_tokens, num_tokens * topk)


def _fill_csr(valid: torch.Tensor, slots: torch.Tensor, qo_indptr, kv_indptr, kv_indices, last_page) -> None:
    """CSR of the valid slots of each row, without host sync.

    Entry j of row i goes to `kv_indptr[i] + (number of valid entries before j)`; invalid
    entries all go to the extra last element of `kv_indices` (never read by aiter).
    """
    rows, width = valid.shape
    torch.arange(rows + 1, dtype=torch.int32, device=valid.device, out=qo_indptr)
    kv_indptr[:1].zero_()
    torch.cumsum(valid.sum(1, dtype=torch.int32), 0, dtype=torch.int32, out=kv_indptr[1:])
    rank = torch.cumsum(valid.int(), 1) - 1
    dest = torch.where(valid, kv_indptr[:-1, None].long() + rank, rows * width)
    kv_indices.scatter_(0, dest.reshape(-1), slots.reshape(-1).int())
    last_page.fill_(1)


def _finish(out: torch.Tensor, lse: torch.Tensor | None, empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out.masked_fill_(empty[:, None, None], 0.0)
    lse = lse.reshape(out.shape[:2]).float() if lse is not None else torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
    return out, lse.masked_fill(empty[:, None], float("-inf"))


def _empty_outputs(rows: int, num_heads: int, kv_lora_rank: int, dtype: torch.dtype, device: torch.device):
    def run(*_):
        out = torch.empty((rows, num_heads, kv_lora_rank), dtype=dtype, device=device)
        return out, torch.empty((rows, num_heads), dtype=torch.float32, device=device)

    return run


def prepare_mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    """The aiter runner of `mla_decode` for calls with this signature (one `supports`
    accepts): the workspace specs (aiter's metadata sizes included) and the token
    positions of the block table are fixed here."""
    batch, num_heads, head_dim = q.shape
    device, dtype = q.device, q.dtype
    if batch == 0:
        return _empty_outputs(batch, num_heads, kv_lora_rank, dtype, device)
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    specs = tuple(mla_decode_workspace(batch, num_heads, kv_lora_rank, capacity, device, head_dim, dtype))
    pos = torch.arange(capacity, device=device)
    pos_block, pos_offset = pos // block_size, pos % block_size
    scale = float(sm_scale)
    aiter, decode_fwd = _aiter(), _mla_decode_fwd()
    kv_dtype = kv_cache.dtype

    def run(q, kv_cache, block_table, seq_lens, *_):
        out = torch.empty((batch, num_heads, kv_lora_rank), dtype=dtype, device=device)
        qo_indptr, kv_indptr, kv_indices, last_page, wm, wi, wis, ri, rfm, rpm = current_workspace_manager(
            device
        ).get_simultaneous(*specs, owner="mla_decode")
        valid = pos[None, :] < seq_lens[:, None]
        slots = torch.where(valid, block_table[:, pos_block], 0).long() * block_size + pos_offset
        _fill_csr(valid, slots, qo_indptr, kv_indptr, kv_indices, last_page)
        wis.fill_(-1)  # aiter's own tests start the work list from -1 (unused entries)
        # Argument order of get_mla_metadata_v1: ..., work_metadata_ptrs, work_info_set, work_indptr, reduce_*.
        _call(
            aiter.get_mla_metadata_v1,
            qo_indptr, kv_indptr, last_page, num_heads, 1, True, wm, wis, wi, ri, rfm, rpm,
            page_size=1, kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True,
            dtype_q=dtype, dtype_kv=kv_dtype,
        )
        _, lse = _call(
            decode_fwd,
            q.contiguous(), kv_cache.view(-1, 1, 1, head_dim), out, qo_indptr, kv_indptr, kv_indices[:-1], last_page, 1,
            page_size=1, nhead_kv=1, sm_scale=scale,
            work_meta_data=wm, work_indptr=wi, work_info_set=wis,
            reduce_indptr=ri, reduce_final_map=rfm, reduce_partial_map=rpm, return_lse=True,
        )
        return _finish(out, lse, seq_lens <= 0)

    return run


def prepare_sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank):
    """The aiter runner of `sparse_mla` for calls with this signature (one `supports`
    accepts)."""
    tokens, num_heads, head_dim = q.shape
    device, dtype = q.device, q.dtype
    if tokens == 0:
        return _empty_outputs(tokens, num_heads, kv_lora_rank, dtype, device)
    topk = indices.shape[1]
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    specs = tuple(sparse_mla_workspace(tokens, num_heads, kv_lora_rank, topk, device, head_dim, dtype))
    scale = float(sm_scale)
    decode_fwd = _mla_decode_fwd()

    def run(q, kv_cache, indices, *_):
        out = torch.empty((tokens, num_heads, kv_lora_rank), dtype=dtype, device=device)
        qo_indptr, kv_indptr, kv_indices, last_page = current_workspace_manager(device).get_simultaneous(
            *specs, owner="sparse_mla"
        )
        valid = (indices >= 0) & (indices < num_slots)
        _fill_csr(valid, indices, qo_indptr, kv_indptr, kv_indices, last_page)
        _, lse = _call(
            decode_fwd,
            q.contiguous(), kv_cache.view(-1, 1, 1, head_dim), out, qo_indptr, kv_indptr, kv_indices[:-1], last_page, 1,
            page_size=1, nhead_kv=1, sm_scale=scale, return_lse=True,
        )
        return _finish(out, lse, ~valid.any(1))

    return run


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank):
    """aiter's `mla_decode` (a signature `mla_decode_supports` accepts), prepared afresh."""
    args = (q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank)
    return prepare_mla_decode(*args)(*args)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank):
    """aiter's `sparse_mla` (a signature `sparse_mla_supports` accepts), prepared afresh."""
    args = (q, kv_cache, indices, sm_scale, kv_lora_rank)
    return prepare_sparse_mla(*args)(*args)
