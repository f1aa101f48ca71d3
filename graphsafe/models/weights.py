"""Weights in transformers' `DeepseekV32ForCausalLM` naming: loading them into the fused and
absorbed layout the model runs, and making random ones for the demo and the tests.

Fusions (each is a concatenation of rows, so values are unchanged):
- `w_a`: the projections of the normed hidden state, `[q_a_proj; kv_a_proj_with_mqa;
  indexer.wk; indexer.weights_proj]` (one GEMM instead of four).
- `w_b`: the projections of the q latent, `[q_b_proj; indexer.wq_b]`.
- `w_gate_up`: `[gate_proj; up_proj]`.
The optional biases follow the fusions: `b_a` (w_a's rows; zeros for the parts without a
bias), `b_o` (o_proj), `b_iq` (w_b's indexer rows, `indexer.wq_b`; q_b_proj has none),
`b_gate_up` and `b_down` (`ModelConfig.attention_bias`, `indexer_bias`, `mlp_bias`).
Absorbed MLA (decode and sparse prefill) splits `kv_b_proj [H * (nope + v), R]` per head
into `w_uk [H, nope, R]` (queries move into the latent space: `q_nope @ w_uk`) and
`w_uv_t [H, R, v]` (the latent output moves back: `o @ w_uv_t`).
"""

from __future__ import annotations

import math

import torch

from graphsafe.models.config import ModelConfig


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a dense-MLP `DeepseekV32ForCausalLM` state dict and its shape."""
    h, d = cfg.num_heads, cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                a + "q_a_proj.weight": (cfg.q_lora_rank, d),
                a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                a + "q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
                a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
                a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                a + "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                a + "o_proj.weight": (d, h * cfg.v_head_dim),
                a + "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                a + "indexer.wk.weight": (cfg.index_head_dim, d),
                a + "indexer.k_norm.weight": (cfg.index_head_dim,),
                a + "indexer.k_norm.bias": (cfg.index_head_dim,),
                a + "indexer.weights_proj.weight": (cfg.index_n_heads, d),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
                p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
            }
        )
        if cfg.attention_bias:
            shapes[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
            shapes[a + "kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
            shapes[a + "o_proj.bias"] = (d,)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.up_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.down_proj.bias"] = (d,)
        if cfg.indexer_bias:
            shapes[a + "indexer.wq_b.bias"] = (cfg.index_n_heads * cfg.index_head_dim,)
            shapes[a + "indexer.wk.bias"] = (cfg.index_head_dim,)
            shapes[a + "indexer.weights_proj.bias"] = (cfg.index_n_heads,)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def random_hf_state_dict(cfg: ModelConfig, seed: int = 0, logit_gain: float = 4.0) -> dict[str, torch.Tensor]:
    """A float32 state dict with activations of order one in every layer (transformers'
    default init, std 0.02 and unit norms, gives near-uniform attention and indexer
    scores, which would test little). Linear weights ~ N(0, 1/fan_in); norm weights
    1 + 0.2 N(0, 1) (a missing norm weight shows); LayerNorm biases 0.1 N(0, 1);
    embeddings N(0, 1); the LM head `logit_gain` times larger so greedy choices have
    margins well above bf16 rounding."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_param_shapes(cfg).items():
        if name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=g)
        elif len(shape) == 2:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            if name == "lm_head.weight":
                t = t * logit_gain
        elif name.endswith("k_norm.bias") or name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:  # norm weights
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        out[name] = t
    return out


def _take(sd: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in sd:
        raise KeyError(f"state dict has no {name!r} (a DeepseekV32ForCausalLM state dict with dense MLPs is expected)")
    t = sd[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def convert_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused/absorbed tensors named as `DeepseekV32Model` registers them (see module doc)."""
    shapes = hf_param_shapes(cfg)
    w = {name: _take(sd, name, shape) for name, shape in shapes.items()}
    h, nope, v, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = {"embed": w["model.embed_tokens.weight"], "final_norm": w["model.norm.weight"]}
    out["lm_head"] = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    for i in range(cfg.num_layers):
        p, a, o = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"layers.{i}."
        kv_b = w[a + "kv_b_proj.weight"]
        per_head = kv_b.view(h, nope + v, r)
        out.update(
            {
                o + "input_norm": w[p + "input_layernorm.weight"],
                o + "post_norm": w[p + "post_attention_layernorm.weight"],
                o + "w_a": torch.cat(
                    [
                        w[a + "q_a_proj.weight"],
                        w[a + "kv_a_proj_with_mqa.weight"],
                        w[a + "indexer.wk.weight"],
                        w[a + "indexer.weights_proj.weight"],
                    ]
                ),
                o + "q_a_norm": w[a + "q_a_layernorm.weight"],
                o + "kv_a_norm": w[a + "kv_a_layernorm.weight"],
                o + "ik_norm_w": w[a + "indexer.k_norm.weight"],
                o + "ik_norm_b": w[a + "indexer.k_norm.bias"],
                o + "w_b": torch.cat([w[a + "q_b_proj.weight"], w[a + "indexer.wq_b.weight"]]),
                o + "w_kv_b": kv_b,
                o + "w_uk": per_head[:, :nope, :].contiguous(),
                o + "w_uv_t": per_head[:, nope:, :].transpose(1, 2).contiguous(),
                o + "w_o": w[a + "o_proj.weight"],
                o + "w_gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                o + "w_down": w[p + "mlp.down_proj.weight"],
            }
        )
        if cfg.attention_bias or cfg.indexer_bias:
            # w_a's bias: the parts without one are zeros.
            def bias(name: str, rows: int) -> torch.Tensor:
                return w[name] if name in w else torch.zeros(rows, dtype=kv_b.dtype)

            out[o + "b_a"] = torch.cat([
                bias(a + "q_a_proj.bias", cfg.q_lora_rank),
                bias(a + "kv_a_proj_with_mqa.bias", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                bias(a + "indexer.wk.bias", cfg.index_head_dim),
                bias(a + "indexer.weights_proj.bias", cfg.index_n_heads),
            ])
        if cfg.attention_bias:
            out[o + "b_o"] = w[a + "o_proj.bias"]
        if cfg.indexer_bias:
            out[o + "b_iq"] = w[a + "indexer.wq_b.bias"]  # the bias of w_b's indexer rows
        if cfg.mlp_bias:
            out[o + "b_gate_up"] = torch.cat([w[p + "mlp.gate_proj.bias"], w[p + "mlp.up_proj.bias"]])
            out[o + "b_down"] = w[p + "mlp.down_proj.bias"]
    return out
