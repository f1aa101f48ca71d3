"""aiter/mla.py: `mla_decode_fwd` (aiter/mla.py:523-1006 at v0.1.20-46-ge4048607a5).

Modelled, with the aiter source of each rule:
* The Python signature, asserts and derivations of `mla_decode_fwd`: `logit_cap <= 0`
  (AssertionError); `qk_head_dim` unpacked from a 4-D `kv_buffer` (ValueError otherwise);
  H and Dv from `o`; persistent mode iff `work_meta_data` is given, switched off by
  `_use_persistent_mla_decode` (gfx950, bf16/bf16, H 16, one query token, bs >= 32) when
  `num_kv_splits` is None; the persistent head fold of H in 32..128 step 16 when H is not
  natively served (AssertionError "nhead=... and max_seqlen_q=... not supported" else).
* Non-persistent splits: `num_kv_splits` and `num_kv_splits_indptr` as given when both
  are, else `get_meta_param` (the same occupancy search over 1..16, so n = 1 happens);
  the early return for n == 1 with fp8 q, bf16 q4, bf16 H 32 or 8 (lse not written); the
  Triton reduce `_fwd_kernel_stage2_asm`: for H = 128 (MAYBE_FINAL_OUT) and n == 1 it
  only copies the output and never stores `final_lse`, filled with NaN here to model the
  `torch.empty` garbage; rows without a key get out 0/0 = NaN and lse -inf.
* The C++ checks of `mla_decode_stage1_asm_fwd` (csrc/py_itfs_cu/asm_mla.cu), as
  RuntimeError: q contiguous, one KV head, q head size = kv_buffer.shape[3] (unless the
  cache is i8/u8), fp8 q needs q_scale and kv_scale, q dtype bf16 or aiter's fp8
  ("unsupport Q dtype"), kv dtype bf16/fp8/i8/u8; then `get_heuristic_kernel_mla`: the
  key (q type, kv type, gqa, ps, qseqlen, lse) after asm_mla.cu's remaps must be a decode
  row of the architecture's `hsa/<arch>/mla/mla_asm.csv`, with `lse = return_lse and
  persistent` (asm_mla.cu: `lse_flag = lse != nullptr && persistent`, since v0.1.19:
  #4308; before it `lse_flag = lse != nullptr`, and the non-persistent path passes
  `final_lse` whenever `return_lse`, so such a call looks for an lse=1 non-persistent row,
  which no bf16 row of gqa 16 or 128 is: the stand-in follows `aiter._version`), else
  "get_heuristic_kernel_mla: cannot get heuristic kernel! ...". Only the bf16/bf16 rows
  the digest of those tables lists are modelled (`KERNELS`); other dtype pairs and head
  counts raise that error here (stricter than aiter: graphsafe never passes them).
* What a GPU would read out of bounds, as IndexError: index arrays that are not
  contiguous int32 of their sizes, a `kv_indptr` that is not non-decreasing from >= 0
  or runs past `kv_indices`, a page id of a used `kv_indices` entry outside
  `kv_buffer`'s pages, a `num_kv_splits_indptr` other than `[0, n, .., bs * n]`, a
  `kv_buffer` whose pages are not dense (aiter passes only its stride(0)), and in the
  non-persistent bf16 kernels (hsa/<arch>/mla/mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co,
  _subQ128_mqa128.co and the m16x4 / m32x4 builds, unchanged since 2025; #4341 and #4452
  rebuilt the persistent and fp8 ones with 64-bit offsets, gfx950 only) a used page whose
  bytes end past 4 GiB: their KV byte offset is `page_id * page bytes` in 32 bits
  (v_mul_lo_u32 alone, #4341), so it would wrap to another row.

Results: `o` written in place, attention in float32 over exactly the listed tokens
(score `sm_scale * q . k` over the whole head, value the first Dv entries of the key
row, a causal mask for several query tokens), lse in natural log; returns
`(logits, final_lse)`. The split partials (`logits`) are not modelled: returned as NaN.
The persistent schedule (`work_*`, `reduce_*`) is not validated; a persistent call that
finds a kernel is computed from the CSR like a non-persistent one (rows without a key:
NaN, where aiter leaves them unspecified).
"""

import functools
import os

import torch

from aiter._version import at_least
from aiter.jit.utils.chip_info import get_cu_num, get_gfx
from aiter.utility import dtypes

# Decode rows (prefill = 0) of hsa/<arch>/mla/mla_asm.csv, bf16/bf16 only:
# (q type, kv type, gqa, ps, qseqlen, lse).
KERNELS = {
    "gfx942": frozenset({
        ("bf16", "bf16", 128, 0, 0, 0),  # mla_dec_stage1_bf16_a16w16_subQ128_mqa128
        ("bf16", "bf16", 16, 1, 4, 0),  # mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps
        ("bf16", "bf16", 16, 0, 1, 0),  # mla_dec_stage1_bf16_a16w16_subQ16_mqa16
        ("bf16", "bf16", 16, 0, 4, 0),
        ("bf16", "bf16", 16, 0, 8, 0),
    }),
    "gfx950": frozenset({
        ("bf16", "bf16", 128, 0, 0, 0),
        ("bf16", "bf16", 16, 0, 1, 0),
        ("bf16", "bf16", 16, 0, 4, 0),
        ("bf16", "bf16", 16, 0, 8, 0),
        ("bf16", "bf16", 16, 1, 4, 1),  # persistent with lse
        ("bf16", "bf16", 32, 1, 4, 1),
        ("bf16", "bf16", 64, 1, 1, 1),
    }),
}

# The non-persistent kernels' KV byte offset is 32-bit (see the module docstring).
KV_BYTE_OFFSET_LIMIT = 2**32

# _use_persistent_mla_decode's batch gate (env AITER_MLA_DECODE_PERSISTENT_MAX_BATCH).
_PERSISTENT_MAX_BATCH_DEFAULT = 32


def _type_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bf16", dtypes.fp8: "fp8", torch.int8: "i8", torch.uint8: "u8"}
    return names.get(dtype, str(dtype))


def _check(condition: bool, message: str) -> None:
    """AITER_CHECK: a RuntimeError in Python."""
    if not condition:
        raise RuntimeError(message)


@functools.lru_cache
def get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype):
    """aiter/mla.py:get_meta_param: with `num_kv_splits` None, the i in 1..16 maximising
    CU occupancy of `bs * i` workgroups times `avg_kv / (avg_kv + 84.1 i)`, first on ties
    (n = 1 for large bs or short rows); and `arange(0, (bs + 1) n, n)` int32 (aiter: on the
    current CUDA device; the stand-in: the CPU). The fp8 block cap is not modelled."""
    if num_kv_splits is None:
        cu_num = get_cu_num()
        avg_kv = total_kv / bs

        def score(i):
            work = bs * i
            return work / ((work + cu_num - 1) // cu_num * cu_num) * avg_kv / (avg_kv + 84.1 * i)

        num_kv_splits = max(range(1, 17), key=score)
    indptr = torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits, dtype=torch.int32)
    return num_kv_splits, indptr


def _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q_dtype, kv_dtype) -> bool:
    """aiter/mla.py:_use_persistent_mla_decode."""
    profile = get_gfx() == "gfx950" and q_dtype == kv_dtype == torch.bfloat16 and nhead == 16 and max_seqlen_q == 1
    if not profile:
        return True
    max_batch = int(os.environ.get("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", _PERSISTENT_MAX_BATCH_DEFAULT))
    return max_batch <= 0 or bs < max_batch


def _natively_persistent(nhead: int, q_dtype, kv_dtype) -> bool:
    """The bf16 entries of the persistent path's "natively supported" list (aiter/mla.py)."""
    return nhead == 16 or (get_gfx() == "gfx950" and q_dtype == kv_dtype == torch.bfloat16)


def _kernel_key(q_dtype, kv_dtype, gqa: int, max_seqlen_q: int, persistent: bool, lse: int):
    """The csv key get_heuristic_kernel_mla matches, after asm_mla.cu's remaps."""
    q_type, kv_type = _type_name(q_dtype), _type_name(kv_dtype)
    ps, qseqlen = int(persistent), max_seqlen_q
    bf16 = q_type == kv_type == "bf16"
    if gqa == 128:
        qseqlen = 0
        if bf16 and get_gfx() == "gfx942":
            ps = 0
    elif gqa == 16 and q_type == "bf16" and persistent:
        qseqlen = 4
    if bf16 and persistent and get_gfx() == "gfx950":
        if gqa * max_seqlen_q >= 128 or gqa > 64:
            gqa, qseqlen = 32, 4
        elif gqa >= 16:
            gqa, qseqlen = 64, 1
    return q_type, kv_type, gqa, ps, qseqlen, lse


def _lookup_kernel(key, causal: int) -> None:
    """asm_mla.cu:get_heuristic_kernel_mla: an exact csv row or the AITER_CHECK failure."""
    q_type, kv_type, gqa, ps, qseqlen, lse = key
    _check(
        key in KERNELS.get(get_gfx(), frozenset()),
        f"get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q_type} kv_type:{kv_type} gqa:{gqa} "
        f"ps:{ps} prefill:0 causal:{causal} qseqlen:{qseqlen} lse:{lse} cprr:0",
    )


def _stage1_checks(q, kv_buffer, q_scale, kv_scale) -> None:
    """AITER_CHECKs of asm_mla.cu:mla_decode_stage1_asm_fwd."""
    _check(q.is_contiguous(), "Q must be contiguous")
    _check(kv_buffer.size(2) == 1, "only support num_kv_heads==1 for MLA")
    if kv_buffer.dtype not in (torch.int8, torch.uint8):
        _check(q.size(-1) == kv_buffer.size(3), "head_size of Q and KV must match")
    if q.dtype == dtypes.fp8:
        _check(q_scale is not None and kv_scale is not None, "fp8 Q needs q_scale and kv_scale")
    _check(q.dtype in (torch.bfloat16, dtypes.fp8), "unsupport Q dtype")
    _check(kv_buffer.dtype in (torch.bfloat16, dtypes.fp8, torch.int8, torch.uint8), "unsupport KV dtype")


def _index_array(name: str, t, min_len: int) -> torch.Tensor:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous()):
        raise IndexError(f"{name}: the kernels read a contiguous int32 array (got {getattr(t, 'dtype', t)})")
    if t.numel() < min_len:
        raise IndexError(f"{name}: {t.numel()} entries, the kernels read {min_len}")
    return t.cpu().long()


def _rows_of(kv_buffer, kv_indptr, kv_indices, kv_last_page_lens, bs: int, page_size: int,
             offset_limit: int | None = None):
    """Per request, the key rows [n, D] its pages name (IndexError where a GPU would read
    out of bounds, or, with `offset_limit`, a page whose bytes end past it: a 32-bit byte
    offset would wrap)."""
    pages = kv_buffer.shape[0]
    page_bytes = kv_buffer.stride(0) * kv_buffer.element_size() if pages else 0
    inner = kv_buffer[0] if pages else kv_buffer
    if pages and not inner.is_contiguous():
        raise IndexError("kv_buffer: aiter passes only stride(0); its pages must be dense")
    indptr = _index_array("kv_indptr", kv_indptr, bs + 1)[: bs + 1]
    indices = _index_array("kv_indices", kv_indices, 0)
    last = _index_array("kv_last_page_lens", kv_last_page_lens, bs)
    if bs and (indptr[0] < 0 or bool((indptr[1:] < indptr[:-1]).any()) or indptr[-1] > indices.numel()):
        raise IndexError(f"kv_indptr {indptr.tolist()} is not a non-decreasing range of kv_indices ({indices.numel()})")
    flat = kv_buffer.reshape(pages, page_size, -1)
    rows = []
    for b in range(bs):
        ids = indices[indptr[b]: indptr[b + 1]]
        if ids.numel() and (bool((ids < 0).any()) or bool((ids >= pages).any())):
            raise IndexError(f"kv_indices of request {b} name pages outside [0, {pages}): {ids.tolist()}")
        if ids.numel() and offset_limit is not None and (int(ids.max()) + 1) * page_bytes > offset_limit:
            raise IndexError(f"kv_indices of request {b} name page {int(ids.max())}, whose bytes end past "
                             f"{offset_limit}: the kernel's 32-bit KV byte offset wraps")
        keys = flat[ids].reshape(-1, flat.shape[-1])
        if page_size > 1 and ids.numel():
            keys = keys[: (ids.numel() - 1) * page_size + int(last[b])]
        rows.append(keys)
    return rows


def _attend(q_rows, keys, sm_scale: float, dv: int):
    """q [L, H, D], keys [n, D]: out [L, H, Dv] and natural-log lse [L, H] in float32,
    query i seeing the first n - L + i + 1 keys; NaN / -inf without a key (0/0)."""
    length, heads = q_rows.shape[:2]
    n = keys.shape[0]
    scores = torch.einsum("lhd,nd->lhn", q_rows.float(), keys.float()) * sm_scale
    seen = torch.arange(n)[None, :] < (n - length + torch.arange(length) + 1)[:, None]
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    m = scores.amax(-1) if n else torch.full((length, heads), float("-inf"))
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(scores - m_safe[..., None])
    total = p.sum(-1)
    out = torch.einsum("lhn,nv->lhv", p, keys[:, :dv].float()) / total[..., None]
    return out, m_safe + torch.log(total)


def _compute(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size,
             sm_scale, offset_limit=None):
    """(out [total_s, H, Dv], lse [total_s, H]) in float32 over the CSR."""
    bs = qo_indptr.shape[0] - 1
    qo = _index_array("qo_indptr", qo_indptr, bs + 1)
    rows = _rows_of(kv_buffer, kv_indptr, kv_indices, kv_last_page_lens, bs, page_size, offset_limit)
    total_s, heads, dv = o.shape
    out = torch.full((total_s, heads, dv), float("nan"))
    lse = torch.full((total_s, heads), float("nan"))
    for b in range(bs):
        lo, hi = int(qo[b]), int(qo[b + 1])
        if not (0 <= lo <= hi <= total_s and hi - lo <= max_seqlen_q):
            raise IndexError(f"qo_indptr[{b}:{b + 2}] = [{lo}, {hi}] outside the {total_s} query rows")
        out[lo:hi], lse[lo:hi] = _attend(q[lo:hi].cpu(), rows[b], sm_scale, dv)
    return out, lse


def _check_splits_indptr(num_kv_splits_indptr, bs: int, n: int) -> None:
    indptr = _index_array("num_kv_splits_indptr", num_kv_splits_indptr, bs + 1)[: bs + 1]
    if not torch.equal(indptr, torch.arange(bs + 1) * n):
        raise IndexError(f"num_kv_splits_indptr {indptr.tolist()} is not [0, {n}, ..] with num_kv_splits={n}")


def mla_decode_fwd(
    q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
    page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
    num_kv_splits=None, num_kv_splits_indptr=None,
    work_meta_data=None, work_indptr=None, work_info_set=None,
    reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None,
    q_scale=None, kv_scale=None, intra_batch_mode=False,
    return_logits=False, return_lse=False,
    g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True,
):
    """aiter's MLA decode: writes `o`, returns `(logits, final_lse)` (module docstring)."""
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    if kv_buffer.dtype != torch.uint8:
        _, _, _, qk_head_dim = kv_buffer.shape
    else:
        _, _, qk_head_dim = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim**0.5)
    total_s, nhead, v_head_dim = o.shape
    bs = qo_indptr.shape[0] - 1
    total_kv = kv_indices.shape[0]
    persistent = work_meta_data is not None
    if persistent and num_kv_splits is None:
        persistent = _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q.dtype, kv_buffer.dtype)
    if persistent:
        return _persistent(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                           page_size, sm_scale, reduce_partial_map, q_scale, kv_scale, return_lse, causal)
    if num_kv_splits is None or num_kv_splits_indptr is None:
        num_kv_splits, num_kv_splits_indptr = get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, q.dtype)
    n = num_kv_splits
    maybe_final_out = not (nhead in (8, 16) and max_seqlen_q == 1)
    logits = torch.full((total_s, n, nhead, v_head_dim), float("nan"), device=o.device)
    final_lse = torch.full((total_s, nhead), float("nan"), device=o.device) if return_lse else None
    _stage1_checks(q, kv_buffer, q_scale, kv_scale)
    # Before v0.1.19 (#4308) stage 1 asks for an lse kernel whenever final_lse is passed.
    lse_flag = 0 if at_least("0.1.19") else int(return_lse)
    _lookup_kernel(_kernel_key(q.dtype, kv_buffer.dtype, nhead // nhead_kv, max_seqlen_q, False, lse_flag),
                   1 if max_seqlen_q == 1 else int(causal))
    _check_splits_indptr(num_kv_splits_indptr, bs, n)
    bf16 = q.dtype == kv_buffer.dtype == torch.bfloat16
    out, lse = _compute(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                        page_size, sm_scale, KV_BYTE_OFFSET_LIMIT if bf16 else None)
    o.copy_(out.to(o.dtype))
    if n == 1 and (q.dtype == dtypes.fp8 or (q.dtype == torch.bfloat16 and max_seqlen_q == 4)
                   or (bf16 and nhead in (32, 8))):
        # The early return: no reduce; stage 1 (lse_flag 0) does not write final_lse.
        attn_lse = torch.full((total_s, n, nhead, 1), float("nan"), device=o.device)
        return o.view(total_s, nhead, v_head_dim), final_lse if return_lse else attn_lse
    if final_lse is not None and not (maybe_final_out and n == 1):  # FINAL_OUT copies and stores no lse
        final_lse.copy_(lse)
    return logits, final_lse


def _persistent(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size,
                sm_scale, reduce_partial_map, q_scale, kv_scale, return_lse, causal):
    """The persistent path: the head fold, then stage 1 with `lse = return_lse`."""
    total_s, nhead, v_head_dim = o.shape
    kernel_heads = nhead
    if not _natively_persistent(nhead, q.dtype, kv_buffer.dtype):
        assert nhead in range(32, 129, 16), f"{nhead=} and {max_seqlen_q=} not supported"
        kernel_heads = 16
        fold = nhead // 16
        q.view(total_s * fold, 16, -1)  # aiter views q and o as 16-head rows (raises if not viewable)
        o.view(total_s * fold, 16, -1)
    partials = reduce_partial_map.size(0)
    logits = torch.full((partials * max_seqlen_q, 1, kernel_heads, v_head_dim), float("nan"), device=o.device)
    final_lse = torch.full((total_s, nhead), float("nan"), device=o.device) if return_lse else None
    _stage1_checks(q, kv_buffer, q_scale, kv_scale)
    _lookup_kernel(_kernel_key(q.dtype, kv_buffer.dtype, kernel_heads, max_seqlen_q, True, int(return_lse)),
                   1 if max_seqlen_q == 1 else int(causal))
    out, lse = _compute(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                        page_size, sm_scale)
    o.copy_(out.to(o.dtype))
    if final_lse is not None:
        final_lse.copy_(lse)
    return logits, final_lse
