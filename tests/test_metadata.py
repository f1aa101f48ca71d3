"""Metadata builders (graphsafe.metadata): the behaviours issue 5 lists.

- pad-initialised persistent buffers; each build writes its extent and pads only the rows
  between the new and the previous extent (writes spied);
- decode builds read nothing back from the device (a guard mode raises on any host read of
  device-derived data), and only a prefill build copies device lengths to the host;
- the metadata cache: hits on identical batches, misses when the length contents change
  with the shapes unchanged, when the block table changes, and is off when a key input
  (the length mirror) is missing;
- `build_for_capture`; prefill metadata (groups, windows, host ints).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from graphsafe.metadata import BatchSpec, DecodeInputs, DecodeMetadataBuilder, build_prefill

MAX_BATCH, MAX_BLOCKS, BS = 8, 6, 4


def _decode_batch(seq_lens, table=None, mirror=True, version=None, seed=0):
    n = len(seq_lens)
    if table is None:
        g = torch.Generator().manual_seed(seed)
        table = torch.randperm(max(n, MAX_BATCH) * MAX_BLOCKS, generator=g)[: n * MAX_BLOCKS].view(n, MAX_BLOCKS)
    table = table.to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return BatchSpec(
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
        block_table_cpu=table,
        seq_lens_cpu=lens if mirror else None,
        seq_lens=None if mirror else lens.clone(),
        block_table_version=version,
    )


def _expected(batch):
    lens = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens).long()
    pos = lens - 1
    table = batch.block_table_cpu.long()
    slots = table[torch.arange(len(lens)), pos // BS] * BS + pos % BS
    return {"positions": pos, "seq_lens": lens.int(), "slot_mapping": slots, "block_table": table.int()}


def _assert_padded_from(builder, n):
    for name, t, pad in builder.buffers.items():
        assert bool((t[n:] == pad).all()), f"{name} rows >= {n} are not all {pad}"


def _assert_rows(builder, batch, ids=None):
    n = batch.num_reqs
    for name, want in _expected(batch).items():
        got = getattr(builder.buffers, name)[:n]
        assert torch.equal(got.long(), want.long()), name
    if ids is not None:
        assert torch.equal(builder.buffers.input_ids[:n], ids)


class _Spy:
    """Records the row ranges a builder writes and pads."""

    def __init__(self, monkeypatch):
        self.writes, self.pads = [], []
        write, pad = DecodeMetadataBuilder._write_rows, DecodeMetadataBuilder._pad_rows

        def spy_write(builder, name, src):
            self.writes.append((name, src.shape[0]))
            return write(builder, name, src)

        def spy_pad(builder, start, end):
            self.pads.append((start, end))
            return pad(builder, start, end)

        monkeypatch.setattr(DecodeMetadataBuilder, "_write_rows", spy_write)
        monkeypatch.setattr(DecodeMetadataBuilder, "_pad_rows", spy_pad)

    def clear(self):
        self.writes.clear()
        self.pads.clear()


class HostReadGuard(TorchFunctionMode):
    """Raises when data derived from `tainted` tensors (device data) is read on the host:
    the CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`. Taint follows every
    op that takes a tainted input (copies into buffers included)."""

    READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__", "__array__"}

    def __init__(self, *tainted):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in tainted}

    def _tainted(self, leaves):
        return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.ptrs for t in leaves)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tainted = self._tainted(leaves)
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in leaves if isinstance(a, (str, torch.device)))
        if tainted and (name in self.READS or to_host):
            raise AssertionError(f"host read of device data through {name}()")
        out = func(*args, **kwargs)
        if tainted:
            self.ptrs.update(t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


# -- persistent buffers -------------------------------------------------------------------
def test_buffers_are_pad_initialised():
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    fresh = DecodeInputs.empty(MAX_BATCH, MAX_BLOCKS, "cpu")
    assert builder.extent == 0
    _assert_padded_from(builder, 0)
    for (name, t, pad), (_, f, _) in zip(builder.buffers.items(), fresh.items()):
        assert torch.equal(t, f), name
    # slot 0 is a real cache slot: the slot pad is -1, never 0.
    assert bool((builder.buffers.slot_mapping == -1).all())
    assert all(bool((t == 0).all()) for name, t, _ in builder.buffers.items() if name != "slot_mapping")


def test_build_fills_extent_and_pads_only_between_old_and_new_extent(monkeypatch):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu", cache=False)
    five = _decode_batch([3, 9, 1, 17, 24])
    ids5 = torch.arange(5) + 100
    builder.build(five, ids5)
    assert spy.pads == []  # grew from extent 0: the rows past 5 were already padded
    fields = ("positions", "seq_lens", "slot_mapping", "block_table", "input_ids")
    assert sorted(spy.writes) == sorted((f, 5) for f in fields)
    _assert_rows(builder, five, ids5)
    _assert_padded_from(builder, 5)

    # Poison a row past the extent: a build must never touch rows beyond the old extent.
    builder.buffers.positions[6] = 777
    spy.clear()
    three = _decode_batch([2, 5, 8], seed=1)
    builder.build(three, torch.arange(3))
    assert spy.pads == [(3, 5)]  # exactly the rows between the new and the previous extent
    assert int(builder.buffers.positions[6]) == 777
    assert all(rows == 3 for _, rows in spy.writes)
    builder.buffers.positions[6] = 0
    _assert_rows(builder, three)
    _assert_padded_from(builder, 3)

    spy.clear()
    six = _decode_batch([4, 4, 4, 4, 4, 4], seed=2)
    builder.build(six, torch.arange(6))
    assert spy.pads == []
    _assert_rows(builder, six)
    _assert_padded_from(builder, 6)


@settings(max_examples=25)
@given(st.lists(st.lists(st.integers(1, MAX_BLOCKS * BS), min_size=1, max_size=MAX_BATCH), min_size=1, max_size=6))
def test_any_build_sequence_keeps_rows_past_the_batch_padded(batches):
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    for i, lens in enumerate(batches):
        batch = _decode_batch(lens, seed=i % 2)  # repeated tables exercise cache hits
        ids = torch.randint(0, 1000, (len(lens),))
        builder.build(batch, ids)
        _assert_rows(builder, batch, ids)
        _assert_padded_from(builder, len(lens))


# The transitions hypothesis found (test above) as fixed examples: a batch that shrinks by
# exactly one request (the last live row is the freed one), at the top of the buffers, down
# to one request and to none, on the host path and on the device path (no length mirror).
SHRINK_BY_ONE = [(5, 4), (MAX_BATCH, MAX_BATCH - 1), (2, 1), (1, 0)]


@pytest.mark.parametrize("mirror", [True, False], ids=["host-path", "device-path"])
@pytest.mark.parametrize("before,after", SHRINK_BY_ONE, ids=[f"{a}-to-{b}" for a, b in SHRINK_BY_ONE])
def test_a_batch_shrinking_by_one_pads_the_freed_row(monkeypatch, before, after, mirror):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    bucket = builder.buffers.rows(MAX_BATCH)  # a graph captured on the whole buffers
    lens = [3, 9, 1, 17, 24, 6, 11, 2][:before]
    builder.build(_decode_batch(lens, mirror=mirror), torch.arange(before) + 100)
    spy.clear()
    smaller = _decode_batch(lens[:after], mirror=mirror, seed=1)
    builder.build(smaller, torch.arange(after) + 200)
    for name, t, pad in builder.buffers.items():  # the freed row, field by field
        assert bool((t[after] == pad).all()), f"{name}[{after}] (the freed row) holds {t[after].tolist()}, not {pad}"
    assert spy.pads == [(after, before)], "exactly the freed row is padded"
    assert builder.extent == after
    _assert_rows(builder, smaller, torch.arange(after) + 200)
    _assert_padded_from(builder, after)
    for name, t, pad in bucket.items():
        assert bool((t[after:] == pad).all()), f"bucket {name}"
    # ... and growing back by one writes that row again.
    builder.build(_decode_batch(lens, mirror=mirror, seed=2), torch.arange(before))
    _assert_padded_from(builder, before)


def test_build_for_capture_pads_every_row_of_the_bucket_and_forgets_the_key(monkeypatch):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    batch = _decode_batch([5, 6, 7, 8, 9, 10])
    builder.build(batch, torch.arange(6) + 1)
    spy.clear()
    inputs = builder.build_for_capture(4)
    assert spy.pads == [(0, 6)]  # the bucket and the stale rows past it
    assert inputs.batch_size == 4 and inputs.input_ids.data_ptr() == builder.buffers.input_ids.data_ptr()
    _assert_padded_from(builder, 0)
    spy.clear()
    again = builder.build(batch, torch.arange(6) + 1)
    assert not again.cache_hit  # the capture overwrote the rows the key described
    assert ("positions", 6) in spy.writes
    _assert_rows(builder, batch)
    with pytest.raises(ValueError, match="batch_size"):
        builder.build_for_capture(MAX_BATCH + 1)


def test_rows_of_a_bucket_after_a_smaller_build_are_a_padded_input():
    """A graph captured on `buffers.rows(bucket)` replays correctly after any build n <= bucket."""
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    bucket = builder.build_for_capture(8)
    builder.build(_decode_batch([3, 4, 5, 6, 7, 8, 9]), torch.arange(7))
    builder.build(_decode_batch([3, 4]), torch.arange(2))
    for name, t, pad in bucket.items():
        assert bool((t[2:] == pad).all()), name


# -- no host reads in decode ------------------------------------------------------------------
def test_decode_build_without_length_mirror_reads_nothing_back_and_matches_the_host_path():
    lens = [7, 1, 13, 24, 2]
    on_device = _decode_batch(lens, mirror=False)
    host = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    dev = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    ids = torch.arange(5) + 3
    with HostReadGuard(on_device.seq_lens, ids):
        meta = dev.build(on_device, ids)
    assert on_device.host_copies == 0
    assert dev.stats.device_path == 1 and dev.stats.cache_disabled == 1
    assert meta.max_seq_len == MAX_BLOCKS * BS  # a bound: the host never saw the lengths
    host.build(_decode_batch(lens, table=on_device.block_table_cpu), ids)
    for (name, a, _), (_, b, _) in zip(host.buffers.items(), dev.buffers.items()):
        assert torch.equal(a, b), name


def test_guard_catches_a_host_read():
    t = torch.arange(4)
    with pytest.raises(AssertionError, match="host read"):
        with HostReadGuard(t):
            (t + 1).tolist()


def test_only_a_prefill_copies_device_lengths_to_the_host():
    decode = _decode_batch([4, 5], mirror=False)
    DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu").build(decode, torch.arange(2))
    assert decode.host_copies == 0
    prefill = BatchSpec(
        query_start_loc_cpu=torch.tensor([0, 3, 5], dtype=torch.int32),
        block_table_cpu=torch.arange(2 * MAX_BLOCKS, dtype=torch.int32).view(2, MAX_BLOCKS),
        seq_lens=torch.tensor([3, 2], dtype=torch.int32),
    )
    meta = build_prefill(prefill, np.arange(5), index_topk=8, block_size=BS, device="cpu")
    assert prefill.host_copies == 1 and meta.max_seq_len == 3
    build_prefill(prefill, np.arange(5), index_topk=8, block_size=BS, device="cpu")
    assert prefill.host_copies == 1  # the mirror is kept


# -- the metadata cache -----------------------------------------------------------------------
def test_cache_hits_on_an_identical_batch_and_skips_the_metadata_copies(monkeypatch):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    batch = _decode_batch([5, 9, 2])
    assert not builder.build(batch, torch.arange(3)).cache_hit
    spy.clear()
    meta = builder.build(_decode_batch([5, 9, 2]), torch.arange(3) + 7)
    assert meta.cache_hit and builder.stats.cache_hits == 1
    assert spy.writes == [("input_ids", 3)]  # the step's tokens are always copied
    _assert_rows(builder, batch, torch.arange(3) + 7)


def test_cache_misses_when_seq_len_contents_change_with_the_same_shapes(monkeypatch):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    table = _decode_batch([1, 1, 1]).block_table_cpu
    builder.build(_decode_batch([5, 9, 2], table=table), torch.arange(3))
    spy.clear()
    changed = _decode_batch([6, 9, 2], table=table)  # same n, same table, one length differs
    meta = builder.build(changed, torch.arange(3))
    assert not meta.cache_hit
    assert ("seq_lens", 3) in spy.writes and ("positions", 3) in spy.writes
    _assert_rows(builder, changed)


def test_cache_misses_when_the_block_table_changes():
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    batch = _decode_batch([5, 9, 2])
    builder.build(batch, torch.arange(3))
    table = batch.block_table_cpu.clone()
    table[1, 2] += 100  # the block the new token of request 1 lands in
    moved = _decode_batch([5, 9, 2], table=table)
    assert not builder.build(moved, torch.arange(3)).cache_hit
    _assert_rows(builder, moved)
    # With a version number the key uses it instead of the bytes.
    v1 = _decode_batch([5, 9, 2], table=table, version=1)
    builder.build(v1, torch.arange(3))
    assert builder.build(_decode_batch([5, 9, 2], table=table, version=1), torch.arange(3)).cache_hit
    assert not builder.build(_decode_batch([5, 9, 2], table=table, version=2), torch.arange(3)).cache_hit


def test_a_missing_key_input_disables_the_cache(monkeypatch):
    spy = _Spy(monkeypatch)
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    table = _decode_batch([1, 1]).block_table_cpu
    builder.build(_decode_batch([5, 9], table=table, mirror=False), torch.arange(2))
    spy.clear()
    meta = builder.build(_decode_batch([5, 9], table=table, mirror=False), torch.arange(2))
    assert not meta.cache_hit and builder.stats.cache_disabled == 2
    assert ("seq_lens", 2) in spy.writes
    # Nor does a mirrored build hit on what a key-less build left behind.
    assert not builder.build(_decode_batch([5, 9], table=table), torch.arange(2)).cache_hit


def test_decode_build_rejects_bad_batches():
    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    with pytest.raises(ValueError, match="max_batch"):
        builder.build(_decode_batch([1] * (MAX_BATCH + 1)))
    prefill = BatchSpec(torch.tensor([0, 2], dtype=torch.int32), torch.zeros(1, MAX_BLOCKS, dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="decode-only"):
        builder.build(prefill)
    with pytest.raises(ValueError, match="past the block table"):
        builder.build(_decode_batch([MAX_BLOCKS * BS + 1]))
    with pytest.raises(ValueError, match="input_ids"):
        builder.build(_decode_batch([3]), torch.arange(2))
    with pytest.raises(ValueError, match="CPU mirror"):
        table = torch.zeros(1, MAX_BLOCKS, dtype=torch.int32)
        BatchSpec(torch.tensor([0, 1]), table, torch.tensor([1], dtype=torch.int32))


# -- prefill metadata -------------------------------------------------------------------------
def test_prefill_groups_windows_and_host_ints():
    # Requests: 0 long (sparse), 1 short (dense), 2 an extend (context 4, sparse), 3 short.
    qlens, seq_lens, topk = [9, 3, 2, 5], [9, 3, 6, 5], 8
    table = torch.arange(4 * MAX_BLOCKS, dtype=torch.int32).view(4, MAX_BLOCKS).flip(1).contiguous()
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    batch = BatchSpec(qsl, table, torch.tensor(seq_lens, dtype=torch.int32))
    ids = np.arange(sum(qlens)) + 50
    meta = build_prefill(batch, ids, index_topk=topk, block_size=BS, device="cpu")

    order = [1, 3, 0, 2]  # dense group first, each group in request order
    want_ids = np.concatenate([ids[qsl[r] : qsl[r + 1]] for r in order])
    want_pos = np.concatenate([np.arange(seq_lens[r] - qlens[r], seq_lens[r]) for r in order])
    want_req = np.concatenate([[r] * qlens[r] for r in order])
    assert meta.input_ids.tolist() == want_ids.tolist()
    assert meta.positions.tolist() == want_pos.tolist()
    t = table.long().numpy()
    assert meta.slot_mapping.tolist() == (t[want_req, want_pos // BS] * BS + want_pos % BS).tolist()
    ends = np.cumsum([qlens[r] for r in order]) - 1
    assert meta.last_token_index.tolist() == [int(ends[order.index(r)]) for r in range(4)]
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (4, 19, 9, 9)

    dense, sparse = meta.dense, meta.sparse
    assert (dense.start, dense.end, dense.num_reqs, dense.max_seqlen) == (0, 8, 2, 5)
    assert dense.cu_seqlens.tolist() == [0, 3, 8]
    assert (sparse.start, sparse.end, sparse.num_reqs, sparse.total_seq_lens) == (8, 19, 2, 15)
    assert sparse.block_table.tolist() == table[[0, 2]].tolist()
    assert sparse.cu_seq_lens.tolist() == [0, 9, 15]
    assert sparse.req_id_per_token.tolist() == [0] * 9 + [1] * 2
    # Causal windows over the gathered context: token i of a request sees its first pos+1 keys.
    assert sparse.cu_seqlen_ks.tolist() == [0] * 9 + [9] * 2
    assert sparse.cu_seqlen_ke.tolist() == list(range(1, 10)) + [9 + 5, 9 + 6]


def test_prefill_all_dense_and_all_sparse():
    qsl = torch.tensor([0, 4, 6], dtype=torch.int32)
    table = torch.arange(2 * MAX_BLOCKS, dtype=torch.int32).view(2, MAX_BLOCKS)
    lens = torch.tensor([4, 2], dtype=torch.int32)
    dense = build_prefill(BatchSpec(qsl, table, lens), np.arange(6), index_topk=4, block_size=BS, device="cpu")
    assert dense.sparse is None and dense.dense.num_reqs == 2
    sparse = build_prefill(BatchSpec(qsl, table, lens), np.arange(6), index_topk=1, block_size=BS, device="cpu")
    assert sparse.dense is None and sparse.sparse.num_reqs == 2
    with pytest.raises(ValueError, match="input_ids"):
        build_prefill(BatchSpec(qsl, table, lens), np.arange(5), index_topk=4, block_size=BS, device="cpu")
    with pytest.raises(ValueError, match="block table"):
        build_prefill(BatchSpec(qsl, table, lens * 100), np.arange(6), index_topk=4, block_size=BS, device="cpu")


def test_staging_uses_one_allocation_per_build(monkeypatch):
    calls = []
    empty = torch.empty

    def counting_empty(*args, **kwargs):
        calls.append(kwargs.get("dtype"))
        return empty(*args, **kwargs)

    builder = DecodeMetadataBuilder(MAX_BATCH, MAX_BLOCKS, BS, "cpu")
    monkeypatch.setattr(torch, "empty", counting_empty)
    builder.build(_decode_batch([3, 4]))
    assert calls == [torch.uint8]  # the four fields share one (pinned, on a GPU) staging block


def test_states_over_disjoint_blocks_never_share_a_cache_key():
    """Two model states side by side (one prefilling while the other decodes) hand out
    disjoint blocks; with the same lengths and allocation history their block-table
    versions must still differ, or the builder would serve the first state's table."""
    from graphsafe.models.state import HostState

    builder = DecodeMetadataBuilder(2, 4, 4, "cpu")
    for ids in (range(0, 8), range(8, 16)):
        state = HostState(2, 4, 4, 16, 16, block_ids=ids)
        rows = state.add_requests([3, 5])
        state.commit_prefill(rows, [3, 5])
        meta = builder.build(state.decode_batch(), torch.tensor([1, 2]))
        assert not meta.cache_hit
        table = state.block_table[:2, :2]
        assert torch.equal(meta.inputs.block_table[:2, :2], table)
        assert set(table[0, :1].tolist() + table[1, :2].tolist()) <= set(ids)
    with pytest.raises(ValueError, match="block_ids"):
        HostState(2, 4, 4, 16, 16, block_ids=[0, 16])
