"""The demo model with DeepSeek's FP8 MLA cache (`ModelConfig.kv_cache_dtype = "fp8_ds_mla"`)
against the same weights with the bf16 cache. CPU.

What needs which backend: the accuracy tests run the ops' reference backend (named
explicitly: the executable spec of the fp8_ds_mla reads and writes); the last test runs
the ops that touch the cache (`concat_and_cache_mla`, `sparse_mla`) on their Triton
kernels through the interpreter and compares with the reference.

Accuracy bound. Only the latent cache differs between the two models: each latent value
is stored as e4m3 after scaling its 128-value tile to +-448, a relative rounding of at
most 2^-4 (3 mantissa bits; values below e4m3's normal range, 2^-6 of the scaled
range, lose at most 2^-10 of the tile's scale instead), the rope values stay bf16. The
attention over such keys and values moves its output by O(2^-4) relatively (scores and
values each carry the error), and the remaining layers pass that on at about unit gain
(the random model keeps activations of order one, `random_hf_state_dict`). So the
logits of each decode row are held to a relative error (L2, and max |diff| / max
|logits|) of 2^-4; the rounding errors of many values partly average out: measured at
most 2.6%, under half the bound (ModelConfig.kv_cache_dtype's comment gives the numbers).
Greedy picks: a pick flips only where the bf16 cache's top two logits are closer than
twice the logit error, which for this random model (logit gaps of a few % of the top
logit are common) happens at some positions: at least 3/4 of the decode positions must
agree (measured: see ModelConfig.kv_cache_dtype).
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.models import ModelConfig, build_demo_model, demo_hf_config
from graphsafe.models.precision import compare_decoding
from graphsafe.formats.fp8_ds_mla import dequantize_records, record_bytes

E4M3_REL = 2.0**-4  # e4m3's relative rounding: 3 mantissa bits
LOGIT_REL_BOUND = E4M3_REL
MIN_AGREE = 0.75
# The demo model with a latent width that has an fp8_ds_mla layout (R = 128, P = 16:
# 164-byte records) and an index_topk that keeps every key of these contexts, so the
# indexer's selection cannot differ between the two models.
SHAPES = {"kv_lora_rank": 128, "index_topk": 64, "max_batch": 4, "max_model_len": 64}


def _pair(seed: int = 0, dtype=torch.bfloat16, **overrides):
    kw = {**SHAPES, **overrides}
    bf16, _ = build_demo_model("cpu", dtype, seed=seed, with_hf=False, **kw)
    fp8, _ = build_demo_model("cpu", dtype, seed=seed, with_hf=False, kv_cache_dtype="fp8_ds_mla", **kw)
    return bf16, fp8


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- configuration ---------------------------------------------------------------------------
def test_config_refuses_what_has_no_record_layout():
    cfg = demo_hf_config(kv_lora_rank=128)
    assert ModelConfig.from_hf(cfg).kv_cache_dtype == "auto"
    assert ModelConfig.from_hf(cfg, kv_cache_dtype="fp8_ds_mla").kv_cache_dtype == "fp8_ds_mla"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_ds_mla'.*kv_lora_rank=64"):
        ModelConfig.from_hf(demo_hf_config(), kv_cache_dtype="fp8_ds_mla")  # the demo's R = 64
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_ds_mla'.*qk_rope_head_dim=15"):
        ModelConfig.from_hf(demo_hf_config(kv_lora_rank=128, qk_rope_head_dim=15), kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        ModelConfig.from_hf(cfg, kv_cache_dtype="fp8")
    # The bf16 cache keeps accepting any latent width (the demo's 64 included).
    assert ModelConfig.from_hf(demo_hf_config()).kv_lora_rank == 64


def test_caches_are_records_of_the_layout_and_bytes_per_token_count_them():
    bf16, fp8 = _pair()
    r, p, layers = 128, 16, bf16.cfg.num_layers
    assert fp8.cfg.kv_cache_dtype == "fp8_ds_mla" and bf16.cfg.kv_cache_dtype == "auto"
    for a, b in zip(bf16.layers, fp8.layers):
        assert a.kv_cache.dtype == torch.bfloat16 and a.kv_cache.shape[-1] == r + p
        assert b.kv_cache.dtype == torch.uint8 and b.kv_cache.shape == (*a.kv_cache.shape[:2], record_bytes(r, p))
        assert b.index_cache.shape == a.index_cache.shape, "the indexer cache does not depend on the kind"
    assert record_bytes(r, p) == 164
    with pytest.raises(ValueError, match="needs the model dtype bfloat16"):
        build_demo_model("cpu", torch.float16, with_hf=False, kv_cache_dtype="fp8_ds_mla", **SHAPES)
    assert bf16.cache_bytes_per_token() == layers * (r + p) * 2
    assert fp8.cache_bytes_per_token() == layers * 164


# -- accuracy (reference backend) --------------------------------------------------------------
def test_layer0_cache_holds_the_bf16_latent_to_e4m3_rounding():
    """After the same prefill, layer 0 (whose inputs are the same in both models) holds in
    its fp8 cache the bf16 cache's rope values exactly and its latent values to e4m3
    rounding of the tile-scaled values: |x' - x| <= 2^-4 |x| + 2^-10 scale."""
    bf16, fp8 = _pair()
    prompts = _prompts([9, 20, 14])
    with graphsafe.use_backend("reference"):
        for model in (bf16, fp8):
            model.prefill(model.new_state(), prompts)
    r = 128
    want = bf16.layers[0].kv_cache.float()
    got = dequantize_records(fp8.layers[0].kv_cache, r)
    written = want.abs().amax(-1) > 0
    assert int(written.sum()) == sum(len(p) for p in prompts)
    want, got = want[written], got[written]
    assert torch.equal(got[:, r:], want[:, r:]), "rope values are stored as bf16"
    scale = want[:, :r].abs().amax(-1, keepdim=True) / 448  # one 128-value tile: R = 128
    err = (got[:, :r] - want[:, :r]).abs()
    # (1 + 2^-20): the float32 division and product around the e4m3 rounding.
    assert bool((err <= (E4M3_REL * want[:, :r].abs() + 2.0**-10 * scale) * (1 + 2.0**-20)).all())
    assert float(err.max()) > 0, "the latent went through e4m3"


def test_decode_logits_and_greedy_picks_against_the_bf16_cache():
    """Teacher-forced decoding (both models fed the bf16 cache's picks): the prompt's
    last logits come from the dense prefill, which never reads the cache (equal); every
    decode row within the bound of the module docstring, greedy picks agreeing at
    MIN_AGREE of the decode positions or more."""
    bf16, fp8 = _pair()
    prompts = _prompts([20, 9, 14])
    steps = 6
    with graphsafe.use_backend("reference"):
        result = compare_decoding(bf16, fp8, prompts, steps)
        first = [m.prefill(m.new_state(), prompts) for m in (bf16, fp8)]
    assert torch.equal(first[0], first[1]), "the dense prefill does not read the cache"
    stats = result["b_vs_a"]
    print(f"\nfp8_ds_mla vs bf16 cache, {len(prompts)} rows x {steps} decode steps: {stats}")
    assert stats["rel_l2_max"] <= LOGIT_REL_BOUND, stats
    assert stats["peak_err_max"] <= LOGIT_REL_BOUND, stats
    assert stats["rel_l2_median"] > 0, "the fp8 cache changes the decode logits"
    positions = len(prompts) * (steps + 1)
    decode_agree = (stats["agree"] * positions - len(prompts)) / (len(prompts) * steps)
    assert decode_agree >= MIN_AGREE, stats


def test_sparse_prefill_reads_the_fp8_cache():
    """Prompts longer than index_topk take the sparse prefill (`sparse_mla` over the
    cache). One layer: the indexer's selection is the same in both models (its inputs
    precede the attention), so only the cache's rounding separates the logits."""
    bf16, fp8 = _pair(seed=1, num_hidden_layers=1, index_topk=8)
    prompts = _prompts([20, 13], seed=1)
    with graphsafe.use_backend("reference"):
        want, got = (m.prefill(m.new_state(), prompts) for m in (bf16, fp8))
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert bool((rel > 0).all()) and bool((rel <= LOGIT_REL_BOUND).all()), rel


# -- Triton kernels (interpreter) ----------------------------------------------------------------
# The ops that read or write the latent cache. The fp8_ds_mla cache goes with bf16 queries
# only, and of the model's other kernels only the MLA one has the interpreter's bf16 tl.dot
# workaround, so the rest stay on the reference backend.
CACHE_OPS = ["concat_and_cache_mla", "sparse_mla"]


def test_triton_cache_ops_with_the_fp8_cache_match_the_reference():
    """The fp8_ds_mla model's prefill (dense and sparse requests) and decode step with
    the cache ops on their Triton kernels (interpreter) against the reference backend
    from the same caches: the same cache bytes written, logits within bf16 rounding."""
    model, _ = build_demo_model("cpu", torch.bfloat16, seed=4, with_hf=False, kv_cache_dtype="fp8_ds_mla",
                                kv_lora_rank=128, num_hidden_layers=1, index_topk=8, max_batch=3, max_model_len=32)
    prompts = _prompts([11, 3, 12], seed=4)  # 11 and 12 take the sparse prefill, 3 the dense one
    snapshot = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]

    def restore(saved):
        for layer, (kv, index) in zip(model.layers, saved):
            layer.kv_cache.copy_(kv)
            layer.index_cache.copy_(index)

    with graphsafe.use_backend("reference"):
        want_prefill = model.prefill(model.new_state(), prompts)
    want_caches = [layer.kv_cache.clone() for layer in model.layers]
    restore(snapshot)
    with graphsafe.use_backend("triton", ops=CACHE_OPS):
        state = model.new_state()
        got_prefill = model.prefill(state, prompts)
    for layer, want in zip(model.layers, want_caches):
        assert torch.equal(layer.kv_cache, want), "the Triton write stores the reference's records"
    _check_close(got_prefill, want_prefill)
    inputs = model.decode_inputs(state, got_prefill.argmax(-1))
    before = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]
    with graphsafe.use_backend("reference"):
        want = model.decode_step(inputs)
    restore(before)
    with graphsafe.use_backend("triton", ops=CACHE_OPS):
        got = model.decode_step(inputs)
    _check_close(got, want)


def _check_close(got, want):
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    tol = 4 * 2.0**-8 * want.abs().amax(-1)  # four bf16 unit roundoffs of the row's largest logit
    assert bool(((got - want).abs().amax(-1) <= tol).all())


# -- GPU (Triton kernels; skipped without a CUDA/HIP device) --------------------------------------
@pytest.mark.gpu
def test_gpu_fp8_cache_at_deepseek_head_shapes_against_the_bf16_cache():
    """DeepSeek's latent and rope widths (R = 512, P = 64: 656-byte records), 16 heads,
    on the GPU's kernels: the bounds of the CPU test over 8 teacher-forced decode steps."""
    shapes = dict(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
        index_topk=1024, vocab_size=2048, max_model_len=1024, block_size=64, max_batch=8,
    )
    bf16, _ = build_demo_model("cuda", torch.bfloat16, seed=5, with_hf=False, **shapes)
    fp8, _ = build_demo_model("cuda", torch.bfloat16, seed=5, with_hf=False, kv_cache_dtype="fp8_ds_mla", **shapes)
    assert fp8.cache_bytes_per_token() == 2 * 656
    prompts = _prompts([700, 300, 64, 9], seed=5, vocab=2048)
    stats = compare_decoding(bf16, fp8, prompts, 8)["b_vs_a"]
    print(stats)
    assert 0 < stats["rel_l2_median"] and stats["rel_l2_max"] <= LOGIT_REL_BOUND, stats
    assert stats["peak_err_max"] <= LOGIT_REL_BOUND, stats
    assert stats["agree"] >= MIN_AGREE, stats
