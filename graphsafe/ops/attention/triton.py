"""Triton backend of the GQA attention ops: the records, and the per-signature runners.

What runs is decided in `plan.py`: each `prepare_*` (the records' `prepare`, run once per
call signature; the registry keeps the runner) calls `plan.choose_*(call)` once and binds
the launches the Choice names (`graphsafe.launch.bind`). A runner allocates the output,
takes the Choice's scratch from the workspace manager and calls the bound launches with
tensors only. Every host int comes from shapes or arguments.

The kernels (kernels/, imported by the first prepare, so that importing graphsafe never
imports triton): `triton_decode.py` (paged decode + split combine), `triton_prefill.py`
(varlen FlashAttention-2 forward), `triton_paged_prefill.py`, `triton_quant.py` (the fp8
path's quantisation, and zeroing the output rows outside every sequence) and, on sm_90,
`gluon_prefill.py` (varlen's Gluon kernels, bound here by `bind_wgmma_varlen` and
`bind_wgmma_varlen_fp8` with the runtime fallback the Choice lists: the Triton kernel
for a misaligned call or a Gluon kernel that failed to compile).
"""

from __future__ import annotations

import warnings

import torch

from graphsafe.device_info import num_sms
from graphsafe.launch import Launch, bind, compile_errors, output_allocator
from graphsafe.ops.attention import plan, reference
from graphsafe.ops.attention.fake import output_dtype
from graphsafe.ops.attention.fp8_format import AMAX_Q, DESCALE_K, DESCALE_Q, DESCALE_V, ONE, vt_columns
from graphsafe.registry import Backend, get_op
from graphsafe.workspace import current_lane, current_workspace_manager

DECODE_OWNER = "paged_attention_decode"
VARLEN_OWNER = "flash_attn_varlen"
# The runners pass `scales` itself as the pointer to q's amax (no view to cut per call).
assert AMAX_Q == 0
LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- paged decode -------------------------------------------------------------------------
def prepare_paged_attention_decode(call):
    """The runner of this call signature (the record's `prepare`): the plan's split count,
    the decode launch and (with more than one split) the combine launch and the partials'
    workspace specs, with the variants (`window_left`, `softcap`, whether there are
    `sinks`: host arguments of the signature) bound into them. A call makes 1 launch, or
    2 with splits."""
    return bind_paged_attention_decode(call, plan.choose_paged_attention_decode(call))


def bind_paged_attention_decode(call, choice: plan.DecodeChoice):
    """The runner of `call`'s signature running `choice`."""
    q = call.q
    b, hq, _ = q.shape
    dv = call.v_cache.shape[3]
    device = q.device
    new_out = output_allocator((b, hq, dv), q.dtype, device)

    if choice.path == "empty":
        def run_empty(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None,
                      window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    from graphsafe.ops.attention.kernels.triton_decode import bind_combine, bind_paged_decode

    kv_fp8 = choice.kv_fp8
    decode = bind_paged_decode(q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, call.scale,
                               choice.num_splits, choice.config, kv_fp8, call.window_left, call.softcap, call.sinks)
    if choice.path == "one-split":
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

    specs = choice.workspace  # the partials (plan.split_scratch)
    combine = bind_combine(q, b, hq, dv, choice.num_splits, call.sinks)

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
    """One call, prepared afresh (tests). `num_splits` overrides the shape-based plan."""
    call = get_op("paged_attention_decode").call(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale,
                                                 window_left, softcap, sinks)
    return bind_paged_attention_decode(call, plan.choose_paged_attention_decode(call, num_splits))(*call)


# -- paged prefill ------------------------------------------------------------------------
def prepare_paged_attention_prefill(call):
    """The runner of this call signature (the record's `prepare`): the plan's kernels and
    tiles, the grid and both launches fixed here. A call makes 2 launches: zero the output
    rows outside every sequence (`triton_quant.bind_prepare`), then attention (on sm_90
    the Gluon kernel where the plan names it, else the Triton kernel). No workspace."""
    return bind_paged_attention_prefill(call, plan.choose_paged_attention_prefill(call))


def bind_paged_attention_prefill(call, choice: plan.PagedPrefillChoice):
    """The runner of `call`'s signature running `choice`."""
    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    tq, hq, _ = q.shape
    dv = v_cache.shape[3]
    new_out = output_allocator((tq, hq, dv), q.dtype, q.device)
    if choice.path == "empty":
        def run_empty(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
                      k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    from graphsafe.ops.attention.kernels.triton_paged_prefill import bind_paged_prefill
    from graphsafe.ops.attention.kernels.triton_quant import bind_prepare

    num_seqs = call.cu_seqlens_q.shape[0] - 1
    zero_rows = bind_prepare(q, num_seqs, tq, hq * dv, False)  # not None: the output has elements
    sinks_stride = None if call.sinks is None else call.sinks.stride(0)
    attend = bind_paged_prefill(q, k_cache, v_cache, call.block_table, call.seq_lens, num_seqs, call.max_seqlen_q,
                                call.scale, call.causal, call.window_left, call.softcap, sinks_stride, choice.config,
                                choice.kv_fp8)
    if choice.gluon is not None and attend is not None:
        attend = bind_gluon_paged_prefill(call, num_seqs, choice.gluon, attend)
    kv_fp8 = choice.kv_fp8

    def run(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
            k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None):
        out = new_out()
        zero_rows(out, cu_seqlens_q, out)
        if attend is not None:
            if not kv_fp8:
                k_scale = v_scale = q  # bf16/fp16 caches read no scale: placeholders
            attend(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale,
                   q if sinks is None else sinks, out)
        return out

    return run


def paged_attention_prefill(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
    k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None, *,
    config=None,
):
    """One call, prepared afresh (tests and benchmarks). `config` overrides (BLOCK_M,
    BLOCK_N, num_warps, num_stages)."""
    call = get_op("paged_attention_prefill").call(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                                                  max_seqlen_q, scale, causal, k_scale, v_scale, window_left, softcap,
                                                  sinks)
    return bind_paged_attention_prefill(call, plan.choose_paged_attention_prefill(call, config))(*call)


# -- varlen prefill -----------------------------------------------------------------------
def prepare_fp8_quantisation(q, k, v, cu_seqlens_q, quantize=True):
    """The fp8 path's launches before the attention kernel, bound to these shapes and
    strides (the op's own runners use it; public for tests and the benchmark).

    Returns `run(q, k, v, cu_seqlens_q, out, k8, vt, scales)`: zeroes the rows of `out`
    (contiguous `[Tq, Hq, Dv]`) past `cu_seqlens_q[B]` and resets `scales` (float32
    `[SCALE_SLOTS]`), one launch; then with `quantize` (bf16/fp16 inputs) the amax of q,
    k and v (one launch) and k, V^T quantised into `k8` (contiguous `[Tk, Hk, D]`) and
    `vt` (contiguous `[Hk, Dv, vt_columns(Tk)]`, one launch); without (fp8 inputs) V^T
    is a transposed copy of v and `k8` is not used (pass None)."""
    from graphsafe.ops.attention.kernels.triton_quant import bind_amax, bind_prepare, bind_quantize_kv

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


def prepare_flash_attn_varlen(call):
    """The runner of this call signature (the record's `prepare`): the plan (`fp8`
    resolved, "auto" by the cached per-device probe; the kernels in the order they are
    tried, the tiles, the scratch) and every launch. A call makes 2 launches (zero the
    output tail, attention) on the bf16/fp16 path, 4 quantising bf16/fp16 inputs (reset +
    tail, amax, k and V^T, attention; 5 where the sm_90 fp8 Gluon kernel runs: it reads a
    quantised copy of q) and 3 on fp8 inputs (reset + tail, V^T, attention). The variants
    (window, softcap, whether there are sinks) are constexprs of the attention launch;
    `sinks` itself is a tensor argument per call."""
    return bind_flash_attn_varlen(call, plan.choose_flash_attn_varlen(call))


def bind_flash_attn_varlen(call, choice: plan.VarlenChoice):
    """The runner of `call`'s signature running `choice`."""
    if choice.path == "reference":
        # fp8 asked of a GPU without fp8 matrix units (or working fp8 codegen): the slow, exact PyTorch path.
        return reference.flash_attn_varlen
    q, k, v = call.q, call.k, call.v
    device = q.device
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    new_out = output_allocator((tq, hq, dv), output_dtype(q.dtype), device)
    if choice.path == "empty":
        def run_empty(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                      q_descale=None, k_descale=None, v_descale=None, fp8="off",
                      window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    from graphsafe.ops.attention.kernels.triton_prefill import bind_varlen
    from graphsafe.ops.attention.kernels.triton_quant import EMULATE_FP8_CAST, bind_prepare, bind_quantize_q

    max_seqlen_q, scale, causal = call.max_seqlen_q, call.scale, call.causal
    num_seqs = call.cu_seqlens_q.shape[0] - 1
    emulate = EMULATE_FP8_CAST and device.type == "cpu"
    sinks_stride = None if call.sinks is None else call.sinks.stride(0)
    variants = {"window_left": call.window_left, "softcap": call.softcap, "sinks_stride": sinks_stride}
    gluon = choice.gluon  # tried first where set; the Triton kernel (kernels[-1]) takes what it cannot
    attends = bool(choice.kernels)  # False: no row has work, nothing to launch
    specs = choice.workspace

    if choice.path == "16-bit":
        zero_tail = bind_prepare(q, num_seqs, tq, hq * dv, False)  # not None: out has elements
        attend = bind_varlen(
            q, num_seqs, hk, dv, (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1), v.stride(2)),
            max_seqlen_q, scale, causal, None, False, choice.config, emulate, tk, **variants,
        ) if attends else None
        if gluon is not None:
            attend = bind_wgmma_varlen(q, k, v, num_seqs, max_seqlen_q, scale, causal, gluon, attend, **variants,
                                       max_seqlen_k=call.max_seqlen_k)

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
    quantize = choice.path == "quantise"
    quantise = prepare_fp8_quantisation(q, k, v, call.cu_seqlens_q, quantize)

    if quantize:
        # k8 is contiguous; every descale is a [1] scale slot.
        attend = bind_varlen(
            q, num_seqs, hk, dv, (hk * d, d), vt_strides, max_seqlen_q, scale, causal, ((0, 0),) * 3, True,
            choice.config, emulate, tk, q_quant=True, **variants,
        ) if attends else None
        copies = quantise_q = None
        if gluon is not None:
            # sm_90: q, k quantised into fp8 copies for the fp8 Gluon kernel (it reads q by TMA).
            copies = bind_wgmma_varlen_fp8(q, k, (hk, dv, columns), num_seqs, max_seqlen_q, scale, causal,
                                           ((0, 0),) * 3, gluon, None, max_seqlen_k=call.max_seqlen_k)
            quantise_q = bind_quantize_q(q)

        def run_quantised(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                          q_descale=None, k_descale=None, v_descale=None, fp8="off",
                          window_left=-1, softcap=0.0, sinks=None):
            out = new_out()
            vt, k8, scales, *q8 = current_workspace_manager(device).get_simultaneous(*specs, owner=VARLEN_OWNER)
            quantise(q, k, v, cu_seqlens_q, out, k8, vt, scales)
            if attend is None:
                return out
            k_descale, v_descale = scales[DESCALE_K : DESCALE_K + 1], scales[DESCALE_V : DESCALE_V + 1]
            if copies is not None:
                quantise_q(q, q8[0], scales)
                if copies(q8[0], k8, vt, out, cu_seqlens_q, cu_seqlens_k, scales[DESCALE_Q : DESCALE_Q + 1],
                          k_descale, v_descale, q):
                    return out
            # The Triton kernel quantises q itself, from its amax (slot 0: `scales`).
            attend(q, k8, vt, out, cu_seqlens_q, cu_seqlens_k, scales, k_descale, v_descale,
                   q if sinks is None else sinks)
            return out

        return run_quantised

    descale_strides = tuple(_descale_strides(x) for x in (call.q_descale, call.k_descale, call.v_descale))
    attend = bind_varlen(
        q, num_seqs, hk, dv, (k.stride(0), k.stride(1)), vt_strides, max_seqlen_q, scale, causal,
        descale_strides, True, choice.config, emulate, tk, **variants,
    ) if attends else None
    if gluon is not None:
        attend = bind_wgmma_varlen_fp8(q, k, (hk, dv, columns), num_seqs, max_seqlen_q, scale, causal,
                                       descale_strides, gluon, attend,
                                       max_seqlen_k=call.max_seqlen_k)
    needs_one = call.q_descale is None or call.k_descale is None or call.v_descale is None

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
    """One call, prepared afresh (tests and benchmarks). `config` overrides the Triton
    kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages), and so asks for that kernel."""
    call = get_op("flash_attn_varlen").call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                            causal, q_descale, k_descale, v_descale, fp8, window_left, softcap, sinks)
    return bind_flash_attn_varlen(call, plan.choose_flash_attn_varlen(call, config))(*call)


# -- varlen prefill: the sm_90 Gluon launches and their runtime fallback ---------------------
def _qk_scale(scale: float, softcap: float) -> float:
    """The Gluon TMA kernels' score scale: scale x log2(e), or with a softcap the tanh's
    exp2 argument per raw score, scale x 2 log2(e) / softcap (as the Triton kernels')."""
    return scale * 2 * LOG2E / softcap if softcap > 0 else scale * LOG2E


def _variant_meta(window_left: int, softcap: float, sinks_stride: int | None) -> dict:
    """The Gluon TMA kernels' variant constexprs (the cap in log2 units)."""
    return {"WINDOW_LEFT": window_left, "SOFTCAP": softcap * LOG2E if softcap > 0 else 0.0,
            "HAS_SINKS": sinks_stride is not None}


# Signatures (dtype, head dims, tiles, causal, kernel, warp specialisation) whose Gluon kernel failed to compile.
_FAILED: set[tuple] = set()

_SCHEDULE_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def schedule_counter(device: torch.device) -> torch.Tensor:
    """The ticket counter (int32 [2]) of the TMA prefill kernels' dynamic schedule
    (`plan.tma_claims_tiles`) on `device` for the current workspace lane: zero between
    launches (each launch leaves it as it found it), so the launches of one lane, which
    run in stream order as its workspace assumes, share it. Made on first use: the
    runners ask for it when they are prepared, so a warm-up call makes it outside a
    graph capture."""
    key = (device, current_lane())
    counter = _SCHEDULE_COUNTERS.get(key)
    if counter is None:
        counter = _SCHEDULE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def _out_slot(module, gluon: plan.GluonPlan, like: torch.Tensor, shape: tuple[int, int, int], placeholder):
    """A TMA kernel's out-descriptor argument at bind time: the template of out's descriptor
    (`like`: out's dtype and device) where the plan stages the output, else `placeholder`."""
    return module.out_descriptor(like, shape, gluon.out_pieces) if gluon.out_buffers else placeholder


def _counter_arg(claim: bool, device: torch.device, placeholder: torch.Tensor) -> torch.Tensor:
    """A TMA kernel's counter argument of a call: the lane's ticket counter where the
    programs claim their tiles, else `placeholder` (an int32 tensor, never read)."""
    return schedule_counter(device) if claim else placeholder


def _compile_failed(key: tuple, exc: Exception, op: str = "flash_attn_varlen") -> None:
    """Remember that the Gluon kernel of signature `key` did not compile (its later calls
    and bindings run the Triton kernel at once) and say so, once per signature."""
    if key not in _FAILED:
        _FAILED.add(key)
        warnings.warn(f"graphsafe {op}: the sm_90 Gluon kernel did not compile for {key} ({exc}); "
                      "running the Triton kernel", RuntimeWarning, stacklevel=3)


def bind_gluon_paged_prefill(call, num_seqs: int, gluon: plan.GluonPlan, triton_launch: Launch) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k_cache, v_cache, block_table,
    seq_lens, cu_seqlens_q, k_scale, v_scale, sinks, out)` into a contiguous `out` [Tq, Hq,
    Dv]: the paged Gluon kernel of plan `gluon` (it reads no scales; sinks where the call
    has them, else a placeholder) for 16-byte aligned q and caches, else `triton_launch`
    (the Choice's next kernel), as for every call once the Gluon kernel failed to compile.
    The call's variants are its constexprs (a window of a table row's keys or more is none)."""
    module = plan.gluon_module()
    q, k_cache, v_cache, block_table = call.q, call.k_cache, call.v_cache, call.block_table
    tq, hq, d = q.shape
    num_blocks, page, hk, dv = v_cache.shape
    num_m_blocks = _cdiv(call.max_seqlen_q, gluon.block_m)
    max_len = block_table.shape[1] * page
    sinks_stride = None if call.sinks is None else call.sinks.stride(0)
    variant = _variant_meta(call.window_left if call.window_left < max_len else -1, call.softcap, sinks_stride)
    key = (q.dtype, d, dv, page, call.causal, gluon.kernel, gluon.warp_spec, *variant.values())
    claim = plan.tma_claims_tiles(hq // hk, d, paged=True)
    errors = compile_errors()
    kernel = None
    if key not in _FAILED:
        stages, consumer_regs, loader_regs = gluon.warp_spec
        section = plan.tma_heads_per_section(hq, hk, max_len, d, dv, q.element_size())
        work = num_m_blocks * num_seqs * hq
        descriptors = module.paged_tma_descriptors(q, k_cache, v_cache, gluon.block_n)  # templates: each call's
        out_slot = _out_slot(module, gluon, q, (tq, hq, dv), q)
        kernel = bind(module.paged_fwd_tma_kernel, (min(work, num_sms(q.device)),), *descriptors, out_slot,
                      q, q, q, q, q, q,  # out, cu_q, seq_lens, block_table, sinks, counter: only their device is read
                      hq * dv, dv, call.seq_lens.stride(0), block_table.stride(0), block_table.stride(1),
                      sinks_stride or 0, _qk_scale(call.scale, call.softcap), hq, num_m_blocks, tq, max_len, num_seqs,
                      num_blocks, section, GROUP=hq // hk, DK=d, DV=dv, BLOCK_M=gluon.block_m, BLOCK_N=gluon.block_n,
                      CAUSAL=call.causal, STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs,
                      PAGE=page, Q_BUFFERS=gluon.q_buffers, **variant, DYNAMIC=claim, O_BUFFERS=gluon.out_buffers,
                      num_warps=4)
        if claim:
            schedule_counter(q.device)

    def launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale, sinks, out):
        nonlocal kernel
        if kernel is not None and not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15:
            try:
                return kernel(q, k_cache, v_cache, out, out, cu_seqlens_q, seq_lens, block_table, sinks,
                              _counter_arg(claim, q.device, cu_seqlens_q))
            except errors as exc:  # nothing ran: the Triton kernel runs the call
                kernel = None
                _compile_failed(key, exc, "paged_attention_prefill")
        triton_launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale, sinks, out)

    return launch


def bind_wgmma_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
                      scale: float, causal: bool, gluon: plan.GluonPlan, triton_launch: Launch,
                      window_left: int = -1, softcap: float = 0.0, sinks_stride: int | None = None,
                      max_seqlen_k: int | None = None) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k, v, out, cu_q, cu_k, q_descale,
    k_descale, v_descale, sinks)` into a contiguous `out` [Tq, Hq, Dv]: the Gluon kernel of
    plan `gluon` (which reads no descales, placeholders here) for 16-byte aligned q, k, v,
    else `triton_launch` (the Choice's next kernel), as for every call once the Gluon
    kernel failed to compile. The variants (`window_left`, `softcap`, `sinks_stride`: None
    without sinks, whose argument is then a placeholder) run on the "tma" kernel only (the
    plan's rule); a window of Tk keys or more is none. `max_seqlen_k` (None: Tk) bounds a
    sequence's keys for the work tiles' sections (`plan.tma_heads_per_section`)."""
    module = plan.gluon_module()
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    kernel, block_m, block_n, ws = gluon.kernel, gluon.block_m, gluon.block_n, gluon.warp_spec
    num_m_blocks = _cdiv(max_seqlen_q, block_m)
    window_left = window_left if window_left < tk else -1
    claim = kernel == "tma" and plan.tma_claims_tiles(hq // hk, d)
    variant = _variant_meta(window_left, softcap, sinks_stride)
    key = (q.dtype, d, dv, block_m, block_n, causal, kernel, ws, *variant.values())
    errors = compile_errors()
    wgmma = None
    if key not in _FAILED:
        work = num_m_blocks * num_seqs * hq
        meta = {"GROUP": hq // hk, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal}
        sizes = (_qk_scale(scale, softcap), hq, num_m_blocks, tq, tk)
        if kernel == "tma":  # persistent: a program per SM walks the work tiles
            stages, consumer_regs, loader_regs = ws
            descriptors = module.tma_descriptors(q, k, v, block_n)  # templates: each call's q, k, v
            out_slot = _out_slot(module, gluon, q, (tq, hq, dv), q)
            section = plan.tma_heads_per_section(hq, hk, min(max_seqlen_k or tk, tk), d, dv, q.element_size())
            wgmma = bind(module.varlen_fwd_tma_kernel, (min(work, num_sms(q.device)),), *descriptors, out_slot,
                         q, q, q, q, q, q, q, q,  # out, cu_q, cu_k; descales (not read without FP8), sinks, counter
                         hq * dv, dv, *(0,) * 6, sinks_stride or 0, *sizes, num_seqs, section, **meta, DK=d, DV=dv,
                         STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, FP8=False,
                         Q_BUFFERS=gluon.q_buffers, **variant, DYNAMIC=claim, O_BUFFERS=gluon.out_buffers,
                         num_warps=4)
        else:
            args = (q, q, q, q, q, q,  # placeholders: only their device is read
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), hq * d, d, *sizes)
            if kernel == "wgmma":
                wgmma = bind(module.varlen_fwd_wgmma_kernel, (work,), *args, **meta, D=d, num_warps=block_m // 16)
            else:
                stages, consumer_regs, loader_regs = ws
                wgmma = bind(module.varlen_fwd_ws_kernel, (min(work, num_sms(q.device)),), *args, num_seqs, **meta,
                             D=d, STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)

    tma = kernel == "tma"
    if claim and wgmma is not None:
        schedule_counter(q.device)

    def launch(q, k, v, out, cu_q, cu_k, *rest):
        nonlocal wgmma
        if wgmma is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            try:
                if tma:  # its descale pointers (read by its fp8 variant only) are placeholders; sinks; counter
                    return wgmma(q, k, v, out, out, cu_q, cu_k, q, q, q, rest[3], _counter_arg(claim, q.device, cu_q))
                return wgmma(q, k, v, out, cu_q, cu_k)
            except errors as exc:  # nothing ran: the Triton kernel runs the call
                wgmma = None
                _compile_failed(key, exc)
        triton_launch(q, k, v, out, cu_q, cu_k, *rest)

    return launch


def bind_wgmma_varlen_fp8(q: torch.Tensor, k: torch.Tensor, vt_shape: tuple[int, int, int], num_seqs: int,
                          max_seqlen_q: int, scale: float, causal: bool,
                          descale_strides: tuple[tuple[int, int], ...], gluon: plan.GluonPlan,
                          triton_launch: Launch | None, max_seqlen_k: int | None = None) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k, vt, out, cu_q, cu_k, q_descale,
    k_descale, v_descale, sinks)` (fp8 q, k; V^T `vt` of shape `vt_shape`; out contiguous
    [Tq, Hq, Dv]): the fp8 Gluon kernel of plan `gluon` (which reads no sinks: a
    placeholder here) for 16-byte aligned q, k, vt, else `triton_launch` (the Choice's
    next kernel). `descale_strides`: each descale's (sequence, kv head) strides, (0, 0)
    for one value per tensor. `gluon.copies`: q and k are bf16/fp16 inputs whose
    contiguous fp8 copies each call passes instead; then `triton_launch` may be None, and
    a call the Gluon kernel cannot run (a failed compile) returns False for the caller
    to run the Triton kernel its own way (on q as given). `max_seqlen_k` (None: Tk) as
    `bind_wgmma_varlen`'s."""
    module = plan.gluon_module()
    tq, hq, d = q.shape
    tk, hk = k.shape[:2]
    like = torch.empty(0, dtype=torch.float8_e4m3fn, device=q.device)
    if gluon.copies:
        q_view, k_view = (q.shape, hq * d), (k.shape, hk * d)
    else:
        q_view, k_view = (q.shape, q.stride(0)), (k.shape, k.stride(0))
    dv = vt_shape[1]
    block_m, block_n, ws = gluon.block_m, gluon.block_n, gluon.warp_spec
    num_m_blocks = _cdiv(max_seqlen_q, block_m)
    claim = plan.tma_claims_tiles(hq // hk, d, fp8=True)
    key = (q.dtype, d, dv, block_m, block_n, causal, gluon.kernel, ws)
    errors = compile_errors()
    wgmma = None
    if key not in _FAILED:
        stages, consumer_regs, loader_regs = ws
        work = num_m_blocks * num_seqs * hq
        descriptors = module.tma_descriptors_fp8(like, q_view, k_view, vt_shape, block_n)  # templates
        strides = tuple(x for pair in descale_strides for x in pair)
        out_like = torch.empty(0, dtype=output_dtype(q.dtype), device=q.device)
        out_slot = _out_slot(module, gluon, out_like, (tq, hq, dv), q)
        section = plan.tma_heads_per_section(hq, hk, min(max_seqlen_k or tk, tk), d, dv, 1)  # 1-byte K / V^T
        wgmma = bind(module.varlen_fwd_tma_kernel, (min(work, num_sms(q.device)),), *descriptors, out_slot,
                     q, q, q, q, q, q, q, q,  # out, cu_q, cu_k, the descales, sinks, counter: only their device is read
                     hq * dv, dv, *strides, 0, scale * LOG2E, hq, num_m_blocks, tq, tk, num_seqs, section,
                     GROUP=hq // hk, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, DK=d, DV=dv, STAGES=stages,
                     CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, FP8=True, Q_BUFFERS=gluon.q_buffers,
                     **_variant_meta(-1, 0.0, None), DYNAMIC=claim, O_BUFFERS=gluon.out_buffers, num_warps=4)
        if claim:
            schedule_counter(q.device)

    def launch(q, k, vt, out, cu_q, cu_k, q_descale, k_descale, v_descale, sinks) -> bool:
        """Whether the call ran (False only without a `triton_launch`: the caller runs it)."""
        nonlocal wgmma
        if wgmma is not None and not (q.data_ptr() | k.data_ptr() | vt.data_ptr()) & 15:
            try:
                wgmma(q, k, vt, out, out, cu_q, cu_k, q_descale, k_descale, v_descale, q_descale,  # (no sinks: a placeholder)
                      _counter_arg(claim, q.device, cu_q))
                return True
            except errors as exc:  # nothing ran: the Triton kernel runs the call
                wgmma = None
                _compile_failed(key, exc)
        if triton_launch is None:
            return False
        triton_launch(q, k, vt, out, cu_q, cu_k, q_descale, k_descale, v_descale, sinks)
        return True

    return launch


# -- the records ------------------------------------------------------------------------------
PAGED_ATTENTION_DECODE = Backend(name="triton", prepare=prepare_paged_attention_decode,
                                 workspace=plan.decode_workspace_specs)
FLASH_ATTN_VARLEN = Backend(name="triton", prepare=prepare_flash_attn_varlen,
                            workspace=plan.flash_attn_varlen_workspace)
PAGED_ATTENTION_PREFILL = Backend(name="triton", prepare=prepare_paged_attention_prefill)
