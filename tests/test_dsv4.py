"""DeepSeek-V4 attention (`dsv4_sparse_attn`) beyond the registry-wide contract: an
independent oracle of the formula (transformers' sink softmax), the records against bf16
rows, split plans, padded heads, the block padding outside the cache view, and the
kernels compiled for sm_90 without a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphsafe
from graphsafe.formats import fp8_dsv4
from graphsafe.ops.dsv4 import plan, triton as dsv4_triton
from graphsafe.ops.dsv4.cases import latent_rows, make_indices, record_cache
from graphsafe.testing.compile_scripts import SPECIALISE_PRELUDE

SPEC = graphsafe.get_op("dsv4_sparse_attn")
SCALE = 512**-0.5


def _inputs(seed=0, t=3, h=4, k=24, k2=16, bs=4, xbs=2, nb=5, xnb=6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((t, h, 512), generator=gen).bfloat16()
    swa = record_cache(latent_rows(nb * bs, gen), nb, bs, "cpu", gen)
    comp = record_cache(latent_rows(xnb * xbs, gen), xnb, xbs, "cpu", gen)
    idx = make_indices(t, k, nb * bs, 0.25, gen)
    xidx = make_indices(t, k2, xnb * xbs, 0.25, gen)
    sink = torch.randn(h, generator=gen)
    length = torch.randint(0, k + 1, (t,), generator=gen).int()
    xlength = torch.randint(0, k2 + 1, (t,), generator=gen).int()
    return q, swa, idx, SCALE, sink, length, comp, xidx, xlength


def _sink_softmax_oracle(q, keys, valid, sink, scale):
    """transformers' DeepSeek-V4 `eager_attention_forward`: the sink as one more logit
    column, softmax, the sink's column dropped; float64."""
    scores = torch.einsum("hd,ld->hl", q.double(), keys.double()) * scale
    scores = scores.masked_fill(~valid[None, :], float("-inf"))
    logits = torch.cat([scores, sink.double()[:, None]], dim=1)
    probs = torch.softmax(logits - logits.max(dim=1, keepdim=True).values, dim=1)[:, :-1]
    return probs @ keys.double()


def test_reference_equals_the_sink_softmax_of_transformers():
    q, swa, idx, scale, sink, length, comp, xidx, xlength = _inputs()
    out, lse = SPEC.runner("reference")(q, swa, idx, scale, sink, length, comp, xidx, xlength)
    for t in range(q.shape[0]):
        main = [int(s) for j, s in enumerate(idx[t]) if j < length[t] and s >= 0]
        extra = [int(s) for j, s in enumerate(xidx[t]) if j < xlength[t] and s >= 0]
        keys = torch.cat([fp8_dsv4.read_tokens(swa, torch.tensor(main, dtype=torch.long)).reshape(-1, 512),
                          fp8_dsv4.read_tokens(comp, torch.tensor(extra, dtype=torch.long)).reshape(-1, 512)])
        if keys.shape[0] == 0:
            assert out[t].eq(0).all() and lse[t].isneginf().all()
            continue
        want = _sink_softmax_oracle(q[t].float(), keys, torch.ones(keys.shape[0], dtype=torch.bool), sink, scale)
        torch.testing.assert_close(out[t].double(), want, rtol=1e-2, atol=1e-2)
        s = torch.einsum("hd,ld->hl", q[t].double(), keys.double()) * scale
        torch.testing.assert_close(lse[t].double(), torch.logsumexp(s, dim=1), rtol=1e-5, atol=1e-5)


def _bf16_rows_of(cache: torch.Tensor) -> torch.Tensor:
    nb, bs = cache.shape[:2]
    return fp8_dsv4.read_tokens(cache, torch.arange(nb * bs)).to(torch.bfloat16).view(nb, bs, 512)


def test_records_read_as_their_bf16_rows():
    """The kernel dequantises a record to exactly the bf16 row of its values: the same call
    over a bf16 cache of those rows gives the same bits."""
    q, swa, idx, scale, sink, length, comp, xidx, xlength = _inputs(seed=1)
    rec = SPEC.runner("triton")(q, swa, idx, scale, sink, length, comp, xidx, xlength)
    rows = SPEC.runner("triton")(q, _bf16_rows_of(swa), idx, scale, sink, length, _bf16_rows_of(comp), xidx, xlength)
    assert torch.equal(rec[0], rows[0]) and torch.equal(rec[1], rows[1])


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_split_plans_agree(splits):
    args = _inputs(seed=2, k=40, k2=24)
    expected = SPEC.runner("reference")(*args)
    out, lse = dsv4_triton.dsv4_sparse_attn(*args, num_splits=splits)
    torch.testing.assert_close(out.float(), expected[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, expected[1], rtol=1e-4, atol=1e-4)


def test_padded_heads_leave_the_real_heads_unchanged():
    """vLLM pads DeepSeek-V4's heads for FlashMLA (q rows of 0, sinks of -inf): the real heads
    are those of the unpadded call, bit for bit."""
    q, swa, idx, scale, sink, length, comp, xidx, xlength = _inputs(seed=3, h=5)
    padded_q = torch.cat([q, torch.zeros((q.shape[0], 11, 512), dtype=q.dtype)], dim=1)
    padded_sink = torch.cat([sink, torch.full((11,), float("-inf"))])
    for backend in ("reference", "triton"):
        out, lse = SPEC.runner(backend)(q, swa, idx, scale, sink, length, comp, xidx, xlength)
        pout, plse = SPEC.runner(backend)(padded_q, swa, idx, scale, padded_sink, length, comp, xidx, xlength)
        assert torch.equal(pout[:, :5], out) and torch.equal(plse[:, :5], lse), backend


def test_block_padding_and_pad_bytes_are_never_read():
    """The bytes between a block's records and the next block (vLLM's padding to 576) lie
    outside the cache view, so the registry's contract cannot poison them: here they and
    every record's pad byte hold 0xFF (NaN as e4m3 and as UE8M0)."""
    args = list(_inputs(seed=4, bs=4))
    clean = [SPEC.runner(b)(*args) for b in ("reference", "triton")]
    for at in (1, 6):
        cache = args[at]
        nb, bs = cache.shape[:2]
        stride = cache.stride(0)
        storage = torch.as_strided(cache, (nb * stride,), (1,))
        used = torch.zeros(nb * stride, dtype=torch.bool)
        for b in range(nb):
            used[b * stride : b * stride + bs * fp8_dsv4.TOKEN_BYTES] = True
            for t in range(bs):
                used[b * stride + fp8_dsv4.token_byte_offsets(bs, t)[2]] = False
        assert (~used).sum() >= nb * (stride - bs * 584) and stride > bs * 584
        storage[~used] = 0xFF
    for backend, (out, lse) in zip(("reference", "triton"), clean):
        got = SPEC.runner(backend)(*args)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse), backend


def test_workspace_follows_the_plan():
    """The reservation is the plan's partials; one split needs none. (On a CPU the automatic
    order serves the reference, which takes no scratch: ask for the Triton record's.)"""
    specs = graphsafe.ops.dsv4.dsv4_sparse_attn_workspace_specs(3, 4, 512, 40, 24, device="cpu", backend="triton")
    cfg, split_plan = plan.plan_launch(3, 4, 64, torch.device("cpu"))
    assert split_plan.num_splits == 2
    assert specs == [((3, 2, 4, 512), torch.float32), ((3, 2, 4), torch.float32)]
    assert graphsafe.ops.dsv4.dsv4_sparse_attn_workspace_specs(3, 4, 512, 16, 0, device="cpu", backend="triton") == []
    assert graphsafe.ops.dsv4.dsv4_sparse_attn_workspace_specs(3, 4, 512, 40, 24, device="cpu") == []


def test_choice_names_the_gluon_kernel_then_the_triton_fallback(monkeypatch):
    """Where the Gluon kernel fits (an sm_90 signature: patched in here), the choice names it
    with the Triton kernel as the fallback of the calls it cannot run, on the Gluon tiles and
    their split plan; the workspace sizing covers the larger of both candidates' partials."""
    monkeypatch.setattr(plan, "gluon_fits", lambda *a: True)
    q, swa, idx, scale, sink, length, comp, xidx, xlength = _inputs(seed=2)
    call = SPEC.call(q, swa, idx, scale, sink, length, comp, xidx, xlength)
    choice = plan.choose(call)
    assert choice.kernels == (plan.GLUON_SPARSE_ATTN, plan.TRITON_SPARSE_ATTN)
    assert choice.config == plan.GLUON_TILES and choice.kernel == plan.GLUON_SPARSE_ATTN
    assert "gluon_sparse_attn (else triton_sparse_attn); tiles 64 heads x 64 keys" in choice.describe()
    # Forced tiles (tests, tuning) keep the Triton kernel alone.
    assert plan.choose(call, config=plan.tiles(4, "cpu")).kernels == (plan.TRITON_SPARSE_ATTN,)
    # Off sm_90 (this CPU) the real test declines.
    monkeypatch.undo()
    assert plan.choose(call).kernels == (plan.TRITON_SPARSE_ATTN,)


def test_gluon_fits_only_what_its_copies_can_address(monkeypatch):
    """The Gluon kernel's signature test on an sm_90 device (patched in): bf16 q of head dim
    512 with row strides of multiples of 16 elements (Triton's specialisation proves those
    16-byte aligned; a stride of 8 elements left its cp.async of q uncompilable on Triton
    3.6), fp8_dsv4 records in both caches."""
    if plan.gluon_module() is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(plan, "is_sm90", lambda device: True)
    monkeypatch.setattr(plan, "max_shared_memory", lambda device: 227 * 1024)
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    rec, xrec = fp8_dsv4.empty_cache(4, 64, "cpu"), fp8_dsv4.empty_cache(2, 64, "cpu")
    assert plan.gluon_fits(q, rec, xrec) and plan.gluon_fits(q, rec, None)
    assert not plan.gluon_fits(torch.zeros(4, 64, 520, dtype=torch.bfloat16)[..., :512], rec, None)  # stride 520
    assert plan.gluon_fits(torch.zeros(4, 72, 512, dtype=torch.bfloat16)[:, :64], rec, None)  # strides 72 * 512, 512
    assert not plan.gluon_fits(q.half(), rec, None)
    assert not plan.gluon_fits(q, torch.zeros(4, 64, 512, dtype=torch.bfloat16), None)
    assert not plan.gluon_fits(q, rec, torch.zeros(4, 64, 512, dtype=torch.bfloat16))
    monkeypatch.setattr(plan, "max_shared_memory", lambda device: 100 * 1024)
    assert not plan.gluon_fits(q, rec, None)


def test_a_gluon_compile_failure_runs_the_triton_kernel_on_the_same_plan(monkeypatch):
    """Where the Gluon kernel is chosen but fails to compile (nothing launched: patched in
    here), the runner warns once, runs the Triton kernel on the Gluon plan's splits (the
    same partials) and never tries that signature's Gluon launch again."""
    gluon = plan.gluon_module()
    if gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(plan, "gluon_fits", lambda *a: True)
    real_bind, tries = dsv4_triton.bind, []

    def bind(kernel, grid, *args, **kw):
        if kernel is gluon.dsv4_attn_wgmma_kernel:
            def fail(*tensors):
                tries.append(1)
                raise RuntimeError("PassManager::run failed")
            return fail
        return real_bind(kernel, grid, *args, **kw)

    monkeypatch.setattr(dsv4_triton, "bind", bind)
    monkeypatch.setattr(dsv4_triton, "_GLUON_FAILED", set())
    args = _inputs(seed=5)
    run = dsv4_triton.prepare_dsv4_sparse_attn(SPEC.call(*args), num_splits=2)
    with pytest.warns(RuntimeWarning, match="Gluon kernel did not compile"):
        out, lse = run(*args)
    ref_out, ref_lse = SPEC.runner("reference")(*args)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = run(*args)
    assert torch.equal(again, out) and len(tries) == 1 and len(dsv4_triton._GLUON_FAILED) == 1


_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
import torch
import graphsafe
from graphsafe.formats import fp8_dsv4
from graphsafe.ops.dsv4 import plan, triton as tri

launches = []

def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record each launch, run nothing
    def launch(*tensors):
        it = iter(tensors)
        launches.append((kernel, tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args), dict(kw)))
    return launch

tri.bind = record
""" + SPECIALISE_PRELUDE + r"""
TYPES[torch.uint8] = "u8"
for heads in (16, 64, 128):
    cfg = plan.tiles(heads, "cuda")
    q = torch.randn(4, heads, 512, dtype=torch.bfloat16)
    rec, xrec = fp8_dsv4.empty_cache(4, 64, "cpu"), fp8_dsv4.empty_cache(16, 64, "cpu")
    rows, xrows = torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(16, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(4, 128, dtype=torch.int32)
    xidx = torch.zeros(4, 512, dtype=torch.int32)
    sink = torch.zeros(heads)
    lens = torch.zeros(4, dtype=torch.int32)
    tri.dsv4_sparse_attn(q, rec, idx, 0.04, sink, lens, xrec, xidx, lens, config=cfg, num_splits=4)
    tri.dsv4_sparse_attn(q, rec, idx, 0.04, None, None, None, None, None, config=cfg, num_splits=1)
    tri.dsv4_sparse_attn(q, rows, idx, 0.04, sink, lens, xrows, xidx, None, config=cfg, num_splits=2)
    insert = graphsafe.get_op("dsv4_qnorm_rope_kv_insert")
    for cache in (rec, rows):
        args = (q, torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(4, 128, 512, dtype=torch.bfloat16), cache,
                torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.zeros(64, 64), 1e-6)
        tri.prepare_dsv4_qnorm_rope_kv_insert(insert.call(*args))(*args)
compress = graphsafe.get_op("dsv4_compress_kv")
for d, ratio, coff, cache in ((512, 4, 2, rec), (512, 128, 1, rec), (512, 4, 2, rows),
                              (128, 4, 2, torch.zeros(4, 64, 128, dtype=torch.bfloat16))):
    w, t = coff * d, 8
    i64 = torch.zeros(t, dtype=torch.int64)
    args = (torch.zeros(t, w, dtype=torch.bfloat16), torch.zeros(t, w, dtype=torch.bfloat16), torch.zeros(ratio, w),
            i64, torch.zeros(16, 8, 2 * w), i64, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(t, dtype=torch.int32),
            torch.ones(d), 1e-6, torch.zeros(64, 64), cache, i64, ratio)
    tri.prepare_dsv4_compress_kv(compress.call(*args))(*args)
seen = set()
for fn, args, kw in launches:
    if kw.get("RECORDS"):
        kw["FP8_NATIVE"] = True  # recorded on CPU tensors: what a CUDA tensor on sm_90 turns on
    key = (fn.__name__, tuple(sorted((k, v) for k, v in kw.items())))
    if key in seen:
        continue
    seen.add(key)
    opts = {"num_warps": kw.pop("num_warps"), "num_stages": kw.pop("num_stages", 2)}
    k = triton.compile(specialise(fn, args, kw), target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    print("compiled", fn.__name__, kw.get("BLOCK_H"), kw.get("RECORDS"), kw.get("SPLIT"), "shared", k.metadata.shared,
          "native", "e4m3x2" in ptx)
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    if kw.get("RECORDS") and fn.__name__ == "dsv4_attn_kernel":
        assert "e4m3x2" in ptx, "the hardware e4m3 conversion"
print("OK")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter never compiles: catch GPU-only errors (types, constexpr misuse) by
    compiling every variant the runner binds (records with the hardware e4m3 conversion,
    bf16 rows; split or not; sink, lengths, the extra cache) for sm_90 with ptxas."""
    out = compile_for_sm90(_COMPILE_SCRIPT, timeout=1200)
    # 3 variants per tile size (64 and 128 heads share the 32-head tiles); the insert kernel
    # for records and bf16 rows.
    assert out.count("compiled dsv4_attn_kernel") == 6 and "compiled combine_kernel" in out, out
    assert out.count("compiled qnorm_rope_kv_insert_kernel") == 2, out
    assert out.count("compiled compress_kernel") == 4 and out.count("compiled save_state_kernel") == 3, out


_GLUON_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, warpgroup_mma
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.dsv4.kernels import gluon_sparse_attn as G
import torch
from graphsafe.formats import fp8_dsv4
from graphsafe.ops.dsv4 import plan, triton as tri

launches = []

def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record the Gluon launches, run nothing
    def launch(*tensors):
        it = iter(tensors)
        if kernel is G.dsv4_attn_wgmma_kernel:
            launches.append((tuple(next(it) if isinstance(a, torch.Tensor) else a for a in args), dict(kw)))
    return launch

tri.bind = record
plan.gluon_fits = lambda *a: True  # what an sm_90 device gives these calls
""" + SPECIALISE_PRELUDE + r"""
TYPES[torch.uint8] = "u8"
for heads in (64, 128):
    q = torch.randn(4, heads, 512, dtype=torch.bfloat16)
    rec, xrec = fp8_dsv4.empty_cache(4, 64, "cpu"), fp8_dsv4.empty_cache(16, 64, "cpu")
    idx = torch.zeros(4, 128, dtype=torch.int32)
    xidx = torch.zeros(4, 512, dtype=torch.int32)
    sink = torch.zeros(heads)
    lens = torch.zeros(4, dtype=torch.int32)
    tri.dsv4_sparse_attn(q, rec, idx, 0.04, sink, lens, xrec, xidx, lens, num_splits=4)
    tri.dsv4_sparse_attn(q, rec, idx, 0.04, sink, None, xrec, xidx, None, num_splits=1)
    tri.dsv4_sparse_attn(q, rec, idx, 0.04, None, None, None, None, None, num_splits=1)
assert len(launches) == 6, len(launches)
seen = set()
for args, kw in launches:
    key = tuple(sorted(kw.items()))
    if key in seen:
        continue
    seen.add(key)
    k = triton.compile(specialise(G.dsv4_attn_wgmma_kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": kw.pop("num_warps")})
    shapes = wgmma_shapes(k)
    print("compiled dsv4_attn_wgmma_kernel", kw, "shared", k.metadata.shared, shapes)
    # Per 64 keys each warpgroup scores its 32 keys over 512 columns (8 + 8 + 8 + 4 + 4 k-steps
    # of 16, in five wgmmas) and accumulates its half of each value piece (128 / 128 / 128 / 64
    # / 64 columns) over the 64 keys (4 k-steps each); the phases (window, compressed) one loop each.
    phases = 2 if kw["HAS_EXTRA"] else 1
    assert shapes == {"m64n32k16": phases * (32 + 8), "m64n64k16": phases * 12}, shapes
    assert k.metadata.shared <= G.shared_memory_bytes() <= 227 * 1024, k.metadata.shared
    assert "e4m3x2" in k.asm["ptx"], "the hardware e4m3 conversion"
print("OK")
"""


def test_gluon_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The sm_90 Gluon kernel (never run by the interpreter), launched as the runner launches
    it (split or not, sink, lengths, the extra cache), compiles for sm_90 with this Triton:
    each warpgroup issues the wgmmas of its own half of the scores and values, the e4m3
    bytes convert in hardware, and it fits Hopper's 227 KiB of shared memory."""
    out = compile_for_sm90(_GLUON_COMPILE_SCRIPT, timeout=1200)
    assert out.count("compiled dsv4_attn_wgmma_kernel") == 3, out


# -- dsv4_qnorm_rope_kv_insert ---------------------------------------------------------------
INSERT = graphsafe.get_op("dsv4_qnorm_rope_kv_insert")


def test_insert_matches_transformers_norm_and_interleaved_rope():
    """An independent oracle of the conventions: transformers' DeepSeek-V4 unweighted RMSNorm
    and `apply_rotary_pos_emb` (interleaved pairs on the trailing 64 values, one cos / sin
    per pair) in float32, against q_out and the rows the cache reads back."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from graphsafe.ops.dsv4.cases import rope_table

    gen = torch.Generator().manual_seed(5)
    t, h, hp, max_pos = 6, 3, 8, 300
    q = torch.randn((t, h, 512), generator=gen).bfloat16()
    kv = (torch.randn((t, 512), generator=gen) * 2).bfloat16()
    positions = torch.tensor([0, 7, 299, 64, 1, 150])
    table = rope_table(max_pos)
    cos, sin = table[positions, :32][None], table[positions, 32:][None]  # [1, T, 32]
    norm = modeling.DeepseekV4UnweightedRMSNorm(eps=1e-6)
    want_q = modeling.apply_rotary_pos_emb(norm(q.float().transpose(0, 1)[None]), cos, sin)[0].transpose(0, 1)
    want_kv = modeling.apply_rotary_pos_emb(kv.float()[None, None], cos, sin)[0, 0]
    for backend in ("reference", "triton"):
        for cache in (fp8_dsv4.empty_cache(2, 4), torch.zeros(2, 4, 512, dtype=torch.bfloat16)):
            q_out = torch.full((t, hp, 512), float("nan"), dtype=torch.bfloat16)
            slots = torch.tensor([3, 0, 7, 5, 1, 2])
            INSERT.runner(backend)(q, kv, q_out, cache, slots, positions, table, 1e-6)
            torch.testing.assert_close(q_out[:, :h].float(), want_q, rtol=1e-2, atol=1e-2)
            assert q_out[:, h:].eq(0).all()
            if cache.dtype == torch.uint8:
                rows = fp8_dsv4.read_tokens(cache, slots)
                torch.testing.assert_close(rows[:, :448], want_kv[:, :448], rtol=2.0**-4, atol=1e-6)
            else:
                rows = cache.view(-1, 512)[slots].float()
                torch.testing.assert_close(rows[:, :448], want_kv[:, :448], rtol=0, atol=0)
            torch.testing.assert_close(rows[:, 448:], want_kv[:, 448:], rtol=2.0**-8, atol=1e-6)


def test_insert_writes_only_its_tokens_and_padding_tokens_nothing():
    """Record bytes of other tokens, pad bytes' neighbours and the block padding stay as
    they were; a padding token (position -1) writes zeros to all its q_out heads and
    nothing to the cache; tokens past slot_mapping's length are not inserted."""
    gen = torch.Generator().manual_seed(6)
    from graphsafe.ops.dsv4.cases import rope_table

    cache = fp8_dsv4.empty_cache(3, 4)
    storage = torch.as_strided(cache, (3 * cache.stride(0),), (1,))
    storage.copy_(torch.randint(0, 256, storage.shape, generator=gen, dtype=torch.uint8))
    for backend in ("reference", "triton"):
        c = fp8_dsv4.empty_cache(3, 4)
        st = torch.as_strided(c, (3 * c.stride(0),), (1,))
        st.copy_(storage)
        q = torch.randn((4, 2, 512), generator=gen).bfloat16()
        kv = torch.randn((4, 512), generator=gen).bfloat16()
        q_out = torch.randn((4, 2, 512), generator=gen).bfloat16()
        positions = torch.tensor([5, -1, 9, 3])
        INSERT.runner(backend)(q, kv, q_out, c, torch.tensor([6, 2, 11]), positions, rope_table(16), 1e-6)
        assert q_out[1].eq(0).all() and not q_out[0].eq(0).all()
        changed = (st != storage).nonzero()[:, 0]
        block = c.stride(0)
        allowed = set()
        for slot in (6, 11):
            b, tok = divmod(slot, 4)
            d, sc, pad = fp8_dsv4.token_byte_offsets(4, tok)
            allowed |= {b * block + o for o in (*d, *sc, pad)}
        assert set(changed.tolist()) <= allowed, backend
        assert fp8_dsv4.read_tokens(c, torch.tensor([6, 11]))[:, :448].eq(
            fp8_dsv4.dequantize_tokens(*fp8_dsv4.quantize_tokens(kv[[0, 2]].float()))[:, :448]).all()


# -- dsv4_compress_kv -------------------------------------------------------------------------
COMPRESS = graphsafe.get_op("dsv4_compress_kv")


@pytest.mark.parametrize("kind,ratio", [("compressed_sparse_attention", 4), ("heavily_compressed_attention", 8)])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compressor_matches_transformers(kind, ratio, backend):
    """transformers' DeepSeek-V4 compressors (CSA: overlapping windows of 2 x 4 states; HCA:
    non-overlapping windows, here of 8) on the same projections, position bias, norm weight
    and "compress" RoPE, against the entries this op writes for a prefill of 13 tokens
    (one call: windows pool states saved by the same call) into a bf16 row cache."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from graphsafe.ops.dsv4.cases import rope_table

    d, n, theta = 128, 13, 160000.0
    cfg = DeepseekV4Config(hidden_size=64, head_dim=d, q_lora_rank=32, index_n_heads=2, index_head_dim=64,
                           partial_rotary_factor=64 / d, num_hidden_layers=1, compress_rope_theta=theta,
                           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    module = modeling.COMPRESSOR_CLASSES[kind](cfg)
    gen = torch.Generator().manual_seed(7)
    overlap = kind == "compressed_sparse_attention"
    w = 2 * d if overlap else d
    kv = torch.randn((n, w), generator=gen).bfloat16()
    gate = (torch.randn((n, w), generator=gen) * 2).bfloat16()
    with torch.no_grad():
        module.position_bias.copy_(torch.randn(module.position_bias.shape, generator=gen))
        module.kv_norm.weight.copy_(torch.randn(d, generator=gen) * 0.3 + 1)
    module.kv_proj.forward = lambda h: kv.float()[None]  # the projections: these bf16 rows
    module.gate_proj.forward = lambda h: gate.float()[None]
    with torch.no_grad():
        want = module(torch.zeros(1, n, 64), torch.randn(1, n, 32, generator=gen), torch.arange(n)[None], None, 0)[0]
    want = want[0, 0]  # [n // ratio, D]
    assert want.shape == (n // ratio, d)

    sbs = 2
    state = torch.zeros((n // sbs + 1, sbs, 2 * w))
    table = torch.arange(n // sbs + 1, dtype=torch.int32)[None]
    positions = torch.arange(n)
    kv_slots = torch.where((positions + 1) % ratio == 0, positions // ratio, -1)
    cache = torch.full((n // ratio, 1, d), float("nan"), dtype=torch.bfloat16)
    COMPRESS.runner(backend)(kv, gate, module.position_bias.detach().float(), positions, state, positions, table,
                             torch.zeros(n, dtype=torch.int32), module.kv_norm.weight.detach().float(), 1e-6,
                             rope_table(n, theta), cache, kv_slots, ratio)
    torch.testing.assert_close(cache[:, 0].float(), want, rtol=1e-2, atol=1e-2)


# The GPU contract (tests/test_contract_gpu.py) builds each op's `gpu_examples` on the host
# before moving them to the device: a pytest worker that runs out of host memory dies
# ("node down"), whatever the op's kernel does.
HOST_ADDRESS_SPACE = 16 << 30
EXAMPLE_BYTES = 1 << 30
_BUILD_GPU_EXAMPLES = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import torch
from graphsafe.testing import case_for
for name in {names!r}:
    case = case_for(name)
    for i, params in enumerate(case.gpu_examples):
        try:
            args = case.inputs(params, torch.device("cpu"), 7)
        except (MemoryError, RuntimeError) as err:
            print(f"{{name}} gpu_examples[{{i}}]: {{str(err).splitlines()[0][:200]}}")
            continue
        held = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
        print(f"{{name}} gpu_examples[{{i}}]: {{held}} bytes")
print("DONE")
"""


def test_gpu_examples_build_in_bounded_host_memory():
    """Each DeepSeek-V4 op's realistic GPU shapes build on the host within 16 GiB of address
    space and hold at most 1 GiB of tensors. The compressor's decode example (64 requests at
    positions up to 258k) once allocated a state block for every earlier position of every
    request: a 135 GB state cache, which killed the GPU run's pytest workers."""
    import os
    import pathlib
    import subprocess
    import sys

    from graphsafe.testing import case_for

    names = sorted(n for n in graphsafe.op_table() if graphsafe.get_op(n).family == "dsv4")
    assert "dsv4_compress_kv" in names
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = _BUILD_GPU_EXAMPLES.format(limit=HOST_ADDRESS_SPACE, names=names)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()[:-1]
    assert len(lines) == sum(len(case_for(n).gpu_examples) for n in names)
    for line in lines:
        assert line.endswith(" bytes") and int(line.split()[-2]) <= EXAMPLE_BYTES, line


def test_bench_caches_hold_their_quantised_rows():
    """`graphsafe.ops.dsv4.bench.record_cache` (the caches of `decode_inputs`: the bench's
    and the FlashMLA comparison's, tests/test_dsv4_gpu.py) holds, block after block, the
    bytes `quantize_tokens` gives its random rows. It once wrote them into a copy
    (`view.reshape` of blocks 37440 bytes apart) and left the cache uninitialised, so
    graphsafe and FlashMLA were compared on stale device memory."""
    from graphsafe.ops.dsv4 import bench

    nb = 3
    cache = bench.record_cache(nb * bench.BLOCK_SIZE - 5, torch.device("cpu"), torch.Generator().manual_seed(3))
    assert cache.shape[:2] == (nb, bench.BLOCK_SIZE) and cache.stride(0) == fp8_dsv4.padded_block_bytes(64) != 64 * 584
    rows = torch.randn((nb * bench.BLOCK_SIZE, bench.D), generator=torch.Generator().manual_seed(3))
    want_data, want_scales = fp8_dsv4.quantize_tokens(rows)
    data, scales = fp8_dsv4.block_views(cache)
    assert torch.equal(data.reshape(-1, fp8_dsv4.DATA_BYTES), want_data)
    assert torch.equal(scales.reshape(-1, fp8_dsv4.SCALE_BYTES), want_scales)
    q, swa, idx, scale, sink, length, comp, xidx, xlength = bench.decode_inputs(2, 64, 128, 64, torch.device("cpu"))
    for c, i in ((swa, idx), (comp, xidx)):
        assert c.shape[0] > 1 and torch.isfinite(fp8_dsv4.read_tokens(c, i.long())).all()
