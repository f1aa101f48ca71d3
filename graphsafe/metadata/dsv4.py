"""DeepSeek-V4 attention metadata, on the device, without a host sync.

Every function is a few tensor ops over the tokens' positions, their requests and the
requests' block tables: no host int comes from data, no shape depends on values, so they
run inside a compiled (fullgraph) decode step and a captured CUDA graph, and the same
calls serve prefill. A position < 0 marks a padding token: it gets no slot and no key.
Tables are `[R, max_blocks]` int32 (request r's blocks in order); a block id outside the
cache is the ops' business (they treat it as padding), these functions pass it through,
and a column past the table's width gives -1 (no slot).

* `window_indices`: each token's sliding-window slots in the SWA cache and their count
  (`dsv4_sparse_attn`'s `indices` / `topk_length`): positions `max(0, p - W + 1) ... p`.
* `position_slots`: the slot of each token's own position (SWA cache and compressor
  state writes).
* `compressed_slots`: the compressed-cache slot of the entry a token completes (positions
  `p` with `(p + 1) % ratio == 0`: entry `(p + 1) // ratio - 1`), else -1
  (`dsv4_compress_kv`'s `kv_slot_mapping`).
* `visible_entries`: compressed entries a token may see, `(p + 1) // ratio` (the indexer's
  context lengths).
* `all_entry_indices`: every visible entry's slot, for layers that attend to all their
  compressed entries (DeepSeek-V4's ratio-128 layers; `extra_indices` / `extra_topk_length`).
* `topk_slots`: the indexer's request-local top-k (compressed positions) as cache slots,
  with their count (`graphsafe.req_local_to_global_slots`).

`Dsv4Metadata` keeps the results in persistent buffers (rows of at most `max_tokens`
tokens, allocated once and pad-initialised; a build writes rows `[0, T)` and re-pads the
rows the previous build used past T), for callers that need fixed addresses outside a
compiled step.
"""

from __future__ import annotations

import torch



def _table_at(table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor, block_size: int,
              valid: torch.Tensor) -> torch.Tensor:
    """Slots (int64) of `positions` (any shape, aligned with `req`'s leading dims) through
    request `req`'s row of `table`; -1 where not `valid` or past the table's width."""
    col = positions.div(block_size, rounding_mode="floor")
    ok = valid & (col < table.shape[1]) & (col >= 0)
    rows = req.long().clamp(0, max(table.shape[0] - 1, 0))
    while rows.dim() < col.dim():
        rows = rows[..., None]
    ids = table[rows.expand_as(col), torch.where(ok, col, 0)].long()
    return torch.where(ok, ids * block_size + positions % block_size, -1)


def position_slots(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """int64 `[T]`: the slot of each token's own position (-1 for padding tokens)."""
    pos = positions.long()
    return _table_at(table, token_to_req, pos, block_size, pos >= 0)


def window_indices(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 `[T, window]` slots of positions `start ... p` (start = max(0, p - window + 1)),
    oldest first, -1 after them; int32 `[T]` their count `min(p + 1, window)`, 0 for padding)."""
    pos = positions.long()
    length = torch.where(pos >= 0, torch.clamp(pos + 1, max=window), 0)
    j = torch.arange(window, device=pos.device)
    q = (pos - length + 1)[:, None] + j[None, :]
    slots = _table_at(table, token_to_req, q, block_size, j[None, :] < length[:, None])
    return slots.to(torch.int32), length.to(torch.int32)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """int32 `[T]`: compressed entries a token may see, `(p + 1) // ratio` (0 for padding)."""
    pos = positions.long()
    return torch.where(pos >= 0, (pos + 1).div(ratio, rounding_mode="floor"), 0).to(torch.int32)


def compressed_slots(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                     ratio: int) -> torch.Tensor:
    """int64 `[T]`: the compressed-cache slot of entry `(p + 1) // ratio - 1` for a token that
    completes it (`(p + 1) % ratio == 0`), else -1."""
    pos = positions.long()
    completes = (pos >= 0) & ((pos + 1) % ratio == 0)
    entry = (pos + 1).div(ratio, rounding_mode="floor") - 1
    return _table_at(table, token_to_req, entry, block_size, completes)


def all_entry_indices(positions: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
                      ratio: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 `[T, capacity]` slots of compressed entries `0 ... n - 1`, -1 after; int32 `[T]`
    n = `min(visible_entries, capacity)`)."""
    n = torch.clamp(visible_entries(positions, ratio).long(), max=capacity)
    j = torch.arange(capacity, device=positions.device)
    slots = _table_at(table, token_to_req, j[None, :].expand(positions.shape[0], capacity), block_size,
                      j[None, :] < n[:, None])
    return slots.to(torch.int32), n.to(torch.int32)


def topk_slots(topk: torch.Tensor, token_to_req: torch.Tensor, table: torch.Tensor, block_size: int,
               visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 `[T, K]` cache slots of the request-local top-k positions `topk` (-1 stays -1),
    via `graphsafe.req_local_to_global_slots`; int32 `[T]` `min(visible, K)`: the indexer's
    top-k holds its valid entries first, -1 after)."""
    import graphsafe

    slots = graphsafe.req_local_to_global_slots(token_to_req.to(torch.int32), table, topk, block_size)
    return slots, torch.clamp(visible, max=topk.shape[1]).to(torch.int32)


class Dsv4Metadata:
    """Persistent buffers for the window and compressed-entry indices of up to `max_tokens`
    tokens (module docstring). `build_*` write rows `[0, T)`, re-pad the rows a previous
    build used past T (slots -1, counts 0) and return views of the first T rows; each
    view is valid until the next build of that kind."""

    def __init__(self, max_tokens: int, window: int, capacity: int, device: torch.device | str):
        device = torch.device(device)
        self.max_tokens = max_tokens
        self.window_buf = torch.full((max_tokens, window), -1, dtype=torch.int32, device=device)
        self.window_len = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.entries_buf = torch.full((max_tokens, capacity), -1, dtype=torch.int32, device=device)
        self.entries_len = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self._extent = {"window": 0, "entries": 0}

    def _store(self, kind: str, idx: torch.Tensor, length: torch.Tensor, buf: torch.Tensor, lens: torch.Tensor):
        t = idx.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed the buffers' max_tokens={self.max_tokens}")
        buf[:t].copy_(idx)
        lens[:t].copy_(length)
        previous = self._extent[kind]
        if previous > t:
            buf[t:previous].fill_(-1)
            lens[t:previous].fill_(0)
        self._extent[kind] = t
        return buf[:t], lens[:t]

    def build_window(self, positions, token_to_req, table, block_size: int):
        idx, length = window_indices(positions, token_to_req, table, block_size, self.window_buf.shape[1])
        return self._store("window", idx, length, self.window_buf, self.window_len)

    def build_entries(self, positions, token_to_req, table, block_size: int, ratio: int):
        idx, length = all_entry_indices(positions, token_to_req, table, block_size, ratio, self.entries_buf.shape[1])
        return self._store("entries", idx, length, self.entries_buf, self.entries_len)


__all__ = [
    "Dsv4Metadata", "all_entry_indices", "compressed_slots", "position_slots", "topk_slots", "visible_entries",
    "window_indices",
]
