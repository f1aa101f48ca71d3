"""Test cases of `top_k_per_row_prefill` and `top_k_per_row_decode`.

Results are compared as sets (`assert_topk_rows`): the -1 pattern exactly, every
position valid, in range and distinct within its row, and the multiset of chosen
scores equal to the reference's (scores compared as the sortable keys both backends
rank by, so ties and -inf compare exactly).
"""

from __future__ import annotations

import torch

from graphsafe.testing.cases import BadInput, OpCase, Params, register_case
from graphsafe.testing.tensors import poison, randint

VALUE_MODES = ("normal", "ties", "ties_inf", "neg_inf_rows")
# Ties: 0.3 has nonzero low mantissa bits, the others are exact in the top 16 bits, so
# both the "ties at the threshold" and the "bound below the ties" paths are exercised.
TIE_VALUES = (-1.0, 0.0, 0.3, 1.0, 2.5)


# -- comparison ---------------------------------------------------------------------
def sortable_keys(logits: torch.Tensor) -> torch.Tensor:
    bits = logits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def prefill_ranges(row_starts: torch.Tensor, row_ends: torch.Tensor, width: int):
    """(lo, hi, origin) of each row: bounds clamped to [0, width], positions from lo."""
    lo = row_starts.long().clamp(0, width)
    hi = torch.maximum(row_ends.long().clamp(max=width), lo)
    return lo, hi, lo


def decode_ranges(seq_lens: torch.Tensor, next_n: int, width: int):
    """(lo, hi, origin) of each row: lengths clamped to [0, width] first."""
    rows = seq_lens.shape[0] * next_n
    i = torch.arange(rows) % next_n
    end = seq_lens.long().cpu().clamp(0, width).repeat_interleave(next_n) - next_n + i + 1
    hi = end.clamp(0, width)
    lo = torch.zeros_like(hi)
    return lo, hi, lo


def assert_topk_rows(logits, lo, hi, shift, expected, actual, topk: int, what: str = "indices") -> None:
    """`actual` (and `expected`) are valid top-k results of the rows [lo, hi) of `logits`."""
    logits, expected, actual = logits.cpu(), expected.cpu(), actual.cpu()
    lo, hi, shift = lo.cpu().long(), hi.cpu().long(), shift.cpu().long()
    rows, k_cols = actual.shape
    width = logits.shape[1]
    assert actual.dtype == torch.int32 and actual.shape == expected.shape, f"{what}: {actual.dtype} {tuple(actual.shape)}"
    count = torch.minimum(hi - lo, torch.full_like(hi, topk))
    cols = torch.arange(k_cols)
    want = cols[None, :] < count[:, None]
    for name, res in (("expected", expected), ("actual", actual)):
        filled = res != -1
        bad = (filled != want).any(dim=1)
        assert not bad.any(), (
            f"{what} ({name}): the -1 tail is wrong in rows {bad.nonzero().flatten()[:8].tolist()}: "
            f"{count[bad][:8].tolist()} positions expected"
        )
    absolute = actual.long() + shift[:, None]
    inside = (absolute >= lo[:, None]) & (absolute < hi[:, None])
    bad = (want & ~inside).any(dim=1)
    assert not bad.any(), f"{what}: positions outside the valid range in rows {bad.nonzero().flatten()[:8].tolist()}"
    uniq = torch.where(want, absolute, -1 - cols[None, :]).sort(dim=1).values
    dup = (uniq[:, 1:] == uniq[:, :-1]).any(dim=1) if k_cols > 1 else torch.zeros(rows, dtype=torch.bool)
    assert not dup.any(), f"{what}: repeated positions in rows {dup.nonzero().flatten()[:8].tolist()}"
    if width == 0 or k_cols == 0:
        return
    keys = sortable_keys(logits)

    def chosen(res):
        col = (res.long() + shift[:, None]).clamp(0, width - 1)
        return torch.where(want, keys.gather(1, col), -1).sort(dim=1, descending=True).values

    diff = (chosen(actual) != chosen(expected)).any(dim=1)
    assert not diff.any(), (
        f"{what}: the chosen scores differ from the reference's in rows {diff.nonzero().flatten()[:8].tolist()}"
    )


def final_paths(meta, cand, plan, lo, hi, topk: int) -> list[str]:
    """The selection the Triton final program takes for each row, from the scratch the
    bound programs wrote (mirrors `_final_kernel`): "short", "registers", "list" or "row"
    (the exact select over the row itself, the slow fallback)."""
    meta, cand, lo, hi = meta.cpu().long(), cand.cpu().long(), lo.cpu().long(), hi.cpu().long()
    paths = []
    for r in range(meta.shape[0]):
        if int(hi[r] - lo[r]) <= topk:
            paths.append("short")
            continue
        w = meta[r, : plan.p1, 0] & 0xFFFFFFFF
        n_gt, n_eq = meta[r, : plan.p1, 1], meta[r, : plan.p1, 2]
        kept = torch.clamp(n_gt + n_eq, max=plan.reg)
        if bool((n_gt > plan.reg).any()) or int(kept.sum()) < topk:
            paths.append("row")
            continue
        keys = torch.cat([(cand[r, c * plan.reg : c * plan.reg + int(kept[c])] >> 32) & 0xFFFFFFFF for c in range(plan.p1)])
        t = int(keys.sort(descending=True).values[topk - 1])
        paths.append("row" if t < int(w.max()) else ("registers" if plan.in_registers else "list"))
    return paths


def compare_prefill(expected, actual, exp_args, act_args, params) -> None:
    assert expected is None and actual is None
    logits, starts, ends, idx_e, topk = exp_args
    idx_a = act_args[3]
    lo, hi, shift = prefill_ranges(starts.cpu(), ends.cpu(), logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, idx_e, idx_a, topk, "top_k_per_row_prefill indices")


def compare_decode(expected, actual, exp_args, act_args, params) -> None:
    assert expected is None and actual is None
    logits, next_n, seq_lens, idx_e, topk = exp_args
    idx_a = act_args[3]
    lo, hi, shift = decode_ranges(seq_lens.cpu(), next_n, logits.shape[1])
    assert_topk_rows(logits, lo, hi, shift, idx_e, idx_a, topk, "top_k_per_row_decode indices")


# -- unread elements, bounds out of range, non-finite logits ------------------------
def _unread(ranges):
    """`OpCase.unread`: every logit outside its row's valid columns, and all of `indices`
    (written, never read)."""

    def unread(params: Params, args):
        logits, indices = args[0], args[3]
        lo, hi, _ = ranges(args)
        cols = torch.arange(logits.shape[1])
        outside = (cols[None, :] < lo.cpu()[:, None]) | (cols[None, :] >= hi.cpu()[:, None])
        return [(0, outside), (3, torch.ones(indices.shape, dtype=torch.bool))]

    return unread


def _prefill_ranges_of(args):
    return prefill_ranges(args[1].cpu(), args[2].cpu(), args[0].shape[1])


def _decode_ranges_of(args):
    return decode_ranges(args[2].cpu(), args[1], args[0].shape[1])


def _replace_bounds(bounds: torch.Tensor, width: int, gen: torch.Generator, count: int):
    """(bad, clamped): `count` entries (at least one) replaced by 10**6, -5, -2 or width + 1,
    and the same entries set to the value they act as (0 or width)."""
    where = torch.randperm(bounds.shape[0], generator=gen)[: max(1, count)]
    choices = torch.tensor([10**6, -5, -2, width + 1], dtype=bounds.dtype)
    bad_values = choices[torch.randperm(4, generator=gen)][torch.arange(where.numel()) % 4]
    bad, clamped = bounds.clone(), bounds.clone()
    bad[where.to(bounds.device)] = bad_values.to(bounds.device)
    clamped[where.to(bounds.device)] = bad_values.clamp(0, width).to(bounds.device)
    return bad, clamped


def _prefill_out_of_range(params: Params, args, gen: torch.Generator):
    """`OpCase.out_of_range`: row starts and ends outside [0, N], paired with the bound
    they act as (the op clamps; there is no padding value)."""
    logits, starts, ends, indices, topk = args
    m, width = logits.shape
    if m == 0:
        return None
    bad_s, ok_s = _replace_bounds(starts, width, gen, m // 3)
    bad_e, ok_e = _replace_bounds(ends, width, gen, m // 3)
    return (logits, bad_s, bad_e, indices, topk), (logits, ok_s, ok_e, indices, topk)


def _decode_out_of_range(params: Params, args, gen: torch.Generator):
    """`OpCase.out_of_range`: sequence lengths outside [0, L], paired with 0 or L."""
    logits, next_n, seq_lens, indices, topk = args
    if seq_lens.shape[0] == 0:
        return None
    bad, ok = _replace_bounds(seq_lens, logits.shape[1], gen, seq_lens.shape[0] // 3)
    return (logits, next_n, bad, indices, topk), (logits, next_n, ok, indices, topk)


def _nonfinite(params: Params, args, gen: torch.Generator):
    """`OpCase.nonfinite`: NaN of both signs, +inf and -inf (about 4% each) in the logits."""
    logits = args[0]
    u = torch.rand(logits.shape, generator=gen).to(logits.device)
    nan = torch.tensor(float("nan"))
    x = torch.where(u < 0.04, nan, logits)
    x = torch.where((u >= 0.04) & (u < 0.08), -nan, x)  # sign bit set: ranks below -inf
    x = torch.where((u >= 0.08) & (u < 0.12), float("inf"), x)
    x = torch.where((u >= 0.12) & (u < 0.16), float("-inf"), x)
    out = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)
    out.copy_(x)
    return (out, *args[1:])


def _workspace_args(params: Params, args):
    """`OpCase.workspace_args`: the reservation from shapes (`spec.workspace_specs(num_rows=,
    width=, topk=)`, what the indexer composites reserve)."""
    logits, topk = args[0], args[4]
    rows, width = logits.shape
    return (), {"num_rows": rows, "width": width, "topk": topk}


# -- inputs -------------------------------------------------------------------------
def make_logits(rows: int, width: int, mode: str, device, gen, strided: bool = False) -> torch.Tensor:
    """Random logits; `mode` in VALUE_MODES (ties from a small value set, -inf sprinkled in)."""
    if mode == "normal":
        x = torch.randn(rows, width, generator=gen) * 3.0
    else:
        values = torch.tensor(TIE_VALUES)
        x = values[torch.randint(0, len(TIE_VALUES), (rows, width), generator=gen)]
        if mode == "ties":
            # A few distinct values too, so the K-th largest is not always a tie.
            noise = torch.randn(rows, width, generator=gen)
            x = torch.where(torch.rand(rows, width, generator=gen) < 0.2, noise, x)
    if mode == "ties_inf":
        x = torch.where(torch.rand(rows, width, generator=gen) < 0.3, float("-inf"), x)
    if mode == "neg_inf_rows":
        x = torch.randn(rows, width, generator=gen)
        x[::2] = float("-inf")  # every other row is all -inf: -inf still counts as a score
    if strided:
        big = torch.randn(rows, width + 7, generator=gen)
        big[:, :width] = x
        return big.to(device)[:, :width]
    return x.to(device)


def make_indices(rows: int, k: int, device, gen, strided: bool) -> torch.Tensor:
    if strided:
        return poison((rows, k + 5), torch.int32, device, gen)[:, :k]
    return poison((rows, k), torch.int32, device, gen)


def _prefill_bounds(m: int, n: int, mode: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    if mode == "full":
        return torch.zeros(m, dtype=torch.int32), torch.full((m,), n, dtype=torch.int32)
    if mode == "causal":
        # One request whose last m query tokens see a prefix of n - m keys (vLLM's ks/ke).
        ends = (torch.arange(m) + 1 + max(n - m, 0)).clamp(max=n)
        return torch.zeros(m, dtype=torch.int32), ends.to(torch.int32)
    if mode == "random":
        starts = torch.randint(0, n + 1, (m,), generator=gen)
        ends = starts + (torch.rand(m, generator=gen) * (n - starts + 1)).long()
        return starts.to(torch.int32), ends.clamp(max=n).to(torch.int32)
    # "wild": any bounds in [0, N], end < start (an empty row) too. Bounds outside
    # [0, N] are `_prefill_out_of_range`'s (the debug switch refuses them).
    starts = torch.randint(0, n + 1, (m,), generator=gen)
    ends = torch.randint(0, n + 1, (m,), generator=gen)
    return starts.to(torch.int32), ends.to(torch.int32)


def _params_prefill():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "M": st.integers(0, 5),
            "N": st.integers(0, 300),
            "topk": st.integers(0, 16),
            "extra_k": st.sampled_from([0, 0, 3]),
            "values": st.sampled_from(VALUE_MODES),
            "ranges": st.sampled_from(["random", "causal", "full", "wild"]),
            "strided": st.booleans(),
        }
    )


def _make_prefill(p: Params, device, gen):
    m, n, topk = p["M"], p["N"], p["topk"]
    logits = make_logits(m, n, p["values"], device, gen, p["strided"])
    starts, ends = _prefill_bounds(m, n, p["ranges"], gen)
    indices = make_indices(m, topk + p["extra_k"], device, gen, p["strided"])
    return logits, starts.to(device), ends.to(device), indices, topk


EXAMPLE_PREFILL: Params = {"M": 4, "N": 200, "topk": 12, "extra_k": 0, "values": "normal", "ranges": "causal", "strided": False}


def _bad_prefill(device, gen):
    logits, starts, ends, idx, topk = _make_prefill(EXAMPLE_PREFILL, device, gen)
    return [
        BadInput("logits float16", (logits.half(), starts, ends, idx, topk), "logits", "dtype"),
        BadInput("logits 1-D", (logits[0], starts, ends, idx, topk), "logits", "2-D"),
        BadInput("logits strided last dim", (logits.t().contiguous().t(), starts, ends, idx, topk), "logits", "contiguous"),
        BadInput("row_starts int64", (logits, starts.long(), ends, idx, topk), "row_starts", "dtype"),
        BadInput("row_ends of other M", (logits, starts, ends[1:], idx, topk), "row_ends", r"\[M\]"),
        BadInput("indices int64", (logits, starts, ends, idx.long(), topk), "indices", "dtype"),
        BadInput("indices of other M", (logits, starts, ends, idx[1:], topk), "indices", r"\[M, K\]"),
        BadInput("topk > K", (logits, starts, ends, idx, idx.shape[1] + 1), "topk", r"\[0, indices.shape\[1\]\]"),
        BadInput("topk < 0", (logits, starts, ends, idx, -1), "topk", "int in"),
    ]


register_case(
    OpCase(
        op="top_k_per_row_prefill",
        params=_params_prefill,
        example=EXAMPLE_PREFILL,
        make=_make_prefill,
        compare=compare_prefill,
        bad_inputs=_bad_prefill,
        unread=_unread(_prefill_ranges_of),
        out_of_range=_prefill_out_of_range,
        nonfinite=_nonfinite,
        # The comparison ranks by the float bits: NaN and +-inf compare exactly as they are.
        compare_nonfinite=compare_prefill,
        workspace_args=_workspace_args,
        edge_cases=(
            {**EXAMPLE_PREFILL, "M": 0},
            {**EXAMPLE_PREFILL, "N": 0},
            {**EXAMPLE_PREFILL, "topk": 0, "extra_k": 3},
            {**EXAMPLE_PREFILL, "N": 10, "topk": 16},  # every row shorter than topk
            {**EXAMPLE_PREFILL, "values": "ties", "ranges": "full", "strided": True},
            {**EXAMPLE_PREFILL, "values": "ties_inf", "ranges": "wild", "extra_k": 3},
            {**EXAMPLE_PREFILL, "values": "neg_inf_rows", "ranges": "random", "N": 300, "topk": 5},
        ),
        gpu_examples=(
            # One 8k-token request (causal): vLLM's prefill chunk with DeepSeek-V3.2's top-2048.
            {"M": 2048, "N": 8192, "topk": 2048, "extra_k": 0, "values": "normal", "ranges": "causal", "strided": False},
            {"M": 512, "N": 32768, "topk": 2048, "extra_k": 0, "values": "normal", "ranges": "random", "strided": True},
            {"M": 256, "N": 16384, "topk": 2048, "extra_k": 0, "values": "ties", "ranges": "full", "strided": False},
        ),
    )
)


def _params_decode():
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "B": st.integers(0, 4),
            "next_n": st.integers(1, 3),
            "L": st.integers(0, 300),
            "topk": st.integers(0, 16),
            "extra_k": st.sampled_from([0, 0, 3]),
            "values": st.sampled_from(VALUE_MODES),
            "lens": st.sampled_from(["random", "full", "short"]),
            "strided": st.booleans(),
        }
    )


def _seq_lens(b: int, next_n: int, width: int, mode: str, gen) -> torch.Tensor:
    if mode == "full":
        return torch.full((b,), width, dtype=torch.int32)
    if mode == "short":
        # Contexts of exactly next_n (row i sees i + 1 tokens) and other short ones.
        lens = torch.randint(0, next_n + 3, (b,), generator=gen)
        lens[::2] = next_n
        return lens.to(torch.int32)
    # Lengths past L are `_decode_out_of_range`'s (the debug switch refuses them).
    return torch.randint(0, width + 1, (b,), generator=gen).to(torch.int32)


def _make_decode(p: Params, device, gen):
    b, next_n, width, topk = p["B"], p["next_n"], p["L"], p["topk"]
    rows = b * next_n
    logits = make_logits(rows, width, p["values"], device, gen, p["strided"])
    seq_lens = _seq_lens(b, next_n, width, p["lens"], gen).to(device)
    indices = make_indices(rows, topk + p["extra_k"], device, gen, p["strided"])
    return logits, next_n, seq_lens, indices, topk


EXAMPLE_DECODE: Params = {"B": 3, "next_n": 2, "L": 250, "topk": 10, "extra_k": 0, "values": "normal", "lens": "random", "strided": False}


def _bad_decode(device, gen):
    logits, next_n, seq_lens, idx, topk = _make_decode(EXAMPLE_DECODE, device, gen)
    return [
        BadInput("logits float64", (logits.double(), next_n, seq_lens, idx, topk), "logits", "dtype"),
        BadInput("logits with B*next_n != rows", (logits[1:], next_n, seq_lens, idx[1:], topk), "logits", "B \\* next_n"),
        BadInput("next_n 0", (logits, 0, seq_lens, idx, topk), "next_n", ">= 1"),
        BadInput("seq_lens 2-D", (logits, next_n, seq_lens[:, None], idx, topk), "seq_lens", "1-D"),
        BadInput("seq_lens int64", (logits, next_n, seq_lens.long(), idx, topk), "seq_lens", "dtype"),
        BadInput("indices 1-D", (logits, next_n, seq_lens, idx[:, 0], topk), "indices", "2-D"),
        BadInput("topk > K", (logits, next_n, seq_lens, idx, idx.shape[1] + 1), "topk", "int in"),
        BadInput(
            "indices strided last dim",
            (logits, next_n, seq_lens, randint(0, 5, (idx.shape[1], idx.shape[0]), torch.int32, device, gen).t(), topk),
            "indices", "contiguous",
        ),
    ]


register_case(
    OpCase(
        op="top_k_per_row_decode",
        params=_params_decode,
        example=EXAMPLE_DECODE,
        make=_make_decode,
        compare=compare_decode,
        bad_inputs=_bad_decode,
        unread=_unread(_decode_ranges_of),
        out_of_range=_decode_out_of_range,
        nonfinite=_nonfinite,
        compare_nonfinite=compare_decode,
        workspace_args=_workspace_args,
        edge_cases=(
            {**EXAMPLE_DECODE, "B": 0},
            {**EXAMPLE_DECODE, "L": 0},
            {**EXAMPLE_DECODE, "topk": 0, "extra_k": 3},
            {**EXAMPLE_DECODE, "next_n": 1, "lens": "short"},
            {**EXAMPLE_DECODE, "next_n": 2, "lens": "short", "topk": 2},
            {**EXAMPLE_DECODE, "values": "ties", "lens": "full", "strided": True, "extra_k": 3},
            {**EXAMPLE_DECODE, "values": "ties_inf", "lens": "full", "L": 300, "topk": 6},
            {**EXAMPLE_DECODE, "values": "neg_inf_rows", "lens": "random"},
        ),
        gpu_examples=(
            # DeepSeek-V3.2 decode: top-2048 over max_model_len-wide paged logits.
            {"B": 128, "next_n": 1, "L": 32768, "topk": 2048, "extra_k": 0, "values": "normal", "lens": "random", "strided": False},
            {"B": 16, "next_n": 2, "L": 131072, "topk": 2048, "extra_k": 0, "values": "normal", "lens": "full", "strided": False},
            {"B": 1, "next_n": 1, "L": 131072, "topk": 2048, "extra_k": 0, "values": "normal", "lens": "full", "strided": True},
            {"B": 32, "next_n": 1, "L": 32768, "topk": 2048, "extra_k": 0, "values": "ties", "lens": "random", "strided": False},
            {"B": 8, "next_n": 2, "L": 65536, "topk": 2048, "extra_k": 0, "values": "ties_inf", "lens": "short", "strided": False},
        ),
    )
)


def rowwise_outcomes(meta) -> list[tuple[int, int]]:
    """(passes, outcome) of each row of the one-program-a-row decode kernel
    (kernels/triton_rowwise.py), from the state it leaves in `meta`: outcome 1 = its regions
    held a valid top-k (selected from them), 0 = too few entries, 2 = a region overflowed
    (the row is then selected exactly). Rows with at most topk valid entries keep
    whatever `meta` held: (-1, -1) when the caller filled it with -1."""
    code = meta[:, 0, 3].cpu().long()
    return [(-1, -1) if int(c) < 0 else ((int(c) >> 2) & 3, int(c) & 3) for c in code]


def rowwise_search(meta) -> list[tuple[int, bool]]:
    """(search rounds, whether the bin was moved to a small tile after the first) of each
    row's selection over the regions ((0, False): not selected there)."""
    code = meta[:, 0, 3].cpu().long()
    return [((max(int(c), 0) >> 5), bool((max(int(c), 0) >> 4) & 1)) for c in code]
