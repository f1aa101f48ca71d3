"""Test cases of the sparse-indexer ops (K-cache quantise/gather, fp8 MQA logits, slot mapping).

Shapes come from the params only; contents (context lengths, slots, windows) from the
seed, so two seeds of one params set share a captured CUDA graph.
"""

from __future__ import annotations

import torch

from graphsafe.ops.indexer import layout
from graphsafe.testing.cases import BadInput, OpCase, Params, register_case
from graphsafe.testing.compare import assert_same, default_compare
from graphsafe.testing.contract import clone_tensor
from graphsafe.testing.registry_access import spec
from graphsafe.testing.tensors import distinct_slots, poison, randint, randn

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")
# Logits: |actual - expected| <= LOGIT_TOL * max |expected| of the row. Hopper's fp8
# tensor cores accumulate with ~14 mantissa bits (worst row seen on an H200 at
# B=128 x 32k: 3.1e-3); the CPU interpreter is exact to ~1e-6.
LOGIT_TOL = 5e-3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_randn(shape, device, gen, spread: bool = True) -> torch.Tensor:
    """Random e4m3fn values; `spread` varies the magnitude per row (exercises exponents)."""
    x = torch.randn(tuple(shape), generator=gen)
    if spread and len(shape) > 1:
        x = x * torch.exp2(torch.randint(-4, 5, (shape[0],) + (1,) * (len(shape) - 1), generator=gen).float())
    return x.clamp(-448, 448).to(FP8).to(device)


def random_cache(nb: int, bs: int, d: int, g: int, device, gen, strided: bool = False) -> torch.Tensor:
    """A valid K cache (finite fp8 values, positive scales); `strided` pads each block by 16 bytes."""
    values = fp8_randn((nb * bs, d), "cpu", gen).view(nb, bs, d)
    scales = torch.rand((nb, bs, g), generator=gen) * 0.05 + 0.001
    cache = layout.pack(values, scales)
    if strided:
        big = poison((nb, bs * (d + 4 * g) + 16), torch.uint8, "cpu", gen)
        big[:, : bs * (d + 4 * g)] = cache.view(nb, -1)
        cache = big[:, : bs * (d + 4 * g)].view(nb, bs, d + 4 * g)
    return cache.to(device) if not strided else _to_device_strided(cache, device)


def _to_device_strided(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def poisoned_cache(nb: int, bs: int, width: int, device, gen, strided: bool) -> torch.Tensor:
    if not strided:
        return poison((nb, bs, width), torch.uint8, device, gen)
    big = poison((nb, bs * width + 16), torch.uint8, device, gen)
    return big[:, : bs * width].view(nb, bs, width)


def compare_logits(e, a, ea=None, aa=None, p=None) -> None:
    """Same -inf pattern exactly; finite logits within LOGIT_TOL of the row's magnitude."""
    assert isinstance(a, torch.Tensor) and a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape)
    e, a = e.cpu(), a.cpu()
    ninf_e, ninf_a = e == NEG_INF, a == NEG_INF
    if not torch.equal(ninf_e, ninf_a):
        bad = (ninf_e != ninf_a).nonzero()[:5].tolist()
        raise AssertionError(f"logits: -inf pattern differs at {bad} (expected {[e[tuple(i)].item() for i in bad]})")
    fe, fa = e.masked_fill(ninf_e, 0.0), a.masked_fill(ninf_a, 0.0)
    assert torch.isfinite(fa).all(), "logits: non-finite values where finite ones were expected"
    scale = fe.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    err = ((fa - fe).abs() / scale).max().item() if fe.numel() else 0.0
    assert err <= LOGIT_TOL, f"logits: max error {err:.2e} of the row magnitude > {LOGIT_TOL}"


# -- indexer_k_quant_and_cache ---------------------------------------------------------
def _params_quant():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "T": st.integers(0, 12),
            "D": st.sampled_from([16, 32, 64, 128]),
            "groups": st.sampled_from([1, 1, 2, 4]),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "dtype": st.sampled_from(DTYPES),
            "scale_fmt": st.sampled_from([None, "ue8m0"]),
            "strided_cache": st.booleans(),
        }
    )


# Per-token magnitudes: 1e-7 puts the amax under the 1e-4 floor.
MAGNITUDES = torch.tensor([1e-7, 1e-2, 1.0, 30.0, 1000.0])


def _make_quant(p: Params, device, gen):
    t, d, g, bs = p["T"], p["D"], p["groups"], p["block_size"]
    nb = max(1, _cdiv(2 * t, bs))
    mag = MAGNITUDES[torch.randint(0, len(MAGNITUDES), (t, 1), generator=gen)]
    k = (torch.randn((t, d), generator=gen) * mag).to(p["dtype"]).to(device)
    cache = poisoned_cache(nb, bs, d + 4 * g, device, gen, p["strided_cache"])
    slots = distinct_slots(t, nb * bs, gen)
    if p.get("oob_slot") and t > 0:
        slots[0] = nb * bs + 3  # past the cache: skipped
    return k, cache, slots.to(device), d // g, p["scale_fmt"]


def compare_quant(e, a, ea, aa, p) -> None:
    """Scales and every untouched byte exact; written fp8 values within one e4m3 step."""
    assert e is None and a is None
    k, ce, slots = ea[0], ea[1].cpu(), ea[2].cpu().long()
    ca = aa[1].cpu()
    d = k.shape[1]
    nb, bs, _ = ce.shape
    written = slots[(slots >= 0) & (slots < nb * bs)]
    blk, off = written // bs, written % bs
    ve, se = layout.cache_views(ce, d)
    va, sa = layout.cache_views(ca, d)
    assert_same(ve[blk, off].view(FP8), va[blk, off].view(FP8), "indexer_k_quant_and_cache values")
    torch.testing.assert_close(sa[blk, off], se[blk, off], rtol=0, atol=0, msg=lambda m: f"scales: {m}")
    patched = clone_tensor(ca)
    layout.cache_views(patched, d)[0][blk, off] = ve[blk, off]
    assert torch.equal(patched, ce), "indexer_k_quant_and_cache: bytes outside the written values changed"


EXAMPLE_QUANT: Params = {"T": 6, "D": 32, "groups": 1, "block_size": 4, "dtype": torch.bfloat16, "scale_fmt": None, "strided_cache": False}


def _bad_quant(device, gen):
    k, cache, slots, qbs, fmt = _make_quant(EXAMPLE_QUANT, device, gen)
    k24 = torch.randn(6, 24, generator=gen).to(device)
    return [
        BadInput("k int32", (k.int(), cache, slots, qbs, fmt), "k", "dtype"),
        BadInput("k 3-D", (k[None], cache, slots, qbs, fmt), "k", "2-D"),
        BadInput("D not a multiple of 16", (k24, cache, slots, 24, fmt), "k", "multiple of 16"),
        BadInput("kv_cache float32", (k, cache.float(), slots, qbs, fmt), "kv_cache", "dtype"),
        BadInput("kv_cache last dim D+8", (k, poison((4, 4, 40), torch.uint8, device, gen), slots, qbs, fmt), "kv_cache", r"D \+ 4"),
        BadInput("slot_mapping float", (k, cache, slots.float(), qbs, fmt), "slot_mapping", "dtype"),
        BadInput("slot_mapping of other T", (k, cache, slots[1:], qbs, fmt), "slot_mapping", r"\[T\]"),
        BadInput("quant_block_size not dividing D", (k, cache, slots, 12, fmt), "quant_block_size", "divisor"),
        BadInput("unknown scale_fmt", (k, cache, slots, qbs, "e4m3"), "scale_fmt", "ue8m0"),
        BadInput("kv_cache on the meta device", (k, cache.to("meta"), slots, qbs, fmt), "kv_cache", "device"),
    ]


register_case(
    OpCase(
        op="indexer_k_quant_and_cache",
        params=_params_quant,
        example=EXAMPLE_QUANT,
        make=_make_quant,
        compare=compare_quant,
        bad_inputs=_bad_quant,
        edge_cases=(
            {**EXAMPLE_QUANT, "T": 0},
            {**EXAMPLE_QUANT, "D": 128, "block_size": 64, "scale_fmt": "ue8m0", "strided_cache": True, "oob_slot": True},
            {**EXAMPLE_QUANT, "D": 64, "groups": 4, "dtype": torch.float16, "scale_fmt": "ue8m0"},
            {**EXAMPLE_QUANT, "T": 9, "D": 128, "block_size": 1, "dtype": torch.float32},
        ),
        gpu_examples=(
            {"T": 8192, "D": 128, "groups": 1, "block_size": 64, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "strided_cache": False},
            {"T": 256, "D": 128, "groups": 1, "block_size": 1, "dtype": torch.bfloat16, "scale_fmt": None, "strided_cache": True},
            {"T": 1024, "D": 128, "groups": 4, "block_size": 64, "dtype": torch.float16, "scale_fmt": None, "strided_cache": False},
        ),
    )
)


# -- cp_gather_indexer_k_quant_cache ---------------------------------------------------
def _params_gather():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(1, 4),
            "max_seq": st.integers(1, 24),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "D": st.sampled_from([16, 32, 64, 128]),
            "groups": st.sampled_from([1, 1, 2]),
            "extra_cols": st.sampled_from([0, 2]),
            "row_offset": st.sampled_from([0, 0, 3]),
            "strided_cache": st.booleans(),
        }
    )


def _make_gather(p: Params, device, gen):
    b, max_seq, bs, d, g = p["B"], p["max_seq"], p["block_size"], p["D"], p["groups"]
    per_req = _cdiv(max_seq, bs)
    mb = per_req + p["extra_cols"]
    nb = b * per_req + 1
    cache = random_cache(nb, bs, d, g, device, gen, p["strided_cache"])
    table = torch.randint(0, nb, (b, mb), generator=gen, dtype=torch.int32)
    table[:, :per_req] = torch.randperm(nb, generator=gen)[: b * per_req].view(b, per_req).int()
    lens = torch.randint(0, max_seq + 1, (b,), generator=gen)
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    cu += p["row_offset"]
    n = p["row_offset"] + b * max_seq  # an upper bound: rows past cu[B] stay untouched
    dst_k = poison((n, d), FP8, device, gen)
    dst_scale = poison((n,) if g == 1 else (n, g), torch.float32, device, gen)
    return cache, dst_k, dst_scale, table.to(device), cu.int().to(device)


EXAMPLE_GATHER: Params = {"B": 3, "max_seq": 10, "block_size": 4, "D": 32, "groups": 1, "extra_cols": 0, "row_offset": 0, "strided_cache": False}


def _bad_gather(device, gen):
    cache, dst_k, dst_scale, table, cu = _make_gather(EXAMPLE_GATHER, device, gen)
    return [
        BadInput("dst_k bfloat16", (cache, dst_k.bfloat16(), dst_scale, table, cu), "dst_k", "dtype"),
        BadInput("dst_scale [N, 2] for G = 1", (cache, dst_k, dst_scale[:, None].repeat(1, 2), table, cu), "dst_scale", r"\[N\]"),
        BadInput("kv_cache with last dim D + 3", (cache[..., :-1], dst_k, dst_scale, table, cu), "kv_cache", "D \\+ 4\\*G"),
        BadInput("block_table int64", (cache, dst_k, dst_scale, table.long(), cu), "block_table", "dtype"),
        BadInput("cu_seq_lens of B entries", (cache, dst_k, dst_scale, table, cu[1:]), "cu_seq_lens", r"\[B \+ 1\]"),
        BadInput("dst_scale on the meta device", (cache, dst_k, dst_scale.to("meta"), table, cu), "dst_scale", "device"),
    ]


register_case(
    OpCase(
        op="cp_gather_indexer_k_quant_cache",
        params=_params_gather,
        example=EXAMPLE_GATHER,
        make=_make_gather,
        compare=lambda e, a, ea, aa, p: default_compare(spec("cp_gather_indexer_k_quant_cache"), e, a, ea, aa, exact=True),
        bad_inputs=_bad_gather,
        edge_cases=(
            {**EXAMPLE_GATHER, "B": 1, "max_seq": 1, "block_size": 1},
            {**EXAMPLE_GATHER, "D": 128, "block_size": 64, "max_seq": 150, "row_offset": 3, "strided_cache": True},
            {**EXAMPLE_GATHER, "groups": 2, "extra_cols": 2},
        ),
        gpu_examples=(
            {"B": 8, "max_seq": 4096, "block_size": 64, "D": 128, "groups": 1, "extra_cols": 0, "row_offset": 0, "strided_cache": False},
            {"B": 64, "max_seq": 512, "block_size": 1, "D": 128, "groups": 1, "extra_cols": 4, "row_offset": 0, "strided_cache": False},
        ),
    )
)


# -- fp8_mqa_logits --------------------------------------------------------------------
def _params_mqa():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "M": st.integers(1, 20),
            "N": st.integers(1, 40),
            "H": st.sampled_from([16, 32]),
            "D": st.sampled_from([32, 64, 128]),
            "window": st.sampled_from(["causal", "random", "full"]),
        }
    )


def mqa_windows(m: int, n: int, window: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    if window == "full":
        return torch.zeros(m, dtype=torch.int32), torch.full((m,), n, dtype=torch.int32)
    if window == "causal":  # query m is key n - m_total + m: it sees keys up to itself
        ke = (torch.arange(m) + n - m + 1).clamp(0, n)
        return torch.zeros(m, dtype=torch.int32), ke.int()
    ks = torch.randint(-2, n + 1, (m,), generator=gen)
    ke = ks + torch.randint(-2, n + 3, (m,), generator=gen)
    return ks.int(), ke.int()


def _make_mqa(p: Params, device, gen):
    m, n, h, d = p["M"], p["N"], p["H"], p["D"]
    q = fp8_randn((m, h, d), device, gen)
    k = fp8_randn((n, d), device, gen)
    k_scale = (torch.rand(n, generator=gen) * 0.1 + 0.01).to(device)
    weights = randn((m, h), torch.float32, device, gen)
    ks, ke = mqa_windows(m, n, p["window"], gen)
    return q, k, k_scale, weights, ks.to(device), ke.to(device)


EXAMPLE_MQA: Params = {"M": 8, "N": 24, "H": 16, "D": 64, "window": "causal"}


def _bad_mqa(device, gen):
    q, k, k_scale, w, ks, ke = _make_mqa(EXAMPLE_MQA, device, gen)
    return [
        BadInput("q bfloat16", (q.bfloat16(), k, k_scale, w, ks, ke), "q", "dtype"),
        BadInput("k with other D", (q, k[:, :32], k_scale, w, ks, ke), "k", r"\[N, D\]"),
        BadInput("k_scale of other N", (q, k, k_scale[1:], w, ks, ke), "k_scale", r"\[N\]"),
        BadInput("weights [M, H+1]", (q, k, k_scale, torch.cat([w, w[:, :1]], 1), ks, ke), "weights", r"\[M, H\]"),
        BadInput("ke int64", (q, k, k_scale, w, ks, ke.long()), "ke", "dtype"),
        BadInput("k on the meta device", (q, k.to("meta"), k_scale, w, ks, ke), "k", "device"),
    ]


register_case(
    OpCase(
        op="fp8_mqa_logits",
        params=_params_mqa,
        example=EXAMPLE_MQA,
        make=_make_mqa,
        compare=compare_logits,
        bad_inputs=_bad_mqa,
        edge_cases=(
            {"M": 1, "N": 1, "H": 16, "D": 32, "window": "full"},
            {"M": 33, "N": 70, "H": 64, "D": 128, "window": "random"},
            {"M": 20, "N": 5, "H": 32, "D": 64, "window": "causal"},
        ),
        gpu_examples=(
            {"M": 1024, "N": 4096, "H": 64, "D": 128, "window": "causal"},
            {"M": 777, "N": 3001, "H": 64, "D": 128, "window": "random"},
            {"M": 256, "N": 2048, "H": 32, "D": 64, "window": "full"},
        ),
    )
)


# -- fp8_paged_mqa_logits --------------------------------------------------------------
def _params_paged():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(1, 3),
            "next_n": st.sampled_from([1, 2]),
            "H": st.sampled_from([16, 32, 64]),
            "D": st.sampled_from([32, 64, 128]),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "max_model_len": st.integers(1, 70),
            "extra_cols": st.sampled_from([0, 2]),
        }
    )


def paged_context_lens(b: int, next_n: int, length: int, gen) -> torch.Tensor:
    """Random contexts in [0, max_model_len], with exactly next_n and the full length mixed in."""
    lens = torch.randint(0, length + 1, (b,), generator=gen)
    pick = torch.randint(0, 4, (b,), generator=gen)
    lens = torch.where(pick == 0, min(next_n, length), lens)
    lens = torch.where(pick == 1, length, lens)
    return lens.int()


def _make_paged(p: Params, device, gen):
    b, nn, h, d, bs, length = p["B"], p["next_n"], p["H"], p["D"], p["block_size"], p["max_model_len"]
    mb = _cdiv(length, bs) + p["extra_cols"]
    nb = b * mb + 1
    cache = random_cache(nb, bs, d, 1, device, gen, p.get("strided_cache", False))
    table = torch.randperm(nb, generator=gen)[: b * mb].view(b, mb).int()
    q = fp8_randn((b, nn, h, d), device, gen)
    weights = randn((b * nn, h), torch.float32, device, gen)
    lens = paged_context_lens(b, nn, length, gen)
    return q, cache, weights, lens.to(device), table.to(device), length


EXAMPLE_PAGED: Params = {"B": 2, "next_n": 2, "H": 16, "D": 64, "block_size": 4, "max_model_len": 30, "extra_cols": 0}


def _bad_paged(device, gen):
    q, cache, w, lens, table, length = _make_paged(EXAMPLE_PAGED, device, gen)
    short = table[:, :-1]  # 7 columns of 4 tokens < max_model_len 30
    return [
        BadInput("block_table too short for max_model_len", (q, cache, w, lens, short, length), "block_table", "wide enough"),
        BadInput("q bfloat16", (q.bfloat16(), cache, w, lens, table, length), "q", "dtype"),
        BadInput("q 3-D", (q[:, 0], cache, w, lens, table, length), "q", "4-D"),
        BadInput("next_n 5", (q[:, :1].repeat(1, 5, 1, 1), cache, w.repeat(3, 1)[:10], lens, table, length), "q", "next_n <= 4"),
        BadInput("weights [B, H]", (q, cache, w[:2], lens, table, length), "weights", r"\[B \* next_n, H\]"),
        BadInput("context_lens int64", (q, cache, w, lens.long(), table, length), "context_lens", "dtype"),
        BadInput("kv_cache with two scales per token", (q, cache.repeat(1, 1, 2)[..., :72], w, lens, table, length), "kv_cache", r"D \+ 4"),
        BadInput("max_model_len 0", (q, cache, w, lens, table, 0), "max_model_len", "positive"),
        BadInput("block_table on the meta device", (q, cache, w, lens, table.to("meta"), length), "block_table", "device"),
    ]


register_case(
    OpCase(
        op="fp8_paged_mqa_logits",
        params=_params_paged,
        example=EXAMPLE_PAGED,
        make=_make_paged,
        compare=compare_logits,
        bad_inputs=_bad_paged,
        edge_cases=(
            {**EXAMPLE_PAGED, "next_n": 1, "block_size": 1, "max_model_len": 1},
            {**EXAMPLE_PAGED, "B": 3, "H": 64, "D": 128, "block_size": 64, "max_model_len": 130, "extra_cols": 2},
            {**EXAMPLE_PAGED, "H": 32, "D": 32, "block_size": 16, "max_model_len": 50, "strided_cache": True},
        ),
        gpu_examples=(
            {"B": 32, "next_n": 1, "H": 64, "D": 128, "block_size": 64, "max_model_len": 8192, "extra_cols": 0},
            {"B": 8, "next_n": 2, "H": 64, "D": 128, "block_size": 64, "max_model_len": 32768, "extra_cols": 3},
            {"B": 4, "next_n": 2, "H": 32, "D": 128, "block_size": 1, "max_model_len": 2048, "extra_cols": 0},
            {"B": 3, "next_n": 1, "H": 16, "D": 64, "block_size": 16, "max_model_len": 1000, "extra_cols": 1},
        ),
    )
)


# -- req_local_to_global_slots ---------------------------------------------------------
def _params_slots():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "T": st.integers(0, 12),
            "B": st.integers(1, 4),
            "K": st.integers(1, 40),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "max_blocks": st.integers(1, 6),
        }
    )


def _make_slots(p: Params, device, gen):
    t, b, k, bs, mb = p["T"], p["B"], p["K"], p["block_size"], p["max_blocks"]
    req = torch.randint(0, b, (t,), generator=gen)
    req = torch.where(torch.rand(t, generator=gen) < 0.1, -1, req).int()
    idx = torch.randint(0, mb * bs + 3, (t, k), generator=gen)  # a few past the table
    idx = torch.where(torch.rand(t, k, generator=gen) < 0.2, -1, idx).int()
    table = randint(0, 100_000, (b, mb), torch.int32, device, gen)
    return req.to(device), table, idx.to(device), bs


EXAMPLE_SLOTS: Params = {"T": 5, "B": 2, "K": 16, "block_size": 4, "max_blocks": 3}


def _bad_slots(device, gen):
    req, table, idx, bs = _make_slots(EXAMPLE_SLOTS, device, gen)
    return [
        BadInput("topk_indices int64", (req, table, idx.long(), bs), "topk_indices", "dtype"),
        BadInput("req_id_per_token of other T", (req[1:], table, idx, bs), "req_id_per_token", r"\[T\]"),
        BadInput("block_table 1-D", (req, table[0], idx, bs), "block_table", "2-D"),
        BadInput("block_size 0", (req, table, idx, 0), "block_size", "positive"),
        BadInput("block_table on the meta device", (req, table.to("meta"), idx, bs), "block_table", "device"),
    ]


register_case(
    OpCase(
        op="req_local_to_global_slots",
        params=_params_slots,
        example=EXAMPLE_SLOTS,
        make=_make_slots,
        compare=lambda e, a, ea, aa, p: default_compare(spec("req_local_to_global_slots"), e, a, ea, aa, exact=True),
        bad_inputs=_bad_slots,
        edge_cases=(
            {**EXAMPLE_SLOTS, "T": 0},
            {"T": 3, "B": 2, "K": 2048, "block_size": 64, "max_blocks": 40},
            {"T": 7, "B": 1, "K": 5, "block_size": 1, "max_blocks": 1},
        ),
        gpu_examples=(
            {"T": 512, "B": 64, "K": 2048, "block_size": 64, "max_blocks": 512},
            {"T": 8192, "B": 4, "K": 2048, "block_size": 64, "max_blocks": 2048},
        ),
    )
)
