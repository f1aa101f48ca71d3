"""Reference backend of the GQA attention ops: the executable spec, vectorised PyTorch in
float32. No host sync, no Python loops over tokens or requests: ragged batches are
padded to the caller's `max_seqlen_*` (host ints) and masked.
"""

from __future__ import annotations

import torch

from graphsafe.fake_impls.attention import FP8, output_dtype
from graphsafe.ops.attention.fp8 import quantize_inputs, quantize_per_tensor

NEG_INF = float("-inf")


def _masked_softmax_apply(
    scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor, equation: str
) -> torch.Tensor:
    """softmax(scores) over allowed keys (last dim), applied to `values` with `equation`.
    Rows without an allowed key give 0 (not NaN)."""
    if scores.shape[-1] == 0:  # no keys at all: the (empty) sum below is 0
        return torch.einsum(equation, scores, values)
    scores = scores.masked_fill(~allowed, NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # exp(-inf) = 0 on masked keys
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum(equation, p, values)


def _fresh(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor of `dtype` (the real impls' output strides, also when empty)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


# -- paged decode ------------------------------------------------------------------------
def _gather_pages(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, MB] block ids -> the requests' tokens `[B, MB * block_size, Hk, Dx]` in float32."""
    b, mb = blocks.shape
    pages = cache[blocks]  # [B, MB, BS, Hk, Dx]
    return pages.reshape(b, mb * cache.shape[1], *cache.shape[2:]).float()


def paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    b, hq, d = q.shape
    block_size, hk, dv = v_cache.shape[1:]
    mb = block_table.shape[1]
    max_len = mb * block_size
    lens = seq_lens.long().clamp(0, max_len)
    # Entries past a request's last used block may hold anything (-1, stale ids): read block 0.
    used = torch.arange(mb, device=q.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    blocks = torch.where(used, block_table.long(), torch.zeros_like(block_table, dtype=torch.long))
    keys = _gather_pages(k_cache, blocks)
    values = _gather_pages(v_cache, blocks)
    if k_cache.dtype == FP8:
        keys = keys * k_scale.float().reshape(())
        values = values * v_scale.float().reshape(())
    qg = q.float().reshape(b, hk, hq // hk, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale
    allowed = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    out = _masked_softmax_apply(scores, allowed, values, "bhgl,blhd->bhgd")
    return _fresh(out.reshape(b, hq, dv), q.dtype)


# -- varlen prefill ----------------------------------------------------------------------
def _pad(x: torch.Tensor, cu: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Packed `[T, H, Dx]` -> padded `[B, max_len, H, Dx]`; zeros past each sequence."""
    pos = torch.arange(max_len, device=x.device)
    valid = pos[None, :] < lens[:, None]
    # Row T of the extended tensor is zeros: padding positions (and T == 0) read it.
    x_ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return x_ext[torch.where(valid, cu[:-1, None] + pos[None, :], x.shape[0])]


def _descale(descale: torch.Tensor | None, batch: int, hk: int, ndim: int) -> torch.Tensor | float:
    """`[1]` or `[B, Hk]` descale, broadcastable to padded `[B, L, Hk, ...]` (ndim dims)."""
    if descale is None:
        return 1.0
    lead = (batch, 1, hk) if descale.dim() == 2 else (1, 1, 1)
    return descale.float().reshape(*lead, *([1] * (ndim - 3)))


def flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="auto",
):
    out_dtype = output_dtype(q.dtype)
    if quantize_inputs(fp8, q.dtype, q.device):
        # The fp8 path's numerics: each of q, k, v quantised per tensor, then as fp8 inputs.
        (q, q_descale), (k, k_descale), (v, v_descale) = (quantize_per_tensor(x) for x in (q, k, v))
    tq, hq, d = q.shape
    hk, dv = v.shape[1:]
    batch = cu_seqlens_q.shape[0] - 1
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]

    qp = _pad(q, cu_q, lens_q, max_seqlen_q).float().reshape(batch, max_seqlen_q, hk, hq // hk, d)
    kp = _pad(k, cu_k, lens_k, max_seqlen_k).float()
    vp = _pad(v, cu_k, lens_k, max_seqlen_k).float()
    qp = qp * _descale(q_descale, batch, hk, 5)
    kp = kp * _descale(k_descale, batch, hk, 4)
    vp = vp * _descale(v_descale, batch, hk, 4)

    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp, kp) * scale
    i = torch.arange(max_seqlen_q, device=q.device)
    j = torch.arange(max_seqlen_k, device=q.device)
    allowed = (j[None, None, :] < lens_k[:, None, None]).expand(batch, max_seqlen_q, max_seqlen_k)
    if causal:
        # Bottom-right aligned: query i of a sequence sees keys j <= i + (len_k - len_q).
        allowed = allowed & (j[None, None, :] <= i[None, :, None] + (lens_k - lens_q)[:, None, None])
    out = _masked_softmax_apply(scores, allowed[:, None, None], vp, "bhgqk,bkhd->bqhgd")
    out = out.reshape(batch * max_seqlen_q, hq, dv)

    # Back to packed rows; rows outside every sequence (t >= cu_seqlens_q[B]) get 0.
    t = torch.arange(tq, device=q.device)
    seq = torch.searchsorted(cu_q[1:].contiguous(), t, right=True).clamp(max=max(batch - 1, 0))
    pos = t - cu_q[seq]
    valid = (t < cu_q[-1]) & (pos >= 0) & (pos < max_seqlen_q)
    out_ext = torch.cat([out, out.new_zeros((1, hq, dv))])
    return _fresh(out_ext[torch.where(valid, seq * max_seqlen_q + pos, batch * max_seqlen_q)], out_dtype)
