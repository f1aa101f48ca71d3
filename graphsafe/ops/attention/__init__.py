"""GQA attention: paged decode and paged prefill over the K/V cache written by
`reshape_and_cache`, and varlen (packed) prefill with an FP8 path. All three take the
attention variants of current models: a sliding (left) window, a logit softcap and
per-head attention sinks.

Public helpers besides the ops: `paged_attention_decode_workspace` /
`flash_attn_varlen_workspace` (worst-case scratch from shapes, to size the workspace
before a CUDA-graph capture), `fp8_prefill_supported(device)` (the cached fp8 probe) and
`plan_decode_splits` (the shape-only split-KV plan).

Backends, each a record of its module: `reference.py` (the executable spec), `triton.py`
(Triton and, on sm_90, Gluon kernels; what runs is decided once per call signature in
`plan.py`), `aiter.py` (ROCm, `flash_attn_varlen`). Kernels in `kernels/`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from graphsafe.ops.attention import aiter, reference, triton
from graphsafe.ops.attention import fake as fakes
from graphsafe.ops.attention.fp8 import fp8_prefill_supported
from graphsafe.ops.attention.plan import plan_decode_splits
from graphsafe.registry import get_op, register_op

__all__ = [
    "flash_attn_varlen",
    "flash_attn_varlen_workspace",
    "fp8_prefill_supported",
    "paged_attention_decode",
    "paged_attention_decode_workspace",
    "paged_attention_prefill",
    "plan_decode_splits",
]


def paged_attention_decode_workspace(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks_per_seq: int, block_size: int,
    device: torch.device | str | None = None, head_dim: int | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case scratch `[(shape, dtype), ...]` of one `paged_attention_decode` call on
    `device` (default: the current CUDA device, else the CPU), from shapes only: the
    largest over the backends that may serve it there. Feed it to
    `WorkspaceManager.reserve(*specs)` before capturing a graph."""
    return get_op("paged_attention_decode").workspace_specs(
        batch_size, num_q_heads, num_kv_heads, head_dim_v, max_blocks_per_seq, block_size,
        head_dim=head_dim, device=device,
    )


def flash_attn_varlen_workspace(
    total_q: int, total_k: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, fp8: bool = True,
    device: torch.device | str | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Worst-case scratch of one `flash_attn_varlen` call on `device` (default: the
    current CUDA device, else the CPU), over the backends that may serve it there: the
    fp8 path quantising bf16/fp16 inputs (fp8 inputs need less); nothing when `fp8` is
    False."""
    return get_op("flash_attn_varlen").workspace_specs(
        total_q, total_k, num_q_heads, num_kv_heads, head_dim, head_dim_v, fp8=fp8, device=device,
    )


@register_op(
    "paged_attention_decode",
    fake=fakes.fake_paged_attention_decode,
    check=fakes.check_paged_attention_decode,
    family="attention",
    debug_check="graphsafe.ops.attention.debug:debug_check_paged_attention_decode",
    backends=(reference.PAGED_ATTENTION_DECODE, triton.PAGED_ATTENTION_DECODE),
)
def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """GQA decode: each request's query attends to its first `seq_lens[b]` cached tokens.

    `out[b, h] = softmax_j(scale * q[b, h] . K[b, j, h // G]) @ V[b, j, h // G]` over
    the tokens j of request b, with `G = Hq / Hk` query heads per KV head and token j
    stored at block `block_table[b, j // block_size]`, offset `j % block_size` (the
    layout `reshape_and_cache` writes). The tokens of request b are the `j < seq_lens[b]`
    whose block id is in `[0, num_blocks)`: a block-table entry outside that range (-1
    is the documented padding; any other out-of-range value, negative or too large,
    acts exactly like -1 on every backend) is a padding block, which holds no key, its
    positions skipped like positions past `seq_lens[b]`; nothing outside the caches is
    ever read. A request without a token (`seq_lens[b] == 0`, or only padding blocks)
    gets 0. For fp8 caches: `softmax_j(scale * k_scale * q . K_raw) @ V_raw * v_scale`.

    Variants (each off by default; FlashAttention's and gpt-oss's conventions):
    * `window_left = w >= 0`, a sliding window: the query, at position `p = seq_lens[b] - 1`
      (the request's last token), sees only the tokens `j >= p - w` (FlashAttention's
      `window_size=(w, 0)`). A model whose window holds W tokens, the query's own
      included (Mistral's and Gemma's `sliding_window`), passes `w = W - 1`. Tokens
      before the window are never read, nor are the block-table entries of blocks that
      lie wholly before it (a sliding-window cache may have freed them: any value there
      is fine). -1: no window.
    * `softcap = c > 0`: every score becomes `c * tanh(s / c)` (Gemma-2), before the
      softmax (a -inf or +inf score then becomes -c or +c, a finite weight). 0: none.
    * `sinks` (`[Hq]` float32): head h's sink logit joins the softmax's normaliser and
      carries no value (gpt-oss): `out[b, h] = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m)
      + e^(sinks[h] - m))` with m the largest score; the same as FlashMLA's `out *
      exp(lse) / (exp(lse) + exp(sink))`. A sink of +inf gives 0, -inf no change, NaN
      NaN (for a request with a key: one without any stays 0).

    Non-finite values (IEEE arithmetic of the formula, the same places on every backend):
    elements the op does not read (tokens past `seq_lens[b]` or in padding blocks, cache
    blocks no request reads, block-table entries past a request's last block) never
    reach an output. A NaN or +-inf in `q[b, h]` or in a key of a token of request b
    makes the scores `s_j` of the heads reading it NaN or +-inf; a NaN or +inf score
    makes all of `out[b, h]` NaN; a -inf score gives token j weight 0. A NaN in
    element c of a value of a token of request b makes `out[b, h, c]` NaN for the G
    heads reading it; a +-inf there gives +-inf (NaN where its weight is 0, i.e. a -inf
    score, or where +inf and -inf meet).
    Split-KV: the KV range of each request is cut into a number of splits chosen on the
    host from shapes only (B, Hk, max_blocks_per_seq * block_size, SM count), never from
    `seq_lens` values, so the op captures into a CUDA graph and replays with any lengths;
    partial outputs/LSEs come from the workspace (`paged_attention_decode_workspace`).

    Args:
        q: `[B, Hq, D]` bfloat16/float16, last dim contiguous. One query token per request.
        k_cache: `[num_blocks, block_size, Hk, D]`, dtype of `q` or float8_e4m3fn (then
            `k_scale` is required); `Hk` divides `Hq`. Last dim contiguous; block, token
            and head strides are free.
        v_cache: `[num_blocks, block_size, Hk, Dv]`, same dtype as `k_cache`.
        block_table: `[B, max_blocks_per_seq]` int32, the cache blocks of each request in
            order. Only the first `ceil(seq_lens[b] / block_size)` entries of row b are
            read; the rest may hold anything (-1, stale ids). A read entry is a block id
            in `[0, num_blocks)` or -1 (a padding block, see above); other values act as
            -1 (no host sync checks them; the debug switch `graphsafe.debug_checks`
            raises for them).
        seq_lens: `[B]` int32, cached tokens per request (the new token included). Values
            are clamped to `[0, max_blocks_per_seq * block_size]`; a value outside that
            range is almost surely a bug: the debug switch raises for it.
        scale: multiplies `q . k` before the softmax (usually `D ** -0.5`).
        k_scale, v_scale: `[1]` float32, for float8_e4m3fn caches: the cached value times
            the scale is the real key/value (`reshape_and_cache` stores `x / scale`).
            Ignored for bf16/fp16 caches.
        window_left: int >= -1, the sliding window (above); a host int (part of the
            call's signature, as is whether `softcap` is 0 and `sinks` None).
        softcap: float >= 0, the logit softcap (above).
        sinks: `[Hq]` float32 or None, the attention sinks (above).

    Returns:
        out: `[B, Hq, Dv]`, dtype of `q`, contiguous.
    """


@register_op(
    "flash_attn_varlen",
    fake=fakes.fake_flash_attn_varlen,
    check=fakes.check_flash_attn_varlen,
    family="attention",
    debug_check="graphsafe.ops.attention.debug:debug_check_flash_attn_varlen",
    backends=(reference.FLASH_ATTN_VARLEN, triton.FLASH_ATTN_VARLEN, aiter.FLASH_ATTN_VARLEN),
)
def flash_attn_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    fp8: str = "off",
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Varlen (packed) prefill attention with GQA, causal or not, and an FP8 path.

    Sequence b owns query rows `[cq[b], cq[b+1])` and key/value rows `[ck[b], ck[b+1])`,
    where `cq` / `ck` are `cu_seqlens_q` / `cu_seqlens_k` made well-formed on the device
    (no host sync): the running maximum of the entries, clamped to `[0, Tq]` / `[0, Tk]`.
    So rows at or past a tensor's end do not exist (a sequence reaching past it is cut
    there), an entry smaller than an earlier one makes an empty sequence (a negative
    length is an empty sequence, and the next one starts where the last non-empty one
    ended), and nothing outside q, k, v or out is ever accessed, for any cu_seqlens
    values, on every backend. Query head h uses KV head `h // (Hq / Hk)`. Causal masking
    is aligned to the bottom-right corner (the FlashAttention-2 convention): query i of
    a sequence sees keys `j <= i + (len_k - len_q)`; with `len_q == len_k` that is the
    usual `j <= i`. A query row with no visible key (e.g. `len_k < len_q` under `causal`,
    or `len_k == 0`) gives 0; so do rows outside every sequence (before `cq[0]`, or at or
    past `cq[B]`: padding after the last sequence). Empty and length-1 sequences are fine.

    Variants, as `paged_attention_decode` defines them, with query i of a sequence at key
    position `p = i + (len_k - len_q)`: `window_left = w >= 0` hides the keys `j < p - w`
    (under `causal` too those `j > p`; without `causal` only the left bound applies, as
    FlashAttention's `window_size=(w, -1)`); `softcap` caps every score; `sinks[h]`
    joins the normaliser of every row of head h. Key rows no query row of their
    sequence sees (before every row's window) are never read (without fp8 quantisation,
    which reads all); a key row that some rows of a kernel tile see may reach the others
    as 0 * NaN (as under `causal`).

    Non-finite values (IEEE arithmetic of the formula, the same places on every backend):
    rows outside every sequence never reach an output (without fp8 quantisation, see
    below). A NaN or +-inf in a query row or in a key row makes the scores it enters NaN
    or +-inf; a NaN or +inf score makes the whole output row (all Dv) NaN; a -inf score
    gives that key weight 0. A NaN in element c of a value row makes element c of every
    output row that sees that key NaN (+-inf: +-inf, or NaN where its weight is 0 or
    where +inf and -inf meet); under `causal`, an output row that does not see the key
    but lies in the same kernel tile as rows that do may get NaN there too (0 * NaN).
    A row that sees no key is 0 whatever the values hold. A NaN descale makes every
    output row that sees a key NaN (descales are meant finite). With fp8 quantisation ("on", or
    "auto" where supported) each of q, k, v is scaled by its amax over the WHOLE tensor
    (rows outside every sequence included): a NaN or inf anywhere in it makes its scale
    NaN, so every output row that sees a key is NaN (rows that see none stay 0).

    FP8 path (`fp8`): "off" (the default: an op keeps the precision of its inputs unless
    the caller asks) computes from the inputs as given. "on" quantises bf16/fp16 q, k, v
    per tensor to float8_e4m3fn inside the op (`descale = max(amax, 1e-12) / 448`,
    round to nearest even; K and V^T scratch from the workspace, q quantised tile by tile
    in the kernel) and runs fp8 matrix products (P is scaled by 256 before its fp8
    cast); its accuracy against the bf16 result is measured in tests/test_attention*.py
    (relative L2 error <= 0.06 on unit-Gaussian inputs, about 3-7% per row). "auto",
    which the caller must ask for, is "on" where `fp8_prefill_supported(q.device)` (fp8
    matrix units AND a probe kernel that works) and "off" elsewhere, the CPU included.
    Inputs that are already float8_e4m3fn always take the fp8 path, dequantised by the
    optional descales.

    Args:
        q: `[Tq, Hq, D]` bfloat16/float16/float8_e4m3fn, last dim contiguous.
        k: `[Tk, Hk, D]`, dtype of `q`; `Hk` divides `Hq`. Last dim contiguous.
        v: `[Tk, Hk, Dv]`, dtype of `q` (MLA prefill: D = 192, Dv = 128). Last dim contiguous.
        cu_seqlens_q: `[B + 1]` int32, cumulative query lengths: expected `cu[0] = 0`,
            non-decreasing, `cu[B] <= Tq`. Other values are defined above (cut at Tq,
            decreasing entries give empty sequences); no host sync checks them, the
            debug switch `graphsafe.debug_checks` raises for them.
        cu_seqlens_k: `[B + 1]` int32, cumulative key lengths, the same for `Tk`.
        max_seqlen_q: host int >= every query length (the kernel's grid; the reference
            pads to it). Pass it from the CPU mirror of the lengths; never read on
            device. A precondition no host sync checks (the debug switch raises when a
            length exceeds it): the rows of a longer sequence past `max_seqlen_q` are
            not computed (their content is unspecified: 0 on one backend, stale memory
            on another).
        max_seqlen_k: host int >= every key length; the same kind of precondition (the
            debug switch checks it): with a longer key sequence, which keys past
            `max_seqlen_k` take part is unspecified.
        scale: multiplies `q . k` before the softmax.
        causal: bottom-right aligned causal mask (see above).
        q_descale, k_descale, v_descale: float32, only with float8_e4m3fn inputs: the real
            value is `x * descale`. Shape `[1]` (per tensor) or `[B, Hk]` (per sequence and
            KV head, FlashAttention-3's convention; q uses its KV head's entry). None means 1.
        fp8: "off" (default), "on" or "auto", see above.
        window_left, softcap, sinks: the variants (above; `paged_attention_decode`).

    Returns:
        out: `[Tq, Hq, Dv]`, contiguous; dtype of `q`, or bfloat16 for fp8 inputs.
    """


@register_op(
    "paged_attention_prefill",
    fake=fakes.fake_paged_attention_prefill,
    check=fakes.check_paged_attention_prefill,
    family="attention",
    debug_check="graphsafe.ops.attention.debug:debug_check_paged_attention_prefill",
    backends=(reference.PAGED_ATTENTION_PREFILL, triton.PAGED_ATTENTION_PREFILL),
)
def paged_attention_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    scale: float,
    causal: bool,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Varlen prefill over the paged K/V cache: chunked prefill and prefix caching.

    The new tokens' keys and values are written into the cache first
    (`reshape_and_cache`); then sequence b's query rows `[cq[b], cq[b+1])` attend to its
    first `seq_lens[b]` cached tokens, token j at block `block_table[b, j // block_size]`,
    offset `j % block_size` (FlashAttention's `block_table` + `seqused_k`; the layout
    `paged_attention_decode` reads). `cq` is `cu_seqlens_q` made well-formed as
    `flash_attn_varlen` does it (running maximum, clamped to `[0, Tq]`: rows at or past
    Tq do not exist, a decreasing entry makes an empty sequence), and `seq_lens[b]` is
    clamped to `[0, max_blocks_per_seq * block_size]`. A block id outside
    `[0, num_blocks)` (-1 documented) is a padding block whose tokens hold no key, as in
    `paged_attention_decode`. With `len_q` query rows and `len_k = seq_lens[b]` keys the
    queries are the LAST `len_q` tokens of the sequence: query i sits at key position
    `p = i + (len_k - len_q)`, `causal` hides the keys `j > p` (FlashAttention's
    bottom-right alignment) and `window_left = w >= 0` the keys `j < p - w`. A query row
    with no visible key gives 0; so do rows outside every sequence. A decode step is the
    case `len_q = 1`; a batch may mix decodes, chunks and whole prompts.

    Variants (`window_left`, `softcap`, `sinks`) and non-finite values as in
    `paged_attention_decode`, per query row: a NaN or +-inf in a query row or in a key it
    sees makes its scores NaN or +-inf; a NaN or +inf score makes the whole row NaN; a
    NaN in element c of a value makes element c of every row that sees it NaN, and may
    reach a row of the same kernel tile that does not see it (0 * NaN, as under `causal`
    in `flash_attn_varlen`). Never read: cache tokens at or past `seq_lens[b]` and of
    padding blocks, tokens no query row of their sequence sees (before the first row's
    window), block-table entries past a sequence's last block or of blocks wholly before
    its first row's window, and query rows outside every sequence. fp8 caches:
    `softmax(scale * k_scale * q . K_raw) @ V_raw * v_scale`.

    Args:
        q: `[Tq, Hq, D]` bfloat16/float16, last dim contiguous; the new tokens of all
            sequences, packed.
        k_cache: `[num_blocks, block_size, Hk, D]`, dtype of `q` or float8_e4m3fn (then
            `k_scale` is required); `Hk` divides `Hq`. Last dim contiguous; block,
            token and head strides are free.
        v_cache: `[num_blocks, block_size, Hk, Dv]`, same dtype as `k_cache`.
        block_table: `[B, max_blocks_per_seq]` int32, as for `paged_attention_decode`.
        seq_lens: `[B]` int32, cached tokens per sequence, the new ones included.
        cu_seqlens_q: `[B + 1]` int32, contiguous, cumulative query lengths (as for
            `flash_attn_varlen`).
        max_seqlen_q: host int >= every query length (the kernel's grid; never read on
            the device): a precondition as in `flash_attn_varlen` (the debug switch
            `graphsafe.debug_checks` checks it).
        scale: multiplies `q . k` before the softmax (usually `D ** -0.5`).
        causal: bottom-right aligned causal mask (above).
        k_scale, v_scale: `[1]` float32 for float8_e4m3fn caches (as for decode).
        window_left, softcap, sinks: the variants of `paged_attention_decode`.

    Returns:
        out: `[Tq, Hq, Dv]`, dtype of `q`, contiguous.
    """
