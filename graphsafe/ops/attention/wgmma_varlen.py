"""Where `flash_attn_varlen` runs its sm_90 Gluon kernels (_gluon_prefill.py), and their launch.

The Gluon kernels (persistent and warp-specialised for 128-row blocks at D = 128,
single-partition otherwise: `warp_specialisation`) serve the plain bf16/fp16 call on
Hopper: head dims 64 or 128 with Dv = D, a positive softmax scale, no variant (window,
softcap, sinks), rows the 16-byte copies can address. Everything else, and any call whose q, k or v is not 16-byte
aligned, runs the Triton kernel, as does every call of a signature whose Gluon kernel
failed to compile (a warning says so once). The decision on shapes, strides, dtype and
device is made once per signature (`wgmma_varlen_fits`); the alignment per call.
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
# Signatures (dtype, head dim, tiles, causal, warp specialisation) whose Gluon kernel failed to compile.
_FAILED: set[tuple] = set()


@functools.cache
def _gluon_module():
    """The kernel's module, or None where this Triton has no Gluon (imported on first use:
    CPU runs and other GPUs never need it)."""
    try:
        from graphsafe.ops.attention import _gluon_prefill
    except (ImportError, AttributeError):  # no Gluon, or one without the Hopper ops used
        return None
    return _gluon_prefill


def wgmma_varlen_tiles(max_seqlen_q: int, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 128 query rows (two warpgroups) unless every sequence is
    short; 128 keys a tile at D = 128, 64 at D = 64 (measured on an H200, 8 x 4096
    causal, 32/8 heads: D = 128 2.60 ms with 128 keys vs 2.73 with 64; D = 64 1.52 vs
    1.84 ms)."""
    return (128 if max_seqlen_q > 64 else 64), (128 if d >= 128 else 64)


def warp_specialisation(block_m: int, d: int) -> tuple[int, int, int] | None:
    """(stages, consumer registers, loader registers) of the persistent warp-specialised
    kernel, which 128-row blocks at D = 128 run, or None: the single-partition kernel.
    Measured on an H200 (32/8 heads, causal; 8 x 2048, 8 x 4096, 4 x 8192 in ms):
    232 / 48 registers 0.661, 2.254, 4.326; 224 / 64 0.696, 2.436, 4.654; 216 / 80 0.715,
    2.386, 4.594 (the consumers spill); the single-partition kernel 0.730, 2.354, 4.527
    at best; the same kernel not persistent, 232 / 48: 0.725, 2.375, 4.555 (with 24
    loader registers 3.65 ms at 8 x 4096: the loader starves). At D = 64 the
    single-partition kernel is faster (3.02 vs 3.52 ms at 8 x 4096, 64/8 heads)."""
    return (2, 232, 48) if block_m == 128 and d == 128 else None


def wgmma_varlen_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int, scale: float,
                      variants: bool) -> bool:
    """Whether this call signature runs the Gluon kernel (alignment aside): an sm_90 CUDA
    device, q, k, v of one 16-bit dtype with D = Dv in the kernel's head dims, unit
    strides along D and row strides of whole 16-byte groups (what the copies need and
    Triton's specialisation proves), a finite positive scale, no variant."""
    if variants or q.device.type != "cuda" or torch.version.hip is not None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    module = _gluon_module()
    if module is None or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    d, dv = q.shape[2], v.shape[2]
    if d != dv or d not in module.HEAD_DIMS or not (math.isfinite(scale) and scale > 0):
        return False
    if any(x.stride(2) != 1 or x.stride(0) % 8 or x.stride(1) % 8 for x in (q, k, v)):
        return False
    smem = max_shared_memory(q.device)
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    ws = warp_specialisation(block_m, d)
    need = module.shared_memory_bytes(block_m, block_n, d, *((2,) if ws is None else (ws[0], 2)))
    return smem is not None and need <= smem


def bind_wgmma_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
                      scale: float, causal: bool, triton_launch: Launch) -> Launch:
    """A launch with `triton_launch`'s arguments, `(q, k, v, out, cu_q, cu_k, *rest)` into a
    contiguous `out` [Tq, Hq, D]: the Gluon kernel (which reads no `rest`: descales and
    sinks, placeholders here) for 16-byte aligned q, k, v, else `triton_launch`."""
    module = _gluon_module()
    tq, hq, d = q.shape
    tk, hk = k.shape[:2]
    block_m, block_n = wgmma_varlen_tiles(max_seqlen_q, d)
    num_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    ws = warp_specialisation(block_m, d)
    key = (q.dtype, d, block_m, block_n, causal, ws)
    wgmma = None
    if key not in _FAILED:
        args = (q, q, q, q, q, q,  # placeholders: only their device is read
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), hq * d, d,
                scale * LOG2E, hq, num_m_blocks, tq, tk)
        meta = {"GROUP": hq // hk, "D": d, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal}
        work = num_m_blocks * num_seqs * hq
        if ws is None:
            wgmma = bind(module.varlen_fwd_wgmma_kernel, (work,), *args, **meta, num_warps=block_m // 16)
        else:  # persistent: a program per SM walks the work tiles
            stages, consumer_regs, loader_regs = ws
            wgmma = bind(module.varlen_fwd_ws_kernel, (min(work, num_sms(q.device)),), *args, num_seqs, **meta,
                         STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, num_warps=4)

    def launch(q, k, v, out, cu_q, cu_k, *rest):
        nonlocal wgmma
        if wgmma is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            try:
                return wgmma(q, k, v, out, cu_q, cu_k)
            except _COMPILE_ERRORS as exc:  # nothing ran: the Triton kernel runs the call
                wgmma = None
                if key not in _FAILED:
                    _FAILED.add(key)
                    warnings.warn(f"graphsafe flash_attn_varlen: the sm_90 Gluon kernel did not compile for {key} "
                                  f"({exc}); running the Triton kernel", RuntimeWarning, stacklevel=2)
        triton_launch(q, k, v, out, cu_q, cu_k, *rest)

    return launch
