"""End-to-end exactness oracle: the real round on a tiny float64
Llama with a vocabulary of 5 reproduces the target's joint over the next tokens, with every
proposal and verifier draw enumerated; a proposer that records a q other than the law it sampled
and a commit that keeps the wrong rows are both caught."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import round_of_one

from harness.contracts import Budget
from harness.engine.decode import RoundConfig, decode
from harness.gates import e2e as E
from harness.gates.oracle import MARGINAL_ATOL, OracleError, enumerate_marginal, exact_verifier_names, max_abs_error
from harness.target.backend import CausalLMBackend
from harness.verifiers.base import VERIFIERS

#: cases slower than ~1 s on one core run in the slow suite only (all others run by default)
SLOW = {
    ("membership", "draft/iid/set2/T1"),
    ("membership", "draft/iid/exp21/T0.8-topk3-topp0.9"),
    ("membership", "draft/wor/set2/T1"),
    ("membership", "draft/wor/exp21/T0.8-topk3-topp0.9"),
    ("membership", "eagle/iid/seq1/T1/2-rounds"),
}


@pytest.fixture(scope="module")
def models():
    return E.E2EModels.build()


def _params():
    out = []
    for name in exact_verifier_names():
        verifier = VERIFIERS[name]()
        for case in E.standard_cases():
            if E.applicable(case, verifier):
                marks = [pytest.mark.slow] if (name, case.name) in SLOW else []
                out.append(pytest.param(name, case.name, marks=marks, id=f"{name}-{case.name}"))
    return out


CASES = {c.name: c for c in E.standard_cases()}


@pytest.mark.parametrize("verifier_name,case_name", _params())
def test_real_round_reproduces_the_target_joint(models, verifier_name, case_name):
    row = E.check_e2e_case(VERIFIERS[verifier_name](), CASES[case_name], models)
    assert row["max_abs_error"] <= MARGINAL_ATOL, row
    assert row["passed"] and row["kind"] == "end_to_end"
    assert row["leaves"] >= 1 and row["seconds"] < 10


def test_every_exact_verifier_has_fast_end_to_end_cases_of_its_kind():
    """Coverage follows declarations: each exact verifier gets a T=1 case without truncation, a
    truncated one (top-k + top-p on both sides) where it samples, and T=0 where it allows it."""
    assert {"greedy", "membership", "rejection", "specinfer", "sequoia"} <= set(exact_verifier_names())
    for name in exact_verifier_names():
        verifier = VERIFIERS[name]()
        fast = [c for c in E.standard_cases() if E.applicable(c, verifier) and (name, c.name) not in SLOW]
        temps = {c.policy.temperature for c in fast}
        if verifier.temperatures in ("positive", "any"):
            assert 1.0 in temps, name
            assert any(c.policy.top_k and c.policy.top_p < 1 for c in fast), name
        if verifier.temperatures in ("zero", "any"):
            assert 0.0 in temps, name
    pairs = {(n, c.name) for n in exact_verifier_names() for c in E.standard_cases() if E.applicable(c, VERIFIERS[n]())}
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

    # the synthetic suite has its own tests (test_oracle.py); keep this one to the e2e part
    monkeypatch.setattr(oracle_cli, "run_suite", lambda *a, **k: [])
    out = tmp_path / "oracles.json"
    assert main(["--verifier", "rejection", "--random", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "e2e/draft/iid/seq2/T1" in text
    assert "end-to-end negative control (recorded q is not the law sampled): caught" in text
    data = json.loads(out.read_text())
    e2e_rows = [r for r in data["rows"] if r["kind"] == "end_to_end" and not r["negative_control"]]
    assert {r["case"] for r in e2e_rows} == {
        "e2e/draft/iid/seq2/T1",
        "e2e/draft/iid/seq2/T0.8-topk3-topp0.9",
        "e2e/eagle/iid/seq1/T1/2-rounds",
    }
    assert all(r["max_abs_error"] <= MARGINAL_ATOL for r in e2e_rows)
    assert data["summary"]["e2e_negative_control"]["caught"] is True
    assert data["summary"]["end_to_end_cases"] == 3


def test_oracles_cli_quick_skips_the_end_to_end_cases(capsys):
    from harness.gates.oracle_cli import main

    assert main(["--verifier", "rejection", "--quick", "--random", "0"]) == 0
    assert "e2e/" not in capsys.readouterr().out


def test_eagle_rounds_after_the_first_draft_from_the_verify_forwards_features(models):
    """The two-round EAGLE cases really draft in round 2: every branch's proposer received its verify
    forward through the shared tap, admitted the committed features and fed them to its cache."""
    from harness.proposers.eagle import EagleProposer

    seen = []
    orig = EagleProposer.propose

    def spy(self, committed, rng):
        out = orig(self, committed, rng)
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
        proposer_factory=lambda c, d, p: E.pruned_sampled_dynamic_proposer(c, policy=p, eagle=models.eagle),
    )
    assert not row["passed"] and row["max_abs_error"] > 1e-3, row
