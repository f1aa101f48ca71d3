"""The sm_90 Gluon kernel of `paged_attention_prefill` (`gluon_prefill.paged_fwd_tma_kernel`)
on the CPU: its launches, as `prepare_paged_attention_prefill` binds them, compile for
sm_90 (wgmma shapes, TMA copies per key tile, shared memory within the plan's estimate);
where it runs (`plan.paged_gluon_plan` on stand-in sm_90 tensors); the launch's fallback
to the Triton kernel (misaligned inputs, a failed compile). Its numerics are checked on
the GPU (tests/test_paged_prefill_gpu.py).
"""

from __future__ import annotations

import inspect
import math
import types
import warnings

import pytest
import torch

from graphsafe import device_info
from graphsafe.ops.attention import plan as P
from graphsafe.ops.attention import triton as T
from graphsafe.testing.compile_scripts import SPECIALISE_PRELUDE
from graphsafe.testing.stand_ins import StandInKernel

_PAGED_COMPILE_SCRIPT = r"""
import re, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.attention.kernels import gluon_prefill as G
import torch
from graphsafe.ops.attention import plan as P, triton as T
from graphsafe.ops.attention.kernels import triton_paged_prefill, triton_quant

launches = []

def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record the Gluon launches
    def launch(*tensors):  # (bound_args: SPECIALISE_PRELUDE's, defined by the time a launch runs)
        if kernel is G.paged_fwd_tma_kernel:
            launches.append((bound_args(args, tensors), dict(kw)))
    return launch

for module in (T, triton_paged_prefill, triton_quant):
    module.bind = record
# As on sm_90 (the CPU tensors stand in for CUDA ones, 227 KiB of shared memory): the plan of these shapes.
P.paged_gluon_plan = lambda call: P.with_tma_store(
    P.GluonPlan("paged-tma", 128, P.tma_key_tile(call.q.shape[2], call.window_left >= 0),
                P.warp_specialisation("tma", 128), P.tma_q_buffers(call.q.shape[2])),
    G, call.q.shape[2], call.q.shape[2], 227 * 1024)
""" + SPECIALISE_PRELUDE + r"""
# (dtype, block size, causal): every box count a key tile takes (8, 2, 1, and a block
# spanning two tiles), fp16 once.
CALLS = [(torch.bfloat16, 16, True), (torch.bfloat16, 64, False), (torch.float16, 128, True),
         (torch.bfloat16, 256, True)]
# And the variants (window, softcap, sinks) at block size 16, at D 128 and (64-key tiles) D 64
# and D 256 (one q buffer).
CALLS += [(torch.bfloat16, 16, "variants"), (torch.bfloat16, 16, "variants-d64"), (torch.bfloat16, 16, "variants-d256")]
for dtype, bs, causal in CALLS:
    variants = (255, 30.0, torch.zeros(8)) if str(causal).startswith("variants") else (-1, 0.0, None)
    d = {"variants-d64": 64, "variants-d256": 256}.get(causal, 128)
    q = torch.zeros(600, 8, d, dtype=dtype)
    cache = torch.zeros(64, bs, 2, d, dtype=dtype)
    table = torch.zeros(2, 4096 // bs, dtype=torch.int32)
    lens = torch.full((2,), 4096, dtype=torch.int32)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    before = len(launches)
    T.paged_attention_prefill(q, cache, cache, table, lens, cu, 300, 0.088, bool(causal), None, None, *variants)
    assert len(launches) == before + 1, "the Gluon kernel is bound and launched"
for args, kw in launches:
    kw = dict(kw)
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(G.paged_fwd_tma_kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    ptx = k.asm["ptx"]
    tma_copies = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    bn, d = kw["BLOCK_N"], kw["DK"]
    box = min(kw["PAGE"], bn)
    print("compiled page", kw["PAGE"], "causal", kw["CAUSAL"], "window", kw.get("WINDOW_LEFT"), "softcap",
          kw.get("SOFTCAP"), "sinks", kw.get("HAS_SINKS"), "O_BUFFERS", kw["O_BUFFERS"], "shared", k.metadata.shared, shapes,
          "tma", tma_copies)
    # The output by TMA: two [64, D] staging buffers where they fit beside the stages, two
    # [64, D / 2] at D 256 (a row block in two stores); args[3] is out's descriptor template.
    pieces = 2 if d == 256 else 1
    assert kw["O_BUFFERS"] == 2 and list(args[3].block_shape) == [64, d // pieces], (kw, args[3].block_shape)
    # q.k (n BLOCK_N, D / 16 k-steps) and p.V (n D, BLOCK_N / 16 k-steps), each in the loop
    # and once outside it, in each of the two consumer partitions.
    want = {}
    for shape, count in ((f"m64n{bn}k16", 2 * d // 16), (f"m64n{d}k16", 2 * bn // 16)):
        want[shape] = want.get(shape, 0) + 2 * count
    assert shapes == want, (shapes, want)
    # q: two 64-row halves x its 64-column chunks; K: a copy per box and chunk; V: the
    # same twice (a whole tile, and a tile cut by the sequence's end or a window's start
    # whose rows outside are zeroed); each consumer's output store (or its two halves).
    assert tma_copies == (3 * bn // box + 2) * (d // 64) + 2 * pieces, tma_copies
    need = G.shared_memory_bytes(128, bn, d, d, 2, kw["Q_BUFFERS"], o_buffers=kw["O_BUFFERS"], o_pieces=pieces)
    assert k.metadata.shared <= need <= 227 * 1024, (k.metadata.shared, need)
print("OK")
"""


def test_paged_gluon_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """`prepare_paged_attention_prefill`'s Gluon launch (block sizes 16, 64, 128, 256;
    bf16 and fp16; causal or not; window, softcap and sinks) compiles for sm_90 with this Triton: the wgmma shapes and
    counts, one TMA copy per box and 64-column chunk of a key tile, the output by TMA stores
    (a [64, D] block in one, in two halves at D 256), and shared memory within the estimate the plan
    decides by."""
    out = compile_for_sm90(_PAGED_COMPILE_SCRIPT, timeout=900)
    print(out)
    assert out.count("compiled") == 7 and "window 255" in out, out


# -- where the Gluon kernel runs -----------------------------------------------------------------
SM90_SHARED = 232448


@pytest.fixture
def sm90(monkeypatch):
    if P.gluon_module() is None:
        pytest.skip("this Triton has no Gluon (or not the Hopper ops the kernel uses)")
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(P, "max_shared_memory", lambda device: SM90_SHARED)
    monkeypatch.setattr(P.torch.version, "hip", None)
    return monkeypatch


def _stand_in(dtype, shape, stride=None):
    """A CUDA tensor's shape, strides and dtype (all the plan reads), contiguous unless
    `stride` is given."""
    if stride is None:
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=shape,
                                 stride=lambda dim=None: stride if dim is None else stride[dim])


def _call(dtype=torch.bfloat16, d=128, dv=None, bs=16, max_seqlen_q=512, scale=0.088, window_left=-1, softcap=0.0,
          sinks=None, q_stride=None, cache_stride=None, k_dtype=None, table_dtype=torch.int32, lens_dtype=torch.int32,
          num_blocks=1000):
    dv = d if dv is None else dv
    return types.SimpleNamespace(
        q=_stand_in(dtype, (1024, 8, d), q_stride), k_cache=_stand_in(k_dtype or dtype, (num_blocks, bs, 2, d),
                                                                       cache_stride),
        v_cache=_stand_in(dtype, (num_blocks, bs, 2, dv)), block_table=_stand_in(table_dtype, (2, 4096 // bs)),
        seq_lens=_stand_in(lens_dtype, (2,)), max_seqlen_q=max_seqlen_q, scale=scale, window_left=window_left,
        softcap=softcap, sinks=sinks, causal=True)


def _fits(**kw) -> bool:
    return P.paged_gluon_plan(_call(**kw)) is not None


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_calls_fit_on_sm90(sm90, dtype, bs, d):
    """D 64 and 128: 128-key tiles, two q buffers; D 256 64-key tiles and one (shared memory)."""
    assert _fits(dtype=dtype, bs=bs, d=d)
    plan = P.paged_gluon_plan(_call(dtype=dtype, bs=bs, d=d))
    want = (64, 1) if d == 256 else (128, 2)
    assert (plan.name, plan.block_m, (plan.block_n, plan.q_buffers)) == ("gluon-paged-tma", 128, want)


def test_a_window_at_d64_takes_64_key_tiles(sm90):
    """The key tile as the varlen TMA kernel's (`plan.tma_key_tile`): 64 keys at D 64 with a
    window narrower than a table row's keys, 128 otherwise."""
    tiles = {(d, w): P.paged_gluon_plan(_call(d=d, window_left=w)).block_n for d in (64, 128) for w in (-1, 127, 4096)}
    assert tiles == {(64, -1): 128, (64, 127): 64, (64, 4096): 128, (128, -1): 128, (128, 127): 128, (128, 4096): 128}


def test_the_d256_kernel_needs_its_shared_memory(sm90):
    need = P.gluon_module().shared_memory_bytes(128, 64, 256, 256, 2, 1)
    for smem, fits in ((need, True), (need - 1, False)):
        sm90.setattr(P, "max_shared_memory", lambda device, s=smem: s)
        assert _fits(d=256) == fits, smem


_DECLINED = {
    "64 queries at most (64-row blocks)": dict(max_seqlen_q=64),
    "scale 0": dict(scale=0.0),
    "nan scale": dict(scale=math.nan),
    "D 96": dict(d=96),
    "D 192": dict(d=192),
    "Dv 64 != D 128": dict(dv=64),
    "fp8 cache": dict(k_dtype=torch.float8_e4m3fn),
    "float32": dict(dtype=torch.float32),
    "block size 8": dict(bs=8),
    "block size 48": dict(bs=48),
    "int64 block table": dict(table_dtype=torch.int64),
    "int64 seq_lens": dict(lens_dtype=torch.int64),
    "q heads padded": dict(q_stride=(8 * 144, 144, 1)),
    "q token stride of 8 k + 4 elements": dict(q_stride=(8 * 128 + 4, 128, 1)),
    "cache heads padded": dict(cache_stride=(16 * 2 * 144, 2 * 144, 144, 1)),
    "cache blocks padded": dict(cache_stride=(16 * 256 + 64, 256, 128, 1)),
    "cache of 2^31 rows": dict(num_blocks=2**27),
}


def test_variants_fit_on_sm90(sm90):
    """A window, softcap and sinks are the kernel's constexprs: they keep the Gluon kernel."""
    assert _fits(window_left=127, softcap=30.0, sinks=object())


@pytest.mark.parametrize("case", list(_DECLINED))
def test_other_calls_run_the_triton_kernel_on_sm90(sm90, case):
    assert not _fits(**_DECLINED[case])


def test_the_paged_kernel_needs_its_shared_memory(sm90):
    need = P.gluon_module().shared_memory_bytes(128, 128, 128, 128, 2, 2)
    for smem, fits in ((need, True), (need - 1, False), (None, False)):
        sm90.setattr(P, "max_shared_memory", lambda device, s=smem: s)
        assert _fits() == fits, smem


def test_other_gpus_and_the_cpu_run_the_triton_kernel(sm90):
    assert _fits()
    for capability in ((10, 0), (8, 0)):
        sm90.setattr(device_info, "compute_capability", lambda device, c=capability: c)
        assert not _fits(), capability
    sm90.undo()
    q = torch.zeros(600, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(64, 16, 2, 128, dtype=torch.bfloat16)
    call = types.SimpleNamespace(q=q, k_cache=cache, v_cache=cache, block_table=torch.zeros(2, 4, dtype=torch.int32),
                                 seq_lens=torch.zeros(2, dtype=torch.int32), max_seqlen_q=300, scale=0.08,
                                 window_left=-1, softcap=0.0, sinks=None, causal=True)
    assert P.paged_gluon_plan(call) is None


# -- the launch: the Triton kernel for misaligned calls and failed compiles --------------------
def _bind(monkeypatch, error=None):
    """(Gluon stand-in, Triton launch records, launch, call tensors) for a bf16 block-16
    signature bound by `bind_gluon_paged_prefill`."""
    real = P.gluon_module()
    if real is None:
        pytest.skip("this Triton has no Gluon")
    gluon = StandInKernel(inspect.signature(real.paged_fwd_tma_kernel.fn), error)
    module = types.SimpleNamespace(paged_fwd_tma_kernel=gluon, paged_tma_descriptors=real.paged_tma_descriptors)
    monkeypatch.setattr(P, "gluon_module", lambda: module)
    monkeypatch.setattr(T, "_FAILED", set())
    monkeypatch.setattr(T, "num_sms", lambda device: 132)
    q = torch.zeros(600, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(64, 16, 2, 128, dtype=torch.bfloat16)
    table = torch.zeros(2, 64, dtype=torch.int32)
    lens = torch.full((2,), 1024, dtype=torch.int32)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    call = types.SimpleNamespace(q=q, k_cache=cache, v_cache=cache, block_table=table, seq_lens=lens,
                                 max_seqlen_q=300, scale=0.088, causal=True, window_left=-1, softcap=0.0, sinks=None)
    triton_calls = []
    launch = T.bind_gluon_paged_prefill(call, 2, P.GluonPlan("paged-tma", 128, 128, (2, 232, 32), 2),
                                        lambda *tensors: triton_calls.append(tensors))
    tensors = (q, cache, cache, table, lens, cu, q, q, q, torch.empty(600, 8, 128, dtype=torch.bfloat16))
    return gluon, triton_calls, launch, tensors


def test_aligned_calls_run_the_gluon_kernel(monkeypatch):
    gluon, triton_calls, launch, tensors = _bind(monkeypatch)
    launch(*tensors)
    assert len(gluon.calls) == 1 and not triton_calls
    q, k_cache, v_cache, table, lens, cu, _, _, sinks, out = tensors
    # The kernel's tensor order: q, k_cache, v_cache (as descriptors' bases), out twice (the TMA store's
    # descriptor base, here a plain placeholder: the plan has no staging buffers; the pointer), cu_q, seq_lens,
    # block table, sinks (here a placeholder), the dynamic schedule's ticket counter (this device's and lane's).
    counter = T.schedule_counter(q.device)
    expected = (q, k_cache, v_cache, out, out, cu, lens, table, sinks, counter)
    assert all(a is b for a, b in zip(gluon.calls[0], expected, strict=True))


def test_misaligned_q_runs_the_triton_kernel(monkeypatch):
    gluon, triton_calls, launch, tensors = _bind(monkeypatch)
    q = tensors[0]
    shifted = torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    assert shifted.data_ptr() % 16
    call = (shifted, *tensors[1:])
    launch(*call)
    assert not gluon.calls and len(triton_calls) == 1
    assert all(a is b for a, b in zip(triton_calls[0], call, strict=True))
    assert not T._FAILED


def test_compile_failure_warns_once_and_runs_the_triton_kernel(monkeypatch):
    gluon, triton_calls, launch, tensors = _bind(monkeypatch, RuntimeError("PassManager::run failed"))
    with pytest.warns(RuntimeWarning, match="paged_attention_prefill: the sm_90 Gluon kernel did not compile"):
        launch(*tensors)
    assert (len(gluon.calls), len(triton_calls)) == (1, 1)
    assert T._FAILED == {(torch.bfloat16, 128, 128, 16, True, "paged-tma", (2, 232, 32), -1, 0.0, False)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch(*tensors)
    assert (len(gluon.calls), len(triton_calls)) == (1, 2)


# -- what the plan accepts, TMA can address ----------------------------------------------------------
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _strided(dtype, shape, stride) -> torch.Tensor:
    """A CPU tensor of `shape` and `stride` (over a buffer just large enough)."""
    size = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return torch.zeros(size, dtype=dtype).as_strided(shape, stride)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), d=st.sampled_from([64, 128, 256, 96]),
       bs=st.sampled_from([16, 32, 64, 128, 256, 8, 48]), hk=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 4]), q_pad=st.sampled_from([0, 8, 64, 4]), head_pad=st.sampled_from([0, 0, 0, 16]),
       row_pad=st.sampled_from([0, 8, 4]), block_pad=st.sampled_from([0, 0, 64]), window=st.sampled_from([-1, 127]))
def test_every_accepted_call_has_valid_tma_views(dtype, d, bs, hk, group, q_pad, head_pad, row_pad, block_pad, window):
    """Which strided layouts `paged_gluon_plan` takes (D 64 / 128 / 256, power-of-two blocks
    from 16, heads contiguous, rows of whole 16 bytes, a block's rows one after another),
    and that every call it takes gets TMA descriptors Triton validates (16-byte strides,
    block shapes) from `paged_tma_descriptors`: each cache seen as exactly its [blocks x
    block size, heads x D] rows, boxes of min(block size, the plan's key tile) rows inside
    one block."""
    if P.gluon_module() is None:
        pytest.skip("this Triton has no Gluon")
    hq, num_blocks = hk * group, 4
    q_stride = (hq * (d + head_pad) + q_pad, d + head_pad, 1)
    row = hk * (d + head_pad) + row_pad
    cache_stride = (bs * row + block_pad, row, d + head_pad, 1)
    shapes = {"q": (300, hq, d), "cache": (num_blocks, bs, hk, d)}
    call = types.SimpleNamespace(
        q=_stand_in(dtype, shapes["q"], q_stride), k_cache=_stand_in(dtype, shapes["cache"], cache_stride),
        v_cache=_stand_in(dtype, shapes["cache"], cache_stride), block_table=_stand_in(torch.int32, (2, 8)),
        seq_lens=_stand_in(torch.int32, (2,)), max_seqlen_q=300, scale=d**-0.5, window_left=window, softcap=0.0,
        sinks=None, causal=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_info, "compute_capability", lambda device: (9, 0))
        mp.setattr(P, "max_shared_memory", lambda device: SM90_SHARED)
        mp.setattr(P.torch.version, "hip", None)
        plan = P.paged_gluon_plan(call)
    takes = (d in (64, 128, 256) and bs >= 16 and bs & (bs - 1) == 0 and head_pad == 0 and q_pad % 8 == 0
             and row_pad % 8 == 0 and block_pad == 0)
    assert (plan is not None) == takes
    event(f"the Gluon kernel takes the call: {takes}")
    if plan is None:
        return
    q = _strided(dtype, shapes["q"], q_stride)
    k_cache, v_cache = (_strided(dtype, shapes["cache"], cache_stride) for _ in range(2))
    qd, kd, vd = P.gluon_module().paged_tma_descriptors(q, k_cache, v_cache, plan.block_n)
    box = min(bs, plan.block_n)
    for desc, cache in ((kd, k_cache), (vd, v_cache)):
        assert list(desc.shape) == [num_blocks * bs, hk * d] and list(desc.strides) == [cache.stride(1), 1]
        assert list(desc.block_shape) == [box, 64] and plan.block_n % box == 0 and bs % box == 0
    assert list(qd.shape) == [300, hq * d] and list(qd.strides) == [q.stride(0), 1]
