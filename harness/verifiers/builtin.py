"""Built-in verifiers: greedy, membership, one-draft rejection, SpecInfer residual, Sequoia.

Each is a short walk over the compiled tree from the frontier (node ``-1``) down one accepted
path. ``target_probs[1 + node]`` is the target distribution at ``node``.
"""

from __future__ import annotations

import math

import torch

from harness.contracts import ContractError, Selection
from harness.random_source import RandomSource
from harness.topology.compiler import CompiledTree
from harness.verifiers.base import Verifier, register, walk_children
from harness.verifiers.sampling import SamplingPolicy, argmax_rows

ALL_SEMANTICS = frozenset({"normalized_conditional", "score_only", "frequency", "absent"})
ALL_RELATIONS = frozenset({"iid", "without_replacement", "beam", "deterministic_lookup"})


def positive_residual(residual: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm([residual - q]_+)`` (SpecInfer's residual update). ``[V]``. If no mass is left (only
    reachable through rounding: rejection then had probability 0), the residual is returned
    unchanged."""
    diff = (residual - q).clamp_min(0.0)
    z = diff.sum()
    if float(z) <= 1e-12:
        return residual
    return diff / z


@register
class GreedyVerifier(Verifier):
    """Accept the child equal to the target argmax; emit the argmax where none matches."""

    name = "greedy"
    probability_semantics = ALL_SEMANTICS
    sampling_relations = ALL_RELATIONS
    temperatures = "zero"

    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection:
        return self._walk(tree, argmax_rows(target_probs).tolist())

    def select_logits(
        self, tree: CompiledTree, logits: torch.Tensor, policy: SamplingPolicy, rng: RandomSource
    ) -> Selection:
        """At temperature 0 the policy's law is the one-hot of each row's argmax (the first index of
        its maximum), whose argmax is that index again: walk the logits' argmax directly, without
        building the ``[1 + N, V]`` one-hot. This holds for any policy whose greedy law is the one-hot of
        the argmax of the logits in their own or a wider dtype (a narrower one could round two values
        into a tie)."""
        if not policy.greedy:
            return super().select_logits(tree, logits, policy, rng)
        return self._walk(tree, argmax_rows(logits).tolist())

    @staticmethod
    def _walk(tree: CompiledTree, argmax: list[int]) -> Selection:
        """Follow the child carrying each reached node's argmax (``argmax[1 + node]``)."""
        node, path = -1, []
        while True:
            tok = int(argmax[node + 1])
            child = walk_children(tree, node, tok)
            if child is None:
                return Selection(accepted_rows=tuple(path), next_token=tok)
            path.append(child)
            node = child


@register
class MembershipVerifier(Verifier):
    """Sample from the target at each reached node; follow the child carrying that token.

    Needs no q, so it is valid for deterministic, score-only, frequency and heterogeneous
    (merged) candidate sets. The output is exactly a target sample path.
    """

    name = "membership"
    probability_semantics = ALL_SEMANTICS
    sampling_relations = ALL_RELATIONS

    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection:
        node, path = -1, []
        while True:
            tok = rng.categorical(target_probs[node + 1])
            child = walk_children(tree, node, tok)
            if child is None:
                return Selection(accepted_rows=tuple(path), next_token=tok)
            path.append(child)
            node = child


class _ResidualVerifier(Verifier):
    """Multi-candidate residual update (SpecInfer, Miao et al., 2024); with one draw per node it is
    the one-draft rejection rule. Each draw is tested against the *current* residual with the law
    it was drawn from; after a rejection the residual becomes norm([residual - q_i]_+)."""

    probability_semantics = frozenset({"normalized_conditional"})
    temperatures = "positive"

    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection:
        q_dists = tree.q_dists
        node, path = -1, []
        while True:
            residual = target_probs[node + 1]
            accepted = None
            for draw in tree.draws[node + 1]:
                if draw.q_index < 0 or q_dists is None:
                    raise ValueError(f"verifier {self.name!r}: draw for row {draw.row} carries no q")
                q = q_dists[draw.q_index].to(residual.dtype)
                x = int(tree.token_ids[draw.row])
                # the drawn token's probability in the law's own dtype: a float64 draft's tiny q
                # rounds to 0 in a float32 target's dtype, where the ratio is still p / q
                qx = float(q_dists[draw.q_index, x])
                if not qx > 0.0:
                    raise ContractError(
                        f"verifier {self.name!r}: row {draw.row}'s token {x} was drawn from a law that gives it "
                        f"probability {qx!r}"
                    )
                ratio = float(residual[x]) / qx
                if math.isnan(ratio):  # min(1.0, nan) is 1.0: a NaN row would accept every draw
                    raise ContractError(
                        f"verifier {self.name!r}: the acceptance ratio of row {draw.row} is not a number "
                        f"(target {float(residual[x])!r}, q {qx!r})"
                    )
                if rng.bernoulli(min(1.0, ratio)):
                    accepted = draw.row
                    break
                residual = positive_residual(residual, q)
            if accepted is None:
                return Selection(accepted_rows=tuple(path), next_token=rng.categorical(residual))
            path.append(accepted)
            node = accepted


@register
class RejectionVerifier(_ResidualVerifier):
    """One-draft p/q rejection on a sampled sequence (Leviathan et al., 2023: a maximal coupling)."""

    name = "rejection"
    sampling_relations = frozenset({"iid"})
    topologies = frozenset({"sequence"})


@register
class SpecInferVerifier(_ResidualVerifier):
    """SpecInfer multi-step residual verification over i.i.d. sampled children (Miao et al., 2024)."""

    name = "specinfer"
    sampling_relations = frozenset({"iid"})


@register
class SequoiaVerifier(_ResidualVerifier):
    """Sequoia's verifier: the residual update paired with without-replacement sampling (Chen et
    al., 2024).

    The proposal side removes each sampled token from later draws at the same parent and falls
    back to a uniform law over unsampled tokens when the draft mass is exhausted; each draw
    carries the law it was actually drawn from, and the residual update uses exactly that law.
    """

    name = "sequoia"
    sampling_relations = frozenset({"without_replacement"})
