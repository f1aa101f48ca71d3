"""A/B of the sm_90 TMA prefill kernels' tiles at a head dim (what `plan.tma_key_tile` and
`plan.tma_q_buffers` were decided from), on the GPU:

* `--head-dim 64` (gpt-oss-120b: 64/8 heads): `flash_attn_varlen` 8 x 4096 causal on the
  one-partition "wgmma" kernel, the Triton kernel and the TMA kernel with 64- and 128-key
  tiles, plain and with sinks + a 128-token window; `paged_attention_prefill` 8 x 512 new
  tokens over 4096 (blocks of 16 and 64) on the Triton kernel and the TMA kernel;
* `--head-dim 256` (Gemma-2: 16/8 heads): varlen 4 x 4096 and paged 8 x 512 over 4096 on the
  Triton kernels and the TMA kernels with 64-key tiles and one q buffer (two consumer /
  loader register splits), plain and with a 4095-token window + softcap 50; gather +
  varlen beside the paged rows.

Prints ms (medians of `triton.testing.do_bench`) and each TMA launch's max |difference|
from the Triton kernel on the same inputs. Needs an sm_90 GPU with Gluon.
Results: benchmarks/results/h200/2026-11-29-0317_d64_tma_ab.txt, ..._0340_d256_tma_ab.txt.
"""

from __future__ import annotations

import argparse
import sys

import torch

import graphsafe
from graphsafe.ops.attention import plan as P
from graphsafe.ops.attention import triton as T
from graphsafe.ops.attention.bench import _gathered_varlen, _paged_prefill_inputs


def _bench(fn) -> float:
    import triton

    return round(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"), 4)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _varlen(seqs, n, hq, hk, d, window_left, softcap, sinks, plans: dict) -> dict:
    """{label: ms} of the varlen call on the Triton kernel and each Gluon plan of `plans`."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(seqs * n, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(seqs * n, hk, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * n
    args = (q, k, v, cu, cu, n, n, d**-0.5, True, None, None, None, "off", window_left, softcap, sinks)
    call = graphsafe.get_op("flash_attn_varlen").call(*args)
    choice = P.choose_flash_attn_varlen(call)
    triton_run = T.bind_flash_attn_varlen(call, P.choose_flash_attn_varlen(call, choice.config))
    expected = triton_run(*args)
    rows = {"triton": _bench(lambda: triton_run(*args))}
    for label, gluon in plans.items():
        run = T.bind_flash_attn_varlen(call, P.VarlenChoice("16-bit", (gluon.name, "triton"), choice.config, gluon))
        out = run(*args)
        torch.cuda.synchronize()
        rows[label] = _bench(lambda run=run: run(*args))
        rows[f"{label} err"] = _err(out, expected)
    return rows


def _paged(d, hk, group, block_size, window_left, softcap, sinks, plans: dict) -> dict:
    """{label: ms} of paged prefill 8 x 512 over 4096 on the Triton kernel, gather + varlen
    and each Gluon plan of `plans`."""
    dev = torch.device("cuda")
    args = _paged_prefill_inputs(8, 512, 4096, dev, hk, group, d, block_size=block_size, window_left=window_left,
                                 softcap=softcap, sinks=sinks)
    call = graphsafe.get_op("paged_attention_prefill").call(*args)
    config = P.choose_paged_attention_prefill(call).config
    triton_run = T.bind_paged_attention_prefill(call, P.PagedPrefillChoice("triton", config, False))
    expected = triton_run(*args)
    rows = {"triton": _bench(lambda: triton_run(*args))}
    if not sinks:  # (the gather + varlen row of the bench; varlen takes the same sinks, left out here)
        rows["gather + varlen"] = _bench(_gathered_varlen(args))
    for label, gluon in plans.items():
        run = T.bind_paged_attention_prefill(call, P.PagedPrefillChoice("triton", config, False,
                                                                         (gluon.name, "triton"), gluon))
        out = run(*args)
        torch.cuda.synchronize()
        rows[label] = _bench(lambda run=run: run(*args))
        rows[f"{label} err"] = _err(out, expected)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, choices=(64, 256), required=True)
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and P.is_sm90(torch.device("cuda")) and P.gluon_module() is not None):
        print("needs an sm_90 GPU and a Triton with Gluon: nothing measured")
        return 0
    ws = P.warp_specialisation("tma", args.head_dim)
    if args.head_dim == 64:
        sinks = torch.randn(64, device="cuda")
        for label, (window, s) in (("plain", (-1, None)), ("sinks + window 127", (127, sinks))):
            plans = {f"tma {bn}-key tiles": P.GluonPlan("tma", 128, bn, ws, 2) for bn in (64, 128)}
            plans["wgmma (one partition)"] = P.gluon_plan_for("wgmma", 4096, 64)
            print("varlen D 64", label, _varlen(8, 4096, 64, 8, 64, window, 0.0, s, plans), flush=True)
            for bs in (16, 64):
                paged = {"paged tma": P.GluonPlan("paged-tma", 128, 128, ws, 2)}
                print("paged D 64", label, "block", bs, _paged(64, 8, 8, bs, window, 0.0, s is not None, paged),
                      flush=True)
    else:
        for regs in ((232, 32), (240, 24)):
            for label, (window, cap) in (("plain", (-1, 0.0)), ("window 4095 + softcap 50", (4095, 50.0))):
                plan = {f"tma 64-key tiles, 1 q buffer, {regs}": P.GluonPlan("tma", 128, 64, (2, *regs), 1)}
                print("varlen D 256", label, _varlen(4, 4096, 16, 8, 256, window, cap, None, plan), flush=True)
                paged = {f"paged tma, {regs}": P.GluonPlan("paged-tma", 128, 64, (2, *regs), 1)}
                print("paged D 256", label, "block 16", _paged(256, 8, 2, 16, window, cap, False, paged), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
