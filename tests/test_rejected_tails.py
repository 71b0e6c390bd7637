"""Prompt lookup's rejected tails: after a round, the tails of candidates the target rejected by one
substituted token, proposed after the target's own token (a copy resuming past a one-token edit)."""

import numpy as np
import pytest
from helpers import greedy_tokens

from harness.contracts import Budget, ConfigError
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import AcceptanceModel, PromptLookupProposer, candidate_tree, rejected_tails
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model

MATCHES = [
    (3, np.array([9, 1, 2, 3]), False),
    (1, np.array([9, 4, 5]), True),
    (2, np.array([7, 8, 6]), False),
    (1, np.array([9, 5, 2, 3]), False),  # after a substitution at depth 2 its tail equals the first's
]


def test_a_rejected_tail_is_what_followed_the_substituted_token_of_a_leaf_on_the_accepted_path():
    tree = candidate_tree(MATCHES, limit=16)
    # the target accepted 9 and then wrote 6: the leaves under 9 held 1, 4 and 5 there
    assert rejected_tails(tree, (9, 6)) == [(3, (2, 3), False, 1), (1, (5,), True, 1)]  # (2, 3) once
    # the target wrote 5 at once: every candidate's first token was substituted
    assert rejected_tails(tree, (5,)) == [
        (3, (1, 2, 3), False, 0),
        (1, (4, 5), True, 0),
        (2, (8, 6), False, 0),
        (1, (5, 2, 3), False, 0),
    ]
    # the target wrote 7: the candidate under 7 was not rejected there, so no tail comes from it
    assert rejected_tails(tree, (7,)) == [(3, (1, 2, 3), False, 0), (1, (4, 5), True, 0), (1, (5, 2, 3), False, 0)]
    # the target's token at depth 2 was 4: the 4 5 leaf was accepted there, the others were not
    assert rejected_tails(tree, (9, 4)) == [(3, (2, 3), False, 1)]
    # a candidate rejected at its last token has nothing after it; a path the candidates left earlier
    # gives no tail either
    assert rejected_tails(tree, (9, 1, 2, 8)) == []
    assert rejected_tails(tree, (7, 9, 4)) == []
    assert rejected_tails(tree, ()) == [] and rejected_tails(candidate_tree([], limit=8), (3,)) == []


def test_tails_join_the_candidate_tree_after_the_matches_marked_with_their_run():
    tails = [(3, (2, 3), False, 1), (1, (5,), True, 2)]
    tree = candidate_tree([(2, np.array([2, 7]), False)], limit=16, tails=tails)
    assert tree.prefixes == ((2,), (2, 7), (2, 3), (5,))
    assert tree.tail.tolist() == [False, False, True, True]  # (2,) was the match's: the match made it
    assert tree.tail_run.tolist() == [0, 0, 1, 2]
    assert tree.history.tolist() == [False, False, False, True]
    # a tail counts in the rows the tails made only: the match's rows keep their own features
    assert tree.support.tolist() == [1, 1, 1, 1]
    assert tree.parent_support.tolist() == [1, 1, 1, 2]  # below the root: the matches, or the tails
    assert tree.rank.tolist() == [0, 0, 1, 1]
    raw = AcceptanceModel.raw_features(tree)
    alone = candidate_tree([(2, np.array([2, 7]), False)], limit=16)
    np.testing.assert_array_equal(raw[:2], AcceptanceModel.raw_features(alone))
    assert raw[:, AcceptanceModel.FEATURES.index("tail")].tolist() == [0, 0, 1, 1]
    np.testing.assert_allclose(raw[:, AcceptanceModel.FEATURES.index("log_tail_run")], np.log1p([0, 0, 1, 2]))
    assert len(AcceptanceModel.MEAN) == len(AcceptanceModel.SCALE) == len(AcceptanceModel.WEIGHTS) == raw.shape[1]
    assert candidate_tree([(2, np.array([2, 7]), False)], limit=2, tails=tails).prefixes == ((2,), (2, 7))


def _proposer(tails, **kw):
    return PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=8, max_depth=4),
        manifest_hash="h",
        rejected_tails=tails,
        **kw,
    )


def test_the_proposer_offers_a_rejected_tail_in_the_round_after_the_rejection_only():
    prompt = [9, 1, 2, 3, 4, 5, 6, 9]  # the final 9 proposes 1 2 3 4
    for tails in (False, True):
        prop = _proposer(tails)
        prop.start(prompt)
        committed = list(prompt)
        assert [n.token_id for n in prop.propose(committed, TorchRandomSource(0)).nodes] == [1, 2, 3, 4]
        committed = committed + [7]  # the target wrote 7 where the copy said 1
        prop.observe_commit(committed)
        # a proposal at another length than the commit the tails follow does not see them
        assert prop.propose(committed + [8], TorchRandomSource(0)).nodes == ()
        after = [n.token_id for n in prop.propose(committed, TorchRandomSource(0)).nodes]
        # nothing earlier follows 9 7 or 7: only the tail resumes the copy
        assert after == ([2, 3, 4] if tails else [])
    assert prop.stats.extras["rows_kept_from_tails"] == 3 and prop.last_candidates.tail.all()
    # the tails are still held for this length (no commit since); a new request whose prompt has
    # that length starts without them
    prop.start(committed)
    assert prop.last_candidates is None
    assert prop.propose(committed, TorchRandomSource(0)).nodes == ()
    with pytest.raises(ValueError, match="rejected_tails"):
        PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="h", rejected_tails=True)
    with pytest.raises(ConfigError, match="topology=sequences"):
        PromptLookupProposer.check_plan({"rejected_tails": True}, Budget("sequence", 4, 4), None)
    PromptLookupProposer.check_plan({"rejected_tails": True}, Budget("sequences", 4, 4), None)


@pytest.mark.parametrize("budget_policy", ["fixed", "adaptive"])
def test_greedy_output_with_rejected_tails_equals_the_target_s(budget_policy):
    target = CausalLMBackend(build_tiny_model(seed=3))
    options = {"budget_policy": "adaptive", "verify_cost": [1.0 + 0.01 * k for k in range(9)]}
    prop = _proposer(True, **(options if budget_policy == "adaptive" else {}))

    null = NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="h")
    for prompt in ([5, 17, 33, 8, 5, 17, 33, 9, 40, 41], [7, 3, 7, 4, 7, 5, 3, 4, 5, 7], list(range(20, 40)) * 2):
        assert greedy_tokens(target, prompt, 40, prop) == greedy_tokens(target, prompt, 40, null)
    assert prop.stats.extras["rows_kept_from_tails"] > 0


def test_the_end_to_end_oracle_runs_rounds_whose_trees_hold_tails(monkeypatch):
    import harness.proposers.prompt_lookup as lookup
    from harness.gates import e2e as E
    from harness.verifiers.base import VERIFIERS

    made = []
    real = lookup.rejected_tails

    def counted(tree, continuation):
        out = real(tree, continuation)
        made.append(len(out))
        return out

    monkeypatch.setattr(lookup, "rejected_tails", counted)
    case = {c.name: c for c in E.e2e_cases()}["lookup/sequences-tails/T1/2-rounds"]
    row = E.check_e2e_case(VERIFIERS["membership"](), case, E.E2EModels.build())
    assert row["passed"] and row["max_abs_error"] <= row["bound"]
    assert made and max(made) > 0  # some first round left tails for the second
