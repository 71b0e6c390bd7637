"""Gates before logging, through the real runner: a verifier broken on
purpose fails its oracle gate and leaves no record (its W&B run is a failed run tagged refused,
with no metric); negotiation refuses before
any model is loaded; gate outcomes land in every record and are cached by a key that a changed
verifier source changes; the statistical gate passes a correct round and fails a wrong one; a
heuristic verifier runs only when allowed explicitly and then records exact: false and its drift."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import inspect_run

import harness.verifiers.broken  # noqa: F401  (registers the test-only naive_multi_draft)
from harness import runner
from harness.app import run_main
from harness.config import compose
from harness.gates import keys, stages
from harness.gates.status import GateError
from harness.record_schema import GATES
from harness.verifiers.base import NegotiationError

PROMPTS = [
    {"id": "p0", "category": "code", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"},
    {"id": "p1", "category": "code", "prompt": "for i in range(3):\n    print(i)\nfor i in range(3):\n"},
]


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def compose_cfg(run_dir: Path, workload: Path, *overrides: str):
    base = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={workload}",
        "workload.chat=false",
        "generation.max_new_tokens=6",
        "generation.warmup_tokens=2",
        f"output_dir={run_dir}",
        "threads=1",
    ]
    return compose(base + list(overrides))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HARNESS_CACHE", str(root))
    return root


@pytest.fixture
def no_model_load(monkeypatch):
    import harness.runner
    import harness.target.loading as loading

    def refuse(**kwargs):
        raise AssertionError(f"a model was loaded: {kwargs.get('name')}")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(harness.runner, "load_model", refuse)  # the runner's own reference


def _no_outputs(run_dir: Path) -> None:
    """A refusal before any model work: nothing written, no tracker run."""
    assert not (run_dir / "record.json").exists()
    assert not (run_dir / "outputs.jsonl").exists()
    assert not list(run_dir.parent.rglob("wandb")), "a tracker run was opened"


def _refused_without_record(run_dir: Path) -> None:
    """A failed gate: no record and no measurement anywhere; the job's W&B run (these jobs track)
    is visible as a failed run tagged ``refused``, carrying the gate's error and no metric."""
    assert not (run_dir / "record.json").exists()
    assert not (run_dir / "outputs.jsonl").exists()
    assert not (run_dir / "rounds.jsonl").exists()
    info, _ = inspect_run(run_dir)
    assert info["state"] == "failed" and "refused" in info["tags"], info["tags"]
    assert info["summary"]["outcome"] == "refused" and info["summary"]["failure_stage"] == "gate"
    assert "speedup" not in info["summary"] and "time_per_committed_token_ms" not in info["summary"]


# --------------------------------------------------------------------------- the broken verifier


NAIVE = (
    "proposer=draft_model",
    "topology=set",
    "topology.max_nodes=2",
    "verifier=specinfer",
    "verifier.name=naive_multi_draft",
    "generation.temperature=1.0",
    "tracking=wandb",
)


def test_broken_verifier_fails_its_oracle_gate_and_leaves_nothing(tmp_path, workload, cache):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(run_dir, workload, *NAIVE)
    with pytest.raises(GateError, match=r"gate 'oracle' failed for verifier 'naive_multi_draft'") as err:
        runner.run_job(cfg, run_dir=run_dir)
    assert '"max_abs_error"' in str(err.value) and '"case"' in str(err.value)  # the evidence: the failed case
    _refused_without_record(run_dir)
    assert not list((cache / "gates").glob("oracle-*")), "a failed gate must not be cached"


def test_broken_verifier_through_harness_run_exits_2_with_no_record_and_a_refused_wandb_run(
    tmp_path, workload, cache, capsys
):
    run_dir = tmp_path / "run"
    argv = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={workload}",
        "workload.chat=false",
        "generation.max_new_tokens=6",
        "generation.warmup_tokens=2",
        f"output_dir={run_dir}",
        "threads=1",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        *NAIVE,
    ]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "gate 'oracle' failed" in err and "naive_multi_draft" in err
    _refused_without_record(run_dir)


# --------------------------------------------------------------------------- negotiation


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ("proposer=prompt_lookup", "verifier=rejection", "generation.temperature=0.7"),
            r"probability semantics \['score_only'\].*'rejection' requires one of \['normalized_conditional'\]",
        ),
        (("verifier=greedy", "generation.temperature=0.7"), r"'greedy' supports temperature 0 only"),
        (
            ("proposer=prompt_lookup", "verifier=typical", "generation.temperature=0.7"),
            r"'typical' is heuristic \(not exact\); exact mode refuses it.*generation.exact=false",
        ),
    ],
)
def test_negotiation_refuses_before_any_model_work(tmp_path, workload, cache, no_model_load, overrides, message):
    run_dir = tmp_path / "run"
    with pytest.raises(NegotiationError, match=message):
        runner.run_job(compose_cfg(run_dir, workload, *overrides), run_dir=run_dir)
    _no_outputs(run_dir)


def test_negotiation_refusal_through_harness_run(tmp_path, workload, cache, no_model_load, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "model=tiny",
        "workload=jsonl",
        f"workload.path={workload}",
        f"output_dir={run_dir}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "proposer=prompt_lookup",
        "verifier=rejection",
        "generation.temperature=0.7",
        "tracking=wandb",
    ]
    assert run_main(argv) == 2
    assert "refused" in capsys.readouterr().err
    _no_outputs(run_dir)


# --------------------------------------------------------------------------- records and the cache


def test_gate_outcomes_are_recorded_and_a_second_run_hits_the_cache(tmp_path, workload, cache):
    overrides = (
        "proposer=prompt_lookup",
        "verifier=greedy",
        "topology=sequence",
        "topology.max_nodes=3",
        "topology.max_depth=3",
    )
    first = runner.run_job(compose_cfg(tmp_path / "r1", workload, *overrides), run_dir=tmp_path / "r1")
    on_disk = json.loads((tmp_path / "r1" / "record.json").read_text())
    for record in (first, on_disk):
        gates = record["gates"]
        assert set(gates) == set(GATES) and record["gated"] is True and record["exact"] is True
        assert {g: gates[g]["status"] for g in GATES} == {
            "negotiation": "passed",
            "oracle": "passed",
            "end_to_end_oracle": "passed",
            "equivalence": "passed",
            "statistical": "not_applicable",  # temperature 0
            "workload_governance": "not_applicable",  # prompt lookup reads no datastore
            "greedy_equality": "passed",
        }
        assert gates["oracle"]["cached"] is False and gates["oracle"]["max_abs_error"] <= 1e-9
        assert gates["end_to_end_oracle"]["cases"] and all(
            c.startswith("e2e/") for c in gates["end_to_end_oracle"]["cases"]
        )
        assert "temperature 0" in gates["statistical"]["why"]
        assert gates["greedy_equality"]["prompts"] == len(PROMPTS) and gates["greedy_equality"]["tokens"] > 0
        assert gates["negotiation"]["verifier"] == "greedy"
    assert len(list((cache / "gates").glob("oracle-*.json"))) == 1
    second = runner.run_job(compose_cfg(tmp_path / "r2", workload, *overrides), run_dir=tmp_path / "r2")
    for name in ("oracle", "end_to_end_oracle", "equivalence"):
        assert second["gates"][name]["cached"] is True and second["gates"][name]["key"] == first["gates"][name]["key"]
    assert second["metrics"]["greedy_identical"] is True


def _keys_read_a_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the harness package whose sources the gate keys read instead (its folder returned):
    a test edits it to see which changes a key covers."""
    fake = tmp_path / "site"
    shutil.copytree(Path(stages.__file__).resolve().parents[1], fake / "harness")

    def module_file(name):
        path = fake / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = fake / name.replace(".", "/") / "__init__.py"
        return path if path.exists() else None

    monkeypatch.setattr(keys, "module_file", module_file)
    monkeypatch.setattr(keys, "_imports", keys._imports.__wrapped__)
    return fake


def test_changing_verifier_or_proposer_source_changes_the_gate_key(tmp_path, monkeypatch):
    """The oracle keys hash the import closure of the code they run: a change in the verifier, or in a
    proposer the end-to-end cases run, is a cache miss."""
    fake = _keys_read_a_copy(tmp_path, monkeypatch)
    files = {}
    inputs = {"verifier": "specinfer", "relation": "iid"}

    def key(entries):
        return keys.gate_key("end_to_end_oracle", entries=entries, inputs=inputs)

    entries = ["harness.gates.e2e", "harness.gates.stages", "harness.verifiers.builtin"]
    before = key(entries)
    assert key(entries) == before
    builtin = fake / "harness/verifiers/builtin.py"
    files["builtin"] = builtin.read_bytes()
    changed = files["builtin"].replace(b"rng.bernoulli(min(1.0, ratio))", b"rng.bernoulli(min(1.0, 1.0 * ratio))")
    assert changed != files["builtin"]
    builtin.write_bytes(changed)
    after_builtin = key(entries)
    assert after_builtin != before
    draft = fake / "harness/proposers/draft_model.py"
    draft.write_bytes(draft.read_bytes() + b"\n# changed\n")
    assert key(entries) != after_builtin
    assert keys.gate_key("end_to_end_oracle", entries=entries, inputs={**inputs, "relation": "beam"}) != key(entries)
    # the native kernels' C++ is code the gates run too (the fused decoder layers and stack)
    equivalence = ["harness.gates.equivalence", "harness.target.loading"]
    assert "harness.target.native" in keys.import_closure(equivalence)
    kernel_before = keys.gate_key("equivalence", entries=equivalence, inputs={})
    cpp = fake / "harness/target/kernels/cpu_decode.cpp"
    cpp.write_bytes(cpp.read_bytes() + b"\n// changed\n")
    assert keys.gate_key("equivalence", entries=equivalence, inputs={}) != kernel_before


def test_the_run_manifest_s_code_fingerprint_covers_the_native_kernels(tmp_path, monkeypatch):
    import harness.manifest as manifest

    pkg = tmp_path / "harness"
    (pkg / "target" / "kernels").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    cpp = pkg / "target" / "kernels" / "k.cpp"
    cpp.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(manifest, "PACKAGE_DIR", pkg)
    fingerprint = manifest.code_fingerprint.__wrapped__
    before = fingerprint()
    cpp.write_text("int f() { return 2; }\n")
    assert fingerprint() != before


def test_a_cached_gate_is_reused_only_for_the_same_forward(tmp_path, workload, cache):
    """The equivalence gate checks the configured forward: another cache layout or another linear
    kernel is another forward, so its gate runs again (it was reused from the first one run)."""
    overrides = ("proposer=prompt_lookup", "verifier=greedy", "topology=sequence", "gates.oracle=false")
    first = runner.run_job(compose_cfg(tmp_path / "r1", workload, *overrides), run_dir=tmp_path / "r1")
    again = runner.run_job(compose_cfg(tmp_path / "r2", workload, *overrides), run_dir=tmp_path / "r2")
    assert again["gates"]["equivalence"]["cached"] is True
    keys_seen = {first["gates"]["equivalence"]["key"]}
    kernel = "default" if first["manifest"]["backend"]["linear_kernel"] != "default" else "weight_major"
    for i, option in enumerate(("model.static_cache=false", f"model.linear_kernel={kernel}")):
        other = runner.run_job(
            compose_cfg(tmp_path / f"o{i}", workload, *overrides, option), run_dir=tmp_path / f"o{i}"
        )
        assert other["gates"]["equivalence"]["cached"] is False, option
        keys_seen.add(other["gates"]["equivalence"]["key"])
    assert len(keys_seen) == 3


def test_the_end_to_end_key_covers_every_module_its_cases_run():
    """Run the end-to-end gate of a verifier in a fresh process: every harness module it loaded is in
    the closure its key hashes."""
    import subprocess

    code = (
        "import sys; from harness.gates import stages;"
        "stages.e2e_gate('specinfer', 'draft_model', ['iid'], greedy=False);"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('harness'))))"
    )
    root = Path(stages.__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True).stdout
    loaded = set(out.split())
    closure = set(keys.import_closure(["harness.gates.e2e", "harness.gates.stages", "harness.verifiers.builtin"]))
    assert "harness.proposers.draft_model" in loaded and "harness.target.backend" in loaded
    assert loaded <= closure, sorted(loaded - closure)


def test_the_statistical_gate_of_a_merged_proposer_is_keyed_by_its_sources_code():
    """The merged proposer reaches its sources through the registry's "module:Class" strings, which
    the import closure did not follow: a changed prompt lookup or draft model passed the merged
    proposer's statistical gate from the cache. The closure follows those references now."""
    from harness.proposers.registry import PROPOSERS

    closure = set(keys.import_closure(["harness.gates.statistical", "harness.proposers.merged"]))
    for name in ("prompt_lookup", "draft_model", "rest"):
        assert PROPOSERS[name].split(":")[0] in closure, name
    # a preparer registry likewise
    assert "harness.prepare.sequoia" in set(keys.import_closure(["harness.prepare"]))


def test_the_statistical_gate_is_keyed_by_the_code_that_builds_and_prepares_the_run_s_proposer(tmp_path, monkeypatch):
    """The statistical gate runs the run's own proposer, built by harness.engine.build from options the
    preparers resolve, with arguments harness.gates.stages decides: none of them was in its key, so a
    build_proposer that recorded a wrong q passed from the cache (gated: true) where a fresh gate
    failed. A change in any of them is a cache miss now."""
    closure = set(keys.import_closure(stages.statistical_entries("prompt_lookup", "harness.verifiers.builtin")))
    assert {"harness.engine.build", "harness.gates.stages", "harness.prepare.verify_cost"} <= closure
    fake = _keys_read_a_copy(tmp_path, monkeypatch)
    entries = stages.statistical_entries("draft_model", "harness.verifiers.builtin")

    def key():
        return keys.gate_key("statistical", entries=entries, inputs={"temperature": 1.0})

    before = key()
    build = fake / "harness/engine/build.py"
    build.write_bytes(build.read_bytes() + b"\n# changed\n")
    assert key() != before


def test_an_oracle_error_that_is_not_a_number_fails_every_bound():
    """Python's max keeps a NaN only when it comes first: a NaN marginal entry after a finite one
    gave a finite error, and err <= bound passed."""
    import math

    from harness.gates.oracle import max_abs_error

    assert math.isnan(max_abs_error({(0,): 0.5, (1,): float("nan")}, {(0,): 0.4, (1,): 0.6}))
    assert math.isnan(max_abs_error({(1,): float("nan"), (0,): 0.5}, {(0,): 0.4, (1,): 0.6}))
    assert max_abs_error({(0,): 0.5}, {(0,): 0.25}) == 0.25 and max_abs_error({}, {}) == 0.0


def test_gate_keys_do_not_depend_on_the_hash_seed(tmp_path):
    """A merged proposer declares several relations (a frozenset): keys and case choice are sorted."""
    import subprocess

    relations = "frozenset({'iid', 'beam', 'deterministic_lookup'})"
    code = (
        "from harness.gates.keys import gate_key;"
        f"print(gate_key('x', entries=['harness.gates.keys'], inputs={{'r': {relations}}}))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(stages.__file__).resolve().parents[2],
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outs) == 1 and outs.pop().strip()


# --------------------------------------------------------------------------- the statistical gate


STAT = (
    "proposer=prompt_lookup",
    "verifier=membership",
    "topology=sequence",
    "topology.max_nodes=3",
    "topology.max_depth=3",
    "generation.temperature=1.0",
    "gates.oracle=false",
    "gates.cache=false",
    "gates.chi2_samples=400",
    "gates.chi2_top_m=4",
    "model.tiny.vocab_size=16",
)


def test_statistical_gate_passes_a_correct_round(tmp_path, workload, cache):
    record = runner.run_job(compose_cfg(tmp_path / "run", workload, *STAT), run_dir=tmp_path / "run")
    stat = record["gates"]["statistical"]
    assert stat["status"] == "passed" and stat["samples"] == 400 and stat["p_value"] >= stat["alpha"] == 1e-3
    assert stat["bins"] >= 4 and sum(stat["observed"]) == 400
    assert stat["distinct_trees"] >= 1 and stat["target_forwards"] >= 1  # forwards shared across samples
    assert 0 < stat["first_token_accepted"] < 400 and "paths_note" not in stat  # both ways to a first token
    # the oracle was switched off explicitly: recorded as skipped with the override, and the run is ungated
    for name in ("oracle", "end_to_end_oracle"):
        assert record["gates"][name] == {"status": "skipped", "override": "gates.oracle=false"}
    assert record["gated"] is False


def test_a_draft_that_is_the_target_is_never_rejected_and_the_gate_says_so(tmp_path, workload, cache):
    """The tiny target's default derived draft has the target's layers and weights: rejection sampling
    accepts every proposed token, so the test never reaches the residual law, and its evidence says so."""
    overrides = [o for o in STAT if not o.startswith(("proposer=", "verifier="))]
    cfg = compose_cfg(tmp_path / "run", workload, *overrides, "proposer=draft_model", "verifier=rejection")
    assert cfg.proposer.model.name == "derived" and cfg.proposer.model.num_layers == cfg.model.tiny.num_layers
    record = runner.run_job(cfg, run_dir=tmp_path / "run")
    stat = record["gates"]["statistical"]
    assert stat["status"] == "passed" and stat["first_token_accepted"] == stat["samples"] == 400
    assert "the correction after a rejection was not exercised" in stat["paths_note"]


def test_statistical_gate_fails_a_verifier_that_returns_the_argmax(tmp_path, workload, cache, monkeypatch):
    from harness.contracts import Selection
    from harness.verifiers.base import walk_children
    from harness.verifiers.builtin import MembershipVerifier

    def argmax_walk(self, tree, target_probs, rng):  # WRONG at T > 0: greedy instead of sampling
        node, path = -1, []
        while True:
            tok = int(target_probs[node + 1].argmax())
            child = walk_children(tree, node, tok)
            if child is None:
                return Selection(accepted_rows=tuple(path), next_token=tok)
            path.append(child)
            node = child

    monkeypatch.setattr(MembershipVerifier, "select", argmax_walk)
    run_dir = tmp_path / "run"
    with pytest.raises(GateError, match=r"gate 'statistical' failed for verifier 'membership'") as err:
        runner.run_job(compose_cfg(run_dir, workload, *STAT, "tracking=wandb"), run_dir=run_dir)
    assert '"p_value"' in str(err.value) and '"observed"' in str(err.value)  # the evidence
    _refused_without_record(run_dir)


def test_a_one_token_law_passes_when_every_sample_is_that_token_and_fails_otherwise(
    tmp_path, workload, cache, monkeypatch
):
    """top_k=1 at T > 0 leaves the target one token: no chi-square test exists (one bin); the gate
    passes a correct round by count, and fails a verifier that commits a token of zero mass."""
    from harness.contracts import Selection
    from harness.verifiers.builtin import MembershipVerifier

    one = (*STAT, "generation.top_k=1")
    record = runner.run_job(compose_cfg(tmp_path / "run", workload, *one), run_dir=tmp_path / "run")
    stat = record["gates"]["statistical"]
    assert stat["status"] == "passed" and stat["bins"] == 1 and stat["observed"] == [400]
    assert stat["impossible_samples"] == 0 and stat["p_value"] is None and "leaves one bin" in stat["note"]

    def impossible(self, tree, target_probs, rng):  # WRONG: a token the target's law gives no mass
        return Selection(accepted_rows=(), next_token=int(target_probs[0].argmin()))

    monkeypatch.setattr(MembershipVerifier, "select", impossible)
    run_dir = tmp_path / "wrong"
    with pytest.raises(GateError, match=r"gate 'statistical' failed for verifier 'membership'") as err:
        runner.run_job(compose_cfg(run_dir, workload, *one), run_dir=run_dir)
    assert '"impossible_samples": 400' in str(err.value)
    assert not (run_dir / "record.json").exists()


def test_a_high_entropy_law_is_tested_over_its_tail_split_by_rank(tmp_path, workload, cache, monkeypatch):
    """A tiny random model over 4,096 ids at T=1 spreads its law thinly: no top token expects 5 of 400
    samples, so top tokens and tail pooled into one bin left nothing to test. The tail is split by rank
    into bins of equal expected count: a correct round passes a real test, and a verifier that
    truncates the target's law (a top-k the target does not apply) fails it."""
    import torch

    from harness.contracts import Selection
    from harness.verifiers.builtin import MembershipVerifier

    wide = (*STAT, "model.tiny.vocab_size=4096")
    record = runner.run_job(compose_cfg(tmp_path / "run", workload, *wide), run_dir=tmp_path / "run")
    stat = record["gates"]["statistical"]
    assert stat["status"] == "passed" and stat["bins"] >= 3 and stat["p_value"] is not None
    assert stat["bin_tokens"][-1][-1].startswith("rank ") and stat["bin_tokens"][-1][-1].endswith("+")
    assert min(stat["expected"]) >= 5 and sum(stat["observed"]) == 400

    def truncated(self, tree, target_probs, rng):  # WRONG: the target's law cut to its likeliest 1,024 ids
        law = target_probs[0].clone()
        law[torch.topk(law, law.numel() - 1024, largest=False).indices] = 0.0
        return Selection(accepted_rows=(), next_token=int(rng.categorical(law / law.sum())))

    monkeypatch.setattr(MembershipVerifier, "select", truncated)
    run_dir = tmp_path / "wrong"
    with pytest.raises(GateError, match=r"gate 'statistical' failed for verifier 'membership'"):
        runner.run_job(compose_cfg(run_dir, workload, *wide), run_dir=run_dir)
    assert not (run_dir / "record.json").exists()


def test_the_tail_bins_are_fixed_by_the_law_and_count_every_sample():
    """Rank bins of about equal expected count, each at least 5, cut before any count is read; a
    token of zero mass is observed in the last; a tail too small for two bins stays one "other"."""
    import torch

    from harness.gates.statistical import chi2_bins

    p = torch.tensor([0.4] + [0.0] + [0.6 / 60] * 60, dtype=torch.float64)  # id 1 has no mass
    counts = {0: 80, 1: 3, **{t: 2 for t in range(2, 60)}}  # 80 + 3 + 116 = 199 of 200
    counts[61] = 1
    bins, expected, observed = chi2_bins([0], p, counts, 200)
    assert bins == [[0], ["rank 2-16"], ["rank 17-31"], ["rank 32-46"], ["rank 47+"]]
    assert expected == pytest.approx([80, 30, 30, 30, 30])
    assert observed == [80, 30, 30, 30, 3 + 26 + 1] and sum(observed) == 200
    # the top's pooled remainder opens the tail's first bin; a thin tail stays "other"
    p = torch.tensor([0.9, 0.01, 0.01] + [0.08 / 8] * 8, dtype=torch.float64)
    bins, expected, _ = chi2_bins([0, 1, 2], p, {}, 100)
    assert bins == [[0], [1, 2, "rank 4-6"], ["rank 7+"]] and expected == pytest.approx([90, 2 + 3, 5])
    bins, expected, _ = chi2_bins([0, 1, 2], p, {}, 60)
    assert bins == [[0], [1, 2, "other"]] and expected == pytest.approx([54, 1.2 + 4.8])


def test_the_drift_of_a_sampled_draft_tree_reads_as_an_upper_bound(tmp_path, workload, cache):
    """A draft whose children are i.i.d. draws: the first-token law given one drawn tree is not the
    emitted token's law (that is its average over the draw), so the record calls the figure a bound."""
    record = runner.run_job(
        compose_cfg(
            tmp_path / "run",
            workload,
            "proposer=draft_model",
            "topology=sequence",
            "verifier=typical",
            "generation.exact=false",
            "generation.temperature=0.7",
        ),
        run_dir=tmp_path / "run",
    )
    drift = record["metrics"]["drift"]
    assert record["config"]["proposer"]["sampling"] == "iid"
    assert drift["tree_sampled"] is True and drift["reads_as"] == "upper_bound" and drift["rounds"] >= 1


def test_skipping_the_statistical_gate_is_stated_in_the_record(tmp_path, workload, cache):
    record = runner.run_job(
        compose_cfg(tmp_path / "run", workload, *STAT, "gates.skip_statistical=true"), run_dir=tmp_path / "run"
    )
    assert record["gates"]["statistical"] == {"status": "skipped", "override": "gates.skip_statistical=true"}
    assert record["gated"] is False


# --------------------------------------------------------------------------- heuristic verifiers


def test_typical_allowed_explicitly_records_exact_false_and_its_drift(tmp_path, workload, cache):
    record = runner.run_job(
        compose_cfg(
            tmp_path / "run",
            workload,
            "proposer=prompt_lookup",
            "verifier=typical",
            "generation.exact=false",
            "generation.temperature=0.7",
        ),
        run_dir=tmp_path / "run",
    )
    assert record["exact"] is False
    assert json.loads((tmp_path / "run" / "record.json").read_text())["exact"] is False
    gates = record["gates"]
    assert set(gates) == set(GATES)
    for name in ("oracle", "end_to_end_oracle", "statistical"):  # no exactness claim to check
        assert gates[name]["status"] == "not_applicable" and "heuristic" in gates[name]["why"], name
    assert "drift" in gates["oracle"]["why"]
    drift = record["metrics"]["drift"]
    assert drift["metric"] == "first_token_total_variation" and "total variation" in drift["method"]
    assert drift["verifier"] == "typical" and drift["verifier_params"] == {"epsilon": 0.09, "delta": 0.3}
    # prompt lookup's tree is a function of the context: the figure is the divergence itself
    assert drift["tree_sampled"] is False and drift["reads_as"] == "divergence"
    assert drift["rounds"] == 8 and len(drift["per_round_tv"]) == 8
    assert 0.0 <= drift["min_tv"] <= drift["mean_tv"] <= drift["max_tv"] <= 1.0


def test_the_drift_starts_where_the_measurement_started_whatever_prompts_follow(tmp_path, cache):
    """The drift's rounds ran on the slot-0 proposer as the measurement left it: prompt lookup searched
    the outputs of every request in the job, so the figure changed with the prompts measured after
    the first two. It starts from the job's start now (no request remembered, nothing learned since),
    and its rounds leave the record's proposer counters as the measurement left them."""
    from harness.engine.arms import merge_extras

    prompts = [*PROMPTS, *({"id": f"q{k}", "prompt": f"x{k} = {k}\ny = x{k} + {k}\nx{k} = {k}\n"} for k in range(3))]
    drifts = []
    for n in (2, 5):
        path = tmp_path / f"p{n}.jsonl"
        path.write_text("\n".join(json.dumps(p) for p in prompts[:n]) + "\n")
        run_dir = tmp_path / f"run{n}"
        overrides = ["proposer=prompt_lookup", "proposer.history_tokens=4096", "topology=sequences"]
        overrides += ["verifier=typical", "generation.exact=false", "generation.temperature=0.7"]
        overrides += ["generation.max_new_tokens=16", "gates.oracle=false"]
        record = runner.run_job(compose_cfg(run_dir, path, *overrides), run_dir=run_dir)
        drifts.append(record["metrics"]["drift"]["per_round_tv"])
    assert drifts[0] == drifts[1]
    live = {"hist": [1, 2], "rounds": 3}
    merged = merge_extras([live])
    live["hist"].append(9)
    assert merged["hist"] == [1, 2]  # a copy: later rounds do not count into the record


def test_drift_of_typical_is_positive_on_a_peaked_target_and_matches_the_generic_enumeration():
    """The closed form used for `typical` equals enumerating its draws; on a peaked target the
    typical rule drifts (TV > 0) while an exact verifier's first-token law has TV 0."""
    import torch
    from omegaconf import OmegaConf

    from harness.contracts import Budget
    from harness.engine.build import Plan
    from harness.gates import drift as D
    from harness.gates.e2e import E2E_PROMPT, E2EModels, Float64Policy
    from harness.proposers.draft_model import DraftModelProposer
    from harness.verifiers import get_verifier

    models = E2EModels.build()
    policy = Float64Policy(temperature=1.0)
    budget = Budget(shape="expansion", max_nodes=4, max_depth=2, widths=(2, 1))
    proposer = DraftModelProposer(budget=budget, manifest_hash="t", policy=policy, backend=models.draft)
    typical, membership = get_verifier("typical"), get_verifier("membership")
    from harness.gates.e2e import propose_and_verify
    from harness.random_source import TorchRandomSource

    proposer.start(list(E2E_PROMPT))
    seq = models.target.prefill_one(list(E2E_PROMPT))
    _, tree, probs = propose_and_verify(
        target=models.target,
        seq=seq,
        proposer=proposer,
        policy=policy,
        committed=list(E2E_PROMPT),
        rng=TorchRandomSource(0),
    )
    closed = D.first_token_law(typical, tree, probs)

    from harness.verifiers.base import Verifier

    class Generic(Verifier):  # the same rule, not recognised as typical: goes through enumeration
        name, exact = "generic_typical", False
        probability_semantics, sampling_relations = typical.probability_semantics, typical.sampling_relations

        def select(self, tree, target_probs, rng):
            return typical.select(tree, target_probs, rng)

    generic = Generic()
    assert torch.allclose(D.first_token_law(generic, tree, probs), closed, atol=1e-12)
    assert torch.allclose(D.first_token_law(membership, tree, probs), probs[0].double(), atol=1e-12)
    cfg = OmegaConf.create({"seed": 0})
    items = [(None, list(E2E_PROMPT))]
    for verifier, positive in ((typical, True), (membership, False)):
        plan_ = Plan(policy=policy, budget=budget, capabilities=None, verifier=verifier, baseline_verifier=membership)
        out = D.heuristic_drift(cfg, plan_=plan_, backend=models.target, proposer=proposer, items=items, rounds=3)
        assert out["rounds"] == 3
        if positive:
            assert out["mean_tv"] > 1e-3
        else:
            assert out["max_tv"] < 1e-9


def test_an_unreadable_gate_cache_file_is_recomputed_and_replaced(tmp_path, monkeypatch):
    """Jobs of a sweep share the gate cache: a torn file (a job killed mid-write before writes were
    atomic, a full disk) is computed again and replaced, never read as a pass or a crash."""
    from harness.gates import stages

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return {"status": "passed", "max_abs_error": 0.0}

    first = stages._cached("oracle", "k1", True, compute)
    path = tmp_path / "gates" / "oracle-k1.json"
    assert first["cached"] is False and json.loads(path.read_text())["status"] == "passed"
    assert stages._cached("oracle", "k1", True, compute)["cached"] is True and len(calls) == 1
    path.write_text('{"status": "pas')  # torn
    again = stages._cached("oracle", "k1", True, compute)
    assert again["cached"] is False and len(calls) == 2 and json.loads(path.read_text())["status"] == "passed"
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temporary left beside it


def test_the_switched_off_line_names_only_gates_that_apply_to_the_run(capsys):
    from harness.config import compose
    from harness.engine.build import plan
    from harness.gates.stages import announce_disabled

    def announced(*overrides: str) -> str:
        cfg = compose(["model=tiny", *overrides])
        announce_disabled(cfg, plan(cfg))
        return capsys.readouterr().err

    line = announced("gates.enabled=false")
    assert "greedy_equality" in line and "statistical" not in line  # temperature 0: no sampled rounds
    line = announced("gates.enabled=false", "generation.temperature=0.7", "verifier=membership")
    assert "statistical" in line and "greedy_equality" not in line
    # top_k=1 at T > 0 is deterministic, and its rounds are sampled: both gates run, so both are named
    # (gates.statistical=false alone turned the run ungated with no line)
    line = announced("gates.enabled=false", "generation.temperature=0.7", "generation.top_k=1", "verifier=membership")
    assert "greedy_equality" in line and "statistical" in line
    line = announced(
        "gates.statistical=false", "generation.temperature=0.7", "generation.top_k=1", "verifier=membership"
    )
    assert line.startswith("harness: gate(s) statistical switched off by gates.statistical=false")
    # a heuristic verifier's oracles do not apply (the record says not_applicable): not announced,
    # and with nothing else switched off there is no line at all
    line = announced("gates.oracle=false", "verifier=typical", "generation.exact=false", "generation.temperature=0.7")
    assert line == ""


def test_a_test_whose_samples_all_took_one_way_to_their_first_token_says_what_it_did_not_exercise():
    from harness.gates.statistical import paths_note

    assert "correction after a rejection was not exercised" in paths_note(400, 400)
    assert "only the correction after a rejection was exercised" in paths_note(0, 400)
    assert paths_note(200, 400) is None and paths_note(0, 0) is None
    # one rejection in 400 samples (or one acceptance) leaves that way all but untested: said too
    assert paths_note(399, 400).startswith("only 1 of the 400 samples with a proposal rejected every proposed token")
    assert paths_note(1, 400).startswith("only 1 of the 400 samples with a proposal accepted a proposed token")
    assert paths_note(392, 400) is None and paths_note(8, 400) is None  # 2% each way: both exercised
    assert paths_note(0, 400, proposed=0) is None  # no tree had a candidate: nothing was rejected either


def test_chi_square_bins_hold_five_expected_samples_each_pooling_rare_tokens():
    """Each likely token is a bin while its expected count reaches 5; rarer ones are pooled in order,
    and a remainder under 5 joins the last bin (the approximation needs 5 per bin)."""
    import torch

    from harness.gates.statistical import chi2_bins

    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.015, 0.004, 0.001])  # token 7 outside the top
    counts = {0: 98, 1: 61, 2: 21, 3: 9, 4: 7, 5: 2, 6: 1, 7: 1}
    bins, expected, observed = chi2_bins(list(range(7)), p, counts, 200)
    assert bins == [[0], [1], [2], [3], [4, 5, 6, "other"]]
    assert expected == pytest.approx([100, 60, 20, 10, 6 + 3 + 0.8 + 0.2])
    assert observed == [98, 61, 21, 9, 7 + 2 + 1 + 1] and sum(observed) == 200
    # rare top tokens pooled into a bin of their own once they reach 5, the tail apart when it does
    p = torch.tensor([0.6, 0.02, 0.02, 0.012, 0.348])
    bins, expected, _ = chi2_bins([0, 1, 2, 3], p, {0: 300}, 500)
    assert bins == [[0], [1], [2], [3], ["other"]] and expected == pytest.approx([300, 10, 10, 6, 174], rel=1e-5)
    bins, expected, _ = chi2_bins([0, 1, 2, 3], p, {0: 60}, 100)
    assert bins == [[0], [1, 2, 3], ["other"]] and expected == pytest.approx([60, 5.2, 34.8], rel=1e-5)


def test_the_statistical_gate_compares_the_samples_with_the_law_the_round_samples():
    """The expected counts came from the policy decided in float64 while the round samples its float32
    law: at a top-p boundary the two keep different tokens (here float64 keeps a third token the round
    never draws), so a correct round could fail, or be tested against mass it cannot produce."""
    import math

    import torch

    from harness.gates.statistical import frontier_law
    from harness.verifiers.sampling import SamplingPolicy

    policy = SamplingPolicy(temperature=1.0, top_p=0.7)
    logits = torch.tensor([math.log(0.3), math.log(0.4), math.log(0.3)], dtype=torch.float32)
    assert (policy.probs(logits.double(), dtype=torch.float64) > 0).tolist() == [True, True, True]
    law = frontier_law(policy, logits)
    assert law.dtype == torch.float64 and (law > 0).tolist() == (policy.probs(logits) > 0).tolist() == [
        True,
        True,
        False,
    ]
