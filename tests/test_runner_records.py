"""What `harness run` writes: the record's required fields, outputs.jsonl, the t(n) profile of an
adaptive lookup run, and that the store accepts the record."""

import json

from harness.config import compose
from harness.runner import run_job
from harness.tracking.store import load_record


def test_adaptive_lookup_run_writes_a_complete_record(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = compose(
        [
            "model=tiny",
            "topology=sequences",
            "proposer.budget_policy=adaptive",
            "workload.limit=2",
            "generation.max_new_tokens=12",
            "gates.oracle=false",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    record = run_job(cfg, run_dir=tmp_path / "run")
    stored = load_record(tmp_path / "run" / "record.json")  # validates schema and required keys
    assert stored["run_id"] == record["run_id"]
    m = record["metrics"]
    for key in (
        "time_per_committed_token_ms",
        "ar_time_per_token_ms",
        "speedup",
        "ttft_ms",
        "committed_tokens",
        "rounds",
        "mean_committed_per_round",
        "acceptance_by_depth",
        "reach_by_depth",
        "accepted_length_hist",
        "first_child_coverage",
        "fallback_rate",
        "round_cost_ms",
        "temp_kv_bytes_peak",
        "temp_kv_bytes_formula",
        "proposal_state_bytes",
        "peak_rss_bytes",
        "greedy_identical",
        "greedy_near_ties",
    ):
        assert key in m, key
    assert set(m["round_cost_ms"]) == {
        "proposal",
        "retrieval",
        "packing",
        "target_verify",
        "selection",
        "temporary_state",
    }
    assert m["greedy_identical"] is True
    assert m["temp_kv_bytes_peak"] == m["temp_kv_bytes_formula"]
    assert m["speedup"] == m["ar_time_per_token_ms"] / m["time_per_committed_token_ms"]
    prof = record["t_profile"]
    assert prof["n"][0] == 1 and len(prof["n"]) == len(prof["t"]) and all(t > 0 for t in prof["t"])
    assert record["hardware"]["torch_threads"] >= 1 and record["manifest_hash"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(x["ar_token_ids"] == x["spec_token_ids"] for x in lines)
    assert {"prompt_id", "prompt_token_ids", "ar_token_ids", "spec_token_ids", "ar_text", "spec_text"} <= set(lines[0])
