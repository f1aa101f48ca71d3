"""aiter backend of the sparse-indexer ops (ROCm): `fp8_mqa_logits` on gfx950 only
(its record `FP8_MQA_LOGITS`).

Read against aiter v0.1.20-46-ge4048607a5 (commit e4048607a535ace3a2b51ded31b1c8c2d45c0879);
`graphsafe.aiter_support` holds the per-architecture decision. The record's `supports`
predicate accepts a call signature only where aiter's kernel has graphsafe's semantics;
the registry hands every other signature to Triton, once per signature.

`fp8_mqa_logits` (aiter/ops/triton/attention/fp8_mqa_logits.py:fp8_mqa_logits, plain
Python): served on gfx950 with Triton >= 3.6, where aiter launches its Gluon kernel
(aiter/ops/triton/_gluon_kernels/gfx950/attention/fp8_mqa_logits.py): `relu_f32` is
`gl.maximum(x, 0, propagate_nan=ALL)`, so relu(NaN) = NaN as graphsafe's contract says,
the key scale multiplies the head sum as in graphsafe's formula, and the windows are
clamped to `[max(ks, 0), min(ke, N))` like graphsafe's. Elsewhere aiter takes its Triton
kernel (aiter/ops/triton/_triton_kernels/attention/fp8_mqa_logits.py:_fp8_mqa_logits_kernel),
whose `tl.maximum(scores, 0.0)` takes relu(NaN) to 0, and on gfx942 it first converts
e4m3fn inputs to e4m3fnuz copies: those go to Triton. Taken: e4m3fn q and k, H and D
powers of two (aiter asserts it), `16 <= D <= 1024` (the Gluon Q layout spreads D / 16
lanes over a 64-lane wave), at least one query and one key. Small H on the Gluon
kernel has not run on hardware.
Allocations per call: aiter allocates its output itself, a `[M, ceil(N / 256) * 256]`
float32 buffer filled with -inf (`clean_logits=True`, the default), and returns its
`[:, :N]` view; unless N is a multiple of 256 that view is not contiguous and we copy it
into a contiguous `[M, N]` tensor (graphsafe's output contract). Both are ordinary
allocations (capturable: the graph pool serves them), not workspace.

Ops with no aiter backend any more (their records are gone; Triton serves them):
* `indexer_k_quant_and_cache` (aiter/ops/cache.py:indexer_k_quant_and_cache,
  csrc/kernels/cache_kernels.cu:indexer_k_quant_and_cache_kernel): the group amax is
  reduced with `fmaxf` / `v_max3_f32`, which drop NaN, so a NaN key gives a finite scale
  and saturated bytes where graphsafe stores NaN scales and values bit for bit; only
  `slot < 0` is skipped (a slot past the cache is written out of bounds); the block pitch
  comes from the sizes (`kv_cache.size(1) * kv_cache.size(2)`), never the strides; and on
  gfx942 it quantises to e4m3fnuz with max 240 (csrc/include/opus/opus.hpp:finfo<fp8_t>).
* `cp_gather_indexer_k_quant_cache` (aiter/ops/cache.py:cp_gather_indexer_k_quant_cache,
  csrc/kernels/cache_kernels.cu:cp_gather_indexer_k_quant_cache_kernel): a row at or past
  `cu_seq_lens[B]` reads its request index from shared memory no thread initialised and
  then the block table and cache at that index, and block ids are never checked; the
  prefill composite passes an upper bound of rows, so this would read out of bounds.
* `fp8_paged_mqa_logits` (aiter/ops/triton/attention/pa_mqa_logits.py:
  deepgemm_fp8_paged_mqa_logits, Gluon kernel aiter/ops/triton/gluon/pa_mqa_logits.py:
  _gluon_deepgemm_fp8_paged_mqa_logits): `gl.maximum(o, 0.0)` without NaN propagation
  takes relu(NaN) to 0; padding block ids (-1) are read as blocks; `context_lens` are
  not clamped (it writes past a row of `max_model_len` columns); H must be a multiple of
  `4096 // D` (its `ValQMPerThread` layout); and on gfx942 the kernel is compiled with
  e4m3fnuz pointers, so e4m3fn bytes are read as fnuz.
"""

from __future__ import annotations

import functools
import importlib
import re

import torch

from graphsafe import aiter_support, device_info
from graphsafe.registry import SUPPORTED, Backend, Support, declined

_GLUON_TRITON = (3, 6)  # aiter: TRITON_GE_36 gates the Gluon kernels
MQA_MODULES = ("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")


@functools.cache
def _module(*paths: str):
    for path in paths:
        try:
            return importlib.import_module(path)
        except Exception:  # noqa: BLE001 - older/newer aiter releases move these modules
            continue
    return None


def _mqa_module():
    return _module(*MQA_MODULES)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _triton_version() -> tuple[int, ...]:
    import triton  # aiter's kernels are Triton/Gluon ones: only asked once aiter may serve

    return tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])


def _runs_gluon(module) -> bool:
    """aiter's own choice (fp8_mqa_logits.py: `use_gluon = TRITON_GE_36 and
    _gluon_fp8_mqa_logits_kernel is not None`; the kernel import may fail and then aiter
    silently takes the Triton kernel, whose relu drops NaN)."""
    return _triton_version() >= _GLUON_TRITON and getattr(module, "_gluon_fp8_mqa_logits_kernel", None) is not None


# -- fp8_mqa_logits ----------------------------------------------------------------------------
def supports_fp8_mqa_logits(call) -> Support:
    """Whether aiter serves this call signature (else the Triton backend does), and why not."""
    q, k = call.q, call.k
    if not aiter_support.serves("fp8_mqa_logits", q.device):
        capability = aiter_support.CAPABILITIES["fp8_mqa_logits"]
        arch = device_info.rocm_arch(q.device) or q.device.type
        return declined(f"aiter serves fp8_mqa_logits on {', '.join(capability.archs)} only, not on {arch} "
                        f"({capability.why})")
    module = _mqa_module()
    if module is None:
        return declined(f"this aiter has no fp8_mqa_logits module (looked for {' and '.join(MQA_MODULES)})")
    if not _runs_gluon(module):
        version = ".".join(map(str, _triton_version()))
        return declined(f"aiter would run its Triton kernel, whose relu takes NaN to 0: its Gluon kernel needs "
                        f"Triton >= {'.'.join(map(str, _GLUON_TRITON))} (found {version}) and an importable "
                        "_gluon_fp8_mqa_logits_kernel")
    if q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn:
        return declined(f"aiter takes float8_e4m3fn q and k, got {q.dtype} and {k.dtype}")
    m, h, d = q.shape
    if not _pow2(h):
        return declined(f"aiter needs the head count H to be a power of two, got H = {h}")
    if not (_pow2(d) and 16 <= d <= 1024):
        return declined(f"aiter needs the head dim D to be a power of two in [16, 1024], got D = {d}")
    if m == 0 or k.shape[0] == 0:
        return declined(f"aiter needs at least one query and one key, got M = {m}, N = {k.shape[0]}")
    return SUPPORTED


def prepare_fp8_mqa_logits(call):
    fn = _mqa_module().fp8_mqa_logits

    def run(q, k, k_scale, weights, ks, ke):
        # clean_logits defaults to True: -inf outside each window.
        out = fn(q, k, k_scale, weights, ks, ke)
        return out if out.is_contiguous() else out.contiguous()

    return run


# -- the records (graphsafe/ops/indexer/__init__.py names them) ------------------------------
FP8_MQA_LOGITS = Backend(name="aiter", prepare=prepare_fp8_mqa_logits, supports=supports_fp8_mqa_logits)
