"""Benchmarks of the DeepSeek-V4 ops.

`dsv4_sparse_attn`: decode at DeepSeek-V4's shapes: T requests of one token, H heads (64:
Flash, 128: Pro), a window of `W` (128) slots of the SWA cache (64-token blocks) and `K2`
entries of the compressed cache (the indexer's top-k: 512 Flash, 1024 Pro; K2 = 0 is a
window-only layer), both caches of fp8_dsv4 records (`graphsafe.formats.fp8_dsv4`, 584 bytes
a key) in blocks padded to 576 bytes as vLLM allocates them. Each request's entries are
distinct slots of its own region of each cache. Peer: FlashMLA's MODEL1 sparse decode
(`flash_mla.flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=, topk_length=,
attn_sink=, extra_k_cache=, extra_indices_in_kvcache=, extra_topk_length=)`) on the same
bytes, where `import flash_mla` works (64 or 128 heads); the note gives its largest
difference from graphsafe's out and lse.

Bytes = every key's record read once + q + out + lse + indices; flops = 2 * H * keys *
(512 + 512) per query.

`dsv4_tune` (full sweep, GPU only): the Triton kernel's tiles and split counts at the
decode shapes, for picking `plan.tiles` on a new GPU.
"""

from __future__ import annotations

import torch

from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.formats import fp8_dsv4
from graphsafe.registry import get_op

D = 512
BLOCK_SIZE = 64
RIDGE_FLOPS_PER_BYTE = 230
QUANT_CHUNK_ROWS = 1 << 16


def record_cache(num_rows: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A cache of `num_rows` random tokens (rounded up to whole 64-token blocks, vLLM's padded
    block stride), quantised on the device in chunks of whole blocks
    (`fp8_dsv4.quantize_tokens`) and written through the cache's block views.

    Not through `view.reshape(-1, 576)`: with the padded stride (37440 bytes a block, not
    64 * 576) that reshape is a copy, and writing it left the cache uninitialised (the
    FlashMLA comparisons then ran on whatever bytes the allocator handed back)."""
    nb = -(-num_rows // BLOCK_SIZE)
    cache = fp8_dsv4.empty_cache(nb, BLOCK_SIZE, device)
    data, scales = fp8_dsv4.block_views(cache)
    chunk = QUANT_CHUNK_ROWS // BLOCK_SIZE
    for b0 in range(0, nb, chunk):
        b1 = min(b0 + chunk, nb)
        d, s = fp8_dsv4.quantize_tokens(torch.randn(((b1 - b0) * BLOCK_SIZE, D), generator=gen, device=device))
        data[b0:b1] = d.view(b1 - b0, BLOCK_SIZE, fp8_dsv4.DATA_BYTES)
        scales[b0:b1] = s.view(b1 - b0, BLOCK_SIZE, fp8_dsv4.SCALE_BYTES)
    return cache


def _own_slots(tokens: int, k: int, region: int, device, gen) -> torch.Tensor:
    """`[tokens, k]` int32: k distinct slots of each token's own `region` slots."""
    order = torch.rand((tokens, region), generator=gen, device=device).argsort(dim=1)[:, :k]
    return (order + torch.arange(tokens, device=device)[:, None] * region).to(torch.int32)


def decode_inputs(tokens: int, heads: int, window: int, extra_topk: int, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((tokens, heads, D), generator=gen, device=device).to(torch.bfloat16)
    swa = record_cache(tokens * window, device, gen)
    idx = _own_slots(tokens, window, window, device, gen)
    sink = torch.randn(heads, generator=gen, device=device)
    length = torch.full((tokens,), window, dtype=torch.int32, device=device)
    if extra_topk == 0:
        return q, swa, idx, D**-0.5, sink, length, None, None, None
    region = 4 * extra_topk
    comp = record_cache(tokens * region, device, gen)
    xidx = _own_slots(tokens, extra_topk, region, device, gen)
    xlength = torch.full((tokens,), extra_topk, dtype=torch.int32, device=device)
    return q, swa, idx, D**-0.5, sink, length, comp, xidx, xlength


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def flashmla_peer(args: tuple, graphsafe_out: tuple) -> tuple[dict, str]:
    """FlashMLA's MODEL1 sparse decode on the same caches and indices, where `import
    flash_mla` works: ({label: call}, note)."""
    try:
        import flash_mla
    except ImportError as exc:
        return {}, f"FlashMLA not importable ({exc}): no peer row"
    q, swa, idx, scale, sink, length, comp, xidx, xlength = args
    t, h, _ = q.shape
    if h not in (64, 128):
        return {}, f"FlashMLA's sparse decode takes 64 or 128 heads, not {h}"
    sched = flash_mla.get_mla_metadata()[0]

    def call():
        return flash_mla.flash_mla_with_kvcache(
            q[:, None], swa.unsqueeze(-2), None, None, D, sched, softmax_scale=scale, is_fp8_kvcache=True,
            indices=idx[:, None], attn_sink=sink, topk_length=length,
            extra_k_cache=None if comp is None else comp.unsqueeze(-2),
            extra_indices_in_kvcache=None if xidx is None else xidx[:, None], extra_topk_length=xlength)

    try:
        out, lse = call()
    except Exception as exc:  # noqa: BLE001 - a peer that refuses the shape: no row, say why
        return {}, f"FlashMLA refused: {exc}"
    note = (f"FlashMLA model1 vs graphsafe: max |out| diff {_max_diff(out[:, 0], graphsafe_out[0]):.3g}, "
            f"max |lse| diff {_max_diff(lse.reshape(t, h), graphsafe_out[1]):.3g}")
    return {"FlashMLA model1": call}, note


def _problem(spec, args, device, tokens, heads, window, extra_topk) -> Problem:
    keys = window + extra_topk
    q = args[0]
    out_bytes = tokens * heads * (D * 2 + 4)
    total = tokens * keys * fp8_dsv4.TOKEN_BYTES + nbytes(q) + out_bytes + nbytes(args[2], args[7])
    flops = 2 * tokens * heads * keys * (D + D)
    return Problem(
        case=spec.name, shape=f"T={tokens} H={heads} W={window} K2={extra_topk} fp8_dsv4", impls=op_peers(spec, args, device),
        bytes=total, flops=flops, bound="compute" if flops / total > RIDGE_FLOPS_PER_BYTE else "memory",
    )


# (tokens, heads, window, extra_topk)
@bench_case("dsv4_sparse_attn", Shapes(
    default=((64, 64, 128, 512), (64, 128, 128, 1024), (1, 64, 128, 512)),
    full=tuple((t, h, 128, k2) for t in (1, 32, 64, 128) for h, k2 in ((64, 512), (128, 1024), (64, 0), (128, 0))),
    cpu=((2, 16, 32, 32),),
))
def dsv4_sparse_attn(device: torch.device, shapes: tuple):
    spec = get_op("dsv4_sparse_attn")
    for tokens, heads, window, extra_topk in shapes:
        args = decode_inputs(tokens, heads, window, extra_topk, device)
        problem = _problem(spec, args, device, tokens, heads, window, extra_topk)
        if device.type == "cuda":
            peers, note = flashmla_peer(args, spec.public(*args))
            problem.impls.update(peers)
            problem.note = note
        yield problem
        del args, problem


# Candidate tiles (block_h, block_n, num_warps, num_stages).
TUNE_TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2), (64, 32, 8, 1), (64, 16, 8, 2)]


@bench_case("dsv4_tune", Shapes(
    default=(),
    full=((64, 64, 128, 512), (64, 128, 128, 1024), (1, 64, 128, 512)),
    cpu=None,
))
def dsv4_tune(device: torch.device, shapes: tuple):
    """The chosen kernel (the Gluon kernel on sm_90) at other split counts (10 at K + K2 = 640
    is one 64-key tile a split), and the Triton kernel's tiles, at the decode shapes
    (graphsafe only)."""
    from graphsafe.ops.dsv4 import plan as dsv4_plan
    from graphsafe.ops.dsv4 import triton as backend
    from graphsafe.ops.dsv4.plan import Dsv4Tiles

    spec = get_op("dsv4_sparse_attn")
    for tokens, heads, window, extra_topk in shapes:
        args = decode_inputs(tokens, heads, window, extra_topk, device)
        choice = dsv4_plan.choose(spec.call(*args))
        impls = {f"default: {choice.describe()}": lambda: backend.dsv4_sparse_attn(*args)}
        for n in (1, 2, 3, 4, 5, 8, 10, 16):
            impls[f"{choice.kernel}, splits {n}"] = lambda n=n: backend.dsv4_sparse_attn(*args, num_splits=n)
        for t in TUNE_TILES:
            c = Dsv4Tiles(*t)
            impls[f"triton tiles {t}"] = lambda c=c: backend.dsv4_sparse_attn(*args, config=c)
        problem = _problem(spec, args, device, tokens, heads, window, extra_topk)
        problem.case, problem.impls = "dsv4_tune", impls
        problem.shape += f" (plan S={choice.plan.num_splits})"
        yield problem
        del args
