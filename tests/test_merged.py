"""proposer=merged: full-prefix merge of several sources, negotiation over the union
of semantics, the membership/greedy oracles, greedy equality and per-source attribution."""

from __future__ import annotations

import json
from typing import ClassVar

import numpy as np
import pytest

import harness.config  # noqa: F401  (registers the config schemas)
from harness.config import compose
from harness.contracts import Budget, ProposalNode, ProposalResult
from harness.engine.build import plan
from harness.engine.decode import RoundConfig, decode
from harness.gates.oracle import OracleCase, PrefixLaws, check_case, fixed_candidates
from harness.proposers.base import NullProposer, Proposer
from harness.proposers.merged import MergedProposer, merge_proposals
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.proposers.rest import RestProposer
from harness.random_source import TorchRandomSource
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.topology.compiler import compile_tree, validate_candidate_graph
from harness.verifiers import get_verifier
from harness.verifiers.base import NegotiationError, negotiate
from harness.verifiers.sampling import SamplingPolicy
from harness.workloads.datastore import datastore_from_token_ids, write_datastore

MERGED = Budget(shape="merged", max_nodes=16, max_depth=8)


def compose_cfg(*overrides: str):
    return compose(overrides)


class Fixed(Proposer):
    """A source proposing a fixed candidate table every round (no randomness, no state)."""

    name: ClassVar[str] = "fixed"
    probability_semantics: ClassVar[str] = "frequency"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"tree"})

    def __init__(self, table, *, name: str, semantics: str = "frequency") -> None:
        super().__init__(budget=Budget(shape="tree", max_nodes=16, max_depth=8), manifest_hash="h")
        self.name, self.probability_semantics = name, semantics  # per instance
        self.result = fixed_candidates(table, semantics=semantics, source=name)

    def propose(self, committed, rng) -> ProposalResult:
        return self.result


def prefixes(nodes: list[ProposalNode]) -> list[tuple[int, ...]]:
    out = []
    for n in nodes:
        out.append((() if n.parent < 0 else out[n.parent]) + (n.token_id,))
    return out


# ------------------------------------------------------------------------------ the merge itself


def test_merge_by_full_prefix_keeps_equal_tokens_under_different_parents_distinct():
    # the proposal-buffer trace's shape from two sources: A proposes A-B-{C,D}, the other B-{B,E}
    # and A-B-D again
    a, b, c, d, e = 1, 2, 3, 4, 5
    first = fixed_candidates({(): [a], (a,): [b], (a, b): [c, d]}, semantics="frequency", source="rest")
    second = fixed_candidates(
        {(): [b, a], (b,): [b, e], (a,): [b], (a, b): [d]}, semantics="score_only", source="prompt_lookup"
    )
    nodes, stats = merge_proposals([first, second], max_nodes=16, max_depth=8)
    # round-robin: rest[0], pl[0], rest[1], pl[1], ...; repeated prefixes stay as extra nodes
    assert [(p, n.source) for p, n in zip(prefixes(nodes), nodes)] == [
        ((a,), "rest"),
        ((b,), "prompt_lookup"),
        ((a, b), "rest"),
        ((a,), "prompt_lookup"),
        ((a, b, c), "rest"),
        ((b, b), "prompt_lookup"),
        ((a, b, d), "rest"),
        ((b, e), "prompt_lookup"),
        ((a, b), "prompt_lookup"),
        ((a, b, d), "prompt_lookup"),
    ]
    assert stats == [{"offered": 4, "new_rows": 4, "shared": 0}, {"offered": 6, "new_rows": 3, "shared": 3}]
    result = ProposalResult(
        nodes=tuple(nodes),
        probability_semantics="score_only",
        sampling_relation="deterministic_lookup",
        topology="tree",
        state_handle=first.state_handle,
        manifest_hash="h",
    )
    tree = compile_tree([result], prefix_len=3)
    validate_candidate_graph(tree)
    rows = dict(zip(tree.full_prefixes, tree.sources))
    assert list(rows) == [(a,), (b,), (a, b), (a, b, c), (b, b), (a, b, d), (b, e)]
    assert rows[(a, b)] == ("rest", "prompt_lookup") and rows[(a, b, d)] == ("rest", "prompt_lookup")
    assert rows[(b, b)] == ("prompt_lookup",) and rows[(a, b, c)] == ("rest",)
    # token b under the frontier, under a and under b: three distinct rows
    assert sorted(p for p in rows if p[-1] == b) == [(a, b), (b,), (b, b)]


def test_merge_budget_is_shared_round_robin_and_prefix_closed():
    chain = fixed_candidates({(): [1], (1,): [2], (1, 2): [3], (1, 2, 3): [4]}, source="x")
    other = fixed_candidates({(): [5], (5,): [6], (5, 6): [7], (5, 6, 7): [8]}, source="y")
    nodes, stats = merge_proposals([chain, other], max_nodes=5, max_depth=8)
    assert prefixes(nodes) == [(1,), (5,), (1, 2), (5, 6), (1, 2, 3)]
    assert [s["new_rows"] for s in stats] == [3, 2]
    nodes, _ = merge_proposals([chain, other], max_nodes=16, max_depth=2)
    assert prefixes(nodes) == [(1,), (5,), (1, 2), (5, 6)]  # deeper nodes and their children dropped


def test_the_merge_shares_the_node_budget_among_the_rows_the_round_can_commit():
    """In a request's last rounds (``depth_cap``) a row deeper than the round commits is not merged:
    it took a node of the budget, and the compiler then cut it, while shallower rows of another
    source were left out. ``depth_cap`` 0 (only the target's own token is left) keeps no row."""
    chain = Fixed({(): [1], (1,): [2], (1, 2): [3], (1, 2, 3): [4]}, name="chain")  # ignores depth_cap
    wide = Fixed({(): [5, 6, 7]}, name="wide")
    merged = MergedProposer(budget=Budget("merged", 3, 4), manifest_hash="h", sources=[chain, wide])
    assert prefixes(list(merged.propose([9], rng=None).nodes)) == [(1,), (5,), (1, 2)]
    merged.depth_cap = 1
    result = merged.propose([9], rng=None)
    assert prefixes(list(result.nodes)) == [(1,), (5,), (6,)]
    assert compile_tree([result], prefix_len=1, max_nodes=3, max_depth=1).token_ids.tolist() == [1, 5, 6]
    merged.depth_cap = 0
    assert merged.propose([9], rng=None).nodes == ()
    nodes, stats = merge_proposals([chain.result, wide.result], max_nodes=3, max_depth=0)
    assert nodes == [] and [s["offered"] for s in stats] == [4, 3]


def test_each_source_s_share_of_the_proposal_is_timed_after_its_device_ran_its_kernels(monkeypatch):
    """A draft source's kernels on a GPU are queued, not run, when its call returns: read without
    waiting for them, its share of the proposal time fell to the next source that waited."""
    import torch

    import harness.proposers.merged as merged_module

    waited: list[str] = []

    class OnGpu(Fixed):
        def devices(self):
            return {torch.device("cuda", 0)}

        def propose(self, committed, rng):
            waited.append("propose")
            return self.result

    def synchronizer(device):
        return (lambda: waited.append(str(device))) if device.type == "cuda" else None

    monkeypatch.setattr(merged_module, "device_synchronizer", synchronizer)
    draft, lookup = OnGpu({(): [1]}, name="draft"), Fixed({(): [5]}, name="lookup")
    merged = MergedProposer(budget=Budget("merged", 3, 4), manifest_hash="h", sources=[draft, lookup])
    assert merged.devices() == {torch.device("cuda", 0)} and lookup.devices() == set()
    merged.propose([9], rng=None)
    # the draft's clock read after its device's queue drained, before and after its own call
    assert waited[:3] == ["cuda:0", "propose", "cuda:0"] and waited.count("propose") == 1
    assert set(merged.stats.extras["per_source"]) == {"draft", "lookup"}


def test_a_rest_source_prunes_its_trie_to_the_round_s_depth_cap():
    """REST inside a merged tree gets the round's depth cap: its node budget goes to the levels the
    round verifies."""
    docs = [[1, 2, 10, 11, 12, 13]] * 5 + [[1, 2, 20, 21, 22, 23]] * 4 + [[1, 2, 30, 31]] * 3 + [[1, 2, 40]]
    rest = RestProposer(budget=Budget("tree", 4, 4), manifest_hash="h", datastore=datastore_from_token_ids(docs))
    lookup = PromptLookupProposer(budget=Budget("sequences", 4, 4), manifest_hash="h")
    merged = MergedProposer(budget=Budget("merged", 4, 4), manifest_hash="h", sources=[rest, lookup])
    merged.depth_cap = 1
    result = merged.propose([7, 1, 2], TorchRandomSource(0))
    assert rest.depth_cap is None and lookup.depth_cap is None  # the cap is the round's only
    tree = compile_tree([result], prefix_len=3, max_nodes=4, max_depth=1)
    assert tree.token_ids.tolist() == [10, 20, 30, 40]


# ------------------------------------------------------------------------------ negotiation


def merged_options(**rest):
    return {
        "sources": ["rest", "prompt_lookup"],
        "rest": {"name": "rest", "datastore": {"path": "/nonexistent"}, **rest},
        "prompt_lookup": {"name": "prompt_lookup", "max_ngram": 3, "min_ngram": 1, "max_matches": 8},
    }


def test_negotiation_sees_the_union_of_source_semantics():
    caps = MergedProposer.declare(merged_options(), MERGED)
    assert caps.probability_semantics == frozenset({"frequency", "score_only"})
    assert caps.sampling_relations == frozenset({"deterministic_lookup"}) and caps.topology == "tree"
    for name in ("rejection", "specinfer", "sequoia"):
        with pytest.raises(NegotiationError, match="probability semantics"):
            negotiate(caps, get_verifier(name), temperature=0.7)
    negotiate(caps, get_verifier("greedy"), temperature=0.0)
    negotiate(caps, get_verifier("membership"), temperature=0.7)
    # a q-carrying source still cannot unlock a p/q verifier: the merge emits score_only
    with_draft = {**merged_options(), "sources": ["draft_model", "prompt_lookup"], "draft_model": {"sampling": "iid"}}
    caps = MergedProposer.declare(with_draft, MERGED)
    assert caps.probability_semantics == frozenset({"normalized_conditional", "score_only"})
    assert caps.sampling_relations == frozenset({"iid", "deterministic_lookup"})
    with pytest.raises(NegotiationError):
        negotiate(caps, get_verifier("specinfer"), temperature=0.7)
    with pytest.raises(ValueError, match="use topology=merged"):
        MergedProposer.declare(merged_options(), Budget(shape="sequence", max_nodes=4, max_depth=4))
    with pytest.raises(ValueError, match="proposer.draft_model is not configured"):
        MergedProposer.declare({**merged_options(), "sources": ["draft_model"]}, MERGED)


def test_merged_with_a_pq_verifier_is_refused_from_the_config_before_model_work():
    base = ["model=tiny", "proposer=merged", "topology=merged", "proposer.rest.datastore.path=/nonexistent"]
    cfg = compose_cfg(*base, "verifier=specinfer", "generation.temperature=0.7")
    assert list(cfg.proposer.sources) == ["rest", "prompt_lookup"]
    with pytest.raises(NegotiationError, match=r"\['frequency', 'score_only'\]"):
        plan(cfg)
    p = plan(compose_cfg(*base, "verifier=membership", "generation.temperature=0.7"))
    assert p.budget == Budget(shape="merged", max_nodes=16, max_depth=8)


STEP = [1.0] + [2.0] * 16  # a verify-cost step at 2 rows: the first candidate row doubles the forward
#: a request whose suffix "1 2 3" occurred three times before, followed by other continuations
REPEATS = [1, 2, 3, 10, 11, 12, 50, 1, 2, 3, 20, 21, 22, 51, 1, 2, 3, 10, 11, 30, 52, 1, 2, 3]
SHALLOW = Budget(shape="merged", max_nodes=16, max_depth=3)


def adaptive_lookup(rate: float) -> PromptLookupProposer:
    lookup = PromptLookupProposer(
        budget=Budget("sequences", 16, 3), manifest_hash="h", budget_policy="adaptive", verify_cost=STEP
    )
    lookup.acceptance.predict = lambda x: np.full(len(x), rate)
    seen = []
    choose = lookup._choose_rows
    lookup._choose_rows = lambda *a: (seen.append(getattr(lookup, "rows_before", None)), choose(*a))[1]
    lookup.seen_rows_before = seen
    return lookup


@pytest.mark.parametrize("lookup_first", [False, True])
def test_an_adaptive_lookup_prices_its_rows_after_the_other_sources_rows(lookup_first):
    """The merged forward carries the other sources' rows: an adaptive prompt lookup is told them
    (rows_before, only for its proposal) and prices its own rows after them. Under a cost step at 2
    rows it keeps none alone, and all of them once another source has paid the step."""
    alone = adaptive_lookup(0.1)
    res = MergedProposer(budget=SHALLOW, manifest_hash="h", sources=[alone]).propose(REPEATS, TorchRandomSource(0))
    assert alone.seen_rows_before == [frozenset()] and res.nodes == () and len(alone.last_candidates) > 1
    lookup = adaptive_lookup(0.1)
    other = Fixed({(): [90, 91], (90,): [92], (90, 92): [93], (91,): [3]}, name="rest")
    sources = [lookup, other] if lookup_first else [other, lookup]
    merged = MergedProposer(budget=SHALLOW, manifest_hash="h", sources=sources)
    res = merged.propose(REPEATS, TorchRandomSource(0))
    # the other source's rows were counted before the lookup chose, whatever the sources' order
    assert lookup.seen_rows_before == [frozenset({(90,), (91,), (90, 92), (90, 92, 93), (91, 3)})]
    assert lookup.rows_before == frozenset()  # for that proposal only
    kept = res.extras["sources"]["prompt_lookup"]["nodes"]
    assert kept == len(lookup.last_candidates) > 0  # the step is paid: every candidate row is kept
    # the merge interleaves the proposals in the sources' list order
    assert res.nodes[0].source == ("prompt_lookup" if lookup_first else "rest")
    assert [n.source for n in res.nodes].count("rest") == 5 and len(res.nodes) == 5 + kept
    # a depth cap bounds the rows counted: only the other source's first level remains
    merged.depth_cap = 1
    merged.propose(REPEATS, TorchRandomSource(0))
    assert lookup.seen_rows_before[-1] == frozenset({(90,), (91,)})


@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
def test_a_merged_draft_source_samples_a_chain_at_temperature_0(sampling):
    """Inside proposer=merged a draft source's sub-budget has one child per level: at temperature 0
    its sampled chain is the argmax chain beam drafts, so proposer.draft_model.sampling=iid (or
    without_replacement) is no tree collapsing into a chain and is planned; outside merged a
    branching draft's sampling is still refused under the key that sets it."""
    from harness.proposers.merged import sub_budget
    from harness.proposers.registry import proposer_class

    base = ["model=tiny", "proposer=merged", "topology=merged", "proposer.sources=[draft_model,prompt_lookup]"]
    cfg = compose_cfg(*base, f"proposer.draft_model.sampling={sampling}")
    assert cfg.generation.temperature == 0
    p = plan(cfg)
    assert sampling in p.capabilities.sampling_relations  # the source's relation is still declared
    from harness.engine.build import branching_samplings

    assert branching_samplings(cfg, p.budget, p.capabilities) == []
    draft = proposer_class("draft_model")(
        budget=sub_budget(proposer_class("draft_model"), p.budget),
        manifest_hash="h",
        policy=SamplingPolicy(),
        backend=CausalLMBackend(build_tiny_model(seed=3)),
        sampling=sampling,
    )
    assert draft.widths == (1,) * p.budget.max_depth  # one child per level: a chain
    single = compose_cfg("model=tiny", "proposer=draft_model", "topology=set", f"proposer.sampling={sampling}")
    with pytest.raises(Exception, match=rf"proposer.sampling={sampling} at temperature 0 draws the draft's argmax"):
        plan(single)


# ------------------------------------------------------------------------------ oracles


def two_source_merged(table_a, table_b, budget=MERGED) -> MergedProposer:
    return MergedProposer(
        budget=budget,
        manifest_hash="h",
        sources=[Fixed(table_a, name="rest"), Fixed(table_b, name="prompt_lookup", semantics="score_only")],
    )


TABLE_A = {(): [0, 1], (0,): [2], (0, 2): [1]}
TABLE_B = {(): [0, 2], (0,): [2, 0], (2,): [0]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_tree_passes_the_membership_oracle(seed):
    merged = two_source_merged(TABLE_A, TABLE_B)
    result = merged.propose([7], TorchRandomSource(0))
    assert result.probability_semantics == "score_only" and len(result.nodes) == 9  # 7 rows + 2 shared
    case = OracleCase(
        name=f"merged-membership-{seed}",
        proposal_builder=lambda rng: merged.propose([7], rng),
        target=PrefixLaws(vocab=3, seed=seed, kind="dense"),
        length=4,
    )
    row = check_case(get_verifier("membership"), case)
    assert row["passed"] and row["max_abs_error"] <= 1e-9 and row["leaves"] > 10


def test_merged_tree_passes_the_greedy_oracle():
    merged = two_source_merged(TABLE_A, TABLE_B)
    for seed in range(4):
        case = OracleCase(
            name="merged-greedy",
            proposal_builder=lambda rng: merged.propose([7], rng),
            target=PrefixLaws(vocab=3, seed=seed, kind="one_hot"),
            length=4,
        )
        assert check_case(get_verifier("greedy"), case)["max_abs_error"] == 0.0


# ------------------------------------------------------------------------------ decode on tiny


class Oracle(Proposer):
    """Proposes the next ``k`` tokens of a known AR output (plus a wrong branch with ``wrong``)."""

    name: ClassVar[str] = "ar"
    probability_semantics: ClassVar[str] = "score_only"
    sampling_relation: ClassVar[str] = "deterministic_lookup"
    shapes: ClassVar[frozenset[str]] = frozenset({"tree"})

    def __init__(self, ar, prompt_len, k, *, name, wrong=None) -> None:
        super().__init__(budget=Budget(shape="tree", max_nodes=16, max_depth=8), manifest_hash="h")
        self.ar, self.prompt_len, self.k, self.name, self.wrong = ar, prompt_len, k, name, wrong

    def propose(self, committed, rng) -> ProposalResult:
        g = len(committed) - self.prompt_len
        toks = self.ar[g : g + self.k]
        nodes = [ProposalNode(token_id=t, parent=i - 1, score=1.0, source=self.name) for i, t in enumerate(toks)]
        if self.wrong is not None and toks:
            nodes.append(ProposalNode(token_id=self.wrong, parent=len(toks) - 2, score=1.0, source=self.name))
        return ProposalResult(
            nodes=tuple(nodes),
            probability_semantics="score_only",
            sampling_relation="deterministic_lookup",
            topology="tree",
            state_handle=fixed_candidates({}).state_handle,
            manifest_hash="h",
            source=self.name,
        )


PROMPT = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41, 5, 17]


def greedy_decode(backend, proposer, new, budget=MERGED):
    return decode(
        target=backend,
        proposer=proposer,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=PROMPT,
        max_new_tokens=new,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=budget.max_nodes, max_depth=budget.max_depth),
    )


@pytest.fixture(scope="module")
def tiny():
    backend = CausalLMBackend(build_tiny_model(seed=3))
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    return backend, greedy_decode(backend, null, 40).tokens


def test_accepted_tokens_are_attributed_to_every_source_that_proposed_them(tiny):
    backend, ar = tiny
    # A proposes the next 3 AR tokens; B the next 2 and a wrong sibling of its second
    wrong = next(t for t in range(90) if t not in ar)
    merged = MergedProposer(
        budget=MERGED,
        manifest_hash="h",
        sources=[Oracle(ar, len(PROMPT), 3, name="A"), Oracle(ar, len(PROMPT), 2, name="B", wrong=wrong)],
    )
    res = greedy_decode(backend, merged, 16)
    assert res.tokens == ar[:16]
    # 4 rounds x (3 accepted + 1 bonus); rows t0, t0t1 are both sources', t0t1t2 only A's
    assert res.ledger.rounds == 4 and res.sources == {"A": 12, "B": 8}
    per = merged.stats.extras["per_source"]
    assert per["A"]["new_rows"] == 12 and per["B"]["shared"] == 8 and per["B"]["new_rows"] == 4


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_merged_rest_and_prompt_lookup_keep_greedy_equality(tiny, policy):
    backend, ar = tiny
    ds = datastore_from_token_ids([PROMPT[-4:] + ar[:12], [1, 2, 3, 4, 5, 6], PROMPT[-3:] + [9, 9, 9]])
    rest = RestProposer(
        budget=Budget(shape="tree", max_nodes=16, max_depth=8),
        manifest_hash="h",
        datastore=ds,
        max_suffix=8,
        min_suffix=1,
    )
    adaptive = {"budget_policy": "adaptive", "verify_cost": [1.0 + 0.02 * k for k in range(17)]}
    lookup = PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=16, max_depth=8),
        manifest_hash="h",
        **(adaptive if policy == "adaptive" else {}),
    )
    # listed first, an adaptive lookup still proposes after REST (pricing its rows after REST's)
    merged = MergedProposer(
        budget=MERGED, manifest_hash="h", sources=[lookup, rest] if lookup.prices_rows else [rest, lookup]
    )
    res = greedy_decode(backend, merged, 40)
    assert res.tokens == ar
    src = f"rest:{ds.release_id[:12]}"
    # REST holds the first 12 AR tokens (11 accepted + bonus at least); lookup copies the repeats
    assert res.sources[src] >= 11 and res.sources["prompt_lookup"] > 0 and set(res.sources) == {src, "prompt_lookup"}
    assert res.ledger.summary()["round_cost_ms"]["retrieval"] > 0  # REST's search, split out of proposal
    assert merged.stats.retrieval_ms == pytest.approx(rest.stats.retrieval_ms)
    assert merged.manifest_hash == "h"  # directly built sources share the run hash
    assert lookup.rows_before == frozenset()  # set for each proposal only


def test_a_merged_round_s_verify_time_reaches_its_sources(tiny):
    backend, ar = tiny
    lookup = PromptLookupProposer(
        budget=Budget(shape="sequences", max_nodes=16, max_depth=8),
        manifest_hash="h",
        budget_policy="adaptive",
        verify_cost=[1.0 + 0.02 * k for k in range(17)],
    )
    merged = MergedProposer(budget=MERGED, manifest_hash="h", sources=[lookup])
    res = greedy_decode(backend, merged, 40)
    assert res.tokens == ar
    assert lookup.cost_model.observed == res.ledger.rounds > 5  # every round's forward, priced by the lookup
    learned = merged.stats.extras["sources"]["prompt_lookup"]["adaptive_budget"]  # in the record, by source
    assert learned["verify_rounds_observed"] == res.ledger.rounds and learned["verify_cost_ms"] is not None


# ------------------------------------------------------------------------------ harness run


def test_merged_run_end_to_end_on_tiny(tmp_path, monkeypatch):
    from harness.runner import load_models, run_job
    from harness.workloads.conversations import encode_workload

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    wl = tmp_path / "wl.jsonl"
    wl.write_text(json.dumps({"id": "p", "prompt": "for i in range(10): total = total + i * i; print(total)"}) + "\n")
    base = ["model=tiny", "workload=jsonl", f"workload.path={wl}", "workload.chat=false"]
    cfg = compose_cfg(*base)
    target, _ = load_models(cfg)
    ((prompt, ids),) = encode_workload(cfg, None)
    null = NullProposer(budget=Budget(shape="sequence", max_nodes=1, max_depth=1), manifest_hash="h")
    ar = decode(
        target=CausalLMBackend(target.model),
        proposer=null,
        verifier=get_verifier("greedy"),
        policy=SamplingPolicy(),
        prompt_ids=ids,
        max_new_tokens=24,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(0),
        round_cfg=RoundConfig(max_nodes=1, max_depth=1),
    ).tokens
    ds = datastore_from_token_ids([ids[-5:] + ar])
    write_datastore(ds, tmp_path / "ds")
    cfg = compose_cfg(
        *base,
        "proposer=merged",
        "topology=merged",
        f"proposer.rest.datastore.path={tmp_path / 'ds'}",
        "generation.max_new_tokens=16",
        "generation.warmup_tokens=2",
        "gates.oracle=false",
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    m = record["metrics"]
    src = f"rest:{ds.release_id[:12]}"
    assert m["greedy_identical"] is True and m["accepted_by_source"][src] > 0
    assert set(m["accepted_by_source"]) <= {src, "prompt_lookup"}
    assert record["gates"]["negotiation"]["probability_semantics"] == ["frequency", "score_only"]
    assert record["gates"]["workload_governance"]["sources"]["rest"]["leaked"] == []
    r = m["retrieval"]
    assert r["sources"]["rest"]["datastore_release_id"] == ds.release_id and r["sources"]["rest"]["rounds"] > 0
    assert r["per_source"]["prompt_lookup"]["offered"] >= 0 and r["rounds"] == r["sources"]["rest"]["rounds"]
    assert m["round_cost_ms"]["retrieval"] > 0
    assert m["proposal_state_bytes"] == ds.nbytes


def test_a_draft_model_source_is_loaded_capped_in_depth_and_keeps_greedy_equality(tmp_path, monkeypatch):
    """``proposer.sources=[draft_model, rest, prompt_lookup]``: the runner loads the draft only
    because it is a source, the draft chain is capped at ``proposer.depths.draft_model``, and the
    three-source tree keeps greedy output identical to AR."""
    from harness.runner import draft_model_config, load_models, run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    wl = tmp_path / "wl.jsonl"
    wl.write_text(json.dumps({"id": "p", "prompt": "def add(a, b): return a + b; add(1, 2); add(3, 4)"}) + "\n")
    base = ["model=tiny", "workload=jsonl", f"workload.path={wl}", "workload.chat=false"]
    ds = datastore_from_token_ids([[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 11, 12]])
    write_datastore(ds, tmp_path / "ds")
    two = compose_cfg(*base, "proposer=merged", "topology=merged", f"proposer.rest.datastore.path={tmp_path / 'ds'}")
    assert draft_model_config(two) is None and load_models(two)[1] is None  # no draft unless it is a source
    three = [
        *base,
        "proposer=merged",
        "topology=merged",
        f"proposer.rest.datastore.path={tmp_path / 'ds'}",
        "proposer.sources=[draft_model,rest,prompt_lookup]",
        "proposer.depths.draft_model=3",
    ]
    cfg = compose_cfg(*three, "generation.max_new_tokens=16", "generation.warmup_tokens=2", "gates.oracle=false")
    assert draft_model_config(cfg).num_layers == cfg.proposer.draft_model.model.num_layers
    record = run_job(cfg, run_dir=tmp_path / "run")
    m = record["metrics"]
    assert m["greedy_identical"] is True
    per = m["retrieval"]["per_source"]
    rounds = m["retrieval"]["rounds"]
    assert rounds > 0 and 0 < per["draft_model"]["offered"] <= 3 * rounds  # a depth-3 chain per round
    assert per["draft_model"]["new_rows"] > 0
    assert set(m["accepted_by_source"]) <= {"draft_model", f"rest:{ds.release_id[:12]}", "prompt_lookup"}
    # at temperature 0 the draft's children are its top-ranked tokens (beam: scores, not a law)
    assert cfg.proposer.draft_model.sampling == "beam"
    assert record["gates"]["negotiation"]["probability_semantics"] == ["frequency", "score_only"]
    with pytest.raises(ValueError, match="proposer.depths names"):
        plan(compose_cfg(*three, "+proposer.depths.rest_x=2"))


def test_every_source_s_depth_cap_is_an_option():
    """proposer.depths.rest=3 was refused ("proposer.depths has no option 'rest'") though the docs say
    the option caps a source's depth; only a hidden `+` passed it. Each source's cap is an option
    (null: the round's max_depth), and a cap of a source left out is listed as inert."""
    from harness.runner import inert_options

    base = ["model=tiny", "proposer=merged", "topology=merged"]
    cfg = compose_cfg(*base, "proposer.depths.rest=3")
    assert dict(cfg.proposer.depths) == {"draft_model": 4, "rest": 3, "prompt_lookup": None}
    assert inert_options(cfg) == [] and plan(cfg).budget.max_depth >= 3
    left_out = compose_cfg(*base, "proposer.sources=[rest]", "proposer.depths.prompt_lookup=2")
    assert "proposer.depths.prompt_lookup=2: proposer.sources=[rest] leaves it out" in inert_options(left_out)
    with pytest.raises(Exception, match=r"proposer.depths\[rest\]=0 is out of range; each must be >= 1"):
        plan(compose_cfg(*base, "proposer.depths.rest=0"))


class Governed(Fixed):
    """A source whose workload-governance gate says ``status``."""

    def __init__(self, status: str, *, name: str) -> None:
        super().__init__({(): [5]}, name=name)
        self.status = status

    def check_workload(self, items, *, allow_leakage=False):
        return {"status": self.status}


@pytest.mark.parametrize(
    "statuses, merged",
    [
        (("not_applicable", "passed"), "passed"),
        (("not_applicable", "not_applicable"), "not_applicable"),
        (("passed", "skipped"), "skipped"),
        (("not_applicable", "skipped"), "skipped"),
    ],
)
def test_merged_governance_is_the_worst_of_what_its_sources_checked(statuses, merged):
    """A source with nothing to check (a published draft) is no pass: sources that all had nothing
    to check make the merged entry not applicable, not passed."""
    sources = [Governed(s, name=f"s{i}") for i, s in enumerate(statuses)]
    proposer = MergedProposer(budget=Budget("merged", 3, 4), manifest_hash="h", sources=sources)
    entry = proposer.check_workload([])
    assert entry["status"] == merged and set(entry["sources"]) == {"s0", "s1"}
