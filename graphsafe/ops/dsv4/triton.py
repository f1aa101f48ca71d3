"""Triton backend of the DeepSeek-V4 ops: records, and runners that bind the choice made
once per call signature to the kernels (graphsafe/ops/dsv4/kernels/).

`dsv4_sparse_attn`: `plan.choose` fixes the tiles, the split plan and the cache format;
`prepare_dsv4_sparse_attn` binds `kernels/triton_sparse_attn.dsv4_attn_kernel` (and, with
several splits, the MLA ops' `combine_kernel`, whose partial layout and sink rule it
shares) with `graphsafe.launch.bind`; a call allocates the outputs, takes the partials
from the workspace manager (the choice's specs, the same the record's worst case sizes)
and launches. The runner holds no tensor of a call.

Under Triton's CPU interpreter bf16 dots run on f32 copies (DOT_F32; its bf16 `tl.dot`
is wrong) and dequantised records round to bf16 on their bits (its conversion
truncates); e4m3 bytes convert in hardware only where the device has OCP e4m3
(`has_ocp_e4m3`), else with integer ops, exactly.

No module here imports triton at import time (`import graphsafe` must not).
"""

from __future__ import annotations

import functools
import warnings

import torch

from graphsafe.backends import triton_interpreter_enabled
from graphsafe.device_info import has_ocp_e4m3
from graphsafe.launch import bind, compile_errors, output_allocator
from graphsafe.ops.dsv4 import plan
from graphsafe.registry import Backend, prepared
from graphsafe.workspace import current_workspace_manager

LOG2E = 1.4426950408889634


def _pow2(n: int, least: int = 16) -> int:
    return max(1 << (max(n, 1) - 1).bit_length(), least)


@functools.cache
def _attn_kernels():
    from graphsafe.ops.dsv4.kernels import triton_sparse_attn
    from graphsafe.ops.mla.kernels import triton_split_kv

    return triton_sparse_attn.dsv4_attn_kernel, triton_split_kv.combine_kernel


# Keys whose Gluon kernel failed to compile: their calls run the Triton kernel (warned once).
_GLUON_FAILED: set[tuple] = set()


def _gluon_or_triton(key: tuple, gluon, make_triton):
    """`run(q, kv_cache, ..., extra_kv_cache, ...)` (the kernel's tensors): the Gluon launch
    for calls whose q and caches are 16-byte aligned, until it fails to compile (nothing
    launched; warned once per `key`), else the Triton launch `make_triton()` (made on
    first need) on the same split plan. A key that failed before binds no Gluon launch."""
    triton_launch = None
    if key in _GLUON_FAILED:
        gluon = None

    def run(*tensors):
        nonlocal gluon, triton_launch
        q, kv, xkv = tensors[0], tensors[1], tensors[4]
        if gluon is not None and not (q.data_ptr() | kv.data_ptr() | xkv.data_ptr()) & 15:
            try:
                return gluon(*tensors)
            except compile_errors() as exc:
                gluon = None
                _GLUON_FAILED.add(key)
                warnings.warn(f"graphsafe dsv4_sparse_attn: the sm_90 Gluon kernel did not compile for {key} "
                              f"({exc}); running the Triton kernel", RuntimeWarning, stacklevel=2)
        if triton_launch is None:
            triton_launch = make_triton()
        triton_launch(*tensors)

    return run


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


def prepare_dsv4_sparse_attn(call, *, config: plan.Dsv4Tiles | None = None, num_splits: int | None = None):
    """The Triton runner of `dsv4_sparse_attn` for calls with the signature of `call`;
    `config` / `num_splits` override the tiles / split count (tests, tuning)."""
    q, kv_cache = call.q, call.kv_cache
    rows, heads, d = q.shape
    device = q.device
    new_out = output_allocator((rows, heads, d), q.dtype, device)
    new_lse = output_allocator((rows, heads), torch.float32, device)
    if rows == 0 or heads == 0:
        def nothing(*args, **kwargs):
            return new_out(), new_lse()

        return nothing
    choice = plan.choose(call, config=config, num_splits=num_splits)
    split_plan = choice.plan
    records = choice.cache_format == "fp8_dsv4"
    extra = call.extra_kv_cache
    has_extra = extra is not None
    ph = _placeholder(device)
    nb, bs = kv_cache.shape[:2]
    xnb, xbs = extra.shape[:2] if has_extra else (1, 1)
    sink_stride = call.attn_sink.stride(0) if call.attn_sink is not None else None
    args = (
        ph, ph, ph, ph, ph, ph, ph, ph, ph, ph, ph, ph,
        float(call.sm_scale) * LOG2E,
        heads, None, split_plan.num_splits, split_plan.tokens_per_split, choice.topk, choice.extra_topk,
        nb * bs, xnb * xbs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), call.indices.stride(0),
        extra.stride(0) if has_extra else 0, extra.stride(1) if has_extra else 0,
        call.extra_indices.stride(0) if has_extra else 0,
        heads * d, d, heads, sink_stride or 0,
    )
    options = dict(BLOCK_SIZE=bs, EXTRA_BLOCK_SIZE=xbs, HAS_EXTRA=has_extra, TOPK_LENGTH=call.topk_length is not None,
                   EXTRA_TOPK_LENGTH=has_extra and call.extra_topk_length is not None,
                   HAS_SINK=sink_stride is not None, SPLIT=choice.split)

    def launch_on(cfg: plan.Dsv4Tiles, kernel, **constexprs):
        """The attention kernel bound on tiles `cfg` (its head tiles make the grid)."""
        head_tiles = -(-heads // cfg.block_h)
        bound = (*args[:14], head_tiles, *args[15:])
        return bind(kernel, (head_tiles * split_plan.num_splits * rows,), *bound, **options, **constexprs,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def triton_launch():
        cfg = choice.config if choice.kernel == plan.TRITON_SPARSE_ATTN else plan.tiles(heads, device.type)
        return launch_on(
            cfg, _attn_kernels()[0], D=d, BLOCK_D=_pow2(d), BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            RECORDS=records, FP8_NATIVE=records and has_ocp_e4m3(device),
            DOT_F32=device.type == "cpu" and triton_interpreter_enabled(),
        )

    if choice.kernel == plan.GLUON_SPARSE_ATTN:
        gluon = launch_on(choice.config, plan.gluon_module().dsv4_attn_wgmma_kernel)
        key = ("dsv4_sparse_attn", device, q.stride()[:2], tuple(sorted(options.items())))
        attention = _gluon_or_triton(key, gluon, triton_launch)
    else:
        attention = triton_launch()
    _, combine_kernel = _attn_kernels()

    def tensors(q, kv_cache, indices, attn_sink, topk_length, extra_kv_cache, extra_indices, extra_topk_length):
        """The kernel's 8 input tensors, a placeholder (never read) for each absent one."""
        return (q, kv_cache, indices, ph if topk_length is None else topk_length,
                ph if extra_kv_cache is None else extra_kv_cache, ph if extra_indices is None else extra_indices,
                ph if extra_topk_length is None else extra_topk_length, ph if attn_sink is None else attn_sink)

    if not choice.split:
        def run(q, kv_cache, indices, sm_scale=None, attn_sink=None, topk_length=None, extra_kv_cache=None,
                extra_indices=None, extra_topk_length=None):
            out, lse = new_out(), new_lse()
            attention(*tensors(q, kv_cache, indices, attn_sink, topk_length, extra_kv_cache, extra_indices,
                               extra_topk_length), out, lse, out, lse)  # partials untouched (SPLIT off)
            return out, lse

        return run

    specs = tuple(choice.workspace)
    s = split_plan.num_splits
    block_s = _pow2(s, 2)
    block_r = min(_pow2(d), max(32, 4096 // block_s))
    r_chunks = -(-d // block_r)
    combine = bind(
        combine_kernel, (rows * heads * r_chunks,), ph, ph, ph, ph, ph,
        heads, s, r_chunks, heads * d, d, heads, sink_stride or 0,
        R=d, BLOCK_S=block_s, BLOCK_R=block_r, HAS_SINK=sink_stride is not None, num_warps=4,
    )

    def run_split(q, kv_cache, indices, sm_scale=None, attn_sink=None, topk_length=None, extra_kv_cache=None,
                  extra_indices=None, extra_topk_length=None):
        out, lse = new_out(), new_lse()
        pout, plse = current_workspace_manager(device).get_simultaneous(*specs, owner="dsv4_sparse_attn")
        inputs = tensors(q, kv_cache, indices, attn_sink, topk_length, extra_kv_cache, extra_indices,
                         extra_topk_length)
        attention(*inputs, out, lse, pout, plse)
        combine(pout, plse, inputs[7], out, lse)
        return out, lse

    return run_split


@functools.cache
def _insert_kernel():
    from graphsafe.ops.dsv4.kernels import triton_qnorm_rope_insert

    return triton_qnorm_rope_insert.qnorm_rope_kv_insert_kernel


# Heads per loop step of the query part (a [BLOCK_H, 512] tile of f32 values).
INSERT_BLOCK_H = 8


def prepare_dsv4_qnorm_rope_kv_insert(call):
    """The Triton runner of `dsv4_qnorm_rope_kv_insert`: one program per token."""
    q, kv, q_out, kv_cache = call.q, call.kv, call.q_out, call.kv_cache
    t, h, _ = q.shape
    if t == 0:
        def nothing(*args):
            return None

        return nothing
    ph = _placeholder(q.device)
    nb, bs = kv_cache.shape[:2]
    launch = bind(
        _insert_kernel(), (t,), ph, ph, ph, ph, ph, ph, ph,
        float(call.eps), h, q_out.shape[1], call.slot_mapping.shape[0], call.cos_sin_cache.shape[0], nb * bs,
        q.stride(0), q.stride(1), kv.stride(0), q_out.stride(0), q_out.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), call.cos_sin_cache.stride(0),
        BLOCK_SIZE=bs, RECORDS=kv_cache.dtype == torch.uint8, BLOCK_H=INSERT_BLOCK_H, num_warps=4,
    )

    def run(q, kv, q_out, kv_cache, slot_mapping, positions, cos_sin_cache, eps=None):
        launch(q, kv, q_out, kv_cache, slot_mapping, positions, cos_sin_cache)

    return run


DSV4_QNORM_ROPE_KV_INSERT = Backend(name="triton", prepare=prepare_dsv4_qnorm_rope_kv_insert)


@functools.cache
def _compress_kernels():
    from graphsafe.ops.dsv4.kernels import triton_compress

    return triton_compress.save_state_kernel, triton_compress.compress_kernel


def prepare_dsv4_compress_kv(call):
    """The Triton runner of `dsv4_compress_kv`: the state save, then the pooling and write
    (two launches: a window's states may come from other tokens of the call)."""
    kv, state, cache, table = call.kv, call.state_cache, call.kv_cache, call.state_block_table
    t, w = kv.shape
    if t == 0:
        def nothing(*args):
            return None

        return nothing
    d = call.norm_weight.shape[0]
    ratio = call.compress_ratio
    nsb, sbs = state.shape[:2]
    nb, bs = cache.shape[:2]
    max_pos = call.cos_sin_cache.shape[0]
    ph = _placeholder(kv.device)
    save_kernel, compress_kernel = _compress_kernels()
    save = bind(
        save_kernel, (t,), ph, ph, ph, ph, ph, ph,
        max_pos, nsb * sbs, kv.stride(0), call.score.stride(0), call.ape.stride(0), state.stride(0), state.stride(1),
        W=w, STATE_BLOCK=sbs, RATIO=ratio, BLOCK_W=min(_pow2(w), 1024), num_warps=4,
    )
    s = ratio * (w // d)
    compress = bind(
        compress_kernel, (t,), ph, ph, ph, ph, ph, ph, ph, ph, ph,
        float(call.eps), max_pos, nsb * sbs, nsb, table.shape[0], table.shape[1], nb * bs,
        state.stride(0), state.stride(1), table.stride(0), call.cos_sin_cache.stride(0), cache.stride(0),
        cache.stride(1),
        D=d, W=w, RATIO=ratio, S=s, STATE_BLOCK=sbs, BLOCK_S=_pow2(s, 2), BLOCK_SIZE=bs,
        RECORDS=cache.dtype == torch.uint8, num_warps=4,
    )

    def run(kv, score, ape, positions, state_cache, state_slot_mapping, state_block_table, token_to_req, norm_weight,
            eps, cos_sin_cache, kv_cache, kv_slot_mapping, compress_ratio):
        save(kv, score, ape, positions, state_cache, state_slot_mapping)
        compress(positions, state_cache, state_slot_mapping, state_block_table, token_to_req, norm_weight,
                 cos_sin_cache, kv_cache, kv_slot_mapping)

    return run


DSV4_COMPRESS_KV = Backend(name="triton", prepare=prepare_dsv4_compress_kv)


def explain_dsv4_sparse_attn(call) -> str:
    return plan.choose(call).describe()


DSV4_SPARSE_ATTN = Backend(name="triton", prepare=prepare_dsv4_sparse_attn,
                           workspace=plan.dsv4_sparse_attn_workspace, explain=explain_dsv4_sparse_attn)


def _call(op: str, *args):
    from graphsafe.registry import get_op

    return get_op(op).call(*args)


def dsv4_sparse_attn(q, kv_cache, indices, sm_scale, attn_sink=None, topk_length=None, extra_kv_cache=None,
                     extra_indices=None, extra_topk_length=None, *, config=None, num_splits=None):
    """The Triton kernel run directly (inputs unchecked); `config` / `num_splits` override
    the plan (tests, tuning). Prepared once per signature and overrides."""
    args = (q, kv_cache, indices, sm_scale, attn_sink, topk_length, extra_kv_cache, extra_indices, extra_topk_length)
    return prepared(prepare_dsv4_sparse_attn, _call("dsv4_sparse_attn", *args), config=config,
                    num_splits=num_splits)(*args)
