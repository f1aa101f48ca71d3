"""The decisions of the attention ops' Triton backend, made once per call signature.

`choose_<op>(call) -> <Op>Choice` reads the op's bound call (shapes, strides, dtypes,
device, host ints; never tensor values) and decides everything its launches need: the
path and kernel(s), the tiles, the split-KV plan, whether the cache is fp8, and the
scratch all of that takes. `triton.prepare_<op>` calls it once per signature and binds
what it chose. The records' workspace functions (the worst case from shapes alone,
before a CUDA-graph capture) build the scratch with the same functions from the same
candidates, so sizing and launch cannot disagree.

* `paged_attention_decode`: the split-KV plan. The split count is a HOST decision made
  from shapes only -- batch size, KV heads, the cache capacity of a request
  (`max_blocks_per_seq * block_size`) -- and the device's SM count. Never from
  `seq_lens` values: a choice made while a CUDA graph is captured is frozen into the
  graph, so one that depended on the lengths seen at capture would be wrong for every
  later replay (vLLM #51119). Inside the kernel each request divides ITS OWN length
  (read on the device) evenly among the splits, so short requests still spread over
  every split and long ones are never truncated. Several splits write partials to the
  workspace (`split_scratch`) and a combine launch reduces them.
* `flash_attn_varlen`: the path (bf16/fp16, fp8 quantising bf16/fp16 inputs, fp8
  inputs, or the reference where fp8 was asked of a GPU without working fp8 matrix
  units), the Triton FA2 kernel's tiles (`varlen_config`) and, on sm_90, a Gluon kernel
  (kernels/gluon_prefill.py) tried first. Three Gluon kernels serve the plain
  bf16/fp16 call (a positive softmax scale), chosen by `varlen_kernel`; the variants
  (window, softcap, sinks) run on "tma" only:
  - "tma": persistent, warp-specialised, K/V/q by TMA: 128-row blocks at D = Dv = 64,
    128 and 256 and at MLA prefill's D = 192, Dv = 128, for q, k, v whose heads are
    contiguous (TMA reads them as 2-D [tokens, heads * head dim]);
  - "ws": the same with 16-byte cp.async copies, for D = Dv = 128 in other layouts;
  - "wgmma": one partition, for 64-row blocks (every sequence short) and D = Dv = 64 in
    other layouts.
  The fp8 paths run the "tma" kernel with fp8 wgmma ("tma-fp8") at D = Dv = 128 and
  128-row blocks (`gluon_fp8_plan`): on fp8 inputs (q, k as given, V^T from its
  transposed copy) and on bf16/fp16 inputs, from the fp8 copies of q, k and V^T the op
  quantises them into (then the scratch holds the q copy too). The Choice lists the
  kernels in the order they are tried: a call the Gluon kernel cannot take at run time
  (q, k or v not 16-byte aligned, or a Gluon compile that failed: a warning says so
  once) runs the next, the Triton kernel, with the same plan.
* `paged_attention_prefill`: the Triton kernel's tiles (`paged_prefill_config`) and, on
  sm_90, the Gluon kernel tried first (`paged_gluon_plan`): "paged-tma", the varlen "tma"
  kernel walking the block table (a key tile's boxes each read from its cache block by
  TMA) for the plain bf16/fp16 call (D = Dv = 128, 128-row blocks, block sizes a power of
  two >= 16; the variants as the varlen "tma" kernel's), the Triton kernel after it as
  for varlen.

Pure Python: triton is never imported here at module level (Gluon's kernel module only
lazily, to ask its shared memory and whether this Triton has Gluon at all).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from graphsafe.device_info import (
    compute_capability,
    config_shared_memory,
    is_sm90,
    lds_direct_loads,
    max_shared_memory,
    num_sms,
)
from graphsafe.ops.attention.fp8 import fp8_prefill_supported, quantize_inputs
from graphsafe.ops.attention.fp8_format import FP8_DTYPE, SCALE_SLOTS, vt_columns
from graphsafe.workspace import workspace_bytes

Specs = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _hopper_or_newer(device: torch.device) -> bool:
    cc = compute_capability(device)
    return cc is not None and cc >= (9, 0)


# -- shared memory -----------------------------------------------------------------------
# What Triton allocates besides the tiles the models below count (barriers, reduction
# scratch: up to 5 KiB on gfx950; Triton 3.6 takes 512 bytes more than 3.9 for the decode
# kernel at D 256 on gfx942).
SHARED_SLACK = 6 * 1024


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _split_head(d: int, least: int) -> int:
    """The padded head dim of the varlen kernel's q.k: a power of two plus a power-of-two
    remainder (kernels/triton_prefill.py:_split_head_dim; 192 stays 192)."""
    da = max(least, 1 << (max(d, 1).bit_length() - 1))
    rest = d - da
    return da + (0 if rest <= 0 else _pow2(rest, least))


def fit_shared_memory(candidates: list[tuple[int, ...]], need, device: torch.device) -> tuple[int, ...]:
    """The first of `candidates` (configs, preferred first) whose shared memory `need(config)`
    fits the device's (`device_info.config_shared_memory`: ROCm's LDS), else the last; the
    first where nothing is fitted (NVIDIA: configs sized per capability)."""
    budget = config_shared_memory(device)
    if budget is None:
        return candidates[0]
    for config in candidates:
        if need(config) <= budget:
            return config
    return candidates[-1]


def _tile_candidates(preferred: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) in the order they are tried: the preferred
    tiles with fewer stages, then fewer keys per tile (down to 16), then 64 query rows on 4
    warps with the same sequence."""
    block_m, block_n, warps, stages = preferred
    out = []
    for bm, w in ((block_m, warps),) + (((64, 4),) if block_m > 64 else ()):
        bn = block_n
        while bn >= 16:
            out += [(bm, bn, w, st) for st in range(stages, 0, -1)]
            bn //= 2
    return out


def kv_cache_fp8(k_cache: torch.Tensor) -> bool:
    """Whether a paged K/V cache holds float8_e4m3fn (then `k_scale`/`v_scale` are read):
    decided here, once per signature, for the launches of both paged ops."""
    return k_cache.dtype == FP8_DTYPE


# -- paged decode -------------------------------------------------------------------------
# Tokens per tile of the decode kernel. The interpreter (CPU) uses small tiles so tests
# at tiny shapes still cover multi-tile loops and several splits.
DECODE_BLOCK_N = {"cuda": 64, "cpu": 16}
# Enough resident programs per SM to hide memory latency and even out the last wave.
PROGRAMS_PER_SM = 4
# A split must cover at least this many tiles of the worst-case length, or the combine
# pass costs more than the parallelism gains.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


def decode_block_n(device: torch.device | str) -> int:
    return DECODE_BLOCK_N.get(torch.device(device).type, DECODE_BLOCK_N["cuda"])


def decode_shared_bytes(config: tuple[int, int, int], d: int, dv: int, kv_fp8: bool, direct: bool = False) -> int:
    """LDS of the decode kernel under Triton's AMD backend (an upper bound, checked against
    its compiler by the compile matrix): a K and a V tile of BLOCK_N keys, only the larger
    at one stage (the loads are gathered through the block table: Triton keeps one buffer
    of each whatever the stage count); with direct-to-LDS loads (`direct`, gfx950) two of
    each from two stages on."""
    block_n, _, stages = config
    k, v = block_n * _pow2(d), block_n * _pow2(dv)
    tiles = min(stages, 2) * (k + v) if direct else (k + v if stages > 1 else max(k, v))
    return tiles * (1 if kv_fp8 else 2) + SHARED_SLACK


def decode_config(device: torch.device, d: int = 128, dv: int = 128, kv_fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 3 stages keep ~3 K/V tiles in flight per program;
    on ROCm fewer where the LDS is too small (`fit_shared_memory`: the decode kernel at D
    256 on gfx942); BLOCK_N never changes (the split plan reads it)."""
    stages = 3 if device.type == "cuda" and _hopper_or_newer(device) else 2
    block_n = decode_block_n(device)
    candidates = [(block_n, 4, st) for st in range(stages, 0, -1)]
    direct = lds_direct_loads(device)
    return fit_shared_memory(candidates, lambda c: decode_shared_bytes(c, d, dv, kv_fp8, direct), device)


def num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, sms: int, block_n: int) -> int:
    """KV splits per (request, KV head): enough programs for `PROGRAMS_PER_SM * sms`,
    each split covering at least `MIN_TILES_PER_SPLIT` tiles of `max_kv_len`."""
    programs = batch * num_kv_heads
    if programs <= 0 or max_kv_len <= 0:
        return 1
    useful = max(1, _cdiv(max_kv_len, block_n) // MIN_TILES_PER_SPLIT)
    wanted = _cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(1, min(wanted, useful, MAX_SPLITS))


def plan_decode_splits(
    batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int, device: torch.device | str
) -> int:
    """The split count the Triton decode kernel uses for these shapes on `device`."""
    return num_kv_splits(batch, num_kv_heads, max_blocks_per_seq * block_size, num_sms(device), decode_block_n(device))


def split_scratch(batch: int, num_q_heads: int, head_dim_v: int, num_splits: int) -> Specs:
    """The decode's scratch with `num_splits` splits (its one definition): per-split
    outputs `[B, Hq, S, Dv]` f32 and log2-sum-exp `[B, Hq, S]` f32; nothing for one split
    (the kernel then writes the output directly)."""
    if num_splits == 1:
        return ()
    return (((batch, num_q_heads, num_splits, head_dim_v), torch.float32),
            ((batch, num_q_heads, num_splits), torch.float32))


@dataclass(frozen=True)
class DecodeChoice:
    """How one `paged_attention_decode` signature runs.

    `path`: "empty" (no request or no query head: nothing launches), "one-split" (the
    decode kernel writes the output) or "split-kv" (`num_splits` partials per (request,
    KV head) into `workspace`, then the combine kernel). `config`: the decode kernel's
    (BLOCK_N, num_warps, num_stages). `kv_fp8`: the caches are float8_e4m3fn (the
    kernel reads `k_scale`/`v_scale`)."""

    path: str
    num_splits: int
    config: tuple[int, int, int]
    kv_fp8: bool
    workspace: Specs


def choose_paged_attention_decode(call, num_splits: int | None = None) -> DecodeChoice:
    """The decode's plan for this call signature (module docstring). `num_splits` (tests
    only) overrides the shape-based split count."""
    b, hq, _ = call.q.shape
    _, block_size, hk, dv = call.v_cache.shape
    device = call.q.device
    if num_splits is None:
        num_splits = plan_decode_splits(b, hk, call.block_table.shape[1], block_size, device)
    path = "empty" if b == 0 or hq == 0 else "one-split" if num_splits == 1 else "split-kv"
    workspace = () if path == "empty" else split_scratch(b, hq, dv, num_splits)
    d, fp8 = call.q.shape[2], kv_cache_fp8(call.k_cache)
    return DecodeChoice(path, num_splits, decode_config(device, d, dv, fp8), fp8, workspace)


def decode_workspace_specs(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks_per_seq: int, block_size: int,
    device: torch.device | str | None = None, head_dim: int | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of one Triton decode call on `device` (the registry passes it; default: the
    current CUDA device, else the CPU), from shapes: `split_scratch` of the split count
    `choose_paged_attention_decode` takes for these shapes (`plan_decode_splits`).
    `head_dim` (a parameter every backend's workspace function takes) does not change
    the Triton kernel's scratch."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    splits = plan_decode_splits(batch_size, num_kv_heads, max_blocks_per_seq, block_size, device)
    return list(split_scratch(batch_size, num_q_heads, head_dim_v, splits))


# -- paged prefill ------------------------------------------------------------------------
def paged_prefill_config(device: torch.device, d: int, dv: int, group: int, max_seqlen_q: int,
                         kv_fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) from shapes and host ints only.

    CUDA: 128 rows (8 warps) when a sequence's query block fills them
    (`max_seqlen_q * group > 64`), else 64 (4 warps); 64 keys per tile; 3 stages on
    Hopper at head dims <= 128, 2 otherwise. Head dims > 128 take 64 rows (the fp32
    accumulator of 128 x 256 would spill). On ROCm fewer stages, then fewer keys per
    tile, then 64 rows, where the LDS is too small (`fit_shared_memory`). The interpreter (CPU): 16 x 16
    tiles, so tiny tests cover several query blocks and key tiles."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    wide = max(d, dv) > 128
    block_m = 128 if max_seqlen_q * group > 64 and not wide else 64
    preferred = (block_m, 64, 8 if block_m == 128 else 4, 3 if _hopper_or_newer(device) and not wide else 2)
    direct = lds_direct_loads(device)
    return fit_shared_memory(_tile_candidates(preferred),
                             lambda c: paged_prefill_shared_bytes(c, d, dv, kv_fp8, direct), device)


def paged_prefill_shared_bytes(config: tuple[int, int, int, int], d: int, dv: int, kv_fp8: bool,
                               direct: bool = False) -> int:
    """LDS of the paged prefill kernel under Triton's AMD backend (an upper bound, checked by
    the compile matrix): the query tile [BLOCK_M, D] (a dot operand goes through LDS) and
    one K and one V tile of BLOCK_N keys from two stages on (gathered loads: Triton keeps a
    single buffer of each); at one stage the largest of the three. With direct-to-LDS loads
    (`direct`, gfx950): two K and V buffers from two stages on, or q, whichever is larger,
    and the p tile [BLOCK_M, BLOCK_N] in 16 bits. Measured with Triton 3.9, 128 rows x 64
    keys at D 128: 32 KiB at 1 stage, 48 KiB at 2 and 3 (gfx942); 82 KiB at 3 (gfx950)."""
    block_m, block_n, _, stages = config
    least = 32 if kv_fp8 else 16
    elem = 1 if kv_fp8 else 2
    q, k, v = block_m * _pow2(d) * 2, block_n * _pow2(d, least) * elem, block_n * _pow2(dv, least) * elem
    if direct:
        return max(q, min(stages, 2) * (k + v)) + block_m * block_n * 2 + SHARED_SLACK
    return (q + k + v if stages > 1 else max(q, k, v)) + SHARED_SLACK


@dataclass(frozen=True)
class PagedPrefillChoice:
    """How one `paged_attention_prefill` signature runs: `path` "empty" (the output has
    no element: nothing launches) or "triton" (zero the rows outside every sequence, then
    the attention kernels), `kernels` in the order they are tried (("gluon-paged-tma",
    "triton") where `gluon` is set: a call the Gluon kernel cannot take, misaligned or
    after a failed compile, runs the Triton kernel), `config` the Triton kernel's
    (BLOCK_M, BLOCK_N, num_warps, num_stages); `kv_fp8` as for decode. No scratch: one
    program covers all keys of its query block (no split-KV)."""

    path: str
    config: tuple[int, int, int, int]
    kv_fp8: bool
    kernels: tuple[str, ...] = ("triton",)
    gluon: GluonPlan | None = None


def paged_gluon_plan(call) -> GluonPlan | None:
    """The sm_90 Gluon kernel's plan for this paged prefill signature (alignment aside), or
    None (the Triton kernel): q and both caches of one 16-bit dtype, D = Dv = 64, 128 or 256, some
    sequence with more than 64 queries (128-row blocks), a finite positive scale (the
    variants, window, softcap and sinks, are the kernel's constexprs); TMA views: q [tokens, heads x D] and each cache
    [blocks x block size, heads x D] (unit strides along D, heads contiguous, a block's
    rows one after another, row strides of whole 16 bytes), block sizes a power of two
    from 16 (a box of a key tile lies in one block: `gluon_prefill.paged_tma_descriptors`)
    and a cache of fewer than 2^31 rows (TMA coordinates are int32); int32 block table and
    seq_lens."""
    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != dtype or v_cache.dtype != dtype:
        return None
    if not (math.isfinite(call.scale) and call.scale > 0) or call.max_seqlen_q <= 64:
        return None
    if call.block_table.dtype != torch.int32 or call.seq_lens.dtype != torch.int32:
        return None
    module = _sm90_gluon(q.device)
    if module is None:
        return None
    num_blocks, page, hk, d = k_cache.shape
    if not (d == v_cache.shape[3] and d in (64, 128, 256) and q.shape[2] == d and q.shape[0] > 0 and num_blocks > 0):
        return None
    if page < 16 or page & (page - 1) or num_blocks * page >= 2**31:
        return None
    if q.stride(2) != 1 or q.stride(1) != d or q.stride(0) % 8:
        return None
    for cache in (k_cache, v_cache):
        if cache.stride(3) != 1 or cache.stride(2) != d or cache.stride(1) % 8 or cache.stride(0) != page * cache.stride(1):
            return None
    window = 0 <= call.window_left < call.block_table.shape[1] * page
    plan = GluonPlan("paged-tma", 128, tma_key_tile(d, window), warp_specialisation("tma", d), tma_q_buffers(d))
    smem = max_shared_memory(q.device)
    plan = with_tma_store(plan, module, d, d, smem)
    return plan if smem is not None and shared_memory(module, plan, d, d) <= smem else None


def choose_paged_attention_prefill(call, config: tuple[int, int, int, int] | None = None) -> PagedPrefillChoice:
    """The paged prefill's plan for this call signature. `config` (tests and benchmarks
    only) overrides the Triton kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) and so
    asks for that kernel."""
    tq, hq, d = call.q.shape
    hk, dv = call.v_cache.shape[2:]
    path = "empty" if tq * hq * dv == 0 else "triton"
    gluon = None if path == "empty" or config is not None else paged_gluon_plan(call)
    config = config or paged_prefill_config(call.q.device, d, dv, hq // hk, call.max_seqlen_q,
                                            kv_cache_fp8(call.k_cache))
    kernels = ("triton",) if gluon is None else (gluon.name, "triton")
    return PagedPrefillChoice(path, config, kv_cache_fp8(call.k_cache), kernels, gluon)


# -- varlen prefill: the Triton kernel -----------------------------------------------------
def varlen_config(device: torch.device, d: int, dv: int, fp8: bool, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the Triton kernel, from shapes and host
    ints only.

    fp8 on Hopper: 128 x 128 tiles (fp8 wgmma m64n128k32; one CTA of two warpgroups per
    SM at ~255 registers, no spills in the key loop), 3 stages of K and V^T tiles
    (115 KB of shared memory at D = 128; 2 stages at D = 192). bf16/fp16: 128 x 64.
    On ROCm (capability (9, 4) / (9, 5): the Hopper branch below) fewer stages, then fewer
    keys per tile, then 64 query rows, where the LDS is too small (`fit_shared_memory`,
    `varlen_shared_bytes`: e.g. 1 stage at D 128 on gfx942's 64 KiB, where 3 take 80-96 KiB)."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # interpreter: small tiles, so tiny tests cover several blocks
    preferred = _varlen_preferred(device, d, dv, fp8, max_seqlen_q)
    direct = lds_direct_loads(device)
    return fit_shared_memory(_tile_candidates(preferred), lambda c: varlen_shared_bytes(c, d, dv, fp8, direct), device)


def varlen_shared_bytes(config: tuple[int, int, int, int], d: int, dv: int, fp8: bool, direct: bool = False) -> int:
    """LDS of the Triton varlen kernel under Triton's AMD backend (an upper bound, checked
    against its compiler by the compile matrix): a K and a V tile of BLOCK_N keys per stage,
    or the query / output tile [BLOCK_M, max(D, Dv)] in 16 bits (a dot operand goes through
    LDS: 64 KiB at 128 rows of D 256), whichever is larger, plus the p tile [BLOCK_M,
    BLOCK_N] where it goes through LDS: for fp8 (its cast, in fp32) and with direct-to-LDS
    loads (`direct`, gfx950: in 16 bits)."""
    block_m, block_n, _, stages = config
    least = 32 if fp8 else 16
    tiles = stages * block_n * (_split_head(d, least) + _pow2(dv, least)) * (1 if fp8 else 2)
    rows = block_m * max(_split_head(d, least), _pow2(dv, least)) * 2
    p = block_m * block_n * (4 if fp8 else 2 if direct else 0)
    return max(tiles, rows) + p + SHARED_SLACK


def _varlen_preferred(device: torch.device, d: int, dv: int, fp8: bool, max_seqlen_q: int
                      ) -> tuple[int, int, int, int]:
    """The config sized for the device's capability (on NVIDIA's GPUs: measured there)."""
    wide = max(d, dv) > 128
    block_m = 128 if max_seqlen_q > 64 else 64
    num_warps = 8 if block_m == 128 else 4
    hopper = _hopper_or_newer(device)
    stages = 3 if hopper and not wide else 2
    if fp8 and hopper:
        # Measured on an H200, 8 x 4096 causal, fp8 inputs: 64 x 128 / 4 warps / 3 stages
        # 1.83 ms vs 2.02 for 128 x 128 / 8 warps (D=128, GQA and MHA alike); at D=192,
        # 64 x 64 / 4 warps / 3 stages 1.33 vs 1.43 ms. Two CTAs per SM overlap one CTA's
        # softmax with the other's MMAs.
        return (64, 64, 4, 3) if wide else (64, 128, 4, 3)
    if fp8 and not wide:  # (sm89 has 99 KB of shared memory per block)
        return block_m, 128, num_warps, stages
    return block_m, 64, num_warps, stages


# -- varlen prefill: the sm_90 Gluon kernels ----------------------------------------------
@functools.cache
def gluon_module():
    """The Gluon kernels' module (kernels/gluon_prefill.py), or None where this Triton has
    no Gluon (imported on first use: CPU runs and other GPUs never need it)."""
    try:
        from graphsafe.ops.attention.kernels import gluon_prefill
    except (ImportError, AttributeError):  # no Gluon, or one without the Hopper ops used
        return None
    return gluon_prefill


def _sm90_gluon(device: torch.device):
    """The Gluon kernels' module where they can run on `device` (an sm_90 CUDA GPU, not
    HIP, a Triton with Gluon), else None."""
    if not is_sm90(device):
        return None
    return gluon_module()


def tma_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q, k and v can be read by TMA as 2-D [tokens, heads * head dim]: each
    head's row follows the previous head's (head stride = head dim), and there are
    tokens (a descriptor has no empty dimension)."""
    return all(x.stride(1) == x.shape[2] and x.shape[0] > 0 for x in (q, k, v))


def varlen_kernel(max_seqlen_q: int, d: int, dv: int, tma: bool) -> str | None:
    """Which 16-bit Gluon kernel serves these shapes (module docstring), or None: the
    Triton kernel."""
    long_rows = max_seqlen_q > 64  # 128-row blocks
    if long_rows and tma and (d, dv) in ((64, 64), (128, 128), (192, 128), (256, 256)):
        return "tma"
    if long_rows and d == dv == 128:
        return "ws"
    if d == dv and d in (64, 128):
        return "wgmma"
    return None


def wgmma_varlen_tiles(max_seqlen_q: int, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 128 query rows (two warpgroups) unless every sequence is
    short; 128 keys a tile at D = 128 and 192, 64 at D = 64 (measured on an H200, 8 x 4096
    causal, 32/8 heads: D = 128 2.60 ms with 128 keys vs 2.73 with 64; D = 64 1.52 vs
    1.84 ms; 16/16 heads, D = 192 / Dv = 128: 1.32 ms with 128 keys and one q buffer vs
    1.46-1.48 with 64 keys, 3 stages and two)."""
    return (128 if max_seqlen_q > 64 else 64), (64 if d == 64 else 128)


def warp_specialisation(kernel: str, d: int) -> tuple[int, int, int] | None:
    """(stages, consumer registers, loader registers) of the warp-specialised kernels, None
    for "wgmma". Measured on an H200 (32/8 heads, causal; 8 x 2048, 8 x 4096, 4 x 8192
    in ms). "ws" (a loader warpgroup of cp.async copies): 232 / 48 registers 0.661,
    2.254, 4.326; 224 / 64 0.696, 2.436, 4.654; 216 / 80 0.715, 2.386, 4.594 (the
    consumers spill); with 24 loader registers 3.65 ms at 8 x 4096 (the loader starves).
    "tma" (one loader warp): 232 / 32 0.631, 1.988, 3.783; 240 / 32 0.578, 2.127, 3.845;
    232 / 24 0.604, 2.040, 3.785 (within run-to-run noise of each other). At D = 192 (one
    q buffer, `tma_q_buffers`) 2 stages of 128 keys, 232 / 32 too."""
    if kernel == "ws":
        return 2, 232, 48
    if kernel == "tma":
        return 2, 232, 32
    return None


def warp_specialisation_fp8() -> tuple[int, int, int]:
    """(stages, consumer registers, loader registers) of the fp8 "tma" kernel. Measured on
    an H200 (32/8 heads, causal, fp8 inputs; 8 x 2048, 8 x 4096, 4 x 8192 in ms, CUDA-graph
    replays): 2 stages 232 / 32 0.493, 1.616, 2.966; 3 stages 0.498, 1.642, 3.033; 4 stages
    0.506, 1.649, 3.019; 3 stages 240 / 24 0.517, 1.656, 3.004 (the Triton fp8 kernel
    0.563, 1.869, 3.480)."""
    return 2, 232, 32


def tma_claims_tiles(group: int, d: int, fp8: bool = False, paged: bool = False) -> bool:
    """Whether the programs of a "tma" kernel (varlen 16-bit and fp8, paged prefill) claim
    their work tiles one at a time from a ticket counter (DYNAMIC: whichever program is
    free takes the next) rather than take the static deal (program p: tiles p, p +
    programs, ...). `group`: q heads per kv head. Measured on an H200 (causal,
    `benchmarks/prefill_tma_ab.py --knob schedule`, claimed / static time, medians of 3-5
    alternating rounds): paged prefill (32/8 heads, D 128, 8 x 512 new over 4096) 0.98-0.99
    at blocks of 16, 0.97-0.99 at 64; varlen 8 x 4096 at 32/32 heads, D 128 0.96, 16/16 at
    D 192 / Dv 128 0.92-0.94, 64/8 at D 64 0.99; 4 x 4096 at 16/8, D 256 0.92-0.93
    (`h200/2026-11-29-0627_prefill_schedule_ab.txt`, `..._0633_prefill_schedule_claims_ab.txt`).
    At 32/8 heads, D 128 (GQA at 128, fa3's rows), with the output by TMA
    (`h200/2026-11-29-0755_prefill_schedule_ab_tma_store.txt`): 1.001 / 0.986 / 1.008 at
    8 x 2048 / 8 x 4096 / 4 x 8192 (within the rounds' spread) and 0.977 over 16 uneven
    prompts (256-15360 tokens; every round lower), so claimed there too (before the TMA
    store it measured 1.00-1.02 and kept the static deal). Not the fp8 kernel: 1.014 (and
    1.014-1.019 before), so the static deal stays there. A kv head's q-head tiles a claim
    instead of one gained nothing and lost 7% on the paged rows."""
    return paged or not fp8


# The K/V bytes one section of a TMA kernel's work tiles may read (`tma_heads_per_section`):
# a third of the H100 / H200 L2 (50 MB), which leaves room for the q, output and other
# traffic (None: every head in one section, the order before sections). Measured on an H200
# (`benchmarks/prefill_tma_ab.py --knob section --rounds 4`, causal, medians of alternating
# CUDA-graph replays, `h200/2026-11-29-0934_prefill_section_ab.txt`), 16 MiB / 32 MiB / one
# section: 32/32 heads at D 128 0.948 / 0.962 (8 x 4096) and 0.923 / 0.923 (2 x 16384); 32/8
# heads 0.983 / 1.001 (4 x 8192: 32 MiB is one section there) and 0.979 / 0.990 (2 x 16384);
# D 192 / Dv 128 at 16/16 0.983 / 0.973; D 256 at 16/8 0.985 / 1.002; fp8 at 32/32 0.993 /
# 1.011. Outputs bit-equal; shapes whose K/V fits in one section (32/8 heads at 8 x 4096,
# D 64 at 64/8) run as before.
L2_SECTION_BYTES: int | None = 16 * 2**20


def tma_heads_per_section(hq: int, hk: int, max_keys: int, d: int, dv: int, elem_bytes: int) -> int:
    """Query heads a section of a "tma" kernel's work tiles (varlen 16-bit and fp8, paged
    prefill; `gluon_prefill._ws_tile`): the tiles of a sequence run section by section,
    each section's heaviest query blocks first across its heads, so the programs running
    at once read the K/V of one section's kv heads, which L2 keeps between the query
    blocks that read it again. A section holds as many whole kv heads (with their q heads)
    as `L2_SECTION_BYTES` of K/V (`max_keys` keys of d + dv elements of `elem_bytes`), the
    kv heads spread evenly over the fewest sections; every head (one section) where they
    all fit, as with few kv heads (GQA) or short sequences."""
    if L2_SECTION_BYTES is None or hk <= 1:
        return hq
    per_kv_head = max(max_keys, 1) * (d + dv) * elem_bytes
    fit = max(1, L2_SECTION_BYTES // per_kv_head)
    if fit >= hk:
        return hq
    sections = -(-hk // fit)
    return -(-hk // sections) * (hq // hk)


def tma_q_buffers(d: int) -> int:
    """q buffers of the "tma" kernels: two (the next work tile's q loads while this one
    computes), one at D = 192 and 256, where two would not leave room for two stages of
    key tiles (a q buffer is released after its last q.k, so its refill overlaps the last
    p.V)."""
    return 1 if d in (192, 256) else 2


@dataclass(frozen=True)
class GluonPlan:
    """The launch plan of one sm_90 Gluon kernel: `kernel` "tma", "ws" or "wgmma" (16-bit)
    or "tma-fp8" (varlen), "paged-tma" (paged prefill); the tiles; `warp_spec` (stages, consumer registers, loader registers),
    None for "wgmma"; the q buffers of the TMA kernels; `copies`: fp8 on the contiguous
    fp8 copies of bf16/fp16 q and k that the op quantises (the q copy is scratch);
    `out_buffers`: the TMA kernels' output staging buffers (2: each consumer's full row
    blocks go out by TMA, `with_tma_store`; 0: by `gl.store`), [64, Dv / `out_pieces`]
    each (1, or 2: a row block in two stores of half its columns)."""

    kernel: str
    block_m: int
    block_n: int
    warp_spec: tuple[int, int, int] | None
    q_buffers: int
    copies: bool = False
    out_buffers: int = 0
    out_pieces: int = 1

    @property
    def name(self) -> str:
        """The kernel's name in `VarlenChoice.kernels`."""
        return f"gluon-{self.kernel}"


def tma_key_tile(d: int, window: bool) -> int:
    """Keys a tile of the TMA kernels (varlen "tma", paged "paged-tma"): 128, but 64 at
    D = 64 with a sliding window and at D = 256 (where 128 would not leave shared memory
    for two stages). Measured on an H200 at gpt-oss-120b's shapes (64/8 heads, D 64, 8 x
    4096 causal, ms): plain, 128-key tiles 2.85, 64-key 3.22 (the one-partition "wgmma"
    kernel 3.00, Triton 2.93); sinks + a 128-token window, 64-key tiles 0.82, 128-key 0.94
    (Triton 1.10). At Gemma-2's (16/8 heads, D 256, 4 x 4096 causal) 64-key tiles and one
    q buffer 1.08 ms against Triton's 1.60 (window 4095 + softcap 50: 1.29 against 2.05)."""
    return 64 if (d == 64 and window) or d == 256 else 128


def gluon_plan_for(kernel: str, max_seqlen_q: int, d: int, copies: bool = False, window: bool = False) -> GluonPlan:
    """The plan of Gluon kernel `kernel` at these shapes (tiles, warp specialisation, q
    buffers): the one place they are derived from the kernel's name."""
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    if kernel == "tma":
        block_n = tma_key_tile(d, window)
    if kernel == "tma-fp8":
        return GluonPlan(kernel, block_m, block_n, warp_specialisation_fp8(), 2, copies)
    ws = warp_specialisation(kernel, d)
    q_buffers = tma_q_buffers(d) if kernel == "tma" else 2 if ws is not None else 1
    return GluonPlan(kernel, block_m, block_n, ws, q_buffers)


def shared_memory(module, plan: GluonPlan, d: int, dv: int) -> int:
    """Shared memory of the planned launch (`module`: the Gluon kernels' module)."""
    if plan.kernel == "tma-fp8":
        return fp8_shared_memory(module, plan.block_m, plan.block_n, d, dv, plan.out_buffers, plan.out_pieces)
    stages = 2 if plan.warp_spec is None else plan.warp_spec[0]
    return module.shared_memory_bytes(plan.block_m, plan.block_n, d, dv, stages, plan.q_buffers,
                                      o_buffers=plan.out_buffers, o_pieces=plan.out_pieces)


def fp8_shared_memory(module, block_m: int, block_n: int, d: int, dv: int, out_buffers: int = 0,
                      out_pieces: int = 1) -> int:
    """The fp8 kernel's shared memory: 1-byte q buffers and K / V^T stages, each
    consumer's p [64, BLOCK_N], and `out_buffers` 16-bit output staging buffers [64, Dv /
    out_pieces]."""
    return module.shared_memory_bytes(block_m, block_n, d, dv, warp_specialisation_fp8()[0], 2, 1, 2, out_buffers,
                                      out_pieces)


# The TMA kernels store each consumer's full 64-row output blocks by TMA (through a staging
# buffer each) where the shared memory holds the two buffers: [64, Dv] at D = Dv = 64 and 128,
# fp8 included; [64, Dv / 2] (a row block in two stores, the second after the first has read
# the buffer) at D 192 / Dv 128 and D 256, where the stages leave no room for two full ones.
# Measured on an H200 against `gl.store` from the accumulator's layout
# (`benchmarks/prefill_tma_ab.py --knob store`, `h200/2026-11-29-0653_prefill_tma_store_ab.txt`,
# medians of 5 alternating rounds, causal): 32/8 heads at D 128 0.925 / 0.951 / 1.001 at 8 x
# 2048 / 8 x 4096 / 4 x 8192, 0.970 over 16 uneven prompts, fp8 0.951; 32/32 heads 0.969; D 64
# (64/8) 0.976; paged prefill 0.976 / 0.966 (blocks of 16 / 64).
TMA_STORE = True


def with_tma_store(plan: GluonPlan, module, d: int, dv: int, smem: int | None) -> GluonPlan:
    """`plan` of a TMA kernel with two output staging buffers where `TMA_STORE` and the
    launch's shared memory with them is within `smem`: [64, Dv] where they fit, else
    [64, Dv / 2] (Dv a multiple of 128) where those do; else `plan` (`gl.store`)."""
    if not TMA_STORE or smem is None:
        return plan
    for pieces in (1, 2) if dv % 128 == 0 else (1,):
        staged = replace(plan, out_buffers=2, out_pieces=pieces)
        if shared_memory(module, staged, d, dv) <= smem:
            return staged
    return plan


def gluon_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, scale: float,
               variants: bool, window: bool = False) -> GluonPlan | None:
    """The Gluon kernel this bf16/fp16 call signature runs (alignment aside), or None (the
    Triton kernel): an sm_90 CUDA device, q, k, v of one 16-bit dtype with head dims one
    of the kernels serves (`varlen_kernel`), unit strides along D, a finite positive
    scale, no variant but on the "tma" kernel, the shared memory of the launch, and row strides the copies can
    use: TMA's token stride a whole number of 16 bytes; the 16-byte cp.async copies'
    token and head strides multiples of 16 elements (what Triton's specialisation of an
    int proves: with 8, the copies cannot be proven 16-byte aligned and the kernel does
    not compile)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    module = _sm90_gluon(q.device)
    if module is None:
        return None
    d, dv = q.shape[2], v.shape[2]
    kernel = varlen_kernel(max_seqlen_q, d, dv, tma_views(q, k, v))
    if kernel is None or not (math.isfinite(scale) and scale > 0) or (variants and kernel != "tma"):
        return None
    if any(x.stride(2) != 1 for x in (q, k, v)):
        return None
    if kernel == "tma":
        if any(x.stride(0) % 8 for x in (q, k, v)):
            return None
    elif any(x.stride(0) % 16 or x.stride(1) % 16 for x in (q, k, v)):
        return None
    plan = gluon_plan_for(kernel, max_seqlen_q, d, window=window)
    smem = max_shared_memory(q.device)
    if kernel == "tma":
        plan = with_tma_store(plan, module, d, dv, smem)
    return plan if smem is not None and shared_memory(module, plan, d, dv) <= smem else None


def gluon_fp8_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, variants: bool,
                   copies: bool = False) -> GluonPlan | None:
    """The fp8 "tma" kernel's plan for this fp8 call signature (alignment aside), or None
    (the Triton kernel): an sm_90 CUDA device, D = Dv = 128, 128-row blocks, no variant,
    the shared memory, and q and k float8_e4m3fn TMA views (heads contiguous, token
    strides of whole 16-byte groups) or, `copies`, bf16/fp16 inputs the op quantises into
    contiguous fp8 copies. (The V^T copy the fp8 path writes is always a TMA view.)"""
    dtypes = (torch.float16, torch.bfloat16) if copies else (torch.float8_e4m3fn,)
    if variants or q.dtype not in dtypes or k.dtype != q.dtype:
        return None
    module = _sm90_gluon(q.device)
    if module is None:
        return None
    d, dv = q.shape[2], v.shape[2]
    if not (d == dv == 128 and max_seqlen_q > 64 and q.shape[0] > 0 and k.shape[0] > 0):
        return None
    if not copies and any(x.stride(2) != 1 or x.stride(1) != d or x.stride(0) % 16 for x in (q, k)):
        return None
    smem = max_shared_memory(q.device)
    plan = with_tma_store(gluon_plan_for("tma-fp8", max_seqlen_q, d, copies), module, d, dv, smem)
    return plan if smem is not None and shared_memory(module, plan, d, dv) <= smem else None


# -- varlen prefill: the choice and its scratch --------------------------------------------
def varlen_scratch(total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   head_dim_v: int, quantize: bool, q_copy: bool = False) -> Specs:
    """Scratch of one fp8 call (its one definition): V^T (fp8, token-contiguous rows
    padded to 16 tokens: `vt_columns`), k in fp8 when quantising bf16/fp16 inputs, the
    float32 scale slots (`fp8_format.SCALE_SLOTS`) and, `q_copy`, q in fp8 (the sm_90
    Gluon kernel reads q from memory; the Triton kernel quantises q tile by tile
    itself). The bf16/fp16 path needs none."""
    specs = [((num_kv_heads, head_dim_v, vt_columns(total_k)), FP8_DTYPE)]
    if quantize:
        specs += [((total_k, num_kv_heads, head_dim), FP8_DTYPE)]
    specs += [((SCALE_SLOTS,), torch.float32)]
    if quantize and q_copy:
        specs += [((total_q, num_q_heads, head_dim), FP8_DTYPE)]
    return tuple(specs)


# The fp8 paths' scratch candidates, as `choose_flash_attn_varlen` picks among them:
# (quantise, q copy) for fp8 inputs (V^T only: the Gluon kernel reads q as given), for
# quantised bf16/fp16 inputs on the Triton kernel, and on the Gluon fp8 kernel (which
# reads a quantised copy of q).
VARLEN_FP8_SCRATCH = ((False, False), (True, False), (True, True))


def flash_attn_varlen_workspace(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, fp8: bool = True,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The Triton backend's worst case for one call (the record's `workspace`): the
    largest scratch among the fp8 paths' candidates (`VARLEN_FP8_SCRATCH`: quantising
    bf16/fp16 inputs for the sm_90 Gluon kernel, with a q copy); nothing when `fp8` is
    False (the bf16/fp16 path takes none)."""
    if not fp8:
        return []
    candidates = [varlen_scratch(total_q, total_k, num_q_heads, num_kv_heads, head_dim, head_dim_v, quantize, q_copy)
                  for quantize, q_copy in VARLEN_FP8_SCRATCH]
    return list(max(candidates, key=lambda specs: workspace_bytes(*specs)))


@dataclass(frozen=True)
class VarlenChoice:
    """How one `flash_attn_varlen` signature runs.

    `path`: "reference" (fp8 asked of a GPU without working fp8 matrix units: the exact
    PyTorch path), "empty" (the output has no element), "16-bit" (bf16/fp16 as given),
    "quantise" (bf16/fp16 inputs quantised to fp8 inside the op) or "fp8-inputs".
    `kernels`: the attention kernels in the order they are tried, e.g. ("gluon-tma",
    "triton"): a call the Gluon kernel cannot take (misaligned, failed compile) runs the
    next; the Triton kernel, always last, takes every call; () when no row has work.
    `config`: the Triton kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages). `gluon`: the
    Gluon kernel's plan (None: not tried). `workspace`: the scratch of the call."""

    path: str
    kernels: tuple[str, ...] = ()
    config: tuple[int, int, int, int] | None = None
    gluon: GluonPlan | None = None
    workspace: Specs = ()


def choose_flash_attn_varlen(call, config: tuple[int, int, int, int] | None = None) -> VarlenChoice:
    """The varlen prefill's plan for this call signature (module docstring). `fp8` is
    resolved here ("auto": the cached per-device probe). `config` (tests and benchmarks
    only) overrides the Triton kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) and so
    asks for the Triton kernel."""
    q, k, v = call.q, call.k, call.v
    device = q.device
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    quantize = quantize_inputs(call.fp8, q.dtype, device)
    use_fp8 = q.dtype == FP8_DTYPE or quantize
    if use_fp8 and device.type == "cuda" and not fp8_prefill_supported(device):
        return VarlenChoice("reference")
    if tq * hq * dv == 0:
        return VarlenChoice("empty")
    path = "quantise" if quantize else "fp8-inputs" if use_fp8 else "16-bit"
    explicit = config is not None
    config = config or varlen_config(device, d, dv, use_fp8, call.max_seqlen_q)
    num_seqs = call.cu_seqlens_q.shape[0] - 1
    gluon = None
    if num_seqs > 0 and call.max_seqlen_q > 0 and not explicit:
        # (A window of every key is none: the kernels compile it away; of the 16-bit Gluon kernels only "tma"
        # takes the variants, of the fp8 path none.)
        window = 0 <= call.window_left < tk
        variants = window or call.softcap != 0.0 or call.sinks is not None
        if path == "16-bit":
            gluon = gluon_plan(q, k, v, call.max_seqlen_q, call.scale, variants, window=window)
        else:
            gluon = gluon_fp8_plan(q, k, v, call.max_seqlen_q, variants, copies=quantize)
    if num_seqs == 0 or call.max_seqlen_q == 0:
        kernels: tuple[str, ...] = ()
    else:
        kernels = ("triton",) if gluon is None else (gluon.name, "triton")
    workspace = () if path == "16-bit" else varlen_scratch(tq, tk, hq, hk, d, dv, quantize, q_copy=gluon is not None)
    return VarlenChoice(path, kernels, config, gluon, workspace)
