"""Batch metadata: CPU mirrors in, device tensors out, persistent buffers, no host sync.

- `BatchSpec`: one scheduled batch as the host knows it (CPU mirrors; device lengths
  where the host does not have them).
- `DecodeMetadataBuilder`: `DecodeInputs` in persistent, pad-initialised buffers; tail
  padding between the old and new extent; a metadata cache keyed on the length and block
  table contents; `build_for_capture(batch_size)`.
- `build_prefill`: prefill/extend metadata with every host int precomputed, split into a
  dense group (`flash_attn_varlen`) and a sparse group (indexer top-k + `sparse_mla`).
"""

from graphsafe.metadata.batch import BatchSpec
from graphsafe.metadata.decode import BuilderStats, DecodeMetadata, DecodeMetadataBuilder
from graphsafe.metadata.inputs import DecodeInputs
from graphsafe.metadata.prefill import DenseGroup, PrefillMetadata, SparseGroup, build_prefill

__all__ = [
    "BatchSpec",
    "BuilderStats",
    "DecodeInputs",
    "DecodeMetadata",
    "DecodeMetadataBuilder",
    "DenseGroup",
    "PrefillMetadata",
    "SparseGroup",
    "build_prefill",
]
