"""aiter backend of the sparse-indexer ops (ROCm), written against aiter's documented API.

Used only where aiter's kernel has exactly graphsafe's semantics and layout: each op's
`supports_*` predicate (its registry record's `supports`) accepts those signatures, and
the registry hands every other one to the next backend (Triton), once per signature.
`prepare_*` resolves aiter's function once and returns the runner. Guards:

* aiter's fp8 type: on gfx942 (MI300) `aiter.dtypes.fp8` is float8_e4m3fnuz and its
  kernels quantise with 240 and read the cache bytes as fnuz, which is not graphsafe's
  e4m3fn cache. The adapters call aiter only when `aiter.dtypes.fp8` is
  float8_e4m3fn (gfx950 and later).
* `indexer_k_quant_and_cache` (aiter.ops.cache): its kernel reduces the group amax over a
  fixed thread group: used only for quant_block_size == 128 and contiguous `k`.
  Note: aiter stores `k * (1 / s)` (a reciprocal multiply) where graphsafe divides: a value
  may land one e4m3 step away (the case's comparison allows one step).
* `cp_gather_indexer_k_quant_cache` (aiter.ops.cache): same cache layout and row mapping.
  aiter's kernel wants `dst_scale` as bytes `[N, 4 * G]` (we pass a uint8 view). Unlike
  graphsafe it may not guard rows past `cu_seq_lens[B]` (N as an upper bound): not
  verifiable here, see the family report.
* `fp8_mqa_logits` (aiter.ops.triton[.attention].fp8_mqa_logits): takes (Q, KV, kv_scales,
  weights, cu_starts, cu_ends) and returns a -inf-initialised `[M, N]` view of a buffer
  whose rows are padded to 256 columns: made contiguous here. Power-of-two H and D only.
* `fp8_paged_mqa_logits` (aiter.ops.triton[.attention].pa_mqa_logits,
  `deepgemm_fp8_paged_mqa_logits`): wants a 4-D cache `[NB, BS, 1, D + 4]`, writes only
  the valid logits into a caller-provided output, which must be pre-filled with -inf.
  Non-preshuffled caches with KVBlockSize > 1 have a public illegal-address report, so it
  is used for block_size == 1 only (vLLM uses the preshuffled layout for larger blocks).
"""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def _aiter_fp8_is_e4m3fn() -> bool:
    try:
        from aiter import dtypes

        return dtypes.fp8 == torch.float8_e4m3fn
    except Exception:  # noqa: BLE001 - any failure means "do not use aiter's fp8 kernels"
        return False


@functools.cache
def _module(*paths: str):
    for path in paths:
        try:
            return importlib.import_module(path)
        except Exception:  # noqa: BLE001 - older/newer aiter releases move these modules
            continue
    return None


def _cache_ops():
    return _module("aiter.ops.cache", "aiter")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _nothing(*args, **kwargs) -> None:
    return None


def _cache_fn(name: str):
    ops = _cache_ops()
    return getattr(ops, name, None) if ops is not None else None


def _mqa_module():
    return _module("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")


def _paged_module():
    return _module("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits")


# -- indexer_k_quant_and_cache ---------------------------------------------------------------
def supports_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None) -> bool:
    return (_cache_fn("indexer_k_quant_and_cache") is not None and _aiter_fp8_is_e4m3fn()
            and quant_block_size == 128 and k.is_contiguous())


def prepare_indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None):
    if k.shape[0] == 0:
        return _nothing
    fn = _cache_fn("indexer_k_quant_and_cache")

    def run(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None) -> None:
        # aiter's kernel takes int64 slots and a plain string format ("" = float32 scales).
        fn(k, kv_cache, slot_mapping.long(), quant_block_size, scale_fmt or "")

    return run


# -- cp_gather_indexer_k_quant_cache -----------------------------------------------------------
def supports_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> bool:
    return (_cache_fn("cp_gather_indexer_k_quant_cache") is not None and dst_k.is_contiguous()
            and dst_scale.is_contiguous() and block_table.is_contiguous())


def prepare_cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    n = dst_k.shape[0]
    if n == 0 or block_table.shape[0] == 0:
        return _nothing
    fn = _cache_fn("cp_gather_indexer_k_quant_cache")

    def run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
        fn(kv_cache, dst_k, dst_scale.view(torch.uint8).view(n, -1), block_table, cu_seq_lens)

    return run


# -- fp8_mqa_logits ----------------------------------------------------------------------------
def supports_fp8_mqa_logits(q, k, k_scale, weights, ks, ke) -> bool:
    m, h, d = q.shape
    return (_mqa_module() is not None and _aiter_fp8_is_e4m3fn() and _pow2(h) and _pow2(d)
            and m > 0 and k.shape[0] > 0)


def prepare_fp8_mqa_logits(q, k, k_scale, weights, ks, ke):
    fn = _mqa_module().fp8_mqa_logits

    def run(q, k, k_scale, weights, ks, ke):
        out = fn(q, k, k_scale, weights, ks, ke)
        return out if out.is_contiguous() else out.contiguous()

    return run


# -- fp8_paged_mqa_logits ----------------------------------------------------------------------
def supports_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_model_len) -> bool:
    return (_paged_module() is not None and _aiter_fp8_is_e4m3fn() and kv_cache.shape[1] == 1
            and q.shape[0] > 0)


def prepare_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_model_len):
    b, next_n = q.shape[:2]
    block_size = kv_cache.shape[1]
    device = q.device
    fn = _paged_module().deepgemm_fp8_paged_mqa_logits

    def run(q, kv_cache, weights, context_lens, block_table, max_model_len):
        out = torch.full((b * next_n, max_model_len), float("-inf"), dtype=torch.float32, device=device)
        fn(q, kv_cache.unsqueeze(2), weights, out, context_lens, block_table, max_model_len,
           Preshuffle=False, KVBlockSize=block_size)
        return out

    return run
