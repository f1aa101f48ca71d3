"""`no_sync()`: fail on any host-device synchronisation inside the block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_sync() -> Iterator[None]:
    """CUDA sync-debug mode "error" inside the block (a sync raises); a no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
