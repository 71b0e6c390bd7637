"""The enumeration oracle: exact branch probabilities over the real verifier code."""

from __future__ import annotations

import json

import pytest
import torch

from harness.contracts import NO_STATE, ProposalNode, ProposalResult
from harness.gates import oracle as O
from harness.gates.oracle_cli import main as oracles_main
from harness.gates.oracle_cli import negative_control_status, run_suite
from harness.verifiers import VERIFIERS, get_verifier
from harness.verifiers import broken as _broken  # noqa: F401  (registers the negative control)

P_TOY = (0.5, 0.3, 0.2)
Q_TOY = (0.4, 0.4, 0.2)


# --------------------------------------------------------------------------- the enumerator


def test_enumerator_gives_exact_branch_probabilities():
    def fn(rng):
        a = rng.bernoulli(0.3)
        b = rng.categorical(torch.tensor([0.25, 0.0, 0.75]))
        return (a, b)

    marg = O.enumerate_marginal(fn)
    assert marg == {
        (True, 0): pytest.approx(0.075, abs=1e-15),
        (True, 2): pytest.approx(0.225, abs=1e-15),
        (False, 0): pytest.approx(0.175, abs=1e-15),
        (False, 2): pytest.approx(0.525, abs=1e-15),
    }
    # the zero-probability branch (token 1) is pruned: 4 leaves, not 6
    assert len(list(O.enumerate_leaves(fn))) == 4


def test_enumerator_follows_data_dependent_draw_sequences():
    def fn(rng):  # number of flips depends on earlier flips: geometric truncated at 3
        n = 0
        while n < 3 and rng.bernoulli(0.5):
            n += 1
        return n

    assert O.enumerate_marginal(fn) == {0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125}


def test_enumerator_normalises_categorical_like_the_torch_source():
    marg = O.enumerate_marginal(lambda rng: rng.categorical(torch.tensor([2.0, 6.0])))
    assert marg == {0: 0.25, 1: 0.75}


def test_leaf_cap_is_asserted():
    def fn(rng):
        return tuple(rng.categorical(torch.full((4,), 0.25)) for _ in range(3))  # 64 leaves

    with pytest.raises(O.OracleError, match="max_leaves=10"):
        O.enumerate_marginal(fn, max_leaves=10)
    assert len(O.enumerate_marginal(fn, max_leaves=64)) == 64


def test_code_with_randomness_outside_its_source_is_refused():
    state = {"calls": 0}

    def fn(rng):  # the branch probability depends on hidden state, not on earlier draws
        state["calls"] += 1
        return rng.bernoulli(0.5 if state["calls"] == 1 else 0.4)

    with pytest.raises(O.OracleError, match="changed on replay"):
        O.enumerate_marginal(fn)


def test_target_joint_and_completion():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    joint = O.target_joint(lambda prefix: p, 2)
    assert joint == {(0, 0): 0.25, (0, 1): 0.25, (1, 0): 0.25, (1, 1): 0.25}
    completed = O.complete_to_length({(1,): 1.0}, lambda prefix: p, 2)
    assert completed == {(1, 0): 0.5, (1, 1): 0.5}
    assert O.max_abs_error(completed, joint) == 0.25


# --------------------------------------------------------------------------- toy instances


def _iid_set(q, k):
    q_t = torch.tensor(q, dtype=torch.float64)
    laws = O.PrefixLaws(vocab=len(q), seed=0, fixed={(): q_t})
    return O.sampled_builder(laws, (k,), "iid")


def _first_token(marg, vocab):
    return O.first_token_marginal(marg, vocab).tolist()


def test_toy_specinfer_reproduces_p():
    p = torch.tensor(P_TOY, dtype=torch.float64)
    marg = O.verifier_output_marginal(get_verifier("specinfer"), _iid_set(Q_TOY, 2), lambda prefix: p)
    assert _first_token(marg, 3) == pytest.approx(list(P_TOY), abs=1e-12)


def test_toy_naive_multi_draft_is_wrong():
    # independent derivation: each draw tested against the ORIGINAL p, correction norm([p - q]_+)
    p, q = P_TOY, Q_TOY
    accept = [min(1.0, p[x] / q[x]) for x in range(3)]
    resid = [max(0.0, p[x] - q[x]) for x in range(3)]
    resid = [r / sum(resid) for r in resid]
    expected = [0.0, 0.0, 0.0]
    for x1 in range(3):
        for x2 in range(3):
            w = q[x1] * q[x2]
            expected[x1] += w * accept[x1]
            expected[x2] += w * (1 - accept[x1]) * accept[x2]
            for y in range(3):
                expected[y] += w * (1 - accept[x1]) * (1 - accept[x2]) * resid[y]
    pt = torch.tensor(P_TOY, dtype=torch.float64)
    marg = O.verifier_output_marginal(get_verifier("naive_multi_draft"), _iid_set(Q_TOY, 2), lambda prefix: pt)
    got = _first_token(marg, 3)
    assert got == pytest.approx(expected, abs=1e-12)
    assert max(abs(a - b) for a, b in zip(got, P_TOY)) > 1e-3  # the bug is visible


def test_duplicated_mass():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    naive = O.verifier_output_marginal(get_verifier("naive_multi_draft"), _iid_set((0.0, 1.0), 3), lambda pr: p)
    assert _first_token(naive, 2) == pytest.approx([2**-3, 1 - 2**-3], abs=1e-15)  # not (1/2, 1/2)
    spec = O.verifier_output_marginal(get_verifier("specinfer"), _iid_set((0.0, 1.0), 3), lambda pr: p)
    assert _first_token(spec, 2) == pytest.approx([0.5, 0.5], abs=1e-15)


def test_oracle_catches_a_q_that_is_not_the_law_sampled():
    p = torch.tensor(P_TOY, dtype=torch.float64)
    q_true = torch.tensor(Q_TOY, dtype=torch.float64)
    q_claimed = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)

    def lying(rng):
        toks = [rng.categorical(q_true) for _ in range(2)]
        nodes = tuple(ProposalNode(token_id=t, q=float(q_claimed[t])) for t in toks)
        return ProposalResult(
            nodes=nodes,
            probability_semantics="normalized_conditional",
            sampling_relation="iid",
            topology="set",
            state_handle=NO_STATE,
            manifest_hash="x",
            q_dists=torch.stack([q_claimed, q_claimed]),
        )

    marg = O.verifier_output_marginal(get_verifier("specinfer"), lying, lambda prefix: p)
    err = max(abs(a - b) for a, b in zip(_first_token(marg, 3), P_TOY))
    assert err > 1e-3


# --------------------------------------------------------------------------- registry coverage


@pytest.mark.parametrize("name", O.exact_verifier_names())
def test_every_exact_verifier_passes_its_cases(name):
    verifier = VERIFIERS[name]()
    cases = O.verifier_cases(verifier, seeds=(0,), random_count=2)
    assert cases, f"no oracle case derived for {name}"
    for case in cases:
        row = O.check_case(verifier, case)
        assert row["passed"], f"{name} / {case.name}: marginal error {row['max_abs_error']:.3e}"
        assert row["leaves"] <= O.MAX_LEAVES


def test_registry_iteration_covers_the_builtins_and_hides_test_only():
    names = O.exact_verifier_names()
    assert {"greedy", "membership", "rejection", "specinfer", "sequoia"} <= set(names)
    assert "naive_multi_draft" not in names
    assert "naive_multi_draft" in O.exact_verifier_names(include_test_only=True)


def test_cases_follow_declarations():
    greedy = O.verifier_cases(VERIFIERS["greedy"](), seeds=(0,))
    assert greedy and all(c.name.startswith("one_hot/") for c in greedy)  # temperature 0 only
    rejection = O.verifier_cases(VERIFIERS["rejection"](), seeds=(0,))
    assert all("/seq" in c.name or c.name.startswith("truncation/") for c in rejection)  # sequences only
    membership = {c.tags.get("relation") for c in O.verifier_cases(VERIFIERS["membership"](), seeds=(0,))}
    assert {"iid", "without_replacement", "beam", "deterministic_lookup"} <= membership
    sequoia = [c.name for c in O.verifier_cases(VERIFIERS["sequoia"](), seeds=(0,))]
    assert "fallback/uniform-after-exhaustion-k3" in sequoia
    assert any(n.startswith("truncation/top_p") for n in sequoia)
    assert any(n.startswith("truncation/top_k") for n in sequoia)
    specinfer = [c.name for c in O.verifier_cases(VERIFIERS["specinfer"](), seeds=(0,))]
    assert "toy/p.5.3.2-q.4.4.2-iid2" in specinfer and "duplicated-mass/bernoulli-half-k3" in specinfer


def test_random_cases_stay_small_and_varied():
    cases = O.random_cases(VERIFIERS["specinfer"](), count=12, seed=3)
    vocabs = {c.tags["vocab"] for c in cases}
    assert max(vocabs) <= 6 and min(vocabs) >= 2 and len(vocabs) > 1
    depths = {len(c.tags["widths"]) for c in cases}
    assert depths <= {1, 2, 3} and len(depths) > 1
    assert all(1 <= c.tags["widths"][0] <= 4 for c in cases)


def test_sequoia_fallback_case_is_exact_and_naive_is_caught():
    sequoia = VERIFIERS["sequoia"]()
    case = next(c for c in O.verifier_cases(sequoia, seeds=()) if c.name == "fallback/uniform-after-exhaustion-k3")
    assert O.check_case(sequoia, case)["passed"]
    rows = run_suite(["naive_multi_draft"], seeds=(0,), random_count=1, transport=False)
    assert rows and all(not r["passed"] for r in rows if r["case"].startswith(("toy", "duplicated-mass")))
    status = negative_control_status([dict(r, negative_control=True) for r in rows])
    assert status["caught"] and status["max_abs_error"] >= 0.3


def test_run_suite_filters_by_verifier_and_relation():
    rows = run_suite(["rejection"], relations=["iid"], seeds=(0,), random_count=1)
    assert rows and {r["verifier"] for r in rows} == {"rejection"}
    assert all(r["passed"] for r in rows)
    assert {r["kind"] for r in rows} == {"marginal", "transport"}
    assert not any(r["negative_control"] for r in rows)
    with pytest.raises(ValueError, match="unknown verifier"):
        run_suite(["no_such_verifier"])


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "not" / "yet" / "oracles.json"  # its folder is created (it failed after the whole suite)
    rc = oracles_main(["--verifier", "rejection", "--quick", "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0
    assert "oracle cases" in captured.err and "case/s" in captured.err  # a progress bar, on stderr
    assert "rejection" in text and "negative control naive_multi_draft: caught" in text
    data = json.loads(out.read_text())
    assert data["summary"]["passed"] is True
    assert data["summary"]["negative_control"]["caught"] is True
    assert all(r["passed"] for r in data["rows"] if not r["negative_control"])


def test_cli_json_refuses_to_replace_a_run_s_record_or_a_file_it_did_not_write(tmp_path, capsys):
    """``--json`` wrote over any file, a run's record.json included."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "record.json").write_text('{"run_id": "r"}')
    (run / "outputs.jsonl").write_text("{}\n")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for path, fragment in (
        (run / "record.json", f"is a file of the run folder {run}: write an oracle suite JSON elsewhere"),
        (run / "outputs.jsonl", f"is a file of the run folder {run}: write an oracle suite JSON elsewhere"),
        (tmp_path / "record.json", "record.json is the name of a run's record; give an oracle suite JSON another name"),
        (notes, "already exists and is not an oracle suite JSON; give another path or --overwrite"),
        # any other path inside a run folder too, as compare, dashboard and export refuse it
        (run / "oracles.json", f"is inside the run folder {run.resolve()}: write an oracle suite JSON outside any"),
        (run / "sub" / "o.json", f"is inside the run folder {run.resolve()}: write an oracle suite JSON outside any"),
    ):
        assert oracles_main(["--verifier", "rejection", "--quick", "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("harness oracles: refused: --json=") and fragment in err and err.count("\n") == 1, err
    assert (run / "record.json").read_text() == '{"run_id": "r"}' and notes.read_text() == '{"mine": 1}'
    assert sorted(p.name for p in run.iterdir()) == ["outputs.jsonl", "record.json"]
    assert oracles_main(["--verifier", "rejection", "--quick", "--json", str(notes), "--overwrite"]) == 0
    assert json.loads(notes.read_text())["summary"]["passed"] is True
    assert oracles_main(["--verifier", "rejection", "--quick", "--json", str(notes)]) == 0  # its own file again


def test_cli_refuses_an_empty_json_and_overwrite_without_json_in_one_line(tmp_path, capsys, monkeypatch):
    """``--json=`` was read as the current folder ("--json=. is a folder"); ``--overwrite`` alone was
    accepted and did nothing. Both refused before the suite runs."""
    monkeypatch.chdir(tmp_path)
    for argv, line in (
        (["--json="], "--json= is empty: give the file to write the rows and summary to (e.g. --json oracles.json)"),
        (["--json", " "], "--json= is empty: give the file to write the rows and summary to"),
        (["--overwrite"], "--overwrite goes with --json PATH (the file it may replace)"),
    ):
        assert oracles_main(["--verifier", "rejection", "--quick", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"harness oracles: refused: {line}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_cli_help_says_random_sets_the_count_quick_otherwise_takes(capsys):
    """--quick's help said "two random instances" while --random 0 --quick ran none: --random gives the
    count, --quick its default."""
    with pytest.raises(SystemExit):
        oracles_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quick one seed, no end-to-end cases, two random instances per verifier (unless --random gives" in text
    assert "--random RANDOM random instances per verifier (default 4; 2 with --quick)" in text


def test_cli_refuses_a_heuristic_verifier_in_one_line_before_its_progress_bar(capsys):
    assert oracles_main(["--verifier", "typical", "--quick"]) == 2
    assert capsys.readouterr().err == (
        "harness oracles: refused: verifier 'typical' is heuristic (exact=False): the oracle does not apply\n"
    )


def test_cli_refuses_an_unknown_verifier_in_one_line(capsys):
    """The refusal came after the progress bar had started, its remnant in front of the line."""
    assert oracles_main(["--verifier", "nonsense", "--quick"]) == 2
    assert capsys.readouterr().err == (
        "harness oracles: refused: unknown verifier 'nonsense'; registered: ['greedy', 'membership', "
        "'naive_multi_draft', 'rejection', 'sequoia', 'specinfer', 'typical']\n"
    )


def test_cli_fails_when_a_named_verifier_is_broken(capsys):
    assert oracles_main(["--verifier", "naive_multi_draft", "--quick", "--random", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_nan_acceptance_is_refused_not_silently_rejected():
    with pytest.raises(O.OracleError, match="nan"):
        O.enumerate_marginal(lambda rng: rng.bernoulli(float("nan")))


@pytest.mark.parametrize("name", ["rejection", "specinfer"])
def test_a_float64_draft_s_tiny_probability_is_read_in_its_own_dtype(name):
    """A float64 draft's q of 1e-50 for the drawn token rounds to 0 in a float32 target's dtype: the
    ratio p / q divided by zero (ZeroDivisionError) where it is p / 1e-50, an acceptance."""
    from harness.random_source import TorchRandomSource
    from harness.topology.compiler import compile_tree

    q = torch.tensor([[1.0 - 1e-50, 1e-50, 0.0]], dtype=torch.float64)
    proposal = ProposalResult(
        nodes=(ProposalNode(token_id=1, q=1e-50),),
        probability_semantics="normalized_conditional",
        sampling_relation="iid",
        topology="sequence",
        state_handle=NO_STATE,
        manifest_hash="x",
        q_dists=q,
    )
    tree = compile_tree([proposal], 1)
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float32)
    marginal = O.enumerate_marginal(lambda rng: get_verifier(name).select(tree, probs, rng).accepted_rows)
    assert marginal == {(0,): 1.0}  # accepted with probability min(1, 0.5 / 1e-50)
    assert get_verifier(name).select(tree, probs, TorchRandomSource(0)).accepted_rows == (0,)


def test_top_p_keeps_tied_tokens_by_index_whatever_the_rows_sorted_together():
    """Two tokens tied at the top-p boundary: the law keeps the lower index, for one row and for a
    verify forward's many rows alike (an unstable sort may break the tie otherwise on some devices)."""
    from harness.verifiers.sampling import SamplingPolicy

    row = torch.full((64,), -30.0)
    row[[5, 9]] = 0.0  # tied, each about half the mass
    policy = SamplingPolicy(temperature=1.0, top_p=0.4)
    one = policy.probs(row[None])
    many = policy.probs(row.repeat(33, 1))
    assert torch.equal(one[0], many[17]) and one[0, 5] == 1.0 and one[0, 9] == 0.0


@pytest.mark.parametrize("name", ["rejection", "specinfer", "sequoia"])
def test_a_nan_target_row_fails_the_residual_verifiers_contract_instead_of_accepting(name):
    """min(1.0, nan) is 1.0 in Python: a NaN frontier row accepted every draft token, in runs and in
    the oracle alike (its NaN guard never saw the ratio). The ratio is checked before it is clipped."""
    from harness.contracts import ContractError
    from harness.random_source import TorchRandomSource
    from harness.topology.compiler import compile_tree
    from harness.verifiers.sampling import SamplingPolicy

    relation = "without_replacement" if name == "sequoia" else "iid"
    q = torch.tensor([[0.1, 0.7, 0.1, 0.1]])
    proposal = ProposalResult(
        nodes=(ProposalNode(token_id=1, q=0.7),),
        probability_semantics="normalized_conditional",
        sampling_relation=relation,
        topology="sequence",
        state_handle=NO_STATE,
        manifest_hash="x",
        q_dists=q,
    )
    tree = compile_tree([proposal], 1)
    probs = SamplingPolicy(temperature=1.0).probs(torch.zeros(2, 4))
    probs[0] = float("nan")  # the frontier row only
    verifier = get_verifier(name)
    with pytest.raises(ContractError, match="acceptance ratio of row 0 is not a number"):
        verifier.select(tree, probs, TorchRandomSource(0))
    with pytest.raises(ContractError, match="not a number"):
        O.enumerate_marginal(lambda rng: verifier.select(tree, probs, rng).accepted_rows)
    with pytest.raises(ValueError, match="nan"):
        TorchRandomSource(0).bernoulli(float("nan"))


@pytest.mark.slow
def test_full_suite_passes_and_catches_the_negative_control():
    from harness.gates.oracle_cli import summarize

    rows = run_suite()
    summary = summarize(rows)
    assert summary["failed"] == 0, [r["case"] for r in rows if not r["passed"] and not r["negative_control"]]
    assert summary["negative_control"]["caught"] and summary["passed"]


def test_a_verifiers_own_logits_path_is_checked_against_select_and_a_wrong_one_fails():
    """Runs call select_logits; the marginal cases call select. A verifier whose fast path drops the
    policy's truncation passed every oracle while the run emitted tokens outside top-p. Its fast path is
    now compared with select on the same trees, logits and random stream, under truncating policies."""
    from harness.gates.oracle import check_fast_path, overrides_select_logits, run_verifier_cases, verifier_cases
    from harness.gates.stages import oracle_gate
    from harness.verifiers import get_verifier
    from harness.verifiers.builtin import SpecInferVerifier
    from harness.verifiers.sampling import SamplingPolicy

    greedy = get_verifier("greedy")
    assert overrides_select_logits(greedy) and not overrides_select_logits(get_verifier("specinfer"))
    rows = [r for r in run_verifier_cases("greedy") if r["kind"] == "fast_path"]
    assert rows and all(r["passed"] and r["leaves"] > 0 for r in rows)
    assert any(c.endswith("/select_logits") for c in oracle_gate("greedy", "beam")["cases"])

    class UntruncatedFastPath(SpecInferVerifier):  # WRONG: its fast path ignores top-k and top-p
        def select_logits(self, tree, logits, policy, rng):
            return self.select(tree, SamplingPolicy(temperature=policy.temperature).probs(logits), rng)

    wrong = UntruncatedFastPath()
    case = next(c for c in verifier_cases(wrong) if c.tags.get("relation") == "iid" and "set" in c.name)
    row = check_fast_path(wrong, case)
    assert not row["passed"] and row["max_abs_error"] > 0
    assert check_fast_path(SpecInferVerifier(), case)["passed"]  # the inherited path is select itself


def test_the_oracle_gate_runs_every_sampling_relation_the_proposer_declares(monkeypatch):
    """A merged proposer declares its sources' relations; the oracle gate ran the first one's cases
    only, so a verifier wrong only for siblings drawn without replacement passed under a merge whose
    other source drew i.i.d. It runs the cases of every declared relation now."""
    from harness.contracts import Selection
    from harness.gates.stages import oracle_gate
    from harness.verifiers.base import VERIFIERS
    from harness.verifiers.builtin import ALL_RELATIONS, SpecInferVerifier, positive_residual

    class FirstDrawLaw(SpecInferVerifier):
        """WRONG for draws without replacement: every sibling is tested against the first draw's law
        (right for i.i.d. siblings, which share it)."""

        name = "first_draw_law"
        sampling_relations = ALL_RELATIONS

        def select(self, tree, target_probs, rng):
            node, path = -1, []
            while True:
                residual, accepted, draws = target_probs[node + 1], None, tree.draws[node + 1]
                for draw in draws:
                    q = tree.q_dists[draws[0].q_index].to(residual.dtype)
                    x = int(tree.token_ids[draw.row])
                    if rng.bernoulli(min(1.0, float(residual[x]) / float(q[x])) if q[x] > 0 else 1.0):
                        accepted = draw.row
                        break
                    residual = positive_residual(residual, q)
                if accepted is None:
                    return Selection(accepted_rows=tuple(path), next_token=rng.categorical(residual))
                path.append(accepted)
                node = accepted

    monkeypatch.setitem(VERIFIERS, FirstDrawLaw.name, FirstDrawLaw)
    iid = oracle_gate(FirstDrawLaw.name, "iid")
    assert iid["status"] == "passed" and not any("without_replacement" in c for c in iid["cases"])
    both = oracle_gate(FirstDrawLaw.name, ["without_replacement", "iid"])
    assert both["status"] == "failed" and "without_replacement" in both["failed_case"]["case"]
    membership = oracle_gate("membership", ["iid", "without_replacement"])
    assert membership["status"] == "passed"
    assert {"iid", "without_replacement"} <= {c.split("/")[1] for c in membership["cases"] if "/" in c}


# --------------------------------------------------------------------------- random-case coverage

#: the probability semantics a proposal of each sampling relation can carry
_RELATION_SEMANTICS = {
    "iid": ("normalized_conditional",),
    "without_replacement": ("normalized_conditional",),
    "beam": ("score_only",),
    "deterministic_lookup": ("absent", "frequency"),
}


def _negotiable_pairs(verifier) -> set[tuple[str, str]]:
    """``(sampling relation, target kind)`` for every proposal relation and temperature negotiation
    admits for ``verifier``: a one-hot target at temperature 0, a dense one above."""
    from harness.contracts import Capabilities
    from harness.verifiers.base import refusal

    pairs = set()
    for relation, semantics in _RELATION_SEMANTICS.items():
        for temperature, kind in ((0.0, "one_hot"), (0.8, "dense")):
            for sem in semantics:
                caps = Capabilities(
                    name="probe",
                    probability_semantics=frozenset({sem}),
                    sampling_relations=frozenset({relation}),
                    topology="sequence",
                )
                if refusal(caps, verifier, temperature=temperature) is None:
                    pairs.add((relation, kind))
    return pairs


@pytest.mark.parametrize("name", O.exact_verifier_names())
def test_run_gate_random_cases_cover_every_relation_and_target_kind(name, monkeypatch):
    """The oracle gate of a run with one sampling relation keeps only that relation's cases: at the
    gate's own random count, those still hold a random case for each temperature regime the relation
    can be negotiated at, and a branching tree where the verifier takes trees."""
    from harness.gates import stages

    seen: list = []

    def record(verifier, case, **_):
        seen.append(case)
        return {"case": case.name, "kind": "marginal", "passed": True, "max_abs_error": 0.0}

    monkeypatch.setattr(stages, "check_case", record)
    monkeypatch.setattr(stages, "check_fast_path", lambda v, case, **_: record(v, case))
    monkeypatch.setattr(stages, "check_transport", lambda v, **kw: {"case": kw["name"], "kind": "transport"})
    verifier = VERIFIERS[name]()
    pairs = _negotiable_pairs(verifier)
    assert pairs, name
    for relation in sorted({r for r, _ in pairs}):
        seen.clear()
        list(stages._synthetic_rows(name, [relation]))
        random = [c for c in seen if c.name.startswith("random/") and c.tags["relation"] == relation]
        kinds = {c.tags["target_kind"] for c in random}
        assert kinds == {k for r, k in pairs if r == relation}, (name, relation, [c.name for c in random])
        if "tree" in verifier.topologies:
            assert any(len(c.tags["widths"]) >= 2 and max(c.tags["widths"]) >= 2 for c in random), (
                name,
                relation,
                [c.name for c in random],
            )
    # the quick suite's count (2) covers every pair too
    quick = O.random_cases(verifier, count=2)
    assert {(c.tags["relation"], c.tags["target_kind"]) for c in quick} == pairs
