"""Triton backend of the GQA attention ops: per-signature runners, configs and scratch.

Kernels live in `_triton_decode.py` (paged decode + split combine), `_triton_prefill.py`
(varlen FlashAttention-2 forward) and `_triton_quant.py` (fp8 quantisation). The
`prepare_*` functions run once per call signature (the registry keeps their runners):
plans, tile configs, grids, workspace specs and every launch are bound there
(`graphsafe.launch.bind`). A runner allocates the output, takes its scratch from the
workspace manager and calls the bound launches with tensors only. Every host int comes
from shapes or arguments.
"""

from __future__ import annotations

import torch

from graphsafe.device_info import compute_capability
from graphsafe.ops.attention.fake import FP8, output_dtype
from graphsafe.launch import output_allocator
from graphsafe.ops.attention import reference
from graphsafe.ops.attention.kernels.triton_decode import bind_combine, bind_paged_decode
from graphsafe.ops.attention.kernels.triton_prefill import bind_varlen
from graphsafe.ops.attention.kernels.triton_quant import (
    AMAX_Q,
    DESCALE_K,
    DESCALE_Q,
    DESCALE_V,
    EMULATE_FP8_CAST,
    ONE,
    SCALE_SLOTS,
    bind_amax,
    bind_prepare,
    bind_quantize_kv,
    bind_quantize_q,
    vt_columns,
)
from graphsafe.ops.attention.fp8 import fp8_prefill_supported, quantize_inputs
from graphsafe.ops.attention.split_kv import decode_block_n, plan_decode_splits
from graphsafe.ops.attention.wgmma_varlen import (
    bind_wgmma_varlen,
    bind_wgmma_varlen_fp8,
    wgmma_varlen_fits,
    wgmma_varlen_fp8_fits,
)
from graphsafe.workspace import current_workspace_manager

DECODE_OWNER = "paged_attention_decode"
VARLEN_OWNER = "flash_attn_varlen"
# The runners pass `scales` itself as the pointer to q's amax (no view to cut per call).
assert AMAX_Q == 0


def _hopper_or_newer(device: torch.device) -> bool:
    cc = compute_capability(device)
    return cc is not None and cc >= (9, 0)


# -- paged decode -------------------------------------------------------------------------
def decode_config(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 3 stages keep ~3 K/V tiles in flight per program."""
    stages = 3 if device.type == "cuda" and _hopper_or_newer(device) else 2
    return decode_block_n(device), 4, stages


def prepare_paged_attention_decode(
    q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None, window_left=-1, softcap=0.0,
    sinks=None, *, num_splits=None,
):
    """The runner of this call signature: the split plan, the decode launch and (with
    more than one split) the combine launch and the partials' workspace specs, fixed
    here, with the variants (`window_left`, `softcap`, whether there are `sinks`: host
    arguments of the signature) bound into them. A call makes 1 launch, or 2 with
    splits. `num_splits` (tests only) overrides the shape-based plan."""
    b, hq, _ = q.shape
    _, block_size, hk, dv = v_cache.shape
    shape, dtype, device = (b, hq, dv), q.dtype, q.device
    new_out = output_allocator(shape, dtype, device)

    if b == 0 or hq == 0:
        def run_empty(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None,
                      window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    if num_splits is None:
        num_splits = plan_decode_splits(b, hk, block_table.shape[1], block_size, device)
    kv_fp8 = k_cache.dtype.itemsize == 1
    decode = bind_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, num_splits, decode_config(device),
                               window_left, softcap, sinks)
    if num_splits == 1:
        def run(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None,
                window_left=-1, softcap=0.0, sinks=None):
            out = new_out()
            if not kv_fp8:
                k_scale = v_scale = q  # bf16/fp16 caches read no scale: placeholders
            if sinks is None:
                sinks = q  # not read: a placeholder
            decode(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sinks, out, out, out)
            return out

        return run

    specs = (((b, hq, num_splits, dv), torch.float32), ((b, hq, num_splits), torch.float32))
    combine = bind_combine(q, b, hq, dv, num_splits, sinks)

    def run_split(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None,
                  window_left=-1, softcap=0.0, sinks=None):
        out = new_out()
        part_o, part_lse = current_workspace_manager(device).get_simultaneous(*specs, owner=DECODE_OWNER)
        if not kv_fp8:
            k_scale = v_scale = q
        if sinks is None:
            sinks = part_lse  # not read: a placeholder
        decode(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sinks, out, part_o, part_lse)
        combine(part_o, part_lse, sinks, out)
        return out

    return run_split


def paged_attention_decode(
    q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None, window_left=-1, softcap=0.0,
    sinks=None, *, num_splits=None,
):
    """One call, prepared afresh. `num_splits` (tests only) overrides the shape-based plan."""
    args = (q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale, window_left, softcap, sinks)
    return prepare_paged_attention_decode(*args, num_splits=num_splits)(*args)


# -- varlen prefill -----------------------------------------------------------------------
def varlen_config(device: torch.device, d: int, dv: int, fp8: bool, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from shapes and host ints only.

    fp8 on Hopper: 128 x 128 tiles (fp8 wgmma m64n128k32; one CTA of two warpgroups per
    SM at ~255 registers, no spills in the key loop), 3 stages of K and V^T tiles
    (115 KB of shared memory at D = 128; 2 stages at D = 192). bf16/fp16: 128 x 64."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # interpreter: small tiles, so tiny tests cover several blocks
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


def varlen_workspace_specs(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, quantize: bool,
    q_copy: bool = False,
):
    """Scratch of one fp8 call: V^T (fp8, token-contiguous rows padded to 16 tokens), k in
    fp8 when quantising bf16/fp16 inputs, the float32 scale slots
    (`_triton_quant.SCALE_SLOTS`) and, `q_copy`, q in fp8 (the sm_90 Gluon kernel reads q
    from memory; the Triton kernel quantises q tile by tile itself). The bf16/fp16 path
    needs none."""
    specs = [((num_kv_heads, head_dim_v, vt_columns(total_k)), FP8)]
    if quantize:
        specs += [((total_k, num_kv_heads, head_dim), FP8)]
    specs += [((SCALE_SLOTS,), torch.float32)]
    if quantize and q_copy:
        specs += [((total_q, num_q_heads, head_dim), FP8)]
    return specs


def flash_attn_varlen_workspace(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, fp8: bool = True,
):
    """This backend's worst case for one call (the record's `workspace`): the fp8 path
    quantising bf16/fp16 inputs for the sm_90 Gluon kernel, with a q copy (fp8 inputs and
    the Triton kernel need less); nothing when `fp8` is False."""
    if not fp8:
        return []
    return varlen_workspace_specs(total_q, total_k, num_q_heads, num_kv_heads, head_dim, head_dim_v, quantize=True,
                                  q_copy=True)


def prepare_fp8_quantisation(q, k, v, cu_seqlens_q, quantize=True):
    """The fp8 path's launches before the attention kernel, bound to these shapes and
    strides (the op's own runners use it; public for tests and the benchmark).

    Returns `run(q, k, v, cu_seqlens_q, out, k8, vt, scales)`: zeroes the rows of `out`
    (contiguous `[Tq, Hq, Dv]`) past `cu_seqlens_q[B]` and resets `scales` (float32
    `[SCALE_SLOTS]`), one launch; then with `quantize` (bf16/fp16 inputs) the amax of q,
    k and v (one launch) and k, V^T quantised into `k8` (contiguous `[Tk, Hk, D]`) and
    `vt` (contiguous `[Hk, Dv, vt_columns(Tk)]`, one launch); without (fp8 inputs) V^T
    is a transposed copy of v and `k8` is not used (pass None)."""
    tq, hq, _ = q.shape
    prep = bind_prepare(q, cu_seqlens_q.shape[0] - 1, tq, hq * v.shape[2], True)
    to_fp8 = bind_quantize_kv(k, v, quantize)  # None when k and v have no token (or head)
    if not quantize:
        def run_copy(q, k, v, cu_seqlens_q, out, k8, vt, scales):
            prep(out, cu_seqlens_q, scales)
            if to_fp8 is not None:
                to_fp8(k, v, vt, vt, scales)

        return run_copy

    amax = bind_amax(q, k, v)

    def run(q, k, v, cu_seqlens_q, out, k8, vt, scales):
        prep(out, cu_seqlens_q, scales)
        amax(q, k, v, scales)
        if to_fp8 is not None:
            to_fp8(k, v, k8, vt, scales)

    return run


def _descale_strides(x: torch.Tensor | None) -> tuple[int, int]:
    return (x.stride(0), x.stride(1)) if x is not None and x.dim() == 2 else (0, 0)


def prepare_flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off", window_left=-1, softcap=0.0, sinks=None, *,
    config=None,
):
    """The runner of this call signature. `fp8` is resolved here ("auto": the cached
    per-device probe), with the tile config, the workspace specs and every launch.
    A call makes 2 launches (zero the output tail, attention) on the bf16/fp16 path,
    4 quantising bf16/fp16 inputs (reset + tail, amax, k and V^T, attention; 5 where the
    sm_90 fp8 Gluon kernel runs: it reads a quantised copy of q) and 3 on fp8 inputs
    (reset + tail, V^T, attention). The variants (window, softcap, whether
    there are sinks) are constexprs of the attention launch; `sinks` itself is a tensor
    argument per call. `config` (tests and benchmarks only) overrides (BLOCK_M, BLOCK_N,
    num_warps, num_stages)."""
    device = q.device
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    quantize = quantize_inputs(fp8, q.dtype, device)
    use_fp8 = q.dtype == FP8 or quantize
    if use_fp8 and device.type == "cuda" and not fp8_prefill_supported(device):
        # No fp8 matrix units (or no working fp8 codegen): the slow, exact PyTorch path.
        return reference.flash_attn_varlen
    shape, dtype = (tq, hq, dv), output_dtype(q.dtype)
    new_out = output_allocator(shape, dtype, device)
    if tq * hq * dv == 0:
        def run_empty(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                      q_descale=None, k_descale=None, v_descale=None, fp8="off",
                      window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    explicit_config = config is not None
    config = config or varlen_config(device, d, dv, use_fp8, max_seqlen_q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    emulate = EMULATE_FP8_CAST and device.type == "cpu"
    sinks_stride = None if sinks is None else sinks.stride(0)
    variants = {"window_left": window_left, "softcap": softcap, "sinks_stride": sinks_stride}
    # (A window of every key is none: `bind_varlen` compiles it away; the Gluon kernels take no variant.)
    has_variant = (0 <= window_left < tk) or softcap != 0.0 or sinks is not None

    if not use_fp8:
        zero_tail = bind_prepare(q, num_seqs, tq, hq * dv, False)  # not None: out has elements
        attend = bind_varlen(
            q, num_seqs, hk, dv, (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1), v.stride(2)),
            max_seqlen_q, scale, causal, None, False, config, emulate, tk, **variants,
        )
        if attend is not None and not explicit_config and wgmma_varlen_fits(q, k, v, max_seqlen_q, scale, has_variant):
            # sm_90: the Gluon kernel (a config override asks for the Triton kernel's tiles).
            attend = bind_wgmma_varlen(q, k, v, num_seqs, max_seqlen_q, scale, causal, attend)

        def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                q_descale=None, k_descale=None, v_descale=None, fp8="off",
                window_left=-1, softcap=0.0, sinks=None):
            out = new_out()
            zero_tail(out, cu_seqlens_q, out)
            if attend is not None:  # no descales (nor sinks): placeholders
                attend(q, k, v, out, cu_seqlens_q, cu_seqlens_k, q, q, q, q if sinks is None else sinks)
            return out

        return run

    # fp8: V^T [Hk, Dv, Tk_pad] from the workspace, seen by the kernel as [Tk, Hk, Dv].
    columns = vt_columns(tk)
    vt_strides = (1, dv * columns, columns)
    quantise = prepare_fp8_quantisation(q, k, v, cu_seqlens_q, quantize)

    if quantize:
        # k8 is contiguous; every descale is a [1] scale slot.
        attend = bind_varlen(
            q, num_seqs, hk, dv, (hk * d, d), vt_strides, max_seqlen_q, scale, causal, ((0, 0),) * 3, True,
            config, emulate, tk, q_quant=True, **variants,
        )
        gluon = quantise_q = None
        if attend is not None and not explicit_config and wgmma_varlen_fp8_fits(
                q, k, v, max_seqlen_q, has_variant, copies=True):
            # sm_90: q, k quantised into fp8 copies for the fp8 Gluon kernel (it reads q by TMA).
            gluon = bind_wgmma_varlen_fp8(q, k, (hk, dv, columns), num_seqs, max_seqlen_q, scale, causal,
                                          ((0, 0),) * 3, None, copies=True)
            quantise_q = bind_quantize_q(q)
        specs = tuple(varlen_workspace_specs(tq, tk, hq, hk, d, dv, True, q_copy=gluon is not None))

        def run_quantised(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                          q_descale=None, k_descale=None, v_descale=None, fp8="off",
                          window_left=-1, softcap=0.0, sinks=None):
            out = new_out()
            vt, k8, scales, *q8 = current_workspace_manager(device).get_simultaneous(*specs, owner=VARLEN_OWNER)
            quantise(q, k, v, cu_seqlens_q, out, k8, vt, scales)
            if attend is None:
                return out
            k_descale, v_descale = scales[DESCALE_K : DESCALE_K + 1], scales[DESCALE_V : DESCALE_V + 1]
            if gluon is not None:
                quantise_q(q, q8[0], scales)
                if gluon(q8[0], k8, vt, out, cu_seqlens_q, cu_seqlens_k, scales[DESCALE_Q : DESCALE_Q + 1],
                         k_descale, v_descale, q):
                    return out
            # The Triton kernel quantises q itself, from its amax (slot 0: `scales`).
            attend(q, k8, vt, out, cu_seqlens_q, cu_seqlens_k, scales, k_descale, v_descale,
                   q if sinks is None else sinks)
            return out

        return run_quantised

    specs = tuple(varlen_workspace_specs(tq, tk, hq, hk, d, dv, False))
    descale_strides = tuple(_descale_strides(x) for x in (q_descale, k_descale, v_descale))
    attend = bind_varlen(
        q, num_seqs, hk, dv, (k.stride(0), k.stride(1)), vt_strides, max_seqlen_q, scale, causal,
        descale_strides, True, config, emulate, tk, **variants,
    )
    if attend is not None and not explicit_config and wgmma_varlen_fp8_fits(q, k, v, max_seqlen_q, has_variant):
        # sm_90: the fp8 Gluon kernel (a config override asks for the Triton kernel's tiles).
        attend = bind_wgmma_varlen_fp8(q, k, (hk, dv, columns), num_seqs, max_seqlen_q, scale, causal,
                                       descale_strides, attend)
    needs_one = q_descale is None or k_descale is None or v_descale is None

    def run_fp8_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                       q_descale=None, k_descale=None, v_descale=None, fp8="off",
                       window_left=-1, softcap=0.0, sinks=None):
        out = new_out()
        vt, scales = current_workspace_manager(device).get_simultaneous(*specs, owner=VARLEN_OWNER)
        quantise(q, k, v, cu_seqlens_q, out, None, vt, scales)
        if attend is not None:
            one = scales[ONE : ONE + 1] if needs_one else None  # stands in for descales left out
            attend(q, k, vt, out, cu_seqlens_q, cu_seqlens_k,
                   one if q_descale is None else q_descale,
                   one if k_descale is None else k_descale,
                   one if v_descale is None else v_descale,
                   q if sinks is None else sinks)
        return out

    return run_fp8_inputs


def flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off", window_left=-1, softcap=0.0, sinks=None, *,
    config=None,
):
    """One call, prepared afresh. `config` (tests and benchmarks only) overrides
    (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            q_descale, k_descale, v_descale, fp8, window_left, softcap, sinks)
    return prepare_flash_attn_varlen(*args, config=config)(*args)
