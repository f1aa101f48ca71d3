"""DeepSeek-V4's attention and its cache ops: single-latent MQA (head_dim 512 = 448 NoPE + 64
RoPE, the key row is also the value) over a sliding-window cache and a compressed cache,
with per-head attention sinks.

Caches hold one 512-value row per token, either as DeepSeek-V4's FP8 records (uint8,
`graphsafe.formats.fp8_dsv4`: 448 e4m3 + 64 bf16 per token, 7 UE8M0 scales per token after
the block's data; FlashMLA's "MODEL1" layout, vLLM's fp8_ds_mla for DeepSeek-V4) or as bf16
rows `[num_blocks, block_size, 512]`; the ops tell them apart by dtype.

Split-KV scratch comes from the workspace manager, sized from shapes
(`dsv4_sparse_attn_workspace_specs`; `plan.py` says why never from lengths).
Backends: `triton` (kernels/, bound once per call signature), `reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from graphsafe.ops.dsv4 import fake, reference, triton
from graphsafe.registry import register_op

__all__ = ["dsv4_compress_kv", "dsv4_qnorm_rope_kv_insert", "dsv4_sparse_attn", "dsv4_sparse_attn_workspace_specs"]


@register_op(
    "dsv4_sparse_attn",
    fake=fake.fake_dsv4_sparse_attn,
    check=fake.check_dsv4_sparse_attn,
    debug_check="graphsafe.ops.dsv4.debug:debug_check_dsv4_sparse_attn",
    family="dsv4",
    backends=(reference.DSV4_SPARSE_ATTN, triton.DSV4_SPARSE_ATTN),
)
def dsv4_sparse_attn(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    extra_kv_cache: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V4 sparse attention over two caches: each query token attends to its own
    window entries in `kv_cache` and its own compressed entries in `extra_kv_cache`, in one
    softmax with the head's sink (FlashMLA's `flash_mla_with_kvcache(q, k_cache, indices=,
    topk_length=, attn_sink=, extra_k_cache=, extra_indices_in_kvcache=, extra_topk_length=)`
    for DeepSeek-V4, with T queries of one token each; decode (T = B) and prefill (T = the
    new tokens) alike).

    For token t and head h, the keys are the entries j of `indices[t]` with `j <
    topk_length[t]` (all K without lengths) whose slot `s = indices[t, j]` lies in `[0,
    num_blocks * block_size)` of `kv_cache`, and likewise the entries of `extra_indices[t]`
    in `extra_kv_cache`. With `k_j` the cached row of a key (slot s: block `s //
    block_size`, token `s % block_size`; its 512 values, dequantised for records):
    `score_j = sm_scale * q[t, h] . k_j`, `out[t, h] = sum_j softmax(score)_j k_j` (the
    whole row is the value), `lse[t, h] = log(sum_j exp(score_j))`. Entries -1 (the
    padding value) and any other slot outside its cache are no key and nothing is read for
    them (a negative slot never wraps around); a repeated slot counts once per occurrence.
    A token with no key gets out 0 and lse -inf, whatever its q holds. Cache rows (record
    bytes) no key names, entries right of a length, and the q rows of tokens without a key
    never influence an output (NaN there included); neither does the pad byte of a record
    nor a block's padding.

    `attn_sink` (`[H]` float32): head h's sink joins the softmax's normaliser without a
    value: `out[t, h]` is scaled by `exp(lse) / (exp(lse) + exp(attn_sink[h]))` =
    `sigmoid(lse - attn_sink[h])`, computed in float32 before the output's rounding; lse is
    returned without it. +inf gives out 0, -inf no change, NaN NaN; a token without a key
    stays out 0, lse -inf. (vLLM pads DeepSeek-V4's heads to 64 or 128 for FlashMLA with
    q rows of 0 and sinks of -inf; any H works here.)

    Non-finite inputs follow the MLA ops' softmax arithmetic (`graphsafe.sparse_mla`), the
    same on every backend: a NaN or +inf score of a key makes `out[t, h]` and `lse[t, h]`
    NaN; a key whose score is -inf has weight 0, yet an infinite value entry of it still
    enters as `0 * inf` (NaN in that column). A record tile written from a row holding NaN
    or inf reads back all NaN (its scale byte is 255), so every head of every token
    reading that key gets NaN.

    Records (uint8 caches, `graphsafe.formats.fp8_dsv4`): the row of a key is
    `dequantize_tokens` of its bytes, float32: NoPE value c is `e4m3(byte c) * 2^(scale[c //
    64] - 127)`, the 64 RoPE values the bf16 ones. The kernels round these rows to bf16 for
    their dot products, which leaves them unchanged for every scale byte in [10, 246] (all
    a writer produces for finite bf16 rows, see the format); the reference computes in
    float32 over the same rows, so backends differ by the dots' summation order and the
    softmax probabilities' bf16 rounding (as every tensor-core kernel rounds them).

    Args:
        q: `[T, H, D]` bf16, D = 512 with records (any D >= 1 with bf16 caches). Last dim
            contiguous.
        kv_cache: the window cache: uint8 `[num_blocks, block_size, 584]` fp8_dsv4 records
            (the last two dims contiguous: each block's `block_size * 584` bytes in one
            piece; the block stride free, e.g. vLLM's padding to a multiple of 576), or bf16
            `[num_blocks, block_size, D]` rows (last dim contiguous, other strides free).
        indices: `[T, K]` int32 slots of `kv_cache` (`block * block_size + offset`), -1 =
            none, in any order; a slot outside `[0, num_blocks * block_size)` acts as -1.
            Last dim contiguous. The debug switch (`graphsafe.debug_checks`) checks that
            every entry read is in range or -1.
        sm_scale: multiplies `q . k` before the softmax (DeepSeek-V4: 512^-0.5).
        attn_sink: `[H]` float32 or None (above).
        topk_length: `[T]` int32 or None: token t uses its first `topk_length[t]` window
            entries (clamped to [0, K]); the entries right of it are never read. The debug
            switch checks `0 <= topk_length[t] <= K`.
        extra_kv_cache: the compressed cache, of the same kind as `kv_cache` (records or
            bf16 rows; its own block size), or None.
        extra_indices: `[T, K2]` int32 slots of `extra_kv_cache` (as `indices`); given
            exactly when `extra_kv_cache` is.
        extra_topk_length: `[T]` int32 or None: as `topk_length`, for `extra_indices`;
            only with `extra_kv_cache`.

    Returns:
        out: `[T, H, D]` bf16, contiguous.
        lse: `[T, H]` float32, natural-log log-sum-exp of the scaled scores (no sink).

    The K + K2 key positions are split across programs by a plan from shapes alone (T, H,
    K + K2, the SM count), never from lengths or indices, so a captured CUDA graph stays
    right when they change between replays. Workspace:
    `dsv4_sparse_attn_workspace_specs(T, H, D, K, K2)`.
    """


@register_op(
    "dsv4_qnorm_rope_kv_insert",
    fake=fake.fake_dsv4_qnorm_rope_kv_insert,
    check=fake.check_dsv4_qnorm_rope_kv_insert,
    mutates_args=("q_out", "kv_cache"),
    debug_check="graphsafe.ops.dsv4.debug:debug_check_dsv4_qnorm_rope_kv_insert",
    family="dsv4",
    backends=(reference.DSV4_QNORM_ROPE_KV_INSERT, triton.DSV4_QNORM_ROPE_KV_INSERT),
)
def dsv4_qnorm_rope_kv_insert(
    q: Tensor,
    kv: Tensor,
    q_out: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    eps: float,
) -> None:
    """A step's queries and window-cache write, fused (vLLM's
    `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`): per-head RMSNorm and RoPE of q into
    `q_out` (its extra heads zero), RoPE of kv and its insert into the window cache.

    For token t with position `p = positions[t]` in `[0, max_pos)`, with `cos = cos_sin_cache[p,
    :32]`, `sin = cos_sin_cache[p, 32:]` and RoPE the GPT-J rotation of the pairs `(x[448 +
    2i], x[449 + 2i])` into `(e cos_i - o sin_i, e sin_i + o cos_i)`, in float32:

    * head h < H: `x = q[t, h]`, `y = x / sqrt(sum(x^2) / 512 + eps)` (RMSNorm without
      weight; IEEE sqrt and division), RoPE on y's last 64 values, `q_out[t, h]` = y rounded
      to bf16 (nearest even);
    * head H <= h < Hp: `q_out[t, h] = 0` (the padded heads FlashMLA reads, see
      `dsv4_sparse_attn`);
    * if t < N (`slot_mapping`'s length: tokens past it, e.g. data-parallel padding, are not
      inserted) and `s = slot_mapping[t]` is in `[0, num_blocks * block_size)`: the row
      `kv[t]` with RoPE on its last 64 values, rounded to bf16, is written at slot s: as an
      fp8_dsv4 record (`graphsafe.formats.fp8_dsv4.quantize_tokens`, byte for byte: UE8M0
      scales, e4m3 NoPE values, the RoPE values' bf16 bits, the pad byte 0) or as a bf16 row.

    A token whose position lies outside `[0, max_pos)` (-1 is the padding value) is a padding
    token: all its Hp heads of `q_out` are 0 and it is not inserted; nothing of it (q, kv, a
    table row) is read. A slot of -1, or outside the cache, skips the insert only. Only the
    slots written change in `kv_cache` (all bytes of their records but no other: neither
    other tokens' bytes nor a block's padding); `q_out` is written whole and never read.
    Slots >= 0 must be distinct (which token a repeated slot ends up holding is
    unspecified; the debug switch checks it).

    Non-finite values follow the arithmetic: a NaN or inf in `q[t, h]` makes the sum of
    squares NaN or inf, so that head's row is NaN (inf / inf, 0 * inf) or 0 where finite
    values meet an infinite norm; in `kv[t]` a NoPE value NaN or +-inf makes its 64-value tile
    a NaN tile (scale byte 255, value bytes 0x7F), a RoPE value NaN or inf gives NaN or inf
    where the rotation does (a bf16 NaN whose bits are not specified). Rounding: the
    kernels may sum squares in another order and contract the rotation's multiply-adds, so
    a `q_out` value or a stored RoPE value may differ from the reference by one bf16 ulp;
    the NoPE bytes and scales of a record are exact (RoPE does not touch the NoPE values).

    Args:
        q: `[T, H, 512]` bf16 queries (448 NoPE + 64 RoPE values a head). Last dim contiguous.
        kv: `[T, 512]` bf16 latent rows (after the kv RMSNorm). Last dim contiguous.
        q_out: `[T, Hp, 512]` bf16, Hp >= H (vLLM pads to 64 or 128 heads for FlashMLA);
            written whole, never read; must not overlap `q`. Last dim contiguous.
        kv_cache: the window cache: uint8 `[num_blocks, block_size, 584]` fp8_dsv4 records
            (see `dsv4_sparse_attn`) or bf16 `[num_blocks, block_size, 512]` rows.
        slot_mapping: `[N]` int64 or int32, N <= T: the cache slot of each of the first N
            tokens, -1 = not inserted (any slot outside the cache acts as -1; the debug
            switch refuses it).
        positions: `[T]` int64 or int32 positions, rows of `cos_sin_cache`; -1 (or any value
            outside `[0, max_pos)`) marks a padding token (the debug switch refuses values
            outside other than -1).
        cos_sin_cache: `[max_pos, 64]` float32: cos of the 32 pairs, then their sin.
        eps: the RMSNorm epsilon (DeepSeek-V4: 1e-6).

    Returns None; mutates `q_out` and `kv_cache`.
    """


@register_op(
    "dsv4_compress_kv",
    fake=fake.fake_dsv4_compress_kv,
    check=fake.check_dsv4_compress_kv,
    mutates_args=("state_cache", "kv_cache"),
    debug_check="graphsafe.ops.dsv4.debug:debug_check_dsv4_compress_kv",
    family="dsv4",
    backends=(reference.DSV4_COMPRESS_KV, triton.DSV4_COMPRESS_KV),
)
def dsv4_compress_kv(
    kv: Tensor,
    score: Tensor,
    ape: Tensor,
    positions: Tensor,
    state_cache: Tensor,
    state_slot_mapping: Tensor,
    state_block_table: Tensor,
    token_to_req: Tensor,
    norm_weight: Tensor,
    eps: float,
    cos_sin_cache: Tensor,
    kv_cache: Tensor,
    kv_slot_mapping: Tensor,
    compress_ratio: int,
) -> None:
    """DeepSeek-V4's KV compressor for one step's tokens: save each token's partial state,
    then, for each token that completes a window of `compress_ratio` positions, pool the
    window's states into one compressed entry, RMS-normalise it, rotate it and write it
    into the compressed cache (vLLM's `_save_partial_states_kernel` and
    `_fused_kv_compress_norm_rope_insert_sparse_attn`; transformers' `DeepseekV4CSACompressor`
    / `DeepseekV4HCACompressor`).

    With D = `norm_weight`'s size (512 for the attention's cache, 128 for the indexer's
    keys) and W = `kv`'s width: W = D pools non-overlapping windows (ratio 128, "HCA");
    W = 2 D overlapping ones (ratio 4, "CSA"): an entry pools its window's states through
    their last D channels and the previous window's through their first D.

    1. Save: token t with position `p = positions[t]` in `[0, max_pos)` and state slot `s =
       state_slot_mapping[t]` in the state cache writes the float32 row `[kv[t] | score[t] +
       ape[p % compress_ratio]]` (2 W values) at s (slot s: block `s // state_block_size`,
       row `s % state_block_size`). Other tokens (-1 slots, positions outside the table:
       padding) save nothing and do nothing below.
    2. Compress (after every save of the call): a saving token t with `(p + 1) %
       compress_ratio == 0`, a request `r = token_to_req[t]` in `[0, R)` and a slot `e =
       kv_slot_mapping[t]` in the compressed cache pools the S states of positions `q = p -
       S + 1 ... p` (S = ratio, or 2 ratio with W = 2 D), state i at slot
       `state_block_table[r, q // sbs] * sbs + q % sbs`, through channels `[0, D)` (or, with
       W = 2 D, `[D, 2D)` for the last `ratio` states): channel c of the entry is
       `sum_i softmax_i(score_i[c]) kv_i[c]` in float32 (max-shifted: `exp(s - max) / sum`).
       A state with q < 0, a block-table column past its width, or a block id outside the
       state cache is missing (no weight); a window without any state pools to 0. Then
       `y = x / sqrt(sum(x^2) / D + eps) * norm_weight` (IEEE sqrt and division), RoPE (GPT-J
       pairs, as `dsv4_qnorm_rope_kv_insert`) of y's last 64 values at position `(p //
       ratio) * ratio` (the window's first), and the row, rounded to bf16, is written at e:
       an fp8_dsv4 record (`graphsafe.formats.fp8_dsv4.quantize_tokens`) or a bf16 row.
       Tokens that complete no window read neither `kv_slot_mapping` nor `token_to_req`.

    The indexer's keys (D = 128) go to the indexer's fp8 cache in two steps: this op writes
    bf16 rows (a `[T, 1, 128]` staging cache, slot = token), then
    `graphsafe.indexer_k_quant_and_cache(rows, cache, slots, 128, "ue8m0")`, whose layout
    (DeepGEMM's: 128 e4m3 bytes then one float32 scale per token, a block's data then its
    scales) and power-of-two scales are DeepSeek-V4's indexer cache (vLLM
    `_fused_kv_compress_norm_rope_insert_indexer_attn`).

    Only the slots written change (state rows of saving tokens, whole compressed entries);
    state slots >= 0 must be distinct, and so must compressed slots (the debug switch checks
    both). Non-finite values follow the arithmetic: a NaN score or kv value reaching a
    channel's pool makes that channel NaN, and the RMS then makes the whole entry NaN (a
    record of NaN tiles); an inf score gives that channel NaN (inf - inf). Rounding: the
    kernels' exp and summation order differ from the reference's, so an entry may differ
    by a float32 ulp before its bf16 rounding, and a record's value bytes by one e4m3 step
    (its scale by one binade where the tile's max sits at a power of two).

    Args:
        kv: `[T, W]` bf16, the compressor's kv projection of each token (W = D or 2 D).
        score: `[T, W]` bf16, its gate logits.
        ape: `[compress_ratio, W]` float32, the position bias (by position in the window).
        positions: `[T]` int64 / int32 positions, rows of `cos_sin_cache`; outside
            `[0, max_pos)` (-1: padding) a token does nothing.
        state_cache: `[num_state_blocks, state_block_size, 2 W]` float32 partial states
            (read and written). Last dim contiguous.
        state_slot_mapping: `[T]` int64 / int32, each token's state slot; -1 (or any slot
            outside the state cache) = padding token.
        state_block_table: `[R, max_state_blocks]` int32, each request's state blocks by
            position (`position // state_block_size`); ids outside the state cache are missing
            states. Only the entries of the windows pooled are read.
        token_to_req: `[T]` int32, the request (row of `state_block_table`) of each token.
        norm_weight: `[D]` float32, the RMSNorm weight; D a multiple of 64.
        eps: the RMSNorm epsilon.
        cos_sin_cache: `[max_pos, 64]` float32 (cos | sin of the 32 pairs; DeepSeek-V4's
            compressed layers use their "compress" RoPE).
        kv_cache: the compressed cache: fp8_dsv4 records (D = 512) or bf16 `[num_blocks,
            block_size, D]` rows (see `dsv4_sparse_attn`).
        kv_slot_mapping: `[T]` int64 / int32, the compressed-cache slot of the entry a token
            completes (read only for tokens that complete one; -1 = none).
        compress_ratio: positions per window (4 or 128 for DeepSeek-V4; any >= 1).

    Returns None; mutates `state_cache` and `kv_cache`.
    """


def dsv4_sparse_attn_workspace_specs(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    topk: int,
    extra_topk: int = 0,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case workspace of one `dsv4_sparse_attn` call, from shapes (no dry run).

    Args:
        num_tokens: T (rows of `q`).
        num_heads: H.
        head_dim: D (512).
        topk: K (`indices.shape[1]`).
        extra_topk: K2 (`extra_indices.shape[1]`; 0 without the compressed cache).
        device: the op's device (default: the current CUDA device, else the CPU).
        backend: size for this backend only (default: the largest need among the backends
            that may serve `device`).

    Reserve with `current_workspace_manager(device).reserve(*specs)` before capture.
    """
    return dsv4_sparse_attn.spec.workspace_specs(num_tokens, num_heads, head_dim, topk, extra_topk, device=device,
                                                 backend=backend)
