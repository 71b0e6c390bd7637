"""Medusa typical acceptance: a registered heuristic that exact mode refuses, with a drift estimate."""

from __future__ import annotations

import math

import pytest
import torch

from harness.contracts import Capabilities
from harness.gates import oracle as O
from harness.gates.oracle_cli import run_suite
from harness.topology.compiler import compile_tree
from harness.verifiers import VERIFIERS, NegotiationError, get_verifier, negotiate
from harness.verifiers.typical import (
    TypicalVerifier,
    typical_first_token_law,
    typical_round_divergence,
    typical_threshold,
)

P_REF = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
LOOKUP = Capabilities(
    name="lookup",
    probability_semantics=frozenset({"absent"}),
    sampling_relations=frozenset({"deterministic_lookup"}),
    topology="tree",
)


def test_registered_as_heuristic_and_refused_in_exact_mode():
    assert VERIFIERS["typical"] is TypicalVerifier and TypicalVerifier.exact is False
    v = get_verifier("typical")
    with pytest.raises(NegotiationError, match="heuristic"):
        negotiate(LOOKUP, v, temperature=0.7, exact_mode=True)
    negotiate(LOOKUP, v, temperature=0.7, exact_mode=False)  # allowed explicitly
    assert "typical" not in O.exact_verifier_names()
    with pytest.raises(ValueError, match="heuristic"):
        run_suite(["typical"])


def test_threshold_is_min_of_epsilon_and_entropy_term():
    h = -sum(x * math.log(x) for x in (0.5, 0.3, 0.2))
    got = float(typical_threshold(P_REF, epsilon=0.09, delta=0.3))
    assert got == pytest.approx(min(0.09, 0.3 * math.exp(-h)), abs=1e-15)
    assert got == pytest.approx(0.09, abs=1e-15)  # 0.3 * exp(-1.0297) = 0.107 > 0.09
    # a flat distribution has a lower entropy term: delta * exp(-log 4) = 0.075
    flat = torch.full((4,), 0.25, dtype=torch.float64)
    assert float(typical_threshold(flat, epsilon=0.09, delta=0.3)) == pytest.approx(0.075, abs=1e-15)
    # zeros contribute nothing to the entropy: one-hot -> threshold min(eps, delta)
    assert float(typical_threshold(O.one_hot(3, 1), epsilon=0.5, delta=0.3)) == pytest.approx(0.3, abs=1e-15)


def _tree(table):
    return compile_tree([O.fixed_candidates(table)], 1)


def test_selects_the_deepest_all_typical_path():
    p = {
        (): torch.tensor([0.05, 0.55, 0.4], dtype=torch.float64),
        (1,): torch.tensor([0.02, 0.02, 0.96], dtype=torch.float64),
        (2,): torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64),
        (2, 0): torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
    }
    tree = _tree({(): [0, 1, 2], (1,): [0], (2,): [0]})
    probs = O.target_rows(tree, lambda prefix: p.get(prefix, P_REF))
    sel = TypicalVerifier().select(tree, probs, rng=_FirstBranch())
    # token 0 at the root is atypical (0.05 < 0.09); (1, 0) fails at depth 2 (0.02); (2, 0) passes
    assert [tree.full_prefixes[r] for r in sel.accepted_rows] == [(2,), (2, 0)]
    assert sel.next_token == 0  # sampled from p(. | 2, 0), which is one-hot on token 0


def test_nothing_typical_falls_back_to_a_target_sample():
    tree = _tree({(): [2]})
    probs = O.target_rows(tree, lambda prefix: torch.tensor([0.95, 0.0, 0.05], dtype=torch.float64))
    law = typical_first_token_law(tree, probs)
    assert law.tolist() == pytest.approx([0.95, 0.0, 0.05], abs=1e-15)
    assert typical_round_divergence(tree, probs) == pytest.approx(0.0, abs=1e-15)


def test_drift_estimate_matches_the_oracle_and_is_nonzero():
    tree_table = {(): [1]}  # token 1 has p = 0.3 > 0.09: always accepted
    tree = _tree(tree_table)
    probs = O.target_rows(tree, lambda prefix: P_REF)
    assert typical_first_token_law(tree, probs).tolist() == [0.0, 1.0, 0.0]
    est = typical_round_divergence(tree, probs)
    assert est == pytest.approx(0.7, abs=1e-15)  # TV((0, 1, 0), (0.5, 0.3, 0.2))
    exact = O.first_token_tv(TypicalVerifier(), lambda rng: O.fixed_candidates(tree_table), lambda prefix: P_REF)
    assert exact == pytest.approx(est, abs=1e-12)


def test_oracle_reports_typical_as_not_exact():
    v = TypicalVerifier()
    case = O.OracleCase(
        name="set2",
        proposal_builder=lambda rng: O.fixed_candidates({(): [0, 1]}),
        target=lambda prefix: P_REF,
        length=2,
    )
    row = O.check_case(v, case)
    assert not row["passed"] and row["max_abs_error"] > 0.1


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="epsilon"):
        TypicalVerifier(epsilon=0.0)
    with pytest.raises(ValueError, match="delta"):
        TypicalVerifier(delta=-1.0)


class _FirstBranch:
    """A source for deterministic checks: the first nonzero branch, never random."""

    def bernoulli(self, p: float) -> bool:
        return p > 0.0

    def categorical(self, probs: torch.Tensor) -> int:
        return int(torch.nonzero(probs > 0)[0])
