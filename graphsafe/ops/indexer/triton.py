"""Triton backend of the sparse-indexer ops: the host side (records, prepare, runners).

`prepare_<op>(call)` runs once per call signature: it takes the op's decision from
`graphsafe/ops/indexer/plan.py` (`choose_<op>(call)`: tiles, launch options, grid,
fp8 dots or bytes decoded to fp16) and binds the kernel (`graphsafe.launch.bind`); the
runner it returns launches with the tensors alone. The logits kernels also have
`bind_*_logits` (a chosen launch bound to a caller's output buffer: the composites bind
them on workspace views), `prepare_*_into` and `*_into` (tests, benchmarks: overrides of
the choice, run once).

The kernels are in `graphsafe/ops/indexer/kernels/` (`triton_k_cache.py`,
`triton_mqa_logits.py`, `triton_paged_mqa_logits.py`, `triton_slots.py`, where their
design notes are), imported when a runner is first bound: importing this module never
imports triton. Every kernel runs on every Triton target: devices without fp8 e4m3fn
matrix units read the fp8 tiles as bytes and decode them in registers.
"""

from __future__ import annotations

import torch

from graphsafe.launch import bind, output_allocator
from graphsafe.ops.indexer import plan
from graphsafe.registry import Backend, prepared


def _nothing(*args, **kwargs) -> None:
    return None


# -- indexer_k_quant_and_cache -----------------------------------------------------------
def prepare_indexer_k_quant_and_cache(call):
    choice = plan.choose_indexer_k_quant_and_cache(call)
    if choice is None:
        return _nothing
    from graphsafe.ops.indexer.kernels.triton_k_cache import quant_and_cache_kernel

    k, kv_cache = call.k, call.kv_cache
    t, d = k.shape
    nb, bs, _ = kv_cache.shape
    # kv_cache stands for its float32 view here (bind reads only the device).
    launch = bind(
        quant_and_cache_kernel, choice.grid,
        k, kv_cache, kv_cache, call.slot_mapping,
        t, nb * bs, bs, k.stride(0), kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4,
        D=d, G=choice.groups, QB=call.quant_block_size, BLOCK_T=choice.block_t, BLOCK_Q=choice.block_q,
        UE8M0=choice.ue8m0, num_warps=choice.num_warps,
    )

    def run(k, kv_cache, slot_mapping, quant_block_size, scale_fmt=None) -> None:
        launch(k, kv_cache, kv_cache.view(torch.float32), slot_mapping)

    return run


# -- cp_gather_indexer_k_quant_cache -----------------------------------------------------
def prepare_cp_gather_indexer_k_quant_cache(call):
    choice = plan.choose_cp_gather_indexer_k_quant_cache(call)
    if choice is None:  # (no blocks or an empty table: the owned rows get zero rows)
        return _nothing
    from graphsafe.ops.indexer.kernels.triton_k_cache import gather_kernel

    kv_cache, dst_k, dst_scale, block_table = call.kv_cache, call.dst_k, call.dst_scale, call.block_table
    n, d = dst_k.shape
    nb, bs, _ = kv_cache.shape
    b, mb = block_table.shape
    # kv_cache and dst_k stand for their float32 / uint8 views here (bind reads only the device).
    launch = bind(
        gather_kernel, choice.grid,
        kv_cache, kv_cache, dst_k, dst_scale, block_table, call.cu_seq_lens,
        n, b, nb, mb, bs,
        kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4, block_table.stride(0), dst_k.stride(0),
        dst_scale.stride(0), choice.search_steps,
        D=d, G=choice.groups, BLOCK_R=choice.block_r, BLOCK_D=choice.block_d, BLOCK_G=choice.block_g,
        ROW_ALIGN=choice.row_align, num_warps=choice.num_warps,
    )

    def run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
        launch(kv_cache, kv_cache.view(torch.float32), dst_k.view(torch.uint8), dst_scale, block_table, cu_seq_lens)

    return run


# -- fp8_mqa_logits (prefill) --------------------------------------------------------------
def bind_mqa_logits(choice: plan.MqaLogitsChoice | None, q, k, k_scale, weights, out_stride: int):
    """`run(out, q, k, k_scale, weights, ks, ke)` for tensors of this signature: `choice`'s
    launch, `out` of row stride `out_stride`."""
    if choice is None:
        return _nothing
    from graphsafe.ops.indexer.kernels.triton_mqa_logits import mqa_logits_kernel

    m, h, d = q.shape
    n = k.shape[0]
    # q stands for ks, ke and out here (bind reads only the device); the uint8 views that
    # the fp16 path passes have the strides of the fp8 tensors.
    launch = bind(
        mqa_logits_kernel, choice.grid,
        q, k, k_scale, weights, q, q, q,
        m, n, h,
        q.stride(0), q.stride(1), k.stride(0), k_scale.stride(0), weights.stride(0), weights.stride(1), out_stride,
        D=d, BLOCK_M=choice.block_m, BLOCK_N=choice.block_n, BLOCK_D=choice.block_d, FP8_DOT=choice.fp8_dot,
        CLEAN=choice.clean, **choice.launch_options,
    )
    if choice.fp8_dot:
        def run(out, q, k, k_scale, weights, ks, ke) -> None:
            launch(q, k, k_scale, weights, ks, ke, out)
    else:  # the kernel decodes the bytes itself (no fp8 type needed on the target)
        def run(out, q, k, k_scale, weights, ks, ke) -> None:
            launch(q.view(torch.uint8), k.view(torch.uint8), k_scale, weights, ks, ke, out)
    return run


def prepare_fp8_mqa_logits(call):
    m, n = call.q.shape[0], call.k.shape[0]
    # A fresh contiguous [M, N] output: row stride N.
    fill = bind_mqa_logits(plan.choose_fp8_mqa_logits(call), call.q, call.k, call.k_scale, call.weights, n)
    new_out = output_allocator((m, n), torch.float32, call.q.device)

    def run(q, k, k_scale, weights, ks, ke):
        out = new_out()
        fill(out, q, k, k_scale, weights, ks, ke)
        return out

    return run


def prepare_mqa_logits_into(
    out, q, k, k_scale, weights, ks, ke, *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
):
    """`run(out, q, k, k_scale, weights, ks, ke)`, which writes every element of `out`
    `[M, N]`, for tensors of this signature; `fp8_dot`/`config` override the device choice
    (tests).

    `clean=False` (the composite: the top-k reads only the windows) skips the tiles
    outside every row's window; the rest of those tiles' rows is still -inf."""
    m, h, d = q.shape
    choice = plan.choose_mqa_logits(m, k.shape[0], h, d, q.device, fp8_dot=fp8_dot, config=config, clean=clean)
    return bind_mqa_logits(choice, q, k, k_scale, weights, out.stride(0))


def mqa_logits_into(
    out, q, k, k_scale, weights, ks, ke, *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
) -> None:
    """`prepare_mqa_logits_into(...)` run once; the runner is kept per signature and options
    (`bind` costs far more than a launch, and benchmarks call this in a loop)."""
    args = (out, q, k, k_scale, weights, ks, ke)
    prepared(prepare_mqa_logits_into, *args, fp8_dot=fp8_dot, config=config, clean=clean)(*args)


# -- fp8_paged_mqa_logits (decode) ---------------------------------------------------------
def bind_paged_mqa_logits(choice: plan.PagedLogitsChoice | None, q, kv_cache, weights, block_table,
                          max_model_len: int, out_stride: int):
    """`run(out, q, kv_cache, weights, context_lens, block_table, max_model_len)` for this
    signature (q `[B, next_n, H, D]`): `choice`'s launch, `out` of row stride `out_stride`."""
    if choice is None:
        return _nothing
    from graphsafe.ops.indexer.kernels.triton_paged_mqa_logits import paged_mqa_logits_kernel

    b, next_n, h, d = q.shape
    bs = kv_cache.shape[1]
    # Tensors stand for the views passed at run time (bind reads only the device).
    launch = bind(
        paged_mqa_logits_kernel, choice.grid,
        q, kv_cache, kv_cache, weights, weights, block_table, weights,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        kv_cache.stride(0), kv_cache.stride(0) // 4, bs * d // 4, block_table.stride(0), out_stride,
        max_model_len, choice.chunk, kv_cache.shape[0],
        H=h, D=d, BS=bs, NEXT_N=next_n, BLOCK_H=choice.block_h, BLOCK_D=choice.block_d, BLOCK_N=choice.block_n,
        FP8_DOT=choice.fp8_dot, ROW_ALIGN=choice.row_align, CLEAN=choice.clean,
        **choice.launch_options,
    )
    # A launch reads only each tensor's address and dtype (the strides are bound above), so
    # run takes q in any shape of the same memory: the decode composite passes its [T, H, D].
    if choice.fp8_dot:
        def run(out, q, kv_cache, weights, context_lens, block_table, max_model_len) -> None:
            launch(q, kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32), weights, context_lens,
                   block_table, out)
    else:  # the kernel reads bytes and decodes them (no fp8 type on the target)
        def run(out, q, kv_cache, weights, context_lens, block_table, max_model_len) -> None:
            launch(q.view(torch.uint8), kv_cache, kv_cache.view(torch.float32), weights, context_lens, block_table, out)
    return run


def prepare_fp8_paged_mqa_logits(call):
    b, next_n = call.q.shape[:2]
    length = call.max_model_len
    fill = bind_paged_mqa_logits(plan.choose_fp8_paged_mqa_logits(call), call.q, call.kv_cache, call.weights,
                                 call.block_table, length, length)
    new_out = output_allocator((b * next_n, length), torch.float32, call.q.device)

    def run(q, kv_cache, weights, context_lens, block_table, max_model_len):
        out = new_out()
        fill(out, q, kv_cache, weights, context_lens, block_table, max_model_len)
        return out

    return run


def prepare_paged_mqa_logits_into(
    out, q, kv_cache, weights, context_lens, block_table, max_model_len,
    *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
):
    """`run(out, q, kv_cache, weights, context_lens, block_table, max_model_len)`, which writes
    every element of `out` `[B*next_n, max_model_len]`, for tensors of this signature;
    `fp8_dot`/`config` override the device choice (tests use them for the fp16 path and
    many small chunks).

    `clean=False` (the composite: the top-k reads only each row's valid range) writes the
    key tiles below each context only, not the -inf tail up to `max_model_len`."""
    choice = plan.choose_paged_mqa_logits(q.shape, kv_cache, max_model_len, q.device, fp8_dot=fp8_dot,
                                          config=config, clean=clean)
    return bind_paged_mqa_logits(choice, q, kv_cache, weights, block_table, max_model_len, out.stride(0))


def paged_mqa_logits_into(
    out, q, kv_cache, weights, context_lens, block_table, max_model_len,
    *, fp8_dot: bool | None = None, config: dict | None = None, clean: bool = True,
) -> None:
    """`prepare_paged_mqa_logits_into(...)` run once; the runner is kept per signature and options."""
    args = (out, q, kv_cache, weights, context_lens, block_table, max_model_len)
    prepared(prepare_paged_mqa_logits_into, *args, fp8_dot=fp8_dot, config=config, clean=clean)(*args)


# -- req_local_to_global_slots -------------------------------------------------------------
def prepare_req_local_to_global_slots(call):
    choice = plan.choose_req_local_to_global_slots(call)
    t, k = call.topk_indices.shape
    device = call.topk_indices.device
    if choice.path == "empty":
        def run(req_id_per_token, block_table, topk_indices, block_size):
            return torch.empty((t, k), dtype=torch.int32, device=device)
        return run
    if choice.path == "padding":
        def run(req_id_per_token, block_table, topk_indices, block_size):
            return torch.full((t, k), -1, dtype=torch.int32, device=device)
        return run
    from graphsafe.ops.indexer.kernels.triton_slots import req_local_to_global_kernel

    block_table, topk_indices = call.block_table, call.topk_indices
    b, mb = block_table.shape
    # topk_indices stands for the output here (bind reads only the device); the output is
    # a fresh contiguous [T, K].
    launch = bind(
        req_local_to_global_kernel, choice.grid,
        call.req_id_per_token, block_table, topk_indices, topk_indices,
        b, mb, k, block_table.stride(0), topk_indices.stride(0), topk_indices.stride(1), k,
        BS=call.block_size, BLOCK_K=choice.block_k, LAST_BLOCK_ID=choice.last_block_id, num_warps=choice.num_warps,
    )

    new_out = output_allocator((t, k), torch.int32, device)

    def run(req_id_per_token, block_table, topk_indices, block_size):
        out = new_out()
        launch(req_id_per_token, block_table, topk_indices, out)
        return out

    return run


# -- the records (graphsafe/ops/indexer/__init__.py names them) ------------------------------
INDEXER_K_QUANT_AND_CACHE = Backend(name="triton", prepare=prepare_indexer_k_quant_and_cache)
CP_GATHER_INDEXER_K_QUANT_CACHE = Backend(name="triton", prepare=prepare_cp_gather_indexer_k_quant_cache)
FP8_MQA_LOGITS = Backend(name="triton", prepare=prepare_fp8_mqa_logits)
FP8_PAGED_MQA_LOGITS = Backend(name="triton", prepare=prepare_fp8_paged_mqa_logits)
REQ_LOCAL_TO_GLOBAL_SLOTS = Backend(name="triton", prepare=prepare_req_local_to_global_slots)
