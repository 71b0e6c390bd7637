"""End-to-end exactness oracle: the real round on a tiny float64
Llama with a vocabulary of 5 reproduces the target's joint over the next tokens, with every
proposal and verifier draw enumerated, for every proposer (draft model, prompt lookup, REST, the
three head kinds, early exit, layer skip, merged sources, Sequoia-shaped trees) and on the float32
path the runs use; a proposer that records a q other than the law it sampled and a commit that
keeps the wrong rows are both caught; the gate's case selection prefers the run's own proposer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import round_of_one

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.gates import e2e as E
from harness.gates.oracle import MARGINAL_ATOL, OracleError, enumerate_marginal, exact_verifier_names, max_abs_error
from harness.proposers.registry import PROPOSERS
from harness.target.backend import CausalLMBackend
from harness.verifiers.base import VERIFIERS

#: cases slower than ~1 s on one core run in the slow suite only (all others run by default)
SLOW = {
    ("membership", "draft/iid/set2/T1"),
    ("membership", "draft/iid/exp21/T0.8-topk3-topp0.9"),
    ("membership", "draft/wor/set2/T1"),
    ("membership", "draft/wor/exp21/T0.8-topk3-topp0.9"),
    ("membership", "eagle/iid/seq1/T1/2-rounds"),
    ("membership", "merged/draft-wor+lookup/T1"),  # ~40 s: every draw of the draft's siblings and lookup's chains
}


BASE = {c.name for c in E.standard_cases()}


def is_slow(verifier_name: str, case: E.E2ECase) -> bool:
    """The listed pairs, and membership on any other sampled (iid / without-replacement) case at
    T > 0: membership walks every target draw below each of the many sampled trees (1-2 s of CPU
    each). Their p/q verifiers, whose exactness depends on the recorded q, run by default."""
    if (verifier_name, case.name) in SLOW:
        return True
    sampled = {"iid", "without_replacement"} & set(E.case_relations(case))
    return verifier_name == "membership" and case.name not in BASE and bool(sampled) and case.policy.temperature > 0


@pytest.fixture(scope="module")
def models():
    return E.E2EModels.build()


def _params():
    out = []
    for name in exact_verifier_names():
        verifier = VERIFIERS[name]()
        for case in E.e2e_cases():
            if E.applicable(case, verifier):
                marks = [pytest.mark.slow] if is_slow(name, case) else []
                out.append(pytest.param(name, case.name, marks=marks, id=f"{name}-{case.name}"))
    return out


CASES = {c.name: c for c in E.e2e_cases()}
#: sampled chains with a confidence stop: proposals enumerated if the chain never stopped (5 x 5)
UNSTOPPED_PROPOSALS = {"early_exit/iid/seq2/T1": 25, "layer_skip/iid/seq2/T1": 25}


@pytest.mark.parametrize("verifier_name,case_name", _params())
def test_real_round_reproduces_the_target_joint(models, verifier_name, case_name):
    case = CASES[case_name]
    row = E.check_e2e_case(VERIFIERS[verifier_name](), case, models)
    assert row["max_abs_error"] <= row["bound"] == E.E2E_ATOL[case.dtype], row
    assert row["passed"] and row["kind"] == "end_to_end" and row["proposer"] == case.proposer
    assert row["leaves"] >= 1 and row["proposals"] >= 1
    if case.proposer in E.HEAD_PROPOSERS:
        # h_{t-1} came from the target's own forwards in every round of every branch (forked heads
        # share the hook, which shows each branch the forwards a run would have made)
        assert row["empty_proposals"] == 0, row
    if case_name in UNSTOPPED_PROPOSALS:  # the confidence stop fell inside the enumeration
        assert 0 < row["proposals"] < UNSTOPPED_PROPOSALS[case_name], row
    if case.dtype == torch.float32:  # the float32 path really ran: its rounding shows, far below the bound
        assert 1e-12 < row["max_abs_error"] <= E.FLOAT32_ATOL and row["dtype"] == "float32", row
    else:
        assert row["max_abs_error"] <= MARGINAL_ATOL and row["dtype"] == "float64", row


def test_every_exact_verifier_has_fast_end_to_end_cases_of_its_kind():
    """Coverage follows declarations: each exact verifier gets a T=1 case without truncation, a
    truncated one (top-k + top-p on both sides) where it samples, and T=0 where it allows it."""
    assert {"greedy", "membership", "rejection", "specinfer", "sequoia"} <= set(exact_verifier_names())
    for name in exact_verifier_names():
        verifier = VERIFIERS[name]()
        fast = [c for c in E.e2e_cases() if E.applicable(c, verifier) and not is_slow(name, c)]
        temps = {c.policy.temperature for c in fast}
        if verifier.temperatures in ("positive", "any"):
            assert 1.0 in temps, name
            assert any(c.policy.top_k and c.policy.top_p < 1 for c in fast), name
        if verifier.temperatures in ("zero", "any"):
            assert 0.0 in temps, name
    pairs = {(n, c.name) for n in exact_verifier_names() for c in E.e2e_cases() if E.applicable(c, VERIFIERS[n]())}
    # the named pairings of the issue: rejection on a sequence, SpecInfer on an expansion, Sequoia
    # with without-replacement sampling, membership with prompt lookup, greedy at T=0
    assert {
        ("rejection", "draft/iid/seq2/T1"),
        ("specinfer", "draft/iid/exp21/T0.8-topk3-topp0.9"),
        ("sequoia", "draft/wor/set2/T1"),
        ("membership", "lookup/sequences/T1"),
        ("greedy", "draft/iid/exp21/T0"),
        # EAGLE: the dynamic tree (its shape follows the draft's confidences) deterministic under greedy
        # and membership, sampled under Sequoia and SpecInfer; a sampled chain under rejection
        ("greedy", "eagle/beam/dynamic/T0/2-rounds"),
        ("membership", "eagle/beam/dynamic/T1"),
        ("sequoia", "eagle/wor/dynamic/T0.8-topk3-topp0.9"),
        ("specinfer", "eagle/iid/dynamic/T0.8-topk3-topp0.9"),
        ("rejection", "eagle/iid/seq1/T1/2-rounds"),
    } <= pairs


def test_target_joint_from_the_cache_equals_direct_forwards(models):
    policy = E.Float64Policy(temperature=1.0)
    direct = E.direct_target_joint(models.target.model, E.E2E_PROMPT, policy, 3)
    assert len(direct) == 5**3 and abs(sum(direct.values()) - 1.0) < 1e-12
    seq = models.target.prefill_one(list(E.E2E_PROMPT))
    cached = E.continuation_law(models.target, seq, list(E.E2E_PROMPT), policy, 3)
    assert max_abs_error(direct, cached) < 1e-12
    # the laws are peaked and prefix-dependent (a wrong q or commit would be visible)
    first = {t: sum(p for k, p in direct.items() if k[0] == t) for t in range(5)}
    assert max(first.values()) > 0.3 and min(first.values()) < 0.15


def test_greedy_target_joint_is_one_hot(models):
    joint = E.direct_target_joint(models.target.model, E.E2E_PROMPT, E.Float64Policy(temperature=0.0), 3)
    assert list(joint.values()) == [1.0]


def test_a_q_other_than_the_law_sampled_is_caught(models):
    """Negative control: the draft samples from q but records q**2 (normalised), i.e. a
    temperature of 0.5 applied to the recorded q only. Every contract check passes; the
    end-to-end law misses the target by orders of magnitude more than the bound."""
    from harness.random_source import TorchRandomSource

    case = CASES["draft/iid/set2/T1"]
    bad = E.misrecorded_q_proposer(budget=case.budget, policy=E.Float64Policy(temperature=1.0), backend=models.draft)
    bad.start(list(E.E2E_PROMPT))
    proposal = bad.propose(list(E.E2E_PROMPT), TorchRandomSource(0))  # a valid ProposalResult
    assert proposal.q_dists is not None and proposal.probability_semantics == "normalized_conditional"
    rows = E.negative_control_rows(models)
    assert [(r["verifier"], r["case"]) for r in rows] == [
        (v, f"e2e-negative/misrecorded-q/{c}") for v, c in E.NEGATIVE_CONTROL_CASES
    ]
    assert all(r["negative_control"] and not r["passed"] and r["max_abs_error"] > 1e-3 for r in rows), rows
    # one per kind of q-recording proposer: draft model (chain, set, Sequoia shape), a dependent and
    # an independent head bank, early exit, and the float32 path (the bias dwarfs FLOAT32_ATOL)
    assert {r["proposer"] for r in rows} >= {"draft_model", "hydra", "medusa", "early_exit"}
    assert any(r["dtype"] == "float32" and r["max_abs_error"] > 100 * E.FLOAT32_ATOL for r in rows)
    assert all(E.case_relations(CASES[c]) != ("beam",) for _, c in E.NEGATIVE_CONTROL_CASES)


class _ContiguousCommitBackend(CausalLMBackend):
    """BUG on purpose: keeps the first len(accepted) candidate rows, not the accepted ones."""

    def commit(self, state, accepted_rows):
        super().commit(state, [list(range(len(a))) for a in accepted_rows])


def test_a_commit_that_keeps_the_wrong_rows_is_caught(models):
    bad = E.E2EModels(target=_ContiguousCommitBackend(models.target.model), draft=models.draft)
    row = E.check_e2e_case(VERIFIERS["specinfer"](), CASES["draft/iid/set2/T1"], bad)
    assert not row["passed"] and row["max_abs_error"] > 1e-3, row


def test_leaf_cap_is_asserted(models):
    case = CASES["draft/iid/seq2/T1"]
    with pytest.raises(OracleError, match="max_leaves"):
        E.check_e2e_case(VERIFIERS["rejection"](), case, models, max_leaves=20)


def test_fork_copies_request_state_and_shares_the_model(models):
    case = CASES["draft/iid/seq2/T1"]
    proposer = E.make_proposer(case, draft=models.draft, policy=E.Float64Policy(temperature=1.0))
    proposer.start(list(E.E2E_PROMPT))
    twin = E.fork(proposer)
    assert twin.backend is proposer.backend and twin.backend.model is proposer.backend.model
    assert twin.seq is not proposer.seq and twin.seq.cached_tokens == proposer.seq.cached_tokens
    twin.seq.cached_tokens.append(0)
    assert twin.seq.cached_tokens != proposer.seq.cached_tokens


def test_production_decode_loop_is_exact_under_enumeration(models):
    """``harness.engine.decode.decode`` itself, every draw of every round enumerated (each leaf
    re-runs the whole request): rejection over a one-token draft chain, two emitted tokens, so a
    request whose first draft is rejected runs a second round on the committed cache."""
    policy = E.Float64Policy(temperature=0.8, top_k=3, top_p=0.9)
    budget = Budget(shape="sequence", max_nodes=1, max_depth=1)
    base = E.make_proposer(E.E2ECase("chain1", "draft_model", budget, policy), draft=models.draft, policy=policy)
    verifier = VERIFIERS["rejection"]()
    rounds_seen = set()

    def request(rng):
        res = decode(
            target=models.target,
            proposer=E.fork(base),
            verifier=verifier,
            policy=policy,
            prompt_ids=list(E.E2E_PROMPT),
            max_new_tokens=2,
            eos_token_ids=frozenset(),
            rng=rng,
            round_cfg=RoundConfig(max_nodes=1, max_depth=1),
        )
        rounds_seen.add(res.ledger.rounds)
        return tuple(res.tokens)

    law = enumerate_marginal(request)
    assert rounds_seen == {1, 2}
    assert max_abs_error(law, E.direct_target_joint(models.target.model, E.E2E_PROMPT, policy, 2)) <= MARGINAL_ATOL


@pytest.mark.slow
def test_several_real_rounds_are_exact(models):
    """No target-side completion at all: real rounds until three tokens are emitted."""
    case = CASES["draft/iid/seq2/T0.8-topk3-topp0.9"]
    multi = E.E2ECase(case.name + "/all-rounds", case.proposer, case.budget, case.policy, case.sampling, rounds=None)
    row = E.check_e2e_case(VERIFIERS["specinfer"](), multi, models)
    assert row["passed"], row


def test_speculative_round_is_the_composition_decode_runs(models):
    """One round through the library function equals one round of decode() on the same seed."""
    from harness.random_source import TorchRandomSource

    policy = E.Float64Policy(temperature=1.0)
    case = CASES["draft/iid/exp21/T0.8-topk3-topp0.9"]
    verifier = VERIFIERS["specinfer"]()
    rounds = []
    decode(
        target=models.target,
        proposer=E.make_proposer(case, draft=models.draft, policy=policy),
        verifier=verifier,
        policy=policy,
        prompt_ids=list(E.E2E_PROMPT),
        max_new_tokens=8,
        eos_token_ids=frozenset(),
        rng=TorchRandomSource(3),
        round_cfg=RoundConfig(max_nodes=4, max_depth=2),
        on_round=lambda **kw: rounds.append(round_of_one(kw)),
    )
    proposer = E.make_proposer(case, draft=models.draft, policy=policy)
    proposer.start(list(E.E2E_PROMPT))
    seq = models.target.prefill_one(list(E.E2E_PROMPT))
    tree, sel, emitted = E.speculative_round(
        target=models.target,
        seq=seq,
        proposer=proposer,
        verifier=verifier,
        policy=policy,
        committed=list(E.E2E_PROMPT),
        rng=TorchRandomSource(3),
        max_nodes=4,
        max_depth=2,
    )
    assert torch.equal(tree.token_ids, rounds[0]["tree"].token_ids)
    assert sel == rounds[0]["selection"] and list(emitted) == rounds[0]["emitted"]
    assert seq.cached_tokens == rounds[0]["state"].cached_tokens[: len(seq.cached_tokens)]


def test_oracles_cli_without_quick_runs_the_end_to_end_cases(tmp_path, capsys, monkeypatch):
    from harness.gates import oracle_cli
    from harness.gates.oracle_cli import main

    # the synthetic suite has its own tests (test_oracle.py); keep this one to the e2e part, on a
    # few of the cases (each of them has its own test above)
    monkeypatch.setattr(oracle_cli, "run_suite", lambda *a, **k: [])
    few = ("draft/iid/seq2/T1", "early_exit/iid/seq2/T0.8-topk3-topp0.9", "draft/iid/seq2/T1/float32")
    monkeypatch.setattr(E, "e2e_cases", lambda: [CASES[n] for n in few])
    # the specinfer pair is left out by --verifier rejection (its case does not even exist)
    monkeypatch.setattr(E, "NEGATIVE_CONTROL_CASES", (("rejection", "draft/iid/seq2/T1"), ("specinfer", "x/y")))
    out = tmp_path / "oracles.json"
    assert main(["--verifier", "rejection", "--random", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(f"e2e/{n}" in text for n in few)
    assert "end-to-end negative control (recorded q is not the law sampled): caught (1 cases" in text
    data = json.loads(out.read_text())
    e2e_rows = [r for r in data["rows"] if r["kind"] == "end_to_end" and not r["negative_control"]]
    assert [r["case"] for r in e2e_rows] == [f"e2e/{n}" for n in few]
    assert [r["dtype"] for r in e2e_rows] == ["float64", "float64", "float32"]
    assert all(r["max_abs_error"] <= r["bound"] for r in e2e_rows)
    assert data["summary"]["e2e_negative_control"]["caught"] is True
    assert data["summary"]["end_to_end_cases"] == 3


def test_oracles_cli_lists_every_standard_case_of_a_verifier(monkeypatch):
    """``harness oracles`` runs run_e2e_suite over e2e_cases(): every case a verifier negotiates is
    among its rows (checked without running them)."""
    from harness.gates import oracle_cli

    ran = []
    monkeypatch.setattr(E, "check_e2e_case", lambda v, c, m, **k: ran.append((v.name, c.name)) or {"case": c.name})
    oracle_cli.run_e2e(["sequoia", "membership"], negative_control=False)
    names = {c for _, c in ran}
    assert ("sequoia", "draft/wor/sequoia3/T0.8-topk3-topp0.9") in ran
    assert {"rest/tree4/T1", "merged/rest+lookup/T1", "clover/beam/exp21/T1", "layer_skip/iid/seq2/T1"} <= names
    assert ("sequoia", "medusa/wor/exp21/T0.8-topk3-topp0.9") in ran and ("sequoia", "rest/tree4/T1") not in ran


def test_oracles_cli_quick_skips_the_end_to_end_cases(capsys):
    from harness.gates.oracle_cli import main

    assert main(["--verifier", "rejection", "--quick", "--random", "0"]) == 0
    assert "e2e/" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- coverage


def test_every_registered_proposer_has_end_to_end_cases():
    covered = {c.proposer for c in E.e2e_cases()}
    assert set(PROPOSERS) <= covered, sorted(set(PROPOSERS) - covered)
    names = [c.name for c in E.e2e_cases()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_every_head_kind_has_every_relation_at_zero_and_positive_temperature(kind):
    cases = [c for c in E.e2e_cases() if c.proposer == kind]
    have = {(E.case_relations(c), c.policy.temperature == 0.0) for c in cases}
    for relation in ("beam", "iid", "without_replacement"):
        assert {((relation,), True), ((relation,), False)} <= have, (kind, relation)
    for c in cases:  # beam is score-only; sampled heads record the law they drew from
        semantics = E.case_capabilities(c).probability_semantics
        assert semantics == {"score_only" if c.sampling == "beam" else "normalized_conditional"}
    pairs = {(n, c.name) for n in exact_verifier_names() for c in cases if E.applicable(c, VERIFIERS[n]())}
    assert {
        ("rejection", f"{kind}/iid/seq2/T1"),
        ("specinfer", f"{kind}/iid/seq2/T1"),
        ("sequoia", f"{kind}/wor/exp21/T0.8-topk3-topp0.9"),
        ("membership", f"{kind}/beam/exp21/T1"),
        ("greedy", f"{kind}/beam/exp21/T0"),
    } <= pairs
    assert ("specinfer", f"{kind}/beam/exp21/T1") not in pairs  # a score is not a q


def test_self_speculation_has_sampled_chains_at_positive_temperature():
    for name in ("early_exit", "layer_skip"):
        sampled = [c for c in E.e2e_cases() if c.proposer == name and c.sampling == "iid"]
        assert sampled and all(c.policy.temperature > 0 for c in sampled)
        for verifier in ("rejection", "specinfer"):
            fast = [c for c in sampled if E.applicable(c, VERIFIERS[verifier]()) and not is_slow(verifier, c)]
            assert fast, (name, verifier)
    assert any(c.proposer == "layer_skip" and c.rounds == 2 for c in E.e2e_cases())  # gamma adapts


def test_rest_is_verified_by_membership_at_positive_temperature_and_greedy_at_zero():
    """Frequency semantics: a trie count is never q, so only greedy and membership negotiate."""
    rest = [c for c in E.e2e_cases() if c.proposer == "rest"]
    assert rest and all(E.case_capabilities(c).probability_semantics == {"frequency"} for c in rest)
    for c in rest:
        ok = {n for n in exact_verifier_names() if E.applicable(c, VERIFIERS[n]())}
        assert ok == ({"greedy", "membership"} if c.policy.temperature == 0 else {"membership"}), (c.name, ok)
    merged = CASES["merged/rest+lookup/T1"]
    assert E.case_relations(merged) == ("deterministic_lookup",) and E.merged_sources(merged) == (
        "rest",
        "prompt_lookup",
    )


def test_rest_case_proposes_the_frequency_trie_from_its_datastore(models):
    from harness.random_source import TorchRandomSource

    case = CASES["rest/tree4/T1"]
    proposer = E.make_proposer(case, policy=E.case_policy(case), target=models.target, draft=models.draft)
    proposer.start(list(E.E2E_PROMPT))
    result = proposer.propose(list(E.E2E_PROMPT), TorchRandomSource(0))
    # suffix (3, 1, 2) continues with (4, 0), (4, 1), (2, 0): counts 4:2, 2:1, 4-0:1, 4-1:1 kept
    assert [(n.token_id, n.parent, n.score) for n in result.nodes] == [
        (4, -1, 2.0),
        (2, -1, 1.0),
        (0, 0, 1.0),
        (1, 0, 1.0),
    ]
    assert result.probability_semantics == "frequency" and result.extras["match_len"] == 3


def test_sequoia_shaped_tree_case_samples_its_parent_array(models):
    from harness.random_source import TorchRandomSource

    case = CASES["draft/wor/sequoia3/T0.8-topk3-topp0.9"]
    assert case.budget.shape == "tree" and case.budget.parents == (-1, -1, 0)
    assert E.applicable(case, VERIFIERS["sequoia"]()) and not E.applicable(case, VERIFIERS["specinfer"]())
    proposer = E.make_proposer(case, draft=models.draft, policy=E.case_policy(case))
    assert proposer.shape_parents == (-1, -1, 0)
    proposer.start(list(E.E2E_PROMPT))
    result = proposer.propose(list(E.E2E_PROMPT), TorchRandomSource(1))
    assert [n.parent for n in result.nodes] == [-1, -1, 0] and result.sampling_relation == "without_replacement"
    assert result.nodes[0].token_id != result.nodes[1].token_id  # siblings drawn without replacement


def test_a_committed_id_past_the_short_draft_s_embedding_is_read_as_the_stand_in_once_noted(
    models, capsys, monkeypatch
):
    from harness.proposers import draft_model
    from harness.random_source import TorchRandomSource

    case = CASES["draft-short/wor/exp31/T1-topk2"]
    short = models.draft_for(case)
    limit = short.vocab_size
    assert limit < models.target.vocab_size
    draft_model._STAND_IN_NOTED.discard(short.model)
    proposer = E.make_proposer(case, draft=short, policy=E.case_policy(case), target_vocab=models.target.vocab_size)
    prompt = list(case.prompt)
    proposer.start(prompt)
    first = [*prompt, limit]  # the target committed an id the draft has no embedding row for
    proposer.propose(first, TorchRandomSource(0))
    seq = proposer.seq
    assert seq.cached_tokens[: len(first)] == [*prompt, proposer.stand_in]
    fed = []
    forward_rows = short.forward_rows

    def recording(state, ids, positions, mask):
        fed.append((list(ids), list(positions)))
        return forward_rows(state, ids, positions, mask)

    monkeypatch.setattr(short, "forward_rows", recording)
    result = proposer.propose([*first, 1, limit + 1], TorchRandomSource(1))
    # the next round kept the rows it had read (the stand-in compared equal) and fed only what was new
    assert fed[0] == ([1, proposer.stand_in], [len(first), len(first) + 1]) and result.nodes
    assert seq.cached_tokens[: len(first) + 2] == [*prompt, proposer.stand_in, 1, proposer.stand_in]
    assert all(n.token_id < proposer.vocab_range for n in result.nodes)
    err = capsys.readouterr().err
    assert err.count("harness: note: the target committed id") == 1 and f"as id {proposer.stand_in}" in err


def test_float32_cases_run_the_round_in_float32_against_a_float64_reference(models):
    cases = [c for c in E.e2e_cases() if c.dtype == torch.float32]
    assert {c.proposer for c in cases} >= {"draft_model"}
    cast = models.at_dtype(torch.float32)
    assert cast is models.at_dtype(torch.float32)  # built once
    assert cast.target.dtype == torch.float32 and cast.draft.dtype == torch.float32
    ref = dict(cast.reference.named_parameters())
    for name, p in cast.target.model.named_parameters():  # the reference holds exactly the cast weights
        assert ref[name].dtype == torch.float64 and torch.equal(ref[name], p.double())
    policy = E.case_policy(cases[0])
    assert not isinstance(policy, E.Float64Policy)
    assert policy.probs(torch.zeros(2, 5, dtype=torch.float32)).dtype == torch.float32  # what decode asks


# ---------------------------------------------------------------------------------------------- forks and hooks


def test_fork_shares_weights_hooks_and_indexes_and_copies_request_state(models):
    def built(name):
        case = CASES[name]
        p = E.make_proposer(case, draft=models.draft, policy=E.case_policy(case), target=models.target)
        models.target.prefill_one(list(E.E2E_PROMPT))
        p.start(list(E.E2E_PROMPT))
        return p, E.fork(p)

    heads, twin = built("hydra/iid/seq2/T1")
    assert twin.tap is heads.tap and twin.heads is heads.heads and twin.model is heads.model
    assert twin.lm_head is heads.lm_head and twin.store is not heads.store
    assert E.hidden_taps(twin) == [heads.tap]
    early, twin = built("early_exit/iid/seq2/T1")
    assert twin.adapter is early.adapter and twin.path.base is early.path.base  # a submodule, shared
    assert twin.kv is not early.kv and len(twin.kv) == len(early.kv) > 0
    twin.kv.keep(range(1))
    assert len(twin.kv) != len(early.kv)
    rest, twin = built("rest/tree4/T1")
    assert twin.datastore is rest.datastore and twin.stats is not rest.stats
    merged, twin = built("merged/rest+lookup/T1")
    assert twin.sources[0].datastore is merged.sources[0].datastore and twin.sources is not merged.sources


def test_heads_read_each_branch_hidden_rows_only_through_the_restored_hook(models, monkeypatch):
    """Without restoring the hook before each forked propose, a branch's heads would read the
    forward of the branch enumerated before it: the enumeration breaks."""
    case = CASES["hydra/iid/seq2/T1"]
    monkeypatch.setattr(E, "restore_taps", lambda state: None)
    with pytest.raises(OracleError):
        E.check_e2e_case(VERIFIERS["specinfer"](), case, models)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "clover"])
def test_heads_propose_in_every_real_round_from_the_verify_forwards(models, kind):
    """T = 0, every round real: rounds after the first read h_{t-1} from the branch's own verify
    forward (through forked proposers and deep-copied caches) and never miss it."""
    row = E.check_e2e_case(VERIFIERS["greedy"](), CASES[f"{kind}/beam/exp21/T0"], models)
    assert row["passed"] and row["proposals"] >= 2 and row["empty_proposals"] == 0, row


# ---------------------------------------------------------------------------------------------- gate selection


def _names(cases):
    return [c.name for c in cases]


def test_gate_cases_prefer_the_runs_own_proposer_and_shape():
    wor = E.gate_cases("draft_model", {"without_replacement"}, "sequoia", greedy=False)
    # the draft family: a draft of the target's vocabulary, one whose LM head is padded past it and one
    # whose vocabulary ends before it
    family = (["draft", "wor"], ["draft-padded", "wor"], ["draft-short", "wor"])
    assert wor and all(n.split("/")[:2] in family for n in _names(wor))
    assert "draft-short/wor/exp31/T1-topk2" in _names(wor)
    assert _names(E.gate_cases("draft_model", ["without_replacement"], "sequoia", greedy=False, shape="tree")) == [
        "draft/wor/sequoia3/T0.8-topk3-topp0.9"
    ]
    assert _names(E.gate_cases("draft_model", ["without_replacement"], "sequoia", greedy=False, shape="set")) == [
        "draft/wor/set2/T1",
        "draft-padded/wor/set2/T0.8-topk3-topp0.9",
    ]
    # a shape with no case of its own falls back to the proposer's cases of its relation
    assert _names(E.gate_cases("medusa", ["iid"], "specinfer", greedy=False, shape="cartesian")) == [
        "medusa/iid/seq2/T1"
    ]
    assert _names(E.gate_cases("hydra", ["beam"], VERIFIERS["greedy"](), greedy=True)) == ["hydra/beam/exp21/T0"]
    assert _names(E.gate_cases("rest", ["deterministic_lookup"], "membership", greedy=False)) == [
        "rest/tree4/T1",
        "rest/tree4/T0.8-topk3-topp0.9",
        "rest/sequence2/T1",
    ]
    assert _names(E.gate_cases("early_exit", ["iid"], "rejection", greedy=False)) == [
        "early_exit/iid/seq2/T1",
        "early_exit/iid/seq2/T0.8-topk3-topp0.9",
    ]


def test_the_gate_says_which_tier_of_cases_covered_the_run():
    """The tier of :func:`gate_cases` that gave the cases is named with them: the run's own
    configuration (1), its proposer and relations in another shape (2), some of its relations (3),
    another proposer's cases of its relations (4); a run no case covers has none."""
    tier = E.gate_tier
    assert tier("draft_model", ["without_replacement"], "sequoia", greedy=False, shape="tree")[0] == 1
    assert tier("medusa", ["iid"], "specinfer", greedy=False, shape="cartesian")[0] == 2
    assert tier("merged", {"beam", "deterministic_lookup"}, "greedy", greedy=True)[0] == 3
    four, cases = tier("a_new_proposer", {"iid"}, "specinfer", greedy=False)
    assert four == 4 and _names(cases) == _names(E.gate_cases("a_new_proposer", {"iid"}, "specinfer", greedy=False))
    assert tier("draft_model", {"iid"}, "typical", greedy=False) == (None, [])
    assert set(E.GATE_TIERS) == {1, 2, 3, 4}


def test_the_end_to_end_gate_entry_records_its_coverage():
    from harness.gates.stages import e2e_gate

    own = e2e_gate("greedy", "hydra", ["beam"], greedy=True, shape="expansion")
    assert own["status"] == "passed" and own["cases"] == ["e2e/hydra/beam/exp21/T0"]
    assert own["coverage"] == {"tier": 1, "covers": E.GATE_TIERS[1], "run_shape": "expansion"}
    other = e2e_gate("greedy", "hydra", ["beam"], greedy=True, shape="cartesian")
    assert other["coverage"]["tier"] == 2 and other["coverage"]["run_shape"] == "cartesian"
    assert "another topology shape" in other["coverage"]["covers"]
    assert "coverage" not in e2e_gate("typical", "draft_model", ["iid"], greedy=False)  # not applicable


def test_gate_cases_for_merged_match_its_sources_relations():
    assert _names(E.gate_cases("merged", {"deterministic_lookup"}, "membership", greedy=False)) == [
        "merged/rest+lookup/T1"
    ]
    assert _names(E.gate_cases("merged", {"iid", "deterministic_lookup"}, "membership", greedy=False)) == [
        "merged/draft+lookup/T1"
    ]
    # other sources (draft + REST + lookup declare the same relations as draft + lookup); sources of
    # relations no merged case has fall back to the merged cases sharing one of them
    assert _names(E.gate_cases("merged", {"beam", "deterministic_lookup"}, "greedy", greedy=True)) == [
        "merged/draft+lookup/T0",
        "merged/rest+lookup/T0",
    ]


def test_gate_cases_fall_back_to_the_relation_and_refuse_what_cannot_apply():
    fallback = E.gate_cases("a_new_proposer", {"iid"}, "specinfer", greedy=False)
    assert fallback and all("iid" in E.case_relations(c) and c.policy.temperature > 0 for c in fallback)
    assert {c.proposer for c in fallback} >= {"draft_model", "medusa", "early_exit"}
    assert E.gate_cases("draft_model", {"iid"}, "typical", greedy=False) == []  # heuristic: no oracle
    assert E.gate_cases("rest", {"deterministic_lookup"}, "specinfer", greedy=False) == []  # frequency is no q
    with pytest.raises(ValueError, match="unknown verifier"):
        E.gate_cases("draft_model", {"iid"}, "no_such_verifier", greedy=False)


def test_gate_case_selection_does_not_depend_on_the_hash_seed():
    """The same cases whatever the order relations come in, and in a process with another hash
    seed (set iteration order changes with it)."""
    queries = [
        ("merged", ("iid", "deterministic_lookup", "beam"), "membership", False),
        ("a_new_proposer", ("iid", "without_replacement"), "membership", False),
        ("hydra", ("beam",), "greedy", True),
    ]
    here = []
    for proposer, rels, verifier, greedy in queries:
        got = {tuple(_names(E.gate_cases(proposer, order, verifier, greedy=greedy))) for order in (rels, rels[::-1])}
        got.add(tuple(_names(E.gate_cases(proposer, frozenset(rels), verifier, greedy=greedy))))
        assert len(got) == 1, got
        here.append(list(got.pop()))
    code = (
        "import json; from harness.gates.e2e import gate_cases\n"
        f"queries = {queries!r}\n"
        "print(json.dumps([[c.name for c in gate_cases(p, frozenset(r), v, greedy=g)] for p, r, v, g in queries]))\n"
    )
    root = Path(__file__).resolve().parents[1]
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # another seed than ours
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == here
    assert here[0] and here[1] and here[2] == ["hydra/beam/exp21/T0"]


def _capped_params():
    """Per proposer, its first sampled case drafting two or more deep, with the first exact verifier
    that negotiates it."""
    out, seen = [], set()
    for case in E.e2e_cases():
        if case.proposer in seen or case.policy.temperature <= 0 or case.budget.max_depth < 2:
            continue
        name = next((n for n in exact_verifier_names() if E.applicable(case, VERIFIERS[n]())), None)
        if name is not None:
            seen.add(case.proposer)
            out.append(pytest.param(name, case.name, id=f"{name}-{case.name}"))
    return out


@pytest.mark.parametrize("verifier_name,case_name", _capped_params())
def test_a_request_s_last_rounds_draft_under_the_depth_cap_and_stay_exact(
    models, monkeypatch, verifier_name, case_name
):
    """With two tokens to go a round may commit one drafted token and its bonus token: the proposer
    drafts under a depth cap of 1, as the measured loop's last rounds do, and the output law is still
    the target's."""
    caps = []
    propose_round = E.propose_round

    def recording(proposer, committed, rng, **kw):
        caps.append((kw["max_depth"], kw.get("tokens_left")))
        return propose_round(proposer, committed, rng, **kw)

    monkeypatch.setattr(E, "propose_round", recording)
    case = replace(CASES[case_name], length=2, rounds=None)
    row = E.check_e2e_case(VERIFIERS[verifier_name](), case, models)
    assert row["passed"] and row["max_abs_error"] <= row["bound"], row
    assert (case.budget.max_depth, 2) in caps and all(left <= 2 for _, left in caps), caps


def test_eagle_rounds_after_the_first_draft_from_the_verify_forwards_features(models):
    """The two-round EAGLE cases really draft in round 2: every branch's proposer received its verify
    forward through the shared tap, admitted the committed features and fed them to its cache."""
    from harness.proposers.eagle import EagleProposer

    seen = []
    orig = EagleProposer.propose

    def spy(self, committed, rng):
        out = orig(self, committed, rng)
        if self.depth_cap != 0:  # a request's last round, one token left, drafts nothing by design
            seen.append((len(committed), len(out.nodes), self.stats.extras["hidden_misses"], self.cache.length))
        return out

    EagleProposer.propose = spy
    try:
        for verifier, case in (
            ("rejection", "eagle/iid/seq1/T1/2-rounds"),
            ("greedy", "eagle/beam/dynamic/T0/2-rounds"),
        ):
            assert E.check_e2e_case(VERIFIERS[verifier](), CASES[case], models)["passed"]
    finally:
        EagleProposer.propose = orig
    prompt = len(E.E2E_PROMPT)
    later = [s for s in seen if s[0] > prompt]
    assert later and all(nodes >= 1 and misses == 0 and cache == n - 1 for n, nodes, misses, cache in later)


@pytest.mark.parametrize(
    "verifier,case",
    [("sequoia", "eagle/wor/dynamic/T0.8-topk3-topp0.9"), ("specinfer", "eagle/iid/dynamic/T0.8-topk3-topp0.9")],
)
def test_a_sampled_dynamic_tree_pruned_by_its_own_confidences_is_caught(models, verifier, case):
    """Negative control: EAGLE-2's rerank applied to a SAMPLED tree keeps a draw only if its own
    value scores well, so the kept draws no longer follow the laws they record. Every contract check
    passes; the end-to-end law misses the target far beyond the bound. (The proposer's sampled
    dynamic tree therefore expands by confidence but never prunes.)"""
    row = E.check_e2e_case(
        VERIFIERS[verifier](),
        CASES[case],
        models,
        proposer_factory=lambda c, d, p: E.pruned_sampled_dynamic_proposer(c, policy=p, target=models.target),
    )
    assert not row["passed"] and row["max_abs_error"] > 1e-3, row


def test_a_truncating_run_enumerates_a_truncating_case():
    """A run that cuts its law to top-k / top-p is enumerated through a case that does too: its own
    tier's where one truncates, else the nearest one added from the later tiers, named with its tier;
    an untruncated run's cases are unchanged, and the entry says where no case truncates."""
    from harness.gates.stages import e2e_gate

    # medusa's i.i.d. cases sample the whole law: the nearest truncating i.i.d. case is added (tier 4)
    tier, extra = E.truncating_case("medusa", ["iid"], "specinfer", shape="cartesian")
    assert tier == 4 and extra.policy.truncated and "iid" in E.case_relations(extra)
    assert not any(c.policy.truncated for c in E.gate_cases("medusa", ["iid"], "specinfer", greedy=False))
    # the run's own tier already truncates: its case is named, nothing added
    assert E.truncating_case("rest", ["deterministic_lookup"], "membership", shape="tree")[0] == 1
    assert E.truncating_case("draft_model", ["iid"], "typical") == (None, None)

    plain = e2e_gate("specinfer", "medusa", ["iid"], greedy=False, shape="cartesian")
    assert plain["cases"] == ["e2e/medusa/iid/seq2/T1"] and "truncation" not in plain["coverage"]
    cut = e2e_gate("specinfer", "medusa", ["iid"], greedy=False, shape="cartesian", truncated=True)
    assert cut["status"] == "passed"
    assert cut["cases"] == ["e2e/medusa/iid/seq2/T1", f"e2e/{extra.name}"]
    assert cut["coverage"]["truncation"] == {"case": f"e2e/{extra.name}", "tier": 4, "covers": E.GATE_TIERS[4]}
    own = e2e_gate("rejection", "early_exit", ["iid"], greedy=False, truncated=True)
    assert own["coverage"]["truncation"]["case"] == "e2e/early_exit/iid/seq2/T0.8-topk3-topp0.9"
    assert own["cases"] == ["e2e/early_exit/iid/seq2/T1", "e2e/early_exit/iid/seq2/T0.8-topk3-topp0.9"]


def test_a_truncated_policy_is_one_that_samples_a_cut_law():
    from harness.verifiers.sampling import SamplingPolicy

    assert SamplingPolicy(temperature=0.8, top_p=0.9).truncated and SamplingPolicy(temperature=1.0, top_k=3).truncated
    assert not SamplingPolicy(temperature=1.0).truncated
    assert not SamplingPolicy(temperature=0.0, top_k=3, top_p=0.5).truncated  # greedy: the argmax whatever


def test_cases_deepen_in_their_own_shape():
    """:func:`E.deepen` lengthens a chain, extends an expansion's widths, hangs a chain below an
    explicit tree's deepest node, gives a head bank a head per depth and REST continuations that long;
    the enumeration reaches the token after the deepest node."""
    assert E.deep_budget(E.SEQ2, 3) == Budget(shape="sequence", max_nodes=3, max_depth=3)
    assert E.deep_budget(E.EXP21, 3) == Budget(shape="expansion", max_nodes=6, max_depth=3, widths=(2, 1, 1))
    assert E.deep_budget(E.SEQUOIA3, 3).parents == (-1, -1, 0, 2)
    assert E.deep_budget(Budget(shape="set", max_nodes=2, max_depth=1, widths=(2,)), 3) is None
    assert [E.budget_depth(b) for b in (E.SEQ2, E.EXP21, E.SEQUOIA3)] == [2, 2, 2]
    assert E.budget_depth(Budget(shape="sequence", max_nodes=2, max_depth=5)) == 2  # a node d deep needs d nodes
    hydra = E.deepen(CASES["hydra/iid/seq2/T1"], 3)
    assert hydra.options["num_heads"] == 3 and hydra.length == 4 and E.budget_depth(hydra.budget) == 3
    rest = E.deepen(CASES["rest/tree4/T1"], 3)
    assert rest.options["release"]["continuation_len"] == 3
    merged = E.deepen(CASES["merged/rest+lookup/T1"], 3)
    assert merged.options["rest"]["release"]["continuation_len"] == 3
    assert E.deepen(CASES["eagle/iid/seq1/T1/2-rounds"], 3).rounds == 1  # one sampled round, 125 draws
    # every case deepens but a set, one level deep by definition
    assert all(E.deepen(c, 3) is not None for c in E.e2e_cases() if c.budget.shape != "set")


def _deep_misrecorded_draft(min_depth: int = 3):
    """WRONG (test-only): a draft proposer that records q with an extra temperature at nodes
    ``min_depth`` deep or deeper only: every case at most two deep passes."""

    class DeepMisrecorded(E.DraftModelProposer):
        def propose(self, committed, rng):
            result = super().propose(committed, rng)
            if result.q_dists is None or not result.nodes:
                return result
            depth = []
            for n in result.nodes:
                depth.append(1 if n.parent < 0 else depth[n.parent] + 1)
            wrong = E.misrecord_q(result, 0.3)
            q = torch.where(torch.tensor(depth)[:, None] >= min_depth, wrong.q_dists, result.q_dists)
            nodes = tuple(replace(n, q=float(q[i, n.token_id])) for i, n in enumerate(result.nodes))
            return replace(result, nodes=nodes, q_dists=q)

    return DeepMisrecorded


def test_a_q_wrong_only_past_depth_two_fails_the_gate_of_a_deeper_run(monkeypatch):
    """Every case was at most two deep: a draft whose recorded q is wrong only at depth 3 passed the
    gate of a run drafting four deep. The gate deepens one of the run's cases to min(depth, 3)."""
    from harness.gates.stages import e2e_gate

    monkeypatch.setattr(E, "DraftModelProposer", _deep_misrecorded_draft(3))
    shallow = e2e_gate("rejection", "draft_model", ["iid"], greedy=False, shape="sequence", max_depth=2)
    assert shallow["status"] == "passed" and shallow["coverage"]["depth"] == {"run": 2, "enumerated": 2}
    deep = e2e_gate("rejection", "draft_model", ["iid"], greedy=False, shape="sequence", max_depth=4)
    assert deep["status"] == "failed", deep
    assert deep["failed_case"]["case"] == "e2e/draft/iid/seq2/T1/depth3" and deep["failed_case"]["max_abs_error"] > 1e-3


def test_the_gate_entry_says_which_depth_it_enumerated():
    """A run deeper than the deepened case says so: the depth enumerated and the run's depth, and its
    coverage claims no more than that."""
    from harness.gates.stages import e2e_gate

    three = e2e_gate("greedy", "hydra", ["beam"], greedy=True, shape="expansion", max_depth=3)
    assert three["status"] == "passed" and three["cases"][-1] == "e2e/hydra/beam/exp21/T0/depth3"
    assert three["coverage"]["depth"] == {"run": 3, "enumerated": 3, "case": "e2e/hydra/beam/exp21/T0/depth3"}
    assert three["coverage"]["covers"] == E.GATE_TIERS[1]
    five = e2e_gate("greedy", "hydra", ["beam"], greedy=True, shape="expansion", max_depth=5)
    assert five["status"] == "passed" and five["coverage"]["depth"]["enumerated"] == 3
    assert five["coverage"]["depth"]["run"] == 5 and "5 deep" in five["coverage"]["depth"]["partial"]
    assert five["coverage"]["covers"] != E.GATE_TIERS[1] and "3 deep" in five["coverage"]["covers"]
