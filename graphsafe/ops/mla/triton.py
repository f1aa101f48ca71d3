"""Triton backend of the MLA attention ops: its records, and the runners that bind the
choice of `plan.choose` (once per call signature) to its kernels.

The kernels (graphsafe/ops/mla/kernels/): `triton_split_kv` (portable split-KV flash
decoding, every GPU and the interpreter), and on sm_90 `gluon_wgmma` (64-head tiles, the
two warpgroups splitting q.k), `gluon_paged_tma` (dense decode over a 16-bit cache, TMA
page tiles), `gluon_fp8_few_heads` (dense decode over fp8_ds_mla records at up to 16
heads, producer warps dequantising the next tile while a consumer warpgroup multiplies
this one) and `gluon_fp8_producer` (either op over fp8_ds_mla records past 16 heads: a
producer warpgroup dequantising into the 64-head kernel's bf16 stages; and sparse calls
over a 16-bit cache past 16 heads, its producer copying the rows). Which of them run a signature, on which tiles and split plan, and over which
cache format, `plan.choose` decides (`MlaChoice`); the workspace a launch takes is the
choice's, and the records' worst-case sizing reads the same candidates
(`plan.workspace_specs`), so what is reserved before capture is what a call requests.

One kernel family serves both ops; they differ only in how a key position maps to a
cache row: `mla_decode` walks its request's block table up to `seq_lens[b]`, `sparse_mla`
reads the token's own list of cache slots (`-1` = none). A block id or slot outside the
cache (-1, the padding, or any other) holds no key: sparse calls fold one unsigned compare
per key into the key mask; dense calls on the Triton kernel launch it twice (CHECK_IDS off
and on) and each program, having scanned its split's block ids, works in the launch that
matches, so the common case (every id valid) runs the loop without a per-key check; the
Gluon kernels check per program (`one_dense_launch`) or per tile. Masked keys address row
0 and load as 0: no id is ever dereferenced and no unread row reaches the math. Non-finite
scores follow the softmax arithmetic (the ops' docstrings): a NaN or +inf score leaves l
NaN, which the epilogue and the combine keep NaN (only l == 0 means "no key").

Program = (head tile, split, query): it holds the query tile `[BLOCK_H, R + P]` and streams
BLOCK_N cache rows at a time (scores by MMA with f32 accumulation, the online softmax in
f32, base 2, and `acc[BLOCK_H, R] += p @ V` where V is the first R columns of the very
tile just loaded). With one split the kernel writes the final outputs; with several it
writes f32 partials into the workspace (a split without a valid key writes out 0, lse
-inf) and `combine_kernel` merges them. `sparse_mla`'s FlashMLA options are constexprs:
`topk_length` ends a token's key loop at its length (the entries right of it are never
read), the attention sink scales out by `sigmoid(lse - sink)` where the final out is
written (the attention epilogue with one split, the combine with several).

The runner `prepare_*` returns allocates the outputs, takes the partials from the
workspace and calls the bound launches (`graphsafe.launch.bind`). Each launch holds the
next kernel of the choice as its fallback: calls whose q or cache is not 16-byte aligned
run it, and so does every call after a Gluon kernel fails to compile (nothing launched;
`_GLUON_FAILED` warns once per variant). The Triton kernel compiles at its first launch:
`OutOfResources` binds it again with one pipeline stage fewer (the tiles, so the plan and
the workspace, unchanged).

Triton's CPU interpreter computes `tl.dot` on bf16 operands wrongly and truncates float32
-> bf16: there (and only there) bf16 dots run on f32 copies (DOT_F32), and dequantised
fp8_ds_mla keys are rounded to nearest even on their bits first, as the GPU rounds them.
An fp8_ds_mla cache (`graphsafe.formats.fp8_ds_mla`) runs the same kernels with FP8_DS on:
pointers and strides count bytes, each key tile's latent bytes are converted from e4m3
(in hardware where `has_ocp_e4m3`, else exactly with integer ops), multiplied by the
record's float32 scale of their 128-column tile and rounded to bf16 for the dots; the rope
values are read through a bf16 view; a record's storage offset is checked per call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from graphsafe.backends import triton_interpreter_enabled
from graphsafe.device_info import has_ocp_e4m3, is_hip
from graphsafe.launch import bind, compile_errors, output_allocator
from graphsafe.ops.mla import plan
from graphsafe.ops.mla.fake import check_fp8_ds_mla_offset
from graphsafe.ops.mla.plan import (
    FP8_DS_MLA, GLUON_FP8_FEW_HEADS, GLUON_FP8_PRODUCER, GLUON_PAGED_TMA, GLUON_WGMMA, KernelConfig, MlaChoice,
    kernel_module,
)
from graphsafe.registry import Backend, prepared
from graphsafe.workspace import current_workspace_manager

LOG2E = 1.4426950408889634
Launch = Callable[..., None]


def _pow2(n: int, least: int = 16) -> int:
    return max(1 << (max(n, 1) - 1).bit_length(), least)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _split_kv():
    """kernels/triton_split_kv.py (imported at the first prepare: `import graphsafe` never
    imports triton)."""
    from graphsafe.ops.mla.kernels import triton_split_kv

    return triton_split_kv


# Pipeline depth that compiled within the device's shared memory, per (config, device,
# dtype, head dim, cache dtype, variant). The configs are sized for their GPUs up front
# (plan.kernel_config; on ROCm plan.fit_stages fits the stages to the LDS); this is only the
# last guard, against a Triton version that allocates more shared memory than the plan's
# bound: one stage fewer keeps the tiles, so the split plan and the workspace stay the same.
_STAGES: dict[tuple, int] = {}


def _variant(constexprs: dict) -> tuple:
    """The kernel variant a binding compiles, as a memo key part: every constexpr (sparse or
    dense, split, id check, the sparse options, the cache format...), so what one variant
    learnt (a failed compile, the depth that fitted) is never applied to another."""
    return tuple(sorted(constexprs.items()))


def _triton_launch(grid, args, constexprs, cfg: KernelConfig, where: tuple) -> Launch:
    """The Triton attention kernel bound to one signature (`graphsafe.launch.bind`), called
    with its 9 tensors. The kernel compiles at the first call of a binding (and at a call
    whose pointers Triton specialises differently): where the compiled kernel needs more
    shared memory than the device has (`OutOfResources`, raised before anything is
    launched), it is bound again with one pipeline stage fewer and launched, down to one
    stage; the depth that compiled is remembered in `_STAGES` for later bindings."""
    key = (cfg, *where, _variant(constexprs))
    stages = _STAGES.get(key, cfg.num_stages)

    from triton.runtime import OutOfResources

    kernel = _split_kv().mla_attn_kernel

    def make(stages: int) -> Launch:
        return bind(kernel, grid, *args, **constexprs, num_warps=cfg.num_warps, num_stages=stages)

    launch = make(stages)
    recorded = False

    def run(*tensors):
        nonlocal launch, stages, recorded
        while True:
            try:
                launch(*tensors)
            except OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
                launch = make(stages)
                recorded = False
                continue
            break
        if not recorded:
            _STAGES[key] = stages
            recorded = True

    return run


# (device, dtype, head dim, cache dtype, variant) keys whose Gluon kernel failed to compile: those
# calls run the next kernel of their choice (a warning says why, once per key).
_GLUON_FAILED: set[tuple] = set()


def _gluon_failed(key: tuple, exc: BaseException) -> None:
    if key not in _GLUON_FAILED:
        _GLUON_FAILED.add(key)
        warnings.warn(f"graphsafe mla: the sm_90 Gluon kernel did not compile for {key} ({exc}); "
                      "running the Triton kernel", RuntimeWarning, stacklevel=4)


def _attention_launch(grid, args, gluon_constexprs, triton_constexprs, cfg: KernelConfig, where: tuple,
                      gluon: bool, dense: bool, one_launch: bool) -> Launch:
    """The attention kernel's launch, called with its 9 tensors: the Triton kernel, or
    where `gluon` (the choice lists the 64-head Gluon kernel) the Gluon kernel for
    calls whose q and cache are 16-byte aligned, the Triton kernel (bound on first need)
    for the others and for good once the Gluon kernel fails to compile (a failed compile
    launched nothing: the Triton kernel then runs the call). `dense`: the kernel launches
    twice, without and with the per-key id check (CHECK_IDS: each program works in the
    launch its split's ids call for), but the Gluon kernel launches once where
    `one_launch` (`IDS_PER_PROGRAM`)."""
    def triton_launch(check_ids: bool) -> Launch:
        return _triton_launch(grid, args, {**triton_constexprs, "CHECK_IDS": check_ids}, cfg, where)

    def gluon_launch(check_ids: str, fallback: Callable[[], Launch]) -> Launch:
        """The Gluon kernel with CHECK_IDS = its module's `check_ids`, else `fallback()`."""
        if not gluon:
            return fallback()
        module = kernel_module(GLUON_WGMMA)
        constexprs = {**gluon_constexprs, "CHECK_IDS": int(getattr(module, check_ids))}
        return _gluon_or_fallback(
            (*where, _variant(constexprs)),
            lambda: bind(module.mla_attn_wgmma_kernel, grid, *args, **constexprs, num_warps=module.NUM_WARPS),
            fallback)

    def both(first: Launch, second: Launch) -> Launch:
        def run(*tensors):
            first(*tensors)
            second(*tensors)

        return run

    def triton_pair() -> Launch:
        return both(triton_launch(False), triton_launch(True))

    if not dense:  # (sparse: slots are checked per key)
        return gluon_launch("IDS_UNCHECKED", lambda: triton_launch(False))
    if not gluon:
        return triton_pair()
    if one_launch:
        return gluon_launch("IDS_PER_PROGRAM", triton_pair)
    return both(gluon_launch("IDS_UNCHECKED", lambda: triton_launch(False)),
                gluon_launch("IDS_CHECKED", lambda: triton_launch(True)))


def _gluon_or_fallback(key: tuple, make_gluon: Callable[[], Launch], make_fallback: Callable[[], Launch]) -> Launch:
    """`run(q, kv, *rest)`: `gluon(q, kv, *rest)` (gluon = `make_gluon()`, bound now) for calls
    whose q and cache are 16-byte aligned, until it fails to compile (nothing launched:
    `_gluon_failed` remembers `key` and warns once), else the launch `make_fallback()`
    returns (made on first need). Where `key` failed before, `make_fallback()` itself."""
    if key in _GLUON_FAILED:
        return make_fallback()
    gluon = make_gluon()
    fallback = None

    def run(q, kv, *rest):
        nonlocal gluon, fallback
        if gluon is not None and not (q.data_ptr() | kv.data_ptr()) & 15:
            try:
                return gluon(q, kv, *rest)
            except compile_errors() as exc:
                gluon = None
                _gluon_failed(key, exc)
        if fallback is None:
            fallback = make_fallback()
        fallback(q, kv, *rest)

    return run


def _paged_launch(grid, q: torch.Tensor, kv_cache: torch.Tensor, r: int, scalars: tuple, block_size: int, split: bool,
                  where: tuple, fallback: Launch) -> Launch:
    """The dense decode's attention launch, called with the 9 tensors of the others:
    `kernels/gluon_paged_tma.mla_decode_tma_kernel` (one launch, ids checked per tile) for calls whose
    q and cache are 16-byte aligned, `fallback` (the 64-head kernel's launches) for the
    others and for good once it fails to compile (a failed compile launched nothing)."""
    module = kernel_module(GLUON_PAGED_TMA)

    def make() -> Launch:
        ph = _placeholder(q.device)
        kernel = bind(module.mla_decode_tma_kernel, grid, *module.tma_descriptors(q, kv_cache, r),
                      ph, ph, ph, ph, ph, ph, *scalars, BLOCK_SIZE=block_size, SPLIT=split,
                      CONSUMER_REGS=module.CONSUMER_REGS, LOADER_REGS=module.LOADER_REGS, num_warps=module.NUM_WARPS)

        def paged(q, kv, key_map, lens, sink, out, lse, pout, plse):  # q and the cache each as two descriptors
            kernel(q, q, kv, kv, key_map, lens, out, lse, pout, plse)

        return paged

    return _gluon_or_fallback((*where, "paged", block_size, split), make, lambda: fallback)


def _few_heads_launch(grid, device: torch.device, scalars: tuple, r: int, p: int, block_size: int, split: bool,
                      where: tuple, fallback: Launch) -> Launch:
    """The dense decode's attention launch over fp8_ds_mla records at up to 16 heads, called
    with the 9 tensors of the others: `kernels/gluon_fp8_few_heads.mla_fp8_few_heads_kernel` (one
    launch, ids checked per key) for calls whose q and cache are 16-byte aligned,
    `fallback` (the 64-head kernel's launch) for the others and for good once it fails to
    compile (a failed compile launched nothing)."""
    module = kernel_module(GLUON_FP8_FEW_HEADS)

    def make() -> Launch:
        ph = _placeholder(device)
        kernel = bind(module.mla_fp8_few_heads_kernel, grid, ph, ph, ph, ph, ph, ph, ph, ph, *scalars, R=r, P=p,
                      BLOCK_SIZE=block_size, SPLIT=split, PRODUCER_REGS=module.PRODUCER_REGS,
                      num_warps=module.NUM_WARPS)

        def few_heads(q, kv, key_map, lens, sink, out, lse, pout, plse):  # (no sink in dense decode)
            kernel(q, kv, key_map, lens, out, lse, pout, plse)

        return few_heads

    return _gluon_or_fallback((*where, "few heads", block_size, split), make, lambda: fallback)


def _producer_launch(grid, args: tuple, constexprs: dict, where: tuple, fallback: Launch) -> Launch:
    """Either op's attention launch over fp8_ds_mla records past 16 heads, called with the 9
    tensors of the others: `kernels/gluon_fp8_producer.mla_fp8_producer_kernel` (one launch,
    ids checked per key; the 64-head kernel's arguments) for calls whose q and cache are
    16-byte aligned, `fallback` (the 64-head kernel's launches) for the others and for good
    once it fails to compile (a failed compile launched nothing)."""
    module = kernel_module(GLUON_FP8_PRODUCER)
    return _gluon_or_fallback(
        (*where, "producer", _variant(constexprs)),
        lambda: bind(module.mla_fp8_producer_kernel, grid, *args, **constexprs, PRODUCER_WARPS=module.PRODUCER_WARPS,
                     PRODUCER_REGS=module.PRODUCER_REGS, num_warps=module.NUM_WARPS),
        lambda: fallback)


def _offset_checked(op: str, attention: Launch) -> Launch:
    """`attention` refusing (`InputError`) an fp8_ds_mla cache whose storage offset is not
    a multiple of 4 bytes (the kernel loads the scales as float32; the strides, part of
    the signature, were checked at its first call)."""
    def run(q, kv_cache, *rest):
        check_fp8_ds_mla_offset(op, kv_cache)
        attention(q, kv_cache, *rest)

    return run


def _combine_launch(rows: int, num_heads: int, r: int, num_splits: int, args: tuple, sink_stride: int | None) -> Launch:
    """`combine_kernel` bound to one signature (`sink_stride`: the attention sink's, None
    without one); called with (pout, plse, sink, out, lse), the sink never read without it."""
    block_s = _pow2(num_splits, 2)
    block_r = min(_pow2(r), max(32, 4096 // block_s))
    r_chunks = _cdiv(r, block_r)
    return bind(
        _split_kv().combine_kernel, (rows * num_heads * r_chunks,),
        *args, num_heads, num_splits, r_chunks, num_heads * r, r, num_heads, sink_stride or 0,
        R=r, BLOCK_S=block_s, BLOCK_R=block_r, HAS_SINK=sink_stride is not None, num_warps=4,
    )


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """A tensor on `device` that holds no memory: what `bind` takes at tensor positions."""
    return torch.empty(0, device=device)


def _prepare(op: str, call, sparse: bool, config: KernelConfig | None, num_splits: int | None):
    """`attend(q, kv_cache, key_map, lens, sink) -> (out, lse)` for calls with the signature
    of `call` (a bound `mla_decode` or `sparse_mla` call): the choice (`plan.choose`: kernels,
    tiles, split plan, cache format), the grid, the constexprs and the bound launches are
    fixed here; a call allocates the outputs, takes the partials from the workspace and
    launches. Holds no tensor of the call. `lens` cuts each row's keys (dense: the sequence
    lengths; sparse: read only with `topk_length`, the entries each token uses); `sink` is
    the `[H]` attention sink, read only with one (a placeholder tensor otherwise)."""
    q, kv_cache, r = call.q, call.kv_cache, call.kv_lora_rank
    key_map = call.indices if sparse else call.block_table
    topk_length = sparse and call.topk_length is not None
    sink_stride = call.attn_sink.stride(0) if sparse and call.attn_sink is not None else None
    rows, num_heads, head_dim = q.shape
    p = head_dim - r
    device, dtype = q.device, q.dtype
    sink = sink_stride is not None
    new_out = output_allocator((rows, num_heads, r), dtype, device)
    new_lse = output_allocator((rows, num_heads), torch.float32, device)
    if rows == 0 or num_heads == 0:
        def nothing(q, kv_cache, key_map, lens, sink):
            return new_out(), new_lse()

        return nothing
    choice = plan.choose(call, sparse=sparse, config=config, num_splits=num_splits)
    cfg, split_plan, split = choice.config, choice.plan, choice.split
    fp8_ds = choice.cache_format == FP8_DS_MLA
    kv_capacity = choice.kv_capacity
    specs = tuple(choice.workspace)
    nb, bs = kv_cache.shape[:2]
    head_tiles = _cdiv(num_heads, cfg.block_h)
    dot_f32 = dtype == torch.bfloat16 and device.type == "cpu" and triton_interpreter_enabled()
    grid = (head_tiles * split_plan.num_splits * rows,)
    # The tensors (q, the cache, the key map, the lengths, the sink, out, lse, the
    # partials) are placeholders at `bind`, which reads only their device: the runner
    # keeps none of the call's tensors alive.
    ph = _placeholder(device)
    qk_scale = float(call.sm_scale) * LOG2E
    args = (
        ph, ph, ph, ph, ph, ph, ph, ph, ph,
        qk_scale,
        num_heads, head_tiles, split_plan.num_splits, split_plan.tokens_per_split, kv_capacity, nb * bs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), key_map.stride(0),
        num_heads * r, r, num_heads,  # out and lse are contiguous
        sink_stride or 0,
    )
    where = (device, dtype, head_dim, kv_cache.dtype)

    # The choice's kernels, last first: each launch falls back to the one bound after it.
    attention = _attention_launch(
        grid, args,
        dict(R=r, P=p, BLOCK_SIZE=bs, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPARSE=sparse, SPLIT=split,
             TOPK_LENGTH=topk_length, HAS_SINK=sink, FP8_DS=fp8_ds, HEADS_ON_N=choice.heads_on_n),
        dict(
            R=r, P=p, BLOCK_SIZE=bs, BLOCK_R=max(_pow2(r) // cfg.value_chunks, 16), CHUNKS=cfg.value_chunks,
            BLOCK_P=_pow2(p), BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPARSE=sparse, SPLIT=split,
            DOT_F32=dot_f32,
            # PTX prefetch: NVIDIA only (not the interpreter, not ROCm); its lines count
            # 16-bit elements, so not for fp8_ds_mla records (no default config prefetches).
            PREFETCH=cfg.l2_prefetch and device.type == "cuda" and not is_hip(device) and not fp8_ds,
            LINES=_pow2(_cdiv(head_dim, 64), 1),
            FP8_DS=fp8_ds, FP8_NATIVE=fp8_ds and has_ocp_e4m3(device), TOPK_LENGTH=topk_length, HAS_SINK=sink,
        ),
        cfg, where, GLUON_WGMMA in choice.kernels, not sparse, choice.one_dense_launch,
    )
    if choice.kernel == GLUON_PAGED_TMA:
        attention = _paged_launch(
            grid, q, kv_cache, r,
            (qk_scale, num_heads, head_tiles, split_plan.num_splits, split_plan.tokens_per_split, kv_capacity,
             nb, nb * bs, key_map.stride(0), num_heads * r, r, num_heads),
            bs, split, where, attention)
    elif choice.kernel == GLUON_FP8_FEW_HEADS:
        attention = _few_heads_launch(
            grid, device,
            (qk_scale, num_heads, split_plan.num_splits, split_plan.tokens_per_split, kv_capacity, nb * bs,
             q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), key_map.stride(0), num_heads * r, r,
             num_heads),
            r, p, bs, split, where, attention)
    elif choice.kernel == GLUON_FP8_PRODUCER:
        attention = _producer_launch(
            grid, args,
            dict(R=r, P=p, BLOCK_SIZE=bs, SPARSE=sparse, SPLIT=split, TOPK_LENGTH=topk_length, HAS_SINK=sink,
                 FP8=fp8_ds),
            where, attention)

    if fp8_ds:  # the storage offset is no part of the signature: checked per call
        attention = _offset_checked(op, attention)
    if not split:  # the attention kernel applies the sink
        def attend(q, kv_cache, key_map, lens, sink):
            out, lse = new_out(), new_lse()
            attention(q, kv_cache, key_map, lens, sink, out, lse, out, lse)  # partials untouched (SPLIT off)
            return out, lse

        return attend
    combine = _combine_launch(rows, num_heads, r, split_plan.num_splits, (ph, ph, ph, ph, ph), sink_stride)

    def attend_split(q, kv_cache, key_map, lens, sink):  # the combine applies the sink
        out, lse = new_out(), new_lse()
        pout, plse = current_workspace_manager(device).get_simultaneous(*specs, owner=op)
        attention(q, kv_cache, key_map, lens, sink, out, lse, pout, plse)
        combine(pout, plse, sink, out, lse)
        return out, lse

    return attend_split


def prepare_mla_decode(call, *, config: KernelConfig | None = None, num_splits: int | None = None):
    """The Triton runner of `mla_decode` for calls with the signature of `call`;
    `config` / `num_splits` override the tiles / the split count (tests, tuning)."""
    attend = _prepare("mla_decode", call, False, config, num_splits)

    def run(q, kv_cache, block_table, seq_lens, *_):
        return attend(q, kv_cache, block_table, seq_lens, seq_lens)  # the sink slot is never read (no sink)

    return run


def prepare_sparse_mla(call, *, config: KernelConfig | None = None, num_splits: int | None = None):
    """The Triton runner of `sparse_mla` for calls with the signature of `call` (`attn_sink`
    and `topk_length` None or not is part of it); `config` / `num_splits` as for
    `prepare_mla_decode`."""
    attend = _prepare("sparse_mla", call, True, config, num_splits)

    def run(q, kv_cache, indices, sm_scale=None, kv_lora_rank=None, attn_sink=None, topk_length=None):
        # Where an option is None its slot gets `indices`, which the kernels then never read.
        return attend(q, kv_cache, indices, indices if topk_length is None else topk_length,
                      indices if attn_sink is None else attn_sink)

    return run


def explain_mla_decode(call) -> str:
    return plan.choose(call, sparse=False).describe()


def explain_sparse_mla(call) -> str:
    return plan.choose(call, sparse=True).describe()


MLA_DECODE = Backend(name="triton", prepare=prepare_mla_decode, workspace=plan.mla_decode_workspace,
                     explain=explain_mla_decode)
SPARSE_MLA = Backend(name="triton", prepare=prepare_sparse_mla, workspace=plan.sparse_mla_workspace,
                     explain=explain_sparse_mla)


# Runners of direct calls (tests, the tune bench), per signature and overrides.
def _call(op: str, *args):
    from graphsafe.registry import get_op

    return get_op(op).call(*args)


def mla_decode(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, *, config=None, num_splits=None):
    """Dense absorbed-MLA decode (inputs unchecked); `config` / `num_splits` override the
    plan (tests, tuning). Prepared once per signature and overrides."""
    args = (q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank)
    return prepared(prepare_mla_decode, _call("mla_decode", *args), config=config, num_splits=num_splits)(*args)


def sparse_mla(q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink=None, topk_length=None, *, config=None,
               num_splits=None):
    """Sparse absorbed-MLA attention over each token's own cache slots, with FlashMLA's
    optional sink and per-token lengths (inputs unchecked)."""
    args = (q, kv_cache, indices, sm_scale, kv_lora_rank, attn_sink, topk_length)
    return prepared(prepare_sparse_mla, _call("sparse_mla", *args), config=config, num_splits=num_splits)(*args)
