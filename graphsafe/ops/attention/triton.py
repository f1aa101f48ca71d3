"""Triton backend of the GQA attention ops: launch wrappers, configs and scratch.

Kernels live in `_triton_decode.py` (paged decode + split combine), `_triton_prefill.py`
(varlen FlashAttention-2 forward) and `_triton_quant.py` (fp8 quantisation). Every host
int comes from shapes or arguments; scratch comes from the workspace manager.
"""

from __future__ import annotations

import torch

from graphsafe.device_info import compute_capability
from graphsafe.fake_impls.attention import FP8, output_dtype
from graphsafe.ops.attention import reference
from graphsafe.ops.attention._triton_decode import launch_paged_decode
from graphsafe.ops.attention._triton_prefill import launch_varlen
from graphsafe.ops.attention._triton_quant import (
    AMAX_Q,
    DESCALE_K,
    DESCALE_V,
    EMULATE_FP8_CAST,
    ONE,
    amax_into,
    prepare_varlen,
    quantize_kv_into,
    vt_columns,
)
from graphsafe.ops.attention.fp8 import fp8_prefill_supported, quantize_inputs
from graphsafe.ops.attention.split_kv import decode_block_n, plan_decode_splits
from graphsafe.workspace import current_workspace_manager

DECODE_OWNER = "paged_attention_decode"
VARLEN_OWNER = "flash_attn_varlen"


def _hopper_or_newer(device: torch.device) -> bool:
    cc = compute_capability(device)
    return cc is not None and cc >= (9, 0)


# -- paged decode -------------------------------------------------------------------------
def decode_config(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 3 stages keep ~3 K/V tiles in flight per program."""
    stages = 3 if device.type == "cuda" and _hopper_or_newer(device) else 2
    return decode_block_n(device), 4, stages


def paged_attention_decode(
    q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None, *, num_splits=None
):
    """`num_splits` (tests only) overrides the shape-based plan."""
    b, hq, _ = q.shape
    _, block_size, hk, dv = v_cache.shape
    out = torch.empty((b, hq, dv), dtype=q.dtype, device=q.device)
    if b == 0 or hq == 0:
        return out
    if num_splits is None:
        num_splits = plan_decode_splits(b, hk, block_table.shape[1], block_size, q.device)
    partials = None
    if num_splits > 1:
        partials = current_workspace_manager(q.device).get_simultaneous(
            ((b, hq, num_splits, dv), torch.float32), ((b, hq, num_splits), torch.float32), owner=DECODE_OWNER
        )
    launch_paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, out, partials, num_splits,
        decode_config(q.device),
    )
    return out


# -- varlen prefill -----------------------------------------------------------------------
def varlen_config(device: torch.device, d: int, dv: int, fp8: bool, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from shapes and host ints only.

    fp8 on Hopper: 128 x 128 tiles (fp8 wgmma m64n128k32; one CTA of two warpgroups per
    SM at ~255 registers, no spills in the key loop), 3 stages of K and V^T tiles
    (115 KB of shared memory at D = 128; 2 stages at D = 192). bf16/fp16: 128 x 64."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # interpreter: small tiles, so tiny tests cover several blocks
    wide = max(d, dv) > 128
    block_m = 128 if max_seqlen_q > 64 else 64
    num_warps = 8 if block_m == 128 else 4
    hopper = _hopper_or_newer(device)
    stages = 3 if hopper and not wide else 2
    if fp8 and hopper:
        # Measured on an H200, 8 x 4096 causal, fp8 inputs: 64 x 128 / 4 warps / 3 stages
        # 1.83 ms vs 2.02 for 128 x 128 / 8 warps (D=128, GQA and MHA alike); at D=192,
        # 64 x 64 / 4 warps / 3 stages 1.33 vs 1.43 ms. Two CTAs per SM overlap one CTA's
        # softmax with the other's MMAs.
        return (64, 64, 4, 3) if wide else (64, 128, 4, 3)
    if fp8 and not wide:  # (sm89 has 99 KB of shared memory per block)
        return block_m, 128, num_warps, stages
    return block_m, 64, num_warps, stages


def varlen_workspace_specs(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, quantize: bool
):
    """Scratch of one fp8 call: V^T (fp8, token-contiguous rows padded to 16 tokens), k in
    fp8 when quantising bf16/fp16 inputs (q is quantised tile by tile inside the attention
    kernel), and 8 float32 scale slots (`_triton_quant.AMAX_Q` ...). The bf16/fp16 path
    needs none."""
    specs = [((num_kv_heads, head_dim_v, vt_columns(total_k)), FP8)]
    if quantize:
        specs += [((total_k, num_kv_heads, head_dim), FP8)]
    return specs + [((8,), torch.float32)]


def _descale_arg(x: torch.Tensor | None, one: torch.Tensor):
    if x is None:
        return one, 0, 0
    return (x, x.stride(0), x.stride(1)) if x.dim() == 2 else (x, 0, 0)


def flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="auto", *, config=None,
):
    """`config` (tests and benchmarks only) overrides (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    device = q.device
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    in_fp8 = q.dtype == FP8
    quantize = quantize_inputs(fp8, q.dtype, device)
    use_fp8 = in_fp8 or quantize
    if use_fp8 and device.type == "cuda" and not fp8_prefill_supported(device):
        # No fp8 matrix units (or no working fp8 codegen): the slow, exact PyTorch path.
        return reference.flash_attn_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            q_descale, k_descale, v_descale, fp8,
        )
    out = torch.empty((tq, hq, dv), dtype=output_dtype(q.dtype), device=device)
    if out.numel() == 0:
        return out
    config = config or varlen_config(device, d, dv, use_fp8, max_seqlen_q)
    descales = None
    v_strides = (v.stride(0), v.stride(1), v.stride(2))
    if not use_fp8:
        prepare_varlen(out, cu_seqlens_q)
    else:
        bufs = current_workspace_manager(device).get_simultaneous(
            *varlen_workspace_specs(tq, tk, hq, hk, d, dv, quantize), owner=VARLEN_OWNER
        )
        vt, scales = bufs[0], bufs[-1]
        prepare_varlen(out, cu_seqlens_q, scales)  # also resets the amax slots and the 1.0
        if quantize:
            k8 = bufs[1]
            amax_into(q, k, v, scales)  # the attention kernel quantises q itself, from its amax
            quantize_kv_into(k, v, k8, vt, scales)
            k = k8
            descales = tuple((scales[i : i + 1], 0, 0) for i in (AMAX_Q, DESCALE_K, DESCALE_V))
        else:
            quantize_kv_into(k, v, None, vt, scales, quant=False)  # V^T only
            one = scales[ONE : ONE + 1]  # stands in for descales the caller left out
            descales = tuple(_descale_arg(x, one) for x in (q_descale, k_descale, v_descale))
        v, v_strides = vt, (1, vt.stride(0), vt.stride(1))  # V^T [Hk, Dv, Tk_pad] seen as [Tk, Hk, Dv]
    launch_varlen(
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, descales, v_strides, use_fp8,
        config, EMULATE_FP8_CAST and device.type == "cpu", q_quant=quantize,
    )
    return out
