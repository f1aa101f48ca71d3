"""The DeepSeek-V4 attention's decision on the Triton backend, made once per call signature
(`choose` -> `Dsv4AttnChoice`: tiles, split plan, cache format), and the worst-case
workspace from the same candidates (`workspace_specs`). Host ints from SHAPES, dtypes and
the device only, never from lengths or indices (a captured CUDA graph replays with new
ones); pure Python.

A query's keys are its window entries (`indices`, K of them) followed by its compressed
entries (`extra_indices`, K2): K + K2 key positions, split across programs exactly as the
MLA ops split theirs (`graphsafe.ops.mla.plan.plan_kv_splits`: whole waves of equal
programs on the resident slots; on the CPU, two key tiles a split so tiny test shapes
cover the combine). A split past a token's lengths loops zero times and writes a neutral
partial (out 0, lse -inf).

Kernels: on sm_90, bf16 queries of head dim 512 over fp8_dsv4 records with 16-byte strides
run the Gluon kernel (kernels/gluon_sparse_attn.py: 64-head tiles, 64-key tiles, wgmma, two
warpgroups; `gluon_fits`); the portable Triton kernel (kernels/triton_sparse_attn.py) runs
everything else, and the calls the Gluon kernel cannot (a pointer not 16-byte aligned, a
failed compile) on the same split plan, so the partials do not change.

Triton tiles: the row of a key is 512 values (448 dequantised e4m3 + 64 bf16, or 512 bf16),
the value is the same row, so a program holds q `[BLOCK_H, 512]`, a key tile `[BLOCK_N, 512]`
and the accumulator `[BLOCK_H, 512]` f32. Up to 16 heads one 16-head tile; more (DeepSeek-V4
runs 64 or 128 padded heads) 32-head tiles, the keys of a tile dequantised by each of the
H / 32 programs (L2 serves the repeats). `python -m graphsafe bench --op dsv4_tune` times
the alternatives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from graphsafe.device_info import is_sm90, max_shared_memory, num_sms
from graphsafe.ops.mla.plan import SplitPlan, forced_plan, plan_kv_splits


@dataclass(frozen=True)
class Dsv4Tiles:
    block_h: int  # heads per program (a dot's M: >= 16)
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1


def tiles(num_heads: int, device_type: str) -> Dsv4Tiles:
    """The tiles per head count (module docstring); the interpreter's are the smallest legal."""
    if device_type != "cuda":
        return Dsv4Tiles(block_h=16, block_n=16, num_warps=4, num_stages=1)
    if num_heads <= 16:
        return Dsv4Tiles(block_h=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=2)
    return Dsv4Tiles(block_h=32, block_n=32, num_warps=8, num_stages=2, ctas_per_sm=1)


# The Gluon kernel's tiles (kernels/gluon_sparse_attn.py: BLOCK_H, BLOCK_N, NUM_WARPS).
GLUON_TILES = Dsv4Tiles(block_h=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1)


def gluon_module():
    """kernels/gluon_sparse_attn.py, or None where this Triton lacks the Gluon ops it uses
    (imported on first need: CPU runs and other GPUs never import it)."""
    try:
        from graphsafe.ops.dsv4.kernels import gluon_sparse_attn
    except (ImportError, AttributeError):
        return None
    return gluon_sparse_attn


def gluon_fits(q: torch.Tensor, kv_cache: torch.Tensor, extra_kv_cache: torch.Tensor | None) -> bool:
    """Whether calls of this signature can run the Gluon kernel: an sm_90 device, bf16 q of
    head dim 512 with row strides of multiples of 16 elements (16-byte copies whose alignment
    Triton's specialisation proves; a stride of 8 is not: its cp.async does not compile), fp8_dsv4 records in both caches with
    block strides of whole 16 bytes (what Triton's specialisation proves for the cp.async
    copies), the kernel importable and its shared memory on the device. Each call's
    pointers are tested by the runner (16-byte aligned, else the Triton kernel)."""
    if not is_sm90(q.device) or q.dtype != torch.bfloat16 or q.shape[-1] != 512 or q.stride(-1) != 1:
        return False
    if q.stride(0) % 16 or q.stride(1) % 16:  # elements: Triton's specialisation proves 16, not 8
        return False
    for cache in (kv_cache, extra_kv_cache):
        if cache is not None and (cache.dtype != torch.uint8 or cache.stride(0) % 16):
            return False
    module = gluon_module()
    smem = max_shared_memory(q.device)
    return module is not None and smem is not None and module.shared_memory_bytes() <= smem


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=1024)
def plan_launch(rows: int, num_heads: int, kv_capacity: int, device: torch.device,
                config: Dsv4Tiles | None = None) -> tuple[Dsv4Tiles, SplitPlan]:
    """The tiles and split plan of `rows` queries of `num_heads` heads over `kv_capacity`
    key positions (K + K2), from shapes and the device alone."""
    cfg = config or tiles(num_heads, device.type)
    if device.type != "cuda":
        return cfg, forced_plan(kv_capacity, cfg.block_n, _cdiv(_cdiv(max(kv_capacity, 0), cfg.block_n), 2))
    return cfg, plan_kv_splits(rows=rows, head_tiles=_cdiv(num_heads, cfg.block_h), kv_capacity=kv_capacity,
                               block_n=cfg.block_n, num_sms=num_sms(device), ctas_per_sm=cfg.ctas_per_sm)


def partial_specs(rows: int, num_heads: int, head_dim: int, plan: SplitPlan) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of a split launch: partial outputs [rows, S, H, D] and LSEs [rows, S, H], f32;
    none with one split (the kernel then writes the outputs)."""
    if plan.num_splits <= 1:
        return []
    s = plan.num_splits
    return [((rows, s, num_heads, head_dim), torch.float32), ((rows, s, num_heads), torch.float32)]


TRITON_SPARSE_ATTN = "triton_sparse_attn"
GLUON_SPARSE_ATTN = "gluon_sparse_attn"


@dataclass(frozen=True)
class Dsv4AttnChoice:
    """What a `dsv4_sparse_attn` call signature runs on the Triton backend, decided once and
    read by the runner, the workspace sizing and `list --why`. `kernels`: the kernel, then
    the one that runs the calls it cannot (the Triton kernel, always last, on its own tiles
    `tiles(num_heads)` but this `plan`: the partials are the same); `config`: the first's tiles."""

    kernels: tuple[str, ...]
    config: Dsv4Tiles
    plan: SplitPlan
    cache_format: str  # "fp8_dsv4" (records) or "bfloat16"
    rows: int
    num_heads: int
    head_dim: int
    topk: int  # K: window entries per token
    extra_topk: int  # K2: compressed entries per token (0 without the extra cache)

    @property
    def kernel(self) -> str:
        return self.kernels[0]

    @property
    def split(self) -> bool:
        return self.plan.num_splits > 1

    @property
    def kv_capacity(self) -> int:
        return self.topk + self.extra_topk

    @property
    def workspace(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return partial_specs(self.rows, self.num_heads, self.head_dim, self.plan)

    def describe(self) -> str:
        cfg = self.config
        fallback = f" (else {', '.join(self.kernels[1:])})" if len(self.kernels) > 1 else ""
        return (f"{self.kernel}{fallback}; tiles {cfg.block_h} heads x {cfg.block_n} keys, {self.plan.num_splits} split(s) of "
                f"{self.plan.tokens_per_split} of {self.topk} + {self.extra_topk} keys, {self.cache_format} cache")


def choose(call, *, config: Dsv4Tiles | None = None, num_splits: int | None = None) -> Dsv4AttnChoice:
    """The Triton backend's choice for calls with the signature of `call` (a bound
    `dsv4_sparse_attn` call); `config` / `num_splits` force the tiles / split count (tests)."""
    q = call.q
    rows, heads, d = q.shape
    k = call.indices.shape[1]
    k2 = call.extra_indices.shape[1] if call.extra_kv_cache is not None else 0
    fmt = "fp8_dsv4" if call.kv_cache.dtype == torch.uint8 else str(call.kv_cache.dtype).removeprefix("torch.")
    kernels: tuple[str, ...] = (TRITON_SPARSE_ATTN,)
    if config is None and gluon_fits(q, call.kv_cache, call.extra_kv_cache):
        kernels, config = (GLUON_SPARSE_ATTN, TRITON_SPARSE_ATTN), GLUON_TILES
    cfg, plan = plan_launch(rows, heads, k + k2, q.device, config)
    if num_splits is not None:
        plan = forced_plan(k + k2, cfg.block_n, num_splits)
    return Dsv4AttnChoice(kernels, cfg, plan, fmt, rows, heads, d, k, k2)


def dsv4_sparse_attn_workspace(num_tokens: int, num_heads: int, head_dim: int, topk: int, extra_topk: int = 0,
                               device: torch.device | str | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton record's worst-case workspace of one call, from shapes: the partials of
    the plans `choose` can make for them (the Triton kernel's tiles, and on sm_90 for head
    dim 512 the Gluon kernel's: the cache format and strides that pick between them are no
    shapes), the larger."""
    dev = _device(device)
    configs = [None]
    if head_dim == 512 and is_sm90(dev) and gluon_module() is not None:
        configs.append(GLUON_TILES)
    worst: list[tuple[tuple[int, ...], torch.dtype]] = []
    for cfg in configs:
        _, plan = plan_launch(num_tokens, num_heads, topk + extra_topk, dev, cfg)
        specs = partial_specs(num_tokens, num_heads, head_dim, plan)
        if not worst or (specs and specs[0][0] > worst[0][0]):
            worst = specs
    return worst
