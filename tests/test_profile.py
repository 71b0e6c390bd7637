"""Hardware profile (for Sequoia's hardware-aware objective): t(n) with real tree masks, c0 and c,
provenance and staleness."""

from __future__ import annotations

import json

import pytest
import torch

from harness.prepare.profile import (
    PROFILE_MATCH_FIELDS,
    StaleArtifactError,
    artifact_hash,
    check_profile,
    cycle_prefix,
    measure_profile,
    plot_profile,
    profile_provenance,
    read_artifact,
    summarize_ms,
    write_artifact,
)
from harness.target.timing import heap_parents, timing_tree


def test_heap_shape_and_its_ancestor_mask():
    assert heap_parents(0) == []
    assert heap_parents(1) == [-1]
    assert heap_parents(4) == [-1, -1, 0, 0]  # root-inclusive node k under (k - 1) // 2
    assert heap_parents(6) == [-1, -1, 0, 0, 1, 1]
    tree = timing_tree(4, prefix_len=10, vocab=96)
    assert tree.parents.tolist() == [-1, -1, 0, 0] and tree.topology == "tree"
    assert tree.ancestor_mask[3].tolist() == [True, False, False, True]  # row 3 sees row 0 and itself
    assert tree.position_ids.tolist() == [10, 10, 11, 11]
    assert timing_tree(0, prefix_len=10, vocab=96) is None  # no candidate rows: t(1), one AR step


def test_summary_is_median_and_iqr():
    s = summarize_ms([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median_ms"], s["q25_ms"], s["q75_ms"], s["iqr_ms"]) == (3.0, 2.0, 4.0, 2.0)
    with pytest.raises(ValueError):
        summarize_ms([])


def test_cycle_prefix():
    assert cycle_prefix([4, 5, 6], 7) == [4, 5, 6, 4, 5, 6, 4]
    with pytest.raises(ValueError, match="at least one token"):
        cycle_prefix([], 4)


class CountingBackend:
    """Wraps a backend, recording (requests, rows per request) of every verify forward."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def verify(self, state, pending, trees):
        self.calls.append((len(trees), 1 + (trees[0].num_rows if trees[0] is not None else 0)))
        return self.backend.verify(state, pending, trees)


@pytest.fixture(scope="module")
def measured():
    from harness.target.backend import CausalLMBackend
    from harness.target.loading import build_tiny_model

    target = CountingBackend(CausalLMBackend(build_tiny_model(seed=0)))
    draft_model = build_tiny_model(seed=0)
    draft_model.model.layers = draft_model.model.layers[:1]
    draft_model.config.num_hidden_layers = 1
    draft = CausalLMBackend(draft_model)
    prefix = cycle_prefix([5, 17, 33, 8, 40], 32)
    prof = measure_profile(
        target_backend=target,
        draft_backend=draft,
        prefix_ids=prefix,
        max_nodes=5,
        warmup=1,
        repeats=3,
        provenance={"threads": torch.get_num_threads()},
        progress=False,
        max_depth=3,
    )
    return prof, target, draft, prefix


class DraftForwards:
    """Wraps a draft backend, recording (rows, positions, masked) of every forward and the cache
    length after it."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward_rows(self, seq, ids, positions, mask):
        out = self.backend.forward_rows(seq, ids, positions, mask)
        self.calls.append((len(ids), list(positions), mask is not None))
        return out


def test_draft_forwards_are_timed_as_a_tree_round_runs_them(measured):
    """The draft's pass over k = 1 .. max_depth + 1 committed tokens (a round after one that accepted
    k - 1), a one-row chain step and masked levels of r = 1 .. (max_nodes - 1) // 2 rows, each from the
    same cached prefix: a one-row unmasked forward priced every level and every first pass."""
    from harness.prepare.profile import draft_times

    _, _, draft, prefix = measured
    counting = DraftForwards(draft)
    out = draft_times(counting, prefix, feeds=4, level_rows=3, batch_size=2, warmup=1, repeats=2, progress=False)
    base = draft.prefill_one(prefix).cache_len  # the prefix the timed forwards start from
    feeds = {k: (k, list(range(base - k, base)), False) for k in range(1, 5)}
    levels = {r: (r, [base] * r, True) for r in range(1, 4)}
    expected = [*feeds.values(), (1, [base], False), *levels.values()]
    # 3 rounds (1 warm-up), each forward run once per request of the batch
    assert sorted(map(str, counting.calls)) == sorted(map(str, expected * 3 * 2))
    assert sorted(out["feed"]) == [1, 2, 3, 4] and sorted(out["level"]) == [1, 2, 3]
    assert all(len(v) == 2 for v in (*out["feed"].values(), *out["level"].values(), out["chain"]))
    with pytest.raises(ValueError, match="the draft's pass over 4 tokens needs a cached prefix of more"):
        draft_times(draft, prefix[:4], feeds=4, level_rows=1, batch_size=1, warmup=0, repeats=1, progress=False)


def test_profile_records_the_draft_forwards_by_size(measured):
    prof = measured[0]
    t1 = prof["t1_ms"]
    assert [f["tokens"] for f in prof["draft_feed_ms"]] == [1, 2, 3, 4]  # max_depth + 1
    assert [v["rows"] for v in prof["draft_level_ms"]] == [1, 2]  # (max_nodes - 1) // 2
    assert prof["draft_feed_cost"] == pytest.approx([f["median_ms"] / t1 for f in prof["draft_feed_ms"]])
    assert prof["draft_level_cost"] == pytest.approx([v["median_ms"] / t1 for v in prof["draft_level_ms"]])
    assert prof["draft_base_ms"]["samples_ms"] == prof["draft_feed_ms"][0]["samples_ms"]  # c0: one token


def test_profile_times_every_size_with_warmup_and_repeats(measured):
    prof, target, draft, prefix = measured
    # n = 1..5 verify forwards (pending + n - 1 rows), each once per round: 1 warm-up + 3 timed
    assert sorted(target.calls) == sorted([(1, n) for n in (1, 2, 3, 4, 5)] * 4)
    assert [v["n"] for v in prof["verify_ms"]] == [1, 2, 3, 4, 5]
    assert all(len(v["samples_ms"]) == 3 for v in prof["verify_ms"])
    assert len(prof["draft_base_ms"]["samples_ms"]) == 3 and len(prof["draft_step_ms"]["samples_ms"]) == 3
    assert prof["verify_cost"][0] == 1.0 and len(prof["verify_cost"]) == 5
    assert prof["t1_ms"] == prof["verify_ms"][0]["median_ms"] > 0
    for v, cost in zip(prof["verify_ms"], prof["verify_cost"]):
        assert cost == pytest.approx(v["median_ms"] / prof["t1_ms"])
        assert v["q25_ms"] <= v["median_ms"] <= v["q75_ms"]
    assert prof["draft_cost"] == pytest.approx(prof["draft_step_ms"]["median_ms"] / prof["t1_ms"])
    assert prof["draft_base_cost"] == pytest.approx(prof["draft_base_ms"]["median_ms"] / prof["t1_ms"])
    assert prof["synthetic"] is False


def test_profile_at_batch_two_times_one_batched_verify_per_size(measured):
    """At batch B the t(n) sample is ONE batched verify forward of B requests (the forward a batched
    round runs), and each draft cost sums B single-request draft forwards."""
    _, target, draft, prefix = measured
    before = len(target.calls)
    prof = measure_profile(
        target_backend=target,
        draft_backend=draft,
        prefix_ids=prefix,
        max_nodes=3,
        warmup=1,
        repeats=2,
        provenance={},
        progress=False,
        batch_size=2,
    )
    assert sorted(target.calls[before:]) == sorted([(2, 1), (2, 2), (2, 3)] * 3)  # no batch-1 verify was timed
    assert prof["batch_size"] == 2 and "batch 2" in prof["notes"]["batch"]
    assert [v["n"] for v in prof["verify_ms"]] == [1, 2, 3] and prof["verify_cost"][0] == 1.0
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        measure_profile(
            target_backend=target,
            draft_backend=draft,
            prefix_ids=prefix,
            max_nodes=2,
            warmup=1,
            repeats=1,
            provenance={},
            progress=False,
            batch_size=0,
        )


def test_profile_needs_a_draft_model_and_sane_settings(measured):
    _, target, _, prefix = measured
    with pytest.raises(ValueError, match="needs a separate draft"):
        measure_profile(
            target_backend=target,
            draft_backend=None,
            prefix_ids=prefix,
            max_nodes=2,
            warmup=1,
            repeats=1,
            provenance={},
            progress=False,
        )
    with pytest.raises(ValueError, match="repeats must be an integer >= 1; got 0"):
        measure_profile(
            target_backend=target,
            draft_backend=target,
            prefix_ids=prefix,
            max_nodes=2,
            warmup=1,
            repeats=0,
            provenance={},
            progress=False,
        )


def test_artifact_hash_verifies_and_edits_are_refused(measured, tmp_path):
    prof = measured[0]
    stored = write_artifact(prof, tmp_path / "p.json")
    assert stored["hash"] == artifact_hash(stored) == read_artifact(tmp_path / "p.json", kind=prof["kind"])["hash"]
    data = json.loads((tmp_path / "p.json").read_text())
    data["draft_cost"] = 0.0
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(StaleArtifactError, match="does not verify"):
        read_artifact(tmp_path / "p.json", kind=prof["kind"])
    with pytest.raises(StaleArtifactError, match="is not a sequoia_tree artifact"):
        read_artifact(tmp_path / "p.json", kind="sequoia_tree")


def _expected():
    from harness.app import with_sequoia
    from harness.config import compose

    return profile_provenance(compose(with_sequoia(["model=tiny", "proposer=draft_model", "topology.max_nodes=4"])))


def test_run_provenance_has_every_field():
    exp = _expected()
    assert set(PROFILE_MATCH_FIELDS) <= set(exp)
    assert exp["dtype"] == "float32" and exp["device"] == "cpu" and exp["batch_size"] == 1
    assert exp["threads"] == torch.get_num_threads() == 1
    assert exp["attn_implementation"] == "sdpa"
    # the default derived draft of a 2-layer tiny target keeps both layers
    draft = exp["model"]["draft"]
    assert exp["model"]["target"]["name"] == "tiny" and draft["name"] == "derived" and draft["num_layers"] == 2
    assert exp["measurement"] == {
        "protocol": 3,
        "prefix_len": 256,
        "warmup": 2,
        "repeats": 7,
        "max_nodes": 5,
        "max_depth": 4,  # topology.max_depth=6, but a tree of topology.max_nodes=4 rows is at most 4 deep
    }
    assert exp["checkpoints"] == {"target": None, "draft": None}  # built models: their config is their identity
    assert exp["model"]["draft_device"] == "cpu" and exp["model"]["draft_attn_implementation"] == "sdpa"


def test_the_profile_key_follows_the_checkpoint_files_the_draft_and_the_code(tmp_path, monkeypatch):
    """New weights at the same path, a draft on another attention path and a change to the timed code each
    make another profile (and calibration) key: each was reused before, so the run read old timings."""
    from checkpoint_fixtures import tiny_checkpoint

    from harness.app import with_sequoia
    from harness.config import compose
    from harness.gates import keys
    from harness.prepare.calibrate import CALIBRATION_MATCH_FIELDS, calibration_provenance
    from harness.prepare.profile import key_hash

    draft = tiny_checkpoint(tmp_path / "draft", seed=1)
    over = ["model=tiny", "proposer=draft_model", "proposer.model.name=hf", f"proposer.model.name_or_path={draft}"]

    def keys_now(extra=()):
        cfg = compose(with_sequoia([*over, *extra]))
        prof = profile_provenance(cfg)
        cal = calibration_provenance(cfg, tokenizer=None, items=[])
        return (
            key_hash({k: prof.get(k) for k in PROFILE_MATCH_FIELDS}),
            key_hash({k: cal.get(k) for k in CALIBRATION_MATCH_FIELDS}),
        )

    before = keys_now()
    assert keys_now() == before
    tiny_checkpoint(draft, seed=2)  # other weights, same files
    reweighted = keys_now()
    assert reweighted[0] != before[0] and reweighted[1] != before[1]
    assert keys_now(["proposer.model.attn_implementation=eager"])[0] != reweighted[0]

    edited = tmp_path / "backend.py"  # the verify forward's module, one line longer
    edited.write_text(keys.module_file("harness.target.backend").read_text() + "\n# edited\n")
    real = keys.module_file
    monkeypatch.setattr(keys, "module_file", lambda name: edited if name == "harness.target.backend" else real(name))
    recoded = keys_now()
    assert recoded[0] != reweighted[0] and recoded[1] != reweighted[1]


def test_configurations_that_search_the_same_trees_share_a_profile():
    """The profile times the draft's pass over 1 .. depth + 1 tokens for the deepest tree searched,
    min(topology.max_depth, topology.max_nodes): its key holds that depth, so max_depth=30 and
    max_depth=4 at max_nodes=4 (the same trees) share one profile, and max_depth=3 has its own."""
    from harness.app import with_sequoia
    from harness.config import compose
    from harness.prepare.profile import key_hash

    def provenance(depth: int) -> dict:
        over = ["model=tiny", "proposer=draft_model", "topology.max_nodes=4", f"topology.max_depth={depth}"]
        return profile_provenance(compose(with_sequoia(over)))

    def key(prov: dict) -> str:
        return key_hash({k: prov.get(k) for k in PROFILE_MATCH_FIELDS})

    four, thirty, three = provenance(4), provenance(30), provenance(3)
    assert four["measurement"]["max_depth"] == thirty["measurement"]["max_depth"] == 4
    assert key(four) == key(thirty) and four == thirty
    assert three["measurement"]["max_depth"] == 3 and key(three) != key(four)


def test_the_provenance_takes_the_thread_count_the_run_will_set():
    """A check made before the run sets its thread count compares the profile with that count, not
    with the process's count at the time of the check."""
    from harness.app import with_sequoia
    from harness.config import compose

    cfg = compose(with_sequoia(["model=tiny", "proposer=draft_model", "topology.max_nodes=4"]))
    assert profile_provenance(cfg, threads=3)["threads"] == 3
    assert profile_provenance(cfg)["threads"] == torch.get_num_threads()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dtype", "bfloat16", r"dtype differs \(dtype: artifact 'bfloat16', this run 'float32'\)"),
        ("threads", 2, r"threads differs \(threads: artifact 2, this run 1\)"),
        ("attn_implementation", "eager", "attn_implementation differs"),
        ("batch_size", 4, "batch_size differs"),
        ("device", "cuda:0", "device differs"),
    ],
)
def test_stale_profile_is_refused_naming_the_field(field, value, message):
    exp = _expected()
    profile = {"verify_cost": [1.0] * 5, "synthetic": False, "provenance": {**exp, field: value}}
    check_profile({**profile, "provenance": exp}, exp, path="p", max_nodes=5)
    with pytest.raises(StaleArtifactError, match=message):
        check_profile(profile, exp, path="p", max_nodes=5)


def test_stale_library_version_names_the_library():
    exp = _expected()
    old = {**exp, "library_versions": {**exp["library_versions"], "torch": "1.0.0"}}
    with pytest.raises(
        StaleArtifactError, match=r"library_versions differs \(library_versions.torch: artifact '1.0.0'"
    ):
        check_profile({"verify_cost": [1.0] * 5, "synthetic": False, "provenance": old}, exp, path="p", max_nodes=5)


def test_a_stale_profile_refusal_ends_with_the_remedy_given():
    exp = _expected()
    stale = {"verify_cost": [1.0] * 5, "synthetic": False, "provenance": {**exp, "threads": 2}}
    with pytest.raises(StaleArtifactError, match=r"artifact 2, this run 1\); re-run `harness calibrate` with the run"):
        check_profile(stale, exp, path="p", max_nodes=5)
    with pytest.raises(StaleArtifactError, match=r"artifact 2, this run 1\); give another$"):
        check_profile(stale, exp, path="p", max_nodes=5, remedy="give another")
    # only the fields named are compared
    check_profile(stale, exp, path="p", max_nodes=5, fields=[f for f in PROFILE_MATCH_FIELDS if f != "threads"])


def test_synthetic_or_short_profiles_are_refused():
    exp = _expected()
    with pytest.raises(StaleArtifactError, match="synthetic"):
        check_profile({"verify_cost": [1.0] * 5, "synthetic": True, "provenance": exp}, exp, path="p", max_nodes=5)
    with pytest.raises(StaleArtifactError, match=r"gives t\(1..3\); the search needs t\(1..5\)"):
        check_profile({"verify_cost": [1.0] * 3, "synthetic": False, "provenance": exp}, exp, path="p", max_nodes=5)


def test_plot_writes_a_png(measured, tmp_path):
    path = plot_profile(measured[0], tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_profile_named_by_path_measured_by_other_code_is_used_and_said(capsys):
    """The cache keys profiles by the timed code's source, so another build measures again; a profile a
    run names by path (topology.profile_artifact) is the user's choice: used, with a note, not refused."""
    exp = _expected()
    profile = {"verify_cost": [1.0] * 5, "synthetic": False, "provenance": {**exp, "code": "0" * 16}}
    check_profile(profile, exp, path="p.json", max_nodes=5)
    assert "hardware profile 'p.json' was measured by other harness code (code '0000000000000000'" in (
        capsys.readouterr().err
    )
    with pytest.raises(StaleArtifactError, match="threads differs"):
        check_profile({**profile, "provenance": {**profile["provenance"], "threads": 64}}, exp, path="p", max_nodes=5)
