"""The sm_90 Gluon kernel of `flash_attn_varlen` (ops/attention/kernels/gluon_prefill.py) on the CPU.

Gluon cannot run in Triton's interpreter, so here: its launches, as `prepare_flash_attn_varlen`
binds them, compile for sm_90 (wgmma shapes and shared memory checked in the PTX); where it
runs (`plan.gluon_plan`, on stand-in sm_90 tensors); the launch's fallback to the Triton
kernel (misaligned inputs, a failed compile); and when `prepare_flash_attn_varlen` binds
it at all. Its numerics are checked on the GPU (tests/test_attention_gpu.py).
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
from dataclasses import replace

import pytest
import torch

import graphsafe
from graphsafe import device_info
from graphsafe.ops.attention import plan as P
from graphsafe.ops.attention import triton as T
from graphsafe.testing.compile_scripts import SPECIALISE_PRELUDE
from graphsafe.testing.stand_ins import StandInKernel

# -- compiled for sm_90, without a GPU ---------------------------------------------------------
# (SPECIALISE_PRELUDE: the launcher's specialisation of a recorded launch, and wgmma_shapes.)

_GLUON_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    # The Gluon API the kernel's module uses: a Triton without it has no backend for it.
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma, warpgroup_mma
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
# Outside the guard: an ImportError of the kernel's own module fails the test.
from graphsafe.ops.attention.kernels import gluon_prefill as G
import torch
from graphsafe.ops.attention import plan as P, triton as T
from graphsafe.ops.attention.kernels import triton_prefill, triton_quant

launches = []
KERNELS = {G.varlen_fwd_wgmma_kernel: "wgmma", G.varlen_fwd_ws_kernel: "ws", G.varlen_fwd_tma_kernel: "tma"}

# Record what the launcher binds on an sm_90 device (CPU tensors stand in for CUDA ones);
# the other launches of the runner (the output tail, the Triton kernel) run nothing.
def record(kernel, grid, *args, **kw):  # graphsafe.launch.bind: record the Gluon launches
    def launch(*tensors):  # (bound_args: SPECIALISE_PRELUDE's, defined by the time a launch runs)
        if kernel in KERNELS:
            launches.append((kernel, bound_args(args, tensors), dict(kw)))
    return launch

for module in (T, triton_prefill, triton_quant):
    module.bind = record
# The names choose_flash_attn_varlen calls: every call gets its shapes' Gluon plan (as on sm_90,
# 227 KiB of shared memory: the TMA kernels' output staging buffers where they fit).
SMEM = 227 * 1024
def _plan(q, k, v, max_q, *a, window=False):
    kernel = P.varlen_kernel(max_q, q.shape[2], v.shape[2], P.tma_views(q, k, v))
    plan = P.gluon_plan_for(kernel, max_q, q.shape[2], window=window)
    return P.with_tma_store(plan, G, q.shape[2], v.shape[2], SMEM) if kernel == "tma" else plan
P.gluon_plan = _plan
P.gluon_fp8_plan = lambda q, k, v, max_q, variants, copies=False: P.with_tma_store(
    P.gluon_plan_for("tma-fp8", max_q, q.shape[2], copies), G, q.shape[2], v.shape[2], SMEM)
""" + SPECIALISE_PRELUDE + r"""
# (dtype, D, Dv, max_seqlen_q, head stride of q): every kernel, causal or not, bf16; fp16
# for one launch of each kernel. Heads padded to 144 columns: no TMA view ("ws").
CASES = [(torch.bfloat16, 64, 64, 40, None), (torch.bfloat16, 64, 64, 4096, None), (torch.bfloat16, 128, 128, 40, None),
         (torch.bfloat16, 128, 128, 4096, None), (torch.bfloat16, 128, 128, 4096, 144),
         (torch.bfloat16, 192, 128, 4096, None), (torch.bfloat16, 256, 256, 4096, None)]
CALLS = [(c, causal) for c in CASES for causal in (True, False)]
CALLS += [((torch.float16, 128, 128, 4096, None), True), ((torch.float16, 128, 128, 4096, 144), True),
          ((torch.float16, 64, 64, 40, None), True)]
for (dtype, d, dv, max_q, head_stride), causal in CALLS:
    t = 2 * max_q
    hs = head_stride or d
    q = torch.zeros(t, 8, hs, dtype=dtype)[:, :, :d]
    k = torch.zeros(t, 2, d, dtype=dtype)
    v = torch.zeros(t, 2, dv, dtype=dtype)
    cu = torch.tensor([0, max_q, t], dtype=torch.int32)
    T.flash_attn_varlen(q, k, v, cu, cu, max_q, max_q, d ** -0.5, causal)
    # 128-row blocks with contiguous heads: TMA; padded heads at D 128: cp.async; else one partition.
    want = ("tma" if not head_stride else "ws" if d >= 128 else "wgmma") if max_q > 64 else "wgmma"
    assert KERNELS[launches[-1][0]] == want, (d, max_q, head_stride, launches[-1][0])
# The variants (window, softcap, sinks) on the TMA kernel, as constexprs.
q = torch.zeros(8192, 8, 128, dtype=torch.bfloat16)
k = torch.zeros(8192, 2, 128, dtype=torch.bfloat16)
cu = torch.tensor([0, 4096, 8192], dtype=torch.int32)
T.flash_attn_varlen(q, k, k, cu, cu, 4096, 4096, 0.088, True, None, None, None, "off", 255, 30.0, torch.zeros(8))
assert KERNELS[launches[-1][0]] == "tma", launches[-1][0]
kw = launches[-1][2]
assert (kw["WINDOW_LEFT"], round(kw["SOFTCAP"], 3), kw["HAS_SINKS"]) == (255, 43.281, True), kw
# gpt-oss: D 64, sinks and a 128-token window: the TMA kernel with 64-key tiles.
q64 = torch.zeros(8192, 8, 64, dtype=torch.bfloat16)
k64 = torch.zeros(8192, 2, 64, dtype=torch.bfloat16)
T.flash_attn_varlen(q64, k64, k64, cu, cu, 4096, 4096, 0.125, True, None, None, None, "off", 127, 0.0, torch.zeros(8))
assert KERNELS[launches[-1][0]] == "tma" and launches[-1][2]["BLOCK_N"] == 64, launches[-1][2]
# fp8 inputs (q, k, v float8_e4m3fn, per-tensor descales): the fp8 "tma" kernel.
fp8 = torch.float8_e4m3fn
for causal in (True, False):
    q8, k8, v8 = (torch.zeros(8192, h, 128, dtype=fp8) for h in (8, 2, 2))
    descale = torch.ones(1)
    cu = torch.tensor([0, 4096, 8192], dtype=torch.int32)
    T.flash_attn_varlen(q8, k8, v8, cu, cu, 4096, 4096, 0.088, causal, descale, descale, descale)
    assert KERNELS[launches[-1][0]] == "tma" and launches[-1][2]["FP8"], launches[-1][0]
kinds = sorted(KERNELS[kernel] for kernel, _, _ in launches)
assert kinds == ["tma"] * 13 + ["wgmma"] * 5 + ["ws"] * 3, kinds
# One compile per kernel family (kernel, tile, fp8): its widest head dim, causal (the
# masked diagonal's code too); every launch above was checked for the kernel it binds.
families = {}
for kernel, args, kw in launches:
    key = (kernel, kw["BLOCK_M"], kw["BLOCK_N"], bool(kw.get("FP8")), kw.get("WINDOW_LEFT", -1) >= 0,
           kw.get("DK", kw.get("D")) in (64, 256), kw.get("O_BUFFERS", 0))
    if kernel is G.varlen_fwd_tma_kernel:  # TMA stores: two [64, Dv] buffers where they fit beside the
        # stages, two [64, Dv / 2] at D 192 / 256 (the out descriptor's blocks, args[3])
        assert kw["O_BUFFERS"] == 2, kw
        assert list(args[3].block_shape) == [64, kw["DV"] // (2 if kw["DK"] in (192, 256) else 1)], args[3].block_shape
    rank = (kw.get("DK", kw.get("D")), kw["CAUSAL"])
    if key not in families or rank > families[key][0]:
        families[key] = (rank, (kernel, args, kw))
print("families", len(families))
for _, (kernel, args, kw) in families.values():
    kw = dict(kw)
    warps = kw.pop("num_warps")
    k = triton.compile(specialise(kernel, args, kw, GluonASTSource),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    shapes = wgmma_shapes(k)
    tiles = (kw["BLOCK_M"], kw["BLOCK_N"])
    kind = KERNELS[kernel]
    d, dv = (kw["DK"], kw["DV"]) if kind == "tma" else (kw["D"], kw["D"])
    print("compiled", kind, "fp8" if kw.get("FP8") else "16-bit", "D", d, "Dv", dv, "tiles", tiles, "CAUSAL", kw["CAUSAL"], "warps", warps,
          "O_BUFFERS", kw.get("O_BUFFERS", 0), "shared", k.metadata.shared, shapes)
    # 128-row blocks run a warp-specialised kernel (4 warps at launch), the rest the
    # single-partition one (a warp per 16 rows).
    ws = kind != "wgmma"
    assert ws == (tiles[0] == 128 and (d >= 128 or kind == "tma")), (kind, tiles)
    assert warps == (4 if ws else tiles[0] // 16), warps
    # Per program code: q.k (n = BLOCK_N, D / 16 k-steps) in the prologue and the loop; p.V
    # (n = Dv, BLOCK_N / 16 k-steps) in the loop and after it; the warp-specialised kernels
    # have that code twice (one consumer partition per warpgroup).
    # fp8 wgmma steps through K 32 at a time.
    copies, fp8 = (2 if ws else 1), kw.get("FP8", False)
    step = 32 if fp8 else 16
    want = {}
    for shape, count in ((f"m64n{tiles[1]}k{step}", 2 * d // step), (f"m64n{dv}k{step}", 2 * tiles[1] // step)):
        want[shape] = want.get(shape, 0) + copies * count
    assert shapes == want, (shapes, want)
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    # gluon_plan decides from this estimate: it must cover what the compiler allocates.
    if fp8:
        need = P.fp8_shared_memory(G, *tiles, d, dv, kw["O_BUFFERS"], dv // args[3].block_shape[1])
    else:
        stages, q_buffers = (kw["STAGES"], kw.get("Q_BUFFERS", 2)) if ws else (2, 1)
        assert q_buffers == (P.tma_q_buffers(d) if kind == "tma" else 2 if ws else 1)
        pieces = dv // args[3].block_shape[1] if kw.get("O_BUFFERS", 0) else 1
        need = G.shared_memory_bytes(*tiles, d, dv, stages, q_buffers, o_buffers=kw.get("O_BUFFERS", 0), o_pieces=pieces)
    assert k.metadata.shared <= need, (k.metadata.shared, need, tiles)
print("OK")
"""


def test_gluon_varlen_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The Gluon kernels (sm_90 only, never run by the interpreter), launched as
    `prepare_flash_attn_varlen` launches them (bf16 and fp16; D 64, 128 and 192 / Dv 128;
    causal or not; 64- and 128-row tiles; heads contiguous or padded): which kernel each
    launch binds; then one launch per kernel family (kernel, tile, fp8; its widest head
    dim, causal) compiles for sm_90 with this Triton: the wgmma shapes and counts of the
    q.k and p.V products, and shared memory within Hopper's 227 KiB and within the
    estimate `plan.gluon_plan` decides by."""
    out = compile_for_sm90(_GLUON_COMPILE_SCRIPT, timeout=900)
    print(out)
    families = int(out.split("families ")[1].split()[0])
    assert families >= 4 and out.count("compiled") == families, out  # wgmma, ws, tma, fp8 tma at least


# -- where the Gluon kernel runs -----------------------------------------------------------------
def _gluon_module():
    module = P.gluon_module()
    if module is None:
        pytest.skip("this Triton has no Gluon (or not the Hopper ops the kernel uses)")
    return module


SM90_SHARED = 232448  # an H100's / H200's opt-in shared memory per block


@pytest.fixture
def sm90(monkeypatch):
    """A stand-in sm_90 CUDA device (CUDA, not HIP; capability, shared memory); returns the
    monkeypatch to change either."""
    _gluon_module()
    monkeypatch.setattr(device_info, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(P, "max_shared_memory", lambda device: SM90_SHARED)
    monkeypatch.setattr(P.torch.version, "hip", None)
    return monkeypatch


def _stand_in(dtype, shape, stride=None):
    """A CUDA tensor's shape, strides and dtype (all `gluon_plan` reads), contiguous
    unless `stride` is given."""
    if stride is None:
        stride = (shape[1] * shape[2], shape[2], 1)
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=shape,
                                 stride=lambda dim=None: stride if dim is None else stride[dim])


def _qkv(dtype=torch.bfloat16, d=128, dv=None, k_dtype=None, v_dtype=None, q_stride=None):
    dv = d if dv is None else dv
    q = _stand_in(dtype, (300, 8, d), q_stride)
    k = _stand_in(k_dtype or dtype, (300, 2, d))
    v = _stand_in(v_dtype or dtype, (300, 2, dv))
    return q, k, v


def _fits(q, k, v, max_seqlen_q=300, scale=0.08, variants=False):
    return P.gluon_plan(q, k, v, max_seqlen_q, scale, variants) is not None


@pytest.mark.parametrize("max_seqlen_q", [40, 4096])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_16_bit_calls_fit_on_sm90(sm90, dtype, d, max_seqlen_q):
    assert _fits(*_qkv(dtype, d), max_seqlen_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_prefill_head_dims_fit_with_128_row_blocks_and_tma_views(sm90, dtype):
    """D = 192, Dv = 128 runs the TMA kernel: with 128-row blocks and heads contiguous
    (TMA's 2-D view); 64-row blocks and padded heads run the Triton kernel."""
    assert _fits(*_qkv(dtype, 192, 128), 4096)
    assert P.varlen_kernel(4096, 192, 128, True) == "tma"
    assert not _fits(*_qkv(dtype, 192, 128), 64)
    assert not _fits(*_qkv(dtype, 192, 128, q_stride=(8 * 208, 208, 1)), 4096)


FP8 = torch.float8_e4m3fn
_DECLINED = {
    "a variant on the one-partition kernel (64-row blocks)": lambda: _fits(*_qkv(), 64, variants=True),
    "a variant on the cp.async kernel (padded heads)": lambda: _fits(*_qkv(q_stride=(8 * 144, 144, 1)), variants=True),
    "D=192/Dv=128, 64-row blocks": lambda: _fits(*_qkv(d=192, dv=128), 64),
    "D=192/Dv=192": lambda: _fits(*_qkv(d=192)),
    "D=96": lambda: _fits(*_qkv(d=96)),
    "D=256, 64-row blocks": lambda: _fits(*_qkv(d=256), 64),
    "Dv=64 != D=128": lambda: _fits(*_qkv(d=128, dv=64)),
    "Dv=128 != D=64": lambda: _fits(*_qkv(d=64, dv=128)),
    "fp8": lambda: _fits(*_qkv(FP8)),
    "float32": lambda: _fits(*_qkv(torch.float32)),
    "k of another dtype": lambda: _fits(*_qkv(torch.bfloat16, k_dtype=torch.float16)),
    "v of another dtype": lambda: _fits(*_qkv(torch.float16, v_dtype=torch.bfloat16)),
    "scale 0": lambda: _fits(*_qkv(), scale=0.0),
    "negative scale": lambda: _fits(*_qkv(), scale=-0.08),
    "nan scale": lambda: _fits(*_qkv(), scale=math.nan),
    "inf scale": lambda: _fits(*_qkv(), scale=math.inf),
    "token stride of 8 k + 4 elements": lambda: _fits(*_qkv(q_stride=(8 * 128 + 4, 128, 1))),
    "head stride of 8 k + 4 elements": lambda: _fits(*_qkv(q_stride=(8 * 256, 132, 1))),
    "cp.async: head stride of 16 k + 8 elements": lambda: _fits(*_qkv(q_stride=(8 * 136, 136, 1))),
    "cp.async: token stride of 16 k + 8 elements": lambda: _fits(*_qkv(d=64, q_stride=(8 * 64 + 8, 64, 1)), 40),
    "non-unit last stride": lambda: _fits(*_qkv(q_stride=(8 * 256, 256, 2))),
}


@pytest.mark.parametrize("case", list(_DECLINED))
def test_other_calls_run_the_triton_kernel_on_sm90(sm90, case):
    """Each departure from the plain call declines the Gluon kernel, the rest as in
    test_plain_16_bit_calls_fit_on_sm90."""
    assert not _DECLINED[case]()


def test_d256_fits_the_tma_kernel_with_64_key_tiles_and_one_q_buffer(sm90):
    """Gemma-2's D 256 with 128-row blocks and contiguous heads: the "tma" kernel, 64-key
    tiles and one q buffer (two would not leave shared memory for two key stages)."""
    plan = P.gluon_plan(*_qkv(d=256), 4096, 0.0625, False)
    assert (plan.kernel, plan.block_n, plan.q_buffers) == ("tma", 64, 1)
    assert _fits(*_qkv(d=256), 4096, variants=True)


def test_variants_fit_the_tma_kernel(sm90):
    """A window, softcap or sinks (the TMA kernel's constexprs) keep the "tma" kernel: D 128
    and D 192 / Dv 128 with 128-row blocks and contiguous heads."""
    assert _fits(*_qkv(), 300, variants=True)
    assert _fits(*_qkv(d=192, dv=128), 4096, variants=True)


def test_strided_rows_fit_where_the_copies_can_use_them(sm90):
    """Padded rows fit: for TMA (heads contiguous) a token stride of whole 16-byte groups;
    for the cp.async copies (padded heads, or D = 64) token and head strides of whole
    16-element groups. The strided cases above fail for their stride alone."""
    assert _fits(*_qkv(q_stride=(8 * 128 + 8, 128, 1)))  # TMA
    assert _fits(*_qkv(q_stride=(8 * 144, 144, 1)))  # cp.async, warp-specialised
    assert _fits(*_qkv(d=64, q_stride=(8 * 64 + 16, 64, 1)))  # cp.async, one partition


def _fp8_fits(max_seqlen_q=300, variants=False, **kw):
    return P.gluon_fp8_plan(*_qkv(FP8, **kw), max_seqlen_q, variants) is not None


def test_fp8_inputs_fit_the_fp8_kernel_at_d128_with_tma_views(sm90):
    """fp8 q, k (v is read as the V^T copy the fp8 path writes) at D = Dv = 128 with
    128-row blocks and TMA views run the fp8 kernel; every departure declines it."""
    assert _fp8_fits()
    assert _fp8_fits(q_stride=(8 * 128 + 16, 128, 1))  # padded tokens: whole 16-byte groups
    declined = {
        "64-row blocks": _fp8_fits(64),
        "a variant": _fp8_fits(variants=True),
        "D 64": _fp8_fits(d=64),
        "D 192 / Dv 128": _fp8_fits(d=192, dv=128),
        "padded heads (no TMA view)": _fp8_fits(q_stride=(8 * 144, 144, 1)),
        "token stride of 16 k + 8 bytes": _fp8_fits(q_stride=(8 * 128 + 8, 128, 1)),
        "bf16 k": P.gluon_fp8_plan(*_qkv(FP8, k_dtype=torch.bfloat16), 300, False),
        "bf16 q (quantised inside the op)": P.gluon_fp8_plan(*_qkv(torch.bfloat16), 300, False),
    }
    assert not any(declined.values()), declined
    need = P.fp8_shared_memory(_gluon_module(), 128, 128, 128, 128)
    for smem, fits in ((need, True), (need - 1, False), (None, False)):
        sm90.setattr(P, "max_shared_memory", lambda device, s=smem: s)
        assert _fp8_fits() == fits, smem


def test_hip_and_other_gpus_run_the_triton_kernel(sm90):
    q, k, v = _qkv()
    assert _fits(q, k, v)
    for capability in ((10, 0), (8, 0), (9, 1)):
        sm90.setattr(device_info, "compute_capability", lambda device, c=capability: c)
        assert not _fits(q, k, v), capability
    sm90.setattr(device_info, "compute_capability", lambda device: (9, 0))
    sm90.setattr(P.torch.version, "hip", "6.2")
    assert not _fits(q, k, v)


@pytest.mark.parametrize(("d", "dv", "head_stride", "max_seqlen_q"), [
    (64, 64, None, 40), (64, 64, None, 4096), (128, 128, None, 40), (128, 128, None, 4096), (128, 128, 144, 4096),
    (192, 128, None, 4096)])
def test_the_gluon_kernel_needs_its_shared_memory(sm90, d, dv, head_stride, max_seqlen_q):
    """Fits exactly when the device offers the launch's shared memory (its tiles follow
    max_seqlen_q and D; the warp-specialised kernels' stages and two q buffers); not when
    the device's is unknown. One case per kernel and tile shape."""
    q_stride = None if head_stride is None else (8 * head_stride, head_stride, 1)
    kernel = P.varlen_kernel(max_seqlen_q, d, dv, head_stride is None)
    plan = P.gluon_plan_for(kernel, max_seqlen_q, d)
    block_m, block_n, ws = plan.block_m, plan.block_n, plan.warp_spec
    assert (ws is not None) == (block_m == 128 and (d >= 128 or kernel == "tma"))
    stages, q_buffers = (2, 1) if ws is None else (ws[0], P.tma_q_buffers(d) if kernel == "tma" else 2)
    need = _gluon_module().shared_memory_bytes(block_m, block_n, d, dv, stages, q_buffers)
    assert need <= SM90_SHARED
    for smem, fits in ((need, True), (need - 1, False), (None, False)):
        sm90.setattr(P, "max_shared_memory", lambda device, s=smem: s)
        assert _fits(*_qkv(d=d, dv=dv, q_stride=q_stride), max_seqlen_q) == fits, smem


def test_the_gluon_kernel_never_runs_on_the_cpu():
    """Real CPU tensors (and so the interpreter) always get the Triton kernel."""
    q = torch.zeros(16, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(16, 2, 128, dtype=torch.bfloat16)
    assert not P.gluon_plan(q, k, k, 16, 0.08, False)


# -- the launch: the Triton kernel for misaligned calls and failed compiles --------------------
class _TritonLaunch:
    """Stands in for the bound Triton launch: records the tensors of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *tensors):
        self.calls.append(tensors)


def _bind_stand_ins(monkeypatch, error=None):
    """(gluon stand-in, bind) with the Gluon module's kernel replaced and no failed key yet;
    `bind(triton_launch)` binds a bf16 D = 128 causal signature."""
    real = _gluon_module()
    gluon = StandInKernel(inspect.signature(real.varlen_fwd_wgmma_kernel.fn), error)
    module = types.SimpleNamespace(varlen_fwd_wgmma_kernel=gluon)
    monkeypatch.setattr(P, "gluon_module", lambda: module)
    monkeypatch.setattr(T, "_FAILED", set())
    q = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    gluon_plan = P.gluon_plan_for("wgmma", 32, 128)
    return gluon, lambda triton_launch: T.bind_wgmma_varlen(q, q, q, 2, 32, 0.08, True, gluon_plan, triton_launch)


def _call_tensors(q_offset=0):
    """(q, k, v, out, cu_q, cu_k, 4 placeholders) for the bound signature; q a view at
    element offset `q_offset` of a bigger buffer (offset 1: 2 bytes, not 16-byte aligned)."""
    buf = torch.zeros(64 * 4 * 128 + 8, dtype=torch.bfloat16)
    q = buf[q_offset : q_offset + 64 * 4 * 128].view(64, 4, 128)
    k = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    return (q, k, k, torch.empty_like(k), cu, cu, q, q, q, q)


def test_aligned_calls_run_the_gluon_kernel(monkeypatch):
    gluon, bind = _bind_stand_ins(monkeypatch)
    triton_launch = _TritonLaunch()
    call = _call_tensors()
    bind(triton_launch)(*call)
    assert len(gluon.calls) == 1 and not triton_launch.calls
    assert all(a is b for a, b in zip(gluon.calls[0], call[:6], strict=True)), "q, k, v, out, cu_q, cu_k"


def test_schedule_counter_is_one_zeroed_tensor_per_device_and_lane():
    """The TMA kernels' ticket counter: int32 [2], zero; the same tensor for every call of a
    device and workspace lane (the kernels leave it zero), another for another lane."""
    from graphsafe.workspace import workspace_lane

    cpu = torch.device("cpu")
    counter = T.schedule_counter(cpu)
    assert counter.dtype == torch.int32 and counter.shape == (2,) and not counter.any()
    assert T.schedule_counter(cpu) is counter
    with workspace_lane(1):
        other = T.schedule_counter(cpu)
    assert other is not counter and not other.any()
    assert T.schedule_counter(cpu) is counter


@pytest.mark.parametrize("claim", [True, False])
def test_tma_launch_passes_the_schedule_counter_where_the_plan_claims_tiles(monkeypatch, claim):
    """The TMA kernel's last tensor: this device's and lane's ticket counter where
    `plan.tma_claims_tiles` has the programs claim tiles, else (the static deal) a
    placeholder (cu_q, int32 as the counter), never read; DYNAMIC as the plan says."""
    real = _gluon_module()
    gluon = StandInKernel(inspect.signature(real.varlen_fwd_tma_kernel.fn))
    module = types.SimpleNamespace(varlen_fwd_tma_kernel=gluon, tma_descriptors=real.tma_descriptors)
    monkeypatch.setattr(P, "gluon_module", lambda: module)
    monkeypatch.setattr(P, "tma_claims_tiles", lambda group, d, fp8=False, paged=False: claim)
    monkeypatch.setattr(T, "_FAILED", set())
    monkeypatch.setattr(T, "num_sms", lambda device: 132)
    q = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    launch = T.bind_wgmma_varlen(q, q, q, 2, 64, 0.08, True, P.gluon_plan_for("tma", 64, 128), _TritonLaunch())
    call = _call_tensors()
    launch(*call)
    assert len(gluon.calls) == 1
    # q, k, v (descriptor bases), out twice (the TMA store's descriptor base or a placeholder; the pointer),
    # cu_q, cu_k, three descales and the sinks (placeholders), the counter
    assert len(gluon.calls[0]) == 12
    assert gluon.calls[0][11] is (T.schedule_counter(q.device) if claim else call[4])  # (placeholder: cu_q)
    assert gluon.keywords[0]["DYNAMIC"] is claim


@pytest.mark.parametrize(("d", "dv", "pieces"), [(64, 64, 1), (128, 128, 1), (192, 128, 2), (256, 256, 2)])
def test_tma_store_is_planned_where_two_staging_buffers_fit(monkeypatch, d, dv, pieces):
    """`plan.with_tma_store`: two [64, Dv] output staging buffers where the launch's shared
    memory with them is within Hopper's 227 KiB (D 64 and 128, the fp8 kernel too), two
    [64, Dv / 2] at D 192 / 256 (where the full ones do not fit), none without
    `plan.TMA_STORE`; the plan's shared memory counts them."""
    module = _gluon_module()
    smem = 227 * 1024
    plan = P.gluon_plan_for("tma", 4096, d)
    chosen = P.with_tma_store(plan, module, d, dv, smem)
    assert (chosen.out_buffers, chosen.out_pieces) == (2, pieces)
    assert P.shared_memory(module, chosen, d, dv) <= smem
    assert P.shared_memory(module, chosen, d, dv) == P.shared_memory(module, plan, d, dv) + 2 * 2 * 64 * dv // pieces
    if pieces == 2:  # (the full buffers would not fit)
        assert P.shared_memory(module, replace(chosen, out_pieces=1), d, dv) > smem
    assert P.with_tma_store(plan, module, d, dv, P.shared_memory(module, plan, d, dv)) == plan  # (no room: none)
    fp8 = P.with_tma_store(P.gluon_plan_for("tma-fp8", 4096, 128), module, 128, 128, smem)
    assert (fp8.out_buffers, fp8.out_pieces) == (2, 1) and P.shared_memory(module, fp8, 128, 128) <= smem
    monkeypatch.setattr(P, "TMA_STORE", False)
    assert P.with_tma_store(plan, module, d, dv, smem).out_buffers == 0
    assert P.with_tma_store(plan, module, d, dv, None) == plan


def test_tma_heads_per_section_keeps_a_section_s_kv_in_its_l2_share(monkeypatch):
    """`plan.tma_heads_per_section`: every head in one section where the K/V of all kv
    heads fits in `L2_SECTION_BYTES` (GQA 32/8 at 4096 keys, D 128: 16 MiB); else whole kv
    heads with their q heads, spread evenly over the fewest sections whose K/V fits (one
    kv head a section where not even one fits); None: one section."""
    monkeypatch.setattr(P, "L2_SECTION_BYTES", 16 * 2**20)
    assert P.tma_heads_per_section(32, 8, 4096, 128, 128, 2) == 32  # 8 x 2 MiB
    assert P.tma_heads_per_section(32, 8, 8192, 128, 128, 2) == 16  # 4 MiB a kv head: 4 a section
    assert P.tma_heads_per_section(32, 32, 4096, 128, 128, 2) == 8  # MHA: 8 of 2 MiB
    assert P.tma_heads_per_section(32, 32, 4096, 128, 128, 1) == 16  # fp8: 1 MiB a kv head
    assert P.tma_heads_per_section(16, 16, 4096, 192, 128, 2) == 6  # 2.5 MiB: 6 fit, sections of 6, 6, 4
    assert P.tma_heads_per_section(64, 8, 4096, 64, 64, 2) == 64  # D 64: 1 MiB a kv head
    assert P.tma_heads_per_section(24, 12, 4096, 128, 128, 2) == 12  # 8 fit: two sections of 6 kv heads
    assert P.tma_heads_per_section(32, 8, 2**20, 128, 128, 2) == 4  # none fits: a kv head (4 q heads) a section
    assert P.tma_heads_per_section(8, 1, 2**20, 128, 128, 2) == 8  # one kv head: one section
    for hq, hk, keys, d, elem in ((40, 8, 6000, 128, 2), (12, 3, 30000, 64, 2), (96, 32, 5000, 128, 1)):
        section = P.tma_heads_per_section(hq, hk, keys, d, d, elem)
        kv = section // (hq // hk)
        assert section % (hq // hk) == 0 and 0 < section <= hq
        assert kv == 1 or kv * keys * 2 * d * elem <= P.L2_SECTION_BYTES
    monkeypatch.setattr(P, "L2_SECTION_BYTES", None)
    assert P.tma_heads_per_section(32, 32, 2**20, 128, 128, 2) == 32


def test_tma_launch_passes_the_plan_s_heads_per_section(monkeypatch):
    """The TMA kernel's `heads_per_section` is the plan's for the call's heads, head dims,
    element size and max_seqlen_k, bounded by the keys given (None: all of them)."""
    real = _gluon_module()
    gluon = StandInKernel(inspect.signature(real.varlen_fwd_tma_kernel.fn))
    module = types.SimpleNamespace(varlen_fwd_tma_kernel=gluon, tma_descriptors=real.tma_descriptors)
    monkeypatch.setattr(P, "gluon_module", lambda: module)
    monkeypatch.setattr(T, "_FAILED", set())
    monkeypatch.setattr(T, "num_sms", lambda device: 132)
    monkeypatch.setattr(P, "L2_SECTION_BYTES", 64 * 1024)  # (small: these few keys make sections)
    q = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    for max_k in (None, 16, 100):
        launch = T.bind_wgmma_varlen(q, k, k, 2, 64, 0.08, True, P.gluon_plan_for("tma", 64, 128), _TritonLaunch(),
                                     max_seqlen_k=max_k)
        launch(q, k, k, torch.empty_like(q), cu, cu, q, q, q, q)
    # 64 keys of 2 x 128 bf16 columns: 32 KiB a kv head, two a section (4 q heads); 16 keys: all 4 kv heads
    assert [a["heads_per_section"] for a in gluon.arguments] == [4, 8, 4]
    assert [a["num_q_heads"] for a in gluon.arguments] == [8, 8, 8]


def test_tma_schedule_is_claimed_where_it_measured_faster():
    """`plan.tma_claims_tiles`, as measured (its docstring): paged prefill always; the 16-bit
    varlen kernel at every head dim and group; the static deal for the fp8 kernel."""
    assert P.tma_claims_tiles(4, 128, paged=True) and P.tma_claims_tiles(8, 64, paged=True)
    assert P.tma_claims_tiles(1, 128) and P.tma_claims_tiles(1, 192) and P.tma_claims_tiles(2, 256)
    assert P.tma_claims_tiles(8, 64) and P.tma_claims_tiles(4, 128)
    assert not P.tma_claims_tiles(4, 128, fp8=True) and not P.tma_claims_tiles(1, 128, fp8=True)


def test_misaligned_q_runs_the_triton_kernel(monkeypatch):
    """A q that is not 16-byte aligned runs the Triton launch with every tensor of the
    call; the Gluon kernel is not tried (nor marked failed)."""
    gluon, bind = _bind_stand_ins(monkeypatch)
    triton_launch = _TritonLaunch()
    call = _call_tensors(q_offset=1)
    assert call[0].data_ptr() % 16
    bind(triton_launch)(*call)
    assert not gluon.calls and len(triton_launch.calls) == 1
    assert all(a is b for a, b in zip(triton_launch.calls[0], call, strict=True))
    assert not T._FAILED


def test_gluon_compile_failure_warns_once_and_runs_the_triton_kernel(monkeypatch):
    """The Gluon kernel compiles at the first call of its binding: a failure there warns
    once ("did not compile"), launches nothing itself, and the Triton launch runs that
    call; later calls and a new binding of the same signature go to the Triton launch at
    once, without a warning."""
    gluon, bind = _bind_stand_ins(monkeypatch, RuntimeError("PassManager::run failed"))
    triton_launch = _TritonLaunch()
    launch = bind(triton_launch)
    call = _call_tensors()
    with pytest.warns(RuntimeWarning, match="did not compile"):
        launch(*call)
    assert (len(gluon.calls), len(triton_launch.calls)) == (1, 1), "the failed compile: Triton ran the call"
    assert all(a is b for a, b in zip(triton_launch.calls[0], call, strict=True))
    # 64-row tiles: one partition; no variant
    assert T._FAILED == {(torch.bfloat16, 128, 128, 64, 128, True, "wgmma", None, -1, 0.0, False)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch(*call)
        bind(triton_launch)(*call)  # a new binding of the signature: the Triton kernel at once
    assert (len(gluon.calls), len(triton_launch.calls)) == (1, 3)


# -- which kernel prepare_flash_attn_varlen binds ---------------------------------------------
def _varlen_args(window_left=-1, softcap=0.0, sinks=None):
    gen = torch.Generator().manual_seed(0)
    # float16: the interpreter computes bf16 dots wrongly; the choice does not depend on it.
    q = torch.randn(24, 4, 64, generator=gen).half()
    k, v = (torch.randn(24, 2, 64, generator=gen).half() for _ in range(2))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    return (q, k, v, cu, cu, 14, 14, 0.125, True, None, None, None, "off", window_left, softcap, sinks)


def _call(args):
    return graphsafe.get_op("flash_attn_varlen").call(*args)


def _prepare(args, config=None):
    """`prepare_flash_attn_varlen`'s runner of `args`; with `config`, the Choice made with
    that override of the Triton kernel's tiles."""
    call = _call(args)
    if config is None:
        return T.prepare_flash_attn_varlen(call)
    return T.bind_flash_attn_varlen(call, P.choose_flash_attn_varlen(call, config))


@pytest.fixture
def binds(monkeypatch):
    """Stand-ins: `plan.gluon_plan` gives a Gluon plan for every call (as on sm_90: "wgmma"
    for these short sequences, "tma" where the call has a variant, as a long one would) and
    `triton.bind_wgmma_varlen` records its binding (the variants it was given) and wraps
    the Triton launch. Returns (fits calls, bindings, Gluon launches)."""
    fits_calls, bindings, launches = [], [], []

    def fits(q, k, v, max_seqlen_q, scale, variants, window=False):
        fits_calls.append(variants)
        return P.gluon_plan_for("tma" if variants else "wgmma", max_seqlen_q, q.shape[2], window=window)

    def bind(q, k, v, num_seqs, max_seqlen_q, scale, causal, gluon, triton_launch, **variants):
        bindings.append((num_seqs, max_seqlen_q, scale, causal, gluon.kernel, variants))

        def launch(*tensors):
            launches.append(tensors)
            triton_launch(*tensors)

        return launch

    monkeypatch.setattr(P, "gluon_plan", fits)
    monkeypatch.setattr(T, "bind_wgmma_varlen", bind)
    return fits_calls, bindings, launches


def test_plain_calls_bind_and_run_the_gluon_launch(binds):
    """Control for the cases below: the default plain call binds the Gluon launch with the
    call's sequences, max_seqlen_q, scale, causality and max_seqlen_k, and each call goes
    through it."""
    fits_calls, bindings, launches = binds
    args = _varlen_args()
    out = _prepare(args)(*args)
    plain = {"window_left": -1, "softcap": 0.0, "sinks_stride": None, "max_seqlen_k": 14}
    assert fits_calls == [False] and bindings == [(2, 14, 0.125, True, "wgmma", plain)] and len(launches) == 1
    triton_kernel = T.flash_attn_varlen(*args, config=P.varlen_config(args[0].device, 64, 64, False, 14))
    assert torch.equal(out, triton_kernel), "the wrapped Triton launch computed the call"


def test_a_window_wider_than_the_keys_is_no_variant(binds):
    """window_left >= Tk hides no key (the Triton kernel compiles it as no window): the
    plan is asked without variants; one key narrower is a variant."""
    fits_calls, bindings, _ = binds
    _prepare(_varlen_args(window_left=24))
    _prepare(_varlen_args(window_left=23))
    assert fits_calls == [False, True] and [b[4] for b in bindings] == ["wgmma", "tma"]


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks"])
def test_variants_ask_the_plan_and_reach_the_gluon_binding(binds, variant):
    """A variant asks the plan with variants=True, and the binding of the plan it gives
    gets the call's window, softcap and sinks' stride (its constexprs)."""
    fits_calls, bindings, _ = binds
    options = {"window": {"window_left": 3}, "softcap": {"softcap": 30.0},
               "sinks": {"sinks": torch.zeros(8)[::2]}}[variant]
    _prepare(_varlen_args(**options))
    want = {"window_left": 3 if variant == "window" else -1, "softcap": 30.0 if variant == "softcap" else 0.0,
            "sinks_stride": 2 if variant == "sinks" else None, "max_seqlen_k": 14}
    assert fits_calls == [True] and bindings == [(2, 14, 0.125, True, "tma", want)]


def test_a_config_override_never_binds_the_gluon_launch(binds):
    """`config` (tests, benchmarks) asks for the Triton kernel's tiles: the Triton kernel."""
    _, bindings, _ = binds
    args = _varlen_args()
    _prepare(args, config=(16, 16, 4, 1))(*args)
    _prepare(args, config=P.varlen_config(args[0].device, 64, 64, False, 14))(*args)
    assert not bindings


@pytest.fixture
def fp8_binds(monkeypatch):
    """Stand-ins: `plan.gluon_fp8_plan` gives the fp8 plan unless there is a variant, and
    `triton.bind_wgmma_varlen_fp8` records what it is bound with (returns the Triton
    launch, or for copies a launch that reports it did not run)."""
    bindings = []

    def bind(q, k, vt_shape, num_seqs, max_seqlen_q, scale, causal, descale_strides, gluon, triton_launch,
             max_seqlen_k=None):
        bindings.append((q.dtype, vt_shape, num_seqs, max_seqlen_q, causal, descale_strides, gluon.copies))
        assert max_seqlen_k == 14, "the call's max_seqlen_k reaches the binding (its sections)"
        return triton_launch if triton_launch is not None else (lambda *tensors: False)

    monkeypatch.setattr(P, "gluon_fp8_plan", lambda q, k, v, max_seqlen_q, variants, copies=False: None if variants
                        else P.gluon_plan_for("tma-fp8", max_seqlen_q, q.shape[2], copies))
    monkeypatch.setattr(T, "bind_wgmma_varlen_fp8", bind)
    return bindings


def _fp8_args(descale_shape=(1,), **options):
    q, k, v, cu, _, max_q, max_k, scale, causal, *_ = _varlen_args()
    q8, k8, v8 = (x.to(FP8) for x in (q, k, v))
    descale = torch.ones(descale_shape)
    args = [q8, k8, v8, cu, cu, max_q, max_k, scale, causal, descale, descale, descale, "off", -1, 0.0, None]
    for name, value in options.items():
        args[{"window_left": 13, "softcap": 14, "sinks": 15}[name]] = value
    return tuple(args)


def test_fp8_inputs_bind_the_fp8_gluon_launch(fp8_binds):
    """fp8 inputs bind the fp8 Gluon launch with the V^T copy's shape [Hk, Dv, Tk padded
    to 16] and each descale's (sequence, head) strides; per-(sequence, head) descales
    keep theirs."""
    _prepare(_fp8_args())
    _prepare(_fp8_args(descale_shape=(2, 2)))
    assert fp8_binds == [(FP8, (2, 64, 32), 2, 14, True, ((0, 0),) * 3, False),
                         (FP8, (2, 64, 32), 2, 14, True, ((2, 1),) * 3, False)]


def test_quantised_inputs_bind_the_fp8_gluon_launch_on_copies(fp8_binds):
    """bf16/fp16 inputs the op quantises bind the launch on fp8 copies of q and k (per-tensor
    descale slots), the workspace then holds the q copy too, and a call the Gluon launch
    does not run (here: every call) runs the Triton kernel, which quantises q itself."""
    from graphsafe.ops.attention.kernels import triton_quant as Q

    q, k, v, cu, _, max_q, max_k, scale, causal, *_ = _varlen_args()
    args = (q, k, v, cu, cu, max_q, max_k, scale, causal, None, None, None, "on")
    out = _prepare(args)(*args)
    assert fp8_binds == [(torch.float16, (2, 64, 32), 2, 14, True, ((0, 0),) * 3, True)]
    specs = list(P.varlen_scratch(24, 24, 4, 2, 64, 64, True, q_copy=True))
    assert specs[-1] == ((24, 4, 64), FP8) and specs[-2] == ((Q.SCALE_SLOTS,), torch.float32)
    assert P.flash_attn_varlen_workspace(24, 24, 4, 2, 64, 64) == specs, "the worst case has the q copy"
    triton_kernel = T.flash_attn_varlen(*args, config=P.varlen_config(q.device, 64, 64, True, 14))
    assert torch.equal(out, triton_kernel)


def test_fp8_variants_and_config_overrides_keep_the_triton_kernel(fp8_binds):
    _prepare(_fp8_args(softcap=30.0))
    _prepare(_fp8_args(sinks=torch.zeros(4)))
    _prepare(_fp8_args(), config=(16, 16, 4, 1))
    q, k, v, cu, _, max_q, max_k, scale, causal, *_ = _varlen_args()
    _prepare((q, k, v, cu, cu, max_q, max_k, scale, causal, None, None, None, "on", 3))
    assert not fp8_binds
