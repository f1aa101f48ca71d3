"""Every Triton kernel launch the runners bind compiles for gfx942, gfx950 and sm_90 and fits
the target's shared memory, without a GPU (issue 36; `graphsafe.testing.compile_matrix`).

The launches are recorded as a device of the target binds them (ROCm's selection emulated:
capability (9, 4) / (9, 5), 64 / 160 KiB of LDS) at the ops' contract and GPU-test shapes,
then compiled with Triton's whole pipeline in a fresh interpreter (without
TRITON_INTERPRET). CI compiles one or two variants per entry point and pointer types (the
largest, the one with the most code paths on: `compile_matrix.ci_selection`); `python -m
graphsafe.testing.compile_matrix --all` compiles all of them. On ROCm each compiled launch
must also stay within its plan's bound (the model the plan fits its config with).
"""

from __future__ import annotations

import pytest
import torch

from graphsafe import device_info
from graphsafe.ops.attention import plan as attention_plan
from graphsafe.ops.mla import plan as mla_plan
from graphsafe.testing import compile_matrix as M

CUDA = torch.device("cuda", 0)


def _variants(target: str, ops: list[str]) -> list[M.Variant]:
    launches, skipped = M.record(M.TARGETS[target], ops)
    assert not skipped, skipped
    return M.distinct(launches)


def _stages(variants, kernel: str, **consts) -> set[int]:
    return {v.options.get("num_stages") for v in variants
            if v.kernel == kernel and all(v.consts.get(k) == x for k, x in consts.items())}


# -- the plans' choice, from the device's LDS (no compile) -------------------------------
def test_rocm_configs_are_fitted_to_the_lds_up_front():
    """Finding 3 and 7 of issue 36: on gfx942 (64 KiB) the varlen kernel at D 128 takes one
    stage (three took 80-96 KiB) and MLA's 16-head tiles three (five took 108 KiB); gfx950
    (160 KiB) keeps the preferred ones; every fitted launch is within the LDS by its plan's
    bound."""
    ops = ["flash_attn_varlen", "paged_attention_decode", "paged_attention_prefill", "mla_decode", "sparse_mla"]
    varlen, mla = "triton_prefill._varlen_fwd_kernel", "triton_split_kv.mla_attn_kernel"
    for target in ("gfx942", "gfx950"):
        variants = _variants(target, ops)
        direct = target == "gfx950"
        bounded = [v for v in variants if M.plan_bound(v, direct) is not None]
        assert len(bounded) > 20
        for v in bounded:
            assert M.plan_bound(v, direct) <= M.TARGETS[target].shared_memory, (target, v.kernel, v.consts, v.options)
        if target == "gfx942":
            assert _stages(variants, varlen, D=128, FP8=False, BLOCK_M=128) == {1}
            # (16-head tiles: 16 heads at 5 stages, 128 heads at 2 on a 64 KiB LDS)
            assert max(_stages(variants, mla, BLOCK_H=16, R=512, FP8_DS=False)) == 3
        else:
            assert _stages(variants, varlen, D=128, FP8=False, BLOCK_M=128) == {3}
            assert max(_stages(variants, mla, BLOCK_H=16, R=512, FP8_DS=False)) == 5


def test_nvidia_configs_are_the_ones_sized_per_capability():
    """On NVIDIA nothing is fitted (`config_shared_memory` is None): the configs stay the
    ones sized and measured per capability."""
    variants = _variants("sm90", ["flash_attn_varlen", "mla_decode"])
    assert _stages(variants, "triton_prefill._varlen_fwd_kernel", D=128, FP8=False, BLOCK_M=128) == {3}
    assert max(_stages(variants, "triton_split_kv.mla_attn_kernel", BLOCK_H=16, R=512, FP8_DS=False)) == 5
    assert device_info.config_shared_memory("cpu") is None


def test_every_op_of_the_registry_is_recorded():
    """Registry-wide: every op's case builds at every shape (fake tensors, or real CPU ones
    where its make reads what it drew) and every op with a Triton record binds a launch, so
    a new op cannot fall out of the matrix (dsv4_compress_kv and the indexer's prefill
    composite were skipped whole before)."""
    from graphsafe.registry import REGISTRY

    launches, skipped = M.record(M.TARGETS["gfx942"])
    assert skipped == []
    recorded = {v.split("[")[0] for launch in launches for v in [launch.origin]}
    triton_ops = {op for op, spec in REGISTRY.ops.items() if "triton" in spec.backends}
    assert triton_ops - recorded == set()


def test_emulation_leaves_nothing_behind():
    """After recording, every graphsafe name is bound to what it was before: a leaked
    recording `bind` turned later launches into no-ops (the aiter CSR kernels wrote nothing)."""
    import sys

    import graphsafe.backends
    import graphsafe.launch

    def names():
        return {(m, a): id(v) for m, mod in list(sys.modules.items())
                if (m == "graphsafe" or m.startswith("graphsafe.")) and mod is not None
                for a, v in vars(mod).items() if callable(v)}

    before, bind, available = names(), graphsafe.launch.bind, graphsafe.backends.backend_available
    _variants("gfx942", ["mla_decode"])
    assert graphsafe.launch.bind is bind and graphsafe.backends.backend_available is available
    after = names()
    assert {k: v for k, v in after.items() if k in before and before[k] != v} == {}


def test_fitting_takes_fewer_stages_then_fewer_keys(monkeypatch):
    monkeypatch.setattr(attention_plan, "config_shared_memory", lambda device: 64 * 1024)
    need = lambda c: attention_plan.varlen_shared_bytes(c, 256, 256, False)  # noqa: E731
    candidates = attention_plan._tile_candidates((128, 64, 8, 2))
    # D 256: 128 rows of q take 64 KiB whatever the keys: 64 rows, 32 keys, one stage
    assert attention_plan.fit_shared_memory(candidates, need, CUDA) == (64, 32, 4, 1)
    monkeypatch.setattr(mla_plan, "config_shared_memory", lambda device: 64 * 1024)
    cfg = mla_plan.kernel_config(16, "cuda")
    assert mla_plan.fit_stages(cfg, CUDA, 512, 64, False).num_stages == 3
    monkeypatch.setattr(mla_plan, "config_shared_memory", lambda device: None)
    assert mla_plan.fit_stages(cfg, CUDA, 512, 64, False) == cfg


# -- the compile matrix -------------------------------------------------------------------
_SCRIPT = "import sys; from graphsafe.testing.compile_matrix import main; sys.exit(main({argv!r}))"


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "sm90"])
def test_every_triton_launch_compiles_and_fits(compile_for_sm90, target):
    """The CI selection of the recorded launches compiles for `target` and fits its shared
    memory (and on ROCm its plan's bound). All ~30 entry points the runners bind appear."""
    out = compile_for_sm90(_SCRIPT.format(argv=[target]), timeout=1200)
    compiled = {line.split()[1] for line in out.splitlines() if line.startswith(f"[{target}] ") and " shared " in line}
    expected = {"triton_prefill._varlen_fwd_kernel", "triton_decode._paged_decode_kernel",
                "triton_paged_prefill._paged_prefill_kernel", "triton_split_kv.mla_attn_kernel",
                "triton_split_kv.combine_kernel", "triton_mqa_logits.mqa_logits_kernel",
                "triton_paged_mqa_logits.paged_mqa_logits_kernel", "triton_two_launch._final_kernel"}
    expected |= {"triton_sparse_attn.dsv4_attn_kernel", "triton_compress.compress_kernel",
                 "triton_qnorm_rope_insert.qnorm_rope_kv_insert_kernel"}
    if target != "sm90":  # the aiter adapters' kernels
        expected |= {"triton_aiter_csr._count_kernel", "triton_sequence_bounds._sequence_bounds_kernel",
                     "triton_external._finish_external_kernel"}
    assert expected <= compiled, expected - compiled
    assert len(compiled) >= 25, sorted(compiled)
