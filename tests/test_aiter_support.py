"""The aiter capability table (graphsafe.aiter_support) and the stand-in aiter's set-up."""

from __future__ import annotations

import re

import torch

import graphsafe.registry
from graphsafe import aiter_support


def test_every_op_is_in_the_capability_table_once():
    listed = list(aiter_support.CAPABILITIES) + list(aiter_support.NO_ADAPTER)
    assert sorted(listed) == sorted(graphsafe.registry.ops()), "a new op must say where aiter serves it"
    for name, spec in graphsafe.registry.ops().items():
        served = bool(aiter_support.CAPABILITIES.get(name, aiter_support.Capability((), "", "")).archs)
        assert ("aiter" in spec.backends) == served, f"{name}: an aiter record iff the table lets aiter serve it"


def test_readme_shows_the_capability_table():
    readme = open("README.md", encoding="utf-8").read()
    assert aiter_support.markdown_table() in readme, "README's ROCm table differs from graphsafe.aiter_support"


def test_selection_reads_the_table(aiter_standin):
    aiter_standin("gfx942")
    assert aiter_support.serves("mla_decode", "cuda")
    assert not aiter_support.serves("fp8_mqa_logits", "cuda")
    assert not aiter_support.serves("cp_gather_indexer_k_quant_cache", "cuda")
    aiter_standin("gfx950")
    assert aiter_support.serves("fp8_mqa_logits", "cuda")
    aiter_standin("gfx90a")
    assert not any(aiter_support.serves(op, "cuda") for op in aiter_support.CAPABILITIES)


def test_standin_fp8_type_follows_the_architecture(aiter_standin):
    import pytest

    aiter = aiter_standin("gfx942")
    assert aiter.dtypes.fp8 == torch.float8_e4m3fnuz
    with pytest.raises(AssertionError, match=re.escape("Unsupported dtype: torch.float8_e4m3fn")):
        aiter.dtypes.torch_to_aiter_pybind(torch.zeros(2, dtype=torch.float8_e4m3fn))
    aiter = aiter_standin("gfx950")
    assert aiter.dtypes.fp8 == torch.float8_e4m3fn
    aiter.dtypes.torch_to_aiter_pybind(torch.zeros(2, dtype=torch.float8_e4m3fn))


def test_the_table_says_which_kernel_serves_and_what_never_ran():
    """Every op aiter serves names the aiter kernel per shape (OPUS included) and what was
    read in aiter's source but never run on AMD hardware (issue 36)."""
    for op, cap in aiter_support.CAPABILITIES.items():
        if cap.archs:
            assert cap.kernels and cap.unverified, op
    assert "OPUS" in aiter_support.CAPABILITIES["flash_attn_varlen"].kernels
    assert aiter_support.CAPABILITIES["mla_decode"].release == "0.1.19"


def test_release_at_least_reads_pep440_versions():
    at_least = aiter_support.release_at_least
    assert at_least("0.1.19", "0.1.19") and at_least("0.1.19.post2", "0.1.19") and at_least("0.1.20", "0.1.19")
    assert at_least("0.1.21.dev46+ge4048607a5", "0.1.19")  # a build of the pinned commit
    assert at_least("0.1.18", "0.1.19") is False and at_least("0.1.19rc0", "0.1.19") is False
    assert at_least("0.1.19.dev5+g0123abc", "0.1.19") is False  # a commit after 0.1.18
    assert at_least("not a version", "0.1.19") is None
