"""The logit softcap's tanh, shared by the attention kernels (decode, varlen, paged prefill)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh_of_exp2(y):
    """tanh(x) from `y = 2 x log2(e)` (each kernel folds that factor into its score scale):
    `1 - 2 / (2^y + 1)`. Nothing overflows: 2^y going to inf gives 1, to 0 gives -1, so
    +-inf scores cap to +-1 and NaN stays NaN."""
    return 1.0 - 2.0 / (tl.exp2(y) + 1.0)
