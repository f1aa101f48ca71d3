"""Reference backend of the GQA attention ops: the executable spec, vectorised PyTorch in
float32. No host sync, no Python loops over tokens or requests: ragged batches are
padded to the caller's `max_seqlen_*` (host ints) and masked. The records (`Backend`)
at the bottom.
"""

from __future__ import annotations

import torch

from graphsafe.ops.attention.fake import FP8, output_dtype
from graphsafe.ops.attention.fp8 import quantize_inputs, quantize_per_tensor
from graphsafe.registry import Backend

NEG_INF = float("-inf")


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """The logit softcap (Gemma-2): `softcap * tanh(s / softcap)`; 0 means none."""
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _masked_softmax_apply(
    scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor, equation: str,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scores) over allowed keys (last dim), applied to `values` with `equation`.
    `sinks` (broadcast against `scores[..., :1]`): a logit per row that joins the
    normaliser and carries no value, `exp(sink - m)` added to the sum with `m` the row
    max of the scores (the kernels' arithmetic: +inf gives 0, -inf no change). Rows
    without an allowed key give 0 (not NaN), whatever the sink."""
    if scores.shape[-1] == 0:  # no keys at all: the (empty) sum below is 0
        return torch.einsum(equation, scores, values)
    scores = scores.masked_fill(~allowed, NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # exp(-inf) = 0 on masked keys
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = torch.where(allowed.any(dim=-1, keepdim=True), denom + torch.exp(sinks - row_max), denom)
    # (A NaN normaliser, from a NaN score or sink, keeps the row NaN.)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.einsum(equation, p, values)


def _visible(lens_q: torch.Tensor, lens_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
             window_left: int) -> torch.Tensor:
    """[B, max_q, max_k]: query i of sequence b sees key j. Keys j < len_k; with the query
    at key position `i + (len_k - len_q)` (bottom-right alignment), `causal` hides keys
    after it and `window_left >= 0` keys more than `window_left` before it."""
    i = torch.arange(max_q, device=lens_q.device)[None, :, None]
    j = torch.arange(max_k, device=lens_q.device)[None, None, :]
    position = i + (lens_k - lens_q)[:, None, None]
    allowed = (j < lens_k[:, None, None]).expand(lens_q.shape[0], max_q, max_k)
    if causal:
        allowed = allowed & (j <= position)
    if window_left >= 0:
        allowed = allowed & (j >= position - window_left)
    return allowed


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


def _paged_keys(k_cache, v_cache, block_table, lens_k):
    """(keys, values `[B, L, Hk, Dx]` float32, token_ok `[B, L]`), L = max_blocks *
    block_size: token j of request b exists when `j < lens_k[b]` and its block id is in
    `[0, num_blocks)` (an id outside, -1 documented, is a padding block: no key)."""
    num_blocks, block_size = k_cache.shape[:2]
    ids = block_table.long()
    block_ok = (ids >= 0) & (ids < num_blocks)
    pos = torch.arange(ids.shape[1] * block_size, device=k_cache.device)
    token_ok = (pos[None, :] < lens_k[:, None]) & block_ok.repeat_interleave(block_size, dim=1)
    blocks = torch.where(block_ok, ids, torch.zeros_like(ids))  # any in-range id; masked below
    return _gather_pages(k_cache, blocks, token_ok), _gather_pages(v_cache, blocks, token_ok), token_ok


def _score_scale(scale: float, k_cache: torch.Tensor, k_scale) -> float | torch.Tensor:
    return scale * k_scale.float().reshape(()) if k_cache.dtype == FP8 else scale


def paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None,
                           window_left=-1, softcap=0.0, sinks=None):
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    lens = seq_lens.long().clamp(0, block_table.shape[1] * k_cache.shape[1])
    keys, values, token_ok = _paged_keys(k_cache, v_cache, block_table, lens)
    # One query per request, its last token: a prefill of one query row.
    qp = q.float().reshape(b, 1, hk, hq // hk, d)
    out = _attend_padded(qp, keys, values, torch.ones_like(lens), lens, token_ok, _score_scale(scale, k_cache, k_scale),
                         True, window_left, softcap, sinks, v_scale if k_cache.dtype == FP8 else None)
    return _fresh(out, q.dtype)


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


def _attend_padded(qp, kp, vp, lens_q, lens_k, token_ok, scale, causal, window_left, softcap, sinks,
                   value_scale=None):
    """Padded queries `[B, Mq, Hk, G, D]` over padded keys/values `[B, Mk, Hk, Dx]` ->
    `[B * Mq, Hq, Dv]`; `token_ok` `[B, Mk]` (or None) further hides keys; `value_scale`
    (fp8 caches) multiplies the result, after the sum as the kernels apply it. A row that
    sees no key is 0, also where a value it does not see is NaN (0 * NaN)."""
    batch, max_q, hk, group = qp.shape[:4]
    allowed = _visible(lens_q, lens_k, max_q, kp.shape[1], causal, window_left)
    if token_ok is not None:
        allowed = allowed & token_ok[:, None, :]
    # Keys no row sees (before every row's window) never reach the arithmetic (0 * NaN).
    seen = allowed.any(dim=1)[:, :, None, None]
    kp, vp = (torch.where(seen, x, torch.zeros((), device=x.device)) for x in (kp, vp))
    scores = _capped(torch.einsum("bqhgd,bkhd->bhgqk", qp, kp) * scale, softcap)
    sink = None if sinks is None else sinks.float().reshape(1, hk, group, 1, 1)
    out = _masked_softmax_apply(scores, allowed[:, None, None], vp, "bhgqk,bkhd->bqhgd", sink)
    if value_scale is not None:
        out = out * value_scale.float().reshape(())
    sees = allowed.any(dim=-1)[:, :, None, None, None]
    out = torch.where(sees, out, torch.zeros((), device=out.device))
    return out.reshape(batch * max_q, hk * group, vp.shape[-1])


def _unpad(out: torch.Tensor, cu_q: torch.Tensor, total_q: int, max_q: int) -> torch.Tensor:
    """Padded rows `[B * max_q, H, Dv]` back to packed `[Tq, H, Dv]`; rows outside every
    sequence (before c[0], at or past c[B]) get 0."""
    batch = cu_q.shape[0] - 1
    t = torch.arange(total_q, device=out.device)
    seq = torch.searchsorted(cu_q[1:].contiguous(), t, right=True).clamp(max=max(batch - 1, 0))
    pos = t - cu_q[seq]
    valid = (t < cu_q[-1]) & (pos >= 0) & (pos < max_q)
    out_ext = torch.cat([out, out.new_zeros((1, *out.shape[1:]))])
    return out_ext[torch.where(valid, seq * max_q + pos, batch * max_q)]


def flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off", window_left=-1, softcap=0.0, sinks=None,
):
    out_dtype = output_dtype(q.dtype)
    if quantize_inputs(fp8, q.dtype, q.device):
        # The fp8 path's numerics: each of q, k, v quantised per tensor, then as fp8 inputs.
        (q, q_descale), (k, k_descale), (v, v_descale) = (quantize_per_tensor(x) for x in (q, k, v))
    tq, hq, d = q.shape
    hk = v.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    cu_q, cu_k = sequence_bounds(cu_seqlens_q, tq), sequence_bounds(cu_seqlens_k, k.shape[0])
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]

    qp = _descaled(_pad(q, cu_q[:-1], lens_q, max_seqlen_q).reshape(batch, max_seqlen_q, hk, hq // hk, d),
                   q_descale, lens_q)
    kp = _descaled(_pad(k, cu_k[:-1], lens_k, max_seqlen_k), k_descale, lens_k)
    vp = _descaled(_pad(v, cu_k[:-1], lens_k, max_seqlen_k), v_descale, lens_k)
    out = _attend_padded(qp, kp, vp, lens_q, lens_k, None, scale, causal, window_left, softcap, sinks)
    return _fresh(_unpad(out, cu_q, tq, max_seqlen_q), out_dtype)


# -- paged prefill -----------------------------------------------------------------------
def paged_attention_prefill(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
    k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None,
):
    tq, hq, d = q.shape
    hk = k_cache.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    cu_q = sequence_bounds(cu_seqlens_q, tq)
    lens_q = cu_q[1:] - cu_q[:-1]
    lens_k = seq_lens.long().clamp(0, block_table.shape[1] * k_cache.shape[1])
    keys, values, token_ok = _paged_keys(k_cache, v_cache, block_table, lens_k)
    qp = _pad(q, cu_q[:-1], lens_q, max_seqlen_q).reshape(batch, max_seqlen_q, hk, hq // hk, d)
    out = _attend_padded(qp, keys, values, lens_q, lens_k, token_ok, _score_scale(scale, k_cache, k_scale), causal,
                         window_left, softcap, sinks, v_scale if k_cache.dtype == FP8 else None)
    return _fresh(_unpad(out, cu_q, tq, max_seqlen_q), q.dtype)


# -- the records --------------------------------------------------------------------------
PAGED_ATTENTION_DECODE = Backend(name="reference", impl=paged_attention_decode)
FLASH_ATTN_VARLEN = Backend(name="reference", impl=flash_attn_varlen)
PAGED_ATTENTION_PREFILL = Backend(name="reference", impl=paged_attention_prefill)
