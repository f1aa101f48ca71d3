"""Test cases of `mla_decode` and `sparse_mla`.

Inputs are random everywhere a kernel must not look: block-table entries past a
request's length hold garbage block ids (huge, negative), caches are random. The ids an
op reads are valid or the padding value -1 (padding blocks inside a request's length,
`-1` among the sparse slots, which also repeat); ids out of range in every other way
(huge, negative, one past the end) come from `out_of_range`, paired with -1 at their places.

Parameter sets with `"cache": FP8_DS` hold an fp8_ds_mla cache (uint8 records written by
`quantize_records`, bf16 q); the others a cache of q's dtype.
"""

from __future__ import annotations

import torch

from graphsafe.formats.fp8_ds_mla import TILE, dequantize_records, quantize_records, record_bytes
from graphsafe.testing.cases import BadInput, OpCase, Params, assert_out_lse_close, flag, register_case
from graphsafe.testing.tensors import randn

# Ids out of range that `out_of_range` mixes in: huge, negative (never wrapping around),
# and exactly one past the end (`END`, replaced by num_blocks or num_slots).
END = "end"
BAD_IDS = (10**6, -5, -2, END)

DTYPES = (torch.bfloat16, torch.float16)
# (rtol, atol) of `out`: the kernels round the softmax probabilities to the input dtype
# before `p @ V` (as every tensor-core kernel does) and accumulate in another order, so
# allow about two units in the last place of the output dtype.
OUT_TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
LSE_TOLERANCE = (1e-4, 1e-4)  # f32 LSE from the same f32-accumulated scores
# (rtol, atol) of `lse` over an fp8_ds_mla cache. The reference scores the float32 rows
# `dequantize_records` gives; the kernels round them to bf16 for their dots (2^-9
# relative, to nearest even), so a score moves by at most sm_scale * 2^-9 * sum_c
# |q_c k_c| (up to about 0.023 for the rows and queries of these cases: randn, tiles
# scaled by up to 2, D <= 288) and the lse, a smooth max of the scores, by no more.
# Measured: at most 1.23e-2 (300 draws of 4 x 16 heads, R = 128 and 256, P = 16 and 32,
# the reference over bf16-rounded rows) and 6.7e-3 (80 contract draws on the Triton
# kernel). `out`: the score moves above change each softmax weight by a factor of at most
# exp(2 * 0.023), about 4.7%, which moves `out` by that share of the spread of the values
# (unit-variance values here): up to ~0.05 where a few keys split the weight. Measured: a
# contract draw of 2 keys moved an `out` of 0.115 by 0.0229 (over the bf16 tolerance of
# 0.022 there); 600 draws of the Triton kernel at 1 to 16 heads and 2 to 96 keys left at
# most 0.0191 beyond 2% of |out|. So the fp8_ds_mla cache adds FP8_DS_OUT_ATOL.
FP8_DS_LSE_TOLERANCE = (0.0, 3e-2)
FP8_DS_OUT_ATOL = 5e-2
FP8_DS = "fp8_ds_mla"


def fp8_ds(p: Params) -> bool:
    """Whether parameter set `p` holds an fp8_ds_mla cache."""
    return p.get("cache", "float") == FP8_DS


def compare_attention(expected, actual, expected_args, actual_args, params: Params) -> None:
    """out within a couple of ulps of its dtype (plus FP8_DS_OUT_ATOL over an fp8_ds_mla
    cache), lse within 1e-4 (3e-2 over an fp8_ds_mla cache; the cache kind told by the args
    or the params); -inf rows must match exactly."""
    quantized = (expected_args is not None and expected_args[1].dtype == torch.uint8) or (
        params is not None and fp8_ds(params))
    rtol, atol = OUT_TOLERANCES[expected[0].dtype]
    if quantized:
        atol += FP8_DS_OUT_ATOL
    assert_out_lse_close(expected, actual, (rtol, atol), FP8_DS_LSE_TOLERANCE if quantized else LSE_TOLERANCE)


def _q(shape, dtype, device, gen, strided: bool) -> torch.Tensor:
    """Query rows; `strided` makes them a view with gaps between heads and rows."""
    rows, heads, d = shape
    # Empty strided views trip torch's opcheck input cloning (negative storage size).
    if not strided or rows * heads == 0:
        return randn(shape, dtype, device, gen)
    return randn((rows, heads + 1, d + 8), dtype, device, gen)[:, :heads, :d]


def _cache(nb: int, bs: int, d: int, dtype, device, gen, strided: bool) -> torch.Tensor:
    if not strided:
        return randn((nb, bs, d), dtype, device, gen)
    return randn((nb, bs + 1, d + 16), dtype, device, gen)[:, :bs, :d]


def _fp8_ds_cache(nb: int, bs: int, r: int, pe: int, device, gen, strided: bool) -> torch.Tensor:
    """An fp8_ds_mla cache of random tokens: randn latents, each 128-value tile times a
    factor in [1/2, 2] (so the tiles of a record have clearly different scales), randn
    rope values. `strided`: a view with random bytes between tokens and blocks (a 16-byte
    gap keeps the records 4-byte aligned)."""
    kv_c = torch.randn((nb * bs, r // TILE, TILE), generator=gen)
    kv_c = (kv_c * 2.0 ** (2 * torch.rand((nb * bs, r // TILE, 1), generator=gen) - 1)).reshape(nb * bs, r)
    records = quantize_records(kv_c, torch.randn((nb * bs, pe), generator=gen)).view(nb, bs, -1)
    if not strided:
        return records.to(device)
    size = records.shape[2]
    base = torch.randint(0, 256, (nb, bs + 1, size + 16), generator=gen, dtype=torch.uint8).to(device)
    view = base[:, :bs, :size]
    view.copy_(records)
    return view


def _kv_cache(p: Params, nb: int, device, gen) -> torch.Tensor:
    bs, r, pe = p["block_size"], p["R"], p["P"]
    if fp8_ds(p):
        return _fp8_ds_cache(nb, bs, r, pe, device, gen, p["strided"])
    return _cache(nb, bs, r + pe, p["dtype"], device, gen, p["strided"])


def sm_scale_of(p: Params) -> float:
    return (p["R"] + p["P"]) ** -0.5


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (gaps of strided views included)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _bad_ids(pick: torch.Tensor, end: int, gen) -> torch.Tensor:
    """A tensor of pick's shape holding a mix of BAD_IDS (END = `end`)."""
    values = torch.tensor([end if v == END else v for v in BAD_IDS], dtype=torch.int64)
    return values[torch.randint(0, len(BAD_IDS), pick.shape, generator=gen)]


def _pick(read: torch.Tensor, gen, fraction: float = 0.3) -> torch.Tensor:
    """About `fraction` of the True places of `read` (at least one), on the CPU."""
    read = read.cpu()
    pick = read & (torch.rand(read.shape, generator=gen) < fraction)
    if not pick.any():
        pick.view(-1)[int(read.reshape(-1).nonzero()[0, 0])] = True
    return pick


def _out_of_range_ids(ids: torch.Tensor, read: torch.Tensor, end: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with bad ids at some read places, ids with -1 at exactly those places)."""
    pick = _pick(read, gen)
    host = ids.cpu().long()
    bad = torch.where(pick, _bad_ids(pick, end, gen), host)
    padded = torch.where(pick, -1, host)
    return bad.to(ids.dtype).to(ids.device), padded.to(ids.dtype).to(ids.device)


def _nonfinite(q, kv, q_read, kv_rows_read, gen, kv_lora_rank: int):
    """Copies of q and kv with NaN in one element of a read q row and, in read cache rows,
    +inf, -inf and (in about half of the draws) NaN at random columns. q_read: bool [rows, H];
    kv_rows_read: bool [num_blocks, block_size]. An fp8_ds_mla cache gets them in its
    tokens' float values (`_set_fp8_ds_value`)."""
    q, kv = _copy(q), _copy(kv)
    heads = q_read.reshape(-1).nonzero()[:, 0].cpu()
    if heads.numel():
        i = int(heads[torch.randint(0, heads.numel(), (1,), generator=gen)])
        col = int(torch.randint(0, q.shape[2], (1,), generator=gen))
        q[i // q.shape[1], i % q.shape[1], col] = float("nan")
    rows = kv_rows_read.reshape(-1).nonzero()[:, 0].cpu()
    values = [float("inf"), float("-inf")] + ([float("nan")] if bool(torch.rand(1, generator=gen) < 0.5) else [])
    bs = kv.shape[1]
    for v in values:
        if rows.numel() == 0:
            break
        row = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
        col = int(torch.randint(0, q.shape[2], (1,), generator=gen))
        if kv.dtype == torch.uint8:
            _set_fp8_ds_value(kv[row // bs, row % bs], col, v, kv_lora_rank)
        else:
            kv[row // bs, row % bs, col] = v
    return q, kv


def _set_fp8_ds_value(record: torch.Tensor, col: int, value: float, r: int) -> None:
    """Write `value` at column `col` of the token whose fp8_ds_mla record is `record`
    (uint8 [record], in place). A latent column (col < R): the token's row is read back
    (`dequantize_records`), the value put in and the latent quantized again
    (`quantize_records`), so its tile reads back all NaN (see graphsafe.formats.fp8_ds_mla):
    its score is NaN for every head, and out and lse are NaN for every head of every
    query reading it. A rope column: its bf16 bytes, so the score is +-inf or NaN as for
    a float cache (an inf times q's entry)."""
    row = dequantize_records(record[None], r)[0]
    if col < r:
        latent = row[:r].clone()
        latent[col] = value
        record.copy_(quantize_records(latent[None], row[r:][None])[0].to(record.device))
    else:
        at = r + 4 * (r // TILE) + 2 * (col - r)
        record[at : at + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).to(record.device)


# -- mla_decode ---------------------------------------------------------------------------
def _with_fp8_ds_sets(st, fields: dict, fp8_only: bool = False):
    """Parameter sets of a cache of q's dtype (`fields`) or, one draw in four, of an
    fp8_ds_mla cache: R = 128 (one scale per token) or 256, P = 16 or 32, bf16 q (what
    the interpreter runs in reasonable time). `fp8_only`: the fp8_ds_mla sets alone."""
    fp8 = {**fields, "R": st.sampled_from([128, 128, 256]), "P": st.sampled_from([16, 32]),
           "dtype": st.just(torch.bfloat16), "cache": st.just(FP8_DS)}
    if fp8_only:
        return st.fixed_dictionaries(fp8)
    return st.one_of(st.fixed_dictionaries(fields), st.fixed_dictionaries(fields),
                     st.fixed_dictionaries(fields), st.fixed_dictionaries(fp8))


def _params_decode(fp8_only: bool = False):
    from hypothesis import strategies as st

    return _with_fp8_ds_sets(st, fp8_only=fp8_only, fields={
        "B": st.integers(0, 4),
        "H": st.sampled_from([1, 2, 3, 4, 16]),
        "R": st.sampled_from([16, 24, 32]),
        "P": st.sampled_from([0, 8, 16]),
        "block_size": st.sampled_from([1, 4, 16]),
        "max_blocks": st.integers(0, 6),
        "dtype": st.sampled_from(DTYPES),
        "lens": st.sampled_from(["random", "random", "full", "empty"]),
        "padding": st.sampled_from([0.0, 0.0, 0.25]),
        "strided": st.booleans(),
    })


def make_seq_lens(p: Params, gen) -> torch.Tensor:
    capacity = p["max_blocks"] * p["block_size"]
    if p["lens"] == "full":
        return torch.full((p["B"],), capacity, dtype=torch.int32)
    if p["lens"] == "empty":
        return torch.zeros((p["B"],), dtype=torch.int32)
    return torch.randint(0, capacity + 1, (p["B"],), generator=gen, dtype=torch.int32)


def make_block_table(p: Params, seq_lens: torch.Tensor, num_blocks: int, gen, padding: float = 0.0) -> torch.Tensor:
    """Distinct random blocks per request, about `padding` of the entries below a request's
    length -1 (padding blocks); entries past a request's length are garbage."""
    b, mb, bs = p["B"], p["max_blocks"], p["block_size"]
    table = torch.randperm(num_blocks, generator=gen)[: b * mb].view(b, mb).to(torch.int32)
    table = torch.where(torch.rand((b, mb), generator=gen) < padding, -1, table)
    used = torch.arange(mb)[None, :] * bs < seq_lens[:, None]
    garbage = torch.randint(-(2**31), 2**31 - 1, (b, mb), generator=gen, dtype=torch.int64).to(torch.int32)
    return torch.where(used, table, garbage)


def decode_reads(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """What `mla_decode` reads: (block-table entries below each request's length [B,
    max_blocks], positions holding a key [B, L], cache rows holding a key of some
    request [num_blocks, block_size]); all on the CPU."""
    nb, bs = kv_cache.shape[:2]
    table, lens = block_table.cpu().long(), seq_lens.cpu().long()
    entries = torch.arange(table.shape[1])[None, :] * bs < lens[:, None]
    pos = torch.arange(table.shape[1] * bs)
    blocks = table[:, pos // bs]
    keys = (pos[None, :] < lens[:, None]) & (blocks >= 0) & (blocks < nb)
    rows = torch.zeros((nb, bs), dtype=torch.bool)
    rows[blocks[keys], (pos % bs).expand_as(keys)[keys]] = True
    return entries, keys, rows


def _make_decode(p: Params, device, gen):
    b, h, r, pe, bs, mb = p["B"], p["H"], p["R"], p["P"], p["block_size"], p["max_blocks"]
    d = r + pe
    num_blocks = b * mb + 3
    q = _q((b, h, d), p["dtype"], device, gen, p["strided"])
    kv_cache = _kv_cache(p, num_blocks, device, gen)
    seq_lens = make_seq_lens(p, gen)
    block_table = make_block_table(p, seq_lens, num_blocks, gen, padding=p.get("padding", 0.0))
    return q, kv_cache, block_table.to(device), seq_lens.to(device), sm_scale_of(p), r


def _unread_decode(p: Params, args):
    """Cache rows no request's key names, block-table entries past each length, and the
    q rows of requests without any key (their output is 0, -inf whatever q holds)."""
    q, kv_cache, block_table, seq_lens = args[:4]
    entries, keys, rows = decode_reads(kv_cache, block_table, seq_lens)
    q_unread = ~keys.any(dim=1)[:, None, None].expand(q.shape)
    return [(0, q_unread), (1, ~rows[..., None].expand(kv_cache.shape)), (2, ~entries)]


def _out_of_range_decode(p: Params, args, gen):
    """Bad block ids at some entries below a request's length (a request gets length 1
    where none has a read entry), and -1 there."""
    q, kv_cache, block_table, seq_lens, scale, r = args
    if block_table.numel() == 0:
        return None
    entries, _, _ = decode_reads(kv_cache, block_table, seq_lens)
    if not entries.any():
        seq_lens = seq_lens.clone()
        seq_lens[0] = 1
        entries[0, 0] = True
    bad, padded = _out_of_range_ids(block_table, entries, kv_cache.shape[0], gen)
    return (q, kv_cache, bad, seq_lens, scale, r), (q, kv_cache, padded, seq_lens, scale, r)


def _nonfinite_decode(p: Params, args, gen):
    q, kv_cache, block_table, seq_lens, scale, r = args
    _, keys, rows = decode_reads(kv_cache, block_table, seq_lens)
    q_read = keys.any(dim=1)[:, None].expand(q.shape[:2])
    q, kv_cache = _nonfinite(q, kv_cache, q_read, rows, gen, r)
    return q, kv_cache, block_table, seq_lens, scale, r


EXAMPLE_DECODE: Params = {
    "B": 3, "H": 4, "R": 32, "P": 16, "block_size": 4, "max_blocks": 5,
    "dtype": torch.float16, "lens": "random", "padding": 0.25, "strided": False,
}
DEEPSEEK = {"R": 512, "P": 64}
# The shapes aiter's MLA kernels serve (bf16, head dim 576, 16 heads), small: the draws
# and edge cases never reach them (OpCase.adapter_examples).
AITER_DECODE: Params = {**DEEPSEEK, "B": 3, "H": 16, "block_size": 4, "max_blocks": 5, "dtype": torch.bfloat16,
                        "lens": "random", "padding": 0.25, "strided": False}
AITER_SPARSE: Params = {**DEEPSEEK, "T": 3, "H": 16, "block_size": 4, "num_blocks": 6, "K": 40,
                        "dtype": torch.bfloat16, "invalid": 0.25, "strided": False, "attn_sink": False,
                        "topk_length": False}
EXAMPLE_DECODE_FP8_DS: Params = {**EXAMPLE_DECODE, "R": 128, "P": 16, "dtype": torch.bfloat16, "cache": FP8_DS}


def _bad_fp8_ds(q, kv, rest: tuple, r: int, gen) -> list[BadInput]:
    """What an fp8_ds_mla cache (q, kv: R = r, P = 16) must refuse; `rest` are the other
    args between the cache and sm_scale, kv_lora_rank."""
    scale = (q.shape[2]) ** -0.5
    odd_q = randn((*q.shape[:2], q.shape[2] + 1), torch.bfloat16, q.device, gen)
    odd_kv = torch.zeros((*kv.shape[:2], record_bytes(r, 17) + 1), dtype=torch.uint8, device=kv.device)
    wide_q = randn((*q.shape[:2], 64 + 80), torch.bfloat16, q.device, gen)
    wide_kv = torch.zeros((*kv.shape[:2], record_bytes(128, 16)), dtype=torch.uint8, device=kv.device)
    shifted = torch.zeros((*kv.shape[:2], kv.shape[2] + 2), dtype=torch.uint8, device=kv.device)[..., 2:]
    return [
        BadInput("fp8_ds_mla cache, q float16", (q.half(), kv, *rest, scale, r), "q",
                 "bfloat16 when 'kv_cache' is uint8"),
        BadInput("fp8_ds_mla cache, record of other size", (q, kv[..., 4:], *rest, scale, r), "kv_cache",
                 "fp8_ds_mla record"),
        BadInput("fp8_ds_mla cache, R not a multiple of 128", (wide_q, wide_kv, *rest, scale, 64), "kv_lora_rank",
                 "a multiple of 128"),
        BadInput("fp8_ds_mla cache, odd P", (odd_q, odd_kv, *rest, scale, r), "q", "P .*even"),
        BadInput("fp8_ds_mla cache, records 2-byte aligned", (q, shifted, *rest, scale, r), "kv_cache",
                 "4-byte aligned"),
    ]


def _bad_decode(device, gen):
    q, kv, bt, lens, scale, r = _make_decode(EXAMPLE_DECODE, device, gen)
    q8, kv8, bt8, lens8, _, r8 = _make_decode(EXAMPLE_DECODE_FP8_DS, device, gen)
    return [
        BadInput("q of dtype float32", (q.float(), kv, bt, lens, scale, r), "q", "dtype"),
        BadInput("q 2-D", (q[0], kv, bt, lens, scale, r), "q", "3-D"),
        BadInput("q strided last dim", (q.transpose(1, 2).contiguous().transpose(1, 2), kv, bt, lens, scale, r), "q", "contiguous"),
        BadInput("kv_cache of other dtype", (q, kv.to(torch.bfloat16), bt, lens, scale, r), "kv_cache", "same dtype"),
        BadInput("kv_cache last dim != R+P", (q, kv[..., 1:], bt, lens, scale, r), "kv_cache", r"R \+ P"),
        BadInput("block_table int64", (q, kv, bt.long(), lens, scale, r), "block_table", "dtype"),
        BadInput("block_table of other B", (q, kv, bt[1:], lens, scale, r), "block_table", r"\[B, max_blocks\]"),
        BadInput("seq_lens of other B", (q, kv, bt, lens[1:], scale, r), "seq_lens", r"\[B\]"),
        BadInput("seq_lens int64", (q, kv, bt, lens.long(), scale, r), "seq_lens", "dtype"),
        BadInput("kv_lora_rank 0", (q, kv, bt, lens, scale, 0), "kv_lora_rank", r"\[1, R \+ P\]"),
        BadInput("kv_lora_rank > R+P", (q, kv, bt, lens, scale, q.shape[2] + 1), "kv_lora_rank", r"\[1, R \+ P\]"),
        BadInput("kv_cache uint8 with q float16", (q, kv.view(torch.uint8), bt, lens, scale, r), "q", "bfloat16"),
        *_bad_fp8_ds(q8, kv8, (bt8, lens8), r8, gen),
    ]


def _workspace_decode(params: Params, args) -> tuple[tuple, dict]:
    """`mla_decode_workspace_specs(B, H, R, max_blocks * block_size, head_dim=, dtype=)`."""
    q, kv, block_table, _, _, r = args
    return (q.shape[0], q.shape[1], r, block_table.shape[1] * kv.shape[1]), {"head_dim": q.shape[2], "dtype": q.dtype}


def _workspace_sparse(params: Params, args) -> tuple[tuple, dict]:
    """`sparse_mla_workspace_specs(T, H, R, K, head_dim=, dtype=)`."""
    q, _, indices, _, r = args[:5]
    return (q.shape[0], q.shape[1], r, indices.shape[1]), {"head_dim": q.shape[2], "dtype": q.dtype}


register_case(
    OpCase(
        op="mla_decode",
        params=_params_decode,
        example=EXAMPLE_DECODE,
        make=_make_decode,
        compare=compare_attention,
        workspace_args=_workspace_decode,
        adapter_examples=(AITER_DECODE,),
        bad_inputs=_bad_decode,
        unread=_unread_decode,
        out_of_range=_out_of_range_decode,
        nonfinite=_nonfinite_decode,
        edge_cases=(
            {**EXAMPLE_DECODE, "B": 0},
            {**EXAMPLE_DECODE, "max_blocks": 0},
            {**EXAMPLE_DECODE, "lens": "empty"},
            {**EXAMPLE_DECODE, "lens": "full", "padding": 1.0},
            {**EXAMPLE_DECODE, "lens": "full", "dtype": torch.bfloat16, "strided": True},
            {**EXAMPLE_DECODE, "P": 0, "H": 1, "block_size": 1, "max_blocks": 40},
            {**EXAMPLE_DECODE, "B": 2, "H": 16, "block_size": 16, "max_blocks": 6, "lens": "full"},
            {**EXAMPLE_DECODE, "R": 24, "P": 12, "H": 17, "max_blocks": 9},
            EXAMPLE_DECODE_FP8_DS,
            {**EXAMPLE_DECODE_FP8_DS, "P": 32, "H": 16, "block_size": 16, "max_blocks": 3, "lens": "full",
             "strided": True},
            {**EXAMPLE_DECODE_FP8_DS, "R": 256, "B": 2, "H": 3, "block_size": 1, "max_blocks": 20, "strided": True},
        ),
        gpu_examples=(
            {**DEEPSEEK, "B": 64, "H": 16, "block_size": 64, "max_blocks": 64, "dtype": torch.bfloat16, "lens": "random", "strided": False},
            {**DEEPSEEK, "B": 8, "H": 128, "block_size": 64, "max_blocks": 128, "dtype": torch.bfloat16, "lens": "random",
             "padding": 0.25, "strided": False},
            {**DEEPSEEK, "B": 5, "H": 16, "block_size": 16, "max_blocks": 300, "dtype": torch.float16, "lens": "random", "strided": True},
            {**DEEPSEEK, "B": 3, "H": 128, "block_size": 64, "max_blocks": 16, "dtype": torch.bfloat16, "lens": "empty", "strided": False},
            {**DEEPSEEK, "B": 64, "H": 16, "block_size": 64, "max_blocks": 64, "dtype": torch.bfloat16,
             "lens": "random", "padding": 0.25, "strided": False, "cache": FP8_DS},
            {**DEEPSEEK, "B": 8, "H": 128, "block_size": 64, "max_blocks": 128, "dtype": torch.bfloat16,
             "lens": "random", "strided": True, "cache": FP8_DS},
        ),
    )
)


# -- sparse_mla ---------------------------------------------------------------------------
def _params_sparse(fp8_only: bool = False):
    from hypothesis import strategies as st

    return _with_fp8_ds_sets(st, fp8_only=fp8_only, fields={
        "T": st.integers(0, 4),
        "H": st.sampled_from([1, 2, 3, 4, 16]),
        "R": st.sampled_from([16, 24, 32]),
        "P": st.sampled_from([0, 8, 16]),
        "block_size": st.sampled_from([1, 4, 16]),
        "num_blocks": st.integers(1, 6),
        "K": st.integers(0, 70),
        "dtype": st.sampled_from(DTYPES),
        "invalid": st.sampled_from([0.0, 0.25, 0.25, 1.0]),
        "strided": st.booleans(),
        "attn_sink": st.booleans(),
        "topk_length": st.booleans(),
    })


def make_indices(t: int, k: int, num_slots: int, invalid: float, gen) -> torch.Tensor:
    """Slots drawn with replacement (duplicates happen); a fraction `invalid` of them is
    -1 (padding)."""
    slots = torch.randint(0, num_slots, (t, k), generator=gen)
    draw = torch.rand((t, k), generator=gen)
    return torch.where(draw < invalid, -1, slots).to(torch.int32)


def sparse_reads(kv_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None):
    """What `sparse_mla` reads: (entries naming a cache slot [T, K] (left of
    `topk_length`), cache rows some such entry names [num_blocks, block_size]); on the CPU."""
    nb, bs = kv_cache.shape[:2]
    slots = indices.cpu().long()
    keys = (slots >= 0) & (slots < nb * bs)
    if topk_length is not None:
        keys = keys & (torch.arange(slots.shape[1])[None, :] < topk_length.cpu().long()[:, None])
    rows = torch.zeros(nb * bs, dtype=torch.bool)
    rows[slots[keys]] = True
    return keys, rows.view(nb, bs)


def _make_sparse(p: Params, device, gen):
    t, h, r, pe, bs, nb, k = p["T"], p["H"], p["R"], p["P"], p["block_size"], p["num_blocks"], p["K"]
    d = r + pe
    q = _q((t, h, d), p["dtype"], device, gen, p["strided"])
    kv_cache = _kv_cache(p, nb, device, gen)
    indices = make_indices(t, k, nb * bs, p["invalid"], gen)
    # FlashMLA's options: sinks around the lse's scale; lengths in [0, K].
    sink = (torch.randn(h, generator=gen) * 2).to(device) if p.get("attn_sink") else None
    length = torch.randint(0, k + 1, (t,), generator=gen).int().to(device) if p.get("topk_length") else None
    return q, kv_cache, indices.to(device), sm_scale_of(p), r, sink, length


def _unread_sparse(p: Params, args):
    """Cache rows no entry read names, the q rows of tokens without a valid entry read,
    and the entries right of `topk_length`."""
    q, kv_cache, indices = args[:3]
    keys, rows = sparse_reads(kv_cache, indices, args[6])
    q_unread = ~keys.any(dim=1)[:, None, None].expand(q.shape)
    marks = [(0, q_unread), (1, ~rows[..., None].expand(kv_cache.shape))]
    if args[6] is not None:
        columns = torch.arange(indices.shape[1])[None, :]
        marks.append((2, columns >= args[6].cpu().long()[:, None]))
    return marks


def _out_of_range_sparse(p: Params, args, gen):
    """Bad slots at some entries read, and -1 there; with `topk_length`, a length above K
    (K + 5; padded K) and a negative one (-3; padded 0)."""
    q, kv_cache, indices, scale, r, sink, length = args
    if indices.numel() == 0:
        return None
    read = torch.ones(indices.shape, dtype=torch.bool)
    if length is not None:
        read = torch.arange(indices.shape[1])[None, :] < length.cpu().long()[:, None]
        if not read.any():
            read[0] = True  # (ids only; the lengths below still go out of range)
    bad, padded = _out_of_range_ids(indices, read, kv_cache.shape[0] * kv_cache.shape[1], gen)
    bad_length = padded_length = length
    if length is not None:
        bad_length, padded_length = length.clone(), length.clone()
        row = int(torch.randint(0, length.shape[0], (1,), generator=gen))
        bad_length[row], padded_length[row] = indices.shape[1] + 5, indices.shape[1]
        if length.shape[0] > 1:
            bad_length[(row + 1) % length.shape[0]], padded_length[(row + 1) % length.shape[0]] = -3, 0
    return (q, kv_cache, bad, scale, r, sink, bad_length), (q, kv_cache, padded, scale, r, sink, padded_length)


def _nonfinite_sparse(p: Params, args, gen):
    q, kv_cache, indices, scale, r = args[:5]
    keys, rows = sparse_reads(kv_cache, indices, args[6])
    q_read = keys.any(dim=1)[:, None].expand(q.shape[:2])
    q, kv_cache = _nonfinite(q, kv_cache, q_read, rows, gen, r)
    return (q, kv_cache, indices, scale, r, *args[5:])


EXAMPLE_SPARSE: Params = {
    "T": 3, "H": 4, "R": 32, "P": 16, "block_size": 4, "num_blocks": 5, "K": 40,
    "dtype": torch.float16, "invalid": 0.25, "strided": False, "attn_sink": False, "topk_length": False,
}


EXAMPLE_SPARSE_FP8_DS: Params = {**EXAMPLE_SPARSE, "R": 128, "P": 16, "dtype": torch.bfloat16, "cache": FP8_DS}


def _bad_sparse(device, gen):
    q, kv, idx, scale, r = _make_sparse(EXAMPLE_SPARSE, device, gen)[:5]
    q8, kv8, idx8, _, r8 = _make_sparse(EXAMPLE_SPARSE_FP8_DS, device, gen)[:5]
    sink = torch.zeros(q.shape[1], device=device)
    length = torch.zeros(q.shape[0], dtype=torch.int32, device=device)
    return [
        BadInput("attn_sink float16", (q, kv, idx, scale, r, sink.half()), "attn_sink", "dtype"),
        BadInput("attn_sink of other H", (q, kv, idx, scale, r, sink[1:]), "attn_sink", r"\[H\]"),
        BadInput("topk_length int64", (q, kv, idx, scale, r, None, length.long()), "topk_length", "dtype"),
        BadInput("topk_length of other T", (q, kv, idx, scale, r, None, length[1:]), "topk_length", r"\[T\]"),
        BadInput("q of dtype int32", (q.int(), kv, idx, scale, r), "q", "dtype"),
        BadInput("kv_cache 4-D", (q, kv[None], idx, scale, r), "kv_cache", "3-D"),
        BadInput("kv_cache of other width", (q, kv[..., :-2], idx, scale, r), "kv_cache", r"R \+ P"),
        BadInput("indices int64", (q, kv, idx.long(), scale, r), "indices", "dtype"),
        BadInput("indices of other T", (q, kv, idx[1:], scale, r), "indices", r"\[T, K\]"),
        BadInput("indices strided", (q, kv, idx.t().contiguous().t(), scale, r), "indices", "contiguous"),
        BadInput("indices 1-D", (q, kv, idx.flatten(), scale, r), "indices", "2-D"),
        BadInput("kv_lora_rank negative", (q, kv, idx, scale, -3), "kv_lora_rank", r"\[1, R \+ P\]"),
        BadInput("kv_cache float8_e4m3fn", (q, kv.to(torch.float8_e4m3fn), idx, scale, r), "kv_cache",
                 "same dtype as 'q'.* or uint8"),
        *_bad_fp8_ds(q8, kv8, (idx8,), r8, gen),
    ]


register_case(
    OpCase(
        op="sparse_mla",
        params=_params_sparse,
        example=EXAMPLE_SPARSE,
        make=_make_sparse,
        compare=compare_attention,
        workspace_args=_workspace_sparse,
        options={"attn_sink": flag("attn_sink"), "topk_length": flag("topk_length")},
        adapter_examples=(AITER_SPARSE,),
        bad_inputs=_bad_sparse,
        unread=_unread_sparse,
        out_of_range=_out_of_range_sparse,
        nonfinite=_nonfinite_sparse,
        edge_cases=(
            {**EXAMPLE_SPARSE, "T": 0},
            {**EXAMPLE_SPARSE, "K": 0},
            {**EXAMPLE_SPARSE, "invalid": 1.0},
            {**EXAMPLE_SPARSE, "invalid": 0.0, "dtype": torch.bfloat16, "strided": True},
            {**EXAMPLE_SPARSE, "P": 0, "H": 16, "block_size": 1, "num_blocks": 30, "K": 100},
            {**EXAMPLE_SPARSE, "R": 24, "P": 12, "H": 17, "dtype": torch.bfloat16},
            EXAMPLE_SPARSE_FP8_DS,
            {**EXAMPLE_SPARSE_FP8_DS, "P": 32, "H": 16, "block_size": 16, "num_blocks": 3, "invalid": 0.0,
             "strided": True},
            {**EXAMPLE_SPARSE_FP8_DS, "R": 256, "T": 2, "H": 3, "block_size": 1, "num_blocks": 30, "strided": True},
            {**EXAMPLE_SPARSE, "attn_sink": True, "topk_length": True},
            {**EXAMPLE_SPARSE, "H": 16, "K": 70, "invalid": 0.0, "attn_sink": True},
            {**EXAMPLE_SPARSE_FP8_DS, "topk_length": True, "attn_sink": True},
        ),
        gpu_examples=(
            {**DEEPSEEK, "T": 64, "H": 16, "block_size": 64, "num_blocks": 2048, "K": 2048, "dtype": torch.bfloat16, "invalid": 0.0, "strided": False},
            {**DEEPSEEK, "T": 16, "H": 128, "block_size": 64, "num_blocks": 512, "K": 2048, "dtype": torch.bfloat16, "invalid": 0.25, "strided": False},
            {**DEEPSEEK, "T": 300, "H": 16, "block_size": 1, "num_blocks": 50000, "K": 2048, "dtype": torch.float16, "invalid": 0.25, "strided": True},
            {**DEEPSEEK, "T": 7, "H": 16, "block_size": 64, "num_blocks": 64, "K": 2048, "dtype": torch.bfloat16, "invalid": 1.0, "strided": False},
            {**DEEPSEEK, "T": 64, "H": 16, "block_size": 64, "num_blocks": 2048, "K": 2048, "dtype": torch.bfloat16,
             "invalid": 0.25, "strided": True, "cache": FP8_DS},
            {**DEEPSEEK, "T": 16, "H": 128, "block_size": 64, "num_blocks": 512, "K": 2048, "dtype": torch.bfloat16,
             "invalid": 0.0, "strided": False, "cache": FP8_DS},
            # FlashMLA's sink and per-token lengths, at both head counts (Gluon takes H = 128).
            {**DEEPSEEK, "T": 64, "H": 16, "block_size": 64, "num_blocks": 2048, "K": 2048, "dtype": torch.bfloat16,
             "invalid": 0.0, "strided": False, "attn_sink": True, "topk_length": True},
            {**DEEPSEEK, "T": 16, "H": 128, "block_size": 64, "num_blocks": 512, "K": 2048, "dtype": torch.bfloat16,
             "invalid": 0.0, "strided": False, "attn_sink": True, "topk_length": True},
            {**DEEPSEEK, "T": 16, "H": 128, "block_size": 64, "num_blocks": 512, "K": 2048, "dtype": torch.bfloat16,
             "invalid": 0.0, "strided": False, "cache": FP8_DS, "topk_length": True},
        ),
    )
)

__all__ = ["FP8_DS", "compare_attention", "decode_reads", "fp8_ds", "make_block_table", "make_indices", "make_seq_lens",
           "sm_scale_of", "sparse_reads"]
