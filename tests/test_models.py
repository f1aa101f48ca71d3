"""The DeepSeek-V3.2-style model (graphsafe.models) against transformers' eager forward,
and its decode step under torch.compile. CPU (reference backends).

Tolerance of the bf16/fp16 oracle ((a), full top-k): per step,
    max |logits_graphsafe - logits_transformers| <= 4 u max |logits|,
u = 2^-8 (bf16) or 2^-11 (fp16), the unit roundoff. Both models round every activation to
the model dtype, in different orders (fused GEMMs; absorbed MLA in the latent space for
decode), so each carries its own O(u) relative error; logits are the last of ~12 rounded
layers of matmuls. The measured difference is 1 to 2 u max|logits|; the test also checks
the error against transformers' float32 forward of the same (rounded) weights: graphsafe is
no further from it than 2x transformers' own low-precision error plus u max|logits|. With
index_topk at least the context, the indexer keeps every causal key whatever its fp8
scores, so the fp8 indexer cannot change anything: the selection is exact.

(b), small index_topk: the fp8 indexer and transformers' float32 scores select different
keys at near-ties of the k-th score, and the random model amplifies one swapped key into
logits that differ by whole units, so greedy runs diverge. The test measures the
agreement over seeds and checks that every selection difference is explained by fp8
error: for a swap (a chosen by graphsafe only, b by transformers only) the exact scores
satisfy s[b] - s[a] <= E[a] + E[b], with E a rigorous bound on the fp8 score error
computed from transformers' own queries and keys (module `_fp8_score_bound`).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import graphsafe
from graphsafe.metadata import build_prefill
from graphsafe.models.layers import quant_fp8_per_head
from graphsafe.formats.indexer_k import dequantize, quantize, unpack
from graphsafe.models import DeepseekV32Model, ModelConfig, build_demo_model, demo_hf_config, random_hf_state_dict
from graphsafe.models.weights import hf_param_shapes

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
STEPS = 16


def _need_transformers():
    return pytest.importorskip("transformers", minversion="5.17")


def _prompts(seed, lengths, vocab=512):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(model, prompts, steps=STEPS):
    """graphsafe greedy decoding: (tokens [R][steps + 1], logits [R][steps + 1, V])."""
    state = model.new_state()
    logits = model.prefill(state, prompts)
    tok = logits.argmax(-1)
    toks, outs = [tok], [logits]
    for _ in range(steps):
        inputs = model.decode_inputs(state, tok)
        logits = model.decode_step(inputs)
        model.advance(state, tok)
        tok = logits.argmax(-1)
        toks.append(tok)
        outs.append(logits)
    toks = torch.stack(toks, 1)
    outs = torch.stack(outs, 1)
    return [toks[r].tolist() for r in range(len(prompts))], [outs[r] for r in range(len(prompts))]


@torch.no_grad()
def teacher_forced(hf, prompt, tokens):
    """transformers' logits at the prompt's last position and at each fed token."""
    ids = torch.tensor([prompt + tokens[:-1]])
    return hf(ids).logits[0, len(prompt) - 1 :].float()


def _tolerance(dtype, ref):
    return 4 * UNIT_ROUNDOFF[dtype] * ref.abs().amax(-1)


def _check_steps(got, ref_lp, ref32, dtype, steps=None):
    """Per step (rows): the oracle tolerance, and graphsafe's error to float32 at most 2x
    transformers' own plus u max|logits|."""
    steps = range(got.shape[0]) if steps is None else steps
    for s in steps:
        tol = float(_tolerance(dtype, ref32[s]))
        diff = float((got[s] - ref_lp[s]).abs().max())
        assert diff <= tol, f"step {s}: |graphsafe - transformers| = {diff:.4f} > {tol:.4f}"
        ours = float((got[s] - ref32[s]).abs().max())
        theirs = float((ref_lp[s] - ref32[s]).abs().max())
        u_max = UNIT_ROUNDOFF[dtype] * float(ref32[s].abs().max())
        assert ours <= 2 * theirs + u_max, f"step {s}: error to float32 {ours:.4f} vs transformers' {theirs:.4f}"


def _check_tokens(tokens, ref_lp, dtype, steps=None, allowed=1):
    """graphsafe's greedy token equals transformers' argmax at each step; a difference is
    allowed only as a tie at this precision (top-2 margin within twice the tolerance),
    and at most `allowed` times."""
    steps = range(len(tokens)) if steps is None else steps
    ties = []
    for s in steps:
        want = int(ref_lp[s].argmax())
        if tokens[s] != want:
            top2 = ref_lp[s].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin <= 2 * float(_tolerance(dtype, ref_lp[s])), f"step {s}: token {tokens[s]} vs {want}"
            ties.append(s)
    assert len(ties) <= allowed, f"tokens differ at steps {ties}"


# -- weights and config ---------------------------------------------------------------------------
def test_random_state_dict_loads_strictly_into_transformers():
    _need_transformers()
    from graphsafe.models import build_hf_model

    cfg = demo_hf_config()
    sd = random_hf_state_dict(ModelConfig.from_hf(cfg))
    hf = build_hf_model(cfg, sd, torch.float32)  # strict: names and shapes must match
    assert set(hf.state_dict()) == set(sd)


def test_from_hf_refuses_what_the_model_does_not_implement():
    cfg = demo_hf_config()
    with pytest.raises(NotImplementedError, match="dense MLP"):
        ModelConfig.from_hf({**cfg, "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(NotImplementedError, match="q_lora_rank"):
        ModelConfig.from_hf({**cfg, "q_lora_rank": None})
    with pytest.raises(NotImplementedError, match="rope_type"):
        model, _ = build_demo_model("cpu", with_hf=False, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    sd = random_hf_state_dict(ModelConfig.from_hf(cfg))
    sd.pop("model.layers.1.self_attn.indexer.wk.weight")
    with pytest.raises(KeyError, match="indexer.wk"):
        DeepseekV32Model.from_hf_state_dict(cfg, sd, device="cpu", max_model_len=64, max_batch=2)
    assert "lm_head.weight" not in hf_param_shapes(ModelConfig.from_hf({**cfg, "tie_word_embeddings": True}))


# -- (a) the oracle with the top-k covering the whole context ------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_oracle_full_topk_prompt_and_16_greedy_steps(dtype):
    _need_transformers()
    # index_topk 64 >= the longest context (24 + 16): dense prefill, decode over every key.
    model, hf = build_demo_model("cpu", dtype, seed=0, index_topk=64)
    hf32 = copy.deepcopy(hf).float()
    prompts = _prompts(0, [24, 17, 9])
    tokens, logits = greedy(model, prompts)
    for r, prompt in enumerate(prompts):
        ref_lp = teacher_forced(hf, prompt, tokens[r])
        ref32 = teacher_forced(hf32, prompt, tokens[r])
        _check_steps(logits[r], ref_lp, ref32, dtype)
        _check_tokens(tokens[r], ref_lp, dtype)

    # The sparse prefill path (indexer composite + absorbed sparse_mla) computes the same
    # logits when its top-k covers everything: force every request onto it.
    state = model.new_state()
    lengths = [len(p) for p in prompts]
    rows = state.add_requests(lengths)
    meta = build_prefill(
        state.prefill_batch(rows, lengths), np.concatenate(prompts), index_topk=0,
        block_size=model.block_size, device="cpu",
    )
    assert meta.dense is None and meta.sparse.num_reqs == 3
    sparse_logits = model.prefill_forward(meta)
    for r, prompt in enumerate(prompts):
        ref_lp = teacher_forced(hf, prompt, tokens[r])[:1]
        ref32 = teacher_forced(hf32, prompt, tokens[r])[:1]
        _check_steps(sparse_logits[r : r + 1], ref_lp, ref32, dtype)


def test_oracle_yarn_rope_and_mscale():
    """YaRN inverse frequencies, the cos/sin attention factor (mscale != mscale_all_dim)
    and the softmax scale's mscale^2 correction, against transformers."""
    _need_transformers()
    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
    }
    model, hf = build_demo_model(
        "cpu", torch.bfloat16, seed=3, index_topk=64, rope_parameters=rope, max_position_embeddings=64, max_model_len=64
    )
    assert model.scale != model.cfg.qk_head_dim**-0.5
    hf32 = copy.deepcopy(hf).float()
    prompts = _prompts(3, [30])
    tokens, logits = greedy(model, prompts, steps=4)
    ref_lp = teacher_forced(hf, prompts[0], tokens[0])
    _check_steps(logits[0], ref_lp, teacher_forced(hf32, prompts[0], tokens[0]), torch.bfloat16)
    _check_tokens(tokens[0], ref_lp, torch.bfloat16)


# -- (b) the oracle with a small top-k -------------------------------------------------------------
def _hf_indexer_hook(store, scale_fmt):
    """Records, per layer, transformers' exact index scores [S, S], its selection, and the
    same scores from transformers' own queries and keys quantised to fp8 the way graphsafe
    quantises them (per-head query scales folded into the weights, per-token key scales)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hfm

    def hook(m, args, kwargs, out):
        hs, q_resid, (cos, sin) = args[0], args[1], args[2]
        b, s, _ = hs.shape
        q = m.wq_b(q_resid).view(b, s, m.n_heads, m.head_dim)
        q_rot, q_pass = torch.split(q, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        k = m.k_norm(m.wk(hs)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = hfm.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)[0]
        k = torch.cat([k_rot, k_pass], -1)[0, :, 0]
        w = m.weights_proj(hs)[0].float() * m.n_heads**-0.5
        dots = torch.einsum("thd,nd->thn", q.float(), k.float())
        exact = torch.einsum("th,thn->tn", w, F.relu(dots * m.softmax_scale))
        q8, q_scale = quant_fp8_per_head(q, scale_fmt)
        k8, k_scale = quantize(k, m.head_dim, scale_fmt)
        dots8 = torch.einsum("thd,nd->thn", q8.float(), k8.float())
        fp8 = torch.einsum("th,thn->tn", w * m.softmax_scale * q_scale, F.relu(dots8)) * k_scale[:, 0][None, :]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        store[m.layer_idx] = (exact.masked_fill(~causal, -math.inf), fp8.masked_fill(~causal, -math.inf), out[0])

    return hook


def _topk_set(scores, k):
    return set(scores.topk(min(k, scores.shape[0])).indices.tolist())


def _graphsafe_selections(model, records):
    """{(request, layer, position): (selected set, graphsafe's fp8 scores)} from the trace."""
    rows = {}
    for _, layer, v in records:
        cache = model.layers[layer].index_cache
        for i in range(v["q"].shape[0]):
            ctx = int(v["context_lens"][i])
            if ctx <= 0:
                continue
            lens, table = v["context_lens"][i : i + 1].contiguous(), v["block_table"][i : i + 1].contiguous()
            weights = v["weights"][i][None].contiguous()
            scores = graphsafe.fp8_paged_mqa_logits(
                v["q"][i][None, None], cache, weights, lens, table, model.max_model_len
            )[0, :ctx]
            chosen = {j for j in v["topk"][i].tolist() if j >= 0}
            rows[(int(v["rows"][i]), layer, int(v["positions"][i]))] = (chosen, scores)
    return rows


def _sparse_oracle_seed(seed, topk=8, lengths=(24, 6)):
    model, hf = build_demo_model("cpu", torch.bfloat16, seed=seed, index_topk=topk)
    prompts = _prompts(seed, list(lengths))
    records = []
    model.trace = lambda kind, layer, values: records.append((kind, layer, values))
    tokens, logits = greedy(model, prompts)
    ours = _graphsafe_selections(model, records)
    hf32 = copy.deepcopy(hf).float()
    out = {
        "layer0": 0, "layer0_same": 0, "clean_mismatches": 0, "reproduced": 0, "swaps": [], "requests": [],
        "emulation_gaps": [],
    }
    for r, prompt in enumerate(prompts):
        store = {}
        handles = [
            layer.self_attn.indexer.register_forward_hook(
                _hf_indexer_hook(store, model.cfg.index_scale_fmt), with_kwargs=True
            )
            for layer in hf.model.layers
        ]
        ref_lp = teacher_forced(hf, prompt, tokens[r])
        for h in handles:
            h.remove()
        first_mismatch = math.inf  # the first position with any selection difference
        first_bad = {}  # layer -> its first position with a selection difference
        for (req, layer, pos), (chosen, gs_scores) in sorted(ours.items(), key=lambda kv: (kv[0][2], kv[0][1])):
            if req != r:
                continue
            exact, fp8, hf_topk = store[layer]
            theirs = {j for j in hf_topk[pos].tolist() if j <= pos}
            if layer == 0:
                out["layer0"] += 1
                out["layer0_same"] += chosen == theirs
            if chosen == theirs:
                continue
            # Layer L at position p reads identical inputs in both models (up to rounding)
            # unless a layer below L selected differently at a position <= p; layer 0 reads
            # the embeddings of the same tokens, so its rows are always clean.
            if all(first_bad.get(lower, math.inf) > pos for lower in range(layer)):
                out["clean_mismatches"] += 1
                # transformers' own inputs, quantised like graphsafe's: the same choice?
                row = exact[pos, : pos + 1]
                spread = float(row.max() - row.min())
                if _topk_set(fp8[pos, : pos + 1], topk) == chosen:
                    out["reproduced"] += 1
                else:  # how far graphsafe's fp8 scores are from the emulation's
                    out["emulation_gaps"].append(float((fp8[pos, : pos + 1] - gs_scores).abs().max()) / spread)
                for a in chosen - theirs:
                    for b in theirs - chosen:
                        gap = float(row[b] - row[a])  # >= 0: transformers preferred b
                        err = float((gs_scores[a] - row[a]).abs() + (gs_scores[b] - row[b]).abs())
                        out["swaps"].append((gap / spread, err / spread, gap <= err + 1e-6))
            first_mismatch = min(first_mismatch, pos)
            first_bad.setdefault(layer, pos)
        # Steps fed only identical selections (every position before the first
        # difference) must match like the full-top-k oracle.
        clean_steps = [s for s in range(STEPS + 1) if len(prompt) - 1 + s < first_mismatch]
        if clean_steps:
            ref32 = teacher_forced(hf32, prompt, tokens[r])
            _check_steps(logits[r], ref_lp, ref32, torch.bfloat16, clean_steps)
            _check_tokens(tokens[r], ref_lp, torch.bfloat16, clean_steps)
        hf_greedy = ref_lp.argmax(-1).tolist()
        agree = next((s for s in range(STEPS + 1) if tokens[r][s] != hf_greedy[s]), STEPS + 1)
        out["requests"].append((seed, r, agree, first_mismatch - (len(prompt) - 1)))
    return out


def test_oracle_small_topk_agreement_and_fp8_tie_explanation():
    """index_topk = 8 with contexts up to 40: a long prompt (sparse prefill) and a short one
    (dense prefill, then sparse decode) per seed, 16 greedy steps each."""
    _need_transformers()
    total = {
        "layer0": 0, "layer0_same": 0, "clean_mismatches": 0, "reproduced": 0, "swaps": [], "requests": [],
        "emulation_gaps": [],
    }
    for seed in range(6):
        res = _sparse_oracle_seed(seed)
        for key, value in res.items():
            total[key] += value
    rate = total["layer0_same"] / total["layer0"]
    reproduced = total["reproduced"] / total["clean_mismatches"]
    gaps = sorted(g for g, _, _ in total["swaps"])
    errs = sorted(e for _, e, _ in total["swaps"])
    print(f"\nlayer-0 selections identical to transformers': {total['layer0_same']}/{total['layer0']} = {rate:.3f}")
    print(f"selection differences on identical inputs: {total['clean_mismatches']}; reproduced by quantising "
          f"transformers' own q/k to fp8: {total['reproduced']} ({reproduced:.2f})")
    print("  where not, graphsafe's fp8 scores differ from the emulation's by (/ score range):",
          [round(g, 4) for g in total["emulation_gaps"]])
    print(f"swapped keys: exact score gap / score range: median {np.median(gaps):.4f}, max {gaps[-1]:.4f}; "
          f"graphsafe's score error on them / range: median {np.median(errs):.4f}")
    print("(seed, request, greedy steps agreeing of 17, step of the first selection difference):", total["requests"])
    # The differences are fp8's: the same quantisation of transformers' own scores makes the
    # same choice (measured 0.84; the rest are closer ties, decided by the bf16 rounding of
    # the inputs that differs between the two models' GEMMs).
    assert reproduced >= 0.7
    # Each swap is between keys whose exact scores differ by less than graphsafe's score
    # error on them: graphsafe's top-k is the top-k of its own (fp8) scores.
    assert all(ok for *_, ok in total["swaps"])
    # ...and those are near-ties: a few % of the row's score range.
    assert np.median(gaps) <= 0.05
    # The floor: e4m3 (3 mantissa bits) perturbs each score by a few % while the k-th and
    # (k+1)-th of 9-40 scores are a few % apart; measured 0.875 over these seeds.
    assert rate >= 0.75
    # Greedy tokens never diverge before the selections do.
    for seed, r, agree, first_step in total["requests"]:
        assert agree >= min(first_step, STEPS + 1), (seed, r, agree, first_step)


# -- compile ---------------------------------------------------------------------------------------
def _decode_model(dtype=torch.bfloat16, seed=0):
    model, _ = build_demo_model("cpu", dtype, seed=seed, with_hf=False, index_topk=8)
    state = model.new_state()
    logits = model.prefill(state, _prompts(seed, [11, 3, 20, 5, 9, 13, 4, 6]))
    model.decode_inputs(state, logits.argmax(-1))  # fills the builder's 8 rows
    return model


def test_decode_step_compiles_fullgraph_without_breaks_or_recompiles_across_batch_sizes():
    model = _decode_model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model.decode_step, fullgraph=True, backend=counter, dynamic=True)
    for b in (2, 3, 5, 8, 4):
        inputs = model.decode_builder.buffers.rows(b)
        want = model.decode_step(inputs)  # the cache writes are idempotent for equal inputs
        got = step(inputs)
        assert got.shape == (b, model.cfg.vocab_size)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert float((got - want).abs().max()) <= float(_tolerance(torch.bfloat16, want).max())
        assert counter.frame_count == 1, f"recompiled at B={b}"
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    # B = 1 is one more graph (torch's 0/1 size specialisation), compiled once.
    step(model.decode_builder.buffers.rows(1))
    step(model.decode_builder.buffers.rows(1))
    assert counter.frame_count == 2


@pytest.mark.slow
def test_decode_step_under_inductor_on_cpu_equals_eager():
    model = _decode_model()
    inputs = model.decode_builder.buffers.rows(8)
    want = model.decode_step(inputs)
    caches = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]
    torch._dynamo.reset()
    got = torch.compile(model.decode_step, fullgraph=True, backend="inductor", dynamic=True)(inputs)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) <= float(_tolerance(torch.bfloat16, want).max())
    d = model.cfg.index_head_dim
    for layer, (kv, index) in zip(model.layers, caches):
        # Caches written by the compiled step hold the same keys up to bf16 rounding
        # (the latent) and one e4m3 step (the indexer keys).
        assert torch.allclose(layer.kv_cache.float(), kv.float(), atol=0.05, rtol=2**-7)
        got_k, want_k = (dequantize(*unpack(c, d)) for c in (layer.index_cache, index))
        assert float((got_k - want_k).abs().max()) <= 2**-3 * float(want_k.abs().max())


# -- decode semantics the graph runner relies on ---------------------------------------------------
def test_padding_rows_write_nothing_and_leave_live_rows_unchanged():
    model = _decode_model()
    state = model.new_state()
    logits = model.prefill(state, _prompts(1, [7, 12, 3]))
    live = model.decode_inputs(state, logits.argmax(-1))
    caches = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]
    want = model.decode_step(live)
    after = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]
    for layer, (kv, index) in zip(model.layers, caches):  # undo the step's writes
        layer.kv_cache.copy_(kv)
        layer.index_cache.copy_(index)
    bucket = model.decode_builder.buffers.rows(8)  # rows 3..7 hold the pad values
    got = model.decode_step(bucket)
    assert torch.equal(got[:3], want)
    for layer, (kv, index) in zip(model.layers, after):
        assert torch.equal(layer.kv_cache, kv) and torch.equal(layer.index_cache, index)
    assert bool(torch.isfinite(got).all())


def test_prefill_in_chunks_equals_one_batch():
    """Whole prompts per chunk: requests do not interact, so only GEMM blocking (the row
    count) changes the rounding. The top-k covers the contexts, so no near-tie of the
    indexer can amplify that rounding."""
    prompts = _prompts(2, [9, 14, 5, 11])
    one, _ = build_demo_model("cpu", torch.bfloat16, seed=2, with_hf=False, index_topk=64)
    chunked, _ = build_demo_model(
        "cpu", torch.bfloat16, seed=2, with_hf=False, index_topk=64, max_num_batched_tokens=16
    )
    a = one.prefill(one.new_state(), prompts)
    b = chunked.prefill(chunked.new_state(), prompts)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert float((a - b).abs().max()) <= float(_tolerance(torch.bfloat16, a).max())


def test_decode_workspace_worst_case_covers_every_batch_size():
    model = _decode_model()
    worst = model.decode_workspace_bytes()
    from graphsafe.ops.indexer.plan import decode_bytes

    assert worst >= max(decode_bytes(b, model.max_model_len, model.topk) for b in range(1, model.max_batch + 1))
    ws = graphsafe.current_workspace_manager("cpu")
    assert model.decode_workspace_reserve() == worst and ws.size_bytes >= worst
    grows = ws.stats().grow_count
    with ws.locked():
        for b in (8, 3, 1):
            model.decode_step(model.decode_builder.buffers.rows(b))
    assert ws.stats().grow_count == grows


def test_host_state_allocates_blocks_lazily_and_checks_order():
    model = _decode_model()
    state = model.new_state()
    model.prefill(state, [[1] * 16, [2] * 3])
    assert state.blocks_held[:2].tolist() == [1, 1]  # block_size 16
    with pytest.raises(RuntimeError, match="decode_inputs"):
        model.advance(state)  # request 0's next token has no block yet
    tok = torch.tensor([5, 6])
    model.decode_inputs(state, tok)  # request 0's 17th token needs a second block
    assert state.blocks_held[:2].tolist() == [2, 1]
    model.advance(state, tok)
    assert state.seq_lens[:2].tolist() == [17, 4] and len(state.outputs) == 1
    with pytest.raises(ValueError, match="max_batch"):
        state.add_requests([1] * model.max_batch)


def test_triton_backends_in_the_model_match_the_reference_through_the_interpreter():
    """Every op of the decode step and of a mixed dense/sparse prefill on its Triton kernel
    (the GPU path), through the CPU interpreter: fp16 (the interpreter's bf16 tl.dot is
    broken), small shapes. The decode step also runs with the workspace locked after
    `decode_workspace_reserve`."""
    model, _ = build_demo_model(
        "cpu", torch.float16, seed=4, with_hf=False, index_topk=8, max_batch=4, max_model_len=64
    )
    prompts = _prompts(4, [11, 3, 12])  # 11 and 12 take the sparse prefill, 3 the dense one
    snapshot = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]

    def restore():
        for layer, (kv, index) in zip(model.layers, snapshot):
            layer.kv_cache.copy_(kv)
            layer.index_cache.copy_(index)

    want_prefill = model.prefill(model.new_state(), prompts)
    restore()
    with graphsafe.use_backend("triton"):
        state = model.new_state()
        got_prefill = model.prefill(state, prompts)
    _check_close(got_prefill, want_prefill, torch.float16)
    inputs = model.decode_inputs(state, got_prefill.argmax(-1))
    caches = [(layer.kv_cache.clone(), layer.index_cache.clone()) for layer in model.layers]
    want = model.decode_step(inputs)
    for layer, (kv, index) in zip(model.layers, caches):
        layer.kv_cache.copy_(kv)
        layer.index_cache.copy_(index)
    ws = graphsafe.current_workspace_manager("cpu")
    with graphsafe.use_backend("triton"):
        model.decode_workspace_reserve()
        grows = ws.stats().grow_count
        with ws.locked():
            got = model.decode_step(inputs)
            model.decode_step(model.decode_builder.buffers.rows(1))
    assert ws.stats().grow_count == grows
    _check_close(got, want, torch.float16)


def _check_close(got, want, dtype):
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) <= float(_tolerance(dtype, want).max())


def test_demo_model_builds_without_transformers(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    model, hf = build_demo_model("cpu", torch.bfloat16, seed=0, num_hidden_layers=1, max_model_len=32)
    assert hf is None and len(model.layers) == 1
    state = model.new_state()
    assert model.prefill(state, [[1, 2, 3]]).shape == (1, model.cfg.vocab_size)


def test_precision_comparison_measures_the_fp8_prefill():
    """`compare_decoding` (README "Prefill precision"): a model against itself differs by
    nothing; the fp8 dense prefill ("on"; "auto" is "off" on a CPU) moves logits by about
    fp8 rounding, against bf16 and against transformers' float32 forward."""
    from graphsafe.models.precision import compare_decoding

    off, hf = build_demo_model("cpu", torch.bfloat16, seed=1, prefill_fp8="off", index_topk=64)
    same, _ = build_demo_model("cpu", torch.bfloat16, seed=1, prefill_fp8="off", index_topk=64, with_hf=False)
    fp8, _ = build_demo_model("cpu", torch.bfloat16, seed=1, prefill_fp8="on", index_topk=64, with_hf=False)
    assert build_demo_model("cpu", torch.bfloat16, seed=1, with_hf=False)[0].cfg.prefill_fp8 == "auto"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, off.cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 17, 9)]
    exact = compare_decoding(off, same, prompts, 3)
    assert exact["b_vs_a"]["peak_err_max"] == 0 and exact["b_vs_a"]["agree"] == 1
    result = compare_decoding(off, fp8, prompts, 3, oracle=hf.float() if hf is not None else None)
    assert 0 < result["b_vs_a"]["rel_l2_median"] <= 0.05, result
    if hf is not None:
        assert result["a_vs_oracle"]["rel_l2_max"] <= 0.02, result
        assert result["b_vs_oracle"]["rel_l2_max"] <= 0.06, result
