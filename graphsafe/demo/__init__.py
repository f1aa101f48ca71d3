"""`python -m graphsafe demo`: greedy decoding with the DeepSeek-V3.2-style demo model in
three modes, and one table comparing them.

For every batch size, each mode starts from the same prompts (random token ids from a
seeded generator), prefills them eagerly, then decodes `--steps` tokens greedily:

    eager             the model's decode step as Python calls the ops
    compiled          torch.compile(fullgraph=True, dynamic=True) of the same step
    compiled+graphs   the compiled step captured into one CUDA graph per batch bucket
                      (graphsafe.graphs.GraphRunner; CUDA only)

The step that every mode runs is `decode_step(inputs).argmax(-1)`: greedy sampling sits
inside the compiled / captured region, so a replay hands back the next tokens and
nothing else. Per row the table gives the median step latency (the first `--warmup`
steps, where compilation, Triton JIT and autotuning happen, are left out), tokens/s,
graph breaks and recompiles seen by dynamo, host syncs and caching-allocator allocations
per step (CUDA only: sync-debug "warn" warnings and `memory_stats` counters, for the
forward alone and for the whole step with the metadata build), the one-off set-up time
(compile or capture) and whether each mode's greedy picks equal eager's: every mode is
fed eager's tokens (teacher forcing), so one pick flipped at a near-tie of the logits
stays one pick instead of forking the rest of the sequence.

The latent MLA cache is the model dtype's (`--kv-cache auto`) or DeepSeek's FP8 record
(`--kv-cache fp8_ds_mla`; the model then has kv_lora_rank 128, since the demo model's 64
has no record layout); the table's header gives its bytes per token, per layer and in
all layers. `--compare-caches` runs the modes with both caches on the same prompts and
weights, the fp8_ds_mla run fed the bf16 run's picks, and adds a table of bytes per
token, cache size, step times and greedy agreement (`format_cache_comparison`).

Modules: `options` (options, rows, checks), `measure` (counters, progress, one mode's
decode), `table` (the printed tables and the plot), `parallel` (`--tp`), `run` (the modes,
the cache comparison, capture).
"""

# `_agreement` too: tests check the agreement strings.
from graphsafe.demo.measure import Progress, _agreement, greedy_with_near_ties
from graphsafe.demo.options import (
    FP8_CACHE_KV_LORA_RANK, GRAPHS, KV_CACHES, MODES, DemoError, DemoOptions, Row, check_plot_available,
    default_options, exit_code, model_sizes, parse_override, uses_fp8_cache,
)
from graphsafe.demo.parallel import allreduce_ms
from graphsafe.demo.run import run_demo
from graphsafe.demo.table import format_cache_comparison, format_table, plot_rows

__all__ = [
    "MODES", "GRAPHS", "KV_CACHES", "FP8_CACHE_KV_LORA_RANK", "DemoError", "DemoOptions", "Row", "Progress",
    "default_options", "run_demo", "format_table", "format_cache_comparison", "plot_rows", "parse_override",
    "exit_code", "model_sizes", "uses_fp8_cache", "greedy_with_near_ties", "allreduce_ms", "check_plot_available",
]
