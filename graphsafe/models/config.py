"""The model's hyper-parameters, read from a transformers `DeepseekV32Config` (or a dict
with the same field names, so the model never needs transformers at run time)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from graphsafe.formats.fp8_ds_mla import TILE


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction (the same formula as transformers')."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# `ModelConfig.kv_cache_dtype` values.
KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int  # R: the latent width (the value width of absorbed MLA)
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # P: the rope part of every query/key head
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Biases transformers' DeepseekV32 does not have (its MLP and indexer projections are
    # bias-free; its config's `mlp_bias` is not read by its MLP), so `from_hf` never reads
    # them: pass them as extras (`from_hf(cfg, mlp_bias=True)`). With `mlp_bias` the state
    # dict holds `mlp.{gate,up,down}_proj.bias`; with `indexer_bias`,
    # `self_attn.indexer.{wq_b,wk,weights_proj}.bias`. Under tensor parallelism the gate and
    # up biases shard with their rows; the down bias, like o_proj's, is added once, after
    # the all-reduce; the indexer's are replicated with it (`graphsafe.models.parallel`).
    mlp_bias: bool = False
    indexer_bias: bool = False
    # Indexer fp8 scale format: "ue8m0" (power-of-two scales, DeepSeek-V3.2's checkpoint
    # setting) or None (plain float32 scales).
    index_scale_fmt: str | None = "ue8m0"
    # `flash_attn_varlen`'s fp8 switch for the dense prefill. The op itself keeps its
    # inputs' precision (its default is "off"); the model owns this accuracy trade:
    # "auto" runs fp8 Q/K/V where the device has fp8 matrix units (sm_89+; elsewhere bf16),
    # "off" keeps bf16 (the transformers oracle's numerics), "on" forces fp8. The effect on
    # the model's logits and greedy picks is measured in README.md ("Prefill precision").
    prefill_fp8: str = "auto"
    # The per-layer latent MLA cache (written by `concat_and_cache_mla`, read by
    # `sparse_mla`): "auto" stores the model dtype, R + P values a token (1152 bytes for
    # DeepSeek in bf16); "fp8_ds_mla" stores DeepSeek's FP8 record
    # (`graphsafe.formats.fp8_ds_mla`: R e4m3 bytes, a float32 scale per 128 of them, P bf16
    # rope values; 656 bytes for DeepSeek), which needs R a multiple of 128 and P even.
    # Accuracy against the bf16 cache: every latent value is rounded to e4m3 (relative
    # error at most 2^-4, 3 mantissa bits) after scaling its 128-value tile to +-448, the
    # rope values stay bf16. Measured on the CPU, reference backend (the demo model with
    # R = 128 and an index_topk keeping every key; 3 prompts of 9-20 tokens, 6 decode steps
    # fed the bf16 cache's picks; seeds 0-3, 18 decode rows each): the logits' relative L2
    # error per row is 1.6-1.9% (median), 2.6% at most; max |diff| / max |logits| 2.6% at
    # most; greedy picks agree at 17 of 18 decode positions for every seed. The dense
    # prefill never reads the cache (its logits are equal). tests/test_models_fp8_cache.py
    # bounds it: every row within 2^-4 = 6.25%, picks equal at 3/4 of the positions or more.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_ds_mla":
            if self.kv_lora_rank <= 0 or self.kv_lora_rank % TILE:
                raise ValueError(
                    f"kv_cache_dtype='fp8_ds_mla' needs kv_lora_rank a positive multiple of {TILE} (one float32 "
                    f"scale per {TILE} latent values), got kv_lora_rank={self.kv_lora_rank}"
                )
            if self.qk_rope_head_dim % 2:
                raise ValueError(
                    f"kv_cache_dtype='fp8_ds_mla' needs an even qk_rope_head_dim (2-byte aligned bf16 rope "
                    f"values), got qk_rope_head_dim={self.qk_rope_head_dim}"
                )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times mscale(factor, mscale_all_dim)^2 under YaRN (as
        transformers' `yarn_apply_mscale` and DeepSeek's reference do)."""
        scale = self.qk_head_dim**-0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default":
            mscale_all_dim = rp.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_get_mscale(rp["factor"], mscale_all_dim)
                scale = scale * m * m
        return scale

    @property
    def index_softmax_scale(self) -> float:
        return self.index_head_dim**-0.5

    @classmethod
    def from_hf(cls, cfg: Any, **extra: Any) -> ModelConfig:
        """From a transformers `DeepseekV32Config` or a dict of its fields. Raises for what
        the model does not implement (MoE layers, no q_lora, a non-SiLU MLP)."""
        layers = int(_get(cfg, "num_hidden_layers"))
        kinds = _get(cfg, "mlp_layer_types")
        if kinds is None:
            dense = min(int(_get(cfg, "first_k_dense_replace", layers)), layers)
            kinds = ["dense"] * dense + ["sparse"] * (layers - dense)
        if any(k != "dense" for k in kinds):
            raise NotImplementedError(
                "graphsafe's DeepSeek-V3.2 model implements dense MLP layers only; build the config with "
                f"first_k_dense_replace = num_hidden_layers (and mlp_layer_types all 'dense'), got {list(kinds)}"
            )
        if _get(cfg, "q_lora_rank") is None:
            raise NotImplementedError("DeepSeek-V3.2's indexer reads the q_lora latent: q_lora_rank is required")
        if _get(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"MLP activation {_get(cfg, 'hidden_act')!r}: only 'silu' is implemented")
        heads, kv_heads = int(_get(cfg, "num_attention_heads")), _get(cfg, "num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != heads:
            raise NotImplementedError("MLA shares one latent across heads: num_key_value_heads must equal the heads")
        rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
        rope = dict(rope)
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", _get(cfg, "rope_theta", 10000.0))
        return cls(
            vocab_size=int(_get(cfg, "vocab_size")),
            hidden_size=int(_get(cfg, "hidden_size")),
            intermediate_size=int(_get(cfg, "intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            q_lora_rank=int(_get(cfg, "q_lora_rank")),
            kv_lora_rank=int(_get(cfg, "kv_lora_rank")),
            qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")),
            v_head_dim=int(_get(cfg, "v_head_dim")),
            index_n_heads=int(_get(cfg, "index_n_heads")),
            index_head_dim=int(_get(cfg, "index_head_dim")),
            index_topk=int(_get(cfg, "index_topk")),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
            attention_bias=bool(_get(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            **extra,
        )
