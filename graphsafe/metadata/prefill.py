"""Prefill (and extend) metadata: every host int precomputed, device tensors from one copy.

A request whose whole context fits the indexer's top-k (`seq_len <= index_topk`, no cached
context) attends densely: every query's causal window is at most `index_topk` keys, so the
DSA selection keeps all of them and dense causal attention (`flash_attn_varlen`) computes
exactly what sparse attention would. The other requests take the sparse path (the
prefill indexer composite, then `sparse_mla` over the paged latent cache), which also
serves requests with cached context (extends).

Token order: the dense group's tokens come first, then the sparse group's, each in
request order, so each group is one contiguous slice of the token dimension (no index
gathers). `last_token_index[b]` finds request b's last token in that order.

Builds read the lengths on the host (`BatchSpec.seq_lens_host`): a prefill needs them for
its host ints, and this is the only builder that may copy them from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphsafe.metadata.batch import BatchSpec
from graphsafe.metadata.staging import upload


@dataclass
class DenseGroup:
    """Requests attended with `flash_attn_varlen` (causal; keys are the new tokens)."""

    start: int  # token slice [start, end)
    end: int
    num_reqs: int
    cu_seqlens: torch.Tensor  # int32 [num_reqs + 1]
    max_seqlen: int


@dataclass
class SparseGroup:
    """Requests attended through the indexer's top-k and `sparse_mla`."""

    start: int  # token slice [start, end)
    end: int
    num_reqs: int
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    req_id_per_token: torch.Tensor  # int32 [T]: row of block_table
    cu_seq_lens: torch.Tensor  # int32 [num_reqs + 1]: gathered-context rows of each request
    cu_seqlen_ks: torch.Tensor  # int32 [T]: first gathered key of each token's window
    cu_seqlen_ke: torch.Tensor  # int32 [T]: end of the window (causal, inclusive of itself)
    total_seq_lens: int  # host int: gathered rows (sum of the group's seq_lens)


@dataclass
class PrefillMetadata:
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    input_ids: torch.Tensor  # int64 [T], group order
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    last_token_index: torch.Tensor  # int64 [num_reqs], request order
    dense: DenseGroup | None
    sparse: SparseGroup | None
    # Host copies for callers that need them (no device reads): token order -> request.
    token_request_cpu: np.ndarray


def _cumsum0(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def build_prefill(
    batch: BatchSpec,
    input_ids: np.ndarray | torch.Tensor,
    *,
    index_topk: int,
    block_size: int,
    device: torch.device | str,
) -> PrefillMetadata:
    """Metadata of one prefill/extend batch.

    Args:
        batch: the batch; `query_start_loc_cpu` gives the new tokens of each request and
            the lengths (mirror, or one counted copy) the cache size after this step.
        input_ids: int `[num_tokens]` host array, the new tokens in request order.
        index_topk: the indexer's top-k (decides the dense and sparse groups).
        block_size: tokens per cache block.
        device: where the tensors go.
    """
    device = torch.device(device)
    n = batch.num_reqs
    qsl = batch.query_start_loc_np.astype(np.int64)
    qlens = np.diff(qsl)
    seq_lens = batch.seq_lens_host().astype(np.int64)
    ctx = seq_lens - qlens
    if np.any(ctx < 0):
        raise ValueError("prefill: a request's seq_len is below its new-token count")
    ids = np.asarray(input_ids.numpy() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    if ids.shape != (batch.num_tokens,):
        raise ValueError(f"prefill: input_ids must have {batch.num_tokens} tokens, got shape {ids.shape}")
    table = batch.block_table_cpu[:n].numpy()
    max_blocks = table.shape[1]
    if n and np.any((seq_lens + block_size - 1) // block_size > max_blocks):
        raise ValueError(f"prefill: a request is longer than its block table ({max_blocks} blocks of {block_size})")

    dense = (seq_lens <= index_topk) & (ctx == 0)
    order = np.concatenate([np.flatnonzero(dense), np.flatnonzero(~dense)])  # requests, group order
    # Token gather in group order, and the position of each token inside its request.
    tok_req = np.concatenate([np.full(qlens[r], r, dtype=np.int64) for r in order]) if n else np.zeros(0, np.int64)
    tok_src = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in order]) if n else np.zeros(0, np.int64)
    pos = ctx[tok_req] + (tok_src - qsl[tok_req])
    slots = table[tok_req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    group_qlens = qlens[order]
    last = np.empty(n, dtype=np.int64)
    last[order] = _cumsum0(group_qlens)[1:] - 1  # a zero-length request points at its predecessor

    nd = int(dense.sum())
    td = int(group_qlens[:nd].sum())
    arrays = [ids[tok_src], pos, slots, last]
    dense_cu = _cumsum0(group_qlens[:nd]).astype(np.int32)
    arrays.append(dense_cu)
    sp = order[nd:]
    sp_lens = seq_lens[sp]
    sp_cu = _cumsum0(sp_lens)
    local = np.repeat(np.arange(len(sp)), qlens[sp])  # row of the sparse block table
    sp_pos = pos[td:]
    ks = sp_cu[local]
    ke = ks + sp_pos + 1
    arrays += [
        np.ascontiguousarray(table[sp]),
        local.astype(np.int32),
        sp_cu.astype(np.int32),
        ks.astype(np.int32),
        ke.astype(np.int32),
    ]
    (d_ids, d_pos, d_slots, d_last, d_dense_cu, d_sp_table, d_local, d_sp_cu, d_ks, d_ke) = upload(arrays, device)
    t = batch.num_tokens
    dense_group = (
        DenseGroup(0, td, nd, d_dense_cu, int(group_qlens[:nd].max(initial=0))) if nd else None
    )
    sparse_group = (
        SparseGroup(td, t, len(sp), d_sp_table, d_local, d_sp_cu, d_ks, d_ke, int(sp_lens.sum())) if len(sp) else None
    )
    return PrefillMetadata(
        num_reqs=n,
        num_tokens=t,
        max_query_len=int(qlens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        input_ids=d_ids,
        positions=d_pos,
        slot_mapping=d_slots,
        last_token_index=d_last,
        dense=dense_group,
        sparse=sparse_group,
        token_request_cpu=tok_req,
    )
