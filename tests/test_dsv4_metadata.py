"""DeepSeek-V4 metadata (graphsafe.metadata.dsv4) against plain Python loops, and traced
whole by torch.compile(fullgraph=True)."""

from __future__ import annotations

import torch

from graphsafe.metadata import dsv4 as m


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 5, 17, 3, -1, 40, 7, 8])
    token_to_req = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1], dtype=torch.int32)
    table = torch.randperm(60, generator=gen)[:3 * 11].view(3, 11).to(torch.int32)
    return positions, token_to_req, table


def _slot(table, r, q, bs):
    col = q // bs
    if q < 0 or col >= table.shape[1]:
        return -1
    return int(table[r, col]) * bs + q % bs


def test_window_indices_and_position_slots():
    positions, reqs, table = _inputs()
    bs, w = 4, 6
    idx, length = m.window_indices(positions, reqs, table, bs, w)
    slots = m.position_slots(positions, reqs, table, bs)
    for t, (p, r) in enumerate(zip(positions.tolist(), reqs.tolist())):
        n = 0 if p < 0 else min(p + 1, w)
        assert length[t] == n
        want = [_slot(table, r, q, bs) for q in range(p - n + 1, p + 1)] + [-1] * (w - n)
        assert idx[t].tolist() == want, t
        assert slots[t] == (_slot(table, r, p, bs) if p >= 0 else -1)
    # A position past the table (11 blocks of 4 = 44 positions): no slot.
    far = m.window_indices(torch.tensor([45]), torch.tensor([0], dtype=torch.int32), table, bs, w)[0]
    assert far[0, -1] == -1 and far[0, 0] == _slot(table, 0, 40, bs)


def test_compressed_slots_entries_and_visibility():
    positions, reqs, table = _inputs(1)
    bs, ratio, cap = 2, 4, 5
    slots = m.compressed_slots(positions, reqs, table, bs, ratio)
    idx, n = m.all_entry_indices(positions, reqs, table, bs, ratio, cap)
    vis = m.visible_entries(positions, ratio)
    for t, (p, r) in enumerate(zip(positions.tolist(), reqs.tolist())):
        visible = 0 if p < 0 else (p + 1) // ratio
        assert vis[t] == visible
        completes = p >= 0 and (p + 1) % ratio == 0
        assert slots[t] == (_slot(table, r, (p + 1) // ratio - 1, bs) if completes else -1)
        k = min(visible, cap)
        assert n[t] == k
        assert idx[t].tolist() == [_slot(table, r, e, bs) for e in range(k)] + [-1] * (cap - k)


def test_topk_slots():
    positions, reqs, table = _inputs(2)
    topk = torch.tensor([[0, 3, -1], [2, -1, -1], [1, 0, 4], [-1, -1, -1], [-1, -1, -1], [5, 6, 7], [0, -1, -1],
                         [1, -1, -1]], dtype=torch.int32)
    vis = m.visible_entries(positions, 4)
    slots, n = m.topk_slots(topk, reqs, table, 2, vis)
    for t in range(8):
        assert slots[t].tolist() == [_slot(table, int(reqs[t]), int(e), 2) if e >= 0 else -1 for e in topk[t]]
        assert n[t] == min(int(vis[t]), 3)


def test_persistent_buffers_repad():
    positions, reqs, table = _inputs()
    meta = m.Dsv4Metadata(8, 6, 5, "cpu")
    idx, n = meta.build_window(positions, reqs, table, 4)
    first = meta.window_buf.data_ptr()
    idx2, n2 = meta.build_window(positions[:3], reqs[:3], table, 4)
    assert meta.window_buf.data_ptr() == first and idx2.data_ptr() == first
    assert meta.window_buf[3:].eq(-1).all() and meta.window_len[3:].eq(0).all()
    assert torch.equal(idx2, idx[:3])
    e, k = meta.build_entries(positions, reqs, table, 2, 4)
    assert torch.equal(e, m.all_entry_indices(positions, reqs, table, 2, 4, 5)[0])


def test_traced_whole_without_graph_breaks():
    positions, reqs, table = _inputs()

    def step(positions, reqs, table):
        w = m.window_indices(positions, reqs, table, 4, 6)
        s = m.position_slots(positions, reqs, table, 4)
        c = m.compressed_slots(positions, reqs, table, 2, 4)
        e = m.all_entry_indices(positions, reqs, table, 2, 4, 5)
        return (*w, s, c, *e)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for got, want in zip(compiled(positions, reqs, table), step(positions, reqs, table)):
        assert torch.equal(got, want)
