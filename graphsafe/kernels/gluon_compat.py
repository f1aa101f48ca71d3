"""Gluon names that moved between Triton releases, resolved once for the sm_90 kernels.

Triton 3.6 (the GPU machines' Triton) and 3.7+ spell four Hopper operations differently
with the same arguments: cp.async global -> shared (`async_copy_global_to_shared`, then
`async_load`), the TMA copies global -> shared (the same two names in the `tma` module)
and shared -> global (`async_copy_shared_to_global`, then `async_store`) and
the CTA-wide barrier, bar.sync (`thread_barrier`, then `barrier`), and a shared buffer
reinterpreted (`_reinterpret`, then `reinterpret`).
Imported only where Gluon exists (Triton >= 3.4), by the Gluon kernels' modules.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma

cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


# A shared buffer seen with another shape or layout: `_reinterpret` in Triton 3.6,
# `reinterpret` from 3.7 on.
if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def nvmma_chunks(smem, dtype: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr):
        """`smem` as [D0, D1, D2] of `dtype` in the default NVMMA layout of [D1, D2]."""
        return smem.reinterpret(dtype, [D0, D1, D2], gl.NVMMASharedLayout.get_default_for([D1, D2], dtype))
else:
    @gluon.jit
    def nvmma_chunks(smem, dtype: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr):
        """`smem` as [D0, D1, D2] of `dtype` in the default NVMMA layout of [D1, D2]."""
        return smem._reinterpret(dtype, [D0, D1, D2], gl.NVMMASharedLayout.get_default_for([D1, D2], dtype))
