"""Triton backend of `paged_attention_prefill`: the per-signature runner and its config.

`prepare_paged_attention_prefill` runs once per call signature (the registry keeps its
runner): the tile config, the grid and both launches are bound there
(`graphsafe.launch.bind`). A call makes 2 launches: zero the output rows outside every
sequence (`_triton_quant.bind_prepare`), then attention (`_triton_paged_prefill`). No
workspace: one program covers all keys of its query block (no split-KV).
"""

from __future__ import annotations

import torch

from graphsafe.device_info import compute_capability
from graphsafe.launch import output_allocator
from graphsafe.ops.attention.kernels.triton_paged_prefill import bind_paged_prefill
from graphsafe.ops.attention.kernels.triton_quant import bind_prepare


def paged_prefill_config(device: torch.device, d: int, dv: int, group: int, max_seqlen_q: int
                         ) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) from shapes and host ints only.

    CUDA: 128 rows (8 warps) when a sequence's query block fills them
    (`max_seqlen_q * group > 64`), else 64 (4 warps); 64 keys per tile; 3 stages on
    Hopper at head dims <= 128, 2 otherwise. Head dims > 128 take 64 rows (the fp32
    accumulator of 128 x 256 would spill). The interpreter (CPU): 16 x 16 tiles, so tiny
    tests cover several query blocks and key tiles."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    wide = max(d, dv) > 128
    block_m = 128 if max_seqlen_q * group > 64 and not wide else 64
    cc = compute_capability(device)
    hopper = cc is not None and cc >= (9, 0)
    return block_m, 64, 8 if block_m == 128 else 4, 3 if hopper and not wide else 2


def prepare_paged_attention_prefill(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
    k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None, *,
    config=None,
):
    """The runner of this call signature: config, grid and launches fixed here. `config`
    (tests and benchmarks only) overrides (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    tq, hq, d = q.shape
    hk, dv = v_cache.shape[2:]
    device = q.device
    new_out = output_allocator((tq, hq, dv), q.dtype, device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    zero_rows = bind_prepare(q, num_seqs, tq, hq * dv, False)  # None: the output has no element
    if zero_rows is None:
        def run_empty(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
                      k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None):
            return new_out()

        return run_empty

    config = config or paged_prefill_config(device, d, dv, hq // hk, max_seqlen_q)
    attend = bind_paged_prefill(q, k_cache, v_cache, block_table, seq_lens, num_seqs, max_seqlen_q, scale, causal,
                                window_left, softcap, None if sinks is None else sinks.stride(0), config)
    kv_fp8 = k_cache.dtype.itemsize == 1

    def run(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
            k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None):
        out = new_out()
        zero_rows(out, cu_seqlens_q, out)
        if attend is not None:
            if not kv_fp8:
                k_scale = v_scale = q  # bf16/fp16 caches read no scale: placeholders
            attend(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale, v_scale,
                   q if sinks is None else sinks, out)
        return out

    return run


def paged_attention_prefill(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
    k_scale=None, v_scale=None, window_left=-1, softcap=0.0, sinks=None, *,
    config=None,
):
    """One call, prepared afresh. `config` (tests and benchmarks only) overrides
    (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    args = (q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, causal,
            k_scale, v_scale, window_left, softcap, sinks)
    return prepare_paged_attention_prefill(*args, config=config)(*args)

