"""A small DeepSeek-V4-style decoder on graphsafe's DeepSeek-V4 ops (demo, tests).

Per layer (`Dsv4Config.compress_ratios[i]`: 0 a sliding-window layer, 4 a compressed sparse
layer with the lightning indexer ("CSA"), any other ratio a heavily compressed layer that
attends to every compressed entry ("HCA"; DeepSeek-V4 uses 128, the demo's default 8 so
that a few dozen tokens compress something)):

  RMSNorm -> q_a, RMSNorm, q_b (H heads of 512 = 448 NoPE + 64 RoPE); kv, RMSNorm ->
  `dsv4_qnorm_rope_kv_insert` (per-head RMSNorm + RoPE of q into the padded heads,
  RoPE + fp8_dsv4 record of kv into the window cache) ->
  [compressed layers] `dsv4_compress_kv` (partial states, gated pooling, RMSNorm, RoPE,
  the compressed cache) ->
  [CSA] the indexer: its own `dsv4_compress_kv` (128-value keys into a bf16 staging row),
  q RoPE and fp8 per-head quantisation (weights folded), `sparse_attn_indexer_decode` /
  `_prefill` (the V3.2 composites: key write into the indexer's fp8 cache, logits,
  top-k over the visible compressed entries) -> `req_local_to_global_slots` ->
  `dsv4_sparse_attn` (window + compressed keys, sinks) -> inverse RoPE of the output's
  RoPE part -> grouped output projection -> residual -> RMSNorm -> SiLU MLP -> residual.

Dense MLPs and no hyper-connections (DeepSeek-V4's MoE and mHC are out of scope: they do
not touch attention); otherwise DeepSeek-V4's attention block (transformers'
`DeepseekV4Attention` with its compressors and indexer: the op-level tests compare against
them). RoPE: "main" (theta 10000) on window-only layers, "compress" (theta 160000, no
YaRN here) on compressed layers, for q, kv, the compressed entries and the indexer.

Caches per layer: the window cache through the host's block tables
(`graphsafe.models.state.HostState`, the V3.2 model's; vLLM frees the blocks that leave the
window, this keeps them), and, with fixed blocks per request row (row r owns blocks `[r
* mb, (r + 1) * mb)`), the compressed cache, the compressor state cache and, on CSA
layers, the indexer's state and fp8 key caches. `kv_cache_dtype`: "fp8_dsv4" (584-byte
records) or "bf16" (1024-byte rows).

Decode (`decode_step`) is a pure function of `DecodeInputs` (rows past the live batch:
seq_len 0, they write and attend to nothing) that compiles with fullgraph and captures
into a CUDA graph: every index comes from `graphsafe.metadata.dsv4` on the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from graphsafe.formats import fp8_dsv4
from graphsafe.metadata import DecodeInputs, DecodeMetadataBuilder
from graphsafe.metadata import dsv4 as meta
from graphsafe.models.layers import quant_fp8_per_head, rms_norm, silu_mul
from graphsafe.models.state import HostState
from graphsafe.ops.dsv4 import dsv4_sparse_attn_workspace_specs
from graphsafe.ops.indexer.plan import sparse_attn_indexer_decode_workspace, sparse_attn_indexer_prefill_workspace
from graphsafe.workspace import current_workspace_manager, workspace_bytes

_ops = torch.ops.graphsafe
_insert = _ops.dsv4_qnorm_rope_kv_insert.default
_compress = _ops.dsv4_compress_kv.default
_attend = _ops.dsv4_sparse_attn.default
_indexer_decode = _ops.sparse_attn_indexer_decode.default
_indexer_prefill = _ops.sparse_attn_indexer_prefill.default
_local_to_global = _ops.req_local_to_global_slots.default

HEAD_DIM = fp8_dsv4.HEAD_DIM
NOPE, ROPE = fp8_dsv4.NOPE_DIM, fp8_dsv4.ROPE_DIM
CSA_RATIO = 4  # the compressed layers with an indexer


@dataclass
class Dsv4Config:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    # q heads the attention runs (vLLM pads DeepSeek-V4's to 64 or 128 for FlashMLA; the
    # padded q rows are 0 and their sinks -inf).
    padded_heads: int = 16
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    window: int = 8
    compress_ratios: tuple[int, ...] = (0, 4, 8, 4)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    kv_cache_dtype: str = "fp8_dsv4"  # or "bf16"
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.num_layers:
            ratios = (0, CSA_RATIO, 8, CSA_RATIO)
            self.compress_ratios = tuple(ratios[i % len(ratios)] for i in range(self.num_layers))
        if self.num_heads % self.o_groups or self.padded_heads < self.num_heads:
            raise ValueError("num_heads must divide into o_groups and fit padded_heads")
        if self.kv_cache_dtype not in ("fp8_dsv4", "bf16"):
            raise ValueError(f"kv_cache_dtype: 'fp8_dsv4' or 'bf16', got {self.kv_cache_dtype!r}")

    @property
    def softmax_scale(self) -> float:
        return HEAD_DIM**-0.5


def param_shapes(cfg: Dsv4Config) -> dict[str, tuple[int, ...]]:
    """Every weight of the model, by name."""
    h, d = cfg.hidden_size, HEAD_DIM
    shapes = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "lm_head": (cfg.vocab_size, h)}
    for i, ratio in enumerate(cfg.compress_ratios):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm": (h,), p + "wq_a": (cfg.q_lora_rank, h), p + "q_norm": (cfg.q_lora_rank,),
            p + "wq_b": (cfg.num_heads * d, cfg.q_lora_rank), p + "wkv": (d, h), p + "kv_norm": (d,),
            p + "sinks": (cfg.num_heads,),
            p + "wo_a": (cfg.o_groups, cfg.o_lora_rank, cfg.num_heads * d // cfg.o_groups),
            p + "wo_b": (h, cfg.o_groups * cfg.o_lora_rank),
            p + "ffn_norm": (h,), p + "w_gate_up": (2 * cfg.intermediate_size, h), p + "w_down": (h, cfg.intermediate_size),
        })
        if ratio:
            w = (2 if ratio == CSA_RATIO else 1) * d
            shapes.update({p + "w_comp": (2 * w, h), p + "ape": (ratio, w), p + "comp_norm": (d,)})
        if ratio == CSA_RATIO:
            di = cfg.index_head_dim
            shapes.update({p + "w_icomp": (4 * di, h), p + "iape": (ratio, 2 * di), p + "inorm": (di,),
                           p + "wq_index": (cfg.index_n_heads * di, cfg.q_lora_rank),
                           p + "w_iweights": (cfg.index_n_heads, h)})
    return shapes


# Weights kept in float32 (as DeepSeek-V4 keeps its norms, position biases and sinks).
FLOAT32 = ("sinks", "ape", "iape", "comp_norm", "inorm")


def random_weights(cfg: Dsv4Config, seed: int = 0, logit_gain: float = 4.0) -> dict[str, torch.Tensor]:
    """Activations of order one: linear weights N(0, 1/fan_in), norms 1 + 0.2 N(0, 1),
    sinks and position biases N(0, 1), embeddings N(0, 1), the LM head `logit_gain` times
    larger (greedy margins above bf16 rounding)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed":
            t = torch.randn(shape, generator=g)
        elif leaf in ("sinks", "ape", "iape"):
            t = torch.randn(shape, generator=g)
        elif len(shape) >= 2:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            if leaf == "lm_head":
                t = t * logit_gain
        else:
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        out[name] = t
    return out


def rope_cos_sin(num_positions: int, theta: float) -> torch.Tensor:
    """`[num_positions, 64]` float32: cos | sin of the 32 interleaved pairs' angles."""
    inv_freq = 1.0 / theta ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of the last 64 values of `x [..., D]` (pairs (2i, 2i + 1)) in float32; cos
    and sin broadcast to `[..., 32]`."""
    head, rope = x[..., :-ROPE], x[..., -ROPE:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)


class _Layer(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        for name, t in caches.items():
            self.register_buffer(name, t, persistent=False)


class DeepseekV4Model(nn.Module):
    """The model, its caches, the decode metadata builder's persistent inputs (module
    docstring). Interface of the V3.2 model (`new_state`, `prefill`, `decode_inputs`,
    `decode_step`, `advance`, the workspace reservations) so the demo drives either."""

    def __init__(self, cfg: Dsv4Config, tensors: dict[str, torch.Tensor], *, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, max_batch: int = 8, max_model_len: int = 256,
                 block_size: int = 16, max_num_batched_tokens: int = 8192):
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"the DeepSeek-V4 ops run bf16 queries: dtype must be bfloat16, got {dtype}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks = -(-max_model_len // block_size)
        self.num_blocks = max_batch * self.max_blocks
        self.scale = cfg.softmax_scale
        self.eps = cfg.rms_norm_eps
        self.index_weight_scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5
        consts = (self.scale, self.eps, self.index_weight_scale)
        self._floats = torch._dynamo.assume_constant_result(lambda: consts)
        # The compressed entries a request can hold, per ratio; the indexer's top-k never
        # exceeds the entries it chooses from.
        self.entries = {r: max(1, -(-max_model_len // r)) for r in set(cfg.compress_ratios) if r}
        self.topk = min(cfg.index_topk, self.entries.get(CSA_RATIO, 1))

        def param(name: str, t: torch.Tensor) -> torch.Tensor:
            keep = torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32 else dtype
            return t.detach().to(device=self.device, dtype=keep).contiguous()

        self.embed = nn.Parameter(param("embed", tensors["embed"]), requires_grad=False)
        self.final_norm = nn.Parameter(param("final_norm", tensors["final_norm"]), requires_grad=False)
        self.lm_head = nn.Parameter(param("lm_head", tensors["lm_head"]), requires_grad=False)
        # Fixed per-row tables: positions (state caches) and compressed entries, `block_size` a block.
        rows = torch.arange(max_batch, dtype=torch.int32)[:, None]
        self.register_buffer("state_table", (rows * self.max_blocks + torch.arange(self.max_blocks, dtype=torch.int32))
                             .to(self.device), persistent=False)
        self.entry_blocks = {r: -(-n // block_size) for r, n in self.entries.items()}
        for r, mb in self.entry_blocks.items():
            table = rows * mb + torch.arange(mb, dtype=torch.int32)
            self.register_buffer(f"entry_table_{r}", table.to(self.device), persistent=False)
        layers = []
        for i, ratio in enumerate(cfg.compress_ratios):
            prefix = f"layers.{i}."
            own = {k[len(prefix):]: param(k, v) for k, v in tensors.items() if k.startswith(prefix)}
            layers.append(_Layer(own, self._caches(ratio)))
        self.layers = nn.ModuleList(layers)
        max_pos = max(max_model_len, 1)
        self.register_buffer("rope_main", rope_cos_sin(max_pos, cfg.rope_theta).to(self.device), persistent=False)
        self.register_buffer("rope_compress", rope_cos_sin(max_pos, cfg.compress_rope_theta).to(self.device),
                             persistent=False)
        self.register_buffer("topk_buffer", torch.full((max(max_batch, max_num_batched_tokens), self.topk), -1,
                                                       dtype=torch.int32, device=self.device), persistent=False)
        staging_rows = max(max_batch, max_num_batched_tokens)
        self.register_buffer("index_staging", torch.zeros(staging_rows, 1, cfg.index_head_dim, dtype=dtype,
                                                          device=self.device), persistent=False)
        self.decode_builder = DecodeMetadataBuilder(max_batch, self.max_blocks, block_size, self.device)

    # -- construction ------------------------------------------------------------------
    def _row_cache(self, num_blocks: int) -> torch.Tensor:
        if self.cfg.kv_cache_dtype == "fp8_dsv4":
            cache = fp8_dsv4.empty_cache(num_blocks, self.block_size, self.device)
            torch.as_strided(cache, (num_blocks * cache.stride(0),), (1,)).zero_()
            return cache
        return torch.zeros(num_blocks, self.block_size, HEAD_DIM, dtype=self.dtype, device=self.device)

    def _caches(self, ratio: int) -> dict[str, torch.Tensor]:
        cfg, nrows = self.cfg, self.max_batch
        caches = {"swa_cache": self._row_cache(self.num_blocks)}
        if ratio:
            w = (2 if ratio == CSA_RATIO else 1) * HEAD_DIM
            caches["comp_cache"] = self._row_cache(nrows * self.entry_blocks[ratio])
            caches["state_cache"] = torch.zeros(nrows * self.max_blocks, self.block_size, 2 * w, device=self.device)
        if ratio == CSA_RATIO:
            di = cfg.index_head_dim
            caches["istate_cache"] = torch.zeros(nrows * self.max_blocks, self.block_size, 4 * di, device=self.device)
            caches["index_cache"] = torch.zeros(nrows * self.entry_blocks[ratio], self.block_size, di + 4,
                                                dtype=torch.uint8, device=self.device)
        return caches

    def cache_bytes_per_token(self) -> int:
        """Attention cache bytes one token takes in all layers: its window-cache row, plus
        1 / ratio of a compressed row on compressed layers (the window cache holds every
        position here; vLLM keeps only the window's blocks)."""
        row = fp8_dsv4.TOKEN_BYTES if self.cfg.kv_cache_dtype == "fp8_dsv4" else 2 * HEAD_DIM
        return sum(row + (row // r if r else 0) for r in self.cfg.compress_ratios)

    def cache_description(self) -> str:
        """The demo's cache line."""
        cfg = self.cfg
        kind = ("fp8_dsv4 records: 448 e4m3 NoPE bytes, 7 UE8M0 scales + 1 pad, 64 bf16 RoPE values = 584 bytes"
                if cfg.kv_cache_dtype == "fp8_dsv4" else "bf16 rows: 512 values = 1024 bytes")
        return (f"DeepSeek-V4 caches: {kind} a token; window {cfg.window}; compress ratios {list(cfg.compress_ratios)} "
                f"(4: indexer top-{self.topk}); {self.cache_bytes_per_token()} bytes per token in all "
                f"{cfg.num_layers} layers")

    # -- host bookkeeping ----------------------------------------------------------------
    def new_state(self) -> HostState:
        return HostState(self.max_batch, self.max_blocks, self.block_size, self.num_blocks, self.max_model_len)

    def decode_inputs(self, state: HostState, next_tokens: torch.Tensor) -> DecodeInputs:
        return self.decode_builder.build(state.decode_batch(), next_tokens).inputs

    def advance(self, state: HostState, next_tokens: torch.Tensor | None = None) -> None:
        state.advance(next_tokens)

    # -- workspace -------------------------------------------------------------------------
    def _attention_workspace(self, tokens: int) -> int:
        cfg = self.cfg
        worst = 0
        for ratio in set(cfg.compress_ratios):
            k2 = 0 if not ratio else (self.topk if ratio == CSA_RATIO else self.entries[ratio])
            specs = dsv4_sparse_attn_workspace_specs(tokens, cfg.padded_heads, HEAD_DIM, cfg.window, k2,
                                                     device=self.device)
            worst = max(worst, workspace_bytes(*specs))
        return worst

    def decode_workspace_bytes(self, max_batch: int | None = None) -> int:
        max_batch = self.max_batch if max_batch is None else max_batch
        worst = 0
        for b in range(1, max_batch + 1):
            indexer = sparse_attn_indexer_decode_workspace(
                b, self.entries.get(CSA_RATIO, 1), self.cfg.index_n_heads, self.cfg.index_head_dim, self.topk)
            worst = max(worst, self._attention_workspace(b), workspace_bytes(*indexer))
        return worst

    def decode_workspace_reserve(self, max_batch: int | None = None) -> int:
        need = self.decode_workspace_bytes(max_batch)
        current_workspace_manager(self.device).reserve(nbytes=need, owner="DeepseekV4Model.decode")
        return need

    def prefill_workspace_bytes(self, max_tokens: int | None = None) -> int:
        t = min(self.max_num_batched_tokens, self.max_batch * self.max_model_len) if max_tokens is None else max_tokens
        worst = 0
        if CSA_RATIO in self.entries:
            indexer = sparse_attn_indexer_prefill_workspace(
                t, self.entries[CSA_RATIO], self.cfg.index_n_heads, self.cfg.index_head_dim, self.topk,
                max_total_seq_lens=self.max_batch * self.entries[CSA_RATIO])
            worst = workspace_bytes(*indexer)
        for rows in range(1, t + 1):
            worst = max(worst, self._attention_workspace(rows))
        return worst

    def prefill_workspace_reserve(self, max_tokens: int | None = None) -> int:
        need = self.prefill_workspace_bytes(max_tokens)
        current_workspace_manager(self.device).reserve(nbytes=need, owner="DeepseekV4Model.prefill")
        return need

    # -- the layer -----------------------------------------------------------------------------
    def _layer(self, i: int, layer: _Layer, x: torch.Tensor, pos: torch.Tensor, reqs: torch.Tensor,
               swa_table: torch.Tensor, swa_slots: torch.Tensor, indexer) -> torch.Tensor:
        """One layer over T tokens at positions `pos` (-1: padding) of request rows `reqs`;
        `indexer(layer, h, qr, pos, reqs, comp_slots, visible) -> local top-k [T, K]`."""
        cfg = self.cfg
        scale, eps, _ = self._floats()
        ratio = cfg.compress_ratios[i]
        t = x.shape[0]
        h = rms_norm(x, layer.attn_norm, eps)
        qr = rms_norm(F.linear(h, layer.wq_a), layer.q_norm, eps)
        q = F.linear(qr, layer.wq_b).view(t, cfg.num_heads, HEAD_DIM)
        kv = rms_norm(F.linear(h, layer.wkv), layer.kv_norm, eps)
        rope = self.rope_compress if ratio else self.rope_main
        q_out = q.new_empty((t, cfg.padded_heads, HEAD_DIM))
        _insert(q, kv, q_out, layer.swa_cache, swa_slots, pos, rope, eps)
        window_idx, window_len = meta.window_indices(pos, reqs, swa_table, self.block_size, cfg.window)
        extra = (None, None, None)
        if ratio:
            table = getattr(self, f"entry_table_{ratio}")
            comp_slots = meta.compressed_slots(pos, reqs, table, self.block_size, ratio)
            state_slots = meta.position_slots(pos, reqs, self.state_table, self.block_size)
            kv_c, score = F.linear(h, layer.w_comp).chunk(2, dim=-1)
            _compress(kv_c, score, layer.ape, pos, layer.state_cache, state_slots, self.state_table, reqs,
                      layer.comp_norm, eps, rope, layer.comp_cache, comp_slots, ratio)
            visible = meta.visible_entries(pos, ratio)
            if ratio == CSA_RATIO:
                local = indexer(layer, h, qr, pos, reqs, comp_slots, state_slots, visible)
                slots, lengths = meta.topk_slots(local, reqs, table, self.block_size, visible)
            else:
                slots, lengths = meta.all_entry_indices(pos, reqs, table, self.block_size, ratio, self.entries[ratio])
            extra = (layer.comp_cache, slots, lengths)
        sinks = torch.cat([layer.sinks, layer.sinks.new_full((cfg.padded_heads - cfg.num_heads,), float("-inf"))])
        out, _ = _attend(q_out, layer.swa_cache, window_idx, scale, sinks, window_len, *extra)
        # The value carried RoPE: rotate the output back (the conjugate, at the query's position).
        cs = rope[pos.clamp(min=0)]
        o = rotate(out[:, : cfg.num_heads], cs[:, None, : ROPE // 2], -cs[:, None, ROPE // 2 :])
        # [G, T, H / G * 512]: the heads split into groups, then each group's rows joined. One
        # reshape [T, H, 512] -> [T, G, H / G * 512] of this (unrealised) result would split
        # and join a dimension at once, which Inductor lowers through a flat view that guards
        # T == 1 when it compiles at T = 1 (a recompile at the next batch size, whose graph
        # the CUDA-graph buckets of size 1 then replay).
        o = o.unflatten(1, (cfg.o_groups, -1)).flatten(2).transpose(0, 1)
        # A contiguous copy, then a view: `reshape` of the transposed result would make
        # Dynamo guard on T == 1 (the V3.2 model's note).
        o = torch.bmm(o, layer.wo_a.transpose(1, 2)).transpose(0, 1)
        o = o.clone(memory_format=torch.contiguous_format).view(t, -1)
        x = x + F.linear(o, layer.wo_b)
        return x + F.linear(silu_mul(F.linear(rms_norm(x, layer.ffn_norm, eps), layer.w_gate_up)), layer.w_down)

    def _index_inputs(self, layer: _Layer, h, qr, pos, reqs, comp_slots, state_slots):
        """The indexer's keys (its compressor into the staging rows; a token's row is
        written only where it completes an entry), fp8 queries and folded weights."""
        cfg = self.cfg
        _, eps, weight_scale = self._floats()
        t = h.shape[0]
        staging = self.index_staging[:t]
        rows = torch.arange(t, device=h.device)
        ikv, iscore = F.linear(h, layer.w_icomp).chunk(2, dim=-1)
        _compress(ikv, iscore, layer.iape, pos, layer.istate_cache, state_slots, self.state_table, reqs, layer.inorm,
                  eps, self.rope_compress, staging, torch.where(comp_slots >= 0, rows, -1), CSA_RATIO)
        iq = F.linear(qr, layer.wq_index).view(t, cfg.index_n_heads, cfg.index_head_dim)
        cs = self.rope_compress[pos.clamp(min=0)]
        iq = rotate(iq, cs[:, None, : ROPE // 2], cs[:, None, ROPE // 2 :])
        iq8, iq_scale = quant_fp8_per_head(iq, "ue8m0")
        weights = F.linear(h, layer.w_iweights).float() * weight_scale * iq_scale
        return iq8, staging.view(t, cfg.index_head_dim), weights

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        _, eps, _ = self._floats()
        return F.linear(rms_norm(x, self.final_norm, eps), self.lm_head).float()

    # -- decode --------------------------------------------------------------------------------
    def decode_step(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of one decode step: reads `inputs` and the model's
        tensors (mutates the caches and the top-k buffer); no host int from data, no sync."""
        x = F.embedding(inputs.input_ids, self.embed)
        b = x.shape[0]
        pos = torch.where(inputs.seq_lens > 0, inputs.positions, -1)
        reqs = torch.arange(b, dtype=torch.int32, device=x.device)
        torch._check(b <= self.topk_buffer.shape[0])
        torch._check(b <= self.state_table.shape[0])

        def indexer(layer, h, qr, pos, reqs, comp_slots, state_slots, visible):
            iq8, ik, w = self._index_inputs(layer, h, qr, pos, reqs, comp_slots, state_slots)
            _indexer_decode(layer.index_cache, iq8, ik, w, comp_slots, visible, self.entry_table_4[:b],
                            self.topk_buffer, "ue8m0", self.topk, self.entries[CSA_RATIO])
            return self.topk_buffer[:b]

        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, pos, reqs, inputs.block_table, inputs.slot_mapping, indexer)
        return self._logits(x)

    # -- prefill -----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, state: HostState, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add `prompts` as new requests and run them, in chunks of whole prompts of at most
        `max_num_batched_tokens` tokens (a longer prompt is a chunk of its own); returns the
        last-token logits `[len(prompts), vocab]` float32 (request order)."""
        lengths = [len(p) for p in prompts]
        rows = state.add_requests(lengths)
        logits, start = [], 0
        while start < len(prompts):
            end, tokens = start, 0
            while end < len(prompts) and (end == start or tokens + lengths[end] <= self.max_num_batched_tokens):
                tokens += lengths[end]
                end += 1
            logits.append(self._prefill_chunk(state, rows[start:end], prompts[start:end]))
            start = end
        state.commit_prefill(rows, lengths)
        return torch.cat(logits) if logits else torch.empty(0, self.cfg.vocab_size, device=self.device)

    def _prefill_chunk(self, state: HostState, rows: list[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """One chunk: every token of whole new prompts (no cached context), host-driven."""
        lengths = [len(p) for p in prompts]
        dev = self.device
        ids = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])).to(dev)
        pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(dev)
        reqs = torch.from_numpy(np.concatenate([np.full(n, r, dtype=np.int32) for r, n in zip(rows, lengths)])).to(dev)
        swa_table = state.block_table.to(dev)
        swa_slots = meta.position_slots(pos, reqs, swa_table, self.block_size)
        # The indexer: request b's compressed entries gathered at rows [cu[b], cu[b + 1]), a
        # token at position p scoring the first (p + 1) // 4 of them.
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([n // CSA_RATIO for n in lengths], out=cu[1:])
        local = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)])
        ks = torch.from_numpy(cu[local]).to(dev)
        cu_dev = torch.from_numpy(cu).to(dev)
        total = max(int(cu[-1]), 1)
        t = ids.shape[0]

        def indexer(layer, h, qr, pos, reqs, comp_slots, state_slots, visible):
            iq8, ik, w = self._index_inputs(layer, h, qr, pos, reqs, comp_slots, state_slots)
            topk = self.topk_buffer[:t]
            _indexer_prefill(layer.index_cache, iq8, ik, w, comp_slots, self.entry_table_4[rows], cu_dev, ks,
                             ks + visible, topk, "ue8m0", self.topk, total)
            return topk

        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, pos, reqs, swa_table, swa_slots, indexer)
        last = torch.from_numpy(np.cumsum(lengths) - 1).to(dev)
        return self._logits(x[last])


def build_dsv4_demo_model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          **overrides: Any) -> tuple[DeepseekV4Model, None]:
    """(the model, None: no transformers twin) with random weights. `overrides`: `Dsv4Config`
    fields (e.g. `compress_ratios=(0, 4, 128, 4)` or "0,4,128,4", `window=128`, `kv_cache_dtype="bf16"`) and
    model sizes (`max_batch` 8, `max_model_len` 256, `block_size` 16, `max_num_batched_tokens`);
    unknown fields are refused."""
    sizes = {"max_batch": 8, "max_model_len": 256, "block_size": 16}
    for k in ("max_batch", "max_model_len", "block_size", "max_num_batched_tokens"):
        if k in overrides:
            sizes[k] = overrides.pop(k)
    if isinstance(overrides.get("compress_ratios"), str):  # `--model compress_ratios=0,4,128,4`
        overrides["compress_ratios"] = tuple(int(r) for r in overrides["compress_ratios"].split(","))
    if "num_hidden_layers" in overrides:  # the V3.2 demo's name
        overrides["num_layers"] = overrides.pop("num_hidden_layers")
    names = set(Dsv4Config.__dataclass_fields__)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown DeepSeek-V4 demo model fields {unknown}; known: {sorted(names)}")
    cfg = Dsv4Config(**overrides)
    return DeepseekV4Model(cfg, random_weights(cfg, seed), device=device, dtype=dtype, **sizes), None


__all__ = ["DeepseekV4Model", "Dsv4Config", "build_dsv4_demo_model", "param_shapes", "random_weights", "rope_cos_sin"]
