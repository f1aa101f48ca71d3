"""Small building blocks with transformers' numerics (norms, fp8 query quantisation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphsafe.formats.indexer_k import round_scale_ue8m0

FP8 = torch.float8_e4m3fn
# Float constants are written as literals inside traced functions: under
# torch.compile(dynamic=True) a float read from a global becomes a symbolic input.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV32RMSNorm: normalise in float32, round to x's dtype, then
    scale (the rounding before the weight matters in bf16)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def quant_fp8_per_head(x: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `per_token_group_quant_fp8` with one group per head: `x [T, H, D]` ->
    (`q [T, H, D]` e4m3fn, `scale [T, H]` float32) with `x ~= q * scale`.

    `scale = max(amax, 1e-10) / 448`, rounded up to a power of two for "ue8m0"; values
    are divided (IEEE), saturated to +-448 and rounded to nearest even.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-10) / 448.0
    if scale_fmt == "ue8m0":
        scale = round_scale_ue8m0(scale)  # exact 2^ceil(log2 s), as the K cache's scales
    q = (xf / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8)
    return q, scale


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
