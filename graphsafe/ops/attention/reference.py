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
def _gather_pages(cache: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B, MB] block ids (each in range) -> the requests' tokens `[B, MB * block_size, Hk, Dx]`
    in float32, 0 where `keep` ([B, MB * block_size]) is False: tokens the request does not
    read never reach the arithmetic (a NaN there stays out; no 0 * NaN)."""
    b, mb = blocks.shape
    pages = cache[blocks].reshape(b, mb * cache.shape[1], *cache.shape[2:]).float()
    return torch.where(keep[:, :, None, None], pages, torch.zeros((), device=pages.device))


def paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    b, hq, d = q.shape
    num_blocks, block_size, hk, dv = v_cache.shape
    mb = block_table.shape[1]
    max_len = mb * block_size
    lens = seq_lens.long().clamp(0, max_len)
    # Token j of request b exists when j < seq_lens[b] and its block id is in range: an
    # id outside [0, num_blocks) is a padding block (-1 documented) and holds no key.
    ids = block_table.long()
    block_ok = (ids >= 0) & (ids < num_blocks)
    pos = torch.arange(max_len, device=q.device)
    allowed = (pos[None, :] < lens[:, None]) & block_ok.repeat_interleave(block_size, dim=1)
    blocks = torch.where(block_ok, ids, torch.zeros_like(ids))  # any in-range id; masked below
    keys = _gather_pages(k_cache, blocks, allowed)
    values = _gather_pages(v_cache, blocks, allowed)
    qg = q.float().reshape(b, hk, hq // hk, d)
    score_scale = scale * k_scale.float().reshape(()) if k_cache.dtype == FP8 else scale
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * score_scale
    out = _masked_softmax_apply(scores, allowed[:, None, None, :], values, "bhgl,blhd->bhgd")
    if k_cache.dtype == FP8:
        out = out * v_scale.float().reshape(())  # after the sum, as the kernels apply it
    return _fresh(out.reshape(b, hq, dv), q.dtype)


# -- varlen prefill ----------------------------------------------------------------------
def sequence_bounds(cu: torch.Tensor, total: int) -> torch.Tensor:
    """The boundaries the op uses: the running maximum of `cu_seqlens`, clamped to
    `[0, total]` (sequence b is rows `[c[b], c[b + 1])`): a sequence is cut at the
    tensor's end, and one whose cu_seqlens entry decreases is empty."""
    return cu.long().cummax(0).values.clamp(0, total)


def _pad(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Packed `[T, H, Dx]` -> padded `[B, max_len, H, Dx]` (float32); zeros past each sequence."""
    pos = torch.arange(max_len, device=x.device)
    valid = pos[None, :] < lens[:, None]
    # Row T of the extended tensor is zeros: padding positions (and T == 0) read it.
    x_ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return x_ext[torch.where(valid, starts[:, None] + pos[None, :], x.shape[0])].float()


def _descaled(x: torch.Tensor, descale: torch.Tensor | None, lens: torch.Tensor) -> torch.Tensor:
    """Padded `[B, L, Hk, ...]` times its `[1]` or `[B, Hk]` descale, 0 past each sequence
    (a NaN or inf descale never turns the padding into NaN)."""
    if descale is None:
        return x
    batch, max_len, hk = x.shape[:3]
    lead = (batch, 1, hk) if descale.dim() == 2 else (1, 1, 1)
    x = x * descale.float().reshape(*lead, *([1] * (x.dim() - 3)))
    valid = torch.arange(max_len, device=x.device)[None, :] < lens[:, None]
    return torch.where(valid.reshape(batch, max_len, *([1] * (x.dim() - 2))), x, torch.zeros((), device=x.device))


def flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off",
):
    out_dtype = output_dtype(q.dtype)
    if quantize_inputs(fp8, q.dtype, q.device):
        # The fp8 path's numerics: each of q, k, v quantised per tensor, then as fp8 inputs.
        (q, q_descale), (k, k_descale), (v, v_descale) = (quantize_per_tensor(x) for x in (q, k, v))
    tq, hq, d = q.shape
    hk, dv = v.shape[1:]
    batch = cu_seqlens_q.shape[0] - 1
    cu_q, cu_k = sequence_bounds(cu_seqlens_q, tq), sequence_bounds(cu_seqlens_k, k.shape[0])
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]

    qp = _descaled(_pad(q, cu_q[:-1], lens_q, max_seqlen_q).reshape(batch, max_seqlen_q, hk, hq // hk, d),
                   q_descale, lens_q)
    kp = _descaled(_pad(k, cu_k[:-1], lens_k, max_seqlen_k), k_descale, lens_k)
    vp = _descaled(_pad(v, cu_k[:-1], lens_k, max_seqlen_k), v_descale, lens_k)

    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp, kp) * scale
    i = torch.arange(max_seqlen_q, device=q.device)
    j = torch.arange(max_seqlen_k, device=q.device)
    allowed = (j[None, None, :] < lens_k[:, None, None]).expand(batch, max_seqlen_q, max_seqlen_k)
    if causal:
        # Bottom-right aligned: query i of a sequence sees keys j <= i + (len_k - len_q).
        allowed = allowed & (j[None, None, :] <= i[None, :, None] + (lens_k - lens_q)[:, None, None])
    out = _masked_softmax_apply(scores, allowed[:, None, None], vp, "bhgqk,bkhd->bqhgd")
    # A row that sees no key is 0, also where a value it does not see is NaN (0 * NaN).
    sees = allowed.any(dim=-1)[:, :, None, None, None]
    out = torch.where(sees, out, torch.zeros((), device=out.device)).reshape(batch * max_seqlen_q, hq, dv)

    # Back to packed rows; rows outside every sequence (before c[0], at or past c[B]) get 0.
    t = torch.arange(tq, device=q.device)
    seq = torch.searchsorted(cu_q[1:].contiguous(), t, right=True).clamp(max=max(batch - 1, 0))
    pos = t - cu_q[seq]
    valid = (t < cu_q[-1]) & (pos >= 0) & (pos < max_seqlen_q)
    out_ext = torch.cat([out, out.new_zeros((1, hq, dv))])
    return _fresh(out_ext[torch.where(valid, seq * max_seqlen_q + pos, batch * max_seqlen_q)], out_dtype)
