"""GPU checks of the attention family (H100/H200): realistic Llama /
DeepSeek shapes against the reference, bf16 (which the CPU interpreter cannot check),
the fp8 prefill path and its accuracy bound, split-KV plans frozen into CUDA graphs and
replayed with other lengths (vLLM #51119), workspace sizing helpers, no host sync."""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.device_info import has_fp8_matrix_units
from graphsafe.ops.attention import (
    flash_attn_varlen_workspace,
    fp8_prefill_supported,
    paged_attention_decode_workspace,
    plan,
    plan_decode_splits,
    reference,
)
from graphsafe.ops.attention.fp8 import FP8_DTYPE, quantize_per_tensor
from graphsafe.testing import no_sync
from graphsafe.testing.cases import case_for
from graphsafe.ops.attention.cases import attention_compare, varlen_uses_fp8_products
from graphsafe.workspace import current_workspace_manager, reset_workspace_managers, workspace_bytes

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FP8_REL_L2_BOUND = 0.06  # same bound as tests/test_attention.py and the op's docstring


def _triton():
    from graphsafe.ops.attention import triton as T

    return T


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


LLAMA_DECODE = {"B": 64, "Hk": 8, "group": 4, "D": 128, "Dv": None, "block_size": 16, "max_blocks": 256,
                "dtype": torch.bfloat16, "fp8_cache": False, "strided_cache": False}


@pytest.mark.parametrize("splits", [None, 1, 5, 64])
def test_decode_llama_bf16_against_reference(splits):
    case = case_for("paged_attention_decode")
    args = case.inputs(LLAMA_DECODE, CUDA, seed=21)
    expected = reference.paged_attention_decode(*args)
    actual = _triton().paged_attention_decode(*args, num_splits=splits)
    torch.cuda.synchronize()
    assert not actual.isnan().any()
    attention_compare(expected, actual, args[2].abs().max().item(), torch.bfloat16, False, 0, f"splits={splits}")


def test_decode_graph_captured_short_replayed_long():
    """Capture with every request at length 1, replay at full capacity with new block
    tables: the split plan (shapes only) must serve both."""
    reset_workspace_managers()
    case = case_for("paged_attention_decode")
    params = {**LLAMA_DECODE, "B": 8, "max_blocks": 512}  # ctx up to 8192
    q, kc, vc, table, lens, scale = case.inputs({**params, "seq_lens": [1] * 8}, CUDA, seed=1)[:6]
    fresh = case.inputs({**params, "seq_lens": [8192, 8191, 1, 0, 4096, 17, 8000, 2]}, CUDA, seed=2)
    b, hq, d = q.shape
    assert plan_decode_splits(b, 8, 512, 16, CUDA) > 1
    manager = current_workspace_manager(CUDA)
    manager.reserve(*paged_attention_decode_workspace(b, hq, 8, d, 512, 16, device=CUDA, head_dim=d))
    static = [q, kc, vc, table, lens]
    graphsafe.paged_attention_decode(*static, scale)  # warm-up (Triton compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with manager.locked(), torch.cuda.graph(graph):
        out = graphsafe.paged_attention_decode(*static, scale)
    for dst, src in zip(static, fresh[:5]):
        dst.copy_(src)
    graph.replay()
    expected = reference.paged_attention_decode(*fresh)
    torch.cuda.synchronize()
    attention_compare(expected, out, fresh[2].abs().max().item(), torch.bfloat16, False, 0, "graph replay")
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_decode_no_sync_and_workspace_from_helper():
    reset_workspace_managers()
    case = case_for("paged_attention_decode")
    args = case.inputs(LLAMA_DECODE, CUDA, seed=3)
    graphsafe.paged_attention_decode(*args)
    torch.cuda.synchronize()
    with no_sync():
        graphsafe.paged_attention_decode(*args)
    torch.cuda.synchronize()
    specs = paged_attention_decode_workspace(64, 32, 8, 128, 256, 16, device=CUDA, head_dim=128)
    assert current_workspace_manager(CUDA).stats().peak_request_bytes <= workspace_bytes(*specs)


GQA_PREFILL = {"B": 8, "max_q": 1024, "max_k": 1024, "self_attn": True, "Hk": 8, "group": 4, "D": 128, "Dv": None,
               "causal": True, "dtype": torch.bfloat16, "mode": "off", "descale": "tensor", "pad_q": 5, "pad_k": 0}
MLA_PREFILL = {**GQA_PREFILL, "B": 4, "max_q": 1024, "max_k": 2048, "self_attn": False, "Hk": 16, "group": 1,
               "D": 192, "Dv": 128}


@pytest.mark.parametrize("params", [GQA_PREFILL, {**GQA_PREFILL, "causal": False, "dtype": torch.float16}, MLA_PREFILL],
                         ids=["gqa-causal-bf16", "gqa-full-fp16", "mla-192-128"])
def test_varlen_half_against_reference(params):
    case = case_for("flash_attn_varlen")
    args = case.inputs(params, CUDA, seed=4)
    expected = reference.flash_attn_varlen(*args)
    actual = _triton().flash_attn_varlen(*args)
    torch.cuda.synchronize()
    attention_compare(expected, actual, args[2].abs().max().item(), params["dtype"], False, 0, "varlen")


def test_fp8_probe_matches_the_hardware():
    assert fp8_prefill_supported(CUDA) == has_fp8_matrix_units(CUDA), (
        "fp8 matrix units present but the fp8 probe kernel failed (or the reverse)"
    )


@pytest.mark.parametrize("params", [GQA_PREFILL, MLA_PREFILL], ids=["gqa", "mla"])
def test_fp8_path_accuracy_bound(params):
    """'auto' takes the fp8 path on fp8-capable GPUs; its output stays within the stated
    relative L2 bound of the bf16 reference, and matches the reference's emulation of
    the quantisation within the P-rounding bound."""
    if not fp8_prefill_supported(CUDA):
        pytest.skip("no fp8 prefill on this GPU")
    case = case_for("flash_attn_varlen")
    args = case.inputs({**params, "mode": "auto"}, CUDA, seed=6)
    assert varlen_uses_fp8_products(args)
    fp8_out = graphsafe.flash_attn_varlen(*args)
    bf16_ref = reference.flash_attn_varlen(*args[:12], "off")
    emulated = reference.flash_attn_varlen(*args)
    torch.cuda.synchronize()
    err = _rel_l2(fp8_out, bf16_ref)
    print(f"fp8 path relative L2 error vs bf16 reference: {err:.4f}")
    assert err <= FP8_REL_L2_BOUND
    vmax = args[2].abs().max().item() * (1 + 2**-4)
    attention_compare(emulated, fp8_out, vmax, torch.bfloat16, True, args[2].shape[0], "fp8 vs emulation")


def test_quantisation_kernels_bit_exact_on_gpu():
    """amax of q/k/v (one launch, atomic max), k / V^T quantisation (one launch) and the q
    copy equal `quantize_per_tensor` bit for bit at a Llama prefill shape; V^T padding is
    zero."""
    from graphsafe.ops.attention.kernels import triton_quant as Q

    gen = torch.Generator(device=CUDA).manual_seed(0)
    tk = 4096 * 8 + 5  # not a multiple of 16: V^T has padding columns
    q = torch.randn(tk, 32, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) * 5
    k = torch.randn(tk, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) * 3
    v = torch.randn(tk, 8, 2, 128, device=CUDA, dtype=torch.bfloat16, generator=gen)[:, :, 1]  # strided
    k8 = torch.empty(tk, 8, 128, device=CUDA, dtype=FP8_DTYPE)
    vt = torch.full((8, 128, Q.vt_columns(tk)), 3.0, device=CUDA).to(FP8_DTYPE)
    scales = torch.full((Q.SCALE_SLOTS,), 77.0, device=CUDA)
    out = torch.empty(tk, 32, 128, device=CUDA, dtype=torch.bfloat16)
    cu = torch.zeros(1, device=CUDA, dtype=torch.int32)
    _triton().prepare_fp8_quantisation(q, k, v, cu)(q, k, v, cu, out, k8, vt, scales)
    (want_k, kd), (want_v, vd) = quantize_per_tensor(k), quantize_per_tensor(v)
    assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vt[..., :tk].permute(2, 0, 1).view(torch.uint8), want_v.view(torch.uint8))
    assert not vt[..., tk:].view(torch.uint8).any()
    assert scales[Q.AMAX_Q].item() == q.float().abs().max().item()
    assert scales[Q.DESCALE_K].item() == kd.item() and scales[Q.DESCALE_V].item() == vd.item()
    q8 = torch.empty(tk, 32, 128, device=CUDA, dtype=FP8_DTYPE)
    Q.bind_quantize_q(q)(q, q8, scales)  # the q copy of the sm_90 Gluon kernel's path
    want_q, qd = quantize_per_tensor(q)
    assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8)) and scales[Q.DESCALE_Q].item() == qd.item()


RAGGED_FP8 = {**GQA_PREFILL, "B": 4, "max_q": 2048, "max_k": 2048, "lens_q": [2048 - 5, 17, 1000, 3], "pad_q": 3,
              "mode": "on"}


@pytest.mark.parametrize("config", [None, (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)])
@pytest.mark.parametrize("params", [RAGGED_FP8, {**MLA_PREFILL, "mode": "on"}, {**RAGGED_FP8, "causal": False}],
                         ids=["gqa-ragged", "mla", "gqa-full"])
def test_fp8_kernel_configs_against_emulation(config, params):
    """The default fp8 tiles and the benchmark's alternatives (graphsafe/bench/cases/
    attention.py) against the reference's emulation of the quantisation. Sequences start
    at keys that are not multiples of 16 (the kernel's masked lead block)."""
    if not fp8_prefill_supported(CUDA):
        pytest.skip("no fp8 prefill on this GPU")
    case = case_for("flash_attn_varlen")
    args = case.inputs(params, CUDA, seed=8)
    actual = _triton().flash_attn_varlen(*args, config=config)
    emulated = reference.flash_attn_varlen(*args)
    torch.cuda.synchronize()
    vmax = args[2].abs().max().item() * (1 + 2**-4)
    attention_compare(emulated, actual, vmax, torch.bfloat16, True, args[2].shape[0], f"fp8 tiles {config}")
    assert _rel_l2(actual, reference.flash_attn_varlen(*args[:12], "off")) <= FP8_REL_L2_BOUND


@pytest.mark.parametrize("lens", [[20, 19, 30], [300, 190, 400]])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_neighbour_nan_stays_out(lens, causal):
    """The fp8 kernel reads V^T in 16-token groups across sequence bounds (its aligned
    key frame); a NaN value in a neighbouring sequence must still not reach a sequence's
    output (p = 0 there, but 0 * NaN = NaN unless those values are zeroed). GPU only:
    Triton's CPU interpreter does not treat e4m3 0x7F as NaN."""
    if not fp8_prefill_supported(CUDA):
        pytest.skip("no fp8 prefill on this GPU")
    case = case_for("flash_attn_varlen")
    params = {**GQA_PREFILL, "B": 3, "max_q": max(lens), "lens_q": lens, "lens_k": lens, "causal": causal,
              "mode": "fp8_inputs", "descale": "tensor", "pad_q": 0, "pad_k": 0}
    args = list(case.inputs(params, CUDA, seed=3))
    first, last = lens[0], lens[0] + lens[1] - 1  # sequence 1's first and last tokens
    v = args[2].clone()
    v[[first, first + 1, last - 1, last]] = float("nan")
    args[2] = v
    actual = _triton().flash_attn_varlen(*args)
    expected = reference.flash_attn_varlen(*args)
    torch.cuda.synchronize()
    clean = torch.ones(actual.shape[0], dtype=torch.bool, device=CUDA)
    clean[first : last + 1] = False  # sequences 0 and 2 see no NaN
    assert not expected[clean].isnan().any()
    assert not actual[clean].isnan().any(), "a neighbouring sequence's NaN reached the output"
    vmax = torch.nan_to_num(v.float(), nan=0.0).abs().max().item() * args[11].item()
    attention_compare(expected[clean], actual[clean], vmax, torch.bfloat16, True, v.shape[0], "neighbour NaN")


FP8_GLUON = {**GQA_PREFILL, "B": 5, "max_q": 1500, "max_k": 1500, "lens_q": [1500, 1, 333, 0, 1200], "pad_q": 9,
             "pad_k": 9, "mode": "fp8_inputs"}


@pytest.mark.parametrize("descale", ["tensor", "per_seq", "none", "negative"])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_gluon_kernel_against_emulation(descale, causal):
    """fp8 inputs at D = 128 with 128-row blocks run the sm_90 fp8 Gluon kernel (TMA, fp8
    wgmma, V^T tiles from 16-token-aligned frames: these sequences start anywhere):
    against the reference's emulation, and near the Triton fp8 kernel, with per-tensor,
    per-(sequence, head), missing and negative descales; no NaN from the padding rows."""
    from graphsafe.ops.attention import triton as T_

    case = case_for("flash_attn_varlen")
    params = {**FP8_GLUON, "causal": causal, "descale": "tensor" if descale == "negative" else descale}
    args = list(case.inputs(params, CUDA, seed=31))
    if descale == "negative":
        args[9] = -args[9]
    q, k, v = args[:3]
    if not plan.gluon_fp8_plan(q, k, v, args[5], False):
        pytest.skip("the fp8 Gluon kernel serves sm_90 GPUs only")
    k[k.shape[0] - 9 :] = float("nan")  # padding rows: no sequence reads them
    v[v.shape[0] - 9 :] = float("nan")
    T = _triton()
    actual = T.flash_attn_varlen(*args)
    triton_kernel = T.flash_attn_varlen(*args, config=(64, 128, 4, 3))
    emulated = reference.flash_attn_varlen(*args)
    torch.cuda.synchronize()
    assert not T_._FAILED, T_._FAILED
    assert not actual.isnan().any()
    scale = 1.0 if args[11] is None else args[11].abs().max().item()
    vmax = torch.nan_to_num(v.float(), nan=0.0).abs().max().item() * scale
    attention_compare(emulated, actual, vmax, torch.bfloat16, True, v.shape[0], f"fp8 Gluon {descale}")
    assert _max_err(actual, triton_kernel) <= 2e-2 * max(vmax, 1.0)


def test_fp8_gluon_kernel_graph_replay():
    """The fp8 Gluon kernel captured once and replayed with new fp8 inputs and lengths."""
    from graphsafe.ops.attention import triton as T_

    case = case_for("flash_attn_varlen")
    args = list(case.inputs({**FP8_GLUON, "lens_q": [1000, 1000, 500, 0, 1500]}, CUDA, seed=32))
    if not plan.gluon_fp8_plan(*args[:3], args[5], False):
        pytest.skip("the fp8 Gluon kernel serves sm_90 GPUs only")
    runner = _triton().prepare_flash_attn_varlen(graphsafe.get_op("flash_attn_varlen").call(*args))
    runner(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner(*args)
    fresh = case.inputs({**FP8_GLUON, "lens_q": [700, 1500, 1, 299, 1000]}, CUDA, seed=33)
    for dst, src in zip(args, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    expected = reference.flash_attn_varlen(*args)
    torch.cuda.synchronize()
    assert not T_._FAILED
    vmax = args[2].float().abs().max().item() * args[11].abs().max().item()
    attention_compare(expected, out, vmax, torch.bfloat16, True, args[2].shape[0], "fp8 Gluon graph replay")


def test_negative_scales_on_gpu():
    """A negative score scale moves into q's sign bits (bf16 and fp8 kernels)."""
    case = case_for("flash_attn_varlen")
    for mode in ("off", "on"):
        args = list(case.inputs({**GQA_PREFILL, "B": 2, "max_q": 256, "max_k": 256, "mode": mode}, CUDA, seed=9))
        args[7] = -args[7]
        actual = _triton().flash_attn_varlen(*args)
        expected = reference.flash_attn_varlen(*args)
        torch.cuda.synchronize()
        vmax = args[2].abs().max().item() * (1 + 2**-4 if mode == "on" else 1)
        attention_compare(expected, actual, vmax, torch.bfloat16, mode == "on", args[2].shape[0] if mode == "on" else 0,
                          f"negative scale {mode}")


def test_varlen_fp8_graph_capture_with_reserved_workspace():
    """The fp8 path (quantisation scratch from the workspace) captures into a graph
    after `flash_attn_varlen_workspace` sized the arena, and replays with new lengths."""
    reset_workspace_managers()
    case = case_for("flash_attn_varlen")
    params = {**GQA_PREFILL, "B": 4, "max_q": 512, "max_k": 512, "mode": "auto"}
    static = list(case.inputs(params, CUDA, seed=1))
    fresh = case.inputs(params, CUDA, seed=2)
    q, k, v = static[:3]
    manager = current_workspace_manager(CUDA)
    manager.reserve(*flash_attn_varlen_workspace(q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2]))
    graphsafe.flash_attn_varlen(*static)  # warm-up: Triton compiles, the fp8 probe runs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with manager.locked(), torch.cuda.graph(graph):
        out = graphsafe.flash_attn_varlen(*static)
    for i in range(5):
        static[i].copy_(fresh[i])
    graph.replay()
    expected = graphsafe.flash_attn_varlen(*fresh)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # same kernels, same inputs
    with no_sync():
        graphsafe.flash_attn_varlen(*fresh)
    torch.cuda.synchronize()


@pytest.mark.parametrize("op", ["paged_attention_decode", "flash_attn_varlen", "paged_attention_prefill"])
def test_strided_sinks_are_read_by_their_stride(op):
    """`sinks` may be any float32 `[Hq]` view: the kernels read it by its stride (an every
    other element view and a stride-0 expansion give the contiguous copy's result). The
    CPU interpreter did not show a kernel that ignored the stride: a GPU test."""
    case = case_for(op)
    args = list(case.inputs({**case.example, "sinks": True}, CUDA, seed=5))
    sinks = args[-1]
    wide = torch.zeros(2 * sinks.numel(), device=CUDA)
    wide[::2] = sinks
    expected = getattr(graphsafe, op)(*args)
    for view, contiguous in ((wide[::2], sinks), (sinks[:1].expand(sinks.numel()), sinks[:1].repeat(sinks.numel()))):
        reference = expected if contiguous is sinks else getattr(graphsafe, op)(*args[:-1], contiguous)
        assert torch.equal(getattr(graphsafe, op)(*args[:-1], view), reference), op


# -- the sm_90 Gluon kernel of flash_attn_varlen (ops/attention/kernels/gluon_prefill.py) ----------------
# (lens_q, lens_k, Hq, Hk, D, dtype, causal): one tile; ragged lengths with 1-token sequences;
# more keys than queries (chunked prefill); more queries than keys (rows that see no key);
# empty sequences at D = 64; every sequence short (64-row tiles); a long GQA batch (the
# persistent kernel: ~8 work tiles a program, its K/V ring and q buffers carried across them);
# many sequences of odd lengths and empty ones at D = 128 (work tiles past their rows skipped).
def _wgmma_case(lens_q, lens_k, hq, hk, d, dtype, causal, kernel, dv=None, layout="contiguous"):
    return (lens_q, lens_k, hq, hk, d, d if dv is None else dv, dtype, causal, layout, kernel)


_RAGGED = [300, 1, 77, 1000]
# kernel: the Gluon kernel the case must run (plan.varlen_kernel): "tma" for 128-row
# blocks with contiguous heads, "ws" with padded heads, "wgmma" for 64-row blocks and D = 64.
WGMMA_VARLEN_CASES = {
    "one-tile": _wgmma_case([128], [128], 4, 4, 128, torch.bfloat16, True, "tma"),
    "ragged-causal": _wgmma_case(_RAGGED, _RAGGED, 8, 2, 128, torch.bfloat16, True, "tma"),
    "ragged-full-fp16": _wgmma_case(_RAGGED, _RAGGED, 8, 2, 128, torch.float16, False, "tma"),
    "prefix-keys": _wgmma_case([50, 200, 129], [700, 200, 1029], 4, 1, 128, torch.bfloat16, True, "tma"),
    "rows-see-no-key": _wgmma_case([512, 10], [100, 10], 4, 2, 128, torch.bfloat16, True, "tma"),
    "empty-seqs-d64": _wgmma_case([0, 64, 0, 200], [0, 64, 5, 200], 4, 2, 64, torch.bfloat16, True, "tma"),
    "full-d64-fp16": _wgmma_case([256, 333], [256, 333], 4, 4, 64, torch.float16, False, "tma"),
    "short-d64": _wgmma_case([60, 0, 33], [60, 5, 300], 4, 2, 64, torch.bfloat16, True, "wgmma"),
    "gemma-d256-ragged": _wgmma_case(_RAGGED, _RAGGED, 4, 2, 256, torch.bfloat16, True, "tma"),
    "d256-prefix-full-fp16": _wgmma_case([50, 200, 129], [700, 200, 1029], 4, 2, 256, torch.float16, False, "tma"),
    "padded-heads-d64": _wgmma_case([256, 333], [256, 333], 4, 2, 64, torch.bfloat16, True, "wgmma", layout="padded"),
    "short-64-row-tiles": _wgmma_case([60, 40], [60, 400], 8, 8, 128, torch.bfloat16, True, "wgmma"),
    "llama-2x2048": _wgmma_case([2048] * 2, [2048] * 2, 32, 8, 128, torch.bfloat16, True, "tma"),
    "many-ragged-d128": _wgmma_case([0, 5, 0, 130, 1, 0, 64, 257, 700, 129, 3, 0],
                                    [0, 9, 4, 130, 1, 0, 80, 257, 900, 129, 3, 2], 8, 2, 128, torch.float16, True,
                                    "tma"),
    "qkv-projection-views": _wgmma_case(_RAGGED, _RAGGED, 8, 2, 128, torch.bfloat16, True, "tma", layout="qkv"),
    "padded-heads-cp-async": _wgmma_case(_RAGGED, _RAGGED, 8, 2, 128, torch.bfloat16, True, "ws", layout="padded"),
    "padded-heads-cp-async-full": _wgmma_case([129, 700], [129, 700], 4, 4, 128, torch.float16, False, "ws",
                                              layout="padded"),
    "mla-d192-ragged-causal": _wgmma_case(_RAGGED, _RAGGED, 16, 16, 192, torch.bfloat16, True, "tma", dv=128),
    "mla-d192-prefix-full-fp16": _wgmma_case([50, 200, 129], [700, 200, 1029], 8, 8, 192, torch.float16, False,
                                             "tma", dv=128),
    "mla-d192-rows-see-no-key": _wgmma_case([512, 10], [100, 10], 4, 4, 192, torch.bfloat16, True, "tma", dv=128),
    "mla-d192-llama-like": _wgmma_case([2048] * 2, [2048] * 2, 16, 16, 192, torch.bfloat16, True, "tma", dv=128),
}
WGMMA_PAD = 16  # rows past every sequence; NaN in k and v, which no sequence may read


def _wgmma_inputs(lens_q, lens_k, hq, hk, d, dtype, seed, dv=None, layout="contiguous"):
    """q, k, v ([sum + WGMMA_PAD, H, d], k and v NaN past the last sequence), cu_q, cu_k.
    layout "qkv": views of one projection output [T, (Hq + Hk) d + Hk dv] (lens_q = lens_k);
    "padded": each head's row padded to 144 columns (no TMA view)."""
    dv = d if dv is None else dv
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    tq, tk = sum(lens_q) + WGMMA_PAD, sum(lens_k) + WGMMA_PAD

    def rand(t, h, width):
        return torch.randn(t, h, width, device=CUDA, dtype=dtype, generator=gen)

    if layout == "qkv":
        assert tq == tk
        qkv = rand(tq, 1, (hq + hk) * d + hk * dv)[:, 0]
        q = qkv[:, : hq * d].view(tq, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(tk, hk, d)
        v = qkv[:, (hq + hk) * d :].view(tk, hk, dv)
    elif layout == "padded":
        q, k, v = rand(tq, hq, 144)[..., :d], rand(tk, hk, 144)[..., :d], rand(tk, hk, 144)[..., :dv]
    else:
        q, k, v = rand(tq, hq, d), rand(tk, hk, d), rand(tk, hk, dv)
    k[sum(lens_k) :] = float("nan")
    v[sum(lens_k) :] = float("nan")
    cu_q, cu_k = (torch.tensor([0, *lens], device=CUDA).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    return q, k, v, cu_q, cu_k


def _float_reference(args):
    """The reference on float32 copies of q, k, v, cast to their dtype."""
    q = args[0]
    floats = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return reference.flash_attn_varlen(*floats).to(q.dtype)


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _skip_unless_wgmma(args):
    """Skip where the Gluon kernel does not serve the call (not an sm_90 GPU, no Gluon)."""
    from graphsafe.ops.attention.plan import gluon_plan

    q, k, v, _, _, max_seqlen_q, _, scale = args[:8]
    if not gluon_plan(q, k, v, max_seqlen_q, scale, False):
        pytest.skip("the Gluon varlen kernel serves sm_90 GPUs only")


def _assert_gluon_compiled():
    from graphsafe.ops.attention import triton as T_

    assert not T_._FAILED, f"the Gluon kernel did not compile for {T_._FAILED}: Triton ran"


@pytest.mark.parametrize("case", list(WGMMA_VARLEN_CASES))
def test_varlen_wgmma_kernel_against_reference(case):
    """The Gluon kernel (the default bf16/fp16 path on sm_90) against the float32 reference:
    within twice the Triton kernel's error (or 2e-2), no NaN (the NaN rows past the last
    sequence are never read)."""
    lens_q, lens_k, hq, hk, d, dv, dtype, causal, layout, kernel = WGMMA_VARLEN_CASES[case]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens_q, lens_k, hq, hk, d, dtype, seed=25, dv=dv, layout=layout)
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), d**-0.5, causal)
    _skip_unless_wgmma(args)
    assert plan.varlen_kernel(max(lens_q), d, dv, plan.tma_views(q, k, v)) == kernel
    T = _triton()
    actual = T.flash_attn_varlen(*args)
    triton_kernel = T.flash_attn_varlen(*args, config=plan.varlen_config(CUDA, d, dv, False, max(lens_q)))
    expected = _float_reference(args)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    err, triton_err = _max_err(actual, expected), _max_err(triton_kernel, expected)
    print(f"{case}: Gluon max error {err:.3g}, Triton {triton_err:.3g}")
    assert not actual.isnan().any()
    assert err <= max(2 * triton_err, 2e-2), (err, triton_err)


@pytest.mark.parametrize(("d", "dv"), [(128, 128), (192, 128)])
def test_varlen_wgmma_graph_replay_with_new_lengths(d, dv):
    """Captured once (max_seqlen 600), replayed with other cu_seqlens, an empty sequence
    among them, and new q, k, v: each replay matches the reference."""
    lens = [500, 300]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens, lens, 8, 2, d, torch.bfloat16, seed=26, dv=dv)
    args = (q, k, v, cu_q, cu_k, 600, 600, d**-0.5, True)
    _skip_unless_wgmma(args)
    runner = _triton().prepare_flash_attn_varlen(graphsafe.get_op("flash_attn_varlen").call(*args))
    runner(*args)  # warm-up: the kernels compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner(*args)
    _assert_gluon_compiled()
    gen = torch.Generator(device=CUDA).manual_seed(27)
    for new_lens in ([600, 200], [100, 600], [600, 0]):
        cu = torch.tensor([0, new_lens[0], sum(new_lens)], device=CUDA, dtype=torch.int32)
        cu_q.copy_(cu)
        cu_k.copy_(cu)
        for x in (q, k, v):
            x[: sum(lens)].normal_(generator=gen)  # the NaN rows past 800 stay
        graph.replay()
        expected = _float_reference(args)
        torch.cuda.synchronize()
        err = _max_err(out, expected)
        assert not out.isnan().any() and err < 2e-2, (new_lens, err)


@pytest.mark.parametrize(("hq", "hk", "d", "dv"), [(32, 8, 128, 128), (16, 16, 192, 128), (8, 4, 256, 256)],
                         ids=["gqa-d128", "mla-d192", "d256"])
def test_varlen_tma_eager_call_makes_no_host_sync(hq, hk, d, dv):
    """An eager bf16 call on the TMA kernel (static deal at GQA D 128, claimed tiles at D
    192 and 256; the output by TMA, in two halves at D 192 / 256) under sync-debug
    "error": no host sync, and its output the reference's."""
    lens = [1024, 300, 700]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens, lens, hq, hk, d, torch.bfloat16, seed=28, dv=dv)
    args = (q, k, v, cu_q, cu_k, max(lens), max(lens), d**-0.5, True)
    _skip_unless_wgmma(args)
    graphsafe.flash_attn_varlen(*args)  # warm-up: compiles, plans, reserves the workspace
    torch.cuda.synchronize()
    with no_sync():
        out = graphsafe.flash_attn_varlen(*args)
    _assert_gluon_compiled()
    expected = _float_reference(args)
    torch.cuda.synchronize()
    assert not out.isnan().any() and _max_err(out, expected) < 2e-2, _max_err(out, expected)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_varlen_tma_claimed_schedule_matches_the_static_deal(monkeypatch, fp8):
    """The TMA kernel's work tiles claimed one at a time from the ticket counter (forced
    here: `plan.tma_claims_tiles` keeps the static deal at these heads) against the static
    deal on uneven sequences (8192 work tiles on one program per SM, most of them past a
    short sequence's rows): the same bits (a tile's rows do not depend on which program
    computes them), and the ticket counter back at 0 after every call, eager and replayed
    in a CUDA graph."""
    lens = [4096, 37, 1500, 2048, 1, 700, 3000, 129]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens, lens, 32, 8, 128, torch.bfloat16, seed=31)
    if fp8:  # (the fp8 path's per-tensor scales read every row: no NaN past the last sequence here)
        k.nan_to_num_(0.0)
        v.nan_to_num_(0.0)
    args = (q, k, v, cu_q, cu_k, max(lens), max(lens), 128**-0.5, True, None, None, None, "on" if fp8 else "off")
    _skip_unless_wgmma(args)
    T = _triton()
    call = graphsafe.get_op("flash_attn_varlen").call(*args)
    monkeypatch.setattr(plan, "tma_claims_tiles", lambda group, d, fp8=False, paged=False: True)
    claimed = T.prepare_flash_attn_varlen(call)
    monkeypatch.setattr(plan, "tma_claims_tiles", lambda group, d, fp8=False, paged=False: False)
    dealt = T.prepare_flash_attn_varlen(call)
    expected = dealt(*args).clone()
    counter = T.schedule_counter(q.device)
    for _ in range(3):
        out = claimed(*args)
        torch.cuda.synchronize()
        _assert_gluon_compiled()
        assert torch.equal(out, expected) and counter.tolist() == [0, 0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = claimed(*args)
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, expected) and counter.tolist() == [0, 0]
    del graph


@pytest.mark.parametrize("claim", [False, True], ids=["static", "claimed"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_varlen_tma_head_sections_match_one_section(monkeypatch, fp8, claim):
    """The work tiles taken section by section of heads (`plan.L2_SECTION_BYTES` set so
    that 3 kv heads make a section of two and a narrower last one: q heads 0-7, then 8-11)
    against every head in one section, on uneven sequences: the same bits (the order of
    the tiles changes no row's arithmetic), so every tile was computed, once, at the rows
    and head it names, under the static deal and with claimed tiles."""
    lens = [2048, 37, 1500, 1, 700, 129]
    hq, hk, d = 12, 3, 128
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens, lens, hq, hk, d, torch.bfloat16, seed=37)
    if fp8:  # (the fp8 path's per-tensor scales read every row: no NaN past the last sequence here)
        k.nan_to_num_(0.0)
        v.nan_to_num_(0.0)
    args = (q, k, v, cu_q, cu_k, max(lens), max(lens), d**-0.5, True, None, None, None, "on" if fp8 else "off")
    _skip_unless_wgmma(args)
    T = _triton()
    call = graphsafe.get_op("flash_attn_varlen").call(*args)
    monkeypatch.setattr(plan, "tma_claims_tiles", lambda group, d, fp8=False, paged=False: claim)
    elem = 1 if fp8 else 2
    monkeypatch.setattr(plan, "L2_SECTION_BYTES", 2 * max(lens) * 2 * d * elem)
    assert plan.tma_heads_per_section(hq, hk, max(lens), d, d, elem) == 8
    sections = T.prepare_flash_attn_varlen(call)
    monkeypatch.setattr(plan, "L2_SECTION_BYTES", None)
    assert plan.tma_heads_per_section(hq, hk, max(lens), d, d, elem) == hq
    whole = T.prepare_flash_attn_varlen(call)
    expected = whole(*args).clone()
    out = sections(*args)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    assert torch.equal(out, expected)
    if fp8:  # the sections' output is the fp8 path's: within its stated bound of the reference
        assert _rel_l2(out, _float_reference((*args[:12], "off"))) <= FP8_REL_L2_BOUND
    else:
        assert _max_err(out, _float_reference(args)) < 0.02


# name: (lens_q, lens_k, D, Dv, causal, window_left, softcap, sinks): the TMA kernel's variants.
TMA_VARIANT_CASES = {
    "window-100": ([300, 1, 77, 1000], [300, 1, 77, 1000], 128, 128, True, 100, 0.0, False),
    "window-100-over-prefix": ([300, 200, 129], [2000, 200, 1029], 128, 128, True, 100, 0.0, False),
    "window-0-not-causal": ([300, 700], [900, 700], 128, 128, False, 0, 0.0, False),
    "window-500-not-causal": ([300, 1000], [300, 1000], 128, 128, False, 500, 0.0, False),
    "softcap-30": ([300, 1, 77, 1000], [300, 1, 77, 1000], 128, 128, True, -1, 30.0, False),
    "sinks": ([300, 1, 77, 1000], [300, 1, 77, 1000], 128, 128, True, -1, 0.0, True),
    "all-three": ([2048, 700], [2048, 1500], 128, 128, True, 127, 50.0, True),
    "mla-d192-all-three": ([300, 1000], [800, 1000], 192, 128, True, 255, 30.0, True),
    "gpt-oss-d64-sinks-window": ([2048, 300], [2048, 700], 64, 64, True, 127, 0.0, True),
    "d64-sinks": ([300, 1, 77, 1000], [300, 1, 77, 1000], 64, 64, True, -1, 0.0, True),
    "gemma-d256-window-softcap": ([2048, 300], [2048, 700], 256, 256, True, 1023, 50.0, False),
}


@pytest.mark.parametrize("case", list(TMA_VARIANT_CASES))
def test_varlen_tma_variants_against_reference(case):
    """Sliding window, logit softcap and sinks on the TMA kernel (its constexprs) against
    the float32 reference and the Triton kernel; keys before every row's window are NaN
    (never read), as are the rows past the last sequence."""
    lens_q, lens_k, d, dv, causal, window_left, softcap, with_sinks = TMA_VARIANT_CASES[case]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16, seed=29, dv=dv)
    if window_left >= 0:  # keys no row of their sequence sees (row i sees n >= i + Lk - Lq - window_left)
        for start, n_q, n_k in zip(cu_k[:-1].tolist(), lens_q, lens_k):
            unseen = max(0, n_k - n_q - window_left)
            k[start : start + unseen] = float("nan")
            v[start : start + unseen] = float("nan")
    sinks = torch.randn(8, device=CUDA) * 2 if with_sinks else None
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), d**-0.5, causal, None, None, None, "off", window_left,
            softcap, sinks)
    from graphsafe.ops.attention.plan import choose_flash_attn_varlen

    choice = choose_flash_attn_varlen(graphsafe.get_op("flash_attn_varlen").call(*args))
    if choice.gluon is None:
        pytest.skip("the Gluon varlen kernel serves sm_90 GPUs only")
    assert choice.gluon.kernel == "tma"
    T = _triton()
    actual = T.flash_attn_varlen(*args)
    triton_kernel = T.flash_attn_varlen(*args, config=choice.config)
    expected = _float_reference(args)
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    assert not expected.isnan().any() and not actual.isnan().any()
    err, triton_err = _max_err(actual, expected), _max_err(triton_kernel, expected)
    assert err <= max(2 * triton_err, 2e-2), (err, triton_err)


def test_varlen_wgmma_misaligned_inputs_run_the_triton_kernel():
    """q as a view at a 1-element (2-byte) offset of a bigger buffer: the call of the Gluon
    kernel's signature runs the Triton kernel (bit-equal to it on the same input) and
    matches the aligned call within tolerance."""
    lens = [300, 1, 77, 1000]
    q, k, v, cu_q, cu_k = _wgmma_inputs(lens, lens, 8, 2, 128, torch.bfloat16, seed=28)
    shifted = torch.empty(q.numel() + 1, device=CUDA, dtype=q.dtype)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    rest = (v, cu_q, cu_k, 1000, 1000, 128**-0.5, True)
    _skip_unless_wgmma((shifted, k, *rest))
    T = _triton()
    aligned = T.flash_attn_varlen(q, k, *rest)
    misaligned = T.flash_attn_varlen(shifted, k, *rest)
    triton_kernel = T.flash_attn_varlen(shifted, k, *rest, config=plan.varlen_config(CUDA, 128, 128, False, 1000))
    torch.cuda.synchronize()
    _assert_gluon_compiled()
    assert torch.equal(misaligned, triton_kernel), "the misaligned call ran the Triton kernel"
    assert not misaligned.isnan().any() and _max_err(misaligned, aligned) <= 2e-2
