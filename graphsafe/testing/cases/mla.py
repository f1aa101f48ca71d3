"""Test cases of `mla_decode` and `sparse_mla`.

Inputs are random everywhere a kernel must not look: block-table entries past a
request's length hold garbage block ids (huge, negative), caches are random. The ids an
op reads are valid or the padding value -1 (padding blocks inside a request's length,
`-1` among the sparse slots, which also repeat); ids out of range in every other way
(huge, negative, one past the end) come from `out_of_range`, paired with -1 at their places.
"""

from __future__ import annotations

import torch

from graphsafe.testing.cases import BadInput, OpCase, Params, register_case
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


def compare_attention(expected, actual, expected_args, actual_args, params: Params) -> None:
    """out within a couple of ulps of its dtype, lse within 1e-4; -inf rows must match exactly."""
    (e_out, e_lse), (a_out, a_lse) = expected, actual
    rtol, atol = OUT_TOLERANCES[e_out.dtype]
    assert a_out.shape == e_out.shape and a_out.dtype == e_out.dtype, "out: shape/dtype"
    assert a_lse.shape == e_lse.shape and a_lse.dtype == torch.float32, "lse: shape/dtype"
    torch.testing.assert_close(a_out.float().cpu(), e_out.float().cpu(), rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    assert torch.equal(torch.isneginf(a_lse).cpu(), torch.isneginf(e_lse).cpu()), "lse: rows without a key differ"
    rtol, atol = LSE_TOLERANCE
    torch.testing.assert_close(a_lse.cpu(), e_lse.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"lse: {m}")


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


def _nonfinite(q, kv, q_read, kv_rows_read, gen):
    """Copies of q and kv with NaN in one element of a read q row and, in read cache rows,
    +inf, -inf and (in about half of the draws) NaN at random columns. q_read: bool [rows, H];
    kv_rows_read: bool [num_blocks, block_size]."""
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
        col = int(torch.randint(0, kv.shape[2], (1,), generator=gen))
        kv[row // bs, row % bs, col] = v
    return q, kv


# -- mla_decode ---------------------------------------------------------------------------
def _params_decode():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
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
        }
    )


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
    kv_cache = _cache(num_blocks, bs, d, p["dtype"], device, gen, p["strided"])
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
    q, kv_cache = _nonfinite(q, kv_cache, q_read, rows, gen)
    return q, kv_cache, block_table, seq_lens, scale, r


EXAMPLE_DECODE: Params = {
    "B": 3, "H": 4, "R": 32, "P": 16, "block_size": 4, "max_blocks": 5,
    "dtype": torch.float16, "lens": "random", "padding": 0.25, "strided": False,
}
DEEPSEEK = {"R": 512, "P": 64}


def _bad_decode(device, gen):
    q, kv, bt, lens, scale, r = _make_decode(EXAMPLE_DECODE, device, gen)
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
    ]


register_case(
    OpCase(
        op="mla_decode",
        params=_params_decode,
        example=EXAMPLE_DECODE,
        make=_make_decode,
        compare=compare_attention,
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
        ),
        gpu_examples=(
            {**DEEPSEEK, "B": 64, "H": 16, "block_size": 64, "max_blocks": 64, "dtype": torch.bfloat16, "lens": "random", "strided": False},
            {**DEEPSEEK, "B": 8, "H": 128, "block_size": 64, "max_blocks": 128, "dtype": torch.bfloat16, "lens": "random",
             "padding": 0.25, "strided": False},
            {**DEEPSEEK, "B": 5, "H": 16, "block_size": 16, "max_blocks": 300, "dtype": torch.float16, "lens": "random", "strided": True},
            {**DEEPSEEK, "B": 3, "H": 128, "block_size": 64, "max_blocks": 16, "dtype": torch.bfloat16, "lens": "empty", "strided": False},
        ),
    )
)


# -- sparse_mla ---------------------------------------------------------------------------
def _params_sparse():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
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
        }
    )


def make_indices(t: int, k: int, num_slots: int, invalid: float, gen) -> torch.Tensor:
    """Slots drawn with replacement (duplicates happen); a fraction `invalid` of them is
    -1 (padding)."""
    slots = torch.randint(0, num_slots, (t, k), generator=gen)
    draw = torch.rand((t, k), generator=gen)
    return torch.where(draw < invalid, -1, slots).to(torch.int32)


def sparse_reads(kv_cache: torch.Tensor, indices: torch.Tensor):
    """What `sparse_mla` reads: (entries naming a cache slot [T, K], cache rows some entry
    names [num_blocks, block_size]); on the CPU."""
    nb, bs = kv_cache.shape[:2]
    slots = indices.cpu().long()
    keys = (slots >= 0) & (slots < nb * bs)
    rows = torch.zeros(nb * bs, dtype=torch.bool)
    rows[slots[keys]] = True
    return keys, rows.view(nb, bs)


def _make_sparse(p: Params, device, gen):
    t, h, r, pe, bs, nb, k = p["T"], p["H"], p["R"], p["P"], p["block_size"], p["num_blocks"], p["K"]
    d = r + pe
    q = _q((t, h, d), p["dtype"], device, gen, p["strided"])
    kv_cache = _cache(nb, bs, d, p["dtype"], device, gen, p["strided"])
    indices = make_indices(t, k, nb * bs, p["invalid"], gen)
    return q, kv_cache, indices.to(device), sm_scale_of(p), r


def _unread_sparse(p: Params, args):
    """Cache rows no entry names, and the q rows of tokens without a valid entry."""
    q, kv_cache, indices = args[:3]
    keys, rows = sparse_reads(kv_cache, indices)
    q_unread = ~keys.any(dim=1)[:, None, None].expand(q.shape)
    return [(0, q_unread), (1, ~rows[..., None].expand(kv_cache.shape))]


def _out_of_range_sparse(p: Params, args, gen):
    """Bad slots at some entries (every entry is read), and -1 there."""
    q, kv_cache, indices, scale, r = args
    if indices.numel() == 0:
        return None
    read = torch.ones(indices.shape, dtype=torch.bool)
    bad, padded = _out_of_range_ids(indices, read, kv_cache.shape[0] * kv_cache.shape[1], gen)
    return (q, kv_cache, bad, scale, r), (q, kv_cache, padded, scale, r)


def _nonfinite_sparse(p: Params, args, gen):
    q, kv_cache, indices, scale, r = args
    keys, rows = sparse_reads(kv_cache, indices)
    q_read = keys.any(dim=1)[:, None].expand(q.shape[:2])
    q, kv_cache = _nonfinite(q, kv_cache, q_read, rows, gen)
    return q, kv_cache, indices, scale, r


EXAMPLE_SPARSE: Params = {
    "T": 3, "H": 4, "R": 32, "P": 16, "block_size": 4, "num_blocks": 5, "K": 40,
    "dtype": torch.float16, "invalid": 0.25, "strided": False,
}


def _bad_sparse(device, gen):
    q, kv, idx, scale, r = _make_sparse(EXAMPLE_SPARSE, device, gen)
    return [
        BadInput("q of dtype int32", (q.int(), kv, idx, scale, r), "q", "dtype"),
        BadInput("kv_cache 4-D", (q, kv[None], idx, scale, r), "kv_cache", "3-D"),
        BadInput("kv_cache of other width", (q, kv[..., :-2], idx, scale, r), "kv_cache", r"R \+ P"),
        BadInput("indices int64", (q, kv, idx.long(), scale, r), "indices", "dtype"),
        BadInput("indices of other T", (q, kv, idx[1:], scale, r), "indices", r"\[T, K\]"),
        BadInput("indices strided", (q, kv, idx.t().contiguous().t(), scale, r), "indices", "contiguous"),
        BadInput("indices 1-D", (q, kv, idx.flatten(), scale, r), "indices", "2-D"),
        BadInput("kv_lora_rank negative", (q, kv, idx, scale, -3), "kv_lora_rank", r"\[1, R \+ P\]"),
    ]


register_case(
    OpCase(
        op="sparse_mla",
        params=_params_sparse,
        example=EXAMPLE_SPARSE,
        make=_make_sparse,
        compare=compare_attention,
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
        ),
        gpu_examples=(
            {**DEEPSEEK, "T": 64, "H": 16, "block_size": 64, "num_blocks": 2048, "K": 2048, "dtype": torch.bfloat16, "invalid": 0.0, "strided": False},
            {**DEEPSEEK, "T": 16, "H": 128, "block_size": 64, "num_blocks": 512, "K": 2048, "dtype": torch.bfloat16, "invalid": 0.25, "strided": False},
            {**DEEPSEEK, "T": 300, "H": 16, "block_size": 1, "num_blocks": 50000, "K": 2048, "dtype": torch.float16, "invalid": 0.25, "strided": True},
            {**DEEPSEEK, "T": 7, "H": 16, "block_size": 64, "num_blocks": 64, "K": 2048, "dtype": torch.bfloat16, "invalid": 1.0, "strided": False},
        ),
    )
)

__all__ = ["compare_attention", "decode_reads", "make_block_table", "make_indices", "make_seq_lens", "sm_scale_of",
           "sparse_reads"]
