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
e4m3fn inputs to e4m3fnuz copies: those go to Triton. Taken:
* e4m3fn q and k, H and D powers of two (aiter asserts it);
* `64 <= D <= 1024`: the Gluon kernel multiplies with MFMA instructions whose K is 64 or
  128 (`AMDMFMALayout(instr_shape=[32, 32, 64] or [16, 16, 128])`, K = the head dim) and
  lays Q out as D / 16 lanes of a 64-lane wave. At D 16 and 32 Triton's AMD backend
  aborts the process while compiling it (an LLVM assertion, SIGFPE on Triton 3.6: checked
  with Triton 3.9 for gfx950, H 16 to 64), which no caller can catch or fall back from;
  D 64 to 1024 compile (D 1024 at H <= 32 takes 146 KiB of the 160 KiB of LDS);
* a unit-stride `k_scale` (and `ks`, `ke`, which the op's checks already make
  contiguous): the kernel reads `kv_scales_ptr + offset + arange(BLOCK_KV)`
  (`_load_kv_scales_block`) and `cu_start_ptr + row`, ignoring strides; q, k and the
  weights are read with their strides;
* q and the weights within 2 GiB of their base: the kernel reads them with buffer loads
  (`gl.amd.cdna4.buffer_load`, a 32-bit offset);
* at least one query and one key.
Small H on the Gluon kernel has not run on hardware.
Allocations per call: aiter allocates its output itself, a `[M, ceil(N / 256) * 256]`
float32 buffer, and returns its `[:, :N]` view. Where N is a multiple of 256 that view is
the whole buffer, contiguous: aiter fills it with -inf (`clean_logits=True`) and it is
returned as it is. Otherwise it is not contiguous (graphsafe's output is): aiter is called
with `clean_logits=False` (no -inf fill; its kernel writes only the windows) and a Triton
launch (kernels/triton_aiter_window.py) writes the contiguous `[M, N]` output from the
windows, -inf elsewhere, reading nothing outside them. Both are ordinary allocations
(capturable: the graph pool serves them), not workspace.

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
from graphsafe.launch import output_allocator
from graphsafe.registry import SUPPORTED, Backend, Support, declined

_GLUON_TRITON = (3, 6)  # aiter: TRITON_GE_36 gates the Gluon kernels
MQA_MODULES = ("aiter.ops.triton.attention.fp8_mqa_logits", "aiter.ops.triton.fp8_mqa_logits")
# The head dims the gfx950 Gluon kernel compiles (module docstring).
MIN_HEAD_DIM, MAX_HEAD_DIM = 64, 1024
# aiter pads its output's rows to a multiple of this many columns.
ALIGN = 256
# Buffer loads take a 32-bit byte offset.
BUFFER_LIMIT = 2**31


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
    if not (_pow2(d) and MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
        return declined(f"aiter's gfx950 Gluon kernel takes a head dim D that is a power of two in "
                        f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (MFMA K of 64 or 128; D 16 and 32 abort the process in "
                        f"Triton's compiler), got D = {d}")
    n = k.shape[0]
    if m == 0 or n == 0:
        return declined(f"aiter needs at least one query and one key, got M = {m}, N = {n}")
    if n > 1 and call.k_scale.stride(0) != 1:
        return declined(f"aiter reads kv_scales with unit stride (its kernel ignores strides); k_scale has stride "
                        f"{call.k_scale.stride(0)}: pass a contiguous k_scale")
    weights = call.weights
    for name, x in (("q", q), ("weights", weights)):
        end = (sum((size - 1) * stride for size, stride in zip(x.shape, x.stride())) + 1) * x.element_size()
        if end > BUFFER_LIMIT:
            return declined(f"aiter's Gluon kernel reads {name} with buffer loads (32-bit byte offsets): its "
                            f"{end} bytes must stay within 2 GiB")
    return SUPPORTED


def prepare_fp8_mqa_logits(call):
    """The runner of this (supported) signature: aiter's call and, unless N is a multiple of
    ALIGN, the launch writing the contiguous output (module docstring)."""
    fn = _mqa_module().fp8_mqa_logits
    m, n = call.q.shape[0], call.k.shape[0]
    if n % ALIGN == 0:
        def run_whole(q, k, k_scale, weights, ks, ke):
            # aiter's [M, N] buffer, -inf outside each window (clean_logits=True, the default).
            return fn(q, k, k_scale, weights, ks, ke)

        return run_whole

    from graphsafe.ops.indexer.kernels.triton_aiter_window import bind_window_copy

    copy = bind_window_copy(call.q, m, n, -(-n // ALIGN) * ALIGN)
    new_out = output_allocator((m, n), torch.float32, call.q.device)

    def run(q, k, k_scale, weights, ks, ke):
        windows = fn(q, k, k_scale, weights, ks, ke, clean_logits=False)  # only the windows written
        out = new_out()
        copy(windows, ks, ke, out)
        return out

    return run


# -- the records (graphsafe/ops/indexer/__init__.py names them) ------------------------------
FP8_MQA_LOGITS = Backend(name="aiter", prepare=prepare_fp8_mqa_logits, supports=supports_fp8_mqa_logits)
