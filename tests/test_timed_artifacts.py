"""Cached artifacts chosen or priced by timings (Sequoia's hardware profile, the layer-skip vector)
record how many sweep jobs shared the machine while they were timed (``concurrent_jobs``). A run
beside fewer jobs than that measures the artifact again in its place, as a sweep times a record again;
one timed alone serves any run; one that records no count is measured again by a run alone. The
record says the count of the artifact it used, and a record whose job ran beside fewer jobs than its
artifact was timed under is no complete job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SEQUOIA_SMALL_TREE, build_context_of

from harness.app import calibrate_main, with_sequoia
from harness.config import compose as compose_config
from harness.heads.artifacts import skip_artifact_path
from harness.heads.checkpoint import ArtifactError, save_artifact
from harness.prepare.profile import StaleArtifactError, contention_problem, write_artifact
from harness.prepare.skip_search import ensure_skip
from harness.prepare.trained import noting_outcomes
from harness.target.backend import CausalLMBackend
from harness.target.loading import build_tiny_model
from harness.tracking import job_folder

SMALL_TREE = SEQUOIA_SMALL_TREE


def test_the_rule_never_lets_a_contended_timing_price_a_run_alone():
    assert contention_problem(2, 1) == "it was timed while 2 jobs ran at once, and this run is alone"
    assert contention_problem(4, 2) == "it was timed while 4 jobs ran at once, and this run is one of 2"
    assert contention_problem(1, 1) is None and contention_problem(1, 4) is None and contention_problem(2, 2) is None
    assert "records no count" in contention_problem(None, 1)  # unknown: measured again by a run alone
    assert contention_problem(None, 2) is None  # a run beside other jobs is itself timed under contention


def _rewrite_profile(path: Path, out: Path | None = None, **concurrency) -> Path:
    """The profile at ``path`` with ``provenance.concurrent_jobs`` set (or, given None, removed), re-hashed."""
    profile = json.loads(path.read_text())
    for key, value in concurrency.items():
        if value is None:
            profile["provenance"].pop(key, None)
        else:
            profile["provenance"][key] = value
    out = out or path
    write_artifact({k: v for k, v in profile.items() if k != "hash"}, out)
    return out


def test_a_cached_profile_timed_beside_more_jobs_is_measured_again_for_a_run_beside_fewer(
    tmp_path, monkeypatch, capsys
):
    """A sweep of 2 jobs at once profiled the hardware; a relaunch of 1 at a time timed its records
    again but chose their trees from that profile, and recorded concurrent_jobs 1."""
    from harness.prepare.sequoia import check_profile_config, ensure_tree_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert calibrate_main(SMALL_TREE) == 0  # `harness calibrate` runs alone
    out = json.loads(capsys.readouterr().out)
    prof = Path(out["sequoia_profile"])
    assert json.loads(prof.read_text())["provenance"]["concurrent_jobs"] == 1 and out["profile_concurrent_jobs"] == 1
    contended = json.loads(_rewrite_profile(prof, concurrent_jobs=2).read_text())["hash"]  # as 2 at once wrote it

    alone, shared = (
        compose_config(with_sequoia(SMALL_TREE)),
        compose_config(with_sequoia([*SMALL_TREE, "concurrent_jobs=2"])),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the runs' threads=1, as the provenance compares it
        context = build_context_of(shared)
        arts = ensure_tree_artifact(shared, context, progress=False)  # as many at once: reused
        assert arts.stages["profile"] == "loaded (cache)" and arts.profile["hash"] == contended
        assert arts.metrics()["sequoia_profile_concurrent_jobs"] == 2  # the record says it
        arts = ensure_tree_artifact(alone, context, progress=False)  # alone: measured again, in its place
        assert arts.stages["profile"] == "measured" and arts.stages["tree"] == "built"
        assert arts.profile_path == prof and arts.profile["hash"] != contended
        assert (
            arts.profile["provenance"]["concurrent_jobs"] == 1
            and arts.metrics()["sequoia_profile_concurrent_jobs"] == 1
        )
        assert "again: it was timed while 2 jobs ran at once, and this run is alone" in capsys.readouterr().err
        assert (
            ensure_tree_artifact(shared, context, progress=False).stages["profile"] == "loaded (cache)"
        )  # timed alone
        # a profile that records no count: a run beside other jobs uses it, a run alone measures it again
        _rewrite_profile(prof, concurrent_jobs=None)
        assert ensure_tree_artifact(shared, context, progress=False).stages["profile"] == "loaded (cache)"
        arts = ensure_tree_artifact(alone, context, progress=False)
        assert arts.stages["profile"] == "measured" and arts.profile["provenance"]["concurrent_jobs"] == 1
    finally:
        torch.set_num_threads(threads)

    # a profile topology.profile_artifact names is refused, not replaced
    named = _rewrite_profile(prof, tmp_path / "named.json", concurrent_jobs=2)
    given = ["topology=sequoia", *SMALL_TREE, f"topology.profile_artifact={named}"]
    with pytest.raises(StaleArtifactError, match=r"timed while 2 jobs ran at once, and this run is alone; drop "):
        check_profile_config(compose_config(given))
    check_profile_config(compose_config([*given, "concurrent_jobs=2"]))


def test_a_cached_calibration_or_profile_cut_short_or_edited_is_measured_again(tmp_path, monkeypatch, capsys):
    """A cached Sequoia calibration or profile that does not read (cut short by a full disk, edited by
    hand) was refused on every later run, naming a file in the cache the user never chose; it is
    measured again in its place, with a note, and the broken file is not put back when a later stage
    refuses. One that ``topology.<name>_artifact`` names is still refused."""
    from harness.prepare import sequoia
    from harness.prepare.profile import read_artifact
    from harness.prepare.sequoia import ensure_tree_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert calibrate_main(SMALL_TREE) == 0
    out = json.loads(capsys.readouterr().out)
    cal, prof = Path(out["sequoia_calibration"]), Path(out["sequoia_profile"])
    cfg = compose_config(with_sequoia(SMALL_TREE))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        context = build_context_of(cfg)
        cal.write_bytes(cal.read_bytes()[:100])  # cut short
        edited = json.loads(prof.read_text())
        edited["note"] = "edited by hand"
        prof.write_text(json.dumps(edited))  # the hash no longer verifies
        arts = ensure_tree_artifact(cfg, context, progress=False)
        assert arts.stages == {"calibration": "measured", "profile": "measured", "tree": "built"}
        err = capsys.readouterr().err
        assert f"measuring the cached Sequoia calibration {str(cal)!r} again: cannot read" in err
        assert f"measuring the cached Sequoia hardware profile {str(prof)!r} again" in err and "does not verify" in err
        read_artifact(cal, kind=sequoia.CALIBRATION_KIND)
        read_artifact(prof, kind=sequoia.PROFILE_KIND)
        assert ensure_tree_artifact(cfg, context, progress=False).stages == {
            "calibration": "loaded (cache)",
            "profile": "loaded (cache)",
            "tree": "loaded (cache)",
        }
        # cut short again, and the tree search then refuses: the new measurement stays, not the broken file
        cal.write_bytes(cal.read_bytes()[:100])

        def refuse(**_):
            raise ValueError("the hardware-aware choice is plain autoregressive decoding (n = 1)")

        monkeypatch.setattr(sequoia, "build_tree_artifact", refuse)
        with pytest.raises(ValueError, match="plain autoregressive"):
            ensure_tree_artifact(cfg, context, progress=False)
        read_artifact(cal, kind=sequoia.CALIBRATION_KIND)
        # a named calibration that does not read is refused, not replaced
        named = tmp_path / "named.json"
        named.write_bytes(cal.read_bytes()[:100])
        with pytest.raises(StaleArtifactError, match="cannot read sequoia_calibration artifact"):
            ensure_tree_artifact(
                compose_config(with_sequoia([*SMALL_TREE, f"topology.calibration_artifact={named}"])),
                context,
                progress=False,
            )
        assert len(named.read_bytes()) == 100
    finally:
        torch.set_num_threads(threads)


def test_a_named_calibration_builds_a_tree_of_its_own_and_leaves_the_cached_one(tmp_path, monkeypatch, capsys):
    """The cached tree was keyed by the configuration, not by the calibration and profile it was built
    from: a run naming another calibration rebuilt the default configuration's tree file in place (its
    records then pointed at a tree that binds another calibration), and the next default run rebuilt it
    back."""
    from harness.prepare.sequoia import ensure_tree_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert calibrate_main(SMALL_TREE) == 0
    out = json.loads(capsys.readouterr().out)
    cal, tree = Path(out["sequoia_calibration"]), Path(out["sequoia_tree"])
    tree_bytes = tree.read_bytes()
    named = json.loads(cal.read_text())
    named["note"] = "another calibration of the same configuration"
    write_artifact({k: v for k, v in named.items() if k != "hash"}, tmp_path / "named.json")
    cfg = compose_config(with_sequoia(SMALL_TREE))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        context = build_context_of(cfg)
        other = ensure_tree_artifact(
            compose_config(with_sequoia([*SMALL_TREE, f"topology.calibration_artifact={tmp_path / 'named.json'}"])),
            context,
            progress=False,
        )
        assert other.stages["tree"] == "built" and other.tree_path != tree
        assert other.tree["calibration_hash"] == json.loads((tmp_path / "named.json").read_text())["hash"]
        assert tree.read_bytes() == tree_bytes  # the default configuration's tree, untouched
        again = ensure_tree_artifact(cfg, context, progress=False)
        assert again.stages["tree"] == "loaded (cache)" and again.tree_path == tree
    finally:
        torch.set_num_threads(threads)


def test_a_cached_skip_vector_timed_beside_more_jobs_is_searched_again_for_a_run_beside_fewer(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    backend = CausalLMBackend(build_tiny_model(seed=1, num_layers=4))
    opts = {"search": {"trials": 2, "prompts": 1, "max_new_tokens": 4, "depth": 2, "gamma": 0.0}}

    def run(jobs: int, **options):
        with noting_outcomes() as outcomes:
            _, manifest = ensure_skip(
                {**opts, **options},
                backend=backend,
                tokenizer=None,
                target_source="t",
                prompts=[[5, 9, 13, 7, 22, 31]],
                progress=False,
                concurrent_jobs=jobs,
            )
        return [outcome for outcome, _ in outcomes], manifest

    outcome, first = run(2)
    assert outcome == ["trained"] and first["search"]["concurrent_jobs"] == 2  # the record's artifact entry says it
    assert run(2)[0] == ["loaded"] and run(3)[0] == ["loaded"]
    with pytest.raises(
        ArtifactError, match="timed while 2 jobs ran at once, and this run is alone; proposer.auto_train"
    ):
        run(1, auto_train=False)
    outcome, again = run(1)
    assert outcome == ["trained"] and again["search"]["concurrent_jobs"] == 1
    assert again["artifact_id"] != first["artifact_id"]
    assert run(2)[0] == ["loaded"]  # timed alone: serves a run beside other jobs
    # a vector that records no count: a run beside other jobs uses it, a run alone searches it again
    _, path = skip_artifact_path(opts, model=backend.model, tokenizer=None, prompts=[[5, 9, 13, 7, 22, 31]])
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["search"]["concurrent_jobs"]
    save_artifact(path, manifest={k: v for k, v in manifest.items() if k != "artifact_id"})
    assert run(2)[0] == ["loaded"] and run(1)[0] == ["trained"]


def test_a_record_whose_job_ran_beside_fewer_jobs_than_its_timed_artifact_is_no_complete_job(tmp_path, monkeypatch):
    """A record of a job alone that stands on a profile or skip vector timed beside 2 jobs is measured again."""
    monkeypatch.setattr(job_folder, "_cached_artifact_id", lambda entry: entry["artifact_id"])
    profile = tmp_path / "profile-abc.json"

    def record(ran: int, measured: int | None) -> dict:
        search = {} if measured is None else {"concurrent_jobs": measured}
        provenance = {} if measured is None else {"concurrent_jobs": measured}
        profile.write_text(json.dumps({"hash": "p1", "provenance": provenance}))
        return {
            "metrics": {"concurrent_jobs": ran},
            "config": {"proposer": {}},
            "artifacts": {
                "sequoia_profile": str(profile),
                "sequoia_profile_hash": "p1",
                "proposer_artifact": {
                    "kind": "layer_skip",
                    "artifact_id": "v1",
                    "recipe": {"trials": 2},
                    "target_hash": "t",
                    "search": search,
                },
            },
        }

    assert job_folder.measured_artifact_change(record(1, 2)) == (
        f"its sequoia_profile artifact {profile} was timed while 2 jobs ran at once, and its job ran alone: "
        "the job would measure it again"
    )
    assert job_folder.cached_artifact_change(record(1, 2)) == (
        "its layer_skip artifact v1 was timed while 2 jobs ran at once, and its job ran alone: the job would search "
        "it again"
    )
    assert "as one of 2" in job_folder.measured_artifact_change(record(2, 4))
    for ran, measured in ((2, 2), (2, 1), (1, 1), (1, None)):
        assert job_folder.measured_artifact_change(record(ran, measured)) is None
        assert job_folder.cached_artifact_change(record(ran, measured)) is None
