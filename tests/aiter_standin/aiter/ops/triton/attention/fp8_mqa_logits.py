"""aiter/ops/triton/attention/fp8_mqa_logits.py: the prefill indexer logits (stand-in).

aiter's `fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True)`
is plain Python (no pybind dtype table). Modelled here:
* its asserts: H and D powers of two (`x & (x - 1) == 0`, so 0 passes, as in aiter);
* its output: a `[M, ceil(N / 256) * 256]` float32 buffer, -inf with `clean_logits`
  (else uninitialised: NaN here), returned as the `[:, :N]` view (not contiguous unless
  N % 256 == 0);
* the kernel choice at import: the Gluon kernel when Triton >= 3.6 on gfx950 / gfx1250
  (`_gluon_fp8_mqa_logits_kernel`), else the Triton kernel `_fp8_mqa_logits_kernel`;
* the Gluon kernel: `out[m, n] = kv_scales[n] * sum_h w[m, h] * relu(q[m, h] . k[n])`
  with relu propagating NaN (`gl.maximum(..., propagate_nan=ALL)`), Q and KV bytes
  read as e4m3fn (`mfma_scaled` "e4m3"); its MFMA K is 64 or 128 and its Q layout
  spreads D / 16 lanes over a 64-lane wave, so D outside [64, 1024] does not compile:
  D 16 and 32 abort the process in Triton's AMD backend (an LLVM assertion), which the
  stand-in can only raise;
* what both kernels read: `kv_scales`, `cu_starts` and `cu_ends` with unit stride from
  their data pointers, whatever their strides (`kv_scales_ptr + offsets`,
  `cu_start_ptr + row`); Q, KV and the weights with their strides;
* the Triton kernel: `sum_h w[m, h] * max(kv_scales[n] * (q[m, h] . k[n]), 0)` with the
  scale applied per head before the ReLU and relu(NaN) = 0 (`tl.maximum` without NaN
  propagation); on gfx942, e4m3fn Q / KV are first converted into e4m3fnuz copies
  `(x.float() * 0.5).to(fnuz)` and `kv_scales` multiplied by 2 per converted operand;
* both: the window of row m is `[max(cu_starts[m], 0), min(cu_ends[m], N))`; only it
  is stored.
"""

import re

import torch
import triton

from aiter.jit.utils.chip_info import get_gfx

TRITON_GE_36 = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 6)
arch = get_gfx()


def _unit_stride(x, n: int):
    """The `n` elements a kernel reads from `x`'s data pointer with unit stride (IndexError
    where that runs past `x`'s storage: a GPU would read out of bounds)."""
    try:
        return torch.as_strided(x, (n,), (1,), x.storage_offset())
    except RuntimeError as exc:
        raise IndexError(f"reading {n} elements with unit stride runs past the tensor's storage: {exc}") from None


def _gluon_scores(q, kv, kv_scales, weights):
    """The Gluon gfx950 kernel's arithmetic, all rows and keys."""
    qf = q.view(torch.uint8).view(torch.float8_e4m3fn).float()
    kf = kv.view(torch.uint8).view(torch.float8_e4m3fn).float()
    head, dim = qf.shape[1:]
    if not 64 <= dim <= 1024:
        raise RuntimeError(f"Gluon fp8_mqa_logits: HEAD_SIZE {dim} does not compile (MFMA K 64 or 128, D / 16 lanes "
                           "of 64): Triton's compiler aborts the process")
    dots = torch.einsum("mhd,nd->mhn", qf, kf)
    return (torch.relu(dots) * weights.float()[:, :, None]).sum(1) * kv_scales.float()[None, :]


def _triton_scores(q, kv, kv_scales, weights):
    """The Triton kernel's arithmetic (after aiter's gfx942 fnuz conversion)."""
    scale = kv_scales.float()
    fnuz = torch.float8_e4m3fnuz
    if arch == "gfx942":
        if q.dtype != fnuz:
            q, scale = (q.float() * 0.5).to(fnuz), scale * 2.0
        if kv.dtype != fnuz:
            kv, scale = (kv.float() * 0.5).to(fnuz), scale * 2.0
    dots = torch.einsum("mhd,nd->mhn", q.float(), kv.float()) * scale[None, None, :]
    relu = torch.where(dots > 0, dots, torch.zeros((), dtype=dots.dtype))  # NaN -> 0
    return (relu * weights.float()[:, :, None]).sum(1)


_gluon_fp8_mqa_logits_kernel = _gluon_scores if TRITON_GE_36 and arch in ("gfx950", "gfx1250") else None


def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):
    seq_len, num_heads, head_size = Q.shape
    seq_len_kv = KV.shape[0]
    assert num_heads & (num_heads - 1) == 0, "num q. heads should be power of 2."
    assert head_size & (head_size - 1) == 0, "head size should be power of 2."
    aligned = (seq_len_kv + 255) // 256 * 256
    fill = float("-inf") if clean_logits else float("nan")
    logits = torch.full((seq_len, aligned), fill, dtype=torch.float32, device=Q.device)[:, :seq_len_kv]
    kernel = _gluon_fp8_mqa_logits_kernel or _triton_scores
    scores = kernel(Q, KV, _unit_stride(kv_scales, seq_len_kv), weights)
    start = _unit_stride(cu_starts, seq_len).to(torch.int64).clamp(min=0)[:, None]
    end = _unit_stride(cu_ends, seq_len).to(torch.int64).clamp(max=seq_len_kv)[:, None]
    cols = torch.arange(seq_len_kv, device=Q.device)[None, :]
    inside = (cols >= start) & (cols < end)
    logits.copy_(torch.where(inside, scores, logits))
    return logits
