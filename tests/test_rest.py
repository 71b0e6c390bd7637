"""proposer=rest: the toy source-to-index trace, sibling order, pruning, brute-force retrieval, negotiation."""

from __future__ import annotations

import numpy as np
import pytest

from harness.contracts import Budget, ProposalResult
from harness.proposers.rest import RestProposer, build_trie, linearize_trie
from harness.random_source import TorchRandomSource
from harness.topology.compiler import compile_tree
from harness.verifiers.base import NegotiationError, get_verifier, negotiate
from harness.workloads.datastore import SENTINEL, DatastoreError, datastore_from_token_ids

TREE = Budget(shape="tree", max_nodes=32, max_depth=8)


def rest(docs, *, budget=TREE, release=None, **kw) -> RestProposer:
    """A proposer over ``docs``; ``release`` sets the datastore's context_len / continuation_len /
    max_matches (defaults 16 / 8 / 64), ``kw`` the proposer's own options."""
    ds = datastore_from_token_ids(docs, **(release or {}))
    return RestProposer(budget=budget, manifest_hash="test", datastore=ds, **kw)


def rows(result: ProposalResult) -> list[tuple[int, int, float]]:
    return [(n.token_id, n.parent, n.score) for n in result.nodes]


def paths(result: ProposalResult) -> list[tuple[int, ...]]:
    out = []
    for node in result.nodes:
        prefix = () if node.parent < 0 else out[node.parent]
        out.append(prefix + (node.token_id,))
    return out


def rng():
    return TorchRandomSource(seed=0)


def test_source_to_index_toy_trace():
    prop = rest([[4, 5, 6, 9, 4, 5, 6, 10, 11]], max_suffix=3)
    result = prop.propose([1, 4, 5, 6], rng())
    # continuations [9, 4, 5, 6, 10, 11] and [10, 11]; breadth-first, siblings by (-count, token)
    assert rows(result) == [
        (9, -1, 1.0),
        (10, -1, 1.0),  # root children tie at count 1: 9 before 10 by token id
        (4, 0, 1.0),
        (11, 1, 1.0),
        (5, 2, 1.0),
        (6, 4, 1.0),
        (10, 5, 1.0),  # the later 10: full prefix [9,4,5,6,10], not root child [10]
        (11, 6, 1.0),
    ]
    ps = paths(result)
    assert ps.index((10,)) != ps.index((9, 4, 5, 6, 10))
    assert all(n.q is None for n in result.nodes)  # frequency, never q
    assert result.probability_semantics == "frequency" and result.topology == "tree"
    assert result.extras["match_len"] == 3 and result.extras["n_matches"] == 2
    # the compiler keeps them as distinct rows
    tree = compile_tree([result], prefix_len=4, max_nodes=32, max_depth=8)
    assert len(tree.token_ids) == 8


def test_sibling_order_descending_count_then_ascending_id():
    # after [1, 2]: 5 twice, 4 twice, 3 once
    prop = rest([[1, 2, 3], [1, 2, 5], [1, 2, 4], [1, 2, 5], [1, 2, 4]], max_suffix=2)
    result = prop.propose([1, 2], rng())
    assert rows(result) == [(4, -1, 2.0), (5, -1, 2.0), (3, -1, 1.0)]  # Not [3, 4, 5], not [5, 4, 3]


def test_decreasing_suffix_length_and_miss_accounting():
    prop = rest([[4, 5, 6, 9]], max_suffix=3)
    result = prop.propose([7, 5, 6], rng())  # [7,5,6] is absent, [5,6] is present
    assert result.extras["match_len"] == 2 and rows(result) == [(9, -1, 1.0)]
    miss = prop.propose([99, 98], rng())
    assert miss.empty and miss.extras["miss"] is True and miss.probability_semantics == "frequency"
    assert prop.stats.extras["rounds"] == 2 and prop.stats.extras["misses"] == 1 and prop.miss_rate == 0.5
    assert prop.stats.extras["match_len_sum"] == 2
    assert prop.stats.retrieval_ms > 0 and prop.state_bytes() == prop.datastore.nbytes > 0
    assert prop.stats.proposal_state_bytes == prop.datastore.nbytes


def test_a_suffix_ending_every_document_is_not_a_match():
    # [5, 6] occurs only at document ends: no continuation, so n falls back to [6] -> ... miss
    prop = rest([[5, 6], [3, 5, 6]], max_suffix=2)
    assert prop.propose([5, 6], rng()).empty


def test_global_pruning_keeps_highest_counts_and_is_prefix_closed():
    conts = [[1, 2, 3], [1, 2, 4], [1, 2, 4], [1, 5], [6], [6, 7]]
    root = build_trie(conts)
    kept = linearize_trie(root, max_nodes=4, max_depth=8)
    # counts: 1:4, 1-2:3, 1-2-4:2, 6:2, 1-2-3:1, 1-5:1, 6-7:1 -> keep the four highest
    assert kept == [(1, -1, 4), (6, -1, 2), (2, 0, 3), (4, 2, 2)]
    assert linearize_trie(root, max_nodes=32, max_depth=1) == [(1, -1, 4), (6, -1, 2)]


def _brute_continuations(
    tokens: np.ndarray, committed: list[int], *, max_suffix: int, max_matches: int, length: int
) -> tuple[int, list[list[int]]]:
    for n in range(min(max_suffix, len(committed)), 0, -1):
        pat = committed[len(committed) - n :]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n].tolist() == pat and tokens[i + n] != SENTINEL]
        starts.sort(key=lambda i: tokens[i:].tolist())  # by the text that follows: suffix-array order
        if len(starts) > max_matches:  # the middle match of each of max_matches equal strata
            starts = [starts[(2 * j + 1) * len(starts) // (2 * max_matches)] for j in range(max_matches)]
        if starts:
            conts = []
            for s in starts:
                cont = []
                for t in tokens[s + n : s + n + length].tolist():
                    if t == SENTINEL:
                        break
                    cont.append(t)
                conts.append(cont)
            return n, conts
    return 0, []


def test_trie_counts_agree_with_a_brute_force_scan():
    gen = np.random.default_rng(5)
    for _trial in range(25):
        docs = [gen.integers(0, 4, size=int(gen.integers(1, 50))).tolist() for _ in range(5)]
        max_matches = int(gen.integers(1, 6))
        prop = rest(
            docs,
            max_suffix=4,
            max_matches=max_matches,
            continuation_len=5,
            budget=Budget(shape="tree", max_nodes=10, max_depth=5),
        )
        committed = gen.integers(0, 4, size=6).tolist()
        n, conts = _brute_continuations(
            prop.datastore.tokens, committed, max_suffix=4, max_matches=max_matches, length=5
        )
        result = prop.propose(committed, rng())
        assert result.extras["match_len"] == n
        counts = {}
        for cont in conts:
            for k in range(1, len(cont) + 1):
                counts[tuple(cont[:k])] = counts.get(tuple(cont[:k]), 0) + 1
        got = dict(zip(paths(result), (nd.score for nd in result.nodes)))
        assert all(counts[p] == c for p, c in got.items())
        assert len(got) == min(10, len(counts))
        dropped = [c for p, c in counts.items() if p not in got]
        assert not dropped or min(got.values()) >= max(dropped)  # global: highest counts kept
        assert all(p[:-1] in got for p in got if len(p) > 1)  # prefix-closed
        for node in result.nodes:  # siblings in declared order
            sibs = [(-nd.score, nd.token_id) for nd in result.nodes if nd.parent == node.parent]
            assert sibs == sorted(sibs)


def test_the_first_level_ranks_continuations_as_the_whole_datastore_does():
    """A suffix with more than ``max_matches`` matches read the earliest ones in the corpus: the first
    files' continuation was proposed alone, ahead of one three times as frequent over the datastore."""
    docs = [[1, 2, 3, 9]] * 6 + [[1, 2, 4, 9]] * 20 + [[1, 2, 5]] * 10 + [[1, 2, 6]] * 2
    prop = rest(docs, max_suffix=2, max_matches=8)
    result = prop.propose([7, 1, 2], rng())
    first = [(n.token_id, n.score) for n in result.nodes if n.parent == -1]
    assert [tok for tok, _ in first] == [4, 5, 3] and sum(score for _, score in first) == 8, first
    assert result.extras["n_matches"] == 8


def test_sequence_shape_follows_the_first_child():
    prop = rest(
        [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7]],
        max_suffix=2,
        budget=Budget(shape="sequence", max_nodes=2, max_depth=8),
    )
    result = prop.propose([1, 2], rng())
    assert result.topology == "sequence" and rows(result) == [(5, -1, 2.0), (6, 0, 1.0)]


# five continuations through 10, four through 20, three through 30, one through 40
DEEP_AND_WIDE = [[1, 2, 10, 11, 12, 13]] * 5 + [[1, 2, 20, 21, 22, 23]] * 4 + [[1, 2, 30, 31]] * 3 + [[1, 2, 40]]


def test_the_node_budget_goes_to_the_levels_the_round_can_commit():
    """In a request's last rounds the round loop sets ``depth_cap`` and compiles the tree to that
    depth: the trie is pruned among the rows of those levels (it was pruned over the budget's depth,
    and the compiler then cut the deeper rows, leaving one row of a budget of four)."""
    prop = rest(DEEP_AND_WIDE, budget=Budget(shape="tree", max_nodes=4, max_depth=4))
    assert paths(prop.propose([7, 1, 2], rng())) == [(10,), (10, 11), (10, 11, 12), (10, 11, 12, 13)]
    prop.depth_cap = 1
    result = prop.propose([7, 1, 2], rng())
    assert paths(result) == [(10,), (20,), (30,), (40,)]
    tree = compile_tree([result], prefix_len=3, max_nodes=4, max_depth=1)
    assert tree.token_ids.tolist() == [10, 20, 30, 40]
    prop.depth_cap = 2
    assert paths(prop.propose([7, 1, 2], rng())) == [(10,), (20,), (10, 11), (20, 21)]
    # one token left: the round commits the target's own token only, so no row is proposed
    prop.depth_cap = 0
    assert prop.propose([7, 1, 2], rng()).empty
    seq = rest(DEEP_AND_WIDE, budget=Budget(shape="sequence", max_nodes=4, max_depth=4))
    seq.depth_cap = 2
    assert paths(seq.propose([7, 1, 2], rng())) == [(10,), (10, 11)]


def test_a_round_that_commits_only_the_target_s_token_searches_nothing_and_counts_no_retrieval(monkeypatch):
    """With one token left in the request the round loop sets ``depth_cap=0``: no row can be verified,
    so the datastore is not searched and the round is no retrieval (it was counted as a hit, in the
    record's rounds, miss rate and mean match length)."""
    prop = rest(DEEP_AND_WIDE, budget=Budget(shape="tree", max_nodes=4, max_depth=4))
    assert not prop.propose([7, 1, 2], rng()).empty  # one retrieval counted
    counted, retrieval_ms = dict(prop.stats.extras), prop.stats.retrieval_ms
    assert counted["rounds"] == 1 and counted["mean_match_len"] == 2

    def searched(*args, **kwargs):
        raise AssertionError("the datastore was searched in a round that can verify no row")

    for method in ("longest_suffix", "occurrences", "continuations"):
        monkeypatch.setattr(prop.datastore, method, searched)
    prop.depth_cap = 0
    capped = prop.propose([7, 1, 2], rng())
    assert capped.empty and capped.manifest_hash == prop.manifest_hash and capped.source == prop.name
    assert capped.probability_semantics == "frequency" and capped.sampling_relation == "deterministic_lookup"
    assert prop.stats.extras == counted and prop.stats.retrieval_ms == retrieval_ms
    prop.depth_cap = 1  # a round that can verify a row searches again
    with pytest.raises(AssertionError, match="was searched"):
        prop.propose([7, 1, 2], rng())


def test_release_limits_are_enforced():
    with pytest.raises(DatastoreError, match="max_matches=65 exceeds"):
        rest([[1, 2, 3]], max_matches=65)
    with pytest.raises(DatastoreError, match="context_len=4"):
        rest([[1, 2, 3]], release={"context_len": 4}, max_suffix=5)
    with pytest.raises(ValueError, match="cannot build topology"):
        rest([[1, 2, 3]], budget=Budget(shape="set", max_nodes=4, max_depth=1))


@pytest.mark.parametrize("shape", ["tree", "sequence"])
def test_negotiation_refuses_pq_verifiers_and_allows_greedy_and_membership(shape):
    prop = rest([[1, 2, 3]], budget=Budget(shape=shape, max_nodes=4, max_depth=4))
    caps = prop.capabilities()
    assert caps.probability_semantics == frozenset({"frequency"})
    for name in ("rejection", "specinfer", "sequoia"):
        with pytest.raises(NegotiationError, match="frequency"):
            negotiate(caps, get_verifier(name), temperature=0.7)
        with pytest.raises(NegotiationError):
            negotiate(caps, get_verifier(name), temperature=0.0)
    negotiate(caps, get_verifier("greedy"), temperature=0.0)
    negotiate(caps, get_verifier("membership"), temperature=0.0)
    negotiate(caps, get_verifier("membership"), temperature=0.7)


def test_an_exclusion_file_named_after_another_source_is_read_again_when_edited(tmp_path, monkeypatch):
    """The exclusion fingerprints are cached per spec and per state of the files it names; a file
    named after a comma and a space is the same file, and an edit to it is read."""
    import json

    from harness.proposers.rest import _configured_fingerprints, _files_state

    monkeypatch.chdir(tmp_path)
    held = tmp_path / "x.jsonl"
    held.write_text(json.dumps({"id": "a", "prompt": "alpha beta"}) + "\n")
    spec = "none, x.jsonl"
    state = _files_state(spec)
    assert [part for part, *_ in state] == ["x.jsonl"] and state == _files_state("x.jsonl")
    before = _configured_fingerprints(spec, state)
    held.write_text(json.dumps({"id": "a", "prompt": "gamma delta, longer"}) + "\n")
    after = _configured_fingerprints(spec, _files_state(spec))
    assert before != after and len(after) == 1
