"""Negative controls for every gate, through the runner on tiny models: each broken piece is caught
by its gate and the run leaves no record; a genuine near-tie passes and is recorded, too many fail."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.config import compose
from harness.contracts import Selection
from harness.gates.status import GateError
from harness.runner import run_job

PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]


@pytest.fixture
def workload(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def cfg(workload: Path, *overrides: str):
    return compose(
        [
            "model=tiny",
            "workload=jsonl",
            f"workload.path={workload}",
            "workload.chat=false",
            "generation.max_new_tokens=12",
            "generation.warmup_tokens=2",
            "threads=1",
            *overrides,
        ]
    )


def nothing_written(run_dir: Path) -> None:
    assert not (run_dir / "record.json").exists() and not (run_dir / "outputs.jsonl").exists()


def test_a_verifier_that_accepts_a_wrong_token_fails_greedy_equality(workload, tmp_path, monkeypatch):
    from harness.verifiers.builtin import MembershipVerifier

    calls = {"n": 0}

    def wrong(self, tree, target_probs, rng):  # WRONG: every third round emits the second-best token
        calls["n"] += 1
        if calls["n"] % 3:
            return Selection(accepted_rows=(), next_token=int(target_probs[0].argmax()))
        return Selection(accepted_rows=(), next_token=int(torch.topk(target_probs[0], 2).indices[1]))

    monkeypatch.setattr(MembershipVerifier, "select", wrong)
    run_dir = tmp_path / "run"
    with pytest.raises(GateError, match=r"greedy equality failed on prompt 'p0' at generated position \d+"):
        run_job(cfg(workload, "verifier=membership", "gates.oracle=false"), run_dir=run_dir)
    nothing_written(run_dir)


def tied_target(tie=(5, 6)):
    """A tiny target where two tokens have identical, dominant LM-head rows: wherever they lead,
    the target's top two logits tie exactly."""
    from harness.runner import _load

    def load_models(c, *, before_weights=None):
        if before_weights is not None:
            before_weights(None)  # the tiny model has no tokenizer
        target = _load(c.model)
        with torch.no_grad():
            w = target.model.lm_head.weight  # [V, d]
            w[tie[0]] = w[tie[1]] = 8.0 * w[7]
        return target, None

    return load_models


def nudged_verify(real, token=6, eps=1e-4):
    """A verify forward whose candidate trees' logits differ in the last bits (as kernels that are not
    shape-invariant make them): ``token`` gains ``eps``, far below the float32 near-tie tolerance."""

    def verify(self, state, pending, trees):
        out = real(self, state, pending, trees)
        if any(t is not None and t.num_rows for t in trees):
            with torch.inference_mode():
                for logits in out.logits:
                    logits[:, token] += eps
        return out

    return verify


def test_a_genuine_near_tie_is_recorded_and_too_many_fail(workload, tmp_path, monkeypatch):
    import harness.runner as runner
    from harness.target.backend import CausalLMBackend

    monkeypatch.setattr(runner, "load_models", tied_target())
    monkeypatch.setattr(CausalLMBackend, "verify", nudged_verify(CausalLMBackend.verify))
    overrides = ("gates.oracle=false", "gates.equivalence=false", "proposer=prompt_lookup", "topology=sequence")
    record = run_job(cfg(workload, *overrides, "gates.near_tie_max_fraction=1.0"), run_dir=tmp_path / "ok")
    ties = record["metrics"]["greedy_near_ties"]
    assert ties and all(t["spec_gap"] == 0.0 for t in ties)  # every divergence is an exact tie
    assert any(t["ar_token"] == 5 and t["spec_token"] == 6 and t["ar_gap"] == 0.0 for t in ties)
    assert record["gates"]["greedy_equality"]["status"] == "passed"
    assert record["metrics"]["greedy_identical"] is False
    run_dir = tmp_path / "too_many"
    with pytest.raises(GateError, match=r"near-ties in \d+ generated tokens, over gates.near_tie_max_fraction=0.01"):
        run_job(cfg(workload, *overrides), run_dir=run_dir)
    nothing_written(run_dir)


def test_a_commit_that_keeps_a_rejected_row_fails_the_equivalence_gate(workload, tmp_path, monkeypatch):
    from harness.target.backend import CausalLMBackend

    real = CausalLMBackend.commit

    def keep_the_first_rows(self, state, accepted_rows):  # WRONG: the first len(path) rows, not the path
        return real(self, state, [list(range(len(a))) for a in accepted_rows])

    monkeypatch.setattr(CausalLMBackend, "commit", keep_the_first_rows)
    run_dir = tmp_path / "run"
    with pytest.raises(GateError, match=r"gate 'equivalence' failed .*commit_max_abs_kv_diff"):
        run_job(cfg(workload, "gates.oracle=false"), run_dir=run_dir)
    nothing_written(run_dir)


def test_a_batched_run_checks_the_batched_verify_and_commit_and_a_broken_one_fails(workload, tmp_path, monkeypatch):
    """At batch > 1 the equivalence gate also runs over a batch of the run's prompts (ragged
    lengths, padded rows, requests that accept nothing): it passes for the real backend, and fails
    for one whose batched forward mixes up its requests' positions, which a batch of one never shows."""
    from harness.target.backend import CausalLMBackend

    record = run_job(cfg(workload, "gates.oracle=false", "generation.batch_size=2"), run_dir=tmp_path / "ok")
    batched = record["gates"]["equivalence"]["batched"]
    assert batched["status"] == "passed" and batched["batch_size"] == 2
    assert batched["max_abs_logit_diff"] <= batched["tolerance"]
    assert len(set(batched["prompt_tokens"])) == 2  # a ragged batch
    single = run_job(cfg(workload, "gates.oracle=false"), run_dir=tmp_path / "one")
    assert "batched" not in single["gates"]["equivalence"]

    real = CausalLMBackend.verify

    def swapped(self, state, pending, trees):  # WRONG: the second request gets the first one's logits
        out = real(self, state, pending, trees)
        if len(out.logits) > 1:
            rows = min(len(out.logits[0]), len(out.logits[1]))
            out.logits[1] = torch.cat([out.logits[0][:rows], out.logits[1][rows:]])
        return out

    bad = cfg(workload, "gates.oracle=false", "generation.batch_size=2", "gates.cache=false")
    with monkeypatch.context() as m:
        m.setattr(CausalLMBackend, "verify", swapped)
        with pytest.raises(GateError, match=r"gate 'equivalence' failed .*\"batched\""):
            run_job(bad, run_dir=tmp_path / "bad")
    nothing_written(tmp_path / "bad")
    real_commit = CausalLMBackend.commit

    def second_keeps_first_rows(self, state, accepted_rows):  # WRONG for request 1: its first rows, not its path
        if len(accepted_rows) > 1:
            accepted_rows = [accepted_rows[0], list(range(len(accepted_rows[1]))), *accepted_rows[2:]]
        return real_commit(self, state, accepted_rows)

    monkeypatch.setattr(CausalLMBackend, "commit", second_keeps_first_rows)
    with pytest.raises(GateError, match=r"gate 'equivalence' failed .*\"batched\""):
        run_job(bad, run_dir=tmp_path / "bad-commit")
    nothing_written(tmp_path / "bad-commit")


def _misrecord_q(monkeypatch):
    """The draft model made to record q with an extra temperature of 0.3 (WRONG: not the law it
    sampled); returns its real ``propose``."""
    from harness.proposers.draft_model import DraftModelProposer

    real = DraftModelProposer.propose

    def misrecorded(self, committed, rng):
        result = real(self, committed, rng)
        if result.q_dists is None or not result.nodes:
            return result
        q = result.q_dists.pow(1 / 0.3)
        q = q / q.sum(dim=-1, keepdim=True)
        nodes = tuple(replace(n, q=float(q[i, n.token_id])) for i, n in enumerate(result.nodes))
        return replace(result, nodes=nodes, q_dists=q)

    monkeypatch.setattr(DraftModelProposer, "propose", misrecorded)
    return real


def test_a_proposer_that_misrecords_q_fails_the_statistical_gate(workload, tmp_path, monkeypatch):
    real = _misrecord_q(monkeypatch)
    overrides = (
        "proposer=draft_model",
        "proposer.sampling=iid",
        "proposer.model.num_layers=1",
        "topology=set",
        "topology.max_nodes=2",
        "verifier=specinfer",
        "generation.temperature=1.0",
        "gates.oracle=false",
        "gates.chi2_samples=2000",
        "model.tiny.vocab_size=16",
    )
    run_dir = tmp_path / "run"
    with pytest.raises(GateError, match=r"gate 'statistical' failed .*p_value"):
        run_job(cfg(workload, *overrides), run_dir=run_dir)
    nothing_written(run_dir)
    from harness.proposers.draft_model import DraftModelProposer

    monkeypatch.setattr(DraftModelProposer, "propose", real)  # the same run with the real proposer passes
    record = run_job(cfg(workload, *overrides), run_dir=tmp_path / "ok")
    assert record["gates"]["statistical"]["status"] == "passed"
    # under 1% of its samples rejected the draft: the correction was barely exercised, and the entry says
    # so (it counted as tested both ways), after piloting other prefixes for one that takes both
    stat = record["gates"]["statistical"]
    assert stat["coverage"] == "one_way" and stat["paths_note"].startswith("only ")


def test_a_chance_rejection_of_a_correct_round_is_overturned_by_the_confirmation_sample(tmp_path, monkeypatch):
    """Prompt lookup under membership at T = 0.7 on the tiny model is exact, yet its first chi-square
    test at the gate's seed rejects at alpha = 5e-3 (p = 4.2e-3: the 1-in-200 chance every test at
    that level has). The independent confirmation passes, so the gate passes and records both."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    overrides = [
        "model=tiny",
        "proposer=prompt_lookup",
        "topology=sequences",
        "verifier=membership",
        "generation.temperature=0.7",
        "generation.max_new_tokens=4",
        "generation.warmup_tokens=0",
        "workload=humaneval",
        "workload.limit=1",
        "gates.oracle=false",
        "gates.chi2_alpha=5e-3",
        "seed=0",
        "threads=1",
    ]
    record = run_job(compose(overrides), run_dir=tmp_path / "run")
    entry = record["gates"]["statistical"]
    assert entry["first_test"]["status"] == "failed" and entry["first_test"]["p_value"] < entry["alpha"]
    assert entry["confirmation"]["status"] == "passed" and entry["confirmation"]["p_value"] >= entry["alpha"]
    # the top level is the deciding test's: no "passed" beside the rejected first test's p-value
    assert entry["status"] == "passed" and entry["decided_by"] == "confirmation"
    assert (
        entry["p_value"] == entry["confirmation"]["p_value"] and entry["observed"] == entry["confirmation"]["observed"]
    )


def test_a_biased_round_fails_the_confirmation_too(workload, tmp_path, monkeypatch):
    """The misrecorded-q proposer fails both tests: the confirmation does not rescue a real bias."""
    from harness.gates import statistical

    calls = []
    real = statistical.chi_square_test

    def spy(**kw):
        out = real(**kw)
        calls.append((kw["stream"], out["status"]))
        return out

    monkeypatch.setattr(statistical, "chi_square_test", spy)
    test_a_proposer_that_misrecords_q_fails_the_statistical_gate(workload, tmp_path, monkeypatch)
    # the biased run: two tests on disjoint streams, both failed; the real proposer: one test, passed,
    # then the pilots of other prefixes (its samples rejected the draft too rarely to count)
    assert [s for _, s in calls][:3] == ["failed", "failed", "passed"]
    assert len(calls) == 3 + statistical.MIXED_PREFIX_TRIES
    assert calls[1][0] - calls[0][0] == statistical.CONFIRMATION_STREAM


def _probe_finds_nothing(monkeypatch, *, every_call: bool = False) -> list[dict]:
    """The statistical gate's scan of the workload's prompts made to find no proposing prefix (its
    first call, or ``every_call``); the calls' prompts are returned as they are made."""
    import harness.gates.stages as stages
    from harness.gates.status import not_applicable

    real, calls = stages.statistical_gate, []

    def gate(**kw):
        calls.append({"prompts": [list(p) for p in kw["prompts"]]})
        if len(calls) == 1 or every_call:
            return {
                **not_applicable("proposer proposed nothing at the 4 candidate prefixes of the first 1 prompt(s)"),
                "prefix": {"probes": 4, "prompts_scanned": 1},
            }
        return real(**kw)

    monkeypatch.setattr(stages, "statistical_gate", gate)
    return calls


def test_a_statistical_gate_whose_probe_drew_no_proposal_tests_where_the_measured_run_proposed(
    workload, tmp_path, monkeypatch, capsys
):
    """Where the gate's scan of the workload's first prompts draws no proposal but the measured run
    proposes, the test runs at the contexts the run's first proposing rounds drafted from: the
    record said only that those rounds went untested, and counted the run as gated."""
    calls = _probe_finds_nothing(monkeypatch)
    overrides = ("proposer=prompt_lookup", "verifier=membership", "generation.temperature=0.7", "gates.cache=false")
    record = run_job(cfg(workload, *overrides), run_dir=tmp_path / "run")
    entry = record["gates"]["statistical"]
    assert len(calls) == 2 and entry["status"] == "passed" and record["gated"]
    assert (
        entry["prefixes_from"].startswith("the measured run") and "proposed nothing" in entry["workload_probe"]["why"]
    )
    assert "note" not in entry and "found no proposing prefix" not in capsys.readouterr().err
    # the prefixes are the contexts of the run's first proposing rounds: the prompt and what was committed before
    out = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    first = next(r for r in rounds if r["candidate_rows"] > 0)
    before = sum(r["committed"] for r in rounds if r["prompt_id"] == first["prompt_id"] and r["round"] < first["round"])
    row = next(o for o in out if o["prompt_id"] == first["prompt_id"])
    assert calls[1]["prompts"][0] == row["prompt_token_ids"] + row["spec_token_ids"][:before]
    assert entry["prefix"]["source"] == "prompt" and entry["prefix"]["prefix_len"] <= len(calls[1]["prompts"][0])


def test_a_round_wrong_where_only_the_measured_run_proposed_is_refused(workload, tmp_path, monkeypatch):
    """The misrecorded-q draft, with the gate's scan of the workload made to find nothing: the test at
    the measured run's own contexts fails it, and nothing is written."""
    _misrecord_q(monkeypatch)
    _probe_finds_nothing(monkeypatch)
    overrides = (
        "proposer=draft_model",
        "proposer.sampling=iid",
        "proposer.model.num_layers=1",
        "topology=set",
        "topology.max_nodes=2",
        "verifier=specinfer",
        "generation.temperature=1.0",
        "gates.oracle=false",
        "gates.cache=false",
        "gates.chi2_samples=2000",
        "model.tiny.vocab_size=16",
    )
    run_dir = tmp_path / "run"
    with pytest.raises(GateError, match=r"gate 'statistical' failed .* at a prefix where the measured run proposed"):
        run_job(cfg(workload, *overrides), run_dir=run_dir)
    nothing_written(run_dir)


def test_a_statistical_gate_that_finds_no_proposal_anywhere_says_so_when_the_measured_run_proposed(
    workload, tmp_path, monkeypatch, capsys
):
    """Where neither the workload's prompts nor the measured run's contexts draw a proposal from the
    gate's probe, the record says that the run's rounds were not tested by sampling, and how many."""
    _probe_finds_nothing(monkeypatch, every_call=True)
    overrides = ("proposer=prompt_lookup", "verifier=membership", "generation.temperature=0.7", "gates.cache=false")
    record = run_job(cfg(workload, *overrides), run_dir=tmp_path / "run")
    entry, rate = record["gates"]["statistical"], 1.0 - record["metrics"]["fallback_rate"]
    assert entry["status"] == "not_applicable" and rate > 0
    assert entry["measured_proposal_rate"] == rate and entry["prefixes_from"].startswith("the measured run")
    assert entry["note"].startswith(
        "the statistical gate found no proposing prefix to test (nor at the contexts the run's proposing rounds "
        f"drafted from), yet the measured run proposed in {rate:.0%} of its rounds"
    )
    assert f"harness: note: {entry['note']}" in capsys.readouterr().err


class _FixedLogits(torch.nn.Module):
    """A model whose every position's logits are ``row`` (in ``dtype``): what the greedy gate's
    teacher-forced forward reads."""

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=row.dtype))
        self.row = row

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.row.expand(input_ids.shape[0], input_ids.shape[1], -1))


def test_a_bfloat16_near_tie_is_measured_in_steps_of_the_top_logit():
    """bfloat16 logits from 32 to 64 lie 0.25 apart: a tie that another forward rounds one step apart was
    past the fixed 0.125 and failed the gate. Two steps at the top logit's magnitude are a near-tie in
    half precision; three are not, and at small logits the fixed tolerance still holds."""
    from harness.gates.greedy import NEAR_TIE_LOGIT_TOL, check_prompt, near_tie_tolerance

    def check(top: float, gap_steps: int):
        row = torch.full((8,), -10.0)
        step = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(top))
        row[3], row[5] = top, top - gap_steps * step
        model = _FixedLogits(row.to(torch.bfloat16))
        assert float(row.to(torch.bfloat16)[3] - row.to(torch.bfloat16)[5]) == gap_steps * step  # exact in bf16
        return check_prompt(
            model,
            prompt_id="p",
            prompt=[1, 2],
            ar=[3, 3],
            spec=[5, 3],
            tol=NEAR_TIE_LOGIT_TOL[torch.bfloat16],
            dtype=torch.bfloat16,
        )

    (tie,) = check(40.0, 1)  # one step: 0.25
    assert tie["spec_gap"] == 0.25 and tie["ar_gap"] == 0.0 and tie["tolerance"] == 0.5
    assert check(40.0, 2)[0]["spec_gap"] == 0.5
    with pytest.raises(GateError, match=r"0\.75 below the target's top logit.*near-tie tolerance 0\.5"):
        check(40.0, 3)
    assert near_tie_tolerance(torch.bfloat16, 0.125, 2.5) == 0.125  # small logits: the fixed tolerance
    with pytest.raises(GateError, match="near-tie tolerance 0.125"):
        check(2.5, 12)  # 12 steps of 2**-6 = 0.1875
    assert near_tie_tolerance(torch.float32, 1e-3, 40.0) == 1e-3  # float32 keeps its own


def test_the_equivalence_gate_stays_inside_the_context_a_short_model_allows(workload, tmp_path):
    """A run that fits a model of few positions: the gate's forwards stay inside them too (it kept
    48 prompt tokens and added twelve positions whatever the limit); five rounds of four positions leave
    twenty of its forty to the prompt."""
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"id": "s0", "prompt": "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny"}) + "\n")
    run_dir = tmp_path / "run"
    overrides = ["model.tiny.max_position_embeddings=40", "topology=sequence", "topology.max_nodes=2"]
    overrides += ["topology.max_depth=2", "generation.max_new_tokens=4", f"output_dir={run_dir}"]
    record = run_job(cfg(short, *overrides), run_dir=run_dir)
    gate = record["gates"]["equivalence"]
    assert gate["status"] == "passed" and gate["last_position"] <= 39 and gate["prompt_tokens"] == 20  # 5 rounds
    assert record["metrics"]["greedy_identical"] is True
