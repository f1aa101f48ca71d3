"""GQA attention: paged decode over the K/V cache written by `reshape_and_cache`, and
varlen (packed) prefill with an FP8 path.

Public helpers besides the ops: `paged_attention_decode_workspace` /
`flash_attn_varlen_workspace` (worst-case scratch from shapes, to size the workspace
before a CUDA-graph capture), `fp8_prefill_supported(device)` (the cached fp8 probe) and
`plan_decode_splits` (the shape-only split-KV plan).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from graphsafe.fake_impls import attention as fakes
from graphsafe.ops.attention.fp8 import fp8_prefill_supported
from graphsafe.ops.attention.split_kv import decode_workspace_specs, plan_decode_splits
from graphsafe.registry import Backend, get_op, register_op

__all__ = [
    "flash_attn_varlen",
    "flash_attn_varlen_workspace",
    "fp8_prefill_supported",
    "paged_attention_decode",
    "paged_attention_decode_workspace",
    "plan_decode_splits",
]


def paged_attention_decode_workspace(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks_per_seq: int, block_size: int,
    device: torch.device | str | None = None, head_dim: int | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case scratch `[(shape, dtype), ...]` of one `paged_attention_decode` call on
    `device` (default: the current CUDA device, else the CPU), from shapes only: the
    largest over the backends that may serve it there. Feed it to
    `WorkspaceManager.reserve(*specs)` before capturing a graph."""
    return get_op("paged_attention_decode").workspace_specs(
        batch_size, num_q_heads, num_kv_heads, head_dim_v, max_blocks_per_seq, block_size,
        head_dim=head_dim, device=device,
    )


def flash_attn_varlen_workspace(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, fp8: bool = True,
    device: torch.device | str | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case scratch of one `flash_attn_varlen` call on `device` (default: the
    current CUDA device, else the CPU), over the backends that may serve it there: the
    fp8 path quantising bf16/fp16 inputs (fp8 inputs need less); nothing when `fp8` is
    False."""
    return get_op("flash_attn_varlen").workspace_specs(
        total_q, total_k, num_q_heads, num_kv_heads, head_dim, head_dim_v, fp8=fp8, device=device,
    )


@register_op(
    "paged_attention_decode",
    fake=fakes.fake_paged_attention_decode,
    check=fakes.check_paged_attention_decode,
    family="attention",
    backends={
        "reference": "graphsafe.ops.attention.reference:paged_attention_decode",
        "triton": Backend(
            "graphsafe.ops.attention.triton:paged_attention_decode",
            prepare="graphsafe.ops.attention.triton:prepare_paged_attention_decode",
            workspace=decode_workspace_specs,
        ),
        "aiter": Backend(
            prepare="graphsafe.ops.attention.aiter:prepare_paged_attention_decode",
            supports="graphsafe.ops.attention.aiter:supports_paged_attention_decode",
            workspace="graphsafe.ops.attention.aiter:paged_attention_decode_workspace",
        ),
    },
)
def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> Tensor:
    """GQA decode: each request's query attends to its first `seq_lens[b]` cached tokens.

    `out[b, h] = softmax_j(scale * q[b, h] . K[b, j, h // G]) @ V[b, j, h // G]` over
    `j < seq_lens[b]`, with `G = Hq / Hk` query heads per KV head and token j of request
    b stored at block `block_table[b, j // block_size]`, offset `j % block_size` (the
    layout `reshape_and_cache` writes). A request with `seq_lens[b] == 0` gets 0.
    Split-KV: the KV range of each request is cut into a number of splits chosen on the
    host from shapes only (B, Hk, max_blocks_per_seq * block_size, SM count), never from
    `seq_lens` values, so the op captures into a CUDA graph and replays with any lengths;
    partial outputs/LSEs come from the workspace (`paged_attention_decode_workspace`).

    Args:
        q: `[B, Hq, D]` bfloat16/float16, last dim contiguous. One query token per request.
        k_cache: `[num_blocks, block_size, Hk, D]`, dtype of `q` or float8_e4m3fn (then
            `k_scale` is required); `Hk` divides `Hq`. Last dim contiguous; block, token
            and head strides are free.
        v_cache: `[num_blocks, block_size, Hk, Dv]`, same dtype as `k_cache`.
        block_table: `[B, max_blocks_per_seq]` int32, the cache blocks of each request in
            order. Only the first `ceil(seq_lens[b] / block_size)` entries of row b are
            read; the rest may hold anything (-1, stale ids).
        seq_lens: `[B]` int32, cached tokens per request (the new token included). Values
            are clamped to `[0, max_blocks_per_seq * block_size]`.
        scale: multiplies `q . k` before the softmax (usually `D ** -0.5`).
        k_scale, v_scale: `[1]` float32, for float8_e4m3fn caches: the cached value times
            the scale is the real key/value (`reshape_and_cache` stores `x / scale`).
            Ignored for bf16/fp16 caches.

    Returns:
        out: `[B, Hq, Dv]`, dtype of `q`, contiguous.
    """


@register_op(
    "flash_attn_varlen",
    fake=fakes.fake_flash_attn_varlen,
    check=fakes.check_flash_attn_varlen,
    family="attention",
    backends={
        "reference": "graphsafe.ops.attention.reference:flash_attn_varlen",
        "triton": Backend(
            "graphsafe.ops.attention.triton:flash_attn_varlen",
            prepare="graphsafe.ops.attention.triton:prepare_flash_attn_varlen",
            workspace="graphsafe.ops.attention.triton:flash_attn_varlen_workspace",
        ),
        "aiter": Backend(
            prepare="graphsafe.ops.attention.aiter:prepare_flash_attn_varlen",
            supports="graphsafe.ops.attention.aiter:supports_flash_attn_varlen",
        ),
    },
)
def flash_attn_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    fp8: str = "auto",
) -> Tensor:
    """Varlen (packed) prefill attention with GQA, causal or not, and an FP8 path.

    Sequence b owns query rows `cu_seqlens_q[b] : cu_seqlens_q[b+1]` and key/value rows
    `cu_seqlens_k[b] : cu_seqlens_k[b+1]`. Query head h uses KV head `h // (Hq / Hk)`.
    Causal masking is aligned to the bottom-right corner (the FlashAttention-2
    convention): query i of a sequence sees keys `j <= i + (len_k - len_q)`; with
    `len_q == len_k` that is the usual `j <= i`. A query row with no visible key (e.g.
    `len_k < len_q` under `causal`, or `len_k == 0`) gives 0; so do rows outside every
    sequence (`t >= cu_seqlens_q[B]`: padding after the last sequence). Empty and
    length-1 sequences are fine.

    FP8 path (`fp8`): "off" computes from the inputs as given. "on" quantises bf16/fp16
    q, k, v per tensor to float8_e4m3fn inside the op (`descale = max(amax, 1e-12) / 448`,
    round to nearest even; K and V^T scratch from the workspace, q quantised tile by tile
    in the kernel) and runs fp8 matrix products (P is scaled by 256 before its fp8
    cast); its accuracy against the bf16 result is measured in tests/test_attention*.py
    (relative L2 error <= 0.06 on unit-Gaussian inputs). "auto" is "on" where
    `fp8_prefill_supported(q.device)` (fp8 matrix units AND a probe kernel that works)
    and "off" elsewhere, the CPU included. Inputs that are already float8_e4m3fn always
    take the fp8 path, dequantised by the optional descales.

    Args:
        q: `[Tq, Hq, D]` bfloat16/float16/float8_e4m3fn, last dim contiguous.
        k: `[Tk, Hk, D]`, dtype of `q`; `Hk` divides `Hq`. Last dim contiguous.
        v: `[Tk, Hk, Dv]`, dtype of `q` (MLA prefill: D = 192, Dv = 128). Last dim contiguous.
        cu_seqlens_q: `[B + 1]` int32, cumulative query lengths: `cu[0] = 0`,
            non-decreasing, `cu[B] <= Tq`.
        cu_seqlens_k: `[B + 1]` int32, cumulative key lengths, `cu[B] <= Tk`.
        max_seqlen_q: host int >= every query length (the kernel's grid; the reference
            pads to it). Pass it from the CPU mirror of the lengths; never read on device.
        max_seqlen_k: host int >= every key length.
        scale: multiplies `q . k` before the softmax.
        causal: bottom-right aligned causal mask (see above).
        q_descale, k_descale, v_descale: float32, only with float8_e4m3fn inputs: the real
            value is `x * descale`. Shape `[1]` (per tensor) or `[B, Hk]` (per sequence and
            KV head, FlashAttention-3's convention; q uses its KV head's entry). None means 1.
        fp8: "auto" (default), "on" or "off", see above.

    Returns:
        out: `[Tq, Hq, Dv]`, contiguous; dtype of `q`, or bfloat16 for fp8 inputs.
    """
