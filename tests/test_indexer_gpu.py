"""GPU tests of the sparse-indexer family: realistic
shapes against the reference with NaN-poisoned outputs, bit-exact quantisation across
devices, the fp16 fallback path, and a whole indexer pipeline captured in one CUDA graph
and replayed with new context lengths, without host syncs."""

from __future__ import annotations

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe.ops.indexer.bench import paged_inputs
from graphsafe.ops.indexer import reference as ref
from graphsafe.ops.indexer import triton as tri
from graphsafe.testing import no_sync
from graphsafe.ops.indexer import cases as cases
from graphsafe.testing.contract import clone_args

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
NEG_INF = float("-inf")


def _nan(shape):
    return torch.full(shape, float("nan"), device=CUDA)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("batch,ctx", [(128, 32768), (32, 4096), (1, 32768)])
def test_paged_logits_at_benchmark_shapes(next_n, batch, ctx):
    q, cache, w, _, table, _ = paged_inputs(batch, ctx, next_n, CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    # Uneven contexts (some exactly next_n) and a max_model_len past them all.
    lens = torch.randint(next_n, ctx + 1, (batch,), device=CUDA, generator=gen, dtype=torch.int32)
    lens[0] = next_n
    length = ctx  # block_table covers exactly ctx tokens
    expected = ref.fp8_paged_mqa_logits(q, cache, w, lens, table, length)
    out = _nan((batch * next_n, length))
    tri.paged_mqa_logits_into(out, q, cache, w, lens, table, length)
    cases.compare_logits(expected, out)


@pytest.mark.parametrize("block_size", [1, 64])
def test_paged_logits_fp16_path_equals_fp8_path(block_size):
    q, cache, w, lens, table, length = paged_inputs(16, 4096, 2, CUDA, block_size=block_size)
    a, b = _nan((32, length)), _nan((32, length))
    tri.paged_mqa_logits_into(a, q, cache, w, lens, table, length, fp8_dot=True)
    tri.paged_mqa_logits_into(b, q, cache, w, lens, table, length, fp8_dot=False)
    cases.compare_logits(b, a)
    cases.compare_logits(ref.fp8_paged_mqa_logits(q, cache, w, lens, table, length), a)


@pytest.mark.parametrize("window", ["causal", "random", "full"])
def test_mqa_logits_large(window):
    p = {"M": 2048, "N": 4096 + 77, "H": 64, "D": 128, "window": window}
    q, k, k_scale, w, ks, ke = case_for("fp8_mqa_logits").inputs(p, CUDA, seed=3)
    out = _nan((p["M"], p["N"]))
    tri.mqa_logits_into(out, q, k, k_scale, w, ks, ke)
    cases.compare_logits(ref.fp8_mqa_logits(q, k, k_scale, w, ks, ke), out)


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
def test_quantisation_is_bit_exact_across_devices(fmt):
    """Triton on the GPU == reference on the GPU == reference on the CPU, byte for byte."""
    p = {"T": 8192, "D": 128, "groups": 1, "block_size": 64, "dtype": torch.bfloat16, "scale_fmt": fmt, "strided_cache": False}
    args = case_for("indexer_k_quant_and_cache").inputs(p, "cpu", seed=4)
    cpu = clone_args(args)
    ref.indexer_k_quant_and_cache(*cpu)
    gpu_ref = tuple(a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args)
    gpu_tri = clone_args(gpu_ref)
    ref.indexer_k_quant_and_cache(*gpu_ref)
    tri.prepare_indexer_k_quant_and_cache(graphsafe.get_op("indexer_k_quant_and_cache").call(*gpu_tri))(*gpu_tri)
    assert torch.equal(gpu_tri[1].cpu(), cpu[1])
    assert torch.equal(gpu_ref[1].cpu(), cpu[1])


def _pipeline(k, cache, slots, table, cu, dst_k, dst_s, q_pre, w_pre, ks, ke, q_dec, w_dec, lens, req, topk, length):
    graphsafe.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
    graphsafe.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, table, cu)
    pre = graphsafe.fp8_mqa_logits(q_pre, dst_k, dst_s, w_pre, ks, ke)
    dec = graphsafe.fp8_paged_mqa_logits(q_dec, cache, w_dec, lens, table, length)
    slots_out = graphsafe.req_local_to_global_slots(req, table, topk, 64)
    return pre, dec, slots_out


def _pipeline_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    b, per_req, bs, d, length = 4, 16, 64, 128, 1024
    nb = b * per_req
    table = torch.randperm(nb, generator=gen).view(b, per_req).int()
    lens = torch.randint(2, length + 1, (b,), generator=gen).int()
    t = 256
    slots = torch.randperm(nb * bs, generator=gen)[:t]  # distinct: one writer per slot
    slots = torch.where(torch.rand(t, generator=gen) < 0.1, -1, slots)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    n = b * length
    ks = torch.zeros(64, dtype=torch.int32)
    ke = torch.randint(0, n + 1, (64,), generator=gen).int()
    host = dict(
        k=torch.randn(t, d, generator=gen).bfloat16(),
        cache=cases.random_cache(nb, bs, d, 1, "cpu", gen),
        slots=slots, table=table, cu=cu,
        dst_k=torch.zeros(n, d, dtype=cases.FP8), dst_s=torch.zeros(n),
        q_pre=cases.fp8_randn((64, 64, d), "cpu", gen), w_pre=torch.randn(64, 64, generator=gen), ks=ks, ke=ke,
        q_dec=cases.fp8_randn((b, 2, 64, d), "cpu", gen), w_dec=torch.randn(b * 2, 64, generator=gen), lens=lens,
        req=torch.randint(0, b, (t,), generator=gen).int(),
        topk=torch.randint(-1, length, (t, 2048), generator=gen).int(),
    )
    return {key: v.to(CUDA) for key, v in host.items()}, length


def test_indexer_pipeline_captures_and_replays_with_new_contexts():
    static, length = _pipeline_inputs(1)
    fresh, _ = _pipeline_inputs(2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _pipeline(**{k: v.clone() for k, v in static.items()}, length=length)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _pipeline(**static, length=length)
    for key in static:
        static[key].copy_(fresh[key])
    with no_sync():
        graph.replay()
    eager = {k: v.clone() for k, v in fresh.items()}
    expected = _pipeline(**eager, length=length)
    torch.cuda.synchronize()
    cases.compare_logits(expected[0], outs[0])
    cases.compare_logits(expected[1], outs[1])
    assert torch.equal(expected[2], outs[2])
    assert torch.equal(eager["cache"], static["cache"])
    assert torch.equal(eager["dst_k"].view(torch.uint8), static["dst_k"].view(torch.uint8))


def test_indexer_pipeline_under_inductor_fullgraph():
    args, length = _pipeline_inputs(3)
    compiled = torch.compile(_pipeline, fullgraph=True, backend="inductor")
    eager = {k: v.clone() for k, v in args.items()}
    got = compiled(**args, length=length)
    want = _pipeline(**eager, length=length)
    cases.compare_logits(want[0], got[0])
    cases.compare_logits(want[1], got[1])
    assert torch.equal(want[2], got[2])
