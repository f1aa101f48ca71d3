"""What a precision setting of the model costs end to end: logit error and greedy-pick
agreement of one model against another with the same weights (and, when given,
transformers' float32 forward as the exact answer).

`compare_decoding(a, b, prompts, steps, oracle=None)` prefills both models with the same
prompts and decodes `steps` tokens, feeding both the picks of `a` (teacher forcing, so the
two see the same tokens and every step measures the same question). Used by
`benchmarks/prefill_fp8_accuracy.py` (README, "Prefill precision") and the GPU tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphsafe.models.model import DeepseekV32Model


def _row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: max |got - want| / max |want|, and ||got - want|| / ||want||."""
    got, want = got.float(), want.float()
    diff = got - want
    peak = diff.abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)
    l2 = diff.norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    return peak, l2


def _decode(model: DeepseekV32Model, prompts: Sequence[Sequence[int]], feed: torch.Tensor | None,
            steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, steps + 1, vocab] (prefill's last token, then each decode step) and the
    tokens fed [B, steps + 1] (`feed` if given, else the model's own greedy picks)."""
    state = model.new_state()
    logits = model.prefill(state, prompts)
    out, fed = [logits.float().cpu()], []
    for s in range(steps + 1):
        tok = feed[:, s].to(logits.device) if feed is not None else logits.argmax(-1)
        fed.append(tok.cpu())
        if s == steps:
            break
        logits = model.decode_step(model.decode_inputs(state, tok))
        model.advance(state, tok)
        out.append(logits.float().cpu())
    return torch.stack(out, 1), torch.stack(fed, 1)


@torch.no_grad()
def compare_decoding(a: DeepseekV32Model, b: DeepseekV32Model, prompts: Sequence[Sequence[int]], steps: int,
                     oracle: Any = None) -> dict[str, Any]:
    """`a` against `b` (same weights, other settings) over `steps` greedy tokens.

    Returns per-position statistics over all rows and steps: `peak_err` (max |b - a| /
    max |a| of a row: median and max), `rel_l2` (median, max), `agree` (fraction of
    positions where b's argmax equals a's); with `oracle` (a transformers model whose
    forward takes token ids on its own device), the same for `a` and `b` against it.
    """
    logits_a, fed = _decode(a, prompts, None, steps)
    logits_b, _ = _decode(b, prompts, fed, steps)
    result: dict[str, Any] = {"rows": len(prompts), "positions": logits_a.shape[0] * logits_a.shape[1]}

    def stats(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        peak, l2 = _row_errors(got, want)
        result[name] = {
            "peak_err_median": float(peak.median()), "peak_err_max": float(peak.max()),
            "rel_l2_median": float(l2.median()), "rel_l2_max": float(l2.max()),
            "agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        }

    stats("b_vs_a", logits_b, logits_a)
    if oracle is not None:
        device = next(oracle.parameters()).device
        exact = []
        for r, prompt in enumerate(prompts):
            ids = torch.tensor([list(prompt) + fed[r, :-1].tolist()], device=device)
            exact.append(oracle(ids).logits[0, len(prompt) - 1:].float().cpu())
        exact_t = torch.stack(exact)
        stats("a_vs_oracle", logits_a, exact_t)
        stats("b_vs_oracle", logits_b, exact_t)
    return result
