"""Batch metadata: CPU mirrors in, device tensors out, persistent buffers, no host sync."""

from graphsafe.metadata.inputs import DecodeInputs

__all__ = ["DecodeInputs"]
