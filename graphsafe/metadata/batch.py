"""What a metadata builder is given: one scheduled batch as the host knows it.

The host (the scheduler's bookkeeping) keeps CPU mirrors of the per-request state:
`query_start_loc_cpu` (the new tokens of each request), `block_table_cpu` and, usually,
`seq_lens_cpu`. Under asynchronous scheduling the sequence lengths may be known on the
device only (vLLM issue #29134): then `seq_lens_cpu` is None and `seq_lens` is a device
tensor. A decode build never needs the lengths on the host; a batch with a prefill or an
extend does (its host ints depend on them), and only then `seq_lens_host()` copies them
(vLLM PR #41942). The copy is counted, so tests can assert it never happens for decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def _cpu_i32(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.int32 or t.dim() != ndim:
        got = f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{t.dtype} {t.dim()}-D on {t.device}"
        raise ValueError(f"BatchSpec.{name} must be an int32 {ndim}-D CPU tensor (a CPU mirror), got {got}")


@dataclass
class BatchSpec:
    """One scheduled batch of `num_reqs` requests.

    Request b owns the new tokens `query_start_loc_cpu[b] : query_start_loc_cpu[b + 1]`;
    after this step it has `seq_lens[b]` tokens in the cache (its context plus the new
    tokens). Row b of the block tables lists its cache blocks in order.

    Attributes:
        query_start_loc_cpu: int32 `[num_reqs + 1]` CPU, cumulative new-token counts from 0.
        block_table_cpu: int32 `[num_reqs, max_blocks]` CPU (the requests' rows, in order).
        seq_lens_cpu: int32 `[num_reqs]` CPU mirror of the lengths, or None when only
            the device knows them.
        seq_lens: int32 `[num_reqs]` on the device, required when `seq_lens_cpu` is None.
        block_table_version: optional int that changes whenever `block_table_cpu`
            changes (an allocator counter): lets the metadata cache key on it instead of
            comparing the table's bytes.
    """

    query_start_loc_cpu: torch.Tensor
    block_table_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table_version: int | None = None
    # Device-to-host copies this batch made (0 unless a prefill/extend build needed the
    # lengths and only the device had them).
    host_copies: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _cpu_i32("query_start_loc_cpu", self.query_start_loc_cpu, 1)
        _cpu_i32("block_table_cpu", self.block_table_cpu, 2)
        n = self.num_reqs
        if self.block_table_cpu.shape[0] < n:
            raise ValueError(f"BatchSpec.block_table_cpu has {self.block_table_cpu.shape[0]} rows for {n} requests")
        if self.seq_lens_cpu is not None:
            _cpu_i32("seq_lens_cpu", self.seq_lens_cpu, 1)
            if self.seq_lens_cpu.shape[0] != n:
                raise ValueError(f"BatchSpec.seq_lens_cpu has {self.seq_lens_cpu.shape[0]} entries for {n} requests")
        elif self.seq_lens is None:
            raise ValueError("BatchSpec needs seq_lens_cpu (the CPU mirror) or seq_lens (on the device)")
        elif self.seq_lens.shape != (n,) or self.seq_lens.dtype != torch.int32:
            got = f"{self.seq_lens.dtype} {tuple(self.seq_lens.shape)}"
            raise ValueError(f"BatchSpec.seq_lens must be int32 [{n}], got {got}")
        qsl = self.query_start_loc_np
        if qsl[0] != 0 or np.any(np.diff(qsl) < 0):
            raise ValueError("BatchSpec.query_start_loc_cpu must start at 0 and be non-decreasing")

    # -- host views (no device access) --------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return self.query_start_loc_cpu.shape[0] - 1

    @property
    def query_start_loc_np(self) -> np.ndarray:
        return self.query_start_loc_cpu.numpy()

    @property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_np[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens_np.max(initial=0))

    @property
    def is_decode_only(self) -> bool:
        """Every request feeds exactly one token (no prefill, no extend)."""
        return bool(np.all(self.query_lens_np == 1))

    @property
    def has_seq_lens_mirror(self) -> bool:
        return self.seq_lens_cpu is not None

    def seq_lens_host(self) -> np.ndarray:
        """The lengths on the host: the mirror, or one counted device-to-host copy (a host
        sync on a GPU). Only prefill/extend builds call this."""
        if self.seq_lens_cpu is None:
            assert self.seq_lens is not None
            self.seq_lens_cpu = self.seq_lens.to("cpu")  # the copy PR #41942 confines to prefill
            self.host_copies += 1
        return self.seq_lens_cpu.numpy()
