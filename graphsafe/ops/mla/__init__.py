"""Absorbed MLA attention over the paged latent cache: dense decode and sparse (DSA) attention.

The latent cache `kv_cache [num_blocks, block_size, R + P]` is written by
`concat_and_cache_mla`: each token's row is its compressed KV (R = kv_lora_rank = 512 for
DeepSeek) followed by its rope key (P = 64). In the absorbed form a query head is one
`R + P` vector: `score = sm_scale * q . row` over all R + P entries, and the value of a
row is its first R entries, so K and V are one read of the cache. The cache may also be
DeepSeek's FP8 one (fp8_ds_mla, `graphsafe.formats.fp8_ds_mla`: uint8 records of e4m3 latent
bytes, float32 tile scales and bf16 rope values), told apart by its dtype; the ops then
attend over the dequantized rows (`mla_decode`'s docstring).

Split-KV scratch (f32 partial outputs and LSEs) comes from the workspace manager; its
size is a function of shapes only (`mla_decode_workspace_specs`,
`sparse_mla_workspace_specs`, see `plan.py` for why never of sequence lengths).

Backends: `triton` (`prepare_*` bind the kernels to a call signature once), `aiter` on
ROCm gfx942 / gfx950 for the shapes it has kernels for (its `supports` predicates hand
the rest to Triton; aiter allocates its own split buffers, see `graphsafe.ops.mla.aiter`),
`reference`. Each record names its own worst-case workspace function.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from graphsafe.ops.mla import aiter, fake, reference, triton
from graphsafe.registry import register_op

__all__ = ["mla_decode", "sparse_mla", "mla_decode_workspace_specs", "sparse_mla_workspace_specs"]


@register_op(
    "mla_decode",
    fake=fake.fake_mla_decode,
    check=fake.check_mla_decode,
    debug_check="graphsafe.ops.mla.debug:debug_check_mla_decode",
    family="mla",
    backends=(reference.MLA_DECODE, triton.MLA_DECODE, aiter.MLA_DECODE),
)
def mla_decode(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, sm_scale: float, kv_lora_rank: int
) -> tuple[Tensor, Tensor]:
    """Dense absorbed-MLA decode: each request's query heads attend to all its cached tokens.

    For request b and head h, over the positions `0 <= j < seq_lens[b]` (bs = block_size)
    whose block `blk = block_table[b, j // bs]` is in `[0, num_blocks)`, with rows
    `k_j = kv_cache[blk, j % bs]`: `s_j = sm_scale * q[b, h] . k_j` (all R + P entries),
    `out[b, h] = sum_j softmax(s)_j * k_j[:R]`, `lse[b, h] = log(sum_j exp(s_j))`. A
    block id outside `[0, num_blocks)` (-1 is the padding value) is a padding block: its
    positions hold no key, exactly like positions past `seq_lens[b]`, and nothing of it
    is read (a negative id never wraps around). A request without any key gets
    `out = 0`, `lse = -inf`, whatever its q holds. Cache rows, block-table entries and q
    rows the formula does not name never influence any output (NaN there included).

    Non-finite inputs follow the kernels' arithmetic, the same on every backend:
    `m = max_j s_j`, `out = sum_j exp(s_j - m) k_j[:R] / l`, `lse = m + log l` with
    `l = sum_j exp(s_j - m)`. So a NaN or +inf score (a NaN in q[b, h] or in a row the
    request reads; an inf there whose product with q is +inf) makes `out[b, h]` (all R)
    and `lse[b, h]` NaN; a key whose score is -inf has weight 0, yet its value entries
    still enter as `0 * k_j[c]`: an infinite `k_j[c]` (c < R) makes `out[b, h, c]` NaN.

    fp8_ds_mla cache (`kv_cache` uint8; `graphsafe.formats.fp8_ds_mla`): `kv_cache
    [num_blocks, block_size, record]`, `record = R + 4 * R/128 + 2 * P` bytes per token
    (656 for R = 512, P = 64). A token's record, byte by byte: `[0, R)` its latent, one
    float8_e4m3fn byte per value; `[R, R + 4 * R/128)` R/128 float32 scales
    (little-endian), scale t for the latent values `[128 t, 128 t + 128)`;
    `[R + 4 * R/128, record)` its rope key, P bfloat16 values (little-endian). Its row
    `k_j` is `dequantize_records(record, R)`: latent value c is `float(byte c as e4m3fn)
    * scale[c // 128]` in float32, followed by the P rope values; the op computes the
    formula above over these float32 rows (scores over all R + P entries, values the
    first R). Only the records of the keys the formula names are read: no byte of any
    other record ever influences an output. Non-finite values come from the bytes: a NaN
    byte (0x7F, 0xFF) or a NaN scale gives NaN values, an infinite scale gives +-inf
    values (NaN for a 0 byte); a tile written (`quantize_records`) from a latent holding
    NaN or +-inf reads back all NaN, so every head of every request reading that key gets
    NaN out and lse. Rounding: the reference scores the float32 rows exactly; the
    kernels round them to bf16 (to nearest even) for their dot products, as a bf16
    cache would hold them, which moves a score by at most `sm_scale * 2^-9 * sum_c
    |q[c] k_j[c]|` (up to about 2e-2 for randn rows and queries; measured at most
    1.2e-2) and the lse by no more. Requires bf16 q, R a multiple of 128, P even, and
    4-byte aligned records (block and token strides and the storage offset multiples
    of 4 bytes; the kernels load the scales as float32).

    Args:
        q: `[B, H, R + P]` bf16/fp16, one decode token per request (R = kv_lora_rank; for
            DeepSeek 512 + 64, H = 16 at TP8 or 128 at TP1); bf16 with an fp8_ds_mla
            cache. Last dim contiguous.
        kv_cache: `[num_blocks, block_size, R + P]`, dtype of `q`; the latent cache of
            `concat_and_cache_mla`. Or an fp8_ds_mla cache: uint8 `[num_blocks,
            block_size, R + 4 * R/128 + 2 * P]` (above). Last dim contiguous; block and
            token strides are free (multiples of 4 for an fp8_ds_mla cache).
        block_table: `[B, max_blocks]` int32, last dim contiguous; entry `[b, i]` is the
            cache block of request b's tokens `i * block_size ... (i + 1) * block_size - 1`,
            or -1 (padding: those tokens hold no key; any other id outside
            `[0, num_blocks)` acts as -1). Entries past a request's length are never read
            (they may hold anything). The debug switch (`graphsafe.debug_checks`) checks
            that every entry below a request's length is in `[0, num_blocks)` or -1.
        seq_lens: `[B]` int32, cached tokens per request, the new token's key included
            (write it with `concat_and_cache_mla` first). Values above
            `max_blocks * block_size` are clamped to it; values <= 0 mean no key. The
            debug switch checks `0 <= seq_lens[b] <= max_blocks * block_size`.
        sm_scale: multiplies `q . k` before the softmax (e.g. `1 / sqrt(192)` times the
            YaRN mscale correction for DeepSeek).
        kv_lora_rank: R, the value width: `0 < R <= R + P`.

    Returns:
        out: `[B, H, R]` in q's dtype, contiguous.
        lse: `[B, H]` float32, natural-log log-sum-exp of the scaled scores.

    The key range is split across programs by a plan computed from shapes alone
    (B, H, `max_blocks * block_size`, the SM count), never from `seq_lens` values, so a
    captured CUDA graph stays correct when `seq_lens` and `block_table` change between
    replays. Workspace: `mla_decode_workspace_specs(B, H, R, max_blocks * block_size)`.
    """


@register_op(
    "sparse_mla",
    fake=fake.fake_sparse_mla,
    check=fake.check_sparse_mla,
    debug_check="graphsafe.ops.mla.debug:debug_check_sparse_mla",
    family="mla",
    backends=(reference.SPARSE_MLA, triton.SPARSE_MLA, aiter.SPARSE_MLA),
)
def sparse_mla(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Sparse absorbed-MLA attention: each query token attends to its own K selected cache slots.

    For token t and head h, over the entries `j` with a valid slot `s = indices[t, j]`
    (`0 <= s < num_blocks * block_size`), row `k_j = kv_cache[s // bs, s % bs]`:
    `out[t, h] = sum_j softmax(sm_scale * q[t, h] . k_j)_j * k_j[:R]` and
    `lse[t, h] = log(sum_j exp(sm_scale * q[t, h] . k_j))`. Entries `-1` (the padding
    value) and any other slot outside the cache are ignored: nothing is read for them (a
    negative slot never wraps around). A repeated slot counts once per occurrence. A
    token with no valid entry gets `out = 0`, `lse = -inf`, whatever its q holds. Cache
    rows no valid entry names and q rows of tokens without a valid entry never influence
    any output (NaN there included). Serves decode (T = B) and prefill (T = all new
    tokens) alike: the top-k of the DSA indexer after `req_local_to_global_slots`.

    Non-finite inputs follow the arithmetic of `mla_decode` (see there), the same on
    every backend: a NaN or +inf score of a valid entry makes `out[t, h]` and `lse[t, h]`
    NaN; an entry whose score is -inf has weight 0, yet an infinite value entry
    `k_j[c]` (c < R) of it makes `out[t, h, c]` NaN.

    FlashMLA's two options (each off by default):
    * `topk_length` (`[T]` int32): token t uses only its first `topk_length[t]` entries
      (values clamped to `[0, K]`); the entries right of it are never read, nor the
      cache rows only they name (so they may hold anything, stale slots included).
    * `attn_sink` (`[H]` float32): head h's sink logit joins the softmax's normaliser
      and carries no value: `out[t, h]` is scaled by `exp(lse) / (exp(lse) +
      exp(attn_sink[h]))`, computed as `sigmoid(lse - attn_sink[h])` in float32 before
      the output's rounding; `lse` is returned without the sink. A sink of +inf gives
      out 0, -inf no change, NaN NaN; a token without a valid entry stays out 0, lse -inf.

    An fp8_ds_mla cache (uint8) is read exactly as `mla_decode` reads it (see there: the
    record's bytes, `k_j = dequantize_records(record, R)`, only the records of valid
    entries read, non-finite values, the kernels' bf16 rounding of the rows and its
    bound on the scores and lse, the requirements).

    Args:
        q: `[T, H, R + P]` bf16/fp16 (DeepSeek-V3.2: R = 512, P = 64); bf16 with an
            fp8_ds_mla cache. Last dim contiguous.
        kv_cache: `[num_blocks, block_size, R + P]`, dtype of `q`, or an fp8_ds_mla cache
            (uint8 `[num_blocks, block_size, R + 4 * R/128 + 2 * P]`, see `mla_decode`).
            Last dim contiguous; block and token strides are free (multiples of 4 for an
            fp8_ds_mla cache).
        indices: `[T, K]` int32 cache slots (`block * block_size + offset`), `-1` = none,
            in any order; a slot outside `[0, num_blocks * block_size)` acts as -1. Last
            dim contiguous. The debug switch (`graphsafe.debug_checks`) checks that every
            entry read is in `[0, num_blocks * block_size)` or -1.
        sm_scale: multiplies `q . k` before the softmax.
        kv_lora_rank: R, the value width: `0 < R <= R + P`.
        attn_sink: `[H]` float32 or None (above).
        topk_length: `[T]` int32 or None (above); the debug switch checks `0 <=
            topk_length[t] <= K`.

    Returns:
        out: `[T, H, R]` in q's dtype, contiguous.
        lse: `[T, H]` float32, natural-log log-sum-exp of the scaled scores.

    The K entries are split across programs by a plan from shapes alone (T, H, K, the SM
    count). Workspace: `sparse_mla_workspace_specs(T, H, R, K)`.
    """


def mla_decode_workspace_specs(
    batch: int,
    num_heads: int,
    kv_lora_rank: int,
    max_kv_len: int,
    device: torch.device | str | None = None,
    backend: str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one `mla_decode` call, from shapes (no dry run).

    Args:
        batch: B (rows of `q` and `block_table`).
        num_heads: H.
        kv_lora_rank: R.
        max_kv_len: `block_table.shape[1] * kv_cache.shape[1]` (max_blocks * block_size);
            the value is the same for every replay of a captured graph.
        device: the op's device (default: the current CUDA device, else the CPU).
        backend: size for this backend only (default: the largest need among the
            backends that may serve `device`, as the registry's `workspace_specs`).
        head_dim, dtype: R + P and q's dtype; only the aiter backend reads them.

    Reserve with `current_workspace_manager(device).reserve(*specs)` before capture.
    """
    return mla_decode.spec.workspace_specs(batch, num_heads, kv_lora_rank, max_kv_len, device=device,
                                           backend=backend, head_dim=head_dim, dtype=dtype)


def sparse_mla_workspace_specs(
    num_tokens: int,
    num_heads: int,
    kv_lora_rank: int,
    topk: int,
    device: torch.device | str | None = None,
    backend: str | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one `sparse_mla` call, from shapes (no dry run).

    Args:
        num_tokens: T (rows of `q` and `indices`).
        num_heads: H.
        kv_lora_rank: R.
        topk: K (`indices.shape[1]`).
        device, backend, head_dim, dtype: as for `mla_decode_workspace_specs`.
    """
    return sparse_mla.spec.workspace_specs(num_tokens, num_heads, kv_lora_rank, topk, device=device,
                                           backend=backend, head_dim=head_dim, dtype=dtype)
