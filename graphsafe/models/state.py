"""Host-side request bookkeeping: rows, sequence lengths and block tables as CPU mirrors,
and a block allocator. Nothing here touches a device tensor's values.

Request i is row i of the decode batch. Both caches of a layer (the latent MLA cache and
the indexer K cache) share one block table: they have the same block size and number of
blocks, so one slot mapping serves both writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from graphsafe.metadata.batch import BatchSpec

# Block-table versions, unique across states: the decode builder caches metadata by
# (batch, lengths, version), and a new state's first table must never look like the
# last one the builder saw of another state.
_versions = itertools.count(1)


class HostState:
    def __init__(self, max_batch: int, max_blocks: int, block_size: int, num_blocks: int, max_model_len: int,
                 block_ids: Sequence[int] | None = None):
        """`block_ids`: the cache blocks this state hands out (default all `num_blocks`):
        states given disjoint ids can live side by side (one prefilling while another
        decodes) over the same caches."""
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.num_reqs = 0
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32)  # tokens cached per row
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int32)
        self.blocks_held = np.zeros(max_batch, dtype=np.int64)
        ids = list(range(num_blocks) if block_ids is None else block_ids)
        if any(not 0 <= i < num_blocks for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block_ids: expected distinct ids in [0, {num_blocks}), got {ids}")
        self._free = ids[::-1]  # pop() hands out the first ids first
        self.block_table_version = next(_versions)
        # Tokens handed to `advance` at each step (device tensors, never read back here).
        self.outputs: list[torch.Tensor] = []

    # -- allocation --------------------------------------------------------------------
    def _ensure_blocks(self, row: int, length: int) -> None:
        need = -(-length // self.block_size)
        if need > self.max_blocks or length > self.max_model_len:
            raise ValueError(f"request {row} would hold {length} tokens, past max_model_len={self.max_model_len}")
        held = int(self.blocks_held[row])
        if need <= held:
            return
        if need - held > len(self._free):
            raise RuntimeError(f"out of cache blocks: request {row} needs {need - held} more, {len(self._free)} free")
        table = self.block_table.numpy()
        for j in range(held, need):
            table[row, j] = self._free.pop()
        self.blocks_held[row] = need
        self.block_table_version = next(_versions)

    def add_requests(self, lengths: list[int]) -> list[int]:
        """New rows with room for `lengths[i]` tokens each; their seq_lens stay 0 until the
        prefill that writes them commits (`commit_prefill`)."""
        if self.num_reqs + len(lengths) > self.max_batch:
            raise ValueError(f"{self.num_reqs} + {len(lengths)} requests exceed max_batch={self.max_batch}")
        rows = list(range(self.num_reqs, self.num_reqs + len(lengths)))
        for row, n in zip(rows, lengths):
            if n < 1:
                raise ValueError("prompts must hold at least one token")
            self._ensure_blocks(row, n)
        self.num_reqs += len(lengths)
        return rows

    def commit_prefill(self, rows: list[int], lengths: list[int]) -> None:
        for row, n in zip(rows, lengths):
            self.seq_lens[row] = n

    # -- batches ------------------------------------------------------------------------
    def prefill_batch(self, rows: list[int], lengths: list[int]) -> BatchSpec:
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        return BatchSpec(
            query_start_loc_cpu=torch.from_numpy(qsl),
            block_table_cpu=self.block_table[rows],
            seq_lens_cpu=torch.tensor(lengths, dtype=torch.int32),
        )

    def decode_batch(self) -> BatchSpec:
        """The next decode step of every request: one new token at position seq_len.
        Allocates the block the new token lands in (idempotent until `advance`)."""
        n = self.num_reqs
        after = self.seq_lens[:n] + 1
        crossing = np.flatnonzero(after.numpy() > self.blocks_held[:n] * self.block_size)
        for row in crossing:
            self._ensure_blocks(int(row), int(after[row]))
        return BatchSpec(
            query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
            block_table_cpu=self.block_table[:n],
            seq_lens_cpu=after,
            block_table_version=self.block_table_version,
        )

    def advance(self, next_tokens: torch.Tensor | None = None) -> None:
        """Commit one decode step: every request's token of this step is now cached."""
        n = self.num_reqs
        if next_tokens is not None:
            if tuple(next_tokens.shape) != (n,):
                raise ValueError(f"advance: next_tokens must have shape [{n}], got {tuple(next_tokens.shape)}")
            self.outputs.append(next_tokens)
        if n and bool(((self.seq_lens[:n] + 1).numpy() > self.blocks_held[:n] * self.block_size).any()):
            raise RuntimeError("advance before decode_inputs: the step's block was never allocated")
        self.seq_lens[:n] += 1
