"""A/B of two choices of the sm_90 TMA prefill kernels on the GPU, on the same inputs:

* `--knob schedule`: the static deal (program p takes tiles p, p + programs, ...) against
  work tiles claimed one at a time from a ticket counter (whichever program is free takes
  the next), `plan.tma_claims_tiles`;
* `--knob store`: each consumer's output by `gl.store` from the accumulator's layout
  against a TMA store of its full 64-row blocks through a shared-memory staging buffer
  (in two halves at D 192 / 256), `plan.TMA_STORE` (where the plan finds room for the
  buffers; elsewhere both run the same);
* `--knob section`: every head of a sequence in one section of work tiles against
  sections of 32 and 16 MiB of K/V, `plan.L2_SECTION_BYTES` (where the K/V of all kv
  heads fits in a section, the choices run the same).

Each row also names the plan's own pick there.

    python benchmarks/prefill_tma_ab.py [--knob schedule|store|section] [--rounds 3] [--only TEXT ...]

Rows: `flash_attn_varlen` bf16 causal at the bench's default shapes (8 x 2048, 8 x 4096,
4 x 8192 with 32/8 heads, D 128; 8 x 4096 with 16/16 heads, D 192 / Dv 128), the full
sweep's and the variants' head dims (8 x 4096 with 64/8 heads at D 64 and 32/32 at D 128;
4 x 4096 with 16/8 at D 256), 2 x 16384 at 32/8 and 32/32 heads (D 128), a batch of
uneven sequences (16 prompts of 256 to 15360 tokens, 61568 in all), the fp8 path at 8 x 4096 (32/8 and 32/32 heads),
and `paged_attention_prefill` 8 x 512 new tokens over 4096 (blocks of 16 and 64). Each
runner is captured in a CUDA graph; the two choices' replays alternate `--rounds` times
(medians of `graphsafe.bench.harness.time_ms`); printed: the median of those per choice,
its ratio to the first's, the max |difference| of the outputs from the first's (0: the
schedule does not change which program computes a row's bits, nor the store its values),
and every round (their spread is the noise a ratio is read against). `--only`: the rows
whose label contains one of the texts.
Needs an sm_90 GPU with Gluon.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import graphsafe
from graphsafe.bench.harness import time_ms
from graphsafe.ops.attention import plan as P
from graphsafe.ops.attention import triton as T
from graphsafe.ops.attention.bench import _paged_prefill_inputs
from graphsafe.workspace.manager import current_workspace_manager

CUDA = torch.device("cuda")
UNEVEN = (7936, 256, 3072, 512, 6144, 1024, 2048, 4096, 768, 5120, 1536, 7168, 384, 2560, 3584, 15360)


def _varlen_args(lens, hq, hk, d, dv, fp8=False):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, hq, d, device=CUDA, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(t, hk, d, device=CUDA, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(t, hk, dv, device=CUDA, dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, *lens], device=CUDA).cumsum(0).to(torch.int32)
    n = max(lens)
    return (q, k, v, cu, cu, n, n, d**-0.5, True, None, None, None, "on" if fp8 else "off")


def _graphed(runner, args):
    """(replay, output) of `runner(*args)` captured in a CUDA graph after a warm-up call."""
    runner(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner(*args)
    return graph, out


def _set_schedule(claim: bool):
    P.tma_claims_tiles = lambda group, d, fp8=False, paged=False: claim


def _set_store(on: bool):
    P.TMA_STORE = on


def _set_section(size: int | None):
    P.L2_SECTION_BYTES = size


# knob: (its choices, label -> the value set, the function setting it)
KNOBS = {"schedule": ({"static": False, "claimed": True}, _set_schedule),
         "store": ({"gl.store": False, "TMA store": True}, _set_store),
         "section": ({"one section": None, "32 MiB sections": 32 * 2**20, "16 MiB sections": 16 * 2**20},
                     _set_section)}


def _planned(knob: str, op: str, call) -> str:
    """The label of the plan's own choice for `call`."""
    labels = list(KNOBS[knob][0])
    if op == "paged_attention_prefill":
        gluon = P.choose_paged_attention_prefill(call).gluon
    else:
        gluon = P.choose_flash_attn_varlen(call).gluon
    if gluon is None:
        return "no Gluon kernel"
    if knob == "store":
        return labels[gluon.out_buffers > 0]
    if knob == "section":
        return next((label for label, size in KNOBS[knob][0].items() if size == P.L2_SECTION_BYTES),
                    f"{P.L2_SECTION_BYTES} bytes")
    q, k = call.q, call.k if op == "flash_attn_varlen" else call.k_cache
    fp8 = gluon.kernel == "tma-fp8"
    return labels[P.tma_claims_tiles(q.shape[1] // k.shape[-2], q.shape[2], fp8, op == "paged_attention_prefill")]


def _ab(knob: str, op: str, args, rounds: int) -> str:
    call = graphsafe.get_op(op).call(*args)
    paged = op == "paged_attention_prefill"
    prepare = T.prepare_paged_attention_prefill if paged else T.prepare_flash_attn_varlen
    planned = _planned(knob, op, call)
    choices, setter = KNOBS[knob]
    saved = (P.tma_claims_tiles, P.TMA_STORE, P.L2_SECTION_BYTES)
    graphs = {}
    try:
        for label, value in choices.items():
            setter(value)
            graphs[label] = _graphed(prepare(call), args)
    finally:
        P.tma_claims_tiles, P.TMA_STORE, P.L2_SECTION_BYTES = saved
    times = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, (graph, _) in graphs.items():
            times[label].append(time_ms(graph.replay, CUDA))
    for graph, _ in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    outs = {label: out for label, (_, out) in graphs.items()}
    graph = None
    graphs.clear()  # the row's graphs destroyed: the next row's workspace may grow
    current_workspace_manager(CUDA).forget_captures()
    first = list(outs)[0]
    base = statistics.median(times[first])
    parts = []
    for label, out in outs.items():
        ms = statistics.median(times[label])
        diff = (out.float() - outs[first].float()).abs().max().item()
        parts.append(f"{label} {ms:.4f} ms ({ms / base:.3f}, diff {diff:.3g})")
    rounds_text = " ".join("/".join(f"{times[label][i]:.4f}" for label in outs) for i in range(rounds))
    return f"plan: {planned} | " + " | ".join(parts) + f" | rounds ({'/'.join(outs)}) {rounds_text}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--knob", choices=tuple(KNOBS), default="schedule")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="rows whose label contains one of these")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and P.is_sm90(CUDA) and P.gluon_module() is not None):
        print("needs an sm_90 GPU and a Triton with Gluon: nothing measured")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = [
        ("varlen 8 x 2048, 32/8 heads, D 128", "flash_attn_varlen", _varlen_args([2048] * 8, 32, 8, 128, 128)),
        ("varlen 8 x 4096, 32/8 heads, D 128", "flash_attn_varlen", _varlen_args([4096] * 8, 32, 8, 128, 128)),
        ("varlen 4 x 8192, 32/8 heads, D 128", "flash_attn_varlen", _varlen_args([8192] * 4, 32, 8, 128, 128)),
        ("varlen 8 x 4096, 16/16 heads, D 192/128", "flash_attn_varlen", _varlen_args([4096] * 8, 16, 16, 192, 128)),
        ("varlen 8 x 4096, 64/8 heads, D 64", "flash_attn_varlen", _varlen_args([4096] * 8, 64, 8, 64, 64)),
        ("varlen 4 x 4096, 16/8 heads, D 256", "flash_attn_varlen", _varlen_args([4096] * 4, 16, 8, 256, 256)),
        ("varlen 8 x 4096, 32/32 heads, D 128", "flash_attn_varlen", _varlen_args([4096] * 8, 32, 32, 128, 128)),
        ("varlen 2 x 16384, 32/8 heads, D 128", "flash_attn_varlen", _varlen_args([16384] * 2, 32, 8, 128, 128)),
        ("varlen 2 x 16384, 32/32 heads, D 128", "flash_attn_varlen", _varlen_args([16384] * 2, 32, 32, 128, 128)),
        (f"varlen {len(UNEVEN)} uneven ({min(UNEVEN)}-{max(UNEVEN)}), 32/8 heads, D 128", "flash_attn_varlen",
         _varlen_args(list(UNEVEN), 32, 8, 128, 128)),
        ("varlen fp8 8 x 4096, 32/8 heads, D 128", "flash_attn_varlen",
         _varlen_args([4096] * 8, 32, 8, 128, 128, fp8=True)),
        ("varlen fp8 8 x 4096, 32/32 heads, D 128", "flash_attn_varlen",
         _varlen_args([4096] * 8, 32, 32, 128, 128, fp8=True)),
        ("paged 8 x 512 over 4096, block 16", "paged_attention_prefill",
         _paged_prefill_inputs(8, 512, 4096, CUDA, block_size=16)),
        ("paged 8 x 512 over 4096, block 64", "paged_attention_prefill",
         _paged_prefill_inputs(8, 512, 4096, CUDA, block_size=64)),
    ]
    for label, op, op_args in rows:
        if args.only and not any(text in label for text in args.only):
            continue
        print(f"{label}: {_ab(args.knob, op, op_args, args.rounds)}", flush=True)
        del op_args
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
