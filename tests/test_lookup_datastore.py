"""Prompt lookup with a datastore: the continuations a REST datastore holds after the committed
suffix join the lookup's candidate tree, as rows of their own kind the adaptive budget keeps where
they pay; the output stays the target's."""

import numpy as np
import pytest
from helpers import greedy_tokens

from harness.contracts import Budget, ConfigError
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import AcceptanceModel, PromptLookupProposer, candidate_tree
from harness.proposers.rest import RestProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.workloads.datastore import LeakageError, datastore_from_token_ids
from harness.workloads.prompts import Prompt

MATCH = [(2, np.array([2, 7]), False)]
TAILS = [(3, (2, 3), False, 1)]
RETRIEVED = [(4, [2, 7, 9]), (4, [2, 7, 9]), (4, [5, 1])]


def test_retrieved_continuations_join_the_tree_after_the_matches_and_tails_with_their_own_support():
    tree = candidate_tree(MATCH, limit=16, tails=TAILS, retrieved=RETRIEVED)
    assert tree.prefixes == ((2,), (2, 7), (2, 3), (2, 7, 9), (5,), (5, 1))
    assert tree.datastore.tolist() == [False, False, False, True, True, True]
    assert tree.tail.tolist() == [False, False, True, False, False, False]
    # a retrieved continuation through a match's rows leaves their support alone; among the
    # datastore's rows, (2, 7, 9) was retrieved twice, and below the root a datastore row's parent
    # support is the number of retrieved continuations
    assert tree.support.tolist() == [1, 1, 1, 2, 1, 1]
    assert tree.parent_support.tolist() == [1, 1, 1, 1, 3, 1]
    assert tree.context.tolist() == [2, 2, 3, 4, 4, 4]  # a retrieved row's: the suffix the datastore matched
    raw = AcceptanceModel.raw_features(tree)
    alone = AcceptanceModel.raw_features(candidate_tree(MATCH, limit=16, tails=TAILS))
    np.testing.assert_array_equal(raw[:3], alone)  # the other rows' features as without the datastore
    assert raw[:, AcceptanceModel.FEATURES.index("datastore")].tolist() == [0, 0, 0, 1, 1, 1]
    assert len(AcceptanceModel.MEAN) == len(AcceptanceModel.SCALE) == len(AcceptanceModel.WEIGHTS) == raw.shape[1]
    # the retrieved rows come last, so a row limit drops them first
    assert candidate_tree(MATCH, limit=3, tails=TAILS, retrieved=RETRIEVED).prefixes == ((2,), (2, 7), (2, 3))


def _retriever(docs, nodes=8, depth=4):
    return RestProposer(
        budget=Budget("tree", nodes, depth), manifest_hash="h", datastore=datastore_from_token_ids(docs), min_suffix=2
    )


def _proposer(retriever, **kw):
    return PromptLookupProposer(
        budget=Budget("sequences", 8, 4), manifest_hash="h", max_ngram=2, retriever=retriever, **kw
    )


def test_the_proposer_offers_what_the_datastore_holds_after_the_committed_suffix():
    retriever = _retriever([[40, 41, 42, 43, 44, 45], [60, 61, 62, 63]])
    prop = _proposer(retriever)
    prompt = [10, 11, 12, 13, 40, 41]  # no n-gram of the prompt recurs: lookup alone finds nothing
    prop.start(prompt)
    nodes = prop.propose(list(prompt), TorchRandomSource(0)).nodes
    assert [n.token_id for n in nodes] == [42, 43, 44, 45]
    assert prop.last_candidates is None  # nothing kept under the fixed budget
    ex = prop.stats.extras
    assert ex["rows_kept_from_datastore"] == 4 and ex["rows_kept"] == 4
    assert ex["datastore"]["rounds"] == 1 and ex["datastore"]["mean_match_len"] == 2
    assert prop.stats.retrieval_ms > 0  # the round loop reports the search as the retrieval stage
    assert prop.state_bytes() == retriever.datastore.nbytes
    # a suffix the datastore does not hold: a miss, counted
    assert prop.propose([10, 11, 12, 13, 14], TorchRandomSource(0)).nodes == ()
    assert ex["datastore"]["misses"] == 1 and ex["datastore"]["miss_rate"] == 0.5
    # the counters restart with the proposer's (after the warm-up and the gates)
    prop.reset_counters()
    assert ex["rows_kept_from_datastore"] == 0 and ex["datastore"]["rounds"] == 0
    assert prop.stats.retrieval_ms == 0.0


def test_a_datastore_needs_a_tree_of_several_continuations():
    with pytest.raises(ConfigError, match="proposer.datastore needs topology=sequences"):
        PromptLookupProposer.check_plan({"datastore": {"corpus": "stdlib"}}, Budget("sequence", 4, 4), None)
    PromptLookupProposer.check_plan({"datastore": {"corpus": "stdlib"}}, Budget("sequences", 4, 4), None)
    PromptLookupProposer.check_plan({"datastore": None}, Budget("sequence", 4, 4), None)
    with pytest.raises(ConfigError, match="topology=sequences"):
        PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="h", retriever=_retriever([[1, 2, 3]]))


def test_the_datastore_s_leakage_gate_runs_for_the_lookup():
    prompt = Prompt(prompt_id="p1", text="", category="code")
    ids = list(range(3, 43))
    assert _proposer(None).check_workload([(prompt, ids)]) is None  # no datastore, no gate
    clean = _proposer(_retriever([ids[:10] + [90, 91]]))
    entry = clean.check_workload([(prompt, ids)])
    assert entry["status"] == "passed" and entry["max_longest_match"] == 10
    leaky = _proposer(_retriever([ids + [90]]))
    with pytest.raises(LeakageError, match="p1"):
        leaky.check_workload([(prompt, ids)])


@pytest.mark.parametrize("budget_policy", ["fixed", "adaptive"])
def test_greedy_output_with_datastore_rows_equals_the_target_s(budget_policy):
    target = CausalLMBackend(build_tiny_model(seed=3))
    null = NullProposer(budget=Budget("sequence", 1, 1), manifest_hash="h")
    prompts = [[5, 17, 33, 8, 5, 17, 33, 9, 40, 41], [7, 3, 7, 4, 7, 5, 3, 4, 5, 7], list(range(20, 40))]
    ar = [greedy_tokens(target, p, 40, null) for p in prompts]
    # the datastore holds each prompt's AR continuation with a few tokens changed, and other text
    rng = np.random.default_rng(0)
    docs = []
    for p, out in zip(prompts, ar, strict=True):
        noisy = [t if rng.random() > 0.15 else int(rng.integers(3, 90)) for t in out]
        docs.append(p[-3:] + noisy)
    docs += [rng.integers(3, 90, size=50).tolist() for _ in range(6)]
    options = {"budget_policy": "adaptive", "verify_cost": [1.0 + 0.01 * k for k in range(9)]}
    prop = _proposer(_retriever(docs), **(options if budget_policy == "adaptive" else {}))
    for p, want in zip(prompts, ar, strict=True):
        assert greedy_tokens(target, p, 40, prop) == want
    assert prop.stats.extras["rows_kept_from_datastore"] > 0
