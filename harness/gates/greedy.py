"""Greedy equality: at temperature 0 the speculative output equals the autoregressive output token for
token; the only tolerated divergence is a recorded near-tie.

CPU (and GPU) matrix kernels are not shape-invariant: a verify forward of several rows can round the
logits of a position differently from a one-row step, so two exact greedy decoders may pick
different tokens where the target's top logits (nearly) tie. A divergence is a near-tie only when
both the autoregressive token and the speculative token lie within the dtype's tolerance of the
target's top logit at that position. Every token of the speculative output is checked, not only
the first divergence: after the outputs part ways their contexts differ, so each speculative token
is checked against the target's logits at its own context (one teacher-forced forward over the
prompt and the speculative output). More near-ties than ``max_fraction`` of the generated tokens
fail the gate as well.

Conversations: every turn is checked. Each arm's turn-k prompt carries its own earlier answers, so
after a near-tie in an earlier turn the two arms' prompts differ; such a turn has no AR output to
compare with and every speculative token is checked against the target at its own context (a
token off the top logit is a near-tie within the tolerance, a failure past it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from harness.gates.status import GateError

#: a divergence whose tokens are both within this many logits of the top logit is a near-tie
NEAR_TIE_LOGIT_TOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.125, torch.float16: 0.03}
#: in half precision, or this many units in the last place at the top logit's magnitude where that is
#: more: bfloat16 logits from 32 to 64 lie 0.25 apart, so two tokens that tie in one forward can be a
#: step or two apart in another that rounds its hidden states differently
NEAR_TIE_ULPS = {torch.bfloat16: 2, torch.float16: 2}


def near_tie_tolerance(dtype: torch.dtype | None, floor: float, top: float) -> float:
    """The near-tie tolerance at a position whose top logit is ``top``: ``floor`` (the dtype's
    :data:`NEAR_TIE_LOGIT_TOL`), or :data:`NEAR_TIE_ULPS` units in the last place of ``dtype`` at the top
    logit's magnitude where that is larger."""
    ulps = NEAR_TIE_ULPS.get(dtype) if dtype is not None else None
    if ulps is None or not math.isfinite(top) or top == 0:
        return floor
    return max(floor, ulps * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(top))))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where two token lists differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


@torch.inference_mode()
def teacher_forced_logits(model: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """The target's logits predicting each generated token from its own context: ``[len(generated), V]``."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(generated[:-1])], device=device)
    logits = model(input_ids=ids).logits[0].float()  # [P + G - 1, V]
    return logits[len(prompt) - 1 :]


def _gap(logits: torch.Tensor, token: int) -> float:
    """Top logit minus the token's logit (0 for the argmax)."""
    return float(logits.max() - logits[token])


def check_prompt(
    model,
    *,
    prompt_id,
    prompt: Sequence[int],
    ar: Sequence[int],
    spec: Sequence[int],
    tol: float,
    turn: int = 1,
    ar_prompt: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
):
    """Near-ties of one prompt turn's outputs; raises GateError at a divergence that is not one.
    ``ar_prompt`` (when it differs from ``prompt``): the AR arm's own prompt for this turn; ``tol``
    the near-tie tolerance, widened in half precision ``dtype`` (the model's) to the top logit's
    units in the last place (:func:`near_tie_tolerance`)."""
    where = f"prompt {prompt_id!r}" + (f" turn {turn}" if turn != 1 else "")
    same_prompt = ar_prompt is None or list(ar_prompt) == list(prompt)
    pos = first_divergence(ar, spec) if same_prompt else 0
    if pos is None or not spec and not same_prompt:
        return []
    if same_prompt and (pos >= len(spec) or pos >= len(ar)):
        raise GateError(
            f"greedy equality failed on {where}: one arm stopped at generated position {pos} "
            f"({len(ar)} AR vs {len(spec)} speculative tokens)"
        )
    logits = teacher_forced_logits(model, prompt, spec)  # [G, V]
    ties = []
    for t in range(pos, len(spec)):
        gap = _gap(logits[t], spec[t])
        ar_gap = _gap(logits[t], ar[t]) if (same_prompt and t == pos) else None
        if gap == 0.0 and ar_gap is None:
            continue
        tol_t = near_tie_tolerance(dtype, tol, float(logits[t].max()))
        if gap > tol_t or (ar_gap is not None and ar_gap > tol_t):
            raise GateError(
                f"greedy equality failed on {where} at generated position {t}: speculative token "
                f"{spec[t]} is {gap:.3g} below the target's top logit"
                + (f" (AR token {ar[t]}: {ar_gap:.3g})" if ar_gap is not None else "")
                + f", over the near-tie tolerance {tol_t:.3g}"
                + ("" if same_prompt else " (the arms' prompts differ after an earlier near-tie)")
            )
        ties.append(
            {
                "prompt_id": prompt_id,
                "turn": turn,
                "position": t,
                "ar_token": int(ar[t]) if ar_gap is not None else None,
                "spec_token": int(spec[t]),
                "spec_gap": gap,
                "ar_gap": ar_gap,
                "tolerance": tol_t,
            }
        )
    return ties


def output_turns(o: dict) -> list[dict]:
    """An outputs row's turns (``turns``; a row without them is one turn with its top-level ids)."""
    if o.get("turns"):
        return list(o["turns"])
    return [
        {
            "turn": 1,
            "spec_prompt_token_ids": o["prompt_token_ids"],
            "ar_prompt_token_ids": o["prompt_token_ids"],
            "ar_token_ids": o["ar_token_ids"],
            "spec_token_ids": o["spec_token_ids"],
        }
    ]


def greedy_equality(model: torch.nn.Module, outputs: Sequence[dict], *, max_fraction: float, dtype=None) -> dict:
    """The greedy-equality gate over a run's outputs, every turn of every prompt (``turns``, each
    with ``spec_prompt_token_ids``, ``ar_prompt_token_ids``, ``ar_token_ids``, ``spec_token_ids``;
    or the top-level ``prompt_token_ids``, ``ar_token_ids``, ``spec_token_ids`` of a one-turn row).
    Returns the gate entry; raises GateError on failure."""
    dtype = dtype or next(model.parameters()).dtype
    tol = NEAR_TIE_LOGIT_TOL.get(dtype, 1e-3)
    ties: list[dict] = []
    tokens = turns = identical = differing_prompts = 0
    for o in outputs:
        for tr in output_turns(o):
            ties += check_prompt(
                model,
                prompt_id=o["prompt_id"],
                prompt=tr["spec_prompt_token_ids"],
                ar_prompt=tr["ar_prompt_token_ids"],
                ar=tr["ar_token_ids"],
                spec=tr["spec_token_ids"],
                tol=tol,
                turn=int(tr.get("turn", 1)),
                dtype=dtype,
            )
            turns += 1
            tokens += len(tr["spec_token_ids"])
            identical += tr["ar_token_ids"] == tr["spec_token_ids"]
            differing_prompts += list(tr["ar_prompt_token_ids"]) != list(tr["spec_prompt_token_ids"])
    entry = {
        "status": "passed",
        "prompts": len(outputs),
        "turns": turns,
        "tokens": tokens,
        "identical_prompts": sum(
            all(tr["ar_token_ids"] == tr["spec_token_ids"] for tr in output_turns(o)) for o in outputs
        ),
        "identical_turns": identical,
        "turns_with_differing_prompts": differing_prompts,
        "near_ties": ties,
        "tolerance": tol,
        "tolerance_ulps_at_top_logit": NEAR_TIE_ULPS.get(dtype),  # where more than ``tolerance``
        "max_near_tie_fraction": max_fraction,
    }
    if ties and len(ties) > max_fraction * max(tokens, 1):
        raise GateError(
            f"greedy equality failed: {len(ties)} near-ties in {tokens} generated tokens, over "
            f"gates.near_tie_max_fraction={max_fraction}"
        )
    return entry
