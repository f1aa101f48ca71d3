"""The demo's options, rows and the checks of both (see graphsafe.demo)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphsafe.errors import GraphsafeError


MODES = ("eager", "compiled", "compiled+graphs")


GRAPHS = "compiled+graphs"


# The latent MLA cache kinds (`ModelConfig.kv_cache_dtype`): the model dtype, DeepSeek's FP8 record.
KV_CACHES = ("auto", "fp8_ds_mla")

# The demo models: DeepSeek-V3.2-style (`graphsafe.models.build_demo_model`) and
# DeepSeek-V4-style (`graphsafe.models.dsv4.build_dsv4_demo_model`; its caches are set with
# `--model kv_cache_dtype=fp8_dsv4|bf16`, `--kv-cache` stays auto).
MODEL_FAMILIES = ("deepseek_v32", "deepseek_v4")


# fp8_ds_mla keeps one float32 scale per 128 latent values: the demo model's kv_lora_rank
# (64) has no record layout, so a run with that cache builds the model with this one.
FP8_CACHE_KV_LORA_RANK = 128


class DemoError(GraphsafeError):
    """The demo cannot run as asked (a missing optional package, bad options)."""


@dataclass
class DemoOptions:
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 4)
    steps: int = 16
    prompt_len: int = 16
    backend: str = "inductor"
    warmup: int = 2
    seed: int = 0
    modes: tuple[str, ...] = MODES
    dtype: torch.dtype = torch.bfloat16
    plot: str | None = None
    progress: bool = True
    # Tests: off CUDA, run the graph mode through GraphRunner(emulate=True) (no graphs,
    # the same bucketing, padding and static outputs) instead of printing "n/a".
    emulate_graphs: bool = False
    # CPU intra-op threads during the run (restored after). The demo model's matrices
    # are a few hundred wide: OpenMP fork/join costs more than it saves, and on a shared
    # machine spinning threads stall for milliseconds. 0 leaves torch's setting.
    threads: int = 1
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # Tensor-parallel ranks (one process each, started by torchrun): each rank runs its
    # shard (graphsafe.models.parallel); picks are compared with a one-device model of the
    # same weights that every rank also runs eagerly.
    tp: int = 1
    # The latent MLA cache: "auto" (the model dtype) or "fp8_ds_mla" (656 bytes a token for
    # DeepSeek). With either fp8_ds_mla or `compare_caches`, kv_lora_rank is 128 unless
    # `model_overrides` names a multiple of 128 (the demo model's 64 has no record layout).
    kv_cache: str = "auto"
    # Run the modes with both caches on the same prompts and weights (bf16 first; every
    # fp8_ds_mla row is fed the bf16 run's picks) and print a comparison table after the two
    # tables. `kv_cache` is then not used.
    compare_caches: bool = False
    model_family: str = "deepseek_v32"  # MODEL_FAMILIES


def default_options(device: str) -> DemoOptions:
    """Defaults that finish in well under a minute on a 2-core CPU; on a GPU, the decode
    benchmark of issue 5 (B = 1, 8, 64, contexts growing to 4096 tokens); both with
    DeepSeek-V3.2's index_topk of 2048. The demo model's own 16 would keep 16 of 4096 tokens: fp8
    near-ties in the indexer then swap a token carrying 1/16 of the attention whenever
    compiled code rounds the indexer's query differently, and about a fifth of the greedy
    picks of this random model flipped against eager in the first GPU run."""
    if device == "cuda":
        return DemoOptions(
            device="cuda", batches=(1, 8, 64), steps=64, prompt_len=4096 - 64, warmup=4,
            model_overrides={"index_topk": 2048},
        )
    # The CPU too: with the model's own 16 the selection drops tokens after 16 of the 32
    # positions, and fp8 near-ties in the indexer then flip picks by more than rounding.
    return DemoOptions(device="cpu", model_overrides={"index_topk": 2048})


@dataclass
class Row:
    mode: str
    batch: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    graph_breaks: int | None = None
    recompiles: int | None = None
    syncs_fwd: float | None = None
    syncs_step: float | None = None
    allocs_fwd: float | None = None
    allocs_step: float | None = None
    setup_s: float | None = None
    allreduce_ms: float | None = None  # tensor parallel: the step's all-reduces alone
    kv_cache: str = "auto"  # the latent cache kind of the run (KV_CACHES)
    agree: str = ""
    note: str = ""  # why a row has no numbers ("n/a (no CUDA)", an error)
    tokens: torch.Tensor | None = field(default=None, repr=False)  # [steps, batch] on the CPU

    @property
    def ok(self) -> bool:
        return not self.note.startswith("error")


def model_sizes(opts: DemoOptions) -> dict[str, Any]:
    """Model sizes the run needs (user overrides win): room for the largest batch, and a
    context just long enough for the prompt plus the decoded tokens (the indexer's decode
    logits are `max_model_len` wide, so a tight bound keeps the step honest and small);
    with an fp8_ds_mla cache (`uses_fp8_cache`), kv_lora_rank FP8_CACHE_KV_LORA_RANK."""
    sizes: dict[str, Any] = {"max_batch": max(opts.batches), "max_model_len": opts.prompt_len + opts.steps}
    if uses_fp8_cache(opts):
        sizes["kv_lora_rank"] = FP8_CACHE_KV_LORA_RANK
    return {**sizes, **opts.model_overrides}


def uses_fp8_cache(opts: DemoOptions) -> bool:
    """Whether some run of the demo builds the model with the fp8_ds_mla cache."""
    return opts.compare_caches or opts.kv_cache == "fp8_ds_mla"


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise DemoError(
            "--plot needs matplotlib, an optional extra: pip install 'graphsafe[plot]' (or pip install matplotlib)"
        ) from err


def measured_steps(opts: DemoOptions) -> range:
    """The steps (0-based) behind the latency median: all but the first `warmup`, at
    least the last one."""
    return range(min(opts.warmup, opts.steps - 1), opts.steps)


def check_model_overrides(overrides: dict[str, Any]) -> None:
    """Refuse a `--model` field the demo model does not have, naming the closest one
    (`num_hidden_layer` -> num_hidden_layers), before any work."""
    from graphsafe.models.demo import DEMO_MODEL_FIELDS, unknown_override

    for key, value in overrides.items():
        if key == "tp":
            raise DemoError(f"--model tp={value}: tensor parallelism is the demo's --tp option")
        why = unknown_override(key, tuple(f for f in DEMO_MODEL_FIELDS if f != "tp"))
        if why:
            raise DemoError(f"--model {key}={value}: {why}")


def _validate(opts: DemoOptions, device: torch.device, default_build: bool = True) -> None:
    """Refuse options the run cannot honour, before any work. `default_build`: the demo
    model is graphsafe's (its `--model` fields are known); a caller's `build` takes its
    own."""
    if default_build:
        check_model_overrides(opts.model_overrides)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device here")
    unknown = [m for m in opts.modes if m not in MODES]
    if unknown or not opts.modes:
        raise DemoError(f"modes: expected some of {list(MODES)}, got {list(opts.modes)}")
    if opts.tp < 1:
        raise DemoError(f"--tp: expected a positive number of ranks, got {opts.tp}")
    if opts.model_family not in MODEL_FAMILIES:
        raise DemoError(f"--model-family: expected one of {list(MODEL_FAMILIES)}, got {opts.model_family!r}")
    if opts.model_family == "deepseek_v4" and (opts.kv_cache != "auto" or opts.compare_caches or opts.tp > 1):
        raise DemoError("--model-family deepseek_v4 runs on one device with its own caches: leave out --kv-cache, "
                        "--compare-caches and --tp (set the cache with --model kv_cache_dtype=fp8_dsv4|bf16)")
    if opts.kv_cache not in KV_CACHES:
        raise DemoError(f"--kv-cache: expected one of {list(KV_CACHES)}, got {opts.kv_cache!r}")
    if opts.compare_caches and opts.tp > 1:
        raise DemoError("--compare-caches runs on one device: leave out --tp")
    if uses_fp8_cache(opts):
        _validate_fp8_layout(opts.model_overrides)
    if not opts.batches or min(opts.batches) < 1 or opts.steps < 1 or opts.prompt_len < 1:
        raise DemoError("batch sizes, steps and the prompt length must be positive")
    if opts.plot:
        check_plot_available()  # before any work


def _validate_fp8_layout(overrides: dict[str, Any]) -> None:
    """The fp8_ds_mla record needs kv_lora_rank a multiple of 128 and an even rope width:
    refuse overrides without a layout before building anything."""
    rank = overrides.get("kv_lora_rank", FP8_CACHE_KV_LORA_RANK)
    rope = overrides.get("qk_rope_head_dim", 0)
    if not isinstance(rank, int) or rank <= 0 or rank % FP8_CACHE_KV_LORA_RANK:
        raise DemoError(
            f"the fp8_ds_mla cache needs kv_lora_rank a multiple of {FP8_CACHE_KV_LORA_RANK} (one float32 scale "
            f"per {FP8_CACHE_KV_LORA_RANK} latent values), got --model kv_lora_rank={rank}; without the override "
            f"the demo uses {FP8_CACHE_KV_LORA_RANK}"
        )
    if not isinstance(rope, int) or rope % 2:
        raise DemoError(f"the fp8_ds_mla cache needs an even qk_rope_head_dim, got --model qk_rope_head_dim={rope}")


def parse_override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--model`: ints, floats, true/false, else the string."""
    if "=" not in text:
        raise DemoError(f"--model expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def exit_code(rows: Sequence[Row]) -> int:
    """1 when a mode failed, or when graph replays gave other tokens than the compiled
    step they captured; else 0. Compiled tokens may legitimately drift from eager's
    (fused bf16 arithmetic can flip a near-tie in the argmax): the table reports it."""
    bad = [r for r in rows if not r.ok or r.agree.endswith("= compiled: NO")]
    return 1 if bad else 0
