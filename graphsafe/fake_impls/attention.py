"""Fakes and input checks of the GQA attention ops (`paged_attention_decode`, `flash_attn_varlen`)."""

from __future__ import annotations

import torch

from graphsafe.fake_impls import _checks as c

FP8 = torch.float8_e4m3fn
FP8_MODES = ("auto", "on", "off")


def _check_heads(op: str, arg: str, hk, hq) -> None:
    if hk < 1 or hq % hk != 0:
        c.fail(op, arg, f"a head count Hk >= 1 that divides Hq = {hq} (GQA)", f"Hk = {hk}")


def check_paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    op = "paged_attention_decode"
    c.tensor(op, "q", q, dtypes=c.HALF_DTYPES, ndim=3)
    dev = q.device
    b, hq, d = q.shape
    c.tensor(op, "k_cache", k_cache, dtypes=(q.dtype, FP8), ndim=4, device=dev)
    c.shape(op, "k_cache", k_cache, (None, None, None, d), "[num_blocks, block_size, Hk, D]")
    nb, bs, hk = k_cache.shape[:3]
    if nb < 1 or bs < 1:
        c.fail(op, "k_cache", "a cache of at least 1 block of at least 1 token", f"shape {list(k_cache.shape)}")
    _check_heads(op, "k_cache", hk, hq)
    c.tensor(op, "v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, device=dev)
    c.shape(op, "v_cache", v_cache, (nb, bs, hk, None), "[num_blocks, block_size, Hk, Dv]")
    c.tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    c.shape(op, "block_table", block_table, (b, None), "[B, max_blocks_per_seq]")
    c.tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev)
    c.shape(op, "seq_lens", seq_lens, (b,), "[B]")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        c.last_dim_contiguous(op, name, x)
    c.fp8_cache_scale(op, "k_scale", k_scale, k_cache, dev, "when the caches are float8_e4m3fn")
    c.fp8_cache_scale(op, "v_scale", v_scale, v_cache, dev, "when the caches are float8_e4m3fn")


def fake_paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    check_paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale)
    b, hq, _ = q.shape
    return q.new_empty((b, hq, v_cache.shape[3]))


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


def check_flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    fp8: str = "off",
) -> None:
    op = "flash_attn_varlen"
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
    c.tensor(op, "cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1, device=dev)
    if cu_seqlens_q.shape[0] < 1:
        c.fail(op, "cu_seqlens_q", "of shape [B + 1] with B >= 0", f"shape {list(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    c.tensor(op, "cu_seqlens_k", cu_seqlens_k, dtypes=(torch.int32,), ndim=1, device=dev)
    c.shape(op, "cu_seqlens_k", cu_seqlens_k, (batch + 1,), "[B + 1] (as cu_seqlens_q)")
    c.contiguous(op, "cu_seqlens_q", cu_seqlens_q)
    c.contiguous(op, "cu_seqlens_k", cu_seqlens_k)
    if max_seqlen_q < 0:
        c.fail(op, "max_seqlen_q", "an int >= 0", max_seqlen_q)
    if max_seqlen_k < 0:
        c.fail(op, "max_seqlen_k", "an int >= 0", max_seqlen_k)
    if fp8 not in FP8_MODES:
        c.fail(op, "fp8", "one of 'auto', 'on', 'off'", repr(fp8))
    for name, x in (("q", q), ("k", k), ("v", v)):
        c.last_dim_contiguous(op, name, x)
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _check_descale(op, name, x, q, batch, hk)


def fake_flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off",
):
    check_flash_attn_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
        q_descale, k_descale, v_descale, fp8,
    )
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=output_dtype(q.dtype))
