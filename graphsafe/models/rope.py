"""Rotary embeddings of DeepSeek-V3.2, as transformers computes them.

One frequency table serves both rotations over the P = qk_rope_head_dim rope dims:
- MLA (`apply_interleaved`): pairs `(x0, x1), (x2, x3), ...` rotate together and the
  output is de-interleaved, `cat(even * cos - odd * sin, odd * cos + even * sin)`
  (transformers' `apply_rotary_pos_emb_interleave`). Queries and keys get the same
  permutation, so the dot products are DeepSeek's; the cache stores the keys permuted.
- the indexer (`apply_half`): the first P dims of each head rotate as halves
  (`rotate_half`, NeoX style).
cos and sin are computed in float32 and rounded to the model dtype, as transformers does.
"""

from __future__ import annotations

import math

import torch

from graphsafe.models.config import ModelConfig, yarn_get_mscale


def inv_freq_and_scaling(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """`(inv_freq [P/2] float32, attention_scaling)` for "default" and "yarn" rope."""
    rp = cfg.rope_parameters
    kind = rp.get("rope_type", "default")
    base = float(rp.get("rope_theta", 10000.0))
    dim = cfg.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind != "yarn":
        raise NotImplementedError(f"rope_type {kind!r}: the model implements 'default' and 'yarn'")
    factor = rp.get("factor")
    original = rp["original_max_position_embeddings"]
    if factor is None:
        factor = cfg.max_position_embeddings / original
    attention_factor = rp.get("attention_factor")
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(cfg: ModelConfig, num_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[num_positions, P/2]` in `dtype` (scaled by the YaRN attention factor)."""
    inv_freq, scaling = inv_freq_and_scaling(cfg)
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * scaling).to(dtype)
    sin = (freqs.sin() * scaling).to(dtype)
    return cos.to(device), sin.to(device)


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA rope of `x [..., P]`; cos/sin broadcast to `[..., P/2]`."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def apply_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer rope of the first P dims of `x [..., D]` (NeoX halves); the rest passes."""
    p = cos.shape[-1] * 2
    x1, x2, rest = x[..., : p // 2], x[..., p // 2 : p], x[..., p:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
