"""Round engine on the tiny model: greedy equality for every allowed proposer x topology x
verifier at temperature 0, EOS inside an accepted path, input/cache lengths, negotiation."""

import numpy as np
import pytest
import torch
from helpers import load_script, round_of_one

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.proposers.base import NullProposer
from harness.proposers.draft_model import DraftModelProposer
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.verifiers import get_verifier
from harness.verifiers.sampling import SamplingPolicy

GREEDY = SamplingPolicy()
PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]
NEW = 40


@pytest.fixture(scope="module")
def models():
    target = build_tiny_model(seed=1)
    different = build_tiny_model(seed=1)  # the target's first layer only: agrees often, not always
    different.model.layers = different.model.layers[:1]
    different.config.num_hidden_layers = 1
    return CausalLMBackend(target), CausalLMBackend(different), CausalLMBackend(build_tiny_model(seed=1))


def run(backend, proposer, verifier="greedy", prompt=PROMPT, new=NEW, eos=frozenset(), budget=None, seed=0):
    rounds = []
    budget = budget or proposer.budget
    res = decode(
        target=backend,
        proposer=proposer,
        verifier=get_verifier(verifier),
        policy=GREEDY,
        prompt_ids=prompt,
        max_new_tokens=new,
        eos_token_ids=eos,
        rng=TorchRandomSource(seed),
        round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
        on_round=lambda **kw: rounds.append(round_of_one(kw)),
    )
    return res, rounds


def autoregressive(backend, prompt=PROMPT, new=NEW, eos=frozenset()):
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    return run(backend, null, prompt=prompt, new=new, eos=eos)[0].tokens


@torch.inference_mode()
def hf_greedy(model, prompt, new):
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


COMBOS = [
    ("prompt_lookup", Budget(shape="sequence", max_nodes=4, max_depth=4), None),
    ("prompt_lookup", Budget(shape="sequences", max_nodes=12, max_depth=4), None),
    ("draft_model", Budget(shape="sequence", max_nodes=4, max_depth=4), "beam"),
    ("draft_model", Budget(shape="sequence", max_nodes=4, max_depth=4), "iid"),
    ("draft_model", Budget(shape="set", max_nodes=3, max_depth=1, widths=(3,)), "beam"),
    ("draft_model", Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)), "beam"),
    ("draft_model", Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)), "without_replacement"),
]


def make(name, budget, sampling, draft_backend):
    if name == "prompt_lookup":
        return PromptLookupProposer(budget=budget, manifest_hash="h")
    return DraftModelProposer(budget=budget, manifest_hash="h", policy=GREEDY, backend=draft_backend, sampling=sampling)


def test_baseline_matches_plain_hf_greedy(models):
    target, _, _ = models
    assert autoregressive(target) == hf_greedy(target.model, PROMPT, NEW)


@pytest.mark.parametrize("verifier", ["greedy", "membership"])
@pytest.mark.parametrize("name,budget,sampling", COMBOS)
def test_greedy_equality(models, name, budget, sampling, verifier):
    target, different, _ = models
    expected = autoregressive(target)
    res, rounds = run(target, make(name, budget, sampling, different), verifier=verifier)
    assert res.tokens == expected
    accepted = [len(r["selection"].accepted_rows) for r in rounds]
    rejected = [r for r in rounds if r["tree"].num_rows > len(r["selection"].accepted_rows)]
    emitted = [len(r["emitted"]) for r in rounds]
    assert max(emitted) >= 2, f"no round committed two or more tokens: {emitted}"
    if budget.max_depth > 1:  # a one-position set can accept one candidate (+ the bonus) at most
        assert max(accepted) >= 2, f"no round accepted two or more candidates: {accepted}"
    assert rejected, "no round rejected a candidate"
    assert res.ledger.committed_tokens == len(res.tokens)
    # every round emits its accepted tokens plus one bonus/correction token, except a last round
    # cut by max_new_tokens
    assert res.ledger.committed_tokens - res.ledger.accepted_tokens in (res.ledger.rounds, res.ledger.rounds - 1)


@pytest.mark.parametrize(
    "budget",
    [
        Budget(shape="sequence", max_nodes=4, max_depth=4),
        Budget(shape="expansion", max_nodes=12, max_depth=3, widths=(2, 2, 1)),
    ],
)
def test_identical_draft_accepts_its_whole_greedy_path(models, budget):
    target, _, same = models
    expected = autoregressive(target)
    res, rounds = run(target, make("draft_model", budget, "beam", same))
    assert res.tokens == expected
    for r in rounds[:-1]:  # the last round may be cut by max_new_tokens
        assert len(r["selection"].accepted_rows) == budget.max_depth


def test_eos_inside_accepted_path_truncates(models):
    target, _, same = models
    free = autoregressive(target)
    eos_tok = free[5]  # a token the greedy path emits at position 5
    first = free.index(eos_tok)
    res, rounds = run(
        target,
        make("draft_model", Budget(shape="sequence", max_nodes=4, max_depth=4), "beam", same),
        eos=frozenset({eos_tok}),
    )
    assert res.tokens == free[: first + 1]
    assert res.finished_by == "eos"
    assert res.ledger.committed_tokens == first + 1  # what follows EOS is neither emitted nor counted


def test_max_new_tokens_inside_accepted_path(models):
    target, _, same = models
    res, _ = run(target, make("draft_model", Budget(shape="sequence", max_nodes=4, max_depth=4), "beam", same), new=7)
    assert len(res.tokens) == 7 and res.ledger.committed_tokens == 7


@pytest.mark.parametrize(
    "budget",
    [
        Budget(shape="sequence", max_nodes=4, max_depth=4),
        Budget(shape="expansion", max_nodes=12, max_depth=4, widths=(2, 2, 1, 1)),
    ],
)
@pytest.mark.parametrize("new,last_depth", [(7, 1), (6, 0), (8, 2)])
def test_a_round_near_the_token_budget_verifies_only_what_it_can_commit(models, budget, new, last_depth, monkeypatch):
    """An identical draft accepts every candidate: the first round commits 5 tokens, and the
    second, with ``new - 5`` left, gets a tree no deeper than it can commit (one token less than
    it has left: the bonus token is the last), so no round drafts or verifies rows past the end."""
    target, _, same = models
    proposer = make("draft_model", budget, "beam", same)
    seen_caps = []
    propose = proposer.propose

    drafted = []
    forwards = []  # the draft's forwards in each proposal
    forward_rows = proposer.backend.forward_rows

    def counted(*args, **kwargs):
        forwards[-1] += 1
        return forward_rows(*args, **kwargs)

    monkeypatch.setattr(proposer.backend, "forward_rows", counted)

    def spy(committed, rng):
        seen_caps.append(proposer.depth_cap)
        forwards.append(0)
        result = propose(committed, rng)
        depth = {-1: 0}
        for i, node in enumerate(result.nodes):
            depth[i] = depth[node.parent] + 1
        drafted.append(max(depth.values()))
        return result

    proposer.propose = spy
    res, rounds = run(target, proposer, new=new)
    assert res.tokens == autoregressive(target, new=new)
    depths = [int(r["tree"].depths.max()) if r["tree"].num_rows else 0 for r in rounds]
    assert depths == [4, last_depth]
    assert seen_caps == [None, last_depth] and proposer.depth_cap is None  # the cap was the round's
    assert drafted == [4, last_depth]  # the draft drafted no deeper than the round could commit
    # a draft forward per level (the feed gives the first): none where only the bonus token is left
    assert forwards == [4, last_depth]
    assert [len(r["emitted"]) for r in rounds] == [5, new - 5]
    assert len(rounds[1]["selection"].accepted_rows) == last_depth  # every row it verified was accepted
    assert res.ledger.reached[:4] == [1 + (last_depth >= 1), 1 + (last_depth >= 2), 1, 1]


def test_verify_input_and_cache_lengths(models):
    """The prefix is never recomputed; the pending token rides in the verify forward."""
    target, different, _ = models
    seen = []
    orig = target._forward

    def spy(cache, ids, pos, allowed, start, **kw):
        seen.append((start, ids.shape[1]))
        return orig(cache, ids, pos, allowed, start, **kw)

    target._forward = spy
    try:
        budget = Budget(shape="sequence", max_nodes=4, max_depth=4)
        res, rounds = run(target, make("prompt_lookup", budget, None, different), new=12)
    finally:
        del target._forward
    assert seen[0] == (0, len(PROMPT) - 1)  # prefill: the prompt minus the pending token
    committed = len(PROMPT)
    for (cache_len, n_in), r in zip(seen[1:], rounds):
        assert cache_len == committed - 1  # every committed token but the pending one is cached
        assert n_in == 1 + r["tree"].num_rows  # [pending] + candidate rows, no extra forward
        committed += len(r["emitted"])
    assert len(seen) == 1 + len(rounds)


def test_draft_cache_is_rolled_back_not_reprefilled(models):
    target, different, _ = models
    proposer = make("draft_model", Budget(shape="sequence", max_nodes=4, max_depth=4), "beam", different)
    fed = []
    orig = different._forward

    def spy(cache, ids, pos, allowed, start, **kw):
        fed.append(ids.shape[1])
        return orig(cache, ids, pos, allowed, start, **kw)

    different._forward = spy
    try:
        run(target, proposer, new=24)
    finally:
        del different._forward
    assert fed[0] == len(PROMPT) - 1  # one draft prefill
    assert max(fed[1:]) <= 1 + 4  # afterwards only accepted + pending tokens, never the prompt again


def test_acceptance_by_depth_counts_a_depth_tried_only_where_the_accepted_node_had_children(models):
    """A tree whose shallow branch is right and whose deep branch is wrong: the walk accepts the
    shallow branch's leaf, and nothing was offered below it. Acceptance by depth counted depths 2
    and 3 as tried and rejected (any branch of the tree reached them), which read every branching
    topology's acceptance low; it counts depth 1 only now."""
    from harness.contracts import ProposalResult

    target = models[0]
    right = autoregressive(target, new=1)[0]
    wrong = next(t for t in range(5, 90) if t != right)

    class Once(PromptLookupProposer):
        """The given paths in the first round, nothing after."""

        paths: list = []

        def propose(self, committed, rng):
            paths, type(self).paths = type(self).paths, []
            if not paths:
                return ProposalResult.empty_result(source="fixed", manifest_hash="h")
            return ProposalResult.from_paths(paths, source="fixed", manifest_hash="h")

    for paths, accepted in (([[right], [wrong, 7, 8]], 1), ([[wrong, 7, 8]], 0)):
        Once.paths = paths
        res, rounds = run(target, Once(budget=Budget("sequences", 4, 3), manifest_hash="h"), new=6)
        assert int(rounds[0]["tree"].depths.max()) == 3 and len(rounds[0]["selection"].accepted_rows) == accepted
        # depth 1 tried (accepted or not); 2 and 3 never offered below the node the walk stopped at
        assert res.ledger.reached[0] == 1 and sum(res.ledger.reached[1:]) == 0
        assert res.ledger.accepted_at[0] == accepted


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_prompt_lookup_proposes_no_row_below_the_rounds_depth_cap(policy):
    """A request's last rounds are compiled to fewer levels: prompt lookup ignored the cap, so its
    rows_kept counted rows the compiler then dropped, and the adaptive budget spent its choice on
    rows that could not be verified."""
    text = [5, 9, 14, 22, 31, 40, 7, 8]
    committed = text * 3 + text[:2]  # every match continues 6 deep
    budget = Budget(shape="sequences", max_nodes=8, max_depth=6)
    prop = PromptLookupProposer(
        budget=budget, manifest_hash="h", budget_policy=policy, verify_cost=[1.0 + 0.01 * k for k in range(9)]
    )
    prop.start(committed[:10])
    free = prop.propose(committed, TorchRandomSource(0))
    assert max(_depths(free)) == 6
    before = prop.stats.extras["rows_kept"]
    prop.depth_cap = 2
    capped = prop.propose(committed, TorchRandomSource(0))
    assert capped.nodes and max(_depths(capped)) <= 2
    assert prop.stats.extras["rows_kept"] - before == len(capped.nodes)


def test_prompt_lookup_spends_its_row_limit_on_the_levels_the_round_verifies():
    """The candidate tree was cut to ``max_nodes`` rows before the rows below the depth cap were
    dropped: a capped round verified fewer first tokens than the matches offered and the budget allowed."""
    committed = [1, 10, 11, 12, 13, 1, 20, 21, 22, 1, 30, 31, 1]  # three continuations after token 1
    prop = PromptLookupProposer(budget=Budget("sequences", 4, 4), manifest_hash="h", max_ngram=1, max_matches=8)
    prop.start(committed)
    assert max(_depths(prop.propose(committed, TorchRandomSource(0)))) > 1
    prop.depth_cap = 1
    capped = prop.propose(committed, TorchRandomSource(0))
    assert sorted(n.token_id for n in capped.nodes) == [10, 20, 30] and _depths(capped) == [1, 1, 1]
    prop.depth_cap = 0  # one token left: the target's own
    assert prop.propose(committed, TorchRandomSource(0)).nodes == ()


def _depths(result) -> list[int]:
    depth = {-1: 0}
    for i, node in enumerate(result.nodes):
        depth[i] = depth[node.parent] + 1
    return [depth[i] for i in range(len(result.nodes))]


def test_adaptive_prompt_lookup_is_exact_and_uses_the_cost_curve(models):
    target, _, _ = models
    expected = autoregressive(target)
    budget = Budget(shape="sequences", max_nodes=12, max_depth=4)
    flat = [1.0 + 0.01 * k for k in range(13)]  # rows nearly free: keep (almost) everything
    steep = [1.0 + 2.0 * k for k in range(13)]  # each row costs two steps: never worth it
    kept = {}
    for name, cost in (("flat", flat), ("steep", steep)):
        prop = PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=cost)
        res, rounds = run(target, prop)
        assert res.tokens == expected
        kept[name] = prop.stats.extras["rows_kept"]
    assert kept["steep"] == 0
    assert kept["flat"] > 0
    with pytest.raises(ValueError, match="verify_cost"):
        PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive")


def test_adaptive_rows_are_priced_after_the_rows_other_sources_put_in_the_forward():
    """Inside proposer=merged the verify forward carries the other sources' m rows too: k rows of the
    lookup cost t(1 + m + k), not t(1 + k); a row another source already proposed costs no row, and
    the forward never holds more than max_rows rows."""
    budget = Budget(shape="sequences", max_nodes=8, max_depth=4)
    step = [1.0] + [2.0] * 8  # a step at 2 rows: the first candidate row doubles the forward, later ones are free
    prop = PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=step)
    parents = np.array([-1, 0, -1])
    prefixes = ((5,), (5, 6), (7,))
    rate = np.array([0.3, 0.3, 0.3])  # reach 0.3, 0.09, 0.3: 0.69 tokens in all, below the step's price
    assert prop._choose_rows(parents, rate, prefixes) == []  # alone: the step is not worth paying
    prop.rows_before = frozenset({(40,), (40, 41), (40, 41, 42), (43,)})  # m = 4: the step is paid already
    assert prop._choose_rows(parents, rate, prefixes) == [0, 1, 2]
    # a row equal to another source's is verified once: free, where a new row costs ten steps
    knee = [1.0, 1.0] + [10.0] * 7
    prop = PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=knee)
    assert prop._choose_rows(parents, rate, prefixes) == [0]  # alone: one row is free, a second costs ten
    prop.rows_before = frozenset({(5,)})
    assert prop._choose_rows(parents, rate, prefixes) == [0]  # (5,) is the other source's row: still free
    prop.rows_before = frozenset({(40,)})
    assert prop._choose_rows(parents, rate, prefixes) == []  # (40,) took the free row
    # a forward the others already fill to max_rows grows no more: the lookup's rows share it
    steep = [1.0 + 2.0 * k for k in range(9)]
    prop = PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=steep)
    assert prop._choose_rows(parents, rate, prefixes) == []
    prop.rows_before = frozenset((40 + i,) for i in range(8))
    assert prop._choose_rows(parents, rate, prefixes) == [0, 1, 2]


def test_the_candidate_tree_counts_how_many_matches_agree_on_each_row():
    from harness.proposers.prompt_lookup import candidate_tree

    matches = [
        (3, np.array([9, 1, 2]), False),
        (1, np.array([9, 1, 5]), False),
        (1, np.array([9, 4]), True),
        (1, np.array([7, 8]), True),
    ]
    tree = candidate_tree(matches, limit=16)
    assert tree.prefixes == ((9,), (9, 1), (9, 1, 2), (9, 1, 5), (9, 4), (7,), (7, 8))
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, -1, 5]
    assert tree.depth.tolist() == [1, 2, 3, 3, 2, 1, 2]
    assert tree.context.tolist() == [3, 3, 3, 1, 1, 1, 1]  # the best match that made each row
    assert tree.rank.tolist() == [0, 0, 0, 1, 1, 1, 0]
    assert tree.history.tolist() == [False, False, False, False, True, True, True]
    assert tree.support.tolist() == [3, 2, 1, 1, 1, 1, 1]
    assert tree.parent_support.tolist() == [4, 3, 2, 2, 3, 4, 1]  # below the root: the number of matches
    small = candidate_tree(matches, limit=3)
    assert small.prefixes == ((9,), (9, 1), (9, 1, 2))
    assert small.support.tolist() == [3, 2, 1]  # matches past the limit still count where they pass
    assert len(candidate_tree([], limit=8)) == 0


def test_tried_rows_are_those_whose_parent_the_target_followed():
    from harness.proposers.prompt_lookup import tried_rows

    prefixes = ((9,), (9, 1), (9, 1, 2), (9, 1, 5), (9, 4), (7,), (7, 8))
    rows, accepted = tried_rows(prefixes, (9, 1, 6))  # 9 and 1 accepted, then 6: no row has it
    assert rows.tolist() == [0, 1, 2, 3, 4, 5] and accepted.tolist() == [True, True, False, False, False, False]
    rows, accepted = tried_rows(prefixes, (7,))  # one token committed: only the root's children are known
    assert rows.tolist() == [0, 5] and accepted.tolist() == [False, True]


def test_the_acceptance_model_learns_from_every_tried_row_kept_or_not():
    from harness.proposers.prompt_lookup import AcceptanceModel

    prop = PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=8, max_depth=4),
        manifest_hash="h",
        budget_policy="adaptive",
        verify_cost=[1.0] * 9,
    )
    model = prop.acceptance
    assert model.weights.tolist() == list(AcceptanceModel.WEIGHTS) and model.bias == AcceptanceModel.BIAS
    committed = [1, 2, 3, 9, 1, 2, 3]
    result = prop.propose(committed, TorchRandomSource(0))
    assert [n.token_id for n in result.nodes] == [9, 1, 2, 3]  # the one occurrence: context 3
    assert [n.score for n in result.nodes] == [3.0] * 4
    x = prop._last[2][:3]
    outcome = np.array([1.0, 1.0, 0.0])

    def loss():
        p = model.predict(x)
        return -np.mean(outcome * np.log(p) + (1 - outcome) * np.log(1 - p))

    before = loss()
    prop.observe_commit(committed + [9, 1, 7])  # 9 and 1 accepted, then 7 instead of 2
    assert model.rows_learned == 3  # depth 4 was never reached: not tried
    assert loss() < before  # one gradient step on what the target said
    assert prop._last is None
    prop.observe_commit(committed + [9, 1, 7, 4])  # nothing pending: nothing learned twice
    assert model.rows_learned == 3
    prop.propose(committed, TorchRandomSource(0))
    x, rising = prop._last[2], model.predict(prop._last[2])
    prop.observe_commit(committed + [9, 1, 2, 3])  # every row accepted: every estimate rises
    assert (model.predict(x) > rising).all() and model.rows_learned == 7
    # rows the round did not keep are learned from too, where the commit tells about them
    steep = PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=8, max_depth=4),
        manifest_hash="h",
        budget_policy="adaptive",
        verify_cost=[1.0, 1.0] + [5.0] * 7,
    )
    kept = steep.propose(committed, TorchRandomSource(0)).nodes
    assert len(kept) == 1 and len(steep._last[1]) == 4  # one of the four rows verified
    steep.observe_commit(committed + [9, 1, 7])  # the target's tokens, as another round found them
    assert steep.acceptance.rows_learned == 3


def test_the_acceptance_model_s_starting_constants_rank_copies_as_the_dev_prompts_did():
    from harness.proposers.prompt_lookup import AcceptanceModel, candidate_tree

    model = AcceptanceModel()
    assert len(AcceptanceModel.MEAN) == len(AcceptanceModel.SCALE) == len(AcceptanceModel.WEIGHTS)
    assert len(AcceptanceModel.WEIGHTS) == len(AcceptanceModel.FEATURES)

    def first_row(*matches):
        return float(model.predict(AcceptanceModel.features(candidate_tree(list(matches), limit=16)))[0])

    long_ctx, short_ctx = first_row((12, np.array([5]), False)), first_row((1, np.array([5]), False))
    assert 0 < short_ctx < long_ctx < 1
    alone = first_row((1, np.array([5]), False), (1, np.array([6]), False), (1, np.array([7]), False))
    agreed = first_row((1, np.array([5]), False), (1, np.array([5]), False), (1, np.array([5]), False))
    assert agreed > alone  # three matches agreeing on the row predict it better than one of three
    assert first_row((4, np.array([5]), True)) < first_row((4, np.array([5]), False))  # history ranks below
    # a rejected tail ranks below a match of the same context, the more so the shorter its copy had run
    match = AcceptanceModel.features(candidate_tree([(4, np.array([5]), False)], limit=16))
    tails = [AcceptanceModel.features(candidate_tree([], limit=16, tails=[(4, (5,), False, run)]))[0] for run in (0, 3)]
    short_run, long_run = model.predict(np.stack(tails)).tolist()
    assert short_run < long_run < model.predict(match)[0]
    # a datastore's continuation ranks below a lookup match whose context is as long
    retrieved = AcceptanceModel.features(candidate_tree([], limit=16, retrieved=[(4, [5])]))
    assert model.predict(retrieved)[0] < model.predict(match)[0]
    tree = candidate_tree([(3, np.array([5, 6]), True), (1, np.array([7]), False)], limit=16)
    np.testing.assert_allclose(
        AcceptanceModel.features(tree),
        (AcceptanceModel.raw_features(tree) - np.asarray(AcceptanceModel.MEAN)) / np.asarray(AcceptanceModel.SCALE),
    )
    np.testing.assert_allclose(
        AcceptanceModel.raw_features(tree),
        [
            [np.log(3), 1, 0, 1, 0.5, 0, np.log(2), 0, 0, 0],  # 5: context 3, first child, history, 1 of 2 matches
            [np.log(4), 1, 0, 1, 1.0, 0, 0, 0, 0, 0],  # 6 below it: context 3 + depth 2 - 1
            [0, 0, 1, 0, 0.5, 0, np.log(2), 0, 0, 0],  # 7: the root's second child (no row is a tail or retrieved)
        ],
    )
    with pytest.raises(ValueError, match="learning_rate"):
        AcceptanceModel(learning_rate=float("nan"))


def test_occurrences_are_ranked_by_how_much_context_they_match():
    from harness.proposers.prompt_lookup import MAX_CONTEXT, find_continuations

    tokens = np.array([5, 1, 2, 8, 30, 7, 1, 2, 9, 31, 2, 40, 32, 5, 1, 2])
    got = find_continuations(tokens, max_ngram=2, min_ngram=1, max_depth=2, max_matches=8)
    # [1, 2] after 5 (context 3: 5 1 2), then the more recent [1, 2] after 7 (context 2), then the
    # 1-gram [2] at 10 (context 1; the 2s at 2 and 7 are taken by the 2-gram matches)
    assert [(c, cont.tolist(), h) for c, cont, h in got] == [
        (3, [8, 30], False),
        (2, [9, 31], False),
        (1, [40, 32], False),
    ]
    assert [c for c, *_ in find_continuations(tokens, max_ngram=2, min_ngram=2, max_depth=2, max_matches=1)] == [3]
    loop = np.array(list(range(3, 43)) * 2)  # 40 tokens repeated: the match runs as far back as it can
    (context, cont, _), *_ = find_continuations(loop, max_ngram=2, min_ngram=1, max_depth=3, max_matches=8)
    assert context == MAX_CONTEXT and cont.tolist() == [3, 4, 5]


def _continuations_by_the_rule(tokens: list[int], *, max_ngram: int, max_depth: int) -> list[tuple[int, list[int]]]:
    """find_continuations' documented rule, written out with loops: every earlier occurrence of the
    longest suffix n-gram that matches at a continuation start, its context extended backwards,
    ranked by context and then recency."""
    from harness.proposers.prompt_lookup import MAX_CONTEXT

    total, found = len(tokens), {}
    for n in range(min(max_ngram, total - 1), 0, -1):
        for i in range(total - n):
            if tokens[i : i + n] == tokens[total - n :] and i + n not in found:
                context = n
                while context < min(MAX_CONTEXT, total - 1) and i - (context - n) - 1 >= 0:
                    back = context - n + 1
                    if tokens[i - back] != tokens[total - n - back]:
                        break
                    context += 1
                found[i + n] = context
    order = sorted(found, key=lambda start: (-found[start], -start))
    return [(found[s], tokens[s : s + max_depth]) for s in order]


def test_the_vectorised_search_finds_what_the_rule_says_on_random_sequences():
    from harness.proposers.prompt_lookup import find_continuations

    rng = np.random.default_rng(0)
    for case in range(300):
        tokens = rng.integers(0, 2 + case % 4, size=int(rng.integers(2, 70))).tolist()
        max_ngram, depth = 1 + case % 4, 1 + case % 5
        got = find_continuations(np.array(tokens), max_ngram=max_ngram, min_ngram=1, max_depth=depth, max_matches=10**6)
        want = _continuations_by_the_rule(tokens, max_ngram=max_ngram, max_depth=depth)
        assert [(c, cont.tolist()) for c, cont, _ in got] == want, (case, tokens)


def test_the_context_calibration_tallies_each_tried_candidate_by_its_effective_context(tmp_path):
    import json

    script = load_script("lookup_context_calibration")
    # one occurrence of [2, 3] with 3 tokens of context; the target says 9, 1, then 7 (not 2)
    got = script.tally([1, 2, 3, 9, 1, 2, 3], [9, 1, 7], max_ngram=2, max_depth=10, max_matches=8)
    assert got == {3: [1, 1], 4: [1, 1], 5: [0, 1]}
    assert script.main(["--model", "tiny", "--limit", "2", "--max-new-tokens", "8", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lookup_context.json").read_text())
    assert result["buckets"] and all(0 <= b["accepted"] <= b["tried"] for b in result["buckets"].values())
    assert sum(b["tried"] for b in result["buckets"].values()) == sum(
        t for w in result["by_effective_context"].values() for _, t in w.values()
    )
    assert "| pooled |" in (tmp_path / "lookup_context.md").read_text()
    assert [script.bucket_of(k) for k in (1, 2, 3, 4, 5, 16, 17, 40)] == [0, 1, 2, 2, 3, 4, 5, 5]


def test_the_lookup_comparison_loads_another_commits_proposer_beside_this_one():
    script = load_script("lookup_ab")
    baseline = script.baseline_module("HEAD")
    assert baseline.PromptLookupProposer is not PromptLookupProposer  # a module of its own
    assert baseline.PromptLookupProposer.name == "prompt_lookup"
    with pytest.raises(SystemExit, match="cannot read prompt_lookup.py"):
        script.baseline_module("no-such-revision-anywhere")


def test_a_corpus_of_earlier_requests_is_searched_below_the_current_one():
    from harness.proposers.prompt_lookup import SEPARATOR, TokenCorpus, find_continuations

    tokens = np.array([7, 1, 2, 50, 51, 3, 1, 2])
    # earlier requests: [1, 2] with 3 tokens of context (3 1 2) -> 60, cut by the separator after
    # it; [1, 2] after 4 -> 70 71 (context 2)
    corpus = TokenCorpus(np.array([9, 3, 1, 2, 60, SEPARATOR, 4, 1, 2, 70, 71, SEPARATOR]))
    got = find_continuations(tokens, max_ngram=2, min_ngram=2, max_depth=3, max_matches=8, corpus=corpus)
    assert [(c, cont.tolist(), h) for c, cont, h in got] == [
        (3, [60], True),
        (2, [50, 51, 3], False),
        (2, [70, 71], True),
    ]
    # a context never runs across a separator, nor before the current request's first token
    assert (
        find_continuations(np.array([1, 2]), max_ngram=2, min_ngram=2, max_depth=2, max_matches=8, corpus=corpus)[0][0]
        == 2
    )
    assert find_continuations(tokens, max_ngram=2, min_ngram=2, max_depth=3, max_matches=1, corpus=corpus)[0][2]


def test_the_history_index_finds_what_a_scan_finds(monkeypatch):
    from harness.proposers.prompt_lookup import SEPARATOR, TokenCorpus

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, 400)
    tokens[rng.integers(0, 400, 12)] = SEPARATOR
    corpus = TokenCorpus(tokens)
    for cap in (TokenCorpus.MAX_HITS, 5):  # every hit, and only the last few
        monkeypatch.setattr(TokenCorpus, "MAX_HITS", cap)
        tail = tokens[-2:].tolist()  # grams ending the history: no token after their last occurrence
        for gram in ([0], [3], [1, 2], [2, 2], [0, 1, 3], [3, 3, 3, 0], tail[1:], tail):
            n = len(gram)
            want = [i for i in range(len(tokens) - n) if tokens[i : i + n].tolist() == gram][-cap:]
            assert corpus.occurrences(np.array(gram)).tolist() == want, (cap, gram)
    # a token the history never holds occurs nowhere (its code must not alias another bigram's)
    history = TokenCorpus(np.array([1, 0, 2, 3, 1, 0, 3]))
    for gram in ([0, 5], [9], [-5, 0], [0, -7]):
        assert history.occurrences(np.array(gram)).tolist() == [], gram


def test_a_match_s_context_is_the_run_of_equal_tokens_before_it():
    from harness.proposers.prompt_lookup import MAX_CONTEXT, _context_lengths

    rng = np.random.default_rng(1)
    for _ in range(60):
        seq = rng.integers(0, 3, int(rng.integers(5, 120)))
        seq[rng.integers(0, len(seq), 3)] = -1  # separators: never equal to a request's token
        tokens = rng.integers(0, 3, int(rng.integers(3, 60)))
        n = int(rng.integers(1, 6))
        hits = np.sort(rng.choice(len(seq), size=min(len(seq), 20), replace=False))
        reach = min(MAX_CONTEXT, len(tokens) - 1) - n
        want = []
        for h in hits.tolist():
            run = 0
            while run < reach and h - 1 - run >= 0 and seq[h - 1 - run] == tokens[len(tokens) - n - 1 - run]:
                run += 1
            want.append(n + run)
        assert _context_lengths(seq, hits, n, tokens).tolist() == want


def test_the_native_match_search_finds_what_the_python_reference_finds(monkeypatch):
    import harness.proposers.prompt_lookup as lookup
    from harness.proposers.prompt_lookup import (
        SEPARATOR,
        TokenCorpus,
        find_continuations,
        find_continuations_python,
        match_search,
    )

    if match_search() != "native":
        pytest.skip("the native kernels do not build or load here")
    rng = np.random.default_rng(0)
    for case in range(600):
        vocab = int(rng.integers(2, 8))
        tokens = rng.integers(0, vocab, int(rng.integers(0, 80)))
        corpus = skip = None
        if rng.random() < 0.7:  # a history, with separators, tokens the request lacks and a skip mask
            held = rng.integers(0, int(rng.integers(1, vocab + 3)), int(rng.integers(1, 300)))
            held[rng.integers(0, len(held), max(1, len(held) // int(rng.choice([2, 3, 30]))))] = SEPARATOR
            corpus = TokenCorpus(held)
            skip = rng.random(len(corpus)) < 0.3 if rng.random() < 0.4 else None
        if rng.random() < 0.1:  # an empty history, or a skip mask without one
            corpus, skip = (TokenCorpus(np.empty(0, dtype=np.int64)), None) if rng.random() < 0.5 else (None, skip)
        monkeypatch.setattr(TokenCorpus, "MAX_HITS", int(rng.integers(1, 6)) if rng.random() < 0.3 else 1024)
        monkeypatch.setattr(lookup, "MAX_CONTEXT", int(rng.integers(2, 7)) if rng.random() < 0.3 else 32)
        low = int(rng.integers(1, 4))
        kw = {
            "max_ngram": int(rng.integers(low, 6)),
            "min_ngram": low,
            "max_depth": int(rng.integers(1, 12)),
            "max_matches": int(rng.integers(1, 10)),
            "corpus": corpus,
            "skip": skip,
        }
        got = [(c, cont.tolist(), h) for c, cont, h in find_continuations(tokens, **kw)]
        want = [(c, cont.tolist(), h) for c, cont, h in find_continuations_python(tokens, **kw)]
        assert got == want, (case, tokens.tolist(), kw)


def test_the_search_reads_past_the_best_occurrences_when_they_all_end_at_a_separator():
    from harness.proposers.prompt_lookup import SEPARATOR, TokenCorpus, find_continuations, find_continuations_python

    older = [t for k in range(10) for t in (7, 20 + k, SEPARATOR)]  # ten continuations, 20 the oldest
    corpus = TokenCorpus(np.array(older + [7, SEPARATOR] * 30))
    for search in (find_continuations, find_continuations_python):
        got = search(np.array([1, 7]), max_ngram=1, min_ngram=1, max_depth=3, max_matches=3, corpus=corpus)
        assert [(c, cont.tolist(), h) for c, cont, h in got] == [(1, [29], True), (1, [28], True), (1, [27], True)]


def test_without_the_native_kernels_the_python_search_serves_and_the_stats_say_so(monkeypatch):
    import harness.proposers.prompt_lookup as lookup

    monkeypatch.setattr(lookup, "_native_search", lambda: None)  # as where no compiler builds them
    monkeypatch.setattr(lookup, "find_continuations_python", spy := _Spy(lookup.find_continuations_python))
    prop = _lookup(0)
    assert prop.stats.extras["match_search"] == "python"
    tokens = [5, 6, 7, 8, 5, 6]
    prop.start(tokens)
    nodes = prop.propose(tokens, TorchRandomSource(0)).nodes
    assert spy.calls == 1 and [nd.token_id for nd in nodes][:2] == [7, 8]  # what followed "5 6"


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _lookup(history_tokens, **kw):
    return PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=8, max_depth=4),
        manifest_hash="h",
        history_tokens=history_tokens,
        **kw,
    )


def _serve(prop, prompt, output):
    prop.start(list(prompt))
    committed = list(prompt)
    prop.propose(committed, TorchRandomSource(0))
    committed += output
    prop.observe_commit(committed)
    prop.finish()


def test_history_serves_later_requests_but_never_a_request_its_own_answer():
    prop = _lookup(64)
    _serve(prop, [10, 11, 12], [20, 21, 22, 23, 24])
    other = [30, 31, 21, 22]  # ends with a bigram of the earlier output
    prop.start(other)
    assert [n.token_id for n in prop.propose(other, TorchRandomSource(0)).nodes] == [23, 24]
    prop.finish()
    # the same prompt again (a warm-up, a repeat, a gate's pass): its own earlier answer is not read
    again = [10, 11, 12, 20, 21, 22]
    prop.start(again[:3])
    assert prop.propose(again, TorchRandomSource(0)).nodes == ()
    prop.finish()
    # off: nothing is kept
    off = _lookup(0)
    _serve(off, [10, 11, 12], [20, 21, 22, 23, 24])
    off.start(other)
    assert off.propose(other, TorchRandomSource(0)).nodes == ()


def test_batch_slots_share_one_history_and_a_request_searches_it_as_it_started():
    """The job's batch slots each have a lookup proposer; joined, every slot searches what any slot
    served before (a batch of two: the next batch reads both outputs), and a request that started
    before another finished does not read it mid-request."""
    a, b = _lookup(64), _lookup(64)
    b.join(a)
    other = [30, 31, 21, 22]  # ends with a bigram of slot a's output
    b.start(other)  # started before slot a's request finished
    _serve(a, [10, 11, 12], [20, 21, 22, 23, 24])
    assert b.propose(other, TorchRandomSource(0)).nodes == ()  # not in the history it started with
    b.finish()
    b.start(other)
    assert [n.token_id for n in b.propose(other, TorchRandomSource(0)).nodes] == [23, 24]  # a's output
    b.finish()
    alone = _lookup(64)  # a slot not joined keeps its own history
    alone.start(other)
    assert alone.propose(other, TorchRandomSource(0)).nodes == ()


def test_a_shared_history_is_counted_once_and_the_warm_up_is_forgotten():
    """Every slot reported the whole shared history in its state bytes (the record's figure doubled
    at batch 2, B-fold in general), and the warm-up's outputs stayed in it for measured requests
    to search. The slot that owns the shelf counts it; the arms forget the warm-up's requests."""
    a, b = _lookup(64), _lookup(64)
    b.join(a)
    _serve(a, [10, 11, 12], [20, 21, 22, 23, 24])
    assert a.state_bytes() > 0 and b.state_bytes() == 0
    b.forget_requests()  # any slot's call empties the shelf they share
    assert a._shelf.history == [] and a.state_bytes() == 0
    other = [30, 31, 21, 22]
    a.start(other)
    assert a.propose(other, TorchRandomSource(0)).nodes == ()


def test_history_keeps_the_newest_tokens_up_to_its_size():
    prop = _lookup(6)
    _serve(prop, [1], [40, 41, 42, 43])
    _serve(prop, [2], [50, 51, 52, 53])  # 8 tokens: the oldest request is dropped
    assert [out.tolist() for _, out in prop._shelf.history] == [[50, 51, 52, 53]]
    assert prop.state_bytes() >= 4 * 8
    _serve(prop, [3], list(range(60, 70)))  # longer than the whole history: its last 6 tokens
    assert [out.tolist() for _, out in prop._shelf.history] == [list(range(64, 70))]
    with pytest.raises(ValueError, match="history_tokens"):
        _lookup(-1)


def test_adaptive_prompt_lookup_with_history_is_exact_across_requests(models):
    target, _, _ = models
    prompts = [PROMPT, [5, 17, 33, 8, 40, 41], PROMPT[::-1], PROMPT]
    prop = _lookup(4096, budget_policy="adaptive", verify_cost=[1.0 + 0.01 * k for k in range(9)])
    for prompt in prompts:
        res, _ = run(target, prop, prompt=prompt)
        assert res.tokens == autoregressive(target, prompt=prompt)
    assert prop.stats.extras["rows_kept_from_history"] > 0


def test_the_lookup_replay_prices_rounds_with_the_cost_curve(tmp_path):
    import json

    from harness.contracts import ProposalNode

    script = load_script("lookup_replay")
    # transformers' rule: the leftmost occurrence of the longest suffix n-gram
    assert script.transformers_lookup([1, 2, 5, 6, 1, 2, 7, 1, 2], num_tokens=3, ngram=2) == [5, 6, 1]
    assert script.transformers_lookup([4, 9, 8, 4], num_tokens=3, ngram=2) == [9, 8, 4]
    assert script.transformers_lookup([1, 2, 3], num_tokens=3, ngram=2) == []
    tree = [ProposalNode(token_id=t, parent=p, score=1.0, source="x") for t, p in ((5, -1), (6, 0), (7, 0))]
    assert script.accepted_along(tree, [5, 7, 1]) == 2 and script.accepted_along(tree, [6]) == 0
    t = [10.0, 10.5, 11.0, 11.5] + [12.0 + k for k in range(14)]  # t(1..18)
    loop = list(range(30, 50))
    records = [{"prompt": [1, *loop], "out": loop * 2}]  # the output copies its prompt
    ar = script.replay(records, t, propose=lambda committed, truth: (0, 0))
    assert ar["ms_per_token"] == 10.0 and ar["tokens_per_round"] == 1.0
    hf = script.transformers_replay(records, t)
    ours = script.replay(records, t, proposer=script.adaptive_proposer(t))
    assert hf["ms_per_token"] < 10.0 and ours["ms_per_token"] < 10.0 and ours["tokens_per_round"] > 2
    # a second prompt whose output repeats the first's: only the history finds it
    other = [{"prompt": [2, 3], "out": loop}, {"prompt": [4, 5], "out": loop}]
    alone = script.replay(other, t, proposer=script.adaptive_proposer(t))
    shared = script.replay(other, t, proposer=script.adaptive_proposer(t, history_tokens=1000))
    assert shared["ms_per_token"] < alone["ms_per_token"]
    # the clairvoyant ceiling: the best continuation of any earlier occurrence of the last token
    assert script.best_continuation([7, 1, 2, 3, 7, 1, 2, 9, 7], [1, 2, 9, 4], depth=8) == 3
    assert script.best_continuation([7, 1, 2, 3, 7, 1, 2, 9, 7], [1, 2, 9, 4], depth=2) == 2
    assert script.best_continuation([5, 6, 7], [8], depth=8) == 0
    for recs, prop in (
        (records, script.adaptive_proposer(t)),
        (other, script.adaptive_proposer(t, history_tokens=1000)),
    ):
        real = script.replay(recs, t, proposer=prop)
        ceiling = script.clairvoyant_replay(recs, t, history=True)
        assert ceiling["tokens_per_round"] >= real["tokens_per_round"]
        assert ceiling["ms_per_token"] < real["ms_per_token"]
        chosen = script.selection_oracle_replay(recs, t)  # the accepted path of the real candidates
        assert real["ms_per_token"] > chosen["ms_per_token"] >= ceiling["ms_per_token"]
    # the oracle keeps what greedy verification accepts of the proposer's own candidates: after the
    # prefill's 7, the earlier 7s propose 8 9 1 ... and 7; the target says 8 5, so one round verifies
    # the one row 8 (t(2)) and commits 8 and 5
    got = script.selection_oracle_replay([{"prompt": [7, 8, 9, 1, 7], "out": [7, 8, 5]}], t)
    assert got["tokens_per_round"] == 2.0 and got["ms_per_token"] == pytest.approx(t[1] / 2)
    blind = script.clairvoyant_replay(other, t, history=False)
    assert blind["ms_per_token"] > script.clairvoyant_replay(other, t, history=True)["ms_per_token"]
    # a dip in the curve is not held against it: the lower envelope prices each chain
    dip = [10.0, 20.0, 15.0] + [30.0] * 15
    one = [{"prompt": [1, 2, 3, 1], "out": [2, 3, 1, 2]}]  # two rounds, each a 1-token chain at t'(2) = 15
    got = script.clairvoyant_replay(one, dip, depth=1)
    assert got["ms_per_token"] == pytest.approx(30.0 / 3) and got["tokens_per_round"] == 1.5
    # a rejected candidate's tail after the target's correction: the prompt's 1 2 3 4 5 6 proposes
    # 2 3 4 5 6 after the prefill's 1; the target writes 7 instead of 2 (round 1), nothing matches
    # after 7 (round 2: the tail 3 4 5 6 would have given four tokens), and the unigram 3 finds 4 5 6
    # (round 3)
    substitution = [{"prompt": [9, 1, 2, 3, 4, 5, 6, 9], "out": [1, 7, 3, 4, 5, 6]}]
    got = script.rejected_remainder_replay(substitution, t)
    assert got == {"available": 1 / 3, "hits": 1 / 3, "beats_proposal": 1 / 3, "oracle_extra_tokens_per_round": 4 / 3}
    copied = [{"prompt": [9, 1, 2, 3, 4, 5, 6, 9], "out": [1, 2, 3, 4, 5, 6]}]  # nothing rejected
    assert script.rejected_remainder_replay(copied, t)["available"] == 0.0
    # a copy over many rounds (a steep curve keeps rounds short): the candidates the arm did not verify
    # continue the output, and the target never wrote another token, so there is no rejected tail
    steep = [10.0, 19.0] + [40.0 + 10 * k for k in range(16)]
    got = script.rejected_remainder_replay(records, steep)
    assert got == {"available": 0.0, "hits": 0.0, "beats_proposal": 0.0, "oracle_extra_tokens_per_round": 0.0}
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({"sets": {"x/eval": other}}))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"t_of_n_ms": t}))
    argv = ["replay", str(path), "--t-from", str(bench), "--baseline-rev", "HEAD", "--out", str(tmp_path / "r.json")]
    assert script.main([*argv, "--rejected-tails", "true", "false"]) == 0
    row = json.loads((tmp_path / "r.json").read_text())["table"]["x/eval"]
    assert row["adaptive_tails_history_0_ms_per_token"] > 0 and row["adaptive_history_0_ms_per_token"] > 0
    assert row["adaptive_history_65536_vs_transformers"] > row["adaptive_history_0_vs_transformers"]
    assert 0.0 <= row["remainder_hits"] <= row["remainder_available"] <= 1.0
    assert row["clairvoyant_history_vs_transformers"] >= row["selection_oracle_vs_transformers"]
    assert row["selection_oracle_vs_transformers"] > row["adaptive_history_65536_vs_transformers"]
    assert row["baseline_history_0_vs_transformers"] > 0  # the committed proposer, loaded from git
    # with a datastore that holds the outputs the history cannot give (the first prompt's), its
    # continuations make rounds cheaper than the lookup's alone
    from harness.workloads.datastore import datastore_from_token_ids, write_datastore

    store = tmp_path / "store"
    write_datastore(datastore_from_token_ids([[3, *loop]]), store)
    argv = ["replay", str(path), "--t-from", str(bench), "--history-tokens", "0", "--datastores", f"x={store}"]
    assert script.main([*argv, "--out", str(tmp_path / "d.json")]) == 0
    row = json.loads((tmp_path / "d.json").read_text())["table"]["x/eval"]
    assert row["adaptive_datastore_history_0_vs_transformers"] > row["adaptive_history_0_vs_transformers"]
    with pytest.raises(SystemExit) as exc:
        script.main(["replay", str(path), "--t-from", str(bench), "--datastores", f"x={tmp_path / 'none'}"])
    assert exc.value.code == 2


def test_the_acceptance_fit_observes_tried_rows_and_recovers_a_known_law(tmp_path, capsys):
    import json

    from harness.proposers.prompt_lookup import AcceptanceModel

    script = load_script("lookup_acceptance_fit")
    # output position 0 is the prefill's token (not tried); after 4 there is no earlier 4. After
    # 4 9, the 9 at 3 proposes 1 5 ...: 1 is the target's, 5 is not (it says 7). After 9 1, the
    # bigram at 3 proposes 5 (not 7), and the unigram 1 at 0 proposes 2 (not 7).
    x, y = script.observations([{"prompt": [1, 2, 3, 9, 1, 5, 0, 2, 3], "out": [4, 9, 1, 7]}])
    assert x.shape[1] == len(AcceptanceModel.FEATURES) and len(x) == len(y)
    assert y.tolist() == [True, False, False, False]
    effective = np.exp(x[:, AcceptanceModel.FEATURES.index("log_effective_context")]).round().tolist()
    assert effective == [1, 2, 2, 1]  # the 9 (context 1, depth 1 and 2), the bigram 9 1, the unigram 1
    # a law over the standardised features: only agreement and the first-sibling flag matter
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(20000, len(AcceptanceModel.FEATURES)))
    true_w = np.zeros(len(AcceptanceModel.FEATURES))
    true_w[AcceptanceModel.FEATURES.index("agreement")] = 1.5
    true_w[AcceptanceModel.FEATURES.index("first_sibling")] = -1.0
    p = 1 / (1 + np.exp(-(raw @ true_w + 0.3)))
    model = script.fit(raw * 2.0 + 1.0, rng.random(len(p)) < p, l2=0.0)
    np.testing.assert_allclose(model["weights"], true_w, atol=0.1)
    assert model["bias"] == pytest.approx(0.3, abs=0.1)
    assert np.allclose(model["mean"], 1.0, atol=0.1) and np.allclose(model["scale"], 2.0, atol=0.1)
    with pytest.raises(ValueError, match="both accepted and rejected"):
        script.fit(raw, np.ones(len(raw), dtype=bool))
    # one feature fitted alone, the rest held: rows where it is zero keep the held probabilities
    held = {"mean": [1.0] * raw.shape[1], "scale": [2.0] * raw.shape[1], "weights": true_w.tolist(), "bias": 0.3}
    extra = np.where(rng.random(len(raw)) < 0.3, rng.integers(1, 4, len(raw)), 0).astype(np.float64)
    x = raw * 2.0 + 1.0
    x[:, -1] = extra
    z = ((x[:, :-1] - 1.0) / 2.0) @ true_w[:-1] + 0.3 - 0.8 * extra
    y = rng.random(len(z)) < 1 / (1 + np.exp(-z))
    only = script.fit(x, y, l2=0.0, only=[raw.shape[1] - 1], held=held)
    assert only["weights"][-1] == pytest.approx(-0.8, abs=0.1) and only["weights"][:-1] == held["weights"][:-1]
    assert (only["mean"][-1], only["scale"][-1], only["bias"]) == (0.0, 1.0, 0.3)
    plain = x[:, -1] == 0
    assert script.log_loss(only, x[plain], y[plain]) == pytest.approx(script.log_loss(held, x[plain], y[plain]))
    # the command: fits on the dev sets, reports every set, writes the constants
    loop = list(range(30, 60))
    sets = {
        "code/dev": [{"prompt": [1, *loop[:20]], "out": loop + [7, 8] + loop[:10]}, {"prompt": [2], "out": loop}],
        "code/eval": [{"prompt": [3, *loop[:10]], "out": loop[:15] + [9] + loop[15:]}],
    }
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"sets": sets}))
    assert script.main([str(outputs), "--out", str(tmp_path / "fit.json")]) == 0
    result = json.loads((tmp_path / "fit.json").read_text())
    assert result["fit_sets"] == ["code/dev"] and result["features"] == list(AcceptanceModel.FEATURES)
    assert result["sets"]["code/eval"]["fitted_on"] is False and result["sets"]["code/dev"]["rows"] > 0
    assert "WEIGHTS: ClassVar" in capsys.readouterr().out
    assert result["settings"] == {
        "max_ngram": 2,
        "max_depth": 16,
        "max_matches": 8,
        "rows": 64,
    }  # the default experiment's
    # the rounds a run sees: the proposer replayed on a cost curve, rejected tails among its rows. After
    # the prefill's 1, the prompt's 1 proposes 2 3 4 5 6 9 1; the target writes 7, and the tail
    # 3 4 5 6 9 1 of that candidate is tried in the next round (its first four rows accepted)
    t = [10.0 + 0.2 * k for k in range(17)]
    substitution = [{"prompt": [9, 1, 2, 3, 4, 5, 6, 9], "out": [1, 7, 3, 4, 5, 6]}]
    x, y = script.round_observations(substitution, t)
    tail = x[:, AcceptanceModel.FEATURES.index("tail")] > 0
    assert tail.any() and y[tail].any() and len(x) == len(y)
    x_off, _ = script.round_observations(substitution, t, rejected_tails=False)
    assert not x_off[:, AcceptanceModel.FEATURES.index("tail")].any()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"t_of_n_ms": t}))
    assert script.main([str(outputs), "--t-from", str(bench), "--out", str(tmp_path / "rounds.json")]) == 0
    rounds = json.loads((tmp_path / "rounds.json").read_text())
    assert rounds["settings"]["t_from"] == str(bench) and rounds["sets"]["code/dev"]["rows"] > 0
    argv = [str(outputs), "--t-from", str(bench), "--only", "tail", "log_tail_run", "--out", str(tmp_path / "t.json")]
    assert script.main(argv) == 0
    tails_only = json.loads((tmp_path / "t.json").read_text())
    assert tails_only["only"] == ["tail", "log_tail_run"]
    fitted = {AcceptanceModel.FEATURES.index(f) for f in ("tail", "log_tail_run")}
    held_weights = [w for i, w in enumerate(tails_only["model"]["weights"]) if i not in fitted]
    assert held_weights == [w for i, w in enumerate(AcceptanceModel.WEIGHTS) if i not in fitted]
    # with a datastore: its continuations are among the rounds' rows, marked
    from harness.workloads.datastore import datastore_from_token_ids, write_datastore

    store = tmp_path / "store"
    write_datastore(datastore_from_token_ids([[9, 1, 7, 3, 4, 5, 6], [50, 51, 52]]), store)
    x_ds, y_ds = script.round_observations(substitution, t, datastore=str(store))
    marked = x_ds[:, AcceptanceModel.FEATURES.index("datastore")] > 0
    assert marked.any() and y_ds[marked].any()
    argv = [str(outputs), "--t-from", str(bench), "--datastores", f"code={store}", "--only", "datastore"]
    assert script.main([*argv, "--out", str(tmp_path / "ds.json")]) == 0
    ds_fit = json.loads((tmp_path / "ds.json").read_text())
    assert ds_fit["settings"]["datastores"] == {"code": str(store)} and ds_fit["only"] == ["datastore"]
    for bad_store in (["--datastores", "code"], ["--datastores", f"code={tmp_path / 'none'}"]):
        with pytest.raises(SystemExit) as exc:
            script.main([str(outputs), "--t-from", str(bench), *bad_store])
        assert exc.value.code == 2 and "give WORKLOAD=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([str(outputs), "--datastores", f"code={store}"])
    assert "--datastores needs --t-from" in capsys.readouterr().err
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"t_of_n_ms": t[:5]}))
    # bad input: one line and exit status 2, nothing written
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    no_sets = tmp_path / "no_sets.json"
    no_sets.write_text(json.dumps({"records": []}))
    eval_only = tmp_path / "eval_only.json"
    eval_only.write_text(json.dumps({"sets": {"code/eval": sets["code/eval"]}}))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"sets": {"code/dev": [{"prompt": [1, 2]}]}}))
    for argv, says in (
        ([str(outputs), "--fit", "code/test"], "no recorded set named code/test"),
        ([str(tmp_path / "missing.json")], "cannot read recorded outputs"),
        ([str(bad)], "cannot read recorded outputs"),
        ([str(no_sets)], "not a file of recorded outputs"),
        ([str(eval_only)], "no set name ends in /dev"),
        ([str(broken)], "is not a list of"),
        ([str(outputs), str(outputs)], "also in an earlier file"),
        ([str(outputs), "--t-from", str(tmp_path / "missing.json")], "cannot read a benchmark's t_of_n_ms"),
        ([str(outputs), "--t-from", str(short)], "must list at least 17 positive times"),
    ):
        assert script.main([*argv, "--out", str(tmp_path / "not_written.json")]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "not_written.json").exists()
    with pytest.raises(SystemExit):
        script.main([str(outputs), "--l2", "-1"])


def test_the_verify_cost_model_follows_the_rounds_own_times():
    from harness.proposers.prompt_lookup import VerifyCostModel

    profile = np.array([1.0, 1.1, 1.2, 1.6])
    model = VerifyCostModel(profile)
    np.testing.assert_allclose(model.cost(4), profile)  # nothing observed: the profile
    for rows, ms in ((0, 5.0), (5, 5.0), (2, 0.0), (2, float("nan"))):  # no such count, or no time
        model.observe(rows, ms)
    assert model.observed == 0
    for _ in range(200):  # the machine is twenty times slower than profiled, and 3 rows cost what 1 does
        model.observe(1, 20.0)
        model.observe(3, 20.0)
    cost = model.cost(4)
    assert cost[0] == pytest.approx(20.0, rel=0.05) and cost[2] / cost[0] < 1.06  # from 1.2
    assert cost[3] / cost[0] == pytest.approx(profile[3] / profile[0], rel=0.06)  # unobserved: the profile's shape
    before = model.cost(4)
    model.observe(1, 2000.0)  # one very slow round moves a count by a few percent at most
    assert (model.cost(4) / before).max() < 1.05


def test_the_learned_verify_cost_never_prices_more_rows_below_fewer():
    from harness.proposers.prompt_lookup import VerifyCostModel, non_decreasing

    np.testing.assert_allclose(non_decreasing(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4)), [1, 2.5, 2.5, 4])
    np.testing.assert_allclose(
        non_decreasing(np.array([1.0, 3.0, 2.0, 4.0]), np.array([1, 1, 3, 1])), [1, 2.25, 2.25, 4]
    )
    np.testing.assert_allclose(non_decreasing(np.array([3.0, 2.0, 1.0]), np.ones(3)), [2, 2, 2])
    profile = np.array([1.0, 1.02, 1.04, 1.3, 1.5])
    model = VerifyCostModel(profile)
    for _ in range(60):  # two rows observed only in slow minutes, three in ordinary ones
        model.observe(1, 10.0)
        model.observe(2, 15.0)
        model.observe(3, 10.4)
    cost = model.cost(5)
    assert (np.diff(cost) >= 0).all()
    # the dip is pooled: two and three rows share a price between what each was seen to cost
    assert cost[1] == pytest.approx(cost[2]) and 10.4 < cost[1] < 15.0
    assert cost[3] / cost[0] == pytest.approx(1.3, rel=0.05)  # unobserved counts above keep the profile
    rng = np.random.default_rng(0)
    for _ in range(20):  # whatever the rounds saw, the estimate never decreases
        model = VerifyCostModel(np.sort(rng.uniform(1, 2, 9)))
        for rows, ms in zip(rng.integers(1, 10, 300), rng.lognormal(2.5, 0.4, 300)):
            model.observe(int(rows), float(ms))
        assert (np.diff(model.cost(9)) >= 0).all()


def test_a_slow_first_round_does_not_distort_the_verify_cost_shape():
    from harness.proposers.prompt_lookup import VerifyCostModel

    profile = np.array([1.0, 1.1, 1.2, 1.6, 1.7, 1.8])
    model = VerifyCostModel(profile)
    model.observe(1, 1000.0)  # a warm-up or compile: a hundred times a normal round
    for _ in range(40):
        model.observe(1, 10.0)
    cost = model.cost(6)
    assert cost[0] == pytest.approx(10.0, rel=0.05)
    np.testing.assert_allclose(cost[1:] / cost[0], profile[1:] / profile[0], rtol=0.05)  # never seen: unchanged


def test_the_adaptive_budget_reports_what_it_learned_when_a_request_finishes():
    from harness.proposers.prompt_lookup import AcceptanceModel

    fixed = _lookup(0)
    assert fixed.learned_state() is None
    prop = _lookup(0, budget_policy="adaptive", verify_cost=[1.0, 1.0, 1.1, 1.2, 1.5, 1.6, 1.7, 1.8, 1.9])
    tokens = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    prop.start(tokens)
    assert prop.learned_state()["verify_cost_ms"] is None  # no round yet: no units
    for k in range(8):
        nodes = prop.propose(tokens, TorchRandomSource(0)).nodes
        prop.observe_verify(1 + len(nodes), 10.0 + len(nodes))
        tokens = tokens + [7 if k % 2 else 8]
        prop.observe_commit(tokens)
    prop.finish()
    state = prop.stats.extras["adaptive_budget"]
    assert state == prop.learned_state()
    assert state["verify_cost_ms"] == prop.cost_model.cost(9).tolist() and len(state["verify_cost_ms"]) == 9
    assert state["verify_rounds_observed"] == 8 and sum(state["verify_rounds_by_rows"]) == 8 - 5  # after the units
    assert state["acceptance_rows_learned"] == prop.acceptance.rows_learned > 0  # the commits taught it
    assert list(state["acceptance_weights"]) == list(AcceptanceModel.FEATURES)
    assert state["acceptance_weights"] != dict(zip(AcceptanceModel.FEATURES, AcceptanceModel.WEIGHTS, strict=True))
    fixed.start(tokens)
    fixed.finish()
    assert "adaptive_budget" not in fixed.stats.extras


def test_a_full_batch_round_tells_its_proposers_its_verify_time(models):
    """A round's verify time reaches the cost models when the run's batch size of requests shared the
    forward: the size their t(n) curve was measured at (at batch 1, every round of the request)."""
    from harness.engine.decode import RoundConfig, decode_batch

    target, _, _ = models

    class Spy(PromptLookupProposer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.seen = []

        def observe_verify(self, rows, ms):
            self.seen.append((rows, ms))
            super().observe_verify(rows, ms)

    budget = Budget(shape="sequences", max_nodes=4, max_depth=4)
    prop = Spy(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0] * 5)
    res, rounds = run(target, prop, new=16)
    assert [rows for rows, _ in prop.seen] == [1 + r["tree"].num_rows for r in rounds]
    assert all(ms > 0 for _, ms in prop.seen) and prop.cost_model.observed == len(rounds)
    pair = [Spy(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0] * 5) for _ in "ab"]
    alone = {0: 0, 1: 0, "shared": 0}

    def count(*, live, **_):
        alone[live[0] if len(live) == 1 else "shared"] += 1

    decode_batch(
        target=target,
        proposers=pair,
        verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompts=[PROMPT, PROMPT[::-1]],
        max_new_tokens=8,
        eos_token_ids=frozenset(),
        rngs=[TorchRandomSource(0), TorchRandomSource(1)],
        round_cfg=RoundConfig(max_nodes=4, max_depth=4),
        on_round=count,
    )
    # the batch-2 curve prices a forward of both requests' rows: only the rounds they shared
    assert [len(p.seen) for p in pair] == [alone["shared"], alone["shared"]]
    assert pair[0].seen == pair[1].seen  # the same forward, the same rows per request and time
    assert alone["shared"] > 0 and alone[0] + alone[1] > 0  # rounds of both kinds happened


def test_a_round_cut_by_the_token_budget_keeps_its_tree_depth_and_counts_only_the_depths_tried():
    """The round series shows the verified tree's depth (a 4-row chain is 4 deep, even when the
    request had one token left); acceptance by depth counts only the depths the walk tried."""
    from harness.measure.ledger import RoundLedger

    led = RoundLedger(max_depth=4)
    stage = {"proposal": 1.0, "target_verify": 2.0}
    led.observe_round(
        tree_depth=4,
        num_rows=4,
        accepted=0,
        committed=1,
        first_child_hit=False,
        stage_ms=stage,
        temp_kv_bytes=0,
        depth_tried=0,
    )  # one token left: the first candidate was accepted but cut, the bonus never emitted
    led.observe_round(
        tree_depth=4, num_rows=4, accepted=2, committed=3, first_child_hit=True, stage_ms=stage, temp_kv_bytes=0
    )  # a whole round: depths 1-3 tried, 1-2 accepted
    rows = led.rounds_table()
    assert [r["tree_depth"] for r in rows] == [4, 4] and [r["candidate_rows"] for r in rows] == [4, 4]
    assert led.reached == [1, 1, 1, 0] and led.accepted_at == [1, 1, 0, 0]


def test_what_a_proposer_learns_from_a_commit_is_proposal_time_and_its_finish_is_the_request_s(models):
    """A proposer's work on a round's outcome (``observe_commit``: a draft catching up, an
    acceptance model's update) lands in the next round's proposal stage, and its ``finish`` (an
    index of the output for later requests) in its last round's: every cost of the speculative arm
    is on its clock and in its ledger."""
    import time

    target, _, _ = models

    class Slow(PromptLookupProposer):
        commits = 0

        def observe_commit(self, committed):
            time.sleep(0.02)
            self.commits += 1
            super().observe_commit(committed)

        def finish(self):
            time.sleep(0.05)
            super().finish()

    prop = Slow(budget=Budget(shape="sequences", max_nodes=4, max_depth=4), manifest_hash="h")
    res, rounds = run(target, prop, new=12)
    n = res.ledger.rounds
    assert n >= 2 and prop.commits == n - 1  # told of every round's commit but the last's (then finish)
    proposal = [r["proposal"] for r in res.ledger.round_stage_ms]
    assert proposal[0] < 20 and all(ms >= 20 for ms in proposal[1:-1]) and proposal[-1] >= 70, proposal
    assert res.decode_ms == pytest.approx(sum(res.ledger.round_ms), abs=5)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_round_stages_add_up_to_the_decode_time(models, batch):
    """Everything a round does is in one of its stages: what the proposers learn from the verify
    forward's time and a finishing request's index of its output are proposal work, the cache's
    compaction when a request leaves the batch is temporary state. The batch rounds' stages add up
    to the batch's decode time, and each request's to its own."""
    import time

    from harness.engine.decode import RoundConfig, decode_batch

    target, _, _ = models

    class Slow(PromptLookupProposer):
        def observe_verify(self, rows, ms):
            time.sleep(0.01)
            super().observe_verify(rows, ms)

        def finish(self):
            time.sleep(0.03)
            super().finish()

    class SlowDrop(CausalLMBackend):
        drops = 0

        def drop(self, state, rows):
            if rows:
                time.sleep(0.02)
                self.drops += 1
            super().drop(state, rows)

    backend = SlowDrop(target.model)
    budget = Budget(shape="sequences", max_nodes=4, max_depth=4)
    props = [
        Slow(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0] * 5) for _ in range(batch)
    ]
    res = decode_batch(
        target=backend,
        proposers=props,
        verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompts=[PROMPT, PROMPT[::-1][: 6 + 4 * batch]][:batch],
        max_new_tokens=10,
        eos_token_ids=frozenset(),
        rngs=[TorchRandomSource(k) for k in range(batch)],
        round_cfg=RoundConfig(max_nodes=4, max_depth=4),
        full_batch=batch,
    )
    rounds = res.ledger.rounds
    assert backend.drops >= 1 and res.ledger.stage_ms["temporary_state"] >= 20 * backend.drops
    assert res.ledger.stage_ms["proposal"] >= 30 * batch + 10 * batch * min(r.ledger.rounds for r in res.requests)
    assert res.decode_ms == pytest.approx(sum(res.ledger.round_ms), abs=5), (res.decode_ms, res.ledger.round_ms)
    for req in res.requests:  # at B > 1 a request also waits for the others' own stages
        if batch == 1:
            assert req.decode_ms == pytest.approx(sum(req.ledger.round_ms), abs=5)
        else:
            assert sum(req.ledger.round_ms) <= req.decode_ms + 5
    assert rounds >= 2


def test_the_autoregressive_arm_runs_the_target_without_the_hooks_proposers_read_it_through():
    """A proposer built on the target's hidden rows hooks the model; the AR arm's forwards run
    without those hooks (a hooked model leaves the fast paths), the speculative arm's with them."""
    from harness.engine.arms import Arms
    from harness.heads.state import HiddenTap

    model = build_tiny_model(seed=2)
    tap = HiddenTap.on(model)
    tap.capture_layers([0])

    class Hooked(NullProposer):  # as a proposer reading the target's hidden rows through the tap
        def target_unhooked(self):
            return HiddenTap.suspended(model)

    budget = Budget(shape="sequence", max_nodes=1, max_depth=1)
    arms = Arms(
        target=CausalLMBackend(model),
        spec_proposers=[Hooked(budget=budget, manifest_hash="h")],
        null_proposers=[NullProposer(budget=budget, manifest_hash="h")],
        spec_verifier=get_verifier("greedy"),
        ar_verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompts=[PROMPT],
        seed=0,
        batch_size=1,
        max_new_tokens=4,
        eos_token_ids=frozenset(),
        round_cfg=RoundConfig(max_nodes=1, max_depth=1),
        rng_factory=TorchRandomSource,
    )
    serial = tap.serial
    ar = arms._run("ar", [0], [PROMPT], 0, 4)
    assert tap.serial == serial  # no forward of the AR arm reached the tap
    spec = arms._run("spec", [0], [PROMPT], 0, 4)
    assert tap.serial == serial + 1 + spec.requests[0].ledger.rounds  # the prefill and every round's verify
    assert set(tap.last.aux) == {0}  # the layer capture is back too
    assert ar.requests[0].tokens == spec.requests[0].tokens


def test_a_history_index_orders_equal_codes_by_position_as_a_stable_sort_does():
    """The index sorts positions by unigram and bigram code with equal codes in position order (the
    most recent occurrences are the last ones); it folds the position into the key for the faster
    unstable sort, and falls back to the stable sort where the folded key would not fit."""
    from harness.proposers.prompt_lookup import SEPARATOR, TokenCorpus, _stable_order

    rng = np.random.default_rng(0)
    for n, vocab in ((0, 5), (1, 5), (300, 3), (5000, 40), (20000, 49152)):
        tokens = rng.integers(0, vocab, n)
        tokens[rng.random(n) < 0.05] = SEPARATOR
        corpus = TokenCorpus(tokens)
        shifted = tokens + 1
        assert np.array_equal(corpus._uni_order, np.argsort(shifted, kind="stable"))
        codes = shifted[:-1] * corpus._base + shifted[1:]
        assert np.array_equal(corpus._bi_order, np.argsort(codes, kind="stable"))
    huge = np.array([3, 1, 3, 0, 1], dtype=np.int64)
    assert np.array_equal(_stable_order(huge, 2**61), [3, 1, 4, 0, 2])  # the stable sort itself


def test_the_warm_up_leaves_what_the_proposers_learn_as_it_found_it():
    """The warm-up decodes the first measured prompt's first tokens: an adaptive budget (its cost and
    acceptance models) or an adaptive draft threshold that kept what it learned there would start
    that prompt's measurement trained on its own first rounds. The arms put it back after the
    warm-up, as they restart the counters and forget its requests."""
    from harness.engine.arms import Arms
    from harness.proposers.merged import MergedProposer

    target = CausalLMBackend(build_tiny_model(seed=1))
    budget = Budget(shape="sequences", max_nodes=8, max_depth=4)
    prompts = [PROMPT * 3, [20, 21, 22, 20, 21] * 4]
    lookup = PromptLookupProposer(
        budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0 + 0.05 * i for i in range(9)]
    )
    before = lookup.snapshot_learning()
    arms = Arms(
        target=target,
        spec_proposers=[lookup],
        null_proposers=[NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")],
        spec_verifier=get_verifier("greedy"),
        ar_verifier=get_verifier("greedy"),
        policy=GREEDY,
        prompts=prompts,
        seed=0,
        batch_size=1,
        max_new_tokens=16,
        eos_token_ids=frozenset(),
        round_cfg=RoundConfig(max_nodes=8, max_depth=4),
        rng_factory=TorchRandomSource,
    )
    learned = []
    run_once = arms._run

    def spy(arm, *args):
        out = run_once(arm, *args)
        if arm == "spec":
            learned.append((lookup.acceptance.rows_learned, lookup.cost_model.observed))
        return out

    arms._run = spy
    arms.warmup(16)
    assert learned and learned[0][0] > 0 and learned[0][1] > 0  # the warm-up's rounds taught both models
    after = lookup.snapshot_learning()
    assert after["acceptance"].rows_learned == before["acceptance"].rows_learned == 0
    assert np.array_equal(after["acceptance"].weights, before["acceptance"].weights)
    assert after["cost_model"].observed == 0
    assert np.array_equal(after["cost_model"].count, before["cost_model"].count)
    # a merged proposer puts back each source's
    inner = PromptLookupProposer(budget=budget, manifest_hash="h", budget_policy="adaptive", verify_cost=[1.0] * 9)
    merged = MergedProposer(budget=budget, manifest_hash="h", sources=[inner], source_caps=[inner.capabilities()])
    snap = merged.snapshot_learning()
    inner.acceptance.rows_learned = 7
    merged.restore_learning(snap)
    assert inner.acceptance.rows_learned == 0
    # generation.warmup_tokens=0 (its range allows it) is no warm-up, not a one-token one
    ran = []
    arms._run = lambda arm, *args: ran.append(arm)
    arms.warmup(0)
    assert ran == []
    arms.warmup(2)
    assert ran == ["ar", "spec"]


def test_a_proposal_bound_to_another_manifest_is_refused_by_the_round(models):
    """Every proposal carries the manifest hash it was made under; one that is not its proposer's
    (a stale proposal, index or cache from another configuration) stops the round."""
    import dataclasses

    from harness.contracts import ContractError

    target, _, _ = models

    class Stale(PromptLookupProposer):
        def propose(self, committed, rng):
            result = super().propose(committed, rng)
            return dataclasses.replace(result, manifest_hash="stale")

    prop = Stale(budget=Budget(shape="sequences", max_nodes=4, max_depth=4), manifest_hash="h")
    with pytest.raises(ContractError, match=r"proposal bound to manifest 'stale', not its own 'h'"):
        run(target, prop, new=8)
    ok = PromptLookupProposer(budget=Budget(shape="sequences", max_nodes=4, max_depth=4), manifest_hash="h")
    assert run(target, ok, new=8)[0].tokens == autoregressive(target, new=8)


def test_the_first_round_s_correctness_checks_are_no_part_of_the_timed_round(models, monkeypatch):
    """The candidate-graph and commit checks of each request's first round ran inside the packing and
    temporary-state spans: a cost of the loop's own assertions, charged to the speculative arm (its
    trees are larger than the baseline's empty one) as decode time. They run, untimed: here each
    check moves the stage clock's time source on by an hour, which no timed span may show."""
    import types

    import harness.engine.decode as decode_module
    import harness.measure.ledger as ledger_module

    hour, calls, skipped = 3600.0, [], [0.0]
    real = ledger_module.time.perf_counter
    monkeypatch.setattr(ledger_module, "time", types.SimpleNamespace(perf_counter=lambda: real() + skipped[0]))

    def slowed(check):
        def run_check(*args, **kwargs):
            calls.append(check.__name__)
            skipped[0] += hour
            return check(*args, **kwargs)

        return run_check

    monkeypatch.setattr(decode_module, "validate_candidate_graph", slowed(decode_module.validate_candidate_graph))
    monkeypatch.setattr(decode_module, "validate_commit", slowed(decode_module.validate_commit))
    target = models[0]
    res, _ = run(
        target, PromptLookupProposer(budget=Budget(shape="sequences", max_nodes=12, max_depth=4), manifest_hash="h")
    )
    assert calls == ["validate_candidate_graph", "validate_commit"]  # the first round's checks ran
    rounds = res.ledger.rounds_table()
    assert rounds[0]["packing_ms"] < hour * 1e3 and rounds[0]["temporary_state_ms"] < hour * 1e3
    assert res.decode_ms < hour * 1e3 and res.ttft_ms - res.prefill_ms < hour * 1e3
    assert res.round_end_ms[0] < hour * 1e3


def test_a_batch_s_rounds_add_up_to_its_decode_time_exactly(models, monkeypatch):
    """Batch 3, requests leaving at different rounds, both arms: the batch rounds' times (the batch
    ledger's, and as the record rebuilds them from the requests' rows: their own stages summed over the
    live requests plus the shared ones) add up to the batch's decode time to float precision. The
    ledgers' record of a round is off the clock (here each record takes a millisecond): neither the
    next round's proposal nor the decode time after the last round holds it."""
    import time

    from harness.engine.decode import BatchLedger, decode_batch
    from harness.measure.ledger import SHARED_ROUND_STAGES, STAGES

    target, _, _ = models
    prompts = [PROMPT, PROMPT[::-1], [9, 9, 10, 11, 12, 13, 14, 15, 3, 4, 9, 9, 10]]
    free = [autoregressive(target, prompt=p, new=16) for p in prompts]
    eos_tok = next(t for t in free[0][1:6] if t not in free[1] and t not in free[2])  # request 0 stops early
    real_observe = BatchLedger.observe_round

    def slow_observe(self, **kwargs):
        time.sleep(0.001)
        real_observe(self, **kwargs)

    monkeypatch.setattr(BatchLedger, "observe_round", slow_observe)
    budget = Budget(shape="sequences", max_nodes=8, max_depth=4)
    for arm in ("ar", "spec"):
        if arm == "ar":
            props = [NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")]
        else:
            props = [PromptLookupProposer(budget=budget, manifest_hash="h")]
        props += [type(props[0])(budget=props[0].budget, manifest_hash="h") for _ in prompts[1:]]
        cfg = props[0].budget
        res = decode_batch(
            target=target,
            proposers=props,
            verifier=get_verifier("greedy"),
            policy=GREEDY,
            prompts=prompts,
            max_new_tokens=16,
            eos_token_ids=frozenset({eos_tok}),
            rngs=[TorchRandomSource(k) for k in range(3)],
            round_cfg=RoundConfig(max_nodes=cfg.max_nodes, max_depth=cfg.max_depth),
        )
        rounds = [req.ledger.rounds for req in res.requests]
        assert res.requests[0].finished_by == "eos" and rounds[0] < max(rounds), (arm, rounds)
        assert [req.tokens for req in res.requests][1:] == free[1:]
        assert res.ledger.rounds == max(rounds)
        assert sum(res.ledger.round_ms) == pytest.approx(res.decode_ms, rel=1e-12, abs=1e-9), arm
        rebuilt = []
        for j in range(res.ledger.rounds):
            rows = [req.ledger.round_stage_ms[j] for req in res.requests if req.ledger.rounds > j]
            own = sum(row[s] for row in rows for s in STAGES if s not in SHARED_ROUND_STAGES)
            rebuilt.append(own + sum(rows[0][s] for s in SHARED_ROUND_STAGES))
            assert rebuilt[-1] == pytest.approx(res.ledger.round_ms[j], rel=1e-12, abs=1e-9)
        assert sum(rebuilt) == pytest.approx(res.decode_ms, rel=1e-12, abs=1e-9), arm
        for req, n in zip(res.requests, rounds):  # a request ends where its last round ends
            assert req.decode_ms == pytest.approx(sum(rebuilt[:n]), rel=1e-12, abs=1e-9)
        assert max(req.decode_ms for req in res.requests) == res.decode_ms


def test_a_proposal_outside_what_its_proposer_declared_is_refused_by_the_round(models):
    """The verifier is negotiated for the semantics and sampling relations a proposer declares; a
    proposal of another relation (here i.i.d. draws from a proposer declaring lookup paths) stops the
    round instead of reaching a verifier whose exactness assumed the declared ones."""
    from harness.contracts import ContractError, ProposalResult

    target = models[0]

    class Mislabelled(PromptLookupProposer):
        def propose(self, committed, rng):
            return ProposalResult.from_paths([[5, 6]], source="mislabelled", manifest_hash="h", sampling_relation="iid")

    proposer = Mislabelled(budget=Budget("sequences", 4, 3), manifest_hash="h")
    assert "iid" not in proposer.capabilities().sampling_relations
    with pytest.raises(ContractError, match=r"sampling_relation='iid' \(declared .*\).*'prompt_lookup'"):
        run(target, proposer, new=4)
