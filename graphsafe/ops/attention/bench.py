"""Benchmarks of the GQA attention ops against SDPA and flex_attention on the same inputs.

Inputs are drawn on the device (the caches at B=128, ctx=32k are 17 GB: too big to draw
on the CPU). The reference peers run only where their float32 intermediates fit; the
problem's note says when they were left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphsafe.bench import flashinfer
from graphsafe.bench.harness import Problem, Shapes, bench_case
from graphsafe.bench.peers import nbytes, op_peers
from graphsafe.registry import get_op

# Reference peers materialise float32 copies (gathered K/V, padded scores): skip above this.
REFERENCE_BYTES_LIMIT = 10e9
# (B, ctx) of the decode problems at Llama-3-8B shapes (Hq=32, Hk=8, D=128, block 16):
# by default the NOTES anchor B=128 x 32k (its reference peers are skipped: no compile).
DECODE_SHAPES = Shapes(
    default=((128, 32768),),
    full=tuple((b, ctx) for b in (1, 64, 128) for ctx in (4096, 32768)),
    cpu=((2, 256),),
)
# (sequences, tokens each, Hq, Hk, D, Dv) of the causal prefill problems: GQA (Llama-3-8B)
# at 2K, 4K (the NOTES row) and 8K tokens a sequence and MLA prefill (DeepSeek's D = 192,
# Dv = 128, 16 heads a rank) by default; MHA and gpt-oss's D = 64 in the full sweep.
_DEFAULT_VARLEN = ((8, 2048, 32, 8, 128, 128), (8, 4096, 32, 8, 128, 128), (4, 8192, 32, 8, 128, 128),
                   (8, 4096, 16, 16, 192, 128))
VARLEN_SHAPES = Shapes(
    default=_DEFAULT_VARLEN,
    full=(*_DEFAULT_VARLEN, (8, 4096, 32, 32, 128, 128), (8, 4096, 64, 8, 64, 64)),
    cpu=((2, 128, 4, 2, 64, 64),),
)
CPU_NO_COMPILE = "flex_attention left out on the CPU (its compile takes longer than the CPU run)"


def _graphsafe_only(spec, args, device, note_bytes: float) -> tuple[dict, str]:
    if note_bytes <= REFERENCE_BYTES_LIMIT:
        return op_peers(spec, args, device), ""
    impls = op_peers(spec, args, device, compile_reference=False)
    impls.pop("reference eager")
    return impls, f"reference peers skipped: their fp32 intermediates need {note_bytes / 1e9:.0f} GB"


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return create_block_mask, torch.compile(flex_attention, dynamic=False)


# -- paged decode -------------------------------------------------------------------------
def _decode_inputs(b: int, ctx: int, device, hk=8, group=4, d=128, block_size=16, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(0)
    mb = ctx // block_size
    nb = b * mb
    q = torch.randn((b, hk * group, d), device=device, dtype=dtype, generator=gen)
    k_cache = torch.randn((nb, block_size, hk, d), device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn((nb, block_size, hk, d), device=device, dtype=dtype, generator=gen)
    table = torch.randperm(nb, device=device, generator=gen).reshape(b, mb).int()
    lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
    return q, k_cache, v_cache, table, lens, d**-0.5


def _decode_peers(q, k_cache, v_cache, table, lens, scale, device) -> tuple[dict, str]:
    """SDPA and compiled flex_attention over K/V gathered from the cache BEFORE timing."""
    b, _, d = q.shape
    hk = k_cache.shape[2]
    ctx = table.shape[1] * k_cache.shape[1]
    k_dense = k_cache[table.long()].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    v_dense = v_cache[table.long()].reshape(b, ctx, hk, d).transpose(1, 2).contiguous()
    q4 = q[:, :, None, :]
    impls = {
        "SDPA (KV pre-gathered)": lambda: F.scaled_dot_product_attention(
            q4, k_dense, v_dense, scale=scale, enable_gqa=True
        )
    }
    note = "SDPA/flex read K/V gathered into dense tensors outside the timing"
    if device.type == "cpu":
        return impls, f"{note}; {CPU_NO_COMPILE}"
    try:
        create_block_mask, flex = _flex()
        mask = create_block_mask(lambda bi, h, qi, ki: ki < lens[bi], b, None, 1, ctx, device=device)
        impls["flex_attention (compiled)"] = lambda: flex(
            q4, k_dense, v_dense, block_mask=mask, scale=scale, enable_gqa=True
        )
    except Exception as err:  # noqa: BLE001 - reported in the note, not fatal
        note += f"; flex_attention unavailable: {type(err).__name__}: {str(err)[:80]}"
    return impls, note


@bench_case("paged_attention_decode", DECODE_SHAPES)
def paged_attention_decode(device: torch.device, shapes: tuple):
    spec = get_op("paged_attention_decode")
    for b, ctx in shapes:
        args = _decode_inputs(b, ctx, device)
        q, k_cache, v_cache, table, lens, _ = args
        hq, hk, d = q.shape[1], k_cache.shape[2], q.shape[2]
        impls, note = _graphsafe_only(spec, args, device, 2 * b * ctx * hk * 2 * d * 4)
        fi_impls, fi_note = flashinfer.paged_decode_peers(*args, spec.public(*args))
        impls.update(fi_impls)
        peers, peer_note = _decode_peers(*args, device)
        impls.update(peers)
        yield Problem(
            case=spec.name,
            shape=f"B={b} ctx={ctx} Hq={hq} Hk={hk} D={d} bs=16 bf16",
            impls=impls,
            # every cached K/V row of each request once, q, the tables, the output
            bytes=b * ctx * hk * 2 * d * k_cache.element_size() + nbytes(q, table, lens) + nbytes(q),
            flops=4 * b * hq * ctx * d,
            note="; ".join(x for x in (note, fi_note, peer_note) if x),
        )
        del impls, peers, fi_impls, args, q, k_cache, v_cache, table, lens


# -- varlen prefill -----------------------------------------------------------------------
def _causal_pairs(seqs: int, n: int) -> int:
    return seqs * n * (n + 1) // 2


def _sdpa_flash(q4, k4, v4, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)


def _varlen_peers(q, k, v, seqs: int, n: int, scale: float, device) -> tuple[dict, str]:
    """SDPA (flash backend) on the dense batch (all lengths equal) and compiled
    flex_attention with a causal block mask."""
    hq, d, hk, dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    q4 = q.view(seqs, n, hq, d).transpose(1, 2)
    k4 = k.view(seqs, n, hk, d).transpose(1, 2)
    v4 = v.view(seqs, n, hk, dv).transpose(1, 2)
    notes = []
    k_sdpa, v_sdpa = k4, v4
    if hk != hq:  # FlashAttention-2 in SDPA takes no GQA: expand K/V heads before timing
        k_sdpa, v_sdpa = (x.repeat_interleave(hq // hk, dim=1) for x in (k4, v4))
        notes.append("SDPA gets K/V heads expanded outside the timing")
    if dv != d:  # FlashAttention-2 needs Dv == D: pad V (the vLLM MLA-prefill workaround)
        v_sdpa = F.pad(v_sdpa, (0, d - dv))
        notes.append(f"SDPA gets V padded to {d}")
    impls = {"SDPA flash": lambda: _sdpa_flash(q4, k_sdpa, v_sdpa, scale)}
    if device.type == "cpu":
        return impls, "; ".join([*notes, CPU_NO_COMPILE])
    try:
        create_block_mask, flex = _flex()
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=device)
        impls["flex_attention (compiled)"] = lambda: flex(q4, k4, v4, block_mask=mask, scale=scale, enable_gqa=hk != hq)
    except Exception as err:  # noqa: BLE001
        notes.append(f"flex_attention unavailable: {type(err).__name__}: {str(err)[:80]}")
    return impls, "; ".join(notes)


# Alternative fp8 tile configs (BLOCK_M, BLOCK_N, num_warps, num_stages) timed next to
# the default (`plan.varlen_config`: on Hopper 64 x 128 / 4 warps / 3 stages at
# D <= 128, 64 x 64 at D = 192, two CTAs per SM) on fp8 inputs: the earlier default of
# one CTA of 128 x 128 tiles per SM, and 128 x 64.
FP8_CONFIG_VARIANTS = {128: [(128, 128, 8, 3), (128, 64, 8, 3)], 192: [(128, 128, 8, 2), (128, 64, 8, 3)]}


def _fp8_impls(public, q, k, v, cu, n: int, scale: float) -> dict:
    """graphsafe's fp8 path quantising inside the op (bf16 in and out), on pre-quantised
    fp8 inputs (also with other tile configs), the quantisation launches alone, and the
    bf16 path for the ratio."""
    from graphsafe.ops.attention import plan, triton as T
    from graphsafe.ops.attention.fp8 import quantize_per_tensor
    from graphsafe.workspace import current_workspace_manager

    (q8, qd), (k8, kd), (v8, vd) = (quantize_per_tensor(x) for x in (q, k, v))
    impls = {
        "graphsafe fp8 (bf16 in)": lambda: public(q, k, v, cu, cu, n, n, scale, True, None, None, None, "on"),
        "graphsafe fp8 (fp8 in)": lambda: public(q8, k8, v8, cu, cu, n, n, scale, True, qd, kd, vd),
        "graphsafe bf16": lambda: public(q, k, v, cu, cu, n, n, scale, True, None, None, None, "off"),
    }
    for config in FP8_CONFIG_VARIANTS.get(q.shape[2], []):
        impls[f"graphsafe fp8 (fp8 in) tiles {config}"] = (
            lambda c=config: T.flash_attn_varlen(q8, k8, v8, cu, cu, n, n, scale, True, qd, kd, vd, config=c)
        )
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    out = torch.empty((tq, hq, dv), dtype=q.dtype, device=q.device)

    quantise = T.prepare_fp8_quantisation(q, k, v, cu)  # the op's own launches, bound once

    def quantise_only():
        """The three launches before the attention kernel (workspace as in the op)."""
        vt, k8w, scales = current_workspace_manager(q.device).get_simultaneous(
            *plan.varlen_scratch(tq, tk, hq, hk, d, dv, quantize=True), owner="bench"
        )
        quantise(q, k, v, cu, out, k8w, vt, scales)

    impls["fp8 quantisation launches only"] = quantise_only
    return impls


def _with_triton_kernel_row(impls: dict, args: tuple, d: int, dv: int, n: int) -> dict:
    """`impls` with "graphsafe triton kernel" right after the first (default) row: the
    bf16/fp16 Triton kernel with its own tiles (the kernel the Gluon one replaces on
    sm_90; elsewhere the default row runs it too), its runner prepared once as the op's is."""
    from graphsafe.ops.attention import plan, triton as T

    call = get_op("flash_attn_varlen").call(*args[:9])
    runner = T.bind_flash_attn_varlen(call, plan.choose_flash_attn_varlen(call, plan.varlen_config(args[0].device, d, dv,
                                                                                                    False, n)))
    (first, run_first), *rest = impls.items()
    return {first: run_first, "graphsafe triton kernel": lambda: runner(*args[:9]), **dict(rest)}


@bench_case("flash_attn_varlen", VARLEN_SHAPES)
def flash_attn_varlen(device: torch.device, shapes: tuple):
    """bf16 against SDPA / flex_attention and, on a GPU, the bf16/fp16 Triton kernel with
    its own tiles (which the default path replaces on sm_90); then (GPU only: it times the
    Triton kernels directly) the fp8 path."""
    spec = get_op("flash_attn_varlen")
    for seqs, n, hq, hk, d, dv in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        t = seqs * n
        q = torch.randn((t, hq, d), device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn((t, hk, d), device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn((t, hk, dv), device=device, dtype=torch.bfloat16, generator=gen)
        cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * n
        scale = d**-0.5
        flops = 2 * _causal_pairs(seqs, n) * hq * (d + dv)
        io_bytes = nbytes(q, k, v) + t * hq * dv * 2
        label = f"{seqs}x{n} Hq={hq} Hk={hk} D={d}/{dv} causal"

        args = (q, k, v, cu, cu, n, n, scale, True, None, None, None, "off")
        impls, note = _graphsafe_only(spec, args, device, seqs * hq * n * n * 4 * 3)
        if device.type == "cuda":
            impls = _with_triton_kernel_row(impls, args, d, dv, n)
        fi_impls, fi_note = flashinfer.ragged_prefill_peers(q, k, v, cu, scale, True, spec.public(*args))
        impls.update(fi_impls)
        peers, peer_note = _varlen_peers(q, k, v, seqs, n, scale, device)
        impls.update(peers)
        gpu_only = "" if device.type == "cuda" else "the fp8 problem needs a GPU: skipped"
        yield Problem(case=spec.name, shape=f"{label} bf16", impls=impls, bytes=io_bytes, flops=flops, bound="compute",
                      peak_dtype=torch.bfloat16, note="; ".join(x for x in (note, fi_note, peer_note, gpu_only) if x))
        del impls, peers, fi_impls
        if device.type != "cuda":
            continue
        yield Problem(case=spec.name, shape=f"{label} fp8", impls=_fp8_impls(spec.public, q, k, v, cu, n, scale),
                      bytes=io_bytes, flops=flops, bound="compute", peak_dtype=torch.float8_e4m3fn,
                      note="fp8 (bf16 in) includes the per-tensor quantisation of q, k, v (amax of q/k/v in "
                           "one pass, k and V^T written once, q quantised per tile in the kernel); "
                           "'quantisation launches only' times that prefix alone (its TFLOP/s is meaningless)")
        del q, k, v, args


# -- paged prefill ------------------------------------------------------------------------
# (sequences, new tokens each, keys each with the new ones, cache block size) at Llama-3-8B
# shapes: by default chunked prefill (512-token chunks after 3.5K cached tokens) in blocks of
# 16 (vLLM's default) and 64; the full set adds prompts with no prefix, a prefix cache hit
# (128 new tokens over 8K), decode-like chunks of 16 tokens (the Triton kernel's 16-row
# packing), and the prefix-cache shape in blocks of 64.
PAGED_PREFILL_SHAPES = Shapes(
    default=((8, 512, 4096, 16), (8, 512, 4096, 64)),
    full=((8, 512, 4096, 16), (8, 512, 4096, 64), (4, 2048, 2048, 16), (32, 128, 8192, 16), (32, 128, 8192, 64),
          (64, 16, 4096, 16)),
    cpu=((2, 16, 64, 16),),
)


def _paged_prefill_inputs(b: int, n: int, ctx: int, device, hk=8, group=4, d=128, block_size=16,
                          dtype=torch.bfloat16, causal=True, window_left=-1, softcap=0.0, sinks=False):
    q, k_cache, v_cache, table, lens, scale = _decode_inputs(b, ctx, device, hk, group, d, block_size, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn((b * n, hk * group, d), device=device, dtype=dtype, generator=gen)
    cu = torch.arange(b + 1, device=device, dtype=torch.int32) * n
    sink = torch.randn(hk * group, device=device, generator=gen) if sinks else None
    return q, k_cache, v_cache, table, lens, cu, n, scale, causal, None, None, window_left, softcap, sink


def _visible_pairs(b: int, n: int, ctx: int, window_left: int) -> int:
    """(query, key) pairs a causal prefill of n queries over ctx keys computes, per head."""
    positions = torch.arange(ctx - n, ctx, dtype=torch.int64)
    first = (positions - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(positions)
    return b * int((positions + 1 - first).sum())


def _gathered_varlen(args):
    """What a user without the op runs: gather each sequence's K/V out of the cache, then
    `flash_attn_varlen` over the packed copy (both inside the timing)."""
    from graphsafe import flash_attn_varlen

    q, k_cache, v_cache, table, lens, cu, n, scale, causal = args[:9]
    b, ctx = table.shape[0], table.shape[1] * k_cache.shape[1]
    cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * ctx

    def run():
        k = k_cache[table.long()].reshape(b * ctx, *k_cache.shape[2:])
        v = v_cache[table.long()].reshape(b * ctx, *v_cache.shape[2:])
        return flash_attn_varlen(q, k, v, cu, cu_k, n, ctx, scale, causal, None, None, None, "off", *args[11:])

    return run


def _paged_triton_kernel(args):
    """The paged prefill's Triton kernel with its own tiles (what the sm_90 Gluon kernel
    replaces), its runner prepared once as the op's is; None where the op runs it anyway."""
    from graphsafe.ops.attention import plan, triton as T

    call = get_op("paged_attention_prefill").call(*args)
    choice = plan.choose_paged_attention_prefill(call)
    if choice.gluon is None:
        return None
    runner = T.bind_paged_attention_prefill(call, plan.choose_paged_attention_prefill(call, choice.config))
    return lambda: runner(*args)


def _paged_prefill_problem(spec, args, device, label: str) -> Problem:
    q, k_cache, v_cache, table, lens, cu, n, scale, causal = args[:9]
    window_left, softcap, sinks = args[11:]
    b, ctx = table.shape[0], table.shape[1] * k_cache.shape[1]
    hq, hk, d, dv = q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3]
    impls, note = _graphsafe_only(spec, args, device, b * hq * n * ctx * 4 * 3)
    if device.type == "cuda" and (triton_kernel := _paged_triton_kernel(args)) is not None:
        (first, run_first), *rest = impls.items()
        impls = {first: run_first, "graphsafe triton kernel": triton_kernel, **dict(rest)}
    impls["graphsafe gather + flash_attn_varlen"] = _gathered_varlen(args)
    fi_impls, fi_note = {}, "flashinfer: no sinks in its paged prefill wrapper" if sinks is not None else ""
    if sinks is None:
        fi_impls, fi_note = flashinfer.paged_prefill_peers(*args[:6], scale, causal, spec.public(*args),
                                                           window_left, softcap)
    impls.update(fi_impls)
    first = max(0, ctx - n - window_left) if window_left >= 0 else 0
    flops = 2 * _visible_pairs(b, n, ctx, window_left) * hq * (d + dv)
    kv_bytes = b * (ctx - first) * hk * (d + dv) * k_cache.element_size()
    return Problem(case=spec.name, shape=label, impls=impls, bytes=kv_bytes + nbytes(q, table, lens, cu) + nbytes(q),
                   flops=flops, bound="compute", peak_dtype=torch.bfloat16,
                   note="; ".join(x for x in (note, fi_note) if x))


@bench_case("paged_attention_prefill", PAGED_PREFILL_SHAPES)
def paged_attention_prefill(device: torch.device, shapes: tuple):
    """Causal prefill chunks over the paged cache: against the gather + varlen workaround,
    the reference and FlashInfer's paged prefill."""
    spec = get_op("paged_attention_prefill")
    for b, n, ctx, block_size in shapes:
        args = _paged_prefill_inputs(b, n, ctx, device, block_size=block_size)
        yield _paged_prefill_problem(spec, args, device,
                                     f"{b}x{n} new over ctx={ctx} Hq=32 Hk=8 D=128 bs={block_size} bf16")
        del args


# -- the attention variants ---------------------------------------------------------------
# gpt-oss-120b (TP1): Hq 64, Hk 8, D 64, sinks on every layer, a 128-token window on half of
# them; Gemma-2-9B: Hq 16, Hk 8, D 256, logit softcap 50. Each variant row next to the same
# shape without it (the default path), so the variant's cost or saving shows.
VARIANT_SHAPES = Shapes(default=("gpt-oss",), full=("gpt-oss", "gemma-2"), cpu=("tiny",))
_VARIANT_MODELS = {  # hk, group, d, window_left, softcap, (decode B, ctx), (prefill seqs, tokens)
    "gpt-oss": (8, 8, 64, 127, 0.0, (64, 8192), (8, 4096)),
    "gemma-2": (8, 2, 256, 4095, 50.0, (64, 8192), (4, 4096)),
    "tiny": (2, 2, 32, 15, 5.0, (2, 128), (2, 64)),
}


def _decode_variant_problem(spec, device, model: str, window_left: int, softcap: float, sinks: bool) -> Problem:
    hk, group, d = _VARIANT_MODELS[model][:3]
    b, ctx = _VARIANT_MODELS[model][5]
    q, k_cache, v_cache, table, lens, scale = _decode_inputs(b, ctx, device, hk, group, d)
    sink = torch.randn(hk * group, device=device) if sinks else None
    args = (q, k_cache, v_cache, table, lens, scale, None, None, window_left, softcap, sink)
    impls, note = _graphsafe_only(spec, args, device, 2 * b * ctx * hk * 2 * d * 4)
    keys = min(ctx, window_left + 1) if window_left >= 0 else ctx
    fi_note = "flashinfer: no sinks in its decode wrapper"
    if not sinks:
        fi_impls, fi_note = flashinfer.paged_decode_peers(*args[:6], spec.public(*args), window_left, softcap)
        impls.update(fi_impls)
    label = (f"{model} B={b} ctx={ctx} Hq={hk * group} Hk={hk} D={d} window={window_left} softcap={softcap:g} "
             f"sinks={'yes' if sinks else 'no'}")
    return Problem(case=spec.name, shape=label, impls=impls,
                   bytes=b * keys * hk * 2 * d * k_cache.element_size() + nbytes(q, table, lens) + nbytes(q),
                   flops=4 * b * hk * group * keys * d, note="; ".join(x for x in (note, fi_note) if x))


def _varlen_variant_problem(spec, device, model: str, window_left: int, softcap: float, sinks: bool) -> Problem:
    hk, group, d = _VARIANT_MODELS[model][:3]
    seqs, n = _VARIANT_MODELS[model][6]
    hq = hk * group
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((seqs * n, hq, d), device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((seqs * n, hk, d), device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * n
    sink = torch.randn(hq, device=device, generator=gen) if sinks else None
    args = (q, k, v, cu, cu, n, n, d**-0.5, True, None, None, None, "off", window_left, softcap, sink)
    impls, note = _graphsafe_only(spec, args, device, seqs * hq * n * n * 4 * 3)
    fi_note = "flashinfer: no sinks in its ragged prefill wrapper"
    if not sinks:
        fi_impls, fi_note = flashinfer.ragged_prefill_peers(q, k, v, cu, d**-0.5, True, spec.public(*args),
                                                            window_left, softcap)
        impls.update(fi_impls)
    flops = 2 * _visible_pairs(seqs, n, n, window_left) * hq * 2 * d
    label = (f"{model} {seqs}x{n} Hq={hq} Hk={hk} D={d} causal window={window_left} softcap={softcap:g} "
             f"sinks={'yes' if sinks else 'no'}")
    return Problem(case=spec.name, shape=label, impls=impls, bytes=nbytes(q, k, v) + nbytes(q), flops=flops,
                   bound="compute", note="; ".join(x for x in (note, fi_note) if x))


def _sparse_options_problem(device) -> Problem:
    """DeepSeek-V3.2 sparse decode at T = 128, H = 128, K = 2048 with FlashMLA's options:
    a sink per head and per-token lengths drawn in [K/2, K] (bytes count the keys read)."""
    from graphsafe.ops.mla.bench import sparse_inputs

    spec = get_op("sparse_mla")
    tokens, heads, topk = (128, 128, 2048) if device.type == "cuda" else (4, 16, 64)
    q, kv_cache, indices, scale, rank = sparse_inputs(tokens, heads, topk, device, region=4 * topk)
    gen = torch.Generator(device=device).manual_seed(2)
    length = torch.randint(topk // 2, topk + 1, (tokens,), device=device, generator=gen, dtype=torch.int32)
    sink = torch.randn(heads, device=device, generator=gen)
    args = (q, kv_cache, indices, scale, rank, sink, length)
    keys = int(length.sum())
    row = kv_cache.shape[-1] * kv_cache.element_size()
    return Problem(case=spec.name, shape=f"T={tokens} H={heads} K={topk} attn_sink + topk_length in [K/2, K]",
                   impls=op_peers(spec, args, device), bytes=keys * row + nbytes(q, indices) + nbytes(q),
                   flops=2 * heads * keys * (q.shape[-1] + rank))


@bench_case("attention_variants", VARIANT_SHAPES)
def attention_variants(device: torch.device, shapes: tuple):
    """Sliding window, softcap and sinks on paged decode, varlen and paged prefill, each next
    to the same shape without them; sparse_mla with attn_sink and topk_length."""
    decode, varlen, paged = (get_op(n) for n in ("paged_attention_decode", "flash_attn_varlen",
                                                   "paged_attention_prefill"))
    for model in shapes:
        window_left, softcap = _VARIANT_MODELS[model][3:5]
        sinks = model != "gemma-2"
        plain = dict(window_left=-1, softcap=0.0, sinks=False)
        variant = dict(window_left=window_left, softcap=softcap, sinks=sinks)
        for options in (plain, variant):
            yield _decode_variant_problem(decode, device, model, **options)
        for options in (plain, variant):
            yield _varlen_variant_problem(varlen, device, model, **options)
        hk, group, d = _VARIANT_MODELS[model][:3]
        b, n = (8, 512) if device.type == "cuda" else (2, 16)
        ctx = 4096 if device.type == "cuda" else 64
        for options in (plain, variant):
            args = _paged_prefill_inputs(b, n, ctx, device, hk, group, d, **options)
            yield _paged_prefill_problem(paged, args, device, f"{model} {b}x{n} new over ctx={ctx} Hq={hk * group} "
                                         f"Hk={hk} D={d} window={args[11]} softcap={args[12]:g} "
                                         f"sinks={'yes' if args[13] is not None else 'no'}")
    yield _sparse_options_problem(device)
