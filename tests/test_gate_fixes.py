"""The equivalence gates' chain rounds (a verify over a chain takes the unmasked forward every
topology=sequence run takes) and their NaN checks, the gate cache keys' machine identity, the
end-to-end gate's coverage wording, and the statistical gate's handling of a committed token the
target's law gives no mass."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.gates.equivalence import batched_equivalence_gate, equivalence_gate
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model

PROMPTS = [
    {"id": "p0", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]


def _hide_the_last_cached_slot(hits: list):
    """WRONG (test-only): a causal mask for an unmasked forward of several rows over a non-empty
    cache in which every row after the first misses the last cached slot (an off-by-one causal
    offset in that forward alone); every other forward (prefills, masked trees, one-row steps) is
    untouched."""

    def mask(ids: torch.Tensor, start: int) -> torch.Tensor:
        b, r = ids.shape
        allowed = torch.zeros((b, 1, r, start + r), dtype=torch.bool)  # [B, 1, R, L + R]
        allowed[:, :, :, :start] = True
        allowed[:, :, :, start:] = torch.tril(torch.ones((r, r), dtype=torch.bool))
        allowed[:, :, 1:, start - 1] = False
        hits.append((b, r, start))
        return allowed.to(ids.device)

    return mask


def _break_the_chain_forward(monkeypatch, hits: list) -> None:
    """Patch the backend's forward with :func:`_hide_the_last_cached_slot`'s bug."""
    real = CausalLMBackend._forward
    wrong = _hide_the_last_cached_slot(hits)

    def chain_bug(self, cache, ids, pos, allowed, start, *, last_only=False, output_hidden=False):
        if allowed is None and start > 0 and ids.shape[1] > 1 and not last_only:
            allowed = wrong(ids, start)[:, 0]  # [B, R, L + R]
        return real(self, cache, ids, pos, allowed, start, last_only=last_only, output_hidden=output_hidden)

    monkeypatch.setattr(CausalLMBackend, "_forward", chain_bug)


def test_a_broken_unmasked_chain_forward_fails_both_equivalence_gates(monkeypatch):
    """Every gate round verified a branching tree (a masked forward), so a bug in the unmasked
    forward of several rows over a cache, the one every topology=sequence verify takes, passed."""
    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompt = list(range(3, 40))
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    single, batched = equivalence_gate(backend, prompt), batched_equivalence_gate(backend, prompts)
    assert single["status"] == "passed" and single["chain_rows"] == 3
    assert batched["status"] == "passed" and batched["chain_rows"] == 3
    hits: list = []
    _break_the_chain_forward(monkeypatch, hits)
    broken = equivalence_gate(backend, prompt)
    assert broken["status"] == "failed" and broken["tree_max_abs_logit_diff"] > broken["tolerance"]
    assert hits and all(b == 1 and r == 4 for b, r, _ in hits)  # the chain round's verify alone
    hits.clear()
    broken = batched_equivalence_gate(backend, prompts)
    assert broken["status"] == "failed" and broken["max_abs_logit_diff"] > broken["tolerance"]
    assert hits and all(b == 3 and r == 4 for b, r, _ in hits)  # the batch's equal chains, no holes


def test_a_broken_native_chain_forward_fails_a_sequence_run_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """A topology=sequence run on a fused CPU target verifies its chains through the native stack
    without a mask; an off-by-one there alone passed every gate and the run was recorded."""
    from harness.cli import main
    from harness.target import backend as backend_module
    from harness.target import fused_layers, native

    if native.native_kernels_problem() is not None:
        pytest.skip(f"no native kernels here: {native.native_kernels_problem()}")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    real = fused_layers.stack_logits
    hits: list = []
    wrong = _hide_the_last_cached_slot(hits)

    def chain_bug(model, ids, pos, mask, cache, *, last_only=False):
        start = cache.get_seq_length() if cache is not None else 0
        if mask is None and start > 0 and ids.shape[1] > 1 and not last_only:
            out = real(model, ids, pos, wrong(ids, start), cache, last_only=last_only)
            if out is not None:
                return out
            hits.pop()
        return real(model, ids, pos, mask, cache, last_only=last_only)

    monkeypatch.setattr(backend_module, "stack_logits", chain_bug)
    run_dir = tmp_path / "run"
    argv = ["run", "model=tiny", "topology=sequence", "proposer=prompt_lookup", "workload=jsonl"]
    argv += [f"workload.path={workload}", "workload.chat=false", "generation.max_new_tokens=8", "threads=1"]
    assert main([*argv, f"output_dir={run_dir}"]) == 2
    assert hits  # the native stack ran the broken forward
    err = capsys.readouterr().err
    assert "gate 'equivalence' failed" in err and "tree_max_abs_logit_diff" in err
    assert not (run_dir / "record.json").exists() and not (run_dir / "outputs.jsonl").exists()


def test_a_gate_cache_shared_across_machines_keys_the_machines_kernels(tmp_path, monkeypatch):
    """The gates' cache keys named the device as torch spells it ("cpu", "cuda:0") and nothing of the
    machine, so a cache shared across machines served passes computed on another CPU's or GPU's
    kernels, or under another CPU dispatch (ATEN_CPU_CAPABILITY=default)."""
    from harness.config import compose
    from harness.measure import hardware
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={workload}", "workload.chat=false"]
    config = compose([*overrides, "generation.max_new_tokens=4", "threads=1", "gates.oracle=false"])

    def equivalence(name: str) -> dict:
        return run_job(config, run_dir=tmp_path / name)["gates"]["equivalence"]

    first, again = equivalence("first"), equivalence("again")
    assert not first["cached"] and again["cached"] and again["key"] == first["key"]
    with monkeypatch.context() as m:
        m.setattr(hardware, "cpu_capability", lambda: "DEFAULT")
        dispatch = equivalence("dispatch")
    assert not dispatch["cached"] and dispatch["key"] != first["key"]
    with monkeypatch.context() as m:
        m.setattr(hardware, "cpu_name", lambda *a, **k: "Another CPU")
        cpu = equivalence("cpu")
    assert not cpu["cached"] and len({cpu["key"], dispatch["key"], first["key"]}) == 3


def test_the_machine_identity_names_the_gpu_and_the_native_kernels_where_they_apply(monkeypatch):
    """A CUDA device's model and compute capability, and the native kernels' code paths only where
    they are loaded."""
    from harness.gates import stages
    from harness.measure import hardware
    from harness.target import native

    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(native, "native_kernels_loaded", lambda: False)
    h100 = stages.machine_identity(["cuda:0"])
    assert h100["devices"] == [["cuda:0", "NVIDIA H100 80GB HBM3", [9, 0]]]
    assert "cpu_capability" not in h100 and "native_code_paths" not in h100  # nothing on the CPU decides
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert stages.machine_identity(["cuda:0"]) != h100
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert stages.machine_identity(["cuda:0"]) != h100
    cpu = stages.machine_identity(["cpu", "cpu"])
    assert cpu["devices"] == [["cpu", hardware.cpu_name()]] and cpu["cpu_capability"] == hardware.cpu_capability()
    assert "native_code_paths" not in cpu
    monkeypatch.setattr(native, "native_kernels_loaded", lambda: True)
    monkeypatch.setattr(native, "code_paths", lambda: {"float32_width": 512, "avx512": True})
    wide = stages.machine_identity(["cpu"])
    monkeypatch.setattr(native, "code_paths", lambda: {"float32_width": 256, "avx512": False})
    assert wide["native_code_paths"]["avx512"] and stages.machine_identity(["cpu"]) != wide


def test_the_fourth_tier_says_what_this_proposer_lacks_not_that_it_has_no_cases():
    """A greedy draft_model run drafting without replacement enumerates another proposer's cases
    (tier 4), whose entry said draft_model had no end-to-end case of its own: it has many, only none
    with that relation at temperature 0."""
    from harness.gates import e2e as E

    tier, cases = E.gate_tier("draft_model", ["without_replacement"], "greedy", greedy=True)
    assert tier == 4 and cases and all(c.proposer != "draft_model" for c in cases)
    own = [c for c in E.e2e_cases() if c.proposer == "draft_model"]
    assert any("without_replacement" in E.case_relations(c) and c.policy.temperature > 0 for c in own)
    covers = E.GATE_TIERS[4]
    assert "no end-to-end case of its own" not in covers
    assert "no case of this proposer has any of them at this kind of temperature" in covers


def test_a_nan_in_the_compared_cache_fails_the_equivalence_gate(monkeypatch):
    """A NaN in a compared cache entry fails the gate: ``max(worst, nan)`` keeps the finite value, so
    the cache comparison carries NaN through as the logit comparison does, and the finite check sees
    it."""
    backend = CausalLMBackend(build_tiny_model(seed=0))
    prompt = list(range(3, 40))
    assert equivalence_gate(backend, prompt)["status"] == "passed"
    real, calls = backend.prefill_one, []

    def nan_in_the_reference_cache(prompt_ids):  # WRONG (test-only): the reference cache holds a NaN
        state = real(prompt_ids)
        calls.append(len(prompt_ids))
        if len(calls) == 2:  # the gate's second prefill: the reference the committed cache is compared with
            state.cache.layers[0].values[0, 0, 0, 0] = float("nan")
        return state

    monkeypatch.setattr(backend, "prefill_one", nan_in_the_reference_cache)
    broken = equivalence_gate(backend, prompt)
    assert len(calls) == 2
    assert broken["status"] == "failed" and math.isnan(broken["commit_max_abs_kv_diff"])
    assert broken["tree_max_abs_logit_diff"] <= broken["tolerance"]  # the logits alone would pass


def test_the_oracle_gates_keys_name_the_machine(tmp_path, monkeypatch):
    """The synthetic oracle's and the end-to-end oracle's cache keys name the machine, as the other
    gates' do: both compute on the CPU (float32 fast-path checks, the end-to-end cases' float32
    forwards), and a cache shared across machines must not serve a pass computed on another CPU's
    kernels."""
    from harness.config import compose
    from harness.gates import stages
    from harness.runner import load, plan_job, prepare_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={workload}", "workload.chat=false", "threads=1"]
    cfg = compose([*overrides, "tracking=none"])
    planned = plan_job(cfg, tmp_path / "run")
    loaded = load(cfg, planned)
    prep = prepare_job(cfg, planned, loaded)
    seen: dict[str, str] = {}

    def record_key(name, key, enabled, compute):  # the key alone: nothing computed
        seen[name] = key
        return {"status": "passed", "cached": False, "key": key}

    monkeypatch.setattr(stages, "_cached", record_key)

    def keys_on(machine: str) -> dict[str, str]:
        monkeypatch.setattr(
            stages, "machine_identity", lambda devices: {"devices": [[str(d), machine] for d in devices]}
        )
        seen.clear()
        stages.run_gates(
            cfg,
            plan_=prep.plan,
            backend=loaded.backend,
            proposer=prep.proposers[0],
            items=loaded.items,
            model_source=loaded.target.source,
        )
        return dict(seen)

    first, again, other = keys_on("one CPU"), keys_on("one CPU"), keys_on("another CPU")
    assert {"oracle", "end_to_end_oracle"} <= set(first)
    for name in ("oracle", "end_to_end_oracle", "equivalence"):
        assert first[name] == again[name] and first[name] != other[name], name


# --------------------------------------------------------------------------- statistical: impossible tokens


@pytest.fixture(scope="module")
def top_k_run(tmp_path_factory):
    """A sampled prompt-lookup run whose law is cut to its top 4 tokens of 16: every other token has
    no mass."""
    from harness.config import compose
    from harness.runner import load, plan_job, prepare_job

    root = tmp_path_factory.mktemp("top_k")
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_CACHE", str(root / "cache"))
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={path}", "workload.chat=false", "threads=1"]
    overrides += ["tracking=none", "proposer=prompt_lookup", "verifier=membership", "topology=sequence"]
    overrides += ["topology.max_nodes=3", "topology.max_depth=3", "generation.temperature=1.0"]
    overrides += ["generation.top_k=4", "model.tiny.vocab_size=16"]
    cfg = compose(overrides)
    planned = plan_job(cfg, root / "run")
    loaded = load(cfg, planned)
    prep = prepare_job(cfg, planned, loaded)
    yield loaded, prep
    mp.undo()


def _gate_with(run, verifier, seed: int) -> dict:
    from harness.gates.statistical import statistical_gate

    loaded, prep = run
    return statistical_gate(
        backend=loaded.backend,
        proposer=prep.proposers[0],
        verifier=verifier,
        policy=prep.plan.policy,
        prompts=[list(item[1]) for item in loaded.items],
        samples=400,
        top_m=4,
        alpha=1e-3,
        seed=seed,
        max_nodes=prep.plan.budget.max_nodes,
        max_depth=prep.plan.budget.max_depth,
    )


def _assert_failed_on_an_impossible_token(entry: dict, *, test: str) -> None:
    assert entry["status"] == "failed" and entry["impossible_samples"] >= 1
    evidence = entry["impossible"]
    assert evidence["test"] == test and evidence["impossible_samples"] == entry["impossible_samples"]
    assert evidence["prefix_len"] == entry["prefix"]["prefix_len"] and evidence["samples"] == entry["samples"]
    assert sum(n for _, n in evidence["tokens"]) == evidence["impossible_samples"]


def test_a_verifier_that_rarely_commits_an_impossible_token_fails_the_statistical_gate(top_k_run):
    """A token outside the target's top-k is impossible under the target's law: the first test that
    sees one fails the gate, with no confirmation on fresh samples that may not see it (at seeds 1
    and 2 here the first test draws one and a confirmation would draw none)."""
    from harness.contracts import Selection
    from harness.verifiers.builtin import MembershipVerifier

    class RarelyImpossible(MembershipVerifier):
        """WRONG (test-only): with probability 1/400 commits a token the target's top-k law gives no mass."""

        def select(self, tree, target_probs, rng):
            if rng.bernoulli(1 / 400):
                return Selection(accepted_rows=(), next_token=int(target_probs[0].argmin()))
            return super().select(tree, target_probs, rng)

    for seed in (1, 2):
        entry = _gate_with(top_k_run, RarelyImpossible(), seed)
        _assert_failed_on_an_impossible_token(entry, test="first_test")
        assert entry["decided_by"] == "first_test" and "confirmation" not in entry  # proof: no rerun


def test_a_verifier_that_commits_an_impossible_token_once_fails_the_statistical_gate(top_k_run):
    """One impossible token, on the very first selection the gate makes, and never again."""
    from harness.contracts import Selection
    from harness.verifiers.builtin import MembershipVerifier

    class OnceImpossible(MembershipVerifier):
        """WRONG (test-only): its first selection commits a token the target's top-k law gives no mass."""

        calls = 0

        def select(self, tree, target_probs, rng):
            OnceImpossible.calls += 1
            if OnceImpossible.calls == 1:
                self.token = int(target_probs[0].argmin())
                return Selection(accepted_rows=(), next_token=self.token)
            return super().select(tree, target_probs, rng)

    verifier = OnceImpossible()
    entry = _gate_with(top_k_run, verifier, 0)
    _assert_failed_on_an_impossible_token(entry, test="first_test")
    assert entry["impossible_samples"] == 1 and entry["impossible"]["tokens"] == [[verifier.token, 1]]
    assert _gate_with(top_k_run, MembershipVerifier(), 0)["status"] == "passed"  # the correct verifier passes


def _scripted_test(script: dict):
    """A chi-square test standing in for the real one: ``script[(prefix length, confirmation)]`` gives
    its outcome (``ok``: passed; ``one_way``: passed, every sample one way; ``reject``: a chi-square
    rejection; ``impossible``: passed the chi-square but committed an impossible token), default
    ``ok``; records what it was asked."""
    from harness.gates import statistical

    asked = []

    def test(*, prompt_ids, samples, stream, **kw):
        confirmation = stream >= statistical.CONFIRMATION_STREAM
        asked.append((len(prompt_ids), samples, confirmation))
        outcome = script.get((len(prompt_ids), confirmation), "ok")
        one_way = outcome == "one_way"
        impossible = 2 if outcome == "impossible" else 0
        return {
            "status": "passed" if outcome in ("ok", "one_way") else "failed",
            "samples": samples,
            "impossible_samples": impossible,
            **({"impossible_tokens": [[7, impossible]]} if impossible else {}),
            "p_value": 1e-9 if outcome == "reject" else 0.5,
            "prefix_len": len(prompt_ids),
            "first_token_accepted": samples if one_way else samples // 2,
            "proposal_seconds": 0.0,
            **({"paths_note": statistical.paths_note(samples, samples)} if one_way else {}),
        }

    return test, asked


def test_an_impossible_token_in_any_test_the_statistical_gate_runs_fails_it(monkeypatch):
    """Only a chi-square rejection is confirmed; an impossible token seen by a confirmation, a pilot or
    the test at another prefix fails the gate with that test's evidence at the top level, and a one-way
    first prefix given up for another keeps its own outcome under ``one_way_prefix``."""
    from harness.contracts import Budget
    from harness.gates import statistical
    from harness.proposers.prompt_lookup import PromptLookupProposer

    backend = CausalLMBackend(build_tiny_model(seed=0))
    lookup = PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]  # every cut from the end back proposes a copy
    kw = dict(backend=backend, proposer=lookup, verifier=None, policy=None, top_m=8, alpha=1e-3, seed=0)

    def gate(script: dict) -> tuple[dict, list]:
        test, asked = _scripted_test(script)
        monkeypatch.setattr(statistical, "chi_square_test", test)
        entry = statistical.statistical_gate(prompts=[prompt], samples=500, max_nodes=4, max_depth=4, **kw)
        if entry["status"] == "failed":
            assert entry["impossible_samples"] > 0 or "impossible" not in entry
        else:
            assert entry.get("impossible_samples", 0) == 0 and "impossible" not in entry
        return entry, asked

    entry, asked = gate({(12, False): "impossible"})  # the first test: no confirmation
    assert asked == [(12, 500, False)] and entry["impossible"]["test"] == "first_test"
    assert entry["status"] == "failed" and entry["decided_by"] == "first_test"
    entry, asked = gate({(12, False): "reject"})  # a chi-square rejection alone is confirmed
    assert asked == [(12, 500, False), (12, 500, True)] and entry["status"] == "passed"
    assert entry["decided_by"] == "confirmation" and entry["first_test"]["status"] == "failed"
    entry, asked = gate({(12, False): "reject", (12, True): "impossible"})  # seen by the confirmation
    assert entry["status"] == "failed" and entry["decided_by"] == "confirmation"
    assert entry["impossible_samples"] == 2 and entry["impossible"]["test"] == "confirmation"
    assert entry["confirmation"]["impossible_samples"] == 2 and entry["first_test"]["impossible_samples"] == 0
    entry, asked = gate({(12, False): "one_way", (11, False): "impossible"})  # seen by a pilot
    assert asked == [(12, 500, False), (11, 64, False)]
    assert entry["status"] == "failed" and entry["decided_by"] == "pilot" and entry["prefix"]["prefix_len"] == 11
    assert entry["impossible"] == {**entry["impossible"], "test": "pilot", "prefix_len": 11, "samples": 64}
    assert entry["impossible"]["tokens"] == [[7, 2]] and entry["pilots"][-1]["impossible_samples"] == 2
    assert entry["one_way_prefix"]["prefix_len"] == 12 and entry["one_way_prefix"]["status"] == "passed"
    # a one-way first prefix decided by its confirmation gives way to the next: its outcome is kept
    entry, asked = gate({(12, False): "reject", (12, True): "one_way"})
    assert asked == [(12, 500, False), (12, 500, True), (11, 64, False), (11, 500, False)]
    assert entry["status"] == "passed" and entry["prefix"]["prefix_len"] == 11
    assert entry["one_way_prefix"] == {
        **entry["one_way_prefix"],
        "prefix_len": 12,
        "status": "passed",
        "decided_by": "confirmation",
        "impossible_samples": 0,
    }
    # a later pilot, after one that took one way too
    entry, asked = gate({(12, False): "one_way", (11, False): "one_way", (10, False): "impossible"})
    assert asked == [(12, 500, False), (11, 64, False), (10, 64, False)]
    assert entry["status"] == "failed" and entry["impossible"]["test"] == "pilot"


def test_an_impossible_token_at_the_mixed_prefix_s_full_test_fails_the_gate(monkeypatch):
    """The full test at the prefix the pilots chose saw an impossible token (its pilot did not):
    the gate fails there, with no confirmation and no further prefix tried."""
    from harness.contracts import Budget
    from harness.gates import statistical
    from harness.proposers.prompt_lookup import PromptLookupProposer

    backend = CausalLMBackend(build_tiny_model(seed=0))
    lookup = PromptLookupProposer(budget=Budget("sequence", 4, 4), manifest_hash="t")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    kw = dict(backend=backend, proposer=lookup, verifier=None, policy=None, top_m=8, alpha=1e-3, seed=0)
    test, asked = _scripted_test({(12, False): "one_way"})

    def pilot_clean_full_test_not(*, prompt_ids, samples, stream, **rest):
        out = test(prompt_ids=prompt_ids, samples=samples, stream=stream, **rest)
        if len(prompt_ids) == 11 and samples == 500:
            out = {**out, "status": "failed", "impossible_samples": 1, "impossible_tokens": [[9, 1]]}
        return out

    monkeypatch.setattr(statistical, "chi_square_test", pilot_clean_full_test_not)
    entry = statistical.statistical_gate(prompts=[prompt], samples=500, max_nodes=4, max_depth=4, **kw)
    assert asked == [(12, 500, False), (11, 64, False), (11, 500, False)]
    assert entry["status"] == "failed" and entry["impossible"]["test"] == "first_test"
    assert entry["impossible"]["prefix_len"] == 11 and entry["impossible"]["tokens"] == [[9, 1]]
    assert entry["one_way_prefix"]["prefix_len"] == 12 and "coverage" not in entry


# --------------------------------------------------------------------------- gate cache: entries that are no verdict

#: cache files that hold no passed verdict: a JSON list, an empty object, a failed verdict, a
#: truncated file
NOT_A_VERDICT = {
    "list": "[]",
    "empty_object": "{}",
    "failed": json.dumps({"status": "failed", "max_abs_error": 3.0, "key": "k1"}),
    "truncated": '{"status": "passed", "max_abs_err',
}


@pytest.mark.parametrize("content", list(NOT_A_VERDICT.values()), ids=list(NOT_A_VERDICT))
def test_a_cached_gate_file_that_holds_no_passed_verdict_is_recomputed_and_replaced(tmp_path, monkeypatch, content):
    from harness.gates.stages import _cached

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    calls = []

    def compute():
        calls.append(1)
        return {"status": "passed", "max_abs_error": 0.0}

    path = tmp_path / "cache" / "gates" / "equivalence-k1.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    entry = _cached("equivalence", "k1", True, compute)
    assert calls == [1]
    assert entry == {"status": "passed", "max_abs_error": 0.0, "cached": False, "key": "k1"}
    assert json.loads(path.read_text()) == {"status": "passed", "max_abs_error": 0.0, "cached": False, "key": "k1"}
    assert _cached("equivalence", "k1", True, compute)["cached"] and calls == [1]  # the replacement is served


def test_a_cached_gate_entry_recorded_under_another_key_is_recomputed(tmp_path, monkeypatch):
    from harness.gates.stages import _cached

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    calls = []

    def compute():
        calls.append(1)
        return {"status": "passed"}

    path = tmp_path / "cache" / "gates" / "oracle-k1.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"status": "passed", "cached": False, "key": "k0"}))
    assert _cached("oracle", "k1", True, compute) == {"status": "passed", "cached": False, "key": "k1"}
    assert calls == [1] and json.loads(path.read_text())["key"] == "k1"
    path.write_text(json.dumps({"status": "passed"}))  # an entry that records no key is served
    assert _cached("oracle", "k1", True, compute) == {"status": "passed", "cached": True} and calls == [1]


def test_the_gates_recompute_a_cached_equivalence_file_that_holds_no_verdict_and_the_run_goes_on(tmp_path, monkeypatch):
    """The equivalence gate's cache file, replaced by each of NOT_A_VERDICT, is recomputed by the
    gates of a run (which go on to the later gates), and the recomputed verdict is cached again."""
    from harness.config import compose
    from harness.gates import stages
    from harness.runner import load, plan_job, prepare_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    overrides = ["model=tiny", "workload=jsonl", f"workload.path={workload}", "workload.chat=false", "threads=1"]
    cfg = compose([*overrides, "tracking=none", "gates.oracle=false"])
    planned = plan_job(cfg, tmp_path / "run")
    loaded = load(cfg, planned)
    prep = prepare_job(cfg, planned, loaded)
    calls = []
    real = stages.equivalence_gate

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stages, "equivalence_gate", counted)

    def gates() -> dict:
        return stages.run_gates(
            cfg,
            plan_=prep.plan,
            backend=loaded.backend,
            proposer=prep.proposers[0],
            items=loaded.items,
            model_source=loaded.target.source,
        )

    first = gates()
    assert first["equivalence"]["status"] == "passed" and not first["equivalence"]["cached"] and len(calls) == 1
    (path,) = (tmp_path / "cache" / "gates").glob("equivalence-*.json")
    for n, (name, content) in enumerate(NOT_A_VERDICT.items(), start=2):
        path.write_text(content)
        out = gates()
        assert len(calls) == n, name
        assert out["equivalence"]["status"] == "passed" and not out["equivalence"]["cached"], name
        assert out["equivalence"]["key"] == first["equivalence"]["key"], name
        assert "workload_governance" in out and "greedy_equality" in out, name  # the later gates ran
        assert json.loads(path.read_text())["status"] == "passed", name
    assert gates()["equivalence"]["cached"] and len(calls) == 1 + len(NOT_A_VERDICT)
