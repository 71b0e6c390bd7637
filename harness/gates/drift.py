"""Heuristic drift: how far a run with a heuristic (``exact=False``) verifier leaves the target law.

Exact verifiers are proved by the oracles; a heuristic one (Medusa's typical acceptance,
``verifier=typical``) is allowed only with ``generation.exact=false`` and its record then carries
this estimate under ``metrics.drift``.

Method: real rounds of the configured round (the run's proposer, compiler, target verify forward,
sampling policy and verifier) on the first prompts of the workload, with the spec arm's seeds. In
each round, the EXACT law of the first emitted token given that round's proposal tree is computed
— in closed form for ``typical`` (:func:`~harness.verifiers.typical.typical_first_token_law`),
otherwise by enumerating the verifier's draws with the oracle's enumerating source — and compared
with the target's distribution at the frontier by total variation. The run then continues with the
verifier's own selection (sampled, as in the measured arm). Tokens after the first in an accepted
path are not scored separately (their divergence is of the same kind, conditional on the first).

What the mean over rounds measures depends on the proposer. Where its tree is a function of the
context (prompt lookup, REST, beam children: ``tree_sampled: false``), the round's first-token law
is the emitted token's law, and the mean estimates the per-token divergence itself. Where the tree
is drawn (i.i.d. or without-replacement children, ``tree_sampled: true``), the emitted token's law
is the average of the per-tree laws over the draw; TV is convex, so the per-tree figure bounds it
from above and can be far above it: even an exact verifier scores near ``1 - p(x)`` there (its
per-tree law is not the target's; only the average is). The record says which (``reads_as``).
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig

from harness.gates.e2e import propose_and_verify, select_and_commit
from harness.gates.oracle import enumerate_marginal
from harness.random_source import RandomSource, TorchRandomSource
from harness.topology.compiler import CompiledTree
from harness.verifiers.base import Verifier
from harness.verifiers.typical import TypicalVerifier, typical_first_token_law

#: prompts and rounds per prompt scored by default
DRIFT_PROMPTS = 2
DRIFT_ROUNDS = 4
#: enumeration cap for a generic heuristic verifier's first-token law per round
DRIFT_MAX_LEAVES = 100_000
#: sampling relations whose proposal trees are drawn: the per-tree figure then bounds the drift
SAMPLED_RELATIONS = frozenset({"iid", "without_replacement"})

METHOD = (
    "mean over real rounds (first prompts, spec-arm seeds) of the total variation between the exact law of "
    "the round's first emitted token given its proposal tree and the target's frontier distribution "
    "under the run's sampling policy"
)


def first_token_law(
    verifier: Verifier, tree: CompiledTree, target_probs: torch.Tensor, *, max_leaves: int = DRIFT_MAX_LEAVES
) -> torch.Tensor:
    """Exact law ``[V]`` (float64) of the first token one ``select`` emits on ``tree``.
    ``target_probs``: ``[1 + N, V]``."""

    probs = target_probs.to(torch.float64)
    if isinstance(verifier, TypicalVerifier):
        return typical_first_token_law(tree, probs, epsilon=verifier.epsilon, delta=verifier.delta)

    def first(rng: RandomSource) -> int:
        sel = verifier.select(tree, probs, rng)
        return int(tree.token_ids[sel.accepted_rows[0]]) if sel.accepted_rows else int(sel.next_token)

    law = torch.zeros(probs.shape[-1], dtype=torch.float64, device=probs.device)  # [V]
    for tok, p in enumerate_marginal(first, max_leaves=max_leaves).items():
        law[tok] += p
    return law


@torch.inference_mode()
def heuristic_drift(
    cfg: DictConfig, *, plan_, backend, proposer, items, prompts: int = DRIFT_PROMPTS, rounds: int = DRIFT_ROUNDS
) -> dict:
    """Drift estimate of the configured (heuristic) round; the ``metrics.drift`` record entry."""
    t0 = time.perf_counter()
    verifier, policy = plan_.verifier, plan_.policy
    per_round: list[float] = []
    accepted: list[int] = []
    for i, (_prompt, ids) in enumerate(items[:prompts]):
        rng = TorchRandomSource(int(cfg.seed) * 1_000_003 + i)  # the spec arm's seed of this prompt
        seq = backend.prefill_one(list(ids))
        proposer.start(list(ids))
        committed = list(ids)
        for _ in range(rounds):
            _, tree, probs = propose_and_verify(
                target=backend,
                seq=seq,
                proposer=proposer,
                policy=policy,
                committed=committed,
                rng=rng,
                max_nodes=plan_.budget.max_nodes,
                max_depth=plan_.budget.max_depth,
            )
            law = first_token_law(verifier, tree, probs)  # [V]
            p = probs[0].to(torch.float64)  # [V] the target's frontier law
            per_round.append(0.5 * float((law - p).abs().sum()))
            sel, emitted = select_and_commit(
                target=backend, seq=seq, verifier=verifier, tree=tree, target_probs=probs, rng=rng
            )
            accepted.append(len(sel.accepted_rows))
            committed.extend(emitted)
            proposer.observe_commit(committed)
        proposer.finish()
    n = len(per_round)
    params = {k: getattr(verifier, k) for k in ("epsilon", "delta") if hasattr(verifier, k)}
    sampled = bool(set(proposer.capabilities().sampling_relations) & SAMPLED_RELATIONS)
    return {
        "metric": "first_token_total_variation",
        "method": METHOD,
        "tree_sampled": sampled,
        "reads_as": "upper_bound" if sampled else "divergence",
        "verifier": verifier.name,
        "verifier_params": params,
        "temperature": policy.temperature,
        "prompts": min(prompts, len(items)),
        "rounds": n,
        "mean_tv": sum(per_round) / n if n else None,
        "max_tv": max(per_round) if n else None,
        "min_tv": min(per_round) if n else None,
        "per_round_tv": [round(x, 6) for x in per_round],
        "mean_accepted_per_round": sum(accepted) / n if n else None,
        "seconds": time.perf_counter() - t0,
    }
