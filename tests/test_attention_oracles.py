"""The attention variants against the models that define them: gpt-oss's sinks and
Gemma-2's softcap as Hugging Face transformers computes them (`eager_attention_forward`),
with a sliding window of W tokens as those models mask it (key k visible from query q
when `0 <= q - k < W`, i.e. `window_left = W - 1`); and sparse_mla's `attn_sink` /
`topk_length` as FlashMLA documents them. Every op is called through the public entry
point, so the backend that serves it on this machine is what is checked."""

from __future__ import annotations

import types

import pytest
import torch

import graphsafe

transformers = pytest.importorskip("transformers")
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

HK, GROUP, D = 2, 2, 32
HQ = HK * GROUP


def _hf(q, k, v, q_pos, k_pos, window: int | None, sinks=None, softcap=None) -> torch.Tensor:
    """One sequence: q `[Lq, Hq, D]`, k/v `[Lk, Hk, D]` at absolute positions; HF's eager
    attention of gpt-oss (with sinks) or Gemma-2 (softcap), causal, optional window."""
    module = types.SimpleNamespace(num_key_value_groups=GROUP, training=False, head_dim=D,
                                   sinks=None if sinks is None else sinks.float())
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    args = (module, q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None], mask)
    if sinks is not None:
        out, _ = modeling_gpt_oss.eager_attention_forward(*args, scaling=D**-0.5)
    else:
        out, _ = modeling_gemma2.eager_attention_forward(*args, scaling=D**-0.5, softcap=softcap)
    return out[0]  # [Lq, Hq, D]


MODELS = [  # (window W or None, sinks, softcap)
    pytest.param(None, True, None, id="gpt-oss-full"),
    pytest.param(5, True, None, id="gpt-oss-sliding"),
    pytest.param(None, False, 3.0, id="gemma2-softcap"),
    pytest.param(7, False, 3.0, id="gemma2-sliding-softcap"),
]


def _options(window, sinks_on, softcap, gen):
    sinks = torch.randn(HQ, generator=gen) * 2 if sinks_on else None
    return (-1 if window is None else window - 1), (softcap or 0.0), sinks


@pytest.mark.parametrize("window, sinks_on, softcap", MODELS)
def test_varlen_matches_the_models(window, sinks_on, softcap):
    gen = torch.Generator().manual_seed(0)
    lens = [9, 1, 14]
    total = sum(lens)
    q, k, v = (torch.randn((total, h, D), generator=gen).half() for h in (HQ, HK, HK))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    window_left, cap, sinks = _options(window, sinks_on, softcap, gen)
    out = graphsafe.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), D**-0.5, True, None, None, None, "off",
                                      window_left, cap, sinks)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        pos = torch.arange(n)
        expected = _hf(q[rows], k[rows], v[rows], pos, pos, window, sinks, softcap)
        torch.testing.assert_close(out[rows].float(), expected, atol=2e-3, rtol=2e-3)


def _paged(gen, lens_k: list[int], block_size: int = 4):
    """A shuffled paged cache holding each sequence's keys, and the packed K/V it holds."""
    mb = max(-(-n // block_size) for n in lens_k)
    nb = len(lens_k) * mb
    k_cache, v_cache = (torch.randn((nb, block_size, HK, D), generator=gen).half() for _ in range(2))
    table = torch.randperm(nb, generator=gen).reshape(len(lens_k), mb).int()
    seqs = []
    for b, n in enumerate(lens_k):
        pos = torch.arange(n)
        blocks = table[b, pos // block_size].long()
        seqs.append((k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size]))
    return k_cache, v_cache, table, torch.tensor(lens_k, dtype=torch.int32), seqs


@pytest.mark.parametrize("window, sinks_on, softcap", MODELS)
def test_paged_decode_matches_the_models(window, sinks_on, softcap):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table, lens, seqs = _paged(gen, [11, 1, 16])
    q = torch.randn((3, HQ, D), generator=gen).half()
    window_left, cap, sinks = _options(window, sinks_on, softcap, gen)
    out = graphsafe.paged_attention_decode(q, k_cache, v_cache, table, lens, D**-0.5, None, None, window_left, cap,
                                           sinks)
    for b, (keys, values) in enumerate(seqs):
        n = keys.shape[0]
        expected = _hf(q[b:b + 1], keys, values, torch.tensor([n - 1]), torch.arange(n), window, sinks, softcap)
        torch.testing.assert_close(out[b:b + 1].float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("window, sinks_on, softcap", MODELS)
def test_paged_prefill_matches_the_models(window, sinks_on, softcap):
    """Chunked prefill: each sequence's new tokens are its last ones in the cache."""
    gen = torch.Generator().manual_seed(2)
    lens_k, lens_q = [13, 6, 20], [5, 6, 1]
    k_cache, v_cache, table, seq_lens, seqs = _paged(gen, lens_k)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((sum(lens_q), HQ, D), generator=gen).half()
    window_left, cap, sinks = _options(window, sinks_on, softcap, gen)
    out = graphsafe.paged_attention_prefill(q, k_cache, v_cache, table, seq_lens, cu, max(lens_q), D**-0.5, True,
                                            None, None, window_left, cap, sinks)
    for b, ((keys, values), n_q) in enumerate(zip(seqs, lens_q)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n_k = keys.shape[0]
        expected = _hf(q[rows], keys, values, torch.arange(n_k - n_q, n_k), torch.arange(n_k), window, sinks,
                       softcap)
        torch.testing.assert_close(out[rows].float(), expected, atol=2e-3, rtol=2e-3)


def test_sparse_mla_options_are_flashmlas():
    """`attn_sink`: out scaled by exp(lse) / (exp(lse) + exp(sink)), lse unchanged (+inf:
    0, -inf: unchanged); `topk_length`: the entries right of it act as -1."""
    gen = torch.Generator().manual_seed(3)
    t, h, r, p, k = 4, 3, 32, 16, 20
    q = torch.randn((t, h, r + p), generator=gen).half()
    kv = torch.randn((6, 4, r + p), generator=gen).half()
    idx = torch.randint(0, 24, (t, k), generator=gen).int()
    length = torch.tensor([0, 3, 20, 11], dtype=torch.int32)
    sink = torch.tensor([0.5, float("inf"), float("-inf")])
    out, lse = graphsafe.sparse_mla(q, kv, idx, 0.1, r, sink, length)
    cut = torch.where(torch.arange(k)[None, :] < length[:, None], idx, -1)
    plain_out, plain_lse = graphsafe.sparse_mla(q, kv, cut, 0.1, r)
    torch.testing.assert_close(lse, plain_lse)
    kept = torch.where(plain_lse.isinf(), 0.0, plain_lse.exp() / (plain_lse.exp() + sink.exp()))
    torch.testing.assert_close(out.float(), plain_out.float() * kept[..., None], atol=1e-3, rtol=1e-3)
    assert (out[:, 1] == 0).all() and torch.equal(out[1:, 2], plain_out[1:, 2])
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()

