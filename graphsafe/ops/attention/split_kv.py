"""Split-KV planning for `paged_attention_decode`: how many KV splits, and their scratch.

The split count is a HOST decision made from shapes only -- batch size, KV heads, the
cache capacity of a request (`max_blocks_per_seq * block_size`) -- and the device's SM
count. Never from `seq_lens` values: a choice made while a CUDA graph is captured is
frozen into the graph, so one that depended on the lengths seen at capture would be
wrong for every later replay (vLLM #51119). Inside the kernel each request divides ITS
OWN length (read on the device) evenly among the splits, so short requests still spread
over every split and long ones are never truncated.
"""

from __future__ import annotations

import torch

from graphsafe.device_info import num_sms

# Tokens per tile of the decode kernel. The interpreter (CPU) uses small tiles so tests
# at tiny shapes still cover multi-tile loops and several splits.
DECODE_BLOCK_N = {"cuda": 64, "cpu": 16}
# Enough resident programs per SM to hide memory latency and even out the last wave.
PROGRAMS_PER_SM = 4
# A split must cover at least this many tiles of the worst-case length, or the combine
# pass costs more than the parallelism gains.
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_block_n(device: torch.device | str) -> int:
    return DECODE_BLOCK_N.get(torch.device(device).type, DECODE_BLOCK_N["cuda"])


def num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, sms: int, block_n: int) -> int:
    """KV splits per (request, KV head): enough programs for `PROGRAMS_PER_SM * sms`,
    each split covering at least `MIN_TILES_PER_SPLIT` tiles of `max_kv_len`."""
    programs = batch * num_kv_heads
    if programs <= 0 or max_kv_len <= 0:
        return 1
    useful = max(1, _cdiv(max_kv_len, block_n) // MIN_TILES_PER_SPLIT)
    wanted = _cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(1, min(wanted, useful, MAX_SPLITS))


def plan_decode_splits(
    batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int, device: torch.device | str
) -> int:
    """The split count the Triton decode kernel uses for these shapes on `device`."""
    return num_kv_splits(batch, num_kv_heads, max_blocks_per_seq * block_size, num_sms(device), decode_block_n(device))


def decode_workspace_specs(
    batch_size: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks_per_seq: int, block_size: int,
    device: torch.device | str | None = None, head_dim: int | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of one Triton decode call on `device` (the registry passes it; default: the
    current CUDA device, else the CPU): per-split outputs `[B, Hq, S, Dv]` f32 and
    log2-sum-exp `[B, Hq, S]` f32; nothing when one split suffices (the kernel then
    writes the output directly). `head_dim` (a parameter every backend's workspace
    function takes) does not change the Triton kernel's scratch."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    splits = plan_decode_splits(batch_size, num_kv_heads, max_blocks_per_seq, block_size, device)
    if splits == 1:
        return []
    return [((batch_size, num_q_heads, splits, head_dim_v), torch.float32),
            ((batch_size, num_q_heads, splits), torch.float32)]
