"""W&B tracking: what reaches the offline log, read back with W&B's own reader (`wandb leet inspect`,
which parses the run's .wandb transaction log through wandb-core).

Each offline W&B run costs about a second; a job run through the runner costs a few more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fixture_run, history, inspect_run, run_info

from harness.tracking.conventions import MIN_DEPTH_ROUNDS
from harness.tracking.store import REQUIRED_METRICS, load_record
from harness.tracking.wandb_tracker import (
    DEFAULT_PROJECT,
    NullTracker,
    Tracker,
    axis_tags,
    open_run,
    status_tags,
    tracker_from_config,
)

FIXTURE_RUN = fixture_run(11)  # prompt lookup, adaptive budget (it records t(n)), the oracle switched off
HEADS_RUN = fixture_run(9)  # hydra heads trained here: the record carries their manifest


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own folders (settings, cache, artifact staging) inside tmp_path; no key, no server."""
    for var, sub in (
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    return tmp_path / "wandb-home"


@pytest.fixture
def run_dir(tmp_path, wandb_home):
    """A copy of a fixture run folder."""
    dest = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, dest)
    return dest


def test_log_record_reaches_the_offline_log(run_dir):
    record = load_record(run_dir)
    with open_run(record, mode="offline", dir=run_dir) as tracker:
        assert isinstance(tracker, Tracker)
        tracker.log_record(record, run_dir)
    info, records = inspect_run(run_dir)

    assert info["state"] == "finished" and info["exit_code"] == 0
    assert info["project"] == DEFAULT_PROJECT
    run = run_info(records)
    arm = "prompt_lookup-sequences-greedy-T0-B1"
    assert run["display_name"] == f"{arm}-jsonl"
    assert run["run_id"] == record["run_id"]
    assert run["run_group"] == "fixture-sweep"
    assert run["job_type"] == arm
    assert set(axis_tags(record["axes"])) <= set(run["tags"])
    assert {"ungated", "gate-skipped:oracle", "gate-skipped:end_to_end_oracle"} <= set(run["tags"])

    config = info["config"]
    assert {k: config[k] for k in ("proposer", "topology", "verifier", "temperature", "batch_size", "workload")} == {
        "proposer": "prompt_lookup",
        "topology": "sequences",
        "verifier": "greedy",
        "temperature": 0,
        "batch_size": 1,
        "workload": "jsonl",
    }
    assert config["arm"] == arm and config["sweep"] == "fixture-sweep"
    assert config["resolved"]["topology"]["max_nodes"] == record["config"]["topology"]["max_nodes"] == 16

    summary = info["summary"]
    for name in REQUIRED_METRICS:
        if record["metrics"][name] is not None:  # W&B keeps no summary value for None (CUDA peaks on a CPU)
            assert name in summary, name
    assert summary["speedup"] == record["metrics"]["speedup"]
    assert summary["acceptance_by_depth"] == record["metrics"]["acceptance_by_depth"]
    assert summary["round_cost_ms"]["target_verify"] == record["metrics"]["round_cost_ms"]["target_verify"]
    assert summary["run_id"] == record["run_id"] and summary["exact"] is True
    assert summary["outcome"] == "finished" and summary["gated"] is False
    assert summary["gates_skipped"] == ["end_to_end_oracle", "oracle"]
    assert summary["gates_passed"] == ["equivalence", "greedy_equality", "negotiation"], {
        n: g["status"] for n, g in record["gates"].items()
    }
    assert not set(summary["gates_passed"]) & set(summary["gates_skipped"])
    assert not any(k.startswith(("round/", "depth/", "t_profile/")) for k in summary)  # series stay series
    depths = len(record["metrics"]["acceptance_by_depth"])
    assert summary["acceptance_by_depth_table"]["nrows"] == depths == record["config"]["topology"]["max_depth"]
    assert summary["round_cost_table"]["nrows"] == 6
    assert summary["accepted_length_hist_table"]["nrows"] == len(record["metrics"]["accepted_length_hist"])
    assert summary["per_prompt_table"]["nrows"] == len(record["per_prompt"])
    from harness.tracking.wandb_tracker import PER_PROMPT_COLUMNS, per_prompt_rows

    rows = per_prompt_rows(record)
    first, p = dict(zip(PER_PROMPT_COLUMNS, rows[0], strict=True)), record["per_prompt"][0]
    assert first["prompt_id"] == str(p["prompt_id"]) and first["spec_tokens"] == p["spec_tokens"]
    assert first["decode_speedup"] == pytest.approx(
        (p["ar_decode_ms"] / p["ar_tokens"]) / (p["spec_decode_ms"] / p["spec_tokens"])
    )

    steps = history(records)
    rounds = [s for s in steps if "round/committed_tokens" in s]
    table = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [s["round"] for s in rounds] == list(range(len(table))) and len(table) == record["metrics"]["rounds"]
    assert [s["round/accepted_length"] for s in rounds] == [r["accepted"] for r in table]
    assert [s["round/target_verify_ms"] for s in rounds] == [r["target_verify_ms"] for r in table]
    depth = [s for s in steps if "depth/reach" in s]
    assert [s["depth"] for s in depth] == list(range(1, depths + 1))
    tried = record["metrics"]["rounds_tried_by_depth"]
    # depths no round tried are left off the log-scaled panel's line (a zero has no place on it)
    assert [s.get("depth/rounds_tried") for s in depth] == [n or None for n in tried]
    for s, n, acc in zip(depth, tried, record["metrics"]["acceptance_by_depth"]):
        if acc is None:  # no round tried this depth: no rate, no interval
            assert n == 0 and not {"depth/acceptance", "depth/acceptance_few_rounds", "depth/acceptance_low"} & set(s)
            continue
        key = "depth/acceptance" if n >= MIN_DEPTH_ROUNDS else "depth/acceptance_few_rounds"
        assert s[key] == acc and s["depth/acceptance_low"] <= acc <= s["depth/acceptance_high"]
    # 64 committed tokens: a depth d >= 3 is tried by at most 64 / d < 30 rounds ("few rounds")
    assert len([n for n in tried if n]) >= 3 and any("depth/acceptance_few_rounds" in s for s in depth)
    profile = [s for s in steps if "t_profile/t_ms" in s]
    assert [s["verify_rows"] for s in profile] == record["t_profile"]["n"]
    assert [s["t_profile/t_ms"] for s in profile] == record["t_profile"]["t"]

    (artifact,) = [
        r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
    ]
    assert artifact["name"] == f"record-{record['run_id']}"
    paths = {c["path"] for c in artifact["manifest"]["contents"]}
    assert paths == {"record.json", "outputs.jsonl", "rounds.jsonl"}  # the job's files; no artifact files


def test_artifact_files_and_manifests_a_record_names(tmp_path, wandb_home):
    """A Sequoia run names its tree and profile files (paths in the cache); trained heads are named
    by their manifest, which record.json already holds."""
    run_dir = tmp_path / "heads"
    shutil.copytree(HEADS_RUN, run_dir)
    record = load_record(run_dir)
    assert isinstance(record["artifacts"]["proposer_artifact"], dict)
    tree = tmp_path / "cache" / "sequoia" / "tree-abc.json"
    tree.parent.mkdir(parents=True)
    tree.write_text("{}")
    record["artifacts"]["tree"] = str(tree)
    with open_run(record, mode="offline", dir=run_dir) as tracker:
        tracker.log_record(record, run_dir)
    info, records = inspect_run(run_dir)
    assert info["state"] == "finished" and "cpu-budget-artifact" in info["tags"]
    (artifact,) = [
        r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
    ]
    paths = {c["path"] for c in artifact["manifest"]["contents"]}
    assert paths == {"record.json", "outputs.jsonl", "rounds.jsonl", "artifacts/tree/tree-abc.json"}


def test_an_error_inside_the_run_marks_it_failed_and_is_reraised(run_dir):
    record = load_record(run_dir)
    record["artifacts"]["profile"] = str(run_dir / "profile.json")  # the record points at a missing artifact
    with pytest.raises(FileNotFoundError, match="record artifact 'profile' points to"):
        with open_run(record, mode="offline", dir=run_dir) as tracker:
            tracker.log_record(record, run_dir)
    info, records = inspect_run(run_dir)
    assert info["state"] == "failed" and info["exit_code"] == 1
    assert info["summary"]["outcome"] == "failed"
    assert "failed" in info["tags"] and "verifier=greedy" in info["tags"]
    assert run_info(records)["run_group"] == "fixture-sweep"


def test_an_unreachable_server_falls_back_to_offline_with_one_warning(run_dir, monkeypatch, capfd):
    """Online against a closed port: one warning line, an offline run with everything in it, and
    the record says so. This record is also ungated with a skipped gate: both show as tags."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    record = load_record(run_dir)
    assert record["gated"] is False and record["gates"]["oracle"]["status"] == "skipped"  # gates.oracle=false
    tracker = open_run(record, mode="online", dir=run_dir)
    described = tracker.describe()
    tracker.log_record(record, run_dir)

    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("harness: W&B server http://127.0.0.1:9 not usable") and "wandb sync" in err[0]
    assert described["mode"] == "offline" and described["requested_mode"] == "online"
    assert described["sync"].startswith("wandb sync wandb/offline-run-")
    info, _ = inspect_run(run_dir)
    assert info["state"] == "finished"
    assert info["summary"]["speedup"] == record["metrics"]["speedup"] and info["summary"]["gated"] is False
    assert {"ungated", "gate-skipped:oracle", "gate-skipped:end_to_end_oracle"} <= set(info["tags"])
    assert info["summary"]["gates_skipped"] == ["end_to_end_oracle", "oracle"]


def test_status_tags_read_the_gate_status_or_the_passed_flag():
    assert status_tags(load_record(FIXTURE_RUN)) == ["ungated", "gate-skipped:oracle", "gate-skipped:end_to_end_oracle"]
    assert status_tags(load_record(HEADS_RUN)) == ["cpu-budget-artifact"]
    record = load_record(fixture_run(3))  # gated, exact, no trained artifact
    assert status_tags(record) == []
    record["gates"]["oracle"] = {"passed": False}
    record["gates"]["statistical"] = {"status": "not_applicable"}
    record["exact"] = False
    record["metrics"]["cpu_budget_artifact"] = True
    assert status_tags(record) == ["gate-failed:oracle", "heuristic", "cpu-budget-artifact"]
    # a schema-1 record has no ``gated``: its gates decide, and its ``skipped: true`` is a skip
    v1 = load_record(fixture_run(3))
    v1["schema_version"] = 1
    del v1["gated"]
    v1["gates"] = {name: {"passed": True} for name in v1["gates"]}
    assert status_tags(v1) == []
    v1["gates"]["oracle"] = {"passed": None, "skipped": True}
    assert status_tags(v1) == ["ungated", "gate-skipped:oracle"]


@pytest.mark.parametrize("tracking", [None, "none", {"name": "none"}, {"backend": "none"}])
def test_tracking_none_gives_a_null_tracker_that_logs_nothing(tmp_path, tracking):
    cfg = {"experiment": "x"} if tracking is None else {"experiment": "x", "tracking": tracking}
    tracker = tracker_from_config(cfg, run_dir=tmp_path)
    assert isinstance(tracker, NullTracker) and tracker.describe() is None
    with pytest.raises(RuntimeError, match="boom"):
        with tracker:
            tracker.log_record(load_record(FIXTURE_RUN), FIXTURE_RUN)
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []  # no wandb folder, nothing written


def test_bad_tracking_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="tracking must be 'none' or 'wandb'; got 'mlflow'"):
        tracker_from_config({"tracking": {"name": "mlflow"}}, run_dir=tmp_path)
    with pytest.raises(ValueError, match="mode must be one of"):
        open_run({"experiment": "x"}, mode="cloud", dir=tmp_path)  # type: ignore[arg-type]
    # W&B's "disabled" logs nothing, and a record naming its run would claim a log that does not exist
    with pytest.raises(ValueError, match=r"mode must be one of \['offline', 'online'\]; got 'disabled'"):
        open_run({"experiment": "x"}, mode="disabled", dir=tmp_path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_axis_tags_keep_the_axis_order():
    axes = {"model": "m", "proposer": "rest", "temperature": 0.7, "extra": 1}
    assert axis_tags(axes) == ["proposer=rest", "temperature=0.7", "model=m", "extra=1"]


# --------------------------------------------------------------------------------------------
# jobs run by the runner with tracking=wandb (tiny model)

JOB = [
    "experiment=default",  # the demo's experiment on the tiny model: group "default"
    "model=tiny",
    "proposer.budget_policy=fixed",
    "topology=sequence",
    "workload.limit=2",
    "generation.max_new_tokens=10",
    "gates.oracle=false",
    "tracking=wandb",
    "tracking.system_metrics_interval_s=0.5",
]


def test_a_tracked_job_reads_back_with_names_group_config_history_and_summary(tmp_path, wandb_home, monkeypatch):
    from harness.config import compose
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    record = run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    assert load_record(out)["tracking"] == record["tracking"]
    tracking = record["tracking"]
    assert tracking["mode"] == "offline" and tracking["run_id"] == record["run_id"]
    assert (out / tracking["dir"]).is_dir() and tracking["sync"] == f"wandb sync {tracking['dir']}"

    info, records = inspect_run(out)
    assert info["state"] == "finished"
    run = run_info(records)
    assert run["display_name"] == "prompt_lookup-sequence-greedy-T0-B1-humaneval" == tracking["name"]
    assert run["run_group"] == "default" and run["job_type"] == "prompt_lookup-sequence-greedy-T0-B1"
    assert run["run_id"] == record["run_id"]
    assert info["config"]["proposer"] == "prompt_lookup" and info["config"]["batch_size"] == 1
    assert info["config"]["experiment"] == "default" and info["config"]["resolved"]["workload"]["limit"] == 2
    # the machine, as compare splits arms by it: a sweep run on each machine logs into one group
    hardware = record["hardware"]
    assert info["config"]["machine"] == f"{hardware['device'].split(':')[0]}: {hardware['device_name']}"
    m = record["metrics"]
    assert info["summary"]["committed_tokens"] == m["committed_tokens"] == 20
    assert info["summary"]["rounds_tried_by_depth"] == m["rounds_tried_by_depth"]
    assert info["summary"]["peak_rss_method"] == m["peak_rss_method"]

    committed = [s["round/committed_tokens"] for s in history(records) if "round/committed_tokens" in s]
    assert len(committed) == m["rounds"] == record["round_series"]["rows"]
    assert sum(committed) == m["committed_tokens"]
    stats = [r for r in records if r.get("type") == "stats"]
    assert stats and any("proc.memory.rssMB" in s["stats"]["item"] for s in stats)  # system metrics on


def test_a_refused_job_is_a_failed_w_and_b_run_tagged_refused_and_leaves_no_record(tmp_path, wandb_home, monkeypatch):
    import harness.runner as runner
    from harness.config import compose
    from harness.gates.status import GateError

    def refuse(*args, **kwargs):
        raise GateError("equivalence: tree logits differ from sequential logits")

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "gate", refuse)
    out = tmp_path / "job"
    with pytest.raises(GateError, match="equivalence"):
        runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    assert not (out / "record.json").exists()
    info, records = inspect_run(out)
    assert info["state"] == "failed" and "refused" in info["tags"]
    assert info["summary"]["failure_stage"] == "gate" and "tree logits differ" in info["summary"]["error"]
    assert run_info(records)["run_group"] == "default"


def test_a_re_run_whose_gate_fails_says_the_earlier_record_stays_aside(tmp_path, wandb_home, monkeypatch):
    """A failed gate's evidence refutes the folder's earlier record, which stays in .previous/; the
    failing W&B run says so, so the dashboard tags the earlier run superseded (only finished re-runs
    did, and the refuted run stayed among the gated ones)."""
    import harness.runner as runner
    from harness.config import compose
    from harness.gates.status import GateError

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    first = runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)

    def refuse(*args, **kwargs):
        raise GateError("equivalence: tree logits differ from sequential logits")

    monkeypatch.setattr(runner, "gate", refuse)
    with pytest.raises(GateError):
        runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    info, _ = inspect_run(out)
    assert info["state"] == "failed" and info["summary"]["earlier_record"] == "set_aside"
    assert info["config"]["replaces"] == [first["run_id"]]


def test_a_record_logged_after_the_fact_names_every_tracked_record_set_aside_in_its_folder(
    tmp_path, wandb_home, monkeypatch
):
    """Only the record a job itself moved aside was named in ``replaces``: a record logged after the
    fact named none, and one set aside by a launch that failed before its W&B run opened (or by an
    interrupted re-run) was named by no later run, so its arm was counted twice on the dashboard."""
    import harness.runner as runner
    from harness.config import compose
    from harness.tracking.job_folder import set_aside

    out, first, _ = _earlier_tracked_run(tmp_path, monkeypatch)
    set_aside(out)  # a launch of another manifest moved it, then failed before W&B opened
    assert runner.replaced_runs(out) == [first["run_id"]]
    untracked = runner.run_job(compose([*JOB, f"output_dir={out}", "seed=1", "tracking=none"]), run_dir=out)
    assert "tracking" not in untracked
    assert runner.track(compose([*JOB, f"output_dir={out}", "seed=1"]), load_record(out), out) is True
    info, _ = inspect_run(out)
    assert info["config"]["replaces"] == [first["run_id"]]
    # the record logged after the fact, set aside in turn, is named too; each run once
    set_aside(out)
    assert runner.replaced_runs(out) == [first["run_id"], untracked["run_id"]]


def test_a_record_another_job_logged_meanwhile_is_not_logged_twice(tmp_path, wandb_home, monkeypatch):
    """A skipped job and its twin (a default restated) found one untracked record and both logged it:
    two finished W&B runs of one id. Logging reads the record again under its lock."""
    import harness.runner as runner
    from harness.config import compose

    out, first, runs = _earlier_tracked_run(tmp_path, monkeypatch)
    stale = {k: v for k, v in first.items() if k != "tracking"}  # as the other job read it before
    assert runner.track(compose([*JOB, f"output_dir={out}"]), stale, out) is False
    assert {p.name for p in (out / "wandb").iterdir()} == runs and load_record(out)["tracking"] == first["tracking"]


def test_a_refused_plan_logs_nothing(tmp_path, wandb_home):
    from harness.config import compose
    from harness.runner import run_job
    from harness.verifiers.base import NegotiationError

    out = tmp_path / "job"
    with pytest.raises(NegotiationError):
        run_job(compose([*JOB, "verifier=rejection", f"output_dir={out}"]), run_dir=out)
    assert not out.exists() or not any(out.rglob("*.wandb"))


def test_tracking_names_and_environment_w_and_b_refuses_are_named_before_any_work(tmp_path):
    from harness.tracking.wandb_tracker import environment_notes, tracking_problem

    assert tracking_problem("spec-harness", None, environ={}) is None
    assert tracking_problem("a:b", None, environ={}) == "tracking.project=a:b: W&B names cannot hold :"
    assert tracking_problem("", None, environ={}).startswith("tracking.project is empty")
    assert (
        tracking_problem("x" * 129, None, environ={}) == "tracking.project has 129 characters: W&B allows at most 128"
    )
    assert tracking_problem("p", "me/you", environ={}) == "tracking.entity=me/you: W&B names cannot hold /"
    assert tracking_problem("p", environ={"WANDB_MODE": "bogus"}).startswith("WANDB_MODE=bogus in the environment")
    assert tracking_problem("p", environ={"WANDB_BASE_URL": "notaurl"}).startswith("WANDB_BASE_URL=notaurl")
    assert tracking_problem("p", environ={"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://h:8080"}) is None
    afile = tmp_path / "afile"
    afile.write_text("x")  # a folder W&B writes into, under a regular file: it failed after the whole run
    said = tracking_problem("p", environ={"WANDB_DATA_DIR": str(afile / "data")})
    assert said.startswith(f"WANDB_DATA_DIR={afile / 'data'}: cannot be created") and said.endswith("W&B writes there)")
    assert tracking_problem("p", environ={"WANDB_DATA_DIR": str(tmp_path / "fine")}) is None
    assert environment_notes("offline", {"WANDB_MODE": "disabled", "WANDB_DISABLED": "true"}) == [
        "WANDB_MODE=disabled is set, but tracking.mode=offline decides: it logs offline",
        "WANDB_DISABLED is set, but tracking=wandb asks for a run: it logs offline",
    ]
    assert environment_notes("offline", {"WANDB_MODE": "offline"}) == []


def _earlier_tracked_run(tmp_path, monkeypatch):
    from harness.config import compose
    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    record = run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    return out, record, {p.name for p in (out / "wandb").iterdir()}


def test_a_w_and_b_run_that_cannot_start_leaves_the_earlier_record_in_place(tmp_path, wandb_home, monkeypatch):
    """Opening the W&B run came after the earlier files were moved aside, and a failure there left
    them in .previous/: they are put back, and the refusal names W&B."""
    import harness.runner as runner
    from harness.config import compose
    from harness.contracts import ConfigError
    from harness.tracking.wandb_tracker import TrackingError

    out, earlier, runs = _earlier_tracked_run(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=r"^tracking.project=a:b: W&B names cannot hold :"):
        runner.run_job(compose([*JOB, f"output_dir={out}", "tracking.project=a:b"]), run_dir=out)

    def broken(*args, **kwargs):
        raise RuntimeError("Unable to write staging files\nmore lines")

    monkeypatch.setattr(runner, "open_run", broken)
    with pytest.raises(TrackingError, match=r"^W&B could not start the run \(RuntimeError: Unable to write staging"):
        runner.run_job(compose([*JOB, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert load_record(out)["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    assert {p.name for p in (out / "wandb").iterdir()} == runs


def test_a_w_and_b_failure_after_the_record_keeps_it_untracked_and_a_later_launch_logs_it(
    tmp_path, wandb_home, monkeypatch, capsys
):
    import harness.runner as runner
    from harness.config import compose

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"

    def broken(self, record, run_dir):
        raise OSError("Unable to write staging files")

    with monkeypatch.context() as patch:
        patch.setattr(Tracker, "log_record", broken)
        record = runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    assert "tracking" not in record and "tracking" not in load_record(out)
    assert "the record is written, but W&B could not log it (OSError" in capsys.readouterr().err
    assert not list((out / "wandb").glob("offline-run-*"))  # the half-logged run is gone: one id, one run
    cfg = compose([*JOB, f"output_dir={out}"])
    assert runner.track(cfg, load_record(out), out) is True
    assert load_record(out)["tracking"]["logged_after_the_run"] is True
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    with monkeypatch.context() as patch:  # logging after the fact fails the same way: untracked, no stray run
        patch.setattr(Tracker, "log_record", broken)
        untracked = {k: v for k, v in load_record(out).items() if k != "tracking"}
        (out / "record.json").write_text(json.dumps(untracked))  # track reads the record as it is on disk
        assert runner.track(cfg, untracked, out) is False
    assert "it stays untracked, and the next launch with tracking=wandb tries again" in capsys.readouterr().err
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


def test_an_interrupt_while_w_and_b_logs_the_record_leaves_it_untracked_and_the_next_launch_logs_it(
    tmp_path, wandb_home, monkeypatch, capsys
):
    import harness.runner as runner
    from harness.config import compose

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"

    def interrupted(self, record, run_dir):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Tracker, "log_record", interrupted)
        with pytest.raises(KeyboardInterrupt):
            runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    assert "tracking" not in load_record(out)  # written, and not claiming a W&B run that holds only part of it
    assert "the record is written, but the interrupt came while W&B logged it" in capsys.readouterr().err
    assert not list((out / "wandb").glob("offline-run-*"))
    assert runner.track(compose([*JOB, f"output_dir={out}"]), load_record(out), out) is True
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


def test_an_interrupt_before_the_write_leaves_the_earlier_record_s_w_and_b_run_the_only_one(
    tmp_path, wandb_home, monkeypatch
):
    """The earlier record comes back, and the interrupted attempt's offline run goes: a ``wandb sync``
    of the folder uploads the arm's record, not an interrupted run beside it."""
    import harness.runner as runner
    from harness.config import compose

    out, earlier, runs = _earlier_tracked_run(tmp_path, monkeypatch)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_job(compose([*JOB, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert load_record(out)["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    assert {p.name for p in (out / "wandb").iterdir()} == runs  # its latest-run link included
    assert (out / "wandb" / "latest-run").resolve() == (out / earlier["tracking"]["dir"]).resolve()


def test_an_interrupted_run_is_tagged_interrupted_not_failed(tmp_path, wandb_home, monkeypatch):
    import harness.runner as runner
    from harness.config import compose

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
    (run,) = (out / "wandb").glob("offline-run-*")  # no earlier record: the attempt is the arm's only trace
    info, _ = inspect_run(out, sync_dir=run)
    assert info["state"] == "failed" and "interrupted" in info["tags"] and "failed" not in info["tags"]
    assert info["summary"]["outcome"] == "interrupted" and info["summary"]["failure_stage"] == "measure"


@pytest.mark.parametrize("earlier", [False, True])
def test_a_run_stopped_while_w_and_b_opens_it_leaves_no_offline_run(tmp_path, wandb_home, monkeypatch, earlier):
    """Ctrl-C inside wandb.init left its half-made offline run (W&B ends it "finished" at exit, with the
    arm's name and tags and none of its data: a ``wandb sync`` would upload it), and W&B's links
    pointing at it. Another run's folder there stays."""
    import wandb

    run_dir = tmp_path / "job"
    other = run_dir / "wandb" / "offline-run-20260101_000000-other"
    if earlier:
        other.mkdir(parents=True)

    def interrupted_init(**kwargs):
        sync = Path(kwargs["dir"]) / "wandb" / f"offline-run-20260102_000000-{kwargs['id']}"
        (sync / "logs").mkdir(parents=True)
        (sync / "logs" / "debug.log").write_text("")
        (sync / f"run-{kwargs['id']}.wandb").write_bytes(b":W&B")
        (sync.parent / "latest-run").symlink_to(sync.name)
        (sync.parent / "debug.log").symlink_to(f"{sync.name}/logs/debug.log")
        raise KeyboardInterrupt

    monkeypatch.setattr(wandb, "init", interrupted_init)
    with pytest.raises(KeyboardInterrupt):
        open_run({"experiment": "e"}, mode="offline", dir=run_dir, run_id="m1-20260102T000000-abc")
    if earlier:
        assert [p.name for p in (run_dir / "wandb").iterdir()] == [other.name]
    else:
        assert not (run_dir / "wandb").exists() and run_dir.is_dir()


@pytest.mark.parametrize("where", ["inside_init", "before_the_runner_holds_it"])
def test_an_interrupt_while_the_w_and_b_run_opens_leaves_the_earlier_record_s_run_the_only_one(
    tmp_path, wandb_home, monkeypatch, where
):
    """A Ctrl-C as W&B opened the run left the runner without its tracker: nothing closed or removed
    the new offline run, and W&B's latest-run link pointed at it, not at the record's run."""
    import wandb

    import harness.runner as runner
    from harness.config import compose

    out, earlier, runs = _earlier_tracked_run(tmp_path, monkeypatch)
    opened = []
    if where == "inside_init":
        real_init = wandb.init

        def init(**kwargs):
            opened.append(real_init(**kwargs))  # W&B made the run (its folder, its stream) ...
            raise KeyboardInterrupt  # ... and the interrupt came before wandb.init returned

        monkeypatch.setattr(wandb, "init", init)
    else:
        real_open = runner.open_run

        def open_run(*args, **kwargs):
            opened.append(real_open(*args, **kwargs).run)
            raise KeyboardInterrupt

        monkeypatch.setattr(runner, "open_run", open_run)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_job(compose([*JOB, f"output_dir={out}", "seed=1"]), run_dir=out)
    finally:
        for run in opened:
            run.finish()
    assert len(opened) == 1
    assert load_record(out)["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    assert {p.name for p in (out / "wandb").iterdir()} == runs  # no offline run of the attempt
    assert (out / "wandb" / "latest-run").resolve() == (out / earlier["tracking"]["dir"]).resolve()


def test_a_refusal_while_loading_puts_the_earlier_w_and_b_runs_back_beside_its_own(tmp_path, wandb_home, monkeypatch):
    import harness.runner as runner
    from harness.config import compose

    out, earlier, runs = _earlier_tracked_run(tmp_path, monkeypatch)

    def refuse(*args, **kwargs):
        raise ValueError("prompt 'p' does not fit")

    monkeypatch.setattr(runner, "load", refuse)
    with pytest.raises(ValueError, match="does not fit"):
        runner.run_job(compose([*JOB, f"output_dir={out}", "seed=1"]), run_dir=out)
    assert load_record(out)["run_id"] == earlier["run_id"] and not (out / ".previous").exists()
    # bad input logs nothing: the W&B run opens once the job is past its refusals (loaded and prepared)
    assert {p.name for p in (out / "wandb").iterdir()} == runs  # its latest-run link included
    assert (out / earlier["tracking"]["dir"]).is_dir()


def test_a_refusal_before_the_gates_leaves_no_w_and_b_run_and_no_folder(tmp_path, wandb_home, monkeypatch):
    """A prompt over the context limit, found once the tokenizer loads, was refused in one line and
    still left an offline W&B run tagged refused (and so the run folder) behind."""
    import harness.runner as runner
    from harness.config import compose

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    for stage in ("load", "prepare_job"):

        def refuse(*args, **kwargs):
            raise ValueError("prompt 'p' does not fit")

        with monkeypatch.context() as m:
            m.setattr(runner, stage, refuse)
            with pytest.raises(ValueError, match="does not fit"):
                runner.run_job(compose([*JOB, f"output_dir={out}"]), run_dir=out)
        assert not (out / "wandb").exists(), stage


def test_tracking_options_without_tracking_are_listed_as_inert():
    from harness.config import compose
    from harness.runner import inert_options

    assert inert_options(compose(["model=tiny", "tracking.project=foo", "tracking.entity=me"])) == [
        "tracking.project=foo: tracking=none logs nothing",
        "tracking.entity=me: tracking=none logs nothing",
    ]
    assert inert_options(compose(["model=tiny", "tracking=wandb", "tracking.project=foo"])) == []


def test_harness_run_reports_a_w_and_b_run_that_cannot_start_as_a_refusal(tmp_path, wandb_home, monkeypatch, capsys):
    """The command line said "error" and exit 1 (the runner's refusal list had it, the app's not)."""
    import harness.runner as runner
    from harness.app import run_main

    def broken(*args, **kwargs):
        raise RuntimeError("Unable to write staging files")

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "open_run", broken)
    out = tmp_path / "job"
    assert run_main([*JOB, f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harness run: refused: W&B could not start the run (RuntimeError: Unable to write")
    assert not (out / "record.json").exists()


@pytest.mark.parametrize("index", [1, 6, 7, 8, 11])
def test_round_steps_are_one_per_verify_forward(index):
    """At B > 1 the round series holds one row per request, each with the shared verify and commit in
    full: the history's steps are batch rounds (the record's batch_rounds), their stages adding to the
    record's round cost, not one step per request that draws each forward once per request."""
    from harness.tracking.wandb_tracker import round_steps

    run = fixture_run(index)
    record = load_record(run)
    m = record["metrics"]
    rows = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    steps = round_steps(rows)
    batched = record["axes"]["batch_size"] > 1
    assert len(steps) == (m["batch_rounds"] if batched else m["rounds"]) and [s["round"] for s in steps] == list(
        range(len(steps))
    )
    assert sum(s["round/committed_tokens"] for s in steps) == m["committed_tokens"]
    for stage, mean in m["round_cost_ms"].items():
        assert sum(s[f"round/{stage}_ms"] for s in steps) / len(steps) == pytest.approx(mean, rel=1e-9)
    assert all(s["round/ms"] == pytest.approx(sum(s[f"round/{k}_ms"] for k in m["round_cost_ms"])) for s in steps)
    if batched:
        assert len(steps) < len(rows) and all("round/prompt" not in s for s in steps)
        assert sum(s["round/live_requests"] for s in steps) == len(rows)
        assert max(s["round/live_requests"] for s in steps) == record["axes"]["batch_size"]
    else:
        assert [s["round/prompt"] for s in steps] == [r["prompt_index"] for r in rows]
        assert [s["round/accepted_length"] for s in steps] == [r["accepted"] for r in rows]


def test_a_batched_record_logs_one_history_step_per_batch_round(tmp_path, wandb_home):
    dest = tmp_path / "run"
    shutil.copytree(fixture_run(6), dest)
    record = load_record(dest)
    with open_run(record, mode="offline", dir=dest) as tracker:
        tracker.log_record(record, dest)
    _, records = inspect_run(dest)
    rounds = [s for s in history(records) if "round/committed_tokens" in s]
    assert len(rounds) == record["metrics"]["batch_rounds"] < record["metrics"]["rounds"]
    assert {s["round/live_requests"] for s in rounds} <= {1, 2} and 2 in {s["round/live_requests"] for s in rounds}


def test_a_tag_longer_than_w_and_b_takes_is_cut_and_kept_apart(run_dir):
    """W&B refuses to start a run with a tag over 64 characters; a hub id and dtype as the model's
    label pass that, and the run would be refused for it."""
    from harness.tracking.wandb_tracker import MAX_TAG_CHARS, fit_tag

    long_ids = [
        "unsloth/DeepSeek-R1-Distill-Llama-8B-unsloth-bnb-4bit@bfloat16",
        "unsloth/DeepSeek-R1-Distill-Llama-8B-unsloth-bnb-4bit@float16",
    ]
    tags = [fit_tag(f"model={m}") for m in long_ids]
    assert all(len(t) <= MAX_TAG_CHARS for t in tags) and tags[0] != tags[1]
    assert all(t.startswith("model=unsloth/DeepSeek-R1-Distill") for t in tags)
    assert fit_tag("model=tiny@float32") == "model=tiny@float32"
    record = load_record(run_dir)
    record["axes"] = {**record["axes"], "model": long_ids[0]}
    with open_run(record, mode="offline", dir=run_dir) as tracker:
        tracker.log_record(record, run_dir)
    info, records = inspect_run(run_dir)
    assert info["state"] == "finished" and tags[0] in run_info(records)["tags"]
    assert info["config"]["model"] == long_ids[0]  # the whole label stays in the config


def _sequoia_artifacts(folder, *, tree_hash="t1"):
    """Sequoia's cached artifacts as a run resolves them (:class:`SequoiaArtifacts`), their files written."""
    from harness.prepare.sequoia import SequoiaArtifacts

    folder.mkdir(parents=True)
    files = {name: folder / f"{name}-abc.json" for name in ("tree", "calibration", "profile")}
    tree, calibration, profile = {"hash": tree_hash}, {"hash": "c1"}, {"hash": "p1"}
    for name, content in zip(files, (tree, calibration, profile), strict=True):
        files[name].write_text(json.dumps(content))
    plot = folder / "profile-abc.png"
    plot.write_bytes(b"png")
    return SequoiaArtifacts(tree, files["tree"], calibration, files["calibration"], profile, files["profile"], plot)


def test_a_sequoia_record_uploads_its_artifact_files_and_logs_their_content_hashes(tmp_path, wandb_home):
    """A Sequoia record's artifacts hold each file's content hash beside its path, and every hash was
    read as a path: the logging failed, the record stayed untracked and every relaunch failed alike."""
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run_dir)
    record = load_record(run_dir)
    arts = _sequoia_artifacts(tmp_path / "cache" / "sequoia")
    record["artifacts"] = {**arts.paths()}  # as the runner puts a plan's artifacts into the record
    assert record["artifacts"]["sequoia_tree_hash"] == "t1"
    with open_run(record, mode="offline", dir=run_dir) as tracker:
        tracker.log_record(record, run_dir)
    info, records = inspect_run(run_dir)
    assert info["state"] == "finished"
    (artifact,) = [
        r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
    ]
    paths = {c["path"] for c in artifact["manifest"]["contents"]}
    assert paths == {
        "record.json",
        "outputs.jsonl",
        "rounds.jsonl",
        "artifacts/sequoia_tree/tree-abc.json",
        "artifacts/sequoia_calibration/calibration-abc.json",
        "artifacts/sequoia_profile/profile-abc.json",
        "artifacts/sequoia_profile_plot/profile-abc.png",
    }
    summary = info["summary"]
    assert (summary["sequoia_tree_hash"], summary["sequoia_calibration_hash"], summary["sequoia_profile_hash"]) == (
        "t1",
        "c1",
        "p1",
    )
    # a tree written without a hash: its entry is None, a value like the others, not a path
    other = tmp_path / "other"
    shutil.copytree(FIXTURE_RUN, other)
    record["artifacts"] = {**_sequoia_artifacts(tmp_path / "cache2", tree_hash=None).paths()}
    assert record["artifacts"]["sequoia_tree_hash"] is None
    with open_run(record, mode="offline", dir=other) as tracker:
        tracker.log_record(record, other)
    info, _ = inspect_run(other)
    assert info["state"] == "finished" and info["summary"]["sequoia_profile_hash"] == "p1"
    assert "sequoia_tree_hash" not in info["summary"]


def test_an_older_record_s_relative_artifact_paths_are_read_from_the_working_directory_else_the_run_folder(
    tmp_path, wandb_home, monkeypatch
):
    """Sequoia's artifact paths went into records as given, relative to the working directory, and
    W&B read them relative to the run folder: "does not exist", the W&B run discarded and the record
    left untracked on every launch. A relative path is now read from the working directory, then from
    the run folder; where neither holds it, the error names both places."""
    cached = _sequoia_artifacts(tmp_path / "cache" / "sequoia")
    wanted = "artifacts/sequoia_tree/tree-abc.json"

    def relative(base):
        return {k: os.path.relpath(v, base) if not k.endswith("_hash") else v for k, v in cached.paths().items()}

    def logged_files(record, folder) -> set[str]:  # the files the finished run's record artifact holds
        with open_run(record, mode="offline", dir=folder) as tracker:
            tracker.log_record(record, folder)
        info, records = inspect_run(folder)
        (artifact,) = [
            r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
        ]
        assert info["state"] == "finished"
        return {c["path"] for c in artifact["manifest"]["contents"]}

    # relative to the working directory the run started in
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "job"
    shutil.copytree(FIXTURE_RUN, run_dir)
    record = load_record(run_dir)
    record["artifacts"] = relative(tmp_path)
    assert record["artifacts"]["sequoia_tree"] == "cache/sequoia/tree-abc.json"
    assert logged_files(record, run_dir) >= {wanted}
    # relative to the run folder, logged from another working directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    other = tmp_path / "other"
    shutil.copytree(FIXTURE_RUN, other)
    record["artifacts"] = relative(other)
    assert record["artifacts"]["sequoia_tree"] == "../cache/sequoia/tree-abc.json"
    assert logged_files(record, other) >= {wanted}
    # in neither place: the error says where it looked
    third = tmp_path / "third"
    shutil.copytree(FIXTURE_RUN, third)
    record["artifacts"] = {"sequoia_tree": "gone/tree.json", "sequoia_tree_hash": "t1"}
    with pytest.raises(FileNotFoundError) as caught:
        with open_run(record, mode="offline", dir=third) as tracker:
            tracker.log_record(record, third)
    assert str(caught.value) == (
        "record artifact 'sequoia_tree' points to gone/tree.json, which does not exist: neither "
        f"{elsewhere / 'gone' / 'tree.json'} (from the working directory) nor {third / 'gone' / 'tree.json'} "
        "(from the run folder) exists"
    )


def test_a_multirun_without_a_sweep_name_is_one_w_and_b_group_per_launch(tmp_path, wandb_home):
    """Every `harness run -m` without a sweep name logged into the one W&B group "adhoc", so a
    dashboard of one launch's folder selected every unnamed launch's runs. A job below a multirun's
    sweep folder (its launch.json) is now group ``adhoc/<that folder's name>``; a single run outside
    any multirun stays ``adhoc``, and a named sweep or experiment keeps its name."""
    from harness.sweep import LAUNCH_FILE as SWEEP_LAUNCH_FILE
    from harness.tracking.wandb_tracker import LAUNCH_FILE, launch_folder, wandb_group

    assert LAUNCH_FILE == SWEEP_LAUNCH_FILE
    sweep = tmp_path / "multirun" / "adhoc" / "2026-12-07_10-00-00"
    job = sweep / "seed=1"
    shutil.copytree(FIXTURE_RUN, job)
    (sweep / LAUNCH_FILE).write_text(json.dumps({"launch_id": "l1", "sweep": None}))
    single = tmp_path / "outputs" / "adhoc" / "2026-12-07_10-05-00"
    shutil.copytree(FIXTURE_RUN, single)
    assert launch_folder(job) == sweep and launch_folder(single) is None
    assert wandb_group(None, None, job) == "adhoc/2026-12-07_10-00-00"
    assert wandb_group(None, None, single) == wandb_group(None, None) == "adhoc"
    assert wandb_group("smoke", None, job) == "smoke" and wandb_group(None, "exp/a", job) == "exp/a"
    groups = {}
    for name, folder in (("multirun", job), ("single", single)):
        record = load_record(folder)
        record["sweep"] = record["experiment"] = None
        # as the runner opens a job's run: the group of its sweep and experiment names, here "adhoc"
        with open_run(record, mode="offline", dir=folder, group=wandb_group(None, None)) as tracker:
            tracker.log_record(record, folder)
        groups[name] = run_info(inspect_run(folder)[1])["run_group"]
    assert groups == {"multirun": "adhoc/2026-12-07_10-00-00", "single": "adhoc"}
    record = load_record(job)  # the fixture's named sweep, below the same folder: its own name
    with open_run(record, mode="offline", dir=job, group=wandb_group(record["sweep"], None)) as tracker:
        assert tracker.run.group == "fixture-sweep"


@pytest.mark.slow
def test_a_tracked_sequoia_job_reaches_w_and_b(tmp_path, wandb_home, monkeypatch):
    """A real Sequoia job on the tiny model, tracked: its record is logged, not left untracked."""
    from test_sequoia_topology import RUN, compose

    from harness.runner import run_job

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "job"
    record = run_job(compose([*RUN, "tracking=wandb", f"output_dir={out}"]), run_dir=out)
    assert load_record(out)["tracking"]["run_id"] == record["run_id"]
    info, records = inspect_run(out)
    assert info["state"] == "finished" and info["summary"]["outcome"] == "finished"
    assert info["summary"]["sequoia_tree_hash"] == record["artifacts"]["sequoia_tree_hash"]
    (artifact,) = [
        r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
    ]
    assert {
        c["path"].split("/")[1] for c in artifact["manifest"]["contents"] if c["path"].startswith("artifacts/")
    } == {
        "sequoia_tree",
        "sequoia_calibration",
        "sequoia_profile",
        "sequoia_profile_plot",
    }


#: a tracked job whose process dies (SIGKILL: an out-of-memory kill, a Slurm time limit) while W&B logs
#: its record: nothing after the logging runs
KILLED_WHILE_LOGGING = """
import os, sys
from pathlib import Path
import harness.tracking.wandb_tracker as wt
from harness.config import compose
from harness.runner import run_job

def killed(self, record, run_dir):
    os._exit(137)

wt.Tracker._log_series = killed
out = Path(sys.argv[1])
run_job(compose(sys.argv[2:] + [f"output_dir={out}"]), run_dir=out)
"""


def test_a_job_killed_while_w_and_b_logs_leaves_its_record_untracked_for_the_next_launch(
    tmp_path, wandb_home, monkeypatch
):
    """The record named its W&B run before the run held anything: a job killed while logging left a
    record pointing to an empty offline run, and no relaunch ever logged it."""
    import harness.runner as runner
    from harness.config import compose

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    repo = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    # a W&B service of its own, which dies with it, as a killed job's does (not this process's service)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    out = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_LOGGING, str(out), *JOB], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 137, done.stderr[-2000:]
    record = load_record(out)
    assert "tracking" not in record  # the record claims no W&B run, so a later launch logs it
    (killed,) = list((out / "wandb").glob("offline-run-*"))  # the killed run's half of a log
    assert runner.track(compose([*JOB, f"output_dir={out}"]), record, out) is True
    (logged,) = list((out / "wandb").glob("offline-run-*"))  # one run of the id: what a sync uploads
    assert load_record(out)["tracking"]["dir"] == f"wandb/{logged.name}" and logged != killed
    info, _ = inspect_run(out)
    assert info["state"] == "finished" and info["summary"]["run_id"] == record["run_id"]


def test_the_upload_command_said_is_quoted_for_a_shell(tmp_path, wandb_home, monkeypatch, capfd):
    """Job folders are named by their overrides (quotes, spaces, commas): the `wandb sync` command a
    fallback to offline printed split into several words in a shell."""
    import shlex

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: the run logs offline
    run_dir = tmp_path / "sweep" / "proposer=prompt_lookup,workload.path='/data/my prompts/p,1.jsonl'"
    shutil.copytree(FIXTURE_RUN, run_dir)
    record = load_record(run_dir)
    with open_run(record, mode="online", dir=run_dir) as tracker:
        described = tracker.describe()
        tracker.log_record(record, run_dir)
    (err,) = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    command = err.split("upload it later with `", 1)[1].rstrip("`")
    (sync_dir,) = list((run_dir / "wandb").glob("offline-run-*"))
    assert shlex.split(command) == ["wandb", "sync", str(sync_dir)]
    assert shlex.split(described["sync"]) == ["wandb", "sync", described["dir"]]
    assert (run_dir / described["dir"]).resolve() == sync_dir.resolve()


def test_round_ms_is_the_round_s_wall_time_at_every_batch_size():
    """``round/ms`` is the round's wall time from the rows' ``ms`` at every batch size (a batch round's
    shared stages counted once), also where the rows list fewer stages than their ``ms`` covers; the
    stages' own figures stand beside it."""
    from harness.tracking.wandb_tracker import round_steps

    def row(prompt: int, batch: int, own: float) -> dict:
        stages = {"proposal_ms": own, "selection_ms": 0.2, "target_verify_ms": 5.0, "temporary_state_ms": 0.5}
        untimed = 0.3  # the row's time in stages its series does not list
        return {
            "prompt_index": prompt,
            "batch_index": batch,
            "turn": 1,
            "round": 0,
            "accepted": 1,
            "committed": 2,
            "candidate_rows": 4,
            "ms": sum(stages.values()) + untimed,
            **stages,
        }

    alone = [row(0, 0, 1.0), row(1, 1, 2.0)]
    steps = round_steps(alone)
    assert [s["round/ms"] for s in steps] == [r["ms"] for r in alone]
    batched = [row(0, 0, 1.0), row(1, 0, 2.0)]
    (step,) = round_steps(batched)
    shared = 5.0 + 0.5
    assert step["round/live_requests"] == 2
    assert step["round/ms"] == pytest.approx(sum(r["ms"] for r in batched) - shared)  # each row's untimed part too
    assert step["round/proposal_ms"] == pytest.approx(3.0) and step["round/target_verify_ms"] == pytest.approx(5.0)
    assert step["round/ms"] > sum(v for k, v in step.items() if k.endswith("_ms") and k != "round/ms")
    # a batch round's rows without the shared stages' times: no wall time rather than another figure
    bare = [{k: v for k, v in r.items() if k != "target_verify_ms"} for r in batched]
    (step,) = round_steps(bare)
    assert "round/ms" not in step and "round/target_verify_ms" not in step
