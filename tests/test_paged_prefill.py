"""`paged_attention_prefill` beyond the contract, on the CPU (Triton's interpreter, float16
and fp8 caches at tiny shapes): the Triton kernel against `flash_attn_varlen` over the same
keys packed, against `paged_attention_decode` for one query per sequence, against an
independent float64 loop on mixed batches, and the sliding window's skipped blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

import graphsafe
from graphsafe.ops.attention import reference
from graphsafe.ops.attention.cases import attention_compare

HAS_INTERPRETER = graphsafe.get_op("paged_attention_prefill").available_backends("cpu").count("triton") == 1
pytestmark = pytest.mark.skipif(not HAS_INTERPRETER, reason="Triton interpreter not enabled")
FP8 = torch.float8_e4m3fn


def _kernel(*args, config=None):
    from graphsafe.ops.attention import triton as T

    return T.paged_attention_prefill(*args, config=config)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _paged(keys: torch.Tensor, values: torch.Tensor, lens_k: list[int], block_size: int, gen, spare: int = 2):
    """Packed keys/values `[Tk, Hk, Dx]` (sequence b: `lens_k[b]` rows in order) written
    into caches of shuffled blocks: (k_cache, v_cache, block_table). Blocks no sequence
    owns hold NaN; table entries past a sequence's last block are -1."""
    mb = max(1, max((math.ceil(n / block_size) for n in lens_k), default=1))
    nb = len(lens_k) * mb + spare
    order = torch.randperm(nb, generator=gen)
    table = torch.full((len(lens_k), mb), -1, dtype=torch.int32)
    k_cache = torch.full((nb, block_size, *keys.shape[1:]), float("nan"), dtype=keys.dtype)
    v_cache = torch.full((nb, block_size, *values.shape[1:]), float("nan"), dtype=values.dtype)
    start = 0
    for b, n in enumerate(lens_k):
        used = math.ceil(n / block_size)
        table[b, :used] = order[b * mb : b * mb + used].int()
        pos = torch.arange(n)
        blocks = table[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = keys[start : start + n]
        v_cache[blocks, pos % block_size] = values[start : start + n]
        start += n
    return k_cache, v_cache, table


def _variant_args(variant: str, hq: int, gen):
    """(window_left, softcap, sinks) of a named variant."""
    sinks = torch.randn(hq, generator=gen) * 2
    return {
        "plain": (-1, 0.0, None),
        "window": (3, 0.0, None),
        "all": (5, 2.0, sinks),
        "sinks": (-1, 0.0, sinks),
        "softcap": (-1, 0.5, None),
    }[variant]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["plain", "window", "all"])
def test_equals_varlen_over_the_packed_keys(block_size, causal, variant):
    """A cache that holds exactly the packed K/V of `flash_attn_varlen` (chunks after a
    prefix, a whole prompt, a sequence with fewer keys than queries, an empty one):
    the same result (up to the kernels' P rounding)."""
    gen = torch.Generator().manual_seed(11 + block_size)
    hk, group, d = 2, 3, 16
    lens_q, lens_k = [4, 9, 0, 6], [11, 9, 5, 3]
    q = torch.randn(sum(lens_q), hk * group, d, generator=gen).half()
    k = torch.randn(sum(lens_k), hk, d, generator=gen).half()
    v = torch.randn(sum(lens_k), hk, d, generator=gen).half()
    k_cache, v_cache, table = _paged(k, v, lens_k, block_size, gen)
    cu_q, cu_k, scale = _cu(lens_q), _cu(lens_k), d**-0.5
    variants = _variant_args(variant, hk * group, gen)
    out = _kernel(q, k_cache, v_cache, table, torch.tensor(lens_k, dtype=torch.int32), cu_q, max(lens_q), scale,
                  causal, None, None, *variants)
    want = reference.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal, None, None,
                                       None, "off", *variants)
    attention_compare(want, out, v.abs().max().item(), torch.float16, False, 0, "paged prefill vs varlen")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_one_query_per_sequence_is_a_decode(causal, variant, fp8_cache):
    """Every len_q = 1 (causal or not: the query is the last token) equals
    `paged_attention_decode` on the same cache, padding blocks and junk entries included."""
    gen = torch.Generator().manual_seed(3)
    b, hk, group, d, bs, mb = 4, 2, 4, 32, 4, 5
    nb = b * mb + 1
    cache_dtype = FP8 if fp8_cache else torch.float16
    q = torch.randn(b, hk * group, d, generator=gen).half()
    k_cache = torch.randn(nb, bs, hk, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(nb, bs, hk, d, generator=gen).to(cache_dtype)
    table = torch.randperm(nb, generator=gen)[: b * mb].reshape(b, mb).int()
    table[1, 1] = -1  # a padding block inside sequence 1
    table[3, 2:] = torch.tensor([-7, 10**6, nb], dtype=torch.int32)  # past sequence 3's end: never read
    seq_lens = torch.tensor([1, 17, 0, 8], dtype=torch.int32)
    scales = (torch.tensor([0.7]), torch.tensor([0.6])) if fp8_cache else (None, None)
    variants = _variant_args(variant, hk * group, gen)
    out = _kernel(q, k_cache, v_cache, table, seq_lens, _cu([1] * b), 1, d**-0.5, causal, *scales, *variants)
    want = reference.paged_attention_decode(q, k_cache, v_cache, table, seq_lens, d**-0.5, *scales, *variants)
    vmax = v_cache.float().abs().max().item() * (scales[1].item() if fp8_cache else 1.0)
    attention_compare(want, out, vmax, torch.float16, False, 0, "paged prefill vs decode")
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no key


def _naive(q, k_cache, v_cache, table, seq_lens, cu_q, scale, causal, window, softcap, sinks, k_scale, v_scale):
    """Float64 loops over sequences, rows and heads (independent of the reference's
    padded tensors): softmax over the visible keys, the sink in the normaliser."""
    hq, dv = q.shape[1], v_cache.shape[3]
    nb, bs, hk = k_cache.shape[:3]
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)
    for b in range(len(seq_lens)):
        start, end, len_k = int(cu_q[b]), int(cu_q[b + 1]), int(seq_lens[b])
        pos = torch.arange(len_k)
        ids = table[b, pos // bs].long()
        exists = (ids >= 0) & (ids < nb)
        keys = k_cache[ids.clamp(0, nb - 1), pos % bs].double() * ks
        vals = v_cache[ids.clamp(0, nb - 1), pos % bs].double() * vs
        for i in range(end - start):
            p = i + len_k - (end - start)
            seen = exists & ((pos <= p) if causal else True) & ((pos >= p - window) if window >= 0 else True)
            if not seen.any():
                continue
            for h in range(hq):
                s = keys[seen, h // (hq // hk)] @ q[start + i, h].double() * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                e = torch.exp(s - s.max())
                denom = e.sum() + (math.exp(float(sinks[h]) - float(s.max())) if sinks is not None else 0.0)
                out[start + i, h] = e @ vals[seen, h // (hq // hk)] / denom
    return out


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("variant", ["plain", "window", "all", "sinks", "softcap"])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_mixed_batch_against_loops(block_size, variant, fp8_cache):
    """Decodes, chunks after cached prefixes, a whole prompt and an empty sequence in one
    batch, q rows before the first sequence and after the last (NaN: never read, output
    0), against float64 loops."""
    gen = torch.Generator().manual_seed(5 + block_size)
    hk, group, d, dv = 2, 2, 16, 32
    lens_q, seq_lens = [1, 7, 13, 0, 1], [9, 20, 13, 6, 1]
    lead, tail = 2, 3
    mb = math.ceil(max(seq_lens) / block_size)
    nb = len(seq_lens) * mb + 1
    cache_dtype = FP8 if fp8_cache else torch.float16
    q = torch.randn(lead + sum(lens_q) + tail, hk * group, d, generator=gen).half()
    q[:lead] = float("nan")
    q[lead + sum(lens_q):] = float("nan")
    k_cache = torch.randn(nb, block_size, hk, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(nb, block_size, hk, dv, generator=gen).to(cache_dtype)
    table = torch.randperm(nb, generator=gen)[: len(seq_lens) * mb].reshape(-1, mb).int()
    cu_q = _cu(lens_q) + lead
    scales = (torch.tensor([0.8]), torch.tensor([0.5])) if fp8_cache else (None, None)
    variants = _variant_args(variant, hk * group, gen)
    args = (q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), cu_q)
    want = _naive(*args, d**-0.5, True, *variants, *scales)
    vmax = v_cache.float().abs().max().item() * (scales[1].item() if fp8_cache else 1.0)
    for config in ((16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)):
        out = _kernel(*args, max(lens_q), d**-0.5, True, *scales, *variants, config=config)
        attention_compare(want.half(), out, vmax, torch.float16, False, 0, f"mixed batch, config {config}")
        outside = torch.cat([out[:lead], out[-tail:]])
        assert torch.equal(outside, torch.zeros_like(outside))


@pytest.mark.parametrize("group", [3, 32])
def test_groups_that_do_not_fill_the_rows(group):
    """A group that is not a power of two (rows past BLOCK_Q * GROUP idle) and one larger
    than BLOCK_M (raised to the group): the reference's result."""
    gen = torch.Generator().manual_seed(group)
    hk, d, bs = 1, 16, 4
    lens_q, seq_lens = [6, 1], [10, 3]
    q = torch.randn(sum(lens_q), hk * group, d, generator=gen).half()
    k_cache = torch.randn(7, bs, hk, d, generator=gen).half()
    v_cache = torch.randn(7, bs, hk, d, generator=gen).half()
    table = torch.tensor([[3, 0, 5], [6, -1, -1]], dtype=torch.int32)
    args = (q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), _cu(lens_q), 6, d**-0.5, True)
    want = reference.paged_attention_prefill(*args, window_left=4)
    out = _kernel(*args, None, None, 4, config=(16, 16, 4, 1))
    attention_compare(want, out, v_cache.abs().max().item(), torch.float16, False, 0, f"group {group}")


@pytest.mark.parametrize("causal", [True, False])
def test_window_skips_whole_blocks_and_their_table_entries(causal):
    """Blocks wholly before the first query row's window are never read, nor their table
    entries: pointing those entries at a NaN-filled block (or any id) and filling the
    tokens before the window with NaN leaves the output bit for bit unchanged."""
    gen = torch.Generator().manual_seed(9)
    hk, group, d, bs, window = 2, 2, 16, 4, 5
    lens_q, seq_lens = [3, 8], [30, 21]  # first rows at positions 27 and 13: windows from 22 and 8
    mb, nb = 8, 18
    q = torch.randn(sum(lens_q), hk * group, d, generator=gen).half()
    k_cache = torch.randn(nb, bs, hk, d, generator=gen).half()
    v_cache = torch.randn(nb, bs, hk, d, generator=gen).half()
    table = (torch.randperm(nb - 1, generator=gen)[: 2 * mb] + 1).reshape(2, mb).int()
    k_cache[0] = v_cache[0] = float("nan")  # block 0: no sequence's
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (lens, _cu(lens_q), max(lens_q), d**-0.5, causal, None, None, window)
    clean = _kernel(q, k_cache, v_cache, table, *args)

    junk_table, junk_k, junk_v = table.clone(), k_cache.clone(), v_cache.clone()
    for b, first in enumerate((seq_lens[0] - lens_q[0] - window, seq_lens[1] - lens_q[1] - window)):
        junk_table[b, : first // bs] = torch.tensor([0, -1, 10**6, -3, 0, 0, 0, 0])[: first // bs].int()
        pos = torch.arange(first)  # tokens before the window, in the clean table's blocks
        blocks = table[b, pos // bs].long()
        junk_k[blocks, pos % bs] = float("nan")
        junk_v[blocks, pos % bs] = float("nan")
    out = _kernel(q, junk_k, junk_v, junk_table, *args)
    assert torch.equal(out, clean)
    assert not out.isnan().any()
    want = reference.paged_attention_prefill(q, k_cache, v_cache, table, *args)
    attention_compare(want, out, v_cache[1:].abs().max().item(), torch.float16, False, 0, "window")


def test_registered_triton_backend_serves_the_variants():
    """The dispatcher's Triton backend takes every variant (no predicate hands them to
    the reference): the same as the direct call."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 4, 16, generator=gen).half()
    k_cache = torch.randn(4, 4, 2, 16, generator=gen).half()
    v_cache = torch.randn(4, 4, 2, 16, generator=gen).half()
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    args = (q, k_cache, v_cache, table, torch.tensor([11], dtype=torch.int32), _cu([5]), 5, 0.25, True,
            None, None, 2, 1.5, torch.randn(4, generator=gen))
    spec = graphsafe.get_op("paged_attention_prefill")
    assert spec.backends["triton"].supports is None
    with graphsafe.use_backend("triton"):
        out = graphsafe.paged_attention_prefill(*args)
    assert torch.equal(out, _kernel(*args))


def test_kernel_keeps_max_len_a_runtime_int():
    """Triton specialises an int argument equal to 1 into a constant; with `max_len` (the
    block table's capacity in tokens) specialised to 1, the ptxas of Triton 3.6 segfaults
    on the paged prefill kernel at 3 stages (reproduced for sm_90a; Triton 3.9's ptxas
    does not). The edge case of one block of one token runs the kernel there on a GPU."""
    from graphsafe.ops.attention.kernels import triton_paged_prefill as kernels

    kernel = kernels._paged_prefill_kernel
    # A JITFunction keeps the list itself; under the interpreter, the decorator's kwargs.
    names = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
    assert list(names) == ["max_len"]
