"""The numbers of the fp8 prefill path that the reference (`fp8.py`) and the Triton
kernels (`kernels/triton_quant.py`, `kernels/triton_prefill.py`) share. A leaf module: it imports
nothing of graphsafe, so both sides can import it without importing each other."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Floor of a tensor's amax: an all-zero (or empty) tensor quantises to zeros, not NaN.
AMAX_EPS = 1e-12
# Softmax probabilities (<= 1) are multiplied by this before their fp8 cast for the P.V
# product, so that p down to 2^-17 stays representable (e4m3's smallest subnormal is 2^-9).
P_SCALE = 256.0
