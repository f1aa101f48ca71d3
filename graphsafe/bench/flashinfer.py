"""FlashInfer as a bench peer, on the same tensors as graphsafe, outputs compared.

Never required: `peers_*` return no impls (and say why in their note) when `import
flashinfer` fails, off CUDA, or when the FlashInfer kernel a variant needs is neither
prebuilt nor already JIT-built here (compiling it can take from minutes to half an hour;
`GRAPHSAFE_BENCH_FLASHINFER_JIT=1` allows it). Each variant is run once before timing and
its output compared with graphsafe's (max abs difference, in the note; for top-k the
share of rows picking the same values); the timed impls are labelled
"flashinfer <kernel> <backend>". The harness adds "graphsafe / flashinfer" ratios to the
problem's note (`ratio_note`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from graphsafe.bench.peers import ratio_note as peer_ratio_note, same_picks

WORKSPACE_BYTES = 256 * 2**20
BF16 = torch.bfloat16  # the dtype FlashInfer's prebuilt kernels were built for
PREFIX = "flashinfer"


@functools.cache
def _module() -> Any:
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - any import failure: no FlashInfer rows
        return None
    return flashinfer


def unavailable(device: torch.device) -> str | None:
    """Why FlashInfer rows cannot run here, or None."""
    if device.type != "cuda" or torch.version.hip is not None:
        return "flashinfer: CUDA only"
    if _module() is None:
        return "flashinfer not installed"
    return None


def _built(spec: Callable[[], Any]) -> str | None:
    """None when the JIT module `spec()` names is prebuilt (AOT) or already built (JIT),
    or JIT builds are allowed; else why not."""
    if os.environ.get("GRAPHSAFE_BENCH_FLASHINFER_JIT") == "1":
        return None
    try:
        from flashinfer.jit import env

        name = spec().name
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    for root in (env.FLASHINFER_AOT_DIR, env.FLASHINFER_JIT_DIR):
        if (root / name / f"{name}.so").exists():
            return None
    return f"{name} not prebuilt (GRAPHSAFE_BENCH_FLASHINFER_JIT=1 builds it)"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _variants(device: torch.device, variants: list[tuple[str, Callable[[], Any], Callable[[], Callable[[], Any]]]],
              compare: Callable[[Any], str]) -> tuple[dict, str]:
    """Build each (label, jit spec, make) variant: `make()` plans and returns the call.
    Returns the impls and a note with each variant's comparison or why it is missing."""
    if device.type != "cuda":
        return {}, ""  # nothing to say off CUDA
    why = unavailable(device)
    if why:
        return {}, why
    impls, notes = {}, []
    for label, spec, make in variants:
        missing = _built(spec)
        if missing:
            notes.append(f"{label}: skipped ({missing})")
            continue
        try:
            call = make()
            result = call()
            torch.cuda.synchronize(device)
        except Exception as err:  # noqa: BLE001 - a failing peer is reported, never fatal
            notes.append(f"{label}: failed ({type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''})")
            continue
        impls[label] = call
        notes.append(f"{label}: {compare(result)}")
    return impls, "; ".join(notes)


def mla_decode_peers(q, kv_cache, block_table, seq_lens, sm_scale, kv_lora_rank, graphsafe_out) -> tuple[dict, str]:
    """`BatchMLAPagedAttentionWrapper` fa3 and fa2 (bf16, the whole block table as CSR)."""
    fi = _module()
    device = q.device
    b, h, d = q.shape
    page = kv_cache.shape[1]
    out, lse = graphsafe_out

    def make(backend: str):
        def plan():
            mb = block_table.shape[1]
            qo = torch.arange(b + 1, dtype=torch.int32, device=device)
            kv_indptr = qo * mb
            wrapper = fi.mla.BatchMLAPagedAttentionWrapper(_workspace(device), backend=backend)
            wrapper.plan(
                metadata=fi.mla.MLAPlanMetadata.csr(qo, kv_indptr, block_table.reshape(-1).contiguous(), seq_lens),
                num_heads=h, head_dim_ckv=kv_lora_rank, head_dim_kpe=d - kv_lora_rank, page_size=page, causal=False,
                sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype, lse_mode="basee",
            )
            return lambda: wrapper.run(query=q, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True)

        return plan

    def spec(backend: str):
        def name():
            from flashinfer.jit.attention import modules

            return modules.gen_batch_mla_module(backend, BF16, BF16, BF16, torch.int32, kv_lora_rank,
                                                d - kv_lora_rank, False)

        return name

    def compare(result) -> str:
        o, l = result
        return f"max |out - graphsafe| {_max_diff(o, out):.3g}, |lse - graphsafe| {_max_diff(l, lse):.3g}"

    variants = [(f"{PREFIX} MLA {backend}", spec(backend), make(backend)) for backend in ("fa3", "fa2")]
    return _variants(device, variants, compare)


def _page_csr(block_table: torch.Tensor, seq_lens: torch.Tensor, page: int):
    """FlashInfer's paged layout of graphsafe's block table: (indptr, the pages each
    request uses in order, the keys in each request's last page)."""
    pages = (seq_lens.long() + page - 1) // page
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    used = torch.arange(block_table.shape[1], device=block_table.device) < pages[:, None]
    last = (seq_lens.long() - (pages - 1) * page).clamp(1, page).to(torch.int32)
    return indptr, block_table[used].contiguous(), last


def _soft_cap(softcap: float) -> float | None:
    return softcap if softcap > 0 else None


def paged_decode_peers(q, k_cache, v_cache, block_table, seq_lens, scale, graphsafe_out, window_left: int = -1,
                       softcap: float = 0.0) -> tuple[dict, str]:
    """`BatchDecodeWithPagedKVCacheWrapper`: its decode kernel, and tensor cores (fa2);
    with graphsafe's sliding window / softcap where given (FlashInfer's `window_left`,
    `logits_soft_cap`)."""
    fi = _module()
    device = q.device
    b, hq, d = q.shape
    page, hk = k_cache.shape[1], k_cache.shape[2]
    window, capped = window_left >= 0, softcap > 0

    def make(**kw):
        def plan():
            indptr, indices, last = _page_csr(block_table, seq_lens, page)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD", **kw)
            wrapper.plan(indptr, indices, last, hq, hk, d, page, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                         sm_scale=scale, window_left=window_left, logits_soft_cap=_soft_cap(softcap))
            return lambda: wrapper.run(q, (k_cache, v_cache))

        return plan

    def decode_spec():
        from flashinfer.jit.attention import modules

        return modules.gen_batch_decode_module(BF16, BF16, BF16, torch.int32, d, d, 0, window, capped)

    def prefill_spec():
        from flashinfer.jit.attention import modules

        return modules._gen_batch_prefill_primary_module("fa2", BF16, BF16, BF16, torch.int32, d, d, 0,
                                                          window, capped, False)

    variants = [
        (f"{PREFIX} decode", decode_spec, make(use_tensor_cores=False)),
        (f"{PREFIX} decode tensor cores fa2", prefill_spec, make(use_tensor_cores=True)),
    ]
    return _variants(device, variants, lambda o: f"max |out - graphsafe| {_max_diff(o, graphsafe_out):.3g}")


def _prefill_spec(backend: str, d: int, dv: int, window: bool, capped: bool):
    def name():
        from flashinfer.jit.attention import modules

        if backend == "fa2":
            return modules._gen_batch_prefill_primary_module("fa2", BF16, BF16, BF16, torch.int32, d, dv, 0,
                                                              window, capped, False)
        return modules.gen_batch_prefill_module("fa3", BF16, BF16, BF16, torch.int32, d, dv, 0, window, capped,
                                                False)

    return name


def paged_prefill_peers(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, causal, graphsafe_out,
                        window_left: int = -1, softcap: float = 0.0) -> tuple[dict, str]:
    """`BatchPrefillWithPagedKVCacheWrapper` fa3 and fa2 over the same pages (the used
    pages of each sequence as CSR), with the sliding window / softcap where given."""
    fi = _module()
    device = q.device
    hq, d = q.shape[1], q.shape[2]
    page, hk, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]

    def make(backend: str):
        def plan():
            indptr, indices, last = _page_csr(block_table, seq_lens, page)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend=backend)
            wrapper.plan(cu_seqlens_q, indptr, indices, last, hq, hk, d, page, head_dim_vo=dv, causal=causal,
                         sm_scale=scale, window_left=window_left, logits_soft_cap=_soft_cap(softcap),
                         q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            return lambda: wrapper.run(q, (k_cache, v_cache))

        return plan

    variants = [(f"{PREFIX} paged prefill {backend}", _prefill_spec(backend, d, dv, window_left >= 0, softcap > 0),
                 make(backend)) for backend in ("fa3", "fa2")]
    return _variants(device, variants, lambda o: f"max |out - graphsafe| {_max_diff(o, graphsafe_out):.3g}")


def ragged_prefill_peers(q, k, v, cu_seqlens, scale, causal, graphsafe_out, window_left: int = -1,
                         softcap: float = 0.0) -> tuple[dict, str]:
    """`BatchPrefillWithRaggedKVCacheWrapper` fa3 and fa2 (one cu_seqlens for q and k),
    with the sliding window / softcap where given."""
    fi = _module()
    device = q.device
    hq, d = q.shape[1], q.shape[2]
    hk, dv = k.shape[1], v.shape[2]

    def make(backend: str):
        def plan():
            wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend=backend)
            wrapper.plan(cu_seqlens, cu_seqlens, hq, hk, d, head_dim_vo=dv, causal=causal, sm_scale=scale,
                         window_left=window_left, logits_soft_cap=_soft_cap(softcap), q_data_type=q.dtype,
                         kv_data_type=k.dtype)
            return lambda: wrapper.run(q, k, v)

        return plan

    variants = [(f"{PREFIX} ragged prefill {backend}", _prefill_spec(backend, d, dv, window_left >= 0, softcap > 0),
                 make(backend)) for backend in ("fa3", "fa2")]
    return _variants(device, variants, lambda o: f"max |out - graphsafe| {_max_diff(o, graphsafe_out):.3g}")


def topk_decode_peers(logits, lengths, topk, graphsafe_indices) -> tuple[dict, str]:
    """`top_k_ragged_transform` (row offsets 0, the rows' lengths): FlashInfer's DSA top-k."""
    fi = _module()
    device = logits.device

    def make():
        offsets = torch.zeros(logits.shape[0], dtype=torch.int32, device=device)
        return lambda: fi.top_k_ragged_transform(logits, offsets, lengths, topk)

    def spec():
        from flashinfer.jit.topk import gen_topk_module

        return gen_topk_module()

    def compare(result) -> str:
        idx = result[1] if isinstance(result, tuple) else result
        return f"rows picking graphsafe's values {same_picks(logits, idx, graphsafe_indices):.3f}"

    return _variants(device, [(f"{PREFIX} top_k_ragged_transform", spec, make)], compare)


def ratio_note(rows: list) -> str:
    """"graphsafe / <peer> = r" for each FlashInfer row of a problem (`peers.ratio_note`)."""
    return peer_ratio_note(rows, (PREFIX,))


__all__ = ["unavailable", "mla_decode_peers", "paged_decode_peers", "ragged_prefill_peers", "topk_decode_peers",
           "ratio_note", "PREFIX"]
