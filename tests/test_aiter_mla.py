"""The aiter MLA adapter (graphsafe.ops.mla.aiter) against the CPU stand-in of aiter
(tests/aiter_standin: `mla_decode_fwd`'s signature, checks and kernel tables at
v0.1.20-46-ge4048607a5), on gfx942 and gfx950.

Covered: results against the reference backend (H 16 and 128, padding and out-of-range
block ids and slots, lengths <= 0 and past the capacity, unread cache rows and q rows
poisoned with NaN, NaN/inf in read inputs); the token CSR the Triton kernels write; the
`supports` predicates and workspace functions per architecture; the stand-in rejecting
what aiter rejects (so the old persistent + LSE call and a single split would fail);
and the CSR kernels compiling for gfx942, gfx950 and sm_90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from graphsafe.testing import case_for
import graphsafe
from graphsafe import registry
from graphsafe.ops.mla import aiter as adapter
from graphsafe.ops.mla import mla_decode_workspace_specs
from graphsafe.ops.mla.kernels import triton_aiter_csr as aiter_csr
from graphsafe.testing import contract as C
from graphsafe.ops.mla import cases as cases

ARCHS = ("gfx942", "gfx950")
CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _decode_params(heads: int, **over):
    return {**cases.EXAMPLE_DECODE, **cases.DEEPSEEK, "B": 5, "H": heads, "block_size": 4, "max_blocks": 5,
            "dtype": BF16, "lens": "random", "padding": 0.25, "strided": False, **over}


def _sparse_params(heads: int, **over):
    return {**cases.EXAMPLE_SPARSE, **cases.DEEPSEEK, "T": 4, "H": heads, "block_size": 4, "num_blocks": 6, "K": 40,
            "dtype": BF16, "invalid": 0.25, "strided": False, **over}


def _call(op: str, *args):
    """The op's bound call of `args` (what `supports` and `prepare` take)."""
    return graphsafe.get_op(op).call(*args)


def _make(op: str, params, seed: int = 0):
    return case_for(op).make(params, CPU, torch.Generator().manual_seed(seed))


def _decode_args(heads: int, seed: int = 0):
    """Lengths 0, past the capacity (20), partial and negative; block ids -1, 10**6 and
    num_blocks below a request's length, and a request whose blocks are all padding."""
    p = _decode_params(heads)
    q, kv, table, _, scale, r = _make("mla_decode", p, seed)
    nb = kv.shape[0]
    lens = torch.tensor([0, 27, 9, 13, -3], dtype=torch.int32)
    table[1, 1], table[1, 3], table[2, 0] = -1, 10**6, nb
    table[3, :4] = -1
    return p, (q, kv, table, lens, scale, r)


def _sparse_args(heads: int, seed: int = 0):
    """Slots -1, -5, 10**6 and num_slots among valid (repeated) ones, and a token without
    a valid slot."""
    p = _sparse_params(heads)
    q, kv, idx, scale, r = _make("sparse_mla", p, seed)[:5]
    num_slots = kv.shape[0] * kv.shape[1]
    idx[1, :4] = torch.tensor([-5, 10**6, num_slots, -1], dtype=torch.int32)
    idx[2] = -1
    return p, (q, kv, idx, scale, r, None, None)


def _check_against_reference(op: str, params, args) -> None:
    """Reference agreement, unread elements poisoned with NaN, out-of-range ids as
    padding, NaN/inf in read inputs at the reference's places, a prepared runner reused."""
    spec = graphsafe.get_op(op)
    expected = C.run_backend(spec, "reference", C.clone_args(args))
    case_for(spec.name).compare(expected, C.run_backend(spec, "aiter", C.clone_args(args)), args, args, params)
    assert C.check_unread_inputs_never_matter(spec, case_for(spec.name), "aiter", params, args) > 0
    assert C.check_out_of_range_ids_are_padding(spec, case_for(spec.name), "aiter", params, args)
    assert C.check_nonfinite_inputs_agree(spec, case_for(spec.name), "aiter", params, args)
    run = spec.prepare("aiter", *args)
    for _ in range(2):
        case_for(spec.name).compare(expected, run(*C.clone_args(args)), args, args, params)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_matches_the_reference(aiter_standin, arch, heads):
    aiter_standin(arch)
    params, args = _decode_args(heads)
    assert adapter.mla_decode_supports(_call("mla_decode", *args))
    _check_against_reference("mla_decode", params, args)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_matches_the_reference(aiter_standin, arch, heads):
    aiter_standin(arch)
    params, args = _sparse_args(heads)
    assert adapter.sparse_mla_supports(_call("sparse_mla", *args))
    _check_against_reference("sparse_mla", params, args)


def _record_calls(aiter, monkeypatch) -> list[dict]:
    """Wrap the stand-in's mla_decode_fwd: each call's CSR arguments, copied."""
    calls: list[dict] = []
    original = aiter.mla.mla_decode_fwd

    def recording(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, **kw):
        total = int(kv_indptr[-1])
        calls.append({"qo_indptr": qo_indptr.clone(), "kv_indptr": kv_indptr.clone(),
                      "kv_indices": kv_indices[:total].clone(), "last": kv_last_page_lens.clone(),
                      "splits_indptr": kw["num_kv_splits_indptr"].clone(), **kw})
        return original(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, **kw)

    monkeypatch.setattr(aiter.mla, "mla_decode_fwd", recording)
    return calls


def _expected_csr(slot_lists):
    indptr = torch.tensor([0] + [len(s) for s in slot_lists]).cumsum(0).int()
    return indptr, torch.tensor([x for s in slot_lists for x in s], dtype=torch.int32)


def _check_csr(call, slot_lists, rows: int) -> None:
    indptr, indices = _expected_csr(slot_lists)
    n = adapter.num_kv_splits(rows, CPU)
    assert torch.equal(call["kv_indptr"], indptr) and torch.equal(call["kv_indices"], indices)
    assert torch.equal(call["qo_indptr"], torch.arange(rows + 1, dtype=torch.int32))
    assert torch.equal(call["last"], torch.ones(rows, dtype=torch.int32))
    assert call["num_kv_splits"] == n and torch.equal(call["splits_indptr"], torch.arange(rows + 1).int() * n)
    assert call["return_lse"] and call.get("work_meta_data") is None, "non-persistent, with the LSE"


def test_csr_kernels_write_exactly_the_valid_slots(aiter_standin, monkeypatch):
    """Rows wider than one chunk of the CSR kernels (1024 positions), so the running
    counts cross chunk and row boundaries."""
    aiter = aiter_standin("gfx942")
    calls = _record_calls(aiter, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    bs, max_blocks = 16, 70
    assert max_blocks * bs > aiter_csr.CHUNK
    q, kv, table, _, scale, r = _make("mla_decode", _decode_params(16, B=3, block_size=bs, max_blocks=max_blocks), 5)
    nb = kv.shape[0]
    table = torch.where(torch.rand(table.shape, generator=gen) < 0.2, torch.tensor([-1, 10**6, nb, -7])[
        torch.randint(0, 4, table.shape, generator=gen)].int(), table)
    lens = torch.tensor([max_blocks * bs + 50, 0, 1030], dtype=torch.int32)
    adapter.mla_decode(q, kv, table, lens, scale, r)
    slots = [[int(table[b, p // bs]) * bs + p % bs for p in range(min(int(lens[b]), max_blocks * bs))
              if 0 <= int(table[b, p // bs]) < nb] for b in range(3)]
    _check_csr(calls[-1], slots, 3)

    q, kv, idx, scale, r = _make("sparse_mla", _sparse_params(16, T=3, K=1500, num_blocks=40), 6)[:5]
    num_slots = kv.shape[0] * kv.shape[1]
    idx = torch.randint(-3, num_slots + 3, idx.shape, generator=gen).int()
    idx[0, :3] = torch.tensor([10**6, -(2**31), num_slots])
    adapter.sparse_mla(q, kv, idx, scale, r)
    _check_csr(calls[-1], [[int(s) for s in row if 0 <= s < num_slots] for row in idx], 3)


def test_split_count_comes_from_shapes(aiter_standin):
    """n = min(16, max(2, ceil(2 * CUs / rows))): at least two splits, so aiter's reduce
    writes the LSE; gfx942 (304 CUs) here."""
    aiter_standin("gfx942")
    assert [adapter.num_kv_splits(rows, CPU) for rows in (1, 38, 39, 100, 304, 10**5)] == [16, 16, 16, 7, 2, 2]


@pytest.mark.parametrize("arch", ARCHS)
def test_supports_declines_what_aiter_does_not_serve(aiter_standin, arch):
    aiter_standin(arch)
    _, decode = _decode_args(16)
    _, sparse = _sparse_args(128)
    assert adapter.mla_decode_supports(_call("mla_decode", *decode)) and adapter.sparse_mla_supports(_call("sparse_mla", *sparse))
    declined = [
        _make("mla_decode", _decode_params(16, dtype=torch.float16)),  # aiter: "unsupport Q dtype"
        _make("mla_decode", _decode_params(32)),  # no gqa-32 kernel in graphsafe's selection
        _make("mla_decode", _decode_params(16, R=512, P=128)),  # head dim 640
        _make("mla_decode", _decode_params(16, R=448, P=128)),  # head dim 576, kv_lora_rank 448
        _make("mla_decode", _decode_params(16, strided=True)),  # strided q and cache
    ]
    for args in declined:
        assert not adapter.mla_decode_supports(_call("mla_decode", *args))
    assert not adapter.sparse_mla_supports(_call("sparse_mla", *_make("sparse_mla", _sparse_params(16, dtype=torch.float16))))
    assert not adapter.sparse_mla_supports(_call("sparse_mla", *_make("sparse_mla", _sparse_params(16, strided=True))))
    q, kv, table, lens, scale, r = decode
    assert not adapter.mla_decode_supports(_call("mla_decode", q.transpose(0, 1).contiguous().transpose(0, 1), kv, table, lens, scale, r))
    shape = (5, 16, 512, 20)
    specs = mla_decode_workspace_specs(*shape, device="cpu", backend="aiter", head_dim=576, dtype=BF16)
    assert specs and all(dtype == torch.int32 for _, dtype in specs) and (5 * 20,) in [s for s, _ in specs]
    assert mla_decode_workspace_specs(*shape, device="cpu", backend="aiter", head_dim=576, dtype=torch.float16) == []


def test_supports_declines_other_architectures(aiter_standin):
    aiter_standin("gfx90a")
    _, decode = _decode_args(16)
    _, sparse = _sparse_args(16)
    assert not adapter.mla_decode_supports(_call("mla_decode", *decode)) and not adapter.sparse_mla_supports(_call("sparse_mla", *sparse))
    shape = (5, 16, 512, 20)
    assert mla_decode_workspace_specs(*shape, device="cpu", backend="aiter", head_dim=576, dtype=BF16) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_aiter_before_the_lse_fix_goes_to_triton(aiter_standin, arch):
    """Finding 2 of issue 36: aiter v0.1.16 to v0.1.18 take every keyword of the adapter's
    call (num_kv_splits, num_kv_splits_indptr, return_lse), but their non-persistent stage
    1 asks for an lse=1 kernel whenever the LSE is returned (asm_mla.cu `lse_flag = lse !=
    nullptr` before #4308, v0.1.19), which no csv lists: every call would raise. `supports`
    reads aiter's version; the stand-in raises as those releases do."""
    _, decode = _decode_args(16)
    _, sparse = _sparse_args(128)
    for version in ("0.1.16", "0.1.18", "0.1.19rc0", "0.1.19.dev12+g0123abcd"):
        aiter_standin(arch, version)
        why = adapter.mla_decode_supports(_call("mla_decode", *decode))
        assert not why and "0.1.19" in why.reason, (version, why)
        assert not adapter.sparse_mla_supports(_call("sparse_mla", *sparse)), version
        with pytest.raises(RuntimeError, match="cannot get heuristic kernel!.* lse:1"):
            adapter.mla_decode(*decode)
    for version in ("0.1.19", "0.1.19.post2", "0.1.20", None):  # None: the pinned commit's
        aiter_standin(arch, version)
        assert adapter.mla_decode_supports(_call("mla_decode", *decode)), version
        assert adapter.sparse_mla_supports(_call("sparse_mla", *sparse)), version
    aiter_standin(arch, "a source tree")
    why = adapter.mla_decode_supports(_call("mla_decode", *decode))
    assert not why and "version" in why.reason


def test_supports_declines_a_cache_past_4_gib(aiter_standin):
    """Finding 6 of issue 36: the non-persistent bf16 kernels (subQ16_mqa16, subQ128_mqa128,
    never rebuilt since 2025) address the cache with a 32-bit byte offset, so a cache past
    4 GiB (3,728,270 slots of 1152 bytes) goes to Triton."""
    aiter_standin("gfx950")
    meta = torch.device("meta")
    q = torch.empty(8, 16, 576, dtype=BF16, device=meta)
    table = torch.empty(8, 64, dtype=torch.int32, device=meta)
    lens = torch.empty(8, dtype=torch.int32, device=meta)
    indices = torch.empty(8, 2048, dtype=torch.int32, device=meta)
    fits = torch.empty(2**32 // (64 * 1152), 64, 576, dtype=BF16, device=meta)  # 58254 blocks of 64
    past = torch.empty(fits.shape[0] + 1, 64, 576, dtype=BF16, device=meta)
    assert fits.numel() * 2 <= 2**32 < past.numel() * 2
    assert adapter.mla_decode_supports(_call("mla_decode", q, fits, table, lens, 0.1, 512))
    assert adapter.sparse_mla_supports(_call("sparse_mla", q, fits, indices, 0.1, 512))
    why = adapter.mla_decode_supports(_call("mla_decode", q, past, table, lens, 0.1, 512))
    assert not why and "32-bit byte offset" in why.reason
    assert not adapter.sparse_mla_supports(_call("sparse_mla", q, past, indices, 0.1, 512))


@pytest.mark.parametrize("arch", ARCHS)
def test_standin_wraps_no_kv_byte_offset(aiter_standin, monkeypatch, arch):
    """The stand-in refuses a page whose bytes end past the non-persistent bf16 kernels'
    32-bit byte offset (scaled down here: a limit of 6 rows)."""
    aiter = aiter_standin(arch)
    args = _raw_call(16, rows=2, keys=5)  # pages 0..9 of 1152 bytes
    monkeypatch.setattr(aiter.mla, "KV_BYTE_OFFSET_LIMIT", 6 * 1152)
    args[5] = torch.tensor([0, 1, 2, 3, 4, 5, 4, 3, 2, 1], dtype=torch.int32)
    aiter.mla.mla_decode_fwd(*args, **_splits(2, 2), return_lse=True)
    args[5][7] = 6
    with pytest.raises(IndexError, match="32-bit KV byte offset"):
        aiter.mla.mla_decode_fwd(*args, **_splits(2, 2), return_lse=True)


def test_the_dispatcher_picks_aiter_only_where_it_serves(aiter_standin, monkeypatch):
    aiter_standin("gfx950")
    spec = graphsafe.get_op("mla_decode")
    params, args = _decode_args(16)
    small = case_for(spec.name).make(case_for(spec.name).example, CPU, torch.Generator().manual_seed(1))
    monkeypatch.setattr(registry, "backend_available", lambda backend, device_type: True)
    monkeypatch.setattr(registry, "AUTO_ORDER", {"cpu": ("aiter", "triton", "reference")})
    with graphsafe.use_backend(None):  # fresh signature tables, here and on exit
        assert spec.serving_backend("cpu", *args) == "aiter" and spec.serving_backend("cpu", *small) == "triton"
        expected = C.run_backend(spec, "reference", args)
        case_for(spec.name).compare(expected, spec.overload(*C.clone_args(args)), args, args, params)


# -- the stand-in rejects what aiter rejects ----------------------------------------------
def _raw_call(heads: int, rows: int = 2, keys: int = 5, dtype=BF16):
    """mla_decode_fwd's positional arguments for `rows` requests of `keys` tokens each."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(rows, heads, 576, generator=gen).to(dtype)
    kv = torch.randn(rows * keys, 1, 1, 576, generator=gen).to(dtype)
    o = torch.empty(rows, heads, 512, dtype=dtype)
    i32 = torch.int32
    qo = torch.arange(rows + 1, dtype=i32)
    kv_indptr = torch.arange(rows + 1, dtype=i32) * keys
    kv_indices = torch.randperm(rows * keys, generator=gen).to(i32)
    return [q, kv, o, qo, kv_indptr, kv_indices, torch.ones(rows, dtype=i32), 1]


def _persistent_kwargs(rows: int):
    """What the old adapter passed (get_mla_metadata_v1's buffers; their contents are not modelled)."""
    i32 = torch.int32
    return {"work_meta_data": torch.zeros(2, dtype=torch.uint64), "work_indptr": torch.zeros(5, dtype=i32),
            "work_info_set": torch.zeros(7, 8, dtype=i32), "reduce_indptr": torch.zeros(rows + 1, dtype=i32),
            "reduce_final_map": torch.zeros(rows, 2, dtype=i32), "reduce_partial_map": torch.zeros(9, dtype=i32),
            "return_lse": True}


def _splits(rows: int, n: int):
    return {"num_kv_splits": n, "num_kv_splits_indptr": torch.arange(rows + 1, dtype=torch.int32) * n}


@pytest.mark.parametrize("heads", [16, 128])
def test_standin_refuses_the_persistent_lse_call_on_gfx942(aiter_standin, heads):
    """gfx942 ships no bf16 lse=1 kernel (hsa/gfx942/mla/mla_asm.csv); gfx950 does."""
    aiter = aiter_standin("gfx942")
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel! q_type:bf16 kv_type:bf16 gqa:16 ps:1 "
                                           "prefill:0 causal:1 qseqlen:4 lse:1 cprr:0"):
        aiter.mla.mla_decode_fwd(*_raw_call(heads), **_persistent_kwargs(2))
    aiter = aiter_standin("gfx950")
    _, lse = aiter.mla.mla_decode_fwd(*_raw_call(heads), **_persistent_kwargs(2))
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_standin_leaves_the_lse_unwritten_for_128_heads_and_one_split(aiter_standin, arch):
    aiter = aiter_standin(arch)
    args = _raw_call(128)
    _, lse = aiter.mla.mla_decode_fwd(*args, **_splits(2, 1), return_lse=True)
    assert torch.isnan(lse).all(), "FINAL_OUT: no lse store"
    out_one = args[2].clone()
    _, lse = aiter.mla.mla_decode_fwd(*args, **_splits(2, 2), return_lse=True)
    assert torch.isfinite(lse).all() and torch.equal(out_one, args[2])
    _, lse = aiter.mla.mla_decode_fwd(*_raw_call(16), **_splits(2, 1), return_lse=True)
    assert torch.isfinite(lse).all(), "16 heads always go through the reduce"
    # aiter's own split choice is 1 for a batch filling every CU (the old sparse_mla call).
    cu = aiter.get_cu_num()
    assert aiter.mla.get_meta_param(None, cu, cu * 64, 128, 1, BF16)[0] == 1
    assert aiter.mla.get_meta_param(None, 2, 2 * 4096, 128, 1, BF16)[0] > 1


def test_standin_checks_what_aiter_checks(aiter_standin):
    aiter = aiter_standin("gfx942")
    fwd = aiter.mla.mla_decode_fwd
    splits = _splits(2, 2)
    fwd(*_raw_call(16), **splits)
    with pytest.raises(RuntimeError, match="unsupport Q dtype"):
        fwd(*_raw_call(16, dtype=torch.float16), **splits)
    with pytest.raises(AssertionError, match="logit_cap"):
        fwd(*_raw_call(16), logit_cap=30.0, **splits)
    args = _raw_call(16)
    with pytest.raises(ValueError):
        fwd(args[0], args[1].view(-1, 1, 576), *args[2:], **splits)
    with pytest.raises(RuntimeError, match="contiguous"):
        fwd(args[0].transpose(0, 1).contiguous().transpose(0, 1), *args[1:], **splits)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        fwd(args[0], args[1].view(-1, 1, 2, 288), *args[2:], **splits)
    with pytest.raises(IndexError, match="kv_indices"):
        fwd(*args[:5], args[5] + 100, *args[6:], **splits)
    with pytest.raises(IndexError, match="kv_indptr"):
        fwd(*args[:4], args[4].flip(0), *args[5:], **splits)
    with pytest.raises(IndexError, match="num_kv_splits_indptr"):
        fwd(*args, num_kv_splits=2, num_kv_splits_indptr=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="gqa:32"):
        fwd(*_raw_call(32), **splits)


def test_standin_empty_rows_are_nan_and_minus_inf(aiter_standin):
    """aiter's reduce on a row without keys: out 0/0, lse -inf (the adapter masks both)."""
    aiter = aiter_standin("gfx950")
    args = _raw_call(16)
    args[4] = torch.tensor([0, 0, 5], dtype=torch.int32)
    _, lse = aiter.mla.mla_decode_fwd(*args, **_splits(2, 2), return_lse=True)
    assert torch.isnan(args[2][0].float()).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


# -- the CSR kernels on a GPU target, without a GPU ---------------------------------------
_COMPILE_SCRIPT = r"""
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from graphsafe.ops.mla.kernels import triton_aiter_csr as K

def source(fn, pointers, consts):
    sig = {p.name: "constexpr" if p.is_constexpr or p.name in consts else pointers.get(p.name, "i32")
           for p in fn.params}
    return ASTSource(fn=fn, signature=sig, constexprs=consts)

i32 = lambda *names: {n: "*i32" for n in names}
count = i32("src_ptr", "lens_ptr", "counts_ptr", "qo_indptr_ptr", "last_page_ptr", "splits_indptr_ptr")
scatter = i32("src_ptr", "lens_ptr", "counts_ptr", "ends_ptr", "kv_indptr_ptr", "kv_indices_ptr")
mask = {"kv_indptr_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
for target in (GPUTarget("hip", "gfx942", 64), GPUTarget("hip", "gfx950", 64), GPUTarget("cuda", 90, 32)):
    for paged in (True, False):
        # sparse_mla binds block_size 1, which the launcher specialises to a constant.
        consts = {"PAGED": paged, "CHUNK_SIZE": K.CHUNK, **({} if paged else {"block_size": 1})}
        triton.compile(source(K._count_kernel, count, consts), target=target)
        triton.compile(source(K._scatter_kernel, scatter, consts), target=target)
    for heads in (16, 128):
        triton.compile(source(K._mask_empty_kernel, mask, {"BLOCK": 1024, "HEADS": heads}), target=target)
    print("compiled", target.backend, target.arch)
print("OK")
"""


def test_csr_kernels_compile_for_amd_and_nvidia_targets(compile_for_sm90):
    """The interpreter never compiles: the kernels must pass Triton's GPU pipeline."""
    out = compile_for_sm90(_COMPILE_SCRIPT)
    assert "compiled cuda 90" in out and "compiled hip gfx942" in out and "compiled hip gfx950" in out, out


def test_supports_declines_calls_whose_aiter_partials_are_too_large(aiter_standin):
    """aiter allocates its split partials itself on every call: a 4096-token sparse call
    at H = 128 (2 splits: 2.1 GB) goes to Triton; decode batches stay on aiter."""
    from graphsafe.ops.mla import aiter as adapter

    aiter_standin("gfx942")
    meta = torch.device("meta")
    cache = torch.empty(64, 64, 576, dtype=torch.bfloat16, device=meta)
    big = torch.empty(4096, 128, 576, dtype=torch.bfloat16, device=meta)
    indices = torch.empty(4096, 2048, dtype=torch.int32, device=meta)
    assert adapter.split_partial_bytes(4096, 128, 512, meta) > adapter.MAX_SPLIT_PARTIAL_BYTES
    assert not adapter.sparse_mla_supports(_call("sparse_mla", big, cache, indices, 0.1, 512))
    assert adapter.sparse_mla_supports(_call("sparse_mla", big[:64], cache, indices[:64], 0.1, 512))
    table = torch.empty(128, 64, dtype=torch.int32, device=meta)
    lens = torch.empty(128, dtype=torch.int32, device=meta)
    assert adapter.mla_decode_supports(_call("mla_decode", big[:128], cache, table, lens, 0.1, 512))
