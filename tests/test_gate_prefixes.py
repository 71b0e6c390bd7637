"""The statistical gate's prefixes: where a proposer copies from the text generated so far, the scan
goes on into a continuation the target decodes; where a test's samples all took one way to their
first token, later prefixes are piloted and the first that takes both ways is tested instead, and
where none does the entry and the run say so."""

from __future__ import annotations

import json

from harness.config import compose
from harness.contracts import Budget
from harness.gates import statistical
from harness.proposers.prompt_lookup import PromptLookupProposer
from harness.runner import run_job
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model

#: no token repeats: prompt lookup finds nothing to copy in the prompt itself
UNIQUE = [list(range(3, 15)), list(range(20, 30))]


def test_a_proposer_that_copies_generated_text_is_tested_in_the_target_s_continuation():
    """Prompt lookup over prompts with no repeat proposed nothing at any cut of them, and the gate said
    not_applicable (the run counted as gated) while the measured run proposed in a third of its
    rounds. The scan now goes on into the tokens the target decodes after each prompt."""
    backend = CausalLMBackend(build_tiny_model(seed=0))
    lookup = PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t")
    prefix, how = statistical.choose_prefix(backend, lookup, UNIQUE, stream=0, max_nodes=4, max_depth=4)
    assert prefix is None and how["continuations_scanned"] == 0  # the prompts alone: nothing
    prefix, how = statistical.choose_prefix(
        backend, lookup, UNIQUE, stream=0, max_nodes=4, max_depth=4, continuation=32
    )
    assert how["source"] == "continuation" and how["prompt_index"] == 0
    assert prefix[: len(UNIQUE[0])] == UNIQUE[0] and len(UNIQUE[0]) < how["prefix_len"] <= len(UNIQUE[0]) + 32
    assert prefix == statistical.target_continuation(backend, UNIQUE[0], 32)[: how["prefix_len"]]
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    entry = statistical.statistical_gate(
        backend=backend,
        proposer=lookup,
        verifier=get_verifier("membership"),
        policy=SamplingPolicy(temperature=0.7),
        prompts=UNIQUE,
        samples=300,
        top_m=8,
        alpha=1e-3,
        seed=0,
        max_nodes=4,
        max_depth=4,
        continuation=32,
    )
    assert entry["status"] == "passed" and entry["prefix"]["source"] == "continuation"


def _fake_test(one_way_at: set[int]):
    """A chi-square test standing in for the real one: one way to the first token at the prefix
    lengths ``one_way_at``, both ways elsewhere; records what it was asked."""
    asked = []

    def test(*, prompt_ids, samples, **kw):
        asked.append((len(prompt_ids), samples))
        one_way = len(prompt_ids) in one_way_at
        return {
            "status": "passed",
            "samples": samples,
            "first_token_accepted": samples if one_way else samples // 2,
            "proposal_seconds": 0.0,
            **({"paths_note": statistical.paths_note(samples, samples)} if one_way else {}),
        }

    return test, asked


def test_a_one_way_prefix_gives_way_to_the_first_piloted_prefix_that_takes_both(monkeypatch):
    backend = CausalLMBackend(build_tiny_model(seed=0))
    lookup = PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]  # every cut from the end back proposes a copy
    test, asked = _fake_test(one_way_at={12, 11})
    monkeypatch.setattr(statistical, "chi_square_test", test)
    kw = dict(backend=backend, proposer=lookup, verifier=None, policy=None, top_m=8, alpha=1e-3, seed=0)
    entry = statistical.statistical_gate(prompts=[prompt], samples=500, max_nodes=4, max_depth=4, **kw)
    # the full test at 12 took one way; the pilot at 11 too; the pilot at 10 both: the full test there decides
    assert asked == [(12, 500), (11, 64), (10, 64), (10, 500)]
    assert entry["status"] == "passed" and entry["prefix"]["prefix_len"] == 10 and "coverage" not in entry
    assert entry["one_way_prefix"]["prefix_len"] == 12 and [p["prefix_len"] for p in entry["pilots"]] == [11, 10]
    # no prefix takes both ways: the first test stands, said as such, after the pilots it allows
    test, asked = _fake_test(one_way_at=set(range(100)))
    monkeypatch.setattr(statistical, "chi_square_test", test)
    entry = statistical.statistical_gate(prompts=[prompt], samples=500, max_nodes=4, max_depth=4, **kw)
    assert entry["coverage"] == "one_way" and entry["prefix"]["prefix_len"] == 12
    assert len(entry["pilots"]) == statistical.MIXED_PREFIX_TRIES == len(asked) - 1


def test_a_run_whose_gate_took_one_way_everywhere_says_so(tmp_path, monkeypatch, capsys):
    """A draft equal to the target (all of its layers) has every proposal accepted: the chi-square
    test passes without ever exercising the correction after a rejection. The entry says
    coverage one_way with the prefixes piloted, and the run says so on stderr."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n    return a + b\n# add"}) + "\n")
    overrides = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={path}",
        "workload.chat=false",
        "generation.max_new_tokens=4",
        "generation.warmup_tokens=0",
        "proposer=draft_model",
        "proposer.model.num_layers=2",  # the tiny target's every layer: the draft is the target
        "proposer.sampling=iid",
        "topology=sequence",
        "topology.max_nodes=2",
        "verifier=rejection",
        "generation.temperature=0.7",
        "gates.oracle=false",
        "gates.chi2_samples=200",
        "threads=1",
    ]
    record = run_job(compose(overrides), run_dir=tmp_path / "run")
    entry = record["gates"]["statistical"]
    assert entry["status"] == "passed" and entry["coverage"] == "one_way"
    assert entry["first_token_accepted"] == 200 and all(p["accepted"] == 64 for p in entry["pilots"])
    tried = 1 + len(entry["pilots"])
    assert (
        f"harness: note: statistical gate passed, but at each of the {tried} prefixes it tried every sample's first "
        "token was an accepted proposed token: no test exercised both ways to a first token"
    ) in capsys.readouterr().err


def _ranges(calls) -> list[tuple[int, int]]:
    """The streams ``[start, end)`` of each test asked, modulo 2**32 (what torch's CPU generator keeps)."""
    return [(stream % 2**32, stream % 2**32 + samples) for stream, samples in calls]


def _pairwise_disjoint(ranges) -> bool:
    ordered = sorted(ranges)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:]))


def test_the_first_test_each_pilot_and_each_full_test_draw_from_streams_of_their_own(monkeypatch):
    """A pilot re-using the first test's streams adds little at a neighbouring cut, and a full test at a
    prefix on the streams of the pilot that chose it re-tests the very samples that chose it. Every
    test the gate asks for (the first, the pilots, the full tests at piloted prefixes, a confirmation)
    draws from a range of streams no other test draws from."""
    backend = CausalLMBackend(build_tiny_model(seed=0))
    lookup = PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    asked = []

    def test(*, prompt_ids, samples, stream, **kw):
        n, pilot = len(prompt_ids), samples == statistical.PILOT_SAMPLES
        confirmation = stream % 2**32 >= statistical.CONFIRMATION_STREAM
        asked.append((n, samples, stream, confirmation))
        # 12: one way; 11: the pilot both ways, the full test one way; 10: the pilot one way; 9: both ways,
        # the full test's first chi-square rejects and its confirmation passes
        one_way = n == 12 or (n == 11 and not pilot) or n == 10
        reject = n == 9 and not pilot and not confirmation
        return {
            "status": "failed" if reject else "passed",
            "samples": samples,
            "p_value": 1e-9 if reject else 0.5,
            "first_token_accepted": samples if one_way else samples // 2,
            "proposal_seconds": 0.0,
            **({"paths_note": statistical.paths_note(samples, samples)} if one_way else {}),
        }

    monkeypatch.setattr(statistical, "chi_square_test", test)
    kw = dict(backend=backend, proposer=lookup, verifier=None, policy=None, top_m=8, alpha=1e-3, max_nodes=4)
    entry = statistical.statistical_gate(prompts=[prompt], samples=500, max_depth=4, seed=3, **kw)
    assert [(n, s, c) for n, s, _, c in asked] == [
        (12, 500, False),
        (11, 64, False),
        (11, 500, False),
        (10, 64, False),
        (9, 64, False),
        (9, 500, False),
        (9, 500, True),
    ]
    assert entry["status"] == "passed" and entry["prefix"]["prefix_len"] == 9 and entry["decided_by"] == "confirmation"
    assert _pairwise_disjoint(_ranges([(stream, s) for _, s, stream, _ in asked]))
    # the evidence names each test's streams: the pilots', and the full test's where it took one way
    assert [p["stream"] for p in entry["pilots"]] == [stream for _, s, stream, _ in asked if s == 64]
    assert entry["pilots"][0]["full_test"]["stream"] == asked[2][2] and entry["pilots"][0]["full_test"]["way"]
    # deterministic given the seed: the same tests on the same streams again
    again = list(asked)
    asked.clear()
    statistical.statistical_gate(prompts=[prompt], samples=500, max_depth=4, seed=3, **kw)
    assert asked == again
    asked.clear()
    statistical.statistical_gate(prompts=[prompt], samples=500, max_depth=4, seed=4, **kw)
    assert [a[2] for a in asked] != [a[2] for a in again]


def test_a_real_gate_s_pilots_draw_new_samples_and_its_verdict_is_reproducible(monkeypatch):
    """The draft equal to the target: every proposal accepted at every prefix, so the gate pilots its
    eight next prefixes. Spying on the real chi-square test: the first test and the pilots draw from
    pairwise disjoint streams, and the gate's entry is the same for the same seed."""
    from harness.proposers.draft_model import DraftModelProposer
    from harness.verifiers import get_verifier
    from harness.verifiers.sampling import SamplingPolicy

    policy = SamplingPolicy(temperature=0.7)
    target = CausalLMBackend(build_tiny_model(seed=0))
    proposer = DraftModelProposer(
        budget=Budget("sequence", 2, 2),
        manifest_hash="t",
        policy=policy,
        backend=CausalLMBackend(build_tiny_model(seed=0)),
    )
    calls, real = [], statistical.chi_square_test

    def spy(**kw):
        out = real(**kw)
        calls.append((kw["stream"], kw["samples"]))
        return out

    monkeypatch.setattr(statistical, "chi_square_test", spy)

    def gate(seed):
        entry = statistical.statistical_gate(
            backend=target,
            proposer=proposer,
            verifier=get_verifier("rejection"),
            policy=policy,
            prompts=[list(range(3, 20))],
            samples=200,
            top_m=8,
            alpha=1e-3,
            seed=seed,
            max_nodes=2,
            max_depth=2,
        )
        return {k: v for k, v in entry.items() if "seconds" not in k}

    entry = gate(5)
    assert len(calls) == 1 + statistical.MIXED_PREFIX_TRIES and _pairwise_disjoint(_ranges(calls))
    assert entry["coverage"] == "one_way" and entry["way"] == "accepted"
    assert [p["stream"] for p in entry["pilots"]] == [stream for stream, _ in calls[1:]]
    first_calls = list(calls)
    calls.clear()
    again = gate(5)
    assert calls == first_calls
    again["prefix"].pop("seconds"), entry["prefix"].pop("seconds")  # the prefix scan's time
    assert again == entry


def _one_way_entry(first_accepted: int, pilots: list[dict], *, samples: int = 2000) -> dict:
    return {
        "status": "passed",
        "coverage": "one_way",
        "samples": samples,
        "proposed": samples,
        "first_token_accepted": first_accepted,
        "paths_note": statistical.paths_note(first_accepted, samples),
        "pilots": pilots,
    }


def test_the_one_way_note_says_the_way_most_samples_took_where_every_test_took_it():
    """A first test with 1,993 of 2,000 samples accepted (only 7 rejected: fewer than 2%) and eight
    pilots with every sample accepted all took the accepted way; the note said they had not taken
    the same way everywhere. Each test is classed by the way (nearly) all its samples took."""
    from harness.gates.stages import one_way_note

    pilots = [{"prefix_len": 50 - i, "samples": 64, "accepted": 64} for i in range(8)]
    note = one_way_note(_one_way_entry(1993, pilots))
    assert "not the same everywhere" not in note
    assert note.startswith(
        "harness: note: statistical gate passed, but at each of the 9 prefixes it tried every sample's first token, "
        "or all but a few, was an accepted proposed token (the first test: only 7 of the 2000 samples with a "
        "proposal rejected every proposed token (fewer than 2%)): no test took each way to a first token in 2% of "
        "its samples with a proposal"
    )
    # every sample of every test accepted: the first test's note as it is
    assert "tried every sample's first token was an accepted proposed token: no test exercised both ways" in (
        one_way_note(_one_way_entry(2000, pilots))
    )
    # the other way: a first test with 3 of 2,000 accepted, pilots with none accepted
    rejected = [{**p, "accepted": 0} for p in pilots]
    note = one_way_note(_one_way_entry(3, rejected))
    assert "tried no sample, or only a few, accepted a proposed token (the first test: only 3 of the 2000" in note
    assert "no sample accepted a proposed token: no test exercised" in one_way_note(_one_way_entry(0, rejected))
    # the ways differ between tests: said so, with how many took each
    mixed = rejected[:3] + pilots[3:]
    note = one_way_note(_one_way_entry(1993, mixed))
    assert "(not the same everywhere: mostly accepted at 6, mostly rejected at 3)" in note
    # a pilot that took both ways is classed by the full test it led to
    led = [{**pilots[0], "accepted": 30, "full_test": {"samples": 2000, "accepted": 1995}}] + pilots[1:]
    note = one_way_note(_one_way_entry(1993, led))
    assert "was an accepted proposed token (the first test:" in note and "not the same everywhere" not in note
    assert "(at 1 of them a 64-sample pilot took both ways, the full test there one way): no full test took" in note
