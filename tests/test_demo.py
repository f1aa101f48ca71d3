"""`python -m graphsafe demo` on the CPU with tiny settings (aot_eager keeps compiles
short): the table's modes, numbers and token agreement, the CLI, the progress bar, the
plot option. A fake model with the demo model's API (built on graphsafe ops, see
tests/test_graphs.py) checks the demo's own logic; the real model runs through the CLI."""

from __future__ import annotations

import io
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from graphsafe import demo
from graphsafe.metadata import DecodeInputs
from graphsafe.ops.attention import paged_attention_decode_workspace
from graphsafe.workspace import current_workspace_manager
from test_graphs import ToyStep

ROW = re.compile(r"^(eager|compiled\+graphs|compiled)\s+(\d+)\s+(.*)$")


@dataclass
class FakeConfig:
    vocab_size: int


class FakeState:
    def __init__(self) -> None:
        self.seq_lens: list[int] = []
        self.blocks: list[list[int]] = []


class FakeModel:
    """The demo model's API over ToyStep: the caches live in the model (a captured graph
    keeps reading them), a state holds the CPU mirrors of its requests."""

    def __init__(self, device, dtype, seed):
        self.toy = ToyStep(device, dtype=dtype, seed=seed, max_blocks=4, num_blocks=48)
        self.cfg = FakeConfig(self.toy.vocab)
        self.device = device
        self.reserved: list[int] = []

    def new_state(self) -> FakeState:
        return FakeState()

    def _inputs(self, state, rows, ids) -> DecodeInputs:
        bs = self.toy.block_size
        pos = [p for _, p in rows]
        table = [state.blocks[r] for r, _ in rows]
        slots = [state.blocks[r][p // bs] * bs + p % bs for r, p in rows]
        dev = self.device
        return DecodeInputs(
            input_ids=ids,
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )

    def prefill(self, state, prompts):
        # Every prompt token in one step: all K/V are written before attention reads them,
        # so token t sees tokens 0..t of its request (causal prefill).
        first = len(state.blocks)
        mb = self.toy.max_blocks
        rows, ids, last = [], [], []
        for i, prompt in enumerate(prompts):
            r = first + i
            state.blocks.append(list(range(r * mb, (r + 1) * mb)))
            state.seq_lens.append(len(prompt))
            rows += [(r, p) for p in range(len(prompt))]
            ids += prompt
            last.append(len(rows) - 1)
        logits, _ = self.toy(self._inputs(state, rows, torch.tensor(ids, device=self.device)))
        return logits[last]

    def decode_inputs(self, state, next_tokens):
        rows = list(enumerate(state.seq_lens))
        return self._inputs(state, rows, next_tokens.to(torch.int64))

    def decode_step(self, inputs):
        return self.toy(inputs)[0]

    def advance(self, state, next_tokens):
        state.seq_lens = [n + 1 for n in state.seq_lens]

    def decode_workspace_reserve(self, max_batch):
        self.reserved.append(max_batch)
        t = self.toy
        specs = paged_attention_decode_workspace(max_batch, t.hq, t.hk, t.d, t.max_blocks, t.block_size, self.device)
        current_workspace_manager(self.device).reserve(*specs)


def fake_build(device, dtype, seed, **overrides):
    assert not overrides
    return FakeModel(device, dtype, seed), None


def _run(**kw):
    opts = demo.DemoOptions(
        device="cpu", batches=(1, 3), steps=5, prompt_len=6, backend="aot_eager", progress=False, **kw
    )
    out = io.StringIO()
    rows = demo.run_demo(opts, build=fake_build, out=out)
    return rows, out.getvalue()


def _table_rows(text: str) -> dict[tuple[str, int], str]:
    found = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            found[(m.group(1), int(m.group(2)))] = m.group(3)
    return found


def _check_table(text: str, batches=(1, 3), picks_equal=True, no_recompiles=True) -> None:
    rows = _table_rows(text)
    assert set(rows) == {(m, b) for m in demo.MODES for b in batches}, text
    for b in batches:
        for mode in ("eager", "compiled"):
            cells = rows[(mode, b)].split()
            step_ms, tokens_per_s = float(cells[0]), float(cells[1])
            assert step_ms > 0 and tokens_per_s == pytest.approx(b / (step_ms / 1e3), rel=0.01)
        eager = rows[("eager", b)].split()
        assert eager[2:4] == ["-", "-"] and "(reference)" in rows[("eager", b)]
        compiled = rows[("compiled", b)].split()
        assert compiled[2] == "0", "graph breaks"
        assert int(compiled[3]) >= 0
        if no_recompiles:
            assert compiled[3] == "0", "recompiles: one dynamic graph serves B = 1 and B = 3"
        assert compiled[4] == "n/a" and compiled[5] == "n/a", "syncs and allocations are counted on CUDA only"
        if picks_equal:
            assert rows[("compiled", b)].endswith("yes"), "compiled picks equal eager's"
        else:
            assert re.search(r"(yes|near-tie: \d+/\d+ picks \((1 flip, at a near-tie|\d+ flips, all at near-ties)\))$",
                             rows[("compiled", b)]), rows[("compiled", b)]
        assert rows[("compiled+graphs", b)].strip() == "n/a (no CUDA)"


def test_demo_table_with_the_fake_model():
    rows, text = _run()
    _check_table(text)
    # 5 steps, the first 2 of warm-up: the header says how many steps the median is over.
    assert "5 greedy steps (step ms: the median of 3 steps, 3..5; 2 steps of warm-up left out)" in text, text
    assert demo.exit_code(rows) == 0
    by = {(r.mode, r.batch): r for r in rows}
    for b in (1, 3):
        assert by[("eager", b)].tokens.shape == (5, b)
        assert torch.equal(by[("eager", b)].tokens, by[("compiled", b)].tokens)
        assert by[("compiled+graphs", b)].tokens is None
    assert by[("compiled", 1)].setup_s is not None, "the first compiled row reports its compile time"


def test_demo_graph_mode_through_the_emulated_runner():
    """The graph mode's plumbing (template, reserve, capture, replay from static outputs)
    without CUDA: GraphRunner(emulate=True) in place of graphs."""
    built = []

    def build(device, dtype, seed):
        model, _ = fake_build(device, dtype, seed)
        built.append(model)
        return model, None

    opts = demo.DemoOptions(device="cpu", batches=(1, 3), steps=4, prompt_len=5, backend="aot_eager",
                            progress=False, emulate_graphs=True)
    out = io.StringIO()
    rows = demo.run_demo(opts, build=build, out=out)
    table = _table_rows(out.getvalue())
    for b in (1, 3):
        cells = table[("compiled+graphs", b)].split()
        assert float(cells[0]) > 0 and cells[2:4] == ["0", "0"], table[("compiled+graphs", b)]
        assert cells[-1] == "yes"
    assert built[0].reserved == [3], "the worst case is reserved once, for the largest bucket"
    assert demo.exit_code(rows) == 0
    assert not current_workspace_manager("cpu").is_locked, "the runner is closed after the demo"


def test_a_failing_mode_is_reported_in_its_row_and_fails_the_exit_code():
    def broken_build(device, dtype, seed):
        model, _ = fake_build(device, dtype, seed)
        model.decode_step = lambda inputs: inputs.input_ids.nonzero()  # data-dependent: no fullgraph
        return model, None

    opts = demo.DemoOptions(device="cpu", batches=(2,), steps=2, prompt_len=3, backend="aot_eager",
                            progress=False, modes=("compiled",))
    out = io.StringIO()
    rows = demo.run_demo(opts, build=broken_build, out=out)
    assert rows[0].note.startswith("error: ") and "error: " in out.getvalue()
    assert demo.exit_code(rows) == 1


def test_agreement_text():
    ref = torch.tensor([[1, 2], [3, 4], [5, 6]])
    assert demo._agreement(ref.clone(), ref) == "yes"
    other = ref.clone()
    other[1, 0] = 9
    other[2, 1] = 9
    assert demo._agreement(other, ref) == "NO: 4/6 picks (2 of 2 flips not at a near-tie)"
    near = torch.zeros(3, 2, dtype=torch.bool)
    near[1, 0] = True
    assert demo._agreement(other, ref, near) == "NO: 4/6 picks (1 of 2 flips not at a near-tie)"
    near[2, 1] = True
    assert demo._agreement(other, ref, near) == "near-tie: 4/6 picks (2 flips, all at near-ties)"
    assert demo._agreement(ref, None).startswith("n/a")
    one = ref.clone()
    one[0, 0] = 9
    assert demo._agreement(one, ref, near) == "NO: 5/6 picks (1 of 1 flip not at a near-tie)"
    near[0, 0] = True
    assert demo._agreement(one, ref, near) == "near-tie: 5/6 picks (1 flip, at a near-tie)"


def test_near_ties_are_flagged_from_the_top_two_logits():
    logits = torch.tensor([[10.0, 9.99, 0.0], [10.0, 5.0, 0.0], [-3.0, -3.01, -9.0]]).bfloat16()
    picks, near = demo.greedy_with_near_ties(logits)
    assert picks.tolist() == [0, 0, 0] and near.tolist() == [True, False, True]


def test_bad_options_are_refused():
    for kw in ({"modes": ("fast",)}, {"modes": ()}, {"batches": (0,)}, {"steps": 0}):
        with pytest.raises(demo.DemoError):
            demo.run_demo(demo.DemoOptions(progress=False, **kw), build=fake_build, out=io.StringIO())
    assert demo.parse_override("num_hidden_layers=4") == ("num_hidden_layers", 4)
    assert demo.parse_override("rope_theta=1e4") == ("rope_theta", 1e4)
    assert demo.parse_override("flag=false") == ("flag", False)
    with pytest.raises(demo.DemoError, match="KEY=VALUE"):
        demo.parse_override("layers")


def test_unknown_model_fields_are_refused_with_the_closest_name(monkeypatch, capsys):
    """A typo in --model would otherwise run the defaults silently."""
    import graphsafe.models
    from graphsafe.__main__ import main

    built = []
    monkeypatch.setattr(graphsafe.models, "build_demo_model", lambda *a, **k: built.append(1))
    cases = {
        "num_hidden_layer": r"--model num_hidden_layer=1: .*did you mean num_hidden_layers\?",
        "indx_topk": r"did you mean index_topk\?",
        "nosuchfield": r"no field 'nosuchfield': the fields: .*num_hidden_layers",
        "num_key_value_heads": r"follows num_attention_heads",
        "rope_theta": r"no field 'rope_theta'",  # read from rope_parameters: it would change nothing
        "tp": r"--tp",
    }
    for field, message in cases.items():
        with pytest.raises(demo.DemoError, match=message):
            demo.run_demo(demo.DemoOptions(progress=False, model_overrides={field: 1}), out=io.StringIO())
    assert main(["demo", "--no-progress", "--model", "num_hidden_layer=1"]) == 2
    assert "did you mean num_hidden_layers?" in capsys.readouterr().err
    assert not built, "refused before any work"
    from graphsafe.demo.options import check_model_overrides

    check_model_overrides({"num_hidden_layers": 1, "max_num_batched_tokens": 64, "kv_cache_dtype": "auto"})
    monkeypatch.undo()
    from graphsafe.models import build_demo_model

    with pytest.raises(TypeError, match="did you mean num_hidden_layers"):
        build_demo_model("cpu", with_hf=False, num_hidden_layer=1)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    built = []
    opts = demo.DemoOptions(progress=False, plot="out.png")
    with pytest.raises(demo.DemoError, match=r"matplotlib.*graphsafe\[plot\]"):
        demo.run_demo(opts, build=lambda *a, **k: built.append(1), out=io.StringIO())
    assert not built, "the missing extra is reported before any work"


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [demo.Row(m, b, step_ms=float(b + i)) for i, m in enumerate(demo.MODES[:2]) for b in (1, 4)]
    rows.append(demo.Row(demo.GRAPHS, 1, note="n/a (no CUDA)"))
    path = tmp_path / "latency.png"
    demo.plot_rows(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_progress_bar_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = io.StringIO()
    bar = demo.Progress(40, stream=stream)
    for _ in range(40):
        bar.update(1, "eager B=1")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("[" + "#" * 30 + "] 100%") and "eager B=1" in lines[-1]
    assert 5 <= len(lines) <= 12, "a non-interactive stream gets a line per 10%, not per step"
    silent = io.StringIO()
    off = demo.Progress(10, enabled=False, stream=silent)
    off.update(3)
    off.close()
    assert silent.getvalue() == ""


def _real_model_available() -> bool:
    try:
        from graphsafe.models import build_demo_model  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _real_model_available(), reason="graphsafe.models is not there yet")
def test_cli_demo_with_the_real_model_on_the_cpu(tmp_path):
    cmd = [sys.executable, "-m", "graphsafe", "demo", "--device", "cpu", "--batch", "1", "3", "--steps", "4",
           "--prompt-len", "8", "--backend", "aot_eager", "--no-progress"]
    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # aot_eager runs eager's kernels: the picks are equal. Recompiles are the model's
    # business (tests/test_models*.py); here they only need to be reported.
    _check_table(proc.stdout, no_recompiles=False)
    assert "4 greedy steps (step ms: the median of 2 steps, 3..4;" in proc.stdout


@pytest.mark.skipif(not _real_model_available(), reason="graphsafe.models is not there yet")
def test_graph_mode_with_the_real_model_through_the_emulated_runner():
    """The real model's graph path on the CPU: its metadata builder's buffers as the
    static inputs (no copy), the decode and prefill worst cases reserved, the workspace
    locked during the graph rows and released after."""
    opts = demo.DemoOptions(device="cpu", batches=(1, 3), steps=4, prompt_len=20, backend="aot_eager",
                            progress=False, emulate_graphs=True)
    out = io.StringIO()
    rows = demo.run_demo(opts, out=out)
    text = out.getvalue()
    assert demo.exit_code(rows) == 0, text
    for row in rows:
        assert row.ok and row.step_ms is not None, text
        assert row.agree in ("(reference)", "yes"), text  # aot_eager: eager's kernels, equal picks
    assert not current_workspace_manager("cpu").is_locked


# -- the MLA cache kind: --kv-cache, --compare-caches -------------------------------------------
@dataclass
class CacheFakeConfig:
    vocab_size: int
    kv_cache_dtype: str
    num_layers: int = 2
    kv_lora_rank: int = 128
    qk_rope_head_dim: int = 16


class CacheFakeModel(FakeModel):
    """The fake model with the cache-size API; "fp8_ds_mla" is another seed (other picks)
    whose tokens fed to each decode step are recorded."""

    def __init__(self, device, dtype, seed, kind):
        super().__init__(device, dtype, seed + (kind != "auto"))
        self.cfg = CacheFakeConfig(self.toy.vocab, kind)
        self.dtype, self.max_model_len, self.max_batch = dtype, 11, 3
        self.fed: list[torch.Tensor] = []

    def cache_bytes_per_token(self):
        return 2 * (288 if self.cfg.kv_cache_dtype == "auto" else 164)

    def decode_inputs(self, state, next_tokens):
        self.fed.append(next_tokens.cpu().clone())
        return super().decode_inputs(state, next_tokens)


def test_cache_options_are_validated_before_any_work():
    built = []

    def build(*args, **kwargs):
        built.append(1)

    bad = (
        {"kv_cache": "fp8"},
        {"kv_cache": "fp8_ds_mla", "model_overrides": {"kv_lora_rank": 64}},
        {"compare_caches": True, "model_overrides": {"kv_lora_rank": 192}},
        {"kv_cache": "fp8_ds_mla", "model_overrides": {"qk_rope_head_dim": 15}},
        {"compare_caches": True, "tp": 2},
    )
    messages = ("--kv-cache", "multiple of 128", "multiple of 128", "even qk_rope_head_dim", "one device")
    for kw, message in zip(bad, messages):
        with pytest.raises(demo.DemoError, match=message):
            demo.run_demo(demo.DemoOptions(progress=False, **kw), build=build, out=io.StringIO())
    assert not built
    # The demo model's own kv_lora_rank (64) has no fp8_ds_mla layout: the demo uses 128.
    sizes = demo.model_sizes(demo.DemoOptions(kv_cache="fp8_ds_mla", batches=(2,), steps=3, prompt_len=4))
    assert sizes == {"max_batch": 2, "max_model_len": 7, "kv_lora_rank": 128}
    assert "kv_lora_rank" not in demo.model_sizes(demo.DemoOptions())
    assert demo.model_sizes(demo.DemoOptions(compare_caches=True, model_overrides={"kv_lora_rank": 256}))[
        "kv_lora_rank"] == 256


def test_cli_cache_options_reach_the_demo_options(monkeypatch):
    from graphsafe.__main__ import main

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda opts: seen.append(opts) or [])
    assert main(["demo", "--device", "cpu", "--kv-cache", "fp8_ds_mla"]) == 0
    assert main(["demo", "--device", "cpu", "--compare-caches"]) == 0
    assert main(["demo", "--device", "cpu"]) == 0
    assert [(o.kv_cache, o.compare_caches) for o in seen] == [("fp8_ds_mla", False), ("auto", True), ("auto", False)]


def test_compare_caches_feeds_the_bf16_runs_tokens_and_counts_agreement():
    """The fake model: the fp8_ds_mla run (another seed, so other picks) is fed the bf16
    run's prefill pick and eager picks in every mode; the comparison counts the picks of
    each of its rows equal to the bf16 eager picks at the same positions."""
    built = {}

    def build(device, dtype, seed, kv_cache_dtype="auto"):
        built[kv_cache_dtype] = CacheFakeModel(device, dtype, seed, kv_cache_dtype)
        return built[kv_cache_dtype], None

    opts = demo.DemoOptions(device="cpu", batches=(1, 3), steps=5, prompt_len=6, backend="aot_eager",
                            progress=False, compare_caches=True, modes=("eager", "compiled"))
    out = io.StringIO()
    rows = demo.run_demo(opts, build=build, out=out)
    text = out.getvalue()
    assert [(r.kv_cache, r.mode, r.batch) for r in rows] == [
        (k, m, b) for k in ("auto", "fp8_ds_mla") for m in ("eager", "compiled") for b in (1, 3)]
    assert demo.exit_code(rows) == 0
    by = {(r.kv_cache, r.mode, r.batch): r for r in rows}
    # Each run feeds 5 steps per row; the fp8 model's step 0 gets bf16's prefill pick.
    bf16, fp8 = built["auto"], built["fp8_ds_mla"]
    for i, b in enumerate((1, 3)):
        eager = by[("auto", "eager", b)].tokens
        for j, mode in enumerate(("eager", "compiled")):
            fed = fp8.fed[(2 * j + i) * 5:(2 * j + i + 1) * 5]
            assert torch.equal(torch.stack(fed[1:]), eager[:-1]), (mode, b)
            assert torch.equal(fed[0], bf16.fed[i * 5]), "step 0: the bf16 run's prefill pick"
    assert not torch.equal(by[("fp8_ds_mla", "eager", 3)].tokens, by[("auto", "eager", 3)].tokens)
    lines = text[text.index("KV cache comparison"):].splitlines()
    assert lines[2].split()[:5] == ["auto", "(bfloat16)", "288", "576", "18.6"]  # 576 B x 11 x 3 = 18.6 KiB
    assert lines[3].split()[:3] == ["fp8_ds_mla", "164", "328"] and lines[3].endswith("(0.57x)")
    assert "fp8_ds_mla picks = auto eager's" in lines[5]
    table = {(m.group(1), int(m.group(2))): m.group(3) for m in map(ROW.match, lines[7:]) if m}
    assert set(table) == {(m, b) for m in ("eager", "compiled") for b in (1, 3)}
    for (mode, b), cells in table.items():
        got, want = by[("fp8_ds_mla", mode, b)], by[("auto", "eager", b)].tokens
        equal = int((got.tokens == want).sum())
        c = cells.split()
        assert float(c[0]) == pytest.approx(by[("auto", mode, b)].step_ms, abs=1e-3)
        assert float(c[1]) == pytest.approx(got.step_ms, abs=1e-3)
        assert c[3] == f"{equal}/{5 * b}", cells
    assert text.count("MLA cache (") == 2 and "164 bytes per token per layer, 328 in all 2 layers" in text


@pytest.mark.skipif(not _real_model_available(), reason="graphsafe.models is not there yet")
def test_demo_with_the_fp8_cache_on_the_real_model():
    """`--kv-cache fp8_ds_mla`: the model gets kv_lora_rank 128 (the header says why), the
    header gives its 164-byte records per layer and in all layers, and the modes run as
    with the bf16 cache (aot_eager: eager's kernels, equal picks)."""
    opts = demo.DemoOptions(device="cpu", batches=(1, 2), steps=3, prompt_len=5, backend="aot_eager",
                            progress=False, modes=("eager", "compiled"), kv_cache="fp8_ds_mla")
    out = io.StringIO()
    rows = demo.run_demo(opts, out=out)
    text = out.getvalue()
    assert demo.exit_code(rows) == 0, text
    assert all(r.ok and r.kv_cache == "fp8_ds_mla" and r.agree in ("(reference)", "yes") for r in rows), text
    assert "kv_lora_rank=128," in text and "note: kv_lora_rank=128: the demo model's own 64 has no fp8_ds_mla" in text
    assert ("MLA cache (fp8_ds_mla records: 128 e4m3 latent bytes, 1 float32 scale, 16 bf16 rope values): "
            "164 bytes per token per layer, 328 in all 2 layers") in text


@pytest.mark.skipif(not _real_model_available(), reason="graphsafe.models is not there yet")
def test_cli_compare_caches_on_the_real_model(capsys):
    """`--compare-caches` through the command line: both tables, then the comparison with
    the two caches' bytes (288 / 164 a layer for R = 128, P = 16), sizes, step times and the
    fp8 run's agreement with the bf16 eager picks, one line per mode and batch."""
    from graphsafe.__main__ import main

    argv = ["demo", "--device", "cpu", "--batch", "1", "2", "--steps", "3", "--prompt-len", "5", "--backend",
            "aot_eager", "--mode", "eager", "--mode", "compiled", "--no-progress", "--compare-caches"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "MLA cache (auto: 128 + 16 values in bfloat16): 288 bytes per token per layer, 576 in all 2 layers" in text
    assert "164 bytes per token per layer, 328 in all 2 layers" in text
    lines = text[text.index("KV cache comparison"):].splitlines()
    assert "(8 x 2)" in lines[1]
    assert lines[2].split()[:5] == ["auto", "(bfloat16)", "288", "576", "9.0"]  # 576 B x 8 x 2
    assert lines[3].split()[:4] == ["fp8_ds_mla", "164", "328", "5.1"] and lines[3].endswith("(0.57x)")
    table = {(m.group(1), int(m.group(2))): m.group(3).split() for m in map(ROW.match, lines[7:]) if m}
    assert set(table) == {(m, b) for m in ("eager", "compiled") for b in (1, 2)}
    for (mode, b), cells in table.items():
        assert float(cells[0]) > 0 and float(cells[1]) > 0
        equal, total = map(int, cells[3].split("/"))
        # e4m3 flips a pick only at a close call of the random model's top two logits.
        assert total == 3 * b and equal >= total - 1, cells
