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
