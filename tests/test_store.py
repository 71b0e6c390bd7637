"""Run records and the Parquet results store, on synthetic fixture records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.tracking.store import (
    AXES,
    REQUIRED_METRICS,
    RecordError,
    aggregate,
    flatten_record,
    json_column,
    load_record,
    read_results,
    rebuild_store,
    write_store,
)

FIXTURES = Path(__file__).parent / "fixtures" / "records"
SWEEP = FIXTURES / "fixture-sweep"
HYDRA = SWEEP / "fx03-hydra-greedy-t0-b1"


def _copy_sweep(tmp_path: Path) -> Path:
    root = tmp_path / "records"
    shutil.copytree(SWEEP, root / "fixture-sweep")
    return root


def _write(run_dir: Path, record: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "record.json").write_text(json.dumps(record))
    return run_dir / "record.json"


def test_load_record_reads_a_run_folder_or_its_file():
    rec = load_record(HYDRA)
    assert rec["run_id"] == "fx03-hydra-greedy-t0-b1"
    assert rec == load_record(HYDRA / "record.json")
    assert rec["axes"]["proposer"] == "hydra"
    assert rec["metrics"]["round_cost_ms"]["proposal"] == 4.0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(schema_version=3), "expected one of [1, 2], got 3"),
        (lambda r: r.pop("schema_version"), "no schema_version"),
        (lambda r: r.pop("per_prompt"), "missing required keys ['per_prompt']"),
        (lambda r: r["metrics"].pop("speedup"), "metrics is missing required keys ['speedup']"),
        (lambda r: r["axes"].pop("verifier"), "axes is missing required keys ['verifier']"),
        (lambda r: r.update(exact="yes"), "exact must be bool; got str 'yes'"),
        (lambda r: r["per_prompt"][0].pop("ar_tokens"), "per_prompt[0] is missing required keys ['ar_tokens']"),
        (lambda r: r["metrics"]["round_cost_ms"].pop("selection"), "round_cost_ms is missing"),
        (lambda r: r["gates"]["negotiation"].pop("passed"), "gates.negotiation is missing"),
        (lambda r: r.update(t_profile={"n": [1, 2], "t": [1.0]}), "same length; got 2 and 1"),
    ],
)
def test_load_record_refuses_bad_records_with_the_key_and_values(tmp_path, mutate, message):
    rec = load_record(HYDRA)
    mutate(rec)
    path = _write(tmp_path / "run", rec)
    with pytest.raises(RecordError, match=None) as info:
        load_record(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_load_record_refuses_missing_and_broken_files(tmp_path):
    with pytest.raises(RecordError, match="no such record file"):
        load_record(tmp_path / "nothing")
    (tmp_path / "record.json").write_text("{not json")
    with pytest.raises(RecordError, match="not valid JSON"):
        load_record(tmp_path)


def test_fixture_records_are_internally_consistent():
    """The synthetic records obey the identities the compare/report code relies on."""
    for path in sorted(SWEEP.rglob("record.json")):
        rec = load_record(path)
        m, pp = rec["metrics"], rec["per_prompt"]
        spec = sum(p["spec_decode_ms"] for p in pp) / sum(p["spec_tokens"] for p in pp)
        ar = sum(p["ar_decode_ms"] for p in pp) / sum(p["ar_tokens"] for p in pp)
        assert m["speedup"] == pytest.approx(ar / spec, abs=1e-4)
        assert m["time_per_committed_token_ms"] == pytest.approx(spec, abs=1e-4)
        assert sum(m["accepted_length_hist"]) == m["rounds"]
        assert m["mean_committed_per_round"] == pytest.approx(1 + sum(m["reach_by_depth"]), abs=1e-3)
        assert len(m["acceptance_by_depth"]) == rec["config"]["topology"]["max_depth"]


def test_aggregate_flattens_one_row_per_run():
    df = aggregate(FIXTURES)
    assert len(df) == 10
    assert df["run_id"].is_unique
    assert list(df["run_id"]) == sorted(df["run_id"])
    assert df["section"].value_counts().to_dict() == {"exact": 8, "heuristic": 1, "cpu_budget_artifact": 1}
    for col in (
        *AXES,
        *[m for m in REQUIRED_METRICS if m != "round_cost_ms"],
        "round_cost_ms.target_verify",
        "config.topology.max_nodes",
        "hardware.torch",
        "artifacts.tree",
        "record_dir",
    ):
        assert col in df.columns, col
    row = df.set_index("run_id").loc["fx03-hydra-greedy-t0-b1"]
    rec = load_record(HYDRA)
    assert row["speedup"] == rec["metrics"]["speedup"]
    assert row["round_cost_ms.target_verify"] == rec["metrics"]["round_cost_ms"]["target_verify"]
    assert row["config.topology.max_nodes"] == 32
    assert row["record_dir"] == "fixture-sweep/fx03-hydra-greedy-t0-b1"
    assert row["section"] == "exact" and bool(row["gated"]) is True
    decoded = json_column(df.set_index("run_id"), "acceptance_by_depth")
    assert decoded["fx03-hydra-greedy-t0-b1"] == rec["metrics"]["acceptance_by_depth"]
    # artifact runs and heuristic runs are told apart
    sec = df.set_index("run_id")["section"]
    assert sec["fx09-prompt_lookup-greedy-t0-b1"] == "cpu_budget_artifact"
    assert sec["fx10-hydra-typical-t0.7-b1"] == "heuristic"
    # t_profile kept only where the record has one
    assert json_column(df.set_index("run_id"), "t_profile")["fx01-prompt_lookup-greedy-t0-b1"] is None


def test_store_round_trips_through_parquet_and_rebuilds_from_records(tmp_path):
    root = _copy_sweep(tmp_path)
    df = rebuild_store(root)
    stored, where = read_results(root / "store.parquet")
    assert where == root
    pd.testing.assert_frame_equal(stored, df, check_dtype=False)
    # delete the store and a record: rebuilding reflects the records only
    (root / "store.parquet").unlink()
    shutil.rmtree(root / "fixture-sweep" / "fx05-hydra-specinfer-t0.7-b1")
    df2 = rebuild_store(root, tmp_path / "out" / "s.parquet")
    assert len(df2) == 9 and "fx05-hydra-specinfer-t0.7-b1" not in set(df2["run_id"])
    assert len(pd.read_parquet(tmp_path / "out" / "s.parquet")) == 9


def test_store_refuses_duplicate_run_ids_and_bad_paths(tmp_path):
    root = _copy_sweep(tmp_path)
    shutil.copytree(root / "fixture-sweep" / "fx01-prompt_lookup-greedy-t0-b1", root / "again")
    with pytest.raises(RecordError, match="duplicate run_id 'fx01-prompt_lookup-greedy-t0-b1'"):
        aggregate(root)
    with pytest.raises(ValueError, match="must end in .parquet; got"):
        write_store(pd.DataFrame({"a": [1]}), tmp_path / "store.csv")
    with pytest.raises(RecordError, match="expected a records folder or a .parquet store"):
        read_results(tmp_path / "missing.parquet")


def test_mixed_type_config_values_still_write(tmp_path):
    root = _copy_sweep(tmp_path)
    rec = load_record(HYDRA)
    rec["run_id"] = "extra"
    rec["config"]["model"]["revision"] = 3
    other = load_record(root / "fixture-sweep" / "fx01-prompt_lookup-greedy-t0-b1")
    other["config"]["model"]["revision"] = "main"
    _write(root / "extra", rec)
    _write(root / "fixture-sweep" / "fx01-prompt_lookup-greedy-t0-b1", other)
    df = rebuild_store(root)
    back = pd.read_parquet(root / "store.parquet").set_index("run_id")
    assert len(df) == 11
    assert json.loads(back.loc["extra", "config.model.revision"]) == 3
    assert json.loads(back.loc["fx01-prompt_lookup-greedy-t0-b1", "config.model.revision"]) == "main"


def test_empty_folder_gives_an_empty_frame(tmp_path):
    df = aggregate(tmp_path)
    assert df.empty and "speedup" in df.columns


@pytest.mark.parametrize(
    "entry, gated",
    [
        ({"passed": True}, True),
        ({"passed": None, "evidence": "checked on every prompt"}, True),  # schema 1: checked during measurement
        ({"passed": None, "skipped": True, "evidence": "gates.skip_statistical=true"}, False),
        ({"passed": False}, False),
    ],
)
def test_schema_1_records_are_gated_only_when_no_gate_was_skipped(entry, gated):
    rec = load_record(HYDRA)
    assert rec["schema_version"] == 1
    rec["gates"]["statistical"] = entry
    row = flatten_record(rec)
    assert row["gated"] is gated and (row["section"] == "ungated") is (not gated)
    rec["gates"] = {"negotiation": {"passed": True}, "skipped": {"passed": True, "evidence": "gates.enabled=false"}}
    assert flatten_record(rec)["gated"] is False  # what gates.enabled=false wrote in schema 1


def test_schema_2_records_state_gated_and_every_gate_status(tmp_path):
    from harness.record_schema import GATES

    rec = load_record(HYDRA)
    rec["schema_version"] = 2
    rec["gates"] = {g: {"status": "passed"} for g in GATES}
    rec["gated"] = True
    assert flatten_record(validate(rec, tmp_path))["section"] == "exact"
    rec["gates"]["oracle"] = {"status": "skipped", "override": "gates.oracle=false"}
    with pytest.raises(RecordError, match="gated=True disagrees with its gate statuses"):
        validate(rec, tmp_path)
    rec["gated"] = False
    assert flatten_record(validate(rec, tmp_path))["section"] == "ungated"
    rec["gates"]["oracle"] = {"status": "maybe"}
    with pytest.raises(RecordError, match="gates.oracle.status must be one of"):
        validate(rec, tmp_path)
    del rec["gates"]["statistical"]
    rec["gates"]["oracle"] = {"status": "passed"}
    with pytest.raises(RecordError, match=r"gates is missing required keys \['statistical'\]"):
        validate(rec, tmp_path)


def validate(rec, tmp_path):
    return load_record(_write(tmp_path / "r", rec))
