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
# (sequences, tokens each, Hq, Hk, D, Dv) of the causal prefill problems: GQA, MHA, MLA
# prefill; by default the GQA one (the NOTES row).
VARLEN_SHAPES = Shapes(
    default=((8, 4096, 32, 8, 128, 128),),
    full=((8, 4096, 32, 8, 128, 128), (8, 4096, 32, 32, 128, 128), (8, 4096, 16, 16, 192, 128)),
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
# the default (`triton.varlen_config`: on Hopper 64 x 128 / 4 warps / 3 stages at
# D <= 128, 64 x 64 at D = 192, two CTAs per SM) on fp8 inputs: the earlier default of
# one CTA of 128 x 128 tiles per SM, and 128 x 64.
FP8_CONFIG_VARIANTS = {128: [(128, 128, 8, 3), (128, 64, 8, 3)], 192: [(128, 128, 8, 2), (128, 64, 8, 3)]}


def _fp8_impls(public, q, k, v, cu, n: int, scale: float) -> dict:
    """graphsafe's fp8 path quantising inside the op (bf16 in and out), on pre-quantised
    fp8 inputs (also with other tile configs), the quantisation launches alone, and the
    bf16 path for the ratio."""
    from graphsafe.ops.attention import triton as T
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
            *T.varlen_workspace_specs(tq, tk, hq, hk, d, dv, quantize=True), owner="bench"
        )
        quantise(q, k, v, cu, out, k8w, vt, scales)

    impls["fp8 quantisation launches only"] = quantise_only
    return impls


@bench_case("flash_attn_varlen", VARLEN_SHAPES)
def flash_attn_varlen(device: torch.device, shapes: tuple):
    """bf16 against SDPA / flex_attention; and (GPU only: it times the Triton kernels
    directly) the fp8 path."""
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
