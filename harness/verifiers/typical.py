"""Medusa's typical acceptance (``verifier=typical``): a heuristic, NOT exact.

Rule (Medusa, "typical acceptance"; parameters named as there: ``posterior_threshold`` =
``epsilon``, ``posterior_alpha`` = ``delta``). With ``p`` the target distribution at a node
(under the run's sampling policy) and ``H(p) = -sum_x p(x) log p(x)`` in nats, a child token
``x`` is *typical* iff

    p(x) > min(epsilon, delta * exp(-H(p)))

A candidate row is accepted iff its token is typical under its predictor row's distribution and
its parent row is accepted (the frontier always is). The selected path ends at the DEEPEST
accepted row (ties: the lowest row index, i.e. the first proposed); the next token is sampled from
the target distribution at that row (at the frontier when no row is accepted). The only draw is
that last categorical, through the injected :class:`~harness.random_source.RandomSource`.

Accepting every "plausible enough" token does not preserve the target's law, so the verifier is
registered with ``exact = False``: exact mode refuses it (``negotiate``), and a run that allows it
explicitly records ``exact: false`` together with a drift estimate
(:func:`typical_round_divergence`).
"""

from __future__ import annotations

import math

import torch

from harness.contracts import Selection
from harness.random_source import RandomSource
from harness.topology.compiler import CompiledTree
from harness.verifiers.base import Verifier, register
from harness.verifiers.builtin import ALL_RELATIONS, ALL_SEMANTICS

#: Medusa's defaults (posterior_threshold, posterior_alpha)
DEFAULT_EPSILON = 0.09
DEFAULT_DELTA = 0.3


def typical_threshold(p: torch.Tensor, *, epsilon: float, delta: float) -> torch.Tensor:
    """``min(epsilon, delta * exp(-H(p)))`` per distribution. ``p``: ``[..., V]`` -> ``[...]``."""
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [...] nats
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def typical_accepted_rows(
    tree: CompiledTree, target_probs: torch.Tensor, *, epsilon: float, delta: float
) -> list[bool]:
    """Per candidate row: is it on an all-typical path from the frontier? ``target_probs``
    ``[1 + N, V]``."""
    thresholds = typical_threshold(target_probs, epsilon=epsilon, delta=delta).tolist()  # [1 + N]
    parents = tree.parents.tolist()
    tokens = tree.token_ids.tolist()
    accepted: list[bool] = []
    for r, parent in enumerate(parents):  # rows are topological: a parent precedes its children
        parent_ok = parent == -1 or accepted[parent]
        prob = float(target_probs[parent + 1, tokens[r]])
        accepted.append(parent_ok and prob > thresholds[parent + 1])
    return accepted


def typical_best_row(tree: CompiledTree, target_probs: torch.Tensor, *, epsilon: float, delta: float) -> int:
    """The deepest accepted row (lowest index on a tie), ``-1`` when none is accepted."""
    accepted = typical_accepted_rows(tree, target_probs, epsilon=epsilon, delta=delta)
    depths = tree.depths.tolist()
    best, best_depth = -1, 0
    for r, ok in enumerate(accepted):
        if ok and depths[r] > best_depth:
            best, best_depth = r, depths[r]
    return best


@register
class TypicalVerifier(Verifier):
    """Medusa typical acceptance (heuristic): see the module docstring for the rule."""

    name = "typical"
    exact = False
    probability_semantics = ALL_SEMANTICS
    sampling_relations = ALL_RELATIONS
    temperatures = "any"

    def __init__(self, *, epsilon: float = DEFAULT_EPSILON, delta: float = DEFAULT_DELTA) -> None:
        if not (0.0 < epsilon <= 1.0):
            raise ValueError(f"epsilon (posterior_threshold) must be in (0, 1]; got {epsilon}")
        if not (delta > 0.0 and math.isfinite(delta)):
            raise ValueError(f"delta (posterior_alpha) must be positive; got {delta}")
        self.epsilon = float(epsilon)
        self.delta = float(delta)

    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection:
        best = typical_best_row(tree, target_probs, epsilon=self.epsilon, delta=self.delta)
        path = tree.path_to(best) if best >= 0 else ()
        return Selection(accepted_rows=path, next_token=rng.categorical(target_probs[best + 1]))


def typical_first_token_law(
    tree: CompiledTree, target_probs: torch.Tensor, *, epsilon: float = DEFAULT_EPSILON, delta: float = DEFAULT_DELTA
) -> torch.Tensor:
    """Exact law ``[V]`` of the first emitted token of one typical round on this tree.

    The first token of the selected path when a row is accepted, else a sample of the frontier
    distribution ``target_probs[0]``.
    """
    best = typical_best_row(tree, target_probs, epsilon=epsilon, delta=delta)
    if best < 0:
        return target_probs[0].clone()
    law = torch.zeros_like(target_probs[0])  # [V]
    law[int(tree.token_ids[tree.path_to(best)[0]])] = 1.0
    return law


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """``0.5 * sum |a - b|`` between two distributions ``[V]``."""
    if a.shape != b.shape:
        raise ValueError(f"distributions differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return 0.5 * float((a.to(torch.float64) - b.to(torch.float64)).abs().sum())


def typical_round_divergence(
    tree: CompiledTree, target_probs: torch.Tensor, *, epsilon: float = DEFAULT_EPSILON, delta: float = DEFAULT_DELTA
) -> float:
    """Per-round drift estimate for records: TV between the round's first-token law and ``p``.

    Exact for the given tree. Averaged over rounds it bounds from above the TV between the
    run's first-token law and the target (TV is convex in its first argument), and equals it when
    the candidates do not depend on a random draw. ``harness.gates.oracle.first_token_tv`` gives
    the exact value over a proposal distribution by enumeration.
    """
    law = typical_first_token_law(tree, target_probs, epsilon=epsilon, delta=delta)
    return total_variation(law, target_probs[0])
