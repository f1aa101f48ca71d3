"""aiter backend of the GQA attention ops (ROCm only; selected when `import aiter` works).

Written against aiter's documented Python API; it cannot run on the machines this was
written on (no ROCm). What aiter does not cover is declined per call signature by the
records' `supports` predicates here (`supports_*`), and the registry hands those
signatures to the next backend (Triton); the adapter itself never calls another backend.

* `flash_attn_varlen` -> `aiter.flash_attn_varlen_func(q, k, v, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=, causal=)`
  (aiter/ops/mha.py; bottom-right causal alignment like FlashAttention-2; supports GQA
  and hdim_q 192 / hdim_v 128). Only for the bf16/fp16 path: aiter's fp8 varlen kernel
  (`flash_attn_varlen_fp8_pertensor_func`) takes the platform's fp8 type (e4m3fnuz on
  gfx942), not our float8_e4m3fn inputs, so fp8 goes to Triton.
* `paged_attention_decode` -> `torch.ops.aiter.paged_attention_v1(out, workspace, q,
  k_cache, v_cache, scale, block_tables, cu_query_lens, context_lens, max_context_len,
  alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
  fp8_out_scale, partition_size)` with kv_cache_layout "NHD" = our `[num_blocks,
  block_size, Hk, D]` layout (as vLLM's ROCM_AITER_FA decode calls it). Its partition
  count comes from `max_context_len`, which we pass from shapes
  (`max_blocks_per_seq * block_size`), never from `seq_lens` values (vLLM #51119).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphsafe.launch import bind
from graphsafe.ops.attention._triton_quant import bind_prepare
from graphsafe.ops.attention.fp8 import quantize_inputs
from graphsafe.workspace import current_workspace_manager

PARTITION_SIZE = 256  # aiter's paged_attention_v1 partition (vLLM's _PARTITION_SIZE_ROCM)
OWNER = "paged_attention_decode"


def decode_workspace_specs(batch: int, num_q_heads: int, head_dim: int, max_blocks_per_seq: int, block_size: int):
    """paged_attention_v1's buffer (bf16/fp16 partial outputs, f32 exp sums and max
    logits per partition), then int32 cu_query_lens [B+1] and clamped lengths [B], and
    two float32 unit scales."""
    partitions = max(1, -(-(max_blocks_per_seq * block_size) // PARTITION_SIZE))
    nbytes = batch * num_q_heads * partitions * head_dim * 2 + 2 * batch * num_q_heads * partitions * 4
    return [((nbytes,), torch.uint8), ((batch + 1,), torch.int32), ((batch,), torch.int32), ((2,), torch.float32)]


def paged_attention_decode_workspace(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks_per_seq: int, block_size: int,
    device: torch.device | str | None = None, head_dim: int | None = None,
):
    """This backend's worst case for one call (the record's `workspace`, the op's common
    parameters): aiter's buffer holds partial outputs of `head_dim` (= `head_dim_v` for
    the signatures it takes)."""
    return decode_workspace_specs(batch_size, num_q_heads, head_dim or head_dim_v, max_blocks_per_seq, block_size)


def supports_paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    """What paged_attention_v1 covers: contiguous q, a cache of q's dtype (no fp8 cache),
    D == Dv in (64, 128), block size 16 or 32."""
    return (
        q.is_contiguous()
        and k_cache.dtype == q.dtype
        and v_cache.shape[-1] == q.shape[-1]
        and q.shape[-1] in (64, 128)
        and k_cache.shape[1] in (16, 32)
    )


@triton.jit
def _zero_empty_rows_kernel(out_ptr, lens_ptr, row_len, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if tl.load(lens_ptr + b) <= 0:
        for c0 in range(0, row_len, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + b * row_len + cols, zeros, mask=cols < row_len)


def prepare_paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
    """The runner of this (supported) call signature: the workspace specs, the capacity
    passed as `max_context_len` and the empty-row launch are fixed here."""
    import aiter  # noqa: F401 - registers torch.ops.aiter.*

    b, hq, d = q.shape
    block_size = k_cache.shape[1]
    max_len = block_table.shape[1] * block_size
    shape, dtype, device = (b, hq, d), q.dtype, q.device
    if b == 0:
        def run_empty(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
            return torch.empty(shape, dtype=dtype, device=device)

        return run_empty

    paged_attention_v1 = torch.ops.aiter.paged_attention_v1
    specs = tuple(decode_workspace_specs(b, hq, d, block_table.shape[1], block_size))
    # Our contract: an empty request gives 0 (aiter's value for it is not documented).
    zero_empty_rows = bind(_zero_empty_rows_kernel, (b,), q, seq_lens, hq * d,
                           BLOCK=min(1024, triton.next_power_of_2(hq * d)))

    def run(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale=None, v_scale=None):
        out = torch.empty(shape, dtype=dtype, device=device)
        buf, cu_query_lens, lens, unit = current_workspace_manager(device).get_simultaneous(*specs, owner=OWNER)
        torch.arange(b + 1, out=cu_query_lens)  # one query token per request
        torch.clamp(seq_lens, 0, max_len, out=lens)  # our contract clamps; aiter would read past the table
        unit.fill_(1.0)
        paged_attention_v1(
            out, buf, q, k_cache, v_cache, scale, block_table, cu_query_lens[:b], lens, max_len,
            None, "auto", "NHD", 0.0, unit[0:1], unit[1:2], None, PARTITION_SIZE,
        )
        zero_empty_rows(out, lens)
        return out

    return run


def supports_flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off",
):
    """The bf16/fp16 path only: fp8 inputs and fp8 quantisation ("on", or "auto" where
    `fp8_prefill_supported`) go to the next backend."""
    return q.dtype in (torch.bfloat16, torch.float16) and not quantize_inputs(fp8, q.dtype, q.device)


def prepare_flash_attn_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
    q_descale=None, k_descale=None, v_descale=None, fp8="off",
):
    """The runner of this (supported) call signature; the launch that zeroes the padding
    rows after the last sequence is bound here."""
    import aiter

    varlen = aiter.flash_attn_varlen_func
    tq, hq, _ = q.shape
    dv = v.shape[-1]
    # Rows after the last sequence (padding) are 0 in our contract; aiter leaves them unset.
    zero_tail = bind_prepare(q, cu_seqlens_q.shape[0] - 1, tq, hq * dv, False)

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            q_descale=None, k_descale=None, v_descale=None, fp8="off"):
        res = varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
        )
        out = res[0] if isinstance(res, (tuple, list)) else res  # older aiter returns a 1-tuple
        if out.dim() != 3 or out.shape[-1] != dv or not out.is_contiguous():
            out = out[..., :dv].contiguous()
        if zero_tail is not None:
            zero_tail(out, cu_seqlens_q, out)
        return out

    return run

