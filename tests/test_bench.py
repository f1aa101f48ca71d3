"""The benchmark runner on the CPU (`python -m graphsafe bench`): rows stream as they are
measured, the JSON file is a complete document after every row, a time limit or an
interruption keeps the rows measured, and GB/s is never printed as 0 for bytes moved.
GPU paths (graph replays, tuning cases) are not run here."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from graphsafe.__main__ import main
from graphsafe.bench import harness
from graphsafe.bench.harness import IMPL_WIDTH, Row, Shapes, format_row, header

# Two cheap cases: one that moves bytes (3 impls x 2 shapes), one of host times (3 impls).
CASES = ["--op", "top_k_per_row_decode", "--op", "workspace"]
ROWS = 2 * 3 + 3


def _strict_json(path) -> dict:
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(path.read_text(), parse_constant=reject)


def _bench(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "--device", "cpu", *argv])
    return rc, out.getvalue()


def _rows(doc: dict) -> list[Row]:
    return [Row(**r) for r in doc["rows"]]


def _gbps_cell(line: str) -> str:
    """The GB/s cell of a one-line row: cells after the impl are time, its unit, eager, MB, GB/s, ..."""
    return line[2 + IMPL_WIDTH :].split()[4]


def test_rows_stream_once_and_json_is_complete_after_every_row(tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    out = io.StringIO()
    seen: list[tuple[str, list]] = []  # stdout and the JSON rows on disk as each row starts
    measure = harness.measure_impl

    def spy(*args, **kwargs):
        seen.append((out.getvalue(), _strict_json(path)["rows"]))
        return measure(*args, **kwargs)

    monkeypatch.setattr(harness, "measure_impl", spy)
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--device", "cpu", *CASES, "--json", str(path)]) == 0
    text = out.getvalue()
    doc = _strict_json(path)
    rows = _rows(doc)
    assert len(rows) == ROWS and len(seen) == ROWS
    assert text.splitlines().count(header()) == 1
    assert text.index(header()) < text.index(format_row(rows[0]))
    for row in rows:
        assert row.error is None, row
        assert text.count(format_row(row)) == 1, format_row(row)
    # Streaming: when a row starts, every earlier row is already printed and on disk.
    for k, (printed, on_disk) in enumerate(seen):
        assert len(on_disk) == k
        assert all(format_row(row) in printed for row in rows[:k])
        assert all(format_row(row) not in printed for row in rows[k:])
    meta = doc["meta"]
    assert meta["complete"] is True and meta["stopped"] is None
    assert meta["device"] == "cpu" and meta["sweep"] == "cpu" and meta["torch"] == torch.__version__
    assert meta["cases"] == ["top_k_per_row_decode", "workspace"]
    assert doc["ceilings"]["copy_bytes_per_s"] > 0


def test_no_reference_leaves_out_the_reference_rows_only(tmp_path):
    """`bench --no-reference`: the same problems without the PyTorch reference's rows (its
    callables never run), graphsafe's rows as before, and the JSON meta says so."""
    def impls(argv, path):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["bench", "--device", "cpu", "--op", "top_k_per_row_decode", "--json", str(path), *argv]) == 0
        doc = _strict_json(path)
        return doc["meta"]["reference"], [(row.shape, row.impl) for row in _rows(doc)]

    with_ref, rows = impls([], tmp_path / "a.json")
    without_ref, rows_without = impls(["--no-reference"], tmp_path / "b.json")
    assert with_ref is True and without_ref is False
    assert any(impl.startswith("reference") for _, impl in rows)
    assert rows_without == [(shape, impl) for shape, impl in rows if not impl.startswith("reference")]
    assert rows_without


def test_only_times_the_problems_whose_label_contains_a_text(tmp_path):
    """`bench --only TEXT` (repeatable): the problems whose "case | shape" label contains one
    of the texts, with all their rows; the others are not timed; the JSON meta names the
    texts. A text matching nothing times nothing."""
    def shapes(argv, path):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["bench", "--device", "cpu", *CASES, "--json", str(path), *argv]) == 0
        doc = _strict_json(path)
        return doc["meta"]["only"], [(row.case, row.shape, row.impl) for row in _rows(doc)]

    meta, every = shapes([], tmp_path / "all.json")
    assert meta is None and len(every) == ROWS
    first = every[0][1]  # a shape label of the first case
    meta, picked = shapes(["--only", first, "--only", "workspace"], tmp_path / "some.json")
    assert meta == [first, "workspace"]
    assert picked == [r for r in every if first in f"{r[0]} | {r[1]}" or "workspace" in f"{r[0]} | {r[1]}"]
    assert 0 < len(picked) < len(every)
    assert shapes(["--only", "no such shape"], tmp_path / "none.json")[1] == []


def test_gbps_is_never_zero_for_rows_that_move_bytes(tmp_path):
    path = tmp_path / "bench.json"
    rc, text = _bench(["--op", "top_k_per_row_decode", "--json", str(path)])
    assert rc == 0
    rows = _rows(_strict_json(path))
    assert rows and all(r.bytes > 0 for r in rows)
    for row in rows:
        assert row.gbps is not None and row.gbps > 0
        assert row.gbps == pytest.approx(row.bytes / (row.median_ms / 1e3) / 1e9)
        cell = _gbps_cell(format_row(row))
        assert float(cell) > 0, format_row(row)
    # The formatting itself keeps small rates non-zero.
    small = (4.2e-4, 0.0123, 1.234, 56.78, 4321.0)
    assert [harness.format_number(x) for x in small] == ["0.00042", "0.0123", "1.23", "56.8", "4321"]


def test_time_limit_keeps_the_rows_measured(tmp_path, monkeypatch):
    """The clock advances one second per measured row: a 1 s limit lets exactly one row start."""
    path = tmp_path / "bench.json"
    measured = [0]
    measure = harness.measure_impl

    def counting(*args, **kwargs):
        result = measure(*args, **kwargs)
        measured[0] += 1
        return result

    monkeypatch.setattr(harness, "measure_impl", counting)
    monkeypatch.setattr(harness, "clock", lambda: float(measured[0]))
    rc, text = _bench([*CASES, "--json", str(path), "--time-limit", "1"])
    assert rc == 0
    doc = _strict_json(path)
    rows = _rows(doc)
    assert len(rows) == 1 and measured[0] == 1
    assert text.count(format_row(rows[0])) == 1
    assert doc["meta"]["complete"] is False and "time limit of 1 s reached" in doc["meta"]["stopped"]
    assert "[bench] time limit of 1 s reached" in text and "1 rows measured" in text


def test_time_limit_zero_starts_no_row_and_leaves_valid_json(tmp_path):
    path = tmp_path / "bench.json"
    rc, text = _bench([*CASES, "--json", str(path), "--time-limit", "0"])
    assert rc == 0
    doc = _strict_json(path)
    assert doc["rows"] == [] and doc["meta"]["complete"] is False
    assert text.splitlines().count(header()) == 1


def test_interrupted_run_keeps_the_rows_done(tmp_path, monkeypatch):
    """A run cut off during its second row (here Ctrl-C) leaves the first row on disk."""
    path = tmp_path / "bench.json"
    calls = [0]
    measure = harness.measure_impl

    def interrupt_second(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(harness, "measure_impl", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        _bench([*CASES, "--json", str(path)])
    doc = _strict_json(path)
    assert len(doc["rows"]) == 1 and doc["rows"][0]["gbps"] > 0
    assert doc["meta"]["complete"] is False and doc["meta"]["stopped"] == "interrupted: KeyboardInterrupt"


def test_gpu_only_cases_are_skipped_on_the_cpu(tmp_path):
    path = tmp_path / "bench.json"
    rc, text = _bench(["--op", "mla_tune", "--op", "host_cost", "--json", str(path)])
    assert rc == 0
    assert "mla_tune: needs a GPU: skipped" in text and "host_cost: needs a GPU: skipped" in text
    doc = _strict_json(path)
    assert doc["rows"] == [] and doc["meta"]["skipped"] == {"mla_tune": "needs a GPU", "host_cost": "needs a GPU"}
    assert doc["meta"]["complete"] is True


def test_every_case_declares_its_shapes():
    cases = harness.load_cases()
    assert len(cases) >= 20
    for name, case in cases.items():
        shapes = case.shapes
        assert shapes.full, name
        assert all(s in shapes.full for s in shapes.default), name
        assert shapes.cpu is None or len(shapes.cpu) >= 1, name
        # The default set is a subset: fewer shapes than the full sweep wherever it has several.
        assert len(shapes.default) < len(shapes.full) or len(shapes.full) == 1, name


def test_shapes_pick():
    shapes = Shapes(default=(1,), full=(1, 2), cpu=None)
    assert shapes.pick("cuda", full=False, named=False) == (1,)
    assert shapes.pick("cuda", full=True, named=False) == (1, 2)
    assert shapes.pick("cpu", full=True, named=True) is None
    tune = Shapes(default=(), full=(3,), cpu=(0,))
    assert tune.pick("cuda", full=False, named=False) == ()
    assert tune.pick("cuda", full=False, named=True) == (3,)
    assert tune.pick("cpu", full=False, named=False) == (0,)
    with pytest.raises(ValueError, match="not in the full sweep"):
        Shapes(default=(5,), full=(1, 2), cpu=None)


def test_long_impl_labels_wrap_instead_of_being_cut():
    label = "graphsafe fp8 (fp8 in) tiles (128, 128, 8, 3) (no graph)"
    row = Row(case="c", shape="s", impl=label, median_ms=0.5, eager_ms=0.7, bytes=10**6, flops=0, gbps=2.0,
              pct_bandwidth=None, tflops=None, pct_peak=None, speedup_vs_first=1.0)
    first, second = format_row(row).splitlines()
    assert first == f"  {label}"
    assert second.startswith("  " + " " * IMPL_WIDTH) and _gbps_cell(second) == "2"


def test_flashinfer_peers_are_optional_and_ratios_come_from_the_first_row():
    """Without FlashInfer (or off CUDA) the peers add no impl; the ratio note divides the
    first (graphsafe) row's time by each FlashInfer row's."""
    from graphsafe.bench import flashinfer
    from graphsafe.bench.harness import Row

    cpu = torch.device("cpu")
    x = torch.zeros(2, 4, 8)
    assert flashinfer.ragged_prefill_peers(x, x, x, torch.zeros(2, dtype=torch.int32), 1.0, True, x) == ({}, "")

    def row(impl, ms, error=None):
        return Row(case="c", shape="s", impl=impl, median_ms=ms, eager_ms=None, bytes=0, flops=0, gbps=None,
                   pct_bandwidth=None, tflops=None, pct_peak=None, speedup_vs_first=None, unit="ms", error=error)

    rows = [row("graphsafe[triton]", 0.4), row("reference eager", 9.0), row("flashinfer MLA fa3", 0.3),
            row("flashinfer MLA fa2", 0.5, error="boom")]
    assert flashinfer.ratio_note(rows) == "graphsafe / flashinfer MLA fa3 = 1.33"
    assert flashinfer.ratio_note([row("graphsafe[triton]", 0.4, error="x"), rows[2]]) == ""
    assert flashinfer.unavailable(cpu) == "flashinfer: CUDA only"


# -- MLA with the fp8_ds_mla cache ------------------------------------------------------------
def _mla_problems(name: str) -> list:
    case = harness.load_cases()[name]
    return list(case.fn(torch.device("cpu"), case.shapes.cpu))


@pytest.mark.parametrize("name", ["mla_decode", "sparse_mla"])
def test_mla_cases_pair_each_bf16_row_with_an_fp8_ds_mla_row_of_656_bytes_a_key(name):
    """Each CPU shape yields the bf16 problem, then the same shape with the fp8_ds_mla
    cache; the bytes moved differ by exactly the cache reads: 1152 against 656 bytes a key
    (q, out, lse and the block table / indices are the same)."""
    from graphsafe.ops.mla import bench as mla

    assert mla.RECORD == 656
    problems = _mla_problems(name)
    shapes = harness.load_cases()[name].shapes.cpu
    assert len(problems) == 2 * len(shapes)
    for (bf16, fp8), shape in zip(zip(problems[::2], problems[1::2]), shapes):
        rows, keys = shape[0], shape[2]
        assert "fp8_ds_mla" not in bf16.shape and fp8.shape == bf16.shape + " fp8_ds_mla", (bf16.shape, fp8.shape)
        assert bf16.bytes - fp8.bytes == rows * keys * (2 * mla.D - 656)
        assert fp8.flops == bf16.flops and set(fp8.impls) == set(bf16.impls)


def test_fp8_bench_cache_holds_the_records_of_the_bf16_keys(monkeypatch):
    from graphsafe.ops.mla import bench as mla
    from graphsafe.formats.fp8_ds_mla import quantize_records

    kv = torch.randn(3, 4, mla.D).bfloat16()
    monkeypatch.setattr(mla, "QUANT_CHUNK_ROWS", 5)  # chunks that split blocks
    records = mla.fp8_cache(kv)
    assert records.dtype == torch.uint8 and records.shape == (3, 4, 656)
    assert mla.cache_bytes_per_key(records) == 656 and mla.cache_bytes_per_key(kv) == 1152
    flat = kv.reshape(-1, mla.D)
    assert torch.equal(records.reshape(-1, 656), quantize_records(flat[:, : mla.R], flat[:, mla.R :]))


def test_bench_runs_the_fp8_ds_mla_rows_on_the_cpu(tmp_path):
    """Needs the MLA ops to read the fp8_ds_mla cache (reference backend on the CPU)."""
    path = tmp_path / "bench.json"
    rc, text = _bench(["--op", "mla_decode", "--op", "sparse_mla", "--json", str(path)])
    assert rc == 0, text
    rows = _rows(_strict_json(path))
    fp8 = [r for r in rows if r.shape.endswith("fp8_ds_mla")]
    assert {r.case for r in fp8} == {"mla_decode", "sparse_mla"} and len(fp8) == len(rows) / 2
    for row in rows:
        assert row.error is None and row.gbps > 0, row


def test_variant_rows_pair_each_variant_with_the_plain_shape_and_count_only_the_window():
    """attention_variants yields, per op, the shape without the variants and then with
    them; the window cuts the bytes (decode: keys read) and the FLOPs (prefill: pairs)."""
    case = harness.load_cases()["attention_variants"]
    problems = list(case.fn(torch.device("cpu"), case.shapes.cpu))
    pairs = list(zip(problems[:-1:2], problems[1:-1:2]))
    assert [plain.case for plain, _ in pairs] == ["paged_attention_decode", "flash_attn_varlen",
                                                  "paged_attention_prefill"]
    for plain, variant in pairs:
        assert "window=-1" in plain.shape and "window=15" in variant.shape, (plain.shape, variant.shape)
        assert variant.flops < plain.flops
    decode_plain, decode_window = pairs[0]
    assert decode_window.bytes < decode_plain.bytes
    assert problems[-1].case == "sparse_mla" and "topk_length" in problems[-1].shape


def test_flashmla_peer_is_never_required():
    """FlashMLA rows only where `import flash_mla` works on sm_90: off CUDA every peer
    function returns no impls (and says nothing on the CPU); vLLM's head padding for its
    64/128-head sparse decode appends zero heads."""
    from graphsafe.bench import flashmla
    from graphsafe.ops.mla import bench as mla

    cpu = torch.device("cpu")
    assert flashmla.unavailable(cpu) == "flashmla: CUDA only"
    args = mla.with_fp8_cache(mla.sparse_inputs(4, 16, 32, cpu, region=64))
    assert flashmla.sparse_decode_peers(*args, (None, None), 2) == ({}, "")
    q = torch.randn(3, 16, 8)
    padded = flashmla.pad_heads(q, 64)
    assert padded.shape == (3, 64, 8) and torch.equal(padded[:, :16], q) and not padded[:, 16:].any()
    assert flashmla.pad_heads(q, 16) is q


def test_flashmla_sparse_prefill_is_called_at_d_v_512_only(monkeypatch):
    """`flash_mla_sparse_fwd` takes d_v 512 only and the prebuilt peer ends the process on
    another (d_qk 512 / d_v 448 on the H200): on CUDA the bench never calls it there and
    says why; at 512 it runs the variant."""
    import types

    from graphsafe.bench import flashmla

    ran = []
    monkeypatch.setattr(flashmla, "_module", lambda: object())
    monkeypatch.setattr(flashmla, "_run_variant", lambda device, label, make, compare: ran.append(label) or ({}, "ran"))
    q = types.SimpleNamespace(device=torch.device("cuda"), shape=(8, 128, 512))
    impls, note = flashmla.sparse_prefill_peers(q, None, None, 0.1, 448, (None, None))
    assert impls == {} and "d_v 512 only (got 448)" in note and not ran
    assert flashmla.sparse_prefill_peers(q, None, None, 0.1, 512, (None, None)) == ({}, "ran") and len(ran) == 1


def test_peer_ratio_note_covers_every_external_peer():
    from graphsafe.bench.harness import Row
    from graphsafe.bench.peers import ratio_note

    def row(impl, ms):
        return Row(case="c", shape="s", impl=impl, median_ms=ms, eager_ms=None, bytes=0, flops=0, gbps=None,
                   pct_bandwidth=None, tflops=None, pct_peak=None, speedup_vs_first=None, unit="ms", error=None)

    rows = [row("graphsafe[triton]", 0.3), row("reference eager", 3.0), row("flashmla sparse decode", 0.2),
            row("flashinfer MLA fa3", 0.6)]
    assert ratio_note(rows) == "graphsafe / flashmla sparse decode = 1.50; graphsafe / flashinfer MLA fa3 = 0.50"


def test_flashmla_sparse_decode_lse_is_read_heads_before_queries():
    """FlashMLA returns the decode LSE as [batch, heads, s_q]; read as [batch, s_q, heads]
    (the bench did until 2026-11-28) it mixed heads and queries: |lse diff| 0.23-0.63 on
    the H200 while the outputs agreed."""
    from graphsafe.bench import flashmla

    b, s_q, heads, padded = 3, 2, 16, 64
    ours = torch.randn(b * s_q, heads)
    theirs = torch.full((b, padded, s_q), float("nan"))
    theirs[:, :heads, :] = ours.view(b, s_q, heads).transpose(1, 2)
    assert torch.equal(flashmla.sparse_decode_lse(theirs, s_q, heads), ours)
