"""`python -m graphsafe soak`: the demo model under changing load. On the CPU (no graphs,
no second stream) at a small size; on a GPU (marker gpu) with graphs and the prefill
overlapping decode on a second stream."""

from __future__ import annotations

import io
import json

import pytest
import torch

from graphsafe.demo import soak
from graphsafe.graphs import buckets_up_to

HAS_CUDA = torch.cuda.is_available()


def _run(**kw):
    out = io.StringIO()
    result = soak.run_soak(soak.SoakOptions(progress=False, **kw), out)
    return result, out.getvalue()


def test_soak_on_the_cpu_runs_every_bucket_and_matches_an_eager_rerun():
    opts = soak.SoakOptions()
    result, text = _run(device="cpu")
    assert result.ok, text
    assert result.steps == opts.steps and result.episodes >= 2
    assert set(result.batch_sizes) == set(range(1, opts.max_batch + 1)), "every bucket and the sizes above them"
    assert set(result.replays_per_bucket) == set(buckets_up_to(opts.max_batch))
    assert all(n > 0 for n in result.replays_per_bucket.values()), result.replays_per_bucket
    assert sum(result.replays_per_bucket.values()) == opts.steps
    assert result.prefills == result.episodes and result.context_max > 16, "some prefills take the sparse path"
    assert result.checked_episodes == opts.checks and result.checked_logits >= opts.checks
    assert result.workspace_start == result.workspace_end and result.workspace_end[1][0] > 0, "lane 1 was used"
    assert "no CUDA: no graphs" in text and "no second stream" in text and "result: ok" in text, text


def test_soak_finds_a_prefill_writing_the_blocks_of_the_decoding_states(monkeypatch):
    """The check is not a tautology: states handing out the same blocks let each prefill
    overwrite the cache the previous episode decodes from, and the eager rerun (alone)
    disagrees with the replays."""
    monkeypatch.setattr(soak, "_state_blocks", lambda model, parity: range(model.num_blocks))
    result, text = _run(device="cpu", steps=16)
    assert not result.ok and result.mismatches, text
    assert "MISMATCHES" in text and "result: FAILED" in text


def test_cli_soak_writes_json_and_refuses_bad_options(tmp_path, capsys):
    from graphsafe.__main__ import main

    path = tmp_path / "soak.json"
    assert main(["soak", "--device", "cpu", "--steps", "10", "--decode", "2", "4", "--checks", "2", "--no-progress",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["ok"] and data["steps"] == 10 and data["checked_episodes"] == 2
    assert "graphsafe soak on cpu" in capsys.readouterr().out
    for bad, message in ((["--checks", "0"], "--checks"), (["--model", "max_batch=8"], "--max-batch"),
                         (["--model", "num_hidden_layer=1"], "did you mean num_hidden_layers"),
                         (["--decode", "5", "2"], "min <= max")):
        assert main(["soak", "--device", "cpu", "--no-progress", *bad]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_soak_on_the_gpu_replays_graphs_with_flat_memory_and_no_allocations():
    result, text = _run(device="cuda", steps=600, max_batch=16, max_prompt=128, min_decode=8, max_decode=32, checks=3)
    assert result.ok, text
    assert result.graphs and result.streams == 2
    assert result.allocations == 0 and result.syncs == 0, text
    assert result.memory_start["allocated"] == result.memory_end["allocated"], text
    assert all(n > 0 for n in result.replays_per_bucket.values()), text
