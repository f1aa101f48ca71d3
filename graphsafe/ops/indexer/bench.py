"""Benchmarks of the sparse-indexer ops (issue 3): paged decode logits, prefill logits,
K-cache quantise/gather, the slot mapping and the decode composite, each against the
reference eager and the reference under torch.compile on the same inputs; and the launch
configurations of the paged-logits kernel (`fp8_paged_mqa_logits_tune`).

Large inputs are drawn on the device (seeded) so that setting up B=128 x 32k contexts
does not take minutes on the host. Peak memory stays under ~20 GB: the largest is the
eager reference of the paged logits at B=128, ctx=32768 (its fp32 keys, ~2.2 GB).
"""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.registry import get_op
from graphsafe.testing.cases import case_for

FP8 = torch.float8_e4m3fn
H, D = 64, 128


def _gen(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _fp8(shape, device, gen) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=gen).to(FP8)


def paged_inputs(batch: int, ctx: int, next_n: int, device: torch.device, block_size: int = 64):
    """Every request holds `ctx` tokens; max_model_len = ctx; blocks shuffled over the cache."""
    gen = _gen(device)
    per_req = -(-ctx // block_size)
    nb = batch * per_req
    cache = torch.empty((nb, block_size, D + 4), dtype=torch.uint8, device=device)
    flat = cache.view(nb, -1)
    flat[:, : block_size * D] = _fp8((nb, block_size * D), device, gen).view(torch.uint8)
    flat[:, block_size * D :] = (torch.rand((nb, block_size), device=device, generator=gen) * 0.05 + 1e-3).view(torch.uint8)
    table = torch.randperm(nb, device=device, generator=gen).view(batch, per_req).int()
    q = _fp8((batch, next_n, H, D), device, gen)
    weights = torch.randn((batch * next_n, H), device=device, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, cache, weights, lens, table, ctx


# (next_n, batch, ctx); by default the NOTES targets (B=128, 32k contexts).
@bench_case("fp8_paged_mqa_logits", Shapes(
    default=((1, 128, 32768), (2, 128, 32768)),
    full=tuple((next_n, b, ctx) for next_n in (1, 2) for b in (1, 32, 128) for ctx in (4096, 32768)),
    cpu=((1, 2, 512), (2, 2, 512)),
))
def fp8_paged_mqa_logits(device: torch.device, shapes: tuple):
    spec = get_op("fp8_paged_mqa_logits")
    for next_n, batch, ctx in shapes:
        args = paged_inputs(batch, ctx, next_n, device)
        q, cache, weights, lens, table, _ = args
        keys = batch * ctx * (D + 4)  # each context's fp8 keys and scales, read once
        written = batch * next_n * ctx * 4
        yield Problem(
            case=spec.name,
            shape=f"B={batch} ctx={ctx} H={H} D={D} next_n={next_n} bs=64",
            impls=op_peers(spec, args, device),
            bytes=keys + written + nbytes(q, weights, lens, table),
            flops=2 * batch * next_n * ctx * H * D,
        )
        del args, q, cache, weights, lens, table


def _mqa_inputs(m: int, n: int, device: torch.device):
    gen = _gen(device)
    q, k = _fp8((m, H, D), device, gen), _fp8((n, D), device, gen)
    k_scale = torch.rand(n, device=device, generator=gen) * 0.05 + 1e-3
    weights = torch.randn((m, H), device=device, generator=gen)
    return q, k, k_scale, weights


# (M queries, N keys, window)
@bench_case("fp8_mqa_logits", Shapes(
    default=((8192, 8192, "full"),),
    full=((8192, 8192, "full"), (8192, 8192, "causal")),
    cpu=((256, 256, "causal"),),
))
def fp8_mqa_logits(device: torch.device, shapes: tuple):
    spec = get_op("fp8_mqa_logits")
    for m, n, window in shapes:
        q, k, k_scale, weights = _mqa_inputs(m, n, device)
        rows = torch.arange(m, device=device, dtype=torch.int32)
        ks = torch.zeros_like(rows)
        ke = torch.full_like(rows, n) if window == "full" else (rows + 1).clamp(max=n)
        args = (q, k, k_scale, weights, ks, ke)
        pairs = int((ke - ks).clamp(0, n).sum())  # host read at set-up only
        yield Problem(
            case=spec.name,
            shape=f"M={m} N={n} H={H} D={D} {window}",
            impls=op_peers(spec, args, device),
            bytes=nbytes(q, k, k_scale, weights, ks, ke) + m * n * 4,
            flops=2 * pairs * H * D,
            bound="compute",
            peak_dtype=FP8,
            note="flops count only the (query, key) pairs inside the windows",
        )


# (tokens, scale format)
@bench_case("indexer_k_quant_and_cache", Shapes(
    default=((8192, "ue8m0"),),
    full=((128, "ue8m0"), (8192, "ue8m0"), (8192, None)),
    cpu=((256, "ue8m0"), (256, None)),
))
def indexer_k_quant_and_cache(device: torch.device, shapes: tuple):
    spec, case = get_op("indexer_k_quant_and_cache"), case_for("indexer_k_quant_and_cache")
    for t, fmt in shapes:
        params = {"T": t, "D": D, "groups": 1, "block_size": 64, "dtype": torch.bfloat16, "scale_fmt": fmt, "strided_cache": False}
        args = case.inputs(params, device, seed=0)
        k, _, slots, _, _ = args
        yield Problem(
            case=spec.name,
            shape=f"T={t} D={D} bs=64 bf16 {fmt or 'f32'} scales",
            impls=op_peers(spec, args, device),
            bytes=nbytes(k, slots) + t * (D + 4),
        )


# (requests, max sequence length)
@bench_case("cp_gather_indexer_k_quant_cache", Shapes(
    default=((8, 8192),),
    full=((8, 8192), (64, 2048)),
    cpu=((4, 256),),
))
def cp_gather_indexer_k_quant_cache(device: torch.device, shapes: tuple):
    spec, case = get_op("cp_gather_indexer_k_quant_cache"), case_for("cp_gather_indexer_k_quant_cache")
    for b, max_seq in shapes:
        params = {"B": b, "max_seq": max_seq, "block_size": 64, "D": D, "groups": 1, "extra_cols": 0, "row_offset": 0, "strided_cache": False}
        args = case.inputs(params, device, seed=0)
        _, _, _, table, cu = args
        tokens = int(cu[-1])  # host read at set-up only
        yield Problem(
            case=spec.name,
            shape=f"B={b} tokens={tokens} D={D} bs=64",
            impls=op_peers(spec, args, device),
            bytes=2 * tokens * (D + 4) + nbytes(table, cu),
        )


# (tokens, requests, max blocks per request, K)
@bench_case("req_local_to_global_slots", Shapes(
    default=((512, 64, 512, 2048),),
    full=((512, 64, 512, 2048), (8192, 4, 2048, 2048)),
    cpu=((64, 4, 64, 256),),
))
def req_local_to_global_slots(device: torch.device, shapes: tuple):
    spec, case = get_op("req_local_to_global_slots"), case_for("req_local_to_global_slots")
    for t, b, mb, k in shapes:
        params = {"T": t, "B": b, "K": k, "block_size": 64, "max_blocks": mb}
        args = case.inputs(params, device, seed=0)
        req, _, idx, _ = args
        yield Problem(
            case=spec.name,
            shape=f"T={t} K={k} B={b} bs=64",
            impls=op_peers(spec, args, device),
            bytes=nbytes(req, idx) + idx.numel() * 4,
        )


# fp8_paged_mqa_logits_tune candidates (BLOCK_N, num_warps, num_stages), next to the
# default (plan.PAGED_CONFIG): the earlier num_stages=3 (two tile buffers), 7 (Triton 3.9 makes
# 3 buffers for 5 and 6, 4 for 7; fewer CTAs fit), 8 warps (two MMA warpgroups per key
# tile, fewer CTAs), and 64-key tiles (half the bytes per tile, more CTAs).
PAGED_TUNE = [(128, 4, 3), (128, 4, 7), (128, 8, 5), (64, 4, 5)]


# next_n; full sweep only (a tuning sweep) and GPU only (it times the Triton kernel directly).
@bench_case("fp8_paged_mqa_logits_tune", Shapes(default=(), full=(1, 2), cpu=None))
def fp8_paged_mqa_logits_tune(device: torch.device, shapes: tuple):
    """Launch configurations of the paged-logits kernel at the target shape (graphsafe only)."""
    from graphsafe.ops.indexer import plan
    from graphsafe.ops.indexer import triton as backend

    for next_n in shapes:
        args = paged_inputs(128, 32768, next_n, device)
        q, cache, weights, lens, table, length = args
        out = torch.empty((128 * next_n, length), dtype=torch.float32, device=device)
        d = plan.PAGED_CONFIG["cuda"]
        impls = {
            f"default {d['BLOCK_N']}/w{d['num_warps']}/s{d['num_stages']}": lambda: backend.paged_mqa_logits_into(out, *args)
        }
        for block_n, warps, stages in PAGED_TUNE:
            cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            impls[f"{block_n}/w{warps}/s{stages}"] = lambda cfg=cfg: backend.paged_mqa_logits_into(out, *args, config=cfg)
        yield Problem(
            case="fp8_paged_mqa_logits_tune",
            shape=f"B=128 ctx=32768 H={H} D={D} next_n={next_n} bs=64",
            impls=impls,
            bytes=128 * 32768 * (D + 4) + 128 * next_n * 32768 * 4 + nbytes(q, weights, lens, table),
        )
        del args, q, cache, weights, lens, table, out


def decode_step_inputs(batch: int, ctx: int, next_n: int, topk: int, device: torch.device):
    """One decode step of `sparse_attn_indexer_decode`: every request holds `ctx` tokens,
    the last `next_n` of them new (their keys are written again at every call)."""
    q, cache, weights, lens, table, length = paged_inputs(batch, ctx, next_n, device)
    gen = _gen(device, 1)
    t = batch * next_n
    pos = (lens.long()[:, None] - next_n + torch.arange(next_n, device=device)[None, :])
    slots = (table.long().gather(1, pos // 64) * 64 + pos % 64).reshape(t)
    k = torch.randn((t, D), device=device, generator=gen).to(torch.bfloat16)
    idx = torch.empty((t, topk), dtype=torch.int32, device=device)
    return (cache, q.view(t, H, D), k, weights, slots, lens, table, idx, "ue8m0", topk, length, next_n, t)


# (batch, ctx, topk)
@bench_case("sparse_attn_indexer_decode", Shapes(
    default=((128, 32768, 2048),),
    full=((32, 32768, 2048), (128, 32768, 2048)),
    cpu=((2, 512, 64),),
))
def sparse_attn_indexer_decode(device: torch.device, shapes: tuple):
    spec = get_op("sparse_attn_indexer_decode")
    for batch, ctx, topk in shapes:
        args = decode_step_inputs(batch, ctx, 1, topk, device)
        cache, q, k, weights, slots, lens, table, idx = args[:8]
        yield Problem(
            case=spec.name,
            shape=f"B={batch} ctx={ctx} H={H} D={D} next_n=1 topk={topk} bs=64",
            impls=op_peers(spec, args, device),
            # The keys read once, the new keys written, the indices written: a fused kernel
            # needs no logits round trip (this composite writes and reads them once).
            bytes=batch * ctx * (D + 4) + nbytes(q, k, weights, slots, lens, table, idx) + k.shape[0] * (D + 4),
            flops=2 * batch * ctx * H * D,
            note="bytes leave out the logits round trip ([B, ctx] f32 written and read by the top-k)",
        )
        del args, cache, q, k, weights, slots, lens, table, idx
