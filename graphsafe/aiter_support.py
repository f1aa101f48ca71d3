"""Where the aiter (ROCm) backend serves each op: one table per AMD architecture.

Read against aiter's source at v0.1.20-46-ge4048607a5 (ROCm/aiter), file and function
names cited. Selection reads this table first: an op's aiter record `supports` a call
only on an architecture listed for it (and only for the shapes, dtypes and layouts its
adapter's predicate accepts there); every other call goes to the Triton backend, decided
once per call signature, never by catching errors per call. Architectures not in the
table (gfx90a / MI250, RDNA, gfx1250...) take Triton for every op: aiter either ships no
kernel for these ops there or none that has been read for them.

The table is also README.md's "ROCm" section (`markdown_table()`; a test keeps them equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from graphsafe import device_info

# MI300X / MI325X (CDNA3), MI350X / MI355X (CDNA4).
ARCHS = ("gfx942", "gfx950")


@dataclass(frozen=True)
class Capability:
    """aiter's coverage of one op: the architectures it serves, what it takes there, and
    why the rest goes to Triton; `kernels`: which aiter kernel serves which shape on each
    architecture; `unverified`: what was read in aiter's source but never run on AMD
    hardware; `release`: the oldest aiter release the adapter takes (read from aiter's
    version, `release_missing`), None where any that has the entry point will do."""

    archs: tuple[str, ...]
    takes: str
    why: str
    kernels: str = ""
    unverified: str = ""
    release: str | None = None


_TRITON_ONLY = "no aiter kernel with this op's semantics"

_MLA_KERNELS = (
    "`aiter.mla.mla_decode_fwd`, non-persistent, 2 to 16 KV splits: stage 1 is the asm kernel "
    "`mla_dec_stage1_bf16_a16w16_subQ16_mqa16` (16 heads) or `mla_dec_stage1_bf16_a16w16_subQ128_mqa128` "
    "(128 heads) of `hsa/<arch>/mla` on both architectures; stage 2 the Triton reduce `_fwd_kernel_stage2_asm`"
)
_MLA_UNVERIFIED = (
    "the asm kernels' NaN / inf propagation and rows with fewer keys than splits; non-persistent mode with "
    "`return_lse` (aiter's own op_tests/test_mla.py skips it at the pinned commit); whether their 32-bit KV byte "
    "offset wraps at 4 GiB (unsigned, as #4341 says) or already at 2 GiB"
)
_TOPK_UNVERIFIED = ("the radix kernel's order of ties and of NaN logits on hardware "
                    "(read: `stable=True` keeps positions)")

CAPABILITIES: dict[str, Capability] = {
    "mla_decode": Capability(
        ARCHS,
        "bf16; head dim 576 (latent 512 + rope 64); 16 or 128 heads; contiguous q; a cache of contiguous "
        "blocks, at most 4 GiB (the kernels' 32-bit byte offset); aiter's own per-call split partials (fp32, "
        "rows x splits x heads x 513) at most 256 MiB; aiter >= 0.1.19",
        "`aiter.mla.mla_decode_fwd` in non-persistent mode with at least 2 KV splits on both: its Triton "
        "reduce (`_fwd_kernel_stage2_asm`) writes the LSE. Persistent mode with `return_lse` needs an "
        "lse=1 bf16 kernel, which gfx942's `hsa/gfx942/mla/mla_asm.csv` does not list "
        "(`get_heuristic_kernel_mla` raises); one split skips the LSE store. Before 0.1.19 (#4308) the "
        "non-persistent call with `return_lse` asks for an lse kernel too and raises",
        _MLA_KERNELS, _MLA_UNVERIFIED, "0.1.19",
    ),
    "sparse_mla": Capability(
        ARCHS, "as mla_decode; without `attn_sink` or `topk_length` (not adapted: Triton serves them)",
        "as mla_decode", "as mla_decode", "as mla_decode", "0.1.19",
    ),
    "paged_attention_decode": Capability(
        (),
        "",
        "`torch.ops.aiter.paged_attention_v1` weights the V rows past a request's length in its last "
        "block by 0 (`pa_kernels.cuh`), so a NaN in those unread rows reaches the output; it also "
        "reads padding block ids unchecked and misplaces heads beyond 16 query heads per KV head",
    ),
    "flash_attn_varlen": Capability(
        ARCHS,
        "bf16/fp16, `fp8=\"off\"`; at least one sequence; no sliding window, softcap or sinks (not adapted: "
        "Triton serves them); on gfx950 in bf16 at head dims 192 / 128, a scale > 0 (OPUS replaces a scale "
        "<= 0 by 1/sqrt(192))",
        "`aiter.flash_attn_varlen_func`. It uses `cu_seqlens` as given, so they are first clamped to "
        "graphsafe's contract. fp8 goes to Triton: aiter's fp8 type is e4m3fnuz on gfx942",
        "gfx950, bf16, head dims 192 / 128: OPUS (`fmha_fwd_bf16_opus_varlen_fwd`, since 0.1.18); bf16 at "
        "128 / 128 (both) and 192 / 128 (gfx942; gfx950 before 0.1.18): the fmha v3 asm kernel "
        "(`fmha_v3_varlen_fwd`); fp16 and other head dims: CK's `mha_varlen_fwd`",
        "NaN / inf propagation of all three kernels, and whether they load K / V rows past a sequence's end "
        "(read: CK's tile windows and OPUS's buffer descriptors stop at the sequence's length)",
    ),
    "paged_attention_prefill": Capability(
        (),
        "",
        "not adapted: aiter's paged prefill (`flash_attn_varlen_func` with `block_table`, "
        "`mha_batch_prefill`) has not been read against graphsafe's contract (padding block ids, unread "
        "cache rows, NaN placement)",
    ),
    "fp8_mqa_logits": Capability(
        ("gfx950",),
        "H a power of two; D a power of two in [64, 1024] (at D 16 and 32 Triton's compiler aborts the "
        "process on the kernel); a unit-stride `k_scale`; Triton >= 3.6 (aiter's Gluon kernel)",
        "gfx942: aiter's Triton path converts e4m3fn inputs to e4m3fnuz copies and its `tl.maximum` "
        "takes relu(NaN) to 0; graphsafe's contract propagates NaN. The gfx950 Gluon kernel propagates it",
        "gfx950: the Gluon kernel `_gluon_fp8_mqa_logits_kernel` (aiter/ops/triton/_gluon_kernels/gfx950/"
        "attention/fp8_mqa_logits.py: MFMA 32x32x64 up to D 64 or at 32 heads, else 16x16x128)",
        "the Gluon kernel on hardware, small H (below 16: compiles with Triton 3.9) above all; its relu "
        "propagating NaN (`propagate_nan=ALL`, read)",
    ),
    "fp8_paged_mqa_logits": Capability(
        (),
        "",
        "`deepgemm_fp8_paged_mqa_logits` (Gluon): relu(NaN) is 0 (`gl.maximum` without NaN propagation), "
        "padding block ids are read, and on gfx942 e4m3fn bytes are read as e4m3fnuz",
    ),
    "indexer_k_quant_and_cache": Capability(
        (),
        "",
        "`aiter.ops.cache.indexer_k_quant_and_cache`: the amax reduction drops NaN (graphsafe stores NaN "
        "scales and values bit for bit), and gfx942 quantises to e4m3fnuz with max 240",
    ),
    "cp_gather_indexer_k_quant_cache": Capability(
        (),
        "",
        "its kernel reads an uninitialised shared-memory request index for rows at or past "
        "`cu_seq_lens[B]` and never checks block ids; the prefill composite passes an upper bound of rows",
    ),
    "top_k_per_row_decode": Capability(
        ARCHS,
        "fp32 logits; `topk` 2048 unless this aiter takes `k`; at least one row",
        "`aiter.top_k_per_row_decode` (HIP source built for the device); row bounds clamped first",
        "the one-block radix kernel of csrc/kernels/topk_per_row_kernels.cu (`_top_k_per_row_decode`)",
        _TOPK_UNVERIFIED,
    ),
    "top_k_per_row_prefill": Capability(
        ARCHS,
        "as top_k_per_row_decode",
        "`aiter.top_k_per_row_prefill` with `stable=True` (the one-block kernel: the multi-block path "
        "keeps a zeroed scratch per stream that aiter allocates and caches itself)",
        "the one-block radix kernel (`_top_k_per_row_prefill`, `stable=True`)",
        _TOPK_UNVERIFIED,
    ),
}

# Ops with no aiter adapter at all (cache writes, ragged helpers, the composites, which
# run their inner ops on the backends those choose).
NO_ADAPTER = (
    "concat_and_cache_mla", "reshape_and_cache", "build_ragged_indices_from_dense", "req_local_to_global_slots",
    "sparse_attn_indexer_decode", "sparse_attn_indexer_prefill",
    # DeepSeek-V4: vLLM's ROCm path (amd/rocm.py) runs aiter's sparse MLA over a bf16 copy of the
    # window and compressed rows; no aiter kernel reads the 584-byte record, so no adapter yet.
    "dsv4_sparse_attn", "dsv4_qnorm_rope_kv_insert", "dsv4_compress_kv",
)


# -- aiter's version ------------------------------------------------------------------------------
# An adapter that relies on a fix asks for the release that carries it (`release_missing`),
# read from aiter's version: keywords and signatures outlive the bugs (v0.1.16 to v0.1.18
# take every keyword the MLA adapter passes, and raise on its call).
AITER_PACKAGE = "amd-aiter"


def aiter_version() -> str | None:
    """The installed aiter's version: `aiter/_version.py` (setuptools_scm writes it at every
    build, wheel or editable), else the `amd-aiter` package metadata; None when neither can
    be read. (aiter's `__init__` does not export `__version__`.) Not cached: asked once per
    call signature, where a `supports` predicate needs it."""
    try:
        from aiter._version import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 - no _version module (a source tree never built)
        pass
    try:
        from importlib.metadata import version

        return version(AITER_PACKAGE)
    except Exception:  # noqa: BLE001 - not installed as a package
        return None


_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[.-]?(a|b|c|rc|alpha|beta|pre|preview)\.?\d*)?"
                      r"(?:[.-]?(post|rev|r)\.?\d*)?(?:[.-]?(dev)\.?\d*)?(?:\+.*)?$", re.IGNORECASE)


def release_at_least(version: str, release: str) -> bool | None:
    """Whether PEP 440 `version` is `release` or later (None: not a version). A pre-release
    or development build of `release` itself (0.1.19rc0, 0.1.19.dev5: setuptools_scm's
    name for a commit after 0.1.18) is earlier, so it may lack the fix; a post release
    (0.1.19.post1) is later."""
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    have = tuple(int(x) for x in match.group(1).split("."))
    want = tuple(int(x) for x in release.split("."))
    width = max(len(have), len(want))
    have, want = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
    if have != want:
        return have > want
    pre, post, dev = match.group(2), match.group(3), match.group(4)
    return post is not None or (pre is None and dev is None)


def release_missing(release: str, what: str) -> str:
    """Why the installed aiter cannot serve a call that needs `release` ("" when it is that
    release or later): `what` says what the release fixed."""
    version = aiter_version()
    if version is None:
        return (f"cannot read the installed aiter's version (aiter/_version.py, package {AITER_PACKAGE}); "
                f"this call needs aiter >= {release}, where {what}")
    at_least = release_at_least(version, release)
    if at_least is None:
        return (f"cannot parse the installed aiter's version {version!r}; this call needs aiter >= {release}, "
                f"where {what}")
    if not at_least:
        return f"aiter {version} predates {release}, where {what}: update aiter (Triton serves the call meanwhile)"
    return ""


def serves(op: str, device) -> bool:
    """Whether the capability table lets aiter serve `op` on `device`'s architecture."""
    capability = CAPABILITIES.get(op)
    return capability is not None and device_info.rocm_arch(device) in capability.archs


def markdown_table() -> str:
    """The table as README.md shows it."""
    rows = ["| op | gfx942 (MI300) | gfx950 (MI350) | takes / why | aiter kernel per shape | read, never run |",
            "|---|---|---|---|---|---|"]
    for op, cap in CAPABILITIES.items():
        cells = ["aiter" if arch in cap.archs else "Triton" for arch in ARCHS]
        text = f"{cap.takes}. {cap.why}" if cap.takes else cap.why
        rows.append(f"| `{op}` | {cells[0]} | {cells[1]} | {text} | {cap.kernels or '-'} | {cap.unverified or '-'} |")
    for op in NO_ADAPTER:
        rows.append(f"| `{op}` | Triton | Triton | {_TRITON_ONLY} (no adapter) | - | - |")
    return "\n".join(rows)


__all__ = ["ARCHS", "CAPABILITIES", "NO_ADAPTER", "Capability", "aiter_version", "markdown_table", "release_at_least",
           "release_missing", "serves"]
