"""Where `flash_attn_varlen` runs its sm_90 Gluon kernels (kernels/gluon_prefill.py), and their launch.

Three Gluon kernels serve the plain bf16/fp16 call on Hopper (a positive softmax scale,
no variant: window, softcap, sinks), chosen by `varlen_kernel`:
- "tma": persistent, warp-specialised, K/V/q by TMA: 128-row blocks at D = Dv = 128 and
  at MLA prefill's D = 192, Dv = 128, for q, k, v whose heads are contiguous (TMA reads
  them as 2-D [tokens, heads * head dim]);
- "ws": the same with 16-byte cp.async copies, for D = Dv = 128 in other layouts;
- "wgmma": one partition, for 64-row blocks (every sequence short) and D = Dv = 64.
The fp8 path runs the "tma" kernel with fp8 wgmma at D = Dv = 128 and 128-row blocks
(`wgmma_varlen_fp8_fits`): on fp8 inputs (q, k as given, V^T from its transposed copy)
and on bf16/fp16 inputs, from the fp8 copies of q, k and V^T the op quantises them into.
Everything else, and any call whose q, k or v is not 16-byte aligned, runs the Triton
kernel, as does every call of a signature whose Gluon kernel failed to compile (a
warning says so once). The decision on shapes, strides, dtype and device is made once
per signature (`wgmma_varlen_fits`); the alignment per call.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import triton
from triton.runtime import OutOfResources

from graphsafe.device_info import num_sms
from graphsafe.launch import Launch, bind
from graphsafe.ops.mla.splits import max_shared_memory

LOG2E = 1.4426950408889634
# What a failed Gluon compile raises (RuntimeError: a failed MLIR pass).
_COMPILE_ERRORS = (OutOfResources, triton.CompilationError, RuntimeError)
# Signatures (dtype, head dims, tiles, causal, kernel, warp specialisation) whose Gluon kernel failed to compile.
_FAILED: set[tuple] = set()


@functools.cache
def _gluon_module():
    """The kernel's module, or None where this Triton has no Gluon (imported on first use:
    CPU runs and other GPUs never need it)."""
    try:
        from graphsafe.ops.attention.kernels import gluon_prefill
    except (ImportError, AttributeError):  # no Gluon, or one without the Hopper ops used
        return None
    return gluon_prefill


def _compile_failed(key: tuple, exc: Exception) -> None:
    """Remember that the Gluon kernel of signature `key` did not compile (its later calls
    and bindings run the Triton kernel at once) and say so, once per signature."""
    if key not in _FAILED:
        _FAILED.add(key)
        warnings.warn(f"graphsafe flash_attn_varlen: the sm_90 Gluon kernel did not compile for {key} ({exc}); "
                      "running the Triton kernel", RuntimeWarning, stacklevel=3)


def _sm90_gluon(device: torch.device):
    """The Gluon kernels' module where they can run on `device` (an sm_90 CUDA GPU, not
    HIP, a Triton with Gluon), else None."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    module = _gluon_module()
    if module is None or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    return module


def tma_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q, k and v can be read by TMA as 2-D [tokens, heads * head dim]: each
    head's row follows the previous head's (head stride = head dim), and there are
    tokens (a descriptor has no empty dimension)."""
    return all(x.stride(1) == x.shape[2] and x.shape[0] > 0 for x in (q, k, v))


def varlen_kernel(max_seqlen_q: int, d: int, dv: int, tma: bool) -> str | None:
    """Which Gluon kernel runs (module docstring), or None: the Triton kernel."""
    long_rows = max_seqlen_q > 64  # 128-row blocks
    if long_rows and tma and (d, dv) in ((128, 128), (192, 128)):
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


def tma_q_buffers(d: int) -> int:
    """q buffers of the "tma" kernel: two (the next work tile's q loads while this one
    computes), one at D = 192, where two would not leave room for 128-key tiles (a q
    buffer is released after its last q.k, so its refill overlaps the last p.V)."""
    return 1 if d == 192 else 2


def _shared_memory(module, kernel: str, block_m: int, block_n: int, d: int, dv: int) -> int:
    ws = warp_specialisation(kernel, d)
    stages, q_buffers = (2, 1) if ws is None else (ws[0], tma_q_buffers(d) if kernel == "tma" else 2)
    return module.shared_memory_bytes(block_m, block_n, d, dv, stages, q_buffers)


def wgmma_varlen_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, scale: float,
                      variants: bool) -> bool:
    """Whether this call signature runs a Gluon kernel (alignment aside): an sm_90 CUDA
    device, q, k, v of one 16-bit dtype with head dims one of the kernels serves
    (`varlen_kernel`), unit strides along D, a finite positive scale, no variant, the
    shared memory of the launch, and row strides the copies can use: TMA's token stride a
    whole number of 16 bytes; the 16-byte cp.async copies' token and head strides
    multiples of 16 elements (what Triton's specialisation of an int proves: with 8, the
    copies cannot be proven 16-byte aligned and the kernel does not compile)."""
    if variants or q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    module = _sm90_gluon(q.device)
    if module is None:
        return False
    d, dv = q.shape[2], v.shape[2]
    kernel = varlen_kernel(max_seqlen_q, d, dv, tma_views(q, k, v))
    if kernel is None or not (math.isfinite(scale) and scale > 0):
        return False
    if any(x.stride(2) != 1 for x in (q, k, v)):
        return False
    if kernel == "tma":
        if any(x.stride(0) % 8 for x in (q, k, v)):
            return False
    elif any(x.stride(0) % 16 or x.stride(1) % 16 for x in (q, k, v)):
        return False
    smem = max_shared_memory(q.device)
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    return smem is not None and _shared_memory(module, kernel, block_m, block_n, d, dv) <= smem


def bind_wgmma_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
                      scale: float, causal: bool, triton_launch: Launch) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k, v, out, cu_q, cu_k, *rest)` into a
    contiguous `out` [Tq, Hq, Dv]: the Gluon kernel (which reads no `rest`: descales and
    sinks, placeholders here) for 16-byte aligned q, k, v, else `triton_launch`."""
    module = _gluon_module()
    tq, hq, d = q.shape
    tk, hk, dv = v.shape
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    kernel = varlen_kernel(max_seqlen_q, d, dv, tma_views(q, k, v))
    ws = warp_specialisation(kernel, d)
    key = (q.dtype, d, dv, block_m, block_n, causal, kernel, ws)
    wgmma = None
    if key not in _FAILED:
        work = num_m_blocks * num_seqs * hq
        meta = {"GROUP": hq // hk, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal}
        sizes = (scale * LOG2E, hq, num_m_blocks, tq, tk)
        if kernel == "tma":  # persistent: a program per SM walks the work tiles
            stages, consumer_regs, loader_regs = ws
            descriptors = module.tma_descriptors(q, k, v, block_n)  # templates: each call's q, k, v
            wgmma = bind(module.varlen_fwd_tma_kernel, (min(work, num_sms(q.device)),), *descriptors,
                         q, q, q, q, q, q,  # out, cu_q, cu_k; descales (not read without FP8)
                         hq * dv, dv, *(0,) * 6, *sizes, num_seqs, **meta, DK=d, DV=dv, STAGES=stages,
                         CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, FP8=False,
                         Q_BUFFERS=tma_q_buffers(d), num_warps=4)
        else:
            args = (q, q, q, q, q, q,  # placeholders: only their device is read
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), hq * d, d, *sizes)
            if kernel == "wgmma":
                wgmma = bind(module.varlen_fwd_wgmma_kernel, (work,), *args, **meta, D=d, num_warps=block_m // 16)
            else:
                stages, consumer_regs, loader_regs = ws
                wgmma = bind(module.varlen_fwd_ws_kernel, (min(work, num_sms(q.device)),), *args, num_seqs, **meta,
                             D=d, STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)

    # The TMA kernel's descale pointers (read by its fp8 variant only): placeholders.
    placeholders = 3 if kernel == "tma" else 0

    def launch(q, k, v, out, cu_q, cu_k, *rest):
        nonlocal wgmma
        if wgmma is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            try:
                return wgmma(q, k, v, out, cu_q, cu_k, *(q,) * placeholders)
            except _COMPILE_ERRORS as exc:  # nothing ran: the Triton kernel runs the call
                wgmma = None
                _compile_failed(key, exc)
        triton_launch(q, k, v, out, cu_q, cu_k, *rest)

    return launch


def wgmma_varlen_fp8_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
                          variants: bool, copies: bool = False) -> bool:
    """Whether this fp8 call signature runs the fp8 "tma" kernel (alignment aside): an
    sm_90 CUDA device, D = Dv = 128, 128-row blocks, no variant, the shared memory, and
    q and k float8_e4m3fn TMA views (heads contiguous, token strides of whole 16-byte
    groups) or, `copies`, bf16/fp16 inputs the op quantises into contiguous fp8 copies.
    (The V^T copy the fp8 path writes is always a TMA view.)"""
    dtypes = (torch.float16, torch.bfloat16) if copies else (torch.float8_e4m3fn,)
    if variants or q.dtype not in dtypes or k.dtype != q.dtype:
        return False
    module = _sm90_gluon(q.device)
    if module is None:
        return False
    d, dv = q.shape[2], v.shape[2]
    if not (d == dv == 128 and max_seqlen_q > 64 and q.shape[0] > 0 and k.shape[0] > 0):
        return False
    if not copies and any(x.stride(2) != 1 or x.stride(1) != d or x.stride(0) % 16 for x in (q, k)):
        return False
    smem = max_shared_memory(q.device)
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    return smem is not None and fp8_shared_memory(module, block_m, block_n, d, dv) <= smem


def fp8_shared_memory(module, block_m: int, block_n: int, d: int, dv: int) -> int:
    """The fp8 kernel's shared memory: 1-byte q buffers and K / V^T stages, and each
    consumer's p [64, BLOCK_N]."""
    return module.shared_memory_bytes(block_m, block_n, d, dv, warp_specialisation_fp8()[0], 2, 1, 2)


def warp_specialisation_fp8() -> tuple[int, int, int]:
    """(stages, consumer registers, loader registers) of the fp8 "tma" kernel. Measured on
    an H200 (32/8 heads, causal, fp8 inputs; 8 x 2048, 8 x 4096, 4 x 8192 in ms, CUDA-graph
    replays): 2 stages 232 / 32 0.493, 1.616, 2.966; 3 stages 0.498, 1.642, 3.033; 4 stages
    0.506, 1.649, 3.019; 3 stages 240 / 24 0.517, 1.656, 3.004 (the Triton fp8 kernel
    0.563, 1.869, 3.480)."""
    return 2, 232, 32


def bind_wgmma_varlen_fp8(q: torch.Tensor, k: torch.Tensor, vt_shape: tuple[int, int, int], num_seqs: int,
                          max_seqlen_q: int, scale: float, causal: bool,
                          descale_strides: tuple[tuple[int, int], ...], triton_launch: Launch | None,
                          copies: bool = False) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k, vt, out, cu_q, cu_k, q_descale,
    k_descale, v_descale, sinks)` (fp8 q, k; V^T `vt` of shape `vt_shape`; out contiguous
    [Tq, Hq, Dv]): the fp8 Gluon kernel (which reads no sinks: a placeholder here) for
    16-byte aligned q, k, vt, else `triton_launch`. `descale_strides`: each descale's
    (sequence, kv head) strides, (0, 0) for one value per tensor. `copies`: q and k are
    bf16/fp16 inputs whose contiguous fp8 copies each call passes instead; then
    `triton_launch` may be None, and a call the Gluon kernel cannot run (a failed
    compile) returns False for the caller to run it its own way."""
    module = _gluon_module()
    tq, hq, d = q.shape
    tk, hk = k.shape[:2]
    fp8 = torch.float8_e4m3fn
    like = torch.empty(0, dtype=fp8, device=q.device)
    if copies:
        q_view, k_view = (q.shape, hq * d), (k.shape, hk * d)
    else:
        q_view, k_view = (q.shape, q.stride(0)), (k.shape, k.stride(0))
    dv = vt_shape[1]
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    ws = warp_specialisation_fp8()
    key = (q.dtype, d, dv, block_m, block_n, causal, "tma-fp8", ws)
    wgmma = None
    if key not in _FAILED:
        stages, consumer_regs, loader_regs = ws
        work = num_m_blocks * num_seqs * hq
        descriptors = module.tma_descriptors_fp8(like, q_view, k_view, vt_shape, block_n)  # templates
        strides = tuple(x for pair in descale_strides for x in pair)
        wgmma = bind(module.varlen_fwd_tma_kernel, (min(work, num_sms(q.device)),), *descriptors,
                     q, q, q, q, q, q,  # out, cu_q, cu_k, the descales: only their device is read
                     hq * dv, dv, *strides, scale * LOG2E, hq, num_m_blocks, tq, tk, num_seqs,
                     GROUP=hq // hk, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, DK=d, DV=dv, STAGES=stages,
                     CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, FP8=True, Q_BUFFERS=2, num_warps=4)

    def launch(q, k, vt, out, cu_q, cu_k, q_descale, k_descale, v_descale, sinks) -> bool:
        """Whether the call ran (False only without a `triton_launch`: the caller runs it)."""
        nonlocal wgmma
        if wgmma is not None and not (q.data_ptr() | k.data_ptr() | vt.data_ptr()) & 15:
            try:
                wgmma(q, k, vt, out, cu_q, cu_k, q_descale, k_descale, v_descale)
                return True
            except _COMPILE_ERRORS as exc:  # nothing ran: the Triton kernel runs the call
                wgmma = None
                _compile_failed(key, exc)
        if triton_launch is None:
            return False
        triton_launch(q, k, vt, out, cu_q, cu_k, q_descale, k_descale, v_descale, sinks)
        return True

    return launch
