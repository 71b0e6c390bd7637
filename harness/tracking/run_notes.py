"""What a record's figures need said beside them, wherever they are shown: by the run on the
console, by ``harness compare`` and the report, by the Spec-Bench export."""

from __future__ import annotations

#: a prompt whose arm took this many times its arm's median time per round is flagged
TIMING_OUTLIER_FACTOR = 3.0

#: a decode speedup at least this factor above the tokens committed per round is noted (with one token
#: per round, nothing accepted: a speedup from 1.05x)
PAST_ROUNDS_FACTOR = 1.05


def timing_outlier_note(outliers: list[dict]) -> str:
    """One line naming a run's timing outliers (a record's ``metrics.timing_outliers``: prompts whose
    arm took :data:`TIMING_OUTLIER_FACTOR` times its median time per round or more)."""
    named = ", ".join(f"{o['prompt_id']} ({o['arm']}, {o['ratio']:.1f}x)" for o in outliers[:3])
    more = f" and {len(outliers) - 3} more" if len(outliers) > 3 else ""
    prompts = "prompt's arm" if len(outliers) == 1 else "prompts' arms"
    return (
        f"{len(outliers)} {prompts} took {TIMING_OUTLIER_FACTOR:g}x or more the arm's median time per round: "
        f"{named}{more}; a stall, not the method: their speedups are suspect (metrics.timing_outliers)"
    )


def sped_up_past_rounds(speedup: float | None, per_round: float | None) -> bool:
    """Whether a decode speedup is :data:`PAST_ROUNDS_FACTOR` times the tokens committed per round or
    more: a round runs at least one verify forward, which costs about the baseline's one-row step, so
    speculation gives at most its tokens per round. False where either figure is missing."""
    if speedup is None or per_round is None or speedup != speedup or per_round != per_round:
        return False
    return speedup >= max(per_round, 1.0) * PAST_ROUNDS_FACTOR


def rounds_bound(metrics: dict) -> tuple[float | None, str | None]:
    """The speedup speculation gives at most by a record's round counts, and how the note names it
    (None where batched and the batch figures are missing; the name None at batch 1).
    At batch 1 a round runs one verify forward, about the baseline's step: the bound is the tokens
    committed per round. At batch size B > 1 one verify forward serves every live request of a batch
    round, and a request's tokens per round do not bound the batch's time: the baseline's batch steps
    per token over the speculative arm's batch rounds per token do (``ar_batch_rounds / batch_rounds``
    when both arms commit as many tokens)."""
    per_round = metrics.get("mean_committed_per_round")
    if max(metrics.get("batch_requests") or [1]) <= 1:
        return per_round, None
    figures = [metrics.get(k) for k in ("ar_batch_rounds", "ar_tokens", "batch_rounds", "committed_tokens")]
    if not all(isinstance(x, int | float) and x > 0 for x in figures):
        return None, None
    ar_rounds, ar_tokens, rounds, tokens = figures
    bound = (ar_rounds / ar_tokens) / (rounds / tokens)
    name = (
        f"the {bound:.2f}x its batch rounds allow (the baseline's {ar_rounds:g} batch steps for {ar_tokens:g} "
        f"tokens, the speculative arm's {rounds:g} batch rounds for {tokens:g})"
    )
    return bound, name


def past_rounds_speedup_note(metrics: dict) -> str | None:
    """One line when the speculative arm's decode ran faster than its rounds allow (:func:`rounds_bound`:
    its tokens per round at batch 1, the arms' batch rounds above), or None.
    Each of its rounds runs a verify forward of at least the baseline step's rows plus the proposal,
    so such a speedup comes from the forward's kernels at several rows (a one-row forward taking a
    slower path) or from the machine's load while the arms were timed: not from speculation. A stall
    shows in the timing outliers only with three prompts or more; this holds for any number."""
    speedup, per_round = metrics.get("decode_speedup"), metrics.get("mean_committed_per_round")
    bound, batched = rounds_bound(metrics)
    if not sped_up_past_rounds(speedup, bound):
        return past_rounds_end_to_end_note(metrics)
    step = "batch step" if batched else "one-row step"
    why = (
        "the machine's load while the arms were timed, or a verify forward of several rows running faster than "
        f"the baseline's {step} (metrics.decode_speedup)"
    )
    if per_round is not None and per_round <= 1.0:
        return (
            f"decode speedup {speedup:.2f}x with no proposed token accepted (one token per round, as the baseline "
            f"commits per step): not speculation's; {why}"
        )
    if batched:
        return (
            f"decode speedup {speedup:.2f}x, past {batched}: each batch round runs at least one verify forward, "
            f"about the baseline's batch step, so speculation gives at most that; {why}"
        )
    return (
        f"decode speedup {speedup:.2f}x from {per_round:.2f} tokens committed per round: each round runs at least "
        f"one verify forward, about the baseline's step, so speculation gives at most its tokens per round; {why}"
    )


def past_rounds_end_to_end_note(metrics: dict) -> str | None:
    """One line when the end-to-end speedup (prefill counted) is past what the rounds allow
    (:func:`rounds_bound`) while the decode speedup is not, or None: the speculative arm prefills the
    same prompts (and a draft's), so its prefill cannot be faster than the baseline's; such a figure is
    the prefills' timing (a first forward's one-time costs, the machine's load), not speculation."""
    speedup, per_round = metrics.get("speedup"), metrics.get("mean_committed_per_round")
    bound, batched = rounds_bound(metrics)
    if not sped_up_past_rounds(speedup, bound):
        return None
    spec, ar = metrics.get("prefill_ms_total"), metrics.get("ar_prefill_ms_total")
    prefills = (
        f": the speculative arm's prefills took {spec:.1f} ms against the baseline's {ar:.1f} ms for the same prompts"
        if isinstance(spec, int | float) and isinstance(ar, int | float)
        else ""
    )
    past = (
        f", past {batched}"
        if batched
        else f" from {per_round:.2f} tokens committed per round, past what speculation gives"
    )
    return (
        f"end-to-end speedup {speedup:.2f}x{past}{prefills}; the prefills' timing (a first forward's one-time "
        "costs, the machine's load), not speculation (metrics.speedup)"
    )


def batched_history_note(config: dict) -> str | None:
    """One line where prompt lookup's history (``proposer.history_tokens``, itself or as a merged
    source) runs at a batch size above one, or None: the requests of a batch start together, and a
    request searches only the outputs finished before it started, so it never reads its batch's own;
    its acceptance then falls with the batch size, apart from what batching costs."""
    batch = int((config.get("generation") or {}).get("batch_size") or 1)
    proposer = config.get("proposer") or {}
    lookup = proposer if proposer.get("name") == "prompt_lookup" else None
    if proposer.get("name") == "merged" and "prompt_lookup" in (proposer.get("sources") or []):
        lookup = proposer.get("prompt_lookup") or {}
    if batch <= 1 or not lookup or not int(lookup.get("history_tokens") or 0):
        return None
    return (
        f"at generation.batch_size={batch} prompt lookup's history (proposer.history_tokens) serves a request the "
        "outputs finished before it started: a batch's requests start together and never read each other, so its "
        "acceptance is lower than at batch 1 for a reason besides batching's cost"
    )
