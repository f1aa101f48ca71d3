"""Test cases of the sparse-indexer ops (K-cache quantise/gather, fp8 MQA logits, slot mapping).

Shapes come from the params only; contents (context lengths, slots, windows) from the
seed, so two seeds of one params set share a captured CUDA graph.
"""

from __future__ import annotations

import torch

from graphsafe.formats import indexer_k as layout
from graphsafe.ops.indexer import plan, reference
from graphsafe.registry import get_op
from graphsafe.testing.cases import BadInput, OpCase, Params, reads_no_floats, register_case
from graphsafe.testing.compare import assert_same, exact_compare
from graphsafe.testing.contract import clone_tensor
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
        unread=lambda p, a: _unread_quant(p, a),
        out_of_range=lambda p, a, g: _oor_quant(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_quant(p, a, g),
        compare_nonfinite=lambda *x: compare_quant_nonfinite(*x),
        params=_params_quant,
        example=EXAMPLE_QUANT,
        make=_make_quant,
        compare=compare_quant,
        bad_inputs=_bad_quant,
        edge_cases=(
            {**EXAMPLE_QUANT, "T": 0},
            {**EXAMPLE_QUANT, "D": 128, "block_size": 64, "scale_fmt": "ue8m0", "strided_cache": True},
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
        unread=lambda p, a: _unread_gather(p, a),
        out_of_range=lambda p, a, g: _oor_gather(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_gather(p, a, g),
        params=_params_gather,
        example=EXAMPLE_GATHER,
        make=_make_gather,
        compare=exact_compare("cp_gather_indexer_k_quant_cache"),
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
    # Non-empty windows inside [0, N] (wider ones: OpCase.out_of_range); empty ones any.
    ks = torch.randint(0, n + 1, (m,), generator=gen)
    ke = ks + torch.randint(-2, n + 3, (m,), generator=gen)
    ke = torch.where(ke > ks, ke.clamp(max=n), ke)
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
        unread=lambda p, a: _unread_mqa(p, a),
        out_of_range=lambda p, a, g: _oor_mqa(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_mqa(p, a, g),
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
        unread=lambda p, a: _unread_paged(p, a),
        out_of_range=lambda p, a, g: _oor_paged(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_paged(p, a, g),
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
    idx = torch.randint(0, mb * bs, (t, k), generator=gen)  # past the table: OpCase.out_of_range
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
        unread=lambda p, a: _unread_slots(p, a),
        out_of_range=lambda p, a, g: _oor_slots(p, a, g),
        nonfinite=reads_no_floats,
        params=_params_slots,
        example=EXAMPLE_SLOTS,
        make=_make_slots,
        compare=exact_compare("req_local_to_global_slots"),
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


# -- composites: shared comparison -------------------------------------------------------
def compare_new_keys(k, slots, ce, ca, what: str) -> None:
    """The caches after writing `k` at `slots`: scales and untouched bytes exact, written
    fp8 values within one e4m3 step (aiter's quantiser multiplies by 1/s)."""
    ce, ca, slots = ce.cpu(), ca.cpu(), slots.cpu().long()
    d = k.shape[1]
    nb, bs, _ = ce.shape
    written = slots[(slots >= 0) & (slots < nb * bs)]
    blk, off = written // bs, written % bs
    ve, se = layout.cache_views(ce, d)
    va, sa = layout.cache_views(ca, d)
    assert_same(ve[blk, off].view(FP8), va[blk, off].view(FP8), f"{what} cache values")
    torch.testing.assert_close(sa[blk, off], se[blk, off], rtol=0, atol=0, msg=lambda m: f"{what} cache scales: {m}")
    patched = clone_tensor(ca)
    layout.cache_views(patched, d)[0][blk, off] = ve[blk, off]
    assert torch.equal(patched, ce), f"{what}: cache bytes outside the new tokens' slots changed"


def assert_topk_near(logits, lo, hi, shift, indices, topk: int, what: str, tol: float = 2 * LOGIT_TOL) -> None:
    """`indices` is a top-`topk` of each row's range `[lo, hi)` of `logits` up to `tol`.

    Exact structure: `min(topk, hi - lo)` distinct in-range positions (minus `shift`),
    then -1 to the end of the row. Values: every chosen score is >= the row's k-th
    largest minus `tol * max|row|`, every score left out is <= it plus that much. With
    `tol = 0` this is the set-of-scores comparison (any set of tied scores passes); a
    positive `tol` admits the swaps at the k-th value that a backend whose logits differ
    by rounding (fp8 tensor cores) may make. A top-k of logits within `e` of these is
    within `2e` of this bound (the k-th value moves by at most `e` too): hence the
    default of twice the logits tolerance.
    """
    logits = logits.detach().double()  # on its device: realistic prefill rows sort fast on a GPU
    dev = logits.device
    indices, lo, hi, shift = indices.to(dev), lo.to(dev).long(), hi.to(dev).long(), shift.to(dev).long()
    rows, width = logits.shape
    k_cols = indices.shape[1]
    count = torch.minimum(hi - lo, torch.full_like(hi, topk)).clamp_min(0)
    cols = torch.arange(k_cols, device=dev)
    want = cols[None, :] < count[:, None]
    bad = ((indices != -1) != want).any(dim=1)
    assert not bad.any(), f"{what}: the -1 tail is wrong in rows {bad.nonzero().flatten()[:8].tolist()}"
    absolute = indices.long() + shift[:, None]
    inside = (absolute >= lo[:, None]) & (absolute < hi[:, None])
    bad = (want & ~inside).any(dim=1)
    assert not bad.any(), f"{what}: positions outside the valid range in rows {bad.nonzero().flatten()[:8].tolist()}"
    if width == 0 or rows == 0:
        return
    chosen = torch.zeros(rows, width + 1, dtype=torch.int64, device=dev)
    chosen.scatter_add_(1, torch.where(want, absolute, width).clamp(0, width), want.long())
    assert chosen[:, :width].max() <= 1, f"{what}: repeated positions"
    chosen = chosen[:, :width].bool()
    grid = torch.arange(width, device=dev)
    valid = (grid[None, :] >= lo[:, None]) & (grid[None, :] < hi[:, None])
    vals = torch.where(valid, logits, float("-inf"))
    kth = vals.sort(dim=1, descending=True).values.gather(1, (count - 1).clamp_min(0)[:, None])[:, 0]
    slack = tol * torch.where(valid, logits.abs(), 0.0).amax(dim=1)
    low = torch.where(chosen, logits, float("inf")).amin(dim=1)
    high = torch.where(valid & ~chosen, logits, float("-inf")).amax(dim=1)
    has = count > 0
    bad = has & ((low < kth - slack) | (high > kth + slack))
    assert not bad.any(), (
        f"{what}: not a top-{topk} (tolerance {tol}) in rows {bad.nonzero().flatten()[:8].tolist()}: "
        f"k-th {kth[bad][:4].tolist()}, lowest chosen {low[bad][:4].tolist()}, highest left {high[bad][:4].tolist()}"
    )


def _decode_check_rows(args, what: str) -> None:
    """The top-k rows of a decode step's args (after the call) against the reference
    logits of its own cache."""
    cache, q, _, w, _, lens, table, idx, _, topk, length, next_n, _ = args
    t, h, d = q.shape
    logits = reference.fp8_paged_mqa_logits(q.view(-1, next_n, h, d), cache, w, lens, table, length)
    i = torch.arange(t, device=lens.device) % next_n
    hi = (lens.long().repeat_interleave(next_n) - next_n + i + 1).clamp(0, length)
    zero = torch.zeros_like(hi)
    assert_topk_near(logits, zero, hi, zero, idx[:t], topk, what)


def compare_composite_decode(e, a, ea, aa, p) -> None:
    assert e is None and a is None
    k, slots = ea[2], ea[4]
    compare_new_keys(k, slots, ea[0], aa[0], "sparse_attn_indexer_decode")
    t = ea[1].shape[0]
    assert torch.equal(ea[7][t:].cpu(), aa[7][t:].cpu()), "sparse_attn_indexer_decode: topk_indices rows >= T changed"
    _decode_check_rows(ea, "sparse_attn_indexer_decode expected")
    _decode_check_rows(aa, "sparse_attn_indexer_decode actual")


# -- sparse_attn_indexer_decode -----------------------------------------------------------
def _params_composite_decode():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(1, 3),
            "next_n": st.sampled_from([1, 2]),
            "H": st.sampled_from([16, 32, 64]),
            "D": st.sampled_from([64, 128]),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "max_model_len": st.integers(1, 60),
            "topk": st.sampled_from([1, 4, 16, 40]),
            "extra_cols": st.sampled_from([0, 3]),
            "extra_rows": st.sampled_from([0, 2]),
            "dtype": st.sampled_from(DTYPES),
            "scale_fmt": st.sampled_from([None, "ue8m0"]),
            "pad": st.sampled_from([0.0, 0.3]),
        }
    )


def _decode_slots(lens, next_n, table, bs, pad) -> torch.Tensor:
    """Slots of the new tokens: request b's tokens are positions lens[b] - next_n + i
    (-1 for padding requests and for positions below 0)."""
    b = lens.shape[0]
    pos = lens.long()[:, None] - next_n + torch.arange(next_n)[None, :]
    ok = (pos >= 0) & ~pad[:, None]
    blk = table.long().gather(1, torch.where(ok, pos, 0) // bs)
    slots = blk * bs + torch.where(ok, pos, 0) % bs
    return torch.where(ok, slots, -1).reshape(b * next_n)


def _make_composite_decode(p: Params, device, gen):
    b, nn, h, d, bs, length = p["B"], p["next_n"], p["H"], p["D"], p["block_size"], p["max_model_len"]
    t = b * nn
    mb = _cdiv(length, bs) + p.get("extra_blocks", 0)
    nb = b * mb + 1
    cache = random_cache(nb, bs, d, 1, device, gen)
    table = torch.randperm(nb, generator=gen)[: b * mb].view(b, mb).int()
    lens = paged_context_lens(b, nn, length, gen)
    pad = torch.rand(b, generator=gen) < p["pad"]
    lens = torch.where(pad, 0, lens).int()  # padding requests: no context, slot -1
    slots = _decode_slots(lens, nn, table, bs, pad)
    q = fp8_randn((t, h, d), device, gen)
    k = (torch.randn((t, d), generator=gen) * MAGNITUDES[torch.randint(1, 4, (t, 1), generator=gen)]).to(p["dtype"])
    weights = randn((t, h), torch.float32, device, gen)
    idx = poison((t + p["extra_rows"], p["topk"] + p["extra_cols"]), torch.int32, device, gen)
    return (
        cache, q, k.to(device), weights, slots.to(device), lens.to(device), table.to(device), idx,
        p["scale_fmt"], p["topk"], length, nn, p.get("reserve_tokens", 0),
    )


EXAMPLE_COMPOSITE_DECODE: Params = {
    "B": 3, "next_n": 2, "H": 16, "D": 64, "block_size": 4, "max_model_len": 30, "topk": 8,
    "extra_cols": 2, "extra_rows": 2, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "pad": 0.3,
}


def _bad_composite_decode(device, gen):
    args = _make_composite_decode(EXAMPLE_COMPOSITE_DECODE, device, gen)
    cache, q, k, w, slots, lens, table, idx, fmt, topk, length, nn, mnbt = args

    def bad(**kw):
        names = ("kv_cache", "q", "k", "weights", "slot_mapping", "seq_lens", "block_table", "topk_indices",
                 "scale_fmt", "topk", "max_model_len", "next_n", "max_num_batched_tokens")
        return tuple(kw.get(n, v) for n, v in zip(names, args))

    return [
        BadInput("block_table too short for max_model_len", bad(block_table=table[:, :-1]), "block_table", "wide enough"),
        BadInput("q bfloat16", bad(q=q.bfloat16()), "q", "dtype"),
        BadInput("q tokens not B * next_n", bad(q=q[:-1], k=k[:-1], weights=w[:-1], slot_mapping=slots[:-1]), "q", r"B \* next_n"),
        BadInput("weights [T, H + 1]", bad(weights=torch.cat([w, w[:, :1]], 1)), "weights", r"\[T, H\]"),
        BadInput("seq_lens int64", bad(seq_lens=lens.long()), "seq_lens", "dtype"),
        BadInput("topk_indices with fewer rows than T", bad(topk_indices=idx[:3]), "topk_indices", "at least"),
        BadInput("topk above K", bad(topk=idx.shape[1] + 1), "topk", r"\[0, "),
        BadInput("kv_cache with two scales per token", bad(kv_cache=torch.cat([cache, cache[..., :4]], 2)), "kv_cache", r"D \+ 4"),
        BadInput("unknown scale_fmt", bad(scale_fmt="e4m3"), "scale_fmt", "ue8m0"),
        BadInput("next_n 5", bad(next_n=5), "next_n", r"\[1, 4\]"),
        BadInput("k on the meta device", bad(k=k.to("meta")), "k", "device"),
    ]


def _workspace_composite_decode(p: Params, args):
    """`sparse_attn_indexer_decode_workspace`'s args for a call: its largest T
    (`max_num_batched_tokens` when larger), `max_model_len`, H, D and `topk`."""
    call = get_op("sparse_attn_indexer_decode").call(*args)
    t, h, d = call.q.shape
    return (max(t, call.max_num_batched_tokens), call.max_model_len, h, d), {"topk": call.topk}


register_case(
    OpCase(
        op="sparse_attn_indexer_decode",
        unread=lambda p, a: _unread_composite_decode(p, a),
        out_of_range=lambda p, a, g: _oor_composite_decode(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_composite_decode(p, a, g),
        compare_nonfinite=lambda *x: compare_composite_decode_nonfinite(*x),
        params=_params_composite_decode,
        example=EXAMPLE_COMPOSITE_DECODE,
        make=_make_composite_decode,
        compare=compare_composite_decode,
        bad_inputs=_bad_composite_decode,
        workspace_args=_workspace_composite_decode,
        edge_cases=(
            {**EXAMPLE_COMPOSITE_DECODE, "B": 1, "next_n": 1, "block_size": 1, "max_model_len": 1, "topk": 1, "pad": 0.0},
            {**EXAMPLE_COMPOSITE_DECODE, "H": 64, "D": 128, "block_size": 64, "max_model_len": 130, "topk": 64,
             "scale_fmt": None, "dtype": torch.float32, "reserve_tokens": 16},
            {**EXAMPLE_COMPOSITE_DECODE, "H": 32, "next_n": 1, "max_model_len": 20, "topk": 0, "extra_blocks": 2},
            {**EXAMPLE_COMPOSITE_DECODE, "pad": 1.0},  # every request is padding
        ),
        gpu_examples=(
            {"B": 32, "next_n": 1, "H": 64, "D": 128, "block_size": 64, "max_model_len": 8192, "topk": 2048,
             "extra_cols": 0, "extra_rows": 0, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "pad": 0.1},
            {"B": 16, "next_n": 2, "H": 64, "D": 128, "block_size": 64, "max_model_len": 16384, "topk": 2048,
             "extra_cols": 0, "extra_rows": 8, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "pad": 0.0,
             "reserve_tokens": 256},
            {"B": 8, "next_n": 1, "H": 32, "D": 128, "block_size": 1, "max_model_len": 4096, "topk": 512,
             "extra_cols": 16, "extra_rows": 0, "dtype": torch.float16, "scale_fmt": None, "pad": 0.2},
        ),
    )
)


# -- sparse_attn_indexer_prefill ----------------------------------------------------------
def _params_composite_prefill():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(1, 3),
            "T": st.integers(0, 12),
            "max_ctx": st.integers(1, 24),
            "H": st.sampled_from([16, 32]),
            "D": st.sampled_from([64, 128]),
            "block_size": st.sampled_from([1, 4, 16, 64]),
            "topk": st.sampled_from([1, 4, 16, 40]),
            "extra_cols": st.sampled_from([0, 3]),
            "extra_rows": st.sampled_from([0, 2]),
            "dtype": st.sampled_from(DTYPES),
            "scale_fmt": st.sampled_from([None, "ue8m0"]),
            "chunk": st.sampled_from(["default", "1", "2", "3", "3-1", "3+1"]),
        }
    )


def prefill_chunk_bound(chunk: str, tokens: int, keys: int, topk: int) -> int:
    """max_chunk_bytes for a case: "default", "R" (exactly R rows' need), "R-1", "R+1"."""
    if chunk == "default":
        return plan.DEFAULT_MAX_CHUNK_BYTES
    rows, _, delta = chunk.partition("-") if "-" in chunk else chunk.partition("+")
    need = plan.prefill_chunk_bytes(int(rows), keys, topk)
    return need - int(delta or 0) if "-" in chunk else need + int(delta or 0)


def prefill_batch(b: int, t: int, max_ctx: int, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query tokens, prior context) per request and the number of padding tokens: T query
    tokens spread over B requests of at most `max_ctx` tokens each, the rest padding."""
    q_lens = torch.zeros(b, dtype=torch.int64)
    left = t - int(torch.randint(0, t // 4 + 1, (), generator=gen))  # some padding at the end
    for r in range(b):  # test-input builder: host loop over requests
        q_lens[r] = min(left, max_ctx) if r == b - 1 else min(left, int(torch.randint(0, max_ctx + 1, (), generator=gen)))
        left -= int(q_lens[r])
    prior = (torch.rand(b, generator=gen) * (max_ctx - q_lens + 1)).long().clamp(0, max_ctx)
    prior = torch.where(torch.rand(b, generator=gen) < 0.3, 0, prior)  # context exactly the new tokens
    return q_lens, prior, t - int(q_lens.sum())


def _make_composite_prefill(p: Params, device, gen):
    b, t, max_ctx, h, d, bs, topk = p["B"], p["T"], p["max_ctx"], p["H"], p["D"], p["block_size"], p["topk"]
    n = b * max_ctx  # total_seq_lens: an upper bound of the gathered rows (shapes from params)
    mb = _cdiv(max_ctx, bs) + 1
    nb = b * mb + 1
    cache = random_cache(nb, bs, d, 1, device, gen)
    table = torch.randperm(nb, generator=gen)[: b * mb].view(b, mb).int()
    q_lens, prior, _ = prefill_batch(b, t, max_ctx, gen)
    ctx = prior + q_lens
    cu = torch.zeros(b + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(ctx, 0)
    req = torch.repeat_interleave(torch.arange(b), q_lens)  # request of each real token
    j = torch.arange(req.shape[0]) - torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens)
    pos = prior[req] + j  # position of each real token in its request
    slots = table.long()[req, pos // bs] * bs + pos % bs
    pad = t - req.shape[0]
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])
    ks = torch.cat([cu[req], torch.zeros(pad, dtype=torch.int64)])
    ke = torch.cat([cu[req] + pos + 1, torch.zeros(pad, dtype=torch.int64)])  # padding: empty window
    q = fp8_randn((t, h, d), device, gen)
    k = (torch.randn((t, d), generator=gen) * MAGNITUDES[torch.randint(1, 4, (t, 1), generator=gen)]).to(p["dtype"])
    weights = randn((t, h), torch.float32, device, gen)
    idx = poison((t + p["extra_rows"], topk + p["extra_cols"]), torch.int32, device, gen)
    bound = prefill_chunk_bound(p["chunk"], t, n, topk)
    return (
        cache, q, k.to(device), weights, slots.to(device), table.to(device), cu.int().to(device),
        ks.int().to(device), ke.int().to(device), idx, p["scale_fmt"], topk, n, bound,
        p.get("reserve_tokens", 0), p.get("reserve_keys", 0),
    )


def _prefill_check_rows(args, what: str) -> None:
    """The same for a prefill step: reference gather and logits of its own cache."""
    cache, q, _, w, _, table, cu, ks, ke, idx, _, topk, n = args[:13]
    t, _, d = q.shape
    keys = torch.zeros((n, d), dtype=torch.uint8, device=q.device).view(FP8)
    scales = torch.zeros((n,), dtype=torch.float32, device=q.device)
    reference.cp_gather_indexer_k_quant_cache(cache, keys, scales, table, cu)
    logits = reference.fp8_mqa_logits(q, keys, scales, w, ks, ke)
    lo = ks.long().clamp(0, n)
    hi = torch.maximum(ke.long().clamp(max=n), lo)
    assert_topk_near(logits, lo, hi, ks.long(), idx[:t], topk, what)


def compare_composite_prefill(e, a, ea, aa, p) -> None:
    assert e is None and a is None
    compare_new_keys(ea[2], ea[4], ea[0], aa[0], "sparse_attn_indexer_prefill")
    t = ea[1].shape[0]
    assert torch.equal(ea[9][t:].cpu(), aa[9][t:].cpu()), "sparse_attn_indexer_prefill: topk_indices rows >= T changed"
    _prefill_check_rows(ea, "sparse_attn_indexer_prefill expected")
    _prefill_check_rows(aa, "sparse_attn_indexer_prefill actual")


EXAMPLE_COMPOSITE_PREFILL: Params = {
    "B": 3, "T": 12, "max_ctx": 20, "H": 16, "D": 64, "block_size": 4, "topk": 8, "extra_cols": 2,
    "extra_rows": 2, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "chunk": "3",
}


def _bad_composite_prefill(device, gen):
    args = _make_composite_prefill(EXAMPLE_COMPOSITE_PREFILL, device, gen)
    names = ("kv_cache", "q", "k", "weights", "slot_mapping", "block_table", "cu_seq_lens", "cu_seqlen_ks",
             "cu_seqlen_ke", "topk_indices", "scale_fmt", "topk", "total_seq_lens", "max_chunk_bytes",
             "max_num_batched_tokens", "max_total_seq_lens")
    a = dict(zip(names, args))

    def bad(**kw):
        return tuple(kw.get(n, a[n]) for n in names)

    return [
        BadInput("q float16", bad(q=a["q"].half()), "q", "dtype"),
        BadInput("k with another D", bad(k=a["k"][:, :32]), "k", r"\[T, D\]"),
        BadInput("cu_seq_lens of B entries", bad(cu_seq_lens=a["cu_seq_lens"][1:]), "cu_seq_lens", r"\[B \+ 1\]"),
        BadInput("cu_seqlen_ks int64", bad(cu_seqlen_ks=a["cu_seqlen_ks"].long()), "cu_seqlen_ks", "dtype"),
        BadInput("cu_seqlen_ke strided", bad(cu_seqlen_ke=a["cu_seqlen_ke"].repeat_interleave(2)[::2]), "cu_seqlen_ke", "contiguous"),
        BadInput("topk_indices with fewer rows than T", bad(topk_indices=a["topk_indices"][:2]), "topk_indices", "at least"),
        BadInput("max_chunk_bytes 0", bad(max_chunk_bytes=0), "max_chunk_bytes", "positive"),
        BadInput("total_seq_lens -1", bad(total_seq_lens=-1), "total_seq_lens", ">= 0"),
        BadInput("kv_cache with two scales per token", bad(kv_cache=torch.cat([a["kv_cache"], a["kv_cache"][..., :4]], 2)), "kv_cache", r"D \+ 4"),
        BadInput("block_table on the meta device", bad(block_table=a["block_table"].to("meta")), "block_table", "device"),
    ]


def _workspace_composite_prefill(p: Params, args):
    """`sparse_attn_indexer_prefill_workspace`'s args for a call: its largest T and N (the
    `max_*` bounds when larger), H, D, `topk` and `max_chunk_bytes`."""
    call = get_op("sparse_attn_indexer_prefill").call(*args)
    t, h, d = call.q.shape
    keys = max(call.total_seq_lens, call.max_total_seq_lens)
    return ((max(t, call.max_num_batched_tokens), 0, h, d),
            {"topk": call.topk, "max_total_seq_lens": keys, "max_chunk_bytes": call.max_chunk_bytes})


register_case(
    OpCase(
        op="sparse_attn_indexer_prefill",
        unread=lambda p, a: _unread_composite_prefill(p, a),
        out_of_range=lambda p, a, g: _oor_composite_prefill(p, a, g),
        nonfinite=lambda p, a, g: _nonfinite_composite_prefill(p, a, g),
        compare_nonfinite=lambda *x: compare_composite_prefill_nonfinite(*x),
        params=_params_composite_prefill,
        example=EXAMPLE_COMPOSITE_PREFILL,
        make=_make_composite_prefill,
        compare=compare_composite_prefill,
        bad_inputs=_bad_composite_prefill,
        workspace_args=_workspace_composite_prefill,
        edge_cases=(
            {**EXAMPLE_COMPOSITE_PREFILL, "T": 0},
            {**EXAMPLE_COMPOSITE_PREFILL, "B": 1, "T": 1, "max_ctx": 1, "block_size": 1, "topk": 1, "chunk": "default"},
            {**EXAMPLE_COMPOSITE_PREFILL, "H": 64, "D": 128, "block_size": 64, "max_ctx": 70, "topk": 64,
             "scale_fmt": None, "dtype": torch.float32, "chunk": "3-1", "reserve_tokens": 40, "reserve_keys": 300},
            {**EXAMPLE_COMPOSITE_PREFILL, "H": 32, "topk": 0, "chunk": "1"},
        ),
        gpu_examples=(
            {"B": 4, "T": 2048, "max_ctx": 4096, "H": 64, "D": 128, "block_size": 64, "topk": 2048, "extra_cols": 0,
             "extra_rows": 0, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "chunk": "default"},
            {"B": 2, "T": 1000, "max_ctx": 3000, "H": 64, "D": 128, "block_size": 64, "topk": 2048, "extra_cols": 0,
             "extra_rows": 4, "dtype": torch.bfloat16, "scale_fmt": "ue8m0", "chunk": "300+1"},
            {"B": 8, "T": 512, "max_ctx": 512, "H": 32, "D": 128, "block_size": 1, "topk": 512, "extra_cols": 0,
             "extra_rows": 0, "dtype": torch.float16, "scale_fmt": None, "chunk": "7"},
        ),
    )
)


# -- unread elements, ids out of range, non-finite inputs ---------------------------------
# Bad ids the out-of-range checks cycle through (the table's or cache's own size is added).
BAD_IDS = (10**6, -5, -2)


def _bad_ids(count: int, high: int) -> torch.Tensor:
    """`count` out-of-range ids: 10**6, -5, -2 and exactly `high`, in turn."""
    pool = torch.tensor(BAD_IDS + (high,), dtype=torch.int64)
    return pool[torch.arange(count) % len(pool)]


def _pick(mask: torch.Tensor, gen, at_most: int = 4) -> torch.Tensor:
    """Flat indices of up to `at_most` random True elements of `mask` (a host helper)."""
    where = mask.reshape(-1).nonzero().flatten()
    order = torch.randperm(where.numel(), generator=gen)[:at_most]
    return where[order]


def _with(args, index: int, tensor: torch.Tensor) -> tuple:
    out = list(args)
    out[index] = tensor
    return tuple(out)


def _replace_ids(pair, index: int, used: torch.Tensor, high: int, gen, padding: int = -1):
    """((bad, padded), count): a few ids of argument `index` where `used` (a bool mask of
    its shape) replaced by bad ids in `bad` and by `padding` in `padded`."""
    picks = _pick(used.cpu(), gen)
    if picks.numel() == 0:
        return pair, 0
    bad_args, padded_args = pair
    bad, padded = clone_tensor(bad_args[index]), clone_tensor(padded_args[index])
    at = picks.to(bad.device)
    bad.view(-1)[at] = _bad_ids(picks.numel(), high).to(bad.dtype).to(bad.device)
    padded.view(-1)[at] = padding
    return (_with(bad_args, index, bad), _with(padded_args, index, padded)), picks.numel()


def table_used(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool `[B, max_blocks]`: the entries that hold a position below each length."""
    blocks = torch.div(lengths.long().cpu().clamp_min(0) + block_size - 1, block_size, rounding_mode="floor")
    return torch.arange(block_table.shape[1])[None, :] < blocks[:, None]


def tokens_read(block_table, lengths, block_size: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of every cache token below each request's length whose block id is valid."""
    table, lengths = block_table.cpu().long(), lengths.cpu().long()
    width = table.shape[1] * block_size
    pos = torch.arange(width)
    raw = table[:, pos // block_size] if width else table[:, :0]
    ok = (pos[None, :] < lengths[:, None]) & (raw >= 0) & (raw < num_blocks)
    return raw[ok], (pos % block_size).expand_as(raw)[ok]


def cache_token_mask(cache: torch.Tensor, d: int, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Bool of the cache's shape: the value bytes and scales of tokens (blk, off)."""
    marker = torch.zeros(cache.shape, dtype=torch.uint8)
    values, scales = layout.cache_views(marker, d)
    values[blk, off] = 1
    scales.view(torch.int32)[blk, off] = -1
    return marker != 0


def _slot_tokens(slots: torch.Tensor, nb: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = slots.cpu().long()
    s = s[(s >= 0) & (s < nb * bs)]
    return s // bs, s % bs


def _nan_fp8(x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """A copy of fp8 (or uint8) `x` with NaN bytes (0x7F, 0xFF in turn) at flat `picks`."""
    y = clone_tensor(x)
    y.view(torch.uint8).view(-1)[picks.to(x.device)] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)[
        torch.arange(picks.numel()) % 2].to(x.device)
    return y


def _nonfinite_floats(x: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """A copy of float `x` with NaN, +inf, -inf in turn at flat `picks`."""
    y = clone_tensor(x)
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.arange(picks.numel()) % 3]
    y.view(-1)[picks.to(x.device)] = vals.to(x.dtype).to(x.device)
    return y


def _nonfinite_cache(cache: torch.Tensor, d: int, blk, off, gen) -> torch.Tensor:
    """A copy of `cache` with NaN value bytes and NaN/+-inf scales at some of tokens (blk, off)."""
    out = clone_tensor(cache)
    if blk.numel() == 0:
        return out
    values, scales = layout.cache_views(out, d)
    pick = torch.randperm(blk.numel(), generator=gen)[:3]
    col = torch.randint(0, d, (pick.numel(),), generator=gen)
    values[blk[pick], off[pick], col] = 0x7F
    pick = torch.randperm(blk.numel(), generator=gen)[:3]
    nonfinite = torch.tensor([float("nan"), float("inf"), float("-inf")])[: pick.numel()]
    scales[blk[pick], off[pick], 0] = nonfinite.to(scales.device)
    return out


def without_nans(cache: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU copy of `cache` with NaN values (bytes 0x7F/0xFF) and NaN scales zeroed, and
    the masks of both."""
    c = clone_tensor(cache.cpu())
    values, scales = layout.cache_views(c, d)
    v_nan, s_nan = (values & 0x7F) == 0x7F, torch.isnan(scales)
    values[v_nan] = 0
    scales[s_nan] = 0.0
    return c, v_nan, s_nan


def _same_nan_places(ce, ca, d: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    e, ve, se = without_nans(ce, d)
    a, va, sa = without_nans(ca, d)
    assert torch.equal(ve, va), f"{what}: NaN values at other places than the reference's"
    assert torch.equal(se, sa), f"{what}: NaN scales at other places than the reference's"
    return e, a


def compare_quant_nonfinite(e, a, ea, aa, p) -> None:
    """NaN values and scales at the reference's places; the rest as `compare_quant`
    (+-inf scales compare equal)."""
    ce, ca = _same_nan_places(ea[1], aa[1], ea[0].shape[1], "indexer_k_quant_and_cache")
    compare_quant(e, a, _with(ea, 1, ce), _with(aa, 1, ca), p)


def _ids_pair(args, gen, *replacements):
    """(bad, padded) from `(index, used, high)` replacements; None when no id is used."""
    pair, total = (args, args), 0
    for index, used, high in replacements:
        pair, n = _replace_ids(pair, index, used, high, gen)
        total += n
    return pair if total else None


def _flat_picks(mask: torch.Tensor, gen, at_most: int = 6) -> torch.Tensor:
    return _pick(mask.cpu(), gen, at_most)


# indexer_k_quant_and_cache
def _unread_quant(p, args):
    k, cache, slots = args[:3]
    nb, bs = cache.shape[:2]
    s = slots.cpu().long()
    skipped = ~((s >= 0) & (s < nb * bs))
    return [(0, skipped[:, None].expand(k.shape)), (1, torch.ones(cache.shape, dtype=torch.bool))]


def _oor_quant(p, args, gen):
    k, cache, slots = args[:3]
    nb, bs = cache.shape[:2]
    return _ids_pair(args, gen, (2, torch.ones(slots.shape, dtype=torch.bool), nb * bs))


def _nonfinite_quant(p, args, gen):
    k = args[0]
    if k.numel() == 0:
        return None
    return _with(args, 0, _nonfinite_floats(k, _flat_picks(torch.ones(k.shape, dtype=torch.bool), gen)))


# cp_gather_indexer_k_quant_cache
def _gather_lengths(args) -> torch.Tensor:
    """Rows of each request that lie in dst (cu non-decreasing, as the case draws it)."""
    dst_k, cu = args[1], args[4].cpu().long()
    n = dst_k.shape[0]
    return (torch.minimum(cu[1:], torch.full_like(cu[1:], n)) - cu[:-1]).clamp_min(0)


def _unread_gather(p, args):
    cache, dst_k, dst_scale, table = args[:4]
    lengths = _gather_lengths(args)
    blk, off = tokens_read(table, lengths, cache.shape[1], cache.shape[0])
    read = cache_token_mask(cache, dst_k.shape[1], blk, off)
    return [(0, ~read), (1, torch.ones(dst_k.shape, dtype=torch.bool)),
            (2, torch.ones(dst_scale.shape, dtype=torch.bool)),
            (3, ~table_used(table, lengths, cache.shape[1]))]


def _oor_gather(p, args, gen):
    cache, table = args[0], args[3]
    return _ids_pair(args, gen, (3, table_used(table, _gather_lengths(args), cache.shape[1]), cache.shape[0]))


def _nonfinite_gather(p, args, gen):
    cache, dst_k, table = args[0], args[1], args[3]
    blk, off = tokens_read(table, _gather_lengths(args), cache.shape[1], cache.shape[0])
    if blk.numel() == 0:
        return None
    return _with(args, 0, _nonfinite_cache(cache, dst_k.shape[1], blk, off, gen))


# fp8_mqa_logits
def _mqa_window_masks(args):
    """(keys read [N], rows with a non-empty window [M]) of the windows clipped to [0, N)."""
    k, ks, ke = args[1], args[4].cpu().long(), args[5].cpu().long()
    n = k.shape[0]
    lo, hi = ks.clamp(0, n), ke.clamp(0, n)
    cols = torch.arange(n)
    inside = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    return inside.any(dim=0), hi > lo


def _unread_mqa(p, args):
    q, k, k_scale, w = args[:4]
    keys, rows = _mqa_window_masks(args)
    return [(0, ~rows[:, None, None].expand(q.shape)), (1, ~keys[:, None].expand(k.shape)),
            (2, ~keys), (3, ~rows[:, None].expand(w.shape))]


def _oor_mqa(p, args, gen):
    """Windows stretched outside [0, N) where they touch its ends: they clip back to the
    drawn windows (the `padded` args)."""
    n = args[1].shape[0]
    ks, ke = args[4].cpu().long(), args[5].cpu().long()
    open_ = ke > ks
    pair, total = (args, args), 0
    for index, at_end, bad in ((4, open_ & (ks == 0), (-5, -(10**6), -2)), (5, open_ & (ke == n), (n + 1, 10**6))):
        picks = _pick(at_end, gen)
        if picks.numel():
            t = clone_tensor(args[index])
            t[picks.to(t.device)] = torch.tensor(bad)[torch.arange(picks.numel()) % len(bad)].to(t.dtype).to(t.device)
            pair, total = (_with(pair[0], index, t), pair[1]), total + 1
    return pair if total else None


def _nonfinite_mqa(p, args, gen):
    q, k, k_scale, w = args[:4]
    keys, rows = _mqa_window_masks(args)
    q_at = _flat_picks(rows[:, None, None].expand(q.shape), gen, 2)
    k_at = _flat_picks(keys[:, None].expand(k.shape), gen, 2)
    if q_at.numel() == 0 or k_at.numel() == 0:
        return None
    return (_nan_fp8(q, q_at), _nan_fp8(k, k_at), _nonfinite_floats(k_scale, _flat_picks(keys, gen, 3)),
            _nonfinite_floats(w, _flat_picks(rows[:, None].expand(w.shape), gen, 3)), *args[4:])


# fp8_paged_mqa_logits
def _paged_lengths(args) -> torch.Tensor:
    return args[3].cpu().long().clamp(0, args[5])


def _paged_rows_see_keys(args) -> torch.Tensor:
    """Bool [B, next_n]: rows whose visible range n < ctx - next_n + i + 1 is not empty."""
    nn = args[0].shape[1]
    limit = args[3].cpu().long()[:, None] - nn + 1 + torch.arange(nn)[None, :]
    return limit.clamp(max=args[5]) > 0


def _unread_paged(p, args):
    q, cache, w, lens, table, length = args
    d = q.shape[-1]
    blk, off = tokens_read(table, _paged_lengths(args), cache.shape[1], cache.shape[0])
    rows = _paged_rows_see_keys(args)
    return [(0, ~rows[:, :, None, None].expand(q.shape)), (1, ~cache_token_mask(cache, d, blk, off)),
            (2, ~rows.reshape(-1, 1).expand(w.shape)),
            (4, ~table_used(table, _paged_lengths(args), cache.shape[1]))]


def _oor_paged(p, args, gen):
    cache, table = args[1], args[4]
    return _ids_pair(args, gen, (4, table_used(table, _paged_lengths(args), cache.shape[1]), cache.shape[0]))


def _nonfinite_paged(p, args, gen):
    q, cache, w, lens, table, length = args
    rows = _paged_rows_see_keys(args)
    blk, off = tokens_read(table, _paged_lengths(args), cache.shape[1], cache.shape[0])
    if not rows.any() or blk.numel() == 0:
        return None
    return (_nan_fp8(q, _flat_picks(rows[:, :, None, None].expand(q.shape), gen, 2)),
            _nonfinite_cache(cache, q.shape[-1], blk, off, gen),
            _nonfinite_floats(w, _flat_picks(rows.reshape(-1, 1).expand(w.shape), gen, 3)), lens, table, length)


# req_local_to_global_slots
def _slots_table_used(args) -> torch.Tensor:
    req, table, idx, bs = args
    b, mb = table.shape
    r, pos = req.cpu().long(), idx.cpu().long()
    ok = ((r >= 0) & (r < b))[:, None] & (pos >= 0) & (pos < mb * bs)
    used = torch.zeros((b, mb), dtype=torch.bool)
    used[r[:, None].expand_as(pos)[ok], (pos // bs)[ok]] = True
    return used


def _unread_slots(p, args):
    return [(1, ~_slots_table_used(args))]


def _oor_slots(p, args, gen):
    req, table, idx, bs = args
    b, mb = table.shape
    pair, total = (args, args), 0
    for index, used, high in ((0, torch.ones(req.shape, dtype=torch.bool), b),
                              (2, torch.ones(idx.shape, dtype=torch.bool), mb * bs)):
        pair, n = _replace_ids(pair, index, used, high, gen)
        total += n
    # Block ids: only negative ones are out of range (the op knows no num_blocks).
    picks = _pick(_slots_table_used(args), gen)
    if picks.numel():
        bad, padded = clone_tensor(table), clone_tensor(table)
        at = picks.to(table.device)
        bad.view(-1)[at] = torch.tensor([-5, -2, -(2**31)], dtype=torch.int32)[torch.arange(picks.numel()) % 3].to(table.device)
        padded.view(-1)[at] = -1
        pair, total = (_with(pair[0], 1, bad), _with(pair[1], 1, padded)), total + 1
    return pair if total else None


# composites
def _composite_cache_unread(cache, d, slots, blk, off) -> torch.Tensor:
    """Cache bytes a composite never reads: all but the tokens it reads, and the new
    tokens' slots (overwritten before anything reads them)."""
    nb, bs = cache.shape[:2]
    wb, wo = _slot_tokens(slots, nb, bs)
    return ~cache_token_mask(cache, d, blk, off) | cache_token_mask(cache, d, wb, wo)


def _k_rows_skipped(k, slots, cache) -> torch.Tensor:
    nb, bs = cache.shape[:2]
    s = slots.cpu().long()
    return ~((s >= 0) & (s < nb * bs))[:, None].expand(k.shape)


def _decode_rows_see_keys(args) -> torch.Tensor:
    lens, length, nn = args[5].cpu().long(), args[10], args[11]
    limit = lens[:, None] - nn + 1 + torch.arange(nn)[None, :]
    return (limit.clamp(max=length) > 0).reshape(-1)


def _unread_composite_decode(p, args):
    cache, q, k, w, slots, lens, table, idx = args[:8]
    lengths = lens.cpu().long().clamp(0, args[10])
    blk, off = tokens_read(table, lengths, cache.shape[1], cache.shape[0])
    rows = _decode_rows_see_keys(args)
    return [(0, _composite_cache_unread(cache, q.shape[-1], slots, blk, off)),
            (1, ~rows[:, None, None].expand(q.shape)), (2, _k_rows_skipped(k, slots, cache)),
            (3, ~rows[:, None].expand(w.shape)), (6, ~table_used(table, lengths, cache.shape[1])),
            (7, torch.ones(idx.shape, dtype=torch.bool))]


def _oor_composite_decode(p, args, gen):
    cache, slots, lens, table = args[0], args[4], args[5], args[6]
    nb, bs = cache.shape[:2]
    lengths = lens.cpu().long().clamp(0, args[10])
    s = slots.cpu().long()
    return _ids_pair(args, gen, (4, (s >= 0) & (s < nb * bs), nb * bs), (6, table_used(table, lengths, bs), nb))


def _nonfinite_composite(args, gen, rows: torch.Tensor, slots: torch.Tensor):
    """NaN/inf in new keys that are written, NaN in queries and NaN/inf in weights of rows
    that score keys."""
    cache, q, k, w = args[:4]
    nb, bs = cache.shape[:2]
    s = slots.cpu().long()
    written = ((s >= 0) & (s < nb * bs))[:, None].expand(k.shape)
    if not rows.any() or not written.any():
        return None
    return (cache, _nan_fp8(q, _flat_picks(rows[:, None, None].expand(q.shape), gen, 2)),
            _nonfinite_floats(k, _flat_picks(written, gen, 3)),
            _nonfinite_floats(w, _flat_picks(rows[:, None].expand(w.shape), gen, 3)), *args[4:])


def _nonfinite_composite_decode(p, args, gen):
    return _nonfinite_composite(args, gen, _decode_rows_see_keys(args), args[4])


def _compare_composite_nonfinite(ea, aa, what: str, check_rows, cache_at: int, idx_at: int) -> None:
    """Non-finite inputs: the cache as `compare_quant_nonfinite`, topk_indices rows >= T
    untouched, and rows < T a valid selection (count, -1 tail, in-range distinct
    positions: with NaN logits the choice itself is the top-k op's order, checked there)."""
    d = ea[1].shape[-1]
    ce, ca = _same_nan_places(ea[cache_at], aa[cache_at], d, what)
    compare_new_keys(ea[2], ea[4], ce, ca, what)
    t = ea[1].shape[0]
    assert torch.equal(ea[idx_at][t:].cpu(), aa[idx_at][t:].cpu()), f"{what}: topk_indices rows >= T changed"
    check_rows(aa, what)


def _decode_structure(args, what: str) -> None:
    cache, q, _, w, _, lens, table, idx, _, topk, length, next_n, _ = args
    t = q.shape[0]
    i = torch.arange(t) % next_n
    hi = (lens.cpu().long().repeat_interleave(next_n) - next_n + i + 1).clamp(0, length)
    zero = torch.zeros_like(hi)
    assert_topk_near(torch.zeros((t, length)), zero, hi, zero, idx[:t].cpu(), topk, what)


def compare_composite_decode_nonfinite(e, a, ea, aa, p) -> None:
    _compare_composite_nonfinite(ea, aa, "sparse_attn_indexer_decode", _decode_structure, 0, 7)


def _prefill_lengths(args) -> torch.Tensor:
    cu, n = args[6].cpu().long(), args[12]
    return (torch.minimum(cu[1:], torch.full_like(cu[1:], n)) - cu[:-1]).clamp_min(0)


def _prefill_rows_see_keys(args) -> torch.Tensor:
    ks, ke = args[7].cpu().long(), args[8].cpu().long()
    return ke > ks


def _unread_composite_prefill(p, args):
    cache, q, k, w, slots, table = args[:6]
    idx = args[9]
    lengths = _prefill_lengths(args)
    blk, off = tokens_read(table, lengths, cache.shape[1], cache.shape[0])
    rows = _prefill_rows_see_keys(args)
    return [(0, _composite_cache_unread(cache, q.shape[-1], slots, blk, off)),
            (1, ~rows[:, None, None].expand(q.shape)), (2, _k_rows_skipped(k, slots, cache)),
            (3, ~rows[:, None].expand(w.shape)), (5, ~table_used(table, lengths, cache.shape[1])),
            (9, torch.ones(idx.shape, dtype=torch.bool))]


def _oor_composite_prefill(p, args, gen):
    cache, slots, table = args[0], args[4], args[5]
    nb, bs = cache.shape[:2]
    s = slots.cpu().long()
    return _ids_pair(args, gen, (4, (s >= 0) & (s < nb * bs), nb * bs),
                     (5, table_used(table, _prefill_lengths(args), bs), nb))


def _nonfinite_composite_prefill(p, args, gen):
    return _nonfinite_composite(args, gen, _prefill_rows_see_keys(args), args[4])


def _prefill_structure(args, what: str) -> None:
    q, ks, ke, idx, topk, n = args[1], args[7], args[8], args[9], args[11], args[12]
    t = q.shape[0]
    lo = ks.cpu().long().clamp(0, n)
    hi = torch.maximum(ke.cpu().long().clamp(max=n), lo)
    assert_topk_near(torch.zeros((t, n)), lo, hi, ks.cpu().long(), idx[:t].cpu(), topk, what)


def compare_composite_prefill_nonfinite(e, a, ea, aa, p) -> None:
    _compare_composite_nonfinite(ea, aa, "sparse_attn_indexer_prefill", _prefill_structure, 0, 9)
