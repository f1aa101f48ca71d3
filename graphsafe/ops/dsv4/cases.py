"""Test cases of the DeepSeek-V4 ops.

`dsv4_sparse_attn`: parameter sets with `"cache": "fp8_dsv4"` hold DeepSeek-V4 record caches
(`graphsafe.formats.fp8_dsv4`, written by `write_tokens` into storage of random bytes, blocks
`block_stride` bytes apart: vLLM's padding to 576 by default, `"strided"` adds 16 more),
the others bf16 caches of rows of D values. Slots drawn with replacement (repeats happen),
a fraction `invalid` of them -1; out-of-range slots (huge, negative, one past the end) come
from `out_of_range`, paired with -1 at their places.
"""

from __future__ import annotations

import torch

from graphsafe.formats import fp8_dsv4
from graphsafe.testing.cases import BadInput, OpCase, Params, assert_out_lse_close, register_case
from graphsafe.testing.tensors import randn

RECORDS = "fp8_dsv4"
BF16 = "bf16"
END = "end"
BAD_IDS = (10**6, -5, -2, END)
# out: the kernels round the softmax probabilities to bf16 before `p k` and sum in another
# order: about two bf16 ulps. lse: f32 scores of the same (bf16-exact) rows.
OUT_TOLERANCE = (2e-2, 2e-2)
LSE_TOLERANCE = (1e-4, 1e-4)


def records(p: Params) -> bool:
    return p.get("cache", BF16) == RECORDS


def head_dim(p: Params) -> int:
    return fp8_dsv4.HEAD_DIM if records(p) else p.get("D", fp8_dsv4.HEAD_DIM)


def compare_attention(expected, actual, expected_args, actual_args, params: Params) -> None:
    assert_out_lse_close(expected, actual, OUT_TOLERANCE, LSE_TOLERANCE)


def _q(shape, device, gen, strided: bool) -> torch.Tensor:
    rows, heads, d = shape
    if not strided or rows * heads == 0:
        return randn(shape, torch.bfloat16, device, gen)
    return randn((rows, heads + 1, d + 8), torch.bfloat16, device, gen)[:, :heads, :d]


def latent_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, 512]` float32 rows: randn, each 64-value NoPE tile times a factor in [1/4, 4]
    (tiles of one token get clearly different scales)."""
    x = torch.randn((n, 512), generator=gen)
    factor = 2.0 ** (4 * torch.rand((n, 8, 1), generator=gen) - 2)
    return (x.view(n, 8, 64) * factor).view(n, 512)


def record_cache(rows: torch.Tensor, nb: int, bs: int, device, gen, block_stride: int | None = None) -> torch.Tensor:
    """An fp8_dsv4 cache of `nb * bs` tokens holding `rows` (slot s = row s), in storage of
    random bytes (the pad bytes are written 0, the block padding stays random)."""
    stride = fp8_dsv4.padded_block_bytes(bs) if block_stride is None else block_stride
    storage = torch.randint(0, 256, (max(nb * stride, 1),), generator=gen, dtype=torch.uint8)
    cache = storage.as_strided((nb, bs, fp8_dsv4.TOKEN_BYTES), (stride, fp8_dsv4.TOKEN_BYTES, 1))
    fp8_dsv4.write_tokens(cache, rows, torch.arange(nb * bs))
    storage = storage.to(device)
    return storage.as_strided((nb, bs, fp8_dsv4.TOKEN_BYTES), (stride, fp8_dsv4.TOKEN_BYTES, 1))


def _cache(p: Params, nb: int, bs: int, device, gen) -> torch.Tensor:
    d = head_dim(p)
    if records(p):
        stride = fp8_dsv4.padded_block_bytes(bs) + (16 if p["strided"] else 0)
        return record_cache(latent_rows(nb * bs, gen), nb, bs, device, gen, stride)
    if not p["strided"]:
        return randn((nb, bs, d), torch.bfloat16, device, gen)
    return randn((nb, bs + 1, d + 16), torch.bfloat16, device, gen)[:, :bs, :d]


def make_indices(t: int, k: int, num_slots: int, invalid: float, gen) -> torch.Tensor:
    slots = torch.randint(0, num_slots, (t, k), generator=gen)
    return torch.where(torch.rand((t, k), generator=gen) < invalid, -1, slots).to(torch.int32)


def _params():
    from hypothesis import strategies as st

    common = {
        "T": st.integers(0, 4),
        "H": st.sampled_from([1, 2, 3, 4, 16]),
        "block_size": st.sampled_from([1, 4, 16]),
        "num_blocks": st.integers(1, 5),
        "K": st.integers(0, 40),
        "invalid": st.sampled_from([0.0, 0.25, 0.25, 1.0]),
        "strided": st.booleans(),
        "attn_sink": st.booleans(),
        "topk_length": st.booleans(),
        "extra": st.booleans(),
        "extra_block_size": st.sampled_from([1, 2, 8]),
        "extra_num_blocks": st.integers(1, 4),
        "K2": st.integers(0, 24),
        "extra_topk_length": st.booleans(),
    }
    rec = st.fixed_dictionaries({**common, "cache": st.just(RECORDS)})
    bf16 = st.fixed_dictionaries({**common, "cache": st.just(BF16), "D": st.sampled_from([512, 48, 40])})
    return st.one_of(rec, rec, bf16)


def _make(p: Params, device, gen):
    t, h, d, k = p["T"], p["H"], head_dim(p), p["K"]
    nb, bs = p["num_blocks"], p["block_size"]
    q = _q((t, h, d), device, gen, p["strided"])
    cache = _cache(p, nb, bs, device, gen)
    indices = make_indices(t, k, nb * bs, p["invalid"], gen).to(device)
    sink = (torch.randn(h, generator=gen) * 2).to(device) if p.get("attn_sink") else None
    length = torch.randint(0, k + 1, (t,), generator=gen).int().to(device) if p.get("topk_length") else None
    if not p.get("extra"):
        return q, cache, indices, d**-0.5, sink, length, None, None, None
    xnb, xbs, k2 = p["extra_num_blocks"], p["extra_block_size"], p["K2"]
    xcache = _cache(p, xnb, xbs, device, gen)
    xindices = make_indices(t, k2, xnb * xbs, p["invalid"], gen).to(device)
    xlength = torch.randint(0, k2 + 1, (t,), generator=gen).int().to(device) if p.get("extra_topk_length") else None
    return q, cache, indices, d**-0.5, sink, length, xcache, xindices, xlength


def entries_read(cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None):
    """(entries left of the length [T, K], entries naming a token [T, K], tokens read
    [num_blocks * block_size]); on the CPU."""
    nb, bs = cache.shape[:2]
    slots = indices.cpu().long()
    left = torch.ones(slots.shape, dtype=torch.bool)
    if lengths is not None:
        left = torch.arange(slots.shape[1])[None, :] < lengths.cpu().long().clamp(0, slots.shape[1])[:, None]
    keys = left & (slots >= 0) & (slots < nb * bs)
    tokens = torch.zeros(nb * bs, dtype=torch.bool)
    tokens[slots[keys]] = True
    return left, keys, tokens


def cache_bytes_read(cache: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Bool of the cache's shape: the elements a reader of `tokens` (bool [nb * bs]) reads.
    Records: the 576 data bytes and 7 scale bytes of each (view element (b, t, c) is block
    byte 584 t + c); never a pad byte. bf16 rows: the rows."""
    nb, bs = cache.shape[:2]
    tok = tokens.view(nb, bs)
    if cache.dtype != torch.uint8:
        return tok[..., None].expand(cache.shape).clone()
    offset = torch.arange(bs * fp8_dsv4.TOKEN_BYTES)
    data_token = offset // fp8_dsv4.DATA_BYTES
    in_data = offset < bs * fp8_dsv4.DATA_BYTES
    scale_off = offset - bs * fp8_dsv4.DATA_BYTES
    scale_token = scale_off.clamp(min=0) // fp8_dsv4.SCALE_BYTES
    is_scale = ~in_data & (scale_off % fp8_dsv4.SCALE_BYTES < fp8_dsv4.NUM_TILES)
    owner = torch.where(in_data, data_token, scale_token).clamp(max=bs - 1)
    read = tok[:, owner] & (in_data | is_scale)[None, :]
    return read.view(nb, bs, fp8_dsv4.TOKEN_BYTES)


def _lists(args):
    q, cache, indices, _, _, length, xcache, xindices, xlength = args
    lists = [(1, 2, 5, cache, indices, length)]
    if xcache is not None:
        lists.append((6, 7, 8, xcache, xindices, xlength))
    return lists


def _unread(p: Params, args):
    """Cache bytes / rows no key reads (pad bytes included), entries right of a length,
    and the q rows of tokens without any key."""
    q = args[0]
    marks, any_key = [], torch.zeros(q.shape[0], dtype=torch.bool)
    for cache_at, idx_at, _, cache, indices, length in _lists(args):
        left, keys, tokens = entries_read(cache, indices, length)
        any_key |= keys.any(dim=1)
        marks.append((cache_at, ~cache_bytes_read(cache, tokens)))
        if length is not None:
            marks.append((idx_at, ~left))
    marks.append((0, ~any_key[:, None, None].expand(q.shape)))
    return marks


def _bad_ids(shape, end: int, gen) -> torch.Tensor:
    values = torch.tensor([end if v == END else v for v in BAD_IDS], dtype=torch.int64)
    return values[torch.randint(0, len(BAD_IDS), shape, generator=gen)]


def _out_of_range(p: Params, args, gen):
    """Bad slots at some entries read, -1 there; with lengths, one above K (padded: K) and
    one negative (padded: 0)."""
    bad, padded = list(args), list(args)
    touched = False
    for cache_at, idx_at, len_at, cache, indices, length in _lists(args):
        if indices.numel() == 0:
            continue
        left, _, _ = entries_read(cache, indices, length)
        if not left.any():
            left[0, 0] = True
        pick = left & (torch.rand(left.shape, generator=gen) < 0.3)
        if not pick.any():
            pick.view(-1)[int(left.reshape(-1).nonzero()[0, 0])] = True
        nb, bs = cache.shape[:2]
        host = indices.cpu().long()
        bad[idx_at] = torch.where(pick, _bad_ids(pick.shape, nb * bs, gen), host).to(torch.int32).to(indices.device)
        padded[idx_at] = torch.where(pick, -1, host).to(torch.int32).to(indices.device)
        if length is not None:
            b_len, p_len = length.clone(), length.clone()
            row = int(torch.randint(0, length.shape[0], (1,), generator=gen))
            b_len[row], p_len[row] = indices.shape[1] + 5, indices.shape[1]
            if length.shape[0] > 1:
                b_len[(row + 1) % length.shape[0]], p_len[(row + 1) % length.shape[0]] = -3, 0
            bad[len_at], padded[len_at] = b_len, p_len
        touched = True
    return (tuple(bad), tuple(padded)) if touched else None


def set_row_value(cache: torch.Tensor, slot: int, col: int, value: float) -> None:
    """Put `value` at column `col` of the token at `slot` (in place). Records: the token's
    row is read back, the value put in and the row written again (`write_tokens`), so a
    NoPE tile reads back all NaN; a RoPE column gets its bf16 bytes."""
    nb, bs = cache.shape[:2]
    if cache.dtype != torch.uint8:
        cache[slot // bs, slot % bs, col] = value
        return
    row = fp8_dsv4.read_tokens(cache.cpu(), torch.tensor([slot]))[0]
    row[col] = value
    data, scales = fp8_dsv4.quantize_tokens(row[None])
    data_view, scale_view = fp8_dsv4.block_views(cache)
    data_view[slot // bs, slot % bs] = data[0].to(cache.device)
    scale_view[slot // bs, slot % bs] = scales[0].to(cache.device)


def _nonfinite(p: Params, args, gen):
    """NaN in one element of a q row read; in the rows of keys read: +inf, -inf and (half the
    draws) NaN at random columns."""
    from graphsafe.testing.contract import clone_tensor

    args = list(args)
    q = args[0] = clone_tensor(args[0])
    any_key = torch.zeros(q.shape[0], dtype=torch.bool)
    values = [float("inf"), float("-inf")] + ([float("nan")] if bool(torch.rand(1, generator=gen) < 0.5) else [])
    for cache_at, _, _, cache, indices, length in _lists(args):
        _, keys, tokens = entries_read(cache, indices, length)
        any_key |= keys.any(dim=1)
        cache = args[cache_at] = clone_tensor(cache)
        read = tokens.nonzero()[:, 0]
        for v in values:
            if read.numel() == 0:
                break
            slot = int(read[torch.randint(0, read.numel(), (1,), generator=gen)])
            set_row_value(cache, slot, int(torch.randint(0, q.shape[2], (1,), generator=gen)), v)
    rows = (any_key[:, None].expand(q.shape[:2])).reshape(-1).nonzero()[:, 0]
    if rows.numel():
        i = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
        q[i // q.shape[1], i % q.shape[1], int(torch.randint(0, q.shape[2], (1,), generator=gen))] = float("nan")
    return tuple(args)


def _workspace(p: Params, args) -> tuple[tuple, dict]:
    """`dsv4_sparse_attn_workspace_specs(T, H, D, K, K2)`."""
    q, indices, xindices = args[0], args[2], args[7]
    return (q.shape[0], q.shape[1], q.shape[2], indices.shape[1], 0 if xindices is None else xindices.shape[1]), {}


EXAMPLE: Params = {
    "T": 3, "H": 4, "block_size": 4, "num_blocks": 5, "K": 40, "invalid": 0.25, "strided": False,
    "attn_sink": True, "topk_length": True, "extra": True, "extra_block_size": 2, "extra_num_blocks": 4, "K2": 20,
    "extra_topk_length": True, "cache": RECORDS,
}
EXAMPLE_BF16: Params = {**EXAMPLE, "cache": BF16, "D": 512}
# DeepSeek-V4 decode (GPU): a window of 128 in 64-token blocks, the indexer's top-k over a
# ratio-4 cache (Flash 512, Pro 1024), 64 or 128 (padded) heads.
DSV4 = {"block_size": 64, "extra_block_size": 64, "invalid": 0.0, "strided": False, "attn_sink": True,
        "topk_length": True, "extra": True, "extra_topk_length": True, "cache": RECORDS}


def _bad(device, gen):
    q, c, idx, scale, sink, length, xc, xidx, xlen = _make(EXAMPLE, device, gen)
    qb, cb, idxb = _make(EXAMPLE_BF16, device, gen)[:3]
    wide = torch.zeros((*c.shape[:2], 585), dtype=torch.uint8, device=device)
    return [
        BadInput("q float32", (q.float(), c, idx, scale), "q", "dtype"),
        BadInput("q 2-D", (q[0], c, idx, scale), "q", "3-D"),
        BadInput("records with D != 512", (q[..., :256].contiguous(), c, idx, scale), "kv_cache", "uint8 fp8_dsv4"),
        BadInput("records of 585 bytes", (q, wide, idx, scale), "kv_cache", "584"),
        BadInput("records 585 bytes apart", (q, wide[..., :584], idx, scale), "kv_cache", "stride"),
        BadInput("bf16 cache of other D", (qb, cb[..., :64], idxb, scale), "kv_cache", r"head_dim"),
        BadInput("cache float16", (qb, cb.half(), idxb, scale), "kv_cache", "bfloat16 or uint8"),
        BadInput("indices int64", (q, c, idx.long(), scale), "indices", "dtype"),
        BadInput("indices of other T", (q, c, idx[1:], scale), "indices", r"\[T, K\]"),
        BadInput("attn_sink of other H", (q, c, idx, scale, sink[1:]), "attn_sink", r"\[H\]"),
        BadInput("topk_length int64", (q, c, idx, scale, None, length.long()), "topk_length", "dtype"),
        BadInput("extra cache of the other kind", (qb, cb, idxb, scale, None, None, xc, xidx), "extra_kv_cache",
                 "kind of 'kv_cache'"),
        BadInput("extra_indices without a cache", (q, c, idx, scale, None, None, None, xidx), "extra_indices",
                 "None when"),
        BadInput("extra cache without indices", (q, c, idx, scale, None, None, xc, None), "extra_indices",
                 "a tensor when"),
        BadInput("extra_topk_length of other T", (q, c, idx, scale, None, None, xc, xidx, xlen[1:]),
                 "extra_topk_length", r"\[T\]"),
    ]


register_case(
    OpCase(
        op="dsv4_sparse_attn",
        params=_params,
        example=EXAMPLE,
        make=_make,
        compare=compare_attention,
        workspace_args=_workspace,
        bad_inputs=_bad,
        unread=_unread,
        out_of_range=_out_of_range,
        nonfinite=_nonfinite,
        edge_cases=(
            {**EXAMPLE, "T": 0},
            {**EXAMPLE, "K": 0, "extra": False},
            {**EXAMPLE, "K": 0},
            {**EXAMPLE, "invalid": 1.0},
            {**EXAMPLE, "attn_sink": False, "topk_length": False, "extra": False, "strided": True},
            {**EXAMPLE_BF16, "strided": True, "extra_topk_length": False},
            {**EXAMPLE_BF16, "D": 40, "H": 17, "K": 33},
            # vLLM's 64-token blocks (stride 37440 bytes), DeepSeek-V4's 64 padded heads.
            {**EXAMPLE, "T": 2, "H": 64, "block_size": 64, "num_blocks": 2, "K": 48, "extra_block_size": 64,
             "extra_num_blocks": 1, "K2": 16},
        ),
        gpu_examples=(
            {**DSV4, "T": 64, "H": 64, "num_blocks": 256, "K": 128, "extra_num_blocks": 1024, "K2": 512},
            {**DSV4, "T": 64, "H": 128, "num_blocks": 256, "K": 128, "extra_num_blocks": 1024, "K2": 1024},
            {**DSV4, "T": 1, "H": 64, "num_blocks": 8, "K": 128, "extra_num_blocks": 64, "K2": 512, "invalid": 0.25},
            {**DSV4, "T": 300, "H": 64, "num_blocks": 512, "K": 128, "extra": False, "strided": True},
            {**DSV4, "T": 16, "H": 128, "num_blocks": 64, "K": 128, "extra_num_blocks": 64, "K2": 1024,
             "cache": BF16, "D": 512},
        ),
    )
)

# -- dsv4_qnorm_rope_kv_insert -------------------------------------------------------------
# q_out: the kernels may sum the squares in another order and fuse the rotation's
# multiply-adds: a value may differ by one bf16 ulp. RoPE values stored in the cache: the same.
Q_OUT_TOLERANCE = (1.6e-2, 1e-2)
ROPE_RTOL = 2.0**-7


def rope_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    """`[max_pos, 64]` float32: cos | sin of DeepSeek-V4's 32 rotary frequencies."""
    inv_freq = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def _params_insert():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "T": st.integers(0, 5),
        "H": st.sampled_from([1, 2, 3, 4, 16]),
        "pad_heads": st.sampled_from([0, 0, 3, 12]),
        "inserted": st.sampled_from(["all", "all", "fewer"]),
        "cache": st.sampled_from([RECORDS, RECORDS, BF16]),
        "block_size": st.sampled_from([1, 4, 16]),
        "num_blocks": st.integers(1, 4),
        "max_pos": st.integers(1, 64),
        "padding": st.sampled_from([0.0, 0.0, 0.3]),
        "index_dtype": st.sampled_from([torch.int64, torch.int32]),
        "strided": st.booleans(),
    })


def _make_insert(p: Params, device, gen):
    t, h, nb, bs = p["T"], p["H"], p["num_blocks"], p["block_size"]
    hp = h + p["pad_heads"]
    q = _q((t, h, 512), device, gen, p["strided"])
    kv = randn((t, 512 + (8 if p["strided"] else 0)), torch.bfloat16, device, gen)[:, :512]
    q_out = randn((t, hp, 512), torch.bfloat16, device, gen, scale=3.0)  # random before the op writes it
    if p["cache"] == RECORDS:
        stride = fp8_dsv4.padded_block_bytes(bs) + (16 if p["strided"] else 0)
        cache = record_cache(latent_rows(nb * bs, gen), nb, bs, device, gen, stride)
    else:
        cache = _cache({**p, "D": 512}, nb, bs, device, gen)
    n = t if p["inserted"] == "all" else t // 2
    slots = torch.full((n,), -1, dtype=torch.int64)
    m = min(n, nb * bs)  # distinct slots; tokens beyond the cache's slots are not inserted
    slots[:m] = torch.randperm(nb * bs, generator=gen)[:m]
    slots = torch.where(torch.rand(n, generator=gen) < p["padding"], -1, slots)
    positions = torch.randint(0, p["max_pos"], (t,), generator=gen)
    positions = torch.where(torch.rand(t, generator=gen) < p["padding"], -1, positions)
    table = rope_table(p["max_pos"]).to(device)
    idt = p["index_dtype"]
    return q, kv, q_out, cache, slots.to(idt).to(device), positions.to(idt).to(device), table, 1e-6


def _inserted(args):
    """(tokens with a position in the table [T], tokens written [T], their slots); CPU."""
    q, kv, q_out, cache, slots, positions, table, eps = args
    pos = positions.cpu().long()
    ok = (pos >= 0) & (pos < table.shape[0])
    nb, bs = cache.shape[:2]
    written = torch.zeros_like(ok)
    s = slots.cpu().long()
    written[: s.numel()] = ok[: s.numel()] & (s >= 0) & (s < nb * bs)
    return ok, written, s


def _unread_insert(p: Params, args):
    """q rows of padding tokens, kv rows of tokens not inserted, table rows no position
    names; all of q_out and of the cache (written, never read)."""
    q, kv, q_out, cache, slots, positions, table, eps = args
    ok, written, _ = _inserted(args)
    used = torch.zeros(table.shape[0], dtype=torch.bool)
    used[positions.cpu().long()[ok]] = True
    return [
        (0, ~ok[:, None, None].expand(q.shape)),
        (1, ~written[:, None].expand(kv.shape)),
        (2, torch.ones(q_out.shape, dtype=torch.bool)),
        (3, torch.ones(cache.shape, dtype=torch.bool)),
        (6, ~used[:, None].expand(table.shape)),
    ]


def _out_of_range_insert(p: Params, args, gen):
    """Bad slots at some inserted tokens (-1 there) and bad positions at some tokens (-1
    there: padding tokens)."""
    q, kv, q_out, cache, slots, positions, table, eps = args
    if q.shape[0] == 0:
        return None
    ok, written, s = _inserted(args)
    nb, bs = cache.shape[:2]
    bad, padded = list(args), list(args)
    if written.any():
        pick = written[: s.numel()] & (torch.rand(s.numel(), generator=gen) < 0.5)
        if not pick.any():
            pick[int(written[: s.numel()].nonzero()[0, 0])] = True
        bad[4] = torch.where(pick, _bad_ids(pick.shape, nb * bs, gen), s).to(slots.dtype).to(slots.device)
        padded[4] = torch.where(pick, -1, s).to(slots.dtype).to(slots.device)
    pos = positions.cpu().long()
    pick = torch.rand(pos.shape, generator=gen) < 0.3
    pick[int(torch.randint(0, pos.numel(), (1,), generator=gen))] = True
    bad[5] = torch.where(pick, _bad_ids(pick.shape, table.shape[0], gen), pos).to(positions.dtype).to(positions.device)
    padded[5] = torch.where(pick, -1, pos).to(positions.dtype).to(positions.device)
    return tuple(bad), tuple(padded)


def _nonfinite_insert(p: Params, args, gen):
    """NaN / +-inf in a q row read, in kv rows inserted (NoPE or RoPE columns), and a NaN
    in one table row used."""
    from graphsafe.testing.contract import clone_tensor

    q, kv, q_out, cache, slots, positions, table, eps = args
    q, kv, table = clone_tensor(q), clone_tensor(kv), clone_tensor(table)
    ok, written, _ = _inserted(args)
    for v in (float("nan"), float("inf"), float("-inf")):
        rows = ok.nonzero()[:, 0]
        if rows.numel():
            t = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
            q[t, int(torch.randint(0, q.shape[1], (1,), generator=gen)), int(torch.randint(0, 512, (1,), generator=gen))] = v
        rows = written.nonzero()[:, 0]
        if rows.numel():
            t = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
            kv[t, int(torch.randint(0, 512, (1,), generator=gen))] = v
    used = positions.cpu().long()[ok]
    if used.numel() and bool(torch.rand(1, generator=gen) < 0.5):
        table[int(used[0]), int(torch.randint(0, 64, (1,), generator=gen))] = float("nan")
    return q, kv, q_out, cache, slots, positions, table, eps


def compare_caches(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Written caches: every byte (record caches) or value (bf16) equal, but the RoPE values,
    which may differ by one bf16 ulp (NaN equal to NaN, whatever its bits)."""
    e, a = expected.cpu(), actual.cpu()
    if e.dtype == torch.uint8:
        nb, bs = e.shape[:2]
        e_data, e_scales = fp8_dsv4.block_views(e)
        a_data, a_scales = fp8_dsv4.block_views(a)
        assert torch.equal(e_scales, a_scales), "record scales and pad bytes differ"
        assert torch.equal(e_data[..., :448], a_data[..., :448]), "record NoPE bytes differ"
        e_rope = e_data[..., 448:].contiguous().view(torch.bfloat16).float()
        a_rope = a_data[..., 448:].contiguous().view(torch.bfloat16).float()
    else:
        torch.testing.assert_close(a[..., :448], e[..., :448], rtol=0, atol=0, equal_nan=True)
        e_rope, a_rope = e[..., 448:].float(), a[..., 448:].float()
    torch.testing.assert_close(a_rope, e_rope, rtol=ROPE_RTOL, atol=1e-30, equal_nan=True, msg=lambda m: f"RoPE: {m}")


def compare_insert(expected, actual, expected_args, actual_args, params: Params) -> None:
    assert expected is None and actual is None
    rtol, atol = Q_OUT_TOLERANCE
    torch.testing.assert_close(actual_args[2].float().cpu(), expected_args[2].float().cpu(), rtol=rtol, atol=atol,
                               equal_nan=True, msg=lambda m: f"q_out: {m}")
    compare_caches(expected_args[3], actual_args[3])


EXAMPLE_INSERT: Params = {
    "T": 5, "H": 3, "pad_heads": 5, "inserted": "fewer", "cache": RECORDS, "block_size": 4, "num_blocks": 3,
    "max_pos": 40, "padding": 0.3, "index_dtype": torch.int64, "strided": False,
}


def _bad_insert(device, gen):
    q, kv, q_out, cache, slots, pos, table, eps = _make_insert({**EXAMPLE_INSERT, "inserted": "all"}, device, gen)
    return [
        BadInput("q float16", (q.half(), kv, q_out, cache, slots, pos, table, eps), "q", "dtype"),
        BadInput("q of head dim 576", (torch.cat([q, q[..., :64]], -1), kv, q_out, cache, slots, pos, table, eps), "q",
                 r"\[T, H, 512\]"),
        BadInput("kv of other T", (q, kv[1:], q_out, cache, slots, pos, table, eps), "kv", r"\[T, 512\]"),
        BadInput("q_out of fewer heads", (q, kv, q_out[:, :2], cache, slots, pos, table, eps), "q_out", "at least"),
        BadInput("slot_mapping longer than T", (q, kv, q_out, cache, torch.cat([slots, slots]), pos, table, eps),
                 "slot_mapping", "at most T"),
        BadInput("slot_mapping float", (q, kv, q_out, cache, slots.float(), pos, table, eps), "slot_mapping", "dtype"),
        BadInput("positions of other T", (q, kv, q_out, cache, slots, pos[1:], table, eps), "positions", r"\[T\]"),
        BadInput("cos_sin_cache of 128 columns", (q, kv, q_out, cache, slots, pos, torch.cat([table, table], 1), eps),
                 "cos_sin_cache", "max_pos, 64"),
        BadInput("cos_sin_cache bf16", (q, kv, q_out, cache, slots, pos, table.bfloat16(), eps), "cos_sin_cache",
                 "dtype"),
        BadInput("cache of float16 rows", (q, kv, q_out, torch.zeros(2, 4, 512, dtype=torch.float16, device=device),
                                           slots, pos, table, eps), "kv_cache", "bfloat16 or uint8"),
    ]


register_case(
    OpCase(
        op="dsv4_qnorm_rope_kv_insert",
        params=_params_insert,
        example=EXAMPLE_INSERT,
        make=_make_insert,
        compare=compare_insert,
        bad_inputs=_bad_insert,
        unread=_unread_insert,
        out_of_range=_out_of_range_insert,
        nonfinite=_nonfinite_insert,
        edge_cases=(
            {**EXAMPLE_INSERT, "T": 0},
            {**EXAMPLE_INSERT, "padding": 0.0, "inserted": "all", "pad_heads": 0},
            {**EXAMPLE_INSERT, "padding": 1.0},
            {**EXAMPLE_INSERT, "cache": BF16, "strided": True, "index_dtype": torch.int32},
            {**EXAMPLE_INSERT, "H": 16, "pad_heads": 48, "block_size": 64, "num_blocks": 1, "strided": True},
        ),
        gpu_examples=(
            {**EXAMPLE_INSERT, "T": 64, "H": 64, "pad_heads": 0, "block_size": 64, "num_blocks": 8, "max_pos": 4096,
             "padding": 0.0, "inserted": "all"},
            {**EXAMPLE_INSERT, "T": 1000, "H": 16, "pad_heads": 48, "block_size": 64, "num_blocks": 40,
             "max_pos": 4096, "padding": 0.1},
            {**EXAMPLE_INSERT, "T": 64, "H": 128, "pad_heads": 0, "block_size": 64, "num_blocks": 8, "max_pos": 4096,
             "padding": 0.0, "cache": BF16},
        ),
    )
)

# -- dsv4_compress_kv ----------------------------------------------------------------------
# A record's values may move by one e4m3 step (2^-3 relative; the pooled float32 value
# differs by ulps between exp implementations, which can flip its bf16 and e4m3 rounding).
COMPRESS_RECORD_TOLERANCE = (0.13, 1e-3)
COMPRESS_ROW_TOLERANCE = (2e-2, 1e-2)


def _params_compress():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "requests": st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4)), min_size=1, max_size=3),
        "ratio": st.sampled_from([1, 2, 4, 4, 8]),
        "overlap": st.booleans(),
        "cache": st.sampled_from([RECORDS, RECORDS, BF16]),
        "D": st.sampled_from([64, 128]),
        "state_block_size": st.sampled_from([1, 2, 4]),
        "block_size": st.sampled_from([1, 4]),
        "missing": st.sampled_from([0.0, 0.0, 0.2]),
        "padding": st.sampled_from([0.0, 0.0, 0.25]),
    })


def _make_compress(p: Params, device, gen):
    """Requests `(start, new)`: `new` tokens at positions start ... start + new - 1, packed
    one request after the other; every position the step reads or writes (the windows of
    its tokens: from start - S + 1 on) has a state block (some, a fraction `missing`, -1:
    missing states), the earlier positions' states hold random saved states, and the table's
    other columns are -1 (never read); compressed slots for the tokens that complete a
    window, garbage elsewhere (never read), and so are `token_to_req` of the others.

    Only the blocks a step touches get state rows: a decode token at position 258k needs 3
    of them, where a block for every earlier position took 135 GB of host memory at the
    GPU examples' shapes (`tests/test_dsv4.py::test_gpu_examples_build_in_bounded_host_memory`)."""
    ratio, d = p["ratio"], (fp8_dsv4.HEAD_DIM if records(p) else p["D"])
    w = 2 * d if p["overlap"] else d
    window = ratio * (w // d)  # states an entry pools
    sbs = p["state_block_size"]
    reqs = p["requests"]
    t = sum(n for _, n in reqs)
    max_blocks = max((s + n) // sbs + 1 for s, n in reqs)
    spans = [(max(s - window + 1, 0) // sbs, (s + n - 1) // sbs + 1) if n else (0, 0) for s, n in reqs]
    nsb = sum(hi - lo for lo, hi in spans) + 2
    ids = torch.randperm(nsb, generator=gen)
    table = torch.full((len(reqs), max_blocks), -1, dtype=torch.int64)
    used = 0
    for r, (lo, hi) in enumerate(spans):
        table[r, lo:hi] = ids[used : used + hi - lo]
        used += hi - lo
    missing = torch.rand(table.shape, generator=gen) < p["missing"]
    table = torch.where(missing, -1, table).to(torch.int32)
    state = torch.randn((nsb, sbs, 2 * w), generator=gen)
    positions = torch.cat([torch.arange(s, s + n) for s, n in reqs]) if t else torch.zeros(0, dtype=torch.int64)
    req_of = torch.cat([torch.full((n,), r) for r, (_, n) in enumerate(reqs)]) if t else torch.zeros(0, dtype=torch.int64)
    blk = table[req_of, positions // sbs].long()
    state_slots = torch.where(blk >= 0, blk * sbs + positions % sbs, -1)
    pad = torch.rand(t, generator=gen) < p["padding"]
    state_slots = torch.where(pad & (torch.rand(t, generator=gen) < 0.5), -1, state_slots)
    positions = torch.where(pad & (state_slots >= 0), -1, positions)
    boundary = (positions >= 0) & (state_slots >= 0) & ((positions + 1) % ratio == 0)
    nb, bs = 3, p["block_size"]
    nb = max(nb, -(-int(boundary.sum()) // bs) + 1)
    kv_slots = torch.randint(-(2**40), 2**40, (t,), generator=gen)  # garbage: never read
    kv_slots[boundary] = torch.randperm(nb * bs, generator=gen)[: int(boundary.sum())]
    token_to_req = torch.randint(-(2**31), 2**31 - 1, (t,), generator=gen, dtype=torch.int64)
    token_to_req[boundary] = req_of[boundary]
    max_pos = max((s + n for s, n in reqs), default=1) + 3
    if records(p):
        cache = record_cache(latent_rows(nb * bs, gen), nb, bs, device, gen)
    else:
        cache = randn((nb, bs, d), torch.bfloat16, device, gen)
    return (
        randn((t, w), torch.bfloat16, device, gen), randn((t, w), torch.bfloat16, device, gen),
        randn((ratio, w), torch.float32, device, gen), positions.to(device), state.to(device), state_slots.to(device),
        table.to(device), token_to_req.to(torch.int32).to(device),
        (torch.randn(d, generator=gen) * 0.3 + 1).to(device), 1e-6, rope_table(max_pos, 160000.0).to(device), cache,
        kv_slots.to(device), ratio,
    )


def _compress_reads(args):
    """What the op reads and writes: (saving tokens, boundary tokens, pooling tokens, state
    rows read before any write [nsb, sbs], state rows written, table entries read [R, MB],
    rope positions read [max_pos]); on the CPU."""
    kv, score, ape, positions, state, state_slots, table, t2r, weight, eps, cs, cache, kv_slots, ratio = args
    pos, ss = positions.cpu().long(), state_slots.cpu().long()
    nsb, sbs = state.shape[:2]
    saving = (pos >= 0) & (pos < cs.shape[0]) & (ss >= 0) & (ss < nsb * sbs)
    boundary = saving & ((pos + 1) % ratio == 0)
    nb, bs = cache.shape[:2]
    ks, req = kv_slots.cpu().long(), t2r.cpu().long()
    pooling = boundary & (ks >= 0) & (ks < nb * bs) & (req >= 0) & (req < table.shape[0])
    written = torch.zeros(nsb * sbs, dtype=torch.bool)
    written[ss[saving]] = True
    s = ratio * (kv.shape[1] // weight.shape[0])
    q = pos[:, None] - s + 1 + torch.arange(s)[None, :]
    col = q.div(sbs, rounding_mode="floor")
    in_table = pooling[:, None] & (q >= 0) & (col < table.shape[1])
    tab = table.cpu().long()
    r = torch.where(pooling, req, 0)[:, None].expand_as(col)
    ids = tab[r, torch.where(in_table, col, 0)]
    present = in_table & (ids >= 0) & (ids < nsb)
    read = torch.zeros(nsb * sbs, dtype=torch.bool)
    read[(ids * sbs + q % sbs)[present]] = True
    entries = torch.zeros(tab.shape, dtype=torch.bool)
    entries[r[in_table], col[in_table]] = True
    rope = torch.zeros(cs.shape[0], dtype=torch.bool)
    rope[((pos // ratio) * ratio)[pooling]] = True
    return saving, boundary, pooling, (read & ~written).view(nsb, sbs), written.view(nsb, sbs), entries, rope


def _unread_compress(p: Params, args):
    kv, score, ape, positions, state, state_slots, table, t2r, weight, eps, cs, cache, kv_slots, ratio = args
    saving, boundary, pooling, read_before, _, entries, rope = _compress_reads(args)
    ape_used = torch.zeros(ape.shape[0], dtype=torch.bool)
    ape_used[positions.cpu().long()[saving] % ratio] = True
    return [
        (0, ~saving[:, None].expand(kv.shape)),
        (1, ~saving[:, None].expand(score.shape)),
        (2, ~ape_used[:, None].expand(ape.shape)),
        (4, ~read_before[..., None].expand(state.shape)),
        (6, ~entries),
        (7, ~boundary),
        (8, torch.full(weight.shape, not bool(pooling.any()))),
        (10, ~rope[:, None].expand(cs.shape)),
        (11, torch.ones(cache.shape, dtype=torch.bool)),
        (12, ~boundary),
    ]


def _out_of_range_compress(p: Params, args, gen):
    """Bad positions / state slots at some tokens (-1 there), bad compressed slots and
    requests at some window-completing tokens (-1 there), bad block ids among the entries
    pooled (-1 there: missing states)."""
    kv, score, ape, positions, state, state_slots, table, t2r, weight, eps, cs, cache, kv_slots, ratio = args
    t = kv.shape[0]
    if t == 0:
        return None
    saving, boundary, pooling, _, _, entries, _ = _compress_reads(args)
    bad, padded = list(args), list(args)

    def swap(at, host, pick, end):
        bad[at] = torch.where(pick, _bad_ids(pick.shape, end, gen), host).to(args[at].dtype).to(args[at].device)
        padded[at] = torch.where(pick, -1, host).to(args[at].dtype).to(args[at].device)

    nsb, sbs = state.shape[:2]
    nb, bs = cache.shape[:2]
    pick = torch.rand(t, generator=gen) < 0.2
    if pick.any():
        which = torch.rand(t, generator=gen) < 0.5
        swap(3, positions.cpu().long(), pick & which, cs.shape[0])
        swap(5, state_slots.cpu().long(), pick & ~which, nsb * sbs)
    if boundary.any():
        pick = boundary & (torch.rand(t, generator=gen) < 0.4)
        which = torch.rand(t, generator=gen) < 0.5
        swap(12, kv_slots.cpu().long(), pick & which, nb * bs)
        swap(7, t2r.cpu().long(), pick & ~which, table.shape[0])
    if entries.any():
        swap(6, table.cpu().long(), entries & (torch.rand(entries.shape, generator=gen) < 0.3), nsb)
    return tuple(bad), tuple(padded)


def _nonfinite_compress(p: Params, args, gen):
    """NaN / +-inf in the kv and score rows of saving tokens, in state rows pooled, and
    (half the draws) a NaN in the norm weight or in a RoPE row read."""
    from graphsafe.testing.contract import clone_tensor

    args = list(args)
    saving, boundary, pooling, read_before, _, _, rope = _compress_reads(args)
    for at in (0, 1, 4):
        args[at] = clone_tensor(args[at])
    for v in (float("nan"), float("inf"), float("-inf")):
        rows = saving.nonzero()[:, 0]
        if rows.numel():
            at = (0, 1)[int(torch.randint(0, 2, (1,), generator=gen))]
            r = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
            args[at][r, int(torch.randint(0, args[at].shape[1], (1,), generator=gen))] = v
        rows = read_before.reshape(-1).nonzero()[:, 0]
        if rows.numel():
            r = int(rows[torch.randint(0, rows.numel(), (1,), generator=gen)])
            sbs = args[4].shape[1]
            args[4][r // sbs, r % sbs, int(torch.randint(0, args[4].shape[2], (1,), generator=gen))] = v
    if bool(torch.rand(1, generator=gen) < 0.5):
        if bool(torch.rand(1, generator=gen) < 0.5):
            args[8] = clone_tensor(args[8])
            args[8][int(torch.randint(0, args[8].shape[0], (1,), generator=gen))] = float("nan")
        elif rope.any():
            args[10] = clone_tensor(args[10])
            args[10][int(rope.nonzero()[0, 0]), int(torch.randint(0, 64, (1,), generator=gen))] = float("nan")
    return tuple(args)


def compare_compress(expected, actual, expected_args, actual_args, params: Params) -> None:
    assert expected is None and actual is None
    torch.testing.assert_close(actual_args[4].cpu(), expected_args[4].cpu(), rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"state_cache: {m}")
    e, a = expected_args[11].cpu(), actual_args[11].cpu()
    nb, bs = e.shape[:2]
    if e.dtype == torch.uint8:
        e_rows = fp8_dsv4.read_tokens(e, torch.arange(nb * bs))
        a_rows = fp8_dsv4.read_tokens(a, torch.arange(nb * bs))
        rtol, atol = COMPRESS_RECORD_TOLERANCE
    else:
        e_rows, a_rows = e.float(), a.float()
        rtol, atol = COMPRESS_ROW_TOLERANCE
    torch.testing.assert_close(a_rows, e_rows, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"kv_cache: {m}")


EXAMPLE_COMPRESS: Params = {
    "requests": [(5, 4), (0, 3), (14, 2)], "ratio": 4, "overlap": True, "cache": RECORDS, "D": 128,
    "state_block_size": 2, "block_size": 4, "missing": 0.0, "padding": 0.0,
}


def _bad_compress(device, gen):
    args = _make_compress(EXAMPLE_COMPRESS, device, gen)
    kv, score, ape, pos, state, ss, table, t2r, weight, eps, cs, cache, ks, ratio = args

    def with_(at, value):
        a = list(args)
        a[at] = value
        return tuple(a)

    return [
        BadInput("kv float32", with_(0, kv.float()), "kv", "dtype"),
        BadInput("score of other width", with_(1, score[:, 1:]), "score", r"\[T, W\]"),
        BadInput("kv of 3 D", (torch.cat([kv, kv[:, :512]], 1), torch.cat([score, score[:, :512]], 1), *args[2:]),
                 "kv", "D or 2 D"),
        BadInput("ape of other ratio", with_(2, ape[1:]), "ape", "compress_ratio"),
        BadInput("norm weight of 100", with_(8, weight[:100]), "norm_weight", "multiple of 64"),
        BadInput("state cache of other width", with_(4, state[..., 1:]), "state_cache", "2 W"),
        BadInput("state cache bf16", with_(4, state.bfloat16()), "state_cache", "dtype"),
        BadInput("token_to_req int64", with_(7, t2r.long()), "token_to_req", "dtype"),
        BadInput("kv_slot_mapping of other T", with_(12, ks[1:]), "kv_slot_mapping", r"\[T\]"),
        BadInput("block table 1-D", with_(6, table[0]), "state_block_table", "2-D"),
        BadInput("compress_ratio 0", (*args[:2], ape[:0], *args[3:13], 0), "compress_ratio", "positive"),
    ]


register_case(
    OpCase(
        op="dsv4_compress_kv",
        params=_params_compress,
        example=EXAMPLE_COMPRESS,
        make=_make_compress,
        compare=compare_compress,
        bad_inputs=_bad_compress,
        unread=_unread_compress,
        out_of_range=_out_of_range_compress,
        nonfinite=_nonfinite_compress,
        edge_cases=(
            {**EXAMPLE_COMPRESS, "requests": [(0, 0)]},
            {**EXAMPLE_COMPRESS, "padding": 0.25, "missing": 0.2},
            {**EXAMPLE_COMPRESS, "overlap": False, "ratio": 8, "requests": [(3, 6), (15, 1)], "cache": BF16},
            {**EXAMPLE_COMPRESS, "cache": BF16, "D": 64, "state_block_size": 1},
            # DeepSeek-V4's heavily compressed layers: 128 states a window (no overlap).
            {**EXAMPLE_COMPRESS, "ratio": 128, "overlap": False, "requests": [(120, 9)], "state_block_size": 8},
        ),
        gpu_examples=(
            # Decode at long contexts: one token a request, a quarter of them completing a window.
            {**EXAMPLE_COMPRESS, "requests": [(4096 * i + 300 + i % 4, 1) for i in range(64)], "state_block_size": 4,
             "block_size": 64},
            {**EXAMPLE_COMPRESS, "requests": [(0, 1000), (37, 500)], "ratio": 128, "overlap": False,
             "state_block_size": 8, "block_size": 64},
        ),
    )
)

__all__ = ["RECORDS", "compare_attention", "entries_read", "latent_rows", "make_indices", "record_cache",
           "rope_table", "set_row_value"]
