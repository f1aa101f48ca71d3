"""Test cases of `paged_attention_decode`, `paged_attention_prefill` and `flash_attn_varlen`.

Host ints (max_seqlen_*, scale, causal, the fp8 mode) come from the params; lengths are
drawn per seed (unless the params pin them), so two seeds of one params set share a
CUDA graph and its replay sees new lengths. Under Triton's CPU interpreter only float16
is drawn: the interpreter computes bf16 `tl.dot` wrongly (bf16 is checked on the GPU).
"""

from __future__ import annotations

import torch

from graphsafe.backends import triton_interpreter_enabled
from graphsafe.testing.cases import Args, BadInput, OpCase, Params, flag, register_case, value
from graphsafe.testing.tensors import randn

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float16,) if triton_interpreter_enabled() else (torch.bfloat16, torch.float16)
# Unit roundoff of the output dtype (also the rounding of P before its P.V product).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP8_UNIT_ROUNDOFF = 2.0**-4  # e4m3: 3 mantissa bits
FP8_SUBNORMAL_STEP = 2.0**-9 / 256  # P is cast as p * 256: absolute error below 2^-6 / 256


def attention_compare(expected, actual, vmax: float, dtype: torch.dtype, fp8_products: bool, num_keys: int, what: str):
    """Kernel vs reference. Both compute q.k and the softmax normaliser in fp32 from the
    same operands; the kernel rounds P to the operand dtype before P.V. Every output is
    a convex combination of values, so that rounding moves it by at most
    `eps_P * max|v|` (eps_P: the dtype's unit roundoff, or e4m3's plus the subnormal
    step per key for fp8 products); both outputs are then rounded to `dtype` (rtol)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}"
    )
    eps = UNIT_ROUNDOFF[dtype]
    eps_p = FP8_UNIT_ROUNDOFF + num_keys * FP8_SUBNORMAL_STEP if fp8_products else eps
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), rtol=2 * eps, atol=eps_p * vmax + 1e-5,
        msg=lambda m: f"{what}: {m}",
    )


def _maxabs(x: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    if x.numel() == 0 or (scale is not None and scale.numel() == 0):
        return 0.0
    m = x.float().abs().amax()
    if scale is not None:
        m = m * scale.float().abs().amax()
    return float(m)


# -- paged_attention_decode -------------------------------------------------------------
def _params_decode():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(0, 3),
            "Hk": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 4, 8]),
            "D": st.sampled_from([16, 32, 64]),
            "Dv": st.sampled_from([None, 16]),
            "block_size": st.sampled_from([1, 4, 16]),
            "max_blocks": st.integers(1, 5),
            "dtype": st.sampled_from(DTYPES),
            "fp8_cache": st.booleans(),
            "strided_cache": st.booleans(),
            **_variant_params(),
        }
    )


def _variant_params() -> dict:
    """The attention variants: a sliding window, a softcap, sinks (each off half the time)."""
    from hypothesis import strategies as st

    return {
        "window_left": st.sampled_from([-1, -1, 0, 2, 5, 13]),
        "softcap": st.sampled_from([0.0, 0.0, 0.5, 4.0]),
        "sinks": st.booleans(),
    }


def _variants(p: Params, num_q_heads: int, device, gen) -> tuple:
    """(window_left, softcap, sinks) of the params; sinks drawn around the scores' scale."""
    sinks = None
    if p.get("sinks"):
        sinks = (torch.randn(num_q_heads, generator=gen) * 2).to(device)
    return p.get("window_left", -1), p.get("softcap", 0.0), sinks


def _decode_cache(shape, dtype, device, gen, strided: bool) -> torch.Tensor:
    nb, bs, hk, d = shape
    if not strided:
        return randn(shape, torch.float32, device, gen).to(dtype)
    big = randn((nb, bs + 1, hk, d + 8), torch.float32, device, gen).to(dtype)
    return big[:, :bs, :, :d]


def _make_decode(p: Params, device, gen):
    b, hk, group, d, bs, mb = p["B"], p["Hk"], p["group"], p["D"], p["block_size"], p["max_blocks"]
    dv = p["Dv"] or d
    hq = hk * group
    nb = b * mb + 1
    cache_dtype = FP8 if p["fp8_cache"] else p["dtype"]
    q = randn((b, hq, d), p["dtype"], device, gen)
    k_cache = _decode_cache((nb, bs, hk, d), cache_dtype, device, gen, p["strided_cache"])
    v_cache = _decode_cache((nb, bs, hk, dv), cache_dtype, device, gen, p["strided_cache"])
    if "seq_lens" in p:
        lens = torch.tensor(p["seq_lens"], dtype=torch.int64)
    else:
        lens = torch.randint(0, mb * bs + 1, (b,), generator=gen)
    table = torch.randperm(nb, generator=gen)[: b * mb].reshape(b, mb)
    # Entries past each request's last used block must never be read: fill with junk.
    unused = torch.arange(mb)[None, :] >= (lens[:, None] + bs - 1) // bs
    junk = torch.randint(-4, 4 * nb, (b, mb), generator=gen)
    table = torch.where(unused, junk, table)
    if p["fp8_cache"]:
        k_scale = (torch.rand(1, generator=gen) * 0.5 + 0.5).to(device)
        v_scale = (torch.rand(1, generator=gen) * 0.5 + 0.5).to(device)
    else:
        k_scale = v_scale = None
    return (q, k_cache, v_cache, table.int().to(device), lens.int().to(device), d**-0.5, k_scale, v_scale,
            *_variants(p, hq, device, gen))


def _decode_workspace_args(p: Params, args: Args) -> tuple[tuple, dict]:
    """`paged_attention_decode_workspace`'s arguments for these inputs: their shapes."""
    q, _, v_cache, block_table = args[:4]
    b, hq, d = q.shape
    _, block_size, hk, dv = v_cache.shape
    return (b, hq, hk, dv, block_table.shape[1], block_size), {"head_dim": d}


def _compare_decode(expected, actual, exp_args, act_args, params):
    v_cache, v_scale = exp_args[2], exp_args[7]
    attention_compare(
        expected, actual, _maxabs(v_cache, v_scale), exp_args[0].dtype, False, 0, "paged_attention_decode output"
    )


def paged_reads(k_cache, table, lens, first) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries [B, MB] of the block table read, cache tokens [nb, bs] read) when request
    b reads its tokens `[first[b], lens[b])` (CPU int64 `lens` clamped, `first`)."""
    nb, bs = k_cache.shape[:2]
    mb = table.shape[1]
    blocks = torch.arange(mb)[None, :]
    entry_read = (blocks < (lens[:, None] + bs - 1) // bs) & (blocks >= first.clamp(min=0)[:, None] // bs)
    pos = torch.arange(mb * bs)
    token = (pos[None, :] < lens[:, None]) & (pos[None, :] >= first[:, None])
    token = token & ((table >= 0) & (table < nb)).repeat_interleave(bs, dim=1)
    read = torch.zeros(nb * bs, dtype=torch.bool)
    slots = table.clamp(0, nb - 1).repeat_interleave(bs, dim=1) * bs + pos[None, :] % bs
    read[slots[token]] = True
    return entry_read, read.reshape(nb, bs)


def _decode_reads(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries [B, MB] of the block table the op reads, cache tokens [nb, bs] it reads):
    those of the tokens below seq_lens, from the window's first on."""
    k_cache, table, lens, window = args[1], args[3].cpu().long(), args[4].cpu().long(), args[8]
    lens = lens.clamp(0, table.shape[1] * k_cache.shape[1])
    first = lens - 1 - window if window >= 0 else torch.zeros_like(lens)
    return paged_reads(k_cache, table, lens, first)


def _unread_decode(p: Params, args: Args):
    """Cache tokens no request reads (other blocks, past seq_lens inside a used block) and
    block-table entries past each request's last block."""
    entry_read, token_read = _decode_reads(args)
    k_cache, v_cache, table = args[1], args[2], args[3]
    return [
        (1, (~token_read)[:, :, None, None].expand(k_cache.shape)),
        (2, (~token_read)[:, :, None, None].expand(v_cache.shape)),
        (3, ~entry_read),
    ]


def _out_of_range_decode(p: Params, args: Args, gen):
    """Read block-table entries -> 10**6, -5, -2, num_blocks (padded: -1); a zero
    `seq_lens` -> -5 (padded: 0, what the op clamps it to)."""
    q, k_cache, table, lens = args[0], args[1], args[3], args[4]
    if q.shape[0] == 0:
        return None
    entry_read, _ = _decode_reads(args)
    bad_table, pad_table = table.clone(), table.clone()
    spots = entry_read.nonzero()
    if len(spots):
        spots = spots[torch.randperm(len(spots), generator=gen)[:4]]
        values = torch.tensor([10**6, -5, -2, k_cache.shape[0]], dtype=torch.int32)[: len(spots)]
        bad_table[spots[:, 0], spots[:, 1]] = values.to(table.device)
        pad_table[spots[:, 0], spots[:, 1]] = -1
    bad_lens, pad_lens = lens.clone(), lens.clone()
    empty = (lens.cpu() == 0).nonzero().flatten()
    if len(empty):
        bad_lens[int(empty[0])] = -5
    rest = args[5:]
    return (*args[:3], bad_table, bad_lens, *rest), (*args[:3], pad_table, pad_lens, *rest)


def _nonfinite_decode(p: Params, args: Args, gen):
    """NaN, +inf, -inf in q and in keys / values of tokens the requests read (NaN only in
    fp8 caches: e4m3fn has no inf)."""
    from graphsafe.testing.contract import clone_tensor  # (keeps strided caches strided)

    q, k_cache, v_cache = (clone_tensor(x) for x in args[:3])
    _, token_read = _decode_reads(args)
    specials = (float("nan"), float("inf"), float("-inf"))
    if q.numel():
        flat = q.view(-1)
        for value, i in zip(specials, torch.randperm(flat.numel(), generator=gen)[:2]):
            flat[int(i)] = value
    tokens = token_read.nonzero()
    if len(tokens):
        tokens = tokens[torch.randperm(len(tokens), generator=gen)[:3]]
        for cache, values in ((k_cache, specials[:1]), (v_cache, specials)):
            for (blk, t), value in zip(tokens.tolist(), values):
                head = int(torch.randint(0, cache.shape[2], (1,), generator=gen))
                col = int(torch.randint(0, cache.shape[3], (1,), generator=gen))
                if cache.dtype != FP8:
                    cache[blk, t, head, col] = value
                elif not triton_interpreter_enabled():  # (its fp8 -> half cast turns NaN into 480)
                    cache[blk, t, head, col] = float("nan")
    return (q, k_cache, v_cache, *args[3:])


EXAMPLE_DECODE: Params = {
    "B": 3, "Hk": 2, "group": 4, "D": 32, "Dv": None, "block_size": 4, "max_blocks": 4,
    "dtype": torch.float16, "fp8_cache": False, "strided_cache": False,
    "window_left": -1, "softcap": 0.0, "sinks": False,
}


def _bad_decode(device, gen):
    q, kc, vc, table, lens, scale = _make_decode(EXAMPLE_DECODE, device, gen)[:6]
    base = (q, kc, vc, table, lens, scale)
    sinks = torch.zeros(q.shape[1], device=device)
    return [
        *variant_bad_inputs((*base, None, None), sinks),
        BadInput("q float32", (q.float(), kc, vc, table, lens, scale), "q", "dtype"),
        BadInput("q 2-D", (q[0], kc, vc, table, lens, scale), "q", "3-D"),
        BadInput("k_cache with other head dim", (q, kc[..., 1:], vc, table, lens, scale), "k_cache", r"D\]"),
        BadInput("Hq not a multiple of Hk", (q[:, :3], kc, vc, table, lens, scale), "k_cache", "divides Hq"),
        BadInput("v_cache with other heads", (q, kc, vc[:, :, :1], table, lens, scale), "v_cache", r"Hk, Dv\]"),
        BadInput("block_table int64", (q, kc, vc, table.long(), lens, scale), "block_table", "dtype"),
        BadInput("seq_lens of other B", (q, kc, vc, table, lens[1:], scale), "seq_lens", r"\[B\]"),
        BadInput(
            "fp8 caches without k_scale", (q, kc.to(FP8), vc.to(FP8), table, lens, scale), "k_scale", "float32"
        ),
    ]


def variant_bad_inputs(pre: Args, sinks: torch.Tensor) -> list[BadInput]:
    """The variants refused: `pre` are the arguments before `window_left`, `sinks` a valid
    sinks tensor."""
    return [
        BadInput("window_left below -1", (*pre, -2), "window_left", ">= -1"),
        BadInput("negative softcap", (*pre, -1, -1.0), "softcap", ">= 0"),
        BadInput("infinite softcap", (*pre, -1, float("inf")), "softcap", "finite"),
        BadInput("sinks float16", (*pre, -1, 0.0, sinks.half()), "sinks", "dtype"),
        BadInput("sinks of other heads", (*pre, -1, 0.0, sinks[:-1]), "sinks", r"\[Hq\]"),
    ]


register_case(
    OpCase(
        op="paged_attention_decode",
        params=_params_decode,
        example=EXAMPLE_DECODE,
        make=_make_decode,
        compare=_compare_decode,
        workspace_args=_decode_workspace_args,
        bad_inputs=_bad_decode,
        unread=_unread_decode,
        out_of_range=_out_of_range_decode,
        nonfinite=_nonfinite_decode,
        edge_cases=(
            {**EXAMPLE_DECODE, "B": 0},
            {**EXAMPLE_DECODE, "seq_lens": [0, 0, 0]},
            {**EXAMPLE_DECODE, "seq_lens": [0, 1, 16], "block_size": 1, "max_blocks": 16},
            {**EXAMPLE_DECODE, "B": 1, "Hk": 1, "seq_lens": [128], "block_size": 8, "max_blocks": 16},  # >1 split
            {**EXAMPLE_DECODE, "fp8_cache": True, "Dv": 16, "strided_cache": True},
            {**EXAMPLE_DECODE, "B": 2, "Hk": 1, "group": 8, "D": 64, "block_size": 16, "max_blocks": 2},
            # Variants: a window inside one block and across several (with > 1 split), softcap, sinks.
            {**EXAMPLE_DECODE, "window_left": 0, "sinks": True},
            {**EXAMPLE_DECODE, "B": 1, "Hk": 1, "seq_lens": [128], "block_size": 8, "max_blocks": 16,
             "window_left": 37, "softcap": 4.0, "sinks": True},
            {**EXAMPLE_DECODE, "seq_lens": [0, 5, 16], "window_left": 6, "fp8_cache": True, "softcap": 0.5},
        ),
        gpu_examples=(
            # Llama-3-8B: Hq=32, Hk=8, D=128, block 16, ctx up to 4096 / 32768.
            {"B": 64, "Hk": 8, "group": 4, "D": 128, "Dv": None, "block_size": 16, "max_blocks": 256,
             "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False},
            {"B": 1, "Hk": 8, "group": 4, "D": 128, "Dv": None, "block_size": 16, "max_blocks": 2048,
             "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False},
            {"B": 16, "Hk": 8, "group": 4, "D": 128, "Dv": None, "block_size": 16, "max_blocks": 128,
             "dtype": torch.bfloat16, "fp8_cache": True, "strided_cache": False},
            {"B": 32, "Hk": 4, "group": 8, "D": 64, "Dv": None, "block_size": 32, "max_blocks": 64,
             "dtype": torch.float16, "fp8_cache": False, "strided_cache": True},
            {"B": 8, "Hk": 32, "group": 1, "D": 128, "Dv": None, "block_size": 16, "max_blocks": 64,
             "dtype": torch.float16, "fp8_cache": False, "strided_cache": False},
            # gpt-oss-120b (TP1): 64/8 heads, D 64, sinks; its sliding layers see 128 tokens.
            {"B": 32, "Hk": 8, "group": 8, "D": 64, "Dv": None, "block_size": 16, "max_blocks": 256,
             "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False, "window_left": 127, "sinks": True},
            # Gemma-2-9B: 16/8 heads, D 256, softcap 50, a 4096-token window.
            {"B": 16, "Hk": 8, "group": 2, "D": 256, "Dv": None, "block_size": 16, "max_blocks": 512,
             "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False, "window_left": 4095,
             "softcap": 50.0},
        ),
    )
)


# -- flash_attn_varlen ------------------------------------------------------------------
def _params_varlen():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(0, 3),
            "max_q": st.integers(0, 24),
            "max_k": st.integers(0, 40),
            "self_attn": st.booleans(),
            "Hk": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 2, 4]),
            "D": st.sampled_from([16, 32, 48]),
            "Dv": st.sampled_from([None, 32]),
            "causal": st.booleans(),
            "dtype": st.sampled_from(DTYPES),
            "mode": st.sampled_from(["off", "on", "auto", "fp8_inputs"]),
            "descale": st.sampled_from(["tensor", "per_seq", "none"]),
            "pad_q": st.integers(0, 3),
            "pad_k": st.integers(0, 2),
            **_variant_params(),
        }
    )


def _lengths(p: Params, key: str, high: int, gen) -> torch.Tensor:
    if key in p:
        return torch.tensor(p[key], dtype=torch.int64).reshape(-1)
    lens = torch.randint(0, high + 1, (p["B"],), generator=gen)
    # Length-0 and length-1 sequences are the interesting ones: make them common.
    pick = torch.randint(0, 4, (p["B"],), generator=gen)
    ones = torch.ones_like(lens).clamp(max=high)
    return torch.where(pick == 0, torch.zeros_like(lens), torch.where(pick == 1, ones, lens))


def _cu(lens: torch.Tensor, device) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).int().to(device)


def varlen_max_k(p: Params) -> int:
    return p["max_q"] if p["self_attn"] else p["max_k"]


def _fp8_input(shape, device, gen, per_seq: bool, batch: int, hk: int, kind: str):
    x = randn(shape, torch.float32, device, gen).to(FP8)
    if kind == "none":
        return x, None
    if per_seq:
        return x, (torch.rand((batch, hk), generator=gen) * 1.5 + 0.5).to(device)
    return x, (torch.rand(1, generator=gen) * 1.5 + 0.5).to(device)


def _make_varlen(p: Params, device, gen):
    b, hk, group, d = p["B"], p["Hk"], p["group"], p["D"]
    dv = p["Dv"] or d
    hq = hk * group
    max_q, max_k = p["max_q"], varlen_max_k(p)
    lens_q = _lengths(p, "lens_q", max_q, gen)
    lens_k = lens_q if p["self_attn"] and "lens_k" not in p else _lengths(p, "lens_k", max_k, gen)
    tq, tk = b * max_q + p["pad_q"], b * max_k + p["pad_k"]
    if p["mode"] == "fp8_inputs":
        per_seq = p["descale"] == "per_seq"
        q, qd = _fp8_input((tq, hq, d), device, gen, per_seq, b, hk, p["descale"])
        k, kd = _fp8_input((tk, hk, d), device, gen, per_seq, b, hk, p["descale"])
        v, vd = _fp8_input((tk, hk, dv), device, gen, per_seq, b, hk, p["descale"])
        mode = "auto"
    else:
        q, k, v = (randn(s, p["dtype"], device, gen) for s in ((tq, hq, d), (tk, hk, d), (tk, hk, dv)))
        qd = kd = vd = None
        mode = p["mode"]
    return (q, k, v, _cu(lens_q, device), _cu(lens_k, device), max_q, max_k, d**-0.5, p["causal"], qd, kd, vd, mode,
            *_variants(p, hq, device, gen))


def varlen_uses_fp8_products(args) -> bool:
    from graphsafe.ops.attention.fp8 import quantize_inputs

    q, mode = args[0], args[12]
    return q.dtype == FP8 or quantize_inputs(mode, q.dtype, q.device)


def _varlen_workspace_args(p: Params, args: Args) -> tuple[tuple, dict]:
    """`flash_attn_varlen_workspace`'s arguments for these inputs: their shapes, and `fp8`
    unless the call keeps bf16/fp16 (fp8 inputs, or "on"/"auto", may take the fp8 path)."""
    q, k, v = args[:3]
    fp8 = q.dtype == FP8 or args[12] != "off"
    return (q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2]), {"fp8": fp8}


def _compare_varlen(expected, actual, exp_args, act_args, params):
    v, vd = exp_args[2], exp_args[11]
    fp8 = varlen_uses_fp8_products(exp_args)
    # Quantised v (fp8 products from bf16/fp16 inputs) rounds up by at most 2^-4.
    vmax = _maxabs(v, vd) * (1 + FP8_UNIT_ROUNDOFF if fp8 else 1)
    attention_compare(expected, actual, vmax, expected.dtype, fp8, v.shape[0], "flash_attn_varlen output")


def _varlen_bounds(args) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' (query, key) row boundaries as the op uses them (CPU int64)."""
    from graphsafe.ops.attention.reference import sequence_bounds

    return sequence_bounds(args[3].cpu(), args[0].shape[0]), sequence_bounds(args[4].cpu(), args[1].shape[0])


def _rows_in(bounds: torch.Tensor, total: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[total] bool: rows inside a sequence (of those sequences where `keep`)."""
    rows = torch.arange(total)
    inside = (rows[:, None] >= bounds[None, :-1]) & (rows[:, None] < bounds[None, 1:])
    if keep is not None:
        inside = inside & keep[None, :]
    return inside.any(dim=1)


def _keys_seen(cq: torch.Tensor, ck: torch.Tensor, total_k: int, window_left: int) -> torch.Tensor:
    """[Tk] bool: key rows some query row of their sequence sees (the sequence has a
    query, and under a window the key is not before the first query row's window)."""
    lens_q, lens_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    rows = torch.arange(total_k)[:, None]
    inside = (rows >= ck[None, :-1]) & (rows < ck[None, 1:]) & (lens_q > 0)[None, :]
    if window_left >= 0:
        inside = inside & (rows - ck[None, :-1] >= (lens_k - lens_q - window_left)[None, :])
    return inside.any(dim=1)


def _unread_varlen(p: Params, args: Args):
    """Query rows outside every sequence; key/value rows outside every sequence or of a
    sequence without queries; per-sequence descales of a sequence without queries. With
    fp8 quantisation every element of q, k, v is read (the per-tensor amax)."""
    from graphsafe.ops.attention.fp8 import quantize_inputs

    q, k, v = args[:3]
    cq, ck = _varlen_bounds(args)
    has_queries = cq[1:] > cq[:-1]
    marks = []
    if not quantize_inputs(args[12], q.dtype, q.device):
        q_rows = ~_rows_in(cq, q.shape[0])
        k_rows = ~_keys_seen(cq, ck, k.shape[0], args[13])
        marks += [(0, q_rows[:, None, None].expand(q.shape)), (1, k_rows[:, None, None].expand(k.shape)),
                  (2, k_rows[:, None, None].expand(v.shape))]
    for index in (9, 10, 11):
        descale = args[index]
        if descale is not None and descale.dim() == 2:
            marks.append((index, (~has_queries)[:, None].expand(descale.shape)))
    return marks


def _out_of_range_varlen(p: Params, args: Args, gen):
    """cu_seqlens past the tensors' ends (Tq + 10**6, Tk + 1), a negative first entry
    (-5) and a decreasing one (-2); padded: the values the op cuts them to (Tq, Tk, 0,
    the previous entry), with max_seqlen_* grown to the padded lengths."""
    cu_q, cu_k = args[3], args[4]
    batch = cu_q.shape[0] - 1
    if batch == 0:
        return None
    tq, tk = args[0].shape[0], args[1].shape[0]
    bad_q, pad_q, bad_k, pad_k = cu_q.clone(), cu_q.clone(), cu_k.clone(), cu_k.clone()
    bad_q[batch], pad_q[batch] = tq + 10**6, tq
    bad_q[0] = -5
    bad_k[batch], pad_k[batch] = tk + 1, tk
    if batch >= 2:
        b = int(torch.randint(1, batch, (1,), generator=gen))
        bad_k[b], pad_k[b] = -2, pad_k[b - 1]
    max_q = max(args[5], int((pad_q[1:] - pad_q[:-1]).max()))
    max_k = max(args[6], int((pad_k[1:] - pad_k[:-1]).max()))
    rest = args[7:]
    return (*args[:3], bad_q, bad_k, max_q, max_k, *rest), (*args[:3], pad_q, pad_k, max_q, max_k, *rest)


def _nonfinite_varlen(p: Params, args: Args, gen):
    """NaN, +inf, -inf (fp8 inputs: NaN, e4m3fn has no inf) in query rows and key rows of
    sequences, and in value rows of keys every query row of their sequence sees (a value
    only some rows of a kernel tile see may reach the others as 0 * NaN: see the op)."""
    q, k, v = (x.clone() for x in args[:3])
    cq, ck = _varlen_bounds(args)
    lens_q, lens_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    has_queries = lens_q > 0
    specials = (float("nan"),) if q.dtype == FP8 else (float("nan"), float("inf"), float("-inf"))
    # Keys every query row of their sequence sees: all, or under causal j <= len_k - len_q,
    # and under a window j >= len_k - 1 - window_left (the last row's window).
    rows = torch.arange(k.shape[0])[:, None]
    inside = (rows >= ck[None, :-1]) & (rows < ck[None, 1:]) & has_queries[None, :]
    if args[8]:
        inside = inside & (rows - ck[None, :-1] <= (lens_k - lens_q)[None, :])
    if args[13] >= 0:
        inside = inside & (rows - ck[None, :-1] >= (lens_k - 1 - args[13])[None, :])
    seen_by_all = inside.any(dim=1)
    choices = ((q, _rows_in(cq, q.shape[0])), (k, _keys_seen(cq, ck, k.shape[0], args[13])), (v, seen_by_all))
    if q.dtype == FP8 and triton_interpreter_enabled():
        # The interpreter casts an fp8 NaN to 480: a NaN descale instead (where given).
        return (*args[:9], *_nan_descale(args[9:12], has_queries, gen), *args[12:])
    for x, rows in choices:
        if not rows.any() or x.numel() == 0:
            continue
        picks = rows.nonzero().flatten()
        for value in specials:
            t = int(picks[int(torch.randint(0, len(picks), (1,), generator=gen))])
            x[t, int(torch.randint(0, x.shape[1], (1,), generator=gen)), int(torch.randint(0, x.shape[2], (1,),
                                                                                                generator=gen))] = value
    return (q, k, v, *args[3:])



def _nan_descale(descales, has_queries: torch.Tensor, gen) -> tuple:
    """The descales with NaN in one entry of the first one given (a sequence with queries
    for a `[B, Hk]` one)."""
    out = list(descales)
    for i, d in enumerate(descales):
        if d is None:
            continue
        d = d.clone()
        if d.dim() == 2:
            seqs = has_queries.nonzero().flatten()
            if not len(seqs):
                return tuple(out)
            b = int(seqs[int(torch.randint(0, len(seqs), (1,), generator=gen))])
            d[b, int(torch.randint(0, d.shape[1], (1,), generator=gen))] = float("nan")
        else:
            d[0] = float("nan")
        out[i] = d
        break
    return tuple(out)


EXAMPLE_VARLEN: Params = {
    "B": 3, "max_q": 20, "max_k": 33, "self_attn": False, "Hk": 2, "group": 2, "D": 32, "Dv": None,
    "causal": True, "dtype": torch.float16, "mode": "off", "descale": "tensor", "pad_q": 2, "pad_k": 1,
    "lens_q": [5, 0, 20], "lens_k": [9, 3, 17], "window_left": -1, "softcap": 0.0, "sinks": False,
}


def _bad_varlen(device, gen):
    args = _make_varlen(EXAMPLE_VARLEN, device, gen)
    q, k, v, cu_q, cu_k, mq, mk, scale, causal = args[:9]
    base = (q, k, v, cu_q, cu_k, mq, mk, scale, causal)
    one = torch.ones(1, device=device)
    return [
        BadInput("q 2-D", (q[0], *base[1:]), "q", "3-D"),
        BadInput("q float32", (q.float(), *base[1:]), "q", "dtype"),
        BadInput("k of other dtype", (q, k.float(), *base[2:]), "k", "same dtype"),
        BadInput("Hq not a multiple of Hk", (q[:, :1], *base[1:]), "k", "divides Hq"),
        BadInput("v of other heads", (q, k, v[:, :1], *base[3:]), "v", r"\[Tk, Hk, Dv\]"),
        BadInput("cu_seqlens_q int64", (q, k, v, cu_q.long(), *base[4:]), "cu_seqlens_q", "dtype"),
        BadInput("cu_seqlens_k of other B", (q, k, v, cu_q, cu_k[1:], *base[5:]), "cu_seqlens_k", r"\[B \+ 1\]"),
        BadInput(
            "cu_seqlens_k strided", (q, k, v, cu_q, torch.stack([cu_k, cu_k], 1)[:, 0], *base[5:]), "cu_seqlens_k",
            "contiguous",
        ),
        BadInput("negative max_seqlen_q", (*base[:5], -1, *base[6:]), "max_seqlen_q", ">= 0"),
        BadInput("unknown fp8 mode", (*base, None, None, None, "maybe"), "fp8", "'auto'"),
        BadInput("descale with half inputs", (*base, one, None, None, "auto"), "q_descale", "float8_e4m3fn"),
        BadInput(
            "descale of a wrong shape",
            (q.to(FP8), k.to(FP8), v.to(FP8), *base[3:], None, torch.ones(2, 2, 2, device=device), None, "auto"),
            "k_descale", r"\[B, Hk\]",
        ),
        *variant_bad_inputs((*base, None, None, None, "off"), torch.zeros(q.shape[1], device=device)),
    ]


def _varlen_descales(params: Params, present: bool) -> Params:
    """`OpCase.options` switch of q/k/v_descale: fp8 inputs with descales, or without."""
    if present:
        descale = params["descale"] if params.get("descale", "none") != "none" else "tensor"
        return {**params, "mode": "fp8_inputs", "descale": descale}
    return {**params, "descale": "none"} if params["mode"] == "fp8_inputs" else params


def _varlen_fp8(params: Params, present: bool) -> Params:
    """`OpCase.options` switch of `fp8`: "off" (bf16/fp16 inputs), or "on" unless the params
    already ask for an fp8 path ("on", "auto", fp8 inputs)."""
    if present:
        return params if params["mode"] != "off" else {**params, "mode": "on"}
    return {**params, "mode": "off"}


VARLEN_OPTIONS = {
    "q_descale": _varlen_descales, "k_descale": _varlen_descales, "v_descale": _varlen_descales,
    "fp8": _varlen_fp8, "window_left": value("window_left", -1, 5), "softcap": value("softcap", 0.0, 4.0),
    "sinks": flag("sinks"),
}

_GPU_VARLEN = {"self_attn": True, "Dv": None, "descale": "tensor", "pad_q": 7, "pad_k": 3, "dtype": torch.bfloat16}
_LLAMA_VARLEN = {**_GPU_VARLEN, "B": 4, "max_q": 1024, "max_k": 1024, "Hk": 8, "group": 4, "D": 128, "causal": True}

register_case(
    OpCase(
        op="flash_attn_varlen",
        params=_params_varlen,
        example=EXAMPLE_VARLEN,
        make=_make_varlen,
        compare=_compare_varlen,
        workspace_args=_varlen_workspace_args,
        options=VARLEN_OPTIONS,
        bad_inputs=_bad_varlen,
        unread=_unread_varlen,
        out_of_range=_out_of_range_varlen,
        nonfinite=_nonfinite_varlen,
        edge_cases=(
            {**EXAMPLE_VARLEN, "B": 0, "lens_q": [], "lens_k": []},
            {**EXAMPLE_VARLEN, "lens_q": [0, 0, 0], "lens_k": [0, 4, 0]},
            {**EXAMPLE_VARLEN, "lens_q": [1, 20, 1], "lens_k": [1, 20, 33], "causal": False},
            {**EXAMPLE_VARLEN, "self_attn": True, "max_q": 20, "lens_q": [20, 7, 1], "lens_k": [20, 7, 1]},
            {**EXAMPLE_VARLEN, "mode": "on"},
            {**EXAMPLE_VARLEN, "mode": "fp8_inputs", "descale": "per_seq"},
            {**EXAMPLE_VARLEN, "B": 2, "Hk": 1, "group": 2, "D": 192, "Dv": 128, "max_q": 9, "max_k": 17,
             "lens_q": [9, 4], "lens_k": [17, 4]},  # MLA prefill head dims
            # Variants: windows narrower and wider than a tile, causal or not, with softcap, sinks, fp8.
            {**EXAMPLE_VARLEN, "window_left": 3, "sinks": True},
            {**EXAMPLE_VARLEN, "window_left": 20, "causal": False, "softcap": 4.0},
            {**EXAMPLE_VARLEN, "window_left": 0, "mode": "on", "sinks": True, "softcap": 0.5},
            {**EXAMPLE_VARLEN, "window_left": 5, "mode": "fp8_inputs", "descale": "per_seq", "sinks": True},
        ),
        gpu_examples=(
            # Llama-3-8B GQA, causal self-attention; "auto" takes the fp8 path on H100/H200.
            {**_LLAMA_VARLEN, "mode": "auto"},
            {**_LLAMA_VARLEN, "mode": "off"},
            # MLA prefill (DeepSeek TP8: 16 heads), D=192 / Dv=128, chunked: keys past queries.
            {**_GPU_VARLEN, "B": 4, "max_q": 512, "max_k": 1024, "self_attn": False, "Hk": 16, "group": 1, "D": 192,
             "Dv": 128, "causal": True, "mode": "off"},
            {**_GPU_VARLEN, "B": 4, "max_q": 512, "max_k": 1024, "self_attn": False, "Hk": 16, "group": 1, "D": 192,
             "Dv": 128, "causal": True, "mode": "on"},
            {**_GPU_VARLEN, "B": 4, "max_q": 512, "max_k": 512, "Hk": 8, "group": 4, "D": 128, "causal": True,
             "mode": "fp8_inputs", "descale": "per_seq"},
            {**_GPU_VARLEN, "B": 8, "max_q": 256, "max_k": 256, "Hk": 16, "group": 1, "D": 64, "causal": False,
             "mode": "off", "dtype": torch.float16},
            # gpt-oss sliding layers (window 128, sinks) and Gemma-2 (softcap 50, window 4096).
            {**_GPU_VARLEN, "B": 4, "max_q": 1024, "max_k": 1024, "Hk": 8, "group": 8, "D": 64, "causal": True,
             "mode": "off", "window_left": 127, "sinks": True},
            {**_GPU_VARLEN, "B": 2, "max_q": 2048, "max_k": 2048, "Hk": 8, "group": 2, "D": 256, "causal": True,
             "mode": "off", "window_left": 1023, "softcap": 50.0},
            {**_LLAMA_VARLEN, "mode": "auto", "window_left": 255, "sinks": True},
        ),
    )
)


# -- paged_attention_prefill ------------------------------------------------------------
def _params_paged_prefill():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(0, 3),
            "max_q": st.integers(0, 20),
            "Hk": st.sampled_from([1, 2]),
            "group": st.sampled_from([1, 2, 4]),
            "D": st.sampled_from([16, 32]),
            "Dv": st.sampled_from([None, 16]),
            "block_size": st.sampled_from([1, 4, 16]),
            "max_blocks": st.integers(1, 5),
            "causal": st.booleans(),
            "dtype": st.sampled_from(DTYPES),
            "fp8_cache": st.booleans(),
            "strided_cache": st.booleans(),
            "pad_q": st.integers(0, 3),
            **_variant_params(),
        }
    )


def _make_paged_prefill(p: Params, device, gen):
    b, hk, group, d, bs, mb = p["B"], p["Hk"], p["group"], p["D"], p["block_size"], p["max_blocks"]
    dv = p["Dv"] or d
    hq = hk * group
    nb = b * mb + 1
    cache_dtype = FP8 if p["fp8_cache"] else p["dtype"]
    lens_q = _lengths(p, "lens_q", p["max_q"], gen)
    if "seq_lens" in p:
        lens_k = torch.tensor(p["seq_lens"], dtype=torch.int64)
    else:
        # Mostly a cached prefix plus the new tokens; sometimes fewer keys than queries.
        lens_k = (lens_q + torch.randint(0, mb * bs + 1, (b,), generator=gen)).clamp(max=mb * bs)
    tq = b * p["max_q"] + p["pad_q"]
    q = randn((tq, hq, d), p["dtype"], device, gen)
    k_cache = _decode_cache((nb, bs, hk, d), cache_dtype, device, gen, p["strided_cache"])
    v_cache = _decode_cache((nb, bs, hk, dv), cache_dtype, device, gen, p["strided_cache"])
    table = torch.randperm(nb, generator=gen)[: b * mb].reshape(b, mb)
    unused = torch.arange(mb)[None, :] >= (lens_k[:, None] + bs - 1) // bs
    table = torch.where(unused, torch.randint(-4, 4 * nb, (b, mb), generator=gen), table)
    if p["fp8_cache"]:
        k_scale = (torch.rand(1, generator=gen) * 0.5 + 0.5).to(device)
        v_scale = (torch.rand(1, generator=gen) * 0.5 + 0.5).to(device)
    else:
        k_scale = v_scale = None
    return (q, k_cache, v_cache, table.int().to(device), lens_k.int().to(device), _cu(lens_q, device), p["max_q"],
            d**-0.5, p["causal"], k_scale, v_scale, *_variants(p, hq, device, gen))


def _compare_paged_prefill(expected, actual, exp_args, act_args, params):
    attention_compare(expected, actual, _maxabs(exp_args[2], exp_args[10]), exp_args[0].dtype, False, 0,
                      "paged_attention_prefill output")


def _prefill_lengths(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query bounds as the op uses them, query lengths, clamped key lengths), CPU int64."""
    from graphsafe.ops.attention.reference import sequence_bounds

    k_cache, table = args[1], args[3]
    cq = sequence_bounds(args[5].cpu(), args[0].shape[0])
    lens_k = args[4].cpu().long().clamp(0, table.shape[1] * k_cache.shape[1])
    return cq, cq[1:] - cq[:-1], lens_k


def _prefill_reads(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-table entries read, cache tokens read): a sequence with queries reads its
    tokens below seq_lens from its first query row's window on."""
    _, lens_q, lens_k = _prefill_lengths(args)
    window = args[11]
    first = lens_k - lens_q - window if window >= 0 else torch.zeros_like(lens_k)
    return paged_reads(args[1], args[3].cpu().long(), torch.where(lens_q > 0, lens_k, 0), first)


def _unread_paged_prefill(p: Params, args: Args):
    entry_read, token_read = _prefill_reads(args)
    cq, _, _ = _prefill_lengths(args)
    q, k_cache, v_cache = args[:3]
    return [
        (0, (~_rows_in(cq, q.shape[0]))[:, None, None].expand(q.shape)),
        (1, (~token_read)[:, :, None, None].expand(k_cache.shape)),
        (2, (~token_read)[:, :, None, None].expand(v_cache.shape)),
        (3, ~entry_read),
    ]


def _out_of_range_paged_prefill(p: Params, args: Args, gen):
    """Read block-table entries -> 10**6, -5, -2, num_blocks (padded: -1); a zero
    `seq_lens` -> -5 (padded: 0); cu_seqlens_q[B] -> Tq + 10**6 (padded: Tq)."""
    table, lens, cu_q = args[3], args[4], args[5]
    batch = cu_q.shape[0] - 1
    if batch == 0:
        return None
    entry_read, _ = _prefill_reads(args)
    bad_table, pad_table = table.clone(), table.clone()
    spots = entry_read.nonzero()
    if len(spots):
        spots = spots[torch.randperm(len(spots), generator=gen)[:4]]
        values = torch.tensor([10**6, -5, -2, args[1].shape[0]], dtype=torch.int32)[: len(spots)]
        bad_table[spots[:, 0], spots[:, 1]] = values.to(table.device)
        pad_table[spots[:, 0], spots[:, 1]] = -1
    bad_lens, pad_lens = lens.clone(), lens.clone()
    empty = (lens.cpu() == 0).nonzero().flatten()
    if len(empty):
        bad_lens[int(empty[0])] = -5
    bad_cu, pad_cu = cu_q.clone(), cu_q.clone()
    bad_cu[batch], pad_cu[batch] = args[0].shape[0] + 10**6, args[0].shape[0]
    max_q = max(args[6], int((pad_cu[1:] - pad_cu[:-1]).max()))
    rest = args[7:]
    return ((*args[:3], bad_table, bad_lens, bad_cu, max_q, *rest),
            (*args[:3], pad_table, pad_lens, pad_cu, max_q, *rest))


def _nonfinite_paged_prefill(p: Params, args: Args, gen):
    """NaN, +inf, -inf in query rows of sequences, in keys of tokens read, and in values
    of tokens every query row of their sequence sees (fp8 caches: NaN only)."""
    from graphsafe.testing.contract import clone_tensor

    q, k_cache, v_cache = (clone_tensor(x) for x in args[:3])
    cq, lens_q, lens_k = _prefill_lengths(args)
    _, token_read = _prefill_reads(args)
    table, bs = args[3].cpu().long(), k_cache.shape[1]
    specials = (float("nan"), float("inf"), float("-inf"))
    rows = _rows_in(cq, q.shape[0]).nonzero().flatten()
    for value in specials[: min(2, len(rows))]:
        t = int(rows[int(torch.randint(0, len(rows), (1,), generator=gen))])
        q[t, int(torch.randint(0, q.shape[1], (1,), generator=gen)), int(torch.randint(0, q.shape[2], (1,),
                                                                                         generator=gen))] = value
    # Tokens every row sees: from the last row's window start to the first row's diagonal.
    pos = torch.arange(table.shape[1] * bs)[None, :]
    seen = (pos < lens_k[:, None]) & (lens_q > 0)[:, None]
    if args[8]:
        seen = seen & (pos <= (lens_k - lens_q)[:, None])
    if args[11] >= 0:
        seen = seen & (pos >= (lens_k - 1 - args[11])[:, None])
    seen = seen & ((table >= 0) & (table < k_cache.shape[0])).repeat_interleave(bs, dim=1)
    slots = table.clamp(0, k_cache.shape[0] - 1).repeat_interleave(bs, dim=1) * bs + pos % bs
    for cache, chosen, values in ((k_cache, token_read.reshape(-1).nonzero().flatten(), specials[:1]),
                                  (v_cache, slots[seen].unique(), specials)):
        for value in values:
            if not len(chosen):
                break
            slot = int(chosen[int(torch.randint(0, len(chosen), (1,), generator=gen))])
            head = int(torch.randint(0, cache.shape[2], (1,), generator=gen))
            col = int(torch.randint(0, cache.shape[3], (1,), generator=gen))
            if cache.dtype != FP8:
                cache[slot // bs, slot % bs, head, col] = value
            elif not triton_interpreter_enabled():  # (its fp8 -> half cast turns NaN into 480)
                cache[slot // bs, slot % bs, head, col] = float("nan")
    return (q, k_cache, v_cache, *args[3:])


EXAMPLE_PAGED_PREFILL: Params = {
    "B": 3, "max_q": 12, "Hk": 2, "group": 2, "D": 32, "Dv": None, "block_size": 4, "max_blocks": 6,
    "causal": True, "dtype": torch.float16, "fp8_cache": False, "strided_cache": False, "pad_q": 2,
    "lens_q": [5, 0, 12], "seq_lens": [9, 3, 21], "window_left": -1, "softcap": 0.0, "sinks": False,
}


def _bad_paged_prefill(device, gen):
    args = _make_paged_prefill(EXAMPLE_PAGED_PREFILL, device, gen)
    q, kc, vc, table, lens, cu_q, max_q, scale, causal = args[:9]
    base = (q, kc, vc, table, lens, cu_q, max_q, scale, causal)
    return [
        BadInput("q float32", (q.float(), *base[1:]), "q", "dtype"),
        BadInput("k_cache with other head dim", (q, kc[..., 1:], *base[2:]), "k_cache", r"D\]"),
        BadInput("Hq not a multiple of Hk", (q[:, :3], *base[1:]), "k_cache", "divides Hq"),
        BadInput("block_table of other B", (q, kc, vc, table[1:], *base[4:]), "block_table", r"\[B, max_blocks"),
        BadInput("seq_lens int64", (q, kc, vc, table, lens.long(), *base[5:]), "seq_lens", "dtype"),
        BadInput("cu_seqlens_q strided", (*base[:5], torch.stack([cu_q, cu_q], 1)[:, 0], *base[6:]), "cu_seqlens_q",
                 "contiguous"),
        BadInput("negative max_seqlen_q", (*base[:6], -1, *base[7:]), "max_seqlen_q", ">= 0"),
        BadInput("fp8 caches without k_scale", (q, kc.to(FP8), vc.to(FP8), *base[3:]), "k_scale", "float32"),
        *variant_bad_inputs((*base, None, None), torch.zeros(q.shape[1], device=device)),
    ]


_GPU_PAGED = {"Dv": None, "block_size": 16, "pad_q": 5, "dtype": torch.bfloat16, "fp8_cache": False,
              "strided_cache": False, "causal": True}

register_case(
    OpCase(
        op="paged_attention_prefill",
        params=_params_paged_prefill,
        example=EXAMPLE_PAGED_PREFILL,
        make=_make_paged_prefill,
        compare=_compare_paged_prefill,
        bad_inputs=_bad_paged_prefill,
        unread=_unread_paged_prefill,
        out_of_range=_out_of_range_paged_prefill,
        nonfinite=_nonfinite_paged_prefill,
        edge_cases=(
            {**EXAMPLE_PAGED_PREFILL, "B": 0, "lens_q": [], "seq_lens": []},
            {**EXAMPLE_PAGED_PREFILL, "lens_q": [0, 0, 0], "seq_lens": [0, 4, 0]},
            {**EXAMPLE_PAGED_PREFILL, "lens_q": [1, 1, 1], "seq_lens": [1, 7, 24]},  # decode steps
            {**EXAMPLE_PAGED_PREFILL, "lens_q": [5, 3, 12], "seq_lens": [2, 3, 24], "causal": False},
            {**EXAMPLE_PAGED_PREFILL, "block_size": 1, "max_blocks": 24, "fp8_cache": True, "Dv": 16,
             "strided_cache": True},
            {**EXAMPLE_PAGED_PREFILL, "window_left": 3, "sinks": True, "softcap": 4.0},
            {**EXAMPLE_PAGED_PREFILL, "window_left": 0, "causal": False, "block_size": 16, "max_blocks": 2},
            # One block of one token: max_len == 1 (Triton 3.6's ptxas crashed on it specialised).
            {**EXAMPLE_PAGED_PREFILL, "B": 1, "max_q": 1, "block_size": 1, "max_blocks": 1, "causal": False,
             "pad_q": 1, "lens_q": [1], "seq_lens": [1]},
        ),
        gpu_examples=(
            # Llama-3-8B chunked prefill: 512-token chunks after cached prefixes, up to 4096.
            {**_GPU_PAGED, "B": 4, "max_q": 512, "Hk": 8, "group": 4, "D": 128, "max_blocks": 256},
            # A mixed batch: decodes and short chunks over long contexts, fp8 cache.
            {**_GPU_PAGED, "B": 16, "max_q": 64, "Hk": 8, "group": 4, "D": 128, "max_blocks": 512, "fp8_cache": True},
            # gpt-oss sliding layers (sinks, window 128) and Gemma-2 (softcap 50, window 4096).
            {**_GPU_PAGED, "B": 4, "max_q": 256, "Hk": 8, "group": 8, "D": 64, "max_blocks": 128,
             "window_left": 127, "sinks": True},
            {**_GPU_PAGED, "B": 2, "max_q": 512, "Hk": 8, "group": 2, "D": 256, "max_blocks": 384,
             "window_left": 4095, "softcap": 50.0, "strided_cache": True},
        ),
    )
)
