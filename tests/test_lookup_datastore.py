"""Prompt lookup with a datastore: the continuations a REST datastore holds after the committed
suffix join the lookup's candidate tree, as rows of their own kind the adaptive budget keeps where
they pay; the output stays the target's."""

import numpy as np
import pytest
from helpers import greedy_tokens

from harness.contracts import Budget, ConfigError
from harness.proposers.base import NullProposer
from harness.proposers.prompt_lookup import AcceptanceModel, PromptLookupProposer, candidate_tree
from harness.proposers.rest import (
    LOOKUP_MIN_SUFFIX,
    RestProposer,
    TrieNode,
    best_path,
    build_trie,
    ranked_continuations,
)
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


def test_ranked_continuations_put_the_most_frequent_first_as_rest_s_trie_does():
    conts = [[9, 9], [5, 6], [4], [5, 7], [5, 6], [5], [5, 6], [4, 1]]
    # 5 heads five continuations, 4 two, 9 one; below 5, 6 thrice before 7 once, and the one that ends
    # at 5 comes before those going on; identical continuations stay together
    assert ranked_continuations(conts) == [[5], [5, 6], [5, 6], [5, 6], [5, 7], [4], [4, 1], [9, 9]]
    # siblings of one count: ascending token id, REST's declared order
    assert ranked_continuations([[8, 1], [3, 2]]) == [[3, 2], [8, 1]]
    assert ranked_continuations([]) == []


def _trie_order(node: TrieNode, prefix: list[int]):
    """The distinct continuations of REST's trie depth-first, siblings in declared order, each with
    how many end at it."""
    ends = node.count - sum(c.count for c in node.children.values())
    if prefix and ends:
        yield prefix, ends
    for c in node.ordered_children():
        yield from _trie_order(c, [*prefix, c.token])


def test_ranked_continuations_follow_rest_s_trie_and_keep_every_continuation():
    rng = np.random.default_rng(7)
    for _ in range(50):
        conts = [rng.integers(0, 4, size=int(rng.integers(1, 5))).tolist() for _ in range(int(rng.integers(1, 40)))]
        ranked = ranked_continuations(conts)
        assert sorted(map(tuple, ranked)) == sorted(map(tuple, conts))  # every continuation, reordered
        want = [seq for seq, n in _trie_order(build_trie(conts), []) for _ in range(n)]
        assert ranked == want
        chain = [tok for tok, _, _ in best_path(build_trie(conts), max_len=99)]
        assert chain[: len(ranked[0])] == ranked[0]  # the first runs along REST's best path


# the suffix [1, 2] is followed once by 9, 9 (the first document, the lowest corpus offset), and by 5, 6
# in the ten documents after it
FREQUENT_LATER = [[1, 2, 9, 9]] + [[1, 2, 5, 6]] * 10


def _lookup_retriever(docs):
    ds = datastore_from_token_ids(docs, context_len=4, continuation_len=2)
    return RestProposer(budget=Budget("tree", 2, 2), manifest_hash="h", datastore=ds, min_suffix=LOOKUP_MIN_SUFFIX)


def test_the_row_limit_keeps_the_datastore_s_most_frequent_continuation_not_the_earliest():
    committed = [30, 1, 2]
    retriever = _lookup_retriever(FREQUENT_LATER)
    assert retriever.retrieve(committed)[1][0] == [9, 9]  # the search returns them in corpus order
    rest = RestProposer(budget=Budget("sequences", 2, 2), manifest_hash="h", datastore=retriever.datastore)
    rest_rows = [(n.token_id, n.parent) for n in rest.propose(committed, TorchRandomSource(0)).nodes]
    prop = PromptLookupProposer(budget=Budget("sequences", 2, 2), manifest_hash="h", retriever=retriever)
    prop.start(committed)
    rows = [(n.token_id, n.parent) for n in prop.propose(committed, TorchRandomSource(0)).nodes]
    assert rows == rest_rows == [(5, -1), (6, 0)]
    # a third row lets the rarer continuation's first token in after them
    prop3 = PromptLookupProposer(budget=Budget("sequences", 3, 2), manifest_hash="h", retriever=retriever)
    prop3.start(committed)
    assert [n.token_id for n in prop3.propose(committed, TorchRandomSource(0)).nodes] == [5, 6, 9]


def test_the_adaptive_budget_considers_the_frequent_continuation_with_its_full_support():
    # four rare continuations at the lowest offsets fill the adaptive budget's 4 * 2 candidate rows
    # when taken in corpus order; the continuation twenty documents share comes after them
    docs = [[1, 2, 10 + k, 20 + k] for k in range(4)] + [[1, 2, 5, 6]] * 20
    committed = [30, 1, 2]
    prop = PromptLookupProposer(
        budget=Budget("sequences", 2, 2),
        manifest_hash="h",
        retriever=_lookup_retriever(docs),
        budget_policy="adaptive",
        verify_cost=[1.0, 1.0, 1.0],
    )
    prop.start(committed)
    nodes = prop.propose(committed, TorchRandomSource(0)).nodes
    tree = prop.last_candidates
    assert len(tree) == 8 and tree.prefixes[:2] == ((5,), (5, 6))
    # support counted over every retrieved continuation: twenty through 5, 6 of the 24 retrieved
    assert tree.support[:2].tolist() == [20, 20]
    assert tree.parent_support[:2].tolist() == [24, 20]
    assert tree.datastore.all()
    assert [(n.token_id, n.parent) for n in nodes] == [(5, -1), (6, 0)]


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


def test_a_capped_round_reads_the_datastore_only_as_deep_as_the_round_verifies():
    """A request's last rounds verify fewer levels: the datastore's continuations are read to that
    depth (they were read to the retriever's full depth and the deeper tokens then cut), and the cap
    is the round's only."""
    retriever = _retriever([[40, 41, 42, 43, 44, 45], [60, 61, 62, 63]])
    prop = _proposer(retriever)
    prompt = [10, 11, 12, 13, 40, 41]
    prop.start(prompt)
    read = []
    retrieve = retriever.retrieve
    retriever.retrieve = lambda committed: read.append(retrieve(committed)) or read[-1]
    assert [n.token_id for n in prop.propose(list(prompt), TorchRandomSource(0)).nodes] == [42, 43, 44, 45]
    prop.depth_cap = 2
    assert [n.token_id for n in prop.propose(list(prompt), TorchRandomSource(0)).nodes] == [42, 43]
    assert [c for _, conts in read for c in conts] == [[42, 43, 44, 45], [42, 43]]
    assert retriever.depth_cap is None
    prop.depth_cap = 0  # one token left: the target's own
    assert prop.propose(list(prompt), TorchRandomSource(0)).nodes == ()
    assert read[-1][1] and all(c == [] for c in read[-1][1])  # found, but no token the round could verify
