"""Tensor parallelism for the DeepSeek-V3.2-style model: which weights shard, the all-reduce.

Megatron-style sharding over `size` ranks, every rank loading its slice of the same full
state dict (`shard_tensors`, after `weights.convert_state_dict`):

* attention heads: rank r owns heads `[r * H/size, (r + 1) * H/size)`: its rows of `q_b`
  (inside `w_b`), of `kv_b` (`w_kv_b`, `w_uk`, `w_uv_t`) and its columns of `o_proj`
  (row-parallel: each rank's `o_proj` product is a partial sum, all-reduced);
* the MLP: gate and up rows column-parallel, `down_proj` columns row-parallel
  (all-reduced): two all-reduces of `[T, hidden]` per layer in all;
* biases (`ModelConfig.attention_bias`, `mlp_bias`, `indexer_bias`): the gate and up
  biases shard with their rows; the o_proj and down_proj biases are replicated and added
  once, after their all-reduce (inside each rank's partial sum they would count `size`
  times); the biases of replicated projections (`b_a`, the indexer's `b_iq`) replicated;
* replicated: the embedding and LM head, every norm, `w_a` (the low-rank `q_a` / `kv_a`
  projections and the indexer's `wk` / `weights_proj`), the indexer's `wq_b`, the MLA
  latent cache and the indexer's K cache. MLA's latent is shared by every head, so each
  rank needs all of it (vLLM replicates it the same way). The indexer is replicated
  because its top-k is a selection over all its heads' summed scores: sharding its heads
  would put an all-reduce of `[T, max_model_len]` logits before every top-k, more traffic
  than the indexer's small GEMMs cost to repeat, and every rank must select exactly the
  same keys for its MLA heads. Since every rank holds the same hidden state after each
  all-reduce (NCCL and gloo hand every rank the same sum), the replicated indexer picks
  the same keys on every rank.

The all-reduce is `torch.distributed._functional_collectives.all_reduce`: it traces
under `torch.compile(fullgraph=True)` (no graph break) and captures into a CUDA graph
with NCCL; with gloo it runs on CPUs. With `size == 1` it is the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from graphsafe.models.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group: `rank` of `size`, and the process
    group the all-reduces use (None: the default group; unused when `size == 1`)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel: rank must be in [0, size) and size >= 1, got rank {self.rank}, "
                             f"size {self.size}")

    @classmethod
    def from_process_group(cls, group: Any = None) -> TensorParallel:
        """This process's rank and the group's size (`torch.distributed` must be
        initialised; `group` None is the default group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TensorParallel.from_process_group: torch.distributed is not initialised "
                               "(start under torchrun, or call torch.distributed.init_process_group first)")
        if group is None:
            group = dist.group.WORLD
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group's ranks (identity for one rank)."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def heads(self, num_heads: int) -> slice:
        """This rank's slice of `num_heads` heads."""
        return self._part(num_heads, "num_attention_heads")

    def _part(self, n: int, what: str) -> slice:
        if n % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs {what} divisible by {self.size}, got {n}")
        width = n // self.size
        return slice(self.rank * width, (self.rank + 1) * width)


def check_shardable(cfg: ModelConfig, tp: TensorParallel) -> None:
    """Raise a ValueError naming the config field that `tp.size` does not divide."""
    tp._part(cfg.num_heads, "num_attention_heads")
    tp._part(cfg.intermediate_size, "intermediate_size")


def shard_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slices of the model's full tensors (`convert_state_dict`'s names and
    layouts); replicated tensors are passed through. Slices are contiguous copies."""
    if tp.size == 1:
        return dict(tensors)
    check_shardable(cfg, tp)
    heads = tp.heads(cfg.num_heads)
    ffn = tp._part(cfg.intermediate_size, "intermediate_size")
    qk, nope_v, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    n_q = cfg.num_heads * qk
    inter = cfg.intermediate_size

    def rows(t: torch.Tensor, per: int) -> torch.Tensor:
        return t[heads.start * per : heads.stop * per]

    out = dict(tensors)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w_b = tensors[p + "w_b"]
        # q_b's rows of this rank's heads, then the (replicated) indexer wq_b rows.
        out[p + "w_b"] = torch.cat([rows(w_b[:n_q], qk), w_b[n_q:]])
        out[p + "w_kv_b"] = rows(tensors[p + "w_kv_b"], nope_v)
        out[p + "w_uk"] = tensors[p + "w_uk"][heads]
        out[p + "w_uv_t"] = tensors[p + "w_uv_t"][heads]
        out[p + "w_o"] = tensors[p + "w_o"][:, heads.start * v : heads.stop * v]
        for name in ("w_gate_up", "b_gate_up"):  # b_gate_up: with `mlp_bias`
            if p + name in tensors:
                gate_up = tensors[p + name]
                out[p + name] = torch.cat([gate_up[ffn], gate_up[inter + ffn.start : inter + ffn.stop]])
        out[p + "w_down"] = tensors[p + "w_down"][:, ffn]
    return {k: t.contiguous() for k, t in out.items()}


def local_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """`cfg` as one rank sees its shard: heads and MLP width divided by `tp.size`."""
    check_shardable(cfg, tp)
    return replace(cfg, num_heads=cfg.num_heads // tp.size, intermediate_size=cfg.intermediate_size // tp.size)


def init_from_environment(device_type: str) -> tuple[TensorParallel, torch.device]:
    """Initialise `torch.distributed` from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT): NCCL with one GPU per process on CUDA, gloo on CPUs.
    Returns this rank's TensorParallel and its device."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"tensor parallelism needs one process per rank started by torchrun (missing {', '.join(missing)}): "
            "torchrun --nproc-per-node 2 -m graphsafe demo --tp 2"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if device_type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return TensorParallel.from_process_group(), device


__all__ = ["TensorParallel", "check_shardable", "shard_tensors", "local_config", "init_from_environment"]
