"""Scratch sizes of the Triton top-k, from shapes only (no triton import: the registry
reads the worst case through `workspace_specs` without loading a backend)."""

from __future__ import annotations

import functools

import torch

# Per-row int32 state: [0] pass-1 ticket, [1] threshold key bits, [2] #(key > t),
# [3] #(key == t), [4] pass-2 ticket; padded to 32 bytes.
NSTATE = 8
# Largest candidate list selected in registers.
BLOCK_F_MAX = 4096


def pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


@functools.lru_cache(maxsize=256)
def plan_sizes(width: int, topk: int) -> tuple[int, int, int]:
    """(G strided columns, candidate capacity, register block of the final select)."""
    # With G columns, random rows leave about -G*ln(1 - topk/G) candidates: 1.15*topk for
    # G = 4*topk (1.39*topk for 2*topk), so they fit the register block (2*topk).
    # No more columns than the row has positions.
    g_cols = min(max(4 * pow2(topk), 64), max(pow2(width), 64), 16384)
    # 4*topk leaves room for rows with structure (periodic scores, near-ties).
    cap = max(1, min(4 * topk, width))
    block_f = min(BLOCK_F_MAX, max(16, 2 * pow2(topk)))
    return g_cols, cap, block_f


def specs(rows: int, g_cols: int, cap: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """state, column maxima, candidate keys, candidate positions, tie positions."""
    return [
        ((rows, NSTATE), torch.int32),
        ((rows, g_cols), torch.int32),
        ((rows, cap), torch.int32),
        ((rows, cap), torch.int32),
        ((rows, max(topk, 1)), torch.int32),
    ]


def workspace_specs(num_rows: int, width: int, topk: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of one call with `num_rows` rows of `width` logits (the worst case is the need)."""
    g_cols, cap, _ = plan_sizes(width, topk)
    return specs(num_rows, g_cols, cap, topk)
