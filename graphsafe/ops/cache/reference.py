"""Reference backend of the paged-cache writes: the executable spec, vectorised PyTorch.

No boolean-mask indexing (it syncs on CUDA): padding tokens are redirected instead of
filtered out, see `scatter_tokens`.
"""

from __future__ import annotations

import torch

from graphsafe.formats import fp8_ds_mla as ds_mla
from graphsafe.registry import Backend

FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to the e4m3fn range, as float8_e4m3fn."""
    return (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def scatter_tokens(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache[s // block_size, s % block_size] = values[t] for each token t with slot s.

    Tokens whose slot is negative (padding) or past the cache are skipped. They still
    take part in the one index_put (no data-dependent shapes): each writes slot 0 with
    the value slot 0 ends up holding anyway, so duplicate writes agree.
    """
    if values.shape[0] == 0:
        return
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        # fp8: move the bytes (torch.where and Inductor have no fp8 promotion rules).
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    num_blocks, block_size = cache.shape[:2]
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    writes_slot0 = valid & (slots == 0)
    # A token that writes slot 0, if any. index_select, not values[t]: indexing with a
    # 0-dim tensor converts it to a Python int, a host sync.
    slot0_writer = writes_slot0.int().argmax().view(1)
    slot0_final = torch.where(writes_slot0.any(), values.index_select(0, slot0_writer)[0], cache[0, 0])
    target = torch.where(valid, slots, 0)
    keep = valid.view(-1, *([1] * (values.dim() - 1)))
    cache[target // block_size, target % block_size] = torch.where(keep, values, slot0_final)


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if cache.dtype == torch.float8_e4m3fn:
        assert scale is not None
        return quantize_fp8(x, scale)
    return x.to(cache.dtype)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    if ds_mla.holds_records(kv_cache):
        # fp8_ds_mla (the input check holds the layout). Every token is quantised, the
        # skipped ones too (no data-dependent shapes): records are independent rows and
        # scatter_tokens drops the skipped ones, so a skipped row never reaches the cache.
        scatter_tokens(kv_cache, slot_mapping, ds_mla.quantize_records(kv_c, k_pe))
        return
    entries = torch.cat([kv_c, k_pe], dim=-1)
    scatter_tokens(kv_cache, slot_mapping, _to_cache(entries, kv_cache, scale))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    scatter_tokens(key_cache, slot_mapping, _to_cache(key, key_cache, k_scale))
    scatter_tokens(value_cache, slot_mapping, _to_cache(value, value_cache, v_scale))


# -- the records --------------------------------------------------------------------
CONCAT_AND_CACHE_MLA = Backend(name="reference", impl=concat_and_cache_mla)
RESHAPE_AND_CACHE = Backend(name="reference", impl=reshape_and_cache)
