"""Test cases of `concat_and_cache_mla` and `reshape_and_cache`."""

from __future__ import annotations

import torch

from graphsafe.formats.fp8_ds_mla import TILE, record_bytes
from graphsafe.testing.cases import BadInput, OpCase, Params, register_case
from graphsafe.testing.tensors import distinct_slots, poison, randn

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cache(shape, dtype, device, gen, strided: bool) -> torch.Tensor:
    """A poisoned cache; `strided` makes it a view with a gap between blocks and tokens."""
    if not strided:
        return poison(shape, dtype, device, gen)
    nb, bs, *rest = shape
    big = poison((nb, bs + 1, *rest[:-1], rest[-1] + 8), dtype, device, gen)
    return big[:, :bs, ..., : rest[-1]]


def _slots(t: int, nb: int, bs: int, device, gen) -> torch.Tensor:
    return distinct_slots(t, nb * bs, gen).to(device)


# -- comparison, unread elements, ids out of range, non-finite values ------------------
def bitwise_compare(op: str):
    """An `OpCase.compare` for the cache writes: every mutated cache bit for bit (fp8
    bytes included: every backend rounds as torch's cast does)."""

    def compare(expected, actual, expected_args, actual_args, params) -> None:
        from graphsafe.registry import get_op
        from graphsafe.testing.compare import mutated_args
        from graphsafe.testing.contract import assert_bits_equal

        assert expected is None and actual is None, f"{op} returns None"
        spec = get_op(op)
        want, got = mutated_args(spec, expected_args), mutated_args(spec, actual_args)
        for name in want:
            assert_bits_equal(want[name], got[name], f"{op} mutated '{name}'")

    return compare


def _rope_nans_canonical(cache: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8_ds_mla cache (uint8 records, the last 2P bytes the bf16 rope) with every NaN
    rope value set to 0x7FFF, and the mask of those values."""
    records = cache.contiguous()
    rope = records[..., records.shape[-1] - 2 * p :].contiguous().view(torch.int16)
    nan = torch.isnan(rope.view(torch.bfloat16))
    rope = torch.where(nan, torch.full_like(rope, 0x7FFF), rope)
    return torch.cat([records[..., : records.shape[-1] - 2 * p], rope.view(torch.uint8)], dim=-1), nan


def compare_mla(expected, actual, expected_args, actual_args, params) -> None:
    """`bitwise_compare` of concat_and_cache_mla, except that the bits of a NaN rope value in
    an fp8_ds_mla cache written from fp16/fp32 are free (the op's docstring: torch's CPU
    conversion gives 0xFFFF or 0x7FC0, CUDA's and the Triton kernel's 0x7FFF); the NaNs
    must be at the same places."""
    if not params.get("ds_mla_cache", False) or params["dtype"] == torch.bfloat16 or params["P"] == 0:
        return bitwise_compare("concat_and_cache_mla")(expected, actual, expected_args, actual_args, params)
    from graphsafe.testing.contract import assert_bits_equal

    assert expected is None and actual is None, "concat_and_cache_mla returns None"
    want, want_nan = _rope_nans_canonical(expected_args[2], params["P"])
    got, got_nan = _rope_nans_canonical(actual_args[2], params["P"])
    assert torch.equal(want_nan, got_nan), "concat_and_cache_mla: NaN rope values at other places than the reference's"
    assert_bits_equal(want, got, "concat_and_cache_mla mutated 'kv_cache' (fp8_ds_mla, NaN rope bits aside)")


def _valid_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_blocks, block_size = cache.shape[:2]
    return (slots >= 0) & (slots < num_blocks * block_size)


def _unread(values: tuple[int, ...], caches: tuple[int, ...], scales: tuple[int, ...], slots_at: int):
    """`OpCase.unread` of a cache write: the rows of skipped tokens in the values, every
    cache element (written, never read) and the scales when no token is written."""

    def unread(params: Params, args):
        valid = _valid_slots(args[caches[0]], args[slots_at]).cpu()
        marks = [(i, (~valid).view(-1, *[1] * (args[i].dim() - 1)).expand(args[i].shape)) for i in values]
        marks += [(i, torch.ones(args[i].shape, dtype=torch.bool)) for i in caches]
        if not bool(valid.any()):
            marks += [(i, torch.ones(1, dtype=torch.bool)) for i in scales if args[i] is not None]
        return marks

    return unread


BAD_SLOTS = (10**6, -5, -2)


def _out_of_range(caches_at: int, slots_at: int):
    """`OpCase.out_of_range`: about a third of the slots (at least one) replaced by 10**6,
    -5, -2 or num_blocks * block_size; -1 (padding) at those places in the padded args."""

    def out_of_range(params: Params, args, gen: torch.Generator):
        slots = args[slots_at]
        t = slots.shape[0]
        if t == 0:
            return None
        num_blocks, block_size = args[caches_at].shape[:2]
        where = torch.randperm(t, generator=gen)[: max(1, t // 3)]
        choices = torch.tensor([*BAD_SLOTS, num_blocks * block_size], dtype=slots.dtype)
        bad_values = choices[torch.arange(where.numel()) % choices.numel()]
        bad, padded = slots.clone(), slots.clone()
        bad[where.to(slots.device)] = bad_values.to(slots.device)
        padded[where.to(slots.device)] = -1
        swap = lambda s: tuple(s if i == slots_at else a for i, a in enumerate(args))  # noqa: E731
        return swap(bad), swap(padded)

    return out_of_range


def _nonfinite(values: tuple[int, ...]):
    """`OpCase.nonfinite`: NaN, +inf and -inf (about 5% each) in the value tensors."""

    def nonfinite(params: Params, args, gen: torch.Generator):
        out = list(args)
        for i in values:
            x = args[i].clone()
            u = torch.rand(x.shape, generator=gen).to(x.device)
            x = torch.where(u < 0.05, float("nan"), x)
            x = torch.where((u >= 0.05) & (u < 0.1), float("inf"), x)
            out[i] = torch.where((u >= 0.1) & (u < 0.15), float("-inf"), x)
        return tuple(out)

    return nonfinite


def _nonfinite_mla(params: Params, args, gen: torch.Generator):
    """`OpCase.nonfinite` of concat_and_cache_mla. Into an fp8_ds_mla cache per 128-value
    tile of `kv_c` (elementwise NaN/inf would leave hardly a tile without a NaN): a fifth
    each clean, one NaN, one +inf, one -inf, a +inf and a -inf; `k_pe` elementwise."""
    if not params.get("ds_mla_cache", False):
        return _nonfinite((0, 1))(params, args, gen)
    kv_c = args[0]
    t, r = kv_c.shape
    x = kv_c.float().cpu().reshape(t, r // TILE, TILE)
    kind = torch.randint(0, 5, x.shape[:2], generator=gen)[..., None]
    at = [torch.nn.functional.one_hot(torch.randint(0, TILE, x.shape[:2], generator=gen), TILE).bool()
          for _ in range(2)]
    x = torch.where(at[0] & (kind == 1), float("nan"), x)
    x = torch.where(at[0] & ((kind == 2) | (kind == 4)), float("inf"), x)
    x = torch.where((at[0] & (kind == 3)) | (at[1] & (kind == 4)), float("-inf"), x)
    with_rope = _nonfinite((1,))(params, args, gen)
    return (x.reshape(t, r).to(kv_c.dtype).to(kv_c.device), *with_rope[1:])


def _params_mla():
    from hypothesis import strategies as st

    common = {
        "T": st.integers(0, 12),
        "block_size": st.sampled_from([1, 4, 16, 64]),
        "dtype": st.sampled_from(DTYPES),
        "strided_cache": st.booleans(),
    }
    plain_or_fp8 = {
        **common,
        "R": st.sampled_from([8, 32, 64]),
        "P": st.sampled_from([4, 8, 16]),
        "fp8_cache": st.booleans(),
        "ds_mla_cache": st.just(False),
    }
    ds_mla = {
        **common,
        "R": st.just(TILE),
        "P": st.sampled_from([16, 32]),
        "fp8_cache": st.just(False),
        "ds_mla_cache": st.just(True),
    }
    return st.fixed_dictionaries(plain_or_fp8) | st.fixed_dictionaries(ds_mla)


def _ds_mla_latent(t: int, r: int, dtype: torch.dtype, device, gen) -> torch.Tensor:
    """`[T, R]` latent rows for an fp8_ds_mla cache: each 128-value tile randn times 2^k
    (k drawn per tile, within the dtype's range), one tile in 8 all zeros (scale 1)."""
    span = 12 if dtype == torch.float16 else 60
    tiles = torch.randn((t, r // TILE, TILE), generator=gen)
    k = torch.randint(-span, span + 1, (t, r // TILE, 1), generator=gen)
    zero = torch.rand((t, r // TILE, 1), generator=gen) < 0.125
    tiles = torch.where(zero, 0.0, tiles * torch.pow(2.0, k.float()))
    return tiles.reshape(t, r).to(dtype).to(device)


def _make_mla(p: Params, device, gen):
    t, r, pe, bs = p["T"], p["R"], p["P"], p["block_size"]
    # Parameter sets written before the fp8_ds_mla kind (benchmarks) lack the key.
    ds_mla = p.get("ds_mla_cache", False)
    nb = max(1, -(-2 * t // bs))
    kv_c = _ds_mla_latent(t, r, p["dtype"], device, gen) if ds_mla else randn((t, r), p["dtype"], device, gen)
    k_pe = randn((t, pe), p["dtype"], device, gen)
    if ds_mla:
        kv_cache = _cache((nb, bs, record_bytes(r, pe)), torch.uint8, device, gen, p["strided_cache"])
    else:
        cache_dtype = torch.float8_e4m3fn if p["fp8_cache"] else p["dtype"]
        kv_cache = _cache((nb, bs, r + pe), cache_dtype, device, gen, p["strided_cache"])
    slots = _slots(t, nb, bs, device, gen)
    scale = (torch.rand(1, generator=gen) * 0.1 + 0.01).to(device) if p["fp8_cache"] else None
    return kv_c, k_pe, kv_cache, slots, scale


def _bad_mla(device, gen):
    good = _make_mla(EXAMPLE_MLA, device, gen)
    kv_c, k_pe, kv_cache, slots, _ = good
    fp8_cache = kv_cache.to(torch.float8_e4m3fn)
    return [
        BadInput("kv_c of dtype int32", (kv_c.int(), k_pe, kv_cache, slots), "kv_c", "dtype"),
        BadInput("kv_c 3-D", (kv_c[None], k_pe, kv_cache, slots), "kv_c", "2-D"),
        BadInput("k_pe with other T", (kv_c, k_pe[1:], kv_cache, slots), "k_pe", r"\[T, P\]"),
        BadInput("k_pe of other dtype", (kv_c, k_pe.float(), kv_cache, slots), "k_pe", "same dtype"),
        BadInput("kv_cache last dim != R+P", (kv_c, k_pe, kv_cache[..., 1:], slots), "kv_cache", "R \\+ P"),
        BadInput("slot_mapping float", (kv_c, k_pe, kv_cache, slots.float()), "slot_mapping", "dtype"),
        BadInput("slot_mapping with other T", (kv_c, k_pe, kv_cache, slots[1:]), "slot_mapping", r"\[T\]"),
        BadInput("fp8 cache without scale", (kv_c, k_pe, fp8_cache, slots), "scale", "float32"),
        BadInput("kv_c strided last dim", (kv_c.t().contiguous().t(), k_pe, kv_cache, slots), "kv_c", "contiguous"),
        *_bad_ds_mla(device, gen),
    ]


def _bad_ds_mla(device, gen):
    """uint8 (fp8_ds_mla) caches that do not fit R and P, and a scale given with one."""
    kv_c, k_pe, cache, slots, _ = _make_mla(EXAMPLE_DS_MLA, device, gen)  # R = 128, P = 16: 164 bytes
    scale = torch.ones(1, device=device)
    return [
        BadInput("uint8 kv_cache of 163-byte records (R=128, P=16: 164)", (kv_c, k_pe, cache[..., 1:], slots),
                 "kv_cache", r"record.*= \[\?, \?, 164\], got shape \[\d+, \d+, 163\]"),
        BadInput("uint8 kv_cache with R=64", (kv_c[:, :64], k_pe, cache, slots), "kv_c", "multiple of 128.*got R = 64"),
        BadInput("uint8 kv_cache with odd P", (kv_c, k_pe[:, :15], cache, slots), "k_pe", "P even.*got P = 15"),
        BadInput("uint8 kv_cache with a scale", (kv_c, k_pe, cache, slots, scale), "scale",
                 r"None when .*got a float32 tensor of shape \[1\]"),
    ]


EXAMPLE_MLA: Params = {"T": 6, "R": 32, "P": 8, "block_size": 4, "dtype": torch.bfloat16, "fp8_cache": False,
                       "strided_cache": False, "ds_mla_cache": False}
EXAMPLE_DS_MLA: Params = {**EXAMPLE_MLA, "R": TILE, "P": 16, "ds_mla_cache": True}

register_case(
    OpCase(
        op="concat_and_cache_mla",
        params=_params_mla,
        example=EXAMPLE_MLA,
        make=_make_mla,
        compare=compare_mla,
        bad_inputs=_bad_mla,
        unread=_unread(values=(0, 1), caches=(2,), scales=(4,), slots_at=3),
        out_of_range=_out_of_range(caches_at=2, slots_at=3),
        nonfinite=_nonfinite_mla,
        edge_cases=(
            {**EXAMPLE_MLA, "T": 0},
            {**EXAMPLE_MLA, "fp8_cache": True, "dtype": torch.float16},
            {**EXAMPLE_MLA, "R": 512, "P": 64, "block_size": 64, "strided_cache": True},
            EXAMPLE_DS_MLA,
            {**EXAMPLE_DS_MLA, "T": 0},
            {**EXAMPLE_DS_MLA, "P": 32, "dtype": torch.float32, "block_size": 1, "strided_cache": True},
            {**EXAMPLE_DS_MLA, "R": 2 * TILE, "dtype": torch.float16, "strided_cache": True},
        ),
        gpu_examples=(
            {"T": 256, "R": 512, "P": 64, "block_size": 64, "dtype": torch.bfloat16, "fp8_cache": False,
             "strided_cache": False, "ds_mla_cache": False},
            {"T": 1024, "R": 512, "P": 64, "block_size": 64, "dtype": torch.bfloat16, "fp8_cache": True,
             "strided_cache": True, "ds_mla_cache": False},
            # DeepSeek-V3.2's fp8_ds_mla cache: 656-byte records.
            {"T": 1024, "R": 512, "P": 64, "block_size": 64, "dtype": torch.bfloat16, "fp8_cache": False,
             "strided_cache": True, "ds_mla_cache": True},
        ),
    )
)


def _params_kv():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "T": st.integers(0, 10),
            "Hk": st.sampled_from([1, 2, 4]),
            "D": st.sampled_from([8, 16, 64]),
            "Dv": st.sampled_from([None, 8]),
            "block_size": st.sampled_from([1, 4, 16]),
            "dtype": st.sampled_from(DTYPES),
            "fp8_cache": st.booleans(),
            "strided_cache": st.booleans(),
        }
    )


def _make_kv(p: Params, device, gen):
    t, hk, d, bs = p["T"], p["Hk"], p["D"], p["block_size"]
    dv = p["Dv"] or d
    nb = max(1, -(-2 * t // bs))
    key = randn((t, hk, d), p["dtype"], device, gen)
    value = randn((t, hk, dv), p["dtype"], device, gen)
    cache_dtype = torch.float8_e4m3fn if p["fp8_cache"] else p["dtype"]
    k_cache = _cache((nb, bs, hk, d), cache_dtype, device, gen, p["strided_cache"])
    v_cache = _cache((nb, bs, hk, dv), cache_dtype, device, gen, p["strided_cache"])
    slots = _slots(t, nb, bs, device, gen)
    if p["fp8_cache"]:
        k_scale = (torch.rand(1, generator=gen) * 0.1 + 0.01).to(device)
        v_scale = (torch.rand(1, generator=gen) * 0.1 + 0.01).to(device)
    else:
        k_scale = v_scale = None
    return key, value, k_cache, v_cache, slots, k_scale, v_scale


EXAMPLE_KV: Params = {"T": 5, "Hk": 2, "D": 16, "Dv": None, "block_size": 4, "dtype": torch.float16, "fp8_cache": False, "strided_cache": False}


def _bad_kv(device, gen):
    key, value, kc, vc, slots, _, _ = _make_kv(EXAMPLE_KV, device, gen)
    return [
        BadInput("key 2-D", (key[0], value, kc, vc, slots), "key", "3-D"),
        BadInput("value with other heads", (key, value[:, :1], kc, vc, slots), "value", r"\[T, Hk, Dv\]"),
        BadInput("key_cache with other head dim", (key, value, kc[..., 1:], vc, slots), "key_cache", "D\\]"),
        BadInput("value_cache of other dtype", (key, value, kc, vc.float(), slots), "value_cache", "dtype"),
        BadInput("slot_mapping 2-D", (key, value, kc, vc, slots[None]), "slot_mapping", "1-D"),
        BadInput(
            "fp8 caches without k_scale",
            (key, value, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), slots),
            "k_scale",
            "float32",
        ),
    ]


register_case(
    OpCase(
        op="reshape_and_cache",
        params=_params_kv,
        example=EXAMPLE_KV,
        make=_make_kv,
        compare=bitwise_compare("reshape_and_cache"),
        bad_inputs=_bad_kv,
        unread=_unread(values=(0, 1), caches=(2, 3), scales=(5, 6), slots_at=4),
        out_of_range=_out_of_range(caches_at=2, slots_at=4),
        nonfinite=_nonfinite((0, 1)),
        edge_cases=(
            {**EXAMPLE_KV, "T": 0},
            {**EXAMPLE_KV, "fp8_cache": True, "dtype": torch.bfloat16, "Dv": 8},
            {**EXAMPLE_KV, "Hk": 8, "D": 128, "block_size": 16, "strided_cache": True},
        ),
        gpu_examples=(
            {"T": 512, "Hk": 8, "D": 128, "Dv": None, "block_size": 16, "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False},
            {"T": 2048, "Hk": 8, "D": 128, "Dv": None, "block_size": 16, "dtype": torch.float16, "fp8_cache": True, "strided_cache": True},
        ),
    )
)
