"""aiter/ops/mha.py (stand-in): `flash_attn_varlen_func` (exported at aiter's top level).

aiter's router (mha.py:3446-3676) on gfx942/gfx950 ends in
`FlashAttnVarlenFunc.forward`: head dims padded to a multiple of 8 (copies), then
`_flash_attn_varlen_forward` (q/k/v made contiguous where `stride(-1) != 1`), then
(mha.py:2894-2935) on gfx950 for bf16 with head dims 192 / 128 the OPUS kernel
(`fmha_fwd_bf16_opus_varlen_fwd`, since v0.1.18, on by default, off with
`AITER_DISABLE_FMHA_OPUS=1`), else the fmha v3 asm kernel (bf16, hdim 128/128 or
192/128) or CK `mha_varlen_fwd`; it returns `out_padded[..., :head_size_v]`, one tensor
when no LSE / probabilities are asked. Then, when grad is enabled and q, k or v requires
it, `assert return_lse` (FlashAttnVarlenFunc.forward saves the LSE for backward).

OPUS (csrc/py_itfs_cu/fmha_fwd_bf16_opus_kernels.cu:launch_d192_v128) replaces a
`softmax_scale <= 0` by `1 / sqrt(192)`, and checks `max_seqlen_q > 0 and max_seqlen_k
> 0` and int32 contiguous seqstart arrays of B + 1 entries; the v3 and CK kernels take the
scale as given.

The stand-in raises the TORCH_CHECKs of csrc/py_itfs_cu/asm_mha_varlen_fwd.cu and
csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu as RuntimeError: dtype fp16/bf16, k and v of
q's dtype, int32 contiguous cu_seqlens of q's device, batch size > 0 ("batch size must be
postive"), head sizes <= 256 (after padding), Hq % Hk == 0, the shapes. aiter uses
cu_seqlens as given, so cu_seqlens that would make it read outside q / k / v (a negative
first entry, a decreasing entry, an end past the tensor) raise here too. Options
graphsafe does not use (dropout, bias, alibi, windows, softcap, block tables, `out`,
LSE, fp8) raise NotImplementedError.

Result: float32 torch, bottom-right causal alignment, a row that sees no key is 0 (the
docstring: "If the row of the mask is all zero, the output will be zero"). Rows outside
every sequence, and rows of a sequence at positions >= max_seqlen_q (outside the grid),
are not written: NaN here (`torch::empty` in aiter).
"""

import math
import os

import torch

from aiter._version import at_least
from aiter.jit.utils.chip_info import get_gfx

__all__ = ["flash_attn_varlen_func"]

_HALF = (torch.float16, torch.bfloat16)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1, 0),
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    sink_ptr=None,
):
    unmodelled = (
        dropout_p != 0.0 or logits_soft_cap != 0.0 or tuple(window_size)[:2] != (-1, -1) or bias is not None
        or alibi_slopes is not None or return_lse or return_attn_probs or block_table is not None or out is not None
        or cu_seqlens_q_padded is not None or cu_seqlens_k_padded is not None or sink_ptr is not None
        or min_seqlen_q != 0
    )
    if unmodelled:
        raise NotImplementedError("stand-in: only the plain varlen forward graphsafe calls")
    is_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    dv = v.shape[-1]
    q, k, v = (_pad8(x) for x in (q, k, v))  # FlashAttnVarlenFunc.forward
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # maybe_contiguous
    _torch_checks(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if _opus(q, v):
        _check(max_seqlen_q > 0 and max_seqlen_k > 0, "group mode requires max_seqlen_q / max_seqlen_k > 0")
        if softmax_scale <= 0.0:
            softmax_scale = 1.0 / math.sqrt(192.0)
    starts_q = _bounds(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    starts_k = _bounds(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    out_padded = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    for b in range(len(starts_q) - 1):
        _sequence(out_padded, q, k, v, starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1],
                  max_seqlen_q, softmax_scale, causal)
    if is_grad:
        assert return_lse  # FlashAttnVarlenFunc.forward: the backward needs the LSE
    return out_padded[..., :dv]


def _opus(q, v) -> bool:
    """mha.py:can_impl_fmha_fwd_hd192_v128_bf16_opus_varlen, for the calls graphsafe makes."""
    enabled = int(os.environ.get("AITER_DISABLE_FMHA_OPUS", "0")) == 0 and at_least("0.1.18")
    return (enabled and get_gfx() == "gfx950" and q.dtype == torch.bfloat16 and q.shape[-1] == 192
            and v.shape[-1] == 128)


def _pad8(x):
    return x if x.shape[-1] % 8 == 0 else torch.nn.functional.pad(x, [0, 8 - x.shape[-1] % 8])


def _check(ok: bool, message: str):
    if not ok:
        raise RuntimeError(message)


def _torch_checks(q, k, v, cu_q, cu_k):
    """asm_mha_varlen_fwd.cu:273-399 / mha_varlen_fwd_kernels.cu:392-528."""
    if q.dtype not in _HALF:
        if q.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise NotImplementedError("stand-in: the fp8 varlen path is not modelled")
        raise RuntimeError("FlashAttention only support fp16, bf16 and fp8 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.device == q.device, f"{name} must be on the device of q")
        _check(cu.is_contiguous(), f"{name} must be contiguous")
    batch = cu_q.numel() - 1
    _check(batch > 0, "batch size must be postive")
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be 3-D [total, heads, head_size]")
    hq, d = q.shape[1:]
    hk, dv = v.shape[1], v.shape[2]
    _check(d <= 256 and dv <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(d % 8 == 0 and dv % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(hq % hk == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(k.shape) == (k.shape[0], hk, d), "k must be [total_k, num_heads_k, head_size_q]")
    _check(v.shape[0] == k.shape[0], "v must be [total_k, num_heads_k, head_size_v]")
    _check(cu_q.shape == (batch + 1,) and cu_k.shape == (batch + 1,), "cu_seqlens must be [batch_size + 1]")


def _bounds(cu, total: int, name: str) -> list[int]:
    """The entries as aiter uses them; where it would read outside the tensor: an error."""
    values = cu.tolist()
    _check(values[0] >= 0 and values[-1] <= total and all(a <= b for a, b in zip(values, values[1:])),
           f"{name} = {values} (rows 0..{total}): aiter uses them as given and would read out of bounds")
    return values


def _sequence(out, q, k, v, q0, q1, k0, k1, max_seqlen_q, scale, causal):
    """One sequence, rows [q0, min(q1, q0 + max_seqlen_q)) (the grid covers max_seqlen_q)."""
    len_q, len_k = min(q1 - q0, max_seqlen_q), k1 - k0
    if len_q <= 0:
        return
    hq, hk = q.shape[1], k.shape[1]
    qs = q[q0:q0 + len_q].float().reshape(len_q, hk, hq // hk, -1)
    ks, vs = k[k0:k1].float(), v[k0:k1].float()
    i = torch.arange(len_q)[:, None]
    j = torch.arange(len_k)[None, :]
    allowed = j <= i + (len_k - (q1 - q0)) if causal else torch.ones(len_q, len_k, dtype=torch.bool)
    scores = torch.einsum("ihgd,jhd->hgij", qs, ks) * scale
    p = _weights(scores.masked_fill(~allowed, float("-inf")))
    # Only the keys a row sees enter its sum (no 0 * NaN from the others); no key -> 0.
    terms = torch.where(allowed[None, None, :, :, None], p[..., None] * vs.permute(1, 0, 2)[:, None, None], 0.0)
    o = terms.sum(dim=3)  # [hk, g, i, dv]
    out[q0:q0 + len_q] = o.permute(2, 0, 1, 3).reshape(len_q, hq, -1).to(out.dtype)


def _weights(scores):
    """Softmax as FlashAttention kernels compute it: the row maximum taken as 0 where it
    is not finite, and a zero normaliser left as is (weights 0), so a row whose scores are
    all -inf gets weights 0; a NaN or +inf score gives NaN weights."""
    top = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else scores.new_zeros((*scores.shape[:-1], 1))
    e = torch.exp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))
