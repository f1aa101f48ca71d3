"""Fakes and input checks of the GQA attention ops (`paged_attention_decode`,
`paged_attention_prefill`, `flash_attn_varlen`). Each takes the op's bound call
(`OpSpec.call`: a named tuple of the stub's arguments)."""

from __future__ import annotations

import math

import torch

from graphsafe import checks as c

FP8 = torch.float8_e4m3fn
FP8_MODES = ("auto", "on", "off")


def _check_heads(op: str, arg: str, hk, hq) -> None:
    if hk < 1 or hq % hk != 0:
        c.fail(op, arg, f"a head count Hk >= 1 that divides Hq = {hq} (GQA)", f"Hk = {hk}")


def check_variants(op: str, window_left, softcap, sinks, num_q_heads, device: torch.device) -> None:
    """The attention variants every GQA op takes: `window_left` an int >= -1 (-1: no
    window), `softcap` a finite float >= 0 (0: none), `sinks` None or float32 `[Hq]`."""
    if isinstance(window_left, bool) or not isinstance(window_left, (int, torch.SymInt)) or window_left < -1:
        c.fail(op, "window_left", "an int >= -1 (the keys left of the query's own it sees; -1: no window)",
               repr(window_left))
    if not isinstance(softcap, (int, float, torch.SymFloat)) or not (math.isfinite(softcap) and softcap >= 0):
        c.fail(op, "softcap", "a finite float >= 0 (0: no softcap)", repr(softcap))
    if sinks is not None:
        c.tensor(op, "sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device)
        c.shape(op, "sinks", sinks, (num_q_heads,), "[Hq]")


def _check_paged_cache(op: str, q: torch.Tensor, k_cache, v_cache, block_table, seq_lens, batch: int,
                       k_scale, v_scale) -> None:
    """The paged K/V cache of `reshape_and_cache`, its block table and lengths."""
    dev = q.device
    hq, d = q.shape[1:]
    c.tensor(op, "k_cache", k_cache, dtypes=(q.dtype, FP8), ndim=4, device=dev)
    c.shape(op, "k_cache", k_cache, (None, None, None, d), "[num_blocks, block_size, Hk, D]")
    nb, bs, hk = k_cache.shape[:3]
    if nb < 1 or bs < 1:
        c.fail(op, "k_cache", "a cache of at least 1 block of at least 1 token", f"shape {list(k_cache.shape)}")
    _check_heads(op, "k_cache", hk, hq)
    c.tensor(op, "v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, device=dev)
    c.shape(op, "v_cache", v_cache, (nb, bs, hk, None), "[num_blocks, block_size, Hk, Dv]")
    c.tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    c.shape(op, "block_table", block_table, (batch, None), "[B, max_blocks_per_seq]")
    c.tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev)
    c.shape(op, "seq_lens", seq_lens, (batch,), "[B]")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        c.last_dim_contiguous(op, name, x)
    c.fp8_cache_scale(op, "k_scale", k_scale, k_cache, dev, "when the caches are float8_e4m3fn")
    c.fp8_cache_scale(op, "v_scale", v_scale, v_cache, dev, "when the caches are float8_e4m3fn")


def check_paged_attention_decode(call) -> None:
    op = "paged_attention_decode"
    q = call.q
    c.tensor(op, "q", q, dtypes=c.HALF_DTYPES, ndim=3)
    _check_paged_cache(op, q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, q.shape[0], call.k_scale,
                       call.v_scale)
    check_variants(op, call.window_left, call.softcap, call.sinks, q.shape[1], q.device)


def fake_paged_attention_decode(call):
    check_paged_attention_decode(call)
    b, hq, _ = call.q.shape
    return call.q.new_empty((b, hq, call.v_cache.shape[3]))


def _check_cu_seqlens(op: str, arg: str, cu: torch.Tensor, device: torch.device, batch: int | None) -> int:
    """`[B + 1]` int32 contiguous (B from this tensor when `batch` is None); returns B."""
    c.tensor(op, arg, cu, dtypes=(torch.int32,), ndim=1, device=device)
    if batch is None:
        if cu.shape[0] < 1:
            c.fail(op, arg, "of shape [B + 1] with B >= 0", f"shape {list(cu.shape)}")
        batch = cu.shape[0] - 1
    else:
        c.shape(op, arg, cu, (batch + 1,), "[B + 1] (as cu_seqlens_q)")
    c.contiguous(op, arg, cu)
    return batch


def check_paged_attention_prefill(call) -> None:
    op = "paged_attention_prefill"
    q = call.q
    c.tensor(op, "q", q, dtypes=c.HALF_DTYPES, ndim=3)
    batch = _check_cu_seqlens(op, "cu_seqlens_q", call.cu_seqlens_q, q.device, None)
    _check_paged_cache(op, q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, batch, call.k_scale,
                       call.v_scale)
    if call.max_seqlen_q < 0:
        c.fail(op, "max_seqlen_q", "an int >= 0", call.max_seqlen_q)
    check_variants(op, call.window_left, call.softcap, call.sinks, q.shape[1], q.device)


def fake_paged_attention_prefill(call):
    check_paged_attention_prefill(call)
    q = call.q
    return q.new_empty((q.shape[0], q.shape[1], call.v_cache.shape[3]))


def _check_descale(op: str, arg: str, descale, q: torch.Tensor, batch, hk) -> None:
    if descale is None:
        return
    if q.dtype != FP8:
        c.fail(op, arg, "None unless q, k, v are float8_e4m3fn", f"a tensor with q of dtype {q.dtype}")
    c.tensor(op, arg, descale, dtypes=(torch.float32,), device=q.device)
    shape = tuple(descale.shape)
    if not (shape == (1,) or shape == (batch, hk)):
        c.fail(op, arg, f"of shape [1] (per tensor) or [B, Hk] = [{batch}, {hk}]", f"shape {list(shape)}")


def output_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """bf16 for fp8 inputs; the input dtype otherwise."""
    return torch.bfloat16 if q_dtype == FP8 else q_dtype


def check_flash_attn_varlen(call) -> None:
    op = "flash_attn_varlen"
    q, k, v, cu_seqlens_q, cu_seqlens_k = call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k
    max_seqlen_q, max_seqlen_k, fp8 = call.max_seqlen_q, call.max_seqlen_k, call.fp8
    c.tensor(op, "q", q, dtypes=(*c.HALF_DTYPES, FP8), ndim=3)
    dev = q.device
    hq, d = q.shape[1:]
    c.tensor(op, "k", k, ndim=3, device=dev)
    c.same_dtype(op, "k", k, "q", q)
    c.shape(op, "k", k, (None, None, d), "[Tk, Hk, D]")
    tk, hk = k.shape[:2]
    _check_heads(op, "k", hk, hq)
    c.tensor(op, "v", v, ndim=3, device=dev)
    c.same_dtype(op, "v", v, "q", q)
    c.shape(op, "v", v, (tk, hk, None), "[Tk, Hk, Dv]")
    batch = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, dev, None)
    _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, dev, batch)
    if max_seqlen_q < 0:
        c.fail(op, "max_seqlen_q", "an int >= 0", max_seqlen_q)
    if max_seqlen_k < 0:
        c.fail(op, "max_seqlen_k", "an int >= 0", max_seqlen_k)
    if fp8 not in FP8_MODES:
        c.fail(op, "fp8", "one of 'auto', 'on', 'off'", repr(fp8))
    for name, x in (("q", q), ("k", k), ("v", v)):
        c.last_dim_contiguous(op, name, x)
    for name, x in (("q_descale", call.q_descale), ("k_descale", call.k_descale), ("v_descale", call.v_descale)):
        _check_descale(op, name, x, q, batch, hk)
    check_variants(op, call.window_left, call.softcap, call.sinks, hq, dev)


def fake_flash_attn_varlen(call):
    check_flash_attn_varlen(call)
    q = call.q
    return q.new_empty((q.shape[0], q.shape[1], call.v.shape[2]), dtype=output_dtype(q.dtype))
