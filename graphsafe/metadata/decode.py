"""Decode metadata: `DecodeInputs` built into persistent buffers, with no host sync.

The builder owns one `DecodeInputs` of `max_batch` rows, allocated once and initialised
to every field's pad value (zeros; -1 for `slot_mapping`, since slot 0 is a real cache
slot). A build of n requests writes rows `[0, n)` and pads only the rows between the new
and the previous extent (`[n, previous)` when the batch shrank; vLLM PR #42982): rows past
the previous extent already hold the pad value. Invariant after every build: rows `>= n`
of every field hold its pad value, so `buffers.rows(bucket)` is a valid padded input of
any bucket `>= n` (a CUDA graph captured on those rows can replay without a copy).

Decode metadata (positions, seq_lens, slot_mapping, block table) depends on the request
lengths and block tables only. With the CPU mirror of the lengths it is computed on the
host and copied once per field (staged in pinned memory: `staging.py`); without it
(lengths known on the device only) it is derived on the device, and nothing is read back
to the host either way. `input_ids` are copied every build (device to device when the
sampled tokens are already there).

Metadata cache: a build whose key equals the key of what the buffers hold skips the
metadata copies. The key is everything the metadata depends on: the batch size, the
length contents (not just the shapes), and the block-table contents (or a version number
the caller bumps on every change). Without the length mirror the key cannot be formed
without a sync, so the cache is off for that build (the gap reviewers found in PR #42982:
a key that omits an input serves stale metadata). `build_for_capture` and `invalidate`
forget the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphsafe.metadata.batch import BatchSpec
from graphsafe.metadata.inputs import DecodeInputs
from graphsafe.metadata.staging import stage

# The fields a cache hit may skip (input_ids change every step and are always copied).
METADATA_FIELDS = ("positions", "seq_lens", "slot_mapping", "block_table")


@dataclass
class DecodeMetadata:
    """One decode build: the inputs (views of the builder's first n rows, valid until the
    next build) and the host ints precomputed for it (PR #42509)."""

    inputs: DecodeInputs
    num_reqs: int
    # Longest request after this step; without the length mirror, the bound
    # `max_blocks * block_size` (the host never reads device lengths in decode).
    max_seq_len: int
    cache_hit: bool


@dataclass
class BuilderStats:
    builds: int = 0
    cache_hits: int = 0
    cache_disabled: int = 0  # builds without a complete key (no length mirror)
    host_path: int = 0
    device_path: int = 0


class DecodeMetadataBuilder:
    """Builds `DecodeInputs` for decode batches of at most `max_batch` requests."""

    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, device: torch.device | str, cache: bool = True
    ):
        if min(max_batch, max_blocks, block_size) < 1:
            got = (max_batch, max_blocks, block_size)
            raise ValueError(f"max_batch, max_blocks, block_size must be >= 1, got {got}")
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.cache_enabled = cache
        self.buffers = DecodeInputs.empty(max_batch, max_blocks, self.device)
        self._extent = 0  # rows [0, extent) may hold live values; the rest hold the pad
        self._key: tuple | None = None
        self.stats = BuilderStats()

    # -- public ------------------------------------------------------------------------
    @property
    def extent(self) -> int:
        return self._extent

    def invalidate(self) -> None:
        """Forget the cache key (call after writing into the buffers yourself)."""
        self._key = None

    def build(self, batch: BatchSpec, input_ids: torch.Tensor | None = None) -> DecodeMetadata:
        """Fill the buffers for a decode-only batch; return views of its n rows.

        `input_ids`: `[n]` int64 (any integer dtype), on the device or the host; None
        leaves the ids of rows `[0, n)` as they are (e.g. written in place by a sampler).
        """
        n = batch.num_reqs
        self._validate(batch, input_ids)
        self.stats.builds += 1
        key = self._cache_key(batch)
        hit = key is not None and key == self._key
        if hit:
            self.stats.cache_hits += 1
        elif batch.has_seq_lens_mirror:
            self._write_from_host(batch)
            self.stats.host_path += 1
        else:
            self._write_on_device(batch)
            self.stats.device_path += 1
        if key is None:
            self.stats.cache_disabled += 1
        if input_ids is not None:
            self._write_ids(input_ids)
        if n < self._extent:
            self._pad_rows(n, self._extent)
        self._extent = n
        self._key = key
        if batch.has_seq_lens_mirror:
            max_seq_len = int(batch.seq_lens_cpu.numpy().max(initial=0))  # type: ignore[union-attr]
        else:
            max_seq_len = self.max_blocks * self.block_size
        return DecodeMetadata(self.buffers.rows(n), n, max_seq_len, hit)

    def build_for_capture(self, batch_size: int) -> DecodeInputs:
        """Inputs for capturing (and warming up) a batch bucket: `batch_size` rows that all
        hold the pad value (no request: no cache write, nothing attended), as views of the
        persistent buffers. Later builds of n <= batch_size keep rows `[n, batch_size)`
        padded, so a graph captured on these views replays correctly without a copy."""
        if not 1 <= batch_size <= self.max_batch:
            raise ValueError(f"build_for_capture: batch_size must be in [1, {self.max_batch}], got {batch_size}")
        end = max(batch_size, self._extent)
        self._pad_rows(0, end)
        self._extent = 0
        self._key = None
        return self.buffers.rows(batch_size)

    # -- internals -----------------------------------------------------------------------
    def _validate(self, batch: BatchSpec, input_ids: torch.Tensor | None) -> None:
        n = batch.num_reqs
        if n > self.max_batch:
            raise ValueError(f"decode batch of {n} requests exceeds max_batch={self.max_batch}")
        if not batch.is_decode_only:
            raise ValueError("DecodeMetadataBuilder.build takes decode-only batches (one new token per request)")
        if batch.block_table_cpu.shape[1] != self.max_blocks:
            raise ValueError(
                f"block_table_cpu has {batch.block_table_cpu.shape[1]} columns, the builder {self.max_blocks}"
            )
        if input_ids is not None and tuple(input_ids.shape) != (n,):
            raise ValueError(f"input_ids must have shape [{n}], got {tuple(input_ids.shape)}")

    def _cache_key(self, batch: BatchSpec) -> tuple | None:
        if not self.cache_enabled or not batch.has_seq_lens_mirror:
            return None  # a key without the length contents could serve stale metadata
        n = batch.num_reqs
        if batch.block_table_version is not None:
            table = ("version", batch.block_table_version)
        else:
            table = ("bytes", batch.block_table_cpu[:n].numpy().tobytes())
        return (n, batch.seq_lens_cpu.numpy().tobytes(), table)  # type: ignore[union-attr]

    def _host_arrays(self, batch: BatchSpec) -> dict[str, np.ndarray]:
        n, bs = batch.num_reqs, self.block_size
        seq_lens = batch.seq_lens_cpu.numpy()  # type: ignore[union-attr]
        if n and seq_lens.min() < 1:
            raise ValueError("decode rows need seq_lens >= 1 (the new token is cached)")
        table = batch.block_table_cpu[:n].numpy()
        pos = seq_lens.astype(np.int64) - 1
        col = pos // bs
        if n and col.max() >= self.max_blocks:
            raise ValueError(
                f"a decode position {int(pos.max())} is past the block table ({self.max_blocks} blocks of {bs})"
            )
        slots = table[np.arange(n), col].astype(np.int64) * bs + pos % bs
        return {
            "positions": pos,
            "seq_lens": seq_lens.astype(np.int32, copy=False),
            "slot_mapping": slots,
            "block_table": np.ascontiguousarray(table),
        }

    def _write_from_host(self, batch: BatchSpec) -> None:
        arrays = self._host_arrays(batch)
        staged = stage([arrays[f] for f in METADATA_FIELDS], self.device)
        for name, src in zip(METADATA_FIELDS, staged):
            self._write_rows(name, src)

    def _write_on_device(self, batch: BatchSpec) -> None:
        n, bs = batch.num_reqs, self.block_size
        (table,) = stage([np.ascontiguousarray(batch.block_table_cpu[:n].numpy())], self.device)
        self._write_rows("block_table", table)
        seq_lens = batch.seq_lens
        assert seq_lens is not None
        self._write_rows("seq_lens", seq_lens)
        pos = seq_lens.long() - 1
        self._write_rows("positions", pos)
        col = (pos // bs).clamp(0, self.max_blocks - 1)
        blocks = self.buffers.block_table[:n].gather(1, col[:, None]).squeeze(1).long()
        self._write_rows("slot_mapping", blocks * bs + pos % bs)

    def _write_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.device.type == "cpu" and self.device.type != "cpu":
            (input_ids,) = stage([input_ids.to(torch.int64).numpy()], self.device)
        self._write_rows("input_ids", input_ids)

    def _write_rows(self, name: str, src: torch.Tensor) -> None:
        """Rows `[0, len(src))` of one field (the only way builds write live values)."""
        getattr(self.buffers, name)[: src.shape[0]].copy_(src, non_blocking=True)

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows `[start, end)` of every field back to its pad value."""
        if end <= start:
            return
        for _, t, pad in self.buffers.items():
            t[start:end].fill_(pad)
