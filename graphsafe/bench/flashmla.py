"""FlashMLA (DeepSeek's own MLA kernels) as a bench peer, on the same tensors as graphsafe,
outputs compared.

Never required: the `*_peers` functions return no impls (and say why in their note) when
`import flash_mla` fails, off CUDA, off sm_90 (the prebuilt peer is built for sm_90a), or
for a shape FlashMLA does not take (sparse decode: 64 or 128 heads over an fp8_ds_mla
cache; dense decode: a bf16 cache). A graphsafe fp8_ds_mla cache is FlashMLA's V3.2 FP8
layout byte for byte (`cache.view(torch.float8_e4m3fn).unsqueeze(2)`). Each variant runs
once before timing and its output is compared with graphsafe's (max abs difference, in
the note); timed impls are labelled "flashmla <kernel>", and the harness adds
"graphsafe / flashmla ..." ratios to the problem's note (`graphsafe.bench.peers.ratio_note`).

FlashMLA's own heads rule: sparse decode takes 64 or 128 query heads. A tensor-parallel
rank with fewer (16 or 32 of DeepSeek's 128) pads its queries to 64 heads, as vLLM does:
`pad_heads` gives that peer; the note says "padded to 64 heads".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

PREFIX = "flashmla"
SPARSE_DECODE_HEADS = (64, 128)


@functools.cache
def _module() -> Any:
    try:
        import flash_mla
    except Exception:  # noqa: BLE001 - any import failure: no FlashMLA rows
        return None
    return flash_mla


def unavailable(device: torch.device) -> str | None:
    """Why FlashMLA rows cannot run here, or None."""
    if device.type != "cuda" or torch.version.hip is not None:
        return "flashmla: CUDA only"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "flashmla: the prebuilt peer is sm_90a only"
    if _module() is None:
        return "flash_mla not installed"
    return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _run_variant(device: torch.device, label: str, make: Callable[[], Callable[[], Any]],
                 compare: Callable[[Any], str]) -> tuple[dict, str]:
    """The variant's timed call (`make()` plans and returns it), run once and compared."""
    if device.type != "cuda":
        return {}, ""  # nothing to say off CUDA
    why = unavailable(device)
    if why:
        return {}, why
    try:
        call = make()
        result = call()
        torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - a failing peer is reported, never fatal
        return {}, f"{label}: failed ({type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''})"
    return {label: call}, f"{label}: {compare(result)}"


def pad_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    """q `[..., H, D]` with zero heads appended up to `heads` (vLLM's padding for FlashMLA)."""
    pad = heads - q.shape[-2]
    if pad <= 0:
        return q
    return torch.cat([q, q.new_zeros((*q.shape[:-2], pad, q.shape[-1]))], dim=-2).contiguous()


def sparse_decode_lse(lse: torch.Tensor, s_q: int, heads: int) -> torch.Tensor:
    """FlashMLA's decode LSE `[batch, padded heads, s_q]` (its docstring: `(batch_size,
    num_heads_q, seq_len_q)`) as graphsafe's `[tokens, heads]`, tokens request-major."""
    b, padded = lse.shape[0], lse.shape[1]
    return lse.reshape(b, padded, s_q).transpose(1, 2).reshape(b * s_q, padded)[:, :heads]


def sparse_decode_peers(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                        kv_lora_rank: int, graphsafe_out: tuple, queries_per_request: int) -> tuple[dict, str]:
    """`flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`: the V3.2 sparse decode
    over an fp8_ds_mla cache, `q [T, H, 576]` read as `[T / s_q, s_q, H, 576]`
    (`queries_per_request` = s_q). Fewer than 64 heads: padded to 64 (the note says so)."""
    fm = _module()
    device, (tokens, heads, d) = q.device, q.shape
    topk, s_q = indices.shape[1], queries_per_request
    if kv_cache.dtype != torch.uint8:
        return {}, "flashmla: sparse decode reads an fp8_ds_mla cache only"
    padded = next((h for h in SPARSE_DECODE_HEADS if h >= heads), None)
    if padded is None or tokens % s_q:
        return {}, f"flashmla: sparse decode takes 64 or 128 heads and whole requests (got H {heads})"
    label = f"{PREFIX} sparse decode" + ("" if padded == heads else f" (padded to {padded} heads)")
    out, lse = graphsafe_out

    def make():
        qp = pad_heads(q, padded).view(tokens // s_q, s_q, padded, d)
        cache = kv_cache.view(torch.float8_e4m3fn).unsqueeze(2)
        idx = indices.view(tokens // s_q, s_q, topk)
        meta, _ = fm.get_mla_metadata()
        return lambda: fm.flash_mla_with_kvcache(qp, cache, None, None, kv_lora_rank, meta, None, sm_scale, False,
                                                 True, idx)

    def compare(result) -> str:
        o, l = result
        o = o.reshape(tokens, padded, kv_lora_rank)[:, :heads]
        text = f"max |out - graphsafe| {_max_diff(o, out):.3g}"
        if l.numel() == tokens * padded:
            text += f", |lse - graphsafe| {_max_diff(sparse_decode_lse(l, s_q, heads), lse):.3g}"
        return text

    return _run_variant(device, label, make, compare)


def dense_decode_peers(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       sm_scale: float, kv_lora_rank: int, graphsafe_out: tuple) -> tuple[dict, str]:
    """`flash_mla_with_kvcache` dense decode over a bf16 cache (one query per request)."""
    fm = _module()
    device, (b, h, d) = q.device, q.shape
    if kv_cache.dtype != torch.bfloat16:
        return {}, "flashmla: dense decode reads a bf16 cache here"
    out, _ = graphsafe_out
    label = f"{PREFIX} dense decode"

    def make():
        meta, _ = fm.get_mla_metadata()
        qv, cache = q.view(b, 1, h, d), kv_cache.unsqueeze(2)
        return lambda: fm.flash_mla_with_kvcache(qv, cache, block_table, seq_lens, kv_lora_rank, meta, None,
                                                 sm_scale, False, False)

    def compare(result) -> str:
        return f"max |out - graphsafe| {_max_diff(result[0].view(b, h, kv_lora_rank), out):.3g}"

    return _run_variant(device, label, make, compare)


def sparse_prefill_peers(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                         graphsafe_out: tuple) -> tuple[dict, str]:
    """`flash_mla_sparse_fwd(q [s_q, H, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, K])`
    (bf16; the slots index `kv`'s rows, as graphsafe's flat cache slots do). Its d_v "can
    only be 512" (its docstring); the prebuilt peer (commit 9241ae3) ends the process with a
    segmentation fault on another d_v (H200, 2026-11-29: d_qk 512, d_v 448), so any other
    is not called."""
    fm = _module()
    out, _ = graphsafe_out
    label = f"{PREFIX} sparse prefill"
    if d_v != 512 and q.device.type == "cuda":
        return {}, f"{label}: takes d_v 512 only (got {d_v}): not run"

    def make():
        kv3, idx3 = kv.unsqueeze(1), indices.unsqueeze(1)
        return lambda: fm.flash_mla_sparse_fwd(q, kv3, idx3, sm_scale, d_v)

    def compare(result) -> str:
        return f"max |out - graphsafe| {_max_diff(result[0], out):.3g}"

    return _run_variant(q.device, label, make, compare)


__all__ = ["unavailable", "sparse_decode_peers", "dense_decode_peers", "sparse_prefill_peers", "pad_heads", "PREFIX"]
