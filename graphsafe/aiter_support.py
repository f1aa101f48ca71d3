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
    why the rest goes to Triton."""

    archs: tuple[str, ...]
    takes: str
    why: str


_TRITON_ONLY = "no aiter kernel with this op's semantics"

CAPABILITIES: dict[str, Capability] = {
    "mla_decode": Capability(
        ARCHS,
        "bf16; head dim 576 (latent 512 + rope 64); 16 or 128 heads; contiguous q; a cache of contiguous "
        "blocks; aiter's own per-call split partials (fp32, rows x splits x heads x 513) at most 256 MiB",
        "`aiter.mla.mla_decode_fwd` in non-persistent mode with at least 2 KV splits on both: its Triton "
        "reduce (`_fwd_kernel_stage2_asm`) writes the LSE. Persistent mode with `return_lse` needs an "
        "lse=1 bf16 kernel, which gfx942's `hsa/gfx942/mla/mla_asm.csv` does not list "
        "(`get_heuristic_kernel_mla` raises); one split skips the LSE store",
    ),
    "sparse_mla": Capability(
        ARCHS, "as mla_decode; without `attn_sink` or `topk_length` (not adapted: Triton serves them)",
        "as mla_decode",
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
        "Triton serves them)",
        "`aiter.flash_attn_varlen_func` (fmha v3 asm or CK). It uses `cu_seqlens` as given, so they are "
        "first clamped to graphsafe's contract. fp8 goes to Triton: aiter's fp8 type is e4m3fnuz on gfx942",
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
        "H and D powers of two; Triton >= 3.6 (aiter's Gluon kernel)",
        "gfx942: aiter's Triton path converts e4m3fn inputs to e4m3fnuz copies and its `tl.maximum` "
        "takes relu(NaN) to 0; graphsafe's contract propagates NaN. The gfx950 Gluon kernel propagates it",
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
    ),
    "top_k_per_row_prefill": Capability(
        ARCHS,
        "as top_k_per_row_decode",
        "`aiter.top_k_per_row_prefill` with `stable=True` (the one-block kernel: the multi-block path "
        "keeps a zeroed scratch per stream that aiter allocates and caches itself)",
    ),
}

# Ops with no aiter adapter at all (cache writes, ragged helpers, the composites, which
# run their inner ops on the backends those choose).
NO_ADAPTER = (
    "concat_and_cache_mla", "reshape_and_cache", "build_ragged_indices_from_dense", "req_local_to_global_slots",
    "sparse_attn_indexer_decode", "sparse_attn_indexer_prefill",
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
        return f"cannot parse the installed aiter's version {version!r}; this call needs aiter >= {release}, where {what}"
    if not at_least:
        return f"aiter {version} predates {release}, where {what}: update aiter (Triton serves the call meanwhile)"
    return ""


def serves(op: str, device) -> bool:
    """Whether the capability table lets aiter serve `op` on `device`'s architecture."""
    capability = CAPABILITIES.get(op)
    return capability is not None and device_info.rocm_arch(device) in capability.archs


def markdown_table() -> str:
    """The table as README.md shows it."""
    rows = ["| op | gfx942 (MI300) | gfx950 (MI350) | takes / why |", "|---|---|---|---|"]
    for op, cap in CAPABILITIES.items():
        cells = ["aiter" if arch in cap.archs else "Triton" for arch in ARCHS]
        text = f"{cap.takes}. {cap.why}" if cap.takes else cap.why
        rows.append(f"| `{op}` | {cells[0]} | {cells[1]} | {text} |")
    for op in NO_ADAPTER:
        rows.append(f"| `{op}` | Triton | Triton | {_TRITON_ONLY} (no adapter) |")
    return "\n".join(rows)


__all__ = ["ARCHS", "CAPABILITIES", "NO_ADAPTER", "Capability", "aiter_version", "markdown_table", "release_at_least",
           "release_missing", "serves"]
