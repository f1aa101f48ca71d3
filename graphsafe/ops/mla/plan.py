"""The MLA ops' decision on the Triton backend, made once per call signature: which kernel,
on which tiles, with which split-KV plan, over which cache format (`choose` -> `MlaChoice`),
and the worst-case workspace from the same candidates (`workspace_specs`). Host ints from
SHAPES, strides, dtypes and the device only; pure Python (kernel modules are imported on
first need, for their tile sizes and shared-memory needs).

The choice: the tiles are the head count's own (`kernel_config`: 16-head tiles up to 16
heads, 64-head tiles for 128 on Hopper-class shared memory; `fp8_ds_kernel_config` for
fp8_ds_mla records), or up to 16 heads on sm_90 the 64-head tiles (`few_heads_wide_tiles`)
where a Gluon kernel that pays for them fits the signature (`_WIDE_TILE_KERNELS`). On the
chosen tiles the kernels that fit, best first (`_fitting_kernels`): dense decode's paged
TMA kernel (16-bit cache, `paged_tma_fits`) or warp-specialised fp8 kernel (records, up
to 16 heads, `few_heads_fp8_fits`), the producer kernel (records past 16 heads,
`fp8_producer_fits`; sparse over a 16-bit cache past 16 heads, `rows_producer_fits`), the
64-head Gluon kernel (`warpgroup_split_fits`),
and the portable Triton kernel, always. The later ones are the runner's fallbacks for a
call the first cannot run (misaligned pointers, a failed compile): same tiles, same plan,
same partials.

Split-KV: a decode batch has few queries (B requests, or T tokens for `sparse_mla`) and
many keys, so one program per (query, head tile) leaves most SMs idle. The kernels split
the key range of each query into `num_splits` chunks of `tokens_per_split` positions; each
(head tile, split, query) program writes a partial output and a partial LSE (f32, from the
workspace) and a combine kernel merges the splits.

Why shapes and never sequence lengths: the plan decides the launch grid and the workspace
views, both host-side values. Under CUDA-graph capture they are frozen into the graph,
while `seq_lens` (and the `-1` pattern of sparse indices) change at every replay. A plan
read from `seq_lens` at capture time is wrong for the replays (vLLM #51119 is exactly
that bug: a split count chosen from the captured batch's lengths). Here the plan is a
pure function of (queries, heads, key capacity, SM count), where the key capacity is
`max_blocks * block_size` for `mla_decode` (the block table's shape) and `K` for
`sparse_mla`. Splits that hold no valid key at run time (short sequences, `-1` indices)
still run: they loop zero times and write a neutral partial (out 0, lse -inf) that the
combine weighs by `exp(-inf) = 0`.

The split count minimises a small cost model of equal-length programs on the GPU's
resident slots (`plan_kv_splits`): whole waves, plus a per-split overhead for the
partials. On the CPU (Triton's interpreter, tests only) the plan is two tiles per split,
so tiny test shapes exercise the combine. The tiles depend on the head count and, for
64-head tiles, on the device's shared memory per block (`graphsafe.device_info`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from graphsafe.device_info import config_shared_memory, is_sm90, max_shared_memory, num_sms
from graphsafe.formats import fp8_ds_mla

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
    # (kernels/gluon_wgmma.py) where it applies, the Triton kernel elsewhere.
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
    (kernels/gluon_wgmma.py): each warpgroup scores half of the 64 keys and accumulates half of
    the value columns, q.k with N = 32 wgmmas but no duplicate; 1.6-1.8x faster than the
    Triton kernel on an H200 (`mla_tune`), with the same plan and workspace. Dense decode
    with pages of a multiple of 64 slots runs a third kernel on these tiles (kernels/gluon_paged_tma.py:
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length() if n > 0 else 0


# What Triton allocates besides the tiles `shared_memory_bytes` counts (barriers, scratch).
SHARED_SLACK = 6 * 1024


def shared_memory_bytes(cfg: KernelConfig, r: int, p: int, fp8_ds: bool) -> int:
    """LDS of the Triton attention kernel (kernels/triton_split_kv.py) on tiles `cfg` under
    Triton's AMD backend, an upper bound checked against its compiler by the compile matrix:
    the query tile [BLOCK_H, R + P] and `num_stages - 2` buffers (at least one) of the key
    tile [BLOCK_N, R + P] of 16-bit rows; over fp8_ds_mla records, which go through
    registers, one tile of their dequantised bf16 latents at any depth. Measured with
    Triton 3.9, 16 heads x 32 keys at R + P = 576: 36 KiB at 2 stages, 108 KiB at 5 on gfx942
    (Triton 3.6 too), 48 KiB at 5 on gfx950; fp8_ds_mla 36 / 40 KiB."""
    width = _pow2(r) + _pow2(p)
    buffers = max(1, cfg.num_stages - 2)
    q = cfg.block_h * width * 2  # (a dot operand goes through LDS)
    if fp8_ds:  # the records go through registers into one tile of bf16 latents
        return q + cfg.block_n * width * 2 + SHARED_SLACK
    return q + buffers * cfg.block_n * width * 2 + SHARED_SLACK


def fit_stages(cfg: KernelConfig, device: torch.device, r: int, p: int, fp8_ds: bool) -> KernelConfig:
    """`cfg`, or on ROCm, where its shared memory (`shared_memory_bytes`) exceeds the LDS
    (`device_info.config_shared_memory`: 64 KiB on gfx942, 160 KiB on gfx950), the same
    tiles with the most pipeline stages that fit (at least one): the tiles, so the split
    plan and the workspace, never change: the 16-head tiles' 5 stages (108 KiB) become 3 on
    gfx942. The runner's stage drop on OutOfResources stays as the last guard."""
    budget = config_shared_memory(device)
    stages = cfg.num_stages
    while budget is not None and stages > 1 and (
            shared_memory_bytes(replace(cfg, num_stages=stages), r, p, fp8_ds) > budget):
        stages -= 1
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


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
    the TMA kernel run (kernels/gluon_paged_tma.py; the runner decides per call signature): its 64-head
    tiles, a quarter used at 16 heads, or None on other devices. Measured on an H200 at 16
    heads against the 16-head Triton tiles (`benchmarks/results/h200/2026-11-26-1413_mla_paged_tuning.txt`):
    B 1 0.014 vs 0.024 ms, B 8 0.041 vs 0.045, B 64 0.197 vs 0.204, B 128 0.380 vs 0.421
    (ctx 8192). Over an fp8_ds_mla cache both ops take them where the 64-head Gluon kernel
    runs (triton.py decides): 0.24 vs 0.35 ms at B 64 (dense), 0.138 vs 0.185 ms sparse at
    T 128, K 2048 (H200, `benchmarks/results/h200/2026-11-26-1652_fp8_gluon.txt`). The workspaces cover
    both plans (`workspace_specs` reads the same candidates)."""
    if num_heads > 16 or not is_sm90(device):
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


# -- the kernels, and which calls each can run ------------------------------------------------
# The Triton backend's kernels (graphsafe/ops/mla/kernels/), best first for the calls each
# fits: the warp-specialised fp8 kernels (fp8_ds_mla records: dense decode up to 16 heads;
# both ops past 16 heads, a producer warpgroup dequantising), the paged TMA kernel (dense
# decode over a 16-bit cache), the 64-head-tile wgmma kernel, and the portable Triton
# kernel, which runs everything (other GPUs, the interpreter).
GLUON_FP8_FEW_HEADS = "gluon_fp8_few_heads"
GLUON_FP8_PRODUCER = "gluon_fp8_producer"
GLUON_PAGED_TMA = "gluon_paged_tma"
GLUON_WGMMA = "gluon_wgmma"
TRITON_SPLIT_KV = "triton_split_kv"


@functools.cache
def kernel_module(kernel: str):
    """The module of a Gluon kernel (`graphsafe.ops.mla.kernels.<kernel>`), or None where this
    Triton lacks the Gluon ops it uses. Imported on first use only: CPU runs and other GPUs
    never need it."""
    import importlib

    try:
        return importlib.import_module(f"graphsafe.ops.mla.kernels.{kernel}")
    except (ImportError, AttributeError):  # no Gluon, or one without the Hopper ops used
        return None


FP8_DS_MLA = "fp8_ds_mla"


def cache_format(q: torch.Tensor, kv_cache: torch.Tensor) -> str:
    """The cache's format, decided here once per call signature: "fp8_ds_mla" for uint8
    records (the ops' checks validated their layout: `graphsafe.formats.fp8_ds_mla`), else
    the name of the cache's dtype (q's)."""
    return FP8_DS_MLA if fp8_ds_mla.holds_records(kv_cache) else str(kv_cache.dtype).removeprefix("torch.")


def warpgroup_split_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether calls of this signature (shapes, strides, dtype, device) can run the 64-head
    Gluon kernel (kernels/gluon_wgmma.py) on tiles `cfg`: a config that asks for it with the
    kernel's tiles (64 heads, 64 keys), a CUDA sm_90 device (wgmma; Blackwell has none), a
    16-bit dtype, R = 512 (DeepSeek) or 256 with P = 64, rows the 16-byte copies can address
    (row strides multiples of 16 elements: what Triton's specialisation proves; without it
    the cp.async copies do not compile), a cache of q's dtype or DeepSeek's fp8_ds_mla
    records (R = 512; the kernel dequantises them), and the shared memory the kernel needs.
    The data pointers' 16-byte alignment, no part of a signature, is tested per call by the
    runner (`warpgroup_split_applies` says both)."""
    if not cfg.warpgroup_split:
        return False
    if not is_sm90(q.device) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if r not in (256, 512) or p != 64:  # the shapes its copy layout and GPU tests cover
        return False
    # Strides in elements: 16-bit rows (bytes for an fp8_ds_mla cache) of whole 16-byte copies.
    if any(st % 16 for st in (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1))):
        return False
    module = kernel_module(GLUON_WGMMA)
    if module is None or (cfg.block_h, cfg.block_n) != (module.BLOCK_H, module.BLOCK_N):
        return False
    # The records dequantise to bf16, q's dtype (the ops refuse other queries with them).
    fp8_ds = cache_format(q, kv_cache) == FP8_DS_MLA
    if fp8_ds and (q.dtype != torch.bfloat16 or not module.fp8_ds_supported(r, p)):
        return False
    smem = max_shared_memory(q.device)
    return smem is not None and module.shared_memory_bytes(r, p, fp8_ds) <= smem


def paged_tma_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether dense decode calls of this signature can run kernels/gluon_paged_tma.py (the
    runner tests each call's 16-byte alignment): a 16-bit cache where the 64-head Gluon
    kernel would run (`warpgroup_split_fits`), with pages of a multiple of 64 slots (a
    64-key tile lies in one page), q's heads evenly spaced through its rows and the cache's
    pages through its blocks (TMA reads each as one 2-D [rows, R + P] view), row strides of
    whole 16 bytes and row counts TMA coordinates (int32) reach."""
    if cache_format(q, kv_cache) == FP8_DS_MLA or not warpgroup_split_fits(q, kv_cache, cfg, r, p):
        return False
    rows, heads, d = q.shape
    nb, bs = kv_cache.shape[:2]
    if bs % 64 or q.stride(2) != 1 or kv_cache.stride(2) != 1:
        return False
    if q.stride(0) != heads * q.stride(1) or kv_cache.stride(0) != bs * kv_cache.stride(1):
        return False
    if q.stride(1) % 8 or kv_cache.stride(1) % 8 or max(rows * heads, nb * bs) + 64 >= 2**31:
        return False
    module = kernel_module(GLUON_PAGED_TMA)
    smem = max_shared_memory(q.device)
    return module is not None and smem is not None and module.shared_memory_bytes(r, p) <= smem


def few_heads_fp8_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether dense decode calls of this signature can run kernels/gluon_fp8_few_heads.py
    (the runner tests each call's 16-byte alignment): fp8_ds_mla records with the heads on
    N (`heads_on_n`: up to 16 heads) where the 64-head Gluon kernel would run
    (`warpgroup_split_fits`: sm_90, bf16 q, 16-byte strides, DeepSeek's records), and the
    shared memory it needs."""
    fp8_ds = cache_format(q, kv_cache) == FP8_DS_MLA
    if not heads_on_n(q.shape[1], fp8_ds) or not warpgroup_split_fits(q, kv_cache, cfg, r, p):
        return False
    module = kernel_module(GLUON_FP8_FEW_HEADS)
    smem = max_shared_memory(q.device)
    return module is not None and module.supported(r, p) and smem is not None and module.shared_memory_bytes(r, p) <= smem


def fp8_producer_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether calls of this signature (either op) can run kernels/gluon_fp8_producer.py (the
    runner tests each call's 16-byte alignment): fp8_ds_mla records with more than 16 heads
    (up to 16 the heads-on-N kernels run: `heads_on_n`) where the 64-head Gluon kernel would
    run (`warpgroup_split_fits`: sm_90, bf16 q, 16-byte strides, DeepSeek's records), and
    the shared memory it needs."""
    fp8_ds = cache_format(q, kv_cache) == FP8_DS_MLA
    if not fp8_ds or heads_on_n(q.shape[1], fp8_ds) or not warpgroup_split_fits(q, kv_cache, cfg, r, p):
        return False
    return _producer_kernel_fits(q.device, r, p)


def _producer_kernel_fits(device: torch.device, r: int, p: int) -> bool:
    """Whether kernels/gluon_fp8_producer.py exists here, takes these records (R, P) and its
    shared memory fits `device`'s (either producer: dequantising or copying)."""
    module = kernel_module(GLUON_FP8_PRODUCER)
    smem = max_shared_memory(device)
    return (module is not None and module.supported(r, p) and smem is not None
            and module.shared_memory_bytes(r, p) <= smem)


# Sparse calls over a 16-bit cache past 16 heads run the producer kernel too (its producer
# warpgroup only copying the rows: `gluon_fp8_producer._produce_rows`), where the 64-head
# kernel's consumers issued the copies themselves. Measured on an H200 (graph replays, K
# 2048, `h200/2026-11-29-0803_rows_producer_ab.txt`, two alternating runs each): T 128 / 256 at
# 128 heads 0.181-0.182 / 0.357-0.371 ms against 0.194-0.195 / 0.385-0.391; T 128 at 64 heads
# 0.097-0.099 against 0.105-0.106; sparse prefill (s_q 4096, 128 heads) 5.50-5.55 against
# 5.81-5.91 ms. Dense decode over a 16-bit cache keeps the paged TMA kernel (faster still).
ROWS_PRODUCER = True


def rows_producer_fits(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int,
                       sparse: bool) -> bool:
    """Whether calls of this signature can run kernels/gluon_fp8_producer.py over a 16-bit
    cache (`ROWS_PRODUCER`): sparse calls with more than 16 heads where the 64-head Gluon
    kernel would run (`warpgroup_split_fits`), R = 512 and P = 64, and the shared memory."""
    if not (ROWS_PRODUCER and sparse) or cache_format(q, kv_cache) == FP8_DS_MLA or q.shape[1] <= 16:
        return False
    return warpgroup_split_fits(q, kv_cache, cfg, r, p) and _producer_kernel_fits(q.device, r, p)


def warpgroup_split_applies(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int) -> bool:
    """Whether a call runs the 64-head Gluon kernel on tiles `cfg`: its signature fits
    (`warpgroup_split_fits`) and q and the cache are 16-byte aligned."""
    return not (q.data_ptr() | kv_cache.data_ptr()) & 15 and warpgroup_split_fits(q, kv_cache, cfg, r, p)


def heads_on_n(num_heads: int, fp8_ds: bool) -> bool:
    """Whether the Gluon kernel computes with keys on wgmma's M and the heads on its N
    (HEADS_ON_N: s^T = k q^T, O^T += V^T p^T): over fp8_ds_mla records, up to 16 heads,
    where 64-row head tiles would be three quarters padding. Measured on an H200 against
    the 64-row tiles (`benchmarks/results/h200/2026-11-26-1900_fp8_heads_on_n.txt`, graph replays):
    dense decode at 16 heads, ctx 8192, B 1 / 8 / 32 / 64 / 128: 0.91 / 0.88 / 0.91 / 0.90 /
    0.88x; ctx 32768, B 64: 0.89x; sparse, K 2048, T 64 / 128: 0.80x. On an H100
    (`h100/2026-11-26-1919_fp8_heads_on_n.txt`): 1.03 / 0.92 / 0.90 / 0.91 / 0.88x, 0.88x, 0.78x."""
    return fp8_ds and num_heads <= 16


# Dense decode on the 64-head Gluon kernel: one launch (`IDS_PER_PROGRAM`) where a program
# walks at most this many key tiles, else two (`IDS_UNCHECKED`, `IDS_CHECKED`). The one
# launch's branch per key tile costs 2-5% at 32-128 tiles a program; the second launch
# costs a few microseconds of device time (0.003 ms at B 1) and ~10 us of host time per
# eager call. Measured on an H100 (benchmarks/NOTES.md): one / two launches 0.86-0.97 at
# 2-8 tiles, 0.97-1.00 at 16, 1.00-1.05 at 32 and more.
ONE_LAUNCH_MAX_TILES = 16


def one_dense_launch(plan: SplitPlan, cfg: KernelConfig) -> bool:
    """Whether a dense call on the 64-head Gluon kernel launches it once (`ONE_LAUNCH_MAX_TILES`)."""
    return _cdiv(plan.tokens_per_split, cfg.block_n) <= ONE_LAUNCH_MAX_TILES


# -- the choice: once per call signature -------------------------------------------------------
@dataclass(frozen=True)
class MlaChoice:
    """What a call signature of `mla_decode` / `sparse_mla` runs on the Triton backend, decided
    once (`choose`) and read by the runner, the workspace sizing and `list --why`.

    `kernels`: the kernel, then the kernels that run a call it cannot (q or the cache not
    16-byte aligned, a failed Gluon compile, which launched nothing), all on the same
    `config` and `plan`, so the grid and the partials do not change; the portable Triton
    kernel is always last. `workspace` is the launch's scratch (the split partials)."""

    kernels: tuple[str, ...]
    config: KernelConfig
    plan: SplitPlan
    cache_format: str
    sparse: bool
    rows: int
    num_heads: int
    kv_lora_rank: int
    kv_capacity: int  # key positions a query may have: max_blocks * block_size (dense) or K

    @property
    def kernel(self) -> str:
        return self.kernels[0]

    @property
    def split(self) -> bool:
        return self.plan.num_splits > 1

    @property
    def heads_on_n(self) -> bool:
        return heads_on_n(self.num_heads, self.cache_format == FP8_DS_MLA)

    @property
    def one_dense_launch(self) -> bool:
        return one_dense_launch(self.plan, self.config)

    @property
    def workspace(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return partial_specs(self.rows, self.num_heads, self.kv_lora_rank, self.plan)

    def describe(self) -> str:
        cfg = self.config
        return (f"{' > '.join(self.kernels)}; tiles {cfg.block_h} heads x {cfg.block_n} keys, "
                f"{self.plan.num_splits} split(s) of {self.plan.tokens_per_split} keys, {self.cache_format} cache")


def _tile_candidates(num_heads: int, device: torch.device, fp8_ds: bool, sparse: bool) -> list[KernelConfig]:
    """The tiles a call may run on, preferred first: up to 16 heads on sm_90, the 64-head
    tiles (`few_heads_wide_tiles`) where a Gluon kernel that pays for them runs
    (`_WIDE_TILE_KERNELS`), then the head count's own tiles (`kernel_config`;
    `fp8_ds_kernel_config` for records). Sizing reads the same list (`workspace_specs`)."""
    own = fp8_ds_kernel_config(num_heads, device) if fp8_ds else kernel_config(
        num_heads, device.type, max_shared_memory(device))
    wide = few_heads_wide_tiles(num_heads, device)
    if wide is not None and _WIDE_TILE_KERNELS[fp8_ds, sparse]:
        return [wide, own]
    return [own]


# The kernels for which a few-head call takes the 64-head tiles: over fp8_ds_mla records the
# Gluon kernels dequantise a tile once for all heads (0.24 vs 0.35 ms at B 64 dense, 0.138 vs
# 0.185 ms sparse at T 128, K 2048; H200, `few_heads_wide_tiles`); over a 16-bit cache only
# the paged TMA kernel beats the 16-head Triton tiles (dense decode).
_WIDE_TILE_KERNELS = {
    (True, False): (GLUON_FP8_FEW_HEADS, GLUON_WGMMA),
    (True, True): (GLUON_WGMMA,),
    (False, False): (GLUON_PAGED_TMA,),
    (False, True): (),
}


def choose(call, *, sparse: bool, config: KernelConfig | None = None, num_splits: int | None = None) -> MlaChoice:
    """The Triton backend's choice for calls with the signature of `call` (a bound
    `mla_decode` or `sparse_mla` call): the kernels, tiles, split plan and cache format.
    `config` / `num_splits` force the tiles / the split count (tests, tuning)."""
    q, kv_cache, r = call.q, call.kv_cache, call.kv_lora_rank
    rows, num_heads, head_dim = q.shape
    p = head_dim - r
    capacity = call.indices.shape[1] if sparse else call.block_table.shape[1] * kv_cache.shape[1]
    fmt = cache_format(q, kv_cache)
    fp8_ds = fmt == FP8_DS_MLA
    candidates = [config] if config is not None else _tile_candidates(num_heads, q.device, fp8_ds, sparse)
    for i, cfg in enumerate(candidates):
        kernels = _fitting_kernels(q, kv_cache, cfg, r, p, sparse)
        last = i == len(candidates) - 1
        if last or kernels[0] in _WIDE_TILE_KERNELS[fp8_ds, sparse]:
            break
    cfg, plan = plan_launch(rows, num_heads, capacity, q.device, cfg)
    if config is None:
        cfg = fit_stages(cfg, q.device, r, p, fp8_ds)
    if num_splits is not None:  # tests and tuning only
        plan = forced_plan(capacity, cfg.block_n, num_splits)
    return MlaChoice(kernels, cfg, plan, fmt, sparse, rows, num_heads, r, capacity)


def _fitting_kernels(q: torch.Tensor, kv_cache: torch.Tensor, cfg: KernelConfig, r: int, p: int,
                     sparse: bool) -> tuple[str, ...]:
    """The kernels that can run calls of this signature on tiles `cfg`, best first: for dense
    decode the paged TMA kernel (16-bit cache) or the warp-specialised one (fp8_ds_mla, up
    to 16 heads); over fp8_ds_mla records past 16 heads the producer kernel (either op);
    and for sparse calls over a 16-bit cache past 16 heads (`rows_producer_fits`); then the
    64-head Gluon kernel, then the Triton kernel (always)."""
    kernels = []
    if not sparse and paged_tma_fits(q, kv_cache, cfg, r, p):
        kernels.append(GLUON_PAGED_TMA)
    elif not sparse and few_heads_fp8_fits(q, kv_cache, cfg, r, p):
        kernels.append(GLUON_FP8_FEW_HEADS)
    elif fp8_producer_fits(q, kv_cache, cfg, r, p) or rows_producer_fits(q, kv_cache, cfg, r, p, sparse):
        kernels.append(GLUON_FP8_PRODUCER)
    if warpgroup_split_fits(q, kv_cache, cfg, r, p):
        kernels.append(GLUON_WGMMA)
    kernels.append(TRITON_SPLIT_KV)
    return tuple(kernels)


def workspace_specs(rows: int, num_heads: int, kv_lora_rank: int, kv_capacity: int,
                    device: torch.device | str | None, sparse: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one call on the Triton backend, from shapes: the partials of
    the plan with the most splits among the tiles `choose` may pick for these shapes (either
    cache format: the call's cache decides), so a launch never takes more."""
    dev = _device(device)
    plans = [plan_launch(rows, num_heads, kv_capacity, dev, cfg)[1]
             for fp8_ds in (False, True) for cfg in _tile_candidates(num_heads, dev, fp8_ds, sparse)]
    return partial_specs(rows, num_heads, kv_lora_rank, max(plans, key=lambda p: p.num_splits))


def mla_decode_workspace(batch: int, num_heads: int, kv_lora_rank: int, max_kv_len: int,
                         device: torch.device | str | None = None, head_dim: int | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton record's worst-case workspace of one `mla_decode` call (`workspace_specs`;
    `head_dim` and `dtype` do not change it: the aiter backend's function reads them). The
    public helper is `graphsafe.ops.mla.mla_decode_workspace_specs`: the largest over the
    backends that may serve the device."""
    return workspace_specs(batch, num_heads, kv_lora_rank, max_kv_len, device, sparse=False)


def sparse_mla_workspace(num_tokens: int, num_heads: int, kv_lora_rank: int, topk: int,
                         device: torch.device | str | None = None, head_dim: int | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton record's worst-case workspace of one `sparse_mla` call (the key capacity is
    `topk`), as `mla_decode_workspace`."""
    return workspace_specs(num_tokens, num_heads, kv_lora_rank, topk, device, sparse=True)
