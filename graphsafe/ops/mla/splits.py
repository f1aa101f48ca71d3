"""Split-KV planning for the MLA kernels: host ints from SHAPES and the SM count only.

A decode batch has few queries (B requests, or T tokens for `sparse_mla`) and many keys,
so one program per (query, head tile) leaves most SMs idle. The kernels therefore split
the key range of each query into `num_splits` chunks of `tokens_per_split` positions;
each (head tile, split, query) program writes a partial output and a partial LSE (f32,
from the workspace) and a combine kernel merges the splits.

Why shapes and never sequence lengths: the plan decides the launch grid and the workspace
views, both host-side values. Under CUDA-graph capture they are frozen into the graph,
while `seq_lens` (and the `-1` pattern of sparse indices) change at every replay. A plan
read from `seq_lens` at capture time is wrong for the replays (vLLM #51119 is exactly
that bug: a split count chosen from the captured batch's lengths). Here the plan is a
pure function of (queries, heads, key capacity, SM count), where the key capacity is
`max_blocks * block_size` for `mla_decode` (the block table's shape) and `K` for
`sparse_mla`. Splits that hold no valid key at run time (short sequences, `-1` indices)
still run: they loop zero times and write a neutral partial (out 0, lse -inf) that the
combine weighs by `exp(-inf) = 0`. The same function sizes the workspace
(`triton_mla_decode_workspace`, `triton_sparse_mla_workspace`, the Triton backend's
records), so what is reserved before capture is exactly what a call requests.

The split count minimises a small cost model of equal-length programs on the GPU's
resident slots (`plan_kv_splits`): whole waves, plus a per-split overhead for the
partials. On the CPU (Triton's interpreter, tests only) the plan is two tiles per split,
so tiny test shapes exercise the combine.

The kernel tiles (`kernel_config`) depend on the head count and, for 64-head tiles, on the
device's shared memory per block; like the SM count, a fixed property of the device.

Everything here is pure Python (triton is imported lazily, only for the shared-memory
query), so the registry can hold the workspace helpers without importing a kernel. It
imports neither the registry nor another backend: each backend record names its own
workspace function, and `graphsafe.ops.mla.mla_decode_workspace_specs` asks the registry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from graphsafe.device_info import num_sms

# A split reads at least this many key rows (capacity-wise) on the GPU: below that the
# partial write and the combine cost more than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 128
# What one more split costs, in key rows: its f32 partial output written and read back by
# the combine (16 heads x 512 x 4 B x 2 ~ 56 rows of 1152 B) plus the program's start-up.
SPLIT_OVERHEAD_TOKENS = 64
# Upper bound of splits per query (bounds the combine's tile and the workspace). 256 lets
# a lone 32k-token request with 16 heads fill 264 program slots with 128-token splits.
MAX_SPLITS = 256


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of the MLA attention kernel (see triton.py)."""

    block_h: int  # heads per program (a tl.dot M dimension: >= 16)
    block_n: int  # key rows per loop iteration
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1  # resident programs per SM (registers / shared memory), an estimate
    value_chunks: int = 1  # the R value columns as 1 or 2 tiles, each with its own accumulator
    l2_prefetch: bool = False  # prefetch the next key tile into L2 (PTX; NVIDIA only)
    # 64-head tiles on sm_90: the Gluon kernel whose two warpgroups split the keys of q.k
    # (_gluon_hopper.py) where it applies, the Triton kernel elsewhere.
    warpgroup_split: bool = False


@dataclass(frozen=True)
class SplitPlan:
    """Split s of a query covers key positions [s * tokens_per_split, (s + 1) * tokens_per_split)."""

    num_splits: int
    tokens_per_split: int  # a multiple of the kernel's block_n


# Shared memory (bytes per block, opt-in) a device must offer for the 64-head tiles, for
# R + P = 576 in 16-bit: q [64, 576] + 2 stages of [64, 576] keys = 216 KiB, plus a little
# for barriers (Hopper and datacenter Blackwell offer 227 KiB); the older [64, 16]-key
# tiles need 128 KiB (A100: 163 KiB). Less (consumer GPUs, MI300's 64 KiB): 16-head tiles.
SMEM_WIDE_TILES = 220 * 1024
SMEM_NARROW_TILES = 132 * 1024


def kernel_config(num_heads: int, device_type: str, max_shared: int | None = None) -> KernelConfig:
    """Default tiles per head count (and, for 64-head tiles, the device's shared memory).

    GPU: 16 heads (DeepSeek TP8) fill one 16-row MMA tile, so each cache row is read
    once per request (memory-bound: mma.sync tiles, two programs per SM). 128 heads (TP1)
    are compute-bound and run as two 64-head tiles, the wgmma M on Hopper (the second
    tile re-reads the rows from L2), with 64 keys per iteration, 8 warps and the 512
    value columns as two accumulators of 256 (`value_chunks=2`).

    Why these 64-head tiles (sm_90a, R = 512, P = 64, ptxas reports of Triton 3.9; bench
    case `mla_tune` measures the alternatives): Triton lays the chained q.k dot out on
    all 8 warps along M, so both warpgroups compute the whole [64, N] score tile and each
    keeps half of the [64, 512] f32 accumulator (128 registers). The q.k wgmmas then have
    N = block_n / 2 and read their q operand (in shared memory) once per instruction: at
    N = 8 (block_n 16, the earlier default) that shared-memory traffic caps q.k at about
    a fifth of the tensor-core rate, at N = 32 (block_n 64) at two thirds. The 36 q
    descriptors are loop-invariant and live in registers; with block_n 64 some of them
    spill (reloaded from L1 once per iteration, not per key), least with the value
    columns as two tiles (fewer live row pointers: 200 B of stack, 240 B with the L2
    prefetch below, against 320 B for one [64, 512] tile). With 2 stages Triton issues the next key tile at the end of an
    iteration (the block-table load before it is an indirection), so the tile's load
    overlaps only the p @ V wgmmas: the kernel therefore prefetches the next tile's rows
    into L2 (`l2_prefetch`, PTX `prefetch.global.L2`) right after the q.k wgmmas, so the
    copy at the end of the iteration reads L2. 64/32 tiles with 5 stages prefetch two
    tiles ahead in shared memory instead, but pay N = 16 q.k wgmmas (`mla_tune` times
    these variants, prefetch off included). block_n 64 with 2 stages needs
    `SMEM_WIDE_TILES`; devices with less shared memory get the older tiles, or 16-head
    tiles.
    On sm_90 (`warpgroup_split`) these 64-head tiles run the Gluon kernel instead
    (_gluon_hopper.py): each warpgroup scores half of the 64 keys and accumulates half of
    the value columns, q.k with N = 32 wgmmas but no duplicate; 1.6-1.8x faster than the
    Triton kernel on an H200 (`mla_tune`), with the same plan and workspace. Dense decode
    with pages of a multiple of 64 slots runs a third kernel on these tiles (_gluon_paged.py:
    TMA page tiles, each warpgroup scoring alternate tiles at N = 64), same plan and workspace.
    CPU (Triton interpreter, tests only): the smallest legal tiles, so tiny test shapes
    span several tiles and splits.
    """
    if device_type != "cuda":
        return KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    if num_heads <= 16:
        # 5 stages: measured 6% faster than 2 on an H200 for decode (B=64, 8k and 32k) and
        # sparse (T=64, K=2048) with the same split plan (`mla_tune`).
        return KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=5, ctas_per_sm=2)
    if num_heads <= 32:
        return KernelConfig(block_h=32, block_n=32, num_warps=8, num_stages=2, ctas_per_sm=1)
    smem = SMEM_WIDE_TILES if max_shared is None else max_shared
    if smem >= SMEM_WIDE_TILES:
        # The L2 prefetch (l2_prefetch=True) measured 1.7x SLOWER on an H200 (`mla_tune`,
        # B=64 H=128: 3.92 vs 2.30 ms at 32k; sparse T=64: 0.255 vs 0.184 ms): off.
        return KernelConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, value_chunks=2,
                            l2_prefetch=False, warpgroup_split=True)
    if smem >= SMEM_NARROW_TILES:
        return KernelConfig(block_h=64, block_n=16, num_warps=8, num_stages=2, ctas_per_sm=1)
    return KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1)


@functools.cache
def max_shared_memory(device: torch.device) -> int | None:
    """Opt-in shared memory per block of a CUDA/HIP device (Triton's driver query), or None."""
    if device.type != "cuda":
        return None
    try:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no driver: assume a Hopper-class GPU
        return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_kv_splits(
    *,
    rows: int,
    head_tiles: int,
    kv_capacity: int,
    block_n: int,
    num_sms: int,
    ctas_per_sm: int = 1,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
    overhead_tokens: int = SPLIT_OVERHEAD_TOKENS,
    max_splits: int = MAX_SPLITS,
) -> SplitPlan:
    """The split-KV plan of one launch, from shapes and the SM count only.

    Args:
        rows: queries of the launch (B for `mla_decode`, T for `sparse_mla`).
        head_tiles: programs per query along the heads (`cdiv(H, block_h)`).
        kv_capacity: key positions a query may have: `max_blocks * block_size`, or `K`.
        block_n: key rows per kernel iteration; splits are whole iterations.
        num_sms: multiprocessors of the device; `ctas_per_sm` programs fit on each.

    Picks the split count S minimising `waves(S) * (rows per split + overhead)`, where
    `waves = cdiv(rows * head_tiles * S, num_sms * ctas_per_sm)`: the time of a launch of
    equal programs (full-length queries, the worst case) on the resident slots. Counting
    whole waves avoids plans whose last wave runs a few programs on an idle GPU (e.g. 9
    splits of 64 queries on 264 slots: 3 waves where 4 splits take 1). Ties go to fewer
    splits (less workspace). Every split starts below `kv_capacity`; at run time a split
    past a query's length is empty and yields a neutral partial.
    """
    tiles = _cdiv(max(kv_capacity, 0), block_n)
    base = rows * head_tiles
    if tiles <= 1 or base <= 0:
        return SplitPlan(1, max(tiles, 1) * block_n)
    slots = max(1, num_sms * ctas_per_sm)
    most = min(max_splits, tiles, max(1, kv_capacity // max(min_tokens_per_split, 1)))
    best = (_cdiv(base, slots) * tiles * block_n, 1, tiles)  # (cost, splits, tiles per split)
    for splits in range(2, most + 1):
        per_split = _cdiv(tiles, splits)
        if _cdiv(tiles, per_split) != splits:  # the same split as a smaller count
            continue
        cost = _cdiv(base * splits, slots) * (per_split * block_n + overhead_tokens)
        if cost < best[0]:
            best = (cost, splits, per_split)
    return SplitPlan(best[1], best[2] * block_n)


def fp8_ds_kernel_config(num_heads: int, device: torch.device) -> KernelConfig:
    """The tiles for an fp8_ds_mla cache where the Gluon kernel does not run (triton.py
    gives up to 16 heads `few_heads_wide_tiles` where it does): `kernel_config`'s, with 3
    stages for 16 heads.

    Measured on an H200 (B = 64, ctx 8192 / 32768, CUDA-graph replays): 16 heads 0.350 /
    1.344 ms with 3 stages against 0.502 / 1.921 ms with the bf16 default's 5 (the byte
    tiles and their dequantisation leave room for one program per SM at 5 stages); 2 and
    4 stages within 3%, other tiles slower. 128 heads: the default tiles were the fastest
    of those tried (64/32 with 2 value chunks, 64/16, 32/32, 32/64, 16/32). Only the
    stages change, so the split plan, and with it the workspace, are the bf16 cache's."""
    cfg = kernel_config(num_heads, device.type, max_shared_memory(device))
    if device.type == "cuda" and num_heads <= 16:
        return replace(cfg, num_stages=3)
    return cfg


def few_heads_wide_tiles(num_heads: int, device: torch.device) -> KernelConfig | None:
    """The tiles dense decode with up to 16 heads runs on sm_90 where the cache's layout lets
    the TMA kernel run (_gluon_paged.py; the runner decides per call signature): its 64-head
    tiles, a quarter used at 16 heads, or None on other devices. Measured on an H200 at 16
    heads against the 16-head Triton tiles (`benchmarks/results/h200_s27_mla_paged_tuning.txt`):
    B 1 0.014 vs 0.024 ms, B 8 0.041 vs 0.045, B 64 0.197 vs 0.204, B 128 0.380 vs 0.421
    (ctx 8192). Over an fp8_ds_mla cache both ops take them where the 64-head Gluon kernel
    runs (triton.py decides): 0.24 vs 0.35 ms at B 64 (dense), 0.138 vs 0.185 ms sparse at
    T 128, K 2048 (H200, `benchmarks/results/h200_s29_fp8_gluon.txt`). The workspaces cover
    both plans (`triton_mla_decode_workspace`, `triton_sparse_mla_workspace`)."""
    if device.type != "cuda" or num_heads > 16 or torch.version.hip is not None:
        return None
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None
    cfg = kernel_config(128, device.type, max_shared_memory(device))
    return cfg if cfg.warpgroup_split else None


def forced_plan(kv_capacity: int, block_n: int, num_splits: int) -> SplitPlan:
    """A plan with (at most) `num_splits` splits: tests and tuning force the split path."""
    tiles = max(_cdiv(max(kv_capacity, 0), block_n), 1)
    tiles_per_split = _cdiv(tiles, max(1, min(num_splits, tiles)))
    return SplitPlan(_cdiv(tiles, tiles_per_split), tiles_per_split * block_n)


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=1024)
def _plan(rows: int, num_heads: int, kv_capacity: int, device: torch.device, config: KernelConfig | None) -> tuple[KernelConfig, SplitPlan]:
    cfg = config or kernel_config(num_heads, device.type, max_shared_memory(device))
    if device.type != "cuda":
        # Triton's interpreter (CPU, tests only): splits of two tiles each, so tiny test
        # shapes cover both the online softmax across tiles and the split/combine path.
        return cfg, forced_plan(kv_capacity, cfg.block_n, _cdiv(_cdiv(max(kv_capacity, 0), cfg.block_n), 2))
    plan = plan_kv_splits(
        rows=rows,
        head_tiles=_cdiv(num_heads, cfg.block_h),
        kv_capacity=kv_capacity,
        block_n=cfg.block_n,
        num_sms=num_sms(device),
        ctas_per_sm=cfg.ctas_per_sm,
    )
    return cfg, plan


def plan_launch(
    rows: int, num_heads: int, kv_capacity: int, device: torch.device | str | None, config: KernelConfig | None = None
) -> tuple[KernelConfig, SplitPlan]:
    """(tiles, split plan) of the Triton MLA kernel for these shapes on `device` (cached)."""
    return _plan(int(rows), int(num_heads), int(kv_capacity), _device(device), config)


def partial_specs(rows: int, num_heads: int, kv_lora_rank: int, plan: SplitPlan) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Workspace of one launch: partial outputs [rows, S, H, R] and LSEs [rows, S, H], f32.

    One split needs none: the kernel then writes the final outputs directly.
    """
    if plan.num_splits <= 1:
        return []
    s = plan.num_splits
    return [((rows, s, num_heads, kv_lora_rank), torch.float32), ((rows, s, num_heads), torch.float32)]


def _worst_plan(rows: int, num_heads: int, kv_capacity: int, device: torch.device) -> SplitPlan:
    """The plan of the default tiles, or where few heads may run the 64-head tiles
    (`few_heads_wide_tiles`; the call's cache decides) the one of the two with more splits."""
    _, plan = plan_launch(rows, num_heads, kv_capacity, device)
    wide = few_heads_wide_tiles(num_heads, device)
    if wide is not None:
        _, wide_plan = plan_launch(rows, num_heads, kv_capacity, device, wide)
        plan = max(plan, wide_plan, key=lambda p: p.num_splits)
    return plan


def triton_mla_decode_workspace(
    batch: int,
    num_heads: int,
    kv_lora_rank: int,
    max_kv_len: int,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one `mla_decode` call on the Triton backend, from shapes:
    the partials of `plan_launch(batch, num_heads, max_kv_len, device)` (none with one
    split), or where few heads may run the 64-head tiles (`few_heads_wide_tiles`: the
    cache's layout decides) those of the plan with more splits. `head_dim` and `dtype` do
    not change it (the aiter backend's function, which the registry also asks, reads
    them). The public helper is `graphsafe.ops.mla.mla_decode_workspace_specs`: the largest
    over the backends that may serve the device."""
    return partial_specs(batch, num_heads, kv_lora_rank, _worst_plan(batch, num_heads, max_kv_len, _device(device)))


def triton_sparse_mla_workspace(
    num_tokens: int,
    num_heads: int,
    kv_lora_rank: int,
    topk: int,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one `sparse_mla` call on the Triton backend, from shapes
    (see `triton_mla_decode_workspace`; the key capacity is `topk`; few heads over an
    fp8_ds_mla cache may run the 64-head tiles)."""
    return partial_specs(num_tokens, num_heads, kv_lora_rank, _worst_plan(num_tokens, num_heads, topk, _device(device)))
