"""A tiny random DeepSeek-V3.2-style model for the demo, the tests and the benchmarks.

`build_demo_model` makes one random state dict in transformers' naming and loads it into
graphsafe's model and, when transformers is installed (the `oracle` extra), into
transformers' `DeepseekV32ForCausalLM` (strictly: names and shapes are checked), so the
two compute the same function. Every layer is a dense MLP (no MoE): the config sets
`first_k_dense_replace = num_hidden_layers`.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

import torch

from graphsafe.models.config import ModelConfig
from graphsafe.models.model import DeepseekV32Model
from graphsafe.models.weights import random_hf_state_dict

# transformers field names. index_head_dim: a multiple of 16 (fp8 indexer ops).
DEMO_HF_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    # MoE fields must be consistent for transformers' config even though no layer uses them.
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
}

# Keyword arguments of DeepseekV32Model.from_hf_state_dict (the rest are config fields).
_MODEL_KWARGS = ("max_batch", "max_model_len", "block_size", "num_blocks", "max_num_batched_tokens", "tp")
_EXTRA_FIELDS = ("index_scale_fmt", "prefill_fp8", "kv_cache_dtype", "mlp_bias", "indexer_bias")
# Extras that add weights transformers' DeepseekV32 does not have (its strict load refuses them).
_NOT_IN_TRANSFORMERS = ("mlp_bias", "indexer_bias")
# Config fields demo_hf_config sets from others (an override would be overwritten).
_DERIVED_FIELDS = {"first_k_dense_replace": "num_hidden_layers", "mlp_layer_types": "num_hidden_layers",
                   "num_key_value_heads": "num_attention_heads"}
# Every name build_demo_model's overrides take. Other transformers fields would reach only
# the transformers model (rope_theta, for one, is read from rope_parameters): refused.
DEMO_MODEL_FIELDS = tuple(sorted({*DEMO_HF_CONFIG, *_MODEL_KWARGS, *_EXTRA_FIELDS} - set(_DERIVED_FIELDS)))


def unknown_override(name: str, fields: tuple[str, ...] = DEMO_MODEL_FIELDS) -> str | None:
    """None when `name` is one of `fields`; else why it is refused, with the closest valid
    name (difflib) or, without a close one, every valid name."""
    if name in fields:
        return None
    if name in _DERIVED_FIELDS:
        return f"{name} follows {_DERIVED_FIELDS[name]} in the demo model: set that instead"
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"the fields: {', '.join(fields)}"
    return f"the demo model has no field {name!r}: {hint}"


def demo_hf_config(**overrides: Any) -> dict[str, Any]:
    """The demo config (transformers field names) with `overrides`; all layers dense."""
    cfg = {**DEMO_HF_CONFIG, **overrides}
    layers = cfg["num_hidden_layers"]
    cfg["first_k_dense_replace"] = layers
    cfg["mlp_layer_types"] = ["dense"] * layers
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def build_hf_model(hf_config: dict[str, Any], state_dict: dict[str, torch.Tensor], dtype: torch.dtype):
    """transformers' `DeepseekV32ForCausalLM` (eager attention, eval mode) with exactly
    `state_dict` (strict load). Needs transformers >= 5.17."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(**hf_config, attn_implementation="eager")
    model = DeepseekV32ForCausalLM(config)
    model.load_state_dict(state_dict, strict=True)
    return model.to(dtype).eval()


def build_demo_model(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    with_hf: bool | None = None,
    **overrides: Any,
) -> tuple[DeepseekV32Model, Any]:
    """(graphsafe model, transformers model or None) sharing one random state dict.

    `overrides`: transformers config fields (e.g. `index_topk=64`, `num_hidden_layers=4`),
    `ModelConfig` extras (`index_scale_fmt`, `prefill_fp8`, `kv_cache_dtype`; the
    transformers model has no fp8 cache: it always computes with the exact latent;
    `mlp_bias`, `indexer_bias`: weights transformers' model has not, so no transformers
    model is built with them) and
    model sizes
    (`max_batch` default 8, `max_model_len` default 256, `block_size` default 16,
    `num_blocks`, `max_num_batched_tokens`, and `tp`, a `TensorParallel` for one rank's
    shard). `with_hf`: build the transformers model
    (on the CPU); None means "if transformers is importable". Any other name raises
    TypeError with the closest valid one (`DEMO_MODEL_FIELDS`).
    """
    for name in overrides:
        why = unknown_override(name)
        if why:
            raise TypeError(f"build_demo_model: {why}")
    model_kwargs = {"max_batch": 8, "max_model_len": 256, "block_size": 16}
    model_kwargs.update({k: overrides.pop(k) for k in _MODEL_KWARGS if k in overrides})
    extra = {k: overrides.pop(k) for k in _EXTRA_FIELDS if k in overrides}
    hf_config = demo_hf_config(**overrides)
    state_dict = random_hf_state_dict(ModelConfig.from_hf(hf_config, **extra), seed=seed)
    model = DeepseekV32Model.from_hf_state_dict(
        hf_config, state_dict, device=device, dtype=dtype, **model_kwargs, **extra
    )
    extra_weights = [k for k in _NOT_IN_TRANSFORMERS if extra.get(k)]
    if with_hf and extra_weights:
        raise ValueError(f"{', '.join(extra_weights)}: transformers' DeepseekV32 has no such weights; "
                         "build with with_hf=False")
    if with_hf is None:
        try:
            importlib.import_module("transformers")
            with_hf = not extra_weights
        except ImportError:
            with_hf = False
    hf_model = build_hf_model(hf_config, state_dict, dtype) if with_hf else None
    return model, hf_model
