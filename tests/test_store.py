"""Run records and the Parquet results store, on the fixture sweep (records the runner wrote on the
tiny model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers import FIXTURE_ROOT, FIXTURE_SWEEP, fixture_run, fixture_run_id

from harness.tracking.store import (
    AXES,
    REQUIRED_METRICS,
    RecordError,
    aggregate,
    flatten_record,
    json_column,
    left_out_records,
    load_record,
    no_records_message,
    read_results,
    rebuild_store,
    validate_record,
    write_store,
)

FIXTURES = FIXTURE_ROOT
SWEEP = FIXTURE_SWEEP
DRAFT = fixture_run(3)  # draft_model, expansion tree, greedy, B = 1


def _copy_sweep(tmp_path: Path) -> Path:
    root = tmp_path / "records"
    shutil.copytree(SWEEP, root / "fixture-sweep")
    return root


def _missing_as_none(df: pd.DataFrame) -> pd.DataFrame:
    return df.astype(object).where(df.notna(), None)


def _write(run_dir: Path, record: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "record.json").write_text(json.dumps(record))
    return run_dir / "record.json"


def test_load_record_reads_a_run_folder_or_its_file():
    rec = load_record(DRAFT)
    assert rec == load_record(DRAFT / "record.json") == json.loads((DRAFT / "record.json").read_text())
    assert rec["axes"]["proposer"] == "draft_model" and rec["run_id"].startswith(rec["manifest_hash"])


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
        (lambda r: r["gates"]["negotiation"].pop("status"), "gates.negotiation.status must be one of"),
        (lambda r: r["gates"].pop("oracle"), "gates is missing required keys ['oracle']"),
        (lambda r: r.pop("gated"), "gated must be bool; got NoneType None"),
        (lambda r: r.update(t_profile={"n": [1, 2], "t": [1.0]}), "same length; got 2 and 1"),
        (
            lambda r: r["per_prompt"][0].update(spec_decode_ms=float("nan")),
            "per_prompt[0].spec_decode_ms must be a finite number >= 0",
        ),
        (lambda r: r["per_prompt"][1].update(ar_tokens=-3), "per_prompt[1].ar_tokens must be a whole number >= 1"),
        # a prompt's arms each generate a token at least: a count of 0 made compare print a speedup of 0.000x
        (
            lambda r: r["per_prompt"][0].update(spec_tokens=0),
            "per_prompt[0].spec_tokens must be a whole number >= 1 (each arm generates a token at least; prompt",
        ),
        (lambda r: r["per_prompt"][1].update(ar_tokens=0), "per_prompt[1].ar_tokens must be a whole number >= 1"),
        (lambda r: r["per_prompt"][0].update(ar_tokens=2.5), "per_prompt[0].ar_tokens must be a whole number >= 1"),
        # a null category made a category column named None
        (lambda r: r["per_prompt"][0].update(category=None), "per_prompt[0].category must be a non-empty string"),
        (lambda r: r["per_prompt"][1].update(category=" "), "per_prompt[1].category must be a non-empty string"),
        (lambda r: r["per_prompt"][0].update(prompt_id=""), "per_prompt[0].prompt_id must be a non-empty string"),
        (lambda r: r["per_prompt"][0].update(prompt_id=7), "per_prompt[0].prompt_id must be a non-empty string; got 7"),
        (lambda r: r["per_prompt"][0].update(ar_prefill_ms="5"), "per_prompt[0].ar_prefill_ms must be a finite"),
        (lambda r: r.update(per_prompt=[]), "per_prompt is empty: a run records every prompt it measured"),
        (lambda r: r["axes"].update(batch_size="four"), "axes.batch_size must be a whole number >= 1; got 'four'"),
        (lambda r: r["axes"].update(temperature=-1), "axes.temperature must be a finite number >= 0; got -1"),
        # the elements of the lists compare, report and export compute with
        (
            lambda r: r["metrics"].update(accepted_length_hist=["3", "4"]),
            "metrics.accepted_length_hist[0] must be a whole number >= 0; got str '3'",
        ),
        (
            lambda r: r["metrics"].update(acceptance_by_depth=[0.5, "high"]),
            "metrics.acceptance_by_depth[1] must be a finite number >= 0 or null; got str 'high'",
        ),
        (
            lambda r: r["metrics"].update(rounds_tried_by_depth=[3, 1.5]),
            "metrics.rounds_tried_by_depth[1] must be a whole number >= 0; got float 1.5",
        ),
        (
            lambda r: r["metrics"].update(timing_outliers=["code-0"]),
            "metrics.timing_outliers[0] must be dict; got str 'code-0'",
        ),
        (
            lambda r: r["metrics"].update(timing_outliers=[{"prompt_id": "code-0", "arm": "spec", "ratio": "3x"}]),
            "metrics.timing_outliers[0].ratio must be a finite number >= 0; got '3x'",
        ),
        (lambda r: r["per_prompt"][0].update(spec_rounds="nine"), "per_prompt[0].spec_rounds must be a finite number"),
        (lambda r: r.update(t_profile={"n": [1, "2"], "t": [1.0, 2.0]}), "t_profile.n[1] must be a finite number"),
        # a failed gate stops its run: no record the runner wrote holds one
        (
            lambda r: r["gates"]["equivalence"].update(status="failed"),
            "gates.equivalence failed: a failed gate stops its run before a record is written",
        ),
        # the files a record binds: a digest, a row count and a file name of its folder, each checked
        # before the store, a relaunch's plan or a report computes with them
        (
            lambda r: r["outputs"].update(sha256=None),
            "outputs.sha256 must be a SHA-256 digest (64 lowercase hex digits); got NoneType None",
        ),
        (lambda r: r["outputs"].update(sha256="AB" * 32), "outputs.sha256 must be a SHA-256 digest"),
        (lambda r: r["outputs"].update(sha256="ab" * 31), "outputs.sha256 must be a SHA-256 digest"),
        (lambda r: r["outputs"].update(rows=True), "outputs.rows must be a whole number >= 0; got bool True"),
        (lambda r: r["outputs"].update(rows=-1), "outputs.rows must be a whole number >= 0; got int -1"),
        (lambda r: r["outputs"].update(file="sub/outputs.jsonl"), "outputs.file must be a file name in the record's"),
        (lambda r: r["outputs"].update(file=""), "outputs.file must be a file name in the record's folder; got str ''"),
        (
            lambda r: r["round_series"].update(sha256=5),
            "round_series.sha256 must be a SHA-256 digest (64 lowercase hex digits); got int 5",
        ),
        (lambda r: r["round_series"].update(sha256=None), "round_series.sha256 must be a SHA-256 digest"),
        (lambda r: r["round_series"].update(rows=True), "round_series.rows must be a whole number >= 0; got bool"),
        (lambda r: r["round_series"].update(rows=2.0), "round_series.rows must be a whole number >= 0; got float"),
        (lambda r: r["round_series"].update(file="../rounds.jsonl"), "round_series.file must be a file name in the"),
        (lambda r: r["round_series"].update(file=".rounds.jsonl"), "round_series.file must be a file name in the"),
        (lambda r: r["round_series"].update(file=["rounds.jsonl"]), "round_series.file must be a file name in the"),
    ],
)
def test_load_record_refuses_bad_records_with_the_key_and_values(tmp_path, mutate, message):
    rec = load_record(DRAFT)
    mutate(rec)
    path = _write(tmp_path / "run", rec)
    with pytest.raises(RecordError, match=None) as info:
        load_record(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_a_round_series_bound_by_a_digest_or_by_none_is_a_valid_record(tmp_path):
    """Records written before the round series was bound by its SHA-256 name none; a record naming one
    names a 64-digit lowercase hex digest."""
    rec = load_record(DRAFT)
    assert "sha256" not in rec["round_series"]
    rec["round_series"]["sha256"] = "0123456789abcdef" * 4
    assert load_record(_write(tmp_path / "run", rec)) == rec


def test_load_record_refuses_missing_and_broken_files(tmp_path):
    with pytest.raises(RecordError, match="no such record file"):
        load_record(tmp_path / "nothing")
    (tmp_path / "record.json").write_text("{not json")
    with pytest.raises(RecordError, match="not valid JSON"):
        load_record(tmp_path)
    folder = tmp_path / "odd" / "record.json"
    folder.mkdir(parents=True)  # its path was doubled: odd/record.json/record.json: no such record file
    with pytest.raises(RecordError, match=r"odd/record.json: a folder, where a run's record file belongs$"):
        load_record(folder)


def test_aggregate_flattens_one_row_per_run():
    df = aggregate(FIXTURES)
    assert len(df) == 11
    assert df["run_id"].is_unique
    assert list(df["run_id"]) == sorted(df["run_id"])
    sections = {"exact": 8, "cpu_budget_artifact": 1, "heuristic": 1, "ungated": 1}
    assert df["section"].value_counts().to_dict() == sections
    for col in (
        *AXES,
        *[m for m in REQUIRED_METRICS if m != "round_cost_ms"],
        "round_cost_ms.target_verify",
        "config.topology.max_nodes",
        "hardware.torch",
        "artifacts.proposer_artifact.kind",  # the trained heads of the hydra run
        "record_dir",
    ):
        assert col in df.columns, col
    by_id = df.set_index("run_id")
    rec = load_record(DRAFT)
    row = by_id.loc[rec["run_id"]]
    assert row["speedup"] == rec["metrics"]["speedup"]
    assert row["round_cost_ms.target_verify"] == rec["metrics"]["round_cost_ms"]["target_verify"]
    assert row["config.topology.max_nodes"] == rec["config"]["topology"]["max_nodes"] == 16
    assert row["record_dir"] == f"fixture-sweep/{DRAFT.name}"
    assert row["section"] == "exact" and bool(row["gated"]) is True
    decoded = json_column(by_id, "acceptance_by_depth")
    assert decoded[rec["run_id"]] == rec["metrics"]["acceptance_by_depth"]
    # artifact runs, heuristic runs and runs with a gate switched off are told apart
    sec = by_id["section"]
    assert sec[fixture_run_id(9)] == "cpu_budget_artifact"  # heads trained on 2,000 tokens
    assert sec[fixture_run_id(10)] == "heuristic"  # typical acceptance, generation.exact=false
    assert sec[fixture_run_id(11)] == "ungated"  # gates.oracle=false
    assert by_id.loc[fixture_run_id(9), "artifacts.proposer_artifact.kind"] == "hydra"
    # t_profile kept only where the record has one (the adaptive prompt lookup run)
    profiles = json_column(by_id, "t_profile")
    assert profiles[fixture_run_id(1)] is None
    assert profiles[fixture_run_id(11)] == load_record(fixture_run(11))["t_profile"]


def test_store_round_trips_through_parquet_and_rebuilds_from_records(tmp_path):
    root = _copy_sweep(tmp_path)
    df = rebuild_store(root)
    stored, where = read_results(root / "store.parquet")
    assert where == root
    # a key only some runs have (REST's retrieval.*) is missing elsewhere: NaN in the aggregated
    # frame, None once read back from Parquet; both are "missing", compared as such
    pd.testing.assert_frame_equal(_missing_as_none(stored), _missing_as_none(df), check_dtype=False)
    # delete the store and a record: rebuilding reflects the records only
    (root / "store.parquet").unlink()
    shutil.rmtree(root / "fixture-sweep" / fixture_run(5).name)
    df2 = rebuild_store(root, tmp_path / "out" / "s.parquet")
    assert len(df2) == 10 and fixture_run_id(5) not in set(df2["run_id"])
    assert len(pd.read_parquet(tmp_path / "out" / "s.parquet")) == 10


def test_a_store_whose_job_was_re_run_since_is_refused_as_stale(tmp_path):
    """A job re-run in place (`harness run output_dir=<job folder>`) after the sweep built its
    store: the store still showed the replaced run as current, beside the folder's new record. It
    is refused now, naming the folder and both runs; a store copied away from its records reads."""
    root = _copy_sweep(tmp_path)
    rebuild_store(root)
    job = root / "fixture-sweep" / fixture_run(2).name
    record = json.loads((job / "record.json").read_text())
    record["run_id"] = "0000000000000000-20261206T120000-abcdef"
    (job / "record.json").write_text(json.dumps(record, indent=2))
    with pytest.raises(RecordError, match=r"store.parquet is stale: fixture-sweep/fx02-[^ ]+ now holds run "):
        read_results(root / "store.parquet")
    try:
        read_results(root / "store.parquet")
    except RecordError as exc:
        assert f"the store's row is run {fixture_run_id(2)}" in str(exc) and f"`{root}`" in str(exc)
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy(root / "store.parquet", away / "store.parquet")
    assert len(read_results(away / "store.parquet")[0]) == 11


def test_a_store_lacking_a_complete_job_written_after_it_is_refused_as_stale(tmp_path):
    """A complete job written into the records folder after its store was built was left out, with
    nothing said, by compare and report reading the store. The store is refused now, naming the
    folder and the run; a record that is no complete job (outputs missing) does not make it stale,
    and a store copied away from its records still reads."""
    root = tmp_path / "records"
    shutil.copytree(fixture_run(1), root / "one")
    rebuild_store(root)
    assert list(read_results(root / "store.parquet")[0]["run_id"]) == [fixture_run_id(1)]
    shutil.copytree(fixture_run(2), root / "two")
    outputs = root / "two" / "outputs.jsonl"
    kept = outputs.read_bytes()
    outputs.unlink()  # no complete job yet: the folder leaves it out too
    assert len(read_results(root / "store.parquet")[0]) == 1
    outputs.write_bytes(kept)
    with pytest.raises(RecordError) as info:
        read_results(root / "store.parquet")
    assert str(info.value) == (
        f"{root / 'store.parquet'} is stale: two holds run {fixture_run_id(2)}, a complete job the store lacks "
        f"(written after the store was built); give the folder instead (`{root}`: its records are read now, "
        "without the store), or launch the sweep again to rebuild the store"
    )
    assert set(read_results(root)[0]["run_id"]) == {fixture_run_id(1), fixture_run_id(2)}
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy(root / "store.parquet", away / "store.parquet")
    shutil.copytree(fixture_run(3), away / "three")  # beside a store of other folders: not its own records
    assert len(read_results(away / "store.parquet")[0]) == 1


def test_a_store_counting_a_run_whose_outputs_changed_since_is_refused(tmp_path):
    """The folder leaves out a record whose bound outputs changed (no complete job); the store built
    before the change still counted it, so the two gave different figures. The store is refused,
    naming the job and why, and the folder reads as before."""
    root = _copy_sweep(tmp_path)
    rebuild_store(root)
    job = root / "fixture-sweep" / fixture_run(3).name
    with open(job / "outputs.jsonl", "a", encoding="utf-8") as fh:
        fh.write("{}\n")
    with pytest.raises(
        RecordError, match=r"store.parquet counts a run that is no complete job now: fixture-sweep/fx03-"
    ):
        read_results(root / "store.parquet")
    try:
        read_results(root / "store.parquet")
    except RecordError as exc:
        assert "its outputs.jsonl is not the one the record binds" in str(exc) and f"`{root}`" in str(exc)
    assert fixture_run_id(3) not in set(read_results(root)[0]["run_id"])


def test_the_store_reads_a_job_folder_under_a_dot_folder_and_skips_only_the_harness_s_own(tmp_path):
    """A sweep names a job's folder by its overrides, so a path value (``workload.path=/x/.data/p.jsonl``)
    nests it under a dot folder: every hidden folder was skipped, and that job was in no store,
    compare or report. A dot folder within a job folder's name is searched now; a job's earlier files
    (``.previous``), Hydra's and submitit's folders and other hidden folders are still left out."""
    root = _copy_sweep(tmp_path)
    run = root / "fixture-sweep" / fixture_run(1).name
    nested = root / "workload.path=" / "x" / ".data" / "p.jsonl"
    nested.parent.mkdir(parents=True)
    shutil.move(str(run), str(nested))
    for kept_out in (".previous", ".hydra", ".submitit"):
        shutil.copytree(nested, root / "fixture-sweep" / fixture_run(2).name / kept_out / "earlier")
    shutil.copytree(nested, root / ".bak" / "run")  # a user's hidden copy is no current record either
    shutil.copytree(nested, nested / ".previous" / "earlier")
    df = rebuild_store(root)
    assert len(df) == 11 and fixture_run_id(1) in set(df["run_id"])


def test_store_refuses_duplicate_run_ids_and_bad_paths(tmp_path):
    root = _copy_sweep(tmp_path)
    shutil.copytree(root / "fixture-sweep" / fixture_run(1).name, root / "again")
    with pytest.raises(RecordError, match=f"duplicate run_id '{fixture_run_id(1)}'"):
        aggregate(root)
    with pytest.raises(ValueError, match="must end in .parquet; got"):
        write_store(pd.DataFrame({"a": [1]}), tmp_path / "store.csv")
    with pytest.raises(RecordError, match="expected a records folder or a .parquet store"):
        read_results(tmp_path / "missing.parquet")
    # a Parquet file of other data, and a file that is no Parquet: refused naming the file (report gave
    # "error: KeyError: 'section'", compare "refused: section")
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "other.parquet")
    with pytest.raises(RecordError) as err:
        read_results(tmp_path / "other.parquet")
    assert str(err.value) == (
        f"{tmp_path / 'other.parquet'}: not a store this harness wrote (it has no run_id, section, record_dir, "
        "per_prompt or 7 more columns); give a records folder, or the store.parquet a sweep wrote"
    )
    (tmp_path / "junk.parquet").write_text("nope")
    with pytest.raises(RecordError, match=r"junk.parquet: not a readable Parquet file \(ArrowInvalid: "):
        read_results(tmp_path / "junk.parquet")
    # an empty store (a folder with no records) is still a store
    (tmp_path / "empty").mkdir()
    write_store(aggregate(tmp_path / "empty"), tmp_path / "empty.parquet")
    assert read_results(tmp_path / "empty.parquet")[0].empty


def test_mixed_type_config_values_still_write(tmp_path):
    root = _copy_sweep(tmp_path)
    shutil.copytree(DRAFT, root / "extra")  # the outputs the record binds come along
    rec = load_record(DRAFT)
    rec["run_id"] = "extra"
    rec["config"]["model"]["revision"] = 3
    first = root / "fixture-sweep" / fixture_run(1).name
    other = load_record(first)
    other["config"]["model"]["revision"] = "main"
    _write(root / "extra", rec)
    _write(first, other)
    df = rebuild_store(root)
    back = pd.read_parquet(root / "store.parquet").set_index("run_id")
    assert len(df) == 12
    assert json.loads(back.loc["extra", "config.model.revision"]) == 3
    assert json.loads(back.loc[other["run_id"], "config.model.revision"]) == "main"


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
    rec = schema_1(load_record(DRAFT))
    assert flatten_record(rec)["gated"] is True
    rec["gates"]["statistical"] = entry
    row = flatten_record(rec)
    assert row["gated"] is gated and (row["section"] == "ungated") is (not gated)
    rec["gates"] = {"negotiation": {"passed": True}, "skipped": {"passed": True, "evidence": "gates.enabled=false"}}
    assert flatten_record(rec)["gated"] is False  # what gates.enabled=false wrote in schema 1
    # a gate switched off by its own option was left out of a schema-1 record with nothing to say so
    for switch, value in (
        ("oracle", False),
        ("equivalence", False),
        ("statistical", False),
        ("skip_statistical", True),
    ):
        off = schema_1(load_record(DRAFT))
        off["gates"].pop(switch if switch != "skip_statistical" else "statistical", None)
        off["config"]["gates"][switch] = value
        assert flatten_record(off)["gated"] is False, switch


@pytest.mark.parametrize(
    "gates",
    [
        {},  # no gate at all
        {"oracle": {"passed": None}},  # a null where the runner wrote true
        {"negotiation": {"passed": True}, "oracle": {"passed": True}, "greedy_equality": {"passed": None}},
        {
            "negotiation": {"passed": True},
            "oracle": {"passed": None},
            "equivalence": {"passed": True},
            "greedy_equality": {"passed": None},
        },
        {"negotiation": {"passed": True}, "oracle": {"passed": True}, "equivalence": {"passed": True}},
    ],
)
def test_schema_1_records_are_gated_only_with_the_gate_evidence_that_runner_wrote(tmp_path, gates):
    """A schema-1 record with ``"gates": {}``, or with a gate whose ``passed`` is null, counted as
    gated and exact: nothing was skipped, so nothing said otherwise. That runner wrote negotiation,
    oracle and equivalence with ``passed: true`` and greedy equality (or the statistical gate) for
    every run with its gates on; a record with less is ungated."""
    rec = schema_1(load_record(DRAFT))
    assert flatten_record(validate(rec, tmp_path))["section"] == "exact"  # the full set: gated
    rec["gates"] = gates
    row = flatten_record(validate(rec, tmp_path))
    assert row["gated"] is False and row["section"] == "ungated"


def test_schema_1_records_of_a_sampling_run_are_gated_by_the_statistical_gate(tmp_path):
    rec = schema_1(load_record(fixture_run(4)))  # specinfer at T > 0: the statistical gate ran
    assert "greedy_equality" not in rec["gates"] and rec["gates"]["statistical"] == {"passed": True}
    assert flatten_record(validate(rec, tmp_path))["gated"] is True
    rec["gates"]["statistical"] = {"passed": None, "skipped": True, "evidence": "gates.skip_statistical=true"}
    assert flatten_record(validate(rec, tmp_path))["gated"] is False


def test_a_schema_1_record_with_a_failed_gate_is_refused(tmp_path):
    rec = schema_1(load_record(DRAFT))
    rec["gates"]["oracle"] = {"passed": False}
    with pytest.raises(RecordError, match=r"gates.oracle failed: a failed gate stops its run"):
        validate(rec, tmp_path)


def test_schema_2_records_state_gated_and_every_gate_status(tmp_path):
    from harness.record_schema import GATES

    rec = load_record(DRAFT)
    assert rec["schema_version"] == 2
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


def schema_1(rec: dict) -> dict:
    """A schema-1 record of the same run, as the runner wrote them before per-gate statuses: only
    the gates that ran, each ``passed: true``, and no ``gated``."""
    rec = {k: v for k, v in rec.items() if k != "gated"}
    rec["schema_version"] = 1
    rec["gates"] = {name: {"passed": True} for name, g in rec["gates"].items() if g["status"] == "passed"}
    return validate_record(rec)


def validate(rec, tmp_path):
    return load_record(_write(tmp_path / "r", rec))


def test_a_store_counting_a_record_set_aside_since_is_refused_as_stale(tmp_path):
    """A job re-run after the store was built, whose gate then failed, has its record set aside to
    ``<job>/.previous/``: the store still counted it (a folder without a record read as one copied
    away). It is refused, naming the folder and that its record was set aside; the folder reads
    without it, and a store copied away from its records still reads."""
    root = _copy_sweep(tmp_path)
    rebuild_store(root)
    job = root / "fixture-sweep" / fixture_run(2).name
    aside = job / ".previous" / "20261206T120000-abcdef"
    aside.mkdir(parents=True)
    for name in ("record.json", "outputs.jsonl", "rounds.jsonl"):
        shutil.move(str(job / name), str(aside / name))
    with pytest.raises(RecordError) as info:
        read_results(root / "store.parquet")
    message = str(info.value)
    assert f"store.parquet is stale: fixture-sweep/{job.name} holds no record now" in message
    assert f"(it was set aside to fixture-sweep/{job.name}/.previous/ by a re-run that wrote none)" in message
    assert f"the store's row is run {fixture_run_id(2)}" in message and f"`{root}`" in message
    assert fixture_run_id(2) not in set(read_results(root)[0]["run_id"])
    shutil.rmtree(job / ".previous")  # a job folder emptied by hand: its record is gone, not set aside
    with pytest.raises(RecordError, match=f"fixture-sweep/{job.name} holds no record now \\(it was removed\\)"):
        read_results(root / "store.parquet")
    shutil.rmtree(job)  # the job folder removed beside the others': as stale
    with pytest.raises(RecordError, match=f"fixture-sweep/{job.name} is gone"):
        read_results(root / "store.parquet")
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy(root / "store.parquet", away / "store.parquet")
    assert len(read_results(away / "store.parquet")[0]) == 11


def test_a_record_that_is_not_utf8_or_cannot_be_read_is_refused_naming_its_file(tmp_path, monkeypatch):
    """A record.json in another encoding raised a UnicodeDecodeError that named no file: compare and
    report refused with a line saying which byte, not which record."""
    path = tmp_path / "run" / "record.json"
    path.parent.mkdir()
    path.write_bytes(json.dumps({"run_id": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(RecordError, match=r"record.json: not UTF-8 text \(invalid continuation byte at byte 15\)$"):
        load_record(path)
    with pytest.raises(RecordError, match=str(path)):
        aggregate(tmp_path)
    path.write_text("{}")

    def unreadable(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", unreadable)
    with pytest.raises(RecordError, match=r"record.json: cannot be read \(Permission denied\)$"):
        load_record(path)


def test_a_record_binding_its_outputs_by_no_digest_is_refused_naming_its_file_and_field(tmp_path):
    """A record whose outputs.sha256 was null passed as valid: the store, a relaunch's plan and the
    sweep's store step then raised a bare TypeError naming no file. It is refused as an invalid record,
    by the folder and by a store built before it changed."""
    root = _copy_sweep(tmp_path)
    rebuild_store(root)
    path = root / "fixture-sweep" / fixture_run(3).name / "record.json"
    record = json.loads(path.read_text())
    record["outputs"]["sha256"] = None
    path.write_text(json.dumps(record))
    for read in (aggregate, rebuild_store, read_results):
        with pytest.raises(RecordError) as info:
            read(root)
        assert str(info.value).startswith(f"{path}: outputs.sha256 must be a SHA-256 digest")
    assert left_out_records(root) == []  # refused outright, not left out
    with pytest.raises(RecordError) as info:
        read_results(root / "store.parquet")
    message = str(info.value)
    assert (
        f"counts a run that is no complete job now: fixture-sweep/{fixture_run(3).name}: its record is no " in message
    )
    assert "outputs.sha256 must be a SHA-256 digest" in message


def test_a_job_whose_round_series_is_missing_or_cut_short_is_left_out_as_a_relaunch_leaves_it(tmp_path):
    """A relaunch runs again a job whose rounds.jsonl is gone or changed (no complete job), while the
    store, compare and report still counted it. The folder now leaves it out, naming why; a store
    built before it changed is refused; a store missing it is not stale for it."""
    root = _copy_sweep(tmp_path)
    rebuild_store(root)
    job = root / "fixture-sweep" / fixture_run(3).name
    rounds = job / "rounds.jsonl"
    text = rounds.read_text()
    rounds.write_text("".join(text.splitlines(keepends=True)[:5]))
    why = "its rounds.jsonl holds 5 rows, its record 25"
    assert fixture_run_id(3) not in set(aggregate(root)["run_id"]) and len(aggregate(root)) == 10
    assert left_out_records(root) == [(f"fixture-sweep/{job.name}", why)]
    with pytest.raises(RecordError, match=f"no complete job now: fixture-sweep/{job.name}: {why}"):
        read_results(root / "store.parquet")
    rounds.unlink()
    assert left_out_records(root) == [(f"fixture-sweep/{job.name}", "its rounds.jsonl is missing")]
    with pytest.raises(RecordError, match=f"fixture-sweep/{job.name}: its rounds.jsonl is missing"):
        read_results(root / "store.parquet")
    rebuild_store(root)  # without the job: a store that lacks it is no stale one
    assert len(read_results(root / "store.parquet")[0]) == 10
    rounds.write_text(text)  # complete again: the store lacks a complete job now
    with pytest.raises(RecordError, match=f"is stale: fixture-sweep/{job.name} holds run {fixture_run_id(3)}"):
        read_results(root / "store.parquet")

    only = tmp_path / "only"
    shutil.copytree(fixture_run(3), only / "one")
    (only / "one" / "rounds.jsonl").unlink()
    assert aggregate(only, warn_if_none_left=False).empty
    assert no_records_message(only, only) == (
        f"no complete run records under {only}: 1 record(s) left out because their outputs or round series are "
        "not the ones they bind (one: its rounds.jsonl is missing)"
    )


def test_a_store_of_a_config_key_of_mixed_types_reads_a_run_lacking_it_as_null(tmp_path):
    """A config key that is a number in one run, a string in another and absent in a third: the store
    wrote the third's NaN as the JSON text "NaN", so it read back as a value where the folder gave
    none (compare's option text "NaN", not "null")."""
    root = tmp_path / "records"
    for i, value in enumerate([8, "auto", None]):
        job = root / f"j{i}"
        shutil.copytree(DRAFT, job)
        rec = load_record(job)
        rec["run_id"] = f"run-{i}"
        if value is None:
            rec["config"]["topology"].pop("budget", None)
        else:
            rec["config"]["topology"]["budget"] = value
        _write(job, rec)
    rebuild_store(root)
    folder = read_results(root)[0].set_index("run_id")["config.topology.budget"]
    stored = read_results(root / "store.parquet")[0].set_index("run_id")["config.topology.budget"]
    assert folder.isna().tolist() == stored.isna().tolist() == [False, False, True]
    assert [json.loads(stored[f"run-{i}"]) for i in (0, 1)] == [folder["run-0"], folder["run-1"]] == [8, "auto"]
