"""A DeepSeek-V3.2-style decoder on graphsafe's ops: MLA attention with the DSA lightning
indexer, dense MLPs (see `ModelConfig.from_hf`).

Decode (`decode_step`, one token per request; a pure function of `DecodeInputs` that
compiles with fullgraph and captures into a CUDA graph), per layer:
  RMSNorm -> one GEMM for q_a / kv_a / indexer k / indexer weights -> norms -> one GEMM
  for q_b / indexer q -> rope -> `concat_and_cache_mla` (latent + rope key) ->
  `sparse_attn_indexer_decode` (fp8 queries, weights folded with the query scales and the
  softmax scales; writes the new indexer key and the top-k into the shared buffer) ->
  `req_local_to_global_slots` -> absorbed `sparse_mla` (q_nope @ W_UK; output @ W_UV) ->
  o_proj -> residual -> RMSNorm -> SiLU MLP -> residual; final norm, lm_head.

Prefill (`prefill`, eager, host-driven): requests whose length is at most `index_topk`
take `flash_attn_varlen` over up-projected K/V (the DSA selection keeps every causal key,
so dense attention is exact); longer requests take `sparse_attn_indexer_prefill` and
absorbed `sparse_mla` over the paged cache. This is transformers' semantics: its indexer
keeps the top `min(index_topk, T)` causal keys of each query and masks the rest.

Latent cache (`ModelConfig.kv_cache_dtype`): "auto" keeps R + P values a token in the
model dtype; "fp8_ds_mla" keeps DeepSeek's 656-byte FP8 record (`graphsafe.formats.fp8_ds_mla`).
The same op calls serve both (the ops read the format from the cache tensor): decode
writes with `concat_and_cache_mla` and reads with `sparse_mla`; prefill writes the
cache, its dense path attends over the bf16 projections (it never reads the cache),
its sparse path reads the cache with `sparse_mla`.

Indexer numerics: queries and keys are fp8 (DeepGEMM/vLLM), transformers scores in
float32 from bf16 inputs; the two select the same keys except at near-ties of the k-th
score (tests/test_models.py measures it). The Hadamard rotation of DeepSeek's reference
is skipped, as in transformers (orthogonal: exact scores are unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from graphsafe.metadata import DecodeInputs, DecodeMetadataBuilder, PrefillMetadata, build_prefill
from graphsafe.models.config import ModelConfig
from graphsafe.models.layers import quant_fp8_per_head, rms_norm, silu_mul
from graphsafe.models.parallel import TensorParallel, local_config, shard_tensors
from graphsafe.models.rope import apply_half, apply_interleaved, rope_tables
from graphsafe.models.state import HostState
from graphsafe.models.weights import convert_state_dict
from graphsafe.formats.fp8_ds_mla import record_bytes
from graphsafe.ops.indexer.plan import sparse_attn_indexer_decode_workspace, sparse_attn_indexer_prefill_workspace
from graphsafe.ops.mla import sparse_mla_workspace_specs
from graphsafe.workspace import current_workspace_manager, workspace_bytes

import graphsafe

_ops = torch.ops.graphsafe
_concat_and_cache_mla = _ops.concat_and_cache_mla.default
_indexer_decode = _ops.sparse_attn_indexer_decode.default
_indexer_prefill = _ops.sparse_attn_indexer_prefill.default
_indexer_k_cache = _ops.indexer_k_quant_and_cache.default
_local_to_global = _ops.req_local_to_global_slots.default
_sparse_mla = _ops.sparse_mla.default
_flash_attn_varlen = _ops.flash_attn_varlen.default



# A layer's optional biases (`weights.convert_state_dict`): None where the config has none.
OPTIONAL_BIASES = ("b_a", "b_o", "b_iq", "b_gate_up", "b_down")


class _Layer(nn.Module):
    """One decoder layer's weights and caches (names: `weights.convert_state_dict`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], kv_cache: torch.Tensor, index_cache: torch.Tensor):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        for name in OPTIONAL_BIASES:  # the biases the config leaves out (weights.convert_state_dict)
            if name not in tensors:
                setattr(self, name, None)
        self.register_buffer("kv_cache", kv_cache, persistent=False)
        self.register_buffer("index_cache", index_cache, persistent=False)


class DeepseekV32Model(nn.Module):
    """The model plus its paged caches (latent MLA cache and indexer K cache per layer),
    the shared top-k buffer and the decode metadata builder's persistent inputs.

    With `tp` (a `graphsafe.models.parallel.TensorParallel` of size > 1) this is one
    rank's shard: `tensors` are the full model's, sliced here; `cfg` is then this rank's
    config (its heads and MLP width divided by the group size) and `full_cfg` the whole
    model's. Every rank runs the same calls in the same order (the all-reduces pair up)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        max_batch: int = 128,
        max_model_len: int = 4096,
        block_size: int = 64,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 8192,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.tp = tp if tp is not None else TensorParallel()
        self.full_cfg = cfg
        tensors = shard_tensors(cfg, tensors, self.tp)
        cfg = local_config(cfg, self.tp)
        if cfg.index_head_dim % 16:
            raise ValueError(f"index_head_dim must be a multiple of 16 (fp8 indexer ops), got {cfg.index_head_dim}")
        if cfg.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        if cfg.kv_cache_dtype == "fp8_ds_mla" and dtype != torch.bfloat16:
            # The MLA ops read an fp8_ds_mla cache with bf16 queries only.
            raise ValueError(f"kv_cache_dtype='fp8_ds_mla' needs the model dtype bfloat16, got {dtype}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_batch * self.max_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        # transformers keeps min(index_topk, T) keys; T never exceeds max_model_len.
        self.topk = min(cfg.index_topk, max_model_len)
        self.scale = cfg.softmax_scale
        self.rms_eps = cfg.rms_norm_eps
        self.index_weight_scale = cfg.index_n_heads**-0.5 * cfg.index_softmax_scale
        # Under torch.compile(dynamic=True) a float read from an attribute becomes a
        # symbolic float; the ops' `float` arguments then force dynamo to restart its
        # analysis with the value specialised (compile time doubles). The floats are fixed
        # for the model's life, so traced code reads them as constants.
        consts = (self.scale, self.rms_eps, self.index_weight_scale)
        self._floats = torch._dynamo.assume_constant_result(lambda: consts)

        def param(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=self.device, dtype=dtype).contiguous()

        self.embed = nn.Parameter(param(tensors["embed"]), requires_grad=False)
        self.final_norm = nn.Parameter(param(tensors["final_norm"]), requires_grad=False)
        self.lm_head = nn.Parameter(param(tensors["lm_head"]), requires_grad=False)
        layers = []
        d = cfg.index_head_dim
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}."
            own = {k[len(prefix) :]: param(v) for k, v in tensors.items() if k.startswith(prefix)}
            kv_cache = self._new_kv_cache()
            index_cache = torch.zeros(self.num_blocks, block_size, d + 4, dtype=torch.uint8, device=self.device)
            layers.append(_Layer(own, kv_cache, index_cache))
        self.layers = nn.ModuleList(layers)
        cos, sin = rope_tables(cfg, max_model_len, dtype, self.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The indexer's shared top-k output (vLLM's topk_indices_buffer), decode rows.
        topk_buffer = torch.full((max_batch, self.topk), -1, dtype=torch.int32, device=self.device)
        self.register_buffer("topk_buffer", topk_buffer, persistent=False)
        self.decode_builder = DecodeMetadataBuilder(max_batch, self.max_blocks, block_size, self.device)
        # Test hook, eager only: called as trace(kind, layer, values) after each sparse
        # indexer step with its rows' fp8 queries, folded weights, request-local top-k,
        # request (batch row), positions, context lengths and block-table rows (copies).
        # None (the default) costs nothing under torch.compile (a guard on the attribute).
        self.trace: Callable[[str, int, dict], None] | None = None

    # -- construction ------------------------------------------------------------------
    def _new_kv_cache(self) -> torch.Tensor:
        """One layer's zeroed latent cache `[num_blocks, block_size, row]`: rows of R + P
        values in the model dtype ("auto"), or uint8 fp8_ds_mla records of
        `record_bytes(R, P)` bytes (`ModelConfig.kv_cache_dtype`). The ops tell the two
        apart by the tensor alone; nothing else in the model depends on the kind."""
        r, p = self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim
        if self.cfg.kv_cache_dtype == "fp8_ds_mla":
            shape, dtype = (self.num_blocks, self.block_size, record_bytes(r, p)), torch.uint8
        else:
            shape, dtype = (self.num_blocks, self.block_size, r + p), self.dtype
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def cache_bytes_per_token(self) -> int:
        """Bytes one token takes in the latent MLA caches of all layers (this rank's: the
        latent cache is replicated under tensor parallelism). The indexer's fp8 key cache
        (`index_head_dim + 4` bytes a layer, the same for both cache kinds) is not counted."""
        return sum(layer.kv_cache.shape[-1] * layer.kv_cache.element_size() for layer in self.layers)

    @classmethod
    def from_hf_state_dict(
        cls,
        hf_config,
        state_dict: dict[str, torch.Tensor],
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        max_batch: int = 128,
        max_model_len: int | None = None,
        block_size: int = 64,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 8192,
        tp: TensorParallel | None = None,
        **config_extra,
    ) -> DeepseekV32Model:
        """Load a transformers `DeepseekV32ForCausalLM` state dict (dense MLP layers).

        `hf_config`: its `DeepseekV32Config` (or a dict of the same fields);
        `config_extra`: `ModelConfig` fields not in it (`index_scale_fmt`, `prefill_fp8`,
        `kv_cache_dtype`).
        `max_model_len` defaults to `min(max_position_embeddings, 4096)`. `tp`: load
        this rank's shard of the same full state dict (see `graphsafe.models.parallel`).
        """
        cfg = ModelConfig.from_hf(hf_config, **config_extra)
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 4096)
        tensors = convert_state_dict(cfg, state_dict)
        return cls(
            cfg,
            tensors,
            device=device,
            dtype=dtype,
            max_batch=max_batch,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            tp=tp,
        )

    # -- host bookkeeping ----------------------------------------------------------------
    def new_state(self, block_ids: Sequence[int] | None = None) -> HostState:
        """Fresh request bookkeeping over this model's caches. The caches are shared, so
        a new state starts from an empty cache logically, handing out `block_ids` (default
        every block: one state at a time). States with disjoint `block_ids` may be used
        side by side, e.g. one prefilling on a second stream while another decodes."""
        return HostState(self.max_batch, self.max_blocks, self.block_size, self.num_blocks, self.max_model_len,
                         block_ids)

    def decode_inputs(self, state: HostState, next_tokens: torch.Tensor) -> DecodeInputs:
        """Inputs of the next decode step of every request in `state`: `next_tokens [n]`
        (int64, on the device or the host) are fed at positions `seq_lens`. Built from the
        state's CPU mirrors into the builder's persistent buffers (no host sync); the
        result is a view of the first n rows, valid until the next build."""
        return self.decode_builder.build(state.decode_batch(), next_tokens).inputs

    def advance(self, state: HostState, next_tokens: torch.Tensor | None = None) -> None:
        """Host bookkeeping after a decode step: each request's token of the step is now
        cached (seq_lens += 1). `next_tokens`, if given (typically the tokens sampled from
        the step's logits), are appended to `state.outputs` as they are: device tensors
        are kept on the device, nothing is read back."""
        state.advance(next_tokens)

    # -- workspace -------------------------------------------------------------------------
    def decode_workspace_bytes(self, max_batch: int | None = None) -> int:
        """Worst-case workspace of one decode step with at most `max_batch` requests: the
        largest single request (ops run one at a time) over every batch size, since the
        ops' split plans need not grow monotonically with the batch."""
        max_batch = self.max_batch if max_batch is None else max_batch
        cfg = self.cfg
        worst = 0
        for b in range(1, max_batch + 1):
            indexer = sparse_attn_indexer_decode_workspace(
                b, self.max_model_len, cfg.index_n_heads, cfg.index_head_dim, self.topk
            )
            mla = sparse_mla_workspace_specs(
                b, cfg.num_heads, cfg.kv_lora_rank, self.topk, device=self.device,
                head_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=self.dtype,
            )
            worst = max(worst, workspace_bytes(*indexer), workspace_bytes(*mla))
        return worst

    def decode_workspace_reserve(self, max_batch: int | None = None) -> int:
        """Grow this device's workspace to the decode worst case (call before capture);
        returns the bytes reserved."""
        need = self.decode_workspace_bytes(max_batch)
        current_workspace_manager(self.device).reserve(nbytes=need, owner="DeepseekV32Model.decode")
        return need

    def prefill_workspace_bytes(self, max_tokens: int | None = None) -> int:
        """Worst-case workspace of one prefill chunk of at most `max_tokens` new tokens
        without cached context (default: the most a chunk can hold, the smaller of the
        chunk budget `max_num_batched_tokens` and `max_batch * max_model_len`): the sparse
        indexer composite (its bound covers every smaller chunk) and `sparse_mla` at every
        token count (its split plan is not monotonic). The dense path's
        `flash_attn_varlen` needs scratch only for its fp8 path (`prefill_fp8` not "off")."""
        if max_tokens is None:
            max_tokens = min(self.max_num_batched_tokens, self.max_batch * self.max_model_len)
        t = max_tokens
        cfg = self.cfg
        indexer = sparse_attn_indexer_prefill_workspace(
            t, self.max_model_len, cfg.index_n_heads, cfg.index_head_dim, self.topk, max_total_seq_lens=t
        )
        worst = workspace_bytes(*indexer)
        for rows in range(1, t + 1):
            mla = sparse_mla_workspace_specs(
                rows, cfg.num_heads, cfg.kv_lora_rank, self.topk, device=self.device,
                head_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=self.dtype,
            )
            worst = max(worst, workspace_bytes(*mla))
        if cfg.prefill_fp8 != "off":
            spec = graphsafe.get_op("flash_attn_varlen")
            varlen = spec.workspace_bytes(t, t, cfg.num_heads, cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim)
            worst = max(worst, varlen)
        return worst

    def prefill_workspace_reserve(self, max_tokens: int | None = None) -> int:
        """Grow the workspace to `prefill_workspace_bytes(max_tokens)` (call before a
        capture locks it, if prefills follow the capture); returns the bytes."""
        need = self.prefill_workspace_bytes(max_tokens)
        current_workspace_manager(self.device).reserve(nbytes=need, owner="DeepseekV32Model.prefill")
        return need

    # -- shared per-layer pieces -------------------------------------------------------------
    def _project(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input -> (q_nope, q_pe, kv_c, k_pe, index q, index k, index weights)."""
        cfg = self.cfg
        t = x.shape[0]
        _, eps, index_weight_scale = self._floats()
        h = rms_norm(x, layer.input_norm, eps)
        a = F.linear(h, layer.w_a, layer.b_a)
        q_c, kv_c, k_pe, ik, iw = a.split(
            [cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.index_n_heads], dim=-1
        )
        # The q_a / kv_a norms and the indexer LayerNorm use transformers' default eps.
        q_c = rms_norm(q_c, layer.q_a_norm, 1e-6)
        kv_c = rms_norm(kv_c, layer.kv_a_norm, 1e-6)
        ik = F.layer_norm(ik, (cfg.index_head_dim,), layer.ik_norm_w, layer.ik_norm_b, 1e-6)
        # Two GEMMs over row blocks of w_b (contiguous slices), not one GEMM split after:
        # a column slice of the product is non-contiguous, and Inductor's view lowering
        # then asks whether T == 1 (torch 2.11), a guard that gives B = 1 its own graph.
        n_q = cfg.num_heads * cfg.qk_head_dim
        q, iq = F.linear(q_c, layer.w_b[:n_q]), F.linear(q_c, layer.w_b[n_q:], layer.b_iq)
        q_nope, q_pe = q.view(t, cfg.num_heads, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        cos_h, sin_h = cos[:, None, :], sin[:, None, :]
        q_pe = apply_interleaved(q_pe, cos_h, sin_h)
        k_pe = apply_interleaved(k_pe, cos, sin)
        iq = apply_half(iq.view(t, cfg.index_n_heads, cfg.index_head_dim), cos_h, sin_h)
        ik = apply_half(ik, cos, sin)
        iq8, iq_scale = quant_fp8_per_head(iq, cfg.index_scale_fmt)
        # relu(s * x) = s * relu(x) for s > 0: the softmax scale and the query's fp8 scale
        # move into the per-head weights (vLLM's folding).
        weights = iw.float() * index_weight_scale * iq_scale
        return q_nope, q_pe, kv_c.contiguous(), k_pe.contiguous(), iq8, ik.contiguous(), weights

    def _absorbed_attention(self, layer: _Layer, q_nope, q_pe, slots) -> torch.Tensor:
        """Absorbed sparse MLA over cache `slots [T, K]` -> `[T, H * v_head_dim]`."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1)  # [T, H, R]
        q = torch.cat([q_lat, q_pe], dim=-1)
        scale, _, _ = self._floats()
        out, _ = _sparse_mla(q, layer.kv_cache, slots, scale, self.cfg.kv_lora_rank)
        # An explicit contiguous copy, then a view: `reshape` of the transposed bmm result
        # makes Dynamo guard on T == 1 (it is a view only then), and so does einsum, which
        # compiled B = 1 as a graph of its own. reshape copied here anyway.
        t = out.shape[0]
        out = torch.bmm(out.transpose(0, 1), layer.w_uv_t).transpose(0, 1)  # [T, H, v]
        return out.clone(memory_format=torch.contiguous_format).view(t, -1)

    def _mlp_block(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        _, eps, _ = self._floats()
        tp = self.tp
        if tp.size == 1:
            x = x + F.linear(attn, layer.w_o, layer.b_o)
        else:  # row-parallel o_proj: partial sums over this rank's heads; the bias once, after
            o = tp.all_reduce(F.linear(attn, layer.w_o))
            x = x + (o if layer.b_o is None else o + layer.b_o)
        h = rms_norm(x, layer.post_norm, eps)
        # gate/up column-parallel (their bias sharded with the rows), down row-parallel.
        act = silu_mul(F.linear(h, layer.w_gate_up, layer.b_gate_up))
        if tp.size == 1:
            return x + F.linear(act, layer.w_down, layer.b_down)
        down = tp.all_reduce(F.linear(act, layer.w_down))  # the bias once, after the sum
        return x + (down if layer.b_down is None else down + layer.b_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        _, eps, _ = self._floats()
        return F.linear(rms_norm(x, self.final_norm, eps), self.lm_head).float()

    # -- decode --------------------------------------------------------------------------------
    def decode_step(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of one decode step. Reads only `inputs` and the
        model's tensors (mutates the caches and the top-k buffer): no host ints from data,
        no sync, shapes from `B` alone. Padding rows (slot -1, seq_len 0) write nothing
        and attend to nothing: their logits are finite and meaningless."""
        cfg = self.cfg
        x = F.embedding(inputs.input_ids, self.embed)
        b = x.shape[0]
        cos, sin = self.rope_cos[inputs.positions], self.rope_sin[inputs.positions]
        req_ids = torch.arange(b, dtype=torch.int32, device=x.device)
        # Under backed_size_oblivious (one graph for every batch size, B = 1 included)
        # torch 2.11 cannot tell that b fits the buffer and gives the slice an unbacked
        # length, which the ops' shape checks then fail to compare with b: say it.
        torch._check(b <= self.topk_buffer.shape[0])
        topk_rows = self.topk_buffer[:b]
        for i, layer in enumerate(self.layers):
            q_nope, q_pe, kv_c, k_pe, iq8, ik, w = self._project(layer, x, cos, sin)
            _concat_and_cache_mla(kv_c, k_pe, layer.kv_cache, inputs.slot_mapping)
            _indexer_decode(
                layer.index_cache, iq8, ik, w, inputs.slot_mapping, inputs.seq_lens, inputs.block_table,
                self.topk_buffer, cfg.index_scale_fmt, self.topk, self.max_model_len,
            )
            if self.trace is not None:
                self.trace("decode", i, {
                    "q": iq8, "weights": w, "topk": topk_rows.clone(), "rows": req_ids.clone(),
                    "positions": inputs.positions.clone(),
                    "context_lens": inputs.seq_lens.clone(), "block_table": inputs.block_table.clone(),
                })
            slots = _local_to_global(req_ids, inputs.block_table, topk_rows, self.block_size)
            x = self._mlp_block(layer, x, self._absorbed_attention(layer, q_nope, q_pe, slots))
        return self._logits(x)

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, state: HostState, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add `prompts` as new requests and run them through the model; returns the
        last-token logits `[len(prompts), vocab]` float32 (request order). Prompts are
        processed in chunks of at most `max_num_batched_tokens` tokens (whole prompts:
        requests do not interact, so chunking changes nothing)."""
        lengths = [len(p) for p in prompts]
        rows = state.add_requests(lengths)
        logits = []
        start = 0
        while start < len(prompts):
            end, tokens = start, 0
            while end < len(prompts) and (end == start or tokens + lengths[end] <= self.max_num_batched_tokens):
                tokens += lengths[end]
                end += 1
            batch = state.prefill_batch(rows[start:end], lengths[start:end])
            ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts[start:end]])
            meta = build_prefill(
                batch, ids, index_topk=self.cfg.index_topk, block_size=self.block_size, device=self.device
            )
            logits.append(self.prefill_forward(meta))
            start = end
        state.commit_prefill(rows, lengths)
        return torch.cat(logits) if logits else torch.empty(0, self.cfg.vocab_size, device=self.device)

    @torch.no_grad()
    def prefill_forward(self, meta: PrefillMetadata) -> torch.Tensor:
        """One prefill batch (from `graphsafe.metadata.build_prefill`): fills the caches,
        returns the last-token logits of each request."""
        x = F.embedding(meta.input_ids, self.embed)
        cos, sin = self.rope_cos[meta.positions], self.rope_sin[meta.positions]
        for i, layer in enumerate(self.layers):
            x = self._prefill_layer(i, layer, x, cos, sin, meta)
        return self._logits(x[meta.last_token_index])

    def _prefill_layer(self, i: int, layer: _Layer, x, cos, sin, meta: PrefillMetadata) -> torch.Tensor:
        cfg = self.cfg
        q_nope, q_pe, kv_c, k_pe, iq8, ik, w = self._project(layer, x, cos, sin)
        _concat_and_cache_mla(kv_c, k_pe, layer.kv_cache, meta.slot_mapping)
        outs = []
        dense, sparse = meta.dense, meta.sparse
        if dense is not None:
            s = slice(dense.start, dense.end)
            t = dense.end - dense.start
            # The dense requests' indexer keys still go into the cache for later decode.
            _indexer_k_cache(ik[s], layer.index_cache, meta.slot_mapping[s], cfg.index_head_dim, cfg.index_scale_fmt)
            kv = F.linear(kv_c[s], layer.w_kv_b).view(t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
            k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[s, None, :].expand(t, cfg.num_heads, cfg.qk_rope_head_dim)], dim=-1)
            q = torch.cat([q_nope[s], q_pe[s]], dim=-1)
            out = _flash_attn_varlen(
                q, k, v, dense.cu_seqlens, dense.cu_seqlens, dense.max_seqlen, dense.max_seqlen,
                self.scale, True, fp8=cfg.prefill_fp8,
            )
            outs.append(out.reshape(t, -1))
        if sparse is not None:
            s = slice(sparse.start, sparse.end)
            t = sparse.end - sparse.start
            topk = torch.empty(t, self.topk, dtype=torch.int32, device=self.device)
            _indexer_prefill(
                layer.index_cache, iq8[s], ik[s], w[s], meta.slot_mapping[s], sparse.block_table,
                sparse.cu_seq_lens, sparse.cu_seqlen_ks, sparse.cu_seqlen_ke, topk, cfg.index_scale_fmt,
                self.topk, sparse.total_seq_lens,
            )
            if self.trace is not None:
                pos = meta.positions[s]
                self.trace("prefill", i, {
                    "q": iq8[s], "weights": w[s], "topk": topk.clone(), "positions": pos.clone(),
                    "rows": torch.from_numpy(meta.token_request_cpu[s]),
                    "context_lens": (pos + 1).to(torch.int32),
                    "block_table": sparse.block_table[sparse.req_id_per_token.long()],
                })
            slots = _local_to_global(sparse.req_id_per_token, sparse.block_table, topk, self.block_size)
            outs.append(self._absorbed_attention(layer, q_nope[s], q_pe[s], slots))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self._mlp_block(layer, x, attn)
