"""The numbers of the fp8 prefill path that the reference (`fp8.py`), the plan (its
scratch: `plan.varlen_scratch`) and the Triton kernels (`kernels/triton_quant.py`,
`kernels/triton_prefill.py`) share. A leaf module: it imports nothing of graphsafe, so
each side can import it without importing the others (nor triton)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Floor of a tensor's amax: an all-zero (or empty) tensor quantises to zeros, not NaN.
AMAX_EPS = 1e-12
# Softmax probabilities (<= 1) are multiplied by this before their fp8 cast for the P.V
# product, so that p down to 2^-17 stays representable (e4m3's smallest subnormal is 2^-9).
P_SCALE = 256.0

# Scale slots of the fp8 path's float32 scratch `scales[SCALE_SLOTS]`: amax of q, k, v
# (atomic max targets, zeroed by the prepare kernel first), descales of k and v (written
# by the quantise kernel) and of q (written by the q quantise kernel, which the sm_90
# Gluon kernel's path runs), and a constant 1.0 (stands in for descales a caller left
# out). The attention kernels read the q amax, the descales and the 1.0 through pointers
# of their own: each starts a 16-byte group, as a bound launch needs of its tensors
# (`graphsafe.launch`: a misaligned one takes Triton's slow binder), and the q amax is
# slot 0, so `scales` itself points at it. (A power of two: the prepare kernel resets
# them with one arange.)
SCALE_SLOTS = 32
AMAX_Q, AMAX_K, AMAX_V, DESCALE_K, DESCALE_V, ONE, DESCALE_Q = 0, 1, 2, 4, 8, 12, 16


def vt_columns(n_tokens: int) -> int:
    """Token columns of a V^T buffer: T rounded up to 16 (16-byte aligned fp8 rows)."""
    return -(-n_tokens // 16) * 16
