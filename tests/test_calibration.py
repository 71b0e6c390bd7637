"""Sequoia calibration: positional acceptance from the run's own proposer, verifier
and decode loop on the calibration split; statistics, validation, provenance and `harness calibrate`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import SEQUOIA_SMALL_TREE, SEQUOIA_TINY, build_context_of

from harness.app import calibrate_main as main
from harness.app import with_sequoia
from harness.config import compose as compose_config
from harness.contracts import NO_STATE, ProposalNode, ProposalResult, Selection
from harness.prepare.calibrate import (
    CalibrationError,
    acceptance_statistics,
    accepted_rank,
    calibration_items,
    calibration_provenance,
    check_calibration,
    check_disjoint,
    run_calibration,
)
from harness.prepare.profile import StaleArtifactError
from harness.topology.compiler import compile_tree
from harness.topology.sequoia import wilson_interval
from harness.workloads.prompts import Prompt


def compose(overrides):
    return compose_config(with_sequoia(overrides))


TINY = SEQUOIA_TINY

SMALL_TREE = SEQUOIA_SMALL_TREE


# ---------------------------------------------------------------- statistics


def test_toy_rates_recovered_from_ranks():
    # 31250 parents whose accepted ranks realise h = [0.82, 0.48, 0.24] exactly (hardware-aware toy)
    ranks = [1] * 25625 + [2] * 2700 + [3] * 702 + [0] * 2223
    s = acceptance_statistics(ranks, branches=3)
    assert s["parents"] == 31250
    assert s["tested"] == [31250, 5625, 2925]  # parents reaching rank j (earlier siblings rejected)
    assert s["accepted"] == [25625, 2700, 702]
    assert s["h"] == pytest.approx([0.82, 0.48, 0.24], abs=1e-15)
    assert s["acceptance"] == pytest.approx([0.82, 0.0864, 0.022464], abs=1e-15)  # not h: sum 0.928864 <= 1
    assert s["sibling_mass"] == pytest.approx(0.928864, abs=1e-12)
    assert s["none_accepted"] == 2223
    assert s["h_wilson"][1] == pytest.approx(list(wilson_interval(2700, 5625)))
    assert s["acceptance_wilson"][2] == pytest.approx(list(wilson_interval(702, 31250)))
    for (lo, hi), v in zip(s["acceptance_wilson"], s["acceptance"]):
        assert lo < v < hi


def test_statistics_refuse_bad_ranks():
    with pytest.raises(ValueError, match=r"ranks must be in \[0, 2\]"):
        acceptance_statistics([1, 3], branches=2)
    with pytest.raises(ValueError, match="no parent nodes"):
        acceptance_statistics([], branches=2)


def test_unreached_ranks_have_no_interval():
    s = acceptance_statistics([1, 1, 1], branches=2)
    assert s["tested"] == [3, 0] and s["h"] == [1.0, 0.0] and s["h_wilson"][1] is None
    assert s["acceptance"] == [1.0, 0.0]


def _set_tree(tokens):
    nodes = tuple(ProposalNode(token_id=t, parent=-1, q=0.25, source="d") for t in tokens)
    laws = torch.full((len(tokens), 4), 0.25)
    prop = ProposalResult(
        nodes=nodes,
        probability_semantics="normalized_conditional",
        sampling_relation="iid",
        topology="set",
        state_handle=NO_STATE,
        manifest_hash="h",
        q_dists=laws,
    )
    return compile_tree([prop], prefix_len=3)


def test_accepted_rank_is_the_first_draw_of_the_accepted_row():
    tree = _set_tree([2, 0, 2, 3])  # draws: 2, 0, 2 (merged into row 0), 3 -> rows 0, 1, 0, 2
    assert accepted_rank(tree, Selection(accepted_rows=(0,), next_token=1)) == 1
    assert accepted_rank(tree, Selection(accepted_rows=(1,), next_token=1)) == 2
    assert accepted_rank(tree, Selection(accepted_rows=(2,), next_token=1)) == 4  # not 3: the 3rd draw repeats 2
    assert accepted_rank(tree, Selection(accepted_rows=(), next_token=1)) == 0


# ---------------------------------------------------------------- calibration prompts


def _items(ids_by_name):
    return [(Prompt(prompt_id=k, category="c", text=k), list(v)) for k, v in ids_by_name.items()]


def test_calibration_must_be_disjoint_from_evaluation():
    check_disjoint(_items({"a": [1, 2]}), _items({"b": [3, 4]}))
    with pytest.raises(CalibrationError, match="'a' is also an evaluation prompt"):
        check_disjoint(_items({"a": [1, 2]}), _items({"a": [3, 4]}))
    with pytest.raises(CalibrationError, match="'c' is also an evaluation prompt"):
        check_disjoint(_items({"c": [1, 2]}), _items({"d": [1, 2]}))  # same tokens, another id


def test_jsonl_workload_without_splits_is_refused(tmp_path):
    from harness.workloads.conversations import encode_workload

    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "x", "prompt": "def f():"}\n{"id": "y", "prompt": "class A:"}\n')
    cfg = compose(TINY + ["workload=jsonl", f"workload.path={path}", "workload.chat=false"])
    with pytest.raises(CalibrationError, match="'x' is also an evaluation prompt"):
        check_disjoint(calibration_items(cfg, None), encode_workload(cfg, None))
    path.write_text(
        '{"id": "x", "prompt": "def f():", "split": "calibration"}\n'
        '{"id": "y", "prompt": "class A:", "split": "eval"}\n'
    )
    cal = calibration_items(cfg, None)
    assert [p.prompt_id for p, _ in cal] == ["x"]
    check_disjoint(cal, encode_workload(cfg, None))
    with pytest.raises(CalibrationError, match="workload.split=calibration"):
        calibration_items(compose(TINY + ["workload.split=calibration"]), None)


# ---------------------------------------------------------------- the stage on tiny models


@pytest.fixture(scope="module")
def identical_draft():
    cfg = compose(TINY)  # model=tiny has 2 layers: the draft's "first 6 layers" is the whole target
    return cfg, build_context_of(cfg)


def test_calibration_with_an_identical_draft_accepts_the_first_sibling(identical_draft):
    cfg, ctx = identical_draft
    items = calibration_items(cfg, None)
    prov = calibration_provenance(cfg, tokenizer=None, items=items)
    art = run_calibration(cfg, ctx, items=items, provenance=prov, progress=False)
    assert art["parents"] >= 20 and art["branches"] == 3
    # q == p (up to float rounding across batch shapes): the rank-1 draw is accepted with probability ~1
    assert art["acceptance"][0] >= 0.95
    assert art["sibling_mass"] <= 1.0
    assert art["provenance"]["sampling_policy"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "relation": "without_replacement",
    }
    assert art["provenance"]["calibration_data"]["split"] == "calibration"
    assert len(art["acceptance_wilson"]) == 3
    check_calibration({**art, "hash": "x"}, prov, path="a")


def test_a_prompts_last_round_drafts_nothing_and_is_no_parent_node(identical_draft):
    """With one token left a round drafts no sibling (the loop cuts the tree to nothing): it was
    counted as a parent node whose siblings were all rejected, so every prompt whose decode ended on
    such a round (an odd max_new_tokens here) pulled p_1 down from ~1 to ~0.83."""
    _, ctx = identical_draft
    for new in (10, 9):
        cfg = compose(TINY + [f"topology.calibration.max_new_tokens={new}", "topology.calibration.parents=20"])
        items = calibration_items(cfg, None)
        prov = calibration_provenance(cfg, tokenizer=None, items=items)
        art = run_calibration(cfg, ctx, items=items, provenance=prov, progress=False)
        assert art["parents"] >= 20 and art["none_accepted"] == 0 and art["acceptance"][0] >= 0.95, (new, art)
    assert prov["method"] == "parents: rounds with the full sibling set"  # in the cache key: older ones re-measured


def test_weak_draft_gives_a_valid_acceptance_vector():
    cfg = compose(TINY + ["proposer.model.num_layers=1", "topology.calibration.parents=40"])
    ctx = build_context_of(cfg)
    items = calibration_items(cfg, None)
    art = run_calibration(
        cfg, ctx, items=items, provenance=calibration_provenance(cfg, tokenizer=None, items=items), progress=False
    )
    p = art["acceptance"]
    assert sum(art["accepted"]) + art["none_accepted"] == art["parents"] >= 40
    assert 0.0 < sum(p) <= 1.0
    assert p == pytest.approx([a / art["parents"] for a in art["accepted"]])


def test_too_few_parent_nodes_fail_the_stage(identical_draft):
    _, ctx = identical_draft
    cfg = compose(
        TINY
        + [
            "topology.calibration.parents=100000",
            "topology.calibration.prompts=1",
            "topology.calibration.max_new_tokens=3",
        ]
    )
    items = calibration_items(cfg, None)
    with pytest.raises(
        CalibrationError,
        match=r"measured \d+ parent nodes on all 1 calibration prompts; "
        r"topology.calibration.parents=100000 are required",
    ):
        run_calibration(cfg, ctx, items=items, provenance={}, progress=False)


def test_stored_calibration_is_checked_against_the_run(identical_draft):
    cfg, _ = identical_draft
    items = calibration_items(cfg, None)
    prov = calibration_provenance(cfg, tokenizer=None, items=items)
    art = {"kind": "sequoia_calibration", "acceptance": [0.82, 0.0864, 0.022464], "provenance": prov}
    check_calibration(art, prov, path="a")
    hot = calibration_provenance(compose(TINY + ["generation.temperature=1.0"]), tokenizer=None, items=items)
    with pytest.raises(
        StaleArtifactError,
        match=r"sampling_policy differs \(sampling_policy.temperature: "
        r"artifact 0.7, this run 1.0\)",
    ):
        check_calibration(art, hot, path="a")
    other_data = calibration_provenance(cfg, tokenizer=None, items=items[:1])
    with pytest.raises(StaleArtifactError, match="calibration_data differs"):
        check_calibration(art, other_data, path="a")
    # conditional rates stored where selected-child probabilities belong: refused with the reason
    with pytest.raises(StaleArtifactError, match=r"sum\(p\) must be <= 1.*conditional sibling rates"):
        check_calibration({**art, "acceptance": [0.82, 0.48, 0.24]}, prov, path="a")


# ---------------------------------------------------------------- `harness calibrate`


def test_harness_calibrate_writes_the_artifacts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    rc = main(SMALL_TREE)
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages"] == {"calibration": "measured", "profile": "measured", "tree": "built"}
    for key in ("sequoia_tree", "sequoia_calibration", "sequoia_profile", "sequoia_profile_plot"):
        assert Path(out[key]).exists() and Path(out[key]).parent == tmp_path / "sequoia"
    tree = json.loads(Path(out["sequoia_tree"]).read_text())
    cal = json.loads(Path(out["sequoia_calibration"]).read_text())
    prof = json.loads(Path(out["sequoia_profile"]).read_text())
    assert tree["calibration_hash"] == cal["hash"] and tree["profile_hash"] == prof["hash"]
    # the summary (a run's record artifacts) holds the hash of each artifact it used
    assert (out["sequoia_tree_hash"], out["sequoia_calibration_hash"], out["sequoia_profile_hash"]) == (
        tree["hash"],
        cal["hash"],
        prof["hash"],
    )
    assert len(prof["verify_cost"]) == 4  # n = 1..max_nodes + 1 (root included)
    assert out["chosen"]["candidate_rows"] <= 3 and out["acceptance"] == cal["acceptance"]


def test_an_explicit_calibration_of_another_configuration_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """topology.calibration_artifact= made at T=0.7, run at T=0.5, was refused only after the models had
    loaded (40-50 s on SmolLM2), though the temperature is in the artifact's own file."""
    from harness.config import compose
    from harness.prepare.sequoia import check_calibration_config

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    cal = json.loads(capsys.readouterr().out)["sequoia_calibration"]
    given = ["topology=sequoia", *SMALL_TREE, f"topology.calibration_artifact={cal}"]
    check_calibration_config(compose(given))  # its own configuration: no refusal
    with pytest.raises(
        StaleArtifactError, match=r"sampling_policy differs \(sampling_policy.temperature: artifact 0.7"
    ):
        check_calibration_config(compose([*given, "generation.temperature=0.5"]))
    with pytest.raises(StaleArtifactError, match=r"settings differs \(settings.parents: artifact 20, this run 99\)"):
        check_calibration_config(compose([*given, "topology.calibration.parents=99"]))
    # the runner's config checks call it: the refusal comes before any model is loaded
    from harness.runner import check_job

    with pytest.raises(StaleArtifactError, match="sampling_policy differs"):
        check_job(compose([*given, "generation.temperature=0.5"]), None)


def _with_provenance(profile_path: Path, out: Path, **changes) -> Path:
    """A copy of the profile at ``profile_path``, its provenance changed and re-hashed, at ``out``."""
    from harness.prepare.profile import write_artifact

    profile = json.loads(profile_path.read_text())
    profile["provenance"].update(changes)
    write_artifact({k: v for k, v in profile.items() if k != "hash"}, out)
    return out


def test_an_explicit_profile_of_another_configuration_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """topology.profile_artifact= measured with other threads or profile settings is refused from its
    own file before any model work, and the refusal names the user's file as the thing to drop or
    replace (`harness calibrate` writes to the cache: it would not repair that file)."""
    from harness.prepare.sequoia import check_profile_config
    from harness.runner import check_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    prof = Path(json.loads(capsys.readouterr().out)["sequoia_profile"])
    given = ["topology=sequoia", *SMALL_TREE, f"topology.profile_artifact={prof}"]
    check_profile_config(compose(given))  # its own configuration: no refusal
    threads = torch.get_num_threads()
    try:  # compared at the run's threads=1, whatever the process's count at the time of the check
        torch.set_num_threads(2)
        check_profile_config(compose(given))
    finally:
        torch.set_num_threads(threads)
    # measured by other harness code: said once, when the run loads it; nothing said here
    other_code = _with_provenance(prof, tmp_path / "other-code.json", code="0" * 16)
    check_profile_config(compose([*given, f"topology.profile_artifact={other_code}"]))
    assert capsys.readouterr().err == ""

    stale = _with_provenance(prof, tmp_path / "stale-threads.json", threads=2)
    with pytest.raises(StaleArtifactError) as info:
        check_profile_config(compose([*given, f"topology.profile_artifact={stale}"]))
    assert str(info.value) == (
        f"stale hardware profile {str(stale)!r}: threads differs (threads: artifact 2, this run 1); drop "
        "topology.profile_artifact (the run measures one) or give one measured for this configuration"
    )
    with pytest.raises(
        StaleArtifactError, match=r"measurement differs \(measurement.repeats: artifact 2, this run 5\)"
    ):
        check_profile_config(compose([*given, "topology.profile.repeats=5"]))
    with pytest.raises(StaleArtifactError, match=r"model differs \(model.draft.num_layers: artifact 1, this run 2\)"):
        check_profile_config(compose([*given, "proposer.model.num_layers=2"]))
    with pytest.raises(StaleArtifactError, match="cannot read sequoia_hardware_profile artifact"):
        check_profile_config(compose([*given, f"topology.profile_artifact={tmp_path / 'absent.json'}"]))
    # the runner's config checks call it, and `harness calibrate` refuses before calibrating
    with pytest.raises(StaleArtifactError, match="threads differs"):
        check_job(compose([*given, f"topology.profile_artifact={stale}"]), None)
    calibrations = sorted((tmp_path / "sequoia").glob("calibration-*.json"))
    mtimes = [c.stat().st_mtime_ns for c in calibrations]
    assert main([*SMALL_TREE, f"topology.profile_artifact={stale}"]) == 2
    err = capsys.readouterr().err
    assert "threads differs" in err and "drop topology.profile_artifact" in err and "re-run" not in err
    assert [c.stat().st_mtime_ns for c in calibrations] == mtimes


def test_an_explicit_profile_is_checked_before_the_calibration_is_measured(tmp_path, monkeypatch, capsys):
    """Where the artifacts are resolved, a stale topology.profile_artifact is refused before the
    calibration stage runs (minutes on a real model), not after it."""
    from harness import runner
    from harness.prepare import sequoia

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    prof = Path(json.loads(capsys.readouterr().out)["sequoia_profile"])
    stale = _with_provenance(prof, tmp_path / "stale-threads.json", threads=2)
    monkeypatch.setattr(runner, "check_profile_config", lambda cfg: None)  # the load's own check, alone
    calibrated = []

    def calibration(*args, **kwargs):
        calibrated.append(True)
        raise RuntimeError("the calibration stage ran")

    monkeypatch.setattr(sequoia, "run_calibration", calibration)
    assert main([*SMALL_TREE, f"topology.profile_artifact={stale}"]) == 2
    err = capsys.readouterr().err
    assert "threads differs (threads: artifact 2, this run 1); drop topology.profile_artifact" in err
    assert calibrated == []


def test_a_depth_bound_past_the_rows_searches_and_profiles_as_the_rows_allow(tmp_path, monkeypatch, capsys):
    """A tree of topology.max_nodes rows is at most that deep: topology.max_depth=30 at max_nodes=3
    measures the draft's pass over 1 .. 4 tokens (not 31), with a prefix sized for that, and shares
    its profile with max_depth=3."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    deep = [o for o in SMALL_TREE if not o.startswith("topology.max_depth=")] + ["topology.max_depth=30"]
    assert "topology.profile.prefix_len=16" in deep
    assert main(deep) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stages"]["profile"] == "measured"
    prof = json.loads(Path(first["sequoia_profile"]).read_text())
    assert len(prof["draft_feed_cost"]) == 4 and prof["provenance"]["measurement"]["max_depth"] == 3
    assert main(SMALL_TREE) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["stages"]["profile"] == "loaded (cache)" and second["sequoia_profile"] == first["sequoia_profile"]


def test_harness_calibrate_refuses_a_tree_to_load(tmp_path, monkeypatch, capsys):
    """With topology.tree_artifact= it loaded that tree, measured nothing and exited 0 as if it had
    calibrated; the tree a run loads is given to `harness run`."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main([*SMALL_TREE, f"topology.tree_artifact={tmp_path / 'tree.json'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"harness calibrate: refused: topology.tree_artifact={tmp_path / 'tree.json'} names a tree to load: "
        "harness calibrate measures and writes one"
    ), err
    assert not (tmp_path / "sequoia").exists()


def test_harness_calibrate_refuses_a_calibration_to_load_and_jobs_beside_it(tmp_path, monkeypatch, capsys):
    """topology.calibration_artifact= loaded that calibration, measured nothing and exited 0, though
    calibrate says it measures the calibration again; concurrent_jobs=2 was said to have no effect, yet
    the profile recorded it, and a run alone then measured that profile again. Both are refused in one
    line before any model work, nothing written."""
    from harness import app

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    monkeypatch.setattr(app, "load", lambda *a, **k: pytest.fail("calibrate loaded the models"))
    named = tmp_path / "mine.json"  # refused whether or not the file is there: calibrate never reads it
    assert main([*SMALL_TREE, f"topology.calibration_artifact={named}"]) == 2
    assert capsys.readouterr().err == (
        f"harness calibrate: refused: topology.calibration_artifact={named} names a calibration to load: harness "
        "calibrate measures one again (a run loads a given calibration: harness run "
        "topology.calibration_artifact=...)\n"
    )
    assert main([*SMALL_TREE, "concurrent_jobs=2"]) == 2
    assert capsys.readouterr().err == (
        "harness calibrate: refused: concurrent_jobs=2 is a sweep option (how many of a multirun's jobs run at "
        "once); harness calibrate is one job, timed alone: drop it\n"
    )
    assert not (tmp_path / "sequoia").exists()


def test_harness_calibrate_usage_names_the_topology_a_run_needs_to_load_its_artifacts(capsys):
    """calibrate implies topology=sequoia, a run does not: "a run with the same overrides" loaded nothing."""
    assert main(["--help"]) == 0
    assert "a run with the\nsame overrides and topology=sequoia then loads them" in capsys.readouterr().out


def test_harness_calibrate_refuses_other_topologies(capsys):
    assert main(["model=tiny", "topology=sequence"]) == 2
    assert "needs topology=sequoia" in capsys.readouterr().err


def test_harness_calibrate_refuses_unknown_keys(capsys):
    assert main(["model=tiny", "topology.calibration.bogus=3"]) == 2
    assert "topology.calibration has no option 'bogus'" in capsys.readouterr().err


def test_harness_calibrate_refuses_flags_in_one_line(capsys):
    """``-m`` and ``--bogus`` reached Hydra's lexer: "refused: LexerNoViableAltException: -m ^"."""
    for flag in ("-m", "--bogus"):
        assert main([flag, "model=tiny", "proposer=draft_model"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"harness calibrate: refused: harness calibrate takes key=value overrides, not flags; got ['{flag}'] "
            "(one job, no -m)"
        )


def test_harness_calibrate_notes_the_run_options_it_does_not_read():
    from harness.app import unread_options

    assert unread_options(
        ["model=tiny", "output_dir=/tmp/x", "gates.enabled=false", "tracking=wandb", "topology.max_nodes=3"]
    ) == [
        "output_dir=/tmp/x: calibrate writes its artifacts to $HARNESS_CACHE/sequoia",
        "gates.enabled=false: calibrate runs no gate",
        "tracking=wandb: calibrate logs nothing to W&B",
    ]
    assert unread_options(["model=tiny", "topology.calibration.parents=20"]) == []
    # what a run decodes and times, and its evaluation prompts' number: calibrate reads its own
    noted = unread_options(
        [
            "generation.max_new_tokens=8",
            "generation.warmup_tokens=2",
            "generation.temp_kv_budget_bytes=100000",
            "workload.limit=3",
            "allow_leakage=true",
            "hydra.run.dir=/tmp/x",
            # read: the sampling law, the profile's batch, the calibration split's prompts per category
            "generation.temperature=0.7",
            "generation.batch_size=2",
            "workload.per_category=2",
        ]
    )
    assert [n.split(":", 1)[0] for n in noted] == [
        "generation.max_new_tokens=8",
        "generation.warmup_tokens=2",
        "generation.temp_kv_budget_bytes=100000",
        "workload.limit=3",
        "allow_leakage=true",
        "hydra.run.dir=/tmp/x",
    ]
    # a sweep option calibrate refuses (it is one job, timed alone): never noted as without effect
    assert unread_options(["concurrent_jobs=2"]) == []


def test_more_calibration_branches_than_a_tiny_vocabulary_are_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """``topology.calibration.branches`` above ``model.tiny.vocab_size`` was refused once the models had
    loaded, leaving a lock file in the cache: the config's vocabulary refuses it first, nothing written."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    assert main([*SMALL_TREE, "topology.calibration.branches=200"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness calibrate")]
    assert len(lines) == 1 and lines[0].startswith(
        "harness calibrate: refused: topology.calibration.branches=200 exceeds the target's vocabulary (96 tokens, "
        "model.tiny.vocab_size)"
    ), lines
    assert not (tmp_path / "cache" / "sequoia").exists()  # no artifact, no lock file


def test_calibration_that_would_decode_past_the_positions_is_refused_before_any_round(tmp_path, monkeypatch, capsys):
    """``topology.calibration.max_new_tokens=5000`` on a 2,048-position model decoded thousands of
    tokens past its positions and wrote a calibration a run then used; `harness run` refuses the
    same generation length. Now refused in one line before any round, with nothing written."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main([*TINY, "topology.calibration.max_new_tokens=5000", "topology.calibration.parents=3000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("harness calibrate: refused: calibration prompt ")
    assert "+ topology.calibration.max_new_tokens=5000 + " in err and "> the 2,048 positions of the target;" in err
    assert re.search(r"use topology.calibration.max_new_tokens=\d+", err)
    assert not (tmp_path / "sequoia").exists() or not any((tmp_path / "sequoia").glob("calibration-*.json"))


def test_calibrating_another_configuration_keeps_the_hardware_profile_other_trees_bind(tmp_path, monkeypatch, capsys):
    """The profile's key holds no calibration field, so configurations that differ in temperature share
    it; `harness calibrate` of one re-measured it in place, and a tree pinned for the other
    (topology.tree_artifact=) was refused as stale. A matching profile is reused; topology.reuse=false
    measures it again."""
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    first = json.loads(capsys.readouterr().out)
    profile = Path(first["sequoia_profile"])
    before = profile.read_bytes()
    assert main([*SMALL_TREE, "generation.temperature=0.9"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["stages"] == {"calibration": "measured", "profile": "loaded (cache)", "tree": "built"}
    assert second["sequoia_profile"] == str(profile) and profile.read_bytes() == before
    assert second["sequoia_tree"] != first["sequoia_tree"]
    # the first configuration's tree still binds the profile there (a run pinning it loads it)
    assert json.loads(Path(first["sequoia_tree"]).read_text())["profile_hash"] == json.loads(before)["hash"]
    # the same configuration calibrated again: its calibration is measured again, the profile reused
    assert main(SMALL_TREE) == 0
    assert json.loads(capsys.readouterr().out)["stages"]["calibration"] == "measured"
    assert main([*SMALL_TREE, "topology.reuse=false"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"]["profile"] == "measured"


def test_calibrating_again_keeps_the_calibration_a_pinned_tree_binds(tmp_path, monkeypatch, capsys):
    """`harness calibrate` measures the calibration again in place: a tree pinned from the earlier one
    (topology.tree_artifact=) was then refused as stale, with no remedy. The replaced calibration is
    kept beside the new one under its content hash, with a note naming both files, and the pinned tree
    loads it; a tree whose calibration is gone is refused with the remedy, and a kept file that is not
    the calibration the tree binds is refused as before."""
    from harness.prepare.sequoia import ensure_tree_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    assert main(SMALL_TREE) == 0
    first = json.loads(capsys.readouterr().out)
    cal = Path(first["sequoia_calibration"])
    earlier = cal.read_bytes()
    pinned = tmp_path / "pinned.json"
    pinned.write_bytes(Path(first["sequoia_tree"]).read_bytes())
    assert main(SMALL_TREE) == 0
    captured = capsys.readouterr()
    second = json.loads(captured.out)
    assert second["stages"]["calibration"] == "measured" and second["sequoia_calibration"] == str(cal)
    assert second["sequoia_calibration_hash"] != first["sequoia_calibration_hash"]
    kept = cal.with_name(f"{cal.stem}.{first['sequoia_calibration_hash']}.json")
    assert kept.read_bytes() == earlier
    assert (
        f"harness: note: the Sequoia calibration {str(cal)!r} was measured again; the one it replaced, which trees "
        f"given by topology.tree_artifact may bind, is kept as {str(kept)!r}"
    ) in captured.err
    assert not list(cal.parent.glob("profile-*.*.json"))  # the profile was reused, not replaced

    cfg = compose([*SMALL_TREE, f"topology.tree_artifact={pinned}"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the run's threads=1, as the provenance compares it
        context = build_context_of(cfg)
        arts = ensure_tree_artifact(cfg, context, progress=False)
        assert arts.calibration_path == kept and arts.calibration["hash"] == first["sequoia_calibration_hash"]
        assert arts.stages["tree"] == "loaded (topology.tree_artifact)"
        assert arts.tree["chosen"]["parents"] == first["chosen"]["parents"]
        kept.write_bytes(cal.read_bytes())  # another calibration under that name: the tree's hash refuses it
        with pytest.raises(StaleArtifactError, match=r"it binds calibration '[0-9a-f]{16}', the run resolved"):
            ensure_tree_artifact(cfg, context, progress=False)
        kept.unlink()
        with pytest.raises(StaleArtifactError) as info:
            ensure_tree_artifact(cfg, context, progress=False)
        assert str(info.value) == (
            f"stale tree artifact {str(pinned)!r}: it binds calibration {first['sequoia_calibration_hash']!r}, "
            f"the run resolved calibration {second['sequoia_calibration_hash']!r}; drop topology.tree_artifact (the "
            "run builds a tree from the current calibration and profile), or run `harness calibrate` with the run's "
            "overrides and pin the tree it writes"
        )
    finally:
        torch.set_num_threads(threads)


def test_the_plot_of_a_profile_outside_the_cache_is_drawn_in_the_cache(tmp_path, monkeypatch, capsys):
    """The plot of a topology.profile_artifact the user named was written beside it as <name>.png: into
    the user's folder, and an unrelated PNG of that name there was reported as the plot. It is drawn in
    the cache folder, named by the profile's content hash."""
    from harness.prepare.sequoia import ensure_tree_artifact

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    assert main(SMALL_TREE) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sequoia_profile_plot"] == str(Path(out["sequoia_profile"]).with_suffix(".png"))  # a cached one
    mine = tmp_path / "mine"
    mine.mkdir()
    named = mine / "profile.json"
    named.write_bytes(Path(out["sequoia_profile"]).read_bytes())
    (mine / "profile.png").write_bytes(b"not a plot")
    cfg = compose([*SMALL_TREE, f"topology.profile_artifact={named}"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        arts = ensure_tree_artifact(cfg, build_context_of(cfg), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert arts.stages["profile"] == "loaded (topology.profile_artifact)" and arts.profile_path == named
    assert arts.plot_path == tmp_path / "cache" / "sequoia" / f"profile-plot-{out['sequoia_profile_hash']}.png"
    assert arts.plot_path.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in mine.iterdir()) == ["profile.json", "profile.png"]
    assert (mine / "profile.png").read_bytes() == b"not a plot"


def test_a_refused_calibrate_puts_back_the_artifacts_it_re_measured(tmp_path, monkeypatch, capsys):
    """`harness calibrate` re-measures the calibration (and with topology.reuse=false the hardware
    profile); when the tree search then refuses (speculation does not pay at n = 1), the shared
    profile was left replaced, so trees of other configurations bound to the earlier one went stale.
    The earlier files are put back."""
    from harness.prepare import sequoia

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert main(SMALL_TREE) == 0
    out = json.loads(capsys.readouterr().out)
    files = [Path(out[k]) for k in ("sequoia_calibration", "sequoia_profile", "sequoia_profile_plot")]
    before = [f.read_bytes() for f in files]

    def refuse(**_):
        raise ValueError("the hardware-aware choice is plain autoregressive decoding (n = 1)")

    monkeypatch.setattr(sequoia, "build_tree_artifact", refuse)
    assert main([*SMALL_TREE, "topology.reuse=false"]) == 2
    assert "plain autoregressive decoding" in capsys.readouterr().err
    assert [f.read_bytes() for f in files] == before


def test_a_tree_artifact_whose_budget_differs_from_its_chosen_tree_is_refused(tmp_path, monkeypatch, capsys):
    """A run builds its budget from the tree artifact's ``budget_parents``, but only ``parents`` was
    compared with what the optimiser chooses: an artifact re-hashed with a flat star there ran the
    star while the record described the chosen chain. Every figure of the choice is checked now."""
    from harness.prepare.profile import read_artifact, write_artifact
    from harness.prepare.sequoia import CALIBRATION_KIND, PROFILE_KIND, TREE_KIND, check_tree

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    # both rows of the budget, whatever the measured profile favours (under load it chose one row, whose
    # budget has no other shape)
    assert main([*SMALL_TREE, "topology.min_nodes=3"]) == 0
    out = json.loads(capsys.readouterr().out)
    tree = read_artifact(Path(out["sequoia_tree"]), kind=TREE_KIND)
    cal = read_artifact(Path(out["sequoia_calibration"]), kind=CALIBRATION_KIND)
    prof = read_artifact(Path(out["sequoia_profile"]), kind=PROFILE_KIND)
    check_tree(tree, calibration=cal, profile=prof, search=tree["search"], path="t.json")  # as written: fine
    chosen = tree["chosen"]["budget_parents"]
    flat, chain = [-1] * len(chosen), [-1, *range(len(chosen) - 1)]
    other = {k: v for k, v in tree.items() if k != "hash"}
    other["chosen"] = {**tree["chosen"], "budget_parents": chain if chosen == flat else flat}
    assert other["chosen"]["budget_parents"] != chosen and len(chosen) > 1  # another shape of the same rows
    write_artifact(other, tmp_path / "other.json")  # re-hashed: the content hash alone cannot tell
    tampered = read_artifact(tmp_path / "other.json", kind=TREE_KIND)
    with pytest.raises(StaleArtifactError, match=r"its chosen budget_parents is \[-1, "):
        check_tree(tampered, calibration=cal, profile=prof, search=tree["search"], path="other.json")


def test_a_tree_predicted_slower_than_plain_decoding_is_noted():
    """With the default topology.min_nodes=2 the search builds a tree even where its predicted time
    per token is above one AR step (1.54x on SmolLM2 in a trial) and nothing said so; the run's notes
    and `harness calibrate` say it now, naming min_nodes."""
    from harness.prepare.sequoia import slower_than_ar_note
    from harness.runner import run_notes

    note = slower_than_ar_note({"n": 3, "time_per_token": 1.54})
    assert note.startswith("the Sequoia tree of 3 nodes is predicted at 1.54x an autoregressive step per token")
    assert "topology.min_nodes" in note and slower_than_ar_note({"n": 5, "time_per_token": 0.61}) is None
    metrics = {"sequoia_predicted_time_per_token_normalised": 1.54, "sequoia_tree_nodes": 3}
    assert run_notes({"metrics": metrics, "per_prompt": [{}]}) == [note]
    assert (
        run_notes({"metrics": {**metrics, "sequoia_predicted_time_per_token_normalised": 0.9}, "per_prompt": []}) == []
    )


def test_a_chosen_tree_with_nodes_worth_nothing_is_noted():
    """A measured profile pricing t(9) below t(7) made the search add two siblings of acceptance 0:
    the tree expects no more tokens than the best of 7 nodes, and nothing said why it was larger."""
    from harness.prepare.sequoia import idle_nodes_note

    table = [[n, d, None if d == 0 and n > 1 else float(min(n, 7))] for n in range(1, 10) for d in range(0, 7)]
    tree = {"chosen": {"n": 9, "expected_tokens": 7.0}, "search": {"max_depth": 6}, "expected_tokens_table": table}
    note = idle_nodes_note(tree)
    assert note.startswith(
        "the chosen Sequoia tree of 9 nodes expects no more tokens per round (7) than the best of 7:"
    )
    assert idle_nodes_note({**tree, "chosen": {"n": 7, "expected_tokens": 7.0}}) is None
    # a depth bound past what the table stores (max_depth 6 over trees of at most 4 nodes: depth 3)
    small = [[n, d, float(min(n, 3))] for n in range(1, 5) for d in range(0, 4)]
    shallow = {"chosen": {"n": 4, "expected_tokens": 3.0}, "search": {"max_depth": 6}, "expected_tokens_table": small}
    assert idle_nodes_note(shallow).startswith("the chosen Sequoia tree of 4 nodes expects no more tokens")
