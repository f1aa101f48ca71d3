"""Triton backend of the paged-cache writes: the host side (records, prepare, runners).

`prepare_*(call)` take the call signature's choice once (`plan.choose_*`: no token, the
copy of values or e4m3 bytes, or fp8_ds_mla records; the block sizes) and bind its
kernel (`graphsafe.launch.bind`; kernels/triton_copy.py, kernels/triton_ds_mla.py,
whose docstrings describe them); the runners they return launch it with the tensors
alone. fp8 caches are written through their uint8 view. Kernel modules are imported
when a signature is first bound, never at import time: `import graphsafe` does not
import triton.
"""

from __future__ import annotations

import torch

from graphsafe.formats import fp8_ds_mla as ds_mla
from graphsafe.launch import bind
from graphsafe.ops.cache.plan import choose_concat_and_cache_mla, choose_reshape_and_cache
from graphsafe.registry import Backend


def _nothing(*args, **kwargs) -> None:
    return None


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The uint8 view of an fp8 cache (same strides): the kernel stores the e4m3fn bytes."""
    return cache.view(torch.uint8)


def _prepare_records(call, choice):
    """The fp8_ds_mla write: one program per token (a record is 656 bytes for DeepSeek)."""
    from graphsafe.ops.cache.kernels.triton_ds_mla import _concat_and_cache_ds_mla_kernel

    kv_c, k_pe, kv_cache = call.kv_c, call.k_pe, call.kv_cache
    t, r = kv_c.shape
    p = k_pe.shape[1]
    nb, bs = kv_cache.shape[:2]
    launch = bind(
        _concat_and_cache_ds_mla_kernel, (t,),
        kv_c, k_pe, kv_cache, call.slot_mapping,
        nb * bs, bs,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=r, P=p, TILE=ds_mla.TILE, **dict(choice.blocks),
    )

    def run(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
        launch(kv_c, k_pe, kv_cache, slot_mapping)

    return run


def prepare_concat_and_cache_mla(call):
    choice = choose_concat_and_cache_mla(call)
    if choice.kernel == "none":
        return _nothing
    if choice.kernel == "records":
        return _prepare_records(call, choice)
    from graphsafe.ops.cache.kernels.triton_copy import _concat_and_cache_mla_kernel

    kv_c, k_pe, kv_cache, scale = call.kv_c, call.k_pe, call.kv_cache, call.scale
    t, r = kv_c.shape
    p = k_pe.shape[1]
    quant = choice.quant
    nb, bs = kv_cache.shape[:2]
    launch = bind(
        _concat_and_cache_mla_kernel, (t,),
        kv_c, k_pe, kv_cache, call.slot_mapping, scale if quant else kv_c,
        nb * bs, bs,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=r, P=p, QUANT=quant, **dict(choice.blocks),
    )

    def run(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
        launch(kv_c, k_pe, _bytes(kv_cache) if quant else kv_cache, slot_mapping, scale if quant else kv_c)

    return run


def prepare_reshape_and_cache(call):
    choice = choose_reshape_and_cache(call)
    if choice.kernel == "none":
        return _nothing
    from graphsafe.ops.cache.kernels.triton_copy import _reshape_and_cache_kernel

    key, value, key_cache, value_cache = call.key, call.value, call.key_cache, call.value_cache
    t, hk, d = key.shape
    dv = value.shape[2]
    quant = choice.quant
    nb, bs = key_cache.shape[:2]
    launch = bind(
        _reshape_and_cache_kernel, (t,),
        key, value, key_cache, value_cache, call.slot_mapping,
        call.k_scale if quant else key, call.v_scale if quant else value,
        nb * bs, bs, hk,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        D=d, DV=dv, QUANT=quant, **dict(choice.blocks),
    )

    def run(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if quant:
            launch(key, value, _bytes(key_cache), _bytes(value_cache), slot_mapping, k_scale, v_scale)
        else:
            launch(key, value, key_cache, value_cache, slot_mapping, key, value)

    return run


# -- the records --------------------------------------------------------------------
CONCAT_AND_CACHE_MLA = Backend(name="triton", prepare=prepare_concat_and_cache_mla)
RESHAPE_AND_CACHE = Backend(name="triton", prepare=prepare_reshape_and_cache)
