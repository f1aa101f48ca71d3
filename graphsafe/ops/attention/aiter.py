"""aiter backend of `flash_attn_varlen` (ROCm: gfx942 and gfx950, see graphsafe.aiter_support).

Read against aiter v0.1.20-46-ge4048607a5 (ROCm/aiter e4048607a535); file and function
names cited. The record's `supports` predicate (`supports_flash_attn_varlen`, taking the
bound call) answers `SUPPORTED` only where `aiter_support.serves` lists the device's
architecture for the op and aiter's kernel exists for the shapes and dtypes with
graphsafe's semantics, else `declined(why)`; the registry hands every other signature to
the next backend (Triton), once per signature. The adapter itself never calls another
backend. Nothing here imports aiter or triton before the first prepare.

* `flash_attn_varlen` -> `aiter.flash_attn_varlen_func(q, k, v, cu_q, cu_k,
  max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=, causal=)` (aiter/ops/mha.py;
  bottom-right causal alignment, a row that sees no key is 0). Which kernel serves a call
  (aiter/ops/mha.py:_flash_attn_varlen_forward): on gfx950, bf16 with head dims 192 / 128
  the OPUS kernel (`fmha_fwd_bf16_opus_varlen_fwd`, csrc/include/
  fmha_fwd_hd192_v128_bf16_opus_kernel.hpp; since v0.1.18, on unless
  `AITER_DISABLE_FMHA_OPUS=1`); else bf16 with head dims 128 / 128 or 192 / 128 the fmha
  v3 asm kernel (`fmha_v3_varlen_fwd`, hsa/<arch>/fmha_v3_fwd; 192 / 128 only while the
  K / V bytes of a head stay below 4 GiB); everything else (fp16, other head dims) CK's
  `mha_varlen_fwd`. OPUS replaces a scale <= 0 by 1 / sqrt(192)
  (fmha_fwd_bf16_opus_kernels.cu:launch_d192_v128), the others take it as given: on gfx950
  a bf16 192 / 128 call with a scale <= 0 goes to Triton. aiter uses `cu_seqlens` as given (asm_mha_varlen_fwd.cu / CK
  mha_varlen_fwd_kernels.cu: no clamping), so a Triton launch
  (kernels/triton_sequence_bounds.py) first writes graphsafe's bounds (running maximum,
  clamped to [0, T]) into workspace int32 buffers, and those are passed. aiter's output
  is `torch::empty`: rows outside every sequence (before the first, at or past the last)
  are zeroed afterwards (`kernels/triton_quant.bind_prepare`). Only bf16/fp16 with `fp8="off"`:
  aiter's fp8 type is e4m3fnuz on gfx942 (aiter/utility/dtypes.py), and its fp8 varlen
  path is not graphsafe's per-tensor quantisation. At least one sequence: aiter rejects
  B = 0 ("batch size must be postive"). Calls with no output element, no key row or a
  `max_seqlen_*` of 0 have an all-zero (or empty) output and skip aiter.

What aiter allocates itself (not from graphsafe's workspace): `flash_attn_varlen_func`
allocates its output (and, for head dims not a multiple of 8, padded copies of q, k, v
and a padded output, whose slice the adapter then copies to a contiguous tensor:
aiter/ops/mha.py:FlashAttnVarlenFunc.forward). The output tensor is allocated per call
as on every backend. The varlen bounds (two int32 [B + 1] buffers) are not in
`flash_attn_varlen_workspace`'s worst case, whose parameters have no batch size: an
arena grown at all (1 MiB granularity) holds them up to B = 131071, and an eager call
before a capture grows an empty one.

`paged_attention_decode` has no aiter backend (Triton serves it on ROCm).
`torch.ops.aiter.paged_attention_v1` (aiter/ops/attention.py, body
csrc/cpp_itfs/pa/pa_v1.py) loads the V rows of every token of a partition and weights
the rows past a request's length by 0, positions past the context reusing its last block
(csrc/cpp_itfs/pa/pa_kernels.cuh:_paged_attention_kernel): a NaN or inf in the V cache
rows past `seq_lens[b]` inside request b's last block makes its output NaN (0 * NaN),
where graphsafe's contract says those rows are not read. The adapter cannot avoid it
(the kernel takes the cache's base pointer and strides; graphsafe must not write the
caller's cache) and `supports` cannot see values. The kernel also dereferences every
block id unchecked (padding blocks would be read), steps through `block_tables` with
`size(1)` as the row stride (pa_v1.cuh), and with more than 16 query heads per KV head
places KV head h's heads at h times the loop's group size, not h * G (pa_kernels.cuh:
GQA_RATIO_LOOP, wg_start_head_idx).

With grad enabled and q, k or v requiring grad (the dispatcher passes them as they are),
aiter's `FlashAttnVarlenFunc.forward` asserts `return_lse` (it saves the LSE for its
backward): the adapter calls it under `torch.no_grad()` then (graphsafe's op has no
backward).

Not verifiable without AMD hardware: the results of aiter's asm/CK/OPUS kernels. NaN and
inf propagation is expected from their arithmetic (NaN scores reach the exp sums, V is
multiplied by the softmax weights; OPUS normalises with `l > 0 ? 1 / l : 0`, which a NaN
sum keeps NaN through the NaN accumulator) but unverified, and so is whether the kernels
load K/V rows past a sequence's end (the CK tile windows are bounded by the sequence's
length, OPUS's buffer descriptors by it: loads past it read 0; graphsafe's contract says
rows outside the sequences are not read).
"""

from __future__ import annotations

import torch

from graphsafe import aiter_support, device_info
from graphsafe.registry import SUPPORTED, Backend, Support, declined
from graphsafe.workspace import current_workspace_manager

# Head sizes ceil(max/8)*8 above this are rejected by aiter's varlen TORCH_CHECKs.
MAX_VARLEN_HEAD = 256
VARLEN_OWNER = "flash_attn_varlen"
# The head dims (q.k, v) aiter's OPUS kernel serves on gfx950 in bf16, and the release that
# added it.
OPUS_HEADS, OPUS_RELEASE = (192, 128), "0.1.18"


def opus_serves(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether aiter routes a varlen call of these q / v to its OPUS kernel (module
    docstring): gfx950, bf16, head dims 192 / 128, an aiter of OPUS_RELEASE or later (or
    one whose version cannot be read). `AITER_DISABLE_FMHA_OPUS`, read by aiter per call,
    is not: OPUS is assumed."""
    if device_info.rocm_arch(q.device) != "gfx950" or q.dtype != torch.bfloat16:
        return False
    if (q.shape[-1], v.shape[-1]) != OPUS_HEADS:
        return False
    version = aiter_support.aiter_version()
    return version is None or aiter_support.release_at_least(version, OPUS_RELEASE) is not False


# -- varlen prefill -------------------------------------------------------------------------
def supports_flash_attn_varlen(call) -> Support:
    """The architectures of the capability table; bf16/fp16 inputs with `fp8="off"`
    (fp8 goes to Triton); at least one sequence (aiter: "batch size must be postive");
    head dims that aiter's TORCH_CHECKs take after padding them to a multiple of 8
    (<= 256); no sliding window, softcap or sinks (not adapted: Triton serves them); where
    aiter's OPUS kernel serves the call (`opus_serves`), a scale > 0 (or NaN)."""
    q, v = call.q, call.v
    if not aiter_support.serves("flash_attn_varlen", q.device):
        archs = ", ".join(aiter_support.CAPABILITIES["flash_attn_varlen"].archs)
        return declined(f"aiter serves flash_attn_varlen on {archs}; this device is "
                        f"{device_info.rocm_arch(q.device) or q.device.type}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        return declined(f"q is {q.dtype}: the aiter adapter takes bfloat16/float16 inputs (fp8 inputs run on Triton)")
    if call.fp8 != "off":
        return declined(f"fp8={call.fp8!r}: aiter's fp8 varlen path is not graphsafe's per-tensor quantisation "
                        "(Triton serves it; pass fp8='off' for aiter)")
    if call.cu_seqlens_q.shape[0] < 2:
        return declined("no sequence (cu_seqlens_q has 1 entry): aiter rejects a batch size of 0")
    head = max(q.shape[-1], v.shape[-1])
    if -(-head // 8) * 8 > MAX_VARLEN_HEAD:
        return declined(f"head dim {head} (padded to {-(-head // 8) * 8}) is over {MAX_VARLEN_HEAD}, "
                        "the largest aiter's varlen kernels take")
    if call.window_left != -1:
        return declined(f"window_left={call.window_left}: the sliding window is not adapted to aiter (Triton serves "
                        "it)")
    if call.softcap != 0.0:
        return declined(f"softcap={call.softcap}: the softcap is not adapted to aiter (Triton serves it)")
    if call.sinks is not None:
        return declined("sinks: attention sinks are not adapted to aiter (Triton serves them)")
    if call.scale <= 0 and opus_serves(q, v):
        return declined(f"scale={call.scale}: aiter's OPUS kernel (gfx950, bf16, head dims 192 / 128) replaces a "
                        "scale <= 0 by 1/sqrt(192) (Triton serves it)")
    return SUPPORTED


def prepare_flash_attn_varlen(call):
    """The runner of this (supported) call signature: the bounds launch, aiter's call and
    the launch zeroing the rows outside every sequence, bound here."""
    q, k, v = call.q, call.k, call.v
    tq, hq, _ = q.shape
    tk, dv = k.shape[0], v.shape[-1]
    batch = call.cu_seqlens_q.shape[0] - 1
    shape, dtype, device = (tq, hq, dv), q.dtype, q.device
    if tq * hq * dv == 0 or tk == 0 or call.max_seqlen_q == 0 or call.max_seqlen_k == 0:
        # No output element, or no row that sees a key: 0 everywhere (the contract).
        def run_zeros(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                      q_descale=None, k_descale=None, v_descale=None, fp8="off", window_left=-1, softcap=0.0,
                      sinks=None):
            return torch.zeros(shape, dtype=dtype, device=device)

        return run_zeros

    import aiter

    from graphsafe.ops.attention.kernels.triton_quant import bind_prepare
    from graphsafe.ops.attention.kernels.triton_sequence_bounds import bind_sequence_bounds

    varlen = aiter.flash_attn_varlen_func
    grad_enabled = torch.is_grad_enabled
    specs = (((batch + 1,), torch.int32), ((batch + 1,), torch.int32))
    bounds = bind_sequence_bounds(call.cu_seqlens_q, batch, tq, tk)
    zero_outside = bind_prepare(q, batch, tq, hq * dv, False)

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            q_descale=None, k_descale=None, v_descale=None, fp8="off", window_left=-1, softcap=0.0, sinks=None):
        cu_q, cu_k = current_workspace_manager(device).get_simultaneous(*specs, owner=VARLEN_OWNER)
        bounds(cu_seqlens_q, cu_seqlens_k, cu_q, cu_k)
        # One tensor back when no LSE / probabilities are asked (mha.py:FlashAttnVarlenFunc),
        # which aiter allows only without grad (module docstring).
        if grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            with torch.no_grad():
                out = varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
                             causal=causal)
        else:
            out = varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
                         causal=causal)
        if not out.is_contiguous():  # Dv not a multiple of 8: a slice of aiter's padded output
            out = out.contiguous()
        zero_outside(out, cu_q, out)
        return out

    return run


# -- the records ------------------------------------------------------------------------------
FLASH_ATTN_VARLEN = Backend(name="aiter", prepare=prepare_flash_attn_varlen, supports=supports_flash_attn_varlen)
