"""W&B tracking: what reaches the offline log, read back with `wandb leet inspect`.

Each offline W&B run costs about a second, so only two tests start one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tracking.store import REQUIRED_METRICS, load_record
from harness.tracking.wandb_tracker import (
    DEFAULT_PROJECT,
    NullTracker,
    Tracker,
    axis_tags,
    open_run,
    tracker_from_config,
)

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "records" / "fixture-sweep" / "fx03-hydra-greedy-t0-b1"
WANDB_CLI = Path(sys.executable).parent / "wandb"


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A copy of a fixture run folder; W&B's own folders moved into tmp_path too."""
    for var, sub in (
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    dest = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, dest)
    return dest


def _inspect(path: Path, *, summary: bool) -> list[dict] | dict:
    args = [str(WANDB_CLI), "leet", "inspect", *(["--summary"] if summary else []), "--json", str(path)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    if summary:
        return json.loads(res.stdout)
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def test_log_record_reaches_the_offline_log(run_dir):
    record = load_record(run_dir)
    # the runner's flow: open from the resolved config after the gates, log the record at the end
    with open_run(record["config"], mode="offline", group=record["sweep"], dir=run_dir) as tracker:
        assert isinstance(tracker, Tracker)
        tracker.log_record(record, run_dir)
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))

    info = _inspect(offline, summary=True)
    assert info["state"] == "finished" and info["exit_code"] == 0
    assert info["project"] == DEFAULT_PROJECT
    summary = info["summary"]
    for name in REQUIRED_METRICS:
        assert name in summary, name
    assert summary["speedup"] == record["metrics"]["speedup"]
    assert summary["acceptance_by_depth"] == record["metrics"]["acceptance_by_depth"]
    assert summary["round_cost_ms"]["target_verify"] == record["metrics"]["round_cost_ms"]["target_verify"]
    assert summary["run_id"] == "fx03-hydra-greedy-t0-b1" and summary["exact"] is True
    assert summary["sweep"] == "fixture-sweep" and summary["experiment"] == "fixture-synthetic"
    for table in ("acceptance_by_depth_table", "accepted_length_hist_table", "round_cost_table"):
        assert summary[table]["_type"] == "table-file"
    assert summary["acceptance_by_depth_table"]["nrows"] == 6
    assert summary["round_cost_table"]["nrows"] == 6
    assert summary["accepted_length_hist_table"]["nrows"] == 7
    config = info["config"]
    assert config["proposer"] == {"name": "hydra"}
    assert config["topology"]["max_nodes"] == 32 and config["generation"]["temperature"] == 0
    assert set(info["tags"]) == set(axis_tags(record["axes"]))
    assert "proposer=hydra" in info["tags"] and "batch_size=1" in info["tags"]

    records = _inspect(offline, summary=False)
    runs = [r["run"] for r in records if r.get("type") == "run"]
    assert {r["run_group"] for r in runs} == {"fixture-sweep"}
    (artifact,) = [
        r["artifact"] for r in records if r.get("type") == "artifact" and r["artifact"]["type"] == "run-record"
    ]
    assert artifact["name"] == "record-fx03-hydra-greedy-t0-b1"
    paths = {c["path"] for c in artifact["manifest"]["contents"]}
    assert paths == {"record.json", "outputs.jsonl", "artifacts/tree/tree.json", "artifacts/profile/profile.json"}


def test_an_error_inside_the_run_marks_it_failed_and_is_reraised(run_dir):
    record = load_record(run_dir)
    (run_dir / "artifacts" / "profile.json").unlink()  # the record points at a missing artifact
    with pytest.raises(FileNotFoundError, match="record artifact 'profile' points to"):
        with open_run(record, mode="offline", dir=run_dir) as tracker:
            tracker.log_record(record, run_dir)
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
    info = _inspect(offline, summary=True)
    assert info["state"] == "failed" and info["exit_code"] == 1
    # opened from a record: group = its sweep, tags from its axes, before any log_record
    assert "verifier=greedy" in info["tags"]
    runs = [r["run"] for r in _inspect(offline, summary=False) if r.get("type") == "run"]
    assert {r["run_group"] for r in runs} == {"fixture-sweep"}


@pytest.mark.parametrize("tracking", [None, "none", {"name": "none"}, {"backend": "none"}])
def test_tracking_none_gives_a_null_tracker_that_logs_nothing(tmp_path, tracking):
    cfg = {"experiment": "x"} if tracking is None else {"experiment": "x", "tracking": tracking}
    tracker = tracker_from_config(cfg, run_dir=tmp_path)
    assert isinstance(tracker, NullTracker)
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
    assert list(tmp_path.iterdir()) == []


def test_axis_tags_keep_the_axis_order():
    axes = {"model": "m", "proposer": "rest", "temperature": 0.7, "extra": 1}
    assert axis_tags(axes) == ["proposer=rest", "temperature=0.7", "model=m", "extra=1"]
