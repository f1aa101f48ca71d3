"""The demo's output: the table of a run, the cache comparison, the plot (see graphsafe.demo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphsafe.demo.options import (
    DemoOptions, FP8_CACHE_KV_LORA_RANK, KV_CACHES, MODES, Row, check_plot_available, measured_steps,
    uses_fp8_cache,
)


def _fp8_rank_note(opts: DemoOptions, default_build: bool) -> list[str]:
    """The header's note when the demo changed the model's kv_lora_rank for the fp8 cache."""
    if not (default_build and uses_fp8_cache(opts)) or "kv_lora_rank" in opts.model_overrides:
        return []
    both = " (both caches run this model)" if opts.compare_caches else ""
    return [f"note: kv_lora_rank={FP8_CACHE_KV_LORA_RANK}{both}: the demo model's own 64 has no fp8_ds_mla record "
            f"layout (one float32 scale per {FP8_CACHE_KV_LORA_RANK} latent values)"]


def _config(model: Any) -> Any:
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def _describe(model: Any) -> str:
    cfg = _config(model)
    names = ("num_layers", "hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "index_n_heads",
             "index_head_dim", "index_topk", "vocab_size")
    parts = [f"{n}={getattr(cfg, n)}" for n in names if hasattr(cfg, n)]
    for n in ("max_batch", "max_model_len", "block_size"):
        if hasattr(model, n):
            parts.append(f"{n}={getattr(model, n)}")
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        parts.append(f"tensor parallel over {tp.size} ranks (num_heads is per rank)")
    return ", ".join(parts) or repr(cfg)


# -- output ------------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"cpu (torch {torch.__version__})"


def _steps(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _pair(fwd: float | None, step: float | None) -> str:
    if fwd is None:
        return "n/a"
    return f"{fwd:g} / {step:g}"


COLUMNS = [
    ("mode", 15), ("batch", 5), ("step ms", 9), ("tokens/s", 10), ("breaks", 6), ("recompiles", 10),
    ("syncs fwd/step", 14), ("allocs fwd/step", 15), ("setup s", 7), ("picks = eager", 0),
]


def format_table(rows: Sequence[Row], opts: DemoOptions, device: torch.device, build_s: float = 0.0,
                 model: Any = None, legend: bool = True, notes: Sequence[str] = ()) -> str:
    """The demo's table: the run, the model and its MLA cache's bytes per token (per
    layer and in all layers), `notes`, one line per (mode, batch), then what the
    columns mean."""
    timed = measured_steps(opts)
    lines = [
        f"graphsafe demo on {_device_name(device)}: prompt {opts.prompt_len} tokens, {opts.steps} greedy steps "
        f"(step ms: the median of {_steps(len(timed))}, {timed.start + 1}..{opts.steps}; "
        f"{_steps(timed.start)} of warm-up left out), compile backend {opts.backend}, model built in {build_s:.1f} s",
    ]
    if model is not None:
        lines.append(f"model: {_describe(model)}")
        cache = _cache_line(model)
        if cache:
            lines.append(cache)
    lines += list(notes)
    parallel = any(r.allreduce_ms is not None for r in rows)
    columns = COLUMNS[:-1] + ([("all-reduce ms (share)", 21), ("picks = one-device eager", 0)] if parallel
                              else COLUMNS[-1:])
    header = " ".join(f"{name:<{w}}" if w else name for name, w in columns)
    lines += [header, "-" * len(header)]
    for r in rows:
        if r.step_ms is None:
            cells = [r.mode, str(r.batch), r.note]
            lines.append(f"{cells[0]:<15} {cells[1]:<5} {cells[2]}")
            continue
        cells = [
            r.mode, str(r.batch), _num(r.step_ms, ".3f"), _num(r.tokens_per_s, ".1f"),
            "-" if r.graph_breaks is None else str(r.graph_breaks),
            "-" if r.recompiles is None else str(r.recompiles),
            _pair(r.syncs_fwd, r.syncs_step), _pair(r.allocs_fwd, r.allocs_step),
            "-" if r.setup_s is None else f"{r.setup_s:.1f}",
        ]
        if parallel:
            cells.append("-" if r.allreduce_ms is None else f"{r.allreduce_ms:.3f} ({r.allreduce_ms / r.step_ms:.0%})")
        cells.append(r.agree)
        lines.append(" ".join(f"{c:<{w}}" if w else c for c, (_, w) in zip(cells, columns)))
    if not legend:
        return "\n".join(lines)
    lines += [
        "",
        "step ms: median wall time of a whole step over the steps the header names (metadata build, forward",
        "  with greedy argmax, state advance, device synchronised at the end). breaks / recompiles: dynamo graph",
        "  breaks and graphs compiled beyond the first (fullgraph=True, dynamic=True). syncs, allocs: per step,",
        "  over the same steps, host syncs (sync-debug warn) and caching-allocator allocations, for the forward",
        "  alone / the whole step (CUDA only). setup s: compile (first step) or warm-up + capture of every",
        "  bucket. picks = eager: every mode is fed eager's tokens",
        "  (teacher forcing) and its greedy picks are compared with eager's. Compiled code rounds bf16 differently",
        "  (fused ops, ~1 ulp); the logits come out of a bf16 lm_head (0.0625 apart near 10), so this random",
        "  model's top two often tie within an ulp and a pick can flip: \"near-tie\" means every flip is at a",
        "  position where eager's or this mode's top two logits are within 4 * 2^-8 of the top one (two bf16",
        "  ulps); \"NO\" counts the flips that are not. Graphs replay the compiled kernels: at a bucket's own",
        "  batch size, picks equal compiled's.",
    ]
    if parallel:
        lines += [
            "Tensor parallel: every mode, eager included, is fed and compared with the picks of a one-device",
            "  model of the same weights run eagerly on each rank. all-reduce ms: the step's all-reduces (two a",
            "  layer, [batch, hidden]) timed alone, eagerly or replayed from a CUDA graph as the mode runs them,",
            "  and their share of the step's median.",
        ]
    return "\n".join(lines)


def _cache_line(model: Any) -> str | None:
    """"MLA cache: <kind> (<row layout>): N bytes per token per layer, M in all L layers"
    for a model with `cache_bytes_per_token` (None otherwise)."""
    describe = getattr(model, "cache_description", None)  # a model that describes its own caches
    if describe is not None:
        return describe()
    per_token = getattr(model, "cache_bytes_per_token", None)
    cfg = _config(model)
    if per_token is None or cfg is None:
        return None
    total, layers = per_token(), cfg.num_layers
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.kv_cache_dtype == "fp8_ds_mla":
        scales = r // 128
        layout = (f"fp8_ds_mla records: {r} e4m3 latent bytes, {scales} float32 scale{'s' * (scales > 1)}, "
                  f"{p} bf16 rope values")
    else:
        layout = f"auto: {r} + {p} values in {str(model.dtype).removeprefix('torch.')}"
    return f"MLA cache ({layout}): {total // layers} bytes per token per layer, {total} in all {layers} layers"


def _size(nbytes: float) -> str:
    """Bytes in B, KiB, MiB or GiB (the largest unit that keeps the number >= 1)."""
    units, power = ("B", "KiB", "MiB", "GiB"), 0
    while nbytes >= 1024 and power < len(units) - 1:
        nbytes /= 1024
        power += 1
    return f"{nbytes:.0f} B" if power == 0 else f"{nbytes:.1f} {units[power]}"


def _picks_equal(tokens: torch.Tensor | None, reference: torch.Tensor) -> str:
    if tokens is None:
        return "-"
    equal = int((tokens == reference).sum())
    return f"{equal}/{tokens.numel()} ({equal / tokens.numel():.0%})"


def format_cache_comparison(runs: Sequence[Any]) -> str:
    """`--compare-caches`' table: per cache kind, the MLA cache's bytes per token (a layer,
    all layers) and its size at max_model_len x max_batch tokens; per (mode, batch), each
    cache's median step ms, their ratio, and how many of the fp8_ds_mla run's greedy picks
    equal the bf16 run's (both fed the bf16 run's picks). `runs`: the bf16 run, then fp8_ds_mla."""
    base, other = runs
    layers = _config(base.model).num_layers
    tokens = base.model.max_model_len * base.model.max_batch
    lines = [
        f"KV cache comparison: same weights and prompts; every {other.kind} row is fed the {base.kind} run's picks",
        f"{'cache':<17} {'bytes/token/layer':<18} {f'bytes/token ({layers} layers)':<24} "
        f"cache at max_model_len x max_batch ({base.model.max_model_len} x {base.model.max_batch})",
    ]
    base_bytes = base.model.cache_bytes_per_token()
    for run in runs:
        per_token = run.model.cache_bytes_per_token()
        ratio = "" if run is base else f" ({per_token / base_bytes:.2f}x)"
        name = f"{run.kind} ({str(run.model.dtype).removeprefix('torch.')})" if run.kind == "auto" else run.kind
        lines.append(f"{name:<17} {per_token // layers:<18} {per_token:<24} {_size(per_token * tokens)}{ratio}")
    ref_modes = sorted({mode for mode, _ in base.fed.values()})
    header = (f"{'mode':<15} {'batch':<5} {f'{base.kind} ms':<9} {f'{other.kind} ms':<14} {'ratio':<6} "
              f"{other.kind} picks = {base.kind} {'/'.join(ref_modes)}'s")
    lines += ["", header, "-" * len(header)]
    by_mode = {(r.mode, r.batch): r for r in other.rows}
    for r in base.rows:
        o = by_mode[(r.mode, r.batch)]
        if r.step_ms is None or o.step_ms is None:
            lines.append(f"{r.mode:<15} {r.batch:<5} {r.note or o.note}")
            continue
        agree = _picks_equal(o.tokens, base.fed[r.batch][1])
        lines.append(f"{r.mode:<15} {r.batch:<5} {r.step_ms:<9.3f} {o.step_ms:<14.3f} "
                     f"{o.step_ms / r.step_ms:<6.2f} {agree}")
    lines += [
        "",
        "bytes: the latent MLA cache only (the indexer's fp8 keys are the same for both). ms: median step, as",
        f"  above. picks: the {other.kind} run's greedy picks equal to the {base.kind} run's at the same",
        "  positions (teacher forcing). e4m3 rounds each latent value by up to 2^-4 of it; a pick flips where",
        "  the top two logits are closer than that moves them (README, \"FP8 MLA cache\").",
    ]
    return "\n".join(lines)


def plot_rows(rows: Sequence[Row], path: str, title: str = "graphsafe demo") -> None:
    """Step latency per mode against the batch size, to `path` (png, svg, pdf...)."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    kinds = [k for k in KV_CACHES if any(r.kv_cache == k for r in rows)]
    for kind in kinds:
        for mode in MODES:
            points = sorted((r.batch, r.step_ms) for r in rows
                            if r.mode == mode and r.kv_cache == kind and r.step_ms is not None)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", linestyle="-" if kind == kinds[0] else "--",
                        label=mode if len(kinds) == 1 else f"{mode}, {kind} cache")
    ax.set_xscale("log", base=2)
    batches = sorted({r.batch for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size")
    ax.set_ylabel("step latency, median (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
