"""Benchmarks of the MLA attention ops (DeepSeek dims: R = 512, P = 64; bf16 queries).

`mla_decode`: B x H x ctx (default the design anchor B=64, H=16, ctx=8192 and B=64, H=128 at
8192 and 32768; `--full`: B in {1, 64, 128} x H in {16, 128} x ctx in {4096, 32768}); every
request holds `ctx` cached tokens in randomly placed 64-token blocks. `sparse_mla`:
DeepSeek-V3.2's decode, T tokens (b requests of s_q queries) x H in {16, 64, 128} with
K = 2048 distinct slots per token, each token's slots in its own region of the cache.
`sparse_mla_prefill`: thousands of query tokens over one flat cache (DeepSeek-V3.2's sparse
prefill; d_qk 512 is DeepSeek-V4's head). Every shape runs with the bf16 cache (1152 bytes
a key) and, on a row labelled "fp8_ds_mla", with the same keys as DeepSeek's FP8 records
(`graphsafe.formats.fp8_ds_mla`, 656 bytes a key).

Peers on the same tensors, outputs compared: FlashInfer's MLA decode (fa3, fa2; bf16) and
FlashMLA (`graphsafe.bench.flashmla`: dense bf16 decode, sparse decode over the fp8_ds_mla
cache with 16 heads padded to 64 as vLLM does, `flash_mla_sparse_fwd` for prefill), each
where it is installed; the note gives graphsafe / peer ratios.

Bytes = the cache rows every query must read once (at the cache's bytes a key) + q +
out + lse + the block table / indices; flops = 2 * H * keys * (R + P + R) per query.
With H = 128 the roofline is the larger of bytes / bandwidth and flops / peak: the
table shows %bw and %peak, read the larger one. The eager reference materialises the
gathered keys in f32 and the [H, keys] scores; where that would need more than ~20 GB
it is left out and the shape label says so ("no eager").

`mla_tune` compares kernel tiles and split counts at the anchor shapes (for picking the
defaults in plan.kernel_config / plan_kv_splits on a new GPU): `TUNE_TILES` says
what each candidate tests.
"""

from __future__ import annotations

import torch

from graphsafe.bench import flashinfer, flashmla
from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.formats.fp8_ds_mla import quantize_records, record_bytes
from graphsafe.registry import get_op

R, P, D = 512, 64, 576
RECORD = record_bytes(R, P)  # 656: 512 e4m3 bytes, 4 float32 scales, 64 bf16 rope values
# Cache rows quantised at a time by `fp8_cache` (its float32 temporaries stay ~1 GB).
QUANT_CHUNK_ROWS = 1 << 18
BLOCK_SIZE = 64
EAGER_LIMIT_BYTES = 20e9
# bf16 dense peak over copy bandwidth on H100/H200 (~800 TFLOP/s, 3.0-4.3 TB/s): above
# this many flops per byte a shape is compute-bound.
RIDGE_FLOPS_PER_BYTE = 230


def _eager_bytes(rows: int, heads: int, keys: int) -> float:
    """Peak memory of the reference: gathered keys (bf16, f32, and a copy of the f32 values
    einsum may make), scores, probs."""
    return rows * keys * D * (2 + 4 + 4) + 3 * rows * heads * keys * 4 + rows * keys * 8


def _gen(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def decode_inputs(batch: int, heads: int, ctx: int, device: torch.device, seed: int = 0, dtype=torch.bfloat16):
    """Full requests of `ctx` tokens in random blocks; drawn on the device (GB-sized caches)."""
    gen = _gen(device, seed)
    max_blocks = ctx // BLOCK_SIZE
    num_blocks = batch * max_blocks
    q = torch.randn((batch, heads, D), generator=gen, device=device, dtype=dtype)
    kv_cache = torch.randn((num_blocks, BLOCK_SIZE, D), generator=gen, device=device, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen, device=device).view(batch, max_blocks).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, kv_cache, block_table, seq_lens, D**-0.5, R


def sparse_inputs(tokens: int, heads: int, topk: int, device: torch.device, region: int = 8192, seed: int = 0, dtype=torch.bfloat16):
    """Token t attends to `topk` distinct slots of its own `region`-slot part of the cache."""
    gen = _gen(device, seed)
    num_blocks = tokens * region // BLOCK_SIZE
    q = torch.randn((tokens, heads, D), generator=gen, device=device, dtype=dtype)
    kv_cache = torch.randn((num_blocks, BLOCK_SIZE, D), generator=gen, device=device, dtype=dtype)
    order = torch.rand((tokens, region), generator=gen, device=device).argsort(dim=1)[:, :topk]
    base = torch.arange(tokens, device=device)[:, None] * region
    indices = (order + base).to(torch.int32)
    return q, kv_cache, indices, D**-0.5, R


def fp8_cache(kv_cache: torch.Tensor, kv_lora_rank: int = R) -> torch.Tensor:
    """The fp8_ds_mla cache `[num_blocks, block_size, record]` uint8 holding the keys of the
    bf16 cache `kv_cache [num_blocks, block_size, R + P]` (`quantize_records`, in chunks of
    QUANT_CHUNK_ROWS rows: the float32 temporaries of a GB-sized cache at once would not fit)."""
    d = kv_cache.shape[-1]
    record = record_bytes(kv_lora_rank, d - kv_lora_rank)
    rows = kv_cache.reshape(-1, d)
    out = torch.empty(rows.shape[0], record, dtype=torch.uint8, device=kv_cache.device)
    for start in range(0, rows.shape[0], QUANT_CHUNK_ROWS):
        part = rows[start : start + QUANT_CHUNK_ROWS]
        out[start : start + QUANT_CHUNK_ROWS] = quantize_records(part[:, :kv_lora_rank], part[:, kv_lora_rank:])
    return out.view(*kv_cache.shape[:2], record)


def with_fp8_cache(args: tuple) -> tuple:
    """`decode_inputs` / `sparse_inputs` (or any MLA op's args, kv_lora_rank last) with their
    cache (argument 1) as fp8_ds_mla records."""
    return (args[0], fp8_cache(args[1], args[-1]), *args[2:])


def cache_bytes_per_key(kv_cache: torch.Tensor) -> int:
    """Bytes of one key of the cache: 1152 for bf16 (576 values), 656 for fp8_ds_mla records."""
    return kv_cache.shape[-1] * kv_cache.element_size()


def _label(kind: str, rows: int, heads: int, keys: int, eager: bool, fp8: bool = False, extra: str = "") -> str:
    return (f"{kind}={rows} H={heads} {'ctx' if kind == 'B' else 'K'}={keys}" + (f" {extra}" if extra else "")
            + (" fp8_ds_mla" if fp8 else "") + ("" if eager else " (no eager)"))


def _problem(spec, args, device, rows: int, heads: int, keys: int, kind: str, extra_bytes: int,
             extra_label: str = "") -> Problem:
    eager = _eager_bytes(rows, heads, keys) <= EAGER_LIMIT_BYTES
    impls = op_peers(spec, args, device)
    if not eager:
        impls.pop("reference eager")
    q, kv_cache = args[0], args[1]
    out_bytes = rows * heads * R * q.element_size() + rows * heads * 4
    read = rows * keys * cache_bytes_per_key(kv_cache)
    total = read + nbytes(q) + out_bytes + extra_bytes
    flops = 2 * rows * heads * keys * (D + R)
    return Problem(
        case=spec.name,
        shape=_label(kind, rows, heads, keys, eager, fp8=kv_cache.dtype == torch.uint8, extra=extra_label),
        impls=impls,
        bytes=total,
        flops=flops,
        bound="compute" if flops / total > RIDGE_FLOPS_PER_BYTE else "memory",
    )


# (batch, heads, ctx); by default the design anchor (memory-bound), the FlashInfer
# comparison's B=64 H=128 ctx=8192 (issue 17) and the compute-bound
# 128 heads at 32k.
@bench_case("mla_decode", Shapes(
    default=((64, 16, 8192), (64, 128, 8192), (64, 128, 32768)),
    full=((64, 16, 8192), (64, 128, 8192),
          *((b, h, c) for b in (1, 64, 128) for h in (16, 128) for c in (4096, 32768))),
    cpu=((2, 16, 512),),
))
def mla_decode(device: torch.device, shapes: tuple):
    spec = get_op("mla_decode")
    for batch, heads, ctx in shapes:
        args = decode_inputs(batch, heads, ctx, device)
        problem = _problem(spec, args, device, batch, heads, ctx, "B", nbytes(args[2], args[3]))
        ours = spec.public(*args)
        _add_peers(problem, flashinfer.mla_decode_peers(*args, ours), flashmla.dense_decode_peers(*args, ours))
        yield problem
        del problem, ours
        args = with_fp8_cache(args)
        yield _problem(spec, args, device, batch, heads, ctx, "B", nbytes(args[2], args[3]))
        del args


def _add_peers(problem: Problem, *peers: tuple[dict, str]) -> None:
    """The external peers' impls and notes (`graphsafe.bench.flashinfer`, `.flashmla`)."""
    for impls, note in peers:
        problem.impls.update(impls)
        problem.note = "; ".join(x for x in (problem.note, note) if x)


# DeepSeek-V3.2's decode: (tokens T, heads, K slots per token, cache slots per token's
# region, queries per request s_q); T = requests * s_q. Heads 128 (TP1), 64 (TP2), 16 (TP8:
# FlashMLA's peer pads them to 64, as vLLM does).
@bench_case("sparse_mla", Shapes(
    default=((128, 128, 2048, 8192, 2), (256, 128, 2048, 8192, 2), (128, 64, 2048, 8192, 2), (128, 16, 2048, 8192, 2)),
    full=tuple((b * s, h, 2048, 8192, s) for b in (1, 8, 32, 64, 128) for s in (1, 2) for h in (16, 64, 128)),
    cpu=((4, 16, 64, 256, 2),),
))
def sparse_mla(device: torch.device, shapes: tuple):
    spec = get_op("sparse_mla")
    for tokens, heads, topk, region, s_q in shapes:
        args = sparse_inputs(tokens, heads, topk, device, region=region)
        requests = f"b={tokens // s_q}x{s_q}"
        yield _problem(spec, args, device, tokens, heads, topk, "T", nbytes(args[2]), requests)
        args = with_fp8_cache(args)
        problem = _problem(spec, args, device, tokens, heads, topk, "T", nbytes(args[2]), requests)
        _add_peers(problem, flashmla.sparse_decode_peers(*args, spec.public(*args), s_q))
        yield problem
        del args, problem


# DeepSeek-V3.2's sparse prefill: (query tokens, heads, q.k width R + P, K, cache keys). Each
# token attends to K distinct keys of one flat bf16 cache; graphsafe reads it as 64-slot
# pages, bf16 and (R a multiple of 128) as fp8_ds_mla records; FlashMLA's
# `flash_mla_sparse_fwd` reads the bf16 rows. d_qk 512 is DeepSeek-V4's head (R = 448).
@bench_case("sparse_mla_prefill", Shapes(
    default=((4096, 128, 576, 2048, 32768),),
    full=((4096, 128, 576, 2048, 32768), (4096, 64, 576, 2048, 32768), (4096, 128, 512, 2048, 32768)),
    cpu=((16, 16, 192, 32, 256),),
))
def sparse_mla_prefill(device: torch.device, shapes: tuple):
    spec = get_op("sparse_mla")
    for tokens, heads, d_qk, topk, keys in shapes:
        gen = _gen(device)
        r = d_qk - P
        kv = torch.randn((keys, d_qk), generator=gen, device=device, dtype=torch.bfloat16)
        q = torch.randn((tokens, heads, d_qk), generator=gen, device=device, dtype=torch.bfloat16)
        indices = torch.rand((tokens, keys), generator=gen, device=device).argsort(dim=1)[:, :topk].to(torch.int32)
        scale = d_qk**-0.5
        args = (q, kv.view(keys // BLOCK_SIZE, BLOCK_SIZE, d_qk), indices, scale, r)
        flops = 2 * tokens * heads * topk * (d_qk + r)
        for fp8 in (False, True) if r % 128 == 0 else (False,):
            call = with_fp8_cache(args) if fp8 else args
            impls = {f"graphsafe[{spec.serving_backend(device.type)}]": (lambda call=call: spec.public(*call))}
            problem = Problem(case="sparse_mla_prefill",
                              shape=f"s_q={tokens} H={heads} d_qk={d_qk} K={topk} keys={keys}"
                              + (" fp8_ds_mla" if fp8 else ""),
                              impls=impls, bytes=nbytes(q, indices) + tokens * heads * r * 2
                              + min(keys, tokens * topk) * cache_bytes_per_key(call[1]),
                              flops=flops, bound="compute")
            _add_peers(problem, flashmla.sparse_prefill_peers(q, kv, indices, scale, r, spec.public(*call)))
            yield problem
            del problem, call
        del args, kv, q, indices


# mla_tune candidates: (block_h, block_n, num_warps, num_stages, ctas_per_sm, value_chunks
# [, l2_prefetch]). With num_stages >= 5 Triton (3.9 at least) keeps 3 key-tile buffers and
# issues each tile two iterations ahead (the block-table / index load takes a stage of its
# own); with 2-4 stages the next tile is issued at the end of the current iteration, so
# part of its latency is exposed (what l2_prefetch works around). 128 heads (the default
# there is the Gluon kernel on sm_90): the Triton kernel's best tiles, with and without
# the L2 prefetch; 64/32/w8/s5 (latency hidden, but q.k wgmmas of N = 16); one
# [64, 512] value tile; the earlier default 64/16; 16-head tiles. 16 heads: the default
# with the L2 prefetch, deeper pipelines of the default tile (s5: 94 KB, still two
# programs per SM) and of 16-key tiles, and 64-key tiles.
TUNE_TILES = {
    16: [(16, 32, 4, 2, 2, 1), (16, 32, 4, 5, 2, 1, True), (16, 16, 4, 5, 2, 1), (16, 32, 4, 3, 2, 1), (16, 64, 8, 2, 1, 1)],
    128: [(64, 64, 8, 2, 1, 2), (64, 64, 8, 2, 1, 2, True), (64, 32, 8, 5, 1, 2), (64, 64, 8, 2, 1, 1), (64, 16, 8, 2, 1, 1),
          (16, 32, 4, 2, 2, 1)],
}


def _tiles_label(c) -> str:
    pf = "/pf" if c.l2_prefetch else ""
    wg = "/wgsplit" if c.warpgroup_split else ""
    return f"{c.block_h}/{c.block_n}/w{c.num_warps}/s{c.num_stages}/c{c.value_chunks}{pf}{wg}"


def _tune_impls(call, heads: int, cfg, splits_list) -> dict:
    from graphsafe.ops.mla.plan import KernelConfig

    impls = {f"default {_tiles_label(cfg)}": lambda: call()}
    for t in TUNE_TILES[heads]:
        c = KernelConfig(*t)
        impls[f"tiles {_tiles_label(c)}"] = lambda c=c: call(config=c)
    for n in splits_list:
        impls[f"splits {n}"] = lambda n=n: call(num_splits=n)
    return impls


# ("decode", heads, ctx) and ("sparse", heads, K); full sweep only (a tuning sweep) and
# GPU only (it times the Triton kernel directly).
@bench_case("mla_tune", Shapes(
    default=(),
    full=(*(("decode", h, c) for h, c in ((16, 8192), (16, 32768), (128, 8192), (128, 32768))),
          ("sparse", 16, 2048), ("sparse", 128, 2048)),
    cpu=None,
))
def mla_tune(device: torch.device, shapes: tuple):
    """Tiles and split counts of the Triton kernel at the anchor shapes (graphsafe only)."""
    from graphsafe.ops.mla import triton as backend
    from graphsafe.ops.mla.plan import plan_launch

    for heads, ctx in ((h, c) for kind, h, c in shapes if kind == "decode"):
        args = decode_inputs(64, heads, ctx, device)
        cfg, plan = plan_launch(64, heads, ctx, device)
        impls = _tune_impls(lambda **kw: backend.mla_decode(*args, **kw), heads, cfg, (2, 4, 8, 16, 32))
        total = 64 * ctx * D * 2 + 2 * nbytes(args[0])
        flops = 2 * 64 * heads * ctx * (D + R)
        yield Problem(case="mla_tune decode", shape=f"B=64 H={heads} ctx={ctx} (plan S={plan.num_splits})", impls=impls,
                      bytes=total, flops=flops, bound="compute" if flops / total > RIDGE_FLOPS_PER_BYTE else "memory")
        del args
    for heads in (h for kind, h, _ in shapes if kind == "sparse"):
        args = sparse_inputs(64, heads, 2048, device)
        cfg, plan = plan_launch(64, heads, 2048, device)
        impls = _tune_impls(lambda **kw: backend.sparse_mla(*args, **kw), heads, cfg, (2, 4, 8))
        total = 64 * 2048 * D * 2 + 2 * nbytes(args[0]) + nbytes(args[2])
        flops = 2 * 64 * heads * 2048 * (D + R)
        yield Problem(case="mla_tune sparse", shape=f"T=64 H={heads} K=2048 (plan S={plan.num_splits})", impls=impls,
                      bytes=total, flops=flops, bound="compute" if flops / total > RIDGE_FLOPS_PER_BYTE else "memory")
        del args
