"""The fixture sweep (tests/fixtures/records) is what the runner writes: every record validates
against the current schema as a complete job, carries the runner's gate structure, holds a config
the runner's plan accepts, and obeys the identities between its metrics, per-prompt rows and
per-round series. A hand-edited or stale fixture fails here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import FIXTURE_ROOT, FIXTURE_SWEEP
from omegaconf import OmegaConf

from harness.config import compose
from harness.record_schema import GATES, STATUSES, is_gated
from harness.runner import plan_job
from harness.tracking.store import SCHEMA_VERSION, aggregate, load_record, outputs_problem
from harness.verifiers import get_verifier
from harness.verifiers.base import NegotiationError

REPO = Path(__file__).resolve().parents[1]
RUN_DIRS = sorted(p.parent for p in FIXTURE_SWEEP.glob("*/record.json"))
#: the config groups a record's resolved config names its options by
GROUPS = ("model", "proposer", "topology", "verifier", "workload", "tracking")


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def test_the_sweep_holds_every_job_make_fixtures_runs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURE_ROOT / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    assert [p.name for p in RUN_DIRS] == [folder for folder, _ in make_fixtures.RUNS]


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: p.name[:4])
def test_every_fixture_is_a_complete_job_of_the_current_schema_with_the_runners_gates(run_dir):
    rec = load_record(run_dir)  # validates the schema, its required keys and types
    assert rec["schema_version"] == SCHEMA_VERSION
    assert outputs_problem(rec, run_dir) is None and rec["outputs"]["file"] == "outputs.jsonl"
    assert rec["sweep"] == "fixture-sweep" and rec["experiment"] is None
    assert list(rec["gates"]) == [g for g in GATES if g in rec["gates"]] and set(rec["gates"]) == set(GATES)
    assert all(entry["status"] in STATUSES and entry["status"] != "failed" for entry in rec["gates"].values())
    assert rec["gated"] is is_gated(rec["gates"])
    for entry in rec["gates"].values():
        if entry["status"] == "skipped":
            assert entry["override"].startswith("gates.")  # what switched it off
        if entry["status"] == "not_applicable":
            assert entry["why"]
    axes, config = rec["axes"], rec["config"]
    assert axes == {
        "model": config["model"]["name"],
        "proposer": config["proposer"]["name"],
        "topology": config["topology"]["name"],
        "verifier": config["verifier"]["name"],
        "temperature": config["generation"]["temperature"],
        "batch_size": config["generation"]["batch_size"],
        "workload": config["workload"]["name"],
    }
    assert rec["exact"] is get_verifier(axes["verifier"]).exact  # what the runner records
    if not rec["exact"]:
        assert config["generation"]["exact"] is False and "drift" in rec["metrics"]  # admitted outside exact mode
    arm = f"{axes['proposer']}-{axes['topology']}-{axes['verifier']}-t{axes['temperature']:g}-b{axes['batch_size']}"
    assert run_dir.name.endswith(arm)  # the folder says what ran


#: options added to the schema after the fixture records were written, each with the value the
#: runner gives a record that predates it (its default, what those runs did)
ADDED_OPTIONS = {("proposer", "data", "loss_tokens"): "assistant"}


def without_added_options(resolved: dict, config: dict) -> dict:
    """``resolved`` less the :data:`ADDED_OPTIONS` a record's ``config`` predates (each at its default)."""
    out = json.loads(json.dumps(resolved))
    for path, default in ADDED_OPTIONS.items():
        node, held = out, config
        for key in path[:-1]:
            node, held = node.get(key), (held or {}).get(key)
            if not isinstance(node, dict):
                break
        else:
            if path[-1] in node and not (isinstance(held, dict) and path[-1] in held):
                assert node.pop(path[-1]) == default, path
    return out


def plan_record_config(config: dict, run_dir: Path):
    """The runner's plan stage on a record's resolved config, merged into the composed schema of
    its own options (struct mode: a key the schema no longer has is refused; one added since the
    record was written takes its default, :data:`ADDED_OPTIONS`)."""
    cfg = OmegaConf.merge(compose([f"{group}={config[group]['name']}" for group in GROUPS]), config)
    assert without_added_options(OmegaConf.to_container(cfg, resolve=True), config) == config
    return plan_job(cfg, run_dir)


@pytest.fixture
def at_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the fixtures name their inputs relative to the repository root
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: p.name[:4])
def test_every_fixture_config_is_one_the_runner_plans(run_dir, tmp_path, at_repo):
    """Values, negotiation, budgets, the workload, the context limit and the manifest."""
    config = load_record(run_dir)["config"]
    planned = plan_record_config(config, tmp_path / "job")
    assert planned.manifest["verifier"] == {
        "name": config["verifier"]["name"],
        "exact_mode": config["generation"]["exact"],
    }


def test_the_plan_check_refuses_what_the_runner_refuses(tmp_path, at_repo):
    heuristic = next(load_record(d)["config"] for d in RUN_DIRS if load_record(d)["exact"] is False)
    heuristic["generation"]["exact"] = True  # a heuristic verifier claimed exact
    with pytest.raises(NegotiationError, match="heuristic"):
        plan_record_config(heuristic, tmp_path / "job")
    rest = next(load_record(d)["config"] for d in RUN_DIRS if load_record(d)["axes"]["proposer"] == "rest")
    rest["verifier"]["name"], rest["generation"]["temperature"] = "specinfer", 0.7  # REST has no q
    with pytest.raises(NegotiationError):
        plan_record_config(rest, tmp_path / "job")


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=lambda p: p.name[:4])
def test_every_fixture_obeys_the_runners_metric_identities(run_dir):
    rec = load_record(run_dir)
    m, pp, rounds = rec["metrics"], rec["per_prompt"], _rounds(run_dir)
    outputs = [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines()]
    assert [o["prompt_id"] for o in outputs] == [p["prompt_id"] for p in pp]
    assert all(len(o["spec_token_ids"]) == p["spec_tokens"] for o, p in zip(outputs, pp))
    # tokens and rounds: metrics = per-prompt sums = the per-round series
    assert m["committed_tokens"] == sum(p["spec_tokens"] for p in pp) == sum(r["committed"] for r in rounds)
    assert m["ar_tokens"] == sum(p["ar_tokens"] for p in pp)
    assert m["rounds"] == sum(m["accepted_length_hist"]) == sum(p["spec_rounds"] for p in pp) == len(rounds)
    assert rec["round_series"] == {"file": "rounds.jsonl", "rows": len(rounds), "arm": "spec"}
    assert {r["prompt_id"] for r in rounds} == {p["prompt_id"] for p in pp}
    accepted = sum(k * n for k, n in enumerate(m["accepted_length_hist"]))
    assert accepted == sum(r["accepted"] for r in rounds) == sum(m["rounds_accepted_by_depth"])
    assert m["mean_committed_per_round"] == pytest.approx(m["committed_tokens"] / m["rounds"], rel=1e-12)
    # rates by depth are the counts behind them
    tried, acc = m["rounds_tried_by_depth"], m["rounds_accepted_by_depth"]
    assert m["acceptance_by_depth"] == [a / n if n else None for a, n in zip(acc, tried)]
    assert m["reach_by_depth"] == [a / m["rounds"] for a in acc]
    assert max(r["tree_depth"] for r in rounds) <= len(tried) <= rec["config"]["topology"]["max_depth"]
    # times: decode time per token is the batches' decode time over their tokens; speedups are ratios
    batches = {p["batch_index"]: p for p in pp}
    assert len(batches) == m["batches"] == math.ceil(len(pp) / rec["axes"]["batch_size"])
    spec_ms = sum(p["spec_batch_decode_ms"] for p in batches.values())
    ar_ms = sum(p["ar_batch_decode_ms"] for p in batches.values())
    assert m["time_per_committed_token_ms"] == pytest.approx(spec_ms / m["committed_tokens"], rel=1e-12)
    assert m["ar_time_per_token_ms"] == pytest.approx(ar_ms / m["ar_tokens"], rel=1e-12)
    assert m["decode_speedup"] == pytest.approx(m["ar_time_per_token_ms"] / m["time_per_committed_token_ms"])
    assert m["speedup"] == pytest.approx(m["ar_end_to_end_time_per_token_ms"] / m["end_to_end_time_per_token_ms"])
    # the round-cost ledger: each round's stages sum to its time; the requests' rows add up to the
    # batch rounds' stages (the loops' own time shared among the live requests), and at B = 1 each
    # row is its round (verify and commit are the batch's, counted once per round at any B)
    stages = list(m["round_cost_ms"])
    assert all(r["ms"] == pytest.approx(sum(r[f"{s}_ms"] for s in stages)) for r in rounds)
    for s in ("proposal", "retrieval", "packing", "selection"):
        total = sum(r[f"{s}_ms"] for r in rounds)
        assert total == pytest.approx(m["round_cost_ms"][s] * m["batch_rounds"], rel=1e-9, abs=1e-9)
    if rec["axes"]["batch_size"] == 1:
        assert m["batch_rounds"] == m["rounds"]
        for s in stages:
            per_request = sum(r[f"{s}_ms"] for r in rounds) / len(rounds)
            assert m["round_cost_ms"][s] == pytest.approx(per_request, rel=1e-9, abs=1e-12)
    assert m["temp_kv_bytes_peak"] == m["temp_kv_bytes_formula"]
    greedy = rec["axes"]["temperature"] == 0.0
    assert m["greedy_identical"] is (True if greedy else None)
    if greedy:
        assert all(o["ar_token_ids"] == o["spec_token_ids"] for o in outputs)


def test_the_sweep_spans_the_combinations_its_readme_lists():
    df = aggregate(FIXTURE_ROOT)
    assert len(df) == len(RUN_DIRS) and df["run_id"].is_unique
    assert set(df["proposer"]) == {"prompt_lookup", "rest", "draft_model", "hydra"}
    assert set(df["topology"]) == {"sequence", "sequences", "expansion", "cartesian"}
    assert set(df["verifier"]) == {"greedy", "specinfer", "rejection", "typical"}
    assert set(df["temperature"]) == {0.0, 0.7} and set(df["batch_size"]) == {1, 2, 4}
    assert set(df["section"]) == {"exact", "ungated", "heuristic", "cpu_budget_artifact"}
    assert (df["section"] == "exact").sum() >= 6
    cats = {p["category"] for r in df["per_prompt"] for p in json.loads(r)}
    assert cats == {"code", "chat"}
