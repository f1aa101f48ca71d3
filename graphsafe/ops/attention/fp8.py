"""The FP8 prefill path of `flash_attn_varlen`: the device probe, the mode resolution,
and the per-tensor quantisation the reference uses (the seed PR vLLM #42509 pattern).

Quantisation of one tensor x (bf16/fp16): `descale = max(amax(|x|), AMAX_EPS) / 448`
(float32, IEEE division; NaN when x holds a NaN or inf anywhere), `x8 = clamp(x /
descale, -448, 448)` rounded to nearest-even float8_e4m3fn (NaN stays NaN). The Triton kernels
(`kernels/triton_quant.py`) compute the very same bits; the constants both use live in the leaf
module `fp8_format.py`.
"""

from __future__ import annotations

import threading

import torch

from graphsafe.device_info import has_fp8_matrix_units
from graphsafe.errors import GraphsafeError
from graphsafe.ops.attention.fp8_format import AMAX_EPS, FP8_DTYPE, FP8_MAX

MODES = ("auto", "on", "off")

_probe_lock = threading.Lock()
_probe_results: dict[torch.device, bool] = {}


def _normalise(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def fp8_prefill_supported(device: torch.device | str) -> bool:
    """True when `flash_attn_varlen` can take its fp8 path on `device`: the device has
    fp8 matrix units (sm89+, gfx942+) AND a tiny fp8 Triton kernel compiles there and
    gives the right answer. Cached per device; the first call runs the probe (a kernel
    launch and a host sync), so call it (or run the op once) before capturing a graph.
    False on the CPU and wherever Triton is missing."""
    device = _normalise(device)
    cached = _probe_results.get(device)
    if cached is not None:
        return cached
    if device.type != "cuda" or not has_fp8_matrix_units(device):
        result = False
    else:
        if torch.cuda.is_current_stream_capturing():
            raise GraphsafeError(
                f"fp8_prefill_supported({device}) is probed for the first time while a CUDA graph is being "
                "captured; the probe launches a kernel and syncs. Call it (or run flash_attn_varlen once) "
                "before capture."
            )
        result = _run_probe(device)
    with _probe_lock:
        _probe_results.setdefault(device, result)
    return _probe_results[device]


def _run_probe(device: torch.device) -> bool:
    try:
        from graphsafe.ops.attention.kernels.triton_quant import run_fp8_probe

        return run_fp8_probe(device)
    except Exception:  # noqa: BLE001 - any failure (no Triton, no fp8 codegen) means "unsupported"
        return False


def quantize_inputs(mode: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16/fp16 inputs are quantised to fp8: "on" always (the reference emulates
    it anywhere), "off" never, "auto" where `fp8_prefill_supported(device)`."""
    if dtype == FP8_DTYPE:
        return False  # already fp8: nothing to quantise
    if mode == "on":
        return True
    if mode == "auto":
        return fp8_prefill_supported(device)
    return False


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 float8_e4m3fn, descale f32 `[1]`) with x ~= x8 * descale. No host sync."""
    amax = x.abs().amax().float() if x.numel() > 0 else x.new_zeros((), dtype=torch.float32)
    # Divide by a tensor, not a Python float: CUDA turns `tensor / scalar` into a multiply
    # by the rounded reciprocal (not IEEE division), so the descale would differ by an ulp
    # from the kernels' and the CPU's (seen on an H200: 17 to 140790 bytes of V^T off by one).
    descale = torch.clamp(amax, min=AMAX_EPS) / amax.new_full((), FP8_MAX)
    # A NaN or inf anywhere in x: descale NaN, so every element quantises to NaN (an inf
    # amax alone would turn the finite elements into 0 and keep going, silently).
    descale = torch.where(torch.isfinite(amax), descale, amax.new_full((), float("nan")))
    x8 = (x.float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8, descale.reshape(1)
