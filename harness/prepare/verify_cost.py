"""Prompt lookup's adaptive budget needs the target's measured verify cost t(n): measured here
once per run (not once per batch slot) over the workload's first prompt, at the run's batch size
(a batched run verifies every request's rows in one forward). It is never cached: each run times it
beside the jobs it shares the machine with (its record's ``concurrent_jobs``), so no timing taken
under other contention prices its budget."""

from __future__ import annotations

from harness.prepare import Preparation
from harness.target.timing import verify_cost_curve
from harness.topology.budgets import budget_from_config, verified_rows


def prepare_prompt_lookup(options: dict, context) -> Preparation:
    if options.get("budget_policy") != "adaptive" or options.get("verify_cost"):
        return Preparation()
    # the verify forward is timed over a real prefix: the first prompt of two tokens or more (a
    # one-token prompt leaves no prefix to time over), else the prompts' tokens repeated to two
    prompts = [list(ids) for _, ids in context.items] if context.items else [[1, 2, 3, 4] * 16]
    ids = next((p for p in prompts if len(p) >= 2), None) or (prompts[0] * 2 if prompts[0] else [1, 2])
    # the rows a round can verify (a chain's max_depth, not an unreachable topology.max_nodes): t(1..rows + 1)
    max_rows = verified_rows(budget_from_config(context.cfg))[0]
    batch_size = int(context.cfg.generation.batch_size)
    profile = verify_cost_curve(context.target_backend, ids, max_rows=max_rows, batch_size=batch_size)
    # the curve the budget uses, and the raw t(n) the record and report show
    return Preparation(options={"verify_cost": profile["normalised"]}, extras={"t_profile": profile["t_profile"]})
