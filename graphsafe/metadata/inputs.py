"""The tensors of one decode step: the contract between the metadata builders (which fill
them from CPU mirrors), the model's decode step (which reads them), and the CUDA-graph
runner (which keeps one static set per batch bucket and copies a step's inputs into it).

Every field is a device tensor whose first dimension is the batch; row i is request i.
Rows past the live batch (padding up to a graph bucket) hold each field's pad value, which
the ops treat as "nothing here": slot -1 writes nothing, seq_len 0 attends to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


def _pad(value: int):
    return field(metadata={"pad": value})


@dataclass
class DecodeInputs:
    input_ids: torch.Tensor = _pad(0)  # int64 [B]: the token fed at this step
    positions: torch.Tensor = _pad(0)  # int64 [B]: its position (= seq_lens - 1 for live rows)
    seq_lens: torch.Tensor = _pad(0)  # int32 [B]: cached tokens after this step's write, the new one included
    block_table: torch.Tensor = _pad(0)  # int32 [B, max_blocks]: the request's cache blocks
    slot_mapping: torch.Tensor = _pad(-1)  # int64 [B]: cache slot of the new token (-1: padding)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def items(self):
        """(name, tensor, pad value) of every field."""
        return [(f.name, getattr(self, f.name), f.metadata["pad"]) for f in fields(self)]

    def rows(self, n: int) -> DecodeInputs:
        """Views of the first n rows (a smaller bucket over the same storage)."""
        return DecodeInputs(**{name: t[:n] for name, t, _ in self.items()})

    def copy_into(self, static: DecodeInputs) -> None:
        """Copy these rows into the first rows of `static` and pad the rest (no host sync)."""
        n = self.batch_size
        for name, src, pad in self.items():
            dst = getattr(static, name)
            dst[:n].copy_(src, non_blocking=True)
            if dst.shape[0] > n:
                dst[n:].fill_(pad)

    @staticmethod
    def empty(batch: int, max_blocks: int, device: torch.device | str) -> DecodeInputs:
        """Zero-initialised (padding-valued) inputs of a batch size."""
        device = torch.device(device)
        return DecodeInputs(
            input_ids=torch.zeros(batch, dtype=torch.int64, device=device),
            positions=torch.zeros(batch, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(batch, dtype=torch.int32, device=device),
            block_table=torch.zeros(batch, max_blocks, dtype=torch.int32, device=device),
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        )
