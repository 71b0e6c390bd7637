"""A deliberately wrong verifier: the oracle's negative control (one-draft acceptance
repeated over k candidates).

``naive_multi_draft`` tests each of the ``k`` draws below a node against the ORIGINAL target
``p`` with the one-draft rule ``min(1, p(x) / q(x))`` and, when all are rejected, samples the
one-draft correction ``norm([p - q]_+)``. With one draw this is the correct rejection rule; with
``k > 1`` every extra chance to accept the same token duplicates its mass (all drafts 1,
target Bernoulli(1/2), ``k`` copies output 1 with probability at least ``1 - 2^-k``).

It is registered ``exact=True`` (it claims exactness, as a buggy verifier would) and
``test_only=True``: it is never offered to runs, and ``harness oracles`` runs it as the negative
control that must be caught. Import this module to register it.
"""

from __future__ import annotations

import torch

from harness.contracts import Selection
from harness.random_source import RandomSource
from harness.topology.compiler import CompiledTree
from harness.verifiers.base import Verifier, register
from harness.verifiers.builtin import positive_residual


@register
class NaiveMultiDraftVerifier(Verifier):
    """WRONG on purpose: each draw tested against the original p, not the residual."""

    name = "naive_multi_draft"
    exact = True
    test_only = True
    probability_semantics = frozenset({"normalized_conditional"})
    sampling_relations = frozenset({"iid"})
    topologies = frozenset({"set", "tree"})
    temperatures = "positive"

    def select(self, tree: CompiledTree, target_probs: torch.Tensor, rng: RandomSource) -> Selection:
        q_dists = tree.q_dists
        node, path = -1, []
        while True:
            p = target_probs[node + 1]  # [V], never updated: the bug
            accepted, last_q = None, None
            for draw in tree.draws[node + 1]:
                if draw.q_index < 0 or q_dists is None:
                    raise ValueError(f"verifier {self.name!r}: draw for row {draw.row} carries no q")
                q = q_dists[draw.q_index].to(p.dtype)  # [V]
                x = int(tree.token_ids[draw.row])
                if rng.bernoulli(min(1.0, float(p[x]) / float(q[x]))):
                    accepted = draw.row
                    break
                last_q = q
            if accepted is None:
                correction = p if last_q is None else positive_residual(p, last_q)
                return Selection(accepted_rows=tuple(path), next_token=rng.categorical(correction))
            path.append(accepted)
            node = accepted
