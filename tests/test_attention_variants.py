"""`flash_attn_varlen`'s variants (sliding window, softcap, sinks) in the Triton kernel.

Geometry the contract's random draws rarely hit: windows narrower than a tile and wider
than every sequence over several block configs, the key blocks wholly before every row's
window (skipped: never loaded), the sinks' limits, softcap on the fp8 path. The kernels
run through Triton's interpreter (float16 and fp8, small shapes); bf16 is checked on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.ops.attention import reference
from graphsafe.ops.attention.fp8 import FP8_DTYPE
from graphsafe.testing.cases import case_for
from graphsafe.ops.attention.cases import attention_compare

HAS_INTERPRETER = graphsafe.get_op("flash_attn_varlen").available_backends("cpu").count("triton") == 1
pytestmark = pytest.mark.skipif(not HAS_INTERPRETER, reason="Triton interpreter not enabled")

# Positions in the op's arguments.
SCALE, CAUSAL, MODE, WINDOW, SOFTCAP, SINKS = 7, 8, 12, 13, 14, 15
# Lengths across 16-key blocks: more keys than queries, fewer, a single query, empty keys.
LENGTHS = {"B": 4, "max_q": 20, "max_k": 40, "lens_q": [20, 9, 1, 6], "lens_k": [40, 5, 23, 0]}


def _triton_varlen(*args, config=None):
    from graphsafe.ops.attention import triton as T

    return T.flash_attn_varlen(*args, config=config)


def _args(seed: int = 3, **params):
    case = case_for("flash_attn_varlen")
    return case.inputs({**case.example, **LENGTHS, **params}, "cpu", seed)


def _fp8_products(args) -> bool:
    return args[0].dtype == FP8_DTYPE or args[MODE] == "on"


def _compare(args, config=None, what=""):
    expected, actual = reference.flash_attn_varlen(*args), _triton_varlen(*args, config=config)
    v, vd = args[2], args[11]
    vmax = v.float().abs().max().item() * (1.0 if vd is None else vd.abs().max().item())
    fp8 = _fp8_products(args)
    attention_compare(expected, actual, vmax * (1 + 2**-4 if fp8 else 1), torch.float16, fp8, v.shape[0], what)
    return actual


# Every block config on the bf16/fp16 kernel; the fp8 kernel (both fp8 modes run it) at
# BLOCK_M = BLOCK_N and BLOCK_M > BLOCK_N.
@pytest.mark.parametrize("config, mode", [((16, 16, 4, 1), "off"), ((32, 16, 4, 1), "off"), ((16, 32, 4, 1), "off"),
                                          ((16, 16, 4, 1), "fp8_inputs"), ((32, 16, 4, 1), "on")])
@pytest.mark.parametrize("causal", [True, False])
def test_window_geometry_matches_reference(config, mode, causal):
    """Windows of 0 and 3 keys (narrower than a tile: the window's edge and the diagonal
    share blocks), 17 (one block and a key), 100 (wider than every sequence) and 10**9
    (at least Tk: compiled as no window), under BLOCK_M larger, equal and smaller than
    BLOCK_N; fp8 adds the aligned key frame (the sequences start off the 16-key grid)."""
    for window in (0, 3, 17, 100, 10**9):
        args = _args(window_left=window, causal=causal, mode=mode, descale="per_seq")
        _compare(args, config, f"window {window} config {config} {mode} causal={causal}")


@pytest.mark.parametrize("mode", ["off", "on", "fp8_inputs"])
@pytest.mark.parametrize("causal", [True, False])
def test_window_wider_than_every_sequence_is_no_window(mode, causal):
    """A window that holds every key (40, the longest sequence's keys; narrower than Tk,
    so the kernel's window path runs) walks the same blocks with the same masks as no
    window (the lead block of the fp8 frame included): the outputs are bit-equal."""
    args = _args(causal=causal, mode=mode, descale="tensor")
    assert args[1].shape[0] > 40
    plain = _triton_varlen(*args)
    wide = _triton_varlen(*args[:WINDOW], 40, *args[WINDOW + 1 :])
    assert torch.equal(wide, plain)


def _poison(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x with the given rows poisoned: NaN for float16, the largest finite e4m3 value for
    fp8 (the interpreter casts an fp8 NaN byte to 480; any value read would move the
    output)."""
    x = x.clone()
    x[rows] = float("nan") if x.dtype == torch.float16 else 448.0
    return x


@pytest.mark.nonfinite
@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 1)])
@pytest.mark.parametrize("mode", ["off", "fp8_inputs"])
@pytest.mark.parametrize("causal", [True, False])
def test_keys_before_every_rows_window_are_never_read(config, mode, causal):
    """Key and value rows before the first query row's window (whole 16-key blocks and
    the start of the block the window's edge cuts) are poisoned: the output is bit-equal
    to the clean call. Sequence 0 has 40 keys and 4 queries, window 2: keys 0..33 are seen
    by no row. (fp8 quantisation, "on", reads every element for its amax: not here.)"""
    args = _args(lens_q=[4, 9, 1, 6], lens_k=[40, 5, 23, 0], window_left=2, causal=causal, mode=mode,
                 descale="per_seq")
    unseen = torch.arange(34)
    q, k, v = args[:3]
    clean = _triton_varlen(*args, config=config)
    dirty = _triton_varlen(q, _poison(k, unseen), _poison(v, unseen), *args[3:], config=config)
    assert torch.equal(dirty, clean)
    # The poisoned rows are really where the test says: one key later, the output moves.
    moved = _triton_varlen(q, _poison(k, torch.arange(35)), v, *args[3:], config=config)
    assert not torch.equal(moved[:4], clean[:4])


def _with_sinks(args, value: float) -> tuple:
    return (*args[:SINKS], torch.full((args[0].shape[1],), value))


def _rows_that_see_a_key(lens_q: list[int], lens_k: list[int], total_q: int) -> torch.Tensor:
    """[Tq] bool, causal: row i of a sequence sees a key when len_k > 0 and i + len_k - len_q >= 0
    (a window never empties a row)."""
    sees = torch.zeros(total_q, dtype=torch.bool)
    start = 0
    for lq, lk in zip(lens_q, lens_k):
        i = torch.arange(lq)
        sees[start : start + lq] = (lk > 0) & (i + lk - lq >= 0)
        start += lq
    return sees


@pytest.mark.nonfinite
@pytest.mark.parametrize("mode", ["off", "on", "fp8_inputs"])
def test_sink_limits(mode):
    """Causal, window 5. A sink of -inf changes nothing (bit-equal to no sinks); +inf
    gives 0 everywhere; NaN makes the rows that see a key NaN and leaves the others 0
    (the first 4 rows of sequence 1, which has fewer keys than queries, all of sequence
    3, which has none, and the padding rows)."""
    args = _args(window_left=5, causal=True, mode=mode, descale="tensor")
    plain = _triton_varlen(*args)
    assert torch.equal(_triton_varlen(*_with_sinks(args, float("-inf"))), plain)
    assert torch.equal(_triton_varlen(*_with_sinks(args, float("inf"))), torch.zeros_like(plain))
    nan = _triton_varlen(*_with_sinks(args, float("nan")))
    sees = _rows_that_see_a_key(LENGTHS["lens_q"], LENGTHS["lens_k"], plain.shape[0])
    assert 0 < sees.sum() < len(sees)
    assert nan[sees].isnan().all() and torch.equal(nan[~sees], torch.zeros_like(nan[~sees]))


@pytest.mark.parametrize("mode", ["off", "on", "fp8_inputs"])
def test_sinks_match_reference(mode):
    """Sinks around the scores' size (they matter) against the reference, windowed."""
    args = _args(window_left=3, mode=mode, descale="per_seq")
    sinks = torch.linspace(-2.0, 3.0, args[0].shape[1])
    _compare((*args[:SINKS], sinks), what=f"sinks {mode}")


@pytest.mark.nonfinite
@pytest.mark.parametrize("mode", ["off", "on", "fp8_inputs"])
@pytest.mark.parametrize("softcap", [0.5, 4.0])
def test_softcap_matches_reference_with_large_scores(mode, softcap):
    """scale 4: most scores lie far past the cap (tanh saturates), where an uncapped
    kernel would be far off; with a window and sinks on top."""
    args = _args(window_left=7, mode=mode, descale="tensor", softcap=softcap, sinks=True)
    args = (*args[:SCALE], 4.0, *args[SCALE + 1 :])
    uncapped = reference.flash_attn_varlen(*args[:SOFTCAP], 0.0, args[SINKS])
    capped = _compare(args, what=f"softcap {softcap} {mode}")
    assert (capped.float() - uncapped.float()).abs().max() > 0.1


@pytest.mark.nonfinite
def test_softcap_turns_infinite_scores_finite():
    """An inf in a query row makes its scores +-inf; capped they are +-softcap, so the
    row stays finite (as the reference computes it)."""
    args = _args(softcap=2.0, causal=False)
    q = args[0].clone()
    q[3, 1, 5] = float("inf")
    args = (q, *args[1:])
    out = _compare(args, what="inf query, softcap")
    assert torch.isfinite(out).all()
