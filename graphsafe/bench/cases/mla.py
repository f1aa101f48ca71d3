"""Benchmarks of the MLA attention ops (DeepSeek dims: R = 512, P = 64, bf16).

`mla_decode`: B in {1, 64, 128} x H in {16, 128} x ctx in {4096, 32768}, plus the
DESIGN.md anchor B=64, H=16, ctx=8192; every request holds `ctx` cached tokens in
randomly placed 64-token blocks. `sparse_mla`: T in {1, 64, 128} x H in {16, 128} with
K = 2048 distinct slots per token, each token's slots in its own region of the cache (as
in decode, where every token attends to its own request).

Bytes = the cache rows every query must read once + q + out + lse + the block table /
indices; flops = 2 * H * keys * (R + P + R) per query. With H = 128 the roofline is
the larger of bytes / bandwidth and flops / peak: the table shows %bw and %peak, read the
larger one. The eager reference materialises the gathered keys in f32 and the [H, keys]
scores; where that would need more than ~20 GB it is left out and the shape label says
so ("no eager").

`mla_tune` compares kernel tiles and split counts at the anchor shapes (for picking the
defaults in splits.kernel_config / plan_kv_splits on a new GPU).
"""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.registry import get_op

R, P, D = 512, 64, 576
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


def _label(kind: str, rows: int, heads: int, keys: int, eager: bool) -> str:
    return f"{kind}={rows} H={heads} {'ctx' if kind == 'B' else 'K'}={keys}" + ("" if eager else " (no eager)")


def _problem(spec, args, device, rows: int, heads: int, keys: int, kind: str, extra_bytes: int) -> Problem:
    eager = _eager_bytes(rows, heads, keys) <= EAGER_LIMIT_BYTES
    impls = op_peers(spec, args, device)
    if not eager:
        impls.pop("reference eager")
    q = args[0]
    out_bytes = rows * heads * R * q.element_size() + rows * heads * 4
    read = rows * keys * D * q.element_size()
    total = read + nbytes(q) + out_bytes + extra_bytes
    flops = 2 * rows * heads * keys * (D + R)
    return Problem(
        case=spec.name,
        shape=_label(kind, rows, heads, keys, eager),
        impls=impls,
        bytes=total,
        flops=flops,
        bound="compute" if flops / total > RIDGE_FLOPS_PER_BYTE else "memory",
    )


@bench_case("mla_decode")
def mla_decode(device: torch.device):
    spec = get_op("mla_decode")
    shapes = [(64, 16, 8192)] + [(b, h, c) for b in (1, 64, 128) for h in (16, 128) for c in (4096, 32768)]
    for batch, heads, ctx in shapes:
        args = decode_inputs(batch, heads, ctx, device)
        yield _problem(spec, args, device, batch, heads, ctx, "B", nbytes(args[2], args[3]))
        del args


@bench_case("sparse_mla")
def sparse_mla(device: torch.device):
    spec = get_op("sparse_mla")
    for tokens in (1, 64, 128):
        for heads in (16, 128):
            args = sparse_inputs(tokens, heads, 2048, device)
            yield _problem(spec, args, device, tokens, heads, 2048, "T", nbytes(args[2]))
            del args


@bench_case("mla_tune")
def mla_tune(device: torch.device):
    """Tiles and split counts of the Triton kernel at the anchor shapes (graphsafe only)."""
    from graphsafe.ops.mla import triton as backend
    from graphsafe.ops.mla.splits import KernelConfig, plan_launch

    tiles = {
        16: [(16, 32, 4, 2), (16, 32, 4, 3), (16, 16, 4, 3), (16, 16, 4, 4), (16, 64, 8, 2)],
        128: [(64, 16, 8, 2), (64, 32, 8, 2), (64, 16, 8, 3), (32, 32, 8, 2), (32, 16, 4, 3), (16, 32, 4, 2)],
    }
    for heads, ctx in ((16, 8192), (16, 32768), (128, 8192)):
        args = decode_inputs(64, heads, ctx, device)
        cfg, plan = plan_launch(64, heads, ctx, device)
        impls = {f"default {cfg.block_h}/{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages} S={plan.num_splits}": lambda: backend.mla_decode(*args)}
        for t in tiles[heads]:
            c = KernelConfig(*t)
            impls[f"tiles {t[0]}/{t[1]}/w{t[2]}/s{t[3]}"] = lambda c=c: backend.mla_decode(*args, config=c)
        for s in (4, 8, 16, 32, 64):
            impls[f"splits {s}"] = lambda s=s: backend.mla_decode(*args, num_splits=s)
        total = 64 * ctx * D * 2 + 2 * nbytes(args[0])
        yield Problem(case="mla_tune decode", shape=f"B=64 H={heads} ctx={ctx}", impls=impls, bytes=total, flops=2 * 64 * heads * ctx * (D + R))
        del args
    for heads in (16, 128):
        args = sparse_inputs(64, heads, 2048, device)
        impls = {"default": lambda: backend.sparse_mla(*args)}
        for t in tiles[heads]:
            c = KernelConfig(*t)
            impls[f"tiles {t[0]}/{t[1]}/w{t[2]}/s{t[3]}"] = lambda c=c: backend.sparse_mla(*args, config=c)
        for s in (4, 8, 16):
            impls[f"splits {s}"] = lambda s=s: backend.sparse_mla(*args, num_splits=s)
        total = 64 * 2048 * D * 2 + 2 * nbytes(args[0]) + nbytes(args[2])
        yield Problem(case="mla_tune sparse", shape=f"T=64 H={heads} K=2048", impls=impls, bytes=total, flops=2 * 64 * heads * 2048 * (D + R))
        del args
