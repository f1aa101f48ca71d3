"""Fakes and input checks of the paged-cache writes (`concat_and_cache_mla`, `reshape_and_cache`)."""

from __future__ import annotations

import torch

from graphsafe import checks as c
from graphsafe.formats import fp8_ds_mla

SLOT_DTYPES = (torch.int64, torch.int32)
CACHE_FP8 = torch.float8_e4m3fn


def check_concat_and_cache_mla(call) -> None:
    op = "concat_and_cache_mla"
    kv_c, k_pe, kv_cache, slot_mapping, scale = call
    c.tensor(op, "kv_c", kv_c, dtypes=c.FLOAT_DTYPES, ndim=2)
    dev = kv_c.device
    t, r = kv_c.shape
    c.tensor(op, "k_pe", k_pe, ndim=2, device=dev)
    c.same_dtype(op, "k_pe", k_pe, "kv_c", kv_c)
    c.shape(op, "k_pe", k_pe, (t, None), "[T, P]")
    p = k_pe.shape[1]
    # A uint8 cache is an fp8_ds_mla cache (graphsafe.formats.fp8_ds_mla).
    c.tensor(op, "kv_cache", kv_cache, dtypes=(kv_c.dtype, CACHE_FP8, fp8_ds_mla.DTYPE), ndim=3, device=dev)
    if fp8_ds_mla.holds_records(kv_cache):
        _check_ds_mla_layout(op, kv_c, k_pe, kv_cache, scale)
    else:
        c.shape(op, "kv_cache", kv_cache, (None, None, r + p), "[num_blocks, block_size, R + P]")
    c.tensor(op, "slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=dev)
    c.shape(op, "slot_mapping", slot_mapping, (t,), "[T]")
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        c.last_dim_contiguous(op, name, x)
    c.fp8_cache_scale(op, "scale", scale, kv_cache, dev, "when 'kv_cache' is float8_e4m3fn")


def _check_ds_mla_layout(op: str, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, scale) -> None:
    """A uint8 `kv_cache` is an fp8_ds_mla cache: R a multiple of 128, P even, one
    `record_bytes(R, P)`-byte record per token, and no `scale` (the records hold theirs)."""
    r, p = kv_c.shape[1], k_pe.shape[1]
    when = "when 'kv_cache' is uint8 (an fp8_ds_mla cache)"
    if r % fp8_ds_mla.TILE != 0 or r == 0:
        c.fail(op, "kv_c", f"of shape [T, R] with R a positive multiple of {fp8_ds_mla.TILE} {when}", f"R = {r}")
    if p % 2 != 0:
        c.fail(op, "k_pe", f"of shape [T, P] with P even {when}", f"P = {p}")
    c.shape(op, "kv_cache", kv_cache, (None, None, fp8_ds_mla.record_bytes(r, p)),
            "[num_blocks, block_size, R + 4 * R/128 + 2 * P] (fp8_ds_mla records)")
    if scale is not None:
        c.fail(op, "scale", f"None {when}: the records hold their scales",
               f"a {str(scale.dtype).removeprefix('torch.')} tensor of shape {list(scale.shape)}"
               if isinstance(scale, torch.Tensor) else type(scale).__name__)


def fake_concat_and_cache_mla(call) -> None:
    check_concat_and_cache_mla(call)


def check_reshape_and_cache(call) -> None:
    op = "reshape_and_cache"
    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale = call
    c.tensor(op, "key", key, dtypes=c.FLOAT_DTYPES, ndim=3)
    dev = key.device
    t, hk, d = key.shape
    c.tensor(op, "value", value, ndim=3, device=dev)
    c.same_dtype(op, "value", value, "key", key)
    c.shape(op, "value", value, (t, hk, None), "[T, Hk, Dv]")
    dv = value.shape[2]
    c.tensor(op, "key_cache", key_cache, dtypes=(key.dtype, CACHE_FP8), ndim=4, device=dev)
    c.shape(op, "key_cache", key_cache, (None, None, hk, d), "[num_blocks, block_size, Hk, D]")
    nb, bs = key_cache.shape[:2]
    c.tensor(op, "value_cache", value_cache, dtypes=(key_cache.dtype,), ndim=4, device=dev)
    c.shape(op, "value_cache", value_cache, (nb, bs, hk, dv), "[num_blocks, block_size, Hk, Dv]")
    c.tensor(op, "slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=dev)
    c.shape(op, "slot_mapping", slot_mapping, (t,), "[T]")
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        c.last_dim_contiguous(op, name, x)
    c.fp8_cache_scale(op, "k_scale", k_scale, key_cache, dev, "when 'key_cache' is float8_e4m3fn")
    c.fp8_cache_scale(op, "v_scale", v_scale, value_cache, dev, "when 'value_cache' is float8_e4m3fn")


def fake_reshape_and_cache(call) -> None:
    check_reshape_and_cache(call)
